"""Prefill addresses named by host name, looked up off the engine thread.

A request names its prefill instance's kvx control address (``kvx_prefill``) as ``HOST:PORT``.
An IP address is used as it is. A host name is looked up on a helper thread, never on vLLM's
engine thread: a slow or unreachable DNS server would otherwise stall every request's step for
the resolver's timeouts. The request waits (it is waiting for its KV anyway) until the answer
(the name's first IPv4 address, see ``lookup``), which is then kept for ``ttl_s``; after that
the old answer is still used while a fresh lookup runs. A name that does not resolve fails the
requests that name it, and the failure is kept for ``failure_ttl_s`` so that a burst of them
makes one lookup.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from concurrent.futures import Future
from typing import Callable


def split(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` for an IPv6 address) as (host, port); ``ValueError`` for
    anything else."""
    host, sep, port_text = addr.rpartition(":")
    if not sep or not host:
        raise ValueError(f"address {addr!r} is not HOST:PORT")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"address {addr!r} has no port number") from None
    if not 0 < port < 65536:
        raise ValueError(f"address {addr!r}: port out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def join(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def lookup(host: str, port: int) -> str:
    """A TCP address of ``host`` (the system resolver, blocking): its first IPv4 address if it
    has one, else its first. One address is used, not each in turn, and a server listening on
    IPv4 (or on both) is the common case: ``localhost`` often resolves to ``::1`` first while
    the instance listens on ``127.0.0.1``."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host} has no address")
    first = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    return join(str(first[4][0]), port)


class Resolver:
    """Turns ``HOST:PORT`` into ``IP:PORT`` without blocking its caller (one thread calls it:
    the worker's engine thread)."""

    def __init__(
        self,
        ttl_s: float = 30.0,
        failure_ttl_s: float = 2.0,
        lookup_fn: Callable[[str, int], str] = lookup,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._ttl = ttl_s
        self._failure_ttl = failure_ttl_s
        self._lookup = lookup_fn
        self._clock = clock
        # addr -> (expires, "IP:PORT" or the lookup's error)
        self._cache: dict[str, tuple[float, str | Exception]] = {}
        self._pending: dict[str, Future] = {}

    def cached(self, addr: str) -> str | None:
        """``addr`` as ``IP:PORT`` if that is known without a lookup (an IP address, or a name
        looked up before, even if its answer is due for a refresh); ``None`` otherwise, and for
        a malformed ``addr``. Never starts a lookup."""
        try:
            host, _ = split(addr)
        except ValueError:
            return None
        if is_ip(host):
            return addr
        cached = self._cache.get(addr)
        if cached is None or isinstance(cached[1], Exception):
            return None
        return cached[1]

    def address(self, addr: str) -> str | None:
        """``addr`` as ``IP:PORT``; ``None`` while its host name is being looked up (ask again
        later). ``ValueError`` when ``addr`` is malformed or its name does not resolve."""
        host, port = split(addr)
        if is_ip(host):
            return addr
        now = self._clock()
        future = self._pending.get(addr)
        if future is not None and future.done():
            del self._pending[addr]
            try:
                answer: str | Exception = future.result()
                expires = now + self._ttl
            except Exception as e:  # noqa: BLE001 - any lookup failure fails the request
                answer, expires = e, now + self._failure_ttl
            self._cache[addr] = (expires, answer)
        cached = self._cache.get(addr)
        if cached is not None and isinstance(cached[1], Exception):
            if cached[0] > now:
                raise ValueError(f"cannot resolve {addr}: {cached[1]}")
            cached = None  # an old failure: look again
        if (cached is None or cached[0] <= now) and addr not in self._pending:
            self._pending[addr] = self._start(host, port)
        return cached[1] if cached is not None else None  # type: ignore[return-value]

    def _start(self, host: str, port: int) -> Future:
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(self._lookup(host, port))
            except Exception as e:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(e)

        # A daemon thread, not a pool's: a lookup stuck in the system resolver must not hold
        # up the process's exit.
        threading.Thread(target=run, name="kvx-resolve", daemon=True).start()
        return future
