//! A virtual-clock simulator that drives a [`Matcher`] like a prefill engine and a decode engine
//! would, and checks the matcher's invariants after every step. The crate's tests, property
//! tests and fuzz target use it; a connector can use it to replay a trace.
//!
//! The payloads are [`Token`]s: move-only values that remember which attempt and side they were
//! created for. The simulator keeps a ledger of every token it has handed in and checks that
//! each comes back exactly once, from the right action, for the right attempt.
//!
//! ```
//! use kvx_rendezvous::sim::{Sim, SimEvent};
//! use kvx_rendezvous::Config;
//!
//! let mut sim = Sim::new(Config::default())?;
//! sim.step(SimEvent::PrefillDone { transfer: 1, attempt: 0 })?;
//! sim.step(SimEvent::Register { transfer: 1, attempt: 0, consumer: 0, lease_ms: 1_000 })?;
//! assert_eq!(sim.started(), 1);
//! sim.step(SimEvent::Finish { transfer: 1, attempt: 0, ok: true })?;
//! sim.finish()?; // runs the clock out and checks that every token came back exactly once
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::time::Duration;

use kvx_core::ids::{Attempt, EngineId, Incarnation, TransferId};
use thiserror::Error;

use crate::matcher::{Action, Config, ConfigError, Matcher};
use crate::time::Timestamp;
use crate::types::{AttemptKey, ConsumerId, Reason, TransferOutcome};

/// Which half a token stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// Finished-prefill blocks.
    Producer,
    /// A registration's destination.
    Consumer,
}

/// A move-only payload with an identity, standing for held blocks or a destination.
#[derive(Debug, PartialEq, Eq)]
pub struct Token {
    id: u64,
    key: AttemptKey,
    side: Side,
}

impl Token {
    /// The token's unique id.
    #[must_use]
    pub const fn id(&self) -> u64 {
        self.id
    }

    /// The attempt it was handed in for.
    #[must_use]
    pub const fn key(&self) -> AttemptKey {
        self.key
    }

    /// Which half it stands for.
    #[must_use]
    pub const fn side(&self) -> Side {
        self.side
    }
}

/// One scripted step. Transfers, attempts and consumers are small numbers so that generated
/// sequences collide often.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimEvent {
    /// Consumer `consumer` registers `transfer`/`attempt` with a lease of `lease_ms`.
    Register {
        /// Transfer number.
        transfer: u8,
        /// Attempt number.
        attempt: u8,
        /// Consumer number (its engine id).
        consumer: u8,
        /// Lease asked for, in milliseconds.
        lease_ms: u32,
    },
    /// Prefill of `transfer`/`attempt` finished.
    PrefillDone {
        /// Transfer number.
        transfer: u8,
        /// Attempt number.
        attempt: u8,
    },
    /// Abort one attempt, or every attempt when `attempt` is `None`.
    Abort {
        /// Transfer number.
        transfer: u8,
        /// Attempt number, or every attempt.
        attempt: Option<u8>,
    },
    /// The request was preempted at `transfer`/`attempt`.
    Preempt {
        /// Transfer number.
        transfer: u8,
        /// Attempt number.
        attempt: u8,
    },
    /// Consumer `consumer` heartbeats these transfers.
    Heartbeat {
        /// Consumer number.
        consumer: u8,
        /// Transfer numbers.
        transfers: Vec<u8>,
    },
    /// The driver finishes the transfer of `transfer`/`attempt` (reported to the matcher even
    /// if nothing is in flight under that key, to exercise late reports).
    Finish {
        /// Transfer number.
        transfer: u8,
        /// Attempt number.
        attempt: u8,
        /// Whether it succeeded.
        ok: bool,
    },
    /// The clock moves forward.
    Advance {
        /// By how many milliseconds.
        ms: u32,
    },
    /// The driver's clock reads earlier than before (another thread's clock); the matcher must
    /// keep using the latest time it saw.
    Rewind {
        /// By how many milliseconds.
        ms: u32,
    },
}

/// Decodes arbitrary bytes into events (for fuzzers): 4 bytes per event, never failing.
#[must_use]
pub fn events_from_bytes(bytes: &[u8]) -> Vec<SimEvent> {
    bytes
        .chunks_exact(4)
        .map(|c| {
            let transfer = c[1] % 8;
            let attempt = c[2] % 4;
            match c[0] % 9 {
                0 | 1 => SimEvent::Register {
                    transfer,
                    attempt,
                    consumer: c[3] % 3,
                    lease_ms: u32::from(c[3]) * 40,
                },
                2 | 3 => SimEvent::PrefillDone { transfer, attempt },
                4 => SimEvent::Abort {
                    transfer,
                    attempt: (c[3] % 4 != 0).then_some(attempt),
                },
                5 => SimEvent::Preempt { transfer, attempt },
                6 => SimEvent::Heartbeat {
                    consumer: c[3] % 3,
                    transfers: vec![transfer, c[2] % 8],
                },
                7 => SimEvent::Finish {
                    transfer,
                    attempt,
                    ok: c[3] % 2 == 0,
                },
                _ if c[3] % 8 == 0 => SimEvent::Rewind {
                    ms: u32::from(c[1]) * 10,
                },
                _ => SimEvent::Advance {
                    ms: u32::from(c[1]) * u32::from(c[2] % 8 + 1) * 5,
                },
            }
        })
        .collect()
}

/// An invariant the matcher broke.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum Violation {
    /// A second transfer started for one attempt.
    #[error("{key} started a second transfer")]
    DoubleStart {
        /// The attempt.
        key: AttemptKey,
    },
    /// A transfer paired halves of different attempts, or the wrong sides.
    #[error("{key} paired blocks of {blocks} with a destination of {destination}")]
    StalePairing {
        /// The action's attempt.
        key: AttemptKey,
        /// The blocks' attempt.
        blocks: AttemptKey,
        /// The destination's attempt.
        destination: AttemptKey,
    },
    /// An attempt started after a newer attempt of its transfer had been seen.
    #[error("{key} started after attempt {newest} was seen")]
    StartedAfterSuperseded {
        /// The attempt started.
        key: AttemptKey,
        /// The newest attempt seen before.
        newest: Attempt,
    },
    /// A payload came back that is not outstanding (released twice, or never handed in).
    #[error("token {id} came back but is not outstanding")]
    NotOutstanding {
        /// The token.
        id: u64,
    },
    /// A payload came back in an action for another attempt or of the wrong kind.
    #[error("token {id} of {token_key} came back from an action on {action_key} ({what})")]
    WrongPayload {
        /// The token.
        id: u64,
        /// Its attempt.
        token_key: AttemptKey,
        /// The action's attempt.
        action_key: AttemptKey,
        /// Which action.
        what: &'static str,
    },
    /// A transfer was cancelled that the driver is not running.
    #[error("{key} cancelled but not in flight")]
    CancelNotInFlight {
        /// The attempt.
        key: AttemptKey,
    },
    /// An entry is still held after `handle_timeout` passed its deadline.
    #[error("{key} held until {deadline} at {now}")]
    HeldPastLease {
        /// The attempt.
        key: AttemptKey,
        /// Its deadline.
        deadline: Timestamp,
        /// The matcher's time.
        now: Timestamp,
    },
    /// `poll_timeout` disagrees with the earliest deadline.
    #[error("poll_timeout said {got:?}, the earliest deadline is {expected:?}")]
    WrongTimeout {
        /// The earliest deadline of the live entries.
        expected: Option<Timestamp>,
        /// What `poll_timeout` returned.
        got: Option<Timestamp>,
    },
    /// Tokens outstanding do not match what the matcher and the driver hold.
    #[error("{outstanding} tokens outstanding, but the matcher and driver hold {held}")]
    Leak {
        /// Tokens handed in and not yet back.
        outstanding: usize,
        /// Tokens the matcher and the driver account for.
        held: usize,
    },
    /// The matcher's bookkeeping is inconsistent (size bound, counters).
    #[error("inconsistent matcher: {0}")]
    Inconsistent(String),
}

/// What an action looked like, without its payloads (for scripted assertions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observed {
    /// [`Action::StartTransfer`].
    Start(AttemptKey),
    /// [`Action::ReleaseProducer`].
    Release(AttemptKey, Reason),
    /// [`Action::FailConsumer`].
    Fail(AttemptKey, Reason),
    /// [`Action::RejectRegistration`].
    Reject(AttemptKey, Reason),
    /// [`Action::CancelTransfer`].
    Cancel(AttemptKey, Reason),
}

impl fmt::Display for Observed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Start(k) => write!(f, "start {k}"),
            Self::Release(k, r) => write!(f, "release {k} ({r})"),
            Self::Fail(k, r) => write!(f, "fail {k} ({r})"),
            Self::Reject(k, r) => write!(f, "reject {k} ({r})"),
            Self::Cancel(k, r) => write!(f, "cancel {k} ({r})"),
        }
    }
}

/// The simulator: a matcher, a virtual clock, a driver that runs started transfers until told
/// to finish them, and the ledger.
#[derive(Debug)]
pub struct Sim {
    matcher: Matcher<Token, Token>,
    now: Timestamp,
    next_id: u64,
    outstanding: HashSet<u64>,
    in_flight: HashMap<AttemptKey, (Token, Token)>,
    started: HashSet<AttemptKey>,
    newest: HashMap<TransferId, Attempt>,
    log: Vec<Observed>,
}

/// The transfer id of transfer number `n`.
#[must_use]
pub fn transfer_id(n: u8) -> TransferId {
    TransferId(0x5eed_0000_0000 + u128::from(n))
}

/// The key of transfer number `transfer`, attempt `attempt`.
#[must_use]
pub fn key(transfer: u8, attempt: u8) -> AttemptKey {
    AttemptKey::new(transfer_id(transfer), Attempt(u32::from(attempt)))
}

/// The identity of consumer number `n`.
#[must_use]
pub fn consumer(n: u8) -> ConsumerId {
    ConsumerId {
        engine: EngineId(u64::from(n)),
        incarnation: Incarnation(1),
    }
}

impl Sim {
    /// A simulator around a matcher with `config`, at time zero.
    ///
    /// # Errors
    /// The matcher's [`ConfigError`].
    pub fn new(config: Config) -> Result<Self, ConfigError> {
        Ok(Self {
            matcher: Matcher::new(config)?,
            now: Timestamp::ZERO,
            next_id: 0,
            outstanding: HashSet::new(),
            in_flight: HashMap::new(),
            started: HashSet::new(),
            newest: HashMap::new(),
            log: Vec::new(),
        })
    }

    /// The matcher under test.
    #[must_use]
    pub const fn matcher(&self) -> &Matcher<Token, Token> {
        &self.matcher
    }

    /// The simulator's clock.
    #[must_use]
    pub const fn now(&self) -> Timestamp {
        self.now
    }

    /// Transfers started so far.
    #[must_use]
    pub fn started(&self) -> usize {
        self.started.len()
    }

    /// Tokens handed in and not yet back.
    #[must_use]
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// Every action seen so far, in order, and forgets them.
    pub fn take_log(&mut self) -> Vec<Observed> {
        std::mem::take(&mut self.log)
    }

    fn token(&mut self, key: AttemptKey, side: Side) -> Token {
        self.next_id += 1;
        self.outstanding.insert(self.next_id);
        Token {
            id: self.next_id,
            key,
            side,
        }
    }

    fn saw(&mut self, transfer: TransferId, attempt: Attempt) {
        let newest = self.newest.entry(transfer).or_insert(attempt);
        if attempt > *newest {
            *newest = attempt;
        }
    }

    /// Whether no tombstone can have been forgotten yet, so the strict checks apply.
    fn memory_intact(&self) -> bool {
        self.matcher.stats().tombstones_forgotten == 0
    }

    /// Applies one event, lets the driver react to the actions, runs expiry at the current time
    /// and checks every invariant.
    ///
    /// # Errors
    /// The first [`Violation`] found.
    pub fn step(&mut self, event: SimEvent) -> Result<(), Violation> {
        let now = self.now;
        match event {
            SimEvent::Register {
                transfer,
                attempt,
                consumer: c,
                lease_ms,
            } => {
                let k = key(transfer, attempt);
                self.saw(k.transfer, k.attempt);
                let token = self.token(k, Side::Consumer);
                let lease = Duration::from_millis(u64::from(lease_ms));
                self.matcher.register(now, k, consumer(c), lease, token);
            }
            SimEvent::PrefillDone { transfer, attempt } => {
                let k = key(transfer, attempt);
                self.saw(k.transfer, k.attempt);
                let token = self.token(k, Side::Producer);
                self.matcher.prefill_done(now, k, token);
            }
            SimEvent::Abort { transfer, attempt } => {
                let t = transfer_id(transfer);
                let attempt = attempt.map(|a| Attempt(u32::from(a)));
                if let Some(a) = attempt {
                    self.saw(t, a);
                }
                self.matcher.abort(now, t, attempt, Reason::Aborted);
            }
            SimEvent::Preempt { transfer, attempt } => {
                let k = key(transfer, attempt);
                self.saw(k.transfer, k.attempt);
                self.matcher.preempt(now, k);
            }
            SimEvent::Heartbeat {
                consumer: c,
                transfers,
            } => {
                let ids: Vec<TransferId> = transfers.into_iter().map(transfer_id).collect();
                self.matcher.heartbeat(now, consumer(c), ids);
            }
            SimEvent::Finish {
                transfer,
                attempt,
                ok,
            } => {
                let k = key(transfer, attempt);
                let outcome = if ok {
                    TransferOutcome::Succeeded
                } else {
                    TransferOutcome::Failed
                };
                self.finish_transfer(k, outcome);
            }
            SimEvent::Advance { ms } => {
                self.now = self.now + Duration::from_millis(u64::from(ms));
            }
            SimEvent::Rewind { ms } => {
                self.now = Timestamp::from_nanos(
                    self.now
                        .as_nanos()
                        .saturating_sub(u64::from(ms) * 1_000_000),
                );
            }
        }
        self.settle()
    }

    /// The driver ends a transfer: it releases both payloads and reports to the matcher.
    fn finish_transfer(&mut self, key: AttemptKey, outcome: TransferOutcome) {
        if let Some((blocks, destination)) = self.in_flight.remove(&key) {
            self.outstanding.remove(&blocks.id);
            self.outstanding.remove(&destination.id);
        }
        self.matcher.transfer_finished(self.now, key, outcome);
    }

    /// Drains actions (reacting to each), runs expiry, drains again, then checks.
    fn settle(&mut self) -> Result<(), Violation> {
        self.drain()?;
        self.matcher.handle_timeout(self.now);
        self.drain()?;
        self.check()
    }

    fn give_back(
        &mut self,
        token: &Token,
        action_key: AttemptKey,
        side: Side,
        what: &'static str,
    ) -> Result<(), Violation> {
        if !self.outstanding.remove(&token.id) {
            return Err(Violation::NotOutstanding { id: token.id });
        }
        if token.key != action_key || token.side != side {
            return Err(Violation::WrongPayload {
                id: token.id,
                token_key: token.key,
                action_key,
                what,
            });
        }
        Ok(())
    }

    fn drain(&mut self) -> Result<(), Violation> {
        while let Some(action) = self.matcher.poll_action() {
            match action {
                Action::StartTransfer {
                    key,
                    blocks,
                    destination,
                    ..
                } => {
                    self.log.push(Observed::Start(key));
                    if blocks.key != key
                        || destination.key != key
                        || blocks.side != Side::Producer
                        || destination.side != Side::Consumer
                    {
                        return Err(Violation::StalePairing {
                            key,
                            blocks: blocks.key,
                            destination: destination.key,
                        });
                    }
                    if !self.outstanding.contains(&blocks.id) {
                        return Err(Violation::NotOutstanding { id: blocks.id });
                    }
                    if !self.outstanding.contains(&destination.id) {
                        return Err(Violation::NotOutstanding { id: destination.id });
                    }
                    let strict = self.memory_intact();
                    if !self.started.insert(key) && strict {
                        return Err(Violation::DoubleStart { key });
                    }
                    if let Some(newest) = self.newest.get(&key.transfer) {
                        if *newest > key.attempt && strict {
                            return Err(Violation::StartedAfterSuperseded {
                                key,
                                newest: *newest,
                            });
                        }
                    }
                    if self.in_flight.insert(key, (blocks, destination)).is_some() {
                        return Err(Violation::DoubleStart { key });
                    }
                }
                Action::ReleaseProducer {
                    key,
                    blocks,
                    reason,
                    ..
                } => {
                    self.log.push(Observed::Release(key, reason));
                    self.give_back(&blocks, key, Side::Producer, "release")?;
                }
                Action::FailConsumer {
                    key,
                    destination,
                    reason,
                    ..
                } => {
                    self.log.push(Observed::Fail(key, reason));
                    self.give_back(&destination, key, Side::Consumer, "fail")?;
                }
                Action::RejectRegistration {
                    key,
                    destination,
                    reason,
                    ..
                } => {
                    self.log.push(Observed::Reject(key, reason));
                    self.give_back(&destination, key, Side::Consumer, "reject")?;
                }
                Action::CancelTransfer { key, reason, .. } => {
                    self.log.push(Observed::Cancel(key, reason));
                    if !self.in_flight.contains_key(&key) {
                        return Err(Violation::CancelNotInFlight { key });
                    }
                    // The driver stops the writes, frees both payloads and reports the end.
                    self.finish_transfer(key, TransferOutcome::Failed);
                }
            }
        }
        Ok(())
    }

    fn check(&mut self) -> Result<(), Violation> {
        self.matcher
            .check_consistency()
            .map_err(|e| Violation::Inconsistent(e.to_string()))?;
        let now = self.matcher.now();
        let mut earliest: Option<Timestamp> = None;
        for entry in self.matcher.entries() {
            if entry.deadline <= now {
                return Err(Violation::HeldPastLease {
                    key: entry.key,
                    deadline: entry.deadline,
                    now,
                });
            }
            earliest = Some(earliest.map_or(entry.deadline, |e| e.min(entry.deadline)));
        }
        let got = self.matcher.poll_timeout();
        if got != earliest {
            return Err(Violation::WrongTimeout {
                expected: earliest,
                got,
            });
        }
        if self.matcher.in_flight() != self.in_flight.len() {
            return Err(Violation::Inconsistent(format!(
                "matcher has {} in flight, driver {}",
                self.matcher.in_flight(),
                self.in_flight.len()
            )));
        }
        let held = self.matcher.held_producers()
            + self.matcher.held_consumers()
            + 2 * self.in_flight.len();
        if held != self.outstanding.len() {
            return Err(Violation::Leak {
                outstanding: self.outstanding.len(),
                held,
            });
        }
        Ok(())
    }

    /// Ends the run: finishes every transfer still in flight (successfully), lets the clock run
    /// past every lease and checks that every token came back exactly once.
    ///
    /// # Errors
    /// The first [`Violation`] found, or [`Violation::Leak`] if a token never came back.
    pub fn finish(&mut self) -> Result<(), Violation> {
        let keys: Vec<AttemptKey> = self.in_flight.keys().copied().collect();
        for key in keys {
            self.finish_transfer(key, TransferOutcome::Succeeded);
        }
        self.settle()?;
        let config = self.matcher.config();
        let horizon = config.producer_lease.max(config.max_registration_lease)
            + config.transfer_timeout
            + Duration::from_millis(1);
        self.now = self.matcher.now() + horizon;
        self.settle()?;
        if !self.outstanding.is_empty() || !self.matcher.is_empty() {
            return Err(Violation::Leak {
                outstanding: self.outstanding.len(),
                held: self.matcher.len(),
            });
        }
        Ok(())
    }

    /// Ends the run by shutting the matcher down instead of waiting for leases, then checks
    /// that every token came back exactly once.
    ///
    /// # Errors
    /// As [`Sim::finish`].
    pub fn shutdown(&mut self) -> Result<(), Violation> {
        self.matcher.shutdown(self.now);
        self.drain()?;
        self.check()?;
        if !self.outstanding.is_empty() || !self.matcher.is_empty() {
            return Err(Violation::Leak {
                outstanding: self.outstanding.len(),
                held: self.matcher.len(),
            });
        }
        Ok(())
    }
}
