//! The endpoint address of a multi-rail libfabric endpoint.
//!
//! A single-rail endpoint's [`EndpointDesc::address`](crate::EndpointDesc::address) is the
//! provider's own address, unchanged: an address that does not begin with the table's magic is
//! one rail, so single-rail endpoints need no table. A multi-rail endpoint's address is a table,
//! little-endian:
//!
//! ```text
//! magic "KVXRAILS" | version u8 (1) | rails u8 (2..=255)
//! per rail:   address length u16 | provider address | notice-slot addr u64 | notice-slot key u64
//! regions u32 | per region: index u32 | key u64 on each rail after the first
//! ```
//!
//! Rail 0's notice slot and region keys are also the description's own
//! [`notice_slot`](crate::EndpointDesc::notice_slot) and [`RegionDesc::key`](kvx_core::RegionDesc)
//! (region addresses are the same on every rail: one provider, one addressing mode), so a
//! single-rail peer reads rail 0 from the table and ignores the rest. The magic cannot begin a
//! provider address in practice (`shm` names, `sockaddr`s and EFA GIDs all start otherwise).

use std::collections::HashMap;

use crate::desc::{DescError, EndpointDesc, NoticeSlot};

/// Opens a multi-rail address table.
pub(crate) const MAGIC: &[u8; 8] = b"KVXRAILS";
/// Version of the table.
const VERSION: u8 = 1;
/// Most rails a table holds.
pub(crate) const MAX_RAILS: usize = u8::MAX as usize;

/// One rail of a peer: its provider address and notice slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RailAddress {
    pub(crate) address: Vec<u8>,
    pub(crate) notice: NoticeSlot,
}

/// A peer's rails, decoded from its description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PeerRails {
    pub(crate) rails: Vec<RailAddress>,
    /// Region keys on rails 1.. (`keys[r - 1][&index]`); rail 0's are the description's.
    pub(crate) keys: Vec<HashMap<u32, u64>>,
}

impl PeerRails {
    /// The key of region `index` on rail `rail` of the peer described by `desc`.
    pub(crate) fn key(&self, desc: &EndpointDesc, rail: usize, index: u32) -> Option<u64> {
        if rail == 0 {
            desc.region(index).map(|r| r.key)
        } else {
            self.keys.get(rail - 1)?.get(&index).copied()
        }
    }
}

/// One local rail, as encoded.
pub(crate) struct LocalRail<'a> {
    pub(crate) address: &'a [u8],
    pub(crate) notice: NoticeSlot,
}

/// Encodes the table of a multi-rail endpoint; `keys` lists each region's index with its keys on
/// rails 1.. (`rails.len() - 1` keys each).
pub(crate) fn encode(rails: &[LocalRail<'_>], keys: &[(u32, Vec<u64>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        16 + rails.iter().map(|r| r.address.len() + 18).sum::<usize>()
            + keys.len() * (4 + 8 * rails.len()),
    );
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.push(u8::try_from(rails.len()).unwrap_or(u8::MAX));
    for rail in rails.iter().take(MAX_RAILS) {
        // Provider addresses are tens of bytes; clamp rather than wrap (a clamped address fails
        // to decode instead of decoding as something else).
        let len = u16::try_from(rail.address.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&rail.address[..usize::from(len)]);
        out.extend_from_slice(&rail.notice.addr.to_le_bytes());
        out.extend_from_slice(&rail.notice.key.to_le_bytes());
    }
    out.extend_from_slice(&u32::try_from(keys.len()).unwrap_or(u32::MAX).to_le_bytes());
    for (index, rail_keys) in keys {
        out.extend_from_slice(&index.to_le_bytes());
        for key in rail_keys {
            out.extend_from_slice(&key.to_le_bytes());
        }
    }
    out
}

/// Decodes a peer's rails from its description: the table of a multi-rail endpoint, or the
/// provider address of a single-rail one.
///
/// # Errors
/// A [`DescError`] for a table that is truncated, too long, of another version, or whose region
/// keys do not match the description's region table.
pub(crate) fn decode(desc: &EndpointDesc, notice: NoticeSlot) -> Result<PeerRails, DescError> {
    let Some(mut rest) = desc.address.strip_prefix(MAGIC.as_slice()) else {
        return Ok(PeerRails {
            rails: vec![RailAddress {
                address: desc.address.clone(),
                notice,
            }],
            keys: Vec::new(),
        });
    };
    let mut take = |n: usize, what: &'static str| -> Result<&[u8], DescError> {
        if rest.len() < n {
            return Err(DescError::Truncated { what });
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    let u64_at = |b: &[u8]| {
        let mut a = [0; 8];
        a.copy_from_slice(b);
        u64::from_le_bytes(a)
    };
    let version = take(1, "rail table version")?[0];
    if version != VERSION {
        return Err(DescError::Version(version));
    }
    let count = usize::from(take(1, "rail count")?[0]);
    if count == 0 {
        return Err(DescError::Truncated { what: "rail table" });
    }
    let mut rails = Vec::with_capacity(count);
    for _ in 0..count {
        let len = take(2, "rail address")?;
        let len = usize::from(u16::from_le_bytes([len[0], len[1]]));
        if len == 0 {
            return Err(DescError::EmptyAddress);
        }
        let address = take(len, "rail address")?.to_vec();
        let addr = u64_at(take(8, "rail notice slot")?);
        let key = u64_at(take(8, "rail notice slot")?);
        rails.push(RailAddress {
            address,
            notice: NoticeSlot {
                addr,
                key,
                len: notice.len,
            },
        });
    }
    let regions = take(4, "rail keys")?;
    let regions = u32::from_le_bytes([regions[0], regions[1], regions[2], regions[3]]) as usize;
    let per_region = 4 + 8 * (count - 1);
    if regions != desc.regions.len() {
        return Err(DescError::TooLong {
            what: "rail key table",
            len: regions,
            max: desc.regions.len(),
        });
    }
    let mut keys = vec![HashMap::with_capacity(regions); count - 1];
    for _ in 0..regions {
        let entry = take(per_region, "rail keys")?;
        let index = u32::from_le_bytes([entry[0], entry[1], entry[2], entry[3]]);
        if desc.region(index).is_none() {
            return Err(DescError::Truncated {
                what: "rail keys of a listed region",
            });
        }
        for (r, map) in keys.iter_mut().enumerate() {
            map.insert(index, u64_at(&entry[4 + 8 * r..12 + 8 * r]));
        }
    }
    if !rest.is_empty() {
        return Err(DescError::Trailing(rest.len()));
    }
    Ok(PeerRails { rails, keys })
}

#[cfg(test)]
mod tests {
    use kvx_core::{MemoryKind, RegionDesc};

    use super::*;

    fn slot(addr: u64, key: u64) -> NoticeSlot {
        NoticeSlot { addr, key, len: 64 }
    }

    fn desc(address: Vec<u8>) -> EndpointDesc {
        EndpointDesc {
            backend: "libfabric".into(),
            provider: "shm".into(),
            address,
            notice_slot: Some(slot(1, 2)),
            board: None,
            regions: vec![
                RegionDesc {
                    index: 3,
                    kind: MemoryKind::Host,
                    addr: 0x1000,
                    len: 4096,
                    key: 30,
                },
                RegionDesc {
                    index: 7,
                    kind: MemoryKind::Host,
                    addr: 0x9000,
                    len: 4096,
                    key: 70,
                },
            ],
        }
    }

    #[test]
    fn single_rail_addresses_pass_through() {
        let d = desc(b"fi_shm://1234".to_vec());
        let peer = decode(&d, slot(1, 2)).unwrap();
        assert_eq!(peer.rails.len(), 1);
        assert_eq!(peer.rails[0].address, b"fi_shm://1234");
        assert_eq!(peer.key(&d, 0, 7), Some(70));
        assert_eq!(peer.key(&d, 1, 7), None);
    }

    #[test]
    fn tables_round_trip_and_refuse_damage() {
        let rails = [
            LocalRail {
                address: b"rail-zero",
                notice: slot(1, 2),
            },
            LocalRail {
                address: b"rail-one!",
                notice: slot(5, 6),
            },
            LocalRail {
                address: b"r2",
                notice: slot(8, 9),
            },
        ];
        let table = encode(&rails, &[(3, vec![31, 32]), (7, vec![71, 72])]);
        let d = desc(table.clone());
        let peer = decode(&d, slot(1, 2)).unwrap();
        assert_eq!(peer.rails.len(), 3);
        assert_eq!(peer.rails[1].address, b"rail-one!");
        assert_eq!(peer.rails[2].notice, slot(8, 9));
        assert_eq!(peer.key(&d, 0, 3), Some(30));
        assert_eq!(peer.key(&d, 1, 3), Some(31));
        assert_eq!(peer.key(&d, 2, 7), Some(72));
        for cut in MAGIC.len()..table.len() {
            assert!(
                decode(&desc(table[..cut].to_vec()), slot(1, 2)).is_err(),
                "{cut}"
            );
        }
        let mut long = table.clone();
        long.push(0);
        assert_eq!(decode(&desc(long), slot(1, 2)), Err(DescError::Trailing(1)));
        let mut version = table.clone();
        version[MAGIC.len()] = 9;
        assert_eq!(
            decode(&desc(version), slot(1, 2)),
            Err(DescError::Version(9))
        );
        // Keys of a region the description does not list.
        let other = encode(&rails, &[(3, vec![31, 32]), (8, vec![81, 82])]);
        assert!(decode(&desc(other), slot(1, 2)).is_err());
    }
}
