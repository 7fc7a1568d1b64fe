//! The consumer's state machine as the driver loop sees it ([`driver::Driven`]): what it waits for,
//! when it wakes, the commands it handles, how it stops; and the engine thread's fast path into it
//! (registering at once, waking the parked driver).

use super::*;

impl driver::Driven for Machine {
    type Command = Command;

    fn clock(&self) -> Clock {
        self.clock
    }

    fn wake_at(&mut self) -> Option<Timestamp> {
        // At least every heartbeat interval, even with nothing to do: a request the engine
        // thread registers then needs no wake-up to have its heartbeats (or its lease) looked
        // after in time.
        let idle_tick = self.clock.now() + self.config.heartbeat_interval;
        Some(self.deadline().map_or(idle_tick, |d| d.min(idle_tick)))
    }

    /// Whether the driver must read its transport while it waits: a notice, a finishing hint or
    /// a read is due there (a notice due in the board is not).
    fn busy(&self) -> bool {
        if self.finishing_hints {
            // Push notices are due only once their producer rank said so.
            !self.hinted.is_empty() || !self.reads.is_empty() || !self.quiescing.is_empty()
        } else {
            !self.reads.is_empty()
                || !self.quiescing.is_empty()
                || (self.board_notices_as_messages && !self.notices.is_empty())
                || self.notices.keys().any(|n| !board::is_board_notice(*n))
        }
    }

    fn parking(&mut self, until: Option<Timestamp>, busy: bool) {
        self.transport_wanted = false;
        self.stats
            .in_flight
            .store(self.reads.len() as i64, Ordering::Relaxed);
        self.parked = Some(Parked { until, busy });
    }

    fn woke(&mut self) {
        self.parked = None;
        self.stats.driver_turns.fetch_add(1, Ordering::Relaxed);
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
    }

    fn handle_event(&mut self, event: Event) {
        self.on_event(event);
    }

    fn refused(&mut self, refused: Refused) {
        match refused {
            Refused::Connect { peer, error } => self.endpoint_unreachable(peer, &error),
            Refused::Op { op, error, .. } => self.not_posted(op, error),
        }
    }

    fn handle_timeout(&mut self, now: Timestamp) {
        self.board_quiesce();
        self.first_contacts();
        self.waiter.handle_timeout(now);
        self.look_at_lost(now);
        self.heartbeats(now);
        self.actions();
        // A notice that arrived, or a request that ended, needs no more reading for it.
        let notices = &self.notices;
        self.hinted.retain(|n| notices.contains_key(n));
        let overdue: Vec<AttemptKey> = self
            .quiescing
            .iter()
            .filter(|(_, q)| q.deadline <= now)
            .map(|(k, _)| *k)
            .collect();
        for key in overdue {
            warn!(%key, "producer ranks did not confirm the end of their writes in time");
            self.quiesced(key);
        }
    }

    fn stopping(&mut self, left: Vec<Command>) {
        self.finish_run();
        // What the engine queued behind the shutdown fails too, never silently.
        self.refuse_all(left);
    }
}

impl Machine {
    /// When the state machines next need the time.
    pub(super) fn deadline(&mut self) -> Option<Timestamp> {
        let mut quiesce = self.quiescing.values().map(|q| q.deadline).min();
        if self.quiescing_on_board() {
            // Their writers confirm by writing the board, which wakes no one.
            let poll = self.clock.now() + BOARD_POLL;
            quiesce = Some(quiesce.map_or(poll, |q| q.min(poll)));
        }
        if !self.awaiting_contact.is_empty() {
            // A writer's first contact needs this side's transport read: each turn reads it
            // once (see `first_contacts`).
            let at = self.contact.1;
            quiesce = Some(quiesce.map_or(at, |q| q.min(at)));
        }
        [
            self.waiter.poll_timeout(),
            self.next_heartbeat,
            quiesce,
            self.next_lost_look,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Whether the engine thread may register a push request for `instance` itself: every
    /// writer rank of it is connected.
    pub(super) fn registers_at_once(&self, instance: SocketAddr) -> bool {
        !self.connecting.contains_key(&instance)
            && self.missing_ranks(instance).is_ok_and(|m| m.is_empty())
    }

    /// After the engine thread registered a request: whether the parked driver must look
    /// again.
    pub(super) fn needs_wake(&mut self) -> bool {
        let Some(parked) = self.parked else {
            return true;
        };
        let deadline = self.deadline();
        let sooner = match (deadline, parked.until) {
            (Some(d), Some(until)) => d < until,
            (Some(_), None) => true,
            (None, _) => false,
        };
        // Only a message notice makes the driver read its transport (`busy`): checked without
        // scanning every notice due.
        let newly_busy = (std::mem::take(&mut self.transport_wanted) || !self.quiescing.is_empty())
            && !parked.busy;
        sooner
            || newly_busy
            || self.io.backlogged()
            || self.waiter.has_actions()
            || !self.posts.is_empty()
    }

    /// Requests queued for a driver that has ended: each fails with `Shutdown`.
    pub(super) fn refuse_all(&self, commands: Vec<Command>) {
        for command in commands {
            match command {
                Command::Push(request) | Command::Pull(PullRequest { push: request, .. }) => {
                    self.refuse(&request, Reason::Shutdown, "the consumer shut down".into());
                }
                _ => {}
            }
        }
    }

    /// The end of the driver thread: every request still waited for fails.
    pub(super) fn finish_run(&mut self) {
        self.closed = true;
        let now = self.clock.now();
        for (_, connecting) in std::mem::take(&mut self.connecting) {
            for (request, _) in connecting.queued {
                self.refuse(&request, Reason::Shutdown, "the consumer shut down".into());
            }
        }
        self.waiter.shutdown(now);
        self.actions();
        let keys: Vec<AttemptKey> = self.quiescing.keys().copied().collect();
        for key in keys {
            self.quiesced(key);
        }
        // Closed once what waits in them is sent, and forgotten: their peers' leave to attach
        // to this process ends with them.
        for (_, instance) in self.instances.drain() {
            for conn in instance.ranks.values() {
                self.posts.close_flushed(&conn.sender);
            }
        }
        // The driver closes the transport next, at shutdown, not whenever the engine drops
        // its handle.
    }

    pub(super) fn handle(&mut self, command: Command) {
        match command {
            Command::Push(request) => self.start(request, None),
            Command::Pull(request) => {
                // Where it reads from: the prefill's blocks, relayed by the router.
                let source = RequestBlocks {
                    blocks: request.producer_blocks,
                    groups: request.producer_groups,
                };
                self.start(request.push, Some(source));
            }
            Command::Cancel { transfer, attempt } => {
                let now = self.clock.now();
                self.waiter.cancel(now, transfer, attempt, Reason::Aborted);
                let gone = self.take_queued(|r| {
                    r.key.transfer == transfer && attempt.is_none_or(|a| a == r.key.attempt)
                });
                for (request, _) in gone {
                    self.refuse(
                        &request,
                        Reason::Aborted,
                        "cancelled while connecting".into(),
                    );
                }
            }
            Command::Abandon {
                prefill,
                transfer,
                capability,
            } => self.abandon(prefill, transfer, capability),
            Command::Handshaken(instance, rank, result) => {
                self.handshaken(instance, rank, result);
            }
            Command::Peer(addr, rank, conn, message, _queued) => {
                if self.is_current(addr, rank, conn) {
                    self.peer_message(addr, rank, message);
                }
            }
            Command::PeerClosed(addr, rank, conn, why) => {
                // The other ranks' readers report their closing too, after `instance_lost`
                // closed them: by then the instance may have been reconnected for a new
                // request, which their late reports must not fail.
                if self.is_current(addr, rank, conn) {
                    self.instance_lost(&addr, &why);
                }
            }
            Command::Wake | Command::Shutdown => {}
        }
    }
}
