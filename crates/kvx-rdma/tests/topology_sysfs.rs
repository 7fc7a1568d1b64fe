//! The topology reader and rail selection on fake sysfs trees built by the tests (directories,
//! attribute files and relative symlinks, as the kernel lays them out), and on this machine's own
//! `/sys`.
#![cfg(unix)]

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use kvx_rdma::topology::{
    AcceleratorKind, PciAddress, RailOverrides, RailRule, Topology, TopologyError,
    NEURON_DEVICE_IDS,
};

use kvx_testkit::sysfs::{FakeSysfs, AMAZON, GPU_CLASS, NET_CLASS, NVIDIA};

fn read(t: &FakeSysfs) -> Topology {
    Topology::from_sysfs(t.root()).expect("readable fake sysfs")
}

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

/// One PCIe switch below its own host bridge and root port; returns the path of its `k`-th
/// downstream port, to hang endpoints from.
struct Switch {
    ports: Vec<String>,
}

fn switch(t: &FakeSysfs, above: &str, upstream_bus: u8, nports: u8) -> Switch {
    let up = format!("{above}/0000:{upstream_bus:02x}:00.0");
    t.bridge(&up);
    let ports = (0..nports)
        .map(|k| {
            let p = format!("{up}/0000:{:02x}:{k:02x}.0", upstream_bus + 1);
            t.bridge(&p);
            p
        })
        .collect();
    Switch { ports }
}

/// A root port below a fresh host bridge.
fn root_port(t: &FakeSysfs, bus: u8) -> String {
    let p = format!("pci0000:{bus:02x}/0000:{bus:02x}:01.0");
    t.bridge(&p);
    p
}

/// EFA's RDMA device name for a NIC on `bus`, device 0.
fn efa_name(bus: u8) -> String {
    format!("rdmap{bus}s0")
}

/// A p5en-like host: eight switches (four per NUMA node), each with one GPU and two EFA NICs,
/// plus NVSwitches, an ENA interface and a virtual interface. Returns the fake tree and, per GPU,
/// the names of the NICs on its switch.
fn p5en() -> (FakeSysfs, Vec<(String, u32, [String; 2])>) {
    let t = FakeSysfs::new();
    let mut expected = Vec::new();
    for s in 0u8..8 {
        let gpu_bus = 0x53 + 0x11 * s;
        let numa = u32::from(s / 4);
        let rp = root_port(&t, gpu_bus - 8);
        let sw = switch(&t, &rp, gpu_bus - 7, 3);
        let numa_s = numa.to_string();
        let gpu = format!("0000:{gpu_bus:02x}:00.0");
        t.device(
            &format!("{}/{gpu}", sw.ports[0]),
            NVIDIA,
            0x2335,
            GPU_CLASS,
            Some(&numa_s),
        );
        let mut nics = [String::new(), String::new()];
        for (k, nic_bus) in [gpu_bus - 4, gpu_bus - 3].into_iter().enumerate() {
            let path = format!("{}/0000:{nic_bus:02x}:00.0", sw.ports[k + 1]);
            t.device(&path, AMAZON, 0xefa2, NET_CLASS, Some(&numa_s));
            t.rdma(&efa_name(nic_bus), &path);
            nics[k] = efa_name(nic_bus);
        }
        expected.push((gpu, numa, nics));
    }
    // NVSwitches: NVIDIA bridge-class devices, not GPUs.
    for (i, bus) in [0x05u8, 0x06, 0x07, 0x08].into_iter().enumerate() {
        let rp = root_port(&t, bus);
        t.device(
            &format!("{rp}/0000:{:02x}:00.0", bus + 0x10),
            NVIDIA,
            0x22a3,
            0x06_80_00,
            Some(if i < 2 { "0" } else { "1" }),
        );
    }
    // ENA (Ethernet, same vendor as EFA) with a netdev, and a virtual interface.
    t.device(
        "pci0000:00/0000:00:05.0",
        AMAZON,
        0xec20,
        NET_CLASS,
        Some("0"),
    );
    t.class_entry("net", "enp0s5", "pci0000:00/0000:00:05.0");
    fs::create_dir_all(t.root().join("devices/virtual/net/lo")).unwrap();
    t.class_entry("net", "lo", "virtual/net/lo");
    (t, expected)
}

#[test]
fn p5en_each_gpu_gets_the_two_nics_on_its_switch() {
    let (t, expected) = p5en();
    let topo = read(&t);
    assert_eq!(topo.accelerators().len(), 8);
    assert_eq!(topo.rdma_nics().len(), 16);
    let mut used = BTreeSet::new();
    for (acc, (gpu, numa, nics)) in topo.accelerators().iter().zip(&expected) {
        assert_eq!(acc.address.to_string(), *gpu);
        assert_eq!(acc.kind, AcceleratorKind::Cuda);
        assert_eq!(acc.numa_node, Some(*numa));
        let choice = topo.rails_for(&acc.address).unwrap();
        assert_eq!(choice.rule, RailRule::PcieSwitch, "{gpu}");
        let mut want = nics.to_vec();
        want.sort();
        assert_eq!(choice.rails, want, "{gpu}");
        for r in &choice.rails {
            assert!(used.insert(r.clone()), "{r} given twice");
        }
    }
    assert_eq!(used.len(), 16);
    // The example of the issue.
    let first = topo.rails_for(&addr("00000000:53:00.0")).unwrap();
    assert_eq!(first.rails, ["rdmap79s0", "rdmap80s0"]);
    assert_eq!(
        topo.ucx_net_devices(&addr("0000:53:00.0")).unwrap(),
        "rdmap79s0:1,rdmap80s0:1"
    );
    // The ENA interface is read, the virtual one left out; neither is an RDMA NIC.
    let names: Vec<&str> = topo.net_interfaces().iter().map(|i| i.name()).collect();
    assert_eq!(names, ["enp0s5"]);
    assert!(topo.nic("enp0s5").is_none());
}

#[test]
fn p5en_override_wins_for_the_named_gpu_only() {
    let (t, _) = p5en();
    let o = RailOverrides::from_env_value(Some("0000:53:00.0=rdmap80s0".into())).unwrap();
    let topo = read(&t).with_overrides(&o).unwrap();
    let c = topo.rails_for(&addr("0000:53:00.0")).unwrap();
    assert_eq!(
        (c.rails.as_slice(), c.rule),
        (&["rdmap80s0".to_owned()][..], RailRule::Override)
    );
    assert_eq!(
        topo.rails_for(&addr("0000:64:00.0")).unwrap().rule,
        RailRule::PcieSwitch
    );
    let bad = RailOverrides::parse("0000:53:00.0=rdmap1s0").unwrap();
    let e = read(&t).with_overrides(&bad).unwrap_err();
    assert!(
        matches!(e, TopologyError::OverrideUnknownRail { .. }),
        "{e}"
    );
}

#[test]
fn p4d_two_gpus_share_the_nic_on_their_switch() {
    let t = FakeSysfs::new();
    let mut expected = Vec::new();
    for s in 0u8..4 {
        let base = 0x10 + 0x20 * s;
        let rp = root_port(&t, base);
        let sw = switch(&t, &rp, base + 1, 3);
        let numa = (s / 2).to_string();
        let nic_bus = base + 3;
        let nic_path = format!("{}/0000:{nic_bus:02x}:00.0", sw.ports[2]);
        t.device(&nic_path, AMAZON, 0xefa0, NET_CLASS, Some(&numa));
        t.rdma(&efa_name(nic_bus), &nic_path);
        for k in 0..2 {
            let gpu = format!("0000:{:02x}:00.0", base + 4 + k);
            t.device(
                &format!("{}/{gpu}", sw.ports[usize::from(k)]),
                NVIDIA,
                0x20b0,
                GPU_CLASS,
                Some(&numa),
            );
            expected.push((gpu, efa_name(nic_bus)));
        }
    }
    let topo = read(&t);
    assert_eq!(topo.accelerators().len(), 8);
    assert_eq!(topo.rdma_nics().len(), 4);
    for (gpu, nic) in expected {
        let c = topo.rails_for(&addr(&gpu)).unwrap();
        assert_eq!(c.rails, [nic], "{gpu}");
        assert_eq!(c.rule, RailRule::PcieSwitch);
    }
}

#[test]
fn two_levels_of_switches_prefer_the_deepest_shared_one() {
    // Root port -> outer switch -> inner switches A (GPU, two NICs), B (GPU, one NIC), C (GPU, no
    // NIC). GPU C reaches every NIC through the outer switch; A and B keep their own.
    let t = FakeSysfs::new();
    let rp = root_port(&t, 0x10);
    let outer = switch(&t, &rp, 0x11, 3);
    let a = switch(&t, &outer.ports[0], 0x20, 3);
    let b = switch(&t, &outer.ports[1], 0x30, 2);
    let c = switch(&t, &outer.ports[2], 0x40, 1);
    t.device(
        &format!("{}/0000:23:00.0", a.ports[0]),
        NVIDIA,
        0x2330,
        GPU_CLASS,
        Some("0"),
    );
    for (k, bus) in [(1usize, 0x24u8), (2, 0x25)] {
        let p = format!("{}/0000:{bus:02x}:00.0", a.ports[k]);
        t.device(&p, 0x15b3, 0x101d, NET_CLASS, Some("0"));
        t.rdma(&format!("mlx5_{}", bus - 0x24), &p);
    }
    t.device(
        &format!("{}/0000:33:00.0", b.ports[0]),
        NVIDIA,
        0x2330,
        GPU_CLASS,
        Some("0"),
    );
    let p = format!("{}/0000:34:00.0", b.ports[1]);
    t.device(&p, 0x15b3, 0x101d, NET_CLASS, Some("0"));
    t.rdma("mlx5_2", &p);
    t.device(
        &format!("{}/0000:43:00.0", c.ports[0]),
        NVIDIA,
        0x2330,
        GPU_CLASS,
        Some("0"),
    );

    let topo = read(&t);
    let got = |g: &str| {
        let c = topo.rails_for(&addr(g)).unwrap();
        (c.rails.clone(), c.rule)
    };
    assert_eq!(
        got("0000:23:00.0"),
        (vec!["mlx5_0".into(), "mlx5_1".into()], RailRule::PcieSwitch)
    );
    assert_eq!(
        got("0000:33:00.0"),
        (vec!["mlx5_2".into()], RailRule::PcieSwitch)
    );
    assert_eq!(
        got("0000:43:00.0"),
        (
            vec!["mlx5_0".into(), "mlx5_1".into(), "mlx5_2".into()],
            RailRule::PcieSwitch
        )
    );
    let dev = topo.device(&addr("0000:43:00.0")).unwrap();
    assert_eq!(
        dev.ancestors().len(),
        5,
        "root port, outer up/down, inner up/down"
    );
}

#[test]
fn gpu_without_nic_below_the_root_complex_uses_its_numa_node() {
    let t = FakeSysfs::new();
    // NUMA 0: a switch with a GPU and a NIC.
    let rp = root_port(&t, 0x10);
    let sw = switch(&t, &rp, 0x11, 2);
    t.device(
        &format!("{}/0000:13:00.0", sw.ports[0]),
        NVIDIA,
        0x2330,
        GPU_CLASS,
        Some("0"),
    );
    let p = format!("{}/0000:14:00.0", sw.ports[1]);
    t.device(&p, AMAZON, 0xefa1, NET_CLASS, Some("0"));
    t.rdma("rdmap20s0", &p);
    // NUMA 1: two NICs on their own root ports, and a lone GPU on a third.
    for (bus, name) in [(0x80u8, "rdmap129s0"), (0x90, "rdmap145s0")] {
        let rp = root_port(&t, bus);
        let p = format!("{rp}/0000:{:02x}:00.0", bus + 1);
        t.device(&p, AMAZON, 0xefa1, NET_CLASS, Some("1"));
        t.rdma(name, &p);
    }
    let rp = root_port(&t, 0xa0);
    t.device(
        &format!("{rp}/0000:a1:00.0"),
        NVIDIA,
        0x2330,
        GPU_CLASS,
        Some("1"),
    );
    // NUMA unknown (-1) and no numa_node file: every NIC, split between the two.
    let rp = root_port(&t, 0xb0);
    t.device(
        &format!("{rp}/0000:b1:00.0"),
        NVIDIA,
        0x2330,
        GPU_CLASS,
        Some("-1"),
    );
    let rp = root_port(&t, 0xc0);
    t.device(
        &format!("{rp}/0000:c1:00.0"),
        NVIDIA,
        0x2330,
        GPU_CLASS,
        None,
    );

    let topo = read(&t);
    let got = |g: &str| {
        let c = topo.rails_for(&addr(g)).unwrap();
        (c.rails.clone(), c.rule)
    };
    assert_eq!(
        got("0000:13:00.0"),
        (vec!["rdmap20s0".into()], RailRule::PcieSwitch)
    );
    assert_eq!(
        got("0000:a1:00.0"),
        (
            vec!["rdmap129s0".into(), "rdmap145s0".into()],
            RailRule::Numa
        )
    );
    let b1 = got("0000:b1:00.0");
    let c1 = got("0000:c1:00.0");
    assert_eq!((b1.1, c1.1), (RailRule::All, RailRule::All));
    assert_eq!(b1.0.len() + c1.0.len(), 3, "all three NICs, split");
    assert_eq!(
        topo.device(&addr("0000:b1:00.0")).unwrap().numa_node(),
        None
    );
    assert_eq!(
        topo.device(&addr("0000:c1:00.0")).unwrap().numa_node(),
        None
    );
}

#[test]
fn neuron_devices_are_accelerators_and_efa_is_not() {
    let t = FakeSysfs::new();
    let rp = root_port(&t, 0x10);
    let sw = switch(&t, &rp, 0x11, 2);
    t.device(
        &format!("{}/0000:13:00.0", sw.ports[0]),
        AMAZON,
        0x7164,
        0x08_80_00,
        Some("0"),
    );
    let p = format!("{}/0000:14:00.0", sw.ports[1]);
    t.device(&p, AMAZON, 0xefa1, NET_CLASS, Some("0"));
    t.rdma("rdmap20s0", &p);
    let topo = read(&t);
    assert_eq!(topo.accelerators().len(), 1);
    assert_eq!(topo.accelerators()[0].kind, AcceleratorKind::Neuron);
    assert_eq!(
        topo.rails_for(&addr("0000:13:00.0")).unwrap().rails,
        ["rdmap20s0"]
    );
}

#[test]
fn rdma_and_net_entries_without_a_pci_device_are_left_out() {
    let t = FakeSysfs::new();
    t.device("pci0000:00/0000:00:03.0", 0x1af4, 0x1000, NET_CLASS, None);
    // virtio-net: the netdev's device is a virtio device below the PCI function.
    fs::create_dir_all(t.root().join("devices/pci0000:00/0000:00:03.0/virtio2")).unwrap();
    t.class_entry("net", "eth0", "pci0000:00/0000:00:03.0/virtio2");
    // A software RDMA device with no device link at all.
    fs::create_dir_all(t.root().join("class/infiniband/siw0")).unwrap();
    let topo = read(&t);
    assert!(topo.rdma_nics().is_empty());
    assert_eq!(topo.net_interfaces().len(), 1);
    assert_eq!(topo.net_interfaces()[0].pci(), addr("0000:00:03.0"));
    assert!(topo.accelerators().is_empty());
}

#[test]
fn unreadable_root_is_an_error_naming_it() {
    let t = FakeSysfs::new();
    let missing = t.root().join("nope");
    let e = Topology::from_sysfs(&missing).unwrap_err();
    assert!(
        matches!(&e, TopologyError::ReadRoot { path, .. } if *path == missing),
        "{e}"
    );
    let empty = tempfile::tempdir().unwrap();
    let e = Topology::from_sysfs(empty.path()).unwrap_err();
    assert!(
        matches!(&e, TopologyError::NoPciBus { path } if path.ends_with("bus/pci/devices")),
        "{e}"
    );
}

#[test]
fn malformed_attributes_are_errors_naming_the_file() {
    for (file, content) in [
        ("class", "0xzz\n"),
        ("class", "0x1000000\n"),
        ("vendor", "0x10000\n"),
        ("device", "\n"),
        ("numa_node", "zero\n"),
        ("numa_node", "99999999999\n"),
    ] {
        let t = FakeSysfs::new();
        t.device(
            "pci0000:00/0000:00:04.0",
            NVIDIA,
            0x2330,
            GPU_CLASS,
            Some("0"),
        );
        let path = t.root().join("devices/pci0000:00/0000:00:04.0").join(file);
        fs::write(&path, content).unwrap();
        let e = Topology::from_sysfs(t.root()).unwrap_err();
        match &e {
            TopologyError::MalformedAttribute { path: p, value, .. } => {
                assert!(p.ends_with(file), "{e}");
                assert_eq!(value, content.trim());
            }
            other => panic!("{file}={content:?}: unexpected {other}"),
        }
        assert!(e.to_string().contains(file), "{e}");
    }
}

#[test]
fn missing_required_attribute_is_a_read_error() {
    let t = FakeSysfs::new();
    t.device(
        "pci0000:00/0000:00:04.0",
        NVIDIA,
        0x2330,
        GPU_CLASS,
        Some("0"),
    );
    fs::remove_file(t.root().join("devices/pci0000:00/0000:00:04.0/vendor")).unwrap();
    let e = Topology::from_sysfs(t.root()).unwrap_err();
    assert!(
        matches!(&e, TopologyError::ReadAttribute { path, .. } if path.ends_with("vendor")),
        "{e}"
    );
}

#[test]
fn bad_links_and_names_are_errors() {
    let t = FakeSysfs::new();
    symlink(
        "../../../devices/pci0000:00/0000:00:09.0",
        t.root().join("bus/pci/devices/0000:00:09.0"),
    )
    .unwrap();
    let e = Topology::from_sysfs(t.root()).unwrap_err();
    assert!(matches!(&e, TopologyError::ResolveLink { .. }), "{e}");

    let t = FakeSysfs::new();
    t.device(
        "pci0000:00/0000:00:04.0",
        NVIDIA,
        0x2330,
        GPU_CLASS,
        Some("0"),
    );
    symlink(
        "../../../devices/pci0000:00/0000:00:04.0",
        t.root().join("bus/pci/devices/0000:00:05.0"),
    )
    .unwrap();
    let e = Topology::from_sysfs(t.root()).unwrap_err();
    assert!(
        matches!(&e, TopologyError::LinkMismatch { address, .. } if *address == addr("0000:00:05.0")),
        "{e}"
    );

    let t = FakeSysfs::new();
    fs::create_dir(t.root().join("bus/pci/devices/junk")).unwrap();
    let e = Topology::from_sysfs(t.root()).unwrap_err();
    assert!(
        matches!(&e, TopologyError::DeviceName { path, .. } if path.ends_with("junk")),
        "{e}"
    );
}

/// This machine's own sysfs: whatever it holds must read without error, and the accelerators
/// found must be exactly the NVIDIA display-class and Neuron functions counted independently.
#[test]
fn this_machines_sysfs() {
    let devices = Path::new("/sys/bus/pci/devices");
    if !devices.is_dir() {
        eprintln!("SKIPPED: this machine has no /sys/bus/pci/devices");
        return;
    }
    let topo = Topology::from_sysfs("/sys").expect("the live sysfs reads");
    let hex = |p: PathBuf| {
        let s = fs::read_to_string(p).unwrap();
        u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).unwrap()
    };
    let mut independent = 0;
    for entry in fs::read_dir(devices).unwrap() {
        let dir = entry.unwrap().path();
        let (vendor, device, class) = (
            hex(dir.join("vendor")),
            hex(dir.join("device")),
            hex(dir.join("class")),
        );
        let gpu = vendor == 0x10de && class >> 16 == 0x03;
        let neuron = vendor == 0x1d0f
            && class >> 16 != 0x02
            && u16::try_from(device).is_ok_and(|d| NEURON_DEVICE_IDS.contains(&d));
        if gpu || neuron {
            independent += 1;
        }
    }
    assert_eq!(topo.accelerators().len(), independent);
    assert_eq!(topo.selection().count(), independent);
    assert!(topo.devices().count() > 0, "a PCI bus with no device");
    if independent == 0 {
        eprintln!(
            "this machine has no accelerator: empty selection ({} PCI devices, {} RDMA NICs read)",
            topo.devices().count(),
            topo.rdma_nics().len()
        );
    }
}
