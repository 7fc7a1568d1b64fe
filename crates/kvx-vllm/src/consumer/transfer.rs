//! Starting a request's transfer: refusals, registering destinations with every writer rank (push)
//! or reading the blocks (pull), the transport's events, and the re-layout after the last notice.

use super::*;

/// Why this decode may not connect to a prefill instance for a transfer (a request's failure
/// detail, with [`Reason::Unauthorized`]).
#[derive(Debug, thiserror::Error)]
pub(super) enum Unreachable {
    /// The instance is not on the `peers` list.
    #[error("prefill {prefill} is not on this decode's peers list")]
    NotAPeer { prefill: SocketAddr },
    /// The router's capability does not verify for this engine and instance.
    #[error("refused before connecting to prefill {prefill}: {source}")]
    Capability {
        prefill: SocketAddr,
        source: crate::CapabilityError,
    },
}

impl Machine {
    pub(super) fn start(&mut self, request: PushRequest, pull: Option<RequestBlocks>) {
        if let Err(detail) = self.may_reach(
            request.prefill,
            request.key.transfer,
            request.capability.as_ref(),
        ) {
            self.stats.unauthorized.fetch_add(1, Ordering::Relaxed);
            self.refuse(&request, Reason::Unauthorized, detail.to_string());
            return;
        }
        if let Some((reason, detail)) = self.refusal(request.key) {
            self.refuse(&request, reason, detail);
            return;
        }
        // An older attempt of the transfer still queued is superseded, as a waited one is.
        let key = request.key;
        let older = self.take_queued(|r| r.key.transfer == key.transfer);
        for (old, _) in older {
            self.refuse(
                &old,
                Reason::Superseded,
                format!("attempt {} replaces it", key.attempt.0),
            );
        }
        let instance = request.prefill;
        let missing = match self.missing_ranks(instance) {
            Ok(missing) if missing.is_empty() => {
                self.begin(request, pull);
                return;
            }
            Ok(missing) => missing,
            Err(detail) => {
                self.refuse(&request, Reason::PeerFailed, detail.to_string());
                return;
            }
        };
        match self.connect_ranks(instance, missing) {
            Ok(connecting) => connecting.queued.push((request, pull)),
            Err(detail) => self.refuse(&request, Reason::PeerFailed, detail.to_string()),
        }
    }

    /// Registers (push) or reads (pull) a request whose prefill instance is connected.
    pub(super) fn begin(&mut self, request: PushRequest, pull: Option<RequestBlocks>) {
        if let Err(detail) = self.try_start(&request, pull) {
            self.refuse(&request, Reason::PeerFailed, detail.to_string());
        }
    }

    /// Whether this side may connect to the prefill instance at `prefill` for `transfer`: it is
    /// on the `peers` list (if there is one) and, with a deployment key, `capability` verifies
    /// for this engine and names that instance. Checked before any connection is made.
    pub(super) fn may_reach(
        &self,
        prefill: SocketAddr,
        transfer: TransferId,
        capability: Option<&Capability>,
    ) -> Result<(), Unreachable> {
        if !self.config.peers.allows(prefill) {
            return Err(Unreachable::NotAPeer { prefill });
        }
        if let Some(key) = &self.config.auth_key {
            key.check_before_connecting(
                transfer,
                capability,
                self.config.engine,
                prefill,
                self.clock.wall(),
            )
            .map_err(|source| Unreachable::Capability { prefill, source })?;
        }
        Ok(())
    }

    /// The request fails before anything was registered for it.
    pub(super) fn refuse(&self, request: &PushRequest, reason: Reason, detail: String) {
        warn!(key = %request.key, detail, "request cannot be served");
        let span = crate::trace::request_span(
            "kvx.receive",
            request.trace,
            request.key.transfer,
            self.layout.rank(),
        );
        tracing::info!(target: crate::trace::TARGET, parent: &span, %reason, detail, "failed");
        self.push_event(RecvEvent::Failed {
            key: request.key,
            request: request.request,
            reason,
            detail,
        });
    }

    /// Why `key` cannot be waited for, if it cannot: checked before anything is sent, since a
    /// second wait for an attempt would share the first one's notices and release.
    pub(super) fn refusal(&self, key: AttemptKey) -> Option<(Reason, String)> {
        if let Some(waited) = self.waiter.attempt_of(key.transfer) {
            if key.attempt == waited {
                return Some((
                    Reason::Duplicate,
                    "this attempt is already waited for".into(),
                ));
            }
            if key.attempt < waited {
                return Some((
                    Reason::Stale,
                    format!("attempt {} of this transfer is waited for", waited.0),
                ));
            }
        }
        // A queued request counts as waited for; a newer attempt replaces it (see `start`).
        let queued = self
            .connecting
            .values()
            .flat_map(|c| &c.queued)
            .find(|(r, _)| r.key.transfer == key.transfer && r.key.attempt >= key.attempt);
        if let Some((r, _)) = queued {
            return Some(if r.key.attempt == key.attempt {
                (
                    Reason::Duplicate,
                    "this attempt is already waited for".into(),
                )
            } else {
                (
                    Reason::Stale,
                    format!(
                        "attempt {} of this transfer waits for its prefill's connection",
                        r.key.attempt.0
                    ),
                )
            });
        }
        self.quiescing.contains_key(&key).then(|| {
            (
                Reason::Duplicate,
                "this attempt failed and its blocks are still being released".into(),
            )
        })
    }

    pub(super) fn try_start(
        &mut self,
        request: &PushRequest,
        source: Option<RequestBlocks>,
    ) -> Result<(), TransferError> {
        let now = self.clock.now();
        let key = request.key;
        let instance = request.prefill;
        let num_tokens =
            u32::try_from(request.num_tokens).map_err(|_| TransferError::TooManyTokens)?;
        let skip_tokens =
            u32::try_from(request.skip_tokens).map_err(|_| TransferError::TooManyTokens)?;
        let writers = self.writers(instance)?;
        let any_producer = self.instances[&instance].ranks[&writers[0]].layout.clone();
        let permute = permute_for(
            &any_producer,
            &self.layout,
            request.num_tokens,
            request.skip_tokens,
            &request.blocks,
            &request.groups,
        )?;
        if permute.is_some() && !self.can_permute() {
            return Err(TransferError::CannotReLayout);
        }
        let pull = source.is_some();
        let mut waiting = Waiting {
            cause: None,
            request: request.request,
            registered: now,
            instance,
            writers: writers.clone(),
            notices: Vec::new(),
            permute,
            pull,
            capability: request.capability.clone(),
            span: crate::trace::request_span(
                "kvx.receive",
                request.trace,
                key.transfer,
                self.layout.rank(),
            ),
        };
        let lease = self.config.registration_lease;
        // Prefill keeps a registration for a few heartbeats at a time: one whose decode went
        // silent (a driver stuck, a peer that answers TCP but no longer this protocol) goes
        // long before decode's own lease would end.
        let producer_lease = lease.min(self.config.heartbeat_interval * HEARTBEATS_PER_LEASE);
        if let Some(source) = source {
            if let Err(detail) = self.post_reads(request, &source, &writers) {
                if !self.reads.values().any(|(k, _)| *k == key) {
                    return Err(detail);
                }
                // Reads from other ranks are in flight into the request's blocks: the failure
                // waits for them like any other, so that the engine cannot reuse the blocks
                // under them.
                warn!(%key, %detail, "request cannot be served");
                self.give_up(key, waiting, Reason::PeerFailed);
                return Ok(());
            }
        } else {
            // Board notices where the request needs nothing done once its KV is in (no
            // re-layout) and the board has room; message notices otherwise.
            let on_board = match (&mut self.board, &waiting.permute) {
                (Some(slots), None) => slots.take(now, writers.len()),
                _ => None,
            };
            if let (Some(notices), Some(slots)) = (&on_board, &self.board) {
                slots.shared.arm(
                    key,
                    request.request,
                    writers.clone(),
                    notices,
                    waiting.span.clone(),
                );
            }
            for (index, &rank) in writers.iter().enumerate() {
                let notice = if let Some(notices) = &on_board {
                    notices[index]
                } else {
                    self.fresh_notice()
                };
                self.notices.insert(notice, (key, rank));
                let conn = &self.instances[&instance].ranks[&rank];
                if on_board.is_none() {
                    self.transport_wanted = true;
                } else if self.occasional_reads && !conn.in_contact {
                    if self.awaiting_contact.is_empty() {
                        self.contact = (BOARD_POLL, now + BOARD_POLL);
                    }
                    self.awaiting_contact.insert(notice, (instance, rank));
                }
                waiting.notices.push(notice);
                let registration = Message::Registration(Registration {
                    transfer: key.transfer,
                    attempt: key.attempt,
                    request: request.request,
                    consumer: self.config.engine,
                    consumer_incarnation: self.config.incarnation,
                    consumer_rank: self.layout.rank(),
                    num_tokens,
                    skip_tokens,
                    lease_ms: u32::try_from(producer_lease.as_millis()).unwrap_or(u32::MAX),
                    notice,
                    blocks: request.blocks.clone(),
                    groups: request.groups.clone(),
                    capability: request.capability.clone(),
                });
                // Sent once this input is handled, never blocking (the engine thread may be
                // the caller): a full send buffer leaves it for the driver's flush; a
                // connection that fails is lost, and the request with it.
                let sent = self.posts.send(&conn.sender, &registration);
                if let Err(source) = sent.map_err(crate::control::ControlError::from) {
                    let detail = TransferError::Register { rank, source };
                    self.notices.remove(&notice);
                    waiting.notices.pop();
                    // The notices of the ranks not registered with are never written.
                    if let (Some(notices), Some(slots)) = (&on_board, &mut self.board) {
                        slots.give_back(now, &notices[index..], |_| true);
                    }
                    if index == 0 {
                        if let Some(slots) = &self.board {
                            let _ = slots.shared.disarm(key);
                        }
                        return Err(detail);
                    }
                    // The ranks registered already may write (early): they are told to stop,
                    // and the failure waits for them like any other.
                    warn!(%key, %detail, "request cannot be served");
                    waiting.writers.truncate(index);
                    self.claim(key, &waiting);
                    self.give_up(key, waiting, Reason::PeerFailed);
                    return Ok(());
                }
            }
        }
        self.tell_idle(instance, key, request.capability.as_ref());
        self.instances
            .get_mut(&instance)
            .expect("connected")
            .waiting
            .insert(key);
        self.stats.held.fetch_add(1, Ordering::Relaxed);
        debug!(%key, writers = writers.len(), pull, "registered");
        tracing::info!(
            target: crate::trace::TARGET,
            parent: &waiting.span,
            writers = writers.len(),
            pull,
            "{}",
            if pull { "reads posted" } else { "registered" }
        );
        self.waiter.expect(now, key, writers, lease, waiting);
        if self.next_heartbeat.is_none() {
            self.next_heartbeat = Some(now + self.config.heartbeat_interval);
        }
        Ok(())
    }

    /// Tells the idle ranks of `instance` ([`Instance::idle`]) that this engine needs nothing of
    /// them for `key`: a completion, which gives their blocks back (delivered) now or once the
    /// request finishes there.
    fn tell_idle(
        &mut self,
        instance: SocketAddr,
        key: AttemptKey,
        capability: Option<&Capability>,
    ) {
        let idle = self.instances[&instance].idle.clone();
        for rank in idle {
            let message = Message::Completion(Completion {
                transfer: key.transfer,
                attempt: key.attempt,
                producer: self.config.engine,
                producer_rank: rank,
                bytes: 0,
                capability: capability.cloned(),
            });
            let Some(conn) = self.instances[&instance].ranks.get(&rank) else {
                // Told once connected (a rank that cannot be reached holds until its lease).
                self.connect_idle(instance, rank);
                if self.idle_links.get(&(instance, rank)) == Some(&None) {
                    let pending = self.idle_pending.entry((instance, rank)).or_default();
                    if pending.len() < self.config.max_entries {
                        pending.push(message);
                    }
                }
                continue;
            };
            // Never blocks (the engine thread may be the caller); a rank that is gone holds
            // nothing past its lease.
            self.posts.tell(&conn.sender, &message);
        }
    }

    pub(super) fn post_reads(
        &mut self,
        request: &PushRequest,
        source: &RequestBlocks,
        writers: &[Rank],
    ) -> Result<(), TransferError> {
        let instance = request.prefill;
        let mut layouts = Vec::new();
        for &rank in writers {
            let conn = self
                .instances
                .get_mut(&instance)
                .and_then(|i| i.ranks.get_mut(&rank))
                .ok_or(TransferError::NotConnected)?;
            if conn.peer.is_none() {
                let desc = control::peer_desc(&conn.hello).ok_or(LinkError::EndpointDesc)?;
                // Connected by the driver after this input: reads from an endpoint it cannot
                // connect to are refused then.
                conn.peer = Some(self.posts.connect(desc));
            }
            layouts.push(conn.layout.clone());
        }
        let planned = plan(&PlanRequest {
            producers: &layouts,
            consumer: &self.layout,
            num_tokens: request.num_tokens,
            skip_tokens: request.skip_tokens,
            producer_blocks: &source.blocks,
            consumer_blocks: &request.blocks,
            only_producer: None,
            producer_groups: &source.groups,
            consumer_groups: &request.groups,
        })?;
        for &rank in writers {
            let peer = self.instances[&instance].ranks[&rank]
                .peer
                .expect("connected above");
            let op = self.posts.read(peer, planned.ops_for(rank).to_vec());
            self.reads.insert(op, (request.key, rank));
            // The rank holds the blocks for this read, or says that it no longer does.
            let claim = Message::Claim(Claim {
                transfer: request.key.transfer,
                attempt: request.key.attempt,
                capability: request.capability.clone(),
            });
            let conn = &self.instances[&instance].ranks[&rank];
            self.posts.tell(&conn.sender, &claim);
            // (A connection that fails is lost, and the request with it.)
            self.unheld.insert((request.key, rank), false);
            self.stats.ops_posted.fetch_add(1, Ordering::Relaxed);
            self.stats.bytes_written.fetch_add(
                planned
                    .ops_for(rank)
                    .iter()
                    .map(kvx_layout::CopyOp::bytes)
                    .sum(),
                Ordering::Relaxed,
            );
        }
        Ok(())
    }

    /// A message notice for one writer of a request: random (a producer that sees its own
    /// notices learns nothing of the others', which it could otherwise announce as written),
    /// non-zero, within 32 bits (what every backend carries, and clear of the board notices'
    /// tag bit), and unlike every notice waited for now.
    fn fresh_notice(&self) -> u64 {
        loop {
            let mut bytes = [0; 4];
            // Without the system's generator (it does not fail on Linux), the clock's low bits.
            if getrandom::fill(&mut bytes).is_err() {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.subsec_nanos());
                bytes = nanos.to_le_bytes();
            }
            let notice = u64::from(u32::from_le_bytes(bytes));
            if notice != 0 && !self.notices.contains_key(&notice) {
                return notice;
            }
        }
    }

    pub(super) fn on_event(&mut self, event: Event) {
        let now = self.clock.now();
        match event {
            Event::Notice(notice) => {
                let armed = self.notices.get(&notice.0).is_some_and(|(key, _)| {
                    self.board
                        .as_ref()
                        .is_some_and(|b| b.shared.seen_elsewhere(*key, notice.0))
                });
                if armed {
                    // The engine thread reports it with the request's other notices.
                    self.board_notices_as_messages = true;
                    return;
                }
                if let Some((key, rank)) = self.notices.remove(&notice.0) {
                    if let Some(q) = self.quiescing.get_mut(&key) {
                        q.ranks.remove(&rank);
                        if q.quiet() {
                            self.quiesced(key);
                        }
                        return;
                    }
                    debug!(%key, %rank, "notice");
                    self.waiter.completion(now, key, rank);
                } else {
                    debug!(
                        notice = notice.0,
                        "notice for nothing waited (late or stale)"
                    );
                }
            }
            Event::ReadDone { op, .. } => self.read_ended(op, None),
            Event::Failed { op, error, .. } => self.read_ended(op, Some(error.to_string())),
            _ => {}
        }
    }

    /// Read `op` ended: all of it landed, or it failed for `failure`.
    fn read_ended(&mut self, op: OpId, failure: Option<String>) {
        let Some((key, rank)) = self.reads.remove(&op) else {
            return;
        };
        if let Some(q) = self.quiescing.get_mut(&key) {
            q.reads -= 1;
            if q.quiet() {
                self.quiesced(key);
            }
            return;
        }
        let now = self.clock.now();
        match failure {
            None => match self.unheld.get_mut(&(key, rank)) {
                // Counted once the rank says it held the blocks.
                Some(read) => *read = true,
                None => {
                    self.waiter.completion(now, key, rank);
                }
            },
            Some(error) => {
                warn!(%key, %error, "read failed");
                self.waiter.failure(now, key, Reason::TransferFailed);
            }
        }
    }

    /// The transport did not accept read `op`: it ends as one that failed in flight does.
    pub(super) fn not_posted(&mut self, op: OpId, error: PostError) {
        let Some(&(_, rank)) = self.reads.get(&op) else {
            return;
        };
        let why = TransferError::Read {
            rank,
            source: error,
        };
        self.read_ended(op, Some(why.to_string()));
    }

    /// The driver could not connect to the endpoint of the prefill ranks it named `peer`: they
    /// are connected again for their next reads.
    pub(super) fn endpoint_unreachable(&mut self, peer: PeerId, error: &PostError) {
        for (addr, instance) in &mut self.instances {
            for (rank, conn) in &mut instance.ranks {
                if conn.peer == Some(peer) {
                    warn!(%addr, %rank, %error, "cannot connect to a prefill rank's endpoint");
                    conn.peer = None;
                }
            }
        }
    }

    /// Takes over what the engine thread found ready in the board: the waiter hears of every
    /// writer's notice, and the request's end is then not reported again.
    pub(super) fn absorb_engine_ready(&mut self) {
        let Some(slots) = &self.board else {
            return;
        };
        let ready = slots.shared.take_ready();
        if ready.is_empty() {
            return;
        }
        let now = self.clock.now();
        for (key, ranks) in ready {
            self.engine_ready.insert(key);
            for rank in ranks {
                self.waiter.completion(now, key, rank);
            }
        }
    }

    /// Whether the cache's memory can be re-laid-out here: host memory on the CPU, CUDA memory
    /// with the layout kernels.
    pub(super) fn can_permute(&self) -> bool {
        self.regions.iter().all(|r| {
            r.kind() == kvx_core::MemoryKind::Host
                || (cfg!(feature = "cuda") && matches!(r.kind(), kvx_core::MemoryKind::Cuda { .. }))
        })
    }

    /// Re-lays-out a finished request's chunks in place: with the GPU kernels for a CUDA cache
    /// (waiting until they ran), with [`Permute::apply`](kvx_layout::Permute::apply) for host
    /// memory.
    pub(super) fn apply_permute(&mut self, permute: &PermutePlan) -> Result<(), TransferError> {
        #[cfg(feature = "cuda")]
        if let Some(kvx_core::MemoryKind::Cuda { device }) = self.regions.first().map(|r| r.kind())
        {
            if self.kernels.is_none() {
                let gpu = kvx_rdma::cuda::Gpu::open(device)?;
                self.kernels = Some(kvx_rdma::cuda::kernels::LayoutKernels::new(&gpu)?);
            }
            let regions = &self.regions;
            let lookup = |i: u32| regions.get(i as usize).map(|r| (r.addr() as u64, r.len()));
            let Some(kernels) = self.kernels.as_mut() else {
                return Err(TransferError::NoKernels);
            };
            // SAFETY: the regions are the engine's CUDA KV cache, registered as valid device
            // memory for the connector's life (`LocalRegion`'s contract); every writer of these
            // chunks has finished and the engine does not touch them before the request is
            // reported ready, after the kernels have run (synchronised below).
            unsafe { kernels.permute(&permute.chunks, &lookup) }?;
            return Ok(kernels.synchronize()?);
        }
        let mut scratch = Vec::new();
        for p in &permute.chunks {
            let Some(region) = self.regions.get(p.region as usize) else {
                continue;
            };
            let len = p.chunk_bytes();
            if p.offset + len > region.len() {
                continue;
            }
            // SAFETY: the region was registered from memory valid for reads and writes while the
            // connector runs (`LocalRegion`'s contract), it is host memory (checked when the
            // request started), and this chunk belongs to a request whose every writer has
            // finished: no transport writes it and the engine does not read it until the request
            // is reported ready, after this returns. The slice covers only this chunk.
            let chunk = unsafe {
                std::slice::from_raw_parts_mut(
                    (region.addr() + p.offset as usize) as *mut u8,
                    len as usize,
                )
            };
            p.apply(chunk, &mut scratch);
        }
        Ok(())
    }

    pub(super) fn push_event(&self, event: RecvEvent) {
        if let RecvEvent::Failed { reason, .. } = &event {
            self.stats.failed(*reason);
        }
        self.events.push((event, SystemTime::now()));
    }
}
