//! kvx-layout (work in progress)
#![forbid(unsafe_code)]
pub mod plan;
pub use plan::{CopyOp, Permute};
