"""kvx_vllm: the kvx KV-transfer connector for vLLM.

Load it in vLLM with::

    --kv-transfer-config '{"kv_connector": "KvxPushConnector",
                           "kv_connector_module_path": "kvx_vllm",
                           "kv_role": "kv_producer", "engine_id": "p0",
                           "kv_connector_extra_config": {"listen": "127.0.0.1:7100"}}'

(``kv_consumer`` on decode; ``KvxPullConnector`` for pull mode). The extra-config keys are
documented in ``docs/vllm.md`` and in :mod:`kvx_vllm.config`.

The connector classes are imported lazily, so that ``import kvx_vllm`` (for the native module,
``kvx_vllm._native``) does not import vLLM. The native module links no libfabric: it opens the
library when a libfabric transport is first asked for, and says what to install where it is
missing (``KVX_LIBFABRIC`` names another library file).
"""

# Not bound as `metadata`: importing the submodule kvx_vllm.metadata rebinds that name here.
from importlib import metadata as _dist
from pathlib import Path
from typing import Any

from kvx_vllm import _native


def check_native_version(native: str, package: str | None) -> None:
    """Refuses a native module of another version than the installed package's (``package``;
    None where this copy of ``kvx_vllm`` is not an installed distribution's, as in a checkout):
    a stale ``_native`` beside newer glue fails at import, not at the first transfer."""
    if package is not None and native != package:
        raise ImportError(
            f"kvx_vllm {package} found a native module of version {native} "
            f"({_native.__file__}): reinstall kvx-vllm so that both come from one build"
        )


def _installed_version() -> str | None:
    """The version of the distribution this copy of the package was installed from, if any."""
    try:
        dist = _dist.distribution("kvx-vllm")
    except _dist.PackageNotFoundError:
        return None
    here = Path(__file__).resolve()
    if Path(str(dist.locate_file("kvx_vllm/__init__.py"))).resolve() != here:
        return None
    return dist.version


check_native_version(_native.__version__, _installed_version())

__all__ = ["KvxPushConnector", "KvxPullConnector"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvx_vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvx_vllm' has no attribute {name!r}")
