//! Striping a plan over rails: which bytes of which operations each rail moves.
//!
//! The rule: a plan of fewer than `threshold` bytes (or any plan on one rail) goes whole on one
//! rail, the caller's round-robin choice. A larger plan is laid out as one stream of bytes (the
//! operations in order, each operation's rows in order) and cut into `rails` contiguous ranges
//! of about `bytes / rails` each. A cut that falls inside a row of a strided operation whose rows
//! are small next to a rail's share (at most 1/8 of it) moves to the nearest row edge, so small
//! rows are never split; otherwise the row is split at the exact byte. Each rail gets its range
//! as operations: the whole rows of an operation as one strided operation, the partial rows at
//! the cut points as single pieces.
//!
//! The function is pure and never panics: zero-length operations (which [`check_ops`] refuses
//! anyway) go to the first rail's list unchanged, and sizes are summed in `u128`.
//!
//! [`check_ops`]: crate::validate::check_ops

use kvx_layout::CopyOp;

/// Plans of fewer bytes than this go on one rail (chosen round-robin); larger ones are striped
/// over every rail.
pub const DEFAULT_STRIPE_THRESHOLD: u64 = 256 * 1024;

/// A row of a strided operation is kept whole when a rail's share is at least this many rows.
const SNAP_ROWS: u128 = 8;

/// Splits `ops` over `rails` rails (at least one). Returns one list of operations per rail
/// (index = rail); together they move exactly the bytes of `ops`, each exactly once. Plans of
/// fewer than `threshold` bytes, and every plan when `rails <= 1`, go whole to rail
/// `first % rails`.
#[must_use]
pub fn stripe(ops: &[CopyOp], rails: usize, threshold: u64, first: usize) -> Vec<Vec<CopyOp>> {
    let rails = rails.max(1);
    let mut out: Vec<Vec<CopyOp>> = vec![Vec::new(); rails];
    let sizes: Vec<u128> = ops
        .iter()
        .map(|op| u128::from(op.len) * u128::from(op.count))
        .collect();
    let total: u128 = sizes.iter().sum();
    if rails == 1 || total < u128::from(threshold) {
        out[first % rails] = ops.to_vec();
        return out;
    }
    // Where each operation starts in the byte stream.
    let mut starts = Vec::with_capacity(ops.len());
    let mut at = 0_u128;
    for size in &sizes {
        starts.push(at);
        at += size;
    }
    let share = total / rails as u128;
    // Cut points: cuts[k]..cuts[k + 1] is rail k's range.
    let mut cuts = Vec::with_capacity(rails + 1);
    cuts.push(0_u128);
    for k in 1..rails {
        let mut cut = total * k as u128 / rails as u128;
        // The operation holding the cut: the last one starting at or before it.
        let i = starts.partition_point(|&s| s <= cut).saturating_sub(1);
        if let (Some(op), Some(&start)) = (ops.get(i), starts.get(i)) {
            let len = u128::from(op.len);
            if op.count > 1 && len > 0 && len * SNAP_ROWS <= share {
                let offset = cut - start;
                let row = (offset + len / 2) / len;
                cut = start + row * len;
            }
        }
        // Snapping keeps the cuts ordered (nearest row edge within the same operation); the max
        // keeps that true whatever the arithmetic.
        let previous = cuts.last().copied().unwrap_or(0);
        cuts.push(cut.max(previous));
    }
    cuts.push(total);

    let mut rail = 0;
    for (i, op) in ops.iter().enumerate() {
        let (start, size) = (starts[i], sizes[i]);
        if size == 0 {
            out[0].push(*op);
            continue;
        }
        let end = start + size;
        while rail + 1 < rails && cuts[rail + 1] <= start {
            rail += 1;
        }
        let mut k = rail;
        while k < rails && cuts[k] < end {
            let lo = cuts[k].max(start) - start;
            let hi = cuts[k + 1].min(end) - start;
            if lo < hi {
                split_rows(op, lo, hi, &mut out[k]);
            }
            k += 1;
        }
    }
    out
}

/// Appends the operations that move bytes `lo..hi` of `op`'s byte stream (its rows in order) to
/// `out`: a partial first row, the whole rows, a partial last row.
fn split_rows(op: &CopyOp, lo: u128, hi: u128, out: &mut Vec<CopyOp>) {
    let len = u128::from(op.len);
    // Every value below is at most `op.len * op.count`, which fits u64 for any operation whose
    // bytes fit (the callers' plans were checked); the conversions saturate otherwise.
    let narrow = |x: u128| u64::try_from(x).unwrap_or(u64::MAX);
    let piece = |row: u128, skip: u128, bytes: u128, count: u128| {
        let row = narrow(row);
        CopyOp {
            src_offset: op
                .src_offset
                .wrapping_add(row.wrapping_mul(op.src_stride))
                .wrapping_add(narrow(skip)),
            dst_offset: op
                .dst_offset
                .wrapping_add(row.wrapping_mul(op.dst_stride))
                .wrapping_add(narrow(skip)),
            len: narrow(bytes),
            count: narrow(count),
            ..*op
        }
    };
    let mut at = lo;
    let skip = at % len;
    if skip != 0 || hi - at < len {
        let row = at / len;
        let row_end = (row + 1) * len;
        let stop = hi.min(row_end);
        out.push(piece(row, skip, stop - at, 1));
        at = stop;
    }
    let rows = (hi - at) / len;
    if rows > 0 {
        out.push(piece(at / len, 0, len, rows));
        at += rows * len;
    }
    if at < hi {
        out.push(piece(at / len, 0, hi - at, 1));
    }
}
