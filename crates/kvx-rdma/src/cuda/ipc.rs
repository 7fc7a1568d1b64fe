//! The CUDA IPC backend: prefill and decode on one host, in separate processes, on the same GPU
//! or on GPUs with peer access (NVLink). The common 1P1D-on-one-node deployment.
//!
//! - **Memory**: each registered region's allocation is exported with `cuIpcGetMemHandle`; the
//!   handles travel in the endpoint description's address, and a peer opens them once
//!   (`cuIpcOpenMemHandle`, peer access enabled lazily) and keeps the mapping until it disconnects
//!   or the transport drops. Two endpoints of one process use each other's addresses directly.
//! - **Data**: one non-blocking stream per peer. A plan's operations go to the copy engines
//!   (`cuMemcpyAsync`, `cuMemcpy2DAsync` for strided runs) or, when they are many small runs, to
//!   the batched-copy kernel (one launch); [`CopyMethod`] chooses.
//! - **Notices and messages**: a Unix stream socket per endpoint (abstract namespace, so nothing
//!   is left on disk). A host function queued on the stream behind the copies wakes the endpoint
//!   (a pipe), and only then is the notice sent: the consumer sees it after every byte landed.
//! - **Waiting**: `wait` blocks in `poll(2)` on the socket, its connections and the wake pipe; no
//!   thread spins.
//!
//! A peer that died is found when its socket closes: operations towards it fail with
//! [`OpError::PeerUnreachable`] and no notice is sent.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use kvx_core::{MemoryKind, RegionDesc};
use kvx_layout::CopyOp;

use super::driver::{check, CudaError, Gpu, Stream};
use super::kernels::LayoutKernels;
use crate::desc::EndpointDesc;
use crate::error::{
    BackendError, ConnectError, DeregisterError, OpError, PollError, ReadError, RegisterError,
    SendError, WriteError,
};
use crate::region::LocalRegion;
use crate::transport::{Capabilities, Event, Notice, OpId, OpKind, PeerId, Transport};

/// Backend name in endpoint descriptions.
pub const BACKEND: &str = "cuda-ipc";
/// Longest control message.
pub const MAX_MESSAGE_LEN: usize = 64 << 10;
const ADDRESS_MAGIC: [u8; 4] = *b"KVXC";
const ADDRESS_VERSION: u8 = 1;
const FRAME_NOTICE: u8 = 1;
const FRAME_MESSAGE: u8 = 2;
/// Average run below which [`CopyMethod::Auto`] prefers the batched-copy kernel.
const KERNEL_BELOW: u64 = 64 << 10;

/// How a plan's bytes are moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum CopyMethod {
    /// The copy engines for plans of long runs, the batched-copy kernel for plans of many short
    /// runs (average under 64 KiB), falling back to the copy engines where NVRTC is missing.
    #[default]
    Auto,
    /// Always the copy engines (`cuMemcpyAsync` / `cuMemcpy2DAsync`).
    CopyEngine,
    /// Always the batched-copy kernel.
    Kernel,
}

/// Settings of a [`CudaIpcTransport`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct CudaIpcConfig {
    /// CUDA device ordinal whose memory this endpoint registers.
    pub device: u32,
    /// How plans are moved.
    pub copy: CopyMethod,
    /// An operation not finished after this long fails with [`OpError::TimedOut`].
    pub op_timeout: Duration,
}

impl CudaIpcConfig {
    /// Defaults for device `device`.
    #[must_use]
    pub fn new(device: u32) -> Self {
        Self {
            device,
            copy: CopyMethod::Auto,
            op_timeout: Duration::from_secs(30),
        }
    }
}

/// A CUDA IPC failure, as the source of the transport's errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// A CUDA call failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A socket operation failed.
    #[error("{what}: {source}")]
    Socket {
        /// What was being done.
        what: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The peer's address blob is malformed.
    #[error("malformed cuda-ipc address: {0}")]
    Address(String),
    /// The peer closed its socket (it exited or dropped its endpoint).
    #[error("the peer closed its connection")]
    PeerClosed,
    /// The region is on another device than the endpoint.
    #[error("region is on CUDA device {region}, this endpoint on device {endpoint}")]
    WrongDevice {
        /// The region's device.
        region: u32,
        /// The endpoint's device.
        endpoint: u32,
    },
}

fn socket_error(what: &'static str) -> impl FnOnce(std::io::Error) -> IpcError {
    move |source| IpcError::Socket { what, source }
}

fn boxed(e: impl Into<IpcError>) -> BackendError {
    Box::new(e.into())
}

/// One exported region in the address blob.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ExportedRegion {
    index: u32,
    handle: [u8; 64],
    /// The region's offset inside the exported allocation.
    offset: u64,
}

/// The backend-specific address: who the endpoint is, where its socket is, and the IPC handles of
/// its regions.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Address {
    pid: u32,
    incarnation: u64,
    device: u32,
    socket: String,
    regions: Vec<ExportedRegion>,
}

impl Address {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.socket.len() + self.regions.len() * 76);
        out.extend_from_slice(&ADDRESS_MAGIC);
        out.push(ADDRESS_VERSION);
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.incarnation.to_le_bytes());
        out.extend_from_slice(&self.device.to_le_bytes());
        out.push(self.socket.len() as u8);
        out.extend_from_slice(self.socket.as_bytes());
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            out.extend_from_slice(&r.index.to_le_bytes());
            out.extend_from_slice(&r.handle);
            out.extend_from_slice(&r.offset.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8]) -> Result<Self, IpcError> {
        let mut at = 0;
        let mut take = |n: usize, what: &str| -> Result<&[u8], IpcError> {
            let piece = bytes
                .get(at..at + n)
                .ok_or_else(|| IpcError::Address(format!("truncated at {what}")))?;
            at += n;
            Ok(piece)
        };
        let u32_at = |b: &[u8]| u32::from_le_bytes(b.try_into().unwrap_or_default());
        let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or_default());
        if take(4, "magic")? != ADDRESS_MAGIC {
            return Err(IpcError::Address("bad magic".into()));
        }
        let version = take(1, "version")?[0];
        if version != ADDRESS_VERSION {
            return Err(IpcError::Address(format!("unsupported version {version}")));
        }
        let pid = u32_at(take(4, "pid")?);
        let incarnation = u64_at(take(8, "incarnation")?);
        let device = u32_at(take(4, "device")?);
        let socket_len = take(1, "socket length")?[0] as usize;
        let socket = String::from_utf8(take(socket_len, "socket")?.to_vec())
            .map_err(|_| IpcError::Address("socket name is not UTF-8".into()))?;
        let count = u32_at(take(4, "region count")?) as usize;
        if count > crate::desc::MAX_REGIONS || count * 76 > bytes.len() {
            return Err(IpcError::Address(format!("{count} regions")));
        }
        let mut regions = Vec::with_capacity(count);
        for _ in 0..count {
            let index = u32_at(take(4, "region index")?);
            let mut handle = [0; 64];
            handle.copy_from_slice(take(64, "handle")?);
            let offset = u64_at(take(8, "region offset")?);
            regions.push(ExportedRegion {
                index,
                handle,
                offset,
            });
        }
        if at != bytes.len() {
            return Err(IpcError::Address(format!(
                "{} trailing bytes",
                bytes.len() - at
            )));
        }
        Ok(Self {
            pid,
            incarnation,
            device,
            socket,
            regions,
        })
    }
}

/// Operations the watcher found finished (or failed); the pipe wakes `wait`.
struct Completions {
    done: Mutex<Vec<(u64, Result<(), IpcError>)>>,
    wake: OwnedFd,
}

impl Completions {
    fn push_all(&self, results: Vec<(u64, Result<(), IpcError>)>) {
        self.done
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(results);
        // SAFETY: writes one byte from a live local to an fd this struct owns; a full pipe
        // (EAGAIN) already guarantees a wake-up.
        let _ = unsafe { libc::write(self.wake.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
    }
}

/// A recorded completion event (blocking-sync, no timing), reused through [`EventPool`].
struct RawEvent(sys::CUevent);

// SAFETY: an event handle may be waited on and destroyed from any thread that binds its context.
unsafe impl Send for RawEvent {}

/// Completion events, created on demand and reused.
struct EventPool {
    gpu: Arc<Gpu>,
    free: Mutex<Vec<RawEvent>>,
}

impl EventPool {
    fn take(&self) -> Result<RawEvent, CudaError> {
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

    fn give(&self, event: RawEvent) {
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
struct Watch {
    /// (operation, notice) in posting order.
    ops: Vec<(u64, Option<u64>)>,
    event: RawEvent,
    conn: Arc<Mutex<UnixStream>>,
}

/// The watcher thread: waits on each batch's event in posting order (the event sleeps in the
/// driver, no spinning, and never stalls a stream the way a host function would), sends the
/// notices only then, and reports the outcomes. Exits when the transport drops its sender.
fn watch(
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

/// Waits for a batch's event, then sends its notices.
fn finish(job: Watch, pool: &EventPool, results: &mut Vec<(u64, Result<(), IpcError>)>) {
    // SAFETY: the event was recorded on a live stream of this context before it was sent.
    let waited = check("cuEventSynchronize", unsafe {
        sys::cuEventSynchronize(job.event.0)
    });
    pool.give(job.event);
    for (op, notice) in job.ops {
        let result = match (&waited, notice) {
            (Err(e), _) => Err(IpcError::Cuda(e.clone())),
            (Ok(()), None) => Ok(()),
            (Ok(()), Some(notice)) => {
                let mut frame = [0u8; 9];
                frame[0] = FRAME_NOTICE;
                frame[1..].copy_from_slice(&notice.to_le_bytes());
                job.conn
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .write_all(&frame)
                    .map_err(socket_error("sending the completion notice"))
            }
        };
        results.push((op, result));
    }
}

/// A peer's allocation opened in this process.
struct Mapping {
    gpu: Arc<Gpu>,
    base: u64,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: opened once by `cuIpcOpenMemHandle`; the peer's stream was synchronised
            // before mappings drop (`Peer::drop`).
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        }
    }
}

struct Peer {
    socket: String,
    pid: u32,
    incarnation: u64,
    /// Shared with the watcher thread, which sends completion notices.
    conn: Arc<Mutex<UnixStream>>,
    /// Last time `check_alive` asked the socket.
    checked: Option<Instant>,
    /// Region index → (address in this process, length).
    regions: HashMap<u32, (u64, u64)>,
    mappings: HashMap<[u8; 64], Mapping>,
    stream: Stream,
    kernels: Option<LayoutKernels>,
    /// Kernels could not be compiled here (no NVRTC): the copy engines are used.
    kernels_unavailable: bool,
    closed: bool,
    /// Operations posted since the last flush, with their notices: one event recorded behind
    /// the last of them covers them all (the peer's streams are ordered among themselves).
    unflushed: Vec<(u64, Option<u64>)>,
    /// Whether the peer's latest work went to the kernel queue's stream.
    last_on_kernels: bool,
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Copies into the peer's mapped memory must end before the mappings close.
        let _ = self.stream.synchronize();
        if let Some(kernels) = &self.kernels {
            let _ = kernels.synchronize();
        }
    }
}

impl Peer {
    /// Whether the peer still has its end open (a non-blocking peek; asked at most once a
    /// millisecond, so back-to-back writes do not pay a system call each).
    fn check_alive(&mut self) -> bool {
        if self.closed {
            return false;
        }
        if self
            .checked
            .is_some_and(|t| t.elapsed() < Duration::from_millis(1))
        {
            return true;
        }
        self.checked = Some(Instant::now());
        let fd = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_raw_fd();
        let mut byte = [0u8; 1];
        // SAFETY: a one-byte peek into a live local buffer on a connected socket that `self`
        // keeps open.
        let n = unsafe {
            libc::recv(
                fd,
                byte.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n == 0 {
            self.closed = true;
        } else if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != ErrorKind::WouldBlock && err.kind() != ErrorKind::Interrupted {
                self.closed = true;
            }
        }
        !self.closed
    }

    fn send_frame(&mut self, frame: &[u8]) -> Result<(), IpcError> {
        if self.closed {
            return Err(IpcError::PeerClosed);
        }
        let sent = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .write_all(frame);
        sent.map_err(|e| {
            self.closed = true;
            IpcError::Socket {
                what: "sending to the peer",
                source: e,
            }
        })
    }
}

struct Inbound {
    conn: UnixStream,
    buf: Vec<u8>,
}

struct Pending {
    peer: PeerId,
    kind: OpKind,
    bytes: u64,
    regions: Vec<u32>,
    started: Instant,
}

struct Local {
    region: LocalRegion,
    handle: [u8; 64],
    offset: u64,
}

/// The CUDA IPC endpoint. See the [module documentation](self).
pub struct CudaIpcTransport {
    gpu: Arc<Gpu>,
    config: CudaIpcConfig,
    incarnation: u64,
    socket: String,
    listener: UnixListener,
    inbound: Vec<Inbound>,
    regions: BTreeMap<u32, Local>,
    peers: Vec<Option<Peer>>,
    next_op: u64,
    pending: HashMap<u64, Pending>,
    completions: Arc<Completions>,
    wake_rx: OwnedFd,
    events: VecDeque<Event>,
    pool: Arc<EventPool>,
    /// Sender to the watcher thread (dropped first on drop, which ends the thread).
    watch: Option<std::sync::mpsc::Sender<Watch>>,
    watcher: Option<std::thread::JoinHandle<()>>,
}

impl CudaIpcTransport {
    /// Opens an endpoint on `config.device`.
    ///
    /// # Errors
    /// [`IpcError::Cuda`] where CUDA is missing or the device does not exist, [`IpcError::Socket`]
    /// when the control socket cannot be made.
    pub fn open(config: CudaIpcConfig) -> Result<Self, IpcError> {
        let gpu = Gpu::open(config.device)?;
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let pid = std::process::id();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let serial = COUNTER.fetch_add(1, Ordering::Relaxed);
        let incarnation =
            kvx_core::ids::fnv1a_64(&[nanos.to_le_bytes(), serial.to_le_bytes()].concat())
                ^ u64::from(pid);
        let socket = format!("kvx-cuda-ipc/{pid}/{serial}/{incarnation:016x}");
        let addr = SocketAddr::from_abstract_name(socket.as_bytes())
            .map_err(socket_error("naming the control socket"))?;
        let listener =
            UnixListener::bind_addr(&addr).map_err(socket_error("binding the control socket"))?;
        listener
            .set_nonblocking(true)
            .map_err(socket_error("configuring the control socket"))?;
        let mut fds = [0 as RawFd; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 returns.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(IpcError::Socket {
                what: "creating the wake pipe",
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: pipe2 returned two fresh descriptors that nothing else owns.
        let (wake_rx, wake_tx) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let completions = Arc::new(Completions {
            done: Mutex::new(Vec::new()),
            wake: wake_tx,
        });
        let pool = Arc::new(EventPool {
            gpu: Arc::clone(&gpu),
            free: Mutex::new(Vec::new()),
        });
        let (watch_tx, watch_rx) = std::sync::mpsc::channel();
        let watcher = {
            let (gpu, pool, completions) = (
                Arc::clone(&gpu),
                Arc::clone(&pool),
                Arc::clone(&completions),
            );
            std::thread::Builder::new()
                .name("kvx-cuda-watch".into())
                .spawn(move || watch(&gpu, &watch_rx, &pool, &completions))
                .map_err(socket_error("starting the completion watcher"))?
        };
        Ok(Self {
            gpu,
            config,
            incarnation,
            socket,
            listener,
            inbound: Vec::new(),
            regions: BTreeMap::new(),
            peers: Vec::new(),
            next_op: 0,
            pending: HashMap::new(),
            completions,
            wake_rx,
            events: VecDeque::new(),
            pool,
            watch: Some(watch_tx),
            watcher: Some(watcher),
        })
    }

    /// The device this endpoint serves.
    #[must_use]
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn address(&self) -> Address {
        Address {
            pid: std::process::id(),
            incarnation: self.incarnation,
            device: self.gpu.ordinal(),
            socket: self.socket.clone(),
            regions: self
                .regions
                .iter()
                .map(|(&index, local)| ExportedRegion {
                    index,
                    handle: local.handle,
                    offset: local.offset,
                })
                .collect(),
        }
    }

    fn peer_mut(&mut self, peer: PeerId) -> Option<&mut Peer> {
        self.peers.get_mut(peer.0 as usize).and_then(Option::as_mut)
    }

    /// Posts `ops` on the peer's stream (copy engines or the batched-copy kernel), records a
    /// completion event behind them and hands it to the watcher; returns the op id.
    fn post(
        &mut self,
        peer_id: PeerId,
        kind: OpKind,
        ops: &[CopyOp],
        notice: Option<Notice>,
        bytes: u64,
    ) -> Result<OpId, BackendError> {
        let op = self.next_op;
        let method = self.config.copy;
        let max_pitch = self.gpu.max_pitch();
        let regions = &self.regions;
        let local = |i: u32| {
            regions
                .get(&i)
                .map(|l| (l.region.addr() as u64, l.region.len()))
        };
        let Some(peer) = self
            .peers
            .get_mut(peer_id.0 as usize)
            .and_then(Option::as_mut)
        else {
            return Err(boxed(IpcError::PeerClosed));
        };
        let remote_regions = &peer.regions;
        let remote = |i: u32| remote_regions.get(&i).copied();
        let (src, dst): (RegionFn<'_>, RegionFn<'_>) = match kind {
            OpKind::Read => (&remote, &local),
            _ => (&local, &remote),
        };
        let runs: u64 = ops.iter().map(|o| o.count).sum();
        let use_kernel = match method {
            CopyMethod::CopyEngine => false,
            CopyMethod::Kernel => true,
            CopyMethod::Auto => {
                !peer.kernels_unavailable && runs > 64 && bytes / runs.max(1) < KERNEL_BELOW
            }
        };
        if use_kernel && peer.kernels.is_none() {
            match LayoutKernels::new(peer.stream.gpu()) {
                Ok(k) => peer.kernels = Some(k),
                Err(e) if method == CopyMethod::Auto => {
                    peer.kernels_unavailable = true;
                    note_fallback(&e);
                }
                Err(e) => return Err(boxed(e)),
            }
        }
        match peer.kernels.as_mut().filter(|_| use_kernel) {
            Some(kernels) => {
                // Ordered behind the peer's earlier copy-engine work.
                sync_streams(&peer.stream, kernels.stream()).map_err(boxed)?;
                // SAFETY: every address resolves inside a registered local region or a peer
                // region mapped for the peer's lifetime, and `Peer::drop` synchronises the queue
                // before the mappings close.
                unsafe { kernels.copy_ops(ops, src, dst) }.map_err(boxed)?;
                peer.last_on_kernels = true;
            }
            None => {
                if let Some(kernels) = &peer.kernels {
                    sync_streams(kernels.stream(), &peer.stream).map_err(boxed)?;
                }
                post_copy_engine(&peer.stream, ops, src, dst, max_pitch).map_err(boxed)?;
                peer.last_on_kernels = false;
            }
        }
        // The completion event is recorded at the next poll or wait, behind everything posted
        // until then (`flush`).
        peer.unflushed.push((op, notice.map(|Notice(n)| n)));
        let used = ops
            .iter()
            .map(|op| match kind {
                OpKind::Read => op.dst_region,
                _ => op.src_region,
            })
            .collect();
        self.next_op += 1;
        self.pending.insert(
            op,
            Pending {
                peer: peer_id,
                kind,
                bytes,
                regions: used,
                started: Instant::now(),
            },
        );
        Ok(OpId(op))
    }

    /// Records one completion event behind each peer's operations posted since the last flush
    /// and hands them to the watcher; operations that cannot be handed over fail now.
    fn flush(&mut self) {
        for (index, slot) in self.peers.iter_mut().enumerate() {
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
                        conn: Arc::clone(&peer.conn),
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
                    if let Some(p) = self.pending.remove(&op) {
                        self.events.push_back(Event::Failed {
                            op: OpId(op),
                            kind: p.kind,
                            peer: PeerId(index as u32),
                            error: OpError::Backend {
                                source: text.clone().into(),
                            },
                        });
                    }
                }
            }
        }
    }

    /// Fails an operation at once (the peer is gone) without posting anything.
    fn fail_now(&mut self, peer: PeerId, kind: OpKind) -> OpId {
        let op = self.next_op;
        self.next_op += 1;
        self.events.push_back(Event::Failed {
            op: OpId(op),
            kind,
            peer,
            error: OpError::PeerUnreachable {
                source: boxed(IpcError::PeerClosed),
            },
        });
        OpId(op)
    }

    fn accept_and_read(&mut self) {
        while let Ok((conn, _)) = self.listener.accept() {
            if conn.set_nonblocking(true).is_ok() {
                self.inbound.push(Inbound {
                    conn,
                    buf: Vec::new(),
                });
            }
        }
        let mut chunk = [0u8; 16 << 10];
        let mut i = 0;
        while i < self.inbound.len() {
            let mut closed = false;
            loop {
                match self.inbound[i].conn.read(&mut chunk) {
                    Ok(0) => {
                        closed = true;
                        break;
                    }
                    Ok(n) => self.inbound[i].buf.extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => {
                        closed = true;
                        break;
                    }
                }
            }
            let malformed = parse_frames(&mut self.inbound[i].buf, &mut self.events);
            if closed || malformed {
                self.inbound.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    fn finish_completed(&mut self) {
        let mut drain = [0u8; 256];
        // SAFETY: reads into a live local buffer from the pipe's read end (non-blocking).
        while unsafe {
            libc::read(
                self.wake_rx.as_raw_fd(),
                drain.as_mut_ptr().cast(),
                drain.len(),
            )
        } > 0
        {}
        let done = std::mem::take(
            &mut *self
                .completions
                .done
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for (op, result) in done {
            let Some(pending) = self.pending.remove(&op) else {
                continue; // already failed by its timeout
            };
            let (op, peer, bytes) = (OpId(op), pending.peer, pending.bytes);
            let event = match (result, pending.kind) {
                (Ok(()), OpKind::Read) => Event::ReadDone { op, peer, bytes },
                (Ok(()), _) => Event::WriteDone { op, peer, bytes },
                (Err(e), kind) => {
                    let unreachable = matches!(e, IpcError::Socket { .. });
                    if unreachable {
                        if let Some(p) = self.peer_mut(peer) {
                            p.closed = true;
                        }
                    }
                    let source = boxed(e);
                    let error = if unreachable {
                        OpError::PeerUnreachable { source }
                    } else {
                        OpError::Backend { source }
                    };
                    Event::Failed {
                        op,
                        kind,
                        peer,
                        error,
                    }
                }
            };
            self.events.push_back(event);
        }
        let timeout = self.config.op_timeout;
        let expired: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.started.elapsed() > timeout)
            .map(|(&op, _)| op)
            .collect();
        for op in expired {
            if let Some(p) = self.pending.remove(&op) {
                self.events.push_back(Event::Failed {
                    op: OpId(op),
                    kind: p.kind,
                    peer: p.peer,
                    error: OpError::TimedOut(timeout),
                });
            }
        }
    }
}

/// A region lookup: index → (address in this process, length).
type RegionFn<'a> = &'a dyn Fn(u32) -> Option<(u64, u64)>;

/// Note for a fallback that changes nothing the caller must act on.
fn note_fallback(error: &CudaError) {
    if std::env::var_os("KVX_DEBUG").is_some() {
        eprintln!("kvx cuda-ipc: batched-copy kernel unavailable, using the copy engines: {error}");
    }
}

/// Makes `later` wait for everything queued on `earlier` so far.
fn sync_streams(earlier: &Stream, later: &Stream) -> Result<(), CudaError> {
    let gpu = earlier.gpu();
    gpu.bind()?;
    let mut event = std::ptr::null_mut();
    // SAFETY: bound context, valid out-pointer.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(
            &raw mut event,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
        )
    })?;
    // SAFETY: live event and streams of one context; the event may be destroyed right after the
    // wait is queued (the driver keeps what the wait needs).
    let result = unsafe {
        check("cuEventRecord", sys::cuEventRecord(event, earlier.raw())).and_then(|()| {
            check(
                "cuStreamWaitEvent",
                sys::cuStreamWaitEvent(later.raw(), event, 0),
            )
        })
    };
    // SAFETY: created above, destroyed once.
    unsafe { sys::cuEventDestroy_v2(event) };
    result
}

/// Queues `ops` on `stream` as copy-engine copies: one `cuMemcpyAsync` per contiguous operation,
/// one `cuMemcpy2DAsync` per strided one (per piece where the pitch is out of the 2-D limits).
fn post_copy_engine(
    stream: &Stream,
    ops: &[CopyOp],
    src: &dyn Fn(u32) -> Option<(u64, u64)>,
    dst: &dyn Fn(u32) -> Option<(u64, u64)>,
    max_pitch: u64,
) -> Result<(), CudaError> {
    crate::validate::check_ops(ops, |r| src(r).map(|x| x.1), |r| dst(r).map(|x| x.1))
        .map_err(|e| CudaError::Invalid(e.to_string()))?;
    stream.gpu().bind()?;
    for op in ops {
        let (src_base, _) = src(op.src_region).unwrap_or_default();
        let (dst_base, _) = dst(op.dst_region).unwrap_or_default();
        let contiguous = op.count == 1 || (op.src_stride == op.len && op.dst_stride == op.len);
        if contiguous {
            // SAFETY: both ranges lie inside live regions (checked above); the caller keeps
            // them alive until the stream has run.
            check("cuMemcpyAsync", unsafe {
                sys::cuMemcpyAsync(
                    dst_base + op.dst_offset,
                    src_base + op.src_offset,
                    (op.len * op.count) as usize,
                    stream.raw(),
                )
            })?;
        } else if op.src_stride >= op.len
            && op.dst_stride >= op.len
            && op.src_stride <= max_pitch
            && op.dst_stride <= max_pitch
        {
            let copy = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                srcHost: std::ptr::null(),
                srcDevice: src_base + op.src_offset,
                srcArray: std::ptr::null_mut(),
                srcPitch: op.src_stride as usize,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                dstHost: std::ptr::null_mut(),
                dstDevice: dst_base + op.dst_offset,
                dstArray: std::ptr::null_mut(),
                dstPitch: op.dst_stride as usize,
                WidthInBytes: op.len as usize,
                Height: op.count as usize,
            };
            // SAFETY: every row lies inside live regions (checked above); the descriptor is
            // read during the call.
            check("cuMemcpy2DAsync", unsafe {
                sys::cuMemcpy2DAsync_v2(&raw const copy, stream.raw())
            })?;
        } else {
            for (s, d, len) in op.pieces() {
                // SAFETY: as for the contiguous case, per piece.
                check("cuMemcpyAsync", unsafe {
                    sys::cuMemcpyAsync(dst_base + d, src_base + s, len as usize, stream.raw())
                })?;
            }
        }
    }
    Ok(())
}

/// Parses complete frames off the front of `buf` into events; true when the stream is malformed
/// (the connection is then dropped).
fn parse_frames(buf: &mut Vec<u8>, events: &mut VecDeque<Event>) -> bool {
    let mut at = 0;
    let malformed = loop {
        let rest = &buf[at..];
        match rest.first() {
            None => break false,
            Some(&FRAME_NOTICE) => {
                if rest.len() < 9 {
                    break false;
                }
                let n = u64::from_le_bytes(rest[1..9].try_into().unwrap_or_default());
                events.push_back(Event::Notice(Notice(n)));
                at += 9;
            }
            Some(&FRAME_MESSAGE) => {
                if rest.len() < 5 {
                    break false;
                }
                let len = u32::from_le_bytes(rest[1..5].try_into().unwrap_or_default()) as usize;
                if len > MAX_MESSAGE_LEN {
                    break true;
                }
                if rest.len() < 5 + len {
                    break false;
                }
                events.push_back(Event::Message(rest[5..5 + len].to_vec()));
                at += 5 + len;
            }
            Some(_) => break true,
        }
    };
    buf.drain(..at);
    malformed
}

impl Transport for CudaIpcTransport {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            notice_bits: 64,
            max_message_len: MAX_MESSAGE_LEN,
            memory_kinds: vec![MemoryKind::Cuda {
                device: self.gpu.ordinal(),
            }],
        }
    }

    fn register(&mut self, region: LocalRegion) -> Result<RegionDesc, RegisterError> {
        let index = region.index();
        if self.regions.contains_key(&index) {
            return Err(RegisterError::Duplicate(index));
        }
        if region.is_empty() {
            return Err(RegisterError::Empty(index));
        }
        let device = match region.kind() {
            MemoryKind::Cuda { device } => device,
            kind => {
                return Err(RegisterError::UnsupportedKind {
                    index,
                    kind,
                    backend: BACKEND,
                })
            }
        };
        let backend = |e: IpcError| RegisterError::Backend {
            index,
            source: boxed(e),
        };
        if device != self.gpu.ordinal() {
            return Err(backend(IpcError::WrongDevice {
                region: device,
                endpoint: self.gpu.ordinal(),
            }));
        }
        self.gpu.bind().map_err(|e| backend(e.into()))?;
        let addr = region.addr() as u64;
        let (mut base, mut size) = (0, 0);
        // SAFETY: valid out-pointers; the driver checks that `addr` is device memory.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, addr)
        })
        .map_err(|e| backend(e.into()))?;
        if addr + region.len() > base + size as u64 {
            return Err(backend(IpcError::Cuda(CudaError::Invalid(format!(
                "region {index} ({} bytes at {addr:#x}) runs past its allocation ({size} bytes at {base:#x})",
                region.len()
            )))));
        }
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `base` is the start of a live cuMemAlloc allocation (reported by the driver).
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&raw mut handle, base)
        })
        .map_err(|e| backend(e.into()))?;
        let desc = RegionDesc {
            index,
            kind: region.kind(),
            addr,
            len: region.len(),
            key: 0,
        };
        self.regions.insert(
            index,
            Local {
                region,
                handle: handle.reserved.map(|b| b as u8),
                offset: addr - base,
            },
        );
        Ok(desc)
    }

    fn deregister(&mut self, index: u32) -> Result<(), DeregisterError> {
        if !self.regions.contains_key(&index) {
            return Err(DeregisterError::Unknown(index));
        }
        let ops = self
            .pending
            .values()
            .filter(|p| p.regions.contains(&index))
            .count();
        if ops > 0 {
            return Err(DeregisterError::InUse { index, ops });
        }
        self.regions.remove(&index);
        Ok(())
    }

    fn local_desc(&self) -> EndpointDesc {
        EndpointDesc {
            backend: BACKEND.to_owned(),
            provider: String::new(),
            address: self.address().encode(),
            notice_slot: None,
            regions: self
                .regions
                .values()
                .map(|l| RegionDesc {
                    index: l.region.index(),
                    kind: l.region.kind(),
                    addr: l.region.addr() as u64,
                    len: l.region.len(),
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
        let bad = |e: IpcError| ConnectError::BadAddress { source: boxed(e) };
        let address = Address::decode(&desc.address).map_err(bad)?;
        let same_process = address.pid == std::process::id();
        let existing = self.peers.iter().position(|p| {
            p.as_ref()
                .is_some_and(|p| p.socket == address.socket && p.incarnation == address.incarnation)
        });
        let id = match existing {
            Some(i) => i,
            None => {
                let addr = SocketAddr::from_abstract_name(address.socket.as_bytes())
                    .map_err(|e| bad(socket_error("naming the peer socket")(e)))?;
                let conn =
                    UnixStream::connect_addr(&addr).map_err(|e| ConnectError::Unreachable {
                        source: boxed(socket_error("connecting to the peer")(e)),
                    })?;
                let _ = conn.set_write_timeout(Some(Duration::from_secs(5)));
                let conn = Arc::new(Mutex::new(conn));
                let stream = Stream::new(&self.gpu).map_err(|e| bad(e.into()))?;
                self.peers.push(Some(Peer {
                    socket: address.socket.clone(),
                    pid: address.pid,
                    incarnation: address.incarnation,
                    conn,
                    checked: None,
                    regions: HashMap::new(),
                    mappings: HashMap::new(),
                    stream,
                    kernels: None,
                    kernels_unavailable: false,
                    closed: false,
                    unflushed: Vec::new(),
                    last_on_kernels: false,
                }));
                self.peers.len() - 1
            }
        };
        let gpu = Arc::clone(&self.gpu);
        let Some(peer) = self.peers[id].as_mut() else {
            return Err(bad(IpcError::PeerClosed));
        };
        let handles: HashMap<u32, &ExportedRegion> =
            address.regions.iter().map(|r| (r.index, r)).collect();
        let mut regions = HashMap::new();
        for region in &desc.regions {
            let addr = if same_process || peer.pid == std::process::id() {
                region.addr
            } else {
                let exported = handles.get(&region.index).ok_or_else(|| {
                    bad(IpcError::Address(format!(
                        "region {} has no IPC handle",
                        region.index
                    )))
                })?;
                let base = match peer.mappings.entry(exported.handle) {
                    std::collections::hash_map::Entry::Occupied(m) => m.get().base,
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        gpu.bind().map_err(|e| bad(e.into()))?;
                        let handle = sys::CUipcMemHandle {
                            reserved: exported.handle.map(|b| b as std::ffi::c_char),
                        };
                        let mut base = 0;
                        // SAFETY: valid out-pointer; the driver validates the handle (a stale or
                        // foreign one is an error, not undefined behaviour). Closed in
                        // Mapping::drop.
                        check("cuIpcOpenMemHandle", unsafe {
                            sys::cuIpcOpenMemHandle_v2(
                                &raw mut base,
                                handle,
                                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                            )
                        })
                        .map_err(|e| bad(e.into()))?;
                        slot.insert(Mapping {
                            gpu: Arc::clone(&gpu),
                            base,
                        });
                        base
                    }
                };
                base + exported.offset
            };
            regions.insert(region.index, (addr, region.len));
        }
        peer.regions = regions;
        Ok(PeerId(id as u32))
    }

    fn write(
        &mut self,
        peer: PeerId,
        ops: &[CopyOp],
        notice: Option<Notice>,
    ) -> Result<OpId, WriteError> {
        let Some(p) = self.peers.get(peer.0 as usize).and_then(Option::as_ref) else {
            return Err(WriteError::UnknownPeer(peer));
        };
        let bytes = crate::validate::check_ops(
            ops,
            |r| self.regions.get(&r).map(|l| l.region.len()),
            |r| p.regions.get(&r).map(|x| x.1),
        )?;
        if !self.peer_mut(peer).is_some_and(Peer::check_alive) {
            return Ok(self.fail_now(peer, OpKind::Write));
        }
        self.post(peer, OpKind::Write, ops, notice, bytes)
            .map_err(WriteError::Backend)
    }

    fn read(&mut self, peer: PeerId, ops: &[CopyOp]) -> Result<OpId, ReadError> {
        let Some(p) = self.peers.get(peer.0 as usize).and_then(Option::as_ref) else {
            return Err(ReadError::UnknownPeer(peer));
        };
        let bytes = crate::validate::check_ops(
            ops,
            |r| p.regions.get(&r).map(|x| x.1),
            |r| self.regions.get(&r).map(|l| l.region.len()),
        )?;
        if !self.peer_mut(peer).is_some_and(Peer::check_alive) {
            return Ok(self.fail_now(peer, OpKind::Read));
        }
        self.post(peer, OpKind::Read, ops, None, bytes)
            .map_err(ReadError::Backend)
    }

    fn send(&mut self, peer: PeerId, message: &[u8]) -> Result<OpId, SendError> {
        if message.len() > MAX_MESSAGE_LEN {
            return Err(SendError::TooLarge {
                len: message.len(),
                max: MAX_MESSAGE_LEN,
            });
        }
        let op = self.next_op;
        let Some(p) = self.peer_mut(peer) else {
            return Err(SendError::UnknownPeer(peer));
        };
        let mut frame = Vec::with_capacity(5 + message.len());
        frame.push(FRAME_MESSAGE);
        frame.extend_from_slice(&(message.len() as u32).to_le_bytes());
        frame.extend_from_slice(message);
        let event = match p.send_frame(&frame) {
            Ok(()) => Event::SendDone { op: OpId(op), peer },
            Err(e) => Event::Failed {
                op: OpId(op),
                kind: OpKind::Send,
                peer,
                error: OpError::PeerUnreachable { source: boxed(e) },
            },
        };
        self.next_op += 1;
        self.events.push_back(event);
        Ok(OpId(op))
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, PollError> {
        self.flush();
        self.accept_and_read();
        self.finish_completed();
        let n = self.events.len();
        events.extend(self.events.drain(..));
        Ok(n)
    }

    fn wait(&mut self, events: &mut Vec<Event>, timeout: Duration) -> Result<usize, PollError> {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.poll(events)?;
            if n > 0 {
                return Ok(n);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(0);
            }
            let mut fds: Vec<libc::pollfd> = [self.listener.as_raw_fd(), self.wake_rx.as_raw_fd()]
                .into_iter()
                .chain(self.inbound.iter().map(|i| i.conn.as_raw_fd()))
                .map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            // Wake at least every 100 ms while operations are pending, for their timeouts.
            let mut slice = deadline - now;
            if !self.pending.is_empty() {
                slice = slice.min(Duration::from_millis(100));
            }
            let ms = slice.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: `fds` is a live array of `fds.len()` pollfd entries.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if r < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() != ErrorKind::Interrupted {
                    return Err(PollError::Backend(boxed(socket_error("poll")(err))));
                }
            }
        }
    }
}

impl Drop for CudaIpcTransport {
    fn drop(&mut self) {
        // The watcher finishes what it was given (every event completes) and exits; then the
        // peers synchronise their streams and close their mappings.
        drop(self.watch.take());
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join();
        }
        self.peers.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Address {
        Address {
            pid: 4242,
            incarnation: 0xdead_beef,
            device: 1,
            socket: "kvx-cuda-ipc/4242/0/00000000deadbeef".into(),
            regions: vec![
                ExportedRegion {
                    index: 0,
                    handle: [7; 64],
                    offset: 0,
                },
                ExportedRegion {
                    index: 3,
                    handle: [9; 64],
                    offset: 1 << 20,
                },
            ],
        }
    }

    #[test]
    fn address_round_trips_and_rejects_damage() {
        let a = sample();
        let bytes = a.encode();
        assert_eq!(Address::decode(&bytes).unwrap(), a);
        for cut in 0..bytes.len() {
            assert!(Address::decode(&bytes[..cut]).is_err(), "prefix {cut}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(Address::decode(&long).is_err());
        let mut magic = bytes.clone();
        magic[0] = b'X';
        assert!(Address::decode(&magic).is_err());
        let mut version = bytes;
        version[4] = 9;
        assert!(Address::decode(&version).is_err());
    }

    #[test]
    fn frames_parse_across_partial_reads_and_reject_garbage() {
        let mut events = VecDeque::new();
        let mut stream = vec![FRAME_NOTICE];
        stream.extend_from_slice(&42u64.to_le_bytes());
        stream.push(FRAME_MESSAGE);
        stream.extend_from_slice(&3u32.to_le_bytes());
        stream.extend_from_slice(b"abc");
        let mut buf = Vec::new();
        for byte in &stream {
            buf.push(*byte);
            assert!(!parse_frames(&mut buf, &mut events));
        }
        assert!(buf.is_empty());
        assert!(matches!(events[0], Event::Notice(Notice(42))));
        assert!(matches!(&events[1], Event::Message(m) if m == b"abc"));
        let mut garbage = vec![0x77, 1, 2];
        assert!(parse_frames(&mut garbage, &mut events));
        let mut huge = vec![FRAME_MESSAGE];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_frames(&mut huge, &mut events));
    }

    #[test]
    fn opening_without_a_driver_is_a_clear_error() {
        match CudaIpcTransport::open(CudaIpcConfig::new(0)) {
            Ok(t) => assert_eq!(t.gpu().ordinal(), 0),
            Err(IpcError::Cuda(CudaError::DriverMissing | CudaError::NoDevice)) => {
                eprintln!("SKIPPED (GPU part): no CUDA driver or device on this machine");
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
}
