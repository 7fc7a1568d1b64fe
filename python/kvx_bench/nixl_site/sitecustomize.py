"""Loaded by every Python process of a vLLM instance that runs one of vLLM's NIXL connectors in
`cargo xtask bench vllm` (this folder is put first on PYTHONPATH for those instances only; the
installed files are never edited). Two independent switches, read from the environment:

KVX_BENCH_NIXL_CUDA_MAJOR=12
    The `nixl` meta package picks its backend wheel from the CUDA version torch reports. The venv's
    torch 2.13.0 (PyPI) reports CUDA 13, so `import nixl` asks for `nixl_cu13`, which is not
    installed, and fails. This makes `nixl_meta_utils.detect_cuda_major()` return 12, so `nixl`
    loads the installed `nixl_cu12` (both run on CPU memory here; no CUDA is used).

KVX_BENCH_VLLM_CORRECTED=1   ("corrected" vLLM; unset = "as shipped")
    1. vLLM's NIXL worker (`.../kv_connector/v1/nixl/base_worker.py`, `__init__` on a CPU
       platform) calls `os.sched_setaffinity(0, [last core of each NUMA node])`, moving the
       engine's main thread onto the last core — on 2 cores, prefill's forward pass lands on
       decode's core. The module's `os` is replaced by a view of `os` whose `sched_setaffinity`
       does nothing (the call is logged), so the `VLLM_CPU_OMP_THREADS_BIND` pinning stays.
    2. NIXL's Python agent (`nixl_cu12/_api.py`, `nixl_agent.__init__`) hard-codes
       `agent_config.pthrDelay = 0`: the progress thread polls without pause and keeps a core
       busy. The agent is created with `pthrDelay = 1000` (microseconds: poll every 1 ms)
       instead, by wrapping `_bindings.nixlAgent` as that module sees it.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import types


def _log(msg: str) -> None:
    print(f"[kvx-bench sitecustomize pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _patch_base_worker(module: types.ModuleType) -> None:
    real_os = module.os

    class _OsView(types.ModuleType):
        def __getattr__(self, name):
            return getattr(real_os, name)

        @staticmethod
        def sched_setaffinity(pid, cores):
            _log(f"corrected: skipped os.sched_setaffinity({pid}, {sorted(cores)}) in vLLM's NIXL worker")

    module.os = _OsView("os")
    _log("corrected: vLLM NIXL worker will leave CPU affinity alone")


def _patch_nixl_api(module: types.ModuleType) -> None:
    real = module.nixlBind
    delay_us = int(os.environ.get("KVX_BENCH_NIXL_PTHR_DELAY_US", "1000"))

    class _BindView(types.ModuleType):
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def nixlAgent(name, config):  # noqa: N802 - the binding's name
            config.pthrDelay = delay_us
            _log(f"corrected: NIXL agent {name} progress thread polls every {delay_us} us")
            return real.nixlAgent(name, config)

    module.nixlBind = _BindView(real.__name__)


_HOOKS = {}
if os.environ.get("KVX_BENCH_VLLM_CORRECTED") == "1":
    _HOOKS["vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"] = _patch_base_worker
    _HOOKS["nixl_cu12._api"] = _patch_nixl_api


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a hook right after one of the named modules has executed."""

    def find_spec(self, name, path, target=None):
        hook = _HOOKS.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module, _run=run, _hook=hook):
            _run(module)
            _hook(module)

        loader.exec_module = exec_module
        return spec


if _HOOKS:
    sys.meta_path.insert(0, _AfterImport())

if os.environ.get("KVX_BENCH_NIXL_CUDA_MAJOR"):
    try:
        import nixl_meta_utils

        _major = int(os.environ["KVX_BENCH_NIXL_CUDA_MAJOR"])
        nixl_meta_utils.detect_cuda_major = lambda: _major
    except ImportError:
        pass
