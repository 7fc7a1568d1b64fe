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
pub fn head_vector(seed: u64, layer: u32, kv: u32, token: u64, head: u32, out: &mut [u8]) {
    let key = mix(seed ^ mix((u64::from(layer) << 40) ^ (u64::from(kv) << 32) ^ u64::from(head)))
        ^ mix(token.wrapping_add(0x9e37_79b9_7f4a_7c15));
    let mut state = key;
    for chunk in out.chunks_mut(8) {
        state = mix(state.wrapping_add(0x9e37_79b9_7f4a_7c15));
        chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
    }
}

fn for_each_vector(
    layout: &Layout,
    blocks: &[BlockId],
    tokens: std::ops::Range<u64>,
    mut f: impl FnMut(u32, u32, u64, u32, u32, u64) -> bool,
) {
    let bt = u64::from(layout.spec().block_tokens);
    for token in tokens {
        let block = blocks[(token / bt) as usize];
        let slot = (token % bt) as u32;
        for layer in 0..layout.spec().num_layers {
            for kv in 0..layout.kv_parts() {
                for local in 0..layout.local_heads() {
                    let (region, offset) = layout.head_vector(layer, kv, block, slot, local);
                    if !f(
                        layer,
                        kv,
                        token,
                        layout.first_head() + local,
                        region,
                        offset,
                    ) {
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
    let hb = layout.head_bytes() as usize;
    for_each_vector(
        layout,
        blocks,
        0..num_tokens,
        |layer, kv, token, head, region, offset| {
            let at = offset as usize;
            head_vector(
                seed,
                layer,
                kv,
                token,
                head,
                &mut regions[region as usize][at..at + hb],
            );
            true
        },
    );
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
    let mut expected = vec![0u8; hb];
    let mut found = None;
    for_each_vector(
        layout,
        blocks,
        skip_tokens..num_tokens,
        |layer, kv, token, head, region, offset| {
            head_vector(seed, layer, kv, token, head, &mut expected);
            let at = offset as usize;
            if regions[region as usize][at..at + hb] != expected[..] {
                found = Some(Mismatch {
                    layer,
                    kv,
                    token,
                    head,
                    region,
                    offset,
                });
                return false;
            }
            true
        },
    );
    found.map_or(Ok(()), Err)
}
