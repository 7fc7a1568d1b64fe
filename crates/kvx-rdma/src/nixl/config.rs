//! How a NIXL endpoint is opened ([`NixlConfig`]: plugin, backend parameters, UCX devices and
//! timeouts) and what opening it can fail with ([`OpenError`]).

use std::ffi::OsStr;
use std::path::PathBuf;
use std::time::Duration;

use nixl_sys as sys;

use super::{RuntimeError, PLUGIN_UCX};
use crate::topology::{PciAddress, Topology};
#[cfg(doc)]
use {super::LIB_DIR_ENV, crate::error::OpError, crate::transport::Transport};

/// Default longest such sleep ([`NixlConfig::max_idle_sleep`]).
const MAX_IDLE_SLEEP: Duration = Duration::from_micros(200);
/// Default most descriptors in one prepared list ([`NixlConfig::prepared_list_limit`]): 64 GiB of
/// registered memory in 4 KiB units.
pub const DEFAULT_PREPARED_LIST_LIMIT: usize = 1 << 24;
/// Default most descriptors in one NIXL request ([`NixlConfig::max_request_descriptors`]).
pub const DEFAULT_MAX_REQUEST_DESCRIPTORS: usize = 1 << 14;

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
    /// [`NixlConfig::with_rails_of`]: given to UCX when the endpoint opens, unless
    /// `engine_config` names devices itself: one device as `NET_DEVICES` in `engine_config` (a
    /// `UCX_NET_DEVICES` the user exported wins), several as NIXL's `device_list` (each on port
    /// 1; NIXL sets it over the environment's value, so a caller that honours the user's
    /// `UCX_NET_DEVICES` leaves this `None`). `None`: UCX's own choice.
    pub net_devices: Option<String>,
    /// Most descriptors in one *prepared* descriptor list (0: none are prepared). A transfer's
    /// operations name their pieces by index in lists NIXL prepared once (`prepXferDlist`) over
    /// all registered memory of each side, cut into the unit the transfers' pieces share, rather
    /// than NIXL looking every piece up in the registrations per transfer (see the module
    /// documentation). NIXL keeps about 32 bytes per descriptor, for the local side and for each
    /// peer written to: the default ([`DEFAULT_PREPARED_LIST_LIMIT`], 16 Mi) covers 64 GiB of
    /// 4 KiB units in about 512 MiB.
    pub prepared_list_limit: usize,
    /// Most descriptors in one NIXL transfer request: a transfer of more is posted as several
    /// requests in a row (the last carrying the notification). UCX's CUDA path has been seen
    /// aborting the *target* process of a read of about 100,000 descriptors in one request
    /// (`nixl-cu12` 1.5.1, H100).
    pub max_request_descriptors: usize,
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
            prepared_list_limit: DEFAULT_PREPARED_LIST_LIMIT,
            max_request_descriptors: DEFAULT_MAX_REQUEST_DESCRIPTORS,
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
        if self.engine_sets(key) {
            return self;
        }
        let value = match self
            .backend_params
            .iter()
            .find(|(k, _)| k == "engine_config")
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
        {
            Some(v) => format!("{v},{key}={value}"),
            None => format!("{key}={value}"),
        };
        self.with_param("engine_config", &value)
    }

    /// Whether `engine_config` sets the UCX setting `key` (with or without the `UCX_` prefix).
    #[must_use]
    pub fn engine_sets(&self, key: &str) -> bool {
        let prefix = format!("{key}=");
        self.backend_params
            .iter()
            .filter(|(k, _)| k == "engine_config")
            .flat_map(|(_, v)| v.split(','))
            .any(|kv| kv.trim().trim_start_matches("UCX_").starts_with(&prefix))
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
    /// Creating the backend failed (plugin not found or not loadable, bad parameters).
    #[error(
        "creating the NIXL {plugin} backend failed (NIXL loads it from {plugin_file}: where that \
         exists, `ldd` on it shows what it lacks)"
    )]
    Backend {
        /// Plugin.
        plugin: String,
        /// Where the runtime looks for the plugin (`plugins/libplugin_<NAME>.so` beside the
        /// runtime).
        plugin_file: String,
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
