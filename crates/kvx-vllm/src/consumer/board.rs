//! The consumer's use of a transport's [notice board](kvx_rdma::board): push requests whose
//! producers write their notices into it are found ready by the engine thread, in
//! [`Consumer::take_events`](crate::Consumer::take_events), and the driver thread is not woken
//! for them.
//!
//! Each outcome is decided once. A request is *armed* from its registration until either the
//! engine thread sees every notice in the board (it reports the request ready and leaves the
//! key for the driver to forget) or the driver takes the request back to fail it (lease, cancel,
//! a producer's failure, a lost instance). Both take the entry out of [`Armed`] under one lock,
//! so whichever comes first decides.

use std::collections::{HashMap, VecDeque};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use kvx_core::{Rank, RequestId};
use kvx_rdma::board::{board_notice, board_slot, NoticeBoard};
use kvx_rdma::transport::Notice;
use kvx_rendezvous::{AttemptKey, Timestamp};
use tracing::debug;

use super::RecvEvent;
use crate::stats::Stats;

/// Slots of a consumer rank's board: 64 Ki (512 KiB). A request takes one per producer rank
/// that writes to it; when none are left, requests fall back to message notices.
pub(crate) const BOARD_SLOTS: usize = 1 << 16;

/// How long a slot whose notice never came stays unused: a write posted before its request
/// failed may still land there, and must not overwrite the notice of the slot's next use.
/// Longer than any transport's operation timeout.
const COOL_OFF: Duration = Duration::from_secs(120);

/// A request whose notices the engine thread looks for.
#[derive(Debug)]
pub(crate) struct ArmedRequest {
    request: RequestId,
    /// Every producer rank that writes to it.
    ranks: Vec<Rank>,
    /// Notices not in the board yet.
    pending: Vec<u64>,
    /// When it was armed (with its registration): how long it waited for its KV.
    armed_at: std::time::Instant,
    /// Its `kvx.receive` span (disabled where it is not traced): the engine thread logs the
    /// request ready in it.
    span: tracing::Span,
}

/// What the engine thread and the driver share.
#[derive(Debug, Default)]
pub(crate) struct Armed {
    requests: HashMap<AttemptKey, ArmedRequest>,
    /// Found ready by the engine thread, with their writer ranks, for the driver to forget.
    ready: Vec<(AttemptKey, Vec<Rank>)>,
}

/// The board and its armed requests, shared by the consumer's handle and its driver.
#[derive(Debug)]
pub(crate) struct SharedBoard {
    /// Where the count of armed requests is published.
    hints: Arc<PollHints>,
    board: Arc<NoticeBoard>,
    armed: Mutex<Armed>,
}

/// What the engine thread's poll reads first, in one cache line: whether the driver left events,
/// and how many requests are armed in the board. A step with neither costs the poll this one
/// read. After an engine's model step the poll's memory is cold; on a virtual machine each cold
/// page it touches costs a nested page walk, so the fewer the better.
#[derive(Debug, Default)]
pub(crate) struct PollHints {
    /// The driver left events (see `Outbox`).
    pub(crate) news: AtomicBool,
    /// Requests armed in the board, kept by every change under its lock.
    armed: AtomicUsize,
}

impl PollHints {
    /// Whether the poll has nothing to look at.
    #[inline]
    pub(crate) fn idle(&self) -> bool {
        !self.news.load(Ordering::Acquire) && self.armed.load(Ordering::Acquire) == 0
    }
}

/// The armed requests, locked; their count is published when the lock is let go.
struct ArmedGuard<'a> {
    armed: MutexGuard<'a, Armed>,
    count: &'a AtomicUsize,
}

impl Deref for ArmedGuard<'_> {
    type Target = Armed;
    fn deref(&self) -> &Armed {
        &self.armed
    }
}

impl DerefMut for ArmedGuard<'_> {
    fn deref_mut(&mut self) -> &mut Armed {
        &mut self.armed
    }
}

impl Drop for ArmedGuard<'_> {
    fn drop(&mut self) {
        // Still under the lock: counts are published in the order of the changes.
        self.count
            .store(self.armed.requests.len(), Ordering::Release);
    }
}

impl SharedBoard {
    pub(crate) fn new(board: Arc<NoticeBoard>, hints: Arc<PollHints>) -> Self {
        Self {
            hints,
            board,
            armed: Mutex::new(Armed::default()),
        }
    }

    fn lock(&self) -> ArmedGuard<'_> {
        ArmedGuard {
            armed: self.armed.lock().unwrap_or_else(PoisonError::into_inner),
            count: &self.hints.armed,
        }
    }

    /// Whether `notice` is in the board.
    pub(crate) fn arrived(&self, notice: u64) -> bool {
        self.board.arrived(Notice(notice))
    }

    /// Engine thread: the armed requests whose every notice is in the board, reported ready;
    /// returns how many stay armed, and whether a traced one was among the ready (the driver
    /// should then be woken to end its span; otherwise it does at its next turn).
    pub(crate) fn collect(
        &self,
        stats: &Stats,
        out: &mut Vec<(RecvEvent, SystemTime)>,
    ) -> (usize, bool) {
        // A request armed meanwhile is looked at in the next call.
        if self.hints.armed.load(Ordering::Acquire) == 0 {
            return (0, false);
        }
        let mut armed = self.lock();
        if armed.requests.is_empty() {
            return (0, false);
        }
        let mut traced_ready = false;
        let board = &self.board;
        let done: Vec<AttemptKey> = armed
            .requests
            .iter_mut()
            .filter_map(|(key, r)| {
                r.pending.retain(|n| !board.arrived(Notice(*n)));
                r.pending.is_empty().then_some(*key)
            })
            .collect();
        let now = SystemTime::now();
        for key in done {
            let Some(r) = armed.requests.remove(&key) else {
                continue;
            };
            out.push((
                RecvEvent::Ready {
                    key,
                    request: r.request,
                },
                now,
            ));
            debug!(%key, "ready (notice board)");
            if !r.span.is_disabled() {
                tracing::info!(target: crate::trace::TARGET, parent: &r.span, "ready");
                traced_ready = true;
            }
            armed.ready.push((key, r.ranks));
            stats.transfers_ok.fetch_add(1, Ordering::Relaxed);
            stats.record_wait(r.armed_at.elapsed().as_secs_f64());
            stats.board_ready.fetch_add(1, Ordering::Relaxed);
            stats.held.fetch_sub(1, Ordering::Relaxed);
        }
        (armed.requests.len(), traced_ready)
    }

    /// Machine: arms a request before its registrations go out.
    pub(crate) fn arm(
        &self,
        key: AttemptKey,
        request: RequestId,
        ranks: Vec<Rank>,
        notices: &[u64],
        span: tracing::Span,
    ) {
        self.lock().requests.insert(
            key,
            ArmedRequest {
                request,
                ranks,
                pending: notices.to_vec(),
                armed_at: std::time::Instant::now(),
                span,
            },
        );
    }

    /// Machine: the requests the engine thread found ready since the last call.
    pub(crate) fn take_ready(&self) -> Vec<(AttemptKey, Vec<Rank>)> {
        let mut armed = self.lock();
        if armed.ready.is_empty() {
            return Vec::new();
        }
        std::mem::take(&mut armed.ready)
    }

    /// Machine: takes `key` back to decide its outcome itself, unless the engine thread has
    /// reported it ready already.
    pub(crate) fn disarm(&self, key: AttemptKey) -> Disarmed {
        let mut armed = self.lock();
        if let Some(r) = armed.requests.remove(&key) {
            return Disarmed::Pending(r.pending);
        }
        match armed.ready.iter().position(|(k, _)| *k == key) {
            Some(i) => {
                armed.ready.swap_remove(i);
                Disarmed::Ready
            }
            None => Disarmed::NotArmed,
        }
    }

    /// Machine: `notice` came as a message instead (a producer whose transport has no board
    /// writes): it counts as in the board. Returns whether `key` is armed.
    pub(crate) fn seen_elsewhere(&self, key: AttemptKey, notice: u64) -> bool {
        let mut armed = self.lock();
        let Some(r) = armed.requests.get_mut(&key) else {
            return false;
        };
        r.pending.retain(|n| *n != notice);
        true
    }
}

/// What [`SharedBoard::disarm`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Disarmed {
    /// It was armed, and these of its notices were not in the board yet: the driver decides.
    Pending(Vec<u64>),
    /// The engine thread reported it ready (the driver forgets it without a word).
    Ready,
    /// It was never armed (message notices).
    NotArmed,
}

/// The driver's allocation of board slots.
#[derive(Debug)]
pub(crate) struct BoardSlots {
    pub(crate) shared: Arc<SharedBoard>,
    free: Vec<u32>,
    cooling: VecDeque<(Timestamp, u32)>,
    seq: u32,
}

impl BoardSlots {
    pub(crate) fn new(shared: Arc<SharedBoard>) -> Self {
        let slots = u32::try_from(shared.board.len()).unwrap_or(u32::MAX);
        Self {
            shared,
            free: (0..slots).rev().collect(),
            cooling: VecDeque::new(),
            seq: 0,
        }
    }

    /// Notices for `count` producer ranks, or `None` when the board has not that many free
    /// slots now.
    pub(crate) fn take(&mut self, now: Timestamp, count: usize) -> Option<Vec<u64>> {
        while self.cooling.front().is_some_and(|(at, _)| *at <= now) {
            if let Some((_, slot)) = self.cooling.pop_front() {
                self.free.push(slot);
            }
        }
        if self.free.len() < count {
            return None;
        }
        let mut notices = Vec::with_capacity(count);
        for _ in 0..count {
            let slot = self.free.pop()?;
            self.seq = self.seq.wrapping_add(1);
            notices.push(board_notice(slot, self.seq)?.0);
        }
        Some(notices)
    }

    /// Gives back the slots of `notices` (other notices are ignored): at once those whose
    /// writes cannot land any more, after [`COOL_OFF`] the others.
    pub(crate) fn give_back(
        &mut self,
        now: Timestamp,
        notices: &[u64],
        quiet: impl Fn(u64) -> bool,
    ) {
        for &n in notices {
            let Some(slot) = board_slot(Notice(n)) else {
                continue;
            };
            if quiet(n) {
                self.free.push(slot);
            } else {
                self.cooling.push_back((now + COOL_OFF, slot));
            }
        }
    }

    /// Slots free now (tests).
    #[cfg(test)]
    pub(crate) fn free(&self) -> usize {
        self.free.len()
    }
}

/// Whether `notice` is a board notice.
pub(crate) fn is_board_notice(notice: u64) -> bool {
    board_slot(Notice(notice)).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::{Attempt, TransferId};

    fn key(t: u128) -> AttemptKey {
        AttemptKey::new(TransferId(t), Attempt::FIRST)
    }

    #[test]
    fn the_engine_thread_and_the_driver_decide_each_request_once() {
        let board = Arc::new(NoticeBoard::new(4));
        let hints = Arc::new(PollHints::default());
        let shared = Arc::new(SharedBoard::new(Arc::clone(&board), Arc::clone(&hints)));
        let mut slots = BoardSlots::new(Arc::clone(&shared));
        let stats = Stats::default();
        let now = Timestamp::from_millis(0);
        let a = slots.take(now, 2).unwrap();
        let b = slots.take(now, 2).unwrap();
        assert!(slots.take(now, 1).is_none(), "4 slots, all taken");
        assert!(hints.idle(), "nothing armed yet");
        shared.arm(
            key(1),
            RequestId(1),
            vec![Rank(0), Rank(1)],
            &a,
            tracing::Span::none(),
        );
        shared.arm(
            key(2),
            RequestId(2),
            vec![Rank(0), Rank(1)],
            &b,
            tracing::Span::none(),
        );
        assert!(!hints.idle(), "the engine's poll must look at the board");
        let mut out = Vec::new();
        board.deliver(Notice(a[0])).unwrap();
        shared.collect(&stats, &mut out);
        assert!(out.is_empty(), "one of two notices");
        board.deliver(Notice(a[1])).unwrap();
        board.deliver(Notice(b[0])).unwrap();
        shared.collect(&stats, &mut out);
        assert!(matches!(&out[..], [(RecvEvent::Ready { key: k, .. }, _)] if *k == key(1)));
        // The driver cannot take back what the engine thread reported...
        assert_eq!(shared.take_ready(), vec![(key(1), vec![Rank(0), Rank(1)])]);
        assert_eq!(shared.disarm(key(1)), Disarmed::NotArmed);
        // ...and what it took back, the engine thread no longer reports.
        assert!(!hints.idle(), "key 2 is still armed");
        assert_eq!(shared.disarm(key(2)), Disarmed::Pending(vec![b[1]]));
        assert!(hints.idle(), "every request was reported or taken back");
        board.deliver(Notice(b[1])).unwrap();
        out.clear();
        shared.collect(&stats, &mut out);
        assert!(out.is_empty());
        assert_eq!(stats.board_ready.load(Ordering::Relaxed), 1);
        // Slots whose notice came are free at once; the others cool off.
        slots.give_back(now, &a, |_| true);
        slots.give_back(now, &b, |n| n == b[0]);
        assert_eq!(slots.free(), 3);
        assert_eq!(slots.take(now, 4), None);
        let later = now + COOL_OFF;
        let again = slots.take(later, 4).unwrap();
        assert!(
            again.iter().all(|n| !a.contains(n) && !b.contains(n)),
            "new values"
        );
    }

    #[test]
    fn a_notice_that_came_as_a_message_counts() {
        let board = Arc::new(NoticeBoard::new(2));
        let shared = SharedBoard::new(Arc::clone(&board), Arc::default());
        let notices = [board_notice(0, 1).unwrap().0, board_notice(1, 1).unwrap().0];
        shared.arm(
            key(1),
            RequestId(1),
            vec![Rank(0), Rank(1)],
            &notices,
            tracing::Span::none(),
        );
        assert!(shared.seen_elsewhere(key(1), notices[0]));
        assert!(!shared.seen_elsewhere(key(2), notices[0]));
        board.deliver(Notice(notices[1])).unwrap();
        let mut out = Vec::new();
        shared.collect(&Stats::default(), &mut out);
        assert_eq!(out.len(), 1);
        // Reported but not yet taken by the driver: disarming finds it ready.
        assert_eq!(shared.disarm(key(1)), Disarmed::Ready);
        assert!(shared.take_ready().is_empty());
        assert!(is_board_notice(notices[0]) && !is_board_notice(7));
    }
}
