//! In-process tests of the libfabric backend: two endpoints of one process (the cross-process
//! tests are in `tests/`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::Rank;
use kvx_layout::CopyOp;

use super::*;
use crate::desc::EndpointDesc;
use crate::error::{ConnectError, DeregisterError, ReadError, SendError, WriteError};
use crate::region::{HostBuffer, LocalRegion};
use crate::transport::{Notice, Transport};

/// `shm` with the stale-region sweep on where the test run asks for it ([`SHM_SWEEP_ENV`]):
/// tests read the environment, the crate does not.
fn shm_config() -> LibfabricConfig {
    let mut config = LibfabricConfig::shm();
    config.sweep_stale_shm = std::env::var_os(SHM_SWEEP_ENV).is_some_and(|v| v == "1");
    config
}

fn pair(config: &LibfabricConfig) -> (LibfabricTransport, LibfabricTransport) {
    let a = LibfabricTransport::open(config).expect("open endpoint a");
    let b = LibfabricTransport::open(config).expect("open endpoint b");
    (a, b)
}

fn op(src_region: u32, src_offset: u64, dst_region: u32, dst_offset: u64, len: u64) -> CopyOp {
    CopyOp::run(
        Rank(0),
        (src_region, src_offset),
        (dst_region, dst_offset),
        len,
    )
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
    write_and_verify(&shm_config());
}

#[test]
fn tcp_write_delivers_bytes_then_notice() {
    write_and_verify(&LibfabricConfig::tcp(Some("lo")));
}

/// Where the transport chooses registration keys (tcp and shm: no `FI_MR_PROV_KEY`), they start
/// at a random value within the provider's key size: a peer never sent one cannot count its way
/// to one, and two endpoints (two processes) do not share theirs.
#[test]
fn keys_the_transport_chooses_are_random_and_unique() {
    for size in [1usize, 2, 4, 8] {
        let k = first_key(size);
        let max = if size == 8 {
            u64::MAX
        } else {
            (1u64 << (8 * size)) - 1
        };
        assert!(
            k >= 1 && (max <= KEY_ROOM || k <= max - KEY_ROOM),
            "size {size}: {k:#x}"
        );
    }
    assert_ne!(first_key(8), first_key(8));
    for config in [shm_config(), LibfabricConfig::tcp(Some("lo"))] {
        let (mut a, mut b) = pair(&config);
        let region = |index| {
            let buffer = Arc::new(HostBuffer::new(4096).unwrap());
            LocalRegion::host(index, buffer)
        };
        let a0 = a.register(region(0)).unwrap().key;
        let a1 = a.register(region(1)).unwrap().key;
        let b0 = b.register(region(0)).unwrap().key;
        assert_ne!(a0, a1, "{}", config.provider);
        assert_ne!(
            a0, b0,
            "{}: two endpoints chose the same key",
            config.provider
        );
        assert!(
            a0 > KEY_ROOM || b0 > KEY_ROOM,
            "{}: {a0:#x} {b0:#x}",
            config.provider
        );
    }
}

#[test]
fn modes_follow_the_provider() {
    let shm = LibfabricTransport::open(&shm_config()).unwrap();
    assert!(shm.uses_virtual_addresses());
    // shm 1.17 has no wait object; its writes land by cross-memory attach where that works.
    let caps = shm.capabilities();
    assert!(caps.polls_to_wait);
    assert_eq!(caps.peer_rma_unassisted, super::shm_cma::cma_usable());
    let tcp = LibfabricTransport::open(&LibfabricConfig::tcp(Some("lo"))).unwrap();
    assert_eq!(tcp.domain_name(), "lo");
    // tcp blocks on a wait descriptor, and its data needs the target's progress.
    let caps = tcp.capabilities();
    assert!(!caps.polls_to_wait && !caps.peer_rma_unassisted);
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
    let (mut a, mut b) = pair(&shm_config());
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
    let mut shm = LibfabricTransport::open(&shm_config()).unwrap();
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

/// A write in flight when its peer is disconnected still ends (its address-vector entry goes
/// only then); the old id is refused, and a new connection works, over both providers.
#[test]
fn a_disconnected_peer_is_refused_and_a_new_connection_works() {
    for config in [shm_config(), LibfabricConfig::tcp(Some("lo"))] {
        let (mut a, mut b) = pair(&config);
        let len = 4 << 20;
        let region = || LocalRegion::host(0, Arc::new(HostBuffer::new(len).unwrap()));
        a.register(region()).unwrap();
        b.register(region()).unwrap();
        crate::transport::check_disconnect(&mut a, &mut b, len as u64);
    }
}

#[test]
fn wakers_interrupt_waits_on_every_kind_of_queue() {
    // shm: no wait object (reads with sleeps); tcp: one wait descriptor; two tcp rails: two.
    for config in [
        shm_config(),
        LibfabricConfig::tcp(Some("lo")),
        two_rails(LibfabricConfig::tcp(Some("lo"))),
    ] {
        let mut endpoint = LibfabricTransport::open(&config).unwrap();
        crate::transport::check_waker(&mut endpoint);
    }
}

#[test]
fn wait_blocks_until_timeout_without_events() {
    let mut a = LibfabricTransport::open(&LibfabricConfig::tcp(Some("lo"))).unwrap();
    let mut events = Vec::new();
    assert_eq!(a.wait(&mut events, Duration::from_millis(20)).unwrap(), 0);
    assert!(events.is_empty());
}

// ---- Striping -------------------------------------------------------------------------------

mod striping {
    use proptest::prelude::*;

    use super::super::stripe::stripe;
    use super::*;

    fn strided(src: u64, dst: u64, len: u64, count: u64, strides: (u64, u64)) -> CopyOp {
        CopyOp {
            count,
            src_stride: strides.0,
            dst_stride: strides.1,
            ..op(0, src, 1, dst, len)
        }
    }

    /// Every byte an operation list moves, as (source offset, destination offset) pairs, sorted.
    fn bytes_moved(ops: &[CopyOp]) -> Vec<(u32, u64, u32, u64)> {
        let mut out = Vec::new();
        for op in ops {
            for (s, d, len) in op.pieces() {
                for i in 0..len {
                    out.push((op.src_region, s + i, op.dst_region, d + i));
                }
            }
        }
        out.sort_unstable();
        out
    }

    fn total(ops: &[CopyOp]) -> u64 {
        ops.iter().map(CopyOp::bytes).sum()
    }

    #[test]
    fn small_plans_go_whole_on_the_round_robin_rail() {
        let ops = [op(0, 0, 1, 0, 1000), strided(0, 0, 10, 5, (20, 30))];
        for first in 0..5 {
            let out = stripe(&ops, 3, 4096, first);
            assert_eq!(out.len(), 3);
            assert_eq!(out[first % 3], ops);
            assert!(out
                .iter()
                .enumerate()
                .all(|(k, o)| k == first % 3 || o.is_empty()));
        }
        // One rail, or zero asked for: everything on rail 0.
        assert_eq!(stripe(&ops, 1, 0, 7), vec![ops.to_vec()]);
        assert_eq!(stripe(&ops, 0, 0, 7), vec![ops.to_vec()]);
    }

    #[test]
    fn a_large_contiguous_op_splits_at_exact_bytes() {
        let out = stripe(&[op(0, 100, 1, 7, 1_000_001)], 2, 0, 1);
        assert_eq!(out[0], [op(0, 100, 1, 7, 500_000)]);
        assert_eq!(out[1], [op(0, 500_100, 1, 500_007, 500_001)]);
    }

    #[test]
    fn strided_ops_split_by_rows() {
        // 64 rows of 8 KiB: 32 whole rows per rail, offsets advanced by 32 strides.
        let s = strided(1000, 2000, 8192, 64, (16384, 12288));
        let out = stripe(&[s], 2, 0, 0);
        assert_eq!(out[0], [CopyOp { count: 32, ..s }]);
        assert_eq!(
            out[1],
            [CopyOp {
                count: 32,
                src_offset: 1000 + 32 * 16384,
                dst_offset: 2000 + 32 * 12288,
                ..s
            }]
        );
        // Three rails over 64 rows: cuts at rows 21 and 43 (nearest edges), no row split.
        let out = stripe(&[s], 3, 0, 0);
        let counts: Vec<u64> = out
            .iter()
            .map(|o| o.iter().map(|c| c.count).sum())
            .collect();
        assert_eq!(counts, [21, 22, 21]);
        assert!(out.iter().flatten().all(|c| c.len == 8192));
        // Rows as large as a rail's share are split inside a row.
        let big = strided(0, 0, 3 << 20, 2, (4 << 20, 3 << 20));
        let out = stripe(&[big], 4, 0, 0);
        assert!(out.iter().all(|o| total(o) == 3 << 19), "{out:?}");
        assert_eq!(bytes_moved(&out.concat()), bytes_moved(&[big]));
    }

    fn any_op() -> impl Strategy<Value = CopyOp> {
        (
            0u32..3,
            0u64..5000,
            0u64..5000,
            1u64..400,
            1u64..12,
            0u64..600,
            0u64..600,
        )
            .prop_map(|(region, src, dst, len, count, gap_s, gap_d)| CopyOp {
                src_region: region,
                dst_region: 2 - region,
                count,
                src_stride: len + gap_s,
                dst_stride: len + gap_d,
                ..op(0, src, 0, dst, len)
            })
    }

    proptest! {
        #[test]
        fn every_byte_goes_exactly_once_and_rails_are_balanced(
            ops in proptest::collection::vec(any_op(), 1..8),
            rails in 1usize..6,
            threshold in 0u64..6000,
            first in 0usize..10,
        ) {
            let out = stripe(&ops, rails, threshold, first);
            prop_assert_eq!(out.len(), rails);
            let all: Vec<CopyOp> = out.concat();
            prop_assert_eq!(bytes_moved(&all), bytes_moved(&ops));
            prop_assert!(all.iter().all(|c| c.len > 0 && c.count > 0));
            let bytes = total(&ops);
            if rails == 1 || bytes < threshold {
                prop_assert_eq!(&out[first % rails], &ops);
            } else {
                // Each rail within its share, give or take the row snapping (a rail's share
                // is at least 8 rows wherever a cut snaps: half a row per cut, two cuts).
                let share = bytes / rails as u64;
                for o in &out {
                    let b = total(o);
                    prop_assert!(b + share / 8 + 1 >= share && b <= share + share / 8 + 1,
                        "rail bytes {} share {}", b, share);
                }
            }
        }
    }
}

// ---- Several rails --------------------------------------------------------------------------

fn two_rails(config: LibfabricConfig) -> LibfabricConfig {
    config.with_rails(Rails::Count(2))
}

/// A plan big enough to be striped: 3 MiB contiguous, 96 strided rows of 8 KiB, a small tail.
fn big_plan() -> Vec<CopyOp> {
    let mut strided = op(0, 4 << 20, 1, 0, 8192);
    strided.count = 96;
    strided.src_stride = 16384;
    strided.dst_stride = 10_000;
    vec![
        op(0, 0, 0, 1 << 20, 3 << 20),
        strided,
        op(0, (6 << 20) - 5, 1, (2 << 20) - 5, 5),
    ]
}

fn expected(plan: &[CopyOp], src: &[u8], dst_lens: [usize; 2]) -> [Vec<u8>; 2] {
    let mut out = [vec![0; dst_lens[0]], vec![0; dst_lens[1]]];
    for op in plan {
        for (s, d, len) in op.pieces() {
            let (s, d, len) = (s as usize, d as usize, len as usize);
            out[op.dst_region as usize][d..d + len].copy_from_slice(&src[s..s + len]);
        }
    }
    out
}

fn multi_rail_write_and_read(a_config: &LibfabricConfig, b_config: &LibfabricConfig) {
    let mut a = LibfabricTransport::open(a_config).expect("open a");
    let mut b = LibfabricTransport::open(b_config).expect("open b");
    assert_eq!(a.in_flight(), RECV_SLOTS * a.rail_count());
    let src = Arc::new(HostBuffer::new(6 << 20).unwrap());
    src.fill_with(|i| (i * 13 + i / 1000) as u8);
    let dst = [
        Arc::new(HostBuffer::new(4 << 20).unwrap()),
        Arc::new(HostBuffer::new(2 << 20).unwrap()),
    ];
    a.register(LocalRegion::host(0, Arc::clone(&src))).unwrap();
    for (i, d) in dst.iter().enumerate() {
        b.register(LocalRegion::host(i as u32, Arc::clone(d)))
            .unwrap();
    }
    let peer = a.connect(&b.local_desc()).unwrap();
    let back = b.connect(&a.local_desc()).unwrap();
    let links = a_config_links(&a, &b);
    assert_eq!(a.links(peer), Some(links));
    assert_eq!(b.links(back), Some(links));

    let plan = big_plan();
    let id = a.write(peer, &plan, Some(Notice(77))).unwrap();
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    // The notice arrives only once every byte is there: check the memory the moment it does.
    let want = expected(&plan, &src.to_vec(), [4 << 20, 2 << 20]);
    pump_until(&mut a, &mut b, &mut ea, &mut eb, |ea, eb| {
        !ea.is_empty() && !eb.is_empty()
    });
    assert!(matches!(eb[..], [Event::Notice(Notice(77))]), "{eb:?}");
    let now = [
        first_difference(&dst[0].to_vec(), &want[0]),
        first_difference(&dst[1].to_vec(), &want[1]),
    ];
    if now != [None, None] {
        std::thread::sleep(Duration::from_millis(500));
        let (mut ea2, mut eb2) = (Vec::new(), Vec::new());
        let _ = a.poll(&mut ea2);
        let _ = b.poll(&mut eb2);
        std::thread::sleep(Duration::from_millis(500));
        let _ = a.poll(&mut ea2);
        let _ = b.poll(&mut eb2);
        let later = [
            first_difference(&dst[0].to_vec(), &want[0]),
            first_difference(&dst[1].to_vec(), &want[1]),
        ];
        panic!(
            "differences at the notice {now:?}, a second later {later:?}, dc {}",
            a.delivery_complete()
        );
    }
    let total: u64 = plan.iter().map(CopyOp::bytes).sum();
    assert!(
        matches!(ea[..], [Event::WriteDone { op, bytes, .. }] if op == id && bytes == total),
        "{ea:?}"
    );

    // Pull mode: b reads a's bytes back into its second region, striped too.
    let mut read_plan = op(0, 0, 1, 0, 2 << 20);
    read_plan.count = 1;
    let id = b.read(back, &[read_plan]).unwrap();
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    pump_until(&mut a, &mut b, &mut ea, &mut eb, |_, eb| !eb.is_empty());
    assert!(
        matches!(eb[..], [Event::ReadDone { op, bytes, .. }] if op == id && bytes == 2 << 20),
        "{eb:?}"
    );
    assert_eq!(
        first_difference(&dst[1].to_vec(), &src.to_vec()[..2 << 20]),
        None
    );

    // Small writes take turns on the rails and still deliver notices in order of completion.
    for n in 0..4 {
        a.write(peer, &[op(0, n * 100, 0, n * 100, 100)], Some(Notice(n)))
            .unwrap();
    }
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    pump_until(&mut a, &mut b, &mut ea, &mut eb, |ea, eb| {
        ea.len() >= 4 && eb.len() >= 4
    });
    let mut notices: Vec<u64> = eb
        .iter()
        .filter_map(|e| match e {
            Event::Notice(Notice(n)) => Some(*n),
            _ => None,
        })
        .collect();
    notices.sort_unstable();
    assert_eq!(notices, [0, 1, 2, 3]);
    assert_eq!(
        first_difference(&dst[0].to_vec()[..400], &src.to_vec()[..400]),
        None
    );

    // Messages go both ways.
    a.send(peer, b"hello").unwrap();
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    pump_until(&mut a, &mut b, &mut ea, &mut eb, |_, eb| {
        eb.iter()
            .any(|e| matches!(e, Event::Message(m) if m == b"hello"))
    });
}

/// Where two byte strings first differ (never prints megabytes of bytes).
fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
    if got.len() != want.len() {
        return Some(got.len().min(want.len()));
    }
    got.iter().zip(want).position(|(g, w)| g != w)
}

fn a_config_links(a: &LibfabricTransport, b: &LibfabricTransport) -> usize {
    a.rail_count().min(b.rail_count())
}

#[test]
fn shm_two_rails_stripe_writes_and_reads() {
    let config = two_rails(shm_config());
    let a = LibfabricTransport::open(&config).unwrap();
    assert_eq!(a.rail_count(), 2);
    assert_eq!(a.rail_domains().len(), 2);
    assert!(a.local_desc().address.starts_with(address::MAGIC));
    drop(a);
    multi_rail_write_and_read(&config, &config);
}

#[test]
fn tcp_two_rails_stripe_writes_and_reads() {
    let config = two_rails(LibfabricConfig::tcp(Some("lo")));
    multi_rail_write_and_read(&config, &config);
}

#[test]
fn two_rails_talk_to_one_rail_over_one_link() {
    let one = shm_config();
    let two = two_rails(shm_config());
    multi_rail_write_and_read(&two, &one);
    multi_rail_write_and_read(&one, &two);
}

#[test]
fn multi_rail_endpoints_report_their_rails_and_completion_semantics() {
    // Both providers here report delivery-complete completions; striped writes flush the other
    // rails before the notice anyway (tcp;ofi_rxm completes RMA writes early, see the module
    // documentation).
    let shm = LibfabricTransport::open(&two_rails(shm_config())).unwrap();
    let tcp = LibfabricTransport::open(&two_rails(LibfabricConfig::tcp(Some("lo")))).unwrap();
    assert_eq!(tcp.rail_domains(), ["lo", "lo"]);
    assert_eq!(shm.rail_count(), 2);
    assert!(shm.delivery_complete() && tcp.delivery_complete());
}

#[test]
fn rail_configurations_that_cannot_work_are_refused() {
    let none = shm_config().with_rails(Rails::Count(0));
    assert!(matches!(
        LibfabricTransport::open(&none),
        Err(OpenError::RailCount { rails: 0, .. })
    ));
    let none = shm_config().with_rails(Rails::Domains(Vec::new()));
    assert!(matches!(
        LibfabricTransport::open(&none),
        Err(OpenError::RailCount { rails: 0, .. })
    ));
    let unknown = LibfabricConfig::tcp(None).with_rails(Rails::Domains(vec![
        "lo".into(),
        "no-such-interface".into(),
    ]));
    assert!(matches!(
        LibfabricTransport::open(&unknown),
        Err(OpenError::Fabric { .. })
    ));
    // A damaged rail table is a bad description, never a panic.
    let mut shm = LibfabricTransport::open(&shm_config()).unwrap();
    let two = LibfabricTransport::open(&two_rails(shm_config())).unwrap();
    let mut desc = two.local_desc();
    desc.address.truncate(desc.address.len() - 3);
    assert!(matches!(
        shm.connect(&desc),
        Err(ConnectError::BadDescription(_))
    ));
}

/// A blocked `wait` on a multi-rail TCP endpoint wakes up when something arrives on a rail, and
/// sleeps (costs no CPU) while nothing does.
#[test]
fn multi_rail_wait_blocks_and_wakes() {
    let config = two_rails(LibfabricConfig::tcp(Some("lo")));
    let mut a = LibfabricTransport::open(&config).unwrap();
    let mut b = LibfabricTransport::open(&config).unwrap();
    let peer = a.connect(&b.local_desc()).unwrap();
    b.connect(&a.local_desc()).unwrap();

    let cpu_before = thread_cpu_ticks();
    let started = Instant::now();
    let mut events = Vec::new();
    assert_eq!(b.wait(&mut events, Duration::from_millis(300)).unwrap(), 0);
    assert!(started.elapsed() >= Duration::from_millis(300));
    if let (Some(before), Some(after)) = (cpu_before, thread_cpu_ticks()) {
        // Clock ticks are 10 ms: a spinning wait would burn about 30 of them.
        assert!(
            after - before <= 10,
            "idle wait used {} ticks",
            after - before
        );
    }

    let waiter = std::thread::spawn(move || {
        let started = Instant::now();
        let mut events = Vec::new();
        while started.elapsed() < Duration::from_secs(10) {
            b.wait(&mut events, Duration::from_secs(10)).unwrap();
            if events
                .iter()
                .any(|e| matches!(e, Event::Message(m) if m == b"wake"))
            {
                return started.elapsed();
            }
        }
        panic!("no message within 10 s: {events:?}");
    });
    std::thread::sleep(Duration::from_millis(100));
    a.send(peer, b"wake").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut events = Vec::new();
    while !waiter.is_finished() && Instant::now() < deadline {
        a.wait(&mut events, Duration::from_millis(10)).unwrap();
    }
    let woke = waiter.join().unwrap();
    assert!(
        woke < Duration::from_secs(2),
        "blocked wait woke after {woke:?}"
    );
}

/// CPU time of the calling thread, in clock ticks (`/proc/thread-self/stat`: utime + stime).
fn thread_cpu_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

// ---- Choosing rails from the topology -------------------------------------------------------

mod selection {
    use super::super::rails::{select_rails, RailFallback};
    use super::*;
    use crate::topology::{
        NetInterface, PciAddress, PciDevice, RailOverrides, RailRule, RdmaNic, Topology,
        VENDOR_AMAZON, VENDOR_NVIDIA,
    };

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    /// One switch with a GPU and two EFA NICs (one of which also has an Ethernet interface), a
    /// second GPU on another root port without NICs nearby, and a NIC on that port.
    fn host() -> Topology {
        let above = |port: &str| vec![a("0000:00:01.0"), a("0000:01:00.0"), a(port)];
        let devices = vec![
            PciDevice::new(a("0000:03:00.0"), VENDOR_NVIDIA, 0x2335, 0x03_02_00)
                .with_numa_node(Some(0))
                .with_ancestors(above("0000:02:00.0")),
            PciDevice::new(a("0000:04:00.0"), VENDOR_AMAZON, 0xefa2, 0x02_00_00)
                .with_numa_node(Some(0))
                .with_ancestors(above("0000:02:01.0")),
            PciDevice::new(a("0000:05:00.0"), VENDOR_AMAZON, 0xefa2, 0x02_00_00)
                .with_numa_node(Some(0))
                .with_ancestors(above("0000:02:02.0")),
            PciDevice::new(a("0000:81:00.0"), VENDOR_NVIDIA, 0x2335, 0x03_02_00)
                .with_numa_node(Some(1))
                .with_ancestors(vec![a("0000:80:01.0")]),
            PciDevice::new(a("0000:91:00.0"), 0x15b3, 0x101d, 0x02_00_00)
                .with_numa_node(Some(1))
                .with_ancestors(vec![a("0000:90:01.0")]),
        ];
        let nics = vec![
            RdmaNic::new("rdmap4s0", a("0000:04:00.0")),
            RdmaNic::new("rdmap5s0", a("0000:05:00.0")),
            RdmaNic::new("mlx5_0", a("0000:91:00.0")),
        ];
        let net = vec![NetInterface::new("ens91", a("0000:91:00.0"))];
        Topology::from_parts(devices, nics, net).unwrap()
    }

    fn offered(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn efa_rails_map_to_their_rdm_domains() {
        let t = host();
        let efa = offered(&["rdmap5s0-rdm", "rdmap45s0-rdm", "rdmap4s0-rdm"]);
        let s = select_rails(&t, Some(&a("0000:03:00.0")), PROVIDER_EFA, &efa);
        assert_eq!(
            s.rails,
            Rails::Domains(vec!["rdmap4s0-rdm".into(), "rdmap5s0-rdm".into()])
        );
        assert_eq!(s.rule, Some(RailRule::PcieSwitch));
        assert_eq!(s.fallback, None);
        // `rdmap4s0` must not match `rdmap45s0-rdm`.
        let s = select_rails(
            &t,
            Some(&a("0000:03:00.0")),
            PROVIDER_EFA,
            &offered(&["rdmap45s0-rdm", "rdmap5s0-rdm"]),
        );
        assert_eq!(s.rails, Rails::Domains(vec!["rdmap5s0-rdm".into()]));
        assert_eq!(s.unmatched, ["rdmap4s0"]);
    }

    #[test]
    fn overrides_are_honoured() {
        let t = host()
            .with_overrides(&"0000:03:00.0=rdmap5s0".parse::<RailOverrides>().unwrap())
            .unwrap();
        let efa = offered(&["rdmap4s0-rdm", "rdmap5s0-rdm"]);
        let s = select_rails(&t, Some(&a("0000:03:00.0")), PROVIDER_EFA, &efa);
        assert_eq!(s.rails, Rails::Domains(vec!["rdmap5s0-rdm".into()]));
        assert_eq!(s.rule, Some(RailRule::Override));
    }

    #[test]
    fn tcp_rails_map_to_the_nics_interfaces() {
        let t = host();
        // The second GPU's rail (by NUMA node) is mlx5_0, whose interface is ens91.
        let s = select_rails(
            &t,
            Some(&a("0000:81:00.0")),
            PROVIDER_TCP,
            &offered(&["lo", "ens91", "eth0"]),
        );
        assert_eq!(s.rails, Rails::Domains(vec!["ens91".into()]));
        assert_eq!(s.rule, Some(RailRule::Numa));
    }

    #[test]
    fn fallbacks_use_the_default_single_rail_and_say_why() {
        let t = host();
        let efa = offered(&["rdmap4s0-rdm"]);
        let s = select_rails(&t, None, PROVIDER_EFA, &efa);
        assert_eq!(
            (s.rails, s.fallback),
            (Rails::One, Some(RailFallback::HostMemory))
        );
        let s = select_rails(&t, Some(&a("0000:04:00.0")), PROVIDER_EFA, &efa);
        assert_eq!(
            s.fallback,
            Some(RailFallback::NotAnAccelerator(a("0000:04:00.0")))
        );
        let s = select_rails(
            &t,
            Some(&a("0000:03:00.0")),
            PROVIDER_SHM,
            &offered(&["shm"]),
        );
        assert_eq!(s.rails, Rails::One);
        let reason = s.fallback.expect("a fallback").to_string();
        assert!(
            reason.contains("rdmap4s0") && reason.contains("default domain"),
            "{reason}"
        );
        let bare = Topology::from_parts(
            vec![PciDevice::new(
                a("0000:03:00.0"),
                VENDOR_NVIDIA,
                0x2335,
                0x03_02_00,
            )],
            Vec::new(),
            Vec::new(),
        )
        .unwrap();
        let s = select_rails(&bare, Some(&a("0000:03:00.0")), PROVIDER_EFA, &efa);
        assert_eq!(s.fallback, Some(RailFallback::NoRails(a("0000:03:00.0"))));
    }

    #[test]
    fn this_hosts_providers_and_a_fallback_config_open() {
        // No RDMA NIC here: the selection falls back to one rail, which opens.
        let (config, selection) = shm_config().with_topology(&host(), None);
        assert_eq!(selection.fallback, Some(RailFallback::HostMemory));
        assert_eq!(config.rails, Rails::One);
        LibfabricTransport::open(&config).unwrap();
        assert!(super::super::rails::provider_domains(PROVIDER_TCP)
            .iter()
            .any(|d| d == "lo"));
    }
}

/// Child role of [`a_write_to_an_exited_shm_peer_fails_soon_after_disconnect`]: opens an
/// `shm` endpoint with one registered region, prints its description, and never reads its
/// queue again, until killed.
#[test]
#[ignore = "child role of a_write_to_an_exited_shm_peer_fails_soon_after_disconnect; started by it"]
fn shm_silent_child_role() {
    if std::env::var_os("KVX_SHM_SILENT_CHILD").is_none() {
        return;
    }
    let mut t = LibfabricTransport::open(&shm_config()).expect("child endpoint");
    let buf = Arc::new(HostBuffer::new(1 << 20).unwrap());
    t.register(LocalRegion::host(0, buf)).unwrap();
    println!("DESC {}", t.local_desc().to_hex());
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// A write towards an `shm` peer that never reads its queue stays in flight; once the peer's
/// process has exited (killed, not even reaped) and this side disconnected it, the write fails
/// within a fraction of a second instead of at the operation timeout.
#[test]
fn a_write_to_an_exited_shm_peer_fails_soon_after_disconnect() {
    use std::io::BufRead as _;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "libfabric::tests::shm_silent_child_role",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVX_SHM_SILENT_CHILD", "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let desc = loop {
        let line = lines
            .next()
            .expect("the child printed its endpoint")
            .unwrap();
        // After libtest's "test … … " on the same line.
        if let Some((_, hex)) = line.split_once("DESC ") {
            break EndpointDesc::from_hex(hex.trim()).unwrap();
        }
    };
    let mut config = shm_config();
    config.op_timeout = Duration::from_secs(120);
    let mut t = LibfabricTransport::open(&config).unwrap();
    let src = Arc::new(HostBuffer::new(1 << 16).unwrap());
    t.register(LocalRegion::host(0, src)).unwrap();
    let peer = t.connect(&desc).unwrap();
    let write = t
        .write(peer, &[op(0, 0, 0, 0, 4096)], Some(Notice(7)))
        .unwrap();
    let mut events = Vec::new();
    let quiet_until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < quiet_until {
        t.wait(&mut events, Duration::from_millis(20)).unwrap();
    }
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, Event::WriteDone { op, .. } if *op == write)),
        "the write ended although the peer never read its queue: {events:?}"
    );
    child.kill().unwrap();
    t.disconnect(peer);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(10);
    let failed = loop {
        if let Some(e) = events
            .iter()
            .find(|e| matches!(e, Event::Failed { op, .. } if *op == write))
        {
            break format!("{e:?}");
        }
        assert!(
            Instant::now() < deadline,
            "the write never failed: {events:?}"
        );
        t.wait(&mut events, Duration::from_millis(100)).unwrap();
    };
    assert!(failed.contains("PeerUnreachable"), "{failed}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    child.wait().unwrap();
}

/// A board for `shm` endpoints where cross-memory attach works; none on `tcp`.
fn shm_board_pair(config: &LibfabricConfig) -> Option<(LibfabricTransport, LibfabricTransport)> {
    let (a, mut b) = pair(config);
    if !super::shm_cma::cma_usable() {
        assert!(b.notice_board(4).is_none());
        eprintln!("skipped: cross-memory attach is not usable here, so shm offers no board");
        return None;
    }
    Some((a, b))
}

#[test]
fn shm_board_notices_land_in_the_peers_memory_after_the_data() {
    let mut tcp = LibfabricTransport::open(&LibfabricConfig::tcp(Some("lo"))).unwrap();
    assert!(tcp.notice_board(4).is_none(), "tcp data needs the target");
    // Two rails: the notice goes once both rails' data is in.
    for config in [shm_config(), two_rails(shm_config())] {
        let Some((mut a, mut b)) = shm_board_pair(&config) else {
            return;
        };
        let len = 1 << 20;
        let src = Arc::new(HostBuffer::new(len).unwrap());
        src.fill_with(|i| (i * 13 + 5) as u8);
        let dst = Arc::new(HostBuffer::new(len).unwrap());
        a.register(LocalRegion::host(0, Arc::clone(&src))).unwrap();
        b.register(LocalRegion::host(0, Arc::clone(&dst))).unwrap();
        crate::transport::check_notice_board(&mut a, &mut b, len as u64, &|| {
            dst.to_vec() == src.to_vec()
        });
    }
}

/// What `peer_rma_occasional_reads` says of `shm`: a fresh connection's first write to a peer
/// that never reads its queue waits; once the peer has read its queue, a later write lands, data
/// and board notice, with the peer silent again; and a write of more pieces than the peer's queue
/// has slots lands with the peer reading its queue only now and then.
#[test]
fn shm_board_writes_need_the_peer_only_for_first_contact_and_now_and_then() {
    let Some((mut a, mut b)) = shm_board_pair(&shm_config()) else {
        return;
    };
    assert!(b.capabilities().peer_rma_occasional_reads);
    let len = 1 << 16;
    let src = Arc::new(HostBuffer::new(len).unwrap());
    src.fill_with(|i| (i * 3 + 1) as u8);
    let dst = Arc::new(HostBuffer::new(len).unwrap());
    a.register(LocalRegion::host(0, Arc::clone(&src))).unwrap();
    b.register(LocalRegion::host(0, Arc::clone(&dst))).unwrap();
    let board = b.notice_board(4).unwrap();
    let peer = a.connect(&b.local_desc()).unwrap();
    let whole = [op(0, 0, 0, 0, len as u64)];
    let first = crate::board::board_notice(1, 5).unwrap();
    a.write(peer, &whole, Some(first)).unwrap();
    let mut ea = Vec::new();
    let quiet = Instant::now() + Duration::from_millis(300);
    while Instant::now() < quiet {
        a.wait(&mut ea, Duration::from_millis(5)).unwrap();
    }
    assert!(
        !board.arrived(first),
        "the first write landed without the peer: {ea:?}"
    );
    assert!(dst.to_vec().iter().all(|&x| x == 0));
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut eb = Vec::new();
    while !board.arrived(first) {
        assert!(Instant::now() < deadline, "a: {ea:?}");
        b.poll(&mut eb).unwrap();
        a.wait(&mut ea, Duration::from_millis(1)).unwrap();
    }
    assert_eq!(dst.to_vec(), src.to_vec());
    src.fill_with(|i| (i * 7 + 2) as u8);
    let second = crate::board::board_notice(2, 6).unwrap();
    a.write(peer, &whole, Some(second)).unwrap();
    while !board.arrived(second) {
        assert!(
            Instant::now() < deadline,
            "the second write needed the peer: {ea:?}"
        );
        a.wait(&mut ea, Duration::from_millis(1)).unwrap();
    }
    assert_eq!(dst.to_vec(), src.to_vec());
    // Small pieces, more than the peer's command queue has slots: the peer reading its queue
    // now and then (every 5 ms) is enough.
    src.fill_with(|i| (i * 5 + 3) as u8);
    let mut rows = op(0, 0, 0, 0, 32);
    rows.count = (len / 32) as u64;
    rows.src_stride = 32;
    rows.dst_stride = 32;
    let third = crate::board::board_notice(3, 7).unwrap();
    a.write(peer, &[rows], Some(third)).unwrap();
    let mut next_read = Instant::now();
    while !board.arrived(third) {
        assert!(Instant::now() < deadline, "a: {ea:?}");
        if Instant::now() >= next_read {
            b.poll(&mut eb).unwrap();
            next_read += Duration::from_millis(5);
        }
        a.wait(&mut ea, Duration::from_millis(1)).unwrap();
    }
    assert_eq!(dst.to_vec(), src.to_vec());
    assert!(eb.iter().all(|e| !matches!(e, Event::Notice(_))), "{eb:?}");
}

/// `shm` peers come and go (a decode instance restarts): after a peer was disconnected and its
/// process went, a new peer's first write still lands, with the new peer reading its queue.
#[test]
fn shm_a_new_peer_after_a_disconnected_one_is_reached() {
    let config = shm_config();
    let mut a = LibfabricTransport::open(&config).unwrap();
    let len = 1 << 16;
    let src = Arc::new(HostBuffer::new(len).unwrap());
    src.fill_with(|i| (i * 3 + 1) as u8);
    a.register(LocalRegion::host(0, Arc::clone(&src))).unwrap();
    for round in 0..3 {
        let mut b = LibfabricTransport::open(&config).unwrap();
        let dst = Arc::new(HostBuffer::new(len).unwrap());
        b.register(LocalRegion::host(0, Arc::clone(&dst))).unwrap();
        let peer = a.connect(&b.local_desc()).unwrap();
        let id = a.write(peer, &[op(0, 0, 0, 0, len as u64)], None).unwrap();
        let (mut ea, mut eb) = (Vec::new(), Vec::new());
        pump_until(&mut a, &mut b, &mut ea, &mut eb, |ea, _| !ea.is_empty());
        assert!(
            matches!(ea[..], [Event::WriteDone { op, .. }] if op == id),
            "round {round}: {ea:?}"
        );
        assert_eq!(dst.to_vec(), src.to_vec(), "round {round}");
        a.disconnect(peer);
        drop(b);
    }
}

/// One `shm` peer that takes no writes (never contacted, and not reading its queue) holds up no
/// other: a write to a second peer, posted after one to the silent peer, lands; the silent
/// peer's write lands once it reads.
#[test]
fn shm_a_peer_that_takes_no_writes_holds_up_no_other() {
    let config = shm_config();
    let (mut a, mut silent) = pair(&config);
    let mut other = LibfabricTransport::open(&config).unwrap();
    let len = 1 << 16;
    let src = Arc::new(HostBuffer::new(len).unwrap());
    src.fill_with(|i| (i * 11 + 7) as u8);
    a.register(LocalRegion::host(0, Arc::clone(&src))).unwrap();
    let (to_silent, to_other) = (
        Arc::new(HostBuffer::new(len).unwrap()),
        Arc::new(HostBuffer::new(len).unwrap()),
    );
    silent
        .register(LocalRegion::host(0, Arc::clone(&to_silent)))
        .unwrap();
    other
        .register(LocalRegion::host(0, Arc::clone(&to_other)))
        .unwrap();
    let silent_peer = a.connect(&silent.local_desc()).unwrap();
    let other_peer = a.connect(&other.local_desc()).unwrap();
    let whole = [op(0, 0, 0, 0, len as u64)];
    let first = a.write(silent_peer, &whole, None).unwrap();
    let second = a.write(other_peer, &whole, None).unwrap();
    let (mut ea, mut eo) = (Vec::new(), Vec::new());
    pump_until(&mut a, &mut other, &mut ea, &mut eo, |ea, _| {
        ea.iter()
            .any(|e| matches!(e, Event::WriteDone { op, .. } if *op == second))
    });
    assert_eq!(to_other.to_vec(), src.to_vec());
    assert!(
        !ea.iter()
            .any(|e| matches!(e, Event::WriteDone { op, .. } if *op == first)),
        "the silent peer's write landed without it: {ea:?}"
    );
    let mut es = Vec::new();
    pump_until(&mut a, &mut silent, &mut ea, &mut es, |ea, _| {
        ea.iter()
            .any(|e| matches!(e, Event::WriteDone { op, .. } if *op == first))
    });
    assert_eq!(to_silent.to_vec(), src.to_vec());
}

/// Device memory is asked for at open: a provider without `FI_HMEM` (Debian's 1.17 builds) is
/// refused then, naming itself; one with it takes CUDA regions.
#[test]
fn device_memory_needs_a_provider_with_hmem() {
    for provider in [PROVIDER_TCP, PROVIDER_SHM] {
        let config = LibfabricConfig {
            device_memory: true,
            domain: (provider == PROVIDER_TCP).then(|| "lo".to_owned()),
            ..LibfabricConfig::new(provider)
        };
        match LibfabricTransport::open(&config) {
            Err(e @ OpenError::NoDeviceMemory { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains(provider) && text.contains("FI_HMEM"),
                    "{text}"
                );
            }
            Err(other) => panic!("{provider}: {other}"),
            Ok(t) => assert!(t
                .capabilities()
                .memory_kinds
                .iter()
                .any(|k| matches!(k, kvx_core::MemoryKind::Cuda { .. }))),
        }
    }
}

/// The handler installed for `signal` now.
fn signal_handler(signal: libc::c_int) -> libc::sighandler_t {
    // SAFETY: all-zero bytes are a valid `sigaction`; with a null new action the call only reads
    // the current one into it.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(signal, std::ptr::null(), &mut action), 0);
        action.sa_sigaction
    }
}

/// Loading libfabric leaves the process's signal handlers as they were: where the system's
/// libfabric links `libinfinipath` (its PSM provider, as Debian's does), its constructor installs
/// handlers for SIGTERM, SIGABRT and more that call `exit` from the handler (a process that can
/// then hang on SIGTERM, when the signal lands inside `malloc`, and an engine that loses its own
/// shutdown), which the loader (`libfabric-sys`'s shim) puts back. Checked in a child process
/// (this test run again), where libfabric is not loaded yet.
#[test]
fn loading_libfabric_keeps_the_processs_signal_handlers() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "libfabric::tests::signal_handlers_child_role",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVX_SIGNAL_HANDLERS_CHILD", "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "the child ran the check: {text}");
}

#[test]
#[ignore = "the child of loading_libfabric_keeps_the_processs_signal_handlers"]
fn signal_handlers_child_role() {
    if std::env::var_os("KVX_SIGNAL_HANDLERS_CHILD").is_none() {
        return;
    }
    // What the process chose before: SIGTERM ignored, the others as they came.
    // SAFETY: installs the predefined "ignore" disposition, no handler code.
    unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
    let signals = [
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGABRT,
        libc::SIGILL,
        libc::SIGSEGV,
    ];
    let before = signals.map(signal_handler);
    load_library().expect("libfabric loads");
    assert_eq!(signals.map(signal_handler), before);
}
