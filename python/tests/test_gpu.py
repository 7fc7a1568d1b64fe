"""The native module with CUDA tensors, as vLLM hands them over on GPUs, between two processes:
prefill in a child process, decode in the test's. vLLM 0.32's per-layer views of one shared
allocation, `[blocks, heads, tokens, K|V]` in its head-major (`LBHNC`) and token-major (`LBNHC`)
layouts, and earlier vLLMs' FlashAttention tensors `(2, blocks, tokens, heads, dim)`. The
transports: what the connector's default (`auto`) picks for a CUDA cache, CUDA IPC on the
cache's own GPU, and NIXL (`VRAM`; UCX's `cuda_ipc` within the host; skipped, saying so, without
a NIXL runtime in `KVX_NIXL_LIB_DIR`). Push (with part of the request written before it finishes) and pull move every
token's K and V to where decode's blocks say, across different block sizes, and leave every
other block untouched.

Without a CUDA device these tests are skipped, saying so; with `KVX_REQUIRE_GPU=1` (set on GPU
machines) they fail instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvx_vllm import _native
from kvx_vllm.config import nixl_library, resolve_transport
from kvx_vllm.layout import describe
from kv_helpers import assert_tokens_moved, make_caches, wait_events

HEAD = 32
HEADS = 2
LAYERS = 3
BLOCKS = 16

# Prefill: fills its cache, starts a producer over the transport `auto` picks, and answers the
# test's commands (one JSON object per line) until it is told to quit.
PREFILL = r"""
import json, sys
import torch
from kvx_vllm import _native
from kvx_vllm.config import nixl_library, resolve_transport
from kvx_vllm.layout import describe

cfg = json.loads(sys.argv[1])
dev, bs = cfg["device"], cfg["block_size"]
sys.path.insert(0, cfg["helpers"])
from kv_helpers import make_caches, until

torch.manual_seed(11)
caches = make_caches(cfg["kind"], cfg["layers"], cfg["blocks"], cfg["heads"], bs, cfg["head"],
                     fill=True, device=f"cuda:{dev}")
torch.cuda.synchronize(dev)
desc = describe(caches, head_size=cfg["head"], total_kv_heads=cfg["heads"], block_size=bs,
                tp_size=1, tp_rank=0)
transport = resolve_transport(cfg["transport"], dev)
producer = _native.Producer("p0", desc.layout, desc.regions, transport=transport,
                            token_unit=desc.token_unit, cuda_device=dev,
                            nixl_library=nixl_library())
torch.save({k: v.cpu() for k, v in caches.items()}, cfg["dump"])
print(json.dumps({"addr": producer.control_addr, "mode": desc.mode, "transport": transport}),
      flush=True)


for line in sys.stdin:
    cmd = json.loads(line)
    op, out = cmd["op"], {}
    if op == "progress":
        producer.request_progress(cmd["tid"], cmd["blocks"], cmd["tokens"])
        until("early write", lambda: producer.stats()["bytes_streamed"], 20)
    elif op == "finished":
        producer.request_finished(cmd["tid"], cmd["rid"], cmd["blocks"], cmd["tokens"])
    elif op == "finished_pull":
        producer.request_finished_pull(cmd["tid"], cmd["rid"], cmd["blocks"], cmd["tokens"])
    elif op == "done":
        out["finished"] = until("finished report", producer.take_finished, 20)
    elif op == "quit":
        producer.shutdown()
        break
    out["stats"] = dict(producer.stats())
    print(json.dumps(out), flush=True)
"""


@pytest.fixture
def gpu() -> int:
    """Decode's device: the last GPU (a second one where there is one, else prefill's)."""
    if not torch.cuda.is_available():
        why = "no CUDA device (torch.cuda.is_available() is False)"
        if os.environ.get("KVX_REQUIRE_GPU") == "1":
            pytest.fail(f"KVX_REQUIRE_GPU=1 but {why}")
        print(f"SKIPPED (GPU test): {why}")
        pytest.skip(why)
    return torch.cuda.device_count() - 1


TRANSPORTS = ["auto", "nixl"]


def usable(transport: str) -> None:
    """Skips (saying so) a NIXL test without a NIXL runtime."""
    if transport == "nixl" and nixl_library() is None:
        print("SKIPPED (NIXL): no runtime (KVX_NIXL_LIB_DIR unset, no nixl-cu12 installed)")
        pytest.skip("no NIXL runtime")


class Prefill:
    def __init__(self, tmp: Path, kind: str, block_size: int, transport: str = "auto"):
        self.dump = tmp / "prefill-caches.pt"
        cfg = dict(device=0, kind=kind, block_size=block_size, blocks=BLOCKS, heads=HEADS,
                   transport=transport,
                   head=HEAD, layers=LAYERS, dump=str(self.dump),
                   helpers=str(Path(__file__).resolve().parent))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PREFILL, json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.hello = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"prefill exited with {self.proc.wait(timeout=30)}"
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def caches(self) -> dict[str, torch.Tensor]:
        return torch.load(self.dump)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.ask(op="quit")
            except (AssertionError, BrokenPipeError, json.JSONDecodeError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def decode_side(device: int, kind: str, block_size: int, transport: str = "auto"):
    caches = make_caches(kind, LAYERS, BLOCKS, HEADS, block_size, HEAD, fill=False,
                         device=f"cuda:{device}")
    desc = describe(caches, head_size=HEAD, total_kv_heads=HEADS, block_size=block_size,
                    tp_size=1, tp_rank=0)
    resolved = resolve_transport(transport, device)
    if transport == "auto":
        assert resolved == f"cuda-ipc:{device}"
    consumer = _native.Consumer("d0", desc.layout, desc.regions, transport=resolved,
                                token_unit=desc.token_unit, cuda_device=device,
                                nixl_library=nixl_library())
    return caches, desc, consumer


def assert_moved(kind, p_caches, p_blocks, p_bs, d_caches, d_blocks, d_bs, tokens, device):
    torch.cuda.synchronize(device)
    got = {name: t.cpu() for name, t in d_caches.items()}
    assert_tokens_moved(kind, p_caches, p_blocks, p_bs, got, d_blocks, d_bs, tokens)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind,p_bs,d_bs", [
    ("cells-hnd", 16, 32),
    ("cells-nhd", 32, 16),
    ("cells-hnd", 32, 32),
    ("flash", 16, 32),
])
def test_push_moves_cuda_tensors_between_processes(gpu, tmp_path, kind, p_bs, d_bs, transport):
    """Decode registers first; prefill reports 70 of 100 tokens computed (the whole blocks of
    both sides among them are written at once), then finishes; decode's event comes once every
    byte landed, and prefill's blocks come back."""
    usable(transport)
    d_caches, d_desc, consumer = decode_side(gpu, kind, d_bs, transport)
    prefill = Prefill(tmp_path, kind, p_bs, transport)
    try:
        want = "cuda-ipc:0" if transport == "auto" else transport
        assert prefill.hello["transport"] == want
        assert prefill.hello["mode"] == d_desc.mode == "exact"
        tokens = 100
        p_blocks = [5, 1, 12, 3, 9, 14, 7][: -(-tokens // p_bs)]
        d_blocks = [2, 14, 7, 0, 11, 4, 9][: -(-tokens // d_bs)]
        consumer.request_allocated("t-1", "dreq", prefill.hello["addr"], tokens, 0, d_blocks)
        early = prefill.ask(op="progress", tid="t-1", blocks=p_blocks[: -(-70 // p_bs)],
                            tokens=70)
        assert early["stats"]["bytes_streamed"] > 0, early
        assert consumer.take_events() == []
        prefill.ask(op="finished", tid="t-1", rid="preq", blocks=p_blocks, tokens=tokens)
        assert wait_events(consumer, 1, timeout=20) == [("dreq", True, "", "")]
        done = prefill.ask(op="done")
        assert done["finished"] == [["preq", True, ""]], done
        assert done["stats"]["held"] == 0, done
        # Whole blocks of both sides up to token 70 went early; every token exactly once.
        unit = max(p_bs, d_bs)
        per_token = LAYERS * 2 * HEADS * HEAD * 4
        assert done["stats"]["bytes_streamed"] == 70 // unit * unit * per_token, done
        assert done["stats"]["bytes_written"] == tokens * per_token, done
        assert_moved(kind, prefill.caches(), p_blocks, p_bs, d_caches, d_blocks, d_bs, tokens,
                     gpu)
    finally:
        prefill.close()
        consumer.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", ["cells-hnd", "cells-nhd"])
def test_pull_reads_cuda_tensors_between_processes(gpu, tmp_path, kind, transport):
    """Prefill finishes first and holds its blocks; decode reads them into its own (different
    block size) and prefill's blocks come back once decode says it is done."""
    usable(transport)
    p_bs, d_bs = 32, 16
    d_caches, _, consumer = decode_side(gpu, kind, d_bs, transport)
    prefill = Prefill(tmp_path, kind, p_bs, transport)
    try:
        tokens = 77
        p_blocks = [8, 3, 15][: -(-tokens // p_bs)]
        d_blocks = [6, 1, 13, 10, 2][: -(-tokens // d_bs)]
        prefill.ask(op="finished_pull", tid="t-2", rid="preq", blocks=p_blocks, tokens=tokens)
        consumer.pull("t-2", "dreq", prefill.hello["addr"], tokens, 0, d_blocks, p_blocks)
        assert wait_events(consumer, 1, timeout=20) == [("dreq", True, "", "")]
        done = prefill.ask(op="done")
        assert done["finished"] == [["preq", True, ""]], done
        assert done["stats"]["held"] == 0, done
        assert_moved(kind, prefill.caches(), p_blocks, p_bs, d_caches, d_blocks, d_bs, tokens,
                     gpu)
    finally:
        prefill.close()
        consumer.shutdown()


def test_a_cuda_cache_gets_cuda_ipc_on_its_own_device(gpu):
    """What the connector does in `register_kv_caches`: the cache's device picks the transport,
    and a host transport for it is refused before anything is registered."""
    caches, desc, consumer = decode_side(gpu, "cells-hnd", 16)
    consumer.shutdown()
    assert desc.mode == "exact"
    assert (desc.layout["arrangement"], desc.layout["order"]) == ("per-layer-cell-kv", "hnd")
    assert all(t.is_cuda for t in desc.tensors)
    with pytest.raises(ValueError, match="moves host memory"):
        resolve_transport("cma", gpu)
