"""kvx's transfer counters in vLLM's own connector stats: which counters, how often they are
read, ``KvxConnectorStats``, which vLLM sums over ranks, and ``KvxPromMetrics``, which puts
them on vLLM's ``/metrics`` as ``vllm:kvx_…`` counters (each defined only where this vLLM has
connector stats, resp. connector Prometheus metrics)."""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # a vLLM before connector stats
    KVConnectorStats = None  # type: ignore[assignment,misc]
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
except ImportError:  # a vLLM before connector Prometheus metrics
    KVConnectorPromMetrics = None  # type: ignore[assignment,misc]

# The native side's counters that vLLM logs with its own stats, as increments per interval,
# and what each counts (the Prometheus counters' help).
STATS_COUNTERS = {
    "transfers_started": "kvx transfers started (prefill: writes in push; decode: reads in pull)",
    "transfers_ok": "kvx transfers that delivered",
    "transfers_failed": "kvx transfers that failed",
    "bytes_written": "Bytes kvx posted (prefill in push, decode in pull)",
    "bytes_streamed": "Of those, bytes written while their request was still computing",
    "released_unconfirmed": "Failed requests whose blocks went back without every writer's "
                            "confirmation that it writes no more",
    "handshakes_failed": "kvx control connections refused at the handshake (no or another "
                         "deployment key, no hello in time, another protocol version)",
    "idle_closed": "kvx control connections closed because their peer said nothing for the "
                   "idle timeout",
    "ops_posted": "kvx transport operations posted (writes, reads)",
    "unauthorized": "kvx requests, registrations and aborts refused because their capability "
                    "did not verify or named another engine, or their prefill is not a peer",
}
# Samples a worker reports with its counters (lists, concatenated over ranks): on prefill,
# seconds from the post of a push transfer's last writes to their completion, and their bytes;
# on decode, seconds a request waited for its KV (registration, or the post of its reads, to
# ready). vLLM's /metrics observes each into a histogram.
STATS_SAMPLES = ("transfer_seconds", "transfer_bytes", "kv_wait_seconds")
# Gauges a worker reports with its counters, as ``gauge.<name>`` (values now, summed over
# ranks): the native side's name, the series' name, and its help.
STATS_GAUGES = {
    "held": ("requests_held", "Requests whose blocks (prefill) or registrations (decode) kvx "
                              "holds now"),
    "in_flight": ("transfers_in_flight", "kvx transfers in flight now (writes posted and not "
                                         "completed; reads in pull)"),
}
# Requests failed by cause come as ``failed.<cause>`` increments; the rails the transport
# opened on as ``gauge.rail.<name>`` (ranks using it).
FAILED_PREFIX = "failed."
RAIL_PREFIX = "gauge.rail."
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
                if isinstance(value, list):
                    self.data[name] = list(self.data.get(name, [])) + value
                else:
                    self.data[name] = self.data.get(name, 0) + value
            return self

        def reduce(self) -> dict[str, int | float]:
            # Gauges summed over intervals mean nothing: the log line shows counters.
            out = {k: v for k, v in self.data.items()
                   if not isinstance(v, list) and not k.startswith("gauge.")}
            for name, shown in (("transfer_seconds", "transfer_ms_mean"),
                                ("kv_wait_seconds", "kv_wait_ms_mean")):
                seconds = self.data.get(name) or []
                if seconds:
                    out[shown] = round(1e3 * sum(seconds) / len(seconds), 3)
            return out

        def is_empty(self) -> bool:
            return not any(self.data.values())


if KVConnectorPromMetrics is not None:

    class KvxPromMetrics(KVConnectorPromMetrics):
        """``STATS_COUNTERS`` as Prometheus counters ``vllm:kvx_<name>_total``, one child per
        engine (vLLM's labels); each interval's increments, already summed over the ranks,
        are added to them (a sum across ranks, never a last value)."""

        def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self.counters: dict[str, dict[int, Any]] = {}
            for name, documentation in STATS_COUNTERS.items():
                metric = self._counter_cls(
                    name=f"vllm:kvx_{name}", documentation=documentation,
                    labelnames=labelnames,
                )
                self.counters[name] = {
                    engine: metric.labels(*values)
                    for engine, values in per_engine_labelvalues.items()
                }
            self.gauges: dict[str, dict[int, Any]] = {}
            for name, (series, documentation) in STATS_GAUGES.items():
                metric = self._gauge_cls(
                    name=f"vllm:kvx_{series}", documentation=documentation,
                    labelnames=labelnames, multiprocess_mode="mostrecent",
                )
                self.gauges[f"gauge.{name}"] = {
                    engine: metric.labels(*values)
                    for engine, values in per_engine_labelvalues.items()
                }
            # Labelled by cause, resp. rail: their children are made as they come.
            self.failed = self._counter_cls(
                name="vllm:kvx_requests_failed", documentation="kvx requests that ended "
                "failed, by cause (lease_expired, peer_failed, unauthorized, ...)",
                labelnames=[*labelnames, "cause"],
            )
            self.rails = self._gauge_cls(
                name="vllm:kvx_rail_ranks", documentation="Ranks whose kvx transport opened "
                "on each rail (NIC or network interface)",
                labelnames=[*labelnames, "rail"], multiprocess_mode="mostrecent",
            )
            self.labelvalues = per_engine_labelvalues
            self.histograms: dict[str, dict[int, Any]] = {}
            for name, documentation, buckets in (
                ("transfer_seconds", "Push transfers: seconds from the post of their last "
                 "writes to their completion", [1e-4 * 2 ** i for i in range(18)]),
                ("transfer_bytes", "Push transfers: bytes of their last writes",
                 [4096 * 4 ** i for i in range(13)]),
                ("kv_wait_seconds", "Decode: seconds a request waited for its KV, from its "
                 "registration (push) or the post of its reads (pull) to ready",
                 [1e-3 * 2 ** i for i in range(17)]),
            ):
                metric = self._histogram_cls(
                    name=f"vllm:kvx_{name}", documentation=documentation,
                    labelnames=labelnames, buckets=buckets,
                )
                self.histograms[name] = {
                    engine: metric.labels(*values)
                    for engine, values in per_engine_labelvalues.items()
                }

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for name, value in transfer_stats_data.items():
                if isinstance(value, list):
                    child = self.histograms.get(name, {}).get(engine_idx)
                    for sample in value if child is not None else ():
                        child.observe(sample)
                    continue
                labels = self.labelvalues.get(engine_idx)
                if name.startswith(RAIL_PREFIX) and labels is not None:
                    self.rails.labels(*labels, name[len(RAIL_PREFIX):]).set(value)
                    continue
                if name.startswith(FAILED_PREFIX) and labels is not None:
                    if value > 0:
                        self.failed.labels(*labels, name[len(FAILED_PREFIX):]).inc(value)
                    continue
                gauge = self.gauges.get(name, {}).get(engine_idx)
                if gauge is not None:
                    gauge.set(value)
                    continue
                child = self.counters.get(name, {}).get(engine_idx)
                if child is not None and value > 0:
                    child.inc(value)
