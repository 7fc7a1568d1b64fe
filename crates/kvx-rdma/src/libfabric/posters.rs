//! Posting one operation's stripes on several rails at once.
//!
//! On `shm`, a write or read without remote CQ data is done by the *poster*: `fi_writemsg` copies
//! the bytes into the peer with `process_vm_writev` before it returns (the provider's "fast
//! RMA"), one system call per piece and one thread per call. One posting thread therefore caps a
//! transfer at the kernel's single-thread cross-memory copy rate, well below a `memcpy`. With
//! several rails, each rail is its own domain, so its pieces may be posted from its own thread
//! while the others post theirs: [`Posters`] keeps one thread per extra rail, blocked on a
//! channel when idle (nothing spins), and the calling thread posts the first rail's pieces itself.
//! The caller waits for every thread before it touches any rail again, so each domain is still
//! used by one thread at a time (`FI_THREAD_DOMAIN`).

use std::ffi::c_void;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use libfabric_sys as sys;

use super::fi::{self, FiErrno};

/// One piece to post: everything `fi_writemsg`/`fi_readmsg` needs.
#[derive(Clone, Copy, Debug)]
pub(super) struct Piece {
    pub(super) read: bool,
    pub(super) local: usize,
    pub(super) len: usize,
    pub(super) desc: *mut c_void,
    pub(super) peer: sys::fi_addr_t,
    pub(super) remote: u64,
    pub(super) key: u64,
    pub(super) context: *mut c_void,
}

/// Pieces of one rail, posted in order until the first refusal.
struct Job {
    ep: Arc<fi::Endpoint>,
    pieces: Vec<Piece>,
}

// SAFETY: the raw pointers are a registered local range, its descriptor and an operation context,
// all owned by the transport, which keeps them alive and untouched until the job's result has
// been received (`Posters::post` waits for it).
unsafe impl Send for Job {}

/// How far a rail's job got: pieces posted, and the error that stopped it.
pub(super) type Outcome = (usize, Option<FiErrno>);

/// Posts `pieces` on `ep` in order; stops at the first error.
///
/// # Safety
/// Every piece's local range, descriptor and context must stay valid until its completion is
/// read, as for [`fi::Endpoint::post_write`].
unsafe fn post_all(ep: &fi::Endpoint, pieces: &[Piece]) -> Outcome {
    for (done, piece) in pieces.iter().enumerate() {
        // SAFETY: the caller's contract, per piece.
        let result = unsafe {
            if piece.read {
                ep.post_read(
                    piece.local as *mut u8,
                    piece.len,
                    piece.desc,
                    piece.peer,
                    piece.remote,
                    piece.key,
                    piece.context,
                )
            } else {
                ep.post_write(
                    piece.local as *const u8,
                    piece.len,
                    piece.desc,
                    piece.peer,
                    piece.remote,
                    piece.key,
                    None,
                    piece.context,
                )
            }
        };
        if let Err(e) = result {
            return (done, Some(e));
        }
    }
    (pieces.len(), None)
}

struct Poster {
    jobs: Option<Sender<Job>>,
    outcomes: Receiver<Outcome>,
    thread: Option<JoinHandle<()>>,
}

/// One posting thread per rail after the first.
pub(super) struct Posters {
    threads: Vec<Poster>,
}

impl Posters {
    /// Threads for rails `1..rails`.
    ///
    /// # Errors
    /// The system refused a thread.
    pub(super) fn start(rails: usize) -> std::io::Result<Self> {
        let mut threads = Vec::with_capacity(rails.saturating_sub(1));
        for rail in 1..rails {
            let (jobs, job_rx) = channel::<Job>();
            let (outcome_tx, outcomes) = channel::<Outcome>();
            let thread = std::thread::Builder::new()
                .name(format!("kvx-fi-rail{rail}"))
                .spawn(move || {
                    while let Ok(job) = job_rx.recv() {
                        // SAFETY: `Job`'s contract: the transport keeps the pieces valid until
                        // this outcome is received.
                        let outcome = unsafe { post_all(&job.ep, &job.pieces) };
                        if outcome_tx.send(outcome).is_err() {
                            return;
                        }
                    }
                })?;
            threads.push(Poster {
                jobs: Some(jobs),
                outcomes,
                thread: Some(thread),
            });
        }
        Ok(Self { threads })
    }

    /// Posts each rail's pieces (`work[r]` on `eps[r]`), rail 0 on this thread and the others on
    /// their threads at the same time; returns each rail's outcome once all have finished.
    ///
    /// # Safety
    /// As for [`post_all`], for every piece.
    pub(super) unsafe fn post(
        &self,
        eps: &[Arc<fi::Endpoint>],
        work: Vec<Vec<Piece>>,
    ) -> Vec<Outcome> {
        let mut outcomes = vec![(0, None); work.len()];
        let mut sent = Vec::new();
        let mut own = Vec::new();
        for (rail, pieces) in work.into_iter().enumerate() {
            if pieces.is_empty() {
                continue;
            }
            let job = Job {
                ep: Arc::clone(&eps[rail]),
                pieces,
            };
            let poster = rail
                .checked_sub(1)
                .and_then(|t| self.threads.get(t))
                .and_then(|p| p.jobs.as_ref());
            // Rail 0, or a rail whose thread is gone: posted here, after the others started.
            let len = job.pieces.len();
            match poster {
                Some(jobs) => match jobs.send(job) {
                    Ok(()) => sent.push((rail, len)),
                    Err(std::sync::mpsc::SendError(job)) => own.push((rail, job)),
                },
                None => own.push((rail, job)),
            }
        }
        for (rail, job) in own {
            // SAFETY: the caller's contract.
            outcomes[rail] = unsafe { post_all(&job.ep, &job.pieces) };
        }
        for (rail, len) in sent {
            // A poster thread ends only when its channel closes (`post_all` cannot panic), so
            // the outcome always comes. Were it lost, the pieces count as posted: their contexts
            // stay in the pool (never freed under the provider), and the operation times out.
            outcomes[rail] = self.threads[rail - 1]
                .outcomes
                .recv()
                .unwrap_or((len, None));
        }
        outcomes
    }
}

impl Drop for Posters {
    fn drop(&mut self) {
        for poster in &mut self.threads {
            drop(poster.jobs.take());
            if let Some(thread) = poster.thread.take() {
                let _ = thread.join();
            }
        }
    }
}
