"""Two "hosts" on one machine for the end-to-end tests: two network namespaces joined by a veth
pair (10.231.0.1 and 10.231.0.2), each with its own loopback and nothing else, so that prefill in
one reaches decode in the other only over the link, as across hosts (abstract Unix sockets, which
belong to a network namespace, cannot connect across). Needs root and ``ip`` (iproute2); the
Rust side's ``kvx_testkit::netns`` is the same arrangement."""

from __future__ import annotations

import ctypes
import os
import subprocess
import time
from contextlib import contextmanager

ADDR_A = "10.231.0.1"
ADDR_B = "10.231.0.2"
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise OSError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")


class TwoHosts:
    """The two namespaces (``a``, ``b``); :meth:`close` removes them."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 1_000_000}"
        self.a, self.b = f"kvxpy-{tag}-a", f"kvxpy-{tag}-b"
        link_a, link_b = f"kp{tag}a", f"kp{tag}b"
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        try:
            _ip("netns", "add", self.a)
            _ip("netns", "add", self.b)
            _ip("link", "add", link_a, "netns", self.a, "type", "veth", "peer", "name", link_b,
                "netns", self.b)
            for ns, link, addr in ((self.a, link_a, ADDR_A), (self.b, link_b, ADDR_B)):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
                _ip("-n", ns, "link", "set", link, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            for ns, link in ((self.a, link_a), (self.b, link_b)):
                self._wait_up(ns, link)
        except Exception:
            self.close()
            raise

    @staticmethod
    def _wait_up(ns: str, link: str) -> None:
        deadline = time.monotonic() + 10
        while True:
            out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "dev", link],
                                 capture_output=True, text=True).stdout
            if "state UP" in out:
                return
            if time.monotonic() > deadline:
                raise OSError(f"link {link} did not come up: {out}")
            time.sleep(0.01)

    def prefix(self, ns: str) -> list[str]:
        """The command prefix that runs a program in ``ns``."""
        return ["ip", "netns", "exec", ns]

    def close(self) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextmanager
def inside(ns: str | None):
    """Runs the body's network calls (of this thread) in namespace ``ns`` (None: where it is)."""
    if ns is None:
        yield
        return
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(target, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
        try:
            yield
        finally:
            if _libc.setns(own, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back: {os.strerror(err)}")
    finally:
        os.close(target)
        os.close(own)


def why_not() -> str | None:
    """Why two namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_NET_ADMIN)"
    if subprocess.run(["sh", "-c", "command -v ip"], capture_output=True).returncode != 0:
        return "no `ip` (iproute2)"
    return None
