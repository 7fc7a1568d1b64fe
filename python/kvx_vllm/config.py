"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Every key has a default that works on one machine; ``docs/vllm.md`` lists them too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# key: (default, meaning) — the single source of the documented defaults.
KEYS: dict[str, tuple[Any, str]] = {
    "listen": (
        "127.0.0.1:7100",
        "Prefill: this instance's kvx control address HOST:PORT (rank r listens on PORT + r); "
        "the KVX_ADDR given to `kvx proxy --prefill URL@KVX_ADDR`. Unused on decode.",
    ),
    "transport": (
        "auto",
        "Data transport: auto (cuda-ipc on the KV cache's own GPU for a CUDA cache, "
        "libfabric:shm for a host cache: both for one machine), libfabric:shm, libfabric:tcp, "
        "libfabric:efa, libfabric:auto, cma (host memory between processes of one host, "
        "one-sided), cuda-ipc[:DEVICE] (CUDA KV caches of processes on one host; without DEVICE "
        "the cache's own GPU), or loopback (one process only; tests). A libfabric name may end "
        "in ,rails=N.",
    ),
    "layout": (
        "auto",
        "How the KV cache is described to kvx: auto or exact (token by token: vLLM's CPU "
        "backend's cache and FlashAttention's), or block (the CPU cache block by block, which "
        "needs equal block sizes on both sides).",
    ),
    "stream": (
        True,
        "Prefill, push: write a request's KV computed so far while the rest is still being "
        "computed (chunked prefill: each step's finished blocks go to a registered decode during "
        "the next step; with a host cache also layer by layer within a step, as vLLM saves each "
        "layer), so that only the last chunk's last layer is left when the request finishes.",
    ),
    "seal": (
        True,
        "Prefill, push, host cache: when the forward pass that computes a one-token prefill's "
        "last prompt token ends, write what is left of its KV and tell decode at once, instead "
        "of after vLLM has finished the request (an engine iteration later). Needs stream.",
    ),
    "registration_lease_s": (
        120.0,
        "Decode: how long a request may wait for its KV from registration before it fails.",
    ),
    "producer_lease_s": (
        30.0,
        "Prefill: how long finished blocks wait for decode's registration (push) or read (pull) "
        "before they are freed.",
    ),
    "heartbeat_interval_s": (5.0, "Decode: heartbeat period for the transfers it waits for; "
                             "prefill drops a registration after three periods without one."),
    "connect_timeout_s": (
        30.0,
        "Bound on looking up a peer's host name, on connecting to its control address and on "
        "its handshake answer. Generous "
        "because vLLM's CPU workers pin themselves (and so the connector's threads) to few cores, "
        "and an engine busy with its first forward pass answers late.",
    ),
    "transfer_timeout_s": (
        60.0,
        "Prefill: how long one started transfer may run (decode learns it at the handshake: "
        "see quiesce_timeout_s).",
    ),
    "quiesce_timeout_s": (
        None,
        "Decode: after a request fails or is aborted, how long its blocks stay held at most "
        "for every prefill rank to confirm that it writes no more (a posted write cannot be "
        "recalled); the failure is reported to vLLM when all have, or after this. Unset (the "
        "default): as long as the slowest of those prefill ranks says its writes can run (its "
        "transfer_timeout_s, sent when it connects) plus 2 s.",
    ),
    "idle_wait_ms": (
        2.0,
        "When vLLM runs an engine step with nothing to compute while a transfer of this "
        "instance can end (decode: requests wait for their KV; prefill: blocks are held for a "
        "decode), the worker waits up to this long for one to end before the step returns, "
        "and returns as soon as one does. vLLM otherwise repeats such steps about every "
        "millisecond, and its engine and worker processes spin through them. 0: return at once.",
    ),
    "max_entries": (65536, "Most requests held or waited for on one side."),
    "log": (
        "warn",
        "Filter for kvx's own logs on standard error (RUST_LOG syntax, e.g. kvx_vllm=debug); "
        "the environment variable KVX_LOG overrides it.",
    ),
}


@dataclass(frozen=True)
class KvxConfig:
    listen: str
    transport: str
    layout: str
    stream: bool
    seal: bool
    registration_lease_s: float
    producer_lease_s: float
    heartbeat_interval_s: float
    connect_timeout_s: float
    transfer_timeout_s: float
    quiesce_timeout_s: float | None
    idle_wait_ms: float
    max_entries: int
    log: str
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KvxConfig:
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k not in KEYS)
        if unknown:
            raise ValueError(
                f"unknown kvx extra-config key(s) {unknown}; known: {sorted(KEYS)}"
            )
        values: dict[str, Any] = {}
        for key, (default, _) in KEYS.items():
            raw = extra.get(key, default)
            if isinstance(default, bool):
                values[key] = _parse_bool(key, raw)
            elif default is None:
                values[key] = None if raw is None else float(raw)
            else:
                values[key] = type(default)(raw)
        if values["layout"] not in ("auto", "exact", "block"):
            raise ValueError(f"kvx layout must be auto, exact or block, not {values['layout']!r}")
        if not 0.0 <= values["idle_wait_ms"] <= 100.0:
            # Such a step also holds back requests that come meanwhile: keep it short.
            raise ValueError(
                f"kvx idle_wait_ms must be between 0 and 100, not {values['idle_wait_ms']!r}"
            )
        host, sep, port = values["listen"].rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"kvx listen must be HOST:PORT, not {values['listen']!r}")
        values["log"] = os.environ.get("KVX_LOG", values["log"])
        return cls(extra=extra, **values)

    def rank_listen(self, rank: int) -> str:
        """The control address of tensor-parallel rank ``rank``."""
        host, _, port = self.listen.rpartition(":")
        return f"{host}:{int(port) + rank if int(port) else 0}"

    def timings(self) -> dict[str, float]:
        return {
            "registration_lease": self.registration_lease_s,
            "producer_lease": self.producer_lease_s,
            "heartbeat_interval": self.heartbeat_interval_s,
            "connect_timeout": self.connect_timeout_s,
            "transfer_timeout": self.transfer_timeout_s,
        } | (
            {} if self.quiesce_timeout_s is None else {"quiesce_timeout": self.quiesce_timeout_s}
        )


def resolve_transport(setting: str, cuda_device: int | None) -> str:
    """The transport to open for a KV cache in host memory (``cuda_device`` None) or on CUDA
    device ``cuda_device``, from the ``transport`` setting: ``auto`` follows the cache,
    ``cuda-ipc`` without a device takes the cache's, and a setting that cannot move the cache's
    memory (a host transport for a CUDA cache, ``cuda-ipc`` for a host cache, or ``cuda-ipc:N``
    for a cache on another GPU) is refused with the fix in the message."""
    fix = " (kv_connector_extra_config key 'transport'; 'auto' follows the cache)"
    if setting == "auto":
        return "libfabric:shm" if cuda_device is None else f"cuda-ipc:{cuda_device}"
    if setting == "cuda-ipc" or setting.startswith("cuda-ipc:"):
        if cuda_device is None:
            raise ValueError(
                f"kvx: the KV cache is in host memory but the transport is {setting!r}, which "
                f"moves CUDA memory; use a host transport such as libfabric:shm" + fix
            )
        named = setting.partition(":")[2]
        if named and named != str(cuda_device):
            raise ValueError(
                f"kvx: the KV cache is on CUDA device {cuda_device} but the transport is "
                f"{setting!r}; use cuda-ipc:{cuda_device} or cuda-ipc" + fix
            )
        return f"cuda-ipc:{cuda_device}"
    if cuda_device is not None:
        raise ValueError(
            f"kvx: the KV cache is on CUDA device {cuda_device} but the transport {setting!r} "
            f"moves host memory; use cuda-ipc" + fix
        )
    return setting


def _parse_bool(key: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"kvx {key} must be true or false, not {raw!r}")
