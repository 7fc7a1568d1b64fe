//! The connector end to end over the in-process loopback transport: both orders, TP and block
//! ratios, memory-order re-layout, pull mode, and the failure paths (leases, aborts, cancels, a
//! dead prefill, bad blocks, an unreachable peer). Every delivered byte is verified.

use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::{
    Arrangement, Attempt, BlockId, Dtype, EngineId, GroupBlocks, LayoutSpec, MemoryOrder,
    RequestBlocks, RequestId, TransferId,
};
use kvx_layout::synth::{for_each_head_vector_in, head_vector};
use kvx_rdma::loopback::LoopbackFabric;
use kvx_rdma::region::LocalRegion;
use kvx_rdma::{Capabilities, Event, Notice, OpId, PeerId, Transport};
use kvx_rendezvous::{AttemptKey, Reason};
use kvx_testkit::free_ports;
use kvx_vllm::router;
use kvx_vllm::{
    ConnectorConfig, Consumer, FinishedSending, Producer, PullRequest, PushRequest, RecvEvent,
    RouterError, SendOutcome,
};

#[path = "support/side.rs"]
mod side;
#[path = "support/forward.rs"]
#[macro_use]
mod forward;
use side::{Side, SEED};

fn spec(
    tp: u32,
    rank: u32,
    block_tokens: u32,
    order: MemoryOrder,
    arrangement: Arrangement,
) -> LayoutSpec {
    LayoutSpec {
        num_layers: 3,
        total_kv_heads: 4,
        head_dim: 8,
        dtype: Dtype::Bf16,
        mla: false,
        block_tokens,
        num_blocks: 64,
        tp_size: tp,
        tp_rank: rank,
        order,
        arrangement,
    }
}

fn config(engine: u64) -> ConnectorConfig {
    let mut c = ConnectorConfig::new(EngineId(engine));
    c.heartbeat_interval = Duration::from_millis(50);
    c
}

struct Prefill {
    sides: Vec<Side>,
    producers: Vec<Producer>,
    base: SocketAddr,
}

impl Prefill {
    /// Every rank finishes `key` (prefill's request 9) in `blocks`.
    fn finish(&self, key: AttemptKey, blocks: &[BlockId], tokens: u64) {
        for p in &self.producers {
            p.request_finished(key, RequestId(9), blocks.to_vec(), tokens)
                .unwrap();
        }
    }
}

fn prefill(
    fabric: &LoopbackFabric,
    tp: u32,
    bt: u32,
    order: MemoryOrder,
    arr: Arrangement,
    lease: Duration,
) -> Prefill {
    let base = free_ports(tp as u16);
    let mut sides = Vec::new();
    let mut producers = Vec::new();
    for rank in 0..tp {
        let (side, cache) = Side::new(spec(tp, rank, bt, order, arr));
        let mut c = config(1);
        c.listen = SocketAddr::from(([127, 0, 0, 1], base.port() + rank as u16));
        c.producer_lease = lease;
        producers.push(Producer::start(c, cache, Box::new(fabric.endpoint())).unwrap());
        sides.push(side);
    }
    Prefill {
        sides,
        producers,
        base,
    }
}

fn decode(fabric: &LoopbackFabric, spec: LayoutSpec, lease: Duration) -> (Side, Consumer) {
    let (side, cache) = Side::new(spec);
    let mut c = config(2);
    c.registration_lease = lease;
    (
        side,
        Consumer::start(c, cache, Box::new(fabric.endpoint())).unwrap(),
    )
}

/// Two prefill ranks (4-token blocks, HND, K and V apart), long leases.
fn tp2_prefill(fabric: &LoopbackFabric) -> Prefill {
    prefill(
        fabric,
        2,
        4,
        MemoryOrder::Hnd,
        Arrangement::PerLayerSplit,
        LONG,
    )
}

/// One prefill rank (4-token blocks, NHD, K and V apart), long leases.
fn tp1_prefill(fabric: &LoopbackFabric) -> Prefill {
    tp1_prefill_leased(fabric, LONG)
}

/// [`tp1_prefill`] with producer lease `lease`.
fn tp1_prefill_leased(fabric: &LoopbackFabric, lease: Duration) -> Prefill {
    prefill(
        fabric,
        1,
        4,
        MemoryOrder::Nhd,
        Arrangement::PerLayerSplit,
        lease,
    )
}

/// One prefill rank and one decode rank with the same small layout (4-token blocks, NHD, K and V
/// apart), long leases.
fn simple_pair(fabric: &LoopbackFabric) -> (Prefill, Side, Consumer) {
    let pre = tp1_prefill(fabric);
    let (dec, consumer) = decode(
        fabric,
        spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit),
        LONG,
    );
    (pre, dec, consumer)
}

/// Decode registers `blocks` for `key` (decode's request 1) with the prefill at `prefill`.
fn register(
    consumer: &Consumer,
    prefill: SocketAddr,
    key: AttemptKey,
    tokens: u64,
    blocks: Vec<BlockId>,
) {
    register_request(consumer, prefill, key, RequestId(1), tokens, blocks);
}

/// [`register`] as decode's request `request`.
fn register_request(
    consumer: &Consumer,
    prefill: SocketAddr,
    key: AttemptKey,
    request: RequestId,
    tokens: u64,
    blocks: Vec<BlockId>,
) {
    consumer
        .request_allocated(PushRequest {
            groups: Vec::new(),
            key,
            request,
            prefill,
            num_tokens: tokens,
            skip_tokens: 0,
            blocks,
            capability: None,
            trace: None,
        })
        .unwrap();
}

fn wait_events(consumer: &Consumer, n: usize) -> Vec<RecvEvent> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut events = Vec::new();
    while events.len() < n {
        events.extend(consumer.take_events());
        assert!(
            Instant::now() < deadline,
            "waited too long; have {events:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    events
}

/// Waits for decode's one event and checks that it says the request failed for `reason`.
fn expect_failed(consumer: &Consumer, reason: Reason) {
    let events = wait_events(consumer, 1);
    assert!(
        matches!(events[0], RecvEvent::Failed { reason: r, .. } if r == reason),
        "{events:?}"
    );
}

/// Waits for decode's one event and checks that it says `key` (decode's `request`) is ready.
fn expect_ready(consumer: &Consumer, key: AttemptKey, request: RequestId) {
    assert_eq!(
        wait_events(consumer, 1),
        vec![RecvEvent::Ready { key, request }]
    );
}

fn wait_finished(producer: &Producer, n: usize) -> Vec<FinishedSending> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut done = Vec::new();
    while done.len() < n {
        done.extend(producer.take_finished());
        assert!(
            Instant::now() < deadline,
            "producer released too little: {done:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    done
}

fn key(t: u128, a: u32) -> AttemptKey {
    AttemptKey::new(TransferId(t), Attempt(a))
}

fn ids(range: std::ops::Range<u32>) -> Vec<BlockId> {
    range.map(BlockId).collect()
}

const LONG: Duration = Duration::from_secs(30);

/// A `tokens`-token request's blocks: prefill's from 10 up (filled with its KV on every rank),
/// decode's from 40 down.
fn request_blocks(
    pre: &Prefill,
    tokens: u64,
    p_bt: u32,
    c_bt: u32,
) -> (Vec<BlockId>, Vec<BlockId>) {
    let p_blocks = ids(10..10 + tokens.div_ceil(u64::from(p_bt)) as u32);
    let c_blocks = (0..tokens.div_ceil(u64::from(c_bt)) as u32)
        .map(|i| BlockId(40 - i))
        .collect();
    for side in &pre.sides {
        side.fill(&p_blocks, tokens);
    }
    (p_blocks, c_blocks)
}

fn push_roundtrip(
    p_tp: u32,
    p_bt: u32,
    p_order: MemoryOrder,
    c_spec: LayoutSpec,
    tokens: u64,
    registration_first: bool,
) {
    let fabric = LoopbackFabric::new();
    let pre = prefill(
        &fabric,
        p_tp,
        p_bt,
        p_order,
        Arrangement::PerLayerSplit,
        LONG,
    );
    let (dec, consumer) = decode(&fabric, c_spec.clone(), LONG);
    let (p_blocks, c_blocks) = request_blocks(&pre, tokens, p_bt, c_spec.block_tokens);
    let k = key(77, 0);
    let register = || {
        register_request(
            &consumer,
            pre.base,
            k,
            RequestId(5),
            tokens,
            c_blocks.clone(),
        )
    };
    if registration_first {
        register();
        std::thread::sleep(Duration::from_millis(20));
    }
    pre.finish(k, &p_blocks, tokens);
    if !registration_first {
        std::thread::sleep(Duration::from_millis(20));
        register();
    }
    expect_ready(&consumer, k, RequestId(5));
    dec.verify(&c_blocks, 0, tokens);
    // Every producer rank that wrote released its blocks as sent.
    let writers = kvx_layout::writers_for(&dec.layout, p_tp).unwrap();
    for rank in writers {
        let done = wait_finished(&pre.producers[rank.0 as usize], 1);
        assert_eq!(done[0].outcome, SendOutcome::Sent);
        assert_eq!(done[0].request, RequestId(9));
    }
}

#[test]
fn push_registration_first() {
    push_roundtrip(
        1,
        4,
        MemoryOrder::Nhd,
        spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit),
        37,
        true,
    );
}

#[test]
fn push_prefill_first() {
    push_roundtrip(
        1,
        4,
        MemoryOrder::Nhd,
        spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::CrossLayer),
        37,
        false,
    );
}

#[test]
fn push_tp2_into_tp1_with_other_block_size_and_order() {
    push_roundtrip(
        2,
        4,
        MemoryOrder::Hnd,
        spec(1, 0, 8, MemoryOrder::Nhd, Arrangement::PerLayerKvHalves),
        50,
        true,
    );
}

#[test]
fn push_with_finishing_hints_reads_the_transport_when_the_producers_say() {
    // Decode asks for hints (as it does where its transport polls to wait) and then reads its
    // transport only once a producer rank said its final writes begin: with heartbeats a
    // minute apart, nothing else would wake it for the notices.
    let fabric = LoopbackFabric::new();
    let pre = tp2_prefill(&fabric);
    let c_spec = spec(1, 0, 8, MemoryOrder::Nhd, Arrangement::PerLayerSplit);
    let (dec, cache) = Side::new(c_spec.clone());
    let mut c = config(2);
    c.heartbeat_interval = Duration::from_secs(60);
    c.finishing_hints = Some(true);
    let consumer = Consumer::start(c, cache, Box::new(fabric.endpoint())).unwrap();
    let tokens = 45;
    let (p_blocks, c_blocks) = request_blocks(&pre, tokens, 4, c_spec.block_tokens);
    let k = key(78, 0);
    register_request(
        &consumer,
        pre.base,
        k,
        RequestId(5),
        tokens,
        c_blocks.clone(),
    );
    std::thread::sleep(Duration::from_millis(50));
    assert!(consumer.take_events().is_empty());
    pre.finish(k, &p_blocks, tokens);
    expect_ready(&consumer, k, RequestId(5));
    dec.verify(&c_blocks, 0, tokens);
    assert_eq!(consumer.stats().finishing_hints, 2);
    for producer in &pre.producers {
        assert_eq!(wait_finished(producer, 1)[0].outcome, SendOutcome::Sent);
        assert_eq!(producer.stats().finishing_hints, 1);
    }
    // A consumer that did not ask gets none.
    let (_, cache) = Side::new(c_spec);
    let plain = Consumer::start(config(3), cache, Box::new(fabric.endpoint())).unwrap();
    let k = key(79, 0);
    register_request(&plain, pre.base, k, RequestId(6), tokens, c_blocks.clone());
    std::thread::sleep(Duration::from_millis(20));
    pre.finish(k, &p_blocks, tokens);
    expect_ready(&plain, k, RequestId(6));
    assert_eq!(plain.stats().finishing_hints, 0);
    for producer in &pre.producers {
        wait_finished(producer, 1);
        assert_eq!(producer.stats().finishing_hints, 1);
    }
}

#[test]
fn pull_reads_then_frees_the_producer_blocks() {
    let fabric = LoopbackFabric::new();
    let pre = tp2_prefill(&fabric);
    let (dec, consumer) = decode(
        &fabric,
        spec(1, 0, 4, MemoryOrder::Hnd, Arrangement::PerLayerSplit),
        LONG,
    );
    let tokens = 33;
    let p_blocks = ids(3..12);
    let c_blocks = ids(20..29);
    for (side, p) in pre.sides.iter().zip(&pre.producers) {
        side.fill(&p_blocks, tokens);
        p.request_finished_pull(key(5, 0), RequestId(1), p_blocks.clone(), tokens)
            .unwrap();
    }
    consumer
        .pull(PullRequest {
            producer_groups: Vec::new(),
            push: PushRequest {
                groups: Vec::new(),
                key: key(5, 0),
                request: RequestId(2),
                prefill: pre.base,
                num_tokens: tokens,
                skip_tokens: 0,
                blocks: c_blocks.clone(),
                capability: None,
                trace: None,
            },
            producer_blocks: p_blocks.clone(),
        })
        .unwrap();
    expect_ready(&consumer, key(5, 0), RequestId(2));
    dec.verify(&c_blocks, 0, tokens);
    for p in &pre.producers {
        assert_eq!(wait_finished(p, 1)[0].outcome, SendOutcome::Sent);
        assert_eq!(p.stats().held, 0);
    }
}

/// Decode dropped requests before registering them (aborted while queued): every rank of their
/// prefill gives their KV back at once, long before its 30 s lease — a request prefill had
/// finished, and one it finishes later; a prefill decode is not connected to is not contacted.
/// Waits until every rank of `pre` holds `n` finished requests.
fn wait_held(pre: &Prefill, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pre.producers.iter().any(|p| p.stats().held != n) {
        assert!(
            Instant::now() < deadline,
            "prefill never held the finished request"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Every rank of `pre` has handled `n` aborts from routers.
fn wait_router_aborts(pre: &Prefill, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while pre.producers.iter().any(|p| p.stats().router_aborts < n) {
        assert!(
            Instant::now() < deadline,
            "the router's abort never arrived"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Every rank of `pre` has a registration.
fn wait_registered(pre: &Prefill) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while pre
        .producers
        .iter()
        .any(|p| p.stats().remembered_registrations == 0)
    {
        assert!(
            Instant::now() < deadline,
            "prefill never got the registration"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Every rank of `pre` gave its one held request back as aborted, within 5 s of `since` (far
/// from the producer lease).
fn expect_given_back(pre: &Prefill, since: Instant) {
    for p in &pre.producers {
        let done = wait_finished(p, 1);
        assert_eq!(done[0].outcome, SendOutcome::NotSent(Reason::Aborted));
        assert_eq!(p.stats().held, 0);
    }
    assert!(
        since.elapsed() < Duration::from_secs(5),
        "{:?}",
        since.elapsed()
    );
}

#[test]
fn an_abandoned_transfer_is_given_back_at_once_by_every_prefill_rank() {
    let fabric = LoopbackFabric::new();
    let pre = tp2_prefill(&fabric);
    let c_spec = spec(1, 0, 8, MemoryOrder::Nhd, Arrangement::PerLayerKvHalves);
    let (_dec, consumer) = decode(&fabric, c_spec.clone(), LONG);
    let (p_blocks, c_blocks) = request_blocks(&pre, 16, 4, c_spec.block_tokens);
    // A first request connects decode to both prefill ranks.
    register(&consumer, pre.base, key(20, 0), 16, c_blocks.clone());
    pre.finish(key(20, 0), &p_blocks, 16);
    expect_ready(&consumer, key(20, 0), RequestId(1));
    for p in &pre.producers {
        assert_eq!(wait_finished(p, 1)[0].outcome, SendOutcome::Sent);
    }

    // Finished at prefill, dropped at decode before it registered.
    pre.finish(key(21, 0), &p_blocks, 16);
    wait_held(&pre, 1);
    let abandoned = Instant::now();
    consumer.abandon(pre.base, TransferId(21), None).unwrap();
    expect_given_back(&pre, abandoned);

    // Dropped at decode while prefill still computes: given back as soon as it finishes.
    consumer.abandon(pre.base, TransferId(22), None).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    pre.finish(key(22, 0), &p_blocks, 16);
    for p in &pre.producers {
        let done = wait_finished(p, 1);
        assert_eq!(done[0].outcome, SendOutcome::NotSent(Reason::Aborted));
    }

    // Nothing listens at that address: nobody to tell, and nothing fails; the consumer still
    // serves its prefill.
    consumer
        .abandon(free_ports(1), TransferId(23), None)
        .unwrap();
    register(&consumer, pre.base, key(24, 0), 16, c_blocks);
    pre.finish(key(24, 0), &p_blocks, 16);
    expect_ready(&consumer, key(24, 0), RequestId(1));
}

#[test]
fn an_abandon_connects_to_a_prefill_that_decode_never_reached_before() {
    let fabric = LoopbackFabric::new();
    let pre = tp2_prefill(&fabric);
    let c_spec = spec(1, 0, 8, MemoryOrder::Nhd, Arrangement::PerLayerKvHalves);
    let (_dec, consumer) = decode(&fabric, c_spec.clone(), LONG);
    let (p_blocks, c_blocks) = request_blocks(&pre, 16, 4, c_spec.block_tokens);
    // Finished at prefill; the decode instance's first request for it, dropped there before
    // it registered (no connection between the two yet).
    pre.finish(key(30, 0), &p_blocks, 16);
    wait_held(&pre, 1);
    let abandoned = Instant::now();
    consumer.abandon(pre.base, TransferId(30), None).unwrap();
    expect_given_back(&pre, abandoned);
    // The connection it made serves the next request.
    register(&consumer, pre.base, key(31, 0), 16, c_blocks);
    pre.finish(key(31, 0), &p_blocks, 16);
    expect_ready(&consumer, key(31, 0), RequestId(1));
}

/// The key vLLM's connector derives from the router's transfer id string.
fn routed(transfer: &str) -> AttemptKey {
    AttemptKey::new(TransferId::from_str_hash(transfer), Attempt(0))
}

#[test]
fn a_router_gives_a_dispatch_it_gave_up_back_on_every_prefill_rank() {
    let fabric = LoopbackFabric::new();
    let pre = tp2_prefill(&fabric);
    let (p_blocks, _) = request_blocks(&pre, 16, 4, 8);
    // Finished at prefill; the router's decode leg never reached a decode instance.
    pre.finish(routed("kvx-a"), &p_blocks, 16);
    wait_held(&pre, 1);
    let abandoned = Instant::now();
    let told = router::abandon(pre.base, "kvx-a", "decode unreachable", LONG, None).unwrap();
    assert_eq!(told, 2, "both ranks of the prefill instance");
    expect_given_back(&pre, abandoned);
    // Abandoned while prefill still computes (the abort handled first): given back as soon as
    // it finishes.
    router::abandon(pre.base, "kvx-b", "decode unreachable", LONG, None).unwrap();
    wait_router_aborts(&pre, 2);
    let finished = Instant::now();
    pre.finish(routed("kvx-b"), &p_blocks, 16);
    expect_given_back(&pre, finished);
}

#[test]
fn a_router_cannot_abandon_what_a_decode_registered_and_an_absent_prefill_is_an_error() {
    let fabric = LoopbackFabric::new();
    let pre = tp2_prefill(&fabric);
    let c_spec = spec(1, 0, 8, MemoryOrder::Nhd, Arrangement::PerLayerKvHalves);
    let (_dec, consumer) = decode(&fabric, c_spec.clone(), LONG);
    let (p_blocks, c_blocks) = request_blocks(&pre, 16, 4, c_spec.block_tokens);
    let k = routed("kvx-c");
    register(&consumer, pre.base, k, 16, c_blocks);
    wait_registered(&pre);
    router::abandon(pre.base, "kvx-c", "a confused router", LONG, None).unwrap();
    wait_router_aborts(&pre, 1);
    pre.finish(k, &p_blocks, 16);
    expect_ready(&consumer, k, RequestId(1));
    // Nothing listens there: the error names the address.
    let closed = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let err = router::abandon(closed, "kvx-d", "x", Duration::from_secs(2), None).unwrap_err();
    assert!(
        matches!(err, RouterError::Control { addr, .. } if addr == closed),
        "{err}"
    );
}

/// Pull into two decode ranks: once one rank has read the transfer, a router's abort of it is
/// refused (the other rank may be reading), and the second read still lands.
#[test]
fn a_router_cannot_abandon_a_pull_transfer_a_decode_reads() {
    let fabric = LoopbackFabric::new();
    let (pre, decoders) = one_rank_prefill_two_rank_decode(&fabric);
    let tokens = 30;
    let (p_blocks, c_blocks) = (ids(5..9), ids(30..38));
    pre.sides[0].fill(&p_blocks, tokens);
    let k = routed("kvx-p");
    pre.producers[0]
        .request_finished_pull(k, RequestId(4), p_blocks.clone(), tokens)
        .unwrap();
    let pull = |consumer: &Consumer| {
        consumer
            .pull(PullRequest {
                producer_groups: Vec::new(),
                push: PushRequest {
                    groups: Vec::new(),
                    key: k,
                    request: RequestId(3),
                    prefill: pre.base,
                    num_tokens: tokens,
                    skip_tokens: 0,
                    blocks: c_blocks.clone(),
                    capability: None,
                    trace: None,
                },
                producer_blocks: p_blocks.clone(),
            })
            .unwrap();
        expect_ready(consumer, k, RequestId(3));
    };
    pull(&decoders[0].1);
    // The producer learns of the first read's end from its completion message, sent as the
    // read ended (decode's Ready comes after it): a generous margin for the message.
    std::thread::sleep(Duration::from_millis(300));
    router::abandon(pre.base, "kvx-p", "a confused router", LONG, None).unwrap();
    wait_router_aborts(&pre, 1);
    pull(&decoders[1].1);
    for (side, _) in &decoders {
        side.verify(&c_blocks, 0, tokens);
    }
    let done = wait_finished(&pre.producers[0], 1);
    assert_eq!(done[0].outcome, SendOutcome::Sent);
}

#[test]
fn killed_prefill_fails_waiting_requests_at_once() {
    let fabric = LoopbackFabric::new();
    let mut pre = tp1_prefill(&fabric);
    let (_dec, consumer) = decode(
        &fabric,
        spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit),
        LONG,
    );
    register(&consumer, pre.base, key(8, 0), 8, ids(0..2));
    std::thread::sleep(Duration::from_millis(50));
    let started = Instant::now();
    pre.producers[0].shutdown();
    let events = wait_events(&consumer, 1);
    assert!(matches!(events[0], RecvEvent::Failed { .. }), "{events:?}");
    assert!(started.elapsed() < LONG, "failed only after the lease");
}

#[test]
fn bad_blocks_and_unreachable_prefill_fail_cleanly() {
    let fabric = LoopbackFabric::new();
    let (pre, _dec, consumer) = simple_pair(&fabric);
    // Block 999 is outside decode's 64 blocks: prefill refuses the registration.
    register(
        &consumer,
        pre.base,
        key(9, 0),
        8,
        vec![BlockId(1), BlockId(999)],
    );
    let events = wait_events(&consumer, 1);
    assert!(matches!(events[0], RecvEvent::Failed { .. }), "{events:?}");
    // Nothing listens here.
    let dead = free_ports(1);
    register_request(&consumer, dead, key(10, 0), RequestId(2), 8, ids(0..2));
    let events = wait_events(&consumer, 1);
    assert!(
        matches!(&events[0], RecvEvent::Failed { request: RequestId(2), detail, .. } if detail.contains("connect")),
        "{events:?}"
    );
    assert_eq!(consumer.stats().held, 0);
}

/// One producer rank serving both ranks of a TP-2 decode: the blocks go back once, after both.
/// A prefill of one rank (8-token blocks) and the two ranks of a decode instance (4-token
/// blocks, one KV head each).
fn one_rank_prefill_two_rank_decode(fabric: &LoopbackFabric) -> (Prefill, Vec<(Side, Consumer)>) {
    let pre = prefill(
        fabric,
        1,
        8,
        MemoryOrder::Hnd,
        Arrangement::PerLayerSplit,
        LONG,
    );
    let decoders = (0..2)
        .map(|rank| {
            decode(
                fabric,
                spec(2, rank, 4, MemoryOrder::Hnd, Arrangement::PerLayerSplit),
                LONG,
            )
        })
        .collect();
    (pre, decoders)
}

fn one_producer_two_consumers(pull: bool, registration_first: bool) {
    let fabric = LoopbackFabric::new();
    let (pre, decoders) = one_rank_prefill_two_rank_decode(&fabric);
    let tokens = 30;
    let p_blocks = ids(5..9);
    let c_blocks = ids(30..38);
    pre.sides[0].fill(&p_blocks, tokens);
    let k = key(11, 0);
    let request = PushRequest {
        groups: Vec::new(),
        key: k,
        request: RequestId(3),
        prefill: pre.base,
        num_tokens: tokens,
        skip_tokens: 0,
        blocks: c_blocks.clone(),
        capability: None,
        trace: None,
    };
    let consumers_go = || {
        for (_, consumer) in &decoders {
            if pull {
                consumer
                    .pull(PullRequest {
                        producer_groups: Vec::new(),
                        push: request.clone(),
                        producer_blocks: p_blocks.clone(),
                    })
                    .unwrap();
            } else {
                consumer.request_allocated(request.clone()).unwrap();
            }
        }
    };
    let producer_go = || {
        if pull {
            pre.producers[0]
                .request_finished_pull(k, RequestId(4), p_blocks.clone(), tokens)
                .unwrap();
        } else {
            pre.producers[0]
                .request_finished(k, RequestId(4), p_blocks.clone(), tokens)
                .unwrap();
        }
    };
    if registration_first || pull {
        if pull {
            producer_go();
            std::thread::sleep(Duration::from_millis(20));
            consumers_go();
        } else {
            consumers_go();
            std::thread::sleep(Duration::from_millis(30));
            producer_go();
        }
    } else {
        producer_go();
        std::thread::sleep(Duration::from_millis(30));
        consumers_go();
    }
    for (side, consumer) in &decoders {
        assert_eq!(
            wait_events(consumer, 1),
            vec![RecvEvent::Ready {
                key: k,
                request: RequestId(3)
            }]
        );
        side.verify(&c_blocks, 0, tokens);
    }
    let done = wait_finished(&pre.producers[0], 1);
    assert_eq!(
        done,
        vec![FinishedSending {
            request: RequestId(4),
            key: k,
            outcome: SendOutcome::Sent
        }]
    );
    std::thread::sleep(Duration::from_millis(30));
    assert!(
        pre.producers[0].take_finished().is_empty(),
        "blocks released twice"
    );
    assert_eq!(pre.producers[0].stats().held, 0);
}

#[test]
fn push_one_producer_rank_into_two_consumer_ranks_registration_first() {
    one_producer_two_consumers(false, true);
}

#[test]
fn push_one_producer_rank_into_two_consumer_ranks_prefill_first() {
    one_producer_two_consumers(false, false);
}

#[test]
fn pull_by_two_consumer_ranks_frees_after_both() {
    one_producer_two_consumers(true, false);
}

/// Waits until decode's blocks hold tokens `skip..tokens` of the request (every layer).
fn wait_landed(side: &Side, blocks: &[BlockId], skip: u64, tokens: u64) {
    wait_landed_layers(side, blocks, skip..tokens, 0..side.layout.spec().num_layers);
}

fn landed(side: &Side, blocks: &[BlockId], skip: u64, tokens: u64) -> bool {
    landed_in(side, blocks, skip..tokens, 0..side.layout.spec().num_layers)
}

/// Prefill reports progress while "computing": the tokens computed so far land in decode's
/// blocks (whole blocks of both sides, never the last token) before the request finishes; the
/// finish writes only the rest, with the notice. With another memory order on decode, the early
/// bytes are in prefill's order until the notices have come (the receiver re-lays the whole
/// request out then), so only the end result is checked.
fn push_streams(p_tp: u32, c_order: MemoryOrder, registration_first: bool) {
    let same_order = c_order == MemoryOrder::Nhd;
    let fabric = LoopbackFabric::new();
    let (p_bt, c_bt, tokens) = (4u32, 8u32, 45u64);
    let pre = prefill(
        &fabric,
        p_tp,
        p_bt,
        MemoryOrder::Nhd,
        Arrangement::PerLayerSplit,
        LONG,
    );
    let (dec, consumer) = decode(
        &fabric,
        spec(1, 0, c_bt, c_order, Arrangement::CrossLayer),
        LONG,
    );
    let (p_blocks, c_blocks) = request_blocks(&pre, tokens, p_bt, c_bt);
    let k = key(91, 0);
    let register = || {
        register_request(
            &consumer,
            pre.base,
            k,
            RequestId(5),
            tokens,
            c_blocks.clone(),
        )
    };
    let progress = |computed: u64| {
        let blocks = p_blocks[..computed.div_ceil(u64::from(p_bt)) as usize].to_vec();
        for p in &pre.producers {
            p.request_progress(k, blocks.clone(), computed).unwrap();
        }
    };
    if registration_first {
        register();
        std::thread::sleep(Duration::from_millis(20));
        // 21 tokens computed: the first two 8-token blocks go now.
        progress(21);
    } else {
        progress(21);
        std::thread::sleep(Duration::from_millis(20));
        register();
    }
    let early = |bytes: u64| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while pre
            .producers
            .iter()
            .map(|p| p.stats().bytes_streamed)
            .sum::<u64>()
            < bytes
        {
            assert!(Instant::now() < deadline, "early writes never posted");
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    let l = &pre.sides[0].layout;
    let per_token = l.head_bytes()
        * u64::from(l.local_heads() * l.kv_parts() * l.spec().num_layers)
        * u64::from(p_tp);
    early(16 * per_token);
    if same_order {
        wait_landed(&dec, &c_blocks, 0, 16);
        assert!(
            !landed(&dec, &c_blocks, 16, 24),
            "tokens past the whole blocks computed were written"
        );
    }
    // All but the last token computed: everything up to the last whole block before it.
    progress(44);
    early(40 * per_token);
    if same_order {
        wait_landed(&dec, &c_blocks, 16, 40);
        assert!(!landed(&dec, &c_blocks, 40, tokens));
    }
    assert!(consumer.take_events().is_empty(), "ready before finished");
    let streamed: u64 = pre.producers.iter().map(|p| p.stats().bytes_streamed).sum();
    pre.finish(k, &p_blocks, tokens);
    expect_ready(&consumer, k, RequestId(5));
    dec.verify(&c_blocks, 0, tokens);
    for p in &pre.producers {
        let done = wait_finished(p, 1);
        assert_eq!(done[0].outcome, SendOutcome::Sent);
        assert_eq!(p.stats().held, 0);
    }
    let written: u64 = pre.producers.iter().map(|p| p.stats().bytes_written).sum();
    assert_eq!(written, tokens * per_token, "every token written once");
    assert_eq!(streamed, 40 * per_token, "40 tokens went early");
}

#[test]
fn push_streams_computed_tokens_registration_first() {
    push_streams(1, MemoryOrder::Nhd, true);
}

#[test]
fn push_streams_from_two_producer_ranks_into_another_order_progress_first() {
    push_streams(2, MemoryOrder::Hnd, false);
}

/// Whether decode's blocks hold tokens `tokens` of the request in `layers` (same memory order).
fn landed_in(
    side: &Side,
    blocks: &[BlockId],
    tokens: std::ops::Range<u64>,
    layers: std::ops::Range<u32>,
) -> bool {
    let mem: Vec<Vec<u8>> = side.buffers.iter().map(|b| b.to_vec()).collect();
    let hb = side.layout.head_bytes() as usize;
    let (mut expected, mut held) = (vec![0u8; hb], vec![0u8; hb]);
    let mut all = true;
    for_each_head_vector_in(&side.layout, blocks, tokens, layers, |v| {
        head_vector(SEED, v.layer, v.kv, v.token, v.head, &mut expected);
        v.load(&mem[v.region as usize], &mut held);
        all = held == expected;
        all
    });
    all
}

/// A request computed in steps, each layer by layer (3 layers): each layer's tokens go out
/// as soon as they are final, in whole blocks of both sides and never the last token; the
/// finish writes only what is left, and decode gets every byte once.
fn push_streams_layer_by_layer(registration_first: bool) {
    let fabric = LoopbackFabric::new();
    let (p_bt, c_bt, tokens) = (4u32, 8u32, 45u64);
    let pre = prefill(
        &fabric,
        1,
        p_bt,
        MemoryOrder::Nhd,
        Arrangement::PerLayerSplit,
        LONG,
    );
    let (dec, consumer) = decode(
        &fabric,
        spec(1, 0, c_bt, MemoryOrder::Nhd, Arrangement::CrossLayer),
        LONG,
    );
    let p_blocks = ids(10..22);
    let c_blocks: Vec<BlockId> = (0..6).map(|i| BlockId(40 - i)).collect();
    pre.sides[0].fill(&p_blocks, tokens);
    let k = key(93, 0);
    let producer = &pre.producers[0];
    let layers = |upto: u64, layers: u32| {
        let blocks = p_blocks[..upto.div_ceil(u64::from(p_bt)) as usize].to_vec();
        producer
            .request_layer_progress(k, blocks, upto, layers)
            .unwrap();
    };
    let l = &pre.sides[0].layout;
    let per_layer_token = l.head_bytes() * u64::from(l.local_heads() * l.kv_parts());
    let streamed = |bytes: u64| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while producer.stats().bytes_streamed < bytes * per_layer_token {
            assert!(Instant::now() < deadline, "early writes never posted");
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    let register = || register(&consumer, pre.base, k, tokens, c_blocks.clone());
    if registration_first {
        register();
        std::thread::sleep(Duration::from_millis(20));
    }
    // First step: tokens ..20 in layers 0 and 1 (16 tokens of each go: whole 8-token blocks).
    layers(20, 2);
    if registration_first {
        streamed(32);
        assert!(landed_in(&dec, &c_blocks, 0..16, 0..2));
        assert!(
            !landed_in(&dec, &c_blocks, 0..16, 2..3),
            "a layer not final went"
        );
        assert!(
            !landed_in(&dec, &c_blocks, 16..20, 0..1),
            "a part block went"
        );
    }
    // Second step (the last): its layer 0. The first step ended, so its tokens are final in
    // layer 2 too; layer 0 goes up to the last whole block before the last token.
    layers(tokens, 1);
    if !registration_first {
        std::thread::sleep(Duration::from_millis(20));
        register();
    }
    // Layer 0: ..40, layer 1: ..16, layer 2: ..16.
    streamed(72);
    assert!(landed_in(&dec, &c_blocks, 0..40, 0..1));
    assert!(landed_in(&dec, &c_blocks, 0..16, 1..3));
    assert!(!landed_in(&dec, &c_blocks, 16..24, 1..3));
    layers(tokens, 2);
    streamed(96);
    assert!(landed_in(&dec, &c_blocks, 0..40, 1..2));
    assert!(
        !landed_in(&dec, &c_blocks, 40..tokens, 0..3),
        "the last block went early"
    );
    assert!(consumer.take_events().is_empty(), "ready before finished");
    producer
        .request_finished(k, RequestId(9), p_blocks.clone(), tokens)
        .unwrap();
    expect_ready(&consumer, k, RequestId(1));
    dec.verify(&c_blocks, 0, tokens);
    assert_eq!(wait_finished(producer, 1)[0].outcome, SendOutcome::Sent);
    let stats = producer.stats();
    assert_eq!(stats.bytes_streamed, 96 * per_layer_token);
    assert_eq!(
        stats.bytes_written,
        3 * tokens * per_layer_token,
        "every token of every layer written once"
    );
}

#[test]
fn push_streams_layer_by_layer_registration_first() {
    push_streams_layer_by_layer(true);
}

#[test]
fn push_streams_layer_by_layer_progress_first() {
    push_streams_layer_by_layer(false);
}

fn wait_landed_layers(
    side: &Side,
    blocks: &[BlockId],
    tokens: std::ops::Range<u64>,
    layers: std::ops::Range<u32>,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !landed_in(side, blocks, tokens.clone(), layers.clone()) {
        assert!(
            Instant::now() < deadline,
            "tokens {tokens:?} of layers {layers:?} never landed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Counts the reads (polls and waits) of a decode endpoint.
struct CountedReads {
    inner: Box<dyn Transport>,
    reads: Arc<AtomicU64>,
}

impl CountedReads {
    fn count(&self) {
        self.reads.fetch_add(1, Ordering::SeqCst);
    }
}

/// A prefill endpoint whose writes without a notice (early writes) report done only once the
/// decode endpoint has been read after they were posted, as `shm`'s writes do when they need
/// the target's progress (a full command queue, small pieces).
struct ReadGatedWrites {
    inner: Box<dyn Transport>,
    reads: Arc<AtomicU64>,
    /// Early writes not reported yet: the decode reads counted when each was posted.
    gated: HashMap<OpId, u64>,
    held: Vec<Event>,
}

impl ReadGatedWrites {
    /// Moves the gated completions out of `events` (from `first` on) and puts back those whose
    /// decode endpoint has been read since; returns how many events `events` gained.
    fn gate(&mut self, events: &mut Vec<Event>, first: usize) -> usize {
        let reads = self.reads.load(Ordering::SeqCst);
        let fresh: Vec<Event> = events.drain(first..).collect();
        for event in fresh {
            match event {
                Event::WriteDone { op, .. } if self.gated.contains_key(&op) => {
                    self.held.push(event);
                }
                other => events.push(other),
            }
        }
        for event in std::mem::take(&mut self.held) {
            let due = match &event {
                Event::WriteDone { op, .. } => self.gated.get(op).is_some_and(|&at| reads > at),
                _ => true,
            };
            if due {
                if let Event::WriteDone { op, .. } = &event {
                    self.gated.remove(op);
                }
                events.push(event);
            } else {
                self.held.push(event);
            }
        }
        events.len() - first
    }
}

impl Transport for CountedReads {
    forward_transport!(connections);
    forward_transport!(writes);
    forward_transport!(polls counted);
}

impl Transport for ReadGatedWrites {
    forward_transport!(connections);
    fn write(
        &mut self,
        peer: PeerId,
        ops: &[kvx_layout::CopyOp],
        notice: Option<Notice>,
    ) -> Result<OpId, kvx_rdma::WriteError> {
        let op = self.inner.write(peer, ops, notice)?;
        if notice.is_none() {
            self.gated.insert(op, self.reads.load(Ordering::SeqCst));
        }
        Ok(op)
    }
    forward_transport!(polls gate);
}

/// A TP1 prefill (4-token blocks, NHD) on `transport`: its address, cache and producer.
fn tp1_prefill_on(transport: Box<dyn Transport>) -> (SocketAddr, Side, Producer) {
    let base = free_ports(1);
    let (side, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut c = config(1);
    c.listen = base;
    (base, side, Producer::start(c, cache, transport).unwrap())
}

#[test]
fn an_early_write_waiting_for_a_consumer_that_takes_hints_nudges_it() {
    // Decode takes finishing hints and, with heartbeats a minute apart, reads its transport only
    // when woken. Prefill's early write completes only once decode has read after it: without
    // a nudge it would wait for the finish.
    let fabric = LoopbackFabric::new();
    let reads = Arc::new(AtomicU64::new(0));
    let (base, side, producer) = tp1_prefill_on(Box::new(ReadGatedWrites {
        inner: Box::new(fabric.endpoint()),
        reads: Arc::clone(&reads),
        gated: HashMap::new(),
        held: Vec::new(),
    }));
    let c_spec = spec(1, 0, 8, MemoryOrder::Nhd, Arrangement::PerLayerSplit);
    let (dec, cache) = Side::new(c_spec);
    let mut c = config(2);
    c.heartbeat_interval = Duration::from_secs(60);
    c.finishing_hints = Some(true);
    let counted = CountedReads {
        inner: Box::new(fabric.endpoint()),
        reads: Arc::clone(&reads),
    };
    let consumer = Consumer::start(c, cache, Box::new(counted)).unwrap();
    let tokens = 45;
    let p_blocks = ids(10..22);
    side.fill(&p_blocks, tokens);
    let c_blocks: Vec<BlockId> = (0..6).map(|i| BlockId(40 - i)).collect();
    let k = key(93, 0);
    register_request(&consumer, base, k, RequestId(5), tokens, c_blocks.clone());
    std::thread::sleep(Duration::from_millis(20));
    // 21 tokens computed: their first two 8-token blocks of decode go early.
    producer
        .request_progress(k, p_blocks[..6].to_vec(), 21)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while producer.stats().nudges == 0 {
        assert!(
            Instant::now() < deadline,
            "the waiting consumer was never nudged"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(producer.stats().bytes_streamed > 0);
    producer
        .request_finished(k, RequestId(9), p_blocks.clone(), tokens)
        .unwrap();
    expect_ready(&consumer, k, RequestId(5));
    dec.verify(&c_blocks, 0, tokens);
    assert_eq!(wait_finished(&producer, 1)[0].outcome, SendOutcome::Sent);
    assert_eq!(producer.stats().finishing_hints, 1);
}

/// A loopback endpoint that records the peers it connected and those it was told to forget.
struct RecordedPeers {
    inner: Box<dyn Transport>,
    connected: Arc<Mutex<Vec<PeerId>>>,
    forgotten: Arc<Mutex<Vec<PeerId>>>,
}

impl Transport for RecordedPeers {
    forward_transport!(base);
    forward_transport!(reads);
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn connect(&mut self, peer: &kvx_rdma::EndpointDesc) -> Result<PeerId, kvx_rdma::ConnectError> {
        let id = self.inner.connect(peer)?;
        self.connected.lock().unwrap().push(id);
        Ok(id)
    }
    fn disconnect(&mut self, peer: PeerId) {
        self.forgotten.lock().unwrap().push(peer);
        self.inner.disconnect(peer);
    }
    forward_transport!(writes);
    forward_transport!(polls unchanged);
}

impl RecordedPeers {
    fn unchanged(&mut self, events: &mut [Event], first: usize) -> usize {
        events.len() - first
    }
}

#[test]
fn prefill_forgets_the_endpoint_of_a_decode_that_went_away() {
    let fabric = LoopbackFabric::new();
    let base = free_ports(1);
    let (side, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut c = config(1);
    c.listen = base;
    let connected = Arc::new(Mutex::new(Vec::new()));
    let forgotten = Arc::new(Mutex::new(Vec::new()));
    let recorded = RecordedPeers {
        inner: Box::new(fabric.endpoint()),
        connected: Arc::clone(&connected),
        forgotten: Arc::clone(&forgotten),
    };
    let producer = Producer::start(c, cache, Box::new(recorded)).unwrap();
    side.fill(&ids(10..13), 12);
    let (dec, mut consumer) = decode(
        &fabric,
        spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit),
        LONG,
    );
    let k = key(95, 0);
    register(&consumer, base, k, 12, ids(20..23));
    producer
        .request_finished(k, RequestId(9), ids(10..13), 12)
        .unwrap();
    expect_ready(&consumer, k, RequestId(1));
    dec.verify(&ids(20..23), 0, 12);
    assert_eq!(wait_finished(&producer, 1)[0].outcome, SendOutcome::Sent);
    let peer = connected.lock().unwrap()[0];
    assert!(forgotten.lock().unwrap().is_empty());
    // Decode goes away: its control connection closes, and prefill's transport forgets it.
    consumer.shutdown();
    let deadline = Instant::now() + Duration::from_secs(10);
    while forgotten.lock().unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the endpoint was never forgotten"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(*forgotten.lock().unwrap(), vec![peer]);
}

/// Moves the events from `first` on that `is_held` picks into `held`, and gives every held one
/// back once `release` is set; returns how many events from `first` remain.
fn hold_back(
    events: &mut Vec<Event>,
    first: usize,
    held: &mut Vec<Event>,
    release: &std::sync::atomic::AtomicBool,
    is_held: impl Fn(&Event) -> bool,
) -> usize {
    let new: Vec<Event> = events.drain(first..).collect();
    for event in new {
        if is_held(&event) {
            held.push(event);
        } else {
            events.push(event);
        }
    }
    if release.load(Ordering::SeqCst) {
        events.append(held);
    }
    events.len() - first
}

/// A loopback endpoint whose reads complete only once `release` is set (their bytes move at
/// once; their `ReadDone` events wait).
struct HeldReads {
    inner: Box<dyn Transport>,
    release: Arc<std::sync::atomic::AtomicBool>,
    held: Vec<Event>,
}

impl HeldReads {
    fn hold(&mut self, events: &mut Vec<Event>, first: usize) -> usize {
        hold_back(events, first, &mut self.held, &self.release, |event| {
            matches!(event, Event::ReadDone { .. })
        })
    }
}

impl Transport for HeldReads {
    forward_transport!(connections);
    forward_transport!(writes);
    forward_transport!(polls hold);
}

#[test]
fn a_lost_prefill_fails_a_pull_only_once_its_reads_ended() {
    let fabric = LoopbackFabric::new();
    let mut pre = tp1_prefill(&fabric);
    let (_dec, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let endpoint = fabric.endpoint();
    let waker = endpoint.waker().expect("the loopback endpoint has a waker");
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let held = HeldReads {
        inner: Box::new(endpoint),
        release: Arc::clone(&release),
        held: Vec::new(),
    };
    let mut c = config(2);
    c.registration_lease = LONG;
    c.quiesce_timeout = Some(LONG);
    let consumer = Consumer::start(c, cache, Box::new(held)).unwrap();
    let tokens = 8;
    pre.sides[0].fill(&ids(0..2), tokens);
    pre.producers[0]
        .request_finished_pull(key(9, 0), RequestId(1), ids(0..2), tokens)
        .unwrap();
    consumer
        .pull(PullRequest {
            producer_groups: Vec::new(),
            push: PushRequest {
                groups: Vec::new(),
                key: key(9, 0),
                request: RequestId(2),
                prefill: pre.base,
                num_tokens: tokens,
                skip_tokens: 0,
                blocks: ids(20..22),
                capability: None,
                trace: None,
            },
            producer_blocks: ids(0..2),
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    // Prefill goes away while decode's read is in flight: the request fails, but only once
    // the read has ended, so that the engine never gets blocks back that it may still write.
    pre.producers[0].shutdown();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        consumer.take_events(),
        vec![],
        "failed with a read in flight"
    );
    release.store(true, Ordering::SeqCst);
    waker.wake();
    let events = wait_events(&consumer, 1);
    assert!(
        matches!(
            &events[..],
            [RecvEvent::Failed { reason: Reason::PeerFailed, detail, .. }] if detail.is_empty()
        ),
        "{events:?}"
    );
}

/// A loopback endpoint whose writes do not end until `release` is set: their bytes move, but
/// their notices are dropped and their completions withheld, as for a write stuck in the
/// fabric. Closing it takes `close_time`; `closed` says when it ended.
struct StuckWrites {
    inner: Box<dyn Transport>,
    stuck: HashSet<OpId>,
    held: Vec<Event>,
    release: Arc<std::sync::atomic::AtomicBool>,
    close_time: Duration,
    closed: Arc<Mutex<Option<std::time::SystemTime>>>,
}

impl Transport for StuckWrites {
    forward_transport!(connections);
    fn write(
        &mut self,
        peer: PeerId,
        ops: &[kvx_layout::CopyOp],
        _notice: Option<Notice>,
    ) -> Result<OpId, kvx_rdma::WriteError> {
        let op = self.inner.write(peer, ops, None)?;
        self.stuck.insert(op);
        Ok(op)
    }
    forward_transport!(polls withhold);
}

impl StuckWrites {
    fn withhold(&mut self, events: &mut Vec<Event>, first: usize) -> usize {
        let stuck = &self.stuck;
        hold_back(events, first, &mut self.held, &self.release, |event| {
            matches!(
                event,
                Event::WriteDone { op, .. } | Event::Failed { op, .. } if stuck.contains(op)
            )
        })
    }
}

impl Drop for StuckWrites {
    fn drop(&mut self) {
        std::thread::sleep(self.close_time);
        *self.closed.lock().unwrap() = Some(std::time::SystemTime::now());
    }
}

#[test]
fn a_producer_shutting_down_closes_its_transport_before_decode_hears_of_the_failure() {
    let fabric = LoopbackFabric::new();
    let base = free_ports(1);
    let (side, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut c = config(1);
    c.listen = base;
    let closed = Arc::new(Mutex::new(None));
    let stuck = StuckWrites {
        inner: Box::new(fabric.endpoint()),
        stuck: HashSet::new(),
        held: Vec::new(),
        release: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        close_time: Duration::from_millis(300),
        closed: Arc::clone(&closed),
    };
    let mut producer = Producer::start(c, cache, Box::new(stuck)).unwrap();
    side.fill(&ids(10..13), 12);
    let (_dec, consumer) = decode(
        &fabric,
        spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit),
        LONG,
    );
    let k = key(96, 0);
    register(&consumer, base, k, 12, ids(20..23));
    producer
        .request_finished(k, RequestId(9), ids(10..13), 12)
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(consumer.take_events(), vec![], "a stuck write never ends");
    // Prefill shuts down with the write in flight: decode hears that it failed only once
    // prefill's transport is closed, so that nothing can land in blocks it gives back.
    let started = Instant::now();
    producer.shutdown();
    let deadline = Instant::now() + Duration::from_secs(10);
    let (event, told) = loop {
        if let Some(timed) = consumer.take_events_timed().into_iter().next() {
            break timed;
        }
        assert!(Instant::now() < deadline, "decode never heard");
        std::thread::sleep(Duration::from_millis(2));
    };
    let closed = closed.lock().unwrap().expect("the transport was closed");
    assert!(
        told >= closed,
        "decode was told {:?} before the transport closed",
        closed.duration_since(told).unwrap_or_default()
    );
    assert!(
        matches!(event, RecvEvent::Failed { key: failed, .. } if failed == k),
        "{event:?}"
    );
    assert!(started.elapsed() < LONG, "failed only after the lease");
}

#[test]
fn a_prefill_that_never_answers_delays_only_its_own_requests() {
    let fabric = LoopbackFabric::new();
    let pre = tp1_prefill(&fabric);
    // A "prefill" whose connections the kernel accepts and nobody ever answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let (dec, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut c = config(2);
    c.registration_lease = LONG;
    c.connect_timeout = Duration::from_secs(3);
    let consumer = Consumer::start(c, cache, Box::new(fabric.endpoint())).unwrap();
    let started = Instant::now();
    let stuck = key(98, 0);
    register(&consumer, silent_addr, stuck, 8, ids(0..2));
    // A request for the live prefill goes through while that handshake waits.
    let k = key(99, 0);
    pre.sides[0].fill(&ids(0..3), 12);
    register(&consumer, pre.base, k, 12, ids(4..7));
    pre.producers[0]
        .request_finished(k, RequestId(9), ids(0..3), 12)
        .unwrap();
    let events = wait_events(&consumer, 1);
    assert!(
        matches!(events[0], RecvEvent::Ready { key: ready, .. } if ready == k),
        "{events:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "waited for the silent prefill's handshake: {:?}",
        started.elapsed()
    );
    dec.verify(&ids(4..7), 0, 12);
    // The silent prefill's request fails once its handshake times out...
    let events = wait_events(&consumer, 1);
    assert!(
        matches!(
            &events[0],
            RecvEvent::Failed { key: failed, reason: Reason::PeerFailed, .. } if *failed == stuck
        ),
        "{events:?}"
    );
    assert!(started.elapsed() >= Duration::from_secs(3));
    // ... and the next one for it fails at once, without another wait.
    let again = Instant::now();
    register(&consumer, silent_addr, key(100, 0), 8, ids(8..10));
    expect_failed(&consumer, Reason::PeerFailed);
    assert!(
        again.elapsed() < Duration::from_secs(1),
        "{:?}",
        again.elapsed()
    );
    assert_eq!(consumer.stats().held, 0);
    drop(silent);
}

#[test]
fn a_cancel_after_matching_fails_only_once_the_write_in_flight_ended() {
    let fabric = LoopbackFabric::new();
    let base = free_ports(1);
    let (side, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut c = config(1);
    c.listen = base;
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let endpoint = fabric.endpoint();
    let waker = endpoint.waker().expect("the loopback endpoint has a waker");
    let stuck = StuckWrites {
        inner: Box::new(endpoint),
        stuck: HashSet::new(),
        held: Vec::new(),
        release: Arc::clone(&release),
        close_time: Duration::ZERO,
        closed: Arc::new(Mutex::new(None)),
    };
    let producer = Producer::start(c, cache, Box::new(stuck)).unwrap();
    side.fill(&ids(10..13), 12);
    let (_dec, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut dc = config(2);
    dc.registration_lease = LONG;
    dc.quiesce_timeout = Some(LONG);
    let consumer = Consumer::start(dc, cache, Box::new(fabric.endpoint())).unwrap();
    let k = key(101, 0);
    register(&consumer, base, k, 12, ids(20..23));
    producer
        .request_finished(k, RequestId(9), ids(10..13), 12)
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(producer.stats().held, 1);
    // Decode gives up while prefill's write is in flight: the engine hears of it only once
    // prefill says the write ended (it may still land until then).
    consumer.cancel(k.transfer, Some(k.attempt)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        consumer.take_events(),
        vec![],
        "failed with a write in flight"
    );
    assert_eq!(
        producer.stats().held,
        1,
        "blocks released under a write in flight"
    );
    release.store(true, Ordering::SeqCst);
    waker.wake();
    let events = wait_events(&consumer, 1);
    assert!(
        matches!(
            events[0],
            RecvEvent::Failed { key: failed, reason: Reason::Aborted, .. } if failed == k
        ),
        "{events:?}"
    );
    let done = wait_finished(&producer, 1);
    assert!(
        matches!(done[0].outcome, SendOutcome::NotSent(_)),
        "{done:?}"
    );
    assert_eq!(producer.stats().held, 0);
    assert_eq!(consumer.stats().held, 0);
}

#[test]
fn settings_that_must_be_positive_are_refused_at_start() {
    let fabric = LoopbackFabric::new();
    type Zeroes = fn(&mut ConnectorConfig);
    let zero: [(&str, Zeroes); 3] = [
        ("heartbeat_interval", |c| {
            c.heartbeat_interval = Duration::ZERO
        }),
        ("registration_lease", |c| {
            c.registration_lease = Duration::ZERO
        }),
        ("connect_timeout", |c| c.connect_timeout = Duration::ZERO),
    ];
    for (name, set) in zero {
        let (_side, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
        let mut c = config(2);
        set(&mut c);
        let refused = Consumer::start(c, cache, Box::new(fabric.endpoint())).err();
        assert!(
            matches!(refused, Some(kvx_vllm::StartError::ZeroSetting(n)) if n == name),
            "{name}: {refused:?}"
        );
    }
    let (_side, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut c = config(1);
    c.producer_lease = Duration::ZERO;
    let refused = Producer::start(c, cache, Box::new(fabric.endpoint())).err();
    assert!(
        matches!(
            refused,
            Some(kvx_vllm::StartError::ZeroSetting("producer_lease"))
        ),
        "{refused:?}"
    );
}

#[test]
fn a_newer_attempt_replaces_one_that_waits_for_its_prefills_connection() {
    let fabric = LoopbackFabric::new();
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let (_dec, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut c = config(2);
    c.connect_timeout = Duration::from_secs(1);
    let consumer = Consumer::start(c, cache, Box::new(fabric.endpoint())).unwrap();
    let addr = silent.local_addr().unwrap();
    register(&consumer, addr, key(104, 0), 8, ids(0..2));
    register(&consumer, addr, key(104, 1), 8, ids(2..4));
    // The same attempt again, or an older one, is refused; the newer one replaced the first.
    register(&consumer, addr, key(104, 0), 8, ids(4..6));
    let events = wait_events(&consumer, 2);
    assert_failed(&events, 0, key(104, 0), Reason::Superseded);
    assert_failed(&events, 1, key(104, 0), Reason::Stale);
    // The newer attempt fails only when the handshake does.
    let events = wait_events(&consumer, 1);
    assert_failed(&events, 0, key(104, 1), Reason::PeerFailed);
    drop(silent);
}

/// Asserts that `events[i]` says `key` failed for `reason`.
fn assert_failed(events: &[RecvEvent], i: usize, key: AttemptKey, reason: Reason) {
    assert!(
        matches!(
            &events[i],
            RecvEvent::Failed { key: failed, reason: r, .. } if *failed == key && *r == reason
        ),
        "{events:?}"
    );
}

/// [`simple_pair`] with decode's notice board on or off and its heartbeats every `heartbeat`.
fn board_pair(
    fabric: &LoopbackFabric,
    board: bool,
    heartbeat: Duration,
) -> (Prefill, Side, Consumer) {
    let pre = tp1_prefill(fabric);
    let (dec, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut c = config(2);
    c.notice_board = board;
    c.heartbeat_interval = heartbeat;
    let consumer = Consumer::start(c, cache, Box::new(fabric.endpoint())).unwrap();
    (pre, dec, consumer)
}

/// Push notices land in decode's notice board, where the engine's `take_events` finds them (the
/// driver thread is not woken for them); switched off, they come as messages; both deliver the
/// same bytes.
#[test]
fn push_notices_land_in_decodes_notice_board_unless_switched_off() {
    for board in [true, false] {
        let fabric = LoopbackFabric::new();
        let (pre, dec, consumer) = board_pair(&fabric, board, config(2).heartbeat_interval);
        let (p_blocks, c_blocks) = request_blocks(&pre, 22, 4, 4);
        for t in 0..3 {
            let k = key(500 + t, 0);
            register_request(
                &consumer,
                pre.base,
                k,
                RequestId(t as u64),
                22,
                c_blocks.clone(),
            );
            pre.finish(k, &p_blocks, 22);
            expect_ready(&consumer, k, RequestId(t as u64));
            dec.verify(&c_blocks, 0, 22);
            assert_eq!(
                wait_finished(&pre.producers[0], 1)[0].outcome,
                SendOutcome::Sent
            );
        }
        let stats = consumer.stats();
        assert_eq!(
            stats.board_ready,
            if board { 3 } else { 0 },
            "board {board}"
        );
        assert_eq!(stats.transfers_ok, 3);
        assert_eq!(stats.held, 0);
    }
}

/// A cancel that races the last notice's landing in the board ends the request exactly once:
/// ready (the engine thread saw the notice first) or aborted (the driver took it back first),
/// never both, and decode holds nothing afterwards. A third of the rounds have the engine
/// thread first, a third the driver, a third race.
#[test]
fn a_cancel_racing_a_board_notice_ends_the_request_once() {
    let fabric = LoopbackFabric::new();
    let (pre, _dec, consumer) = simple_pair(&fabric);
    let (p_blocks, c_blocks) = request_blocks(&pre, 12, 4, 4);
    let (mut ready, mut aborted) = (0, 0);
    for t in 0..42u128 {
        let k = key(600 + t, 0);
        register(&consumer, pre.base, k, 12, c_blocks.clone());
        pre.finish(k, &p_blocks, 12);
        // The notice is in the board once prefill says the blocks were sent.
        assert_eq!(
            wait_finished(&pre.producers[0], 1)[0].outcome,
            SendOutcome::Sent
        );
        let mut events = Vec::new();
        match t % 3 {
            // The engine thread looks first, then cancels.
            0 => {
                events = wait_events(&consumer, 1);
                consumer.cancel(k.transfer, Some(k.attempt)).unwrap();
            }
            // The driver takes it back first: it has given up before the engine looks.
            1 => {
                let failed = consumer.stats().transfers_failed;
                consumer.cancel(k.transfer, Some(k.attempt)).unwrap();
                let deadline = Instant::now() + Duration::from_secs(10);
                while consumer.stats().transfers_failed == failed {
                    assert!(Instant::now() < deadline, "the cancel was not handled");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            // A race: whichever comes first.
            _ => {
                std::thread::sleep(Duration::from_micros(200 * (t as u64 % 7)));
                consumer.cancel(k.transfer, Some(k.attempt)).unwrap();
            }
        }
        if events.is_empty() {
            events = wait_events(&consumer, 1);
        }
        std::thread::sleep(Duration::from_millis(30));
        let late = consumer.take_events();
        assert!(
            late.is_empty(),
            "a second outcome for {k}: {events:?} then {late:?}"
        );
        match &events[..] {
            [RecvEvent::Ready { key: r, .. }] if *r == k => ready += 1,
            [RecvEvent::Failed {
                key: f,
                reason: Reason::Aborted,
                ..
            }] if *f == k => aborted += 1,
            other => panic!("unexpected {other:?}"),
        }
        match t % 3 {
            0 => assert!(matches!(events[0], RecvEvent::Ready { .. }), "{events:?}"),
            1 => assert!(matches!(events[0], RecvEvent::Failed { .. }), "{events:?}"),
            _ => {}
        }
    }
    assert_eq!(ready + aborted, 42);
    let deadline = Instant::now() + Duration::from_secs(5);
    while consumer.stats().held != 0 {
        assert!(Instant::now() < deadline, "{:?}", consumer.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    eprintln!("ready {ready}, aborted {aborted}");
}

/// With a notice board, the engine thread registers a request with a connected prefill itself
/// and finds it ready in the board: decode's driver thread sleeps through a stream of requests.
/// Without one, each request wakes it (the registration, the notice).
#[test]
fn with_a_notice_board_requests_do_not_wake_decodes_driver() {
    for board in [true, false] {
        let fabric = LoopbackFabric::new();
        let (pre, dec, consumer) = board_pair(&fabric, board, Duration::from_secs(30));
        let (p_blocks, c_blocks) = request_blocks(&pre, 8, 4, 4);
        let round = |t: u128| {
            let k = key(700 + t, 0);
            register(&consumer, pre.base, k, 8, c_blocks.clone());
            pre.finish(k, &p_blocks, 8);
            expect_ready(&consumer, k, RequestId(1));
            assert_eq!(
                wait_finished(&pre.producers[0], 1)[0].outcome,
                SendOutcome::Sent
            );
        };
        // The first request connects.
        round(0);
        std::thread::sleep(Duration::from_millis(50));
        let before = consumer.stats().driver_turns;
        for t in 1..=20 {
            round(t);
        }
        dec.verify(&c_blocks, 0, 8);
        let woken = consumer.stats().driver_turns - before;
        if board {
            assert!(woken <= 3, "the driver woke {woken} times for 20 requests");
        } else {
            assert!(
                woken >= 20,
                "the driver woke only {woken} times for 20 requests"
            );
        }
        eprintln!("board {board}: driver woken {woken} times for 20 requests");
    }
}

/// A decode instance aborts only what it registered, or what nobody registered: an abort from
/// another instance for a transfer this one registered is ignored, and the transfer lands. The
/// other instance speaks the protocol by hand (its hello, then aborts).
#[test]
fn an_abort_from_another_decode_instance_is_ignored() {
    use kvx_core::wire::{Abort, Message, Role};
    use std::io::Write as _;
    use std::net::TcpStream;

    let fabric = LoopbackFabric::new();
    let (pre, dec, consumer) = simple_pair(&fabric);
    let (p_blocks, c_blocks) = request_blocks(&pre, 12, 4, 4);
    let mine = key(801, 0);
    register(&consumer, pre.base, mine, 12, c_blocks.clone());
    wait_registered(&pre);
    // Another decode instance connects with a valid hello.
    let other_spec = spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit);
    let (_other, cache) = Side::new(other_spec.clone());
    let mut endpoint = fabric.endpoint();
    for region in cache.regions {
        endpoint.register(region).unwrap();
    }
    let desc = endpoint.local_desc();
    let hello = hand_hello(Role::Consumer, 9, other_spec, &desc, 0);
    let mut rogue = TcpStream::connect(pre.base).unwrap();
    let abort = |transfer: TransferId| {
        Message::Abort(Abort {
            transfer,
            attempt: None,
            reason: "not mine".into(),
            capability: None,
        })
        .to_bytes()
        .unwrap()
    };
    rogue.write_all(&hello.to_bytes().unwrap()).unwrap();
    rogue.write_all(&abort(mine.transfer)).unwrap();
    // A transfer nobody registered: its abort is honoured, which shows the connection works.
    let orphan = key(802, 0);
    pre.producers[0]
        .request_finished(orphan, RequestId(8), ids(30..33), 12)
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    rogue.write_all(&abort(orphan.transfer)).unwrap();
    let done = wait_finished(&pre.producers[0], 1);
    assert_eq!(done[0].key, orphan);
    assert_eq!(done[0].outcome, SendOutcome::NotSent(Reason::Aborted));
    // The registered transfer was not aborted: it lands.
    pre.finish(mine, &p_blocks, 12);
    expect_ready(&consumer, mine, RequestId(1));
    dec.verify(&c_blocks, 0, 12);
    assert_eq!(
        wait_finished(&pre.producers[0], 1)[0].outcome,
        SendOutcome::Sent
    );
    drop(rogue);
}

/// A decode endpoint whose peers' writes need it to read its queue now and then, as libfabric
/// `shm`'s do (`peer_rma_occasional_reads`); it counts its reads, and those made on the engine's
/// thread (any but the connector's own threads).
struct OccasionalReads {
    inner: Box<dyn Transport>,
    reads: Arc<AtomicU64>,
    engine_reads: Arc<AtomicU64>,
}

impl OccasionalReads {
    fn count(&self) {
        self.reads.fetch_add(1, Ordering::SeqCst);
        let engine = !std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("kvx-"));
        if engine {
            self.engine_reads.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Transport for OccasionalReads {
    forward_transport!(connections_only);
    forward_transport!(writes);
    fn capabilities(&self) -> Capabilities {
        let mut caps = self.inner.capabilities();
        caps.peer_rma_occasional_reads = true;
        caps
    }
    fn notice_board(&mut self, slots: usize) -> Option<Arc<kvx_rdma::board::NoticeBoard>> {
        self.inner.notice_board(slots)
    }
    forward_transport!(polls counted);
}

/// A write not made yet: decode's reads when it was posted, its id, what it does.
type Deferred = (u64, OpId, PeerId, Vec<kvx_layout::CopyOp>, Option<Notice>);

/// A prefill endpoint whose writes, data and notice, happen only once the decode endpoint has
/// been read after they were posted: `shm`'s first contact and full command queue, at their
/// worst.
struct DeferredWrites {
    inner: Box<dyn Transport>,
    reads: Arc<AtomicU64>,
    /// Writes not made yet.
    queued: Vec<Deferred>,
    /// The inner endpoint's ids of the writes made, and the ids they were given here.
    made: HashMap<OpId, OpId>,
    next: u64,
}

impl DeferredWrites {
    /// Makes the writes whose decode endpoint was read since they were posted.
    fn release(&mut self, events: &mut Vec<Event>) {
        let reads = self.reads.load(Ordering::SeqCst);
        let (due, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut self.queued)
            .into_iter()
            .partition(|q| reads > q.0);
        self.queued = wait;
        for (_, id, peer, ops, notice) in due {
            match self.inner.write(peer, &ops, notice) {
                Ok(inner) => {
                    self.made.insert(inner, id);
                }
                Err(e) => events.push(Event::Failed {
                    op: id,
                    kind: kvx_rdma::OpKind::Write,
                    peer,
                    error: kvx_rdma::OpError::Backend {
                        source: e.to_string().into(),
                    },
                }),
            }
        }
    }

    /// Gives the events added from `first` on the ids this endpoint handed out.
    fn rename(&mut self, events: &mut [Event], first: usize) -> usize {
        for event in &mut events[first..] {
            if let Event::WriteDone { op, .. } | Event::Failed { op, .. } = event {
                if let Some(id) = self.made.remove(op) {
                    *op = id;
                }
            }
        }
        events.len() - first
    }
}

impl Transport for DeferredWrites {
    forward_transport!(connections);
    fn write(
        &mut self,
        peer: PeerId,
        ops: &[kvx_layout::CopyOp],
        notice: Option<Notice>,
    ) -> Result<OpId, kvx_rdma::WriteError> {
        self.next += 1;
        let id = OpId(1 << 48 | self.next);
        let reads = self.reads.load(Ordering::SeqCst);
        self.queued.push((reads, id, peer, ops.to_vec(), notice));
        Ok(id)
    }
    fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, kvx_rdma::PollError> {
        let first = events.len();
        self.release(events);
        self.inner.poll(events)?;
        Ok(self.rename(events, first))
    }
    fn wait(
        &mut self,
        events: &mut Vec<Event>,
        timeout: Duration,
    ) -> Result<usize, kvx_rdma::PollError> {
        let first = events.len();
        self.release(events);
        let timeout = if self.queued.is_empty() {
            timeout
        } else {
            timeout.min(Duration::from_millis(1))
        };
        self.inner.wait(events, timeout)?;
        Ok(self.rename(events, first))
    }
}

/// Decode's transport needs reading now and then for its peers' writes to land (as `shm`'s
/// does), its notices go to the board, and its driver, with heartbeats a minute apart, reads it
/// only for a writer's first contact (the first request lands with the engine not reading):
/// every later request lands because the engine thread's `take_events` reads it. Without those
/// reads, the second request would wait a minute.
#[test]
fn with_a_board_on_a_transport_that_needs_occasional_reads_the_engine_thread_reads_it() {
    let fabric = LoopbackFabric::new();
    let reads = Arc::new(AtomicU64::new(0));
    let engine_reads = Arc::new(AtomicU64::new(0));
    let (base, side, producer) = tp1_prefill_on(Box::new(DeferredWrites {
        inner: Box::new(fabric.endpoint()),
        reads: Arc::clone(&reads),
        queued: Vec::new(),
        made: HashMap::new(),
        next: 0,
    }));
    let (dec, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut c = config(2);
    c.heartbeat_interval = Duration::from_secs(60);
    let occasional = OccasionalReads {
        inner: Box::new(fabric.endpoint()),
        reads: Arc::clone(&reads),
        engine_reads: Arc::clone(&engine_reads),
    };
    let consumer = Consumer::start(c, cache, Box::new(occasional)).unwrap();
    let tokens = 16;
    let p_blocks = ids(10..14);
    side.fill(&p_blocks, tokens);
    let c_blocks: Vec<BlockId> = (0..4).map(|i| BlockId(40 - i)).collect();
    for t in 0..6 {
        let k = key(900 + t, 0);
        register_request(&consumer, base, k, RequestId(3), tokens, c_blocks.clone());
        std::thread::sleep(Duration::from_millis(10));
        producer
            .request_finished(k, RequestId(9), p_blocks.clone(), tokens)
            .unwrap();
        if t == 0 {
            // The writer's first contact: the driver reads the transport until its notice
            // lands, with the engine thread not reading at all meanwhile.
            assert_eq!(wait_finished(&producer, 1)[0].outcome, SendOutcome::Sent);
            expect_ready(&consumer, k, RequestId(3));
        } else {
            expect_ready(&consumer, k, RequestId(3));
            assert_eq!(wait_finished(&producer, 1)[0].outcome, SendOutcome::Sent);
        }
        dec.verify(&c_blocks, 0, tokens);
    }
    let stats = consumer.stats();
    assert_eq!(stats.board_ready, 6);
    assert_eq!(stats.finishing_hints, 0);
    assert!(engine_reads.load(Ordering::SeqCst) > 0);
    eprintln!(
        "decode endpoint read {} times, {} of them on the engine thread; driver turns {}",
        reads.load(Ordering::SeqCst),
        engine_reads.load(Ordering::SeqCst),
        stats.driver_turns
    );
}

/// Control connections between two processes of one host go over a Unix socket; with either
/// side's `local_sockets` off they fall back to TCP, and the transfer is the same.
#[test]
fn control_connections_fall_back_to_tcp() {
    for (producer_local, consumer_local) in [(true, true), (false, true), (true, false)] {
        let fabric = LoopbackFabric::new();
        let layout = spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit);
        let (pre, p_cache) = Side::new(layout.clone());
        let mut c = config(1);
        c.local_sockets = producer_local;
        let producer = Producer::start(c, p_cache, Box::new(fabric.endpoint())).unwrap();
        let (dec, d_cache) = Side::new(layout);
        let mut c = config(2);
        c.local_sockets = consumer_local;
        let consumer = Consumer::start(c, d_cache, Box::new(fabric.endpoint())).unwrap();
        let tokens = 13;
        let p_blocks = ids(10..14);
        pre.fill(&p_blocks, tokens);
        let c_blocks = ids(20..24);
        let k = key(1300, 0);
        register(
            &consumer,
            producer.control_addr(),
            k,
            tokens,
            c_blocks.clone(),
        );
        producer
            .request_finished(k, RequestId(9), p_blocks, tokens)
            .unwrap();
        expect_ready(&consumer, k, RequestId(1));
        dec.verify(&c_blocks, 0, tokens);
        assert_eq!(wait_finished(&producer, 1)[0].outcome, SendOutcome::Sent);
        let local = u64::from(producer_local && consumer_local);
        assert_eq!(
            consumer.stats().local_connections,
            local,
            "producer {producer_local}, consumer {consumer_local}"
        );
    }
}

/// An engine step with nothing to compute may wait for a transfer to end (`wait_events`,
/// `wait_finished`): while none can, each wait lasts its whole bound; once prefill finishes,
/// decode's returns with the request ready and prefill's with its blocks sent, long before
/// theirs.
#[test]
fn idle_steps_wait_for_a_transfer_to_end_and_no_longer() {
    let fabric = LoopbackFabric::new();
    let (pre, dec, consumer) = simple_pair(&fabric);
    let producer = &pre.producers[0];
    let bound = Duration::from_millis(60);
    let t = Instant::now();
    assert!(consumer.wait_events(bound).is_empty());
    assert!(producer.wait_finished(bound).is_empty());
    assert!(
        t.elapsed() >= 2 * bound,
        "returned early: {:?}",
        t.elapsed()
    );

    let (k, tokens) = (key(43, 0), 21);
    let (p_blocks, c_blocks) = request_blocks(&pre, tokens, 4, 4);
    register(&consumer, pre.base, k, tokens, c_blocks.clone());
    // Registered, prefill still computing: nothing to report.
    let t = Instant::now();
    assert!(consumer.wait_events(bound).is_empty());
    assert!(t.elapsed() >= bound, "returned early: {:?}", t.elapsed());

    let long = Duration::from_secs(20);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            pre.finish(k, &p_blocks, tokens);
        });
        let t = Instant::now();
        assert_eq!(
            consumer.wait_events(long),
            vec![RecvEvent::Ready {
                key: k,
                request: RequestId(1)
            }]
        );
        assert!(t.elapsed() < long / 2, "waited {:?}", t.elapsed());
    });
    dec.verify(&c_blocks, 0, tokens);
    let t = Instant::now();
    let done = producer.wait_finished(long);
    assert!(t.elapsed() < long / 2, "waited {:?}", t.elapsed());
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].outcome, SendOutcome::Sent);

    // What the driver thread decides (here a cancelled request's failure, once prefill has
    // confirmed that it writes nothing) ends a wait at once too.
    let k2 = key(44, 0);
    register(&consumer, pre.base, k2, tokens, c_blocks);
    consumer.cancel(k2.transfer, None).unwrap();
    let t = Instant::now();
    let events = consumer.wait_events(long);
    assert!(t.elapsed() < long / 2, "waited {:?}", t.elapsed());
    assert!(
        matches!(events[..], [RecvEvent::Failed { key, .. }] if key == k2),
        "{events:?}"
    );
}

/// A peer that opens more control connections than a prefill rank serves and sends nothing
/// (plus a few that trickle a byte now and then) cannot keep a real decode out: the connections
/// without a hello past `MAX_WAITING_HANDSHAKES` are dropped oldest first, so the decode's
/// connection, whose hello follows at once, gets its turn.
#[test]
fn a_flood_of_idle_connections_does_not_keep_a_decode_out() {
    use std::io::Write as _;
    use std::net::TcpStream;

    let fabric = LoopbackFabric::new();
    let (pre, dec, consumer) = simple_pair(&fabric);
    let mut idle = Vec::new();
    for _ in 0..1100 {
        match TcpStream::connect(pre.base) {
            Ok(s) => idle.push(s),
            Err(e) => panic!("the listener refused a connection: {e}"),
        }
    }
    let mut tricklers: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(pre.base).unwrap())
        .collect();
    for t in &mut tricklers {
        let _ = t.write_all(&[0x4b]);
    }
    let (p_blocks, c_blocks) = request_blocks(&pre, 12, 4, 4);
    let k = key(901, 0);
    register(&consumer, pre.base, k, 12, c_blocks.clone());
    pre.finish(k, &p_blocks, 12);
    expect_ready(&consumer, k, RequestId(1));
    dec.verify(&c_blocks, 0, 12);
    // Most of the idle ones were dropped for newer ones (some were refused at the connection
    // limit while dropped ones still closed).
    let stats = pre.producers[0].stats();
    assert!(stats.handshakes_evicted > 500, "{stats:?}");
    drop((idle, tricklers));
}

/// The whole hello must arrive within the handshake timeout: a peer that trickles one byte at a
/// time is cut off then, however regularly it sends.
#[test]
fn a_trickled_hello_is_cut_off_at_the_handshake_deadline() {
    use std::io::{Read as _, Write as _};
    use std::net::TcpStream;

    let fabric = LoopbackFabric::new();
    let base = free_ports(1);
    let (_side, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut c = config(1);
    c.listen = base;
    c.connect_timeout = Duration::from_millis(600);
    let producer = Producer::start(c, cache, Box::new(fabric.endpoint())).unwrap();
    let mut trickler = TcpStream::connect(base).unwrap();
    trickler
        .set_read_timeout(Some(Duration::from_millis(1)))
        .unwrap();
    let started = Instant::now();
    // A frame header that announces a large hello, then its payload, one byte every 100 ms.
    let [m0, m1] = kvx_core::wire::MAGIC;
    let header = [m0, m1, kvx_core::wire::PROTOCOL_VERSION, 1, 0, 0, 0x10, 0];
    let mut closed = None;
    for byte in header.iter().chain(std::iter::repeat(&0u8)).take(30) {
        let mut buf = [0u8; 1];
        let gone =
            matches!(trickler.read(&mut buf), Ok(0)) || trickler.write_all(&[*byte]).is_err();
        if gone {
            closed = Some(started.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let closed = closed.expect("the trickled connection was never closed");
    assert!(
        closed < Duration::from_secs(3),
        "closed after {closed:?}, not at the 600 ms deadline"
    );
    assert_eq!(producer.stats().handshakes_failed, 1);
}

/// A hello of another protocol version is answered with this side's hello, so the peer's
/// error names both versions, and refused.
#[test]
fn a_hello_of_another_protocol_version_is_answered_with_this_sides_version() {
    use std::io::{Read as _, Write as _};
    use std::net::TcpStream;

    let fabric = LoopbackFabric::new();
    let (pre, _dec, _consumer) = simple_pair(&fabric);
    let mut peer = TcpStream::connect(pre.base).unwrap();
    peer.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let other = kvx_core::wire::PROTOCOL_VERSION + 1;
    let [m0, m1] = kvx_core::wire::MAGIC;
    peer.write_all(&[m0, m1, other, 1, 0, 0, 0, 0]).unwrap();
    let mut answer = Vec::new();
    let _ = peer.read_to_end(&mut answer);
    assert!(answer.len() > 8, "no hello came back: {answer:?}");
    // Its header carries this build's version (a peer of the other version fails to parse it
    // with an error that names both).
    assert_eq!(answer[..3], [m0, m1, kvx_core::wire::PROTOCOL_VERSION]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while pre.producers[0].stats().handshakes_failed == 0 {
        assert!(Instant::now() < deadline, "the handshake was not refused");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A hello that declares an absurd tensor-parallel size is refused before anything is sized by
/// it, and the prefill rank goes on serving its real decode.
#[test]
fn a_hello_with_an_absurd_tp_size_is_refused() {
    use kvx_core::wire::Role;
    use std::io::{Read as _, Write as _};
    use std::net::TcpStream;

    let fabric = LoopbackFabric::new();
    let (pre, dec, consumer) = simple_pair(&fabric);
    let mut rogue_spec = spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit);
    // A multiple of the model's two KV heads: only the bound refuses it (before it, the driver
    // sized a table of every rank by it).
    rogue_spec.tp_size = 1 << 31;
    let endpoint = fabric.endpoint();
    let desc = endpoint.local_desc();
    let hello = hand_hello(Role::Consumer, 66, rogue_spec, &desc, 0);
    let mut rogue = TcpStream::connect(pre.base).unwrap();
    rogue
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    rogue.write_all(&hello.to_bytes().unwrap()).unwrap();
    // The producer answers the hello, then closes the connection once its driver refuses it.
    let mut rest = Vec::new();
    let _ = rogue.read_to_end(&mut rest);
    // An abort walks every consumer rank the producer knows of.
    pre.producers[0].abort(TransferId(903), None).unwrap();
    let (p_blocks, c_blocks) = request_blocks(&pre, 12, 4, 4);
    let k = key(902, 0);
    register(&consumer, pre.base, k, 12, c_blocks.clone());
    pre.finish(k, &p_blocks, 12);
    expect_ready(&consumer, k, RequestId(1));
    dec.verify(&c_blocks, 0, 12);
}

/// A failure notice speaks only for requests that went to the instance that sent it: another
/// prefill instance that decode is connected to cannot fail a request registered elsewhere.
#[test]
fn a_failure_notice_from_another_prefill_instance_is_ignored() {
    use kvx_core::wire::{FailureNotice, FailureReason, Message, Role};
    use std::io::Write as _;

    let fabric = LoopbackFabric::new();
    let (pre, dec, consumer) = simple_pair(&fabric);
    // A second "prefill instance", spoken by hand: its hello, then a failure for a request
    // that went to the real one.
    let rogue_spec = spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit);
    let endpoint = fabric.endpoint();
    let desc = endpoint.local_desc();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let rogue_addr = listener.local_addr().unwrap();
    let (p_blocks, c_blocks) = request_blocks(&pre, 12, 4, 4);
    let real = key(904, 0);
    register(&consumer, pre.base, real, 12, c_blocks.clone());
    wait_registered(&pre);
    // A request to the rogue makes decode connect to it.
    register_request(
        &consumer,
        rogue_addr,
        key(905, 0),
        RequestId(2),
        4,
        ids(50..51),
    );
    let (mut rogue, _) = listener.accept().unwrap();
    let _ = read_frame(&mut rogue);
    let hello = hand_hello(Role::Producer, 77, rogue_spec, &desc, 1_000);
    rogue.write_all(&hello.to_bytes().unwrap()).unwrap();
    let forged = Message::Failure(FailureNotice {
        transfer: real.transfer,
        attempt: real.attempt,
        rank: kvx_core::Rank(0),
        reason: FailureReason::from(Reason::Aborted),
        detail: "forged".into(),
    });
    rogue.write_all(&forged.to_bytes().unwrap()).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // The real request is untouched: it lands when its prefill finishes.
    pre.finish(real, &p_blocks, 12);
    let events = wait_events(&consumer, 1);
    assert_eq!(
        events[0],
        RecvEvent::Ready {
            key: real,
            request: RequestId(1)
        },
        "{events:?}"
    );
    dec.verify(&c_blocks, 0, 12);
    drop(rogue);
}

/// Reads one frame from `stream` (its payload).
fn read_frame(stream: &mut std::net::TcpStream) -> Vec<u8> {
    use std::io::Read as _;
    let mut header = [0u8; kvx_core::wire::HEADER_LEN];
    stream.read_exact(&mut header).unwrap();
    let len = u32::from_le_bytes([header[4], header[5], header[6], header[7]]) as usize;
    let mut payload = vec![0u8; len];
    stream.read_exact(&mut payload).unwrap();
    payload
}

/// Abstract Unix socket names belong to no user: another user may bind a producer's local
/// control name first. The producer then says so and serves over TCP, and a decode of its user
/// refuses the squatter's socket (its peer credentials are another user's) and connects over
/// TCP. Needs root (the squatter runs as `nobody`); elsewhere it says that it was skipped.
#[test]
fn a_local_control_socket_squatted_by_another_user_is_refused() {
    use std::io::BufRead as _;

    let Some(mut nobody) =
        python_as_nobody("a_local_control_socket_squatted_by_another_user_is_refused")
    else {
        return;
    };
    let fabric = LoopbackFabric::new();
    let base = free_ports(1);
    let squat = format!(
        "import socket, sys, time\n\
         s = socket.socket(socket.AF_UNIX)\n\
         s.bind('\\0kvx-control/{base}')\n\
         s.listen(16)\n\
         print('bound', flush=True)\n\
         time.sleep(60)\n"
    );
    let mut squatter = nobody
        .args(["-c", &squat])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 for the squatter");
    let mut line = String::new();
    std::io::BufReader::new(squatter.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "bound");
    let (side, cache) = Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut c = config(1);
    c.listen = base;
    let producer = Producer::start(c, cache, Box::new(fabric.endpoint())).unwrap();
    let pre = Prefill {
        sides: vec![side],
        producers: vec![producer],
        base,
    };
    let (dec, consumer) = decode(
        &fabric,
        spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit),
        LONG,
    );
    let (p_blocks, c_blocks) = request_blocks(&pre, 12, 4, 4);
    let k = key(906, 0);
    register(&consumer, pre.base, k, 12, c_blocks.clone());
    pre.finish(k, &p_blocks, 12);
    expect_ready(&consumer, k, RequestId(1));
    dec.verify(&c_blocks, 0, 12);
    assert_eq!(consumer.stats().local_connections, 0);
    let _ = squatter.kill();
    let _ = squatter.wait();
}

/// A producer serves its local control socket to peers of its own user only: another user's
/// connection there is closed unanswered (it may connect over TCP). Needs root (the peer runs
/// as `nobody`); elsewhere it says that it was skipped.
#[test]
fn a_local_peer_of_another_user_is_refused() {
    use kvx_core::wire::Role;

    let Some(mut nobody) = python_as_nobody("a_local_peer_of_another_user_is_refused") else {
        return;
    };
    let fabric = LoopbackFabric::new();
    let pre = tp1_prefill(&fabric);
    let base = pre.base;
    // A valid consumer hello, which the producer would answer with its own.
    let peer_spec = spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit);
    let desc = fabric.endpoint().local_desc();
    let hello = hand_hello(Role::Consumer, 67, peer_spec, &desc, 0)
        .to_bytes()
        .unwrap();
    let hex: String = hello.iter().map(|b| format!("{b:02x}")).collect();
    // Connects to the local socket, sends the hello, and prints how much comes back.
    let peer = format!(
        "import socket\n\
         s = socket.socket(socket.AF_UNIX)\n\
         s.connect('\\0kvx-control/{base}')\n\
         s.settimeout(10)\n\
         try:\n\
         \x20   s.sendall(bytes.fromhex('{hex}'))\n\
         \x20   print(len(s.recv(65536)), flush=True)\n\
         except (BrokenPipeError, ConnectionResetError):\n\
         \x20   print(0, flush=True)\n"
    );
    let out = nobody
        .args(["-c", &peer])
        .output()
        .expect("python3 for the peer");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0",
        "the peer got an answer"
    );
}

/// The hello of a peer that speaks the protocol by hand: `role`, engine and incarnation
/// `engine`, layout `spec`, endpoint `desc`, no finishing hints.
fn hand_hello(
    role: kvx_core::wire::Role,
    engine: u64,
    spec: LayoutSpec,
    desc: &kvx_rdma::EndpointDesc,
    write_timeout_ms: u32,
) -> kvx_core::wire::Message {
    kvx_core::wire::Message::Hello(kvx_core::wire::Hello {
        compat_hash: spec.compat_hash(),
        engine: EngineId(engine),
        incarnation: kvx_core::Incarnation(engine),
        role,
        layout: spec,
        regions: desc.regions.clone(),
        transport: desc.backend.clone(),
        transport_addr: desc.to_bytes(),
        finishing_hints: false,
        write_timeout_ms,
    })
}

/// `python3` to run as `nobody`, for a test of what another user's process may do; `None`
/// (after saying the test was skipped) where this process cannot switch users (not root).
fn python_as_nobody(test: &str) -> Option<std::process::Command> {
    use std::os::unix::process::CommandExt as _;
    if kvx_rdma::local_peer::own_uid() != 0 {
        println!("SKIPPED {test}: not root");
        return None;
    }
    let mut command = std::process::Command::new("python3");
    command.uid(65534).gid(65534);
    Some(command)
}

/// A prefill rank and a decode rank (the simple pair's layout) with deployment keys
/// `prefill_key` and `decode_key`.
fn keyed_pair(
    fabric: &LoopbackFabric,
    prefill_key: Option<kvx_vllm::AuthKey>,
    decode_key: Option<kvx_vllm::AuthKey>,
) -> (Prefill, Side, Consumer) {
    let s = spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit);
    let base = free_ports(1);
    let (side, cache) = Side::new(s.clone());
    let mut c = config(1);
    c.listen = base;
    c.producer_lease = LONG;
    c.auth_key = prefill_key.map(Arc::new);
    let producer = Producer::start(c, cache, Box::new(fabric.endpoint())).unwrap();
    let (dec, cache) = Side::new(s);
    let mut c = config(2);
    c.registration_lease = LONG;
    c.auth_key = decode_key.map(Arc::new);
    let consumer = Consumer::start(c, cache, Box::new(fabric.endpoint())).unwrap();
    (
        Prefill {
            sides: vec![side],
            producers: vec![producer],
            base,
        },
        dec,
        consumer,
    )
}

/// Everything a rogue peer reads before the producer closes the connection.
fn read_until_closed(peer: &mut std::net::TcpStream) -> Vec<u8> {
    use std::io::Read as _;
    peer.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut got = Vec::new();
    let _ = peer.read_to_end(&mut got);
    got
}

/// A Noise first message made with `key`, length-prefixed as on the wire.
fn noise_first_message(key: &[u8; 32]) -> Vec<u8> {
    let params = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s".parse().unwrap();
    let mut hs = snow::Builder::new(params)
        .psk(0, key)
        .unwrap()
        .prologue(b"kvx control v1")
        .unwrap()
        .build_initiator()
        .unwrap();
    let mut buf = [0u8; 128];
    let n = hs.write_message(&[], &mut buf).unwrap();
    let mut out = (n as u16).to_be_bytes().to_vec();
    out.extend_from_slice(&buf[..n]);
    out
}

/// With a deployment key, a peer that lacks it gets no byte: not with a plain hello, not with
/// garbage, not with a handshake under another key; one that replays a first message made with
/// the key gets only the handshake's answer, never the hello with the region table. Meanwhile
/// a decode with the key is served and its bytes verify.
#[test]
fn with_a_deployment_key_a_peer_without_it_gets_no_byte() {
    use kvx_core::wire::Role;
    use std::io::Write as _;
    use std::net::TcpStream;

    let secret = [0x5a; 32];
    let fabric = LoopbackFabric::new();
    let (pre, dec, consumer) = keyed_pair(
        &fabric,
        Some(kvx_vllm::AuthKey::from_bytes(secret)),
        Some(kvx_vllm::AuthKey::from_bytes(secret)),
    );
    let (p_blocks, c_blocks) = request_blocks(&pre, 12, 4, 4);
    let k = key(906, 0);
    // The router's grant for this transfer, which a keyed decode needs.
    let capability = kvx_vllm::AuthKey::from_bytes(secret).grant(
        k.transfer,
        EngineId(2),
        &pre.base.to_string(),
        std::time::SystemTime::now() + LONG,
    );
    consumer
        .request_allocated(PushRequest {
            groups: Vec::new(),
            key: k,
            request: RequestId(1),
            prefill: pre.base,
            num_tokens: 12,
            skip_tokens: 0,
            blocks: c_blocks.clone(),
            capability: Some(capability),
            trace: None,
        })
        .unwrap();
    // A plain hello, as a kvx without the key sends it.
    let endpoint = fabric.endpoint();
    let desc = endpoint.local_desc();
    let s = spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit);
    let hello = hand_hello(Role::Consumer, 67, s, &desc, 0)
        .to_bytes()
        .unwrap();
    let wrong = noise_first_message(&[0xa5; 32]);
    let replayed = noise_first_message(&secret);
    let garbage: Vec<u8> = [0u8, 48]
        .into_iter()
        .chain((0..48u8).map(|b| b ^ 0x77))
        .collect();
    for (what, first) in [
        ("a plain hello", &hello),
        ("garbage", &garbage),
        ("another key's handshake", &wrong),
    ] {
        let mut rogue = TcpStream::connect(pre.base).unwrap();
        rogue.write_all(first).unwrap();
        let got = read_until_closed(&mut rogue);
        assert!(
            got.is_empty(),
            "{what}: the producer sent {} bytes",
            got.len()
        );
    }
    let mut rogue = TcpStream::connect(pre.base).unwrap();
    rogue.write_all(&replayed).unwrap();
    // What a replayer would send next: it cannot make a message the producer accepts.
    rogue.write_all(&garbage).unwrap();
    let got = read_until_closed(&mut rogue);
    assert_eq!(
        got.len(),
        2 + 48,
        "more than the handshake's answer: {got:?}"
    );
    pre.finish(k, &p_blocks, 12);
    expect_ready(&consumer, k, RequestId(1));
    dec.verify(&c_blocks, 0, 12);
    let deadline = Instant::now() + Duration::from_secs(5);
    while pre.producers[0].stats().handshakes_failed < 4 {
        assert!(
            Instant::now() < deadline,
            "the rogue handshakes were not counted"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A decode whose key is not prefill's fails its request, saying why; so does one without a
/// key at a prefill that has one.
#[test]
fn a_decode_with_another_key_or_none_fails_naming_the_key() {
    for decode_key in [Some(kvx_vllm::AuthKey::from_bytes([2; 32])), None] {
        let fabric = LoopbackFabric::new();
        let keyless = decode_key.is_none();
        let (pre, _dec, consumer) = keyed_pair(
            &fabric,
            Some(kvx_vllm::AuthKey::from_bytes([1; 32])),
            decode_key,
        );
        let (_, c_blocks) = request_blocks(&pre, 12, 4, 4);
        // A capability that passes decode's own check: the handshake is what fails.
        let capability = (!keyless).then(|| {
            kvx_vllm::AuthKey::from_bytes([2; 32]).grant(
                key(907, 0).transfer,
                EngineId(2),
                &pre.base.to_string(),
                std::time::SystemTime::now() + LONG,
            )
        });
        consumer
            .request_allocated(PushRequest {
                groups: Vec::new(),
                key: key(907, 0),
                request: RequestId(1),
                prefill: pre.base,
                num_tokens: 12,
                skip_tokens: 0,
                blocks: c_blocks,
                capability,
                trace: None,
            })
            .unwrap();
        let events = wait_events(&consumer, 1);
        match &events[0] {
            RecvEvent::Failed { detail, .. } => {
                let says = if keyless { "hello" } else { "deployment key" };
                assert!(detail.contains(says), "{detail}");
            }
            other => panic!("expected a failure, got {other:?}"),
        }
    }
}

/// A prefill rank that would listen on the network without a key does not start, and says how
/// to make one; with allow_unauthenticated it starts.
#[test]
fn a_producer_on_the_network_without_a_key_does_not_start() {
    let fabric = LoopbackFabric::new();
    let s = spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit);
    let mut c = config(1);
    c.listen = SocketAddr::from(([0, 0, 0, 0], 0));
    let (_side, cache) = Side::new(s.clone());
    let err = Producer::start(c.clone(), cache, Box::new(fabric.endpoint()))
        .err()
        .expect("refused");
    let text = err.to_string();
    assert!(text.contains("kvx keygen"), "{text}");
    assert!(text.contains("allow_unauthenticated"), "{text}");
    c.allow_unauthenticated = true;
    let (_side, cache) = Side::new(s);
    let mut producer = Producer::start(c, cache, Box::new(fabric.endpoint())).unwrap();
    producer.shutdown();
}

/// MLA: every rank of a TP-2 prefill holds the whole latent, and a one-rank decode reads it from
/// rank 0 only. Decode tells rank 1 that it needs nothing of it, so rank 1 gives its blocks
/// back at once (delivered), push and pull, instead of at its producer lease (30 s here, past
/// this test's 20 s waits).
#[test]
fn an_mla_prefill_rank_that_no_decode_rank_reads_gives_its_blocks_back_at_once() {
    let fabric = LoopbackFabric::new();
    let mla = |tp, rank| LayoutSpec {
        total_kv_heads: 1,
        mla: true,
        ..spec(tp, rank, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit)
    };
    let base = free_ports(2);
    let mut sides = Vec::new();
    let mut producers = Vec::new();
    for rank in 0..2 {
        let (side, cache) = Side::new(mla(2, rank));
        let mut c = config(1);
        c.listen = SocketAddr::from(([127, 0, 0, 1], base.port() + rank as u16));
        c.producer_lease = LONG;
        producers.push(Producer::start(c, cache, Box::new(fabric.endpoint())).unwrap());
        sides.push(side);
    }
    let (dec, consumer) = decode(&fabric, mla(1, 0), LONG);
    let tokens = 10;
    let p_blocks = ids(10..13);
    for side in &sides {
        side.fill(&p_blocks, tokens);
    }
    // Push: decode registers, both ranks finish.
    let pushed = key(41, 0);
    let d_blocks = ids(20..23);
    register(&consumer, base, pushed, tokens, d_blocks.clone());
    for p in &producers {
        p.request_finished(pushed, RequestId(9), p_blocks.clone(), tokens)
            .unwrap();
    }
    expect_ready(&consumer, pushed, RequestId(1));
    dec.verify(&d_blocks, 0, tokens);
    for (rank, p) in producers.iter().enumerate() {
        let done = wait_finished(p, 1);
        assert_eq!(done[0].outcome, SendOutcome::Sent, "rank {rank}: {done:?}");
        assert_eq!(p.stats().held, 0, "rank {rank}");
    }
    assert_eq!(producers[1].stats().bytes_written, 0, "rank 1 wrote");
    // Pull: both ranks finish first; decode reads rank 0's blocks.
    let pulled = key(42, 0);
    let d_blocks = ids(30..33);
    for p in &producers {
        p.request_finished_pull(pulled, RequestId(10), p_blocks.clone(), tokens)
            .unwrap();
    }
    consumer
        .pull(PullRequest {
            producer_groups: Vec::new(),
            push: PushRequest {
                groups: Vec::new(),
                key: pulled,
                request: RequestId(2),
                prefill: base,
                num_tokens: tokens,
                skip_tokens: 0,
                blocks: d_blocks.clone(),
                capability: None,
                trace: None,
            },
            producer_blocks: p_blocks.clone(),
        })
        .unwrap();
    expect_ready(&consumer, pulled, RequestId(2));
    dec.verify(&d_blocks, 0, tokens);
    for (rank, p) in producers.iter().enumerate() {
        let done = wait_finished(p, 1);
        assert_eq!(done[0].outcome, SendOutcome::Sent, "rank {rank}: {done:?}");
        assert_eq!(p.stats().held, 0, "rank {rank}");
    }
}

/// Over `cma`, a peer copies into (push) or out of (pull) this process by cross-memory attach,
/// which Yama's `ptrace_scope` 1 allows only to a declared tracer: each side declares the one
/// peer process it knows from its local control socket (here this process, both sides being in
/// it), before the registration or the hello that lets the peer copy, and any process again once
/// no peer is connected.
#[test]
fn over_cma_the_known_peer_process_is_the_declared_tracer() {
    use kvx_rdma::cma::{CmaConfig, CmaTransport};
    use kvx_rdma::local_peer::{tracer_now, Tracer};
    let cma = || Box::new(CmaTransport::open(CmaConfig::default()).unwrap());
    let base = free_ports(1);
    let (pre_side, pre_cache) =
        Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut p = config(1);
    p.listen = base;
    let mut producer = Producer::start(p, pre_cache, cma()).unwrap();
    let (dec_side, dec_cache) =
        Side::new(spec(1, 0, 4, MemoryOrder::Nhd, Arrangement::PerLayerSplit));
    let mut consumer = Consumer::start(config(2), dec_cache, cma()).unwrap();
    let tokens = 8;
    pre_side.fill(&ids(0..2), tokens);
    register(&consumer, base, key(120, 0), tokens, ids(10..12));
    producer
        .request_finished(key(120, 0), RequestId(9), ids(0..2), tokens)
        .unwrap();
    expect_ready(&consumer, key(120, 0), RequestId(1));
    dec_side.verify(&ids(10..12), 0, tokens);
    assert_eq!(
        consumer.stats().local_connections,
        1,
        "not over the local socket"
    );
    let me = i32::try_from(std::process::id()).unwrap();
    assert_eq!(tracer_now(), Tracer::Process(me));
    consumer.shutdown();
    producer.shutdown();
    let deadline = Instant::now() + Duration::from_secs(10);
    while tracer_now() != Tracer::Any {
        assert!(
            Instant::now() < deadline,
            "leave kept after both sides shut down"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A hybrid model's sliding-window group: prefill keeps it from token 16 (block 0 stands for
/// the rest, as vLLM's null block), decode wants it from token 24. Pattern apart from the full
/// group's, so that a block of the wrong group shows.
const WINDOW_SEED: u64 = 0x51d1;

fn window_group(first_token: u32, block_tokens: u32, first_block: u32) -> GroupBlocks {
    let placeholders = first_token / block_tokens;
    GroupBlocks {
        first_token,
        blocks: (0..40_u32.div_ceil(block_tokens))
            .map(|i| BlockId(if i < placeholders { 0 } else { first_block + i }))
            .collect(),
    }
}

/// A one-rank prefill and decode (4-token blocks) with a 37-token hybrid request: the first
/// group in prefill's blocks 10.. (decode's 40..), filled; the window group kept by prefill
/// from token 16 (its pattern `WINDOW_SEED`) and by decode from `decode_keeps`.
struct Hybrid {
    _fabric: LoopbackFabric,
    pre: Prefill,
    dec: Side,
    consumer: Consumer,
    p_full: Vec<BlockId>,
    c_full: Vec<BlockId>,
    p_window: GroupBlocks,
    c_window: GroupBlocks,
}

const HYBRID_TOKENS: u64 = 37;

fn hybrid_pair(decode_keeps: u32) -> Hybrid {
    let fabric = LoopbackFabric::new();
    let (pre, dec, consumer) = simple_pair(&fabric);
    let (p_full, c_full) = (ids(10..20), ids(40..50));
    let (p_window, c_window) = (window_group(16, 4, 24), window_group(decode_keeps, 4, 50));
    pre.sides[0].fill(&p_full, HYBRID_TOKENS);
    pre.sides[0].overwrite(&p_window.blocks, HYBRID_TOKENS, WINDOW_SEED);
    Hybrid {
        _fabric: fabric,
        pre,
        dec,
        consumer,
        p_full,
        c_full,
        p_window,
        c_window,
    }
}

impl Hybrid {
    /// Decode's request `key` (its request 2) into its blocks, with `groups`.
    fn push(&self, key: AttemptKey, groups: Vec<GroupBlocks>) -> PushRequest {
        PushRequest {
            groups,
            key,
            request: RequestId(2),
            prefill: self.pre.base,
            num_tokens: HYBRID_TOKENS,
            skip_tokens: 0,
            blocks: self.c_full.clone(),
            capability: None,
            trace: None,
        }
    }

    /// Prefill's blocks of the request, with its window group.
    fn held(&self) -> RequestBlocks {
        RequestBlocks {
            blocks: self.p_full.clone(),
            groups: vec![self.p_window.clone()],
        }
    }
}

#[test]
fn a_hybrid_models_further_group_lands_in_its_own_blocks_push_and_pull() {
    let tokens = 37;
    for pull in [false, true] {
        let fabric = LoopbackFabric::new();
        let pre = tp2_prefill(&fabric);
        // Other block size and memory order than prefill's: the re-layout covers both groups.
        let (dec, consumer) = decode(
            &fabric,
            spec(1, 0, 8, MemoryOrder::Nhd, Arrangement::PerLayerSplit),
            LONG,
        );
        let (p_full, c_full) = (ids(10..20), ids(40..45));
        let (p_window, c_window) = (window_group(16, 4, 24), window_group(24, 8, 50));
        for side in &pre.sides {
            side.fill(&p_full, tokens);
            side.overwrite(&p_window.blocks, tokens, WINDOW_SEED);
        }
        let held = RequestBlocks {
            blocks: p_full.clone(),
            groups: vec![p_window.clone()],
        };
        let push = PushRequest {
            groups: vec![c_window.clone()],
            key: key(8, 0),
            request: RequestId(2),
            prefill: pre.base,
            num_tokens: tokens,
            skip_tokens: 0,
            blocks: c_full.clone(),
            capability: None,
            trace: None,
        };
        for p in &pre.producers {
            if pull {
                p.request_finished_pull(key(8, 0), RequestId(1), held.clone(), tokens)
            } else {
                p.request_finished(key(8, 0), RequestId(1), held.clone(), tokens)
            }
            .unwrap();
        }
        if pull {
            consumer.pull(PullRequest {
                push,
                producer_blocks: p_full.clone(),
                producer_groups: vec![p_window.clone()],
            })
        } else {
            consumer.request_allocated(push)
        }
        .unwrap();
        expect_ready(&consumer, key(8, 0), RequestId(2));
        dec.verify(&c_full, 0, tokens);
        assert!(
            dec.holds(&c_window.blocks, 24, tokens, WINDOW_SEED),
            "pull {pull}"
        );
        // Nothing landed in decode's placeholder block (the tokens it does not keep).
        for seed in [SEED, WINDOW_SEED] {
            assert!(!dec.holds(&[BlockId(0)], 0, 1, seed));
        }
        for p in &pre.producers {
            assert_eq!(wait_finished(p, 1)[0].outcome, SendOutcome::Sent);
        }
    }
}

#[test]
fn a_group_moves_only_what_both_sides_keep_and_a_group_count_mismatch_fails_with_why() {
    // Decode keeps the window group from token 8; prefill from 16.
    let h = hybrid_pair(8);
    let producer = &h.pre.producers[0];
    h.consumer
        .request_allocated(h.push(key(9, 0), vec![h.c_window.clone()]))
        .unwrap();
    producer
        .request_finished(key(9, 0), RequestId(1), h.held(), HYBRID_TOKENS)
        .unwrap();
    expect_ready(&h.consumer, key(9, 0), RequestId(2));
    h.dec.verify(&h.c_full, 0, HYBRID_TOKENS);
    assert!(h
        .dec
        .holds(&h.c_window.blocks, 16, HYBRID_TOKENS, WINDOW_SEED));
    assert!(!h.dec.holds(&h.c_window.blocks, 8, 9, WINDOW_SEED));
    assert_eq!(wait_finished(producer, 1)[0].outcome, SendOutcome::Sent);

    // Decode names a further group, prefill none: the request fails, saying why.
    h.consumer
        .request_allocated(h.push(key(10, 0), vec![h.c_window.clone()]))
        .unwrap();
    producer
        .request_finished(key(10, 0), RequestId(1), h.p_full.clone(), HYBRID_TOKENS)
        .unwrap();
    let events = wait_events(&h.consumer, 1);
    assert!(
        matches!(&events[0], RecvEvent::Failed { detail, .. }
            if detail.contains("the producer has 0 further KV cache groups, the consumer 1")),
        "{events:?}"
    );
    assert_eq!(
        wait_finished(producer, 1)[0].outcome,
        SendOutcome::NotSent(Reason::TransferFailed)
    );
    assert_eq!(producer.stats().held, 0);
}

#[test]
fn a_hybrid_request_streams_its_first_group_and_moves_the_others_at_the_finish() {
    let h = hybrid_pair(16);
    let (k, tokens) = (key(12, 0), HYBRID_TOKENS);
    h.consumer
        .request_allocated(h.push(k, vec![h.c_window.clone()]))
        .unwrap();
    let producer = &h.pre.producers[0];
    // 21 tokens computed: the first group's first 20 go early (whole blocks).
    producer
        .request_progress(k, h.p_full[..6].to_vec(), 21)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while producer.stats().bytes_streamed == 0 {
        assert!(Instant::now() < deadline, "early writes never posted");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(h.consumer.take_events().is_empty());
    producer
        .request_finished(k, RequestId(1), h.held(), tokens)
        .unwrap();
    expect_ready(&h.consumer, k, RequestId(2));
    h.dec.verify(&h.c_full, 0, tokens);
    assert!(h.dec.holds(&h.c_window.blocks, 16, tokens, WINDOW_SEED));
    // Every byte once: the first group's 20 early tokens, its 17 others and the window
    // group's 21 at the finish.
    let stats = producer.stats();
    let per_token = stats.bytes_streamed / 20;
    assert_eq!(stats.bytes_streamed, 20 * per_token);
    assert_eq!(stats.bytes_written, (tokens + (tokens - 16)) * per_token);
}
