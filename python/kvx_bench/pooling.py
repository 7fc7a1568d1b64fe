"""Several sweeps of the same points as one report of all their rounds (`pool_reports`), the
targets judged anew over them."""

from __future__ import annotations

from kvx_bench.cpu_time import cpu_per_request
from kvx_bench.figures import summarize
from kvx_bench.targets import check_targets, point_rounds


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
