//! The connector over a transport (loopback, or `cma` into this process) and a network that
//! misbehave as a seeded schedule says, in push and pull: prefill's writes and decode's reads land late (posted within the producer's
//! transfer timeout, and landing even where the caller has forgotten the peer meanwhile), fail
//! after their data landed, lose their notice or deliver it twice; the control connections are
//! reset (through a relay in front of prefill's ports); a prefill of one or two ranks streams
//! some requests' first block early, its engine aborts some and never finishes others, decode
//! cancels some and never registers others. Whatever happens:
//!
//! - every request decode registered ends exactly once (ready, and then byte-exact, or failed),
//!   and every request prefill finished is given back exactly once;
//! - no block is written after its engine got it back: each test engine overwrites every block
//!   it gets back at once (as an engine reusing it would), and once every write and read has
//!   ended, decode's still hold what its engine wrote (a read of prefill's blocks after prefill
//!   got them back would carry prefill's overwrite into a ready request, which fails the
//!   byte-exact check);
//! - nothing stays held on either side at the end, and a clean request then goes through.
//!
//! `KVX_FAULT_SEED=N` replays one schedule (`replay_the_seed_named_by_the_environment`);
//! otherwise six seeds from proptest run. Each run prints its seed and what became of its
//! requests.

use std::collections::{HashMap, HashSet};
use std::io::{Read as _, Write as _};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvx_core::{
    Arrangement, Attempt, BlockId, Dtype, EngineId, LayoutSpec, MemoryOrder, RequestId, TransferId,
};
use kvx_layout::CopyOp;
use kvx_rdma::cma::{CmaConfig, CmaTransport};
use kvx_rdma::loopback::LoopbackFabric;
use kvx_rdma::region::LocalRegion;
use kvx_rdma::{Capabilities, Event, Notice, OpError, OpId, OpKind, PeerId, Transport};
use kvx_rendezvous::AttemptKey;
use kvx_testkit::free_ports;
use kvx_vllm::{ConnectorConfig, Consumer, Producer, PullRequest, PushRequest, RecvEvent};
use proptest::prelude::*;

#[path = "support/side.rs"]
mod side;
#[path = "support/forward.rs"]
#[macro_use]
mod forward;
use side::{Side, SEED};

/// What decode's engine writes into every block it gets back.
const REUSED: u64 = 0xbad_5eed;
/// Tokens per request (two 4-token blocks).
const TOKENS: u64 = 8;
/// Requests per schedule.
const REQUESTS: u32 = 10;

/// The schedule's generator (splitmix64): one seed, one run.
struct Schedule(u64);

impl Schedule {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn millis(&mut self, range: std::ops::Range<u64>) -> Duration {
        Duration::from_millis(range.start + self.below(range.end - range.start))
    }

    /// What happens to one write.
    fn fault(&mut self) -> Fault {
        match self.below(10) {
            0..=3 => Fault::None,
            4 | 5 => Fault::Delay(self.millis(20..700)),
            6 => Fault::DropNotice,
            7 => Fault::DuplicateNotice,
            _ => Fault::FailAfterLanding,
        }
    }
}

/// What the schedule does to one write or read (a read's notice faults are none).
#[derive(Clone, Copy, Debug)]
enum Fault {
    None,
    /// Posted only after this long: its data lands late (within the producer's transfer
    /// timeout, as a transport that honours it would), and it is in flight meanwhile.
    Delay(Duration),
    /// Its data lands; its notice never arrives.
    DropNotice,
    /// Its notice arrives twice.
    DuplicateNotice,
    /// Its data lands, and then the transport reports it failed.
    FailAfterLanding,
}

/// A delayed write (`read`: a delayed read).
struct Pending {
    due: Instant,
    peer: PeerId,
    ops: Vec<CopyOp>,
    notice: Option<Notice>,
    read: bool,
    op: OpId,
}

/// An endpoint whose writes (prefill's) and reads (decode's) misbehave as `schedule` says
/// (faults on while `faults` is set).
struct Faulty {
    inner: Box<dyn Transport>,
    schedule: Arc<Mutex<Schedule>>,
    faults: Arc<AtomicBool>,
    next_op: u64,
    pending: Vec<Pending>,
    /// The inner operation of each posted write or read: this side's id, whether to report it
    /// failed once it ends, and its peer as the caller knows it.
    posted: HashMap<OpId, (OpId, bool, PeerId)>,
    /// Inner writes of duplicated notices, whose ends nobody waits for.
    duplicates: HashSet<OpId>,
    /// Events of delayed operations that could not be posted.
    ready: Vec<Event>,
    /// Each peer's description: a write posted to a peer lands even where the producer has
    /// forgotten the peer by the time its data moves.
    descs: HashMap<PeerId, kvx_rdma::EndpointDesc>,
    /// Writes and reads accepted whose end has not been reported yet.
    in_flight: Arc<AtomicUsize>,
}

impl Faulty {
    /// Posts the delayed operations now due.
    fn post_due(&mut self) {
        let now = Instant::now();
        let (due, later): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| p.due <= now);
        self.pending = later;
        for p in due {
            let post = |inner: &mut Box<dyn Transport>, peer| {
                if p.read {
                    inner.read(peer, &p.ops).map_err(|e| e.to_string())
                } else {
                    inner
                        .write(peer, &p.ops, p.notice)
                        .map_err(|e| e.to_string())
                }
            };
            let mut posted = post(&mut self.inner, p.peer);
            if posted.is_err() {
                if let Some(desc) = self.descs.get(&p.peer) {
                    // Forgotten since it was posted: its data still moves.
                    posted = match self.inner.connect(desc) {
                        Ok(peer) => post(&mut self.inner, peer),
                        Err(e) => Err(e.to_string()),
                    };
                }
            }
            match posted {
                Ok(inner) => {
                    self.posted.insert(inner, (p.op, false, p.peer));
                }
                Err(e) => {
                    eprintln!("a delayed operation could not be posted: {e}");
                    self.ready.push(Event::Failed {
                        op: p.op,
                        kind: if p.read { OpKind::Read } else { OpKind::Write },
                        peer: p.peer,
                        error: OpError::TimedOut(Duration::ZERO),
                    });
                }
            }
        }
    }

    /// What the schedule does to the next operation, and this side's id for it.
    fn next(&mut self) -> (Fault, OpId) {
        let fault = if self.faults.load(Ordering::SeqCst) {
            self.schedule.lock().unwrap().fault()
        } else {
            Fault::None
        };
        self.next_op += 1;
        (fault, OpId(self.next_op))
    }

    /// Posts operation `op` only `by` from now.
    fn delay(
        &mut self,
        by: Duration,
        peer: PeerId,
        ops: &[CopyOp],
        notice: Option<Notice>,
        read: bool,
        op: OpId,
    ) {
        self.pending.push(Pending {
            due: Instant::now() + by,
            peer,
            ops: ops.to_vec(),
            notice,
            read,
            op,
        });
    }

    /// The event of inner operation `op` (a `kind`), which ended well (`done` makes it): as
    /// this side's operation and peer, and failed where the schedule says so.
    fn ended(
        &mut self,
        op: OpId,
        peer: PeerId,
        kind: OpKind,
        done: impl FnOnce(OpId, PeerId) -> Event,
    ) -> Event {
        match self.posted.remove(&op) {
            Some((ours, true, peer)) => Event::Failed {
                op: ours,
                kind,
                peer,
                error: OpError::TimedOut(Duration::ZERO),
            },
            Some((ours, false, peer)) => done(ours, peer),
            None => done(op, peer),
        }
    }

    /// What the inner transport reported from `first` on, as the producer must see it.
    fn translate(&mut self, events: &mut Vec<Event>, first: usize) -> usize {
        let new: Vec<Event> = events.drain(first..).collect();
        for event in new {
            let event = match event {
                Event::WriteDone { op, peer, bytes } => {
                    if self.duplicates.remove(&op) {
                        continue;
                    }
                    self.ended(op, peer, OpKind::Write, |op, peer| Event::WriteDone {
                        op,
                        peer,
                        bytes,
                    })
                }
                Event::ReadDone { op, peer, bytes } => {
                    self.ended(op, peer, OpKind::Read, |op, peer| Event::ReadDone {
                        op,
                        peer,
                        bytes,
                    })
                }
                Event::Failed {
                    op,
                    kind,
                    peer,
                    error,
                } => {
                    if self.duplicates.remove(&op) {
                        continue;
                    }
                    let (op, peer) = self
                        .posted
                        .remove(&op)
                        .map_or((op, peer), |(ours, _, peer)| (ours, peer));
                    Event::Failed {
                        op,
                        kind,
                        peer,
                        error,
                    }
                }
                other => other,
            };
            if matches!(
                event,
                Event::WriteDone { .. }
                    | Event::ReadDone { .. }
                    | Event::Failed {
                        kind: OpKind::Write | OpKind::Read,
                        ..
                    }
            ) {
                self.in_flight.fetch_sub(1, Ordering::SeqCst);
            }
            events.push(event);
        }
        let ready = std::mem::take(&mut self.ready);
        self.in_flight.fetch_sub(ready.len(), Ordering::SeqCst);
        events.extend(ready);
        events.len() - first
    }
}

impl Transport for Faulty {
    forward_transport!(base);

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn connect(&mut self, peer: &kvx_rdma::EndpointDesc) -> Result<PeerId, kvx_rdma::ConnectError> {
        let id = self.inner.connect(peer)?;
        self.descs.insert(id, peer.clone());
        Ok(id)
    }

    fn disconnect(&mut self, peer: PeerId) {
        self.inner.disconnect(peer);
    }

    fn write(
        &mut self,
        peer: PeerId,
        ops: &[CopyOp],
        notice: Option<Notice>,
    ) -> Result<OpId, kvx_rdma::WriteError> {
        let (fault, op) = self.next();
        match fault {
            Fault::Delay(by) => self.delay(by, peer, ops, notice, false, op),
            Fault::DropNotice => {
                let inner = self.inner.write(peer, ops, None)?;
                self.posted.insert(inner, (op, false, peer));
            }
            Fault::DuplicateNotice => {
                let inner = self.inner.write(peer, ops, notice)?;
                self.posted.insert(inner, (op, false, peer));
                if let (Some(first), Some(_)) = (ops.first(), notice) {
                    // The first piece again (the same bytes), announcing the same notice.
                    let again = self.inner.write(peer, &[*first], notice)?;
                    self.duplicates.insert(again);
                }
            }
            Fault::FailAfterLanding => {
                let inner = self.inner.write(peer, ops, notice)?;
                self.posted.insert(inner, (op, true, peer));
            }
            Fault::None => {
                let inner = self.inner.write(peer, ops, notice)?;
                self.posted.insert(inner, (op, false, peer));
            }
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Ok(op)
    }

    fn read(&mut self, peer: PeerId, ops: &[CopyOp]) -> Result<OpId, kvx_rdma::ReadError> {
        let (fault, op) = self.next();
        match fault {
            Fault::Delay(by) => self.delay(by, peer, ops, None, true, op),
            Fault::FailAfterLanding => {
                let inner = self.inner.read(peer, ops)?;
                self.posted.insert(inner, (op, true, peer));
            }
            Fault::None | Fault::DropNotice | Fault::DuplicateNotice => {
                let inner = self.inner.read(peer, ops)?;
                self.posted.insert(inner, (op, false, peer));
            }
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Ok(op)
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, kvx_rdma::PollError> {
        self.post_due();
        let first = events.len();
        self.inner.poll(events)?;
        Ok(self.translate(events, first))
    }

    fn wait(
        &mut self,
        events: &mut Vec<Event>,
        timeout: Duration,
    ) -> Result<usize, kvx_rdma::PollError> {
        self.post_due();
        let first = events.len();
        if self.ready.is_empty() {
            // Not past the next delayed write.
            let next = self.pending.iter().map(|p| p.due).min();
            let timeout = next.map_or(timeout, |due| {
                timeout.min(due.saturating_duration_since(Instant::now()))
            });
            self.inner.wait(events, timeout)?;
        } else {
            self.inner.poll(events)?;
        }
        Ok(self.translate(events, first))
    }
}

/// A TCP relay in front of prefill's control port whose connections can be reset.
struct Relay {
    addr: SocketAddr,
    connections: Arc<Mutex<Vec<TcpStream>>>,
}

impl Relay {
    /// Relays connections made to `ranks` consecutive free ports, the first at `addr`, to the
    /// same ranks' ports from `upstream` on (rank r listens at port + r).
    fn start(upstream: SocketAddr, ranks: u16) -> Self {
        let addr = free_ports(ranks);
        let connections: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        for rank in 0..ranks {
            let listener =
                TcpListener::bind(SocketAddr::new(addr.ip(), addr.port() + rank)).unwrap();
            let upstream = SocketAddr::new(upstream.ip(), upstream.port() + rank);
            let kept = Arc::clone(&connections);
            std::thread::spawn(move || relay(&listener, upstream, &kept));
        }
        Self { addr, connections }
    }

    /// Resets every connection relayed so far: both ends see it closed.
    fn reset(&self) {
        for conn in self.connections.lock().unwrap().drain(..) {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}

/// Relays each connection `listener` takes to `upstream`, keeping both ends in `kept`.
fn relay(listener: &TcpListener, upstream: SocketAddr, kept: &Mutex<Vec<TcpStream>>) {
    for client in listener.incoming() {
        let Ok(client) = client else { return };
        let Ok(server) = TcpStream::connect(upstream) else {
            continue;
        };
        for (from, to) in [(&client, &server), (&server, &client)] {
            let (mut from, mut to) = (from.try_clone().unwrap(), to.try_clone().unwrap());
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                while let Ok(n @ 1..) = from.read(&mut buf) {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to.shutdown(Shutdown::Both);
                let _ = from.shutdown(Shutdown::Both);
            });
        }
        let mut kept = kept.lock().unwrap();
        kept.push(client);
        kept.push(server);
    }
}

/// Rank `rank` of `tp`: two layers, two KV heads (one per rank at TP 2), 4-token blocks.
fn spec(tp: u32, rank: u32) -> LayoutSpec {
    LayoutSpec {
        num_layers: 2,
        total_kv_heads: 2,
        head_dim: 8,
        dtype: Dtype::Bf16,
        mla: false,
        block_tokens: 4,
        num_blocks: 64,
        tp_size: tp,
        tp_rank: rank,
        order: MemoryOrder::Nhd,
        arrangement: Arrangement::PerLayerSplit,
    }
}

/// What the schedule does with one request.
#[derive(Clone, Copy, Debug)]
struct Plan {
    /// When decode registers it (`None`: never).
    register: Option<Duration>,
    /// When prefill finishes it (`None`: never).
    finish: Option<Duration>,
    /// Push: prefill's engine aborts it at `finish` instead of finishing it.
    aborted: bool,
    /// Push: prefill reports its first block's tokens final this long before `finish` (they
    /// are written early, once decode registered).
    progress: Option<Duration>,
    /// When decode's engine cancels it (`None`: never).
    cancel: Option<Duration>,
    /// Pull: prefill finishes it for decode to read, and decode reads it at `register` (then
    /// never before `finish`, whose block ids it needs).
    pull: bool,
}

fn plans(schedule: &mut Schedule) -> Vec<Plan> {
    (0..REQUESTS)
        .map(|i| {
            let at = Duration::from_millis(u64::from(i) * 40) + schedule.millis(0..40);
            let other = at + schedule.millis(0..150);
            let (register, finish) = if schedule.below(2) == 0 {
                (at, other)
            } else {
                (other, at)
            };
            let pull = schedule.below(3) == 0;
            // A pull comes after its finish, now and then close to prefill's lease (2 s), so
            // that late reads cross it.
            let register = match (pull, schedule.below(4)) {
                (true, 0) => finish + schedule.millis(1500..2300),
                (true, _) => register.max(finish),
                (false, _) => register,
            };
            let (register, finish) = match schedule.below(10) {
                0 => (None, Some(finish)),
                1 if !pull => (Some(register), None),
                _ => (Some(register), Some(finish)),
            };
            let cancel = (register.is_some() && schedule.below(10) == 0)
                .then(|| register.unwrap_or_default() + schedule.millis(0..400));
            let aborted = !pull && finish.is_some() && schedule.below(10) == 0;
            let progress = (!pull && schedule.below(3) == 0)
                .then(|| finish.map(|at| at.saturating_sub(schedule.millis(0..150))))
                .flatten();
            Plan {
                register,
                finish,
                aborted,
                progress,
                cancel,
                pull,
            }
        })
        .collect()
}

fn key(i: u32) -> AttemptKey {
    AttemptKey::new(TransferId(1000 + u128::from(i)), Attempt(0))
}

/// Request `i`'s blocks, on either side.
fn blocks(i: u32) -> Vec<BlockId> {
    vec![BlockId(2 * i), BlockId(2 * i + 1)]
}

/// One run of the schedule of `seed`.
fn run(seed: u64) {
    eprintln!("fault schedule seed {seed} (KVX_FAULT_SEED={seed} replays it)");
    let mut schedule = Schedule(seed);
    let tp = 1 + schedule.below(2) as u32;
    let dtp = 1 + schedule.below(2) as u32;
    let plans = plans(&mut schedule);
    let resets: Vec<Duration> = (0..schedule.below(3))
        .map(|_| schedule.millis(50..900))
        .collect();
    // Under the injector: the in-process loopback transport, or `cma` (real cross-memory
    // attach into this process, its completions and notices over its own sockets).
    let over_cma = schedule.below(2) == 0;
    let schedule = Arc::new(Mutex::new(schedule));
    let faults = Arc::new(AtomicBool::new(true));
    let in_flight = Arc::new(AtomicUsize::new(0));

    let fabric = LoopbackFabric::new();
    let mut p = ConnectorConfig::new(EngineId(1));
    p.listen = free_ports(tp as u16);
    p.producer_lease = Duration::from_secs(2);
    p.transfer_timeout = Duration::from_secs(1);
    p.local_sockets = false;
    let endpoint = || -> Box<dyn Transport> {
        if over_cma {
            Box::new(CmaTransport::open(CmaConfig::default()).unwrap())
        } else {
            Box::new(fabric.endpoint())
        }
    };
    let faulty = || Faulty {
        inner: endpoint(),
        schedule: Arc::clone(&schedule),
        faults: Arc::clone(&faults),
        next_op: 1 << 40,
        pending: Vec::new(),
        posted: HashMap::new(),
        duplicates: HashSet::new(),
        ready: Vec::new(),
        descs: HashMap::new(),
        in_flight: Arc::clone(&in_flight),
    };
    // Prefill's ranks: each its cache, filled with every request's KV, and its producer.
    let prefill: Vec<(Side, Producer)> = (0..tp)
        .map(|rank| {
            let (side, cache) = Side::new(spec(tp, rank));
            for i in 0..=REQUESTS {
                side.fill(&blocks(i), TOKENS);
            }
            let mut config = p.clone();
            config.listen = SocketAddr::new(p.listen.ip(), p.listen.port() + rank as u16);
            let producer = Producer::start(config, cache, Box::new(faulty())).unwrap();
            (side, producer)
        })
        .collect();
    let relay = Relay::start(p.listen, tp as u16);
    let mut d = ConnectorConfig::new(EngineId(2));
    d.registration_lease = Duration::from_millis(1500);
    // Decode's reads run for a second at most: prefill holds a claimed pull that long (and a
    // margin) without its completion.
    d.transfer_timeout = Duration::from_secs(1);
    d.heartbeat_interval = Duration::from_millis(100);
    d.local_sockets = false;
    // Decode's ranks: each its cache and its consumer.
    let decode: Vec<(Side, Consumer)> = (0..dtp)
        .map(|rank| {
            let (side, cache) = Side::new(spec(dtp, rank));
            let consumer = Consumer::start(d.clone(), cache, Box::new(faulty())).unwrap();
            (side, consumer)
        })
        .collect();

    let request = |i: u32| PushRequest {
        groups: Vec::new(),
        key: key(i),
        request: RequestId(u64::from(i)),
        prefill: relay.addr,
        num_tokens: TOKENS,
        skip_tokens: 0,
        blocks: blocks(i),
        capability: None,
        trace: None,
    };
    let started = Instant::now();
    let mut registered = HashSet::new();
    let mut finished = HashSet::new();
    let mut cancelled = HashSet::new();
    let mut resets_done = 0;
    // Decode's end of each request, and prefill's.
    let mut ended: HashMap<(usize, u32), RecvEvent> = HashMap::new();
    let mut given_back: HashSet<(usize, u32)> = HashSet::new();
    let mut progressed = HashSet::new();
    let deadline = started + Duration::from_secs(30);
    loop {
        let now = started.elapsed();
        for (i, plan) in (0..REQUESTS).zip(&plans) {
            if plan.register.is_some_and(|at| at <= now) && registered.insert(i) {
                for (_, consumer) in &decode {
                    if plan.pull {
                        consumer.pull(PullRequest {
                            producer_groups: Vec::new(),
                            push: request(i),
                            producer_blocks: blocks(i),
                        })
                    } else {
                        consumer.request_allocated(request(i))
                    }
                    .unwrap();
                }
            }
            if plan.progress.is_some_and(|at| at <= now) && progressed.insert(i) {
                for (_, producer) in &prefill {
                    producer
                        .request_progress(key(i), blocks(i)[..1].to_vec(), 4)
                        .unwrap();
                }
            }
            if plan.finish.is_some_and(|at| at <= now) && finished.insert(i) {
                let (key, request) = (key(i), RequestId(u64::from(i)));
                for (_, producer) in &prefill {
                    if plan.aborted {
                        producer.abort(key.transfer, None)
                    } else if plan.pull {
                        producer.request_finished_pull(key, request, blocks(i), TOKENS)
                    } else {
                        producer.request_finished(key, request, blocks(i), TOKENS)
                    }
                    .unwrap();
                }
            }
            if plan.cancel.is_some_and(|at| at <= now) && cancelled.insert(i) {
                for (_, consumer) in &decode {
                    consumer.cancel(key(i).transfer, None).unwrap();
                }
            }
        }
        if resets.iter().filter(|at| **at <= now).count() > resets_done {
            resets_done += 1;
            relay.reset();
        }
        for (rank, (side, consumer)) in decode.iter().enumerate() {
            for event in consumer.take_events() {
                let (RecvEvent::Ready { request, .. } | RecvEvent::Failed { request, .. }) = &event;
                let i = u32::try_from(request.0).unwrap();
                if let RecvEvent::Ready { .. } = event {
                    assert!(
                        side.holds(&blocks(i), 0, TOKENS, SEED),
                        "seed {seed}: request {i} ready at decode rank {rank} but its KV is not \
                         all there; its plan {:?}, after {:?}",
                        plans[i as usize],
                        started.elapsed()
                    );
                }
                // The engine reuses the blocks at once.
                side.overwrite(&blocks(i), TOKENS, REUSED);
                if let Some(before) = ended.insert((rank, i), event.clone()) {
                    panic!(
                        "seed {seed}: request {i} ended twice at decode rank {rank}: {before:?}, \
                         then {event:?}"
                    );
                }
            }
        }
        for (rank, (side, producer)) in prefill.iter().enumerate() {
            for done in producer.take_finished() {
                let i = u32::try_from(done.request.0).unwrap();
                // Prefill's engine reuses the blocks at once: a read of them after this would
                // carry this into decode.
                side.overwrite(&blocks(i), TOKENS, REUSED);
                assert!(
                    given_back.insert((rank, i)),
                    "seed {seed}: prefill rank {rank} got request {i}'s blocks back twice"
                );
            }
        }
        let all_posted = registered.len() + finished.len()
            == plans
                .iter()
                .map(|p| usize::from(p.register.is_some()) + usize::from(p.finish.is_some()))
                .sum::<usize>();
        // Every rank gives back each request its engine finished (not one it aborted).
        let handed = plans
            .iter()
            .filter(|p| p.finish.is_some() && !p.aborted)
            .count();
        if all_posted
            && ended.len() == registered.len() * decode.len()
            && given_back.len() == handed * prefill.len()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: not every request ended: decode ended {:?} of {registered:?}, prefill \
             gave back {given_back:?} of {finished:?}; plans {plans:?}",
            ended.keys().collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Every write ended (a late one would have landed by now), and no block decode's engine
    // got back was written after it.
    while in_flight.load(Ordering::SeqCst) > 0 {
        assert!(Instant::now() < deadline, "seed {seed}: writes never ended");
        std::thread::sleep(Duration::from_millis(5));
    }
    for ((rank, i), event) in &ended {
        assert!(
            decode[*rank].0.holds(&blocks(*i), 0, TOKENS, REUSED),
            "seed {seed}: a write landed in request {i}'s blocks at decode rank {rank} after it \
             gave them back ({event:?}); plans {plans:?}, resets at {resets:?}"
        );
    }
    let ready = ended
        .values()
        .filter(|e| matches!(e, RecvEvent::Ready { .. }))
        .count();
    eprintln!(
        "seed {seed}: {}, prefill TP {tp} into decode TP {dtp}, {ready} ready and {} failed at decode \
         ranks, {} given back by prefill ranks, {resets_done} resets, ended after {:?}",
        if over_cma { "cma" } else { "loopback" },
        ended.len() - ready,
        given_back.len(),
        started.elapsed()
    );
    for (_, consumer) in &decode {
        assert_eq!(consumer.stats().held, 0, "seed {seed}: decode holds blocks");
    }
    for (_, producer) in &prefill {
        assert_eq!(
            producer.stats().held,
            0,
            "seed {seed}: prefill holds blocks"
        );
    }
    // The pair still works: a clean request goes through.
    faults.store(false, Ordering::SeqCst);
    let last = REQUESTS;
    for (_, consumer) in &decode {
        consumer.request_allocated(request(last)).unwrap();
    }
    for (_, producer) in &prefill {
        producer
            .request_finished(key(last), RequestId(u64::from(last)), blocks(last), TOKENS)
            .unwrap();
    }
    for (side, consumer) in &decode {
        let events = consumer.wait_events(Duration::from_secs(10));
        assert!(
            matches!(&events[..], [RecvEvent::Ready { request, .. }] if request.0 == u64::from(last)),
            "seed {seed}: a clean request after the faults: {events:?}"
        );
        assert!(side.holds(&blocks(last), 0, TOKENS, SEED));
    }
}

#[test]
fn replay_the_seed_named_by_the_environment() {
    match std::env::var("KVX_FAULT_SEED") {
        Ok(seed) => run(seed.parse().expect("KVX_FAULT_SEED is a number")),
        Err(_) => eprintln!("KVX_FAULT_SEED not set: nothing to replay"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn whatever_the_transport_and_network_do_requests_end_once_and_no_block_is_written_after_its_release(seed in any::<u64>()) {
        run(seed);
    }
}
