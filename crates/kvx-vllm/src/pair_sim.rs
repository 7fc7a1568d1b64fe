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

use kvx_core::wire::{Hello, Message, Role};
use kvx_core::{Attempt, BlockId, EngineId, LayoutSpec, Rank, RequestId, TransferId};
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
use crate::sim_support::{cache_endpoint_of, spec};
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
    machine: producer::Driver,
    finished: Arc<Mailbox<(FinishedSending, SystemTime)>>,
    stats: Arc<Stats>,
    hello: Hello,
    memory: Vec<Arc<HostBuffer>>,
    layout: Layout,
    /// Its id of the next connection.
    next_conn: u64,
}

struct DecodeRank {
    machine: consumer::Driver,
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
                let machine = producer::Driver::new(
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
                let machine = consumer::Driver::new(
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
        loop {
            let now = self.clock().now();
            for rank in &mut self.prefill {
                rank.machine.tick(now);
            }
            for rank in &mut self.decode {
                rank.machine.tick(now);
            }
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
            if !moved {
                return;
            }
        }
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
                        Ok((stream, hello)),
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
            match relayed(&mut link.from_decode) {
                Relayed::Message(m) => {
                    let queued = Queued::unbounded();
                    prefill.command(producer::Command::Peer(link.conn, m, queued));
                    moved = true;
                }
                Relayed::Nothing => break,
                Relayed::Closed(why) => {
                    closed = Some(why);
                    break;
                }
            }
        }
        while closed.is_none() {
            match relayed(&mut link.from_prefill) {
                Relayed::Message(m) => {
                    let decode_conn = decode_conn.expect("connected");
                    let queued = Queued::unbounded();
                    let peer = consumer::Command::Peer(PREFILL, rank, decode_conn, m, queued);
                    decode.command(peer);
                    moved = true;
                }
                Relayed::Nothing => break,
                Relayed::Closed(why) => closed = Some(why),
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
        pair.hold_transfers = true;
        pair.finish(k, 12, ids(5..8));
        assert_eq!(pair.prefill_held(), 1);
        pair.cancel(k.transfer, Some(k.attempt));
        pair.at(Duration::from_secs(300));
        assert_eq!(pair.events(), vec![], "failed with a write in flight");
        assert_eq!(pair.finished(), vec![]);
        assert_eq!(pair.prefill_held(), 1, "blocks released under a write");
        pair.hold_transfers = false;
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
        pair.hold_transfers = true;
        pair.seal(k, 8, ids(5..7));
        pair.cancel(k.transfer, Some(k.attempt));
        pair.at(Duration::from_secs(1));
        assert_eq!(pair.events(), vec![], "failed with a write in flight");
        pair.hold_transfers = false;
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
            pair.hold_transfers = true;
            if seal {
                pair.seal(k, 8, ids(5..7));
            } else {
                pair.finish(k, 8, ids(5..7));
            }
            pair.at(Duration::from_secs(1));
            // At the lease, the write's end (its notice lost) and decode's abort meet.
            pair.hold_transfers = false;
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
    /// Decode's bound for prefill's word that nothing writes any more: longer than all the
    /// steps (at most 40 waits of 3 s), so that within them every end is confirmed or waits.
    const QUIESCE: Duration = Duration::from_secs(150);
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
        HoldTransfers(bool),
        LoseNotice,
        /// Decode's engine drops a pushed transfer it never registered (and never will).
        Abandon {
            transfer: u8,
        },
        /// The control connection between these ranks (modulo the sizes) breaks.
        Disconnect {
            decode_rank: u8,
            prefill_rank: u8,
        },
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
            1 => any::<bool>().prop_map(Step::HoldTransfers),
            1 => Just(Step::LoseNotice),
            1 => (1u8..PULLED).prop_map(|transfer| Step::Abandon { transfer }),
            1 => (0u8..2, 0u8..2).prop_map(|(decode_rank, prefill_rank)| Step::Disconnect {
                decode_rank,
                prefill_rank,
            }),
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
        /// Each decode rank's ends of each request, as many as came.
        ends: HashMap<(usize, AttemptKey), Vec<RecvEvent>>,
        /// Prefill's computed (progress or seal), and finished, requests.
        computed: HashSet<AttemptKey>,
        finished: HashSet<AttemptKey>,
        /// Each prefill rank's blocks given back, for each request.
        given_back: HashMap<(usize, AttemptKey), Vec<SendOutcome>>,
        /// Whether a control connection broke.
        disconnected: bool,
        /// Transfers decode's engine dropped unregistered.
        abandoned: HashSet<u8>,
    }

    impl Seen {
        /// Reads what every rank's engine heard, checking each Ready's bytes as it comes.
        fn collect(&mut self, pair: &Pair) {
            for d in 0..pair.decode_ranks() {
                for event in pair.rank_events(d) {
                    let key = match &event {
                        RecvEvent::Ready { key, .. } => {
                            assert!(
                                self.computed.contains(key) || self.finished.contains(key),
                                "{key} ready, but prefill never computed it"
                            );
                            let t = u8::try_from(key.transfer.0).expect("small");
                            let (from, to) = (prefill_blocks(t), decode_blocks(*key));
                            assert!(
                                pair.rank_landed(d, &from, &to, 0..TOKENS),
                                "{key} ready on decode rank {d}, but its KV is not all there"
                            );
                            *key
                        }
                        RecvEvent::Failed { key, .. } => *key,
                    };
                    assert!(
                        self.registered.contains(&key),
                        "an end for {key}, never registered"
                    );
                    // Decode's engine may reuse the blocks at once: nothing may still write
                    // there (decode's bound for prefill's word is longer than the steps; the
                    // transfers held in flight end before it passes).
                    assert!(
                        !pair.in_flight(d, key),
                        "{key} ended on decode rank {d} with a transfer in flight: {event:?}"
                    );
                    self.ends.entry((d, key)).or_default().push(event);
                }
            }
            for p in 0..pair.prefill_ranks() {
                for done in pair.rank_finished(p) {
                    assert!(
                        self.finished.contains(&done.key),
                        "{} given back, but never finished",
                        done.key
                    );
                    let given_back = self.given_back.entry((p, done.key)).or_default();
                    given_back.push(done.outcome);
                }
            }
        }
    }

    fn run((prefill_tp, decode_tp): (u32, u32), steps: &[Step]) {
        let mut pair = Pair::ranks(
            prefill_tp,
            decode_tp,
            |_| {},
            |decode| {
                decode.registration_lease = LEASE;
                decode.quiesce_timeout = Some(QUIESCE);
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
                    if !seen.abandoned.contains(&transfer) && seen.registered.insert(key) {
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
                Step::HoldTransfers(hold) => {
                    pair.hold_transfers = hold;
                    pair.at(now);
                }
                Step::LoseNotice => pair.notices_to_lose += 1,
                Step::Abandon { transfer } => {
                    let registered = seen
                        .registered
                        .iter()
                        .any(|k| k.transfer.0 == u128::from(transfer));
                    if !registered && seen.abandoned.insert(transfer) {
                        pair.abandon(TransferId(u128::from(transfer)));
                    }
                }
                Step::Disconnect {
                    decode_rank,
                    prefill_rank,
                } => {
                    let d = usize::from(decode_rank) % pair.decode_ranks();
                    let p = usize::from(prefill_rank) % pair.prefill_ranks();
                    seen.disconnected |= pair.disconnect(d, p);
                }
            }
            seen.collect(&pair);
        }
        // The writes end, every request prefill computed is finished, and every bound passes.
        pair.hold_transfers = false;
        now += QUIESCE + LEASE;
        pair.at(now);
        seen.collect(&pair);
        for key in seen.computed.clone() {
            if seen.finished.insert(key) {
                let transfer = u8::try_from(key.transfer.0).expect("small");
                pair.finish(key, TOKENS, prefill_blocks(transfer));
            }
        }
        now += QUIESCE + LEASE;
        pair.at(now);
        seen.collect(&pair);

        for key in &seen.registered {
            for d in 0..pair.decode_ranks() {
                let ends = seen.ends.get(&(d, *key));
                let n = ends.map_or(0, Vec::len);
                assert_eq!(n, 1, "{key} ended {n} times on decode rank {d}: {ends:?}");
            }
        }
        for key in &seen.finished {
            for p in 0..pair.prefill_ranks() {
                let back = seen.given_back.get(&(p, *key));
                let n = back.map_or(0, Vec::len);
                assert_eq!(
                    n, 1,
                    "{key} given back {n} times on prefill rank {p}: {back:?}"
                );
            }
        }
        assert_eq!(pair.prefill_held(), 0, "prefill holds blocks at the end");
        assert_eq!(
            pair.decode_held(),
            0,
            "decode holds registrations at the end"
        );
        // Without prefill's word, only where a connection broke (and only past the bound).
        assert!(seen.disconnected || pair.released_unconfirmed() == 0);
    }

    /// The cases the property test shrank its failures to, kept as they were (the strategy's
    /// seeds in `proptest-regressions/` stop naming them once the strategy changes).
    #[test]
    fn the_interleavings_that_failed_once() {
        let (t, a) = (2, 0);
        run(
            (1, 1),
            &[
                Step::Progress {
                    transfer: t,
                    attempt: a,
                    tokens: 4,
                    layers: None,
                    elsewhere: false,
                },
                Step::HoldTransfers(true),
                Step::Register {
                    transfer: t,
                    attempt: a,
                },
                Step::Seal {
                    transfer: t,
                    attempt: a,
                },
            ],
        );
        let (t, a) = (1, 0);
        run(
            (1, 1),
            &[
                Step::Seal {
                    transfer: t,
                    attempt: a,
                },
                Step::HoldTransfers(true),
                Step::Register {
                    transfer: t,
                    attempt: a,
                },
                Step::LoseNotice,
            ],
        );
    }

    /// Prefill and decode tensor-parallel sizes: equal, or either twice the other.
    fn sizes() -> impl Strategy<Value = (u32, u32)> {
        prop_oneof![Just((1, 1)), Just((1, 2)), Just((2, 1)), Just((2, 2))]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Whatever the order of both engines' calls, peers' messages, lost notices, slow
        /// writes and time: every registered request ends exactly once, a ready one holds all
        /// its KV, every finished request's blocks go back exactly once, and nothing stays held.
        #[test]
        fn every_interleaving_ends_each_request_once_and_holds_nothing(
            sizes in sizes(),
            steps in proptest::collection::vec(step(), 0..40),
        ) {
            run(sizes, &steps);
        }
    }
}
