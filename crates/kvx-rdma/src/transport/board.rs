//! Notice boards: completion notices that a peer writes straight into this endpoint's memory,
//! for backends whose peers' writes land without this side doing anything (`cma`, libfabric
//! `shm` with cross-memory attach, loopback).
//!
//! A notice delivered as a message wakes the thread that waits on the endpoint, once per
//! transfer; one written into a board costs the receiver nothing until it looks, and an engine
//! that polls every step anyway reads it there for a few nanoseconds. The writer puts the notice
//! value itself in the slot, after every byte of the write is visible (the same promise as a
//! message notice); the reader compares the slot with the value it expects, so a slot can be
//! reused without clearing it (each use expects a different value) and a late write of an earlier
//! use never matches a later one.
//!
//! A board notice is a [`Notice`] with [`BOARD_NOTICE`] set: the slot index is bits 32–62, the
//! rest is the caller's sequence number. Backends without a board carry it like any notice, as a
//! message.
//!
//! ```
//! use kvx_rdma::board::{board_notice, NoticeBoard};
//!
//! let board = NoticeBoard::new(4);
//! let notice = board_notice(2, 7).unwrap();
//! assert!(!board.arrived(notice));
//! board.deliver(notice).unwrap(); // what a peer's write does
//! assert!(board.arrived(notice));
//! assert!(!board.arrived(board_notice(2, 8).unwrap()));
//! ```

use std::sync::atomic::{AtomicU64, Ordering};

use crate::desc::BoardPlace;
pub use crate::error::SlotOutOfRange;
use crate::ids::Notice;

/// Marks a [`Notice`] that is to be written into the peer's notice board.
pub const BOARD_NOTICE: u64 = 1 << 63;

/// Most slots a board can have (slot indices are 31 bits).
pub const MAX_BOARD_SLOTS: usize = 1 << 31;

/// The notice for `slot` of a board, with sequence number `seq`; `None` for a slot index that
/// does not fit.
#[must_use]
pub fn board_notice(slot: u32, seq: u32) -> Option<Notice> {
    (slot < 1 << 31).then(|| Notice(BOARD_NOTICE | u64::from(slot) << 32 | u64::from(seq)))
}

/// The board slot a notice is for, if it is a board notice.
#[must_use]
pub fn board_slot(notice: Notice) -> Option<u32> {
    (notice.0 & BOARD_NOTICE != 0).then_some(((notice.0 >> 32) & 0x7fff_ffff) as u32)
}

/// Slots that peers write notices into, owned by one endpoint (shared with the threads that read
/// it).
///
/// Its memory is never given back, not even when the board is dropped: a peer's notice may still
/// be on its way (another process's `process_vm_writev`, posted before this side gave up on the
/// request) after the endpoint is gone, and it must not land in memory reused for something else.
/// 8 bytes per slot for the life of the process is the price.
#[derive(Debug)]
pub struct NoticeBoard {
    slots: &'static [AtomicU64],
}

impl NoticeBoard {
    /// A board of `slots` slots (at least 1, at most [`MAX_BOARD_SLOTS`]), all empty.
    #[must_use]
    pub fn new(slots: usize) -> Self {
        let slots = slots.clamp(1, MAX_BOARD_SLOTS);
        let slots: Box<[AtomicU64]> = (0..slots).map(|_| AtomicU64::new(0)).collect();
        Self {
            slots: Box::leak(slots),
        }
    }

    /// Number of slots.
    #[must_use]
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the board has no slot (never: it has at least one).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Whether `notice` has been written into its slot (and so every byte of its write is
    /// visible to this thread). False for a notice that is not a board notice or names a slot
    /// the board does not have.
    #[must_use]
    pub fn arrived(&self, notice: Notice) -> bool {
        board_slot(notice)
            .and_then(|slot| self.slots.get(slot as usize))
            .is_some_and(|s| s.load(Ordering::Acquire) == notice.0)
    }

    /// Writes `notice` into its slot, as a peer's write does (for backends that deliver within
    /// one process).
    ///
    /// # Errors
    /// [`SlotOutOfRange`] when the notice is not a board notice for this board.
    pub fn deliver(&self, notice: Notice) -> Result<(), SlotOutOfRange> {
        let slot = self.check(notice)?;
        self.slots[slot].store(notice.0, Ordering::Release);
        Ok(())
    }

    /// The index of `notice`'s slot, checked.
    ///
    /// # Errors
    /// [`SlotOutOfRange`] when the notice is not a board notice for this board.
    pub fn check(&self, notice: Notice) -> Result<usize, SlotOutOfRange> {
        let out = |slot| SlotOutOfRange {
            notice: notice.0,
            slot,
            slots: self.len(),
        };
        let slot = board_slot(notice).ok_or_else(|| out(u32::MAX))?;
        if slot as usize >= self.len() {
            return Err(out(slot));
        }
        Ok(slot as usize)
    }

    /// The address of the first slot, for the endpoint's description.
    #[must_use]
    pub fn addr(&self) -> u64 {
        self.slots.as_ptr() as u64
    }

    /// Bytes the slots span.
    #[must_use]
    pub fn bytes(&self) -> u64 {
        (self.len() * std::mem::size_of::<AtomicU64>()) as u64
    }

    /// Where the board lies, for this endpoint's description.
    #[must_use]
    pub fn place(&self) -> BoardPlace {
        BoardPlace {
            addr: self.addr(),
            len: self.bytes(),
        }
    }
}

/// Writes a board notice into slot address `addr` of process `pid`'s board with one 8-byte
/// `process_vm_writev` (for backends whose data moved by cross-memory attach: libfabric `shm`).
/// The reader compares the whole value, so a write the kernel tears never reads as arrived.
///
/// # Errors
/// The system call's error (`ESRCH`: the process is gone; `EPERM`: no permission; `EFAULT`: no
/// such memory there), or `WriteZero` when the kernel copied less than 8 bytes.
#[cfg(feature = "libfabric")]
pub(crate) fn write_remote(pid: i32, addr: u64, value: u64) -> std::io::Result<()> {
    let local = libc::iovec {
        iov_base: std::ptr::from_ref(&value).cast_mut().cast(),
        iov_len: 8,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: 8,
    };
    loop {
        // SAFETY: `local` describes the 8 bytes of `value`, alive for the call and only read;
        // `remote` names memory of another process, which the kernel checks (nothing of this
        // process is written).
        let moved = unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) };
        match moved {
            8 => return Ok(()),
            m if m < 0 => {
                let err = std::io::Error::last_os_error();
                if err.kind() != std::io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
            _ => return Err(std::io::ErrorKind::WriteZero.into()),
        }
    }
}

/// Where `notice` goes in a peer's board, if it goes there: a board notice to a peer with a
/// board lands in its slot (the byte address returned); any other notice, or any notice to a
/// peer without a board, is a message (`None`).
///
/// # Errors
/// [`SlotOutOfRange`] when a board notice names a slot the peer's board does not have.
pub fn slot_for(
    notice: Option<Notice>,
    board: Option<BoardPlace>,
) -> Result<Option<u64>, SlotOutOfRange> {
    match (notice, board) {
        (Some(n), Some(place)) if board_slot(n).is_some() => remote_slot(place, n).map(Some),
        _ => Ok(None),
    }
}

/// Where a board notice lands in a peer's board: its byte address there.
///
/// # Errors
/// [`SlotOutOfRange`] when the notice is not a board notice or its slot is outside the board.
pub fn remote_slot(board: BoardPlace, notice: Notice) -> Result<u64, SlotOutOfRange> {
    let BoardPlace { addr, len } = board;
    let slots = (len / 8) as usize;
    let out = |slot| SlotOutOfRange {
        notice: notice.0,
        slot,
        slots,
    };
    let slot = board_slot(notice).ok_or_else(|| out(u32::MAX))?;
    if slot as usize >= slots {
        return Err(out(slot));
    }
    Ok(addr + u64::from(slot) * 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_name_their_slot_and_match_only_their_value() {
        let board = NoticeBoard::new(3);
        assert_eq!(board.len(), 3);
        let n = board_notice(1, 0xdead_beef).unwrap();
        assert_eq!(board_slot(n), Some(1));
        assert_eq!(board_slot(Notice(5)), None);
        assert_eq!(board_notice(1 << 31, 0), None);
        assert!(!board.arrived(n));
        board.deliver(n).unwrap();
        assert!(board.arrived(n));
        // The slot's next use expects another value: the earlier write does not count.
        assert!(!board.arrived(board_notice(1, 0xdead_bef0).unwrap()));
        assert!(!board.arrived(Notice(5)));
        let far = board_notice(3, 1).unwrap();
        assert!(!board.arrived(far));
        assert_eq!(
            board.deliver(far),
            Err(SlotOutOfRange {
                notice: far.0,
                slot: 3,
                slots: 3
            })
        );
        assert!(board.deliver(Notice(5)).is_err());
    }

    #[test]
    fn remote_slots_are_bounded_by_the_described_board() {
        let n = board_notice(2, 9).unwrap();
        let place = |len| BoardPlace { addr: 0x1000, len };
        assert_eq!(remote_slot(place(24), n), Ok(0x1010));
        assert!(remote_slot(place(16), n).is_err());
        assert!(remote_slot(place(24), Notice(9)).is_err());
        let board = NoticeBoard::new(2);
        assert_eq!(board.bytes(), 16);
    }
}
