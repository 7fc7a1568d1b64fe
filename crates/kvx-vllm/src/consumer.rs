//! The decode side: registers destinations with the producer ranks that will write here (push),
//! or reads the blocks itself (pull); counts completion notices and reports each request ready
//! or failed.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime};

use kvx_core::wire::{Abort, Completion, Heartbeat, Hello, Message, Registration, Role};
use kvx_core::{Attempt, BlockId, Rank, RequestId, TransferId};
use kvx_layout::{permute_for, plan, writers_for, Layout, PermutePlan, PlanRequest};
use kvx_rdma::region::LocalRegion;
use kvx_rdma::transport::{Event, OpId, PeerId, Transport};
use kvx_rendezvous::{AttemptKey, Reason, Timestamp, Waiter, WaiterAction, WaiterConfig};
use tracing::{debug, info, warn};

use crate::board::{self, BoardSlots, Disarmed, PollHints, SharedBoard, BOARD_SLOTS};
use crate::cache::{register_cache, KvCache};
use crate::config::{ConnectorConfig, QUIESCE_MARGIN};
use crate::control::{self, ControlSender, ControlStream};
use crate::driver::{self, Clock, CommandSender, Mailbox};
use crate::error::{Closed, StartError};
use crate::stats::{Stats, StatsSnapshot};

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
}

/// A prefilled request to read from the prefill instance (pull mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullRequest {
    /// The request as in push mode.
    pub push: PushRequest,
    /// The prefill's block ids for the request, relayed by the router.
    pub producer_blocks: Vec<BlockId>,
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

enum Command {
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
    },
    /// A message from one rank of a prefill instance, over connection `ConnId`.
    Peer(SocketAddr, Rank, ConnId, Message),
    /// That connection closed.
    PeerClosed(SocketAddr, Rank, ConnId, String),
    /// A helper thread's handshake with one rank of a prefill instance ended.
    Handshaken(SocketAddr, Rank, Result<(ControlStream, Hello), String>),
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
    queued: Vec<(PushRequest, Option<Vec<BlockId>>)>,
    /// Transfers the engine dropped before registering them, to tell every rank about once
    /// connected (see [`Consumer::abandon`]).
    abandons: Vec<TransferId>,
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

#[derive(Debug)]
struct Waiting {
    request: RequestId,
    instance: SocketAddr,
    writers: Vec<Rank>,
    notices: Vec<u64>,
    permute: Option<PermutePlan>,
    pull: bool,
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
    /// How long it waits at most, from the failure.
    bound: Duration,
    deadline: Timestamp,
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
    /// endpoint (see `Driver::awaiting_contact`).
    in_contact: bool,
}

struct Instance {
    ranks: HashMap<Rank, RankConn>,
    waiting: HashSet<AttemptKey>,
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
    /// The driver's state: the engine thread registers a push request itself when the state is
    /// free and the request's prefill is connected (with a notice board only, where the
    /// request then costs the driver thread no wake-up at all).
    driver: Arc<Mutex<Driver>>,
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
        let mut waiter_config = WaiterConfig::default();
        waiter_config.max_waiting = config.max_entries;
        waiter_config.max_lease = config.registration_lease;
        let waiter = Waiter::new(waiter_config)?;
        let (tx, rx) = driver::command_queue(transport.waker());
        let events = Arc::new(Outbox {
            hints: Arc::clone(&hints),
            events: Mailbox::default(),
        });
        let stats = Arc::new(Stats::default());
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
        let rank = layout.rank();
        let driver = Driver {
            clock: Clock::new(),
            layout,
            regions,
            transport: Some(transport),
            parked: None,
            closed: false,
            backlogged: false,
            transport_wanted: false,
            board_notices_as_messages: false,
            waiter,
            hello,
            instances: HashMap::new(),
            connecting: HashMap::new(),
            unreachable: HashMap::new(),
            notices: HashMap::new(),
            finishing_hints,
            hinted: HashSet::new(),
            reads: HashMap::new(),
            quiescing: HashMap::new(),
            board: board.as_ref().map(|b| BoardSlots::new(Arc::clone(b))),
            occasional_reads,
            awaiting_contact: HashMap::new(),
            contact: (BOARD_POLL, Timestamp::ZERO),
            engine_ready: HashSet::new(),
            next_notice: 1,
            next_conn: 0,
            next_heartbeat: None,
            tx: tx.clone(),
            events: Arc::clone(&events),
            stats: Arc::clone(&stats),
            config,
            #[cfg(feature = "cuda")]
            kernels: None,
        };
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
        let mut driver = match self.driver.try_lock() {
            Ok(driver) => driver,
            Err(_) => return self.send(Command::Push(request)),
        };
        if driver.closed {
            return Err(Closed);
        }
        if !driver.registers_at_once(request.prefill) {
            drop(driver);
            return self.send(Command::Push(request));
        }
        // What the engine thread found ready is left for the driver's next turn: taking it
        // over here would queue actions, and so a wake-up.
        driver.start(request, None);
        let wake = driver.needs_wake();
        drop(driver);
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
    pub fn abandon(&self, prefill: SocketAddr, transfer: TransferId) -> Result<(), Closed> {
        self.send(Command::Abandon { prefill, transfer })
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
            let waiting = board.collect(&self.stats, &mut events);
            // Right after a request landed its writer is most likely idle; otherwise now and
            // then while requests wait (their early writes hold queue slots too), the first
            // time an interval after the wait began: until then the writes of a writer in
            // contact land without a read, in the queue's room that the last read left.
            let landed = events.len() > before;
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
        if driver.closed {
            return;
        }
        let Some(transport) = driver.transport.as_deref_mut() else {
            return;
        };
        let mut events = Vec::new();
        if let Err(e) = transport.poll(&mut events) {
            // The driver's next read meets it too, and handles it.
            debug!(error = %e, "transport poll failed on the engine thread");
            return;
        }
        if events.is_empty() {
            return;
        }
        for event in events {
            driver.on_event(event);
        }
        let wake = driver.needs_wake();
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
struct Outbox {
    hints: Arc<PollHints>,
    events: Mailbox<(RecvEvent, SystemTime)>,
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

struct Driver {
    config: ConnectorConfig,
    clock: Clock,
    layout: Layout,
    regions: Vec<LocalRegion>,
    /// The driver thread takes it out while it waits on it.
    transport: Option<Box<dyn Transport>>,
    /// While the driver thread waits: until when, and whether on the transport.
    parked: Option<Parked>,
    /// The driver thread has ended.
    closed: bool,
    /// A control message waits for a flush (its connection's send buffer was full).
    backlogged: bool,
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
    unreachable: HashMap<SocketAddr, (Timestamp, String)>,
    notices: HashMap<u64, (AttemptKey, Rank)>,
    /// This side asked the producers for `Finishing` hints (its transport polls to wait).
    finishing_hints: bool,
    /// Notices due: their producer rank has begun its final writes.
    hinted: HashSet<u64>,
    reads: HashMap<OpId, (AttemptKey, Rank)>,
    quiescing: HashMap<AttemptKey, Quiescing>,
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
    next_notice: u64,
    /// The id of the next control connection.
    next_conn: ConnId,
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

impl driver::Driven for Driver {
    type Command = Command;

    fn clock(&self) -> Clock {
        self.clock
    }

    fn wake_at(&mut self) -> Option<Timestamp> {
        // At least every heartbeat interval, even with nothing to do: a request the engine
        // thread registers then needs no wake-up to have its heartbeats (or its lease) looked
        // after in time.
        let idle_tick = self.clock.now() + self.config.heartbeat_interval;
        Some(self.deadline().map_or(idle_tick, |d| d.min(idle_tick)))
    }

    /// Whether the driver must read its transport while it waits: a notice, a finishing hint or
    /// a read is due there (a notice due in the board is not).
    fn busy(&self) -> bool {
        if self.finishing_hints {
            // Push notices are due only once their producer rank said so.
            !self.hinted.is_empty() || !self.reads.is_empty() || !self.quiescing.is_empty()
        } else {
            !self.reads.is_empty()
                || !self.quiescing.is_empty()
                || (self.board_notices_as_messages && !self.notices.is_empty())
                || self.notices.keys().any(|n| !board::is_board_notice(*n))
        }
    }

    fn parking(&mut self, until: Option<Timestamp>, busy: bool) {
        self.transport_wanted = false;
        self.parked = Some(Parked { until, busy });
    }

    fn woke(&mut self) {
        self.parked = None;
        self.stats.driver_turns.fetch_add(1, Ordering::Relaxed);
    }

    fn lend_transport(&mut self) -> Option<Box<dyn Transport>> {
        self.transport.take()
    }

    fn return_transport(&mut self, transport: Box<dyn Transport>) {
        self.transport = Some(transport);
    }

    fn transport(&mut self) -> Option<&mut (dyn Transport + 'static)> {
        self.transport.as_deref_mut()
    }

    fn is_shutdown(command: &Command) -> bool {
        matches!(command, Command::Shutdown)
    }

    fn command(&mut self, command: Command) {
        self.handle(command);
    }

    fn transport_event(&mut self, event: Event) {
        self.on_event(event);
    }

    fn tick(&mut self, now: Timestamp) {
        self.board_quiesce();
        self.first_contacts();
        self.waiter.handle_timeout(now);
        self.heartbeats(now);
        self.actions();
        // A notice that arrived, or a request that ended, needs no more reading for it.
        let notices = &self.notices;
        self.hinted.retain(|n| notices.contains_key(n));
        let overdue: Vec<AttemptKey> = self
            .quiescing
            .iter()
            .filter(|(_, q)| q.deadline <= now)
            .map(|(k, _)| *k)
            .collect();
        for key in overdue {
            warn!(%key, "producer ranks did not confirm the end of their writes in time");
            self.quiesced(key);
        }
        // Last: what this turn (or the engine thread) queued on a full connection.
        self.flush_backlogs();
    }

    fn stopped(&mut self, left: Vec<Command>) {
        self.finish_run();
        // What the engine queued behind the shutdown fails too, never silently.
        self.refuse_all(left);
    }
}

impl Driver {
    /// When the state machines next need the time.
    fn deadline(&mut self) -> Option<Timestamp> {
        let mut quiesce = self.quiescing.values().map(|q| q.deadline).min();
        if self.quiescing_on_board() {
            // Their writers confirm by writing the board, which wakes no one.
            let poll = self.clock.now() + BOARD_POLL;
            quiesce = Some(quiesce.map_or(poll, |q| q.min(poll)));
        }
        if !self.awaiting_contact.is_empty() {
            // A writer's first contact needs this side's transport read: each turn reads it
            // once (see `first_contacts`).
            let at = self.contact.1;
            quiesce = Some(quiesce.map_or(at, |q| q.min(at)));
        }
        [self.waiter.poll_timeout(), self.next_heartbeat, quiesce]
            .into_iter()
            .flatten()
            .min()
    }

    /// Whether the engine thread may register a push request for `instance` itself: every
    /// writer rank of it is connected.
    fn registers_at_once(&self, instance: SocketAddr) -> bool {
        !self.connecting.contains_key(&instance)
            && self.missing_ranks(instance).is_ok_and(|m| m.is_empty())
    }

    /// After the engine thread registered a request: whether the parked driver must look
    /// again.
    fn needs_wake(&mut self) -> bool {
        let Some(parked) = self.parked else {
            return true;
        };
        let deadline = self.deadline();
        let sooner = match (deadline, parked.until) {
            (Some(d), Some(until)) => d < until,
            (Some(_), None) => true,
            (None, _) => false,
        };
        // Only a message notice makes the driver read its transport (`busy`): checked without
        // scanning every notice due.
        let newly_busy = (std::mem::take(&mut self.transport_wanted) || !self.quiescing.is_empty())
            && !parked.busy;
        sooner || newly_busy || self.backlogged || self.waiter.has_actions()
    }

    /// Sends the control messages that waited for room in their connection.
    fn flush_backlogs(&mut self) {
        if !std::mem::take(&mut self.backlogged) {
            return;
        }
        for (addr, instance) in &self.instances {
            for (rank, conn) in &instance.ranks {
                if let Err(e) = conn.sender.flush() {
                    // Its reader sees the connection fail, and the instance is then lost.
                    warn!(%addr, %rank, error = %e, "cannot send to a prefill rank");
                }
            }
        }
    }

    /// Requests queued for a driver that has ended: each fails with `Shutdown`.
    fn refuse_all(&self, commands: Vec<Command>) {
        for command in commands {
            match command {
                Command::Push(request) | Command::Pull(PullRequest { push: request, .. }) => {
                    self.refuse(&request, Reason::Shutdown, "the consumer shut down".into());
                }
                _ => {}
            }
        }
    }

    /// The end of the driver thread: every request still waited for fails.
    fn finish_run(&mut self) {
        self.closed = true;
        let now = self.clock.now();
        for (_, connecting) in std::mem::take(&mut self.connecting) {
            for (request, _) in connecting.queued {
                self.refuse(&request, Reason::Shutdown, "the consumer shut down".into());
            }
        }
        self.waiter.shutdown(now);
        self.actions();
        let keys: Vec<AttemptKey> = self.quiescing.keys().copied().collect();
        for key in keys {
            self.quiesced(key);
        }
        self.flush_backlogs();
        for instance in self.instances.values() {
            for conn in instance.ranks.values() {
                conn.sender.close();
            }
        }
        // Closed here, at shutdown, not whenever the engine drops its handle.
        drop(self.transport.take());
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Push(request) => self.start(request, None),
            Command::Pull(request) => self.start(request.push, Some(request.producer_blocks)),
            Command::Cancel { transfer, attempt } => {
                let now = self.clock.now();
                self.waiter.cancel(now, transfer, attempt, Reason::Aborted);
                let gone = self.take_queued(|r| {
                    r.key.transfer == transfer && attempt.is_none_or(|a| a == r.key.attempt)
                });
                for (request, _) in gone {
                    self.refuse(
                        &request,
                        Reason::Aborted,
                        "cancelled while connecting".into(),
                    );
                }
            }
            Command::Abandon { prefill, transfer } => self.abandon(prefill, transfer),
            Command::Handshaken(instance, rank, result) => {
                self.handshaken(instance, rank, result);
            }
            Command::Peer(addr, rank, conn, message) => {
                if self.is_current(addr, rank, conn) {
                    self.peer_message(addr, rank, message);
                }
            }
            Command::PeerClosed(addr, rank, conn, why) => {
                // The other ranks' readers report their closing too, after `instance_lost`
                // closed them: by then the instance may have been reconnected for a new
                // request, which their late reports must not fail.
                if self.is_current(addr, rank, conn) {
                    self.instance_lost(&addr, &why);
                }
            }
            Command::Wake | Command::Shutdown => {}
        }
    }

    /// Whether `conn` is the live control connection to `rank` of `instance`.
    fn is_current(&self, instance: SocketAddr, rank: Rank, conn: ConnId) -> bool {
        self.instances
            .get(&instance)
            .and_then(|i| i.ranks.get(&rank))
            .is_some_and(|c| c.id == conn)
    }

    /// Takes over a control connection whose handshake a helper thread finished: checks the
    /// producer's hello and starts the connection's reader.
    fn adopt(
        &mut self,
        instance: SocketAddr,
        rank: Rank,
        stream: ControlStream,
        hello: Hello,
    ) -> Result<(), String> {
        let addr = control::rank_addr(instance, rank);
        if hello.role != Role::Producer {
            return Err(format!("{addr} is not a producer"));
        }
        if hello.compat_hash != self.layout.spec().compat_hash() {
            return Err(format!(
                "{addr} serves an incompatible model: {:?} vs {:?}",
                hello.layout,
                self.layout.spec()
            ));
        }
        if hello.layout.tp_rank != rank.0 {
            return Err(format!(
                "{addr} says it is rank {}, expected {rank}",
                hello.layout.tp_rank
            ));
        }
        let layout = Layout::new(hello.layout.clone()).map_err(|e| e.to_string())?;
        // A restarted rank closes its connection (the instance is then dropped and reconnected
        // with the new incarnation's hello), so a live connection's metadata is current.
        let tx = self.tx.clone();
        let id = self.next_conn;
        self.next_conn += 1;
        debug!(%addr, local = stream.is_local(), "connected to a producer rank");
        if stream.is_local() {
            self.stats.local_connections.fetch_add(1, Ordering::Relaxed);
        }
        let sender = control::start(stream, format!("kvx-ctl-{addr}"), move |result| {
            let command = match result {
                Ok(m) => Command::Peer(instance, rank, id, m),
                Err(e) => Command::PeerClosed(instance, rank, id, e.to_string()),
            };
            tx.send(command).is_ok()
        })
        .map_err(|e| e.to_string())?;
        // The instance is known once a rank of it is connected: a prefill that cannot be
        // reached leaves nothing behind.
        let entry = self.instances.entry(instance).or_insert_with(|| Instance {
            ranks: HashMap::new(),
            waiting: HashSet::new(),
        });
        entry.ranks.insert(
            rank,
            RankConn {
                id,
                sender,
                hello,
                layout,
                peer: None,
                in_contact: false,
            },
        );
        Ok(())
    }

    /// The ranks of `instance` still to connect before a request can be registered with it:
    /// rank 0 first (its hello says the instance's TP size), then every writer.
    fn missing_ranks(&self, instance: SocketAddr) -> Result<Vec<Rank>, String> {
        let Some(known) = self.instances.get(&instance) else {
            return Ok(vec![Rank(0)]);
        };
        let Some(first) = known.ranks.get(&Rank(0)) else {
            return Ok(vec![Rank(0)]);
        };
        let writers =
            writers_for(&self.layout, first.layout.spec().tp_size).map_err(|e| e.to_string())?;
        Ok(writers
            .into_iter()
            .filter(|r| !known.ranks.contains_key(r))
            .collect())
    }

    /// The producer ranks that write to this rank (every one connected).
    fn writers(&self, instance: SocketAddr) -> Result<Vec<Rank>, String> {
        let tp = self.instances[&instance].ranks[&Rank(0)]
            .layout
            .spec()
            .tp_size;
        writers_for(&self.layout, tp).map_err(|e| e.to_string())
    }

    /// Handshakes with `rank` of `instance` on a helper thread (once at a time per rank); the
    /// result comes back as [`Command::Handshaken`].
    fn handshake_in_background(&mut self, instance: SocketAddr, rank: Rank) {
        let connecting = self.connecting.entry(instance).or_default();
        if !connecting.ranks.insert(rank) {
            return;
        }
        let addr = control::rank_addr(instance, rank);
        let hello = Message::Hello(self.hello.clone());
        let timeout = self.config.connect_timeout;
        let local = self.config.local_sockets;
        let tx = self.tx.clone();
        let spawned = thread::Builder::new()
            .name(format!("kvx-hs-{addr}"))
            .spawn(move || {
                let result = control::handshake(addr, &hello, timeout, local);
                let _ = tx.send(Command::Handshaken(instance, rank, result));
            });
        if let Err(e) = spawned {
            self.handshaken(
                instance,
                rank,
                Err(format!("cannot start a handshake with {addr}: {e}")),
            );
        }
    }

    /// A handshake ended: the connection is adopted, and once every writer of the instance is
    /// connected, the requests queued for it start; on failure they fail, and the instance is
    /// not tried again for [`RETRY_UNREACHABLE`].
    fn handshaken(
        &mut self,
        instance: SocketAddr,
        rank: Rank,
        result: Result<(ControlStream, Hello), String>,
    ) {
        let Some(connecting) = self.connecting.get_mut(&instance) else {
            // The instance failed meanwhile: this connection is not wanted (it closes).
            return;
        };
        connecting.ranks.remove(&rank);
        let next = result
            .and_then(|(stream, hello)| self.adopt(instance, rank, stream, hello))
            .and_then(|()| self.missing_ranks(instance));
        match next {
            Ok(missing) if missing.is_empty() => {
                let connecting = self.connecting.remove(&instance).unwrap_or_default();
                self.tell_abandoned(instance, &connecting.abandons);
                for (request, producer_blocks) in connecting.queued {
                    self.begin(request, producer_blocks);
                }
            }
            Ok(missing) => {
                for rank in missing {
                    self.handshake_in_background(instance, rank);
                }
            }
            Err(detail) => {
                let now = self.clock.now();
                self.unreachable.insert(instance, (now, detail.clone()));
                let connecting = self.connecting.remove(&instance).unwrap_or_default();
                if !connecting.abandons.is_empty() {
                    debug!(%instance, detail, dropped = connecting.abandons.len(), "cannot tell an unreachable prefill about dropped transfers; its lease frees them");
                }
                for (request, _) in connecting.queued {
                    self.refuse(&request, Reason::PeerFailed, detail.clone());
                }
            }
        }
    }

    fn start(&mut self, request: PushRequest, producer_blocks: Option<Vec<BlockId>>) {
        if let Some((reason, detail)) = self.refusal(request.key) {
            self.refuse(&request, reason, detail);
            return;
        }
        // An older attempt of the transfer still queued is superseded, as a waited one is.
        let key = request.key;
        let older = self.take_queued(|r| r.key.transfer == key.transfer);
        for (old, _) in older {
            self.refuse(
                &old,
                Reason::Superseded,
                format!("attempt {} replaces it", key.attempt.0),
            );
        }
        let instance = request.prefill;
        let missing = match self.missing_ranks(instance) {
            Ok(missing) if missing.is_empty() => {
                self.begin(request, producer_blocks);
                return;
            }
            Ok(missing) => missing,
            Err(detail) => {
                self.refuse(&request, Reason::PeerFailed, detail);
                return;
            }
        };
        match self.connect_ranks(instance, missing) {
            Ok(connecting) => connecting.queued.push((request, producer_blocks)),
            Err(detail) => self.refuse(&request, Reason::PeerFailed, detail),
        }
    }

    /// Connects the `missing` ranks of `instance` (a handshake already running is not started
    /// again) and returns what waits for them; `Err` with the reason while the instance counts
    /// as unreachable (for [`RETRY_UNREACHABLE`] after a failed connection).
    fn connect_ranks(
        &mut self,
        instance: SocketAddr,
        missing: Vec<Rank>,
    ) -> Result<&mut Connecting, String> {
        if !self.connecting.contains_key(&instance) {
            if let Some((at, why)) = self.unreachable.get(&instance) {
                if self.clock.now() < *at + RETRY_UNREACHABLE {
                    return Err(why.clone());
                }
            }
            self.unreachable.remove(&instance);
        }
        for rank in missing {
            self.handshake_in_background(instance, rank);
        }
        Ok(self.connecting.entry(instance).or_default())
    }

    /// Takes the requests queued for a connection that `pick` selects out of their queues.
    fn take_queued(
        &mut self,
        pick: impl Fn(&PushRequest) -> bool,
    ) -> Vec<(PushRequest, Option<Vec<BlockId>>)> {
        let mut taken = Vec::new();
        for connecting in self.connecting.values_mut() {
            let (out, kept) = std::mem::take(&mut connecting.queued)
                .into_iter()
                .partition(|(r, _)| pick(r));
            connecting.queued = kept;
            taken.extend(out);
        }
        taken
    }

    /// Registers (push) or reads (pull) a request whose prefill instance is connected.
    fn begin(&mut self, request: PushRequest, producer_blocks: Option<Vec<BlockId>>) {
        if let Err(detail) = self.try_start(&request, producer_blocks) {
            self.refuse(&request, Reason::PeerFailed, detail);
        }
    }

    /// The request fails before anything was registered for it.
    fn refuse(&self, request: &PushRequest, reason: Reason, detail: String) {
        warn!(key = %request.key, detail, "request cannot be served");
        self.push_event(RecvEvent::Failed {
            key: request.key,
            request: request.request,
            reason,
            detail,
        });
    }

    /// Why `key` cannot be waited for, if it cannot: checked before anything is sent, since a
    /// second wait for an attempt would share the first one's notices and release.
    fn refusal(&self, key: AttemptKey) -> Option<(Reason, String)> {
        if let Some(waited) = self.waiter.attempt_of(key.transfer) {
            if key.attempt == waited {
                return Some((
                    Reason::Duplicate,
                    "this attempt is already waited for".into(),
                ));
            }
            if key.attempt < waited {
                return Some((
                    Reason::Stale,
                    format!("attempt {} of this transfer is waited for", waited.0),
                ));
            }
        }
        // A queued request counts as waited for; a newer attempt replaces it (see `start`).
        let queued = self
            .connecting
            .values()
            .flat_map(|c| &c.queued)
            .find(|(r, _)| r.key.transfer == key.transfer && r.key.attempt >= key.attempt);
        if let Some((r, _)) = queued {
            return Some(if r.key.attempt == key.attempt {
                (
                    Reason::Duplicate,
                    "this attempt is already waited for".into(),
                )
            } else {
                (
                    Reason::Stale,
                    format!(
                        "attempt {} of this transfer waits for its prefill's connection",
                        r.key.attempt.0
                    ),
                )
            });
        }
        self.quiescing.contains_key(&key).then(|| {
            (
                Reason::Duplicate,
                "this attempt failed and its blocks are still being released".into(),
            )
        })
    }

    fn try_start(
        &mut self,
        request: &PushRequest,
        producer_blocks: Option<Vec<BlockId>>,
    ) -> Result<(), String> {
        let now = self.clock.now();
        let key = request.key;
        let instance = request.prefill;
        let num_tokens = u32::try_from(request.num_tokens).map_err(|_| "too many tokens")?;
        let skip_tokens = u32::try_from(request.skip_tokens).map_err(|_| "too many tokens")?;
        let writers = self.writers(instance)?;
        let any_producer = self.instances[&instance].ranks[&writers[0]].layout.clone();
        let permute = permute_for(
            &any_producer,
            &self.layout,
            request.num_tokens,
            request.skip_tokens,
            &request.blocks,
        )
        .map_err(|e| e.to_string())?;
        if permute.is_some() && !self.can_permute() {
            return Err(
                "a memory-order re-layout is needed but this build cannot re-lay-out the cache's \
                 memory (host memory, or CUDA memory with the `cuda` feature)"
                    .into(),
            );
        }
        let pull = producer_blocks.is_some();
        let mut waiting = Waiting {
            request: request.request,
            instance,
            writers: writers.clone(),
            notices: Vec::new(),
            permute,
            pull,
        };
        let lease = self.config.registration_lease;
        // Prefill keeps a registration for a few heartbeats at a time: one whose decode went
        // silent (a driver stuck, a peer that answers TCP but no longer this protocol) goes
        // long before decode's own lease would end.
        let producer_lease = lease.min(self.config.heartbeat_interval * HEARTBEATS_PER_LEASE);
        if let Some(producer_blocks) = producer_blocks {
            if let Err(detail) = self.post_reads(request, &producer_blocks, &writers) {
                if !self.reads.values().any(|(k, _)| *k == key) {
                    return Err(detail);
                }
                // Reads from other ranks are in flight into the request's blocks: the failure
                // waits for them like any other, so that the engine cannot reuse the blocks
                // under them.
                warn!(%key, detail, "request cannot be served");
                self.give_up(key, waiting, Reason::PeerFailed);
                return Ok(());
            }
        } else {
            // Board notices where the request needs nothing done once its KV is in (no
            // re-layout) and the board has room; message notices otherwise.
            let on_board = match (&mut self.board, &waiting.permute) {
                (Some(slots), None) => slots.take(now, writers.len()),
                _ => None,
            };
            if let (Some(notices), Some(slots)) = (&on_board, &self.board) {
                slots
                    .shared
                    .arm(key, request.request, writers.clone(), notices);
            }
            for (index, &rank) in writers.iter().enumerate() {
                let notice = if let Some(notices) = &on_board {
                    notices[index]
                } else {
                    let n = self.next_notice;
                    self.next_notice = self.next_notice % u64::from(u32::MAX) + 1;
                    n
                };
                self.notices.insert(notice, (key, rank));
                let conn = &self.instances[&instance].ranks[&rank];
                if on_board.is_none() {
                    self.transport_wanted = true;
                } else if self.occasional_reads && !conn.in_contact {
                    if self.awaiting_contact.is_empty() {
                        self.contact = (BOARD_POLL, now + BOARD_POLL);
                    }
                    self.awaiting_contact.insert(notice, (instance, rank));
                }
                waiting.notices.push(notice);
                let registration = Message::Registration(Registration {
                    transfer: key.transfer,
                    attempt: key.attempt,
                    request: request.request,
                    consumer: self.config.engine,
                    consumer_incarnation: self.config.incarnation,
                    consumer_rank: self.layout.rank(),
                    num_tokens,
                    skip_tokens,
                    lease_ms: u32::try_from(producer_lease.as_millis()).unwrap_or(u32::MAX),
                    notice,
                    blocks: request.blocks.clone(),
                });
                // Never blocks (the engine thread may be the caller): a full send buffer
                // leaves the registration for the driver to flush.
                let sent = conn.sender.send_or_queue(&registration).map(|queued| {
                    self.backlogged |= queued;
                });
                if let Err(e) = sent {
                    let detail = format!("cannot register with {rank}: {e}");
                    self.notices.remove(&notice);
                    waiting.notices.pop();
                    // The notices of the ranks not registered with are never written.
                    if let (Some(notices), Some(slots)) = (&on_board, &mut self.board) {
                        slots.give_back(now, &notices[index..], |_| true);
                    }
                    if index == 0 {
                        if let Some(slots) = &self.board {
                            let _ = slots.shared.disarm(key);
                        }
                        return Err(detail);
                    }
                    // The ranks registered already may write (early): they are told to stop,
                    // and the failure waits for them like any other.
                    warn!(%key, detail, "request cannot be served");
                    waiting.writers.truncate(index);
                    self.claim(key, &waiting);
                    self.give_up(key, waiting, Reason::PeerFailed);
                    return Ok(());
                }
            }
        }
        self.instances
            .get_mut(&instance)
            .expect("connected")
            .waiting
            .insert(key);
        self.stats.held.fetch_add(1, Ordering::Relaxed);
        debug!(%key, writers = writers.len(), pull, "registered");
        self.waiter.expect(now, key, writers, lease, waiting);
        if self.next_heartbeat.is_none() {
            self.next_heartbeat = Some(now + self.config.heartbeat_interval);
        }
        Ok(())
    }

    fn post_reads(
        &mut self,
        request: &PushRequest,
        producer_blocks: &[BlockId],
        writers: &[Rank],
    ) -> Result<(), String> {
        let instance = request.prefill;
        let mut layouts = Vec::new();
        for &rank in writers {
            let transport = self
                .transport
                .as_deref_mut()
                .ok_or("the transport is in use (reads are posted by the driver thread)")?;
            let conn = self
                .instances
                .get_mut(&instance)
                .and_then(|i| i.ranks.get_mut(&rank))
                .ok_or("not connected")?;
            if conn.peer.is_none() {
                let desc =
                    control::peer_desc(&conn.hello).ok_or("unreadable endpoint description")?;
                conn.peer = Some(transport.connect(&desc).map_err(|e| e.to_string())?);
            }
            layouts.push(conn.layout.clone());
        }
        let planned = plan(&PlanRequest {
            producers: &layouts,
            consumer: &self.layout,
            num_tokens: request.num_tokens,
            skip_tokens: request.skip_tokens,
            producer_blocks,
            consumer_blocks: &request.blocks,
            only_producer: None,
        })
        .map_err(|e| e.to_string())?;
        for &rank in writers {
            let peer = self.instances[&instance].ranks[&rank]
                .peer
                .expect("connected above");
            let op = self
                .transport
                .as_deref_mut()
                .ok_or("the transport is in use")?
                .read(peer, planned.ops_for(rank))
                .map_err(|e| format!("cannot post reads from {rank}: {e}"))?;
            self.reads.insert(op, (request.key, rank));
            self.stats.bytes_written.fetch_add(
                planned
                    .ops_for(rank)
                    .iter()
                    .map(kvx_layout::CopyOp::bytes)
                    .sum(),
                Ordering::Relaxed,
            );
        }
        Ok(())
    }

    fn peer_message(&mut self, instance: SocketAddr, rank: Rank, message: Message) {
        let now = self.clock.now();
        match message {
            Message::Finishing(f) if f.producer_rank == rank => {
                self.stats.finishing_hints.fetch_add(1, Ordering::Relaxed);
                let key = AttemptKey::new(f.transfer, f.attempt);
                let due: Vec<u64> = self
                    .notices
                    .iter()
                    .filter(|(_, (k, r))| *k == key && *r == rank)
                    .map(|(n, _)| *n)
                    .collect();
                debug!(%key, %rank, due = due.len(), "finishing");
                self.hinted.extend(due);
            }
            // Each producer rank speaks for itself only, on its own connection.
            Message::Failure(f) if f.rank == rank => {
                let key = AttemptKey::new(f.transfer, f.attempt);
                debug!(%key, reason = ?f.reason, detail = f.detail, "producer reported failure");
                if let Some(q) = self.quiescing.get_mut(&key) {
                    q.ranks.remove(&f.rank);
                    if q.quiet() {
                        self.quiesced(key);
                    }
                    return;
                }
                // That rank is quiet: it sends a failure only once its writes have ended, and
                // its notice will not come.
                self.notices
                    .retain(|_, (k, rank)| !(*k == key && *rank == f.rank));
                self.waiter.failure(now, key, Reason::from_peer(f.reason));
            }
            Message::Hello(_) | Message::Heartbeat(_) => {}
            _ => warn!(%instance, "unexpected message from a producer"),
        }
    }

    fn instance_lost(&mut self, instance: &SocketAddr, why: &str) {
        let Some(lost) = self.instances.remove(instance) else {
            return;
        };
        warn!(%instance, why, "prefill instance lost");
        // Its writers are gone: none of their writes can land any more (a connection is
        // declared dead only after 25 s of silence, longer than any write takes). This side's
        // own reads from it are still waited for: they land until they end or fail.
        let gone: Vec<AttemptKey> = self
            .quiescing
            .iter_mut()
            .filter(|(_, q)| q.instance == *instance)
            .map(|(k, q)| {
                q.ranks.clear();
                *k
            })
            .collect();
        for key in gone {
            if self.quiescing.get(&key).is_some_and(Quiescing::quiet) {
                self.quiesced(key);
            }
        }
        let now = self.clock.now();
        for key in lost.waiting {
            self.waiter.failure(now, key, Reason::PeerFailed);
        }
        for conn in lost.ranks.values() {
            conn.sender.close();
            // Its endpoint (connected for pull) is forgotten once its reads in flight end.
            if let Some(peer) = conn.peer {
                let shared = self
                    .instances
                    .values()
                    .any(|i| i.ranks.values().any(|r| r.peer == Some(peer)));
                if let Some(transport) = self.transport.as_deref_mut().filter(|_| !shared) {
                    transport.disconnect(peer);
                }
            }
        }
    }

    fn on_event(&mut self, event: Event) {
        let now = self.clock.now();
        match event {
            Event::Notice(notice) => {
                let armed = self.notices.get(&notice.0).is_some_and(|(key, _)| {
                    self.board
                        .as_ref()
                        .is_some_and(|b| b.shared.seen_elsewhere(*key, notice.0))
                });
                if armed {
                    // The engine thread reports it with the request's other notices.
                    self.board_notices_as_messages = true;
                    return;
                }
                if let Some((key, rank)) = self.notices.remove(&notice.0) {
                    if let Some(q) = self.quiescing.get_mut(&key) {
                        q.ranks.remove(&rank);
                        if q.quiet() {
                            self.quiesced(key);
                        }
                        return;
                    }
                    debug!(%key, %rank, "notice");
                    self.waiter.completion(now, key, rank);
                } else {
                    debug!(
                        notice = notice.0,
                        "notice for nothing waited (late or stale)"
                    );
                }
            }
            Event::ReadDone { op, .. } | Event::Failed { op, .. }
                if self
                    .reads
                    .get(&op)
                    .is_some_and(|(k, _)| self.quiescing.contains_key(k)) =>
            {
                let (key, _) = self.reads.remove(&op).expect("checked");
                if let Some(q) = self.quiescing.get_mut(&key) {
                    q.reads -= 1;
                    if q.quiet() {
                        self.quiesced(key);
                    }
                }
            }
            Event::ReadDone { op, .. } => {
                if let Some((key, rank)) = self.reads.remove(&op) {
                    self.waiter.completion(now, key, rank);
                }
            }
            Event::Failed { op, error, .. } => {
                if let Some((key, _)) = self.reads.remove(&op) {
                    warn!(%key, %error, "read failed");
                    self.waiter.failure(now, key, Reason::TransferFailed);
                }
            }
            _ => {}
        }
    }

    fn heartbeats(&mut self, now: Timestamp) {
        let Some(at) = self.next_heartbeat else {
            return;
        };
        if now < at {
            return;
        }
        for instance in self.instances.values() {
            if instance.waiting.is_empty() {
                continue;
            }
            let message = Message::Heartbeat(Heartbeat {
                engine: self.config.engine,
                incarnation: self.config.incarnation,
                transfers: instance.waiting.iter().map(|k| k.transfer).collect(),
            });
            for conn in instance.ranks.values() {
                let _ = conn.sender.send(&message);
            }
        }
        self.next_heartbeat =
            (!self.waiter.is_empty()).then(|| now + self.config.heartbeat_interval);
    }

    /// Takes over what the engine thread found ready in the board: the waiter hears of every
    /// writer's notice, and the request's end is then not reported again.
    fn absorb_engine_ready(&mut self) {
        let Some(slots) = &self.board else {
            return;
        };
        let ready = slots.shared.take_ready();
        if ready.is_empty() {
            return;
        }
        let now = self.clock.now();
        for (key, ranks) in ready {
            self.engine_ready.insert(key);
            for rank in ranks {
                self.waiter.completion(now, key, rank);
            }
        }
    }

    /// Writer ranks whose first board notice has landed are in contact: their later writes need
    /// nothing from this side. Notices of requests that ended otherwise stop counting.
    fn first_contacts(&mut self) {
        let Some(slots) = &self.board else {
            return;
        };
        if self.awaiting_contact.is_empty() {
            return;
        }
        let now = self.clock.now();
        if now >= self.contact.1 {
            let every = (self.contact.0 * 2).min(MAX_CONTACT_POLL);
            self.contact = (every, now + every);
        }
        let landed: Vec<(SocketAddr, Rank)> = self
            .awaiting_contact
            .iter()
            .filter(|(n, _)| slots.shared.arrived(**n))
            .map(|(_, who)| *who)
            .collect();
        for (instance, rank) in &landed {
            if let Some(conn) = self
                .instances
                .get_mut(instance)
                .and_then(|i| i.ranks.get_mut(rank))
            {
                debug!(%instance, %rank, "writer rank in contact");
                conn.in_contact = true;
            }
        }
        let notices = &self.notices;
        self.awaiting_contact
            .retain(|n, who| notices.contains_key(n) && !landed.contains(who));
    }

    /// Whether a failed request waits for a writer rank whose notice would land in the board.
    fn quiescing_on_board(&self) -> bool {
        self.board.is_some()
            && self.quiescing.values().any(|q| {
                q.notices
                    .iter()
                    .any(|n| board::is_board_notice(*n) && self.notices.contains_key(n))
            })
    }

    /// Failed requests' notices that landed in the board count as their ranks' confirmation.
    fn board_quiesce(&mut self) {
        let Some(slots) = &self.board else {
            return;
        };
        let arrived: Vec<u64> = self
            .quiescing
            .values()
            .flat_map(|q| &q.notices)
            .filter(|n| self.notices.contains_key(n) && slots.shared.arrived(**n))
            .copied()
            .collect();
        for n in arrived {
            self.on_event(Event::Notice(kvx_rdma::transport::Notice(n)));
        }
    }

    /// Takes `key` back from the engine thread: `false` if it reported the request ready
    /// already (it is then forgotten here without a word). Notices of it already in the
    /// board count as arrived.
    fn claim(&mut self, key: AttemptKey, payload: &Waiting) -> bool {
        if self.engine_ready.remove(&key) {
            return false;
        }
        let Some(slots) = &self.board else {
            return true;
        };
        match slots.shared.disarm(key) {
            Disarmed::Ready => false,
            Disarmed::NotArmed => true,
            Disarmed::Pending(pending) => {
                for n in &payload.notices {
                    if !pending.contains(n) || slots.shared.arrived(*n) {
                        self.notices.remove(n);
                    }
                }
                true
            }
        }
    }

    fn actions(&mut self) {
        self.absorb_engine_ready();
        let actions: Vec<WaiterAction<Waiting>> = self.waiter.drain_actions().collect();
        for action in actions {
            match action {
                WaiterAction::Ready { key, payload } if !self.claim(key, &payload) => {
                    self.finish(key, &payload, false);
                }
                WaiterAction::Failed { key, payload, .. } if !self.claim(key, &payload) => {
                    self.finish(key, &payload, false);
                }
                WaiterAction::Ready { key, payload } => {
                    self.finish(key, &payload, true);
                    let relaid = payload
                        .permute
                        .as_ref()
                        .map_or(Ok(()), |permute| self.apply_permute(permute));
                    if let Err(detail) = relaid {
                        // Never report garbage as ready: the request fails (the engine
                        // recomputes or errors per its policy).
                        warn!(%key, detail, "re-layout failed");
                        if payload.pull {
                            self.tell_producers(key, &payload, true);
                        }
                        self.stats.transfers_failed.fetch_add(1, Ordering::Relaxed);
                        self.push_event(RecvEvent::Failed {
                            key,
                            request: payload.request,
                            reason: Reason::TransferFailed,
                            detail,
                        });
                        continue;
                    }
                    if payload.pull {
                        self.tell_producers(key, &payload, true);
                    }
                    self.stats.transfers_ok.fetch_add(1, Ordering::Relaxed);
                    debug!(%key, "ready");
                    self.push_event(RecvEvent::Ready {
                        key,
                        request: payload.request,
                    });
                }
                WaiterAction::Failed {
                    key,
                    payload,
                    reason,
                } => {
                    self.stats.held.fetch_sub(1, Ordering::Relaxed);
                    self.give_up(key, payload, reason);
                }
            }
        }
    }

    /// A request failed: its producers are told to stop (push) or free their blocks (pull), and
    /// the engine hears of it once nothing can land in its blocks any more: push, every rank
    /// whose notice (or failure notice) has not come is waited for; pull, its own reads.
    fn give_up(&mut self, key: AttemptKey, payload: Waiting, reason: Reason) {
        let ranks: HashSet<Rank> = payload
            .notices
            .iter()
            .filter_map(|n| self.notices.get(n))
            .map(|(_, rank)| *rank)
            .collect();
        let reads = self.reads.values().filter(|(k, _)| *k == key).count();
        let reachable = self.instances.contains_key(&payload.instance);
        if let Some(instance) = self.instances.get_mut(&payload.instance) {
            instance.waiting.remove(&key);
        }
        self.tell_producers(key, &payload, false);
        self.stats.transfers_failed.fetch_add(1, Ordering::Relaxed);
        let bound = self.quiesce_bound(payload.instance, &ranks, reads);
        let quiescing = Quiescing {
            request: payload.request,
            reason,
            instance: payload.instance,
            ranks,
            notices: payload.notices,
            reads,
            bound,
            deadline: self.clock.now() + bound,
        };
        // The producer instance gone: its writes can land no more, but this side's own reads
        // (pull) still may until they end.
        let quiet = quiescing.reads == 0 && (quiescing.ranks.is_empty() || !reachable);
        self.quiescing.insert(key, quiescing);
        if quiet {
            self.quiesced(key);
        }
    }

    /// How long a failed request's blocks stay held at most for `ranks` of `instance` to
    /// confirm that they write no more and for `reads` of this side's own to end: the
    /// configured bound, else the longest that any of them can run plus a margin.
    fn quiesce_bound(&self, instance: SocketAddr, ranks: &HashSet<Rank>, reads: usize) -> Duration {
        if let Some(fixed) = self.config.quiesce_timeout {
            return fixed;
        }
        let writes = self
            .instances
            .get(&instance)
            .into_iter()
            .flat_map(|i| ranks.iter().filter_map(|r| i.ranks.get(r)))
            .map(|conn| Duration::from_millis(conn.hello.write_timeout_ms.into()))
            .max()
            .unwrap_or_default();
        let own = if reads > 0 {
            self.config.transfer_timeout
        } else {
            Duration::ZERO
        };
        writes.max(own) + QUIESCE_MARGIN
    }

    /// A failed request's writers are quiet (or gone, or out of time): the engine may have its
    /// blocks back.
    fn quiesced(&mut self, key: AttemptKey) {
        let Some(q) = self.quiescing.remove(&key) else {
            return;
        };
        if let Some(slots) = &mut self.board {
            // A notice that never came may still be written: its slot waits before reuse.
            let notices = &self.notices;
            slots.give_back(self.clock.now(), &q.notices, |n| !notices.contains_key(&n));
        }
        for n in &q.notices {
            self.notices.remove(n);
        }
        self.reads.retain(|_, (k, _)| *k != key);
        let detail = if q.quiet() {
            String::new()
        } else {
            self.stats
                .released_unconfirmed
                .fetch_add(1, Ordering::Relaxed);
            warn!(
                key = %key,
                ranks = ?q.ranks,
                reads = q.reads,
                bound = ?q.bound,
                "blocks of a failed request released without every producer rank's confirmation"
            );
            format!(
                "released after {:?} without confirmation from producer ranks {:?} ({} reads in flight)",
                q.bound, q.ranks, q.reads
            )
        };
        self.push_event(RecvEvent::Failed {
            key,
            request: q.request,
            reason: q.reason,
            detail,
        });
    }

    /// A request's KV is in: forget it (`count` whether the `held` gauge still counts it: the
    /// engine thread uncounts what it finds ready in the board).
    fn finish(&mut self, key: AttemptKey, payload: &Waiting, count: bool) {
        for n in &payload.notices {
            self.notices.remove(n);
        }
        if let Some(slots) = &mut self.board {
            slots.give_back(self.clock.now(), &payload.notices, |_| true);
        }
        self.reads.retain(|_, (k, _)| *k != key);
        if let Some(instance) = self.instances.get_mut(&payload.instance) {
            instance.waiting.remove(&key);
        }
        if count {
            self.stats.held.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Tells every connected rank of `prefill` that the engine dropped `transfer` before
    /// registering it: each gives back what it holds for it.
    fn abandon(&mut self, prefill: SocketAddr, transfer: TransferId) {
        let missing = match self.missing_ranks(prefill) {
            Ok(missing) if missing.is_empty() => {
                self.tell_abandoned(prefill, &[transfer]);
                return;
            }
            Ok(missing) => missing,
            Err(detail) => {
                debug!(%prefill, %transfer, detail, "dropped before registration; its prefill cannot serve here");
                return;
            }
        };
        match self.connect_ranks(prefill, missing) {
            Ok(connecting) => {
                connecting.abandons.push(transfer);
                debug!(%prefill, %transfer, "dropped before registration; connecting to its prefill to say so");
            }
            Err(why) => {
                debug!(%prefill, %transfer, why, "dropped before registration; its prefill is unreachable");
            }
        }
    }

    /// Tells every connected rank of `prefill` that the engine dropped `transfers` before
    /// registering them.
    fn tell_abandoned(&mut self, prefill: SocketAddr, transfers: &[TransferId]) {
        let Some(instance) = self.instances.get(&prefill) else {
            return;
        };
        for &transfer in transfers {
            let message = Message::Abort(Abort {
                transfer,
                attempt: None,
                reason: "decode dropped the request before registering it".into(),
            });
            for conn in instance.ranks.values() {
                if let Ok(queued) = conn.sender.send_or_queue(&message) {
                    self.backlogged |= queued;
                }
            }
            debug!(%prefill, %transfer, ranks = instance.ranks.len(), "told prefill: dropped before registration");
        }
    }

    fn tell_producers(&mut self, key: AttemptKey, payload: &Waiting, done: bool) {
        let Some(instance) = self.instances.get(&payload.instance) else {
            return;
        };
        for rank in &payload.writers {
            let Some(conn) = instance.ranks.get(rank) else {
                continue;
            };
            let message = if done {
                Message::Completion(Completion {
                    transfer: key.transfer,
                    attempt: key.attempt,
                    producer: self.config.engine,
                    producer_rank: *rank,
                    bytes: 0,
                })
            } else {
                Message::Abort(Abort {
                    transfer: key.transfer,
                    attempt: Some(key.attempt),
                    reason: "consumer gave up".into(),
                })
            };
            // Never blocks: the engine thread may be the caller (a registration that failed
            // half-way); what a full connection does not take waits for the driver's flush.
            if let Ok(queued) = conn.sender.send_or_queue(&message) {
                self.backlogged |= queued;
            }
        }
    }

    /// Whether the cache's memory can be re-laid-out here: host memory on the CPU, CUDA memory
    /// with the layout kernels.
    fn can_permute(&self) -> bool {
        self.regions.iter().all(|r| {
            r.kind() == kvx_core::MemoryKind::Host
                || (cfg!(feature = "cuda") && matches!(r.kind(), kvx_core::MemoryKind::Cuda { .. }))
        })
    }

    /// Re-lays-out a finished request's chunks in place: with the GPU kernels for a CUDA cache
    /// (waiting until they ran), with [`Permute::apply`](kvx_layout::Permute::apply) for host
    /// memory.
    fn apply_permute(&mut self, permute: &PermutePlan) -> Result<(), String> {
        #[cfg(feature = "cuda")]
        if let Some(kvx_core::MemoryKind::Cuda { device }) = self.regions.first().map(|r| r.kind())
        {
            if self.kernels.is_none() {
                let gpu = kvx_rdma::cuda::Gpu::open(device).map_err(|e| e.to_string())?;
                self.kernels = Some(
                    kvx_rdma::cuda::kernels::LayoutKernels::new(&gpu).map_err(|e| e.to_string())?,
                );
            }
            let regions = &self.regions;
            let lookup = |i: u32| regions.get(i as usize).map(|r| (r.addr() as u64, r.len()));
            let Some(kernels) = self.kernels.as_mut() else {
                return Err("no layout kernels".into());
            };
            // SAFETY: the regions are the engine's CUDA KV cache, registered as valid device
            // memory for the connector's life (`LocalRegion`'s contract); every writer of these
            // chunks has finished and the engine does not touch them before the request is
            // reported ready, after the kernels have run (synchronised below).
            unsafe { kernels.permute(&permute.chunks, &lookup) }.map_err(|e| e.to_string())?;
            return kernels.synchronize().map_err(|e| e.to_string());
        }
        let mut scratch = Vec::new();
        for p in &permute.chunks {
            let Some(region) = self.regions.get(p.region as usize) else {
                continue;
            };
            let len = p.chunk_bytes();
            if p.offset + len > region.len() {
                continue;
            }
            // SAFETY: the region was registered from memory valid for reads and writes while the
            // connector runs (`LocalRegion`'s contract), it is host memory (checked when the
            // request started), and this chunk belongs to a request whose every writer has
            // finished: no transport writes it and the engine does not read it until the request
            // is reported ready, after this returns. The slice covers only this chunk.
            let chunk = unsafe {
                std::slice::from_raw_parts_mut(
                    (region.addr() + p.offset as usize) as *mut u8,
                    len as usize,
                )
            };
            p.apply(chunk, &mut scratch);
        }
        Ok(())
    }

    fn push_event(&self, event: RecvEvent) {
        self.events.push((event, SystemTime::now()));
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
