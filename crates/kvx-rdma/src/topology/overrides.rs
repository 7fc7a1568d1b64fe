//! The explicit accelerator-to-NIC mapping that overrides the selection rule.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::str::FromStr;

use super::error::RailSpecError;
use super::pci::PciAddress;

/// An explicit mapping from accelerators to their rails, which overrides the rule for the
/// accelerators it names.
///
/// Format: entries separated by `;`, each `PCI_ADDRESS=NIC[,NIC...]`, for example
/// `0000:53:00.0=rdmap79s0,rdmap80s0;0000:64:00.0=rdmap81s0`. Spaces around entries, addresses and
/// names are ignored; an empty string is an empty mapping. Addresses are normalised (case, 4- or
/// 8-digit domain); each accelerator's NICs are sorted and deduplicated.
///
/// ```
/// use kvx_rdma::topology::{PciAddress, RailOverrides};
///
/// let o: RailOverrides = "0000:53:00.0=rdmap80s0,rdmap79s0; 00000000:64:00.0=rdmap81s0".parse()?;
/// let gpu: PciAddress = "0000:53:00.0".parse()?;
/// assert_eq!(o.get(&gpu), Some(&["rdmap79s0".to_owned(), "rdmap80s0".to_owned()][..]));
/// assert_eq!(o.len(), 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RailOverrides {
    map: BTreeMap<PciAddress, Vec<String>>,
}

impl RailOverrides {
    /// The environment variable that binaries read a mapping from (this crate reads none; see
    /// [`RailOverrides::from_env_value`]).
    pub const ENV_VAR: &'static str = "KVX_RAILS";

    /// An empty mapping: the rule applies everywhere.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses the mapping format described on the type.
    ///
    /// # Errors
    /// [`RailSpecError`] naming the malformed entry.
    pub fn parse(spec: &str) -> Result<Self, RailSpecError> {
        let mut map = BTreeMap::new();
        for raw in spec.split(';') {
            let entry = raw.trim();
            if entry.is_empty() {
                continue;
            }
            let Some((addr, nics)) = entry.split_once('=') else {
                return Err(RailSpecError::MissingEquals {
                    entry: entry.to_owned(),
                });
            };
            let address: PciAddress =
                addr.trim()
                    .parse()
                    .map_err(|source| RailSpecError::BadAddress {
                        entry: entry.to_owned(),
                        source,
                    })?;
            if nics.trim().is_empty() {
                return Err(RailSpecError::NoRails {
                    entry: entry.to_owned(),
                });
            }
            let mut rails = Vec::new();
            for name in nics.split(',') {
                let name = name.trim();
                check_rail_name(name).map_err(|reason| RailSpecError::BadRailName {
                    entry: entry.to_owned(),
                    name: name.to_owned(),
                    reason,
                })?;
                rails.push(name.to_owned());
            }
            rails.sort();
            rails.dedup();
            if map.insert(address, rails).is_some() {
                return Err(RailSpecError::DuplicateAccelerator { address });
            }
        }
        Ok(Self { map })
    }

    /// The mapping in a value of [`RailOverrides::ENV_VAR`] that the caller (a binary: `kvx`,
    /// the vLLM plugin) took from its environment; this crate reads no environment. Unset or
    /// empty is an empty mapping.
    ///
    /// # Errors
    /// [`RailSpecError`] when the value is not UTF-8 or malformed.
    pub fn from_env_value(value: Option<OsString>) -> Result<Self, RailSpecError> {
        match value {
            None => Ok(Self::new()),
            Some(v) => {
                let s = v
                    .into_string()
                    .map_err(|_| RailSpecError::EnvNotUnicode { var: Self::ENV_VAR })?;
                Self::parse(&s)
            }
        }
    }

    /// The NICs given for an accelerator, sorted.
    #[must_use]
    pub fn get(&self, accelerator: &PciAddress) -> Option<&[String]> {
        self.map.get(accelerator).map(Vec::as_slice)
    }

    /// The number of accelerators named.
    #[must_use]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the mapping names no accelerator.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The entries, in PCI-address order.
    pub fn iter(&self) -> impl Iterator<Item = (&PciAddress, &[String])> {
        self.map.iter().map(|(a, r)| (a, r.as_slice()))
    }
}

impl FromStr for RailOverrides {
    type Err = RailSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// A NIC name as the kernel writes it: not empty, no whitespace, no `/`; no `:` either (that is
/// UCX's port suffix, added by [`super::ucx_net_devices`], not part of the name).
fn check_rail_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        Err("empty name")
    } else if name.chars().any(char::is_whitespace) {
        Err("contains whitespace")
    } else if name.contains(':') {
        Err("contains `:` (give the device name without a port; `mlx5_0`, not `mlx5_0:1`)")
    } else if name.contains(['/', '=']) {
        Err("contains `/` or `=`")
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    #[test]
    fn parses_entries_and_normalises() {
        let o = RailOverrides::parse(
            " 0000:64:00.0 = b , a ;00000000:53:00.0=rdmap79s0,rdmap79s0;0000:AB:00.0=x;",
        )
        .unwrap();
        assert_eq!(o.len(), 3);
        assert_eq!(o.get(&addr("0000:64:00.0")).unwrap(), ["a", "b"]);
        assert_eq!(o.get(&addr("0000:53:00.0")).unwrap(), ["rdmap79s0"]);
        assert_eq!(o.get(&addr("0000:ab:00.0")).unwrap(), ["x"]);
        let order: Vec<String> = o.iter().map(|(a, _)| a.to_string()).collect();
        assert_eq!(order, ["0000:53:00.0", "0000:64:00.0", "0000:ab:00.0"]);
    }

    #[test]
    fn empty_spec_is_empty_mapping() {
        assert!(RailOverrides::parse("").unwrap().is_empty());
        assert!(RailOverrides::parse(" ; ;").unwrap().is_empty());
        assert!(RailOverrides::from_env_value(None).unwrap().is_empty());
        assert!(RailOverrides::from_env_value(Some("".into()))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn env_value_is_parsed() {
        let o = RailOverrides::from_env_value(Some("0000:53:00.0=n1".into())).unwrap();
        assert_eq!(o.get(&addr("0000:53:00.0")).unwrap(), ["n1"]);
    }

    #[cfg(unix)]
    #[test]
    fn non_utf8_env_value_is_an_error() {
        use std::os::unix::ffi::OsStringExt;
        let e =
            RailOverrides::from_env_value(Some(OsString::from_vec(vec![0xff, b'=']))).unwrap_err();
        assert_eq!(e, RailSpecError::EnvNotUnicode { var: "KVX_RAILS" });
    }

    #[test]
    fn malformed_entries_are_named() {
        let e = RailOverrides::parse("0000:53:00.0=a;0000:64:00.0").unwrap_err();
        assert_eq!(
            e,
            RailSpecError::MissingEquals {
                entry: "0000:64:00.0".into()
            }
        );
        let e = RailOverrides::parse("53:00.0=a").unwrap_err();
        assert!(matches!(&e, RailSpecError::BadAddress { entry, .. } if entry == "53:00.0=a"));
        let e = RailOverrides::parse("0000:53:00.0= ").unwrap_err();
        assert!(matches!(e, RailSpecError::NoRails { .. }));
        let e = RailOverrides::parse("0000:53:00.0=a,,b").unwrap_err();
        assert!(matches!(&e, RailSpecError::BadRailName { name, .. } if name.is_empty()));
        let e = RailOverrides::parse("0000:53:00.0=mlx5_0:1").unwrap_err();
        assert!(matches!(&e, RailSpecError::BadRailName { name, .. } if name == "mlx5_0:1"));
        let e = RailOverrides::parse("0000:53:00.0=a b").unwrap_err();
        assert!(
            matches!(&e, RailSpecError::BadRailName { reason, .. } if reason.contains("whitespace"))
        );
        let e = RailOverrides::parse("0000:53:00.0=a=b").unwrap_err();
        assert!(matches!(e, RailSpecError::BadRailName { .. }));
        let e = RailOverrides::parse("0000:53:00.0=a;00000000:53:00.0=b").unwrap_err();
        assert_eq!(
            e,
            RailSpecError::DuplicateAccelerator {
                address: addr("0000:53:00.0")
            }
        );
        assert!(e.to_string().contains("0000:53:00.0"));
    }
}
