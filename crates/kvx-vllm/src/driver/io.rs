//! Transport operations as a state machine's outputs. The state machine names its operations
//! and peers itself and queues what it wants done ([`Posts`]); its driver carries the queue out
//! on the transport after each input ([`TransportIo`]), puts the machine's names on what the
//! transport reports, and hands back, as inputs, what the transport refused ([`Refused`]).
//!
//! A refused operation is one the transport never accepted: no event reports it, and the
//! machine ends it as it ends one that failed in flight.

use std::collections::HashMap;

use kvx_layout::CopyOp;
use kvx_rdma::desc::EndpointDesc;
use kvx_rdma::error::{ConnectError, PollError, ReadError, WriteError};
use kvx_rdma::transport::{Event, Notice, OpId, PeerId, Transport};

/// A transport operation a state machine asks for, under its own names.
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
}

/// The transport operations a state machine asked for and its driver has not carried out yet,
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

/// A side's transport as its driver holds it, and the translation between the transport's names
/// for operations and peers and the state machine's.
pub(crate) struct TransportIo {
    /// `None` while the driver has it out for a wait, and once it is closed.
    transport: Option<Box<dyn Transport>>,
    /// The machine's connected peers: the transport's name for each.
    peers: HashMap<PeerId, PeerId>,
    /// How many of the machine's peers each transport peer is (connecting again to an address
    /// gives its name back): the transport forgets it when the last of them goes.
    users: HashMap<PeerId, usize>,
    /// Operations in flight: the transport's name → the machine's names of it and its peer.
    ops: HashMap<OpId, (OpId, PeerId)>,
}

impl std::fmt::Debug for TransportIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportIo")
            .field("open", &self.transport.is_some())
            .field("peers", &self.peers.len())
            .field("ops", &self.ops.len())
            .finish_non_exhaustive()
    }
}

impl TransportIo {
    pub(crate) fn new(transport: Box<dyn Transport>) -> Self {
        Self {
            transport: Some(transport),
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
        self.ops.clear();
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

    /// Carries out `posts` in order; what the transport refused goes to `refused`.
    pub(super) fn carry_out(&mut self, posts: Vec<Post>, refused: &mut Vec<Refused>) {
        for post in posts {
            match post {
                Post::Connect { peer, desc } => {
                    let Some(transport) = self.transport.as_deref_mut() else {
                        refused.push(Refused::Connect {
                            peer,
                            error: PostError::Closed,
                        });
                        continue;
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
                        continue;
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
        let mut io = TransportIo::new(ours);
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
        let mut io = TransportIo::new(ours);
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
        let write = |io: &mut TransportIo| io.transport().unwrap().write(shared, &run(64), None);

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
}
