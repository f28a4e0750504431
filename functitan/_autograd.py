"""One autograd node the MoE balance and the pipeline's loss terms both use: a gradient handed to a tensor
alongside another's backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["hand_grad"]


class _HandGrad(torch.autograd.Function):
    """Identity on ``out``; ``x``'s gradient is ``grad``, whatever ``out``'s is."""

    @staticmethod
    def forward(out: Tensor, x: Tensor, grad: Tensor) -> Tensor:
        return out.view_as(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
        _, x, grad = inputs
        ctx.save_for_backward(grad.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None]:
        (grad,) = ctx.saved_tensors
        return g, grad, None


def hand_grad(out: Tensor, x: Tensor, grad: Tensor) -> Tensor:
    """``out`` unchanged; a backward through it also gives ``x`` the gradient ``grad`` (``x``'s shape). Outside
    autograd (no grad mode, or ``x`` without ``requires_grad``) ``out`` itself."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return out
    return _HandGrad.apply(out, x, grad)
