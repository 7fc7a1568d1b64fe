//! Completion: one event recorded behind a peer's operations at each poll or wait (`flush`), and
//! the watcher thread that waits on it and only then sends the operations' notices.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use super::super::driver::{check, CudaError, Gpu};
use super::{boxed, socket_error, CudaIpcTransport, IpcError};
use crate::error::OpError;
use crate::same_host::{Completions, NoticeSender};

/// A recorded completion event (blocking-sync, no timing), reused through [`EventPool`].
pub(super) struct RawEvent(sys::CUevent);

// SAFETY: an event handle may be waited on and destroyed from any thread that binds its context.
unsafe impl Send for RawEvent {}

/// Completion events, created on demand and reused.
pub(super) struct EventPool {
    pub(super) gpu: Arc<Gpu>,
    pub(super) free: Mutex<Vec<RawEvent>>,
}

impl EventPool {
    pub(super) fn take(&self) -> Result<RawEvent, CudaError> {
        if let Some(event) = self
            .free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop()
        {
            return Ok(event);
        }
        self.gpu.bind()?;
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: bound context, valid out-pointer; destroyed when the pool drops.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&raw mut raw, flags)
        })?;
        Ok(RawEvent(raw))
    }

    pub(super) fn give(&self, event: RawEvent) {
        self.free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(event);
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            for event in self
                .free
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .drain(..)
            {
                // SAFETY: created by `take`, no longer recorded or waited on (the watcher has
                // exited before the pool drops), destroyed once.
                let _ = unsafe { sys::cuEventDestroy_v2(event.0) };
            }
        }
    }
}

/// Operations for the watcher: wait for the event recorded behind all of them, then send their
/// notices in posting order.
pub(super) struct Watch {
    /// (operation, notice) in posting order.
    pub(super) ops: Vec<(u64, Option<u64>)>,
    pub(super) event: RawEvent,
    pub(super) notices: NoticeSender,
}

/// The watcher thread: waits on each batch's event in posting order (the event sleeps in the
/// driver, no spinning, and never stalls a stream the way a host function would), sends the
/// notices only then, and reports the outcomes. Exits when the transport drops its sender.
pub(super) fn watch(
    gpu: &Arc<Gpu>,
    jobs: &std::sync::mpsc::Receiver<Watch>,
    pool: &EventPool,
    completions: &Completions,
) {
    let _ = gpu.bind();
    while let Ok(first) = jobs.recv() {
        // Everything queued so far: one wake-up of the endpoint for all of it.
        let mut results = Vec::new();
        for job in std::iter::once(first).chain(jobs.try_iter()) {
            finish(job, pool, &mut results);
        }
        completions.push_all(results);
    }
}

/// Waits for a batch's event, then sends its notices (in one write).
fn finish(job: Watch, pool: &EventPool, results: &mut Vec<(u64, Result<(), OpError>)>) {
    // SAFETY: the event was recorded on a live stream of this context before it was sent.
    let waited = check("cuEventSynchronize", unsafe {
        sys::cuEventSynchronize(job.event.0)
    });
    pool.give(job.event);
    let notices: Vec<u64> = job.ops.iter().filter_map(|&(_, notice)| notice).collect();
    let (sent, error) = match &waited {
        Ok(()) if !notices.is_empty() => job.notices.send_all(&notices),
        _ => (0, Ok(())),
    };
    // Operations whose notice went out whole succeeded; the rest lost their peer.
    let mut index = 0;
    for (op, notice) in job.ops {
        let result = match (&waited, notice) {
            (Err(e), _) => Err(OpError::Backend {
                source: boxed(e.clone()),
            }),
            (Ok(()), None) => Ok(()),
            (Ok(()), Some(_)) => {
                index += 1;
                match &error {
                    Err(e) if index > sent => Err(OpError::PeerUnreachable {
                        source: boxed(socket_error("sending the completion notice")(
                            std::io::Error::new(e.kind(), e.to_string()),
                        )),
                    }),
                    _ => Ok(()),
                }
            }
        };
        results.push((op, result));
    }
}

impl CudaIpcTransport {
    /// Records one completion event behind each peer's operations posted since the last flush
    /// and hands them to the watcher; operations that cannot be handed over fail now.
    pub(super) fn flush(&mut self) {
        for slot in &mut self.peers {
            let Some(peer) = slot.as_mut() else { continue };
            if peer.unflushed.is_empty() {
                continue;
            }
            let ops = std::mem::take(&mut peer.unflushed);
            let stream = match (&peer.kernels, peer.last_on_kernels) {
                (Some(kernels), true) => kernels.stream(),
                _ => &peer.stream,
            };
            let recorded = self.pool.take().and_then(|event| {
                // SAFETY: a live event and a live stream of this endpoint's context.
                match check("cuEventRecord", unsafe {
                    sys::cuEventRecord(event.0, stream.raw())
                }) {
                    Ok(()) => Ok(event),
                    Err(e) => {
                        self.pool.give(event);
                        Err(e)
                    }
                }
            });
            let handed = match recorded {
                Ok(event) => {
                    let job = Watch {
                        ops: ops.clone(),
                        event,
                        notices: peer.link.notices(),
                    };
                    match self.watch.as_ref().map(|w| w.send(job)) {
                        Some(Ok(())) => Ok(()),
                        _ => Err(IpcError::Socket {
                            what: "handing operations to the completion watcher",
                            source: std::io::Error::other("the watcher thread has exited"),
                        }),
                    }
                }
                Err(e) => Err(IpcError::Cuda(e)),
            };
            if let Err(e) = handed {
                let text = e.to_string();
                for (op, _) in ops {
                    self.ledger.fail(
                        op,
                        OpError::Backend {
                            source: text.clone().into(),
                        },
                    );
                }
            }
        }
    }
}
