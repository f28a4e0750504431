"""Pipeline parallelism: schedules as data (generate, validate, simulate, draw, CSV) and their executor.

A `Schedule` is one ordered list of `Action`s (F, B, W, BW on a stage and microbatch) per rank; the
point-to-point traffic follows from stage adjacency (`with_comms`). `make_stages` splits a pure-function model
into balanced stages and `pipeline_grad_fn` runs a rank's list as a train-step grad_fn.

    >>> from functitan import pipeline
    >>> s = pipeline.one_f_one_b(pp=4, m=8)
    >>> sim = pipeline.simulate(s, pipeline.Costs(f=1, b=1, w=1, p2p=0))
    >>> sim.bubble_fraction == 3 / 11  # (p-1)/(m+p-1)
    True
"""

from typing import TYPE_CHECKING

from functitan._lazy import lazy_exports
from functitan.pipeline._comms import with_comms
from functitan.pipeline._csvfile import load_csv, save_csv
from functitan.pipeline._generators import (
    SCHEDULE_NAMES,
    ScheduleName,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    zb_h1,
    zb_v,
)
from functitan.pipeline._render import render_png, render_text, summary
from functitan.pipeline._schedule import (
    KINDS,
    Action,
    Comm,
    Schedule,
    dependencies,
    loop_placement,
    split_pairs,
    v_placement,
)
from functitan.pipeline._simulate import Costs, Simulation, peak_activations, simulate
from functitan.pipeline._validate import validate

if TYPE_CHECKING:  # imported on first use (functitan._lazy): they import torch, schedules as data do not
    from functitan.pipeline._executor import Span, StepTimeline, pipeline_grad_fn
    from functitan.pipeline._fit import fit_costs
    from functitan.pipeline._stages import (
        StageModel,
        Stages,
        balance,
        balanced_layers,
        blocks_per_rank,
        make_stages,
        place_stages,
        rank_tree,
        stage_mesh,
        stage_rules,
        stage_tree,
    )

__getattr__ = lazy_exports(
    __name__,
    {
        "._executor": ("Span", "StepTimeline", "pipeline_grad_fn"),
        "._fit": ("fit_costs",),
        "._stages": (
            "StageModel",
            "Stages",
            "balance",
            "balanced_layers",
            "blocks_per_rank",
            "make_stages",
            "place_stages",
            "rank_tree",
            "stage_mesh",
            "stage_rules",
            "stage_tree",
        ),
    },
)

__all__ = [
    "KINDS",
    "SCHEDULE_NAMES",
    "ScheduleName",
    "Action",
    "Comm",
    "Costs",
    "Schedule",
    "Simulation",
    "Span",
    "StageModel",
    "Stages",
    "StepTimeline",
    "balance",
    "balanced_layers",
    "blocks_per_rank",
    "dependencies",
    "fit_costs",
    "gpipe",
    "interleaved_1f1b",
    "load_csv",
    "loop_placement",
    "make_schedule",
    "make_stages",
    "one_f_one_b",
    "peak_activations",
    "pipeline_grad_fn",
    "place_stages",
    "rank_tree",
    "render_png",
    "render_text",
    "save_csv",
    "simulate",
    "split_pairs",
    "stage_mesh",
    "stage_rules",
    "stage_tree",
    "summary",
    "v_placement",
    "validate",
    "with_comms",
    "zb_h1",
    "zb_v",
]
