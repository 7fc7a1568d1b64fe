//! Both sides' state machines joined and driven by hand, with one virtual clock: a prefill
//! instance's ranks and a decode instance's ranks, on one loopback fabric, each control
//! connection relayed message by message by the test. No driver thread, no sleep: what a
//! transfer between them decides at each moment (leases, aborts, cancels under a write in
//! flight, preemption, seals) is tested at the instant it is due, and a write "in flight" is
//! one whose completion the test has not handed to prefill yet. `tests/loopback.rs` keeps what
//! needs the real driver threads, sockets, engines and processes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kvx_core::wire::{Hello, Role};
use kvx_core::{Attempt, BlockId, EngineId, LayoutSpec, Rank, RequestId, TransferId};
use kvx_layout::Layout;
use kvx_rdma::local_peer::Process;
use kvx_rdma::loopback::LoopbackFabric;
use kvx_rdma::region::HostBuffer;
use kvx_rdma::transport::{Event, OpKind};
use kvx_rendezvous::{AttemptKey, Timestamp};

use crate::config::ConnectorConfig;
use crate::consumer::{self, PushRequest, RecvEvent};
use crate::control::{self, ControlStream, Dialled, Queued};
use crate::driver::{self, Clock, CommandReceiver, Driven, Mailbox};
use crate::producer::{self, FinishedBlocks, FinishedSending};
use crate::sim_support::{cache_endpoint_of, deliver, incoming, spec, Incoming};
use crate::stats::Stats;

/// Where prefill is said to listen (decode never reaches it: the test makes the connections).
const PREFILL: SocketAddr = SocketAddr::new(
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 1)),
    1,
);

/// The request ids each side's engine uses.
pub(crate) const PREFILL_REQUEST: RequestId = RequestId(7);
pub(crate) const DECODE_REQUEST: RequestId = RequestId(9);

/// A prefill instance and a decode instance of [`spec`]'s model, each of some tensor-parallel
/// ranks, and what surrounds them. Each engine call goes to every rank of its side, as each
/// rank's worker makes it.
pub(crate) struct Pair {
    now: &'static AtomicU64,
    prefill: Vec<PrefillRank>,
    decode: Vec<DecodeRank>,
    /// Live control connections, by decode rank and prefill rank.
    links: HashMap<(usize, usize), Link>,
    /// Whether transfers stay in flight: prefill's writes (their completions wait in prefill's
    /// transports, their notices are kept from decode) and decode's reads (their completions
    /// are kept from decode), until this is `false` again.
    pub(crate) hold_transfers: bool,
    /// Notices decode's transports drop before its state machines see them.
    pub(crate) notices_to_lose: usize,
    /// What prefill computed into each block ([`Pair::fill`]).
    salts: HashMap<BlockId, u8>,
}

struct PrefillRank {
    machine: producer::Machine,
    finished: Arc<Mailbox<(FinishedSending, SystemTime)>>,
    stats: Arc<Stats>,
    hello: Hello,
    memory: Vec<Arc<HostBuffer>>,
    layout: Layout,
    /// Its id of the next connection.
    next_conn: u64,
}

struct DecodeRank {
    machine: consumer::Machine,
    events: Arc<consumer::Outbox>,
    stats: Arc<Stats>,
    memory: Vec<Arc<HostBuffer>>,
    layout: Layout,
    /// Events of its transport held back while transfers stay in flight.
    held: Vec<Event>,
    /// Its own queue: what its helper threads send (their failed attempts to reach [`PREFILL`]
    /// themselves; never fed back).
    _queue: CommandReceiver<consumer::Command>,
}

/// One control connection: the relay's ends (what decode sends arrives on the first, what
/// prefill sends on the second) and prefill's id of it.
struct Link {
    from_decode: UnixStream,
    from_prefill: UnixStream,
    conn: u64,
}

/// [`spec`] for rank `rank` of `tp`.
fn rank_spec(tp: u32, rank: u32) -> LayoutSpec {
    LayoutSpec {
        tp_size: tp,
        tp_rank: rank,
        ..spec()
    }
}

impl Pair {
    /// A prefill rank (engine 1) and a decode rank (engine 2) with their default settings and
    /// decode's registration lease `lease`.
    pub(crate) fn new(lease: Duration) -> Self {
        Self::configured(|_| {}, |decode| decode.registration_lease = lease)
    }

    /// A prefill rank and a decode rank whose settings `prefill` and `decode` change.
    pub(crate) fn configured(
        prefill: impl Fn(&mut ConnectorConfig),
        decode: impl Fn(&mut ConnectorConfig),
    ) -> Self {
        Self::ranks(1, 1, prefill, decode)
    }

    /// A prefill instance of `prefill_tp` ranks and a decode instance of `decode_tp` ranks
    /// whose settings `prefill` and `decode` change.
    pub(crate) fn ranks(
        prefill_tp: u32,
        decode_tp: u32,
        prefill: impl Fn(&mut ConnectorConfig),
        decode: impl Fn(&mut ConnectorConfig),
    ) -> Self {
        let fabric = LoopbackFabric::new();
        let now: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
        let clock = Clock::virtual_at(now);
        let prefill = (0..prefill_tp)
            .map(|rank| {
                let mut config = ConnectorConfig::new(EngineId(1));
                prefill(&mut config);
                let layout = Layout::new(rank_spec(prefill_tp, rank)).expect("a valid layout");
                let (transport, _, memory) = cache_endpoint_of(&fabric, layout.spec());
                let hello = control::hello(
                    &config,
                    Role::Producer,
                    &layout,
                    &transport.local_desc(),
                    false,
                );
                let finished = Arc::new(Mailbox::default());
                let stats = Arc::new(Stats::default());
                let machine = producer::Machine::new(
                    &config,
                    layout.clone(),
                    transport,
                    clock,
                    Arc::clone(&finished),
                    Arc::clone(&stats),
                )
                .expect("a producer");
                PrefillRank {
                    machine,
                    finished,
                    stats,
                    hello,
                    memory,
                    layout,
                    next_conn: 1,
                }
            })
            .collect();
        let decode = (0..decode_tp)
            .map(|rank| {
                let mut config = ConnectorConfig::new(EngineId(2));
                decode(&mut config);
                // Notices come to the state machine as transport events, not through a board
                // that the engine thread reads.
                config.notice_board = false;
                let layout = Layout::new(rank_spec(decode_tp, rank)).expect("a valid layout");
                let (transport, regions, memory) = cache_endpoint_of(&fabric, layout.spec());
                let (tx, queue) = driver::command_queue(None);
                let events = Arc::new(consumer::Outbox {
                    hints: Arc::default(),
                    events: Mailbox::default(),
                });
                let stats = Arc::new(Stats::default());
                let machine = consumer::Machine::new(
                    config,
                    layout.clone(),
                    regions,
                    transport,
                    None,
                    clock,
                    tx,
                    Arc::clone(&events),
                    Arc::clone(&stats),
                )
                .expect("a consumer");
                DecodeRank {
                    machine,
                    events,
                    stats,
                    memory,
                    layout,
                    held: Vec::new(),
                    _queue: queue,
                }
            })
            .collect();
        Self {
            now,
            prefill,
            decode,
            links: HashMap::new(),
            hold_transfers: false,
            notices_to_lose: 0,
            salts: HashMap::new(),
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
        let push = push_request(key, request, tokens, blocks);
        self.decode_does(|| consumer::Command::Push(push.clone()));
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
        let push = push_request(key, DECODE_REQUEST, tokens, blocks);
        self.decode_does(|| {
            consumer::Command::Pull(consumer::PullRequest {
                push: push.clone(),
                producer_blocks: producer_blocks.clone(),
                producer_groups: Vec::new(),
            })
        });
    }

    /// Decode's engine dropped `transfer` before registering it: prefill gives its KV back now.
    pub(crate) fn abandon(&mut self, transfer: TransferId) {
        self.decode_does(|| consumer::Command::Abandon {
            prefill: PREFILL,
            transfer,
            capability: None,
        });
    }

    /// Decode's engine cancelled `transfer` (`attempt`, or every attempt).
    pub(crate) fn cancel(&mut self, transfer: TransferId, attempt: Option<Attempt>) {
        self.decode_does(|| consumer::Command::Cancel { transfer, attempt });
    }

    /// Prefill's engine finished `key` on `blocks` (push).
    pub(crate) fn finish(&mut self, key: AttemptKey, tokens: u64, blocks: Vec<BlockId>) {
        self.prefill_does(|| producer::Command::Finished {
            key,
            held: FinishedBlocks::new(PREFILL_REQUEST, blocks.clone(), tokens),
            pull: false,
        });
    }

    /// Prefill's engine finished `key` on `blocks` for decode to read (pull).
    pub(crate) fn finish_pull(&mut self, key: AttemptKey, tokens: u64, blocks: Vec<BlockId>) {
        self.prefill_does(|| producer::Command::Finished {
            key,
            held: FinishedBlocks::new(PREFILL_REQUEST, blocks.clone(), tokens),
            pull: true,
        });
    }

    /// Prefill's engine sealed `key` on `blocks`: its KV is final, the engine keeps the blocks
    /// until it finishes the request.
    pub(crate) fn seal(&mut self, key: AttemptKey, tokens: u64, blocks: Vec<BlockId>) {
        self.prefill_does(|| producer::Command::Sealed {
            key,
            held: FinishedBlocks::new(PREFILL_REQUEST, blocks.clone(), tokens),
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
        self.prefill_does(|| producer::Command::Progress {
            key,
            blocks: blocks.clone(),
            tokens,
            layers,
        });
    }

    /// Prefill's engine aborted `transfer` (`attempt`, or every attempt).
    pub(crate) fn abort(&mut self, transfer: TransferId, attempt: Option<Attempt>) {
        self.prefill_does(|| producer::Command::Abort { transfer, attempt });
    }

    /// Prefill's engine preempted `key`.
    pub(crate) fn preempt(&mut self, key: AttemptKey) {
        self.prefill_does(|| producer::Command::Preempted(key));
    }

    fn prefill_does(&mut self, command: impl Fn() -> producer::Command) {
        for rank in &mut self.prefill {
            rank.machine.command(command());
        }
        self.settle();
    }

    fn decode_does(&mut self, command: impl Fn() -> consumer::Command) {
        for rank in &mut self.decode {
            rank.machine.command(command());
        }
        self.settle();
    }

    /// Moves the virtual clock to `at` after the start, stopping at every moment a rank asked
    /// to wake at on the way (its leases, heartbeats, sweeps), as its driver loop would.
    pub(crate) fn at(&mut self, at: Duration) {
        let target = Timestamp::from_nanos(u64::try_from(at.as_nanos()).unwrap_or(u64::MAX));
        loop {
            let now = self.clock().now();
            let prefill = self.prefill.iter_mut().map(|r| r.machine.wake_at());
            let decode = self.decode.iter_mut().map(|r| r.machine.wake_at());
            let next = prefill
                .chain(decode)
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

    fn clock(&self) -> Clock {
        self.prefill[0].machine.clock()
    }

    fn set_clock(&self, at: Timestamp) {
        let nanos = at.saturating_duration_since(Timestamp::ZERO).as_nanos();
        self.now.store(
            u64::try_from(nanos).unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::SeqCst,
        );
    }

    /// Lets every rank's time pass and hands each what its peers sent and what its transport
    /// reported, connecting what decode ranks dial, until nothing moves.
    fn settle(&mut self) {
        // Turns of the driver loops: what came (messages, then transport events), then the
        // time; until a turn after the time brings nothing.
        let mut settled = false;
        loop {
            let moved = self.pass();
            if !moved && settled {
                return;
            }
            let now = self.clock().now();
            for rank in &mut self.prefill {
                rank.machine.tick(now);
            }
            for rank in &mut self.decode {
                rank.machine.tick(now);
            }
            settled = !moved;
        }
    }

    /// Hands every rank what its peers sent and what its transport reported, connecting what
    /// decode ranks dial; whether anything came.
    fn pass(&mut self) -> bool {
        let mut moved = self.connect_dialled();
        let links: Vec<(usize, usize)> = self.links.keys().copied().collect();
        for link in links {
            moved |= self.relay(link);
        }
        if !self.hold_transfers {
            for rank in &mut self.prefill {
                moved |= deliver(&mut rank.machine, Vec::new(), Some);
            }
        }
        for rank in &mut self.decode {
            let (lose, hold) = (&mut self.notices_to_lose, self.hold_transfers);
            let mut held = Vec::new();
            let earlier = if hold {
                Vec::new()
            } else {
                std::mem::take(&mut rank.held)
            };
            moved |= deliver(&mut rank.machine, earlier, |event| match event {
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
            rank.held.extend(held);
        }
        moved
    }

    /// Ends the handshakes decode ranks began with prefill ranks they have no connection to:
    /// each side gets its end of a control connection whose other ends the relay holds.
    fn connect_dialled(&mut self) -> bool {
        let mut moved = false;
        for d in 0..self.decode.len() {
            for (instance, rank) in self.decode[d].machine.handshakes() {
                let p = rank.0 as usize;
                if instance != PREFILL
                    || p >= self.prefill.len()
                    || self.links.contains_key(&(d, p))
                {
                    continue;
                }
                let (decode_end, from_decode) = UnixStream::pair().expect("a socket pair");
                let (prefill_end, from_prefill) = UnixStream::pair().expect("a socket pair");
                let this_process = Process::of(i32::try_from(std::process::id()).expect("a pid"));
                let stream = ControlStream::local_to(decode_end, Some(this_process));
                let hello = self.prefill[p].hello.clone();
                self.decode[d]
                    .machine
                    .command(consumer::Command::Handshaken(
                        PREFILL,
                        rank,
                        Ok(Dialled::new(stream, hello).expect("a sender")),
                    ));
                let sender = control::sender(&ControlStream::local(prefill_end)).expect("a sender");
                let hello = Box::new(self.decode[d].machine.hello().clone());
                let prefill = &mut self.prefill[p];
                let conn = prefill.next_conn;
                prefill.next_conn += 1;
                let accepted = producer::Command::Accepted(conn, sender, hello, None);
                prefill.machine.command(accepted);
                let link = Link {
                    from_decode,
                    from_prefill,
                    conn,
                };
                self.links.insert((d, p), link);
                moved = true;
            }
        }
        moved
    }

    /// Hands each end of the connection between decode rank `d` and prefill rank `p` what the
    /// other sent; a side that closed it closes it for both, as one socket would. Whether
    /// anything moved.
    fn relay(&mut self, (d, p): (usize, usize)) -> bool {
        let Some(link) = self.links.get_mut(&(d, p)) else {
            return false;
        };
        let (prefill, decode) = (&mut self.prefill[p].machine, &mut self.decode[d].machine);
        let rank = Rank(u32::try_from(p).expect("a rank"));
        let decode_conn = decode.conn_of(PREFILL, rank);
        let mut moved = false;
        let mut closed = None;
        loop {
            match incoming(&mut link.from_decode) {
                Incoming::Message(m) => {
                    let queued = Queued::unbounded();
                    prefill.command(producer::Command::Peer(link.conn, m, queued));
                    moved = true;
                }
                Incoming::Nothing => break,
                Incoming::Closed(why) => {
                    closed = Some(why);
                    break;
                }
            }
        }
        while closed.is_none() {
            match incoming(&mut link.from_prefill) {
                Incoming::Message(m) => {
                    let decode_conn = decode_conn.expect("connected");
                    let queued = Queued::unbounded();
                    let peer = consumer::Command::Peer(PREFILL, rank, decode_conn, m, queued);
                    decode.command(peer);
                    moved = true;
                }
                Incoming::Nothing => break,
                Incoming::Closed(why) => closed = Some(why),
            }
        }
        if let Some(why) = closed {
            let conn = link.conn;
            self.links.remove(&(d, p));
            prefill.command(producer::Command::PeerClosed(conn, why.clone()));
            if let Some(decode_conn) = decode_conn {
                decode.command(consumer::Command::PeerClosed(
                    PREFILL,
                    rank,
                    decode_conn,
                    why,
                ));
            }
            moved = true;
        }
        moved
    }

    /// The control connection between decode rank `d` and prefill rank `p` breaks (a network
    /// fault): both sides hear that it closed. Whether there was one.
    pub(crate) fn disconnect(&mut self, d: usize, p: usize) -> bool {
        let Some(link) = self.links.remove(&(d, p)) else {
            return false;
        };
        let rank = Rank(u32::try_from(p).expect("a rank"));
        let why = "connection reset".to_owned();
        let decode = &mut self.decode[d].machine;
        if let Some(conn) = decode.conn_of(PREFILL, rank) {
            decode.command(consumer::Command::PeerClosed(
                PREFILL,
                rank,
                conn,
                why.clone(),
            ));
        }
        let closed = producer::Command::PeerClosed(link.conn, why);
        self.prefill[p].machine.command(closed);
        self.settle();
        true
    }

    /// Prefill's engine hears what it may free now, rank after rank.
    pub(crate) fn finished(&self) -> Vec<FinishedSending> {
        (0..self.prefill.len())
            .flat_map(|p| self.rank_finished(p))
            .collect()
    }

    /// What prefill rank `p`'s engine may free now.
    pub(crate) fn rank_finished(&self, p: usize) -> Vec<FinishedSending> {
        let finished = self.prefill[p].finished.take();
        finished.into_iter().map(|(f, _)| f).collect()
    }

    /// Decode's engine hears what became of its requests, rank after rank.
    pub(crate) fn events(&self) -> Vec<RecvEvent> {
        (0..self.decode.len())
            .flat_map(|d| self.rank_events(d))
            .collect()
    }

    /// What decode rank `d`'s engine hears now.
    pub(crate) fn rank_events(&self, d: usize) -> Vec<RecvEvent> {
        let events = self.decode[d].events.events.take();
        events.into_iter().map(|(e, _)| e).collect()
    }

    /// Whether a write of decode's request `key` into decode rank `d` is in flight at a
    /// prefill rank, or a read of it at `d`.
    pub(crate) fn in_flight(&self, d: usize, key: AttemptKey) -> bool {
        let writing = self.links.iter().any(|(&(to, p), link)| {
            to == d && self.prefill[p].machine.writing(key, Some(link.conn))
        });
        writing || self.decode[d].machine.reading(key)
    }

    /// Requests whose blocks prefill holds, over its ranks.
    pub(crate) fn prefill_held(&self) -> i64 {
        self.prefill.iter().map(|r| r.stats.snapshot().held).sum()
    }

    /// Requests whose registrations decode holds, over its ranks.
    pub(crate) fn decode_held(&self) -> i64 {
        self.decode.iter().map(|r| r.stats.snapshot().held).sum()
    }

    /// Prefill rank 0's counters.
    pub(crate) fn prefill_stats(&self) -> crate::StatsSnapshot {
        self.prefill[0].stats.snapshot()
    }

    /// Decode rank 0's counters.
    pub(crate) fn decode_stats(&self) -> crate::StatsSnapshot {
        self.decode[0].stats.snapshot()
    }

    /// Decode's counters, summed over its ranks, of requests it released without prefill's
    /// word that nothing writes to them any more.
    pub(crate) fn released_unconfirmed(&self) -> u64 {
        let stats = self.decode.iter().map(|r| r.stats.snapshot());
        stats.map(|s| s.released_unconfirmed).sum()
    }

    /// Prefill computes the KV of `salt` into `blocks` on every rank: each byte of every head
    /// vector a value of the salt, the block and its place in the model (layer, K or V, token
    /// slot, global head).
    pub(crate) fn fill(&mut self, blocks: &[BlockId], salt: u8) {
        for rank in &self.prefill {
            let layout = &rank.layout;
            for_each_vector(layout, blocks, 0..u64::MAX, |v| {
                let bytes = kv_bytes(salt, v, layout);
                let memory = &rank.memory[v.region as usize];
                memory
                    .write_at(v.offset as usize, &bytes)
                    .expect("within the cache");
            });
        }
        for &block in blocks {
            self.salts.insert(block, salt);
        }
    }

    /// The prefill instance's ranks.
    pub(crate) fn prefill_ranks(&self) -> usize {
        self.prefill.len()
    }

    /// The decode instance's ranks.
    pub(crate) fn decode_ranks(&self) -> usize {
        self.decode.len()
    }

    /// Whether every decode rank's `landing` blocks hold what prefill computed into its
    /// `blocks` (the request's, in order), in the request's first `tokens` tokens.
    pub(crate) fn landed(&self, blocks: &[BlockId], landing: &[BlockId], tokens: u64) -> bool {
        self.landed_in(blocks, landing, 0..tokens, 0..spec().num_layers)
    }

    /// [`Pair::landed`] for the request's `tokens` in `layers` only.
    pub(crate) fn landed_in(
        &self,
        blocks: &[BlockId],
        landing: &[BlockId],
        tokens: Range<u64>,
        layers: Range<u32>,
    ) -> bool {
        (0..self.decode.len())
            .all(|d| self.landed_on(d, blocks, landing, tokens.clone(), layers.clone()))
    }

    /// [`Pair::landed`] for decode rank `d` and the request's `tokens` only.
    pub(crate) fn rank_landed(
        &self,
        d: usize,
        blocks: &[BlockId],
        landing: &[BlockId],
        tokens: Range<u64>,
    ) -> bool {
        self.landed_on(d, blocks, landing, tokens, 0..spec().num_layers)
    }

    fn landed_on(
        &self,
        d: usize,
        blocks: &[BlockId],
        landing: &[BlockId],
        tokens: Range<u64>,
        layers: Range<u32>,
    ) -> bool {
        if blocks.len() != landing.len() {
            return false;
        }
        let rank = &self.decode[d];
        let layout = &rank.layout;
        let mut all = true;
        for_each_vector(layout, landing, tokens, |v| {
            if !layers.contains(&v.layer) || !all {
                return;
            }
            let from = blocks[v.index];
            let expected = self.salts.get(&from).map_or_else(
                || vec![0; layout.head_bytes() as usize],
                |&salt| kv_bytes(salt, Vector { block: from, ..v }, layout),
            );
            let mut held = vec![0; expected.len()];
            rank.memory[v.region as usize]
                .read_at(v.offset as usize, &mut held)
                .expect("within the cache");
            all = held == expected;
        });
        all
    }
}

/// The engine's push request for `key`.
fn push_request(
    key: AttemptKey,
    request: RequestId,
    tokens: u64,
    blocks: Vec<BlockId>,
) -> PushRequest {
    PushRequest {
        key,
        request,
        prefill: PREFILL,
        num_tokens: tokens,
        skip_tokens: 0,
        blocks,
        groups: Vec::new(),
        capability: None,
        trace: None,
    }
}

/// One head vector of a request in a rank's cache.
#[derive(Clone, Copy, Debug)]
struct Vector {
    /// Its block's place in the request's blocks, and the block.
    index: usize,
    block: BlockId,
    layer: u32,
    kv: u32,
    slot: u32,
    /// Its head, of the model's.
    head: u32,
    region: u32,
    offset: u64,
}

/// Calls `f` with every head vector of `tokens` (of the request whose blocks are `blocks`) in
/// `layout`'s rank, every layer, K and V.
fn for_each_vector(
    layout: &Layout,
    blocks: &[BlockId],
    tokens: Range<u64>,
    mut f: impl FnMut(Vector),
) {
    let block_tokens = u64::from(layout.spec().block_tokens);
    let heads = layout.local_heads();
    let first_head = layout.rank().0 * heads;
    for layer in 0..layout.spec().num_layers {
        for kv in 0..layout.kv_parts() {
            for (index, &block) in blocks.iter().enumerate() {
                for slot in 0..block_tokens {
                    let token = index as u64 * block_tokens + slot;
                    if !tokens.contains(&token) {
                        continue;
                    }
                    let slot = u32::try_from(slot).expect("a slot");
                    for local_head in 0..heads {
                        let (region, offset) =
                            layout.head_vector(layer, kv, block, slot, local_head);
                        f(Vector {
                            index,
                            block,
                            layer,
                            kv,
                            slot,
                            head: first_head + local_head,
                            region,
                            offset,
                        });
                    }
                }
            }
        }
    }
}

/// The bytes prefill computes into head vector `v` for `salt`: a hash of each byte's place.
fn kv_bytes(salt: u8, v: Vector, layout: &Layout) -> Vec<u8> {
    let place = [
        u64::from(salt),
        u64::from(v.block.0),
        u64::from(v.layer),
        u64::from(v.kv),
        u64::from(v.slot),
        u64::from(v.head),
    ]
    .iter()
    .fold(0xcbf2_9ce4_8422_2325_u64, |h, x| {
        (h ^ x).wrapping_mul(0x0100_0000_01b3)
    });
    (0..layout.head_bytes())
        .map(|j| ((place ^ j).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
        .collect()
}

mod interleavings;
mod tests;
