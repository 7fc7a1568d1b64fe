"""The sweep's measuring: the systems side by side in groups (`run_systems`), every point of
a group in rounds of turns (`run_group`)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from kvx_bench import cpu_time
from kvx_bench.cpu_time import cpu_parts, cpu_per_request, cpu_turn, note_machine
from kvx_bench.figures import decode_histograms, grown, summarize
from kvx_bench.instances import hold_idle, start_system, stop_system
from kvx_bench.load import run_point, warm_up
from kvx_bench.systems import log

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
                    clock = cpu_time.CLOCK
                    cpu = cpu_turn(cpu_before, cpu_parts(states, st),
                                   clock.between(t_turn, time.perf_counter()) if clock else None)
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
