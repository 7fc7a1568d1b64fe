//! What a driver thread reports to the engine thread.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// What a driver thread reports to the engine thread, which takes it at each engine step or
/// waits for the first report (`Producer::wait_finished`, `Consumer::wait_events`).
pub(crate) struct Mailbox<T> {
    items: Mutex<Vec<T>>,
    arrived: Condvar,
}

impl<T> Default for Mailbox<T> {
    fn default() -> Self {
        Self {
            items: Mutex::new(Vec::new()),
            arrived: Condvar::new(),
        }
    }
}

impl<T> Mailbox<T> {
    /// The reports, locked: `push` wakes a waiter once the guard is dropped.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Vec<T>> {
        self.items.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leaves `item` and wakes a waiter.
    pub(crate) fn push(&self, item: T) {
        self.lock().push(item);
        self.wake();
    }

    /// Wakes the waiters, to look again at what they wait for.
    pub(crate) fn wake(&self) {
        self.arrived.notify_all();
    }

    /// Everything there now.
    pub(crate) fn take(&self) -> Vec<T> {
        std::mem::take(&mut *self.lock())
    }

    /// Waits until `ready` holds for the reports (at once if it does now), or `timeout` passed.
    /// Returns the guard, so that the caller can take what it waited for.
    pub(crate) fn wait_until(
        &self,
        timeout: Duration,
        mut ready: impl FnMut(&Vec<T>) -> bool,
    ) -> MutexGuard<'_, Vec<T>> {
        let mut items = self.lock();
        if timeout.is_zero() {
            // A plain poll (every engine step): no clock read.
            return items;
        }
        let deadline = Instant::now() + timeout;
        while !ready(&items) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            items = self
                .arrived
                .wait_timeout(items, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        items
    }

    /// Waits until something is there or `timeout` passed, and takes it all.
    pub(crate) fn wait_take(&self, timeout: Duration) -> Vec<T> {
        std::mem::take(&mut *self.wait_until(timeout, |items| !items.is_empty()))
    }
}
