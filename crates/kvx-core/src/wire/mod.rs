//! The versioned wire messages of the push protocol and their binary codec.
//!
//! Every message travels as one *frame*: an 8-byte header followed by the payload.
//!
//! | bytes | field | value |
//! |---|---|---|
//! | 0..2 | magic | `b"KX"` |
//! | 2 | version | [`PROTOCOL_VERSION`] |
//! | 3 | kind | [`MessageKind`] code |
//! | 4..8 | payload length | `u32`, little endian, at most [`MAX_PAYLOAD`] |
//!
//! Integers are little endian; a list is a `u32` count then its items; a string is a `u32` byte
//! length then UTF-8. Decoding never panics: truncated, oversized, malformed and wrong-version input
//! gives a [`DecodeError`]. The field tables are in `docs/wire-protocol.md`.

mod codec;
mod messages;

pub use codec::{DecodeError, EncodeError, FrameHeader};
pub use messages::{
    Abort, Capability, Claim, Completion, FailureNotice, FailureReason, Finishing, Heartbeat, Held,
    Hello, Message, MessageKind, Registration, Role,
};

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u8 = 7;
/// The frame magic.
pub const MAGIC: [u8; 2] = *b"KX";
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 8;
/// Largest payload accepted or produced: 16 MiB (a 1M-block registration fits).
pub const MAX_PAYLOAD: u32 = 16 << 20;
/// Longest string field (reasons, transport names).
pub const MAX_STRING: usize = 4096;
/// Longest opaque transport address.
pub const MAX_TRANSPORT_ADDR: usize = 64 << 10;
