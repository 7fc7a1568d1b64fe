//! The sysfs reader: fills the in-memory model from a sysfs tree. All I/O of the module is here.

use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use super::error::TopologyError;
use super::pci::PciAddress;
use super::{NetInterface, PciDevice, RdmaNic};

/// What the reader found.
pub(super) struct SysfsParts {
    pub(super) devices: Vec<PciDevice>,
    pub(super) nics: Vec<RdmaNic>,
    pub(super) net: Vec<NetInterface>,
}

/// Reads PCI devices, RDMA NICs and network interfaces below `root`.
pub(super) fn read(root: &Path) -> Result<SysfsParts, TopologyError> {
    fs::read_dir(root).map_err(|source| TopologyError::ReadRoot {
        path: root.to_path_buf(),
        source,
    })?;
    let devices_dir = root.join("bus").join("pci").join("devices");
    let entries = match fs::read_dir(&devices_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(TopologyError::NoPciBus { path: devices_dir });
        }
        Err(source) => {
            return Err(TopologyError::ListDir {
                path: devices_dir,
                source,
            })
        }
    };
    let mut devices = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| TopologyError::ListDir {
            path: devices_dir.clone(),
            source,
        })?;
        devices.push(read_device(&entry.path())?);
    }
    let nics = list_class(root, "infiniband")?
        .into_iter()
        .map(|(name, dir, pci)| RdmaNic::new(name, pci).with_port(first_port(&dir)))
        .collect();
    let net = list_class(root, "net")?
        .into_iter()
        .map(|(name, _, pci)| NetInterface::new(name, pci))
        .collect();
    Ok(SysfsParts { devices, nics, net })
}

/// Reads one `bus/pci/devices/<address>` entry.
fn read_device(link: &Path) -> Result<PciDevice, TopologyError> {
    let name = link.file_name().unwrap_or_default().to_string_lossy();
    let address: PciAddress = name.parse().map_err(|source| TopologyError::DeviceName {
        path: link.to_path_buf(),
        source,
    })?;
    let target = fs::canonicalize(link).map_err(|source| TopologyError::ResolveLink {
        path: link.to_path_buf(),
        source,
    })?;
    let mut chain = pci_components(&target);
    if chain.pop() != Some(address) {
        return Err(TopologyError::LinkMismatch {
            path: link.to_path_buf(),
            target,
            address,
        });
    }
    let class = read_hex(
        &link.join("class"),
        0xff_ffff,
        "a 24-bit hexadecimal class code",
    )?;
    let vendor = read_hex16(&link.join("vendor"), "a 16-bit hexadecimal vendor id")?;
    let device = read_hex16(&link.join("device"), "a 16-bit hexadecimal device id")?;
    let numa_node = read_numa(&link.join("numa_node"))?;
    Ok(PciDevice::new(address, vendor, device, class)
        .with_numa_node(numa_node)
        .with_ancestors(chain))
}

/// The PCI addresses among a path's components, top first: the bridges above a device, then the
/// device. The host bridge (`pci0000:00`) is not an address and is skipped.
fn pci_components(path: &Path) -> Vec<PciAddress> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(s) => s.to_str().and_then(|s| s.parse().ok()),
            _ => None,
        })
        .collect()
}

/// Lists `class/<class>/*` whose `device` link leads to a PCI device: (name, entry dir, the
/// deepest PCI address on the link's path). A missing class directory is an empty list; entries
/// without a `device` link or not below a PCI device (virtual, software) are left out.
fn list_class(
    root: &Path,
    class: &str,
) -> Result<Vec<(String, PathBuf, PciAddress)>, TopologyError> {
    let dir = root.join("class").join(class);
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(TopologyError::ListDir { path: dir, source }),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| TopologyError::ListDir {
            path: dir.clone(),
            source,
        })?;
        let entry_dir = entry.path();
        let link = entry_dir.join("device");
        let target = match fs::canonicalize(&link) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => return Err(TopologyError::ResolveLink { path: link, source }),
        };
        if let Some(&pci) = pci_components(&target).last() {
            let name = entry.file_name().to_string_lossy().into_owned();
            out.push((name, entry_dir, pci));
        }
    }
    Ok(out)
}

/// The lowest numbered port of an RDMA device (`ports/<n>`), or 1 when none is listed.
fn first_port(nic_dir: &Path) -> u32 {
    fs::read_dir(nic_dir.join("ports"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .min()
        .unwrap_or(1)
}

/// Reads a required attribute file.
fn read_attr(path: &Path) -> Result<String, TopologyError> {
    fs::read_to_string(path).map_err(|source| TopologyError::ReadAttribute {
        path: path.to_path_buf(),
        source,
    })
}

/// A short, printable excerpt of a malformed value.
fn excerpt(value: &str) -> String {
    const MAX: usize = 64;
    let value = value.trim();
    match value.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}...", &value[..i]),
        None => value.to_owned(),
    }
}

/// Reads a `0x`-prefixed hexadecimal attribute no larger than `max`.
fn read_hex(path: &Path, max: u32, expected: &'static str) -> Result<u32, TopologyError> {
    let raw = read_attr(path)?;
    let text = raw.trim();
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    match u32::from_str_radix(digits, 16) {
        Ok(v) if v <= max && !digits.starts_with('+') => Ok(v),
        _ => Err(TopologyError::MalformedAttribute {
            path: path.to_path_buf(),
            value: excerpt(&raw),
            expected,
        }),
    }
}

/// Reads a 16-bit hexadecimal attribute (vendor or device id).
fn read_hex16(path: &Path, expected: &'static str) -> Result<u16, TopologyError> {
    let value = read_hex(path, u32::from(u16::MAX), expected)?;
    u16::try_from(value).map_err(|_| TopologyError::MalformedAttribute {
        path: path.to_path_buf(),
        value: format!("{value:#x}"),
        expected,
    })
}

/// Reads `numa_node`: absent or negative (the kernel writes `-1`) is an unknown node.
fn read_numa(path: &Path) -> Result<Option<u32>, TopologyError> {
    let raw = match fs::read_to_string(path) {
        Ok(raw) => raw,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TopologyError::ReadAttribute {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    match raw.trim().parse::<i64>() {
        Ok(n) if n < 0 => Ok(None),
        Ok(n) => u32::try_from(n)
            .map(Some)
            .map_err(|_| TopologyError::MalformedAttribute {
                path: path.to_path_buf(),
                value: excerpt(&raw),
                expected: "a NUMA node number or -1",
            }),
        Err(_) => Err(TopologyError::MalformedAttribute {
            path: path.to_path_buf(),
            value: excerpt(&raw),
            expected: "a NUMA node number or -1",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_components_skip_host_bridges_and_other_parts() {
        let p = Path::new("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/virtio2/net");
        let got: Vec<String> = pci_components(p).iter().map(ToString::to_string).collect();
        assert_eq!(got, ["0000:00:01.0", "0000:01:00.0"]);
        assert!(pci_components(Path::new("/sys/devices/virtual/net/lo")).is_empty());
    }

    #[test]
    fn excerpt_shortens_long_values() {
        assert_eq!(excerpt(" 0x03 \n"), "0x03");
        let long = "x".repeat(100);
        assert_eq!(excerpt(&long).len(), 64 + 3);
    }
}
