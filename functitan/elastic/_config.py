"""The ``[elastic]`` config section: what may change when workers join and leave, and the live level's knobs."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ..config import check

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

    def __post_init__(self) -> None:
        check(self.microbatch_size >= 0, "microbatch_size", self.microbatch_size, "must be >= 0 (0: keep microbatches)")
        if not self.live:
            return
        # the live level's needs, checked where the config is parsed (the launcher), not at the first step
        check(
            self.microbatch_size >= 1,
            "microbatch_size",
            self.microbatch_size,
            "live=true needs >= 1: the sequences per microbatch per rank, the unit replica groups share out",
        )
        check(
            self.lighthouse.startswith(("http://", "https://")),
            "lighthouse",
            self.lighthouse,
            "live=true needs the torchft lighthouse as http://HOST:PORT (start `torchft_lighthouse "
            "--min_replicas 1 --bind HOST:PORT`)",
        )
        check(self.min_replicas >= 1, "min_replicas", self.min_replicas, "must be >= 1 (a majority of the groups)")
        for name in ("timeout_s", "quorum_timeout_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        check(
            importlib.util.find_spec("torchft") is not None,
            "live",
            self.live,
            "needs torchft: pip install 'functitan[elastic]'",
        )
