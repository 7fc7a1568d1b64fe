//! Errors of the transport operations, one enum per operation of
//! [`Transport`](crate::Transport), plus [`OpError`] for an operation that was accepted and
//! failed later (reported through [`Event::Failed`](crate::Event::Failed)).
//!
//! Backend failures carry the backend's own error as their source ([`BackendError`]), so that a
//! libfabric failure still says which call failed with which `fi_strerror` text.

use std::time::Duration;

use kvx_core::MemoryKind;

use crate::desc::DescError;
use crate::ids::PeerId;

/// A backend's own error (for libfabric: which `fi_*` call failed, with its error text).
pub type BackendError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// [`Transport::register`](crate::Transport::register) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// A region with this index is already registered.
    #[error("region {0} is already registered")]
    Duplicate(u32),
    /// The region has no bytes.
    #[error("region {0} is empty")]
    Empty(u32),
    /// The backend cannot register this kind of memory (yet).
    #[error("region {index}: {kind} memory is not supported by the {backend} transport")]
    UnsupportedKind {
        /// Region index.
        index: u32,
        /// Kind requested.
        kind: MemoryKind,
        /// Backend name.
        backend: &'static str,
    },
    /// The backend refused the registration.
    #[error("registering region {index} failed")]
    Backend {
        /// Region index.
        index: u32,
        /// The backend's error.
        #[source]
        source: BackendError,
    },
}

/// [`Transport::deregister`](crate::Transport::deregister) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeregisterError {
    /// No region with this index is registered.
    #[error("region {0} is not registered")]
    Unknown(u32),
    /// Operations still in flight use the region.
    #[error("region {index} is used by {ops} operations in flight")]
    InUse {
        /// Region index.
        index: u32,
        /// Operations that use it.
        ops: usize,
    },
    /// The backend failed to release the registration.
    #[error("deregistering region {index} failed")]
    Backend {
        /// Region index.
        index: u32,
        /// The backend's error.
        #[source]
        source: BackendError,
    },
}

/// [`Transport::connect`](crate::Transport::connect) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The description is malformed or inconsistent.
    #[error("bad endpoint description")]
    BadDescription(#[source] DescError),
    /// The description belongs to another backend or provider.
    #[error("endpoint description is for {found}, this transport is {expected}")]
    Mismatch {
        /// What this transport is (`backend/provider`).
        expected: String,
        /// What the description names.
        found: String,
    },
    /// The peer's address is not one this transport can reach.
    #[error("peer address is unusable by this endpoint")]
    BadAddress {
        /// The backend's error.
        #[source]
        source: BackendError,
    },
    /// The peer cannot be reached.
    #[error("peer unreachable")]
    Unreachable {
        /// The backend's error.
        #[source]
        source: BackendError,
    },
}

/// Which side of a [`CopyOp`](kvx_layout::CopyOp) a check refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The producer side (`src_region`, `src_offset`, `src_stride`).
    Src,
    /// The consumer side (`dst_region`, `dst_offset`, `dst_stride`).
    Dst,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Src => "source",
            Self::Dst => "destination",
        })
    }
}

/// A list of copy operations does not fit the registered regions. Found before anything is
/// posted: a plan with one bad operation moves no byte.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlanError {
    /// The list is empty.
    #[error("no copy operations")]
    Empty,
    /// An operation moves no bytes (`len == 0` or `count == 0`) or its size overflows.
    #[error("operation {op} is degenerate (len {len}, count {count})")]
    Degenerate {
        /// Index of the operation in the list.
        op: usize,
        /// Bytes per piece.
        len: u64,
        /// Pieces.
        count: u64,
    },
    /// An operation names a region that is not registered on that side.
    #[error("operation {op}: {side} region {region} is not registered")]
    Unregistered {
        /// Index of the operation in the list.
        op: usize,
        /// Which side.
        side: Side,
        /// Region index.
        region: u32,
    },
    /// An operation reaches past the end of a region.
    #[error("operation {op}: {side} range ends at byte {end} of region {region}, which has {region_len}")]
    OutOfBounds {
        /// Index of the operation in the list.
        op: usize,
        /// Which side.
        side: Side,
        /// Region index.
        region: u32,
        /// One past the last byte the operation touches.
        end: u128,
        /// Length of the region.
        region_len: u64,
    },
}

/// [`Transport::write`](crate::Transport::write) refused the operations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// No peer with this id.
    #[error("unknown peer {0:?}")]
    UnknownPeer(PeerId),
    /// The operations do not fit the registered regions.
    #[error("invalid write plan")]
    Plan(#[from] PlanError),
    /// The notice does not fit the backend's remote-completion data.
    #[error("notice {notice:#x} does not fit in {bits} bits")]
    NoticeTooWide {
        /// The notice.
        notice: u64,
        /// Bits the backend carries.
        bits: u32,
    },
    /// A board notice names no slot of the peer's notice board.
    #[error("the peer's notice board cannot take this notice")]
    NoBoardSlot(#[from] SlotOutOfRange),
    /// The backend failed while posting.
    #[error("posting the write failed")]
    Backend(#[source] BackendError),
}

/// [`Transport::read`](crate::Transport::read) refused the operations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// No peer with this id.
    #[error("unknown peer {0:?}")]
    UnknownPeer(PeerId),
    /// The operations do not fit the registered regions.
    #[error("invalid read plan")]
    Plan(#[from] PlanError),
    /// The backend failed while posting.
    #[error("posting the read failed")]
    Backend(#[source] BackendError),
}

/// [`Transport::send`](crate::Transport::send) refused the message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// No peer with this id.
    #[error("unknown peer {0:?}")]
    UnknownPeer(PeerId),
    /// The message is longer than the transport carries.
    #[error("message of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Message length.
        len: usize,
        /// Limit ([`Capabilities::max_message_len`](crate::Capabilities::max_message_len)).
        max: usize,
    },
    /// Too many sends are in flight; poll and try again.
    #[error("too many sends in flight ({0})")]
    Busy(usize),
    /// The backend failed while posting.
    #[error("posting the send failed")]
    Backend(#[source] BackendError),
}

/// [`Transport::poll`](crate::Transport::poll) or [`Transport::wait`](crate::Transport::wait)
/// failed: the endpoint itself is broken (a failed operation is an [`Event::Failed`]
/// instead).
///
/// [`Event::Failed`]: crate::Event::Failed
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PollError {
    /// Reading completions failed.
    #[error("reading completions failed")]
    Backend(#[source] BackendError),
}

/// Why an accepted operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpError {
    /// The peer went away or refused the connection.
    #[error("peer unreachable")]
    PeerUnreachable {
        /// The backend's error.
        #[source]
        source: BackendError,
    },
    /// The peer no longer accepts the remote key (it deregistered the region or restarted).
    #[error("remote access refused")]
    RemoteAccess {
        /// The backend's error.
        #[source]
        source: BackendError,
    },
    /// The operation did not complete within the transport's operation timeout. Its memory stays
    /// registered-in-use until the backend gives the operation back.
    #[error("operation timed out after {0:?}")]
    TimedOut(Duration),
    /// Any other backend failure.
    #[error("operation failed")]
    Backend {
        /// The backend's error.
        #[source]
        source: BackendError,
    },
}

/// A board notice names a slot the board does not have.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("notice {notice:#x} names slot {slot} of a board of {slots} slots")]
pub struct SlotOutOfRange {
    /// The notice.
    pub notice: u64,
    /// Its slot.
    pub slot: u32,
    /// The board's slots.
    pub slots: usize,
}

/// A peer's backend address (the opaque part of its [`EndpointDesc`](crate::EndpointDesc)) is
/// malformed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum AddressError {
    /// The address ends inside a field.
    #[error("truncated at {0}")]
    Truncated(&'static str),
    /// The address does not start with this backend's magic.
    #[error("bad magic")]
    BadMagic,
    /// The address's format version is not one this build reads.
    #[error("unsupported version {0}")]
    Version(u8),
    /// Bytes are left after the last field.
    #[error("{0} trailing bytes")]
    Trailing(usize),
    /// A text field is not UTF-8 (or holds a NUL byte).
    #[error("{0} is not UTF-8 text without NUL bytes")]
    Text(&'static str),
    /// More regions than the address holds or a description allows.
    #[error("{0} regions")]
    RegionCount(usize),
    /// A region of the description has no entry in the address.
    #[error("region {0} has no IPC handle")]
    MissingRegion(u32),
    /// The address's checksum does not match its contents.
    #[error("corrupted (checksum mismatch)")]
    Checksum,
}
