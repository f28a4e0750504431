"""Elastic training: the launcher, preemption, restart-based elasticity and live membership (docs/elastic.md).

* :func:`launch` runs torchrun for ``functitan train --nproc N [--nnodes MIN:MAX ...]``, forwards SIGTERM/SIGINT
  and shows a rank's user error as one line.
* :class:`NoQuorum`: a live group's peers are gone (the trainer saves, then reports it as one line).
* ``functitan.elastic.live`` (``live_stepper``; needs the ``elastic`` extra, torchft): the trainer's stepper
  for replica groups that join and leave while the others keep stepping, handed to ``functitan.train.run`` by
  the command line.

The trainer's own pieces that elastic runs rely on are re-exported here: :class:`Preemption` (SIGTERM/SIGINT:
checkpoint at the next step boundary and exit 0, functitan._preempt), :func:`split_batch` (the global batch kept
when the data-parallel size changes, functitan._batch) and :class:`ElasticConfig` (functitan.job_config).
"""

from typing import TYPE_CHECKING

from .._batch import BatchSplitError, split_batch, world_sizes_for
from .._lazy import lazy_exports
from ..job_config import ElasticConfig
from ._launch import LaunchError, LaunchSpec, launch, parse_launch_args, torchrun_command
from ._noquorum import NoQuorum
from ._orphans import watch_launcher

if TYPE_CHECKING:  # imported on first use (functitan._lazy): it agrees on a stop over torch.distributed
    from .._preempt import Preemption

__getattr__ = lazy_exports(__name__, {"functitan._preempt": ("Preemption",)})

__all__ = [
    "BatchSplitError",
    "split_batch",
    "world_sizes_for",
    "ElasticConfig",
    "LaunchError",
    "LaunchSpec",
    "launch",
    "parse_launch_args",
    "torchrun_command",
    "NoQuorum",
    "Preemption",
    "watch_launcher",
]
