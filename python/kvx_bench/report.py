"""vllm.md: a report's tables, one cell per system and a row per point, and its targets
section (`markdown`)."""

from __future__ import annotations

from kvx_bench.cpu_time import VLLM_DEPTHS
from kvx_bench.load import OUTPUT_TOKENS, REQUEST_CAP_S
from kvx_bench.systems import UNI_VARIANT
from kvx_bench.targets import BURST_TPOT_MS, bunched

# A stream whose tokens reached the client in this many server-sent events or fewer was merged
# by decode's API server (vLLM coalesces a request's outputs when its stream runs behind).
COALESCED_PIECES = 4


def fmt_ms(v) -> str:
    return "–" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


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
