//! Where a memory region lives.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The kind of memory a registered region lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
#[non_exhaustive]
pub enum MemoryKind {
    /// Host (CPU) memory.
    Host,
    /// CUDA device memory on the given device ordinal.
    Cuda {
        /// CUDA device ordinal.
        device: u32,
    },
    /// AWS Neuron device memory on the given device index.
    Neuron {
        /// Neuron device index.
        device: u32,
    },
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Host => f.write_str("host"),
            Self::Cuda { device } => write!(f, "cuda:{device}"),
            Self::Neuron { device } => write!(f, "neuron:{device}"),
        }
    }
}

/// One registered memory region as a peer sees it: the region's index in the owner's layout, where
/// it lives, its address and length, and the remote key the transport needs to write into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionDesc {
    /// Index of the region in the owner's layout (see `LayoutSpec::region_count`).
    pub index: u32,
    /// Where the memory lives.
    pub kind: MemoryKind,
    /// Base address, or base offset for transports that address by offset.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The transport's remote key (zero where the transport needs none).
    pub key: u64,
}
