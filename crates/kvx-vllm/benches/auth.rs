//! What authentication costs the control plane's CPU: the Noise handshake every control
//! connection runs once (`kvx_vllm::NOISE_PATTERN`, both sides in one thread, in memory: the
//! cryptography without the network), and sealing and opening one message after it (a
//! registration is a few hundred bytes; a hello with a large region table, tens of KiB), and a
//! router's capability granted and checked (once per request on each of router, decode and
//! every prefill rank).
//!
//! Run: `cargo bench -p kvx-vllm --bench auth` (`cargo xtask bench auth` gathers the estimates).

// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const PROLOGUE: &[u8] = b"kvx control v1";
const KEY: [u8; 32] = [0x4b; 32];

fn builder() -> snow::Builder<'static> {
    snow::Builder::new(kvx_vllm::NOISE_PATTERN.parse().expect("pattern"))
        .psk(0, &KEY)
        .and_then(|b| b.prologue(PROLOGUE))
        .expect("builder")
}

/// Both sides' handshake; returns their transport states.
fn handshake() -> (snow::StatelessTransportState, snow::StatelessTransportState) {
    let mut initiator = builder().build_initiator().expect("initiator");
    let mut responder = builder().build_responder().expect("responder");
    let (mut msg, mut payload) = ([0u8; 128], [0u8; 128]);
    let n = initiator.write_message(&[], &mut msg).expect("first");
    responder
        .read_message(&msg[..n], &mut payload)
        .expect("read first");
    let n = responder.write_message(&[], &mut msg).expect("answer");
    initiator
        .read_message(&msg[..n], &mut payload)
        .expect("read answer");
    (
        initiator
            .into_stateless_transport_mode()
            .expect("transport"),
        responder
            .into_stateless_transport_mode()
            .expect("transport"),
    )
}

fn auth(c: &mut Criterion) {
    let mut g = c.benchmark_group("auth");
    g.bench_function("handshake", |b| b.iter(|| black_box(handshake())));
    let (sender, receiver) = handshake();
    for len in [256usize, 64 << 10] {
        let plain = vec![7u8; len.min(65_535 - 16)];
        let (mut sealed, mut opened) = (vec![0u8; 65_535], vec![0u8; 65_535]);
        g.throughput(Throughput::Bytes(plain.len() as u64));
        let mut nonce = 0u64;
        g.bench_function(format!("seal_and_open_{len}"), |b| {
            b.iter(|| {
                let n = sender
                    .write_message(nonce, &plain, &mut sealed)
                    .expect("seal");
                let m = receiver
                    .read_message(nonce, &sealed[..n], &mut opened)
                    .expect("open");
                nonce += 1;
                black_box(m)
            });
        });
    }
    g.throughput(Throughput::Elements(1));
    let key = kvx_vllm::AuthKey::from_bytes(KEY);
    let transfer = kvx_core::TransferId(0x1234_5678_9abc_def0);
    let decode = kvx_core::EngineId::from_name("decode-0");
    let until = std::time::SystemTime::now() + std::time::Duration::from_secs(600);
    g.bench_function("capability_grant", |b| {
        b.iter(|| black_box(key.grant(transfer, decode, "10.0.0.1:7100", until)));
    });
    let capability = key.grant(transfer, decode, "10.0.0.1:7100", until);
    g.bench_function("capability_check", |b| {
        b.iter(|| {
            black_box(key.check(
                transfer,
                Some(&capability),
                Some(decode),
                std::time::SystemTime::now(),
            ))
        });
    });
    g.finish();
}

criterion_group!(benches, auth);
criterion_main!(benches);
