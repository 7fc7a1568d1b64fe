"""#7's targets judged from a report: kvx push against the corrected vLLM connectors, over a
point's pooled rounds, round by round, and with a bootstrap interval of each ratio
(`check_targets`)."""

from __future__ import annotations

import random
import statistics
import zlib

from kvx_bench.figures import quantiles


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
