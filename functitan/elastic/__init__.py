"""Elastic training: the launcher, preemption, restart-based elasticity and live membership (docs/elastic.md).

* :func:`launch` runs torchrun for ``functitan train --nproc N [--nnodes MIN:MAX ...]``, forwards SIGTERM/SIGINT
  and shows a rank's user error as one line.
* :class:`Preemption` turns SIGTERM/SIGINT into "checkpoint at the next step boundary and exit 0".
* :class:`NoQuorum`: a live group's peers are gone (the trainer saves, then reports it as one line).
* :func:`split_batch` keeps the global batch when the data-parallel size changes.
* ``functitan.elastic.live`` (needs the ``elastic`` extra, torchft): replica groups join and leave while the
  others keep stepping.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ._batch import BatchSplitError, split_batch, world_sizes_for
from ._config import ElasticConfig
from ._launch import (
    LaunchError,
    LaunchSpec,
    launch,
    parse_launch_args,
    report_run,
    report_stopped,
    torchrun_command,
)
from ._noquorum import NoQuorum
from ._orphans import watch_launcher

if TYPE_CHECKING:  # imported on first use (functitan._lazy): it agrees on a stop over torch.distributed
    from ._preempt import Preemption

__getattr__ = lazy_exports(__name__, {"._preempt": ("Preemption",)})

__all__ = [
    "BatchSplitError",
    "split_batch",
    "world_sizes_for",
    "ElasticConfig",
    "LaunchError",
    "LaunchSpec",
    "launch",
    "parse_launch_args",
    "report_stopped",
    "report_run",
    "torchrun_command",
    "NoQuorum",
    "Preemption",
    "watch_launcher",
]
