"""Prefill host names are looked up on a helper thread: the caller (vLLM's engine thread) never
waits for DNS, answers are kept for a while and refreshed behind the old one, failures fail the
request and are kept briefly."""

from __future__ import annotations

import threading
import time

import pytest

from kvx_vllm.resolve import Resolver, split


class Lookups:
    """A lookup that answers from a table, counts its calls, and can be held."""

    def __init__(self, table: dict[str, str]):
        self.table = table
        self.calls: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, host: str, port: int) -> str:
        self.calls.append(host)
        assert self.gate.wait(10), "the test never released the lookup"
        if host not in self.table:
            raise OSError(f"{host}: Name or service not known")
        return f"{self.table[host]}:{port}"


def answer(r: Resolver, addr: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while (got := r.address(addr)) is None:
        assert time.monotonic() < deadline, f"{addr} never resolved"
        time.sleep(0.002)
    return got


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ip_addresses_are_used_as_they_are():
    lookups = Lookups({})
    r = Resolver(lookup_fn=lookups)
    assert r.address("10.1.2.3:7100") == "10.1.2.3:7100"
    assert r.address("[::1]:7100") == "[::1]:7100"
    assert lookups.calls == []


@pytest.mark.parametrize("bad", ["prefill", ":7100", "prefill:0", "prefill:70000", "prefill:x"])
def test_malformed_addresses_are_refused(bad):
    with pytest.raises(ValueError):
        Resolver(lookup_fn=Lookups({})).address(bad)
    with pytest.raises(ValueError):
        split(bad)


def test_a_host_name_is_looked_up_without_blocking_the_caller():
    lookups = Lookups({"prefill-0": "10.0.0.7"})
    lookups.gate.clear()
    r = Resolver(lookup_fn=lookups)
    t0 = time.monotonic()
    assert r.address("prefill-0:7100") is None
    assert r.address("prefill-0:7100") is None
    assert time.monotonic() - t0 < 0.5
    lookups.gate.set()
    assert answer(r, "prefill-0:7100") == "10.0.0.7:7100"
    # Kept: asked again, no new lookup; another port of the same host is its own entry.
    assert r.address("prefill-0:7100") == "10.0.0.7:7100"
    assert lookups.calls == ["prefill-0"]
    assert answer(r, "prefill-0:7101") == "10.0.0.7:7101"


def test_an_old_answer_serves_while_a_fresh_lookup_runs():
    clock = Clock()
    lookups = Lookups({"prefill-0": "10.0.0.7"})
    r = Resolver(ttl_s=30, lookup_fn=lookups, clock=clock)
    assert answer(r, "prefill-0:7100") == "10.0.0.7:7100"
    lookups.table["prefill-0"] = "10.0.0.8"
    clock.now += 31
    lookups.gate.clear()
    assert r.address("prefill-0:7100") == "10.0.0.7:7100"
    assert lookups.calls == ["prefill-0", "prefill-0"]
    lookups.gate.set()
    deadline = time.monotonic() + 5
    while r.address("prefill-0:7100") != "10.0.0.8:7100":
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert len(lookups.calls) == 2


def test_a_name_that_does_not_resolve_fails_and_is_tried_again_later():
    clock = Clock()
    lookups = Lookups({})
    r = Resolver(failure_ttl_s=2, lookup_fn=lookups, clock=clock)
    deadline = time.monotonic() + 5
    with pytest.raises(ValueError, match="cannot resolve gone:7100"):
        while r.address("gone:7100") is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
    with pytest.raises(ValueError):
        r.address("gone:7100")
    assert lookups.calls == ["gone"]
    clock.now += 3
    lookups.table["gone"] = "10.0.0.9"
    assert answer(r, "gone:7100") == "10.0.0.9:7100"
    assert lookups.calls == ["gone", "gone"]


def test_the_system_resolver_answers_for_localhost_with_its_ipv4_address():
    assert answer(Resolver(), "localhost:7100") == "127.0.0.1:7100"


def test_cached_answers_only_what_is_known_without_a_lookup():
    clock = Clock()
    lookups = Lookups({"prefill-0": "10.0.0.5"})
    r = Resolver(ttl_s=30.0, lookup_fn=lookups, clock=clock)
    assert r.cached("10.1.2.3:7100") == "10.1.2.3:7100"
    assert r.cached("prefill-0:7100") is None
    assert r.cached("no-port") is None
    assert r.cached("no-such-prefill:7100") is None
    assert lookups.calls == [], "cached() looked a name up"
    assert answer(r, "prefill-0:7100") == "10.0.0.5:7100"
    assert r.cached("prefill-0:7100") == "10.0.0.5:7100"
    # Due for a refresh: still the answer a connection was made to.
    clock.now += 60
    assert r.cached("prefill-0:7100") == "10.0.0.5:7100"
    # A name that failed is not an address.
    with pytest.raises(ValueError):
        answer(r, "no-such-prefill:7100")
    assert r.cached("no-such-prefill:7100") is None
    assert lookups.calls == ["prefill-0", "no-such-prefill"]
