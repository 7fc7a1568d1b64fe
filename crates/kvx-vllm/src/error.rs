//! Errors of the connector's engine-facing API.

use std::io;

use kvx_layout::LayoutError;
use kvx_rdma::error::RegisterError;
use kvx_rendezvous::{ConfigError, WaiterConfigError};

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
