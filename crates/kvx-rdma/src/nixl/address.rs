//! A NIXL endpoint's address: the agent's name and metadata blob behind a checksum, and the
//! default agent name.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::AddressError;

/// Magic and version of the address encoding: magic, version, name length (u16 LE), checksum
/// of name and metadata (FNV-1a, u64 LE), name, metadata blob.
const ADDRESS_MAGIC: &[u8; 4] = b"KVXN";
const ADDRESS_VERSION: u8 = 1;
const ADDRESS_HEADER: usize = 4 + 1 + 2 + 8;

/// A fresh agent name: process id, a counter and the clock.
pub(super) fn default_agent_name() -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "kvx-{}-{}-{:x}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed),
        nanos
    )
}

/// FNV-1a over the agent name, a separator and the metadata: catches a description corrupted
/// on its way before NIXL parses it (NIXL keeps half-loaded state of an agent whose metadata it
/// refused, and then refuses that agent's valid metadata too).
fn checksum(name: &str, metadata: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in name.as_bytes().iter().chain(&[0]).chain(metadata) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// Encodes an address: magic, version, name length, checksum, name, metadata.
pub(super) fn encode_address(name: &str, metadata: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ADDRESS_HEADER + name.len() + metadata.len());
    out.extend_from_slice(ADDRESS_MAGIC);
    out.push(ADDRESS_VERSION);
    // Names are checked to fit a u16 at open.
    out.extend_from_slice(&u16::try_from(name.len()).unwrap_or(u16::MAX).to_le_bytes());
    out.extend_from_slice(&checksum(name, metadata).to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(metadata);
    out
}

/// Decodes an address into the agent name and the metadata blob.
pub(super) fn decode_address(address: &[u8]) -> Result<(&str, &[u8]), AddressError> {
    if address.len() < ADDRESS_HEADER {
        return Err(AddressError::Truncated("header"));
    }
    if &address[..4] != ADDRESS_MAGIC {
        return Err(AddressError::BadMagic);
    }
    if address[4] != ADDRESS_VERSION {
        return Err(AddressError::Version(address[4]));
    }
    let len = usize::from(u16::from_le_bytes([address[5], address[6]]));
    let mut sum = [0; 8];
    sum.copy_from_slice(&address[7..15]);
    let rest = &address[ADDRESS_HEADER..];
    if len == 0 || rest.len() <= len {
        return Err(AddressError::Truncated("agent name or metadata"));
    }
    let name = std::str::from_utf8(&rest[..len]).map_err(|_| AddressError::Text("agent name"))?;
    if name.contains('\0') {
        return Err(AddressError::Text("agent name"));
    }
    let metadata = &rest[len..];
    if checksum(name, metadata) != u64::from_le_bytes(sum) {
        return Err(AddressError::Checksum);
    }
    Ok((name, metadata))
}
