//! A driver's command queue, and one turn of waiting on it and on the transport.

use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SendError, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use kvx_rdma::transport::{Event, Transport, Waker};
use kvx_rendezvous::Timestamp;

use super::{Clock, TRANSPORT_SLICE};

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
