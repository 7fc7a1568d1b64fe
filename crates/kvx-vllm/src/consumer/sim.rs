//! The consumer's state machine driven by hand, with a virtual clock: no driver thread, no
//! sleeps. A test feeds it what the driver loop would (the engine's requests, a producer rank's
//! finished handshake over an in-memory control connection, its messages, the loopback
//! transport's events, the time) and reads what it decided (the engine's events, the messages
//! to the producer). `pair_sim` joins it to a producer's state machine; `tests/loopback.rs`
//! keeps what needs real threads on both sides.

use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU64;

use kvx_core::EngineId;
use kvx_layout::CopyOp;
use kvx_rdma::loopback::LoopbackFabric;
use kvx_rdma::transport::Notice;

use super::*;
use crate::control::ControlStream;
use crate::driver::{CommandReceiver, Driven};
use crate::sim_support::{endpoint, ids, key, spec};
use kvx_core::wire::Held;

/// Where the (absent) prefill instance is said to listen.
const INSTANCE: SocketAddr = SocketAddr::new(
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 1)),
    1,
);

impl Machine {
    /// The hello this side sends producer ranks.
    pub(crate) fn hello(&self) -> &Hello {
        &self.hello
    }

    /// Whether a read of this side's request `key` is in flight (pull).
    pub(crate) fn reading(&self, key: AttemptKey) -> bool {
        self.reads.values().any(|(k, _)| *k == key)
    }

    /// The prefill ranks this side is dialling (their handshakes run on helper threads).
    pub(crate) fn handshakes(&self) -> Vec<(SocketAddr, Rank)> {
        let dialling = self.connecting.iter();
        dialling
            .flat_map(|(addr, c)| c.ranks.iter().map(|rank| (*addr, *rank)))
            .collect()
    }

    /// The live connection to `instance`'s `rank`.
    pub(crate) fn conn_of(&self, instance: SocketAddr, rank: Rank) -> Option<ConnId> {
        Some(self.instances.get(&instance)?.ranks.get(&rank)?.id)
    }
}

/// One consumer rank's state machine and what surrounds it in a test.
struct Sim {
    driver: Machine,
    now: &'static AtomicU64,
    events: Arc<Outbox>,
    /// The producer rank's endpoint, which writes to the consumer.
    producer: Box<dyn Transport>,
    /// The producer rank's end of its control connection.
    control: UnixStream,
    producer_hello: Hello,
    /// The driver's own queue: what its helper threads send (never fed back here).
    _queue: CommandReceiver<Command>,
}

impl Sim {
    /// A consumer rank with registration lease `lease` and quiesce bound `quiesce`.
    fn new(lease: Duration, quiesce: Duration) -> Self {
        Self::with(lease, Some(quiesce), Duration::from_secs(60))
    }

    /// A consumer rank with registration lease `lease` and quiesce bound `quiesce` (`None`:
    /// its writers'), whose producer rank says its writes run at most `transfer_timeout`.
    fn with(lease: Duration, quiesce: Option<Duration>, transfer_timeout: Duration) -> Self {
        Self::configured(transfer_timeout, |config| {
            config.registration_lease = lease;
            config.quiesce_timeout = quiesce;
        })
    }

    /// A consumer rank of engine 2 whose configuration `edit` changes, whose producer rank says
    /// its writes run at most `transfer_timeout`.
    fn configured(transfer_timeout: Duration, edit: impl FnOnce(&mut ConnectorConfig)) -> Self {
        let fabric = LoopbackFabric::new();
        let mut config = ConnectorConfig::new(EngineId(2));
        edit(&mut config);
        // Notices come to the state machine as transport events, not through a board that
        // the engine thread reads.
        config.notice_board = false;
        let now: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
        let (transport, regions) = endpoint(&fabric);
        let (tx, queue) = driver::command_queue(None);
        let events = Arc::new(Outbox {
            hints: Arc::new(PollHints::default()),
            events: Mailbox::default(),
        });
        let driver = Machine::new(
            config,
            Layout::new(spec()).unwrap(),
            regions,
            transport,
            None,
            Clock::virtual_at(now),
            tx,
            Arc::clone(&events),
            Arc::new(Stats::default()),
        )
        .unwrap();
        let (producer, _) = endpoint(&fabric);
        let mut producer_config = ConnectorConfig::new(EngineId(1));
        producer_config.transfer_timeout = transfer_timeout;
        let producer_hello = control::hello(
            &producer_config,
            Role::Producer,
            &Layout::new(spec()).unwrap(),
            &producer.local_desc(),
            false,
        );
        let (_, control) = UnixStream::pair().unwrap();
        Self {
            driver,
            now,
            events,
            producer,
            control,
            producer_hello,
            _queue: queue,
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

    /// Prefill rank 0's handshake ends over a new control connection, whose stream `wrap`
    /// makes of this side's end.
    fn handshake(&mut self, wrap: impl FnOnce(UnixStream) -> ControlStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        self.control = theirs;
        let hello = self.producer_hello.clone();
        self.command(Command::Handshaken(
            INSTANCE,
            Rank(0),
            Ok(Dialled::new(wrap(ours), hello).unwrap()),
        ));
    }

    /// The engine asks to pull `k` ([`pull_request`]), prefill rank 0's handshake then ends, and
    /// the read's claim reaches the producer rank.
    fn pull_claimed(&mut self, k: AttemptKey) {
        self.command(Command::Pull(pull_request(k)));
        self.handshake(ControlStream::local);
        match self.message() {
            Some(Message::Claim(c)) => assert_eq!((c.transfer, c.attempt), (k.transfer, k.attempt)),
            other => panic!("expected the read's claim, got {other:?}"),
        }
    }

    /// The engine allocated `blocks` for `key` (push), and prefill rank 0's handshake then
    /// ends; returns the registration the producer rank receives.
    fn register(&mut self, key: AttemptKey, tokens: u64, blocks: Vec<BlockId>) -> Registration {
        self.register_granted(key, tokens, blocks, None)
    }

    /// [`Sim::register`] with the router's `capability`.
    fn register_granted(
        &mut self,
        key: AttemptKey,
        tokens: u64,
        blocks: Vec<BlockId>,
        capability: Option<Capability>,
    ) -> Registration {
        let this_process = Process::of(i32::try_from(std::process::id()).unwrap());
        self.register_from(key, tokens, blocks, capability, Some(this_process))
    }

    /// [`Sim::register_granted`] over a control connection to `process` (`None`: a producer
    /// of another host).
    fn register_from(
        &mut self,
        key: AttemptKey,
        tokens: u64,
        blocks: Vec<BlockId>,
        capability: Option<Capability>,
        process: Option<Process>,
    ) -> Registration {
        self.command(Command::Push(push_request(key, tokens, blocks, capability)));
        self.handshake(|ours| ControlStream::local_to(ours, process));
        match self.message() {
            Some(Message::Registration(r)) => r,
            other => panic!("expected the registration, got {other:?}"),
        }
    }

    /// The producer rank writes a little and announces it with `notice`.
    fn write_with_notice(&mut self, notice: u64) {
        let peer = self
            .producer
            .connect(&self.driver.transport().expect("open").local_desc())
            .unwrap();
        let op = CopyOp {
            producer: Rank(0),
            src_region: 0,
            src_offset: 0,
            dst_region: 0,
            dst_offset: 0,
            len: 64,
            count: 1,
            src_stride: 0,
            dst_stride: 0,
        };
        self.producer
            .write(peer, &[op], Some(Notice(notice)))
            .unwrap();
    }

    /// Hands the state machine what its transport reported.
    fn transport_events(&mut self) {
        crate::sim_support::transport_events(&mut self.driver);
    }

    /// What the engine learns now.
    fn events(&self) -> Vec<RecvEvent> {
        self.events
            .events
            .take()
            .into_iter()
            .map(|(e, _)| e)
            .collect()
    }

    /// The next message to the producer rank, if one is there.
    fn message(&mut self) -> Option<Message> {
        crate::sim_support::message(&mut self.control)
    }
}

/// The engine's push request for `key` at [`INSTANCE`].
fn push_request(
    key: AttemptKey,
    tokens: u64,
    blocks: Vec<BlockId>,
    capability: Option<Capability>,
) -> PushRequest {
    PushRequest {
        groups: Vec::new(),
        key,
        request: RequestId(9),
        prefill: INSTANCE,
        num_tokens: tokens,
        skip_tokens: 0,
        blocks,
        capability,
        trace: None,
    }
}

/// With a deployment key, a request reaches its prefill only with a router's capability that
/// verifies, names this decode engine (or any) and that prefill, and has not expired; any other
/// fails as unauthorized before a connection is even begun. With a `peers` list, a prefill not
/// on it is refused the same way, key or not. The valid capability goes out with the
/// registration.
#[test]
fn a_request_reaches_its_prefill_only_with_a_valid_capability_and_on_the_peers_list() {
    let secret = crate::AuthKey::from_bytes([4; 32]);
    let mut sim = Sim::configured(Duration::from_secs(60), |c| {
        c.auth_key = Some(Arc::new(secret.clone()));
        c.notice_board = false;
    });
    let wall = sim.driver.clock.wall();
    let until = wall + Duration::from_secs(60);
    let grant = |k: &crate::AuthKey, transfer, decode, prefill: &str, until| {
        Some(k.grant(transfer, decode, prefill, until))
    };
    let me = EngineId(2);
    let at = INSTANCE.to_string();
    let cases = [
        ("none", None, "no capability"),
        (
            "another key's",
            grant(
                &crate::AuthKey::from_bytes([5; 32]),
                key(1).transfer,
                me,
                &at,
                until,
            ),
            "does not verify",
        ),
        (
            "another transfer's",
            grant(&secret, key(2).transfer, me, &at, until),
            "does not verify",
        ),
        (
            "another decode's",
            grant(&secret, key(1).transfer, EngineId(3), &at, until),
            "names decode engine",
        ),
        (
            "another prefill's",
            grant(&secret, key(1).transfer, me, "127.0.0.1:2", until),
            "names prefill",
        ),
        (
            "an expired one",
            grant(
                &secret,
                key(1).transfer,
                me,
                &at,
                wall - crate::capability::CLOCK_SKEW - Duration::from_secs(1),
            ),
            "expired",
        ),
    ];
    for (what, capability, says) in cases {
        sim.command(Command::Push(push_request(
            key(1),
            8,
            ids(3..5),
            capability,
        )));
        match sim.events().as_slice() {
            [RecvEvent::Failed {
                reason: Reason::Unauthorized,
                detail,
                ..
            }] if detail.contains(says) => {}
            other => panic!("{what}: {other:?}"),
        }
        assert!(
            sim.driver.connecting.is_empty() && sim.driver.instances.is_empty(),
            "{what}: a connection was begun"
        );
    }
    assert_eq!(sim.driver.stats.unauthorized.load(Ordering::Relaxed), 6);
    let valid = grant(&secret, key(1).transfer, me, &at, until);
    let registration = sim.register_granted(key(1), 8, ids(3..5), valid.clone());
    assert_eq!(registration.capability, valid);

    // A peers list: a prefill not on it is refused before connecting, even without a key.
    let mut sim = Sim::configured(Duration::from_secs(60), |c| {
        c.peers = "10.0.0.1:7100".parse().unwrap();
    });
    sim.command(Command::Push(push_request(key(3), 8, ids(3..5), None)));
    match sim.events().as_slice() {
        [RecvEvent::Failed {
            reason: Reason::Unauthorized,
            detail,
            ..
        }] if detail.contains("peers list") => {}
        other => panic!("{other:?}"),
    }
    assert!(sim.driver.connecting.is_empty() && sim.driver.instances.is_empty());
}

#[test]
fn a_registered_request_is_ready_once_its_writers_notice_arrives_and_not_before() {
    let mut sim = Sim::new(Duration::from_secs(60), Duration::from_secs(1));
    let registration = sim.register(key(1), 8, ids(3..5));
    assert_eq!(registration.blocks, ids(3..5));
    assert_eq!(registration.num_tokens, 8);
    sim.at(Duration::from_millis(5));
    assert!(sim.events().is_empty(), "ready before any write");
    sim.write_with_notice(registration.notice);
    sim.transport_events();
    sim.at(Duration::from_millis(6));
    assert_eq!(
        sim.events(),
        vec![RecvEvent::Ready {
            key: key(1),
            request: RequestId(9)
        }]
    );
    // A duplicate of the notice changes nothing.
    sim.write_with_notice(registration.notice);
    sim.transport_events();
    sim.at(Duration::from_secs(600));
    assert!(sim.events().is_empty());
}

/// Message notices are random: distinct, non-zero and within 32 bits, and not a sequence, so a
/// producer cannot announce another producer's transfer as written by guessing its notice from
/// its own (the notices that come after and before its own complete nothing).
#[test]
fn message_notices_cannot_be_guessed_from_another_requests() {
    let mut sim = Sim::new(Duration::from_secs(60), Duration::from_secs(1));
    let first = sim.register(key(1), 8, ids(0..2));
    let mut notices = vec![first.notice];
    for i in 2..=64u32 {
        sim.command(Command::Push(push_request(
            key(u128::from(i)),
            8,
            ids(2 * i..2 * i + 2),
            None,
        )));
        match sim.message() {
            Some(Message::Registration(r)) => notices.push(r.notice),
            other => panic!("expected a registration, got {other:?}"),
        }
    }
    let distinct: std::collections::HashSet<u64> = notices.iter().copied().collect();
    assert_eq!(distinct.len(), notices.len(), "{notices:?}");
    assert!(notices.iter().all(|&n| n != 0 && n <= u64::from(u32::MAX)));
    let steps_of_one = notices.windows(2).filter(|w| w[1] == w[0] + 1).count();
    assert!(steps_of_one < 2, "a sequence: {notices:?}");
    // The rogue producer (rank 0 of request 1) announces its guesses.
    for guess in [first.notice + 1, first.notice - 1, first.notice + 2] {
        if !distinct.contains(&guess) {
            sim.write_with_notice(guess);
        }
    }
    sim.transport_events();
    sim.at(Duration::from_millis(5));
    assert!(
        sim.events().is_empty(),
        "a guessed notice completed a request"
    );
}

#[test]
fn a_request_whose_kv_never_comes_fails_at_its_lease_once_its_writers_had_time_to_stop() {
    let (lease, quiesce) = (Duration::from_millis(300), Duration::from_millis(500));
    let mut sim = Sim::new(lease, quiesce);
    sim.register(key(2), 8, ids(0..2));
    sim.at(lease - Duration::from_millis(1));
    assert!(sim.events().is_empty(), "failed before its lease");
    // At the lease the producer rank is told to stop; the blocks stay held while a write of
    // it could still land.
    sim.at(lease);
    assert!(
        sim.events().is_empty(),
        "reported while its writer may still write"
    );
    let told = std::iter::from_fn(|| sim.message()).collect::<Vec<_>>();
    assert!(!told.is_empty(), "the producer rank was not told");
    sim.at(lease + quiesce - Duration::from_millis(1));
    assert!(sim.events().is_empty());
    sim.at(lease + quiesce);
    let events = sim.events();
    assert!(
        matches!(&events[..], [RecvEvent::Failed { key: k, reason: Reason::LeaseExpired, .. }] if *k == key(2)),
        "{events:?}"
    );
}

#[test]
fn heartbeats_go_out_at_the_interval_while_a_request_waits() {
    let mut sim = Sim::new(Duration::from_secs(60), Duration::from_secs(1));
    sim.register(key(3), 8, ids(0..2));
    let interval = ConnectorConfig::new(EngineId(2)).heartbeat_interval;
    sim.at(interval - Duration::from_millis(1));
    assert!(
        sim.message().is_none(),
        "a message before the first heartbeat"
    );
    sim.at(interval + Duration::from_millis(1));
    assert!(
        matches!(sim.message(), Some(Message::Heartbeat(_))),
        "no heartbeat at the interval"
    );
}

/// Once its request is done, decode keeps heartbeating on the connection (naming no transfer)
/// at every interval, so that prefill's idle timeout keeps it for the next request.
#[test]
fn an_idle_decode_keeps_its_connections_alive_with_heartbeats() {
    let mut sim = Sim::new(Duration::from_secs(60), Duration::from_secs(1));
    let registration = sim.register(key(5), 8, ids(0..2));
    sim.write_with_notice(registration.notice);
    sim.transport_events();
    sim.at(Duration::from_millis(1));
    assert_eq!(sim.events().len(), 1, "the request is not done");
    let interval = ConnectorConfig::new(EngineId(2)).heartbeat_interval;
    // Ten intervals with nothing waiting: a heartbeat naming no transfer at each.
    for n in 1..=10u32 {
        sim.at(interval * n - Duration::from_millis(1));
        assert!(
            sim.message().is_none(),
            "a message before heartbeat {n} was due"
        );
        sim.at(interval * n + Duration::from_millis(1));
        match sim.message() {
            Some(Message::Heartbeat(hb)) => assert!(hb.transfers.is_empty(), "{hb:?}"),
            other => panic!("expected heartbeat {n}, got {other:?}"),
        }
    }
}

/// Registers a request with a producer rank that never answers, cancels it at 10 ms, and
/// checks that its failure is reported exactly `bound` later (its blocks held until then, as a
/// write of that rank may still land), with `detail_has` in the detail.
fn cancel_with_a_silent_producer(mut sim: Sim, bound: Duration, detail_has: &str) {
    sim.register(key(14), 8, ids(0..2));
    let cancelled = Duration::from_millis(10);
    sim.at(cancelled);
    sim.command(Command::Cancel {
        transfer: TransferId(14),
        attempt: None,
    });
    sim.at(cancelled + bound - Duration::from_millis(1));
    assert!(sim.events().is_empty(), "reported before {bound:?}");
    sim.at(cancelled + bound);
    let events = sim.events();
    match &events[..] {
        [RecvEvent::Failed { reason, detail, .. }] => {
            assert_eq!(*reason, Reason::Aborted);
            assert!(detail.contains(detail_has), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        sim.driver
            .stats
            .released_unconfirmed
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

/// A producer rank that handshakes and then never answers: with a fixed `quiesce_timeout`, a
/// cancelled request's blocks stay held exactly that long, then the failure is reported.
#[test]
fn cancel_waits_for_a_silent_producer_until_the_quiesce_timeout() {
    let quiesce = Duration::from_millis(400);
    let sim = Sim::with(
        Duration::from_secs(60),
        Some(quiesce),
        Duration::from_secs(60),
    );
    // Not the default's 62 s (the producer's 60 s transfer timeout and the margin).
    cancel_with_a_silent_producer(sim, quiesce, "without confirmation");
}

/// By default decode holds a failed request's blocks for as long as the silent producer rank
/// said (in its hello) that its writes can run, plus the margin: never shorter, so a write
/// still in flight cannot land in blocks the engine has handed to another request.
/// A producer's word for how long its writes can run is taken up to the longest transfer
/// timeout a producer may have: one that says weeks holds decode's blocks for an hour at most.
#[test]
fn a_producers_write_timeout_is_believed_up_to_the_bound() {
    let says = Duration::from_millis(u64::from(u32::MAX));
    let sim = Sim::with(Duration::from_secs(60), None, says);
    let bound = crate::config::MAX_TRANSFER_TIMEOUT + QUIESCE_MARGIN;
    cancel_with_a_silent_producer(sim, bound, &format!("{bound:?}"));
    let mut config = ConnectorConfig::new(EngineId(1));
    config.transfer_timeout = crate::config::MAX_TRANSFER_TIMEOUT + Duration::from_secs(1);
    assert!(matches!(
        config.validate(),
        Err(crate::StartError::TooLong {
            setting: "transfer_timeout",
            ..
        })
    ));
}

#[test]
fn cancel_waits_for_a_silent_producer_as_long_as_its_writes_can_run() {
    assert_eq!(
        ConnectorConfig::new(EngineId(2)).quiesce_timeout,
        None,
        "the default follows the producers"
    );
    let writes = Duration::from_millis(700);
    let sim = Sim::with(Duration::from_secs(60), None, writes);
    let bound = writes + QUIESCE_MARGIN;
    cancel_with_a_silent_producer(sim, bound, &format!("{bound:?}"));
}

/// The producer rank's control connection is lost (a reset, a timeout) at `at`.
fn lose_connection(sim: &mut Sim, at: Duration) {
    sim.at(at);
    let conn = sim.driver.conn_of(INSTANCE, Rank(0)).expect("connected");
    sim.command(Command::PeerClosed(
        INSTANCE,
        Rank(0),
        conn,
        "connection reset by peer".into(),
    ));
}

/// The one event the engine has now: the request's failure; returns its detail.
fn failed_once(sim: &Sim, reason: Reason) -> String {
    match &sim.events()[..] {
        [RecvEvent::Failed {
            reason: r, detail, ..
        }] if *r == reason => detail.clone(),
        other => panic!("expected one failure ({reason:?}), got {other:?}"),
    }
}

/// A lost control connection alone is no proof that a producer's posted writes have ended: its
/// process may live on (a network fault, a connection it closed). The request fails, but its
/// blocks stay held while the producer's process (on this host) runs, and go back as soon as it
/// is seen to exit.
#[test]
fn a_lost_connection_holds_the_blocks_while_the_producers_process_runs() {
    let mut sim = Sim::with(Duration::from_secs(60), None, Duration::from_secs(60));
    let (mut producer, process) = crate::sim_support::a_process();
    sim.register_from(key(30), 8, ids(0..2), None, Some(process));
    let lost = Duration::from_millis(10);
    lose_connection(&mut sim, lost);
    sim.at(lost + Duration::from_secs(5));
    assert!(
        sim.events().is_empty(),
        "released while the producer's process runs"
    );
    producer.kill().unwrap();
    producer.wait().unwrap();
    sim.at(lost + Duration::from_secs(5) + LOST_LOOK);
    let detail = failed_once(&sim, Reason::PeerFailed);
    assert!(detail.is_empty(), "{detail}");
    assert_eq!(
        sim.driver
            .stats
            .released_unconfirmed
            .load(Ordering::Relaxed),
        0
    );
    assert!(sim.driver.quiescing.is_empty() && sim.driver.next_lost_look.is_none());
}

/// A producer whose process is known to have exited when its connection is lost writes no
/// more: the request fails and its blocks go back at once.
#[test]
fn a_lost_connection_to_an_exited_process_releases_the_blocks_at_once() {
    let mut sim = Sim::with(Duration::from_secs(60), None, Duration::from_secs(60));
    let (mut producer, process) = crate::sim_support::a_process();
    sim.register_from(key(31), 8, ids(0..2), None, Some(process));
    producer.kill().unwrap();
    producer.wait().unwrap();
    lose_connection(&mut sim, Duration::from_millis(10));
    let detail = failed_once(&sim, Reason::PeerFailed);
    assert!(detail.is_empty(), "{detail}");
}

/// A producer of another host whose connection is lost cannot be seen: its request's blocks
/// stay held for as long as it said its writes can run, plus the margin, then go back counted
/// as released without confirmation.
#[test]
fn a_lost_connection_to_another_host_holds_the_blocks_as_long_as_its_writes_can_run() {
    let writes = Duration::from_millis(700);
    let mut sim = Sim::with(Duration::from_secs(60), None, writes);
    sim.register_from(key(32), 8, ids(0..2), None, None);
    let lost = Duration::from_millis(10);
    lose_connection(&mut sim, lost);
    let bound = writes + QUIESCE_MARGIN;
    sim.at(lost + bound - Duration::from_millis(1));
    assert!(sim.events().is_empty(), "released before {bound:?}");
    sim.at(lost + bound);
    let detail = failed_once(&sim, Reason::PeerFailed);
    assert!(detail.contains("without confirmation"), "{detail}");
    assert_eq!(
        sim.driver
            .stats
            .released_unconfirmed
            .load(Ordering::Relaxed),
        1
    );
}

/// The producer rank sends `message` over the live connection.
fn from_producer(sim: &mut Sim, message: Message) {
    let conn = sim.driver.conn_of(INSTANCE, Rank(0)).expect("connected");
    sim.command(Command::Peer(
        INSTANCE,
        Rank(0),
        conn,
        message,
        crate::control::Queued::unbounded(),
    ));
}

/// Pull: decode's read ends before prefill says it held the blocks, which it may no longer do
/// (its lease ran out): the request is ready only once prefill answers its claim with `Held`;
/// answered with a failure instead, it fails, and what was read is never reported ready.
#[test]
fn a_pull_is_ready_only_once_prefill_says_it_held_the_blocks() {
    for held in [true, false] {
        let mut sim = Sim::new(Duration::from_secs(60), Duration::from_secs(1));
        let k = key(40);
        sim.pull_claimed(k);
        // The read lands and ends (loopback reads complete at once).
        sim.transport_events();
        sim.at(Duration::from_millis(5));
        assert!(
            sim.events().is_empty(),
            "ready before prefill said it held the blocks"
        );
        let answer = if held {
            Message::Held(Held {
                transfer: k.transfer,
                attempt: k.attempt,
                producer_rank: Rank(0),
            })
        } else {
            Message::Failure(kvx_core::wire::FailureNotice {
                transfer: k.transfer,
                attempt: k.attempt,
                rank: Rank(0),
                reason: kvx_core::wire::FailureReason::LeaseExpired,
                detail: "its blocks are held no more".into(),
            })
        };
        from_producer(&mut sim, answer);
        sim.at(Duration::from_millis(6));
        match (&sim.events()[..], held) {
            ([RecvEvent::Ready { key: ready, .. }], true) => assert_eq!(*ready, k),
            ([RecvEvent::Failed { key: failed, .. }], false) => assert_eq!(*failed, k),
            (other, _) => panic!("held {held}: {other:?}"),
        }
        assert!(sim.driver.unheld.is_empty());
    }
}

/// Pull from a prefill rank whose endpoint decode's transport cannot connect to (here, one on
/// another fabric): connecting is the driver's, after the input that asked for it; the read on
/// the unconnected endpoint is refused, the request fails as a read that failed does (prefill
/// hears the abort after the claim), and the rank is connected again for its next read.
#[test]
fn a_pull_from_an_endpoint_that_cannot_be_connected_fails_and_connects_again_next_time() {
    let mut sim = Sim::new(Duration::from_secs(60), Duration::from_secs(1));
    let elsewhere = endpoint(&LoopbackFabric::new()).0;
    sim.producer_hello = control::hello(
        &ConnectorConfig::new(EngineId(1)),
        Role::Producer,
        &Layout::new(spec()).unwrap(),
        &elsewhere.local_desc(),
        false,
    );
    let k = key(41);
    sim.pull_claimed(k);
    match sim.message() {
        Some(Message::Abort(a)) => {
            assert_eq!((a.transfer, a.attempt), (k.transfer, Some(k.attempt)))
        }
        other => panic!("expected the abort, got {other:?}"),
    }
    match &sim.events()[..] {
        [RecvEvent::Failed {
            key: failed,
            reason: Reason::TransferFailed,
            ..
        }] => {
            assert_eq!(*failed, k);
        }
        other => panic!("{other:?}"),
    }
    assert!(sim.driver.reads.is_empty() && sim.driver.quiescing.is_empty());
    let rank = &sim.driver.instances[&INSTANCE].ranks[&Rank(0)];
    assert!(rank.peer.is_none(), "connected again for the next read");

    let again = key(42);
    sim.command(Command::Pull(pull_request(again)));
    assert!(matches!(sim.message(), Some(Message::Claim(_))));
    assert!(sim.driver.instances[&INSTANCE].ranks[&Rank(0)]
        .peer
        .is_none());
    assert!(
        matches!(&sim.events()[..], [RecvEvent::Failed { key: failed, .. }] if *failed == again)
    );
}

/// Pull `k` into blocks 0..2 from prefill's blocks 4..6 (8 tokens).
fn pull_request(k: AttemptKey) -> PullRequest {
    PullRequest {
        producer_groups: Vec::new(),
        push: push_request(k, 8, ids(0..2), None),
        producer_blocks: ids(4..6),
    }
}
