//! The lock of this endpoint's own `shm` region, watched so that a writer killed inside it
//! cannot stop this side for ever.
//!
//! libfabric 1.17's `shm` provider keeps a process-shared spin lock at the start of each
//! endpoint's region (`/dev/shm/<pid>:<domain>:<endpoint>`, mapped by the owner and by every
//! peer that writes to it). A peer holds it while it writes into this process — the whole
//! cross-memory-attach copy of a write, on its fast path — and this side takes it on every read
//! of its completion queue. A writer killed inside (a prefill instance killed while it pushes
//! KV) leaves it held for ever: the next read spins in `pthread_spin_lock`, and with it the
//! decode engine thread or driver that reads, and every other writer's post.
//!
//! So, before each read of the queue, the transport looks at the lock word (and, before each
//! post, at the lock of the peer's region it would take: held, the post waits for a later try
//! instead of spinning, which leaves only a post that begins just as a peer dies inside). Held, the read is
//! skipped (nothing spins). Held at every look for [`ABANDONED_AFTER`] while a peer's process
//! has exited (a connected peer, or one disconnected within [`DEPARTED_KEPT`]), it was the dead
//! peer's: the transport releases it and reads again. A live writer holds it for one copy (a
//! write's piece, milliseconds), so a second of holding while a writer is known dead leaves
//! little room for a mistake; the remaining one is a writer stopped (not killed) inside for
//! that long while another writer died.
//!
//! Nothing of this is libfabric's interface: the region's header is the provider's private
//! layout, so the watch is armed only where the header reads back as 1.17's (its version byte,
//! this process's pid and the region's own address where 1.17 keeps them); elsewhere reads go
//! to the provider unwatched, as before.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use super::shm_sweep::SHM_DIR;

/// How long the lock must be seen held, while a peer's process has exited, before this side
/// takes it to be the dead peer's and releases it.
pub(super) const ABANDONED_AFTER: Duration = Duration::from_secs(1);

/// How long the watch of a disconnected peer's process is kept: its lock may be found held
/// after the consumer has already let it go.
pub(super) const DEPARTED_KEPT: Duration = Duration::from_secs(60);

/// The header of a 1.17 region: version byte, pid, the region's own address, the lock.
const VERSION_1_17: u8 = 4;
const PID_OFFSET: usize = 4;
const BASE_ADDR_OFFSET: usize = 16;
const LOCK_OFFSET: usize = 24;
/// glibc's x86-64 spin lock: 1 is free; 0 (or below, with waiters) is held.
const FREE: i32 = 1;

/// This endpoint's region lock, and since when it has been seen held.
pub(super) struct RegionLock {
    /// The lock word, inside the region mapping, which lives as long as the endpoint: the
    /// owning rail drops this before its endpoint closes.
    word: NonNull<AtomicI32>,
    held_since: Option<Instant>,
}

/// What a look at the lock found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Look {
    /// Free: the queue can be read.
    Free,
    /// Held, for this long at least.
    Held(Duration),
}

impl RegionLock {
    /// The lock of the region of the endpoint at `address` (`fi_shm://<pid>:…`), owned by
    /// process `pid` (this one's own, or a peer's once the provider has mapped it here, at the
    /// first post towards it), if it is mapped and its header is 1.17's.
    pub(super) fn find(address: &[u8], pid: i32) -> Option<Self> {
        let own = pid == std::process::id() as i32;
        let text = std::str::from_utf8(address).ok()?.trim_end_matches('\0');
        let name = text.strip_prefix("fi_shm://")?;
        let path = format!("{SHM_DIR}/{name}");
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let start = maps.lines().find_map(|line| {
            let mut fields = line.split_whitespace();
            let range = fields.next()?;
            (fields.nth(4)? == path).then_some(())?;
            usize::from_str_radix(range.split('-').next()?, 16).ok()
        })?;
        // SAFETY: `start` is the first byte of a live shared mapping of the region, at least a
        // page long (the header is 32 bytes); it stays mapped while the endpoint is open (a
        // peer's: while its address-vector entry is, which outlives the peer's record here), and
        // this value is dropped before the endpoint closes (see `word`). The header fields are
        // read as plain integers at their aligned offsets; the lock word is only ever accessed
        // atomically, as the provider's own `pthread_spin_*` calls do.
        unsafe {
            let base = start as *const u8;
            // The region's own address is the owner's mapping: comparable in the owner only.
            if base.read_volatile() != VERSION_1_17
                || base.add(PID_OFFSET).cast::<i32>().read_volatile() != pid
                || (own && base.add(BASE_ADDR_OFFSET).cast::<u64>().read_volatile() != start as u64)
            {
                return None;
            }
            Some(Self {
                word: NonNull::new(base.add(LOCK_OFFSET).cast::<AtomicI32>().cast_mut())?,
                held_since: None,
            })
        }
    }

    /// Looks at the lock at `now`.
    pub(super) fn look(&mut self, now: Instant) -> Look {
        if self.word().load(Ordering::Acquire) >= FREE {
            self.held_since = None;
            return Look::Free;
        }
        let since = *self.held_since.get_or_insert(now);
        Look::Held(now.saturating_duration_since(since))
    }

    fn word(&self) -> &AtomicI32 {
        // SAFETY: the word lies in the region mapping, which outlives this value (see `word`);
        // every process touches it only atomically.
        unsafe { self.word.as_ref() }
    }

    /// Releases a lock whose holder is gone.
    pub(super) fn release_abandoned(&mut self) {
        self.word().store(FREE, Ordering::Release);
        self.held_since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_is_timed_from_the_first_look_that_saw_it_held() {
        let word = Box::leak(Box::new(AtomicI32::new(FREE)));
        let mut lock = RegionLock {
            word: NonNull::from(&*word),
            held_since: None,
        };
        let t0 = Instant::now();
        assert_eq!(lock.look(t0), Look::Free);
        word.store(0, Ordering::Release);
        assert_eq!(lock.look(t0), Look::Held(Duration::ZERO));
        let later = t0 + Duration::from_millis(700);
        assert_eq!(lock.look(later), Look::Held(Duration::from_millis(700)));
        // Free in between: the next hold is timed afresh.
        word.store(FREE, Ordering::Release);
        assert_eq!(lock.look(later), Look::Free);
        word.store(-1, Ordering::Release);
        assert_eq!(
            lock.look(later + ABANDONED_AFTER),
            Look::Held(Duration::ZERO)
        );
        lock.release_abandoned();
        assert_eq!(word.load(Ordering::Acquire), FREE);
        assert_eq!(lock.look(later + ABANDONED_AFTER), Look::Free);
    }

    #[test]
    fn no_lock_is_found_for_a_region_not_mapped_here() {
        let me = std::process::id() as i32;
        assert!(RegionLock::find(b"fi_shm://1:0:0\0", 1).is_none());
        assert!(RegionLock::find(b"not an shm address", me).is_none());
    }
}
