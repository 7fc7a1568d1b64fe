//! Fake sysfs trees for the topology and rail tests: directories, attribute files and relative
//! symlinks, as the kernel lays them out, and two hosts built from them (a p5en-like one, whose
//! GPUs share PCIe switches with their NICs, and one whose NICs hang off the CPUs).
//!
//! ```
//! let (sysfs, gpus) = kvx_testkit::sysfs::p5en();
//! assert_eq!(gpus.len(), 8);
//! assert!(sysfs.root().join("bus/pci/devices").is_dir());
//! ```
#![allow(clippy::missing_panics_doc)]

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use tempfile::TempDir;

/// NVIDIA's PCI vendor id.
pub const NVIDIA: u16 = 0x10de;
/// Amazon's PCI vendor id (EFA, ENA).
pub const AMAZON: u16 = 0x1d0f;
/// The PCI class of a 3D controller (a datacenter GPU).
pub const GPU_CLASS: u32 = 0x03_02_00;
/// The PCI class of a PCI-to-PCI bridge (root and switch ports).
pub const BRIDGE_CLASS: u32 = 0x06_04_00;
/// The PCI class of an Ethernet controller.
pub const NET_CLASS: u32 = 0x02_00_00;

/// A sysfs tree in a temporary directory (removed on drop).
#[derive(Debug)]
pub struct FakeSysfs {
    dir: TempDir,
}

impl FakeSysfs {
    /// An empty tree (`bus/pci/devices` and `devices`).
    ///
    /// # Panics
    /// When the temporary directory cannot be made.
    #[must_use]
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        fs::create_dir_all(dir.path().join("bus/pci/devices")).unwrap();
        fs::create_dir_all(dir.path().join("devices")).unwrap();
        Self { dir }
    }

    /// The tree's root, for `Topology::from_sysfs`.
    #[must_use]
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// Adds a PCI device at `path` below `devices/`, with its attribute files and its
    /// `bus/pci/devices` link.
    pub fn device(&self, path: &str, vendor: u16, device: u16, class: u32, numa: Option<&str>) {
        let dir = self.root().join("devices").join(path);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("vendor"), format!("{vendor:#06x}\n")).unwrap();
        fs::write(dir.join("device"), format!("{device:#06x}\n")).unwrap();
        fs::write(dir.join("class"), format!("{class:#08x}\n")).unwrap();
        if let Some(numa) = numa {
            fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
        }
        let name = Path::new(path).file_name().unwrap();
        symlink(
            Path::new("../../../devices").join(path),
            self.root().join("bus/pci/devices").join(name),
        )
        .unwrap();
    }

    /// Adds a bridge (a root or switch port) at `path`.
    pub fn bridge(&self, path: &str) {
        self.device(path, 0x1000, 0xc030, BRIDGE_CLASS, Some("-1"));
    }

    /// Adds `class/<class>/<name>` whose `device` link points at `devices/<target>`.
    ///
    /// # Panics
    /// When the tree cannot be written.
    pub fn class_entry(&self, class: &str, name: &str, target: &str) -> PathBuf {
        let dir = self.root().join("class").join(class).join(name);
        fs::create_dir_all(&dir).unwrap();
        symlink(
            Path::new("../../../devices").join(target),
            dir.join("device"),
        )
        .unwrap();
        dir
    }

    /// Adds the RDMA device `name` (port 1) of the PCI device at `target`.
    pub fn rdma(&self, name: &str, target: &str) {
        let dir = self.class_entry("infiniband", name, target);
        fs::create_dir_all(dir.join("ports/1")).unwrap();
    }
}

/// A p5en-like host: eight PCIe switches (four per NUMA node), each below its own root port with
/// one GPU and two EFA NICs. Returns the tree and, per GPU, its address and the NICs on its
/// switch.
#[must_use]
pub fn p5en() -> (FakeSysfs, Vec<(String, [String; 2])>) {
    let t = FakeSysfs::new();
    let mut expected = Vec::new();
    for s in 0u8..8 {
        let gpu_bus = 0x53 + 0x11 * s;
        let numa = (s / 4).to_string();
        let rp = format!("pci0000:{:02x}/0000:{:02x}:01.0", gpu_bus - 8, gpu_bus - 8);
        t.bridge(&rp);
        let up = format!("{rp}/0000:{:02x}:00.0", gpu_bus - 7);
        t.bridge(&up);
        let ports: Vec<String> = (0..3u8)
            .map(|k| {
                let p = format!("{up}/0000:{:02x}:{k:02x}.0", gpu_bus - 6);
                t.bridge(&p);
                p
            })
            .collect();
        let gpu = format!("0000:{gpu_bus:02x}:00.0");
        t.device(
            &format!("{}/{gpu}", ports[0]),
            NVIDIA,
            0x2335,
            GPU_CLASS,
            Some(&numa),
        );
        let mut nics = [String::new(), String::new()];
        for (k, nic_bus) in [gpu_bus - 4, gpu_bus - 3].into_iter().enumerate() {
            let path = format!("{}/0000:{nic_bus:02x}:00.0", ports[k + 1]);
            t.device(&path, AMAZON, 0xefa2, NET_CLASS, Some(&numa));
            let name = format!("rdmap{nic_bus}s0");
            t.rdma(&name, &path);
            nics[k] = name;
        }
        expected.push((gpu, nics));
    }
    (t, expected)
}

impl Default for FakeSysfs {
    fn default() -> Self {
        Self::new()
    }
}

/// A host whose RDMA NICs hang off the CPUs' root complexes, not off switches shared with the
/// GPUs: two NUMA nodes, each with two GPUs and two Mellanox NICs on root ports of their own.
/// Returns the tree and, per GPU, its address and the NICs of its NUMA node (sorted; the NUMA
/// rule shares them out among the node's GPUs).
#[must_use]
pub fn numa_host() -> (FakeSysfs, Vec<(String, [String; 2])>) {
    const MELLANOX: u16 = 0x15b3;
    let t = FakeSysfs::new();
    let mut expected = Vec::new();
    for node in 0u8..2 {
        let numa = node.to_string();
        let base = 0x20 + 0x60 * node;
        let mut nics = [String::new(), String::new()];
        for k in 0u8..2 {
            let bus = base + 0x10 * k;
            let rp = format!("pci0000:{bus:02x}/0000:{bus:02x}:01.0");
            t.bridge(&rp);
            let path = format!("{rp}/0000:{:02x}:00.0", bus + 1);
            t.device(&path, MELLANOX, 0x101d, NET_CLASS, Some(&numa));
            let name = format!("mlx5_{}", 2 * node + k);
            t.rdma(&name, &path);
            nics[usize::from(k)] = name;
        }
        for k in 0u8..2 {
            let bus = base + 0x30 + 0x10 * k;
            let rp = format!("pci0000:{bus:02x}/0000:{bus:02x}:01.0");
            t.bridge(&rp);
            let gpu = format!("0000:{:02x}:00.0", bus + 1);
            t.device(
                &format!("{rp}/{gpu}"),
                NVIDIA,
                0x2335,
                GPU_CLASS,
                Some(&numa),
            );
            expected.push((gpu, nics.clone()));
        }
    }
    (t, expected)
}
