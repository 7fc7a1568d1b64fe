"""kvx's transfer counters in vLLM's own connector stats: which counters, how often they are
read, and ``KvxConnectorStats``, which vLLM sums over ranks (defined only where this vLLM has
connector stats)."""

from __future__ import annotations

from dataclasses import dataclass

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # a vLLM before connector stats
    KVConnectorStats = None  # type: ignore[assignment,misc]

# The native side's counters that vLLM logs with its own stats, as increments per interval.
STATS_COUNTERS = (
    "transfers_started",
    "transfers_ok",
    "transfers_failed",
    "bytes_written",
    "bytes_streamed",
)
# Seconds between two reads of the counters (vLLM asks every step).
STATS_EVERY_S = 1.0

if KVConnectorStats is not None:

    @dataclass
    class KvxConnectorStats(KVConnectorStats):
        """kvx's transfer counters (``STATS_COUNTERS``) over an interval, summed over ranks;
        vLLM logs them as "KV Transfer metrics"."""

        def reset(self) -> None:
            self.data = {}

        def aggregate(self, other: KVConnectorStats) -> KvxConnectorStats:
            for name, value in other.data.items():
                self.data[name] = self.data.get(name, 0) + value
            return self

        def reduce(self) -> dict[str, int | float]:
            return dict(self.data)

        def is_empty(self) -> bool:
            return not any(self.data.values())
