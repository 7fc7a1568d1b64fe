//! The rendezvous of finished requests and registrations (the matcher's actions), fanning a request
//! out to the consumer ranks it serves, aborts, and posting whole transfers.

use super::*;

impl Machine {
    /// Whether the blocks of `key` are held here (finished, or sealed and not ended).
    pub(super) fn holds(&self, key: AttemptKey) -> bool {
        self.fanouts.contains_key(&key)
            || self.unfanned.contains_key(&key)
            || self.pull_held.contains_key(&key)
    }

    /// Takes over the blocks of a finished (or sealed) request: given back at once if it was
    /// aborted, held for pull, written once its consumer ranks are known.
    pub(super) fn take_over(
        &mut self,
        now: Timestamp,
        key: AttemptKey,
        held: FinishedBlocks,
        pull: bool,
    ) {
        if let Some(streaming) = self.streams.remove(&key) {
            // Progress only ever appends blocks; other ones mean a recomputation.
            if !held.blocks.starts_with(&streaming.blocks) {
                self.reset_early(key);
            }
        }
        self.stats.held.fetch_add(1, Ordering::Relaxed);
        let deadline = now + self.producer_lease;
        let aborted = self
            .dead
            .get(&key.transfer)
            .is_some_and(|(attempt, _)| attempt.is_none_or(|a| a == key.attempt));
        if aborted {
            self.give_back(key, held, SendOutcome::NotSent(Reason::Aborted));
        } else if self.unneeded.remove(&key).is_some() {
            // Its consumer reads a replica another rank serves: nothing to write from here.
            self.give_back(key, held, SendOutcome::Sent);
        } else if pull {
            self.pull_held.insert(
                key,
                AwaitingRead {
                    held,
                    deadline,
                    leased_until: deadline,
                    readers: None,
                    done: Vec::new(),
                    claimants: HashSet::new(),
                    aborted: None,
                },
            );
            self.expiry.push(Reverse((deadline, key, ExpiryKind::Pull)));
            // Readers that claimed it before it finished here are answered now.
            if let Some((conns, _)) = self.early_claims.remove(&key) {
                for conn in conns {
                    self.claimed(now, conn, key);
                }
            }
        } else if let Some(readers) = self.registered_readers(key) {
            self.fan_out(now, key, held, &readers);
        } else {
            self.unfanned.insert(key, (held, deadline));
            self.expiry
                .push(Reverse((deadline, key, ExpiryKind::Unfanned)));
        }
    }

    /// The engine finished a request it had sealed (the same request, with the same blocks):
    /// its blocks are this side's to give back now, at once if its transfer has ended. `false`
    /// when `key` was not sealed (or was disowned: this finish is a new one).
    pub(super) fn finish_sealed(&mut self, key: AttemptKey) -> bool {
        match self.sealed.remove(&key) {
            None | Some(Sealed::Disowned) => false,
            Some(Sealed::Pending) => true,
            Some(Sealed::Ended(done, at)) => {
                self.finished.push((done, at));
                true
            }
        }
    }

    /// The engine aborted (one attempt of) `transfer` and frees its blocks itself: what it had
    /// sealed is not reported back (what ended is forgotten now, the rest when it ends).
    pub(super) fn disown(&mut self, transfer: TransferId, attempt: Option<Attempt>) {
        self.sealed.retain(|k, sealed| {
            if k.transfer != transfer || attempt.is_some_and(|a| a != k.attempt) {
                return true;
            }
            let ended = matches!(sealed, Sealed::Ended(..));
            *sealed = Sealed::Disowned;
            !ended
        });
    }

    /// The consumer ranks that read `key` from this rank, if one of them registered it (and
    /// the matcher still holds that registration: for as long as decode's heartbeats keep it,
    /// however long prefill computes).
    pub(super) fn registered_readers(&self, key: AttemptKey) -> Option<Vec<Rank>> {
        let producer_tp = self.layout.spec().tp_size;
        self.rank_keys(key).find_map(|rkey| {
            let dest = self.matcher.held_registration(rkey)?;
            let consumer = self.conns.get(&dest.conn)?.consumer.as_ref()?;
            kvx_layout::readers_for(self.rank, producer_tp, &consumer.layout).ok()
        })
    }

    /// Consumer ranks a key may have been registered under.
    pub(super) fn ranks_of(&self, key: AttemptKey) -> Vec<Rank> {
        self.registered_readers(key)
            .unwrap_or_else(|| (0..self.max_consumer_tp).map(Rank).collect())
    }

    /// The matcher's keys of `key`, one per consumer rank that may register it.
    pub(super) fn rank_keys(&self, key: AttemptKey) -> impl Iterator<Item = AttemptKey> {
        (0..self.max_consumer_tp).map(move |r| rank_key(key, Rank(r)))
    }

    pub(super) fn abort(
        &mut self,
        now: Timestamp,
        transfer: TransferId,
        attempt: Option<Attempt>,
        reason: Reason,
    ) {
        let mixed: Vec<TransferId> = self
            .rank_keys(AttemptKey::new(transfer, Attempt(0)))
            .map(|k| k.transfer)
            .collect();
        for mixed in mixed {
            self.matcher.abort(now, mixed, attempt, reason);
        }
        let matches =
            |k: &AttemptKey| k.transfer == transfer && attempt.is_none_or(|a| a == k.attempt);
        let unfanned: Vec<AttemptKey> = self
            .unfanned
            .keys()
            .filter(|k| matches(k))
            .copied()
            .collect();
        for key in unfanned {
            if let Some((held, _)) = self.unfanned.remove(&key) {
                self.give_back(key, held, SendOutcome::NotSent(reason));
            }
        }
        let pulled: Vec<AttemptKey> = self
            .pull_held
            .keys()
            .filter(|k| matches(k))
            .copied()
            .collect();
        for key in pulled {
            // Readers that claimed it still read it: it goes back once they are done (their
            // completion or failure, their process gone, or their bound).
            if let Some(hold) = self
                .pull_held
                .get_mut(&key)
                .filter(|h| !h.claimants.is_empty())
            {
                debug!(%key, readers = hold.claimants.len(), "aborted while read: held until the reads end");
                hold.aborted.get_or_insert(reason);
                continue;
            }
            if let Some(hold) = self.pull_held.remove(&key) {
                self.give_back(key, hold.held, SendOutcome::NotSent(reason));
            }
        }
        self.streams.retain(|k, _| !matches(k));
        // Readers that claimed it before it finished hear that it never will be held.
        let claimed: Vec<AttemptKey> = self
            .early_claims
            .keys()
            .filter(|k| matches(k))
            .copied()
            .collect();
        for key in claimed {
            if let Some((conns, _)) = self.early_claims.remove(&key) {
                for conn in conns {
                    self.tell_consumer(conn, key, reason, "aborted before it finished here");
                }
            }
        }
        if let Some((remembered, _)) = self.dead.get_mut(&transfer) {
            // Already remembered (its expiry is queued): another attempt widens it to all.
            if *remembered != attempt {
                *remembered = None;
            }
            return;
        }
        if self.dead.len() >= self.max_dead {
            debug!(%transfer, remembered = self.dead.len(), "too many aborted transfers remembered: a late finish of this one is held until its lease");
            return;
        }
        let until = now + DEAD_TTL;
        self.dead.insert(transfer, (attempt, until));
        self.expiry.push(Reverse((
            until,
            AttemptKey::new(transfer, Attempt(0)),
            ExpiryKind::Dead,
        )));
    }

    pub(super) fn fan_out(
        &mut self,
        now: Timestamp,
        key: AttemptKey,
        held: FinishedBlocks,
        readers: &[Rank],
    ) {
        self.fanouts.insert(
            key,
            Fanout {
                held,
                pending: readers.len(),
                outcome: SendOutcome::Sent,
            },
        );
        for &rank in readers {
            self.matcher
                .prefill_done(now, rank_key(key, rank), Ticket { key });
        }
    }

    pub(super) fn actions(&mut self) {
        while let Some(action) = self.matcher.poll_action() {
            match action {
                Action::StartTransfer {
                    key,
                    blocks,
                    destination,
                    ..
                } => {
                    self.hint_finishing(&destination);
                    match self.early.get_mut(&key) {
                        Some(early) if early.in_flight > 0 => {
                            early.deferred.push(Deferred::Start {
                                ticket: blocks,
                                dest: destination,
                                cancelled: None,
                            });
                        }
                        _ => self.start_transfer(key, blocks, destination, None),
                    }
                }
                Action::ReleaseProducer { blocks, reason, .. } => {
                    self.ticket_back(blocks, SendOutcome::NotSent(reason));
                }
                Action::FailConsumer {
                    key,
                    destination,
                    reason,
                    ..
                } => match self.early.get_mut(&key) {
                    Some(early) if early.in_flight > 0 => early.deferred.push(Deferred::Tell {
                        conn: destination.conn,
                        key: destination.key,
                        reason,
                        ends: true,
                    }),
                    _ => {
                        self.early.remove(&key);
                        self.tell_consumer(destination.conn, destination.key, reason, "");
                    }
                },
                Action::RejectRegistration {
                    key,
                    destination,
                    reason,
                    ..
                } => match self.early.get_mut(&key) {
                    // A second registration of a key being written early: its blocks may be
                    // the ones being written, so the refusal waits for those writes too.
                    Some(early) if early.in_flight > 0 => early.deferred.push(Deferred::Tell {
                        conn: destination.conn,
                        key: destination.key,
                        reason,
                        ends: false,
                    }),
                    _ => self.tell_consumer(destination.conn, destination.key, reason, ""),
                },
                Action::CancelTransfer { key, reason, .. } => {
                    for flight in self.flights.values_mut() {
                        if flight.key == key {
                            flight.cancelled = Some(reason);
                        }
                    }
                    if let Some(early) = self.early.get_mut(&key) {
                        for d in &mut early.deferred {
                            if let Deferred::Start { cancelled, .. } = d {
                                cancelled.get_or_insert(reason);
                            }
                        }
                    }
                }
            }
        }
    }

    pub(super) fn start_transfer(
        &mut self,
        key: AttemptKey,
        ticket: Ticket,
        dest: Dest,
        cancelled: Option<Reason>,
    ) {
        let now = self.clock.now();
        let early = self.early.remove(&key);
        if let Some(reason) = cancelled {
            self.tell_consumer(dest.conn, dest.key, reason, "cancelled");
            self.matcher
                .transfer_finished(now, key, TransferOutcome::Failed);
            self.ticket_back(ticket, SendOutcome::NotSent(reason));
            return;
        }
        let started = std::time::Instant::now();
        let failed_early = early.as_ref().is_some_and(|e| e.failed.is_some());
        let result = match early {
            Some(Early {
                failed: Some(why), ..
            }) => Err(why),
            Some(early) => self
                .post(&ticket, &dest, &early.written)
                .map_err(|e| e.to_string()),
            None => self.post(&ticket, &dest, &[]).map_err(|e| e.to_string()),
        };
        match result {
            Ok((op, bytes)) => {
                self.stats.transfers_started.fetch_add(1, Ordering::Relaxed);
                debug!(key = %dest.key, bytes, post_us = started.elapsed().as_micros() as u64, "writes posted");
                self.trace_event(dest.key.transfer, |span| {
                    tracing::info!(target: crate::trace::TARGET, parent: span, bytes, "writes posted");
                });
                self.flights.insert(
                    op,
                    Flight {
                        started,
                        bytes,
                        key,
                        ticket,
                        conn: dest.conn,
                        original: dest.key,
                        cancelled: None,
                    },
                );
            }
            Err(why) => {
                warn!(key = %dest.key, why, "transfer could not start");
                self.tell_consumer(dest.conn, dest.key, Reason::TransferFailed, &why);
                self.matcher
                    .transfer_finished(now, key, TransferOutcome::Failed);
                if !failed_early {
                    // An early failure was counted when it happened.
                    self.stats.transfers_failed.fetch_add(1, Ordering::Relaxed);
                }
                self.ticket_back(ticket, SendOutcome::NotSent(Reason::TransferFailed));
            }
        }
    }

    /// Posts the writes of tokens `written[l]..` of every layer `l` (those before were written
    /// early; none when `written` is empty) with the notice.
    pub(super) fn post(
        &mut self,
        ticket: &Ticket,
        dest: &Dest,
        written: &[u64],
    ) -> Result<(OpId, u64), TransferError> {
        let key = ticket.key;
        let held = &self
            .fanouts
            .get(&key)
            .ok_or(TransferError::BlocksGone)?
            .held;
        let c = self
            .conns
            .get(&dest.conn)
            .ok_or(TransferError::ConnectionGone)?;
        let consumer = c.consumer.as_ref().ok_or(TransferError::NoConsumerHello)?;
        let tokens = held.num_tokens.min(dest.num_tokens);
        let ranges: Vec<Range<u64>> = (0..self.layout.spec().num_layers as usize)
            .map(|layer| {
                let written = written.get(layer).copied().unwrap_or(0);
                dest.skip_tokens.max(written).min(tokens)..tokens
            })
            .collect();
        let (mut ops, mut bytes) = plan_by_layer(
            &self.layout,
            &consumer.layout,
            &held.blocks,
            &dest.blocks,
            &ranges,
        )
        .map_err(|source| TransferError::PlanOf { key, source })?;
        // A hybrid model's further KV cache groups move whole here (early writes move the
        // first group's tokens only).
        let whole = PlanRequest {
            producers: std::slice::from_ref(&self.layout),
            consumer: &consumer.layout,
            num_tokens: tokens,
            skip_tokens: dest.skip_tokens.min(tokens),
            producer_blocks: &held.blocks,
            consumer_blocks: &dest.blocks,
            only_producer: Some(self.layout.rank()),
            producer_groups: &held.groups,
            consumer_groups: &dest.groups,
        };
        let further = whole
            .further_groups()
            .and_then(|groups| groups.iter().map(plan).collect::<Result<Vec<_>, _>>())
            .map_err(|source| TransferError::PlanOf { key, source })?;
        for planned in further {
            bytes += planned.bytes();
            ops.extend_from_slice(planned.ops());
        }
        self.stats.bytes_written.fetch_add(bytes, Ordering::Relaxed);
        self.stats.ops_posted.fetch_add(1, Ordering::Relaxed);
        let op = self
            .posts
            .write(consumer.peer, ops, Some(Notice(dest.notice)));
        Ok((op, bytes))
    }

    /// The transport did not accept write `op`: it ends as one that failed in flight does.
    pub(super) fn not_posted(&mut self, op: OpId, error: PostError) {
        if let Some(partial) = self.partials.get(&op) {
            let why = format!("cannot post the early writes of {}: {error}", partial.rkey);
            self.early_done(op, Some(why));
            return;
        }
        let Some(flight) = self.flights.remove(&op) else {
            return;
        };
        let why = TransferError::Write {
            key: flight.original,
            source: error,
        }
        .to_string();
        warn!(key = %flight.original, why, "transfer could not start");
        self.tell_consumer(flight.conn, flight.original, Reason::TransferFailed, &why);
        let now = self.clock.now();
        self.matcher
            .transfer_finished(now, flight.key, TransferOutcome::Failed);
        self.stats.transfers_failed.fetch_add(1, Ordering::Relaxed);
        self.ticket_back(flight.ticket, SendOutcome::NotSent(Reason::TransferFailed));
        self.actions();
    }

    pub(super) fn on_event(&mut self, event: Event) {
        let now = self.clock.now();
        match event {
            Event::WriteDone { op, .. } if self.partials.contains_key(&op) => {
                self.early_done(op, None);
            }
            Event::Failed { op, error, .. } if self.partials.contains_key(&op) => {
                self.early_done(op, Some(error.to_string()));
            }
            Event::WriteDone { op, .. } => {
                let Some(flight) = self.flights.remove(&op) else {
                    return;
                };
                debug!(
                    key = %flight.original,
                    bytes = flight.bytes,
                    us = flight.started.elapsed().as_micros() as u64,
                    "write done"
                );
                match flight.cancelled {
                    None => {
                        self.trace_event(flight.original.transfer, |span| {
                            tracing::info!(target: crate::trace::TARGET, parent: span, bytes = flight.bytes, "written");
                        });
                        self.matcher
                            .transfer_finished(now, flight.key, TransferOutcome::Succeeded);
                        self.stats.transfers_ok.fetch_add(1, Ordering::Relaxed);
                        self.stats
                            .record(flight.started.elapsed().as_secs_f64(), flight.bytes);
                        self.ticket_back(flight.ticket, SendOutcome::Sent);
                    }
                    Some(reason) => {
                        self.tell_consumer(flight.conn, flight.original, reason, "cancelled");
                        self.matcher
                            .transfer_finished(now, flight.key, TransferOutcome::Failed);
                        self.ticket_back(flight.ticket, SendOutcome::NotSent(reason));
                    }
                }
            }
            Event::Failed { op, error, .. } => {
                let Some(flight) = self.flights.remove(&op) else {
                    return;
                };
                warn!(key = %flight.original, %error, "transfer failed");
                self.tell_consumer(
                    flight.conn,
                    flight.original,
                    Reason::TransferFailed,
                    &error.to_string(),
                );
                self.matcher
                    .transfer_finished(now, flight.key, TransferOutcome::Failed);
                self.stats.transfers_failed.fetch_add(1, Ordering::Relaxed);
                self.ticket_back(flight.ticket, SendOutcome::NotSent(Reason::TransferFailed));
            }
            _ => {}
        }
    }
}
