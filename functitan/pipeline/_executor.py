"""Run a rank's pipeline program (`with_comms`) as a grad_fn: per-microbatch autograd and P2P on the pp group.

Each compute action runs one stage on one microbatch:

    F   x = recv or hand-off (or the batch on stage 0); out = stage(params, x); keep (x, out)
    BW  dx, dparams = autograd.grad(out, (x, params), dout)            # dout: received, or 1 for the loss
                                                                       # (pure PP: autograd.backward into .grad)
    B   dx = autograd.grad(out, x, dout, retain_graph=True)            # zero-bubble: input gradient only,
                                                                       # keeping dy where weights join
    W   dparams from the kept dy: only the weight branches run (_split_backward: no recomputation)

Activations and input gradients cross ranks as ``isend``/``irecv`` on the pipeline group in the posting
order `with_comms` gives (so NCCL's in-order matching holds); the receiver allocates from
``StageModel.activation``, so no shape handshake. Between two stages on one rank (interleaved, ZB-V) the
tensor is handed over in memory. The last stage scales each microbatch's loss by 1 / microbatches, so the
summed gradients are those of the mean loss, as `functitan.transforms.accumulate` gives; a last stage that
returns ``TokenLoss(sum, count)`` backpropagates the sum, and the step divides by the count summed over
microbatches and data-parallel ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
from torch import Tensor

from functitan import _dtensor as _dt
from functitan._autograd import hand_grad
from functitan._loss import TokenLoss
from functitan._valueless import valueless
from functitan.pipeline._comms import with_comms
from functitan.pipeline._schedule import Action, Comm
from functitan.pipeline._split_backward import WeightGrad, input_grad
from functitan.pipeline._stages import Stages, pp_all_reduce, stage_tree
from functitan.transforms import split_batch
from functitan.tree import flatten_with_names


class Span(NamedTuple):
    """One compute action on this rank: its wall time (seconds, ``time.perf_counter``), the time it waited for
    its input (a receive) before starting, and this thread's CPU time inside it (``time.thread_time``; less
    than ``end - start`` when the OS ran another process meanwhile, as on a machine with fewer cores than
    ranks)."""

    action: Action
    start: float
    end: float
    wait: float = 0.0
    cpu: float = 0.0


class StepTimeline(NamedTuple):
    """One step of one rank: its compute spans and the step's start and end (for idle fractions)."""

    start: float
    end: float
    spans: tuple[Span, ...]

    @property
    def busy(self) -> float:
        return sum(s.end - s.start for s in self.spans)

    @property
    def idle_fraction(self) -> float:
        """1 - busy / step time: bubbles, waits on receives and communication, as a fraction of the step."""
        total = self.end - self.start
        return 1.0 - self.busy / total if total > 0 else 0.0

    @property
    def wait_fraction(self) -> float:
        """The part of `idle_fraction` spent waiting for received activations and gradients."""
        total = self.end - self.start
        return sum(s.wait for s in self.spans) / total if total > 0 else 0.0


class _Slot(NamedTuple):
    """What a stage keeps for one microbatch between F and its backward(s)."""

    inp: Tensor | None  # the stage input (requires grad) or None on stage 0
    out: Tensor  # the stage output, or the scaled loss on the last stage


def pipeline_grad_fn(
    stages: Stages, *, timeline: list[StepTimeline] | None = None
) -> Callable[[Any, Any], tuple[Any, Any]]:
    """A grad_fn ``(params, batch) -> (mean loss, grads)`` running ``stages.schedule`` on this rank.

    ``params`` is this rank's tree (`place_stages`), ``batch`` the data-parallel rank's batch, the same
    on every pipeline rank (stage 0 reads the inputs, the last stage the targets); it is split into
    ``schedule.microbatches`` microbatches along dim 0. The loss is the mean over microbatches, summed
    over the pipeline group so every pp rank returns it; ``grads`` mirror ``params`` (placements kept),
    for `functitan.step.make_train_step` unchanged; pass it ``norm_across=stages.pp_group`` so the gradient
    norm it reports and clips with covers every stage. With ``StageModel.aux`` (blocks with aux outputs, a
    MoE layer's) the value is ``(loss, aux metrics)``: each stage's loss terms join the loss where they arise
    (backward from the stage output also gives them their gradient), and terms and metrics are added over
    microbatches and stages (one all-reduce with the loss), as ``accumulate`` gives them on one process.

    Args:
        stages: from `make_stages`.
        timeline: if given, each call appends this rank's `StepTimeline` (compute spans; on CUDA each
            action is synchronized to be timed, which costs overlap).
    """
    program = with_comms(stages.schedule)[stages.pp_rank]
    aux_keys: dict[str, list[tuple[str, tuple[int, ...]]]] = {}  # "all": the aux sums every pp rank reduces

    def grad_fn(params: Any, batch: Any) -> tuple[Any, Any]:
        return _Run(stages, params, batch, timeline, aux_keys).execute(program)

    return grad_fn


class _Run:
    """The state of one step on one rank: pending receives and sends, kept activations, summed grads."""

    def __init__(
        self,
        stages: Stages,
        params: Any,
        batch: Any,
        timeline: list[StepTimeline] | None,
        aux_keys: dict[str, list[tuple[str, tuple[int, ...]]]] | None = None,
    ):
        self.stages, self.params, self.timeline = stages, params, timeline
        self.aux_keys = aux_keys if aux_keys is not None else {}
        self.aux_sums: dict[str, Tensor] = {}  # "term:<k>", "<metric>:sum", "<metric>:count" over microbatches
        self.m = stages.schedule.microbatches
        self.mbs = split_batch(batch, self.m)
        shape, self.dtype = stages.model.activation(self.mbs[0])
        self.shape = tuple(shape)
        self.device = _device_of(self.mbs[0])
        named, self.treedef = flatten_with_names(params)
        self.names = [n for n, _ in named]
        self.stored = [x for _, x in named]  # the params as given (DTensors in storage placement)
        self.leaves = self.stored
        if stages.stage_mesh.size() == 1:
            # Pure PP: on a one-rank stage mesh a DTensor is its local tensor and Layout needs no collective,
            # so compute on local leaves and skip DTensor's to_local / from_local autograd wrappers (about
            # 10% of a step of the benchmark's Llama); the grads get the stored leaves' specs at the end.
            self.leaves = [_local(x).detach().requires_grad_(x.requires_grad) for x in self.stored]
            self.params = optree.tree_unflatten(self.treedef, self.leaves)
        # These leaves are this step's own tensors, so BW can sum the microbatches' gradients in their ``.grad``
        # as torch's engine does (AccumulateGrad: the first taken over, the rest added in place, in C++ inside
        # the backward) instead of returning them to Python for a ``_foreach_add`` (whose out-of-place first
        # sum allocated a stage's worth of fresh memory each step): 3-4% of the benchmark's backward. The
        # same sums in the same order, so the same bits. DTensor leaves (a stage mesh) keep the Python path:
        # their ``.grad`` would be summed by DTensor dispatch.
        self.into_grad = self.leaves is not self.stored
        index = {n: i for i, n in enumerate(self.names)}
        # stage -> indices (into this rank's leaves) of the params it reads
        self.stage_leaves = {
            s: [index[n] for n, _ in flatten_with_names(stage_tree(params, stages, s))[0]] for s in stages.local
        }
        self.grads: list[Tensor | None] = [None] * len(self.leaves)
        self.owned: set[int] = set()  # grads[i] is a sum this run allocated (safe to add into in place)
        self.received: dict[tuple[str, int, int], tuple[Tensor, Any]] = {}  # (kind, stage, mb) -> buffer, work
        self.handoff: dict[tuple[str, int, int], Tensor] = {}  # same keys, tensors from a stage on this rank
        self.sends: list[tuple[Tensor, Any]] = []
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.pending_w: dict[tuple[int, int], WeightGrad | tuple[_Slot, Tensor | None]] = {}
        # (mean loss or TokenLoss sum, TokenLoss count, TokenLoss microbatches): only the last stage's rank knows
        # which kind its loss is, so every rank all-reduces all three
        self.loss = torch.zeros(3, device=self.device, dtype=torch.float32)
        self._one = torch.ones((), device=self.device, dtype=torch.float32)
        self.spans: list[Span] = []
        self.last_out: dict[tuple[int, int], Tensor] = {}  # the tensor a following send posts

    # -- the program
    def execute(self, program: tuple[Action | Comm, ...]) -> tuple[Any, Any]:
        start = time.perf_counter()
        with torch.enable_grad():
            for item in program:
                if isinstance(item, Comm):
                    self._comm(item)
                else:
                    self._compute(item)
        for _, work in self.sends:
            work.wait()
        leftover = sorted(self.slots) + sorted(self.pending_w)
        if leftover:
            raise RuntimeError(f"pipeline step ended with (stage, microbatch) {leftover} still waiting for a backward")
        keys = self._aux_keys() if self.stages.model.aux is not None else []
        parts = [self.aux_sums.get(k, torch.zeros(shape, device=self.device)).flatten() for k, shape in keys]
        reduced = pp_all_reduce(torch.cat([self.loss, *parts]), self.stages)  # one all-reduce for all of it
        total, count, token_mbs = reduced[:3].unbind()  # only the last stage's rank holds them
        loss: Any = TokenLoss(total, count) if token_mbs.item() > 0 else total
        if self.timeline is not None:
            self.timeline.append(StepTimeline(start, time.perf_counter(), tuple(self.spans)))
        grads = optree.tree_unflatten(self.treedef, self._final_grads())
        if self.stages.model.aux is None:
            return loss, grads
        return (loss, _aux_metrics(keys, reduced[3:], count)), grads

    def _aux_keys(self) -> list[tuple[str, tuple[int, ...]]]:
        """The aux sums of every stage, in one order on every pp rank (a rank whose stages have no MoE layer
        holds none of its own): gathered once, on the first step."""
        mine = sorted((k, tuple(v.shape)) for k, v in self.aux_sums.items())
        if valueless(self.loss):  # the planner's traced step: a fake group exchanges no objects (nor values)
            return mine
        if "all" not in self.aux_keys:
            group = self.stages.pp_group
            every: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, mine, group=group)
            self.aux_keys["all"] = sorted({item for rank in every for item in rank})
        return self.aux_keys["all"]

    def _comm(self, c: Comm) -> None:
        group = self.stages.pp_group
        if c.op == "recv":
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.received[(c.kind, c.stage, c.microbatch)] = (buf, dist.irecv(buf, group=group, group_src=c.peer))
        else:
            t = self.last_out.pop((c.stage, c.microbatch)).contiguous()
            self.sends.append((t, dist.isend(t, group=group, group_dst=c.peer)))

    def _take(self, kind: str, stage: int, mb: int) -> Tensor:
        """The activation ("F") into, or the output gradient ("B") of, ``stage`` for microbatch ``mb``."""
        key = (kind, stage, mb)
        if key in self.handoff:
            return self.handoff.pop(key)
        if key not in self.received:
            raise RuntimeError(f"pipeline program bug: {key} was neither received nor handed over before use")
        buf, work = self.received.pop(key)
        work.wait()
        return buf

    def _compute(self, a: Action) -> None:
        kind, s, mb = a
        last = s == self.stages.num_stages - 1
        # inputs first (their waits are not compute)
        w0 = time.perf_counter() if self.timeline is not None else 0.0
        x = self._take("F", s, mb) if kind == "F" and s > 0 else None
        dout = self._take("B", s, mb) if kind in ("B", "BW") and not last else None
        t0 = self._tic()
        c0 = time.thread_time() if self.timeline is not None else 0.0
        if kind == "F":
            self._forward(s, mb, x, last)
        elif kind == "W":
            pending = self.pending_w.pop((s, mb))
            if isinstance(pending, WeightGrad):  # from what B kept: only the weight branches run
                self._accumulate(s, pending())
            else:  # stage 0 (no input gradient): B did nothing, W is the whole backward
                slot, d = pending
                self._accumulate(s, torch.autograd.grad(slot.out, self._params_of(s), d, allow_unused=True))
        else:
            self._backward(kind, s, mb, dout)
        if self.timeline is not None:
            self.spans.append(Span(a, t0, self._tic(), t0 - w0, time.thread_time() - c0))

    def _forward(self, s: int, mb: int, x: Tensor | None, last: bool) -> None:
        st = self.stages
        params, batch = self.params, self.mbs[mb]
        inp = None if x is None else x.detach().requires_grad_(True)
        if s == 0:
            h = st.model.first(params, batch)
        elif inp is not None:
            h = inp
        else:  # _compute takes an input for every stage after the first
            raise RuntimeError(f"pipeline program bug: F on stage {s}, microbatch {mb} ran without its input")
        h = st.model.blocks([params[st.model.blocks_key][str(i)] for i in st.layers[s]], h)
        term = None
        if isinstance(h, tuple):  # blocks with aux (a MoE layer's): their loss terms join here, on this stage
            h, aux = h
            term = self._aux(s, aux, batch)
        if last:
            loss = st.model.last(params, h, batch)
            if isinstance(loss, TokenLoss):  # sums: the step divides by the count over the whole step
                h = loss.sum if term is None else loss.sum + term
                self.loss += torch.stack([h.detach().float(), loss.count.detach().float(), self._one])
            elif st.model.aux is not None:  # other stages' terms are sums over tokens too
                raise ValueError(
                    "the pipeline's blocks give loss terms (StageModel.aux) but its last stage returns a mean loss; "
                    "return a TokenLoss from StageModel.last (cross_entropy(..., reduction='tokens'))"
                )
            else:
                self.loss[0] += loss.detach().float() / self.m
                h = loss / self.m
        elif term is not None:
            self.loss[0] += term.detach().float()  # the loss sum over the step, added over pp ranks
            h = hand_grad(h, term, torch.ones_like(term))  # backward from h also gives the term its gradient, 1
        self.slots[(s, mb)] = _Slot(inp, h)
        if not last:
            out = h.detach()
            if st.schedule.stage_to_rank[s + 1] == st.pp_rank:
                self.handoff[("F", s + 1, mb)] = out
            else:
                self.last_out[(s, mb)] = out

    def _backward(self, kind: str, s: int, mb: int, dout: Tensor | None) -> None:
        slot = self.slots.pop((s, mb))
        inputs = [] if slot.inp is None else [slot.inp]
        params = self._params_of(s) if kind == "BW" else []
        if kind == "B" and slot.inp is not None:  # inputs == [slot.inp]
            dx, self.pending_w[(s, mb)] = input_grad(slot.out, slot.inp, dout, self._params_of(s))
            self._send_input_grad(s, mb, dx if dx is not None else torch.zeros_like(slot.inp))
            return
        if kind == "B":
            self.pending_w[(s, mb)] = (slot, dout)
        if kind == "BW" and self.into_grad:
            if inputs or params:
                torch.autograd.backward(slot.out, dout, inputs=inputs + params)
            if slot.inp is not None:
                dx = slot.inp.grad
                self._send_input_grad(s, mb, dx if dx is not None else torch.zeros_like(slot.inp))
            return
        if inputs or params:
            grads = torch.autograd.grad(slot.out, inputs + params, dout, retain_graph=kind == "B", allow_unused=True)
        else:
            grads = ()
        if params:
            self._accumulate(s, grads[len(inputs) :])
        if slot.inp is not None:
            self._send_input_grad(s, mb, grads[0] if grads[0] is not None else torch.zeros_like(slot.inp))

    def _aux(self, s: int, aux: Any, batch: Any) -> Tensor | None:
        """Stage ``s``'s loss term for one microbatch (None: none), its terms and metrics added into the sums."""
        if self.stages.model.aux is None:
            raise ValueError(
                f"stage {s}'s blocks returned (x, aux), but its StageModel has no aux; give StageModel(aux=...) "
                f"(functitan.model.Pieces derives it), or return x alone"
            )
        terms, metrics = self.stages.model.aux(aux, batch)
        for name, leaf in flatten_with_names(metrics, is_leaf=lambda x: isinstance(x, TokenLoss))[0]:
            if not isinstance(leaf, TokenLoss):
                raise TypeError(
                    f"pipeline aux metric {name!r} is a {type(leaf).__name__}; the stages add their metrics over "
                    f"microbatches and stages, so each is a TokenLoss(sum, count)"
                )
            self._add(f"{name}:sum", leaf.sum)
            self._add(f"{name}:count", leaf.count)
        for k, t in terms.items():
            self._add(f"term:{k}", t)
        return sum(terms.values()) if terms else None  # type: ignore[return-value]

    def _add(self, key: str, x: Tensor) -> None:
        x = x.detach().float().to(self.device)
        self.aux_sums[key] = self.aux_sums[key] + x if key in self.aux_sums else x

    def _send_input_grad(self, s: int, mb: int, dx: Tensor) -> None:
        if self.stages.schedule.stage_to_rank[s - 1] == self.stages.pp_rank:
            self.handoff[("B", s - 1, mb)] = dx
        else:
            self.last_out[(s, mb)] = dx

    # -- gradients
    def _params_of(self, s: int) -> list[Tensor]:
        return [self.leaves[i] for i in self.stage_leaves[s]]

    def _accumulate(self, s: int, grads: Sequence[Tensor | None]) -> None:
        # (leaf index, the sum so far, this microbatch's gradient)
        add_into: list[tuple[int, Tensor, Tensor]] = []  # sums this run owns: add in place
        add_new: list[tuple[int, Tensor, Tensor]] = []  # a first gradient that may alias a tensor autograd keeps
        for i, g in zip(self.stage_leaves[s], grads):
            if g is None:
                continue
            total = self.grads[i]
            if total is None:
                self.grads[i] = g
            else:
                (add_into if i in self.owned else add_new).append((i, total, g))
        if add_into:  # one foreach call per microbatch instead of one op per leaf
            torch._foreach_add_([_local(t) for _, t, _ in add_into], [_local(g) for _, _, g in add_into])
        if add_new:
            sums = torch._foreach_add([_local(t) for _, t, _ in add_new], [_local(g) for _, _, g in add_new])
            for (i, total, _), t in zip(add_new, sums):
                self.grads[i] = _wrap_like(total, t)
                self.owned.add(i)

    def _final_grads(self) -> list[Tensor]:
        out = []
        for p, leaf, g in zip(self.stored, self.leaves, self.grads):
            if self.into_grad and leaf.grad is not None:  # BW's sums (and W's, if a stage ran both kinds)
                g = leaf.grad if g is None else leaf.grad + g
            g = torch.zeros_like(_local(p)) if g is None else g
            out.append(g if isinstance(g, _dt.DTensor) else _wrap_like(p, g))
        return out

    def _tic(self) -> float:
        if self.timeline is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _aux_metrics(keys: list[tuple[str, tuple[int, ...]]], flat: Tensor, count: Tensor) -> dict[str, TokenLoss]:
    """The step's aux metrics from the reduced sums: each term as ``TokenLoss(term, the loss's tokens)``, each
    metric as ``TokenLoss(sum, count)``, both over every microbatch and stage."""
    sums: dict[str, Tensor] = {}
    at = 0
    for k, shape in keys:
        n = math.prod(shape)
        sums[k] = flat[at : at + n].reshape(shape)
        at += n
    out: dict[str, TokenLoss] = {}
    for k, v in sums.items():
        if k.startswith("term:"):
            out[k[5:]] = TokenLoss(v, count)
        elif k.endswith(":sum"):
            out[k[:-4]] = TokenLoss(v, sums[k[:-4] + ":count"])
    return out


def _wrap_like(ref: Tensor, local: Tensor) -> Tensor:
    """``local`` with ``ref``'s DTensor spec (``ref`` a plain tensor: ``local`` itself)."""
    return _dt.wrap(local, _dt.spec(ref))


_local = _dt.local


def _device_of(batch: Any) -> torch.device:
    for x in optree.tree_leaves(batch):
        if isinstance(x, Tensor):
            return x.device
    raise TypeError("the pipeline batch holds no tensor; pass e.g. {'inputs': tokens, 'targets': tokens}")
