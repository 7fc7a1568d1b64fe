"""kvx_vllm: the kvx KV-transfer connector for vLLM.

Load it in vLLM with::

    --kv-transfer-config '{"kv_connector": "KvxPushConnector",
                           "kv_connector_module_path": "kvx_vllm",
                           "kv_role": "kv_producer", "engine_id": "p0",
                           "kv_connector_extra_config": {"listen": "127.0.0.1:7100"}}'

(``kv_consumer`` on decode; ``KvxPullConnector`` for pull mode). The extra-config keys are
documented in ``docs/vllm.md`` and in :mod:`kvx_vllm.config`.

The connector classes are imported lazily, so that ``import kvx_vllm`` (for the native module,
``kvx_vllm._native``) does not import vLLM. The native module is loaded here, keeping the
process's signal handlers as they were (:mod:`kvx_vllm._signals`).
"""

from typing import Any

from kvx_vllm._signals import signal_handlers_kept

# Loading the native module runs its libraries' constructors, one of which (Debian libfabric's
# libinfinipath) replaces the process's signal handlers: they are put back (see _signals).
with signal_handlers_kept():
    from kvx_vllm import _native  # noqa: F401

__all__ = ["KvxPushConnector", "KvxPullConnector"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvx_vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvx_vllm' has no attribute {name!r}")
