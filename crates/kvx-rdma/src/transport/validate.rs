//! Bounds checks of copy operations against region tables, shared by every backend.
//!
//! Strides are unsigned, so the last piece of an operation reaches furthest on each side: checking
//! the first offset and the end of the last piece covers every piece without walking them, and the
//! arithmetic is done in `u128`, so no operation can overflow its way past a check.

use kvx_layout::CopyOp;

use crate::error::{PlanError, Side};

/// One past the last byte an operation touches on one side, from that side's offset and stride.
fn side_end(offset: u64, stride: u64, len: u64, count: u64) -> u128 {
    u128::from(offset) + u128::from(stride) * u128::from(count - 1) + u128::from(len)
}

/// Checks every piece of every operation against the region lengths that `src_len` and `dst_len`
/// report (`None`: not registered), and returns the total bytes the operations move.
///
/// # Errors
/// The first [`PlanError`] found, in operation order.
pub fn check_ops(
    ops: &[CopyOp],
    src_len: impl Fn(u32) -> Option<u64>,
    dst_len: impl Fn(u32) -> Option<u64>,
) -> Result<u64, PlanError> {
    if ops.is_empty() {
        return Err(PlanError::Empty);
    }
    let mut total: u64 = 0;
    for (i, op) in ops.iter().enumerate() {
        let degenerate = PlanError::Degenerate {
            op: i,
            len: op.len,
            count: op.count,
        };
        if op.len == 0 || op.count == 0 {
            return Err(degenerate);
        }
        let bytes = op.len.checked_mul(op.count).ok_or(degenerate.clone())?;
        total = total.checked_add(bytes).ok_or(degenerate)?;
        for (side, region, offset, stride, lookup) in [
            (
                Side::Src,
                op.src_region,
                op.src_offset,
                op.src_stride,
                &src_len as &dyn Fn(u32) -> Option<u64>,
            ),
            (
                Side::Dst,
                op.dst_region,
                op.dst_offset,
                op.dst_stride,
                &dst_len,
            ),
        ] {
            let region_len = lookup(region).ok_or(PlanError::Unregistered {
                op: i,
                side,
                region,
            })?;
            let end = side_end(offset, stride, op.len, op.count);
            if end > u128::from(region_len) {
                return Err(PlanError::OutOfBounds {
                    op: i,
                    side,
                    region,
                    end,
                    region_len,
                });
            }
        }
    }
    Ok(total)
}

/// The checks libfabric and `cma` make before registering `region`: a new index, a non-empty host
/// region (the only kind they register; NIXL, which also takes CUDA memory, calls
/// [`check_registration_of`] with the kinds it accepts), a length that fits the address
/// space. Returns the length in bytes.
///
/// # Errors
/// [`RegisterError::Duplicate`], [`RegisterError::Empty`], [`RegisterError::UnsupportedKind`] or
/// [`RegisterError::Backend`] (too large).
#[cfg_attr(
    not(any(feature = "libfabric", feature = "cma")),
    allow(dead_code, reason = "only the host-memory FFI backends use it")
)]
pub(crate) fn check_registration(
    region: &crate::region::LocalRegion,
    already_registered: bool,
    backend: &'static str,
) -> Result<usize, crate::error::RegisterError> {
    check_registration_of(region, already_registered, backend, |kind| {
        kind == kvx_core::MemoryKind::Host
    })
}

/// [`check_registration`] for a backend that takes the memory kinds `accepts` says.
#[cfg_attr(
    not(any(feature = "libfabric", feature = "nixl", feature = "cma")),
    allow(
        dead_code,
        reason = "only the FFI backends register memory with a provider"
    )
)]
///
/// # Errors
/// As [`check_registration`].
pub(crate) fn check_registration_of(
    region: &crate::region::LocalRegion,
    already_registered: bool,
    backend: &'static str,
    accepts: impl Fn(kvx_core::MemoryKind) -> bool,
) -> Result<usize, crate::error::RegisterError> {
    use crate::error::RegisterError;
    let index = region.index();
    if already_registered {
        return Err(RegisterError::Duplicate(index));
    }
    if region.is_empty() {
        return Err(RegisterError::Empty(index));
    }
    if !accepts(region.kind()) {
        return Err(RegisterError::UnsupportedKind {
            index,
            kind: region.kind(),
            backend,
        });
    }
    usize::try_from(region.len()).map_err(|_| RegisterError::Backend {
        index,
        source: format!("region of {} bytes exceeds the address space", region.len()).into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::Rank;
    use proptest::prelude::*;

    fn op(src_offset: u64, dst_offset: u64, len: u64, count: u64, stride: u64) -> CopyOp {
        CopyOp::strided(
            Rank(0),
            (0, src_offset),
            (1, dst_offset),
            len,
            count,
            (stride, stride),
        )
    }

    fn lens(region: u32) -> Option<u64> {
        match region {
            0 => Some(1000),
            1 => Some(2000),
            _ => None,
        }
    }

    #[test]
    fn accepts_exact_fit_and_sums_bytes() {
        let ops = [op(0, 0, 100, 10, 100), op(999, 1999, 1, 1, 0)];
        assert_eq!(check_ops(&ops, lens, lens), Ok(1001));
    }

    #[test]
    fn refuses_one_byte_past_the_end() {
        let err = check_ops(&[op(0, 0, 100, 10, 101)], lens, lens).unwrap_err();
        assert_eq!(
            err,
            PlanError::OutOfBounds {
                op: 0,
                side: Side::Src,
                region: 0,
                end: 1009,
                region_len: 1000
            }
        );
    }

    #[test]
    fn refuses_unregistered_empty_and_degenerate() {
        let mut bad = op(0, 0, 1, 1, 0);
        bad.dst_region = 7;
        assert_eq!(
            check_ops(&[op(0, 0, 1, 1, 0), bad], lens, lens),
            Err(PlanError::Unregistered {
                op: 1,
                side: Side::Dst,
                region: 7
            })
        );
        assert_eq!(check_ops(&[], lens, lens), Err(PlanError::Empty));
        assert!(matches!(
            check_ops(&[op(0, 0, 0, 1, 0)], lens, lens),
            Err(PlanError::Degenerate { op: 0, .. })
        ));
        assert!(matches!(
            check_ops(&[op(0, 0, 1, 0, 0)], lens, lens),
            Err(PlanError::Degenerate { op: 0, .. })
        ));
    }

    #[test]
    fn huge_values_do_not_overflow_past_the_check() {
        let ops = [op(u64::MAX, 0, u64::MAX, u64::MAX, u64::MAX)];
        assert!(check_ops(&ops, |_| Some(u64::MAX), |_| Some(u64::MAX)).is_err());
        let ops = [op(u64::MAX - 1, 0, 2, 1, 0)];
        assert!(matches!(
            check_ops(&ops, |_| Some(u64::MAX), |_| Some(u64::MAX)),
            Err(PlanError::OutOfBounds {
                side: Side::Src,
                ..
            })
        ));
    }

    proptest! {
        /// The check agrees with walking every piece.
        #[test]
        fn agrees_with_walking_the_pieces(
            src_offset in 0u64..3000, dst_offset in 0u64..3000,
            len in 1u64..300, count in 1u64..20, stride in 0u64..400,
        ) {
            let o = op(src_offset, dst_offset, len, count, stride);
            let fits = o.pieces().all(|(s, d, l)| s + l <= 1000 && d + l <= 2000);
            prop_assert_eq!(check_ops(&[o], lens, lens).is_ok(), fits);
        }
    }
}
