//! bf16 matrix products through cuBLAS (feature `cublas`; `libcublas` loaded at run time): the
//! GPU work of a synthetic engine, whose cost follows a model's shape so that transfers and
//! compute contend for the GPU as they do in serving.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys as blas;

use super::{CudaError, DeviceBuffer, Gpu, Stream};

/// A cuBLAS handle bound to one stream; every product is enqueued there.
pub struct Blas {
    gpu: Arc<Gpu>,
    handle: blas::cublasHandle_t,
}

// SAFETY: a cuBLAS handle may be used from any thread, one at a time (`&mut self` is not
// needed: cuBLAS serialises on the handle's stream, and `Blas` is not `Sync`).
unsafe impl Send for Blas {}

fn status(call: &'static str, result: blas::cublasStatus_t) -> Result<(), CudaError> {
    if result == blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Invalid(format!("{call} failed: {result:?}")))
    }
}

/// One operand: a buffer, where the matrix starts in it, and (batched products) the distance
/// between consecutive matrices (0: one matrix shared by the whole batch).
#[derive(Clone, Copy, Debug)]
pub struct Operand<'a> {
    /// The memory.
    pub buffer: &'a DeviceBuffer,
    /// Byte offset of the first matrix.
    pub offset: u64,
    /// Elements between consecutive matrices of a batch.
    pub stride: u64,
}

impl<'a> Operand<'a> {
    /// The matrix at the start of `buffer`, shared by a whole batch.
    #[must_use]
    pub fn whole(buffer: &'a DeviceBuffer) -> Self {
        Self {
            buffer,
            offset: 0,
            stride: 0,
        }
    }

    /// Consecutive matrices of `elements` each, from the start of `buffer`.
    #[must_use]
    pub fn batched(buffer: &'a DeviceBuffer, elements: u64) -> Self {
        Self {
            buffer,
            offset: 0,
            stride: elements,
        }
    }

    fn check(&self, elements: u64, batch: u64, what: &str) -> Result<u64, CudaError> {
        let last = self.stride * (batch - 1) + elements;
        let end = self.offset + last * 2;
        if end > self.buffer.len() {
            return Err(CudaError::Invalid(format!(
                "operand {what}: {batch} matrices of {elements} bf16 elements need {end} bytes, the \
                 buffer has {}",
                self.buffer.len()
            )));
        }
        Ok(self.buffer.device_ptr() + self.offset)
    }
}

impl Blas {
    /// A handle whose products run on `stream`.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] naming the library when `libcublas` cannot be loaded, or the
    /// failing call.
    pub fn new(stream: &Stream) -> Result<Self, CudaError> {
        // SAFETY: only probes whether the library can be loaded.
        if !unsafe { blas::is_culib_present() } {
            return Err(CudaError::Invalid(
                "cuBLAS (libcublas.so) is not installed on this machine or not on the loader's \
                 path"
                    .into(),
            ));
        }
        let gpu = Arc::clone(stream.gpu());
        gpu.bind()?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: bound context; valid out-pointer; destroyed in Drop.
        status("cublasCreate", unsafe {
            blas::cublasCreate_v2(&raw mut handle)
        })?;
        let blas = Self { gpu, handle };
        // SAFETY: live handle; the stream belongs to the bound context and outlives its use
        // here (the caller keeps it for as long as it enqueues products).
        status("cublasSetStream", unsafe {
            blas::cublasSetStream_v2(blas.handle, stream.raw().cast())
        })?;
        Ok(blas)
    }

    /// Enqueues `c = a · b` for `batch` row-major bf16 matrices (`a`: m×k, `b`: k×n, `c`: m×n),
    /// accumulating in f32.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a zero or too large dimension or an operand past its buffer,
    /// or the failing call.
    #[allow(clippy::many_single_char_names)]
    pub fn matmul(
        &self,
        (m, n, k): (u64, u64, u64),
        batch: u64,
        a: Operand<'_>,
        b: Operand<'_>,
        c: Operand<'_>,
    ) -> Result<(), CudaError> {
        let dims = [m, n, k, batch];
        if dims.iter().any(|&d| d == 0 || d > i32::MAX as u64) {
            return Err(CudaError::Invalid(format!(
                "matmul of {m}×{k} by {k}×{n}, batch {batch}"
            )));
        }
        let pa = a.check(m * k, batch, "a")?;
        let pb = b.check(k * n, batch, "b")?;
        let pc = c.check(m * n, batch, "c")?;
        if c.stride != 0 && c.stride < m * n && batch > 1 {
            return Err(CudaError::Invalid("batched outputs overlap".into()));
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let bf16 = blas::cudaDataType_t::CUDA_R_16BF;
        self.gpu.bind()?;
        // Row-major c = a·b is column-major cᵀ = bᵀ·aᵀ: cuBLAS sees b (n×k, leading n) times a
        // (k×m, leading k).
        // SAFETY: live handle on a stream of the bound context; every operand lies inside its
        // buffer for the whole batch (checked above); the buffers outlive the enqueued product
        // because the caller synchronises the stream before freeing them (the engine owns both).
        status("cublasGemmStridedBatchedEx", unsafe {
            blas::cublasGemmStridedBatchedEx(
                self.handle,
                blas::cublasOperation_t::CUBLAS_OP_N,
                blas::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                (&raw const alpha).cast::<c_void>(),
                pb as *const c_void,
                bf16,
                n as i32,
                b.stride as i64,
                pa as *const c_void,
                bf16,
                k as i32,
                a.stride as i64,
                (&raw const beta).cast::<c_void>(),
                pc as *mut c_void,
                bf16,
                n as i32,
                c.stride as i64,
                batch as i32,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: created once in `new`; cuBLAS waits for its pending work.
            let _ = unsafe { blas::cublasDestroy_v2(self.handle) };
        }
    }
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas")
            .field("device", &self.gpu.ordinal())
            .finish_non_exhaustive()
    }
}
