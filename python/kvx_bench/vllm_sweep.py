"""kvx against vLLM's own NIXL connectors, end to end on real vLLM (CPU), same machine, same run.

Run by `cargo xtask bench vllm [--quick]` with the venv's Python (see xtask/src/vllm_bench.rs);
standalone:

    .kvx-cache/venv/bin/python -m kvx_bench.vllm_sweep [--kvx-bin target/release/kvx] [--quick]
        (from python/, or with python/ on PYTHONPATH)

For each system — kvx push, kvx pull (the kvx_vllm connectors behind `kvx proxy`), vLLM's
NixlConnector (pull) and NixlPushConnector, each of the vLLM ones "as shipped" and "corrected"
(see nixl_site/sitecustomize.py) — it starts a prefill instance on core 0 and a decode instance
on core 1 (the tiny float32 model of python/tests/tiny_model.py, prefix caching off on both;
vLLM's `uni` executor with the OpenMP threads bound, or `--executor mp`, vLLM's own default),
the router, sends warm-up requests, then for every input length and request rate a Poisson
stream of streamed completions (random token ids, so nothing is cached; `ignore_eos`, fixed
output length). The systems that leave an idle machine alone (kvx, the corrected vLLM ones) run
side by side: all started at once, and each point is measured in rounds (`--rounds`, default
3) in which every system gets the same requests in turn, another system first each round, so
that the machine's slow spells (a shared 2-core VM whose vLLM workers spin in their message
queues) fall on all of them alike; during a system's turn the others are stopped (SIGSTOP,
`--idle-systems`), so that each is measured alone on the machine. The "as shipped" vLLM
systems, whose progress threads spin even when idle, run alone afterwards. TTFT (request sent
to first streamed token) and TPOT ((last token - first token) / (output tokens - 1)) are
measured by this client. A request that fails or takes longer
than the cap counts as an error or a timeout: a result, not a crash.

Routers: `kvx proxy --mode push|pull` for kvx and for NixlConnector (its pull protocol is the
same: prefill with `do_remote_decode`, then decode with the `kv_transfer_params` prefill
returned). NixlPushConnector needs the prefill instance's NIXL coordinates in decode's
`kv_transfer_params` before prefill has run, which `kvx proxy` does not send, so a small router
here (`nixl_push_router`, aiohttp) sends both legs at once with the same `X-Request-Id`.

Output (--out, default target/kvx-bench): vllm.json (every point, every system, and the
per-request samples), vllm.md (tables and the target check); logs of every process under
vllm-logs/. The plots are drawn from vllm.json by xtask.

Several sweeps of the same systems, lengths and rates pool into one report of all their rounds
(the targets judged anew over them):

    .kvx-cache/venv/bin/python -m kvx_bench.vllm_sweep pool A/vllm.json B/vllm.json --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import uuid
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "python" / "tests"))

DEBUG = bool(os.environ.get("KVX_BENCH_ROUTER_DEBUG"))
BLOCK = 32
OUTPUT_TOKENS = 16
REQUEST_CAP_S = 60.0
START_TIMEOUT = 420.0
P_CORES, D_CORES = "0", "1"
NIXL_SITE = HERE / "nixl_site"
# At most this many systems run side by side: a pair of instances takes about 5 GiB here
# (vLLM's CPU worker allocates at least 1 GiB of KV cache whatever it is told).
MAX_SIDE_BY_SIDE = 3
# vLLM's workers spin on their message queue for 1 s after their last step: a system's turn
# starts this long after the previous one ended, so that it does not pay for that spin.
TURN_GAP_S = 1.5
# Untimed requests, one at a time, that start each system's turn: a system that sat idle while
# the others took theirs answers its first requests of a turn slowly (measured here with three
# systems side by side: the first 2 to 4 of 12 took 300 to 1,000 ms, under every system), which
# a system serving steady traffic never does.
TURN_WARMUP = 2

# A stream whose tokens reached the client in this many server-sent events or fewer was merged
# by decode's API server (vLLM coalesces a request's outputs when its stream runs behind).
COALESCED_PIECES = 4

# (name, router, connector, corrected)
SYSTEMS = [
    ("kvx-push", "kvx-push", "KvxPushConnector", None),
    # Variants of kvx push for A/B runs side by side, run only when named (see KVX_VARIANTS).
    ("kvx-push-noseal", "kvx-push", "KvxPushConnector", None),
    ("kvx-push-nowait", "kvx-push", "KvxPushConnector", None),
    ("kvx-push-uni", "kvx-push", "KvxPushConnector", None),
    ("kvx-pull", "kvx-pull", "KvxPullConnector", None),
    ("nixl-pull-shipped", "kvx-pull", "NixlConnector", False),
    ("nixl-pull-corrected", "kvx-pull", "NixlConnector", True),
    ("nixl-push-shipped", "nixl-push", "NixlPushConnector", False),
    ("nixl-push-corrected", "nixl-push", "NixlPushConnector", True),
]


# The kvx variants' extra-config keys (on both instances), by the end of the system's name.
KVX_VARIANTS = {
    # The seal off: the KV leaves when vLLM has finished the request, an engine iteration
    # after its last forward pass.
    "-noseal": {"seal": False},
    # Steps without a forward pass return at once (vLLM's own pace) instead of waiting up to
    # `idle_wait_ms` for a transfer to end.
    "-nowait": {"idle_wait_ms": 0},
}


def variant_extra(system: str) -> dict:
    return next((extra for end, extra in KVX_VARIANTS.items() if system.endswith(end)), {})


# A variant whose instances run vLLM's uni executor whatever `--executor` says (an A/B of the
# executor side by side).
UNI_VARIANT = "-uni"


def is_variant(system: str) -> bool:
    return bool(variant_extra(system)) or system.endswith(UNI_VARIANT)


def executor_of(system: str) -> str:
    return "uni" if system.endswith(UNI_VARIANT) else EXECUTOR


def log(msg: str) -> None:
    print(f"[vllm-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def quantiles(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p25": None, "p50": None, "p99": None, "n": 0}
    s = sorted(xs)

    def q(p: float) -> float:
        # Linear interpolation between closest ranks (numpy's default).
        k = (len(s) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": statistics.fmean(s), "p25": q(0.25), "p50": q(0.5), "p99": q(0.99),
            "n": len(s)}


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


# ---------------------------------------------------------------------------------------------
# The router for NixlPushConnector (run as `python -m kvx_bench.vllm_sweep router ...`).


async def nixl_push_router(listen_port: int, prefill: str, decode: str, p_engine: str,
                           p_side_port: int) -> None:
    import aiohttp
    from aiohttp import web

    timeout = aiohttp.ClientTimeout(total=600)
    session = aiohttp.ClientSession(timeout=timeout,
                                    connector=aiohttp.TCPConnector(limit=0))

    async def health(_req):
        return web.Response(text="ok")

    async def completions(req: web.Request):
        body = await req.json()
        rid = f"nixlpush-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": rid}
        p_body = dict(body)
        p_body.update(max_tokens=1, stream=False,
                      kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        p_body.pop("stream_options", None)
        p_body.pop("max_completion_tokens", None)
        d_body = dict(body)
        d_body["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": p_engine, "remote_host": "127.0.0.1",
            "remote_port": p_side_port, "tp_size": 1,
            # Required by the decode side's metadata; in push mode it only names the request
            # for heartbeats (prefill learns decode's id from the registration). vLLM names a
            # completion `cmpl-<X-Request-Id>-<n>` plus a random suffix that it strips to match.
            "remote_request_id": f"cmpl-{rid}-0",
        }

        async def p_leg():
            async with session.post(f"{prefill}{req.path}", json=p_body, headers=headers) as r:
                text = await r.read()
                if r.status != 200:
                    raise web.HTTPBadGateway(text=f"prefill {r.status}: {text[:300]!r}")

        p_task = asyncio.create_task(p_leg())
        try:
            async with session.post(f"{decode}{req.path}", json=d_body, headers=headers) as r:
                resp = web.StreamResponse(status=r.status, headers={
                    "content-type": r.headers.get("content-type", "application/json")})
                await resp.prepare(req)
                async for chunk in r.content.iter_any():
                    if DEBUG:
                        print(f"{time.perf_counter():.4f} {rid} {len(chunk)}", file=sys.stderr,
                              flush=True)
                    await resp.write(chunk)
                await resp.write_eof()
            await p_task
            return resp
        finally:
            if not p_task.done():
                p_task.cancel()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", listen_port).start()
    await asyncio.Event().wait()


# ---------------------------------------------------------------------------------------------
# The load client.


async def one_request(session, url: str, prompt: list[int], sent_at: float) -> dict:
    import aiohttp

    body = {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    pieces = 0
    completion_tokens = None
    try:
        async with asyncio.timeout(REQUEST_CAP_S):
            async with session.post(f"{url}/v1/completions", json=body) as r:
                if r.status != 200:
                    text = await r.text()
                    return {"ok": False, "error": f"HTTP {r.status}: {text[:200]}"}
                async for raw in r.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return {"ok": False, "error": f"error event: {str(event)[:200]}"}
                    if event.get("usage"):
                        completion_tokens = event["usage"].get("completion_tokens")
                    if event.get("choices"):
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        last = now
                        pieces += 1
    except TimeoutError:
        return {"ok": False, "timeout": True, "error": f"over {REQUEST_CAP_S:.0f} s",
                "ttft_ms": None if first is None else (first - sent_at) * 1e3}
    except (aiohttp.ClientError, OSError, ValueError) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if first is None:
        return {"ok": False, "error": "no token streamed"}
    n = completion_tokens or pieces
    if n != OUTPUT_TOKENS:
        return {"ok": False, "error": f"{n} output tokens, expected {OUTPUT_TOKENS}"}
    # Tokens that came in one streamed event (vLLM coalesces them when its output loop runs
    # behind) show no time between them: TPOT is not observable then, not zero.
    tpot = (last - first) * 1e3 / (n - 1) if pieces > 1 else None
    return {"ok": True, "ttft_ms": (first - sent_at) * 1e3,
            "tpot_ms": tpot, "e2e_ms": (last - sent_at) * 1e3,
            "stream_pieces": pieces, "sent_at": sent_at, "first_at": first,
            # The send on the wall clock, to line requests up with the instances' logs.
            "sent_unix": time.time() - (time.perf_counter() - sent_at)}


VOCAB = 400  # set from the model's config in main()


def make_prompt(rng: random.Random, length: int) -> list[int]:
    # Random ids above the special tokens (the first few) of the tiny model's vocabulary.
    return [rng.randrange(10, VOCAB) for _ in range(length)]


async def run_point(url: str, length: int, rate: float, n: int, seed: int) -> tuple[list, float]:
    """One stream of `n` requests at `rate`: the per-request results and the wall time."""
    import aiohttp

    rng = random.Random(seed)
    prompts = [make_prompt(rng, length) for _ in range(n)]
    gaps = [rng.expovariate(rate) for _ in range(n)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        t0 = time.perf_counter()
        at = t0
        for prompt, gap in zip(prompts, gaps, strict=True):
            at += gap
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter()
            tasks.append(asyncio.create_task(one_request(session, url, prompt, sent)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return list(results), wall


# Decode's own per-request TPOT histogram (vLLM's stats: first to last token of each request,
# measured in the engine's output path, not at the client).
SERVER_TPOT = "vllm:request_time_per_output_token_seconds"
TOKEN_GAPS = "vllm:inter_token_latency_seconds_bucket"
# Bounds (s) of decode's inter-token latency histogram (vLLM's own start at 10 ms, coarser than
# a decode step here), given to every instance with `--custom-histogram-buckets`.
GAP_BOUNDS_S = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.030, 0.050, 0.100, 0.250,
                1.0]


def decode_histograms(decode_url: str) -> dict | None:
    """Decode's histograms so far, from one read of its `/metrics`: `tpot`, its TPOT
    histogram's (sum in seconds, requests), None if absent; `gaps`, its inter-token latency
    histogram's cumulative token gaps per upper bound (`le`, s, as vLLM writes it, "+Inf"
    included). None if unreadable."""
    from test_e2e_vllm import http

    try:
        status, body = http("GET", f"{decode_url}/metrics")
    except OSError:
        return None
    if status != 200:
        return None
    sums = {SERVER_TPOT + "_sum": 0.0, SERVER_TPOT + "_count": 0.0}
    seen: set[str] = set()
    gaps: dict[str, float] = {}
    for line in body.decode(errors="replace").splitlines():
        name = line.split("{", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
            seen.add(name)
        elif name == TOKEN_GAPS and 'le="' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            gaps[le] = gaps.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    tpot = (sums[SERVER_TPOT + "_sum"], sums[SERVER_TPOT + "_count"]) if len(seen) == 2 else None
    return {"tpot": tpot, "gaps": gaps}


def grown(before: dict | None, after: dict | None, key: str):
    """What decode's histogram `key` (`decode_histograms`) grew by between two reads: a
    (sum, count) pair for `tpot`, counts per bound for `gaps`; None if either read lacks it."""
    a = None if before is None else before[key]
    b = None if after is None else after[key]
    if a is None or b is None:
        return None
    if key == "tpot":
        return b[0] - a[0], b[1] - a[1]
    return {le: n - a.get(le, 0.0) for le, n in b.items()} or None


def summarize(length: int, rate: float, results: list, wall: float, rounds: int,
              server: tuple[float, float] | None = None) -> dict:
    """A point's figures from all its rounds' requests; `server`: decode's TPOT histogram's
    growth over the point's rounds (sum in seconds, requests)."""
    ok = [r for r in results if r["ok"]]
    errors = [r for r in results if not r["ok"]]
    n = len(results)
    return {
        "input_tokens": length, "rate": rate, "requests": n, "rounds": rounds, "ok": len(ok),
        "timeouts": sum(1 for r in errors if r.get("timeout")),
        "errors": len(errors), "wall_s": wall,
        "achieved_rate": n / wall if wall > 0 else None,
        "ttft_ms": quantiles([r["ttft_ms"] for r in ok]),
        "tpot_ms": quantiles([r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]),
        "e2e_ms": quantiles([r["e2e_ms"] for r in ok]),
        "server_tpot_ms_mean": server[0] * 1e3 / server[1] if server and server[1] else None,
        "server_tpot_requests": server[1] if server else None,
        "steal": steal_summary(ok),
        "error_samples": sorted({r["error"] for r in errors})[:5],
        "samples": results,
    }


def steal_summary(ok: list[dict]) -> dict | None:
    """How much of the requests' waits the hypervisor stole (None without /proc/stat): the
    requests that lost any CPU time to it, and the TTFT p50 of those that lost none."""
    known = [r for r in ok if r.get("steal_ms") is not None]
    if not known:
        return None
    hit = [r for r in known if r["steal_ms"] > 0]
    clean = [r["ttft_ms"] for r in known if r["steal_ms"] == 0]
    return {"requests": len(known), "requests_stolen_from": len(hit),
            "stolen_ms_total": sum(r["steal_ms"] for r in hit),
            "ttft_ms_p50_stolen_from": quantiles([r["ttft_ms"] for r in hit])["p50"],
            "ttft_ms_p50_untouched": quantiles(clean)["p50"]}


async def warm_up(url: str, lengths: list[int], per_length: int) -> dict:
    import aiohttp

    rng = random.Random(7)
    out = {"sent": 0, "ok": 0, "errors": []}
    async with aiohttp.ClientSession() as session:
        for length in lengths:
            for _ in range(per_length):
                r = await one_request(session, url, make_prompt(rng, length), time.perf_counter())
                out["sent"] += 1
                if r["ok"]:
                    out["ok"] += 1
                else:
                    out["errors"].append(r["error"])
    return out


# ---------------------------------------------------------------------------------------------
# Instances and routers.


# The kvx data transport (`--kvx-transport`); the connector's default when None.
KVX_TRANSPORT: str | None = None
# vLLM's executor on every instance (`--executor`): "uni" (the default here: the worker runs in
# the engine core's process; no queue between them) or "mp" (vLLM's own default on CPU: the
# engine core and its worker are separate processes that talk through a shared-memory queue,
# which each reads spinning for a second after every message; four such processes on two
# cores kept the machine busy and made every system's TTFT p99 one of its scheduler's spells).
EXECUTOR = "uni"


def kv_config(connector: str, role: str, engine: str, kvx_listen: str | None,
              overrides: dict | None = None) -> dict:
    if connector.startswith("Kvx"):
        extra: dict = {"listen": kvx_listen} if kvx_listen else {}
        extra.update(overrides or {})
        if KVX_TRANSPORT:
            extra["transport"] = KVX_TRANSPORT
        return {"kv_connector": connector, "kv_connector_module_path": "kvx_vllm",
                "kv_role": role, "engine_id": engine, "kv_connector_extra_config": extra}
    return {"kv_connector": connector, "kv_role": role, "engine_id": engine,
            "kv_buffer_device": "cpu", "kv_connector_extra_config": {"backends": ["UCX"]}}


def start_instance(name: str, model: Path, log_dir: Path, kv: dict, cores: str,
                   extra_env: dict[str, str], executor: str):
    from test_e2e_vllm import Server, free_port, use_uni_executor, vllm_env

    port = free_port()
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
        "--max-model-len", "2048", "--max-num-seqs", "8", "--seed", "0",
        "--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching",
        "--kv-transfer-config", json.dumps(kv),
        "--custom-histogram-buckets", json.dumps({"inter_token_latency": GAP_BOUNDS_S}),
    ]
    env = vllm_env(cores)
    env.update(extra_env)
    if executor == "uni":
        use_uni_executor(args, env)
    url = f"http://127.0.0.1:{port}"
    return Server(name, args, log_dir, env, f"{url}/health"), url


def nixl_env(corrected: bool, side_port: int) -> dict[str, str]:
    env = {
        "PYTHONPATH": os.pathsep.join(
            [str(NIXL_SITE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        "KVX_BENCH_NIXL_CUDA_MAJOR": "12",
        "UCX_TLS": "tcp",
        "UCX_MODULES": "^ib,mlx5,efa",
        "UCX_RCACHE_MAX_UNRELEASED": "1024",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
    }
    if corrected:
        env["KVX_BENCH_VLLM_CORRECTED"] = "1"
    return env


def start_system(system: tuple, args, model: Path, log_dir: Path, lengths) -> dict:
    """Starts a system's prefill and decode instances and its router, and warms it up. The
    returned state has `servers`, `url` and `result` (`result["failed"]` if it did not start)."""
    # The end-to-end tests' helpers (imported here, not at the top: the router process
    # runs this module too and needs neither them nor vLLM).
    from test_e2e_vllm import Server, free_port

    name, router, connector, corrected = system
    log(f"=== {name}: {connector} behind {router} router")
    extra_p: dict[str, str] = {}
    extra_d: dict[str, str] = {}
    kvx_port = None
    p_side = d_side = None
    if connector.startswith("Kvx"):
        kvx_port = free_port()
    else:
        p_side, d_side = free_port(), free_port()
        extra_p = nixl_env(bool(corrected), p_side)
        extra_d = nixl_env(bool(corrected), d_side)
    p_engine, d_engine = f"p-{name}", f"d-{name}"
    p, p_url = start_instance(f"{name}-prefill", model, log_dir,
                              kv_config(connector, "kv_producer", p_engine,
                                        f"127.0.0.1:{kvx_port}" if kvx_port else None,
                                        variant_extra(name)),
                              P_CORES, extra_p, executor_of(name))
    d, d_url = start_instance(f"{name}-decode", model, log_dir,
                              kv_config(connector, "kv_consumer", d_engine, None,
                                        variant_extra(name)), D_CORES,
                              extra_d, executor_of(name))
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    if router == "nixl-push":
        r_args = [sys.executable, "-m", "kvx_bench.vllm_sweep", "router",
                  "--listen-port", str(router_port), "--prefill", p_url, "--decode", d_url,
                  "--p-engine", p_engine, "--p-side-port", str(p_side)]
        r_env = dict(os.environ)
        r_env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent)] + [
            q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q])
    else:
        mode = router.split("-")[1]
        kvx_addr = f"127.0.0.1:{kvx_port}" if kvx_port else "127.0.0.1:9"
        r_args = [str(args.kvx_bin), "proxy", "--mode", mode, "--listen",
                  f"127.0.0.1:{router_port}", "--prefill", f"{p_url}@{kvx_addr}",
                  "--decode", d_url]
        r_env = dict(os.environ)
    proxy = Server(f"{name}-router", r_args, log_dir, r_env, f"{router_url}/health")
    state = {"servers": [p, d, proxy], "url": router_url, "decode_url": d_url,
             "result": {"system": name, "connector": connector, "router": router,
                        "corrected": corrected, "points": []}}
    result = state["result"]
    t_start = time.monotonic()
    try:
        for srv in state["servers"]:
            srv.wait_ready(START_TIMEOUT)
        result["startup_s"] = time.monotonic() - t_start
        log(f"{name}: ready after {result['startup_s']:.0f} s; warming up")
        result["warmup"] = asyncio.run(warm_up(router_url, lengths, args.warmup))
        log(f"{name}: warm-up {result['warmup']['ok']}/{result['warmup']['sent']} ok")
    except Exception as e:  # a system that cannot start is a result too
        result["failed"] = f"{type(e).__name__}: {e}"[:2000]
        log(f"{name}: FAILED: {result['failed'][:500]}")
        stop_system(state)
    return state


def hold_idle(states: list[dict], running: dict | None) -> None:
    """Stops (SIGSTOP) every process of every system of `states` but `running`, then continues
    (SIGCONT) `running`'s; continues every system where `running` is None. Each server is the
    leader of its own process group (`Server` starts it in a new session), which vLLM's engine
    and worker processes share, so one signal per server reaches all of its processes. A
    stopped system holds no core: no idle progress thread, no spin of vLLM's message queues,
    no timer; the kernel still answers its TCP peers, so no connection of it breaks."""
    order = sorted(states, key=lambda st: st is running)  # stop the others first
    for st in order:
        sig = signal.SIGCONT if running is None or st is running else signal.SIGSTOP
        for srv in st.get("servers", []):
            if srv.proc.poll() is None:
                try:
                    os.killpg(srv.proc.pid, sig)
                except ProcessLookupError:  # ended since the poll
                    pass


def stop_system(state: dict) -> None:
    servers = state.pop("servers", [])
    for srv in reversed(servers):
        srv.kill()
    for srv in servers[:2]:
        text = srv.log.read_text(errors="replace")
        state["result"].setdefault("log_tracebacks", {})[srv.name] = text.count("Traceback")


def run_group(states: list[dict], args, lengths, rates) -> None:
    """Every point of every running system of `states`, in `args.rounds` rounds: each round
    sends `args.requests` requests (the same prompts and arrival times for every system) to
    each system in turn, starting with another system each round, so that the systems meet
    the machine's slow spells alike; with `--idle-systems stopped`, the others are stopped
    during a turn (`hold_idle`). A point pools its rounds."""
    for length in lengths:
        for rate in rates:
            pooled: dict[int, tuple[list, float]] = {}
            # Decode's TPOT histogram's growth in each round's turn (sum in seconds, requests;
            # None where a read failed), per system.
            server: dict[int, list[tuple[float, float] | None]] = {}
            # Each turn's CPU time by part (`cpu_turn`), per system.
            cpu_turns: dict[int, list[dict]] = {}
            # Decode's token gaps of each turn (`grown` "gaps"), per system.
            gaps: dict[int, list[dict | None]] = {}
            for r in range(args.rounds):
                order = [states[(i + r) % len(states)] for i in range(len(states))]
                for st in order:
                    res = st["result"]
                    if res.get("failed") or res.get("saturated_at") == length:
                        continue
                    seed = hash((length, rate, r)) & 0xFFFF
                    if args.idle_systems == "stopped":
                        hold_idle(states, st)
                    time.sleep(TURN_GAP_S)
                    if args.turn_warmup:
                        warm = asyncio.run(warm_up(st["url"], [length], args.turn_warmup))
                        turn = res.setdefault("turn_warmup", {"sent": 0, "ok": 0, "errors": []})
                        turn["sent"] += warm["sent"]
                        turn["ok"] += warm["ok"]
                        turn["errors"] = (turn["errors"] + warm["errors"])[:5]
                    before = decode_histograms(st["decode_url"])
                    cpu_before = cpu_parts(states, st)
                    t_turn = time.perf_counter()
                    got, wall = asyncio.run(run_point(st["url"], length, rate, args.requests,
                                                      seed))
                    cpu = cpu_turn(cpu_before, cpu_parts(states, st),
                                   CLOCK.between(t_turn, time.perf_counter()) if CLOCK else None)
                    note_machine(got, t_turn, st["result"]["system"], r)
                    for sample in got:
                        sample["round"] = r
                    # The engine's stats follow its outputs by a moment.
                    time.sleep(0.5)
                    after = decode_histograms(st["decode_url"])
                    gaps.setdefault(id(st), []).append(grown(before, after, "gaps"))
                    acc, walls = pooled.get(id(st), ([], 0.0))
                    pooled[id(st)] = (acc + got, walls + wall)
                    cpu_turns.setdefault(id(st), []).append(cpu)
                    server.setdefault(id(st), []).append(grown(before, after, "tpot"))
            for st in states:
                res = st["result"]
                if res.get("failed"):
                    continue
                if id(st) not in pooled:
                    res["points"].append({"input_tokens": length, "rate": rate,
                                          "skipped": "the previous rate already failed half "
                                                     "of its requests"})
                    continue
                got, wall = pooled[id(st)]
                by_round = server.get(id(st), [])
                pooled_growth = None if None in by_round else (sum(g[0] for g in by_round),
                                                               sum(g[1] for g in by_round))
                pt = summarize(length, rate, got, wall, args.rounds, pooled_growth)
                pt["cpu_ms_per_request"] = cpu_per_request(cpu_turns.get(id(st), []),
                                                           pt["requests"])
                pt["decode_token_gaps_by_round"] = gaps.get(id(st), [])
                pt["server_tpot_ms_by_round"] = [None if g is None or g[1] <= 0
                                                 else g[0] * 1e3 / g[1] for g in by_round]
                res["points"].append(pt)
                t, tp = pt["ttft_ms"], pt["tpot_ms"]
                fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
                log(f"{res['system']} {length} tok {rate}/s: ok {pt['ok']}/{pt['requests']} "
                    f"(timeouts {pt['timeouts']}), TTFT p50 {fmt(t['p50'])} p99 {fmt(t['p99'])} "
                    f"ms, TPOT p50 {fmt(tp['p50'])} ms"
                    + (f"; errors: {pt['error_samples']}" if pt["errors"] else ""))
                if pt["errors"] * 2 >= pt["requests"]:
                    res["saturated_at"] = length


def cpu_per_request(turns: list[dict], requests: int) -> dict | None:
    """A point's CPU time per request in ms, by part, over all its turns (`cpu_turn`)."""
    if not turns or not requests:
        return None
    keys = sorted({k for t in turns for k in t})
    return {k: sum(t.get(k, 0.0) for t in turns) / requests for k in keys}


def pool_points(points: list[dict]) -> dict:
    """One point of several sweeps: their rounds one after the other (each sweep's round
    numbers shifted past the previous sweep's), its figures recomputed from all requests,
    decode's TPOT weighted by the requests it counted, CPU time per request by requests. A
    point one of the sweeps skipped stays skipped."""
    if any("skipped" in p for p in points):
        return next(p for p in points if "skipped" in p)
    samples, tpot_by_round, gaps_by_round = [], [], []
    growth: tuple[float, float] | None = (0.0, 0.0)
    offset = 0
    for p in points:
        rounds = point_rounds(p) or p.get("rounds", 0)
        samples += [dict(r, round=r.get("round", 0) + offset) for r in p["samples"]]
        for key, acc in (("server_tpot_ms_by_round", tpot_by_round),
                         ("decode_token_gaps_by_round", gaps_by_round)):
            kept = list(p.get(key) or [])[:rounds]
            acc += kept + [None] * (rounds - len(kept))
        n = p.get("server_tpot_requests")
        if growth is None or p.get("server_tpot_ms_mean") is None or not n:
            growth = None
        else:
            growth = (growth[0] + p["server_tpot_ms_mean"] * n / 1e3, growth[1] + n)
        offset += rounds
    first = points[0]
    pooled = summarize(first["input_tokens"], first["rate"], samples,
                       sum(p["wall_s"] for p in points), offset, growth)
    pooled["server_tpot_ms_by_round"] = tpot_by_round
    pooled["decode_token_gaps_by_round"] = gaps_by_round
    cpus = [p.get("cpu_ms_per_request") for p in points]
    if all(cpus):
        # Each sweep's CPU time per request back to its total, then per request of all.
        pooled["cpu_ms_per_request"] = cpu_per_request(
            [{k: ms * p["requests"] for k, ms in c.items()} for c, p in zip(cpus, points)],
            pooled["requests"])
    return pooled


def pool_reports(reports: list[dict]) -> dict:
    """Several sweeps of the same systems, input lengths, rates and vLLM executor (vllm.json)
    as one report of all their rounds, with #7's checks judged anew over them: a verdict no
    single 5-round sweep on this machine can decide may be decided by several."""
    first = reports[0]

    def swept(r: dict) -> tuple:
        # A sweep from before `--executor` ran vLLM's default, mp.
        return ([s["system"] for s in r["systems"]], r["lengths"], r["rates"],
                r.get("executor", "mp"))

    for r in reports[1:]:
        if swept(r) != swept(first):
            raise ValueError(f"the sweep of {r['date']} has other systems, lengths, rates or "
                             f"executor than that of {first['date']}")
    out = dict(first)
    out["date"] = ", ".join(r["date"] for r in reports)
    out["pooled_from"] = len(reports)
    for key in ("rounds", "requests_per_point", "sweep_s"):
        out[key] = sum(r.get(key) or 0 for r in reports)
    out["systems"] = []
    for k in range(len(first["systems"])):
        runs = [r["systems"][k] for r in reports]
        failed = next((s for s in runs if s.get("failed")), None)
        if failed is not None:
            out["systems"].append(failed)
            continue
        system = dict(runs[0])
        system["points"] = [pool_points(list(ps)) for ps in zip(*(s["points"] for s in runs))]
        out["systems"].append(system)
    out["targets"] = check_targets(out)
    return out


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


def run_systems(systems: list[tuple], args, model: Path, log_dir: Path, lengths,
                rates) -> list[dict]:
    """Runs the systems that leave an idle machine alone side by side (started together, at
    most `MAX_SIDE_BY_SIDE` at a time, points interleaved: `run_group`), then each vLLM connector "as shipped" on its own: its
    progress thread spins even when idle and would slow every other system down."""
    # kvx push and the corrected vLLM connectors it is judged against first, in one group.
    first = ("kvx-push", "nixl-push-corrected", "nixl-pull-corrected")
    together = sorted((s for s in systems if s[3] is not False),
                      key=lambda s: first.index(s[0]) if s[0] in first else len(first))
    groups = [together[i:i + MAX_SIDE_BY_SIDE]
              for i in range(0, len(together), MAX_SIDE_BY_SIDE)]
    groups += [[s] for s in systems if s[3] is False]
    results = {}
    for group in groups:
        states = [start_system(s, args, model, log_dir, lengths) for s in group]
        try:
            run_group(states, args, lengths, rates)
        finally:
            for st in states:
                stop_system(st)
                st["result"].pop("saturated_at", None)
                results[st["result"]["system"]] = st["result"]
    return [results[s[0]] for s in systems]


# ---------------------------------------------------------------------------------------------
# Report.


def fmt_ms(v) -> str:
    return "–" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


def get(points: dict, system: str, length: int, rate: float):
    return points.get((system, length, rate))


# A TPOT below this is no decode step of this machine: the tokens were released together
# (a process on their way ran behind and passed several on at once: for NixlPush, its decode's
# API server). Such a request says how its tokens were delivered, not how fast decode made them.
BURST_TPOT_MS = 0.5


# The client's TPOT of the requests whose tokens came paced (`PACED_TPOT`), a metric of its
# own beside `tpot_ms`, which counts every request.
PACED_TPOT = "tpot_ms_paced"


def point_value(p: dict | None, metric: str, q: str, round_: int | None = None) -> float | None:
    """A point's `metric` (`ttft_ms`, `tpot_ms`, `PACED_TPOT`: client side, or
    `server_tpot_ms_mean`) at quantile `q`, over all its rounds or over round `round_` alone
    (None where it has no figure: no point, no request that succeeded, or no record of its
    rounds)."""
    if p is None or p.get("ok", 0) == 0:
        return None
    if metric == "server_tpot_ms_mean":
        if round_ is None:
            return p.get(metric)
        by_round = p.get("server_tpot_ms_by_round") or []
        return by_round[round_] if round_ < len(by_round) else None
    if round_ is None and metric != PACED_TPOT:
        return p[metric][q]
    return quantiles(round_samples(p, metric, round_))[q]


def round_samples(p: dict, metric: str, round_: int | None) -> list[float]:
    """A point's client-side `metric` of every request of round `round_` (None: of every
    round) that succeeded. `PACED_TPOT`: the TPOT of those whose tokens did not reach the
    client together (`BURST_TPOT_MS`)."""
    key = "tpot_ms" if metric == PACED_TPOT else metric
    return [r[key] for r in p.get("samples", [])
            if r.get("ok") and (round_ is None or r.get("round") == round_)
            and r.get(key) is not None
            and (metric != PACED_TPOT or r[key] >= BURST_TPOT_MS)]


def bunched(p: dict | None) -> str:
    """How many of a point's requests got their tokens together (client TPOT under
    `BURST_TPOT_MS`), of those with a TPOT."""
    if p is None or "skipped" in p:
        return "–"
    timed = len(round_samples(p, "tpot_ms", None))
    return f"{timed - len(round_samples(p, PACED_TPOT, None))}/{timed}"


def point_rounds(p: dict | None) -> int:
    """How many rounds a point's samples record (0 for a report from before rounds were)."""
    if p is None:
        return 0
    return 1 + max((r["round"] for r in p.get("samples", []) if "round" in r), default=-1)


# Resamples per check for its ratio's interval (`ratio_interval`), and the interval's coverage.
BOOTSTRAP_RESAMPLES = 400
INTERVAL = 0.90


def ratio_interval(kp: dict, other: dict, metric: str, q: str, seed: int
                   ) -> tuple[float, float] | None:
    """A 90 % interval of a check's ratio (kvx push / vLLM) by a two-level bootstrap over the
    rounds the two points share: rounds drawn with replacement, the same for both systems (their
    turns of a round met the same spell of the machine), then within each drawn round its
    requests drawn with replacement (decode's own TPOT is kept per round only: the rounds
    alone). None where fewer than 2 rounds are shared or a resample has no figure."""
    rounds = min(point_rounds(kp), point_rounds(other))
    if rounds < 2:
        return None

    def by_round(p):
        if metric == "server_tpot_ms_mean":
            return [point_value(p, metric, q, r) for r in range(rounds)]
        return [round_samples(p, metric, r) for r in range(rounds)]

    a_rounds, b_rounds = by_round(kp), by_round(other)
    rng = random.Random(seed)
    ratios = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        picked = [rng.randrange(rounds) for _ in range(rounds)]
        if metric == "server_tpot_ms_mean":
            a_vals = [a_rounds[r] for r in picked]
            b_vals = [b_rounds[r] for r in picked]
            if None in a_vals or None in b_vals:
                return None
            a, b = statistics.fmean(a_vals), statistics.fmean(b_vals)
        else:
            def draw(per_round):
                return [rng.choice(per_round[r]) for r in picked for _ in per_round[r]]
            a, b = quantiles(draw(a_rounds))[q], quantiles(draw(b_rounds))[q]
        if a is None or not b:
            return None
        ratios.append(a / b)
    ratios.sort()
    tail = (1 - INTERVAL) / 2
    return (ratios[int(tail * (len(ratios) - 1))],
            ratios[int(round((1 - tail) * (len(ratios) - 1)))])


def check_targets(report: dict) -> list[dict]:
    """#7's targets, each judged over the pooled rounds of a point (`met`) and, to show how
    much of a verdict the machine's slow spells decide, in each round alone (`round_ratios`,
    `rounds_met` of `rounds`: the systems took their turns of a round minutes apart, so a round
    that one system wins and the next it loses is noise, not a difference), and with a 90 %
    interval of its ratio (`interval`, `ratio_interval`) and what that interval says
    (`confidence`: "met" or "missed" where the whole interval lies on one side of the check's
    bound, "undecided" where it straddles it)."""
    pts = {(s["system"], p["input_tokens"], p["rate"]): p
           for s in report["systems"] for p in s["points"] if "skipped" not in p}
    lengths, rates = report["lengths"], report["rates"]
    checks = []

    def check(what, length, rate, kp, other, metric, q, bound, strict=False):
        def ok(a, b):
            return a < bound * b if strict else a <= bound * b

        def judge(a, b):
            # None ("n/a"): the vLLM side has no figure (nothing measurable).
            if a is not None and b is None:
                return None
            return a is not None and ok(a, b)

        def ratio(a, b):
            return None if a is None or not b else a / b

        a, b = point_value(kp, metric, q), point_value(other, metric, q)
        per_round = [(point_value(kp, metric, q, r), point_value(other, metric, q, r))
                     for r in range(min(point_rounds(kp), point_rounds(other)))]
        judged = [judge(ar, br) for ar, br in per_round]
        interval = None
        if a is not None and b is not None:
            interval = ratio_interval(kp, other, metric, q,
                                      seed=zlib.crc32(f"{what} {length} {rate}".encode()))
        confidence = None
        if interval is not None:
            low, high = interval
            confidence = ("met" if (high < bound if strict else high <= bound)
                          else "missed" if (low >= bound if strict else low > bound)
                          else "undecided")
        checks.append({"what": what, "input_tokens": length, "rate": rate, "kvx": a, "vllm": b,
                       "ratio": ratio(a, b), "met": judge(a, b), "bound": bound,
                       "interval": interval, "confidence": confidence,
                       "round_ratios": [ratio(ar, br) for ar, br in per_round],
                       "rounds": sum(1 for j in judged if j is not None),
                       "rounds_met": sum(1 for j in judged if j)})

    for length in lengths:
        for rate in rates:
            kp = get(pts, "kvx-push", length, rate)
            npush = get(pts, "nixl-push-corrected", length, rate)
            npull = get(pts, "nixl-pull-corrected", length, rate)
            for q in ("p50", "p99"):
                check(f"TTFT {q} kvx push <= 0.8 x corrected NixlPushConnector", length, rate,
                      kp, npush, "ttft_ms", q, 0.8)
            if rate == max(rates):
                for q in ("p50", "p99"):
                    check(f"TTFT {q} kvx push < corrected NixlConnector (highest load)", length,
                          rate, kp, npull, "ttft_ms", q, 1.0, strict=True)
            for other, label in ((npush, "NixlPushConnector"), (npull, "NixlConnector")):
                # The client's TPOT of the streams whose tokens came paced, on both sides: a
                # request whose tokens came together has no TPOT to compare.
                check(f"TPOT p50 (paced streams) kvx push no worse than corrected {label} "
                      "(<= 1.05 x)", length, rate, kp, other, PACED_TPOT, "p50", 1.05)
                # The same judged by decode's own measure, which client-side bursts do not bend.
                check(f"TPOT mean (decode's measure) kvx push no worse than corrected {label} "
                      "(<= 1.05 x)", length, rate, kp, other, "server_tpot_ms_mean", "mean",
                      1.05)
    return checks


def by_depth(cpu: dict, role: str, suffix: str = "") -> str:
    """One instance's API server, engine and worker figures of `cpu_ms_per_request`, as
    `api+engine+worker` (ms)."""
    return "+".join(f"{cpu.get(f'{role} {d}{suffix}', 0.0):.0f}" for d in VLLM_DEPTHS)


def markdown_targets(checks: list[dict]) -> list[str]:
    """The report's targets section: each check pooled and round by round."""
    lines = ["## Targets (kvx push against corrected vLLM)", "",
              "`rounds`: the same check in each round alone (its requests only: the systems' "
              "turns of a round are minutes apart), the rounds it held in, then each round's "
              "ratio. `90 % interval`: of the ratio, by a bootstrap over the rounds (drawn alike "
              "for both systems) and the requests within them; `met` or `missed` with that "
              "confidence where the whole interval lies on one side of the check's bound, "
              "`undecided` where it straddles it.", "",
              "| check | input | req/s | kvx | vLLM | ratio | met | 90 % interval | rounds |",
              "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for c in checks:
        ratio = "–" if c["ratio"] is None else f"{c['ratio']:.2f}"
        rounds = "–"
        if c.get("rounds"):
            each = " ".join("–" if x is None else f"{x:.2f}" for x in c["round_ratios"])
            rounds = f"{c['rounds_met']} of {c['rounds']}: {each}"
        interval = "–"
        if c.get("interval"):
            interval = f"{c['interval'][0]:.2f}–{c['interval'][1]:.2f}: {c['confidence']}"
        lines.append(f"| {c['what']} | {c['input_tokens']} | {c['rate']:g} | {fmt_ms(c['kvx'])} | "
                     f"{fmt_ms(c['vllm'])} | {ratio} | "
                     f"{'n/a' if c['met'] is None else 'yes' if c['met'] else 'NO'} | "
                     f"{interval} | {rounds} |")
    met = sum(1 for c in checks if c["met"])
    checked = sum(1 for c in checks if c["met"] is not None)
    lines += ["", f"{met} of {checked} checks met ({len(checks) - checked} n/a).", ""]
    judged = [c for c in checks if c.get("rounds")]
    if judged:
        held = sum(c["rounds_met"] for c in judged)
        total = sum(c["rounds"] for c in judged)
        lines += [f"Round by round: {held} of {total} round checks held; checks that held in "
                  f"every round: {sum(1 for c in judged if c['rounds_met'] == c['rounds'])}, "
                  f"in none: {sum(1 for c in judged if c['rounds_met'] == 0)}.", ""]
    told = [c["confidence"] for c in checks if c.get("confidence")]
    if told:
        lines += [f"With 90 % confidence: met {told.count('met')}, missed "
                  f"{told.count('missed')}, undecided {told.count('undecided')} (of "
                  f"{len(told)} checks with an interval).", ""]
    return lines


def pooled_gaps(p: dict | None) -> dict[str, float] | None:
    """A point's decode token gaps over all its rounds (cumulative per bound); None where a
    round's scrape failed or the report predates them."""
    rounds = None if p is None else p.get("decode_token_gaps_by_round")
    if not rounds or None in rounds:
        return None
    out: dict[str, float] = {}
    for r in rounds:
        for le, n in r.items():
            out[le] = out.get(le, 0.0) + n
    return out


def gap_shares(p: dict | None) -> str:
    g = pooled_gaps(p)
    if not g or not g.get("+Inf"):
        return "–"
    total = g["+Inf"]
    over = lambda bound: 1 - g.get(bound, total) / total  # noqa: E731
    return (f"{over('0.01'):.1%} / {over('0.02'):.1%} / {over('0.05'):.1%} "
            f"of {total:.0f}")


def uni_note(report: dict) -> str:
    """What vllm.md's header says of instances under vLLM's uni executor, if any."""
    if report.get("executor") == "uni":
        who = "every instance (`--executor uni`)"
    else:
        uni = [s["system"] for s in report["systems"] if s["system"].endswith(UNI_VARIANT)]
        if not uni:
            return ""
        who = f"the instances of {', '.join(uni)}"
    return (f" vLLM's `uni` executor on {who}: the worker runs in the engine core's process, "
            "counted as the worker in the CPU tables (engine 0), its threads but the main one "
            "then vLLM's engine-core threads as well as the connector's.")


def markdown(report: dict) -> str:
    systems = [s["system"] for s in report["systems"]]
    pts = {(s["system"], p["input_tokens"], p["rate"]): p
           for s in report["systems"] for p in s["points"]}
    lines = [
        f"# kvx against vLLM's NIXL connectors ({report['date']}, {report['machine']})",
        "",
        f"Tiny float32 Llama (2 layers, 2 KV heads, head dim 32), vLLM {report['vllm']} on CPU, "
        f"prefill on core 0, decode on core 1; {report['requests_per_point']} requests per "
        f"point ({report['rounds']} rounds of {report['requests_per_round']}, the systems "
        "started side by side and taking turns, another first each round; "
        + {"stopped": "the others stopped (SIGSTOP) during a system's turn",
           "running": "the others running idle during a system's turn"}.get(
               report.get("idle_systems", "running"), "")
        + "), Poisson "
        f"arrivals, {OUTPUT_TOKENS} output tokens, streamed; warm-up "
        f"{report['warmup_per_length']} requests per input length first, and "
        f"{report.get('turn_warmup', 0)} untimed ones at the start of each turn; requests "
        f"capped at {REQUEST_CAP_S:.0f} s. TTFT and TPOT in ms (client side); `err` = failed "
        "or timed-out requests of the point."
        + (f" {report['pooled_from']} sweeps pooled (`vllm_sweep pool`): their rounds one "
           "after the other." if report.get("pooled_from") else "")
        + uni_note(report),
        "",
    ]
    def table(title, cell):
        """A table of one cell per system, a row per (input length, rate)."""
        out = [f"## {title}", "",
               "| input | req/s | " + " | ".join(systems) + " |",
               "|---:|---:|" + "---:|" * len(systems)]
        for length in report["lengths"]:
            for rate in report["rates"]:
                cells = [cell(pts.get((s, length, rate))) for s in systems]
                out.append(f"| {length} | {rate:g} | " + " | ".join(cells) + " |")
        return out + [""]

    def quantiles(metric):
        def cell(p):
            if p is None:
                return "–"
            if "skipped" in p:
                return "skipped"
            c = f"{fmt_ms(p[metric]['p50'])} / {fmt_ms(p[metric]['p99'])}"
            return c + (f" ({p['errors']} err)" if p["errors"] else "")
        return cell

    for metric, title in (("ttft_ms", "TTFT p50 / p99 (ms)"), ("tpot_ms", "TPOT p50 / p99 (ms)"),
                          ("e2e_ms", "End-to-end latency p50 / p99 (ms)")):
        lines += table(title, quantiles(metric))
    lines += table("TTFT mean (ms)", lambda p: "–" if p is None or "skipped" in p
                   else fmt_ms(p["ttft_ms"]["mean"]))
    # The quicker quarter of a point's requests: where this shared machine's slow spells,
    # which last seconds and decide most medians and every p99 here, weigh least.
    lines += table("TTFT p25 (ms; no target: the quicker quarter of each point, the least "
                   "touched by the machine's slow spells)",
                   lambda p: "–" if p is None or "skipped" in p
                   else fmt_ms(p["ttft_ms"].get("p25")))
    lines += table("TPOT mean, decode's own measure (ms; vLLM's "
                   "`request_time_per_output_token_seconds`, first to last token of each request)",
                   lambda p: "–" if p is None or "skipped" in p
                   else fmt_ms(p.get("server_tpot_ms_mean")))
    lines += table("Decode's gaps between a request's tokens (vLLM's inter-token latency "
                   "histogram, every round): the share over 10 ms / over 20 ms / over 50 ms, and "
                   "the gaps counted", gap_shares)
    def cpu(p):
        c = None if p is None or "skipped" in p else p.get("cpu_ms_per_request")
        if not c:
            return "–"
        side = lambda role: (by_depth(c, role)  # noqa: E731
                             + f" ({c.get(f'{role} worker threads', 0.0):.0f})")
        return (f"P {side('prefill')} · D {side('decode')} · R {c.get('router', 0.0):.0f} · "
                f"idle {c.get('other systems', 0.0):.0f} · rest "
                f"{c.get('client', 0.0) + c.get('rest of machine', 0.0):.0f}")
    lines += table("CPU time per request during the system's turns (ms; /proc): prefill's API "
                   "server + engine + worker (P), in parentheses the worker's threads but its main one "
                   "(the connector's: kvx's, NIXL's and UCX's), the same for decode (D), the "
                   "router (R), the idle systems beside it, and the rest of the machine with "
                   "this client", cpu)
    def runq(p):
        c = None if p is None or "skipped" in p else p.get("cpu_ms_per_request")
        if not c or "decode api runq" not in c:
            return "–"
        return f"P {by_depth(c, 'prefill', ' runq')} · D {by_depth(c, 'decode', ' runq')}"
    lines += table("Time the main threads waited for a core, runnable, per request (ms; "
                   "/proc/<pid>/schedstat): prefill's API server + engine + worker (P), the same "
                   "for decode (D)", runq)
    def coalesced(p):
        if p is None or "skipped" in p:
            return "–"
        ok = [r for r in p["samples"] if r.get("ok")]
        few = [r for r in ok if r.get("stream_pieces", OUTPUT_TOKENS) <= COALESCED_PIECES]
        return f"{len(few)}/{len(ok)}"
    lines += table(f"Streams that came in {COALESCED_PIECES} events or fewer (of {OUTPUT_TOKENS} "
                   "tokens): decode's API server ran behind its engine and merged the tokens "
                   "(requests / all that succeeded)", coalesced)
    lines += table(f"Streams whose tokens reached the client together (client TPOT under "
                   f"{BURST_TPOT_MS} ms, however many events: a process on their way ran "
                   "behind; left out of the client-side TPOT checks, on both sides) / all "
                   "with a TPOT", bunched)
    def stolen(p):
        if p is None or "skipped" in p or not p.get("steal"):
            return "–"
        st = p["steal"]
        return (f"{st['requests_stolen_from']}/{st['requests']}, {st['stolen_ms_total']:.0f} ms; "
                f"{fmt_ms(st['ttft_ms_p50_stolen_from'])} vs "
                f"{fmt_ms(st['ttft_ms_p50_untouched'])}")
    lines += table("CPU time stolen by the hypervisor while requests waited for their first "
                   "token (/proc/stat `steal`): requests it touched / all, the time stolen, "
                   "then the TTFT p50 of the requests it touched vs of the others (ms)", stolen)
    failed = [s for s in report["systems"] if s.get("failed")]
    if failed:
        lines += ["## Systems that did not run", ""]
        lines += [f"- {s['system']}: {s['failed'][:400]}" for s in failed]
        lines.append("")
    lines += markdown_targets(report["targets"])
    return "\n".join(lines)


def main() -> None:
    global KVX_TRANSPORT, EXECUTOR
    if len(sys.argv) > 1 and sys.argv[1] == "pool":
        ap = argparse.ArgumentParser(description="several sweeps' vllm.json as one report")
        ap.add_argument("pool")
        ap.add_argument("reports", nargs="+", type=Path)
        ap.add_argument("--out", type=Path, required=True)
        a = ap.parse_args()
        report = pool_reports([json.loads(f.read_text()) for f in a.reports])
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "vllm.json").write_text(json.dumps(report, indent=1))
        (a.out / "vllm.md").write_text(markdown(report))
        log(f"{len(a.reports)} sweeps pooled: {a.out / 'vllm.json'}, {a.out / 'vllm.md'}")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "router":
        ap = argparse.ArgumentParser()
        ap.add_argument("router")
        ap.add_argument("--listen-port", type=int, required=True)
        ap.add_argument("--prefill", required=True)
        ap.add_argument("--decode", required=True)
        ap.add_argument("--p-engine", required=True)
        ap.add_argument("--p-side-port", type=int, required=True)
        a = ap.parse_args()
        asyncio.run(nixl_push_router(a.listen_port, a.prefill, a.decode, a.p_engine,
                                     a.p_side_port))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvx-bin", type=Path, default=REPO / "target" / "release" / "kvx")
    ap.add_argument("--out", type=Path, default=REPO / "target" / "kvx-bench")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--systems", help="comma-separated subset of: "
                    + ", ".join(s[0] for s in SYSTEMS))
    ap.add_argument("--lengths")
    ap.add_argument("--rates")
    ap.add_argument("--requests", type=int, help="requests per point and round")
    ap.add_argument("--rounds", type=int, help="rounds per point (systems interleaved)")
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--turn-warmup", type=int, default=TURN_WARMUP,
                    help="untimed requests (one at a time, the point's input length) that "
                         "start each system's turn in each round")
    ap.add_argument("--idle-systems", choices=["stopped", "running"], default="stopped",
                    help="what the systems side by side do during another's turn: stopped "
                         "(SIGSTOP, continued for their own turn; each system is measured "
                         "alone on the machine) or running (idle, their threads and timers "
                         "competing for the cores)")
    ap.add_argument("--kvx-transport", help="kvx's data transport (default: the connector's, "
                    "libfabric:shm); e.g. cma")
    ap.add_argument("--executor", choices=["mp", "uni"], default=EXECUTOR,
                    help="vLLM's executor on every instance: uni (the default: the worker in "
                         "the engine core's process, its OpenMP threads bound) or mp (vLLM's "
                         "default on CPU, whose processes spin on their message queue)")
    args = ap.parse_args()
    KVX_TRANSPORT = args.kvx_transport
    EXECUTOR = args.executor
    if args.quick:
        lengths, rates, requests, warmup = [256, 1024], [1.0, 4.0], 12, 4
    else:
        lengths, rates, requests, warmup = [256, 1024], [1.0, 2.0, 4.0], 24, 4
    args.rounds = args.rounds or 3
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
    if args.rates:
        rates = [float(x) for x in args.rates.split(",")]
    args.requests = args.requests or requests
    args.warmup = args.warmup if args.warmup is not None else warmup
    # Every system but the A/B variants, unless named.
    systems = [s for s in SYSTEMS if not is_variant(s[0])]
    if args.systems:
        want = args.systems.split(",")
        systems = [s for s in SYSTEMS if s[0] in want]
    if not args.kvx_bin.exists():
        sys.exit(f"no kvx binary at {args.kvx_bin}: cargo build --release -p kvx-cli")

    from tiny_model import build

    import vllm

    args.kvx_bin = args.kvx_bin.resolve()
    out = args.out.resolve()
    log_dir = out / "vllm-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    # Every process starts in the log folder: a crash report written to the working directory
    # (libinfinipath's `.<pid>,vm.btr` when a process is killed) lands there, not in the checkout.
    os.chdir(log_dir)
    model = build(REPO / ".kvx-cache" / "bench-model", kv_heads=2)
    global VOCAB
    VOCAB = json.loads((model / "config.json").read_text())["vocab_size"]
    t0 = time.monotonic()
    global CLOCK
    if MachineClock.read() is not None:
        CLOCK = MachineClock()
    try:
        results = run_systems(systems, args, model, log_dir, lengths, rates)
    finally:
        if CLOCK is not None:
            CLOCK.stop()
    report = {
        "what": "kvx push/pull vs vLLM NixlConnector / NixlPushConnector, as shipped and "
                "corrected, through a router, on real vLLM (CPU)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores",
        "vllm": vllm.__version__,
        "quick": args.quick,
        "model": "tiny random Llama, float32: 2 layers, hidden 64, 2 KV heads, head dim 32, "
                 "block size 32",
        "lengths": lengths, "rates": rates, "requests_per_round": args.requests,
        "rounds": args.rounds, "requests_per_point": args.requests * args.rounds,
        "warmup_per_length": args.warmup, "turn_warmup": args.turn_warmup,
        "idle_systems": args.idle_systems,
        "executor": args.executor,
        "output_tokens": OUTPUT_TOKENS,
        "request_cap_s": REQUEST_CAP_S,
        "corrections": "nixl_site/sitecustomize.py: KVX_BENCH_VLLM_CORRECTED=1 skips "
                       "os.sched_setaffinity in vLLM's NIXL worker and sets NIXL's progress "
                       "thread delay (pthrDelay) to 1000 us instead of 0",
        "routers": {"kvx-push": "kvx proxy --mode push", "kvx-pull": "kvx proxy --mode pull",
                    "nixl-push": "kvx_bench.vllm_sweep router (aiohttp, both legs at once, "
                                 "same X-Request-Id)"},
        "sweep_s": time.monotonic() - t0,
        "systems": results,
    }
    report["targets"] = check_targets(report)
    (out / "vllm.json").write_text(json.dumps(report, indent=1))
    (out / "vllm.md").write_text(markdown(report))
    log(f"sweep took {report['sweep_s'] / 60:.1f} min; results: {out / 'vllm.json'}, "
        f"{out / 'vllm.md'}")
    print(markdown(report))


if __name__ == "__main__":
    main()
