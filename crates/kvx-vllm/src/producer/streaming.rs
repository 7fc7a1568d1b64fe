//! Push while prefill computes: each step's (and layer's) final tokens written to a registered
//! consumer as early writes, before the request finishes.

use super::*;

/// Plans this producer rank's writes of tokens `ranges[l]` of every layer `l` (empty ranges
/// move nothing), one plan per run of layers that share a range; returns the operations and
/// their bytes.
pub(super) fn plan_by_layer(
    producer: &Layout,
    consumer: &Layout,
    producer_blocks: &[BlockId],
    consumer_blocks: &[BlockId],
    ranges: &[Range<u64>],
) -> Result<(Vec<CopyOp>, u64), PlanError> {
    let (mut ops, mut bytes) = (Vec::new(), 0);
    let mut first = 0;
    while first < ranges.len() {
        let range = &ranges[first];
        let end = first + ranges[first..].iter().take_while(|r| *r == range).count();
        if !range.is_empty() {
            let planned = plan_layers(
                &PlanRequest {
                    producers: std::slice::from_ref(producer),
                    consumer,
                    num_tokens: range.end,
                    skip_tokens: range.start,
                    producer_blocks,
                    consumer_blocks,
                    only_producer: Some(producer.rank()),
                    producer_groups: &[],
                    consumer_groups: &[],
                },
                first as u32..end as u32,
            )?;
            bytes += planned.bytes();
            if ops.is_empty() {
                ops = planned.into_ops();
            } else {
                ops.extend_from_slice(planned.ops());
            }
        }
        first = end;
    }
    Ok((ops, bytes))
}

/// The tokens a set of per-layer ranges spans, for the log (the empty ones aside).
fn span(ranges: &[Range<u64>]) -> (u64, u64) {
    ranges
        .iter()
        .filter(|r| !r.is_empty())
        .fold((u64::MAX, 0), |(from, upto), r| {
            (from.min(r.start), upto.max(r.end))
        })
}

/// Least common multiple of two block sizes (both at least 1).
fn lcm(a: u64, b: u64) -> u64 {
    let (mut x, mut y) = (a.max(1), b.max(1));
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a.max(1) / x * b.max(1)
}

impl Machine {
    /// Progress of a request still computing: write what is final to every consumer rank
    /// already registered.
    pub(super) fn progress(
        &mut self,
        now: Timestamp,
        key: AttemptKey,
        blocks: Vec<BlockId>,
        tokens: u64,
        layers: Option<u32>,
    ) {
        let known = self.holds(key) || self.sealed.contains_key(&key);
        let aborted = self
            .dead
            .get(&key.transfer)
            .is_some_and(|(attempt, _)| attempt.is_none_or(|a| a == key.attempt));
        if known || aborted {
            return;
        }
        let deadline = now + self.producer_lease;
        let num_layers = self.layout.spec().num_layers;
        let before = self.streams.get(&key);
        let first = before.is_none();
        let fresh = Final::default().advanced(tokens, layers, num_layers);
        let mut streaming = Streaming {
            blocks,
            done: before.map_or(fresh, |s| s.done.advanced(tokens, layers, num_layers)),
            deadline,
        };
        // Final tokens never go back, and blocks are only ever appended: otherwise the engine
        // recomputes the request somewhere else (a preemption). What was final before says
        // nothing about the new blocks: the state starts over from this report, for consumer
        // ranks that register later; those already written to get everything at the finish.
        if before.is_some_and(|s| {
            !streaming.blocks.starts_with(&s.blocks)
                || (0..num_layers).any(|l| streaming.done.final_in(l) < s.done.final_in(l))
        }) {
            streaming.done = fresh;
            self.reset_early(key);
        }
        self.streams.insert(key, streaming);
        if first {
            // Refreshed progress moves the deadline; `expire` checks it when the entry surfaces.
            self.expiry
                .push(Reverse((deadline, key, ExpiryKind::Stream)));
        }
        for rank in self.ranks_of(key) {
            self.stream(key, rank_key(key, rank));
        }
    }

    /// Writes the tokens of `key` computed so far that the registration held under `rkey` has
    /// not received, in whole blocks of both sides, without a notice. The last token is always
    /// left for the final write, which carries the notice.
    pub(super) fn stream(&mut self, key: AttemptKey, rkey: AttemptKey) {
        let Some(dest) = self.matcher.held_registration(rkey) else {
            return;
        };
        let Some(streaming) = self.streams.get(&key) else {
            return;
        };
        let num_layers = self.layout.spec().num_layers;
        let early = self
            .early
            .entry(rkey)
            .or_insert_with(|| Early::new(num_layers));
        if early.failed.is_some() || early.reset {
            return;
        }
        let Some(consumer) = self.conns.get(&dest.conn).and_then(|c| c.consumer.as_ref()) else {
            return;
        };
        let unit = lcm(
            u64::from(self.layout.spec().block_tokens),
            u64::from(consumer.layout.spec().block_tokens),
        );
        let last = dest.num_tokens.saturating_sub(1);
        let ranges: Vec<Range<u64>> = early
            .written
            .iter()
            .zip(0..)
            .map(|(&written, layer)| {
                let upto = streaming.done.final_in(layer).min(last) / unit * unit;
                written.max(dest.skip_tokens)..upto
            })
            .collect();
        if ranges.iter().all(Range::is_empty) {
            return;
        }
        let posted = plan_by_layer(
            &self.layout,
            &consumer.layout,
            &streaming.blocks,
            &dest.blocks,
            &ranges,
        )
        .map_err(|e| format!("cannot plan the early writes of {key}: {e}"))
        .map(|(ops, bytes)| {
            self.stats.ops_posted.fetch_add(1, Ordering::Relaxed);
            (self.posts.write(consumer.peer, ops, None), bytes)
        });
        match posted {
            Ok((op, bytes)) => {
                let (from, upto) = span(&ranges);
                let layers = ranges.iter().filter(|r| !r.is_empty()).count();
                debug!(%key, from, upto, layers, bytes, "early writes posted");
                if let Some(span) = self.traces.get(&key.transfer) {
                    tracing::info!(target: crate::trace::TARGET, parent: span, from, upto, layers, bytes, "early writes posted");
                }
                for (written, range) in early.written.iter_mut().zip(ranges) {
                    *written = (*written).max(range.end);
                }
                early.in_flight += 1;
                let posted = self.clock.now();
                self.partials.insert(
                    op,
                    Partial {
                        rkey,
                        conn: dest.conn,
                        posted,
                    },
                );
                self.stats.bytes_written.fetch_add(bytes, Ordering::Relaxed);
                self.stats
                    .bytes_streamed
                    .fetch_add(bytes, Ordering::Relaxed);
            }
            Err(why) => self.early_failed(rkey, why),
        }
    }

    /// The blocks of `key` are not the ones written from: every consumer rank gets all of it
    /// again at the end.
    pub(super) fn reset_early(&mut self, key: AttemptKey) {
        debug!(%key, "blocks changed under early writes; the finish rewrites everything");
        for rank in self.ranks_of(key) {
            if let Some(early) = self.early.get_mut(&rank_key(key, rank)) {
                early.written.fill(0);
                early.reset = true;
            }
        }
    }

    /// An early write could not be posted or failed: the registration is failed now (the
    /// consumer hears of it once every early write has ended).
    pub(super) fn early_failed(&mut self, rkey: AttemptKey, why: String) {
        self.note_early_failure(rkey, why);
        let now = self.clock.now();
        self.matcher.abort(
            now,
            rkey.transfer,
            Some(rkey.attempt),
            Reason::TransferFailed,
        );
    }

    /// Records the first early failure of `rkey` (counted once per registration).
    pub(super) fn note_early_failure(&mut self, rkey: AttemptKey, why: String) {
        if let Some(early) = self.early.get_mut(&rkey) {
            if early.failed.is_none() {
                warn!(key = %rkey, why, "early write failed");
                early.failed = Some(why);
                self.stats.transfers_failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// An early write ended; what waited for the early writes runs once they all have.
    pub(super) fn early_done(&mut self, op: OpId, error: Option<String>) {
        let Some(Partial { rkey, .. }) = self.partials.remove(&op) else {
            return;
        };
        let Some(early) = self.early.get_mut(&rkey) else {
            return;
        };
        early.in_flight -= 1;
        if let Some(why) = &error {
            self.note_early_failure(rkey, why.clone());
        }
        let Some(early) = self.early.get_mut(&rkey) else {
            return;
        };
        if early.in_flight == 0 {
            // What waited runs first, so that the failure below finds nothing in flight.
            let deferred = std::mem::take(&mut early.deferred);
            let mut ended = false;
            for d in deferred {
                match d {
                    Deferred::Start {
                        ticket,
                        dest,
                        cancelled,
                    } => {
                        ended = true;
                        self.start_transfer(rkey, ticket, dest, cancelled);
                    }
                    Deferred::Tell {
                        conn,
                        key,
                        reason,
                        ends,
                    } => {
                        ended |= ends;
                        self.tell_consumer(conn, key, reason, "");
                    }
                }
            }
            if ended {
                self.early.remove(&rkey);
            }
        }
        if let Some(why) = error {
            self.early_failed(rkey, why);
            self.actions();
        }
    }
}
