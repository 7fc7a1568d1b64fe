//! A router's side of the control protocol ([`Role::Router`]).
//!
//! A router (`kvx proxy`) that gives up a dispatch after prefill may already have finished it —
//! in push, a decode leg that could not be connected, so the retry goes elsewhere under a new
//! transfer id; in pull, no decode reachable at all — tells every rank of that prefill instance
//! to give the transfer's KV back now ([`abandon`]), instead of holding it until its lease. A
//! prefill rank honours it only for a transfer no consumer registered, and remembers it for a
//! prefill that finishes later (its blocks then go back at once).

use std::io::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use kvx_core::wire::{Abort, Hello, Message, Role};
use kvx_core::{EngineId, Incarnation, Rank, TransferId};

use crate::control;
use crate::settings::rank_addr;

/// How long the capability of a router's abandon stays valid at least.
const ABANDON_GRANT: Duration = Duration::from_secs(60);

/// Why a router could not tell a prefill instance to abandon a transfer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    /// Connecting to, writing to or reading from one of the instance's ranks failed.
    #[error("prefill rank {rank} at {addr}: {detail}")]
    Control {
        /// The rank.
        rank: Rank,
        /// Its control address.
        addr: SocketAddr,
        /// What failed.
        detail: String,
    },
    /// The peer's hello is not that of a producer of that rank.
    #[error("{addr} is not the kvx prefill (producer) rank expected there: {answer}")]
    NotAProducer {
        /// The address connected.
        addr: SocketAddr,
        /// What it answered.
        answer: String,
    },
}

/// Tells every rank of the prefill instance whose rank 0 listens at `instance` to give the KV
/// of `transfer` (the router's transfer id, as in `kv_transfer_params`) back now. Each step is
/// bounded by `timeout`, authenticated with the deployment key `key` where the deployment has
/// one (the abort then carries a capability for the transfer, which prefill requires); returns
/// how many ranks were told. A router must only abandon ids it
/// never handed to a decode instance: a prefill rank cannot tell a pull read in progress from
/// an orphan (see wire-protocol.md, "Routers").
///
/// # Errors
/// [`RouterError`] for rank 0 (the others cannot be known without its hello), or for the first
/// other rank that could not be told (every other rank was still tried).
pub fn abandon(
    instance: SocketAddr,
    transfer: &str,
    reason: &str,
    timeout: Duration,
    key: Option<&crate::AuthKey>,
) -> Result<u32, RouterError> {
    let transfer = TransferId::from_str_hash(transfer);
    let capability = key.map(|key| {
        key.grant(
            transfer,
            EngineId(0),
            &instance.to_string(),
            std::time::SystemTime::now() + timeout.max(ABANDON_GRANT),
        )
    });
    let abort = Message::Abort(Abort {
        transfer,
        attempt: None,
        reason: reason.to_owned(),
        capability,
    });
    let hello = Message::Hello(Hello::router(
        EngineId(u64::from(std::process::id())),
        Incarnation(0),
    ));
    let ranks = tell(instance, Rank(0), &hello, &abort, timeout, key)?;
    let mut first_error = None;
    for rank in 1..ranks {
        if let Err(e) = tell(instance, Rank(rank), &hello, &abort, timeout, key) {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(ranks), Err)
}

/// Sends `abort` to rank `rank` of `instance`; returns the instance's TP size, from the rank's
/// hello.
fn tell(
    instance: SocketAddr,
    rank: Rank,
    hello: &Message,
    abort: &Message,
    timeout: Duration,
    key: Option<&crate::AuthKey>,
) -> Result<u32, RouterError> {
    let addr = rank_addr(instance, rank);
    let (mut stream, theirs) =
        control::handshake(addr, hello, timeout, true, key).map_err(|e| RouterError::Control {
            rank,
            addr,
            detail: e.to_string(),
        })?;
    if theirs.role != Role::Producer || theirs.layout.tp_rank != rank.0 {
        return Err(RouterError::NotAProducer {
            addr,
            answer: format!("{:?} rank {}", theirs.role, theirs.layout.tp_rank),
        });
    }
    // The producer handles its connection's messages in order and reads the abort before the
    // close that follows.
    let bytes = abort.to_bytes().map_err(|e| RouterError::Control {
        rank,
        addr,
        detail: e.to_string(),
    })?;
    stream.write_all(&bytes).map_err(|e| RouterError::Control {
        rank,
        addr,
        detail: format!("cannot send the abort: {e}"),
    })?;
    Ok(theirs.layout.tp_size.max(1))
}
