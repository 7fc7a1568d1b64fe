"""What a rank on CPU logs at start about vLLM's executor (`cpu_executor_advice`)."""

from __future__ import annotations

import logging

from kvx_vllm.cpu_advice import cpu_executor_advice

BOUND = {"VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1", "OMP_PLACES": "{1}",
         "OMP_PROC_BIND": "true"}


def levels(advice: list[tuple[int, str]]) -> list[int]:
    return [level for level, _ in advice]


def test_a_one_rank_push_decode_under_mp_is_told_of_uni():
    advice = cpu_executor_advice("mp", True, 1, {"VLLM_CPU_OMP_THREADS_BIND": "1"})
    assert levels(advice) == [logging.INFO]
    assert "spins" in advice[0][1] and "uni" in advice[0][1]
    # Not a pull decode, a prefill, or a two-rank decode (uni runs one rank).
    assert cpu_executor_advice("mp", False, 1, {}) == []
    assert cpu_executor_advice("mp", True, 2, {}) == []


def test_uni_without_an_openmp_binding_is_warned_about():
    for environ in ({"VLLM_CPU_OMP_THREADS_BIND": "0"}, {}):
        advice = cpu_executor_advice("uni", False, 1, environ)
        assert levels(advice) == [logging.WARNING], environ
        assert "VLLM_CPU_OMP_THREADS_BIND" in advice[0][1]
        assert "OMP_PLACES" in advice[0][1]
    # The same for a push decode: the warning, never the hint towards uni.
    assert levels(cpu_executor_advice("uni", True, 1, {})) == [logging.WARNING]


def test_uni_with_its_openmp_threads_bound_or_unbound_on_purpose_is_quiet():
    assert cpu_executor_advice("uni", True, 1, BOUND) == []
    assert cpu_executor_advice("uni", True, 1, {"GOMP_CPU_AFFINITY": "1"}) == []
    assert cpu_executor_advice("uni", True, 1, {"KMP_AFFINITY": "proclist=[1]"}) == []
    assert cpu_executor_advice("uni", True, 1, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == []
    # Under mp vLLM binds its workers itself: no warning whatever the environment.
    assert cpu_executor_advice("mp", False, 1, {}) == []
