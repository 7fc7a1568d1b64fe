//! The completion queue: reading completions and errors, blocking reads, and waiting on the
//! queue's descriptor with `poll(2)`.

use std::ffi::{c_void, CStr};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use libfabric_sys as sys;

use super::{CompletionQueue, Domain, FabricError, FiErrno};

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
