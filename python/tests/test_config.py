"""The connector's settings: which transport a KV cache gets (`transport`, default `auto`)."""

from __future__ import annotations

import pytest

from kvx_vllm.config import KvxConfig, resolve_transport


def test_auto_follows_the_cache():
    assert KvxConfig.from_extra({}).transport == "auto"
    assert resolve_transport("auto", None) == "libfabric:shm"
    assert resolve_transport("auto", 0) == "cuda-ipc:0"
    assert resolve_transport("auto", 3) == "cuda-ipc:3"


def test_cuda_ipc_takes_the_caches_gpu_unless_it_names_it():
    # Tensor-parallel rank r of a GPU instance holds its cache on its own device.
    assert resolve_transport("cuda-ipc", 1) == "cuda-ipc:1"
    assert resolve_transport("cuda-ipc:1", 1) == "cuda-ipc:1"


def test_named_host_transports_are_kept_for_host_caches():
    for setting in ("libfabric:shm", "cma", "libfabric:tcp,rails=2", "loopback"):
        assert resolve_transport(setting, None) == setting


def test_transports_that_can_move_device_memory_are_kept_for_cuda_caches():
    # NIXL registers VRAM; libfabric where its provider offers FI_HMEM (checked when it opens).
    for setting in ("nixl", "nixl:ucx@eth0", "libfabric:efa", "libfabric:shm"):
        assert resolve_transport(setting, 0) == setting


@pytest.mark.parametrize("setting,device,says", [
    ("cuda-ipc", None, "host memory"),
    ("cuda-ipc:0", None, "host memory"),
    ("loopback", 0, "moves host memory"),
    ("cma", 2, "CUDA device 2"),
    ("cuda-ipc:0", 1, "use cuda-ipc:1"),
])
def test_a_transport_that_cannot_move_the_cache_is_refused(setting, device, says):
    with pytest.raises(ValueError, match=says) as err:
        resolve_transport(setting, device)
    assert "'transport'" in str(err.value)


def test_the_documented_keys_are_the_native_settings_with_their_defaults():
    """docs/vllm.md's table of keys lists exactly the settings the native module defines, each
    with its default: the table is documentation of the one definition, never a second one."""
    import pathlib
    import re

    from kvx_vllm.config import SETTINGS

    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
    rows = dict(re.findall(r"^\| `(\w+)` \| `?([^`|]*?)`? \|", doc.read_text(), re.M))
    documented = {k: v for k, v in rows.items() if k in {s["key"] for s in SETTINGS} or
                  k.endswith(("_s", "_ms"))}
    assert set(documented) == {s["key"] for s in SETTINGS}
    for s in SETTINGS:
        default = s["default"]
        shown = {None: "unset", True: "true", False: "false"}.get(default, default) \
            if not isinstance(default, (int, float)) or isinstance(default, bool) else default
        if isinstance(default, float) and default.is_integer():
            shown = int(default)
        assert documented[s["key"]] == str(shown), (s["key"], documented[s["key"]], shown)
