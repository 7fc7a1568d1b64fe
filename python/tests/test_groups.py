"""A hybrid model's KV cache groups (vLLM's hybrid KV cache manager: full attention beside
sliding window): which blocks of each group kvx moves, what the scheduler glue tells the
workers and the router, and the bytes landing through the real native side (loopback)."""

from __future__ import annotations

import time
from types import SimpleNamespace as NS

import pytest
import torch
from vllm.v1.request import RequestStatus

from kvx_vllm.config import KvxConfig
from kvx_vllm.groups import KvGroups, parse_groups
from kvx_vllm.metadata import KvxConnectorMetadata
from kvx_vllm.scheduler import _Scheduler
from test_native import cpu_caches, start_pair, token_kv, wait_events

BLOCK = 32
WINDOW = 64


def spec(kind: str, **fields):
    """A stand-in for one of vLLM's KV cache specs: the glue reads its class name."""
    return type(kind, (), {"block_size": BLOCK, **fields})()


def config(*specs) -> NS:
    return NS(
        kv_cache_groups=[
            NS(kv_cache_spec=s, layer_names=[f"model.layers.{i + 2 * j}.self_attn.attn"
                                             for j in range(2)])
            for i, s in enumerate(specs)
        ]
    )


SLIDING_THEN_FULL = config(spec("SlidingWindowSpec", sliding_window=WINDOW),
                           spec("FullAttentionSpec"))


def test_the_first_full_attention_group_goes_first_and_windows_keep_their_tokens():
    g = KvGroups.from_config(SLIDING_THEN_FULL, BLOCK)
    assert g.hybrid and g.order == (1, 0) and g.windows == (WINDOW, None)
    assert g.first_layers == {"model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"}
    # Prefill, 128 tokens: vLLM nulled the window group's first two blocks.
    ids = ([0, 0, 5, 6], [1, 2, 3, 4])
    assert g.first(ids) == [1, 2, 3, 4]
    assert g.kept(ids, BLOCK) == [(64, [0, 0, 5, 6])]
    assert g.kept(([7, 8], [1, 2]), BLOCK) == [(0, [7, 8])]
    # A model of one group, and one without a full-attention group.
    assert not KvGroups.from_config(config(spec("FullAttentionSpec")), BLOCK).hybrid
    two_windows = KvGroups.from_config(
        config(spec("SlidingWindowSpec", sliding_window=8),
               spec("SlidingWindowSpec", sliding_window=16)), BLOCK)
    assert two_windows.order == (0, 1) and two_windows.first_windowed
    assert not g.first_windowed
    only_window = KvGroups.from_config(config(spec("SlidingWindowSpec", sliding_window=8)), BLOCK)
    assert not only_window.hybrid and only_window.first_windowed


@pytest.mark.parametrize("specs, streams", [
    ((spec("SlidingWindowSpec", sliding_window=WINDOW), spec("FullAttentionSpec")), True),
    ((spec("FullAttentionSpec"),), True),
    ((spec("SlidingWindowSpec", sliding_window=WINDOW),), False),
])
def test_a_first_group_with_a_window_never_streams(specs, streams):
    """vLLM frees a windowed group's blocks as its window moves, under early writes: where no
    full-attention group exists, the request moves when it finishes."""
    vllm_config = NS(
        kv_transfer_config=NS(kv_connector_extra_config={"listen": "127.0.0.1:7100"}),
        cache_config=NS(block_size=BLOCK),
        scheduler_config=NS(async_scheduling=False),
    )
    s = _Scheduler(vllm_config, config(*specs), pull=False)
    assert s.stream == streams


def test_groups_kvx_cannot_move_are_refused_at_start():
    with pytest.raises(NotImplementedError, match="MambaSpec"):
        KvGroups.from_config(config(spec("FullAttentionSpec"), spec("MambaSpec")), BLOCK)
    odd = spec("SlidingWindowSpec", sliding_window=WINDOW)
    odd.block_size = 64
    with pytest.raises(NotImplementedError, match="one block size"):
        KvGroups.from_config(config(spec("FullAttentionSpec"), odd), BLOCK)


@pytest.mark.parametrize("bad", [None, [], [[1]], [[1, [2]], [0, [3]]], [["x", [1]]],
                                 [[-1, [1]]], [[1, [2**32]]], [[True, [1]]]])
def test_relayed_groups_are_checked(bad):
    with pytest.raises(ValueError, match="kvx_remote_groups"):
        parse_groups(bad, 1)
    assert parse_groups([[64, [0, 0, 5]]], 1) == [(64, [0, 0, 5])]


def hybrid_scheduler(pull: bool) -> _Scheduler:
    s = _Scheduler.__new__(_Scheduler)
    s.pull = pull
    s.block_size = BLOCK
    s.groups = KvGroups.from_config(SLIDING_THEN_FULL, BLOCK)
    s.meta = KvxConnectorMetadata()
    s.held, s.waiting, s.computing = set(), {}, {}
    s.stream = not pull
    s.cfg = KvxConfig.from_extra({"listen": "127.0.0.1:7100"})
    s.async_scheduling = False
    return s


def test_decode_registers_every_group_and_reports_no_null_block_as_a_load_error():
    params = {"do_remote_prefill": True, "kvx_transfer_id": "t-1",
              "kvx_prefill": "127.0.0.1:7100"}
    s = hybrid_scheduler(pull=False)
    request = NS(request_id="r", kv_transfer_params=dict(params), num_prompt_tokens=128)
    blocks = NS(get_block_ids=lambda: ([0, 0, 5, 6], [1, 2, 3, 4]))
    s.update_state_after_alloc(request, blocks, 128)
    (recv,) = s.build_connector_meta(NS(preempted_req_ids=set())).recvs
    assert recv.error is None
    assert recv.block_ids == [1, 2, 3, 4] and recv.groups == [(64, [0, 0, 5, 6])]
    assert recv.loaded_block_ids == [1, 2, 3, 4, 5, 6]
    # Pull needs prefill's groups relayed too: without them the load fails, naming why.
    s = hybrid_scheduler(pull=True)
    pulled = {**params, "kvx_remote_block_ids": [9, 10, 11, 12], "kvx_num_tokens": 128}
    request = NS(request_id="r", kv_transfer_params=dict(pulled), num_prompt_tokens=128)
    s.update_state_after_alloc(request, blocks, 128)
    (recv,) = s.build_connector_meta(NS(preempted_req_ids=set())).recvs
    assert "kvx_remote_groups" in recv.error and recv.loaded_block_ids == [1, 2, 3, 4, 5, 6]
    request.kv_transfer_params = {**pulled, "kvx_remote_groups": [[64, [0, 0, 13, 14]]]}
    s.update_state_after_alloc(request, blocks, 128)
    (recv,) = s.build_connector_meta(NS(preempted_req_ids=set())).recvs
    assert recv.error is None and recv.producer_groups == [(64, [0, 0, 13, 14])]


@pytest.mark.parametrize("pull", [False, True])
def test_prefill_hands_over_every_group_and_relays_them_in_pull(pull):
    s = hybrid_scheduler(pull)
    request = NS(request_id="p", kv_transfer_params={"do_remote_decode": True,
                                                     "kvx_transfer_id": "t-1"},
                 status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=128)
    delay, out = s.request_finished_all_groups(request, ([0, 0, 5, 6], [1, 2, 3, 4]))
    assert delay
    (send,) = s.meta.sends
    assert send.block_ids == [1, 2, 3, 4] and send.groups == [(64, [0, 0, 5, 6])]
    if pull:
        assert out["kvx_remote_block_ids"] == [1, 2, 3, 4]
        assert out["kvx_remote_groups"] == [[64, [0, 0, 5, 6]]]
    else:
        assert "kvx_remote_groups" not in out


@pytest.mark.parametrize("pull", [False, True])
def test_a_hybrid_request_moves_each_groups_tokens_into_its_own_blocks(pull):
    """Two cache tensors, each holding one layer of both groups (as vLLM shares them): the full
    group's 128 tokens land in their blocks, and the window group's tokens from 64 (where
    prefill keeps it; decode keeps it from 32) in its own; nothing lands in decode's null block
    (0) or in the window group's tokens prefill no longer keeps."""
    heads, tokens = 2, 128
    p_caches = cpu_caches(2, 16, heads, BLOCK, fill=True)
    d_caches = cpu_caches(2, 16, heads, BLOCK, fill=False)
    producer, consumer, _, _ = start_pair(p_caches, d_caches, heads=heads, p_bs=BLOCK,
                                          d_bs=BLOCK, mode="exact")
    p_full, p_window = [7, 2, 9, 4], [0, 0, 12, 15]
    d_full, d_window = [3, 11, 5, 8], [0, 13, 1, 14]
    held, wanted = [(64, p_window)], [(32, d_window)]
    if pull:
        producer.request_finished_pull("t-1", "preq", p_full, tokens, groups=held)
        consumer.pull("t-1", "dreq", producer.control_addr, tokens, 0, d_full, p_full,
                      groups=wanted, producer_groups=held)
    else:
        consumer.request_allocated("t-1", "dreq", producer.control_addr, tokens, 0, d_full,
                                   groups=wanted)
        producer.request_finished("t-1", "preq", p_full, tokens, groups=held)
    assert wait_events(consumer, 1) == [("dreq", True, "", "")]
    for name in p_caches:
        for tok in range(tokens):
            want = token_kv(p_caches[name], p_full, BLOCK, tok)
            assert torch.equal(token_kv(d_caches[name], d_full, BLOCK, tok), want), tok
        for tok in range(64, tokens):
            want = token_kv(p_caches[name], p_window, BLOCK, tok)
            assert torch.equal(token_kv(d_caches[name], d_window, BLOCK, tok), want), tok
        assert torch.count_nonzero(d_caches[name][13]) == 0
        assert torch.count_nonzero(d_caches[name][0]) == 0
    deadline = time.monotonic() + 5
    while producer.stats()["held"]:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    producer.shutdown()
    consumer.shutdown()
