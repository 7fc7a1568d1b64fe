//! The RDM endpoint: opening and binding it, its address, and posting RMA writes and reads,
//! sends and receives.

use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use libfabric_sys as sys;

use super::{check, AddressVector, CompletionQueue, Domain, Endpoint, FabricError, FiErrno};

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
