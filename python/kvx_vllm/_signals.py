"""Keeping the engine's signal handlers when kvx's native module loads.

Debian's libfabric links ``libinfinipath`` (the PSM provider's library), whose constructor runs
when the native module is loaded and replaces the handlers of SIGSEGV, SIGBUS, SIGTERM, SIGINT,
SIGABRT and SIGILL with its own, which prints a backtrace and exits with status 1. In vLLM's
processes that took SIGTERM and SIGINT from vLLM itself: its engine core, whose handler shuts it
down in order (the connector's shutdown among the rest), died at once instead. The module is
therefore imported inside :func:`signal_handlers_kept`, which puts back every handler that
changed meanwhile. (libfabric's ``shm`` provider installs handlers too, when an endpoint opens;
those remove its shared-memory names and then hand the signal to the handler they replaced, so
they are left in place.)
"""

from __future__ import annotations

import ctypes
import logging
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

# Room for the C library's `struct sigaction` (152 bytes with glibc on x86_64 and aarch64), saved
# and put back as it is; only its first field, the handler, is read.
_SIGACTION_BYTES = 512
_HANDLER_BYTES = ctypes.sizeof(ctypes.c_void_p)

# The signals whose handlers are the engine's to set. Real-time signals are left alone: a
# library may take one for its own timers, and their default action ends the process.
_KEPT = tuple(
    getattr(signal, name)
    for name in (
        "SIGHUP", "SIGINT", "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE",
        "SIGUSR1", "SIGSEGV", "SIGUSR2", "SIGPIPE", "SIGALRM", "SIGTERM", "SIGCHLD", "SIGXCPU",
        "SIGXFSZ", "SIGSYS",
    )
    if hasattr(signal, name)
)


def _sigaction() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).sigaction
    except (OSError, AttributeError):
        return None


def _current(sigaction, sig: int) -> bytes | None:
    buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
    return buf.raw if sigaction(sig, None, buf) == 0 else None


@contextmanager
def signal_handlers_kept() -> Iterator[list[str]]:
    """Runs the body, then restores the handler of every signal whose handler it changed. Yields
    the list it fills with the names of the signals restored."""
    restored: list[str] = []
    sigaction = _sigaction()
    if sigaction is None:
        yield restored
        return
    saved = {sig: _current(sigaction, int(sig)) for sig in _KEPT}
    try:
        yield restored
    finally:
        for sig, before in saved.items():
            now = _current(sigaction, int(sig))
            if before is None or now is None or now[:_HANDLER_BYTES] == before[:_HANDLER_BYTES]:
                continue
            buf = ctypes.create_string_buffer(before, _SIGACTION_BYTES)
            if sigaction(int(sig), buf, None) == 0:
                restored.append(sig.name)
        if restored:
            logger.debug("kvx: put back the handlers of %s after loading the native module",
                         ", ".join(restored))
