//! Pieces both sides share: the clock, the cache a side registers, the driver's wait loop.

use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SendError, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kvx_core::wire::{Hello, Role};
use kvx_core::{LayoutSpec, Rank};
use kvx_layout::Layout;
use kvx_rdma::desc::EndpointDesc;
use kvx_rdma::region::LocalRegion;
use kvx_rdma::transport::{Event, Transport, Waker};
use kvx_rendezvous::Timestamp;

use crate::config::ConnectorConfig;
use crate::error::StartError;

/// One rank's KV cache, handed to the connector at start: its layout and the memory of each of
/// the layout's regions (index `i` of `regions` is region `i`).
#[derive(Debug)]
pub struct KvCache {
    /// The layout.
    pub layout: LayoutSpec,
    /// The regions, in layout order.
    pub regions: Vec<LocalRegion>,
}

/// Validates the cache and registers its regions with the transport.
pub(crate) fn register_cache(
    transport: &mut dyn Transport,
    cache: KvCache,
) -> Result<(Layout, Vec<LocalRegion>), StartError> {
    let layout = Layout::new(cache.layout)?;
    if cache.regions.len() != layout.region_count() as usize {
        return Err(StartError::RegionCount {
            expected: layout.region_count(),
            given: cache.regions.len(),
        });
    }
    let mut kept = Vec::with_capacity(cache.regions.len());
    for (index, region) in cache.regions.into_iter().enumerate() {
        if region.len() < layout.region_len() {
            return Err(StartError::RegionTooSmall {
                index: index as u32,
                len: region.len(),
                needed: layout.region_len(),
            });
        }
        if region.index() != index as u32 {
            return Err(StartError::RegionIndex {
                position: index,
                index: region.index(),
            });
        }
        transport.register(region.clone())?;
        kept.push(region);
    }
    Ok((layout, kept))
}

/// Monotonic time since the side started, as the state machines want it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clock(Instant);

impl Clock {
    pub(crate) fn new() -> Self {
        Self(Instant::now())
    }

    pub(crate) fn now(self) -> Timestamp {
        Timestamp::from_nanos(u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// How long from now until `at` (zero if past).
    pub(crate) fn until(self, at: Timestamp) -> Duration {
        at.saturating_duration_since(self.now())
    }
}

/// The hello this side sends; `finishing_hints` as in [`Hello::finishing_hints`].
pub(crate) fn hello(
    config: &ConnectorConfig,
    role: Role,
    layout: &Layout,
    desc: &EndpointDesc,
    finishing_hints: bool,
) -> Hello {
    Hello {
        compat_hash: layout.spec().compat_hash(),
        engine: config.engine,
        incarnation: config.incarnation,
        role,
        layout: layout.spec().clone(),
        regions: desc.regions.clone(),
        transport: desc.backend.clone(),
        transport_addr: desc.to_bytes(),
        finishing_hints,
        write_timeout_ms: match role {
            Role::Producer => {
                u32::try_from(config.transfer_timeout.as_millis()).unwrap_or(u32::MAX)
            }
            _ => 0,
        },
    }
}

/// The peer's endpoint description from its hello.
pub(crate) fn peer_desc(hello: &Hello) -> Option<EndpointDesc> {
    EndpointDesc::from_bytes(&hello.transport_addr).ok()
}

/// How long a driver waits on a transport without a [`Waker`] when operations are in flight,
/// before it looks at its command queue again. The wait blocks on the transport's wait object
/// (a completion-queue wait), so such a driver with work in flight wakes at most this often;
/// without work in flight it blocks on its queue alone. A driver whose transport has a waker
/// blocks on the transport until an event, a command or its next deadline.
pub(crate) const TRANSPORT_SLICE: Duration = Duration::from_millis(1);

/// What a driver thread reports to the engine thread, which takes it at each engine step or
/// waits for the first report (`Producer::wait_finished`, `Consumer::wait_events`).
pub(crate) struct Mailbox<T> {
    items: Mutex<Vec<T>>,
    arrived: Condvar,
}

impl<T> Default for Mailbox<T> {
    fn default() -> Self {
        Self {
            items: Mutex::new(Vec::new()),
            arrived: Condvar::new(),
        }
    }
}

impl<T> Mailbox<T> {
    /// The reports, locked: `push` wakes a waiter once the guard is dropped.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Vec<T>> {
        self.items.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leaves `item` and wakes a waiter.
    pub(crate) fn push(&self, item: T) {
        self.lock().push(item);
        self.wake();
    }

    /// Wakes the waiters, to look again at what they wait for.
    pub(crate) fn wake(&self) {
        self.arrived.notify_all();
    }

    /// Everything there now.
    pub(crate) fn take(&self) -> Vec<T> {
        std::mem::take(&mut *self.lock())
    }

    /// Waits until `ready` holds for the reports (at once if it does now), or `timeout` passed.
    /// Returns the guard, so that the caller can take what it waited for.
    pub(crate) fn wait_until(
        &self,
        timeout: Duration,
        mut ready: impl FnMut(&Vec<T>) -> bool,
    ) -> MutexGuard<'_, Vec<T>> {
        let mut items = self.lock();
        if timeout.is_zero() {
            // A plain poll (every engine step): no clock read.
            return items;
        }
        let deadline = Instant::now() + timeout;
        while !ready(&items) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            items = self
                .arrived
                .wait_timeout(items, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        items
    }

    /// Waits until something is there or `timeout` passed, and takes it all.
    pub(crate) fn wait_take(&self, timeout: Duration) -> Vec<T> {
        std::mem::take(&mut *self.wait_until(timeout, |items| !items.is_empty()))
    }
}

/// Whether a driver is blocked on its transport, and how to wake it there.
struct Parking {
    parked: AtomicBool,
    waker: Option<Arc<dyn Waker>>,
}

/// The sending side of a driver's command queue (the engine's handle, the acceptor, the control
/// connections): a command wakes the driver when it is blocked on its transport.
pub(crate) struct CommandSender<C> {
    tx: Sender<C>,
    parking: Arc<Parking>,
}

impl<C> Clone for CommandSender<C> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            parking: Arc::clone(&self.parking),
        }
    }
}

impl<C> CommandSender<C> {
    /// Queues `command` for the driver.
    pub(crate) fn send(&self, command: C) -> Result<(), SendError<C>> {
        self.tx.send(command)?;
        // Pairs with the fence in `wait_turn`: either the driver sees the command before it
        // blocks, or this sees it parked and wakes it.
        fence(Ordering::SeqCst);
        if self.parking.parked.load(Ordering::SeqCst) {
            if let Some(waker) = &self.parking.waker {
                waker.wake();
            }
        }
        Ok(())
    }
}

/// The driver's side of its command queue.
pub(crate) struct CommandReceiver<C> {
    rx: Receiver<C>,
    parking: Arc<Parking>,
}

impl<C> CommandReceiver<C> {
    /// The commands queued now, without waiting.
    pub(crate) fn take_queued(&self) -> Vec<C> {
        self.rx.try_iter().collect()
    }
}

/// A driver's command queue; `waker` (the transport's) lets a command interrupt the driver's
/// transport wait.
pub(crate) fn command_queue<C>(
    waker: Option<Arc<dyn Waker>>,
) -> (CommandSender<C>, CommandReceiver<C>) {
    let (tx, rx) = mpsc::channel();
    let parking = Arc::new(Parking {
        parked: AtomicBool::new(false),
        waker,
    });
    (
        CommandSender {
            tx,
            parking: Arc::clone(&parking),
        },
        CommandReceiver { rx, parking },
    )
}

/// One turn of a driver's loop: wait for commands or transport events, whichever comes, until
/// `deadline` at the latest. Commands go to `commands`, transport events to `events`. Returns
/// `Ok(false)` once every sender of the command queue is gone.
pub(crate) fn wait_turn<C>(
    queue: &CommandReceiver<C>,
    transport: &mut dyn Transport,
    transport_busy: bool,
    clock: Clock,
    deadline: Option<Timestamp>,
    events: &mut Vec<Event>,
    commands: &mut Vec<C>,
) -> Result<bool, kvx_rdma::error::PollError> {
    let limit = deadline.map_or(Duration::from_secs(3600), |d| clock.until(d));
    let mut open = true;
    // Whatever is already queued first, without blocking.
    open &= drain_commands(queue, commands);
    if !commands.is_empty() || !open {
        transport.poll(events)?;
        return Ok(open);
    }
    if transport_busy {
        let parking = &queue.parking;
        if parking.waker.is_some() {
            parking.parked.store(true, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            open &= drain_commands(queue, commands);
            let result = if commands.is_empty() && open {
                transport.wait(events, limit)
            } else {
                transport.poll(events)
            };
            parking.parked.store(false, Ordering::SeqCst);
            result?;
        } else {
            transport.wait(events, limit.min(TRANSPORT_SLICE))?;
        }
        open &= drain_commands(queue, commands);
    } else {
        open &= wait_commands(queue, clock, deadline, commands);
        // Notices may arrive while nothing is in flight on this side (the consumer's case).
        transport.poll(events)?;
    }
    Ok(open)
}

/// Waits for a command until `deadline` (none: an hour) without looking at any transport;
/// returns whether the queue is still open.
pub(crate) fn wait_commands<C>(
    queue: &CommandReceiver<C>,
    clock: Clock,
    deadline: Option<Timestamp>,
    commands: &mut Vec<C>,
) -> bool {
    let limit = deadline.map_or(Duration::from_secs(3600), |d| clock.until(d));
    match queue.rx.recv_timeout(limit) {
        Ok(c) => commands.push(c),
        Err(RecvTimeoutError::Timeout) => return true,
        Err(RecvTimeoutError::Disconnected) => return false,
    }
    // And whatever came with it.
    drain_commands(queue, commands)
}

/// Takes every command already queued, without blocking; returns whether the queue is still
/// open.
fn drain_commands<C>(queue: &CommandReceiver<C>, commands: &mut Vec<C>) -> bool {
    loop {
        match queue.rx.try_recv() {
            Ok(c) => commands.push(c),
            Err(TryRecvError::Empty) => return true,
            Err(TryRecvError::Disconnected) => return false,
        }
    }
}

/// What a side's driver thread plugs into [`drive`].
pub(crate) trait Driven {
    /// Commands from the engine and the connection threads.
    type Command;
    /// The transport and the clock.
    fn transport(&mut self) -> (&mut dyn Transport, Clock);
    /// Whether transport operations this side waits for are in flight.
    fn busy(&self) -> bool;
    /// When the state machines next need the time.
    fn deadline(&mut self) -> Option<Timestamp>;
    /// Whether `command` asks the driver to stop.
    fn is_shutdown(command: &Self::Command) -> bool;
    /// Handles one command.
    fn command(&mut self, command: Self::Command);
    /// Handles one transport event.
    fn transport_event(&mut self, event: Event);
    /// Lets time pass in the state machines and carries out their actions.
    fn tick(&mut self, now: Timestamp);
}

/// A driver thread's loop: wait for commands or transport events (never spinning), handle them,
/// let time pass; until a shutdown command or the engine's side of the queue is gone.
pub(crate) fn drive<D: Driven>(driver: &mut D, rx: &CommandReceiver<D::Command>) {
    let mut events = Vec::new();
    let mut commands = Vec::new();
    loop {
        let deadline = driver.deadline();
        let busy = driver.busy();
        let (transport, clock) = driver.transport();
        let open = match wait_turn(
            rx,
            transport,
            busy,
            clock,
            deadline,
            &mut events,
            &mut commands,
        ) {
            Ok(open) => open,
            Err(e) => {
                tracing::warn!(error = %e, "transport poll failed");
                true
            }
        };
        for command in commands.drain(..) {
            if D::is_shutdown(&command) {
                return;
            }
            driver.command(command);
        }
        for event in events.drain(..) {
            driver.transport_event(event);
        }
        let (_, clock) = driver.transport();
        driver.tick(clock.now());
        if !open {
            return;
        }
    }
}

/// The control address of rank `rank` of an instance whose rank 0 listens at `base`.
#[must_use]
pub fn rank_addr(base: std::net::SocketAddr, rank: Rank) -> std::net::SocketAddr {
    let mut addr = base;
    addr.set_port(base.port().wrapping_add(rank.0 as u16));
    addr
}
