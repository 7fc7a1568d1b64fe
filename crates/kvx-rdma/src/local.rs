//! The control plane of the same-host backends (`cuda-ipc`, `cma`): a Unix stream socket per
//! endpoint in the abstract namespace (nothing left on disk) that carries framed completion
//! notices and control messages, the completions a backend's worker thread reports, and the
//! blocking wait over all of it (`poll(2)` on the listener, the connections and a wake-up
//! `eventfd`: no thread spins).

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{AddressError, OpError, PollError, SendError};
use crate::transport::{Event, Notice, OpId, OpKind, PeerId, Waker};
use crate::wake::WakeSignal;

/// Longest control message.
pub(crate) const MAX_MESSAGE_LEN: usize = 64 << 10;
const FRAME_NOTICE: u8 = 1;
const FRAME_MESSAGE: u8 = 2;

/// Who an endpoint is and where its socket is: the common head of the same-host backends'
/// addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) pid: u32,
    pub(crate) incarnation: u64,
    pub(crate) socket: String,
}

impl Identity {
    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.incarnation.to_le_bytes());
        out.push(self.socket.len() as u8);
        out.extend_from_slice(self.socket.as_bytes());
    }

    pub(crate) fn decode(reader: &mut Reader<'_>) -> Result<Self, AddressError> {
        let pid = reader.u32("pid")?;
        let incarnation = reader.u64("incarnation")?;
        let len = reader.take(1, "socket length")?[0] as usize;
        let socket = String::from_utf8(reader.take(len, "socket")?.to_vec())
            .map_err(|_| AddressError::Text("socket name"))?;
        Ok(Self {
            pid,
            incarnation,
            socket,
        })
    }

    /// Whether the endpoint lives in this process.
    #[cfg(feature = "cuda")]
    pub(crate) fn is_this_process(&self) -> bool {
        self.pid == std::process::id()
    }
}

/// Reads a little-endian address blob front to back; every short read is an error naming the
/// field.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// Starts at the beginning of `bytes`, after checking its magic and version.
    pub(crate) fn open(bytes: &'a [u8], magic: [u8; 4], version: u8) -> Result<Self, AddressError> {
        let mut reader = Self { bytes, at: 0 };
        if reader.take(4, "magic")? != magic {
            return Err(AddressError::BadMagic);
        }
        let found = reader.take(1, "version")?[0];
        if found != version {
            return Err(AddressError::Version(found));
        }
        Ok(reader)
    }

    pub(crate) fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], AddressError> {
        let piece = self
            .bytes
            .get(self.at..self.at + n)
            .ok_or(AddressError::Truncated(what))?;
        self.at += n;
        Ok(piece)
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, AddressError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().unwrap_or_default(),
        ))
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, AddressError> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().unwrap_or_default(),
        ))
    }

    /// Bytes left.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    /// Fails if bytes are left over.
    pub(crate) fn finish(self) -> Result<(), AddressError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(AddressError::Trailing(n)),
        }
    }
}

/// The magic and version that open every same-host address, then the identity.
pub(crate) fn encode_head(magic: [u8; 4], version: u8, who: &Identity) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&magic);
    out.push(version);
    who.encode_into(&mut out);
    out
}

/// Operations finished by a backend's worker, with their outcome; its signal wakes `wait`.
pub(crate) struct Completions {
    done: Mutex<Vec<(u64, Result<(), OpError>)>>,
    /// Rung when operations finish; raised by [`Waker::wake`].
    signal: WakeSignal,
}

impl Waker for Completions {
    fn wake(&self) {
        self.signal.wake();
    }
}

impl Completions {
    /// Reports finished operations and wakes the endpoint once.
    pub(crate) fn push_all(&self, results: impl IntoIterator<Item = (u64, Result<(), OpError>)>) {
        self.done
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(results);
        self.signal.ring();
    }
}

/// Sends completion notices to one peer (shareable with a worker thread).
#[derive(Clone)]
pub(crate) struct NoticeSender(Arc<Mutex<UnixStream>>);

impl NoticeSender {
    /// Sends `notices`, one frame each, in one write: a burst of finished operations costs one
    /// system call, not one per operation. Returns how many frames went out whole; on an error
    /// the connection is shut down, so the peer sees its end rather than a torn frame.
    pub(crate) fn send_all(&self, notices: &[u64]) -> (usize, std::io::Result<()>) {
        let mut frames = Vec::with_capacity(notices.len() * 9);
        for notice in notices {
            frames.push(FRAME_NOTICE);
            frames.extend_from_slice(&notice.to_le_bytes());
        }
        let mut conn = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let mut written = 0;
        while written < frames.len() {
            match conn.write(&frames[written..]) {
                Ok(0) => {
                    let _ = conn.shutdown(std::net::Shutdown::Both);
                    return (written / 9, Err(std::io::ErrorKind::WriteZero.into()));
                }
                Ok(n) => written += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = conn.shutdown(std::net::Shutdown::Both);
                    return (written / 9, Err(e));
                }
            }
        }
        (notices.len(), Ok(()))
    }
}

/// This endpoint's connection to one peer's socket.
pub(crate) struct Link {
    conn: Arc<Mutex<UnixStream>>,
    checked: Option<Instant>,
    closed: bool,
}

impl Link {
    /// Connects to the socket named `socket`.
    pub(crate) fn connect(socket: &str) -> std::io::Result<Self> {
        let addr = SocketAddr::from_abstract_name(socket.as_bytes())?;
        let conn = UnixStream::connect_addr(&addr)?;
        conn.set_write_timeout(Some(Duration::from_secs(5)))?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
            checked: None,
            closed: false,
        })
    }

    /// A handle that sends this peer's notices.
    pub(crate) fn notices(&self) -> NoticeSender {
        NoticeSender(Arc::clone(&self.conn))
    }

    /// Whether the peer still has its end open (a non-blocking peek, asked at most once a
    /// millisecond so that back-to-back operations do not pay a system call each).
    pub(crate) fn alive(&mut self) -> bool {
        if self.closed {
            return false;
        }
        if self
            .checked
            .is_some_and(|t| t.elapsed() < Duration::from_millis(1))
        {
            return true;
        }
        self.checked = Some(Instant::now());
        let fd = self
            .conn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_raw_fd();
        let mut byte = [0u8; 1];
        // SAFETY: a one-byte peek into a live local buffer on a socket `self` keeps open.
        let n = unsafe {
            libc::recv(
                fd,
                byte.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n == 0 {
            self.closed = true;
        } else if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != ErrorKind::WouldBlock && err.kind() != ErrorKind::Interrupted {
                self.closed = true;
            }
        }
        !self.closed
    }

    /// Sends a control message as one frame.
    pub(crate) fn send_message(&mut self, message: &[u8]) -> std::io::Result<()> {
        if self.closed {
            return Err(std::io::Error::new(
                ErrorKind::BrokenPipe,
                "the peer closed its connection",
            ));
        }
        let mut frame = Vec::with_capacity(5 + message.len());
        frame.push(FRAME_MESSAGE);
        frame.extend_from_slice(&(message.len() as u32).to_le_bytes());
        frame.extend_from_slice(message);
        let sent = self
            .conn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .write_all(&frame);
        if sent.is_err() {
            self.closed = true;
        }
        sent
    }
}

struct Inbound {
    conn: UnixStream,
    buf: Vec<u8>,
}

/// An endpoint's socket, its accepted connections and its completions.
pub(crate) struct Control {
    identity: Identity,
    listener: UnixListener,
    inbound: Vec<Inbound>,
    completions: Arc<Completions>,
    /// What the last [`Control::block`] saw readable, for the next receive.
    seen: Option<Readiness>,
    /// The `poll(2)` array, reused.
    fds: Vec<libc::pollfd>,
}

impl Control {
    /// Binds a fresh socket named after `kind`, this process and a new incarnation.
    pub(crate) fn open(kind: &str) -> std::io::Result<Self> {
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let pid = std::process::id();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        let incarnation =
            kvx_core::ids::fnv1a_64(&[nanos.to_le_bytes(), serial.to_le_bytes()].concat())
                ^ u64::from(pid);
        let socket = format!("kvx-{kind}/{pid}/{serial}/{incarnation:016x}");
        let listener =
            UnixListener::bind_addr(&SocketAddr::from_abstract_name(socket.as_bytes())?)?;
        listener.set_nonblocking(true)?;
        Ok(Self {
            identity: Identity {
                pid,
                incarnation,
                socket,
            },
            listener,
            inbound: Vec::new(),
            completions: Arc::new(Completions {
                done: Mutex::new(Vec::new()),
                signal: WakeSignal::new()?,
            }),
            seen: None,
            fds: Vec::new(),
        })
    }

    /// Who this endpoint is.
    pub(crate) fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Where workers report finished operations.
    pub(crate) fn completions(&self) -> Arc<Completions> {
        Arc::clone(&self.completions)
    }

    /// Which of this endpoint's descriptors are readable: those [`Control::block`] saw, or
    /// else a `poll(2)` that does not wait. A poll then reads only those, so an idle endpoint
    /// costs one system call rather than one per descriptor.
    fn readiness(&mut self) -> std::io::Result<Readiness> {
        match self.seen.take() {
            Some(ready) => Ok(ready),
            None => self.poll_fds(0),
        }
    }

    /// One `poll(2)` over the listener, the wake-up descriptor and the connections, waiting
    /// at most `ms` milliseconds.
    fn poll_fds(&mut self, ms: i32) -> std::io::Result<Readiness> {
        self.fds.clear();
        self.fds.extend(
            [self.listener.as_raw_fd(), self.completions.signal.fd()]
                .into_iter()
                .chain(self.inbound.iter().map(|i| i.conn.as_raw_fd()))
                .map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                }),
        );
        // SAFETY: `fds` is a live array of `fds.len()` pollfd entries.
        let r = unsafe { libc::poll(self.fds.as_mut_ptr(), self.fds.len() as libc::nfds_t, ms) };
        if r < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != ErrorKind::Interrupted {
                return Err(err);
            }
            // Interrupted: nothing is known, so everything is looked at.
            return Ok(Readiness::all(self.inbound.len()));
        }
        let ready = |f: &libc::pollfd| f.revents != 0;
        Ok(Readiness {
            listener: ready(&self.fds[0]),
            signal: ready(&self.fds[1]),
            inbound: self.fds[2..].iter().map(ready).collect(),
        })
    }

    /// Accepts new connections and turns every complete frame received into an event; a
    /// connection that closes or sends garbage is dropped. Returns whether the wake-up
    /// descriptor was readable (news from the workers, or a wake).
    pub(crate) fn receive(&mut self, events: &mut VecDeque<Event>) -> std::io::Result<bool> {
        let ready = self.readiness()?;
        if ready.listener {
            while let Ok((conn, _)) = self.listener.accept() {
                // Only processes of this user may send notices and messages here (the socket's
                // name is visible to every process of the network namespace).
                if same_user(&conn) && conn.set_nonblocking(true).is_ok() {
                    self.inbound.push(Inbound {
                        conn,
                        buf: Vec::new(),
                    });
                }
            }
        }
        let mut chunk = [0u8; 16 << 10];
        // Walked from the end, so that dropping a connection (swap_remove) moves only one
        // already looked at; connections accepted just now were not polled and are read too.
        for i in (0..self.inbound.len()).rev() {
            if !ready.inbound.get(i).copied().unwrap_or(true) {
                continue;
            }
            let mut closed = false;
            loop {
                match self.inbound[i].conn.read(&mut chunk) {
                    Ok(0) => {
                        closed = true;
                        break;
                    }
                    Ok(n) => {
                        self.inbound[i].buf.extend_from_slice(&chunk[..n]);
                        if n < chunk.len() {
                            // Drained for now: more would make it readable again.
                            break;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => {
                        closed = true;
                        break;
                    }
                }
            }
            let malformed = parse_frames(&mut self.inbound[i].buf, events);
            if closed || malformed {
                self.inbound.swap_remove(i);
            }
        }
        Ok(ready.signal)
    }

    /// The operations finished since the last call; `signalled`: the wake-up descriptor was
    /// readable, and is emptied.
    pub(crate) fn completed(&mut self, signalled: bool) -> Vec<(u64, Result<(), OpError>)> {
        if signalled {
            self.completions.signal.clear_fd();
        }
        std::mem::take(
            &mut *self
                .completions
                .done
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// Blocks until a connection, a frame or a completion may be ready, or `timeout` passes;
    /// the next [`Control::receive`] reads what this saw.
    pub(crate) fn block(&mut self, timeout: Duration) -> std::io::Result<()> {
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        let ready = self.poll_fds(ms)?;
        self.seen = Some(ready);
        Ok(())
    }
}

/// What one `poll(2)` found readable.
struct Readiness {
    listener: bool,
    signal: bool,
    /// Per connection, in `Control::inbound` order.
    inbound: Vec<bool>,
}

impl Readiness {
    fn all(connections: usize) -> Self {
        Self {
            listener: true,
            signal: true,
            inbound: vec![true; connections],
        }
    }
}

struct Pending {
    peer: PeerId,
    kind: OpKind,
    bytes: u64,
    /// Local regions the operation uses (they cannot be deregistered meanwhile).
    regions: Vec<u32>,
    started: Instant,
}

/// The operations of one endpoint: ids, what is in flight, and the events waiting for the next
/// poll.
#[derive(Default)]
pub(crate) struct Ledger {
    next: u64,
    pending: HashMap<u64, Pending>,
    events: VecDeque<Event>,
}

impl Ledger {
    /// The id the next operation gets.
    pub(crate) fn next_id(&self) -> u64 {
        self.next
    }

    /// Records an accepted operation as in flight under [`Ledger::next_id`].
    pub(crate) fn start(
        &mut self,
        peer: PeerId,
        kind: OpKind,
        bytes: u64,
        regions: Vec<u32>,
    ) -> OpId {
        let op = self.next;
        self.next += 1;
        self.pending.insert(
            op,
            Pending {
                peer,
                kind,
                bytes,
                regions,
                started: Instant::now(),
            },
        );
        OpId(op)
    }

    /// An operation that completes at once (a sent message) or fails at once (a dead peer).
    pub(crate) fn done_now(
        &mut self,
        peer: PeerId,
        kind: OpKind,
        result: Result<(), OpError>,
    ) -> OpId {
        let op = OpId(self.next);
        self.next += 1;
        self.events.push_back(match result {
            Ok(()) => Event::SendDone { op, peer },
            Err(error) => Event::Failed {
                op,
                kind,
                peer,
                error,
            },
        });
        op
    }

    /// Fails an in-flight operation now (it could not be handed to the worker).
    pub(crate) fn fail(&mut self, op: u64, error: OpError) {
        if let Some(p) = self.pending.remove(&op) {
            self.events.push_back(Event::Failed {
                op: OpId(op),
                kind: p.kind,
                peer: p.peer,
                error,
            });
        }
    }

    /// Turns the worker's results into events (results of operations that already timed out are
    /// dropped), then fails what has been in flight longer than `timeout`.
    pub(crate) fn settle(&mut self, results: Vec<(u64, Result<(), OpError>)>, timeout: Duration) {
        for (op, result) in results {
            let Some(p) = self.pending.remove(&op) else {
                continue;
            };
            let (op, peer, bytes) = (OpId(op), p.peer, p.bytes);
            self.events.push_back(match (result, p.kind) {
                (Ok(()), OpKind::Read) => Event::ReadDone { op, peer, bytes },
                (Ok(()), OpKind::Send) => Event::SendDone { op, peer },
                (Ok(()), OpKind::Write) => Event::WriteDone { op, peer, bytes },
                (Err(error), kind) => Event::Failed {
                    op,
                    kind,
                    peer,
                    error,
                },
            });
        }
        let expired: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.started.elapsed() > timeout)
            .map(|(&op, _)| op)
            .collect();
        for op in expired {
            self.fail(op, OpError::TimedOut(timeout));
        }
    }

    /// Operations in flight that use local region `index`.
    pub(crate) fn using(&self, index: u32) -> usize {
        self.pending
            .values()
            .filter(|p| p.regions.contains(&index))
            .count()
    }

    /// [`Transport::deregister`](crate::Transport::deregister) for a same-host transport: forgets
    /// region `index` of `regions` unless an operation in flight uses it.
    pub(crate) fn deregister<V>(
        &self,
        regions: &mut std::collections::BTreeMap<u32, V>,
        index: u32,
    ) -> Result<(), crate::error::DeregisterError> {
        use crate::error::DeregisterError;
        if !regions.contains_key(&index) {
            return Err(DeregisterError::Unknown(index));
        }
        let ops = self.using(index);
        if ops > 0 {
            return Err(DeregisterError::InUse { index, ops });
        }
        regions.remove(&index);
        Ok(())
    }

    /// Whether anything is in flight.
    pub(crate) fn busy(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Moves the waiting events into `events`; returns how many.
    pub(crate) fn drain_into(&mut self, events: &mut Vec<Event>) -> usize {
        let n = self.events.len();
        events.extend(self.events.drain(..));
        n
    }

    /// Where received notices and messages go.
    pub(crate) fn inbox(&mut self) -> &mut VecDeque<Event> {
        &mut self.events
    }
}

/// What the shared poll and wait need from a same-host transport.
pub(crate) trait SameHost {
    /// The endpoint's control plane and operation ledger.
    fn parts(&mut self) -> (&mut Control, &mut Ledger);
    /// How long an operation may stay in flight.
    fn op_timeout(&self) -> Duration;
    /// Work to do first on every poll (hand batched operations to the worker).
    fn before_poll(&mut self) {}

    /// One non-blocking poll: received frames, finished operations, expired ones.
    fn poll_now(&mut self, events: &mut Vec<Event>) -> Result<usize, PollError> {
        self.before_poll();
        let timeout = self.op_timeout();
        let (control, ledger) = self.parts();
        let signalled = control
            .receive(ledger.inbox())
            .map_err(|e| PollError::Backend(Box::new(e)))?;
        let done = control.completed(signalled);
        ledger.settle(done, timeout);
        Ok(ledger.drain_into(events))
    }
}

/// [`Transport::wait`](crate::Transport::wait) for a same-host transport: polls, then blocks in
/// `poll(2)` until something arrives (at most 100 ms at a time while operations are in flight, so
/// that their timeouts are noticed).
pub(crate) fn wait<T: SameHost>(
    transport: &mut T,
    events: &mut Vec<Event>,
    timeout: Duration,
) -> Result<usize, PollError> {
    let deadline = Instant::now() + timeout;
    loop {
        let n = transport.poll_now(events)?;
        if n > 0 {
            return Ok(n);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(0);
        }
        let mut slice = deadline - now;
        let (control, ledger) = transport.parts();
        // Checked after the poll, which emptied the wake-up descriptor: a wake from now on makes
        // it readable, so the block below returns.
        if control.completions.signal.take() {
            return Ok(0);
        }
        if ledger.busy() {
            slice = slice.min(Duration::from_millis(100));
        }
        control
            .block(slice)
            .map_err(|e| PollError::Backend(Box::new(e)))?;
    }
}

/// [`Transport::send`](crate::Transport::send) for a same-host transport: one frame on the
/// peer's socket, reported at once.
pub(crate) fn send(
    link: Option<&mut Link>,
    ledger: &mut Ledger,
    peer: PeerId,
    message: &[u8],
) -> Result<OpId, SendError> {
    if message.len() > MAX_MESSAGE_LEN {
        return Err(SendError::TooLarge {
            len: message.len(),
            max: MAX_MESSAGE_LEN,
        });
    }
    let link = link.ok_or(SendError::UnknownPeer(peer))?;
    let result = link
        .send_message(message)
        .map_err(|e| OpError::PeerUnreachable {
            source: Box::new(e),
        });
    Ok(ledger.done_now(peer, OpKind::Send, result))
}

/// The error of an operation towards a peer whose socket is closed.
pub(crate) fn peer_gone() -> OpError {
    OpError::PeerUnreachable {
        source: "the peer closed its connection (it exited or dropped its endpoint)".into(),
    }
}

/// Whether the process at the other end of `conn` runs as this process's effective user.
fn same_user(conn: &UnixStream) -> bool {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: u32::MAX,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes a `ucred` into the live local `cred`, whose size is passed.
    let ok = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &raw mut len,
        )
    } == 0;
    // SAFETY: geteuid has no preconditions.
    ok && cred.uid == unsafe { libc::geteuid() }
}

/// Parses complete frames off the front of `buf` into events; true when the stream is malformed
/// (the connection is then dropped).
pub(crate) fn parse_frames(buf: &mut Vec<u8>, events: &mut VecDeque<Event>) -> bool {
    let mut at = 0;
    let malformed = loop {
        let rest = &buf[at..];
        match rest.first() {
            None => break false,
            Some(&FRAME_NOTICE) => {
                if rest.len() < 9 {
                    break false;
                }
                let n = u64::from_le_bytes(rest[1..9].try_into().unwrap_or_default());
                events.push_back(Event::Notice(Notice(n)));
                at += 9;
            }
            Some(&FRAME_MESSAGE) => {
                if rest.len() < 5 {
                    break false;
                }
                let len = u32::from_le_bytes(rest[1..5].try_into().unwrap_or_default()) as usize;
                if len > MAX_MESSAGE_LEN {
                    break true;
                }
                if rest.len() < 5 + len {
                    break false;
                }
                events.push_back(Event::Message(rest[5..5 + len].to_vec()));
                at += 5 + len;
            }
            Some(_) => break true,
        }
    };
    buf.drain(..at);
    malformed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_parse_across_partial_reads_and_reject_garbage() {
        let mut events = VecDeque::new();
        let mut stream = vec![FRAME_NOTICE];
        stream.extend_from_slice(&42u64.to_le_bytes());
        stream.push(FRAME_MESSAGE);
        stream.extend_from_slice(&3u32.to_le_bytes());
        stream.extend_from_slice(b"abc");
        let mut buf = Vec::new();
        for byte in &stream {
            buf.push(*byte);
            assert!(!parse_frames(&mut buf, &mut events));
        }
        assert!(buf.is_empty());
        assert!(matches!(events[0], Event::Notice(Notice(42))));
        assert!(matches!(&events[1], Event::Message(m) if m == b"abc"));
        let mut garbage = vec![0x77, 1, 2];
        assert!(parse_frames(&mut garbage, &mut events));
        let mut huge = vec![FRAME_MESSAGE];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_frames(&mut huge, &mut events));
    }

    #[test]
    fn identities_round_trip_and_truncation_is_named() {
        let who = Identity {
            pid: 7,
            incarnation: 0xfeed,
            socket: "kvx-test/7/0/feed".into(),
        };
        let bytes = encode_head(*b"KVXT", 3, &who);
        let mut reader = Reader::open(&bytes, *b"KVXT", 3).unwrap();
        assert_eq!(Identity::decode(&mut reader).unwrap(), who);
        reader.finish().unwrap();
        for cut in 0..bytes.len() {
            let decoded =
                Reader::open(&bytes[..cut], *b"KVXT", 3).and_then(|mut r| Identity::decode(&mut r));
            assert!(decoded.is_err(), "prefix {cut}");
        }
        assert!(Reader::open(&bytes, *b"KVXT", 4).is_err());
        assert!(Reader::open(&bytes, *b"XXXX", 3).is_err());
    }

    #[test]
    fn the_ledger_reports_each_operation_once_and_times_out_the_rest() {
        let mut ledger = Ledger::default();
        let a = ledger.start(PeerId(0), OpKind::Write, 100, vec![3]);
        let b = ledger.start(PeerId(1), OpKind::Read, 50, vec![4]);
        assert_eq!((a, b), (OpId(0), OpId(1)));
        assert_eq!(ledger.using(3), 1);
        assert_eq!(ledger.using(9), 0);
        // `a` finishes, an unknown id is ignored, `b` stays in flight.
        ledger.settle(vec![(0, Ok(())), (77, Ok(()))], Duration::from_secs(60));
        let mut events = Vec::new();
        assert_eq!(ledger.drain_into(&mut events), 1);
        assert!(matches!(
            events[0],
            Event::WriteDone {
                op: OpId(0),
                bytes: 100,
                ..
            }
        ));
        assert!(ledger.busy());
        // A zero timeout expires `b`; its late result is dropped, not reported twice.
        ledger.settle(Vec::new(), Duration::ZERO);
        ledger.settle(vec![(1, Ok(()))], Duration::ZERO);
        events.clear();
        assert_eq!(ledger.drain_into(&mut events), 1);
        assert!(matches!(
            events[0],
            Event::Failed {
                op: OpId(1),
                error: OpError::TimedOut(_),
                ..
            }
        ));
        assert!(!ledger.busy());
        assert_eq!(ledger.using(4), 0);
        // Immediate outcomes get ids of their own.
        let c = ledger.done_now(PeerId(0), OpKind::Send, Ok(()));
        assert_eq!(c, OpId(2));
    }

    #[test]
    fn messages_and_notices_cross_a_socket_and_wake_the_waiter() {
        let mut control = Control::open("test").unwrap();
        let mut link = Link::connect(&control.identity().socket).unwrap();
        assert!(link.alive());
        link.send_message(b"hello").unwrap();
        assert_eq!(link.notices().send_all(&[99, 100, 101]).0, 3);
        let mut events = VecDeque::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while events.len() < 4 {
            control.block(Duration::from_millis(100)).unwrap();
            control.receive(&mut events).unwrap();
            assert!(Instant::now() < deadline);
        }
        assert!(matches!(&events[0], Event::Message(m) if m == b"hello"));
        // One write of three frames: three notices, in order.
        for (event, want) in events.iter().skip(1).zip([99, 100, 101]) {
            assert!(
                matches!(event, Event::Notice(Notice(n)) if *n == want),
                "{event:?}"
            );
        }
        // Nothing new: the poll reads nothing and the wake-up descriptor is not readable.
        assert!(!control.receive(&mut events).unwrap());
        assert_eq!(events.len(), 4);
        control.completions().push_all([(5, Ok(()))]);
        control.block(Duration::from_secs(5)).unwrap();
        let signalled = control.receive(&mut events).unwrap();
        assert!(
            signalled,
            "the worker's report made the descriptor readable"
        );
        let done = control.completed(signalled);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].0, 5);
        // Emptied: the next poll finds it quiet again.
        assert!(!control.receive(&mut events).unwrap());
        drop(control);
        // The peer's socket is gone: the link notices within a millisecond or two.
        std::thread::sleep(Duration::from_millis(5));
        assert!(!link.alive());
    }
}
