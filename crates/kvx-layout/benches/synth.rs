//! Cost of the synthetic KV pattern that `kvx pd` writes on prefill and checks on decode: one
//! 1,024-token request of a Qwen2.5-0.5B-like cache (24 layers, 2 KV heads, head dim 64, bf16,
//! 16-token blocks, 12 MiB), filled and verified. The synthetic engine's prefill time is meant to
//! be its simulated compute, so the fill must cost well under that (10 µs per token in `cargo
//! xtask bench pd`).
#![allow(missing_docs)] // criterion_group! generates an undocumented function

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvx_core::{Arrangement, BlockId, Dtype, LayoutSpec, MemoryOrder};
use kvx_layout::synth::{fill_request, verify_request};
use kvx_layout::Layout;

const TOKENS: u64 = 1024;

fn synth(c: &mut Criterion) {
    let layout = Layout::new(LayoutSpec {
        num_layers: 24,
        total_kv_heads: 2,
        head_dim: 64,
        dtype: Dtype::Bf16,
        mla: false,
        block_tokens: 16,
        num_blocks: 128,
        tp_size: 1,
        tp_rank: 0,
        order: MemoryOrder::Hnd,
        arrangement: Arrangement::PerLayerSplit,
    })
    .expect("valid layout");
    let blocks: Vec<BlockId> = (0..TOKENS / 16).map(|b| BlockId(b as u32 * 2)).collect();
    let mut memory: Vec<Vec<u8>> = (0..layout.region_count())
        .map(|_| vec![0u8; layout.region_len() as usize])
        .collect();
    let mut group = c.benchmark_group("synth");
    group.throughput(Throughput::Bytes(
        TOKENS * layout.head_bytes() * u64::from(layout.local_heads()) * 2 * 24,
    ));
    group.bench_function("fill_1k_tokens", |b| {
        b.iter(|| {
            let mut regions: Vec<&mut [u8]> = memory.iter_mut().map(Vec::as_mut_slice).collect();
            fill_request(&layout, &mut regions, black_box(&blocks), TOKENS, 7);
        });
    });
    let regions: Vec<&[u8]> = memory.iter().map(Vec::as_slice).collect();
    group.bench_function("verify_1k_tokens", |b| {
        b.iter(|| {
            verify_request(&layout, &regions, black_box(&blocks), 0, TOKENS, 7).expect("intact")
        });
    });
    group.finish();
}

criterion_group!(benches, synth);
criterion_main!(benches);
