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
//! A read cannot look and take the lock in one step: a writer may take it between the look
//! (free) and the read, and be killed inside; the read then spins in libfabric, where no look
//! runs. So the own region's lock is also watched from outside ([`RegionLock::watched`]): the
//! process's watchdog thread looks every [`WATCHDOG_EVERY`] at each read in progress, and one
//! that has been inside libfabric for [`ABANDONED_AFTER`] while the lock was held all along and
//! a peer's process had exited gets the lock released as the read's own look would have done.
//!
//! Nothing of this is libfabric's interface: the region's header is the provider's private
//! layout, so the watch is armed only where the header reads back as 1.17's (its version byte,
//! this process's pid and the region's own address where 1.17 keeps them); elsewhere reads go
//! to the provider unwatched, as before.

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use super::shm_sweep::SHM_DIR;

/// How long the lock must be seen held, while a peer's process has exited, before this side
/// takes it to be the dead peer's and releases it.
pub(super) const ABANDONED_AFTER: Duration = Duration::from_secs(1);

/// How long the watch of a disconnected peer's process is kept: its lock may be found held
/// after the consumer has already let it go.
pub(super) const DEPARTED_KEPT: Duration = Duration::from_secs(60);

/// How often the watchdog thread looks at the reads in progress.
pub(super) const WATCHDOG_EVERY: Duration = Duration::from_millis(100);

/// The peers' processes a watch remembers, at most (the most recent).
const WATCHED_PEERS: usize = 1024;

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
    /// The watchdog's view of this lock and of the reads of its queue (own region only).
    watch: Option<Arc<Watched>>,
}

/// What the watchdog thread knows of one endpoint's region lock.
struct Watched {
    /// The lock word while the endpoint is open, `None` once its [`RegionLock`] is dropped; the
    /// watchdog holds the mutex while it touches the word.
    word: Mutex<Option<WordPtr>>,
    /// When the read in progress began, in nanoseconds since [`epoch`] (0: no read).
    reading_since: AtomicU64,
    /// Since when the watchdog has seen the lock held without a break (0: not held).
    held_since: AtomicU64,
    /// The pids of the peers' processes (the most recent [`WATCHED_PEERS`]).
    peers: Mutex<VecDeque<i32>>,
    /// Locks the watchdog released.
    released: AtomicU64,
}

/// The lock word's address, handed to the watchdog thread.
#[derive(Clone, Copy)]
struct WordPtr(NonNull<AtomicI32>);

// SAFETY: the pointee is an atomic integer in a shared mapping, touched only atomically, and
// only while `Watched::word` holds it (the mapping outlives that: see `RegionLock::word`).
unsafe impl Send for WordPtr {}

/// A read of the queue in progress, as the watchdog sees it, until dropped.
pub(super) struct Reading(Option<Arc<Watched>>);

impl Drop for Reading {
    fn drop(&mut self) {
        if let Some(watch) = &self.0 {
            watch.reading_since.store(0, Ordering::Release);
        }
    }
}

/// Nanoseconds since this process first asked (never 0).
fn epoch() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_nanos())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The watches the process's watchdog thread looks at (started with the first).
fn watchdog() -> &'static Mutex<Vec<Weak<Watched>>> {
    static WATCHES: OnceLock<Mutex<Vec<Weak<Watched>>>> = OnceLock::new();
    WATCHES.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("kvx-shm-watchdog".into())
            .spawn(|| loop {
                std::thread::sleep(WATCHDOG_EVERY);
                let live: Vec<Arc<Watched>> = {
                    let mut watches = watchdog().lock().unwrap_or_else(PoisonError::into_inner);
                    watches.retain(|w| w.strong_count() > 0);
                    watches.iter().filter_map(Weak::upgrade).collect()
                };
                for watch in live {
                    watch.check(epoch());
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "kvx: no shm watchdog thread: a writer killed inside this side's region lock may stop a read for ever");
        }
        Mutex::new(Vec::new())
    })
}

impl Watched {
    /// The watchdog's look at `now`: releases the lock where a read has been inside libfabric
    /// for [`ABANDONED_AFTER`], the lock held all along, and a peer's process has exited.
    fn check(&self, now: u64) {
        let word = self.word.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(WordPtr(word)) = *word else { return };
        // SAFETY: the word is in the region mapping, open while `self.word` holds it.
        let word = unsafe { word.as_ref() };
        if word.load(Ordering::Acquire) >= FREE {
            self.held_since.store(0, Ordering::Relaxed);
            return;
        }
        let held_since = match self.held_since.load(Ordering::Relaxed) {
            0 => {
                self.held_since.store(now, Ordering::Relaxed);
                now
            }
            since => since,
        };
        let reading_since = self.reading_since.load(Ordering::Acquire);
        let long = |since: u64| {
            since != 0 && now.saturating_sub(since) >= ABANDONED_AFTER.as_nanos() as u64
        };
        if !(long(reading_since) && long(held_since)) {
            return;
        }
        let peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        if peers.iter().any(|&pid| super::shm_sweep::exited(pid)) {
            word.store(FREE, Ordering::Release);
            self.held_since.store(0, Ordering::Relaxed);
            self.released.fetch_add(1, Ordering::Relaxed);
        }
    }
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
                watch: None,
            })
        }
    }

    /// This lock, watched by the process's watchdog thread too (this endpoint's own region).
    pub(super) fn watched(mut self) -> Self {
        let watch = Arc::new(Watched {
            word: Mutex::new(Some(WordPtr(self.word))),
            reading_since: AtomicU64::new(0),
            held_since: AtomicU64::new(0),
            peers: Mutex::new(VecDeque::new()),
            released: AtomicU64::new(0),
        });
        watchdog()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::downgrade(&watch));
        self.watch = Some(watch);
        self
    }

    /// A read of the queue begins: the watchdog sees it until the value returned is dropped.
    pub(super) fn reading(&self) -> Reading {
        if let Some(watch) = &self.watch {
            watch.reading_since.store(epoch(), Ordering::Release);
        }
        Reading(self.watch.clone())
    }

    /// A peer's process `pid` may write into this region: the watchdog watches it.
    pub(super) fn add_peer(&self, pid: i32) {
        if let Some(watch) = &self.watch {
            let mut peers = watch.peers.lock().unwrap_or_else(PoisonError::into_inner);
            if !peers.contains(&pid) {
                if peers.len() == WATCHED_PEERS {
                    peers.pop_front();
                }
                peers.push_back(pid);
            }
        }
    }

    /// Locks the watchdog released.
    pub(super) fn released_by_watchdog(&self) -> u64 {
        self.watch
            .as_ref()
            .map_or(0, |w| w.released.load(Ordering::Relaxed))
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

impl Drop for RegionLock {
    fn drop(&mut self) {
        // The endpoint closes next: the watchdog must not touch its mapping any more.
        if let Some(watch) = &self.watch {
            *watch.word.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
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
            watch: None,
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

    /// A lock word in this process, leaked (it must outlive the watchdog's looks), watched.
    fn watched_word() -> (&'static AtomicI32, RegionLock) {
        let word: &'static AtomicI32 = Box::leak(Box::new(AtomicI32::new(FREE)));
        let lock = RegionLock {
            word: NonNull::from(word),
            held_since: None,
            watch: None,
        }
        .watched();
        (word, lock)
    }

    /// Takes `word` as `pthread_spin_lock` does (spinning until it is free), giving up at
    /// `limit`; how long it took.
    fn spin_lock(word: &AtomicI32, limit: Duration) -> Option<Duration> {
        let start = Instant::now();
        while word
            .compare_exchange(FREE, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            if start.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Some(start.elapsed())
    }

    /// A read that spins on the lock a writer took just after the read's look, the writer
    /// killed inside: the watchdog releases it once the read has spun for `ABANDONED_AFTER`,
    /// because a peer's process has exited. With every peer alive it never does.
    #[test]
    fn the_watchdog_releases_a_lock_a_dead_peer_left_under_a_spinning_read() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id() as i32;
        child.wait().unwrap();
        let (word, lock) = watched_word();
        lock.add_peer(std::process::id() as i32);
        lock.add_peer(dead);
        word.store(0, Ordering::Release);
        let reading = lock.reading();
        let took = spin_lock(word, Duration::from_secs(10)).expect("never released");
        drop(reading);
        assert!(took >= ABANDONED_AFTER, "released after {took:?}");
        assert_eq!(lock.released_by_watchdog(), 1);

        let (word, lock) = watched_word();
        lock.add_peer(std::process::id() as i32);
        word.store(0, Ordering::Release);
        let reading = lock.reading();
        let limit = ABANDONED_AFTER + WATCHDOG_EVERY * 10;
        assert_eq!(
            spin_lock(word, limit),
            None,
            "released with every peer alive"
        );
        drop(reading);
        assert_eq!(lock.released_by_watchdog(), 0);
        // Held, but no read in progress: nothing to release either (the read's own look does).
        let (word, lock) = watched_word();
        lock.add_peer(dead);
        word.store(0, Ordering::Release);
        std::thread::sleep(ABANDONED_AFTER + WATCHDOG_EVERY * 5);
        assert_eq!(word.load(Ordering::Acquire), 0);
        assert_eq!(lock.released_by_watchdog(), 0);
        drop(lock);
    }

    #[test]
    fn no_lock_is_found_for_a_region_not_mapped_here() {
        let me = std::process::id() as i32;
        assert!(RegionLock::find(b"fi_shm://1:0:0\0", 1).is_none());
        assert!(RegionLock::find(b"not an shm address", me).is_none());
    }
}
