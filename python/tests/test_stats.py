"""kvx's transfer counters in vLLM's own stats: each worker reports what its native side's
counters grew by (at most once a second), vLLM sums them over ranks and logs them. The native
pair here is the real one (loopback transport)."""

from __future__ import annotations

from kvx_vllm.connector import KvxPushConnector
from kvx_vllm.metadata import KvxConnectorMetadata, RecvSpec
from kvx_vllm.stats import KvxConnectorStats
from test_bad_params import decode_worker
from test_native import cpu_caches, start_pair, wait_events


def test_workers_report_what_their_counters_grew_by():
    caches = cpu_caches(2, 8, 2, 16, fill=True)
    producer, consumer, _, _ = start_pair(caches, cpu_caches(2, 8, 2, 16, fill=False),
                                          heads=2, p_bs=16, d_bs=16)
    w = decode_worker(consumer)
    # Nothing moved yet: nothing to report.
    assert w.stats_increments() is None
    w.start_load_kv(KvxConnectorMetadata(recvs=[
        RecvSpec("a", "t-a", producer.control_addr, 16, 0, [4]),
    ]))
    producer.request_finished("t-a", "pa", [5], 16)
    assert wait_events(consumer, 1) == [("a", True, "", "")]
    # Asked again within the second: nothing read.
    assert w.stats_increments() is None
    w.stats_due = 0.0
    grown = w.stats_increments()
    assert grown is not None and grown["transfers_ok"] == 1 and grown["transfers_failed"] == 0
    # Decode's side: how long the request waited for its KV.
    assert len(grown["kv_wait_seconds"]) == 1 and grown["kv_wait_seconds"][0] > 0, grown
    # The producer's side: the push transfer's time and bytes, taken once.
    samples = producer.take_transfer_samples()
    assert len(samples) == 1 and samples[0][0] > 0 and samples[0][1] > 0, samples
    assert producer.take_transfer_samples() == []
    w.stats_due = 0.0
    assert w.stats_increments() is None, "reported twice"
    # A request given up: counted by its cause; held comes back to 0.
    w.start_load_kv(KvxConnectorMetadata(recvs=[
        RecvSpec("b", "t-b", producer.control_addr, 16, 0, [6]),
    ]))
    consumer.cancel("t-b")
    [(rid, ok, reason, _)] = wait_events(consumer, 1)
    assert (rid, ok, reason) == ("b", False, "aborted")
    w.stats_due = 0.0
    grown = w.stats_increments()
    assert grown["failed.aborted"] == 1 and grown["transfers_failed"] == 1, grown
    assert grown["gauge.held"] == 0 and grown["gauge.in_flight"] == 0, grown
    consumer.shutdown()
    producer.shutdown()


def test_vllm_sums_the_reports_of_every_rank():
    total = KvxPushConnector.build_kv_connector_stats()
    assert total.is_empty()
    total.aggregate(KvxConnectorStats(data={"transfers_ok": 2, "bytes_written": 100}))
    total.aggregate(KvxConnectorStats(data={"transfers_ok": 1, "bytes_written": 50}))
    assert total.reduce() == {"transfers_ok": 3, "bytes_written": 150}
    # Samples of every rank are kept (concatenated); the log line shows their mean.
    total.aggregate(KvxConnectorStats(data={"transfer_seconds": [0.001]}))
    total.aggregate(KvxConnectorStats(data={"transfer_seconds": [0.003]}))
    assert total.data["transfer_seconds"] == [0.001, 0.003]
    assert total.reduce()["transfer_ms_mean"] == 2.0
    assert not total.is_empty()
    total.reset()
    assert total.is_empty()
    # What a worker sent, rebuilt on the logging side.
    again = KvxPushConnector.build_kv_connector_stats({"transfers_ok": 4})
    assert again.reduce() == {"transfers_ok": 4}


def test_prometheus_counters_add_up_every_interval_per_engine():
    """vLLM's ``/metrics`` carries kvx's counters as ``vllm:kvx_<name>_total``, one child per
    engine: each interval's increments (summed over ranks) add up, never a last value."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry)
             for kind in (Counter, Gauge, Histogram)}
    from types import SimpleNamespace

    config = SimpleNamespace(kv_transfer_config=None)
    prom = KvxPushConnector.build_prom_metrics(
        config, types, ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]})
    prom.observe({"transfers_ok": 2, "bytes_written": 100, "unknown": 5}, 0)
    prom.observe({"transfers_ok": 1, "bytes_written": 50}, 0)
    prom.observe({"handshakes_failed": 3}, 1)
    prom.observe({"transfer_seconds": [0.002, 0.004], "transfer_bytes": [1 << 20, 1 << 20]}, 0)
    prom.observe({"kv_wait_seconds": [0.05]}, 1)
    prom.observe({"failed.lease_expired": 2, "gauge.held": 3, "gauge.rail.eth0": 2}, 0)
    prom.observe({"failed.lease_expired": 1, "gauge.held": 1}, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvx_transfers_ok_total{engine="0",model_name="tiny"} 3.0' in text, text
    assert 'vllm:kvx_bytes_written_total{engine="0",model_name="tiny"} 150.0' in text, text
    assert 'vllm:kvx_handshakes_failed_total{engine="1",model_name="tiny"} 3.0' in text, text
    assert 'vllm:kvx_transfers_ok_total{engine="1",model_name="tiny"} 0.0' in text, text
    assert 'vllm:kvx_transfer_seconds_count{engine="0",model_name="tiny"} 2.0' in text, text
    assert 'vllm:kvx_kv_wait_seconds_count{engine="1",model_name="tiny"} 1.0' in text, text
    assert 'vllm:kvx_transfer_bytes_sum{engine="0",model_name="tiny"} 2.097152e+06' in text, text
    assert ('vllm:kvx_requests_failed_total{cause="lease_expired",engine="0",model_name="tiny"} '
            '3.0') in text, text
    assert 'vllm:kvx_requests_held{engine="0",model_name="tiny"} 1.0' in text, text
    assert 'vllm:kvx_rail_ranks{engine="0",model_name="tiny",rail="eth0"} 2.0' in text, text
    # Every series and label name follows Prometheus's rules.
    import re

    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name.split(" ")[0]), line
        for label in re.findall(r'([^,{}]+)="', rest):
            assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", label), line
            assert not label.startswith("__"), line
