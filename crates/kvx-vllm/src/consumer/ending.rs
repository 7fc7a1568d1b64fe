//! How a request ends: the waiter's actions, giving up, quiescing the writer ranks of a failed
//! request before its blocks go back, finishing, and telling the producers.

use super::*;

impl Machine {
    /// Whether a failed request waits for a writer rank whose notice would land in the board.
    pub(super) fn quiescing_on_board(&self) -> bool {
        self.board.is_some()
            && self.quiescing.values().any(|q| {
                q.notices
                    .iter()
                    .any(|n| board::is_board_notice(*n) && self.notices.contains_key(n))
            })
    }

    /// Failed requests' notices that landed in the board count as their ranks' confirmation.
    pub(super) fn board_quiesce(&mut self) {
        let Some(slots) = &self.board else {
            return;
        };
        let arrived: Vec<u64> = self
            .quiescing
            .values()
            .flat_map(|q| &q.notices)
            .filter(|n| self.notices.contains_key(n) && slots.shared.arrived(**n))
            .copied()
            .collect();
        for n in arrived {
            self.on_event(Event::Notice(kvx_rdma::transport::Notice(n)));
        }
    }

    /// Takes `key` back from the engine thread: `false` if it reported the request ready
    /// already (it is then forgotten here without a word). Notices of it already in the
    /// board count as arrived.
    pub(super) fn claim(&mut self, key: AttemptKey, payload: &Waiting) -> bool {
        if self.engine_ready.remove(&key) {
            return false;
        }
        let Some(slots) = &self.board else {
            return true;
        };
        match slots.shared.disarm(key) {
            Disarmed::Ready => false,
            Disarmed::NotArmed => true,
            Disarmed::Pending(pending) => {
                for n in &payload.notices {
                    if !pending.contains(n) || slots.shared.arrived(*n) {
                        self.notices.remove(n);
                    }
                }
                true
            }
        }
    }

    pub(super) fn actions(&mut self) {
        self.absorb_engine_ready();
        let actions: Vec<WaiterAction<Waiting>> = self.waiter.drain_actions().collect();
        for action in actions {
            match action {
                WaiterAction::Ready { key, payload } if !self.claim(key, &payload) => {
                    self.finish(key, &payload, false);
                }
                WaiterAction::Failed { key, payload, .. } if !self.claim(key, &payload) => {
                    self.finish(key, &payload, false);
                }
                WaiterAction::Ready { key, payload } => {
                    self.finish(key, &payload, true);
                    let relaid = payload
                        .permute
                        .as_ref()
                        .map_or(Ok(()), |permute| self.apply_permute(permute));
                    if let Err(detail) = relaid {
                        // Never report garbage as ready: the request fails (the engine
                        // recomputes or errors per its policy).
                        warn!(%key, %detail, "re-layout failed");
                        if payload.pull {
                            self.tell_producers(key, &payload, true);
                        }
                        self.stats.transfers_failed.fetch_add(1, Ordering::Relaxed);
                        self.push_event(RecvEvent::Failed {
                            key,
                            request: payload.request,
                            reason: Reason::TransferFailed,
                            detail: detail.to_string(),
                        });
                        continue;
                    }
                    if payload.pull {
                        self.tell_producers(key, &payload, true);
                    }
                    self.stats.transfers_ok.fetch_add(1, Ordering::Relaxed);
                    let waited = self
                        .clock
                        .now()
                        .saturating_duration_since(payload.registered);
                    self.stats.record_wait(waited.as_secs_f64());
                    debug!(%key, "ready");
                    tracing::info!(target: crate::trace::TARGET, parent: &payload.span, "ready");
                    self.push_event(RecvEvent::Ready {
                        key,
                        request: payload.request,
                    });
                }
                WaiterAction::Failed {
                    key,
                    payload,
                    reason,
                } => {
                    self.stats.held.fetch_sub(1, Ordering::Relaxed);
                    self.give_up(key, payload, reason);
                }
            }
        }
    }

    /// A request failed: its producers are told to stop (push) or free their blocks (pull), and
    /// the engine hears of it once nothing can land in its blocks any more: push, every rank
    /// whose notice (or failure notice) has not come is waited for; pull, its own reads.
    pub(super) fn give_up(&mut self, key: AttemptKey, payload: Waiting, reason: Reason) {
        tracing::info!(target: crate::trace::TARGET, parent: &payload.span, %reason, "failed");
        let mut ranks: HashSet<Rank> = payload
            .notices
            .iter()
            .filter_map(|n| self.notices.get(n))
            .map(|(_, rank)| *rank)
            .collect();
        let reads = self.reads.values().filter(|(k, _)| *k == key).count();
        // Ranks of a lost connection can confirm no more: those whose process is known gone
        // write no more; the others are waited for (their process, or the bound).
        let mut lost = HashMap::new();
        if let Some(lost_ranks) = self.lost_ranks.get(&payload.instance) {
            ranks.retain(|rank| match lost_ranks.get(rank) {
                Some(l) if !l.gone => {
                    lost.insert(*rank, l.process);
                    true
                }
                Some(_) => false,
                None => true,
            });
        }
        if let Some(instance) = self.instances.get_mut(&payload.instance) {
            instance.waiting.remove(&key);
        }
        self.tell_producers(key, &payload, false);
        self.stats.transfers_failed.fetch_add(1, Ordering::Relaxed);
        let bound = self.quiesce_bound(payload.instance, &ranks, reads);
        let quiescing = Quiescing {
            request: payload.request,
            reason,
            instance: payload.instance,
            ranks,
            notices: payload.notices,
            reads,
            lost,
            cause: payload.cause,
            bound,
            deadline: self.clock.now() + bound,
        };
        let quiet = quiescing.quiet();
        self.quiescing.insert(key, quiescing);
        if quiet {
            self.quiesced(key);
        }
    }

    /// How long a failed request's blocks stay held at most for `ranks` of `instance` to
    /// confirm that they write no more and for `reads` of this side's own to end: the
    /// configured bound, else the longest that any of them can run plus a margin.
    pub(super) fn quiesce_bound(
        &self,
        instance: SocketAddr,
        ranks: &HashSet<Rank>,
        reads: usize,
    ) -> Duration {
        if let Some(fixed) = self.config.quiesce_timeout {
            return fixed;
        }
        // A rank's connection, or the one just lost.
        let live = self.instances.get(&instance);
        let lost = self.lost_ranks.get(&instance);
        let writes = ranks
            .iter()
            .filter_map(|r| {
                live.and_then(|i| i.ranks.get(r))
                    .map(|conn| Duration::from_millis(conn.hello.write_timeout_ms.into()))
                    .or_else(|| lost.and_then(|l| l.get(r)).map(|l| l.write_timeout))
            })
            .max()
            .unwrap_or_default()
            // What a producer says, up to what any producer may run a write for.
            .min(crate::config::MAX_TRANSFER_TIMEOUT);
        let own = if reads > 0 {
            self.config.transfer_timeout
        } else {
            Duration::ZERO
        };
        writes.max(own) + QUIESCE_MARGIN
    }

    /// A failed request's writers are quiet (or gone, or out of time): the engine may have its
    /// blocks back.
    pub(super) fn quiesced(&mut self, key: AttemptKey) {
        let Some(q) = self.quiescing.remove(&key) else {
            return;
        };
        if let Some(slots) = &mut self.board {
            // A notice that never came may still be written: its slot waits before reuse.
            let notices = &self.notices;
            slots.give_back(self.clock.now(), &q.notices, |n| !notices.contains_key(&n));
        }
        for n in &q.notices {
            self.notices.remove(n);
        }
        self.reads.retain(|_, (k, _)| *k != key);
        self.unheld.retain(|(k, _), _| *k != key);
        let unconfirmed = if q.quiet() {
            String::new()
        } else {
            self.stats
                .released_unconfirmed
                .fetch_add(1, Ordering::Relaxed);
            warn!(
                key = %key,
                ranks = ?q.ranks,
                reads = q.reads,
                bound = ?q.bound,
                "blocks of a failed request released without every producer rank's confirmation"
            );
            format!(
                "released after {:?} without confirmation from producer ranks {:?} ({} reads in flight)",
                q.bound, q.ranks, q.reads
            )
        };
        let detail = match (q.cause, unconfirmed.is_empty()) {
            (Some(cause), true) => cause,
            (Some(cause), false) => format!("{cause}; {unconfirmed}"),
            (None, _) => unconfirmed,
        };
        self.push_event(RecvEvent::Failed {
            key,
            request: q.request,
            reason: q.reason,
            detail,
        });
    }

    /// A request's KV is in: forget it (`count` whether the `held` gauge still counts it: the
    /// engine thread uncounts what it finds ready in the board).
    pub(super) fn finish(&mut self, key: AttemptKey, payload: &Waiting, count: bool) {
        for n in &payload.notices {
            self.notices.remove(n);
        }
        if let Some(slots) = &mut self.board {
            slots.give_back(self.clock.now(), &payload.notices, |_| true);
        }
        self.reads.retain(|_, (k, _)| *k != key);
        self.unheld.retain(|(k, _), _| *k != key);
        if let Some(instance) = self.instances.get_mut(&payload.instance) {
            instance.waiting.remove(&key);
        }
        if count {
            self.stats.held.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Tells every connected rank of `prefill` that the engine dropped `transfer` before
    /// registering it: each gives back what it holds for it.
    pub(super) fn abandon(
        &mut self,
        prefill: SocketAddr,
        transfer: TransferId,
        capability: Option<Capability>,
    ) {
        if let Err(detail) = self.may_reach(prefill, transfer, capability.as_ref()) {
            self.stats.unauthorized.fetch_add(1, Ordering::Relaxed);
            warn!(%prefill, %transfer, %detail, "dropped before registration; not telling its prefill");
            return;
        }
        let missing = match self.missing_ranks(prefill) {
            Ok(missing) if missing.is_empty() => {
                self.tell_abandoned(prefill, &[(transfer, capability)]);
                return;
            }
            Ok(missing) => missing,
            Err(detail) => {
                debug!(%prefill, %transfer, %detail, "dropped before registration; its prefill cannot serve here");
                return;
            }
        };
        match self.connect_ranks(prefill, missing) {
            Ok(connecting) => {
                connecting.abandons.push((transfer, capability));
                debug!(%prefill, %transfer, "dropped before registration; connecting to its prefill to say so");
            }
            Err(why) => {
                debug!(%prefill, %transfer, %why, "dropped before registration; its prefill is unreachable");
            }
        }
    }

    /// Tells every connected rank of `prefill` that the engine dropped `transfers` before
    /// registering them.
    pub(super) fn tell_abandoned(
        &mut self,
        prefill: SocketAddr,
        transfers: &[(TransferId, Option<Capability>)],
    ) {
        let Some(instance) = self.instances.get(&prefill) else {
            return;
        };
        for (transfer, capability) in transfers {
            let transfer = *transfer;
            let message = Message::Abort(Abort {
                transfer,
                attempt: None,
                reason: "decode dropped the request before registering it".into(),
                capability: capability.clone(),
            });
            for conn in instance.ranks.values() {
                self.posts.tell(&conn.sender, &message);
            }
            debug!(%prefill, %transfer, ranks = instance.ranks.len(), "told prefill: dropped before registration");
        }
    }

    pub(super) fn tell_producers(&mut self, key: AttemptKey, payload: &Waiting, done: bool) {
        let Some(instance) = self.instances.get(&payload.instance) else {
            return;
        };
        for rank in &payload.writers {
            let Some(conn) = instance.ranks.get(rank) else {
                continue;
            };
            let message = if done {
                Message::Completion(Completion {
                    transfer: key.transfer,
                    attempt: key.attempt,
                    producer: self.config.engine,
                    producer_rank: *rank,
                    bytes: 0,
                    capability: payload.capability.clone(),
                })
            } else {
                Message::Abort(Abort {
                    transfer: key.transfer,
                    attempt: Some(key.attempt),
                    reason: "consumer gave up".into(),
                    capability: payload.capability.clone(),
                })
            };
            // Never blocks: the engine thread may be the caller (a registration that failed
            // half-way); what a full connection does not take waits for the driver's flush.
            self.posts.tell(&conn.sender, &message);
        }
    }
}
