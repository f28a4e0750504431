"""Learning-rate schedules: pure functions ``step -> float``, read at steps 0, 1, 2, ...

Warmup is linear and reaches ``peak`` at step ``warmup_steps - 1`` (step 0 already trains, at
``peak / warmup_steps``). The decay phase runs from ``peak`` at step ``warmup_steps`` (or at the decay start for
``wsd``) to ``final`` at step ``total_steps`` and stays there after. For example
``warmup_cosine(1.0, warmup_steps=10, total_steps=110)`` gives 0.1 at step 0, 1.0 at steps 9 and 10, 0.5 at
step 60 and 0.0 at step 110.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["constant", "warmup_cosine", "warmup_linear", "wsd", "join_schedules"]

Schedule = Callable[[Any], Any]  # step (int, or a 0-d tensor under torch.compile) -> rate (float, or 0-d tensor)

# Each schedule reads a Python int eagerly (plain float math, no tensor op per step) and a 0-d step tensor under
# torch.compile, where it becomes part of the compiled train step (no graph break, no recompile per step). This
# module does not import torch: a config is checked by building its schedule (functitan.job_config), in processes
# that never need torch (the `--nproc` launcher); a tensor step means torch is already imported.


def _torch(x: Any) -> Any:
    """The torch module when ``x`` is a tensor, else None."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(x, torch.Tensor) else None


def _step(step: Any) -> Any:
    torch = _torch(step)
    return step.to(torch.float64) if torch else int(step)


def _where(cond: Any, a: Any, b: Any) -> Any:
    if torch := _torch(cond):
        return torch.where(cond, torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))
    return a if cond else b


def _clamp01(x: Any) -> Any:
    return x.clamp(0.0, 1.0) if _torch(x) else min(max(x, 0.0), 1.0)


def _cos(x: Any) -> Any:
    return torch.cos(x) if (torch := _torch(x)) else math.cos(x)


def _check(peak: float, warmup_steps: int, total_steps: int, final: float, name: str) -> None:
    if peak < 0 or final < 0:
        raise ValueError(
            f"{name}: peak={peak}, final={final}; learning rates are non-negative, e.g. peak=3e-4, final=0.0"
        )
    if final > peak:
        raise ValueError(f"{name}: final={final} is above peak={peak}; pass final <= peak (a decay ends lower)")
    if warmup_steps < 0 or total_steps <= 0:
        raise ValueError(
            f"{name}: warmup_steps={warmup_steps}, total_steps={total_steps}; pass warmup_steps >= 0 and "
            f"total_steps > 0"
        )
    if warmup_steps > total_steps:
        raise ValueError(
            f"{name}: warmup_steps={warmup_steps} exceeds total_steps={total_steps}; pass warmup_steps <= "
            f"total_steps (e.g. warmup_steps={max(total_steps // 10, 1)})"
        )


def _warmup(peak: float, warmup_steps: int, step: int) -> float:
    return peak * (step + 1) / warmup_steps


def constant(value: float) -> Schedule:
    """``value`` at every step."""
    if value < 0:
        raise ValueError(f"constant: value={value}; a learning rate is non-negative")
    return lambda step: _torch(step).full_like(_step(step), float(value)) if _torch(step) else float(value)


def _warmup_then(
    peak: float, warmup_steps: int, total_steps: int, final: float, shape: Callable[[float], float]
) -> Schedule:
    """Warmup, then ``final + (peak - final) * shape(progress)`` with progress going 0 -> 1 until total_steps."""
    span = max(total_steps - warmup_steps, 1)

    def schedule(step: Any) -> Any:
        step = _step(step)
        progress = _clamp01((step - warmup_steps) / span)
        return _where(
            step < warmup_steps, _warmup(peak, max(warmup_steps, 1), step), final + (peak - final) * shape(progress)
        )

    return schedule


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, final: float = 0.0) -> Schedule:
    """Linear warmup to ``peak``, then half a cosine down to ``final`` at ``total_steps`` (Loshchilov & Hutter,
    2017). The cosine's midpoint, step ``(warmup_steps + total_steps) / 2``, gives ``(peak + final) / 2``."""
    _check(peak, warmup_steps, total_steps, final, "warmup_cosine")
    return _warmup_then(peak, warmup_steps, total_steps, final, lambda p: 0.5 * (1 + _cos(math.pi * p)))


def warmup_linear(peak: float, warmup_steps: int, total_steps: int, final: float = 0.0) -> Schedule:
    """Linear warmup to ``peak``, then a straight line down to ``final`` at ``total_steps``."""
    _check(peak, warmup_steps, total_steps, final, "warmup_linear")
    return _warmup_then(peak, warmup_steps, total_steps, final, lambda p: 1 - p)


def wsd(peak: float, warmup_steps: int, total_steps: int, decay_fraction: float = 0.1, final: float = 0.0) -> Schedule:
    """Warmup-stable-decay (Hu et al., 2024, MiniCPM): linear warmup, ``peak`` held, then a linear decay to
    ``final`` over the last ``decay_fraction`` of ``total_steps``. Checkpoints from the stable phase can be
    decayed later, which is why runs of several lengths can share one.

    ``wsd(1.0, 10, 100, decay_fraction=0.2)``: 0.1 at step 0, 1.0 from step 9 to 80, 0.5 at step 90, 0.0 at 100.
    """
    _check(peak, warmup_steps, total_steps, final, "wsd")
    if not 0 <= decay_fraction <= 1:
        raise ValueError(f"wsd: decay_fraction={decay_fraction}; pass a fraction of total_steps in [0, 1], e.g. 0.1")
    decay_steps = round(decay_fraction * total_steps)
    decay_start = total_steps - decay_steps
    if decay_start < warmup_steps:
        raise ValueError(
            f"wsd: the decay ({decay_steps} steps, decay_fraction={decay_fraction} of {total_steps}) would start at "
            f"step {decay_start}, inside the {warmup_steps}-step warmup; lower decay_fraction or warmup_steps"
        )

    def schedule(step: Any) -> Any:
        step = _step(step)
        decay = final + (peak - final) * (1 - _clamp01((step - decay_start) / max(decay_steps, 1)))
        held = _where(step < decay_start, float(peak), decay) if decay_steps else float(peak)
        return _where(step < warmup_steps, _warmup(peak, max(warmup_steps, 1), step), held)

    return schedule


def join_schedules(schedules: list[Schedule], boundaries: list[int]) -> Schedule:
    """``optax.join_schedules``: ``schedules[i]`` from step ``boundaries[i-1]`` on, read at the step counted
    from its own start (``step - boundaries[i-1]``). ``len(boundaries) == len(schedules) - 1``.

    ``join_schedules([constant(1.0), lambda s: 1.0 / (1 + s)], [10])``: 1.0 up to step 9, 1.0 at 10, 0.5 at 11.
    """
    if len(boundaries) != len(schedules) - 1 or any(b > c for b, c in zip(boundaries, boundaries[1:])):
        raise ValueError(
            f"join_schedules: {len(schedules)} schedules need {len(schedules) - 1} increasing boundaries, "
            f"got {boundaries}"
        )

    def schedule(step: Any) -> Any:
        if torch := _torch(step):  # every piece evaluated, the right one selected: no data-dependent branch
            out = schedules[0](step)
            for b, piece in zip(boundaries, schedules[1:]):
                out = torch.where(step >= b, torch.as_tensor(piece(step - b), dtype=torch.float64), out)
            return out
        step, start, i = int(step), 0, 0
        while i < len(boundaries) and step >= boundaries[i]:
            start, i = boundaries[i], i + 1
        return float(schedules[i](step - start))

    return schedule
