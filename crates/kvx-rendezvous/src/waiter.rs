//! The consumer-side mirror of the [`Matcher`](crate::Matcher): a decode instance waits, for
//! each registered attempt, for a completion notice from every producer rank that writes to it.

use std::cmp::Ordering;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use kvx_core::ids::{Attempt, Rank, TransferId};
use smallvec::SmallVec;
use thiserror::Error;

use crate::time::Timestamp;
use crate::timer::{IdHashBuilder, TimerQueue};
use crate::types::{AttemptKey, Reason};

/// Limits of a [`Waiter`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct WaiterConfig {
    /// Most attempts waited for at once; beyond it [`Waiter::expect`] fails the new one with
    /// [`Reason::Capacity`].
    pub max_waiting: usize,
    /// Upper bound on the lease of one wait.
    pub max_lease: Duration,
    /// Seed of the transfer-id hash table.
    pub hash_seed: u64,
}

impl Default for WaiterConfig {
    fn default() -> Self {
        Self {
            max_waiting: 131_072,
            max_lease: Duration::from_secs(120),
            hash_seed: 0,
        }
    }
}

/// Why a [`WaiterConfig`] was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum WaiterConfigError {
    /// `max_waiting` is zero.
    #[error("max_waiting must be at least 1")]
    ZeroCapacity,
    /// `max_lease` is zero.
    #[error("max_lease must be longer than zero")]
    ZeroLease,
}

/// An output of the [`Waiter`]. Every payload handed to [`Waiter::expect`] comes back in exactly
/// one of these (or is dropped with the waiter).
///
/// Deliberately not `#[non_exhaustive]`, like [`Action`](crate::Action): a driver must handle
/// every variant.
#[derive(Debug, PartialEq, Eq)]
pub enum WaiterAction<D> {
    /// Every expected producer rank reported completion: the KV of `key` is in place.
    Ready {
        /// The attempt.
        key: AttemptKey,
        /// The payload given to [`Waiter::expect`].
        payload: D,
    },
    /// The attempt will not complete: do not decode from its blocks.
    Failed {
        /// The attempt.
        key: AttemptKey,
        /// The payload given to [`Waiter::expect`].
        payload: D,
        /// Why.
        reason: Reason,
    },
}

/// What the waiter made of a completion or failure notice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Notice {
    /// Counted (for a completion) or acted on (for a failure).
    Accepted,
    /// This rank already reported for this attempt.
    Duplicate,
    /// The rank is not one the attempt waits for.
    UnexpectedRank,
    /// The notice names an attempt older than the one waited for.
    Stale,
    /// Nothing is waited for under this transfer and attempt (finished, failed or never
    /// expected).
    Unknown,
}

#[derive(Debug)]
struct Wait<D> {
    attempt: Attempt,
    /// The wait's slot in the timer queue.
    slot: u32,
    payload: D,
    /// Ranks still to report.
    pending: SmallVec<[Rank; 8]>,
    /// Ranks that reported.
    arrived: SmallVec<[Rank; 8]>,
    lease: Duration,
    deadline: Timestamp,
}

/// The consumer-side state machine: sans-IO like the [`Matcher`](crate::Matcher).
///
/// ```
/// use std::time::Duration;
/// use kvx_core::{Attempt, Rank, TransferId};
/// use kvx_rendezvous::{AttemptKey, Timestamp, Waiter, WaiterAction, WaiterConfig};
///
/// let mut waiter = Waiter::new(WaiterConfig::default())?;
/// let key = AttemptKey::new(TransferId(1), Attempt::FIRST);
/// let t0 = Timestamp::ZERO;
/// waiter.expect(t0, key, [Rank(0), Rank(1)], Duration::from_secs(5), "request 1");
/// waiter.completion(t0, key, Rank(1));
/// assert!(waiter.poll_action().is_none());
/// waiter.completion(t0, key, Rank(0));
/// assert_eq!(waiter.poll_action(), Some(WaiterAction::Ready { key, payload: "request 1" }));
/// # Ok::<(), kvx_rendezvous::WaiterConfigError>(())
/// ```
#[derive(Debug)]
pub struct Waiter<D> {
    config: WaiterConfig,
    waits: HashMap<TransferId, Wait<D>, IdHashBuilder>,
    timers: TimerQueue,
    actions: VecDeque<WaiterAction<D>>,
    now: Timestamp,
}

impl<D> Waiter<D> {
    /// A waiter with `config`.
    ///
    /// # Errors
    /// [`WaiterConfigError`] names the field out of range.
    pub fn new(config: WaiterConfig) -> Result<Self, WaiterConfigError> {
        if config.max_waiting == 0 {
            return Err(WaiterConfigError::ZeroCapacity);
        }
        if config.max_lease.is_zero() {
            return Err(WaiterConfigError::ZeroLease);
        }
        let waits = HashMap::with_hasher(IdHashBuilder::new(config.hash_seed));
        Ok(Self {
            config,
            waits,
            timers: TimerQueue::default(),
            actions: VecDeque::new(),
            now: Timestamp::ZERO,
        })
    }

    /// Attempts waited for.
    #[must_use]
    pub fn len(&self) -> usize {
        self.waits.len()
    }

    /// Whether nothing is waited for.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.waits.is_empty()
    }

    /// The transfers to name in the next heartbeat to the producers: every one waited for.
    pub fn waiting_transfers(&self) -> impl Iterator<Item = TransferId> + '_ {
        self.waits.keys().copied()
    }

    /// The attempt of `transfer` waited for now, if any (O(1)).
    #[must_use]
    pub fn attempt_of(&self, transfer: TransferId) -> Option<Attempt> {
        self.waits.get(&transfer).map(|wait| wait.attempt)
    }

    /// The payload of `key` while it is waited for (O(1)).
    #[must_use]
    pub fn payload(&self, key: AttemptKey) -> Option<&D> {
        self.waits
            .get(&key.transfer)
            .filter(|wait| wait.attempt == key.attempt)
            .map(|wait| &wait.payload)
    }

    /// The payload of `key`, to change, if that attempt is waited for.
    pub fn payload_mut(&mut self, key: AttemptKey) -> Option<&mut D> {
        self.waits
            .get_mut(&key.transfer)
            .filter(|wait| wait.attempt == key.attempt)
            .map(|wait| &mut wait.payload)
    }

    /// Every attempt waited for with its deadline (O(n), for metrics and tests).
    pub fn entries(&self) -> impl Iterator<Item = (AttemptKey, Timestamp)> + '_ {
        self.waits
            .iter()
            .map(|(t, w)| (AttemptKey::new(*t, w.attempt), w.deadline))
    }

    /// The next action, oldest first.
    pub fn poll_action(&mut self) -> Option<WaiterAction<D>> {
        self.actions.pop_front()
    }

    /// Whether actions are pending.
    #[must_use]
    pub fn has_actions(&self) -> bool {
        !self.actions.is_empty()
    }

    /// Every pending action, oldest first.
    pub fn drain_actions(&mut self) -> std::collections::vec_deque::Drain<'_, WaiterAction<D>> {
        self.actions.drain(..)
    }

    /// Starts waiting for `key`: completion notices from every rank in `producer_ranks`
    /// (duplicates in the list count once), within `lease` (at most
    /// [`WaiterConfig::max_lease`]) unless heartbeats extend it.
    ///
    /// A wait for an older attempt of the same transfer is failed with
    /// [`Reason::Superseded`]. The new wait is failed at once (its payload handed back) if it
    /// is a duplicate or stale, names no rank, or the waiter is full.
    pub fn expect(
        &mut self,
        now: Timestamp,
        key: AttemptKey,
        producer_ranks: impl IntoIterator<Item = Rank>,
        lease: Duration,
        payload: D,
    ) {
        let now = self.advance(now);
        let mut pending: SmallVec<[Rank; 8]> = producer_ranks.into_iter().collect();
        pending.sort_unstable();
        pending.dedup();
        if pending.is_empty() {
            self.fail(key, payload, Reason::NoProducers);
            return;
        }
        let lease = lease.min(self.config.max_lease);
        if let Some(wait) = self.waits.get(&key.transfer) {
            match key.attempt.cmp(&wait.attempt) {
                Ordering::Less => return self.fail(key, payload, Reason::Stale),
                Ordering::Equal => return self.fail(key, payload, Reason::Duplicate),
                Ordering::Greater => {
                    if let Some(old) = self.waits.remove(&key.transfer) {
                        self.timers.release(old.slot);
                        let old_key = AttemptKey::new(key.transfer, old.attempt);
                        self.fail(old_key, old.payload, Reason::Superseded);
                    }
                }
            }
        } else if self.waits.len() >= self.config.max_waiting {
            return self.fail(key, payload, Reason::Capacity);
        }
        let deadline = now + lease;
        let slot = self.timers.alloc();
        self.timers.arm(slot, deadline, key.transfer);
        self.waits.insert(
            key.transfer,
            Wait {
                attempt: key.attempt,
                slot,
                payload,
                pending,
                arrived: SmallVec::new(),
                lease,
                deadline,
            },
        );
        self.compact();
    }

    /// Producer rank `rank` reported that it wrote everything for `key`. When the last expected
    /// rank reports, emits [`WaiterAction::Ready`].
    pub fn completion(&mut self, now: Timestamp, key: AttemptKey, rank: Rank) -> Notice {
        self.advance(now);
        let Some(wait) = self.waits.get_mut(&key.transfer) else {
            return Notice::Unknown;
        };
        match key.attempt.cmp(&wait.attempt) {
            Ordering::Less => return Notice::Stale,
            Ordering::Greater => return Notice::Unknown,
            Ordering::Equal => {}
        }
        let Some(i) = wait.pending.iter().position(|r| *r == rank) else {
            return if wait.arrived.contains(&rank) {
                Notice::Duplicate
            } else {
                Notice::UnexpectedRank
            };
        };
        wait.pending.swap_remove(i);
        wait.arrived.push(rank);
        if wait.pending.is_empty() {
            if let Some(done) = self.waits.remove(&key.transfer) {
                self.timers.release(done.slot);
                self.actions.push_back(WaiterAction::Ready {
                    key,
                    payload: done.payload,
                });
            }
            self.compact();
        }
        Notice::Accepted
    }

    /// The producer side (any rank) reported that `key` failed: emits [`WaiterAction::Failed`]
    /// with `reason` (usually [`Reason::PeerFailed`] or one mapped from the wire). Notices for
    /// other attempts are ignored.
    pub fn failure(&mut self, now: Timestamp, key: AttemptKey, reason: Reason) -> Notice {
        self.advance(now);
        let Some(wait) = self.waits.get(&key.transfer) else {
            return Notice::Unknown;
        };
        match key.attempt.cmp(&wait.attempt) {
            Ordering::Less => Notice::Stale,
            Ordering::Greater => Notice::Unknown,
            Ordering::Equal => {
                if let Some(wait) = self.waits.remove(&key.transfer) {
                    self.timers.release(wait.slot);
                    self.fail(key, wait.payload, reason);
                }
                self.compact();
                Notice::Accepted
            }
        }
    }

    /// The consumer itself gives up on `transfer` (abort or preemption): the wait for `attempt`,
    /// or for whatever attempt is waited for when `attempt` is `None`, fails with `reason`.
    pub fn cancel(
        &mut self,
        now: Timestamp,
        transfer: TransferId,
        attempt: Option<Attempt>,
        reason: Reason,
    ) -> Notice {
        self.advance(now);
        let Some(wait) = self.waits.get(&transfer) else {
            return Notice::Unknown;
        };
        match attempt.map(|a| a.cmp(&wait.attempt)) {
            Some(Ordering::Less) => Notice::Stale,
            Some(Ordering::Greater) => Notice::Unknown,
            None | Some(Ordering::Equal) => {
                if let Some(wait) = self.waits.remove(&transfer) {
                    self.timers.release(wait.slot);
                    self.fail(
                        AttemptKey::new(transfer, wait.attempt),
                        wait.payload,
                        reason,
                    );
                }
                self.compact();
                Notice::Accepted
            }
        }
    }

    /// The producer side is alive and still working on `transfers`: renew their leases from
    /// `now`. O(1) per transfer.
    pub fn heartbeat(&mut self, now: Timestamp, transfers: impl IntoIterator<Item = TransferId>) {
        let now = self.advance(now);
        for transfer in transfers {
            if let Some(wait) = self.waits.get_mut(&transfer) {
                let until = now + wait.lease;
                if until > wait.deadline {
                    wait.deadline = until;
                }
            }
        }
    }

    /// When [`Waiter::handle_timeout`] is next needed: the earliest deadline, exactly.
    pub fn poll_timeout(&mut self) -> Option<Timestamp> {
        while let Some(entry) = self.timers.peek() {
            let live = self
                .timers
                .is_live(&entry)
                .then(|| self.waits.get(&entry.transfer))
                .flatten()
                .filter(|wait| wait.slot == entry.slot);
            let Some(wait) = live else {
                self.timers.pop();
                continue;
            };
            if wait.deadline == entry.deadline {
                return Some(wait.deadline);
            }
            let deadline = wait.deadline;
            self.timers.pop();
            self.timers.requeue(entry, deadline);
        }
        None
    }

    /// Fails, with [`Reason::LeaseExpired`], every wait whose deadline is at or before `now`.
    /// Work proportional to what expires.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        let now = self.advance(now);
        while let Some(entry) = self.timers.peek() {
            if entry.deadline > now {
                break;
            }
            self.timers.pop();
            if !self.timers.is_live(&entry) {
                continue;
            }
            let Some(wait) = self.waits.get(&entry.transfer) else {
                continue;
            };
            if wait.slot != entry.slot {
                continue;
            }
            if wait.deadline > now {
                self.timers.requeue(entry, wait.deadline);
                continue;
            }
            if let Some(wait) = self.waits.remove(&entry.transfer) {
                self.timers.release(wait.slot);
                let key = AttemptKey::new(entry.transfer, wait.attempt);
                self.fail(key, wait.payload, Reason::LeaseExpired);
            }
        }
        self.compact();
    }

    /// Fails every wait with [`Reason::Shutdown`].
    pub fn shutdown(&mut self, now: Timestamp) {
        self.advance(now);
        let mut waits = std::mem::take(&mut self.waits);
        for (transfer, wait) in waits.drain() {
            self.fail(
                AttemptKey::new(transfer, wait.attempt),
                wait.payload,
                Reason::Shutdown,
            );
        }
        self.waits = waits;
        self.timers.clear();
    }

    fn fail(&mut self, key: AttemptKey, payload: D, reason: Reason) {
        self.actions.push_back(WaiterAction::Failed {
            key,
            payload,
            reason,
        });
    }

    fn advance(&mut self, now: Timestamp) -> Timestamp {
        if now > self.now {
            self.now = now;
        }
        self.now
    }

    fn compact(&mut self) {
        self.timers.compact_if_sparse();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(t: u128, a: u32) -> AttemptKey {
        AttemptKey::new(TransferId(t), Attempt(a))
    }

    const LEASE: Duration = Duration::from_secs(10);

    #[test]
    fn ready_after_every_rank_in_any_order_with_duplicates_ignored() {
        let mut w = Waiter::new(WaiterConfig::default()).unwrap();
        let t0 = Timestamp::ZERO;
        w.expect(
            t0,
            key(1, 0),
            [Rank(2), Rank(0), Rank(1), Rank(0)],
            LEASE,
            7,
        );
        assert_eq!(w.completion(t0, key(1, 0), Rank(1)), Notice::Accepted);
        assert_eq!(w.completion(t0, key(1, 0), Rank(1)), Notice::Duplicate);
        assert_eq!(w.completion(t0, key(1, 0), Rank(9)), Notice::UnexpectedRank);
        assert_eq!(w.completion(t0, key(1, 0), Rank(2)), Notice::Accepted);
        assert!(w.poll_action().is_none());
        assert_eq!(w.completion(t0, key(1, 0), Rank(0)), Notice::Accepted);
        assert_eq!(
            w.poll_action(),
            Some(WaiterAction::Ready {
                key: key(1, 0),
                payload: 7
            })
        );
        assert_eq!(w.completion(t0, key(1, 0), Rank(0)), Notice::Unknown);
        assert!(w.is_empty());
        assert_eq!(w.poll_timeout(), None);
    }

    #[test]
    fn newer_attempt_supersedes_and_stale_notices_are_ignored() {
        let mut w = Waiter::new(WaiterConfig::default()).unwrap();
        let t0 = Timestamp::ZERO;
        w.expect(t0, key(1, 0), [Rank(0)], LEASE, "old");
        w.expect(t0, key(1, 1), [Rank(0)], LEASE, "new");
        assert_eq!(
            w.poll_action(),
            Some(WaiterAction::Failed {
                key: key(1, 0),
                payload: "old",
                reason: Reason::Superseded
            })
        );
        assert_eq!(w.completion(t0, key(1, 0), Rank(0)), Notice::Stale);
        assert_eq!(w.failure(t0, key(1, 0), Reason::PeerFailed), Notice::Stale);
        w.expect(t0, key(1, 0), [Rank(0)], LEASE, "late");
        w.expect(t0, key(1, 1), [Rank(0)], LEASE, "dup");
        let reasons: Vec<_> = w
            .drain_actions()
            .map(|a| match a {
                WaiterAction::Failed {
                    payload, reason, ..
                } => (payload, reason),
                WaiterAction::Ready { .. } => panic!("nothing is ready"),
            })
            .collect();
        assert_eq!(
            reasons,
            vec![("late", Reason::Stale), ("dup", Reason::Duplicate)]
        );
        assert_eq!(w.completion(t0, key(1, 1), Rank(0)), Notice::Accepted);
        assert!(matches!(
            w.poll_action(),
            Some(WaiterAction::Ready { payload: "new", .. })
        ));
    }

    #[test]
    fn lease_expiry_and_heartbeat_extension() {
        let mut w = Waiter::new(WaiterConfig::default()).unwrap();
        w.expect(Timestamp::ZERO, key(1, 0), [Rank(0)], LEASE, 1);
        w.expect(Timestamp::ZERO, key(2, 0), [Rank(0)], LEASE, 2);
        assert_eq!(w.poll_timeout(), Some(Timestamp::from_secs(10)));
        w.heartbeat(Timestamp::from_secs(8), [TransferId(1), TransferId(99)]);
        w.handle_timeout(Timestamp::from_secs(10));
        assert_eq!(
            w.drain_actions().collect::<Vec<_>>(),
            vec![WaiterAction::Failed {
                key: key(2, 0),
                payload: 2,
                reason: Reason::LeaseExpired
            }]
        );
        assert_eq!(w.poll_timeout(), Some(Timestamp::from_secs(18)));
        assert_eq!(
            w.waiting_transfers().collect::<Vec<_>>(),
            vec![TransferId(1)]
        );
        w.handle_timeout(Timestamp::from_secs(18));
        assert!(matches!(
            w.poll_action(),
            Some(WaiterAction::Failed {
                payload: 1,
                reason: Reason::LeaseExpired,
                ..
            })
        ));
        assert!(w.is_empty());
    }

    #[test]
    fn failure_cancel_capacity_and_shutdown() {
        let config = WaiterConfig {
            max_waiting: 2,
            ..WaiterConfig::default()
        };
        let mut w = Waiter::new(config).unwrap();
        let t0 = Timestamp::ZERO;
        w.expect(t0, key(1, 0), [Rank(0)], LEASE, 1);
        w.expect(t0, key(2, 0), [Rank(0)], LEASE, 2);
        w.expect(t0, key(3, 0), [Rank(0)], LEASE, 3);
        w.expect(t0, key(4, 0), [], LEASE, 4);
        assert_eq!(
            w.failure(t0, key(1, 0), Reason::PeerFailed),
            Notice::Accepted
        );
        assert_eq!(
            w.cancel(t0, TransferId(2), Some(Attempt(5)), Reason::Aborted),
            Notice::Unknown
        );
        w.expect(t0, key(5, 0), [Rank(0)], LEASE, 5);
        w.shutdown(t0);
        let got: Vec<_> = w
            .drain_actions()
            .map(|a| match a {
                WaiterAction::Failed {
                    payload, reason, ..
                } => (payload, reason),
                WaiterAction::Ready { .. } => panic!("nothing is ready"),
            })
            .collect();
        assert_eq!(
            &got[..3],
            &[
                (3, Reason::Capacity),
                (4, Reason::NoProducers),
                (1, Reason::PeerFailed)
            ]
        );
        let mut rest = got[3..].to_vec();
        rest.sort_unstable_by_key(|(p, _)| *p);
        assert_eq!(rest, vec![(2, Reason::Shutdown), (5, Reason::Shutdown)]);
        assert!(w.is_empty());
        assert_eq!(w.poll_timeout(), None);
        assert!(Waiter::<()>::new(WaiterConfig {
            max_waiting: 0,
            ..WaiterConfig::default()
        })
        .is_err());
    }
}
