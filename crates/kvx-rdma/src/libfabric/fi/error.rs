//! The errors of the wrapper: a libfabric error number ([`FiErrno`]) and the call that failed
//! with it ([`FabricError`]).

use std::ffi::CStr;

use libfabric_sys as sys;

use super::{MIN_MAJOR, MIN_MINOR};

/// A libfabric error number with its `fi_strerror` text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message} (errno {code})")]
pub struct FiErrno {
    /// The positive error number (`FI_EAGAIN`, `FI_ECONNREFUSED`, ...).
    pub code: i32,
    /// `fi_strerror(code)`.
    pub message: String,
}

impl FiErrno {
    /// The error for a negative libfabric return value (or a positive error number).
    #[must_use]
    pub fn new(ret: i64) -> Self {
        let code = i32::try_from(ret.unsigned_abs()).unwrap_or(i32::MAX);
        // SAFETY: fi_strerror accepts any error number and returns a pointer to a static,
        // NUL-terminated string (or null, handled below).
        let text = unsafe { sys::kvx_fi_strerror(code) };
        let message = if text.is_null() {
            format!("unknown libfabric error {code}")
        } else {
            // SAFETY: non-null, NUL-terminated, static (see above).
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        Self { code, message }
    }

    /// Whether the operation may be retried after progress (`-FI_EAGAIN`).
    #[must_use]
    pub fn is_again(&self) -> bool {
        self.code == sys::FI_EAGAIN
    }

    /// Whether the call is not supported by the provider (`-FI_ENOSYS`, `-FI_EOPNOTSUPP`).
    #[must_use]
    pub fn is_unsupported(&self) -> bool {
        self.code == sys::FI_ENOSYS || self.code == sys::FI_EOPNOTSUPP
    }

    /// Whether the error says that the peer is gone or cannot be reached.
    #[must_use]
    pub fn is_unreachable(&self) -> bool {
        [
            sys::FI_ECONNREFUSED,
            sys::FI_ECONNRESET,
            sys::FI_ECONNABORTED,
            sys::FI_EHOSTUNREACH,
            sys::FI_ENOTCONN,
            sys::FI_ESHUTDOWN,
            sys::FI_EADDRNOTAVAIL,
            sys::FI_ETIMEDOUT,
            sys::FI_EIO,
        ]
        .contains(&self.code)
    }

    /// Whether the error says that a remote key or address was refused.
    #[must_use]
    pub fn is_remote_access(&self) -> bool {
        [
            sys::FI_EACCES,
            sys::FI_EKEYREJECTED,
            sys::FI_EINVAL,
            sys::FI_EFAULT,
        ]
        .contains(&self.code)
    }
}

/// A libfabric call failed: one variant per call, with its context and the error number.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FabricError {
    /// The libfabric shared library could not be loaded (it is opened at run time, on the
    /// first use of a libfabric transport).
    #[error(
        "cannot load libfabric ({library}): {detail}; install libfabric {MIN_MAJOR}.{MIN_MINOR} \
         or later (Debian: libfabric1), or name the library's path in KVX_LIBFABRIC"
    )]
    Load {
        /// The library asked for.
        library: String,
        /// What the dynamic loader said.
        detail: String,
    },
    /// The loaded libfabric is older than kvx runs on, or of another major version than the
    /// headers it was built with.
    #[error("{library} is libfabric {found}; kvx needs {MIN_MAJOR}.{MIN_MINOR} or a later 1.x")]
    Version {
        /// The library loaded.
        library: String,
        /// Its version (`major.minor`).
        found: String,
    },
    /// An argument could not be passed to C (a name with a NUL byte).
    #[error("invalid {what}: {value:?}")]
    InvalidArgument {
        /// Which argument.
        what: &'static str,
        /// Its value.
        value: String,
    },
    /// `fi_getinfo` found no matching provider.
    #[error("fi_getinfo found no RDM endpoint with RMA and messages for provider {provider:?}")]
    GetInfo {
        /// Provider asked for.
        provider: String,
        /// Error.
        #[source]
        source: FiErrno,
    },
    /// `fi_allocinfo` failed.
    #[error("fi_allocinfo failed")]
    AllocInfo,
    /// `fi_fabric` failed.
    #[error("fi_fabric failed")]
    OpenFabric(#[source] FiErrno),
    /// `fi_domain` failed.
    #[error("fi_domain failed")]
    OpenDomain(#[source] FiErrno),
    /// `fi_cq_open` failed.
    #[error("fi_cq_open failed")]
    OpenCq(#[source] FiErrno),
    /// `fi_av_open` failed.
    #[error("fi_av_open failed")]
    OpenAv(#[source] FiErrno),
    /// `fi_endpoint` failed.
    #[error("fi_endpoint failed")]
    OpenEndpoint(#[source] FiErrno),
    /// `fi_ep_bind` failed.
    #[error("fi_ep_bind({what}) failed")]
    Bind {
        /// What was bound.
        what: &'static str,
        /// Error.
        #[source]
        source: FiErrno,
    },
    /// `fi_enable` failed.
    #[error("fi_enable failed")]
    Enable(#[source] FiErrno),
    /// `fi_getname` failed.
    #[error("fi_getname failed")]
    GetName(#[source] FiErrno),
    /// `fi_av_insert` failed or inserted nothing.
    #[error("fi_av_insert of a {len}-byte address failed")]
    AvInsert {
        /// Address length.
        len: usize,
        /// Error.
        #[source]
        source: FiErrno,
    },
    /// `fi_mr_regattr` failed.
    #[error("fi_mr_regattr of {len} bytes at {addr:#x} failed")]
    RegisterMemory {
        /// Base address.
        addr: usize,
        /// Length.
        len: usize,
        /// Error.
        #[source]
        source: FiErrno,
    },
    /// `fi_mr_bind` or `fi_mr_enable` failed (`FI_MR_ENDPOINT` providers).
    #[error("binding a memory registration to the endpoint failed")]
    BindMemory(#[source] FiErrno),
    /// `fi_close` failed.
    #[error("fi_close({what}) failed")]
    Close {
        /// What was closed.
        what: &'static str,
        /// Error.
        #[source]
        source: FiErrno,
    },
    /// `fi_writemsg` failed.
    #[error("fi_writemsg failed")]
    PostWrite(#[source] FiErrno),
    /// `fi_readmsg` failed.
    #[error("fi_readmsg failed")]
    PostRead(#[source] FiErrno),
    /// `fi_sendmsg` failed.
    #[error("fi_sendmsg failed")]
    PostSend(#[source] FiErrno),
    /// `fi_recvmsg` failed.
    #[error("fi_recvmsg failed")]
    PostRecv(#[source] FiErrno),
    /// `fi_cq_read`, `fi_cq_sread` or `fi_cq_readerr` failed.
    #[error("reading the completion queue failed")]
    ReadCq(#[source] FiErrno),
    /// A completion reported an error.
    #[error("operation completed with an error: {detail}")]
    Completion {
        /// The error number.
        #[source]
        source: FiErrno,
        /// The provider's own error number.
        prov_errno: i32,
        /// The provider's description (`fi_cq_strerror`).
        detail: String,
    },
}
