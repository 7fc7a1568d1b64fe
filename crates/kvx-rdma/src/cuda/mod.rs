//! CUDA device memory as a first-class region kind (feature `cuda`): the device and its memory
//! ([`Gpu`], [`DeviceBuffer`], [`LocalRegion::cuda`](crate::LocalRegion::cuda)), the CUDA IPC
//! transport ([`ipc`]), the layout kernels compiled at run time with NVRTC ([`kernels`]), the
//! synthetic KV pattern on the device ([`synth`]) and, with feature `cublas`, bf16 matrix
//! products for synthetic engines (`gemm`).
//!
//! Everything goes through `cudarc` with dynamic loading: the crate builds and its tests run on
//! machines without CUDA, where [`device_count`] answers [`CudaError::DriverMissing`] and GPU
//! tests say that they were skipped.

mod driver;
#[cfg(feature = "cublas")]
pub mod gemm;
pub mod ipc;
pub mod kernels;
pub mod synth;

pub use driver::{device_count, CudaError, DeviceBuffer, Event, Gpu, Stream};

impl crate::region::LocalRegion {
    /// The whole of a CUDA device buffer as region `index` (kind
    /// [`MemoryKind::Cuda`](kvx_core::MemoryKind::Cuda)).
    #[must_use]
    pub fn cuda(index: u32, buffer: std::sync::Arc<DeviceBuffer>) -> Self {
        let kind = kvx_core::MemoryKind::Cuda {
            device: buffer.gpu().ordinal(),
        };
        let (addr, len) = (buffer.device_ptr() as usize, buffer.len());
        Self::owned(index, kind, addr, len, buffer)
    }
}
