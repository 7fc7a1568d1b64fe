//! Errors of the topology reader, the selection and the explicit rail mapping.

use std::io;
use std::path::PathBuf;

use super::pci::{ParsePciAddressError, PciAddress};

/// Why a topology could not be read from sysfs, built, or combined with an explicit mapping.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// The sysfs root itself cannot be read (missing, not a directory, no permission).
    #[error("cannot read the sysfs root {path}")]
    ReadRoot {
        /// The root that was given.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The root has no `bus/pci/devices`: not a sysfs tree, or a host without a PCI bus.
    #[error("{path} does not exist: not a sysfs root, or a host without a PCI bus")]
    NoPciBus {
        /// The missing directory.
        path: PathBuf,
    },
    /// A sysfs directory could not be listed.
    #[error("cannot list {path}")]
    ListDir {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// An entry of `bus/pci/devices` is not named by a PCI address.
    #[error("{path} is not named by a PCI address")]
    DeviceName {
        /// The entry.
        path: PathBuf,
        /// Why its name is not an address.
        #[source]
        source: ParsePciAddressError,
    },
    /// A sysfs link could not be resolved.
    #[error("cannot resolve the link {path}")]
    ResolveLink {
        /// The link.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A `bus/pci/devices` link resolves to a path whose last PCI component is another address.
    #[error("{path} resolves to {target}, which is not the PCI device {address}")]
    LinkMismatch {
        /// The link.
        path: PathBuf,
        /// Where it resolves to.
        target: PathBuf,
        /// The address the link is named by.
        address: PciAddress,
    },
    /// A device attribute (`class`, `vendor`, `device`, `numa_node`) could not be read.
    #[error("cannot read {path}")]
    ReadAttribute {
        /// The attribute file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A device attribute holds something other than what the kernel writes there.
    #[error("{path} holds `{value}`, which is not {expected}")]
    MalformedAttribute {
        /// The attribute file.
        path: PathBuf,
        /// Its content (trimmed, possibly shortened).
        value: String,
        /// What was expected.
        expected: &'static str,
    },
    /// The same PCI address was given for two devices.
    #[error("PCI device {address} is listed twice")]
    DuplicateDevice {
        /// The repeated address.
        address: PciAddress,
    },
    /// An RDMA device or network interface sits on a PCI device that the device list lacks.
    #[error("interface `{name}` sits on PCI device {address}, which the PCI device list lacks")]
    DanglingInterface {
        /// The RDMA device or network interface.
        name: String,
        /// Its PCI address.
        address: PciAddress,
    },
    /// The same RDMA device name was given twice.
    #[error("RDMA device `{name}` is listed twice")]
    DuplicateNic {
        /// The repeated name.
        name: String,
    },
    /// An explicit rail mapping names an accelerator this host does not have.
    #[error("the rail mapping names accelerator {address}, which this host does not have")]
    OverrideUnknownAccelerator {
        /// The accelerator's address.
        address: PciAddress,
    },
    /// An explicit rail mapping names an RDMA device this host does not have.
    #[error("the rail mapping gives accelerator {accelerator} the RDMA device `{rail}`, which this host does not have")]
    OverrideUnknownRail {
        /// The accelerator's address.
        accelerator: PciAddress,
        /// The unknown RDMA device name.
        rail: String,
    },
}

/// Why an explicit rail mapping (`KVX_RAILS`, `--rails`) is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RailSpecError {
    /// An entry has no `=` between the accelerator and its NICs.
    #[error("rail mapping entry `{entry}` lacks `=`: expected PCI_ADDRESS=NIC[,NIC...]")]
    MissingEquals {
        /// The entry.
        entry: String,
    },
    /// An entry's accelerator is not a PCI address.
    #[error("rail mapping entry `{entry}` does not start with a PCI address")]
    BadAddress {
        /// The entry.
        entry: String,
        /// Why the address is invalid.
        #[source]
        source: ParsePciAddressError,
    },
    /// An entry names no NIC at all.
    #[error("rail mapping entry `{entry}` names no NIC")]
    NoRails {
        /// The entry.
        entry: String,
    },
    /// An entry has an invalid NIC name (empty, whitespace, `:` or `/`).
    #[error("rail mapping entry `{entry}`: NIC name `{name}` is invalid: {reason}")]
    BadRailName {
        /// The entry.
        entry: String,
        /// The offending name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Two entries name the same accelerator.
    #[error("rail mapping names accelerator {address} twice")]
    DuplicateAccelerator {
        /// The repeated address.
        address: PciAddress,
    },
    /// The environment variable holds bytes that are not UTF-8.
    #[error("environment variable {var} is not valid UTF-8")]
    EnvNotUnicode {
        /// The variable's name.
        var: &'static str,
    },
}
