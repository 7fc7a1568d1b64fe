//! The selection rule, on the in-memory model only (no I/O).
//!
//! 1. An accelerator's candidates are the RDMA NICs that share its deepest common PCIe ancestor
//!    (rule [`RailRule::PcieSwitch`]); sharing only the host bridge (root complex) does not count.
//! 2. With nothing shared below the root complex: the NICs on the accelerator's NUMA node
//!    ([`RailRule::Numa`]).
//! 3. Otherwise every NIC ([`RailRule::All`]).
//!
//! Accelerators that reach the same candidate set by the same rule split it evenly, in PCI-address
//! order; with fewer NICs than accelerators, they share.

use std::collections::BTreeMap;

use super::{Accelerator, PciAddress, PciDevice, RailChoice, RailRule, RdmaNic};

/// How many PCI devices, from the top, two chains (ancestors then the device) have in common.
/// Zero means nothing is shared below the root complex.
fn shared_depth(a: &[PciAddress], b: &[PciAddress]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The candidates for one accelerator: indices into `nics`, and the rule that found them.
fn candidates(
    devices: &BTreeMap<PciAddress, PciDevice>,
    accelerator: &Accelerator,
    nics: &[RdmaNic],
) -> (RailRule, Vec<usize>) {
    let chain = devices
        .get(&accelerator.address)
        .map(PciDevice::chain)
        .unwrap_or_default();
    let nic_chain = |nic: &RdmaNic| {
        devices
            .get(&nic.pci)
            .map(PciDevice::chain)
            .unwrap_or_default()
    };
    let depths: Vec<usize> = nics
        .iter()
        .map(|nic| shared_depth(&chain, &nic_chain(nic)))
        .collect();
    let deepest = depths.iter().copied().max().unwrap_or(0);
    if deepest > 0 {
        let picked = (0..nics.len()).filter(|&i| depths[i] == deepest).collect();
        return (RailRule::PcieSwitch, picked);
    }
    if let Some(node) = accelerator.numa_node {
        let picked: Vec<usize> = (0..nics.len())
            .filter(|&i| {
                devices
                    .get(&nics[i].pci)
                    .is_some_and(|d| d.numa_node() == Some(node))
            })
            .collect();
        if !picked.is_empty() {
            return (RailRule::Numa, picked);
        }
    }
    (RailRule::All, (0..nics.len()).collect())
}

/// Chooses every accelerator's rails. `accelerators` must be sorted by address and `nics` by
/// (PCI address, name); each returned rail list is sorted by name.
pub(super) fn select(
    devices: &BTreeMap<PciAddress, PciDevice>,
    accelerators: &[Accelerator],
    nics: &[RdmaNic],
) -> BTreeMap<PciAddress, RailChoice> {
    let mut groups: BTreeMap<(RailRule, Vec<usize>), Vec<PciAddress>> = BTreeMap::new();
    for accelerator in accelerators {
        groups
            .entry(candidates(devices, accelerator, nics))
            .or_default()
            .push(accelerator.address);
    }
    let mut out = BTreeMap::new();
    for ((rule, picked), mut members) in groups {
        members.sort();
        let k = members.len();
        let n = picked.len();
        for (i, address) in members.into_iter().enumerate() {
            let share: &[usize] = if n == 0 {
                &[]
            } else if n >= k {
                &picked[i * n / k..(i + 1) * n / k]
            } else {
                let j = i * n / k;
                &picked[j..=j]
            };
            let mut rails: Vec<String> = share.iter().map(|&j| nics[j].name.clone()).collect();
            rails.sort();
            out.insert(address, RailChoice { rails, rule });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_depth_counts_common_prefix() {
        let a: PciAddress = "0000:00:01.0".parse().unwrap();
        let b: PciAddress = "0000:01:00.0".parse().unwrap();
        let c: PciAddress = "0000:02:00.0".parse().unwrap();
        let d: PciAddress = "0000:03:00.0".parse().unwrap();
        assert_eq!(shared_depth(&[a, b, c], &[a, b, d]), 2);
        assert_eq!(shared_depth(&[a, c], &[b, c]), 0);
        assert_eq!(shared_depth(&[], &[a]), 0);
    }
}
