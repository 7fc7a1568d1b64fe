"""The vLLM sweep stops the systems side by side during another's turn
(`kvx_bench.vllm_sweep.hold_idle`): on real process trees started the way the sweep starts vLLM
(`Server`, a new session per server), every process of a held system is stopped, its CPU time
stands still, the running system's processes run, and a held system still stops at once
(`Server.kill` continues it)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvx_bench import vllm_sweep  # noqa: E402
from test_e2e_vllm import Server  # noqa: E402

# Three generations, like a vLLM instance's API server, engine and worker: each process spins
# for 5 ms of every 10 ms; the first prints "ready" once the others have started.
TREE = r"""
import subprocess, sys, time
level, me = int(sys.argv[1]), sys.argv[2]
if level < 2:
    kid = subprocess.Popen([sys.executable, "-c", me, str(level + 1), me],
                           stdout=subprocess.PIPE, text=True)
    kid.stdout.readline()
print("ready", flush=True)
while True:
    end = time.thread_time() + 0.005
    while time.thread_time() < end:
        pass
    time.sleep(0.005)
"""


def start_system(tmp_path: Path, name: str) -> dict:
    servers = []
    for role in ("prefill", "decode"):
        srv = Server(f"{name}-{role}", [sys.executable, "-c", TREE, "0", TREE], tmp_path, {},
                     "http://127.0.0.1:9/health")
        servers.append(srv)
    deadline = time.monotonic() + 30
    while not all("ready" in s.log.read_text() for s in servers):
        assert time.monotonic() < deadline, "the process trees did not start"
        time.sleep(0.05)
    return {"servers": servers, "result": {"system": name}}


def processes(state: dict) -> dict[int, tuple[str, int]]:
    """Every process of a system's trees: pid -> (state letter, CPU ticks)."""
    roots = [s.proc.pid for s in state["servers"]]
    trees = vllm_sweep.process_trees(vllm_sweep.process_table(), roots)
    out = {}
    for pid, _ in (node for root in roots for node in trees[root]):
        fields = vllm_sweep.stat_fields(f"/proc/{pid}/stat")
        if fields is not None:
            out[pid] = (fields[0], int(fields[11]) + int(fields[12]))
    return out


def settle() -> None:
    time.sleep(0.3)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_held_systems_stop_whole_and_the_running_one_runs(tmp_path):
    a = start_system(tmp_path, "a")
    b = start_system(tmp_path, "b")
    try:
        assert len(processes(a)) == len(processes(b)) == 6
        vllm_sweep.hold_idle([a, b], a)
        settle()
        held = processes(b)
        assert all(st == "T" for st, _ in held.values()), held
        assert not any(st == "T" for st, _ in processes(a).values())
        time.sleep(0.5)
        # Not one tick of CPU time while stopped; the running ones spin half of the time.
        assert processes(b) == held
        before = sum(t for _, t in processes(a).values())
        time.sleep(0.5)
        assert sum(t for _, t in processes(a).values()) > before
        # The next turn: the roles swap.
        vllm_sweep.hold_idle([a, b], b)
        settle()
        assert all(st == "T" for st, _ in processes(a).values())
        assert not any(st == "T" for st, _ in processes(b).values())
        # Every system runs again.
        vllm_sweep.hold_idle([a, b], None)
        settle()
        assert not any(st == "T" for st, _ in {**processes(a), **processes(b)}.values())
        # A held system stops at once (a stopped process would hold SIGTERM until continued).
        vllm_sweep.hold_idle([a, b], b)
        settle()
        t0 = time.monotonic()
        procs = [s.proc for s in a["servers"]]
        vllm_sweep.stop_system(a)
        assert time.monotonic() - t0 < 20
        assert all(p.poll() is not None for p in procs)
        assert a["result"]["log_tracebacks"] == {"a-prefill": 0, "a-decode": 0}
    finally:
        for st in (a, b):
            if "servers" in st:
                vllm_sweep.stop_system(st)
