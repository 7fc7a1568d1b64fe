//! In-process tests of the libfabric backend: two endpoints of one process (the cross-process
//! tests are in `tests/`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::Rank;
use kvx_layout::CopyOp;

use super::*;
use crate::region::HostBuffer;

fn pair(config: &LibfabricConfig) -> (LibfabricTransport, LibfabricTransport) {
    let a = LibfabricTransport::open(config).expect("open endpoint a");
    let b = LibfabricTransport::open(config).expect("open endpoint b");
    (a, b)
}

fn op(src_region: u32, src_offset: u64, dst_region: u32, dst_offset: u64, len: u64) -> CopyOp {
    CopyOp {
        producer: Rank(0),
        src_region,
        src_offset,
        dst_region,
        dst_offset,
        len,
        count: 1,
        src_stride: 0,
        dst_stride: 0,
    }
}

/// Waits on both endpoints until `done` says so, or fails the test after a deadline.
fn pump_until(
    a: &mut LibfabricTransport,
    b: &mut LibfabricTransport,
    events_a: &mut Vec<Event>,
    events_b: &mut Vec<Event>,
    done: impl Fn(&[Event], &[Event]) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done(events_a, events_b) {
        assert!(
            Instant::now() < deadline,
            "timed out: a={events_a:?} b={events_b:?}"
        );
        a.wait(events_a, Duration::from_millis(5)).unwrap();
        b.wait(events_b, Duration::from_millis(5)).unwrap();
    }
}

fn write_and_verify(config: &LibfabricConfig) {
    let (mut a, mut b) = pair(config);
    let src = Arc::new(HostBuffer::new(1 << 20).unwrap());
    src.fill_with(|i| (i * 7 + i / 4096) as u8);
    let dst0 = Arc::new(HostBuffer::new(1 << 19).unwrap());
    let dst1 = Arc::new(HostBuffer::new(1 << 19).unwrap());
    a.register(LocalRegion::host(0, Arc::clone(&src))).unwrap();
    b.register(LocalRegion::host(10, Arc::clone(&dst0)))
        .unwrap();
    b.register(LocalRegion::host(11, Arc::clone(&dst1)))
        .unwrap();
    let peer = a.connect(&b.local_desc()).unwrap();
    let mut strided = op(0, 8192, 11, 100, 300);
    strided.count = 50;
    strided.src_stride = 4096;
    strided.dst_stride = 1000;
    let ops = [
        op(0, 0, 10, 0, 1 << 19),
        strided,
        op(0, (1 << 20) - 10, 11, (1 << 19) - 10, 10),
    ];
    let id = a.write(peer, &ops, Some(Notice(0xfeed))).unwrap();
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    pump_until(&mut a, &mut b, &mut ea, &mut eb, |ea, eb| {
        !ea.is_empty() && !eb.is_empty()
    });
    assert!(
        matches!(ea[..], [Event::WriteDone { op, bytes, .. }] if op == id && bytes == (1 << 19) + 15_010),
        "{ea:?}"
    );
    assert!(matches!(eb[..], [Event::Notice(Notice(0xfeed))]), "{eb:?}");
    let (s, d0, d1) = (src.to_vec(), dst0.to_vec(), dst1.to_vec());
    assert_eq!(d0[..], s[..1 << 19]);
    for i in 0..50 {
        let (so, d) = (8192 + i * 4096, 100 + i * 1000);
        assert_eq!(d1[d..d + 300], s[so..so + 300], "piece {i}");
        assert!(
            d1[d + 300..d + 1000].iter().all(|&x| x == 0),
            "gap after piece {i}"
        );
    }
    assert_eq!(d1[(1 << 19) - 10..], s[(1 << 20) - 10..]);
    assert_eq!(a.in_flight(), RECV_SLOTS);
}

#[test]
fn shm_write_delivers_bytes_then_notice() {
    write_and_verify(&LibfabricConfig::shm());
}

#[test]
fn tcp_write_delivers_bytes_then_notice() {
    write_and_verify(&LibfabricConfig::tcp(Some("lo")));
}

#[test]
fn modes_follow_the_provider() {
    let shm = LibfabricTransport::open(&LibfabricConfig::shm()).unwrap();
    assert!(shm.uses_virtual_addresses());
    let tcp = LibfabricTransport::open(&LibfabricConfig::tcp(Some("lo"))).unwrap();
    assert_eq!(tcp.domain_name(), "lo");
    assert!(!tcp.uses_virtual_addresses());
    assert!(!tcp.uses_provider_keys());
    let mut tcp = tcp;
    let buffer = Arc::new(HostBuffer::new(4096).unwrap());
    let r0 = tcp
        .register(LocalRegion::host(0, Arc::clone(&buffer)))
        .unwrap();
    let r1 = tcp.register(LocalRegion::host(1, buffer)).unwrap();
    assert_eq!(
        (r0.addr, r1.addr),
        (0, 0),
        "tcp addresses regions by offset"
    );
    assert_ne!(r0.key, r1.key, "own keys are unique");
}

#[test]
fn read_send_and_errors() {
    let (mut a, mut b) = pair(&LibfabricConfig::shm());
    let remote = Arc::new(HostBuffer::new(65536).unwrap());
    remote.fill_with(|i| (i % 253) as u8);
    let local = Arc::new(HostBuffer::new(65536).unwrap());
    b.register(LocalRegion::host(3, Arc::clone(&remote)))
        .unwrap();
    a.register(LocalRegion::host(4, Arc::clone(&local)))
        .unwrap();
    let peer = a.connect(&b.local_desc()).unwrap();
    let back = b.connect(&a.local_desc()).unwrap();
    a.read(peer, &[op(3, 1000, 4, 0, 5000)]).unwrap();
    a.send(peer, b"registration").unwrap();
    b.send(back, b"ack").unwrap();
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    pump_until(&mut a, &mut b, &mut ea, &mut eb, |ea, eb| {
        ea.len() >= 3 && eb.len() >= 2
    });
    assert!(
        ea.iter()
            .any(|e| matches!(e, Event::ReadDone { bytes: 5000, .. })),
        "{ea:?}"
    );
    assert!(ea.iter().any(|e| matches!(e, Event::SendDone { .. })));
    assert!(ea
        .iter()
        .any(|e| matches!(e, Event::Message(m) if m == b"ack")));
    assert!(eb
        .iter()
        .any(|e| matches!(e, Event::Message(m) if m == b"registration")));
    assert_eq!(local.to_vec()[..5000], remote.to_vec()[1000..6000]);

    // Out of bounds on the remote side, unknown regions: refused before posting.
    assert!(matches!(
        a.write(peer, &[op(4, 0, 3, 65000, 537)], None),
        Err(WriteError::Plan(crate::PlanError::OutOfBounds {
            side: crate::Side::Dst,
            ..
        }))
    ));
    assert!(matches!(
        a.read(peer, &[op(9, 0, 4, 0, 1)]),
        Err(ReadError::Plan(crate::PlanError::Unregistered {
            side: crate::Side::Src,
            ..
        }))
    ));
    assert!(matches!(
        a.send(peer, &vec![0; a.capabilities().max_message_len + 1]),
        Err(SendError::TooLarge { .. })
    ));
    assert!(matches!(
        a.deregister(99),
        Err(DeregisterError::Unknown(99))
    ));

    // A region in use by an operation whose completion has not been read cannot go away.
    let id = a.write(peer, &[op(4, 0, 3, 0, 4096)], None).unwrap();
    assert!(matches!(
        a.deregister(4),
        Err(DeregisterError::InUse { index: 4, ops: 1 })
    ));
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    pump_until(&mut a, &mut b, &mut ea, &mut eb, |ea, _| {
        ea.iter()
            .any(|e| matches!(e, Event::WriteDone { op, .. } if *op == id))
    });
    a.deregister(4).unwrap();
}

#[test]
fn connect_refuses_other_providers_and_broken_descriptions() {
    let mut shm = LibfabricTransport::open(&LibfabricConfig::shm()).unwrap();
    let tcp = LibfabricTransport::open(&LibfabricConfig::tcp(Some("lo"))).unwrap();
    assert!(matches!(
        shm.connect(&tcp.local_desc()),
        Err(ConnectError::Mismatch { .. })
    ));
    let mut desc = shm.local_desc();
    desc.notice_slot = None;
    assert!(matches!(
        shm.connect(&desc),
        Err(ConnectError::BadDescription(_))
    ));
    let mut desc = shm.local_desc();
    desc.address.clear();
    assert!(matches!(
        shm.connect(&desc),
        Err(ConnectError::BadDescription(_))
    ));
}

#[test]
fn wait_blocks_until_timeout_without_events() {
    let mut a = LibfabricTransport::open(&LibfabricConfig::tcp(Some("lo"))).unwrap();
    let mut events = Vec::new();
    assert_eq!(a.wait(&mut events, Duration::from_millis(20)).unwrap(), 0);
    assert!(events.is_empty());
}
