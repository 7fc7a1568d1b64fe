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

use crate::common::rank_addr;
use crate::control::{self, ControlError};

/// Why a router could not tell a prefill instance to abandon a transfer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    /// Connecting to, writing to or reading from one of the instance's ranks failed.
    #[error("prefill rank {rank} at {addr}: {source}")]
    Control {
        /// The rank.
        rank: Rank,
        /// Its control address.
        addr: SocketAddr,
        /// What failed.
        #[source]
        source: ControlError,
    },
    /// The peer answered with something other than a producer's hello.
    #[error("{addr} is not a kvx prefill (producer) rank: {answer}")]
    NotAProducer {
        /// The address connected.
        addr: SocketAddr,
        /// What it answered.
        answer: String,
    },
}

/// Tells every rank of the prefill instance whose rank 0 listens at `instance` to give the KV
/// of `transfer` (the router's transfer id, as in `kv_transfer_params`) back now. Each step is
/// bounded by `timeout`; returns how many ranks were told.
///
/// # Errors
/// [`RouterError`] for the first rank that could not be told (those before it were).
pub fn abandon(
    instance: SocketAddr,
    transfer: &str,
    reason: &str,
    timeout: Duration,
) -> Result<u32, RouterError> {
    let abort = Message::Abort(Abort {
        transfer: TransferId::from_str_hash(transfer),
        attempt: None,
        reason: reason.to_owned(),
    });
    let hello = Message::Hello(Hello::router(
        EngineId(u64::from(std::process::id())),
        Incarnation(0),
    ));
    let mut ranks = 1;
    let mut rank = 0;
    while rank < ranks {
        let addr = rank_addr(instance, Rank(rank));
        let control = |source| RouterError::Control {
            rank: Rank(rank),
            addr,
            source,
        };
        let mut stream = control::connect(addr, timeout, true).map_err(control)?;
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(|e| control(ControlError::Write(e)))?;
        send(&mut stream, &hello).map_err(control)?;
        match control::read_message(&mut stream).map_err(control)? {
            Message::Hello(theirs) if theirs.role == Role::Producer => {
                if rank == 0 {
                    ranks = theirs.layout.tp_size.max(1);
                }
            }
            other => {
                return Err(RouterError::NotAProducer {
                    addr,
                    answer: format!("{other:?}"),
                })
            }
        }
        // The producer handles its connection's messages in order and reads the abort before
        // the close that follows.
        send(&mut stream, &abort).map_err(control)?;
        rank += 1;
    }
    Ok(ranks)
}

fn send(stream: &mut control::ControlStream, message: &Message) -> Result<(), ControlError> {
    let bytes = message.to_bytes()?;
    stream.write_all(&bytes).map_err(ControlError::Write)
}
