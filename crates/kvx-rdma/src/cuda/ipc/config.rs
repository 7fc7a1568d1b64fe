//! How a CUDA IPC endpoint is set up ([`CudaIpcConfig`]) and how it moves a plan's bytes
//! ([`CopyMethod`]).

use std::time::Duration;
#[cfg(doc)]
use {super::CudaIpcTransport, crate::error::OpError};

/// How a plan's bytes are moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum CopyMethod {
    /// The copy engines for plans of long runs, the batched-copy kernel for plans of many short
    /// runs (average under 64 KiB), falling back to the copy engines where NVRTC is missing.
    #[default]
    Auto,
    /// Always the copy engines (`cuMemcpyAsync` / `cuMemcpy2DAsync`).
    CopyEngine,
    /// Always the batched-copy kernel.
    Kernel,
}

/// Settings of a [`CudaIpcTransport`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct CudaIpcConfig {
    /// CUDA device ordinal whose memory this endpoint registers.
    pub device: u32,
    /// How plans are moved.
    pub copy: CopyMethod,
    /// An operation not finished after this long fails with [`OpError::TimedOut`].
    pub op_timeout: Duration,
}

impl CudaIpcConfig {
    /// Defaults for device `device`: the copy method [`CopyMethod::Auto`], operations time out
    /// after 30 s.
    #[must_use]
    pub fn new(device: u32) -> Self {
        Self {
            device,
            copy: CopyMethod::Auto,
            op_timeout: Duration::from_secs(30),
        }
    }
}

/// A copy-method name that is not `auto`, `engine` or `kernel`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown CUDA IPC copy method `{0}` (auto, engine, kernel)")]
pub struct UnknownCopyMethod(pub String);

impl std::str::FromStr for CopyMethod {
    type Err = UnknownCopyMethod;

    /// `auto`, `engine` (the copy engines) or `kernel` (the batched-copy kernel).
    fn from_str(s: &str) -> Result<Self, UnknownCopyMethod> {
        match s {
            "auto" => Ok(Self::Auto),
            "engine" => Ok(Self::CopyEngine),
            "kernel" => Ok(Self::Kernel),
            other => Err(UnknownCopyMethod(other.to_owned())),
        }
    }
}
