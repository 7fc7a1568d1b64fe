"""Where a turn's CPU time goes: the machine's time stolen and busy (`MachineClock`, from
/proc/stat), each process of the systems by the part it plays (`cpu_parts`, from /proc/<pid>),
a turn's share (`cpu_turn`) and a point's per request (`cpu_per_request`)."""

from __future__ import annotations

import os
import threading
import time

from kvx_bench.systems import executor_of, log


class MachineClock:
    """The machine's CPU time as /proc/stat counts it, sampled every `PERIOD_S` on a thread:
    time stolen by the hypervisor (`steal`: the VM's cores ran someone else) and time busy, to
    tell a slow spell of the machine from a slow system. Counters tick in 10 ms jiffies."""

    PERIOD_S = 0.02

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []  # (perf_counter, steal, busy) jiffies
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="machine-clock", daemon=True)
        self._thread.start()

    @staticmethod
    def read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
        except OSError:
            return None
        # cpu user nice system idle iowait irq softirq steal ...
        v = [int(x) for x in fields[1:9]]
        return v[7], v[0] + v[1] + v[2] + v[5] + v[6]

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            got = self.read()
            if got is not None:
                self.samples.append((time.perf_counter(), *got))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> dict | None:
        """Steal and busy in [t0, t1], in ms of CPU time (all cores together)."""
        import bisect

        # The samples are in time order; `key` bisects them without copying their times.
        samples = self.samples
        i = bisect.bisect_left(samples, t0, key=lambda s: s[0])
        j = bisect.bisect_right(samples, t1, key=lambda s: s[0]) - 1
        if i >= len(samples) or j <= i:
            return None
        a, b = self.samples[i], self.samples[j]
        return {"steal_ms": (b[1] - a[1]) * 10.0, "busy_ms": (b[2] - a[2]) * 10.0,
                "window_ms": (b[0] - a[0]) * 1e3}


# One for the whole sweep (None where /proc/stat cannot be read).
CLOCK: MachineClock | None = None


# The parts of a system whose CPU time a turn accounts for: the depth of a process below a vLLM
# instance's API server names it (its engine core is a child, its workers grandchildren).
VLLM_DEPTHS = ("api", "engine", "worker")
TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0


def stat_fields(path: str) -> list[str] | None:
    """The fields of a `/proc/.../stat` file after the command name (`state` first, so that
    `ppid` is [1] and `utime`, `stime` are [11], [12]); None if it is gone."""
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (in parentheses) may hold spaces; the fields after it do not.
    return stat[stat.rfind(")") + 2:].split()


def process_table() -> dict[int, tuple[int, int]]:
    """Every process of the machine: pid -> (parent pid, CPU time of all its threads in clock
    ticks), from /proc/<pid>/stat; empty where there is no /proc."""
    out: dict[int, tuple[int, int]] = {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return out
    for pid in pids:
        fields = stat_fields(f"/proc/{pid}/stat")
        if fields is not None:  # else gone since the listing
            out[pid] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return out


def process_trees(table: dict[int, tuple[int, int]], roots: list[int]
                   ) -> dict[int, list[tuple[int, int]]]:
    """Each root's tree in `table` (`process_table`): the root and its descendants, each as
    (pid, depth below the root); empty for a root that is gone."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    trees = {}
    for root in roots:
        found, stack = [], [(root, 0)]
        while stack:
            pid, depth = stack.pop()
            if pid in table:
                found.append((pid, depth))
                stack.extend((c, depth + 1) for c in children.get(pid, ()))
        trees[root] = found
    return trees


def helper_threads_ticks(pid: int) -> int:
    """CPU ticks of a process's threads other than its main one: in a vLLM worker, whose main
    thread runs the model and spins on its message queue between steps, the connector's
    threads (kvx's driver and transport threads, NIXL's and UCX's) and any others."""
    total = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit() and int(t) != pid]
    except OSError:
        return 0
    for tid in tids:
        fields = stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if fields is not None:
            total += int(fields[11]) + int(fields[12])
    return total


def runqueue_wait_ms(pid: int) -> float:
    """How long a process's main thread has waited on a run queue, runnable but not running
    (`/proc/<pid>/schedstat`, second field, ns), in ms; 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return 0.0


# The parts that are not CPU time of their own but measures within others (not summed into the
# machine's total).
NOT_CPU = (" threads", " runq")


def cpu_parts(states: list[dict], measured: dict) -> dict[str, float]:
    """CPU time so far, in ms, of the measured system's parts (`prefill api`, `prefill engine`,
    `prefill worker`, the same for decode, `router`), of the other systems' processes together
    (`other systems`) and of this client (`client`). Processes that ended are not counted.
    `prefill worker threads` and `decode worker threads`: the part of the workers' time spent
    in threads other than the main one (`helper_threads_ticks`); `<part> runq`: how long the
    part's main threads waited, runnable, for a core (`runqueue_wait_ms`)."""
    table = process_table()
    trees = process_trees(table, [srv.proc.pid for st in states
                                  for srv in st.get("servers", [])])
    parts: dict[str, float] = {"other systems": 0.0,
                               "client": table.get(os.getpid(), (0, 0))[1] * TICK_MS}

    def add(part: str, ms: float) -> None:
        parts[part] = parts.get(part, 0.0) + ms

    for st in states:
        for srv in st.get("servers", []):
            role = srv.name.rsplit("-", 1)[-1]  # prefill, decode or router
            for pid, depth in trees[srv.proc.pid]:
                ms = table[pid][1] * TICK_MS
                if st is not measured:
                    add("other systems", ms)
                    continue
                # With the uni executor the engine core's process runs the worker too: it is
                # counted as the worker, which does the model's and the connector's work.
                depths = (VLLM_DEPTHS if executor_of(st["result"]["system"]) == "mp"
                          else ("api", "worker"))
                part = ("router" if role == "router"
                        else f"{role} {depths[min(depth, len(depths) - 1)]}")
                add(part, ms)
                add(f"{part} runq", runqueue_wait_ms(pid))
                if part.endswith(" worker"):
                    add(f"{part} threads", helper_threads_ticks(pid) * TICK_MS)
    return parts


def cpu_turn(before: dict[str, float], after: dict[str, float], machine: dict | None) -> dict:
    """A turn's CPU time in ms per part (`cpu_parts` after minus before; a process that started
    or ended in between counts from zero or not at all), and `rest of machine`: the machine's
    busy time (`MachineClock`) that none of them account for."""
    out = {k: max(0.0, after.get(k, 0.0) - before.get(k, 0.0)) for k in after}
    if machine is not None:
        out["rest of machine"] = max(0.0, machine["busy_ms"] - sum(
            v for k, v in out.items() if not k.endswith(NOT_CPU)))
    return out


def cpu_per_request(turns: list[dict], requests: int) -> dict | None:
    """A point's CPU time per request in ms, by part, over all its turns (`cpu_turn`)."""
    if not turns or not requests:
        return None
    keys = sorted({k for t in turns for k in t})
    return {k: sum(t.get(k, 0.0) for t in turns) / requests for k in keys}


def note_machine(got: list[dict], t_turn: float, system: str, round_: int) -> None:
    """Writes into each request's sample the CPU time the hypervisor stole from the machine
    while it waited for its first token, and logs the turn's steal."""
    if CLOCK is None:
        return
    for res in got:
        if res.get("first_at") is not None:
            m = CLOCK.between(res["sent_at"], res["first_at"])
            res["steal_ms"] = None if m is None else m["steal_ms"]
    turn = CLOCK.between(t_turn, time.perf_counter())
    if turn is not None and turn["steal_ms"] > 0:
        log(f"{system} round {round_}: {turn['steal_ms']:.0f} ms of CPU stolen in "
            f"{turn['window_ms'] / 1e3:.1f} s ({turn['busy_ms']:.0f} ms busy)")
