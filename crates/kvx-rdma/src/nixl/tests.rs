//! Unit tests of the NIXL backend: the address and notification encodings (no runtime needed),
//! and an in-process pair of agents over UCX (skipped, saying so, without the runtime).

use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{MemoryKind, Rank};
use kvx_layout::CopyOp;
use proptest::prelude::*;

use super::address::{decode_address, encode_address};
use super::notify::{parse_notification, tagged, Incoming, TAG_MESSAGE, TAG_NOTICE, TAG_PROBE};
use super::transfer::{nixl_accepts, nixl_memory};
use super::*;
use crate::error::{
    ConnectError, DeregisterError, PlanError, RegisterError, SendError, Side, WriteError,
};
use crate::region::HostBuffer;
use crate::transport::{Notice, Transport};

/// NIXL cuts `engine_config` at commas: one device goes there, several as `device_list`
/// (names; NIXL adds port 1), and an `engine_config` naming its own devices wins.
#[test]
fn rails_of_several_devices_go_to_nixl_as_a_device_list() {
    let param = |c: &NixlConfig, key: &str| {
        c.backend_params
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    let mut config = NixlConfig::ucx();
    config.net_devices = Some("rdmap79s0:1".into());
    let applied = with_devices_applied(&config).unwrap();
    assert_eq!(
        param(&applied, "engine_config").as_deref(),
        Some("NET_DEVICES=rdmap79s0:1")
    );
    assert_eq!(param(&applied, "device_list"), None);
    config.net_devices = Some("rdmap79s0:1,rdmap80s0:1".into());
    let applied = with_devices_applied(&config.clone().with_device_memory()).unwrap();
    assert_eq!(
        param(&applied, "device_list").as_deref(),
        Some("rdmap79s0, rdmap80s0")
    );
    assert_eq!(
        param(&applied, "engine_config").as_deref(),
        Some("MEMTYPE_CACHE=n")
    );
    let own = config
        .clone()
        .with_engine_setting("NET_DEVICES", "mlx5_3:1");
    let applied = with_devices_applied(&own).unwrap();
    assert_eq!(
        param(&applied, "engine_config").as_deref(),
        Some("NET_DEVICES=mlx5_3:1")
    );
    assert_eq!(param(&applied, "device_list"), None);
    config.net_devices = Some("mlx5_0:1,mlx5_1:2".into());
    let err = with_devices_applied(&config).unwrap_err();
    assert!(err.to_string().contains("mlx5_1:2"), "{err}");
}

#[test]
fn device_memory_turns_the_memtype_cache_off_once_and_keeps_other_settings() {
    let engine = |c: &NixlConfig| {
        c.backend_params
            .iter()
            .find(|(k, _)| k == "engine_config")
            .map(|(_, v)| v.clone())
    };
    assert_eq!(
        engine(&NixlConfig::ucx().with_device_memory()).as_deref(),
        Some("MEMTYPE_CACHE=n")
    );
    let tcp = NixlConfig::ucx_tcp(Some("lo")).with_device_memory();
    assert_eq!(
        engine(&tcp).as_deref(),
        Some("TLS=tcp,NET_DEVICES=lo,MEMTYPE_CACHE=n")
    );
    let again = tcp.clone().with_device_memory();
    assert_eq!(engine(&again), engine(&tcp));
    let mine = NixlConfig::ucx()
        .with_param("engine_config", "MEMTYPE_CACHE=y")
        .with_device_memory();
    assert_eq!(
        engine(&mine).as_deref(),
        Some("MEMTYPE_CACHE=y"),
        "the user's choice stays"
    );
}

#[test]
fn a_region_of_device_memory_and_one_of_host_memory_map_to_their_nixl_types() {
    assert!(matches!(
        nixl_memory(MemoryKind::Cuda { device: 3 }),
        (sys::MemType::Vram, 3)
    ));
    assert!(matches!(
        nixl_memory(MemoryKind::Host),
        (sys::MemType::Dram, 0)
    ));
    assert!(nixl_accepts(MemoryKind::Cuda { device: 0 }));
    assert!(!nixl_accepts(MemoryKind::Neuron { device: 0 }));
}

#[test]
fn addresses_round_trip() {
    let address = encode_address("kvx-1-2-3", b"metadata blob");
    assert_eq!(
        decode_address(&address),
        Ok(("kvx-1-2-3", &b"metadata blob"[..]))
    );
}

#[test]
fn bad_addresses_are_refused() {
    let good = encode_address("agent", b"md");
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    let mut bad_version = good.clone();
    bad_version[4] = 9;
    let mut long_name = good.clone();
    long_name[5] = 200;
    let mut flipped = good.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    let mut cut = good.clone();
    cut.pop();
    let no_metadata = encode_address("agent", b"");
    let not_utf8 = encode_address("\u{fffd}", b"md")
        .into_iter()
        .map(|b| if b == 0xef { 0xff } else { b })
        .collect::<Vec<_>>();
    for (what, address) in [
        ("empty", &[][..]),
        ("short", &good[..5]),
        ("magic", &bad_magic[..]),
        ("version", &bad_version[..]),
        ("name past the end", &long_name[..]),
        ("no metadata", &no_metadata[..]),
        ("flipped metadata bit", &flipped[..]),
        ("metadata cut short", &cut[..]),
        ("name not UTF-8", &not_utf8[..]),
    ] {
        assert!(decode_address(address).is_err(), "{what} accepted");
    }
}

#[test]
fn notifications_are_told_apart() {
    let notice = tagged(TAG_NOTICE, &0x0102_0304_0506_0708_u64.to_le_bytes());
    assert!(matches!(
        parse_notification(&notice),
        Incoming::Event(Event::Notice(Notice(0x0102_0304_0506_0708)))
    ));
    match parse_notification(&tagged(TAG_MESSAGE, b"hello")) {
        Incoming::Event(Event::Message(m)) => assert_eq!(m, b"hello"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        parse_notification(&tagged(TAG_MESSAGE, b"")),
        Incoming::Event(Event::Message(m)) if m.is_empty()
    ));
    assert!(matches!(
        parse_notification(&tagged(TAG_PROBE, b"")),
        Incoming::Probe
    ));
    // A notice of the wrong width, an unknown tag, or too few bytes: not ours.
    for foreign in [
        &tagged(TAG_NOTICE, &[1, 2, 3])[..],
        b"xfer-done",
        b"kvx",
        b"",
    ] {
        assert!(matches!(parse_notification(foreign), Incoming::Foreign));
    }
}

proptest! {
    #[test]
    fn decoding_arbitrary_addresses_never_panics(
        bytes in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let _ = decode_address(&bytes);
        let _ = parse_notification(&bytes);
    }
}

/// An endpoint over UCX, or `None` (printed: why) when the runtime is not available.
fn open_or_skip(test: &str) -> Option<NixlTransport> {
    open_limited_or_skip(
        test,
        DEFAULT_PREPARED_LIST_LIMIT,
        DEFAULT_MAX_REQUEST_DESCRIPTORS,
    )
}

/// [`open_or_skip`] with at most `limit` descriptors in a prepared list and `per_request` in
/// one NIXL request.
fn open_limited_or_skip(test: &str, limit: usize, per_request: usize) -> Option<NixlTransport> {
    if runtime::locate(lib_dir().as_deref()).is_none() {
        // On the real stderr: the test harness captures `println!`.
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED {test}: no NIXL runtime (set {LIB_DIR_ENV} to the directory holding \
             libnixl_capi.so; `cargo xtask test` does)"
        );
        return None;
    }
    let mut config = NixlConfig::ucx_tcp(Some("lo"));
    config.op_timeout = Duration::from_secs(20);
    config.library = lib_dir();
    config.prepared_list_limit = limit;
    config.max_request_descriptors = per_request;
    Some(NixlTransport::open(&config).expect("open a NIXL endpoint"))
}

/// A transfer in flight when its peer is disconnected still ends (the peer's metadata goes
/// only then); the old id is refused, and connecting again loads the peer anew.
#[test]
fn a_disconnected_peer_is_refused_and_a_new_connection_works() {
    let test = "a_disconnected_peer_is_refused_and_a_new_connection_works";
    let (Some(mut a), Some(mut b)) = (open_or_skip(test), open_or_skip(test)) else {
        return;
    };
    let len = 4 << 20;
    let region = || LocalRegion::host(0, Arc::new(HostBuffer::new(len).unwrap()));
    a.register(region()).unwrap();
    b.register(region()).unwrap();
    crate::transport::check_disconnect(&mut a, &mut b, len as u64);
}

/// A waker ends a wait from another thread, and a wake before the wait ends the next one.
#[test]
fn a_waker_interrupts_a_wait() {
    let Some(mut endpoint) = open_or_skip("a_waker_interrupts_a_wait") else {
        return;
    };
    crate::transport::check_waker(&mut endpoint);
}

fn op(src: (u32, u64), dst: (u32, u64), len: u64, count: u64, strides: (u64, u64)) -> CopyOp {
    CopyOp::strided(Rank(0), src, dst, len, count, strides)
}

/// Waits on both endpoints until `done` says the collected events suffice.
fn pump(
    a: &mut NixlTransport,
    b: &mut NixlTransport,
    mut done: impl FnMut(&[Event], &[Event]) -> bool,
) -> (Vec<Event>, Vec<Event>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    while !done(&ea, &eb) {
        assert!(Instant::now() < deadline, "no events: {ea:?} {eb:?}");
        a.wait(&mut ea, Duration::from_millis(1)).unwrap();
        b.wait(&mut eb, Duration::from_millis(1)).unwrap();
    }
    (ea, eb)
}

/// A plan like a request's: 1 KiB units (24 scattered single blocks and a strided run of 10)
/// between regions 0 and 1, and a 300-byte tail of no whole unit; the producer's regions are
/// `regions` × 64 KiB, so its prepared list (if any) holds `regions` × 64 descriptors.
fn request_like_plan(dst_region: u32) -> Vec<CopyOp> {
    let mut plan: Vec<CopyOp> = (0..24)
        .map(|i| {
            op(
                (0, i * 1024),
                (dst_region, ((i * 5 + 3) % 24) * 1024),
                1024,
                1,
                (0, 0),
            )
        })
        .collect();
    plan.push(op((1, 0), (0, 0), 1024, 10, (4096, 2048)));
    plan.push(op(
        (0, 40 * 1024 + 100),
        (dst_region, 30 * 1024 + 7),
        300,
        1,
        (0, 0),
    ));
    plan
}

/// Writes `plan` with a notice from `producer` to `consumer` and checks, when the notice has
/// arrived, every byte of the consumer's regions against the plan applied to the sources.
fn write_and_check(
    producer: &mut NixlTransport,
    consumer: &mut NixlTransport,
    sources: &[Arc<HostBuffer>],
    targets: &[Arc<HostBuffer>],
    plan: &[CopyOp],
    notice: u64,
) {
    let peer = producer.connect(&consumer.local_desc()).unwrap();
    let mut want: Vec<Vec<u8>> = targets.iter().map(|t| t.to_vec()).collect();
    for op in plan {
        let s = sources[op.src_region as usize].to_vec();
        for (from, to, len) in op.pieces() {
            let (from, to, len) = (from as usize, to as usize, len as usize);
            want[op.dst_region as usize][to..to + len].copy_from_slice(&s[from..from + len]);
        }
    }
    producer.write(peer, plan, Some(Notice(notice))).unwrap();
    let (ep, ec) = pump(producer, consumer, |p, c| {
        p.iter().any(|e| matches!(e, Event::WriteDone { .. }))
            && c.iter().any(|e| matches!(e, Event::Notice(_)))
    });
    assert!(
        ec.iter()
            .any(|e| matches!(e, Event::Notice(Notice(n)) if *n == notice)),
        "{ec:?}"
    );
    assert!(
        !ep.iter().any(|e| matches!(e, Event::Failed { .. })),
        "{ep:?}"
    );
    for (i, (target, want)) in targets.iter().zip(&want).enumerate() {
        assert!(target.to_vec() == *want, "region {i} differs from the plan");
    }
}

/// Pieces of whole units go by index into lists prepared once, the others (the tail) in a second
/// request that carries the notice: every byte lands before the notice, with prepared lists or
/// without, and with transfers cut into requests of 7 descriptors; the lists follow
/// registrations on either side, and reads use them too.
#[test]
fn prepared_lists_carry_whole_units_and_the_rest_follows_with_the_notice() {
    let test = "prepared_lists_carry_whole_units_and_the_rest_follows_with_the_notice";
    let buffer = |seed: usize| {
        let b = Arc::new(HostBuffer::new(64 << 10).unwrap());
        b.fill_with(|i| (i * 13 + seed * 71 + i / 4093) as u8);
        b
    };
    for (limit, per_request) in [
        (DEFAULT_PREPARED_LIST_LIMIT, DEFAULT_MAX_REQUEST_DESCRIPTORS),
        (0, DEFAULT_MAX_REQUEST_DESCRIPTORS),
        (DEFAULT_PREPARED_LIST_LIMIT, 7),
        (0, 7),
    ] {
        let (Some(mut producer), Some(mut consumer)) = (
            open_limited_or_skip(test, limit, per_request),
            open_limited_or_skip(test, limit, per_request),
        ) else {
            return;
        };
        let sources: Vec<_> = (0..3).map(buffer).collect();
        let targets: Vec<_> = (3..6).map(buffer).collect();
        for i in 0..2 {
            producer
                .register(LocalRegion::host(i, Arc::clone(&sources[i as usize])))
                .unwrap();
            consumer
                .register(LocalRegion::host(i, Arc::clone(&targets[i as usize])))
                .unwrap();
        }
        write_and_check(
            &mut producer,
            &mut consumer,
            &sources,
            &targets,
            &request_like_plan(1),
            11,
        );
        let prepared = |t: &NixlTransport| (t.prepared_transfers(), t.prepared_descriptors());
        if limit == 0 {
            assert_eq!(prepared(&producer), (0, 0), "nothing prepared at limit 0");
        } else {
            assert_eq!(
                prepared(&producer),
                (1, 2 * 64),
                "1 KiB units of two regions"
            );
        }
        // A few pieces alone do not prepare anything new, and still land.
        write_and_check(
            &mut producer,
            &mut consumer,
            &sources,
            &targets,
            &request_like_plan(1)[20..],
            12,
        );
        // A region more on each side: both lists are prepared again and take it.
        producer
            .register(LocalRegion::host(2, Arc::clone(&sources[2])))
            .unwrap();
        consumer
            .register(LocalRegion::host(2, Arc::clone(&targets[2])))
            .unwrap();
        let mut into_new = request_like_plan(2);
        into_new.push(op((2, 8192), (2, 40 * 1024), 4096, 1, (0, 0)));
        write_and_check(
            &mut producer,
            &mut consumer,
            &sources,
            &targets,
            &into_new,
            13,
        );
        if limit != 0 {
            assert_eq!(prepared(&producer), (3, 3 * 64));
        }
        // A read of whole units back into the consumer (the producer's memory is the source).
        let back = consumer.connect(&producer.local_desc()).unwrap();
        let read: Vec<CopyOp> = (0..40)
            .map(|i| op((2, i * 1024), (0, ((i * 7) % 40) * 1024), 1024, 1, (0, 0)))
            .collect();
        consumer.read(back, &read).unwrap();
        pump(&mut producer, &mut consumer, |_, c| {
            c.iter()
                .any(|e| matches!(e, Event::ReadDone { bytes: 40_960, .. }))
        });
        let (s, d) = (sources[2].to_vec(), targets[0].to_vec());
        for i in 0..40 {
            let to = ((i * 7) % 40) * 1024;
            assert_eq!(
                d[to..to + 1024],
                s[i * 1024..(i + 1) * 1024],
                "read unit {i}"
            );
        }
        if limit != 0 {
            assert_eq!(prepared(&consumer), (1, 3 * 64));
        }
    }
}

#[test]
fn in_process_write_read_send_and_refusals() {
    let Some(mut producer) = open_or_skip("in_process_write_read_send_and_refusals") else {
        return;
    };
    let Some(mut consumer) = open_or_skip("in_process_write_read_send_and_refusals") else {
        return;
    };
    assert_ne!(producer.agent_name(), consumer.agent_name());
    let src = Arc::new(HostBuffer::new(64 << 10).unwrap());
    src.fill_with(|i| (i * 7 + 3) as u8);
    let dst = Arc::new(HostBuffer::new(64 << 10).unwrap());
    producer
        .register(LocalRegion::host(0, Arc::clone(&src)))
        .unwrap();
    let before = consumer.local_desc().address.len();
    consumer
        .register(LocalRegion::host(3, Arc::clone(&dst)))
        .unwrap();
    // The metadata grows with the registration (it carries the remote key).
    assert!(consumer.local_desc().address.len() > before);
    assert!(matches!(
        consumer.register(LocalRegion::host(3, Arc::clone(&dst))),
        Err(RegisterError::Duplicate(3))
    ));

    let desc = consumer.local_desc();
    assert_eq!(desc.backend, BACKEND);
    assert_eq!(desc.regions[0].addr, dst.as_ptr() as u64);
    let peer = producer.connect(&desc).unwrap();
    // Connecting again refreshes the same peer.
    assert_eq!(producer.connect(&desc).unwrap(), peer);
    // Its own description is refused.
    assert!(matches!(
        producer.connect(&producer.local_desc()),
        Err(ConnectError::BadAddress { .. })
    ));

    // A strided write with a notice: 4 pieces of 1000 bytes.
    let plan = [op((0, 100), (3, 5), 1000, 4, (3000, 2000))];
    let id = producer.write(peer, &plan, Some(Notice(u64::MAX))).unwrap();
    // The region is in use while the write is in flight, or the write is already done.
    match producer.deregister(0) {
        Err(DeregisterError::InUse { index: 0, ops: 1 }) => {}
        other => panic!("deregister during a write: {other:?}"),
    }
    let (ep, ec) = pump(&mut producer, &mut consumer, |p, c| {
        p.iter().any(|e| matches!(e, Event::WriteDone { .. }))
            && c.iter().any(|e| matches!(e, Event::Notice(_)))
    });
    assert!(ep
        .iter()
        .any(|e| matches!(e, Event::WriteDone { op, bytes: 4000, .. } if *op == id)));
    assert!(ec
        .iter()
        .any(|e| matches!(e, Event::Notice(Notice(u64::MAX)))));
    let (s, d) = (src.to_vec(), dst.to_vec());
    let mut want = vec![0_u8; d.len()];
    for (from, to, len) in plan[0].pieces() {
        let (from, to, len) = (from as usize, to as usize, len as usize);
        want[to..to + len].copy_from_slice(&s[from..from + len]);
    }
    assert!(d == want, "destination differs from the plan");

    // A read back into the producer's region 0 (the consumer's region 3 is the source).
    let back = consumer.connect(&producer.local_desc()).unwrap();
    let read = [op((0, 100), (3, 40_000), 4000, 1, (0, 0))];
    let rid = consumer.read(back, &read).unwrap();
    let (_, ec) = pump(&mut producer, &mut consumer, |_, c| {
        c.iter().any(|e| matches!(e, Event::ReadDone { .. }))
    });
    assert!(ec
        .iter()
        .any(|e| matches!(e, Event::ReadDone { op, bytes: 4000, .. } if *op == rid)));
    assert_eq!(dst.to_vec()[40_000..44_000], s[100..4100]);

    // A control message.
    producer.send(peer, b"ctrl").unwrap();
    let (ep, ec) = pump(&mut producer, &mut consumer, |p, c| {
        p.iter().any(|e| matches!(e, Event::SendDone { .. }))
            && c.iter().any(|e| matches!(e, Event::Message(_)))
    });
    assert!(ep.iter().any(|e| matches!(e, Event::SendDone { .. })));
    assert!(ec
        .iter()
        .any(|e| matches!(e, Event::Message(m) if m == b"ctrl")));
    assert!(matches!(
        producer.send(peer, &[0; MAX_MESSAGE + 1]),
        Err(SendError::TooLarge { .. })
    ));

    // Refusals before anything moves.
    assert!(matches!(
        producer.write(
            peer,
            &[op((0, 0), (3, (64 << 10) - 10), 11, 1, (0, 0))],
            None
        ),
        Err(WriteError::Plan(PlanError::OutOfBounds {
            side: Side::Dst,
            ..
        }))
    ));
    assert!(matches!(
        producer.write(peer, &[op((1, 0), (3, 0), 1, 1, (0, 0))], None),
        Err(WriteError::Plan(PlanError::Unregistered {
            side: Side::Src,
            region: 1,
            ..
        }))
    ));
    assert!(matches!(
        producer.write(PeerId(9), &plan, None),
        Err(WriteError::UnknownPeer(PeerId(9)))
    ));
    // A one-byte read the other way, pumped to completion.
    let small = producer
        .read(peer, &[op((3, 0), (0, 0), 1, 1, (0, 0))])
        .unwrap();
    let (ep, _) = pump(&mut producer, &mut consumer, |p, _| {
        p.iter()
            .any(|e| matches!(e, Event::ReadDone { .. } | Event::Failed { .. }))
    });
    assert!(ep
        .iter()
        .any(|e| matches!(e, Event::ReadDone { op, bytes: 1, .. } if *op == small)));
    assert_eq!(src.to_vec()[0], d[0]);

    // The consumer registers more memory and sends its description again: connecting again
    // refreshes the same peer, and the new region can be written.
    let more = Arc::new(HostBuffer::new(8192).unwrap());
    consumer
        .register(LocalRegion::host(4, Arc::clone(&more)))
        .unwrap();
    assert!(matches!(
        producer.write(peer, &[op((0, 0), (4, 0), 8192, 1, (0, 0))], None),
        Err(WriteError::Plan(PlanError::Unregistered {
            side: Side::Dst,
            region: 4,
            ..
        }))
    ));
    assert_eq!(producer.connect(&consumer.local_desc()).unwrap(), peer);
    producer
        .write(
            peer,
            &[op((0, 0), (4, 0), 8192, 1, (0, 0))],
            Some(Notice(4)),
        )
        .unwrap();
    pump(&mut producer, &mut consumer, |_, c| {
        c.iter().any(|e| matches!(e, Event::Notice(Notice(4))))
    });
    assert_eq!(more.to_vec(), src.to_vec()[..8192]);

    // Descriptions a third endpoint refuses before NIXL sees them (NIXL keeps half-loaded
    // state of an agent whose metadata it refused), and the endpoint still connects afterwards.
    let Some(mut stranger) = open_or_skip("in_process_write_read_send_and_refusals") else {
        return;
    };
    let mut other = desc.clone();
    other.provider = "LIBFABRIC".into();
    assert!(matches!(
        stranger.connect(&other),
        Err(ConnectError::Mismatch { .. })
    ));
    let mut garbage = desc.clone();
    garbage.address = b"not an address".to_vec();
    assert!(matches!(
        stranger.connect(&garbage),
        Err(ConnectError::BadAddress { .. })
    ));
    let mut corrupt = desc;
    let len = corrupt.address.len();
    corrupt.address.truncate(len - len / 3);
    assert!(matches!(
        stranger.connect(&corrupt),
        Err(ConnectError::BadAddress { .. })
    ));
    // Metadata whose agent name is not UTF-8 (nixl-sys panics on it): an error, not a panic.
    let desc = consumer.local_desc();
    let (name, metadata) = decode_address(&desc.address).unwrap();
    let at = metadata
        .windows(name.len())
        .position(|w| w == name.as_bytes())
        .expect("the metadata names its agent");
    let mut mangled = metadata.to_vec();
    mangled[at + 1] = 0xff;
    let mut not_utf8 = desc.clone();
    not_utf8.address = encode_address(name, &mangled);
    assert!(matches!(
        stranger.connect(&not_utf8),
        Err(ConnectError::BadAddress { .. })
    ));
    // The endpoint still works after refusing them.
    assert!(stranger.connect(&desc).is_ok());

    // The pair still works, and idle endpoints return from wait after its timeout, with
    // nothing.
    producer.write(peer, &plan, Some(Notice(7))).unwrap();
    pump(&mut producer, &mut consumer, |p, c| {
        p.iter().any(|e| matches!(e, Event::WriteDone { .. }))
            && c.iter().any(|e| matches!(e, Event::Notice(Notice(7))))
    });
    let mut events = Vec::new();
    assert_eq!(
        consumer
            .wait(&mut events, Duration::from_millis(5))
            .unwrap(),
        0
    );
    assert_eq!(producer.in_flight(), 0);
    producer.deregister(0).unwrap();
    assert!(matches!(
        producer.deregister(0),
        Err(DeregisterError::Unknown(0))
    ));
}

#[test]
fn metadata_past_the_address_limit_is_a_typed_error_and_rolled_back() {
    let Some(mut endpoint) =
        open_or_skip("metadata_past_the_address_limit_is_a_typed_error_and_rolled_back")
    else {
        return;
    };
    let mut registered = 0_u32;
    let error = loop {
        assert!(
            registered < 10_000,
            "the metadata never outgrew the address"
        );
        let region = LocalRegion::host(registered, Arc::new(HostBuffer::new(4096).unwrap()));
        match endpoint.register(region) {
            Ok(_) => registered += 1,
            Err(error) => break error,
        }
    };
    println!("{registered} regions fit in a description");
    assert!(registered >= 8, "only {registered} regions fit");
    assert!(matches!(error, RegisterError::Backend { index, .. } if index == registered));
    // Rolled back: the description still decodes and lists exactly the registered regions.
    let desc = endpoint.local_desc();
    let again = EndpointDesc::from_bytes(&desc.to_bytes()).unwrap();
    assert_eq!(again.regions.len(), registered as usize);
    assert!(matches!(
        endpoint.deregister(registered),
        Err(DeregisterError::Unknown(_))
    ));
    // Releasing one makes room again.
    endpoint.deregister(0).unwrap();
    let region = LocalRegion::host(registered, Arc::new(HostBuffer::new(4096).unwrap()));
    endpoint.register(region).unwrap();
}

/// The NIXL runtime's directory, from [`LIB_DIR_ENV`] (which `cargo xtask test` sets): tests read
/// the environment, the crate does not.
fn lib_dir() -> Option<std::path::PathBuf> {
    std::env::var_os(LIB_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
}
