//! Fake sysfs trees for tests: directories, attribute files and relative symlinks, as the kernel
//! lays them out, with a p5en-like host (the same builder as `topology_sysfs.rs`, shared here
//! for the tests that choose rails from a topology).
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use kvx_rdma::topology::Topology;
use tempfile::TempDir;

pub(crate) const NVIDIA: u16 = 0x10de;
pub(crate) const AMAZON: u16 = 0x1d0f;
pub(crate) const GPU_CLASS: u32 = 0x03_02_00;
pub(crate) const BRIDGE_CLASS: u32 = 0x06_04_00;
pub(crate) const NET_CLASS: u32 = 0x02_00_00;

/// A sysfs tree in a temporary directory.
pub(crate) struct FakeSysfs {
    dir: TempDir,
}

impl FakeSysfs {
    pub(crate) fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        fs::create_dir_all(dir.path().join("bus/pci/devices")).unwrap();
        fs::create_dir_all(dir.path().join("devices")).unwrap();
        Self { dir }
    }

    pub(crate) fn root(&self) -> &Path {
        self.dir.path()
    }

    /// Adds a PCI device at `path` below `devices/`, with its attribute files and its
    /// `bus/pci/devices` link.
    pub(crate) fn device(
        &self,
        path: &str,
        vendor: u16,
        device: u16,
        class: u32,
        numa: Option<&str>,
    ) {
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

    pub(crate) fn bridge(&self, path: &str) {
        self.device(path, 0x1000, 0xc030, BRIDGE_CLASS, Some("-1"));
    }

    /// Adds `class/<class>/<name>` whose `device` link points at `devices/<target>`.
    pub(crate) fn class_entry(&self, class: &str, name: &str, target: &str) -> PathBuf {
        let dir = self.root().join("class").join(class).join(name);
        fs::create_dir_all(&dir).unwrap();
        symlink(
            Path::new("../../../devices").join(target),
            dir.join("device"),
        )
        .unwrap();
        dir
    }

    pub(crate) fn rdma(&self, name: &str, target: &str) {
        let dir = self.class_entry("infiniband", name, target);
        fs::create_dir_all(dir.join("ports/1")).unwrap();
    }

    pub(crate) fn read(&self) -> Topology {
        Topology::from_sysfs(self.root()).expect("readable fake sysfs")
    }
}

/// A p5en-like host: eight PCIe switches (four per NUMA node), each below its own root port with
/// one GPU and two EFA NICs. Returns the tree and, per GPU, its address and the NICs on its
/// switch.
pub(crate) fn p5en() -> (FakeSysfs, Vec<(String, [String; 2])>) {
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
