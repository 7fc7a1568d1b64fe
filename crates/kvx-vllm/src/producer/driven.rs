//! The producer's state machine as the driver loop sees it ([`driver::Driven`]): when it wakes, the
//! commands it handles, expiry of what it holds, giving blocks back to the engine, and shutdown.

use super::*;

impl driver::Driven for Machine {
    type Command = Command;
    /// Writes in flight end as they would (their notices reach decode), for a while.
    const DRAIN: Duration = SHUTDOWN_DRAIN;

    fn clock(&self) -> Clock {
        self.clock
    }

    fn wake_at(&mut self) -> Option<Timestamp> {
        [
            self.matcher.poll_timeout(),
            self.expiry.peek().map(|Reverse((at, ..))| *at),
            self.next_nudge(),
            Some(self.next_idle_sweep),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn busy(&self) -> bool {
        // Blocks held for pull are read by the consumer; where that needs this side's progress
        // (`tcp`: the reads are messages this side answers), keep reading the transport.
        !self.flights.is_empty()
            || !self.partials.is_empty()
            || (!self.pull_held.is_empty() && !self.peer_rma_unassisted)
    }

    fn parking(&mut self, _until: Option<Timestamp>, _busy: bool) {
        let in_flight = self.flights.len() + self.partials.len();
        self.stats
            .in_flight
            .store(in_flight as i64, Ordering::Relaxed);
    }

    fn io(&mut self) -> &mut Io {
        &mut self.io
    }

    fn posts(&mut self) -> &mut Posts {
        &mut self.posts
    }

    fn is_shutdown(command: &Command) -> bool {
        matches!(command, Command::Shutdown)
    }

    fn handle_command(&mut self, command: Command) {
        self.handle(command);
        // What the matcher decided goes out before the next input: a transfer cancelled by
        // this command must be marked so before its write's completion, which may come next
        // in the same turn, is handled (else the write ends as sent, and the consumer that
        // cancelled it never hears that nothing runs any more).
        self.actions();
    }

    fn handle_event(&mut self, event: Event) {
        self.on_event(event);
    }

    fn refused(&mut self, refused: Refused) {
        match refused {
            Refused::Connect { peer, error } => self.consumer_unreachable(peer, &error),
            Refused::Op { op, error, .. } => self.not_posted(op, error),
        }
    }

    fn handle_timeout(&mut self, now: Timestamp) {
        self.matcher.handle_timeout(now);
        self.expire(now);
        self.actions();
        self.nudge(now);
        self.close_idle(now);
    }

    fn stopping(&mut self, left: Vec<Command>) {
        // Blocks the engine handed over behind the shutdown go back with the rest (a sealed
        // request's blocks go back when its finish comes).
        for command in left {
            if let Command::Finished { key, held, .. } = command {
                self.finished.push((
                    FinishedSending {
                        request: held.request,
                        key,
                        outcome: SendOutcome::NotSent(Reason::Shutdown),
                    },
                    SystemTime::now(),
                ));
            }
        }
        let now = self.clock.now();
        self.matcher.shutdown(now);
        self.actions();
    }

    fn draining(&self) -> bool {
        !(self.flights.is_empty() && self.partials.is_empty())
    }

    fn stopped(&mut self) {
        self.shutdown();
    }
}

impl Machine {
    /// Connecting to a consumer's endpoint failed: its connections are refused, as a consumer
    /// whose hello is refused is.
    fn consumer_unreachable(&mut self, peer: PeerId, error: &PostError) {
        for c in self.conns.values_mut() {
            if c.consumer.as_ref().is_some_and(|x| x.peer == peer) {
                warn!(why = %error, "refusing consumer");
                self.posts.close(&c.sender);
                c.consumer = None;
                c.leave = None;
            }
        }
    }

    /// Forgets connection `conn`, which closed for `why`: its consumer's registrations will
    /// never be served, and the transport forgets the consumer's endpoint (once its writes in
    /// flight end) unless another connection of the same endpoint still uses it.
    fn conn_closed(&mut self, now: Timestamp, conn: ConnId, why: &str) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        debug!(conn, why, "control connection closed");
        self.claimant_lost(now, conn, c.process);
        if let Some(gone) = &c.consumer {
            self.posts.disconnect(gone.peer);
        }
        self.stats
            .remembered_registrations
            .fetch_sub(c.keys.len() as u64, Ordering::Relaxed);
        for key in c.keys {
            self.matcher
                .abort(now, key.transfer, Some(key.attempt), Reason::Aborted);
        }
    }

    /// Closes the connections whose peer has said nothing for the idle timeout (a decode
    /// heartbeats on each of its connections well within it), at most every quarter timeout.
    fn close_idle(&mut self, now: Timestamp) {
        if now < self.next_idle_sweep {
            return;
        }
        self.next_idle_sweep = now + self.idle_timeout / IDLE_SWEEPS_PER_TIMEOUT;
        let idle: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| now.saturating_duration_since(c.last_heard) >= self.idle_timeout)
            .map(|(id, _)| *id)
            .collect();
        if idle.is_empty() {
            return;
        }
        // One line per sweep, however many a peer left open.
        warn!(
            connections = idle.len(),
            idle = ?self.idle_timeout,
            "kvx: closing control connections that said nothing for the idle timeout"
        );
        for conn in idle {
            if let Some(c) = self.conns.get(&conn) {
                self.posts.close(&c.sender);
            }
            self.stats.idle_closed.fetch_add(1, Ordering::Relaxed);
            self.conn_closed(now, conn, "idle timeout");
        }
    }

    /// The driver thread.
    pub(super) fn run(self, rx: CommandReceiver<Command>) {
        driver::drive(&std::sync::Mutex::new(self), &rx);
    }

    pub(super) fn handle(&mut self, command: Command) {
        let now = self.clock.now();
        match command {
            Command::Finished { key, held, pull } => {
                debug!(%key, tokens = held.num_tokens, pull, "request finished");
                self.trace_event(key.transfer, |span| {
                    tracing::info!(target: crate::trace::TARGET, parent: span, tokens = held.num_tokens, pull, "finished");
                });
                if !pull && self.finish_sealed(key) {
                    return;
                }
                if self.holds(key) {
                    warn!(%key, "request finished twice; the second copy is ignored");
                    return;
                }
                self.take_over(now, key, held, pull);
            }
            Command::Sealed { key, held } => {
                debug!(%key, tokens = held.num_tokens, "request sealed");
                if self.sealed.contains_key(&key) || self.holds(key) {
                    warn!(%key, "request sealed twice, or after it finished; ignored");
                    return;
                }
                self.sealed.insert(key, Sealed::Pending);
                self.take_over(now, key, held, false);
            }
            Command::Progress {
                key,
                blocks,
                tokens,
                layers,
            } => self.progress(now, key, blocks, tokens, layers),
            Command::Abort { transfer, attempt } => {
                debug!(%transfer, ?attempt, "the engine aborted the request");
                self.disown(transfer, attempt);
                self.abort(now, transfer, attempt, Reason::Aborted);
            }
            Command::Trace(transfer, trace) => {
                let span = crate::trace::request_span("kvx.send", Some(trace), transfer, self.rank);
                if span.is_disabled() {
                    return;
                }
                if self.traces.insert(transfer, span).is_none() {
                    self.trace_order.push_back(transfer);
                }
                // Transfers that never end here (aborted before they finished) go at last.
                while self.trace_order.len() > self.max_dead.max(1) {
                    if let Some(old) = self.trace_order.pop_front() {
                        self.traces.remove(&old);
                    }
                }
            }
            Command::Preempted(key) => {
                self.streams.remove(&key);
                for rank in self.ranks_of(key) {
                    self.matcher.preempt(now, rank_key(key, rank));
                }
                if let Some((held, _)) = self.unfanned.remove(&key) {
                    self.give_back(key, held, SendOutcome::NotSent(Reason::Preempted));
                }
            }
            Command::Accepted(conn, sender, hello, _) if hello.role == Role::Router => {
                debug!(conn, engine = hello.engine.0, "router connected");
                self.conns.insert(conn, Conn::router(sender, now));
            }
            Command::Accepted(conn, sender, hello, leave) => {
                let consumer = match accept_consumer(&self.layout, &hello, &mut self.posts) {
                    Ok(consumer) => {
                        self.max_consumer_tp =
                            self.max_consumer_tp.max(consumer.layout.spec().tp_size);
                        Some(consumer)
                    }
                    Err(why) => {
                        warn!(%why, "refusing consumer");
                        self.posts.close(&sender);
                        None
                    }
                };
                let mut c = Conn::new(sender, consumer, now);
                c.leave = leave.filter(|_| c.consumer.is_some());
                self.conns.insert(conn, c);
            }
            Command::Peer(conn, message, _queued) => {
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.last_heard = now;
                }
                self.peer_message(conn, message);
            }
            Command::PeerClosed(conn, why) => self.conn_closed(now, conn, &why),
            Command::Shutdown => {}
        }
    }

    /// A ticket came back; the blocks go back to the engine with the last one.
    pub(super) fn ticket_back(&mut self, ticket: Ticket, outcome: SendOutcome) {
        let Some(fanout) = self.fanouts.get_mut(&ticket.key) else {
            return;
        };
        fanout.pending -= 1;
        if let SendOutcome::NotSent(_) = outcome {
            if fanout.outcome == SendOutcome::Sent {
                fanout.outcome = outcome;
            }
        }
        if fanout.pending == 0 {
            let fanout = self.fanouts.remove(&ticket.key).expect("present");
            self.give_back(ticket.key, fanout.held, fanout.outcome);
        }
    }

    /// The blocks of `key` are done with: reported to the engine, unless it sealed the request
    /// and has not finished it (then reported when it does) or aborted it since (never).
    /// Logs an event in `transfer`'s `kvx.send` span, if it is traced.
    pub(super) fn trace_event(&self, transfer: TransferId, event: impl FnOnce(&tracing::Span)) {
        if let Some(span) = self.traces.get(&transfer) {
            event(span);
        }
    }

    pub(super) fn give_back(
        &mut self,
        key: AttemptKey,
        held: FinishedBlocks,
        outcome: SendOutcome,
    ) {
        self.stats.held.fetch_sub(1, Ordering::Relaxed);
        if let SendOutcome::NotSent(reason) = outcome {
            self.stats.failed(reason);
        }
        if let Some(span) = self.traces.remove(&key.transfer) {
            tracing::info!(target: crate::trace::TARGET, parent: &span, outcome = ?outcome, "released");
        }
        let done = FinishedSending {
            request: held.request,
            key,
            outcome,
        };
        match self.sealed.get_mut(&key) {
            Some(sealed @ (Sealed::Pending | Sealed::Ended(..))) => {
                *sealed = Sealed::Ended(done, SystemTime::now());
            }
            Some(Sealed::Disowned) => {
                self.sealed.remove(&key);
            }
            None => self.finished.push((done, SystemTime::now())),
        }
    }

    /// Expiry of what is held outside the matcher; work proportional to what expires.
    pub(super) fn expire(&mut self, now: Timestamp) {
        while let Some(Reverse((at, key, hold))) = self.expiry.peek().copied() {
            if at > now {
                break;
            }
            self.expiry.pop();
            match hold {
                ExpiryKind::Unfanned => {
                    if self.unfanned.get(&key).is_some_and(|(_, d)| *d == at) {
                        let (held, _) = self.unfanned.remove(&key).expect("present");
                        self.give_back(key, held, SendOutcome::NotSent(Reason::LeaseExpired));
                    }
                }
                ExpiryKind::Dead => {
                    if self.dead.get(&key.transfer).is_some_and(|(_, d)| *d == at) {
                        self.dead.remove(&key.transfer);
                    }
                }
                ExpiryKind::Unneeded => {
                    if self.unneeded.get(&key).is_some_and(|d| *d == at) {
                        self.unneeded.remove(&key);
                    }
                }
                ExpiryKind::Stream => {
                    if let Some(deadline) = self.streams.get(&key).map(|s| s.deadline) {
                        if deadline <= now {
                            self.streams.remove(&key);
                        } else {
                            self.expiry
                                .push(Reverse((deadline, key, ExpiryKind::Stream)));
                        }
                    }
                }
                ExpiryKind::Pull => {
                    if let Some(hold) = self.pull_held.get_mut(&key).filter(|h| h.deadline == at) {
                        // The claims' bound: whoever still reads, the blocks go back.
                        hold.claimants.clear();
                        // Given back, and remembered as ended: a claim that comes later is
                        // told that the blocks are no longer held.
                        self.abort(now, key.transfer, Some(key.attempt), Reason::LeaseExpired);
                    }
                }
                ExpiryKind::ClaimantLook => {
                    if self.next_claimant_look == Some(at) {
                        self.look_at_lost_claimants(now);
                    }
                }
                ExpiryKind::EarlyClaim => {
                    if self.early_claims.get(&key).is_some_and(|(_, d)| *d == at) {
                        let (conns, _) = self.early_claims.remove(&key).expect("present");
                        for conn in conns {
                            self.tell_consumer(
                                conn,
                                key,
                                Reason::LeaseExpired,
                                "the request never finished here",
                            );
                        }
                    }
                }
            }
        }
    }

    /// The transport is closed: what was still in flight or waited for it fails with
    /// `Shutdown`, and every block goes back to the engine. (Decode hears of it only now: once
    /// told, it gives the blocks back to its engine, and nothing of ours may land in them after
    /// that.)
    pub(super) fn shutdown(&mut self) {
        if driver::Driven::draining(self) {
            warn!(
                writes = self.flights.len() + self.partials.len(),
                "closed the transport with writes in flight"
            );
        }
        for (_, flight) in std::mem::take(&mut self.flights) {
            self.tell_consumer(flight.conn, flight.original, Reason::Shutdown, "");
            self.ticket_back(flight.ticket, SendOutcome::NotSent(Reason::Shutdown));
        }
        for (_, early) in std::mem::take(&mut self.early) {
            for d in early.deferred {
                match d {
                    Deferred::Start { ticket, dest, .. } => {
                        self.tell_consumer(dest.conn, dest.key, Reason::Shutdown, "");
                        self.ticket_back(ticket, SendOutcome::NotSent(Reason::Shutdown));
                    }
                    Deferred::Tell { conn, key, .. } => {
                        self.tell_consumer(conn, key, Reason::Shutdown, "");
                    }
                }
            }
        }
        for (key, fanout) in std::mem::take(&mut self.fanouts) {
            self.give_back(key, fanout.held, SendOutcome::NotSent(Reason::Shutdown));
        }
        for (key, (held, _)) in std::mem::take(&mut self.unfanned) {
            self.give_back(key, held, SendOutcome::NotSent(Reason::Shutdown));
        }
        for (key, hold) in std::mem::take(&mut self.pull_held) {
            self.give_back(key, hold.held, SendOutcome::NotSent(Reason::Shutdown));
        }
        // Closed, and forgotten: their peers' leave to attach to this process ends with them.
        for (_, c) in self.conns.drain() {
            self.posts.close(&c.sender);
        }
    }
}
