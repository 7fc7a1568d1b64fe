//! Deterministic synthetic KV: a pattern where every byte depends on (seed, layer, K/V, token,
//! global head, byte), for tests, the synthetic engine of `kvx pd` and benchmarks. A head vector
//! that lands in the wrong place, or a stale one, is always detected.

use kvx_core::BlockId;

use crate::geometry::Layout;

/// A mismatch found by [`verify_request`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("KV mismatch at layer {layer} kv {kv} token {token} head {head} (region {region}, offset {offset})")]
pub struct Mismatch {
    /// Layer.
    pub layer: u32,
    /// 0 for K (or the MLA latent), 1 for V.
    pub kv: u32,
    /// Token of the request.
    pub token: u64,
    /// Global head.
    pub head: u32,
    /// Region of the wrong bytes.
    pub region: u32,
    /// Offset of the head vector in that region.
    pub offset: u64,
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Writes the head vector for (layer, kv, token, head) into `out`.
///
/// The vector's key mixes all five coordinates; its words are the key spread by the word's
/// index (an add, a shift and an xor each), so that filling costs little next to the compute it
/// stands in for (see the `synth` benchmark).
pub fn head_vector(seed: u64, layer: u32, kv: u32, token: u64, head: u32, out: &mut [u8]) {
    const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;
    let key = mix(seed ^ mix((u64::from(layer) << 40) ^ (u64::from(kv) << 32) ^ u64::from(head)))
        ^ mix(token.wrapping_add(GOLDEN));
    let mut state = key;
    let mut chunks = out.chunks_exact_mut(8);
    for chunk in &mut chunks {
        state = state.wrapping_add(GOLDEN);
        chunk.copy_from_slice(&(state ^ (state >> 29)).to_le_bytes());
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        state = state.wrapping_add(GOLDEN);
        let len = rest.len();
        rest.copy_from_slice(&(state ^ (state >> 29)).to_le_bytes()[..len]);
    }
}

/// Where one head vector of a request lives on a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadVectorAt {
    /// Layer.
    pub layer: u32,
    /// 0 for K (or the MLA latent), 1 for V.
    pub kv: u32,
    /// Token of the request.
    pub token: u64,
    /// Global head.
    pub head: u32,
    /// Region holding it.
    pub region: u32,
    /// Byte offset of its first element in that region.
    pub offset: u64,
    /// Bytes per element.
    pub element_bytes: u64,
    /// Distance between consecutive elements (`element_bytes` where the vector is contiguous).
    pub element_stride: u64,
}

impl HeadVectorAt {
    /// The vector's bytes in its region, as `(region offset, vector offset, len)` runs: one run
    /// where the vector is contiguous, one per element otherwise.
    pub fn runs(&self, head_bytes: u64) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let contiguous = self.element_stride == self.element_bytes;
        let (len, count) = if contiguous {
            (head_bytes, 1)
        } else {
            (self.element_bytes, head_bytes / self.element_bytes)
        };
        (0..count).map(move |i| (self.offset + i * self.element_stride, i * len, len))
    }

    /// Writes `vector` to its place in `region`.
    ///
    /// # Panics
    /// If the place lies beyond `region`.
    pub fn store(&self, region: &mut [u8], vector: &[u8]) {
        for (at, from, len) in self.runs(vector.len() as u64) {
            let (at, from, len) = (at as usize, from as usize, len as usize);
            region[at..at + len].copy_from_slice(&vector[from..from + len]);
        }
    }

    /// Reads the vector from `region` into `out`.
    ///
    /// # Panics
    /// If the place lies beyond `region`.
    pub fn load(&self, region: &[u8], out: &mut [u8]) {
        for (at, to, len) in self.runs(out.len() as u64) {
            let (at, to, len) = (at as usize, to as usize, len as usize);
            out[to..to + len].copy_from_slice(&region[at..at + len]);
        }
    }
}

/// Calls `f` for every head vector this rank holds of `tokens` of a request stored in `blocks`,
/// until `f` returns false: the walk of [`fill_request`] and [`verify_request`], for callers
/// whose memory is not a Rust slice (registered buffers).
///
/// # Panics
/// If `blocks` does not cover the tokens.
pub fn for_each_head_vector(
    layout: &Layout,
    blocks: &[BlockId],
    tokens: std::ops::Range<u64>,
    f: impl FnMut(HeadVectorAt) -> bool,
) {
    for_each_head_vector_in(layout, blocks, tokens, 0..layout.spec().num_layers, f);
}

/// [`for_each_head_vector`] in `layers` only (an engine computing layer by layer).
///
/// # Panics
/// If `blocks` does not cover the tokens or a layer is beyond the layout's.
pub fn for_each_head_vector_in(
    layout: &Layout,
    blocks: &[BlockId],
    tokens: std::ops::Range<u64>,
    layers: std::ops::Range<u32>,
    mut f: impl FnMut(HeadVectorAt) -> bool,
) {
    assert!(
        layers.end <= layout.spec().num_layers,
        "layers {layers:?} beyond the layout's {}",
        layout.spec().num_layers
    );
    let bt = u64::from(layout.spec().block_tokens);
    let element_bytes = u64::from(layout.spec().dtype.size());
    for token in tokens {
        let block = blocks[(token / bt) as usize];
        let slot = (token % bt) as u32;
        for layer in layers.clone() {
            for kv in 0..layout.kv_parts() {
                for local in 0..layout.local_heads() {
                    let (region, offset) = layout.head_vector(layer, kv, block, slot, local);
                    let at = HeadVectorAt {
                        layer,
                        kv,
                        token,
                        head: layout.first_head() + local,
                        region,
                        offset,
                        element_bytes,
                        element_stride: layout.element_stride(kv),
                    };
                    if !f(at) {
                        return;
                    }
                }
            }
        }
    }
}

/// Fills this rank's share of the request's tokens `0..num_tokens` with the pattern. `regions`
/// are the rank's regions in layout order.
///
/// # Panics
/// If `blocks` does not cover the tokens or a region is shorter than the layout says.
pub fn fill_request(
    layout: &Layout,
    regions: &mut [&mut [u8]],
    blocks: &[BlockId],
    num_tokens: u64,
    seed: u64,
) {
    let mut vector = vec![0u8; layout.head_bytes() as usize];
    for_each_head_vector(layout, blocks, 0..num_tokens, |v| {
        head_vector(seed, v.layer, v.kv, v.token, v.head, &mut vector);
        v.store(regions[v.region as usize], &vector);
        true
    });
}

/// Checks that this rank holds the pattern for tokens `skip_tokens..num_tokens` of the request.
///
/// # Panics
/// If `blocks` does not cover the tokens or a region is shorter than the layout says.
pub fn verify_request(
    layout: &Layout,
    regions: &[&[u8]],
    blocks: &[BlockId],
    skip_tokens: u64,
    num_tokens: u64,
    seed: u64,
) -> Result<(), Mismatch> {
    let hb = layout.head_bytes() as usize;
    let (mut expected, mut held) = (vec![0u8; hb], vec![0u8; hb]);
    let mut found = None;
    for_each_head_vector(layout, blocks, skip_tokens..num_tokens, |v| {
        head_vector(seed, v.layer, v.kv, v.token, v.head, &mut expected);
        v.load(regions[v.region as usize], &mut held);
        if held != expected {
            found = Some(Mismatch {
                layer: v.layer,
                kv: v.kv,
                token: v.token,
                head: v.head,
                region: v.region,
                offset: v.offset,
            });
            return false;
        }
        true
    });
    found.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use kvx_core::{Arrangement, Dtype, LayoutSpec, MemoryOrder};

    use super::*;

    fn layout() -> Layout {
        Layout::new(LayoutSpec {
            num_layers: 3,
            total_kv_heads: 2,
            head_dim: 12, // 24-byte head vectors: three whole words
            dtype: Dtype::Bf16,
            mla: false,
            block_tokens: 4,
            num_blocks: 8,
            tp_size: 1,
            tp_rank: 0,
            order: MemoryOrder::Hnd,
            arrangement: Arrangement::PerLayerSplit,
        })
        .expect("valid layout")
    }

    #[test]
    fn every_coordinate_and_every_byte_changes_the_vector() {
        let vector = |seed, layer, kv, token, head| {
            let mut out = [0u8; 21]; // a partial last word too
            head_vector(seed, layer, kv, token, head, &mut out);
            out
        };
        let base = vector(1, 2, 0, 5, 1);
        for other in [
            vector(2, 2, 0, 5, 1),
            vector(1, 3, 0, 5, 1),
            vector(1, 2, 1, 5, 1),
            vector(1, 2, 0, 6, 1),
            vector(1, 2, 0, 5, 0),
        ] {
            // Every byte differs from the base vector's (with overwhelming likelihood; these
            // coordinates are fixed, so the test is deterministic).
            assert!(
                base.iter().zip(&other).all(|(a, b)| a != b),
                "{base:?} {other:?}"
            );
        }
        // Words within a vector differ too: a shifted copy is no copy.
        assert_ne!(base[..8], base[8..16]);
    }

    #[test]
    fn verify_finds_a_swapped_vector_and_a_flipped_byte() {
        let layout = layout();
        let blocks = [BlockId(3), BlockId(1), BlockId(6)];
        let mut memory: Vec<Vec<u8>> = (0..layout.region_count())
            .map(|_| vec![0u8; layout.region_len() as usize])
            .collect();
        let mut regions: Vec<&mut [u8]> = memory.iter_mut().map(Vec::as_mut_slice).collect();
        fill_request(&layout, &mut regions, &blocks, 10, 42);
        let check = |memory: &[Vec<u8>]| {
            let regions: Vec<&[u8]> = memory.iter().map(Vec::as_slice).collect();
            verify_request(&layout, &regions, &blocks, 0, 10, 42)
        };
        assert_eq!(check(&memory), Ok(()));
        let other_seed = {
            let regions: Vec<&[u8]> = memory.iter().map(Vec::as_slice).collect();
            verify_request(&layout, &regions, &blocks, 0, 10, 43)
        };
        assert!(other_seed.is_err());

        // Token 9's and token 8's vectors of layer 1, K, head 0 swapped.
        let hb = layout.head_bytes() as usize;
        let (r, a) = layout.head_vector(1, 0, blocks[2], 1, 0);
        let (_, b) = layout.head_vector(1, 0, blocks[2], 0, 0);
        let mut swapped = memory.clone();
        let (a, b) = (a as usize, b as usize);
        let region = &mut swapped[r as usize];
        let first = region[a..a + hb].to_vec();
        region.copy_within(b..b + hb, a);
        region[b..b + hb].copy_from_slice(&first);
        let found = check(&swapped).expect_err("a swap is found");
        assert_eq!(
            (found.layer, found.kv, found.token, found.head),
            (1, 0, 8, 0)
        );

        // One bit of token 2's V vector of layer 2, head 1.
        let mut flipped = memory.clone();
        let (r, at) = layout.head_vector(2, 1, blocks[0], 2, 1);
        flipped[r as usize][at as usize + hb - 1] ^= 0x10;
        let found = check(&flipped).expect_err("a flipped bit is found");
        assert_eq!(
            (found.layer, found.kv, found.token, found.head),
            (2, 1, 2, 1)
        );
    }
}
