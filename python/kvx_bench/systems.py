"""The vLLM sweep's systems (the connectors it compares, and the A/B variants of kvx push),
vLLM's executor on their instances, and the sweep's log line. Importing it puts python/tests on
`sys.path`: the sweep starts instances with the end-to-end tests' helpers (`test_e2e_vllm`) and
builds their model with `tiny_model`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "python" / "tests"))

# (name, router, connector, corrected)
SYSTEMS = [
    ("kvx-push", "kvx-push", "KvxPushConnector", None),
    # Variants of kvx push for A/B runs side by side, run only when named (see KVX_VARIANTS).
    ("kvx-push-noseal", "kvx-push", "KvxPushConnector", None),
    ("kvx-push-nowait", "kvx-push", "KvxPushConnector", None),
    ("kvx-push-uni", "kvx-push", "KvxPushConnector", None),
    ("kvx-pull", "kvx-pull", "KvxPullConnector", None),
    ("nixl-pull-shipped", "kvx-pull", "NixlConnector", False),
    ("nixl-pull-corrected", "kvx-pull", "NixlConnector", True),
    ("nixl-push-shipped", "nixl-push", "NixlPushConnector", False),
    ("nixl-push-corrected", "nixl-push", "NixlPushConnector", True),
]


# The kvx variants' extra-config keys (on both instances), by the end of the system's name.
KVX_VARIANTS = {
    # The seal off: the KV leaves when vLLM has finished the request, an engine iteration
    # after its last forward pass.
    "-noseal": {"seal": False},
    # Steps without a forward pass return at once (vLLM's own pace) instead of waiting up to
    # `idle_wait_ms` for a transfer to end.
    "-nowait": {"idle_wait_ms": 0},
}


def variant_extra(system: str) -> dict:
    return next((extra for end, extra in KVX_VARIANTS.items() if system.endswith(end)), {})


# A variant whose instances run vLLM's uni executor whatever `--executor` says (an A/B of the
# executor side by side).
UNI_VARIANT = "-uni"


def is_variant(system: str) -> bool:
    return bool(variant_extra(system)) or system.endswith(UNI_VARIANT)


# vLLM's executor on every instance (`--executor`): "uni" (the default here: the worker runs in
# the engine core's process; no queue between them) or "mp" (vLLM's own default on CPU: the
# engine core and its worker are separate processes that talk through a shared-memory queue,
# which each reads spinning for a second after every message; four such processes on two
# cores kept the machine busy and made every system's TTFT p99 one of its scheduler's spells).
EXECUTOR = "uni"


def executor_of(system: str) -> str:
    return "uni" if system.endswith(UNI_VARIANT) else EXECUTOR


def log(msg: str) -> None:
    print(f"[vllm-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)
