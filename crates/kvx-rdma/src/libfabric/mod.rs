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
//! transport chooses unique keys itself, from a random start within the provider's key size (a
//! peer that was never sent a key cannot guess one); with `FI_MR_ENDPOINT` registrations are bound to the
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
mod completion;
mod config;
mod context;
pub mod fi;
mod peer;
mod post;
mod posters;
pub mod rails;
mod shm_cma;
mod shm_lock;
mod shm_sweep;
pub mod stripe;
mod transport;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libfabric_sys as sys;

use crate::board::NoticeBoard;
use crate::peers::PeerTable;
use crate::region::HostBuffer;
#[cfg(doc)]
use crate::transport::{Capabilities, Transport};
use crate::transport::{Event, PeerId};
use crate::wake::WakeSignal;
use completion::MIN_IDLE_SLEEP;
pub use config::{LibfabricConfig, OpenError, Rails};
use context::{ContextPool, Registration, Scratch};
use fi::FabricError;
pub use fi::{choose_library, load_library, DEFAULT_LIBRARY, LIBRARY_ENV};
use peer::{Peer, Rail, RailInfo};
use post::Pending;
pub use rails::{select_rails, RailFallback, RailSelection};
pub use shm_cma::cma_usable as shm_uses_cma;
pub use stripe::DEFAULT_STRIPE_THRESHOLD;

/// Backend name of libfabric endpoints.
pub const BACKEND: &str = "libfabric";
/// The `tcp;ofi_rxm` provider: RDM over TCP, anywhere.
pub const PROVIDER_TCP: &str = "tcp;ofi_rxm";
/// The `shm` provider: within one host.
pub const PROVIDER_SHM: &str = "shm";
/// The `efa` provider: AWS Elastic Fabric Adapter.
pub const PROVIDER_EFA: &str = "efa";
/// The environment variable (`1`: on) from which the `kvx` binary, the vLLM plugin and the
/// tests set [`LibfabricConfig::sweep_stale_shm`]; this crate never reads it.
pub const SHM_SWEEP_ENV: &str = "KVX_SHM_SWEEP";
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
/// Keys the transport chooses itself (providers without `FI_MR_PROV_KEY`) start at a random value
/// that leaves this many above it.
const KEY_ROOM: u64 = 1 << 20;

/// The first key this transport chooses itself: random within the provider's key size (so that
/// a peer that was never sent a key cannot guess one), with [`KEY_ROOM`] keys after it.
fn first_key(key_size: usize) -> u64 {
    let bits = u32::try_from(key_size.clamp(1, 8) * 8).unwrap_or(64);
    let max = if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    };
    // The system's generator does not fail on Linux once booted; were it to, keys would start
    // low, as any provider's may.
    let random = getrandom::u64().unwrap_or(0);
    if max <= KEY_ROOM {
        return 1;
    }
    random % (max - KEY_ROOM) + 1
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
    /// Opened with `FI_HMEM` ([`LibfabricConfig::device_memory`]): CUDA regions register.
    device_memory: bool,
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
    // A library that cannot be loaded is said as such, not as a provider that lacks something.
    fi::load_library().map_err(fabric_err)?;
    let query = |delivery_complete| {
        fi::Info::query(&fi::Query {
            provider: &config.provider,
            domain,
            delivery_complete,
            hmem: config.device_memory,
        })
    };
    let info = match query(true) {
        Ok(info) => info,
        Err(_) => query(false).map_err(|source| {
            if config.device_memory {
                OpenError::NoDeviceMemory {
                    provider: config.provider.clone(),
                    source,
                }
            } else {
                fabric_err(source)
            }
        })?,
    };
    let rail_info = RailInfo {
        provider: info.provider(),
        mr_mode: info.mr_mode(),
        mr_key_size: info.mr_key_size(),
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
            first_key(rail_info.mr_key_size),
            fi::Hmem::System,
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
                    .map(shm_lock::RegionLock::watched)
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
        // Regions take the keys after the first rail's scratch buffer's (which is random where
        // the transport chooses keys; another rail's domain has keys of its own).
        let next_key = rails[0].scratch.mr.key().wrapping_add(1);
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
            next_key,
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
            device_memory: config.device_memory,
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
        let by_watchdog: u64 = self
            .rails
            .iter()
            .filter_map(|r| r.own_lock.as_ref())
            .map(shm_lock::RegionLock::released_by_watchdog)
            .sum();
        self.abandoned_locks + by_watchdog
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
}

#[cfg(test)]
mod tests;
