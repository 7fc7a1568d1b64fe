//! What consumers and routers say over their control connections (registrations, pull reads done,
//! aborts, heartbeats), and what this side tells them (failures, finishing hints, nudges).

use super::*;

fn failure(key: AttemptKey, rank: Rank, reason: Reason, detail: &str) -> Message {
    Message::Failure(FailureNotice {
        transfer: key.transfer,
        attempt: key.attempt,
        rank,
        reason: reason.into(),
        detail: detail.chars().take(1024).collect(),
    })
}

/// Checks a registration's destination against the consumer's layout before holding it.
/// Blocks a registration may name beyond twice what its tokens need.
const SPARE_BLOCKS: u64 = 8;

fn check_destination(layout: &Layout, reg: &Registration) -> Result<(), BadDestination> {
    if reg.consumer_rank != layout.rank() {
        return Err(BadDestination::WrongRank {
            registered: reg.consumer_rank,
            connection: layout.rank(),
        });
    }
    check_blocks(layout, reg.num_tokens, &reg.blocks)?;
    for group in &reg.groups {
        check_blocks(layout, reg.num_tokens, &group.blocks)?;
    }
    Ok(())
}

/// Checks one KV cache group's blocks of a registration for `tokens` tokens.
fn check_blocks(layout: &Layout, tokens: u32, blocks: &[BlockId]) -> Result<(), BadDestination> {
    let needed = u64::from(tokens).div_ceil(u64::from(layout.spec().block_tokens));
    if (blocks.len() as u64) < needed {
        return Err(BadDestination::TooFewBlocks {
            blocks: blocks.len(),
            tokens,
        });
    }
    // What a registration may hold is bounded by what its tokens need (an engine may register
    // a few blocks it allocated ahead, never many), and its tokens by the consumer's cache.
    if needed > u64::from(layout.spec().num_blocks)
        || blocks.len() as u64 > 2 * needed + SPARE_BLOCKS
    {
        return Err(BadDestination::TooManyBlocks {
            blocks: blocks.len(),
            tokens,
            num_blocks: layout.spec().num_blocks,
        });
    }
    if let Some(&block) = blocks.iter().find(|b| b.0 >= layout.spec().num_blocks) {
        return Err(BadDestination::BlockOutOfRange {
            block,
            num_blocks: layout.spec().num_blocks,
        });
    }
    Ok(())
}

impl Machine {
    /// Whether `capability` allows the peer on `conn` to act on `transfer` (always, without a
    /// deployment key); a refusal is counted and logged.
    pub(super) fn authorized(
        &self,
        conn: ConnId,
        transfer: TransferId,
        capability: Option<&Capability>,
        what: &str,
    ) -> bool {
        self.authorize(conn, transfer, capability, what).is_ok()
    }

    /// [`Machine::authorized`], with why not.
    pub(super) fn authorize(
        &self,
        conn: ConnId,
        transfer: TransferId,
        capability: Option<&Capability>,
        what: &str,
    ) -> Result<(), crate::CapabilityError> {
        let Some(key) = &self.auth_key else {
            return Ok(());
        };
        let presenter = self
            .conns
            .get(&conn)
            .and_then(|c| c.consumer.as_ref())
            .map(|consumer| consumer.id.engine);
        key.check(transfer, capability, presenter, self.clock.wall())
            .inspect_err(|e| {
                self.stats.unauthorized.fetch_add(1, Ordering::Relaxed);
                warn!(conn, %transfer, %e, "{what} refused");
            })
    }

    /// Whether the consumer or router on `conn` may abort `transfer`: unless registrations of
    /// it came from other consumers only. A transfer nobody registered (prefill finished first,
    /// or pull) may be aborted by any consumer or router: its owner is not known.
    pub(super) fn may_abort(&self, conn: ConnId, transfer: TransferId) -> bool {
        let Some(c) = self.conns.get(&conn) else {
            return false;
        };
        // A router is no registrant: it may abort only what nobody registered.
        let me = match (&c.consumer, c.router) {
            (Some(consumer), _) => Some(consumer.id),
            (None, true) => None,
            (None, false) => return false,
        };
        let mixed: Vec<TransferId> = self
            .rank_keys(AttemptKey::new(transfer, Attempt(0)))
            .map(|k| k.transfer)
            .collect();
        let registrants: HashSet<ConsumerId> = self
            .conns
            .values()
            .filter_map(|c| c.consumer.as_ref().map(|consumer| (c, consumer.id)))
            .filter(|(c, _)| c.keys.iter().any(|k| mixed.contains(&k.transfer)))
            .map(|(_, id)| id)
            .collect();
        if registrants.is_empty() || me.is_some_and(|me| registrants.contains(&me)) {
            return true;
        }
        if me.is_some() {
            warn!(
                conn,
                %transfer,
                "abort ignored: another decode instance registered this transfer"
            );
        } else {
            // A router abandons what it cannot tell a decode took in (a client that left):
            // a decode that registered keeps the transfer, as it should.
            debug!(conn, %transfer, "a router's abort ignored: a decode instance registered this transfer");
        }
        false
    }

    /// Whether a decode rank has finished reading `transfer` (pull) while others may still
    /// read it: a router's abort is refused then. (A read in progress before any rank finished
    /// is invisible here: a router must only abandon ids it never handed to a decode.)
    pub(super) fn being_read(&self, transfer: TransferId) -> bool {
        let read = self
            .pull_held
            .iter()
            .any(|(k, hold)| k.transfer == transfer && hold.readers.is_some());
        if read {
            warn!(%transfer, "abort from a router ignored: a decode instance reads this transfer");
        }
        read
    }

    /// Whether nothing of `transfer` at `attempt` from the consumer rank on `conn` is
    /// registered or being written here: no live registration, no transfer in flight, no early
    /// write in flight.
    pub(super) fn writes_nothing_for(
        &self,
        conn: ConnId,
        transfer: TransferId,
        attempt: Attempt,
    ) -> bool {
        let Some(c) = self.conns.get(&conn) else {
            return false;
        };
        let mixed: Vec<AttemptKey> = self.rank_keys(AttemptKey::new(transfer, attempt)).collect();
        let registered = c
            .keys
            .iter()
            .any(|k| mixed.contains(k) && self.matcher.is_live(*k));
        let flying = self
            .flights
            .values()
            .any(|f| f.conn == conn && f.original == AttemptKey::new(transfer, attempt));
        let early = mixed
            .iter()
            .any(|k| self.early.get(k).is_some_and(|e| e.in_flight > 0));
        !(registered || flying || early)
    }

    pub(super) fn peer_message(&mut self, conn: ConnId, message: Message) {
        let now = self.clock.now();
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.router {
            match message {
                Message::Abort(abort) => {
                    if self.authorized(conn, abort.transfer, abort.capability.as_ref(), "abort")
                        && self.may_abort(conn, abort.transfer)
                        && !self.being_read(abort.transfer)
                    {
                        debug!(conn, transfer = %abort.transfer, reason = abort.reason, "a router abandons a transfer");
                        self.abort(now, abort.transfer, abort.attempt, Reason::Aborted);
                    }
                    self.stats.router_aborts.fetch_add(1, Ordering::Relaxed);
                }
                _ => warn!(conn, "a router may only send aborts: message ignored"),
            }
            return;
        }
        match message {
            Message::Hello(_) => warn!(conn, "second hello on a control connection ignored"),
            Message::Registration(reg) => self.registration(conn, now, reg),
            Message::Heartbeat(hb) => {
                if let Some(consumer) = &c.consumer {
                    let rank = consumer.layout.rank();
                    let id = consumer.id;
                    let transfers: Vec<TransferId> = hb
                        .transfers
                        .iter()
                        .map(|t| rank_key(AttemptKey::new(*t, Attempt(0)), rank).transfer)
                        .collect();
                    self.matcher.heartbeat(now, id, transfers);
                }
            }
            Message::Abort(abort) => {
                if self.authorized(conn, abort.transfer, abort.capability.as_ref(), "abort")
                    && self.may_abort(conn, abort.transfer)
                {
                    // Nothing of that attempt registered or in flight from this connection (a
                    // transfer that ended, a notice lost on the way): the consumer rank hears
                    // at once that nothing more will be written, instead of waiting for its
                    // bound. Decided before the abort: messages on a connection keep their
                    // order, so every registration sent before the abort is known here.
                    let quiet = abort
                        .attempt
                        .filter(|&attempt| self.writes_nothing_for(conn, abort.transfer, attempt));
                    self.unclaim(conn, abort.transfer, abort.attempt);
                    self.abort(now, abort.transfer, abort.attempt, Reason::Aborted);
                    if let Some(attempt) = quiet {
                        self.tell_consumer(
                            conn,
                            AttemptKey::new(abort.transfer, attempt),
                            Reason::Aborted,
                            "nothing of it is registered or being written here",
                        );
                    }
                }
            }
            Message::Failure(f) => {
                if self.may_abort(conn, f.transfer) {
                    self.unclaim(conn, f.transfer, Some(f.attempt));
                    self.abort(now, f.transfer, Some(f.attempt), Reason::PeerFailed);
                }
            }
            Message::Claim(claim) => {
                if self.authorized(
                    conn,
                    claim.transfer,
                    claim.capability.as_ref(),
                    "read claim",
                ) {
                    self.claimed(now, conn, AttemptKey::new(claim.transfer, claim.attempt));
                }
            }
            Message::Completion(done) => {
                // With a key, only the decode the router sent to read the transfer frees it.
                if self.authorized(
                    conn,
                    done.transfer,
                    done.capability.as_ref(),
                    "read completion",
                ) {
                    self.consumer_done(now, conn, AttemptKey::new(done.transfer, done.attempt));
                }
            }
            _ => warn!(conn, "unexpected message from a consumer"),
        }
    }

    /// Pull: the consumer rank on `conn` reads `key`'s blocks. Held here, they stay held for
    /// it until its completion (or its claim's bound), and it is told so ([`Held`]): only then
    /// is what it read the request's KV. Held no more (aborted, or out of lease), it is told
    /// that instead, and discards what it read. A claim that comes before the engine finished
    /// the request here waits for it, up to the claim's bound.
    pub(super) fn claimed(&mut self, now: Timestamp, conn: ConnId, key: AttemptKey) {
        let Some(consumer) = self.conns.get(&conn).and_then(|c| c.consumer.as_ref()) else {
            return;
        };
        let until = now + consumer.claim_bound;
        if let Some(hold) = self.pull_held.get_mut(&key).filter(|h| h.aborted.is_none()) {
            let readers =
                kvx_layout::readers_for(self.rank, self.layout.spec().tp_size, &consumer.layout)
                    .unwrap_or_else(|_| vec![consumer.layout.rank()]);
            hold.readers.get_or_insert(readers);
            hold.claimants.insert(conn);
            if until > hold.deadline {
                hold.deadline = until;
                self.expiry.push(Reverse((until, key, ExpiryKind::Pull)));
            }
            let held = Message::Held(Held {
                transfer: key.transfer,
                attempt: key.attempt,
                producer_rank: self.rank,
            });
            if let Some(c) = self.conns.get(&conn) {
                self.posts.tell(&c.sender, &held);
            }
            return;
        }
        let ended = self
            .dead
            .get(&key.transfer)
            .is_some_and(|(attempt, _)| attempt.is_none_or(|a| a == key.attempt));
        if ended || self.pull_held.contains_key(&key) {
            self.tell_consumer(conn, key, Reason::Aborted, "its blocks are held no more");
            return;
        }
        if !self.early_claims.contains_key(&key) && self.early_claims.len() >= self.max_dead {
            self.tell_consumer(conn, key, Reason::Capacity, "too many early read claims");
            return;
        }
        let (conns, deadline) = self.early_claims.entry(key).or_insert((Vec::new(), until));
        if !conns.contains(&conn) {
            conns.push(conn);
        }
        if *deadline == until {
            self.expiry
                .push(Reverse((until, key, ExpiryKind::EarlyClaim)));
        }
    }

    /// The consumer rank on `conn` gives up on `transfer` (at `attempt`, or every attempt): it
    /// reads what it claimed no more (what it still reads lands in blocks it fails anyway).
    fn unclaim(&mut self, conn: ConnId, transfer: TransferId, attempt: Option<Attempt>) {
        for (key, hold) in &mut self.pull_held {
            if key.transfer == transfer && attempt.is_none_or(|a| a == key.attempt) {
                hold.claimants.remove(&conn);
            }
        }
    }

    /// The claims of the consumer rank on `conn`, whose connection closed and whose process has
    /// exited, end: it reads no more. A held pull that no live claimant reads any more keeps
    /// only its lease, and goes back now if that has run out.
    pub(super) fn claims_end(&mut self, now: Timestamp, conn: ConnId) {
        let mut expired = Vec::new();
        for (key, hold) in &mut self.pull_held {
            if !hold.claimants.remove(&conn) || !hold.claimants.is_empty() {
                continue;
            }
            hold.deadline = if hold.aborted.is_some() {
                now
            } else {
                hold.leased_until
            };
            if hold.deadline <= now {
                expired.push(*key);
            } else {
                self.expiry
                    .push(Reverse((hold.deadline, *key, ExpiryKind::Pull)));
            }
        }
        for key in expired {
            debug!(%key, "every reader of a held pull is gone, and its lease has run out");
            let reason = self.pull_held[&key].aborted.unwrap_or(Reason::LeaseExpired);
            self.abort(now, key.transfer, Some(key.attempt), reason);
        }
    }

    /// A claimant's connection closed: its claims end now where its process is known to have
    /// exited, or once it is seen to (looked at until then); where it cannot be seen (another
    /// host, TCP), at their bound.
    pub(super) fn claimant_lost(&mut self, now: Timestamp, conn: ConnId, process: Option<Process>) {
        if !self.pull_held.values().any(|h| h.claimants.contains(&conn)) {
            return;
        }
        match process {
            Some(p) if p.exited() => self.claims_end(now, conn),
            Some(p) => {
                self.lost_claimants.insert(conn, p);
                if self.next_claimant_look.is_none() {
                    let at = now + LOST_CLAIMANT_LOOK;
                    self.next_claimant_look = Some(at);
                    self.expiry.push(Reverse((
                        at,
                        AttemptKey::new(TransferId(0), Attempt(0)),
                        ExpiryKind::ClaimantLook,
                    )));
                }
            }
            None => {}
        }
    }

    /// Looks at the processes of lost claimants (see [`Machine::claimant_lost`]).
    pub(super) fn look_at_lost_claimants(&mut self, now: Timestamp) {
        self.next_claimant_look = None;
        let lost: Vec<(ConnId, Process)> = self.lost_claimants.drain().collect();
        for (conn, process) in lost {
            if !self.pull_held.values().any(|h| h.claimants.contains(&conn)) {
                continue;
            }
            if process.exited() {
                self.claims_end(now, conn);
            } else {
                self.claimant_lost(now, conn, Some(process));
            }
        }
    }

    /// A consumer rank is done with `key` here. Pull mode: it has read the blocks; they go back
    /// once every reader has. Either mode, from a consumer engine that reads nothing from this
    /// rank (it takes a replica another rank serves, [`kvx_layout::idle_producers`]): the
    /// blocks are nobody's, and go back now, or as soon as the request finishes.
    pub(super) fn consumer_done(&mut self, now: Timestamp, conn: ConnId, key: AttemptKey) {
        let Some(consumer) = self.conns.get(&conn).and_then(|c| c.consumer.as_ref()) else {
            return;
        };
        let reader = consumer.layout.rank();
        let readers =
            kvx_layout::readers_for(self.rank, self.layout.spec().tp_size, &consumer.layout)
                .unwrap_or_else(|_| vec![reader]);
        if readers.is_empty() {
            self.not_needed(now, key);
            return;
        }
        let Some(hold) = self.pull_held.get_mut(&key) else {
            return;
        };
        hold.claimants.remove(&conn);
        if let Some(reason) = hold.aborted {
            // Aborted while others read it: it goes back once the last of them is done.
            if hold.claimants.is_empty() {
                let hold = self.pull_held.remove(&key).expect("present");
                self.give_back(key, hold.held, SendOutcome::NotSent(reason));
            }
            return;
        }
        let expected = hold.readers.get_or_insert(readers).clone();
        if !hold.done.contains(&reader) {
            hold.done.push(reader);
        }
        if expected.iter().all(|r| hold.done.contains(r)) {
            let hold = self.pull_held.remove(&key).expect("present");
            self.stats.transfers_ok.fetch_add(1, Ordering::Relaxed);
            self.give_back(key, hold.held, SendOutcome::Sent);
        }
    }

    /// No consumer rank needs `key` from this rank: its blocks go back, delivered, now if it
    /// finished (push or pull), or once it does (remembered, bounded).
    fn not_needed(&mut self, now: Timestamp, key: AttemptKey) {
        if let Some((held, _)) = self.unfanned.remove(&key) {
            debug!(%key, "nothing of it is needed from this rank");
            self.give_back(key, held, SendOutcome::Sent);
            return;
        }
        if let Some(hold) = self.pull_held.remove(&key) {
            debug!(%key, "nothing of it is needed from this rank");
            self.give_back(key, hold.held, SendOutcome::Sent);
            return;
        }
        if self.holds(key) || self.unneeded.contains_key(&key) {
            // Fanned out to the readers of another consumer engine: they decide.
            return;
        }
        if self.unneeded.len() >= self.max_dead {
            debug!(%key, "too many unneeded requests remembered: this one is held until its lease");
            return;
        }
        let until = now + DEAD_TTL;
        self.unneeded.insert(key, until);
        self.expiry
            .push(Reverse((until, key, ExpiryKind::Unneeded)));
    }

    pub(super) fn registration(&mut self, conn: ConnId, now: Timestamp, reg: Registration) {
        let producer_tp = self.layout.spec().tp_size;
        let has_hello = self.conns.get(&conn).is_some_and(|c| c.consumer.is_some());
        if has_hello {
            if let Err(e) =
                self.authorize(conn, reg.transfer, reg.capability.as_ref(), "registration")
            {
                let key = AttemptKey::new(reg.transfer, reg.attempt);
                let detail = format!("registration refused: {e}");
                if let Some(c) = self.conns.get(&conn) {
                    self.posts.tell(
                        &c.sender,
                        &failure(key, self.rank, Reason::Unauthorized, &detail),
                    );
                }
                return;
            }
        }
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let key = AttemptKey::new(reg.transfer, reg.attempt);
        let Some(consumer) = &c.consumer else {
            self.posts.tell(
                &c.sender,
                &failure(
                    key,
                    self.rank,
                    Reason::Conflict,
                    "registration before hello",
                ),
            );
            return;
        };
        if let Err(why) = check_destination(&consumer.layout, &reg) {
            self.posts.tell(
                &c.sender,
                &failure(key, self.rank, Reason::Conflict, &why.to_string()),
            );
            return;
        }
        let readers = match kvx_layout::readers_for(self.rank, producer_tp, &consumer.layout) {
            Ok(r) if r.contains(&reg.consumer_rank) => r,
            Ok(_) | Err(_) => {
                let why = format!(
                    "{} does not write to consumer {}",
                    self.rank, reg.consumer_rank
                );
                self.posts.tell(
                    &c.sender,
                    &failure(key, self.rank, Reason::Conflict, &why.to_string()),
                );
                return;
            }
        };
        let id = consumer.id;
        let rkey = rank_key(key, reg.consumer_rank);
        if !c.keys.contains(&rkey)
            && !c.below_quota(self.registration_quota, &self.matcher, &self.stats)
        {
            let why = format!(
                "this consumer rank holds {} registrations here, the most one may",
                self.registration_quota
            );
            self.posts
                .tell(&c.sender, &failure(key, self.rank, Reason::Conflict, &why));
            return;
        }
        c.remember(rkey, &self.matcher, &self.stats);
        if let Some(span) = self.traces.get(&reg.transfer) {
            tracing::info!(target: crate::trace::TARGET, parent: span, consumer_rank = reg.consumer_rank.0, "registered");
        }
        let lease = Duration::from_millis(u64::from(reg.lease_ms));
        self.matcher.register(
            now,
            rank_key(key, reg.consumer_rank),
            id,
            lease,
            Dest {
                conn,
                key,
                blocks: reg.blocks,
                groups: reg.groups,
                num_tokens: u64::from(reg.num_tokens),
                skip_tokens: u64::from(reg.skip_tokens),
                notice: reg.notice,
            },
        );
        if let Some((held, _)) = self.unfanned.remove(&key) {
            self.fan_out(now, key, held, &readers);
        } else if !self.fanouts.contains_key(&key) && self.streams.contains_key(&key) {
            self.stream(key, rank_key(key, reg.consumer_rank));
        }
    }

    /// When a consumer that asked for finishing hints is next due a nudge: an early write to it
    /// has waited [`NUDGE_AFTER`], and it was not nudged for as long.
    pub(super) fn next_nudge(&self) -> Option<Timestamp> {
        self.partials
            .values()
            .filter_map(|p| self.nudge_due(p))
            .min()
    }

    /// When the consumer of early write `p` is due a nudge for it, if it asked for hints.
    pub(super) fn nudge_due(&self, p: &Partial) -> Option<Timestamp> {
        self.wants_hints(p.conn).then(|| {
            let last = self
                .nudged
                .get(&p.conn)
                .map_or(p.posted, |&at| at.max(p.posted));
            last + NUDGE_AFTER
        })
    }

    /// Nudges every consumer that is due (see [`Self::next_nudge`]) with an empty heartbeat:
    /// a consumer reads its transport once for every message it gets.
    pub(super) fn nudge(&mut self, now: Timestamp) {
        let due: HashSet<ConnId> = self
            .partials
            .values()
            .filter(|p| self.nudge_due(p).is_some_and(|at| at <= now))
            .map(|p| p.conn)
            .collect();
        let message = Message::Heartbeat(Heartbeat {
            engine: self.engine,
            incarnation: self.incarnation,
            transfers: Vec::new(),
        });
        for conn in due {
            self.nudged.insert(conn, now);
            self.send_counted(conn, &message, |s| &s.nudges);
        }
        let partials = &self.partials;
        self.nudged
            .retain(|conn, _| partials.values().any(|p| p.conn == *conn));
    }

    /// Whether the consumer on `conn` asked for finishing hints.
    pub(super) fn wants_hints(&self, conn: ConnId) -> bool {
        self.conns
            .get(&conn)
            .and_then(|c| c.consumer.as_ref())
            .is_some_and(|c| c.finishing_hints)
    }

    /// Tells a consumer rank that asked for it that the final writes of `dest` begin (before
    /// any wait for early writes), so that it reads its transport until the notice.
    pub(super) fn hint_finishing(&mut self, dest: &Dest) {
        if self.wants_hints(dest.conn) {
            let message = Message::Finishing(Finishing {
                transfer: dest.key.transfer,
                attempt: dest.key.attempt,
                producer_rank: self.rank,
            });
            self.send_counted(dest.conn, &message, |s| &s.finishing_hints);
        }
    }

    /// Sends `message` on `conn` (if it is still open) and counts it in `sent`; a hint or a
    /// nudge that cannot be sent needs no more: the closed connection fails what it served.
    pub(super) fn send_counted(
        &mut self,
        conn: ConnId,
        message: &Message,
        sent: fn(&Stats) -> &AtomicU64,
    ) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        self.posts.tell(&c.sender, message);
        sent(&self.stats).fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn tell_consumer(
        &mut self,
        conn: ConnId,
        key: AttemptKey,
        reason: Reason,
        detail: &str,
    ) {
        if let Some(c) = self.conns.get(&conn) {
            self.posts
                .tell(&c.sender, &failure(key, self.rank, reason, detail));
        }
    }
}
