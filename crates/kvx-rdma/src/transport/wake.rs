//! Waking a thread in [`Transport::wait`](crate::Transport::wait) from another thread: a flag
//! that the wait loop checks, and an `eventfd` that sits in the wait's `poll(2)` set (beside the
//! rails' wait descriptors on libfabric, the control socket and its connections on the
//! same-host backends). Nothing here calls into a backend, whose objects the waiting thread
//! owns.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::transport::Waker;

/// The wake-up signal of one endpoint.
pub(crate) struct WakeSignal {
    fd: OwnedFd,
    woken: AtomicBool,
}

impl WakeSignal {
    /// A fresh signal, not raised.
    pub(crate) fn new() -> std::io::Result<Self> {
        // SAFETY: eventfd takes an initial value and flags, no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            // SAFETY: eventfd returned a fresh descriptor that nothing else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            woken: AtomicBool::new(false),
        })
    }

    /// The descriptor that becomes readable on a wake, for `poll(2)`.
    // NIXL, alone, reads only the flag.
    #[cfg_attr(
        not(any(feature = "libfabric", feature = "cuda", feature = "cma")),
        allow(dead_code)
    )]
    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Whether a wake came since the last call (which clears it, and empties the descriptor).
    pub(crate) fn take(&self) -> bool {
        let woken = self.woken.swap(false, Ordering::SeqCst);
        if woken {
            self.clear_fd();
        }
        woken
    }

    /// Empties the descriptor, after a `poll(2)` that it may have ended. A wake that raced
    /// with this still left its flag, which the wait loop reads next.
    pub(crate) fn clear_fd(&self) {
        let mut count = 0u64;
        // SAFETY: reads at most 8 bytes into a live local from a descriptor this value owns;
        // an empty (non-blocking) eventfd answers EAGAIN, which needs no handling.
        let _ = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&raw mut count).cast::<libc::c_void>(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

impl Waker for WakeSignal {
    fn wake(&self) {
        self.woken.store(true, Ordering::SeqCst);
        self.ring();
    }
}

impl WakeSignal {
    /// Makes the descriptor readable without raising the flag (news for the waiting thread to
    /// read, such as finished operations, rather than a wake-up).
    pub(crate) fn ring(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live local to a descriptor this value owns; the only
        // failure (a counter at its maximum) leaves the descriptor readable, as wanted.
        let _ = unsafe {
            libc::write(
                self.fd.as_raw_fd(),
                (&raw const one).cast::<libc::c_void>(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `fd` is readable now.
    fn readable(fd: RawFd) -> bool {
        let mut set = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one initialised pollfd that lives across the call.
        let n = unsafe { libc::poll(&mut set, 1, 0) };
        n == 1 && set.revents & libc::POLLIN != 0
    }

    #[test]
    fn a_wake_is_taken_once_and_leaves_the_descriptor_empty() {
        let signal = WakeSignal::new().unwrap();
        assert!(!signal.take());
        signal.wake();
        signal.wake();
        assert!(readable(signal.fd()));
        assert!(signal.take());
        assert!(!signal.take());
        assert!(!readable(signal.fd()));
        // A ring is news to read, not a wake-up.
        signal.ring();
        assert!(readable(signal.fd()));
        assert!(!signal.take());
        signal.clear_fd();
        assert!(!readable(signal.fd()));
    }
}
