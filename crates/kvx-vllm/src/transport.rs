//! Choosing and opening a transport by name: `libfabric:shm` (the default: one machine),
//! `libfabric:tcp` (on the interface its peers reach it by, or a named one: `libfabric:tcp@IFACE`;
//! see [`OpenOptions`]), `libfabric:auto` (EFA where present, else
//! TCP), `libfabric:<provider>`, or `loopback` (in-process only, for tests and demos). A libfabric
//! name may end in `,rails=N`: that many endpoints on the domain, large transfers striped over
//! them (on `shm`, posted from one thread per rail, so that the copies run in parallel).

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::OnceLock;

use kvx_rdma::loopback::LoopbackFabric;
#[cfg(any(feature = "libfabric", feature = "nixl"))]
use kvx_rdma::topology::Topology;
use kvx_rdma::topology::{PciAddress, RailOverrides, TopologyError};
use kvx_rdma::transport::Transport;

/// A transport choice.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportSpec {
    /// In-process loopback (one process-wide fabric).
    Loopback,
    /// libfabric with this provider (`shm`, `tcp;ofi_rxm`, `efa`, or `auto`) and optional
    /// domain (interface).
    Libfabric {
        /// Provider name, or `auto`.
        provider: String,
        /// Domain, e.g. `lo`.
        domain: Option<String>,
        /// Endpoints (rails) to open on the domain; 1 unless the name says `,rails=N`.
        rails: usize,
    },
    /// Cross-memory attach between processes of one host (host memory; one-sided).
    Cma,
    /// CUDA IPC between processes of one host, registering memory of this CUDA device.
    CudaIpc {
        /// CUDA device ordinal.
        device: u32,
    },
    /// NIXL, through one of its backend plugins: host or CUDA memory, within a host or across
    /// hosts (UCX picks its transports: RDMA NICs, TCP, CUDA IPC within a host).
    Nixl {
        /// The plugin, as NIXL names it (`UCX`, `LIBFABRIC`).
        plugin: String,
        /// The network interface for UCX (`NET_DEVICES`); `None`: chosen like `libfabric:tcp`'s
        /// on hosts without RDMA NICs, UCX's own choice elsewhere.
        interface: Option<String>,
    },
}

/// NIXL's plugins that `nixl:NAME` may name: (NAME, the plugin as NIXL calls it).
pub const NIXL_PLUGINS: &[(&str, &str)] = &[("ucx", "UCX"), ("libfabric", "LIBFABRIC")];

impl Default for TransportSpec {
    fn default() -> Self {
        Self::Libfabric {
            provider: "shm".into(),
            domain: None,
            rails: 1,
        }
    }
}

impl fmt::Display for TransportSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Loopback => f.write_str("loopback"),
            Self::Cma => f.write_str("cma"),
            Self::CudaIpc { device } => write!(f, "cuda-ipc:{device}"),
            Self::Nixl { plugin, interface } => {
                let name = NIXL_PLUGINS
                    .iter()
                    .find(|(_, p)| p == plugin)
                    .map_or(plugin.as_str(), |(n, _)| n);
                write!(f, "nixl:{name}")?;
                match interface {
                    Some(i) => write!(f, "@{i}"),
                    None => Ok(()),
                }
            }
            Self::Libfabric {
                provider,
                domain,
                rails,
            } => {
                let short = if provider == "tcp;ofi_rxm" {
                    "tcp"
                } else {
                    provider
                };
                match domain {
                    Some(d) => write!(f, "libfabric:{short}@{d}")?,
                    None => write!(f, "libfabric:{short}")?,
                }
                if *rails != 1 {
                    write!(f, ",rails={rails}")?;
                }
                Ok(())
            }
        }
    }
}

/// Most rails a transport name may ask for.
const MAX_NAMED_RAILS: usize = 64;

/// A transport name that is not understood, or a transport that could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// Unknown name.
    #[error("unknown transport `{0}` (loopback, libfabric:shm, libfabric:tcp[@IFACE], libfabric:auto, libfabric:PROVIDER, each optionally with `,rails=N`; cma, cuda-ipc[:DEVICE], nixl[:ucx|:libfabric][@IFACE])")]
    Unknown(String),
    /// `nixl:NAME` with a plugin kvx does not know.
    #[error("unknown NIXL plugin `{0}` in the transport name (nixl:ucx, nixl:libfabric)")]
    UnknownNixlPlugin(String),
    /// The host's topology cannot be read, or the rail overrides name what it lacks.
    #[error("cannot choose the rails: {0}")]
    Rails(#[source] TopologyError),
    /// This build has no NIXL support.
    #[error("this build has no NIXL support (feature `nixl` of kvx-vllm)")]
    NoNixl,
    /// This build has no libfabric.
    #[error("this build has no libfabric support (feature `libfabric`)")]
    NoLibfabric,
    /// This build has no CMA support.
    #[error("this build has no CMA support (feature `cma`)")]
    NoCma,
    /// This build has no CUDA support.
    #[error("this build has no CUDA support (feature `cuda`)")]
    NoCuda,
    /// Opening the endpoint failed (the message carries every cause, for callers that show
    /// only the top line, as Python exceptions do).
    #[error("cannot open the {spec} transport: {}", causes(source.as_ref()))]
    Open {
        /// What was asked for.
        spec: String,
        /// Why it failed.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// `error` and its sources, as `a: b: c`.
fn causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

impl FromStr for TransportSpec {
    type Err = TransportError;

    fn from_str(s: &str) -> Result<Self, TransportError> {
        if s == "loopback" {
            return Ok(Self::Loopback);
        }
        if s == "cma" {
            return Ok(Self::Cma);
        }
        if let Some(rest) = s.strip_prefix("cuda-ipc") {
            let device = match rest.strip_prefix(':') {
                None if rest.is_empty() => 0,
                Some(n) => n.parse().map_err(|_| TransportError::Unknown(s.into()))?,
                None => return Err(TransportError::Unknown(s.into())),
            };
            return Ok(TransportSpec::CudaIpc { device });
        }
        if let Some(rest) = s.strip_prefix("nixl") {
            let (rest, interface) = match rest.split_once('@') {
                Some((_, "")) => return Err(TransportError::Unknown(s.into())),
                Some((r, i)) => (r, Some(i.to_owned())),
                None => (rest, None),
            };
            let plugin = match rest.strip_prefix(':') {
                None if rest.is_empty() => "UCX",
                Some(name) => NIXL_PLUGINS
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, p)| *p)
                    .ok_or_else(|| TransportError::UnknownNixlPlugin(name.into()))?,
                None => return Err(TransportError::Unknown(s.into())),
            };
            return Ok(Self::Nixl {
                plugin: plugin.into(),
                interface,
            });
        }
        let (name, rails) = match s.split_once(",rails=") {
            Some((name, n)) => match n.parse::<usize>() {
                Ok(n) if (1..=MAX_NAMED_RAILS).contains(&n) => (name, n),
                _ => return Err(TransportError::Unknown(s.into())),
            },
            None => (s, 1),
        };
        let s = name;
        let rest = s.strip_prefix("libfabric:").unwrap_or(s);
        let (provider, domain) = match rest.split_once('@') {
            Some((p, d)) => (p, Some(d.to_owned())),
            None => (rest, None),
        };
        let provider = match provider {
            "shm" => "shm",
            "tcp" | "tcp;ofi_rxm" => "tcp;ofi_rxm",
            "efa" => "efa",
            "auto" => "auto",
            "" => return Err(TransportError::Unknown(s.into())),
            other if s.starts_with("libfabric:") => other,
            _ => return Err(TransportError::Unknown(s.into())),
        };
        Ok(Self::Libfabric {
            provider: provider.into(),
            domain,
            rails,
        })
    }
}

/// A `transport` setting that cannot move the KV cache's memory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheTransportError {
    /// A CUDA transport for a host cache.
    #[error("kvx: the KV cache is in host memory but the transport is {setting:?}, which moves CUDA memory; use a host transport such as libfabric:shm{FIX}")]
    CudaForHost {
        /// The setting.
        setting: String,
    },
    /// `cuda-ipc:N` for a cache on another device.
    #[error("kvx: the KV cache is on CUDA device {device} but the transport is {setting:?}; use cuda-ipc:{device} or cuda-ipc{FIX}")]
    OtherDevice {
        /// The setting.
        setting: String,
        /// The cache's device.
        device: u32,
    },
    /// A host transport for a CUDA cache.
    #[error("kvx: the KV cache is on CUDA device {device} but the transport {setting:?} moves host memory; use cuda-ipc (one host), nixl, or libfabric with a provider that offers device memory{FIX}")]
    HostForCuda {
        /// The setting.
        setting: String,
        /// The cache's device.
        device: u32,
    },
    /// Not a transport name.
    #[error("{0}{FIX}")]
    Unknown(#[from] TransportError),
}

/// Where a refused `transport` setting is fixed.
const FIX: &str = " (kv_connector_extra_config key 'transport'; 'auto' follows the cache)";

/// The transport to open for a KV cache in host memory (`cuda_device` `None`) or on CUDA device
/// `cuda_device`, from the `transport` setting: `auto` follows the cache (`libfabric:shm` for a
/// host cache, `cuda-ipc:N` for one on device N), `cuda-ipc` without a device takes the cache's,
/// and a setting that cannot move the cache's memory is refused with the fix in the message.
///
/// # Errors
/// [`CacheTransportError`] as above, or for a name that is not a transport.
pub fn resolve_for_cache(
    setting: &str,
    cuda_device: Option<u32>,
) -> Result<String, CacheTransportError> {
    if setting == "auto" {
        return Ok(
            cuda_device.map_or_else(|| "libfabric:shm".to_owned(), |d| format!("cuda-ipc:{d}"))
        );
    }
    let spec: TransportSpec = setting.parse()?;
    match (spec, cuda_device) {
        (TransportSpec::CudaIpc { .. }, None) => Err(CacheTransportError::CudaForHost {
            setting: setting.into(),
        }),
        (TransportSpec::CudaIpc { device: named }, Some(device)) => {
            if setting.contains(':') && named != device {
                Err(CacheTransportError::OtherDevice {
                    setting: setting.into(),
                    device,
                })
            } else {
                Ok(format!("cuda-ipc:{device}"))
            }
        }
        // NIXL registers either memory (DRAM or VRAM); libfabric a CUDA cache where its
        // provider offers device memory (`FI_HMEM`), which opening it checks.
        (TransportSpec::Nixl { .. } | TransportSpec::Libfabric { .. }, _) => Ok(setting.to_owned()),
        (_, Some(device)) => Err(CacheTransportError::HostForCuda {
            setting: setting.into(),
            device,
        }),
        (_, None) => Ok(setting.to_owned()),
    }
}

/// Whether the peers of a transport of `backend` copy into and out of this process by
/// cross-memory attach, and so need leave to attach to it (`local_peer::TracerLeave`).
pub(crate) fn peers_attach(backend: &str) -> bool {
    #[cfg(feature = "cma")]
    {
        backend == kvx_rdma::cma::BACKEND
    }
    #[cfg(not(feature = "cma"))]
    {
        let _ = backend;
        false
    }
}

/// The process-wide loopback fabric.
pub fn loopback_fabric() -> &'static LoopbackFabric {
    static FABRIC: OnceLock<LoopbackFabric> = OnceLock::new();
    FABRIC.get_or_init(LoopbackFabric::new)
}

/// How to open a [`TransportSpec`], beyond its name: settings that a binary takes from its
/// operator (the `kvx` binary and the vLLM plugin from the environment; this crate reads none).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpenOptions {
    /// libfabric `shm`: remove the regions that killed processes of this user left in
    /// `/dev/shm` before opening (`LibfabricConfig::sweep_stale_shm`; off by default).
    pub sweep_stale_shm: bool,
    /// An address of this host at which its peers reach it (its control `listen` address): a
    /// `tcp` endpoint without a named interface opens on the interface that carries it.
    pub local_addr: Option<IpAddr>,
    /// A peer's address (decode: prefill's): without [`OpenOptions::local_addr`], a `tcp`
    /// endpoint without a named interface opens on the interface the route to it leaves by.
    pub peer_addr: Option<IpAddr>,
    /// NIXL: `libnixl_capi.so` or the directory that holds it (the binaries take it from
    /// `KVX_NIXL_LIB_DIR`); `None`: the dynamic loader's search path.
    pub nixl_library: Option<std::path::PathBuf>,
    /// The CUDA device that holds the KV cache (`None`: host memory): NIXL registers `VRAM`,
    /// and the rails are those of this GPU (its PCI address from the CUDA driver, unless
    /// [`OpenOptions::accelerator`] names it).
    pub cuda_device: Option<u32>,
    /// The PCI address of the accelerator that owns the cache, where the caller knows it
    /// (tests on a fake sysfs; other accelerators).
    pub accelerator: Option<PciAddress>,
    /// Explicit rails (the `rails` setting, `kvx pd --rails`: `GPU=NIC,NIC;…`, as `kvx topo
    /// --override`): they win over the topology's rule for the GPUs they name.
    pub rail_overrides: RailOverrides,
    /// Where sysfs is; `None`: `/sys`.
    pub sysfs_root: Option<std::path::PathBuf>,
    /// The operator exported `UCX_NET_DEVICES` (the binaries look; this crate reads no
    /// environment): NIXL's UCX then opens the devices it names, and kvx names none (no rails,
    /// no interface).
    pub ucx_net_devices_exported: bool,
}

impl OpenOptions {
    /// The options an operator asks for in the environment, read through `var` (the `kvx`
    /// binary and the vLLM plugin pass `std::env::var_os`; this crate reads none):
    /// [`SHM_SWEEP_ENV`] `1` sweeps stale `shm` regions, [`NIXL_LIB_DIR_ENV`] names the NIXL
    /// runtime, an exported [`UCX_NET_DEVICES_ENV`] names UCX's devices instead of kvx's rails.
    #[must_use]
    pub fn from_environment(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Self {
        Self {
            sweep_stale_shm: var(SHM_SWEEP_ENV).is_some_and(|v| v == "1"),
            nixl_library: var(NIXL_LIB_DIR_ENV).map(Into::into),
            ucx_net_devices_exported: var(UCX_NET_DEVICES_ENV).is_some_and(|v| !v.is_empty()),
            ..Self::default()
        }
    }

    /// These options, for an instance whose peers reach it at `local` (its `listen` address).
    #[must_use]
    pub fn reached_at(mut self, local: IpAddr) -> Self {
        self.local_addr = Some(local);
        self
    }

    /// These options, with the NIXL runtime at `library` (a file or its directory).
    #[must_use]
    pub fn with_nixl_library(mut self, library: Option<std::path::PathBuf>) -> Self {
        self.nixl_library = library;
        self
    }

    /// These options, for a KV cache on CUDA device `cuda_device` (`None`: host memory).
    #[must_use]
    pub fn for_cuda_device(mut self, cuda_device: Option<u32>) -> Self {
        self.cuda_device = cuda_device;
        self
    }

    /// These options, where the operator exported `UCX_NET_DEVICES` (`exported`) or not.
    #[must_use]
    pub fn with_ucx_net_devices_exported(mut self, exported: bool) -> Self {
        self.ucx_net_devices_exported = exported;
        self
    }

    /// These options, with explicit rails for the GPUs `overrides` names.
    #[must_use]
    pub fn with_rail_overrides(mut self, overrides: RailOverrides) -> Self {
        self.rail_overrides = overrides;
        self
    }

    /// These options, for an instance with a peer at `peer`.
    #[must_use]
    pub fn with_peer(mut self, peer: IpAddr) -> Self {
        self.peer_addr = Some(peer);
        self
    }
}

/// The rail overrides of a `rails` setting (`GPU=NIC,NIC;…`), or, where it is empty, of
/// `env_value`: the value of `KVX_RAILS` (`RailOverrides::ENV_VAR`) that the caller took from its
/// environment (the `kvx` binary and the vLLM plugin; this crate reads none).
///
/// # Errors
/// A malformed mapping, naming the entry.
pub fn rail_overrides(
    setting: &str,
    env_value: Option<std::ffi::OsString>,
) -> Result<RailOverrides, kvx_rdma::topology::RailSpecError> {
    if setting.trim().is_empty() {
        RailOverrides::from_env_value(env_value)
    } else {
        setting.parse()
    }
}

/// The environment variable naming the directory of the NIXL runtime (`libnixl_capi.so`) for
/// [`OpenOptions::nixl_library`] in the `kvx` binary and the vLLM plugin.
pub const NIXL_LIB_DIR_ENV: &str = "KVX_NIXL_LIB_DIR";

/// The environment variable whose value `1` turns on [`OpenOptions::sweep_stale_shm`] in the
/// `kvx` binary and the vLLM plugin.
pub const SHM_SWEEP_ENV: &str = "KVX_SHM_SWEEP";

/// UCX's variable for its network devices: where the operator exported it (non-empty), the
/// `kvx` binary and the vLLM plugin set [`OpenOptions::ucx_net_devices_exported`].
pub const UCX_NET_DEVICES_ENV: &str = "UCX_NET_DEVICES";

/// Loads the libfabric library the operator names in
/// [`LIBRARY_ENV`](kvx_rdma::libfabric::LIBRARY_ENV), read through `var` as in
/// [`OpenOptions::from_environment`] (before the first libfabric transport opens).
#[cfg(feature = "libfabric")]
pub fn choose_libfabric(var: impl Fn(&str) -> Option<std::ffi::OsString>) {
    if let Some(library) = var(kvx_rdma::libfabric::LIBRARY_ENV).filter(|l| !l.is_empty()) {
        kvx_rdma::libfabric::choose_library(library.to_string_lossy());
    }
}

impl TransportSpec {
    /// Opens an endpoint with the default [`OpenOptions`].
    ///
    /// # Errors
    /// [`TransportError`] when the backend is missing or the endpoint cannot be opened.
    pub fn open(&self) -> Result<Box<dyn Transport>, TransportError> {
        self.open_with(&OpenOptions::default())
    }

    /// Opens an endpoint.
    ///
    /// # Errors
    /// [`TransportError`] when the backend is missing or the endpoint cannot be opened.
    #[cfg_attr(
        not(any(feature = "libfabric", feature = "nixl")),
        allow(unused_variables)
    )]
    pub fn open_with(&self, options: &OpenOptions) -> Result<Box<dyn Transport>, TransportError> {
        match self {
            Self::Loopback => Ok(Box::new(loopback_fabric().endpoint())),
            #[cfg(feature = "libfabric")]
            Self::Libfabric { .. } => {
                let (config, _) = self.libfabric_config(options)?;
                self.opened(kvx_rdma::libfabric::LibfabricTransport::open(&config))
            }
            #[cfg(not(feature = "libfabric"))]
            Self::Libfabric { .. } => Err(TransportError::NoLibfabric),
            #[cfg(feature = "cma")]
            Self::Cma => {
                use kvx_rdma::cma::{CmaConfig, CmaTransport};
                self.opened(CmaTransport::open(CmaConfig::default()))
            }
            #[cfg(not(feature = "cma"))]
            Self::Cma => Err(TransportError::NoCma),
            #[cfg(feature = "cuda")]
            Self::CudaIpc { device } => {
                use kvx_rdma::cuda::ipc::{CudaIpcConfig, CudaIpcTransport};
                self.opened(CudaIpcTransport::open(CudaIpcConfig::new(*device)))
            }
            #[cfg(not(feature = "cuda"))]
            Self::CudaIpc { .. } => Err(TransportError::NoCuda),
            #[cfg(feature = "nixl")]
            Self::Nixl { .. } => {
                let config = self.nixl_config(options)?;
                self.opened(kvx_rdma::nixl::NixlTransport::open(&config))
            }
            #[cfg(not(feature = "nixl"))]
            Self::Nixl { .. } => Err(TransportError::NoNixl),
        }
    }
}

impl TransportSpec {
    /// `opened` as the connector's transport, or the error of opening it, naming this spec.
    #[cfg_attr(
        not(any(
            feature = "libfabric",
            feature = "nixl",
            feature = "cma",
            feature = "cuda"
        )),
        allow(dead_code)
    )]
    fn opened<T: Transport + 'static, E: std::error::Error + Send + Sync + 'static>(
        &self,
        opened: Result<T, E>,
    ) -> Result<Box<dyn Transport>, TransportError> {
        opened
            .map(|t| Box::new(t) as Box<dyn Transport>)
            .map_err(|e| TransportError::Open {
                spec: self.to_string(),
                source: Box::new(e),
            })
    }
}

#[cfg(feature = "libfabric")]
impl TransportSpec {
    /// How a `libfabric:…` endpoint opens under `options`: the provider (`auto`: EFA where
    /// present, else TCP), and its domains: the named one; for `tcp`, the interface its peers
    /// reach; for a provider with a domain per NIC (`efa`, `verbs`), the rails of the cache's
    /// GPU (the topology's rule, or `options`' overrides), with the selection that chose them.
    ///
    /// # Errors
    /// [`TransportError::Unknown`] for another transport; [`TransportError::Rails`] for rail
    /// overrides this host cannot honour; [`TransportError::Open`] when no interface fits.
    pub fn libfabric_config(
        &self,
        options: &OpenOptions,
    ) -> Result<
        (
            kvx_rdma::libfabric::LibfabricConfig,
            Option<kvx_rdma::libfabric::RailSelection>,
        ),
        TransportError,
    > {
        use kvx_rdma::libfabric::{LibfabricConfig, Rails, PROVIDER_SHM, PROVIDER_TCP};
        let Self::Libfabric {
            provider,
            domain,
            rails,
        } = self
        else {
            return Err(TransportError::Unknown(self.to_string()));
        };
        let mut config = if provider == "auto" {
            LibfabricConfig::auto()
        } else {
            LibfabricConfig::new(provider.clone())
        };
        let mut selection = None;
        let per_nic = ![PROVIDER_TCP, PROVIDER_SHM].contains(&config.provider.as_str());
        if domain.is_some() {
            config.domain.clone_from(domain);
        } else if config.provider == PROVIDER_TCP {
            config.domain = Some(tcp_interface(self, options)?.interface);
        } else if per_nic && *rails == 1 {
            if let Some((topology, gpu)) = host_topology(options)? {
                let (chosen, selected) = config.with_topology(&topology, Some(&gpu));
                log_rails(self, &gpu, &selected.nics, selected.rule, &selected);
                config = chosen;
                selection = Some(selected);
            }
        }
        if *rails > 1 {
            config = config.with_rails(Rails::Count(*rails));
        }
        config.sweep_stale_shm = options.sweep_stale_shm;
        config.device_memory = options.cuda_device.is_some();
        Ok((config, selection))
    }
}

#[cfg(feature = "nixl")]
impl TransportSpec {
    /// How a `nixl` endpoint opens under `options`: the plugin, the runtime, `VRAM` for a CUDA
    /// cache, and UCX's network devices: the named interface; else the rails of the cache's
    /// GPU (the topology's rule, or `options`' overrides); else, on a host without RDMA NICs,
    /// the interface its peers reach (as `libfabric:tcp`); else UCX's own choice.
    ///
    /// # Errors
    /// [`TransportError::Unknown`] for another transport; [`TransportError::Rails`] for rail
    /// overrides this host cannot honour; [`TransportError::Open`] when no interface fits.
    pub fn nixl_config(
        &self,
        options: &OpenOptions,
    ) -> Result<kvx_rdma::nixl::NixlConfig, TransportError> {
        use kvx_rdma::nixl::{NixlConfig, PLUGIN_UCX};
        let Self::Nixl { plugin, interface } = self else {
            return Err(TransportError::Unknown(self.to_string()));
        };
        let mut config = NixlConfig::ucx();
        config.plugin.clone_from(plugin);
        config.library.clone_from(&options.nixl_library);
        if options.cuda_device.is_some() {
            config = config.with_device_memory();
        }
        if plugin != PLUGIN_UCX {
            return Ok(config);
        }
        if let Some(interface) = interface {
            return Ok(config.with_engine_setting("NET_DEVICES", interface));
        }
        if options.ucx_net_devices_exported {
            tracing::info!(transport = %self, "kvx: UCX opens the devices of UCX_NET_DEVICES");
            return Ok(config);
        }
        let topology = host_topology(options)?;
        if let Some((topology, gpu)) = &topology {
            if let Some(choice) = topology.rails_for(gpu).filter(|c| !c.rails.is_empty()) {
                log_rails(self, gpu, &choice.rails, Some(choice.rule), &());
                return Ok(config.with_rails_of(topology, gpu));
            }
        }
        let root = options.sysfs_root.as_deref().unwrap_or("/sys".as_ref());
        let no_rdma_nics = match topology {
            Some((topology, _)) => topology.rdma_nics().is_empty(),
            None => Topology::from_sysfs(root).map_or(true, |t| t.rdma_nics().is_empty()),
        };
        if no_rdma_nics {
            // Where nothing is known of the peers, UCX keeps all interfaces and pairs them by
            // reachability (a decode of this host then reaches a prefill that listens on
            // loopback: UCX pairs loopback only with loopback, and `engine_config` cannot name
            // two devices).
            let choice = tcp_interface(self, options)?;
            match ucx_tcp_devices(&choice.interface, choice.rule) {
                Some(devices) => config = config.with_engine_setting("NET_DEVICES", &devices),
                None => tracing::info!(
                    transport = %self,
                    "kvx: UCX keeps every interface (nothing is known of the peers; it pairs \
                     them by reachability)"
                ),
            }
        }
        Ok(config)
    }
}

/// The host's topology (overrides applied) and the PCI address of the GPU that holds the cache;
/// `None` for a host cache without overrides to check, or where sysfs is unreadable (logged:
/// the transport then opens its default devices).
///
/// # Errors
/// [`TransportError::Rails`] when the overrides name a GPU or NIC this host lacks.
#[cfg(any(feature = "libfabric", feature = "nixl"))]
fn host_topology(options: &OpenOptions) -> Result<Option<(Topology, PciAddress)>, TransportError> {
    let gpu = options
        .accelerator
        .or_else(|| cuda_pci_address(options.cuda_device));
    if gpu.is_none() && options.rail_overrides.is_empty() {
        return Ok(None);
    }
    let root = options.sysfs_root.as_deref().unwrap_or("/sys".as_ref());
    let topology = match Topology::from_sysfs(root) {
        Ok(t) => t,
        Err(e) if options.rail_overrides.is_empty() => {
            tracing::warn!(error = %e, "kvx: cannot read the host's topology; default rails");
            return Ok(None);
        }
        Err(e) => return Err(TransportError::Rails(e)),
    };
    let topology = topology
        .with_overrides(&options.rail_overrides)
        .map_err(TransportError::Rails)?;
    Ok(gpu.map(|gpu| (topology, gpu)))
}

/// The PCI address of CUDA device `device`, from the driver (`None` without CUDA).
#[cfg(any(feature = "libfabric", feature = "nixl"))]
fn cuda_pci_address(device: Option<u32>) -> Option<PciAddress> {
    #[cfg(feature = "cuda")]
    if let Some(device) = device {
        return match kvx_rdma::cuda::Gpu::open(device) {
            Ok(gpu) => gpu.pci_address().parse().ok(),
            Err(e) => {
                tracing::warn!(device, error = %e, "kvx: no PCI address for the cache's GPU");
                None
            }
        };
    }
    let _ = device;
    None
}

/// Logs, once per endpoint, the rails chosen for the cache's GPU.
#[cfg(any(feature = "libfabric", feature = "nixl"))]
fn log_rails(
    spec: &TransportSpec,
    gpu: &PciAddress,
    nics: &[String],
    rule: Option<kvx_rdma::topology::RailRule>,
    detail: &dyn std::fmt::Debug,
) {
    tracing::info!(
        transport = %spec,
        gpu = %gpu,
        nics = %nics.join(","),
        rule = ?rule,
        detail = ?detail,
        "kvx: rails chosen"
    );
}

/// The network interface a TCP endpoint (libfabric `tcp`, NIXL over UCX's `tcp`) opens on when
/// its name gives none: where `options` say the peers reach this host
/// (`kvx_rdma::topology::reach`); logged once per endpoint.
#[cfg(any(feature = "libfabric", feature = "nixl"))]
fn tcp_interface(
    spec: &TransportSpec,
    options: &OpenOptions,
) -> Result<kvx_rdma::topology::reach::InterfaceChoice, TransportError> {
    use kvx_rdma::topology::reach::{choose_interface, Reach};
    let reach = match (options.local_addr, options.peer_addr) {
        (Some(local), _) => Reach::local(local),
        (None, Some(peer)) => Reach::peer(peer),
        (None, None) => Reach::default(),
    };
    let choice = choose_interface(reach).map_err(|e| TransportError::Open {
        spec: spec.to_string(),
        source: Box::new(e),
    })?;
    tracing::info!(
        transport = %spec,
        interface = %choice.interface,
        address = %choice.address,
        rule = %choice.rule,
        "kvx: tcp endpoint interface chosen"
    );
    Ok(choice)
}

/// UCX's `NET_DEVICES` for a TCP endpoint on `interface`, chosen by `rule`: that interface,
/// unless the choice is a guess (nothing was known of the peers); then none, and UCX keeps all
/// of them. A guessed interface alone would fail against a peer of this host that listens on
/// loopback (UCX on `lo`): UCX pairs a loopback device only with a loopback device ("local
/// non-loopback remote loopback"), and every transfer between the two would be unreachable.
#[cfg(feature = "nixl")]
fn ucx_tcp_devices(interface: &str, rule: kvx_rdma::topology::reach::ReachRule) -> Option<String> {
    (!rule.is_a_guess()).then(|| interface.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse() {
        assert_eq!(
            "loopback".parse::<TransportSpec>().unwrap(),
            TransportSpec::Loopback
        );
        assert_eq!(
            "libfabric:tcp".parse::<TransportSpec>().unwrap(),
            TransportSpec::Libfabric {
                provider: "tcp;ofi_rxm".into(),
                domain: None,
                rails: 1,
            }
        );
        assert_eq!(
            "libfabric:tcp@eth1".parse::<TransportSpec>().unwrap(),
            TransportSpec::Libfabric {
                provider: "tcp;ofi_rxm".into(),
                domain: Some("eth1".into()),
                rails: 1,
            }
        );
        let two = "libfabric:shm,rails=2".parse::<TransportSpec>().unwrap();
        assert_eq!(
            two,
            TransportSpec::Libfabric {
                provider: "shm".into(),
                domain: None,
                rails: 2,
            }
        );
        assert_eq!(two.to_string(), "libfabric:shm,rails=2");
        assert!("libfabric:shm,rails=0".parse::<TransportSpec>().is_err());
        assert!("libfabric:shm,rails=x".parse::<TransportSpec>().is_err());
        assert_eq!(
            "shm".parse::<TransportSpec>().unwrap().to_string(),
            "libfabric:shm"
        );
        assert_eq!(
            "cuda-ipc:1".parse::<TransportSpec>().unwrap(),
            TransportSpec::CudaIpc { device: 1 }
        );
        assert_eq!(
            "cuda-ipc".parse::<TransportSpec>().unwrap().to_string(),
            "cuda-ipc:0"
        );
        assert!("cuda-ipc:x".parse::<TransportSpec>().is_err());
        assert_eq!("cma".parse::<TransportSpec>().unwrap(), TransportSpec::Cma);
        assert_eq!(TransportSpec::Cma.to_string(), "cma");
        assert!("cuda-ipcx".parse::<TransportSpec>().is_err());
        assert!("carrier-pigeon".parse::<TransportSpec>().is_err());
        assert!("libfabric:".parse::<TransportSpec>().is_err());
        let nixl = "nixl".parse::<TransportSpec>().unwrap();
        assert_eq!(
            nixl,
            TransportSpec::Nixl {
                plugin: "UCX".into(),
                interface: None
            }
        );
        assert_eq!(nixl.to_string(), "nixl:ucx");
        let named = "nixl:libfabric@eth1".parse::<TransportSpec>().unwrap();
        assert_eq!(named.to_string(), "nixl:libfabric@eth1");
        assert!(matches!(
            "nixl:carrier-pigeon".parse::<TransportSpec>(),
            Err(TransportError::UnknownNixlPlugin(p)) if p == "carrier-pigeon"
        ));
        assert!("nixlx".parse::<TransportSpec>().is_err());
        assert!("nixl@".parse::<TransportSpec>().is_err());
    }

    #[cfg(feature = "nixl")]
    #[test]
    fn a_missing_nixl_runtime_says_where_it_looked_and_how_to_install_it() {
        let options = OpenOptions::default().with_nixl_library(Some("/nonexistent/nixl".into()));
        let Err(err) = "nixl".parse::<TransportSpec>().unwrap().open_with(&options) else {
            panic!("a NIXL endpoint opened without a runtime");
        };
        let text = err.to_string();
        for part in [
            "nixl:ucx",
            "/nonexistent/nixl",
            "pip install nixl-cu12",
            NIXL_LIB_DIR_ENV,
        ] {
            assert!(text.contains(part), "{part} missing from: {text}");
        }
    }

    /// Options for a cache on the GPU at `gpu` of the fake host `sysfs`.
    #[cfg(any(feature = "libfabric", feature = "nixl"))]
    fn on_gpu(sysfs: &kvx_testkit::sysfs::FakeSysfs, gpu: &str) -> OpenOptions {
        OpenOptions {
            accelerator: Some(gpu.parse().unwrap()),
            sysfs_root: Some(sysfs.root().to_path_buf()),
            ..OpenOptions::default()
        }
    }

    /// `mlx5_0:1,mlx5_1:1` for `["mlx5_0", "mlx5_1"]`, sorted.
    #[cfg(feature = "nixl")]
    fn ucx_devices(nics: &[String]) -> String {
        let mut nics = nics.to_vec();
        nics.sort();
        kvx_rdma::topology::ucx_net_devices(&nics)
    }

    #[cfg(feature = "nixl")]
    fn sorted_devices(config: &kvx_rdma::nixl::NixlConfig) -> Option<String> {
        config.net_devices.as_ref().map(|d| {
            let mut d: Vec<&str> = d.split(',').collect();
            d.sort_unstable();
            d.join(",")
        })
    }

    /// Every rank's GPU opens NIXL on the NICs behind its own PCIe switch (p5en: two EFA each),
    /// or, where the NICs hang off the CPUs, on its NUMA node's; a named override wins for its
    /// GPU; an override naming a NIC the host lacks is a start-up error that names it.
    #[cfg(feature = "nixl")]
    #[test]
    fn nixl_opens_on_the_rails_of_each_ranks_gpu() {
        let nixl: TransportSpec = "nixl".parse().unwrap();
        let (sysfs, gpus) = kvx_testkit::sysfs::p5en();
        for (gpu, nics) in &gpus {
            let config = nixl.nixl_config(&on_gpu(&sysfs, gpu)).unwrap();
            assert_eq!(sorted_devices(&config), Some(ucx_devices(nics)), "{gpu}");
        }
        // NICs on the CPUs' root complexes: each GPU gets NICs of its own NUMA node, and the
        // node's GPUs share all of them out.
        let (sysfs, gpus) = kvx_testkit::sysfs::numa_host();
        let mut used = std::collections::BTreeMap::<String, Vec<String>>::new();
        for (gpu, nics) in &gpus {
            let config = nixl.nixl_config(&on_gpu(&sysfs, gpu)).unwrap();
            let devices = config.net_devices.expect("rails for a GPU");
            for device in devices.split(',') {
                let nic = device.trim_end_matches(":1").to_owned();
                assert!(
                    nics.contains(&nic),
                    "{gpu} got {nic}, not of its node {nics:?}"
                );
                used.entry(nics.join(",")).or_default().push(nic);
            }
        }
        for (node, mut got) in used {
            got.sort();
            got.dedup();
            assert_eq!(got.join(","), node);
        }
        let (sysfs, gpus) = kvx_testkit::sysfs::p5en();
        let (gpu, _) = &gpus[3];
        let elsewhere = gpus[5].1[1].clone();
        let overrides: RailOverrides = format!("{gpu}={elsewhere}").parse().unwrap();
        let options = on_gpu(&sysfs, gpu).with_rail_overrides(overrides.clone());
        let config = nixl.nixl_config(&options).unwrap();
        assert_eq!(config.net_devices, Some(format!("{elsewhere}:1")));
        // The other GPUs keep their own.
        let options = on_gpu(&sysfs, &gpus[0].0).with_rail_overrides(overrides);
        let config = nixl.nixl_config(&options).unwrap();
        assert_eq!(sorted_devices(&config), Some(ucx_devices(&gpus[0].1)));
        let missing: RailOverrides = format!("{gpu}=rdmap999s0").parse().unwrap();
        let err = nixl
            .nixl_config(&on_gpu(&sysfs, gpu).with_rail_overrides(missing))
            .unwrap_err();
        assert!(matches!(err, TransportError::Rails(_)), "{err}");
        assert!(err.to_string().contains("rdmap999s0"), "{err}");
        // An exported UCX_NET_DEVICES wins over the rails: kvx names no device.
        let exported = on_gpu(&sysfs, gpu).with_ucx_net_devices_exported(true);
        let config = nixl.nixl_config(&exported).unwrap();
        assert_eq!(config.net_devices, None);
        assert!(!config
            .backend_params
            .iter()
            .any(|(_, v)| v.contains("NET_DEVICES")));
        // A named interface wins over the rails.
        let named: TransportSpec = "nixl@eth7".parse().unwrap();
        let config = named.nixl_config(&on_gpu(&sysfs, gpu)).unwrap();
        assert_eq!(config.net_devices, None);
        assert!(config
            .backend_params
            .iter()
            .any(|(k, v)| k == "engine_config" && v.contains("NET_DEVICES=eth7")));
    }

    /// A provider with a domain per NIC (EFA) opens the rails of the cache's GPU; the
    /// selection records the NICs and the rule even where this host offers no such domain.
    #[cfg(feature = "libfabric")]
    #[test]
    fn libfabric_per_nic_providers_take_the_rails_of_each_ranks_gpu() {
        let efa: TransportSpec = "libfabric:efa".parse().unwrap();
        let (sysfs, gpus) = kvx_testkit::sysfs::p5en();
        for (gpu, nics) in &gpus {
            let (_, selection) = efa.libfabric_config(&on_gpu(&sysfs, gpu)).unwrap();
            let selection = selection.expect("a selection for a GPU cache");
            let mut chosen = selection.nics.clone();
            chosen.sort();
            let mut want = nics.to_vec();
            want.sort();
            assert_eq!(chosen, want, "{gpu}");
            assert_eq!(
                selection.rule,
                Some(kvx_rdma::topology::RailRule::PcieSwitch)
            );
        }
        // Host memory, or a provider of one domain: no selection.
        let (_, none) = efa.libfabric_config(&OpenOptions::default()).unwrap();
        assert!(none.is_none());
        let missing: RailOverrides = format!("{}=rdmap999s0", gpus[0].0).parse().unwrap();
        let err = efa
            .libfabric_config(&on_gpu(&sysfs, &gpus[0].0).with_rail_overrides(missing))
            .unwrap_err();
        assert!(err.to_string().contains("rdmap999s0"), "{err}");
    }

    /// An instance that knows where its peers are opens UCX on that interface alone; one that
    /// knows nothing (a decode before its first prefill) leaves UCX all of them, so that a
    /// prefill of the same host listening on loopback (UCX on `lo`) shares a device with it.
    #[cfg(feature = "nixl")]
    #[test]
    fn ucx_keeps_all_interfaces_where_the_choice_is_a_guess() {
        use kvx_rdma::topology::reach::ReachRule;
        let local = ReachRule::LocalAddress("192.0.2.2".parse().unwrap());
        assert_eq!(ucx_tcp_devices("eth0", local).as_deref(), Some("eth0"));
        let peer = ReachRule::RouteToPeer("192.0.2.9".parse().unwrap());
        assert_eq!(ucx_tcp_devices("eth0", peer).as_deref(), Some("eth0"));
        assert_eq!(
            ucx_tcp_devices("lo", ReachRule::Loopback).as_deref(),
            Some("lo")
        );
        assert_eq!(ucx_tcp_devices("eth0", ReachRule::DefaultRoute), None);
        assert_eq!(ucx_tcp_devices("eth0", ReachRule::OnlyInterface), None);
    }

    #[test]
    fn loopback_opens() {
        assert_eq!(
            TransportSpec::Loopback.open().unwrap().backend(),
            "loopback"
        );
    }
}
