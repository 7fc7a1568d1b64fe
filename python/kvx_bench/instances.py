"""A system's instances and router: the kv-transfer config and environment of each vLLM
instance, starting a system and warming it up (`start_system`), stopping the others during a
system's turn (`hold_idle`) and stopping a system (`stop_system`)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

from kvx_bench.figures import GAP_BOUNDS_S
from kvx_bench.load import warm_up
from kvx_bench.systems import HERE, executor_of, log, variant_extra

BLOCK = 32
START_TIMEOUT = 420.0
P_CORES, D_CORES = "0", "1"
NIXL_SITE = HERE / "nixl_site"


# The kvx data transport (`--kvx-transport`); the connector's default when None.
KVX_TRANSPORT: str | None = None


def kv_config(connector: str, role: str, engine: str, kvx_listen: str | None,
              overrides: dict | None = None) -> dict:
    if connector.startswith("Kvx"):
        extra: dict = {"listen": kvx_listen} if kvx_listen else {}
        extra.update(overrides or {})
        if KVX_TRANSPORT:
            extra["transport"] = KVX_TRANSPORT
        return {"kv_connector": connector, "kv_connector_module_path": "kvx_vllm",
                "kv_role": role, "engine_id": engine, "kv_connector_extra_config": extra}
    return {"kv_connector": connector, "kv_role": role, "engine_id": engine,
            "kv_buffer_device": "cpu", "kv_connector_extra_config": {"backends": ["UCX"]}}


def start_instance(name: str, model: Path, log_dir: Path, kv: dict, cores: str,
                   extra_env: dict[str, str], executor: str):
    from test_e2e_vllm import Server, free_port, use_uni_executor, vllm_env

    port = free_port()
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
        "--max-model-len", "2048", "--max-num-seqs", "8", "--seed", "0",
        "--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching",
        "--kv-transfer-config", json.dumps(kv),
        "--custom-histogram-buckets", json.dumps({"inter_token_latency": GAP_BOUNDS_S}),
    ]
    env = vllm_env(cores)
    env.update(extra_env)
    if executor == "uni":
        use_uni_executor(args, env)
    url = f"http://127.0.0.1:{port}"
    return Server(name, args, log_dir, env, f"{url}/health"), url


def nixl_env(corrected: bool, side_port: int) -> dict[str, str]:
    env = {
        "PYTHONPATH": os.pathsep.join(
            [str(NIXL_SITE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        "KVX_BENCH_NIXL_CUDA_MAJOR": "12",
        "UCX_TLS": "tcp",
        "UCX_MODULES": "^ib,mlx5,efa",
        "UCX_RCACHE_MAX_UNRELEASED": "1024",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
    }
    if corrected:
        env["KVX_BENCH_VLLM_CORRECTED"] = "1"
    return env


def start_system(system: tuple, args, model: Path, log_dir: Path, lengths) -> dict:
    """Starts a system's prefill and decode instances and its router, and warms it up. The
    returned state has `servers`, `url` and `result` (`result["failed"]` if it did not start)."""
    # The end-to-end tests' helpers (imported here, not at the top: the router process
    # (`vllm_sweep router`) imports this module too and needs neither them nor vLLM).
    from test_e2e_vllm import Server, free_port

    name, router, connector, corrected = system
    log(f"=== {name}: {connector} behind {router} router")
    extra_p: dict[str, str] = {}
    extra_d: dict[str, str] = {}
    kvx_port = None
    p_side = d_side = None
    if connector.startswith("Kvx"):
        kvx_port = free_port()
    else:
        p_side, d_side = free_port(), free_port()
        extra_p = nixl_env(bool(corrected), p_side)
        extra_d = nixl_env(bool(corrected), d_side)
    p_engine, d_engine = f"p-{name}", f"d-{name}"
    p, p_url = start_instance(f"{name}-prefill", model, log_dir,
                              kv_config(connector, "kv_producer", p_engine,
                                        f"127.0.0.1:{kvx_port}" if kvx_port else None,
                                        variant_extra(name)),
                              P_CORES, extra_p, executor_of(name))
    d, d_url = start_instance(f"{name}-decode", model, log_dir,
                              kv_config(connector, "kv_consumer", d_engine, None,
                                        variant_extra(name)), D_CORES,
                              extra_d, executor_of(name))
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    if router == "nixl-push":
        r_args = [sys.executable, "-m", "kvx_bench.vllm_sweep", "router",
                  "--listen-port", str(router_port), "--prefill", p_url, "--decode", d_url,
                  "--p-engine", p_engine, "--p-side-port", str(p_side)]
        r_env = dict(os.environ)
        r_env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent)] + [
            q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q])
    else:
        mode = router.split("-")[1]
        kvx_addr = f"127.0.0.1:{kvx_port}" if kvx_port else "127.0.0.1:9"
        r_args = [str(args.kvx_bin), "proxy", "--mode", mode, "--listen",
                  f"127.0.0.1:{router_port}", "--prefill", f"{p_url}@{kvx_addr}",
                  "--decode", d_url]
        r_env = dict(os.environ)
    proxy = Server(f"{name}-router", r_args, log_dir, r_env, f"{router_url}/health")
    state = {"servers": [p, d, proxy], "url": router_url, "decode_url": d_url,
             "result": {"system": name, "connector": connector, "router": router,
                        "corrected": corrected, "points": []}}
    result = state["result"]
    t_start = time.monotonic()
    try:
        for srv in state["servers"]:
            srv.wait_ready(START_TIMEOUT)
        result["startup_s"] = time.monotonic() - t_start
        log(f"{name}: ready after {result['startup_s']:.0f} s; warming up")
        result["warmup"] = asyncio.run(warm_up(router_url, lengths, args.warmup))
        log(f"{name}: warm-up {result['warmup']['ok']}/{result['warmup']['sent']} ok")
    except Exception as e:  # a system that cannot start is a result too
        result["failed"] = f"{type(e).__name__}: {e}"[:2000]
        log(f"{name}: FAILED: {result['failed'][:500]}")
        stop_system(state)
    return state


def hold_idle(states: list[dict], running: dict | None) -> None:
    """Stops (SIGSTOP) every process of every system of `states` but `running`, then continues
    (SIGCONT) `running`'s; continues every system where `running` is None. Each server is the
    leader of its own process group (`Server` starts it in a new session), which vLLM's engine
    and worker processes share, so one signal per server reaches all of its processes. A
    stopped system holds no core: no idle progress thread, no spin of vLLM's message queues,
    no timer; the kernel still answers its TCP peers, so no connection of it breaks."""
    order = sorted(states, key=lambda st: st is running)  # stop the others first
    for st in order:
        sig = signal.SIGCONT if running is None or st is running else signal.SIGSTOP
        for srv in st.get("servers", []):
            if srv.proc.poll() is None:
                try:
                    os.killpg(srv.proc.pid, sig)
                except ProcessLookupError:  # ended since the poll
                    pass


def stop_system(state: dict) -> None:
    servers = state.pop("servers", [])
    for srv in reversed(servers):
        srv.kill()
    for srv in servers[:2]:
        text = srv.log.read_text(errors="replace")
        state["result"].setdefault("log_tracebacks", {})[srv.name] = text.count("Traceback")
