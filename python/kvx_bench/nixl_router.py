"""The router for NixlPushConnector (run as `python -m kvx_bench.vllm_sweep router ...`): it
sends both legs of a request at once, with the same `X-Request-Id`, and decode's
`kv_transfer_params` name the prefill instance's NIXL coordinates before prefill has run
(which `kvx proxy` does not send)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid

DEBUG = bool(os.environ.get("KVX_BENCH_ROUTER_DEBUG"))


async def nixl_push_router(listen_port: int, prefill: str, decode: str, p_engine: str,
                           p_side_port: int) -> None:
    import aiohttp
    from aiohttp import web

    timeout = aiohttp.ClientTimeout(total=600)
    session = aiohttp.ClientSession(timeout=timeout,
                                    connector=aiohttp.TCPConnector(limit=0))

    async def health(_req):
        return web.Response(text="ok")

    async def completions(req: web.Request):
        body = await req.json()
        rid = f"nixlpush-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": rid}
        p_body = dict(body)
        p_body.update(max_tokens=1, stream=False,
                      kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        p_body.pop("stream_options", None)
        p_body.pop("max_completion_tokens", None)
        d_body = dict(body)
        d_body["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": p_engine, "remote_host": "127.0.0.1",
            "remote_port": p_side_port, "tp_size": 1,
            # Required by the decode side's metadata; in push mode it only names the request
            # for heartbeats (prefill learns decode's id from the registration). vLLM names a
            # completion `cmpl-<X-Request-Id>-<n>` plus a random suffix that it strips to match.
            "remote_request_id": f"cmpl-{rid}-0",
        }

        async def p_leg():
            async with session.post(f"{prefill}{req.path}", json=p_body, headers=headers) as r:
                text = await r.read()
                if r.status != 200:
                    raise web.HTTPBadGateway(text=f"prefill {r.status}: {text[:300]!r}")

        p_task = asyncio.create_task(p_leg())
        try:
            async with session.post(f"{decode}{req.path}", json=d_body, headers=headers) as r:
                resp = web.StreamResponse(status=r.status, headers={
                    "content-type": r.headers.get("content-type", "application/json")})
                await resp.prepare(req)
                async for chunk in r.content.iter_any():
                    if DEBUG:
                        print(f"{time.perf_counter():.4f} {rid} {len(chunk)}", file=sys.stderr,
                              flush=True)
                    await resp.write(chunk)
                await resp.write_eof()
            await p_task
            return resp
        finally:
            if not p_task.done():
                p_task.cancel()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", listen_port).start()
    await asyncio.Event().wait()
