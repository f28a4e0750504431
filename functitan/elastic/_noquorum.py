"""The stop of a live replica group whose peers are gone: no quorum formed within ``elastic.quorum_timeout_s``."""

from __future__ import annotations

from typing import Any

from ..errors import PeersGone

__all__ = ["NoQuorum"]


class NoQuorum(PeersGone):
    """No quorum within ``elastic.quorum_timeout_s``: the message names the lighthouse, the settings and the fix.

    The trainer saves the steps committed so far before it reports this (one line, exit 2).
    """

    @classmethod
    def of(cls, ecfg: Any, replica_id: str, raw: BaseException) -> NoQuorum:
        torchft_says = str(raw).split(", details:")[0]  # tonic's status, without its empty metadata
        return cls(
            f"replica group {replica_id} got no quorum from the lighthouse {ecfg.lighthouse} within "
            f"elastic.quorum_timeout_s={ecfg.quorum_timeout_s:g} (torchft: {torchft_says}): a quorum needs the "
            f"lighthouse's --min_replicas groups up, and a step commits with elastic.min_replicas="
            f"{ecfg.min_replicas} of them; start the missing replica groups (or lower torchft_lighthouse "
            f"--min_replicas and elastic.min_replicas, or raise elastic.quorum_timeout_s to wait longer)"
        )
