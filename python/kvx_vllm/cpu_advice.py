"""What the connector works out about the CPU it runs on: the start-up advice about vLLM's
executor and OpenMP binding (``cpu_executor_advice``), and which kernel family vLLM's CPU
attention backend uses for a cache (``cpu_attention_kernel``), which decides how it lays out a
block."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Variables that bind an OpenMP runtime's threads (GNU, Intel/LLVM, and the standard ones).
OMP_BINDING_VARS = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def cpu_executor_advice(executor: str | None, push_consumer: bool, tp_size: int,
                        environ: Mapping[str, str]) -> list[tuple[int, str]]:
    """What a rank on CPU logs at start about vLLM's executor, as (log level, message).

    Under `mp` a one-rank push decode is told that vLLM's engine-worker queue spins while
    requests wait for their KV, and that `uni` spares it. Under `uni` every rank is warned when
    nothing binds its OpenMP threads: vLLM 0.32 applies ``VLLM_CPU_OMP_THREADS_BIND`` only to
    the worker processes its `mp` executor starts, so under `uni` torch runs one unbound
    OpenMP thread per core of the machine, and instances sharing a machine slow each other
    down several times over whenever both compute."""
    advice = []
    if executor == "mp" and push_consumer and tp_size == 1:
        advice.append((logging.INFO, (
            "vLLM's mp executor on CPU spins on its engine-worker message queue while "
            "requests wait for their KV (about a core); VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "and --distributed-executor-backend uni run the worker in the engine core's "
            "process and spare that; bind its OpenMP threads then (kvx docs/vllm.md)"
        )))
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if (executor == "uni" and bind != "nobind"
            and not any(environ.get(v) for v in OMP_BINDING_VARS)):
        advice.append((logging.WARNING, (
            f"vLLM's uni executor on CPU does not apply VLLM_CPU_OMP_THREADS_BIND={bind}: "
            "its OpenMP threads, one per core, run unbound; set OMP_NUM_THREADS, OMP_PLACES "
            "and OMP_PROC_BIND=true for the engine as vLLM's mp executor does for its "
            "workers (kvx docs/vllm.md)"
        )))
    return advice


def cpu_attention_kernel(kv_caches: dict[str, torch.Tensor], head_size: int, block_size: int,
                         cache_dtype: str) -> str | None:
    """The kernel family vLLM's CPU attention backend uses for this cache (``vec``, ``vec16``,
    ``amx``, ``neon``, …), which decides how it lays out a block; ``None`` for a cache that is
    not on the CPU, or when this vLLM does not say (then kvx describes the cache block by
    block)."""
    first = next(iter(kv_caches.values()), None)
    if first is None or first.device.type != "cpu":
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    try:
        return str(_get_attn_isa(first.dtype, block_size, head_size, cache_dtype))
    except Exception:  # noqa: BLE001 - an unknown combination: describe block by block
        return None
