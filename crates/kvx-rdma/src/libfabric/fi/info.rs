//! Provider descriptions: an owned `fi_info` list ([`Info`]) and what a query asks for
//! ([`Query`]).

use std::ffi::{CStr, CString};
use std::fmt;
use std::ptr::{self, NonNull};

use libfabric_sys as sys;

use super::{FabricError, FiErrno};

/// An owned `fi_info` list (released with `fi_freeinfo`); only its first entry is used.
pub(crate) struct Info {
    pub(super) ptr: NonNull<sys::fi_info>,
}

// SAFETY: `fi_info` is plain heap data owned exclusively by this handle; libfabric keeps no
// reference to it.
unsafe impl Send for Info {}
// SAFETY: shared access only reads the description.
unsafe impl Sync for Info {}

impl Drop for Info {
    fn drop(&mut self) {
        // SAFETY: the list came from fi_getinfo and is freed exactly once.
        unsafe { sys::kvx_fi_freeinfo(self.ptr.as_ptr()) }
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
    /// Device memory (`FI_HMEM`) among the capabilities asked for.
    pub(crate) hmem: bool,
}

impl Info {
    /// The first provider entry matching `query`: an RDM endpoint with messages and RMA in both
    /// directions, the memory-registration modes kvx handles (`FI_MR_LOCAL`, `FI_MR_VIRT_ADDR`,
    /// `FI_MR_ALLOCATED`, `FI_MR_PROV_KEY`, `FI_MR_ENDPOINT`), the context modes it handles
    /// (`FI_CONTEXT`, `FI_CONTEXT2`, `FI_RX_CQ_DATA`), `FI_THREAD_DOMAIN`, and (if asked)
    /// `FI_DELIVERY_COMPLETE` as the default completion semantics of transmit operations.
    pub(crate) fn query(query: &Query<'_>) -> Result<Self, FabricError> {
        // Every libfabric object comes from a query: the library is loaded before the first.
        super::load_library()?;
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
                | sys::FI_REMOTE_WRITE
                | if query.hmem { sys::FI_HMEM } else { 0 };
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
            let ret = sys::kvx_fi_getinfo(
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
                let copy = unsafe { sys::kvx_fi_dupinfo(entry) };
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

    pub(super) fn raw(&self) -> &sys::fi_info {
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

    /// Bytes of a memory-registration key (`mr_key_size`).
    pub(crate) fn mr_key_size(&self) -> usize {
        // SAFETY: domain_attr is always allocated.
        unsafe { (*self.raw().domain_attr).mr_key_size }
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
