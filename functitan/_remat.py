"""Activation-checkpointing (remat) policies as values, like ``jax.checkpoint_policies``.

A policy says which activations of a region the forward keeps for backward; the rest are recomputed.

| policy                       | config (``training.remat``) | keeps                                              |
|------------------------------|-----------------------------|----------------------------------------------------|
| ``everything_saveable``      | ``"none"``                  | every activation (no recomputation)                |
| ``nothing_saveable``         | ``"full"``                  | the region's inputs only                           |
| ``save_matmuls``             | ``"selective"``             | matmul and attention outputs (torchtitan's "op")   |
| ``save_only_these_names(*n)``| (Python only)               | activations tagged ``name(x, n)``, nothing else    |
| ``offload_to_host``          | ``"offload"``               | every activation, moved to host memory in forward  |

``offload_to_host`` copies saved activations to pinned host memory and back in backward
(``torch.autograd.graph.save_on_cpu``); on a CPU device they are already in host memory, so it equals
``everything_saveable`` there. Under a torch.func transform (vmap, torch.func grad), which does not allow
saved-tensor hooks, every policy runs the region plainly (same values, no memory saved).

>>> import torch
>>> f = remat(lambda x: name(x.sin(), "s").cos(), save_only_these_names("s"))
>>> x = torch.ones(2, requires_grad=True)
>>> torch.autograd.grad(f(x).sum(), x)[0]
tensor([-0.4029, -0.4029])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._functorch import peek_interpreter_stack
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from . import _collectives
from ._choices import REMAT_POLICIES, RematName

__all__ = [
    "Policy",
    "RematName",
    "REMAT_POLICIES",
    "everything_saveable",
    "nothing_saveable",
    "save_matmuls",
    "save_only_these_names",
    "offload_to_host",
    "as_policy",
    "apply",
    "offload_hooks",
    "remat",
    "name",
]


_aten = torch.ops.aten
# Expensive to recompute: matmuls and attention. The elementwise ops between them are recomputed.
_MATMUL_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)


# A tag is an op the selective-checkpoint policy can see with its name: ``name(x, "attn_out")``.
@torch.library.custom_op("functitan::checkpoint_name", mutates_args=())
def _name_op(x: torch.Tensor, tag: str) -> torch.Tensor:
    return x.clone()


@_name_op.register_fake
def _(x: torch.Tensor, tag: str) -> torch.Tensor:
    return torch.empty_like(x)


def _name_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
    return g, None


_name_op.register_autograd(_name_backward)


def name(x: torch.Tensor, tag: str) -> torch.Tensor:
    """Tag an activation for ``save_only_these_names`` (``jax.ad_checkpoint.checkpoint_name``); the value is
    ``x``. Outside a remat region with that policy it costs one copy of ``x``, so tag only what a policy keeps."""
    return _name_op(x, tag)


@dataclass(frozen=True)
class Policy:
    """What a remat region keeps for backward. ``save``: ``(op, args) -> bool`` for a selective policy,
    ``"all"`` (no checkpoint) or ``"none"`` (full checkpoint); ``offload``: saved tensors go to host memory."""

    label: str
    save: Any = "all"
    offload: bool = False

    @property
    def single_backward(self) -> bool:
        """Selective checkpointing allows one backward per forward (zero-bubble schedules need two)."""
        return callable(self.save)

    @property
    def checkpoints(self) -> bool:
        return self.save != "all"

    def __repr__(self) -> str:
        return self.label


everything_saveable = Policy("everything_saveable")
nothing_saveable = Policy("nothing_saveable", save="none")
offload_to_host = Policy("offload_to_host", offload=True)


def _save_matmul(op: Any, args: tuple) -> bool:
    return op in _MATMUL_OPS


save_matmuls = Policy("save_matmuls", save=_save_matmul)


def save_only_these_names(*names: str) -> Policy:
    """Keep only activations tagged with one of ``names`` by ``name(x, tag)``; recompute the rest."""
    wanted = frozenset(names)

    def save(op: Any, args: tuple) -> bool:
        return op is torch.ops.functitan.checkpoint_name.default and args[1] in wanted

    return Policy(f"save_only_these_names{tuple(sorted(wanted))}", save=save)


_BY_NAME: dict[str, Policy] = {
    "none": everything_saveable,
    "full": nothing_saveable,
    "selective": save_matmuls,
    "offload": offload_to_host,
}


def as_policy(p: str | Policy) -> Policy:
    """A policy from its config spelling (``"none" | "full" | "selective" | "offload"``) or itself."""
    if isinstance(p, Policy):
        return p
    if p not in _BY_NAME:
        raise ValueError(
            f"training.remat={p!r} is not a policy; choose one of {REMAT_POLICIES} (or pass a "
            f"functitan.transforms.Policy, e.g. save_only_these_names('attn_out'))"
        )
    return _BY_NAME[p]


def _context_fn(save: Callable[[Any, tuple], bool]) -> Callable[[], Any]:
    def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if _collectives.GATHERING.get():  # FSDP's parameter all-gathers are recomputed, never kept
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if save(op, args) else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, decide)


def offload_hooks(
    pack_first: Callable[[Any], Any] | None = None, unpack_first: Callable[[Any], Any] | None = None
) -> Any:
    """Saved-tensor hooks that move saved tensors to host memory (pinned where CUDA is available) and back;
    ``pack_first``/``unpack_first`` run before (FSDP's regather packs gathered params as handles, not copies)."""

    def pack(t: torch.Tensor) -> Any:
        t = pack_first(t) if pack_first is not None else t
        if not isinstance(t, torch.Tensor) or t.device.type == "cpu":
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=torch.cuda.is_available())
        host.copy_(t, non_blocking=True)
        return (t.device, host)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple) and len(packed) == 2 and isinstance(packed[1], torch.Tensor):
            packed = packed[1].to(packed[0], non_blocking=True)
        return unpack_first(packed) if unpack_first is not None else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def apply(p: Policy, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` as a remat region under policy ``p``."""
    if not torch.is_grad_enabled() or peek_interpreter_stack() is not None:
        return fn(*args, **kwargs)
    if p.offload:
        with offload_hooks():
            return fn(*args, **kwargs)
    if p.save == "all":
        return fn(*args, **kwargs)
    if p.save == "none":
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_context_fn(p.save), **kwargs)


def remat(fn: Callable[..., Any], policy: str | Policy = nothing_saveable) -> Callable[..., Any]:
    """``jax.checkpoint``: ``fn`` that keeps for backward only what ``policy`` saves (default: its inputs)."""
    p = as_policy(policy)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return apply(p, fn, *args, **kwargs)

    return wrapped
