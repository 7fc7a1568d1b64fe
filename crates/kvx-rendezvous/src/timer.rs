//! Internal plumbing: a deadline queue with lazy deletion, and a fast keyed hasher for transfer
//! ids.
//!
//! Every owner of a deadline (a matcher record, a waiter wait) holds a *slot* of the queue for
//! its lifetime. A slot has a generation; an entry is live only while it carries its slot's
//! current generation. Arming a slot again (a new state, a new deadline) or freeing it bumps the
//! generation, which makes the entries queued before stale; they are skipped when they surface,
//! and dropped wholesale when they outnumber live ones. Checking an entry needs only the dense
//! generation array, never the owner's hash table.
//!
//! A lease extension only moves the owner's own deadline later and leaves the queue alone; when
//! the old entry surfaces, the owner re-queues it at the new deadline. So extending costs O(1),
//! and expiring costs O(log n) per entry that surfaces, which is bounded by what expires plus
//! what was extended or removed since, never by what is held.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::hash::{BuildHasher, Hasher};

use kvx_core::ids::TransferId;

use crate::time::Timestamp;

/// One queued deadline.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TimerEntry {
    pub(crate) deadline: Timestamp,
    pub(crate) slot: u32,
    pub(crate) generation: u32,
    pub(crate) transfer: TransferId,
}

impl PartialEq for TimerEntry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for TimerEntry {}

impl PartialOrd for TimerEntry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for TimerEntry {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.deadline, self.slot, self.generation).cmp(&(
            other.deadline,
            other.slot,
            other.generation,
        ))
    }
}

/// A min-queue of deadlines with lazy deletion, and the slots that own them.
#[derive(Debug, Default)]
pub(crate) struct TimerQueue {
    heap: BinaryHeap<Reverse<TimerEntry>>,
    /// The current generation of every slot.
    generations: Vec<u32>,
    /// Slots not owned by anyone.
    free: Vec<u32>,
}

impl TimerQueue {
    /// A slot for a new owner, with nothing queued yet.
    pub(crate) fn alloc(&mut self) -> u32 {
        if let Some(slot) = self.free.pop() {
            return slot;
        }
        let slot = u32::try_from(self.generations.len()).unwrap_or(u32::MAX);
        self.generations.push(0);
        slot
    }

    /// Queues `deadline` for `slot` (owned by `transfer`); whatever the slot queued before is
    /// stale from now on.
    pub(crate) fn arm(&mut self, slot: u32, deadline: Timestamp, transfer: TransferId) {
        if let Some(generation) = self.generations.get_mut(slot as usize) {
            *generation = generation.wrapping_add(1);
            let generation = *generation;
            self.heap.push(Reverse(TimerEntry {
                deadline,
                slot,
                generation,
                transfer,
            }));
        }
    }

    /// Queues a live entry that surfaced too early again, at its owner's later deadline.
    pub(crate) fn requeue(&mut self, entry: TimerEntry, deadline: Timestamp) {
        self.heap.push(Reverse(TimerEntry { deadline, ..entry }));
    }

    /// The owner of `slot` is gone: its entries are stale and the slot can be reused.
    pub(crate) fn release(&mut self, slot: u32) {
        if let Some(generation) = self.generations.get_mut(slot as usize) {
            *generation = generation.wrapping_add(1);
            self.free.push(slot);
        }
    }

    /// Whether `entry` is its slot's current one.
    pub(crate) fn is_live(&self, entry: &TimerEntry) -> bool {
        self.generations.get(entry.slot as usize) == Some(&entry.generation)
    }

    /// The earliest queued entry (possibly stale).
    pub(crate) fn peek(&self) -> Option<TimerEntry> {
        self.heap.peek().map(|Reverse(e)| *e)
    }

    pub(crate) fn pop(&mut self) -> Option<TimerEntry> {
        self.heap.pop().map(|Reverse(e)| e)
    }

    /// Queued entries, stale ones included.
    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }

    /// Slots owned.
    pub(crate) fn in_use(&self) -> usize {
        self.generations.len() - self.free.len()
    }

    /// Drops stale entries when they outnumber live ones two to one, so that memory stays
    /// within a constant factor of what is live. The rebuild is O(queue) over a dense array,
    /// paid for by the removals that made the entries stale (amortised O(1) each).
    pub(crate) fn compact_if_sparse(&mut self) {
        if self.heap.len() > 2 * self.in_use() + 1024 {
            let generations = &self.generations;
            self.heap
                .retain(|Reverse(e)| generations.get(e.slot as usize) == Some(&e.generation));
        }
    }

    /// Forgets every entry and frees every slot.
    pub(crate) fn clear(&mut self) {
        self.heap.clear();
        self.generations.clear();
        self.free.clear();
    }
}

/// Builds [`IdHasher`]s: a seeded 64-bit mixer for transfer ids, much cheaper than SipHash.
/// Transfer ids come from the router (a trusted component); the seed lets a driver randomise
/// the table layout anyway.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IdHashBuilder {
    seed: u64,
}

impl IdHashBuilder {
    pub(crate) const fn new(seed: u64) -> Self {
        Self { seed }
    }
}

impl BuildHasher for IdHashBuilder {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher { state: self.seed }
    }
}

/// See [`IdHashBuilder`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct IdHasher {
    state: u64,
}

impl IdHasher {
    #[inline]
    fn mix(&mut self, word: u64) {
        // splitmix64's finaliser over the running state: every input bit reaches every output
        // bit, which the table needs (it uses both the low and the high bits).
        let mut z = (self.state ^ word).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        self.state = z ^ (z >> 31);
    }
}

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.state
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.mix(n);
    }

    #[inline]
    fn write_u128(&mut self, n: u128) {
        // Fold both halves first so the whole id costs one mixing round.
        let lo = n as u64;
        let hi = (n >> 64) as u64;
        self.mix(lo ^ hi.rotate_left(29).wrapping_mul(0xff51_afd7_ed55_8ccd));
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn hash(builder: &IdHashBuilder, id: TransferId) -> u64 {
        builder.hash_one(id)
    }

    #[test]
    fn queue_pops_in_deadline_order() {
        let mut q = TimerQueue::default();
        for (t, deadline) in [(1u128, 30u64), (2, 10), (3, 20)] {
            let slot = q.alloc();
            q.arm(slot, Timestamp::from_nanos(deadline), TransferId(t));
        }
        let order: Vec<u128> = std::iter::from_fn(|| q.pop())
            .map(|e| e.transfer.0)
            .collect();
        assert_eq!(order, vec![2, 3, 1]);
    }

    #[test]
    fn rearming_and_releasing_make_old_entries_stale() {
        let mut q = TimerQueue::default();
        let a = q.alloc();
        let b = q.alloc();
        q.arm(a, Timestamp::from_nanos(5), TransferId(1));
        q.arm(a, Timestamp::from_nanos(9), TransferId(1));
        q.arm(b, Timestamp::from_nanos(7), TransferId(2));
        q.release(b);
        let mut live = Vec::new();
        while let Some(e) = q.pop() {
            live.push((e.deadline.as_nanos(), q.is_live(&e)));
        }
        assert_eq!(live, vec![(5, false), (7, false), (9, true)]);
        assert_eq!(q.alloc(), b, "a released slot is reused");
        assert_eq!(q.in_use(), 2);
    }

    #[test]
    fn compaction_keeps_live_entries() {
        let mut q = TimerQueue::default();
        let mut slots = Vec::new();
        for g in 0..3000u64 {
            let slot = q.alloc();
            q.arm(slot, Timestamp::from_nanos(g), TransferId(u128::from(g)));
            slots.push(slot);
        }
        for (i, slot) in slots.into_iter().enumerate() {
            if i % 300 != 0 {
                q.release(slot);
            }
        }
        q.compact_if_sparse();
        assert_eq!(q.len(), 10);
        assert_eq!(q.peek().map(|e| e.deadline), Some(Timestamp::ZERO));
    }

    #[test]
    fn hasher_spreads_sequential_ids() {
        let b = IdHashBuilder::new(0);
        let low_bits: HashSet<u64> = (0..4096u128)
            .map(|i| hash(&b, TransferId(i)) & 0xfff)
            .collect();
        // A good mixer fills most of the 4096 low-bit buckets (a perfect random one ~63%).
        assert!(low_bits.len() > 2000, "{} buckets", low_bits.len());
        let high: HashSet<u64> = (0..4096u128)
            .map(|i| hash(&b, TransferId(i << 64)) >> 52)
            .collect();
        assert!(high.len() > 2000, "{} buckets", high.len());
        assert_ne!(
            hash(&IdHashBuilder::new(1), TransferId(5)),
            hash(&b, TransferId(5))
        );
    }
}
