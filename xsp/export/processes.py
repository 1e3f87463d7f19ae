"""The processes an export puts a trace's host threads and GPUs on (Chrome JSON, Perfetto): one
per rank of a job, named after its service, rank and pid, and a ``GPU <device>`` one per device."""

from __future__ import annotations

from typing import Any

from xsp.core import schema as col
from xsp.io.trace import Trace


class Processes:
    """The process of each rank's host threads and GPUs (see the module's text)."""

    def __init__(self, meta: dict[str, Any], ranks: dict[str, Any]) -> None:
        self.meta = meta
        self.ranks = {int(rank): rank_meta for rank, rank_meta in ranks.items()}
        self.several = bool(self.ranks)
        """A job's ranks are apart (an imported trace numbers its one rank, and is one process)."""
        pids = [int(rank_meta.get("pid", 0)) for rank_meta in self.ranks.values()]
        self.unique = len(set(pids)) == len(pids)
        """Every rank ran as its own pid (one host): its pid is its process; else rank-numbered ones."""

    @classmethod
    def of(cls, trace: Trace) -> Processes:
        """``trace``'s processes: its ranks apart where it is a job's (ranks in its metadata and a
        rank on its spans)."""
        ranks = trace.metadata.get("ranks") or {}
        spans = trace.spans
        several = bool(ranks) and col.RANK in spans and bool(spans[col.RANK].notna().any())
        return cls(trace.metadata, ranks if several else {})

    def host(self, rank: Any) -> int:
        if rank is None:
            return int(self.meta.get("pid", 0))
        pid = int(self.ranks.get(int(rank), {}).get("pid", 0))
        return pid if self.unique and pid else 1_000_000_000 + int(rank)

    def host_name(self, rank: Any) -> str:
        if rank is None:
            return f"{self.meta.get('service_name', 'xsp')} ({self.host(None)})"
        rank_meta = self.ranks.get(int(rank), {})
        return f"{rank_meta.get('service_name') or self.meta.get('service_name', 'xsp')} rank {int(rank)} " \
               f"({rank_meta.get('pid', '?')})"

    @staticmethod
    def gpu(rank: Any, device: Any) -> str:
        return f"GPU {device}" if rank is None else f"rank {int(rank)} GPU {device}"


__all__ = ["Processes"]
