//! Authenticated control connections: the deployment key ([`AuthKey`]) and the Noise handshake
//! that proves both ends hold it, then encrypts and authenticates every byte (see
//! `docs/security.md`).
//!
//! The pattern is `Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s`: both ends mix the 32-byte deployment
//! key into the handshake from its first message, with ephemeral X25519 keys for forward
//! secrecy. The side that connects (a consumer, a router) initiates; the producer responds.
//! A responder answers only a first message made with the key, and reads the peer's hello only
//! once the handshake is done, so a peer without the key gets nothing; one that replays a
//! captured first message gets an answer it cannot read, and cannot send anything the
//! responder would accept.
//!
//! After the handshake the byte stream travels in Noise transport messages of at most 65,535
//! bytes, each prefixed with its length (2 bytes, big-endian); each direction counts its
//! messages (the nonce), so a dropped, repeated or reordered message fails the connection.

use std::fmt;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The Noise protocol of every authenticated control connection.
pub const NOISE_PATTERN: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";
/// Bound into the handshake: a peer of another protocol fails it.
const PROLOGUE: &[u8] = b"kvx control v1";
/// Largest Noise message.
const MAX_MESSAGE: usize = 65_535;
/// The authentication tag each transport message carries.
const TAG: usize = 16;
/// Largest plaintext piece of one transport message.
const MAX_PIECE: usize = MAX_MESSAGE - TAG;
/// Bytes of a deployment key.
pub(crate) const KEY_LEN: usize = 32;

/// A deployment key: 32 random bytes shared by every prefill, decode and router of one
/// deployment. Its `Debug` shows no byte of it.
#[derive(Clone, PartialEq, Eq)]
pub struct AuthKey([u8; KEY_LEN]);

impl fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuthKey(..)")
    }
}

/// Why a key file cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthKeyError {
    /// The file cannot be read (missing, unreadable).
    #[error("cannot read the kvx key file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Others than its owner may read or write it.
    #[error(
        "the kvx key file {path} has mode {mode:o}: others than its owner can reach it (chmod 600 \
         {path})"
    )]
    Permissions {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// It does not hold exactly 32 bytes.
    #[error("the kvx key file {path} holds {len} bytes, not 32 (make one with `kvx keygen PATH`)")]
    Length {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
    },
    /// A new key file cannot be written (it exists, or its folder is not writable).
    #[error("cannot write the new kvx key file {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// No random bytes from the system.
    #[error("cannot get random bytes for a kvx key: {0}")]
    Random(String),
}

impl AuthKey {
    /// A key of these bytes.
    #[must_use]
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> Self {
        Self(bytes)
    }

    pub(crate) fn bytes(&self) -> &[u8; KEY_LEN] {
        &self.0
    }

    /// Reads a key file: exactly 32 bytes, readable and writable by its owner only.
    ///
    /// # Errors
    /// [`AuthKeyError::Read`], [`AuthKeyError::Permissions`] or [`AuthKeyError::Length`].
    pub fn load(path: &Path) -> Result<Self, AuthKeyError> {
        use std::os::unix::fs::PermissionsExt as _;
        let read = |source| AuthKeyError::Read {
            path: path.to_owned(),
            source,
        };
        let mut file = std::fs::File::open(path).map_err(read)?;
        let meta = file.metadata().map_err(read)?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(AuthKeyError::Permissions {
                path: path.to_owned(),
                mode,
            });
        }
        if meta.len() != KEY_LEN as u64 {
            return Err(AuthKeyError::Length {
                path: path.to_owned(),
                len: meta.len(),
            });
        }
        let mut key = [0u8; KEY_LEN];
        file.read_exact(&mut key).map_err(read)?;
        Ok(Self(key))
    }

    /// Makes a new key of 32 random bytes in a new file at `path` (mode 0600; an existing file
    /// is never overwritten).
    ///
    /// # Errors
    /// [`AuthKeyError::Random`] or [`AuthKeyError::Write`].
    pub fn generate(path: &Path) -> Result<Self, AuthKeyError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut key = [0u8; KEY_LEN];
        getrandom::fill(&mut key).map_err(|e| AuthKeyError::Random(e.to_string()))?;
        let write = |source| AuthKeyError::Write {
            path: path.to_owned(),
            source,
        };
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(write)?;
        file.write_all(&key)
            .and_then(|()| file.sync_all())
            .map_err(write)?;
        Ok(Self(key))
    }
}

/// Why the authenticated handshake failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The socket failed or the peer closed it (a responder closes on a wrong key).
    #[error("the authentication handshake broke off: {0}")]
    Io(#[from] io::Error),
    /// The peer's message does not verify under the deployment key (another key, or none).
    #[error("the peer did not prove it holds the deployment key ({0})")]
    Rejected(snow::Error),
    /// The peer spoke kvx's control protocol without authentication (it has no key).
    #[error("the peer sent a kvx hello without authenticating: it has no deployment key")]
    Unauthenticated,
}

/// The encryption state of one authenticated connection, shared by its sending and receiving
/// halves: each direction has its own key and message counter.
pub(crate) struct Cipher {
    state: Mutex<snow::StatelessTransportState>,
    sent: AtomicU64,
}

impl fmt::Debug for Cipher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cipher")
            .field("sent", &self.sent.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Cipher {
    fn lock(&self) -> std::sync::MutexGuard<'_, snow::StatelessTransportState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `plaintext` as transport messages (length-prefixed), in order. Callers that share a
    /// connection seal under the lock that orders their writes, so that the counter follows the
    /// order on the wire.
    pub(crate) fn seal(&self, plaintext: &[u8]) -> io::Result<Vec<u8>> {
        let pieces = plaintext.len().div_ceil(MAX_PIECE).max(1);
        let mut out = Vec::with_capacity(plaintext.len() + pieces * (TAG + 2));
        let state = self.lock();
        for piece in plaintext.chunks(MAX_PIECE) {
            let nonce = self.sent.fetch_add(1, Ordering::Relaxed);
            // Sealed in place at the end of `out`, after its length.
            let n = piece.len() + TAG;
            out.extend_from_slice(&(n as u16).to_be_bytes());
            let at = out.len();
            out.resize(at + n, 0);
            state
                .write_message(nonce, piece, &mut out[at..])
                .map_err(|e| io::Error::other(format!("encrypting a control message: {e}")))?;
        }
        Ok(out)
    }

    fn open(&self, nonce: u64, message: &[u8], out: &mut [u8]) -> io::Result<usize> {
        self.lock().read_message(nonce, message, out).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a control message failed authentication: {e}"),
            )
        })
    }
}

/// The receiving half's state: plaintext of the last message not yet read, and the count of
/// messages received.
#[derive(Debug, Default)]
pub(crate) struct Received {
    plain: Vec<u8>,
    at: usize,
    count: u64,
    /// The last message as received (reused).
    sealed: Vec<u8>,
}

impl Received {
    /// Reads plaintext into `buf`, receiving (and checking) the next transport message from
    /// `raw` when none is left.
    pub(crate) fn read(
        &mut self,
        cipher: &Cipher,
        raw: &mut impl Read,
        buf: &mut [u8],
    ) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        while self.at == self.plain.len() {
            let mut len = [0u8; 2];
            match raw.read_exact(&mut len) {
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                r => r?,
            }
            let len = usize::from(u16::from_be_bytes(len));
            self.sealed.resize(len, 0);
            raw.read_exact(&mut self.sealed)?;
            // The plaintext is the message less its tag.
            self.plain.resize(len, 0);
            let n = cipher.open(self.count, &self.sealed, &mut self.plain)?;
            self.count += 1;
            self.plain.truncate(n);
            self.at = 0;
        }
        let n = buf.len().min(self.plain.len() - self.at);
        buf[..n].copy_from_slice(&self.plain[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

fn handshake_state(key: &AuthKey, initiator: bool) -> Result<snow::HandshakeState, HandshakeError> {
    let params: snow::params::NoiseParams =
        NOISE_PATTERN.parse().map_err(HandshakeError::Rejected)?;
    let builder = snow::Builder::new(params)
        .psk(0, &key.0)
        .and_then(|b| b.prologue(PROLOGUE))
        .map_err(HandshakeError::Rejected)?;
    if initiator {
        builder.build_initiator()
    } else {
        builder.build_responder()
    }
    .map_err(HandshakeError::Rejected)
}

fn send_handshake(
    hs: &mut snow::HandshakeState,
    stream: &mut impl Write,
) -> Result<(), HandshakeError> {
    let mut buf = [0u8; 256];
    let n = hs
        .write_message(&[], &mut buf)
        .map_err(HandshakeError::Rejected)?;
    let mut framed = Vec::with_capacity(n + 2);
    framed.extend_from_slice(&(n as u16).to_be_bytes());
    framed.extend_from_slice(&buf[..n]);
    stream.write_all(&framed)?;
    Ok(())
}

fn receive_handshake(
    hs: &mut snow::HandshakeState,
    stream: &mut impl Read,
) -> Result<(), HandshakeError> {
    let mut len = [0u8; 2];
    stream.read_exact(&mut len)?;
    // A kvx frame starts with its magic: a peer without a key sent its hello.
    if len == kvx_core::wire::MAGIC {
        return Err(HandshakeError::Unauthenticated);
    }
    let len = usize::from(u16::from_be_bytes(len));
    // The handshake's messages are small: a longer one is not Noise's.
    if len > 256 {
        return Err(HandshakeError::Rejected(snow::Error::Input));
    }
    let mut message = vec![0u8; len];
    stream.read_exact(&mut message)?;
    let mut payload = [0u8; 256];
    hs.read_message(&message, &mut payload)
        .map_err(HandshakeError::Rejected)?;
    Ok(())
}

fn finish(hs: snow::HandshakeState) -> Result<Cipher, HandshakeError> {
    Ok(Cipher {
        state: Mutex::new(
            hs.into_stateless_transport_mode()
                .map_err(HandshakeError::Rejected)?,
        ),
        sent: AtomicU64::new(0),
    })
}

/// The connecting side's handshake over `stream` (its timeouts bound each step).
pub(crate) fn initiate(
    key: &AuthKey,
    stream: &mut (impl Read + Write),
) -> Result<Cipher, HandshakeError> {
    let mut hs = handshake_state(key, true)?;
    send_handshake(&mut hs, stream)?;
    receive_handshake(&mut hs, stream)?;
    finish(hs)
}

/// The accepting side's handshake over `stream`: answers only a first message made with the
/// key.
pub(crate) fn respond(
    key: &AuthKey,
    stream: &mut (impl Read + Write),
) -> Result<Cipher, HandshakeError> {
    let mut hs = handshake_state(key, false)?;
    receive_handshake(&mut hs, stream)?;
    send_handshake(&mut hs, stream)?;
    finish(hs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn pair(
        a: &AuthKey,
        b: &AuthKey,
    ) -> (
        Result<Cipher, HandshakeError>,
        Result<Cipher, HandshakeError>,
    ) {
        let (mut x, mut y) = UnixStream::pair().unwrap();
        let b = b.clone();
        let responder = std::thread::spawn(move || {
            let r = respond(&b, &mut y);
            drop(y); // a rejected initiator then reads the close
            r
        });
        let i = initiate(a, &mut x);
        (i, responder.join().unwrap())
    }

    #[test]
    fn one_key_authenticates_and_carries_bytes_both_ways_in_pieces() {
        let key = AuthKey::from_bytes([7; 32]);
        let (i, r) = pair(&key, &key);
        let (i, r) = (i.unwrap(), r.unwrap());
        // Larger than one transport message: it travels in pieces and comes back whole.
        let big: Vec<u8> = (0..200_000u32).map(|n| (n % 251) as u8).collect();
        let sealed = i.seal(&big).unwrap();
        assert_eq!(sealed.len(), big.len() + 4 * (TAG + 2));
        let mut received = Received::default();
        let mut out = Vec::new();
        let mut raw = &sealed[..];
        let mut buf = [0u8; 7000];
        loop {
            let n = received.read(&r, &mut raw, &mut buf).unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        assert_eq!(out, big);
        // The other direction has its own key: the initiator's messages do not open as the
        // responder's.
        let back = r.seal(b"hello").unwrap();
        let mut raw = &back[..];
        let n = Received::default().read(&i, &mut raw, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hello");
        let mut raw = &sealed[..];
        assert!(Received::default().read(&i, &mut raw, &mut buf).is_err());
    }

    #[test]
    fn a_wrong_key_is_rejected_and_the_responder_sends_nothing() {
        let (i, r) = pair(&AuthKey::from_bytes([1; 32]), &AuthKey::from_bytes([2; 32]));
        assert!(matches!(r, Err(HandshakeError::Rejected(_))), "{r:?}");
        // The responder closed without a byte: the initiator reads the end of the stream.
        assert!(matches!(i, Err(HandshakeError::Io(_))), "{i:?}");
    }

    #[test]
    fn a_peer_without_a_key_is_named_as_such() {
        let (mut x, mut y) = UnixStream::pair().unwrap();
        x.write_all(b"KX\x01\x00rest of a hello").unwrap();
        let r = respond(&AuthKey::from_bytes([3; 32]), &mut y);
        assert!(matches!(r, Err(HandshakeError::Unauthenticated)), "{r:?}");
    }

    #[test]
    fn a_replayed_first_message_gets_an_answer_nothing_can_use() {
        let key = AuthKey::from_bytes([9; 32]);
        // A first message as a legitimate initiator sent it, captured on the wire.
        let mut captured = Vec::new();
        let mut legit = handshake_state(&key, true).unwrap();
        send_handshake(&mut legit, &mut captured).unwrap();
        // Replayed to a responder by a peer without the key (and without the ephemeral
        // secret): the responder answers, but nothing the replayer sends next authenticates.
        let (mut attacker, mut server) = UnixStream::pair().unwrap();
        attacker.write_all(&captured).unwrap();
        let k = key.clone();
        let cipher = std::thread::spawn(move || respond(&k, &mut server))
            .join()
            .unwrap()
            .unwrap();
        let mut answer = [0u8; 2 + 48];
        attacker.read_exact(&mut answer).unwrap();
        let mut forged = vec![0u8, 40];
        forged.extend((0..40u8).map(|b| b.wrapping_mul(37)));
        let mut raw = &forged[..];
        let e = Received::default()
            .read(&cipher, &mut raw, &mut [0u8; 64])
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    }

    #[test]
    fn key_files_are_checked() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("kvx-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("key");
        let made = AuthKey::generate(&path).unwrap();
        assert_eq!(AuthKey::load(&path).unwrap(), made);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(matches!(
            AuthKey::generate(&path),
            Err(AuthKeyError::Write { .. })
        ));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = AuthKey::load(&path).unwrap_err();
        assert!(
            matches!(e, AuthKeyError::Permissions { mode: 0o644, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("chmod 600"), "{e}");
        let short = dir.join("short");
        std::fs::write(&short, [1u8; 31]).unwrap();
        std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(
            AuthKey::load(&short),
            Err(AuthKeyError::Length { len: 31, .. })
        ));
        assert!(matches!(
            AuthKey::load(&dir.join("missing")),
            Err(AuthKeyError::Read { .. })
        ));
        assert_eq!(format!("{made:?}"), "AuthKey(..)");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
