"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

The settings are defined once, in Rust (``kvx_vllm::settings``): their keys, kinds, defaults,
bounds and meanings come from the native module, which also checks and normalises the values,
gives each rank its control address and resolves the transport. Every key has a default that
works on one machine; ``docs/vllm.md`` lists them.
"""

from __future__ import annotations

import os
from typing import Any

from kvx_vllm import _native

#: Every setting, as the native module describes it: dicts with ``key``, ``field`` (the
#: connector's own field, or None for the plugin's), ``kind``, ``default`` and ``doc``.
SETTINGS: list[dict[str, Any]] = _native.settings()

#: key: (default, meaning).
KEYS: dict[str, tuple[Any, str]] = {s["key"]: (s["default"], s["doc"]) for s in SETTINGS}

# Settings of the connector's own that go to the native classes through ``timings``.
_PASSED = ("seconds", "optional_seconds", "peers")


class KvxConfig:
    """The checked settings of one connector: each key of :data:`KEYS` is an attribute."""

    __slots__ = ("_values", "extra")

    def __init__(self, values: dict[str, Any], extra: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "extra", dict(extra))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"kvx has no setting {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("KvxConfig is read-only")

    def __repr__(self) -> str:
        return f"KvxConfig({self._values!r})"

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KvxConfig:
        extra = dict(extra or {})
        values = _native.check_settings(extra)
        values["log"] = os.environ.get("KVX_LOG", values["log"])
        return cls(values, extra)

    def key_file(self) -> str | None:
        """The deployment key file: the ``auth_key_file`` setting, else ``KVX_AUTH_KEY_FILE``,
        else none."""
        return self.auth_key_file or os.environ.get("KVX_AUTH_KEY_FILE") or None

    def rank_listen(self, rank: int) -> str:
        """The control address of tensor-parallel rank ``rank``."""
        return _native.rank_listen(self.listen, rank)

    def timings(self) -> dict[str, Any]:
        """The connector's durations and its peers list, by field name, as the native classes
        take them (an unset optional one is left out)."""
        return {
            s["field"]: self._values[s["key"]]
            for s in SETTINGS
            if s["field"] and s["kind"] in _PASSED and self._values[s["key"]] is not None
        }


def resolve_transport(setting: str, cuda_device: int | None) -> str:
    """The transport to open for a KV cache in host memory (``cuda_device`` None) or on CUDA
    device ``cuda_device``, from the ``transport`` setting: ``auto`` follows the cache,
    ``cuda-ipc`` without a device takes the cache's, and a setting that cannot move the cache's
    memory is refused (ValueError) with the fix in the message."""
    return _native.resolve_transport(setting, cuda_device)


#: Where the ``nixl-cu12`` wheel puts the NIXL runtime, relative to its ``site-packages``.
_NIXL_WHEEL_LIBS = ".nixl_cu12.mesonpy.libs"
_NIXL_CAPI = "libnixl_capi.so"


def nixl_library() -> str | None:
    """The directory of the NIXL runtime (``libnixl_capi.so``) for ``transport = "nixl"``:
    ``KVX_NIXL_LIB_DIR`` where set, else that of an installed ``nixl-cu12`` wheel (``pip
    install nixl-cu12``), else None (the dynamic loader's search path)."""
    configured = os.environ.get("KVX_NIXL_LIB_DIR")
    if configured:
        return configured
    import importlib.util

    for package in ("nixl_cu12", "nixl"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            libs = os.path.join(os.path.dirname(location), _NIXL_WHEEL_LIBS)
            if os.path.isfile(os.path.join(libs, _NIXL_CAPI)):
                return libs
    return None
