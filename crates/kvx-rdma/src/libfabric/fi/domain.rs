//! Opening the fabric and the domain of a provider description.

use std::ptr::{self, NonNull};
use std::sync::Arc;

use libfabric_sys as sys;

use super::{check, Domain, Fabric, FabricError, FiErrno, Info};

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
