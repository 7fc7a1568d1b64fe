//! The libfabric backend: one-sided RMA between engine instances over the system libfabric
//! (`shm` within a host, `tcp;ofi_rxm` anywhere, `efa` on AWS), through the own bindgen crate
//! `libfabric-sys` and the safe handles of [`fi`].
//!
//! # How a write and its notice travel
//!
//! A [`Transport::write`] checks every piece of every operation against the local registrations
//! and the peer's region table, resolves each operation to addresses and keys, and queues it.
//! Pieces are posted with `fi_writemsg` as long as the provider accepts them; on `-FI_EAGAIN` the
//! transport reads its completion queue (which drives progress on manual-progress providers such as
//! `tcp;ofi_rxm` and `shm`) and retries, and whatever is still queued is posted from the next
//! [`Transport::poll`] or [`Transport::wait`].
//!
//! **Ordering argument.** The notice is a tiny RMA write into the peer's notice slot that carries
//! the notice value as remote CQ data (`FI_REMOTE_CQ_DATA`), so the peer sees it as a completion on
//! its own queue. It is posted only after the *local completions of all data writes of the same
//! operation* have been read, and those completions have delivery-complete semantics: the endpoint
//! is opened with `FI_DELIVERY_COMPLETE` as its default transmit completion where the provider
//! offers it, and then a completion means the data is visible in the target memory. Where a
//! provider does not offer it (the transport falls back and says so in
//! [`LibfabricTransport::delivery_complete`]), the notice is still posted after the data
//! completions, and the argument rests on the provider's ordering of RMA writes to the same peer
//! (`FI_ORDER_RMA_WAW`, which `tcp;ofi_rxm` and `shm` both report). A write that fails delivers no
//! notice.
//!
//! # Memory-registration modes
//!
//! The transport accepts whatever of `FI_MR_LOCAL`, `FI_MR_VIRT_ADDR`, `FI_MR_ALLOCATED`,
//! `FI_MR_PROV_KEY` and `FI_MR_ENDPOINT` the provider asks for: with `FI_MR_VIRT_ADDR` (`shm`,
//! `efa`) a region's remote address is its virtual address, otherwise (`tcp;ofi_rxm`) it is 0 and
//! operations address by offset; with `FI_MR_PROV_KEY` the key is the provider's, otherwise the
//! transport chooses unique keys itself; with `FI_MR_ENDPOINT` registrations are bound to the
//! endpoint and enabled; local descriptors are always passed.
//!
//! # Waiting
//!
//! The completion queue is opened with a wait object, and [`Transport::wait`] blocks in
//! `fi_cq_sread`; nothing spins in the background.

pub mod fi;

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{MemoryKind, RegionDesc};
use kvx_layout::CopyOp;
use libfabric_sys as sys;

use crate::desc::{EndpointDesc, NoticeSlot};
use crate::error::{
    ConnectError, DeregisterError, OpError, PollError, ReadError, RegisterError, SendError,
    WriteError,
};
use crate::region::{HostBuffer, LocalRegion};
use crate::transport::{Capabilities, Event, Notice, OpId, OpKind, PeerId, Transport};
use crate::validate::check_ops;
use fi::{CqRead, FabricError, FiErrno};

/// Backend name of libfabric endpoints.
pub const BACKEND: &str = "libfabric";
/// The `tcp;ofi_rxm` provider: RDM over TCP, anywhere.
pub const PROVIDER_TCP: &str = "tcp;ofi_rxm";
/// The `shm` provider: within one host.
pub const PROVIDER_SHM: &str = "shm";
/// The `efa` provider: AWS Elastic Fabric Adapter.
pub const PROVIDER_EFA: &str = "efa";

/// Bytes of one control-message slot (the longest message, unless the provider allows less).
const MESSAGE_SLOT: usize = 4096;
/// Receive buffers kept posted for control messages (and notices on `FI_RX_CQ_DATA` providers).
const RECV_SLOTS: usize = 64;
/// Sends in flight at once.
const SEND_SLOTS: usize = 64;
/// Bytes of the notice slot (the target of notice writes) and of the notice source.
const NOTICE_BYTES: usize = 64;
/// Largest single RMA transfer posted, whatever the provider allows.
const MAX_CHUNK: usize = 1 << 30;
/// Completions read per call.
const CQ_BATCH: usize = 64;
/// First key the transport chooses itself (providers without `FI_MR_PROV_KEY`).
const FIRST_KEY: u64 = 0x4b56_0000;
/// Retries of a post that keeps returning `-FI_EAGAIN` (each after reading the completion queue,
/// blocking up to a millisecond when nothing completed) before it is reported as failed.
const MAX_AGAIN: usize = 10_000;
/// Shortest sleep between completion-queue reads of a waiting thread on a provider without a
/// wait object.
const MIN_IDLE_SLEEP: Duration = Duration::from_micros(50);
/// A completion-queue read that takes longer than this made progress on something.
const BUSY_READ: Duration = Duration::from_micros(20);
/// Longest such sleep.
const MAX_IDLE_SLEEP: Duration = Duration::from_micros(200);

/// How to open a libfabric endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LibfabricConfig {
    /// Provider name, as `fi_info -p` spells it (`shm`, `tcp;ofi_rxm`, `efa`).
    pub provider: String,
    /// Domain (NIC or interface) to open, e.g. `lo` for TCP over loopback; `None`: the first the
    /// provider offers.
    pub domain: Option<String>,
    /// How long an operation may stay in flight before it is reported as
    /// [`OpError::TimedOut`].
    pub op_timeout: Duration,
    /// Completion-queue entries.
    pub cq_size: usize,
}

impl LibfabricConfig {
    /// A configuration for `provider` with default settings.
    #[must_use]
    pub fn new(provider: impl Into<String>) -> Self {
        Self {
            provider: provider.into(),
            domain: None,
            op_timeout: Duration::from_secs(30),
            cq_size: 4096,
        }
    }

    /// The `shm` provider.
    #[must_use]
    pub fn shm() -> Self {
        Self::new(PROVIDER_SHM)
    }

    /// The `tcp;ofi_rxm` provider on the given domain (interface), e.g. `Some("lo")`.
    #[must_use]
    pub fn tcp(domain: Option<&str>) -> Self {
        Self {
            domain: domain.map(str::to_owned),
            ..Self::new(PROVIDER_TCP)
        }
    }

    /// The best provider for traffic between hosts that this machine has: `efa` where present,
    /// otherwise `tcp;ofi_rxm`.
    #[must_use]
    pub fn auto() -> Self {
        let efa = fi::Info::query(&fi::Query {
            provider: PROVIDER_EFA,
            domain: None,
            delivery_complete: false,
        });
        if efa.is_ok() {
            Self::new(PROVIDER_EFA)
        } else {
            Self::new(PROVIDER_TCP)
        }
    }
}

/// What an operation context is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    /// A data piece of operation `op`.
    Data { op: u64 },
    /// The notice write of operation `op`.
    Notice { op: u64 },
    /// A posted receive into message slot `slot`.
    Recv { slot: usize },
    /// Send `op` from send slot `slot`.
    Send { op: u64, slot: usize },
}

/// An operation context handed to libfabric. `FI_CONTEXT`/`FI_CONTEXT2` providers use the leading
/// `fi_context2` as scratch space, so it must come first and stay at a fixed address until the
/// completion is read (hence the boxes).
#[repr(C)]
struct OpContext {
    scratch: sys::fi_context2,
}

/// Contexts of the operations in flight, keyed by their address (the value libfabric hands back).
#[derive(Default)]
struct ContextPool {
    live: HashMap<usize, (Box<OpContext>, Use)>,
    // Boxed: a context keeps its address while it moves between `spare` and `live`.
    #[allow(clippy::vec_box)]
    spare: Vec<Box<OpContext>>,
}

impl ContextPool {
    fn take(&mut self, what: Use) -> *mut c_void {
        let mut ctx = self.spare.pop().unwrap_or_else(|| {
            Box::new(OpContext {
                scratch: sys::fi_context2::default(),
            })
        });
        let ptr: *mut OpContext = &mut *ctx;
        self.live.insert(ptr as usize, (ctx, what));
        ptr.cast::<c_void>()
    }

    fn give_back(&mut self, ptr: *mut c_void) -> Option<Use> {
        let (ctx, what) = self.live.remove(&(ptr as usize))?;
        self.spare.push(ctx);
        Some(what)
    }

    fn in_flight(&self) -> usize {
        self.live.len()
    }
}

/// A registered region.
struct Registration {
    // Declared before `region`: the registration closes before the memory may be released.
    mr: fi::MemoryRegion,
    region: LocalRegion,
    remote: RegionDesc,
    /// Operations in flight that use the region.
    users: usize,
}

/// The endpoint's own buffer: the notice slot, the notice source, receive and send slots.
struct Scratch {
    mr: fi::MemoryRegion,
    buffer: Arc<HostBuffer>,
    remote_base: u64,
    free_sends: Vec<usize>,
}

impl Scratch {
    const NOTICE_SLOT: usize = 0;
    const NOTICE_SOURCE: usize = NOTICE_BYTES;
    const RECV_BASE: usize = 2 * NOTICE_BYTES;
    const SEND_BASE: usize = Self::RECV_BASE + RECV_SLOTS * MESSAGE_SLOT;
    const LEN: usize = Self::SEND_BASE + SEND_SLOTS * MESSAGE_SLOT;

    fn ptr(&self, offset: usize) -> *mut u8 {
        // `offset` is one of the layout's constants, always inside the buffer.
        self.buffer.as_ptr().wrapping_add(offset)
    }
}

struct Peer {
    addr: sys::fi_addr_t,
    desc: EndpointDesc,
}

/// One resolved copy operation: where its pieces start on both sides.
#[derive(Clone, Copy, Debug)]
struct Segment {
    local: usize,
    desc: *mut c_void,
    remote: u64,
    key: u64,
    len: u64,
    count: u64,
    local_stride: u64,
    remote_stride: u64,
}

#[derive(Debug)]
struct Pending {
    kind: OpKind,
    peer: PeerId,
    bytes: u64,
    segments: Vec<Segment>,
    /// Next piece to post: segment, piece, byte within the piece.
    cursor: (usize, u64, u64),
    in_flight: usize,
    notice: Option<u64>,
    notice_posted: bool,
    failed: Option<OpError>,
    /// Reported as timed out; completions still owed by the provider are drained silently.
    abandoned: bool,
    deadline: Instant,
    local_regions: Vec<u32>,
    /// A send not posted yet: its send slot and length.
    send: Option<(usize, usize)>,
}

impl Pending {
    fn data_left(&self) -> bool {
        self.failed.is_none() && (self.cursor.0 < self.segments.len() || self.send.is_some())
    }

    fn wants_post(&self) -> bool {
        self.data_left()
            || (self.failed.is_none()
                && self.in_flight == 0
                && self.notice.is_some()
                && !self.notice_posted)
    }
}

/// A libfabric endpoint implementing [`Transport`].
pub struct LibfabricTransport {
    // Field order is drop order. Registrations and the scratch buffer close before the contexts
    // are freed, and the endpoint (kept open by `ep` and by any `FI_MR_ENDPOINT` registration)
    // closes with the last of them, so no context or buffer is freed while libfabric may still
    // use it.
    ep: Arc<fi::Endpoint>,
    regions: HashMap<u32, Registration>,
    scratch: Scratch,
    contexts: ContextPool,
    domain: Arc<fi::Domain>,
    provider: String,
    domain_name: String,
    address: Vec<u8>,
    virt_addr: bool,
    prov_key: bool,
    endpoint_mr: bool,
    delivery_complete: bool,
    notice_bits: u32,
    max_message: usize,
    max_chunk: usize,
    tx_limit: usize,
    op_timeout: Duration,
    next_key: u64,
    next_op: u64,
    peers: Vec<Peer>,
    pending: HashMap<u64, Pending>,
    post_queue: VecDeque<u64>,
    events: VecDeque<Event>,
    entries: Vec<sys::fi_cq_data_entry>,
    /// A failure of the endpoint itself met outside `poll`/`wait` (while posting, or reposting a
    /// receive); the next `poll` or `wait` reports it.
    broken: Option<FabricError>,
    /// Current sleep between completion-queue reads while waiting without a wait object.
    idle_sleep: Duration,
}

// SAFETY: every libfabric object of the domain is owned by this value and used only through
// `&mut self` (FI_THREAD_DOMAIN: the application serialises access); the raw pointers inside
// (`Segment::desc`, contexts) refer to objects owned by this value.
unsafe impl Send for LibfabricTransport {}

/// Opening a libfabric endpoint failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// A libfabric call failed.
    #[error("opening a {provider} endpoint failed")]
    Fabric {
        /// Provider asked for.
        provider: String,
        /// The failing call.
        #[source]
        source: FabricError,
    },
    /// The internal buffer could not be allocated.
    #[error("allocating the endpoint's message buffers failed")]
    Buffer(#[source] crate::region::BufferError),
    /// The provider carries less remote CQ data than a notice needs.
    #[error("provider {provider} carries no remote CQ data")]
    NoCqData {
        /// Provider.
        provider: String,
    },
}

impl std::fmt::Debug for LibfabricTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LibfabricTransport")
            .field("provider", &self.provider)
            .field("domain", &self.domain_name)
            .field("virt_addr", &self.virt_addr)
            .field("prov_key", &self.prov_key)
            .field("delivery_complete", &self.delivery_complete)
            .field("regions", &self.regions.len())
            .field("peers", &self.peers.len())
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

fn backend(e: impl std::error::Error + Send + Sync + 'static) -> crate::error::BackendError {
    Box::new(e)
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
fn op_error(error: FabricError) -> OpError {
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
    /// Opens an endpoint: provider description, fabric, domain, completion queue (with a wait
    /// object), address vector, endpoint; registers the endpoint's own message buffers and posts
    /// its receives.
    ///
    /// # Errors
    /// [`OpenError`] naming the failing call.
    pub fn open(config: &LibfabricConfig) -> Result<Self, OpenError> {
        let fabric_err = |source| OpenError::Fabric {
            provider: config.provider.clone(),
            source,
        };
        let query = |delivery_complete| {
            fi::Info::query(&fi::Query {
                provider: &config.provider,
                domain: config.domain.as_deref(),
                delivery_complete,
            })
        };
        let info = match query(true) {
            Ok(info) => info,
            Err(_) => query(false).map_err(fabric_err)?,
        };
        let provider = info.provider();
        let domain_name = info.domain();
        let mr_mode = info.mr_mode();
        let cq_data = info.cq_data_size();
        if cq_data == 0 {
            return Err(OpenError::NoCqData { provider });
        }
        let delivery_complete = info.delivery_complete();
        let max_msg = info.max_msg_size();
        let tx_size = info.tx_size();

        let fabric = fi::Fabric::open(info).map_err(fabric_err)?;
        let domain = fi::Domain::open(&fabric).map_err(fabric_err)?;
        let cq = fi::CompletionQueue::open(&domain, config.cq_size.max(64)).map_err(fabric_err)?;
        let av = fi::AddressVector::open(&domain).map_err(fabric_err)?;
        let ep = fi::Endpoint::open(&domain, &cq, &av).map_err(fabric_err)?;
        let address = ep.name().map_err(fabric_err)?;

        let virt_addr = mr_mode & sys::FI_MR_VIRT_ADDR != 0;
        let prov_key = mr_mode & sys::FI_MR_PROV_KEY != 0;
        let endpoint_mr = mr_mode & sys::FI_MR_ENDPOINT != 0;

        let buffer = Arc::new(HostBuffer::new(Scratch::LEN).map_err(OpenError::Buffer)?);
        // SAFETY: the buffer is kept alive by `Scratch::buffer`, which is dropped after the
        // registration (`mr` is declared first).
        let mr = unsafe {
            fi::MemoryRegion::register(
                &domain,
                endpoint_mr.then_some(&ep),
                buffer.as_ptr() as usize,
                buffer.len(),
                sys::FI_SEND
                    | sys::FI_RECV
                    | sys::FI_READ
                    | sys::FI_WRITE
                    | sys::FI_REMOTE_READ
                    | sys::FI_REMOTE_WRITE,
                FIRST_KEY,
            )
        }
        .map_err(fabric_err)?;
        let remote_base = if virt_addr { buffer.as_ptr() as u64 } else { 0 };
        let scratch = Scratch {
            mr,
            buffer,
            remote_base,
            free_sends: (0..SEND_SLOTS).rev().collect(),
        };
        let mut transport = Self {
            ep,
            regions: HashMap::new(),
            scratch,
            contexts: ContextPool::default(),
            domain,
            provider,
            domain_name,
            address,
            virt_addr,
            prov_key,
            endpoint_mr,
            delivery_complete,
            notice_bits: u32::try_from(cq_data.min(8) * 8).unwrap_or(64),
            max_message: MESSAGE_SLOT.min(max_msg),
            max_chunk: MAX_CHUNK.min(max_msg).max(1),
            tx_limit: tx_size.clamp(16, 1024),
            op_timeout: config.op_timeout,
            next_key: FIRST_KEY + 1,
            next_op: 0,
            peers: Vec::new(),
            pending: HashMap::new(),
            post_queue: VecDeque::new(),
            events: VecDeque::new(),
            entries: vec![sys::fi_cq_data_entry::default(); CQ_BATCH],
            broken: None,
            idle_sleep: MIN_IDLE_SLEEP,
        };
        for slot in 0..RECV_SLOTS {
            transport.post_recv(slot).map_err(fabric_err)?;
        }
        Ok(transport)
    }

    /// Provider in use.
    #[must_use]
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// Domain (NIC or interface) in use.
    #[must_use]
    pub fn domain_name(&self) -> &str {
        &self.domain_name
    }

    /// Whether transmit completions have delivery-complete semantics (see the module
    /// documentation's ordering argument).
    #[must_use]
    pub fn delivery_complete(&self) -> bool {
        self.delivery_complete
    }

    /// Whether remote addresses are virtual addresses (`FI_MR_VIRT_ADDR`) rather than offsets.
    #[must_use]
    pub fn uses_virtual_addresses(&self) -> bool {
        self.virt_addr
    }

    /// Whether the provider chooses registration keys (`FI_MR_PROV_KEY`).
    #[must_use]
    pub fn uses_provider_keys(&self) -> bool {
        self.prov_key
    }

    /// Operations (data pieces, notices, sends, receives) in flight at the provider.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.contexts.in_flight()
    }

    fn post_recv(&mut self, slot: usize) -> Result<(), FabricError> {
        let ctx = self.contexts.take(Use::Recv { slot });
        let ptr = self.scratch.ptr(Scratch::RECV_BASE + slot * MESSAGE_SLOT);
        let mut tries = 0;
        loop {
            // SAFETY: the receive slot lies inside the registered scratch buffer, which outlives
            // the endpoint's operations (drop order); the context stays in the pool until its
            // completion is read.
            let result = unsafe {
                self.ep
                    .post_msg(ptr, self.max_message, self.scratch.mr.desc(), None, ctx)
            };
            match result {
                Ok(()) => return Ok(()),
                Err(e) if e.is_again() && tries < MAX_AGAIN => {
                    // Receives are posted at start-up and after each received message; the
                    // receive queue has room again once the provider made progress.
                    tries += 1;
                    if self.drain(None)? == 0 {
                        self.drain(Some(1))?;
                    }
                }
                Err(e) => {
                    self.contexts.give_back(ctx);
                    return Err(FabricError::PostRecv(e));
                }
            }
        }
    }

    fn new_op(&mut self) -> u64 {
        self.next_op += 1;
        self.next_op
    }

    /// Resolves `ops` into segments; `write` says whether local is the source side.
    fn resolve(&self, peer: &Peer, ops: &[CopyOp], write: bool) -> (Vec<Segment>, Vec<u32>) {
        let mut segments = Vec::with_capacity(ops.len());
        let mut locals = Vec::new();
        for op in ops {
            let (
                local_region,
                local_offset,
                local_stride,
                remote_region,
                remote_offset,
                remote_stride,
            ) = if write {
                (
                    op.src_region,
                    op.src_offset,
                    op.src_stride,
                    op.dst_region,
                    op.dst_offset,
                    op.dst_stride,
                )
            } else {
                (
                    op.dst_region,
                    op.dst_offset,
                    op.dst_stride,
                    op.src_region,
                    op.src_offset,
                    op.src_stride,
                )
            };
            // Both lookups succeed: `check_ops` accepted the operations against the same tables.
            let (Some(local), Some(remote)) = (
                self.regions.get(&local_region),
                peer.desc.region(remote_region),
            ) else {
                continue;
            };
            segments.push(Segment {
                local: local.region.addr() + local_offset as usize,
                desc: local.mr.desc(),
                remote: remote.addr + remote_offset,
                key: remote.key,
                len: op.len,
                count: op.count,
                local_stride,
                remote_stride,
            });
            if !locals.contains(&local_region) {
                locals.push(local_region);
            }
        }
        (segments, locals)
    }

    fn submit(
        &mut self,
        kind: OpKind,
        peer: PeerId,
        bytes: u64,
        segments: Vec<Segment>,
        locals: Vec<u32>,
        notice: Option<u64>,
    ) -> u64 {
        let op = self.new_op();
        for index in &locals {
            if let Some(r) = self.regions.get_mut(index) {
                r.users += 1;
            }
        }
        self.pending.insert(
            op,
            Pending {
                kind,
                peer,
                bytes,
                segments,
                cursor: (0, 0, 0),
                in_flight: 0,
                notice,
                notice_posted: false,
                failed: None,
                abandoned: false,
                deadline: Instant::now() + self.op_timeout,
                local_regions: locals,
                send: None,
            },
        );
        self.post_queue.push_back(op);
        // The operation is accepted: a failure of the endpoint while posting it is reported by
        // the next poll or wait.
        if let Err(error) = self.pump() {
            self.broken.get_or_insert(error);
        }
        op
    }

    /// Posts queued work until the queue is empty or the provider pushes back; on `-FI_EAGAIN`
    /// reads the completion queue (progress) and tries again while that frees anything.
    fn pump(&mut self) -> Result<(), FabricError> {
        loop {
            let blocked = self.post_queued();
            if !blocked {
                return Ok(());
            }
            if self.drain(None)? == 0 {
                // Nothing completed: leave the rest for the next poll or wait.
                return Ok(());
            }
        }
    }

    /// Posts from the queue; returns whether the provider (or the in-flight limit) pushed back.
    fn post_queued(&mut self) -> bool {
        while let Some(&op) = self.post_queue.front() {
            let Some(p) = self.pending.get(&op) else {
                self.post_queue.pop_front();
                continue;
            };
            if !p.wants_post() {
                self.post_queue.pop_front();
                continue;
            }
            if self.contexts.in_flight() >= self.tx_limit + RECV_SLOTS {
                return true;
            }
            match self.post_one(op) {
                Ok(()) => {}
                Err(e) if e.is_again() => return true,
                Err(e) => {
                    let kind = self.pending.get(&op).map(|p| p.kind);
                    let error = match kind {
                        Some(OpKind::Read) => FabricError::PostRead(e),
                        Some(OpKind::Send) => FabricError::PostSend(e),
                        _ => FabricError::PostWrite(e),
                    };
                    self.fail(op, op_error(error));
                }
            }
        }
        false
    }

    /// Posts the next piece (or the notice) of `op`.
    fn post_one(&mut self, op: u64) -> Result<(), FiErrno> {
        let Some(p) = self.pending.get(&op) else {
            return Ok(());
        };
        let peer_addr = self.peers[p.peer.0 as usize].addr;
        if !p.data_left() {
            // The notice: every data completion has been read (`wants_post`).
            let Some(slot) = self.peers[p.peer.0 as usize].desc.notice_slot else {
                return Ok(());
            };
            let data = p.notice.unwrap_or(0);
            let ctx = self.contexts.take(Use::Notice { op });
            // SAFETY: the notice source lies inside the registered scratch buffer, which outlives
            // every operation; the context stays in the pool until its completion is read.
            let result = unsafe {
                self.ep.post_write(
                    self.scratch.ptr(Scratch::NOTICE_SOURCE),
                    8,
                    self.scratch.mr.desc(),
                    peer_addr,
                    slot.addr,
                    slot.key,
                    Some(data),
                    ctx,
                )
            };
            return match result {
                Ok(()) => {
                    if let Some(p) = self.pending.get_mut(&op) {
                        p.notice_posted = true;
                    }
                    Ok(())
                }
                Err(e) => {
                    self.contexts.give_back(ctx);
                    Err(e)
                }
            };
        }
        if let Some((slot, len)) = p.send {
            let ctx = self.contexts.take(Use::Send { op, slot });
            // SAFETY: the send slot lies inside the registered scratch buffer and is not reused
            // until its completion is read (free list); the context stays in the pool until then.
            let result = unsafe {
                self.ep.post_msg(
                    self.scratch.ptr(Scratch::SEND_BASE + slot * MESSAGE_SLOT),
                    len,
                    self.scratch.mr.desc(),
                    Some(peer_addr),
                    ctx,
                )
            };
            if let Err(e) = result {
                self.contexts.give_back(ctx);
                return Err(e);
            }
            if let Some(p) = self.pending.get_mut(&op) {
                p.send = None;
                p.in_flight += 1;
            }
            return Ok(());
        }
        let (seg_index, piece, within) = p.cursor;
        let seg = p.segments[seg_index];
        let kind = p.kind;
        let chunk = (seg.len - within).min(self.max_chunk as u64);
        let local = seg.local + (piece * seg.local_stride + within) as usize;
        let remote = seg.remote + piece * seg.remote_stride + within;
        let ctx = self.contexts.take(Use::Data { op });
        // SAFETY: the range was checked against the local registration, which cannot be
        // deregistered while the operation is pending (`users`); the context stays in the pool
        // until its completion is read.
        let result = unsafe {
            if kind == OpKind::Read {
                self.ep.post_read(
                    local as *mut u8,
                    chunk as usize,
                    seg.desc,
                    peer_addr,
                    remote,
                    seg.key,
                    ctx,
                )
            } else {
                self.ep.post_write(
                    local as *const u8,
                    chunk as usize,
                    seg.desc,
                    peer_addr,
                    remote,
                    seg.key,
                    None,
                    ctx,
                )
            }
        };
        if let Err(e) = result {
            self.contexts.give_back(ctx);
            return Err(e);
        }
        if let Some(p) = self.pending.get_mut(&op) {
            p.in_flight += 1;
            let mut next = (seg_index, piece, within + chunk);
            if next.2 >= seg.len {
                next = (seg_index, piece + 1, 0);
                if next.1 >= seg.count {
                    next = (seg_index + 1, 0, 0);
                }
            }
            p.cursor = next;
        }
        Ok(())
    }

    /// Marks `op` failed (the first error wins); it is reported once nothing is in flight.
    fn fail(&mut self, op: u64, error: OpError) {
        if let Some(p) = self.pending.get_mut(&op) {
            if p.failed.is_none() {
                p.failed = Some(error);
            }
        }
        self.settle(op);
    }

    /// Reports and forgets `op` if nothing of it is in flight any more and nothing is left to post.
    fn settle(&mut self, op: u64) {
        let Some(p) = self.pending.get(&op) else {
            return;
        };
        if p.in_flight > 0 || p.notice_posted || p.wants_post() {
            if p.wants_post() && !self.post_queue.contains(&op) {
                self.post_queue.push_back(op);
            }
            return;
        }
        let Some(p) = self.pending.remove(&op) else {
            return;
        };
        if let Some((slot, _)) = p.send {
            // Never posted (failed or timed out before): the slot is free again.
            self.scratch.free_sends.push(slot);
        }
        for index in &p.local_regions {
            if let Some(r) = self.regions.get_mut(index) {
                r.users = r.users.saturating_sub(1);
            }
        }
        if p.abandoned {
            return;
        }
        let id = OpId(op);
        self.events.push_back(match p.failed {
            Some(error) => Event::Failed {
                op: id,
                kind: p.kind,
                peer: p.peer,
                error,
            },
            None if p.kind == OpKind::Read => Event::ReadDone {
                op: id,
                peer: p.peer,
                bytes: p.bytes,
            },
            None if p.kind == OpKind::Send => Event::SendDone {
                op: id,
                peer: p.peer,
            },
            None => Event::WriteDone {
                op: id,
                peer: p.peer,
                bytes: p.bytes,
            },
        });
    }

    /// Reads the completion queue once (blocking up to `timeout_ms` if given) and handles what it
    /// returns; returns the number of completions handled.
    fn drain(&mut self, timeout_ms: Option<i32>) -> Result<usize, FabricError> {
        let mut entries = std::mem::take(&mut self.entries);
        let read = match timeout_ms {
            Some(ms) if self.ep.cq().can_block() => self.ep.cq().sread(&mut entries, ms),
            Some(ms) => {
                // No wait object to block on (shm): read, and sleep a little when idle, backing
                // off from 50 µs to 200 µs, so that a waiting thread never spins. A read that
                // took long did work (on shm the target's progress copies the data of incoming
                // writes, which produces no completion): then go straight back to it.
                let started = Instant::now();
                let read = self.ep.cq().read(&mut entries);
                if matches!(read, CqRead::Empty) && started.elapsed() < BUSY_READ {
                    let limit = Duration::from_millis(u64::try_from(ms.max(0)).unwrap_or(0));
                    std::thread::sleep(self.idle_sleep.min(limit));
                    self.idle_sleep = (self.idle_sleep * 2).min(MAX_IDLE_SLEEP);
                } else {
                    self.idle_sleep = MIN_IDLE_SLEEP;
                }
                read
            }
            None => self.ep.cq().read(&mut entries),
        };
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
                    // An error without an operation (a failed incoming transfer): nothing of ours
                    // to fail.
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

    fn on_completion(&mut self, c: fi::Completion) {
        let what = if c.context.is_null() {
            None
        } else {
            self.contexts.give_back(c.context)
        };
        match what {
            Some(Use::Recv { slot }) => {
                if c.flags & sys::FI_REMOTE_CQ_DATA != 0 {
                    self.events.push_back(Event::Notice(Notice(c.data)));
                } else {
                    let len = c.len.min(self.max_message);
                    let mut bytes = vec![0; len];
                    // The slot lies inside the scratch buffer by construction.
                    let _ = self
                        .scratch
                        .buffer
                        .read_at(Scratch::RECV_BASE + slot * MESSAGE_SLOT, &mut bytes);
                    self.events.push_back(Event::Message(bytes));
                }
                if let Err(error) = self.post_recv(slot) {
                    self.broken.get_or_insert(error);
                }
            }
            Some(Use::Data { op }) => {
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
                self.scratch.free_sends.push(slot);
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

    fn on_failure(&mut self, context: *mut c_void, error: FabricError) {
        match self.contexts.give_back(context) {
            Some(Use::Data { op }) => {
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
                self.scratch.free_sends.push(slot);
                if let Some(p) = self.pending.get_mut(&op) {
                    p.in_flight = p.in_flight.saturating_sub(1);
                }
                self.fail(op, op_error(error));
            }
            Some(Use::Recv { slot }) => {
                // A failed receive (a truncated message): post the slot again.
                if let Err(error) = self.post_recv(slot) {
                    self.broken.get_or_insert(error);
                }
            }
            None => {}
        }
    }

    /// Reports operations past their deadline as timed out; their completions, if they ever
    /// come, are drained silently.
    fn expire(&mut self) {
        let now = Instant::now();
        let expired: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| !p.abandoned && p.deadline <= now)
            .map(|(&op, _)| op)
            .collect();
        for op in expired {
            let Some(p) = self.pending.get_mut(&op) else {
                continue;
            };
            p.abandoned = true;
            // Nothing more is posted for it, and no notice.
            p.cursor = (p.segments.len(), 0, 0);
            p.notice = None;
            if p.failed.is_none() {
                p.failed = Some(OpError::TimedOut(self.op_timeout));
            }
            let (kind, peer) = (p.kind, p.peer);
            self.events.push_back(Event::Failed {
                op: OpId(op),
                kind,
                peer,
                error: OpError::TimedOut(self.op_timeout),
            });
            self.settle(op);
        }
    }

    fn nearest_deadline(&self) -> Option<Instant> {
        self.pending
            .values()
            .filter(|p| !p.abandoned)
            .map(|p| p.deadline)
            .min()
    }

    fn take_events(&mut self, out: &mut Vec<Event>) -> usize {
        let n = self.events.len();
        out.extend(self.events.drain(..));
        n
    }
}

impl Transport for LibfabricTransport {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            notice_bits: self.notice_bits,
            max_message_len: self.max_message,
            memory_kinds: vec![MemoryKind::Host],
        }
    }

    fn register(&mut self, region: LocalRegion) -> Result<RegionDesc, RegisterError> {
        let index = region.index();
        let len = crate::validate::check_registration(
            &region,
            self.regions.contains_key(&index),
            BACKEND,
        )?;
        let requested_key = self.next_key;
        // SAFETY: `LocalRegion` guarantees the memory stays valid until it is deregistered or the
        // transport dropped; the registration is closed before the `LocalRegion` is released
        // (field order of `Registration`).
        let mr = unsafe {
            fi::MemoryRegion::register(
                &self.domain,
                self.endpoint_mr.then_some(&self.ep),
                region.addr(),
                len,
                sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE,
                requested_key,
            )
        }
        .map_err(|e| RegisterError::Backend {
            index,
            source: backend(e),
        })?;
        self.next_key += 1;
        let remote = RegionDesc {
            index,
            kind: region.kind(),
            addr: if self.virt_addr {
                region.addr() as u64
            } else {
                0
            },
            len: region.len(),
            key: mr.key(),
        };
        self.regions.insert(
            index,
            Registration {
                mr,
                region,
                remote,
                users: 0,
            },
        );
        Ok(remote)
    }

    fn deregister(&mut self, index: u32) -> Result<(), DeregisterError> {
        let users = self
            .regions
            .get(&index)
            .ok_or(DeregisterError::Unknown(index))?
            .users;
        if users > 0 {
            return Err(DeregisterError::InUse { index, ops: users });
        }
        self.regions.remove(&index);
        Ok(())
    }

    fn local_desc(&self) -> EndpointDesc {
        let mut regions: Vec<RegionDesc> = self.regions.values().map(|r| r.remote).collect();
        regions.sort_by_key(|r| r.index);
        EndpointDesc {
            backend: BACKEND.into(),
            provider: self.provider.clone(),
            address: self.address.clone(),
            notice_slot: Some(NoticeSlot {
                addr: self.scratch.remote_base + Scratch::NOTICE_SLOT as u64,
                key: self.scratch.mr.key(),
                len: NOTICE_BYTES as u64,
            }),
            regions,
        }
    }

    fn connect(&mut self, peer: &EndpointDesc) -> Result<PeerId, ConnectError> {
        peer.validate().map_err(ConnectError::BadDescription)?;
        if peer.backend != BACKEND || peer.provider != self.provider {
            return Err(ConnectError::Mismatch {
                expected: format!("{BACKEND}/{}", self.provider),
                found: format!("{}/{}", peer.backend, peer.provider),
            });
        }
        let Some(slot) = peer.notice_slot else {
            return Err(ConnectError::BadDescription(
                crate::desc::DescError::Truncated {
                    what: "notice slot",
                },
            ));
        };
        if slot.len < 8 {
            return Err(ConnectError::BadDescription(
                crate::desc::DescError::Truncated {
                    what: "notice slot",
                },
            ));
        }
        if let Some(i) = self
            .peers
            .iter()
            .position(|p| p.desc.address == peer.address)
        {
            self.peers[i].desc = peer.clone();
            return Ok(PeerId(i as u32));
        }
        // Providers read their own address format (fixed-size structures, or NUL-terminated
        // strings for shm) from the pointer: hand them a zero-padded copy at least as long as our
        // own address plus room for a terminator, so that no read goes past the buffer.
        let mut padded = peer.address.clone();
        padded.resize(peer.address.len().max(self.address.len()) + 64, 0);
        let addr = self
            .ep
            .av()
            .insert(&padded)
            .map_err(|e| ConnectError::BadAddress { source: backend(e) })?;
        self.peers.push(Peer {
            addr,
            desc: peer.clone(),
        });
        Ok(PeerId((self.peers.len() - 1) as u32))
    }

    fn write(
        &mut self,
        peer_id: PeerId,
        ops: &[CopyOp],
        notice: Option<Notice>,
    ) -> Result<OpId, WriteError> {
        let peer = self
            .peers
            .get(peer_id.0 as usize)
            .ok_or(WriteError::UnknownPeer(peer_id))?;
        if let Some(Notice(value)) = notice {
            if self.notice_bits < 64 && value >> self.notice_bits != 0 {
                return Err(WriteError::NoticeTooWide {
                    notice: value,
                    bits: self.notice_bits,
                });
            }
        }
        let bytes = check_ops(
            ops,
            |i| self.regions.get(&i).map(|r| r.region.len()),
            |i| peer.desc.region(i).map(|r| r.len),
        )?;
        let (segments, locals) = self.resolve(peer, ops, true);
        let op = self.submit(
            OpKind::Write,
            peer_id,
            bytes,
            segments,
            locals,
            notice.map(|n| n.0),
        );
        Ok(OpId(op))
    }

    fn read(&mut self, peer_id: PeerId, ops: &[CopyOp]) -> Result<OpId, ReadError> {
        let peer = self
            .peers
            .get(peer_id.0 as usize)
            .ok_or(ReadError::UnknownPeer(peer_id))?;
        let bytes = check_ops(
            ops,
            |i| peer.desc.region(i).map(|r| r.len),
            |i| self.regions.get(&i).map(|r| r.region.len()),
        )?;
        let (segments, locals) = self.resolve(peer, ops, false);
        let op = self.submit(OpKind::Read, peer_id, bytes, segments, locals, None);
        Ok(OpId(op))
    }

    fn send(&mut self, peer_id: PeerId, message: &[u8]) -> Result<OpId, SendError> {
        if self.peers.get(peer_id.0 as usize).is_none() {
            return Err(SendError::UnknownPeer(peer_id));
        }
        if message.len() > self.max_message {
            return Err(SendError::TooLarge {
                len: message.len(),
                max: self.max_message,
            });
        }
        if self.scratch.free_sends.is_empty() {
            // Reap finished sends first.
            self.drain(None)
                .map_err(|e| SendError::Backend(backend(e)))?;
        }
        let Some(slot) = self.scratch.free_sends.pop() else {
            return Err(SendError::Busy(SEND_SLOTS));
        };
        let offset = Scratch::SEND_BASE + slot * MESSAGE_SLOT;
        // The slot is inside the buffer and the message fits it (checked above).
        let _ = self.scratch.buffer.write_at(offset, message);
        let op = self.new_op();
        self.pending.insert(
            op,
            Pending {
                kind: OpKind::Send,
                peer: peer_id,
                bytes: message.len() as u64,
                segments: Vec::new(),
                cursor: (0, 0, 0),
                in_flight: 0,
                notice: None,
                notice_posted: false,
                failed: None,
                abandoned: false,
                deadline: Instant::now() + self.op_timeout,
                local_regions: Vec::new(),
                send: Some((slot, message.len())),
            },
        );
        self.post_queue.push_back(op);
        if let Err(error) = self.pump() {
            self.broken.get_or_insert(error);
        }
        Ok(OpId(op))
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, PollError> {
        let broken = |e| PollError::Backend(backend(e));
        if let Some(error) = self.broken.take() {
            return Err(broken(error));
        }
        self.pump().map_err(broken)?;
        while self.drain(None).map_err(broken)? > 0 {
            self.pump().map_err(broken)?;
        }
        self.expire();
        Ok(self.take_events(events))
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
            let mut until = deadline;
            if let Some(op_deadline) = self.nearest_deadline() {
                until = until.min(op_deadline);
            }
            let mut ms = until
                .saturating_duration_since(now)
                .as_millis()
                .clamp(1, i32::MAX as u128) as i32;
            if !self.post_queue.is_empty() {
                // Work is queued behind a full provider queue: come back soon to post it even if
                // no completion of ours wakes us.
                ms = ms.min(1);
            }
            self.drain(Some(ms))
                .map_err(|e| PollError::Backend(backend(e)))?;
        }
    }
}

#[cfg(test)]
mod tests;
