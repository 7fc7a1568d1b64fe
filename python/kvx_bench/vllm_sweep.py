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
of this package (`nixl_router`, aiohttp) sends both legs at once with the same `X-Request-Id`.

Output (--out, default target/kvx-bench): vllm.json (every point, every system, and the
per-request samples), vllm.md (tables and the target check); logs of every process under
vllm-logs/. The plots are drawn from vllm.json by xtask.

Several sweeps of the same systems, lengths and rates pool into one report of all their rounds
(the targets judged anew over them):

    .kvx-cache/venv/bin/python -m kvx_bench.vllm_sweep pool A/vllm.json B/vllm.json --out DIR

The sweep's modules, by job: `systems` (the systems compared, their variants, vLLM's executor),
`instances` (starting, holding and stopping a system's instances and router), `nixl_router`
(the router for NixlPushConnector), `load` (the load client), `rounds` (the systems side by
side, every point in rounds of turns), `figures` (a point's figures, decode's histograms),
`cpu_time` (where a turn's CPU time goes), `targets` (#7's targets), `pooling` (several sweeps
as one report) and `report` (vllm.md); this module is the command line, and the names that
tests and scripts read from `kvx_bench.vllm_sweep` come from those modules. The settings the
command line sets live in the module that reads them: `systems.EXECUTOR`,
`instances.KVX_TRANSPORT`, `load.VOCAB` and `cpu_time.CLOCK`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from kvx_bench import cpu_time, instances, load, systems
from kvx_bench.cpu_time import (  # noqa: F401 - re-exported
    NOT_CPU,
    TICK_MS,
    VLLM_DEPTHS,
    MachineClock,
    cpu_parts,
    cpu_per_request,
    cpu_turn,
    helper_threads_ticks,
    note_machine,
    process_table,
    process_trees,
    runqueue_wait_ms,
    stat_fields,
)
from kvx_bench.figures import (  # noqa: F401 - re-exported
    GAP_BOUNDS_S,
    SERVER_TPOT,
    TOKEN_GAPS,
    decode_histograms,
    grown,
    quantiles,
    steal_summary,
    summarize,
)
from kvx_bench.instances import (  # noqa: F401 - re-exported
    BLOCK,
    D_CORES,
    NIXL_SITE,
    P_CORES,
    START_TIMEOUT,
    hold_idle,
    kv_config,
    nixl_env,
    start_instance,
    start_system,
    stop_system,
)
from kvx_bench.load import (  # noqa: F401 - re-exported
    OUTPUT_TOKENS,
    REQUEST_CAP_S,
    make_prompt,
    one_request,
    run_point,
    warm_up,
)
from kvx_bench.nixl_router import DEBUG, nixl_push_router  # noqa: F401 - re-exported
from kvx_bench.pooling import pool_points, pool_reports  # noqa: F401 - re-exported
from kvx_bench.report import (  # noqa: F401 - re-exported
    COALESCED_PIECES,
    by_depth,
    fmt_ms,
    gap_shares,
    markdown,
    markdown_targets,
    pooled_gaps,
    uni_note,
)
from kvx_bench.rounds import (  # noqa: F401 - re-exported
    MAX_SIDE_BY_SIDE,
    TURN_GAP_S,
    TURN_WARMUP,
    run_group,
    run_systems,
)
from kvx_bench.systems import (  # noqa: F401 - re-exported
    HERE,
    KVX_VARIANTS,
    REPO,
    SYSTEMS,
    UNI_VARIANT,
    executor_of,
    is_variant,
    log,
    variant_extra,
)
from kvx_bench.targets import (  # noqa: F401 - re-exported
    BOOTSTRAP_RESAMPLES,
    BURST_TPOT_MS,
    INTERVAL,
    PACED_TPOT,
    bunched,
    check_targets,
    get,
    point_rounds,
    point_value,
    ratio_interval,
    round_samples,
)


def main() -> None:
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
    ap.add_argument("--executor", choices=["mp", "uni"], default=systems.EXECUTOR,
                    help="vLLM's executor on every instance: uni (the default: the worker in "
                         "the engine core's process, its OpenMP threads bound) or mp (vLLM's "
                         "default on CPU, whose processes spin on their message queue)")
    args = ap.parse_args()
    instances.KVX_TRANSPORT = args.kvx_transport
    systems.EXECUTOR = args.executor
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
    chosen = [s for s in SYSTEMS if not is_variant(s[0])]
    if args.systems:
        want = args.systems.split(",")
        chosen = [s for s in SYSTEMS if s[0] in want]
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
    load.VOCAB = json.loads((model / "config.json").read_text())["vocab_size"]
    t0 = time.monotonic()
    if MachineClock.read() is not None:
        cpu_time.CLOCK = MachineClock()
    try:
        results = run_systems(chosen, args, model, log_dir, lengths, rates)
    finally:
        if cpu_time.CLOCK is not None:
            cpu_time.CLOCK.stop()
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
