//! # kvx-rendezvous
//!
//! The sans-IO rendezvous of push KV transfer. A decode instance *registers* where a request's
//! KV must land; the prefill instance *finishes* the request's prefill. The two halves arrive in
//! either order: the [`Matcher`] holds the first and, when the second arrives, emits exactly one
//! [`Action::StartTransfer`] for the pair. The [`Waiter`] is the decode side's mirror: it counts
//! completion notices from the producer ranks and reports the attempt ready or failed.
//!
//! Both are pure state machines: no threads, no clock, no I/O. Time is an argument
//! ([`Timestamp`]), [`Matcher::poll_timeout`] says when to wake the machine next, and everything
//! it wants done comes out of [`Matcher::poll_action`]. The payloads `P` (the producer's held
//! blocks) and `R` (the registration's destination) are generic, so a driver can put RAII
//! guards in them: a payload leaves the matcher only inside an action, which makes "every held
//! block is released exactly once" a matter of move semantics.
//!
//! * **Attempts.** A preempted or retried request comes back with a higher [`Attempt`] (or a
//!   new transfer id). Halves of older attempts are handed back ([`Reason::Stale`],
//!   [`Reason::Superseded`]) and never paired with newer ones; duplicates are refused
//!   idempotently ([`Reason::Duplicate`]), also after the transfer, for as long as the
//!   attempt's tombstone is remembered.
//! * **Leases.** Held blocks and held registrations expire; heartbeats extend them in O(1);
//!   expiry costs O(log n) per expiring entry, whatever the order of deadlines.
//! * **Bounds.** At most [`Config::max_entries`] live entries; beyond, a half is refused with
//!   [`Reason::Capacity`], never dropped.
//!
//! [`Attempt`]: kvx_core::ids::Attempt
//!
//! ```
//! use std::time::Duration;
//! use kvx_core::{Attempt, EngineId, Incarnation, TransferId};
//! use kvx_rendezvous::{Action, AttemptKey, Config, ConsumerId, Matcher, Reason, Timestamp};
//!
//! // Payloads: the producer's block ids and the consumer's destination block ids.
//! let mut matcher: Matcher<Vec<u32>, Vec<u32>> = Matcher::new(Config::default())?;
//! let decode = ConsumerId { engine: EngineId(2), incarnation: Incarnation(77) };
//! let key = AttemptKey::new(TransferId::from_str_hash("cmpl-1"), Attempt::FIRST);
//!
//! // Decode registers first (while prefill is still running): held, nothing to do yet.
//! let t0 = Timestamp::from_millis(0);
//! matcher.register(t0, key, decode, Duration::from_secs(10), vec![40, 41]);
//! assert!(matcher.poll_action().is_none());
//! assert_eq!(matcher.poll_timeout(), Some(t0 + Duration::from_secs(10)));
//!
//! // Prefill finishes: the pair starts exactly one transfer.
//! let t1 = Timestamp::from_millis(120);
//! matcher.prefill_done(t1, key, vec![7, 8]);
//! match matcher.poll_action() {
//!     Some(Action::StartTransfer { key: k, blocks, destination, .. }) => {
//!         assert_eq!((k, blocks, destination), (key, vec![7, 8], vec![40, 41]));
//!     }
//!     other => panic!("expected a start, got {other:?}"),
//! }
//! // A late duplicate prefill-done is handed straight back, never started again.
//! matcher.prefill_done(t1, key, vec![7, 8]);
//! assert!(matches!(
//!     matcher.poll_action(),
//!     Some(Action::ReleaseProducer { reason: Reason::Duplicate, .. })
//! ));
//!
//! // A prefill whose registration never comes is released when its lease runs out.
//! let lonely = AttemptKey::new(TransferId::from_str_hash("cmpl-2"), Attempt::FIRST);
//! matcher.prefill_done(t1, lonely, vec![9]);
//! let wake = matcher.poll_timeout().expect("a lease is running");
//! matcher.handle_timeout(wake);
//! assert!(matches!(
//!     matcher.poll_action(),
//!     Some(Action::ReleaseProducer { reason: Reason::LeaseExpired, blocks, .. }) if blocks == vec![9]
//! ));
//! # Ok::<(), kvx_rendezvous::ConfigError>(())
//! ```
//!
//! The state diagram, the tables of events, actions and lease rules are in
//! `docs/rendezvous.md`.
#![forbid(unsafe_code)]

pub mod matcher;
pub mod sim;
mod time;
mod timer;
mod types;
pub mod waiter;

pub use matcher::{
    Action, Config, ConfigError, EntryInfo, EntryState, Event, Matcher, MatcherStats,
};
pub use time::Timestamp;
pub use types::{AttemptKey, ConsumerId, Reason, TransferOutcome};
pub use waiter::{Notice, Waiter, WaiterAction, WaiterConfig, WaiterConfigError};
