//! Connections to prefill instances: handshakes (on helper threads), adopting each rank's
//! connection, the messages that come over it, heartbeats, losing an instance, and the first
//! contact of a writer's transport.

use super::*;

impl Machine {
    /// Whether `conn` is the live control connection to `rank` of `instance`.
    pub(super) fn is_current(&self, instance: SocketAddr, rank: Rank, conn: ConnId) -> bool {
        self.instances
            .get(&instance)
            .and_then(|i| i.ranks.get(&rank))
            .is_some_and(|c| c.id == conn)
    }

    /// Takes over a control connection whose handshake a helper thread finished: checks the
    /// producer's hello and starts the connection's reader.
    pub(super) fn adopt(
        &mut self,
        instance: SocketAddr,
        rank: Rank,
        dialled: Dialled,
    ) -> Result<(), LinkError> {
        let Dialled {
            sender,
            reader: stream,
            hello,
        } = dialled;
        let addr = crate::settings::rank_addr(instance, rank);
        if hello.role != Role::Producer {
            return Err(LinkError::NotAProducer { addr });
        }
        if hello.compat_hash != self.layout.spec().compat_hash() {
            return Err(LinkError::IncompatibleProducer {
                addr,
                theirs: Box::new(hello.layout.clone()),
                ours: Box::new(self.layout.spec().clone()),
            });
        }
        let (ours, theirs) = (
            control::transport_name(&self.hello),
            control::transport_name(&hello),
        );
        if ours != theirs {
            let name = |t: Option<String>| t.unwrap_or_else(|| "an unreadable transport".into());
            return Err(LinkError::TransportMismatch {
                addr,
                ours: name(ours),
                theirs: name(theirs),
            });
        }
        if hello.layout.tp_rank != rank.0 {
            return Err(LinkError::WrongRank {
                addr,
                said: hello.layout.tp_rank,
                expected: rank,
            });
        }
        let layout = Layout::new(hello.layout.clone())?;
        // A restarted rank closes its connection (the instance is then dropped and reconnected
        // with the new incarnation's hello), so a live connection's metadata is current.
        let tx = self.tx.clone();
        let id = self.next_conn;
        self.next_conn += 1;
        debug!(%addr, local = stream.is_local(), "connected to a producer rank");
        if stream.is_local() {
            self.stats.local_connections.fetch_add(1, Ordering::Relaxed);
        }
        let stream_process = stream.process();
        let failed = tx.clone();
        self.posts.spawn(
            format!("kvx-ctl-{addr}"),
            move || {
                control::read_loop(stream, |result| {
                    let command = match result {
                        Ok((m, queued)) => Command::Peer(instance, rank, id, m, queued),
                        Err(e) => Command::PeerClosed(instance, rank, id, e.to_string()),
                    };
                    tx.send(command).is_ok()
                });
            },
            move |source| {
                let why = LinkError::Reader { addr, source };
                let _ = failed.send(Command::PeerClosed(instance, rank, id, why.to_string()));
            },
        );
        // The instance is known once a rank of it is connected: a prefill that cannot be
        // reached leaves nothing behind.
        // Rank 0's hello says the instance's TP size, and with it which of its ranks are idle
        // for this engine (worked out once, not per request).
        let idle = (rank == Rank(0)).then(|| self.idle_of(layout.spec().tp_size));
        let entry = self.instances.entry(instance).or_insert_with(|| Instance {
            ranks: HashMap::new(),
            waiting: HashSet::new(),
            idle: Vec::new(),
        });
        if let Some(idle) = idle {
            entry.idle = idle;
        }
        entry.ranks.insert(
            rank,
            RankConn {
                id,
                sender,
                hello,
                layout,
                peer: None,
                in_contact: false,
                process: stream_process,
                // Granted before the registration that lets its writes (or this side's reads)
                // begin goes out.
                _leave: self
                    .peers_attach
                    .then(|| TracerLeave::grant(stream_process.map(|p| p.pid()))),
            },
        );
        let interval = self.config.heartbeat_interval;
        let now = self.clock.now();
        self.next_heartbeat.get_or_insert(now + interval);
        Ok(())
    }

    /// The ranks of `instance` still to connect before a request can be registered with it:
    /// rank 0 first (its hello says the instance's TP size), then every writer.
    pub(super) fn missing_ranks(&self, instance: SocketAddr) -> Result<Vec<Rank>, PlanError> {
        let Some(known) = self.instances.get(&instance) else {
            return Ok(vec![Rank(0)]);
        };
        let Some(first) = known.ranks.get(&Rank(0)) else {
            return Ok(vec![Rank(0)]);
        };
        let writers = writers_for(&self.layout, first.layout.spec().tp_size)?;
        Ok(writers
            .into_iter()
            .filter(|r| !known.ranks.contains_key(r))
            .collect())
    }

    /// What this engine's rank 0 tells the idle ranks of a producer of TP size `producer_tp`
    /// ([`Instance::idle`]); nothing on the other ranks, or where the TP sizes do not fit (its
    /// writers then refuse every request anyway).
    fn idle_of(&self, producer_tp: u32) -> Vec<Rank> {
        if self.layout.rank() != Rank(0) {
            return Vec::new();
        }
        kvx_layout::idle_producers(producer_tp, &self.layout).unwrap_or_default()
    }

    /// The producer ranks that write to this rank (every one connected).
    pub(super) fn writers(&self, instance: SocketAddr) -> Result<Vec<Rank>, PlanError> {
        let tp = self.instances[&instance].ranks[&Rank(0)]
            .layout
            .spec()
            .tp_size;
        writers_for(&self.layout, tp)
    }

    /// Handshakes with `rank` of `instance` on a helper thread (once at a time per rank); the
    /// result comes back as [`Command::Handshaken`].
    pub(super) fn handshake_in_background(&mut self, instance: SocketAddr, rank: Rank) {
        let connecting = self.connecting.entry(instance).or_default();
        if connecting.ranks.insert(rank) {
            self.spawn_handshake(instance, rank);
        }
    }

    /// Starts connecting idle `rank` of `instance` ([`Instance::idle`]) unless that is under
    /// way or failed less than [`RETRY_UNREACHABLE`] ago.
    pub(super) fn connect_idle(&mut self, instance: SocketAddr, rank: Rank) {
        let now = self.clock.now();
        match self.idle_links.get(&(instance, rank)) {
            Some(None) => return,
            Some(Some(failed)) if now < *failed + RETRY_UNREACHABLE => return,
            _ => {}
        }
        self.idle_links.insert((instance, rank), None);
        self.spawn_handshake(instance, rank);
    }

    /// Handshakes with `rank` of `instance` on a helper thread; the result (or why the thread
    /// could not start) comes back as [`Command::Handshaken`].
    fn spawn_handshake(&mut self, instance: SocketAddr, rank: Rank) {
        let addr = crate::settings::rank_addr(instance, rank);
        let hello = Message::Hello(self.hello.clone());
        let (timeout, local) = (self.config.connect_timeout, self.config.local_sockets);
        let key = self.config.auth_key.clone();
        let (tx, failed) = (self.tx.clone(), self.tx.clone());
        self.posts.spawn(
            format!("kvx-hs-{addr}"),
            move || {
                let result = control::handshake(addr, &hello, timeout, local, key.as_deref())
                    .and_then(|(stream, hello)| {
                        Dialled::new(stream, hello)
                            .map_err(|source| LinkError::Reader { addr, source })
                    });
                let _ = tx.send(Command::Handshaken(instance, rank, result));
            },
            move |source| {
                let why = LinkError::HandshakeThread { addr, source };
                let _ = failed.send(Command::Handshaken(instance, rank, Err(why)));
            },
        );
    }

    /// A handshake with an idle rank ended: adopted, or tried again later.
    fn idle_handshaken(
        &mut self,
        instance: SocketAddr,
        rank: Rank,
        result: Result<Dialled, LinkError>,
    ) {
        let adopted = if self.instances.contains_key(&instance) {
            result.and_then(|dialled| self.adopt(instance, rank, dialled))
        } else {
            // The instance was lost meanwhile: this connection is not wanted (it closes).
            Ok(())
        };
        let pending = self
            .idle_pending
            .remove(&(instance, rank))
            .unwrap_or_default();
        match adopted {
            Ok(()) => {
                self.idle_links.remove(&(instance, rank));
                let Some(conn) = self
                    .instances
                    .get(&instance)
                    .and_then(|i| i.ranks.get(&rank))
                else {
                    return;
                };
                for message in &pending {
                    self.posts.tell(&conn.sender, message);
                }
            }
            Err(why) => {
                debug!(%instance, %rank, %why, told = pending.len(), "an idle producer rank is unreachable: it holds requests until its lease");
                self.idle_links
                    .insert((instance, rank), Some(self.clock.now()));
            }
        }
    }

    /// A handshake ended: the connection is adopted, and once every writer of the instance is
    /// connected, the requests queued for it start; on failure they fail, and the instance is
    /// not tried again for [`RETRY_UNREACHABLE`].
    pub(super) fn handshaken(
        &mut self,
        instance: SocketAddr,
        rank: Rank,
        result: Result<Dialled, LinkError>,
    ) {
        if self.idle_links.get(&(instance, rank)) == Some(&None) {
            self.idle_handshaken(instance, rank, result);
            return;
        }
        let Some(connecting) = self.connecting.get_mut(&instance) else {
            // The instance failed meanwhile: this connection is not wanted (it closes).
            return;
        };
        connecting.ranks.remove(&rank);
        let next = result
            .and_then(|dialled| self.adopt(instance, rank, dialled))
            .and_then(|()| self.missing_ranks(instance).map_err(LinkError::from));
        match next {
            Ok(missing) if missing.is_empty() => {
                let connecting = self.connecting.remove(&instance).unwrap_or_default();
                self.tell_abandoned(instance, &connecting.abandons);
                for (request, pull) in connecting.queued {
                    self.begin(request, pull);
                }
            }
            Ok(missing) => {
                for rank in missing {
                    self.handshake_in_background(instance, rank);
                }
            }
            Err(why) => {
                let now = self.clock.now();
                let why = Arc::new(why);
                self.unreachable.insert(instance, (now, Arc::clone(&why)));
                let connecting = self.connecting.remove(&instance).unwrap_or_default();
                if !connecting.abandons.is_empty() {
                    debug!(%instance, %why, dropped = connecting.abandons.len(), "cannot tell an unreachable prefill about dropped transfers; its lease frees them");
                }
                for (request, _) in connecting.queued {
                    self.refuse(&request, Reason::PeerFailed, why.to_string());
                }
            }
        }
    }

    /// Connects the `missing` ranks of `instance` (a handshake already running is not started
    /// again) and returns what waits for them; `Err` with the reason while the instance counts
    /// as unreachable (for [`RETRY_UNREACHABLE`] after a failed connection).
    pub(super) fn connect_ranks(
        &mut self,
        instance: SocketAddr,
        missing: Vec<Rank>,
    ) -> Result<&mut Connecting, Arc<LinkError>> {
        if !self.connecting.contains_key(&instance) {
            if let Some((at, why)) = self.unreachable.get(&instance) {
                if self.clock.now() < *at + RETRY_UNREACHABLE {
                    return Err(Arc::clone(why));
                }
            }
            self.unreachable.remove(&instance);
        }
        for rank in missing {
            self.handshake_in_background(instance, rank);
        }
        Ok(self.connecting.entry(instance).or_default())
    }

    /// Takes the requests queued for a connection that `pick` selects out of their queues.
    pub(super) fn take_queued(
        &mut self,
        pick: impl Fn(&PushRequest) -> bool,
    ) -> Vec<(PushRequest, Option<RequestBlocks>)> {
        let mut taken = Vec::new();
        for connecting in self.connecting.values_mut() {
            let (out, kept) = std::mem::take(&mut connecting.queued)
                .into_iter()
                .partition(|(r, _)| pick(r));
            connecting.queued = kept;
            taken.extend(out);
        }
        taken
    }

    pub(super) fn peer_message(&mut self, instance: SocketAddr, rank: Rank, message: Message) {
        let now = self.clock.now();
        match message {
            Message::Finishing(f) if f.producer_rank == rank => {
                self.stats.finishing_hints.fetch_add(1, Ordering::Relaxed);
                let key = AttemptKey::new(f.transfer, f.attempt);
                let due: Vec<u64> = self
                    .notices
                    .iter()
                    .filter(|(_, (k, r))| *k == key && *r == rank)
                    .map(|(n, _)| *n)
                    .collect();
                debug!(%key, %rank, due = due.len(), "finishing");
                self.hinted.extend(due);
            }
            // Each producer rank speaks for itself only, on its own connection.
            Message::Failure(f) if f.rank == rank => {
                let key = AttemptKey::new(f.transfer, f.attempt);
                // Only the instance the request went to speaks for it.
                let owner = self
                    .quiescing
                    .get(&key)
                    .map(|q| q.instance)
                    .or_else(|| self.waiter.payload(key).map(|w| w.instance));
                if owner.is_some_and(|owner| owner != instance) {
                    warn!(%key, %instance, "a failure notice from an instance this request did not go to: ignored");
                    return;
                }
                debug!(%key, reason = ?f.reason, detail = f.detail, "producer reported failure");
                if let Some(q) = self.quiescing.get_mut(&key) {
                    q.ranks.remove(&f.rank);
                    if q.quiet() {
                        self.quiesced(key);
                    }
                    return;
                }
                // That rank is quiet: it sends a failure only once its writes have ended, and
                // its notice will not come.
                self.notices
                    .retain(|_, (k, rank)| !(*k == key && *rank == f.rank));
                if let Some(waiting) = self.waiter.payload_mut(key) {
                    if waiting.cause.is_none() && !f.detail.is_empty() {
                        waiting.cause = Some(format!("producer rank {}: {}", f.rank.0, f.detail));
                    }
                }
                self.waiter.failure(now, key, Reason::from_peer(f.reason));
            }
            Message::Held(h) if h.producer_rank == rank => {
                let key = AttemptKey::new(h.transfer, h.attempt);
                // Its read counts from now on; one that ended already counts now.
                if self.unheld.remove(&(key, rank)) == Some(true) {
                    self.waiter.completion(self.clock.now(), key, rank);
                }
            }
            Message::Hello(_) | Message::Heartbeat(_) => {}
            _ => warn!(%instance, "unexpected message from a producer"),
        }
    }

    pub(super) fn instance_lost(&mut self, instance: &SocketAddr, why: &str) {
        let Some(lost) = self.instances.remove(instance) else {
            return;
        };
        warn!(%instance, why, "prefill instance lost");
        // Its ranks can confirm nothing more. Where a rank's process is known to have exited
        // (it ran on this host), none of its writes can land any more; otherwise (another host,
        // or a process that lives on: a network fault, a connection it closed) its posted
        // writes may still land, so the requests waiting on it hold their blocks until its
        // process is seen gone or the bound its writes run for has passed. This side's own
        // reads from it are waited for too: they land until they end or fail.
        let ranks: HashMap<Rank, LostRank> = lost
            .ranks
            .iter()
            .map(|(rank, conn)| {
                let lost = LostRank {
                    process: conn.process,
                    gone: conn.process.is_some_and(|p| p.exited()),
                    write_timeout: Duration::from_millis(conn.hello.write_timeout_ms.into()),
                };
                (*rank, lost)
            })
            .collect();
        let mut quiet = Vec::new();
        for (key, q) in &mut self.quiescing {
            if q.instance != *instance {
                continue;
            }
            let already = &mut q.lost;
            q.ranks.retain(|rank| {
                if already.contains_key(rank) {
                    return true;
                }
                match ranks.get(rank) {
                    Some(l) if !l.gone => {
                        already.insert(*rank, l.process);
                        true
                    }
                    _ => false,
                }
            });
            if q.quiet() {
                quiet.push(*key);
            }
        }
        for key in quiet {
            self.quiesced(key);
        }
        let now = self.clock.now();
        for key in lost.waiting {
            self.waiter.failure(now, key, Reason::PeerFailed);
        }
        // The requests that waited on it fail now, while what is known of its ranks is at hand.
        self.lost_ranks.insert(*instance, ranks);
        self.actions();
        self.lost_ranks.remove(instance);
        self.next_lost_look.get_or_insert(now + LOST_LOOK);
        for conn in lost.ranks.values() {
            self.posts.close(&conn.sender);
            // Its endpoint (connected for pull) is forgotten once its reads in flight end.
            if let Some(peer) = conn.peer {
                self.posts.disconnect(peer);
            }
        }
    }

    /// Failed requests waiting on ranks of lost connections: those whose process is seen to
    /// have exited write no more.
    pub(super) fn look_at_lost(&mut self, now: Timestamp) {
        if self.next_lost_look.is_none_or(|at| now < at) {
            return;
        }
        let mut exited: HashMap<Process, bool> = HashMap::new();
        let mut quiet = Vec::new();
        let mut watching = false;
        for (key, q) in &mut self.quiescing {
            let (ranks, lost) = (&mut q.ranks, &mut q.lost);
            lost.retain(|rank, process| {
                if !ranks.contains(rank) {
                    return false;
                }
                let Some(process) = process else {
                    return true;
                };
                if *exited.entry(*process).or_insert_with(|| process.exited()) {
                    debug!(%rank, pid = process.pid(), "a lost producer rank's process has exited");
                    ranks.remove(rank);
                    return false;
                }
                watching = true;
                true
            });
            if q.quiet() {
                quiet.push(*key);
            }
        }
        for key in quiet {
            self.quiesced(key);
        }
        self.next_lost_look = watching.then_some(now + LOST_LOOK);
    }

    pub(super) fn heartbeats(&mut self, now: Timestamp) {
        let Some(at) = self.next_heartbeat else {
            return;
        };
        if now < at {
            return;
        }
        // On every connection, naming the transfers that wait there: with none, it still tells
        // the producer rank that this decode is alive, so that its idle timeout
        // (`ConnectorConfig::idle_timeout`) keeps the connection for the next request.
        for instance in self.instances.values() {
            let message = Message::Heartbeat(Heartbeat {
                engine: self.config.engine,
                incarnation: self.config.incarnation,
                transfers: instance.waiting.iter().map(|k| k.transfer).collect(),
            });
            for conn in instance.ranks.values() {
                self.posts.tell(&conn.sender, &message);
            }
        }
        self.next_heartbeat =
            (!self.instances.is_empty()).then(|| now + self.config.heartbeat_interval);
    }

    /// Writer ranks whose first board notice has landed are in contact: their later writes need
    /// nothing from this side. Notices of requests that ended otherwise stop counting.
    pub(super) fn first_contacts(&mut self) {
        let Some(slots) = &self.board else {
            return;
        };
        if self.awaiting_contact.is_empty() {
            return;
        }
        let now = self.clock.now();
        if now >= self.contact.1 {
            let every = (self.contact.0 * 2).min(MAX_CONTACT_POLL);
            self.contact = (every, now + every);
        }
        let landed: Vec<(SocketAddr, Rank)> = self
            .awaiting_contact
            .iter()
            .filter(|(n, _)| slots.shared.arrived(**n))
            .map(|(_, who)| *who)
            .collect();
        for (instance, rank) in &landed {
            if let Some(conn) = self
                .instances
                .get_mut(instance)
                .and_then(|i| i.ranks.get_mut(rank))
            {
                debug!(%instance, %rank, "writer rank in contact");
                conn.in_contact = true;
            }
        }
        let notices = &self.notices;
        self.awaiting_contact
            .retain(|n, who| notices.contains_key(n) && !landed.contains(who));
    }
}
