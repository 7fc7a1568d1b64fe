"""`bench vllm`'s judgement of #7's targets: pooled over a point's rounds and round by round."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvx_bench import vllm_sweep as vs  # noqa: E402


TPOT_PUSH = ("TPOT p50 (paced streams) kvx push no worse than corrected NixlPushConnector "
             "(<= 1.05 x)")


def sample(round_: int, ttft: float, tpot: float) -> dict:
    return {"ok": True, "round": round_, "ttft_ms": ttft, "tpot_ms": tpot,
            "e2e_ms": ttft + 15 * tpot}


def point(samples: list[dict], server_by_round: list[float | None]) -> dict:
    ok = [s for s in samples if s["ok"]]
    known = [t for t in server_by_round if t is not None]
    return {"input_tokens": 256, "rate": 4.0, "ok": len(ok),
            "ttft_ms": vs.quantiles([s["ttft_ms"] for s in ok]),
            "tpot_ms": vs.quantiles([s["tpot_ms"] for s in ok]),
            "server_tpot_ms_mean": sum(known) / len(known) if known else None,
            "server_tpot_ms_by_round": server_by_round, "samples": samples}


def report(kvx: dict, push: dict, pull: dict) -> dict:
    def system(name, p):
        return {"system": name, "points": [p]}

    return {"lengths": [256], "rates": [4.0],
            "systems": [system("kvx-push", kvx), system("nixl-push-corrected", push),
                        system("nixl-pull-corrected", pull)]}


def by_what(checks: list[dict]) -> dict[str, dict]:
    return {c["what"]: c for c in checks}


def test_each_check_is_judged_pooled_and_in_each_round_alone():
    # kvx push: quick in round 0, slow in round 1; NixlPush steady in between; NixlConnector
    # slow in both rounds.
    kvx = point([sample(0, 40, 10) for _ in range(10)] + [sample(1, 200, 12) for _ in range(10)],
                [10.0, 12.0])
    push = point([sample(r, 100, 11) for r in (0, 1) for _ in range(10)], [11.0, 11.0])
    pull = point([sample(r, 300, 20) for r in (0, 1) for _ in range(10)], [20.0, None])
    checks = by_what(vs.check_targets(report(kvx, push, pull)))

    p50 = checks["TTFT p50 kvx push <= 0.8 x corrected NixlPushConnector"]
    # Pooled, the median falls between the two rounds' (40 and 200): 120 > 0.8 x 100.
    assert p50["kvx"] == 120 and p50["vllm"] == 100 and p50["met"] is False
    assert p50["round_ratios"] == [0.4, 2.0]
    assert (p50["rounds_met"], p50["rounds"]) == (1, 2)

    highest = checks["TTFT p99 kvx push < corrected NixlConnector (highest load)"]
    assert highest["met"] is True and (highest["rounds_met"], highest["rounds"]) == (2, 2)

    tpot = checks[TPOT_PUSH]
    assert tpot["round_ratios"] == [10 / 11, 12 / 11]
    assert (tpot["rounds_met"], tpot["rounds"]) == (1, 2)

    # Decode's own measure, per round from its histogram; a round without a figure for the
    # vLLM side is not judged.
    server = checks["TPOT mean (decode's measure) kvx push no worse than corrected "
                    "NixlConnector (<= 1.05 x)"]
    assert server["kvx"] == 11.0 and server["vllm"] == 20.0 and server["met"] is True
    assert server["round_ratios"] == [0.5, None]
    assert (server["rounds_met"], server["rounds"]) == (1, 1)

    text = "\n".join(vs.markdown_targets(list(checks.values())))
    assert "| 1 of 2: 0.40 2.00 |" in text
    assert "Round by round:" in text


def test_a_burst_on_the_vllm_side_is_not_judged_and_old_reports_have_no_rounds():
    kvx = point([sample(r, 40, 10) for r in (0, 1) for _ in range(4)], [10.0, 10.0])
    # NixlPush's tokens came in one burst in round 1 (client TPOT near zero).
    push = point([sample(0, 100, 10) for _ in range(4)] + [sample(1, 100, 0.1) for _ in range(4)],
                 [10.0, 10.0])
    pull = point([sample(r, 100, 10) for r in (0, 1) for _ in range(4)], [10.0, 10.0])
    tpot = by_what(vs.check_targets(report(kvx, push, pull)))[TPOT_PUSH]
    assert tpot["round_ratios"] == [1.0, None]
    assert (tpot["rounds_met"], tpot["rounds"]) == (1, 1)

    # A report written before samples recorded their round: pooled verdicts only.
    for p in (kvx, push, pull):
        for s in p["samples"]:
            del s["round"]
        p.pop("server_tpot_ms_by_round")
    checks = vs.check_targets(report(kvx, push, pull))
    assert all(c["rounds"] == 0 and c["round_ratios"] == [] for c in checks)
    assert all(c["met"] is not None for c in checks)
    assert "Round by round:" not in "\n".join(vs.markdown_targets(checks))
    assert all(c["interval"] is None and c["confidence"] is None for c in checks)
    assert "With 90 % confidence" not in "\n".join(vs.markdown_targets(checks))


def test_streams_whose_tokens_came_together_are_left_out_of_the_tpot_checks():
    # NixlPush's decode API server ran behind: 6 of every 10 of its streams reached the client
    # at once (TPOT 0.02 ms), the others paced at 10 ms; kvx push paced at 9.5 ms throughout.
    kvx = point([sample(r, 40, 9.5) for r in (0, 1) for _ in range(10)], [9.5, 9.5])
    push = point([sample(r, 100, 0.02 if i < 6 else 10) for r in (0, 1) for i in range(10)],
                 [9.0, 9.0])
    pull = point([sample(r, 100, 10) for r in (0, 1) for _ in range(10)], [10.0, 10.0])
    # Counted in, the bunched streams make NixlPush's median 0.02 ms.
    assert push["tpot_ms"]["p50"] == 0.02
    tpot = by_what(vs.check_targets(report(kvx, push, pull)))[TPOT_PUSH]
    assert tpot["kvx"] == 9.5 and tpot["vllm"] == 10 and tpot["met"] is True
    assert tpot["round_ratios"] == [0.95, 0.95] and tpot["confidence"] == "met"
    # A bunched stream of kvx push's is left out alike.
    kvx["samples"][0]["tpot_ms"] = 0.01
    assert by_what(vs.check_targets(report(kvx, push, pull)))[TPOT_PUSH]["kvx"] == 9.5
    assert vs.bunched(push) == "12/20" and vs.bunched(kvx) == "1/20"


def spread(round_: int, centre: float, tpot: float, n: int = 12) -> list[dict]:
    """`n` requests of a round whose TTFT spreads ±10 % around `centre`."""
    return [sample(round_, centre * (0.9 + 0.2 * i / (n - 1)), tpot) for i in range(n)]


def test_each_check_has_a_bootstrap_interval_and_says_what_it_is_sure_of():
    rounds = range(4)
    # kvx push: TTFT 40 % of NixlPush's in every round; TPOT 20 % above NixlPush's in every
    # round; against NixlConnector, decode's TPOT 15 % better in two rounds and 18 % worse in the
    # other two (the machine's rounds, not a difference).
    kvx = point([x for r in rounds for x in spread(r, 40, 12 if r % 2 else 9)],
                [12.0, 9.0, 12.0, 9.0])
    push = point([x for r in rounds for x in spread(r, 100, 10 if r % 2 else 7.5)],
                 [10.0, 7.5, 10.0, 7.5])
    pull = point([x for r in rounds for x in spread(r, 60, 11 if r % 2 else 10)],
                 [14.1, 7.6, 10.2, 10.6])
    checks = by_what(vs.check_targets(report(kvx, push, pull)))

    ttft = checks["TTFT p50 kvx push <= 0.8 x corrected NixlPushConnector"]
    low, high = ttft["interval"]
    assert 0.3 < low <= ttft["ratio"] <= high < 0.5, ttft["interval"]
    assert ttft["confidence"] == "met"

    worse = checks[TPOT_PUSH]
    assert worse["met"] is False and worse["confidence"] == "missed"
    assert worse["interval"][0] > 1.05

    # Decode's own measure against NixlConnector: 0.85, 1.18, 1.18, 0.85 by round.
    even = checks["TPOT mean (decode's measure) kvx push no worse than corrected "
                  "NixlConnector (<= 1.05 x)"]
    low, high = even["interval"]
    assert low < 1.0 < 1.05 < high and even["confidence"] == "undecided"

    # Strict bound: kvx push below NixlConnector at the highest load, 40 against 60.
    highest = checks["TTFT p50 kvx push < corrected NixlConnector (highest load)"]
    assert highest["bound"] == 1.0 and highest["confidence"] == "met"

    # The same report gives the same intervals (seeded by the check, not by the process).
    again = by_what(vs.check_targets(report(kvx, push, pull)))
    assert all(again[w]["interval"] == c["interval"] for w, c in checks.items())

    text = "\n".join(vs.markdown_targets(list(checks.values())))
    assert f"| {ttft['interval'][0]:.2f}–{ttft['interval'][1]:.2f}: met |" in text
    told = [c["confidence"] for c in checks.values()]
    assert (f"With 90 % confidence: met {told.count('met')}, missed {told.count('missed')}, "
            f"undecided {told.count('undecided')}") in text


def sweep(kvx_ttft: float, kvx_tpot_server: float, requests: int, date: str) -> dict:
    """A sweep of 2 rounds: kvx push at `kvx_ttft` in both, NixlPush and NixlConnector at 100
    and 300 ms; decode's TPOT counted over `requests` requests per point."""
    def full(p: dict, cpu_ms: float) -> dict:
        return dict(p, requests=len(p["samples"]), rounds=2, wall_s=10.0,
                    server_tpot_requests=requests,
                    cpu_ms_per_request={"decode engine": cpu_ms})

    kvx = full(point([sample(r, kvx_ttft, 10) for r in (0, 1) for _ in range(10)],
                     [kvx_tpot_server] * 2), kvx_tpot_server)
    push = full(point([sample(r, 100, 11) for r in (0, 1) for _ in range(10)], [11.0] * 2), 1)
    pull = full(point([sample(r, 300, 20) for r in (0, 1) for _ in range(10)], [20.0] * 2), 1)
    return dict(report(kvx, push, pull), date=date, rounds=2, requests_per_point=20,
                sweep_s=60.0, machine="2 cores", vllm="0.32.0", requests_per_round=10,
                warmup_per_length=4, turn_warmup=2, idle_systems="stopped")


def test_sweeps_pool_into_one_report_of_all_their_rounds():
    quick, slow = sweep(40, 10.0, 20, "day 1"), sweep(200, 14.0, 60, "day 2")
    p50 = "TTFT p50 kvx push <= 0.8 x corrected NixlPushConnector"
    # Alone, each sweep decides the check its own way.
    assert by_what(vs.check_targets(quick))[p50]["met"] is True
    assert by_what(vs.check_targets(slow))[p50]["met"] is False

    pooled = vs.pool_reports([quick, slow])
    assert pooled["rounds"] == 4 and pooled["requests_per_point"] == 40
    assert pooled["date"] == "day 1, day 2" and pooled["pooled_from"] == 2
    kvx = pooled["systems"][0]["points"][0]
    # The second sweep's rounds come after the first's.
    assert sorted({s["round"] for s in kvx["samples"]}) == [0, 1, 2, 3]
    assert [s["round"] for s in slow["systems"][0]["points"][0]["samples"]][:1] == [0]
    assert kvx["requests"] == 40 and kvx["ok"] == 40 and kvx["rounds"] == 4
    assert kvx["ttft_ms"]["p50"] == 120
    # Decode's own TPOT weighted by the requests each sweep counted; per round, in order.
    assert kvx["server_tpot_ms_mean"] == (10.0 * 20 + 14.0 * 60) / 80
    assert kvx["server_tpot_ms_by_round"] == [10.0, 10.0, 14.0, 14.0]
    assert kvx["cpu_ms_per_request"]["decode engine"] == (10.0 * 20 + 14.0 * 20) / 40

    check = by_what(pooled["targets"])[p50]
    assert check["met"] is False and check["round_ratios"] == [0.4, 0.4, 2.0, 2.0]
    assert (check["rounds_met"], check["rounds"]) == (2, 4)
    assert check["confidence"] == "undecided"
    text = vs.markdown(pooled)
    assert "2 of 4: 0.40 0.40 2.00 2.00" in text and "2 sweeps pooled" in text


def test_only_sweeps_of_the_same_points_pool():
    other_rates = sweep(40, 10.0, 20, "day 2")
    other_rates["rates"] = [2.0]
    # A sweep from before `--executor` ran vLLM's default executor, mp.
    other_executor = sweep(40, 10.0, 20, "day 2")
    other_executor["executor"] = "uni"
    for other in (other_rates, other_executor):
        try:
            vs.pool_reports([sweep(40, 10.0, 20, "day 1"), other])
        except ValueError as e:
            assert "day 2" in str(e) and "day 1" in str(e)
        else:
            raise AssertionError(f"sweeps of other points were pooled: {other}")
    same = sweep(40, 10.0, 20, "day 2")
    same["executor"] = "mp"
    assert vs.pool_reports([sweep(40, 10.0, 20, "day 1"), same])["pooled_from"] == 2


def test_the_report_says_which_instances_ran_vllms_uni_executor():
    mp = sweep(40, 10.0, 20, "day 1")
    assert vs.uni_note(mp) == "" and vs.uni_note(dict(mp, executor="mp")) == ""
    every = vs.uni_note(dict(mp, executor="uni"))
    assert "on every instance (`--executor uni`)" in every and "engine 0" in every
    variant = dict(mp, systems=mp["systems"] + [dict(mp["systems"][0], system="kvx-push-uni")])
    assert "on the instances of kvx-push-uni:" in vs.uni_note(variant)
