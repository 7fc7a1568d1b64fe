//! What libfabric holds on to while operations are in flight: the operation contexts it hands
//! back with completions ([`ContextPool`]), the registered regions and each rail's own buffer
//! ([`Scratch`]: notice slot, notice source, receive and send slots).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use kvx_core::RegionDesc;
use libfabric_sys as sys;

use super::fi;
#[cfg(doc)]
use super::post::Pending;
use super::{MESSAGE_SLOT, NOTICE_BYTES, RECV_SLOTS, SEND_SLOTS};
use crate::desc::NoticeSlot;
use crate::region::{HostBuffer, LocalRegion};

/// What an operation context is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Use {
    /// A data piece of operation `op`.
    Data { op: u64 },
    /// The notice write of operation `op`.
    Notice { op: u64 },
    /// A flush read of operation `op` (see [`Pending::flush`]).
    Flush { op: u64 },
    /// A posted receive into message slot `slot` of rail `rail`.
    Recv { rail: usize, slot: usize },
    /// Send `op` from send slot `slot` (of rail 0, which carries every send).
    Send { op: u64, slot: usize },
}

/// An operation context handed to libfabric. `FI_CONTEXT`/`FI_CONTEXT2` providers use the leading
/// `fi_context2` as scratch space, so it must come first and stay at a fixed address until the
/// completion is read (hence the boxes).
#[repr(C)]
pub(super) struct OpContext {
    pub(super) scratch: sys::fi_context2,
}

/// Contexts of the operations in flight, keyed by their address (the value libfabric hands back).
#[derive(Default)]
pub(super) struct ContextPool {
    /// `None`: retired (see [`ContextPool::retire`]).
    pub(super) live: HashMap<usize, (Box<OpContext>, Option<Use>)>,
    /// How many of `live` are retired.
    pub(super) retired: usize,
    // Boxed: a context keeps its address while it moves between `spare` and `live`.
    #[allow(clippy::vec_box)]
    pub(super) spare: Vec<Box<OpContext>>,
}

impl ContextPool {
    pub(super) fn take(&mut self, what: Use) -> *mut c_void {
        let mut ctx = self.spare.pop().unwrap_or_else(|| {
            Box::new(OpContext {
                scratch: sys::fi_context2::default(),
            })
        });
        let ptr: *mut OpContext = &mut *ctx;
        self.live.insert(ptr as usize, (ctx, Some(what)));
        ptr.cast::<c_void>()
    }

    /// The context's use, and the context back in the pool; `None` for one not handed out or
    /// retired.
    pub(super) fn give_back(&mut self, ptr: *mut c_void) -> Option<Use> {
        let (ctx, what) = self.live.remove(&(ptr as usize))?;
        self.spare.push(ctx);
        if what.is_none() {
            self.retired -= 1;
        }
        what
    }

    /// Stops counting a context whose operation was given up while the provider may, in
    /// principle, still hand it back: it is never reused, and its completion, should one come,
    /// is ignored.
    pub(super) fn retire(&mut self, ptr: usize) {
        if let Some((_, what)) = self.live.get_mut(&ptr) {
            if what.take().is_some() {
                self.retired += 1;
            }
        }
    }

    pub(super) fn in_flight(&self) -> usize {
        self.live.len() - self.retired
    }
}

/// A registered region.
pub(super) struct Registration {
    // Declared before `region`: the registrations close before the memory may be released.
    /// One registration per rail.
    pub(super) mrs: Vec<fi::MemoryRegion>,
    pub(super) region: LocalRegion,
    /// How peers see it (with rail 0's key).
    pub(super) remote: RegionDesc,
    /// Operations in flight that use the region.
    pub(super) users: usize,
}

/// A rail's own buffer: the notice slot, the notice source, receive and send slots.
pub(super) struct Scratch {
    pub(super) mr: fi::MemoryRegion,
    pub(super) buffer: Arc<HostBuffer>,
    pub(super) remote_base: u64,
    pub(super) free_sends: Vec<usize>,
}

impl Scratch {
    pub(super) const NOTICE_SLOT: usize = 0;
    pub(super) const NOTICE_SOURCE: usize = NOTICE_BYTES;
    /// Where flush reads land (inside the notice source's 64 bytes, after the 8 it sends).
    pub(super) const FLUSH_TARGET: usize = Self::NOTICE_SOURCE + 8;
    pub(super) const RECV_BASE: usize = 2 * NOTICE_BYTES;
    pub(super) const SEND_BASE: usize = Self::RECV_BASE + RECV_SLOTS * MESSAGE_SLOT;
    pub(super) const LEN: usize = Self::SEND_BASE + SEND_SLOTS * MESSAGE_SLOT;

    pub(super) fn ptr(&self, offset: usize) -> *mut u8 {
        // `offset` is one of the layout's constants, always inside the buffer.
        self.buffer.as_ptr().wrapping_add(offset)
    }

    pub(super) fn notice_slot(&self) -> NoticeSlot {
        NoticeSlot {
            addr: self.remote_base + Self::NOTICE_SLOT as u64,
            key: self.mr.key(),
            len: NOTICE_BYTES as u64,
        }
    }
}
