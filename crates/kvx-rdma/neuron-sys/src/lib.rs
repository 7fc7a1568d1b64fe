//! # neuron-sys
//!
//! The few functions of the AWS Neuron runtime (`libnrt.so`, `nrt/nrt.h`) that kvx needs to use
//! Trainium / Inferentia device memory as a KV region: init and close, tensor allocation on a
//! (virtual) Neuron core, its device virtual address, reads and writes. The library is loaded at
//! run time ([`Nrt::load`]), so kvx builds and runs where it is absent; then loading fails with
//! the names that were tried.
//!
//! Everything here is raw FFI: the safe owner is `kvx_rdma::neuron`.
//!
//! ```
//! match neuron_sys::Nrt::load() {
//!     Ok(nrt) => println!("libnrt loaded from {}", nrt.path()),
//!     Err(e) => println!("no Neuron runtime here: {e}"),
//! }
//! ```

use std::ffi::{c_char, c_int, c_void};
use std::fmt;

/// `NRT_STATUS` (`nrt_status.h`): 0 is success.
pub type NrtStatus = c_int;
/// `NRT_SUCCESS`.
pub const NRT_SUCCESS: NrtStatus = 0;
/// `nrt_tensor_placement_t::NRT_TENSOR_PLACEMENT_DEVICE`.
pub const NRT_TENSOR_PLACEMENT_DEVICE: c_int = 0;
/// `nrt_framework_type_t::NRT_FRAMEWORK_TYPE_NO_FW`.
pub const NRT_FRAMEWORK_TYPE_NO_FW: c_int = 1;

/// Opaque `nrt_tensor_t`.
#[repr(C)]
pub struct NrtTensor {
    _private: [u8; 0],
}

/// `nrt_init(framework, fw_version, fal_version)`.
pub type InitFn = unsafe extern "C" fn(c_int, *const c_char, *const c_char) -> NrtStatus;
/// `nrt_close()`.
pub type CloseFn = unsafe extern "C" fn();
/// `nrt_tensor_allocate(placement, vnc, size, name, tensor)`.
pub type TensorAllocateFn =
    unsafe extern "C" fn(c_int, c_int, usize, *const c_char, *mut *mut NrtTensor) -> NrtStatus;
/// `nrt_tensor_free(tensor)`.
pub type TensorFreeFn = unsafe extern "C" fn(*mut *mut NrtTensor);
/// `nrt_tensor_get_va(tensor)`.
pub type TensorGetVaFn = unsafe extern "C" fn(*const NrtTensor) -> *mut c_void;
/// `nrt_tensor_read(tensor, buf, offset, size)`.
pub type TensorReadFn =
    unsafe extern "C" fn(*const NrtTensor, *mut c_void, usize, usize) -> NrtStatus;
/// `nrt_tensor_write(tensor, buf, offset, size)`.
pub type TensorWriteFn =
    unsafe extern "C" fn(*mut NrtTensor, *const c_void, usize, usize) -> NrtStatus;

/// Library names tried, in order (`KVX_NEURON_LIB` first when set).
pub const LIBRARY_NAMES: [&str; 3] = [
    "libnrt.so.1",
    "libnrt.so",
    "/opt/aws/neuron/lib/libnrt.so.1",
];

/// The runtime library could not be loaded, or lacks a function.
#[derive(Debug)]
#[non_exhaustive]
pub enum LoadError {
    /// None of the names could be opened.
    Missing {
        /// Names tried.
        tried: Vec<String>,
        /// The loader's message for the last one.
        last: String,
    },
    /// The library is there but a function is not.
    Symbol {
        /// Function name.
        name: &'static str,
        /// The loader's message.
        message: String,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing { tried, last } => write!(
                f,
                "the AWS Neuron runtime (libnrt) is not installed: tried {} ({last}); install \
                 aws-neuronx-runtime-lib or set KVX_NEURON_LIB",
                tried.join(", ")
            ),
            Self::Symbol { name, message } => {
                write!(f, "libnrt has no function {name}: {message}")
            }
        }
    }
}

impl std::error::Error for LoadError {}

/// The loaded runtime: the library handle and its function pointers.
pub struct Nrt {
    path: String,
    /// `nrt_init`.
    pub init: InitFn,
    /// `nrt_close`.
    pub close: CloseFn,
    /// `nrt_tensor_allocate`.
    pub tensor_allocate: TensorAllocateFn,
    /// `nrt_tensor_free`.
    pub tensor_free: TensorFreeFn,
    /// `nrt_tensor_get_va`.
    pub tensor_get_va: TensorGetVaFn,
    /// `nrt_tensor_read`.
    pub tensor_read: TensorReadFn,
    /// `nrt_tensor_write`.
    pub tensor_write: TensorWriteFn,
    // Declared last: the pointers above must not outlive the library.
    _library: libloading::Library,
}

impl Nrt {
    /// Loads `libnrt` (from `KVX_NEURON_LIB` when set, else [`LIBRARY_NAMES`]).
    ///
    /// # Errors
    /// [`LoadError::Missing`] where the runtime is not installed, [`LoadError::Symbol`] for a
    /// library without the functions kvx needs.
    pub fn load() -> Result<Self, LoadError> {
        let mut tried: Vec<String> = std::env::var("KVX_NEURON_LIB").into_iter().collect();
        tried.extend(LIBRARY_NAMES.iter().map(|s| (*s).to_owned()));
        let mut last = String::new();
        for name in &tried {
            // SAFETY: loading libnrt runs its initialisers, which only set up the runtime's own
            // state; the library is trusted system software named by the operator.
            match unsafe { libloading::Library::new(name) } {
                Ok(library) => return Self::bind(name.clone(), library),
                Err(e) => last = e.to_string(),
            }
        }
        Err(LoadError::Missing { tried, last })
    }

    fn bind(path: String, library: libloading::Library) -> Result<Self, LoadError> {
        fn get<T: Copy>(library: &libloading::Library, name: &'static str) -> Result<T, LoadError> {
            // SAFETY: `T` is the function-pointer type `nrt.h` declares for `name`; the pointer
            // is only used while the library stays loaded (it is stored next to it).
            unsafe { library.get::<T>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|e| LoadError::Symbol {
                    name,
                    message: e.to_string(),
                })
        }
        Ok(Self {
            init: get(&library, "nrt_init")?,
            close: get(&library, "nrt_close")?,
            tensor_allocate: get(&library, "nrt_tensor_allocate")?,
            tensor_free: get(&library, "nrt_tensor_free")?,
            tensor_get_va: get(&library, "nrt_tensor_get_va")?,
            tensor_read: get(&library, "nrt_tensor_read")?,
            tensor_write: get(&library, "nrt_tensor_write")?,
            path,
            _library: library,
        })
    }

    /// Where the library was loaded from.
    #[must_use]
    pub fn path(&self) -> &str {
        &self.path
    }
}

impl fmt::Debug for Nrt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nrt").field("path", &self.path).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_names_what_was_tried() {
        std::env::set_var("KVX_NEURON_LIB", "/nonexistent/libnrt.so.1");
        match Nrt::load() {
            Ok(nrt) => eprintln!("libnrt present at {}", nrt.path()),
            Err(e) => {
                let text = e.to_string();
                assert!(text.contains("/nonexistent/libnrt.so.1"), "{text}");
                assert!(text.contains("libnrt.so.1"), "{text}");
                assert!(matches!(e, LoadError::Missing { .. }));
            }
        }
    }
}
