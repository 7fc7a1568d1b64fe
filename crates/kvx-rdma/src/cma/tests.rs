//! Unit tests of the `cma` transport.

use super::*;
use crate::region::HostBuffer;
use kvx_core::Rank;
use std::sync::Arc;
use std::time::Instant;

/// A waker interrupts a long wait from another thread, and a wake that comes before the
/// wait makes the next wait return at once.
#[test]
fn a_waker_interrupts_a_wait() {
    crate::transport::check_waker(&mut CmaTransport::open(CmaConfig::default()).unwrap());
}

#[test]
fn a_disconnected_peer_is_refused_and_a_new_connection_works() {
    let mut a = CmaTransport::open(CmaConfig::default()).unwrap();
    let mut b = CmaTransport::open(CmaConfig::default()).unwrap();
    let len = 8 << 20;
    a.register(LocalRegion::host(
        0,
        Arc::new(HostBuffer::new(len).unwrap()),
    ))
    .unwrap();
    b.register(LocalRegion::host(
        0,
        Arc::new(HostBuffer::new(len).unwrap()),
    ))
    .unwrap();
    crate::transport::check_disconnect(&mut a, &mut b, len as u64);
}

fn op(src: u64, dst: u64, len: u64, count: u64, strides: (u64, u64)) -> CopyOp {
    CopyOp::strided(Rank(0), (0, src), (0, dst), len, count, strides)
}

fn wait_for(t: &mut CmaTransport, want: impl Fn(&Event) -> bool) -> Event {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut events = Vec::new();
    loop {
        events.clear();
        t.wait(&mut events, Duration::from_millis(100)).unwrap();
        if let Some(i) = events.iter().position(&want) {
            return events.swap_remove(i);
        }
        assert!(Instant::now() < deadline, "no matching event");
    }
}

/// Two endpoints of this process, `a` with a patterned 1 MiB region 0, `b` with an empty one.
fn two_endpoints() -> (CmaTransport, CmaTransport, Arc<HostBuffer>, Arc<HostBuffer>) {
    let mut a = CmaTransport::open(CmaConfig::default()).unwrap();
    let mut b = CmaTransport::open(CmaConfig::default()).unwrap();
    let src = Arc::new(HostBuffer::new(1 << 20).unwrap());
    src.fill_with(|i| (i * 7 % 251) as u8);
    let dst = Arc::new(HostBuffer::new(1 << 20).unwrap());
    a.register(LocalRegion::host(0, Arc::clone(&src))).unwrap();
    b.register(LocalRegion::host(0, Arc::clone(&dst))).unwrap();
    (a, b, src, dst)
}

#[test]
fn board_notices_land_in_the_peers_memory_after_the_data() {
    let (mut a, mut b, src, dst) = two_endpoints();
    crate::transport::check_notice_board(&mut a, &mut b, 1 << 20, &|| dst.to_vec() == src.to_vec());
}

/// Two endpoints of one process: CMA into the own process is allowed, so the whole path
/// (system calls, notices, reads, errors) runs here; tests/xproc_cma.rs crosses processes.
#[test]
fn write_read_notice_and_bad_plans_in_one_process() {
    let (mut a, mut b, src, dst) = two_endpoints();
    let peer = a.connect(&b.local_desc()).unwrap();
    // 3000 strided pieces: more than one system call's worth.
    let strided = op(0, 0, 100, 3000, (300, 200));
    let tail = op(1_000_000, (1 << 20) - 48_576, 48_576, 1, (0, 0));
    a.write(peer, &[strided, tail], Some(Notice(7))).unwrap();
    assert!(matches!(
        wait_for(&mut a, |e| matches!(
            e,
            Event::WriteDone { .. } | Event::Failed { .. }
        )),
        Event::WriteDone { bytes: 348_576, .. }
    ));
    assert!(matches!(
        wait_for(&mut b, |e| matches!(e, Event::Notice(_))),
        Event::Notice(Notice(7))
    ));
    let got = dst.to_vec();
    let want = src.to_vec();
    for i in 0..3000 {
        assert_eq!(
            got[i * 200..i * 200 + 100],
            want[i * 300..i * 300 + 100],
            "row {i}"
        );
    }
    assert_eq!(got[(1 << 20) - 48_576..], want[1_000_000..1_048_576]);
    // Pull: read back from the peer.
    let back = Arc::new(HostBuffer::new(4096).unwrap());
    a.register(LocalRegion::host(1, Arc::clone(&back))).unwrap();
    let read = CopyOp::run(Rank(0), (0, 200), (1, 0), 4096);
    a.read(peer, &[read]).unwrap();
    wait_for(&mut a, |e| matches!(e, Event::ReadDone { .. }));
    assert_eq!(back.to_vec(), got[200..200 + 4096]);
    // Refused before anything moves.
    assert!(matches!(
        a.write(peer, &[op(0, (1 << 20) - 10, 100, 1, (0, 0))], None),
        Err(WriteError::Plan(_))
    ));
    assert!(matches!(
        a.write(PeerId(9), &[op(0, 0, 1, 1, (0, 0))], None),
        Err(WriteError::UnknownPeer(_))
    ));
    assert!(a.deregister(5).is_err());
    // Messages both ways.
    a.send(peer, b"hi").unwrap();
    assert!(matches!(
        wait_for(&mut b, |e| matches!(e, Event::Message(_))),
        Event::Message(m) if m == b"hi"
    ));
    // The peer goes away: the next write fails as unreachable, with no notice.
    drop(b);
    std::thread::sleep(Duration::from_millis(5));
    a.write(peer, &[op(0, 0, 64, 1, (0, 0))], Some(Notice(8)))
        .unwrap();
    assert!(matches!(
        wait_for(&mut a, |e| matches!(
            e,
            Event::Failed { .. } | Event::WriteDone { .. }
        )),
        Event::Failed {
            error: OpError::PeerUnreachable { .. },
            ..
        }
    ));
}

#[test]
fn shares_cover_the_pieces_in_order_and_balance_the_bytes() {
    let pieces = vec![(0, 1000, 10), (100, 2000, 25), (500, 3000, 5)];
    for parts in 1..6 {
        let shares = split(pieces.clone(), parts);
        assert!(shares.len() <= parts);
        let flat: Vec<_> = shares.iter().flatten().copied().collect();
        // Re-joined, the shares are the pieces, byte for byte, in order.
        let bytes = |v: &[(u64, u64, u64)]| -> Vec<(u64, u64)> {
            v.iter()
                .flat_map(|&(l, r, n)| (0..n).map(move |i| (l + i, r + i)))
                .collect()
        };
        assert_eq!(bytes(&flat), bytes(&pieces));
        let sizes: Vec<u64> = shares.iter().map(|s| s.iter().map(|p| p.2).sum()).collect();
        assert!(
            sizes.iter().all(|&n| n <= 40_u64.div_ceil(parts as u64)),
            "{sizes:?}"
        );
    }
}

#[test]
fn addresses_are_checked() {
    let t = CmaTransport::open(CmaConfig::default()).unwrap();
    let desc = t.local_desc();
    assert_eq!(
        CmaTransport::decode(&desc.address).unwrap(),
        *t.control.identity()
    );
    assert!(CmaTransport::decode(&desc.address[..desc.address.len() - 1]).is_err());
    let mut other = desc.clone();
    other.backend = "libfabric".into();
    let mut t = t;
    assert!(matches!(
        t.connect(&other),
        Err(ConnectError::Mismatch { .. })
    ));
}

/// An address that names another process than the one serving its socket is refused: the pid
/// cma copies into is the process at the other end of the socket, checked with `SO_PEERCRED`,
/// not whichever pid a peer writes into its address (here a live process that is not this one,
/// and the first process).
#[test]
fn an_address_naming_another_process_than_its_sockets_is_refused() {
    let target = CmaTransport::open(CmaConfig::default()).unwrap();
    let mut writer = CmaTransport::open(CmaConfig::default()).unwrap();
    let mut child = std::process::Command::new("sleep")
        .arg("5")
        .spawn()
        .unwrap();
    for pid in [child.id(), 1] {
        let mut who = target.control.identity().clone();
        who.pid = pid;
        let mut forged = target.local_desc();
        forged.address = same_host::encode_head(ADDRESS_MAGIC, ADDRESS_VERSION, &who);
        let err = writer.connect(&forged).unwrap_err();
        assert!(matches!(err, ConnectError::Unreachable { .. }), "{err}");
        let text = format!("{:?}", err);
        assert!(text.contains("not by the address's process"), "{text}");
    }
    // The true address connects.
    assert!(writer.connect(&target.local_desc()).is_ok());
    let _ = child.kill();
    let _ = child.wait();
}
