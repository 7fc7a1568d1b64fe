"""Helpers shared by the native module's tests on the host (test_native.py) and on GPUs
(test_gpu.py)."""

from __future__ import annotations

import time

import torch


# Per kind of cache: the logical shape (from blocks, heads, block size, head size) and its axes
# from outermost to innermost in memory.
#   flash, flash-hnd: earlier vLLMs' FlashAttention tensor (2, blocks, tokens, heads, dim), in
#     their NHD and HND layouts;
#   cells-hnd, cells-nhd: vLLM 0.32's per-layer view [blocks, heads, tokens, K|V] of one shared
#     allocation, in its LBHNC and LBNHC layouts (layer-compact: each layer's blocks together).
KINDS = {
    "flash": (lambda b, h, bs, d: (2, b, bs, h, d), (0, 1, 2, 3, 4)),
    "flash-hnd": (lambda b, h, bs, d: (2, b, bs, h, d), (0, 1, 3, 2, 4)),
    "cells-hnd": (lambda b, h, bs, d: (b, h, bs, 2 * d), (0, 1, 2, 3)),
    "cells-nhd": (lambda b, h, bs, d: (b, h, bs, 2 * d), (0, 2, 1, 3)),
}


def make_caches(kind: str, layers: int, blocks: int, heads: int, bs: int, head: int,
                fill: bool, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Per-layer KV caches as vLLM lays them out: views of one allocation, strided as `kind`
    says (see KINDS), random where `fill`, else zeros."""
    shape_of, axes = KINDS[kind]
    shape = shape_of(blocks, heads, bs, head)
    strides, step = [0] * len(shape), 1
    for axis in reversed(axes):
        strides[axis] = step
        step *= shape[axis]
    raw = torch.zeros(layers * step, device=device)
    if fill:
        raw.normal_()
    return {f"model.layers.{i}.self_attn.attn":
            torch.as_strided(raw, shape, strides, storage_offset=i * step) for i in range(layers)}


def until(what: str, check, timeout: float = 10.0):
    """`check()`'s first truthy answer, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.005)
    return got


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
    return cache[:, block, slot] if kind.startswith("flash") else cache[block, :, slot]


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
        flash = kind.startswith("flash")
        blocks = got.shape[1] if flash else got.shape[0]
        untouched = [b for b in range(blocks) if b not in d_blocks]
        rest = got[:, untouched] if flash else got[untouched]
        assert torch.count_nonzero(rest) == 0, name
