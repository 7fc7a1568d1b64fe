//! The CMA backend (`cma`, feature `cma`, Linux): host memory between processes of one host with
//! cross-memory attach — `process_vm_writev` / `process_vm_readv` copy straight from one
//! process's memory into another's, one system call for up to 1,024 pieces, with no bounce buffer
//! and no work on the receiving side.
//!
//! - **One-sided**: the writer's worker thread does the whole copy; the consumer's engine loop
//!   spends nothing on it (libfabric's `shm` provider, by contrast, copies through a bounce buffer
//!   that the receiver's progress engine drains).
//! - **Completion**: when the copy returned, the notice is sent on the same-host control socket
//!   (`crate::same_host`), so the consumer sees it after every byte landed.
//! - **Permission**: the kernel lets a process write into another one it may `ptrace` (same user,
//!   and under Yama `ptrace_scope` 1 only a declared tracer): an endpoint declares any process of
//!   the user as allowed (`PR_SET_PTRACER`), as libfabric's `shm` does for its CMA path, unless
//!   its program names the one peer process that copies (`local_peer::TracerLeave`: the
//!   connector does, from its local control sockets). Where
//!   that is not enough (`ptrace_scope` 2 or 3, other users), writes fail with
//!   [`OpError::RemoteAccess`] naming the cause.
//! - **Failures**: a dead peer (`ESRCH`, or its socket closed) fails operations with
//!   [`OpError::PeerUnreachable`]; memory the peer no longer has (`EFAULT`) with
//!   [`OpError::RemoteAccess`]. Bad plans are refused before anything moves.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvx_core::{MemoryKind, RegionDesc};
use kvx_layout::CopyOp;

use crate::board::{self, NoticeBoard};
use crate::desc::{BoardPlace, EndpointDesc};
use crate::error::{
    AddressError, ConnectError, DeregisterError, OpError, PollError, ReadError, RegisterError,
    SendError, WriteError,
};
use crate::peers::PeerTable;
use crate::region::LocalRegion;
use crate::same_host::{
    self, peer_gone, Completions, Control, Identity, Ledger, Link, NoticeSender, Reader, SameHost,
};
use crate::transport::{Capabilities, Event, Notice, OpId, OpKind, PeerId, Transport, Waker};

/// Backend name in endpoint descriptions.
pub const BACKEND: &str = "cma";
const ADDRESS_MAGIC: [u8; 4] = *b"KVXM";
const ADDRESS_VERSION: u8 = 1;
/// Pieces per system call (the kernel's `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// Settings of a [`CmaTransport`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct CmaConfig {
    /// An operation not finished after this long fails with [`OpError::TimedOut`].
    pub op_timeout: Duration,
    /// Copy threads: an operation of at least [`CmaConfig::split_bytes`] is cut into this many
    /// shares copied in parallel (the kernel's per-page copy, not memory bandwidth, limits one
    /// thread). Default: the machine's cores, at most 4.
    pub workers: usize,
    /// Operations smaller than this go to one thread whole.
    pub split_bytes: u64,
}

impl Default for CmaConfig {
    fn default() -> Self {
        Self {
            op_timeout: Duration::from_secs(30),
            workers: std::thread::available_parallelism().map_or(1, |n| n.get().min(4)),
            split_bytes: 2 << 20,
        }
    }
}

/// A CMA endpoint could not be opened, or an address is malformed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CmaError {
    /// A socket or thread could not be made.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The peer's address blob is malformed.
    #[error("malformed cma address: {0}")]
    Address(#[from] AddressError),
    /// The peer is another host's or this machine cannot reach it with CMA.
    #[error("the peer is not on this host")]
    OtherHost,
}

/// One accepted operation, shared by the threads that copy its shares.
struct Job {
    op: u64,
    pid: libc::pid_t,
    read: bool,
    notice: Option<JobNotice>,
    /// Shares not finished yet; the thread that finishes the last one reports the operation.
    left: AtomicUsize,
    failed: Mutex<Option<OpError>>,
}

/// How a job's notice reaches the peer once every share succeeded.
enum JobNotice {
    /// As a frame on the same-host control socket.
    Message(NoticeSender, u64),
    /// Written into the peer's notice board, at this address in its process (the value is
    /// boxed so that its address stays put while the job waits for its shares).
    Board { addr: u64, value: Box<u64> },
}

/// Part of a job for one copy thread: pieces (local address, remote address, length).
struct Share {
    job: Arc<Job>,
    pieces: Vec<(u64, u64, u64)>,
}

/// A copy thread: takes shares off the common queue, copies them, and for the last share of a
/// job sends its notice (only if every share succeeded) and reports it.
fn work(shares: &Mutex<Receiver<Share>>, completions: &Completions) {
    loop {
        let next = shares
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .recv();
        let Ok(share) = next else { return };
        let job = &share.job;
        if let Err(e) = copy(job.pid, job.read, &share.pieces) {
            let mut failed = job
                .failed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            failed.get_or_insert(e);
        }
        if job.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            continue;
        }
        let failed = job
            .failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let result = match (failed, &job.notice) {
            (Some(e), _) => Err(e),
            (None, None) => Ok(()),
            (None, Some(JobNotice::Message(sender, notice))) => sender
                .send_all(&[*notice])
                .1
                .map_err(|e| OpError::PeerUnreachable {
                    source: Box::new(e),
                }),
            // After every share's copy returned: the data is in the peer's memory before the
            // notice is (one more 8-byte copy; the peer compares the whole value, so a torn
            // write never reads as arrived).
            (None, Some(JobNotice::Board { addr, value })) => copy(
                job.pid,
                false,
                &[(std::ptr::from_ref::<u64>(value) as u64, *addr, 8)],
            ),
        };
        completions.push_all([(job.op, result)]);
    }
}

/// Cuts `pieces` into at most `parts` shares of about equal bytes (splitting a piece where a
/// share ends), in order.
fn split(pieces: Vec<(u64, u64, u64)>, parts: usize) -> Vec<Vec<(u64, u64, u64)>> {
    let total: u64 = pieces.iter().map(|p| p.2).sum();
    let parts = parts.max(1) as u64;
    if parts == 1 || total == 0 {
        return vec![pieces];
    }
    let target = total.div_ceil(parts);
    let mut shares = vec![Vec::new()];
    let mut room = target;
    for (mut l, mut r, mut len) in pieces {
        while len > 0 {
            if room == 0 {
                shares.push(Vec::new());
                room = target;
            }
            let n = len.min(room);
            if let Some(share) = shares.last_mut() {
                share.push((l, r, n));
            }
            l += n;
            r += n;
            len -= n;
            room -= n;
        }
    }
    shares
}

/// Moves `pieces` to (or, for `read`, from) process `pid`, up to [`IOV_MAX`] pieces per call,
/// resuming after partial transfers.
fn copy(pid: libc::pid_t, read: bool, pieces: &[(u64, u64, u64)]) -> Result<(), OpError> {
    let mut local: Vec<libc::iovec> = Vec::with_capacity(IOV_MAX);
    let mut remote: Vec<libc::iovec> = Vec::with_capacity(IOV_MAX);
    for batch in pieces.chunks(IOV_MAX) {
        // Skip what earlier calls of this batch already moved.
        let mut skip: u64 = 0;
        loop {
            local.clear();
            remote.clear();
            let mut left = skip;
            let mut want: u64 = 0;
            for &(l, r, len) in batch {
                if left >= len {
                    left -= len;
                    continue;
                }
                let (l, r, len) = (l + left, r + left, len - left);
                left = 0;
                local.push(libc::iovec {
                    iov_base: l as *mut libc::c_void,
                    iov_len: len as usize,
                });
                remote.push(libc::iovec {
                    iov_base: r as *mut libc::c_void,
                    iov_len: len as usize,
                });
                want += len;
            }
            if want == 0 {
                break;
            }
            // SAFETY: every local iovec lies inside a region registered with this endpoint (a
            // live `LocalRegion`, checked by `check_ops` when the operation was accepted, and
            // kept registered while it is in flight); the kernel checks the remote ranges against
            // the peer's address space and reports EFAULT instead of touching anything else.
            let moved = unsafe {
                if read {
                    libc::process_vm_readv(
                        pid,
                        local.as_ptr(),
                        local.len() as libc::c_ulong,
                        remote.as_ptr(),
                        remote.len() as libc::c_ulong,
                        0,
                    )
                } else {
                    libc::process_vm_writev(
                        pid,
                        local.as_ptr(),
                        local.len() as libc::c_ulong,
                        remote.as_ptr(),
                        remote.len() as libc::c_ulong,
                        0,
                    )
                }
            };
            if moved < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(os_error(err));
            }
            if moved == 0 {
                return Err(OpError::RemoteAccess {
                    source: "the peer's memory ended before the operation did".into(),
                });
            }
            skip += moved as u64;
            if moved as u64 == want {
                break;
            }
        }
    }
    Ok(())
}

/// The typed error of a failed CMA system call.
fn os_error(err: std::io::Error) -> OpError {
    match err.raw_os_error() {
        Some(libc::ESRCH) => OpError::PeerUnreachable {
            source: Box::new(err),
        },
        Some(libc::EPERM) => OpError::RemoteAccess {
            source: format!(
                "{err}: this process may not write into the peer (different user, or Yama \
                 ptrace_scope above 1; see /proc/sys/kernel/yama/ptrace_scope)"
            )
            .into(),
        },
        Some(libc::EFAULT) => OpError::RemoteAccess {
            source: format!("{err}: the peer's memory is no longer mapped").into(),
        },
        _ => OpError::Backend {
            source: Box::new(err),
        },
    }
}

struct Peer {
    who: Identity,
    link: Link,
    /// Region index → (address in the peer's process, length).
    regions: HashMap<u32, (u64, u64)>,
    /// The peer's notice board, if it has one.
    board: Option<BoardPlace>,
}

/// The CMA endpoint. See the [module documentation](self).
pub struct CmaTransport {
    config: CmaConfig,
    control: Control,
    regions: BTreeMap<u32, LocalRegion>,
    peers: PeerTable<Peer>,
    ledger: Ledger,
    shares: Option<Sender<Share>>,
    workers: Vec<std::thread::JoinHandle<()>>,
    board: Option<Arc<NoticeBoard>>,
}

impl CmaTransport {
    /// Opens an endpoint.
    ///
    /// # Errors
    /// [`CmaError::Io`] when the control socket or the worker thread cannot be made.
    pub fn open(config: CmaConfig) -> Result<Self, CmaError> {
        let control = Control::open(BACKEND).map_err(|source| CmaError::Io {
            what: "opening the control socket",
            source,
        })?;
        // Let the peers write into this process (Yama ptrace_scope 1): any process of this user,
        // or the one peer process a program gave leave to (`local_peer::TracerLeave`). A kernel
        // without Yama ignores it, and stricter settings make writes fail with a clear error.
        crate::local_peer::declare_tracer();
        let (shares, rx) = mpsc::channel();
        let rx = Arc::new(Mutex::new(rx));
        let mut workers = Vec::new();
        for i in 0..config.workers.max(1) {
            let (rx, completions) = (Arc::clone(&rx), control.completions());
            workers.push(
                std::thread::Builder::new()
                    .name(format!("kvx-cma-{i}"))
                    .spawn(move || work(&rx, &completions))
                    .map_err(|source| CmaError::Io {
                        what: "starting the copy threads",
                        source,
                    })?,
            );
        }
        Ok(Self {
            config,
            control,
            regions: BTreeMap::new(),
            peers: PeerTable::default(),
            ledger: Ledger::default(),
            shares: Some(shares),
            workers,
            board: None,
        })
    }

    fn address(&self) -> Vec<u8> {
        same_host::encode_head(ADDRESS_MAGIC, ADDRESS_VERSION, self.control.identity())
    }

    fn decode(bytes: &[u8]) -> Result<Identity, CmaError> {
        let mut reader = Reader::open(bytes, ADDRESS_MAGIC, ADDRESS_VERSION)?;
        let who = Identity::decode(&mut reader)?;
        reader.finish()?;
        Ok(who)
    }

    /// Checks `ops`, resolves them to (local, remote, len) pieces, and hands them to the worker.
    fn post(
        &mut self,
        peer: PeerId,
        kind: OpKind,
        ops: &[CopyOp],
        notice: Option<Notice>,
    ) -> Result<OpId, OpPostError> {
        let read = kind == OpKind::Read;
        let Some(p) = self.peers.get_mut(peer) else {
            return Err(OpPostError::UnknownPeer);
        };
        let local = |i: u32| self.regions.get(&i).map(|r| (r.addr() as u64, r.len()));
        let remote = |i: u32| p.regions.get(&i).copied();
        let bytes = if read {
            crate::validate::check_ops(ops, |i| remote(i).map(|x| x.1), |i| local(i).map(|x| x.1))
        } else {
            crate::validate::check_ops(ops, |i| local(i).map(|x| x.1), |i| remote(i).map(|x| x.1))
        }
        .map_err(OpPostError::Plan)?;
        let slot = board::slot_for(notice, p.board).map_err(OpPostError::Board)?;
        let notice = match (notice, slot) {
            (Some(Notice(n)), Some(addr)) => Some(JobNotice::Board {
                addr,
                value: Box::new(n),
            }),
            (Some(Notice(n)), None) => Some(JobNotice::Message(p.link.notices(), n)),
            (None, _) => None,
        };
        if !p.link.alive() {
            return Ok(self.ledger.done_now(peer, kind, Err(peer_gone())));
        }
        let mut pieces = Vec::new();
        let mut used = Vec::new();
        for op in ops {
            let (src_base, _) = if read {
                remote(op.src_region)
            } else {
                local(op.src_region)
            }
            .unwrap_or_default();
            let (dst_base, _) = if read {
                local(op.dst_region)
            } else {
                remote(op.dst_region)
            }
            .unwrap_or_default();
            used.push(if read { op.dst_region } else { op.src_region });
            let contiguous = op.count == 1 || (op.src_stride == op.len && op.dst_stride == op.len);
            let rows: Box<dyn Iterator<Item = (u64, u64, u64)>> = if contiguous {
                Box::new(std::iter::once((
                    op.src_offset,
                    op.dst_offset,
                    op.len * op.count,
                )))
            } else {
                Box::new(op.pieces())
            };
            for (s, d, len) in rows {
                let (src, dst) = (src_base + s, dst_base + d);
                // Pieces are (local, remote, len).
                pieces.push(if read {
                    (dst, src, len)
                } else {
                    (src, dst, len)
                });
            }
        }
        let parts = if bytes >= self.config.split_bytes {
            self.config.workers
        } else {
            1
        };
        let shares = split(pieces, parts);
        let job = Arc::new(Job {
            op: self.ledger.next_id(),
            pid: p.who.pid as libc::pid_t,
            read,
            notice,
            left: AtomicUsize::new(shares.len()),
            failed: Mutex::new(None),
        });
        let queue = self.shares.as_ref().ok_or(OpPostError::Worker)?;
        for pieces in shares {
            let share = Share {
                job: Arc::clone(&job),
                pieces,
            };
            if queue.send(share).is_err() {
                return Err(OpPostError::Worker);
            }
        }
        Ok(self.ledger.start(peer, kind, bytes, used))
    }
}

/// Why [`CmaTransport::post`] refused an operation.
enum OpPostError {
    UnknownPeer,
    Plan(crate::error::PlanError),
    Board(board::SlotOutOfRange),
    Worker,
}

fn worker_gone() -> crate::error::BackendError {
    "the CMA copy worker has exited".into()
}

impl Transport for CmaTransport {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            notice_bits: 64,
            max_message_len: same_host::MAX_MESSAGE_LEN,
            memory_kinds: vec![MemoryKind::Host],
            polls_to_wait: false,
            peer_rma_unassisted: true,
            peer_rma_occasional_reads: false,
        }
    }

    fn register(&mut self, region: LocalRegion) -> Result<RegionDesc, RegisterError> {
        crate::validate::check_registration(
            &region,
            self.regions.contains_key(&region.index()),
            BACKEND,
        )?;
        let desc = RegionDesc {
            index: region.index(),
            kind: region.kind(),
            addr: region.addr() as u64,
            len: region.len(),
            key: 0,
        };
        self.regions.insert(region.index(), region);
        Ok(desc)
    }

    fn deregister(&mut self, index: u32) -> Result<(), DeregisterError> {
        self.ledger.deregister(&mut self.regions, index)
    }

    fn local_desc(&self) -> EndpointDesc {
        EndpointDesc {
            backend: BACKEND.to_owned(),
            provider: String::new(),
            address: self.address(),
            notice_slot: None,
            board: self.board.as_ref().map(|b| b.place()),
            regions: self
                .regions
                .values()
                .map(|r| RegionDesc {
                    index: r.index(),
                    kind: r.kind(),
                    addr: r.addr() as u64,
                    len: r.len(),
                    key: 0,
                })
                .collect(),
        }
    }

    fn connect(&mut self, desc: &EndpointDesc) -> Result<PeerId, ConnectError> {
        desc.validate().map_err(ConnectError::BadDescription)?;
        if desc.backend != BACKEND {
            return Err(ConnectError::Mismatch {
                expected: BACKEND.to_owned(),
                found: format!("{}/{}", desc.backend, desc.provider),
            });
        }
        let who = Self::decode(&desc.address).map_err(|e| ConnectError::BadAddress {
            source: Box::new(e),
        })?;
        if let Some(region) = desc.regions.iter().find(|r| r.kind != MemoryKind::Host) {
            return Err(ConnectError::BadAddress {
                source: format!(
                    "region {} is {} memory; cma moves host memory",
                    region.index, region.kind
                )
                .into(),
            });
        }
        let regions = desc
            .regions
            .iter()
            .map(|r| (r.index, (r.addr, r.len)))
            .collect();
        let board = desc.board;
        if let Some(id) = self.peers.find(|p| p.who == who) {
            if let Some(known) = self.peers.get_mut(id) {
                known.regions = regions;
                known.board = board;
            }
            return Ok(id);
        }
        let link =
            Link::connect(&who.socket, Some(who.pid)).map_err(|e| ConnectError::Unreachable {
                source: Box::new(CmaError::Io {
                    what: "connecting to the peer",
                    source: e,
                }),
            })?;
        Ok(self.peers.insert(Peer {
            who,
            link,
            regions,
            board,
        }))
    }

    fn disconnect(&mut self, peer: PeerId) {
        // Operations in flight carry what they need (the peer's pid, and a handle on its
        // socket for their notice, which closes when the last of them ends).
        self.peers.remove(peer);
    }

    fn write(
        &mut self,
        peer: PeerId,
        ops: &[CopyOp],
        notice: Option<Notice>,
    ) -> Result<OpId, WriteError> {
        self.post(peer, OpKind::Write, ops, notice)
            .map_err(|e| match e {
                OpPostError::UnknownPeer => WriteError::UnknownPeer(peer),
                OpPostError::Plan(p) => WriteError::Plan(p),
                OpPostError::Board(b) => WriteError::NoBoardSlot(b),
                OpPostError::Worker => WriteError::Backend(worker_gone()),
            })
    }

    fn read(&mut self, peer: PeerId, ops: &[CopyOp]) -> Result<OpId, ReadError> {
        self.post(peer, OpKind::Read, ops, None)
            .map_err(|e| match e {
                OpPostError::UnknownPeer => ReadError::UnknownPeer(peer),
                OpPostError::Plan(p) => ReadError::Plan(p),
                OpPostError::Worker => ReadError::Backend(worker_gone()),
                // A read posts no notice.
                OpPostError::Board(e) => ReadError::Backend(Box::new(e)),
            })
    }

    fn notice_board(&mut self, slots: usize) -> Option<Arc<NoticeBoard>> {
        Some(Arc::clone(
            self.board
                .get_or_insert_with(|| Arc::new(NoticeBoard::new(slots))),
        ))
    }

    fn send(&mut self, peer: PeerId, message: &[u8]) -> Result<OpId, SendError> {
        let link = self.peers.get_mut(peer).map(|p| &mut p.link);
        same_host::send(link, &mut self.ledger, peer, message)
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, PollError> {
        self.poll_now(events)
    }

    fn wait(&mut self, events: &mut Vec<Event>, timeout: Duration) -> Result<usize, PollError> {
        same_host::wait(self, events, timeout)
    }

    fn waker(&self) -> Option<Arc<dyn Waker>> {
        Some(self.control.completions())
    }
}

impl SameHost for CmaTransport {
    fn parts(&mut self) -> (&mut Control, &mut Ledger) {
        (&mut self.control, &mut self.ledger)
    }

    fn op_timeout(&self) -> Duration {
        self.config.op_timeout
    }
}

impl Drop for CmaTransport {
    fn drop(&mut self) {
        // The copy threads finish the shares they were given (their local memory is still
        // registered: the regions drop after this) and exit.
        drop(self.shares.take());
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests;
