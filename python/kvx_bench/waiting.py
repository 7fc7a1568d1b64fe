"""What a push decode costs the machine while its requests wait for their KV.

    .kvx-cache/venv/bin/python -m kvx_bench.waiting [--rounds 2] [--requests 4]
        (from python/, or with python/ on PYTHONPATH)

Starts one kvx push prefill (core 0) and three kvx push decodes (core 1): one with the
connector's `idle_wait_ms` at its default, one with 0 (vLLM's own pace: a step without a
forward pass returns at once, and vLLM runs the next about a millisecond later), both under
vLLM's default executor on CPU (`mp`: engine core and worker in two processes, which spin on
the message queue between them), and one at the default under the `uni` executor (the worker in
the engine core's process: nothing spins). In turns, each
decode is sent `--requests` push requests whose prefill never computes them (they fail at a short
registration lease afterwards), and while they wait this measures for 5 s the CPU time of the
decode's processes (/proc), then the time a CPU-bound probe pinned to decode's core takes to
count to 6 million (the same probe on the idle machine first). Prints a table; writes
`waiting.json` under --out (default target/kvx-bench).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "python" / "tests"))

LEASE_S = 12.0
MEASURE_S = 5.0
PROBE = """import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
t = time.perf_counter(); s = 0
for i in range(6_000_000):
    s += i
print(time.perf_counter() - t)"""


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            out[p] = (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            out[p] = 0.0
    return out


def name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def probe(core: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, core], capture_output=True, text=True,
                         check=True)
    return float(out.stdout)


def main() -> None:
    from test_e2e_vllm import descendants, free_port, http, kv_config, start_vllm
    from tiny_model import build

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--out", type=Path, default=REPO / "target" / "kvx-bench")
    args = ap.parse_args()
    out = args.out.resolve()
    log_dir = out / "waiting-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    model = build(REPO / ".kvx-cache" / "bench-model", kv_heads=2)
    kvx_port = free_port()
    prefill, _ = start_vllm("waiting-prefill", model, log_dir, cores="0", prefix_caching=False,
                            kv=kv_config("KvxPushConnector", "kv_producer", "p",
                                         listen=f"127.0.0.1:{kvx_port}"))
    variants = {}
    for label, extra, executor in (("idle_wait_ms default", {}, "mp"),
                                   ("idle_wait_ms 0", {"idle_wait_ms": 0}, "mp"),
                                   ("uni executor", {}, "uni")):
        variants[label] = start_vllm(
            f"waiting-decode-{len(variants)}", model, log_dir, cores="1", prefix_caching=False,
            kv=kv_config("KvxPushConnector", "kv_consumer", f"d{len(variants)}",
                         registration_lease_s=LEASE_S, **extra), executor=executor)
    servers = [prefill] + [s for s, _ in variants.values()]
    results: dict[str, list[dict]] = {label: [] for label in variants}
    try:
        for s in servers:
            s.wait_ready()
        idle = probe("1")
        print(f"probe on the idle machine: {idle:.2f} s", flush=True)
        for rnd in range(args.rounds):
            for label, (server, url) in variants.items():
                def send(i: int) -> None:
                    body = {"model": "tiny", "prompt": "hello " * 200, "max_tokens": 4,
                            "temperature": 0, "ignore_eos": True,
                            "kv_transfer_params": {
                                "do_remote_prefill": True,
                                "kvx_transfer_id": f"waiting-{rnd}-{label}-{i}",
                                "kvx_prefill": f"127.0.0.1:{kvx_port}"}}
                    try:
                        http("POST", f"{url}/v1/completions", body, timeout=LEASE_S + 30)
                    except OSError:
                        pass
                senders = [threading.Thread(target=send, args=(i,), daemon=True)
                           for i in range(args.requests)]
                for t in senders:
                    t.start()
                time.sleep(1.0)
                pids = descendants(server.proc.pid)
                before, t0 = cpu_seconds(pids), time.monotonic()
                time.sleep(MEASURE_S)
                after, elapsed = cpu_seconds(pids), time.monotonic() - t0
                probe_s = probe("1")
                per = {f"{name(p)}[{p}]": (after[p] - before[p]) / elapsed for p in pids}
                row = {"round": rnd, "cores": sum(per.values()), "processes": per,
                       "probe_s": probe_s}
                results[label].append(row)
                print(f"round {rnd} {label}: decode used {row['cores']:.2f} cores while "
                      f"{args.requests} requests waited ("
                      + ", ".join(f"{k} {v:.2f}" for k, v in per.items() if v >= 0.01)
                      + f"); probe on its core {probe_s:.2f} s", flush=True)
                for t in senders:
                    t.join()
    finally:
        for s in servers:
            s.kill()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "requests_waiting": args.requests, "probe_idle_s": idle, "variants": results}
    (out / "waiting.json").write_text(json.dumps(report, indent=1))
    print("\n| decode | cores used while requests wait (per round) | probe on decode's core "
          f"(s; {idle:.2f} idle) |\n|---|---|---|")
    for label, rows in results.items():
        cores = ", ".join(f"{r['cores']:.2f}" for r in rows)
        probes = ", ".join(f"{r['probe_s']:.2f}" for r in rows)
        print(f"| {label} | {cores} | {probes} |")


if __name__ == "__main__":
    main()
