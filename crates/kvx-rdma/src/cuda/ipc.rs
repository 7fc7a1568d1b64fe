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
//! - **Completion**: at the next poll or wait, one blocking-sync event is recorded behind a
//!   peer's operations posted since; a watcher thread sleeps on it and only then sends their
//!   notices, so the consumer sees a notice after every byte landed.
//! - **Notices, messages, waiting**: the same-host control plane (`crate::local`): a Unix stream
//!   socket per endpoint in the abstract namespace, and `wait` blocking in `poll(2)`; no thread
//!   spins.
//!
//! A peer that died is found when its socket closes: operations towards it fail with
//! [`OpError::PeerUnreachable`] and no notice is sent.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::sys;
use kvx_core::{MemoryKind, RegionDesc};
use kvx_layout::CopyOp;

use super::driver::{check, CudaError, Gpu, Stream};
use super::kernels::LayoutKernels;
use crate::desc::EndpointDesc;
use crate::error::{
    AddressError, BackendError, ConnectError, DeregisterError, OpError, PollError, ReadError,
    RegisterError, SendError, WriteError,
};
use crate::local::{
    self, peer_gone, Completions, Control, Identity, Ledger, Link, NoticeSender, Reader, SameHost,
};
use crate::region::LocalRegion;
use crate::transport::{Capabilities, Event, Notice, OpId, OpKind, PeerId, Transport, Waker};

/// Backend name in endpoint descriptions.
pub const BACKEND: &str = "cuda-ipc";
/// Longest control message.
pub const MAX_MESSAGE_LEN: usize = local::MAX_MESSAGE_LEN;
const ADDRESS_MAGIC: [u8; 4] = *b"KVXC";
const ADDRESS_VERSION: u8 = 1;
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
    /// Defaults for device `device`: the copy method [`CopyMethod::Auto`], operations time out
    /// after 30 s.
    #[must_use]
    pub fn new(device: u32) -> Self {
        Self {
            device,
            copy: CopyMethod::Auto,
            op_timeout: Duration::from_secs(30),
        }
    }
}

/// A copy-method name that is not `auto`, `engine` or `kernel`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown CUDA IPC copy method `{0}` (auto, engine, kernel)")]
pub struct UnknownCopyMethod(pub String);

impl std::str::FromStr for CopyMethod {
    type Err = UnknownCopyMethod;

    /// `auto`, `engine` (the copy engines) or `kernel` (the batched-copy kernel).
    fn from_str(s: &str) -> Result<Self, UnknownCopyMethod> {
        match s {
            "auto" => Ok(Self::Auto),
            "engine" => Ok(Self::CopyEngine),
            "kernel" => Ok(Self::Kernel),
            other => Err(UnknownCopyMethod(other.to_owned())),
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
    Address(#[from] AddressError),
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

/// The backend-specific address: who the endpoint is, where its socket is, its device, and the
/// IPC handles of its regions.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Address {
    who: Identity,
    device: u32,
    regions: Vec<ExportedRegion>,
}

impl Address {
    fn encode(&self) -> Vec<u8> {
        let mut out = local::encode_head(ADDRESS_MAGIC, ADDRESS_VERSION, &self.who);
        out.extend_from_slice(&self.device.to_le_bytes());
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            out.extend_from_slice(&r.index.to_le_bytes());
            out.extend_from_slice(&r.handle);
            out.extend_from_slice(&r.offset.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8]) -> Result<Self, IpcError> {
        let parse = || -> Result<Self, AddressError> {
            let mut reader = Reader::open(bytes, ADDRESS_MAGIC, ADDRESS_VERSION)?;
            let who = Identity::decode(&mut reader)?;
            let device = reader.u32("device")?;
            let count = reader.u32("region count")? as usize;
            if count > crate::desc::MAX_REGIONS || count * 76 > reader.remaining() {
                return Err(AddressError::RegionCount(count));
            }
            let mut regions = Vec::with_capacity(count);
            for _ in 0..count {
                let index = reader.u32("region index")?;
                let mut handle = [0; 64];
                handle.copy_from_slice(reader.take(64, "handle")?);
                let offset = reader.u64("region offset")?;
                regions.push(ExportedRegion {
                    index,
                    handle,
                    offset,
                });
            }
            reader.finish()?;
            Ok(Self {
                who,
                device,
                regions,
            })
        };
        parse().map_err(IpcError::Address)
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
    notices: NoticeSender,
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
    link: Link,
    /// Region index → (address in this process, length).
    regions: HashMap<u32, (u64, u64)>,
    mappings: HashMap<[u8; 64], Mapping>,
    stream: Stream,
    kernels: Option<LayoutKernels>,
    /// Kernels could not be compiled here (no NVRTC): the copy engines are used.
    kernels_unavailable: bool,
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

struct Local {
    region: LocalRegion,
    handle: [u8; 64],
    offset: u64,
}

/// The CUDA IPC endpoint. See the [module documentation](self).
pub struct CudaIpcTransport {
    gpu: Arc<Gpu>,
    config: CudaIpcConfig,
    control: Control,
    regions: BTreeMap<u32, Local>,
    peers: Vec<Option<Peer>>,
    ledger: Ledger,
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
        let control =
            Control::open("cuda-ipc").map_err(socket_error("opening the control socket"))?;
        let completions = control.completions();
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
            control,
            regions: BTreeMap::new(),
            peers: Vec::new(),
            ledger: Ledger::default(),
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
            who: self.control.identity().clone(),
            device: self.gpu.ordinal(),
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
        let op = self.ledger.next_id();
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
        Ok(self.ledger.start(peer_id, kind, bytes, used))
    }

    /// Records one completion event behind each peer's operations posted since the last flush
    /// and hands them to the watcher; operations that cannot be handed over fail now.
    fn flush(&mut self) {
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

/// A region lookup: index → (address in this process, length).
type RegionFn<'a> = &'a dyn Fn(u32) -> Option<(u64, u64)>;

/// Note for a fallback that changes nothing the caller must act on.
fn note_fallback(error: &CudaError) {
    tracing::debug!(%error, "kvx cuda-ipc: batched-copy kernel unavailable, using the copy engines");
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

/// Queues `ops` (already checked against `src` and `dst` by the caller) on `stream` as
/// copy-engine copies: one `cuMemcpyAsync` per contiguous operation,
/// one `cuMemcpy2DAsync` per strided one (per piece where the pitch is out of the 2-D limits).
fn post_copy_engine(
    stream: &Stream,
    ops: &[CopyOp],
    src: &dyn Fn(u32) -> Option<(u64, u64)>,
    dst: &dyn Fn(u32) -> Option<(u64, u64)>,
    max_pitch: u64,
) -> Result<(), CudaError> {
    // `write`/`read` checked every operation against these same regions before posting.
    stream.gpu().bind()?;
    for op in ops {
        let (src_base, _) = src(op.src_region).unwrap_or_default();
        let (dst_base, _) = dst(op.dst_region).unwrap_or_default();
        let contiguous = op.count == 1 || (op.src_stride == op.len && op.dst_stride == op.len);
        if contiguous {
            // SAFETY: both ranges lie inside live regions (checked by `write`/`read`); the caller keeps
            // them alive until the stream has run.
            // Device to device (both sides are device memory: local, or a peer's mapped through
            // IPC), which spares the driver the unified-address lookup of `cuMemcpyAsync`.
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(
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
            // SAFETY: every row lies inside live regions (checked by `write`/`read`); the descriptor is
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
            polls_to_wait: false,
            peer_rma_unassisted: true,
            peer_rma_occasional_reads: false,
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
        self.ledger.deregister(&mut self.regions, index)
    }

    fn local_desc(&self) -> EndpointDesc {
        EndpointDesc {
            backend: BACKEND.to_owned(),
            provider: String::new(),
            address: self.address().encode(),
            notice_slot: None,
            board: None,
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
        let same_process = address.who.is_this_process();
        let existing = self.peers.iter().position(|p| {
            p.as_ref().is_some_and(|p| {
                p.socket == address.who.socket && p.incarnation == address.who.incarnation
            })
        });
        let id = match existing {
            Some(i) => i,
            None => {
                let link =
                    Link::connect(&address.who.socket).map_err(|e| ConnectError::Unreachable {
                        source: boxed(socket_error("connecting to the peer")(e)),
                    })?;
                let stream = Stream::new(&self.gpu).map_err(|e| bad(e.into()))?;
                self.peers.push(Some(Peer {
                    socket: address.who.socket.clone(),
                    pid: address.who.pid,
                    incarnation: address.who.incarnation,
                    link,
                    regions: HashMap::new(),
                    mappings: HashMap::new(),
                    stream,
                    kernels: None,
                    kernels_unavailable: false,
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
                    bad(IpcError::Address(AddressError::MissingRegion(region.index)))
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

    fn disconnect(&mut self, peer: PeerId) {
        // Its posted copies get their completion events first (with handles on its socket for
        // their notices); dropping it then waits on its streams for them to end before its
        // mappings of the peer's memory close (`Peer::drop`). Its slot stays empty: ids are
        // not reused.
        self.flush();
        if let Some(slot) = self.peers.get_mut(peer.0 as usize) {
            drop(slot.take());
        }
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
        if !self.peer_mut(peer).is_some_and(|p| p.link.alive()) {
            return Ok(self.ledger.done_now(peer, OpKind::Write, Err(peer_gone())));
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
        if !self.peer_mut(peer).is_some_and(|p| p.link.alive()) {
            return Ok(self.ledger.done_now(peer, OpKind::Read, Err(peer_gone())));
        }
        self.post(peer, OpKind::Read, ops, None, bytes)
            .map_err(ReadError::Backend)
    }

    fn send(&mut self, peer: PeerId, message: &[u8]) -> Result<OpId, SendError> {
        let link = self
            .peers
            .get_mut(peer.0 as usize)
            .and_then(Option::as_mut)
            .map(|p| &mut p.link);
        local::send(link, &mut self.ledger, peer, message)
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, PollError> {
        self.poll_now(events)
    }

    fn wait(&mut self, events: &mut Vec<Event>, timeout: Duration) -> Result<usize, PollError> {
        local::wait(self, events, timeout)
    }

    fn waker(&self) -> Option<Arc<dyn Waker>> {
        Some(self.control.completions())
    }
}

impl SameHost for CudaIpcTransport {
    fn parts(&mut self) -> (&mut Control, &mut Ledger) {
        (&mut self.control, &mut self.ledger)
    }

    fn op_timeout(&self) -> Duration {
        self.config.op_timeout
    }

    fn before_poll(&mut self) {
        self.flush();
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
            who: Identity {
                pid: 4242,
                incarnation: 0xdead_beef,
                socket: "kvx-cuda-ipc/4242/0/00000000deadbeef".into(),
            },
            device: 1,
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
