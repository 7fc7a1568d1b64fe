//! # kvx-layout
//!
//! KV-cache layouts and the transfer planner: given every producer rank's layout, one consumer
//! rank's layout, a request's token count and its block ids on both sides, compute the copy
//! operations that move exactly that request's KV into the consumer's blocks — for any ratio of
//! block sizes and of tensor-parallel degrees (in both directions, including TP larger than the
//! number of KV heads), MLA, every chunk arrangement and both memory orders. Contiguous runs are
//! merged, and runs that repeat at a fixed spacing become one strided operation, so a request
//! whose blocks are contiguous needs a number of operations independent of its length.
//!
//! Pure: no I/O, no clock, no `unsafe`.
//!
//! ```
//! use kvx_core::{Arrangement, BlockId, Dtype, LayoutSpec, MemoryOrder, Rank};
//! use kvx_layout::{plan, Layout, PlanRequest};
//!
//! let rank = |tp_size, tp_rank| {
//!     Layout::new(LayoutSpec {
//!         num_layers: 4,
//!         total_kv_heads: 8,
//!         head_dim: 128,
//!         dtype: Dtype::Bf16,
//!         mla: false,
//!         block_tokens: 16,
//!         num_blocks: 1000,
//!         tp_size,
//!         tp_rank,
//!         order: MemoryOrder::Hnd,
//!         arrangement: Arrangement::PerLayerSplit,
//!     })
//! };
//! // Prefill with TP 2 writes into decode rank 0 of TP 1.
//! let producers = [rank(2, 0)?, rank(2, 1)?];
//! let consumer = rank(1, 0)?;
//! let blocks: Vec<BlockId> = (100..164).map(BlockId).collect();
//! let plan = plan(&PlanRequest {
//!     producers: &producers,
//!     consumer: &consumer,
//!     num_tokens: 1024,
//!     skip_tokens: 0,
//!     producer_blocks: &blocks,
//!     consumer_blocks: &blocks,
//!     only_producer: None,
//!     producer_groups: &[],
//!     consumer_groups: &[],
//! })?;
//! assert_eq!(plan.writers().collect::<Vec<_>>(), [Rank(0), Rank(1)]);
//! // Contiguous blocks: one (strided) operation per producer rank, layer and K/V.
//! assert_eq!(plan.ops().len(), 2 * 4 * 2);
//! assert_eq!(plan.bytes(), 1024 * 4 * 2 * 8 * 128 * 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

pub mod error;
pub mod geometry;
pub mod plan;
pub mod planner;
pub mod synth;

/// The largest tensor-parallel size a layout may declare: far above any deployment (a rank per
/// attention head of the largest models), and small enough that what is sized by a peer's TP
/// size (per-rank tables, loops over its ranks) stays small.
pub const MAX_TP_SIZE: u32 = 1024;
pub use error::{LayoutError, PlanError, Side};
pub use geometry::{ChunkPlace, Layout};
pub use plan::{CopyOp, Permute};
pub use planner::{
    idle_producers, permute_for, plan, plan_layers, readers_for, writers_for, PermutePlan, Plan,
    PlanRequest,
};
