//! The control listeners: accepting connections (bounded), reading each one's hello on its own
//! thread, and checking a consumer's layout and registrations.

use super::*;

/// Most control connections a producer rank serves at once (each has a reader thread): decode
/// ranks connect once each, so this is far above any deployment's need, and a peer that opens
/// connections without end cannot exhaust the process's threads.
const MAX_CONTROL_CONNECTIONS: usize = 1024;

/// What accepts control connections, on the TCP listener and on the local one: both count
/// against one limit and number their connections from one counter.
#[derive(Clone)]
pub(super) struct Acceptor {
    pub(super) tx: CommandSender<Command>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) hello: Message,
    pub(super) handshake_timeout: Duration,
    pub(super) next: Arc<AtomicU64>,
    pub(super) open: Arc<AtomicUsize>,
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
            let tx = self.tx.clone();
            let hello = self.hello.clone();
            let handshake_timeout = self.handshake_timeout;
            let spawned = thread::Builder::new()
                .name(format!("kvx-ctl-{conn}"))
                .spawn(move || {
                    let _slot = slot;
                    serve_connection(conn, stream, &tx, &hello, handshake_timeout);
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

/// Answers the consumer's hello on the connection's own thread (so a busy driver never delays a
/// handshake), then forwards every later message to the driver.
fn serve_connection(
    conn: ConnId,
    mut stream: ControlStream,
    tx: &CommandSender<Command>,
    hello: &Message,
    handshake_timeout: Duration,
) {
    let handshake = (|| -> Result<(ControlSender, Hello), LinkError> {
        stream
            .set_read_timeout(Some(handshake_timeout))
            .map_err(LinkError::Timeouts)?;
        let theirs = match control::read_message(&mut stream)? {
            Message::Hello(h) => h,
            _ => return Err(LinkError::FirstNotHello),
        };
        let sender = control::sender(&stream).map_err(LinkError::Timeouts)?;
        sender.send(hello)?;
        stream.set_read_timeout(None).map_err(LinkError::Timeouts)?;
        Ok((sender, theirs))
    })();
    let (sender, theirs) = match handshake {
        Ok(h) => h,
        Err(why) => {
            debug!(conn, %why, "handshake failed");
            let _ = stream.shutdown(std::net::Shutdown::Both);
            return;
        }
    };
    if tx
        .send(Command::Accepted(conn, sender, Box::new(theirs)))
        .is_err()
    {
        return;
    }
    control::read_loop(stream, |result| {
        let command = match result {
            Ok(message) => Command::Peer(conn, message),
            Err(e) => Command::PeerClosed(conn, e.to_string()),
        };
        tx.send(command).is_ok()
    });
}

pub(super) fn accept_consumer(
    own: &Layout,
    hello: &Hello,
    transport: &mut dyn Transport,
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
    let peer = transport.connect(&desc)?;
    Ok(ConsumerRank {
        id: ConsumerId {
            engine: hello.engine,
            incarnation: hello.incarnation,
        },
        layout,
        peer,
        finishing_hints: hello.finishing_hints,
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
