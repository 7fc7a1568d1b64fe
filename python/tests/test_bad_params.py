"""Bad ``kv_transfer_params`` (any client can set them) fail the one request's load, through
vLLM's own load-failure path, and never raise into the engine: the scheduler glue checks them,
and the worker turns what the native side refuses into a failed load with its blocks reported
as load errors. The native consumer here is the real one (loopback transport)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace as NS

import pytest

from kvx_vllm.config import KvxConfig
from kvx_vllm.groups import KvGroups
from kvx_vllm.metadata import KvxConnectorMetadata, RecvSpec
from kvx_vllm.resolve import Resolver
from kvx_vllm.scheduler import _Scheduler
from kvx_vllm.worker import _Worker
from test_native import cpu_caches, start_pair, wait_events
from test_resolve import Lookups

GOOD = {"do_remote_prefill": True, "kvx_transfer_id": "t-1", "kvx_prefill": "127.0.0.1:7100"}
PULL = {**GOOD, "kvx_remote_block_ids": [4, 5], "kvx_num_tokens": 40}


def decode_scheduler(pull: bool) -> _Scheduler:
    s = _Scheduler.__new__(_Scheduler)
    s.pull = pull
    s.block_size = 16
    s.groups = KvGroups.single()
    s.meta = KvxConnectorMetadata()
    s.held = set()
    s.waiting = {}
    s.computing = {}
    s.stream = not pull
    s.async_scheduling = True
    return s


def allocate(s: _Scheduler, params: dict, cached: int = 0) -> list[RecvSpec]:
    """Request "r" of 40 tokens in blocks 1-3 (16 tokens each), of which decode's own prefix
    cache holds the first `cached`."""
    request = NS(request_id="r", kv_transfer_params=dict(params), num_prompt_tokens=40)
    blocks = NS(get_block_ids=lambda: ([1, 2, 3],))
    count, is_async = s.get_num_new_matched_tokens(request, cached)
    assert (count, is_async) == (40 - cached, True)
    s.update_state_after_alloc(request, blocks, count)
    return s.build_connector_meta(NS(preempted_req_ids=set())).recvs


@pytest.mark.parametrize(
    "pull, params, why",
    [
        (False, {**GOOD, "kvx_transfer_id": None}, "kvx_transfer_id"),
        (False, {k: v for k, v in GOOD.items() if k != "kvx_prefill"}, "kvx_prefill"),
        (False, {**GOOD, "kvx_prefill": 7100}, "kvx_prefill"),
        (False, {**GOOD, "kvx_prefill": "no-port"}, "kvx_prefill"),
        (False, {**GOOD, "kvx_prefill": "host:99999"}, "kvx_prefill"),
        (True, {**PULL, "kvx_remote_block_ids": ["x"]}, "kvx_remote_block_ids"),
        (True, {**PULL, "kvx_remote_block_ids": [-1]}, "kvx_remote_block_ids"),
        (True, {**PULL, "kvx_remote_block_ids": 7}, "kvx_remote_block_ids"),
        (True, {**PULL, "kvx_num_tokens": "many"}, "kvx_num_tokens"),
        # Prefill computed fewer tokens than decode's prompt has (less the last, which decode
        # computes itself): a different prompt, whose KV would leave tokens unwritten.
        (True, {**PULL, "kvx_num_tokens": 38}, "kvx_num_tokens"),
    ],
)
def test_scheduler_turns_bad_params_into_a_failed_load(pull, params, why):
    s = decode_scheduler(pull)
    (spec,) = allocate(s, params)
    assert spec.error is not None and why in spec.error
    assert spec.block_ids == [1, 2, 3]
    # Nothing is waited for: the worker reports the failure itself.
    assert s.waiting == {}


@pytest.mark.parametrize("pull", [False, True])
def test_a_failed_load_never_reports_decodes_own_prefix_cache_blocks(pull):
    """Decode's prefix cache holds the first block (16 tokens), which other requests may
    share: the load skips it, and a failed load reports only the blocks it writes, so that vLLM
    neither cuts back nor fails the requests sharing that block."""
    s = decode_scheduler(pull)
    (good,) = allocate(s, PULL if pull else GOOD, cached=16)
    assert (good.skip_tokens, good.loaded_block_ids) == (16, [2, 3])
    s = decode_scheduler(pull)
    (bad,) = allocate(s, {**GOOD, "kvx_transfer_id": None}, cached=16)
    assert bad.error is not None and bad.loaded_block_ids == [2, 3]
    # The refusal never reaches the native side: a stand-in with nothing to report.
    w = decode_worker(consumer=NS(take_events=lambda wait_s=0.0: []))
    w.start_load_kv(KvxConnectorMetadata(recvs=[bad]))
    assert w.get_transfer_results().failed_recving == {"r"}
    assert w.get_block_ids_with_load_errors() == {2, 3}


@pytest.mark.parametrize("pull", [False, True])
def test_scheduler_passes_good_params_on(pull):
    s = decode_scheduler(pull)
    (spec,) = allocate(s, PULL if pull else GOOD)
    assert spec.error is None
    assert (spec.transfer_id, spec.prefill) == ("t-1", "127.0.0.1:7100")
    assert spec.producer_block_ids == ([4, 5] if pull else None)
    assert s.waiting == {"r": "t-1"}


def test_prefill_keeps_the_kv_of_a_request_without_transfer_id():
    s = decode_scheduler(pull=False)
    request = NS(request_id="p", kv_transfer_params={"do_remote_decode": True},
                 num_prompt_tokens=40, status=None, num_computed_tokens=40)
    s.update_state_after_alloc(request, NS(get_block_ids=lambda: ([1],)), 0)
    assert s.computing == {}
    assert s.request_finished(request, [1, 2]) == (False, None)
    assert s.meta.sends == [] and s.held == set()


def decode_worker(consumer, resolver: Resolver | None = None) -> _Worker:
    w = _Worker.__new__(_Worker)
    w.producer, w.consumer, w.pull = None, consumer, False
    w.cfg = KvxConfig.from_extra({})
    w.lock = threading.Lock()
    w.recv_blocks, w.recv_transfers, w.cancelled = {}, {}, set()
    w.load_errors, w.refused = set(), []
    w.resolver, w.resolving, w.dropped = resolver or Resolver(), [], []
    w.stats_reported, w.stats_due = {}, 0.0
    w.gauges_reported = {"gauge.held": 0, "gauge.in_flight": 0}
    return w


def test_worker_reports_refused_requests_as_failed_loads():
    caches = cpu_caches(2, 8, 2, 16, fill=False)
    producer, consumer, _, _ = start_pair(caches, cpu_caches(2, 8, 2, 16, fill=False),
                                          heads=2, p_bs=16, d_bs=16)
    w = decode_worker(consumer)
    meta = KvxConnectorMetadata(recvs=[
        # Refused by the scheduler glue.
        RecvSpec("a", "", "", 0, 0, [1], error="bad kv_transfer_params: no kvx_prefill"),
        # Refused by the native side: a block id out of range, an address with a bad port.
        RecvSpec("b", "t-b", "127.0.0.1:7100", 16, 0, [-2]),
        RecvSpec("c", "t-c", "127.0.0.1:99999", 16, 0, [3]),
        # Accepted: waits for its KV from the producer.
        RecvSpec("d", "t-d", producer.control_addr, 16, 0, [4]),
    ])
    w.start_load_kv(meta)
    results = w.get_transfer_results()
    assert results.finished_recving == {"a", "b", "c"}
    assert results.failed_recving == {"a", "b", "c"}
    assert w.get_block_ids_with_load_errors() == {1, -2, 3}
    assert set(w.recv_blocks) == {"d"} and set(w.recv_transfers) == {"t-d"}
    # Reported once.
    again = w.get_transfer_results()
    assert not again.finished_recving & {"a", "b", "c"}
    consumer.shutdown()
    producer.shutdown()


def test_worker_looks_up_prefill_host_names_off_the_engine_thread():
    """Requests that name their prefill by host name: the worker's step returns at once while
    the name is looked up; the request goes to the native consumer at a later step and its KV
    arrives; a name that does not resolve fails its load; a request cancelled during the lookup
    is reported finished (not failed) and never sent."""
    caches = cpu_caches(2, 8, 2, 16, fill=True)
    producer, consumer, _, _ = start_pair(caches, cpu_caches(2, 8, 2, 16, fill=False),
                                          heads=2, p_bs=16, d_bs=16)
    port = int(producer.control_addr.rsplit(":", 1)[1])
    lookups = Lookups({"prefill-0": "127.0.0.1"})
    lookups.gate.clear()
    w = decode_worker(consumer, Resolver(lookup_fn=lookups))
    t0 = time.monotonic()
    w.start_load_kv(KvxConnectorMetadata(recvs=[
        RecvSpec("a", "t-a", f"prefill-0:{port}", 16, 0, [1]),
        RecvSpec("b", "t-b", f"no-such-prefill:{port}", 16, 0, [2]),
        RecvSpec("c", "t-c", f"prefill-0:{port}", 16, 0, [3]),
    ]))
    assert w.get_transfer_results().finished_recving == set()
    w.start_load_kv(KvxConnectorMetadata(cancels=["t-c"]))
    assert time.monotonic() - t0 < 0.5, "the engine thread waited for the lookup"
    assert consumer.stats()["held"] == 0
    lookups.gate.set()
    deadline = time.monotonic() + 10
    finished, failed = set(), set()
    # Until "b" failed, "c" is reported, and "a" went to the native consumer (the lookups end
    # in either order).
    while not ({"b", "c"} <= finished and consumer.stats()["held"] == 1):
        assert time.monotonic() < deadline, (finished, failed)
        r = w.get_transfer_results()
        finished |= r.finished_recving
        failed |= r.failed_recving
        time.sleep(0.005)
    assert failed == {"b"} and "a" not in finished
    assert w.get_block_ids_with_load_errors() == {2}
    producer.request_finished("t-a", "pa", [5], 16)
    assert wait_events(consumer, 1) == [("a", True, "", "")]
    assert lookups.calls.count("prefill-0") == 1
    consumer.shutdown()
    producer.shutdown()


@pytest.mark.parametrize("role", ["kv_both", None])
def test_a_worker_of_another_role_than_producer_or_consumer_is_refused_at_start(role):
    """`kv_both` (prefill for some requests, decode for others) is not a kvx role: the worker
    refuses it at start, naming the roles it takes."""
    ktc = NS(kv_connector_extra_config={}, kv_role=role, engine_id="e")
    with pytest.raises(ValueError, match="kv_producer .prefill. or kv_consumer .decode."):
        _Worker(NS(kv_transfer_config=ktc), pull=False)
