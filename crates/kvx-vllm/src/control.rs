//! The control channel: kvx wire frames over TCP, one connection per (decode rank, prefill rank).
//! Reads block on the socket in a reader thread per connection (never a busy poll); writes go
//! through a shared, locked stream so any thread can send.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use kvx_core::wire::{DecodeError, EncodeError, FrameHeader, Message, HEADER_LEN};

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

/// Reads one frame (blocking).
pub(crate) fn read_message(stream: &mut impl Read) -> Result<Message, ControlError> {
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header).map_err(ControlError::Read)?;
    let parsed = FrameHeader::parse(&header)?;
    let mut payload = vec![0u8; parsed.payload_len as usize];
    stream
        .read_exact(&mut payload)
        .map_err(ControlError::Read)?;
    Ok(Message::decode_payload(parsed.kind, &payload)?)
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
    stream: TcpStream,
    backlog: Vec<u8>,
}

impl Outgoing {
    fn flush(&mut self) -> Result<(), ControlError> {
        if self.backlog.is_empty() {
            return Ok(());
        }
        let backlog = std::mem::take(&mut self.backlog);
        self.stream.write_all(&backlog).map_err(ControlError::Write)
    }
}

impl ControlSender {
    fn lock(&self) -> std::sync::MutexGuard<'_, Outgoing> {
        self.out
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends one message (after any queued before it), blocking until the kernel took it.
    pub(crate) fn send(&self, message: &Message) -> Result<(), ControlError> {
        let bytes = message.to_bytes()?;
        let mut out = self.lock();
        out.flush()?;
        out.stream.write_all(&bytes).map_err(ControlError::Write)
    }

    /// Sends one message without ever blocking: what the kernel does not take at once (its
    /// send buffer is full) waits, in order, for [`ControlSender::flush`]. Returns whether
    /// something waits.
    pub(crate) fn send_or_queue(&self, message: &Message) -> Result<bool, ControlError> {
        let bytes = message.to_bytes()?;
        let mut out = self.lock();
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
/// that closed, and everything that depended on the connection is failed and released.
fn detect_dead_peer(stream: &TcpStream) -> io::Result<()> {
    let socket = socket2::SockRef::from(stream);
    socket.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_PROBES),
    )?;
    socket.set_tcp_user_timeout(Some(UNACKED_LIMIT))
}

/// A sender over a clone of `stream` (a connection of either side, once its handshake is
/// done): no Nagle delay, and a dead peer is detected.
pub(crate) fn sender(stream: &TcpStream) -> io::Result<ControlSender> {
    stream.set_nodelay(true)?;
    detect_dead_peer(stream)?;
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
    mut reader: TcpStream,
    mut deliver: impl FnMut(Result<Message, ControlError>) -> bool,
) {
    loop {
        let result = read_message(&mut reader);
        let failed = result.is_err();
        if !deliver(result) || failed {
            let _ = reader.shutdown(Shutdown::Both);
            return;
        }
    }
}

/// Splits an established stream into a sender and a reader thread running [`read_loop`].
pub(crate) fn start(
    stream: TcpStream,
    name: String,
    deliver: impl FnMut(Result<Message, ControlError>) -> bool + Send + 'static,
) -> io::Result<ControlSender> {
    let sender = sender(&stream)?;
    thread::Builder::new()
        .name(name)
        .spawn(move || read_loop(stream, deliver))?;
    Ok(sender)
}

/// Connects with a bounded wait.
pub(crate) fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStream, ControlError> {
    TcpStream::connect_timeout(&addr, timeout)
        .map_err(|source| ControlError::Connect { addr, source })
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
        let dialled = connect(listener.local_addr().unwrap(), Duration::from_secs(5)).unwrap();
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

    #[test]
    fn both_ends_of_a_control_connection_detect_a_dead_peer() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let dialled = connect(listener.local_addr().unwrap(), Duration::from_secs(5)).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        for stream in [&dialled, &accepted] {
            let _sender = sender(stream).unwrap();
            let socket = socket2::SockRef::from(stream);
            assert!(socket.keepalive().unwrap());
            assert_eq!(socket.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
            assert_eq!(socket.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
            assert_eq!(socket.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
            assert_eq!(socket.tcp_user_timeout().unwrap(), Some(UNACKED_LIMIT));
            assert!(stream.nodelay().unwrap());
        }
    }
}
