//! The messages of the push protocol ([`Message`] and one type per kind) and their wire codes.

use crate::blocks::GroupBlocks;
use crate::ids::{Attempt, BlockId, EngineId, Incarnation, Rank, RequestId, TransferId};
use crate::layout::{Arrangement, Dtype, LayoutSpec, MemoryOrder};
use crate::memory::RegionDesc;

/// The message kinds and their wire codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum MessageKind {
    /// [`Hello`].
    Hello = 1,
    /// [`Registration`].
    Registration = 2,
    /// [`Completion`].
    Completion = 3,
    /// [`FailureNotice`].
    Failure = 4,
    /// [`Abort`].
    Abort = 5,
    /// [`Heartbeat`].
    Heartbeat = 6,
    /// [`Finishing`].
    Finishing = 7,
    /// [`Claim`].
    Claim = 8,
    /// [`Held`].
    Held = 9,
}

impl MessageKind {
    pub(super) fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::Hello,
            2 => Self::Registration,
            3 => Self::Completion,
            4 => Self::Failure,
            5 => Self::Abort,
            6 => Self::Heartbeat,
            7 => Self::Finishing,
            8 => Self::Claim,
            9 => Self::Held,
            _ => return None,
        })
    }
}

/// Which side of the disaggregated pair an engine is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Role {
    /// Produces KV (prefill).
    Producer,
    /// Consumes KV (decode).
    Consumer,
    /// Routes requests to both sides (`kvx proxy`): has no cache and no transport, and may
    /// only cancel transfers that no consumer registered ([`Abort`]). Its hello carries an
    /// all-zero layout and no regions.
    Router,
}

/// The first message on a control connection: who the sender is, what its cache looks like and
/// how to reach its memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Hash of what must match between peers (model shape, dtype); see
    /// [`LayoutSpec::compat_hash`].
    pub compat_hash: u64,
    /// The sending engine.
    pub engine: EngineId,
    /// The sender's incarnation: a new value after every restart.
    pub incarnation: Incarnation,
    /// Producer or consumer.
    pub role: Role,
    /// The sending rank's cache layout.
    pub layout: LayoutSpec,
    /// The sending rank's registered regions.
    pub regions: Vec<RegionDesc>,
    /// Transport name (`"libfabric:shm"`, `"nixl:ucx"`, `"loopback"`, ...).
    pub transport: String,
    /// Opaque transport endpoint address.
    pub transport_addr: Vec<u8>,
    /// From a consumer: send a [`Finishing`] message before each transfer's final writes to
    /// this rank (its transport has no wait object, so it reads its transport only while a
    /// notice is due). Producers send `false`.
    pub finishing_hints: bool,
    /// The longest this rank's transfer operations can run, in milliseconds (its transfer
    /// timeout). From a producer, its writes for one registration: a consumer that gives up on
    /// a request holds the request's blocks until this rank confirms that it writes no more,
    /// or for this long (plus a margin), since a posted write cannot be recalled. From a
    /// consumer, its reads (pull): a producer holds blocks it claimed ([`Claim`]) for this long
    /// (plus a margin) at most without its completion.
    pub write_timeout_ms: u32,
}

impl Hello {
    /// A router's hello ([`Role::Router`]): no cache (an all-zero layout), no regions, no
    /// transport.
    #[must_use]
    pub fn router(engine: EngineId, incarnation: Incarnation) -> Self {
        Self {
            compat_hash: 0,
            engine,
            incarnation,
            role: Role::Router,
            layout: LayoutSpec {
                num_layers: 0,
                total_kv_heads: 0,
                head_dim: 0,
                dtype: Dtype::F32,
                mla: false,
                block_tokens: 0,
                num_blocks: 0,
                tp_size: 0,
                tp_rank: 0,
                order: MemoryOrder::Nhd,
                arrangement: Arrangement::PerLayerSplit,
            },
            regions: Vec::new(),
            transport: String::new(),
            transport_addr: Vec::new(),
            finishing_hints: false,
            write_timeout_ms: 0,
        }
    }
}

/// Decode tells prefill where one request's KV must land on one decode rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// The router's transfer id.
    pub transfer: TransferId,
    /// The attempt; higher supersedes lower.
    pub attempt: Attempt,
    /// Decode's own request id (for its logs).
    pub request: RequestId,
    /// The registering decode engine.
    pub consumer: EngineId,
    /// Its incarnation.
    pub consumer_incarnation: Incarnation,
    /// The decode rank these blocks belong to.
    pub consumer_rank: Rank,
    /// Prompt tokens whose KV is wanted.
    pub num_tokens: u32,
    /// Leading tokens decode already has (prefix cache hit); they are not written.
    pub skip_tokens: u32,
    /// How long prefill may hold this registration unmatched, in milliseconds.
    pub lease_ms: u32,
    /// The transport notice value the producer rank attaches to its writes: chosen by the
    /// consumer, distinct for every (registration, producer rank), so that the arriving notice
    /// names both.
    pub notice: u64,
    /// Destination blocks, in token order, covering tokens from 0.
    pub blocks: Vec<BlockId>,
    /// Destination blocks of the further KV cache groups of a hybrid model (none for a model
    /// of one group), at most [`MAX_GROUPS`](crate::MAX_GROUPS).
    pub groups: Vec<GroupBlocks>,
    /// The router's grant for this transfer (required by a producer that has a deployment
    /// key).
    pub capability: Option<Capability>,
}

/// A router's grant: one decode engine may take one transfer's KV from one prefill instance
/// until a time. The router signs it with a MAC under (a key derived from) the deployment key;
/// the transfer id is the message's own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capability {
    /// The decode engine it names, or `EngineId(0)`: any decode engine of the deployment.
    pub decode: EngineId,
    /// The prefill instance's control address as the router named it (`HOST:PORT`).
    pub prefill: String,
    /// When it expires, in milliseconds since the Unix epoch.
    pub expires_unix_ms: u64,
    /// The MAC over the transfer id and the fields above.
    pub tag: [u8; 16],
}

/// Prefill tells decode that one producer rank has written everything it will write for a
/// transfer. Sent only after the data is visible at the destination. From a consumer rank to a
/// producer rank: it needs nothing more of that rank for the transfer (pull: it has read the
/// blocks; either mode: its engine reads nothing from that rank, which replicates what another
/// rank serves), so the producer rank may give the blocks back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The transfer.
    pub transfer: TransferId,
    /// The attempt that was written.
    pub attempt: Attempt,
    /// The producing engine.
    pub producer: EngineId,
    /// The producer rank that finished.
    pub producer_rank: Rank,
    /// Bytes written by this rank.
    pub bytes: u64,
    /// From a consumer (pull: it has read the transfer's blocks; or it reads nothing from this
    /// rank): the router's grant, which a producer with a deployment key requires before it
    /// frees them. Producers send `None`.
    pub capability: Option<Capability>,
}

/// Prefill tells a decode rank that asked for it ([`Hello::finishing_hints`]) that one producer
/// rank has begun the final writes of a transfer attempt: its completion notice follows on the
/// transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finishing {
    /// The transfer.
    pub transfer: TransferId,
    /// The attempt being written.
    pub attempt: Attempt,
    /// The producer rank that writes.
    pub producer_rank: Rank,
}

/// Pull: decode tells a producer rank that it is reading a transfer attempt's blocks (sent as
/// its reads are posted). The producer rank holds them until this consumer rank's
/// [`Completion`] (or a bound) and answers [`Held`]; or, holding them no more (its lease ran
/// out, the request was aborted), answers with a [`FailureNotice`], and decode discards what
/// it read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The transfer.
    pub transfer: TransferId,
    /// The attempt being read.
    pub attempt: Attempt,
    /// The router's grant, which a producer with a deployment key requires.
    pub capability: Option<Capability>,
}

/// Pull: a producer rank's answer to a [`Claim`]: the blocks were held when it came and stay
/// held until the claiming rank's [`Completion`] (or a bound), so whatever decode read of them
/// is the request's KV.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// The transfer.
    pub transfer: TransferId,
    /// The attempt held.
    pub attempt: Attempt,
    /// The producer rank that holds it.
    pub producer_rank: Rank,
}

/// Why a transfer failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
#[non_exhaustive]
pub enum FailureReason {
    /// A lease ran out before the other half arrived.
    LeaseExpired = 1,
    /// The peer could not be reached.
    PeerUnreachable = 2,
    /// Posting or completing the writes failed.
    TransferFailed = 3,
    /// The request was aborted.
    Aborted = 4,
    /// The registration was refused (capacity, stale attempt, bad blocks).
    Rejected = 5,
    /// The layouts of the two sides cannot be planned together.
    IncompatibleLayout = 6,
    /// The request was preempted.
    Preempted = 7,
}

impl FailureReason {
    pub(super) fn from_code(code: u16) -> Option<Self> {
        Some(match code {
            1 => Self::LeaseExpired,
            2 => Self::PeerUnreachable,
            3 => Self::TransferFailed,
            4 => Self::Aborted,
            5 => Self::Rejected,
            6 => Self::IncompatibleLayout,
            7 => Self::Preempted,
            _ => return None,
        })
    }
}

/// Either side tells the other that a transfer attempt failed and will not complete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailureNotice {
    /// The transfer.
    pub transfer: TransferId,
    /// The failed attempt.
    pub attempt: Attempt,
    /// The rank reporting the failure.
    pub rank: Rank,
    /// Why.
    pub reason: FailureReason,
    /// Human-readable detail.
    pub detail: String,
}

/// Cancel one attempt, or every attempt, of a transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Abort {
    /// The transfer.
    pub transfer: TransferId,
    /// One attempt, or `None` for every attempt.
    pub attempt: Option<Attempt>,
    /// Human-readable reason.
    pub reason: String,
    /// The router's grant for the transfer (required by a producer that has a deployment key).
    pub capability: Option<Capability>,
}

/// Keeps leases alive for the listed transfers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    /// The sender.
    pub engine: EngineId,
    /// Its incarnation.
    pub incarnation: Incarnation,
    /// Transfers still wanted.
    pub transfers: Vec<TransferId>,
}

/// Every message of the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Message {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`Registration`].
    Registration(Registration),
    /// See [`Completion`].
    Completion(Completion),
    /// See [`FailureNotice`].
    Failure(FailureNotice),
    /// See [`Abort`].
    Abort(Abort),
    /// See [`Heartbeat`].
    Heartbeat(Heartbeat),
    /// See [`Finishing`].
    Finishing(Finishing),
    /// See [`Claim`].
    Claim(Claim),
    /// See [`Held`].
    Held(Held),
}
