//! The connector over NIXL (UCX) with host memory, prefill and decode on one host, each opened
//! the way the vLLM plugin opens it: prefill with its `listen` address (loopback here, so UCX
//! on the loopback interface), decode knowing nothing of its peers (UCX on the default route's
//! interface, and loopback beside it). Push, with part of the request written before it
//! finishes, and pull; every byte verified. Skipped, saying so, without a NIXL runtime
//! (`KVX_NIXL_LIB_DIR`; `cargo xtask test` sets it, with UCX over TCP).
#![cfg(feature = "nixl")]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvx_core::{
    Arrangement, Attempt, BlockId, Dtype, EngineId, LayoutSpec, MemoryOrder, RequestId, TransferId,
};
use kvx_rendezvous::AttemptKey;
use kvx_testkit::free_ports;
use kvx_vllm::{
    ConnectorConfig, Consumer, OpenOptions, Producer, PullRequest, PushRequest, RecvEvent,
    SendOutcome, TransportSpec,
};

#[path = "support/side.rs"]
mod side;
use side::Side;

const TOKENS: u64 = 100;

fn spec(block_tokens: u32) -> LayoutSpec {
    LayoutSpec {
        num_layers: 3,
        total_kv_heads: 2,
        head_dim: 64,
        dtype: Dtype::Bf16,
        mla: false,
        block_tokens,
        num_blocks: 32,
        tp_size: 1,
        tp_rank: 0,
        order: MemoryOrder::Hnd,
        arrangement: Arrangement::PerLayerSplit,
    }
}

/// The NIXL runtime, or `None` after saying why the test is skipped.
fn runtime(test: &str) -> Option<std::path::PathBuf> {
    let dir = std::env::var_os(kvx_vllm::transport::NIXL_LIB_DIR_ENV);
    if dir.is_none() {
        eprintln!("SKIPPED {test}: no NIXL runtime (KVX_NIXL_LIB_DIR unset)");
    }
    dir.map(Into::into)
}

fn wait_for<T>(what: &str, mut poll: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(found) = poll() {
            return found;
        }
        assert!(Instant::now() < deadline, "{what}: not within 30 s");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A prefill rank listening on loopback and a decode rank opened without an address, as the
/// plugin opens them, over `nixl`.
fn pair(library: std::path::PathBuf) -> ((Side, Producer, SocketAddr), (Side, Consumer)) {
    let spec_nixl: TransportSpec = "nixl".parse().unwrap();
    let options = OpenOptions::default().with_nixl_library(Some(library));
    let listen = free_ports(1);
    let (p_side, p_cache) = Side::new(spec(16));
    let mut p_config = ConnectorConfig::new(EngineId(1));
    p_config.listen = listen;
    let p_transport = spec_nixl
        .open_with(&options.clone().reached_at(listen.ip()))
        .expect("prefill opens nixl");
    let producer = Producer::start(p_config, p_cache, p_transport).expect("producer");
    let (d_side, d_cache) = Side::new(spec(32));
    let d_transport = spec_nixl.open_with(&options).expect("decode opens nixl");
    let consumer =
        Consumer::start(ConnectorConfig::new(EngineId(2)), d_cache, d_transport).expect("consumer");
    ((p_side, producer, listen), (d_side, consumer))
}

/// Decode's request `request` of `key` is ready, and prefill gets its blocks back, delivered.
fn delivered(consumer: &Consumer, producer: &Producer, key: AttemptKey, request: RequestId) {
    let events = wait_for("decode's event", || {
        Some(consumer.take_events()).filter(|e| !e.is_empty())
    });
    assert_eq!(events, vec![RecvEvent::Ready { key, request }]);
    let done = wait_for("prefill's blocks back", || {
        Some(producer.take_finished()).filter(|d| !d.is_empty())
    });
    assert_eq!(done[0].outcome, SendOutcome::Sent);
}

fn blocks(ids: &[u32], block_tokens: u64) -> Vec<BlockId> {
    ids[..TOKENS.div_ceil(block_tokens) as usize]
        .iter()
        .map(|&b| BlockId(b))
        .collect()
}

#[test]
fn push_with_an_early_write_and_pull_between_a_loopback_prefill_and_an_unaddressed_decode() {
    let test =
        "push_with_an_early_write_and_pull_between_a_loopback_prefill_and_an_unaddressed_decode";
    let Some(library) = runtime(test) else {
        return;
    };
    let ((p_side, mut producer, listen), (d_side, mut consumer)) = pair(library);
    let p_blocks = blocks(&[5, 1, 12, 3, 9, 14, 7], 16);
    let d_blocks = blocks(&[2, 14, 7, 0], 32);
    p_side.fill(&p_blocks, TOKENS);

    // Push: 70 of 100 tokens computed first (64 tokens of whole blocks of both sides go early).
    let key = AttemptKey::new(TransferId(71), Attempt(0));
    consumer
        .request_allocated(PushRequest {
            groups: Vec::new(),
            key,
            request: RequestId(1),
            prefill: listen,
            num_tokens: TOKENS,
            skip_tokens: 0,
            blocks: d_blocks.clone(),
            capability: None,
            trace: None,
        })
        .unwrap();
    producer
        .request_progress(key, p_blocks[..5].to_vec(), 70)
        .unwrap();
    wait_for("the early write", || {
        (producer.stats().bytes_streamed > 0).then_some(())
    });
    producer
        .request_finished(key, RequestId(9), p_blocks.clone(), TOKENS)
        .unwrap();
    delivered(&consumer, &producer, key, RequestId(1));
    d_side.verify(&d_blocks, 0, TOKENS);
    let per_token = p_side.layout.head_bytes()
        * u64::from(p_side.layout.local_heads() * p_side.layout.kv_parts() * 3);
    let stats = producer.stats();
    assert_eq!(stats.bytes_written, TOKENS * per_token, "{stats:?}");
    assert_eq!(stats.bytes_streamed, 64 * per_token, "{stats:?}");

    // Pull into other blocks of decode's: prefill holds its blocks, decode reads them.
    let key = AttemptKey::new(TransferId(72), Attempt(0));
    let d_blocks = blocks(&[20, 25, 21, 30], 32);
    producer
        .request_finished_pull(key, RequestId(10), p_blocks.clone(), TOKENS)
        .unwrap();
    consumer
        .pull(PullRequest {
            producer_groups: Vec::new(),
            push: PushRequest {
                groups: Vec::new(),
                key,
                request: RequestId(2),
                prefill: listen,
                num_tokens: TOKENS,
                skip_tokens: 0,
                blocks: d_blocks.clone(),
                capability: None,
                trace: None,
            },
            producer_blocks: p_blocks,
        })
        .unwrap();
    delivered(&consumer, &producer, key, RequestId(2));
    d_side.verify(&d_blocks, 0, TOKENS);
    consumer.shutdown();
    producer.shutdown();
}
