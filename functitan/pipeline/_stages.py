"""Cut a pure-function model into pipeline stages and give each rank only its stages' parameters.

A model is pipelined through a small protocol, `StageModel`: a first piece (tokens -> activation), a run
of blocks (activation -> activation) and a last piece (activation -> mean loss), plus where their params
sit in the tree. The block list is split into `pp * stages_per_rank` contiguous stages balanced by a cost
estimate; the embedding rides on the first stage and the head + loss on the last, which may therefore
hold fewer blocks. Stage s runs on rank `schedule.stage_to_rank[s]` (loop placement for interleaved
schedules, V placement for ZB-V).

A rank's param tree keeps the full model's key paths but only its stages' entries, so names (and
checkpoints) agree with the unpipelined model::

    rank 0 of 2 (stages 0, 2 of 4; 8 layers)    {"embed": ..., "layers": {"0": .., "1": .., "4": .., "5": ..}}
    rank 1                                      {"layers": {"2": .., "3": .., "6": .., "7": ..}, "norm": .., "output": ..}

It is placed with `functitan.sharding.place` on the mesh without the ``pp`` axis, so FSDP and TP on the
other axes compose with the pipeline unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from functitan.mesh import AXES
from functitan.pipeline._schedule import Schedule, split_pairs
from functitan.sharding import Rules, is_spec, place

STAGE_AXES = tuple(a for a in AXES if a != "pp")  # the mesh a stage's params and collectives live on


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageModel:
    """A model as three pure pieces, the protocol the pipeline executor runs.

    Attributes:
        first: ``(params, microbatch) -> x``: the first stage's prologue (e.g. token embedding).
        blocks: ``(block_params: list, x) -> x``: a run of consecutive blocks.
        last: ``(params, x, microbatch) -> loss``: the last stage's epilogue; a 0-d mean loss.
        activation: ``microbatch -> (shape, dtype)`` of ``x`` between stages, so receivers allocate
            buffers without a handshake.
        n_blocks: number of blocks; their params are ``params[blocks_key][i]``.
        block_cost: cost of one block (or one per block), in any unit.
        first_cost, last_cost: cost of ``first`` and ``last`` in the same unit.
        blocks_key: the key of the block list in the param tree.
        first_keys, last_keys: the top-level keys ``first`` and ``last`` read. A key in both (tied
            embeddings) is allowed only when the first and last stages share a rank.
        single_backward: the stage graph allows only one backward pass (selective activation
            checkpointing), so schedules that split backward into B and W cannot run it.
        aux: for ``blocks`` that return ``(x, aux)`` (a MoE layer's load and balance loss): ``(aux, microbatch)
            -> (terms, metrics)``. Each term (0-d, differentiable) joins the loss sum where its stage runs (its
            gradient 1: ``last`` returns a ``TokenLoss``) and is reported as ``TokenLoss(term, the loss's
            tokens)`` under its key; the metrics' ``TokenLoss`` leaves are added over microbatches and stages.
    """

    first: Callable[[Any, Any], Tensor]
    blocks: Callable[[list, Tensor], Tensor]
    last: Callable[[Any, Tensor, Any], Tensor]
    activation: Callable[[Any], tuple[tuple[int, ...], torch.dtype]]
    n_blocks: int
    block_cost: float | Sequence[float] = 1.0
    first_cost: float = 0.0
    last_cost: float = 0.0
    blocks_key: str = "layers"
    first_keys: tuple[str, ...] = ()
    last_keys: tuple[str, ...] = ()
    single_backward: bool = False
    aux: Callable[[Any, Any], tuple[dict[str, Tensor], dict[str, Any]]] | None = None


# ----------------------------------------------------------------------------------------------- split


def balance(
    block_cost: float | Sequence[float],
    n_blocks: int,
    n_stages: int,
    *,
    first_cost: float = 0.0,
    last_cost: float = 0.0,
) -> tuple[range, ...]:
    """Split blocks ``0..n_blocks-1`` into ``n_stages`` contiguous non-empty runs minimizing the costliest stage.

    The first stage also pays ``first_cost`` and the last ``last_cost``. Exact (dynamic programming over
    split points, O(n_stages * n_blocks^2)); ties go to the split that puts blocks on earlier stages.

    >>> balance(1.0, 8, 2, last_cost=2.0)
    (range(0, 5), range(5, 8))

    Raises:
        ValueError: fewer blocks than stages, or a cost list of the wrong length.
    """
    costs = [float(block_cost)] * n_blocks if isinstance(block_cost, (int, float)) else [float(c) for c in block_cost]
    if len(costs) != n_blocks:
        raise ValueError(f"block_cost: got {len(costs)} per-block costs for {n_blocks} blocks; give one per block")
    if n_stages < 1 or n_blocks < n_stages:
        raise ValueError(
            f"cannot split {n_blocks} blocks into {n_stages} non-empty pipeline stages; use at most {n_blocks} "
            f"stages (pp * stages_per_rank) or a model with more layers"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, i: int, j: int) -> float:  # stage s holds blocks i..j-1
        extra = (first_cost if s == 0 else 0.0) + (last_cost if s == n_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    # best[s][j]: the least max-cost of stages 0..s holding blocks 0..j-1; cut[s][j]: where stage s starts
    best = [[math.inf] * (n_blocks + 1) for _ in range(n_stages)]
    cut = [[0] * (n_blocks + 1) for _ in range(n_stages)]
    for j in range(1, n_blocks + 1):
        best[0][j] = stage_cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n_blocks + 1):
            for i in range(j - 1, s - 1, -1):  # latest start first: ties favour longer earlier stages
                c = max(best[s - 1][i], stage_cost(s, i, j))
                if c < best[s][j] - 1e-12 * abs(c):
                    best[s][j], cut[s][j] = c, i
    bounds, j = [], n_blocks
    for s in range(n_stages - 1, 0, -1):
        bounds.append(cut[s][j])
        j = cut[s][j]
    edges = [0, *reversed(bounds), n_blocks]
    return tuple(range(a, b) for a, b in zip(edges, edges[1:]))


def balanced_layers(model: StageModel, n_stages: int) -> tuple[range, ...]:
    """The blocks of each of ``n_stages`` stages as `make_stages` cuts ``model`` by default: `balance` of its
    block, first and last costs. The planner sizes ranks by the same cut (`blocks_per_rank`), so a plan
    predicts the stages the trainer builds."""
    return balance(model.block_cost, model.n_blocks, n_stages, first_cost=model.first_cost, last_cost=model.last_cost)


def blocks_per_rank(model: StageModel, schedule: Schedule) -> tuple[int, ...]:
    """How many blocks each pipeline rank holds when `make_stages` cuts ``model`` for ``schedule`` by default:
    the blocks of the rank's stages (``schedule.stages_of``), rank 0 first.

    >>> m = StageModel(first=None, blocks=None, last=None, activation=None, n_blocks=8, last_cost=2.0)
    >>> from functitan.pipeline import one_f_one_b
    >>> blocks_per_rank(m, one_f_one_b(pp=2, m=4))  # the head costs two blocks: the last rank holds fewer
    (5, 3)
    """
    layers = balanced_layers(model, schedule.num_stages)
    return tuple(sum(len(layers[s]) for s in schedule.stages_of(r)) for r in range(schedule.pp))


# ----------------------------------------------------------------------------------------------- stages


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stages:
    """A model cut into a schedule's stages, seen from one rank. Build with `make_stages`.

    Attributes:
        model: the `StageModel`.
        schedule: the pipeline schedule (its `stage_to_rank` places the stages).
        layers: the blocks of each global stage, ``layers[s]`` a range.
        mesh: the full mesh (with ``pp``).
        pp_rank: this rank's coordinate on ``pp``.
        pp_group: the process group of this rank's pipeline (same coordinates on every other axis).
        stage_mesh: the mesh without ``pp``; stage params and their collectives live there.
    """

    model: StageModel
    schedule: Schedule
    layers: tuple[range, ...]
    mesh: DeviceMesh
    pp_rank: int
    pp_group: Any
    stage_mesh: DeviceMesh

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    @property
    def local(self) -> tuple[int, ...]:
        """This rank's global stages, in increasing order."""
        return self.schedule.stages_of(self.pp_rank)

    def keys_of(self, stage: int) -> tuple[str, ...]:
        """Top-level param keys (besides blocks) that ``stage`` reads."""
        keys = self.model.first_keys if stage == 0 else ()
        return keys + (self.model.last_keys if stage == self.num_stages - 1 else ())


def stage_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` without its ``pp`` axis: ``mesh["dp_replicate", "dp_shard", "tp"]`` (a collective call)."""
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names:
        raise ValueError(f"the mesh has axes {names} and no 'pp' axis; build it with functitan.mesh.make_mesh(pp=...)")
    return mesh[tuple(a for a in names if a != "pp")]


def stage_rules(rules: Rules) -> Rules:
    """``rules`` without the ``pp`` axis (``("layers", "pp")`` in the defaults), for the stage mesh."""

    def drop(axes: Any) -> Any:
        if axes is None or isinstance(axes, str):
            return None if axes == "pp" else axes
        kept = tuple(a for a in axes if a != "pp")
        return kept or None

    return tuple((name, drop(axes)) for name, axes in rules)


def make_stages(
    model: StageModel, schedule: Schedule, mesh: DeviceMesh, *, layers: Sequence[range] | None = None
) -> Stages:
    """Cut ``model`` into ``schedule.num_stages`` stages (balanced by cost unless ``layers`` is given).

    Every rank calls it (slicing the mesh may create process groups).

    Raises:
        ValueError: the mesh's ``pp`` degree differs from the schedule's; the given ``layers`` do not
            cover the blocks in order; or a key is read by both the first and last stage (tied
            embeddings) while they sit on different ranks.
    """
    names = tuple(mesh.mesh_dim_names or ())
    pp = mesh.size(names.index("pp")) if "pp" in names else 0
    if pp != schedule.pp:
        raise ValueError(
            f"schedule {schedule.name!r} is for pp={schedule.pp} ranks but the mesh has pp={pp}; build the mesh "
            f"with make_mesh(pp={schedule.pp}, ...) or the schedule for pp={pp}"
        )
    n = schedule.num_stages
    if layers is None:
        layers = balanced_layers(model, n)
    layers = tuple(layers)
    flat = [i for r in layers for i in r]
    if len(layers) != n or flat != list(range(model.n_blocks)) or any(len(r) == 0 for r in layers):
        raise ValueError(
            f"layers={layers}: need {n} non-empty contiguous ranges covering blocks 0..{model.n_blocks - 1} in order"
        )
    if model.single_backward and split_pairs(schedule):
        raise ValueError(
            f"schedule {schedule.name!r} splits the backward into B and W, two backward passes through each "
            f"stage, but the stages use selective activation checkpointing (remat='selective'), which allows one; "
            f"build the Layout with remat 'none' or 'full' (training.remat), or use a schedule without B/W "
            f"(parallelism.pipeline_schedule gpipe, 1f1b or interleaved_1f1b)"
        )
    shared = set(model.first_keys) & set(model.last_keys)
    if shared and n > 1 and schedule.stage_to_rank[0] != schedule.stage_to_rank[-1]:
        raise ValueError(
            f"params {sorted(shared)} are read by both the first and the last stage (tied embeddings), which "
            f"schedule {schedule.name!r} puts on ranks {schedule.stage_to_rank[0]} and {schedule.stage_to_rank[-1]}; "
            f"untie them in the model's config (the bundled models: model.tie_embeddings=false) or use a V-placed "
            f"schedule (zb_v) that keeps both on rank 0"
        )
    pp_mesh = mesh["pp"]
    return Stages(
        model=model,
        schedule=schedule,
        layers=layers,
        mesh=mesh,
        pp_rank=pp_mesh.get_local_rank(),
        pp_group=pp_mesh.get_group(),
        stage_mesh=stage_mesh(mesh),
    )


def _select(tree: dict, stages: Stages, which: Sequence[int]) -> dict:
    """The entries of a full-model ``tree`` (params or specs) that stages ``which`` read."""
    key = stages.model.blocks_key
    blocks = tree[key]
    out: dict[str, Any] = {}
    for s in sorted(which):
        for k in stages.keys_of(s):
            if k not in tree:
                raise ValueError(
                    f"stage {s} reads top-level key {k!r}, which the tree lacks; its keys are {sorted(tree)}"
                )
            out[k] = tree[k]
    pick = (lambda i: blocks[str(i)]) if isinstance(blocks, dict) else (lambda i: blocks[i])  # rank tree or full
    out[key] = {str(i): pick(i) for s in sorted(which) for i in stages.layers[s]}
    return out


def rank_tree(tree: dict, stages: Stages) -> dict:
    """This rank's part of a full-model tree: its stages' blocks (keyed by global index) and pieces."""
    return _select(tree, stages, stages.local)


def stage_tree(tree: dict, stages: Stages, stage: int) -> dict:
    """One stage's part of a tree (a full-model tree, or this rank's tree for one of its stages)."""
    return _select(tree, stages, (stage,))


def place_stages(params: dict, specs: dict, rules: Rules, stages: Stages, *, requires_grad: bool = True) -> dict:
    """Place this rank's params on the stage mesh: `rank_tree` of ``params`` and ``specs``, then `place`.

    ``params`` are the full model's values, identical on every rank (like `place`); ``rules`` may name
    ``pp`` (it is dropped, see `stage_rules`).
    """
    stage_specs = _select_specs(specs, stages)  # first: a stacked declaration is refused by name, not a KeyError
    return place(
        rank_tree(params, stages),
        stage_specs,
        stage_rules(rules),
        stages.stage_mesh,
        requires_grad=requires_grad,
    )


def _select_specs(specs: dict, stages: Stages) -> dict:
    key = stages.model.blocks_key
    blocks = specs.get(key)
    if isinstance(blocks, dict) and blocks and all(is_spec(s) and s[:1] == ("layers",) for s in blocks.values()):
        raise ValueError(
            f"params {sorted(f'{key}.{k}' for k in blocks)} are declared as one stack over all blocks (names "
            f"{list(next(iter(blocks.values())))}), which pipeline stages cannot split: declare {key!r} as a list "
            f"with one param tree per block ([{{...}} for _ in range(n_layers)], dropping the leading 'layers' "
            f"dim), or use parallelism.pp=1"
        )
    if not isinstance(blocks, list) or (blocks and is_spec(blocks)):
        raise ValueError(
            f"specs[{key!r}] must be a list with one spec tree per block, got {type(specs.get(key)).__name__}"
        )
    return rank_tree(specs, stages)


def pp_all_reduce(x: Tensor, stages: Stages) -> Tensor:
    """Sum ``x`` over this rank's pipeline group, in place (a no-op for pp = 1)."""
    if dist.get_world_size(stages.pp_group) > 1:
        dist.all_reduce(x, group=stages.pp_group)
    return x
