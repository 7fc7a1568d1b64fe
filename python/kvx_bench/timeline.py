"""Where a kvx request's time to first token goes, on real vLLM (CPU).

Starts a kvx prefill and decode instance (the tiny float32 model of python/tests/tiny_model.py,
prefill on core 0, decode on core 1) behind `kvx proxy`, with kvx's debug log on, sends
sequential streamed completions of random token ids, and lines up each request's connector
events (from the instances' logs) against the client's clock:

    decode registered -> prefill sealed (the forward pass that computed the prompt ended) ->
    writes posted -> notice -> ready -> first token; prefill finished (vLLM hands the blocks
    over, an engine iteration after the seal) is shown too

    .kvx-cache/venv/bin/python -m kvx_bench.timeline --kvx-bin target/debug/kvx \\
        [--mode push|pull] [--transport cma] [--input-tokens 256] [--requests 12]
        [--max-tokens 8] [--rate R (Poisson arrivals, overlapping, instead of sequential)]
        [--no-seal] [--executor uni] [--extra JSON]
        (from python/, or with python/ on PYTHONPATH; `maturin develop` first)

It prints one line per request and the medians of the phases: how long the connector's own part
(prefill finished -> KV ready on decode) takes, and how much of the TTFT is vLLM's before
(request handling and the prefill) and after (decode's next steps, the first token's way out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python" / "tests"))

# kvx writes colour codes only to a terminal; strip any anyway (a log captured through a pty).
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LINE = re.compile(r"(\d{4}-\d\d-\d\dT[\d:.]+)Z\s+DEBUG\s+\S+: (.*)")
# The events kept, by the first words of their log message.
EVENTS = ("registered", "request sealed", "request finished", "writes posted", "write done",
          "notice", "ready")


def events(path: Path) -> list[tuple[float, str]]:
    """(unix time, event) of the connector's debug lines in a log."""
    out = []
    for raw in path.read_text(errors="replace").splitlines():
        m = LINE.match(ANSI.sub("", raw))
        if not m:
            continue
        name = next((e for e in EVENTS if m.group(2).startswith(e)), None)
        if name is None:
            continue
        at = datetime.datetime.fromisoformat(m.group(1)).replace(tzinfo=datetime.timezone.utc)
        out.append((at.timestamp(), name))
    return out


def stream(url: str, prompt: list[int], max_tokens: int = 8) -> tuple[float, float]:
    """Sends one streamed completion; returns (sent, first token) in unix time."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    sent = time.time()
    first = None
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if first is None and line.startswith(b"data: ") and b"[DONE]" not in line:
                first = time.time()
    if first is None:
        raise RuntimeError("no token streamed")
    return sent, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvx-bin", required=True)
    ap.add_argument("--mode", choices=("push", "pull"), default="push")
    ap.add_argument("--transport", default="cma")
    ap.add_argument("--input-tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--gap-s", type=float, default=0.5)
    ap.add_argument("--rate", type=float,
                    help="Poisson arrivals at this many requests/s (overlapping) instead of "
                         "sequential requests --gap-s apart")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--no-seal", action="store_true",
                    help="prefill's extra-config seal off: the KV leaves when vLLM has finished "
                         "the request, not when the forward pass that computed it ended")
    ap.add_argument("--extra", type=json.loads, default={},
                    help="more extra-config keys for both instances, as JSON "
                         "(e.g. '{\"idle_wait_ms\": 0}')")
    ap.add_argument("--executor", choices=("mp", "uni"), default="mp",
                    help="vLLM's executor on both instances (docs/vllm.md)")
    args = ap.parse_args()
    os.environ["KVX_BIN"] = str(Path(args.kvx_bin).resolve())
    os.environ["KVX_LOG"] = "kvx_vllm=debug"
    import test_e2e_vllm as e2e  # noqa: PLC0415 (reads KVX_BIN when imported)
    from tiny_model import build  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="kvx-timeline-"))
    model = build(work / "model", kv_heads=2)
    extra = {"transport": args.transport, **args.extra}
    if args.no_seal:
        extra["seal"] = False
    p, _, d, _, proxy, url = e2e.run_pair(args.mode, model, work, {}, p_extra=dict(extra),
                                          d_extra=dict(extra), executor=args.executor)
    rng = random.Random(1)
    sends = []
    try:
        for s in (p, d, proxy):
            s.wait_ready()
        for _ in range(3):  # warm-up
            stream(url, [rng.randrange(10, 400) for _ in range(args.input_tokens)])
        prompts = [[rng.randrange(10, 400) for _ in range(args.input_tokens)]
                   for _ in range(args.requests)]
        if args.rate:
            with ThreadPoolExecutor(max_workers=args.requests) as pool:
                futures = []
                for prompt in prompts:
                    futures.append(pool.submit(stream, url, prompt, args.max_tokens))
                    time.sleep(rng.expovariate(args.rate))
                sends = [f.result() for f in futures]
        else:
            for prompt in prompts:
                sends.append(stream(url, prompt, args.max_tokens))
                time.sleep(args.gap_s)
    finally:
        for s in (proxy, d, p):
            s.kill()
    logged = sorted([(t, "prefill " + e) for t, e in events(p.log)]
                    + [(t, "decode " + e) for t, e in events(d.log)])
    phases: dict[str, list[float]] = {}
    print(f"kvx {args.mode} over {args.transport}{', seal off' if args.no_seal else ''}, "
          f"{args.input_tokens}-token prompts "
          f"(ms from the request's send; logs in {work})")
    for sent, first in sends:
        mine = [(round((t - sent) * 1e3, 2), e) for t, e in logged if sent <= t <= first]
        print(f"TTFT {(first - sent) * 1e3:6.1f}: " + "; ".join(f"{t} {e}" for t, e in mine))
        at = {e: t for t, e in reversed(mine)}  # the first of each
        sealed = at.get("prefill request sealed")
        finished = at.get("prefill request finished")
        # The KV is complete at the seal (a one-token prefill on a host cache), else at the
        # finish.
        done = sealed if sealed is not None else finished
        ready = at.get("decode ready")
        if done is not None and ready is not None:
            phases.setdefault("send -> prefill done (sealed or finished)", []).append(done)
            phases.setdefault("prefill done -> ready (kvx)", []).append(ready - done)
            phases.setdefault("ready -> first token", []).append((first - sent) * 1e3 - ready)
        if sealed is not None and finished is not None:
            phases.setdefault("sealed -> finished (taken off the TTFT)", []).append(
                finished - sealed
            )
        phases.setdefault("TTFT", []).append((first - sent) * 1e3)
    for name, xs in phases.items():
        print(f"median {name}: {statistics.median(xs):.2f} ms ({len(xs)} requests)")


if __name__ == "__main__":
    main()
