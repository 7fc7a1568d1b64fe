//! The endpoint description a transport exports and a peer connects to: which backend and
//! provider, the endpoint's address, and the table of registered regions with their remote keys.
//!
//! A description travels between processes (inside a registration message, over a pipe in the
//! tests), so it has a compact, versioned binary form ([`EndpointDesc::to_bytes`],
//! [`EndpointDesc::from_bytes`]) besides its serde derive. Decoding never panics: a short, long or
//! inconsistent buffer is a [`DescError`].

use kvx_core::{MemoryKind, RegionDesc};
use serde::{Deserialize, Serialize};

/// Magic bytes that open an encoded description.
const MAGIC: [u8; 4] = *b"KVXE";
/// Version of the binary encoding (2 added the notice board; version 1 is still read).
const VERSION: u8 = 2;
/// Largest endpoint address accepted: libfabric names are tens of bytes, NIXL agent metadata
/// grows with the registered regions (the length field is 16 bits).
pub const MAX_ADDRESS_LEN: usize = u16::MAX as usize;
/// Largest name (backend, provider) accepted.
pub const MAX_NAME_LEN: usize = 255;
/// Largest number of regions accepted in one description.
pub const MAX_REGIONS: usize = 1 << 20;

/// Where a peer's completion notices land: a small remote-writable slot of the endpoint itself
/// (transports that carry the notice as remote CQ data of a tiny RMA write need a target).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NoticeSlot {
    /// Remote address (or offset) of the slot.
    pub addr: u64,
    /// Remote key of the slot.
    pub key: u64,
    /// Bytes writable at the slot.
    pub len: u64,
}

/// Where an endpoint's [notice board](crate::board) lies in its own process: peers on the same
/// host write board notices there (`cma`, libfabric `shm` with cross-memory attach).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BoardPlace {
    /// Address of the first slot in the endpoint's process.
    pub addr: u64,
    /// Bytes of the board (8 per slot).
    pub len: u64,
}

/// Everything a peer needs to reach an endpoint and address its memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointDesc {
    /// Backend name (`"loopback"`, `"libfabric"`): a peer of another backend cannot connect.
    pub backend: String,
    /// Backend-specific provider (`"shm"`, `"tcp;ofi_rxm"`, `"efa"`; empty for loopback).
    pub provider: String,
    /// The endpoint's address in the backend's own format.
    pub address: Vec<u8>,
    /// Where completion notices are written, for backends that need it.
    pub notice_slot: Option<NoticeSlot>,
    /// The endpoint's notice board, if it has one ([`crate::Transport::notice_board`]).
    #[serde(default)]
    pub board: Option<BoardPlace>,
    /// Registered regions, by layout index, with their remote addresses and keys.
    pub regions: Vec<RegionDesc>,
}

/// An encoded description could not be decoded, or a description is inconsistent.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum DescError {
    /// A hex form ([`EndpointDesc::from_hex`]) has an odd length or a non-hex digit.
    #[error("not a hex-encoded endpoint description")]
    NotHex,
    /// The bytes do not start with the description magic.
    #[error("not an endpoint description (bad magic)")]
    BadMagic,
    /// The encoding version is not understood.
    #[error("unsupported endpoint description version {0}")]
    Version(u8),
    /// The bytes end before the description does.
    #[error("endpoint description truncated while reading {what}")]
    Truncated {
        /// Field being read.
        what: &'static str,
    },
    /// Bytes follow the end of the description.
    #[error("{0} trailing bytes after the endpoint description")]
    Trailing(usize),
    /// A length field exceeds its limit.
    #[error("{what} has {len} entries, more than the limit of {max}")]
    TooLong {
        /// Field.
        what: &'static str,
        /// Length found.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// A name is not UTF-8.
    #[error("{what} is not valid UTF-8")]
    Utf8 {
        /// Field.
        what: &'static str,
    },
    /// The notice-slot or board flag is neither 0 nor 1.
    #[error("bad notice-slot or board flag {0}")]
    BadFlag(u8),
    /// A memory-kind tag is unknown.
    #[error("unknown memory kind tag {0}")]
    MemoryKind(u8),
    /// Two regions share an index.
    #[error("region index {0} appears twice")]
    DuplicateRegion(u32),
    /// A region is empty or its end overflows the address space.
    #[error("region {index} has an invalid range (addr {addr:#x}, len {len})")]
    BadRegion {
        /// Region index.
        index: u32,
        /// Base address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// The address is empty.
    #[error("the endpoint address is empty")]
    EmptyAddress,
    /// The notice board is empty, not whole slots, or its end overflows the address space.
    #[error("invalid notice board (addr {addr:#x}, len {len})")]
    BadBoard {
        /// Address.
        addr: u64,
        /// Bytes.
        len: u64,
    },
}

impl EndpointDesc {
    /// The region with layout index `index`.
    #[must_use]
    pub fn region(&self, index: u32) -> Option<&RegionDesc> {
        self.regions.iter().find(|r| r.index == index)
    }

    /// Checks the description's internal consistency (what [`EndpointDesc::from_bytes`] checks
    /// too): a non-empty address within limits, non-empty regions with distinct indices whose
    /// ranges do not overflow.
    ///
    /// # Errors
    /// The first inconsistency found.
    pub fn validate(&self) -> Result<(), DescError> {
        if self.address.is_empty() {
            return Err(DescError::EmptyAddress);
        }
        for (what, len, max) in [
            ("backend", self.backend.len(), MAX_NAME_LEN),
            ("provider", self.provider.len(), MAX_NAME_LEN),
            ("address", self.address.len(), MAX_ADDRESS_LEN),
            ("regions", self.regions.len(), MAX_REGIONS),
        ] {
            if len > max {
                return Err(DescError::TooLong { what, len, max });
            }
        }
        if let Some(BoardPlace { addr, len }) = self.board {
            if len == 0 || len % 8 != 0 || addr.checked_add(len).is_none() {
                return Err(DescError::BadBoard { addr, len });
            }
        }
        let mut indices: Vec<u32> = self.regions.iter().map(|r| r.index).collect();
        indices.sort_unstable();
        if let Some(pair) = indices.windows(2).find(|w| w[0] == w[1]) {
            return Err(DescError::DuplicateRegion(pair[0]));
        }
        for r in &self.regions {
            if r.len == 0 || r.addr.checked_add(r.len).is_none() {
                return Err(DescError::BadRegion {
                    index: r.index,
                    addr: r.addr,
                    len: r.len,
                });
            }
        }
        Ok(())
    }

    /// The binary encoding (little-endian, versioned).
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.address.len() + 40 * self.regions.len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        put_bytes(&mut out, self.backend.as_bytes());
        put_bytes(&mut out, self.provider.as_bytes());
        put_bytes(&mut out, &self.address);
        match self.notice_slot {
            None => out.push(0),
            Some(slot) => {
                out.push(1);
                out.extend_from_slice(&slot.addr.to_le_bytes());
                out.extend_from_slice(&slot.key.to_le_bytes());
                out.extend_from_slice(&slot.len.to_le_bytes());
            }
        }
        match self.board {
            None => out.push(0),
            Some(board) => {
                out.push(1);
                out.extend_from_slice(&board.addr.to_le_bytes());
                out.extend_from_slice(&board.len.to_le_bytes());
            }
        }
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            out.extend_from_slice(&r.index.to_le_bytes());
            let (tag, device) = match r.kind {
                MemoryKind::Cuda { device } => (1_u8, device),
                MemoryKind::Neuron { device } => (2, device),
                // Host, and any kind added later that has no device (encoded as host until the
                // encoding learns it).
                _ => (0, 0),
            };
            out.push(tag);
            out.extend_from_slice(&device.to_le_bytes());
            out.extend_from_slice(&r.addr.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
            out.extend_from_slice(&r.key.to_le_bytes());
        }
        out
    }

    /// [`EndpointDesc::to_bytes`] as lower-case hex, for text channels (a child process's
    /// stdout, a command line).
    #[must_use]
    pub fn to_hex(&self) -> String {
        self.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Decodes the form [`EndpointDesc::to_hex`] makes (surrounding whitespace ignored).
    ///
    /// # Errors
    /// [`DescError::NotHex`], or what [`EndpointDesc::from_bytes`] finds.
    pub fn from_hex(text: &str) -> Result<Self, DescError> {
        let text = text.trim();
        if !text.len().is_multiple_of(2) {
            return Err(DescError::NotHex);
        }
        let bytes = (0..text.len() / 2)
            .map(|i| u8::from_str_radix(text.get(2 * i..2 * i + 2).unwrap_or("x"), 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|_| DescError::NotHex)?;
        Self::from_bytes(&bytes)
    }

    /// Decodes and validates a description made by [`EndpointDesc::to_bytes`].
    ///
    /// # Errors
    /// A [`DescError`] for anything but exactly one valid description.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DescError> {
        let mut r = Reader { bytes, pos: 0 };
        if r.take(4, "magic")? != MAGIC {
            return Err(DescError::BadMagic);
        }
        let version = r.u8("version")?;
        if version != VERSION && version != 1 {
            return Err(DescError::Version(version));
        }
        let backend = r.string("backend")?;
        let provider = r.string("provider")?;
        let address = r.sized("address", MAX_ADDRESS_LEN)?.to_vec();
        let notice_slot = match r.u8("notice slot flag")? {
            0 => None,
            1 => Some(NoticeSlot {
                addr: r.u64("notice slot")?,
                key: r.u64("notice slot")?,
                len: r.u64("notice slot")?,
            }),
            other => return Err(DescError::BadFlag(other)),
        };
        let flag = if version == 1 { 0 } else { r.u8("board flag")? };
        let board = match flag {
            0 => None,
            1 => Some(BoardPlace {
                addr: r.u64("board")?,
                len: r.u64("board")?,
            }),
            other => return Err(DescError::BadFlag(other)),
        };
        let count = r.u32("region count")? as usize;
        if count > MAX_REGIONS {
            return Err(DescError::TooLong {
                what: "regions",
                len: count,
                max: MAX_REGIONS,
            });
        }
        // Each region takes 33 bytes: refuse counts the buffer cannot hold before allocating.
        if r.remaining() < count.saturating_mul(33) {
            return Err(DescError::Truncated { what: "regions" });
        }
        let mut regions = Vec::with_capacity(count);
        for _ in 0..count {
            let index = r.u32("region")?;
            let tag = r.u8("region")?;
            let device = r.u32("region")?;
            let kind = match tag {
                0 => MemoryKind::Host,
                1 => MemoryKind::Cuda { device },
                2 => MemoryKind::Neuron { device },
                other => return Err(DescError::MemoryKind(other)),
            };
            regions.push(RegionDesc {
                index,
                kind,
                addr: r.u64("region")?,
                len: r.u64("region")?,
                key: r.u64("region")?,
            });
        }
        if r.remaining() != 0 {
            return Err(DescError::Trailing(r.remaining()));
        }
        let desc = Self {
            backend,
            provider,
            address,
            notice_slot,
            board,
            regions,
        };
        desc.validate()?;
        Ok(desc)
    }
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    // Lengths beyond u16 are refused by `validate`; clamp rather than wrap so that an oversized
    // field fails to decode instead of decoding as something else.
    let len = u16::try_from(bytes.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&bytes[..usize::from(len)]);
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DescError> {
        if self.remaining() < n {
            return Err(DescError::Truncated { what });
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DescError> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DescError> {
        let mut b = [0; 4];
        b.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, DescError> {
        let mut b = [0; 8];
        b.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(b))
    }

    fn sized(&mut self, what: &'static str, max: usize) -> Result<&'a [u8], DescError> {
        let mut b = [0; 2];
        b.copy_from_slice(self.take(2, what)?);
        let len = usize::from(u16::from_le_bytes(b));
        if len > max {
            return Err(DescError::TooLong { what, len, max });
        }
        self.take(len, what)
    }

    fn string(&mut self, what: &'static str) -> Result<String, DescError> {
        let bytes = self.sized(what, MAX_NAME_LEN)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| DescError::Utf8 { what })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> EndpointDesc {
        EndpointDesc {
            backend: "libfabric".into(),
            provider: "tcp;ofi_rxm".into(),
            address: vec![2, 0, 0x1f, 0x90, 127, 0, 0, 1],
            notice_slot: Some(NoticeSlot {
                addr: 0,
                key: 7,
                len: 64,
            }),
            board: Some(BoardPlace {
                addr: 0x7f00_1000_0000,
                len: 4096,
            }),
            regions: vec![
                RegionDesc {
                    index: 0,
                    kind: MemoryKind::Host,
                    addr: 0x7f00_0000_0000,
                    len: 1 << 20,
                    key: 11,
                },
                RegionDesc {
                    index: 5,
                    kind: MemoryKind::Cuda { device: 3 },
                    addr: 0,
                    len: 4096,
                    key: 12,
                },
            ],
        }
    }

    #[test]
    fn hex_form_round_trips_and_rejects_non_hex() {
        let d = sample();
        let text = d.to_hex();
        assert_eq!(EndpointDesc::from_hex(&format!(" {text}\n")).unwrap(), d);
        assert_eq!(EndpointDesc::from_hex(&text[1..]), Err(DescError::NotHex));
        assert_eq!(
            EndpointDesc::from_hex(&text.replacen('0', "g", 1)),
            Err(DescError::NotHex)
        );
        assert!(EndpointDesc::from_hex(&text[..text.len() - 2]).is_err());
    }

    #[test]
    fn round_trips() {
        let desc = sample();
        let bytes = desc.to_bytes();
        assert_eq!(EndpointDesc::from_bytes(&bytes).unwrap(), desc);
        assert_eq!(desc.region(5).unwrap().key, 12);
        assert!(desc.region(1).is_none());
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample().to_bytes();
        for cut in 0..bytes.len() {
            assert!(
                EndpointDesc::from_bytes(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(EndpointDesc::from_bytes(&long), Err(DescError::Trailing(1)));
    }

    #[test]
    fn inconsistent_descriptions_are_refused() {
        let mut desc = sample();
        desc.regions[1].index = 0;
        assert_eq!(
            EndpointDesc::from_bytes(&desc.to_bytes()),
            Err(DescError::DuplicateRegion(0))
        );
        let mut desc = sample();
        desc.regions[0].len = 0;
        assert!(matches!(
            EndpointDesc::from_bytes(&desc.to_bytes()),
            Err(DescError::BadRegion { index: 0, .. })
        ));
        let mut desc = sample();
        desc.address.clear();
        assert_eq!(
            EndpointDesc::from_bytes(&desc.to_bytes()),
            Err(DescError::EmptyAddress)
        );
        let mut bytes = sample().to_bytes();
        bytes[0] = b'X';
        assert_eq!(EndpointDesc::from_bytes(&bytes), Err(DescError::BadMagic));
        let mut bytes = sample().to_bytes();
        bytes[4] = 9;
        assert_eq!(EndpointDesc::from_bytes(&bytes), Err(DescError::Version(9)));
        for len in [0, 12] {
            let mut desc = sample();
            desc.board = Some(BoardPlace { addr: 64, len });
            assert_eq!(
                EndpointDesc::from_bytes(&desc.to_bytes()),
                Err(DescError::BadBoard { addr: 64, len })
            );
        }
    }

    #[test]
    fn version_1_descriptions_are_read_without_a_board() {
        let mut desc = sample();
        desc.board = None;
        let mut bytes = desc.to_bytes();
        bytes[4] = 1;
        // Version 1 has no board flag: it sits after the notice slot (3 words).
        let flag = 4
            + 1
            + [&desc.backend, &desc.provider]
                .iter()
                .map(|s| 2 + s.len())
                .sum::<usize>()
            + 2
            + desc.address.len()
            + 1
            + 24;
        assert_eq!(bytes.remove(flag), 0);
        assert_eq!(EndpointDesc::from_bytes(&bytes).unwrap(), desc);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = EndpointDesc::from_bytes(&bytes);
        }

        #[test]
        fn corrupted_descriptions_never_panic(pos in 0usize..200, value in any::<u8>()) {
            let mut bytes = sample().to_bytes();
            let pos = pos % bytes.len();
            bytes[pos] = value;
            if let Ok(desc) = EndpointDesc::from_bytes(&bytes) {
                let again = EndpointDesc::from_bytes(&desc.to_bytes()).unwrap();
                prop_assert_eq!(again, desc);
            }
        }
    }
}
