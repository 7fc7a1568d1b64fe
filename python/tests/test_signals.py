"""Loading kvx, and libfabric under it, keeps the engine's signal handlers. Debian's libfabric
links libinfinipath, whose constructor replaces the handlers of SIGSEGV, SIGBUS, SIGTERM, SIGINT,
SIGABRT and SIGILL with one that prints a backtrace and exits with status 1: vLLM's engine core,
which shuts down in order on SIGTERM, would die at once instead. kvx opens libfabric at run time
and puts back what its constructors replaced (libfabric-sys' shim). Each check runs in a fresh
interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent

HANDLERS = r"""
import ctypes, signal
libc = ctypes.CDLL(None, use_errno=True)
WATCHED = (signal.SIGSEGV, signal.SIGBUS, signal.SIGTERM, signal.SIGINT, signal.SIGABRT,
           signal.SIGILL)

def handlers():
    out = {}
    for sig in WATCHED:
        buf = ctypes.create_string_buffer(512)
        assert libc.sigaction(int(sig), None, buf) == 0
        out[sig.name] = buf.raw[:ctypes.sizeof(ctypes.c_void_p)]
    return out
"""


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HANDLERS + code], cwd=PACKAGE_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_sigterm_still_reaches_the_engines_handler_after_kvx_loads_and_opens_libfabric():
    done = run(r"""
import os, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append("term"))
signal.signal(signal.SIGINT, lambda s, f: got.append("int"))
before = handlers()
import kvx_vllm
from kvx_vllm import _native
assert handlers() == before, (before, handlers())
import torch
from kvx_vllm.layout import describe
caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(4, 2, 32, 64) for i in range(2)}
desc = describe(caches, head_size=32, total_kv_heads=2, block_size=32, tp_size=1, tp_rank=0)
producer = _native.Producer("p0", desc.layout, desc.regions, transport="libfabric:shm",
                            token_unit=1)
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGINT)
deadline = time.monotonic() + 5
while len(got) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
producer.shutdown()
# CPython runs the handlers of signals that arrived before it looked in signal-number order
# (SIGINT before SIGTERM), in the order sent otherwise: what matters is that both ran.
print("handled", sorted(got))
""")
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "handled ['int', 'term']" in done.stdout, done.stdout
