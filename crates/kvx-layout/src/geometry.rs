//! A validated layout and its addressing: where each (layer, K/V, block, token slot, head) lives.

use kvx_core::{Arrangement, BlockId, LayoutSpec, MemoryOrder, Rank};

use crate::error::LayoutError;

/// A validated [`LayoutSpec`] with its derived geometry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    spec: LayoutSpec,
    kv_parts: u32,
    model_heads: u32,
    local_heads: u32,
    first_head: u32,
    head_bytes: u64,
    head_pitch: u64,
    chunk_bytes: u64,
    block_stride: u64,
    region_len: u64,
}

/// Where one chunk family (a layer's K or V) lives: chunk of block `b` is at
/// `region`, byte `base + b · stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkPlace {
    /// Region index.
    pub region: u32,
    /// Offset of block 0's chunk.
    pub base: u64,
}

impl Layout {
    /// Validates a spec.
    pub fn new(spec: LayoutSpec) -> Result<Self, LayoutError> {
        for (name, value) in [
            ("num_layers", spec.num_layers),
            ("head_dim", spec.head_dim),
            ("block_tokens", spec.block_tokens),
            ("num_blocks", spec.num_blocks),
            ("tp_size", spec.tp_size),
        ] {
            if value == 0 {
                return Err(LayoutError::Zero(name));
            }
        }
        if spec.tp_size > crate::MAX_TP_SIZE {
            return Err(LayoutError::TpSizeTooLarge {
                tp_size: spec.tp_size,
                max: crate::MAX_TP_SIZE,
            });
        }
        if spec.tp_rank >= spec.tp_size {
            return Err(LayoutError::RankOutOfRange {
                rank: spec.tp_rank,
                size: spec.tp_size,
            });
        }
        let (kv_parts, model_heads, local_heads, first_head) = if spec.mla {
            (1, 1, 1, 0)
        } else {
            let heads = spec.total_kv_heads;
            if heads == 0 {
                return Err(LayoutError::Zero("total_kv_heads"));
            }
            let tp = spec.tp_size;
            if tp <= heads {
                if !heads.is_multiple_of(tp) {
                    return Err(LayoutError::HeadsNotDivisible { heads, tp });
                }
                let local = heads / tp;
                (2, heads, local, spec.tp_rank * local)
            } else {
                if !tp.is_multiple_of(heads) {
                    return Err(LayoutError::HeadsNotDivisible { heads, tp });
                }
                (2, heads, 1, spec.tp_rank / (tp / heads))
            }
        };
        if spec.arrangement == Arrangement::PerLayerHeadKv && spec.order == MemoryOrder::Nhd {
            return Err(LayoutError::OrderArrangement {
                order: spec.order,
                arrangement: spec.arrangement,
            });
        }
        if spec.arrangement == Arrangement::PerLayerCellKv && spec.order == MemoryOrder::HndKt {
            return Err(LayoutError::CellKeysDimensionMajor);
        }
        let head_bytes = u64::from(spec.head_dim) * u64::from(spec.dtype.size());
        let chunk_bytes = head_bytes
            .checked_mul(u64::from(local_heads) * u64::from(spec.block_tokens))
            .ok_or(LayoutError::TooLarge)?;
        let per_block_chunks = match spec.arrangement {
            Arrangement::PerLayerSplit | Arrangement::PerLayerKvHalves => 1,
            Arrangement::PerLayerKvInBlock
            | Arrangement::PerLayerHeadKv
            | Arrangement::PerLayerCellKv => u64::from(kv_parts),
            Arrangement::CrossLayer => u64::from(kv_parts) * u64::from(spec.num_layers),
        };
        let block_stride = chunk_bytes
            .checked_mul(per_block_chunks)
            .ok_or(LayoutError::TooLarge)?;
        let chunks_per_region = match spec.arrangement {
            Arrangement::PerLayerSplit => 1,
            Arrangement::PerLayerKvHalves
            | Arrangement::PerLayerKvInBlock
            | Arrangement::PerLayerHeadKv
            | Arrangement::PerLayerCellKv => u64::from(kv_parts),
            Arrangement::CrossLayer => u64::from(kv_parts) * u64::from(spec.num_layers),
        };
        // Head-major orders: one head's tokens of a chunk, then the next head's; with K and V
        // interleaved per head (or per token and head), the next head comes after this head's V.
        let head_span = head_bytes * u64::from(spec.block_tokens);
        let head_pitch = match spec.arrangement {
            Arrangement::PerLayerHeadKv | Arrangement::PerLayerCellKv => {
                head_span * u64::from(kv_parts)
            }
            _ => head_span,
        };
        let region_len = chunk_bytes
            .checked_mul(chunks_per_region)
            .and_then(|b| b.checked_mul(u64::from(spec.num_blocks)))
            .ok_or(LayoutError::TooLarge)?;
        Ok(Self {
            spec,
            kv_parts,
            model_heads,
            local_heads,
            first_head,
            head_bytes,
            head_pitch,
            chunk_bytes,
            block_stride,
            region_len,
        })
    }

    /// The spec this layout was made from.
    #[must_use]
    pub fn spec(&self) -> &LayoutSpec {
        &self.spec
    }

    /// This rank.
    #[must_use]
    pub fn rank(&self) -> Rank {
        Rank(self.spec.tp_rank)
    }

    /// 2 for K and V, 1 for MLA's latent vector.
    #[must_use]
    pub fn kv_parts(&self) -> u32 {
        self.kv_parts
    }

    /// KV heads of the model (1 for MLA).
    #[must_use]
    pub fn model_heads(&self) -> u32 {
        self.model_heads
    }

    /// Heads held by this rank.
    #[must_use]
    pub fn local_heads(&self) -> u32 {
        self.local_heads
    }

    /// Global index of this rank's first head.
    #[must_use]
    pub fn first_head(&self) -> u32 {
        self.first_head
    }

    /// Whether this rank holds global head `head`.
    #[must_use]
    pub fn holds_head(&self, head: u32) -> bool {
        (self.first_head..self.first_head + self.local_heads).contains(&head)
    }

    /// Bytes per head vector.
    #[must_use]
    pub fn head_bytes(&self) -> u64 {
        self.head_bytes
    }

    /// In a head-major order, the distance between consecutive heads of a chunk: a head's tokens
    /// (`block_tokens × head_bytes`), times 2 where each head's V follows its K
    /// ([`Arrangement::PerLayerHeadKv`]).
    #[must_use]
    pub fn head_pitch(&self) -> u64 {
        self.head_pitch
    }

    /// Whether each (token, head) cell holds its K vector and then its V vector
    /// ([`Arrangement::PerLayerCellKv`]).
    #[must_use]
    pub fn cells_hold_kv(&self) -> bool {
        self.spec.arrangement == Arrangement::PerLayerCellKv
    }

    /// Distance between the head vectors of consecutive slots (head-major orders) or heads
    /// (`nhd`) of one part: a head vector, times 2 where each cell holds K then V.
    #[must_use]
    pub fn vector_pitch(&self) -> u64 {
        if self.cells_hold_kv() {
            self.head_bytes * u64::from(self.kv_parts)
        } else {
            self.head_bytes
        }
    }

    /// Distance between consecutive elements of one head vector of part `kv`: the element size,
    /// except for the dimension-major keys of [`MemoryOrder::HndKt`], whose elements are a
    /// block's tokens apart.
    #[must_use]
    pub fn element_stride(&self, kv: u32) -> u64 {
        let element = u64::from(self.spec.dtype.size());
        if self.spec.order == MemoryOrder::HndKt && kv == 0 {
            element * u64::from(self.spec.block_tokens)
        } else {
            element
        }
    }

    /// Bytes of one (layer, K/V, block) chunk.
    #[must_use]
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    /// Distance between the chunks of consecutive block ids.
    #[must_use]
    pub fn block_stride(&self) -> u64 {
        self.block_stride
    }

    /// Number of memory regions the cache occupies.
    #[must_use]
    pub fn region_count(&self) -> u32 {
        match self.spec.arrangement {
            Arrangement::PerLayerSplit => self.spec.num_layers * self.kv_parts,
            Arrangement::PerLayerKvHalves
            | Arrangement::PerLayerKvInBlock
            | Arrangement::PerLayerHeadKv
            | Arrangement::PerLayerCellKv => self.spec.num_layers,
            Arrangement::CrossLayer => 1,
        }
    }

    /// Bytes in each region.
    #[must_use]
    pub fn region_len(&self) -> u64 {
        self.region_len
    }

    /// Where the chunks of (`layer`, `kv`) live.
    #[must_use]
    pub fn chunk_place(&self, layer: u32, kv: u32) -> ChunkPlace {
        let parts = self.kv_parts;
        match self.spec.arrangement {
            Arrangement::PerLayerSplit => ChunkPlace {
                region: layer * parts + kv,
                base: 0,
            },
            Arrangement::PerLayerKvHalves => ChunkPlace {
                region: layer,
                base: u64::from(kv) * u64::from(self.spec.num_blocks) * self.chunk_bytes,
            },
            Arrangement::PerLayerKvInBlock => ChunkPlace {
                region: layer,
                base: u64::from(kv) * self.chunk_bytes,
            },
            Arrangement::CrossLayer => ChunkPlace {
                region: 0,
                base: u64::from(layer * parts + kv) * self.chunk_bytes,
            },
            // Head 0's K, then its V, then head 1's K …: the V "chunk" starts one head span in.
            Arrangement::PerLayerHeadKv => ChunkPlace {
                region: layer,
                base: u64::from(kv) * self.head_bytes * u64::from(self.spec.block_tokens),
            },
            // Each cell's V follows its K.
            Arrangement::PerLayerCellKv => ChunkPlace {
                region: layer,
                base: u64::from(kv) * self.head_bytes,
            },
        }
    }

    /// Offset of the first element of (`slot`, local head `head`) of part `kv` inside a chunk,
    /// in `order` (its other elements follow at [`Layout::element_stride`]).
    #[must_use]
    pub fn inner_offset(&self, order: MemoryOrder, kv: u32, slot: u32, head: u32) -> u64 {
        let (slot, head) = (u64::from(slot), u64::from(head));
        let vector = self.vector_pitch();
        match order {
            MemoryOrder::Nhd => (slot * u64::from(self.local_heads) + head) * vector,
            MemoryOrder::Hnd => head * self.head_pitch + slot * vector,
            MemoryOrder::HndKt if kv == 0 => {
                head * self.head_pitch + slot * u64::from(self.spec.dtype.size())
            }
            MemoryOrder::HndKt => head * self.head_pitch + slot * self.head_bytes,
        }
    }

    /// Region and byte offset of the first element of one head vector: layer, K/V part, block
    /// id, token slot within the block, local head. The vector is contiguous unless
    /// [`Layout::element_stride`] exceeds the element size.
    #[must_use]
    pub fn head_vector(
        &self,
        layer: u32,
        kv: u32,
        block: BlockId,
        slot: u32,
        head: u32,
    ) -> (u32, u64) {
        let place = self.chunk_place(layer, kv);
        (
            place.region,
            place.base
                + u64::from(block.0) * self.block_stride
                + self.inner_offset(self.spec.order, kv, slot, head),
        )
    }
}
