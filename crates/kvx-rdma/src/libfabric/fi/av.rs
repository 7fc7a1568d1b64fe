//! The address vector: peers' addresses in, `fi_addr_t` handles out.

use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use libfabric_sys as sys;

use super::{check, AddressVector, Domain, FabricError, FiErrno};

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
