//! Both sides' state machines joined and driven by hand, with one virtual clock: a prefill
//! rank's and a decode rank's, on one loopback fabric, their control connection relayed message
//! by message by the test. No driver thread, no sleep: what a transfer between them decides at
//! each moment (leases, aborts, cancels under a write in flight, preemption, seals) is tested at
//! the instant it is due, and a write "in flight" is one whose completion the test has not
//! handed to prefill yet. `tests/loopback.rs` keeps what needs the real driver threads,
//! sockets, engines and processes.

use std::net::SocketAddr;
use std::ops::Range;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kvx_core::wire::{Hello, Message, Role};
use kvx_core::{Attempt, BlockId, EngineId, Rank, RequestId, TransferId};
use kvx_layout::Layout;
use kvx_rdma::local_peer::Process;
use kvx_rdma::loopback::LoopbackFabric;
use kvx_rdma::region::HostBuffer;
use kvx_rdma::transport::{Event, OpKind};
use kvx_rendezvous::{AttemptKey, Timestamp};

use crate::config::ConnectorConfig;
use crate::consumer::{self, PushRequest, RecvEvent};
use crate::control::{self, ControlError, ControlStream, Queued};
use crate::driver::{self, Clock, CommandReceiver, Driven, Mailbox};
use crate::producer::{self, FinishedBlocks, FinishedSending};
use crate::sim_support::{cache_endpoint, spec};
use crate::stats::Stats;

/// Where prefill is said to listen (decode never reaches it: the test makes the connection).
const PREFILL: SocketAddr = SocketAddr::new(
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 1)),
    1,
);

/// The request ids each side's engine uses.
pub(crate) const PREFILL_REQUEST: RequestId = RequestId(7);
pub(crate) const DECODE_REQUEST: RequestId = RequestId(9);

/// One prefill rank and one decode rank of [`spec`]'s layout, and what surrounds them.
pub(crate) struct Pair {
    now: &'static AtomicU64,
    prefill: producer::Driver,
    decode: consumer::Driver,
    finished: Arc<Mailbox<(FinishedSending, SystemTime)>>,
    events: Arc<consumer::Outbox>,
    prefill_stats: Arc<Stats>,
    decode_stats: Arc<Stats>,
    prefill_memory: Vec<Arc<HostBuffer>>,
    decode_memory: Vec<Arc<HostBuffer>>,
    producer_hello: Hello,
    /// The relay's ends while connected: what decode sends arrives on the first, what prefill
    /// sends on the second; and prefill's id of the connection.
    relay: Option<(UnixStream, UnixStream, u64)>,
    /// Prefill's id of the next connection.
    next_conn: u64,
    /// Decode's own queue: what its helper threads send (its failed attempt to reach
    /// [`PREFILL`] itself; never fed back).
    _queue: CommandReceiver<consumer::Command>,
    /// Whether transfers stay in flight: prefill's writes (their completions wait in prefill's
    /// transport, their notices are kept from decode) and decode's reads (their completions are
    /// kept from decode), until this is `false` again.
    pub(crate) hold_writes: bool,
    held_notices: Vec<Event>,
    /// Notices decode's transport drops before its state machine sees them.
    pub(crate) notices_to_lose: usize,
}

impl Pair {
    /// A prefill rank (engine 1) and a decode rank (engine 2) with their default settings and
    /// decode's registration lease `lease`.
    pub(crate) fn new(lease: Duration) -> Self {
        Self::configured(|_| {}, |decode| decode.registration_lease = lease)
    }

    /// A prefill rank and a decode rank whose settings `prefill` and `decode` change.
    pub(crate) fn configured(
        prefill: impl FnOnce(&mut ConnectorConfig),
        decode: impl FnOnce(&mut ConnectorConfig),
    ) -> Self {
        let fabric = LoopbackFabric::new();
        let now: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
        let clock = Clock::virtual_at(now);

        let mut producer_config = ConnectorConfig::new(EngineId(1));
        prefill(&mut producer_config);
        let (transport, _, prefill_memory) = cache_endpoint(&fabric);
        let layout = Layout::new(spec()).expect("a valid layout");
        let producer_hello = control::hello(
            &producer_config,
            Role::Producer,
            &layout,
            &transport.local_desc(),
            false,
        );
        let finished = Arc::new(Mailbox::default());
        let prefill_stats = Arc::new(Stats::default());
        let prefill = producer::Driver::new(
            &producer_config,
            layout.clone(),
            transport,
            clock,
            Arc::clone(&finished),
            Arc::clone(&prefill_stats),
        )
        .expect("a producer");

        let mut consumer_config = ConnectorConfig::new(EngineId(2));
        decode(&mut consumer_config);
        // Notices come to the state machine as transport events, not through a board that the
        // engine thread reads.
        consumer_config.notice_board = false;
        let (transport, regions, decode_memory) = cache_endpoint(&fabric);
        let (tx, queue) = driver::command_queue(None);
        let events = Arc::new(consumer::Outbox {
            hints: Arc::default(),
            events: Mailbox::default(),
        });
        let decode_stats = Arc::new(Stats::default());
        let decode = consumer::Driver::new(
            consumer_config,
            layout,
            regions,
            transport,
            None,
            clock,
            tx,
            Arc::clone(&events),
            Arc::clone(&decode_stats),
        )
        .expect("a consumer");
        Self {
            now,
            prefill,
            decode,
            finished,
            events,
            prefill_stats,
            decode_stats,
            prefill_memory,
            decode_memory,
            producer_hello,
            relay: None,
            next_conn: 1,
            _queue: queue,
            hold_writes: false,
            held_notices: Vec::new(),
            notices_to_lose: 0,
        }
    }

    /// Decode's engine allocated `blocks` for `key`'s `tokens` tokens (push): it registers them
    /// with prefill, connecting first if it has not yet.
    pub(crate) fn register(&mut self, key: AttemptKey, tokens: u64, blocks: Vec<BlockId>) {
        self.register_as(key, DECODE_REQUEST, tokens, blocks);
    }

    /// [`Pair::register`] for decode's engine request `request`.
    pub(crate) fn register_as(
        &mut self,
        key: AttemptKey,
        request: RequestId,
        tokens: u64,
        blocks: Vec<BlockId>,
    ) {
        self.decode.command(consumer::Command::Push(PushRequest {
            key,
            request,
            prefill: PREFILL,
            num_tokens: tokens,
            skip_tokens: 0,
            blocks,
            groups: Vec::new(),
            capability: None,
            trace: None,
        }));
        if self.relay.is_none() {
            self.connect();
        }
        self.settle();
    }

    /// Decode's engine allocated `blocks` for `key`'s `tokens` tokens (pull): it reads them from
    /// prefill's `producer_blocks` once prefill holds them, connecting first if it has not yet.
    pub(crate) fn pull(
        &mut self,
        key: AttemptKey,
        tokens: u64,
        blocks: Vec<BlockId>,
        producer_blocks: Vec<BlockId>,
    ) {
        self.decode
            .command(consumer::Command::Pull(consumer::PullRequest {
                push: PushRequest {
                    key,
                    request: DECODE_REQUEST,
                    prefill: PREFILL,
                    num_tokens: tokens,
                    skip_tokens: 0,
                    blocks,
                    groups: Vec::new(),
                    capability: None,
                    trace: None,
                },
                producer_blocks,
                producer_groups: Vec::new(),
            }));
        if self.relay.is_none() {
            self.connect();
        }
        self.settle();
    }

    /// Decode's handshake with prefill ends: each side gets its end of a control connection
    /// whose other ends the relay holds.
    fn connect(&mut self) {
        let (decode_end, from_decode) = UnixStream::pair().expect("a socket pair");
        let (prefill_end, from_prefill) = UnixStream::pair().expect("a socket pair");
        let this_process = Process::of(i32::try_from(std::process::id()).expect("a pid"));
        self.decode.command(consumer::Command::Handshaken(
            PREFILL,
            Rank(0),
            Ok((
                ControlStream::local_to(decode_end, Some(this_process)),
                self.producer_hello.clone(),
            )),
        ));
        let sender = control::sender(&ControlStream::local(prefill_end)).expect("a sender");
        let hello = Box::new(self.decode.hello().clone());
        let conn = self.next_conn;
        self.next_conn += 1;
        self.prefill
            .command(producer::Command::Accepted(conn, sender, hello, None));
        self.relay = Some((from_decode, from_prefill, conn));
    }

    /// Prefill's engine finished `key` on `blocks` (push).
    pub(crate) fn finish(&mut self, key: AttemptKey, tokens: u64, blocks: Vec<BlockId>) {
        self.prefill_does(producer::Command::Finished {
            key,
            held: FinishedBlocks::new(PREFILL_REQUEST, blocks, tokens),
            pull: false,
        });
    }

    /// Prefill's engine finished `key` on `blocks` for decode to read (pull).
    pub(crate) fn finish_pull(&mut self, key: AttemptKey, tokens: u64, blocks: Vec<BlockId>) {
        self.prefill_does(producer::Command::Finished {
            key,
            held: FinishedBlocks::new(PREFILL_REQUEST, blocks, tokens),
            pull: true,
        });
    }

    /// Prefill's engine sealed `key` on `blocks`: its KV is final, the engine keeps the blocks
    /// until it finishes the request.
    pub(crate) fn seal(&mut self, key: AttemptKey, tokens: u64, blocks: Vec<BlockId>) {
        self.prefill_does(producer::Command::Sealed {
            key,
            held: FinishedBlocks::new(PREFILL_REQUEST, blocks, tokens),
        });
    }

    /// Prefill's engine computed `key`'s first `tokens` tokens into `blocks`, in its first
    /// `layers` layers (`None`: all of them).
    pub(crate) fn progress(
        &mut self,
        key: AttemptKey,
        blocks: Vec<BlockId>,
        tokens: u64,
        layers: Option<u32>,
    ) {
        self.prefill_does(producer::Command::Progress {
            key,
            blocks,
            tokens,
            layers,
        });
    }

    /// Prefill's engine aborted `transfer` (`attempt`, or every attempt).
    pub(crate) fn abort(&mut self, transfer: TransferId, attempt: Option<Attempt>) {
        self.prefill_does(producer::Command::Abort { transfer, attempt });
    }

    /// Prefill's engine preempted `key`.
    pub(crate) fn preempt(&mut self, key: AttemptKey) {
        self.prefill_does(producer::Command::Preempted(key));
    }

    /// Decode's engine cancelled `transfer` (`attempt`, or every attempt).
    pub(crate) fn cancel(&mut self, transfer: TransferId, attempt: Option<Attempt>) {
        self.decode
            .command(consumer::Command::Cancel { transfer, attempt });
        self.settle();
    }

    fn prefill_does(&mut self, command: producer::Command) {
        self.prefill.command(command);
        self.settle();
    }

    /// Moves the virtual clock to `at` after the start, stopping at every moment either side
    /// asked to wake at on the way (its leases, heartbeats, sweeps), as its driver loop would.
    pub(crate) fn at(&mut self, at: Duration) {
        let target = Timestamp::from_nanos(u64::try_from(at.as_nanos()).unwrap_or(u64::MAX));
        loop {
            let now = self.prefill.clock().now();
            let next = [self.prefill.wake_at(), self.decode.wake_at()]
                .into_iter()
                .flatten()
                .filter(|&t| t > now && t < target)
                .min();
            let Some(next) = next else { break };
            self.set_clock(next);
            self.settle();
        }
        self.set_clock(target);
        self.settle();
    }

    fn set_clock(&self, at: Timestamp) {
        let nanos = at.saturating_duration_since(Timestamp::ZERO).as_nanos();
        self.now.store(
            u64::try_from(nanos).unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::SeqCst,
        );
    }

    /// Lets both sides' time pass and hands each what the other sent and what its transport
    /// reported, until nothing moves.
    fn settle(&mut self) {
        loop {
            let now = self.prefill.clock().now();
            self.prefill.tick(now);
            self.decode.tick(now);
            let mut moved = false;
            moved |= self.relay();
            if !self.hold_writes {
                moved |= deliver(&mut self.prefill, Vec::new(), Some);
            }
            let (lose, hold) = (&mut self.notices_to_lose, self.hold_writes);
            let mut held = Vec::new();
            let earlier = if hold {
                Vec::new()
            } else {
                std::mem::take(&mut self.held_notices)
            };
            moved |= deliver(&mut self.decode, earlier, |event| match event {
                Event::Notice(_) if *lose > 0 => {
                    *lose -= 1;
                    None
                }
                Event::Notice(_)
                | Event::ReadDone { .. }
                | Event::Failed {
                    kind: OpKind::Read, ..
                } if hold => {
                    held.push(event);
                    None
                }
                _ => Some(event),
            });
            self.held_notices.extend(held);
            if !moved {
                return;
            }
        }
    }

    /// Hands each side what the other sent; a side that closed the connection closes it for
    /// both, as one socket would. Whether anything moved.
    fn relay(&mut self) -> bool {
        let Some((from_decode, from_prefill, conn)) = &mut self.relay else {
            return false;
        };
        let conn = *conn;
        let mut moved = false;
        let mut closed = None;
        loop {
            match relayed(from_decode) {
                Relayed::Message(m) => {
                    let queued = Queued::unbounded();
                    self.prefill
                        .command(producer::Command::Peer(conn, m, queued));
                    moved = true;
                }
                Relayed::Nothing => break,
                Relayed::Closed(why) => {
                    closed = Some(why);
                    break;
                }
            }
        }
        let decode_conn = self.decode.conn_of(PREFILL, Rank(0));
        while closed.is_none() {
            match relayed(from_prefill) {
                Relayed::Message(m) => {
                    let decode_conn = decode_conn.expect("connected");
                    let queued = Queued::unbounded();
                    let peer = consumer::Command::Peer(PREFILL, Rank(0), decode_conn, m, queued);
                    self.decode.command(peer);
                    moved = true;
                }
                Relayed::Nothing => break,
                Relayed::Closed(why) => closed = Some(why),
            }
        }
        if let Some(why) = closed {
            self.relay = None;
            self.prefill
                .command(producer::Command::PeerClosed(conn, why.clone()));
            if let Some(decode_conn) = decode_conn {
                let gone = consumer::Command::PeerClosed(PREFILL, Rank(0), decode_conn, why);
                self.decode.command(gone);
            }
            moved = true;
        }
        moved
    }

    /// Prefill's engine hears what it may free now.
    pub(crate) fn finished(&self) -> Vec<FinishedSending> {
        self.finished.take().into_iter().map(|(f, _)| f).collect()
    }

    /// Decode's engine hears what became of its requests.
    pub(crate) fn events(&self) -> Vec<RecvEvent> {
        self.events
            .events
            .take()
            .into_iter()
            .map(|(e, _)| e)
            .collect()
    }

    /// Whether a write of decode's request `key` is in flight at prefill, or a read of it at
    /// decode.
    pub(crate) fn in_flight(&self, key: AttemptKey) -> bool {
        self.prefill.writing(key) || self.decode.reading(key)
    }

    /// Requests whose blocks prefill holds.
    pub(crate) fn prefill_held(&self) -> i64 {
        self.prefill_stats.snapshot().held
    }

    /// Requests whose registrations decode holds.
    pub(crate) fn decode_held(&self) -> i64 {
        self.decode_stats.snapshot().held
    }

    /// Prefill's counters.
    pub(crate) fn prefill_stats(&self) -> crate::StatsSnapshot {
        self.prefill_stats.snapshot()
    }

    /// Decode's counters.
    pub(crate) fn decode_stats(&self) -> crate::StatsSnapshot {
        self.decode_stats.snapshot()
    }

    /// Fills prefill's `blocks` (every layer's K and V) with bytes that `salt` and each byte's
    /// place choose.
    pub(crate) fn fill(&self, blocks: &[BlockId], salt: u8) {
        for_each_block(
            blocks,
            0..u64::MAX,
            0..spec().num_layers,
            |region, range| {
                // A byte of a hash of its place and the salt: no two blocks alike.
                let bytes: Vec<u8> = range
                    .clone()
                    .map(|i| {
                        let x =
                            (i as u64 ^ u64::from(salt) << 40).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                        (x >> 56) as u8
                    })
                    .collect();
                self.prefill_memory[region]
                    .write_at(range.start, &bytes)
                    .expect("within the cache");
            },
        );
    }

    /// Whether decode's `landing` blocks hold what prefill's `blocks` hold, block for block,
    /// in the request's first `tokens` tokens.
    pub(crate) fn landed(&self, blocks: &[BlockId], landing: &[BlockId], tokens: u64) -> bool {
        let layers = Layout::new(spec())
            .expect("a valid layout")
            .spec()
            .num_layers;
        self.landed_in(blocks, landing, 0..tokens, 0..layers)
    }

    /// [`Pair::landed`] for the request's `tokens` in `layers` only.
    pub(crate) fn landed_in(
        &self,
        blocks: &[BlockId],
        landing: &[BlockId],
        tokens: Range<u64>,
        layers: Range<u32>,
    ) -> bool {
        let read = |memory: &[Arc<HostBuffer>], of: &[BlockId]| {
            let mut bytes = Vec::new();
            for_each_block(of, tokens.clone(), layers.clone(), |region, range| {
                let mut chunk = vec![0; range.len()];
                memory[region]
                    .read_at(range.start, &mut chunk)
                    .expect("within the cache");
                bytes.push(chunk);
            });
            bytes
        };
        blocks.len() == landing.len()
            && read(&self.prefill_memory, blocks) == read(&self.decode_memory, landing)
    }
}

/// What one end of the relay holds now.
enum Relayed {
    Message(Message),
    Nothing,
    /// The side at the other end closed the connection (or sent what is no message).
    Closed(String),
}

fn relayed(stream: &mut UnixStream) -> Relayed {
    stream.set_nonblocking(true).expect("a socket");
    let read = control::read_message(stream);
    stream.set_nonblocking(false).expect("a socket");
    match read {
        Ok(message) => Relayed::Message(message),
        Err(ControlError::Read(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {
            Relayed::Nothing
        }
        Err(e) => Relayed::Closed(e.to_string()),
    }
}

/// Calls `f` with the bytes of `tokens` in `blocks` (the request's blocks in order) in every
/// layer of `layers`, K and V: region index and byte range, one range per block and chunk.
/// [`spec`]'s memory order is NHD: a block's tokens lie one after the other.
fn for_each_block(
    blocks: &[BlockId],
    tokens: Range<u64>,
    layers: Range<u32>,
    mut f: impl FnMut(usize, Range<usize>),
) {
    let layout = Layout::new(spec()).expect("a valid layout");
    let stride = layout.block_stride();
    let block_tokens = u64::from(layout.spec().block_tokens);
    let token_bytes = stride / block_tokens;
    for layer in layers {
        for kv in 0..layout.kv_parts() {
            let place = layout.chunk_place(layer, kv);
            for (i, &block) in (0u64..).zip(blocks) {
                let first = i * block_tokens;
                let from = tokens.start.clamp(first, first + block_tokens) - first;
                let to = tokens.end.clamp(first, first + block_tokens) - first;
                let start = place.base + u64::from(block.0) * stride;
                let range = start + from * token_bytes..start + to * token_bytes;
                f(
                    place.region as usize,
                    range.start as usize..range.end as usize,
                );
            }
        }
    }
}

/// Hands `driver` `earlier` events, then those its transport reported, each as `route` passes it
/// on (`None`: kept from it); whether any came.
fn deliver(
    driver: &mut impl Driven,
    mut events: Vec<Event>,
    mut route: impl FnMut(Event) -> Option<Event>,
) -> bool {
    driver
        .transport()
        .expect("open")
        .poll(&mut events)
        .expect("a loopback poll");
    let came = !events.is_empty();
    for event in events.into_iter().filter_map(&mut route) {
        driver.transport_event(event);
    }
    came
}

#[cfg(test)]
mod tests {
    use kvx_rendezvous::Reason;

    use super::*;
    use crate::producer::SendOutcome;
    use crate::sim_support::{ids, key};

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    /// Asserts that decode's engine heard exactly that `key` failed for `reason`, and returns
    /// the failure's detail.
    fn expect_failed(pair: &Pair, key: AttemptKey, reason: Reason) -> String {
        match &pair.events()[..] {
            [RecvEvent::Failed {
                key: failed,
                reason: r,
                detail,
                ..
            }] if *failed == key && *r == reason => detail.clone(),
            other => panic!("expected {key} to fail for {reason:?}, got {other:?}"),
        }
    }

    /// Asserts that decode's engine heard exactly that `key` is ready.
    fn expect_ready(pair: &Pair, key: AttemptKey) {
        assert_eq!(
            pair.events(),
            vec![RecvEvent::Ready {
                key,
                request: DECODE_REQUEST
            }]
        );
    }

    /// Asserts that prefill's engine heard exactly that `key`'s blocks are free, with `outcome`.
    fn expect_given_back(pair: &Pair, key: AttemptKey, outcome: SendOutcome) {
        assert_eq!(
            pair.finished(),
            vec![FinishedSending {
                request: PREFILL_REQUEST,
                key,
                outcome
            }]
        );
    }

    /// A registration that prefill never serves fails at its lease, to the nanosecond; a finish
    /// that comes for it afterwards is given back at once, unsent.
    #[test]
    fn a_registration_prefill_never_serves_fails_at_its_lease_and_a_late_finish_goes_back_at_once()
    {
        let mut pair = Pair::new(ms(300));
        pair.register(key(1), 8, ids(0..2));
        pair.at(ms(300) - Duration::from_nanos(1));
        assert_eq!(pair.events(), vec![]);
        pair.at(ms(300));
        expect_failed(&pair, key(1), Reason::LeaseExpired);
        assert_eq!(pair.decode_held(), 0);
        pair.finish(key(1), 8, ids(0..2));
        assert!(matches!(
            &pair.finished()[..],
            [FinishedSending { key: k, outcome: SendOutcome::NotSent(_), .. }] if *k == key(1)
        ));
        assert_eq!(pair.prefill_held(), 0);
    }

    /// Prefill's engine aborts a transfer decode waits for: decode fails it at once.
    #[test]
    fn prefills_abort_fails_the_waiting_request_at_once() {
        let mut pair = Pair::new(Duration::from_secs(60));
        pair.register(key(3), 8, ids(0..2));
        pair.at(ms(50));
        pair.abort(TransferId(3), None);
        expect_failed(&pair, key(3), Reason::Aborted);
        assert_eq!(pair.decode_held(), 0);
    }

    /// Decode's engine cancels a registered request: it fails once prefill confirmed it writes
    /// nothing more (at once here, not at the quiesce bound), and prefill gives the blocks of
    /// its later finish back unsent.
    #[test]
    fn decodes_cancel_fails_once_prefill_confirms_and_prefill_gives_the_blocks_back() {
        let mut pair = Pair::new(Duration::from_secs(60));
        pair.register(key(4), 8, ids(0..2));
        pair.at(ms(50));
        pair.cancel(TransferId(4), None);
        let detail = expect_failed(&pair, key(4), Reason::Aborted);
        assert!(!detail.contains("without confirmation"), "{detail}");
        assert_eq!(pair.decode_stats().released_unconfirmed, 0);
        pair.at(ms(100));
        pair.finish(key(4), 8, ids(0..2));
        expect_given_back(&pair, key(4), SendOutcome::NotSent(Reason::Aborted));
        assert_eq!(pair.prefill_held(), 0);
    }

    /// Decode cancels while prefill's write is in flight: its engine hears of it only once
    /// prefill says the write ended (it may land until then), however long that takes within
    /// the quiesce bound; prefill holds the blocks until then too.
    #[test]
    fn a_cancel_under_a_write_in_flight_fails_only_once_the_write_ended() {
        let mut pair = Pair::configured(
            |_| {},
            |decode| {
                decode.registration_lease = Duration::from_secs(600);
                decode.quiesce_timeout = Some(Duration::from_secs(600));
            },
        );
        let k = key(101);
        pair.fill(&ids(5..8), 1);
        pair.register(k, 12, ids(0..3));
        pair.hold_writes = true;
        pair.finish(k, 12, ids(5..8));
        assert_eq!(pair.prefill_held(), 1);
        pair.cancel(k.transfer, Some(k.attempt));
        pair.at(Duration::from_secs(300));
        assert_eq!(pair.events(), vec![], "failed with a write in flight");
        assert_eq!(pair.finished(), vec![]);
        assert_eq!(pair.prefill_held(), 1, "blocks released under a write");
        pair.hold_writes = false;
        pair.at(Duration::from_secs(301));
        expect_failed(&pair, k, Reason::Aborted);
        assert!(matches!(
            &pair.finished()[..],
            [FinishedSending {
                outcome: SendOutcome::NotSent(_),
                ..
            }]
        ));
        assert_eq!((pair.prefill_held(), pair.decode_held()), (0, 0));
    }

    /// Decode cancels while prefill's write of a sealed request is in flight: it fails once
    /// prefill says the write ended, as for a finished request; the engine's finish later gives
    /// the blocks back.
    #[test]
    fn a_cancel_under_a_sealed_requests_write_fails_once_the_write_ended() {
        let mut pair = Pair::configured(
            |_| {},
            |decode| decode.quiesce_timeout = Some(Duration::from_secs(600)),
        );
        let k = key(103);
        pair.fill(&ids(5..7), 18);
        pair.register(k, 8, ids(0..2));
        pair.hold_writes = true;
        pair.seal(k, 8, ids(5..7));
        pair.cancel(k.transfer, Some(k.attempt));
        pair.at(Duration::from_secs(1));
        assert_eq!(pair.events(), vec![], "failed with a write in flight");
        pair.hold_writes = false;
        pair.at(Duration::from_secs(2));
        expect_failed(&pair, k, Reason::Aborted);
        assert_eq!(pair.decode_held(), 0);
        pair.finish(k, 8, ids(5..7));
        assert!(matches!(&pair.finished()[..], [FinishedSending { key: done, .. }] if *done == k));
        assert_eq!(pair.prefill_held(), 0);
    }

    /// Decode gives up on a request (its lease) in the very turn in which prefill's write of
    /// it ends (finished or sealed, its notice lost): prefill, which heard the abort first,
    /// tells decode that nothing runs any more once the write's end comes, and decode fails the
    /// request then, not at its bound for prefill's word.
    #[test]
    fn an_abort_in_the_turn_a_write_ends_is_answered_once_the_write_ended() {
        for seal in [true, false] {
            let mut pair = Pair::configured(
                |_| {},
                |decode| {
                    decode.quiesce_timeout = Some(Duration::from_secs(600));
                    decode.registration_lease = Duration::from_secs(2);
                },
            );
            let k = key(104);
            pair.fill(&ids(5..7), 18);
            pair.register(k, 8, ids(0..2));
            pair.hold_writes = true;
            if seal {
                pair.seal(k, 8, ids(5..7));
            } else {
                pair.finish(k, 8, ids(5..7));
            }
            pair.at(Duration::from_secs(1));
            // At the lease, the write's end (its notice lost) and decode's abort meet.
            pair.hold_writes = false;
            pair.notices_to_lose = 1;
            pair.at(Duration::from_secs(2));
            assert_eq!(pair.notices_to_lose, 0);
            let detail = expect_failed(&pair, k, Reason::LeaseExpired);
            assert!(
                !detail.contains("without confirmation"),
                "seal {seal}: {detail}"
            );
            assert_eq!(pair.decode_stats().released_unconfirmed, 0);
            assert_eq!(pair.decode_held(), 0);
        }
    }

    /// Prefill's engine preempts an attempt: decode's wait for it fails at once, a finish for it
    /// goes back unsent, and the request's next attempt is served.
    #[test]
    fn a_prefill_preempted_at_an_attempt_fails_it_and_serves_the_next() {
        let mut pair = Pair::new(Duration::from_secs(60));
        let first = key(102);
        pair.register(first, 8, ids(0..2));
        pair.at(ms(100));
        pair.preempt(first);
        expect_failed(&pair, first, Reason::Preempted);
        assert_eq!(pair.decode_held(), 0);
        pair.finish(first, 8, ids(2..4));
        assert!(matches!(
            &pair.finished()[..],
            [FinishedSending {
                outcome: SendOutcome::NotSent(_),
                ..
            }]
        ));
        let second = AttemptKey::new(first.transfer, first.attempt.next());
        pair.fill(&ids(0..2), 2);
        pair.register(second, 8, ids(4..6));
        pair.finish(second, 8, ids(0..2));
        expect_ready(&pair, second);
        assert!(pair.landed(&ids(0..2), &ids(4..6), 8));
        assert!(
            !pair.landed(&ids(0..2), &ids(0..2), 8),
            "the preempted attempt's blocks were written"
        );
        expect_given_back(&pair, second, SendOutcome::Sent);
        assert_eq!(pair.prefill_held(), 0);
    }

    /// Decode re-registers a request at a newer attempt (its engine preempted and rescheduled
    /// it): the older wait fails as superseded, and prefill's finish of the newer lands.
    #[test]
    fn a_preempted_request_registers_again_at_a_newer_attempt_and_lands() {
        let mut pair = Pair::new(Duration::from_secs(60));
        let first = key(6);
        let second = AttemptKey::new(first.transfer, first.attempt.next());
        pair.fill(&ids(0..3), 3);
        pair.register(first, 12, ids(5..8));
        pair.at(ms(30));
        pair.register(second, 12, ids(8..11));
        expect_failed(&pair, first, Reason::Superseded);
        pair.finish(second, 12, ids(0..3));
        expect_ready(&pair, second);
        assert!(pair.landed(&ids(0..3), &ids(8..11), 12));
    }

    /// Prefill wrote and gave its blocks back, but the notice never reached decode: the
    /// request fails at its lease (not later: prefill, holding nothing of it, answers decode's
    /// abort at once), and nothing stays held on either side.
    #[test]
    fn a_lost_notice_fails_the_request_at_its_lease_and_nothing_stays_held() {
        let mut pair = Pair::new(ms(500));
        pair.notices_to_lose = 1;
        let k = key(97);
        pair.fill(&ids(0..2), 4);
        pair.register(k, 8, ids(4..6));
        pair.finish(k, 8, ids(0..2));
        expect_given_back(&pair, k, SendOutcome::Sent);
        assert_eq!(pair.notices_to_lose, 0, "the notice was not lost");
        pair.at(ms(499));
        assert_eq!(pair.events(), vec![]);
        pair.at(ms(500));
        let detail = expect_failed(&pair, k, Reason::LeaseExpired);
        assert!(!detail.contains("without confirmation"), "{detail}");
        assert_eq!(pair.decode_stats().released_unconfirmed, 0);
        assert_eq!((pair.prefill_held(), pair.decode_held()), (0, 0));
    }

    /// A sealed request written in full whose notice was lost: decode fails it at its lease, at
    /// once (prefill, whose write ended, says so), not at its bound for prefill's word; the
    /// engine's finish then gives the blocks back.
    #[test]
    fn a_sealed_requests_lost_notice_fails_it_at_its_lease_at_once() {
        let mut pair = Pair::configured(
            |_| {},
            |decode| {
                decode.registration_lease = ms(500);
                decode.quiesce_timeout = Some(Duration::from_secs(600));
            },
        );
        pair.cancel(TransferId(36), None);
        pair.notices_to_lose = 1;
        let k = key(36);
        pair.fill(&ids(0..2), 17);
        pair.seal(k, 8, ids(0..2));
        pair.register(k, 8, ids(4..6));
        assert_eq!(pair.notices_to_lose, 0, "the notice was not lost");
        pair.at(Duration::from_secs(600));
        let detail = expect_failed(&pair, k, Reason::LeaseExpired);
        assert!(!detail.contains("without confirmation"), "{detail}");
        assert_eq!(pair.decode_held(), 0);
        pair.finish(k, 8, ids(0..2));
        expect_given_back(&pair, k, SendOutcome::Sent);
        assert_eq!(pair.prefill_held(), 0);
    }

    /// A sealed request is written, and decode told, without waiting for the engine to finish
    /// it (registration first or seal first); its blocks go back only once the engine has
    /// finished it, at once then, and the finish writes nothing more.
    #[test]
    fn a_sealed_request_lands_before_it_finishes() {
        for registration_first in [true, false] {
            let mut pair = Pair::new(Duration::from_secs(60));
            let k = key(30);
            pair.fill(&ids(0..5), 5);
            if registration_first {
                pair.register(k, 19, ids(8..13));
                pair.seal(k, 19, ids(0..5));
            } else {
                pair.seal(k, 19, ids(0..5));
                pair.at(ms(20));
                pair.register(k, 19, ids(8..13));
            }
            expect_ready(&pair, k);
            assert!(pair.landed(&ids(0..5), &ids(8..13), 19));
            pair.at(Duration::from_secs(30));
            assert_eq!(pair.finished(), vec![], "given back before the finish");
            assert_eq!(pair.prefill_stats().transfers_ok, 1);
            pair.finish(k, 19, ids(0..5));
            expect_given_back(&pair, k, SendOutcome::Sent);
            assert_eq!(pair.prefill_held(), 0);
            assert_eq!(pair.prefill_stats().transfers_started, 1);
        }
    }

    /// A request finished after its seal but before decode registered is written when the
    /// registration comes, and given back then.
    #[test]
    fn a_sealed_request_finished_before_its_registration_is_given_back_when_written() {
        let mut pair = Pair::new(Duration::from_secs(60));
        let k = key(31);
        pair.fill(&ids(0..3), 6);
        pair.seal(k, 12, ids(0..3));
        pair.finish(k, 12, ids(0..3));
        pair.at(Duration::from_secs(10));
        assert_eq!(pair.finished(), vec![]);
        pair.register(k, 12, ids(8..11));
        expect_ready(&pair, k);
        assert!(pair.landed(&ids(0..3), &ids(8..11), 12));
        expect_given_back(&pair, k, SendOutcome::Sent);
        assert_eq!(pair.prefill_stats().transfers_started, 1);
    }

    /// The engine aborts a sealed request (it frees the blocks itself): nothing is given back,
    /// whether its transfer ended before or nobody registered yet, and a registration that
    /// comes later fails.
    #[test]
    fn a_sealed_request_the_engine_aborts_is_never_given_back() {
        let mut pair = Pair::new(Duration::from_secs(60));
        let delivered = key(33);
        pair.fill(&ids(0..2), 7);
        pair.register(delivered, 8, ids(8..10));
        pair.seal(delivered, 8, ids(0..2));
        expect_ready(&pair, delivered);
        pair.abort(delivered.transfer, None);
        let late = key(34);
        pair.seal(late, 8, ids(2..4));
        pair.abort(late.transfer, None);
        pair.at(Duration::from_secs(30));
        assert_eq!(pair.finished(), vec![]);
        assert_eq!(pair.prefill_held(), 0);
        pair.register(late, 8, ids(12..14));
        expect_failed(&pair, late, Reason::Aborted);
        pair.at(Duration::from_secs(60));
        assert_eq!(pair.finished(), vec![]);
    }

    /// A seal after the request finished, or a second seal, changes nothing.
    #[test]
    fn a_second_seal_is_ignored() {
        let mut pair = Pair::new(Duration::from_secs(60));
        let k = key(35);
        pair.fill(&ids(0..2), 8);
        pair.seal(k, 8, ids(0..2));
        pair.seal(k, 8, ids(0..2));
        pair.finish(k, 8, ids(0..2));
        pair.seal(k, 8, ids(0..2));
        pair.register(k, 8, ids(8..10));
        expect_ready(&pair, k);
        assert!(pair.landed(&ids(0..2), &ids(8..10), 8));
        expect_given_back(&pair, k, SendOutcome::Sent);
        assert_eq!(pair.prefill_stats().transfers_started, 1);
        assert_eq!(pair.prefill_held(), 0);
    }

    /// Requests that all came over one connection and all ended are forgotten: prefill
    /// remembers at most the 64 it keeps before it next forgets, not the whole history.
    #[test]
    fn a_long_lived_connection_forgets_the_registrations_that_ended() {
        let mut pair = Pair::new(Duration::from_secs(60));
        pair.fill(&ids(10..12), 9);
        for t in 0..200 {
            let k = key(1000 + t);
            pair.register(k, 8, ids(4..6));
            pair.finish(k, 8, ids(10..12));
            expect_ready(&pair, k);
            expect_given_back(&pair, k, SendOutcome::Sent);
        }
        assert!(pair.landed(&ids(10..12), &ids(4..6), 8));
        let remembered = pair.prefill_stats().remembered_registrations;
        assert!(remembered <= 64, "{remembered} registrations remembered");
    }

    /// The bytes of `tokens` tokens of every layer's K and V.
    fn request_bytes(tokens: u64) -> u64 {
        let layout = Layout::new(spec()).expect("a valid layout");
        let token_bytes = layout.block_stride() / u64::from(layout.spec().block_tokens);
        tokens * token_bytes * u64::from(layout.kv_parts() * layout.spec().num_layers)
    }

    /// Layer-wise progress that goes back (fewer tokens in fewer layers: the engine computes
    /// again) writes nothing more early, even once it is back where it was; the finish then
    /// writes the whole request again, and decode gets every byte.
    #[test]
    fn layer_progress_going_back_is_rewritten_at_the_finish() {
        let mut pair = Pair::new(Duration::from_secs(60));
        pair.fill(&ids(0..4), 10);
        let k = key(14);
        pair.register(k, 16, ids(8..12));
        pair.progress(k, ids(0..4), 16, Some(1));
        // Whole blocks of both sides, never the last token.
        assert!(pair.landed_in(&ids(0..4), &ids(8..12), 0..12, 0..1));
        assert!(!pair.landed_in(&ids(0..4), &ids(8..12), 0..12, 1..2));
        let streamed = pair.prefill_stats().bytes_streamed;
        assert_eq!(streamed, request_bytes(12) / 2);
        pair.progress(k, ids(0..2), 8, Some(0));
        pair.progress(k, ids(0..4), 16, Some(1));
        pair.finish(k, 16, ids(0..4));
        expect_ready(&pair, k);
        assert!(pair.landed(&ids(0..4), &ids(8..12), 16));
        let stats = pair.prefill_stats();
        assert_eq!(
            stats.bytes_streamed, streamed,
            "no early write after going back"
        );
        assert_eq!(
            stats.bytes_written,
            streamed + request_bytes(16),
            "the finish rewrote everything"
        );
    }

    /// A preemption (progress without blocks) after layer-wise progress forgets what was
    /// final: decode registering only afterwards gets the resumed request's KV from its new
    /// blocks, written early as it computes again, and every byte is right.
    #[test]
    fn preemption_after_layer_progress_starts_over_for_a_later_registration() {
        let mut pair = Pair::new(Duration::from_secs(60));
        // The old blocks never hold the request's KV; the new ones do.
        pair.fill(&ids(0..4), 11);
        pair.fill(&ids(10..14), 12);
        let k = key(15);
        pair.progress(k, ids(0..4), 16, Some(1));
        pair.progress(k, Vec::new(), 0, None);
        pair.register(k, 16, ids(4..8));
        pair.at(ms(50));
        assert_eq!(
            pair.prefill_stats().bytes_streamed,
            0,
            "nothing is final after the preemption"
        );
        pair.progress(k, ids(10..14), 16, Some(1));
        assert!(pair.landed_in(&ids(10..14), &ids(4..8), 0..12, 0..1));
        pair.finish(k, 16, ids(10..14));
        expect_ready(&pair, k);
        assert!(pair.landed(&ids(10..14), &ids(4..8), 16));
        expect_given_back(&pair, k, SendOutcome::Sent);
    }

    /// An abort while early writes have landed fails decode's request; the later finish goes
    /// back unsent.
    #[test]
    fn abort_after_early_writes_fails_the_consumer_and_releases_the_finish() {
        let mut pair = Pair::new(Duration::from_secs(60));
        let k = key(8);
        pair.fill(&ids(0..4), 13);
        pair.register(k, 16, ids(8..12));
        pair.at(ms(50));
        pair.progress(k, ids(0..3), 12, None);
        assert!(pair.landed(&ids(0..3), &ids(8..11), 12));
        pair.abort(k.transfer, None);
        expect_failed(&pair, k, Reason::Aborted);
        pair.finish(k, 16, ids(0..4));
        expect_given_back(&pair, k, SendOutcome::NotSent(Reason::Aborted));
        assert_eq!(pair.prefill_held(), 0);
    }

    /// Progress naming blocks outside prefill's cache fails decode's request at once (not at
    /// the end of its lease), and the finish goes back unsent.
    #[test]
    fn bad_progress_fails_the_consumer_at_once() {
        let mut pair = Pair::new(Duration::from_secs(60));
        let k = key(6);
        pair.register(k, 16, ids(8..12));
        pair.at(ms(50));
        pair.progress(k, vec![BlockId(1), BlockId(9999)], 8, None);
        expect_failed(&pair, k, Reason::TransferFailed);
        pair.finish(k, 16, ids(0..4));
        assert!(matches!(
            &pair.finished()[..],
            [FinishedSending {
                outcome: SendOutcome::NotSent(_),
                ..
            }]
        ));
        assert_eq!(pair.prefill_held(), 0);
    }

    /// The engine computed a request again in other blocks (a preemption) after some of it was
    /// written early from the old ones: the finish rewrites everything from the new blocks.
    #[test]
    fn changed_blocks_after_early_writes_are_rewritten_at_the_finish() {
        let mut pair = Pair::new(Duration::from_secs(60));
        // The old blocks hold stale bytes; the new ones the request's KV.
        pair.fill(&ids(0..4), 14);
        pair.fill(&ids(10..14), 15);
        let k = key(12);
        pair.register(k, 16, ids(4..8));
        pair.at(ms(50));
        pair.progress(k, ids(0..3), 12, None);
        assert!(pair.prefill_stats().bytes_streamed > 0, "no early write");
        pair.progress(k, ids(10..12), 8, None);
        pair.finish(k, 16, ids(10..14));
        expect_ready(&pair, k);
        assert!(pair.landed(&ids(10..14), &ids(4..8), 16));
        expect_given_back(&pair, k, SendOutcome::Sent);
    }

    /// A second wait for the same attempt is refused, and the refusal reaches neither prefill
    /// nor the first wait, which lands.
    #[test]
    fn a_second_wait_for_the_same_attempt_is_refused_and_the_first_still_lands() {
        let mut pair = Pair::new(Duration::from_secs(60));
        let k = key(8);
        pair.fill(&ids(0..3), 16);
        pair.register_as(k, RequestId(1), 12, ids(4..7));
        pair.register_as(k, RequestId(2), 12, ids(8..11));
        assert!(
            matches!(
                &pair.events()[..],
                [RecvEvent::Failed {
                    request: RequestId(2),
                    reason: Reason::Duplicate,
                    ..
                }]
            ),
            "the second wait was not refused"
        );
        pair.finish(k, 12, ids(0..3));
        assert_eq!(
            pair.events(),
            vec![RecvEvent::Ready {
                key: k,
                request: RequestId(1)
            }]
        );
        assert!(pair.landed(&ids(0..3), &ids(4..7), 12));
        assert!(!pair.landed(&ids(0..3), &ids(8..11), 12));
    }
}

/// Random interleavings of everything both engines, both peers and the clock can do to a few
/// transfers, checked against what must hold whatever the order.
#[cfg(test)]
mod interleavings {
    use std::collections::{HashMap, HashSet};

    use proptest::prelude::*;

    use super::*;
    use crate::producer::SendOutcome;
    use crate::sim_support::ids;

    /// Transfers 1 to 3, attempts 0 and 1; every request is 8 tokens (2 blocks). Transfer 3
    /// moves by pull, the others by push.
    const TOKENS: u64 = 8;
    const LEASE: Duration = Duration::from_secs(2);
    const PULLED: u8 = 3;
    /// Prefill blocks no request ends in.
    const STALE: [BlockId; 2] = [BlockId(12), BlockId(13)];

    #[derive(Clone, Copy, Debug)]
    enum Step {
        Register {
            transfer: u8,
            attempt: u8,
        },
        /// Prefill computed `tokens` in `layers`; `elsewhere`: in blocks it later leaves (the
        /// engine computes the request again in its own blocks before it finishes).
        Progress {
            transfer: u8,
            attempt: u8,
            tokens: u8,
            layers: Option<u8>,
            elsewhere: bool,
        },
        Seal {
            transfer: u8,
            attempt: u8,
        },
        Finish {
            transfer: u8,
            attempt: u8,
        },
        Abort {
            transfer: u8,
        },
        Preempt {
            transfer: u8,
            attempt: u8,
        },
        Cancel {
            transfer: u8,
        },
        Wait {
            ms: u16,
        },
        HoldWrites(bool),
        LoseNotice,
    }

    fn step() -> impl Strategy<Value = Step> {
        let t = 1u8..=3;
        // Mostly the first attempt, so that registrations and finishes meet.
        let a = prop_oneof![3 => Just(0u8), 1 => Just(1u8)];
        prop_oneof![
            3 => (t.clone(), a.clone()).prop_map(|(transfer, attempt)| Step::Register { transfer, attempt }),
            2 => (t.clone(), a.clone(), 1u8..=2, proptest::option::of(0u8..=2), any::<bool>())
                .prop_map(|(transfer, attempt, blocks, layers, elsewhere)| Step::Progress {
                    transfer,
                    attempt,
                    tokens: blocks * 4,
                    layers,
                    elsewhere,
                }),
            1 => (t.clone(), a.clone()).prop_map(|(transfer, attempt)| Step::Seal { transfer, attempt }),
            3 => (t.clone(), a.clone()).prop_map(|(transfer, attempt)| Step::Finish { transfer, attempt }),
            1 => t.clone().prop_map(|transfer| Step::Abort { transfer }),
            1 => (t.clone(), a).prop_map(|(transfer, attempt)| Step::Preempt { transfer, attempt }),
            1 => t.prop_map(|transfer| Step::Cancel { transfer }),
            3 => (0u16..3000).prop_map(|ms| Step::Wait { ms }),
            1 => any::<bool>().prop_map(Step::HoldWrites),
            1 => Just(Step::LoseNotice),
        ]
    }

    fn key_of(transfer: u8, attempt: u8) -> AttemptKey {
        let mut a = Attempt::FIRST;
        for _ in 0..attempt {
            a = a.next();
        }
        AttemptKey::new(TransferId(u128::from(transfer)), a)
    }

    /// Prefill computes transfer `t` into blocks `2(t-1)..`.
    fn prefill_blocks(transfer: u8) -> Vec<BlockId> {
        let first = u32::from(transfer - 1) * 2;
        ids(first..first + 2)
    }

    /// Decode lands attempt `a` of transfer `t` in blocks of its own.
    fn decode_blocks(key: AttemptKey) -> Vec<BlockId> {
        let t = u32::try_from(key.transfer.0).expect("small") - 1;
        let a = u32::from(key.attempt != Attempt::FIRST);
        let first = (t * 2 + a) * 2;
        ids(first..first + 2)
    }

    /// What the test saw, to check against.
    #[derive(Default)]
    struct Seen {
        registered: HashSet<AttemptKey>,
        /// Decode's end of each request, as many as came.
        ends: HashMap<AttemptKey, Vec<RecvEvent>>,
        /// Prefill's computed (progress or seal), and finished, requests.
        computed: HashSet<AttemptKey>,
        finished: HashSet<AttemptKey>,
        given_back: HashMap<AttemptKey, Vec<SendOutcome>>,
    }

    impl Seen {
        /// Reads what both engines heard, checking each Ready's bytes as it comes.
        fn collect(&mut self, pair: &Pair) {
            for event in pair.events() {
                let key = match &event {
                    RecvEvent::Ready { key, .. } => {
                        assert!(
                            self.computed.contains(key) || self.finished.contains(key),
                            "{key} ready, but prefill never computed it"
                        );
                        let from = prefill_blocks(u8::try_from(key.transfer.0).expect("small"));
                        assert!(
                            pair.landed(&from, &decode_blocks(*key), TOKENS),
                            "{key} ready, but its KV is not all there"
                        );
                        *key
                    }
                    RecvEvent::Failed { key, .. } => *key,
                };
                assert!(
                    self.registered.contains(&key),
                    "an end for {key}, never registered"
                );
                // Decode's engine may reuse the blocks at once: nothing may still write there
                // (decode's bound for prefill's word is longer than the test).
                assert!(
                    !pair.in_flight(key),
                    "{key} ended with a transfer of it in flight: {event:?}"
                );
                self.ends.entry(key).or_default().push(event);
            }
            for done in pair.finished() {
                assert!(
                    self.finished.contains(&done.key),
                    "{} given back, but never finished",
                    done.key
                );
                self.given_back
                    .entry(done.key)
                    .or_default()
                    .push(done.outcome);
            }
        }
    }

    fn run(steps: &[Step]) {
        let mut pair = Pair::configured(
            |_| {},
            |decode| {
                decode.registration_lease = LEASE;
                decode.quiesce_timeout = Some(Duration::from_secs(3600));
            },
        );
        for t in 1..=3 {
            pair.fill(&prefill_blocks(t), t);
        }
        pair.fill(&STALE, 99);
        let mut seen = Seen::default();
        let mut now = Duration::ZERO;
        for &step in steps {
            match step {
                Step::Register { transfer, attempt } => {
                    let key = key_of(transfer, attempt);
                    if seen.registered.insert(key) {
                        if transfer == PULLED {
                            let from = prefill_blocks(transfer);
                            pair.pull(key, TOKENS, decode_blocks(key), from);
                        } else {
                            pair.register(key, TOKENS, decode_blocks(key));
                        }
                    }
                }
                Step::Progress {
                    transfer,
                    attempt,
                    tokens,
                    layers,
                    elsewhere,
                } => {
                    let key = key_of(transfer, attempt);
                    if transfer != PULLED && !seen.finished.contains(&key) {
                        let blocks = if elsewhere {
                            STALE.to_vec()
                        } else {
                            prefill_blocks(transfer)
                        };
                        let blocks = blocks[..usize::from(tokens / 4)].to_vec();
                        pair.progress(key, blocks, u64::from(tokens), layers.map(u32::from));
                    }
                }
                Step::Seal { transfer, attempt } => {
                    let key = key_of(transfer, attempt);
                    if transfer != PULLED && !seen.finished.contains(&key) {
                        seen.computed.insert(key);
                        pair.seal(key, TOKENS, prefill_blocks(transfer));
                    }
                }
                Step::Finish { transfer, attempt } => {
                    let key = key_of(transfer, attempt);
                    if seen.finished.insert(key) {
                        if transfer == PULLED {
                            pair.finish_pull(key, TOKENS, prefill_blocks(transfer));
                        } else {
                            pair.finish(key, TOKENS, prefill_blocks(transfer));
                        }
                    }
                }
                Step::Abort { transfer } => {
                    pair.abort(TransferId(u128::from(transfer)), None);
                }
                Step::Preempt { transfer, attempt } => {
                    let key = key_of(transfer, attempt);
                    if !seen.finished.contains(&key) {
                        pair.preempt(key);
                    }
                }
                Step::Cancel { transfer } => {
                    pair.cancel(TransferId(u128::from(transfer)), None);
                }
                Step::Wait { ms } => {
                    now += Duration::from_millis(u64::from(ms));
                    pair.at(now);
                }
                Step::HoldWrites(hold) => {
                    pair.hold_writes = hold;
                    pair.at(now);
                }
                Step::LoseNotice => pair.notices_to_lose += 1,
            }
            seen.collect(&pair);
        }
        // The writes end, every request prefill computed is finished, and every bound passes.
        pair.hold_writes = false;
        now += Duration::from_secs(600);
        pair.at(now);
        seen.collect(&pair);
        for key in seen.computed.clone() {
            if seen.finished.insert(key) {
                let transfer = u8::try_from(key.transfer.0).expect("small");
                pair.finish(key, TOKENS, prefill_blocks(transfer));
            }
        }
        now += Duration::from_secs(600);
        pair.at(now);
        seen.collect(&pair);

        for key in &seen.registered {
            let ends = seen.ends.get(key).map_or(0, Vec::len);
            assert_eq!(
                ends,
                1,
                "{key} ended {ends} times: {:?}",
                seen.ends.get(key)
            );
        }
        for key in &seen.finished {
            let back = seen.given_back.get(key).map_or(0, Vec::len);
            assert_eq!(
                back,
                1,
                "{key} given back {back} times: {:?}",
                seen.given_back.get(key)
            );
        }
        assert_eq!(pair.prefill_held(), 0, "prefill holds blocks at the end");
        assert_eq!(
            pair.decode_held(),
            0,
            "decode holds registrations at the end"
        );
        assert_eq!(pair.decode_stats().released_unconfirmed, 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Whatever the order of both engines' calls, peers' messages, lost notices, slow
        /// writes and time: every registered request ends exactly once, a ready one holds all
        /// its KV, every finished request's blocks go back exactly once, and nothing stays held.
        #[test]
        fn every_interleaving_ends_each_request_once_and_holds_nothing(
            steps in proptest::collection::vec(step(), 0..40),
        ) {
            run(&steps);
        }
    }
}
