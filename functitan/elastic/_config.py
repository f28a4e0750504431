"""The ``[elastic]`` config section: what may change when workers join and leave, and the live level's knobs."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ElasticConfig"]


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """How a run adapts to its world size (docs/elastic.md).

    The data-parallel degree given as -1 (``parallelism.dp_shard`` by default) is the elastic one; ``tp`` and
    ``pp`` stay fixed. ``training.batch_size`` is global and stays constant: the per-rank batch follows the
    data-parallel size.

    Attributes:
        microbatch_size: sequences per microbatch on each rank. 0 keeps ``training.microbatches`` fixed;
            set it for elastic runs so the microbatch count follows the per-rank batch (memory stays put).
        live: keep training through membership changes without restarting (torchft replica groups).
        lighthouse: the torchft lighthouse, ``http://HOST:PORT`` (live only).
        replica_id: this replica group's name (live only; default: host and process id).
        min_replicas: steps commit only with at least this many replica groups (live only).
        timeout_s: a collective or commit vote that takes longer marks the peer dead (live only).
        quorum_timeout_s: how long a step waits for a quorum (live only).
        advertise_host: the address peers reach this group at (live only; default: the host name).
    """

    microbatch_size: int = 0
    live: bool = False
    lighthouse: str = ""
    replica_id: str = ""
    min_replicas: int = 1
    timeout_s: float = 10.0
    quorum_timeout_s: float = 120.0
    advertise_host: str = ""
