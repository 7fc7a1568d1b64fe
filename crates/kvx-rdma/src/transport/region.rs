//! Local memory that a transport registers: an owned, page-aligned host buffer for tests, tools and
//! staging, and [`LocalRegion`], the description of one region handed to
//! [`Transport::register`](crate::Transport::register).

use std::alloc::{self, Layout};
use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use kvx_core::MemoryKind;

/// Alignment of a [`HostBuffer`]: one page, so that registrations never share a page with
/// unrelated data (some providers pin whole pages).
pub const HOST_BUFFER_ALIGN: usize = 4096;

/// Host buffers of at least this size are aligned to it and, on Linux, advised to be backed by
/// transparent huge pages (`MADV_HUGEPAGE`): a KV cache on huge pages costs fewer TLB misses in
/// every copy, and the kernel pins (and copies across processes) a huge page at a time.
pub const HUGE_PAGE: usize = 2 * 1024 * 1024;

/// An owned, zero-initialised, page-aligned block of host memory that remote peers may write into
/// once it is registered.
///
/// The memory is only ever accessed through raw copies ([`HostBuffer::write_at`],
/// [`HostBuffer::read_at`]), never through references: a transport (another process, a NIC) may
/// change the bytes at any time while the buffer is registered, and the contents mean something
/// only once the transport has said so (a completion notice, a finished read).
pub struct HostBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is a plain heap allocation that the `HostBuffer` owns; every access goes
// through raw copies with explicit bounds, so sharing or moving it across threads creates no
// reference that could alias a concurrent access.
unsafe impl Send for HostBuffer {}
// SAFETY: as above: `&HostBuffer` only permits bounds-checked raw copies.
unsafe impl Sync for HostBuffer {}

/// A [`HostBuffer`] could not be created or accessed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum BufferError {
    /// A buffer of zero bytes was requested.
    #[error("a host buffer must not be empty")]
    Empty,
    /// The allocation failed or its size cannot be represented.
    #[error("could not allocate a host buffer of {len} bytes")]
    Alloc {
        /// Requested length.
        len: usize,
    },
    /// An access reached past the end of the buffer.
    #[error("range {offset}..{offset}+{len} is outside the buffer of {capacity} bytes")]
    OutOfBounds {
        /// First byte of the access.
        offset: usize,
        /// Length of the access.
        len: usize,
        /// Size of the buffer.
        capacity: usize,
    },
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes aligned to [`HOST_BUFFER_ALIGN`], or to [`HUGE_PAGE`] (and
    /// advised onto huge pages) from that size up.
    ///
    /// # Errors
    /// [`BufferError::Empty`] for `len == 0`, [`BufferError::Alloc`] when the allocator fails.
    pub fn new(len: usize) -> Result<Self, BufferError> {
        if len == 0 {
            return Err(BufferError::Empty);
        }
        let huge = len >= HUGE_PAGE;
        let align = if huge { HUGE_PAGE } else { HOST_BUFFER_ALIGN };
        let layout = Layout::from_size_align(len, align).map_err(|_| BufferError::Alloc { len })?;
        let raw = if huge {
            // SAFETY: the layout has a non-zero size (checked above).
            let raw = unsafe { alloc::alloc(layout) };
            if !raw.is_null() {
                advise_huge_pages(raw, len);
                // SAFETY: `raw` is a fresh allocation of `len` bytes; zeroing it is what
                // faults its pages in, after the advice, so they come as huge pages.
                unsafe { std::ptr::write_bytes(raw, 0, len) };
            }
            raw
        } else {
            // SAFETY: the layout has a non-zero size (checked above).
            unsafe { alloc::alloc_zeroed(layout) }
        };
        let ptr = NonNull::new(raw).ok_or(BufferError::Alloc { len })?;
        Ok(Self { ptr, layout })
    }

    /// Length in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Always `false`: a buffer has at least one byte.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Base address of the buffer.
    #[must_use]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), BufferError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(BufferError::OutOfBounds {
                offset,
                len,
                capacity: self.len(),
            }),
        }
    }

    /// Copies `bytes` into the buffer at `offset`.
    ///
    /// # Errors
    /// [`BufferError::OutOfBounds`] when the range does not fit.
    pub fn write_at(&self, offset: usize, bytes: &[u8]) -> Result<(), BufferError> {
        self.check(offset, bytes.len())?;
        // SAFETY: `offset + bytes.len() <= len` (checked), so the destination lies inside the
        // allocation; `bytes` is a live slice of other memory (a `&[u8]` cannot point into this
        // buffer, which never hands out references), so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.as_ptr().add(offset), bytes.len());
        }
        Ok(())
    }

    /// Copies bytes from the buffer at `offset` into `out`.
    ///
    /// # Errors
    /// [`BufferError::OutOfBounds`] when the range does not fit.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<(), BufferError> {
        self.check(offset, out.len())?;
        // SAFETY: the source range lies inside the allocation (checked); `out` is an exclusive
        // slice of other memory.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), out.as_mut_ptr(), out.len());
        }
        Ok(())
    }

    /// Fills the whole buffer with `f(i)` for byte `i`.
    pub fn fill_with(&self, mut f: impl FnMut(usize) -> u8) {
        let mut chunk = [0_u8; 4096];
        let mut offset = 0;
        while offset < self.len() {
            let n = chunk.len().min(self.len() - offset);
            for (i, byte) in chunk[..n].iter_mut().enumerate() {
                *byte = f(offset + i);
            }
            // The range is inside the buffer by construction.
            let _ = self.write_at(offset, &chunk[..n]);
            offset += n;
        }
    }

    /// A copy of the whole contents.
    #[must_use]
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0; self.len()];
        // The range is the whole buffer.
        let _ = self.read_at(0, &mut out);
        out
    }
}

/// Asks the kernel to back `len` bytes at `addr` (a fresh allocation, aligned to [`HUGE_PAGE`])
/// with transparent huge pages. Only a hint: refused or unsupported, nothing changes.
#[cfg(target_os = "linux")]
fn advise_huge_pages(addr: *mut u8, len: usize) {
    // SAFETY: the range is one live allocation of ours; MADV_HUGEPAGE changes only how its
    // pages are backed, never their contents or validity.
    let _ = unsafe { libc::madvise(addr.cast(), len, libc::MADV_HUGEPAGE) };
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_addr: *mut u8, _len: usize) {}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` was returned by `alloc_zeroed` with exactly this layout and is freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len())
            .finish()
    }
}

/// One region of local memory to register with a transport, under the index that the layout
/// (and so the transfer plan) uses for it.
///
/// Made safely from an owned [`HostBuffer`] (the region keeps the buffer alive for as long as the
/// transport holds the registration), or unsafely from raw parts for memory that someone else
/// owns (an inference engine's KV cache).
#[derive(Clone)]
pub struct LocalRegion {
    index: u32,
    kind: MemoryKind,
    addr: usize,
    len: u64,
    owner: Option<Arc<dyn Any + Send + Sync>>,
}

impl LocalRegion {
    /// The whole of `buffer` as host region `index`.
    #[must_use]
    pub fn host(index: u32, buffer: Arc<HostBuffer>) -> Self {
        Self {
            index,
            kind: MemoryKind::Host,
            addr: buffer.as_ptr() as usize,
            len: buffer.len() as u64,
            owner: Some(buffer),
        }
    }

    /// The whole of an allocation that `owner` keeps alive, as region `index` of `kind` (the
    /// device modules' constructors: [`LocalRegion::cuda`], `LocalRegion::neuron`).
    #[cfg(any(feature = "cuda", feature = "neuron"))]
    pub(crate) fn owned(
        index: u32,
        kind: MemoryKind,
        addr: usize,
        len: u64,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        Self {
            index,
            kind,
            addr,
            len,
            owner: Some(owner),
        }
    }

    /// A region over memory owned elsewhere.
    ///
    /// # Safety
    /// `addr..addr + len` must be one allocation of memory of `kind`, valid for reads and writes
    /// from the moment it is registered until it is deregistered or the transport is dropped; and
    /// the owner must accept that transports (and through them remote peers) read and write those
    /// bytes at any time in that span, so it must not hold Rust references into the range while
    /// the region is registered.
    #[must_use]
    pub unsafe fn from_raw(index: u32, kind: MemoryKind, addr: *mut u8, len: u64) -> Self {
        Self {
            index,
            kind,
            addr: addr as usize,
            len,
            owner: None,
        }
    }

    /// Region index in the owner's layout.
    #[must_use]
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Kind of memory.
    #[must_use]
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// Base address.
    #[must_use]
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Length in bytes.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region has no bytes (transports refuse to register such a region).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Debug for LocalRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalRegion")
            .field("index", &self.index)
            .field("kind", &self.kind)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("owned", &self.owner.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_are_zeroed_and_aligned_to_huge_pages() {
        let len = 2 * HUGE_PAGE + 4096;
        let buffer = HostBuffer::new(len).unwrap();
        assert_eq!(buffer.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(buffer.len(), len);
        assert!(buffer.to_vec().iter().all(|&b| b == 0));
        buffer.write_at(len - 2, &[7, 8]).unwrap();
        let mut tail = [0u8; 2];
        buffer.read_at(len - 2, &mut tail).unwrap();
        assert_eq!(tail, [7, 8]);
    }

    #[test]
    fn buffer_is_zeroed_aligned_and_bounds_checked() {
        let buffer = HostBuffer::new(10_000).unwrap();
        assert_eq!(buffer.as_ptr() as usize % HOST_BUFFER_ALIGN, 0);
        assert!(buffer.to_vec().iter().all(|&b| b == 0));
        buffer.write_at(9_998, &[1, 2]).unwrap();
        assert_eq!(
            buffer.write_at(9_999, &[1, 2]),
            Err(BufferError::OutOfBounds {
                offset: 9_999,
                len: 2,
                capacity: 10_000
            })
        );
        assert!(buffer.read_at(usize::MAX, &mut [0]).is_err());
        let mut out = [0; 2];
        buffer.read_at(9_998, &mut out).unwrap();
        assert_eq!(out, [1, 2]);
        assert_eq!(HostBuffer::new(0).unwrap_err(), BufferError::Empty);
    }

    #[test]
    fn fill_with_covers_every_byte() {
        let buffer = HostBuffer::new(5_000).unwrap();
        buffer.fill_with(|i| (i % 251) as u8);
        let bytes = buffer.to_vec();
        assert!(bytes.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
    }

    #[test]
    fn host_region_describes_its_buffer() {
        let buffer = Arc::new(HostBuffer::new(64).unwrap());
        let region = LocalRegion::host(3, Arc::clone(&buffer));
        assert_eq!(region.index(), 3);
        assert_eq!(region.addr(), buffer.as_ptr() as usize);
        assert_eq!(region.len(), 64);
        assert_eq!(region.kind(), MemoryKind::Host);
        assert_eq!(Arc::strong_count(&buffer), 2);
        drop(region);
        assert_eq!(Arc::strong_count(&buffer), 1);
    }
}
