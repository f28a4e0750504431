"""Throughput from timings: tokens/s, achieved TFLOP/s and MFU of a logging window."""

from __future__ import annotations

from ._peak import PeakFlops

__all__ = ["throughput", "Meter"]


def throughput(
    *,
    wall_s: float,
    data_s: float,
    tokens: int,
    world_size: int,
    flops_per_token: float,
    peak: PeakFlops | float | None,
    steps: int = 1,
) -> dict[str, float | None]:
    """Turn the timings of ``steps`` training steps into the throughput metrics of a log line.

    MFU (PaLM, arXiv:2204.02311, Appendix B) is achieved model FLOP/s over peak FLOP/s, per device::

        tokens_per_s_per_device = tokens / wall_s / world_size
        tflops                  = flops_per_token * tokens_per_s_per_device / 1e12
        mfu                     = 100 * tflops * 1e12 / peak

    Args:
      wall_s: wall time of the ``steps`` steps, data waiting included (what a user waits for).
      data_s: the part of ``wall_s`` spent waiting for the next batch.
      tokens: tokens trained in the ``steps`` steps, summed over all ranks (the global batch).
      world_size: devices sharing those tokens (every rank of the mesh, whatever the parallelism).
      flops_per_token: model FLOPs per token, e.g. from ``transformer_flops_per_token``.
      peak: peak FLOP/s of one device (``PeakFlops`` or a float); None or ``PeakFlops(None, ...)`` makes
        ``mfu`` None rather than a guess.
      steps: how many steps the window holds; step and data times are reported per step.

    Returns:
      ``tokens_per_s`` (global), ``tokens_per_s_per_device``, ``tflops`` (achieved TFLOP/s per device),
      ``mfu`` (percent, or None), ``step_time_s`` and ``data_time_s`` (per step). An achieved rate above
      the peak means the peak is wrong (a CPU calibration run on a busy machine), not an MFU over 100%:
      ``mfu`` is then None and ``mfu_above_peak`` holds achieved / peak (a ratio > 1) instead.
    """
    if not wall_s > 0:
        raise ValueError(f"throughput: wall_s must be > 0 seconds, got {wall_s!r}")
    if not 0 <= data_s <= wall_s:
        raise ValueError(
            f"throughput: data_s={data_s!r} must lie in [0, wall_s={wall_s!r}]; wall_s includes the data wait"
        )
    if world_size < 1 or steps < 1 or tokens < 0:
        raise ValueError(
            f"throughput: need world_size >= 1, steps >= 1, tokens >= 0; got {world_size=}, {steps=}, {tokens=}"
        )
    peak_value = peak.value if isinstance(peak, PeakFlops) else peak
    tokens_per_s = tokens / wall_s
    per_device = tokens_per_s / world_size
    achieved = flops_per_token * per_device  # FLOP/s of one device
    ratio = achieved / peak_value if peak_value else None
    out = {
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device,
        "tflops": achieved / 1e12,
        "mfu": 100.0 * ratio if ratio is not None and ratio <= 1 else None,
        "step_time_s": wall_s / steps,
        "data_time_s": data_s / steps,
    }
    if ratio is not None and ratio > 1:
        out["mfu_above_peak"] = ratio
    return out


class Meter:
    """Sums step timings between two log lines, then reports them through ``throughput``.

    Averaging over the logging window (as torchtitan does) smooths per-step jitter, and the data wait of
    every step is counted, not only that of the step that happens to log.

    Example:
      >>> m = Meter(world_size=2, flops_per_token=6e9, peak=1e15)
      >>> m.update(wall_s=0.5, data_s=0.1, tokens=4096)
      >>> m.update(wall_s=0.5, data_s=0.1, tokens=4096)
      >>> round(m.flush()["mfu"], 3)
      2.458
    """

    def __init__(self, *, world_size: int, flops_per_token: float, peak: PeakFlops | float | None):
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak = peak
        self._reset()

    def _reset(self) -> None:
        self._wall_s, self._data_s, self._tokens, self._steps = 0.0, 0.0, 0, 0

    def update(self, *, wall_s: float, data_s: float, tokens: int) -> None:
        """Add one step: its wall time (data wait included), its data wait, its global token count."""
        self._wall_s += wall_s
        self._data_s += data_s
        self._tokens += tokens
        self._steps += 1

    def flush(self) -> dict[str, float | None]:
        """The window's throughput metrics (see ``throughput``); starts a new window."""
        if self._steps == 0:
            raise ValueError("Meter.flush: no step was recorded since the last flush; call update() first")
        out = throughput(
            wall_s=self._wall_s,
            data_s=self._data_s,
            tokens=self._tokens,
            world_size=self.world_size,
            flops_per_token=self.flops_per_token,
            peak=self.peak,
            steps=self._steps,
        )
        self._reset()
        return out
