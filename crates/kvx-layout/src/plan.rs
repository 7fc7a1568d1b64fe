//! The transfer plan: copy operations and receiver permutes.

use kvx_core::{MemoryOrder, Rank};
use serde::{Deserialize, Serialize};

/// One copy from a producer rank's region into the consumer rank's region.
///
/// The operation moves `count` pieces of `len` bytes: piece `i` goes from
/// `src_offset + i·src_stride` in producer region `src_region` to `dst_offset + i·dst_stride` in
/// consumer region `dst_region`. With `count == 1` it is one contiguous run (the strides are then
/// zero). Strided operations keep plans short where a run repeats at a fixed spacing (TP ratios,
/// interleaved layouts); a transport executes them as one 2-D copy where it can (CUDA) or as
/// `count` writes (RDMA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CopyOp {
    /// The producer rank whose memory is read.
    pub producer: Rank,
    /// Region index in the producer's layout.
    pub src_region: u32,
    /// Byte offset of the first piece in that region.
    pub src_offset: u64,
    /// Region index in the consumer's layout.
    pub dst_region: u32,
    /// Byte offset of the first piece in that region.
    pub dst_offset: u64,
    /// Bytes per piece.
    pub len: u64,
    /// Number of pieces (at least 1).
    pub count: u64,
    /// Distance between consecutive pieces on the producer side.
    pub src_stride: u64,
    /// Distance between consecutive pieces on the consumer side.
    pub dst_stride: u64,
}

impl CopyOp {
    /// `count` pieces of `len` bytes from `src` (region, offset) of `producer`'s memory to `dst`
    /// (region, offset) of the consumer's, `strides` (source, destination) apart.
    #[must_use]
    pub const fn strided(
        producer: Rank,
        src: (u32, u64),
        dst: (u32, u64),
        len: u64,
        count: u64,
        strides: (u64, u64),
    ) -> Self {
        Self {
            producer,
            src_region: src.0,
            src_offset: src.1,
            dst_region: dst.0,
            dst_offset: dst.1,
            len,
            count,
            src_stride: strides.0,
            dst_stride: strides.1,
        }
    }

    /// One contiguous run of `len` bytes.
    #[must_use]
    pub const fn run(producer: Rank, src: (u32, u64), dst: (u32, u64), len: u64) -> Self {
        Self::strided(producer, src, dst, len, 1, (0, 0))
    }

    /// Bytes this operation moves.
    #[must_use]
    pub const fn bytes(&self) -> u64 {
        self.len * self.count
    }

    /// The pieces as `(src_offset, dst_offset, len)`.
    pub fn pieces(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        (0..self.count).map(move |i| {
            (
                self.src_offset + i * self.src_stride,
                self.dst_offset + i * self.dst_stride,
                self.len,
            )
        })
    }
}

/// A re-layout the consumer applies in place to one destination chunk after the data has landed,
/// where producer and consumer use different memory orders: the producer writes the chunk in its
/// own order (`from`), and the consumer turns it into its own (`to`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Permute {
    /// Consumer region.
    pub region: u32,
    /// Byte offset of the chunk.
    pub offset: u64,
    /// Order the bytes arrive in.
    pub from: MemoryOrder,
    /// Order the consumer needs.
    pub to: MemoryOrder,
    /// Tokens per block (the chunk's token capacity).
    pub block_tokens: u32,
    /// First token slot of the chunk that the transfer fills.
    pub first_slot: u32,
    /// Token slots filled, starting at `first_slot`.
    pub slots: u32,
    /// Heads in the chunk.
    pub heads: u32,
    /// Bytes per head vector.
    pub head_bytes: u64,
}

impl Permute {
    /// Offset of (`slot`, `head`) inside the chunk in `order`.
    fn at(&self, order: MemoryOrder, slot: u64, head: u64) -> usize {
        let index = match order {
            MemoryOrder::Nhd => slot * u64::from(self.heads) + head,
            // The planner never re-lays-out dimension-major keys (it refuses with
            // `PlanError::UnsupportedReLayout`); their V half is head-major.
            MemoryOrder::Hnd | MemoryOrder::HndKt => head * u64::from(self.block_tokens) + slot,
        };
        (index * self.head_bytes) as usize
    }

    /// Bytes of the chunk this permute rewrites.
    #[must_use]
    pub fn chunk_bytes(&self) -> u64 {
        u64::from(self.block_tokens) * u64::from(self.heads) * self.head_bytes
    }

    /// Applies the permute to `chunk` (the chunk's bytes, starting at `offset` of the region): the
    /// CPU reference the device kernels are checked against. `scratch` is reused between calls.
    ///
    /// # Panics
    /// If `chunk` is shorter than [`Permute::chunk_bytes`].
    pub fn apply(&self, chunk: &mut [u8], scratch: &mut Vec<u8>) {
        let len = self.chunk_bytes() as usize;
        let chunk = &mut chunk[..len];
        scratch.clear();
        scratch.extend_from_slice(chunk);
        let hb = self.head_bytes as usize;
        for slot in u64::from(self.first_slot)..u64::from(self.first_slot + self.slots) {
            for head in 0..u64::from(self.heads) {
                let src = self.at(self.from, slot, head);
                let dst = self.at(self.to, slot, head);
                chunk[dst..dst + hb].copy_from_slice(&scratch[src..src + hb]);
            }
        }
    }
}
