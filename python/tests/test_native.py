"""The native module with real memory, without vLLM: a prefill and a decode side in one process
(loopback transport) move a request's KV between torch tensors laid out as vLLM's CPU backend
lays them out, and the bytes land exactly where the layout says — for the token-exact and the
block-granular description, and across different block sizes where the description allows it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvx_vllm import _native
from kvx_vllm.layout import describe
from kv_helpers import assert_tokens_moved, make_caches, wait_events

HEAD = 32


def cpu_caches(layers: int, blocks: int, heads: int, bs: int, fill: bool) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(layers):
        t = torch.zeros(blocks, heads, bs, 2 * HEAD, dtype=torch.float32)
        if fill:
            t.copy_(torch.randn_like(t))
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def token_kv(cache: torch.Tensor, block_ids: list[int], bs: int, token: int) -> torch.Tensor:
    """K and V of one token in one layer, read the way vLLM's CPU attention kernel (ISA vec)
    stores them: per block and head, K dimension-major (K[dim][token]), then V token-major."""
    b, slot = block_ids[token // bs], token % bs
    per_head = cache[b].reshape(cache.shape[1], 2 * bs * HEAD)
    k = per_head[:, : bs * HEAD].reshape(-1, HEAD, bs)[:, :, slot]
    v = per_head[:, bs * HEAD :].reshape(-1, bs, HEAD)[:, slot, :]
    return torch.stack([k, v])


def start_pair(p_caches, d_caches, *, heads, p_bs, d_bs, mode="auto", cells=None, **kw):
    p_desc = describe(p_caches, head_size=HEAD, total_kv_heads=heads, block_size=p_bs,
                      tp_size=1, tp_rank=0, mode=mode, cells=cells)
    d_desc = describe(d_caches, head_size=HEAD, total_kv_heads=heads, block_size=d_bs,
                      tp_size=1, tp_rank=0, mode=mode, cells=cells)
    producer = _native.Producer("p0", p_desc.layout, p_desc.regions, transport="loopback",
                                token_unit=p_desc.token_unit, **kw)
    consumer = _native.Consumer("d0", d_desc.layout, d_desc.regions, transport="loopback",
                                token_unit=d_desc.token_unit, **kw)
    return producer, consumer, p_desc, d_desc


@pytest.mark.parametrize("heads,p_bs,d_bs,mode", [
    (1, 32, 32, "exact"),
    (2, 64, 64, "exact"),
    (2, 16, 32, "exact"),
    (4, 64, 16, "exact"),
    (2, 32, 32, "block"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_push_moves_the_right_bytes(heads, p_bs, d_bs, mode, stream):
    """Token-exact (the default) across block sizes, and block-granular with equal ones; with
    `stream`, 70 of the 100 tokens are reported computed first and whole blocks of them are
    written before the request finishes."""
    p_caches = cpu_caches(3, 16, heads, p_bs, fill=True)
    d_caches = cpu_caches(3, 16, heads, d_bs, fill=False)
    producer, consumer, p_desc, d_desc = start_pair(p_caches, d_caches, heads=heads,
                                                    p_bs=p_bs, d_bs=d_bs, mode=mode)
    assert p_desc.mode == mode and d_desc.mode == mode
    tokens = 100
    p_blocks = [7, 2, 9, 4, 12, 0, 15, 6][: -(-tokens // p_bs)]
    d_blocks = [3, 11, 5, 8, 1, 14, 10, 2][: -(-tokens // d_bs)]
    consumer.request_allocated("t-1", "dreq", producer.control_addr, tokens, 0, d_blocks)
    if stream:
        producer.request_progress("t-1", p_blocks[: -(-70 // p_bs)], 70)
        deadline = time.monotonic() + 10
        while producer.stats()["bytes_streamed"] == 0:
            assert time.monotonic() < deadline, "nothing written early"
            time.sleep(0.005)
        assert consumer.take_events() == []
    producer.request_finished("t-1", "preq", p_blocks, tokens)
    assert wait_events(consumer, 1) == [("dreq", True, "", "")]
    stats = producer.stats()
    if stream:
        # Whole blocks of both sides up to token 70, and never more than was computed.
        unit = max(p_bs, d_bs) if mode == "exact" else p_bs
        early_tokens = 70 // unit * unit
        per_token = stats["bytes_written"] / tokens if mode == "exact" else None
        assert stats["bytes_streamed"] > 0
        if per_token is not None:
            assert stats["bytes_streamed"] == early_tokens * per_token, stats
    else:
        assert stats["bytes_streamed"] == 0
    deadline = time.monotonic() + 5
    finished = []
    while not finished:
        finished = producer.take_finished()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert finished == [("preq", True, "")]
    assert producer.stats()["held"] == 0
    for name in p_caches:
        for tok in range(tokens):
            want = token_kv(p_caches[name], p_blocks, p_bs, tok)
            got = token_kv(d_caches[name], d_blocks, d_bs, tok)
            assert torch.equal(want, got), f"{name} token {tok}"
    # Blocks not named by the request stay untouched.
    untouched = [b for b in range(16) if b not in d_blocks]
    for t in d_caches.values():
        assert torch.count_nonzero(t[untouched]) == 0
    producer.shutdown()
    consumer.shutdown()


def test_block_granular_refuses_different_block_sizes():
    p_caches = cpu_caches(2, 8, 2, 32, fill=True)
    d_caches = cpu_caches(2, 8, 2, 64, fill=False)
    producer, consumer, _, _ = start_pair(p_caches, d_caches, heads=2, p_bs=32, d_bs=64,
                                          mode="block")
    consumer.request_allocated("t-2", "dreq", producer.control_addr, 40, 0, [1])
    producer.request_finished("t-2", "preq", [3, 4], 40)
    [(rid, ok, reason, detail)] = wait_events(consumer, 1)
    assert rid == "dreq" and not ok, (reason, detail)
    assert torch.count_nonzero(torch.stack(list(d_caches.values()))) == 0
    producer.shutdown()
    consumer.shutdown()


def test_only_vec_kernels_are_described_token_by_token():
    """vLLM's AMX (and ARM, fp8) CPU kernels pack blocks differently: their caches are described
    block by block in `auto`, and `exact` is refused; a head count that does not match the model
    and TP size is refused too."""
    caches = cpu_caches(1, 4, 2, 32, fill=False)
    kw = dict(head_size=HEAD, total_kv_heads=2, block_size=32, tp_size=1, tp_rank=0)
    assert describe(caches, cpu_kernel="vec16", **kw).mode == "exact"
    for kernel in ("amx", "neon", None):
        assert describe(caches, cpu_kernel=kernel, **kw).mode == "block", kernel
        with pytest.raises(ValueError, match="vec CPU attention kernels"):
            describe(caches, cpu_kernel=kernel, mode="exact", **kw)
    with pytest.raises(ValueError, match="holds 2 heads"):
        describe(caches, **dict(kw, total_kv_heads=8))


def test_cpu_cache_is_described_token_by_token():
    desc = describe(cpu_caches(2, 4, 2, 32, fill=False), head_size=HEAD, total_kv_heads=4,
                    block_size=32, tp_size=2, tp_rank=1)
    assert desc.mode == "exact" and desc.token_unit == 1
    layout = desc.layout
    assert (layout["order"], layout["arrangement"]) == ("hnd-kt", "per-layer-head-kv")
    assert (layout["head_dim"], layout["block_tokens"], layout["total_kv_heads"]) == (HEAD, 32, 4)
    with pytest.raises(ValueError, match="only for the CPU"):
        describe(flash_caches(1, 4, 2, 16, fill=False), head_size=HEAD, total_kv_heads=2,
                 block_size=16, tp_size=1, tp_rank=0, mode="block")


def wait_finished(producer, what: str) -> list:
    """The producer's first finished reports (5 s at most)."""
    deadline = time.monotonic() + 5
    finished = []
    while not finished:
        finished = producer.take_finished()
        assert time.monotonic() < deadline, f"blocks never {what}"
        time.sleep(0.005)
    return finished


def test_unclaimed_blocks_come_back_after_the_producer_lease():
    p_caches = cpu_caches(1, 8, 1, 32, fill=True)
    d_caches = cpu_caches(1, 8, 1, 32, fill=False)
    producer, consumer, _, _ = start_pair(p_caches, d_caches, heads=1, p_bs=32, d_bs=32,
                                          timings={"producer_lease": 0.3})
    producer.request_finished("t-3", "preq", [1, 2], 50)
    time.sleep(0.1)
    assert producer.stats()["held"] == 1
    finished = wait_finished(producer, "released")
    assert [f[:2] for f in finished] == [("preq", False)], finished
    assert producer.stats()["held"] == 0
    producer.shutdown()
    consumer.shutdown()


def test_a_sealed_request_lands_before_prefill_finishes_it():
    """`request_sealed` (the end of the forward pass that computed the prompt) writes the KV
    and tells decode at once; the blocks come back to prefill's engine only after its
    `request_finished`, with the request's name."""
    p_caches = make_caches("cells-hnd", 2, 8, 2, 32, HEAD, fill=True)
    d_caches = make_caches("cells-hnd", 2, 8, 2, 16, HEAD, fill=False)
    producer, consumer, _, _ = start_pair(p_caches, d_caches, heads=2, p_bs=32, d_bs=16,
                                          cells=True)
    try:
        consumer.request_allocated("t-s", "dreq", producer.control_addr, 50, 0, [6, 4, 0, 7])
        producer.request_sealed("t-s", "preq", [1, 2], 50)
        assert wait_events(consumer, 1) == [("dreq", True, "", "")]
        assert_tokens_moved("cells-hnd", p_caches, [1, 2], 32, d_caches, [6, 4, 0, 7], 16, 50)
        time.sleep(0.05)
        assert producer.take_finished() == []
        producer.request_finished("t-s", "preq", [1, 2], 50)
        assert wait_finished(producer, "given back") == [("preq", True, "")]
        assert producer.stats()["held"] == 0
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_cancel_reports_failure_and_bad_arguments_raise():
    p_caches = cpu_caches(1, 8, 1, 32, fill=True)
    d_caches = cpu_caches(1, 8, 1, 32, fill=False)
    producer, consumer, _, _ = start_pair(p_caches, d_caches, heads=1, p_bs=32, d_bs=32)
    consumer.request_allocated("t-4", "dreq", producer.control_addr, 50, 0, [1, 2])
    time.sleep(0.05)
    consumer.cancel("t-4")
    [(rid, ok, reason, _)] = wait_events(consumer, 1)
    assert (rid, ok) == ("dreq", False) and reason
    with pytest.raises(ValueError):
        consumer.request_allocated("t-5", "x", "not-an-address", 10, 0, [1])
    with pytest.raises(ValueError):
        consumer.request_allocated("t-5", "x", producer.control_addr, 10, 0, [-1])
    producer.shutdown()
    consumer.shutdown()
    with pytest.raises(RuntimeError):
        producer.request_finished("t-6", "y", [1], 10)


def test_an_unset_quiesce_bound_follows_the_producer_and_costs_nothing_when_it_answers():
    """Unset (the default), `quiesce_timeout_s` is not passed on: decode holds a failed
    request's blocks as long as its producer says its writes can run (60 s and a margin here),
    unless the producer confirms at once, as it does for a request it has nothing of."""
    from kvx_vllm.config import KvxConfig

    default = KvxConfig.from_extra({}).timings()
    assert "quiesce_timeout" not in default
    assert KvxConfig.from_extra({"quiesce_timeout_s": "2.5"}).timings()["quiesce_timeout"] == 2.5
    p_caches = cpu_caches(1, 8, 1, 32, fill=True)
    d_caches = cpu_caches(1, 8, 1, 32, fill=False)
    producer, consumer, _, _ = start_pair(p_caches, d_caches, heads=1, p_bs=32, d_bs=32,
                                          timings=default)
    consumer.request_allocated("t-7", "dreq", producer.control_addr, 50, 0, [1, 2])
    time.sleep(0.05)
    started = time.monotonic()
    consumer.cancel("t-7")
    [(rid, ok, reason, detail)] = wait_events(consumer, 1)
    assert (rid, ok) == ("dreq", False) and reason
    assert "without confirmation" not in detail, detail
    assert time.monotonic() - started < 5
    assert consumer.stats()["released_unconfirmed"] == 0
    producer.shutdown()
    consumer.shutdown()


def flash_caches(layers: int, blocks: int, heads: int, bs: int, fill: bool) -> dict[str, torch.Tensor]:
    return make_caches("flash", layers, blocks, heads, bs, HEAD, fill)


def push_70_tokens(kind: str, p_caches, d_caches, p_bs: int, d_bs: int, cells=None):
    """Pushes a 70-token request between two caches described token by token, checks that
    every token landed and nothing else changed; returns the producer's stats and
    description."""
    producer, consumer, p_desc, d_desc = start_pair(p_caches, d_caches, heads=2, p_bs=p_bs,
                                                    d_bs=d_bs, cells=cells)
    try:
        assert p_desc.mode == d_desc.mode == "exact"
        tokens = 70
        p_blocks = [5, 1, 12, 3, 9][: -(-tokens // p_bs)]
        d_blocks = [2, 14, 7, 0, 11][: -(-tokens // d_bs)]
        consumer.request_allocated("t-7", "dreq", producer.control_addr, tokens, 0, d_blocks)
        producer.request_finished("t-7", "preq", p_blocks, tokens)
        assert wait_events(consumer, 1) == [("dreq", True, "", "")]
        assert_tokens_moved(kind, p_caches, p_blocks, p_bs, d_caches, d_blocks, d_bs, tokens)
        return producer.stats(), p_desc
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("p_bs,d_bs", [(16, 32), (32, 16)])
def test_flash_layout_is_token_exact_across_block_sizes(p_bs, d_bs):
    """The FlashAttention layout (2, blocks, bs, heads, dim) is described token by token, so
    prefill and decode may use different block sizes."""
    push_70_tokens("flash", flash_caches(2, 16, 2, p_bs, fill=True),
                   flash_caches(2, 16, 2, d_bs, fill=False), p_bs, d_bs)


def cell_caches(layers: int, blocks: int, heads: int, bs: int, order: str,
                fill: bool) -> dict[str, torch.Tensor]:
    """What vLLM 0.32's GPU model runner hands a connector: per layer a view [blocks, heads,
    tokens, K|V] of one shared allocation, strided as its cache layout (`LBHNC` is `hnd`,
    `LBNHC` is `nhd`) says."""
    return make_caches(f"cells-{order}", layers, blocks, heads, bs, HEAD, fill)


@pytest.mark.parametrize("order", ["hnd", "nhd"])
@pytest.mark.parametrize("p_bs,d_bs", [(16, 32), (32, 16), (32, 32)])
def test_kv_cells_of_vllm_gpu_views_move_token_by_token(order, p_bs, d_bs):
    """vLLM 0.32's GPU layout (K then V per token and head; `cells=True` describes these CPU
    tensors as that), in its head-major and token-major orders: every token's K and V land in
    decode's blocks, across block sizes, and nothing else changes. (The same on a GPU, between
    processes over CUDA IPC: test_gpu.py.)"""
    stats, p_desc = push_70_tokens(f"cells-{order}", cell_caches(2, 16, 2, p_bs, order, fill=True),
                                   cell_caches(2, 16, 2, d_bs, order, fill=False), p_bs, d_bs,
                                   cells=True)
    assert (p_desc.layout["arrangement"], p_desc.layout["order"]) == ("per-layer-cell-kv", order)
    # Exactly the request's tokens: 2 layers x 2 heads x (K, V) x HEAD float32s each.
    assert stats["bytes_written"] == 70 * 2 * 2 * 2 * HEAD * 4


def test_kv_cells_in_different_orders_fail_the_request_cleanly():
    """A head-major prefill and a token-major decode (or any other arrangement) are not
    re-laid-out: the request fails with the planner's reason and decode's blocks stay as they
    were."""
    p_caches = cell_caches(2, 8, 2, 32, "hnd", fill=True)
    d_caches = cell_caches(2, 8, 2, 32, "nhd", fill=False)
    producer, consumer, _, _ = start_pair(p_caches, d_caches, heads=2, p_bs=32, d_bs=32,
                                          cells=True)
    consumer.request_allocated("t-o", "dreq", producer.control_addr, 40, 0, [1, 6])
    producer.request_finished("t-o", "preq", [3, 4], 40)
    [(rid, ok, reason, detail)] = wait_events(consumer, 1)
    assert rid == "dreq" and not ok, (reason, detail)
    assert "re-layout" in detail or "order" in detail, detail
    assert all(torch.count_nonzero(t) == 0 for t in d_caches.values())
    producer.shutdown()
    consumer.shutdown()


def test_only_dense_per_layer_views_are_described():
    """A block-outermost layout (every layer's page of a block together) or a padded page is
    not one dense range per layer: refused, naming vLLM's layouts, rather than misdescribed."""
    kw = dict(head_size=HEAD, total_kv_heads=2, block_size=16, tp_size=1, tp_rank=0, cells=True)
    shape = (4, 2, 16, 2 * HEAD)
    page = 2 * 16 * 2 * HEAD
    raw = torch.zeros(2 * 4 * page)
    block_outer = {
        f"model.layers.{i}.self_attn.attn": torch.as_strided(
            raw, shape, (2 * page, 16 * 2 * HEAD, 2 * HEAD, 1), storage_offset=i * page)
        for i in range(2)
    }
    with pytest.raises(NotImplementedError, match="LBHNC or LBNHC"):
        describe(block_outer, **kw)
    assert describe(cell_caches(2, 4, 2, 16, "nhd", fill=False), **kw).layout["order"] == "nhd"


def test_flash_layout_in_hnd_order_is_described_as_such():
    """Earlier vLLMs' FlashAttention tensor (2, blocks, tokens, heads, dim) viewed over
    head-major memory (their HND layout, which the kvx connectors ask for) is `hnd`, and its
    bytes move token-exactly into a contiguous (`nhd`) decode cache."""
    p_caches = make_caches("flash-hnd", 2, 16, 2, 16, HEAD, fill=True)
    d_caches = flash_caches(2, 16, 2, 16, fill=False)
    producer, consumer, p_desc, d_desc = start_pair(p_caches, d_caches, heads=2, p_bs=16,
                                                    d_bs=16)
    assert (p_desc.layout["order"], d_desc.layout["order"]) == ("hnd", "nhd")
    tokens = 40
    p_blocks, d_blocks = [4, 9, 1], [8, 2, 13]
    consumer.request_allocated("t-h", "dreq", producer.control_addr, tokens, 0, d_blocks)
    producer.request_finished("t-h", "preq", p_blocks, tokens)
    assert wait_events(consumer, 1) == [("dreq", True, "", "")]
    assert_tokens_moved("flash", p_caches, p_blocks, 16, d_caches, d_blocks, 16, tokens)
    producer.shutdown()
    consumer.shutdown()


LATENT = 576


def mla_caches(layers: int, blocks: int, bs: int, fill: bool) -> dict[str, torch.Tensor]:
    """vLLM's MLA cache as its CPU backend has it: per layer [blocks, 1, tokens, latent]
    (DeepSeek's 512-value latent and 64 rotary values per token), the same on every
    tensor-parallel rank."""
    out = {}
    for i in range(layers):
        t = torch.zeros(blocks, 1, bs, LATENT, dtype=torch.float32)
        if fill:
            t.copy_(torch.randn_like(t))
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


@pytest.mark.parametrize("p_bs,d_bs,p_tp,p_rank", [(16, 16, 1, 0), (16, 32, 1, 0), (32, 16, 2, 0)])
def test_an_mla_cache_moves_token_by_token(p_bs, d_bs, p_tp, p_rank):
    """An MLA cache is described as one latent vector per token (`mla`, no heads): every token's
    latent lands in decode's blocks across block sizes, and nothing else changes. With prefill at
    tensor parallelism 2, every rank holds the whole latent, and a one-rank decode needs one of
    them: it registers with rank 0 alone, and that rank's notice completes the request."""
    p_caches, d_caches = mla_caches(2, 16, p_bs, fill=True), mla_caches(2, 16, d_bs, fill=False)
    p_desc = describe(p_caches, head_size=LATENT, total_kv_heads=1, block_size=p_bs,
                      tp_size=p_tp, tp_rank=p_rank, mla=True)
    d_desc = describe(d_caches, head_size=LATENT, total_kv_heads=1, block_size=d_bs,
                      tp_size=1, tp_rank=0, mla=True)
    assert p_desc.layout["mla"] and p_desc.mode == "exact" and p_desc.token_unit == 1
    with pytest.raises(ValueError, match="not an MLA cache"):
        describe(p_caches, head_size=LATENT, total_kv_heads=1, block_size=p_bs, tp_size=1,
                 tp_rank=0, mla=True, mode="block")
    producer = _native.Producer("p0", p_desc.layout, p_desc.regions, transport="loopback",
                                token_unit=1)
    consumer = _native.Consumer("d0", d_desc.layout, d_desc.regions, transport="loopback",
                                token_unit=1)
    try:
        tokens = 70
        p_blocks = [5, 1, 12, 3, 9][: -(-tokens // p_bs)]
        d_blocks = [2, 14, 7, 0, 11][: -(-tokens // d_bs)]
        before = {k: t.clone() for k, t in d_caches.items()}
        consumer.request_allocated("t-8", "dreq", producer.control_addr, tokens, 0, d_blocks)
        producer.request_finished("t-8", "preq", p_blocks, tokens)
        assert wait_events(consumer, 1) == [("dreq", True, "", "")]
        for name, src in p_caches.items():
            dst = d_caches[name]
            for token in range(tokens):
                got = dst[d_blocks[token // d_bs], 0, token % d_bs]
                want = src[p_blocks[token // p_bs], 0, token % p_bs]
                assert torch.equal(got, want), (name, token)
            # Nothing but the request's tokens changed.
            moved = torch.zeros((dst.shape[0], dst.shape[2]), dtype=torch.bool)
            for token in range(tokens):
                moved[d_blocks[token // d_bs], token % d_bs] = True
            assert torch.equal(dst[:, 0][~moved], before[name][:, 0][~moved]), name
    finally:
        producer.shutdown()
        consumer.shutdown()


LIBFABRIC_CHILD = r"""
import sys
from kvx_vllm import _native
from kvx_vllm.layout import describe
sys.path.insert(0, sys.argv[1])
from test_native import HEAD, cpu_caches

desc = describe(cpu_caches(2, 4, 2, 16, fill=False), head_size=HEAD, total_kv_heads=2,
                block_size=16, tp_size=1, tp_rank=0)
try:
    _native.Producer("p0", desc.layout, desc.regions, transport="libfabric:shm")
    print("OPENED")
except RuntimeError as e:
    print("REFUSED", e)
_native.Producer("p1", desc.layout, desc.regions, transport="loopback").shutdown()
print("LOOPBACK")
"""


def test_the_plugin_loads_the_libfabric_its_operator_names():
    """`KVX_LIBFABRIC` names the libfabric the native module loads (the plugin maps the
    environment; the library crates read none): one that is not there fails a libfabric
    transport with an error naming it and what to install, and the other transports work."""
    if not hasattr(_native, "shm_uses_cma"):
        pytest.skip("a native module without libfabric")
    env = dict(os.environ, KVX_LIBFABRIC="libkvx-no-such-fabric.so.1")
    out = subprocess.run([sys.executable, "-c", LIBFABRIC_CHILD, str(Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("REFUSED"), out.stdout
    assert "libkvx-no-such-fabric.so.1" in lines[0] and "libfabric1" in lines[0], lines[0]
    assert lines[-1] == "LOOPBACK", out.stdout
