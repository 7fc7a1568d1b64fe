//! Errors of layout validation and planning.

use kvx_core::{BlockId, Rank};
use thiserror::Error;

/// A [`LayoutSpec`](kvx_core::LayoutSpec) that cannot describe a real cache.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// A dimension that must be positive is zero.
    #[error("layout field `{0}` must be positive")]
    Zero(&'static str),
    /// The tensor-parallel size is beyond any deployment's ([`crate::MAX_TP_SIZE`]): a peer
    /// that declares one is refused before anything is sized by it.
    #[error("tensor-parallel size {tp_size} is above the most kvx serves ({max})")]
    TpSizeTooLarge {
        /// The size declared.
        tp_size: u32,
        /// The most allowed.
        max: u32,
    },
    /// The rank is not below the TP size.
    #[error("tp_rank {rank} is not below tp_size {size}")]
    RankOutOfRange {
        /// The rank.
        rank: u32,
        /// The TP size.
        size: u32,
    },
    /// Neither the KV heads divide among the ranks nor the ranks among the heads.
    #[error("{heads} KV heads cannot be split over TP {tp}: one must divide the other")]
    HeadsNotDivisible {
        /// Model KV heads.
        heads: u32,
        /// TP size.
        tp: u32,
    },
    /// The cache would exceed the address space.
    #[error("layout sizes overflow 64 bits")]
    TooLarge,
    /// The arrangement keeps a chunk's heads apart, which only a head-major order can describe.
    #[error(
        "arrangement {arrangement} needs a head-major memory order (hnd or hnd-kt), not {order}"
    )]
    OrderArrangement {
        /// The order given.
        order: kvx_core::MemoryOrder,
        /// The arrangement given.
        arrangement: kvx_core::Arrangement,
    },
    /// Cells holding K then V keep a token's key vector whole, which dimension-major keys do not.
    #[error("arrangement per-layer-cell-kv keeps each key vector whole: use order nhd or hnd, not hnd-kt")]
    CellKeysDimensionMajor,
}

/// Which side of a plan a problem is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The prefill (writing) side.
    Producer,
    /// The decode (receiving) side.
    Consumer,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Producer => "producer",
            Self::Consumer => "consumer",
        })
    }
}

/// Why no plan could be made.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PlanError {
    /// Producer and consumer disagree on the model's shape.
    #[error("model mismatch on `{field}`: producer {producer}, consumer {consumer}")]
    ModelMismatch {
        /// The field.
        field: &'static str,
        /// Producer's value.
        producer: String,
        /// Consumer's value.
        consumer: String,
    },
    /// The producer ranks' layouts differ in more than their rank.
    #[error(
        "producer rank {rank} has a layout inconsistent with rank {reference}: `{field}` differs"
    )]
    ProducersInconsistent {
        /// The odd rank.
        rank: Rank,
        /// The rank it was compared with.
        reference: Rank,
        /// The first differing field.
        field: &'static str,
    },
    /// No producer layouts were given.
    #[error("no producer layouts given")]
    NoProducers,
    /// A producer rank the plan needs was not given (or given twice).
    #[error("producer rank {0} is needed but its layout was not given exactly once")]
    MissingProducer(Rank),
    /// Fewer blocks than the tokens need.
    #[error("{side} has {given} blocks but {needed} are needed for the tokens")]
    NotEnoughBlocks {
        /// Which side.
        side: Side,
        /// Blocks needed.
        needed: usize,
        /// Blocks given.
        given: usize,
    },
    /// A block id beyond the cache.
    #[error("{side} block {block} is out of range (cache has {num_blocks} blocks)")]
    BlockOutOfRange {
        /// Which side.
        side: Side,
        /// The id.
        block: BlockId,
        /// Blocks in that side's cache.
        num_blocks: u32,
    },
    /// The consumer lists one destination block twice.
    #[error("consumer block {0} appears twice among the destination blocks")]
    DuplicateConsumerBlock(BlockId),
    /// A layer range beyond the model's layers.
    #[error("layers {layers:?} are not within the model's {num_layers} layers")]
    LayersOutOfRange {
        /// The range asked for.
        layers: std::ops::Range<u32>,
        /// The model's layers.
        num_layers: u32,
    },
    /// The two sides name different numbers of further KV cache groups.
    #[error("the producer has {producer} further KV cache groups, the consumer {consumer}")]
    GroupCount {
        /// Further groups on the producer.
        producer: usize,
        /// Further groups on the consumer.
        consumer: usize,
    },
    /// More tokens skipped than requested.
    #[error("skip_tokens {skip} exceeds num_tokens {tokens}")]
    SkipBeyondTokens {
        /// Skipped tokens.
        skip: u64,
        /// Requested tokens.
        tokens: u64,
    },
    /// With differing memory orders the receiver permutes whole blocks, so a prefix hit must end
    /// on a consumer block boundary.
    #[error(
        "skip_tokens {skip} is not a multiple of the consumer block size {block_tokens}, \
         which a re-layout between memory orders needs"
    )]
    UnalignedSkip {
        /// Skipped tokens.
        skip: u64,
        /// Consumer block size.
        block_tokens: u32,
    },
    /// The two sides' memory orders differ in a way no receiver permute handles: the
    /// dimension-major keys of `hnd-kt`, or a consumer whose heads are spread over the block
    /// (`per-layer-head-kv`) receiving another order.
    #[error(
        "no re-layout from producer order {producer} to consumer order {consumer} \
         (consumer arrangement {arrangement}); use the same order on both sides"
    )]
    UnsupportedReLayout {
        /// Producer's order.
        producer: kvx_core::MemoryOrder,
        /// Consumer's order.
        consumer: kvx_core::MemoryOrder,
        /// Consumer's arrangement.
        arrangement: kvx_core::Arrangement,
    },
    /// One side keeps K and V together per (token, head) cell and the other does not: such a
    /// cache plans against its own arrangement only.
    #[error(
        "producer arrangement {producer} and consumer arrangement {consumer} do not plan \
         together: per-layer-cell-kv (K and V together per token and head) plans only against \
         itself"
    )]
    ArrangementMismatch {
        /// Producer's arrangement.
        producer: kvx_core::Arrangement,
        /// Consumer's arrangement.
        consumer: kvx_core::Arrangement,
    },
}
