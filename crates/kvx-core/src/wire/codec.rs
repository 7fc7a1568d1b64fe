//! The binary codec: frame headers ([`FrameHeader`]), encoding and decoding of every
//! [`Message`], and what can go wrong either way ([`EncodeError`], [`DecodeError`]).

use thiserror::Error;

use super::messages::{
    Abort, Capability, Claim, Completion, FailureNotice, FailureReason, Finishing, Heartbeat, Held,
    Hello, Message, MessageKind, Registration, Role,
};
use super::{HEADER_LEN, MAGIC, MAX_PAYLOAD, MAX_STRING, MAX_TRANSPORT_ADDR, PROTOCOL_VERSION};
use crate::blocks::{GroupBlocks, MAX_GROUPS};
use crate::ids::{Attempt, BlockId, EngineId, Incarnation, Rank, RequestId, TransferId};
use crate::layout::{Arrangement, Dtype, LayoutSpec, MemoryOrder};
use crate::memory::{MemoryKind, RegionDesc};

/// Why bytes could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The input ends early; `needed` bytes are required in all.
    #[error("truncated input: need {needed} bytes, have {available}")]
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Bytes present.
        available: usize,
    },
    /// The frame does not start with the magic.
    #[error("bad magic {0:02x?}: not a kvx frame")]
    BadMagic([u8; 2]),
    /// The peer speaks another protocol version.
    #[error("unsupported protocol version {got} (this build speaks {supported})")]
    UnsupportedVersion {
        /// Version in the frame.
        got: u8,
        /// Version this build speaks.
        supported: u8,
    },
    /// Unknown message kind code.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// The payload is longer than [`MAX_PAYLOAD`].
    #[error("payload of {len} bytes exceeds the limit of {max}")]
    Oversized {
        /// Declared length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The payload has bytes after its last field.
    #[error("{extra} unexpected bytes after the message")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
    /// A field holds a value outside its domain.
    #[error("invalid value {value} for field `{field}`")]
    InvalidField {
        /// Field name.
        field: &'static str,
        /// The value found.
        value: u64,
    },
    /// A string field is not UTF-8.
    #[error("field `{field}` is not valid UTF-8")]
    InvalidUtf8 {
        /// Field name.
        field: &'static str,
    },
    /// A string, byte or list field is longer than allowed or than the payload.
    #[error("field `{field}` has length {len}, more than the limit of {max}")]
    FieldTooLong {
        /// Field name.
        field: &'static str,
        /// Declared length.
        len: u64,
        /// The limit.
        max: u64,
    },
}

/// Why a message could not be encoded.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The encoded payload would exceed [`MAX_PAYLOAD`].
    #[error("encoded payload of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Payload length.
        len: usize,
        /// The limit.
        max: u32,
    },
    /// A string or byte field is longer than its limit.
    #[error("field `{field}` has length {len}, more than the limit of {max}")]
    FieldTooLong {
        /// Field name.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// A parsed frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// The message kind.
    pub kind: MessageKind,
    /// Payload bytes that follow the header.
    pub payload_len: u32,
}

impl FrameHeader {
    /// Parses and checks a header (magic, version, kind, length limit). Stream readers call this
    /// on the first [`HEADER_LEN`] bytes to learn how many more to read.
    pub fn parse(bytes: &[u8]) -> Result<Self, DecodeError> {
        let header: &[u8; HEADER_LEN] = bytes
            .get(..HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or(DecodeError::Truncated {
                needed: HEADER_LEN,
                available: bytes.len(),
            })?;
        let magic = [header[0], header[1]];
        if magic != MAGIC {
            return Err(DecodeError::BadMagic(magic));
        }
        if header[2] != PROTOCOL_VERSION {
            return Err(DecodeError::UnsupportedVersion {
                got: header[2],
                supported: PROTOCOL_VERSION,
            });
        }
        let kind = MessageKind::from_code(header[3]).ok_or(DecodeError::UnknownKind(header[3]))?;
        let payload_len = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
        if payload_len > MAX_PAYLOAD {
            return Err(DecodeError::Oversized {
                len: u64::from(payload_len),
                max: u64::from(MAX_PAYLOAD),
            });
        }
        Ok(Self { kind, payload_len })
    }
}

impl Message {
    /// The kind of this message.
    #[must_use]
    pub fn kind(&self) -> MessageKind {
        match self {
            Self::Hello(_) => MessageKind::Hello,
            Self::Registration(_) => MessageKind::Registration,
            Self::Completion(_) => MessageKind::Completion,
            Self::Failure(_) => MessageKind::Failure,
            Self::Abort(_) => MessageKind::Abort,
            Self::Heartbeat(_) => MessageKind::Heartbeat,
            Self::Finishing(_) => MessageKind::Finishing,
            Self::Claim(_) => MessageKind::Claim,
            Self::Held(_) => MessageKind::Held,
        }
    }

    /// Appends this message as one frame to `out`. On error `out` is left as it was.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let start = out.len();
        out.extend_from_slice(&MAGIC);
        out.push(PROTOCOL_VERSION);
        out.push(self.kind() as u8);
        out.extend_from_slice(&[0; 4]);
        let mut w = Writer { out };
        let result = match self {
            Self::Hello(m) => w.hello(m),
            Self::Registration(m) => w.registration(m),
            Self::Completion(m) => w.completion(m),
            Self::Failure(m) => w.failure(m),
            Self::Abort(m) => w.abort(m),
            Self::Heartbeat(m) => {
                w.heartbeat(m);
                Ok(())
            }
            Self::Finishing(m) => {
                w.finishing(m);
                Ok(())
            }
            Self::Claim(m) => w.claim(m),
            Self::Held(m) => {
                w.held(m);
                Ok(())
            }
        };
        let payload_len = out.len() - start - HEADER_LEN;
        let outcome = result.and_then(|()| {
            u32::try_from(payload_len)
                .ok()
                .filter(|&len| len <= MAX_PAYLOAD)
                .ok_or(EncodeError::TooLarge {
                    len: payload_len,
                    max: MAX_PAYLOAD,
                })
        });
        match outcome {
            Ok(len) => {
                out[start + 4..start + HEADER_LEN].copy_from_slice(&len.to_le_bytes());
                Ok(())
            }
            Err(e) => {
                out.truncate(start);
                Err(e)
            }
        }
    }

    /// Encodes into a fresh buffer.
    pub fn to_bytes(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        self.encode(&mut out)?;
        Ok(out)
    }

    /// Decodes the frame at the start of `bytes`; returns the message and the bytes it used.
    pub fn decode(bytes: &[u8]) -> Result<(Self, usize), DecodeError> {
        let header = FrameHeader::parse(bytes)?;
        let total = HEADER_LEN + header.payload_len as usize;
        let payload = bytes.get(HEADER_LEN..total).ok_or(DecodeError::Truncated {
            needed: total,
            available: bytes.len(),
        })?;
        Ok((Self::decode_payload(header.kind, payload)?, total))
    }

    /// Decodes a buffer that holds exactly one frame.
    pub fn decode_exact(bytes: &[u8]) -> Result<Self, DecodeError> {
        let (message, used) = Self::decode(bytes)?;
        if used != bytes.len() {
            return Err(DecodeError::TrailingBytes {
                extra: bytes.len() - used,
            });
        }
        Ok(message)
    }

    /// Decodes a payload whose header has already been parsed.
    pub fn decode_payload(kind: MessageKind, payload: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader {
            buf: payload,
            pos: 0,
        };
        let message = match kind {
            MessageKind::Hello => Self::Hello(r.hello()?),
            MessageKind::Registration => Self::Registration(r.registration()?),
            MessageKind::Completion => Self::Completion(r.completion()?),
            MessageKind::Failure => Self::Failure(r.failure()?),
            MessageKind::Abort => Self::Abort(r.abort()?),
            MessageKind::Heartbeat => Self::Heartbeat(r.heartbeat()?),
            MessageKind::Finishing => Self::Finishing(r.finishing()?),
            MessageKind::Claim => Self::Claim(r.claim()?),
            MessageKind::Held => Self::Held(r.held()?),
        };
        let extra = payload.len() - r.pos;
        if extra != 0 {
            return Err(DecodeError::TrailingBytes { extra });
        }
        Ok(message)
    }
}

struct Writer<'a> {
    out: &'a mut Vec<u8>,
}

impl Writer<'_> {
    fn u8(&mut self, v: u8) {
        self.out.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u128(&mut self, v: u128) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn count(&mut self, len: usize) -> Result<(), EncodeError> {
        let len32 = u32::try_from(len).map_err(|_| EncodeError::TooLarge {
            len,
            max: MAX_PAYLOAD,
        })?;
        self.u32(len32);
        Ok(())
    }
    fn bytes(&mut self, field: &'static str, v: &[u8], max: usize) -> Result<(), EncodeError> {
        if v.len() > max {
            return Err(EncodeError::FieldTooLong {
                field,
                len: v.len(),
                max,
            });
        }
        self.count(v.len())?;
        self.out.extend_from_slice(v);
        Ok(())
    }
    fn string(&mut self, field: &'static str, v: &str) -> Result<(), EncodeError> {
        self.bytes(field, v.as_bytes(), MAX_STRING)
    }
    fn layout(&mut self, l: &LayoutSpec) {
        self.u32(l.num_layers);
        self.u32(l.total_kv_heads);
        self.u32(l.head_dim);
        self.u8(dtype_code(l.dtype));
        self.u8(u8::from(l.mla));
        self.u32(l.block_tokens);
        self.u32(l.num_blocks);
        self.u32(l.tp_size);
        self.u32(l.tp_rank);
        self.u8(match l.order {
            MemoryOrder::Nhd => 0,
            MemoryOrder::Hnd => 1,
            MemoryOrder::HndKt => 2,
        });
        self.u8(match l.arrangement {
            Arrangement::PerLayerSplit => 0,
            Arrangement::PerLayerKvHalves => 1,
            Arrangement::PerLayerKvInBlock => 2,
            Arrangement::CrossLayer => 3,
            Arrangement::PerLayerHeadKv => 4,
            Arrangement::PerLayerCellKv => 5,
        });
    }
    fn region(&mut self, r: &RegionDesc) {
        self.u32(r.index);
        let (kind, device) = match r.kind {
            MemoryKind::Host => (0, 0),
            MemoryKind::Cuda { device } => (1, device),
            MemoryKind::Neuron { device } => (2, device),
        };
        self.u8(kind);
        self.u32(device);
        self.u64(r.addr);
        self.u64(r.len);
        self.u64(r.key);
    }
    fn hello(&mut self, m: &Hello) -> Result<(), EncodeError> {
        self.u64(m.compat_hash);
        self.u64(m.engine.0);
        self.u64(m.incarnation.0);
        self.u8(match m.role {
            Role::Producer => 0,
            Role::Consumer => 1,
            Role::Router => 2,
        });
        self.layout(&m.layout);
        self.count(m.regions.len())?;
        for r in &m.regions {
            self.region(r);
        }
        self.string("transport", &m.transport)?;
        self.bytes("transport_addr", &m.transport_addr, MAX_TRANSPORT_ADDR)?;
        self.u8(u8::from(m.finishing_hints));
        self.u32(m.write_timeout_ms);
        Ok(())
    }
    fn capability(&mut self, c: Option<&Capability>) -> Result<(), EncodeError> {
        let Some(c) = c else {
            self.u8(0);
            return Ok(());
        };
        self.u8(1);
        self.u64(c.decode.0);
        self.string("capability.prefill", &c.prefill)?;
        self.u64(c.expires_unix_ms);
        self.out.extend_from_slice(&c.tag);
        Ok(())
    }
    /// A counted list of block ids, the ids in one pass over room made once: no capacity check
    /// per id.
    fn block_ids(&mut self, blocks: &[BlockId]) {
        // A list longer than u32::MAX items cannot fit MAX_PAYLOAD; the length check in `encode`
        // rejects it, so a saturated count here is never sent.
        self.u32(u32::try_from(blocks.len()).unwrap_or(u32::MAX));
        let start = self.out.len();
        self.out.resize(start + 4 * blocks.len(), 0);
        for (slot, b) in self.out[start..].chunks_exact_mut(4).zip(blocks) {
            slot.copy_from_slice(&b.0.to_le_bytes());
        }
    }
    fn registration(&mut self, m: &Registration) -> Result<(), EncodeError> {
        self.u128(m.transfer.0);
        self.u32(m.attempt.0);
        self.u64(m.request.0);
        self.u64(m.consumer.0);
        self.u64(m.consumer_incarnation.0);
        self.u32(m.consumer_rank.0);
        self.u32(m.num_tokens);
        self.u32(m.skip_tokens);
        self.u32(m.lease_ms);
        self.u64(m.notice);
        self.block_ids(&m.blocks);
        if m.groups.len() > MAX_GROUPS {
            return Err(EncodeError::FieldTooLong {
                field: "groups",
                len: m.groups.len(),
                max: MAX_GROUPS,
            });
        }
        self.count(m.groups.len())?;
        for group in &m.groups {
            self.u32(group.first_token);
            self.block_ids(&group.blocks);
        }
        self.capability(m.capability.as_ref())
    }
    fn completion(&mut self, m: &Completion) -> Result<(), EncodeError> {
        self.u128(m.transfer.0);
        self.u32(m.attempt.0);
        self.u64(m.producer.0);
        self.u32(m.producer_rank.0);
        self.u64(m.bytes);
        self.capability(m.capability.as_ref())
    }
    fn failure(&mut self, m: &FailureNotice) -> Result<(), EncodeError> {
        self.u128(m.transfer.0);
        self.u32(m.attempt.0);
        self.u32(m.rank.0);
        self.u16(m.reason as u16);
        self.string("detail", &m.detail)
    }
    fn abort(&mut self, m: &Abort) -> Result<(), EncodeError> {
        self.u128(m.transfer.0);
        match m.attempt {
            None => self.u8(0),
            Some(a) => {
                self.u8(1);
                self.u32(a.0);
            }
        }
        self.string("reason", &m.reason)?;
        self.capability(m.capability.as_ref())
    }
    fn finishing(&mut self, m: &Finishing) {
        self.u128(m.transfer.0);
        self.u32(m.attempt.0);
        self.u32(m.producer_rank.0);
    }
    fn claim(&mut self, m: &Claim) -> Result<(), EncodeError> {
        self.u128(m.transfer.0);
        self.u32(m.attempt.0);
        self.capability(m.capability.as_ref())
    }
    fn held(&mut self, m: &Held) {
        self.u128(m.transfer.0);
        self.u32(m.attempt.0);
        self.u32(m.producer_rank.0);
    }
    fn heartbeat(&mut self, m: &Heartbeat) {
        self.u64(m.engine.0);
        self.u64(m.incarnation.0);
        self.u32(u32::try_from(m.transfers.len()).unwrap_or(u32::MAX));
        for t in &m.transfers {
            self.u128(t.0);
        }
    }
}

fn dtype_code(d: Dtype) -> u8 {
    match d {
        Dtype::F32 => 0,
        Dtype::F16 => 1,
        Dtype::Bf16 => 2,
        Dtype::Fp8E4m3 => 3,
        Dtype::Fp8E5m2 => 4,
        Dtype::Int8 => 5,
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or(DecodeError::Truncated {
            needed: HEADER_LEN + self.pos.saturating_add(n),
            available: HEADER_LEN + self.buf.len(),
        })?;
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let bytes = self.take(N)?;
        let mut out = [0; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn u128(&mut self) -> Result<u128, DecodeError> {
        Ok(u128::from_le_bytes(self.array()?))
    }
    /// A list count, checked against what the rest of the payload can hold so that a hostile
    /// count never drives a large allocation.
    fn count(&mut self, field: &'static str, item_size: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        let room = (self.buf.len() - self.pos) / item_size;
        if n > room {
            return Err(DecodeError::FieldTooLong {
                field,
                len: n as u64,
                max: room as u64,
            });
        }
        Ok(n)
    }
    fn bytes(&mut self, field: &'static str, max: usize) -> Result<&'a [u8], DecodeError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(DecodeError::FieldTooLong {
                field,
                len: n as u64,
                max: max as u64,
            });
        }
        self.take(n)
    }
    fn string(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let bytes = self.bytes(field, MAX_STRING)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| DecodeError::InvalidUtf8 { field })
    }
    fn flag(&mut self, field: &'static str) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(DecodeError::InvalidField {
                field,
                value: u64::from(v),
            }),
        }
    }
    fn layout(&mut self) -> Result<LayoutSpec, DecodeError> {
        let num_layers = self.u32()?;
        let total_kv_heads = self.u32()?;
        let head_dim = self.u32()?;
        let dtype_code = self.u8()?;
        let dtype =
            Dtype::ALL
                .get(usize::from(dtype_code))
                .copied()
                .ok_or(DecodeError::InvalidField {
                    field: "layout.dtype",
                    value: u64::from(dtype_code),
                })?;
        let mla = self.flag("layout.mla")?;
        let block_tokens = self.u32()?;
        let num_blocks = self.u32()?;
        let tp_size = self.u32()?;
        let tp_rank = self.u32()?;
        let order = match self.u8()? {
            0 => MemoryOrder::Nhd,
            1 => MemoryOrder::Hnd,
            2 => MemoryOrder::HndKt,
            v => {
                return Err(DecodeError::InvalidField {
                    field: "layout.order",
                    value: u64::from(v),
                })
            }
        };
        let arrangement = match self.u8()? {
            0 => Arrangement::PerLayerSplit,
            1 => Arrangement::PerLayerKvHalves,
            2 => Arrangement::PerLayerKvInBlock,
            3 => Arrangement::CrossLayer,
            4 => Arrangement::PerLayerHeadKv,
            5 => Arrangement::PerLayerCellKv,
            v => {
                return Err(DecodeError::InvalidField {
                    field: "layout.arrangement",
                    value: u64::from(v),
                })
            }
        };
        Ok(LayoutSpec {
            num_layers,
            total_kv_heads,
            head_dim,
            dtype,
            mla,
            block_tokens,
            num_blocks,
            tp_size,
            tp_rank,
            order,
            arrangement,
        })
    }
    fn region(&mut self) -> Result<RegionDesc, DecodeError> {
        let index = self.u32()?;
        let kind_code = self.u8()?;
        let device = self.u32()?;
        let kind = match kind_code {
            0 if device == 0 => MemoryKind::Host,
            1 => MemoryKind::Cuda { device },
            2 => MemoryKind::Neuron { device },
            _ => {
                return Err(DecodeError::InvalidField {
                    field: "region.kind",
                    value: u64::from(kind_code),
                })
            }
        };
        Ok(RegionDesc {
            index,
            kind,
            addr: self.u64()?,
            len: self.u64()?,
            key: self.u64()?,
        })
    }
    fn hello(&mut self) -> Result<Hello, DecodeError> {
        let compat_hash = self.u64()?;
        let engine = EngineId(self.u64()?);
        let incarnation = Incarnation(self.u64()?);
        let role = match self.u8()? {
            0 => Role::Producer,
            1 => Role::Consumer,
            2 => Role::Router,
            v => {
                return Err(DecodeError::InvalidField {
                    field: "role",
                    value: u64::from(v),
                })
            }
        };
        let layout = self.layout()?;
        let n = self.count("regions", REGION_WIRE_LEN)?;
        let regions = (0..n).map(|_| self.region()).collect::<Result<_, _>>()?;
        let transport = self.string("transport")?;
        let transport_addr = self.bytes("transport_addr", MAX_TRANSPORT_ADDR)?.to_vec();
        let finishing_hints = self.flag("finishing_hints")?;
        let write_timeout_ms = self.u32()?;
        Ok(Hello {
            compat_hash,
            engine,
            incarnation,
            role,
            layout,
            regions,
            transport,
            transport_addr,
            finishing_hints,
            write_timeout_ms,
        })
    }
    fn registration(&mut self) -> Result<Registration, DecodeError> {
        let transfer = TransferId(self.u128()?);
        let attempt = Attempt(self.u32()?);
        let request = RequestId(self.u64()?);
        let consumer = EngineId(self.u64()?);
        let consumer_incarnation = Incarnation(self.u64()?);
        let consumer_rank = Rank(self.u32()?);
        let num_tokens = self.u32()?;
        let skip_tokens = self.u32()?;
        if skip_tokens > num_tokens {
            return Err(DecodeError::InvalidField {
                field: "skip_tokens",
                value: u64::from(skip_tokens),
            });
        }
        let lease_ms = self.u32()?;
        let notice = self.u64()?;
        let blocks = self.block_ids("blocks")?;
        let n = self.count("groups", 8)?;
        if n > MAX_GROUPS {
            return Err(DecodeError::FieldTooLong {
                field: "groups",
                len: n as u64,
                max: MAX_GROUPS as u64,
            });
        }
        let mut groups = Vec::with_capacity(n);
        for _ in 0..n {
            let first_token = self.u32()?;
            if first_token > num_tokens {
                return Err(DecodeError::InvalidField {
                    field: "groups.first_token",
                    value: u64::from(first_token),
                });
            }
            let blocks = self.block_ids("groups.blocks")?;
            groups.push(GroupBlocks {
                first_token,
                blocks,
            });
        }
        let capability = self.capability()?;
        Ok(Registration {
            transfer,
            attempt,
            request,
            consumer,
            consumer_incarnation,
            consumer_rank,
            num_tokens,
            skip_tokens,
            lease_ms,
            notice,
            blocks,
            groups,
            capability,
        })
    }
    /// A counted list of block ids: `count` checks that they are there, then one slice is
    /// read in one pass.
    fn block_ids(&mut self, field: &'static str) -> Result<Vec<BlockId>, DecodeError> {
        let n = self.count(field, 4)?;
        Ok(self
            .take(4 * n)?
            .chunks_exact(4)
            .map(|id| BlockId(u32::from_le_bytes([id[0], id[1], id[2], id[3]])))
            .collect())
    }
    fn capability(&mut self) -> Result<Option<Capability>, DecodeError> {
        if !self.flag("capability.present")? {
            return Ok(None);
        }
        Ok(Some(Capability {
            decode: EngineId(self.u64()?),
            prefill: self.string("capability.prefill")?,
            expires_unix_ms: self.u64()?,
            tag: self.array()?,
        }))
    }
    fn finishing(&mut self) -> Result<Finishing, DecodeError> {
        Ok(Finishing {
            transfer: TransferId(self.u128()?),
            attempt: Attempt(self.u32()?),
            producer_rank: Rank(self.u32()?),
        })
    }
    fn claim(&mut self) -> Result<Claim, DecodeError> {
        Ok(Claim {
            transfer: TransferId(self.u128()?),
            attempt: Attempt(self.u32()?),
            capability: self.capability()?,
        })
    }
    fn held(&mut self) -> Result<Held, DecodeError> {
        Ok(Held {
            transfer: TransferId(self.u128()?),
            attempt: Attempt(self.u32()?),
            producer_rank: Rank(self.u32()?),
        })
    }
    fn completion(&mut self) -> Result<Completion, DecodeError> {
        Ok(Completion {
            transfer: TransferId(self.u128()?),
            attempt: Attempt(self.u32()?),
            producer: EngineId(self.u64()?),
            producer_rank: Rank(self.u32()?),
            bytes: self.u64()?,
            capability: self.capability()?,
        })
    }
    fn failure(&mut self) -> Result<FailureNotice, DecodeError> {
        let transfer = TransferId(self.u128()?);
        let attempt = Attempt(self.u32()?);
        let rank = Rank(self.u32()?);
        let code = self.u16()?;
        let reason = FailureReason::from_code(code).ok_or(DecodeError::InvalidField {
            field: "reason",
            value: u64::from(code),
        })?;
        let detail = self.string("detail")?;
        Ok(FailureNotice {
            transfer,
            attempt,
            rank,
            reason,
            detail,
        })
    }
    fn abort(&mut self) -> Result<Abort, DecodeError> {
        let transfer = TransferId(self.u128()?);
        let attempt = if self.flag("attempt.present")? {
            Some(Attempt(self.u32()?))
        } else {
            None
        };
        let reason = self.string("reason")?;
        let capability = self.capability()?;
        Ok(Abort {
            transfer,
            attempt,
            reason,
            capability,
        })
    }
    fn heartbeat(&mut self) -> Result<Heartbeat, DecodeError> {
        let engine = EngineId(self.u64()?);
        let incarnation = Incarnation(self.u64()?);
        let n = self.count("transfers", 16)?;
        let transfers = (0..n)
            .map(|_| self.u128().map(TransferId))
            .collect::<Result<_, _>>()?;
        Ok(Heartbeat {
            engine,
            incarnation,
            transfers,
        })
    }
}

const REGION_WIRE_LEN: usize = 4 + 1 + 4 + 8 + 8 + 8;
