//! The vocabulary every module of the crate shares: peer, operation and notice numbers. A leaf:
//! it depends on nothing else in the crate.

/// A connected peer, as numbered by one endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerId(pub u32);

/// One accepted operation (a write, read or send), as numbered by one endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpId(pub u64);

/// The completion notice a write carries: a value the *consumer* chose (typically a token it put
/// in its registration), delivered to the consumer only after every byte of the write is visible
/// in its memory. Backends carry at most [`Capabilities::notice_bits`](crate::Capabilities::notice_bits) bits of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Notice(pub u64);

/// What kind of operation an [`OpId`] names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// A [`Transport::write`](crate::Transport::write).
    Write,
    /// A [`Transport::read`](crate::Transport::read).
    Read,
    /// A [`Transport::send`](crate::Transport::send).
    Send,
}
