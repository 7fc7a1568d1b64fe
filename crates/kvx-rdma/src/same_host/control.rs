//! The socket side of the control plane: an endpoint's listening socket and accepted connections
//! ([`Control`]), links to peers ([`Link`]) with their framed notices and messages, and the
//! completions a backend's worker reports ([`Completions`]).

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{Identity, MAX_MESSAGE_LEN};
use crate::error::OpError;
use crate::transport::{Event, Notice, Waker};
use crate::wake::WakeSignal;

pub(super) const FRAME_NOTICE: u8 = 1;
pub(super) const FRAME_MESSAGE: u8 = 2;

/// Operations finished by a backend's worker, with their outcome; its signal wakes `wait`.
pub(crate) struct Completions {
    done: Mutex<Vec<(u64, Result<(), OpError>)>>,
    /// Rung when operations finish; raised by [`Waker::wake`].
    pub(super) signal: WakeSignal,
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
    /// Connects to the socket named `socket`. With `pid` (`cma`, which copies into the peer's
    /// address space by its pid), that process must serve the socket, as this process's user:
    /// the pid the transport copies into is the process at the other end, not whichever pid an
    /// address names.
    ///
    /// # Errors
    /// The connection's; `PermissionDenied` where another process, or another user's, serves
    /// the socket.
    pub(crate) fn connect(socket: &str, pid: Option<u32>) -> std::io::Result<Self> {
        let addr = SocketAddr::from_abstract_name(socket.as_bytes())?;
        let conn = UnixStream::connect_addr(&addr)?;
        if let Some(pid) = pid {
            let (served_by, uid) = crate::local_peer::peer_credentials(&conn)?;
            if u32::try_from(served_by).ok() != Some(pid) || uid != crate::local_peer::own_uid() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!(
                        "the socket {socket} is served by process {served_by} (uid {uid}), not \
                         by the address's process {pid} of this user"
                    ),
                ));
            }
        }
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
    pub(super) completions: Arc<Completions>,
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
                if crate::local_peer::same_user(&conn) && conn.set_nonblocking(true).is_ok() {
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
