//! Small value types shared by the producer-side [`Matcher`](crate::Matcher) and the
//! consumer-side [`Waiter`](crate::Waiter).

use std::fmt;

use kvx_core::ids::{Attempt, EngineId, Incarnation, TransferId};
use kvx_core::wire::{Completion, FailureNotice, FailureReason, Heartbeat, Registration};

/// One attempt of one transfer: the unit that is matched, started and finished at most once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AttemptKey {
    /// The router's transfer id.
    pub transfer: TransferId,
    /// The attempt; a higher attempt supersedes every lower one.
    pub attempt: Attempt,
}

impl AttemptKey {
    /// The key of `attempt` of `transfer`.
    #[must_use]
    pub const fn new(transfer: TransferId, attempt: Attempt) -> Self {
        Self { transfer, attempt }
    }
}

impl From<&Registration> for AttemptKey {
    fn from(r: &Registration) -> Self {
        Self::new(r.transfer, r.attempt)
    }
}

impl From<&Completion> for AttemptKey {
    fn from(c: &Completion) -> Self {
        Self::new(c.transfer, c.attempt)
    }
}

impl From<&FailureNotice> for AttemptKey {
    fn from(f: &FailureNotice) -> Self {
        Self::new(f.transfer, f.attempt)
    }
}

impl fmt::Display for AttemptKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.transfer, self.attempt)
    }
}

/// Who registered: a decode engine and the incarnation (process lifetime) it registered from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConsumerId {
    /// The decode engine.
    pub engine: EngineId,
    /// Its incarnation when it registered.
    pub incarnation: Incarnation,
}

impl From<&Registration> for ConsumerId {
    fn from(r: &Registration) -> Self {
        Self {
            engine: r.consumer,
            incarnation: r.consumer_incarnation,
        }
    }
}

impl From<&Heartbeat> for ConsumerId {
    fn from(h: &Heartbeat) -> Self {
        Self {
            engine: h.engine,
            incarnation: h.incarnation,
        }
    }
}

impl fmt::Display for ConsumerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.engine, self.incarnation)
    }
}

/// How a started transfer ended, as the driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TransferOutcome {
    /// Every write landed and every completion notice was sent.
    Succeeded,
    /// The transfer failed or was cancelled; the driver has told the consumer.
    Failed,
}

/// Why an action happened. Every action that hands a payload back, fails a side or cancels a
/// transfer says why with one of these; [`FailureReason::from`] maps each to the wire's coarser
/// reason for the failure notice to the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// This half's lease ran out before the other half arrived.
    LeaseExpired,
    /// The other half of this attempt had already expired when this one arrived.
    CounterpartExpired,
    /// The other half of this attempt had been refused (for capacity) when this one arrived.
    CounterpartRejected,
    /// A newer attempt of the same transfer arrived; this attempt is dead.
    Superseded,
    /// This half belongs to an attempt older than the newest one seen for the transfer.
    Stale,
    /// This half of this attempt was already received (held, started or finished).
    Duplicate,
    /// A registration for an attempt already registered by a different consumer.
    Conflict,
    /// The attempt, or the whole transfer, was aborted.
    Aborted,
    /// The request was preempted; it may come back as a higher attempt.
    Preempted,
    /// The matcher or waiter is at its configured size limit.
    Capacity,
    /// A started transfer was not reported finished within the transfer timeout.
    TransferTimeout,
    /// The transfer of this attempt failed.
    TransferFailed,
    /// The consumer reported the attempt failed, or a producer rank did.
    PeerFailed,
    /// The request named no producer rank to wait for.
    NoProducers,
    /// The state machine was shut down by its driver.
    Shutdown,
    /// The request's capability did not verify (forged, expired, for another engine), or its
    /// peer is not one this side may reach.
    Unauthorized,
}

impl Reason {
    /// The reason to record when the peer reports a failure with the wire's `reason` (for
    /// example [`Waiter::failure`](crate::Waiter::failure) on a `FailureNotice`).
    #[must_use]
    pub const fn from_peer(reason: FailureReason) -> Self {
        match reason {
            FailureReason::LeaseExpired => Self::CounterpartExpired,
            FailureReason::Aborted => Self::Aborted,
            FailureReason::Preempted => Self::Preempted,
            FailureReason::TransferFailed => Self::TransferFailed,
            _ => Self::PeerFailed,
        }
    }

    /// A short, stable, lower-case name for logs and metrics labels.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::LeaseExpired => "lease_expired",
            Self::CounterpartExpired => "counterpart_expired",
            Self::CounterpartRejected => "counterpart_rejected",
            Self::Superseded => "superseded",
            Self::Stale => "stale",
            Self::Duplicate => "duplicate",
            Self::Conflict => "conflict",
            Self::Aborted => "aborted",
            Self::Preempted => "preempted",
            Self::Capacity => "capacity",
            Self::TransferTimeout => "transfer_timeout",
            Self::TransferFailed => "transfer_failed",
            Self::PeerFailed => "peer_failed",
            Self::NoProducers => "no_producers",
            Self::Shutdown => "shutdown",
            Self::Unauthorized => "unauthorized",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<Reason> for FailureReason {
    fn from(reason: Reason) -> Self {
        match reason {
            Reason::LeaseExpired | Reason::CounterpartExpired => Self::LeaseExpired,
            Reason::CounterpartRejected
            | Reason::Stale
            | Reason::Duplicate
            | Reason::Conflict
            | Reason::Capacity
            | Reason::NoProducers
            | Reason::Unauthorized => Self::Rejected,
            Reason::Superseded | Reason::Aborted | Reason::Shutdown => Self::Aborted,
            Reason::Preempted => Self::Preempted,
            Reason::TransferTimeout | Reason::TransferFailed | Reason::PeerFailed => {
                Self::TransferFailed
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_map_to_wire_reasons() {
        assert_eq!(
            FailureReason::from(Reason::CounterpartExpired),
            FailureReason::LeaseExpired
        );
        assert_eq!(
            FailureReason::from(Reason::Capacity),
            FailureReason::Rejected
        );
        assert_eq!(
            FailureReason::from(Reason::Preempted),
            FailureReason::Preempted
        );
        assert_eq!(
            FailureReason::from(Reason::TransferTimeout),
            FailureReason::TransferFailed
        );
        assert_eq!(Reason::Stale.to_string(), "stale");
    }

    #[test]
    fn keys_and_identities_from_wire_messages() {
        use kvx_core::ids::{EngineId, Incarnation, Rank, RequestId};
        let registration = Registration {
            groups: Vec::new(),
            transfer: TransferId(5),
            attempt: Attempt(2),
            request: RequestId(1),
            consumer: EngineId(3),
            consumer_incarnation: Incarnation(4),
            consumer_rank: Rank(0),
            num_tokens: 16,
            skip_tokens: 0,
            lease_ms: 1_000,
            notice: 0,
            blocks: vec![],
            capability: None,
        };
        assert_eq!(
            AttemptKey::from(&registration),
            AttemptKey::new(TransferId(5), Attempt(2))
        );
        assert_eq!(
            ConsumerId::from(&registration),
            ConsumerId {
                engine: EngineId(3),
                incarnation: Incarnation(4)
            }
        );
        let completion = Completion {
            transfer: TransferId(6),
            attempt: Attempt(1),
            producer: EngineId(1),
            producer_rank: Rank(3),
            bytes: 0,
            capability: None,
        };
        assert_eq!(
            AttemptKey::from(&completion),
            AttemptKey::new(TransferId(6), Attempt(1))
        );
        let heartbeat = Heartbeat {
            engine: EngineId(8),
            incarnation: Incarnation(9),
            transfers: vec![],
        };
        assert_eq!(ConsumerId::from(&heartbeat).to_string(), "engine-8@inc-9");
        assert_eq!(
            Reason::from_peer(FailureReason::LeaseExpired),
            Reason::CounterpartExpired
        );
        assert_eq!(
            Reason::from_peer(FailureReason::Rejected),
            Reason::PeerFailed
        );
    }

    #[test]
    fn keys_display_and_order() {
        let a = AttemptKey::new(TransferId(7), Attempt(1));
        assert_eq!(a.to_string(), "xfer-7/attempt-1");
        assert!(a < AttemptKey::new(TransferId(7), Attempt(2)));
    }
}
