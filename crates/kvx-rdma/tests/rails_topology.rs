//! Choosing rails from a p5en-like fake sysfs tree: the libfabric domains each GPU's endpoint
//! opens (EFA names its domains `<device>-rdm`), overrides, fallbacks, and the
//! `UCX_NET_DEVICES` value NIXL gets from the same selection.
#![cfg(all(unix, any(feature = "libfabric", feature = "nixl")))]

use kvx_testkit::sysfs as fake_sysfs;

use kvx_rdma::topology::{PciAddress, RailOverrides, RailRule, Topology};

fn read(sysfs: &fake_sysfs::FakeSysfs) -> Topology {
    Topology::from_sysfs(sysfs.root()).expect("readable fake sysfs")
}

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

#[cfg(feature = "libfabric")]
mod libfabric {
    use kvx_rdma::libfabric::{select_rails, RailFallback, Rails, PROVIDER_EFA};

    use super::*;

    /// What `fi_getinfo` reports for efa on a p5en: one `-rdm` domain per NIC (16), in an order
    /// of its own.
    fn efa_domains(nics: &[(String, [String; 2])]) -> Vec<String> {
        let mut domains: Vec<String> = nics
            .iter()
            .flat_map(|(_, n)| n.iter().map(|d| format!("{d}-rdm")))
            .collect();
        domains.reverse();
        domains
    }

    #[test]
    fn p5en_gpus_open_the_two_efa_domains_on_their_switch() {
        let (sysfs, expected) = fake_sysfs::p5en();
        let topo = read(&sysfs);
        let offered = efa_domains(&expected);
        for (gpu, nics) in &expected {
            let s = select_rails(&topo, Some(&addr(gpu)), PROVIDER_EFA, &offered);
            let want: Vec<String> = nics.iter().map(|n| format!("{n}-rdm")).collect();
            assert_eq!(s.rails, Rails::Domains(want), "{gpu}");
            assert_eq!(s.rule, Some(RailRule::PcieSwitch));
            assert!(s.fallback.is_none() && s.unmatched.is_empty());
        }
    }

    #[test]
    fn p5en_override_and_fallbacks() {
        let (sysfs, expected) = fake_sysfs::p5en();
        let offered = efa_domains(&expected);
        let (gpu, nics) = &expected[3];
        let topo = read(&sysfs)
            .with_overrides(
                &format!("{gpu}={}", expected[5].1[1])
                    .parse::<RailOverrides>()
                    .unwrap(),
            )
            .unwrap();
        let s = select_rails(&topo, Some(&addr(gpu)), PROVIDER_EFA, &offered);
        assert_eq!(
            s.rails,
            Rails::Domains(vec![format!("{}-rdm", expected[5].1[1])])
        );
        assert_eq!(s.rule, Some(RailRule::Override));
        // The provider offers none of the GPU's NICs: the default domain, and why.
        let other: Vec<String> = offered
            .iter()
            .filter(|d| !nics.iter().any(|n| d.starts_with(n.as_str())))
            .cloned()
            .collect();
        let s = select_rails(&read(&sysfs), Some(&addr(gpu)), PROVIDER_EFA, &other);
        assert_eq!(s.rails, Rails::One);
        assert!(matches!(
            s.fallback,
            Some(RailFallback::NoMatchingDomain { .. })
        ));
        // Host memory: the default domain.
        let s = select_rails(&read(&sysfs), None, PROVIDER_EFA, &offered);
        assert_eq!(s.fallback, Some(RailFallback::HostMemory));
    }
}

#[cfg(feature = "nixl")]
mod nixl {
    use std::ffi::OsStr;

    use kvx_rdma::nixl::{ucx_net_devices_for, NixlConfig};

    use super::*;

    #[test]
    fn p5en_ucx_net_devices_follow_the_rails() {
        let (sysfs, expected) = fake_sysfs::p5en();
        let topo = read(&sysfs);
        for (gpu, nics) in &expected {
            let want = format!("{}:1,{}:1", nics[0], nics[1]);
            assert_eq!(
                ucx_net_devices_for(&topo, &addr(gpu), None).as_deref(),
                Some(want.as_str())
            );
            let config = NixlConfig::ucx().with_rails_of(&topo, &addr(gpu));
            assert_eq!(config.net_devices.as_deref(), Some(want.as_str()));
        }
        // The user's own value wins; a device that is not an accelerator has no rails.
        let gpu = addr(&expected[0].0);
        assert_eq!(
            ucx_net_devices_for(&topo, &gpu, Some(OsStr::new("mlx5_0:1"))),
            None
        );
        let nic_pci = addr("0000:4f:00.0");
        assert_eq!(ucx_net_devices_for(&topo, &nic_pci, None), None);
        assert_eq!(
            NixlConfig::ucx().with_rails_of(&topo, &nic_pci).net_devices,
            None
        );
    }
}
