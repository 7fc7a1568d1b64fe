//! AWS Neuron device memory as a region kind (feature `neuron`): the runtime loaded at run time
//! through `neuron-sys`, tensors allocated on a (virtual) Neuron core and released on drop, and
//! [`LocalRegion::neuron`](crate::LocalRegion::neuron) over one of them. Where `libnrt` is absent
//! [`NeuronRuntime::open`] says so ([`NeuronError::Runtime`]); transports that cannot register
//! Neuron memory refuse such regions with
//! [`RegisterError::UnsupportedKind`](crate::RegisterError::UnsupportedKind).

use std::ffi::CString;
use std::fmt;
use std::sync::Arc;

/// A Neuron operation failed, or the runtime is not installed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NeuronError {
    /// `libnrt` could not be loaded.
    #[error("the AWS Neuron runtime could not be loaded")]
    Runtime(#[source] neuron_sys::LoadError),
    /// A runtime call failed.
    #[error("{call} failed with NRT status {status}")]
    Call {
        /// The runtime function.
        call: &'static str,
        /// Its `NRT_STATUS`.
        status: i32,
    },
    /// A read or write reached outside a tensor, or a zero size.
    #[error("invalid tensor access: {0}")]
    Invalid(String),
}

fn check(call: &'static str, status: neuron_sys::NrtStatus) -> Result<(), NeuronError> {
    if status == neuron_sys::NRT_SUCCESS {
        Ok(())
    } else {
        Err(NeuronError::Call { call, status })
    }
}

/// The initialised Neuron runtime of this process; closed when the last handle drops.
pub struct NeuronRuntime {
    nrt: neuron_sys::Nrt,
}

impl NeuronRuntime {
    /// Loads and initialises the runtime (framework-less).
    ///
    /// # Errors
    /// [`NeuronError::Runtime`] where `libnrt` is absent, [`NeuronError::Call`] when `nrt_init`
    /// fails (no Neuron device, driver missing).
    pub fn open() -> Result<Arc<Self>, NeuronError> {
        let nrt = neuron_sys::Nrt::load().map_err(NeuronError::Runtime)?;
        // SAFETY: the versions are NUL-terminated literals; `nrt_init` may be called once per
        // process before any other runtime call (this handle is the only caller).
        check("nrt_init", unsafe {
            (nrt.init)(
                neuron_sys::NRT_FRAMEWORK_TYPE_NO_FW,
                c"".as_ptr(),
                c"".as_ptr(),
            )
        })?;
        Ok(Arc::new(Self { nrt }))
    }
}

impl Drop for NeuronRuntime {
    fn drop(&mut self) {
        // SAFETY: initialised in `open`; every tensor holds an `Arc` of the runtime, so none is
        // left when it closes.
        unsafe { (self.nrt.close)() }
    }
}

impl fmt::Debug for NeuronRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NeuronRuntime")
            .field("library", &self.nrt.path())
            .finish()
    }
}

/// A device tensor on one Neuron core, freed on drop.
pub struct NeuronTensor {
    runtime: Arc<NeuronRuntime>,
    raw: *mut neuron_sys::NrtTensor,
    core: u32,
    len: u64,
    va: usize,
}

// SAFETY: the runtime's tensor calls are thread-safe; the handle is owned and only freed once.
unsafe impl Send for NeuronTensor {}
// SAFETY: `&NeuronTensor` only permits bounds-checked runtime reads and writes.
unsafe impl Sync for NeuronTensor {}

impl NeuronTensor {
    /// Allocates `len` bytes of device memory on Neuron core `core`.
    ///
    /// # Errors
    /// [`NeuronError::Invalid`] for zero bytes, [`NeuronError::Call`] when the runtime refuses.
    pub fn allocate(
        runtime: &Arc<NeuronRuntime>,
        core: u32,
        len: u64,
    ) -> Result<Self, NeuronError> {
        let size = usize::try_from(len)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| NeuronError::Invalid(format!("a tensor of {len} bytes")))?;
        let core_id =
            i32::try_from(core).map_err(|_| NeuronError::Invalid(format!("core {core}")))?;
        let name = CString::new("kvx-kv").unwrap_or_default();
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid name and out-pointer; the tensor is freed in Drop.
        check("nrt_tensor_allocate", unsafe {
            (runtime.nrt.tensor_allocate)(
                neuron_sys::NRT_TENSOR_PLACEMENT_DEVICE,
                core_id,
                size,
                name.as_ptr(),
                &raw mut raw,
            )
        })?;
        // SAFETY: `raw` is the live tensor just allocated.
        let va = unsafe { (runtime.nrt.tensor_get_va)(raw) } as usize;
        Ok(Self {
            runtime: Arc::clone(runtime),
            raw,
            core,
            len,
            va,
        })
    }

    /// Device virtual address (what a transport with Neuron support registers).
    #[must_use]
    pub fn device_address(&self) -> usize {
        self.va
    }

    /// Length in bytes.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always `false`.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The Neuron core it lives on.
    #[must_use]
    pub fn core(&self) -> u32 {
        self.core
    }

    fn bounds(&self, offset: u64, len: usize) -> Result<(), NeuronError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(NeuronError::Invalid(format!(
                "{offset}+{len} outside a tensor of {} bytes",
                self.len
            ))),
        }
    }

    /// Copies `bytes` into the tensor at `offset`.
    ///
    /// # Errors
    /// [`NeuronError::Invalid`] out of bounds, [`NeuronError::Call`] when the runtime fails.
    pub fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), NeuronError> {
        self.bounds(offset, bytes.len())?;
        // SAFETY: live tensor; the range is inside it (checked); the buffer is a live slice.
        check("nrt_tensor_write", unsafe {
            (self.runtime.nrt.tensor_write)(
                self.raw,
                bytes.as_ptr().cast(),
                offset as usize,
                bytes.len(),
            )
        })
    }

    /// Copies bytes at `offset` into `out`.
    ///
    /// # Errors
    /// [`NeuronError::Invalid`] out of bounds, [`NeuronError::Call`] when the runtime fails.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), NeuronError> {
        self.bounds(offset, out.len())?;
        // SAFETY: live tensor; the range is inside it (checked); `out` is an exclusive slice.
        check("nrt_tensor_read", unsafe {
            (self.runtime.nrt.tensor_read)(
                self.raw,
                out.as_mut_ptr().cast(),
                offset as usize,
                out.len(),
            )
        })
    }
}

impl Drop for NeuronTensor {
    fn drop(&mut self) {
        // SAFETY: allocated in `allocate`, freed once; the runtime outlives it (held by `Arc`).
        unsafe { (self.runtime.nrt.tensor_free)(&raw mut self.raw) }
    }
}

impl fmt::Debug for NeuronTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NeuronTensor")
            .field("core", &self.core)
            .field("va", &format_args!("{:#x}", self.va))
            .field("len", &self.len)
            .finish()
    }
}

impl crate::region::LocalRegion {
    /// The whole of a Neuron device tensor as region `index` (kind
    /// [`MemoryKind::Neuron`](kvx_core::MemoryKind::Neuron), the tensor's core as its device).
    #[must_use]
    pub fn neuron(index: u32, tensor: Arc<NeuronTensor>) -> Self {
        let kind = kvx_core::MemoryKind::Neuron {
            device: tensor.core(),
        };
        let (addr, len) = (tensor.device_address(), tensor.len());
        Self::owned(index, kind, addr, len, tensor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_the_runtime_opening_is_a_clear_error() {
        match NeuronRuntime::open() {
            Ok(runtime) => {
                // A Neuron machine: a tensor round-trips and is bounds-checked.
                let tensor = NeuronTensor::allocate(&runtime, 0, 4096).expect("allocate");
                tensor.write_at(100, b"kvx").expect("write");
                let mut out = [0u8; 3];
                tensor.read_at(100, &mut out).expect("read");
                assert_eq!(&out, b"kvx");
                assert!(tensor.write_at(4095, b"kv").is_err());
            }
            Err(NeuronError::Runtime(e)) => {
                let text = e.to_string();
                assert!(text.contains("libnrt"), "{text}");
                eprintln!("SKIPPED (Neuron part): {text}");
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
}
