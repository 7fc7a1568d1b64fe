//! The control channel: kvx wire frames over TCP, one connection per (decode rank, prefill rank).
//! Reads block on the socket in a reader thread per connection (never a busy poll); writes go
//! through a shared, locked stream so any thread can send.
//!
//! Between two processes of one host (Linux) the connection is a Unix socket instead: a
//! producer listens on one beside its TCP listener, named after the TCP address
//! ([`local_name`], in the abstract namespace, which is the network namespace's, as TCP ports
//! are), and a consumer whose peer's address is one of this host's tries it first. A message
//! then costs the sender about half the CPU that loopback TCP costs, whose receive path runs in
//! the sender's system call.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use kvx_core::wire::Role;
use kvx_core::wire::{DecodeError, EncodeError, FrameHeader, Hello, Message, HEADER_LEN};
use kvx_layout::Layout;
use kvx_rdma::desc::EndpointDesc;
use kvx_rdma::local_peer::Process;
use socket2::Socket;

use crate::config::ConnectorConfig;

pub mod capability;
mod link;
mod local;
pub(crate) mod secure;

pub(crate) use link::LinkError;
pub(crate) use local::{connect_local, listen_local, same_user};
use secure::{AuthKey, Cipher, HandshakeError, Received};

/// Why a control connection failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// Connecting to the peer failed.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The peer's control address.
        addr: SocketAddr,
        /// The socket error.
        source: io::Error,
    },
    /// Reading from the peer failed or the peer closed the connection.
    #[error("control read failed: {0}")]
    Read(#[source] io::Error),
    /// Writing to the peer failed.
    #[error("control write failed: {0}")]
    Write(#[source] io::Error),
    /// The peer sent bytes that are not a valid frame.
    #[error("malformed control frame: {0}")]
    Decode(#[from] DecodeError),
    /// A message could not be encoded.
    #[error("cannot encode control message: {0}")]
    Encode(#[from] EncodeError),
}

/// A control connection's stream: a TCP connection, or a Unix socket to a peer on this host.
/// One [`Socket`] holds either. Once authenticated ([`ControlStream::authenticate`]) its
/// reads and writes carry the connection's encrypted messages.
#[derive(Debug)]
pub(crate) struct ControlStream {
    socket: Socket,
    local: bool,
    /// The process at the other end of a Unix socket (`SO_PEERCRED`).
    process: Option<Process>,
    cipher: Option<Arc<Cipher>>,
    received: Received,
}

impl ControlStream {
    /// A TCP connection.
    pub(crate) fn tcp(stream: TcpStream) -> Self {
        Self {
            socket: stream.into(),
            local: false,
            process: None,
            cipher: None,
            received: Received::default(),
        }
    }

    /// A Unix socket to a peer on this host.
    pub(crate) fn local(stream: UnixStream) -> Self {
        // A pid of 0: the peer is in a pid namespace this one does not see.
        let process = Process::peer_of(&stream).ok().filter(|p| p.pid() > 0);
        Self::local_to(stream, process)
    }

    /// A Unix socket to `process` on this host (tests name a process other than the socket's).
    pub(crate) fn local_to(stream: UnixStream, process: Option<Process>) -> Self {
        Self {
            socket: stream.into(),
            local: true,
            process,
            cipher: None,
            received: Received::default(),
        }
    }

    /// Runs the authentication handshake with `key` (as the side that connected, or the side
    /// that accepted); from then on every byte is encrypted and authenticated. The socket's
    /// timeouts bound each step.
    pub(crate) fn authenticate(
        &mut self,
        key: &AuthKey,
        initiator: bool,
    ) -> Result<(), HandshakeError> {
        let mut raw = Quiet(&self.socket);
        let cipher = if initiator {
            secure::initiate(key, &mut raw)?
        } else {
            secure::respond(key, &mut raw)?
        };
        self.cipher = Some(Arc::new(cipher));
        Ok(())
    }

    /// The bytes to put on the wire for `plaintext`: sealed on an authenticated connection.
    fn seal(&self, plaintext: Vec<u8>) -> io::Result<Vec<u8>> {
        match &self.cipher {
            Some(cipher) => cipher.seal(&plaintext),
            None => Ok(plaintext),
        }
    }

    /// The peer, for logs: its address (TCP) or `this host`.
    pub(crate) fn peer(&self) -> String {
        if self.local {
            return "this host".to_owned();
        }
        self.socket
            .peer_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .map_or_else(|| "an unknown peer".to_owned(), |a| a.ip().to_string())
    }

    /// Another handle on the connection (sharing its encryption state; each handle's reads
    /// are its own, so only one handle reads).
    pub(crate) fn try_clone(&self) -> io::Result<Self> {
        Ok(Self {
            socket: self.socket.try_clone()?,
            local: self.local,
            process: self.process,
            cipher: self.cipher.clone(),
            received: Received::default(),
        })
    }

    /// Shuts down reading, writing or both.
    pub(crate) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.socket.shutdown(how)
    }

    /// Bounds blocking reads (`None`: no bound).
    pub(crate) fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.socket.set_read_timeout(timeout)
    }

    /// Bounds blocking writes (`None`: no bound).
    pub(crate) fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.socket.set_write_timeout(timeout)
    }

    /// Whether this is a Unix socket to a peer on this host.
    pub(crate) fn is_local(&self) -> bool {
        self.local
    }

    /// The process at the other end, where this host's kernel says (a Unix socket).
    pub(crate) fn process(&self) -> Option<Process> {
        self.process
    }
}

impl Read for ControlStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Self {
            socket,
            cipher,
            received,
            ..
        } = self;
        match cipher {
            Some(cipher) => received.read(cipher, &mut &*socket, buf),
            None => (&*socket).read(buf),
        }
    }
}

impl Write for ControlStream {
    /// Takes all of `buf` or nothing: on an authenticated connection it goes out as whole
    /// sealed messages.
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.cipher.is_none() {
            return Quiet(&self.socket).write(buf);
        }
        let sealed = self.seal(buf.to_vec())?;
        Quiet(&self.socket).write_all(&sealed)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        (&self.socket).flush()
    }
}

/// A control socket's bytes, written without `SIGPIPE` (`MSG_NOSIGNAL`): a peer that closed its
/// end is an `EPIPE` error, not a signal that would end a process which did not ignore it (an
/// engine written in C, say; Rust and Python programs ignore it).
struct Quiet<'a>(&'a Socket);

impl Read for Quiet<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self.0).read(buf)
    }
}

impl Write for Quiet<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.send_with_flags(buf, libc::MSG_NOSIGNAL)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsFd for ControlStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

/// Reads one frame (blocking). The payload's memory grows with the bytes that arrive, not with
/// the length the header claims, so a peer that announces a large frame and trickles it holds
/// no more memory than it sent.
pub(crate) fn read_message(stream: &mut impl Read) -> Result<Message, ControlError> {
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header).map_err(ControlError::Read)?;
    let parsed = FrameHeader::parse(&header)?;
    let len = u64::from(parsed.payload_len);
    let mut payload = Vec::with_capacity(usize::try_from(len.min(64 * 1024)).unwrap_or(0));
    let read = stream
        .take(len)
        .read_to_end(&mut payload)
        .map_err(ControlError::Read)?;
    if read as u64 != len {
        return Err(ControlError::Read(io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(Message::decode_payload(parsed.kind, &payload)?)
}

/// Reads one frame from `stream`, all of it before `deadline` (however the peer spaces its
/// bytes out: each read waits only for what is left of the time).
pub(crate) fn read_message_before(
    stream: &mut ControlStream,
    deadline: std::time::Instant,
) -> Result<Message, ControlError> {
    struct Before<'a>(&'a mut ControlStream, std::time::Instant);
    impl Read for Before<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let left = self.1.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the peer's message did not arrive in time",
                ));
            }
            self.0.set_read_timeout(Some(left))?;
            self.0.read(buf)
        }
    }
    read_message(&mut Before(stream, deadline))
}

/// The sending half of a control connection, shareable between threads.
#[derive(Clone, Debug)]
pub(crate) struct ControlSender {
    out: Arc<Mutex<Outgoing>>,
}

/// A connection's stream, and the bytes of messages that [`ControlSender::send_or_queue`]
/// could not hand to the kernel at once (they go first, in order).
#[derive(Debug)]
struct Outgoing {
    stream: ControlStream,
    backlog: Vec<u8>,
}

impl Outgoing {
    fn flush(&mut self) -> Result<(), ControlError> {
        if self.backlog.is_empty() {
            return Ok(());
        }
        let backlog = std::mem::take(&mut self.backlog);
        // Already sealed: straight to the socket.
        Quiet(&self.stream.socket)
            .write_all(&backlog)
            .map_err(ControlError::Write)
    }
}

impl ControlSender {
    fn lock(&self) -> std::sync::MutexGuard<'_, Outgoing> {
        self.out
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `other` sends on the same connection.
    pub(crate) fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.out, &other.out)
    }

    /// The process at the other end, where this host's kernel says (a Unix socket).
    pub(crate) fn process(&self) -> Option<Process> {
        self.lock().stream.process()
    }

    /// Sends one message (after any queued before it), blocking until the kernel took it.
    pub(crate) fn send(&self, message: &Message) -> Result<(), ControlError> {
        self.send_encoded(message.to_bytes()?)
    }

    /// [`ControlSender::send`] of a message already encoded (`Message::to_bytes`).
    pub(crate) fn send_encoded(&self, bytes: Vec<u8>) -> Result<(), ControlError> {
        let mut out = self.lock();
        out.flush()?;
        // Sealed under the lock: the messages' counters follow their order on the wire.
        let sealed = out.stream.seal(bytes).map_err(ControlError::Write)?;
        Quiet(&out.stream.socket)
            .write_all(&sealed)
            .map_err(ControlError::Write)
    }

    /// Sends one message without ever blocking: what the kernel does not take at once (its
    /// send buffer is full) waits, in order, for [`ControlSender::flush`]. Returns whether
    /// something waits.
    #[cfg(test)]
    pub(crate) fn send_or_queue(&self, message: &Message) -> Result<bool, ControlError> {
        self.send_or_queue_encoded(message.to_bytes()?)
    }

    /// [`ControlSender::send_or_queue`] of a message already encoded (`Message::to_bytes`).
    pub(crate) fn send_or_queue_encoded(&self, bytes: Vec<u8>) -> Result<bool, ControlError> {
        let mut out = self.lock();
        let bytes = out.stream.seal(bytes).map_err(ControlError::Write)?;
        if !out.backlog.is_empty() {
            out.backlog.extend_from_slice(&bytes);
            return Ok(true);
        }
        let socket = socket2::SockRef::from(&out.stream);
        let mut sent = 0;
        while sent < bytes.len() {
            match socket.send_with_flags(&bytes[sent..], libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(ControlError::Write(e)),
            }
        }
        out.backlog.extend_from_slice(&bytes[sent..]);
        Ok(!out.backlog.is_empty())
    }

    /// Sends what [`ControlSender::send_or_queue`] left waiting, blocking until the kernel took
    /// it.
    pub(crate) fn flush(&self) -> Result<(), ControlError> {
        self.lock().flush()
    }

    /// Whether bytes wait for [`ControlSender::flush`].
    #[cfg(test)]
    pub(crate) fn backlogged(&self) -> bool {
        !self.lock().backlog.is_empty()
    }

    /// Closes both directions; the reader thread then ends.
    pub(crate) fn close(&self) {
        let _ = self.lock().stream.shutdown(Shutdown::Both);
    }
}

/// How long a control connection may carry nothing before TCP keep-alive probes start.
pub(crate) const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// Between keep-alive probes.
pub(crate) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered probes after which the connection is dead.
pub(crate) const KEEPALIVE_PROBES: u32 = 3;
/// How long sent data may stay unacknowledged before the connection is dead.
pub(crate) const UNACKED_LIMIT: Duration = Duration::from_secs(25);

/// Makes a peer that vanished without closing (host down, network cut) fail the connection
/// within about 25 s instead of never: a blocked read then ends with an error, as for a peer
/// that closed, and everything that depended on the connection is failed and released. (A Unix
/// socket's peer is on this host: its end closes with its process.)
fn detect_dead_peer(socket: &Socket) -> io::Result<()> {
    socket.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_PROBES),
    )?;
    socket.set_tcp_user_timeout(Some(UNACKED_LIMIT))
}

/// A sender over a clone of `stream` (a connection of either side, once its handshake is
/// done): over TCP, no Nagle delay, and a dead peer is detected.
pub(crate) fn sender(stream: &ControlStream) -> io::Result<ControlSender> {
    if !stream.local {
        stream.socket.set_tcp_nodelay(true)?;
        detect_dead_peer(&stream.socket)?;
    }
    Ok(ControlSender {
        out: Arc::new(Mutex::new(Outgoing {
            stream: stream.try_clone()?,
            backlog: Vec::new(),
        })),
    })
}

/// Reads messages until the connection fails, handing each (and finally the error that ended
/// the connection) to `deliver`; stops early when `deliver` returns false.
pub(crate) fn read_loop(
    mut reader: ControlStream,
    mut deliver: impl FnMut(Result<(Message, Queued), ControlError>) -> bool,
) {
    let budget = Budget::default();
    loop {
        // Wait for room first: while the driver has not handled this connection's earlier
        // messages, its socket is not read, and a peer that floods fills its own send buffer.
        let room = budget.take();
        let result = read_message(&mut reader).map(|m| (m, room));
        let failed = result.is_err();
        if !deliver(result) || failed {
            let _ = reader.shutdown(Shutdown::Both);
            return;
        }
    }
}

/// Most messages of one control connection waiting in its driver's queue at once.
pub(crate) const MAX_QUEUED_MESSAGES: usize = 1024;

/// A control connection's room in its driver's queue: [`MAX_QUEUED_MESSAGES`] places.
#[derive(Debug, Default)]
struct Budget(Arc<AtomicUsize>);

impl Budget {
    /// A place, once one is free (waiting in short sleeps: only a connection whose peer sends
    /// faster than the driver handles ever waits).
    fn take(&self) -> Queued {
        while self.0.load(Ordering::Acquire) >= MAX_QUEUED_MESSAGES {
            thread::sleep(Duration::from_micros(200));
        }
        self.0.fetch_add(1, Ordering::AcqRel);
        Queued(Arc::clone(&self.0))
    }
}

/// A message's place in its driver's queue, given back when the command that carries it is
/// handled or dropped.
#[derive(Debug)]
pub(crate) struct Queued(Arc<AtomicUsize>);

impl Queued {
    /// A place outside any budget (messages a test hands a state machine).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn unbounded() -> Self {
        Self(Arc::default())
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A control connection dialled and past its handshake: its sender, the stream its reader
/// reads ([`read_loop`]), and the peer's hello.
#[derive(Debug)]
pub(crate) struct Dialled {
    pub(crate) sender: ControlSender,
    pub(crate) reader: ControlStream,
    pub(crate) hello: Hello,
}

impl Dialled {
    /// Splits `stream` into its sender and the stream to read.
    ///
    /// # Errors
    /// The socket's options cannot be set or it cannot be cloned.
    pub(crate) fn new(stream: ControlStream, hello: Hello) -> io::Result<Self> {
        Ok(Self {
            sender: sender(&stream)?,
            reader: stream,
            hello,
        })
    }
}

/// Connects with a bounded wait: with `local`, over the producer's Unix socket where `addr` is
/// this host's and it has one, else over TCP.
pub(crate) fn connect(
    addr: SocketAddr,
    timeout: Duration,
    local: bool,
) -> Result<ControlStream, ControlError> {
    if let Some(stream) = local.then(|| connect_local(addr)).flatten() {
        return Ok(ControlStream::local(stream));
    }
    TcpStream::connect_timeout(&addr, timeout)
        .map(ControlStream::tcp)
        .map_err(|source| ControlError::Connect { addr, source })
}

/// Connects to `addr`, authenticates with `key` (where there is one) and exchanges hellos
/// (ours first), each step bounded by `timeout`; the stream is left blocking without a
/// timeout.
pub(crate) fn handshake(
    addr: SocketAddr,
    hello: &Message,
    timeout: Duration,
    local: bool,
    key: Option<&AuthKey>,
) -> Result<(ControlStream, Hello), LinkError> {
    use std::io::Write as _;
    let mut stream = connect(addr, timeout, local)?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(LinkError::Timeouts)?;
    if let Some(key) = key {
        stream
            .authenticate(key, true)
            .map_err(|source| LinkError::Authenticate { addr, source })?;
    }
    let bytes = hello.to_bytes().map_err(ControlError::Encode)?;
    stream
        .write_all(&bytes)
        .map_err(|source| LinkError::SendHello { addr, source })?;
    let theirs = match read_message(&mut stream) {
        Ok(Message::Hello(h)) => h,
        Ok(_) => return Err(LinkError::NotAHello { addr }),
        Err(source) => return Err(LinkError::NoHello { addr, source }),
    };
    stream
        .set_read_timeout(None)
        .and_then(|()| stream.set_write_timeout(None))
        .map_err(LinkError::Timeouts)?;
    Ok((stream, theirs))
}

/// The hello this side sends; `finishing_hints` as in [`Hello::finishing_hints`].
pub(crate) fn hello(
    config: &ConnectorConfig,
    role: Role,
    layout: &Layout,
    desc: &EndpointDesc,
    finishing_hints: bool,
) -> Hello {
    Hello {
        compat_hash: layout.spec().compat_hash(),
        engine: config.engine,
        incarnation: config.incarnation,
        role,
        layout: layout.spec().clone(),
        regions: desc.regions.clone(),
        transport: desc.backend.clone(),
        transport_addr: desc.to_bytes(),
        finishing_hints,
        write_timeout_ms: match role {
            Role::Producer | Role::Consumer => {
                u32::try_from(config.transfer_timeout.as_millis()).unwrap_or(u32::MAX)
            }
            _ => 0,
        },
    }
}

/// The transport a hello's side moves KV over, as `backend/provider` (`libfabric/shm`,
/// `nixl/UCX`); `None` for an unreadable description.
pub(crate) fn transport_name(hello: &Hello) -> Option<String> {
    peer_desc(hello).map(|d| format!("{}/{}", d.backend, d.provider))
}

/// The peer's endpoint description from its hello.
pub(crate) fn peer_desc(hello: &Hello) -> Option<EndpointDesc> {
    EndpointDesc::from_bytes(&hello.transport_addr).ok()
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    /// A peer that does not read fills the send buffer: `send_or_queue` then queues instead of
    /// blocking, later messages queue behind, and a flush delivers everything in order.
    #[test]
    fn a_full_send_buffer_queues_messages_in_order_and_never_blocks() {
        use kvx_core::wire::Heartbeat;
        use kvx_core::{EngineId, Incarnation, TransferId};
        use std::time::Instant;

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let dialled = connect(
            listener.local_addr().unwrap(),
            Duration::from_secs(5),
            false,
        )
        .unwrap();
        let (accepted, _) = listener.accept().unwrap();
        socket2::SockRef::from(&dialled)
            .set_send_buffer_size(4096)
            .unwrap();
        socket2::SockRef::from(&accepted)
            .set_recv_buffer_size(4096)
            .unwrap();
        let out = sender(&dialled).unwrap();
        let message = |i: u128| {
            Message::Heartbeat(Heartbeat {
                engine: EngineId(1),
                incarnation: Incarnation(2),
                transfers: (0..50).map(|t| TransferId(i * 100 + t)).collect(),
            })
        };
        let started = Instant::now();
        let mut sent = 0;
        while !out.send_or_queue(&message(sent)).unwrap() {
            sent += 1;
            assert!(sent < 100_000, "the send buffer never filled");
        }
        sent += 1;
        for _ in 0..10 {
            assert!(out.send_or_queue(&message(sent)).unwrap(), "queued behind");
            sent += 1;
        }
        assert!(out.backlogged());
        assert!(started.elapsed() < Duration::from_secs(5), "it blocked");
        let reader = thread::spawn(move || {
            let mut accepted = accepted;
            (0..sent)
                .map(|_| read_message(&mut accepted).unwrap())
                .collect::<Vec<_>>()
        });
        out.flush().unwrap();
        assert!(!out.backlogged());
        assert_eq!(
            reader.join().unwrap(),
            (0..sent).map(message).collect::<Vec<_>>()
        );
    }

    /// Sending to a peer that closed its end is an error, never `SIGPIPE`, which would end a
    /// process that keeps the signal's default action (an engine written in C; the test
    /// harness, like any Rust program, ignores it): checked in a child process (this test run
    /// again) that restores the default, over a Unix socket and over TCP, plain and sealed.
    #[test]
    fn sending_to_a_closed_peer_is_an_error_not_a_sigpipe() {
        use kvx_core::wire::Heartbeat;
        use kvx_core::{EngineId, Incarnation};

        if !kvx_testkit::in_child(
            "control::tests::sending_to_a_closed_peer_is_an_error_not_a_sigpipe",
        ) {
            return;
        }
        // SAFETY: sets the default action of one signal, before any thread of this test sends
        // on a socket; no handler (no Rust code) runs on a signal.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let heartbeat = Message::Heartbeat(Heartbeat {
            engine: EngineId(1),
            incarnation: Incarnation(2),
            transfers: Vec::new(),
        });
        let (ours, theirs) = UnixStream::pair().unwrap();
        drop(theirs);
        let local = sender(&ControlStream::local(ours)).unwrap();
        assert!(local.send(&heartbeat).is_err(), "a Unix socket");
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let dialled = connect(
            listener.local_addr().unwrap(),
            Duration::from_secs(5),
            false,
        )
        .unwrap();
        drop(listener.accept().unwrap());
        let tcp = sender(&dialled).unwrap();
        // The first send may still be taken (the peer's reset answers it).
        let _ = tcp.send(&heartbeat);
        thread::sleep(Duration::from_millis(50));
        assert!(tcp.send(&heartbeat).is_err(), "TCP");
        let key = secure::AuthKey::from_bytes([5; 32]);
        let (a, b) = UnixStream::pair().unwrap();
        let responder = thread::spawn({
            let key = key.clone();
            move || {
                let mut b = ControlStream::local(b);
                b.authenticate(&key, false).unwrap();
            }
        });
        let mut a = ControlStream::local(a);
        a.authenticate(&key, true).unwrap();
        responder.join().unwrap();
        let sealed = sender(&a).unwrap();
        assert!(sealed.send(&heartbeat).is_err(), "an authenticated socket");
    }

    #[test]
    fn both_ends_of_a_control_connection_detect_a_dead_peer() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let dialled = connect(
            listener.local_addr().unwrap(),
            Duration::from_secs(5),
            false,
        )
        .unwrap();
        let accepted = ControlStream::tcp(listener.accept().unwrap().0);
        for stream in [&dialled, &accepted] {
            let _sender = sender(stream).unwrap();
            let socket = socket2::SockRef::from(stream);
            assert!(socket.keepalive().unwrap());
            assert_eq!(socket.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
            assert_eq!(socket.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
            assert_eq!(socket.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
            assert_eq!(socket.tcp_user_timeout().unwrap(), Some(UNACKED_LIMIT));
            assert!(socket.tcp_nodelay().unwrap());
        }
    }

    /// A frame each way over `a` and `b`, two ends of one connection.
    fn talk(a: &mut ControlStream, b: &mut ControlStream) {
        use kvx_core::wire::Abort;
        use kvx_core::TransferId;
        let message = |t| {
            Message::Abort(Abort {
                transfer: TransferId(t),
                attempt: None,
                reason: "test".into(),
                capability: None,
            })
        };
        a.write_all(&message(1).to_bytes().unwrap()).unwrap();
        assert_eq!(read_message(b).unwrap(), message(1));
        b.write_all(&message(2).to_bytes().unwrap()).unwrap();
        assert_eq!(read_message(a).unwrap(), message(2));
    }

    /// A producer of this host is reached over the Unix socket beside its TCP listener, whether
    /// it listens on the address dialled or on the wildcard address of its port; with `local`
    /// off, or without that socket, over TCP.
    #[test]
    fn a_producer_on_this_host_is_reached_over_its_unix_socket() {
        for bind in ["127.0.0.1:0", "0.0.0.0:0"] {
            let listener = TcpListener::bind(bind).unwrap();
            let bound = listener.local_addr().unwrap();
            let dial = SocketAddr::from(([127, 0, 0, 1], bound.port()));
            let local = listen_local(bound).unwrap();
            let mut dialled = connect(dial, Duration::from_secs(5), true).unwrap();
            assert!(dialled.is_local(), "{bind}");
            let mut accepted = ControlStream::local(local.accept().unwrap().0);
            talk(&mut dialled, &mut accepted);
            // The same name twice is refused: another producer cannot take it over.
            assert!(listen_local(bound).is_err());
            let mut tcp = connect(dial, Duration::from_secs(5), false).unwrap();
            assert!(!tcp.is_local());
            let mut accepted = ControlStream::tcp(listener.accept().unwrap().0);
            talk(&mut tcp, &mut accepted);
            drop(local);
            let mut tcp = connect(dial, Duration::from_secs(5), true).unwrap();
            assert!(!tcp.is_local(), "no Unix socket any more: TCP");
            let mut accepted = ControlStream::tcp(listener.accept().unwrap().0);
            talk(&mut tcp, &mut accepted);
        }
    }

    /// Over a Unix socket, the reader of a connection whose peer is gone ends at once.
    #[test]
    fn a_unix_peer_that_goes_is_seen_at_once() {
        let (a, b) = UnixStream::pair().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = thread::spawn(move || {
            read_loop(ControlStream::local(b), |result| {
                let failed = result.is_err();
                tx.send(failed).unwrap();
                !failed
            });
        });
        drop(a);
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(true));
        reader.join().unwrap();
    }

    /// A peer that sends faster than its driver handles gets at most `MAX_QUEUED_MESSAGES` of
    /// its messages queued: the reader then stops reading its socket until the driver has
    /// handled some (here: until the held places are given back), and nothing is lost.
    #[test]
    fn a_flooding_peer_holds_a_bounded_share_of_the_queue() {
        use kvx_core::wire::Heartbeat;
        use kvx_core::{EngineId, Incarnation};
        let (a, b) = UnixStream::pair().unwrap();
        let total = 3 * MAX_QUEUED_MESSAGES;
        let writer = thread::spawn(move || {
            let sender = sender(&ControlStream::local(a)).unwrap();
            let hb = Message::Heartbeat(Heartbeat {
                engine: EngineId(1),
                incarnation: Incarnation(1),
                transfers: Vec::new(),
            });
            for _ in 0..total {
                sender.send(&hb).unwrap();
            }
        });
        let held = Arc::new(Mutex::new(Vec::new()));
        let delivered = Arc::new(AtomicUsize::new(0));
        let (h, d) = (Arc::clone(&held), Arc::clone(&delivered));
        let reader = thread::spawn(move || {
            read_loop(ControlStream::local(b), |result| match result {
                Ok((_, queued)) => {
                    h.lock().unwrap().push(queued);
                    d.fetch_add(1, Ordering::SeqCst) + 1 < total
                }
                Err(_) => false,
            });
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while delivered.load(Ordering::SeqCst) < MAX_QUEUED_MESSAGES {
            assert!(
                std::time::Instant::now() < deadline,
                "the reader stalled early"
            );
            thread::sleep(Duration::from_millis(5));
        }
        thread::sleep(Duration::from_millis(200));
        assert_eq!(delivered.load(Ordering::SeqCst), MAX_QUEUED_MESSAGES);
        // The driver handles them: the rest comes, none lost.
        while delivered.load(Ordering::SeqCst) < total {
            held.lock().unwrap().clear();
            assert!(
                std::time::Instant::now() < deadline,
                "the reader did not go on"
            );
            thread::sleep(Duration::from_millis(5));
        }
        held.lock().unwrap().clear();
        writer.join().unwrap();
        reader.join().unwrap();
    }
}
