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
//! `Send`/`Sync` implementations below sound.

use std::ffi::{c_void, CStr, CString};
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use libfabric_sys as sys;

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
        let text = unsafe { sys::fi_strerror(code) };
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

/// An owned `fi_info` list (released with `fi_freeinfo`); only its first entry is used.
pub(crate) struct Info {
    ptr: NonNull<sys::fi_info>,
}

// SAFETY: `fi_info` is plain heap data owned exclusively by this handle; libfabric keeps no
// reference to it.
unsafe impl Send for Info {}
// SAFETY: shared access only reads the description.
unsafe impl Sync for Info {}

impl Drop for Info {
    fn drop(&mut self) {
        // SAFETY: the list came from fi_getinfo and is freed exactly once.
        unsafe { sys::fi_freeinfo(self.ptr.as_ptr()) }
    }
}

/// `strdup` from the C library: libfabric frees the strings it owns inside `fi_info` with `free`.
fn c_strdup(s: &CStr) -> *mut std::os::raw::c_char {
    extern "C" {
        fn strdup(s: *const std::os::raw::c_char) -> *mut std::os::raw::c_char;
    }
    // SAFETY: `s` is a valid NUL-terminated string; strdup returns a malloc'd copy or null.
    unsafe { strdup(s.as_ptr()) }
}

/// What [`Info::query`] asks of a provider.
#[derive(Clone, Debug)]
pub(crate) struct Query<'a> {
    pub(crate) provider: &'a str,
    pub(crate) domain: Option<&'a str>,
    pub(crate) delivery_complete: bool,
}

impl Info {
    /// The first provider entry matching `query`: an RDM endpoint with messages and RMA in both
    /// directions, the memory-registration modes kvx handles (`FI_MR_LOCAL`, `FI_MR_VIRT_ADDR`,
    /// `FI_MR_ALLOCATED`, `FI_MR_PROV_KEY`, `FI_MR_ENDPOINT`), the context modes it handles
    /// (`FI_CONTEXT`, `FI_CONTEXT2`, `FI_RX_CQ_DATA`), `FI_THREAD_DOMAIN`, and (if asked)
    /// `FI_DELIVERY_COMPLETE` as the default completion semantics of transmit operations.
    pub(crate) fn query(query: &Query<'_>) -> Result<Self, FabricError> {
        let provider = CString::new(query.provider).map_err(|_| FabricError::InvalidArgument {
            what: "provider",
            value: query.provider.into(),
        })?;
        let domain = query
            .domain
            .map(|d| {
                CString::new(d).map_err(|_| FabricError::InvalidArgument {
                    what: "domain",
                    value: d.into(),
                })
            })
            .transpose()?;
        // SAFETY: fi_allocinfo returns a zeroed fi_info with all attribute structs allocated, or
        // null.
        let hints =
            NonNull::new(unsafe { sys::kvx_fi_allocinfo() }).ok_or(FabricError::AllocInfo)?;
        let hints = Self { ptr: hints };
        // SAFETY: `hints` is a valid fi_info from fi_allocinfo whose attribute pointers are all
        // allocated; the strings are malloc'd copies that fi_freeinfo releases.
        let (ret, info) = unsafe {
            let h = hints.ptr.as_ptr();
            (*h).caps = sys::FI_MSG
                | sys::FI_RMA
                | sys::FI_READ
                | sys::FI_WRITE
                | sys::FI_SEND
                | sys::FI_RECV
                | sys::FI_REMOTE_READ
                | sys::FI_REMOTE_WRITE;
            (*h).mode = sys::FI_CONTEXT | sys::FI_CONTEXT2 | sys::FI_RX_CQ_DATA;
            (*(*h).ep_attr).type_ = sys::fi_ep_type::FI_EP_RDM;
            let d = (*h).domain_attr;
            (*d).mr_mode = (sys::FI_MR_LOCAL
                | sys::FI_MR_VIRT_ADDR
                | sys::FI_MR_ALLOCATED
                | sys::FI_MR_PROV_KEY
                | sys::FI_MR_ENDPOINT) as i32;
            (*d).threading = sys::fi_threading::FI_THREAD_DOMAIN;
            if let Some(domain) = &domain {
                (*d).name = c_strdup(domain);
            }
            if query.delivery_complete {
                (*(*h).tx_attr).op_flags = sys::FI_DELIVERY_COMPLETE;
            }
            (*(*h).fabric_attr).prov_name = c_strdup(&provider);
            let mut info = ptr::null_mut();
            let ret = sys::fi_getinfo(
                sys::kvx_fi_header_version(),
                ptr::null(),
                ptr::null(),
                0,
                h,
                &mut info,
            );
            (ret, info)
        };
        drop(hints);
        let getinfo_error = |ret: i64| FabricError::GetInfo {
            provider: query.provider.into(),
            source: FiErrno::new(ret),
        };
        if ret < 0 {
            return Err(getinfo_error(i64::from(ret)));
        }
        let list = NonNull::new(info)
            .map(|ptr| Self { ptr })
            .ok_or_else(|| getinfo_error(-i64::from(sys::FI_ENODATA)))?;
        let Some(wanted) = query.domain else {
            return Ok(list);
        };
        // Layered providers (`tcp;ofi_rxm`) do not all filter by the domain-name hint: pick the
        // matching entry ourselves and keep a copy of it alone.
        let mut entry = list.ptr.as_ptr();
        while !entry.is_null() {
            // SAFETY: `entry` is an element of the list owned by `list`; domain_attr is allocated
            // in every element.
            let name = Self::c_str(unsafe { (*(*entry).domain_attr).name });
            if name == wanted {
                // SAFETY: fi_dupinfo copies one valid element (its `next` is not copied).
                let copy = unsafe { sys::fi_dupinfo(entry) };
                return NonNull::new(copy)
                    .map(|ptr| Self { ptr })
                    .ok_or(FabricError::AllocInfo);
            }
            // SAFETY: as above.
            entry = unsafe { (*entry).next };
        }
        Err(getinfo_error(-i64::from(sys::FI_ENODATA)))
    }

    /// The domain names of every entry of the list (in the provider's order, without repeats).
    pub(crate) fn domains(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let mut entry = self.ptr.as_ptr();
        while !entry.is_null() {
            // SAFETY: `entry` is an element of the list owned by `self`; domain_attr is allocated
            // in every element.
            let name = Self::c_str(unsafe { (*(*entry).domain_attr).name });
            if !name.is_empty() && !out.contains(&name) {
                out.push(name);
            }
            // SAFETY: as above.
            entry = unsafe { (*entry).next };
        }
        out
    }

    fn raw(&self) -> &sys::fi_info {
        // SAFETY: the pointer is valid for as long as `self` lives.
        unsafe { self.ptr.as_ref() }
    }

    fn c_str(p: *const std::os::raw::c_char) -> String {
        if p.is_null() {
            return String::new();
        }
        // SAFETY: libfabric's names are NUL-terminated strings owned by the fi_info.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Provider name (`shm`, `tcp;ofi_rxm`, `efa`).
    pub(crate) fn provider(&self) -> String {
        // SAFETY: fabric_attr is always allocated in an fi_info from fi_getinfo.
        Self::c_str(unsafe { (*self.raw().fabric_attr).prov_name })
    }

    /// Domain name (`shm`, `lo`, `eth0`, `rdmap...`).
    pub(crate) fn domain(&self) -> String {
        // SAFETY: as above, domain_attr is always allocated.
        Self::c_str(unsafe { (*self.raw().domain_attr).name })
    }

    /// The memory-registration mode bits the provider chose.
    pub(crate) fn mr_mode(&self) -> u64 {
        // SAFETY: domain_attr is always allocated.
        let mode = unsafe { (*self.raw().domain_attr).mr_mode };
        u64::from(mode as u32)
    }

    /// Bytes of remote CQ data the provider carries.
    pub(crate) fn cq_data_size(&self) -> usize {
        // SAFETY: domain_attr is always allocated.
        unsafe { (*self.raw().domain_attr).cq_data_size }
    }

    /// Largest single message or RMA transfer.
    pub(crate) fn max_msg_size(&self) -> usize {
        // SAFETY: ep_attr is always allocated.
        unsafe { (*self.raw().ep_attr).max_msg_size }
    }

    /// Transmit queue depth.
    pub(crate) fn tx_size(&self) -> usize {
        // SAFETY: tx_attr is always allocated.
        unsafe { (*self.raw().tx_attr).size }
    }

    /// Whether transmit operations complete with delivery-complete semantics by default.
    pub(crate) fn delivery_complete(&self) -> bool {
        // SAFETY: tx_attr is always allocated.
        unsafe { (*self.raw().tx_attr).op_flags & sys::FI_DELIVERY_COMPLETE != 0 }
    }

    /// Mode bits the provider requires of the application.
    pub(crate) fn mode(&self) -> u64 {
        self.raw().mode
    }
}

impl fmt::Debug for Info {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Info")
            .field("provider", &self.provider())
            .field("domain", &self.domain())
            .field("mode", &format_args!("{:#x}", self.mode()))
            .field("mr_mode", &format_args!("{:#x}", self.mr_mode()))
            .field("cq_data_size", &self.cq_data_size())
            .field("delivery_complete", &self.delivery_complete())
            .finish()
    }
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

impl Fabric {
    /// Opens the fabric of `info`.
    pub(crate) fn open(info: Info) -> Result<Arc<Self>, FabricError> {
        let mut ptr = ptr::null_mut();
        // SAFETY: fabric_attr is a valid attribute struct of the fi_info; `ptr` receives the handle.
        let ret = unsafe { sys::kvx_fi_fabric(info.raw().fabric_attr, &mut ptr, ptr::null_mut()) };
        check(i64::from(ret), FabricError::OpenFabric)?;
        let ptr = NonNull::new(ptr).ok_or(FabricError::OpenFabric(FiErrno::new(-i64::from(
            sys::FI_ENOMEM,
        ))))?;
        Ok(Arc::new(Self { ptr, info }))
    }
}

impl Domain {
    /// Opens the domain of the fabric's description.
    pub(crate) fn open(fabric: &Arc<Fabric>) -> Result<Arc<Self>, FabricError> {
        let mut ptr = ptr::null_mut();
        // SAFETY: the fabric is open; the fi_info outlives the call (owned by the fabric).
        let ret = unsafe {
            sys::kvx_fi_domain(
                fabric.ptr.as_ptr(),
                fabric.info.ptr.as_ptr(),
                &mut ptr,
                ptr::null_mut(),
            )
        };
        check(i64::from(ret), FabricError::OpenDomain)?;
        let ptr = NonNull::new(ptr).ok_or(FabricError::OpenDomain(FiErrno::new(-i64::from(
            sys::FI_ENOMEM,
        ))))?;
        Ok(Arc::new(Self {
            ptr,
            fabric: Arc::clone(fabric),
        }))
    }

    /// The description the domain was opened from.
    pub(crate) fn info(&self) -> &Info {
        &self.fabric.info
    }
}

/// One completion, as kvx needs it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Completion {
    /// The operation context given when posting (null for remote-CQ-data events that consume no
    /// posted receive).
    pub(crate) context: *mut c_void,
    /// `FI_*` flags of the completion.
    pub(crate) flags: u64,
    /// Bytes received (receives).
    pub(crate) len: usize,
    /// Remote CQ data (with `FI_REMOTE_CQ_DATA`).
    pub(crate) data: u64,
}

/// What one read of the completion queue returned.
#[derive(Debug)]
pub(crate) enum CqRead {
    /// This many entries were written to the buffer.
    Entries(usize),
    /// Nothing was ready (or the blocking read timed out).
    Empty,
    /// An operation failed: its context and error.
    Failed {
        /// The operation context.
        context: *mut c_void,
        /// The error.
        error: FabricError,
    },
}

impl CompletionQueue {
    /// Opens a data-format completion queue of `size` entries with a file-descriptor wait object,
    /// so that [`CompletionQueue::sread`] sleeps in the kernel instead of spinning. Providers that
    /// cannot wait on a descriptor (`shm` 1.17 offers only a `sched_yield` loop, whose `sread`
    /// also ignores its timeout) get a queue without a wait object; [`CompletionQueue::can_block`]
    /// says which, and the caller then sleeps between reads itself.
    pub(crate) fn open(domain: &Arc<Domain>, size: usize) -> Result<Arc<Self>, FabricError> {
        let mut last = None;
        for (wait_obj, blocking) in [
            (sys::fi_wait_obj::FI_WAIT_FD, true),
            (sys::fi_wait_obj::FI_WAIT_NONE, false),
        ] {
            let mut attr = sys::fi_cq_attr {
                size,
                format: sys::fi_cq_format::FI_CQ_FORMAT_DATA,
                wait_obj,
                wait_cond: sys::fi_cq_wait_cond::FI_CQ_COND_NONE,
                ..Default::default()
            };
            let mut ptr = ptr::null_mut();
            // SAFETY: the domain is open and `attr` is a valid attribute struct for the call.
            let ret = unsafe {
                sys::kvx_fi_cq_open(domain.ptr.as_ptr(), &mut attr, &mut ptr, ptr::null_mut())
            };
            if ret < 0 {
                last = Some(FiErrno::new(i64::from(ret)));
                continue;
            }
            let ptr = NonNull::new(ptr).ok_or(FabricError::OpenCq(FiErrno::new(-i64::from(
                sys::FI_ENOMEM,
            ))))?;
            return Ok(Arc::new(Self {
                ptr,
                domain: Arc::clone(domain),
                blocking,
            }));
        }
        Err(FabricError::OpenCq(last.unwrap_or_else(|| {
            FiErrno::new(-i64::from(sys::FI_ENOSYS))
        })))
    }

    /// The file descriptor of the queue's wait object (`fi_control(FI_GETWAIT)`), for waiting on
    /// several queues at once with `poll(2)`; `None` for a queue without one, or a provider that
    /// does not hand it out.
    pub(crate) fn wait_fd(&self) -> Option<i32> {
        if !self.blocking {
            return None;
        }
        let fid = self.fid();
        let mut fd: i32 = -1;
        // SAFETY: the CQ is open; every fid carries its ops table, whose `control` entry (when
        // present) takes the fid, a command and, for FI_GETWAIT on an FI_WAIT_FD object, a
        // pointer to an int that receives the descriptor.
        let ret = unsafe {
            let ops = (*fid).ops;
            if ops.is_null() {
                return None;
            }
            let control = (*ops).control?;
            control(fid, FI_GETWAIT, (&mut fd as *mut i32).cast::<c_void>())
        };
        (ret == 0 && fd >= 0).then_some(fd)
    }

    /// `fi_trywait` on this queue: `Ok(true)` when the caller may block on the wait descriptor
    /// (nothing is ready), `Ok(false)` when it must read the queue first.
    pub(crate) fn try_wait(&self) -> Result<bool, FiErrno> {
        let fabric = self.domain.fabric.ptr.as_ptr();
        let mut fids = [self.fid()];
        // SAFETY: fabric and CQ are open; the fabric's ops table carries `trywait` (checked
        // non-null), which reads `count` fids from the array.
        let ret = unsafe {
            let ops = (*fabric).ops;
            if ops.is_null() {
                return Err(FiErrno::new(-i64::from(sys::FI_ENOSYS)));
            }
            let Some(trywait) = (*ops).trywait else {
                return Err(FiErrno::new(-i64::from(sys::FI_ENOSYS)));
            };
            trywait(fabric, fids.as_mut_ptr(), 1)
        };
        match ret {
            0 => Ok(true),
            r if r == -sys::FI_EAGAIN => Ok(false),
            r => Err(FiErrno::new(i64::from(r))),
        }
    }

    /// Whether [`CompletionQueue::sread`] can block on a wait object.
    pub(crate) fn can_block(&self) -> bool {
        self.blocking
    }

    /// Reads completions without blocking (this also drives manual progress).
    pub(crate) fn read(&self, out: &mut [sys::fi_cq_data_entry]) -> CqRead {
        // SAFETY: the CQ is open and `out` has room for `out.len()` entries of the CQ's format.
        let ret = unsafe {
            sys::kvx_fi_cq_read(
                self.ptr.as_ptr(),
                out.as_mut_ptr().cast::<c_void>(),
                out.len(),
            )
        };
        self.interpret(ret as i64)
    }

    /// Reads completions, blocking on the wait object for up to `timeout_ms` milliseconds.
    pub(crate) fn sread(&self, out: &mut [sys::fi_cq_data_entry], timeout_ms: i32) -> CqRead {
        // SAFETY: as in `read`; a null condition is allowed with FI_CQ_COND_NONE.
        let ret = unsafe {
            sys::kvx_fi_cq_sread(
                self.ptr.as_ptr(),
                out.as_mut_ptr().cast::<c_void>(),
                out.len(),
                ptr::null(),
                timeout_ms,
            )
        };
        self.interpret(ret as i64)
    }

    fn interpret(&self, ret: i64) -> CqRead {
        if ret > 0 {
            return CqRead::Entries(ret as usize);
        }
        if ret == 0 || ret == -i64::from(sys::FI_EAGAIN) || ret == -i64::from(sys::FI_ETIMEDOUT) {
            return CqRead::Empty;
        }
        if ret == -i64::from(sys::FI_EAVAIL) {
            return self.read_error();
        }
        CqRead::Failed {
            context: ptr::null_mut(),
            error: FabricError::ReadCq(FiErrno::new(ret)),
        }
    }

    fn read_error(&self) -> CqRead {
        let mut entry = sys::fi_cq_err_entry::default();
        // SAFETY: the CQ is open; `entry` is a zeroed error entry (err_data_size 0: the provider
        // uses its own buffer for error data, valid until the next CQ read).
        let ret = unsafe { sys::kvx_fi_cq_readerr(self.ptr.as_ptr(), &mut entry, 0) };
        if ret < 0 {
            if ret == -(sys::FI_EAGAIN as isize) {
                return CqRead::Empty;
            }
            return CqRead::Failed {
                context: ptr::null_mut(),
                error: FabricError::ReadCq(FiErrno::new(ret as i64)),
            };
        }
        let mut buf = [0 as std::os::raw::c_char; 256];
        // SAFETY: the CQ is open; err_data came from this error entry and is still valid (no CQ
        // read since); `buf` has room for `buf.len()` bytes.
        let text = unsafe {
            sys::kvx_fi_cq_strerror(
                self.ptr.as_ptr(),
                entry.prov_errno,
                entry.err_data,
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        let detail = if text.is_null() {
            String::new()
        } else {
            // SAFETY: fi_cq_strerror returns a NUL-terminated string (in `buf` or static).
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        CqRead::Failed {
            context: entry.op_context,
            error: FabricError::Completion {
                source: FiErrno::new(i64::from(entry.err)),
                prov_errno: entry.prov_errno,
                detail,
            },
        }
    }
}

impl AddressVector {
    /// Opens a table-type address vector.
    pub(crate) fn open(domain: &Arc<Domain>) -> Result<Arc<Self>, FabricError> {
        let mut attr = sys::fi_av_attr {
            type_: sys::fi_av_type::FI_AV_TABLE,
            ..Default::default()
        };
        let mut ptr = ptr::null_mut();
        // SAFETY: the domain is open and `attr` is a valid attribute struct.
        let ret = unsafe {
            sys::kvx_fi_av_open(domain.ptr.as_ptr(), &mut attr, &mut ptr, ptr::null_mut())
        };
        check(i64::from(ret), FabricError::OpenAv)?;
        let ptr = NonNull::new(ptr).ok_or(FabricError::OpenAv(FiErrno::new(-i64::from(
            sys::FI_ENOMEM,
        ))))?;
        Ok(Arc::new(Self {
            ptr,
            domain: Arc::clone(domain),
        }))
    }

    /// Inserts one peer address in the provider's format and returns its `fi_addr_t`.
    pub(crate) fn insert(&self, address: &[u8]) -> Result<sys::fi_addr_t, FabricError> {
        let mut addr: sys::fi_addr_t = sys::FI_ADDR_UNSPEC;
        // SAFETY: the AV is open; `address` holds one address of the provider's format (the
        // provider reads `addrlen` of its format from it: the caller checked the length against
        // this endpoint's own address length); `addr` receives one entry.
        let ret = unsafe {
            sys::kvx_fi_av_insert(
                self.ptr.as_ptr(),
                address.as_ptr().cast::<c_void>(),
                1,
                &mut addr,
                0,
                ptr::null_mut(),
            )
        };
        if ret != 1 || addr == sys::FI_ADDR_UNSPEC {
            let code = if ret < 0 {
                i64::from(ret)
            } else {
                -i64::from(sys::FI_EINVAL)
            };
            return Err(FabricError::AvInsert {
                len: address.len(),
                source: FiErrno::new(code),
            });
        }
        Ok(addr)
    }
}

impl AddressVector {
    /// Removes one entry that [`AddressVector::insert`] returned; nothing may be in flight to it.
    pub(crate) fn remove(&self, addr: sys::fi_addr_t) -> Result<(), FiErrno> {
        let mut addr = addr;
        // SAFETY: the AV is open and `addr` is one of its entries, with no operation in flight
        // to it (the caller's contract); the provider reads one entry.
        let ret = unsafe { sys::kvx_fi_av_remove(self.ptr.as_ptr(), &mut addr, 1, 0) };
        if ret < 0 {
            return Err(FiErrno::new(i64::from(ret)));
        }
        Ok(())
    }
}

impl Endpoint {
    /// Opens an RDM endpoint of the domain's description, binds it to `cq` (transmit and receive)
    /// and `av`, and enables it.
    pub(crate) fn open(
        domain: &Arc<Domain>,
        cq: &Arc<CompletionQueue>,
        av: &Arc<AddressVector>,
    ) -> Result<Arc<Self>, FabricError> {
        let mut ptr = ptr::null_mut();
        // SAFETY: the domain is open; the fi_info is owned by its fabric and outlives the call.
        let ret = unsafe {
            sys::kvx_fi_endpoint(
                domain.ptr.as_ptr(),
                domain.info().ptr.as_ptr(),
                &mut ptr,
                ptr::null_mut(),
            )
        };
        check(i64::from(ret), FabricError::OpenEndpoint)?;
        let ptr = NonNull::new(ptr).ok_or(FabricError::OpenEndpoint(FiErrno::new(-i64::from(
            sys::FI_ENOMEM,
        ))))?;
        // Own the endpoint before binding, so that a failure below closes it.
        let ep = Self {
            ptr,
            cq: Arc::clone(cq),
            av: Arc::clone(av),
        };
        // SAFETY: endpoint, CQ and AV are open objects of the same domain.
        let ret = unsafe {
            sys::kvx_fi_ep_bind(ep.ptr.as_ptr(), cq.fid(), sys::FI_TRANSMIT | sys::FI_RECV)
        };
        check(i64::from(ret), |source| FabricError::Bind {
            what: "cq",
            source,
        })?;
        // SAFETY: as above.
        let ret = unsafe { sys::kvx_fi_ep_bind(ep.ptr.as_ptr(), av.fid(), 0) };
        check(i64::from(ret), |source| FabricError::Bind {
            what: "av",
            source,
        })?;
        // SAFETY: the endpoint is open and bound.
        let ret = unsafe { sys::kvx_fi_enable(ep.ptr.as_ptr()) };
        check(i64::from(ret), FabricError::Enable)?;
        Ok(Arc::new(ep))
    }

    /// The endpoint's address in the provider's format.
    pub(crate) fn name(&self) -> Result<Vec<u8>, FabricError> {
        let mut buf = vec![0_u8; 256];
        let mut len = buf.len();
        // SAFETY: the endpoint is open; `buf` has room for `len` bytes.
        let mut ret =
            unsafe { sys::kvx_fi_getname(self.fid(), buf.as_mut_ptr().cast::<c_void>(), &mut len) };
        if ret == -sys::FI_ETOOSMALL {
            buf.resize(len, 0);
            // SAFETY: as above, with the size the provider asked for.
            ret = unsafe {
                sys::kvx_fi_getname(self.fid(), buf.as_mut_ptr().cast::<c_void>(), &mut len)
            };
        }
        check(i64::from(ret), FabricError::GetName)?;
        buf.truncate(len);
        Ok(buf)
    }

    /// The completion queue the endpoint is bound to.
    pub(crate) fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// The address vector the endpoint is bound to.
    pub(crate) fn av(&self) -> &AddressVector {
        &self.av
    }

    /// Posts one RMA write (or, with `data`, a write carrying remote CQ data).
    ///
    /// # Safety
    /// `local..local + len` must stay registered (under `desc`) and unchanged-in-meaning until
    /// the operation's completion is read, and `context` must stay valid until then.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn post_write(
        &self,
        local: *const u8,
        len: usize,
        desc: *mut c_void,
        dest: sys::fi_addr_t,
        remote_addr: u64,
        key: u64,
        data: Option<u64>,
        context: *mut c_void,
    ) -> Result<(), FiErrno> {
        let iov = sys::iovec {
            iov_base: local.cast_mut().cast::<c_void>(),
            iov_len: len,
        };
        let rma = sys::fi_rma_iov {
            addr: remote_addr,
            len,
            key,
        };
        let mut desc = desc;
        let msg = sys::fi_msg_rma {
            msg_iov: &iov,
            desc: &mut desc,
            iov_count: 1,
            addr: dest,
            rma_iov: &rma,
            rma_iov_count: 1,
            context,
            data: data.unwrap_or(0),
        };
        let flags = sys::FI_COMPLETION
            | if data.is_some() {
                sys::FI_REMOTE_CQ_DATA
            } else {
                0
            };
        // SAFETY: the message and its arrays live across the call (the provider copies what it
        // needs); buffer and context validity are the caller's contract.
        let ret = unsafe { sys::kvx_fi_writemsg(self.ptr.as_ptr(), &msg, flags) };
        if ret < 0 {
            Err(FiErrno::new(ret as i64))
        } else {
            Ok(())
        }
    }

    /// Posts one RMA read into `local..local + len`.
    ///
    /// # Safety
    /// As for [`Endpoint::post_write`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn post_read(
        &self,
        local: *mut u8,
        len: usize,
        desc: *mut c_void,
        src: sys::fi_addr_t,
        remote_addr: u64,
        key: u64,
        context: *mut c_void,
    ) -> Result<(), FiErrno> {
        let iov = sys::iovec {
            iov_base: local.cast::<c_void>(),
            iov_len: len,
        };
        let rma = sys::fi_rma_iov {
            addr: remote_addr,
            len,
            key,
        };
        let mut desc = desc;
        let msg = sys::fi_msg_rma {
            msg_iov: &iov,
            desc: &mut desc,
            iov_count: 1,
            addr: src,
            rma_iov: &rma,
            rma_iov_count: 1,
            context,
            data: 0,
        };
        // SAFETY: as in post_write.
        let ret = unsafe { sys::kvx_fi_readmsg(self.ptr.as_ptr(), &msg, sys::FI_COMPLETION) };
        if ret < 0 {
            Err(FiErrno::new(ret as i64))
        } else {
            Ok(())
        }
    }

    /// Posts a send of `local..local + len` to `dest`, or (with `dest == None`) a receive into it.
    ///
    /// # Safety
    /// As for [`Endpoint::post_write`].
    pub(crate) unsafe fn post_msg(
        &self,
        local: *mut u8,
        len: usize,
        desc: *mut c_void,
        dest: Option<sys::fi_addr_t>,
        context: *mut c_void,
    ) -> Result<(), FiErrno> {
        let iov = sys::iovec {
            iov_base: local.cast::<c_void>(),
            iov_len: len,
        };
        let mut desc = desc;
        let msg = sys::fi_msg {
            msg_iov: &iov,
            desc: &mut desc,
            iov_count: 1,
            addr: dest.unwrap_or(sys::FI_ADDR_UNSPEC),
            context,
            data: 0,
        };
        // SAFETY: as in post_write.
        let ret = unsafe {
            match dest {
                Some(_) => sys::kvx_fi_sendmsg(self.ptr.as_ptr(), &msg, sys::FI_COMPLETION),
                None => sys::kvx_fi_recvmsg(self.ptr.as_ptr(), &msg, sys::FI_COMPLETION),
            }
        };
        if ret < 0 {
            Err(FiErrno::new(ret as i64))
        } else {
            Ok(())
        }
    }
}

impl MemoryRegion {
    /// Registers `addr..addr + len` for local and remote access. `requested_key` is used where the
    /// provider lets the application choose keys (no `FI_MR_PROV_KEY`); with `FI_MR_ENDPOINT`,
    /// the registration is bound to `endpoint` and enabled.
    ///
    /// # Safety
    /// The memory must stay valid (allocated, of the kind registered) until the registration is
    /// dropped.
    pub(crate) unsafe fn register(
        domain: &Arc<Domain>,
        endpoint: Option<&Arc<Endpoint>>,
        addr: usize,
        len: usize,
        access: u64,
        requested_key: u64,
    ) -> Result<Self, FabricError> {
        let iov = sys::iovec {
            iov_base: addr as *mut c_void,
            iov_len: len,
        };
        let attr = sys::fi_mr_attr {
            mr_iov: &iov,
            iov_count: 1,
            access,
            requested_key,
            iface: sys::fi_hmem_iface::FI_HMEM_SYSTEM,
            ..Default::default()
        };
        let mut ptr = ptr::null_mut();
        // SAFETY: the domain is open; `attr` and `iov` live across the call; the memory's validity
        // is the caller's contract.
        let ret = unsafe { sys::kvx_fi_mr_regattr(domain.ptr.as_ptr(), &attr, 0, &mut ptr) };
        check(i64::from(ret), |source| FabricError::RegisterMemory {
            addr,
            len,
            source,
        })?;
        let ptr = NonNull::new(ptr).ok_or(FabricError::RegisterMemory {
            addr,
            len,
            source: FiErrno::new(-i64::from(sys::FI_ENOMEM)),
        })?;
        let mr = Self {
            ptr,
            domain: Arc::clone(domain),
            endpoint: endpoint.cloned(),
        };
        if let Some(ep) = endpoint {
            // SAFETY: MR and endpoint are open objects of the same domain.
            let ret = unsafe { sys::kvx_fi_mr_bind(mr.ptr.as_ptr(), ep.fid(), 0) };
            check(i64::from(ret), FabricError::BindMemory)?;
            // SAFETY: the MR is open and bound.
            let ret = unsafe { sys::kvx_fi_mr_enable(mr.ptr.as_ptr()) };
            check(i64::from(ret), FabricError::BindMemory)?;
        }
        Ok(mr)
    }

    /// The local descriptor to pass with operations on this memory (`FI_MR_LOCAL`).
    pub(crate) fn desc(&self) -> *mut c_void {
        // SAFETY: the MR is open.
        unsafe { sys::kvx_fi_mr_desc(self.ptr.as_ptr()) }
    }

    /// The remote key peers use.
    pub(crate) fn key(&self) -> u64 {
        // SAFETY: the MR is open.
        unsafe { sys::kvx_fi_mr_key(self.ptr.as_ptr()) }
    }
}

/// The `fi_control` command `FI_GETWAIT` (`<rdma/fabric.h>`: an anonymous enum, which bindgen
/// names by position; the value is part of libfabric's ABI).
const FI_GETWAIT: i32 = 5;

/// `struct pollfd` of poll(2).
#[repr(C)]
struct PollFd {
    fd: i32,
    events: i16,
    revents: i16,
}

/// `POLLIN` of poll(2).
const POLLIN: i16 = 1;

extern "C" {
    fn poll(fds: *mut PollFd, nfds: std::os::raw::c_ulong, timeout: i32) -> i32;
}

/// Blocks in poll(2) until one of `fds` is readable or `timeout_ms` passes (an interrupted call
/// returns early, as a timeout does).
pub(crate) fn poll_readable(fds: &[i32], timeout_ms: i32) {
    let mut set: Vec<PollFd> = fds
        .iter()
        .map(|&fd| PollFd {
            fd,
            events: POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `set` holds `set.len()` initialised pollfd structures and lives across the call.
    // The result needs no handling: readiness, a timeout and EINTR all mean "read the queues".
    let _ = unsafe {
        poll(
            set.as_mut_ptr(),
            std::os::raw::c_ulong::try_from(set.len()).unwrap_or(0),
            timeout_ms,
        )
    };
}
