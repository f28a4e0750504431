"""``gradcheck``: a model's one-step loss and gradients under each parallel layout against one process.

A model is correct under a layout when every parameter's gradient equals the single-process gradient (up to
the reordering of floating-point sums). This runs that comparison on gloo processes of this machine and
reports every parameter that differs, so a user can check their own model before a long run::

    functitan gradcheck --model.name=path/to/my_model.py --model.flavor=tiny
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..job_config import DEFAULT_FLAVOR
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
    "pp_1f1b": ({"pp": 2, "dp_shard": 1}, False),
    "pp_zb_v": ({"pp": 2, "dp_shard": 1}, False),
    "cp": ({"cp": 2, "dp_shard": 1}, False),
    "cp_tp_sp": ({"cp": 2, "tp": 2, "dp_shard": 1}, True),
    # expert parallelism borrows its ranks from dp_shard x cp x tp (a MoE model's routed experts over ep)
    "ep": ({"dp_shard": 2, "ep": 2}, False),
    "fsdp_ep": ({"dp_shard": 4, "ep": 2}, False),  # dense params FSDP over dp_shard_ep, experts over efsdp 2
    "ep4": ({"dp_shard": 4, "ep": 4}, False),
    "hsdp_ep": ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, False),
    "ep_tp": ({"dp_shard": 1, "ep": 2, "tp": 2}, False),  # ep is tp's ranks, which share their tokens out
    "ep_tp_sp": ({"dp_shard": 2, "ep": 2, "tp": 2}, True),  # ep is tp's ranks; experts FSDP over dp_shard
    "ep4_tp_sp": ({"dp_shard": 2, "ep": 4, "tp": 2}, True),  # ep spans dp_shard and tp
    "cp_ep": ({"dp_shard": 2, "ep": 2, "cp": 2}, False),  # ep is cp's ranks; experts FSDP over dp_shard
    "ep4_cp_tp_sp": ({"dp_shard": 1, "ep": 4, "cp": 2, "tp": 2}, True),  # ep spans cp and tp
    "pp_ep": ({"pp": 2, "dp_shard": 2, "ep": 2}, False),
    "pp_fsdp_zb": ({"pp": 2, "dp_shard": 2}, False),
}
# the pipeline layouts: (schedule, microbatches); the model's own Model.stages split it (zb_v: 2 stages a rank)
_PIPELINES = {"pp_1f1b": ("1f1b", 2), "pp_zb_v": ("zb_v", 2), "pp_ep": ("1f1b", 2), "pp_fsdp_zb": ("zb_h1", 2)}


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


def _trainer(
    model: Model, cfg: Any, decl: Any, seed: int, lname: str | None, seq_len: int
) -> tuple[Any, Any, Any, Any]:
    """``(train step, state, layout, full params)`` of SGD at lr 1 under layout ``lname`` (None: one process):
    the trainer's own step, so a TokenLoss is normalised and a pipeline split as in training."""
    from .. import optim, pipeline
    from .._loss import split_aux
    from ..job_config import OptimizerConfig
    from ..mesh import make_mesh
    from ..moe import LoadBalance
    from ..sharding import Layout, default_rules, place
    from ..step import make_train_step
    from ..train_state import TrainState
    from ..transforms import value_and_grad
    from ._param import specs

    full = init(decl, fold_in(key(seed), "params"))
    across = None
    if lname is None:
        layout, params = Layout(), full
        grad_fn = value_and_grad(lambda p, b: split_aux(model.loss(p, b, cfg, layout))[0])
    else:
        degrees, sp = GRADCHECK_LAYOUTS[lname]
        mesh = make_mesh(**degrees, device="cpu")
        rules = default_rules(sequence_parallel=sp)
        if lname in _PIPELINES:
            if model.stages is None:
                raise ValueError(f"model {model.name!r} declares no pipeline stages (Model.stages); drop {lname}")
            schedule, microbatches = _PIPELINES[lname]
            layout = Layout(pipeline.stage_mesh(mesh), pipeline.stage_rules(rules))
            stages = pipeline.make_stages(
                model.stages(cfg, layout, seq_len=seq_len), pipeline.make_schedule(schedule, 2, microbatches), mesh
            )
            params = pipeline.place_stages(full, specs(decl), rules, stages)
            grad_fn, across = pipeline.pipeline_grad_fn(stages), stages.pp_group
        else:
            layout = Layout(mesh, rules)
            if model.check_layout is not None:
                model.check_layout(cfg, tp=degrees.get("tp", 1), seq_len=seq_len, sequence_parallel=sp)
            params = place(full, specs(decl), rules, mesh)
            grad_fn = value_and_grad(lambda p, b: split_aux(model.loss(p, b, cfg, layout))[0])
    opt = optim.sgd(1.0)
    balance = LoadBalance.from_specs(specs(decl), OptimizerConfig.moe_bias_rate)  # a MoE bias moves as in training
    step = make_train_step(grad_fn, opt, norm_across=across, balance=balance)
    state = TrainState(step=0, params=params, opt_state=opt.init(params), data_state=None, rng=0)
    return step, state, layout, full


def _train(
    name: str,
    flavor: str,
    overrides: Mapping[str, Any],
    lname: str | None,
    batch: int,
    seq_len: int,
    seed: int,
    steps: int,
) -> tuple[list[float], dict[str, Tensor], dict[str, Tensor]]:
    """``(loss of each step, step 1's gradient, the params' change over all steps)`` of this rank's params (full
    tensors; a pipeline rank: its stages' params), SGD at lr 1, so the gradient is ``before - after``."""
    from torch.distributed.tensor import DTensor

    model, cfg = _setup(name, flavor, overrides)
    step, state, layout, init_params = _trainer(model, cfg, _declaration(model, cfg), seed, lname, seq_len)
    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach()  # noqa: E731
    named = lambda s: {n: full(t) for n, t in flatten_with_names(s.params)[0]}  # noqa: E731
    mine = {n for n, _ in flatten_with_names(state.params)[0]}  # a pipeline rank's: its stages' params only
    first = {n: t for n, t in flatten_with_names(init_params)[0] if n in mine}
    losses: list[float] = []
    for i in range(steps):
        b = {
            k: v.chunk(layout.dp_size)[layout.dp_rank]
            for k, v in _batch(cfg.vocab_size, batch, seq_len, seed + i).items()
        }
        state, metrics = step(state, b)
        losses.append(metrics["loss"])
        if i == 0:
            after = named(state)
            grads = {n: first[n] - after[n] for n in first}
    last = named(state)
    return losses, grads, {n: first[n] - last[n] for n in first}


def _worker(
    name: str,
    flavor: str,
    overrides: Mapping[str, Any],
    layouts: Sequence[str],
    batch: int,
    seq_len: int,
    seed: int,
    steps: int,
) -> dict[str, Any]:
    """``{layout: (losses, grads, params) or (None, "Error: message", None)}``: rank 0's full tensors (every
    rank's own for a pipeline layout); a layout that raises is reported as its error and the next one runs."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for lname in layouts:
        try:
            losses, grads, params = _train(name, flavor, overrides, lname, batch, seq_len, seed, steps)
            keep = dist.get_rank() == 0 or lname in _PIPELINES
            out[lname] = (losses, grads if keep else None, params if keep else None)
        except Exception as e:  # noqa: BLE001  (any error of the user's model under this layout is the report)
            out[lname] = (None, _one_line(e), None)
    return out


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def gradcheck(
    model: str,
    *,
    flavor: str = DEFAULT_FLAVOR,
    overrides: Mapping[str, Any] | None = None,
    layouts: Sequence[str] = ("fsdp", "hsdp", "tp", "tp_sp"),
    batch: int = 4,
    seq_len: int = 16,
    seed: int = 0,
    steps: int = 1,
    atol: float = 1e-6,
    rtol: float = 1e-4,
) -> dict[str, dict[str, Any]]:
    """Compare one step's loss and gradients (and with ``steps > 1`` every step's loss and the params after the
    last) under ``layouts`` with one process.

    Each layout first passes the trainer's own name check for its tp and sequence parallelism
    (``check_names``): a misnamed contraction, a raw contraction of a tp-sharded dim or a wrong-dim bias is
    reported as that error, by name, instead of the shape error or wrong gradient it would cause. Then the
    trainer's step (SGD at lr 1) runs on gloo processes of this machine; pipeline layouts split the model with its
    own ``Model.stages``, so a stage split that drops or repeats a piece shows as the params it gets wrong.
    Params come from the model's declaration, except that constant initializers (zero biases, unit norm
    weights) are drawn as ``normal(0.1, value)``, so a bias added on every rank shows in the loss.

    Args:
        model: the model as ``--model.name`` spells it (a plugin, module or file path: the worker processes
            resolve it again, so a Model value defined in ``__main__`` cannot be checked).
        flavor, overrides: the model config (``Model.config(flavor, **overrides)``); keep it tiny.
        layouts: names from ``GRADCHECK_LAYOUTS``; 2-rank layouts run together on 2 processes, 4-rank ones on 4.
            ``pp_1f1b`` and ``pp_zb_v``: PP 2 with 2 microbatches (zb_v: 4 stages, so at least 4 blocks);
            ``pp_ep``: PP 2 (1F1B) x ep 2 on 4 ranks; ``pp_fsdp_zb``: PP 2 (ZB-H1) x FSDP 2.
        batch, seq_len: the global batch (split over data-parallel ranks) and the sequence length.
        steps: optimizer steps (batch ``seed + i`` for step ``i``); beyond 1 also ``"loss@<step>"`` and
            ``"<param>@<steps>"`` (each param's change over all steps) are compared.
        atol, rtol: a param differs when ``max|g - g_ref| > atol + rtol * max|g_ref|``: relative to the size of its
            own gradient (fresh models have gradients of 1e-4 and less, where an absolute tolerance sees nothing),
            and far above the rounding of collectives that sum in another order.

    Returns:
        ``{layout: {what: max abs difference}}`` with only the entries beyond tolerance (``"loss"`` or a
        param's dotted name); an empty dict for every layout means the model is correct under all of them. A
        layout that raises (or fails the name check) is reported as ``{"error": "ValueError: ..."}`` and the
        other layouts still run. A loss returning ``TokenLoss`` is normalised as the train step does, and a
        ``(loss, aux)`` pair is checked on its loss.
    """
    from ..testing import run_distributed
    from ._check import check_names

    overrides = dict(overrides or {})
    unknown = [n for n in layouts if n not in GRADCHECK_LAYOUTS]
    if unknown:
        raise ValueError(f"gradcheck layouts {unknown} are unknown; choose from {sorted(GRADCHECK_LAYOUTS)}")
    if steps < 1:
        raise ValueError(f"gradcheck steps={steps}: must be >= 1, e.g. steps=3")
    m, cfg = _setup(model, flavor, overrides)
    report: dict[str, dict[str, Any]] = {}
    by_world: dict[int, list[str]] = {}
    for n in layouts:
        degrees, sp = GRADCHECK_LAYOUTS[n]
        try:
            check_names(m, cfg, seq_len=seq_len, tp=degrees.get("tp", 1), sequence_parallel=sp)
        except ValueError as e:
            report[n] = {"error": _one_line(e)}
            continue
        by_world.setdefault(math.prod(d for a, d in degrees.items() if a != "ep"), []).append(n)  # ep borrows
    if not by_world:
        return {n: report[n] for n in layouts}
    ref_losses, ref_grads, ref_params = _train(model, flavor, overrides, None, batch, seq_len, seed, steps)
    for world, names in sorted(by_world.items()):
        ranks = run_distributed(_worker, world, model, flavor, overrides, names, batch, seq_len, seed, steps)
        for lname in names:
            losses, grads, params = ranks[0][lname]
            if losses is None:  # the layout raised: its error is the report
                report[lname] = {"error": grads}
                continue
            for other in ranks[1:] if lname in _PIPELINES else ():  # each pipeline rank holds its stages' params
                grads, params = {**grads, **other[lname][1]}, {**params, **other[lname][2]}
            report[lname] = _differences(losses, grads, params, ref_losses, ref_grads, ref_params, steps, atol, rtol)
    return {n: report[n] for n in layouts}


def _differences(
    losses: list[float],
    grads: dict[str, Tensor],
    params: dict[str, Tensor],
    ref_losses: list[float],
    ref_grads: dict[str, Tensor],
    ref_params: dict[str, Tensor],
    steps: int,
    atol: float,
    rtol: float,
) -> dict[str, float]:
    bad: dict[str, float] = {}
    for i, (loss, ref) in enumerate(zip(losses, ref_losses)):
        if abs(loss - ref) > atol + rtol * abs(ref):
            bad["loss" if i == 0 else f"loss@{i + 1}"] = abs(loss - ref)
    compared = [("", grads, ref_grads)] + ([(f"@{steps}", params, ref_params)] if steps > 1 else [])
    for suffix, got, want in compared:
        for pname, r in want.items():
            if pname not in got:
                bad[pname + suffix] = float("inf")  # no rank holds it: a stage split that drops it
                continue
            err = float((got[pname] - r).abs().max())
            if err > atol + rtol * float(r.abs().max()):
                bad[pname + suffix] = err
    return bad
