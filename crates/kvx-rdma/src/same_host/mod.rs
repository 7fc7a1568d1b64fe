//! The control plane of the same-host backends (`cuda-ipc`, `cma`): a Unix stream socket per
//! endpoint in the abstract namespace (nothing left on disk) that carries framed completion
//! notices and control messages, the completions a backend's worker thread reports, and the
//! blocking wait over all of it (`poll(2)` on the listener, the connections and a wake-up
//! `eventfd`: no thread spins).

mod address;
mod control;
mod ledger;

use std::time::{Duration, Instant};

use crate::error::{OpError, PollError, SendError};
use crate::transport::{Event, OpId, OpKind, PeerId};
pub(crate) use address::{encode_head, Identity, Reader};
pub(crate) use control::{Completions, Control, Link, NoticeSender};
pub(crate) use ledger::Ledger;

/// Longest control message.
pub(crate) const MAX_MESSAGE_LEN: usize = 64 << 10;

/// What the shared poll and wait need from a same-host transport.
pub(crate) trait SameHost {
    /// The endpoint's control plane and operation ledger.
    fn parts(&mut self) -> (&mut Control, &mut Ledger);
    /// How long an operation may stay in flight.
    fn op_timeout(&self) -> Duration;
    /// Work to do first on every poll (hand batched operations to the worker).
    fn before_poll(&mut self) {}

    /// One non-blocking poll: received frames, finished operations, expired ones.
    fn poll_now(&mut self, events: &mut Vec<Event>) -> Result<usize, PollError> {
        self.before_poll();
        let timeout = self.op_timeout();
        let (control, ledger) = self.parts();
        let signalled = control
            .receive(ledger.inbox())
            .map_err(|e| PollError::Backend(Box::new(e)))?;
        let done = control.completed(signalled);
        ledger.settle(done, timeout);
        Ok(ledger.drain_into(events))
    }
}

/// [`Transport::wait`](crate::Transport::wait) for a same-host transport: polls, then blocks in
/// `poll(2)` until something arrives (at most 100 ms at a time while operations are in flight, so
/// that their timeouts are noticed).
pub(crate) fn wait<T: SameHost>(
    transport: &mut T,
    events: &mut Vec<Event>,
    timeout: Duration,
) -> Result<usize, PollError> {
    let deadline = Instant::now() + timeout;
    loop {
        let n = transport.poll_now(events)?;
        if n > 0 {
            return Ok(n);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(0);
        }
        let mut slice = deadline - now;
        let (control, ledger) = transport.parts();
        // Checked after the poll, which emptied the wake-up descriptor: a wake from now on makes
        // it readable, so the block below returns.
        if control.completions.signal.take() {
            return Ok(0);
        }
        if ledger.busy() {
            slice = slice.min(Duration::from_millis(100));
        }
        control
            .block(slice)
            .map_err(|e| PollError::Backend(Box::new(e)))?;
    }
}

/// [`Transport::send`](crate::Transport::send) for a same-host transport: one frame on the
/// peer's socket, reported at once.
pub(crate) fn send(
    link: Option<&mut Link>,
    ledger: &mut Ledger,
    peer: PeerId,
    message: &[u8],
) -> Result<OpId, SendError> {
    if message.len() > MAX_MESSAGE_LEN {
        return Err(SendError::TooLarge {
            len: message.len(),
            max: MAX_MESSAGE_LEN,
        });
    }
    let link = link.ok_or(SendError::UnknownPeer(peer))?;
    let result = link
        .send_message(message)
        .map_err(|e| OpError::PeerUnreachable {
            source: Box::new(e),
        });
    Ok(ledger.done_now(peer, OpKind::Send, result))
}

/// The error of an operation towards a peer whose socket is closed.
pub(crate) fn peer_gone() -> OpError {
    OpError::PeerUnreachable {
        source: "the peer closed its connection (it exited or dropped its endpoint)".into(),
    }
}

#[cfg(test)]
mod tests;
