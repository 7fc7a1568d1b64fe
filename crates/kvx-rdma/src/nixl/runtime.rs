//! Loading the NIXL runtime (`libnixl_capi.so`) before `nixl-sys` needs it.
//!
//! `nixl-sys` built with `stub-api` resolves every C-API call lazily: on its first call it does
//! `dlopen("libnixl_capi.so")` by name, and when that fails, or a symbol is missing, it prints a
//! message and **aborts the process**. A transport must not abort on a missing runtime, so
//! [`ensure_loaded`] loads the library first, by full path when one is configured, and checks
//! that every C-API symbol the transport uses is there. Afterwards the stubs' `dlopen` by name
//! finds the library already loaded (the dynamic loader matches a bare name against the `SONAME`
//! of loaded objects, and the wheel's library has `SONAME libnixl_capi.so`), so no
//! `LD_LIBRARY_PATH` is needed. The library is never unloaded: one runtime per process.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// File name of the NIXL C API library.
pub const CAPI_LIBRARY: &str = "libnixl_capi.so";

/// The C-API functions the transport (through `nixl-sys`) calls. Checked at load time, so that a
/// runtime of another release is a typed error instead of an abort in the middle of a transfer.
const SYMBOLS: &[&str] = &[
    "nixl_capi_create_configured_agent",
    "nixl_capi_destroy_agent",
    "nixl_capi_create_backend",
    "nixl_capi_destroy_backend",
    "nixl_capi_create_params",
    "nixl_capi_params_add",
    "nixl_capi_destroy_params",
    "nixl_capi_create_reg_dlist",
    "nixl_capi_reg_dlist_clear",
    "nixl_capi_reg_dlist_add_desc",
    "nixl_capi_destroy_reg_dlist",
    "nixl_capi_register_mem",
    "nixl_capi_deregister_mem",
    "nixl_capi_create_opt_args",
    "nixl_capi_destroy_opt_args",
    "nixl_capi_opt_args_set_notif_msg",
    "nixl_capi_opt_args_set_has_notif",
    "nixl_capi_get_local_md",
    "nixl_capi_load_remote_md",
    "nixl_capi_invalidate_remote_md",
    "nixl_capi_create_xfer_dlist",
    "nixl_capi_xfer_dlist_clear",
    "nixl_capi_xfer_dlist_add_desc",
    "nixl_capi_destroy_xfer_dlist",
    "nixl_capi_create_xfer_req",
    "nixl_capi_post_xfer_req",
    "nixl_capi_get_xfer_status",
    "nixl_capi_release_xfer_req",
    "nixl_capi_destroy_xfer_req",
    "nixl_capi_gen_notif",
    "nixl_capi_create_notif_map",
    "nixl_capi_destroy_notif_map",
    "nixl_capi_get_notifs",
    "nixl_capi_notif_map_size",
    "nixl_capi_notif_map_get_agent_at",
    "nixl_capi_notif_map_get_notifs_size",
    "nixl_capi_notif_map_get_notif",
];

const RTLD_NOW: c_int = 2;

// The dynamic loader's interface (glibc: in libc itself since 2.34, and in libdl, which
// `nixl-sys` links).
unsafe extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}

/// The NIXL runtime could not be loaded.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum RuntimeError {
    /// The library could not be opened.
    #[error(
        "cannot load the NIXL runtime {library}: {reason} (it comes with the nixl-cu12 wheel: \
         `pip install nixl-cu12`; name the directory that holds {CAPI_LIBRARY} in \
         KVX_NIXL_LIB_DIR)"
    )]
    Load {
        /// What was opened (a path, or the bare name searched by the dynamic loader).
        library: String,
        /// The dynamic loader's message.
        reason: String,
    },
    /// The library lacks a function the transport calls (a runtime of another release).
    #[error("the NIXL runtime {library} lacks {symbol} (another NIXL release?)")]
    Symbol {
        /// The library.
        library: String,
        /// The missing function.
        symbol: String,
    },
}

/// Where the runtime was loaded from, once it was.
static LOADED: Mutex<Option<String>> = Mutex::new(None);

/// The library to load for `configured` (a file or the directory holding it); `None`: the bare
/// name (the dynamic loader's search path: `LD_LIBRARY_PATH`, the cache).
fn candidate(configured: Option<&Path>) -> PathBuf {
    match configured {
        Some(path) if path.is_dir() => path.join(CAPI_LIBRARY),
        Some(path) => path.to_path_buf(),
        None => PathBuf::from(CAPI_LIBRARY),
    }
}

/// The dynamic loader's last error message.
fn last_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by the loader, valid until
    // the next dl* call on this thread; it is copied at once.
    unsafe {
        let message = dlerror();
        if message.is_null() {
            "unknown error".to_owned()
        } else {
            CStr::from_ptr(message).to_string_lossy().into_owned()
        }
    }
}

/// Loads the NIXL runtime (once per process) and checks its symbols; returns what was loaded.
///
/// # Errors
/// [`RuntimeError`] when the library cannot be opened or lacks a function.
pub fn ensure_loaded(configured: Option<&Path>) -> Result<String, RuntimeError> {
    let mut loaded = LOADED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(library) = loaded.as_ref() {
        return Ok(library.clone());
    }
    let path = candidate(configured);
    let library = path.display().to_string();
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| RuntimeError::Load {
        library: library.clone(),
        reason: "the path contains a NUL byte".into(),
    })?;
    // SAFETY: `c_path` is a NUL-terminated string that outlives the call. Loading runs the
    // library's initialisers (C++ static constructors of the NIXL runtime), which is what using
    // the runtime at all requires. The handle is never closed, so every symbol resolved from it
    // stays valid for the life of the process.
    let handle = unsafe { dlopen(c_path.as_ptr(), RTLD_NOW) };
    if handle.is_null() {
        return Err(RuntimeError::Load {
            library,
            reason: last_error(),
        });
    }
    for symbol in SYMBOLS {
        let c_symbol = CString::new(*symbol).map_err(|_| RuntimeError::Symbol {
            library: library.clone(),
            symbol: (*symbol).to_owned(),
        })?;
        // SAFETY: `handle` is a live handle from dlopen (never closed) and `c_symbol` a
        // NUL-terminated string; the result is only compared with NULL.
        let found = unsafe { dlsym(handle, c_symbol.as_ptr()) };
        if found.is_null() {
            return Err(RuntimeError::Symbol {
                library,
                symbol: (*symbol).to_owned(),
            });
        }
    }
    *loaded = Some(library.clone());
    Ok(library)
}

/// Where the runtime was loaded from, if it was.
#[must_use]
pub fn loaded_from() -> Option<String> {
    LOADED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// Where the loaded runtime looks for the plugin `plugin`: `plugins/libplugin_<plugin>.so` in the
/// runtime's directory (as the wheel lays it out), or that relative name before a load.
#[must_use]
pub fn plugin_file(plugin: &str) -> String {
    let file = format!("plugins/libplugin_{plugin}.so");
    loaded_from()
        .map(PathBuf::from)
        .and_then(|library| library.parent().map(|dir| dir.join(&file)))
        .map_or(file, |path| path.display().to_string())
}

/// Whether a NIXL runtime can be found for `configured` (see [`ensure_loaded`]) without loading
/// it: a configured path that exists, or one already loaded. Tests use it
/// to say plainly why they skip.
#[must_use]
pub fn locate(configured: Option<&Path>) -> Option<PathBuf> {
    if let Some(library) = loaded_from() {
        return Some(PathBuf::from(library));
    }
    let path = candidate(configured);
    (path.components().count() > 1 && path.is_file()).then_some(path)
}
