//! The decode side: registers destinations with the producer ranks that will write here (push),
//! or reads the blocks itself (pull); counts completion notices and reports each request ready
//! or failed.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime};

use kvx_core::wire::{
    Abort, Capability, Claim, Completion, Heartbeat, Hello, Message, Registration, Role,
};
use kvx_core::{Attempt, BlockId, GroupBlocks, Rank, RequestBlocks, RequestId, TransferId};
use kvx_layout::{permute_for, plan, writers_for, Layout, PermutePlan, PlanError, PlanRequest};
use kvx_rdma::local_peer::{Process, TracerLeave};
use kvx_rdma::region::LocalRegion;
use kvx_rdma::transport::{Event, OpId, PeerId, Transport};
use kvx_rendezvous::{AttemptKey, Reason, Timestamp, Waiter, WaiterAction, WaiterConfig};
use tracing::{debug, info, warn};

use crate::cache::{register_cache, KvCache};
use crate::config::{ConnectorConfig, QUIESCE_MARGIN};
use crate::control::{self, ControlSender, Dialled};
use crate::driver::{self, Clock, CommandSender, Io, Mailbox, PostError, Posts, Refused, Sending};
use crate::error::{Closed, LinkError, StartError, TransferError};
use crate::stats::{Stats, StatsSnapshot};
use board::{BoardSlots, Disarmed, PollHints, SharedBoard, BOARD_SLOTS};
use engine::EngineRegistration;

mod board;
mod connect;
mod driven;
mod ending;
mod engine;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzz;
#[cfg(test)]
mod sim;
mod transfer;

/// A remotely prefilled request whose blocks decode has allocated (push mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushRequest {
    /// The router's transfer id and the attempt.
    pub key: AttemptKey,
    /// Decode's request id.
    pub request: RequestId,
    /// The prefill instance's control address (its rank 0; rank r listens on port + r).
    pub prefill: SocketAddr,
    /// Prompt tokens whose KV is wanted.
    pub num_tokens: u64,
    /// Leading tokens decode already has (prefix-cache hit, a whole number of blocks).
    pub skip_tokens: u64,
    /// Decode's blocks for the request, in token order from token 0.
    pub blocks: Vec<BlockId>,
    /// Decode's blocks in the further KV cache groups of a hybrid model (none for a model of
    /// one group; as many as prefill's).
    pub groups: Vec<GroupBlocks>,
    /// The router's grant for the transfer (`kvx_capability`): checked here before any
    /// connection, then sent with the registration. Required where this side has a deployment
    /// key.
    pub capability: Option<Capability>,
    /// The request's trace (`kvx_trace`, W3C): the consumer's `kvx.receive` span for it is a
    /// child of it.
    pub trace: Option<crate::trace::TraceContext>,
}

/// A prefilled request to read from the prefill instance (pull mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullRequest {
    /// The request as in push mode.
    pub push: PushRequest,
    /// The prefill's block ids for the request, relayed by the router.
    pub producer_blocks: Vec<BlockId>,
    /// The prefill's blocks in the further KV cache groups, relayed likewise.
    pub producer_groups: Vec<GroupBlocks>,
}

/// What became of a request the consumer waited for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecvEvent {
    /// Every producer rank's KV is in decode's blocks: the request may decode.
    Ready {
        /// The attempt.
        key: AttemptKey,
        /// Decode's request.
        request: RequestId,
    },
    /// The KV will not arrive: never decode this request on its blocks.
    Failed {
        /// The attempt.
        key: AttemptKey,
        /// Decode's request.
        request: RequestId,
        /// Why.
        reason: Reason,
        /// Detail for logs.
        detail: String,
    },
}

pub(crate) enum Command {
    Push(PushRequest),
    Pull(PullRequest),
    Cancel {
        transfer: TransferId,
        attempt: Option<Attempt>,
    },
    /// The engine dropped a request of `transfer` that was never registered here.
    Abandon {
        prefill: SocketAddr,
        transfer: TransferId,
        capability: Option<Capability>,
    },
    /// A message from one rank of a prefill instance, over connection `ConnId`.
    /// A producer rank's message, holding its connection's place in the queue until handled.
    Peer(SocketAddr, Rank, ConnId, Message, control::Queued),
    /// That connection closed.
    PeerClosed(SocketAddr, Rank, ConnId, String),
    /// A helper thread's handshake with one rank of a prefill instance ended.
    Handshaken(SocketAddr, Rank, Result<Dialled, LinkError>),
    /// The engine thread registered a request itself and the driver must look again (a
    /// deadline moved closer, the transport needs reading, an action or a message waits).
    Wake,
    Shutdown,
}

/// Requests for a prefill instance whose ranks are still being connected, and the ranks whose
/// handshake runs on a helper thread: a prefill that answers slowly, or never, delays only the
/// requests that go to it.
#[derive(Default)]
struct Connecting {
    ranks: HashSet<Rank>,
    queued: Vec<(PushRequest, Option<RequestBlocks>)>,
    /// Transfers the engine dropped before registering them, to tell every rank about once
    /// connected (see [`Consumer::abandon`]).
    abandons: Vec<(TransferId, Option<Capability>)>,
}

/// How often the driver reads the notice board while a failed request waits for a writer rank
/// whose confirmation would land there, or (and its transport) while a writer rank's first
/// contact is due.
const BOARD_POLL: Duration = Duration::from_millis(2);

/// How often [`Consumer::wait_events`] looks at the notice board, where notices land without
/// waking anyone.
const BOARD_LOOK: Duration = Duration::from_micros(250);

/// How often, at most, the engine thread reads a transport whose peers' writes need this side's
/// reads now and then (libfabric `shm`: each write holds a slot of decode's command queue, about
/// 1,024, until decode reads), while requests wait in the board and none landed meanwhile, the
/// first time an interval after the wait began. It reads right after a request landed anyway.
/// Reading at every step cost far more: `shm`'s read takes a spin lock that the writer holds
/// while it copies into this process, and the writer, posting piece after piece, can keep it for
/// milliseconds (reads of 3 to 10 ms were seen during 16,384-token transfers).
const ENGINE_READ_INTERVAL: Duration = Duration::from_millis(50);

/// The longest wait between the driver's reads of its transport while a writer rank's first
/// contact is due. The reads start 2 ms apart and double: a writer's first write may come soon
/// (its prefill was done) or after a long prompt's compute, and once contact is made (which the
/// driver cannot see) each read only risks spinning on `shm`'s lock while the writer copies.
const MAX_CONTACT_POLL: Duration = Duration::from_millis(64);

/// Heartbeat intervals that a registration lasts at prefill without a heartbeat.
const HEARTBEATS_PER_LEASE: u32 = 3;

/// How long a prefill instance that could not be connected is not tried again: the requests
/// for it meanwhile fail at once with the same error.
const RETRY_UNREACHABLE: Duration = Duration::from_secs(1);

/// How often the processes of producer ranks whose connection was lost are looked at while a
/// failed request waits for them (a process seen to exit releases its requests' blocks at once).
const LOST_LOOK: Duration = Duration::from_millis(100);

#[derive(Debug)]
struct Waiting {
    request: RequestId,
    /// When it was registered (push) or its reads posted (pull).
    registered: Timestamp,
    instance: SocketAddr,
    writers: Vec<Rank>,
    notices: Vec<u64>,
    permute: Option<PermutePlan>,
    pull: bool,
    /// The router's grant, sent with the registration and with an abort.
    capability: Option<Capability>,
    /// The request's `kvx.receive` span (disabled without a trace): it ends with the request.
    span: tracing::Span,
    /// What a producer rank said when it failed the request, for the engine's event.
    cause: Option<String>,
}

/// A failed request whose blocks a write may still reach: push, a producer rank that has
/// neither delivered its notice nor answered with a failure notice (it answers the consumer's
/// abort only once its writes have ended); pull, this side's own reads in flight. The engine
/// hears of the failure, and may reuse the blocks, once all are quiet or `deadline` passed.
struct Quiescing {
    request: RequestId,
    reason: Reason,
    instance: SocketAddr,
    ranks: HashSet<Rank>,
    notices: Vec<u64>,
    reads: usize,
    /// Those of `ranks` whose control connection was lost: none can confirm any more, so each
    /// is waited for until its process is seen gone (where it runs on this host, `Some`) or
    /// `deadline`. A lost connection alone never ends the wait: the process may live on (a
    /// network fault, a connection it closed) with its writes posted.
    lost: HashMap<Rank, Option<Process>>,
    /// What a producer rank said when it failed the request.
    cause: Option<String>,
    /// How long it waits at most, from the failure.
    bound: Duration,
    deadline: Timestamp,
}

/// A producer rank whose control connection was just lost, as `Machine::give_up` needs it for
/// the requests that fail with it.
#[derive(Clone, Copy, Debug)]
struct LostRank {
    /// Its process, where it runs on this host.
    process: Option<Process>,
    /// Its process is known to have exited: none of its writes can land any more.
    gone: bool,
    /// How long its writes may run (its hello's `write_timeout_ms`).
    write_timeout: Duration,
}

impl Quiescing {
    fn quiet(&self) -> bool {
        self.ranks.is_empty() && self.reads == 0
    }
}

/// Which control connection a reader thread serves: commands from a connection that was since
/// replaced (its instance lost and reconnected) are ignored.
type ConnId = u64;

struct RankConn {
    id: ConnId,
    sender: ControlSender,
    hello: Hello,
    layout: Layout,
    peer: Option<PeerId>,
    /// A write of this rank has landed here: its transport has made first contact with this
    /// endpoint (see `Machine::awaiting_contact`).
    in_contact: bool,
    /// Its process, where it runs on this host (a Unix control socket says which).
    process: Option<Process>,
    /// Its leave to attach to this process, where the transport copies by cross-memory attach.
    _leave: Option<TracerLeave>,
}

struct Instance {
    ranks: HashMap<Rank, RankConn>,
    waiting: HashSet<AttemptKey>,
    /// On this engine's rank 0: the instance's ranks that write to no rank of this engine (they
    /// hold a replica of what another rank serves, [`kvx_layout::idle_producers`]). Told, for
    /// each request, that nothing of them is needed, so that they give their blocks back at
    /// once instead of at their lease; connected best effort ([`Machine::connect_idle`]): no
    /// request waits for them.
    idle: Vec<Rank>,
}

/// The decode side of the connector for one engine rank.
///
/// ```no_run
/// # fn demo(consumer: &kvx_vllm::Consumer) -> Result<(), kvx_vllm::Closed> {
/// use kvx_core::{Attempt, BlockId, RequestId, TransferId};
/// use kvx_rendezvous::AttemptKey;
/// use kvx_vllm::{PushRequest, RecvEvent};
///
/// consumer.request_allocated(PushRequest {
///     key: AttemptKey::new(TransferId(7), Attempt::FIRST),
///     request: RequestId(1),
///     prefill: "127.0.0.1:7100".parse().unwrap(),
///     num_tokens: 20,
///     skip_tokens: 0,
///     blocks: vec![BlockId(10), BlockId(11)],
///     groups: Vec::new(),
///     capability: None,
///     trace: None,
/// })?;
/// // Each engine step:
/// for event in consumer.take_events() {
///     match event {
///         RecvEvent::Ready { request, .. } => println!("{request} may decode"),
///         RecvEvent::Failed { request, reason, .. } => println!("{request} failed: {reason}"),
///     }
/// }
/// # Ok(()) }
/// ```
pub struct Consumer {
    /// Read first by every poll (see [`PollHints`]).
    hints: Arc<PollHints>,
    tx: CommandSender<Command>,
    events: Arc<Outbox>,
    board: Option<Arc<SharedBoard>>,
    /// The engine thread reads the transport's queue (`Capabilities::peer_rma_occasional_reads`)
    /// when a request landed in the board, and every [`ENGINE_READ_INTERVAL`] while requests
    /// wait there.
    engine_reads: bool,
    /// When the engine thread may read the transport next: nanoseconds from `started`.
    next_engine_read: AtomicU64,
    /// The engine thread's last look at the board found requests waiting there.
    board_waiting: AtomicBool,
    started: Instant,
    /// The state machine: the engine thread registers a push request itself when the state is
    /// free and the request's prefill is connected (with a notice board only, where the
    /// request then costs the driver thread no wake-up at all).
    driver: Arc<Mutex<Machine>>,
    stats: Arc<Stats>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Consumer {
    /// Registers the cache with the transport and starts the driver thread.
    ///
    /// # Errors
    /// [`StartError`] when a setting is zero that must not be, the cache is invalid or
    /// registration fails.
    pub fn start(
        config: ConnectorConfig,
        cache: KvCache,
        mut transport: Box<dyn Transport>,
    ) -> Result<Self, StartError> {
        config.validate()?;
        let (layout, regions) = register_cache(transport.as_mut(), cache)?;
        // Before the hello: the board's place is part of this endpoint's description.
        let hints = Arc::new(PollHints::default());
        let board = config
            .notice_board
            .then(|| transport.notice_board(BOARD_SLOTS))
            .flatten()
            .map(|b| Arc::new(SharedBoard::new(b, Arc::clone(&hints))));
        let (tx, rx) = driver::command_queue(transport.waker());
        let events = Arc::new(Outbox {
            hints: Arc::clone(&hints),
            events: Mailbox::default(),
        });
        let stats = Arc::new(Stats::default());
        let driver = Machine::new(
            config,
            layout,
            regions,
            transport,
            board.as_ref(),
            Clock::new(),
            tx.clone(),
            Arc::clone(&events),
            Arc::clone(&stats),
        )?;
        let occasional_reads = driver.occasional_reads;
        let rank = driver.layout.rank();
        let driver = Arc::new(Mutex::new(driver));
        let shared = Arc::clone(&driver);
        let thread = thread::Builder::new()
            .name(format!("kvx-decode-{}", rank.0))
            .spawn(move || driver::drive(&shared, &rx))
            .map_err(StartError::Thread)?;
        info!(%rank, "kvx consumer started");
        Ok(Self {
            hints,
            tx,
            events,
            board,
            engine_reads: occasional_reads,
            next_engine_read: AtomicU64::new(0),
            board_waiting: AtomicBool::new(false),
            started: Instant::now(),
            driver,
            stats,
            stop: Arc::new(AtomicBool::new(false)),
            thread: Some(thread),
        })
    }

    /// Decode allocated blocks for a remotely prefilled request (push): register them with the
    /// producer ranks that will write here. Never blocks the caller.
    ///
    /// # Errors
    /// [`Closed`] after shutdown.
    pub fn request_allocated(&self, request: PushRequest) -> Result<(), Closed> {
        if self.board.is_none() {
            return self.send(Command::Push(request));
        }
        // Never waits for the driver: if it is busy, the request goes through its queue.
        let Ok(mut driver) = self.driver.try_lock() else {
            return self.send(Command::Push(request));
        };
        let entry = driver.engine_register(request);
        drop(driver);
        let wake = match entry {
            EngineRegistration::Registered { wake } => wake,
            EngineRegistration::ThroughQueue(request) => return self.send(Command::Push(*request)),
            EngineRegistration::Closed => return Err(Closed),
        };
        if wake {
            // The request is registered: if the driver ended meanwhile, it reported the request
            // failed, and this call has succeeded all the same.
            let _ = self.tx.send(Command::Wake);
        }
        Ok(())
    }

    /// Reads a prefilled request's KV (pull mode), then tells prefill to free its blocks.
    ///
    /// # Errors
    /// [`Closed`] after shutdown.
    pub fn pull(&self, request: PullRequest) -> Result<(), Closed> {
        self.send(Command::Pull(request))
    }

    /// Gives up on a transfer (abort or preemption): the request is reported failed and the
    /// producer ranks are told.
    ///
    /// # Errors
    /// [`Closed`] after shutdown.
    pub fn cancel(&self, transfer: TransferId, attempt: Option<Attempt>) -> Result<(), Closed> {
        self.send(Command::Cancel { transfer, attempt })
    }

    /// The engine dropped a push request that was never handed to this consumer (aborted
    /// before decode allocated its blocks): every connected rank of the prefill instance whose
    /// rank 0 listens at `prefill` is told to give the transfer's KV back now, not at the end of
    /// its lease. A prefill instance this consumer has no connection to is connected first (as
    /// a registration would), unless it was found unreachable within the last second: then its
    /// lease frees the KV. A transfer another decode instance
    /// registered is not touched there.
    /// Not for pull: a pull transfer is never registered before it is read, so prefill would
    /// free it even while another decode reads it.
    ///
    /// # Errors
    /// [`Closed`] after shutdown.
    pub fn abandon(
        &self,
        prefill: SocketAddr,
        transfer: TransferId,
        capability: Option<Capability>,
    ) -> Result<(), Closed> {
        self.send(Command::Abandon {
            prefill,
            transfer,
            capability,
        })
    }

    /// What happened since the last call. Call it every engine step: it is also where push
    /// requests whose notices land in the transport's notice board (see
    /// [`ConnectorConfig::notice_board`]) are found ready.
    #[must_use]
    pub fn take_events(&self) -> Vec<RecvEvent> {
        self.wait_events(Duration::ZERO)
    }

    /// Like [`Consumer::take_events`], but when nothing happened yet waits up to `timeout` for
    /// the first event, and returns as soon as there is one: for an engine step with nothing
    /// to compute while requests wait for their KV, instead of a quick return and another
    /// step. A notice that lands in the notice board is seen within 0.25 ms; what the
    /// driver thread decides (a failure, a notice sent as a message) at once.
    #[must_use]
    pub fn wait_events(&self, timeout: Duration) -> Vec<RecvEvent> {
        let mut events = self.take_events_timed();
        // A plain poll (every engine step) reads no clock.
        if events.is_empty() && !timeout.is_zero() {
            let deadline = Instant::now() + timeout;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                self.events.wait(if self.board.is_some() {
                    left.min(BOARD_LOOK)
                } else {
                    left
                });
                events = self.take_events_timed();
                if !events.is_empty() {
                    break;
                }
            }
        }
        events.into_iter().map(|(event, _)| event).collect()
    }

    /// Like [`Consumer::take_events`], with the time each event was decided (a ready request:
    /// when its last notice arrived and any re-layout was done), for engines and benchmarks that
    /// poll less often than transfers finish.
    #[inline]
    pub fn take_events_timed(&self) -> Vec<(RecvEvent, SystemTime)> {
        // Inlined into the engine's loop: a step with nothing to report reads one flag word.
        if self.hints.idle() {
            return Vec::new();
        }
        self.collect_events()
    }

    #[inline(never)]
    fn collect_events(&self) -> Vec<(RecvEvent, SystemTime)> {
        let mut events = self.events.take();
        if let Some(board) = &self.board {
            let before = events.len();
            let (waiting, traced_ready) = board.collect(&self.stats, &mut events);
            // Right after a request landed its writer is most likely idle; otherwise now and
            // then while requests wait (their early writes hold queue slots too), the first
            // time an interval after the wait began: until then the writes of a writer in
            // contact land without a read, in the queue's room that the last read left.
            let landed = events.len() > before;
            if traced_ready {
                let _ = self.tx.send(Command::Wake);
            }
            let was_waiting = self.board_waiting.swap(waiting > 0, Ordering::Relaxed);
            if waiting > 0 && !was_waiting {
                self.defer_engine_read();
            }
            if self.engine_reads && (landed || (waiting > 0 && self.engine_read_due())) {
                self.read_transport();
            }
        }
        events
    }

    /// Counters, including requests waiting now.
    #[must_use]
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Seconds each request that became ready since the last call waited for its KV, from its
    /// registration (push) or the post of its reads (pull).
    #[must_use]
    pub fn take_wait_samples(&self) -> Vec<f64> {
        self.stats.take_waits()
    }

    /// A handle on the live counters, for another thread (a metrics endpoint).
    #[must_use]
    pub fn stats_reader(&self) -> crate::StatsReader {
        crate::StatsReader(std::sync::Arc::clone(&self.stats))
    }

    fn send(&self, command: Command) -> Result<(), Closed> {
        self.tx.send(command).map_err(|_| Closed)
    }

    /// Whether the engine thread's next read of the transport is due (then the one after is
    /// [`ENGINE_READ_INTERVAL`] away).
    fn engine_read_due(&self) -> bool {
        self.since_start() >= self.next_engine_read.load(Ordering::Relaxed)
    }

    /// The engine thread's next read of the transport comes an interval from now at the
    /// earliest.
    fn defer_engine_read(&self) {
        let at = self
            .since_start()
            .saturating_add(ENGINE_READ_INTERVAL.as_nanos() as u64);
        self.next_engine_read.fetch_max(at, Ordering::Relaxed);
    }

    /// Nanoseconds since the consumer started (the engine-read schedule's clock).
    fn since_start(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Reads the transport's queue once, on the engine thread, if the driver is not reading it
    /// (it is then waiting for commands, or busy with something else): peers' writes free the
    /// slots they took there. A few hundred nanoseconds when nothing came; what came is handled
    /// here, and the driver is woken only if that leaves it something to do.
    fn read_transport(&self) {
        self.defer_engine_read();
        let Ok(mut driver) = self.driver.try_lock() else {
            return;
        };
        let wake = driver.engine_read_transport();
        drop(driver);
        if wake {
            let _ = self.tx.send(Command::Wake);
        }
    }

    /// Stops the driver; every waiting request is reported failed.
    pub fn shutdown(&mut self) {
        if self.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        let _ = self.tx.send(Command::Shutdown);
        if let Some(handle) = self.thread.take() {
            let _ = handle.join();
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Where the driver leaves events for the engine thread, raising [`PollHints::news`] after.
pub(crate) struct Outbox {
    pub(crate) hints: Arc<PollHints>,
    pub(crate) events: Mailbox<(RecvEvent, SystemTime)>,
}

impl Outbox {
    fn push(&self, event: (RecvEvent, SystemTime)) {
        let mut events = self.events.lock();
        events.push(event);
        // After the event and under the lock: whoever sees the flag finds it, and a waiter
        // that found it unset is waiting before the wake-up below.
        self.hints.news.store(true, Ordering::Release);
        drop(events);
        self.events.wake();
    }

    /// Everything pushed before the flag was last seen set; an event pushed during the call is
    /// taken now or by the next call.
    fn take(&self) -> Vec<(RecvEvent, SystemTime)> {
        let news = &self.hints.news;
        if !news.load(Ordering::Acquire) || !news.swap(false, Ordering::AcqRel) {
            return Vec::new();
        }
        self.events.take()
    }

    /// Waits until the driver leaves an event or `timeout` passed.
    fn wait(&self, timeout: Duration) {
        let news = &self.hints.news;
        drop(
            self.events
                .wait_until(timeout, |_| news.load(Ordering::Acquire)),
        );
    }
}

/// One decode rank's state machine: its requests, its connections to prefill ranks, its reads
/// and notices awaited, and (held for its driver, [`driver::Io`]) its transport. The driver
/// thread feeds it ([`driver::Driven`]); the engine thread enters it only through the entries in
/// `engine.rs`.
pub(crate) struct Machine {
    config: ConnectorConfig,
    clock: Clock,
    layout: Layout,
    regions: Vec<LocalRegion>,
    /// Its I/O, as the driver holds it (the state machine only asks, through `posts`);
    /// the driver thread takes it out while it waits on it.
    io: Io,
    /// The I/O asked for and not yet carried out (see `driver::io`).
    posts: Posts,
    /// While the driver thread waits: until when, and whether on the transport.
    parked: Option<Parked>,
    /// The driver thread has ended.
    closed: bool,
    /// A request registered since the last look waits for message notices.
    transport_wanted: bool,
    /// A board notice came as a message (a producer whose transport writes no boards): from
    /// then on the driver reads its transport while any notice is due.
    board_notices_as_messages: bool,
    waiter: Waiter<Waiting>,
    hello: Hello,
    instances: HashMap<SocketAddr, Instance>,
    connecting: HashMap<SocketAddr, Connecting>,
    /// Instances whose connection failed recently, when and why.
    unreachable: HashMap<SocketAddr, (Timestamp, Arc<LinkError>)>,
    /// Idle ranks of an instance ([`Instance::idle`]) being connected, best effort: no
    /// request waits for them, and a failure only delays the next try (to the time kept).
    idle_links: HashMap<(SocketAddr, Rank), Option<Timestamp>>,
    /// What to tell each idle rank being connected once it is (bounded by `max_entries`).
    idle_pending: HashMap<(SocketAddr, Rank), Vec<Message>>,
    notices: HashMap<u64, (AttemptKey, Rank)>,
    /// This side asked the producers for `Finishing` hints (its transport polls to wait).
    finishing_hints: bool,
    /// Notices due: their producer rank has begun its final writes.
    hinted: HashSet<u64>,
    reads: HashMap<OpId, (AttemptKey, Rank)>,
    /// Pull: the ranks read from that have not answered their claim with `Held` yet, and
    /// whether the read from each has ended. A read counts only once both are in: before
    /// `Held`, the producer may have given the blocks back (its lease ran out), and what was
    /// read may be another request's.
    unheld: HashMap<(AttemptKey, Rank), bool>,
    quiescing: HashMap<AttemptKey, Quiescing>,
    /// The ranks of an instance whose connection is being given up on (`Machine::instance_lost`),
    /// while the requests that waited on it fail.
    lost_ranks: HashMap<SocketAddr, HashMap<Rank, LostRank>>,
    /// When the processes of lost ranks that failed requests wait for are looked at next.
    next_lost_look: Option<Timestamp>,
    /// The notice board's slots, where the transport has a board.
    board: Option<BoardSlots>,
    /// With a board, the transport still needs this side to read its queue now and then, and
    /// once before a new writer's first write lands (`Capabilities::peer_rma_occasional_reads`:
    /// libfabric `shm`). The consumer keeps the same flag as `engine_reads`.
    occasional_reads: bool,
    /// Board notices of writer ranks not yet in contact: while any is due, the driver reads its
    /// transport and watches the board for them, every 2 ms at first, then less and less often
    /// (`contact`).
    awaiting_contact: HashMap<u64, (SocketAddr, Rank)>,
    /// While `awaiting_contact` is not empty: how long the driver now waits between reads, and
    /// when it reads next.
    contact: (Duration, Timestamp),
    /// Requests the engine thread found ready in the board, still in the waiter.
    engine_ready: HashSet<AttemptKey>,
    /// The id of the next control connection.
    next_conn: ConnId,
    /// The transport's peers copy by cross-memory attach: each connected rank gets leave to
    /// attach to this process ([`TracerLeave`]).
    peers_attach: bool,
    next_heartbeat: Option<Timestamp>,
    tx: CommandSender<Command>,
    events: Arc<Outbox>,
    stats: Arc<Stats>,
    /// The re-layout kernels, for a CUDA cache that needs them (made on first use).
    #[cfg(feature = "cuda")]
    kernels: Option<kvx_rdma::cuda::kernels::LayoutKernels>,
}

/// How the driver thread waits.
#[derive(Clone, Copy, Debug)]
struct Parked {
    until: Option<Timestamp>,
    busy: bool,
}

impl Machine {
    /// The state machine of one consumer rank over `transport`, which holds `layout`'s
    /// registered cache (`regions`), with the notice board `board` where the transport has one;
    /// `tx` is its own command queue (for its connections' threads), `events` where it reports
    /// to the engine.
    ///
    /// # Errors
    /// [`StartError::WaiterConfig`] when the settings make an invalid waiter.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        config: ConnectorConfig,
        layout: Layout,
        regions: Vec<LocalRegion>,
        transport: Box<dyn Transport>,
        board: Option<&Arc<SharedBoard>>,
        clock: Clock,
        tx: CommandSender<Command>,
        events: Arc<Outbox>,
        stats: Arc<Stats>,
    ) -> Result<Self, StartError> {
        let mut waiter_config = WaiterConfig::default();
        waiter_config.max_waiting = config.max_entries;
        waiter_config.max_lease = config.registration_lease;
        // Transfer ids reach the waiter's table from peers too: a seed of this process's own.
        waiter_config.hash_seed = crate::config::random_seed();
        let waiter = Waiter::new(waiter_config)?;
        stats.set_rails(transport.rails());
        let peers_attach = crate::transport::peers_attach(transport.backend());
        let caps = transport.capabilities();
        // With a board, notices need nothing from this side, so no hints are asked for.
        let finishing_hints = config
            .finishing_hints
            .unwrap_or(caps.polls_to_wait && caps.peer_rma_unassisted && board.is_none());
        // libfabric `shm`: the board spares this side the notices, not the reads of its queue
        // that peers' writes need now and then (and for a new writer's first contact).
        let occasional_reads = board.is_some() && caps.peer_rma_occasional_reads;
        let hello = control::hello(
            &config,
            Role::Consumer,
            &layout,
            &transport.local_desc(),
            finishing_hints,
        );
        Ok(Self {
            clock,
            layout,
            regions,
            io: Io::new(transport, Sending::Queued),
            posts: Posts::default(),
            parked: None,
            closed: false,
            transport_wanted: false,
            board_notices_as_messages: false,
            waiter,
            hello,
            instances: HashMap::new(),
            connecting: HashMap::new(),
            unreachable: HashMap::new(),
            idle_links: HashMap::new(),
            idle_pending: HashMap::new(),
            notices: HashMap::new(),
            finishing_hints,
            hinted: HashSet::new(),
            reads: HashMap::new(),
            unheld: HashMap::new(),
            quiescing: HashMap::new(),
            lost_ranks: HashMap::new(),
            next_lost_look: None,
            board: board.map(|b| BoardSlots::new(Arc::clone(b))),
            occasional_reads,
            awaiting_contact: HashMap::new(),
            contact: (BOARD_POLL, Timestamp::ZERO),
            engine_ready: HashSet::new(),
            next_conn: 0,
            peers_attach,
            next_heartbeat: None,
            tx,
            events,
            stats,
            config,
            #[cfg(feature = "cuda")]
            kernels: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(transfer: u128) -> (RecvEvent, SystemTime) {
        (
            RecvEvent::Ready {
                key: AttemptKey::new(TransferId(transfer), Attempt::FIRST),
                request: RequestId(0),
            },
            SystemTime::UNIX_EPOCH,
        )
    }

    #[test]
    fn the_outbox_loses_no_event_and_costs_a_flag_when_empty() {
        let hints = Arc::new(PollHints::default());
        let outbox = Arc::new(Outbox {
            hints: Arc::clone(&hints),
            events: Mailbox::default(),
        });
        assert!(hints.idle() && outbox.take().is_empty());
        outbox.push(ready(1));
        assert!(!hints.idle());
        outbox.push(ready(2));
        assert_eq!(outbox.take().len(), 2);
        assert!(hints.idle(), "taken: the flag is down");
        // Pushed from another thread while the engine takes: every event is taken once.
        let pusher = {
            let outbox = Arc::clone(&outbox);
            thread::spawn(move || {
                for t in 0..10_000 {
                    outbox.push(ready(t));
                }
            })
        };
        let mut taken = 0;
        while !pusher.is_finished() {
            if !hints.idle() {
                taken += outbox.take().len();
            }
        }
        pusher.join().unwrap();
        taken += outbox.take().len();
        assert_eq!(taken, 10_000);
        assert!(hints.idle());
    }
}
