//! Safe owners of CUDA driver objects: the device and its primary context ([`Gpu`]), device
//! allocations ([`DeviceBuffer`]), streams and events. Every driver call goes through [`check`],
//! so a failure names the call and the driver's own error text.

use std::ffi::{c_void, CStr};
use std::fmt;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

/// A CUDA operation failed, or CUDA is not usable on this machine.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum CudaError {
    /// The CUDA driver library (`libcuda.so`) could not be loaded: no NVIDIA driver here.
    #[error("the CUDA driver library (libcuda.so) is not installed on this machine")]
    DriverMissing,
    /// The driver is present but sees no device.
    #[error("the CUDA driver sees no device")]
    NoDevice,
    /// A device ordinal beyond the devices present.
    #[error("CUDA device {ordinal} does not exist ({count} present)")]
    BadOrdinal {
        /// Ordinal asked for.
        ordinal: u32,
        /// Devices present.
        count: u32,
    },
    /// A driver call failed.
    #[error("{call} failed: {name} ({code}): {text}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its numeric result.
        code: u32,
        /// The result's name.
        name: String,
        /// The driver's description of it.
        text: String,
    },
    /// NVRTC (`libnvrtc.so`) could not be loaded, so kernels cannot be compiled.
    #[error("NVRTC (libnvrtc.so) is not installed on this machine; the layout kernels need it")]
    NvrtcMissing,
    /// A kernel did not compile.
    #[error("compiling the kvx kernels with NVRTC failed: {log}")]
    Compile {
        /// NVRTC's log or error.
        log: String,
    },
    /// A host-side access reached outside a device buffer.
    #[error("range {offset}..{offset}+{len} is outside the device buffer of {capacity} bytes")]
    OutOfBounds {
        /// First byte.
        offset: u64,
        /// Length.
        len: u64,
        /// Buffer length.
        capacity: u64,
    },
    /// An argument no kernel or copy can take (zero sizes, sizes past the device's limits).
    #[error("invalid argument: {0}")]
    Invalid(String),
}

/// Turns a driver result into a [`CudaError::Driver`] that names `call`.
pub(crate) fn check(call: &'static str, result: sys::CUresult) -> Result<(), CudaError> {
    if result == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static, NUL-terminated string (or leaves it
    // null for an unknown code); nothing is freed.
    let described = unsafe { sys::cuGetErrorString(result, &raw mut text) };
    let text = if described == sys::CUresult::CUDA_SUCCESS && !text.is_null() {
        // SAFETY: non-null and NUL-terminated, with static lifetime (see above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    } else {
        "unknown error".to_owned()
    };
    Err(CudaError::Driver {
        call,
        code: result as u32,
        name: format!("{result:?}"),
        text,
    })
}

/// Loads the driver and initialises it, once per process.
fn driver() -> Result<(), CudaError> {
    static INIT: OnceLock<Result<(), CudaError>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only probes whether the library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::DriverMissing);
        }
        // SAFETY: cuInit takes flags 0 and may be called from any thread, any number of times.
        check("cuInit", unsafe { sys::cuInit(0) })
    })
    .clone()
}

/// Number of CUDA devices, or why CUDA cannot be used here ([`CudaError::DriverMissing`] on a
/// machine without an NVIDIA driver: tests and benchmarks report themselves skipped then).
///
/// # Errors
/// [`CudaError::DriverMissing`], or the failing driver call.
pub fn device_count() -> Result<u32, CudaError> {
    driver()?;
    let mut count = 0;
    // SAFETY: the driver is initialised; `count` is a valid out-pointer.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&raw mut count)
    })?;
    Ok(u32::try_from(count).unwrap_or(0))
}

/// One CUDA device and its retained primary context (the context the CUDA runtime, PyTorch and
/// every other library in the process share). Released on drop.
pub struct Gpu {
    ordinal: u32,
    device: sys::CUdevice,
    context: sys::CUcontext,
    pci: String,
    max_pitch: u64,
    sms: u32,
    max_shared_optin: u32,
    compute: (u32, u32),
}

// SAFETY: a CUDA context handle may be made current on, and used from, any thread; `Gpu` holds
// no thread-affine state and is immutable after construction.
unsafe impl Send for Gpu {}
// SAFETY: as above; every method takes `&self` and binds the context to the calling thread first.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Opens device `ordinal` and retains its primary context.
    ///
    /// # Errors
    /// [`CudaError::DriverMissing`], [`CudaError::NoDevice`], [`CudaError::BadOrdinal`], or the
    /// failing driver call.
    pub fn open(ordinal: u32) -> Result<Arc<Self>, CudaError> {
        let count = device_count()?;
        if count == 0 {
            return Err(CudaError::NoDevice);
        }
        if ordinal >= count {
            return Err(CudaError::BadOrdinal { ordinal, count });
        }
        let mut device = 0;
        // SAFETY: initialised driver, ordinal in range, valid out-pointer.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&raw mut device, ordinal as i32)
        })?;
        let mut context = std::ptr::null_mut();
        // SAFETY: `device` is a valid device handle; valid out-pointer. Released in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&raw mut context, device)
        })?;
        let mut gpu = Self {
            ordinal,
            device,
            context,
            pci: String::new(),
            max_pitch: 0,
            sms: 0,
            max_shared_optin: 0,
            compute: (0, 0),
        };
        gpu.pci = gpu.read_pci()?;
        let attr = |a| gpu.attribute(a);
        let max_pitch = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH)?;
        let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let shared =
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        gpu.max_pitch = u64::from(max_pitch);
        gpu.sms = sms;
        gpu.max_shared_optin = shared;
        gpu.compute = (major, minor);
        Ok(Arc::new(gpu))
    }

    fn attribute(&self, attribute: sys::CUdevice_attribute) -> Result<u32, CudaError> {
        let mut value = 0;
        // SAFETY: valid device handle and out-pointer.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(&raw mut value, attribute, self.device)
        })?;
        Ok(u32::try_from(value).unwrap_or(0))
    }

    fn read_pci(&self) -> Result<String, CudaError> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: the buffer holds 32 bytes and its length is passed; the driver NUL-terminates.
        check("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.device)
        })?;
        // SAFETY: NUL-terminated within the buffer (the driver writes at most `len` bytes).
        let raw = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
        Ok(normalize_pci(&raw))
    }

    /// Makes this device's context current on the calling thread (cheap; every operation calls
    /// it first, so a `Gpu` can be used from any thread).
    ///
    /// # Errors
    /// The failing driver call.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context is retained for the lifetime of `self`.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.context)
        })
    }

    /// Device ordinal.
    #[must_use]
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// PCI address in sysfs form (`0000:53:00.0`), for rail selection.
    #[must_use]
    pub fn pci_address(&self) -> &str {
        &self.pci
    }

    /// Streaming multiprocessors.
    #[must_use]
    pub fn multiprocessors(&self) -> u32 {
        self.sms
    }

    /// Compute capability (major, minor).
    #[must_use]
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute
    }

    /// Largest pitch a 2-D copy accepts.
    pub(crate) fn max_pitch(&self) -> u64 {
        self.max_pitch
    }

    /// Most shared memory one thread block may opt into.
    pub(crate) fn max_shared_optin(&self) -> u32 {
        self.max_shared_optin
    }

    /// Free and total bytes of device memory, as the driver counts them now.
    ///
    /// # Errors
    /// The failing driver call.
    pub fn memory_info(&self) -> Result<(u64, u64), CudaError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: bound context, valid out-pointers.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&raw mut free, &raw mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    /// Whether this device can map `other`'s memory directly (peer access over NVLink or PCIe).
    ///
    /// # Errors
    /// The failing driver call.
    pub fn can_access_peer(&self, other: &Gpu) -> Result<bool, CudaError> {
        if other.device == self.device {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: valid device handles and out-pointer.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&raw mut can, self.device, other.device)
        })?;
        Ok(can != 0)
    }

    /// Lets this device's context access `other`'s memory directly (peer access over NVLink
    /// or PCIe); already enabled is fine.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] when the devices cannot access each other, or the failing call.
    pub fn enable_peer_access(&self, other: &Gpu) -> Result<(), CudaError> {
        if other.device == self.device {
            return Ok(());
        }
        if !self.can_access_peer(other)? {
            return Err(CudaError::Invalid(format!(
                "device {} cannot access device {}",
                self.ordinal, other.ordinal
            )));
        }
        self.bind()?;
        // SAFETY: both contexts are retained primary contexts; flags must be 0.
        let result = unsafe { sys::cuCtxEnablePeerAccess(other.context, 0) };
        if result == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check("cuCtxEnablePeerAccess", result)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: retained once in `open`, released once here.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ordinal)
            .field("pci", &self.pci)
            .field("compute", &self.compute)
            .finish()
    }
}

/// `0000:53:00.0` from the driver's `00000000:53:00.0`, lower case, as sysfs writes it.
pub(crate) fn normalize_pci(raw: &str) -> String {
    let raw = raw.trim().to_ascii_lowercase();
    match raw.split_once(':') {
        Some((domain, rest)) => {
            let domain = u32::from_str_radix(domain, 16).unwrap_or(0);
            format!("{domain:04x}:{rest}")
        }
        None => raw,
    }
}

/// An owned device allocation (`cuMemAlloc`), freed on drop. Accessed from the host only through
/// bounds-checked copies; device code and peers reach it through its address.
pub struct DeviceBuffer {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: u64,
}

// SAFETY: a device pointer is a plain number valid in every thread of the process; the buffer is
// only touched through driver calls, which synchronise themselves.
unsafe impl Send for DeviceBuffer {}
// SAFETY: as above: `&DeviceBuffer` only permits driver copies with explicit bounds.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `len` bytes on `gpu`, filled with zeros.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for `len == 0`, or the failing driver call (out of memory).
    pub fn new(gpu: &Arc<Gpu>, len: u64) -> Result<Self, CudaError> {
        if len == 0 {
            return Err(CudaError::Invalid(
                "a device buffer must not be empty".into(),
            ));
        }
        let bytes = usize::try_from(len).map_err(|_| CudaError::Invalid(format!("{len} bytes")))?;
        gpu.bind()?;
        let mut ptr = 0;
        // SAFETY: bound context, valid out-pointer; freed in Drop.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&raw mut ptr, bytes)
        })?;
        let buffer = Self {
            gpu: Arc::clone(gpu),
            ptr,
            len,
        };
        // SAFETY: `ptr..ptr+bytes` was just allocated.
        check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(ptr, 0, bytes) })?;
        // A memset of device memory may still be running on the default stream when it returns,
        // and kvx's streams do not wait for that stream: without this, the zeroing could land
        // after a peer's (or a kernel table's) first write into the buffer.
        // SAFETY: the null stream is the context's default stream, always valid.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(std::ptr::null_mut())
        })?;
        Ok(buffer)
    }

    /// Device address.
    #[must_use]
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always `false`: a buffer has at least one byte.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The device it lives on.
    #[must_use]
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn bounds(&self, offset: u64, len: usize) -> Result<(), CudaError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError::OutOfBounds {
                offset,
                len: len as u64,
                capacity: self.len,
            }),
        }
    }

    /// Copies `bytes` to the buffer at `offset` (synchronous).
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`], or the failing driver call.
    pub fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), CudaError> {
        self.bounds(offset, bytes.len())?;
        self.gpu.bind()?;
        // SAFETY: the destination range lies inside the allocation (checked); the source is a
        // live host slice of that length.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(
                self.ptr + offset,
                bytes.as_ptr().cast::<c_void>(),
                bytes.len(),
            )
        })?;
        // From pageable memory the call may return before the data reached the device, on the
        // default stream, which kvx's streams do not wait for: finish it here.
        // SAFETY: the null stream is the context's default stream, always valid.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(std::ptr::null_mut())
        })
    }

    /// Copies bytes at `offset` into `out` (synchronous).
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`], or the failing driver call.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), CudaError> {
        self.bounds(offset, out.len())?;
        self.gpu.bind()?;
        // SAFETY: the source range lies inside the allocation (checked); `out` is an exclusive
        // host slice of that length.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(
                out.as_mut_ptr().cast::<c_void>(),
                self.ptr + offset,
                out.len(),
            )
        })
    }

    /// A copy of the whole contents.
    ///
    /// # Errors
    /// The failing driver call.
    pub fn to_vec(&self) -> Result<Vec<u8>, CudaError> {
        let mut out = vec![0; usize::try_from(self.len).unwrap_or(usize::MAX)];
        self.read_at(0, &mut out)?;
        Ok(out)
    }

    /// Fills the buffer with `f(i)` for byte `i` (through a host staging copy of 16 MiB pieces).
    ///
    /// # Errors
    /// The failing driver call.
    pub fn fill_with(&self, mut f: impl FnMut(u64) -> u8) -> Result<(), CudaError> {
        const PIECE: u64 = 16 << 20;
        let mut offset = 0;
        let mut staging = Vec::new();
        while offset < self.len {
            let n = PIECE.min(self.len - offset);
            staging.clear();
            staging.extend((offset..offset + n).map(&mut f));
            self.write_at(offset, &staging)?;
            offset += n;
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated once in `new`, freed once here; no copy the buffer issued is
            // still running (the synchronous ones returned, transports keep an `Arc` of the
            // buffer's region until their operations finish).
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("gpu", &self.gpu.ordinal)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

/// A non-blocking stream of one device, destroyed on drop.
pub struct Stream {
    gpu: Arc<Gpu>,
    raw: sys::CUstream,
}

// SAFETY: stream handles may be used from any thread once the owning context is current (every
// use binds it first).
unsafe impl Send for Stream {}

impl Stream {
    /// A new non-blocking stream on `gpu`.
    ///
    /// # Errors
    /// The failing driver call.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Self, CudaError> {
        gpu.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: bound context, valid out-pointer; destroyed in Drop.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(
                &raw mut raw,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        Ok(Self {
            gpu: Arc::clone(gpu),
            raw,
        })
    }

    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    pub(crate) fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Enqueues a copy of `len` bytes between two buffers (on the same device or on two devices;
    /// with peer access enabled the copy goes device to device, over NVLink where there is one).
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`] when a range does not fit its buffer, or the failing driver call.
    pub fn copy(
        &self,
        dst: &DeviceBuffer,
        dst_offset: u64,
        src: &DeviceBuffer,
        src_offset: u64,
        len: u64,
    ) -> Result<(), CudaError> {
        let n = usize::try_from(len).map_err(|_| CudaError::Invalid(format!("{len} bytes")))?;
        dst.bounds(dst_offset, n)?;
        src.bounds(src_offset, n)?;
        self.gpu.bind()?;
        // SAFETY: both ranges lie inside live allocations (checked); the caller's borrows keep
        // the buffers alive for the call, and `DeviceBuffer::drop` frees only after the device is
        // idle with respect to synchronous frees (cuMemFree waits for pending work).
        check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(dst.ptr + dst_offset, src.ptr + src_offset, n, self.raw)
        })
    }

    /// Blocks until everything queued on the stream has run.
    ///
    /// # Errors
    /// The failing driver call (an earlier asynchronous failure surfaces here).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu.bind()?;
        // SAFETY: a live stream of the bound context.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: created once in `new`; the driver lets queued work finish first.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        }
    }
}

/// A timing event, destroyed on drop (benchmarks and tests).
pub struct Event {
    gpu: Arc<Gpu>,
    raw: sys::CUevent,
}

// SAFETY: event handles may be recorded, waited on and destroyed from any thread that binds the
// owning context (every use binds it first).
unsafe impl Send for Event {}

impl Event {
    /// A new timing event on `gpu`.
    ///
    /// # Errors
    /// The failing driver call.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Self, CudaError> {
        gpu.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: bound context, valid out-pointer; destroyed in Drop.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&raw mut raw, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
        })?;
        Ok(Self {
            gpu: Arc::clone(gpu),
            raw,
        })
    }

    /// Records the event on `stream`.
    ///
    /// # Errors
    /// The failing driver call.
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        // SAFETY: live event and stream of the same context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw())
        })
    }

    /// Blocks until the work recorded before the event has run (at once if never recorded).
    ///
    /// # Errors
    /// The failing driver call.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu.bind()?;
        // SAFETY: a live event.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// Milliseconds from `start` to `self` (waits for `self` to complete).
    ///
    /// # Errors
    /// The failing driver call.
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32, CudaError> {
        // SAFETY: live event.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })?;
        let mut ms = 0.0;
        // SAFETY: both events recorded and complete; valid out-pointer.
        check("cuEventElapsedTime_v2", unsafe {
            sys::cuEventElapsedTime_v2(&raw mut ms, start.raw, self.raw)
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: created once in `new`.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_are_normalised_to_sysfs_form() {
        assert_eq!(normalize_pci("00000000:53:00.0"), "0000:53:00.0");
        assert_eq!(normalize_pci("0001:AB:00.0\n"), "0001:ab:00.0");
    }
}
