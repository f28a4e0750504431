"""Training metrics: model FLOPs, peak FLOP/s, MFU, peak memory, and the sinks that record them.

Data flow in the trainer::

    fpt  = transformer_flops_per_token(n_params=..., n_layers=..., n_heads=..., head_dim=..., seq_len=...)
    peak = peak_flops(device, torch.bfloat16)           # PeakFlops(value | None, source)
    meter = Meter(world_size=ws, flops_per_token=fpt, peak=peak)
    sinks = make_sinks(run_dir, total_steps, rank=rank, metrics=cfg.metrics, config=cfg)  # + W&B if asked
    with Profiler(cfg.profile, run_dir, rank=rank, device=device, start=step0) as profiler:
    ...each step: meter.update(wall_s=..., data_s=..., tokens=global_tokens); profiler.step(step)
    ...each log step: sinks.write(step, {"loss": ..., **meter.flush(), **peak_memory(device)});
                      reset_peak_memory(device)
    ...afterwards: write_report([load_run("runs/a"), load_run("runs/b")], "runs/report")  # PNG + HTML
"""

from ._flops import transformer_flops_per_token
from ._memory import peak_memory, reset_peak_memory
from ._meter import Meter, throughput
from ._peak import PeakFlops, peak_flops
from ._profile import Profiler
from ._report import ReportError, Run, load_run, render_html, render_png, summarize, write_report
from ._sinks import GROUPS, ConsoleSink, JsonlSink, MultiSink, Sink, TensorBoardSink, WandbSink, make_sinks

__all__ = [
    "transformer_flops_per_token",
    "PeakFlops",
    "peak_flops",
    "reset_peak_memory",
    "peak_memory",
    "throughput",
    "Meter",
    "Sink",
    "ConsoleSink",
    "JsonlSink",
    "TensorBoardSink",
    "WandbSink",
    "GROUPS",
    "MultiSink",
    "make_sinks",
    "Profiler",
    "Run",
    "ReportError",
    "load_run",
    "summarize",
    "render_png",
    "render_html",
    "write_report",
]
