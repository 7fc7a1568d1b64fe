//! Errors of the connector's engine-facing API.

use std::io;

use kvx_core::{BlockId, Rank};
use kvx_layout::{LayoutError, PlanError};
use kvx_rdma::error::RegisterError;

use crate::driver::PostError;
use kvx_rendezvous::{AttemptKey, ConfigError, WaiterConfigError};

use crate::control::ControlError;
pub(crate) use crate::control::LinkError;

/// Why a connector side could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The cache layout is invalid.
    #[error("invalid KV cache layout: {0}")]
    Layout(#[from] LayoutError),
    /// The engine gave a different number of regions than the layout has.
    #[error("the layout has {expected} regions but {given} were given")]
    RegionCount {
        /// Regions the layout needs.
        expected: u32,
        /// Regions given.
        given: usize,
    },
    /// A region's index is not its position in the list.
    #[error("region at position {position} says it is region {index}")]
    RegionIndex {
        /// Position in the list.
        position: usize,
        /// The index it carries.
        index: u32,
    },
    /// A region is smaller than the layout needs.
    #[error("region {index} has {len} bytes but the layout needs {needed}")]
    RegionTooSmall {
        /// Region index.
        index: u32,
        /// Its length.
        len: u64,
        /// Bytes the layout needs.
        needed: u64,
    },
    /// Registering memory with the transport failed.
    #[error("cannot register region with the transport: {0}")]
    Register(#[from] RegisterError),
    /// The matcher configuration is invalid.
    #[error("invalid rendezvous configuration: {0}")]
    Config(#[from] ConfigError),
    /// The waiter configuration is invalid.
    #[error("invalid waiter configuration: {0}")]
    WaiterConfig(#[from] WaiterConfigError),
    /// A duration or count of [`ConnectorConfig`](crate::ConnectorConfig) that must be positive
    /// is zero (a zero heartbeat interval, for one, would wake the driver without pause).
    #[error("connector setting `{0}` must be greater than zero")]
    ZeroSetting(&'static str),
    /// A duration setting is longer than kvx allows.
    #[error("connector setting `{setting}` must be at most {max:?}")]
    TooLong {
        /// The setting.
        setting: &'static str,
        /// The most allowed.
        max: std::time::Duration,
    },
    /// A producer would listen on a non-loopback address without a deployment key.
    #[error(
        "kvx: the control address {listen} is reachable from the network but no deployment key \
         is set: make one with `kvx keygen PATH` (mode 0600), copy it to every prefill, decode \
         and router of the deployment, and pass it as auth_key_file (vLLM extra config), \
         --auth-key-file or KVX_AUTH_KEY_FILE; or accept an open control plane with \
         allow_unauthenticated"
    )]
    Unauthenticated {
        /// The control address.
        listen: std::net::SocketAddr,
    },
    /// Binding the control address failed.
    #[error("cannot listen on the control address: {0}")]
    Listen(#[source] io::Error),
    /// A thread could not be started.
    #[error("cannot start a connector thread: {0}")]
    Thread(#[source] io::Error),
}

/// The connector's threads are gone (after shutdown or a crash of a driver thread).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the connector has shut down")]
pub struct Closed;

/// Why a request's transfer could not start or be posted. Its text is the request's failure
/// detail.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum TransferError {
    /// A token count does not fit the wire's 32 bits.
    #[error("too many tokens")]
    TooManyTokens,
    /// Planning failed.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The peer connection failed.
    #[error(transparent)]
    Link(#[from] LinkError),
    /// The two sides' memory orders differ and this build cannot re-lay-out this memory.
    #[error(
        "a memory-order re-layout is needed but this build cannot re-lay-out the cache's \
         memory (host memory, or CUDA memory with the `cuda` feature)"
    )]
    CannotReLayout,
    /// The registration could not be sent to a producer rank.
    #[error("cannot register with {rank}: {source}")]
    Register {
        rank: Rank,
        #[source]
        source: ControlError,
    },
    /// A producer rank is not connected.
    #[error("not connected")]
    NotConnected,
    /// Posting the reads from a producer rank failed.
    #[error("cannot post reads from {rank}: {source}")]
    Read {
        rank: Rank,
        #[source]
        source: PostError,
    },
    /// The blocks of a request to write are no longer held.
    #[error("the request's blocks are gone")]
    BlocksGone,
    /// The consumer's control connection is gone.
    #[error("the consumer's connection is gone")]
    ConnectionGone,
    /// The consumer never said hello.
    #[error("no hello from the consumer")]
    NoConsumerHello,
    /// The writes of a transfer could not be planned.
    #[error("cannot plan {key}: {source}")]
    PlanOf {
        key: AttemptKey,
        #[source]
        source: PlanError,
    },
    /// The writes of a transfer could not be posted.
    #[error("cannot post the writes of {key}: {source}")]
    Write {
        key: AttemptKey,
        #[source]
        source: PostError,
    },
    /// The CUDA re-layout kernels failed.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] kvx_rdma::cuda::CudaError),
    /// No re-layout kernels.
    #[cfg(feature = "cuda")]
    #[error("no layout kernels")]
    NoKernels,
}

/// A registration whose destination does not fit the consumer's layout.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum BadDestination {
    /// It names another consumer rank than the connection's.
    #[error("registration for {registered} on the connection of {connection}")]
    WrongRank { registered: Rank, connection: Rank },
    /// Its blocks cannot hold its tokens.
    #[error("{blocks} blocks cannot hold {tokens} tokens")]
    TooFewBlocks { blocks: usize, tokens: u32 },
    /// It names far more blocks than its tokens need, or more tokens than the cache holds.
    #[error(
        "{blocks} blocks for {tokens} tokens: more than the tokens need, or more tokens than \
         the consumer's {num_blocks} blocks hold"
    )]
    TooManyBlocks {
        blocks: usize,
        tokens: u32,
        num_blocks: u32,
    },
    /// A block is outside the consumer's cache.
    #[error("block {block} is outside the consumer's {num_blocks} blocks")]
    BlockOutOfRange { block: BlockId, num_blocks: u32 },
}
