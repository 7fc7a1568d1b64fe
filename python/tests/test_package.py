"""The package's native module and its Python glue come from one build: ``import kvx_vllm``
refuses a native module of another version than the installed distribution's."""

from __future__ import annotations

import pytest

import kvx_vllm
from kvx_vllm import _native


def test_a_native_module_of_another_version_than_the_package_is_refused():
    with pytest.raises(ImportError, match=r"kvx_vllm 0\.2\.0 found a native module of version 0\.1\.0"):
        kvx_vllm.check_native_version("0.1.0", "0.2.0")
    kvx_vllm.check_native_version("0.1.0", "0.1.0")
    # A checkout's package (no installed distribution of its own) has nothing to compare with.
    kvx_vllm.check_native_version("0.1.0", None)


def test_the_native_module_reports_the_crates_version():
    import re

    # The plugin's own `kvx_vllm.metadata` module, once imported, must not hide the standard
    # library's package metadata from the check.
    import kvx_vllm.metadata  # noqa: F401

    assert re.fullmatch(r"\d+\.\d+\.\d+", _native.__version__), _native.__version__
    installed = kvx_vllm._installed_version()
    if installed is not None:
        assert installed == _native.__version__
