"""End to end with real vLLM on CPU: a prefill and a decode instance running the kvx connector,
behind `kvx proxy`, answer exactly like one vLLM instance alone.

What runs: a tiny random Llama model and tokenizer made here (tiny_model.py); vLLM's OpenAI
server (float32, --enforce-eager, block size 32, prefix caching off on decode); the `kvx` binary
(KVX_BIN, default target/debug/kvx — `cargo build -p kvx-cli` first). Takes a few minutes on two
cores. Without vLLM or the binary the tests are reported as skipped, with the reason.

Each test says what it proves.
"""

from __future__ import annotations

import json
import random
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.client import HTTPConnection
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from two_hosts import TwoHosts, inside, why_not  # noqa: E402

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_VLLM = False

KVX_BIN = Path(os.environ.get("KVX_BIN", REPO / "target" / "debug" / "kvx"))

pytestmark = [
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed: run python/setup_env.sh"),
    pytest.mark.skipif(not KVX_BIN.exists(), reason=f"no kvx binary at {KVX_BIN}: cargo build -p kvx-cli"),
]

if os.environ.get("KVX_REQUIRE_E2E") and (not HAVE_VLLM or not KVX_BIN.exists()):
    # `cargo xtask test` sets this: there, a missing vLLM or binary is a failure, not a skip.
    raise RuntimeError(f"end-to-end prerequisites missing: vLLM {HAVE_VLLM}, kvx binary {KVX_BIN}")

if os.environ.get("KVX_REQUIRE_INSTALLED"):
    # `cargo xtask test`'s wheel run: the package under test (here, and in the vLLM processes,
    # which run this interpreter) is the one pip installed from the wheel, not the checkout's.
    import sysconfig

    import kvx_vllm
    from kvx_vllm import _native

    _SITE = Path(sysconfig.get_paths()["platlib"]).resolve()
    for _file in (kvx_vllm.__file__, _native.__file__):
        if _SITE not in Path(_file).resolve().parents:
            raise RuntimeError(f"{_file} is not the installed package's (in {_SITE})")
    if kvx_vllm._installed_version() != _native.__version__:
        raise RuntimeError(f"installed kvx-vllm {kvx_vllm._installed_version()}, native "
                           f"module {_native.__version__}")

BLOCK = 32
START_TIMEOUT = 420.0
WORDS = (
    "the prefill decode cache block token layer head push pull transfer memory write read engine "
    "request router lease heartbeat queue model vector key value attention latency time first "
    "output batch server client fabric region rank tensor parallel"
).split()
# Word counts chosen so that the prompts span one to about ten blocks of 32 tokens.
PROMPT_WORDS = [7, 45, 110, 260]
# A prompt of about 60 blocks: computed in 32-token steps, it keeps prefill busy long enough to
# be aborted halfway (on a fast machine a step takes about 2 ms).
LONG_WORDS = 1900
MAX_TOKENS = 12
LOGPROB_TOL = 1e-3
_NCPU = os.cpu_count() or 1
P_CORES = "0" if _NCPU > 1 else None
D_CORES = "1" if _NCPU > 1 else None


def prompt(n_words: int, salt: int = 0) -> str:
    return " ".join(WORDS[(i * 5 + salt) % len(WORDS)] for i in range(n_words))


def shared_prefix_prompts() -> dict[str, str]:
    """Two prompts of some 10 blocks that share their first 8 or so."""
    prefix = prompt(260, salt=11)
    return {"shared-a": f"{prefix} {prompt(40, salt=1)}", "shared-b": f"{prefix} {prompt(40, salt=2)}"}


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS = random.Random(os.getpid())
_HANDED_OUT: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive free ports below the ephemeral range (a prefill with
    several ranks listens on `listen` + rank): vLLM binds its own sockets (ZMQ and others) to
    ephemeral ports while it starts, so a port picked there could be taken before our server
    binds it. Never the same port twice in one run: a server handed a port may not have bound
    it yet when the next one is picked (a proxy once took its prefill's port that way)."""
    low = _ephemeral_low()
    for _ in range(1000):
        port = _PORTS.randrange(max(1024, low - 12000), low - count + 1)
        ports = range(port, port + count)
        if any(p in _HANDED_OUT for p in ports):
            continue
        if not all(_bindable(p) for p in ports):
            continue
        _HANDED_OUT.update(ports)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def http(method: str, url: str, body: dict | None = None, timeout: float = 120.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Server:
    """A process (vLLM or the proxy) with its log in a file; stopped at the end."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str],
                 health: str, netns: str | None = None):
        self.name = name
        self.log = log_dir / f"{name}.log"
        self.health = health
        # The network namespace it runs in (two_hosts.py), where its health is asked too.
        self.netns = netns
        if netns is not None:
            args = ["ip", "netns", "exec", netns, *args]
        self.proc = subprocess.Popen(
            args, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with inside(self.netns):
                    if http("GET", self.health, timeout=2)[0] == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                # A stopped process (SIGSTOP) gets the signal only once it runs again.
                os.killpg(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@contextmanager
def running(*servers: Server):
    """Stops ``servers`` at the end (the last first); on a failure prints their logs' tails."""
    try:
        yield
    except Exception:
        for s in servers:
            print(f"--- {s.name} ---\n{s.tail(30)}", file=sys.stderr)
        raise
    finally:
        for s in reversed(servers):
            s.kill()


def vllm_env(cores: str | None = None, kvx_log: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if cores is not None:
        # Prefill and decode each get their own core for vLLM's OpenMP threads (by default
        # both would pin themselves to core 0 on a two-core machine).
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        KVX_LOG=kvx_log or os.environ.get("KVX_LOG", "kvx_vllm=info"),
        PYTHONUNBUFFERED="1",
    )
    return env


def use_uni_executor(args: list[str], env: dict[str, str]) -> None:
    """Makes an instance run its worker in its engine core's process (vLLM's `uni` executor):
    vLLM on CPU turns a `uni` executor into `mp` unless the engine's own multiprocessing is off;
    the API server still starts its engine core as a process of its own.

    vLLM 0.32 binds its OpenMP threads to ``VLLM_CPU_OMP_THREADS_BIND`` only in the worker
    process its `mp` executor starts (through ``OMP_*`` variables set for that process); under
    `uni` nothing binds them, and torch's OpenMP pool then has a thread per core of the machine,
    unbound. The same variables are set here, for the engine core's process."""
    args += ["--distributed-executor-backend", "uni"]
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(omp_binding(env.get("VLLM_CPU_OMP_THREADS_BIND")))


def omp_binding(cores: str | None) -> dict[str, str]:
    """The OpenMP variables vLLM's `mp` executor sets for a CPU worker bound to ``cores`` (a
    one-rank ``VLLM_CPU_OMP_THREADS_BIND`` list such as ``"1"`` or ``"0-3"``); none without a
    list (``auto``, ``nobind`` or unset)."""
    if cores is None or cores in ("auto", "nobind") or "|" in cores:
        return {}
    ids = sorted(core_ids(cores))
    return {
        "OMP_NUM_THREADS": str(len(ids)),
        "OMP_PLACES": "{" + ",".join(map(str, ids)) + "}",
        "OMP_PROC_BIND": "true",
    }


# What a push decode on CPU logs at start under vLLM's mp executor.
UNI_HINT = "vLLM's mp executor on CPU spins"
# What a rank logs at start under vLLM's uni executor when nothing binds its OpenMP threads.
UNBOUND_WARNING = "uni executor on CPU does not apply VLLM_CPU_OMP_THREADS_BIND"


def descendants(pid: int) -> list[int]:
    """`pid` and its descendants (those alive when read)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # ended meanwhile
                pass
    return out


def core_ids(cores: str) -> set[int]:
    """The cores a ``VLLM_CPU_OMP_THREADS_BIND`` value names (``"1"``, ``"0-3"``, ``"0|1"``),
    read with vLLM's own parser of each rank's list."""
    from vllm.utils.cpu_resource_utils import parse_id_list  # noqa: PLC0415

    return set().union(*(parse_id_list(rank) for rank in cores.split("|")))


def forward_affinity(pid: int) -> set[int]:
    """The cores that the main threads of the processes running an instance's forward pass
    (its `VLLM::Worker` processes; under `uni`, its engine core) may run on, together."""
    names = {p: n for p in descendants(pid) if (n := _comm(p)) is not None}
    runners = [p for p, n in names.items() if n.startswith("VLLM::Worker")]
    runners = runners or [p for p, n in names.items() if n == "VLLM::EngineCor"]
    assert runners, names
    return set().union(*(os.sched_getaffinity(p) for p in runners))


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # ended meanwhile
        return None


def process_names(pid: int) -> list[str]:
    """The names (`comm`) of `pid` and of its descendants that are alive."""
    return [n for p in descendants(pid) if (n := _comm(p)) is not None]


def start_vllm(name: str, model: Path, log_dir: Path, *, kv: dict | None = None,
               block_size: int = BLOCK, prefix_caching: bool = True,
               cores: str | None = None, args_extra: tuple[str, ...] = (),
               kvx_log: str | None = None, executor: str = "mp", host: str = "127.0.0.1",
               netns: str | None = None) -> tuple[Server, str]:
    port = free_port()
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--dtype", "float32", "--enforce-eager", "--block-size", str(block_size),
        "--max-model-len", "2048", "--max-num-seqs", "8", "--seed", "0",
        "--host", host, "--port", str(port),
    ]
    if not prefix_caching:
        args.append("--no-enable-prefix-caching")
    args += list(args_extra)
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv)]
    env = vllm_env(cores, kvx_log)
    if executor == "uni":
        use_uni_executor(args, env)
    url = f"http://{host}:{port}"
    return Server(name, args, log_dir, env, f"{url}/health", netns), url


def kv_config(connector: str, role: str, engine: str, **extra) -> dict:
    return {
        "kv_connector": connector,
        "kv_connector_module_path": "kvx_vllm",
        "kv_role": role,
        "engine_id": engine,
        "kv_connector_extra_config": extra,
        "kv_load_failure_policy": extra.pop("_policy", "fail"),
    }


def complete(base: str, text: str, max_tokens: int = MAX_TOKENS) -> dict:
    status, body = http("POST", f"{base}/v1/completions", {
        "model": "tiny", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 1, "ignore_eos": True,
    })
    assert status == 200, body
    out = json.loads(body)
    choice = out["choices"][0]
    return {
        "tokens": choice["logprobs"]["tokens"],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "prompt_tokens": out["usage"]["prompt_tokens"],
    }


def chat_stream(base: str, text: str) -> list[str]:
    """Streamed chat completion: the content pieces, in order."""
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps({
            "model": "tiny", "messages": [{"role": "user", "content": text}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True,
        }).encode(),
        headers={"content-type": "application/json"},
    )
    pieces = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for c in event["choices"]:
                if c["delta"].get("content"):
                    pieces.append(c["delta"]["content"])
    return pieces


class OtlpReceiver:
    """A minimal OpenTelemetry collector: takes OTLP/HTTP JSON posts (``/v1/traces``) on a free
    port and keeps each span with its service's name."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        spans: list[dict] = []
        self.spans = spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the library's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                for resource in body["resourceSpans"]:
                    service = {a["key"]: a["value"]["stringValue"]
                               for a in resource["resource"]["attributes"]}["service.name"]
                    for scope in resource["scopeSpans"]:
                        spans.extend({**span, "service": service} for span in scope["spans"])
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def traces_across_all_three(self) -> list[dict]:
        """Per trace the proxy dispatched: its dispatch span, and prefill's and decode's spans
        that are its children."""
        out = []
        for d in [s for s in self.spans if s["name"] == "kvx.dispatch"]:
            kids = [s for s in self.spans if s["traceId"] == d["traceId"]
                    and s["parentSpanId"] == d["spanId"]]
            by_name = {s["name"]: s for s in kids}
            if "kvx.send" in by_name and "kvx.receive" in by_name:
                out.append({"dispatch": d, **by_name})
        return out


def metric(base: str, name: str, labels: str = "") -> float:
    status, body = http("GET", f"{base}/metrics")
    assert status == 200
    total = 0.0
    found = False
    for line in body.decode().splitlines():
        if line.startswith(name + "{") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"no metric {name}{{{labels}}}"
    return total


def metric_or_zero(base: str, name: str, labels: str = "") -> float:
    """`metric`, or 0 where no series of that name and labels exists yet (a labelled family
    shows a series only once it has counted something)."""
    status, body = http("GET", f"{base}/metrics")
    assert status == 200
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith(name + "{") and labels in line)


def prompt_sources(base: str) -> dict[str, float]:
    return {
        s: metric(base, "vllm:prompt_tokens_by_source_total", f'source="{s}"')
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got["prompt_tokens"] == want["prompt_tokens"], what
    assert got["tokens"] == want["tokens"], f"{what}: {got['tokens']} != {want['tokens']}"
    diffs = [abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)]
    assert max(diffs) <= LOGPROB_TOL, f"{what}: logprob differences {diffs}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvx-e2e")


@pytest.fixture(scope="module")
def model(workdir) -> Path:
    from tiny_model import build

    # Two KV heads: the CPU cache is moved token by token, heads one by one (see
    # kvx_vllm/layout.py).
    return build(workdir / "model", kv_heads=2)


@pytest.fixture(scope="module")
def reference(model, workdir) -> dict:
    """Greedy outputs of one plain vLLM instance (no connector), then stopped."""
    server, url = start_vllm("reference", model, workdir, prefix_caching=False)
    try:
        server.wait_ready()
        out = {n: complete(url, prompt(n)) for n in PROMPT_WORDS}
        out["long"] = complete(url, prompt(LONG_WORDS, salt=5))
        out["chat"] = chat_stream(url, prompt(30, salt=3))
        for name, text in shared_prefix_prompts().items():
            out[name] = complete(url, text)
    finally:
        server.kill()
    lengths = [out[n]["prompt_tokens"] for n in PROMPT_WORDS]
    assert lengths[0] < BLOCK < lengths[-1] and lengths[-1] > 6 * BLOCK, lengths
    assert out["long"]["prompt_tokens"] > 30 * BLOCK, out["long"]["prompt_tokens"]
    return out


def run_pair(mode: str, model: Path, workdir: Path, reference: dict, *, p_extra=None,
             d_extra=None, d_block=BLOCK, d_policy="fail", p_args=(), p_log=None, d_log=None,
             kvx_host="127.0.0.1", p_cores=P_CORES, p_tp=1, d_args=(), d_cores=D_CORES,
             executor="mp", proxy_env=None, d_prefix_caching=False):
    connector = "KvxPushConnector" if mode == "push" else "KvxPullConnector"
    kvx_port = free_port(p_tp)  # rank r of prefill listens on kvx_port + r
    p_cfg = kv_config(connector, "kv_producer", f"p-{mode}", listen=f"127.0.0.1:{kvx_port}",
                      **(p_extra or {}))
    d_cfg = kv_config(connector, "kv_consumer", f"d-{mode}", _policy=d_policy, **(d_extra or {}))
    p, p_url = start_vllm(f"prefill-{mode}", model, workdir, kv=p_cfg, cores=p_cores,
                          args_extra=p_args, kvx_log=p_log, executor=executor)
    d, d_url = start_vllm(f"decode-{mode}", model, workdir, kv=d_cfg,
                          prefix_caching=d_prefix_caching, block_size=d_block, cores=d_cores,
                          args_extra=d_args, kvx_log=d_log, executor=executor)
    proxy_port = free_port()
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    proxy = Server(
        f"proxy-{mode}",
        [str(KVX_BIN), "proxy", "--mode", mode, "--listen", f"127.0.0.1:{proxy_port}",
         "--prefill", f"{p_url}@{kvx_host}:{kvx_port}", "--decode", d_url],
        workdir, {**os.environ, **(proxy_env or {})}, f"{proxy_url}/health",
    )
    return p, p_url, d, d_url, proxy, proxy_url


def check_pair_matches_reference(mode, model, workdir, reference, transport=None, d_block=BLOCK,
                                 chunk=None, d_log_expect=None, kvx_host="127.0.0.1", p_tp=1,
                                 d_tp=1, d_log_absent=None, executor="mp", traced=False):
    """With `chunk`, prefill computes prompts in steps of that many tokens (chunked prefill),
    and push writes each step's finished blocks while the next step computes. With
    `d_log_expect`, decode logs kvx at debug level and that text must appear in its log (and
    `d_log_absent` must not).
    `kvx_host` names prefill's kvx address to the proxy (which hands it to decode in push).
    `p_tp`, `d_tp`: each side's tensor-parallel size. `executor`: vLLM's on both sides (`mp`,
    vLLM's default, or `uni`). With `traced`, the proxy, prefill and decode export their request
    spans to an OTLP receiver the test runs, and each request is followed across the three."""
    extra = {"transport": transport} if transport else {}
    otlp = OtlpReceiver() if traced else None
    if otlp is not None:
        extra["otlp_endpoint"] = otlp.endpoint
    p_args = ("--max-num-batched-tokens", str(chunk)) if chunk else ()
    p_cores = P_CORES
    if p_tp > 1:
        p_args += ("--tensor-parallel-size", str(p_tp))
        # Every rank on prefill's core (vLLM's `|`-separated binding per rank). Not one on
        # decode's: each instance is a session of its own, so the kernel's autogroups share a
        # core between instances by their load on it, and a rank beside decode's busy worker
        # got almost none of it (its step, and its kvx threads' answers to decode's
        # handshake, waited tens of seconds).
        p_cores = "|".join([P_CORES] * p_tp) if P_CORES else None
    d_args: tuple[str, ...] = ()
    d_cores = D_CORES
    if d_tp > 1:
        d_args = ("--tensor-parallel-size", str(d_tp))
        d_cores = "|".join([D_CORES] * d_tp) if D_CORES else None
    p_log = "kvx_vllm::producer=debug,kvx_vllm=info" if chunk else None
    p, p_url, d, d_url, proxy, proxy_url = run_pair(mode, model, workdir, reference,
                                                    p_extra=extra, d_extra=extra,
                                                    d_block=d_block, p_args=p_args, p_log=p_log,
                                                    d_log="kvx_vllm=debug" if d_log_expect else None,
                                                    kvx_host=kvx_host, p_cores=p_cores, p_tp=p_tp,
                                                    d_args=d_args, d_cores=d_cores,
                                                    executor=executor,
                                                    proxy_env={"OTEL_EXPORTER_OTLP_ENDPOINT":
                                                               otlp.endpoint} if otlp else None)
    with running(p, d, proxy):
        for s in (p, d, proxy):
            s.wait_ready()
        before = prompt_sources(d_url)
        # The proxy's own series, before: client requests that ended well, and their TTFT.
        ok_labels = f'mode="{mode}",outcome="ok"'
        proxy_before = (metric_or_zero(proxy_url, "kvx_proxy_requests_total", ok_labels),
                        metric_or_zero(proxy_url, "kvx_proxy_ttft_seconds_count",
                                       f'mode="{mode}"'))
        through_proxy = len(PROMPT_WORDS) + bool(chunk) + 1  # the prompts, the long one, a chat
        prompt_total = 0
        for n in PROMPT_WORDS:
            got = complete(proxy_url, prompt(n))
            assert_same(got, reference[n], f"{mode}, {got['prompt_tokens']}-token prompt")
            prompt_total += got["prompt_tokens"]
        if chunk:
            # A prompt of some 60 steps: decode registers while prefill still computes it, so
            # some of it is written early however quickly the shorter ones are computed.
            got = complete(proxy_url, prompt(LONG_WORDS, salt=5))
            assert_same(got, reference["long"], f"{mode}, {got['prompt_tokens']}-token prompt")
            prompt_total += got["prompt_tokens"]
        # vLLM may coalesce several tokens into one streamed delta when its output loop runs
        # behind (2 busy cores), so the text must match, not the chunking.
        pieces = chat_stream(proxy_url, prompt(30, salt=3))
        assert pieces, "the streamed chat completion carried no content"
        assert "".join(pieces) == "".join(reference["chat"])
        after = prompt_sources(d_url)
        delta = {k: after[k] - before[k] for k in after}
        chat_tokens = delta["external_kv_transfer"] - prompt_total
        # Decode computed none of the prompts itself: every prompt token came over kvx (the
        # last one is recomputed to sample from, which vLLM counts with the transferred ones).
        assert delta["local_compute"] == 0, delta
        assert delta["local_cache_hit"] == 0, delta
        assert chat_tokens > 0, delta
        # kvx's own counters on vLLM's /metrics (build_prom_metrics): the side that writes
        # (prefill in push, decode in pull) counted bytes, and nothing failed. The workers
        # report at most once a second, at an engine step.
        writer = p_url if mode == "push" else d_url
        deadline = time.monotonic() + 20
        while metric(writer, "vllm:kvx_bytes_written_total") == 0:
            assert time.monotonic() < deadline, "no kvx bytes on the writer's /metrics"
            complete(proxy_url, prompt(3, salt=7))
            through_proxy += 1
        assert metric(writer, "vllm:kvx_transfers_ok_total") > 0
        if mode == "push":
            # Each push transfer's time and bytes, observed into histograms.
            assert metric(p_url, "vllm:kvx_transfer_seconds_count") > 0
        # How long decode's requests waited for their KV.
        assert metric(d_url, "vllm:kvx_kv_wait_seconds_count") > 0
        for base in (p_url, d_url):
            assert metric(base, "vllm:kvx_transfers_failed_total") == 0, base
        # Every byte kvx moved is the KV of a prompt token decode took over kvx: the writer's
        # bytes are decode's tokens from kvx times a token's KV (2 layers, K and V, 2 heads of
        # 32 float32s), once both counters have settled.
        # And in push, each decode rank's request took one notice from each of its writers
        # (prefill ranks split the model's two heads among themselves, decode ranks read theirs):
        # prefill's delivered transfers, one per decode rank written, summed over its ranks,
        # are decode's delivered requests (one per rank) times the writers of a decode rank.
        # (Requests sent to an instance directly step it, so that it reports.)
        writers_per_rank = max(1, p_tp // d_tp)
        token_kv = 2 * 2 * 2 * 32 * 4
        deadline = time.monotonic() + 30
        while True:
            moved = metric(writer, "vllm:kvx_bytes_written_total")
            tokens = metric(d_url, "vllm:prompt_tokens_by_source_total",
                            'source="external_kv_transfer"')
            notices = (metric(p_url, "vllm:kvx_transfers_ok_total"),
                       metric(d_url, "vllm:kvx_transfers_ok_total") * writers_per_rank)
            if moved == tokens * token_kv and (mode != "push" or notices[0] == notices[1]):
                break
            assert time.monotonic() < deadline, (moved, tokens, token_kv, notices)
            time.sleep(1.2)
            for base in (p_url, d_url):
                http("POST", f"{base}/v1/completions",
                     {"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=60)
        # The proxy counted every client request it routed as answered well, with its TTFT,
        # and none as an error.
        proxy_after = (metric_or_zero(proxy_url, "kvx_proxy_requests_total", ok_labels),
                       metric_or_zero(proxy_url, "kvx_proxy_ttft_seconds_count",
                                      f'mode="{mode}"'))
        assert proxy_after[0] - proxy_before[0] == through_proxy, (proxy_before, proxy_after)
        assert proxy_after[1] - proxy_before[1] == through_proxy, (proxy_before, proxy_after)
        assert metric_or_zero(proxy_url, "kvx_proxy_requests_total", 'outcome="error"') == 0
        if otlp is not None:
            # One trace per request across the three processes: the proxy's dispatch span, and
            # prefill's and decode's spans as its children, with the request's steps.
            deadline = time.monotonic() + 20
            while len(otlp.traces_across_all_three()) < len(PROMPT_WORDS):
                assert time.monotonic() < deadline, (
                    f"{len(otlp.traces_across_all_three())} traces across proxy, prefill and "
                    f"decode; spans: {[(s['service'], s['name']) for s in otlp.spans][:20]}")
                time.sleep(0.2)
            for t in otlp.traces_across_all_three():
                assert t["dispatch"]["service"] == "kvx-proxy", t
                assert t["kvx.send"]["service"] == "kvx-prefill", t
                assert t["kvx.receive"]["service"] == "kvx-decode", t
                sent = {e["name"] for e in t["kvx.send"]["events"]}
                received = {e["name"] for e in t["kvx.receive"]["events"]}
                if mode == "push":
                    assert {"writes posted", "written", "released"} <= sent, sent
                    assert {"registered", "ready"} <= received, received
                else:
                    assert {"finished", "released"} <= sent, sent
                    assert {"reads posted", "ready"} <= received, received
        texts = {}
        for s, cores in ((p, p_cores), (d, d_cores)):
            text = texts[s.name] = s.log.read_text(errors="replace")
            assert "Traceback" not in text, s.tail()
            # OpenMP threads bound under either executor (use_uni_executor): no warning.
            assert UNBOUND_WARNING not in text, s.tail()
            names = process_names(s.proc.pid)
            assert "VLLM::EngineCor" in names, names
            workers = [n for n in names if n.startswith("VLLM::Worker")]
            assert bool(workers) == (executor == "mp"), names
            if cores is not None:
                # The processes that run the forward pass (the workers under mp, the engine
                # core under uni) are bound to the instance's cores, under either executor.
                bound = forward_affinity(s.proc.pid)
                assert bound == core_ids(cores), (executor, cores, bound)
        d_text = texts[d.name]
        # A push decode on CPU with vLLM's mp executor names the executor that spares a core
        # while requests wait; with uni, or with several ranks (uni runs one), it says nothing.
        hinted = UNI_HINT in d_text
        assert hinted == (mode == "push" and executor == "mp" and d_tp == 1), d.tail()
        if d_log_expect:
            assert d_log_expect in d_text, d.tail()
            assert not d_log_absent or d_log_absent not in d_text, d.tail()
        if chunk:
            # The long prompts' first chunks were written before their prefill finished, and
            # layer by layer within a step too: a write of one of the tiny model's two layers.
            early = [
                line
                for line in p.log.read_text(errors="replace").splitlines()
                if "early writes posted" in line
            ]
            assert early, p.tail()
            assert any("layers=1" in line for line in early), early[:10]
            # Each prompt's KV was sealed when the forward pass that computed its last token
            # ended (a one-token prefill on a host cache), before vLLM finished the request.
            # Decode may answer before prefill's producer hears of the last finish: wait for it.
            deadline = time.monotonic() + 20
            while True:
                p_lines = p.log.read_text(errors="replace").splitlines()
                sealed = sum("request sealed" in line for line in p_lines)
                finished = sum("request finished" in line for line in p_lines)
                if sealed == finished > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert sealed == finished > 0, (sealed, finished)


def test_push_matches_a_single_instance(model, workdir, reference):
    """Push through the proxy: same greedy tokens and logprobs as one instance, for prompts of
    one to ten blocks and a streamed chat completion; decode's own counters show that it
    computed no prompt token (all came over kvx). Decode uses blocks of 64 tokens against
    prefill's 32: the CPU cache is moved token by token. Prefill computes in 32-token steps
    (chunked prefill), and push writes the finished blocks of a long prompt while its next step
    computes (prefill's log shows those early writes), and seals each prompt's KV when the
    forward pass that computed its last token ends, before vLLM finishes the request. Where
    `shm` moves data by cross-memory attach, prefill writes each notice into decode's notice
    board, and decode's engine finds the requests ready there (its log says so). The proxy,
    prefill and decode export their request spans to an OTLP receiver: each request is one
    trace across the three."""
    from kvx_vllm import _native

    board = "ready (notice board)" if _native.shm_uses_cma() else None
    check_pair_matches_reference("push", model, workdir, reference, d_block=2 * BLOCK, chunk=32,
                                 d_log_expect=board, traced=True)


def test_decode_prefix_cache_hits_move_only_the_missing_blocks(model, workdir, reference):
    """Decode with prefix caching on: a request whose leading blocks decode already holds (a
    request before it shared them) registers only the rest (`skip_tokens`), prefill writes only
    those, and the answer is still a single instance's. vLLM's own counters show the second
    request's shared blocks as decode's cache hit and fewer tokens over kvx; prefill's kvx byte
    counter shows it moved fewer bytes."""
    p, p_url, d, d_url, proxy, proxy_url = run_pair("push", model, workdir, reference,
                                                    d_prefix_caching=True)
    prompts = shared_prefix_prompts()

    def settled_bytes() -> float:
        # The workers report at most once a second, at an engine step: a small request (not
        # through kvx) makes one, until the counter holds still.
        last = -1.0
        while True:
            now = metric(p_url, "vllm:kvx_bytes_written_total")
            if now == last:
                return now
            last = now
            time.sleep(1.2)
            http("POST", f"{p_url}/v1/completions",
                 {"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=60)

    with running(p, d, proxy):
        for s in (p, d, proxy):
            s.wait_ready()
        moved = {}
        sources = {}
        for name in ("shared-a", "shared-b"):
            bytes_before, before = settled_bytes(), prompt_sources(d_url)
            got = complete(proxy_url, prompts[name])
            assert_same(got, reference[name], name)
            after = prompt_sources(d_url)
            sources[name] = {k: after[k] - before[k] for k in after}
            moved[name] = settled_bytes() - bytes_before
        a, b = sources["shared-a"], sources["shared-b"]
        assert a["local_cache_hit"] == 0 and a["local_compute"] == 0, a
        # The shared prefix (whole blocks) is decode's own; only the rest came over kvx.
        assert b["local_cache_hit"] >= 8 * BLOCK, b
        assert b["local_compute"] == 0, b
        assert b["external_kv_transfer"] < a["external_kv_transfer"] - 7 * BLOCK, (a, b)
        assert 0 < moved["shared-b"] < moved["shared-a"] / 2, moved
        for base in (p_url, d_url):
            assert metric(base, "vllm:kvx_transfers_failed_total") == 0, base
        for s in (p, d):
            assert "Traceback" not in s.log.read_text(errors="replace"), s.tail()


def test_push_with_vllms_uni_executor_matches_a_single_instance(model, workdir, reference):
    """Push between instances whose worker runs in the engine core's process (vLLM's `uni`
    executor, docs/vllm.md): the connector's scheduler and worker sides share one process, and
    still the same tokens and logprobs as one instance, every prompt token over kvx; the engine
    core runs no worker process of its own."""
    check_pair_matches_reference("push", model, workdir, reference, executor="uni")


def test_pull_matches_a_single_instance(model, workdir, reference):
    """The same through pull mode (prefill first, decode reads), over the CMA transport (decode
    reads prefill's cache with process_vm_readv; push runs over the default libfabric shm), with
    decode's blocks three times prefill's (vLLM 0.32 refused 16-token blocks here:
    `MultipleOf(32)`). Traced like the push test: each request one trace across the three."""
    check_pair_matches_reference("pull", model, workdir, reference, transport="cma",
                                 d_block=3 * BLOCK, traced=True)


# vLLM's CPU MLA backend takes blocks of 16 tokens only (its decode kernel's), and turns
# chunked prefill and prefix caching off for MLA models.
MLA_BLOCK = 16


def run_mla_pair(mode: str, model: Path, workdir: Path, transport: str) -> dict:
    """The outputs of a prefill and a decode instance of the MLA model behind the proxy, for
    PROMPT_WORDS; checks that decode computed none of the prompts and waited for one writer."""
    extra = {"transport": transport}
    p, p_url, d, d_url, proxy, proxy_url = run_pair(
        mode, model, workdir, {}, p_extra=extra, d_extra=extra, d_block=MLA_BLOCK,
        p_args=("--block-size", str(MLA_BLOCK)), d_log="kvx_vllm=debug")
    with running(p, d, proxy):
        for s in (p, d, proxy):
            s.wait_ready()
        before = prompt_sources(d_url)
        out = {n: complete(proxy_url, prompt(n)) for n in PROMPT_WORDS}
        after = prompt_sources(d_url)
    delta = {k: after[k] - before[k] for k in after}
    assert delta["local_compute"] == 0, (mode, delta)
    assert delta["external_kv_transfer"] >= sum(o["prompt_tokens"] - 1 for o in out.values()), delta
    log = d.log.read_text()
    assert "writers=1" in log and "writers=2" not in log, "decode waits for one writer per request"
    return out


def test_an_mla_models_latent_cache_moves_push_and_pull_alike(workdir):
    """A DeepSeek-V2-style model (multi-head latent attention: each layer caches one 576-value
    latent vector per token; vLLM's CPU MLA backend, cache `[blocks, 1, 16, 576]` per layer):
    push over libfabric `shm` and pull over `cma` move every prompt's latent cache, decode
    computes none of the prompt tokens itself, and the two give identical outputs, token for
    token and log-probability for log-probability.

    Not compared with one instance: vLLM's CPU MLA computes a prompt's last token by its
    prefill path (SDPA over the expanded K and V) alone, and by its decode path (the absorbed
    `mla_decode_kvcache` kernel over the latent cache) when the earlier tokens' KV came from a
    connector, and the two differ here by 0.03 to 0.5 in log-probability within one instance
    too (docs/vllm.md, "MLA models"). The latent's bytes themselves are checked token by token
    in `test_native.py::test_an_mla_cache_moves_token_by_token`."""
    from tiny_model import build

    model = build(workdir / "mla-model", mla=True)
    push = run_mla_pair("push", model, workdir, "libfabric:shm")
    pull = run_mla_pair("pull", model, workdir, "cma")
    for n in PROMPT_WORDS:
        assert push[n]["prompt_tokens"] == pull[n]["prompt_tokens"]
        assert_same(pull[n], push[n], f"MLA pull against push, {push[n]['prompt_tokens']}-token prompt")


def test_push_from_a_two_rank_prefill_matches_a_single_instance(model, workdir, reference):
    """Prefill runs with tensor parallelism 2 (two worker processes; each rank holds one of the
    model's two KV heads and listens on its own kvx port, the `listen` port + its rank), decode
    with 1 (both heads): decode connects to both prefill ranks (learning the second from the
    first's hello), registers each request with both, and starts it once both ranks' notices
    arrived. Outputs match one instance, and decode computed no prompt token."""
    check_pair_matches_reference("push", model, workdir, reference, p_tp=2,
                                 d_log_expect="writers=2")


def test_pull_into_a_two_rank_decode_matches_a_single_instance(model, workdir, reference):
    """Decode runs with tensor parallelism 2 (each rank holds one KV head), prefill with 1
    (both heads): each decode rank reads its own head of every block from prefill's one rank
    and reports to its scheduler; the request starts once both ranks have. Outputs match one
    instance, and decode computed no prompt token."""
    check_pair_matches_reference("pull", model, workdir, reference, d_tp=2)


def test_pull_from_a_two_rank_prefill_matches_a_single_instance(model, workdir, reference):
    """Pull from a prefill running with tensor parallelism 2 into a decode with 1: prefill's
    `kv_transfer_params` name its rank 0, decode learns rank 1 from rank 0's hello, reads each
    rank's KV head of every block (decode's debug log: `writers=2`) and starts the request once
    both reads are done. Outputs match one instance, and decode computed no prompt token."""
    check_pair_matches_reference("pull", model, workdir, reference, p_tp=2,
                                 d_log_expect="writers=2")


def test_pull_between_two_rank_instances_matches_a_single_instance(model, workdir, reference):
    """Pull with tensor parallelism 2 on both sides (four worker processes): decode rank r reads
    from prefill rank r only (both hold the same KV head; decode's debug log: `writers=1`, never
    2), and the request starts once both decode ranks have reported it. Outputs match one
    instance, and decode computed no prompt token."""
    check_pair_matches_reference("pull", model, workdir, reference, p_tp=2, d_tp=2,
                                 d_log_expect="writers=1", d_log_absent="writers=2")


def test_push_into_a_two_rank_decode_matches_a_single_instance(model, workdir, reference):
    """Push into a decode running with tensor parallelism 2, prefill with 1: each decode rank
    registers its own head of every block with prefill's one rank, which writes each rank's
    head into that rank's cache and sends each its own notice; decode's scheduler starts the
    request once both ranks have reported it. Outputs match one instance, and decode computed
    no prompt token."""
    check_pair_matches_reference("push", model, workdir, reference, d_tp=2)


def test_push_between_two_rank_instances_matches_a_single_instance(model, workdir, reference):
    """Push with tensor parallelism 2 on both sides (four worker processes): decode rank r
    registers each request with prefill rank r only (both hold the same KV head; decode's debug
    log: `writers=1`, never 2), each prefill rank writes its head and notices its own decode
    rank, and the request starts once both decode ranks have reported it. Outputs match one
    instance, and decode computed no prompt token."""
    check_pair_matches_reference("push", model, workdir, reference, p_tp=2, d_tp=2,
                                 d_log_expect="writers=1", d_log_absent="writers=2")


def test_push_over_cma_finds_the_kv_ready_in_decodes_notice_board(model, workdir, reference):
    """Push over the CMA transport, one block size on both sides: prefill writes each request's
    notice into decode's notice board after its data, decode's engine finds the request ready
    there in its steps (its log says so) and sends the registrations itself; outputs match one
    instance, and decode computed no prompt token. The proxy names prefill's kvx address by
    host name (`localhost`): decode looks it up off its engine thread."""
    check_pair_matches_reference("push", model, workdir, reference, transport="cma",
                                 d_log_expect="ready (notice board)", kvx_host="localhost")


@pytest.fixture(scope="module")
def two_hosts():
    why = why_not()
    if why is not None:
        if os.environ.get("KVX_REQUIRE_NETNS") == "1":
            raise RuntimeError(f"two network namespaces are required (KVX_REQUIRE_NETNS=1): {why}")
        pytest.skip(f"cannot create network namespaces: {why}")
    hosts = TwoHosts()
    yield hosts
    hosts.close()


@pytest.mark.parametrize("mode,transport,d_block", [
    ("push", "libfabric:tcp", 64),
    ("pull", "libfabric:tcp", BLOCK),
    ("push", "nixl", BLOCK),
    ("pull", "nixl", 64),
])
def test_across_two_hosts_matches_a_single_instance(model, workdir, reference, two_hosts, mode,
                                                     transport, d_block):
    """Prefill on one host, decode and the proxy on another (two network namespaces joined by a
    veth pair): the same greedy tokens and logprobs as one instance, push and pull, over
    `libfabric:tcp` and NIXL (UCX over TCP), with decode's block size differing in some. No
    interface is named: each side's endpoint opens on the one the other reaches (the log says
    which), and nothing takes a same-host path (the control connection is TCP, the transport the
    one named). Every control connection is authenticated with the deployment's key, and every
    transfer carries the proxy's capability for this decode engine."""
    if transport.startswith("nixl") and not os.environ.get("KVX_NIXL_LIB_DIR"):
        pytest.skip("KVX_NIXL_LIB_DIR is unset (cargo xtask test sets it)")
    from two_hosts import ADDR_A

    connector = "KvxPushConnector" if mode == "push" else "KvxPullConnector"
    kvx_port = 7100
    # Prefill listens on the network: the deployment shares a key (docs/security.md).
    key = workdir / f"key-{mode}-{transport.replace(':', '-')}"
    key.unlink(missing_ok=True)
    subprocess.run([str(KVX_BIN), "keygen", str(key)], check=True, capture_output=True)
    p_cfg = kv_config(connector, "kv_producer", f"p2h-{mode}", listen=f"{ADDR_A}:{kvx_port}",
                      transport=transport, auth_key_file=str(key))
    # Decode connects only to the prefill host (`peers`), and only for a dispatch the proxy
    # granted it by name (`#ENGINE_ID`: its capabilities name this decode's engine).
    d_cfg = kv_config(connector, "kv_consumer", f"d2h-{mode}", transport=transport,
                      auth_key_file=str(key), peers=ADDR_A)
    tag = f"{mode}-{transport.replace(':', '-')}-2h"
    p, p_url = start_vllm(f"prefill-{tag}", model, workdir, kv=p_cfg, cores=P_CORES,
                          host=ADDR_A, netns=two_hosts.a)
    d, d_url = start_vllm(f"decode-{tag}", model, workdir, kv=d_cfg, prefix_caching=False,
                          block_size=d_block, cores=D_CORES, netns=two_hosts.b,
                          kvx_log="kvx_vllm=info,kvx_vllm::consumer::connect=debug")
    proxy_url = "http://127.0.0.1:7300"
    proxy = Server(
        f"proxy-{tag}",
        [str(KVX_BIN), "proxy", "--mode", mode, "--listen", "127.0.0.1:7300",
         "--prefill", f"{p_url}@{ADDR_A}:{kvx_port}", "--decode", f"{d_url}#d2h-{mode}",
         "--auth-key-file", str(key)],
        workdir, dict(os.environ), f"{proxy_url}/health", netns=two_hosts.b,
    )
    with running(p, d, proxy):
        for server in (p, d, proxy):
            server.wait_ready()
        with inside(two_hosts.b):
            before = prompt_sources(d_url)
            prompt_total = 0
            for n in PROMPT_WORDS:
                got = complete(proxy_url, prompt(n))
                assert_same(got, reference[n], f"{tag}, {got['prompt_tokens']}-token prompt")
                prompt_total += got["prompt_tokens"]
            after = prompt_sources(d_url)
        delta = {k: after[k] - before[k] for k in after}
        # Every prompt token came over kvx (the last one is recomputed to sample from).
        assert delta["local_compute"] == 0, delta
        assert delta["external_kv_transfer"] == prompt_total, delta
        for server, addr in ((p, ADDR_A), (d, "10.231.0.2")):
            text = server.log.read_text(errors="replace")
            assert "Traceback" not in text, server.tail()
            chosen = [line for line in text.splitlines() if "tcp endpoint interface chosen" in line]
            assert chosen, server.tail()
            assert all("interface=kp" in c and addr in c for c in chosen), chosen
        # Decode's control connections crossed the link: none is a same-host Unix socket.
        connected = [line for line in d.log.read_text(errors="replace").splitlines()
                     if "connected to a producer rank" in line]
        assert connected and all("local=false" in c for c in connected), connected


def test_failures_never_hang_and_never_leak(model, workdir, reference):
    """With one push prefill and three decodes:
    1. decode `f` describes its cache block by block (`layout = block`) with blocks of 64 tokens
       against prefill's token-exact 32: kvx refuses the pairing at the handshake, decode's
       `recompute` policy recomputes — and the answer is still exact, never decoded on garbage;
    2. a prefill whose decode never registers (an aborted or lost decode request), and one whose
       decode (`k`) was killed after registering (seen in its log), both give their blocks back
       after the producer lease (prefill's KV-cache usage returns to zero). Before it is killed,
       `k` (vLLM's default `fail` policy) is sent a request whose prefill address has nobody
       listening: the request ends at once with an error (HTTP 500), decoded on nothing, and
       `k` keeps no block. A client that gives up on a request that `w` waits for gets its
       blocks back at once. After `k` was killed, prefill aborts a long request halfway
       through computing it (vLLM's abort API), after some of its KV was written into `w`
       early (its first writes to `w`): `w` hears at once, not at its lease, and recomputes,
       exactly. A request dropped while queued on `w` (never registered) has prefill give its
       KV back at once, not at the lease; so does a request whose only decode does not answer
       connections (the proxy gives the dispatch up and tells prefill, as a router). A
       decode stopped mid-stream costs a client of the proxy its silence bound, and its blocks
       come back once it runs again;
    3. prefill is killed while decode `w` waits for a request's KV: `w` fails the load at once
       and recomputes, exactly, instead of hanging; a client of the proxy gets an error naming
       prefill."""
    kvx_port = free_port()
    lease = 4.0
    p_cfg = kv_config("KvxPushConnector", "kv_producer", "p-f", listen=f"127.0.0.1:{kvx_port}",
                      producer_lease_s=lease)
    d_cfg = kv_config("KvxPushConnector", "kv_consumer", "d-f", _policy="recompute",
                      layout="block")
    # Chunked prefill, 32 tokens a step: a long prompt is written early, step by step. The
    # scale-out endpoints include vLLM's abort API (step 2d).
    # Prefix caching off: step 2d may send the same prompt again and must compute it again.
    p, p_url = start_vllm("prefill-f", model, workdir, kv=p_cfg, cores=P_CORES,
                          prefix_caching=False,
                          args_extra=("--max-num-batched-tokens", "32", "--enable-scale-out"),
                          kvx_log="kvx_vllm::producer=debug,kvx_vllm=info")
    d, d_url = start_vllm("decode-f", model, workdir, kv=d_cfg, prefix_caching=False,
                          block_size=2 * BLOCK, cores=D_CORES)
    dk, dk_url = start_vllm("decode-k", model, workdir, prefix_caching=False, cores=D_CORES,
                            kv=kv_config("KvxPushConnector", "kv_consumer", "d-k"),
                            kvx_log="kvx_vllm=debug")
    # One request at a time, and vLLM's abort API: step 2f holds a request in its queue.
    dw, dw_url = start_vllm("decode-w", model, workdir, prefix_caching=False, cores=D_CORES,
                            kv=kv_config("KvxPushConnector", "kv_consumer", "d-w",
                                         _policy="recompute"),
                            args_extra=("--max-num-seqs", "1", "--enable-scale-out"),
                            kvx_log="kvx_vllm=debug")
    proxy_port = free_port()
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    proxy = Server("proxy-f",
                   [str(KVX_BIN), "proxy", "--mode", "push", "--listen",
                    f"127.0.0.1:{proxy_port}", "--prefill", f"{p_url}@127.0.0.1:{kvx_port}",
                    "--decode", d_url], workdir, dict(os.environ), f"{proxy_url}/health")
    servers = [p, d, dk, dw, proxy]
    sockets: list[socket.socket] = []

    def usage() -> float:
        return metric(p_url, "vllm:kv_cache_usage_perc")

    def push_proxy(name: str, decode: str, *extra: str) -> tuple[Server, int]:
        """Another `kvx proxy --mode push` in front of prefill and `decode`, ready; returns it
        and its port."""
        port = free_port()
        server = Server(name,
                        [str(KVX_BIN), "proxy", "--mode", "push", "--listen", f"127.0.0.1:{port}",
                         "--prefill", f"{p_url}@127.0.0.1:{kvx_port}", "--decode", decode, *extra],
                        workdir, dict(os.environ), f"http://127.0.0.1:{port}/health")
        servers.append(server)
        server.wait_ready()
        return server, port

    def wait_usage_zero(what: str, limit: float) -> float:
        t0 = time.monotonic()
        while usage() > 0:
            assert time.monotonic() - t0 < limit, f"{what}: prefill still holds blocks"
            time.sleep(0.25)
        return time.monotonic() - t0

    def count(server: Server, text: str) -> int:
        return server.log.read_text(errors="replace").count(text)

    def registrations(server: Server) -> int:
        return count(server, "registered")

    def send_waiting(base: str, body: dict, results: list) -> threading.Thread:
        def run():
            try:
                results.append(http("POST", f"{base}/v1/completions", body, timeout=90))
            except OSError as e:  # the server was killed under the request
                results.append((None, repr(e).encode()))
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def answered_exactly(waiting: threading.Thread, answers: list, want: dict, what: str) -> float:
        """Waits for a request sent with `send_waiting`: it must be answered, exactly as `want`.
        Returns how long it took."""
        t0 = time.monotonic()
        waiting.join(timeout=60)
        assert answers, f"decode hung: {what}"
        status, raw = answers[0]
        assert status == 200, raw
        out = json.loads(raw)
        choice = out["choices"][0]
        assert_same({"tokens": choice["logprobs"]["tokens"],
                     "logprobs": choice["logprobs"]["token_logprobs"],
                     "prompt_tokens": out["usage"]["prompt_tokens"]}, want, what)
        return time.monotonic() - t0

    def wait_registered(server: Server, before: int) -> None:
        t0 = time.monotonic()
        while registrations(server) <= before:
            assert time.monotonic() - t0 < 60, f"{server.name} never registered"
            time.sleep(0.1)

    def remote(text: str, transfer_id: str, max_tokens: int, prefill_port: int = kvx_port) -> dict:
        return {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                "logprobs": 1, "ignore_eos": True,
                "kv_transfer_params": {"do_remote_prefill": True, "kvx_transfer_id": transfer_id,
                                       "kvx_prefill": f"127.0.0.1:{prefill_port}"}}

    def prefill_leg(text: str, transfer_id: str, **extra) -> dict:
        """Prefill's half of a push request: one token, its KV kept for `transfer_id`."""
        return {"model": "tiny", "prompt": text, "max_tokens": 1, "temperature": 0, **extra,
                "kv_transfer_params": {"do_remote_decode": True, "kvx_transfer_id": transfer_id}}

    try:
        for s in servers:
            s.wait_ready()
        # 1. Layouts that cannot be paired: recomputed on decode, still exact.
        n = PROMPT_WORDS[2]
        before = prompt_sources(d_url)
        got = complete(proxy_url, prompt(n))
        assert_same(got, reference[n], "refused layout pairing, recompute policy")
        after = prompt_sources(d_url)
        assert after["local_compute"] - before["local_compute"] >= got["prompt_tokens"] - 1
        assert "refusing consumer" in p.log.read_text(errors="replace") or \
            "incompatible" in d.log.read_text(errors="replace"), d.tail()
        wait_usage_zero("after the refused transfer", lease + 10)

        # 2a. Prefill finishes, decode never registers (its request was aborted or lost).
        status, _ = http("POST", f"{p_url}/v1/completions",
                         prefill_leg(prompt(PROMPT_WORDS[3]), "orphan-1"))
        assert status == 200
        assert usage() > 0, "prefill should hold the finished request's blocks"
        waited = wait_usage_zero("orphaned request", lease + 10)
        assert waited >= lease * 0.5, f"released after {waited:.1f}s, before the lease"

        # 2b. Under vLLM's default `fail` policy (decode `k`), a load that fails (here: no
        # prefill listens at the address the request names) ends the request with an error,
        # at once: no token decoded on a cache that never arrived, no block kept.
        nobody = free_port()
        t0 = time.monotonic()
        status, raw = http("POST", f"{dk_url}/v1/completions",
                           remote(prompt(PROMPT_WORDS[2], salt=3), "unserved-1", 4, nobody),
                           timeout=60)
        assert status == 500, (status, raw)
        assert b"choices" not in raw, raw
        assert time.monotonic() - t0 < 15, f"the failed load took {time.monotonic() - t0:.1f}s"
        assert f"127.0.0.1:{nobody}" in dk.log.read_text(errors="replace"), dk.tail()
        t0 = time.monotonic()
        while metric(dk_url, "vllm:kv_cache_usage_perc") > 0:
            assert time.monotonic() - t0 < 20, "decode kept the failed request's blocks"
            time.sleep(0.25)
        # ... and decode's /metrics counts it by its cause (the workers report at most once a
        # second, at an engine step: a request moves one along).
        t0 = time.monotonic()
        while True:
            try:
                failed = metric(dk_url, "vllm:kvx_requests_failed_total", 'cause="peer_failed"')
            except AssertionError:
                failed = 0
            if failed >= 1:
                break
            assert time.monotonic() - t0 < 20, "no failure by cause on decode's /metrics"
            http("POST", f"{dk_url}/v1/completions",
                 {"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=60)

        # 2c. Decode registers, is killed, then prefill finishes: prefill's writes to the dead
        # decode fail at once (not at `transfer_timeout`), and its blocks come back.
        text = prompt(PROMPT_WORDS[3], salt=1)
        seen = registrations(dk)
        send_waiting(dk_url, remote(text, "dead-1", 4), [])
        wait_registered(dk, seen)
        dk.kill(signal.SIGKILL)
        status, _ = http("POST", f"{p_url}/v1/completions", prefill_leg(text, "dead-1"))
        assert status == 200
        wait_usage_zero("killed decode", lease + 10)

        # 2d. Prefill aborts a request while computing it (vLLM's abort API), after `w`
        # registered for it and the first steps' KV was written into `w` early: prefill tells
        # `w` once those writes have ended, `w` fails the load at once (not at its 120 s
        # lease) and recomputes every prompt token, exactly: nothing decoded on a half-written
        # cache. These are prefill's first writes to `w`, after its writes to the killed `k`
        # failed (2c): over `shm` the transport keeps the contexts of writes to a dead peer, so
        # neither those nor these wait for `transfer_timeout` (30 s). The whole prompt
        # computes in about 200 ms here, and the abort goes through prefill's API server: when
        # it comes too late (prefill finished, the KV went to `w`, whose answer is just as
        # exact), the step is run again, up to three times.
        for attempt in range(1, 4):
            seen = registrations(dw)
            failures = count(dw, "producer reported failure")
            answers = []
            waiting = send_waiting(dw_url, remote(prompt(LONG_WORDS, salt=5), f"p-abort-{attempt}",
                                                  MAX_TOKENS), answers)
            wait_registered(dw, seen)
            half = prefill_leg(prompt(LONG_WORDS, salt=5), f"p-abort-{attempt}")
            client = HTTPConnection("127.0.0.1", int(p_url.rsplit(":", 1)[1]), timeout=30)
            # Prefill's log is followed from here on (only what it adds is read): the abort
            # must come while the prompt still computes.
            with open(p.log, "rb") as log:
                log.seek(0, os.SEEK_END)
                client.request("POST", "/v1/completions", json.dumps(half),
                               {"content-type": "application/json",
                                "X-Request-Id": f"p-abort-leg-{attempt}"})
                t0 = time.monotonic()
                tail = b""
                while b"early writes posted" not in tail:
                    assert time.monotonic() - t0 < 60, "prefill wrote nothing early"
                    time.sleep(0.002)
                    tail = tail[-64:] + log.read()
            # vLLM's own abort (what its API server does when a client goes away; a closed
            # client is noticed only when the server next writes to it, which a prefill leg
            # does once done), by the request's id: "cmpl-" + X-Request-Id + "-" + prompt index.
            status, raw = http("POST", f"{p_url}/inference/v1/abort_requests",
                               {"request_ids": [f"cmpl-p-abort-leg-{attempt}-0"]})
            assert status == 200, (status, raw)
            client.close()
            took = answered_exactly(waiting, answers, reference["long"],
                                    "prefill aborted halfway, recompute policy")
            aborted = [line.split("transfer=")[1].split()[0]
                       for line in p.log.read_text(errors="replace").splitlines()
                       if "the engine aborted the request" in line]
            told = [line for line in dw.log.read_text(errors="replace").splitlines()
                    if "producer reported failure" in line][failures:]
            if any(f"key={a}/" in line and "reason=Aborted" in line
                   for a in aborted for line in told):
                break
            print(f"2d, attempt {attempt}: the abort came after prefill finished", file=sys.stderr)
        else:
            raise AssertionError(f"prefill's abort never reached decode: {aborted} {told}")
        assert took < 20, f"the abort reached decode after {took:.1f}s"
        wait_usage_zero("prefill's aborted request", lease + 10)

        # 2e. A client gives up on a decode request that waits for its KV (prefill never
        # serves it): vLLM aborts the request, kvx cancels the wait, and decode's blocks
        # come back without waiting for the lease.
        seen = registrations(dw)
        abandoned = remote(prompt(PROMPT_WORDS[2], salt=2), "abandoned-1", MAX_TOKENS)
        abandoned["stream"] = True
        client = HTTPConnection("127.0.0.1", int(dw_url.rsplit(":", 1)[1]), timeout=30)
        client.request("POST", "/v1/completions", json.dumps(abandoned),
                       {"content-type": "application/json"})
        wait_registered(dw, seen)
        # The gauge follows the engine's steps: it shows the held blocks a little later.
        t0 = time.monotonic()
        while metric(dw_url, "vllm:kv_cache_usage_perc") <= 0:
            assert time.monotonic() - t0 < 20, "decode holds no blocks for the waiting request"
            time.sleep(0.1)
        client.close()
        t0 = time.monotonic()
        while metric(dw_url, "vllm:kv_cache_usage_perc") > 0:
            assert time.monotonic() - t0 < 20, "decode kept the aborted request's blocks"
            time.sleep(0.25)

        # 2f. A decode request dropped while queued (never allocated, so never registered):
        # prefill finishes a request's prefill leg and holds its KV; `w` runs a local request,
        # the only one it may (`--max-num-seqs 1`), while the push request waits behind it;
        # vLLM's abort API drops the queued request. `w` tells prefill, which gives the KV back
        # at once, as aborted (its lease would say `lease_expired`), without a registration.
        def post(url: str, body: dict, request_id: str) -> HTTPConnection:
            c = HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=60)
            c.request("POST", "/v1/completions", json.dumps(body),
                      {"content-type": "application/json", "X-Request-Id": request_id})
            return c

        def dw_gauge_reaches(name: str, value: float, what: str) -> None:
            t0 = time.monotonic()
            while metric(dw_url, name) < value:
                assert time.monotonic() - t0 < 30, what
                time.sleep(0.01)

        text = prompt(PROMPT_WORDS[1], salt=6)
        seen = registrations(dw)
        leg = post(p_url, prefill_leg(text, "queued-1"), "pq-1")
        assert leg.getresponse().status == 200
        leg.close()
        occupying = post(dw_url, {"model": "tiny", "prompt": prompt(20), "max_tokens": 1900,
                                  "temperature": 0, "ignore_eos": True}, "occupy-1")
        dw_gauge_reaches("vllm:num_requests_running", 1, "decode never ran the local request")
        queued = post(dw_url, remote(text, "queued-1", 4), "queued-1")
        dw_gauge_reaches("vllm:num_requests_waiting", 1, "the push request never queued")
        status, raw = http("POST", f"{dw_url}/inference/v1/abort_requests",
                           {"request_ids": ["cmpl-queued-1-0", "cmpl-occupy-1-0"]})
        assert status == 200, (status, raw)
        wait_usage_zero("a request dropped while queued on decode", lease + 10)
        assert registrations(dw) == seen, "the dropped request registered after all"
        assert "told prefill: dropped before registration" in \
            dw.log.read_text(errors="replace"), dw.tail()
        freed = [line for line in p.log.read_text(errors="replace").splitlines()
                 if "KV of cmpl-pq-1-0" in line]
        assert freed and "not delivered (aborted)" in freed[-1], (freed, p.tail())
        queued.close()
        occupying.close()

        # 2g. A proxy whose only decode does not answer connections (a listener with a full
        # backlog drops the SYNs): the prefill leg finishes while the decode leg's connection
        # waits for its 3 s bound (prefill takes well under a second here; the 4 s lease runs
        # from its finish); the proxy gives the dispatch up (503) and tells prefill, as a
        # router, to give that transfer's KV back: freed as aborted, where the lease would say
        # `lease_expired`.
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        filler = socket.create_connection(silent.getsockname(), timeout=5)
        silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        sockets = [filler, silent]
        proxy_g, port_g = push_proxy("proxy-g", silent_url, "--connect-timeout-s", "3")

        def routed_kv_freed() -> list[str]:
            return [line for line in p.log.read_text(errors="replace").splitlines()
                    if "KV of cmpl-kvx-" in line]
        freed_before = len(routed_kv_freed())
        status, raw = http("POST", f"http://127.0.0.1:{port_g}/v1/completions",
                           {"model": "tiny", "prompt": prompt(PROMPT_WORDS[1], salt=7),
                            "max_tokens": 4}, timeout=60)
        assert status == 503, (status, raw)
        wait_usage_zero("a dispatch given up by the proxy", lease + 10)
        freed = routed_kv_freed()[freed_before:]
        assert len(freed) == 1 and "not delivered (aborted)" in freed[0], \
            (freed, p.tail(), proxy_g.tail())
        proxy_g.kill()

        # 2h. A decode that stops mid-stream (its processes stopped: a hung host): a proxy
        # with a 2 s silence bound ends the client's stream with an error event about 2 s
        # after decode's last piece, instead of at its 600 s request timeout, and closes
        # decode's connection; once decode runs again, vLLM notices the closed connection and
        # aborts the request, and decode's blocks come back.
        proxy_h, port_h = push_proxy("proxy-h", dw_url, "--stream-idle-timeout-s", "2")
        c = HTTPConnection("127.0.0.1", port_h, timeout=60)
        c.request("POST", "/v1/completions",
                  json.dumps({"model": "tiny", "prompt": prompt(20), "max_tokens": 1900,
                              "temperature": 0, "ignore_eos": True, "stream": True}),
                  {"content-type": "application/json"})
        r = c.getresponse()
        assert r.status == 200, r.read()
        streamed = 0
        while streamed < 3:
            line = r.readline()
            assert line, "the stream ended before decode was stopped"
            streamed += line.startswith(b"data: ")
        os.killpg(dw.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            rest = r.read()
        finally:
            os.killpg(dw.proc.pid, signal.SIGCONT)
        took = time.monotonic() - t0
        c.close()
        events = [e.strip() for e in rest.split(b"\n\n") if e.strip().startswith(b"data: ")]
        assert events and b"decode sent nothing for 2 s" in events[-1], rest[-400:]
        assert 1.5 < took < 10, f"the stream ended {took:.1f}s after decode stopped"
        t0 = time.monotonic()
        while metric(dw_url, "vllm:kv_cache_usage_perc") > 0:
            assert time.monotonic() - t0 < 30, "decode kept the blocks of the cut stream"
            time.sleep(0.25)
        proxy_h.kill()

        # 3. Prefill killed while decode w waits: w's load fails at once and it recomputes.
        n = PROMPT_WORDS[1]
        seen = registrations(dw)
        answers: list = []
        waiting = send_waiting(dw_url, remote(prompt(n), "orphan-2", MAX_TOKENS), answers)
        wait_registered(dw, seen)
        p.kill(signal.SIGKILL)
        took = answered_exactly(waiting, answers, reference[n],
                                "prefill killed while decode waited, recompute policy")
        assert took < 30, f"decode answered {took:.1f}s after prefill was killed"
        # Through the proxy, the client hears that prefill is down.
        status, err = http("POST", f"{proxy_url}/v1/completions",
                           {"model": "tiny", "prompt": prompt(20), "max_tokens": 4}, timeout=60)
        assert status in (502, 503), (status, err)
        assert b"prefill" in err, err
    except Exception:
        for s in servers:
            print(f"--- {s.name} ---\n{s.tail(40)}", file=sys.stderr)
        raise
    finally:
        for s in reversed(servers):
            s.kill()
        for sock in sockets:
            sock.close()


HYBRID_WINDOW = 64


def test_a_hybrid_models_groups_move_push_and_pull_and_match_a_single_instance(workdir):
    """A model whose layers alternate a 64-token sliding window and full attention: vLLM's
    hybrid KV cache manager keeps two KV cache groups, each layer of one sharing its cache
    tensor with a layer of the other, and holds only the window's blocks of the sliding group.
    Push and pull through the proxy give the greedy tokens and logprobs of one instance, decode
    computes none of the prompt tokens itself, and the writer's bytes are exactly the full
    group's tokens plus the window group's tokens from the first block both sides keep of it
    (decode blocks of 64 tokens against prefill's 32)."""
    from tiny_model import build

    model = build(workdir / "hybrid-model", kv_heads=2, window=HYBRID_WINDOW)
    server, url = start_vllm("reference-hybrid", model, workdir, prefix_caching=False)
    try:
        server.wait_ready()
        want = {n: complete(url, prompt(n)) for n in PROMPT_WORDS}
    finally:
        server.kill()
    # Per token and group: two cache tensors (each holds a layer of both groups), K and V,
    # two heads of 32 float32s.
    token_kv = 2 * 2 * 2 * 32 * 4
    for mode in ("push", "pull"):
        p, p_url, d, d_url, proxy, proxy_url = run_pair(mode, model, workdir, {},
                                                        d_block=2 * BLOCK)
        writer = p_url if mode == "push" else d_url
        with running(p, d, proxy):
            for s in (p, d, proxy):
                s.wait_ready()
            before = prompt_sources(d_url)
            moved_before = metric_or_zero(writer, "vllm:kvx_bytes_written_total")
            expected = 0
            for n in PROMPT_WORDS:
                got = complete(proxy_url, prompt(n))
                assert_same(got, want[n], f"hybrid {mode}, {got['prompt_tokens']}-token prompt")
                tokens = got["prompt_tokens"]
                # vLLM keeps the window group's blocks from token N - W + 1 on each side (in
                # blocks of 32 tokens on prefill, 64 on decode); kvx moves what both keep.
                window_from = max(0, tokens - HYBRID_WINDOW + 1)
                kept_from = max(window_from // BLOCK * BLOCK,
                                window_from // (2 * BLOCK) * 2 * BLOCK)
                expected += token_kv * (2 * tokens - kept_from)
            after = prompt_sources(d_url)
            delta = {k: after[k] - before[k] for k in after}
            assert delta["local_compute"] == 0, (mode, delta)
            assert delta["external_kv_transfer"] == sum(
                want[n]["prompt_tokens"] for n in PROMPT_WORDS), (mode, delta)
            # The workers report their counters at most once a second, at an engine step.
            deadline = time.monotonic() + 30
            while True:
                moved = metric_or_zero(writer, "vllm:kvx_bytes_written_total") - moved_before
                if moved == expected:
                    break
                assert time.monotonic() < deadline and moved < expected, (mode, moved, expected)
                time.sleep(1.2)
                http("POST", f"{writer}/v1/completions",
                     {"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=60)
            for base in (p_url, d_url):
                assert metric(base, "vllm:kvx_transfers_failed_total") == 0, (mode, base)
            for s in (p, d):
                text = s.log.read_text(errors="replace")
                assert "Traceback" not in text, s.tail()
                assert "2 KV cache groups" in text, s.tail()
