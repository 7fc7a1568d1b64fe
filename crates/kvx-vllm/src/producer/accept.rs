//! The control listeners: accepting connections (bounded), reading each one's hello on its own
//! thread, and checking a consumer's layout and registrations.

use super::*;

/// Most control connections a producer rank serves at once (each has a reader thread): decode
/// ranks connect once each, so this is far above any deployment's need, and a peer that opens
/// connections without end cannot exhaust the process's threads.
const MAX_CONTROL_CONNECTIONS: usize = 1024;

/// Most control connections whose hello has not arrived yet: past it, the oldest such
/// connection is dropped for each new one. A decode's hello follows its connect at once, so a
/// real peer waits here for milliseconds, while a peer that opens connections and sends
/// nothing (or trickles) only ever pushes out its own older ones and cannot crowd out real
/// decodes.
pub const MAX_WAITING_HANDSHAKES: usize = 64;

/// What accepts control connections, on the TCP listener and on the local one: both count
/// against one limit and number their connections from one counter.
#[derive(Clone)]
pub(super) struct Acceptor {
    pub(super) tx: CommandSender<Command>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) hello: Message,
    /// The transport's peers copy by cross-memory attach: each consumer gets leave to attach
    /// to this process ([`TracerLeave`]) before it has this side's hello.
    pub(super) peers_attach: bool,
    pub(super) handshake_timeout: Duration,
    pub(super) next: Arc<AtomicU64>,
    pub(super) open: Arc<AtomicUsize>,
    pub(super) waiting: Arc<Handshakes>,
    pub(super) stats: Arc<Stats>,
    /// The deployment key every connection must prove it holds.
    pub(super) auth_key: Option<Arc<crate::AuthKey>>,
    /// When each peer's failed authentication was last warned about.
    pub(super) refused: Arc<Refused>,
}

/// How often one peer's failed authentications are warned about, at most.
const REFUSED_WARNING_EVERY: Duration = Duration::from_secs(60);

/// The peers whose authentication failed, and when that was last said (a warning per peer and
/// minute: a peer that retries in a loop does not flood the log).
#[derive(Default)]
pub(super) struct Refused(std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>);

impl Refused {
    /// Whether a failure of `peer` now is to be warned about.
    fn warn_now(&self, peer: &str) -> bool {
        let mut seen = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = std::time::Instant::now();
        // Bounded: forget peers not seen for a while once the table grows.
        if seen.len() > 4096 {
            seen.retain(|_, at| now.duration_since(*at) < REFUSED_WARNING_EVERY);
        }
        match seen.get(peer) {
            Some(at) if now.duration_since(*at) < REFUSED_WARNING_EVERY => false,
            _ => {
                seen.insert(peer.to_owned(), now);
                true
            }
        }
    }
}

/// The connections whose hello has not arrived yet, oldest first (see
/// [`MAX_WAITING_HANDSHAKES`]).
#[derive(Default)]
pub(super) struct Handshakes(std::sync::Mutex<std::collections::VecDeque<(ConnId, ControlStream)>>);

impl Handshakes {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::VecDeque<(ConnId, ControlStream)>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds `conn` (a handle of its stream), dropping the oldest waiting connections past the
    /// limit; returns how many were dropped.
    fn admit(&self, conn: ConnId, stream: &ControlStream) -> u64 {
        let Ok(handle) = stream.try_clone() else {
            return 0;
        };
        let mut waiting = self.lock();
        waiting.push_back((conn, handle));
        let mut evicted = 0;
        while waiting.len() > MAX_WAITING_HANDSHAKES {
            if let Some((old, stream)) = waiting.pop_front() {
                debug!(
                    conn = old,
                    "dropping a control connection that sent no hello yet"
                );
                let _ = stream.shutdown(std::net::Shutdown::Both);
                evicted += 1;
            }
        }
        evicted
    }

    /// `conn`'s handshake ended (either way).
    fn done(&self, conn: ConnId) {
        self.lock().retain(|(c, _)| *c != conn);
    }
}

impl Acceptor {
    /// Accepts on `listener` on a thread of its own: `serve` runs [`Acceptor::run`] over its
    /// connections.
    pub(super) fn spawn<L: Send + 'static>(
        self,
        name: String,
        listener: L,
        serve: fn(&Self, &L),
    ) -> Result<JoinHandle<()>, StartError> {
        thread::Builder::new()
            .name(name)
            .spawn(move || serve(&self, &listener))
            .map_err(StartError::Thread)
    }

    pub(super) fn run(&self, incoming: impl Iterator<Item = std::io::Result<ControlStream>>) {
        for stream in incoming {
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    continue;
                }
            };
            let Some(slot) = ConnectionSlot::take(&self.open, MAX_CONTROL_CONNECTIONS) else {
                warn!(
                    limit = MAX_CONTROL_CONNECTIONS,
                    "too many control connections: refusing a new one"
                );
                let _ = stream.shutdown(std::net::Shutdown::Both);
                continue;
            };
            let conn = self.next.fetch_add(1, Ordering::Relaxed);
            let evicted = self.waiting.admit(conn, &stream);
            if evicted > 0 {
                self.stats
                    .handshakes_evicted
                    .fetch_add(evicted, Ordering::Relaxed);
            }
            let acceptor = self.clone();
            let spawned = thread::Builder::new()
                .name(format!("kvx-ctl-{conn}"))
                .spawn(move || {
                    let _slot = slot;
                    acceptor.serve_connection(conn, stream);
                });
            if let Err(e) = spawned {
                warn!(error = %e, "cannot start a control connection thread");
            }
        }
    }
}

/// One of a bounded number of open control connections, given back on drop.
struct ConnectionSlot(Arc<AtomicUsize>);

impl ConnectionSlot {
    fn take(open: &Arc<AtomicUsize>, limit: usize) -> Option<Self> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < limit).then_some(n + 1)
        })
        .ok()
        .map(|_| Self(Arc::clone(open)))
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Acceptor {
    /// Answers the consumer's hello on the connection's own thread (so a busy driver never
    /// delays a handshake), then forwards every later message to the driver. The whole hello
    /// must arrive within the handshake timeout. A hello of another protocol version is
    /// answered with this side's (so the peer's error names both versions) and refused, with a
    /// warning naming both.
    fn serve_connection(&self, conn: ConnId, mut stream: ControlStream) {
        let deadline = std::time::Instant::now() + self.handshake_timeout;
        type Handshaken = (ControlSender, Hello, Option<TracerLeave>);
        let handshake = (|| -> Result<Handshaken, LinkError> {
            if let Some(key) = &self.auth_key {
                // Nothing is sent before the peer proved it holds the key.
                stream
                    .set_read_timeout(Some(self.handshake_timeout))
                    .and_then(|()| stream.set_write_timeout(Some(self.handshake_timeout)))
                    .map_err(LinkError::Timeouts)?;
                stream
                    .authenticate(key, false)
                    .map_err(LinkError::Unauthenticated)?;
                stream
                    .set_write_timeout(None)
                    .map_err(LinkError::Timeouts)?;
            }
            let theirs = match control::read_message_before(&mut stream, deadline) {
                Ok(Message::Hello(h)) => h,
                Ok(_) => return Err(LinkError::FirstNotHello),
                Err(
                    e @ ControlError::Decode(kvx_core::wire::DecodeError::UnsupportedVersion {
                        ..
                    }),
                ) => {
                    warn!(conn, error = %e, "a peer speaks another kvx protocol version");
                    let _ = control::sender(&stream).map(|s| s.send(&self.hello));
                    return Err(e.into());
                }
                Err(e) => return Err(e.into()),
            };
            let sender = control::sender(&stream).map_err(LinkError::Timeouts)?;
            // A consumer may read (pull) once it has this side's hello: it has leave to attach
            // to this process before, where the transport copies by cross-memory attach.
            let leave = (theirs.role == Role::Consumer && self.peers_attach)
                .then(|| TracerLeave::grant(stream.process().map(|p| p.pid())));
            sender.send(&self.hello)?;
            stream.set_read_timeout(None).map_err(LinkError::Timeouts)?;
            Ok((sender, theirs, leave))
        })();
        self.waiting.done(conn);
        let (sender, theirs, leave) = match handshake {
            Ok(h) => h,
            Err(why @ LinkError::Unauthenticated(_)) => {
                let peer = stream.peer();
                if self.refused.warn_now(&peer) {
                    warn!(conn, %peer, %why, "kvx: refused a control connection");
                } else {
                    debug!(conn, %peer, %why, "kvx: refused a control connection");
                }
                self.stats.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                let _ = stream.shutdown(std::net::Shutdown::Both);
                return;
            }
            Err(why) => {
                debug!(conn, %why, "handshake failed");
                self.stats.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                let _ = stream.shutdown(std::net::Shutdown::Both);
                return;
            }
        };
        let tx = &self.tx;
        if tx
            .send(Command::Accepted(conn, sender, Box::new(theirs), leave))
            .is_err()
        {
            return;
        }
        control::read_loop(stream, |result| {
            let command = match result {
                Ok((message, queued)) => Command::Peer(conn, message, queued),
                Err(e) => Command::PeerClosed(conn, e.to_string()),
            };
            tx.send(command).is_ok()
        });
    }
}

pub(super) fn accept_consumer(
    own: &Layout,
    hello: &Hello,
    posts: &mut Posts,
) -> Result<ConsumerRank, LinkError> {
    if hello.role != Role::Consumer {
        return Err(LinkError::NotAConsumer);
    }
    if hello.compat_hash != own.spec().compat_hash() {
        return Err(LinkError::IncompatibleConsumer {
            consumer: Box::new(hello.layout.clone()),
            producer: Box::new(own.spec().clone()),
        });
    }
    let layout = Layout::new(hello.layout.clone())?;
    let desc = control::peer_desc(hello).ok_or(LinkError::EndpointDesc)?;
    // Connecting is the driver's, after this input; if it fails, the consumer is refused then.
    let peer = posts.connect(desc);
    Ok(ConsumerRank {
        id: ConsumerId {
            engine: hello.engine,
            incarnation: hello.incarnation,
        },
        layout,
        peer,
        finishing_hints: hello.finishing_hints,
        claim_bound: Duration::from_millis(hello.write_timeout_ms.into())
            .min(crate::config::MAX_TRANSFER_TIMEOUT)
            + crate::config::QUIESCE_MARGIN,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_connections_are_bounded_and_their_slots_come_back() {
        let open = Arc::new(AtomicUsize::new(0));
        let a = ConnectionSlot::take(&open, 2).unwrap();
        let b = ConnectionSlot::take(&open, 2).unwrap();
        assert!(
            ConnectionSlot::take(&open, 2).is_none(),
            "a third connection"
        );
        drop(a);
        let c = ConnectionSlot::take(&open, 2).expect("a slot given back is free again");
        drop((b, c));
        assert_eq!(open.load(Ordering::SeqCst), 0);
    }
}
