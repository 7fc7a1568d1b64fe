//! The copy paths: a plan's operations on a peer's stream, through the copy engines
//! (`cuMemcpyAsync`, `cuMemcpy2DAsync`) or the batched-copy kernel, as [`CopyMethod`] chooses.

use cudarc::driver::sys;
use kvx_layout::CopyOp;

use super::super::driver::{check, CudaError, Stream};
use super::super::kernels::LayoutKernels;
use super::{boxed, CopyMethod, CudaIpcTransport, IpcError};
use crate::error::BackendError;
use crate::transport::{Notice, OpId, OpKind, PeerId};

/// Average run below which [`CopyMethod::Auto`] prefers the batched-copy kernel.
const KERNEL_BELOW: u64 = 64 << 10;

/// A region lookup: index → (address in this process, length).
type RegionFn<'a> = &'a dyn Fn(u32) -> Option<(u64, u64)>;

/// Note for a fallback that changes nothing the caller must act on.
fn note_fallback(error: &CudaError) {
    tracing::debug!(%error, "kvx cuda-ipc: batched-copy kernel unavailable, using the copy engines");
}

/// Makes `later` wait for everything queued on `earlier` so far.
fn sync_streams(earlier: &Stream, later: &Stream) -> Result<(), CudaError> {
    let gpu = earlier.gpu();
    gpu.bind()?;
    let mut event = std::ptr::null_mut();
    // SAFETY: bound context, valid out-pointer.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(
            &raw mut event,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
        )
    })?;
    // SAFETY: live event and streams of one context; the event may be destroyed right after the
    // wait is queued (the driver keeps what the wait needs).
    let result = unsafe {
        check("cuEventRecord", sys::cuEventRecord(event, earlier.raw())).and_then(|()| {
            check(
                "cuStreamWaitEvent",
                sys::cuStreamWaitEvent(later.raw(), event, 0),
            )
        })
    };
    // SAFETY: created above, destroyed once.
    unsafe { sys::cuEventDestroy_v2(event) };
    result
}

/// Queues `ops` (already checked against `src` and `dst` by the caller) on `stream` as
/// copy-engine copies: one `cuMemcpyAsync` per contiguous operation,
/// one `cuMemcpy2DAsync` per strided one (per piece where the pitch is out of the 2-D limits).
fn post_copy_engine(
    stream: &Stream,
    ops: &[CopyOp],
    src: &dyn Fn(u32) -> Option<(u64, u64)>,
    dst: &dyn Fn(u32) -> Option<(u64, u64)>,
    max_pitch: u64,
) -> Result<(), CudaError> {
    // `write`/`read` checked every operation against these same regions before posting.
    stream.gpu().bind()?;
    for op in ops {
        let (src_base, _) = src(op.src_region).unwrap_or_default();
        let (dst_base, _) = dst(op.dst_region).unwrap_or_default();
        let contiguous = op.count == 1 || (op.src_stride == op.len && op.dst_stride == op.len);
        if contiguous {
            // SAFETY: both ranges lie inside live regions (checked by `write`/`read`); the caller keeps
            // them alive until the stream has run.
            // Device to device (both sides are device memory: local, or a peer's mapped through
            // IPC), which spares the driver the unified-address lookup of `cuMemcpyAsync`.
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(
                    dst_base + op.dst_offset,
                    src_base + op.src_offset,
                    (op.len * op.count) as usize,
                    stream.raw(),
                )
            })?;
        } else if op.src_stride >= op.len
            && op.dst_stride >= op.len
            && op.src_stride <= max_pitch
            && op.dst_stride <= max_pitch
        {
            let copy = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                srcHost: std::ptr::null(),
                srcDevice: src_base + op.src_offset,
                srcArray: std::ptr::null_mut(),
                srcPitch: op.src_stride as usize,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                dstHost: std::ptr::null_mut(),
                dstDevice: dst_base + op.dst_offset,
                dstArray: std::ptr::null_mut(),
                dstPitch: op.dst_stride as usize,
                WidthInBytes: op.len as usize,
                Height: op.count as usize,
            };
            // SAFETY: every row lies inside live regions (checked by `write`/`read`); the descriptor is
            // read during the call.
            check("cuMemcpy2DAsync", unsafe {
                sys::cuMemcpy2DAsync_v2(&raw const copy, stream.raw())
            })?;
        } else {
            for (s, d, len) in op.pieces() {
                // SAFETY: as for the contiguous case, per piece.
                check("cuMemcpyAsync", unsafe {
                    sys::cuMemcpyAsync(dst_base + d, src_base + s, len as usize, stream.raw())
                })?;
            }
        }
    }
    Ok(())
}

impl CudaIpcTransport {
    /// Posts `ops` on the peer's stream (copy engines or the batched-copy kernel), records a
    /// completion event behind them and hands it to the watcher; returns the op id.
    pub(super) fn post(
        &mut self,
        peer_id: PeerId,
        kind: OpKind,
        ops: &[CopyOp],
        notice: Option<Notice>,
        bytes: u64,
    ) -> Result<OpId, BackendError> {
        let op = self.ledger.next_id();
        let method = self.config.copy;
        let max_pitch = self.gpu.max_pitch();
        let regions = &self.regions;
        let local = |i: u32| {
            regions
                .get(&i)
                .map(|l| (l.region.addr() as u64, l.region.len()))
        };
        let Some(peer) = self
            .peers
            .get_mut(peer_id.0 as usize)
            .and_then(Option::as_mut)
        else {
            return Err(boxed(IpcError::PeerClosed));
        };
        let remote_regions = &peer.regions;
        let remote = |i: u32| remote_regions.get(&i).copied();
        let (src, dst): (RegionFn<'_>, RegionFn<'_>) = match kind {
            OpKind::Read => (&remote, &local),
            _ => (&local, &remote),
        };
        let runs: u64 = ops.iter().map(|o| o.count).sum();
        let use_kernel = match method {
            CopyMethod::CopyEngine => false,
            CopyMethod::Kernel => true,
            CopyMethod::Auto => {
                !peer.kernels_unavailable && runs > 64 && bytes / runs.max(1) < KERNEL_BELOW
            }
        };
        if use_kernel && peer.kernels.is_none() {
            match LayoutKernels::new(peer.stream.gpu()) {
                Ok(k) => peer.kernels = Some(k),
                Err(e) if method == CopyMethod::Auto => {
                    peer.kernels_unavailable = true;
                    note_fallback(&e);
                }
                Err(e) => return Err(boxed(e)),
            }
        }
        match peer.kernels.as_mut().filter(|_| use_kernel) {
            Some(kernels) => {
                // Ordered behind the peer's earlier copy-engine work.
                sync_streams(&peer.stream, kernels.stream()).map_err(boxed)?;
                // SAFETY: every address resolves inside a registered local region or a peer
                // region mapped for the peer's lifetime, and `Peer::drop` synchronises the queue
                // before the mappings close.
                unsafe { kernels.copy_ops(ops, src, dst) }.map_err(boxed)?;
                peer.last_on_kernels = true;
            }
            None => {
                if let Some(kernels) = &peer.kernels {
                    sync_streams(kernels.stream(), &peer.stream).map_err(boxed)?;
                }
                post_copy_engine(&peer.stream, ops, src, dst, max_pitch).map_err(boxed)?;
                peer.last_on_kernels = false;
            }
        }
        // The completion event is recorded at the next poll or wait, behind everything posted
        // until then (`flush`).
        peer.unflushed.push((op, notice.map(|Notice(n)| n)));
        let used = ops
            .iter()
            .map(|op| match kind {
                OpKind::Read => op.dst_region,
                _ => op.src_region,
            })
            .collect();
        Ok(self.ledger.start(peer_id, kind, bytes, used))
    }
}
