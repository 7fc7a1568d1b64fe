//! Cross-process tests of the CMA backend: the test binary re-executes itself as the peer
//! (`KVX_CMA_ROLE`), descriptions travel over the child's stdout, and every byte is checked —
//! a strided multi-region plan written with a notice (verified by the consumer when the notice
//! arrives), a pull-mode read, and a peer that exited (a typed error, never a hang).
#![cfg(feature = "cma")]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::Rank;
use kvx_layout::CopyOp;
use kvx_rdma::cma::{CmaConfig, CmaTransport};
use kvx_rdma::{EndpointDesc, Event, HostBuffer, LocalRegion, Notice, OpError, Transport};

const ROLE: &str = "KVX_CMA_ROLE";
const NOTICE: u64 = 0xc0ff_ee00_0000_0001;
const DEADLINE: Duration = Duration::from_secs(60);
/// Consumer regions (index, length).
const CONSUMER: [(u32, usize); 2] = [(0, 8 << 20), (1, 3 << 20)];
/// Producer regions (index, length).
const PRODUCER: [(u32, usize); 2] = [(0, 12 << 20), (1, 1 << 20)];

fn pattern(region: u32, offset: u64) -> u8 {
    let x = offset.wrapping_mul(0x9e37_79b9) ^ (u64::from(region) << 29) ^ (offset >> 11);
    (x ^ (x >> 7) ^ (x >> 17)) as u8
}

fn op(src: (u32, u64), dst: (u32, u64), len: u64, count: u64, strides: (u64, u64)) -> CopyOp {
    CopyOp::strided(Rank(0), src, dst, len, count, strides)
}

/// A plan in the planner's shapes: a long merged run, many strided head-sized pieces (more than
/// one system call's worth), odd sizes, a run ending at a region's last byte.
fn plan() -> Vec<CopyOp> {
    vec![
        op((0, 0), (0, 1 << 20), 6 << 20, 1, (0, 0)),
        op((0, 7 << 20), (1, 0), 256, 2500, (1024, 512)),
        op((1, 3), (0, 17), 999, 7, (1111, 2222)),
        op(
            (1, (1 << 20) - 4096),
            (1, (3 << 20) - 4096),
            4096,
            1,
            (0, 0),
        ),
    ]
}

fn expected() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = CONSUMER.iter().map(|&(_, len)| vec![0; len]).collect();
    for op in plan() {
        for (s, d, len) in op.pieces() {
            for i in 0..len {
                out[op.dst_region as usize][(d + i) as usize] = pattern(op.src_region, s + i);
            }
        }
    }
    out
}

fn wait_for(t: &mut CmaTransport, want: impl Fn(&Event) -> bool) -> Event {
    let deadline = Instant::now() + DEADLINE;
    let mut events = Vec::new();
    loop {
        events.clear();
        t.wait(&mut events, Duration::from_millis(200))
            .expect("wait");
        if let Some(i) = events.iter().position(&want) {
            return events.swap_remove(i);
        }
        assert!(Instant::now() < deadline, "no matching event in time");
    }
}

/// The child: `verify` waits for the notice and checks its memory, `serve` offers a filled
/// region until killed, `exit` prints its description and exits.
#[test]
#[ignore = "child role of the cross-process tests; started by them"]
fn child_role() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let mut t = CmaTransport::open(CmaConfig::default()).expect("open");
    let regions: Vec<Arc<HostBuffer>> = CONSUMER
        .iter()
        .map(|&(_, len)| Arc::new(HostBuffer::new(len).expect("buffer")))
        .collect();
    for (&(index, _), buffer) in CONSUMER.iter().zip(&regions) {
        if role == "serve" {
            buffer.fill_with(|i| pattern(index, i as u64));
        }
        t.register(LocalRegion::host(index, Arc::clone(buffer)))
            .expect("register");
    }
    println!("KVX:DESC {}", t.local_desc().to_hex());
    match role.as_str() {
        "verify" => {
            let event = wait_for(&mut t, |e| matches!(e, Event::Notice(_)));
            assert!(matches!(event, Event::Notice(Notice(NOTICE))), "{event:?}");
            let ok = regions
                .iter()
                .zip(expected())
                .all(|(buffer, want)| buffer.to_vec() == want);
            println!("KVX:{}", if ok { "VERIFIED" } else { "MISMATCH" });
        }
        "serve" => std::thread::sleep(DEADLINE),
        _ => {}
    }
}

struct Kid {
    child: Child,
    lines: Receiver<String>,
}

impl Kid {
    fn spawn(role: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "child_role", "--ignored", "--nocapture"])
            .env(ROLE, role)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(at) = line.find("KVX:") {
                    let _ = tx.send(line[at + 4..].to_owned());
                }
            }
        });
        Self { child, lines }
    }

    fn line(&self) -> String {
        self.lines.recv_timeout(DEADLINE).expect("child line")
    }

    fn desc(&self) -> EndpointDesc {
        let line = self.line();
        let hex = line.strip_prefix("DESC ").expect("DESC line");
        EndpointDesc::from_hex(hex).expect("description")
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn producer() -> (CmaTransport, Vec<Arc<HostBuffer>>) {
    let mut t = CmaTransport::open(CmaConfig::default()).expect("open");
    let buffers: Vec<Arc<HostBuffer>> = PRODUCER
        .iter()
        .map(|&(index, len)| {
            let b = Arc::new(HostBuffer::new(len).expect("buffer"));
            b.fill_with(|i| pattern(index, i as u64));
            t.register(LocalRegion::host(index, Arc::clone(&b)))
                .expect("register");
            b
        })
        .collect();
    (t, buffers)
}

#[test]
fn plan_crosses_processes_and_is_verified_at_the_notice() {
    let kid = Kid::spawn("verify");
    let (mut t, _buffers) = producer();
    let peer = t.connect(&kid.desc()).expect("connect");
    t.write(peer, &plan(), Some(Notice(NOTICE))).expect("write");
    let done = wait_for(&mut t, |e| {
        matches!(e, Event::WriteDone { .. } | Event::Failed { .. })
    });
    assert!(matches!(done, Event::WriteDone { .. }), "{done:?}");
    assert_eq!(kid.line(), "VERIFIED");
}

#[test]
fn pull_reads_another_process() {
    let kid = Kid::spawn("serve");
    let mut t = CmaTransport::open(CmaConfig::default()).expect("open");
    let sink = Arc::new(HostBuffer::new(2 << 20).expect("buffer"));
    t.register(LocalRegion::host(0, Arc::clone(&sink)))
        .expect("register");
    let peer = t.connect(&kid.desc()).expect("connect");
    let reads = [
        op((0, 4096), (0, 0), 1 << 20, 1, (0, 0)),
        op((1, 10), (0, 1 << 20), 300, 100, (700, 300)),
    ];
    t.read(peer, &reads).expect("read");
    let done = wait_for(&mut t, |e| {
        matches!(e, Event::ReadDone { .. } | Event::Failed { .. })
    });
    assert!(matches!(done, Event::ReadDone { .. }), "{done:?}");
    let got = sink.to_vec();
    for op in reads {
        for (s, d, len) in op.pieces() {
            for i in 0..len {
                assert_eq!(got[(d + i) as usize], pattern(op.src_region, s + i));
            }
        }
    }
}

#[test]
fn a_peer_that_exited_is_a_typed_error() {
    let mut kid = Kid::spawn("exit");
    let desc = kid.desc();
    let _ = kid.child.wait();
    let (mut t, _buffers) = producer();
    // Its socket is gone: connecting fails, or the first write does.
    let Ok(peer) = t.connect(&desc) else { return };
    t.write(peer, &plan(), Some(Notice(NOTICE)))
        .expect("accepted");
    let event = wait_for(&mut t, |e| {
        matches!(e, Event::WriteDone { .. } | Event::Failed { .. })
    });
    assert!(
        matches!(
            event,
            Event::Failed {
                error: OpError::PeerUnreachable { .. },
                ..
            }
        ),
        "{event:?}"
    );
}
