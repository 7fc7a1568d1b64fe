//! Choosing an endpoint's rails from the PCIe topology: the rails of the memory's accelerator
//! ([`Topology::rails_for`], with any [`RailOverrides`](crate::topology::RailOverrides) the
//! topology was built with), mapped to the domain names the provider reports (EFA: the RDMA
//! device `rdmap79s0` is the domain `rdmap79s0-rdm`; TCP: a NIC's network interface).
//!
//! Host memory, a device that is not an accelerator, an accelerator without rails, or rails that
//! no domain of the provider matches all give the provider's default single rail, with the
//! reason in [`RailSelection::fallback`] for the caller to log.

use std::fmt;

use super::{fi, LibfabricConfig, Rails};
use crate::topology::{PciAddress, RailRule, Topology};

/// The rails chosen for one memory owner.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RailSelection {
    /// What to open: [`Rails::Domains`] with the matched domains, or [`Rails::One`] (the
    /// provider's default domain) on a fallback.
    pub rails: Rails,
    /// The topology's rails (RDMA device names) for the accelerator, before mapping.
    pub nics: Vec<String>,
    /// The rule that chose them, when an accelerator was given and known.
    pub rule: Option<RailRule>,
    /// Rails of the topology that no domain of the provider matched (left out).
    pub unmatched: Vec<String>,
    /// Why the default single rail is used, if it is.
    pub fallback: Option<RailFallback>,
}

/// Why a selection fell back to the provider's default domain.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RailFallback {
    /// The memory is host memory (no accelerator given).
    HostMemory,
    /// The PCI address is not an accelerator of the topology.
    NotAnAccelerator(PciAddress),
    /// The accelerator has no rails (a host without RDMA NICs).
    NoRails(PciAddress),
    /// None of the accelerator's rails is a domain of the provider.
    NoMatchingDomain {
        /// Provider.
        provider: String,
        /// The accelerator's rails.
        nics: Vec<String>,
        /// The domains the provider offers.
        offered: Vec<String>,
    },
}

impl fmt::Display for RailFallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::HostMemory => f.write_str("host memory: one rail on the provider's default domain"),
            Self::NotAnAccelerator(a) => write!(
                f,
                "{a} is not an accelerator of this host's topology: one rail on the provider's default domain"
            ),
            Self::NoRails(a) => write!(
                f,
                "accelerator {a} has no RDMA rails: one rail on the provider's default domain"
            ),
            Self::NoMatchingDomain {
                provider,
                nics,
                offered,
            } => write!(
                f,
                "no {provider} domain matches the rails {nics:?} (offered: {offered:?}): one rail on the provider's default domain"
            ),
        }
    }
}

/// Whether a provider's domain name belongs to a device name: equal, or the name followed by
/// `-` (EFA's `rdmap79s0-rdm`).
fn matches(domain: &str, device: &str) -> bool {
    domain == device
        || domain
            .strip_prefix(device)
            .is_some_and(|rest| rest.starts_with('-'))
}

/// Chooses the rails for memory owned by `accelerator` (`None`: host memory) among the domains
/// `offered` by `provider` (as [`provider_domains`] lists them). Each of the accelerator's rails
/// maps to the first offered domain that is its RDMA device name, that name followed by `-`
/// (EFA), or the name of one of the NIC's network interfaces (TCP); rails without a domain are
/// left out ([`RailSelection::unmatched`]); with none left, the provider's default single rail.
#[must_use]
pub fn select_rails(
    topology: &Topology,
    accelerator: Option<&PciAddress>,
    provider: &str,
    offered: &[String],
) -> RailSelection {
    let fallback = |reason, nics: Vec<String>, rule| RailSelection {
        rails: Rails::One,
        unmatched: nics.clone(),
        nics,
        rule,
        fallback: Some(reason),
    };
    let Some(accelerator) = accelerator else {
        return fallback(RailFallback::HostMemory, Vec::new(), None);
    };
    let Some(choice) = topology.rails_for(accelerator) else {
        return fallback(
            RailFallback::NotAnAccelerator(*accelerator),
            Vec::new(),
            None,
        );
    };
    if choice.rails.is_empty() {
        return fallback(
            RailFallback::NoRails(*accelerator),
            Vec::new(),
            Some(choice.rule),
        );
    }
    let mut domains: Vec<String> = Vec::new();
    let mut unmatched = Vec::new();
    for nic in &choice.rails {
        let mut names = vec![nic.clone()];
        if let Some(device) = topology.nic(nic) {
            names.extend(
                topology
                    .interfaces_on(device.pci())
                    .map(|i| i.name().to_owned()),
            );
        }
        let found = offered
            .iter()
            .find(|d| names.iter().any(|n| matches(d, n)) && !domains.contains(d));
        match found {
            Some(domain) => domains.push(domain.clone()),
            None => unmatched.push(nic.clone()),
        }
    }
    if domains.is_empty() {
        return fallback(
            RailFallback::NoMatchingDomain {
                provider: provider.to_owned(),
                nics: choice.rails.clone(),
                offered: offered.to_vec(),
            },
            choice.rails.clone(),
            Some(choice.rule),
        );
    }
    RailSelection {
        rails: Rails::Domains(domains),
        nics: choice.rails.clone(),
        rule: Some(choice.rule),
        unmatched,
        fallback: None,
    }
}

/// The domains `provider` offers for kvx's endpoints (RDM, RMA, messages), in its order; empty
/// when it offers none.
#[must_use]
pub fn provider_domains(provider: &str) -> Vec<String> {
    fi::Info::query(&fi::Query {
        provider,
        domain: None,
        delivery_complete: false,
        hmem: false,
    })
    .map(|info| info.domains())
    .unwrap_or_default()
}

impl LibfabricConfig {
    /// This configuration with the rails of memory owned by `accelerator` (`None`: host
    /// memory), from `topology` and the domains the provider offers ([`select_rails`]). The
    /// selection comes back too: its [`RailSelection::fallback`] says why only the default rail
    /// is used, for the caller to log.
    #[must_use]
    pub fn with_topology(
        mut self,
        topology: &Topology,
        accelerator: Option<&PciAddress>,
    ) -> (Self, RailSelection) {
        let offered = provider_domains(&self.provider);
        let selection = select_rails(topology, accelerator, &self.provider, &offered);
        self.rails = selection.rails.clone();
        (self, selection)
    }
}
