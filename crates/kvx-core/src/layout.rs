//! The description of one engine rank's KV cache, as it travels in the handshake. `kvx-layout`
//! interprets it (validation, addressing, planning); this module only says what it is.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Element type of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float, e4m3.
    Fp8E4m3,
    /// 8-bit float, e5m2.
    Fp8E5m2,
    /// 8-bit integer.
    Int8,
}

impl Dtype {
    /// Bytes per element.
    #[must_use]
    pub const fn size(self) -> u32 {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Fp8E4m3 | Self::Fp8E5m2 | Self::Int8 => 1,
        }
    }

    /// All dtypes, in wire-code order.
    pub const ALL: [Self; 6] = [
        Self::F32,
        Self::F16,
        Self::Bf16,
        Self::Fp8E4m3,
        Self::Fp8E5m2,
        Self::Int8,
    ];

    /// The name used on the command line and in JSON.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Fp8E4m3 => "fp8_e4m3",
            Self::Fp8E5m2 => "fp8_e5m2",
            Self::Int8 => "int8",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Order of the three inner dimensions of one (layer, K/V) block chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryOrder {
    /// `[token][head][dim]`: one token's heads are adjacent (vLLM's default on GPUs and CPUs).
    Nhd,
    /// `[head][token][dim]`: one head's tokens are adjacent.
    Hnd,
    /// `[head][token][dim]` for V, but K *dimension-major*, `[head][dim][token]`: vLLM's CPU
    /// attention backend, whose kernels read a block's keys one dimension at a time.
    HndKt,
}

impl MemoryOrder {
    /// All orders, in wire-code order.
    pub const ALL: [Self; 3] = [Self::Nhd, Self::Hnd, Self::HndKt];

    /// The name used on the command line and in configuration.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Nhd => "nhd",
            Self::Hnd => "hnd",
            Self::HndKt => "hnd-kt",
        }
    }
}

impl fmt::Display for MemoryOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for MemoryOrder {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        UnknownName::find(
            "memory order",
            s,
            &s.to_ascii_lowercase(),
            Self::ALL,
            Self::name,
        )
    }
}

/// How the (layer, K/V, block) chunks are placed in registered regions. A *chunk* is the data of
/// one block for one layer and one of K or V: `block_tokens × local heads × head_dim` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arrangement {
    /// One region per layer and per K/V (region `2·layer + kv`); consecutive blocks are adjacent.
    PerLayerSplit,
    /// One region per layer holding all K blocks, then all V blocks: vLLM's FlashAttention tensor
    /// `(2, num_blocks, …)`.
    PerLayerKvHalves,
    /// One region per layer, each block holding its K chunk then its V chunk: FlashInfer's
    /// `(num_blocks, 2, …)`.
    PerLayerKvInBlock,
    /// One region for the whole cache, each block holding every layer's K and V chunks:
    /// `(num_blocks, layers, 2, …)`.
    CrossLayer,
    /// One region per layer, each block holding, head by head, that head's K then its V: vLLM's
    /// CPU tensor `[num_blocks, heads, block_size, 2·head_size]`. A chunk's heads are therefore
    /// not adjacent; the memory order must be head-major (`hnd` or `hnd-kt`).
    PerLayerHeadKv,
    /// One region per layer, each block holding, per (token, head) cell, that head's K vector
    /// then its V vector: vLLM's per-layer view `[blocks, heads, tokens, K|V]` (order `hnd`, its
    /// `LBHNC` cache layout) or `[blocks, tokens, heads, K|V]` (`nhd`, `LBNHC`), the GPU caches
    /// of vLLM 0.32 on. K and V travel together, so this plans against itself only.
    PerLayerCellKv,
}

impl Arrangement {
    /// All arrangements, in wire-code order.
    pub const ALL: [Self; 6] = [
        Self::PerLayerSplit,
        Self::PerLayerKvHalves,
        Self::PerLayerKvInBlock,
        Self::CrossLayer,
        Self::PerLayerHeadKv,
        Self::PerLayerCellKv,
    ];

    /// The name used on the command line and in configuration.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::PerLayerSplit => "per-layer-split",
            Self::PerLayerKvHalves => "per-layer-kv-halves",
            Self::PerLayerKvInBlock => "per-layer-kv-in-block",
            Self::CrossLayer => "cross-layer",
            Self::PerLayerHeadKv => "per-layer-head-kv",
            Self::PerLayerCellKv => "per-layer-cell-kv",
        }
    }
}

impl fmt::Display for Arrangement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Arrangement {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        UnknownName::find("arrangement", s, s, Self::ALL, Self::name)
    }
}

/// A name that is not one of a kind's names ([`MemoryOrder`], [`Arrangement`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} `{given}` (one of: {})", .expected.join(", "))]
pub struct UnknownName {
    /// What was being named.
    pub kind: &'static str,
    /// The name given.
    pub given: String,
    /// The valid names.
    pub expected: Vec<&'static str>,
}

impl UnknownName {
    /// The one of `all` whose name (`name_of`) is `wanted`; otherwise the error, naming `given`.
    fn find<T: Copy, const N: usize>(
        kind: &'static str,
        given: &str,
        wanted: &str,
        all: [T; N],
        name_of: fn(T) -> &'static str,
    ) -> Result<T, Self> {
        all.into_iter()
            .find(|v| name_of(*v) == wanted)
            .ok_or_else(|| Self {
                kind,
                given: given.to_owned(),
                expected: all.map(name_of).to_vec(),
            })
    }
}

/// One engine rank's KV cache.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayoutSpec {
    /// Number of attention layers.
    pub num_layers: u32,
    /// The model's number of KV heads (all ranks together). For MLA this is ignored: the latent
    /// vector is one "head", identical on every rank.
    pub total_kv_heads: u32,
    /// Elements per head vector (for MLA: the latent dimension, e.g. 512 + 64).
    pub head_dim: u32,
    /// Element type.
    pub dtype: Dtype,
    /// Multi-head latent attention: one latent vector per token instead of K and V.
    pub mla: bool,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Blocks in this rank's cache.
    pub num_blocks: u32,
    /// Tensor-parallel size of the engine.
    pub tp_size: u32,
    /// This rank.
    pub tp_rank: u32,
    /// Inner memory order.
    pub order: MemoryOrder,
    /// Placement of chunks in regions.
    pub arrangement: Arrangement,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_valid_ones() {
        for order in MemoryOrder::ALL {
            assert_eq!(order.name().parse::<MemoryOrder>(), Ok(order));
        }
        assert_eq!("HND".parse::<MemoryOrder>(), Ok(MemoryOrder::Hnd));
        for arrangement in Arrangement::ALL {
            assert_eq!(arrangement.name().parse::<Arrangement>(), Ok(arrangement));
        }
        let err = "dhn".parse::<MemoryOrder>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown memory order `dhn` (one of: nhd, hnd, hnd-kt)"
        );
        assert!("per-layer".parse::<Arrangement>().is_err());
    }
}
