"""Zero-bubble's split backward without recomputation: B computes the input gradient and keeps, at every
node where a weight's branch joins the activation path, the gradient flowing into it; W starts from those
nodes (``torch.autograd.graph.GradientEdge``) and walks only the weight branches.

Why: ``autograd.grad(out, weights, dout)`` from the stage output in W re-runs the whole activation-gradient
chain that B already ran (a second backward minus nothing). The zero-bubble paper (arXiv 2401.10241) splits
each matmul's backward into ``dx = dy W`` (B) and ``dW = dy^T x`` (W); this is that split found on the autograd
graph, as ``torch.distributed.pipelining._backward`` does: for a matmul ``x @ w.T`` the joining node is the
matmul's backward node, B's pre-hook keeps its ``dy``, and W's ``autograd.grad`` from that edge computes only
``dW`` (the ``x`` branch leads to no requested weight unless the weights share a node, see below).

Weights that reach the activation path through one shared node (FSDP's bucketed all-gather feeds a whole
block) form one group and get one ``autograd.grad`` call, so the shared node's backward (the reduce-scatter)
runs once. Within such a group a joining node upstream of another is given its kept gradient by a pre-hook, so
nothing is counted twice; its ``dx`` branch is then recomputed inside the group (one block), not the stage.

Direct W: where a weight's branch is only the weight itself (a plain leaf, maybe through a transpose) and
its joining node a matmul or an elementwise multiply (a projection, a norm's scale), W computes the
contraction from the node's saved input and the kept gradient (``dW = dy^T x``; ``sum(dy * x)``) instead of
one ``autograd.grad`` per weight: the same numbers (the formula autograd's node runs) without an engine call
and its walk of the graph below the node, which cost about a fifth of W on the CPU benchmark's stage
(``benchmarks/pipeline_vs_torch.py``). Anything else (DTensors, casts, shared nodes) takes the engine.
"""

from __future__ import annotations

import collections

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

__all__ = ["input_grad"]


def _graph(root: Node) -> tuple[dict[Node, list[Node]], dict[int, Node]]:
    """Over the graph below ``root``: node -> the nodes consuming its output (reverse edges), and
    id(leaf tensor) -> its AccumulateGrad node (found by walking, not by a ``view_as`` of the leaf, which would
    dispatch a DTensor op for a DTensor leaf)."""
    rev: dict[Node, list[Node]] = collections.defaultdict(list)
    leaves: dict[int, Node] = {}
    seen, queue = {root}, collections.deque([root])
    while queue:
        node = queue.popleft()
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves[id(variable)] = node
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            rev[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return rev, leaves


def _closure(starts: list[Node], rev: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """(nodes reached from ``starts`` along reverse edges without entering ``stop``, the ``stop`` nodes met)."""
    seen, met = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for parent in rev.get(queue.popleft(), ()):
            if parent in seen:
                continue
            if parent in stop:
                met.add(parent)
                continue
            seen.add(parent)
            queue.append(parent)
    return seen, met


def _leaf_of(node: Node | None) -> Tensor | None:
    """The leaf tensor an AccumulateGrad node feeds, else None."""
    return getattr(node, "variable", None)


def _direct(node: Node, kept: tuple[Tensor | None, ...], w: Tensor) -> Tensor | None:
    """``w``'s gradient from one joining node's kept output gradient and saved input, when the weight's branch
    is the bare leaf (``x @ w.T``, ``x @ w``, ``x * w``); None where the engine must do it."""
    g = kept[0] if len(kept) == 1 else None
    if g is None or type(g) is not Tensor or type(w) not in (Tensor, torch.nn.Parameter):
        return None  # subclasses (DTensor) keep their own dispatch: the engine
    name, nxt = type(node).__name__, node.next_functions
    if name == "MmBackward0" and len(nxt) == 2 and nxt[1][0] is not None:
        x = node._saved_self  # type: ignore[attr-defined]
        if type(x) is not Tensor or x.dtype != g.dtype:
            return None
        if type(nxt[1][0]).__name__ == "TBackward0" and _leaf_of(nxt[1][0].next_functions[0][0]) is w:
            dw = g.t().mm(x)  # y = x @ w.T
        elif _leaf_of(nxt[1][0]) is w:
            dw = x.t().mm(g)  # y = x @ w
        else:
            return None
    elif name == "MulBackward0" and len(nxt) == 2:
        if _leaf_of(nxt[1][0]) is w and _leaf_of(nxt[0][0]) is not w:
            x = node._saved_self  # type: ignore[attr-defined]
        elif _leaf_of(nxt[0][0]) is w and _leaf_of(nxt[1][0]) is not w:
            x = node._saved_other  # type: ignore[attr-defined]
        else:
            return None
        if type(x) is not Tensor or x.dtype != g.dtype:
            return None
        dw = (g * x).sum_to_size(w.shape)
    else:
        return None
    return dw if dw.shape == w.shape and dw.dtype == w.dtype else None


class WeightGrad:
    """The W pass kept by ``input_grad``: calling it returns the weights' gradients (None where unused)."""

    def __init__(self, weights: list[Tensor], groups: list[tuple[list[int], list[Node]]]):
        self.weights, self.groups = weights, groups
        self.kept: dict[Node, tuple[Tensor | None, ...]] = {}

    def __call__(self) -> list[Tensor | None]:
        out: list[Tensor | None] = [None] * len(self.weights)
        for idx, joins in self.groups:
            if len(idx) == 1:  # a weight of its own: each joining node's share directly, if every one allows
                with torch.no_grad():  # the saved inputs require grad; a gradient is no graph
                    parts = [_direct(n, self.kept[n], self.weights[idx[0]]) for n in joins if n in self.kept]
                if parts and all(p is not None for p in parts):
                    out[idx[0]] = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)  # type: ignore[arg-type]
                    continue
            edges, grads = [], []
            for node in joins:
                for i, g in enumerate(self.kept.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue
            handles = []
            if len(joins) > 1:  # a joining node also reached from another one gets exactly its kept gradient
                handles = [n.register_prehook(lambda _, kept=self.kept.get(n): kept) for n in joins]
            try:
                # the graph is kept for the groups after this one: a group whose joins chain through the
                # activation path (the dx branch inside one block, above) runs that path's nodes, and one of them
                # may be another group's join (Qwen3's replicated q/k norm scales beside an FSDP bucket), whose
                # saved tensors a freeing call would have released. The graph goes when the W pass is dropped.
                dws = torch.autograd.grad(
                    edges, [self.weights[i] for i in idx], grads, allow_unused=True, retain_graph=True
                )
            finally:
                for h in handles:
                    h.remove()
            for i, g in zip(idx, dws):
                out[i] = g
        self.kept.clear()
        return out


def input_grad(
    out: Tensor, inp: Tensor, dout: Tensor | None, weights: list[Tensor]
) -> tuple[Tensor | None, WeightGrad]:
    """B: ``d out / d inp`` (with cotangent ``dout``; None for a scalar loss), and the W pass that gives the
    weights' gradients from what B kept. The graph is retained for W; W frees it."""
    if out.grad_fn is None:
        raise ValueError(
            "input_grad: the stage output does not require grad; a pipeline stage's output must depend on its "
            "input or its params"
        )
    rev, leaves = _graph(out.grad_fn)
    inp_node = inp.grad_fn or leaves.get(id(inp))
    activation_path, _ = _closure([inp_node] if inp_node is not None else [], rev, set())
    # group weights by the joining nodes they reach (union over shared joins)
    owner: dict[Node, int] = {}
    groups: list[tuple[list[int], list[Node]]] = []
    for i, w in enumerate(weights):
        wn = w.grad_fn or leaves.get(id(w))  # None: the stage output does not depend on w
        _, joins = _closure([wn], rev, activation_path) if wn is not None else (set(), set())
        hit = sorted({owner[j] for j in joins if j in owner})
        if hit:
            g = hit[0]
            for other in hit[1:]:  # merge groups joined through this weight
                groups[g][0].extend(groups[other][0])
                groups[g][1].extend(groups[other][1])
                for j in groups[other][1]:
                    owner[j] = g
                groups[other] = ([], [])
            groups[g][0].append(i)
        else:
            g = len(groups)
            groups.append(([i], []))
        for j in joins:
            if j not in owner:
                owner[j] = g
                groups[g][1].append(j)
    wg = WeightGrad(weights, [grp for grp in groups if grp[0]])
    handles = []
    for group_joins in (grp[1] for grp in wg.groups):
        for node in group_joins:

            def keep(grad_outputs: tuple[Tensor | None, ...], node: Node = node) -> None:
                wg.kept[node] = tuple(grad_outputs)

            handles.append(node.register_prehook(keep))
    try:
        (dx,) = torch.autograd.grad(out, [inp], dout, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return dx, wg
