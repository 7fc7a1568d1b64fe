//! The transport trait: what the connector needs from a data mover, and nothing engine-specific.

pub mod board;
pub mod desc;
pub mod error;
pub(crate) mod ids;
pub(crate) mod peers;
pub mod region;
pub mod validate;
#[cfg(any(
    feature = "libfabric",
    feature = "cuda",
    feature = "cma",
    feature = "nixl"
))]
pub(crate) mod wake;

use std::sync::Arc;
use std::time::Duration;

use kvx_core::{MemoryKind, RegionDesc};
use kvx_layout::CopyOp;

use crate::board::NoticeBoard;
use crate::desc::EndpointDesc;
use crate::error::{
    ConnectError, DeregisterError, OpError, PollError, ReadError, RegisterError, SendError,
    WriteError,
};
use crate::region::LocalRegion;

pub use crate::ids::{Notice, OpId, OpKind, PeerId};

/// Something that happened on an endpoint, returned by [`Transport::poll`] and
/// [`Transport::wait`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Event {
    /// Every byte of a write is visible at the peer, and its notice (if any) was delivered.
    WriteDone {
        /// The write.
        op: OpId,
        /// Its peer.
        peer: PeerId,
        /// Bytes written (without the notice).
        bytes: u64,
    },
    /// Every byte of a read has landed in local memory.
    ReadDone {
        /// The read.
        op: OpId,
        /// Its peer.
        peer: PeerId,
        /// Bytes read.
        bytes: u64,
    },
    /// A message was handed to the peer.
    SendDone {
        /// The send.
        op: OpId,
        /// Its peer.
        peer: PeerId,
    },
    /// An accepted operation failed. A failed write never delivers its notice.
    Failed {
        /// The operation.
        op: OpId,
        /// What it was.
        kind: OpKind,
        /// Its peer.
        peer: PeerId,
        /// Why.
        error: OpError,
    },
    /// A peer's write finished and announced itself: its data is visible in local memory.
    Notice(Notice),
    /// A peer sent a control message.
    Message(Vec<u8>),
}

/// Limits and abilities of one endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Bits of a [`Notice`] that reach the peer (64 for most, 32 on EFA).
    pub notice_bits: u32,
    /// Longest control message [`Transport::send`] carries.
    pub max_message_len: usize,
    /// Memory kinds [`Transport::register`] accepts.
    pub memory_kinds: Vec<MemoryKind>,
    /// Whether [`Transport::wait`] reads the backend over and over, sleeping in between (no wait
    /// object: libfabric `shm`, NIXL), so that a thread waiting on this endpoint costs CPU for
    /// as long as it waits.
    pub polls_to_wait: bool,
    /// Whether peers' one-sided operations on this endpoint's memory (writes into it, pull
    /// reads from it) complete without it reading its queue: the initiator or the hardware
    /// moves the data (`cma`, CUDA IPC, loopback, libfabric `shm` with cross-memory attach).
    /// Where not (`tcp`, NIXL), an endpoint that stops reading holds them up until it reads
    /// again.
    pub peer_rma_unassisted: bool,
    /// With `peer_rma_unassisted`: whether peers' writes still need this endpoint to read its
    /// queue now and then. libfabric `shm`: each write, though its data lands by cross-memory
    /// attach, takes a slot of the target's command queue that only the target's reads give
    /// back, and a new peer's first write waits for the target to answer its handshake. An
    /// endpoint that otherwise leaves its queue alone (notices in a [board](crate::board)) must
    /// read it regularly, and while a new peer's first write is due.
    pub peer_rma_occasional_reads: bool,
}

/// A data mover between engine instances: registers local memory, describes itself, connects to
/// peers from their descriptions, and moves bytes by one-sided writes (push) or reads (pull), with
/// completion notices and small control messages.
///
/// Every call is non-blocking except [`Transport::wait`]. Operations complete asynchronously and
/// are reported as [`Event`]s by [`Transport::poll`] (for an engine loop) or [`Transport::wait`]
/// (for a background thread, which blocks on the backend's wait object and never spins). Calling
/// either also makes progress on backends that need the caller to drive it, so a caller with
/// operations in flight must keep calling one of them.
///
/// Region indices are the layout's region indices: a [`CopyOp`]'s `src_region` and `dst_region`
/// name regions in the producer's and the consumer's tables. Every piece of every operation is
/// checked against the registered bounds before anything is posted.
pub trait Transport: Send {
    /// Backend name, as in [`EndpointDesc::backend`].
    fn backend(&self) -> &'static str;

    /// Limits and abilities of this endpoint.
    fn capabilities(&self) -> Capabilities;

    /// The rails the endpoint opened on: NIC or network-interface names (a libfabric domain per
    /// rail, UCX's network devices); empty for same-host and in-process transports.
    fn rails(&self) -> Vec<String> {
        Vec::new()
    }

    /// Registers a region of local memory under its layout index, and returns how peers see it.
    ///
    /// # Errors
    /// A [`RegisterError`]: duplicate index, empty region, unsupported memory kind, backend
    /// failure.
    fn register(&mut self, region: LocalRegion) -> Result<RegionDesc, RegisterError>;

    /// Releases a registration (peers that still use its key fail with
    /// [`OpError::RemoteAccess`]).
    ///
    /// # Errors
    /// A [`DeregisterError`]: unknown index, region in use by operations in flight, backend
    /// failure.
    fn deregister(&mut self, index: u32) -> Result<(), DeregisterError>;

    /// This endpoint's description, with the regions registered now.
    fn local_desc(&self) -> EndpointDesc;

    /// Connects to a peer from its description (or refreshes the region table of a peer already
    /// connected at the same address, returning its id). Backends that connect lazily report an
    /// unreachable peer on the first operation, as [`OpError::PeerUnreachable`].
    ///
    /// # Errors
    /// A [`ConnectError`]: bad description, other backend or provider, unusable address,
    /// unreachable peer.
    fn connect(&mut self, peer: &EndpointDesc) -> Result<PeerId, ConnectError>;

    /// Forgets a peer (its process exited or restarted, or the caller is done with it):
    /// operations on `peer` from now on fail with `UnknownPeer`, and what this endpoint holds
    /// for it (its address, its connection, memory of its that is mapped here) is released, once
    /// the operations already posted to it have ended (they end as they would have). Connecting
    /// to it again gives a new id (or, while its operations still settle, its old one back);
    /// an id is never given to another peer. An unknown id is ignored.
    ///
    /// Without it, every peer ever connected would stay: a long-lived prefill whose decode
    /// instances restart would accumulate their sockets, addresses and mappings.
    fn disconnect(&mut self, peer: PeerId);

    /// Writes local `src` ranges into the peer's `dst` ranges, then delivers `notice` (if any) to
    /// the peer, only after all the data is visible there. Reported by [`Event::WriteDone`] or
    /// [`Event::Failed`]; a failed write delivers no notice.
    ///
    /// # Errors
    /// A [`WriteError`] when the operations cannot be accepted (unknown peer, operation outside
    /// a registered region, notice too wide, backend failure); nothing was posted then.
    fn write(
        &mut self,
        peer: PeerId,
        ops: &[CopyOp],
        notice: Option<Notice>,
    ) -> Result<OpId, WriteError>;

    /// Reads the peer's `src` ranges into local `dst` ranges (pull mode). Reported by
    /// [`Event::ReadDone`] or [`Event::Failed`].
    ///
    /// # Errors
    /// A [`ReadError`] when the operations cannot be accepted; nothing was posted then.
    fn read(&mut self, peer: PeerId, ops: &[CopyOp]) -> Result<OpId, ReadError>;

    /// Sends a small control message (at most [`Capabilities::max_message_len`] bytes); the peer
    /// receives it as [`Event::Message`].
    ///
    /// # Errors
    /// A [`SendError`] when the message cannot be accepted.
    fn send(&mut self, peer: PeerId, message: &[u8]) -> Result<OpId, SendError>;

    /// Appends what happened since the last call to `events` without blocking, and returns how
    /// many events it appended.
    ///
    /// # Errors
    /// [`PollError`] when the endpoint itself is broken.
    fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, PollError>;

    /// Like [`Transport::poll`], but blocks on the backend's wait object until at least one event
    /// arrives or `timeout` passes (then it returns 0).
    ///
    /// # Errors
    /// [`PollError`] when the endpoint itself is broken.
    fn wait(&mut self, events: &mut Vec<Event>, timeout: Duration) -> Result<usize, PollError>;

    /// A handle that interrupts [`Transport::wait`] from another thread, so that a driver can
    /// block on its transport alone and still see new commands at once; `None` where the
    /// backend has no such wake-up (the driver then waits in short slices).
    fn waker(&self) -> Option<Arc<dyn Waker>> {
        None
    }

    /// Gives this endpoint a [notice board](crate::board) of `slots` slots, if the backend can
    /// have peers write notices into its memory (peers' writes land here unassisted): from then
    /// on, a write whose notice is a [board notice](crate::board::board_notice) puts it into the
    /// board, after the data, instead of delivering it as an [`Event::Notice`]. Its place is in
    /// [`Transport::local_desc`] (`notice_slot`), so peers must connect (or refresh) after this.
    /// `None` where the backend has none; asking again returns the same board.
    fn notice_board(&mut self, slots: usize) -> Option<Arc<NoticeBoard>> {
        let _ = slots;
        None
    }
}

/// Interrupts a transport's [`Transport::wait`]: once [`Waker::wake`] returns, a wait in
/// progress, or else the next one, returns soon, possibly with no event.
pub trait Waker: Send + Sync {
    /// Wakes the waiting thread.
    fn wake(&self);
}

/// Checks a transport's [`Waker`]: it interrupts a long wait from another thread, and a wake
/// that comes before the wait makes the next wait return at once.
#[cfg(test)]
pub(crate) fn check_waker(transport: &mut dyn Transport) {
    use std::time::Instant;
    let waker = transport.waker().expect("this transport has a waker");
    let started = Instant::now();
    let waking = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        waker.wake();
    });
    let mut events = Vec::new();
    assert_eq!(
        transport
            .wait(&mut events, Duration::from_secs(60))
            .unwrap(),
        0
    );
    let waited = started.elapsed();
    waking.join().unwrap();
    assert!(
        waited >= Duration::from_millis(50) && waited < Duration::from_secs(20),
        "{waited:?}"
    );
    transport.waker().unwrap().wake();
    let started = Instant::now();
    assert_eq!(
        transport
            .wait(&mut events, Duration::from_secs(60))
            .unwrap(),
        0
    );
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// Checks a [notice board](crate::board) of `b`, written by `a` (both with region 0 of at
/// least `len` bytes): while `b` has no board, a board notice is an ordinary message; once it
/// has one, a board notice for a slot it lacks is refused, and one for a slot it has lands in
/// the board after the data (`landed` checks the bytes), with no event at `b`; other notices
/// still come as events.
#[cfg(test)]
pub(crate) fn check_notice_board(
    a: &mut dyn Transport,
    b: &mut dyn Transport,
    len: u64,
    landed: &dyn Fn() -> bool,
) {
    use crate::board::board_notice;
    use crate::error::WriteError;
    use kvx_core::Rank;
    use std::time::Instant;

    let op = CopyOp::run(Rank(0), (0, 0), (0, 0), len);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut ea = Vec::new();
    let n = board_notice(3, 1).unwrap();
    let peer = a.connect(&b.local_desc()).unwrap();
    a.write(peer, &[op], Some(n)).unwrap();
    let mut eb = Vec::new();
    while !eb.iter().any(|e| matches!(e, Event::Notice(m) if *m == n)) {
        assert!(Instant::now() < deadline, "b: {eb:?}");
        a.poll(&mut ea).unwrap();
        b.wait(&mut eb, Duration::from_millis(5)).unwrap();
    }
    let board = b.notice_board(4).expect("a board");
    assert!(Arc::ptr_eq(&board, &b.notice_board(8).unwrap()));
    let peer = a.connect(&b.local_desc()).unwrap();
    assert!(matches!(
        a.write(peer, &[op], Some(board_notice(4, 1).unwrap())),
        Err(WriteError::NoBoardSlot(_))
    ));
    assert!(!board.arrived(n));
    let id = a.write(peer, &[op], Some(n)).unwrap();
    // `b` never reads its queue: the notice needs nothing from it.
    while !board.arrived(n) {
        assert!(Instant::now() < deadline, "no board notice; a: {ea:?}");
        a.wait(&mut ea, Duration::from_millis(1)).unwrap();
    }
    assert!(landed(), "the notice came before the data");
    while !ea
        .iter()
        .any(|e| matches!(e, Event::WriteDone { op, .. } if *op == id))
    {
        assert!(Instant::now() < deadline, "a: {ea:?}");
        a.wait(&mut ea, Duration::from_millis(5)).unwrap();
    }
    let mut eb = Vec::new();
    b.poll(&mut eb).unwrap();
    assert!(
        !eb.iter().any(|e| matches!(e, Event::Notice(_))),
        "a board notice also came as a message: {eb:?}"
    );
    // A plain notice is still a message.
    a.write(peer, &[op], Some(Notice(9))).unwrap();
    let mut eb = Vec::new();
    while !eb.iter().any(|e| matches!(e, Event::Notice(Notice(9)))) {
        assert!(Instant::now() < deadline, "b: {eb:?}");
        a.poll(&mut ea).unwrap();
        b.wait(&mut eb, Duration::from_millis(5)).unwrap();
    }
}

/// Checks [`Transport::disconnect`] between `a` (which has local region 0) and `b` (region 0,
/// at least `len` bytes): a write posted just before the disconnect still ends as it would
/// have (done, its notice delivered), later operations on the old id are refused, and
/// connecting again gives a new id that works.
#[cfg(test)]
pub(crate) fn check_disconnect(a: &mut dyn Transport, b: &mut dyn Transport, len: u64) {
    use crate::error::WriteError;
    use kvx_core::Rank;
    use std::time::Instant;

    let op = CopyOp::run(Rank(0), (0, 0), (0, 0), len);
    // Waits on both until `a` reports `id` and `b` received `notice`.
    let settle = |a: &mut dyn Transport, b: &mut dyn Transport, id: OpId, notice: u64| {
        let deadline = Instant::now() + Duration::from_secs(20);
        let (mut ea, mut eb) = (Vec::new(), Vec::new());
        loop {
            let done = ea.iter().any(
                |e| matches!(e, Event::WriteDone { op, bytes, .. } if *op == id && *bytes == len),
            );
            let noticed = eb
                .iter()
                .any(|e| matches!(e, Event::Notice(Notice(n)) if *n == notice));
            if done && noticed {
                return;
            }
            assert!(Instant::now() < deadline, "a: {ea:?}, b: {eb:?}");
            a.wait(&mut ea, Duration::from_millis(5)).unwrap();
            b.wait(&mut eb, Duration::from_millis(5)).unwrap();
        }
    };
    let first = a.connect(&b.local_desc()).unwrap();
    let id = a.write(first, &[op], Some(Notice(7))).unwrap();
    a.disconnect(first);
    assert!(matches!(
        a.write(first, &[op], None),
        Err(WriteError::UnknownPeer(p)) if p == first
    ));
    settle(a, b, id, 7);
    assert!(matches!(
        a.write(first, &[op], None),
        Err(WriteError::UnknownPeer(_))
    ));
    assert!(a.send(first, b"x").is_err());
    let again = a.connect(&b.local_desc()).unwrap();
    assert_ne!(again, first, "ids are not reused");
    let id = a.write(again, &[op], Some(Notice(8))).unwrap();
    settle(a, b, id, 8);
    // Unknown ids are ignored.
    a.disconnect(first);
    a.disconnect(PeerId(u32::MAX));
}
