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

use kvx_core::wire::{
    Capability, FailureNotice, Finishing, Heartbeat, Held, Hello, Message, Registration, Role,
};
use kvx_core::{
    Attempt, BlockId, EngineId, GroupBlocks, Incarnation, Rank, RequestBlocks, RequestId,
    TransferId,
};
use kvx_layout::{plan, plan_layers, CopyOp, Layout, PlanError, PlanRequest};
use kvx_rdma::local_peer::{Process, TracerLeave};
use kvx_rdma::transport::{Event, Notice, OpId, PeerId, Transport};
use kvx_rendezvous::{
    Action, AttemptKey, Config, ConsumerId, Matcher, Reason, Timestamp, TransferOutcome,
};
use tracing::{debug, info, warn};

use crate::cache::{register_cache, KvCache};
use crate::config::ConnectorConfig;
use crate::control::{self, ControlError, ControlSender, ControlStream};
use crate::driver::{
    self, Clock, CommandReceiver, CommandSender, Io, Mailbox, PostError, Posts, Refused, Sending,
};
use crate::error::{BadDestination, Closed, LinkError, StartError, TransferError};
use crate::stats::{Stats, StatsSnapshot};

mod accept;
mod driven;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzz;
mod matching;
mod peers;
#[cfg(test)]
mod sim;
mod streaming;

pub use accept::MAX_WAITING_HANDSHAKES;
use accept::{accept_consumer, Acceptor};
use streaming::plan_by_layer;

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

pub(crate) enum Command {
    Finished {
        key: AttemptKey,
        held: FinishedBlocks,
        pull: bool,
    },
    /// The KV of `key` is final (push), but the engine keeps its blocks until it finishes.
    Sealed {
        key: AttemptKey,
        held: FinishedBlocks,
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
    /// The engine's trace of a transfer: its `kvx.send` span.
    Trace(TransferId, crate::trace::TraceContext),
    Accepted(ConnId, ControlSender, Box<Hello>, Option<TracerLeave>),
    /// A consumer's message, holding its connection's place in the queue until handled.
    Peer(ConnId, Message, control::Queued),
    PeerClosed(ConnId, String),
    Shutdown,
}

/// A finished request's blocks, which this side holds until its consumers have them.
#[derive(Debug)]
pub(crate) struct FinishedBlocks {
    request: RequestId,
    blocks: Vec<BlockId>,
    /// The further KV cache groups' blocks (a hybrid model's).
    groups: Vec<GroupBlocks>,
    num_tokens: u64,
}

impl FinishedBlocks {
    pub(crate) fn new(
        request: RequestId,
        blocks: impl Into<RequestBlocks>,
        num_tokens: u64,
    ) -> Self {
        let blocks = blocks.into();
        Self {
            request,
            blocks: blocks.blocks,
            groups: blocks.groups,
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
    groups: Vec<GroupBlocks>,
    num_tokens: u64,
    skip_tokens: u64,
    notice: u64,
}

/// A consumer rank connected to this producer rank: what its hello said.
struct ConsumerRank {
    id: ConsumerId,
    layout: Layout,
    peer: PeerId,
    /// It asked for a `Finishing` message before each transfer's final writes.
    finishing_hints: bool,
    /// How long a pull's blocks stay held for its claim ([`Claim`](kvx_core::wire::Claim)) at
    /// most without its completion: its reads' bound (its hello's `write_timeout_ms`, up to
    /// [`MAX_TRANSFER_TIMEOUT`](crate::config::MAX_TRANSFER_TIMEOUT)) and a margin.
    claim_bound: Duration,
}

struct Conn {
    sender: ControlSender,
    /// Its peer's process, where it runs on this host.
    process: Option<Process>,
    /// A consumer's leave to attach to this process, where the transport's peers copy by
    /// cross-memory attach (its reads, in pull): granted by the acceptor before this side's
    /// hello, and given back when the connection goes.
    leave: Option<TracerLeave>,
    consumer: Option<ConsumerRank>,
    /// A router (`kvx proxy`): it may only abort transfers no consumer registered.
    router: bool,
    /// The matcher keys of the registrations that came over this connection, to abort if it
    /// closes. Those that ended are forgotten in batches (see [`Conn::remember`]).
    keys: HashSet<AttemptKey>,
    /// The size at which [`Conn::remember`] next forgets the keys that ended.
    forget_at: usize,
    /// When its peer last sent something (its hello, at first).
    last_heard: Timestamp,
}

/// One consumer rank's connection may hold at most this share (1/N) of `max_entries` live
/// registrations.
const REGISTRATION_QUOTA_SHARE: usize = 4;

/// The fewest remembered keys at which a connection forgets those that ended.
const FORGET_AT_LEAST: usize = 64;

impl Conn {
    fn new(sender: ControlSender, consumer: Option<ConsumerRank>, now: Timestamp) -> Self {
        Self {
            process: sender.process(),
            leave: None,
            sender,
            consumer,
            router: false,
            keys: HashSet::new(),
            forget_at: FORGET_AT_LEAST,
            last_heard: now,
        }
    }

    fn router(sender: ControlSender, now: Timestamp) -> Self {
        Self {
            router: true,
            ..Self::new(sender, None, now)
        }
    }

    /// Whether this connection may register one more: below `quota` live registrations (the
    /// ended ones forgotten first when the set looks full).
    fn below_quota<P, R>(&mut self, quota: usize, matcher: &Matcher<P, R>, stats: &Stats) -> bool {
        if self.keys.len() >= quota {
            self.forget_ended(matcher, stats);
        }
        self.keys.len() < quota
    }

    /// Forgets the keys the matcher no longer has.
    fn forget_ended<P, R>(&mut self, matcher: &Matcher<P, R>, stats: &Stats) {
        let before = self.keys.len();
        self.keys.retain(|k| matcher.is_live(*k));
        stats
            .remembered_registrations
            .fetch_sub((before - self.keys.len()) as u64, Ordering::Relaxed);
        self.forget_at = (2 * self.keys.len()).max(FORGET_AT_LEAST);
    }

    /// Remembers `key`, first forgetting the keys the matcher no longer has once the set has
    /// doubled since the last time: amortised O(1), and the set stays within twice this
    /// connection's live registrations (or [`FORGET_AT_LEAST`]) however long it lives.
    fn remember<P, R>(&mut self, key: AttemptKey, matcher: &Matcher<P, R>, stats: &Stats) {
        if self.keys.len() >= self.forget_at {
            self.forget_ended(matcher, stats);
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
        let driver = Machine::new(
            &config,
            layout,
            transport,
            Clock::new(),
            Arc::clone(&finished),
            Arc::clone(&stats),
        )?;
        let mut threads = Vec::new();
        threads.push(
            thread::Builder::new()
                .name(format!("kvx-prefill-{}", rank.0))
                .spawn(move || driver.run(rx))
                .map_err(StartError::Thread)?,
        );
        // Consumers on this host connect here (control.rs); without it, over TCP.
        let local = if config.local_sockets {
            // A taken name may be another user's squatter: said at the default level (consumers
            // refuse a socket of another user, and connect over TCP).
            control::listen_local(addr)
                .map_err(|e| warn!(%addr, error = %e, "kvx: no local control socket (TCP only)"))
                .ok()
        } else {
            None
        };
        let acceptor = Acceptor {
            tx: tx.clone(),
            stop: Arc::clone(&stop),
            peers_attach: crate::transport::peers_attach(&hello.transport),
            hello: Message::Hello(hello),
            handshake_timeout: connect_timeout,
            next: Arc::new(AtomicU64::new(1)),
            open: Arc::new(AtomicUsize::new(0)),
            waiting: Arc::default(),
            stats: Arc::clone(&stats),
            auth_key: config.auth_key.clone(),
            refused: Arc::default(),
        };
        let local_listening = local.is_some();
        if let Some(local) = local {
            threads.push(acceptor.clone().spawn(
                format!("kvx-accept-local-{}", rank.0),
                local,
                |a, l| {
                    // Only peers of this process's own user use the local socket.
                    let mine = l
                        .incoming()
                        .filter(|s| s.as_ref().map_or(true, control::same_user));
                    a.run(mine.map(|s| s.map(ControlStream::local)));
                },
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

    /// The request of `transfer` belongs to `trace` (`kvx_trace`, W3C): this rank keeps a
    /// `kvx.send` span for it, a child of the trace's span, with the request's steps as events
    /// (registered, writes posted, written, released), until its blocks go back. Call it before
    /// the request's other calls; without it nothing is traced.
    ///
    /// # Errors
    /// [`Closed`] after shutdown.
    pub fn trace(
        &self,
        transfer: TransferId,
        trace: crate::trace::TraceContext,
    ) -> Result<(), Closed> {
        self.send(Command::Trace(transfer, trace))
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
        blocks: impl Into<RequestBlocks>,
        num_tokens: u64,
    ) -> Result<(), Closed> {
        self.send(Command::Finished {
            key,
            held: FinishedBlocks::new(request, blocks, num_tokens),
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
        blocks: impl Into<RequestBlocks>,
        num_tokens: u64,
    ) -> Result<(), Closed> {
        self.send(Command::Sealed {
            key,
            held: FinishedBlocks::new(request, blocks, num_tokens),
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
        blocks: impl Into<RequestBlocks>,
        num_tokens: u64,
    ) -> Result<(), Closed> {
        self.send(Command::Finished {
            key,
            held: FinishedBlocks::new(request, blocks, num_tokens),
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

    /// The transfers (push writes) that finished since the last call: how long each took from
    /// the post of its last writes and how many bytes those moved.
    #[must_use]
    pub fn take_transfer_samples(&self) -> Vec<crate::TransferSample> {
        self.stats.take_samples()
    }

    /// A handle on the live counters, for another thread (a metrics endpoint).
    #[must_use]
    pub fn stats_reader(&self) -> crate::StatsReader {
        crate::StatsReader(std::sync::Arc::clone(&self.stats))
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

/// The matcher's handle on a finished request's blocks: one per consumer rank the request
/// serves; the blocks go back to the engine when every ticket has come back.
#[derive(Debug)]
struct Ticket {
    key: AttemptKey,
}

/// A finished request fanned out to the consumer ranks this producer rank writes to.
struct Fanout {
    held: FinishedBlocks,
    pending: usize,
    outcome: SendOutcome,
}

/// What an expiry entry is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum ExpiryKind {
    /// Finished blocks whose consumer ranks are not known yet (no registration so far).
    Unfanned,
    /// Pull-mode blocks waiting to be read.
    Pull,
    /// An aborted transfer remembered, so that its late prefill is released at once.
    Dead,
    /// Read claims that came before their request finished here.
    EarlyClaim,
    /// A look at the processes of claimants whose connection closed (`Machine::lost_claimants`).
    ClaimantLook,
    /// A request no consumer rank needs from this rank, remembered until it finishes.
    Unneeded,
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

/// How often the processes of claimants whose connection closed are looked at.
const LOST_CLAIMANT_LOOK: Duration = Duration::from_millis(100);

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

/// Pull: finished blocks waiting for their consumer ranks to read them.
struct AwaitingRead {
    held: FinishedBlocks,
    deadline: Timestamp,
    /// The producer lease's end: `deadline` until a reader claims the blocks.
    leased_until: Timestamp,
    readers: Option<Vec<Rank>>,
    done: Vec<Rank>,
    /// Connections of the consumer ranks that claimed the blocks and have not completed.
    claimants: HashSet<ConnId>,
    /// Aborted while claimants read it (why): it goes back once they are done.
    aborted: Option<Reason>,
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

/// Connections are looked at for silence this many times per idle timeout: one is closed
/// between one and 1¼ timeouts after its peer last spoke.
const IDLE_SWEEPS_PER_TIMEOUT: u32 = 4;

/// How long a shutting-down producer lets its writes in flight end before it closes the
/// transport and tells their consumers that they failed.
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(2);

fn rank_key(key: AttemptKey, rank: Rank) -> AttemptKey {
    let mixed = key.transfer.0
        ^ (u128::from(kvx_core::ids::fnv1a_64(&rank.0.to_le_bytes())) << 64)
        ^ u128::from(rank.0);
    AttemptKey::new(TransferId(mixed), key.attempt)
}

/// One prefill rank's state machine: the requests the engine finished, the consumer ranks and
/// their connections, the matcher, the writes in flight, streaming and pull reads awaited, and
/// (held for its driver, [`driver::Io`]) its transport. The driver thread feeds it
/// ([`driver::Driven`]).
pub(crate) struct Machine {
    clock: Clock,
    rank: Rank,
    layout: Layout,
    /// Its I/O, as the driver holds it (the state machine only asks, through `posts`).
    io: Io,
    /// The I/O asked for and not yet carried out (see `driver::io`).
    posts: Posts,
    matcher: Matcher<Ticket, Dest>,
    conns: HashMap<ConnId, Conn>,
    flights: HashMap<OpId, Flight>,
    fanouts: HashMap<AttemptKey, Fanout>,
    unfanned: HashMap<AttemptKey, (FinishedBlocks, Timestamp)>,
    pull_held: HashMap<AttemptKey, AwaitingRead>,
    /// [`Capabilities::peer_rma_unassisted`](kvx_rdma::Capabilities::peer_rma_unassisted) of
    /// the transport: consumers' reads need no progress of this side.
    peer_rma_unassisted: bool,
    dead: HashMap<TransferId, (Option<Attempt>, Timestamp)>,
    /// Requests a consumer engine said it needs nothing of from this rank (it reads a replica
    /// another rank serves: [`kvx_layout::idle_producers`]) before they finished here, until
    /// they do (their blocks then go straight back, delivered) or for [`DEAD_TTL`]. Bounded by
    /// `max_dead`, as `dead` is.
    unneeded: HashMap<AttemptKey, Timestamp>,
    /// Pull: consumer ranks that claimed a request's blocks for their reads before the engine
    /// finished it here (the router relays prefill's answer before the engine hands the
    /// blocks over), each answered once it does, or failed at its claim's bound. Bounded by
    /// `max_dead`.
    early_claims: HashMap<AttemptKey, (Vec<ConnId>, Timestamp)>,
    /// Claimants of held pulls whose connection closed while their process (on this host)
    /// still ran: looked at every [`LOST_CLAIMANT_LOOK`] until it exits (their claims then end)
    /// or no hold names them any more.
    lost_claimants: HashMap<ConnId, Process>,
    /// When `lost_claimants` is looked at next.
    next_claimant_look: Option<Timestamp>,
    /// Most live registrations one consumer rank's connection may hold here: a share of
    /// `max_entries`, so that one peer cannot take the matcher's whole capacity.
    registration_quota: usize,
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
    expiry: BinaryHeap<Reverse<(Timestamp, AttemptKey, ExpiryKind)>>,
    max_consumer_tp: u32,
    producer_lease: Duration,
    /// A connection silent for this long is closed ([`ConnectorConfig::idle_timeout`]).
    idle_timeout: Duration,
    /// When connections are next looked at for [`Machine::close_idle`].
    next_idle_sweep: Timestamp,
    /// The deployment key: registrations and aborts then need a router's capability.
    auth_key: Option<Arc<crate::AuthKey>>,
    /// The `kvx.send` spans of traced transfers, and their order (the oldest go past
    /// `max_entries`).
    traces: HashMap<TransferId, tracing::Span>,
    trace_order: std::collections::VecDeque<TransferId>,
    finished: Arc<Mailbox<(FinishedSending, SystemTime)>>,
    stats: Arc<Stats>,
}

impl Machine {
    /// The state machine of one producer rank over `transport`, which holds `layout`'s
    /// registered cache; what it decides for the engine goes to `finished`.
    ///
    /// # Errors
    /// [`StartError::Config`] when the settings make an invalid matcher.
    pub(crate) fn new(
        config: &ConnectorConfig,
        layout: Layout,
        transport: Box<dyn Transport>,
        clock: Clock,
        finished: Arc<Mailbox<(FinishedSending, SystemTime)>>,
        stats: Arc<Stats>,
    ) -> Result<Self, StartError> {
        let mut matcher_config = Config::default();
        matcher_config.max_entries = config.max_entries;
        matcher_config.producer_lease = config.producer_lease;
        matcher_config.transfer_timeout = config.transfer_timeout;
        // Transfer ids reach the matcher's table from peers: a seed of this process's own keeps
        // its layout unknown to them (no built collisions).
        matcher_config.hash_seed = crate::config::random_seed();
        let matcher = Matcher::new(matcher_config)?;
        stats.set_rails(transport.rails());
        let peer_rma_unassisted = transport.capabilities().peer_rma_unassisted;
        let next_idle_sweep = clock.now() + config.idle_timeout / IDLE_SWEEPS_PER_TIMEOUT;
        Ok(Self {
            clock,
            rank: layout.rank(),
            layout,
            io: Io::new(transport, Sending::Blocking),
            posts: Posts::default(),
            matcher,
            conns: HashMap::new(),
            flights: HashMap::new(),
            fanouts: HashMap::new(),
            unfanned: HashMap::new(),
            pull_held: HashMap::new(),
            peer_rma_unassisted,
            dead: HashMap::new(),
            unneeded: HashMap::new(),
            early_claims: HashMap::new(),
            lost_claimants: HashMap::new(),
            next_claimant_look: None,
            max_dead: config.max_entries,
            registration_quota: (config.max_entries / REGISTRATION_QUOTA_SHARE).max(1),
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
            idle_timeout: config.idle_timeout,
            next_idle_sweep,
            auth_key: config.auth_key.clone(),
            traces: HashMap::new(),
            trace_order: std::collections::VecDeque::new(),
            finished,
            stats,
        })
    }
}
