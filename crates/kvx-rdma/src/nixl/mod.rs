//! The NIXL backend: one-sided transfers through NVIDIA's NIXL (its UCX plugin by default), via
//! `nixl-sys` built with its `stub-api` feature, which loads `libnixl_capi.so` at run time (the
//! PyPI wheel `nixl-cu12` ships it with `libnixl`, the plugins and a private UCX; see
//! [`runtime`] and `cargo xtask test`).
//!
//! # The model
//!
//! One NIXL *agent* per endpoint, with one backend (plugin `UCX` unless configured otherwise).
//! Registered regions are NIXL `DRAM` registrations, or `VRAM` ones (with the device ordinal) for
//! CUDA memory, which UCX then moves with its CUDA transports (`cuda_ipc` between processes of one
//! host, GPUDirect RDMA over a NIC); the endpoint's description carries the
//! agent's name and its *metadata blob* (connection info and the registrations' remote keys) in
//! [`EndpointDesc::address`], and the region table holds virtual addresses (keys are 0: the keys
//! live in the metadata). [`Transport::connect`] loads the peer's metadata; the metadata is
//! regenerated on every [`Transport::register`] and [`Transport::deregister`], so a consumer
//! re-sends its description after registering more memory and the producer connects again
//! (which refreshes the peer). Each [`CopyOp`] becomes one descriptor per piece
//! ([`CopyOp::pieces`]) in a local and a remote descriptor list of the same length; a
//! [`Transport::write`] or [`Transport::read`] is one NIXL transfer request.
//!
//! # How a write and its notice travel
//!
//! A write with a notice is a NIXL `WRITE` request with a notification message (`kvxN` and the
//! notice value, little-endian); the peer receives it through `getNotifs` and reports it as
//! [`Event::Notice`]. Control messages ([`Transport::send`]) are `genNotif` messages tagged
//! `kvxM`; the receiver tells the two apart by the tag.
//!
//! **Ordering argument.** NIXL promises that a transfer's notification is delivered only once the
//! transfer's data is at the target, and its UCX plugin implements it like this
//! (`nixlUcxEngine::postXfer` and `checkXfer`): it posts every piece as a `ucp_put_nbx` on the
//! endpoint to the peer, then `ucp_ep_flush_nbx` on that endpoint, and sends the notification (a
//! UCX active message) only when the puts *and the flush* have completed; if they are still in
//! flight when `postXferReq` returns, the notification is kept in the request and sent from the
//! `getXferStatus` call that first sees them complete. A completed endpoint flush means every
//! preceding RMA operation on the endpoint is complete at the target, that is, its data is
//! visible in the target memory. So the notice cannot overtake the data. The transport only has
//! to keep calling `getXferStatus` on requests in flight, which [`Transport::poll`] and
//! [`Transport::wait`] do; [`Event::WriteDone`] is reported when the request (notification send
//! included) is complete. A write that fails delivers no notice (the notification is sent only
//! after a successful flush).
//!
//! # Progress and waiting
//!
//! The agent is created **without** NIXL's progress thread: that thread busy-polls the UCX worker
//! (two idle agents with it burn two cores; measured while writing this backend), which is what
//! the architecture forbids. Progress is driven by the caller instead, through `getXferStatus`
//! (the initiator's requests) and `getNotifs` (the whole worker, which also serves incoming
//! operations; with UCX over TCP the target's progress moves the bytes). NIXL's C API exposes no
//! wait object (no completion fd), so [`Transport::wait`] polls and sleeps in between, 50 µs
//! doubling up to [`NixlConfig::max_idle_sleep`] (200 µs by default, as libfabric `shm` uses)
//! while idle, and goes straight back once a poll did work (took longer than 20 µs): it never
//! spins. Its [`Waker`] raises a flag that the wait reads between its sleeps, so a wake ends the
//! wait within one sleep (at most `max_idle_sleep`). The cap trades CPU against throughput and latency: measured here (release build), an
//! idle waiting endpoint costs about 9 % of a core with 200 µs and under 3 % with 1 ms, but with
//! 1 ms a consumer whose polls each drain only a little (a transfer of many small pieces
//! trickling in over TCP) moves 4–16 KiB-piece transfers about 1.5 times slower.
//!
//! # Failures
//!
//! NIXL's C API folds every failure of an accepted transfer into one status (`NIXL_ERR_BACKEND`
//! in the C API). To tell a dead peer from other failures, the transport then sends the peer a
//! probe notification (`kvxP`, ignored by receivers): when the peer's endpoint refuses it (UCX
//! has marked it failed: the peer went away), the failure is [`OpError::PeerUnreachable`],
//! otherwise [`OpError::Backend`]. Every operation has a deadline ([`NixlConfig::op_timeout`]);
//! one past it is reported as [`OpError::TimedOut`] and its memory stays in use until NIXL gives
//! the request back. A transfer whose request cannot be created (NIXL checks descriptors against
//! the registrations and the peer's metadata) is a [`WriteError::Backend`] or
//! [`ReadError::Backend`] and moved nothing; one that fails while being posted is accepted and
//! reported as [`Event::Failed`], because part of it may have been posted.
//!
//! An address carries a checksum of the agent name and metadata, checked before NIXL parses the
//! metadata: NIXL keeps half-loaded state of an agent whose metadata it refused, after which it
//! refuses that agent's valid metadata too, so a corrupted description must never reach it. A
//! blob that passes the checksum but that the backend refuses (UCX cannot create an endpoint to a
//! dead agent) is [`ConnectError::Unreachable`]; anything else wrong with an address is
//! [`ConnectError::BadAddress`].

pub mod runtime;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvx_core::{MemoryKind, RegionDesc};
use kvx_layout::CopyOp;
use nixl_sys as sys;

use crate::cpu_time::thread_cpu_time;
use crate::desc::{EndpointDesc, MAX_ADDRESS_LEN};
use crate::error::{
    AddressError, BackendError, ConnectError, DeregisterError, OpError, PollError, ReadError,
    RegisterError, SendError, WriteError,
};
use crate::peers::PeerTable;
use crate::region::LocalRegion;
use crate::topology::{PciAddress, Topology};
use crate::transport::{Capabilities, Event, Notice, OpId, OpKind, PeerId, Transport, Waker};
use crate::validate::check_ops;
use crate::wake::WakeSignal;

pub use runtime::RuntimeError;

/// Backend name of NIXL endpoints.
pub const BACKEND: &str = "nixl";
/// NIXL's UCX plugin.
pub const PLUGIN_UCX: &str = "UCX";
/// Environment variable naming the directory that holds `libnixl_capi.so` (what
/// `cargo xtask test` sets), from which binaries and tests fill [`NixlConfig::library`].
pub const LIB_DIR_ENV: &str = "KVX_NIXL_LIB_DIR";

/// Longest control message.
const MAX_MESSAGE: usize = 4096;
/// Tag of a write's notice.
const TAG_NOTICE: &[u8; 4] = b"kvxN";
/// Tag of a control message.
const TAG_MESSAGE: &[u8; 4] = b"kvxM";
/// Tag of a liveness probe (ignored by receivers).
const TAG_PROBE: &[u8; 4] = b"kvxP";
/// Magic and version of the address encoding: magic, version, name length (u16 LE), checksum
/// of name and metadata (FNV-1a, u64 LE), name, metadata blob.
const ADDRESS_MAGIC: &[u8; 4] = b"KVXN";
const ADDRESS_VERSION: u8 = 1;
const ADDRESS_HEADER: usize = 4 + 1 + 2 + 8;
/// Shortest sleep between polls of a waiting thread.
const MIN_IDLE_SLEEP: Duration = Duration::from_micros(50);
/// Default longest such sleep ([`NixlConfig::max_idle_sleep`]).
const MAX_IDLE_SLEEP: Duration = Duration::from_micros(200);
/// A poll that takes longer than this made progress on something.
const BUSY_POLL: Duration = Duration::from_micros(20);
/// How long dropping a transport waits for its transfers in flight before it leaks them (and the
/// memory they use) rather than free memory a transfer may still touch.
const DROP_GRACE: Duration = Duration::from_secs(2);

/// How to open a NIXL endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NixlConfig {
    /// `libnixl_capi.so`, or the directory holding it; `None`: the dynamic loader's search path
    /// (`LD_LIBRARY_PATH`, the cache). Binaries and tests take it from [`LIB_DIR_ENV`]; this
    /// crate reads no environment. The first endpoint of a process loads the runtime; later
    /// ones use the same.
    pub library: Option<PathBuf>,
    /// The agent's name, unique among the agents that talk to each other; `None`: made from the
    /// process id, a counter and the clock.
    pub agent_name: Option<String>,
    /// Backend plugin (`UCX`).
    pub plugin: String,
    /// Backend parameters on top of the plugin's defaults (for UCX: `engine_config` (UCX
    /// settings `KEY=VALUE,…` without the `UCX_` prefix; a `UCX_*` environment variable wins),
    /// `ucx_error_handling_mode` (`peer` or `none`), `num_workers`, `ucx_devices`).
    pub backend_params: Vec<(String, String)>,
    /// How long an operation may stay in flight before it is reported as
    /// [`OpError::TimedOut`].
    pub op_timeout: Duration,
    /// Longest sleep of [`Transport::wait`] between two polls while nothing happens (it starts
    /// at 50 µs and doubles): the bound on the extra latency of the first event after a quiet
    /// spell, traded against the CPU an idle waiting thread costs.
    pub max_idle_sleep: Duration,
    /// UCX's network devices (`rdmap79s0:1,rdmap80s0:1`) for the memory's accelerator, from
    /// [`NixlConfig::with_rails_of`]: given to UCX as `NET_DEVICES` in `engine_config` when the
    /// endpoint opens, unless `engine_config` names devices itself; a `UCX_NET_DEVICES` the
    /// user set wins. `None`: UCX's own choice.
    pub net_devices: Option<String>,
}

impl NixlConfig {
    /// The UCX plugin with its defaults (UCX picks the transports; `UCX_*` variables apply).
    #[must_use]
    pub fn ucx() -> Self {
        Self {
            library: None,
            agent_name: None,
            plugin: PLUGIN_UCX.into(),
            backend_params: Vec::new(),
            op_timeout: Duration::from_secs(30),
            max_idle_sleep: MAX_IDLE_SLEEP,
            net_devices: None,
        }
    }

    /// UCX over TCP only (`TLS=tcp`), on the given network interface (`NET_DEVICES`), e.g.
    /// `Some("lo")` within one host; `None`: every interface UCX finds (it spreads large
    /// transfers over two). `UCX_TLS` and `UCX_NET_DEVICES` in the environment win.
    #[must_use]
    pub fn ucx_tcp(interface: Option<&str>) -> Self {
        let engine_config = match interface {
            Some(interface) => format!("TLS=tcp,NET_DEVICES={interface}"),
            None => "TLS=tcp".to_owned(),
        };
        Self::ucx().with_param("engine_config", &engine_config)
    }

    /// UCX with its shared-memory transports within one host, which need
    /// `ucx_error_handling_mode=none` (so a dead peer is noticed only by the operation timeout).
    #[must_use]
    pub fn ucx_shm() -> Self {
        Self::ucx().with_param("ucx_error_handling_mode", "none")
    }

    /// Uses the rails of memory owned by `accelerator` (the same selection as the libfabric
    /// backend's: [`Topology::rails_for`], overrides included) as UCX's network devices
    /// ([`ucx_net_devices_for`]). Without rails (not an accelerator, no RDMA NIC) the
    /// configuration is unchanged.
    #[must_use]
    pub fn with_rails_of(mut self, topology: &Topology, accelerator: &PciAddress) -> Self {
        if let Some(devices) = ucx_net_devices_for(topology, accelerator, None) {
            self.net_devices = Some(devices);
        }
        self
    }

    /// Ready for CUDA memory (`VRAM` registrations): turns UCX's memory-type cache off
    /// (`MEMTYPE_CACHE=n` added to `engine_config`). The cache learns device allocations by
    /// intercepting the CUDA allocation calls, so it misses memory allocated through a driver
    /// loaded at run time (kvx's `cudarc`), and NIXL then refuses that memory as "detected as
    /// host" (seen on the H200). Without the cache UCX asks the driver about each buffer.
    #[must_use]
    pub fn with_device_memory(self) -> Self {
        self.with_engine_setting("MEMTYPE_CACHE", "n")
    }

    /// Adds the UCX setting `key=value` (without the `UCX_` prefix) to `engine_config`, unless
    /// `engine_config` already sets `key` (that choice stays).
    #[must_use]
    pub fn with_engine_setting(self, key: &str, value: &str) -> Self {
        let engine = self
            .backend_params
            .iter()
            .find(|(k, _)| k == "engine_config")
            .map(|(_, v)| v.clone())
            .filter(|v| !v.is_empty());
        let prefix = format!("{key}=");
        let value = match engine {
            Some(v)
                if v.split(',')
                    .any(|kv| kv.trim().trim_start_matches("UCX_").starts_with(&prefix)) =>
            {
                v
            }
            Some(v) => format!("{v},{key}={value}"),
            None => format!("{key}={value}"),
        };
        self.with_param("engine_config", &value)
    }

    /// Adds (or replaces) a backend parameter.
    #[must_use]
    pub fn with_param(mut self, key: &str, value: &str) -> Self {
        self.backend_params.retain(|(k, _)| k != key);
        self.backend_params.push((key.into(), value.into()));
        self
    }
}

/// The environment variable UCX reads its network devices from.
pub const UCX_NET_DEVICES: &str = "UCX_NET_DEVICES";

/// The `UCX_NET_DEVICES` value for memory owned by `accelerator`: its rails from the topology
/// with each NIC's port ([`Topology::ucx_net_devices`]). `None` when `user_value` (what the
/// environment holds) is set, which always wins, or when the accelerator is unknown or has no
/// rails.
#[must_use]
pub fn ucx_net_devices_for(
    topology: &Topology,
    accelerator: &PciAddress,
    user_value: Option<&OsStr>,
) -> Option<String> {
    if user_value.is_some_and(|v| !v.is_empty()) {
        return None;
    }
    topology
        .ucx_net_devices(accelerator)
        .filter(|devices| !devices.is_empty())
}

/// Opening a NIXL endpoint failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The NIXL runtime is missing or unusable.
    #[error("NIXL runtime unavailable")]
    Runtime(#[from] RuntimeError),
    /// The configuration cannot be used (a name or parameter with a NUL byte, an empty name).
    #[error("bad NIXL configuration: {0}")]
    Config(String),
    /// Creating the agent failed.
    #[error("creating NIXL agent {name} failed")]
    Agent {
        /// Agent name.
        name: String,
        /// NIXL's error.
        #[source]
        source: sys::NixlError,
    },
    /// Creating the backend failed (plugin not found, bad parameters).
    #[error("creating the NIXL {plugin} backend failed")]
    Backend {
        /// Plugin.
        plugin: String,
        /// NIXL's error.
        #[source]
        source: sys::NixlError,
    },
    /// Exporting the agent's metadata failed.
    #[error("exporting the NIXL agent's metadata failed")]
    Metadata(#[source] sys::NixlError),
    /// The wake-up signal (an `eventfd`) could not be made.
    #[error("making the endpoint's wake-up signal failed")]
    Wake(#[source] std::io::Error),
}

/// A NIXL call failed: which one, with NIXL's error.
#[derive(Debug, thiserror::Error)]
#[error("{call} failed")]
pub struct NixlCallError {
    /// The NIXL call.
    pub call: &'static str,
    /// NIXL's error.
    #[source]
    pub source: sys::NixlError,
}

fn nixl_error(call: &'static str) -> impl FnOnce(sys::NixlError) -> BackendError {
    move |source| Box::new(NixlCallError { call, source })
}

/// A memory range handed to NIXL's registration: host memory, or CUDA memory of a device.
#[derive(Debug)]
struct Span {
    addr: usize,
    len: usize,
    kind: MemoryKind,
}

/// NIXL's memory type and device id for a region kind (only host and CUDA memory get here).
fn nixl_memory(kind: MemoryKind) -> (sys::MemType, u64) {
    match kind {
        MemoryKind::Cuda { device } => (sys::MemType::Vram, u64::from(device)),
        _ => (sys::MemType::Dram, 0),
    }
}

/// Whether NIXL's UCX backend registers this kind here.
fn nixl_accepts(kind: MemoryKind) -> bool {
    matches!(kind, MemoryKind::Host | MemoryKind::Cuda { .. })
}

impl sys::MemoryRegion for Span {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl sys::NixlDescriptor for Span {
    fn mem_type(&self) -> sys::MemType {
        nixl_memory(self.kind).0
    }

    fn device_id(&self) -> u64 {
        nixl_memory(self.kind).1
    }
}

/// A registered region.
struct Registration {
    // Declared before `region`: NIXL's registration is released before the memory may be.
    handle: sys::RegistrationHandle,
    region: LocalRegion,
    remote: RegionDesc,
    /// Operations in flight that use the region.
    users: usize,
}

struct Peer {
    name: String,
    desc: EndpointDesc,
}

impl Peer {
    /// The metadata blob of the peer's description (decoded when it was connected).
    fn metadata(&self) -> &[u8] {
        decode_address(&self.desc.address).map_or(&[], |(_, md)| md)
    }
}

/// An accepted transfer.
struct Pending {
    request: sys::XferRequest,
    kind: OpKind,
    peer: PeerId,
    bytes: u64,
    deadline: Instant,
    local_regions: Vec<u32>,
    /// Reported as timed out; NIXL still owns the request, which is released silently once it
    /// finishes.
    abandoned: bool,
}

/// A NIXL endpoint implementing [`Transport`].
pub struct NixlTransport {
    // Field order is drop order: transfer requests are released before the registrations, and
    // the registrations before the memory they cover (inside `Registration`); the agent goes
    // last (the requests and registrations also keep it alive).
    pending: BTreeMap<u64, Pending>,
    regions: HashMap<u32, Registration>,
    agent: sys::Agent,
    name: String,
    plugin: String,
    /// This endpoint's address: name and metadata blob (see the module documentation).
    address: Vec<u8>,
    peers: PeerTable<Peer>,
    op_timeout: Duration,
    next_op: u64,
    events: VecDeque<Event>,
    /// Notifications that were not kvx's (another program's agent): counted, not reported.
    foreign: u64,
    idle_sleep: Duration,
    max_idle_sleep: Duration,
    /// Ends a [`Transport::wait`] from another thread (its flag is read between the sleeps).
    wake: Arc<WakeSignal>,
}

impl std::fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransport")
            .field("agent", &self.name)
            .field("plugin", &self.plugin)
            .field("regions", &self.regions.len())
            .field("peers", &self.peers.len())
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

/// A fresh agent name: process id, a counter and the clock.
fn default_agent_name() -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "kvx-{}-{}-{:x}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed),
        nanos
    )
}

/// FNV-1a over the agent name, a separator and the metadata: catches a description corrupted
/// on its way before NIXL parses it (NIXL keeps half-loaded state of an agent whose metadata it
/// refused, and then refuses that agent's valid metadata too).
fn checksum(name: &str, metadata: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in name.as_bytes().iter().chain(&[0]).chain(metadata) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// Encodes an address: magic, version, name length, checksum, name, metadata.
fn encode_address(name: &str, metadata: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ADDRESS_HEADER + name.len() + metadata.len());
    out.extend_from_slice(ADDRESS_MAGIC);
    out.push(ADDRESS_VERSION);
    // Names are checked to fit a u16 at open.
    out.extend_from_slice(&u16::try_from(name.len()).unwrap_or(u16::MAX).to_le_bytes());
    out.extend_from_slice(&checksum(name, metadata).to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(metadata);
    out
}

/// Decodes an address into the agent name and the metadata blob.
fn decode_address(address: &[u8]) -> Result<(&str, &[u8]), AddressError> {
    if address.len() < ADDRESS_HEADER {
        return Err(AddressError::Truncated("header"));
    }
    if &address[..4] != ADDRESS_MAGIC {
        return Err(AddressError::BadMagic);
    }
    if address[4] != ADDRESS_VERSION {
        return Err(AddressError::Version(address[4]));
    }
    let len = usize::from(u16::from_le_bytes([address[5], address[6]]));
    let mut sum = [0; 8];
    sum.copy_from_slice(&address[7..15]);
    let rest = &address[ADDRESS_HEADER..];
    if len == 0 || rest.len() <= len {
        return Err(AddressError::Truncated("agent name or metadata"));
    }
    let name = std::str::from_utf8(&rest[..len]).map_err(|_| AddressError::Text("agent name"))?;
    if name.contains('\0') {
        return Err(AddressError::Text("agent name"));
    }
    let metadata = &rest[len..];
    if checksum(name, metadata) != u64::from_le_bytes(sum) {
        return Err(AddressError::Checksum);
    }
    Ok((name, metadata))
}

/// What a received notification is.
#[derive(Debug)]
enum Incoming {
    /// A notice or a control message.
    Event(Event),
    /// A liveness probe.
    Probe,
    /// Not from a kvx endpoint.
    Foreign,
}

fn parse_notification(bytes: &[u8]) -> Incoming {
    let Some((tag, payload)) = bytes.split_first_chunk::<4>() else {
        return Incoming::Foreign;
    };
    match tag {
        TAG_NOTICE => match <[u8; 8]>::try_from(payload) {
            Ok(value) => Incoming::Event(Event::Notice(Notice(u64::from_le_bytes(value)))),
            Err(_) => Incoming::Foreign,
        },
        TAG_MESSAGE => Incoming::Event(Event::Message(payload.to_vec())),
        TAG_PROBE => Incoming::Probe,
        _ => Incoming::Foreign,
    }
}

fn tagged(tag: &[u8; 4], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + payload.len());
    out.extend_from_slice(tag);
    out.extend_from_slice(payload);
    out
}

impl NixlTransport {
    /// Opens an endpoint: loads the runtime (once per process), creates the agent (without a
    /// progress thread, see the module documentation) and the backend, and exports the metadata.
    ///
    /// # Errors
    /// [`OpenError`] naming what failed; a missing runtime is [`OpenError::Runtime`], never an
    /// abort.
    pub fn open(config: &NixlConfig) -> Result<Self, OpenError> {
        runtime::ensure_loaded(config.library.as_deref())?;
        let name = config.agent_name.clone().unwrap_or_else(default_agent_name);
        if name.is_empty() || name.contains('\0') || name.len() > usize::from(u16::MAX) {
            return Err(OpenError::Config(format!(
                "agent name {name:?} must be 1 to 65535 bytes without NUL"
            )));
        }
        if config.plugin.contains('\0')
            || config
                .backend_params
                .iter()
                .any(|(k, v)| k.contains('\0') || v.contains('\0'))
        {
            return Err(OpenError::Config(
                "plugin and backend parameters must not contain NUL bytes".into(),
            ));
        }
        let agent_config = sys::AgentConfig {
            enable_prog_thread: false,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: sys::ThreadSync::None,
            num_workers: 1,
            pthr_delay_us: 0,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        };
        let agent = sys::Agent::new_configured(&name, &agent_config).map_err(|source| {
            OpenError::Agent {
                name: name.clone(),
                source,
            }
        })?;
        let backend_error = |source| OpenError::Backend {
            plugin: config.plugin.clone(),
            source,
        };
        // The rails' devices go to UCX as `NET_DEVICES` in `engine_config` (never through the
        // process environment); a `UCX_NET_DEVICES` the user set wins, as every `UCX_*` does.
        let config = match &config.net_devices {
            Some(devices) => &config.clone().with_engine_setting("NET_DEVICES", devices),
            None => config,
        };
        let params = sys::Params::from(
            config
                .backend_params
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str())),
        )
        .map_err(backend_error)?;
        agent
            .create_backend(&config.plugin, &params)
            .map_err(backend_error)?;
        let metadata = agent.get_local_md().map_err(OpenError::Metadata)?;
        Ok(Self {
            pending: BTreeMap::new(),
            regions: HashMap::new(),
            address: encode_address(&name, &metadata),
            agent,
            name,
            plugin: config.plugin.clone(),
            peers: PeerTable::default(),
            op_timeout: config.op_timeout,
            next_op: 0,
            events: VecDeque::new(),
            foreign: 0,
            idle_sleep: MIN_IDLE_SLEEP,
            max_idle_sleep: config.max_idle_sleep.max(MIN_IDLE_SLEEP),
            wake: Arc::new(WakeSignal::new().map_err(OpenError::Wake)?),
        })
    }

    /// The agent's name.
    #[must_use]
    pub fn agent_name(&self) -> &str {
        &self.name
    }

    /// The backend plugin in use.
    #[must_use]
    pub fn plugin(&self) -> &str {
        &self.plugin
    }

    /// Transfers in flight (timed-out ones NIXL has not given back included).
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Notifications received that did not come from a kvx endpoint (ignored).
    #[must_use]
    pub fn foreign_notifications(&self) -> u64 {
        self.foreign
    }

    /// Re-exports the metadata after a registration change.
    fn refresh_address(&mut self) -> Result<(), BackendError> {
        let metadata = self
            .agent
            .get_local_md()
            .map_err(nixl_error("getLocalMD"))?;
        let address = encode_address(&self.name, &metadata);
        if address.len() > MAX_ADDRESS_LEN {
            return Err(format!(
                "the agent's metadata takes {} bytes, more than an endpoint description's \
                 address holds ({MAX_ADDRESS_LEN})",
                address.len()
            )
            .into());
        }
        self.address = address;
        Ok(())
    }

    fn new_op(&mut self) -> u64 {
        self.next_op += 1;
        self.next_op
    }

    /// Builds the local and remote descriptor lists of `ops`; `write` says whether local is the
    /// source side. Every lookup succeeds: `check_ops` accepted the operations against the same
    /// tables.
    fn descriptors(
        &self,
        peer: &Peer,
        ops: &[CopyOp],
        write: bool,
    ) -> Result<
        (
            sys::XferDescList<'static>,
            sys::XferDescList<'static>,
            Vec<u32>,
        ),
        BackendError,
    > {
        // One list holds one memory type: every local region of the operations must be host
        // memory, or every one GPU memory (of any devices), and the same for the remote side.
        let kinds =
            |side: &dyn Fn(&CopyOp) -> Option<MemoryKind>| -> Result<sys::MemType, BackendError> {
                let mut kinds = ops.iter().filter_map(side);
                let first = kinds.next().unwrap_or(MemoryKind::Host);
                let is_gpu = |k: MemoryKind| matches!(k, MemoryKind::Cuda { .. });
                match kinds.find(|k| is_gpu(*k) != is_gpu(first)) {
                    Some(other) => Err(format!(
                    "one transfer mixes {first} and {other} memory on one side; NIXL takes one \
                     memory type per descriptor list"
                )
                    .into()),
                    None => Ok(nixl_memory(first).0),
                }
            };
        let local_of = |op: &CopyOp| if write { op.src_region } else { op.dst_region };
        let remote_of = |op: &CopyOp| if write { op.dst_region } else { op.src_region };
        let local_type = kinds(&|op| self.regions.get(&local_of(op)).map(|r| r.region.kind()))?;
        let remote_type = kinds(&|op| peer.desc.region(remote_of(op)).map(|r| r.kind))?;
        let mut local =
            sys::XferDescList::new(local_type).map_err(nixl_error("createXferDlist"))?;
        let mut remote =
            sys::XferDescList::new(remote_type).map_err(nixl_error("createXferDlist"))?;
        let mut locals = Vec::new();
        for op in ops {
            let (local_region, remote_region) = if write {
                (op.src_region, op.dst_region)
            } else {
                (op.dst_region, op.src_region)
            };
            let (Some(l), Some(r)) = (
                self.regions.get(&local_region),
                peer.desc.region(remote_region),
            ) else {
                return Err(format!(
                    "region {local_region} or the peer's region {remote_region} vanished"
                )
                .into());
            };
            let local_base = l.region.addr() as u64;
            // Each region's own device (one side may span several GPUs).
            let (local_dev, remote_dev) = (nixl_memory(l.region.kind()).1, nixl_memory(r.kind).1);
            for (src, dst, len) in op.pieces() {
                let (local_offset, remote_offset) = if write { (src, dst) } else { (dst, src) };
                // In range: `check_ops` bounded every piece by the registered lengths, and a
                // registered region lies inside the (unified) address space.
                local.add_desc(
                    (local_base + local_offset) as usize,
                    len as usize,
                    local_dev,
                );
                remote.add_desc((r.addr + remote_offset) as usize, len as usize, remote_dev);
            }
            if !locals.contains(&local_region) {
                locals.push(local_region);
            }
        }
        Ok((local, remote, locals))
    }

    /// Creates and posts a transfer; `Err` when the request could not be created (nothing moved).
    fn submit(
        &mut self,
        kind: OpKind,
        peer_id: PeerId,
        ops: &[CopyOp],
        bytes: u64,
        notice: Option<Notice>,
    ) -> Result<u64, BackendError> {
        let peer = self
            .peers
            .get(peer_id)
            .ok_or_else(|| BackendError::from("unknown peer"))?;
        let write = kind == OpKind::Write;
        let (local, remote, locals) = self.descriptors(peer, ops, write)?;
        let mut args = sys::OptArgs::new().map_err(nixl_error("createOptArgs"))?;
        if let Some(Notice(value)) = notice {
            args.set_notification_message(&tagged(TAG_NOTICE, &value.to_le_bytes()))
                .map_err(nixl_error("setNotifMsg"))?;
            args.set_has_notification(true)
                .map_err(nixl_error("setHasNotif"))?;
        }
        let operation = if write {
            sys::XferOp::Write
        } else {
            sys::XferOp::Read
        };
        let request = self
            .agent
            .create_xfer_req(operation, &local, &remote, &peer.name, Some(&args))
            .map_err(nixl_error("createXferReq"))?;
        drop((local, remote));
        let op = self.new_op();
        for index in &locals {
            if let Some(r) = self.regions.get_mut(index) {
                r.users += 1;
            }
        }
        let posted = self.agent.post_xfer_req(&request, Some(&args));
        self.pending.insert(
            op,
            Pending {
                request,
                kind,
                peer: peer_id,
                bytes,
                deadline: Instant::now() + self.op_timeout,
                local_regions: locals,
                abandoned: false,
            },
        );
        match posted {
            // Done at once, or in flight: either way `poll` reads the status.
            Ok(_) => {}
            Err(e) => {
                let error = self.classify(peer_id, nixl_error("postXferReq")(e));
                self.finish(op, Some(error));
            }
        }
        Ok(op)
    }

    /// Forgets a disconnected peer (NIXL drops its metadata and connection) once no transfer
    /// of its is pending.
    fn release_if_idle(&mut self, peer: PeerId) {
        let in_flight = self.pending.values().any(|p| p.peer == peer);
        let Some(gone) = self.peers.release(peer, in_flight) else {
            return;
        };
        // The same agent connected again under another id keeps its metadata.
        if self.peers.find(|p| p.name == gone.name).is_none() {
            // A peer whose metadata cannot be invalidated stays loaded in the agent: nothing
            // of kvx's refers to it any more.
            let _ = self.agent.invalidate_remote_md(&gone.name);
        }
    }

    /// The asynchronous error for a failed transfer to `peer` (see the module documentation).
    fn classify(&self, peer: PeerId, source: BackendError) -> OpError {
        let Some(p) = self.peers.get(peer) else {
            return OpError::Backend { source };
        };
        match self.agent.send_notification(&p.name, TAG_PROBE, None) {
            Err(_) => OpError::PeerUnreachable { source },
            Ok(()) => OpError::Backend { source },
        }
    }

    /// Forgets `op`, releases its request and regions, and reports it (unless abandoned).
    fn finish(&mut self, op: u64, failed: Option<OpError>) {
        let Some(p) = self.pending.remove(&op) else {
            return;
        };
        let Pending {
            request,
            kind,
            peer,
            bytes,
            local_regions,
            abandoned,
            ..
        } = p;
        // The request goes before the peer's metadata may (the backend may still need it).
        drop(request);
        if self.peers.is_closing(peer) {
            self.release_if_idle(peer);
        }
        for index in &local_regions {
            if let Some(r) = self.regions.get_mut(index) {
                r.users = r.users.saturating_sub(1);
            }
        }
        if abandoned {
            return;
        }
        let id = OpId(op);
        self.events.push_back(match failed {
            Some(error) => Event::Failed {
                op: id,
                kind,
                peer,
                error,
            },
            None if kind == OpKind::Read => Event::ReadDone {
                op: id,
                peer,
                bytes,
            },
            None => Event::WriteDone {
                op: id,
                peer,
                bytes,
            },
        });
    }

    /// Reads the status of every transfer in flight (which also sends deferred notifications)
    /// and reports what finished or expired.
    fn check_transfers(&mut self) {
        let now = Instant::now();
        let ops: Vec<u64> = self.pending.keys().copied().collect();
        for op in ops {
            let Some(p) = self.pending.get(&op) else {
                continue;
            };
            match self.agent.get_xfer_status(&p.request) {
                Ok(sys::XferStatus::Success) => self.finish(op, None),
                Ok(sys::XferStatus::InProgress) => {
                    if !p.abandoned && p.deadline <= now {
                        let (kind, peer) = (p.kind, p.peer);
                        if let Some(p) = self.pending.get_mut(&op) {
                            p.abandoned = true;
                        }
                        self.events.push_back(Event::Failed {
                            op: OpId(op),
                            kind,
                            peer,
                            error: OpError::TimedOut(self.op_timeout),
                        });
                    }
                }
                Err(e) => {
                    let error = if p.abandoned {
                        None
                    } else {
                        Some(self.classify(p.peer, nixl_error("getXferStatus")(e)))
                    };
                    self.finish(op, error);
                }
            }
        }
    }

    /// Drives the worker and collects notifications.
    fn check_notifications(&mut self) -> Result<(), BackendError> {
        let mut map = sys::NotificationMap::new().map_err(nixl_error("createNotifMap"))?;
        self.agent
            .get_notifications(&mut map, None)
            .map_err(nixl_error("getNotifs"))?;
        let agents = map.len().map_err(nixl_error("notifMapSize"))?;
        if agents == 0 {
            return Ok(());
        }
        let names: Vec<String> = map
            .agents()
            .map(|name| name.map(str::to_owned))
            .collect::<Result<_, _>>()
            .map_err(nixl_error("notifMapGetAgent"))?;
        for name in names {
            let notifications = map
                .get_notifications(&name)
                .map_err(nixl_error("notifMapGetNotifs"))?;
            for bytes in notifications {
                let bytes = bytes.map_err(nixl_error("notifMapGetNotif"))?;
                self.on_notification(&bytes);
            }
        }
        Ok(())
    }

    fn on_notification(&mut self, bytes: &[u8]) {
        match parse_notification(bytes) {
            Incoming::Event(event) => self.events.push_back(event),
            Incoming::Probe => {}
            Incoming::Foreign => self.foreign += 1,
        }
    }

    fn take_events(&mut self, out: &mut Vec<Event>) -> usize {
        let n = self.events.len();
        out.extend(self.events.drain(..));
        n
    }
}

impl Drop for NixlTransport {
    fn drop(&mut self) {
        // Let transfers in flight finish; whatever NIXL still holds after the grace period is
        // leaked together with the memory it uses, rather than released under a transfer.
        let deadline = Instant::now() + DROP_GRACE;
        while !self.pending.is_empty() && Instant::now() < deadline {
            self.check_transfers();
            if !self.pending.is_empty() {
                std::thread::sleep(MIN_IDLE_SLEEP);
            }
        }
        for (_, p) in std::mem::take(&mut self.pending) {
            for index in &p.local_regions {
                if let Some(registration) = self.regions.remove(index) {
                    std::mem::forget(registration);
                }
            }
            std::mem::forget(p.request);
        }
    }
}

impl Transport for NixlTransport {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            notice_bits: 64,
            max_message_len: MAX_MESSAGE,
            // CUDA memory of any device (`VRAM`); the ordinal here only names the kind.
            memory_kinds: vec![MemoryKind::Host, MemoryKind::Cuda { device: 0 }],
            polls_to_wait: true,
            peer_rma_unassisted: false,
            peer_rma_occasional_reads: false,
        }
    }

    fn register(&mut self, region: LocalRegion) -> Result<RegionDesc, RegisterError> {
        let index = region.index();
        let len = crate::validate::check_registration_of(
            &region,
            self.regions.contains_key(&index),
            BACKEND,
            nixl_accepts,
        )?;
        let span = Span {
            addr: region.addr(),
            len,
            kind: region.kind(),
        };
        // The registration covers memory that `LocalRegion` keeps valid until it is dropped;
        // `Registration` releases the NIXL registration (field order) before the region.
        let handle =
            self.agent
                .register_memory(&span, None)
                .map_err(|e| RegisterError::Backend {
                    index,
                    source: nixl_error(if matches!(span.kind, MemoryKind::Cuda { .. }) {
                        // The usual cause (seen on the H200): UCX's memory-type cache.
                        "registerMem (CUDA memory: was the endpoint opened with \
                         NixlConfig::with_device_memory()?)"
                    } else {
                        "registerMem"
                    })(e),
                })?;
        let remote = RegionDesc {
            index,
            kind: region.kind(),
            addr: region.addr() as u64,
            len: region.len(),
            key: 0,
        };
        self.regions.insert(
            index,
            Registration {
                handle,
                region,
                remote,
                users: 0,
            },
        );
        if let Err(source) = self.refresh_address() {
            // Undo: the description must describe what is registered.
            self.regions.remove(&index);
            let _ = self.refresh_address();
            return Err(RegisterError::Backend { index, source });
        }
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
        if let Some(mut registration) = self.regions.remove(&index) {
            registration
                .handle
                .deregister()
                .map_err(|e| DeregisterError::Backend {
                    index,
                    source: nixl_error("deregisterMem")(e),
                })?;
        }
        self.refresh_address()
            .map_err(|source| DeregisterError::Backend { index, source })
    }

    fn local_desc(&self) -> EndpointDesc {
        let mut regions: Vec<RegionDesc> = self.regions.values().map(|r| r.remote).collect();
        regions.sort_by_key(|r| r.index);
        EndpointDesc {
            backend: BACKEND.into(),
            provider: self.plugin.clone(),
            address: self.address.clone(),
            notice_slot: None,
            board: None,
            regions,
        }
    }

    fn connect(&mut self, peer: &EndpointDesc) -> Result<PeerId, ConnectError> {
        peer.validate().map_err(ConnectError::BadDescription)?;
        if peer.backend != BACKEND || peer.provider != self.plugin {
            return Err(ConnectError::Mismatch {
                expected: format!("{BACKEND}/{}", self.plugin),
                found: format!("{}/{}", peer.backend, peer.provider),
            });
        }
        if let Some(r) = peer.regions.iter().find(|r| !nixl_accepts(r.kind)) {
            return Err(ConnectError::BadAddress {
                source: format!("peer region {} is {} memory", r.index, r.kind).into(),
            });
        }
        let (name, metadata) = decode_address(&peer.address)
            .map_err(|e| ConnectError::BadAddress { source: e.into() })?;
        if name == self.name {
            return Err(ConnectError::BadAddress {
                source: "the description is this endpoint's own".into(),
            });
        }
        let known = self.peers.find(|p| p.name == name);
        if let Some(id) = known {
            if let Some(p) = self.peers.get_mut(id) {
                if p.metadata() == metadata {
                    // Same registrations: nothing to load again (a disconnected peer whose
                    // transfers still settle is taken back under its id).
                    p.desc = peer.clone();
                    self.peers.reopen(id);
                    return Ok(id);
                }
            }
        }
        // `nixl-sys` panics on an agent name that is not UTF-8 inside the metadata; a corrupt
        // blob must be an error, not a panic, so the call is fenced. No lock is held across the
        // panic (the agent's lock guard is a temporary of the finished FFI call).
        let agent = &self.agent;
        let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            agent.load_remote_md(metadata)
        }));
        let loaded = match loaded {
            Ok(Ok(loaded)) => loaded,
            // The blob passed its checksum, so a failure in the backend is most likely the
            // connection to the peer (UCX cannot create an endpoint to a dead agent).
            Ok(Err(e @ sys::NixlError::BackendError)) => {
                return Err(ConnectError::Unreachable {
                    source: nixl_error("loadRemoteMD")(e),
                })
            }
            Ok(Err(e)) => {
                return Err(ConnectError::BadAddress {
                    source: nixl_error("loadRemoteMD")(e),
                })
            }
            Err(_) => {
                return Err(ConnectError::BadAddress {
                    source: "loadRemoteMD: the metadata's agent name is not UTF-8".into(),
                })
            }
        };
        if loaded != name {
            if self.peers.find(|p| p.name == loaded).is_none() {
                let _ = self.agent.invalidate_remote_md(&loaded);
            }
            return Err(ConnectError::BadAddress {
                source: format!("the address names agent {name} but its metadata is {loaded}")
                    .into(),
            });
        }
        if let Some(id) = known {
            if let Some(p) = self.peers.get_mut(id) {
                p.desc = peer.clone();
            }
            self.peers.reopen(id);
            return Ok(id);
        }
        Ok(self.peers.insert(Peer {
            name: name.to_owned(),
            desc: peer.clone(),
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
        let bytes = check_ops(
            ops,
            |i| self.regions.get(&i).map(|r| r.region.len()),
            |i| peer.desc.region(i).map(|r| r.len),
        )?;
        let op = self
            .submit(OpKind::Write, peer_id, ops, bytes, notice)
            .map_err(WriteError::Backend)?;
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
        let op = self
            .submit(OpKind::Read, peer_id, ops, bytes, None)
            .map_err(ReadError::Backend)?;
        Ok(OpId(op))
    }

    fn send(&mut self, peer_id: PeerId, message: &[u8]) -> Result<OpId, SendError> {
        let peer = self
            .peers
            .live(peer_id)
            .ok_or(SendError::UnknownPeer(peer_id))?;
        if message.len() > MAX_MESSAGE {
            return Err(SendError::TooLarge {
                len: message.len(),
                max: MAX_MESSAGE,
            });
        }
        // genNotif hands the message to UCX (an eager active message) and owns it from there:
        // the send is complete for this endpoint once the call returns.
        self.agent
            .send_notification(&peer.name, &tagged(TAG_MESSAGE, message), None)
            .map_err(|e| SendError::Backend(nixl_error("genNotif")(e)))?;
        let op = self.new_op();
        self.events.push_back(Event::SendDone {
            op: OpId(op),
            peer: peer_id,
        });
        Ok(OpId(op))
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, PollError> {
        self.check_transfers();
        self.check_notifications().map_err(PollError::Backend)?;
        Ok(self.take_events(events))
    }

    fn wait(&mut self, events: &mut Vec<Event>, timeout: Duration) -> Result<usize, PollError> {
        let deadline = Instant::now() + timeout;
        loop {
            let started = thread_cpu_time();
            let n = self.poll(events)?;
            if n > 0 {
                self.idle_sleep = MIN_IDLE_SLEEP;
                return Ok(n);
            }
            let now = Instant::now();
            if now >= deadline || self.wake.take() {
                return Ok(0);
            }
            // Nothing to block on (NIXL exposes no wait object): sleep a little, backing off
            // from 50 µs to `max_idle_sleep` while idle; a poll that used much CPU did work (it
            // moved incoming bytes, which produces no event), so go straight back to it. (CPU
            // time, not wall time: a poll that only waited for a core did no work, and going
            // straight back would then keep the machine busy.)
            if thread_cpu_time().saturating_sub(started) < BUSY_POLL {
                std::thread::sleep(self.idle_sleep.min(deadline - now));
                self.idle_sleep = (self.idle_sleep * 2).min(self.max_idle_sleep);
            } else {
                self.idle_sleep = MIN_IDLE_SLEEP;
            }
        }
    }

    fn waker(&self) -> Option<Arc<dyn Waker>> {
        Some(Arc::clone(&self.wake) as Arc<dyn Waker>)
    }
}

#[cfg(test)]
mod tests;
