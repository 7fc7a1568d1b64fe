//! Why a control link to a peer failed: the error every request waiting on that peer fails
//! with.

use std::io;
use std::net::SocketAddr;

use kvx_core::{LayoutSpec, Rank};
use kvx_layout::{LayoutError, PlanError};
use kvx_rdma::error::ConnectError;

use super::ControlError;

/// Why a control connection to a peer failed or was refused. Its text is the detail that the
/// requests waiting on that peer fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum LinkError {
    /// Connecting, reading, writing or encoding failed.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The socket's timeouts could not be set.
    #[error("cannot set the control socket's timeouts: {0}")]
    Timeouts(#[source] io::Error),
    /// The hello could not be sent.
    #[error("cannot send hello to {addr}: {source}")]
    SendHello {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    /// The peer answered with something else than a hello.
    #[error("{addr} did not answer with a hello")]
    NotAHello { addr: SocketAddr },
    /// The peer's hello never came.
    #[error("no hello from {addr}: {source}")]
    NoHello {
        addr: SocketAddr,
        #[source]
        source: ControlError,
    },
    /// A connecting peer's first message is not a hello.
    #[error("the first message was not a hello")]
    FirstNotHello,
    #[error("cannot authenticate with {addr}: {source} (both sides need the same deployment key: auth_key_file)")]
    Authenticate {
        addr: SocketAddr,
        source: super::secure::HandshakeError,
    },
    #[error("the peer did not authenticate: {0}")]
    Unauthenticated(super::secure::HandshakeError),
    /// The handshake's helper thread could not be started.
    #[error("cannot start a handshake with {addr}: {source}")]
    HandshakeThread {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    /// The connection's reader thread could not be started.
    #[error("cannot start the control reader of {addr}: {source}")]
    Reader {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    /// A producer's peer says it is not a consumer.
    #[error("peer is not a consumer")]
    NotAConsumer,
    /// A consumer's peer says it is not a producer.
    #[error("{addr} is not a producer")]
    NotAProducer { addr: SocketAddr },
    /// A consumer's model differs from this producer's.
    #[error("incompatible model: consumer layout {consumer:?}, producer layout {producer:?}")]
    IncompatibleConsumer {
        consumer: Box<LayoutSpec>,
        producer: Box<LayoutSpec>,
    },
    /// A producer's model differs from this consumer's.
    #[error("{addr} serves an incompatible model: {theirs:?} vs {ours:?}")]
    IncompatibleProducer {
        addr: SocketAddr,
        theirs: Box<LayoutSpec>,
        ours: Box<LayoutSpec>,
    },
    /// The producer's transport is not this side's (another backend, or another provider or
    /// plugin of it): both must name the same `transport`.
    #[error(
        "{addr} moves KV over {theirs} but this side over {ours}: set the same transport on \
         prefill and decode"
    )]
    TransportMismatch {
        addr: SocketAddr,
        /// This side's transport (`backend/provider`).
        ours: String,
        /// The producer's.
        theirs: String,
    },
    /// A producer rank answered for another rank.
    #[error("{addr} says it is rank {said}, expected {expected}")]
    WrongRank {
        addr: SocketAddr,
        said: u32,
        expected: Rank,
    },
    /// The peer's layout is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The peer's endpoint description cannot be read.
    #[error("unreadable endpoint description")]
    EndpointDesc,
    /// The transport cannot reach the peer.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The peer's TP size cannot serve this side's heads.
    #[error(transparent)]
    Writers(#[from] PlanError),
}
