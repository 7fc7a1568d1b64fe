"""The load client: streamed completions of random token ids, one at a time (`warm_up`) or
as a Poisson stream (`run_point`), each timed on the client (`one_request`)."""

from __future__ import annotations

import asyncio
import json
import random
import time

OUTPUT_TOKENS = 16
REQUEST_CAP_S = 60.0


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
