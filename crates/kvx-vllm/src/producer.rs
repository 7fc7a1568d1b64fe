//! The prefill side: a control listener for registrations, the rendezvous matcher, and a driver
//! thread that plans and posts the writes off the engine loop.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, SystemTime};

use kvx_core::wire::{FailureNotice, Finishing, Heartbeat, Hello, Message, Registration, Role};
use kvx_core::{Attempt, BlockId, EngineId, Incarnation, Rank, RequestId, TransferId};
use kvx_layout::{plan_layers, CopyOp, Layout, PlanError, PlanRequest};
use kvx_rdma::transport::{Event, Notice, OpId, PeerId, Transport};
use kvx_rendezvous::{
    Action, AttemptKey, Config, ConsumerId, Matcher, Reason, Timestamp, TransferOutcome,
};
use tracing::{debug, info, warn};

use crate::cache::{register_cache, KvCache};
use crate::config::ConnectorConfig;
use crate::control::{self, ControlSender, ControlStream};
use crate::driver::{self, Clock, CommandReceiver, CommandSender, Mailbox};
use crate::error::{Closed, StartError};
use crate::stats::{Stats, StatsSnapshot};

/// What became of a finished request's blocks: the engine may free them now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FinishedSending {
    /// The engine's request.
    pub request: RequestId,
    /// The attempt.
    pub key: AttemptKey,
    /// Whether the KV was delivered.
    pub outcome: SendOutcome,
}

/// Whether a request's KV reached its consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOutcome {
    /// Written, and the completion notice delivered (push), or read by the consumer (pull).
    Sent,
    /// Not delivered, and why (the consumer has been told where it needs to be).
    NotSent(Reason),
}

type ConnId = u64;

enum Command {
    Finished {
        key: AttemptKey,
        held: Held,
        pull: bool,
    },
    /// The KV of `key` is final (push), but the engine keeps its blocks until it finishes.
    Sealed {
        key: AttemptKey,
        held: Held,
    },
    Progress {
        key: AttemptKey,
        blocks: Vec<BlockId>,
        tokens: u64,
        /// The layers `tokens` are final in; `None`: all of them.
        layers: Option<u32>,
    },
    Abort {
        transfer: TransferId,
        attempt: Option<Attempt>,
    },
    Preempted(AttemptKey),
    Accepted(ConnId, ControlSender, Box<Hello>),
    Peer(ConnId, Message),
    PeerClosed(ConnId, String),
    Shutdown,
}

#[derive(Debug)]
struct Held {
    request: RequestId,
    blocks: Vec<BlockId>,
    num_tokens: u64,
}

impl Held {
    fn new(request: RequestId, blocks: Vec<BlockId>, num_tokens: u64) -> Self {
        Self {
            request,
            blocks,
            num_tokens,
        }
    }
}

#[derive(Debug)]
struct Dest {
    conn: ConnId,
    /// The transfer as the consumer knows it.
    key: AttemptKey,
    blocks: Vec<BlockId>,
    num_tokens: u64,
    skip_tokens: u64,
    notice: u64,
}

struct Consumer {
    id: ConsumerId,
    layout: Layout,
    peer: PeerId,
    /// It asked for a `Finishing` message before each transfer's final writes.
    finishing_hints: bool,
}

struct Conn {
    sender: ControlSender,
    consumer: Option<Consumer>,
    /// A router (`kvx proxy`): it may only abort transfers no consumer registered.
    router: bool,
    /// The matcher keys of the registrations that came over this connection, to abort if it
    /// closes. Those that ended are forgotten in batches (see [`Conn::remember`]).
    keys: HashSet<AttemptKey>,
    /// The size at which [`Conn::remember`] next forgets the keys that ended.
    forget_at: usize,
}

/// The fewest remembered keys at which a connection forgets those that ended.
const FORGET_AT_LEAST: usize = 64;

impl Conn {
    fn new(sender: ControlSender, consumer: Option<Consumer>) -> Self {
        Self {
            sender,
            consumer,
            router: false,
            keys: HashSet::new(),
            forget_at: FORGET_AT_LEAST,
        }
    }

    fn router(sender: ControlSender) -> Self {
        Self {
            router: true,
            ..Self::new(sender, None)
        }
    }

    /// Remembers `key`, first forgetting the keys the matcher no longer has once the set has
    /// doubled since the last time: amortised O(1), and the set stays within twice this
    /// connection's live registrations (or [`FORGET_AT_LEAST`]) however long it lives.
    fn remember<P, R>(&mut self, key: AttemptKey, matcher: &Matcher<P, R>, stats: &Stats) {
        if self.keys.len() >= self.forget_at {
            let before = self.keys.len();
            self.keys.retain(|k| matcher.is_live(*k));
            stats
                .remembered_registrations
                .fetch_sub((before - self.keys.len()) as u64, Ordering::Relaxed);
            self.forget_at = (2 * self.keys.len()).max(FORGET_AT_LEAST);
        }
        if self.keys.insert(key) {
            stats
                .remembered_registrations
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

struct Flight {
    started: std::time::Instant,
    bytes: u64,
    /// The matcher's key (per consumer rank).
    key: AttemptKey,
    ticket: Ticket,
    conn: ConnId,
    /// The transfer as the consumer knows it.
    original: AttemptKey,
    cancelled: Option<Reason>,
}

/// The prefill side of the connector for one engine rank.
///
/// Engine-facing calls never block on the network: they queue a command for the driver thread.
/// ```no_run
/// # fn demo(producer: &kvx_vllm::Producer) -> Result<(), kvx_vllm::Closed> {
/// use kvx_core::{Attempt, BlockId, RequestId, TransferId};
/// use kvx_rendezvous::AttemptKey;
///
/// let key = AttemptKey::new(TransferId(7), Attempt::FIRST);
/// producer.request_finished(key, RequestId(1), vec![BlockId(3), BlockId(4)], 20)?;
/// // Later, each engine step: free what is done.
/// for done in producer.take_finished() {
///     println!("free the blocks of {} ({:?})", done.request, done.outcome);
/// }
/// # Ok(()) }
/// ```
pub struct Producer {
    tx: CommandSender<Command>,
    finished: Arc<Mailbox<(FinishedSending, SystemTime)>>,
    stats: Arc<Stats>,
    addr: SocketAddr,
    /// A Unix socket listens beside the TCP listener (`ConnectorConfig::local_sockets`).
    local_listening: bool,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Producer {
    /// Registers the cache with the transport, listens on `config.listen` and starts the
    /// acceptor and driver threads.
    ///
    /// # Errors
    /// [`StartError`] when a setting is zero that must not be, the cache is invalid,
    /// registration fails or the address is taken.
    pub fn start(
        config: ConnectorConfig,
        cache: KvCache,
        mut transport: Box<dyn Transport>,
    ) -> Result<Self, StartError> {
        config.validate()?;
        let (layout, _regions) = register_cache(transport.as_mut(), cache)?;
        let mut matcher_config = Config::default();
        matcher_config.max_entries = config.max_entries;
        matcher_config.producer_lease = config.producer_lease;
        matcher_config.transfer_timeout = config.transfer_timeout;
        let matcher = Matcher::new(matcher_config)?;
        let listener = TcpListener::bind(config.listen).map_err(StartError::Listen)?;
        let addr = listener.local_addr().map_err(StartError::Listen)?;
        let (tx, rx) = driver::command_queue(transport.waker());
        let finished = Arc::new(Mailbox::default());
        let stats = Arc::new(Stats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let rank = layout.rank();
        let hello = control::hello(
            &config,
            Role::Producer,
            &layout,
            &transport.local_desc(),
            false,
        );
        let connect_timeout = config.connect_timeout;
        let peer_rma_unassisted = transport.capabilities().peer_rma_unassisted;
        let driver = Driver {
            clock: Clock::new(),
            rank,
            layout,
            transport: Some(transport),
            matcher,
            conns: HashMap::new(),
            flights: HashMap::new(),
            fanouts: HashMap::new(),
            unfanned: HashMap::new(),
            pull_held: HashMap::new(),
            peer_rma_unassisted,
            dead: HashMap::new(),
            max_dead: config.max_entries,
            streams: HashMap::new(),
            sealed: HashMap::new(),
            early: HashMap::new(),
            partials: HashMap::new(),
            nudged: HashMap::new(),
            engine: config.engine,
            incarnation: config.incarnation,
            expiry: BinaryHeap::new(),
            max_consumer_tp: 1,
            producer_lease: config.producer_lease,
            finished: Arc::clone(&finished),
            stats: Arc::clone(&stats),
        };
        let mut threads = Vec::new();
        threads.push(
            thread::Builder::new()
                .name(format!("kvx-prefill-{}", rank.0))
                .spawn(move || driver.run(rx))
                .map_err(StartError::Thread)?,
        );
        // Consumers on this host connect here (control.rs); without it, over TCP.
        let local = if config.local_sockets {
            control::listen_local(addr)
                .map_err(|e| debug!(%addr, error = %e, "no local control socket"))
                .ok()
        } else {
            None
        };
        let acceptor = Acceptor {
            tx: tx.clone(),
            stop: Arc::clone(&stop),
            hello: Message::Hello(hello),
            handshake_timeout: connect_timeout,
            next: Arc::new(AtomicU64::new(1)),
            open: Arc::new(AtomicUsize::new(0)),
        };
        let local_listening = local.is_some();
        if let Some(local) = local {
            threads.push(acceptor.clone().spawn(
                format!("kvx-accept-local-{}", rank.0),
                local,
                |a, l| a.run(l.incoming().map(|s| s.map(ControlStream::local))),
            )?);
        }
        threads.push(
            acceptor.spawn(format!("kvx-accept-{}", rank.0), listener, |a, l| {
                a.run(l.incoming().map(|s| s.map(ControlStream::tcp)))
            })?,
        );
        info!(%addr, %rank, local = local_listening, "kvx producer listening");
        Ok(Self {
            tx,
            finished,
            stats,
            addr,
            local_listening,
            stop,
            threads,
        })
    }

    /// This rank's control address (what decode connects to).
    #[must_use]
    pub fn control_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Prefill finished `key` (push): hold `blocks` until the registration arrives (or has
    /// arrived), then write them. The blocks come back through [`Producer::take_finished`].
    ///
    /// # Errors
    /// [`Closed`] after shutdown.
    pub fn request_finished(
        &self,
        key: AttemptKey,
        request: RequestId,
        blocks: Vec<BlockId>,
        num_tokens: u64,
    ) -> Result<(), Closed> {
        self.send(Command::Finished {
            key,
            held: Held::new(request, blocks, num_tokens),
            pull: false,
        })
    }

    /// The KV of `key` (push) is complete and final in `blocks`, although the engine has not
    /// finished the request yet: it is written, and decode told, as soon as decode has
    /// registered, instead of once the engine hands the blocks over. The blocks stay the
    /// engine's until [`Producer::request_finished`] for the same key (which must follow, for
    /// the same request and blocks, unless the engine aborts the request); only then can
    /// [`Producer::take_finished`] report them. Call it when the request will finish with
    /// these tokens (prefill for a remote decode: one output token). Should the engine abort
    /// it after all, hand the blocks over with [`Producer::request_finished`] anyway (its KV is
    /// complete and may be on its way): after [`Producer::abort`] the blocks are not reported
    /// back, and blocks the engine frees at once may still be being read.
    ///
    /// On a GPU, call this only once the request's kernels have completed (an event).
    ///
    /// # Errors
    /// [`Closed`] after shutdown.
    pub fn request_sealed(
        &self,
        key: AttemptKey,
        request: RequestId,
        blocks: Vec<BlockId>,
        num_tokens: u64,
    ) -> Result<(), Closed> {
        self.send(Command::Sealed {
            key,
            held: Held::new(request, blocks, num_tokens),
        })
    }

    /// Prefill of `key` (push) is still computing, and the KV of its first `computed_tokens`
    /// tokens is final in `blocks` (the request's blocks so far, in token order; the blocks
    /// handed to [`Producer::request_finished`] later must start with them). Once the consumer
    /// has registered, those tokens are written at once, while the rest is computed, so that
    /// only the tail is left when the request finishes. Optional: without progress reports the
    /// whole request is written at the end. The engine keeps the blocks until the request
    /// finishes or is aborted, as it does anyway for a running request.
    ///
    /// # Errors
    /// [`Closed`] after shutdown.
    pub fn request_progress(
        &self,
        key: AttemptKey,
        blocks: Vec<BlockId>,
        computed_tokens: u64,
    ) -> Result<(), Closed> {
        self.send(Command::Progress {
            key,
            blocks,
            tokens: computed_tokens,
            layers: None,
        })
    }

    /// Layer-wise progress of `key` (push): the engine is computing its tokens `..tokens`
    /// layer by layer, and layers `..layers` of them are final in `blocks`. Those layers are
    /// written at once, while the next layers compute, so that a request computed in one step
    /// leaves only its last layer for the finish. Tokens of an earlier
    /// [`Producer::request_progress`] stay final in every layer, and so do those of an earlier
    /// layer-wise report for fewer tokens (chunks compute in token order).
    ///
    /// On a GPU, call this only once the layers' kernels have completed (an event), as for
    /// [`Producer::request_progress`].
    ///
    /// # Errors
    /// [`Closed`] after shutdown.
    pub fn request_layer_progress(
        &self,
        key: AttemptKey,
        blocks: Vec<BlockId>,
        tokens: u64,
        layers: u32,
    ) -> Result<(), Closed> {
        self.send(Command::Progress {
            key,
            blocks,
            tokens,
            layers: Some(layers),
        })
    }

    /// Prefill finished `key` in pull mode: hold `blocks` until the consumer has read them and
    /// says so, or the producer lease runs out.
    ///
    /// # Errors
    /// [`Closed`] after shutdown.
    pub fn request_finished_pull(
        &self,
        key: AttemptKey,
        request: RequestId,
        blocks: Vec<BlockId>,
        num_tokens: u64,
    ) -> Result<(), Closed> {
        self.send(Command::Finished {
            key,
            held: Held::new(request, blocks, num_tokens),
            pull: true,
        })
    }

    /// Aborts one attempt, or every attempt, of a transfer.
    ///
    /// # Errors
    /// [`Closed`] after shutdown.
    pub fn abort(&self, transfer: TransferId, attempt: Option<Attempt>) -> Result<(), Closed> {
        self.send(Command::Abort { transfer, attempt })
    }

    /// The engine preempted the request at this attempt.
    ///
    /// # Errors
    /// [`Closed`] after shutdown.
    pub fn preempted(&self, key: AttemptKey) -> Result<(), Closed> {
        self.send(Command::Preempted(key))
    }

    /// Requests whose blocks the engine may free now (sent, or given up).
    #[must_use]
    pub fn take_finished(&self) -> Vec<FinishedSending> {
        self.wait_finished(Duration::ZERO)
    }

    /// Like [`Producer::take_finished`], but when nothing is there yet waits up to `timeout`
    /// for the first request to end, and returns as soon as one has: for an engine step with
    /// nothing to compute while blocks are held, instead of a quick return and another step.
    #[must_use]
    pub fn wait_finished(&self, timeout: Duration) -> Vec<FinishedSending> {
        self.finished
            .wait_take(timeout)
            .into_iter()
            .map(|(finished, _)| finished)
            .collect()
    }

    /// Like [`Producer::take_finished`], with the time each outcome was decided (sent: when
    /// the last write, and so its notice, had landed), for engines and benchmarks that poll
    /// less often than transfers finish.
    pub fn take_finished_timed(&self) -> Vec<(FinishedSending, SystemTime)> {
        self.finished.take()
    }

    /// Counters, including blocks held now.
    #[must_use]
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    fn send(&self, command: Command) -> Result<(), Closed> {
        self.tx.send(command).map_err(|_| Closed)
    }

    /// Stops the threads; every held block is reported through [`Producer::take_finished`].
    pub fn shutdown(&mut self) {
        if self.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        let _ = self.tx.send(Command::Shutdown);
        // Wake the acceptors.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if self.local_listening {
            let _ = control::connect_local(self.addr);
        }
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Most control connections a producer rank serves at once (each has a reader thread): decode
/// ranks connect once each, so this is far above any deployment's need, and a peer that opens
/// connections without end cannot exhaust the process's threads.
const MAX_CONTROL_CONNECTIONS: usize = 1024;

/// What accepts control connections, on the TCP listener and on the local one: both count
/// against one limit and number their connections from one counter.
#[derive(Clone)]
struct Acceptor {
    tx: CommandSender<Command>,
    stop: Arc<AtomicBool>,
    hello: Message,
    handshake_timeout: Duration,
    next: Arc<AtomicU64>,
    open: Arc<AtomicUsize>,
}

impl Acceptor {
    /// Accepts on `listener` on a thread of its own: `serve` runs [`Acceptor::run`] over its
    /// connections.
    fn spawn<L: Send + 'static>(
        self,
        name: String,
        listener: L,
        serve: fn(&Self, &L),
    ) -> Result<JoinHandle<()>, StartError> {
        thread::Builder::new()
            .name(name)
            .spawn(move || serve(&self, &listener))
            .map_err(StartError::Thread)
    }

    fn run(&self, incoming: impl Iterator<Item = std::io::Result<ControlStream>>) {
        for stream in incoming {
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    continue;
                }
            };
            let Some(slot) = ConnectionSlot::take(&self.open, MAX_CONTROL_CONNECTIONS) else {
                warn!(
                    limit = MAX_CONTROL_CONNECTIONS,
                    "too many control connections: refusing a new one"
                );
                let _ = stream.shutdown(std::net::Shutdown::Both);
                continue;
            };
            let conn = self.next.fetch_add(1, Ordering::Relaxed);
            let tx = self.tx.clone();
            let hello = self.hello.clone();
            let handshake_timeout = self.handshake_timeout;
            let spawned = thread::Builder::new()
                .name(format!("kvx-ctl-{conn}"))
                .spawn(move || {
                    let _slot = slot;
                    serve_connection(conn, stream, &tx, &hello, handshake_timeout);
                });
            if let Err(e) = spawned {
                warn!(error = %e, "cannot start a control connection thread");
            }
        }
    }
}

/// One of a bounded number of open control connections, given back on drop.
struct ConnectionSlot(Arc<AtomicUsize>);

impl ConnectionSlot {
    fn take(open: &Arc<AtomicUsize>, limit: usize) -> Option<Self> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < limit).then_some(n + 1)
        })
        .ok()
        .map(|_| Self(Arc::clone(open)))
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Answers the consumer's hello on the connection's own thread (so a busy driver never delays a
/// handshake), then forwards every later message to the driver.
fn serve_connection(
    conn: ConnId,
    mut stream: ControlStream,
    tx: &CommandSender<Command>,
    hello: &Message,
    handshake_timeout: Duration,
) {
    let handshake = (|| -> Result<(ControlSender, Hello), String> {
        stream
            .set_read_timeout(Some(handshake_timeout))
            .map_err(|e| e.to_string())?;
        let theirs = match control::read_message(&mut stream) {
            Ok(Message::Hello(h)) => h,
            Ok(_) => return Err("the first message was not a hello".into()),
            Err(e) => return Err(e.to_string()),
        };
        let sender = control::sender(&stream).map_err(|e| e.to_string())?;
        sender.send(hello).map_err(|e| e.to_string())?;
        stream.set_read_timeout(None).map_err(|e| e.to_string())?;
        Ok((sender, theirs))
    })();
    let (sender, theirs) = match handshake {
        Ok(h) => h,
        Err(why) => {
            debug!(conn, why, "handshake failed");
            let _ = stream.shutdown(std::net::Shutdown::Both);
            return;
        }
    };
    if tx
        .send(Command::Accepted(conn, sender, Box::new(theirs)))
        .is_err()
    {
        return;
    }
    control::read_loop(stream, |result| {
        let command = match result {
            Ok(message) => Command::Peer(conn, message),
            Err(e) => Command::PeerClosed(conn, e.to_string()),
        };
        tx.send(command).is_ok()
    });
}

/// The matcher's handle on a finished request's blocks: one per consumer rank the request
/// serves; the blocks go back to the engine when every ticket has come back.
#[derive(Debug)]
struct Ticket {
    key: AttemptKey,
}

/// A finished request fanned out to the consumer ranks this producer rank writes to.
struct Fanout {
    held: Held,
    pending: usize,
    outcome: SendOutcome,
}

/// What an expiry entry is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Hold {
    /// Finished blocks whose consumer ranks are not known yet (no registration so far).
    Unfanned,
    /// Pull-mode blocks waiting to be read.
    Pull,
    /// An aborted transfer remembered, so that its late prefill is released at once.
    Dead,
    /// A request still computing whose progress was reported (push).
    Stream,
}

/// A sealed request's blocks, which the engine has not handed over yet
/// ([`Producer::request_sealed`]).
#[derive(Debug)]
enum Sealed {
    /// Its transfer has not ended.
    Pending,
    /// Its transfer ended: reported once the engine finishes the request.
    Ended(FinishedSending, SystemTime),
    /// The engine aborted the request and frees the blocks itself: nothing is reported.
    Disowned,
}

/// How long an aborted transfer is remembered.
const DEAD_TTL: Duration = Duration::from_secs(300);

/// A request still computing (push): the blocks and tokens of its KV that are final.
struct Streaming {
    blocks: Vec<BlockId>,
    done: Final,
    deadline: Timestamp,
}

/// Which tokens of a computing request are final, per layer.
#[derive(Clone, Copy, Default)]
struct Final {
    /// Tokens `..computed` are final in every layer.
    computed: u64,
    /// Tokens `..tokens` are final in layers `..layers` (a step computing layer by layer).
    layered: Option<(u64, u32)>,
}

impl Final {
    /// Tokens final in `layer`.
    fn final_in(&self, layer: u32) -> u64 {
        match self.layered {
            Some((tokens, layers)) if layer < layers => tokens.max(self.computed),
            _ => self.computed,
        }
    }

    /// The state after a report that tokens `..tokens` are final in layers `..layers` (all of
    /// them for `None`, or `layers` at least `num_layers`).
    fn advanced(self, tokens: u64, layers: Option<u32>, num_layers: u32) -> Self {
        let (computed, layered) = match layers {
            Some(layers) if layers < num_layers => {
                // Layers only grow within a step, so a report for more tokens, or for as many
                // but fewer layers (in block units two steps can end in the same block), is a
                // new step: the last one ended. (A recomputation is reported first, as
                // progress that loses its blocks.)
                let computed = match self.layered {
                    Some((before, before_layers))
                        if tokens > before || (tokens == before && layers < before_layers) =>
                    {
                        self.computed.max(before)
                    }
                    _ => self.computed,
                };
                (computed, Some((tokens, layers)))
            }
            _ => (tokens, self.layered.filter(|&(t, _)| t > tokens)),
        };
        Self { computed, layered }
    }
}

/// Writes made to one consumer rank's registration before its request finished.
struct Early {
    /// Per layer `l`: tokens `..written[l]` are written or being written.
    written: Vec<u64>,
    /// The request's blocks changed under the early writes (the engine recomputed it elsewhere,
    /// e.g. after a preemption): no more early writes, and the final write rewrites everything.
    /// Early writes still in flight may carry stale bytes; the final write waits for them.
    reset: bool,
    /// Early writes not yet completed.
    in_flight: usize,
    /// Why an early write failed.
    failed: Option<String>,
    /// What must wait until the early writes have ended: the consumer may reuse its blocks
    /// once it hears of the outcome, so neither the final write (whose notice says that
    /// everything has landed) nor a failure notice may overtake them.
    deferred: Vec<Deferred>,
}

impl Early {
    fn new(num_layers: u32) -> Self {
        Self {
            written: vec![0; num_layers as usize],
            reset: false,
            in_flight: 0,
            failed: None,
            deferred: Vec::new(),
        }
    }
}

enum Deferred {
    /// The request finished and was matched: write the tail.
    Start {
        ticket: Ticket,
        dest: Dest,
        cancelled: Option<Reason>,
    },
    /// A registration will not be served: tell the consumer.
    Tell {
        conn: ConnId,
        key: AttemptKey,
        reason: Reason,
        /// The held registration itself was dropped (not a refused second one): the early
        /// writes' bookkeeping ends with it.
        ends: bool,
    },
}

struct PullHold {
    held: Held,
    deadline: Timestamp,
    readers: Option<Vec<Rank>>,
    done: Vec<Rank>,
}

/// The matcher key of `key` for consumer rank `rank`: each consumer rank this producer rank
/// serves registers on its own, so each is its own rendezvous.
/// An early write in flight.
struct Partial {
    /// Its matcher key.
    rkey: AttemptKey,
    /// The consumer's connection.
    conn: ConnId,
    /// When it was posted.
    posted: Timestamp,
}

/// How long an early write may wait before its consumer, if it asked for finishing hints (and
/// so reads its transport only when woken), is nudged to read it: on `shm` a write holds a slot
/// of the consumer's command queue until the consumer reads, and a full queue stops the writes.
const NUDGE_AFTER: Duration = Duration::from_millis(2);

/// The transport is open from start until shutdown.
const OPEN: &str = "the transport is open until shutdown";

/// How long a shutting-down producer lets its writes in flight end before it closes the
/// transport and tells their consumers that they failed.
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(2);

fn rank_key(key: AttemptKey, rank: Rank) -> AttemptKey {
    let mixed = key.transfer.0
        ^ (u128::from(kvx_core::ids::fnv1a_64(&rank.0.to_le_bytes())) << 64)
        ^ u128::from(rank.0);
    AttemptKey::new(TransferId(mixed), key.attempt)
}

struct Driver {
    clock: Clock,
    rank: Rank,
    layout: Layout,
    /// Open until [`Driver::shutdown`] closes it.
    transport: Option<Box<dyn Transport>>,
    matcher: Matcher<Ticket, Dest>,
    conns: HashMap<ConnId, Conn>,
    flights: HashMap<OpId, Flight>,
    fanouts: HashMap<AttemptKey, Fanout>,
    unfanned: HashMap<AttemptKey, (Held, Timestamp)>,
    pull_held: HashMap<AttemptKey, PullHold>,
    /// [`Capabilities::peer_rma_unassisted`](kvx_rdma::Capabilities::peer_rma_unassisted) of
    /// the transport: consumers' reads need no progress of this side.
    peer_rma_unassisted: bool,
    dead: HashMap<TransferId, (Option<Attempt>, Timestamp)>,
    /// Bound on `dead` (`max_entries`): aborts of transfers unknown here (a peer that sends
    /// many) cannot grow it without end; past it, a late finish waits for its lease instead.
    max_dead: usize,
    streams: HashMap<AttemptKey, Streaming>,
    /// Sealed requests the engine has not finished yet.
    sealed: HashMap<AttemptKey, Sealed>,
    /// Early writes, by matcher key (per consumer rank).
    early: HashMap<AttemptKey, Early>,
    /// Early writes in flight.
    partials: HashMap<OpId, Partial>,
    /// When each consumer connection that asked for finishing hints was last nudged.
    nudged: HashMap<ConnId, Timestamp>,
    /// This engine and incarnation (for nudges, which are empty heartbeats).
    engine: EngineId,
    incarnation: Incarnation,
    expiry: BinaryHeap<Reverse<(Timestamp, AttemptKey, Hold)>>,
    max_consumer_tp: u32,
    producer_lease: Duration,
    finished: Arc<Mailbox<(FinishedSending, SystemTime)>>,
    stats: Arc<Stats>,
}

impl driver::Driven for Driver {
    type Command = Command;

    fn clock(&self) -> Clock {
        self.clock
    }

    fn wake_at(&mut self) -> Option<Timestamp> {
        [
            self.matcher.poll_timeout(),
            self.expiry.peek().map(|Reverse((at, ..))| *at),
            self.next_nudge(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn busy(&self) -> bool {
        // Blocks held for pull are read by the consumer; where that needs this side's progress
        // (`tcp`: the reads are messages this side answers), keep reading the transport.
        !self.flights.is_empty()
            || !self.partials.is_empty()
            || (!self.pull_held.is_empty() && !self.peer_rma_unassisted)
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
        self.matcher.handle_timeout(now);
        self.expire(now);
        self.actions();
        self.nudge(now);
    }

    fn stopped(&mut self, left: Vec<Command>) {
        // Blocks the engine handed over behind the shutdown go back with the rest (a sealed
        // request's blocks go back when its finish comes).
        for command in left {
            if let Command::Finished { key, held, .. } = command {
                self.finished.push((
                    FinishedSending {
                        request: held.request,
                        key,
                        outcome: SendOutcome::NotSent(Reason::Shutdown),
                    },
                    SystemTime::now(),
                ));
            }
        }
        self.shutdown();
    }
}

impl Driver {
    /// The driver thread.
    fn run(self, rx: CommandReceiver<Command>) {
        driver::drive(&std::sync::Mutex::new(self), &rx);
    }

    fn handle(&mut self, command: Command) {
        let now = self.clock.now();
        match command {
            Command::Finished { key, held, pull } => {
                debug!(%key, tokens = held.num_tokens, pull, "request finished");
                if !pull && self.finish_sealed(key) {
                    return;
                }
                if self.holds(key) {
                    warn!(%key, "request finished twice; the second copy is ignored");
                    return;
                }
                self.take_over(now, key, held, pull);
            }
            Command::Sealed { key, held } => {
                debug!(%key, tokens = held.num_tokens, "request sealed");
                if self.sealed.contains_key(&key) || self.holds(key) {
                    warn!(%key, "request sealed twice, or after it finished; ignored");
                    return;
                }
                self.sealed.insert(key, Sealed::Pending);
                self.take_over(now, key, held, false);
            }
            Command::Progress {
                key,
                blocks,
                tokens,
                layers,
            } => self.progress(now, key, blocks, tokens, layers),
            Command::Abort { transfer, attempt } => {
                debug!(%transfer, ?attempt, "the engine aborted the request");
                self.disown(transfer, attempt);
                self.abort(now, transfer, attempt, Reason::Aborted);
            }
            Command::Preempted(key) => {
                self.streams.remove(&key);
                for rank in self.ranks_of(key) {
                    self.matcher.preempt(now, rank_key(key, rank));
                }
                if let Some((held, _)) = self.unfanned.remove(&key) {
                    self.give_back(key, held, SendOutcome::NotSent(Reason::Preempted));
                }
            }
            Command::Accepted(conn, sender, hello) if hello.role == Role::Router => {
                debug!(conn, engine = hello.engine.0, "router connected");
                self.conns.insert(conn, Conn::router(sender));
            }
            Command::Accepted(conn, sender, hello) => {
                let consumer = match accept_consumer(
                    &self.layout,
                    &hello,
                    self.transport.as_deref_mut().expect(OPEN),
                ) {
                    Ok(consumer) => {
                        self.max_consumer_tp =
                            self.max_consumer_tp.max(consumer.layout.spec().tp_size);
                        Some(consumer)
                    }
                    Err(why) => {
                        warn!(why, "refusing consumer");
                        sender.close();
                        None
                    }
                };
                self.conns.insert(conn, Conn::new(sender, consumer));
            }
            Command::Peer(conn, message) => self.peer_message(conn, message),
            Command::PeerClosed(conn, why) => {
                if let Some(c) = self.conns.remove(&conn) {
                    debug!(conn, why, "control connection closed");
                    // The transport forgets the consumer's endpoint (once its writes in flight
                    // end) unless another connection of the same endpoint still uses it.
                    if let Some(gone) = &c.consumer {
                        let shared = self
                            .conns
                            .values()
                            .any(|o| o.consumer.as_ref().is_some_and(|x| x.peer == gone.peer));
                        if !shared {
                            self.transport
                                .as_deref_mut()
                                .expect(OPEN)
                                .disconnect(gone.peer);
                        }
                    }
                    // The consumer is gone: its registrations will never be served.
                    self.stats
                        .remembered_registrations
                        .fetch_sub(c.keys.len() as u64, Ordering::Relaxed);
                    for key in c.keys {
                        self.matcher
                            .abort(now, key.transfer, Some(key.attempt), Reason::Aborted);
                    }
                }
            }
            Command::Shutdown => {}
        }
    }

    /// Whether the blocks of `key` are held here (finished, or sealed and not ended).
    fn holds(&self, key: AttemptKey) -> bool {
        self.fanouts.contains_key(&key)
            || self.unfanned.contains_key(&key)
            || self.pull_held.contains_key(&key)
    }

    /// Takes over the blocks of a finished (or sealed) request: given back at once if it was
    /// aborted, held for pull, written once its consumer ranks are known.
    fn take_over(&mut self, now: Timestamp, key: AttemptKey, held: Held, pull: bool) {
        if let Some(streaming) = self.streams.remove(&key) {
            // Progress only ever appends blocks; other ones mean a recomputation.
            if !held.blocks.starts_with(&streaming.blocks) {
                self.reset_early(key);
            }
        }
        self.stats.held.fetch_add(1, Ordering::Relaxed);
        let deadline = now + self.producer_lease;
        let aborted = self
            .dead
            .get(&key.transfer)
            .is_some_and(|(attempt, _)| attempt.is_none_or(|a| a == key.attempt));
        if aborted {
            self.give_back(key, held, SendOutcome::NotSent(Reason::Aborted));
        } else if pull {
            self.pull_held.insert(
                key,
                PullHold {
                    held,
                    deadline,
                    readers: None,
                    done: Vec::new(),
                },
            );
            self.expiry.push(Reverse((deadline, key, Hold::Pull)));
        } else if let Some(readers) = self.registered_readers(key) {
            self.fan_out(now, key, held, &readers);
        } else {
            self.unfanned.insert(key, (held, deadline));
            self.expiry.push(Reverse((deadline, key, Hold::Unfanned)));
        }
    }

    /// The engine finished a request it had sealed (the same request, with the same blocks):
    /// its blocks are this side's to give back now, at once if its transfer has ended. `false`
    /// when `key` was not sealed (or was disowned: this finish is a new one).
    fn finish_sealed(&mut self, key: AttemptKey) -> bool {
        match self.sealed.remove(&key) {
            None | Some(Sealed::Disowned) => false,
            Some(Sealed::Pending) => true,
            Some(Sealed::Ended(done, at)) => {
                self.finished.push((done, at));
                true
            }
        }
    }

    /// The engine aborted (one attempt of) `transfer` and frees its blocks itself: what it had
    /// sealed is not reported back (what ended is forgotten now, the rest when it ends).
    fn disown(&mut self, transfer: TransferId, attempt: Option<Attempt>) {
        self.sealed.retain(|k, sealed| {
            if k.transfer != transfer || attempt.is_some_and(|a| a != k.attempt) {
                return true;
            }
            let ended = matches!(sealed, Sealed::Ended(..));
            *sealed = Sealed::Disowned;
            !ended
        });
    }

    /// The consumer ranks that read `key` from this rank, if one of them registered it (and
    /// the matcher still holds that registration: for as long as decode's heartbeats keep it,
    /// however long prefill computes).
    fn registered_readers(&self, key: AttemptKey) -> Option<Vec<Rank>> {
        let producer_tp = self.layout.spec().tp_size;
        self.rank_keys(key).find_map(|rkey| {
            let dest = self.matcher.held_registration(rkey)?;
            let consumer = self.conns.get(&dest.conn)?.consumer.as_ref()?;
            kvx_layout::readers_for(self.rank, producer_tp, &consumer.layout).ok()
        })
    }

    /// Consumer ranks a key may have been registered under.
    fn ranks_of(&self, key: AttemptKey) -> Vec<Rank> {
        self.registered_readers(key)
            .unwrap_or_else(|| (0..self.max_consumer_tp).map(Rank).collect())
    }

    /// The matcher's keys of `key`, one per consumer rank that may register it.
    fn rank_keys(&self, key: AttemptKey) -> impl Iterator<Item = AttemptKey> {
        (0..self.max_consumer_tp).map(move |r| rank_key(key, Rank(r)))
    }

    fn abort(
        &mut self,
        now: Timestamp,
        transfer: TransferId,
        attempt: Option<Attempt>,
        reason: Reason,
    ) {
        let mixed: Vec<TransferId> = self
            .rank_keys(AttemptKey::new(transfer, Attempt(0)))
            .map(|k| k.transfer)
            .collect();
        for mixed in mixed {
            self.matcher.abort(now, mixed, attempt, reason);
        }
        let matches =
            |k: &AttemptKey| k.transfer == transfer && attempt.is_none_or(|a| a == k.attempt);
        let unfanned: Vec<AttemptKey> = self
            .unfanned
            .keys()
            .filter(|k| matches(k))
            .copied()
            .collect();
        for key in unfanned {
            if let Some((held, _)) = self.unfanned.remove(&key) {
                self.give_back(key, held, SendOutcome::NotSent(reason));
            }
        }
        let pulled: Vec<AttemptKey> = self
            .pull_held
            .keys()
            .filter(|k| matches(k))
            .copied()
            .collect();
        for key in pulled {
            if let Some(hold) = self.pull_held.remove(&key) {
                self.give_back(key, hold.held, SendOutcome::NotSent(reason));
            }
        }
        self.streams.retain(|k, _| !matches(k));
        if let Some((remembered, _)) = self.dead.get_mut(&transfer) {
            // Already remembered (its expiry is queued): another attempt widens it to all.
            if *remembered != attempt {
                *remembered = None;
            }
            return;
        }
        if self.dead.len() >= self.max_dead {
            debug!(%transfer, remembered = self.dead.len(), "too many aborted transfers remembered: a late finish of this one is held until its lease");
            return;
        }
        let until = now + DEAD_TTL;
        self.dead.insert(transfer, (attempt, until));
        self.expiry.push(Reverse((
            until,
            AttemptKey::new(transfer, Attempt(0)),
            Hold::Dead,
        )));
    }

    fn fan_out(&mut self, now: Timestamp, key: AttemptKey, held: Held, readers: &[Rank]) {
        self.fanouts.insert(
            key,
            Fanout {
                held,
                pending: readers.len(),
                outcome: SendOutcome::Sent,
            },
        );
        for &rank in readers {
            self.matcher
                .prefill_done(now, rank_key(key, rank), Ticket { key });
        }
    }

    /// Whether the consumer or router on `conn` may abort `transfer`: unless registrations of
    /// it came from other consumers only. A transfer nobody registered (prefill finished first,
    /// or pull) may be aborted by any consumer or router: its owner is not known.
    fn may_abort(&self, conn: ConnId, transfer: TransferId) -> bool {
        let Some(c) = self.conns.get(&conn) else {
            return false;
        };
        // A router is no registrant: it may abort only what nobody registered.
        let me = match (&c.consumer, c.router) {
            (Some(consumer), _) => Some(consumer.id),
            (None, true) => None,
            (None, false) => return false,
        };
        let mixed: Vec<TransferId> = self
            .rank_keys(AttemptKey::new(transfer, Attempt(0)))
            .map(|k| k.transfer)
            .collect();
        let registrants: HashSet<ConsumerId> = self
            .conns
            .values()
            .filter_map(|c| c.consumer.as_ref().map(|consumer| (c, consumer.id)))
            .filter(|(c, _)| c.keys.iter().any(|k| mixed.contains(&k.transfer)))
            .map(|(_, id)| id)
            .collect();
        if registrants.is_empty() || me.is_some_and(|me| registrants.contains(&me)) {
            return true;
        }
        if me.is_some() {
            warn!(
                conn,
                %transfer,
                "abort ignored: another decode instance registered this transfer"
            );
        } else {
            // A router abandons what it cannot tell a decode took in (a client that left):
            // a decode that registered keeps the transfer, as it should.
            debug!(conn, %transfer, "a router's abort ignored: a decode instance registered this transfer");
        }
        false
    }

    /// Whether a decode rank has finished reading `transfer` (pull) while others may still
    /// read it: a router's abort is refused then. (A read in progress before any rank finished
    /// is invisible here: a router must only abandon ids it never handed to a decode.)
    fn being_read(&self, transfer: TransferId) -> bool {
        let read = self
            .pull_held
            .iter()
            .any(|(k, hold)| k.transfer == transfer && hold.readers.is_some());
        if read {
            warn!(%transfer, "abort from a router ignored: a decode instance reads this transfer");
        }
        read
    }

    /// Whether nothing of `transfer` at `attempt` from the consumer rank on `conn` is
    /// registered or being written here: no live registration, no transfer in flight, no early
    /// write in flight.
    fn writes_nothing_for(&self, conn: ConnId, transfer: TransferId, attempt: Attempt) -> bool {
        let Some(c) = self.conns.get(&conn) else {
            return false;
        };
        let mixed: Vec<AttemptKey> = self.rank_keys(AttemptKey::new(transfer, attempt)).collect();
        let registered = c
            .keys
            .iter()
            .any(|k| mixed.contains(k) && self.matcher.is_live(*k));
        let flying = self
            .flights
            .values()
            .any(|f| f.conn == conn && f.original == AttemptKey::new(transfer, attempt));
        let early = mixed
            .iter()
            .any(|k| self.early.get(k).is_some_and(|e| e.in_flight > 0));
        !(registered || flying || early)
    }

    fn peer_message(&mut self, conn: ConnId, message: Message) {
        let now = self.clock.now();
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.router {
            match message {
                Message::Abort(abort) => {
                    if self.may_abort(conn, abort.transfer) && !self.being_read(abort.transfer) {
                        debug!(conn, transfer = %abort.transfer, reason = abort.reason, "a router abandons a transfer");
                        self.abort(now, abort.transfer, abort.attempt, Reason::Aborted);
                    }
                    self.stats.router_aborts.fetch_add(1, Ordering::Relaxed);
                }
                _ => warn!(conn, "a router may only send aborts: message ignored"),
            }
            return;
        }
        match message {
            Message::Hello(_) => warn!(conn, "second hello on a control connection ignored"),
            Message::Registration(reg) => self.registration(conn, now, reg),
            Message::Heartbeat(hb) => {
                if let Some(consumer) = &c.consumer {
                    let rank = consumer.layout.rank();
                    let id = consumer.id;
                    let transfers: Vec<TransferId> = hb
                        .transfers
                        .iter()
                        .map(|t| rank_key(AttemptKey::new(*t, Attempt(0)), rank).transfer)
                        .collect();
                    self.matcher.heartbeat(now, id, transfers);
                }
            }
            Message::Abort(abort) => {
                if self.may_abort(conn, abort.transfer) {
                    // Nothing of that attempt registered or in flight from this connection (a
                    // transfer that ended, a notice lost on the way): the consumer rank hears
                    // at once that nothing more will be written, instead of waiting for its
                    // bound. Decided before the abort: messages on a connection keep their
                    // order, so every registration sent before the abort is known here.
                    let quiet = abort
                        .attempt
                        .filter(|&attempt| self.writes_nothing_for(conn, abort.transfer, attempt));
                    self.abort(now, abort.transfer, abort.attempt, Reason::Aborted);
                    if let Some(attempt) = quiet {
                        self.tell_consumer(
                            conn,
                            AttemptKey::new(abort.transfer, attempt),
                            Reason::Aborted,
                            "nothing of it is registered or being written here",
                        );
                    }
                }
            }
            Message::Failure(f) => {
                if self.may_abort(conn, f.transfer) {
                    self.abort(now, f.transfer, Some(f.attempt), Reason::PeerFailed);
                }
            }
            Message::Completion(done) => {
                self.pull_done(conn, AttemptKey::new(done.transfer, done.attempt))
            }
            _ => warn!(conn, "unexpected message from a consumer"),
        }
    }

    /// Pull mode: a consumer rank has read the blocks; they go back once every reader has.
    fn pull_done(&mut self, conn: ConnId, key: AttemptKey) {
        let Some(consumer) = self.conns.get(&conn).and_then(|c| c.consumer.as_ref()) else {
            return;
        };
        let reader = consumer.layout.rank();
        let readers =
            kvx_layout::readers_for(self.rank, self.layout.spec().tp_size, &consumer.layout)
                .unwrap_or_else(|_| vec![reader]);
        let Some(hold) = self.pull_held.get_mut(&key) else {
            return;
        };
        let expected = hold.readers.get_or_insert(readers).clone();
        if !hold.done.contains(&reader) {
            hold.done.push(reader);
        }
        if expected.iter().all(|r| hold.done.contains(r)) {
            let hold = self.pull_held.remove(&key).expect("present");
            self.stats.transfers_ok.fetch_add(1, Ordering::Relaxed);
            self.give_back(key, hold.held, SendOutcome::Sent);
        }
    }

    fn registration(&mut self, conn: ConnId, now: Timestamp, reg: Registration) {
        let producer_tp = self.layout.spec().tp_size;
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let key = AttemptKey::new(reg.transfer, reg.attempt);
        let Some(consumer) = &c.consumer else {
            let _ = c.sender.send(&failure(
                key,
                self.rank,
                Reason::Conflict,
                "registration before hello",
            ));
            return;
        };
        if let Err(why) = check_destination(&consumer.layout, &reg) {
            let _ = c
                .sender
                .send(&failure(key, self.rank, Reason::Conflict, &why));
            return;
        }
        let readers = match kvx_layout::readers_for(self.rank, producer_tp, &consumer.layout) {
            Ok(r) if r.contains(&reg.consumer_rank) => r,
            Ok(_) | Err(_) => {
                let why = format!(
                    "{} does not write to consumer {}",
                    self.rank, reg.consumer_rank
                );
                let _ = c
                    .sender
                    .send(&failure(key, self.rank, Reason::Conflict, &why));
                return;
            }
        };
        let id = consumer.id;
        c.remember(rank_key(key, reg.consumer_rank), &self.matcher, &self.stats);
        let lease = Duration::from_millis(u64::from(reg.lease_ms));
        self.matcher.register(
            now,
            rank_key(key, reg.consumer_rank),
            id,
            lease,
            Dest {
                conn,
                key,
                blocks: reg.blocks,
                num_tokens: u64::from(reg.num_tokens),
                skip_tokens: u64::from(reg.skip_tokens),
                notice: reg.notice,
            },
        );
        if let Some((held, _)) = self.unfanned.remove(&key) {
            self.fan_out(now, key, held, &readers);
        } else if !self.fanouts.contains_key(&key) && self.streams.contains_key(&key) {
            self.stream(key, rank_key(key, reg.consumer_rank));
        }
    }

    /// Progress of a request still computing: write what is final to every consumer rank
    /// already registered.
    fn progress(
        &mut self,
        now: Timestamp,
        key: AttemptKey,
        blocks: Vec<BlockId>,
        tokens: u64,
        layers: Option<u32>,
    ) {
        let known = self.holds(key) || self.sealed.contains_key(&key);
        let aborted = self
            .dead
            .get(&key.transfer)
            .is_some_and(|(attempt, _)| attempt.is_none_or(|a| a == key.attempt));
        if known || aborted {
            return;
        }
        let deadline = now + self.producer_lease;
        let num_layers = self.layout.spec().num_layers;
        let before = self.streams.get(&key);
        let first = before.is_none();
        let fresh = Final::default().advanced(tokens, layers, num_layers);
        let mut streaming = Streaming {
            blocks,
            done: before.map_or(fresh, |s| s.done.advanced(tokens, layers, num_layers)),
            deadline,
        };
        // Final tokens never go back, and blocks are only ever appended: otherwise the engine
        // recomputes the request somewhere else (a preemption). What was final before says
        // nothing about the new blocks: the state starts over from this report, for consumer
        // ranks that register later; those already written to get everything at the finish.
        if before.is_some_and(|s| {
            !streaming.blocks.starts_with(&s.blocks)
                || (0..num_layers).any(|l| streaming.done.final_in(l) < s.done.final_in(l))
        }) {
            streaming.done = fresh;
            self.reset_early(key);
        }
        self.streams.insert(key, streaming);
        if first {
            // Refreshed progress moves the deadline; `expire` checks it when the entry surfaces.
            self.expiry.push(Reverse((deadline, key, Hold::Stream)));
        }
        for rank in self.ranks_of(key) {
            self.stream(key, rank_key(key, rank));
        }
    }

    /// Writes the tokens of `key` computed so far that the registration held under `rkey` has
    /// not received, in whole blocks of both sides, without a notice. The last token is always
    /// left for the final write, which carries the notice.
    fn stream(&mut self, key: AttemptKey, rkey: AttemptKey) {
        let Some(dest) = self.matcher.held_registration(rkey) else {
            return;
        };
        let Some(streaming) = self.streams.get(&key) else {
            return;
        };
        let num_layers = self.layout.spec().num_layers;
        let early = self
            .early
            .entry(rkey)
            .or_insert_with(|| Early::new(num_layers));
        if early.failed.is_some() || early.reset {
            return;
        }
        let Some(consumer) = self.conns.get(&dest.conn).and_then(|c| c.consumer.as_ref()) else {
            return;
        };
        let unit = lcm(
            u64::from(self.layout.spec().block_tokens),
            u64::from(consumer.layout.spec().block_tokens),
        );
        let last = dest.num_tokens.saturating_sub(1);
        let ranges: Vec<Range<u64>> = early
            .written
            .iter()
            .zip(0..)
            .map(|(&written, layer)| {
                let upto = streaming.done.final_in(layer).min(last) / unit * unit;
                written.max(dest.skip_tokens)..upto
            })
            .collect();
        if ranges.iter().all(Range::is_empty) {
            return;
        }
        let posted = plan_by_layer(
            &self.layout,
            &consumer.layout,
            &streaming.blocks,
            &dest.blocks,
            &ranges,
        )
        .map_err(|e| format!("cannot plan the early writes of {key}: {e}"))
        .and_then(|(ops, bytes)| {
            self.transport
                .as_deref_mut()
                .expect(OPEN)
                .write(consumer.peer, &ops, None)
                .map(|op| (op, bytes))
                .map_err(|e| format!("cannot post the early writes of {key}: {e}"))
        });
        match posted {
            Ok((op, bytes)) => {
                let (from, upto) = span(&ranges);
                let layers = ranges.iter().filter(|r| !r.is_empty()).count();
                debug!(%key, from, upto, layers, bytes, "early writes posted");
                for (written, range) in early.written.iter_mut().zip(ranges) {
                    *written = (*written).max(range.end);
                }
                early.in_flight += 1;
                let posted = self.clock.now();
                self.partials.insert(
                    op,
                    Partial {
                        rkey,
                        conn: dest.conn,
                        posted,
                    },
                );
                self.stats.bytes_written.fetch_add(bytes, Ordering::Relaxed);
                self.stats
                    .bytes_streamed
                    .fetch_add(bytes, Ordering::Relaxed);
            }
            Err(why) => self.early_failed(rkey, why),
        }
    }

    /// The blocks of `key` are not the ones written from: every consumer rank gets all of it
    /// again at the end.
    fn reset_early(&mut self, key: AttemptKey) {
        debug!(%key, "blocks changed under early writes; the finish rewrites everything");
        for rank in self.ranks_of(key) {
            if let Some(early) = self.early.get_mut(&rank_key(key, rank)) {
                early.written.fill(0);
                early.reset = true;
            }
        }
    }

    /// An early write could not be posted or failed: the registration is failed now (the
    /// consumer hears of it once every early write has ended).
    fn early_failed(&mut self, rkey: AttemptKey, why: String) {
        self.note_early_failure(rkey, why);
        let now = self.clock.now();
        self.matcher.abort(
            now,
            rkey.transfer,
            Some(rkey.attempt),
            Reason::TransferFailed,
        );
    }

    /// Records the first early failure of `rkey` (counted once per registration).
    fn note_early_failure(&mut self, rkey: AttemptKey, why: String) {
        if let Some(early) = self.early.get_mut(&rkey) {
            if early.failed.is_none() {
                warn!(key = %rkey, why, "early write failed");
                early.failed = Some(why);
                self.stats.transfers_failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// An early write ended; what waited for the early writes runs once they all have.
    fn early_done(&mut self, op: OpId, error: Option<String>) {
        let Some(Partial { rkey, .. }) = self.partials.remove(&op) else {
            return;
        };
        let Some(early) = self.early.get_mut(&rkey) else {
            return;
        };
        early.in_flight -= 1;
        if let Some(why) = &error {
            self.note_early_failure(rkey, why.clone());
        }
        let Some(early) = self.early.get_mut(&rkey) else {
            return;
        };
        if early.in_flight == 0 {
            // What waited runs first, so that the failure below finds nothing in flight.
            let deferred = std::mem::take(&mut early.deferred);
            let mut ended = false;
            for d in deferred {
                match d {
                    Deferred::Start {
                        ticket,
                        dest,
                        cancelled,
                    } => {
                        ended = true;
                        self.start_transfer(rkey, ticket, dest, cancelled);
                    }
                    Deferred::Tell {
                        conn,
                        key,
                        reason,
                        ends,
                    } => {
                        ended |= ends;
                        self.tell_consumer(conn, key, reason, "");
                    }
                }
            }
            if ended {
                self.early.remove(&rkey);
            }
        }
        if let Some(why) = error {
            self.early_failed(rkey, why);
            self.actions();
        }
    }

    fn actions(&mut self) {
        while let Some(action) = self.matcher.poll_action() {
            match action {
                Action::StartTransfer {
                    key,
                    blocks,
                    destination,
                    ..
                } => {
                    self.hint_finishing(&destination);
                    match self.early.get_mut(&key) {
                        Some(early) if early.in_flight > 0 => {
                            early.deferred.push(Deferred::Start {
                                ticket: blocks,
                                dest: destination,
                                cancelled: None,
                            });
                        }
                        _ => self.start_transfer(key, blocks, destination, None),
                    }
                }
                Action::ReleaseProducer { blocks, reason, .. } => {
                    self.ticket_back(blocks, SendOutcome::NotSent(reason));
                }
                Action::FailConsumer {
                    key,
                    destination,
                    reason,
                    ..
                } => match self.early.get_mut(&key) {
                    Some(early) if early.in_flight > 0 => early.deferred.push(Deferred::Tell {
                        conn: destination.conn,
                        key: destination.key,
                        reason,
                        ends: true,
                    }),
                    _ => {
                        self.early.remove(&key);
                        self.tell_consumer(destination.conn, destination.key, reason, "");
                    }
                },
                Action::RejectRegistration {
                    key,
                    destination,
                    reason,
                    ..
                } => match self.early.get_mut(&key) {
                    // A second registration of a key being written early: its blocks may be
                    // the ones being written, so the refusal waits for those writes too.
                    Some(early) if early.in_flight > 0 => early.deferred.push(Deferred::Tell {
                        conn: destination.conn,
                        key: destination.key,
                        reason,
                        ends: false,
                    }),
                    _ => self.tell_consumer(destination.conn, destination.key, reason, ""),
                },
                Action::CancelTransfer { key, reason, .. } => {
                    for flight in self.flights.values_mut() {
                        if flight.key == key {
                            flight.cancelled = Some(reason);
                        }
                    }
                    if let Some(early) = self.early.get_mut(&key) {
                        for d in &mut early.deferred {
                            if let Deferred::Start { cancelled, .. } = d {
                                cancelled.get_or_insert(reason);
                            }
                        }
                    }
                }
            }
        }
    }

    fn start_transfer(
        &mut self,
        key: AttemptKey,
        ticket: Ticket,
        dest: Dest,
        cancelled: Option<Reason>,
    ) {
        let now = self.clock.now();
        let early = self.early.remove(&key);
        if let Some(reason) = cancelled {
            self.tell_consumer(dest.conn, dest.key, reason, "cancelled");
            self.matcher
                .transfer_finished(now, key, TransferOutcome::Failed);
            self.ticket_back(ticket, SendOutcome::NotSent(reason));
            return;
        }
        let started = std::time::Instant::now();
        let failed_early = early.as_ref().is_some_and(|e| e.failed.is_some());
        let result = match early {
            Some(Early {
                failed: Some(why), ..
            }) => Err(why),
            Some(early) => self.post(&ticket, &dest, &early.written),
            None => self.post(&ticket, &dest, &[]),
        };
        match result {
            Ok((op, bytes)) => {
                self.stats.transfers_started.fetch_add(1, Ordering::Relaxed);
                debug!(key = %dest.key, bytes, post_us = started.elapsed().as_micros() as u64, "writes posted");
                self.flights.insert(
                    op,
                    Flight {
                        started,
                        bytes,
                        key,
                        ticket,
                        conn: dest.conn,
                        original: dest.key,
                        cancelled: None,
                    },
                );
            }
            Err(why) => {
                warn!(key = %dest.key, why, "transfer could not start");
                self.tell_consumer(dest.conn, dest.key, Reason::TransferFailed, &why);
                self.matcher
                    .transfer_finished(now, key, TransferOutcome::Failed);
                if !failed_early {
                    // An early failure was counted when it happened.
                    self.stats.transfers_failed.fetch_add(1, Ordering::Relaxed);
                }
                self.ticket_back(ticket, SendOutcome::NotSent(Reason::TransferFailed));
            }
        }
    }

    /// Posts the writes of tokens `written[l]..` of every layer `l` (those before were written
    /// early; none when `written` is empty) with the notice.
    fn post(
        &mut self,
        ticket: &Ticket,
        dest: &Dest,
        written: &[u64],
    ) -> Result<(OpId, u64), String> {
        let key = ticket.key;
        let held = &self
            .fanouts
            .get(&key)
            .ok_or("the request's blocks are gone")?
            .held;
        let c = self
            .conns
            .get(&dest.conn)
            .ok_or("the consumer's connection is gone")?;
        let consumer = c.consumer.as_ref().ok_or("no hello from the consumer")?;
        let tokens = held.num_tokens.min(dest.num_tokens);
        let ranges: Vec<Range<u64>> = (0..self.layout.spec().num_layers as usize)
            .map(|layer| {
                let written = written.get(layer).copied().unwrap_or(0);
                dest.skip_tokens.max(written).min(tokens)..tokens
            })
            .collect();
        let (ops, bytes) = plan_by_layer(
            &self.layout,
            &consumer.layout,
            &held.blocks,
            &dest.blocks,
            &ranges,
        )
        .map_err(|e| format!("cannot plan {key}: {e}"))?;
        self.stats.bytes_written.fetch_add(bytes, Ordering::Relaxed);
        self.transport
            .as_deref_mut()
            .expect(OPEN)
            .write(consumer.peer, &ops, Some(Notice(dest.notice)))
            .map(|op| (op, bytes))
            .map_err(|e| format!("cannot post the writes of {key}: {e}"))
    }

    fn on_event(&mut self, event: Event) {
        let now = self.clock.now();
        match event {
            Event::WriteDone { op, .. } if self.partials.contains_key(&op) => {
                self.early_done(op, None);
            }
            Event::Failed { op, error, .. } if self.partials.contains_key(&op) => {
                self.early_done(op, Some(error.to_string()));
            }
            Event::WriteDone { op, .. } => {
                let Some(flight) = self.flights.remove(&op) else {
                    return;
                };
                debug!(
                    key = %flight.original,
                    bytes = flight.bytes,
                    us = flight.started.elapsed().as_micros() as u64,
                    "write done"
                );
                match flight.cancelled {
                    None => {
                        self.matcher
                            .transfer_finished(now, flight.key, TransferOutcome::Succeeded);
                        self.stats.transfers_ok.fetch_add(1, Ordering::Relaxed);
                        self.ticket_back(flight.ticket, SendOutcome::Sent);
                    }
                    Some(reason) => {
                        self.tell_consumer(flight.conn, flight.original, reason, "cancelled");
                        self.matcher
                            .transfer_finished(now, flight.key, TransferOutcome::Failed);
                        self.ticket_back(flight.ticket, SendOutcome::NotSent(reason));
                    }
                }
            }
            Event::Failed { op, error, .. } => {
                let Some(flight) = self.flights.remove(&op) else {
                    return;
                };
                warn!(key = %flight.original, %error, "transfer failed");
                self.tell_consumer(
                    flight.conn,
                    flight.original,
                    Reason::TransferFailed,
                    &error.to_string(),
                );
                self.matcher
                    .transfer_finished(now, flight.key, TransferOutcome::Failed);
                self.stats.transfers_failed.fetch_add(1, Ordering::Relaxed);
                self.ticket_back(flight.ticket, SendOutcome::NotSent(Reason::TransferFailed));
            }
            _ => {}
        }
    }

    /// When a consumer that asked for finishing hints is next due a nudge: an early write to it
    /// has waited [`NUDGE_AFTER`], and it was not nudged for as long.
    fn next_nudge(&self) -> Option<Timestamp> {
        self.partials
            .values()
            .filter_map(|p| self.nudge_due(p))
            .min()
    }

    /// When the consumer of early write `p` is due a nudge for it, if it asked for hints.
    fn nudge_due(&self, p: &Partial) -> Option<Timestamp> {
        self.wants_hints(p.conn).then(|| {
            let last = self
                .nudged
                .get(&p.conn)
                .map_or(p.posted, |&at| at.max(p.posted));
            last + NUDGE_AFTER
        })
    }

    /// Nudges every consumer that is due (see [`Self::next_nudge`]) with an empty heartbeat:
    /// a consumer reads its transport once for every message it gets.
    fn nudge(&mut self, now: Timestamp) {
        let due: HashSet<ConnId> = self
            .partials
            .values()
            .filter(|p| self.nudge_due(p).is_some_and(|at| at <= now))
            .map(|p| p.conn)
            .collect();
        let message = Message::Heartbeat(Heartbeat {
            engine: self.engine,
            incarnation: self.incarnation,
            transfers: Vec::new(),
        });
        for conn in due {
            self.nudged.insert(conn, now);
            self.send_counted(conn, &message, &self.stats.nudges);
        }
        let partials = &self.partials;
        self.nudged
            .retain(|conn, _| partials.values().any(|p| p.conn == *conn));
    }

    /// Whether the consumer on `conn` asked for finishing hints.
    fn wants_hints(&self, conn: ConnId) -> bool {
        self.conns
            .get(&conn)
            .and_then(|c| c.consumer.as_ref())
            .is_some_and(|c| c.finishing_hints)
    }

    /// Tells a consumer rank that asked for it that the final writes of `dest` begin (before
    /// any wait for early writes), so that it reads its transport until the notice.
    fn hint_finishing(&self, dest: &Dest) {
        if self.wants_hints(dest.conn) {
            let message = Message::Finishing(Finishing {
                transfer: dest.key.transfer,
                attempt: dest.key.attempt,
                producer_rank: self.rank,
            });
            self.send_counted(dest.conn, &message, &self.stats.finishing_hints);
        }
    }

    /// Sends `message` on `conn` (if it is still open) and counts it in `sent`; a hint or a
    /// nudge that cannot be sent needs no more: the closed connection fails what it served.
    fn send_counted(&self, conn: ConnId, message: &Message, sent: &AtomicU64) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        match c.sender.send(message) {
            Ok(()) => {
                sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => debug!(conn, kind = ?message.kind(), error = %e, "cannot send"),
        }
    }

    fn tell_consumer(&self, conn: ConnId, key: AttemptKey, reason: Reason, detail: &str) {
        if let Some(c) = self.conns.get(&conn) {
            if let Err(e) = c.sender.send(&failure(key, self.rank, reason, detail)) {
                debug!(%key, error = %e, "cannot send failure notice");
            }
        }
    }

    /// A ticket came back; the blocks go back to the engine with the last one.
    fn ticket_back(&mut self, ticket: Ticket, outcome: SendOutcome) {
        let Some(fanout) = self.fanouts.get_mut(&ticket.key) else {
            return;
        };
        fanout.pending -= 1;
        if let SendOutcome::NotSent(_) = outcome {
            if fanout.outcome == SendOutcome::Sent {
                fanout.outcome = outcome;
            }
        }
        if fanout.pending == 0 {
            let fanout = self.fanouts.remove(&ticket.key).expect("present");
            self.give_back(ticket.key, fanout.held, fanout.outcome);
        }
    }

    /// The blocks of `key` are done with: reported to the engine, unless it sealed the request
    /// and has not finished it (then reported when it does) or aborted it since (never).
    fn give_back(&mut self, key: AttemptKey, held: Held, outcome: SendOutcome) {
        self.stats.held.fetch_sub(1, Ordering::Relaxed);
        let done = FinishedSending {
            request: held.request,
            key,
            outcome,
        };
        match self.sealed.get_mut(&key) {
            Some(sealed @ (Sealed::Pending | Sealed::Ended(..))) => {
                *sealed = Sealed::Ended(done, SystemTime::now());
            }
            Some(Sealed::Disowned) => {
                self.sealed.remove(&key);
            }
            None => self.finished.push((done, SystemTime::now())),
        }
    }

    /// Expiry of what is held outside the matcher; work proportional to what expires.
    fn expire(&mut self, now: Timestamp) {
        while let Some(Reverse((at, key, hold))) = self.expiry.peek().copied() {
            if at > now {
                break;
            }
            self.expiry.pop();
            match hold {
                Hold::Unfanned => {
                    if self.unfanned.get(&key).is_some_and(|(_, d)| *d == at) {
                        let (held, _) = self.unfanned.remove(&key).expect("present");
                        self.give_back(key, held, SendOutcome::NotSent(Reason::LeaseExpired));
                    }
                }
                Hold::Dead => {
                    if self.dead.get(&key.transfer).is_some_and(|(_, d)| *d == at) {
                        self.dead.remove(&key.transfer);
                    }
                }
                Hold::Stream => {
                    if let Some(deadline) = self.streams.get(&key).map(|s| s.deadline) {
                        if deadline <= now {
                            self.streams.remove(&key);
                        } else {
                            self.expiry.push(Reverse((deadline, key, Hold::Stream)));
                        }
                    }
                }
                Hold::Pull => {
                    if self.pull_held.get(&key).is_some_and(|h| h.deadline == at) {
                        let hold = self.pull_held.remove(&key).expect("present");
                        self.give_back(key, hold.held, SendOutcome::NotSent(Reason::LeaseExpired));
                    }
                }
            }
        }
    }

    fn shutdown(&mut self) {
        let now = self.clock.now();
        self.matcher.shutdown(now);
        self.actions();
        // Writes in flight end as they would (their notices reach decode), for a while.
        let deadline = now + SHUTDOWN_DRAIN;
        let mut events = Vec::new();
        while !(self.flights.is_empty() && self.partials.is_empty()) {
            let left = self.clock.until(deadline);
            if left.is_zero() {
                break;
            }
            let transport = self.transport.as_deref_mut().expect(OPEN);
            if let Err(e) = transport.wait(&mut events, left) {
                warn!(error = %e, "transport wait failed while draining writes");
                break;
            }
            for event in events.drain(..) {
                self.on_event(event);
            }
        }
        // Close the transport before decode hears that the rest failed: once a consumer is
        // told, it gives the blocks back to its engine, and nothing of ours may land in them
        // after that (closing waits for or cancels what is still in flight).
        if !(self.flights.is_empty() && self.partials.is_empty()) {
            warn!(
                writes = self.flights.len() + self.partials.len(),
                "closing the transport with writes in flight"
            );
        }
        drop(self.transport.take());
        for (_, flight) in std::mem::take(&mut self.flights) {
            self.tell_consumer(flight.conn, flight.original, Reason::Shutdown, "");
            self.ticket_back(flight.ticket, SendOutcome::NotSent(Reason::Shutdown));
        }
        for (_, early) in std::mem::take(&mut self.early) {
            for d in early.deferred {
                match d {
                    Deferred::Start { ticket, dest, .. } => {
                        self.tell_consumer(dest.conn, dest.key, Reason::Shutdown, "");
                        self.ticket_back(ticket, SendOutcome::NotSent(Reason::Shutdown));
                    }
                    Deferred::Tell { conn, key, .. } => {
                        self.tell_consumer(conn, key, Reason::Shutdown, "");
                    }
                }
            }
        }
        for (key, fanout) in std::mem::take(&mut self.fanouts) {
            self.give_back(key, fanout.held, SendOutcome::NotSent(Reason::Shutdown));
        }
        for (key, (held, _)) in std::mem::take(&mut self.unfanned) {
            self.give_back(key, held, SendOutcome::NotSent(Reason::Shutdown));
        }
        for (key, hold) in std::mem::take(&mut self.pull_held) {
            self.give_back(key, hold.held, SendOutcome::NotSent(Reason::Shutdown));
        }
        for c in self.conns.values() {
            c.sender.close();
        }
    }
}

/// Plans this producer rank's writes of tokens `ranges[l]` of every layer `l` (empty ranges
/// move nothing), one plan per run of layers that share a range; returns the operations and
/// their bytes.
fn plan_by_layer(
    producer: &Layout,
    consumer: &Layout,
    producer_blocks: &[BlockId],
    consumer_blocks: &[BlockId],
    ranges: &[Range<u64>],
) -> Result<(Vec<CopyOp>, u64), PlanError> {
    let (mut ops, mut bytes) = (Vec::new(), 0);
    let mut first = 0;
    while first < ranges.len() {
        let range = &ranges[first];
        let end = first + ranges[first..].iter().take_while(|r| *r == range).count();
        if !range.is_empty() {
            let planned = plan_layers(
                &PlanRequest {
                    producers: std::slice::from_ref(producer),
                    consumer,
                    num_tokens: range.end,
                    skip_tokens: range.start,
                    producer_blocks,
                    consumer_blocks,
                    only_producer: Some(producer.rank()),
                },
                first as u32..end as u32,
            )?;
            bytes += planned.bytes();
            if ops.is_empty() {
                ops = planned.into_ops();
            } else {
                ops.extend_from_slice(planned.ops());
            }
        }
        first = end;
    }
    Ok((ops, bytes))
}

/// The tokens a set of per-layer ranges spans, for the log (the empty ones aside).
fn span(ranges: &[Range<u64>]) -> (u64, u64) {
    ranges
        .iter()
        .filter(|r| !r.is_empty())
        .fold((u64::MAX, 0), |(from, upto), r| {
            (from.min(r.start), upto.max(r.end))
        })
}

/// Least common multiple of two block sizes (both at least 1).
fn lcm(a: u64, b: u64) -> u64 {
    let (mut x, mut y) = (a.max(1), b.max(1));
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a.max(1) / x * b.max(1)
}

fn failure(key: AttemptKey, rank: Rank, reason: Reason, detail: &str) -> Message {
    Message::Failure(FailureNotice {
        transfer: key.transfer,
        attempt: key.attempt,
        rank,
        reason: reason.into(),
        detail: detail.chars().take(1024).collect(),
    })
}

fn accept_consumer(
    own: &Layout,
    hello: &Hello,
    transport: &mut dyn Transport,
) -> Result<Consumer, String> {
    if hello.role != Role::Consumer {
        return Err("peer is not a consumer".into());
    }
    if hello.compat_hash != own.spec().compat_hash() {
        return Err(format!(
            "incompatible model: consumer layout {:?}, producer layout {:?}",
            hello.layout,
            own.spec()
        ));
    }
    let layout = Layout::new(hello.layout.clone()).map_err(|e| e.to_string())?;
    let desc = control::peer_desc(hello).ok_or("unreadable endpoint description")?;
    let peer = transport.connect(&desc).map_err(|e| e.to_string())?;
    Ok(Consumer {
        id: ConsumerId {
            engine: hello.engine,
            incarnation: hello.incarnation,
        },
        layout,
        peer,
        finishing_hints: hello.finishing_hints,
    })
}

/// Checks a registration's destination against the consumer's layout before holding it.
fn check_destination(layout: &Layout, reg: &Registration) -> Result<(), String> {
    if reg.consumer_rank != layout.rank() {
        return Err(format!(
            "registration for {} on the connection of {}",
            reg.consumer_rank,
            layout.rank()
        ));
    }
    let needed = u64::from(reg.num_tokens).div_ceil(u64::from(layout.spec().block_tokens));
    if (reg.blocks.len() as u64) < needed {
        return Err(format!(
            "{} blocks cannot hold {} tokens",
            reg.blocks.len(),
            reg.num_tokens
        ));
    }
    if let Some(bad) = reg.blocks.iter().find(|b| b.0 >= layout.spec().num_blocks) {
        return Err(format!(
            "block {bad} is outside the consumer's {} blocks",
            layout.spec().num_blocks
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_connections_are_bounded_and_their_slots_come_back() {
        let open = Arc::new(AtomicUsize::new(0));
        let a = ConnectionSlot::take(&open, 2).unwrap();
        let b = ConnectionSlot::take(&open, 2).unwrap();
        assert!(
            ConnectionSlot::take(&open, 2).is_none(),
            "a third connection"
        );
        drop(a);
        let c = ConnectionSlot::take(&open, 2).expect("a slot given back is free again");
        drop((b, c));
        assert_eq!(open.load(Ordering::SeqCst), 0);
    }
}
