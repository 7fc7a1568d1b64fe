//! Round-trip and hostile-input properties of the wire codec.

use kvx_core::wire::{
    Abort, Capability, Claim, Completion, DecodeError, EncodeError, FailureNotice, FailureReason,
    Finishing, FrameHeader, Heartbeat, Held, Hello, Message, Registration, Role, HEADER_LEN,
    MAX_PAYLOAD, MAX_STRING, PROTOCOL_VERSION,
};
use kvx_core::{
    Arrangement, Attempt, BlockId, Dtype, EngineId, GroupBlocks, Incarnation, LayoutSpec,
    MemoryKind, MemoryOrder, Rank, RegionDesc, RequestId, TransferId, MAX_GROUPS,
};
use proptest::prelude::*;

fn layout() -> impl Strategy<Value = LayoutSpec> {
    (
        (
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            0..Dtype::ALL.len(),
        ),
        (
            any::<bool>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
        ),
        (0..3usize, 0..5usize),
    )
        .prop_map(
            |((layers, heads, dim, dtype), (mla, bt, nb, tp, rank), (order, arr))| LayoutSpec {
                num_layers: layers,
                total_kv_heads: heads,
                head_dim: dim,
                dtype: Dtype::ALL[dtype],
                mla,
                block_tokens: bt,
                num_blocks: nb,
                tp_size: tp,
                tp_rank: rank,
                order: MemoryOrder::ALL[order],
                arrangement: Arrangement::ALL[arr],
            },
        )
}

fn memory_kind() -> impl Strategy<Value = MemoryKind> {
    prop_oneof![
        Just(MemoryKind::Host),
        any::<u32>().prop_map(|device| MemoryKind::Cuda { device }),
        any::<u32>().prop_map(|device| MemoryKind::Neuron { device }),
    ]
}

fn region() -> impl Strategy<Value = RegionDesc> {
    (
        any::<u32>(),
        memory_kind(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(index, kind, addr, len, key)| RegionDesc {
            index,
            kind,
            addr,
            len,
            key,
        })
}

fn reason() -> impl Strategy<Value = FailureReason> {
    prop_oneof![
        Just(FailureReason::LeaseExpired),
        Just(FailureReason::PeerUnreachable),
        Just(FailureReason::TransferFailed),
        Just(FailureReason::Aborted),
        Just(FailureReason::Rejected),
        Just(FailureReason::IncompatibleLayout),
        Just(FailureReason::Preempted),
    ]
}

fn capability() -> impl Strategy<Value = Option<Capability>> {
    prop::option::of(
        (
            any::<u64>(),
            "[a-z0-9.:-]{0,40}",
            any::<u64>(),
            any::<[u8; 16]>(),
        )
            .prop_map(|(decode, prefill, expires_unix_ms, tag)| Capability {
                decode: EngineId(decode),
                prefill,
                expires_unix_ms,
                tag,
            }),
    )
}

fn message() -> impl Strategy<Value = Message> {
    let hello = (
        (any::<u64>(), any::<u64>(), any::<u64>(), 0..3usize),
        layout(),
        prop::collection::vec(region(), 0..8),
        ".{0,40}",
        prop::collection::vec(any::<u8>(), 0..64),
        (any::<bool>(), any::<u32>()),
    )
        .prop_map(
            |(
                (hash, engine, inc, role),
                layout,
                regions,
                transport,
                addr,
                (hints, write_timeout_ms),
            )| {
                Message::Hello(Hello {
                    compat_hash: hash,
                    engine: EngineId(engine),
                    incarnation: Incarnation(inc),
                    role: [Role::Producer, Role::Consumer, Role::Router][role],
                    layout,
                    regions,
                    transport,
                    transport_addr: addr,
                    finishing_hints: hints,
                    write_timeout_ms,
                })
            },
        );
    let registration = (
        (
            any::<u128>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
        ),
        (any::<u32>(), any::<u32>(), any::<u32>(), any::<u32>()),
        prop::collection::vec(any::<u32>(), 0..100),
        prop::collection::vec(
            (any::<u32>(), prop::collection::vec(any::<u32>(), 0..20)),
            0..4,
        ),
        capability(),
    )
        .prop_map(
            |((t, a, req, c, inc), (rank, n, skip, lease), blocks, groups, capability)| {
                Message::Registration(Registration {
                    transfer: TransferId(t),
                    attempt: Attempt(a),
                    request: RequestId(req),
                    consumer: EngineId(c),
                    consumer_incarnation: Incarnation(inc),
                    consumer_rank: Rank(rank),
                    num_tokens: n,
                    skip_tokens: skip.min(n),
                    lease_ms: lease,
                    notice: (t as u64).rotate_left(7) ^ u64::from(lease),
                    blocks: blocks.into_iter().map(BlockId).collect(),
                    groups: groups
                        .into_iter()
                        .map(|(first, blocks)| GroupBlocks {
                            first_token: first.min(n),
                            blocks: blocks.into_iter().map(BlockId).collect(),
                        })
                        .collect(),
                    capability,
                })
            },
        );
    let completion = (
        any::<u128>(),
        any::<u32>(),
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        capability(),
    )
        .prop_map(|(t, a, p, r, b, capability)| {
            Message::Completion(Completion {
                transfer: TransferId(t),
                attempt: Attempt(a),
                producer: EngineId(p),
                producer_rank: Rank(r),
                bytes: b,
                capability,
            })
        });
    let failure = (
        any::<u128>(),
        any::<u32>(),
        any::<u32>(),
        reason(),
        ".{0,80}",
    )
        .prop_map(|(t, a, r, reason, detail)| {
            Message::Failure(FailureNotice {
                transfer: TransferId(t),
                attempt: Attempt(a),
                rank: Rank(r),
                reason,
                detail,
            })
        });
    let abort = (any::<u128>(), any::<Option<u32>>(), ".{0,80}", capability()).prop_map(
        |(t, a, reason, capability)| {
            Message::Abort(Abort {
                transfer: TransferId(t),
                attempt: a.map(Attempt),
                reason,
                capability,
            })
        },
    );
    let heartbeat = (
        any::<u64>(),
        any::<u64>(),
        prop::collection::vec(any::<u128>(), 0..50),
    )
        .prop_map(|(e, i, ts)| {
            Message::Heartbeat(Heartbeat {
                engine: EngineId(e),
                incarnation: Incarnation(i),
                transfers: ts.into_iter().map(TransferId).collect(),
            })
        });
    let finishing = (any::<u128>(), any::<u32>(), any::<u32>()).prop_map(|(t, a, r)| {
        Message::Finishing(Finishing {
            transfer: TransferId(t),
            attempt: Attempt(a),
            producer_rank: Rank(r),
        })
    });
    let claim = (any::<u128>(), any::<u32>(), capability()).prop_map(|(t, a, capability)| {
        Message::Claim(Claim {
            transfer: TransferId(t),
            attempt: Attempt(a),
            capability,
        })
    });
    let held = (any::<u128>(), any::<u32>(), any::<u32>()).prop_map(|(t, a, r)| {
        Message::Held(Held {
            transfer: TransferId(t),
            attempt: Attempt(a),
            producer_rank: Rank(r),
        })
    });
    prop_oneof![
        hello,
        registration,
        completion,
        failure,
        abort,
        heartbeat,
        finishing,
        claim,
        held
    ]
}

/// Sets the byte at `at` of an encoded message to `value` and checks that decoding it is
/// refused as an invalid `field` holding that value.
fn assert_refused_with(mut bytes: Vec<u8>, at: usize, value: u8, field: &'static str) {
    bytes[at] = value;
    assert_eq!(
        Message::decode_exact(&bytes),
        Err(DecodeError::InvalidField {
            field,
            value: u64::from(value)
        })
    );
}

proptest! {
    #[test]
    fn every_message_round_trips(m in message()) {
        let bytes = m.to_bytes().unwrap();
        prop_assert_eq!(Message::decode_exact(&bytes).unwrap(), m.clone());
        // Two frames back to back decode one after the other.
        let mut two = bytes.clone();
        m.encode(&mut two).unwrap();
        let (first, used) = Message::decode(&two).unwrap();
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(&first, &m);
        prop_assert_eq!(Message::decode_exact(&two[used..]).unwrap(), m);
    }

    #[test]
    fn every_strict_prefix_is_truncated(m in message()) {
        let bytes = m.to_bytes().unwrap();
        for cut in 0..bytes.len() {
            match Message::decode(&bytes[..cut]) {
                Err(DecodeError::Truncated { needed, available }) => {
                    prop_assert_eq!(available, cut);
                    prop_assert!(needed > cut);
                }
                other => prop_assert!(false, "prefix of {} bytes gave {:?}", cut, other),
            }
        }
    }

    #[test]
    fn corrupted_frames_never_panic(m in message(), flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut bytes = m.to_bytes().unwrap();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        // Whatever happens, decoding returns; when it succeeds the result re-encodes to the same
        // bytes (the codec has one encoding per message).
        if let Ok(decoded) = Message::decode_exact(&bytes) {
            prop_assert_eq!(decoded.to_bytes().unwrap(), bytes);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = Message::decode(&bytes);
        let mut framed = vec![b'K', b'X', PROTOCOL_VERSION, bytes.first().copied().unwrap_or(2) % 10];
        framed.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        framed.extend_from_slice(&bytes);
        if let Ok(decoded) = Message::decode_exact(&framed) {
            prop_assert_eq!(decoded.to_bytes().unwrap(), framed);
        }
    }
}

fn sample() -> Vec<u8> {
    Message::Completion(Completion {
        transfer: TransferId(1),
        attempt: Attempt(2),
        producer: EngineId(3),
        producer_rank: Rank(4),
        bytes: 5,
        capability: None,
    })
    .to_bytes()
    .unwrap()
}

#[test]
fn wrong_version_is_rejected() {
    let mut bytes = sample();
    bytes[2] = PROTOCOL_VERSION + 1;
    assert_eq!(
        Message::decode_exact(&bytes),
        Err(DecodeError::UnsupportedVersion {
            got: PROTOCOL_VERSION + 1,
            supported: PROTOCOL_VERSION
        })
    );
}

#[test]
fn bad_magic_unknown_kind_and_trailing_bytes_are_rejected() {
    let mut bytes = sample();
    bytes[0] = b'Z';
    assert_eq!(
        Message::decode_exact(&bytes),
        Err(DecodeError::BadMagic([b'Z', b'X']))
    );
    let mut bytes = sample();
    bytes[3] = 0xee;
    assert_eq!(
        Message::decode_exact(&bytes),
        Err(DecodeError::UnknownKind(0xee))
    );
    let mut bytes = sample();
    bytes.push(0);
    assert_eq!(
        Message::decode_exact(&bytes),
        Err(DecodeError::TrailingBytes { extra: 1 })
    );
    // A payload with an extra byte inside the declared length is also rejected.
    let mut bytes = sample();
    bytes.push(0);
    let len = (bytes.len() - HEADER_LEN) as u32;
    bytes[4..8].copy_from_slice(&len.to_le_bytes());
    assert_eq!(
        Message::decode_exact(&bytes),
        Err(DecodeError::TrailingBytes { extra: 1 })
    );
}

#[test]
fn oversized_frames_are_rejected_before_reading_the_payload() {
    let mut header = sample()[..HEADER_LEN].to_vec();
    header[4..8].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
    assert_eq!(
        FrameHeader::parse(&header),
        Err(DecodeError::Oversized {
            len: u64::from(MAX_PAYLOAD) + 1,
            max: u64::from(MAX_PAYLOAD)
        })
    );
}

#[test]
fn hostile_list_counts_do_not_allocate() {
    // A heartbeat claiming four billion transfers in a 24-byte payload.
    let mut bytes = Message::Heartbeat(Heartbeat {
        engine: EngineId(1),
        incarnation: Incarnation(1),
        transfers: vec![],
    })
    .to_bytes()
    .unwrap();
    let n = bytes.len();
    bytes[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        Message::decode_exact(&bytes),
        Err(DecodeError::FieldTooLong {
            field: "transfers",
            ..
        })
    ));
}

#[test]
fn invalid_enum_codes_and_utf8_are_rejected() {
    let failure = Message::Failure(FailureNotice {
        transfer: TransferId(1),
        attempt: Attempt(0),
        rank: Rank(0),
        reason: FailureReason::Aborted,
        detail: "é".into(),
    });
    let bytes = failure.to_bytes().unwrap();
    let reason_at = HEADER_LEN + 16 + 4 + 4;
    assert_refused_with(bytes.clone(), reason_at, 99, "reason");
    let mut bad = bytes;
    let last = bad.len() - 1;
    bad[last] = 0xff;
    assert_eq!(
        Message::decode_exact(&bad),
        Err(DecodeError::InvalidUtf8 { field: "detail" })
    );
}

#[test]
fn a_hello_flag_other_than_0_or_1_is_rejected() {
    let hello = Message::Hello(Hello {
        compat_hash: 1,
        engine: EngineId(2),
        incarnation: Incarnation(3),
        role: Role::Consumer,
        layout: LayoutSpec {
            num_layers: 2,
            total_kv_heads: 2,
            head_dim: 8,
            dtype: Dtype::F32,
            mla: false,
            block_tokens: 4,
            num_blocks: 8,
            tp_size: 1,
            tp_rank: 0,
            order: MemoryOrder::Nhd,
            arrangement: Arrangement::PerLayerSplit,
        },
        regions: vec![],
        transport: "loopback".into(),
        transport_addr: vec![1, 2],
        finishing_hints: true,
        write_timeout_ms: 7,
    });
    let bytes = hello.to_bytes().unwrap();
    // The flag comes right before the last field, a u32.
    let last = bytes.len() - 5;
    assert_eq!(bytes[last], 1);
    assert_refused_with(bytes, last, 2, "finishing_hints");
}

/// A registration of transfer 1 for `num_tokens` tokens in `blocks`, with `groups`.
fn registration(num_tokens: u32, blocks: Vec<BlockId>, groups: Vec<GroupBlocks>) -> Registration {
    Registration {
        transfer: TransferId(1),
        attempt: Attempt(0),
        request: RequestId(0),
        consumer: EngineId(0),
        consumer_incarnation: Incarnation(0),
        consumer_rank: Rank(0),
        num_tokens,
        skip_tokens: 0,
        lease_ms: 0,
        notice: 0,
        blocks,
        groups,
        capability: None,
    }
}

#[test]
fn skip_beyond_tokens_is_rejected() {
    let reg = Registration {
        skip_tokens: 4,
        ..registration(4, vec![], Vec::new())
    };
    let bytes = Message::Registration(reg).to_bytes().unwrap();
    let skip_at = HEADER_LEN + 16 + 4 + 8 + 8 + 8 + 4 + 4;
    assert_refused_with(bytes, skip_at, 5, "skip_tokens");
}

#[test]
fn a_groups_first_token_past_the_request_or_too_many_groups_are_refused() {
    let reg = |groups: Vec<GroupBlocks>| {
        Message::Registration(registration(8, vec![BlockId(1), BlockId(2)], groups))
    };
    let window = GroupBlocks {
        first_token: 4,
        blocks: vec![BlockId(0), BlockId(3)],
    };
    let ok = reg(vec![window.clone()]);
    assert_eq!(Message::decode_exact(&ok.to_bytes().unwrap()), Ok(ok));

    // The first group token sits right after the two main blocks and the group count.
    let bytes = reg(vec![window.clone()]).to_bytes().unwrap();
    let first_at = HEADER_LEN + 16 + 4 + 8 + 8 + 8 + 4 + 4 + 4 + 4 + 8 + 4 + 8 + 4;
    assert_eq!(bytes[first_at], 4);
    assert_refused_with(bytes, first_at, 9, "groups.first_token");

    let many = reg(vec![window; MAX_GROUPS + 1]);
    assert!(matches!(
        many.to_bytes(),
        Err(EncodeError::FieldTooLong {
            field: "groups",
            ..
        })
    ));
}

#[test]
fn overlong_fields_fail_to_encode_and_leave_the_buffer_alone() {
    let abort = Message::Abort(Abort {
        transfer: TransferId(1),
        attempt: None,
        reason: "x".repeat(MAX_STRING + 1),
        capability: None,
    });
    let mut out = vec![1, 2, 3];
    assert!(abort.encode(&mut out).is_err());
    assert_eq!(out, vec![1, 2, 3]);
}

#[test]
fn compat_hash_ignores_what_the_planner_bridges() {
    let a = LayoutSpec {
        num_layers: 4,
        total_kv_heads: 8,
        head_dim: 128,
        dtype: Dtype::Bf16,
        mla: false,
        block_tokens: 16,
        num_blocks: 100,
        tp_size: 8,
        tp_rank: 0,
        order: MemoryOrder::Nhd,
        arrangement: Arrangement::PerLayerSplit,
    };
    let b = LayoutSpec {
        block_tokens: 64,
        tp_size: 2,
        tp_rank: 1,
        order: MemoryOrder::Hnd,
        arrangement: Arrangement::CrossLayer,
        num_blocks: 7,
        ..a.clone()
    };
    assert_eq!(a.compat_hash(), b.compat_hash());
    let c = LayoutSpec {
        dtype: Dtype::F16,
        ..a.clone()
    };
    assert_ne!(a.compat_hash(), c.compat_hash());
}

#[test]
fn a_router_hello_round_trips_and_an_unknown_role_is_rejected() {
    let hello = Message::Hello(Hello::router(EngineId(5), Incarnation(6)));
    let bytes = hello.to_bytes().unwrap();
    assert_eq!(Message::decode_exact(&bytes).unwrap(), hello);
    // The role is the byte after the header and three u64s.
    let role = HEADER_LEN + 24;
    assert_eq!(bytes[role], 2);
    assert_refused_with(bytes, role, 3, "role");
}
