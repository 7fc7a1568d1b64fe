//! Raw FFI bindings to the system libfabric.
//!
//! The bindings are generated at build time by bindgen from the installed headers
//! (`<rdma/fabric.h>`, `fi_domain.h`, `fi_endpoint.h`, `fi_cm.h`, `fi_rma.h`, `fi_eq.h`,
//! `fi_errno.h`; found through pkg-config, libfabric 1.17 or later). Most of libfabric's calls are
//! `static inline` functions in those headers that dispatch through the provider's operation
//! tables; a small C shim compiled into this crate exports each one that kvx uses as a real
//! function named `kvx_fi_*` (for example [`kvx_fi_writemsg`] for `fi_writemsg`).
//!
//! Nothing links libfabric: [`load`] opens the shared library at run time and binds the calls it
//! exports itself (`fi_getinfo`, `fi_freeinfo`, `fi_dupinfo`, `fi_fabric`, `fi_version`,
//! `fi_strerror`; called as [`kvx_fi_getinfo`] and so on). It must have succeeded before any
//! other call of this crate. A program built with libfabric support thus starts where libfabric
//! is not installed, and says so when a libfabric transport is asked for.
//!
//! Flag macros (`FI_MSG`, `FI_RMA`, `FI_REMOTE_CQ_DATA`, ...) are `u64`; error numbers
//! (`FI_EAGAIN`, ...) are `c_int` and are returned negated by the calls. Enumerations are modules of
//! constants (`fi_ep_type::FI_EP_RDM`).
//!
//! Everything here is `unsafe` and unchecked; the safe wrapper lives in `kvx-rdma`.
#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    missing_docs,
    unreachable_pub,
    clippy::all,
    clippy::undocumented_unsafe_blocks
)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// Opens the libfabric shared library `path` (a file name such as `libfabric.so.1` is searched
/// for as the dynamic loader does) and binds the calls it exports. Once it has succeeded, later
/// calls return at once and the library stays loaded for the life of the process.
///
/// # Errors
/// The dynamic loader's message (no such library), or the call the library does not export.
pub fn load(path: &std::ffi::CStr) -> Result<(), String> {
    static LOADING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _serialised = LOADING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut err = [0 as std::os::raw::c_char; 512];
    // SAFETY: `path` is NUL-terminated; `err` is writable for its whole length, which the shim
    // never exceeds and NUL-terminates; the lock serialises the shim's loader.
    let rc = unsafe { kvx_fi_load(path.as_ptr(), err.as_mut_ptr(), err.len()) };
    if rc == 0 {
        return Ok(());
    }
    // SAFETY: the shim wrote a NUL-terminated message into `err`.
    let why = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) };
    Err(why.to_string_lossy().into_owned())
}

/// Whether [`load`] has succeeded.
#[must_use]
pub fn loaded() -> bool {
    // SAFETY: reads a flag the loader sets; no arguments.
    unsafe { kvx_fi_loaded() != 0 }
}

/// `FI_ADDR_UNSPEC`: "any source" / "no address" (`((uint64_t) -1)`; a cast bindgen cannot
/// evaluate).
pub const FI_ADDR_UNSPEC: fi_addr_t = u64::MAX;

/// `FI_EOTHER`: unspecified error (a member of an anonymous enum in `fi_errno.h`; the shim
/// checks the value at build time).
pub const FI_EOTHER: std::os::raw::c_int = 256;
/// `FI_ETOOSMALL`: the provided buffer is too small.
pub const FI_ETOOSMALL: std::os::raw::c_int = 257;
/// `FI_EOPBADSTATE`: operation not allowed in the current state.
pub const FI_EOPBADSTATE: std::os::raw::c_int = 258;
/// `FI_EAVAIL`: an error entry is available (read it with `fi_cq_readerr`).
pub const FI_EAVAIL: std::os::raw::c_int = 259;

/// `FI_KEY_NOTAVAIL`: the key of a registration is not available yet.
pub const FI_KEY_NOTAVAIL: u64 = u64::MAX;

#[cfg(test)]
mod tests {
    use super::*;

    /// The library as the system installs it (libfabric 1.x).
    fn load_system() {
        load(c"libfabric.so.1").expect("libfabric.so.1 loads");
        assert!(loaded());
    }

    #[test]
    fn runtime_library_is_at_least_the_header_version_major() {
        load_system();
        // SAFETY: both calls take no arguments and only return an integer.
        let (runtime, header) = unsafe { (kvx_fi_version(), kvx_fi_header_version()) };
        assert_eq!(
            runtime >> 16,
            header >> 16,
            "libfabric major version mismatch"
        );
        assert!(runtime >= kvx_fi_make_version_checked(1, 17));
    }

    fn kvx_fi_make_version_checked(major: u32, minor: u32) -> u32 {
        // SAFETY: pure arithmetic in C.
        let version = unsafe { kvx_fi_make_version(major, minor) };
        assert_eq!(version, (major << 16) | minor);
        version
    }

    #[test]
    fn getinfo_finds_the_shm_provider() {
        load_system();
        // SAFETY: allocinfo returns an owned, zeroed fi_info (or null); every pointer written
        // below is owned by that fi_info and released with fi_freeinfo.
        unsafe {
            let hints = kvx_fi_allocinfo();
            assert!(!hints.is_null());
            (*(*hints).ep_attr).type_ = fi_ep_type::FI_EP_RDM;
            (*hints).caps = FI_RMA | FI_MSG;
            let name = std::ffi::CString::new("shm").unwrap();
            (*(*hints).fabric_attr).prov_name = libc_strdup(&name);
            let mut info = std::ptr::null_mut();
            let rc = kvx_fi_getinfo(
                kvx_fi_header_version(),
                std::ptr::null(),
                std::ptr::null(),
                0,
                hints,
                &mut info,
            );
            kvx_fi_freeinfo(hints);
            assert_eq!(rc, 0, "fi_getinfo(shm) failed: {rc}");
            assert!(!info.is_null());
            let prov = std::ffi::CStr::from_ptr((*(*info).fabric_attr).prov_name);
            assert_eq!(prov.to_str().unwrap(), "shm");
            kvx_fi_freeinfo(info);
        }
    }

    /// `strdup` through `fi_dupinfo`'s allocator family: libfabric frees `prov_name` with `free`,
    /// so the copy must come from `malloc`.
    unsafe fn libc_strdup(s: &std::ffi::CStr) -> *mut std::os::raw::c_char {
        extern "C" {
            fn strdup(s: *const std::os::raw::c_char) -> *mut std::os::raw::c_char;
        }
        // SAFETY: `s` is a valid NUL-terminated string.
        unsafe { strdup(s.as_ptr()) }
    }
}
