//! The producer-side rendezvous: pairs a decode registration with the matching finished prefill.
//!
//! See the crate documentation for an example and `docs/rendezvous.md` for the state diagram.
//!
//! One pure state machine in one file, on purpose (about 1,300 lines of code): its live table,
//! lease timers, tombstones and counters change together under every event, and each event's
//! handling is read best beside the others'. What is not the machine lives apart (`timer`,
//! `types`, `time`, the `waiter` for the consumer side, the `sim`ulator).

use std::cmp::Ordering;
use std::collections::hash_map::{Entry, VacantEntry};
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use kvx_core::ids::{Attempt, EngineId, Incarnation, TransferId};
use thiserror::Error;

use crate::time::Timestamp;
use crate::timer::{IdHashBuilder, TimerQueue};
use crate::types::{AttemptKey, ConsumerId, Reason, TransferOutcome};

/// Limits and lease lengths of a [`Matcher`].
///
/// Start from [`Config::default`] and change fields; [`Matcher::new`] validates the result.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Most live entries (held halves plus started, unfinished transfers). A registration or a
    /// finished prefill that would need a new entry beyond this is refused with
    /// [`Reason::Capacity`]; nothing is dropped silently.
    pub max_entries: usize,
    /// Most remembered outcomes ("tombstones") of finished, aborted, expired or refused
    /// attempts. They keep late duplicates idempotent and refuse late halves of dead attempts
    /// at once. At least the `max_tombstones / 2` most recent are always remembered; zero turns
    /// the memory off.
    pub max_tombstones: usize,
    /// How long finished-prefill blocks are held waiting for a registration, from arrival or
    /// from the latest heartbeat naming the transfer.
    pub producer_lease: Duration,
    /// Upper bound on the lease a registration asks for (registrations carry their own).
    pub max_registration_lease: Duration,
    /// How long a started transfer may run before the matcher asks the driver to cancel it.
    pub transfer_timeout: Duration,
    /// How long a tombstone is remembered at least (at most about twice as long), unless
    /// `max_tombstones` forgets it earlier. Keep it well above any retransmission delay: a
    /// replay of both halves after it is forgotten would be served again.
    pub tombstone_ttl: Duration,
    /// Seed of the transfer-id hash table; a driver may randomise it.
    pub hash_seed: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_entries: 131_072,
            max_tombstones: 262_144,
            producer_lease: Duration::from_secs(30),
            max_registration_lease: Duration::from_secs(120),
            transfer_timeout: Duration::from_secs(60),
            tombstone_ttl: Duration::from_secs(300),
            hash_seed: 0,
        }
    }
}

/// Why a [`Config`] was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `max_entries` is zero: the matcher could hold nothing.
    #[error("max_entries must be at least 1")]
    ZeroCapacity,
    /// A lease or timeout is zero, so everything would expire on arrival.
    #[error("{field} must be longer than zero")]
    ZeroDuration {
        /// The offending field.
        field: &'static str,
    },
}

impl Config {
    /// Checks the configuration.
    ///
    /// # Errors
    /// [`ConfigError`] names the first field that is out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_entries == 0 {
            return Err(ConfigError::ZeroCapacity);
        }
        for (field, d) in [
            ("producer_lease", self.producer_lease),
            ("max_registration_lease", self.max_registration_lease),
            ("transfer_timeout", self.transfer_timeout),
            ("tombstone_ttl", self.tombstone_ttl),
        ] {
            if d.is_zero() {
                return Err(ConfigError::ZeroDuration { field });
            }
        }
        Ok(())
    }
}

/// An input to the [`Matcher`]. `P` is the producer's payload (its held blocks, typically an RAII
/// guard), `R` the registration's payload (the destination description).
#[derive(Debug)]
#[non_exhaustive]
pub enum Event<P, R> {
    /// A decode instance registered where the KV of `key` must land. See [`Matcher::register`].
    Registration {
        /// The attempt registered.
        key: AttemptKey,
        /// Who registered.
        consumer: ConsumerId,
        /// How long the registration may be held unmatched (clamped to
        /// [`Config::max_registration_lease`]).
        lease: Duration,
        /// Where the KV goes.
        destination: R,
    },
    /// Prefill finished `key`; its blocks are held until matched. See [`Matcher::prefill_done`].
    PrefillDone {
        /// The attempt whose prefill finished.
        key: AttemptKey,
        /// The producer's blocks.
        blocks: P,
    },
    /// Abort one attempt, or every attempt, of a transfer. See [`Matcher::abort`].
    Abort {
        /// The transfer.
        transfer: TransferId,
        /// One attempt, or `None` for every attempt (including later ones).
        attempt: Option<Attempt>,
        /// Why (usually [`Reason::Aborted`]); passed on in the resulting actions.
        reason: Reason,
    },
    /// The request was preempted at this attempt; it may return as a higher attempt. See
    /// [`Matcher::preempt`].
    Preempted {
        /// The preempted attempt.
        key: AttemptKey,
    },
    /// The consumer still wants these transfers: extend their leases. See
    /// [`Matcher::heartbeat`].
    Heartbeat {
        /// The sender.
        consumer: ConsumerId,
        /// Transfers it still waits for.
        transfers: Vec<TransferId>,
    },
    /// A transfer started by [`Action::StartTransfer`] ended. See
    /// [`Matcher::transfer_finished`].
    TransferFinished {
        /// The attempt transferred.
        key: AttemptKey,
        /// How it ended.
        outcome: TransferOutcome,
    },
}

/// An output of the [`Matcher`]: something its driver must do. Every payload handed in comes
/// back out in exactly one action.
///
/// Deliberately not `#[non_exhaustive]`: a driver must handle every action (a wildcard arm
/// could silently drop a payload), so a new variant is a breaking change that it will notice.
#[derive(Debug, PartialEq, Eq)]
pub enum Action<P, R> {
    /// Both halves of `key` are here: write `blocks` to `destination`. The driver now owns both
    /// payloads, must release them when the transfer ends, and reports the end with
    /// [`Matcher::transfer_finished`].
    StartTransfer {
        /// The attempt to transfer.
        key: AttemptKey,
        /// Who receives it.
        consumer: ConsumerId,
        /// The producer's blocks.
        blocks: P,
        /// Where they go.
        destination: R,
    },
    /// Release the producer's blocks: they will not be transferred.
    ReleaseProducer {
        /// The attempt they were produced for.
        key: AttemptKey,
        /// The blocks.
        blocks: P,
        /// Why. [`Reason::Duplicate`] means these are a second copy of blocks handed in before:
        /// a driver whose payload frees blocks on release must not free them twice.
        reason: Reason,
    },
    /// A held registration will not be served: tell the consumer (unless `reason` says it
    /// already knows, e.g. [`Reason::Preempted`]) and drop the destination.
    FailConsumer {
        /// The attempt registered.
        key: AttemptKey,
        /// Who registered.
        consumer: ConsumerId,
        /// The registration's payload.
        destination: R,
        /// Why.
        reason: Reason,
    },
    /// A registration was refused on arrival and never held.
    RejectRegistration {
        /// The attempt it named.
        key: AttemptKey,
        /// Who sent it.
        consumer: ConsumerId,
        /// Its payload, handed back.
        destination: R,
        /// Why.
        reason: Reason,
    },
    /// Stop a started transfer (aborted, superseded, preempted or timed out). The driver still
    /// owns the payloads, releases them once the writes have stopped, and tells the consumer.
    CancelTransfer {
        /// The attempt being transferred.
        key: AttemptKey,
        /// Who receives it.
        consumer: ConsumerId,
        /// Why.
        reason: Reason,
    },
}

impl<P, R> Action<P, R> {
    /// The attempt the action is about.
    #[must_use]
    pub const fn key(&self) -> AttemptKey {
        match self {
            Self::StartTransfer { key, .. }
            | Self::ReleaseProducer { key, .. }
            | Self::FailConsumer { key, .. }
            | Self::RejectRegistration { key, .. }
            | Self::CancelTransfer { key, .. } => *key,
        }
    }
}

/// What a live entry is doing; see [`Matcher::entries`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EntryState {
    /// Holding finished-prefill blocks, waiting for a registration.
    HoldingProducer,
    /// Holding a registration, waiting for prefill.
    HoldingConsumer,
    /// Matched and started; waiting for the driver to report the end.
    InFlight,
}

/// A live entry of the matcher, for metrics and debugging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryInfo {
    /// The attempt.
    pub key: AttemptKey,
    /// What it is doing.
    pub state: EntryState,
    /// When its lease (or the transfer timeout) runs out.
    pub deadline: Timestamp,
}

/// Counters since the matcher was created. They only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MatcherStats {
    /// Registrations handed in.
    pub registrations: u64,
    /// Finished prefills handed in.
    pub prefills: u64,
    /// Transfers started.
    pub started: u64,
    /// Transfers reported successful.
    pub succeeded: u64,
    /// Transfers reported failed.
    pub failed: u64,
    /// Transfer-finished reports for attempts not in flight (late, stale or unknown).
    pub unexpected_finishes: u64,
    /// Held halves whose lease ran out.
    pub expired: u64,
    /// Started transfers that hit the transfer timeout.
    pub timed_out: u64,
    /// Halves refused on arrival (registrations rejected, prefills released at once).
    pub refused: u64,
    /// Halves refused because the matcher was full.
    pub refused_capacity: u64,
    /// Leases extended by heartbeats.
    pub extended: u64,
    /// Tombstones forgotten (by age or by count); while zero, every ended attempt is still
    /// remembered.
    pub tombstones_forgotten: u64,
}

/// What is remembered of an attempt that ended without a live entry left behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tomb {
    /// The attempt that ended.
    attempt: Attempt,
    /// Set when every attempt of the transfer is refused, with this reason.
    all_attempts: Option<Reason>,
    /// What a finished prefill arriving for this attempt is told.
    producer: Reason,
    /// What a registration arriving for this attempt is told.
    consumer: Reason,
}

impl Tomb {
    /// `attempt` ended for `reason`: a side already received is a duplicate if it comes again;
    /// a side never received is told `reason`.
    const fn ended(
        attempt: Attempt,
        reason: Reason,
        (producer_seen, consumer_seen): (bool, bool),
    ) -> Self {
        Self {
            attempt,
            all_attempts: None,
            producer: if producer_seen {
                Reason::Duplicate
            } else {
                reason
            },
            consumer: if consumer_seen {
                Reason::Duplicate
            } else {
                reason
            },
        }
    }

    /// Every attempt of the transfer is refused with `reason`.
    const fn all(attempt: Attempt, reason: Reason) -> Self {
        Self {
            attempt,
            all_attempts: Some(reason),
            producer: reason,
            consumer: reason,
        }
    }

    /// A half of `attempt` was refused for capacity: the attempt is dead. The same side again
    /// is refused for capacity again (retry with a higher attempt); the other side learns why.
    const fn refused(attempt: Attempt, producer_refused: bool) -> Self {
        let (producer, consumer) = if producer_refused {
            (Reason::Capacity, Reason::CounterpartRejected)
        } else {
            (Reason::CounterpartRejected, Reason::Capacity)
        };
        Self {
            attempt,
            all_attempts: None,
            producer,
            consumer,
        }
    }

    /// What a half of `attempt` arriving now is told, or `None` if the attempt is newer than
    /// the tombstone and may proceed.
    fn verdict(&self, attempt: Attempt, producer: bool) -> Option<Reason> {
        if let Some(reason) = self.all_attempts {
            return Some(reason);
        }
        match attempt.cmp(&self.attempt) {
            Ordering::Less => Some(Reason::Stale),
            Ordering::Equal => Some(if producer {
                self.producer
            } else {
                self.consumer
            }),
            Ordering::Greater => None,
        }
    }
}

/// Tombstones in two generations. New ones go into `current`; a rotation (when `current` is
/// half the budget, or `ttl` after the previous rotation) forgets `previous` wholesale and
/// demotes `current`. Forgetting is thus a `clear` of a table that keeps its memory, not one
/// cache miss per tombstone, and each tombstone lives at least `ttl` unless the count budget
/// forces a rotation sooner.
#[derive(Debug)]
struct Tombs {
    current: HashMap<TransferId, Tomb, IdHashBuilder>,
    previous: HashMap<TransferId, Tomb, IdHashBuilder>,
    rotated_at: Timestamp,
    /// Rotate when `current` holds this many; zero disables the memory.
    half: usize,
    ttl: Duration,
    forgotten: u64,
}

impl Tombs {
    fn new(config: &Config) -> Self {
        let half = if config.max_tombstones == 0 {
            0
        } else {
            (config.max_tombstones / 2).max(1)
        };
        Self {
            current: HashMap::with_hasher(IdHashBuilder::new(config.hash_seed ^ 0x7075_6d62)),
            previous: HashMap::with_hasher(IdHashBuilder::new(config.hash_seed ^ 0x7075_6d62)),
            rotated_at: Timestamp::ZERO,
            half,
            ttl: config.tombstone_ttl,
            forgotten: 0,
        }
    }

    fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    fn get(&self, transfer: &TransferId) -> Option<Tomb> {
        self.current
            .get(transfer)
            .or_else(|| self.previous.get(transfer))
            .copied()
    }

    fn remove(&mut self, transfer: &TransferId) {
        if self.current.remove(transfer).is_none() {
            self.previous.remove(transfer);
        }
    }

    /// Records `tomb` for `transfer`, which has no tombstone.
    fn insert(&mut self, now: Timestamp, transfer: TransferId, tomb: Tomb) {
        if self.half == 0 {
            // Memory off: forgotten at once.
            self.forgotten += 1;
            return;
        }
        // Callers remove any earlier tombstone of `transfer` first, so it is never in both
        // generations.
        self.current.insert(transfer, tomb);
        if self.current.len() >= self.half {
            self.rotate(now);
        }
    }

    /// Rotates if the current generation is `ttl` old.
    fn tick(&mut self, now: Timestamp) {
        if now >= self.rotated_at + self.ttl {
            self.rotate(now);
        }
    }

    fn rotate(&mut self, now: Timestamp) {
        self.forgotten += self.previous.len() as u64;
        self.previous.clear();
        std::mem::swap(&mut self.current, &mut self.previous);
        self.rotated_at = now;
    }

    fn clear(&mut self) {
        self.current.clear();
        self.previous.clear();
    }
}

/// A live entry's state.
#[derive(Debug)]
enum State<P, R> {
    Producer {
        blocks: P,
        deadline: Timestamp,
    },
    Consumer {
        consumer: ConsumerId,
        destination: R,
        lease: Duration,
        deadline: Timestamp,
    },
    InFlight {
        consumer: ConsumerId,
        deadline: Timestamp,
    },
}

impl<P, R> State<P, R> {
    /// A payload-free state to stand in while the real one is moved out.
    const PLACEHOLDER: Self = Self::InFlight {
        consumer: ConsumerId {
            engine: EngineId(0),
            incarnation: Incarnation(0),
        },
        deadline: Timestamp::MAX,
    };

    const fn deadline(&self) -> Timestamp {
        match self {
            Self::Producer { deadline, .. }
            | Self::Consumer { deadline, .. }
            | Self::InFlight { deadline, .. } => *deadline,
        }
    }
}

/// A live entry: one transfer's newest attempt, held or in flight.
#[derive(Debug)]
struct Record<P, R> {
    /// The newest attempt seen for this transfer.
    attempt: Attempt,
    /// The record's slot in the timer queue, for its lifetime.
    slot: u32,
    state: State<P, R>,
}

/// The live records, by transfer.
type Table<P, R> = HashMap<TransferId, Record<P, R>, IdHashBuilder>;

/// An arriving half.
enum Half<P, R> {
    Producer(P),
    Consumer {
        consumer: ConsumerId,
        lease: Duration,
        destination: R,
    },
}

impl<P, R> Half<P, R> {
    const fn is_producer(&self) -> bool {
        matches!(self, Self::Producer(_))
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts {
    producers: usize,
    consumers: usize,
    in_flight: usize,
}

impl Counts {
    const fn live(&self) -> usize {
        self.producers + self.consumers + self.in_flight
    }
}

/// The sans-IO rendezvous of the producer (prefill) side.
///
/// Feed it events with the current time ([`Matcher::handle`] or the per-event methods), wake it
/// at [`Matcher::poll_timeout`] with [`Matcher::handle_timeout`], and carry out what
/// [`Matcher::poll_action`] returns. It never reads a clock, spawns nothing and does no I/O.
///
/// Guarantees, for any order of calls:
/// * each (transfer, attempt) starts at most one transfer (while its tombstone is remembered);
/// * a half never pairs with a half of another attempt;
/// * every payload handed in comes out in exactly one action (or is dropped with the matcher);
/// * after `handle_timeout(now)`, nothing is held with a deadline at or before `now`;
/// * at most [`Config::max_entries`] live entries and [`Config::max_tombstones`] tombstones.
///
/// Time passed in may go backwards (clocks of different threads); the matcher uses the latest
/// time it has seen.
#[derive(Debug)]
pub struct Matcher<P, R> {
    config: Config,
    records: Table<P, R>,
    tombs: Tombs,
    timers: TimerQueue,
    actions: VecDeque<Action<P, R>>,
    now: Timestamp,
    counts: Counts,
    stats: MatcherStats,
}

/// The parts of a matcher that change while one record is borrowed from the table.
struct Cx<'a, P, R> {
    config: &'a Config,
    now: Timestamp,
    tombs: &'a mut Tombs,
    timers: &'a mut TimerQueue,
    actions: &'a mut VecDeque<Action<P, R>>,
    counts: &'a mut Counts,
    stats: &'a mut MatcherStats,
}

impl<P, R> Cx<'_, P, R> {
    const fn full(&self) -> bool {
        self.counts.live() >= self.config.max_entries
    }

    /// Refuses an arriving half: hands its payload straight back.
    fn refuse(&mut self, key: AttemptKey, half: Half<P, R>, reason: Reason) {
        self.stats.refused += 1;
        if reason == Reason::Capacity {
            self.stats.refused_capacity += 1;
        }
        self.actions.push_back(match half {
            Half::Producer(blocks) => Action::ReleaseProducer {
                key,
                blocks,
                reason,
            },
            Half::Consumer {
                consumer,
                destination,
                ..
            } => Action::RejectRegistration {
                key,
                consumer,
                destination,
                reason,
            },
        });
    }

    /// The state holding an arriving half, with its lease armed on `slot`.
    fn hold(&mut self, transfer: TransferId, slot: u32, half: Half<P, R>) -> State<P, R> {
        let state = match half {
            Half::Producer(blocks) => {
                self.counts.producers += 1;
                State::Producer {
                    blocks,
                    deadline: self.now + self.config.producer_lease,
                }
            }
            Half::Consumer {
                consumer,
                lease,
                destination,
            } => {
                self.counts.consumers += 1;
                State::Consumer {
                    consumer,
                    destination,
                    lease,
                    deadline: self.now + lease,
                }
            }
        };
        self.timers.arm(slot, state.deadline(), transfer);
        state
    }

    /// Both halves are here: hand them to the driver and track the transfer in `record`.
    fn start(
        &mut self,
        record: &mut Record<P, R>,
        key: AttemptKey,
        consumer: ConsumerId,
        blocks: P,
        destination: R,
    ) {
        let deadline = self.now + self.config.transfer_timeout;
        record.state = State::InFlight { consumer, deadline };
        self.counts.in_flight += 1;
        self.stats.started += 1;
        self.timers.arm(record.slot, deadline, key.transfer);
        self.actions.push_back(Action::StartTransfer {
            key,
            consumer,
            blocks,
            destination,
        });
    }

    /// Ends a live state, emitting what it requires: a held half is released or failed with
    /// `reason`, a started transfer is cancelled with `in_flight_reason`. Returns which sides it
    /// had received (producer, consumer).
    fn vacate(
        &mut self,
        key: AttemptKey,
        state: State<P, R>,
        reason: Reason,
        in_flight_reason: Reason,
    ) -> (bool, bool) {
        match state {
            State::Producer { blocks, .. } => {
                self.counts.producers -= 1;
                self.actions.push_back(Action::ReleaseProducer {
                    key,
                    blocks,
                    reason,
                });
                (true, false)
            }
            State::Consumer {
                consumer,
                destination,
                ..
            } => {
                self.counts.consumers -= 1;
                self.actions.push_back(Action::FailConsumer {
                    key,
                    consumer,
                    destination,
                    reason,
                });
                (false, true)
            }
            State::InFlight { consumer, .. } => {
                self.counts.in_flight -= 1;
                self.actions.push_back(Action::CancelTransfer {
                    key,
                    consumer,
                    reason: in_flight_reason,
                });
                (true, true)
            }
        }
    }

    /// A half for a transfer with no live record: create one, unless the matcher is full.
    fn create(
        &mut self,
        slot: VacantEntry<'_, TransferId, Record<P, R>>,
        key: AttemptKey,
        half: Half<P, R>,
    ) {
        if self.full() {
            let producer = half.is_producer();
            self.refuse(key, half, Reason::Capacity);
            self.tombs
                .insert(self.now, key.transfer, Tomb::refused(key.attempt, producer));
            return;
        }
        let timer = self.timers.alloc();
        let state = self.hold(key.transfer, timer, half);
        slot.insert(Record {
            attempt: key.attempt,
            slot: timer,
            state,
        });
    }
}

impl<P, R> Matcher<P, R> {
    /// A matcher with `config`.
    ///
    /// # Errors
    /// [`ConfigError`] if the configuration is out of range (see [`Config::validate`]).
    pub fn new(config: Config) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            records: HashMap::with_hasher(IdHashBuilder::new(config.hash_seed)),
            tombs: Tombs::new(&config),
            config,
            timers: TimerQueue::default(),
            actions: VecDeque::new(),
            now: Timestamp::ZERO,
            counts: Counts::default(),
            stats: MatcherStats::default(),
        })
    }

    /// The configuration.
    #[must_use]
    pub const fn config(&self) -> &Config {
        &self.config
    }

    /// Counters since creation.
    #[must_use]
    pub const fn stats(&self) -> &MatcherStats {
        &self.stats
    }

    /// The latest time the matcher has seen.
    #[must_use]
    pub const fn now(&self) -> Timestamp {
        self.now
    }

    /// Live entries: held halves plus started, unfinished transfers.
    #[must_use]
    pub const fn len(&self) -> usize {
        self.counts.live()
    }

    /// Whether there are no live entries.
    #[must_use]
    pub const fn is_empty(&self) -> bool {
        self.counts.live() == 0
    }

    /// Held finished-prefill halves.
    #[must_use]
    pub const fn held_producers(&self) -> usize {
        self.counts.producers
    }

    /// Held registrations.
    #[must_use]
    pub const fn held_consumers(&self) -> usize {
        self.counts.consumers
    }

    /// Started transfers not yet reported finished.
    #[must_use]
    pub const fn in_flight(&self) -> usize {
        self.counts.in_flight
    }

    /// Remembered tombstones.
    #[must_use]
    pub fn tombstones(&self) -> usize {
        self.tombs.len()
    }

    /// Every live entry, in no particular order (O(n): for metrics and debugging, not for the
    /// hot path).
    pub fn entries(&self) -> impl Iterator<Item = EntryInfo> + '_ {
        self.records.iter().map(|(transfer, record)| {
            let state = match &record.state {
                State::Producer { .. } => EntryState::HoldingProducer,
                State::Consumer { .. } => EntryState::HoldingConsumer,
                State::InFlight { .. } => EntryState::InFlight,
            };
            EntryInfo {
                key: AttemptKey::new(*transfer, record.attempt),
                state,
                deadline: record.state.deadline(),
            }
        })
    }

    /// Whether the matcher still has an entry for `key` (either half held, or its transfer in
    /// flight). O(1): drivers use it to forget keys they tracked for entries now gone.
    #[must_use]
    pub fn is_live(&self, key: AttemptKey) -> bool {
        self.records
            .get(&key.transfer)
            .is_some_and(|record| record.attempt == key.attempt)
    }

    /// The destination of the registration held for `key`: that attempt registered, is not yet
    /// matched with its prefill, and its lease has not run out by the latest time seen. A driver
    /// may write the KV already computed there ahead of [`Matcher::prefill_done`] (streaming),
    /// and must then hold back a [`Action::FailConsumer`] for `key` until those writes end.
    #[must_use]
    pub fn held_registration(&self, key: AttemptKey) -> Option<&R> {
        let record = self.records.get(&key.transfer)?;
        match &record.state {
            State::Consumer {
                destination,
                deadline,
                ..
            } if record.attempt == key.attempt && *deadline > self.now => Some(destination),
            _ => None,
        }
    }

    /// The next action for the driver, oldest first.
    pub fn poll_action(&mut self) -> Option<Action<P, R>> {
        self.actions.pop_front()
    }

    /// Every pending action, oldest first.
    pub fn drain_actions(&mut self) -> std::collections::vec_deque::Drain<'_, Action<P, R>> {
        self.actions.drain(..)
    }

    /// Handles one event at time `now`.
    pub fn handle(&mut self, now: Timestamp, event: Event<P, R>) {
        match event {
            Event::Registration {
                key,
                consumer,
                lease,
                destination,
            } => self.register(now, key, consumer, lease, destination),
            Event::PrefillDone { key, blocks } => self.prefill_done(now, key, blocks),
            Event::Abort {
                transfer,
                attempt,
                reason,
            } => self.abort(now, transfer, attempt, reason),
            Event::Preempted { key } => self.preempt(now, key),
            Event::Heartbeat {
                consumer,
                transfers,
            } => self.heartbeat(now, consumer, transfers),
            Event::TransferFinished { key, outcome } => self.transfer_finished(now, key, outcome),
        }
    }

    /// A decode instance registered `destination` for `key`.
    ///
    /// If the prefill of `key` is held, emits [`Action::StartTransfer`]; otherwise the
    /// registration is held for `lease` (at most [`Config::max_registration_lease`]), or
    /// refused with [`Action::RejectRegistration`]: [`Reason::Stale`] (a newer attempt exists),
    /// [`Reason::Duplicate`] / [`Reason::Conflict`] (already registered, by the same or another
    /// consumer), [`Reason::Capacity`], or what ended the attempt before (aborted, preempted,
    /// the prefill's lease expired...). A held older attempt is superseded.
    pub fn register(
        &mut self,
        now: Timestamp,
        key: AttemptKey,
        consumer: ConsumerId,
        lease: Duration,
        destination: R,
    ) {
        self.stats.registrations += 1;
        let lease = lease.min(self.config.max_registration_lease);
        self.arrive(
            now,
            key,
            Half::Consumer {
                consumer,
                lease,
                destination,
            },
        );
    }

    /// Prefill finished `key`; `blocks` hold its KV.
    ///
    /// If a registration for `key` is held, emits [`Action::StartTransfer`]; otherwise the
    /// blocks are held for [`Config::producer_lease`], or released at once with
    /// [`Action::ReleaseProducer`] for the same reasons a registration is refused.
    pub fn prefill_done(&mut self, now: Timestamp, key: AttemptKey, blocks: P) {
        self.stats.prefills += 1;
        self.arrive(now, key, Half::Producer(blocks));
    }

    /// Aborts one attempt (`Some`) or every attempt (`None`, which also refuses attempts that
    /// arrive later) of `transfer`. Held halves are released or failed with `reason`, a started
    /// transfer is cancelled, and a tombstone refuses the aborted attempt's halves if they
    /// arrive later. An abort of an attempt older than the newest is ignored; an abort of a
    /// newer attempt supersedes the current one.
    pub fn abort(
        &mut self,
        now: Timestamp,
        transfer: TransferId,
        attempt: Option<Attempt>,
        reason: Reason,
    ) {
        self.advance(now);
        let (records, mut cx) = self.split();
        if let Some(current) = records.get(&transfer).map(|r| r.attempt) {
            // An abort of an attempt older than the live one changes nothing.
            let stale = attempt.is_some_and(|a| a < current);
            let removed = if stale {
                None
            } else {
                records.remove(&transfer)
            };
            if let Some(record) = removed {
                cx.timers.release(record.slot);
                let key = AttemptKey::new(transfer, current);
                let tomb = match attempt {
                    None => {
                        cx.vacate(key, record.state, reason, reason);
                        Tomb::all(current, reason)
                    }
                    Some(a) if a == current => {
                        let seen = cx.vacate(key, record.state, reason, reason);
                        Tomb::ended(a, reason, seen)
                    }
                    Some(a) => {
                        // A newer attempt is aborted: the live one is superseded by it.
                        cx.vacate(key, record.state, Reason::Superseded, Reason::Superseded);
                        Tomb::ended(a, reason, (false, false))
                    }
                };
                cx.tombs.insert(cx.now, transfer, tomb);
            }
        } else {
            let existing = cx.tombs.get(&transfer);
            let tomb = match (existing, attempt) {
                (Some(t), _) if t.all_attempts.is_some() => return,
                (Some(t), None) => Tomb {
                    all_attempts: Some(reason),
                    ..t
                },
                (Some(t), Some(a)) if a <= t.attempt => return,
                (_, Some(a)) => Tomb::ended(a, reason, (false, false)),
                (None, None) => Tomb::all(Attempt::FIRST, reason),
            };
            cx.tombs.remove(&transfer);
            cx.tombs.insert(cx.now, transfer, tomb);
        }
        self.end_call();
    }

    /// The request was preempted at `key`: the same as aborting that attempt with
    /// [`Reason::Preempted`]. A higher attempt may follow and is served normally.
    pub fn preempt(&mut self, now: Timestamp, key: AttemptKey) {
        self.abort(now, key.transfer, Some(key.attempt), Reason::Preempted);
    }

    /// `consumer` still waits for `transfers`: each held half of their newest attempt gets its
    /// lease renewed from `now` (a held registration only if `consumer` made it). Unknown,
    /// started and finished transfers are ignored. Costs O(1) per listed transfer.
    pub fn heartbeat(
        &mut self,
        now: Timestamp,
        consumer: ConsumerId,
        transfers: impl IntoIterator<Item = TransferId>,
    ) {
        let now = self.advance(now);
        for transfer in transfers {
            let Some(record) = self.records.get_mut(&transfer) else {
                continue;
            };
            let renewed = match &mut record.state {
                State::Producer { deadline, .. } => {
                    Some((deadline, now + self.config.producer_lease))
                }
                State::Consumer {
                    consumer: holder,
                    lease,
                    deadline,
                    ..
                } if *holder == consumer => {
                    let until = now + *lease;
                    Some((deadline, until))
                }
                _ => None,
            };
            if let Some((deadline, until)) = renewed {
                if until > *deadline {
                    // The queued entry keeps its old deadline; when it surfaces it is
                    // re-queued at this one (see `handle_timeout`).
                    *deadline = until;
                    self.stats.extended += 1;
                }
            }
        }
        self.end_call();
    }

    /// The driver finished the transfer of `key` that [`Action::StartTransfer`] began (or that
    /// [`Action::CancelTransfer`] stopped). The attempt becomes a tombstone, so late duplicates
    /// of either half are refused. Reports for attempts not in flight are counted and ignored.
    pub fn transfer_finished(&mut self, now: Timestamp, key: AttemptKey, outcome: TransferOutcome) {
        self.advance(now);
        match self.records.entry(key.transfer) {
            Entry::Occupied(slot)
                if slot.get().attempt == key.attempt
                    && matches!(slot.get().state, State::InFlight { .. }) =>
            {
                let record = slot.remove();
                self.timers.release(record.slot);
            }
            _ => {
                self.stats.unexpected_finishes += 1;
                self.end_call();
                return;
            }
        }
        self.counts.in_flight -= 1;
        let reason = match outcome {
            TransferOutcome::Succeeded => {
                self.stats.succeeded += 1;
                Reason::Duplicate
            }
            TransferOutcome::Failed => {
                self.stats.failed += 1;
                Reason::TransferFailed
            }
        };
        self.tombs.insert(
            self.now,
            key.transfer,
            Tomb::ended(key.attempt, reason, (true, true)),
        );
        self.end_call();
    }

    /// When the matcher next needs [`Matcher::handle_timeout`]: the earliest lease or
    /// transfer-timeout deadline, or `None` when nothing is held or in flight. Exact (never
    /// early), because stale queue entries at the top are discarded here; amortised O(1).
    ///
    /// Tombstones are forgotten lazily on later calls and need no wake-up.
    pub fn poll_timeout(&mut self) -> Option<Timestamp> {
        while let Some(entry) = self.timers.peek() {
            let live = self
                .timers
                .is_live(&entry)
                .then(|| self.records.get(&entry.transfer))
                .flatten()
                .filter(|record| record.slot == entry.slot);
            let Some(record) = live else {
                self.timers.pop();
                continue;
            };
            let deadline = record.state.deadline();
            if deadline == entry.deadline {
                return Some(deadline);
            }
            // Extended by a heartbeat: move the entry to its real deadline.
            self.timers.pop();
            self.timers.requeue(entry, deadline);
        }
        None
    }

    /// Expires everything whose deadline is at or before `now`, in any order the deadlines fall:
    /// held blocks are released ([`Reason::LeaseExpired`]), held registrations failed
    /// ([`Reason::LeaseExpired`]), over-long transfers cancelled ([`Reason::TransferTimeout`]).
    /// Each leaves a tombstone so the other half, arriving late, is refused at once with
    /// [`Reason::CounterpartExpired`]. The work is proportional to what expires (plus queue
    /// entries made stale by earlier calls), not to what is held.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        let now = self.advance(now);
        let (records, mut cx) = self.split();
        while let Some(entry) = cx.timers.peek() {
            if entry.deadline > now {
                break;
            }
            cx.timers.pop();
            if !cx.timers.is_live(&entry) {
                continue;
            }
            // One probe of the table per live entry that surfaces, whatever happens to it.
            let Entry::Occupied(slot) = records.entry(entry.transfer) else {
                continue;
            };
            if slot.get().slot != entry.slot {
                continue;
            }
            let deadline = slot.get().state.deadline();
            if deadline > now {
                cx.timers.requeue(entry, deadline);
                continue;
            }
            let record = slot.remove();
            cx.timers.release(record.slot);
            let key = AttemptKey::new(entry.transfer, record.attempt);
            let timed_out = matches!(record.state, State::InFlight { .. });
            let seen = cx.vacate(
                key,
                record.state,
                Reason::LeaseExpired,
                Reason::TransferTimeout,
            );
            let reason = if timed_out {
                cx.stats.timed_out += 1;
                Reason::TransferTimeout
            } else {
                cx.stats.expired += 1;
                Reason::CounterpartExpired
            };
            cx.tombs
                .insert(now, entry.transfer, Tomb::ended(key.attempt, reason, seen));
        }
        self.end_call();
    }

    /// Releases everything: held blocks and registrations come back with [`Reason::Shutdown`],
    /// started transfers are cancelled, tombstones are forgotten. The matcher stays usable.
    pub fn shutdown(&mut self, now: Timestamp) {
        self.advance(now);
        let mut records = std::mem::take(&mut self.records);
        let (_, mut cx) = self.split();
        for (transfer, record) in records.drain() {
            let key = AttemptKey::new(transfer, record.attempt);
            cx.vacate(key, record.state, Reason::Shutdown, Reason::Shutdown);
        }
        self.records = records;
        self.timers.clear();
        self.tombs.clear();
    }

    /// Checks the internal bookkeeping against the tables (O(n)); for the simulator.
    pub(crate) fn check_consistency(&self) -> Result<(), Inconsistency> {
        let mut counts = Counts::default();
        for (transfer, record) in &self.records {
            match &record.state {
                State::Producer { .. } => counts.producers += 1,
                State::Consumer { .. } => counts.consumers += 1,
                State::InFlight { .. } => counts.in_flight += 1,
            }
            if self.tombs.get(transfer).is_some() {
                return Err(Inconsistency::LiveAndTombstone(*transfer));
            }
        }
        if counts != self.counts {
            return Err(Inconsistency::Counters {
                kept: format!("{:?}", self.counts),
                table: format!("{counts:?}"),
            });
        }
        if counts.live() > self.config.max_entries {
            return Err(Inconsistency::TooManyEntries {
                live: counts.live(),
                max: self.config.max_entries,
            });
        }
        if self.tombs.len() > self.config.max_tombstones {
            return Err(Inconsistency::TooManyTombstones {
                tombstones: self.tombs.len(),
                max: self.config.max_tombstones,
            });
        }
        if let Some(t) = self
            .tombs
            .current
            .keys()
            .find(|t| self.tombs.previous.contains_key(t))
        {
            return Err(Inconsistency::TombstoneInBothGenerations(*t));
        }
        if self.timers.in_use() != counts.live() {
            return Err(Inconsistency::TimerSlots {
                in_use: self.timers.in_use(),
                live: counts.live(),
            });
        }
        if self.timers.len() > 2 * counts.live() + 1024 + 1 {
            return Err(Inconsistency::TimerQueue {
                queued: self.timers.len(),
                live: counts.live(),
            });
        }
        Ok(())
    }

    /// Shared path of both halves.
    fn arrive(&mut self, now: Timestamp, key: AttemptKey, half: Half<P, R>) {
        self.advance(now);
        let (records, mut cx) = self.split();
        // One probe of the live table, whether the transfer is live or new.
        match records.entry(key.transfer) {
            Entry::Occupied(mut slot) => {
                let record = slot.get_mut();
                match key.attempt.cmp(&record.attempt) {
                    Ordering::Less => cx.refuse(key, half, Reason::Stale),
                    Ordering::Greater => {
                        // The live attempt is superseded; the slot goes to the new one.
                        let state = cx.hold(key.transfer, record.slot, half);
                        let old = std::mem::replace(&mut record.state, state);
                        let old_key = AttemptKey::new(key.transfer, record.attempt);
                        record.attempt = key.attempt;
                        cx.vacate(old_key, old, Reason::Superseded, Reason::Superseded);
                    }
                    Ordering::Equal => Self::arrive_same_attempt(&mut cx, record, key, half),
                }
            }
            Entry::Vacant(slot) => match cx.tombs.get(&key.transfer) {
                Some(tomb) => match tomb.verdict(key.attempt, half.is_producer()) {
                    Some(reason) => cx.refuse(key, half, reason),
                    None => {
                        cx.tombs.remove(&key.transfer);
                        cx.create(slot, key, half);
                    }
                },
                None => cx.create(slot, key, half),
            },
        }
        self.end_call();
    }

    /// A half of the live record's own attempt arrived.
    fn arrive_same_attempt(
        cx: &mut Cx<'_, P, R>,
        record: &mut Record<P, R>,
        key: AttemptKey,
        half: Half<P, R>,
    ) {
        let old = std::mem::replace(&mut record.state, State::PLACEHOLDER);
        match (old, half) {
            (
                State::Producer { blocks, .. },
                Half::Consumer {
                    consumer,
                    destination,
                    ..
                },
            ) => {
                cx.counts.producers -= 1;
                cx.start(record, key, consumer, blocks, destination);
            }
            (
                State::Consumer {
                    consumer,
                    destination,
                    ..
                },
                Half::Producer(blocks),
            ) => {
                cx.counts.consumers -= 1;
                cx.start(record, key, consumer, blocks, destination);
            }
            (old, half) => {
                // The same side again, or either side while in flight.
                let reason = match (&old, &half) {
                    (
                        State::Consumer {
                            consumer: holder, ..
                        },
                        Half::Consumer { consumer, .. },
                    ) if holder != consumer => Reason::Conflict,
                    _ => Reason::Duplicate,
                };
                record.state = old;
                cx.refuse(key, half, reason);
            }
        }
    }

    fn split(&mut self) -> (&mut Table<P, R>, Cx<'_, P, R>) {
        (
            &mut self.records,
            Cx {
                config: &self.config,
                now: self.now,
                tombs: &mut self.tombs,
                timers: &mut self.timers,
                actions: &mut self.actions,
                counts: &mut self.counts,
                stats: &mut self.stats,
            },
        )
    }

    /// Moves the clock forward (never back), ages the tombstones, and returns the matcher's
    /// time.
    fn advance(&mut self, now: Timestamp) -> Timestamp {
        if now > self.now {
            self.now = now;
        }
        self.tombs.tick(self.now);
        self.now
    }

    /// Housekeeping at the end of every call: keep the counters in the stats and compact the
    /// timer queue when stale entries dominate it.
    fn end_call(&mut self) {
        self.stats.tombstones_forgotten = self.tombs.forgotten;
        self.timers.compact_if_sparse();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type M = Matcher<&'static str, &'static str>;

    const C: ConsumerId = ConsumerId {
        engine: EngineId(1),
        incarnation: Incarnation(9),
    };

    fn key(t: u128, a: u32) -> AttemptKey {
        AttemptKey::new(TransferId(t), Attempt(a))
    }

    fn secs(s: u64) -> Timestamp {
        Timestamp::from_secs(s)
    }

    #[test]
    fn held_registration_only_while_waiting_for_its_prefill() {
        let mut m = M::new(Config::default()).unwrap();
        assert_eq!(m.held_registration(key(1, 0)), None);
        m.register(secs(0), key(1, 0), C, Duration::from_secs(5), "dst");
        assert_eq!(m.held_registration(key(1, 0)), Some(&"dst"));
        // Another attempt of the same transfer is not this registration.
        assert_eq!(m.held_registration(key(1, 1)), None);
        // Past its lease (before the timeout is handled) it is no longer offered.
        m.heartbeat(secs(6), C, []);
        assert_eq!(m.held_registration(key(1, 0)), None);
        m.register(secs(6), key(2, 0), C, Duration::from_secs(5), "d2");
        m.prefill_done(secs(6), key(2, 0), "src");
        // Matched: in flight, not held.
        assert_eq!(m.held_registration(key(2, 0)), None);
    }

    #[test]
    fn an_entry_is_live_from_its_first_half_until_it_ends() {
        let mut m = M::new(Config::default()).unwrap();
        m.register(secs(0), key(1, 0), C, Duration::from_secs(5), "dst");
        assert!(m.is_live(key(1, 0)));
        assert!(!m.is_live(key(1, 1)), "another attempt is another entry");
        m.prefill_done(secs(1), key(1, 0), "src");
        assert!(m.is_live(key(1, 0)), "in flight");
        m.transfer_finished(secs(1), key(1, 0), TransferOutcome::Succeeded);
        assert!(!m.is_live(key(1, 0)), "finished");
        m.register(secs(1), key(2, 0), C, Duration::from_secs(5), "d2");
        m.handle_timeout(secs(7));
        assert!(!m.is_live(key(2, 0)), "its lease ran out");
        m.prefill_done(secs(7), key(3, 0), "s3");
        assert!(m.is_live(key(3, 0)));
        m.abort(secs(7), TransferId(3), None, Reason::Aborted);
        assert!(!m.is_live(key(3, 0)), "aborted");
    }

    #[test]
    fn handle_dispatches_every_event() {
        let mut m = M::new(Config::default()).unwrap();
        m.handle(
            secs(0),
            Event::Registration {
                key: key(1, 0),
                consumer: C,
                lease: Duration::from_secs(5),
                destination: "dst",
            },
        );
        m.handle(
            secs(1),
            Event::Heartbeat {
                consumer: C,
                transfers: vec![TransferId(1)],
            },
        );
        assert_eq!(m.poll_timeout(), Some(secs(6)));
        m.handle(
            secs(1),
            Event::PrefillDone {
                key: key(1, 0),
                blocks: "src",
            },
        );
        assert_eq!(
            m.poll_action(),
            Some(Action::StartTransfer {
                key: key(1, 0),
                consumer: C,
                blocks: "src",
                destination: "dst"
            })
        );
        m.handle(
            secs(2),
            Event::TransferFinished {
                key: key(1, 0),
                outcome: TransferOutcome::Succeeded,
            },
        );
        m.handle(
            secs(2),
            Event::PrefillDone {
                key: key(2, 0),
                blocks: "b2",
            },
        );
        m.handle(secs(2), Event::Preempted { key: key(2, 0) });
        m.handle(
            secs(2),
            Event::PrefillDone {
                key: key(3, 0),
                blocks: "b3",
            },
        );
        m.handle(
            secs(2),
            Event::Abort {
                transfer: TransferId(3),
                attempt: None,
                reason: Reason::Aborted,
            },
        );
        let got: Vec<_> = m
            .drain_actions()
            .map(|a| match a {
                Action::ReleaseProducer { key, reason, .. } => (key, reason),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(
            got,
            vec![(key(2, 0), Reason::Preempted), (key(3, 0), Reason::Aborted)]
        );
        assert!(m.is_empty());
        assert_eq!(m.tombstones(), 3);
        assert_eq!(m.stats().started, 1);
        assert_eq!(m.stats().succeeded, 1);
    }

    #[test]
    fn a_renewed_lease_is_not_expired_at_its_old_deadline() {
        let mut m = M::new(Config::default()).unwrap();
        m.register(secs(0), key(1, 0), C, Duration::from_secs(10), "d");
        m.heartbeat(secs(5), C, [TransferId(1)]);
        m.handle_timeout(secs(10));
        assert_eq!(m.poll_action(), None);
        assert_eq!(m.entries().next().map(|e| e.deadline), Some(secs(15)));
        assert_eq!(m.poll_timeout(), Some(secs(15)));
        m.handle_timeout(secs(15));
        assert!(matches!(
            m.poll_action(),
            Some(Action::FailConsumer {
                reason: Reason::LeaseExpired,
                ..
            })
        ));
        assert_eq!(m.stats().extended, 1);
        assert_eq!(m.stats().expired, 1);
    }

    #[test]
    fn leases_start_from_the_latest_time_seen() {
        let mut m = M::new(Config::default()).unwrap();
        m.register(secs(10), key(1, 0), C, Duration::from_secs(1), "a");
        m.register(secs(5), key(2, 0), C, Duration::from_secs(1), "b");
        let mut deadlines: Vec<_> = m.entries().map(|e| e.deadline).collect();
        deadlines.sort();
        assert_eq!(deadlines, vec![secs(11), secs(11)]);
        assert_eq!(m.now(), secs(10));
    }

    #[test]
    fn tombstones_rotate_by_count_and_by_age() {
        let config = Config {
            max_tombstones: 6,
            tombstone_ttl: Duration::from_secs(100),
            ..Config::default()
        };
        let mut tombs = Tombs::new(&config);
        let tomb = Tomb::ended(Attempt(0), Reason::Aborted, (false, false));
        for t in 0..7u128 {
            tombs.insert(secs(1), TransferId(t), tomb);
            assert!(tombs.len() <= 6);
        }
        // The most recent half of the budget is always there.
        for t in 4..7u128 {
            assert!(tombs.get(&TransferId(t)).is_some(), "{t}");
        }
        assert_eq!(tombs.forgotten, 3);
        tombs.tick(secs(50));
        assert_eq!(tombs.len(), 4);
        tombs.tick(secs(101)); // 100 s after the last rotation (at 1 s)
        assert_eq!(tombs.len(), 1);
        tombs.tick(secs(201));
        assert_eq!(tombs.len(), 0);
        assert_eq!(tombs.forgotten, 7);
    }

    #[test]
    fn tomb_verdicts() {
        let ended = Tomb::ended(Attempt(2), Reason::Aborted, (true, false));
        assert_eq!(ended.verdict(Attempt(1), true), Some(Reason::Stale));
        assert_eq!(ended.verdict(Attempt(2), true), Some(Reason::Duplicate));
        assert_eq!(ended.verdict(Attempt(2), false), Some(Reason::Aborted));
        assert_eq!(ended.verdict(Attempt(3), false), None);
        let all = Tomb::all(Attempt(0), Reason::Aborted);
        assert_eq!(all.verdict(Attempt(9), true), Some(Reason::Aborted));
        let refused = Tomb::refused(Attempt(0), false);
        assert_eq!(refused.verdict(Attempt(0), false), Some(Reason::Capacity));
        assert_eq!(
            refused.verdict(Attempt(0), true),
            Some(Reason::CounterpartRejected)
        );
    }
}

/// A disagreement between the matcher's bookkeeping and its tables
/// ([`Matcher::check_consistency`], which the simulator runs after every event).
#[derive(Debug, Error, PartialEq, Eq)]
pub(crate) enum Inconsistency {
    #[error("{0} is both live and a tombstone")]
    LiveAndTombstone(TransferId),
    #[error("counters {kept} disagree with the table {table}")]
    Counters { kept: String, table: String },
    #[error("{live} live entries exceed max_entries {max}")]
    TooManyEntries { live: usize, max: usize },
    #[error("{tombstones} tombstones exceed max_tombstones {max}")]
    TooManyTombstones { tombstones: usize, max: usize },
    #[error("{0} has a tombstone in both generations")]
    TombstoneInBothGenerations(TransferId),
    #[error("{in_use} timer slots in use for {live} live entries")]
    TimerSlots { in_use: usize, live: usize },
    #[error("timer queue of {queued} for {live} live entries")]
    TimerQueue { queued: usize, live: usize },
}
