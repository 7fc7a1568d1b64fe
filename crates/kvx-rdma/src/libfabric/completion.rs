//! Progress and waiting: reading the rails' completion queues, blocking until one may have
//! something, and turning completions, failures, deadlines and exited peers into [`Event`]s.

use std::collections::HashMap;
use std::ffi::c_void;
use std::time::{Duration, Instant};

use libfabric_sys as sys;

use super::context::{Scratch, Use};
use super::fi::{self, CqRead, FabricError};
use super::{backend, LibfabricTransport, MESSAGE_SLOT};
use crate::cpu_time::thread_cpu_time;
use crate::error::OpError;
use crate::transport::{Event, Notice, PeerId};

/// How often operations towards a disconnected `shm` peer look whether its process exited.
const EXIT_CHECK: Duration = Duration::from_millis(50);
/// Shortest sleep between completion-queue reads of a waiting thread on a provider without a
/// wait object.
pub(super) const MIN_IDLE_SLEEP: Duration = Duration::from_micros(50);
/// A completion-queue read that uses more CPU than this made progress on something (the
/// thread's own CPU time: a read that only waited for a core did no work).
const BUSY_READ: Duration = Duration::from_micros(20);
/// Longest such sleep.
const MAX_IDLE_SLEEP: Duration = Duration::from_micros(200);
/// Longest blocking read (`fi_cq_sread`) of a queue whose wait descriptor cannot be polled, so
/// that a wake-up is seen this soon; also the longest `poll(2)` after a `fi_trywait` that failed
/// for another reason than lack of support.
const WAKE_SLICE_MS: i32 = 1;

/// After a read of queues without a wait object: when it found nothing and did no work
/// (`idle`), sleep `idle_sleep` (at most `timeout_ms`) and double it up to [`MAX_IDLE_SLEEP`];
/// otherwise start again from [`MIN_IDLE_SLEEP`].
pub(super) fn rest_if_idle(idle_sleep: &mut Duration, idle: bool, timeout_ms: i32) {
    if idle {
        let limit = Duration::from_millis(u64::try_from(timeout_ms.max(0)).unwrap_or(0));
        std::thread::sleep((*idle_sleep).min(limit));
        *idle_sleep = (*idle_sleep * 2).min(MAX_IDLE_SLEEP);
    } else {
        *idle_sleep = MIN_IDLE_SLEEP;
    }
}

/// Linux socket errno values a provider reports as its own error number.
mod libc_errno {
    pub(super) const EPIPE: i32 = 32;
    pub(super) const ECONNABORTED: i32 = 103;
    pub(super) const ECONNRESET: i32 = 104;
    pub(super) const ENOTCONN: i32 = 107;
    pub(super) const ETIMEDOUT: i32 = 110;
    pub(super) const ECONNREFUSED: i32 = 111;
    pub(super) const EHOSTUNREACH: i32 = 113;
}

/// The asynchronous error for a failed completion or post.
pub(super) fn op_error(error: FabricError) -> OpError {
    let errno = match &error {
        FabricError::Completion { source, .. }
        | FabricError::PostWrite(source)
        | FabricError::PostRead(source)
        | FabricError::PostSend(source) => Some(source.clone()),
        _ => None,
    };
    // A completion the provider cancelled because the connection to the peer broke (tcp;ofi_rxm
    // reports FI_ECANCELED with the socket's errno) is the peer being unreachable too.
    let connection_lost = matches!(
        &error,
        FabricError::Completion { prov_errno, .. }
            if [
                libc_errno::ECONNRESET,
                libc_errno::ENOTCONN,
                libc_errno::EPIPE,
                libc_errno::ECONNREFUSED,
                libc_errno::ECONNABORTED,
                libc_errno::EHOSTUNREACH,
                libc_errno::ETIMEDOUT,
            ]
            .contains(&prov_errno.abs())
    );
    match errno {
        Some(_) if connection_lost => OpError::PeerUnreachable {
            source: backend(error),
        },
        Some(e) if e.is_unreachable() => OpError::PeerUnreachable {
            source: backend(error),
        },
        Some(e) if e.is_remote_access() => OpError::RemoteAccess {
            source: backend(error),
        },
        _ => OpError::Backend {
            source: backend(error),
        },
    }
}

impl LibfabricTransport {
    /// Reads every rail's completion queue once without blocking; returns the completions
    /// handled.
    pub(super) fn drain_all(&mut self) -> Result<usize, FabricError> {
        let mut n = 0;
        for rail in 0..self.rails.len() {
            n += self.drain(rail, None)?;
        }
        Ok(n)
    }

    /// Blocks until a completion may be ready on any rail, a wake-up comes, or `timeout_ms`
    /// passes; handles what it reads. Where every rail has a wait descriptor: `fi_trywait` on
    /// each, then `poll(2)` on their descriptors and the wake-up signal's. Otherwise, one rail:
    /// the sleeping read without a wait object (or `fi_cq_sread`, a millisecond at a time);
    /// several: a read of every rail with a short sleep when all were idle.
    pub(super) fn block(&mut self, timeout_ms: i32) -> Result<(), FabricError> {
        if let Some(fds) = self.wait_fds.take() {
            let mut ready = false;
            let mut usable = true;
            let mut limit = timeout_ms;
            for rail in &self.rails {
                match rail.ep.cq().try_wait() {
                    Ok(true) => {}
                    Ok(false) => {
                        ready = true;
                        break;
                    }
                    Err(e) if e.is_unsupported() => {
                        usable = false;
                        break;
                    }
                    // Another failure may pass: block a millisecond at most this time.
                    Err(_) => limit = limit.min(WAKE_SLICE_MS),
                }
            }
            if usable {
                if !ready {
                    fi::poll_readable(&fds, limit);
                    self.wake.clear_fd();
                }
                self.wait_fds = Some(fds);
                // Whatever woke us (or was ready) is read by the caller's next poll; a wake-up
                // left its flag.
                return Ok(());
            }
            // The provider cannot try-wait: sleep between reads from now on.
        }
        if self.rails.len() == 1 {
            self.drain(0, Some(timeout_ms.min(WAKE_SLICE_MS)))?;
            return Ok(());
        }
        let started = thread_cpu_time();
        let n = self.drain_all()?;
        let idle = n == 0
            && thread_cpu_time().saturating_sub(started) < BUSY_READ * self.rails.len() as u32;
        rest_if_idle(&mut self.idle_sleep, idle, timeout_ms);
        Ok(())
    }

    /// Reads rail `rail`'s completion queue once (blocking up to `timeout_ms` if given) and
    /// handles what it returns; returns the number of completions handled.
    pub(super) fn drain(
        &mut self,
        rail: usize,
        timeout_ms: Option<i32>,
    ) -> Result<usize, FabricError> {
        self.draining += 1;
        let result = self.drain_once(rail, timeout_ms);
        self.draining -= 1;
        // Not within a read (handling a completion may read again, while the outer read's
        // entries wait to be handled), nor within the attribution's own reads.
        if self.draining == 0 && !self.attributing && self.unattributed.is_some() {
            self.fail_unconfirmed_pieces()?;
        }
        result
    }

    pub(super) fn drain_once(
        &mut self,
        rail: usize,
        timeout_ms: Option<i32>,
    ) -> Result<usize, FabricError> {
        if !self.own_region_readable(rail) {
            // Read later: a read now would spin on the lock.
            if let Some(ms) = timeout_ms {
                rest_if_idle(&mut self.idle_sleep, true, ms);
            }
            return Ok(0);
        }
        let mut entries = std::mem::take(&mut self.entries);
        // Watched while inside libfabric: a writer killed holding the lock the read spins on
        // is released by the watchdog (see `shm_lock`).
        let reading = self.rails[rail]
            .own_lock
            .as_ref()
            .map(super::shm_lock::RegionLock::reading);
        let cq = self.rails[rail].ep.cq();
        let read = match timeout_ms {
            Some(ms) if cq.can_block() => cq.sread(&mut entries, ms),
            Some(ms) => {
                // No wait object to block on (shm): read, and sleep a little when idle, backing
                // off from 50 µs to 200 µs, so that a waiting thread never spins. A read that
                // took long did work (on shm the target's progress copies the data of incoming
                // writes, which produces no completion): then go straight back to it.
                let started = thread_cpu_time();
                let read = cq.read(&mut entries);
                let idle = matches!(read, CqRead::Empty)
                    && thread_cpu_time().saturating_sub(started) < BUSY_READ;
                rest_if_idle(&mut self.idle_sleep, idle, ms);
                read
            }
            None => cq.read(&mut entries),
        };
        drop(reading);
        let result = match read {
            CqRead::Empty => Ok(0),
            CqRead::Entries(n) => {
                for entry in &entries[..n] {
                    self.on_completion(fi::Completion {
                        context: entry.op_context,
                        flags: entry.flags,
                        len: entry.len,
                        data: entry.data,
                    });
                }
                Ok(n)
            }
            CqRead::Failed { context, error } => {
                if context.is_null() {
                    if let FabricError::ReadCq(_) = error {
                        self.entries = entries;
                        return Err(error);
                    }
                    // An error without an operation: a failed incoming transfer, or (`shm`) one
                    // of our fast-path pieces (see `fail_unconfirmed_pieces`).
                    if self.peer_rma_unassisted && self.virt_addr {
                        self.unattributed.get_or_insert(error);
                    }
                    Ok(1)
                } else {
                    self.on_failure(context, error);
                    Ok(1)
                }
            }
        };
        self.entries = entries;
        result
    }

    /// `shm` with cross-memory attach completes every data piece (a write or read of one range)
    /// inside its post: a success is queued as a completion with the piece's context, a failure
    /// (the peer's process is gone) as an error *without* one (libfabric 1.17 writes it to the
    /// receive side of the queue with a null context), and the post returns success either way.
    /// So once such an error is read, and every queue is read empty, each data piece still in
    /// flight has failed: its operation fails, and its context is retired (never reused).
    /// Unattributed, each would hold a context for ever, and the lost contexts would fill the
    /// in-flight limit: the endpoint could write to no peer any more.
    pub(super) fn fail_unconfirmed_pieces(&mut self) -> Result<(), FabricError> {
        self.attributing = true;
        let read = loop {
            match self.drain_all() {
                Ok(0) => break Ok(()),
                Ok(_) => {}
                Err(e) => break Err(e),
            }
        };
        self.attributing = false;
        read?;
        let Some(error) = self.unattributed.take() else {
            return Ok(());
        };
        let lost: Vec<(usize, u64)> = self
            .contexts
            .live
            .iter()
            .filter_map(|(&ptr, (_, what))| match what {
                Some(Use::Data { op } | Use::Flush { op }) => Some((ptr, *op)),
                _ => None,
            })
            .collect();
        // The process may still be listed while its memory is already gone: ESRCH says so too.
        let gone = matches!(
            &error,
            FabricError::Completion { source, prov_errno, .. }
                if source.code == libc::ESRCH || prov_errno.abs() == libc::ESRCH
        );
        let mut exited: HashMap<PeerId, bool> = HashMap::new();
        for (ptr, op) in lost {
            self.contexts.retire(ptr);
            let Some(p) = self.pending.get_mut(&op) else {
                continue;
            };
            p.in_flight = p.in_flight.saturating_sub(1);
            let peer = p.peer;
            let exited = *exited.entry(peer).or_insert_with(|| self.peer_exited(peer));
            let failure = if gone || exited {
                OpError::PeerUnreachable {
                    source: "the peer's process has exited".into(),
                }
            } else {
                op_error(error.clone())
            };
            self.fail(op, failure);
        }
        Ok(())
    }

    pub(super) fn on_completion(&mut self, c: fi::Completion) {
        let what = if c.context.is_null() {
            None
        } else {
            self.contexts.give_back(c.context)
        };
        match what {
            Some(Use::Recv { rail, slot }) => {
                if c.flags & sys::FI_REMOTE_CQ_DATA != 0 {
                    self.events.push_back(Event::Notice(Notice(c.data)));
                } else {
                    let len = c.len.min(self.max_message);
                    let mut bytes = vec![0; len];
                    // The slot lies inside the rail's scratch buffer by construction.
                    let _ = self.rails[rail]
                        .scratch
                        .buffer
                        .read_at(Scratch::RECV_BASE + slot * MESSAGE_SLOT, &mut bytes);
                    self.events.push_back(Event::Message(bytes));
                }
                if let Err(error) = self.post_recv(rail, slot) {
                    self.broken.get_or_insert(error);
                }
            }
            Some(Use::Data { op } | Use::Flush { op }) => {
                if let Some(p) = self.pending.get_mut(&op) {
                    p.in_flight = p.in_flight.saturating_sub(1);
                }
                self.settle(op);
            }
            Some(Use::Notice { op }) => {
                if let Some(p) = self.pending.get_mut(&op) {
                    p.notice = None;
                    p.notice_posted = false;
                }
                self.settle(op);
            }
            Some(Use::Send { op, slot }) => {
                self.rails[0].scratch.free_sends.push(slot);
                if let Some(p) = self.pending.get_mut(&op) {
                    p.in_flight = p.in_flight.saturating_sub(1);
                }
                self.settle(op);
            }
            None => {
                if c.flags & sys::FI_REMOTE_CQ_DATA != 0 {
                    self.events.push_back(Event::Notice(Notice(c.data)));
                }
            }
        }
    }

    pub(super) fn on_failure(&mut self, context: *mut c_void, error: FabricError) {
        match self.contexts.give_back(context) {
            Some(Use::Data { op } | Use::Flush { op }) => {
                if let Some(p) = self.pending.get_mut(&op) {
                    p.in_flight = p.in_flight.saturating_sub(1);
                }
                self.fail(op, op_error(error));
            }
            Some(Use::Notice { op }) => {
                if let Some(p) = self.pending.get_mut(&op) {
                    p.notice = None;
                    p.notice_posted = false;
                }
                self.fail(op, op_error(error));
            }
            Some(Use::Send { op, slot }) => {
                self.rails[0].scratch.free_sends.push(slot);
                if let Some(p) = self.pending.get_mut(&op) {
                    p.in_flight = p.in_flight.saturating_sub(1);
                }
                self.fail(op, op_error(error));
            }
            Some(Use::Recv { rail, slot }) => {
                // A failed receive (a truncated message): post the slot again.
                if let Err(error) = self.post_recv(rail, slot) {
                    self.broken.get_or_insert(error);
                }
            }
            None => {}
        }
    }

    /// Reports operations past their deadline as timed out, and those towards a disconnected
    /// `shm` peer whose process has exited as failed (they can never complete: only the peer
    /// moves their data); their completions, if they ever come, are drained silently.
    pub(super) fn expire(&mut self) {
        let now = Instant::now();
        let expired: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| !p.abandoned && p.deadline <= now)
            .map(|(&op, _)| op)
            .collect();
        let timeout = self.op_timeout;
        for op in expired {
            self.abandon(op, || OpError::TimedOut(timeout));
        }
        if now >= self.next_exit_check {
            self.next_exit_check = now + EXIT_CHECK;
            let exited = self.exited_peers();
            let gone: Vec<u64> = self
                .pending
                .iter()
                .filter(|(_, p)| !p.abandoned && exited.contains(&p.peer))
                .map(|(&op, _)| op)
                .collect();
            for op in gone {
                self.abandon(op, || OpError::PeerUnreachable {
                    source: "the peer's process has exited".into(),
                });
            }
        }
    }

    pub(super) fn nearest_deadline(&self) -> Option<Instant> {
        self.pending
            .values()
            .filter(|p| !p.abandoned)
            .map(|p| p.deadline)
            .min()
    }

    pub(super) fn take_events(&mut self, out: &mut Vec<Event>) -> usize {
        let n = self.events.len();
        out.extend(self.events.drain(..));
        n
    }
}
