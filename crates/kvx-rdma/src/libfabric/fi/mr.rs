//! Memory registrations: local descriptors and remote keys.

use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use libfabric_sys as sys;

use super::{check, Domain, Endpoint, FabricError, FiErrno, MemoryRegion};

/// Where registered memory lives (`fi_mr_attr::iface` and its device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hmem {
    /// Host memory.
    System,
    /// Memory of this CUDA device ordinal.
    Cuda(u32),
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
        memory: Hmem,
    ) -> Result<Self, FabricError> {
        let iov = sys::iovec {
            iov_base: addr as *mut c_void,
            iov_len: len,
        };
        let mut attr = sys::fi_mr_attr {
            mr_iov: &iov,
            iov_count: 1,
            access,
            requested_key,
            iface: sys::fi_hmem_iface::FI_HMEM_SYSTEM,
            ..Default::default()
        };
        if let Hmem::Cuda(device) = memory {
            attr.iface = sys::fi_hmem_iface::FI_HMEM_CUDA;
            attr.device.cuda = i32::try_from(device).unwrap_or(i32::MAX);
        }
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
