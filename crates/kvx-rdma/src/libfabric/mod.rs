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
//! # Rails
//!
//! An endpoint may span several *rails* ([`Rails`]): one fabric, domain, completion queue, address
//! vector and endpoint per rail (per NIC on EFA hosts, where [`rails::select_rails`] picks the
//! NICs next to the memory's accelerator), every region registered on every rail. A multi-rail
//! endpoint's address carries every rail's address, notice slot and region keys (see
//! [`address`]; a single-rail endpoint's address is the provider's, as before). Connecting pairs
//! local rail *i* with the peer's rail *i*, for as many rails as both have (a 2-rail endpoint and
//! a 1-rail one talk over one rail). A write or read of at least
//! [`LibfabricConfig::stripe_threshold`] bytes is split over the rails by [`stripe::stripe`]
//! (about `bytes / rails` each; smaller ones go whole on one rail, chosen round-robin). Its
//! notice goes on the first rail that carried data, after the data completions of *every* rail
//! have been read and every other rail that carried data has been *flushed*: an 8-byte RMA read
//! of the peer's notice slot on that rail, which completes only after the rail's earlier writes
//! are in the peer's memory. Delivery-complete completions alone would do where the provider
//! honours them for RMA; `tcp;ofi_rxm` 1.17 reports them but completes a write before the target
//! has placed it (the single-rail argument holds there through `FI_ORDER_RMA_WAW` on the one
//! connection, which does not order two connections). A failure on any rail fails the whole
//! operation, once, without a notice.
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
//! `poll(2)` on every rail's wait descriptor (`fi_control(FI_GETWAIT)`, after `fi_trywait`) and
//! on the endpoint's wake-up `eventfd`; nothing spins in the background. Providers without a wait
//! object (`shm`) are read with short sleeps in between (50 to 200 µs), on every rail. Another
//! thread interrupts a wait through [`Transport::waker`]: at once on descriptors, within one
//! sleep otherwise.

pub mod address;
pub mod fi;
mod posters;
pub mod rails;
mod shm_cma;
mod shm_lock;
mod shm_sweep;
pub mod stripe;

use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{MemoryKind, RegionDesc};
use kvx_layout::CopyOp;
use libfabric_sys as sys;

use crate::board::{self, NoticeBoard};
use crate::cpu_time::thread_cpu_time;
use crate::desc::{EndpointDesc, NoticeSlot};
use crate::error::{
    ConnectError, DeregisterError, OpError, PollError, ReadError, RegisterError, SendError,
    WriteError,
};
use crate::peers::PeerTable;
use crate::region::{HostBuffer, LocalRegion};
use crate::transport::{Capabilities, Event, Notice, OpId, OpKind, PeerId, Transport, Waker};
use crate::validate::check_ops;
use crate::wake::WakeSignal;
use address::PeerRails;
use fi::{CqRead, FabricError, FiErrno};
pub use rails::{select_rails, RailFallback, RailSelection};
pub use shm_cma::cma_usable as shm_uses_cma;
pub use stripe::DEFAULT_STRIPE_THRESHOLD;

/// Backend name of libfabric endpoints.
pub const BACKEND: &str = "libfabric";
/// The `tcp;ofi_rxm` provider: RDM over TCP, anywhere.
pub const PROVIDER_TCP: &str = "tcp;ofi_rxm";
/// The `shm` provider: within one host.
pub const PROVIDER_SHM: &str = "shm";
/// The environment variable (`1`: on) from which the `kvx` binary, the vLLM plugin and the
/// tests set [`LibfabricConfig::sweep_stale_shm`]; this crate never reads it.
pub const SHM_SWEEP_ENV: &str = "KVX_SHM_SWEEP";

/// How often operations towards a disconnected `shm` peer look whether its process exited.
const EXIT_CHECK: Duration = Duration::from_millis(50);
/// The `efa` provider: AWS Elastic Fabric Adapter.
pub const PROVIDER_EFA: &str = "efa";
/// Most rails one endpoint opens.
pub const MAX_RAILS: usize = address::MAX_RAILS;

/// Bytes of one control-message slot (the longest message, unless the provider allows less).
const MESSAGE_SLOT: usize = 4096;
/// Receive buffers kept posted for control messages (and notices on `FI_RX_CQ_DATA` providers),
/// per rail.
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
/// How often, at most, the transport looks in its process's mappings for an `shm` peer's region
/// that the provider has not mapped yet (see `peer_region_locked`).
const REGION_LOOKUP_EVERY: Duration = Duration::from_millis(100);
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
fn rest_if_idle(idle_sleep: &mut Duration, idle: bool, timeout_ms: i32) {
    if idle {
        let limit = Duration::from_millis(u64::try_from(timeout_ms.max(0)).unwrap_or(0));
        std::thread::sleep((*idle_sleep).min(limit));
        *idle_sleep = (*idle_sleep * 2).min(MAX_IDLE_SLEEP);
    } else {
        *idle_sleep = MIN_IDLE_SLEEP;
    }
}

/// The error of an operation whose peer link is gone (see `post_one`).
fn no_link() -> FiErrno {
    FiErrno::new(-i64::from(sys::FI_ENOENT))
}

/// Which rails an endpoint opens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rails {
    /// One endpoint on [`LibfabricConfig::domain`] (the default).
    #[default]
    One,
    /// One endpoint per named domain (NIC), in this order, e.g. `rdmap79s0-rdm` and
    /// `rdmap80s0-rdm` from [`rails::select_rails`].
    Domains(Vec<String>),
    /// This many endpoints on [`LibfabricConfig::domain`]: for providers without a domain per
    /// NIC (`shm`, `tcp;ofi_rxm` on one interface), where the rails share the hardware (tests,
    /// benchmarks).
    Count(usize),
}

/// How to open a libfabric endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LibfabricConfig {
    /// Provider name, as `fi_info -p` spells it (`shm`, `tcp;ofi_rxm`, `efa`).
    pub provider: String,
    /// Domain (NIC or interface) to open, e.g. `lo` for TCP over loopback; `None`: the first the
    /// provider offers. [`Rails::Domains`] replaces it.
    pub domain: Option<String>,
    /// The rails to open (one endpoint each); one by default.
    pub rails: Rails,
    /// Writes and reads of at least this many bytes are striped over the rails; smaller ones go
    /// on one rail, chosen round-robin ([`DEFAULT_STRIPE_THRESHOLD`]: 256 KiB).
    pub stripe_threshold: u64,
    /// How long an operation may stay in flight before it is reported as
    /// [`OpError::TimedOut`].
    pub op_timeout: Duration,
    /// Completion-queue entries (per rail).
    pub cq_size: usize,
    /// `shm` only: before opening, remove the regions that killed processes of this user left in
    /// `/dev/shm` (see the module `shm_sweep`; the `kvx` binary and the vLLM plugin turn it on
    /// where [`SHM_SWEEP_ENV`] is `1`). Off by default: it
    /// judges liveness in this pid namespace, which is wrong where containers share `/dev/shm`.
    pub sweep_stale_shm: bool,
}

impl LibfabricConfig {
    /// A configuration for `provider` with default settings.
    #[must_use]
    pub fn new(provider: impl Into<String>) -> Self {
        Self {
            provider: provider.into(),
            domain: None,
            rails: Rails::One,
            stripe_threshold: DEFAULT_STRIPE_THRESHOLD,
            op_timeout: Duration::from_secs(30),
            cq_size: 4096,
            sweep_stale_shm: false,
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

    /// The same configuration with other rails.
    #[must_use]
    pub fn with_rails(mut self, rails: Rails) -> Self {
        self.rails = rails;
        self
    }

    /// The domains this configuration opens, one per rail (`None`: the provider's first).
    fn rail_domains(&self) -> Vec<Option<String>> {
        match &self.rails {
            Rails::One => vec![self.domain.clone()],
            Rails::Domains(domains) => domains.iter().cloned().map(Some).collect(),
            Rails::Count(n) => vec![self.domain.clone(); *n],
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
    /// A flush read of operation `op` (see [`Pending::flush`]).
    Flush { op: u64 },
    /// A posted receive into message slot `slot` of rail `rail`.
    Recv { rail: usize, slot: usize },
    /// Send `op` from send slot `slot` (of rail 0, which carries every send).
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
    /// `None`: retired (see [`ContextPool::retire`]).
    live: HashMap<usize, (Box<OpContext>, Option<Use>)>,
    /// How many of `live` are retired.
    retired: usize,
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
        self.live.insert(ptr as usize, (ctx, Some(what)));
        ptr.cast::<c_void>()
    }

    /// The context's use, and the context back in the pool; `None` for one not handed out or
    /// retired.
    fn give_back(&mut self, ptr: *mut c_void) -> Option<Use> {
        let (ctx, what) = self.live.remove(&(ptr as usize))?;
        self.spare.push(ctx);
        if what.is_none() {
            self.retired -= 1;
        }
        what
    }

    /// Stops counting a context whose operation was given up while the provider may, in
    /// principle, still hand it back: it is never reused, and its completion, should one come,
    /// is ignored.
    fn retire(&mut self, ptr: usize) {
        if let Some((_, what)) = self.live.get_mut(&ptr) {
            if what.take().is_some() {
                self.retired += 1;
            }
        }
    }

    fn in_flight(&self) -> usize {
        self.live.len() - self.retired
    }
}

/// A registered region.
struct Registration {
    // Declared before `region`: the registrations close before the memory may be released.
    /// One registration per rail.
    mrs: Vec<fi::MemoryRegion>,
    region: LocalRegion,
    /// How peers see it (with rail 0's key).
    remote: RegionDesc,
    /// Operations in flight that use the region.
    users: usize,
}

/// A rail's own buffer: the notice slot, the notice source, receive and send slots.
struct Scratch {
    mr: fi::MemoryRegion,
    buffer: Arc<HostBuffer>,
    remote_base: u64,
    free_sends: Vec<usize>,
}

impl Scratch {
    const NOTICE_SLOT: usize = 0;
    const NOTICE_SOURCE: usize = NOTICE_BYTES;
    /// Where flush reads land (inside the notice source's 64 bytes, after the 8 it sends).
    const FLUSH_TARGET: usize = Self::NOTICE_SOURCE + 8;
    const RECV_BASE: usize = 2 * NOTICE_BYTES;
    const SEND_BASE: usize = Self::RECV_BASE + RECV_SLOTS * MESSAGE_SLOT;
    const LEN: usize = Self::SEND_BASE + SEND_SLOTS * MESSAGE_SLOT;

    fn ptr(&self, offset: usize) -> *mut u8 {
        // `offset` is one of the layout's constants, always inside the buffer.
        self.buffer.as_ptr().wrapping_add(offset)
    }

    fn notice_slot(&self) -> NoticeSlot {
        NoticeSlot {
            addr: self.remote_base + Self::NOTICE_SLOT as u64,
            key: self.mr.key(),
            len: NOTICE_BYTES as u64,
        }
    }
}

/// One rail: an endpoint with its own domain, completion queue, address vector and buffer.
struct Rail {
    // Field order is drop order: the watch of the endpoint's region lock, then the endpoint
    // handle; with `FI_MR_ENDPOINT` the scratch registration keeps it open until it closes
    // itself, before its buffer is freed.
    /// `shm` 1.17: the lock of this endpoint's own region (see [`shm_lock`]).
    own_lock: Option<shm_lock::RegionLock>,
    ep: Arc<fi::Endpoint>,
    scratch: Scratch,
    domain: Arc<fi::Domain>,
    name: String,
    address: Vec<u8>,
}

/// What the provider said about one rail.
struct RailInfo {
    provider: String,
    mr_mode: u64,
    cq_data: usize,
    delivery_complete: bool,
    max_msg: usize,
    tx_size: usize,
}

struct Peer {
    desc: EndpointDesc,
    rails: PeerRails,
    /// `shm`: the process that owns the peer's endpoint, from its address.
    pid: Option<i32>,
    /// `shm`: a watch on that process; nothing is posted to it once it has exited.
    watch: Option<shm_sweep::ProcessWatch>,
    /// `shm` 1.17: the lock of the peer's region on each link, once the provider has mapped it
    /// here; nothing is posted while it is held (see [`shm_lock`]).
    region_locks: Vec<Option<shm_lock::RegionLock>>,
    /// When the region locks still missing were last looked for.
    region_lookup_at: Option<Instant>,
    /// The peer's address in each local rail's address vector, for the links in use: local rail
    /// `i` talks to the peer's rail `i`, for `i` below both rail counts.
    links: Vec<sys::fi_addr_t>,
    /// How the provider took posts towards the peer, per link.
    contact: Vec<Contact>,
}

impl Peer {
    /// Whether its process has exited (`shm`): by its watch, or, without one (a kernel before
    /// 5.3, or a process gone before this side connected to it: no pidfd can be opened then),
    /// by its pid and `/proc` (other providers: never known).
    fn exited(&self) -> bool {
        match &self.watch {
            Some(watch) => watch.exited(),
            None => self.pid.is_some_and(shm_sweep::exited),
        }
    }
}

/// How a link's provider took posts towards a peer. `shm` 1.17 refuses (`-FI_EAGAIN`) every
/// post to a peer until the peer has read this side's name, which the first post sends it; that
/// state stays in the address-vector entry after `fi_av_remove`, for the next address inserted
/// there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Contact {
    /// Nothing posted yet.
    Untried,
    /// Posts were refused, none accepted: the peer may never have read this side's name.
    Refused,
    /// A post was accepted (on `shm`: the peer had read this side's name).
    Accepted,
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

/// A position in a stripe: segment, piece, byte within the piece.
type Cursor = (usize, u64, u64);

/// One piece of a stripe, ready to post.
#[derive(Clone, Copy, Debug)]
struct PieceAt {
    seg: Segment,
    local: usize,
    remote: u64,
    len: u64,
    /// The cursor after this piece.
    next: Cursor,
}

/// The part of an operation that one link (rail) moves.
#[derive(Debug)]
struct Stripe {
    link: usize,
    segments: Vec<Segment>,
    /// Next piece to post.
    cursor: Cursor,
}

impl Stripe {
    fn has_data(&self) -> bool {
        self.cursor.0 < self.segments.len()
    }

    /// The piece at `cursor` (at most `max_chunk` bytes); `None` past the last segment.
    fn piece_at(&self, cursor: Cursor, max_chunk: u64) -> Option<PieceAt> {
        let (seg_index, piece, within) = cursor;
        let seg = *self.segments.get(seg_index)?;
        let chunk = (seg.len - within).min(max_chunk);
        let local = seg.local + (piece * seg.local_stride + within) as usize;
        let remote = seg.remote + piece * seg.remote_stride + within;
        let mut next = (seg_index, piece, within + chunk);
        if next.2 >= seg.len {
            next = (seg_index, piece + 1, 0);
            if next.1 >= seg.count {
                next = (seg_index + 1, 0, 0);
            }
        }
        Some(PieceAt {
            seg,
            local,
            remote,
            len: chunk,
            next,
        })
    }
}

#[derive(Debug)]
struct Pending {
    kind: OpKind,
    peer: PeerId,
    bytes: u64,
    stripes: Vec<Stripe>,
    /// The stripe to post from next (the rails take turns).
    next_stripe: usize,
    in_flight: usize,
    notice: Option<u64>,
    /// The link the notice goes on.
    notice_link: usize,
    /// Links (other than the notice's) that carried data of a write with a notice and must be
    /// flushed before the notice goes: a tiny RMA read of the peer's notice slot on that link
    /// completes only after the link's earlier writes are in the peer's memory (the provider
    /// processes a link's operations in order), which holds even where a provider's
    /// delivery-complete completion comes early (`tcp;ofi_rxm`).
    flush: Vec<usize>,
    /// The flush reads have started.
    flushing: bool,
    notice_posted: bool,
    /// Where the notice goes instead, written by cross-memory attach: the peer's process and
    /// the slot's address in its notice board.
    board: Option<(i32, u64)>,
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
        self.failed.is_none() && (self.send.is_some() || self.stripes.iter().any(Stripe::has_data))
    }

    /// A flush read is due: the data completions are in (or the flush has begun).
    fn flush_due(&self) -> bool {
        self.failed.is_none()
            && !self.data_left()
            && self.notice.is_some()
            && !self.flush.is_empty()
            && (self.in_flight == 0 || self.flushing)
    }

    fn wants_post(&self) -> bool {
        self.data_left()
            || self.flush_due()
            || (self.failed.is_none()
                && self.in_flight == 0
                && self.flush.is_empty()
                && self.notice.is_some()
                && !self.notice_posted)
    }
}

/// A libfabric endpoint implementing [`Transport`], over one rail or several.
pub struct LibfabricTransport {
    // Field order is drop order. Registrations close first, then the rails (endpoint, scratch
    // registration and buffer, domain), and the contexts are freed last, so no context or buffer
    // is freed while libfabric may still use it.
    /// `shm` with several rails: one posting thread per extra rail (see [`posters`]).
    posters: Option<posters::Posters>,
    regions: HashMap<u32, Registration>,
    rails: Vec<Rail>,
    contexts: ContextPool,
    provider: String,
    virt_addr: bool,
    prov_key: bool,
    endpoint_mr: bool,
    delivery_complete: bool,
    notice_bits: u32,
    max_message: usize,
    max_chunk: usize,
    /// Contexts in flight (all rails, receives included) beyond which posting waits.
    in_flight_cap: usize,
    stripe_threshold: u64,
    op_timeout: Duration,
    /// When [`Self::expire`] next looks whether disconnected `shm` peers with operations in
    /// flight have exited.
    next_exit_check: Instant,
    next_key: u64,
    next_op: u64,
    /// Round-robin rail of the next operation that goes on one rail.
    next_rail: usize,
    peers: PeerTable<Peer>,
    pending: HashMap<u64, Pending>,
    post_queue: VecDeque<u64>,
    events: VecDeque<Event>,
    entries: Vec<sys::fi_cq_data_entry>,
    /// An error read without an operation context that may be one of ours (`shm`; see
    /// `fail_unconfirmed_pieces`).
    unattributed: Option<FabricError>,
    /// `fail_unconfirmed_pieces` is reading the queues.
    attributing: bool,
    /// Queue reads in progress (handling a completion may read again).
    draining: u32,
    /// A failure of the endpoint itself met outside `poll`/`wait` (while posting, or reposting a
    /// receive); the next `poll` or `wait` reports it.
    broken: Option<FabricError>,
    /// Current sleep between completion-queue reads while waiting without a wait object.
    idle_sleep: Duration,
    /// Where every rail has a wait descriptor: those, and the wake-up signal's, for `poll(2)`.
    wait_fds: Option<Vec<i32>>,
    /// Raised by [`Transport::waker`]'s wakes; checked by `wait`.
    wake: Arc<WakeSignal>,
    /// [`Capabilities::peer_rma_unassisted`]: `shm` with cross-memory attach.
    peer_rma_unassisted: bool,
    /// This endpoint's notice board (`shm` with cross-memory attach), once asked for.
    board: Option<Arc<NoticeBoard>>,
    /// `shm`: watches of the processes of peers released within [`shm_lock::DEPARTED_KEPT`],
    /// and when each was released.
    departed: VecDeque<(Instant, shm_sweep::ProcessWatch)>,
    /// `shm`: region locks released because a peer that died held them.
    abandoned_locks: u64,
}

// SAFETY: every libfabric object of the domains is owned by this value and used only through
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
    /// The configuration names no rail, or more than [`MAX_RAILS`].
    #[error("an endpoint needs 1 to {max} rails, not {rails}")]
    RailCount {
        /// Rails asked for.
        rails: usize,
        /// Most allowed.
        max: usize,
    },
    /// A rail's domain behaves differently from the first rail's (another provider or
    /// memory-registration mode), so one region table cannot describe both.
    #[error("rail {domain:?} differs from the first rail ({what})")]
    RailMismatch {
        /// The rail's domain.
        domain: String,
        /// What differs.
        what: &'static str,
    },
    /// The `shm` region name of this process is taken: most likely by a region that a killed
    /// process with the same pid left in `/dev/shm`.
    #[error(
        "the shm region name of this process is taken (/dev/shm/{pid}:*), most likely left by a \
         killed process with the same pid: remove those files, or turn the sweep on \
         (LibfabricConfig::sweep_stale_shm; KVX_SHM_SWEEP=1 for kvx and the vLLM plugin) where \
         no other pid namespace shares /dev/shm"
    )]
    ShmNameTaken {
        /// This process's id.
        pid: u32,
    },
    /// A rail's posting thread could not be started.
    #[error("starting the rails' posting threads failed")]
    Thread(#[source] std::io::Error),
    /// The wake-up descriptor (`eventfd`) could not be made.
    #[error("making the endpoint's wake-up descriptor failed")]
    Wake(#[source] std::io::Error),
}

impl std::fmt::Debug for LibfabricTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LibfabricTransport")
            .field("provider", &self.provider)
            .field("rails", &self.rail_domains())
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

/// Opens one rail: provider description, fabric, domain, completion queue (with a wait object
/// where the provider has one), address vector, endpoint, and the rail's own message buffer.
fn open_rail(
    config: &LibfabricConfig,
    domain: Option<&str>,
) -> Result<(Rail, RailInfo), OpenError> {
    let fabric_err = |source| OpenError::Fabric {
        provider: config.provider.clone(),
        source,
    };
    let query = |delivery_complete| {
        fi::Info::query(&fi::Query {
            provider: &config.provider,
            domain,
            delivery_complete,
        })
    };
    let info = match query(true) {
        Ok(info) => info,
        Err(_) => query(false).map_err(fabric_err)?,
    };
    let rail_info = RailInfo {
        provider: info.provider(),
        mr_mode: info.mr_mode(),
        cq_data: info.cq_data_size(),
        delivery_complete: info.delivery_complete(),
        max_msg: info.max_msg_size(),
        tx_size: info.tx_size(),
    };
    if rail_info.cq_data == 0 {
        return Err(OpenError::NoCqData {
            provider: rail_info.provider,
        });
    }
    let name = info.domain();
    let fabric = fi::Fabric::open(info).map_err(fabric_err)?;
    let domain = fi::Domain::open(&fabric).map_err(fabric_err)?;
    let cq = fi::CompletionQueue::open(&domain, config.cq_size.max(64)).map_err(fabric_err)?;
    let av = fi::AddressVector::open(&domain).map_err(fabric_err)?;
    let ep = fi::Endpoint::open(&domain, &cq, &av).map_err(|e| match e {
        // `shm` names its region after the pid: a region a killed process with this pid left
        // behind makes enabling fail with EBUSY.
        FabricError::Enable(errno)
            if config.provider == PROVIDER_SHM && errno.code == libc::EBUSY =>
        {
            OpenError::ShmNameTaken {
                pid: std::process::id(),
            }
        }
        other => fabric_err(other),
    })?;
    let address = ep.name().map_err(fabric_err)?;

    let virt_addr = rail_info.mr_mode & sys::FI_MR_VIRT_ADDR != 0;
    let endpoint_mr = rail_info.mr_mode & sys::FI_MR_ENDPOINT != 0;
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
    Ok((
        Rail {
            own_lock: if config.provider == PROVIDER_SHM {
                shm_lock::RegionLock::find(&address, std::process::id() as i32)
            } else {
                None
            },
            ep,
            scratch,
            domain,
            name,
            address,
        },
        rail_info,
    ))
}

impl LibfabricTransport {
    /// Opens an endpoint with one rail per [`LibfabricConfig::rails`], registers
    /// each rail's own message buffers and posts its receives.
    ///
    /// # Errors
    /// [`OpenError`] naming the failing call, or a rail configuration that cannot work.
    pub fn open(config: &LibfabricConfig) -> Result<Self, OpenError> {
        let domains = config.rail_domains();
        if domains.is_empty() || domains.len() > MAX_RAILS {
            return Err(OpenError::RailCount {
                rails: domains.len(),
                max: MAX_RAILS,
            });
        }
        // `shm`, when asked: clear the regions killed processes left (see [`shm_sweep`]), and
        // keep this process's other `shm` opens out until the rails exist.
        let sweep = config.provider == PROVIDER_SHM && config.sweep_stale_shm;
        let _opening = sweep.then(|| {
            let mut first = shm_sweep::OPENING
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            shm_sweep::sweep(std::path::Path::new(shm_sweep::SHM_DIR), *first);
            *first = false;
            first
        });
        let mut rails = Vec::with_capacity(domains.len());
        let mut infos: Vec<RailInfo> = Vec::with_capacity(domains.len());
        for domain in &domains {
            let (rail, info) = open_rail(config, domain.as_deref())?;
            if let Some(first) = infos.first() {
                let what = if info.provider != first.provider {
                    Some("provider")
                } else if info.mr_mode != first.mr_mode {
                    Some("memory-registration mode")
                } else {
                    None
                };
                if let Some(what) = what {
                    return Err(OpenError::RailMismatch {
                        domain: rail.name,
                        what,
                    });
                }
            }
            rails.push(rail);
            infos.push(info);
        }
        // Every rail has the same provider and modes (checked above); the limits are the
        // smallest of any rail.
        let first = &infos[0];
        let mr_mode = first.mr_mode;
        let cq_data = infos.iter().map(|i| i.cq_data).min().unwrap_or(0);
        let max_msg = infos.iter().map(|i| i.max_msg).min().unwrap_or(0);
        let tx_size = infos.iter().map(|i| i.tx_size).min().unwrap_or(0);
        let delivery_complete = infos.iter().all(|i| i.delivery_complete);
        let wake = Arc::new(WakeSignal::new().map_err(OpenError::Wake)?);
        let wait_fds = rails
            .iter()
            .map(|r| r.ep.cq().wait_fd())
            .collect::<Option<Vec<i32>>>()
            .map(|mut fds| {
                fds.push(wake.fd());
                fds
            });
        let n = rails.len();
        // `shm` copies a piece inside the post itself: rails post from threads of their own.
        let posters = (n > 1 && first.provider == PROVIDER_SHM)
            .then(|| posters::Posters::start(n))
            .transpose()
            .map_err(OpenError::Thread)?;
        let mut transport = Self {
            posters,
            regions: HashMap::new(),
            rails,
            contexts: ContextPool::default(),
            provider: first.provider.clone(),
            virt_addr: mr_mode & sys::FI_MR_VIRT_ADDR != 0,
            prov_key: mr_mode & sys::FI_MR_PROV_KEY != 0,
            endpoint_mr: mr_mode & sys::FI_MR_ENDPOINT != 0,
            delivery_complete,
            notice_bits: u32::try_from(cq_data.min(8) * 8).unwrap_or(64),
            max_message: MESSAGE_SLOT.min(max_msg),
            max_chunk: MAX_CHUNK.min(max_msg).max(1),
            in_flight_cap: (tx_size.clamp(16, 1024) + RECV_SLOTS) * n,
            stripe_threshold: config.stripe_threshold,
            op_timeout: config.op_timeout,
            next_exit_check: Instant::now(),
            next_key: FIRST_KEY + 1,
            next_op: 0,
            next_rail: 0,
            peers: PeerTable::default(),
            pending: HashMap::new(),
            post_queue: VecDeque::new(),
            events: VecDeque::new(),
            entries: vec![sys::fi_cq_data_entry::default(); CQ_BATCH],
            unattributed: None,
            attributing: false,
            draining: 0,
            broken: None,
            idle_sleep: MIN_IDLE_SLEEP,
            departed: VecDeque::new(),
            abandoned_locks: 0,
            wait_fds,
            wake,
            peer_rma_unassisted: first.provider == PROVIDER_SHM && shm_cma::cma_usable(),
            board: None,
        };
        for rail in 0..n {
            for slot in 0..RECV_SLOTS {
                transport
                    .post_recv(rail, slot)
                    .map_err(|source| OpenError::Fabric {
                        provider: config.provider.clone(),
                        source,
                    })?;
            }
        }
        Ok(transport)
    }

    /// Provider in use.
    #[must_use]
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// Domain (NIC or interface) of the first rail.
    #[must_use]
    pub fn domain_name(&self) -> &str {
        &self.rails[0].name
    }

    /// Domains of every rail, in rail order.
    #[must_use]
    pub fn rail_domains(&self) -> Vec<&str> {
        self.rails.iter().map(|r| r.name.as_str()).collect()
    }

    /// Number of rails (endpoints) this transport spans.
    #[must_use]
    pub fn rail_count(&self) -> usize {
        self.rails.len()
    }

    /// Rails in use between this endpoint and a connected peer (the smaller rail count of the
    /// two); `None` for an unknown peer.
    #[must_use]
    pub fn links(&self, peer: PeerId) -> Option<usize> {
        self.peers.live(peer).map(|p| p.links.len())
    }

    /// Whether transmit completions have delivery-complete semantics (see the module
    /// documentation's ordering argument).
    #[must_use]
    pub fn delivery_complete(&self) -> bool {
        self.delivery_complete
    }

    /// Whether every rail watches the lock of its own `shm` region, which a writer killed while
    /// writing here would leave held (libfabric 1.17's `shm`; see the module `shm_lock`).
    #[must_use]
    pub fn watches_region_locks(&self) -> bool {
        self.rails.iter().all(|r| r.own_lock.is_some())
    }

    /// Whether posts towards `peer` look at the lock of its `shm` region first (every link's,
    /// found once the provider has mapped the region, at the first post).
    #[must_use]
    pub fn watches_peer_region_locks(&self, peer: PeerId) -> bool {
        self.peers.get(peer).is_some_and(|p| {
            !p.region_locks.is_empty() && p.region_locks.iter().all(Option::is_some)
        })
    }

    /// How many times a region lock left held by a peer that died was released.
    #[must_use]
    pub fn abandoned_locks_released(&self) -> u64 {
        self.abandoned_locks
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

    /// Operations (data pieces, notices, sends, receives of every rail) in flight at the
    /// provider.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.contexts.in_flight()
    }

    fn post_recv(&mut self, rail: usize, slot: usize) -> Result<(), FabricError> {
        let ctx = self.contexts.take(Use::Recv { rail, slot });
        let r = &self.rails[rail];
        let ptr = r.scratch.ptr(Scratch::RECV_BASE + slot * MESSAGE_SLOT);
        let desc = r.scratch.mr.desc();
        let mut tries = 0;
        loop {
            // SAFETY: the receive slot lies inside the rail's registered scratch buffer, which
            // outlives the endpoint's operations (drop order); the context stays in the pool
            // until its completion is read.
            let result = unsafe {
                self.rails[rail]
                    .ep
                    .post_msg(ptr, self.max_message, desc, None, ctx)
            };
            match result {
                Ok(()) => return Ok(()),
                Err(e) if e.is_again() && tries < MAX_AGAIN => {
                    // Receives are posted at start-up and after each received message; the
                    // receive queue has room again once the provider made progress.
                    tries += 1;
                    if self.drain(rail, None)? == 0 {
                        self.drain(rail, Some(1))?;
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

    /// The local regions `ops` use; `write` says whether local is the source side.
    fn local_regions(ops: &[CopyOp], write: bool) -> Vec<u32> {
        let mut locals = Vec::new();
        for op in ops {
            let index = if write { op.src_region } else { op.dst_region };
            if !locals.contains(&index) {
                locals.push(index);
            }
        }
        locals
    }

    /// Resolves `ops` into segments on link `link` of `peer`; `write` says whether local is the
    /// source side.
    fn resolve(&self, peer: &Peer, link: usize, ops: &[CopyOp], write: bool) -> Vec<Segment> {
        let mut segments = Vec::with_capacity(ops.len());
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
            // Every lookup succeeds: `check_ops` accepted the operations against the same tables,
            // every region is registered on every rail, and `connect` checked that the peer's
            // rail table has a key for each of its regions on each rail.
            let (Some(local), Some(remote), Some(key)) = (
                self.regions.get(&local_region),
                peer.desc.region(remote_region),
                peer.rails.key(&peer.desc, link, remote_region),
            ) else {
                continue;
            };
            let Some(mr) = local.mrs.get(link) else {
                continue;
            };
            segments.push(Segment {
                local: local.region.addr() + local_offset as usize,
                desc: mr.desc(),
                remote: remote.addr + remote_offset,
                key,
                len: op.len,
                count: op.count,
                local_stride,
                remote_stride,
            });
        }
        segments
    }

    /// Releases a disconnected peer (its address-vector entries) once no operation of its is
    /// pending.
    fn release_if_idle(&mut self, peer: PeerId) {
        let in_flight = self.pending.values().any(|p| p.peer == peer);
        let Some(mut gone) = self.peers.release(peer, in_flight) else {
            return;
        };
        if let Some(watch) = gone.watch.take() {
            let now = Instant::now();
            while self
                .departed
                .front()
                .is_some_and(|(at, _)| now.duration_since(*at) > shm_lock::DEPARTED_KEPT)
            {
                self.departed.pop_front();
            }
            self.departed.push_back((now, watch));
        }
        for ((rail, addr), contact) in self.rails.iter().zip(gone.links).zip(gone.contact) {
            if self.provider == PROVIDER_SHM && contact == Contact::Refused {
                // Removed, the entry would go to the next address inserted with its state: had
                // the peer never read this side's name (killed before first contact), no post
                // to that next peer would ever be accepted. So it stays (one of the provider's
                // 256 peers per endpoint).
                continue;
            }
            // A provider that cannot remove an entry keeps it: nothing refers to it any more,
            // so that costs its memory only.
            let _ = rail.ep.av().remove(addr);
        }
    }

    /// Whether the lock of a peer's region (`shm` 1.17), which a post towards it takes, is held
    /// now. Locks the provider has not mapped yet are looked for at most every
    /// [`REGION_LOOKUP_EVERY`].
    fn peer_region_locked(&mut self, peer: PeerId) -> bool {
        let Some(p) = self.peers.get_mut(peer) else {
            return false;
        };
        // Where this side's own region is not 1.17's, no peer's is: nothing to look for (and
        // no scan of the mappings on the posting path).
        let Some(pid) = p
            .pid
            .filter(|_| self.rails.iter().any(|r| r.own_lock.is_some()))
        else {
            return false;
        };
        let now = Instant::now();
        if p.region_locks.iter().any(Option::is_none)
            && p.region_lookup_at
                .is_none_or(|at| now.duration_since(at) >= REGION_LOOKUP_EVERY)
        {
            p.region_lookup_at = Some(now);
            for (slot, rail) in p.region_locks.iter_mut().zip(&p.rails.rails) {
                if slot.is_none() {
                    *slot = shm_lock::RegionLock::find(&rail.address, pid);
                }
            }
        }
        p.region_locks
            .iter_mut()
            .flatten()
            .any(|lock| matches!(lock.look(now), shm_lock::Look::Held(_)))
    }

    /// Whether `rail`'s queue can be read without spinning: its region lock (`shm` 1.17) is
    /// free, or was held by a peer that has died and is released now (see [`shm_lock`]).
    fn own_region_readable(&mut self, rail: usize) -> bool {
        let Some(lock) = self.rails[rail].own_lock.as_mut() else {
            return true;
        };
        match lock.look(Instant::now()) {
            shm_lock::Look::Free => true,
            shm_lock::Look::Held(held) if held < shm_lock::ABANDONED_AFTER => false,
            shm_lock::Look::Held(_) => {
                let peer_died = self.peers.find(Peer::exited).is_some()
                    || self.departed.iter().any(|(_, w)| w.exited());
                if !peer_died {
                    return false;
                }
                if let Some(lock) = self.rails[rail].own_lock.as_mut() {
                    lock.release_abandoned();
                }
                self.abandoned_locks += 1;
                true
            }
        }
    }

    /// Splits `ops` into one stripe per link of `peer` that gets any (see [`stripe::stripe`]).
    fn stripes(&mut self, peer: PeerId, ops: &[CopyOp], write: bool) -> Vec<Stripe> {
        let Some(links) = self.peers.get(peer).map(|p| p.links.len()) else {
            return Vec::new();
        };
        if links <= 1 {
            let Some(p) = self.peers.get(peer) else {
                return Vec::new();
            };
            return vec![Stripe {
                link: 0,
                segments: self.resolve(p, 0, ops, write),
                cursor: (0, 0, 0),
            }];
        }
        let first = self.next_rail % links;
        self.next_rail = self.next_rail.wrapping_add(1);
        let Some(peer) = self.peers.get(peer) else {
            return Vec::new();
        };
        stripe::stripe(ops, links, self.stripe_threshold, first)
            .into_iter()
            .enumerate()
            .filter(|(_, ops)| !ops.is_empty())
            .map(|(link, ops)| Stripe {
                link,
                segments: self.resolve(peer, link, &ops, write),
                cursor: (0, 0, 0),
            })
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        kind: OpKind,
        peer: PeerId,
        bytes: u64,
        stripes: Vec<Stripe>,
        locals: Vec<u32>,
        notice: Option<u64>,
        board: Option<(i32, u64)>,
    ) -> u64 {
        let op = self.new_op();
        for index in &locals {
            if let Some(r) = self.regions.get_mut(index) {
                r.users += 1;
            }
        }
        let notice_link = stripes.first().map_or(0, |s| s.link);
        let flush = if notice.is_some() {
            stripes
                .iter()
                .map(|s| s.link)
                .filter(|&link| link != notice_link)
                .collect()
        } else {
            Vec::new()
        };
        self.pending.insert(
            op,
            Pending {
                kind,
                peer,
                bytes,
                stripes,
                next_stripe: 0,
                in_flight: 0,
                notice,
                notice_link,
                flush,
                flushing: false,
                notice_posted: false,
                board,
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
    /// reads the completion queues (progress) and tries again while that frees anything.
    fn pump(&mut self) -> Result<(), FabricError> {
        loop {
            let blocked = self.post_queued();
            if !blocked {
                return Ok(());
            }
            if self.drain_all()? == 0 {
                // Nothing completed: leave the rest for the next poll or wait.
                return Ok(());
            }
        }
    }

    /// Posts from the queue; returns whether the provider (or the in-flight limit) pushed back.
    ///
    /// A peer whose post was pushed back is skipped for the rest of the pass (its operations
    /// keep their order), so that one peer that does not take writes (one never contacted that
    /// does not read, one whose queue is full) holds up no other.
    fn post_queued(&mut self) -> bool {
        let mut refused: Vec<PeerId> = Vec::new();
        let mut at = 0;
        while let Some(&op) = self.post_queue.get(at) {
            let Some(p) = self.pending.get(&op) else {
                self.post_queue.remove(at);
                continue;
            };
            if !p.wants_post() {
                self.post_queue.remove(at);
                continue;
            }
            let peer = p.peer;
            if refused.contains(&peer) {
                at += 1;
                continue;
            }
            if self.contexts.in_flight() >= self.in_flight_cap {
                return true;
            }
            if self.peer_terminated(peer) {
                // Never posted to: the post could spin for ever on a lock it died holding.
                self.abandon(op, || OpError::PeerUnreachable {
                    source: "the peer's process has exited".into(),
                });
                continue;
            }
            if self.peer_region_locked(peer) {
                // Posted later: the post would spin on the lock (for ever, were its holder
                // dead); the operation's timeout still bounds the wait.
                refused.push(peer);
                at += 1;
                continue;
            }
            match self.post_one(op) {
                Ok(()) => {}
                Err(e) if e.is_again() => {
                    refused.push(peer);
                    at += 1;
                }
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
        !refused.is_empty()
    }

    /// Posts the next piece (or the notice, or the send) of `op`.
    fn post_one(&mut self, op: u64) -> Result<(), FiErrno> {
        let Some(p) = self.pending.get(&op) else {
            return Ok(());
        };
        // A pending operation's peer stays until the operation settles (`disconnect`); a link
        // it cannot find (a reconnect that described fewer rails) fails the operation rather
        // than leaving it queued for ever.
        let peer_id = p.peer;
        let Some(peer) = self.peers.get(peer_id) else {
            return Err(no_link());
        };
        if p.flush_due() {
            let link = p.flush[p.flush.len() - 1];
            let (Some(&peer_addr), Some(target)) =
                (peer.links.get(link), peer.rails.rails.get(link))
            else {
                return Err(no_link());
            };
            let slot = target.notice;
            let rail = &self.rails[link];
            let ctx = self.contexts.take(Use::Flush { op });
            // SAFETY: the landing place (8 bytes after the notice source) lies inside the rail's
            // registered scratch buffer, which outlives every operation, and nothing reads it;
            // the context stays in the pool until its completion is read.
            let result = unsafe {
                rail.ep.post_read(
                    rail.scratch.ptr(Scratch::FLUSH_TARGET),
                    8,
                    rail.scratch.mr.desc(),
                    peer_addr,
                    slot.addr,
                    slot.key,
                    ctx,
                )
            };
            self.note_post(peer_id, link, &result);
            if let Err(e) = result {
                self.contexts.give_back(ctx);
                return Err(e);
            }
            if let Some(p) = self.pending.get_mut(&op) {
                p.flush.pop();
                p.flushing = true;
                p.in_flight += 1;
            }
            return Ok(());
        }
        if !p.data_left() {
            // The notice: every data completion of every rail has been read (`wants_post`).
            if let Some((pid, addr)) = p.board {
                self.write_board_notice(op, pid, addr);
                return Ok(());
            }
            let link = p.notice_link;
            let (Some(&peer_addr), Some(target)) =
                (peer.links.get(link), peer.rails.rails.get(link))
            else {
                return Err(no_link());
            };
            let slot = target.notice;
            let data = p.notice.unwrap_or(0);
            let rail = &self.rails[link];
            let ctx = self.contexts.take(Use::Notice { op });
            // SAFETY: the notice source lies inside the rail's registered scratch buffer, which
            // outlives every operation; the context stays in the pool until its completion is
            // read.
            let result = unsafe {
                rail.ep.post_write(
                    rail.scratch.ptr(Scratch::NOTICE_SOURCE),
                    8,
                    rail.scratch.mr.desc(),
                    peer_addr,
                    slot.addr,
                    slot.key,
                    Some(data),
                    ctx,
                )
            };
            self.note_post(peer_id, link, &result);
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
            let peer_addr = peer.links[0];
            let rail = &self.rails[0];
            let ctx = self.contexts.take(Use::Send { op, slot });
            // SAFETY: the send slot lies inside rail 0's registered scratch buffer and is not
            // reused until its completion is read (free list); the context stays in the pool
            // until then.
            let result = unsafe {
                rail.ep.post_msg(
                    rail.scratch.ptr(Scratch::SEND_BASE + slot * MESSAGE_SLOT),
                    len,
                    rail.scratch.mr.desc(),
                    Some(peer_addr),
                    ctx,
                )
            };
            self.note_post(peer_id, 0, &result);
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
        if self.posters.is_some() && p.stripes.len() > 1 {
            return self.post_stripes_together(op);
        }
        // The rails take turns; one that pushes back lets the others go on.
        let (count, start) = (p.stripes.len(), p.next_stripe);
        let mut again = None;
        for k in 0..count {
            let s = (start + k) % count;
            match self.post_piece(op, s) {
                Ok(true) => {
                    if let Some(p) = self.pending.get_mut(&op) {
                        p.next_stripe = (s + 1) % count;
                    }
                    return Ok(());
                }
                Ok(false) => {}
                Err(e) if e.is_again() => again = Some(e),
                Err(e) => return Err(e),
            }
        }
        again.map_or(Ok(()), Err)
    }

    /// Posts the next piece of stripe `s` of `op`; `Ok(false)` when the stripe has nothing left.
    fn post_piece(&mut self, op: u64, s: usize) -> Result<bool, FiErrno> {
        let Some(p) = self.pending.get(&op) else {
            return Ok(false);
        };
        let Some(stripe) = p.stripes.get(s) else {
            return Ok(false);
        };
        let Some(PieceAt {
            seg,
            local,
            remote,
            len: chunk,
            next,
        }) = stripe.piece_at(stripe.cursor, self.max_chunk as u64)
        else {
            return Ok(false);
        };
        let link = stripe.link;
        let (kind, peer_id) = (p.kind, p.peer);
        let Some(&peer_addr) = self
            .peers
            .get(peer_id)
            .and_then(|peer| peer.links.get(link))
        else {
            return Err(no_link());
        };
        let ep = &self.rails[link].ep;
        let ctx = self.contexts.take(Use::Data { op });
        // SAFETY: the range was checked against the local registration, which cannot be
        // deregistered while the operation is pending (`users`); the context stays in the pool
        // until its completion is read.
        let result = unsafe {
            if kind == OpKind::Read {
                ep.post_read(
                    local as *mut u8,
                    chunk as usize,
                    seg.desc,
                    peer_addr,
                    remote,
                    seg.key,
                    ctx,
                )
            } else {
                ep.post_write(
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
        self.note_post(peer_id, link, &result);
        if let Err(e) = result {
            self.contexts.give_back(ctx);
            return Err(e);
        }
        if let Some(p) = self.pending.get_mut(&op) {
            p.in_flight += 1;
            if let Some(stripe) = p.stripes.get_mut(s) {
                stripe.cursor = next;
            }
        }
        Ok(true)
    }

    /// Posts as many pieces of every stripe of `op` as the in-flight limit allows, each rail's
    /// on its own thread at the same time ([`posters`]); `Ok` when anything was posted.
    fn post_stripes_together(&mut self, op: u64) -> Result<(), FiErrno> {
        let Some(posters) = &self.posters else {
            return Ok(());
        };
        let Some(p) = self.pending.get(&op) else {
            return Ok(());
        };
        let room = self.in_flight_cap.saturating_sub(self.contexts.in_flight());
        let per_stripe = (room / p.stripes.len().max(1)).max(1);
        let read = p.kind == OpKind::Read;
        let Some(links) = self.peers.get(p.peer).map(|peer| &peer.links) else {
            return Ok(());
        };
        let max_chunk = self.max_chunk as u64;
        let mut work: Vec<Vec<posters::Piece>> = vec![Vec::new(); self.rails.len()];
        // Per rail: the stripe it carries and the cursor after each of its pieces.
        let mut plans: Vec<Option<(usize, Vec<Cursor>)>> = vec![None; self.rails.len()];
        for (s, stripe) in p.stripes.iter().enumerate() {
            let link = stripe.link;
            if plans[link].is_some() {
                continue; // one stripe per rail and pass
            }
            let mut cursor = stripe.cursor;
            let mut after = Vec::new();
            while after.len() < per_stripe {
                let Some(at) = stripe.piece_at(cursor, max_chunk) else {
                    break;
                };
                work[link].push(posters::Piece {
                    read,
                    local: at.local,
                    len: at.len as usize,
                    desc: at.seg.desc,
                    peer: links[link],
                    remote: at.remote,
                    key: at.seg.key,
                    context: self.contexts.take(Use::Data { op }),
                });
                after.push(at.next);
                cursor = at.next;
            }
            plans[link] = Some((s, after));
        }
        let eps: Vec<Arc<fi::Endpoint>> = self.rails.iter().map(|r| Arc::clone(&r.ep)).collect();
        let contexts: Vec<Vec<*mut c_void>> = work
            .iter()
            .map(|pieces| pieces.iter().map(|piece| piece.context).collect())
            .collect();
        // SAFETY: every range was checked against the local registration, which cannot be
        // deregistered while the operation is pending; the contexts stay in the pool until their
        // completions are read (those of pieces not posted are given back below); no rail is
        // used by this thread while the posting threads run (`post` returns after all of them).
        let outcomes = unsafe { posters.post(&eps, work) };
        let peer = self.pending.get(&op).map(|p| p.peer);
        let (mut posted_any, mut again, mut failed) = (false, None, None);
        for (link, (posted, error)) in outcomes.into_iter().enumerate() {
            if let Some(peer) = peer {
                if posted > 0 {
                    self.note_post(peer, link, &Ok(()));
                } else if let Some(e) = &error {
                    self.note_post(peer, link, &Err(e.clone()));
                }
            }
            for &ctx in contexts[link].iter().skip(posted) {
                self.contexts.give_back(ctx);
            }
            if let (Some((s, after)), Some(p)) = (&plans[link], self.pending.get_mut(&op)) {
                if posted > 0 {
                    p.in_flight += posted;
                    p.stripes[*s].cursor = after[posted - 1];
                    posted_any = true;
                }
            }
            match error {
                Some(e) if e.is_again() => again = Some(e),
                Some(e) => failed = Some(e),
                None => {}
            }
        }
        match (failed, again) {
            (Some(e), _) => Err(e),
            (None, Some(e)) if !posted_any => Err(e),
            _ => Ok(()),
        }
    }

    /// Writes `op`'s notice into the peer's notice board (its data is in place: every data
    /// completion has been read, and `shm` completes a write on delivery) and settles `op`. A
    /// peer that is gone fails it; one whose memory this process may not write (a setting that
    /// changed after its description was made) gets the notice as a message instead.
    fn write_board_notice(&mut self, op: u64, pid: i32, addr: u64) {
        let Some(p) = self.pending.get_mut(&op) else {
            return;
        };
        p.board = None;
        let value = p.notice.unwrap_or(0);
        match board::write_remote(pid, addr, value) {
            Ok(()) => {
                p.notice = None;
                self.settle(op);
            }
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                if !self.post_queue.contains(&op) {
                    self.post_queue.push_back(op);
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => self.fail(
                op,
                OpError::PeerUnreachable {
                    source: format!("writing the notice: the peer's process is gone ({e})").into(),
                },
            ),
            Err(e) => self.fail(
                op,
                OpError::RemoteAccess {
                    source: format!("writing the notice into the peer's board: {e}").into(),
                },
            ),
        }
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
        if self.peers.is_closing(p.peer) {
            self.release_if_idle(p.peer);
        }
        if let Some((slot, _)) = p.send {
            // Never posted (failed or timed out before): the slot is free again.
            self.rails[0].scratch.free_sends.push(slot);
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

    /// Reads every rail's completion queue once without blocking; returns the completions
    /// handled.
    fn drain_all(&mut self) -> Result<usize, FabricError> {
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
    fn block(&mut self, timeout_ms: i32) -> Result<(), FabricError> {
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
    fn drain(&mut self, rail: usize, timeout_ms: Option<i32>) -> Result<usize, FabricError> {
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

    fn drain_once(&mut self, rail: usize, timeout_ms: Option<i32>) -> Result<usize, FabricError> {
        if !self.own_region_readable(rail) {
            // Read later: a read now would spin on the lock.
            if let Some(ms) = timeout_ms {
                rest_if_idle(&mut self.idle_sleep, true, ms);
            }
            return Ok(0);
        }
        let mut entries = std::mem::take(&mut self.entries);
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
    fn fail_unconfirmed_pieces(&mut self) -> Result<(), FabricError> {
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

    fn on_completion(&mut self, c: fi::Completion) {
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

    fn on_failure(&mut self, context: *mut c_void, error: FabricError) {
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

    /// Notes how the provider took a post towards `peer` on `link` (see [`Contact`]).
    fn note_post(&mut self, peer: PeerId, link: usize, result: &Result<(), FiErrno>) {
        let Some(contact) = self
            .peers
            .get_mut(peer)
            .and_then(|p| p.contact.get_mut(link))
        else {
            return;
        };
        match result {
            Ok(()) => *contact = Contact::Accepted,
            Err(e) if e.is_again() && *contact == Contact::Untried => *contact = Contact::Refused,
            Err(_) => {}
        }
    }

    /// Reports operations past their deadline as timed out, and those towards a disconnected
    /// `shm` peer whose process has exited as failed (they can never complete: only the peer
    /// moves their data); their completions, if they ever come, are drained silently.
    fn expire(&mut self) {
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

    /// The disconnected `shm` peers with operations pending whose process has exited (each
    /// looked up once).
    fn exited_peers(&self) -> HashSet<PeerId> {
        let closing: HashSet<PeerId> = self
            .pending
            .values()
            .filter(|p| !p.abandoned && self.peers.is_closing(p.peer))
            .map(|p| p.peer)
            .collect();
        closing
            .into_iter()
            .filter(|&peer| self.peer_exited(peer))
            .collect()
    }

    /// Whether the process of an `shm` peer has terminated, by its watch only: one `poll` that
    /// never blocks, fit for the posting path (no watch, or another provider: never known).
    fn peer_terminated(&self, peer: PeerId) -> bool {
        self.peers
            .get(peer)
            .and_then(|p| p.watch.as_ref())
            .is_some_and(shm_sweep::ProcessWatch::exited)
    }

    /// Whether the process of an `shm` peer has exited: by its watch, or, without one (a kernel
    /// before 5.3), by its pid and `/proc` (other providers: never known).
    fn peer_exited(&self, peer: PeerId) -> bool {
        self.peers.get(peer).is_some_and(Peer::exited)
    }

    /// The process that owns a peer's `shm` endpoint (other providers: none).
    fn shm_pid(&self, rails: &PeerRails) -> Option<i32> {
        if self.provider != PROVIDER_SHM {
            return None;
        }
        rails
            .rails
            .first()
            .and_then(|rail| shm_sweep::address_pid(&rail.address))
    }

    /// Whether an operation waits on a disconnected peer whose process may exit (`shm`).
    fn watching_exits(&self) -> bool {
        self.pending.values().any(|p| {
            !p.abandoned
                && self.peers.is_closing(p.peer)
                && self
                    .peers
                    .get(p.peer)
                    .is_some_and(|peer| peer.pid.is_some())
        })
    }

    /// Gives up on `op`: nothing more is posted for it, no notice goes, and it is reported
    /// failed with the error `error` makes.
    fn abandon(&mut self, op: u64, error: impl Fn() -> OpError) {
        let Some(p) = self.pending.get_mut(&op) else {
            return;
        };
        p.abandoned = true;
        for stripe in &mut p.stripes {
            stripe.cursor = (stripe.segments.len(), 0, 0);
        }
        p.notice = None;
        p.flush.clear();
        if p.failed.is_none() {
            p.failed = Some(error());
        }
        let (kind, peer) = (p.kind, p.peer);
        self.events.push_back(Event::Failed {
            op: OpId(op),
            kind,
            peer,
            error: error(),
        });
        self.settle(op);
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
            polls_to_wait: !self.rails.iter().all(|r| r.ep.cq().can_block()),
            peer_rma_unassisted: self.peer_rma_unassisted,
            peer_rma_occasional_reads: self.provider == PROVIDER_SHM,
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
        let mut mrs = Vec::with_capacity(self.rails.len());
        for rail in &self.rails {
            // SAFETY: `LocalRegion` guarantees the memory stays valid until it is deregistered or
            // the transport dropped; the registrations are closed before the `LocalRegion` is
            // released (field order of `Registration`).
            let mr = unsafe {
                fi::MemoryRegion::register(
                    &rail.domain,
                    self.endpoint_mr.then_some(&rail.ep),
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
            mrs.push(mr);
        }
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
            key: mrs[0].key(),
        };
        self.regions.insert(
            index,
            Registration {
                mrs,
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
        let mut regions: Vec<&Registration> = self.regions.values().collect();
        regions.sort_by_key(|r| r.remote.index);
        let address = if self.rails.len() == 1 {
            self.rails[0].address.clone()
        } else {
            let rails: Vec<address::LocalRail<'_>> = self
                .rails
                .iter()
                .map(|r| address::LocalRail {
                    address: &r.address,
                    notice: r.scratch.notice_slot(),
                })
                .collect();
            let keys: Vec<(u32, Vec<u64>)> = regions
                .iter()
                .map(|r| {
                    (
                        r.remote.index,
                        r.mrs.iter().skip(1).map(fi::MemoryRegion::key).collect(),
                    )
                })
                .collect();
            address::encode(&rails, &keys)
        };
        EndpointDesc {
            backend: BACKEND.into(),
            provider: self.provider.clone(),
            address,
            notice_slot: Some(self.rails[0].scratch.notice_slot()),
            board: self.board.as_ref().map(|b| b.place()),
            regions: regions.iter().map(|r| r.remote).collect(),
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
        let rails = address::decode(peer, slot).map_err(ConnectError::BadDescription)?;
        // The same peer (its first rail's address) again: refresh its region table and keys.
        // One disconnected but not yet released (operations of its still settling) is taken
        // back under its id: its address-vector entries are still there.
        if let Some(id) = self
            .peers
            .find(|p| p.rails.rails[0].address == rails.rails[0].address)
        {
            let pid = self.shm_pid(&rails);
            if let Some(known) = self.peers.get_mut(id) {
                known.desc = peer.clone();
                if known.pid != pid {
                    known.watch = pid.and_then(shm_sweep::ProcessWatch::open);
                }
                known.pid = pid;
                known.rails = rails;
            }
            self.peers.reopen(id);
            return Ok(id);
        }
        let links = self.rails.len().min(rails.rails.len());
        let mut addrs = Vec::with_capacity(links);
        for (local, remote) in self.rails.iter().zip(&rails.rails) {
            // Providers read their own address format (fixed-size structures, or NUL-terminated
            // strings for shm) from the pointer: hand them a zero-padded copy at least as long as
            // our own address plus room for a terminator, so that no read goes past the buffer.
            let mut padded = remote.address.clone();
            padded.resize(remote.address.len().max(local.address.len()) + 64, 0);
            match local.ep.av().insert(&padded) {
                Ok(addr) => addrs.push(addr),
                Err(e) => {
                    // The rails inserted already are taken out again.
                    for (rail, addr) in self.rails.iter().zip(addrs) {
                        let _ = rail.ep.av().remove(addr);
                    }
                    return Err(ConnectError::BadAddress { source: backend(e) });
                }
            }
        }
        let pid = self.shm_pid(&rails);
        Ok(self.peers.insert(Peer {
            desc: peer.clone(),
            rails,
            pid,
            watch: pid.and_then(shm_sweep::ProcessWatch::open),
            region_locks: std::iter::repeat_with(|| None).take(addrs.len()).collect(),
            region_lookup_at: None,
            contact: vec![Contact::Untried; addrs.len()],
            links: addrs,
        }))
    }

    fn disconnect(&mut self, peer: PeerId) {
        if self.peers.close(peer) {
            self.release_if_idle(peer);
        }
    }

    fn write(
        &mut self,
        peer_id: PeerId,
        ops: &[CopyOp],
        notice: Option<Notice>,
    ) -> Result<OpId, WriteError> {
        let peer = self
            .peers
            .live(peer_id)
            .ok_or(WriteError::UnknownPeer(peer_id))?;
        if let Some(Notice(value)) = notice {
            if self.notice_bits < 64 && value >> self.notice_bits != 0 {
                return Err(WriteError::NoticeTooWide {
                    notice: value,
                    bits: self.notice_bits,
                });
            }
        }
        // A peer with a notice board takes board notices there, written by cross-memory attach
        // once the data is in; that needs this side's data to move the same way (no help from
        // the peer). Otherwise every notice is a message.
        let board = match (peer.pid, self.peer_rma_unassisted) {
            (Some(pid), true) => board::slot_for(notice, peer.desc.board)?.map(|slot| (pid, slot)),
            _ => None,
        };
        let bytes = check_ops(
            ops,
            |i| self.regions.get(&i).map(|r| r.region.len()),
            |i| peer.desc.region(i).map(|r| r.len),
        )?;
        let stripes = self.stripes(peer_id, ops, true);
        let locals = Self::local_regions(ops, true);
        let op = self.submit(
            OpKind::Write,
            peer_id,
            bytes,
            stripes,
            locals,
            notice.map(|n| n.0),
            board,
        );
        Ok(OpId(op))
    }

    fn read(&mut self, peer_id: PeerId, ops: &[CopyOp]) -> Result<OpId, ReadError> {
        let peer = self
            .peers
            .live(peer_id)
            .ok_or(ReadError::UnknownPeer(peer_id))?;
        let bytes = check_ops(
            ops,
            |i| peer.desc.region(i).map(|r| r.len),
            |i| self.regions.get(&i).map(|r| r.region.len()),
        )?;
        let stripes = self.stripes(peer_id, ops, false);
        let locals = Self::local_regions(ops, false);
        let op = self.submit(OpKind::Read, peer_id, bytes, stripes, locals, None, None);
        Ok(OpId(op))
    }

    fn send(&mut self, peer_id: PeerId, message: &[u8]) -> Result<OpId, SendError> {
        if self.peers.live(peer_id).is_none() {
            return Err(SendError::UnknownPeer(peer_id));
        }
        if message.len() > self.max_message {
            return Err(SendError::TooLarge {
                len: message.len(),
                max: self.max_message,
            });
        }
        if self.rails[0].scratch.free_sends.is_empty() {
            // Reap finished sends first.
            self.drain(0, None)
                .map_err(|e| SendError::Backend(backend(e)))?;
        }
        let Some(slot) = self.rails[0].scratch.free_sends.pop() else {
            return Err(SendError::Busy(SEND_SLOTS));
        };
        let offset = Scratch::SEND_BASE + slot * MESSAGE_SLOT;
        // The slot is inside the buffer and the message fits it (checked above).
        let _ = self.rails[0].scratch.buffer.write_at(offset, message);
        let op = self.new_op();
        self.pending.insert(
            op,
            Pending {
                kind: OpKind::Send,
                peer: peer_id,
                bytes: message.len() as u64,
                stripes: Vec::new(),
                next_stripe: 0,
                in_flight: 0,
                notice: None,
                notice_link: 0,
                flush: Vec::new(),
                flushing: false,
                notice_posted: false,
                board: None,
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
        while self.drain_all().map_err(broken)? > 0 {
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
            if now >= deadline || self.wake.take() {
                return Ok(0);
            }
            let mut until = deadline;
            if let Some(op_deadline) = self.nearest_deadline() {
                until = until.min(op_deadline);
            }
            if self.watching_exits() {
                until = until.min(self.next_exit_check);
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
            self.block(ms).map_err(|e| PollError::Backend(backend(e)))?;
        }
    }

    /// Every libfabric endpoint has one: a wake ends a `poll(2)` on the wait descriptors at
    /// once, and a wait that reads with sleeps in between (no wait object) within one sleep.
    fn waker(&self) -> Option<Arc<dyn Waker>> {
        Some(Arc::clone(&self.wake) as Arc<dyn Waker>)
    }

    /// `shm` with cross-memory attach: peers' data lands without this side's help, and so can
    /// their notices (one more 8-byte `process_vm_writev` into the board once the data write
    /// completed). Other providers: none.
    fn notice_board(&mut self, slots: usize) -> Option<Arc<NoticeBoard>> {
        if !self.peer_rma_unassisted {
            return None;
        }
        Some(Arc::clone(
            self.board
                .get_or_insert_with(|| Arc::new(NoticeBoard::new(slots))),
        ))
    }
}

#[cfg(test)]
mod tests;
