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
    stream: Arc<Mutex<TcpStream>>,
}

impl ControlSender {
    /// Sends one message.
    pub(crate) fn send(&self, message: &Message) -> Result<(), ControlError> {
        let bytes = message.to_bytes()?;
        let mut stream = self
            .stream
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        stream.write_all(&bytes).map_err(ControlError::Write)
    }

    /// Closes both directions; the reader thread then ends.
    pub(crate) fn close(&self) {
        let stream = self
            .stream
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = stream.shutdown(Shutdown::Both);
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
        stream: Arc::new(Mutex::new(stream.try_clone()?)),
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
