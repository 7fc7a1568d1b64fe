//! The producer's state machine driven by hand, with a virtual clock: no driver thread, no
//! sleeps. A test feeds it what the driver loop would (engine commands, a consumer's hello and
//! messages over an in-memory control connection, the loopback transport's events, the time)
//! and reads what it decided (the engine's mailbox, the messages to the consumer, the notices
//! that reach the consumer's endpoint). Lease and timing behaviour is tested here exactly, at
//! the nanosecond it is due. `pair_sim` joins it to a consumer's state machine;
//! `tests/loopback.rs` keeps what needs real threads and processes.

use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU64;

use kvx_core::wire::FailureReason;
use kvx_core::wire::Registration;
use kvx_core::LayoutSpec;
use kvx_rdma::loopback::LoopbackFabric;

use super::*;
use crate::driver::Driven;
use crate::sim_support::{endpoint, ids, key, spec};

impl Machine {
    /// Whether a write to the consumer's request `key` is in flight (over connection `conn`,
    /// or any): posted, and its end not heard yet.
    pub(crate) fn writing(&self, key: AttemptKey, conn: Option<ConnId>) -> bool {
        let over = |c: ConnId| conn.is_none_or(|conn| conn == c);
        self.flights
            .values()
            .any(|f| f.original == key && over(f.conn))
            || self
                .partials
                .values()
                .any(|p| p.rkey == key && over(p.conn))
    }
}

/// One producer rank's state machine and what surrounds it in a test.
struct Sim {
    driver: Machine,
    now: &'static AtomicU64,
    finished: Arc<Mailbox<(FinishedSending, SystemTime)>>,
    consumer: Box<dyn Transport>,
    /// The consumer's end of its control connection.
    control: UnixStream,
    config: ConnectorConfig,
}

impl Sim {
    /// A producer rank with producer lease `lease`, and one consumer rank connected to it.
    fn new(lease: Duration) -> Self {
        let mut config = ConnectorConfig::new(EngineId(1));
        config.producer_lease = lease;
        Self::with(config)
    }

    /// A producer rank with `config`, and one consumer rank connected to it.
    fn with(config: ConnectorConfig) -> Self {
        Self::with_layouts(config, spec(), spec())
    }

    /// A producer rank laid out as `producer` with `config`, and one consumer rank laid out as
    /// `consumer` connected to it.
    fn with_layouts(config: ConnectorConfig, producer: LayoutSpec, consumer: LayoutSpec) -> Self {
        let fabric = LoopbackFabric::new();
        let now: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
        let finished = Arc::new(Mailbox::default());
        let mut driver = Machine::new(
            &config,
            Layout::new(producer).unwrap(),
            endpoint(&fabric).0,
            Clock::virtual_at(now),
            Arc::clone(&finished),
            Arc::new(Stats::default()),
        )
        .unwrap();
        let consumer_spec = consumer;
        let consumer_endpoint = endpoint(&fabric).0;
        let (ours, theirs) = UnixStream::pair().unwrap();
        let sender = control::sender(&ControlStream::local(ours)).unwrap();
        let hello = control::hello(
            &ConnectorConfig::new(EngineId(2)),
            Role::Consumer,
            &Layout::new(consumer_spec).unwrap(),
            &consumer_endpoint.local_desc(),
            false,
        );
        driver.command(Command::Accepted(1, sender, Box::new(hello), None));
        Self {
            driver,
            now,
            finished,
            consumer: consumer_endpoint,
            control: theirs,
            config,
        }
    }

    /// Hands the state machine `command` and lets its time pass, as one turn of the driver
    /// loop does.
    fn command(&mut self, command: Command) {
        crate::sim_support::turn(&mut self.driver, command);
    }

    /// Moves the virtual clock to `at` after the start and lets the state machine see it.
    fn at(&mut self, at: Duration) {
        crate::sim_support::advance(&mut self.driver, self.now, at);
    }

    /// The consumer registers `blocks` for `key`.
    fn register(&mut self, key: AttemptKey, tokens: u32, blocks: Vec<BlockId>, notice: u64) {
        self.register_granted(key, tokens, blocks, notice, None);
    }

    /// [`Sim::register`] with a router's `capability`.
    fn register_granted(
        &mut self,
        key: AttemptKey,
        tokens: u32,
        blocks: Vec<BlockId>,
        notice: u64,
        capability: Option<Capability>,
    ) {
        let registration = Message::Registration(Registration {
            groups: Vec::new(),
            transfer: key.transfer,
            attempt: key.attempt,
            request: RequestId(7),
            consumer: EngineId(2),
            consumer_incarnation: self.config.incarnation,
            consumer_rank: Rank(0),
            num_tokens: tokens,
            skip_tokens: 0,
            lease_ms: 60_000,
            notice,
            blocks,
            capability,
        });
        self.command(Command::Peer(1, registration, control::Queued::unbounded()));
    }

    /// Prefill finished `key` on `blocks` (push).
    fn finish(&mut self, key: AttemptKey, tokens: u64, blocks: Vec<BlockId>) {
        self.command(Command::Finished {
            key,
            held: FinishedBlocks::new(RequestId(1), blocks, tokens),
            pull: false,
        });
    }

    /// The engine sealed `key` on `blocks` (its KV is final; the engine keeps the blocks until
    /// it finishes the request).
    fn seal(&mut self, key: AttemptKey, tokens: u64, blocks: Vec<BlockId>) {
        self.command(Command::Sealed {
            key,
            held: FinishedBlocks::new(RequestId(1), blocks, tokens),
        });
    }

    /// Hands the state machine what its transport reported.
    fn transport_events(&mut self) {
        crate::sim_support::transport_events(&mut self.driver);
    }

    /// What the engine may free now.
    fn finished(&self) -> Vec<FinishedSending> {
        self.finished.take().into_iter().map(|(f, _)| f).collect()
    }

    /// The notices that reached the consumer's endpoint.
    fn notices(&mut self) -> Vec<u64> {
        let mut events = Vec::new();
        self.consumer.poll(&mut events).unwrap();
        events
            .into_iter()
            .filter_map(|e| match e {
                Event::Notice(n) => Some(n.0),
                _ => None,
            })
            .collect()
    }

    /// The next message to the consumer, if one is there.
    fn message(&mut self) -> Option<Message> {
        crate::sim_support::message(&mut self.control)
    }
}

/// The consumer's rank 0 says it needs nothing of `key` from this rank (a completion).
fn not_needed(sim: &mut Sim, key: AttemptKey) {
    let done = Message::Completion(kvx_core::wire::Completion {
        transfer: key.transfer,
        attempt: key.attempt,
        producer: EngineId(2),
        producer_rank: Rank(1),
        bytes: 0,
        capability: None,
    });
    sim.command(Command::Peer(1, done, control::Queued::unbounded()));
}

/// MLA: every prefill rank holds the whole latent, and a one-rank decode reads it from rank 0
/// only. Rank 1, told by decode that it needs nothing of it, gives the blocks back at once,
/// delivered, whether it heard so before its finish or after, and writes nothing; a
/// completion for a request it serves (decode would read from it) frees nothing in push.
#[test]
fn a_rank_whose_replica_no_consumer_reads_gives_its_blocks_back_when_told() {
    let mla = |tp_size, tp_rank| LayoutSpec {
        total_kv_heads: 1,
        mla: true,
        tp_size,
        tp_rank,
        ..spec()
    };
    let mut sim = Sim::with_layouts(ConnectorConfig::new(EngineId(1)), mla(2, 1), mla(1, 0));
    // Told first, finished later.
    not_needed(&mut sim, key(1));
    sim.at(Duration::from_millis(5));
    assert!(sim.finished().is_empty());
    sim.finish(key(1), 8, ids(0..2));
    sim.at(Duration::from_millis(6));
    let done = sim.finished();
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!((done[0].key, done[0].outcome), (key(1), SendOutcome::Sent));
    // Finished first, told later.
    sim.finish(key(2), 8, ids(2..4));
    sim.at(Duration::from_millis(10));
    assert!(sim.finished().is_empty());
    not_needed(&mut sim, key(2));
    sim.at(Duration::from_millis(11));
    let done = sim.finished();
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!((done[0].key, done[0].outcome), (key(2), SendOutcome::Sent));
    assert!(sim.notices().is_empty(), "an idle rank wrote");
    assert_eq!(sim.driver.stats.held.load(Ordering::Relaxed), 0);
    // Rank 0 of the same prefill serves the decode: a completion in push frees nothing there.
    let mut served = Sim::with_layouts(ConnectorConfig::new(EngineId(1)), mla(2, 0), mla(1, 0));
    served.finish(key(3), 8, ids(0..2));
    not_needed(&mut served, key(3));
    served.at(Duration::from_secs(1));
    assert!(
        served.finished().is_empty(),
        "a served rank gave its blocks back"
    );
}

#[test]
fn prefill_without_registration_is_released_exactly_at_the_producer_lease() {
    let mut sim = Sim::new(Duration::from_millis(200));
    sim.at(Duration::from_millis(10));
    sim.finish(key(2), 8, ids(0..2));
    sim.at(Duration::from_millis(209));
    assert!(sim.finished().is_empty(), "released before its lease");
    sim.at(Duration::from_millis(210));
    let done = sim.finished();
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].key, key(2));
    assert_eq!(
        done[0].outcome,
        SendOutcome::NotSent(Reason::LeaseExpired),
        "{done:?}"
    );
    // Nothing was ever written to the consumer.
    assert!(sim.notices().is_empty());
}

#[test]
fn a_registration_then_the_finish_writes_once_and_gives_the_blocks_back_when_done() {
    let mut sim = Sim::new(Duration::from_secs(30));
    sim.register(key(3), 8, ids(4..6), 0x77);
    sim.at(Duration::from_millis(1));
    assert!(sim.notices().is_empty(), "written before prefill finished");
    sim.finish(key(3), 8, ids(0..2));
    sim.at(Duration::from_millis(2));
    // The loopback transport moves the bytes at once; the write's end frees the blocks.
    assert_eq!(sim.notices(), vec![0x77]);
    sim.transport_events();
    sim.at(Duration::from_millis(3));
    let done = sim.finished();
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].outcome, SendOutcome::Sent);
    // Long after, nothing more happens: no second write, no second release.
    sim.at(Duration::from_secs(120));
    assert!(sim.notices().is_empty());
    assert!(sim.finished().is_empty());
}

/// With a deployment key, a registration needs a router's capability for its transfer that
/// names the registering decode engine (or any) and has not expired: each other one is refused
/// with a failure notice, counted, and never written to; an abort without a valid one changes
/// nothing; the valid registration is served.
#[test]
fn with_a_deployment_key_only_a_valid_capability_registers_or_aborts() {
    let secret = crate::AuthKey::from_bytes([9; 32]);
    let mut config = ConnectorConfig::new(EngineId(1));
    config.producer_lease = Duration::from_secs(30);
    config.auth_key = Some(Arc::new(secret.clone()));
    let mut sim = Sim::with(config);
    let wall = sim.driver.clock.wall();
    let until = wall + Duration::from_secs(60);
    let grant = |k: &crate::AuthKey, transfer, decode, until| {
        Some(k.grant(transfer, decode, "127.0.0.1:7100", until))
    };
    let t = key(8);
    let other_key = crate::AuthKey::from_bytes([8; 32]);
    let cases = [
        ("none", None, "no capability"),
        (
            "another key's",
            grant(&other_key, t.transfer, EngineId(2), until),
            "does not verify",
        ),
        (
            "another transfer's",
            grant(&secret, key(9).transfer, EngineId(2), until),
            "does not verify",
        ),
        (
            "another decode's",
            grant(&secret, t.transfer, EngineId(3), until),
            "names decode engine",
        ),
        (
            "an expired one",
            grant(
                &secret,
                t.transfer,
                EngineId(2),
                wall - crate::capability::CLOCK_SKEW - Duration::from_millis(1),
            ),
            "expired",
        ),
    ];
    for (i, (what, capability, says)) in cases.into_iter().enumerate() {
        sim.register_granted(t, 8, ids(4..6), 0x100 + i as u64, capability);
        sim.at(Duration::from_millis(1 + i as u64));
        let refusal = sim.message();
        assert!(
            matches!(&refusal, Some(Message::Failure(f))
                if f.reason == FailureReason::from(Reason::Unauthorized) && f.detail.contains(says)),
            "{what}: {refusal:?}"
        );
    }
    // The valid one holds; an abort without a capability does not touch it.
    sim.register_granted(
        t,
        8,
        ids(4..6),
        0x77,
        grant(&secret, t.transfer, EngineId(2), until),
    );
    let abort = |capability| {
        Message::Abort(kvx_core::wire::Abort {
            transfer: t.transfer,
            attempt: None,
            reason: "rogue".into(),
            capability,
        })
    };
    sim.command(Command::Peer(1, abort(None), control::Queued::unbounded()));
    sim.at(Duration::from_millis(10));
    assert!(
        sim.message().is_none(),
        "the valid registration was refused"
    );
    sim.finish(t, 8, ids(0..2));
    sim.at(Duration::from_millis(11));
    assert_eq!(
        sim.notices(),
        vec![0x77],
        "only the valid registration is written to"
    );
    sim.transport_events();
    sim.at(Duration::from_millis(12));
    assert_eq!(sim.finished()[0].outcome, SendOutcome::Sent);
    assert_eq!(sim.driver.stats.unauthorized.load(Ordering::Relaxed), 6);
}

#[test]
fn a_registration_for_blocks_outside_the_consumers_cache_is_refused_and_holds_nothing() {
    let mut sim = Sim::new(Duration::from_secs(30));
    sim.register(key(4), 8, vec![BlockId(1), BlockId(999)], 0x78);
    sim.at(Duration::from_millis(1));
    let refusal = sim.message();
    assert!(
        matches!(&refusal, Some(Message::Failure(f)) if f.reason == FailureReason::from(Reason::Conflict)),
        "{refusal:?}"
    );
    // Prefill's finish then waits for a registration of its own, and goes at its lease.
    sim.finish(key(4), 8, ids(0..2));
    sim.at(Duration::from_secs(31));
    assert_eq!(
        sim.finished()[0].outcome,
        SendOutcome::NotSent(Reason::LeaseExpired)
    );
    assert!(sim.notices().is_empty());
}

/// A sealed request whose lease ran out before any registration: the outcome waits for the
/// engine's finish, which gets it at once.
/// A registration may name a few blocks more than its tokens need, not many, and no more tokens
/// than the consumer's cache holds: a peer cannot make the producer keep megabytes of block ids
/// per registration.
#[test]
fn a_registration_of_far_more_blocks_than_its_tokens_need_is_refused() {
    let mut sim = Sim::new(Duration::from_secs(30));
    let refused = |sim: &mut Sim, what: &str| {
        let refusal = sim.message();
        assert!(
            matches!(&refusal, Some(Message::Failure(f))
                if f.reason == FailureReason::from(Reason::Conflict)
                    && f.detail.contains("more than the tokens need")),
            "{what}: {refusal:?}"
        );
    };
    // 8 tokens of 4-token blocks need 2 blocks; 2 × 2 + 8 spare are accepted, 13 are not.
    sim.register(key(5), 8, vec![BlockId(1); 12], 0x79);
    sim.at(Duration::from_millis(1));
    assert!(
        sim.message().is_none(),
        "a registration within the bound was refused"
    );
    sim.register(key(6), 8, vec![BlockId(1); 13], 0x7a);
    sim.at(Duration::from_millis(2));
    refused(&mut sim, "13 blocks for 8 tokens");
    // The consumer's cache has 16 blocks: 17 blocks' worth of tokens cannot be its.
    sim.register(key(7), 17 * 4, vec![BlockId(1); 17], 0x7b);
    sim.at(Duration::from_millis(3));
    refused(&mut sim, "more tokens than the cache holds");
}

/// One consumer rank may hold a quarter of `max_entries` live registrations here, no more: the
/// next is refused (and holds nothing) until one of its registrations ends.
#[test]
fn one_consumer_rank_cannot_take_the_whole_registration_capacity() {
    let mut config = ConnectorConfig::new(EngineId(1));
    config.max_entries = 16;
    let mut sim = Sim::with(config);
    for t in 0..4 {
        sim.register(key(100 + t), 8, ids(0..2), 0x100 + t as u64);
    }
    sim.at(Duration::from_millis(1));
    assert!(
        sim.message().is_none(),
        "a registration within the quota was refused"
    );
    sim.register(key(104), 8, ids(0..2), 0x104);
    sim.at(Duration::from_millis(2));
    let refusal = sim.message();
    assert!(
        matches!(&refusal, Some(Message::Failure(f)) if f.detail.contains("the most one may")),
        "{refusal:?}"
    );
    // One of them lands and ends: there is room again.
    sim.finish(key(100), 8, ids(4..6));
    sim.at(Duration::from_millis(3));
    sim.transport_events();
    sim.at(Duration::from_millis(4));
    assert_eq!(sim.notices(), vec![0x100]);
    sim.register(key(105), 8, ids(0..2), 0x105);
    sim.at(Duration::from_millis(5));
    assert!(
        sim.message().is_none(),
        "room was not made by the registration that ended"
    );
}

#[test]
fn a_sealed_request_that_expired_is_reported_at_its_finish() {
    let mut sim = Sim::new(Duration::from_millis(100));
    sim.seal(key(32), 8, ids(0..2));
    sim.at(Duration::from_millis(100));
    sim.at(Duration::from_millis(300));
    assert!(
        sim.finished().is_empty(),
        "given back before the engine's finish"
    );
    assert_eq!(
        sim.driver
            .stats
            .held
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    sim.finish(key(32), 8, ids(0..2));
    let done = sim.finished();
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].outcome, SendOutcome::NotSent(Reason::LeaseExpired));
}

/// A registration `lease` long (as a decode with short heartbeats asks) for `key`.
fn short_registration(sim: &Sim, key: AttemptKey, lease: Duration, notice: u64) -> Message {
    Message::Registration(Registration {
        groups: Vec::new(),
        transfer: key.transfer,
        attempt: key.attempt,
        request: RequestId(7),
        consumer: EngineId(2),
        consumer_incarnation: sim.config.incarnation,
        consumer_rank: Rank(0),
        num_tokens: 8,
        skip_tokens: 0,
        lease_ms: u32::try_from(lease.as_millis()).unwrap(),
        notice,
        blocks: ids(4..6),
        capability: None,
    })
}

/// The consumer's heartbeat for `transfers`.
fn heartbeat(transfers: Vec<TransferId>) -> Command {
    Command::Peer(
        1,
        Message::Heartbeat(Heartbeat {
            engine: EngineId(2),
            incarnation: kvx_core::Incarnation(0),
            transfers,
        }),
        control::Queued::unbounded(),
    )
}

/// Prefill holds a registration for its own lease (three of decode's heartbeat intervals) at a
/// time: decode's heartbeats keep it, for as long as they come; without them it goes at that
/// lease, and a finish after that waits for a registration that no longer is.
#[test]
fn heartbeats_keep_a_registration_alive_past_its_producer_side_lease() {
    let mut sim = Sim::new(Duration::from_secs(30));
    let lease = Duration::from_millis(300);
    let (kept, dropped) = (key(20), key(21));
    for (k, notice) in [(kept, 0x20), (dropped, 0x21)] {
        let registration = short_registration(&sim, k, lease, notice);
        sim.command(Command::Peer(1, registration, control::Queued::unbounded()));
    }
    // A heartbeat every 100 ms for `kept` only, for a second: more than three leases.
    for step in 1..=10u64 {
        sim.at(Duration::from_millis(100 * step));
        sim.command(heartbeat(vec![kept.transfer]));
    }
    sim.finish(kept, 8, ids(0..2));
    sim.finish(dropped, 8, ids(2..4));
    sim.at(Duration::from_millis(1_001));
    assert_eq!(
        sim.notices(),
        vec![0x20],
        "only the registration kept alive is written to"
    );
    sim.transport_events();
    sim.at(Duration::from_millis(1_002));
    let done = sim.finished();
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!((done[0].key, done[0].outcome), (kept, SendOutcome::Sent));
}

/// A registration kept alive by heartbeats for longer than prefill's own lease still gets its
/// KV when prefill finishes: prefill computing for longer than its lease after decode
/// registered (a first step that compiles, a long queue) must not make it forget which decode
/// ranks read.
#[test]
fn a_registration_older_than_the_producer_lease_still_gets_its_kv() {
    let mut sim = Sim::new(Duration::from_millis(600));
    let k = key(22);
    let registration = short_registration(&sim, k, Duration::from_millis(150), 0x22);
    sim.command(Command::Peer(1, registration, control::Queued::unbounded()));
    for step in 1..=36u64 {
        sim.at(Duration::from_millis(50 * step));
        sim.command(heartbeat(vec![k.transfer]));
    }
    sim.finish(k, 8, ids(0..2));
    sim.at(Duration::from_millis(1_801));
    assert_eq!(sim.notices(), vec![0x22]);
    sim.transport_events();
    sim.at(Duration::from_millis(1_802));
    assert_eq!(sim.finished()[0].outcome, SendOutcome::Sent);
    assert_eq!(sim.driver.stats.transfers_ok.load(Ordering::Relaxed), 1);
}

/// Aborts of transfers prefill has not finished are remembered (so that their finish gives the
/// KV back at once) up to `max_entries`: a peer sending aborts of ever new ids cannot grow that
/// memory without end; past the bound, a late finish waits for its lease instead.
#[test]
fn remembered_aborts_are_bounded() {
    let mut config = ConnectorConfig::new(EngineId(1));
    config.max_entries = 2;
    config.producer_lease = Duration::from_millis(1_500);
    let mut sim = Sim::with(config);
    let (ours, _theirs) = UnixStream::pair().unwrap();
    let sender = control::sender(&ControlStream::local(ours)).unwrap();
    let router = Hello::router(EngineId(9), kvx_core::Incarnation(1));
    sim.command(Command::Accepted(2, sender, Box::new(router), None));
    for t in [30, 31, 32] {
        let abort = Message::Abort(kvx_core::wire::Abort {
            transfer: key(t).transfer,
            attempt: None,
            reason: "decode unreachable".into(),
            capability: None,
        });
        sim.command(Command::Peer(2, abort, control::Queued::unbounded()));
    }
    assert_eq!(sim.driver.stats.router_aborts.load(Ordering::Relaxed), 3);
    // Remembered: given back at once.
    sim.at(Duration::from_millis(1));
    sim.finish(key(30), 8, ids(0..2));
    sim.at(Duration::from_millis(2));
    let done = sim.finished();
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].outcome, SendOutcome::NotSent(Reason::Aborted));
    // Past the bound: held until the lease, to the millisecond.
    sim.finish(key(32), 8, ids(2..4));
    sim.at(Duration::from_millis(1_501));
    assert!(sim.finished().is_empty(), "given back before its lease");
    sim.at(Duration::from_millis(1_502));
    let done = sim.finished();
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].outcome, SendOutcome::NotSent(Reason::LeaseExpired));
}

/// Pull, with a deployment key: prefill frees a request's blocks on a decode rank's read
/// completion only if it carries a capability naming that decode engine; one without (a peer
/// that did not read, or guesses) leaves the blocks held for the real reader.
#[test]
fn with_a_deployment_key_only_the_granted_reader_frees_pulled_blocks() {
    let secret = crate::AuthKey::from_bytes([7; 32]);
    let mut config = ConnectorConfig::new(EngineId(1));
    config.producer_lease = Duration::from_secs(30);
    config.auth_key = Some(Arc::new(secret.clone()));
    let mut sim = Sim::with(config);
    let k = key(40);
    sim.command(Command::Finished {
        key: k,
        held: FinishedBlocks::new(RequestId(1), ids(0..2), 8),
        pull: true,
    });
    let done = |capability| {
        Message::Completion(kvx_core::wire::Completion {
            transfer: k.transfer,
            attempt: k.attempt,
            producer: EngineId(2),
            producer_rank: Rank(0),
            bytes: 0,
            capability,
        })
    };
    let until = sim.driver.clock.wall() + Duration::from_secs(60);
    for capability in [
        None,
        Some(secret.grant(k.transfer, EngineId(3), "127.0.0.1:7100", until)),
    ] {
        sim.command(Command::Peer(
            1,
            done(capability),
            control::Queued::unbounded(),
        ));
        sim.at(Duration::from_millis(1));
        assert!(
            sim.finished().is_empty(),
            "freed on a completion that is not the reader's"
        );
    }
    let granted = secret.grant(k.transfer, EngineId(2), "127.0.0.1:7100", until);
    sim.command(Command::Peer(
        1,
        done(Some(granted)),
        control::Queued::unbounded(),
    ));
    sim.at(Duration::from_millis(2));
    let freed = sim.finished();
    assert_eq!(freed.len(), 1, "{freed:?}");
    assert_eq!(freed[0].outcome, SendOutcome::Sent);
    assert_eq!(sim.driver.stats.unauthorized.load(Ordering::Relaxed), 2);
}

/// After its handshake, a connection whose peer says nothing for the idle timeout is closed and
/// its registrations dropped (a peer cannot hold a connection slot by opening one and leaving
/// it); one whose peer heartbeats, as a decode does on each connection whether it waits or not,
/// stays however long.
#[test]
fn a_silent_connection_is_closed_at_the_idle_timeout_and_a_heartbeating_one_stays() {
    let mut config = ConnectorConfig::new(EngineId(1));
    config.idle_timeout = Duration::from_secs(8);
    let mut sim = Sim::with(config);
    // Empty heartbeats (nothing waits) every 2 s for a minute: more than seven idle timeouts.
    for step in 1..=30u64 {
        sim.at(Duration::from_secs(2 * step));
        sim.command(heartbeat(Vec::new()));
    }
    assert!(
        sim.driver.conns.contains_key(&1),
        "a heartbeating peer's connection was closed"
    );
    // A registration at 60 s, then silence: the connection goes between one and 1¼ timeouts
    // later (it is looked at every quarter timeout), not before.
    sim.register(key(40), 8, ids(4..6), 0x40);
    sim.at(Duration::from_millis(60_000 + 7_999));
    assert!(
        sim.driver.conns.contains_key(&1),
        "closed before the idle timeout"
    );
    assert_eq!(sim.driver.stats.idle_closed.load(Ordering::Relaxed), 0);
    sim.at(Duration::from_secs(60 + 10));
    assert!(
        !sim.driver.conns.contains_key(&1),
        "a silent connection stayed open"
    );
    assert_eq!(sim.driver.stats.idle_closed.load(Ordering::Relaxed), 1);
    // The peer's end sees the close: its read ends (no message, no more to come).
    sim.control.set_nonblocking(false).unwrap();
    sim.control
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(std::io::Read::read(&mut sim.control, &mut byte).unwrap(), 0);
    // Its registration went with it: a finish now waits for one, and nothing is written.
    sim.finish(key(40), 8, ids(0..2));
    sim.at(Duration::from_secs(71));
    assert!(
        sim.notices().is_empty(),
        "written to a closed connection's registration"
    );
    assert_eq!(
        sim.driver
            .stats
            .remembered_registrations
            .load(Ordering::Relaxed),
        0
    );
}

/// Pull: a claimed hold outlives the producer lease until its reader's completion, or until the
/// reader's bound (its `transfer_timeout` and the margin); a claim that comes after the lease
/// gave the blocks back is refused, so that the reader discards what it read; a claim that
/// comes before the engine finished the request is answered once it does.
#[test]
fn a_claimed_pull_is_held_past_its_lease_and_a_late_claim_is_refused() {
    let lease = Duration::from_secs(2);
    let mut sim = Sim::new(lease);
    let claim = |k: AttemptKey| {
        Command::Peer(
            1,
            Message::Claim(kvx_core::wire::Claim {
                transfer: k.transfer,
                attempt: k.attempt,
                capability: None,
            }),
            control::Queued::unbounded(),
        )
    };
    let pull = |k: AttemptKey, blocks: Vec<BlockId>| Command::Finished {
        key: k,
        held: FinishedBlocks::new(RequestId(1), blocks, 8),
        pull: true,
    };
    let secs = Duration::from_secs;
    // Claimed within the lease: held past it, until the reader's completion.
    let read = key(50);
    sim.command(pull(read, ids(0..2)));
    sim.at(secs(1));
    sim.command(claim(read));
    assert!(matches!(sim.message(), Some(Message::Held(h)) if h.transfer == read.transfer));
    sim.at(secs(10));
    assert!(
        sim.finished().is_empty(),
        "a claimed pull given back at its lease"
    );
    let done = Message::Completion(kvx_core::wire::Completion {
        transfer: read.transfer,
        attempt: read.attempt,
        producer: EngineId(2),
        producer_rank: Rank(0),
        bytes: 0,
        capability: None,
    });
    sim.command(Command::Peer(1, done, control::Queued::unbounded()));
    let freed = sim.finished();
    assert_eq!(freed.len(), 1, "{freed:?}");
    assert_eq!((freed[0].key, freed[0].outcome), (read, SendOutcome::Sent));
    // Never claimed: given back at the lease, and a later claim is refused.
    let late = key(51);
    sim.command(pull(late, ids(2..4)));
    sim.at(secs(10) + lease);
    let freed = sim.finished();
    assert_eq!(freed.len(), 1, "{freed:?}");
    assert_eq!(freed[0].outcome, SendOutcome::NotSent(Reason::LeaseExpired));
    sim.command(claim(late));
    assert!(
        matches!(sim.message(), Some(Message::Failure(f)) if f.transfer == late.transfer),
        "a claim for blocks given back was not refused"
    );
    // Claimed before the engine finished it: answered when it does; never completed, given
    // back at the reader's bound.
    let early = key(52);
    sim.at(secs(20));
    sim.command(claim(early));
    assert!(
        sim.message().is_none(),
        "answered before the request finished"
    );
    sim.command(pull(early, ids(4..6)));
    assert!(matches!(sim.message(), Some(Message::Held(h)) if h.transfer == early.transfer));
    // Claimed, then aborted by the engine before it finished: the reader hears so at once.
    let dropped = key(53);
    sim.command(claim(dropped));
    assert!(sim.message().is_none());
    sim.command(Command::Abort {
        transfer: dropped.transfer,
        attempt: None,
    });
    assert!(
        matches!(sim.message(), Some(Message::Failure(f)) if f.transfer == dropped.transfer),
        "an early claim of an aborted request was not answered"
    );
    let bound = secs(60) + crate::config::QUIESCE_MARGIN;
    sim.at(secs(20) + bound - Duration::from_millis(1));
    assert!(
        sim.finished().is_empty(),
        "given back before the reader's bound"
    );
    sim.at(secs(20) + bound);
    let freed = sim.finished();
    assert_eq!(freed.len(), 1, "{freed:?}");
    assert_eq!(freed[0].key, early);
}

/// Pull: a reader whose connection closes holds its claimed blocks while its process runs (its
/// reads may still be in flight), and gives them back as soon as its process is seen to exit,
/// once the lease has run out; a claim from a process of another host would wait for its bound.
#[test]
fn a_claim_ends_when_its_readers_process_exits() {
    let lease = Duration::from_secs(2);
    let mut sim = Sim::new(lease);
    let (mut reader, process) = crate::sim_support::a_process();
    let (ours, _theirs) = UnixStream::pair().unwrap();
    let sender = control::sender(&ControlStream::local_to(ours, Some(process))).unwrap();
    let hello = control::hello(
        &ConnectorConfig::new(EngineId(3)),
        Role::Consumer,
        &Layout::new(spec()).unwrap(),
        &sim.consumer.local_desc(),
        false,
    );
    sim.command(Command::Accepted(2, sender, Box::new(hello), None));
    let k = key(60);
    sim.command(Command::Finished {
        key: k,
        held: FinishedBlocks::new(RequestId(1), ids(0..2), 8),
        pull: true,
    });
    let claim = Message::Claim(kvx_core::wire::Claim {
        transfer: k.transfer,
        attempt: k.attempt,
        capability: None,
    });
    sim.command(Command::Peer(2, claim, control::Queued::unbounded()));
    sim.command(Command::PeerClosed(2, "connection reset".into()));
    sim.at(Duration::from_secs(5));
    assert!(
        sim.finished().is_empty(),
        "given back while the reader's process runs"
    );
    reader.kill().unwrap();
    reader.wait().unwrap();
    sim.at(Duration::from_secs(5) + super::LOST_CLAIMANT_LOOK);
    let freed = sim.finished();
    assert_eq!(freed.len(), 1, "{freed:?}");
    assert_eq!(freed[0].key, k);
    assert!(sim.driver.lost_claimants.is_empty());
}

/// Pull into two decode ranks: one gives up (its abort) while the other still reads what it
/// claimed; the blocks stay held until that one is done too, so its read is never of blocks
/// the engine got back (found by the fault harness: the other rank reported the next request's
/// bytes as ready).
#[test]
fn an_abort_from_one_reader_waits_for_the_others_claimed_reads() {
    let mut spec2 = spec();
    spec2.tp_size = 2;
    spec2.tp_rank = 0;
    let mut sim = Sim::with_layouts(ConnectorConfig::new(EngineId(1)), spec(), spec2.clone());
    // Decode's rank 1, on connection 2.
    spec2.tp_rank = 1;
    let (ours, _theirs) = UnixStream::pair().unwrap();
    let sender = control::sender(&ControlStream::local(ours)).unwrap();
    let hello = control::hello(
        &ConnectorConfig::new(EngineId(2)),
        Role::Consumer,
        &Layout::new(spec2).unwrap(),
        &sim.consumer.local_desc(),
        false,
    );
    sim.command(Command::Accepted(2, sender, Box::new(hello), None));
    let k = key(70);
    sim.command(Command::Finished {
        key: k,
        held: FinishedBlocks::new(RequestId(1), ids(0..2), 8),
        pull: true,
    });
    for conn in [1, 2] {
        let claim = Message::Claim(kvx_core::wire::Claim {
            transfer: k.transfer,
            attempt: k.attempt,
            capability: None,
        });
        sim.command(Command::Peer(conn, claim, control::Queued::unbounded()));
    }
    let abort = Message::Abort(kvx_core::wire::Abort {
        transfer: k.transfer,
        attempt: Some(k.attempt),
        reason: "consumer gave up".into(),
        capability: None,
    });
    sim.command(Command::Peer(1, abort, control::Queued::unbounded()));
    sim.at(Duration::from_millis(10));
    assert!(
        sim.finished().is_empty(),
        "given back while another rank reads"
    );
    let done = Message::Completion(kvx_core::wire::Completion {
        transfer: k.transfer,
        attempt: k.attempt,
        producer: EngineId(2),
        producer_rank: Rank(0),
        bytes: 0,
        capability: None,
    });
    sim.command(Command::Peer(2, done, control::Queued::unbounded()));
    let freed = sim.finished();
    assert_eq!(freed.len(), 1, "{freed:?}");
    assert_eq!(freed[0].outcome, SendOutcome::NotSent(Reason::Aborted));
}

/// A consumer whose endpoint the transport cannot connect to (here, one on another fabric) is
/// refused: its control connection closes and nothing it sends is served. Connecting is the
/// driver's, after the hello: the refusal comes back to the state machine before its next input.
#[test]
fn a_consumer_whose_endpoint_cannot_be_connected_is_refused() {
    let mut sim = Sim::new(Duration::from_secs(2));
    let elsewhere = endpoint(&LoopbackFabric::new()).0;
    let (ours, mut theirs) = UnixStream::pair().unwrap();
    let sender = control::sender(&ControlStream::local(ours)).unwrap();
    let hello = control::hello(
        &ConnectorConfig::new(EngineId(3)),
        Role::Consumer,
        &Layout::new(spec()).unwrap(),
        &elsewhere.local_desc(),
        false,
    );
    sim.command(Command::Accepted(2, sender, Box::new(hello), None));
    assert!(
        matches!(
            crate::sim_support::incoming(&mut theirs),
            crate::sim_support::Incoming::Closed(_)
        ),
        "the refused consumer's connection is closed"
    );
    let refused = &sim.driver.conns[&2];
    assert!(refused.consumer.is_none() && refused.leave.is_none());
    assert!(
        sim.driver.conns[&1].consumer.is_some(),
        "the reachable consumer stays"
    );
}
