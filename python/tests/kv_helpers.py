"""Helpers shared by the native module's tests on the host (test_native.py) and on GPUs
(test_gpu.py)."""

from __future__ import annotations

import time

import torch


def wait_events(consumer, n: int, timeout: float = 10.0):
    """The consumer's next `n` events, failing after `timeout` seconds."""
    events = []
    deadline = time.monotonic() + timeout
    while len(events) < n:
        events += consumer.take_events()
        assert time.monotonic() < deadline, f"only {events} after {timeout}s"
        time.sleep(0.005)
    return events


def token_kv(kind: str, cache: torch.Tensor, block: int, slot: int) -> torch.Tensor:
    """Every head's K and V of one token: `[:, block, slot]` of a FlashAttention tensor
    `(2, blocks, tokens, heads, dim)`, `[block, :, slot]` of a cell view `[blocks, heads, tokens,
    K|V]`."""
    return cache[:, block, slot] if kind == "flash" else cache[block, :, slot]


def assert_tokens_moved(kind: str, p_caches, p_blocks, p_bs, d_caches, d_blocks, d_bs,
                        tokens: int) -> None:
    """Every token's K and V of every layer is where decode's blocks say, and the blocks decode
    did not name hold zeros."""
    for name, want in p_caches.items():
        got = d_caches[name]
        for tok in range(tokens):
            pb, ps = p_blocks[tok // p_bs], tok % p_bs
            db, ds = d_blocks[tok // d_bs], tok % d_bs
            assert torch.equal(token_kv(kind, want, pb, ps), token_kv(kind, got, db, ds)), (
                f"{name} token {tok}"
            )
        blocks = got.shape[1] if kind == "flash" else got.shape[0]
        untouched = [b for b in range(blocks) if b not in d_blocks]
        rest = got[:, untouched] if kind == "flash" else got[untouched]
        assert torch.count_nonzero(rest) == 0, name
