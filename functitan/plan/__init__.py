"""``functitan plan``: per-rank memory and step time of every parallel layout, from the trainer's own step.

    from functitan.plan import plan, device, Cluster
    p = plan(model_name="llama", flavor="llama3_8b", overrides={}, cluster=Cluster(device=device("h100"),
             nodes=8, per_node=8), global_batch_tokens=4 * 2**20, seq_len=8192)
    p.rows[0].cand, p.rows[0].peak, p.cfg          # the recommended layout, its peak bytes, its JobConfig

See docs/autotune.md.
"""

from ._candidates import Candidate, enumerate_candidates, job_config
from ._cli import main
from ._devices import DEVICES, Cluster, Device, calibrate, device
from ._plan import MARGIN, MOE_LOAD, Plan, PlanError, Row, plan, rank
from ._predict import Prediction, model_shape, predict
from ._report import render_png, table, write_toml
from ._trace import RankTrace, build_step, step_peak, trace_rank, young_heap

__all__ = [
    "Candidate",
    "enumerate_candidates",
    "job_config",
    "main",
    "DEVICES",
    "Cluster",
    "Device",
    "calibrate",
    "device",
    "Plan",
    "PlanError",
    "Row",
    "plan",
    "rank",
    "MARGIN",
    "MOE_LOAD",
    "Prediction",
    "model_shape",
    "predict",
    "render_png",
    "table",
    "write_toml",
    "RankTrace",
    "build_step",
    "step_peak",
    "young_heap",
    "trace_rank",
]
