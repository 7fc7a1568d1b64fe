//! Encode and decode cost of the hot-path messages.
#![allow(missing_docs)] // criterion_group! generates an undocumented function

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvx_core::wire::{Completion, Message, Registration};
use kvx_core::{Attempt, BlockId, EngineId, Incarnation, Rank, RequestId, TransferId};

fn registration(blocks: u32) -> Message {
    Message::Registration(Registration {
        transfer: TransferId(0x1234),
        attempt: Attempt(1),
        request: RequestId(9),
        consumer: EngineId(2),
        consumer_incarnation: Incarnation(3),
        consumer_rank: Rank(0),
        num_tokens: blocks * 16,
        skip_tokens: 0,
        lease_ms: 30_000,
        notice: 0,
        blocks: (0..blocks).map(BlockId).collect(),
        groups: Vec::new(),
        capability: None,
    })
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("codec");
    for blocks in [64u32, 1024] {
        let m = registration(blocks);
        let bytes = m.to_bytes().expect("encodes");
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function(format!("encode_registration_{blocks}_blocks"), |b| {
            b.iter_batched_ref(
                || Vec::with_capacity(bytes.len()),
                |out| m.encode(out).expect("encodes"),
                BatchSize::SmallInput,
            );
        });
        group.bench_function(format!("decode_registration_{blocks}_blocks"), |b| {
            b.iter(|| Message::decode_exact(std::hint::black_box(&bytes)).expect("decodes"));
        });
    }
    let completion = Message::Completion(Completion {
        transfer: TransferId(1),
        attempt: Attempt(0),
        producer: EngineId(1),
        producer_rank: Rank(3),
        bytes: 1 << 30,
        capability: None,
    })
    .to_bytes()
    .expect("encodes");
    group.throughput(Throughput::Elements(1));
    group.bench_function("decode_completion", |b| {
        b.iter(|| Message::decode_exact(std::hint::black_box(&completion)).expect("decodes"));
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
