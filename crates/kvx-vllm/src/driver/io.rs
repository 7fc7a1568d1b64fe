//! I/O as a state machine's outputs. The state machine names its transport operations and peers
//! itself and queues what it wants done, with the control messages it sends, the control
//! connections it closes and the helper threads it needs, in one queue ([`Posts`]); its driver carries the queue out, in order,
//! after each input ([`Io`]), puts the machine's names on what the transport reports, and hands
//! back, as inputs, what the transport refused ([`Refused`]).
//!
//! A refused operation is one the transport never accepted: no event reports it, and the
//! machine ends it as it ends one that failed in flight. A control message that cannot be
//! sent closes its connection, whose reader then reports the close to the machine like any
//! other.

use std::collections::HashMap;

use kvx_core::wire::{EncodeError, Message};
use kvx_layout::CopyOp;
use kvx_rdma::desc::EndpointDesc;
use kvx_rdma::error::{ConnectError, PollError, ReadError, WriteError};
use kvx_rdma::transport::{Event, Notice, OpId, PeerId, Transport};
use tracing::debug;

use crate::control::ControlSender;

/// What a state machine asks its driver to do, naming operations and peers its own way.
#[derive(Debug)]
pub(crate) enum Post {
    /// Connect to the endpoint `desc` as `peer`.
    Connect { peer: PeerId, desc: EndpointDesc },
    /// Forget `peer` (once its operations in flight end).
    Disconnect { peer: PeerId },
    /// Write `ops` into `peer`'s memory, then deliver `notice`.
    Write {
        op: OpId,
        peer: PeerId,
        ops: Vec<CopyOp>,
        notice: Option<Notice>,
    },
    /// Read `ops` from `peer`'s memory.
    Read {
        op: OpId,
        peer: PeerId,
        ops: Vec<CopyOp>,
    },
    /// Send an encoded control message on connection `to`.
    Send { to: ControlSender, bytes: Vec<u8> },
    /// Close control connection `to` (its reader then reports the close); `flush`: send what
    /// waits for room first.
    Close { to: ControlSender, flush: bool },
    /// Start a helper thread (a handshake, a control connection's reader).
    Spawn(Spawn),
}

/// A helper thread a state machine asks for: `run` on a thread named `name`, or, if no thread
/// can be started, `failed` with why (it tells the machine, through its command queue).
pub(crate) struct Spawn {
    name: String,
    run: Box<dyn FnOnce() + Send>,
    failed: Box<dyn FnOnce(std::io::Error) + Send>,
}

impl std::fmt::Debug for Spawn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spawn")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// What a state machine asked its driver to do and the driver has not carried out yet,
/// in the order asked; the machine's names for operations and peers come from here.
#[derive(Debug, Default)]
pub(crate) struct Posts {
    queue: Vec<Post>,
    next_op: u64,
    next_peer: u32,
}

impl Posts {
    /// Connects to `desc`; the name of the peer, which operations may use at once.
    pub(crate) fn connect(&mut self, desc: EndpointDesc) -> PeerId {
        self.next_peer += 1;
        let peer = PeerId(self.next_peer);
        self.queue.push(Post::Connect { peer, desc });
        peer
    }

    /// Forgets `peer`.
    pub(crate) fn disconnect(&mut self, peer: PeerId) {
        self.queue.push(Post::Disconnect { peer });
    }

    /// Writes `ops` into `peer`, then delivers `notice`; the write's name.
    pub(crate) fn write(&mut self, peer: PeerId, ops: Vec<CopyOp>, notice: Option<Notice>) -> OpId {
        let op = self.next_op();
        self.queue.push(Post::Write {
            op,
            peer,
            ops,
            notice,
        });
        op
    }

    /// Reads `ops` from `peer`; the read's name.
    pub(crate) fn read(&mut self, peer: PeerId, ops: Vec<CopyOp>) -> OpId {
        let op = self.next_op();
        self.queue.push(Post::Read { op, peer, ops });
        op
    }

    /// Sends `message` on control connection `to`.
    ///
    /// # Errors
    /// The message cannot be encoded (nothing is queued then).
    pub(crate) fn send(
        &mut self,
        to: &ControlSender,
        message: &Message,
    ) -> Result<(), EncodeError> {
        let bytes = message.to_bytes()?;
        self.queue.push(Post::Send {
            to: to.clone(),
            bytes,
        });
        Ok(())
    }

    /// [`Posts::send`] of a message that cannot fail to encode, or whose loss its connection's
    /// end covers (the peer then fails what it waited for).
    pub(crate) fn tell(&mut self, to: &ControlSender, message: &Message) {
        if let Err(e) = self.send(to, message) {
            debug!(kind = ?message.kind(), error = %e, "cannot encode a control message");
        }
    }

    /// Closes control connection `to`.
    pub(crate) fn close(&mut self, to: &ControlSender) {
        self.queue.push(Post::Close {
            to: to.clone(),
            flush: false,
        });
    }

    /// Closes control connection `to` once what waits for room in it is sent.
    pub(crate) fn close_flushed(&mut self, to: &ControlSender) {
        self.queue.push(Post::Close {
            to: to.clone(),
            flush: true,
        });
    }

    /// Runs `run` on a helper thread named `name`; if none can be started, `failed` runs with
    /// why, on the driver's thread.
    pub(crate) fn spawn(
        &mut self,
        name: String,
        run: impl FnOnce() + Send + 'static,
        failed: impl FnOnce(std::io::Error) + Send + 'static,
    ) {
        self.queue.push(Post::Spawn(Spawn {
            name,
            run: Box::new(run),
            failed: Box::new(failed),
        }));
    }

    /// Whether operations wait to be carried out.
    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    fn next_op(&mut self) -> OpId {
        self.next_op += 1;
        OpId(self.next_op)
    }

    /// What waits, for the driver.
    pub(super) fn take(&mut self) -> Vec<Post> {
        std::mem::take(&mut self.queue)
    }

    /// Puts back, in front, what the driver could not carry out yet.
    pub(super) fn put_back(&mut self, mut left: Vec<Post>) {
        left.append(&mut self.queue);
        self.queue = left;
    }
}

/// What the transport did not do of what a state machine asked.
#[derive(Debug)]
pub(crate) enum Refused {
    /// `peer` could not be connected; operations on it are refused too.
    Connect { peer: PeerId, error: PostError },
    /// The transport did not accept operation `op`: nothing of it was posted.
    Op { op: OpId, error: PostError },
}

/// Why the transport did not accept an operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum PostError {
    /// Connecting was refused.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// A write was refused.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// A read was refused.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// Its peer could not be connected, or was forgotten.
    #[error("the peer is not connected")]
    NotConnected,
    /// The transport is closed (the side is shutting down).
    #[error("the transport is closed")]
    Closed,
}

/// How a side's control messages are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sending {
    /// Each blocks until the kernel took it.
    Blocking,
    /// None blocks: what the kernel does not take at once waits, in order, for
    /// [`Io::flush`] at the end of the driver's turn (the engine thread sends too, and must
    /// never wait).
    Queued,
}

/// A side's I/O as its driver holds it: the transport, the translation between the transport's
/// names for operations and peers and the state machine's, and how control messages go out.
pub(crate) struct Io {
    /// `None` while the driver has it out for a wait, and once it is closed.
    transport: Option<Box<dyn Transport>>,
    closed: bool,
    sending: Sending,
    /// Connections with messages that wait for room.
    backlogged: Vec<ControlSender>,
    /// The machine's connected peers: the transport's name for each.
    peers: HashMap<PeerId, PeerId>,
    /// How many of the machine's peers each transport peer is (connecting again to an address
    /// gives its name back): the transport forgets it when the last of them goes.
    users: HashMap<PeerId, usize>,
    /// Operations in flight: the transport's name → the machine's names of it and its peer.
    ops: HashMap<OpId, (OpId, PeerId)>,
}

impl std::fmt::Debug for Io {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Io")
            .field("open", &self.transport.is_some())
            .field("peers", &self.peers.len())
            .field("ops", &self.ops.len())
            .finish_non_exhaustive()
    }
}

impl Io {
    pub(crate) fn new(transport: Box<dyn Transport>, sending: Sending) -> Self {
        Self {
            transport: Some(transport),
            closed: false,
            sending,
            backlogged: Vec::new(),
            peers: HashMap::new(),
            users: HashMap::new(),
            ops: HashMap::new(),
        }
    }

    /// The transport, where it is here (not out for a wait, not closed).
    pub(crate) fn transport(&mut self) -> Option<&mut (dyn Transport + 'static)> {
        self.transport.as_deref_mut()
    }

    /// Takes the transport out for a wait on it.
    pub(super) fn lend(&mut self) -> Option<Box<dyn Transport>> {
        self.transport.take()
    }

    /// Gives back the transport lent for a wait.
    pub(super) fn give_back(&mut self, transport: Box<dyn Transport>) {
        self.transport = Some(transport);
    }

    /// Closes the transport (closing waits for or cancels what is still in flight).
    pub(super) fn close(&mut self) {
        drop(self.transport.take());
        self.closed = true;
        self.ops.clear();
    }

    /// Whether control messages wait for room ([`Io::flush`]).
    pub(crate) fn backlogged(&self) -> bool {
        !self.backlogged.is_empty()
    }

    /// Sends the control messages that waited for room, blocking until the kernel took them.
    pub(super) fn flush(&mut self) {
        for to in std::mem::take(&mut self.backlogged) {
            if let Err(e) = to.flush() {
                // Its reader sees the connection end, and the machine hears of it then.
                debug!(error = %e, "cannot send on a control connection; closing it");
                to.close();
            }
        }
    }

    /// Reads what the transport reported, without waiting, in the machine's names (the engine
    /// thread's read on the consumer side); nothing when the transport is not here.
    ///
    /// # Errors
    /// The transport's, when it is broken.
    pub(crate) fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), PollError> {
        let Some(transport) = self.transport.as_deref_mut() else {
            return Ok(());
        };
        let mut raw = Vec::new();
        transport.poll(&mut raw)?;
        events.extend(raw.into_iter().filter_map(|e| self.translate(e)));
        Ok(())
    }

    /// `event` in the machine's names; `None` for an operation the machine did not ask for.
    pub(super) fn translate(&mut self, event: Event) -> Option<Event> {
        Some(match event {
            Event::WriteDone { op, bytes, .. } => {
                let (op, peer) = self.ops.remove(&op)?;
                Event::WriteDone { op, peer, bytes }
            }
            Event::ReadDone { op, bytes, .. } => {
                let (op, peer) = self.ops.remove(&op)?;
                Event::ReadDone { op, peer, bytes }
            }
            Event::Failed {
                op, kind, error, ..
            } => {
                let (op, peer) = self.ops.remove(&op)?;
                Event::Failed {
                    op,
                    kind,
                    peer,
                    error,
                }
            }
            Event::SendDone { op, .. } => {
                self.ops.remove(&op)?;
                return None;
            }
            other => other,
        })
    }

    /// Carries out `posts` in order; what the transport refused goes to `refused`. Returns what
    /// waits for the transport, lent out for a wait (from the first such operation on).
    pub(super) fn carry_out(&mut self, posts: Vec<Post>, refused: &mut Vec<Refused>) -> Vec<Post> {
        let mut posts = posts.into_iter();
        while let Some(post) = posts.next() {
            let needs_transport = !matches!(
                post,
                Post::Send { .. } | Post::Close { .. } | Post::Spawn(_)
            );
            if needs_transport && self.transport.is_none() && !self.closed {
                return std::iter::once(post).chain(posts).collect();
            }
            self.carry_out_one(post, refused);
        }
        Vec::new()
    }

    fn carry_out_one(&mut self, post: Post, refused: &mut Vec<Refused>) {
        match post {
            Post::Connect { peer, desc } => {
                let Some(transport) = self.transport.as_deref_mut() else {
                    refused.push(Refused::Connect {
                        peer,
                        error: PostError::Closed,
                    });
                    return;
                };
                match transport.connect(&desc) {
                    Ok(theirs) => {
                        self.peers.insert(peer, theirs);
                        *self.users.entry(theirs).or_default() += 1;
                    }
                    Err(error) => refused.push(Refused::Connect {
                        peer,
                        error: error.into(),
                    }),
                }
            }
            Post::Disconnect { peer } => {
                let Some(theirs) = self.peers.remove(&peer) else {
                    return;
                };
                let users = self.users.entry(theirs).or_default();
                *users = users.saturating_sub(1);
                if *users == 0 {
                    self.users.remove(&theirs);
                    if let Some(transport) = self.transport.as_deref_mut() {
                        transport.disconnect(theirs);
                    }
                }
            }
            Post::Write {
                op,
                peer,
                ops,
                notice,
            } => {
                let posted = self.post(peer, |transport, theirs| {
                    transport
                        .write(theirs, &ops, notice)
                        .map_err(PostError::from)
                });
                self.posted(op, peer, posted, refused);
            }
            Post::Read { op, peer, ops } => {
                let posted = self.post(peer, |transport, theirs| {
                    transport.read(theirs, &ops).map_err(PostError::from)
                });
                self.posted(op, peer, posted, refused);
            }
            Post::Send { to, bytes } => {
                let sent = match self.sending {
                    Sending::Blocking => to.send_encoded(bytes),
                    Sending::Queued => to.send_or_queue_encoded(bytes).map(|queued| {
                        if queued && !self.backlogged.iter().any(|b| b.same(&to)) {
                            self.backlogged.push(to.clone());
                        }
                    }),
                };
                if let Err(e) = sent {
                    // Its reader sees the connection end, and the machine hears of it then.
                    debug!(error = %e, "cannot send on a control connection; closing it");
                    to.close();
                }
            }
            Post::Close { to, flush } => {
                if flush {
                    if let Err(e) = to.flush() {
                        debug!(error = %e, "cannot send on a control connection");
                    }
                }
                self.backlogged.retain(|b| !b.same(&to));
                to.close();
            }
            Post::Spawn(Spawn { name, run, failed }) => {
                let started = std::thread::Builder::new().name(name).spawn(run);
                if let Err(e) = started {
                    failed(e);
                }
            }
        }
    }

    /// Posts an operation on the machine's `peer`.
    fn post(
        &mut self,
        peer: PeerId,
        post: impl FnOnce(&mut dyn Transport, PeerId) -> Result<OpId, PostError>,
    ) -> Result<OpId, PostError> {
        let theirs = *self.peers.get(&peer).ok_or(PostError::NotConnected)?;
        let transport = self.transport.as_deref_mut().ok_or(PostError::Closed)?;
        post(transport, theirs)
    }

    fn posted(
        &mut self,
        op: OpId,
        peer: PeerId,
        posted: Result<OpId, PostError>,
        refused: &mut Vec<Refused>,
    ) {
        match posted {
            Ok(theirs) => {
                self.ops.insert(theirs, (op, peer));
            }
            Err(error) => refused.push(Refused::Op { op, error }),
        }
    }
}

#[cfg(test)]
mod tests {
    use kvx_core::Rank;
    use kvx_rdma::error::WriteError;
    use kvx_rdma::loopback::LoopbackFabric;

    use super::*;
    use crate::sim_support::endpoint;

    /// `len` bytes from the start of region 0 to the start of region 0.
    fn run(len: u64) -> Vec<CopyOp> {
        vec![CopyOp::run(Rank(0), (0, 0), (0, 0), len)]
    }

    #[test]
    fn operations_are_reported_in_the_machines_names_and_refusals_come_back() {
        let (fabric, elsewhere) = (LoopbackFabric::new(), LoopbackFabric::new());
        let (ours, theirs) = (endpoint(&fabric).0, endpoint(&fabric).0);
        let foreign = endpoint(&elsewhere).0;
        let mut io = Io::new(ours, Sending::Blocking);
        let mut posts = Posts::default();

        let peer = posts.connect(theirs.local_desc());
        let written = posts.write(peer, run(64), Some(Notice(9)));
        let too_long = posts.write(peer, run(1 << 40), None);
        let unreachable = posts.connect(foreign.local_desc());
        let unread = posts.read(unreachable, run(64));
        let mut refused = Vec::new();
        io.carry_out(posts.take(), &mut refused);
        assert!(posts.is_empty());

        assert_eq!(refused.len(), 3, "{refused:?}");
        assert!(
            matches!(&refused[0], Refused::Op { op, error: PostError::Write(_) } if *op == too_long),
            "{:?}",
            refused[0]
        );
        assert!(
            matches!(&refused[1], Refused::Connect { peer, error: PostError::Connect(ConnectError::Unreachable { .. }) } if *peer == unreachable),
            "{:?}",
            refused[1]
        );
        assert!(
            matches!(&refused[2], Refused::Op { op, error: PostError::NotConnected } if *op == unread),
            "{:?}",
            refused[2]
        );
        let mut events = Vec::new();
        io.poll(&mut events).unwrap();
        assert!(
            matches!(events.as_slice(), [Event::WriteDone { op, peer: p, bytes: 64 }] if *op == written && *p == peer),
            "{events:?}"
        );
        assert!(
            io.ops.is_empty(),
            "the write's names are forgotten once it ended"
        );

        io.close();
        let late = posts.write(peer, run(64), None);
        io.carry_out(posts.take(), &mut refused);
        assert!(
            matches!(refused.last(), Some(Refused::Op { op, error: PostError::Closed }) if *op == late)
        );
    }

    #[test]
    fn an_endpoint_two_of_the_machines_peers_share_is_forgotten_with_the_last() {
        let fabric = LoopbackFabric::new();
        let (ours, theirs) = (endpoint(&fabric).0, endpoint(&fabric).0);
        let mut io = Io::new(ours, Sending::Blocking);
        let mut posts = Posts::default();
        let first = posts.connect(theirs.local_desc());
        let second = posts.connect(theirs.local_desc());
        assert_ne!(first, second, "the machine's names are its own");
        let mut refused = Vec::new();
        io.carry_out(posts.take(), &mut refused);
        let shared = io.peers[&first];
        assert_eq!(
            io.peers[&second], shared,
            "one endpoint, one transport peer"
        );
        let write = |io: &mut Io| io.transport().unwrap().write(shared, &run(64), None);

        posts.disconnect(first);
        io.carry_out(posts.take(), &mut refused);
        write(&mut io).expect("the other peer still uses the endpoint");
        posts.disconnect(second);
        posts.disconnect(second);
        io.carry_out(posts.take(), &mut refused);
        assert!(
            matches!(write(&mut io), Err(WriteError::UnknownPeer(p)) if p == shared),
            "the transport forgot the endpoint with its last user"
        );
        assert!(refused.is_empty(), "{refused:?}");
        let ended = posts.write(second, run(64), None);
        io.carry_out(posts.take(), &mut refused);
        assert!(
            matches!(refused.as_slice(), [Refused::Op { op, error: PostError::NotConnected }] if *op == ended)
        );
    }

    /// Queued control messages never block: what a full connection does not take waits for the
    /// end of the turn's flush, in order, and a close sends what waits first where asked.
    #[test]
    fn control_messages_go_out_in_order_without_blocking_until_the_flush() {
        use std::os::unix::net::UnixStream;

        use kvx_core::wire::Heartbeat;
        use kvx_core::{EngineId, Incarnation, TransferId};

        use crate::control::{self, ControlStream};

        let (ours, mut theirs) = UnixStream::pair().unwrap();
        socket2::SockRef::from(&ours)
            .set_send_buffer_size(4096)
            .unwrap();
        let to = control::sender(&ControlStream::local(ours)).unwrap();
        let fabric = LoopbackFabric::new();
        let mut io = Io::new(endpoint(&fabric).0, Sending::Queued);
        let mut posts = Posts::default();
        let message = |i: u128| {
            Message::Heartbeat(Heartbeat {
                engine: EngineId(1),
                incarnation: Incarnation(2),
                transfers: (0..50).map(|t| TransferId(i * 100 + t)).collect(),
            })
        };
        let mut sent = 0;
        let mut refused = Vec::new();
        while !io.backlogged() {
            posts.send(&to, &message(sent)).unwrap();
            let left = io.carry_out(posts.take(), &mut refused);
            assert!(left.is_empty());
            sent += 1;
            assert!(sent < 100_000, "the send buffer never filled");
        }
        for _ in 0..10 {
            posts.send(&to, &message(sent)).unwrap();
            sent += 1;
        }
        posts.close_flushed(&to);
        let reader = std::thread::spawn(move || {
            let mut received = Vec::new();
            while let Ok(m) = control::read_message(&mut theirs) {
                received.push(m);
            }
            received
        });
        io.carry_out(posts.take(), &mut refused);
        assert!(!io.backlogged());
        assert_eq!(
            reader.join().unwrap(),
            (0..sent).map(message).collect::<Vec<_>>(),
            "every message, in order, then the close"
        );
        assert!(refused.is_empty());
    }
}
