"""``functitan train``: mesh -> init -> place -> optimizer -> step -> checkpoint -> metrics, top to bottom.

Run it on one process (``python -m functitan.train --config configs/debug.toml``), on N through torchrun
(``torchrun --nproc-per-node=N -m functitan.train ...``), or let ``--nproc N`` start torchrun for you.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import _eval, _loss, optim, pipeline
from . import metrics as M
from ._banner import banner, planned_peak
from ._batch import split_batch
from ._model_setup import check_model, check_resumed_model, init_model
from ._preempt import Preemption
from ._worker_report import report_run, report_stopped
from .checkpoint import (
    CheckpointManager,
    check_checkpoint_path,
    is_hf_dir,
    lock_run,
    restore_params,
    write_model_config,
)
from .config import to_dict
from .data import build_loader
from .errors import PeersGone
from .hostmem import keep_freed_memory
from .job_config import DEFAULT_FLAVOR, JobConfig, build_optimizer, build_schedule, learning_rate_schedule
from .mesh import EP_SPAN, check_ep, expert_axis, make_mesh, resolve_degrees
from .model import Model, config_to_dict, count
from .model import specs as model_specs
from .moe import LoadBalance
from .random import key
from .sharding import Layout, default_rules, place
from .step import make_train_step
from .train_state import TrainState
from .transforms import accumulate, value_and_grad

__all__ = [
    "main",
    "run",
    "train_config",
    "EXIT_REJOIN",
    "make_layout",
    "place_model",
    "Placed",
    "local_stepper",
    "make_step",
    "local_batch",
]

EXIT_REJOIN = 3  # elastic: a peer left after a checkpoint; torchrun restarts this worker into the new group


def run(
    cfg: JobConfig,
    model: Model | None = None,
    *,
    stepper: Any = None,
    dry_run: bool = False,
    loader: Callable[..., Any] | None = None,
    optimizer: optim.GradientTransformation | None = None,
    evaluate: Callable[[Any], Mapping[str, float]] | None = None,
    callbacks: Sequence[Callable[[int, TrainState, dict[str, Any]], Mapping[str, float] | None]] = (),
) -> dict[str, Any]:
    """Train as ``cfg`` says; returns a summary (first/last loss, steps, run directory, final state).

    ``model``: the Model value to train (default: the one ``cfg.model.name`` resolves to). ``stepper``: what runs
    each global step (``local_stepper``, the default; ``elastic.live`` needs
    ``functitan.elastic.live.live_stepper``, which ``functitan train`` passes). It is also the step hook: a
    stepper that wraps ``local_stepper`` with its own ``train_step`` sees every step's call, so a benchmark
    measures the trainer as a user runs it without patching it (benchmarks/first_step.py times each step).
    ``dry_run``: build everything (mesh, data, model, placed params, optimizer state), print the banner, and
    return before the run directory, the checkpoint or a step is touched (``functitan train --dry-run`` then
    prints the planner's trace of rank 0's step: ``train_config``).

    The hooks replace one piece each and leave the rest of the loop (layouts, checkpoints, sinks) as it is:

    - ``loader(cfg, *, batch_size, seq_len, dp_rank, dp_size, device)``: this rank's data instead of ``[data]``'s,
      anything with ``init_state()``, ``next(state) -> (batch, state)`` (a functional iterator: the state goes
      into checkpoints), ``batch_size``, ``dp_size`` and ``vocab_size`` (or a ``tokenizer`` that has it);
      ``batch`` is what the model's loss takes.
    - ``optimizer``: the transformation to step with instead of ``[optimizer]``'s (clipping by
      ``optimizer.max_norm`` still happens in the step; the logged ``lr`` is then left out).
    - ``evaluate(params) -> metrics``: runs instead of ``[eval]``'s loss every ``eval.every`` steps and at the
      last one, on every rank with the placed params; no eval data is needed.
    - ``callbacks``: each ``callback(step, state, metrics)`` runs after every step on every rank; what it
      returns joins that step's record, which is then written whatever ``metrics.log_every``.
    """
    if stepper is None and cfg.elastic.live:
        raise ValueError(
            "elastic.live=true: pass stepper=functitan.elastic.live.live_stepper to functitan.train.run (the "
            "`functitan train` command does)"
        )
    stepper = stepper or local_stepper
    custom_optimizer = optimizer is not None
    _check_degrees_and_batch(cfg)
    _check_load_path(cfg)
    device = _init_process(cfg.training)
    par, tcfg = cfg.parallelism, cfg.training
    # 1. mesh: every layout is a choice of degrees; pipeline stages compute on the mesh without pp
    mesh = make_mesh(
        dp_replicate=par.dp_replicate,
        dp_shard=par.dp_shard,
        tp=par.tp,
        pp=par.pp,
        cp=par.cp,
        ep=par.ep,
        device=device.type,
    )
    layout, rules = make_layout(cfg, mesh)
    per_rank, microbatches = local_batch(cfg, layout.dp_size)
    shape = dict(batch_size=per_rank, seq_len=tcfg.seq_len, dp_rank=layout.dp_rank, dp_size=layout.dp_size)
    if loader is None:  # the documents [eval] holds out are never trained on
        data = build_loader(cfg.data, **shape, device=device, holdout=cfg.eval.holdout)  # type: ignore[arg-type]
    else:
        data = loader(cfg, **shape, device=device)
    # None without [eval] (or with an evaluate hook); its errors come before step 1
    eval_data = _eval.eval_loader(cfg, data, device) if evaluate is None else None

    # 2. model and init: identical on every rank and mesh (or weights from load_path)
    rng = key(tcfg.seed)
    name, model, model_cfg, full_params = init_model(cfg, model, rng, vocab=_vocab_size(data), device=device)
    check_model(
        model,
        model_cfg,
        tp=par.tp,
        pp=par.pp,
        cp=par.cp,
        cp_attention=par.cp_attention,
        ep=par.ep,
        seq_len=tcfg.seq_len,
        sequence_parallel=layout.sequence_parallel,
    )

    # 3. place: each rank keeps its shards (and only its pipeline stages); the grad_fn follows the layout
    placed = place_model(cfg, model, model_cfg, full_params, mesh, layout, rules, microbatches=microbatches)
    del full_params

    # 4. optimizer and step
    optimizer, train_step = make_step(cfg, model, model_cfg, placed.grad_fn, placed.norm_across, optimizer=optimizer)
    params = placed.params
    state = TrainState(step=0, params=params, opt_state=optimizer.init(params), data_state=data.init_state(), rng=rng)

    run_dir = _run_dir(cfg, model.name)
    if dist.get_rank() == 0:
        lines = banner(
            model=name,
            flavor=cfg.model.flavor
            or (f"from {cfg.checkpoint.load_path}" if cfg.checkpoint.load_path else DEFAULT_FLAVOR),
            n_params=count(model.params(model_cfg)),
            degrees={a: mesh.size(i) for i, a in enumerate(mesh.mesh_dim_names or ())},
            training=tcfg,
            params=state.params,
            opt_state=state.opt_state,
            run_dir=run_dir,
            dry_run=dry_run,
            expert_span=expert_axis(mesh) == EP_SPAN,
        )
        print("\n".join(lines), flush=True)
    if dry_run:
        world = dist.get_world_size()
        return {"steps": 0, "dry_run": True, "run_dir": None, "state": state, "rank": dist.get_rank(), "world": world,
                "model": (model, model_cfg)}  # fmt: skip

    # 5. checkpoint: resume from the newest complete checkpoint of this run, else a weights-only load_path
    lock = lock_run(run_dir, wait_s=30.0 if "FUNCTITAN_ELASTIC_RUN" in os.environ else 0.0)  # one job per run
    ckpt = None
    if cfg.checkpoint.enable:
        ckpt = CheckpointManager(
            run_dir / cfg.checkpoint.folder,
            interval=cfg.checkpoint.interval,
            keep_last=cfg.checkpoint.keep_last,
            mesh=mesh,
            when_busy=cfg.checkpoint.when_busy,
        )
    report_run(ckpt.root if ckpt is not None else None)  # the launcher names the newest step if the job dies
    if ckpt is not None and ckpt.latest_step() is not None:
        check_resumed_model(run_dir, name, model_cfg)
    restored = (
        ckpt.restore_latest(state, in_place=True) if ckpt is not None else None
    )  # reuses the fresh state's memory
    if restored is not None:
        state = restored
    elif cfg.checkpoint.load_path and not is_hf_dir(cfg.checkpoint.load_path):
        loaded = restore_params(cfg.checkpoint.load_path, state.params, partial=par.pp > 1, model=(model, model_cfg))
        state = state._replace(params=loaded)
    # recorded once the checkpoint took this model: a resume refused (another model or shape) keeps the run's record
    _record_run(cfg, name, model_cfg, run_dir)

    # 6. metrics, and the loop
    meter = M.Meter(
        world_size=dist.get_world_size(),
        flops_per_token=model.flops_per_token(model_cfg, tcfg.seq_len),
        peak=M.peak_flops(device, layout.param_dtype or torch.float32),
    )
    if eval_data is not None:
        evaluate = _eval.make_evaluator(eval_data, placed.eval_loss, cfg.eval.batches)
    lr_at = None if custom_optimizer else learning_rate_schedule(cfg.optimizer, tcfg.steps)  # its own, unknown
    hooks = _Hooks(evaluate=evaluate, callbacks=tuple(callbacks), lr_at=lr_at)
    with lock, stepper(cfg, train_step, data, device, loss_grad=placed.loss_grad, optimizer=optimizer) as advance:
        return _loop(cfg, state, advance, data, meter, ckpt, run_dir, device, hooks)


def _record_run(cfg: JobConfig, name: str, model_cfg: Any, run_dir: Path) -> None:
    """Write what ran (``config.json``) and the model (``model_config.json``, which ``functitan export hf`` and
    ``--checkpoint.load_path`` rebuild the model from) into the run directory."""
    ran = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=name, overrides=config_to_dict(model_cfg)))
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(to_dict(ran), indent=2, default=str))
    write_model_config(name, model_cfg, run_dir)


def make_layout(cfg: JobConfig, mesh: Any) -> tuple[Layout, Any]:
    """``(Layout, rules)`` the step computes with on ``mesh`` (pipeline stages: the mesh without ``pp``)."""
    par, tcfg = cfg.parallelism, cfg.training
    rules = default_rules(sequence_parallel=par.sequence_parallel and par.tp > 1)
    compute_mesh, compute_rules = (
        (pipeline.stage_mesh(mesh), pipeline.stage_rules(rules)) if par.pp > 1 else (mesh, rules)
    )
    layout = Layout(
        compute_mesh,
        compute_rules,
        remat=tcfg.remat,
        compile=tcfg.compile,
        reshard_after_forward=par.reshard_after_forward,
        param_dtype=getattr(torch, tcfg.param_dtype),
        reduce_dtype=getattr(torch, tcfg.reduce_dtype),
        cp_attention=par.cp_attention,
    )
    return layout, rules


class Placed(NamedTuple):
    """What ``place_model`` returns: this rank's params and the gradient functions that follow the layout."""

    params: Any  # this rank's shards (with pipelining: of its stages only)
    grad_fn: Any  # (params, batch) -> ((loss, aux), grads): accumulated microbatches, or the pipeline executor
    norm_across: Any  # the process group the gradient norm sums over besides the mesh (pipelining: pp), or None
    loss_grad: Any  # (params, microbatch) -> (mean loss, grads), for elastic.live; None with pipelining
    eval_loss: Any  # (params, batch) -> this rank's loss, no gradient kept ([eval]): a mean, or a TokenLoss


def place_model(
    cfg: JobConfig,
    model: Model,
    model_cfg: Any,
    full_params: Any,
    mesh: Any,
    layout: Layout,
    rules: Any,
    *,
    microbatches: int,
    stage_layers: Any = None,
) -> Placed:
    """Shards (and only this rank's pipeline stages) placed, and the grad_fn that follows the layout.

    ``stage_layers``: the blocks of each pipeline stage (default: balanced by cost; the planner fixes them)."""
    par, tcfg = cfg.parallelism, cfg.training
    specs = model_specs(model.params(model_cfg))
    if par.pp > 1:
        if model.stages is None:  # check_model refuses this first; kept for callers of place_model
            raise ValueError(f"parallelism.pp={par.pp}: model {model.name!r} declares no stages; use parallelism.pp=1")
        stage_model = model.stages(model_cfg, layout, seq_len=tcfg.seq_len, dtype=layout.param_dtype or torch.float32)
        stages = pipeline.make_stages(stage_model, build_schedule(par, tcfg.microbatches), mesh, layers=stage_layers)
        grad_fn = pipeline.pipeline_grad_fn(stages)
        return Placed(
            params=pipeline.place_stages(full_params, specs, rules, stages),
            grad_fn=grad_fn,
            norm_across=stages.pp_group,
            loss_grad=None,
            eval_loss=_eval.pipeline_loss(grad_fn),
        )
    params = place(full_params, specs, rules, mesh)
    objective = lambda p, b: _loss.split_aux(model.loss(p, b, model_cfg, layout))  # noqa: E731  (loss, aux)
    loss_grad = value_and_grad(lambda p, b: _loss.as_mean(objective(p, b)[0]))  # elastic.live: per-microbatch means
    grad_fn = accumulate(value_and_grad(objective, has_aux=True), microbatches)
    return Placed(params, grad_fn, None, loss_grad, _eval.forward_loss(objective, microbatches))


def make_step(
    cfg: JobConfig,
    model: Model,
    model_cfg: Any,
    grad_fn: Any,
    norm_across: Any,
    *,
    optimizer: optim.GradientTransformation | None = None,
) -> tuple[Any, Any]:
    """``(optimizer, train_step)`` as the config says (weight decay masked by the params' specs), or with the
    ``optimizer`` given; a MoE model's balancing biases move by ``optimizer.moe_bias_rate`` either way."""
    specs = model_specs(model.params(model_cfg))
    optimizer = optimizer or build_optimizer(
        cfg.optimizer,
        cfg.training.steps,
        decay_mask=optim.decay_mask_from_specs(specs),
        muon_labels=optim.muon_labels_from_specs(specs),  # optimizer.name=muon: the hidden matrices
    )
    return optimizer, make_train_step(
        grad_fn,
        optimizer,
        max_norm=cfg.optimizer.max_norm,
        norm_across=norm_across,
        on_nonfinite=cfg.training.on_nonfinite,
        donate=True,  # the loop never reads a state after stepping it: adamw updates in one fused pass
        balance=LoadBalance.from_specs(specs, cfg.optimizer.moe_bias_rate),  # MoE balancing biases, if any
    )


class _Hooks(NamedTuple):
    """What ``run``'s hooks put into the loop."""

    evaluate: Any  # (params) -> metrics, every eval.every steps and at the last; or None
    callbacks: tuple[Any, ...]  # (step, state, metrics) -> metrics or None, after every step
    lr_at: Any  # step -> lr, for the record; None with a custom optimizer (its schedule is its own)


def _vocab_size(loader: Any) -> int:
    """The vocabulary the model must cover: a custom loader's ``vocab_size``, or its tokenizer's."""
    vocab = getattr(loader, "vocab_size", None) or getattr(getattr(loader, "tokenizer", None), "vocab_size", None)
    if not isinstance(vocab, int):
        raise TypeError(
            f"run(loader=...) made a {type(loader).__name__} with neither vocab_size nor tokenizer.vocab_size; give "
            "it one (the model's vocab_size must cover its ids)"
        )
    return vocab


@contextlib.contextmanager
def local_stepper(
    cfg: JobConfig, train_step: Any, loader: Any, device: torch.device, *, loss_grad: Any, optimizer: Any
) -> Iterator[Any]:
    """The default stepper: ``advance(state, preemption, before_update) -> (state, metrics, data position)``, one
    global step on this job's ranks.

    A stepper is a context manager factory with this signature; ``run(cfg, stepper=...)`` takes another one, as
    ``functitan train`` hands in ``functitan.elastic.live.live_stepper`` for ``elastic.live`` (replica groups of a
    torchft quorum; ``loss_grad`` is the per-microbatch gradient it shares the batch out with)."""
    yield _advance(loader, train_step)


def _advance(loader: Any, train_step: Any) -> Any:
    """One global step at the state's data position, on this job's ranks."""

    def advance(
        state: TrainState, preemption: Preemption, before_update: Any = None
    ) -> tuple[TrainState, dict[str, Any], Any]:
        t0 = time.perf_counter()
        batch, after = loader.next(state.data_state)
        data_s = time.perf_counter() - t0
        new, out = train_step(state._replace(data_state=after), batch, before_update=before_update)
        aux = _loss.aux_metrics(out.pop("aux", None))  # the loss's aux outputs, this rank's: "aux/<key>"
        return new, {**out, **aux, "data_s": data_s}, state.data_state

    return advance


def _loop(
    cfg: JobConfig,
    state: TrainState,
    advance: Any,
    loader: Any,
    meter: Any,
    ckpt: Any,
    run_dir: Path,
    device: torch.device,
    hooks: _Hooks = _Hooks(None, (), None),
) -> dict[str, Any]:
    """Step until ``training.steps``, or until SIGTERM/SIGINT: then checkpoint at this step boundary and stop.

    ``hooks.evaluate(params) -> metrics`` (``[eval]``, or ``run``'s hook) runs every ``eval.every`` steps and at
    the last one, on the params that step produced, and each of ``hooks.callbacks`` after every step; what they
    return joins that step's record, which is then written whatever ``log_every``.

    A save copies the state into its staging buffers in the background (on CUDA: pinned buffers, the copy
    engine) while the next step computes its gradients; that step's in-place update waits for the copy first
    (``before_update=ckpt.staged``), so the save call itself blocks for almost nothing. On CPU the copy takes
    the step's own cores either way: staging inside the call cost the loop as much or more over the steps
    until the commit (benchmarks/checkpoint_vs_dcp.py, ``lost_until_commit_*``). So one path on every device,
    and CPU tests run the one GPU users take.
    """
    steps = cfg.training.steps
    evaluate, every = hooks.evaluate, cfg.eval.every
    sinks = M.make_sinks(run_dir, steps, rank=dist.get_rank(), metrics=cfg.metrics, config=cfg)
    batch_seqs = loader.batch_size * loader.dp_size  # global: constant over world sizes (elastic)
    start = state.step  # 0, or the step a checkpoint resumed at; elastic.live: a peer may heal us further on
    first_loss = last_loss = float("nan")
    stop = ran = 0
    window_sum, window_n = 0.0, 0  # the losses since the last write: its loss_avg (a tensor stays unsynced)
    failed = True  # closing the sinks and the saver must not replace the error that stopped the loop
    try:
        with (
            Preemption() as preemption,
            M.Profiler(cfg.profile, run_dir, rank=dist.get_rank(), device=device, start=state.step) as profiler,
        ):
            M.reset_peak_memory(device)
            while state.step < steps and not stop:
                t0 = time.perf_counter()
                try:
                    stepped = advance(state, preemption, ckpt.staged if ckpt is not None else None)
                except PeersGone as exc:  # elastic.live, no quorum: keep the steps committed so far
                    if ckpt is not None:
                        ckpt.maybe_save(state, force=True)
                        ckpt.wait()  # committed before the message says so
                    raise type(exc)(f"{exc}; {_saved(ckpt, state.step)}; then run the same command") from None
                if stepped is None:  # stopped while waiting for peers (elastic.live): save the last committed step
                    stop = preemption.signum
                    if ckpt is not None:
                        ckpt.maybe_save(state, force=True)
                    break
                state, out, position = stepped  # position: where this step read the data stream
                meter.update(
                    wall_s=time.perf_counter() - t0,
                    data_s=out.pop("data_s", 0.0),
                    tokens=batch_seqs * cfg.training.seq_len,
                )
                if ran == 0:  # the first step this process ran: a joiner's follows the step it healed to
                    start, first_loss = state.step - 1, out["loss"]
                ran += 1
                last_loss = out["loss"]
                window_sum, window_n = window_sum + out["loss"], window_n + 1
                stop = preemption.agreed(device)  # every rank stops at the same boundary
                extra = (  # [eval] and the callbacks: they decide when the record is written too
                    dict(evaluate(state.params))
                    if evaluate is not None and every and (state.step % every == 0 or state.step == steps)
                    else {}
                )
                for callback in hooks.callbacks:
                    extra.update(callback(state.step, state, out) or {})
                if state.step % cfg.metrics.log_every == 0 or state.step in (1, steps) or stop or extra:
                    sinks.write(
                        state.step,
                        {
                            **out,
                            **extra,
                            "loss_avg": float(window_sum) / window_n,
                            **({"lr": hooks.lr_at(state.step - 1)} if hooks.lr_at is not None else {}),
                            **meter.flush(),
                            **M.peak_memory(device),
                            **_position(position, batch_seqs, cfg, out.get("replicas", 1) * dist.get_world_size()),
                            **({"checkpoint_wait_s": ckpt.pop_wait_s()} if ckpt is not None else {}),
                        },
                    )
                    M.reset_peak_memory(device)
                    window_sum, window_n = 0.0, 0
                if ckpt is not None:
                    ckpt.maybe_save(state, force=state.step == steps or bool(stop), defer_staging=True)
                profiler.step(state.step)  # [profile]: a trace is one turn of this loop, its records and save in
        failed = False
    finally:
        _close(ckpt, sinks, failed=failed)
    rejoin = bool(stop) and not preemption.signum and "FUNCTITAN_ELASTIC_RUN" in os.environ
    if stop:
        _report_stop(stop, state.step, ckpt, rejoin=rejoin, resume=_resume_hint(cfg, ckpt, run_dir))
    elif dist.get_rank() == 0:
        print(_summary_line(start, state.step, steps, first_loss, last_loss, run_dir), flush=True)
    return {
        "steps": state.step,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "run_dir": str(run_dir),
        "state": state,
        "stopped_by": Preemption.name(stop) if stop else None,
        "rejoin": rejoin,
    }


def _close(ckpt: Any, sinks: Any, *, failed: bool) -> None:
    """Wait for the last async save, then close the sinks; raise the first error, the checkpoint's before the
    event file's (a disk that fills up fails both), and none while another error stopped the loop."""
    errors = []
    for close in (ckpt.close if ckpt is not None else None, sinks.close):
        try:
            if close is not None:
                close()
        except Exception as e:  # noqa: BLE001 - close the rest, then raise the first
            errors.append(e)
    if errors and not failed:
        raise errors[0]


def _position(data_state: Any, batch_seqs: int, cfg: JobConfig, world: int) -> dict[str, int]:
    """Where a step read the data stream and how much: the record that shows every step ran once, at its place
    (a custom loader's state other than a TokenLoader's is not reported)."""
    where = {}
    if isinstance(data_state, Mapping) and {"epoch", "seq"} <= set(data_state):
        where = {"data_epoch": data_state["epoch"], "data_seq": data_state["seq"]}
    return {**where, "batch_tokens": batch_seqs * cfg.training.seq_len, "world_size": world}


def _resume_hint(cfg: JobConfig, ckpt: Any, run_dir: Path) -> str:
    """How to resume: a run finds its checkpoints by its name, and an unnamed run is named by the clock."""
    if ckpt is None:
        return "nothing to resume from (add --checkpoint.enable=true to save one)"
    if cfg.metrics.run_name or os.environ.get("FUNCTITAN_ELASTIC_RUN"):
        return "run the same command to resume"
    return f"run the same command with --metrics.run_name={run_dir.name} to resume"


def _saved(ckpt: Any, step: int) -> str:
    return (
        f"checkpoint saved in {ckpt.step_dir(step)}" if ckpt is not None else "no checkpoint (checkpoint.enable=false)"
    )


def _report_stop(signum: int, step: int, ckpt: Any, *, rejoin: bool, resume: str) -> None:
    saved = _saved(ckpt, step)
    if rejoin:  # a peer was signalled, not us: exit non-zero so that our torchrun agent restarts us (elastic)
        print(f"functitan: a peer stopped after step {step}; {saved}; restarting to re-form the group", flush=True)
    elif dist.get_rank() == 0:
        why = "interrupted (SIGINT)" if Preemption.name(signum) == "SIGINT" else f"stopped by {Preemption.name(signum)}"
        print(f"functitan: {why} after step {step}; {saved}; {resume}", flush=True)
    report_stopped(step)


def _summary_line(start: int, end: int, steps: int, first_loss: float, last_loss: float, run_dir: Path) -> str:
    if end == start:
        return f"functitan: nothing to train: the run's checkpoint is at step {end}, training.steps={steps}; logs in {run_dir}"
    resumed = f" (resumed at step {start})" if start else ""
    first = "first loss" if not start else f"loss at step {start + 1}"
    return f"functitan: {end} steps{resumed}, {first} {first_loss:.4f} -> last loss {last_loss:.4f}; logs in {run_dir}"


def _init_process(tcfg: Any) -> torch.device:
    if tcfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "training.device='cuda' but torch sees no CUDA device here; use training.device=cpu "
            "(or auto, which picks cuda when there is one)"
        )
    use_cuda = tcfg.device == "cuda" or (tcfg.device == "auto" and torch.cuda.is_available())
    if tcfg.threads > 0:
        torch.set_num_threads(tcfg.threads)
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        keep_freed_memory()  # functional updates allocate every step: don't page-fault them in each time
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def _check_degrees_and_batch(cfg: JobConfig) -> None:
    """The errors that need only the world size, raised before any process group forms: a rank that failed
    after joining would take the store down under peers still rendezvousing (they would print tracebacks)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    par = cfg.parallelism
    degrees = resolve_degrees(
        world, pp=par.pp, dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, cp=par.cp, tp=par.tp
    )
    check_ep(par.ep, degrees["dp_shard"], cp=degrees["cp"], tp=degrees["tp"])
    local_batch(cfg, degrees["dp_replicate"] * degrees["dp_shard"])


def _check_load_path(cfg: JobConfig) -> None:
    """A ``checkpoint.load_path`` that holds no checkpoint (a run directory, a missing step), named before any
    process group forms, for the reason above; a run directory's model_config.json would be read as its model."""
    if cfg.checkpoint.load_path and not is_hf_dir(cfg.checkpoint.load_path):
        check_checkpoint_path(cfg.checkpoint.load_path)


def local_batch(cfg: JobConfig, dp_size: int) -> tuple[int, int]:
    """``(per-rank batch, microbatches)``: the global batch is constant, whatever the world size (elastic)."""
    par = cfg.parallelism
    return split_batch(
        cfg.training.batch_size,
        dp_size,
        microbatches=cfg.training.microbatches,
        microbatch_size=cfg.elastic.microbatch_size if par.pp == 1 else 0,
        fixed=par.tp * par.pp * par.cp,
    )


def _run_dir(cfg: JobConfig, model_name: str) -> Path:
    """``run_dir/<run_name>``; unnamed: the model's own name (gpt2, not the module ``models`` that holds it) and
    the start time."""
    name = cfg.metrics.run_name or os.environ.get("FUNCTITAN_ELASTIC_RUN")  # an elastic restart finds its run
    if name is None:  # one timestamp for all ranks
        stamp = torch.tensor([int(time.time())], dtype=torch.int64)
        if dist.get_world_size() > 1:
            dist.broadcast(stamp, src=0)
        name = f"{model_name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(int(stamp.item())))}"
    return Path(cfg.metrics.run_dir) / name


def train_config(cfg: JobConfig, *, stepper: Any = None, dry_run: bool = False) -> int:
    """``run(cfg, stepper=stepper, dry_run=dry_run)`` as a process's exit status: 0, or ``EXIT_REJOIN`` for an
    elastic worker that must rejoin."""
    try:
        summary = run(cfg, stepper=stepper, dry_run=dry_run)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if dry_run:
        if summary["rank"] == 0:  # the planner's fake world needs the real process group gone
            print(planned_peak(cfg, *summary["model"], world=summary["world"]), flush=True)
        return 0
    code = EXIT_REJOIN if summary["rejoin"] else 0
    if cfg.elastic.live and summary["stopped_by"]:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """Exit without joining torchft's quorum thread. A stop signal that cut a quorum wait short leaves the
    request to the lighthouse running there, and interpreter exit would wait for it (up to
    ``elastic.quorum_timeout_s``, past a scheduler's grace period); by now the checkpoint is committed and the
    sinks are closed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """``functitan train`` (functitan._train_cli, which launches; this module trains) with this module's ``run``."""
    from ._train_cli import main as cli

    return cli(argv, worker=train_config)


if __name__ == "__main__":
    sys.exit(main())
