//! Unit tests of the model and the selection rule on in-memory data.

use super::*;

fn a(s: &str) -> PciAddress {
    s.parse().unwrap()
}

fn gpu(addr: &str, numa: Option<u32>, above: &[&str]) -> PciDevice {
    PciDevice::new(a(addr), VENDOR_NVIDIA, 0x2335, 0x03_02_00)
        .with_numa_node(numa)
        .with_ancestors(above.iter().map(|s| a(s)).collect())
}

fn efa(addr: &str, numa: Option<u32>, above: &[&str]) -> PciDevice {
    PciDevice::new(a(addr), VENDOR_AMAZON, 0xefa2, 0x02_00_00)
        .with_numa_node(numa)
        .with_ancestors(above.iter().map(|s| a(s)).collect())
}

fn bridge(addr: &str, above: &[&str]) -> PciDevice {
    PciDevice::new(a(addr), 0x1000, 0xc030, 0x06_04_00)
        .with_ancestors(above.iter().map(|s| a(s)).collect())
}

fn rails(t: &Topology, addr: &str) -> (Vec<String>, RailRule) {
    let c = t.rails_for(&a(addr)).expect("an accelerator");
    (c.rails.clone(), c.rule)
}

#[test]
fn classifies_accelerators() {
    assert_eq!(
        AcceleratorKind::classify(VENDOR_NVIDIA, 0x2335, 0x03_02_00),
        Some(AcceleratorKind::Cuda)
    );
    assert_eq!(
        AcceleratorKind::classify(VENDOR_NVIDIA, 0x1db1, 0x03_00_00),
        Some(AcceleratorKind::Cuda)
    );
    // NVSwitch: a bridge-class NVIDIA device.
    assert_eq!(
        AcceleratorKind::classify(VENDOR_NVIDIA, 0x22a3, 0x06_80_00),
        None
    );
    // NVIDIA HD audio function.
    assert_eq!(
        AcceleratorKind::classify(VENDOR_NVIDIA, 0x10f0, 0x04_03_00),
        None
    );
    assert_eq!(
        AcceleratorKind::classify(VENDOR_AMAZON, 0x7164, 0x08_80_00),
        Some(AcceleratorKind::Neuron)
    );
    assert_eq!(
        AcceleratorKind::classify(VENDOR_AMAZON, 0x7364, 0x12_00_00),
        Some(AcceleratorKind::Neuron)
    );
    // ENA, EFA, EBS NVMe and the Nitro VGA device are not accelerators.
    assert_eq!(
        AcceleratorKind::classify(VENDOR_AMAZON, 0xec20, 0x02_00_00),
        None
    );
    assert_eq!(
        AcceleratorKind::classify(VENDOR_AMAZON, 0xefa2, 0x02_00_00),
        None
    );
    assert_eq!(
        AcceleratorKind::classify(VENDOR_AMAZON, 0x8061, 0x01_08_02),
        None
    );
    assert_eq!(
        AcceleratorKind::classify(VENDOR_AMAZON, 0x1111, 0x03_00_00),
        None
    );
    // A network-class function with a Neuron id is still not an accelerator.
    assert_eq!(
        AcceleratorKind::classify(VENDOR_AMAZON, 0x7164, 0x02_00_00),
        None
    );
    assert_eq!(AcceleratorKind::Cuda.to_string(), "cuda");
    assert_eq!(AcceleratorKind::Neuron.as_str(), "neuron");
}

#[test]
fn rule_names() {
    let names: Vec<&str> = [
        RailRule::PcieSwitch,
        RailRule::Numa,
        RailRule::All,
        RailRule::Override,
    ]
    .iter()
    .map(|r| r.as_str())
    .collect();
    assert_eq!(names, ["pcie-switch", "numa", "all", "override"]);
    assert_eq!(RailRule::PcieSwitch.to_string(), "pcie-switch");
}

/// Two switches under one root port each, one GPU and two NICs per switch.
fn two_switches() -> Topology {
    let devices = vec![
        bridge("0000:00:01.0", &[]),
        bridge("0000:01:00.0", &["0000:00:01.0"]),
        gpu("0000:02:00.0", Some(0), &["0000:00:01.0", "0000:01:00.0"]),
        efa("0000:03:00.0", Some(0), &["0000:00:01.0", "0000:01:00.0"]),
        efa("0000:04:00.0", Some(0), &["0000:00:01.0", "0000:01:00.0"]),
        bridge("0000:00:02.0", &[]),
        bridge("0000:11:00.0", &["0000:00:02.0"]),
        gpu("0000:12:00.0", Some(0), &["0000:00:02.0", "0000:11:00.0"]),
        efa("0000:13:00.0", Some(0), &["0000:00:02.0", "0000:11:00.0"]),
        efa("0000:14:00.0", Some(0), &["0000:00:02.0", "0000:11:00.0"]),
    ];
    let nics = vec![
        RdmaNic::new("rdmap20s0", a("0000:14:00.0")),
        RdmaNic::new("rdmap19s0", a("0000:13:00.0")),
        RdmaNic::new("rdmap4s0", a("0000:04:00.0")),
        RdmaNic::new("rdmap3s0", a("0000:03:00.0")).with_port(2),
    ];
    Topology::from_parts(devices, nics, Vec::new()).unwrap()
}

#[test]
fn each_gpu_gets_the_nics_on_its_switch() {
    let t = two_switches();
    assert_eq!(t.accelerators().len(), 2);
    assert_eq!(
        rails(&t, "0000:02:00.0"),
        (
            vec!["rdmap3s0".into(), "rdmap4s0".into()],
            RailRule::PcieSwitch
        )
    );
    assert_eq!(
        rails(&t, "0000:12:00.0"),
        (
            vec!["rdmap19s0".into(), "rdmap20s0".into()],
            RailRule::PcieSwitch
        )
    );
    assert!(
        t.rails_for(&a("0000:03:00.0")).is_none(),
        "a NIC is no accelerator"
    );
    assert_eq!(
        t.ucx_net_devices(&a("0000:02:00.0")).unwrap(),
        "rdmap3s0:2,rdmap4s0:1"
    );
    assert_eq!(t.ucx_net_devices(&a("0000:03:00.0")), None);
    let order: Vec<String> = t.rdma_nics().iter().map(|n| n.name().to_owned()).collect();
    assert_eq!(order, ["rdmap3s0", "rdmap4s0", "rdmap19s0", "rdmap20s0"]);
}

#[test]
fn gpus_sharing_nearest_nics_split_them_in_address_order() {
    // One switch, three GPUs and four NICs: 1 + 1 + 2.
    let up = ["0000:00:01.0", "0000:01:00.0"];
    let mut devices = vec![
        bridge("0000:00:01.0", &[]),
        bridge("0000:01:00.0", &["0000:00:01.0"]),
    ];
    for g in ["0000:05:00.0", "0000:02:00.0", "0000:03:00.0"] {
        devices.push(gpu(g, Some(0), &up));
    }
    let mut nics = Vec::new();
    for (i, n) in [
        "0000:10:00.0",
        "0000:11:00.0",
        "0000:12:00.0",
        "0000:13:00.0",
    ]
    .iter()
    .enumerate()
    {
        devices.push(efa(n, Some(0), &up));
        nics.push(RdmaNic::new(format!("nic{}", 9 - i), a(n)));
    }
    let t = Topology::from_parts(devices, nics, Vec::new()).unwrap();
    assert_eq!(rails(&t, "0000:02:00.0").0, ["nic9"]);
    assert_eq!(rails(&t, "0000:03:00.0").0, ["nic8"]);
    assert_eq!(rails(&t, "0000:05:00.0").0, ["nic6", "nic7"]);
    for g in t.accelerators() {
        assert_eq!(t.rails_for(&g.address).unwrap().rule, RailRule::PcieSwitch);
    }
}

#[test]
fn fewer_nics_than_gpus_share() {
    // One switch, four GPUs and two NICs: two GPUs per NIC.
    let up = ["0000:00:01.0", "0000:01:00.0"];
    let mut devices = vec![
        bridge("0000:00:01.0", &[]),
        bridge("0000:01:00.0", &["0000:00:01.0"]),
    ];
    for g in [
        "0000:02:00.0",
        "0000:03:00.0",
        "0000:04:00.0",
        "0000:05:00.0",
    ] {
        devices.push(gpu(g, None, &up));
    }
    devices.push(efa("0000:06:00.0", None, &up));
    devices.push(efa("0000:07:00.0", None, &up));
    let nics = vec![
        RdmaNic::new("b", a("0000:06:00.0")),
        RdmaNic::new("a", a("0000:07:00.0")),
    ];
    let t = Topology::from_parts(devices, nics, Vec::new()).unwrap();
    let got: Vec<Vec<String>> = t.selection().map(|(_, c)| c.rails.clone()).collect();
    assert_eq!(got, [["b"], ["b"], ["a"], ["a"]]);
}

#[test]
fn deeper_switch_wins_over_shallower_one() {
    // Outer switch 0000:01 with inner switches 0000:03 (GPU A, NIC x) and 0000:04 (GPU B, no
    // NIC); NIC y directly on the outer switch.
    let outer = ["0000:00:01.0", "0000:01:00.0", "0000:02:00.0"];
    let inner_a = [
        "0000:00:01.0",
        "0000:01:00.0",
        "0000:02:00.0",
        "0000:03:00.0",
    ];
    let inner_b = [
        "0000:00:01.0",
        "0000:01:00.0",
        "0000:02:01.0",
        "0000:04:00.0",
    ];
    let devices = vec![
        gpu("0000:05:00.0", Some(0), &inner_a),
        efa("0000:06:00.0", Some(0), &inner_a),
        gpu("0000:07:00.0", Some(0), &inner_b),
        efa("0000:08:00.0", Some(0), &outer),
    ];
    let nics = vec![
        RdmaNic::new("x", a("0000:06:00.0")),
        RdmaNic::new("y", a("0000:08:00.0")),
    ];
    let t = Topology::from_parts(devices, nics, Vec::new()).unwrap();
    assert_eq!(
        rails(&t, "0000:05:00.0"),
        (vec!["x".into()], RailRule::PcieSwitch)
    );
    // GPU B shares only 0000:01:00.0 with both NICs: both are nearest.
    assert_eq!(
        rails(&t, "0000:07:00.0"),
        (vec!["x".into(), "y".into()], RailRule::PcieSwitch)
    );
}

#[test]
fn numa_then_all_fallbacks() {
    let devices = vec![
        gpu("0000:02:00.0", Some(1), &["0000:00:01.0"]),
        gpu("0000:03:00.0", Some(2), &["0000:00:02.0"]),
        gpu("0000:04:00.0", None, &["0000:00:03.0"]),
        efa("0000:10:00.0", Some(1), &["0000:00:04.0"]),
        efa("0000:11:00.0", Some(0), &["0000:00:05.0"]),
    ];
    let nics = vec![
        RdmaNic::new("n1", a("0000:10:00.0")),
        RdmaNic::new("n0", a("0000:11:00.0")),
    ];
    let t = Topology::from_parts(devices, nics, Vec::new()).unwrap();
    assert_eq!(
        rails(&t, "0000:02:00.0"),
        (vec!["n1".into()], RailRule::Numa)
    );
    // NUMA node 2 has no NIC and the third GPU has no node: both fall back to all NICs, which
    // they split.
    assert_eq!(
        rails(&t, "0000:03:00.0"),
        (vec!["n1".into()], RailRule::All)
    );
    assert_eq!(
        rails(&t, "0000:04:00.0"),
        (vec!["n0".into()], RailRule::All)
    );
}

#[test]
fn host_without_nics_gives_empty_rails() {
    let t = Topology::from_parts(vec![gpu("0000:02:00.0", Some(0), &[])], vec![], vec![]).unwrap();
    assert_eq!(rails(&t, "0000:02:00.0"), (vec![], RailRule::All));
    assert_eq!(t.ucx_net_devices(&a("0000:02:00.0")).unwrap(), "");
}

#[test]
fn host_without_accelerators_selects_nothing() {
    let t = Topology::from_parts(
        vec![efa("0000:10:00.0", Some(0), &[])],
        vec![RdmaNic::new("n", a("0000:10:00.0"))],
        vec![NetInterface::new("eth0", a("0000:10:00.0"))],
    )
    .unwrap();
    assert!(t.accelerators().is_empty());
    assert_eq!(t.selection().count(), 0);
    assert_eq!(t.interfaces_on(a("0000:10:00.0")).count(), 1);
}

#[test]
fn overrides_replace_the_rule_for_named_accelerators() {
    let t = two_switches();
    let o = RailOverrides::parse("0000:02:00.0=rdmap20s0,rdmap3s0").unwrap();
    let t = t.with_overrides(&o).unwrap();
    assert_eq!(
        rails(&t, "0000:02:00.0"),
        (
            vec!["rdmap20s0".into(), "rdmap3s0".into()],
            RailRule::Override
        )
    );
    assert_eq!(rails(&t, "0000:12:00.0").1, RailRule::PcieSwitch);
}

#[test]
fn overrides_naming_unknown_devices_are_rejected() {
    let o = RailOverrides::parse("0000:03:00.0=rdmap3s0").unwrap();
    let e = two_switches().with_overrides(&o).unwrap_err();
    assert!(
        matches!(e, TopologyError::OverrideUnknownAccelerator { address } if address == a("0000:03:00.0"))
    );
    let o = RailOverrides::parse("0000:02:00.0=rdmap3s0,mlx5_0").unwrap();
    let e = two_switches().with_overrides(&o).unwrap_err();
    assert!(matches!(&e, TopologyError::OverrideUnknownRail { rail, .. } if rail == "mlx5_0"));
    assert!(e.to_string().contains("mlx5_0"));
}

#[test]
fn inconsistent_parts_are_rejected() {
    let e = Topology::from_parts(
        vec![
            gpu("0000:02:00.0", None, &[]),
            gpu("0000:02:00.0", None, &[]),
        ],
        vec![],
        vec![],
    )
    .unwrap_err();
    assert!(matches!(e, TopologyError::DuplicateDevice { .. }));
    let e = Topology::from_parts(
        vec![gpu("0000:02:00.0", None, &[])],
        vec![RdmaNic::new("n", a("0000:09:00.0"))],
        vec![],
    )
    .unwrap_err();
    assert!(matches!(&e, TopologyError::DanglingInterface { name, .. } if name == "n"));
    let e = Topology::from_parts(
        vec![
            efa("0000:10:00.0", None, &[]),
            efa("0000:11:00.0", None, &[]),
        ],
        vec![
            RdmaNic::new("n", a("0000:10:00.0")),
            RdmaNic::new("n", a("0000:11:00.0")),
        ],
        vec![],
    )
    .unwrap_err();
    assert!(matches!(&e, TopologyError::DuplicateNic { name } if name == "n"));
}

#[test]
fn free_ucx_net_devices_uses_port_one() {
    assert_eq!(ucx_net_devices(&["mlx5_0", "mlx5_1"]), "mlx5_0:1,mlx5_1:1");
    assert_eq!(ucx_net_devices::<&str>(&[]), "");
}
