//! PCI addresses (`DDDD:BB:DD.F`), parsed case-insensitively and printed in the kernel's form.

use std::fmt;
use std::ops::RangeInclusive;
use std::str::FromStr;

/// A PCI function address: domain, bus, device and function.
///
/// Parsing accepts upper or lower case hexadecimal and a domain of four to eight digits
/// (`nvidia-smi` prints eight, the kernel four); printing always uses the kernel's form, lower case
/// with a four-digit domain (wider only for domains above `ffff`, as the kernel does for VMD).
///
/// ```
/// use kvx_rdma::topology::PciAddress;
///
/// let a: PciAddress = "00000000:53:00.0".parse()?;
/// let b: PciAddress = "0000:53:00.0".parse()?;
/// assert_eq!(a, b);
/// assert_eq!("0000:5A:00.1".parse::<PciAddress>()?.to_string(), "0000:5a:00.1");
/// # Ok::<(), kvx_rdma::topology::ParsePciAddressError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    domain: u32,
    bus: u8,
    device: u8,
    function: u8,
}

/// Why a string is not a PCI address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid PCI address `{input}`: {reason} (expected DDDD:BB:DD.F, e.g. 0000:53:00.0)")]
#[non_exhaustive]
pub struct ParsePciAddressError {
    /// The rejected input.
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl PciAddress {
    /// Highest device number on a bus.
    pub const MAX_DEVICE: u8 = 0x1f;
    /// Highest function number of a device.
    pub const MAX_FUNCTION: u8 = 7;

    /// An address from its parts, or `None` when `device` or `function` is out of range.
    #[must_use]
    pub const fn new(domain: u32, bus: u8, device: u8, function: u8) -> Option<Self> {
        if device > Self::MAX_DEVICE || function > Self::MAX_FUNCTION {
            return None;
        }
        Some(Self {
            domain,
            bus,
            device,
            function,
        })
    }

    /// The PCI domain (segment).
    #[must_use]
    pub const fn domain(self) -> u32 {
        self.domain
    }

    /// The bus number.
    #[must_use]
    pub const fn bus(self) -> u8 {
        self.bus
    }

    /// The device number on the bus.
    #[must_use]
    pub const fn device(self) -> u8 {
        self.device
    }

    /// The function number of the device.
    #[must_use]
    pub const fn function(self) -> u8 {
        self.function
    }
}

/// One hexadecimal field of `digits` digits (`len_reason` says what is wrong when the length is off).
fn hex_field(
    field: &str,
    digits: RangeInclusive<usize>,
    len_reason: &'static str,
) -> Result<u32, &'static str> {
    if !digits.contains(&field.len()) {
        return Err(len_reason);
    }
    if !field.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("a field is not hexadecimal");
    }
    // At most 8 hexadecimal digits: always fits in a u32.
    u32::from_str_radix(field, 16).map_err(|_| "a field is not hexadecimal")
}

impl FromStr for PciAddress {
    type Err = ParsePciAddressError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParsePciAddressError {
            input: s.to_owned(),
            reason,
        };
        let trimmed = s.trim();
        let mut parts = trimmed.split(':');
        let (Some(domain), Some(bus), Some(dev_fn), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(err("expected three `:`-separated fields"));
        };
        let Some((dev, func)) = dev_fn.split_once('.') else {
            return Err(err("missing `.` before the function number"));
        };
        let domain = hex_field(
            domain,
            4..=8,
            "the domain must have 4 to 8 hexadecimal digits",
        )
        .map_err(err)?;
        let bus = hex_field(bus, 2..=2, "the bus must have 2 hexadecimal digits").map_err(err)?;
        let dev =
            hex_field(dev, 2..=2, "the device must have 2 hexadecimal digits").map_err(err)?;
        let func = hex_field(func, 1..=1, "the function must be one digit").map_err(err)?;
        let (Ok(bus), Ok(dev), Ok(func)) =
            (u8::try_from(bus), u8::try_from(dev), u8::try_from(func))
        else {
            return Err(err("field out of range"));
        };
        if dev > Self::MAX_DEVICE {
            return Err(err("the device number must be at most 1f"));
        }
        if func > Self::MAX_FUNCTION {
            return Err(err("the function number must be at most 7"));
        }
        Ok(Self {
            domain,
            bus,
            device: dev,
            function: func,
        })
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<PciAddress, ParsePciAddressError> {
        s.parse()
    }

    #[test]
    fn parses_and_normalises() {
        let a = parse("0000:53:00.0").unwrap();
        assert_eq!(
            (a.domain(), a.bus(), a.device(), a.function()),
            (0, 0x53, 0, 0)
        );
        assert_eq!(parse("00000000:53:00.0").unwrap(), a);
        assert_eq!(parse(" 0000:53:00.0\n").unwrap(), a);
        let b = parse("0000:AB:1F.7").unwrap();
        assert_eq!(b.to_string(), "0000:ab:1f.7");
        assert_eq!(parse("10000:00:01.0").unwrap().to_string(), "10000:00:01.0");
        assert_eq!(
            parse("0001ABCD:00:01.0").unwrap().to_string(),
            "1abcd:00:01.0"
        );
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "",
            "53:00.0",
            "000:53:00.0",
            "000000000:53:00.0",
            "0000:5:00.0",
            "0000:53:0.0",
            "0000:53:00",
            "0000:53:00.8",
            "0000:53:20.0",
            "0000:53:00.00",
            "0000:g3:00.0",
            "0000:53:00.0:1",
            "pci0000:00",
            "0000:+5:00.0",
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.input, bad, "{bad}");
            assert!(e.to_string().contains("invalid PCI address"), "{e}");
        }
    }

    #[test]
    fn orders_by_domain_bus_device_function() {
        let mut v = [
            parse("0001:00:00.0").unwrap(),
            parse("0000:53:00.1").unwrap(),
            parse("0000:53:00.0").unwrap(),
            parse("0000:0a:01.0").unwrap(),
        ];
        v.sort();
        let s: Vec<String> = v.iter().map(ToString::to_string).collect();
        assert_eq!(
            s,
            [
                "0000:0a:01.0",
                "0000:53:00.0",
                "0000:53:00.1",
                "0001:00:00.0"
            ]
        );
    }

    #[test]
    fn new_checks_ranges() {
        assert!(PciAddress::new(0, 1, 0x1f, 7).is_some());
        assert!(PciAddress::new(0, 1, 0x20, 0).is_none());
        assert!(PciAddress::new(0, 1, 0, 8).is_none());
    }
}
