"""A decode request dropped before vLLM allocated its blocks (aborted while queued: the client
went away, the router gave up) was never registered, so its prefill would hold the KV until the
producer's lease. The scheduler glue notices (its ``do_remote_prefill`` is still set) and the
worker tells the prefill instance, which gives the KV back at once. The native pair here is the
real one (loopback transport)."""

from __future__ import annotations

import time
from types import SimpleNamespace as NS

from kvx_vllm.metadata import KvxConnectorMetadata
from test_bad_params import GOOD, allocate, decode_scheduler, decode_worker
from test_native import cpu_caches, start_pair, wait_events


def finished(s, params: dict, status: str = "FINISHED_ABORTED"):
    request = NS(request_id="r", kv_transfer_params=params, num_prompt_tokens=40,
                 status=status, num_computed_tokens=0)
    return s.request_finished(request, [])


def test_the_scheduler_abandons_only_requests_it_never_allocated():
    s = decode_scheduler(pull=False)
    assert finished(s, dict(GOOD)) == (False, None)
    assert s.meta.abandons == [("t-1", "127.0.0.1:7100", None)]
    assert s.has_pending_work(), "the engine must step once more to tell the worker"
    assert s.build_connector_meta(NS(preempted_req_ids=set())).abandons == [
        ("t-1", "127.0.0.1:7100", None)
    ]
    # Allocated and registered, then loaded: finishing it abandons nothing.
    s = decode_scheduler(pull=False)
    params = dict(GOOD)
    request = NS(request_id="r", kv_transfer_params=params, num_prompt_tokens=40)
    s.get_num_new_matched_tokens(request, 0)
    s.update_state_after_alloc(request, NS(get_block_ids=lambda: ([1, 2, 3],)), 40)
    s.update_connector_output(NS(finished_sending=None, finished_recving={"r"}))
    assert finished(s, params, "FINISHED_LENGTH_CAPPED") == (False, None)
    assert s.meta.abandons == [] and s.meta.cancels == []
    # Params without a transfer id or a prefill address: nothing to tell anyone. A request
    # marked for both sides is prefill's. In pull, a drop is never told (below).
    s = decode_scheduler(pull=False)
    finished(s, {"do_remote_prefill": True, "kvx_transfer_id": "t-2"})
    finished(s, {"do_remote_prefill": True, "kvx_prefill": "127.0.0.1:7100"})
    finished(s, {**GOOD, "do_remote_decode": True})
    assert s.meta.abandons == []
    s = decode_scheduler(pull=True)
    finished(s, dict(GOOD))
    assert s.meta.abandons == []
    # A transfer id that is not a string is named as the registration would name it.
    s = decode_scheduler(pull=False)
    finished(s, {**GOOD, "kvx_transfer_id": 17})
    assert s.meta.abandons == [("17", "127.0.0.1:7100", None)]
    # The router's capability goes with it.
    s = decode_scheduler(pull=False)
    finished(s, {**GOOD, "kvx_capability": "1.0.5.00"})
    assert s.meta.abandons == [("t-1", "127.0.0.1:7100", "1.0.5.00")]
    # Allocated with nothing to load (vLLM computes the prompt itself): never registers.
    s = decode_scheduler(pull=False)
    request = NS(request_id="r", kv_transfer_params=dict(GOOD), num_prompt_tokens=40)
    s.update_state_after_alloc(request, NS(get_block_ids=lambda: ([1],)), 0)
    assert s.meta.recvs == [] and s.meta.abandons == [("t-1", "127.0.0.1:7100", None)]
    # Still waiting for its KV: a cancel, as before.
    s = decode_scheduler(pull=False)
    allocate(s, GOOD)
    assert finished(s, {**GOOD, "do_remote_prefill": False}) == (False, None)
    assert s.meta.cancels == ["t-1"] and s.meta.abandons == []


def test_prefill_gives_an_abandoned_transfers_kv_back_at_once():
    caches = cpu_caches(2, 8, 2, 16, fill=True)
    producer, consumer, _, _ = start_pair(caches, cpu_caches(2, 8, 2, 16, fill=False),
                                          heads=2, p_bs=16, d_bs=16)
    # A first request connects decode to prefill.
    consumer.request_allocated("t-1", "d1", producer.control_addr, 16, 0, [1])
    producer.request_finished("t-1", "p1", [5], 16)
    assert wait_events(consumer, 1) == [("d1", True, "", "")]
    # Prefill finished a request whose decode leg was dropped before it registered. Its lease
    # (30 s by default) is far away.
    producer.request_finished("t-2", "p2", [6], 16)
    deadline = time.monotonic() + 10
    while producer.stats()["held"] != 1:
        producer.take_finished()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    w = decode_worker(consumer)
    started = time.monotonic()
    w.start_load_kv(KvxConnectorMetadata(abandons=[
        ("t-2", producer.control_addr, None),
        # Unusable or unknown prefill addresses are skipped, never raised into the engine; a
        # name never looked up is not looked up now; so is a malformed capability.
        ("t-3", "no-port", None),
        ("t-4", "127.0.0.1:9", None),
        ("t-5", "prefill-never-seen:7100", None),
        ("t-6", producer.control_addr, "not a capability"),
    ]))
    assert w.resolver._pending == {}
    got = []
    while not any(f[0] == "p2" for f in got):
        got += producer.take_finished()
        assert time.monotonic() - started < 5, f"KV still held: {got}"
        time.sleep(0.005)
    [(rid, sent, reason)] = [f[:3] for f in got if f[0] == "p2"]
    assert (sent, reason) == (False, "aborted")
    assert producer.stats()["held"] == 0
    consumer.shutdown()
    producer.shutdown()
