//! Typed identifiers. Each is a thin newtype so that a block id can never be passed where a rank is
//! expected; all are `Copy`, hashable and ordered.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! id_type {
    ($(#[$meta:meta])* $name:ident($inner:ty), $prefix:literal) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl $name {
            /// The raw value.
            #[must_use]
            pub const fn get(self) -> $inner {
                self.0
            }
        }

        impl From<$inner> for $name {
            fn from(value: $inner) -> Self {
                Self(value)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

id_type!(
    /// An engine instance (one prefill or decode deployment), chosen at start-up.
    EngineId(u64),
    "engine-"
);
id_type!(
    /// The engine's own request id, hashed to 64 bits where the engine uses strings.
    RequestId(u64),
    "req-"
);
id_type!(
    /// The router's id for one dispatch of a request to a prefill/decode pair. A retried dispatch
    /// gets a fresh transfer id.
    TransferId(u128),
    "xfer-"
);
id_type!(
    /// Which attempt of a transfer this is: a preempted request that comes back registers again
    /// with a higher attempt. Higher attempts supersede lower ones.
    Attempt(u32),
    "attempt-"
);
id_type!(
    /// A tensor-parallel rank within one engine instance.
    Rank(u32),
    "rank-"
);
id_type!(
    /// A KV-cache block index within one rank's cache.
    BlockId(u32),
    "block-"
);
id_type!(
    /// An engine's incarnation: a random value chosen at every start, so that a restarted peer is
    /// recognised and its stale metadata dropped.
    Incarnation(u64),
    "inc-"
);

impl TransferId {
    /// A transfer id from an arbitrary string (for example an HTTP `X-Request-Id`), by a stable
    /// 128-bit FNV-1a hash.
    #[must_use]
    pub fn from_str_hash(s: &str) -> Self {
        Self(fnv1a_128(s.as_bytes()))
    }
}

impl EngineId {
    /// An engine id from the engine's name (for example vLLM's `engine_id`), by a stable 64-bit
    /// FNV-1a hash.
    #[must_use]
    pub fn from_name(name: &str) -> Self {
        Self(fnv1a_64(name.as_bytes()))
    }
}

impl RequestId {
    /// A request id from the engine's string id, by a stable 64-bit FNV-1a hash.
    #[must_use]
    pub fn from_str_hash(s: &str) -> Self {
        Self(fnv1a_64(s.as_bytes()))
    }
}

impl Attempt {
    /// The first attempt of a transfer.
    pub const FIRST: Self = Self(0);

    /// The attempt after this one.
    #[must_use]
    pub const fn next(self) -> Self {
        Self(self.0 + 1)
    }
}

/// 64-bit FNV-1a: stable across builds and platforms (unlike `std`'s hasher).
#[must_use]
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// 128-bit FNV-1a.
#[must_use]
pub fn fnv1a_128(bytes: &[u8]) -> u128 {
    let mut hash: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    for &b in bytes {
        hash ^= u128::from(b);
        hash = hash.wrapping_mul(0x0000_0000_0100_0000_0000_0000_0000_013b);
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_hashes_are_stable_and_distinct() {
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(
            TransferId::from_str_hash("cmpl-1"),
            TransferId::from_str_hash("cmpl-2")
        );
        assert_eq!(RequestId::from_str_hash("x"), RequestId::from_str_hash("x"));
    }

    #[test]
    fn attempts_order_and_display() {
        assert!(Attempt::FIRST < Attempt::FIRST.next());
        assert_eq!(Rank(3).to_string(), "rank-3");
        assert_eq!(BlockId::from(7).get(), 7);
    }
}
