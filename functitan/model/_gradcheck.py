"""``gradcheck``: a model's one-step loss and gradients under each parallel layout against one process.

A model is correct under a layout when every parameter's gradient equals the single-process gradient (up to
the reordering of floating-point sums). This runs that comparison on gloo processes of this machine and
reports every parameter that differs, so a user can check their own model before a long run::

    functitan gradcheck --model.name=path/to/my_model.py --model.flavor=tiny
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..random import fold_in, key
from ..tree import flatten_with_names
from ._model import Model
from ._param import Param, constant, init, is_param, normal
from ._resolve import load_model

__all__ = ["gradcheck", "GRADCHECK_LAYOUTS"]

# name -> (mesh degrees, sequence parallel)
GRADCHECK_LAYOUTS: dict[str, tuple[dict[str, int], bool]] = {
    "ddp": ({"dp_replicate": 2, "dp_shard": 1}, False),
    "fsdp": ({"dp_shard": 2}, False),
    "hsdp": ({"dp_replicate": 2, "dp_shard": 2}, False),
    "tp": ({"tp": 2, "dp_shard": 1}, False),
    "tp_sp": ({"tp": 2, "dp_shard": 1}, True),
    "fsdp_tp": ({"dp_shard": 2, "tp": 2}, False),
    "fsdp_tp_sp": ({"dp_shard": 2, "tp": 2}, True),
}


def _declaration(model: Model, cfg: Any) -> Any:
    """The model's declaration with constant initializers (zero biases, unit norm weights) drawn around their
    value instead: a bias added twice or a norm weight used on the wrong shard changes nothing while it is 0 or 1."""
    from ..tree import map_with_names

    def one(_: str, p: Param) -> Param:
        return Param(p.shape, p.names, normal(0.1, p.init.value)) if isinstance(p.init, constant) else p

    return map_with_names(one, model.params(cfg), is_leaf=is_param)


def _batch(vocab: int, batch: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    t = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def _setup(name: str, flavor: str, overrides: Mapping[str, Any]) -> tuple[Model, Any]:
    model = load_model(name)
    return model, model.config(flavor, **dict(overrides))


def _loss_and_grads(model: Model, cfg: Any, params: Any, batch: Any, layout: Any) -> tuple[Tensor, Tensor | None, Any]:
    """``(loss or TokenLoss sum, TokenLoss count or None, grads of the first)`` of one (local) batch."""
    from .._loss import TokenLoss, split_aux
    from ..transforms import value_and_grad

    loss, grads = value_and_grad(lambda p, b: split_aux(model.loss(p, b, cfg, layout))[0])(params, batch)
    if isinstance(loss, TokenLoss):
        return loss.sum.float(), loss.count.float(), grads
    return loss.float(), None, grads


def _worker(
    name: str, flavor: str, overrides: Mapping[str, Any], layouts: Sequence[str], batch: int, seq_len: int, seed: int
) -> dict[str, Any]:
    """``{layout: (loss, full grads on rank 0) or (None, "Error: message")}``: a layout that raises on every rank
    is reported as that layout's error and the next one runs."""
    out: dict[str, Any] = {}
    for lname in layouts:
        try:
            out[lname] = _one_layout(name, flavor, overrides, lname, batch, seq_len, seed)
        except Exception as e:  # noqa: BLE001  (any error of the user's model under this layout is the report)
            out[lname] = (None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": "))
    return out


def _one_layout(
    name: str, flavor: str, overrides: Mapping[str, Any], lname: str, batch: int, seq_len: int, seed: int
) -> tuple[float, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ..mesh import make_mesh
    from ..sharding import Layout, default_rules, place
    from ._param import specs

    model, cfg = _setup(name, flavor, overrides)
    decl = _declaration(model, cfg)
    degrees, sp = GRADCHECK_LAYOUTS[lname]
    mesh = make_mesh(**degrees, device="cpu")
    layout = Layout(mesh, default_rules(sequence_parallel=sp))
    if model.check_layout is not None:
        model.check_layout(cfg, tp=degrees.get("tp", 1), seq_len=seq_len, sequence_parallel=layout.sequence_parallel)
    params = place(init(decl, fold_in(key(seed), "params")), specs(decl), layout.rules, mesh)
    full = _batch(cfg.vocab_size, batch, seq_len, seed)
    b = {k: v.chunk(layout.dp_size)[layout.dp_rank] for k, v in full.items()}
    loss, count, grads = _loss_and_grads(model, cfg, params, b, layout)
    # as the train step: ranks that share a batch hold the same values, so world means are data-parallel means; a
    # TokenLoss's gradient (of its sum, averaged over data-parallel ranks) is divided by the mean count
    stats = torch.stack([loss, count if count is not None else torch.ones(())])
    dist.all_reduce(stats)
    stats /= dist.get_world_size()
    scale = 1.0 / stats[1].item() if count is not None else 1.0
    named = {n: (g.full_tensor() if isinstance(g, DTensor) else g) * scale for n, g in flatten_with_names(grads)[0]}
    return stats[0].item() * scale, named if dist.get_rank() == 0 else None


def gradcheck(
    model: str,
    *,
    flavor: str = "debug",
    overrides: Mapping[str, Any] | None = None,
    layouts: Sequence[str] = ("fsdp", "hsdp", "tp", "tp_sp"),
    batch: int = 4,
    seq_len: int = 16,
    seed: int = 0,
    atol: float = 1e-6,
    rtol: float = 1e-4,
) -> dict[str, dict[str, Any]]:
    """Compare one step's loss and gradients under ``layouts`` with one process.

    Params come from the model's declaration, except that constant initializers (zero biases, unit norm
    weights) are drawn as ``normal(0.1, value)``, so a bias added on every rank shows in the loss.

    Args:
        model: the model as ``--model.name`` spells it (a plugin, module or file path: the worker processes
            resolve it again, so a Model value defined in ``__main__`` cannot be checked).
        flavor, overrides: the model config (``Model.config(flavor, **overrides)``); keep it tiny.
        layouts: names from ``GRADCHECK_LAYOUTS``; 2-rank layouts run together on 2 processes, 4-rank ones on 4.
        batch, seq_len: the global batch (split over data-parallel ranks) and the sequence length.
        atol, rtol: a param differs when ``max|g - g_ref| > atol + rtol * max|g_ref|``: relative to the size of its
            own gradient (fresh models have gradients of 1e-4 and less, where an absolute tolerance sees nothing),
            and far above the rounding of collectives that sum in another order.

    Returns:
        ``{layout: {what: max abs difference}}`` with only the entries beyond tolerance (``"loss"`` or a
        param's dotted name); an empty dict for every layout means the model is correct under all of them. A
        layout that raises is reported as ``{"error": "ValueError: ..."}`` and the other layouts still run. A
        loss returning ``TokenLoss`` is normalised as the train step does (by the count over data-parallel ranks),
        and a ``(loss, aux)`` pair is checked on its loss.
    """
    from ..sharding import Layout
    from ..testing import run_distributed

    overrides = dict(overrides or {})
    unknown = [n for n in layouts if n not in GRADCHECK_LAYOUTS]
    if unknown:
        raise ValueError(f"gradcheck layouts {unknown} are unknown; choose from {sorted(GRADCHECK_LAYOUTS)}")
    m, cfg = _setup(model, flavor, overrides)
    params = init(_declaration(m, cfg), fold_in(key(seed), "params"))
    ref_sum, ref_count, ref_grads = _loss_and_grads(
        m, cfg, params, _batch(cfg.vocab_size, batch, seq_len, seed), Layout()
    )
    scale = 1.0 / ref_count.item() if ref_count is not None else 1.0
    ref_loss = ref_sum.item() * scale
    ref = {n: g * scale for n, g in flatten_with_names(ref_grads)[0]}
    by_world: dict[int, list[str]] = {}
    for n in layouts:
        degrees = GRADCHECK_LAYOUTS[n][0]
        world = 1
        for d in degrees.values():
            world *= d
        by_world.setdefault(world, []).append(n)
    report: dict[str, dict[str, Any]] = {}
    for world, names in sorted(by_world.items()):
        results = run_distributed(_worker, world, model, flavor, overrides, names, batch, seq_len, seed)[0]
        for lname, (loss, grads) in results.items():
            if loss is None:  # the layout raised: its error is the report
                report[lname] = {"error": grads}
                continue
            bad: dict[str, Any] = {}
            if abs(loss - ref_loss) > atol + rtol * abs(ref_loss):
                bad["loss"] = abs(loss - ref_loss)
            for pname, g in grads.items():
                r = ref[pname]
                err = float((g - r).abs().max())
                if err > atol + rtol * float(r.abs().max()):
                    bad[pname] = err
            report[lname] = bad
    return report
