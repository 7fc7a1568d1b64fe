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
//! (which refreshes the peer). A [`Transport::write`] or [`Transport::read`] is one NIXL transfer
//! request, or several (below); each piece of each [`CopyOp`] ([`CopyOp::pieces`]) is one descriptor
//! in a local and a remote list of the same length.
//!
//! # Prepared descriptor lists
//!
//! Describing every piece per transfer costs a FFI call per descriptor and, inside NIXL, a lookup
//! of each descriptor in the registrations on both sides: for a 16k-token request scattered into
//! 131,072 blocks, about 25 ms of the driver thread here. So the endpoint prepares lists once
//! (`prepXferDlist`): all its registered memory cut into one *unit* (the unit of the largest
//! operation of the first transfer of at least 32 pieces: a block's K or V, say), and the same for
//! each peer it transfers with. A transfer then names the pieces of its operations of whole units
//! by index (`makeXferReq`, which merges indices adjacent on both sides back into one descriptor):
//! about a third of the time. Operations of another unit (a request's partial last block) go in a
//! second request described piece by piece, posted after the first; it carries the notification.
//! Both requests use the one UCX endpoint to the peer, and the plugin flushes that endpoint before
//! it sends a notification (below), which completes the first request's puts too: the notice
//! still follows all the data. A registration change drops this endpoint's list, a peer's new
//! description drops the peer's; each is prepared again when next used. Lists are bounded by
//! [`NixlConfig::prepared_list_limit`] (memory beyond it is described per transfer; 0 turns them
//! off). Either kind of request is cut at [`NixlConfig::max_request_descriptors`], the
//! notification riding on the last.
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

mod address;
mod config;
mod notify;
pub mod runtime;
mod transfer;
mod transport;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::RegionDesc;
use nixl_sys as sys;

use crate::desc::{EndpointDesc, MAX_ADDRESS_LEN};
use crate::error::BackendError;
use crate::peers::PeerTable;
use crate::region::LocalRegion;
use crate::transport::{Event, PeerId};
use crate::wake::WakeSignal;
use address::{decode_address, default_agent_name, encode_address};
pub use config::{
    ucx_net_devices_for, NixlConfig, OpenError, DEFAULT_MAX_REQUEST_DESCRIPTORS,
    DEFAULT_PREPARED_LIST_LIMIT, UCX_NET_DEVICES,
};
pub use runtime::RuntimeError;
use transfer::{Pending, Prepared};
#[cfg(doc)]
use {
    crate::error::{ConnectError, OpError, ReadError, WriteError},
    crate::transport::{Transport, Waker},
    kvx_layout::CopyOp,
};

/// Backend name of NIXL endpoints.
pub const BACKEND: &str = "nixl";
/// NIXL's UCX plugin.
pub const PLUGIN_UCX: &str = "UCX";
/// Environment variable naming the directory that holds `libnixl_capi.so` (what
/// `cargo xtask test` sets), from which binaries and tests fill [`NixlConfig::library`].
pub const LIB_DIR_ENV: &str = "KVX_NIXL_LIB_DIR";

/// Longest control message.
const MAX_MESSAGE: usize = 4096;
/// Shortest sleep between polls of a waiting thread.
const MIN_IDLE_SLEEP: Duration = Duration::from_micros(50);
/// Fewest pieces in a transfer that prepares this endpoint's descriptor list (a smaller first
/// transfer does not choose the list's unit).
const PREPARE_FROM_PIECES: u64 = 32;
/// How long dropping a transport waits for its transfers in flight before it leaks them (and the
/// memory they use) rather than free memory a transfer may still touch.
const DROP_GRACE: Duration = Duration::from_secs(2);

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

/// The network devices `config` gives UCX: its rails, else the `NET_DEVICES` of its
/// `engine_config` (an interface name), else none (UCX's own choice).
/// `config` with its rails' devices ([`NixlConfig::net_devices`]) in the backend parameters
/// (never through the process environment): one device as `NET_DEVICES` in `engine_config`,
/// which a `UCX_NET_DEVICES` the user exported overrides, as every `UCX_*` variable does;
/// several as NIXL's `device_list` (names, each on port 1, which NIXL adds), because NIXL cuts
/// `engine_config` at every comma and a list there would keep its first device only. NIXL sets
/// `device_list` over the environment's value. An `engine_config` that names `NET_DEVICES`
/// itself wins over both.
///
/// # Errors
/// [`OpenError::Config`] for several devices of which one is on a port other than 1, which
/// NIXL cannot be given.
fn with_devices_applied(config: &NixlConfig) -> Result<NixlConfig, OpenError> {
    let Some(devices) = config.net_devices.as_deref().filter(|d| !d.is_empty()) else {
        return Ok(config.clone());
    };
    if config.engine_sets("NET_DEVICES") || !devices.contains(',') {
        return Ok(config.clone().with_engine_setting("NET_DEVICES", devices));
    }
    let names = devices
        .split(',')
        .map(|d| match d.split_once(':') {
            None => Ok(d),
            Some((name, "1")) => Ok(name),
            Some(_) => Err(OpenError::Config(format!(
                "UCX devices {devices}: NIXL takes several devices only on port 1"
            ))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(config.clone().with_param("device_list", &names.join(", ")))
}

fn net_devices(config: &NixlConfig) -> Vec<String> {
    if let Some(devices) = &config.net_devices {
        return devices.split(',').map(str::to_owned).collect();
    }
    config
        .backend_params
        .iter()
        .filter_map(|(_, v)| v.split_once("NET_DEVICES=").map(|(_, d)| d))
        .map(|d| d.split(',').next().unwrap_or_default().to_owned())
        .filter(|d| !d.is_empty())
        .collect()
}

/// A NIXL endpoint implementing [`Transport`].
pub struct NixlTransport {
    // Field order is drop order: transfer requests are released before the registrations, and
    // the registrations before the memory they cover (inside `Registration`); the agent goes
    // last (the requests and registrations also keep it alive). Prepared lists point into the
    // agent without keeping it alive: they go before it.
    pending: BTreeMap<u64, Pending>,
    /// This endpoint's prepared descriptor list (see [`Prepared`]); dropped whenever the
    /// registrations change.
    prepared_local: Option<Prepared>,
    /// Each peer's prepared list, in the unit of `prepared_local`; dropped when the peer's
    /// metadata is loaded again or released.
    prepared_remote: HashMap<PeerId, Prepared>,
    regions: HashMap<u32, Registration>,
    agent: sys::Agent,
    name: String,
    plugin: String,
    /// UCX's network devices, as configured (`NET_DEVICES`).
    rails: Vec<String>,
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
    /// [`NixlConfig::prepared_list_limit`] (0 once preparing failed).
    prepared_limit: usize,
    max_request_descriptors: usize,
    prepared_transfers: u64,
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
            plugin_file: runtime::plugin_file(&config.plugin),
            source,
        };
        let config = &with_devices_applied(config)?;
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
            prepared_local: None,
            prepared_remote: HashMap::new(),
            regions: HashMap::new(),
            address: encode_address(&name, &metadata),
            agent,
            name,
            plugin: config.plugin.clone(),
            rails: net_devices(config),
            peers: PeerTable::default(),
            op_timeout: config.op_timeout,
            next_op: 0,
            events: VecDeque::new(),
            foreign: 0,
            idle_sleep: MIN_IDLE_SLEEP,
            max_idle_sleep: config.max_idle_sleep.max(MIN_IDLE_SLEEP),
            wake: Arc::new(WakeSignal::new().map_err(OpenError::Wake)?),
            prepared_limit: config.prepared_list_limit,
            max_request_descriptors: config.max_request_descriptors,
            prepared_transfers: 0,
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

    /// Forgets a disconnected peer (NIXL drops its metadata and connection) once no transfer
    /// of its is pending.
    fn release_if_idle(&mut self, peer: PeerId) {
        let in_flight = self.pending.values().any(|p| p.peer == peer);
        let Some(gone) = self.peers.release(peer, in_flight) else {
            return;
        };
        self.prepared_remote.remove(&peer);
        // The same agent connected again under another id keeps its metadata.
        if self.peers.find(|p| p.name == gone.name).is_none() {
            // A peer whose metadata cannot be invalidated stays loaded in the agent: nothing
            // of kvx's refers to it any more.
            let _ = self.agent.invalidate_remote_md(&gone.name);
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
            std::mem::forget(p.requests);
        }
    }
}

#[cfg(test)]
mod tests;
