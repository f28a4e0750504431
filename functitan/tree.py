"""Pytree helpers over optree: key paths, dotted names, structure checks, partition/combine.

Every tree in functitan (params, specs, grads, optimizer state, train state) is a plain optree pytree:
nested dicts, lists, tuples and NamedTuples whose leaves are tensors (or other objects). The one thing these
helpers add is naming: a leaf is known by its dotted key path (``layers.3.attn.wq``), and every error that
concerns a leaf names that path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

__all__ = [
    "keystr",
    "leaf_names",
    "flatten_with_names",
    "map_with_names",
    "check_same_structure",
    "tree_map",
    "tree_leaves",
    "tree_structure",
    "tree_unflatten",
    "partition",
    "combine",
]

tree_map = optree.tree_map
tree_leaves = optree.tree_leaves
tree_structure = optree.tree_structure
tree_unflatten = optree.tree_unflatten


def _entry_name(entry: Any) -> str:
    for attr in ("field", "key", "index", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(getattr(entry, "entry", entry))


def keystr(accessor: Any) -> str:
    """The dotted name of an optree accessor or a path tuple: ``('layers', 3, 'attn', 'wq') -> layers.3.attn.wq``.

    NamedTuple fields are named by their field (``mu``), not by position, so optimizer-state paths read
    ``opt_state.1.mu.layers.0.attn.wq``.
    """
    if isinstance(accessor, tuple) and not isinstance(accessor, optree.PyTreeAccessor):
        return ".".join(str(k) for k in accessor)
    return ".".join(_entry_name(e) for e in accessor)


def leaf_names(tree: Any, *, is_leaf: Callable[[Any], bool] | None = None) -> list[str]:
    """Dotted names of the leaves of ``tree`` in flatten order."""
    accessors = optree.tree_flatten_with_accessor(tree, is_leaf=is_leaf)[0]
    return [keystr(a) for a in accessors]


def flatten_with_names(
    tree: Any, *, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[tuple[str, Any]], optree.PyTreeSpec]:
    """Flatten to ``[(dotted_name, leaf), ...]`` and the treedef (for ``tree_unflatten``)."""
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(tree, is_leaf=is_leaf)
    return [(keystr(a), leaf) for a, leaf in zip(accessors, leaves)], treedef


def map_with_names(
    fn: Callable[..., Any],
    tree: Any,
    *rest: Any,
    is_leaf: Callable[[Any], bool] | None = None,
    what: tuple[str, ...] = (),
) -> Any:
    """``tree_map`` whose function also receives the dotted name: ``fn(name, leaf, *rest_leaves)``.

    The trees in ``rest`` must have the structure of ``tree`` (``what`` names them in the error); a mismatch
    raises a ValueError that names the first differing key path and shows both structures.
    """
    named, treedef = flatten_with_names(tree, is_leaf=is_leaf)
    label_a = what[0] if what else "first tree"
    rest_leaves = []
    for i, other in enumerate(rest):
        label_b = what[i + 1] if len(what) > i + 1 else f"tree {i + 2}"
        rest_leaves.append(_leaves_like(treedef, other, tree, label_a, label_b, is_leaf))
    out = [fn(name, leaf, *(r[j] for r in rest_leaves)) for j, (name, leaf) in enumerate(named)]
    return optree.tree_unflatten(treedef, out)


def _leaves_like(treedef, other, reference, label_a, label_b, is_leaf) -> list[Any]:
    try:
        return treedef.flatten_up_to(other)
    except (ValueError, TypeError):
        check_same_structure(reference, other, label_a, label_b, is_leaf=is_leaf)
        raise


def _first_difference(a: Any, b: Any, path: tuple, is_leaf) -> tuple[tuple, str] | None:
    a_leaf = optree.tree_structure(a, is_leaf=is_leaf).is_leaf()
    b_leaf = optree.tree_structure(b, is_leaf=is_leaf).is_leaf()
    if a_leaf and b_leaf:
        return None
    if a_leaf != b_leaf:
        kind_a = "a leaf" if a_leaf else f"a {type(a).__name__}"
        kind_b = "a leaf" if b_leaf else f"a {type(b).__name__}"
        return path, f"{kind_a} vs {kind_b}"
    if type(a) is not type(b):
        return path, f"{type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        ka, kb = set(a), set(b)
        if ka != kb:
            only_a, only_b = sorted(map(str, ka - kb)), sorted(map(str, kb - ka))
            return path, f"keys only in the first: {only_a}, keys only in the second: {only_b}"
        items = [(k, a[k], b[k]) for k in sorted(a, key=str)]
    elif hasattr(a, "_fields"):
        items = [(f, getattr(a, f), getattr(b, f)) for f in a._fields]
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return path, f"length {len(a)} vs {len(b)}"
        items = list(zip(range(len(a)), a, b))
    else:
        return path, f"{type(a).__name__} nodes differ"
    for k, ca, cb in items:
        found = _first_difference(ca, cb, (*path, k), is_leaf)
        if found is not None:
            return found
    return None


def check_same_structure(
    a: Any, b: Any, what_a: str = "first tree", what_b: str = "second tree", *, is_leaf=None
) -> None:
    """Raise ValueError naming the first key path where ``a`` and ``b`` differ, with both structures shown.

    Example message::

        params and specs differ at 'layers.1.attn': keys only in the first: ['wq'], keys only in the
        second: ['w_q']
          params: {'embed': *, 'layers': [{'attn': {...}}, ...]}
          specs:  ...
    """
    sa = optree.tree_structure(a, is_leaf=is_leaf)
    sb = optree.tree_structure(b, is_leaf=is_leaf)
    if sa == sb:
        return
    found = _first_difference(a, b, (), is_leaf)
    where, why = found if found is not None else ((), "node types differ")
    name = ".".join(map(str, where)) or "<root>"
    raise ValueError(
        f"{what_a} and {what_b} differ at {name!r}: {why}.\n"
        f"  {what_a}: {_short(sa)}\n  {what_b}: {_short(sb)}\n"
        f"Fix: make the two trees mirror each other (same keys, same list lengths)."
    )


def _short(spec: optree.PyTreeSpec, limit: int = 600) -> str:
    s = str(spec)
    s = s[len("PyTreeSpec(") : -1] if s.startswith("PyTreeSpec(") else s
    return s if len(s) <= limit else s[: limit - 3] + "..."


def partition(tree: Any, keep: Callable[[str, Any], bool]) -> tuple[Any, Any]:
    """Split ``tree`` into (kept, rest) trees of the same structure, with ``None`` where a leaf went elsewhere.

    ``keep(name, leaf)`` decides; ``combine(kept, rest)`` undoes it (as in equinox).
    """
    kept = map_with_names(lambda n, x: x if keep(n, x) else None, tree)
    rest = map_with_names(lambda n, x: None if keep(n, x) else x, tree)
    return kept, rest


def combine(*trees: Any) -> Any:
    """Merge trees produced by ``partition``: for each leaf, the first non-None value."""

    def pick(*xs: Any) -> Any:
        for x in xs:
            if x is not None:
                return x
        return None

    return optree.tree_map(pick, *trees, none_is_leaf=True)
