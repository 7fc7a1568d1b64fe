//! The safe wrapper over `libfabric-sys`: owned handles for the provider description (`fi_info`),
//! fabric, domain, completion queue, address vector, endpoint and memory registrations.
//!
//! Every handle closes itself on drop, and every child holds an `Arc` to its parent (a domain to
//! its fabric, an endpoint to its domain, completion queue and address vector, a registration to
//! its domain), so no handle can outlive what it was opened from, whatever order the owner drops
//! them in.
//!
//! Threading: the domain is opened with `FI_THREAD_DOMAIN` (the application serialises access to
//! all objects of a domain). The handles of one domain are owned by one
//! [`LibfabricTransport`](super::LibfabricTransport), whose methods take `&mut self`, so access is
//! serialised; the wrappers are crate-private and never shared outside it. That is what makes the
//! handles' `Send`/`Sync` implementations sound.
//!
//! The handles are declared here (`handle!`); each kind's operations live in a module of its own:
//! `info` (provider descriptions), `domain` (fabric and domain), `cq` (completion queue and
//! waiting), `av` (address vector), `endpoint` (posting), `mr` (memory registrations), and
//! `error`.

mod av;
mod cq;
mod domain;
mod endpoint;
mod error;
mod info;
mod mr;

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use libfabric_sys as sys;

pub(crate) use cq::{poll_readable, Completion, CqRead};
pub use error::{FabricError, FiErrno};
pub(crate) use info::{Info, Query};
pub(crate) use mr::Hmem;

/// The libfabric shared library loaded unless [`choose_library`] names another: libfabric 1.x's
/// soname, found as the dynamic loader finds libraries.
pub const DEFAULT_LIBRARY: &str = "libfabric.so.1";

/// The variable in which the `kvx` binary and the vLLM plugin take another library than
/// [`DEFAULT_LIBRARY`] from their operator (this crate reads no environment).
pub const LIBRARY_ENV: &str = "KVX_LIBFABRIC";

/// The oldest libfabric kvx runs on (1.17).
pub(crate) const MIN_MAJOR: u32 = 1;
pub(crate) const MIN_MINOR: u32 = 17;

/// The library this process loads (chosen once).
static LIBRARY: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Names the libfabric library this process loads (a file name the dynamic loader finds, or a
/// path) instead of [`DEFAULT_LIBRARY`]: libfabric is loaded once per process, so only before the
/// first libfabric transport opens. `false` where a library was already chosen or loaded (the
/// earlier choice stays).
pub fn choose_library(library: impl Into<String>) -> bool {
    LIBRARY.set(library.into()).is_ok()
}

/// Loads libfabric, once per process: the library [`choose_library`] named, else
/// [`DEFAULT_LIBRARY`], and checks its version. Every libfabric transport calls it before its
/// first libfabric call; nothing links libfabric, so a program built with it runs (with its
/// other transports) where it is not installed. The outcome, success or not, is kept.
///
/// # Errors
/// [`FabricError::Load`] where the library cannot be opened or lacks libfabric's calls,
/// [`FabricError::Version`] where it is older than 1.17 or not 1.x.
pub fn load_library() -> Result<(), FabricError> {
    static LOADED: std::sync::OnceLock<Result<(), FabricError>> = std::sync::OnceLock::new();
    LOADED
        .get_or_init(|| {
            let library = LIBRARY.get_or_init(|| DEFAULT_LIBRARY.to_owned()).clone();
            let path = std::ffi::CString::new(library.clone()).map_err(|_| {
                FabricError::InvalidArgument {
                    what: "libfabric library",
                    value: library.clone(),
                }
            })?;
            sys::load(&path).map_err(|detail| FabricError::Load {
                library: library.clone(),
                detail,
            })?;
            // SAFETY: loaded just above; fi_version takes nothing and returns an integer.
            let version = unsafe { sys::kvx_fi_version() };
            let (major, minor) = (version >> 16, version & 0xffff);
            if major != MIN_MAJOR || minor < MIN_MINOR {
                return Err(FabricError::Version {
                    library,
                    found: format!("{major}.{minor}"),
                });
            }
            Ok(())
        })
        .clone()
}

/// Returns `Ok(())` for zero, the error for a negative return value.
fn check(ret: i64, wrap: impl FnOnce(FiErrno) -> FabricError) -> Result<(), FabricError> {
    if ret < 0 {
        Err(wrap(FiErrno::new(ret)))
    } else {
        Ok(())
    }
}

/// Closes a libfabric object. Every `fid_*` struct starts with its `struct fid`.
///
/// # Safety
/// `fid` must be an open libfabric object that nothing uses any more.
unsafe fn close_fid(fid: *mut sys::fid, what: &'static str) -> Result<(), FabricError> {
    // SAFETY: per the function contract.
    let ret = unsafe { sys::kvx_fi_close(fid) };
    check(i64::from(ret), |source| FabricError::Close { what, source })
}

macro_rules! handle {
    ($(#[$meta:meta])* $name:ident, $raw:ty, $what:literal, { $($field:ident: $ty:ty),* }) => {
        $(#[$meta])*
        pub(crate) struct $name {
            ptr: NonNull<$raw>,
            // The parents: held so that they stay open while this handle is (some are read too).
            $(#[allow(dead_code)] $field: $ty,)*
        }

        // SAFETY: see the module documentation: all handles of a domain are owned and used by
        // one transport, which serialises every call through `&mut self`.
        unsafe impl Send for $name {}
        // SAFETY: as above.
        unsafe impl Sync for $name {}

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: the handle is open and this is its last use; children hold an `Arc` to
                // it, so none of them is still open. A close error cannot be reported from drop
                // and leaves nothing to undo.
                let _ = unsafe { close_fid(self.ptr.as_ptr().cast::<sys::fid>(), $what) };
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($what, "({:p})"), self.ptr)
            }
        }

        impl $name {
            #[allow(dead_code)]
            fn fid(&self) -> *mut sys::fid {
                self.ptr.as_ptr().cast::<sys::fid>()
            }
        }
    };
}

handle!(
    /// An open fabric.
    Fabric, sys::fid_fabric, "fabric", { info: Info }
);
handle!(
    /// An open domain.
    Domain, sys::fid_domain, "domain", { fabric: Arc<Fabric> }
);
handle!(
    /// An open completion queue (`FI_CQ_FORMAT_DATA`, with a wait object).
    CompletionQueue, sys::fid_cq, "cq", { domain: Arc<Domain>, blocking: bool }
);
handle!(
    /// An open address vector.
    AddressVector, sys::fid_av, "av", { domain: Arc<Domain> }
);
handle!(
    /// An open, enabled RDM endpoint bound to one completion queue and one address vector.
    Endpoint, sys::fid_ep, "endpoint", { cq: Arc<CompletionQueue>, av: Arc<AddressVector> }
);
handle!(
    /// A memory registration.
    MemoryRegion, sys::fid_mr, "mr", { domain: Arc<Domain>, endpoint: Option<Arc<Endpoint>> }
);
