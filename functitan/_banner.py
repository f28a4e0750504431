"""What a run prints before its first step: the model, its size, the layout per mesh axis, this rank's state
memory, and where the records go. A user reads it to catch a wrong flavor, a missed degree or a full disk
before the first step spends minutes; ``functitan train --dry-run`` prints it, adds the planner's per-rank peak
(``planned_peak``: the step traced on meta tensors, activations included), and stops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from .mesh import AXES

__all__ = ["banner", "state_bytes", "planned_peak"]


def state_bytes(tree: Any) -> int:
    """Bytes this rank holds for ``tree``'s tensors (a DTensor counts its local shard)."""
    total = 0
    for x in optree.tree_leaves(tree, none_is_leaf=False):
        if isinstance(x, DTensor):
            x = x.to_local()
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
    return total


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _size(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def banner(
    *,
    model: str,
    flavor: str,
    n_params: int,
    degrees: dict[str, int],
    training: Any,
    params: Any,
    opt_state: Any,
    run_dir: Path,
    dry_run: bool = False,
    expert_span: bool = False,
) -> list[str]:
    """The lines (rank 0 prints them). ``degrees``: the mesh's size per axis; ``params`` / ``opt_state``: this
    rank's placed state. Gradients are counted as one more copy of the params (their dtype and sharding);
    activations are not counted: ``functitan plan`` traces them. ``expert_span``: expert parallelism spans cp
    and tp (``functitan.mesh.expert_axis``)."""
    world = 1
    for a in AXES:
        world *= degrees.get(a, 1)
    # as configured: ep borrows its ranks from dp_shard x cp x tp; the mesh's ep axis holds those of dp_shard,
    # and its dp_shard axis what ep left
    borrowed = degrees.get("ep", 1)
    ep = borrowed * degrees.get("cp", 1) * degrees.get("tp", 1) if expert_span else borrowed
    shown = {**degrees, "dp_shard": degrees.get("dp_shard", 1) * borrowed, "ep": ep}
    layout = " ".join(f"{a}={shown[a]}" for a in AXES if shown.get(a, 1) > 1) or "one process"
    p, o = state_bytes(params), state_bytes(opt_state)
    where = (
        "nothing is written (--dry-run)" if dry_run else f"records in {run_dir}/ (tensorboard --logdir {run_dir}/tb)"
    )
    return [
        f"functitan: model {model} ({flavor}): {_count(n_params)} parameters",
        f"functitan: layout {layout} on {world} process{'es' if world > 1 else ''}; {training.batch_size} "
        f"sequences x {training.seq_len} tokens per step, {training.microbatches} microbatch(es) per rank; "
        f"remat {training.remat}, params {training.param_dtype}",
        f"functitan: rank 0 holds {_size(p)} params + {_size(p)} grads + {_size(o)} optimizer state = "
        f"{_size(2 * p + o)} before activations (functitan plan traces those)",
        f"functitan: {where}",
    ]


def planned_peak(cfg: Any, model: Any, model_cfg: Any, *, world: int) -> str:
    """The line with rank 0's peak memory in one step of ``cfg`` at ``world`` ranks, as ``functitan plan``
    predicts it: the trainer's step traced on meta tensors with a fake process group (no memory, no
    communication; seconds for a large model). Called with no process group in this process."""
    from .plan import MOE_LOAD, trace_rank

    try:
        peak = trace_rank(cfg, model, model_cfg, world=world, rank=0, moe_load=MOE_LOAD).peak
    except Exception as e:  # noqa: BLE001 - the line is advice: a step the planner cannot trace still trains
        why = " ".join(str(e).split())[:200]
        return f"functitan: the planner could not trace this step ({type(e).__name__}: {why}); functitan plan shows it"
    return (
        f"functitan: planner: rank 0 peaks at {_size(peak)} in a step (params, grads, optimizer state and "
        f"activations; the step traced on meta tensors at {world} process{'es' if world > 1 else ''})"
    )
