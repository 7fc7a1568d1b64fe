//! # kvx-core
//!
//! The vocabulary every kvx crate shares: typed ids, memory kinds, the description of a KV-cache
//! layout, and the versioned wire messages of the push protocol with their binary codec.
//!
//! This crate does no I/O, reads no clock and contains no `unsafe`.
//!
//! ```
//! use kvx_core::ids::{Attempt, BlockId, EngineId, Incarnation, Rank, RequestId, TransferId};
//! use kvx_core::wire::{Message, Registration};
//!
//! let registration = Message::Registration(Registration {
//!     transfer: TransferId::from_str_hash("cmpl-42"),
//!     attempt: Attempt::FIRST,
//!     request: RequestId::from_str_hash("cmpl-42"),
//!     consumer: EngineId(7),
//!     consumer_incarnation: Incarnation(1),
//!     consumer_rank: Rank(0),
//!     num_tokens: 40,
//!     skip_tokens: 0,
//!     lease_ms: 30_000,
//!     notice: 7,
//!     blocks: vec![BlockId(3), BlockId(4), BlockId(9)],
//!     groups: Vec::new(),
//!     capability: None,
//! });
//! let bytes = registration.to_bytes()?;
//! assert_eq!(Message::decode_exact(&bytes)?, registration);
//! // A truncated frame is an error, never a panic.
//! assert!(Message::decode_exact(&bytes[..bytes.len() - 1]).is_err());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

pub mod blocks;
pub mod ids;
pub mod layout;
pub mod memory;
pub mod wire;

pub use blocks::{GroupBlocks, RequestBlocks, MAX_GROUPS};
pub use ids::{Attempt, BlockId, EngineId, Incarnation, Rank, RequestId, TransferId};
pub use layout::{Arrangement, Dtype, LayoutSpec, MemoryOrder, UnknownName};
pub use memory::{MemoryKind, RegionDesc};

impl LayoutSpec {
    /// Hash of what two engines must agree on to exchange KV: the model's shape and dtype. Block
    /// size, TP degree, memory order and arrangement may differ; the planner bridges those.
    #[must_use]
    pub fn compat_hash(&self) -> u64 {
        let mut bytes = Vec::with_capacity(16);
        bytes.extend_from_slice(&self.num_layers.to_le_bytes());
        let heads = if self.mla { 1 } else { self.total_kv_heads };
        bytes.extend_from_slice(&heads.to_le_bytes());
        bytes.extend_from_slice(&self.head_dim.to_le_bytes());
        bytes.push(self.dtype.size() as u8);
        bytes.extend_from_slice(self.dtype.name().as_bytes());
        bytes.push(u8::from(self.mla));
        ids::fnv1a_64(&bytes)
    }
}
