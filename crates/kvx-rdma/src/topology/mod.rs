//! PCIe topology and rail selection.
//!
//! On hosts such as AWS p5en (8 GPUs, 16 EFA NICs, each GPU sharing a PCIe switch with two of
//! them) an accelerator's KV cache must leave through the NICs on its own switch, so that a
//! transfer never crosses the root complex. This module reads the PCI tree from sysfs alone (no
//! hwloc) and chooses each accelerator's *rails*:
//!
//! * the RDMA NICs sharing its deepest common PCIe ancestor ([`RailRule::PcieSwitch`]); when several
//!   accelerators have the same nearest NICs they split them evenly in PCI-address order (with
//!   fewer NICs than accelerators, they share);
//! * with nothing shared below the root complex, the NICs on its NUMA node ([`RailRule::Numa`]);
//! * with none there either, all NICs ([`RailRule::All`]);
//! * an explicit mapping ([`RailOverrides`], from `KVX_RAILS` or configuration) overrides the rule
//!   for the accelerators it names ([`RailRule::Override`]).
//!
//! The model ([`PciDevice`], [`RdmaNic`], [`NetInterface`]) and the rule are pure and work on
//! in-memory data ([`Topology::from_parts`]); [`Topology::from_sysfs`] fills the model from a sysfs
//! tree (`/sys` or a copy of one). The libfabric backend opens one endpoint per rail of the
//! memory's owner; [`Topology::ucx_net_devices`] gives NIXL's `UCX_NET_DEVICES`.
//!
//! ```
//! use kvx_rdma::topology::{PciAddress, PciDevice, RailOverrides, RailRule, RdmaNic, Topology};
//!
//! let a = |s: &str| s.parse::<PciAddress>().unwrap();
//! // One PCIe switch (upstream port 0000:01:00.0, downstream ports 0000:02:0x.0) holding a GPU and
//! // two EFA NICs, below root port 0000:00:01.0.
//! let above = |port: &str| vec![a("0000:00:01.0"), a("0000:01:00.0"), a(port)];
//! let devices = vec![
//!     PciDevice::new(a("0000:03:00.0"), 0x10de, 0x2335, 0x03_02_00)
//!         .with_numa_node(Some(0))
//!         .with_ancestors(above("0000:02:00.0")),
//!     PciDevice::new(a("0000:04:00.0"), 0x1d0f, 0xefa2, 0x02_00_00)
//!         .with_numa_node(Some(0))
//!         .with_ancestors(above("0000:02:01.0")),
//!     PciDevice::new(a("0000:05:00.0"), 0x1d0f, 0xefa2, 0x02_00_00)
//!         .with_numa_node(Some(0))
//!         .with_ancestors(above("0000:02:02.0")),
//! ];
//! let nics = vec![
//!     RdmaNic::new("rdmap4s0", a("0000:04:00.0")),
//!     RdmaNic::new("rdmap5s0", a("0000:05:00.0")),
//! ];
//! let topo = Topology::from_parts(devices, nics, Vec::new())?;
//! let gpu = a("0000:03:00.0");
//! let choice = topo.rails_for(&gpu).expect("a GPU");
//! assert_eq!(choice.rails, ["rdmap4s0", "rdmap5s0"]);
//! assert_eq!(choice.rule, RailRule::PcieSwitch);
//! assert_eq!(topo.ucx_net_devices(&gpu).as_deref(), Some("rdmap4s0:1,rdmap5s0:1"));
//!
//! // An explicit mapping wins.
//! let topo = topo.with_overrides(&"0000:03:00.0=rdmap5s0".parse::<RailOverrides>()?)?;
//! assert_eq!(topo.rails_for(&gpu).unwrap().rule, RailRule::Override);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

mod error;
mod overrides;
mod pci;
pub mod reach;
mod select;
mod sysfs;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

pub use error::{RailSpecError, TopologyError};
pub use overrides::RailOverrides;
pub use pci::{ParsePciAddressError, PciAddress};

/// NVIDIA's PCI vendor id.
pub const VENDOR_NVIDIA: u16 = 0x10de;
/// Amazon's PCI vendor id (Neuron devices, and also the ENA and EFA network devices).
pub const VENDOR_AMAZON: u16 = 0x1d0f;

/// PCI device ids of AWS Neuron devices (Inferentia 1 and 2, Trainium 1, 2 and 3), as claimed by
/// the Neuron kernel driver.
pub const NEURON_DEVICE_IDS: [u16; 9] = [
    0x7064, 0x7065, 0x7066, 0x7067, // Inferentia
    0x7164, // Trainium
    0x7264, // Inferentia2
    0x7364, // Trainium2
    0x7564, 0x7565, // Trainium3
];

/// PCI base class of display controllers (GPUs).
const CLASS_DISPLAY: u32 = 0x03;
/// PCI base class of network controllers (ENA, EFA, ConnectX Ethernet).
const CLASS_NETWORK: u32 = 0x02;

/// What kind of accelerator a PCI device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum AcceleratorKind {
    /// An NVIDIA GPU (vendor `0x10de`, display class `0x03xxxx`), driven through CUDA.
    Cuda,
    /// An AWS Neuron device (vendor `0x1d0f`, a device id of [`NEURON_DEVICE_IDS`]).
    Neuron,
}

impl AcceleratorKind {
    /// Classifies a PCI device from its ids and 24-bit class code. NVIDIA's NVSwitch bridges are
    /// not GPUs (bridge class); Amazon's ENA and EFA are network-class devices and never
    /// accelerators.
    #[must_use]
    pub fn classify(vendor: u16, device: u16, class: u32) -> Option<Self> {
        let base = (class >> 16) & 0xff;
        match vendor {
            VENDOR_NVIDIA if base == CLASS_DISPLAY => Some(Self::Cuda),
            VENDOR_AMAZON if base != CLASS_NETWORK && NEURON_DEVICE_IDS.contains(&device) => {
                Some(Self::Neuron)
            }
            _ => None,
        }
    }

    /// The name used in reports: `cuda` or `neuron`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Cuda => "cuda",
            Self::Neuron => "neuron",
        }
    }
}

impl fmt::Display for AcceleratorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which rule chose an accelerator's rails.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum RailRule {
    /// The NICs sharing the accelerator's deepest common PCIe ancestor (its switch).
    PcieSwitch,
    /// Nothing shared below the root complex: the NICs on the accelerator's NUMA node.
    Numa,
    /// Neither: every NIC of the host (none when the host has none).
    All,
    /// An explicit mapping.
    Override,
}

impl RailRule {
    /// The name used in reports: `pcie-switch`, `numa`, `all` or `override`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::PcieSwitch => "pcie-switch",
            Self::Numa => "numa",
            Self::All => "all",
            Self::Override => "override",
        }
    }
}

impl fmt::Display for RailRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An accelerator's rails and the rule that chose them.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RailChoice {
    /// RDMA device names (`rdmap79s0`, `mlx5_0`), sorted; empty only on a host without RDMA NICs.
    pub rails: Vec<String>,
    /// The rule that chose them.
    pub rule: RailRule,
}

/// One PCI function, as sysfs describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciDevice {
    address: PciAddress,
    vendor: u16,
    device: u16,
    class: u32,
    numa_node: Option<u32>,
    ancestors: Vec<PciAddress>,
}

impl PciDevice {
    /// A device with its vendor id, device id and 24-bit class code, no known NUMA node and
    /// directly below the root complex (no bridge above it).
    #[must_use]
    pub fn new(address: PciAddress, vendor: u16, device: u16, class: u32) -> Self {
        Self {
            address,
            vendor,
            device,
            class,
            numa_node: None,
            ancestors: Vec::new(),
        }
    }

    /// Sets the NUMA node (`None`: unknown, as sysfs says with `-1`).
    #[must_use]
    pub fn with_numa_node(mut self, numa_node: Option<u32>) -> Self {
        self.numa_node = numa_node;
        self
    }

    /// Sets the PCI bridges above the device, from the root complex down (the root port first,
    /// the device's own parent last); the host bridge itself is not a PCI device and not listed.
    #[must_use]
    pub fn with_ancestors(mut self, ancestors: Vec<PciAddress>) -> Self {
        self.ancestors = ancestors;
        self
    }

    /// The device's address.
    #[must_use]
    pub fn address(&self) -> PciAddress {
        self.address
    }

    /// The vendor id.
    #[must_use]
    pub fn vendor(&self) -> u16 {
        self.vendor
    }

    /// The device id.
    #[must_use]
    pub fn device_id(&self) -> u16 {
        self.device
    }

    /// The 24-bit class code (base class, subclass, programming interface).
    #[must_use]
    pub fn class(&self) -> u32 {
        self.class
    }

    /// The NUMA node, when known.
    #[must_use]
    pub fn numa_node(&self) -> Option<u32> {
        self.numa_node
    }

    /// The bridges above the device, root port first.
    #[must_use]
    pub fn ancestors(&self) -> &[PciAddress] {
        &self.ancestors
    }

    /// What kind of accelerator this is, if any.
    #[must_use]
    pub fn accelerator_kind(&self) -> Option<AcceleratorKind> {
        AcceleratorKind::classify(self.vendor, self.device, self.class)
    }

    /// The ancestors followed by the device itself.
    fn chain(&self) -> Vec<PciAddress> {
        let mut chain = self.ancestors.clone();
        chain.push(self.address);
        chain
    }
}

/// An RDMA NIC (`class/infiniband/<name>`): its device name and the PCI function it sits on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaNic {
    name: String,
    pci: PciAddress,
    port: u32,
}

impl RdmaNic {
    /// A NIC whose first port is port 1.
    #[must_use]
    pub fn new(name: impl Into<String>, pci: PciAddress) -> Self {
        Self {
            name: name.into(),
            pci,
            port: 1,
        }
    }

    /// Sets the port used for it (UCX's `name:port`).
    #[must_use]
    pub fn with_port(mut self, port: u32) -> Self {
        self.port = port;
        self
    }

    /// The RDMA device name (`rdmap79s0`, `mlx5_0`).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The PCI function it sits on.
    #[must_use]
    pub fn pci(&self) -> PciAddress {
        self.pci
    }

    /// The lowest port number of the device.
    #[must_use]
    pub fn port(&self) -> u32 {
        self.port
    }
}

/// A network interface (`class/net/<name>`) on a PCI function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetInterface {
    name: String,
    pci: PciAddress,
}

impl NetInterface {
    /// An interface on a PCI function.
    #[must_use]
    pub fn new(name: impl Into<String>, pci: PciAddress) -> Self {
        Self {
            name: name.into(),
            pci,
        }
    }

    /// The interface name (`eth0`, `ens32`).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The PCI function it sits on.
    #[must_use]
    pub fn pci(&self) -> PciAddress {
        self.pci
    }
}

/// An accelerator found in the topology.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Accelerator {
    /// Its PCI address.
    pub address: PciAddress,
    /// What kind it is.
    pub kind: AcceleratorKind,
    /// Its NUMA node, when known.
    pub numa_node: Option<u32>,
}

/// A host's PCI devices, RDMA NICs and network interfaces, with every accelerator's rails.
#[derive(Clone, Debug)]
pub struct Topology {
    devices: BTreeMap<PciAddress, PciDevice>,
    accelerators: Vec<Accelerator>,
    nics: Vec<RdmaNic>,
    net: Vec<NetInterface>,
    choices: BTreeMap<PciAddress, RailChoice>,
}

impl Topology {
    /// Reads the topology from a sysfs tree (`/sys` on a live host): PCI devices from
    /// `bus/pci/devices/*` (links into `devices/pci*/...`, whose path gives the bridges above
    /// each device) with their `class`, `vendor`, `device` and `numa_node`; RDMA NICs from
    /// `class/infiniband/<name>/device`; network interfaces from `class/net/<name>/device`.
    /// RDMA devices and interfaces not on a PCI device (software or virtual ones) are left out.
    ///
    /// # Errors
    /// [`TopologyError`] with the offending path: unreadable root, no `bus/pci/devices`,
    /// unresolvable links, unreadable or malformed `class`/`vendor`/`device`/`numa_node` files
    /// (a missing `numa_node`, or `-1`, is an unknown node, not an error).
    pub fn from_sysfs(root: impl AsRef<Path>) -> Result<Self, TopologyError> {
        let parts = sysfs::read(root.as_ref())?;
        Self::from_parts(parts.devices, parts.nics, parts.net)
    }

    /// Builds the topology from in-memory parts and applies the selection rule.
    ///
    /// # Errors
    /// [`TopologyError::DuplicateDevice`] or [`TopologyError::DuplicateNic`] for repeated entries,
    /// [`TopologyError::DanglingInterface`] for a NIC or interface on a device not in `devices`.
    pub fn from_parts(
        devices: Vec<PciDevice>,
        mut nics: Vec<RdmaNic>,
        mut net: Vec<NetInterface>,
    ) -> Result<Self, TopologyError> {
        let mut map = BTreeMap::new();
        for device in devices {
            let address = device.address;
            if map.insert(address, device).is_some() {
                return Err(TopologyError::DuplicateDevice { address });
            }
        }
        let dangling = |name: &str, address: PciAddress| {
            if map.contains_key(&address) {
                Ok(())
            } else {
                Err(TopologyError::DanglingInterface {
                    name: name.to_owned(),
                    address,
                })
            }
        };
        for nic in &nics {
            dangling(&nic.name, nic.pci)?;
        }
        for iface in &net {
            dangling(&iface.name, iface.pci)?;
        }
        let mut seen = BTreeSet::new();
        for nic in &nics {
            if !seen.insert(nic.name.as_str()) {
                return Err(TopologyError::DuplicateNic {
                    name: nic.name.clone(),
                });
            }
        }
        nics.sort_by(|a, b| (a.pci, &a.name).cmp(&(b.pci, &b.name)));
        net.sort_by(|a, b| a.name.cmp(&b.name));
        let accelerators: Vec<Accelerator> = map
            .values()
            .filter_map(|d| {
                d.accelerator_kind().map(|kind| Accelerator {
                    address: d.address,
                    kind,
                    numa_node: d.numa_node,
                })
            })
            .collect();
        let choices = select::select(&map, &accelerators, &nics);
        Ok(Self {
            devices: map,
            accelerators,
            nics,
            net,
            choices,
        })
    }

    /// Applies an explicit mapping: the accelerators it names get exactly its NICs, with rule
    /// [`RailRule::Override`]; the others keep the rule's choice.
    ///
    /// # Errors
    /// [`TopologyError::OverrideUnknownAccelerator`] or [`TopologyError::OverrideUnknownRail`]
    /// when the mapping names an accelerator or NIC this host does not have (a typo must not
    /// silently fall back to the rule).
    pub fn with_overrides(mut self, overrides: &RailOverrides) -> Result<Self, TopologyError> {
        for (address, rails) in overrides.iter() {
            if !self.choices.contains_key(address) {
                return Err(TopologyError::OverrideUnknownAccelerator { address: *address });
            }
            if let Some(rail) = rails.iter().find(|r| self.nic(r).is_none()) {
                return Err(TopologyError::OverrideUnknownRail {
                    accelerator: *address,
                    rail: rail.clone(),
                });
            }
        }
        for (address, rails) in overrides.iter() {
            self.choices.insert(
                *address,
                RailChoice {
                    rails: rails.to_vec(),
                    rule: RailRule::Override,
                },
            );
        }
        Ok(self)
    }

    /// The accelerators, in PCI-address order.
    #[must_use]
    pub fn accelerators(&self) -> &[Accelerator] {
        &self.accelerators
    }

    /// The RDMA NICs, in PCI-address order.
    #[must_use]
    pub fn rdma_nics(&self) -> &[RdmaNic] {
        &self.nics
    }

    /// The RDMA NIC of that name.
    #[must_use]
    pub fn nic(&self, name: &str) -> Option<&RdmaNic> {
        self.nics.iter().find(|n| n.name == name)
    }

    /// The network interfaces on PCI devices, by name.
    #[must_use]
    pub fn net_interfaces(&self) -> &[NetInterface] {
        &self.net
    }

    /// The network interfaces on one PCI function (an RDMA NIC's Ethernet side, for example).
    pub fn interfaces_on(&self, pci: PciAddress) -> impl Iterator<Item = &NetInterface> {
        self.net.iter().filter(move |i| i.pci == pci)
    }

    /// The PCI device at an address.
    #[must_use]
    pub fn device(&self, address: &PciAddress) -> Option<&PciDevice> {
        self.devices.get(address)
    }

    /// Every PCI device, in address order.
    pub fn devices(&self) -> impl Iterator<Item = &PciDevice> {
        self.devices.values()
    }

    /// The rails of the accelerator at `accelerator`, or `None` when it is not an accelerator.
    #[must_use]
    pub fn rails_for(&self, accelerator: &PciAddress) -> Option<&RailChoice> {
        self.choices.get(accelerator)
    }

    /// Every accelerator with its rails, in PCI-address order.
    pub fn selection(&self) -> impl Iterator<Item = (&Accelerator, &RailChoice)> {
        self.accelerators
            .iter()
            .filter_map(|a| self.choices.get(&a.address).map(|c| (a, c)))
    }

    /// The `UCX_NET_DEVICES` value for an accelerator's rails (`rdmap79s0:1,rdmap80s0:1`), with
    /// each NIC's own port; `None` when it is not an accelerator.
    #[must_use]
    pub fn ucx_net_devices(&self, accelerator: &PciAddress) -> Option<String> {
        let choice = self.rails_for(accelerator)?;
        let devices: Vec<String> = choice
            .rails
            .iter()
            .map(|r| {
                let port = self.nic(r).map_or(1, RdmaNic::port);
                format!("{r}:{port}")
            })
            .collect();
        Some(devices.join(","))
    }
}

/// The `UCX_NET_DEVICES` value for RDMA device names, each on port 1 (`mlx5_0:1,mlx5_1:1`; EFA
/// devices are named the same way). Prefer [`Topology::ucx_net_devices`], which knows the ports.
#[must_use]
pub fn ucx_net_devices<S: AsRef<str>>(rails: &[S]) -> String {
    let devices: Vec<String> = rails.iter().map(|r| format!("{}:1", r.as_ref())).collect();
    devices.join(",")
}

#[cfg(test)]
mod tests;
