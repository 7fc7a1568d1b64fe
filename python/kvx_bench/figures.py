"""A point's figures: quantiles of the client's measures (`summarize`), the requests the
hypervisor stole from (`steal_summary`), and decode's own histograms read from its `/metrics`
(`decode_histograms`, `grown`)."""

from __future__ import annotations

import statistics

# python/tests on sys.path, for `test_e2e_vllm`.
import kvx_bench.systems  # noqa: F401


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
