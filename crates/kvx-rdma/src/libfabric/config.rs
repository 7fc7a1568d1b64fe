//! How an endpoint is opened ([`LibfabricConfig`]: provider, domain, [`Rails`], striping,
//! timeouts) and what opening it can fail with ([`OpenError`]).

use std::time::Duration;

use super::fi::{self, FabricError};
#[cfg(doc)]
use super::{rails, MAX_RAILS, SHM_SWEEP_ENV};
use super::{DEFAULT_STRIPE_THRESHOLD, PROVIDER_EFA, PROVIDER_SHM, PROVIDER_TCP};
#[cfg(doc)]
use crate::error::OpError;

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
    /// Open for device memory too: the provider must offer `FI_HMEM`, and CUDA regions are then
    /// registered as such (`fi_mr_regattr` with `FI_HMEM_CUDA` and the device ordinal) and
    /// moved directly. Off by default (host memory only).
    pub device_memory: bool,
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
            device_memory: false,
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
            hmem: false,
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
    pub(super) fn rail_domains(&self) -> Vec<Option<String>> {
        match &self.rails {
            Rails::One => vec![self.domain.clone()],
            Rails::Domains(domains) => domains.iter().cloned().map(Some).collect(),
            Rails::Count(n) => vec![self.domain.clone(); *n],
        }
    }
}

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
    /// Device memory was asked for ([`LibfabricConfig::device_memory`]) but the provider does
    /// not offer `FI_HMEM` (Debian's libfabric 1.17 builds none of its providers with CUDA).
    #[error(
        "libfabric provider {provider} offers no device memory (FI_HMEM) here: move GPU memory \
         with nixl, or use a libfabric built with CUDA (e.g. EFA's installer)"
    )]
    NoDeviceMemory {
        /// The provider.
        provider: String,
        /// What `fi_getinfo` said.
        #[source]
        source: FabricError,
    },
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
