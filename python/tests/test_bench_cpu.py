"""The vLLM sweep's CPU accounting (`kvx_bench.vllm_sweep.cpu_parts`): each process of a system
counts for the part its depth below the instance names, the other systems' processes together,
on a real process tree that has used a known amount of CPU time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvx_bench import systems, vllm_sweep  # noqa: E402

# Three generations of processes, like a vLLM instance's API server, engine and worker: the
# child burns `engine_ms` of its own CPU time, the grandchild `worker_ms` (half of it in a helper
# thread that stays); the first prints one
# line once all three are done, and each then sleeps until it is killed.
TREE = r"""
import subprocess, sys, time
level, engine_ms, worker_ms, me = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if level < 2:
    kid = subprocess.Popen([sys.executable, "-c", me, str(level + 1), sys.argv[2], sys.argv[3], me],
                           stdout=subprocess.PIPE, text=True)
    kid.stdout.readline()
import threading
def burn(ms):
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass
if level == 2:  # half in the main thread, half in a helper thread that stays
    done = threading.Event()
    threading.Thread(target=lambda: (burn(worker_ms / 2), done.set(), time.sleep(600)),
                     daemon=True).start()
    burn(worker_ms / 2)
    done.wait()
else:
    burn((0, engine_ms)[level])
print("ready", flush=True)
time.sleep(600)
"""


def start_tree(engine_ms: int, worker_ms: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", TREE, "0", str(engine_ms), str(worker_ms),
                             TREE], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def kill_tree(proc: subprocess.Popen) -> None:
    table = vllm_sweep.process_table()
    doomed = [proc.pid]
    for pid in doomed:
        doomed.extend(p for p, (ppid, _) in table.items() if ppid == pid)
    for pid in reversed(doomed):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_cpu_parts_names_each_process_by_its_depth_and_pools_the_other_systems(monkeypatch):
    # An `mp` sweep (`--executor mp`): API server, engine core and worker, three processes deep.
    monkeypatch.setattr(systems, "EXECUTOR", "mp")
    measured_tree = start_tree(engine_ms=300, worker_ms=500)
    other_tree = start_tree(engine_ms=200, worker_ms=0)
    try:
        server = lambda name, proc: SimpleNamespace(name=name, proc=proc)  # noqa: E731
        measured = {"servers": [server("kvx-push-prefill", measured_tree)],
                    "result": {"system": "kvx-push"}}
        other = {"servers": [server("nixl-push-corrected-decode", other_tree)],
                 "result": {"system": "nixl-push-corrected"}}
        parts = vllm_sweep.cpu_parts([measured, other], measured)
        ms = parts
        # Each process burnt at least its share before it said it was ready; the ticks are
        # 10 ms apart, and interpreter start-up adds a little to each.
        assert 280 <= ms["prefill engine"] < 1000, ms
        assert 480 <= ms["prefill worker"] < 1200, ms
        assert 230 <= ms["prefill worker threads"] < ms["prefill worker"] - 230, ms
        assert ms["prefill api"] < 300, ms
        assert 180 <= ms["other systems"] < 1000, ms
        assert not any(k.startswith("decode") for k in ms), ms
        # A main thread waits for a core only while something else runs there: never longer
        # than the whole test, and its measure is there for every part.
        assert all(0 <= ms[f"prefill {d} runq"] < 60_000 for d in vllm_sweep.VLLM_DEPTHS), ms
        later = {**parts, "prefill worker": parts["prefill worker"] + 30.0,
                 "prefill worker runq": parts["prefill worker runq"] + 500.0}
        turn = vllm_sweep.cpu_turn(parts, later, {"busy_ms": 10_000.0})
        assert turn["prefill worker"] == pytest.approx(30.0)
        assert turn["prefill worker runq"] == pytest.approx(500.0)
        assert turn["prefill engine"] == 0
        # Run-queue waits and helper threads are not CPU time of their own.
        assert turn["rest of machine"] == pytest.approx(10_000.0 - 30.0)
        per = vllm_sweep.cpu_per_request([turn, turn], requests=4)
        assert per["prefill worker"] == pytest.approx(2 * turn["prefill worker"] / 4)
        # Under vLLM's uni executor the engine core's process runs the worker: all that lies
        # below the API server is the worker.
        uni = {**measured, "result": {"system": "kvx-push-uni"}}
        uni_parts = vllm_sweep.cpu_parts([uni, other], uni)
        assert "prefill engine" not in uni_parts, uni_parts
        assert uni_parts["prefill worker"] >= ms["prefill engine"] + ms["prefill worker"] - 1
        # A `uni` sweep (the default) counts every system so.
        monkeypatch.setattr(systems, "EXECUTOR", "uni")
        default_parts = vllm_sweep.cpu_parts([measured, other], measured)
        assert "prefill engine" not in default_parts, default_parts
        assert default_parts["prefill worker"] >= uni_parts["prefill worker"], default_parts
    finally:
        kill_tree(measured_tree)
        kill_tree(other_tree)


def test_uni_instances_bind_their_openmp_threads_as_vllms_mp_executor_does():
    """vLLM 0.32 applies `VLLM_CPU_OMP_THREADS_BIND` only to the workers of its mp executor;
    the harness sets the same OpenMP variables for an instance under uni (the end-to-end tests
    check the engine core's affinity)."""
    from test_e2e_vllm import core_ids, omp_binding, use_uni_executor

    args: list[str] = []
    env = {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    use_uni_executor(args, env)
    assert args == ["--distributed-executor-backend", "uni"]
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                   "OMP_NUM_THREADS": "1", "OMP_PLACES": "{1}", "OMP_PROC_BIND": "true"}
    assert omp_binding("0-2,5") == {"OMP_NUM_THREADS": "4", "OMP_PLACES": "{0,1,2,5}",
                                    "OMP_PROC_BIND": "true"}
    # No list to bind to: vLLM's own choice (auto), none (nobind), several ranks' lists.
    assert omp_binding(None) == omp_binding("auto") == omp_binding("nobind") == {}
    assert omp_binding("0|1") == {}
    assert core_ids("0|1") == {0, 1} and core_ids("2-3") == {2, 3}
