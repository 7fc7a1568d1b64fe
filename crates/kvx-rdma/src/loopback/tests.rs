//! Unit tests of the in-process loopback transport.

use super::*;
use crate::region::HostBuffer;
use kvx_core::Rank;

/// A waker interrupts a long wait from another thread, and a wake that comes before the
/// wait makes the next wait return at once.
#[test]
fn a_waker_interrupts_a_wait() {
    crate::transport::check_waker(&mut LoopbackFabric::new().endpoint());
}

fn region(index: u32, len: usize, seed: u8) -> (Arc<HostBuffer>, LocalRegion) {
    let buffer = Arc::new(HostBuffer::new(len).unwrap());
    buffer.fill_with(|i| (i as u8).wrapping_mul(31).wrapping_add(seed));
    (Arc::clone(&buffer), LocalRegion::host(index, buffer))
}

fn op(src_region: u32, src_offset: u64, dst_region: u32, dst_offset: u64, len: u64) -> CopyOp {
    CopyOp::run(
        Rank(0),
        (src_region, src_offset),
        (dst_region, dst_offset),
        len,
    )
}

#[test]
fn a_disconnected_peer_is_refused_and_a_new_connection_works() {
    let fabric = LoopbackFabric::new();
    let (mut a, mut b) = (fabric.endpoint(), fabric.endpoint());
    a.register(region(0, 1 << 16, 1).1).unwrap();
    b.register(region(0, 1 << 16, 2).1).unwrap();
    crate::transport::check_disconnect(&mut a, &mut b, 1 << 16);
}

#[test]
fn board_notices_land_in_the_peers_memory_after_the_data() {
    let fabric = LoopbackFabric::new();
    let (mut a, mut b) = (fabric.endpoint(), fabric.endpoint());
    let (src, r) = region(0, 4096, 1);
    a.register(r).unwrap();
    let (dst, r) = region(0, 4096, 2);
    b.register(r).unwrap();
    crate::transport::check_notice_board(&mut a, &mut b, 4096, &|| dst.to_vec() == src.to_vec());
}

#[test]
fn write_moves_bytes_then_notifies() {
    let fabric = LoopbackFabric::new();
    let mut producer = fabric.endpoint();
    let mut consumer = fabric.endpoint();
    let (src, r) = region(0, 8192, 1);
    producer.register(r).unwrap();
    let (dst, r) = region(4, 8192, 0);
    dst.fill_with(|_| 0);
    consumer.register(r).unwrap();

    let peer = producer.connect(&consumer.local_desc()).unwrap();
    let mut strided = op(0, 100, 4, 0, 10);
    strided.count = 3;
    strided.src_stride = 1000;
    strided.dst_stride = 20;
    let ops = [op(0, 0, 4, 4096, 4096), strided];
    let id = producer.write(peer, &ops, Some(Notice(0xabc))).unwrap();

    let mut events = Vec::new();
    assert_eq!(
        producer.wait(&mut events, Duration::from_secs(5)).unwrap(),
        1
    );
    assert!(matches!(events[0], Event::WriteDone { op, bytes: 4126, .. } if op == id));

    let mut events = Vec::new();
    consumer.wait(&mut events, Duration::from_secs(5)).unwrap();
    assert!(matches!(events[..], [Event::Notice(Notice(0xabc))]));
    let (s, d) = (src.to_vec(), dst.to_vec());
    assert_eq!(d[4096..], s[..4096]);
    for i in 0..3 {
        assert_eq!(d[i * 20..i * 20 + 10], s[100 + i * 1000..110 + i * 1000]);
        assert!(d[i * 20 + 10..i * 20 + 20].iter().all(|&b| b == 0));
    }
    assert!(d[60..4096].iter().all(|&b| b == 0));
}

#[test]
fn out_of_bounds_and_unknown_regions_move_nothing() {
    let fabric = LoopbackFabric::new();
    let mut a = fabric.endpoint();
    let mut b = fabric.endpoint();
    let (_src, r) = region(0, 4096, 1);
    a.register(r).unwrap();
    let (dst, r) = region(0, 4096, 0);
    dst.fill_with(|_| 0);
    b.register(r).unwrap();
    let peer = a.connect(&b.local_desc()).unwrap();
    let ops = [op(0, 0, 0, 0, 100), op(0, 0, 0, 4000, 97)];
    let err = a.write(peer, &ops, Some(Notice(1))).unwrap_err();
    assert!(matches!(
        err,
        WriteError::Plan(crate::PlanError::OutOfBounds { op: 1, .. })
    ));
    let err = a.write(peer, &[op(0, 0, 9, 0, 1)], None).unwrap_err();
    assert!(matches!(
        err,
        WriteError::Plan(crate::PlanError::Unregistered { op: 0, .. })
    ));
    assert!(matches!(
        a.write(PeerId(9), &ops, None),
        Err(WriteError::UnknownPeer(PeerId(9)))
    ));
    let mut events = Vec::new();
    assert_eq!(b.poll(&mut events).unwrap(), 0);
    assert!(dst.to_vec().iter().all(|&x| x == 0));
}

#[test]
fn dropped_peer_fails_asynchronously_without_notice() {
    let fabric = LoopbackFabric::new();
    let mut a = fabric.endpoint();
    let mut b = fabric.endpoint();
    let (_s, r) = region(0, 64, 1);
    a.register(r).unwrap();
    let (_d, r) = region(0, 64, 0);
    b.register(r).unwrap();
    let peer = a.connect(&b.local_desc()).unwrap();
    drop(b);
    a.write(peer, &[op(0, 0, 0, 0, 64)], Some(Notice(5)))
        .unwrap();
    a.send(peer, b"hi").unwrap();
    let mut events = Vec::new();
    a.poll(&mut events).unwrap();
    assert_eq!(events.len(), 2);
    for event in &events {
        assert!(matches!(
            event,
            Event::Failed {
                error: OpError::PeerUnreachable { .. },
                ..
            }
        ));
    }
}

#[test]
fn deregistered_remote_region_is_a_remote_access_error() {
    let fabric = LoopbackFabric::new();
    let mut a = fabric.endpoint();
    let mut b = fabric.endpoint();
    let (_s, r) = region(0, 64, 1);
    a.register(r).unwrap();
    let (_d, r) = region(0, 64, 0);
    b.register(r.clone()).unwrap();
    let peer = a.connect(&b.local_desc()).unwrap();
    b.deregister(0).unwrap();
    b.register(r).unwrap();
    a.write(peer, &[op(0, 0, 0, 0, 64)], Some(Notice(5)))
        .unwrap();
    let mut events = Vec::new();
    a.poll(&mut events).unwrap();
    assert!(matches!(
        events[..],
        [Event::Failed {
            error: OpError::RemoteAccess { .. },
            kind: OpKind::Write,
            ..
        }]
    ));
    let mut events = Vec::new();
    assert_eq!(
        b.poll(&mut events).unwrap(),
        0,
        "no notice for a failed write"
    );
}

#[test]
fn read_send_and_registration_errors() {
    let fabric = LoopbackFabric::new();
    let mut a = fabric.endpoint();
    let mut b = fabric.endpoint();
    let (remote, r) = region(2, 256, 7);
    b.register(r).unwrap();
    let (local, r) = region(1, 256, 0);
    local.fill_with(|_| 0);
    a.register(r.clone()).unwrap();
    assert!(matches!(a.register(r), Err(RegisterError::Duplicate(1))));
    let peer = a.connect(&b.local_desc()).unwrap();
    assert_eq!(a.connect(&b.local_desc()).unwrap(), peer);
    a.read(peer, &[op(2, 16, 1, 0, 32)]).unwrap();
    a.send(peer, b"hello").unwrap();
    let mut events = Vec::new();
    a.poll(&mut events).unwrap();
    assert!(matches!(events[0], Event::ReadDone { bytes: 32, .. }));
    assert!(matches!(events[1], Event::SendDone { .. }));
    assert_eq!(local.to_vec()[..32], remote.to_vec()[16..48]);
    let mut events = Vec::new();
    b.poll(&mut events).unwrap();
    assert!(matches!(&events[..], [Event::Message(m)] if m == b"hello"));
    assert!(matches!(
        a.send(peer, &vec![0; MAX_MESSAGE_LEN + 1]),
        Err(SendError::TooLarge { .. })
    ));
    assert!(matches!(a.deregister(9), Err(DeregisterError::Unknown(9))));
}

#[test]
fn connect_refuses_foreign_descriptions() {
    let fabric = LoopbackFabric::new();
    let other = LoopbackFabric::new();
    let mut a = fabric.endpoint();
    let b = other.endpoint();
    assert!(matches!(
        a.connect(&b.local_desc()),
        Err(ConnectError::Unreachable { .. })
    ));
    let mut desc = b.local_desc();
    desc.backend = "libfabric".into();
    assert!(matches!(
        a.connect(&desc),
        Err(ConnectError::Mismatch { .. })
    ));
    desc.address.clear();
    assert!(matches!(
        a.connect(&desc),
        Err(ConnectError::BadDescription(_))
    ));
}

#[test]
fn wait_times_out_empty() {
    let fabric = LoopbackFabric::new();
    let mut a = fabric.endpoint();
    let mut events = Vec::new();
    assert_eq!(a.wait(&mut events, Duration::from_millis(10)).unwrap(), 0);
    assert!(events.is_empty());
}
