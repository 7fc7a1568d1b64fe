//! Cross-process tests of the NIXL backend (UCX over TCP): the test binary re-executes itself as
//! the consumer (`child_role`, selected by `KVX_XPROC_ROLE`); the two processes exchange endpoint
//! descriptions over the child's stdout and stdin; the producer posts a multi-region plan made by
//! `kvx-layout` (different block sizes and chunk arrangements on the two sides, scattered
//! blocks); the consumer verifies every byte of its memory when the notice arrives, then reads a
//! range of the producer's memory back (pull) and reports over a NIXL control message. Failure
//! cases: a peer killed mid-transfer, bad descriptions, out-of-bounds operations, a missing
//! runtime: each a typed error, never a hang (every wait has a deadline and the child is killed
//! on drop).
//!
//! The runtime comes from `$KVX_NIXL_LIB_DIR` (the directory holding `libnixl_capi.so`; `cargo
//! xtask test` sets it). Without it the tests that need it say that they were skipped, and why.
#![cfg(feature = "nixl")]

use std::io::{BufRead, BufReader, Write as _};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{Arrangement, BlockId, Dtype, LayoutSpec, MemoryOrder, Rank};
use kvx_layout::{plan, synth, CopyOp, Layout, PlanRequest};
use kvx_rdma::nixl::{runtime, NixlConfig, NixlTransport, OpenError, RuntimeError, LIB_DIR_ENV};
use kvx_rdma::{
    ConnectError, EndpointDesc, Event, HostBuffer, LocalRegion, Notice, OpError, PlanError, Side,
    Transport, WriteError,
};

const ROLE_ENV: &str = "KVX_XPROC_ROLE";
const NOTICE: u64 = 0xfeed_0000_0000_0042;
const SEED: u64 = 0x6b76_7820_6e69_786c;
const DEADLINE: Duration = Duration::from_secs(60);
/// The request: 700 tokens (not a whole number of blocks on either side).
const TOKENS: u64 = 700;
/// Index of the consumer's extra region that receives the read-back.
const READ_REGION: u32 = 1000;
/// Bytes read back from the producer's region 1.
const READ_LEN: u64 = 200_000;
const READ_OFFSET: u64 = 12_345;

fn config() -> NixlConfig {
    let mut config = NixlConfig::ucx_tcp(Some("lo"));
    config.op_timeout = Duration::from_secs(5);
    config.library = lib_dir();
    config
}

/// Says plainly (on the real stderr, which the test harness does not capture) that a test was
/// skipped and why, when no NIXL runtime is configured.
fn runtime_or_skip(test: &str) -> bool {
    if runtime::locate(lib_dir().as_deref()).is_some() {
        return true;
    }
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED {test}: no NIXL runtime: {LIB_DIR_ENV} is unset or does not hold \
         libnixl_capi.so (`cargo xtask test` fetches the nixl-cu12 wheel and sets it)"
    );
    false
}

/// The producer: prefill with 16-token blocks, one region per layer holding all K then all V.
fn producer_layout() -> Layout {
    Layout::new(spec(16, 96, Arrangement::PerLayerKvHalves)).unwrap()
}

/// The consumer: decode with 32-token blocks, one region per layer and K/V.
fn consumer_layout() -> Layout {
    Layout::new(spec(32, 40, Arrangement::PerLayerSplit)).unwrap()
}

fn spec(block_tokens: u32, num_blocks: u32, arrangement: Arrangement) -> LayoutSpec {
    LayoutSpec {
        num_layers: 6,
        total_kv_heads: 2,
        head_dim: 64,
        dtype: Dtype::Bf16,
        mla: false,
        block_tokens,
        num_blocks,
        tp_size: 1,
        tp_rank: 0,
        order: MemoryOrder::Nhd,
        arrangement,
    }
}

/// Scattered block ids: enough blocks for the request, spread over the cache.
fn blocks(layout: &Layout, step: u32) -> Vec<BlockId> {
    let n = layout.spec().num_blocks;
    let needed = TOKENS.div_ceil(u64::from(layout.spec().block_tokens)) as u32;
    (0..needed).map(|i| BlockId((i * step + 3) % n)).collect()
}

fn producer_blocks() -> Vec<BlockId> {
    blocks(&producer_layout(), 7)
}

fn consumer_blocks() -> Vec<BlockId> {
    blocks(&consumer_layout(), 3)
}

fn the_plan() -> Vec<CopyOp> {
    let (producer, consumer) = (producer_layout(), consumer_layout());
    plan(&PlanRequest {
        producers: std::slice::from_ref(&producer),
        consumer: &consumer,
        num_tokens: TOKENS,
        skip_tokens: 0,
        producer_blocks: &producer_blocks(),
        consumer_blocks: &consumer_blocks(),
        only_producer: None,
        producer_groups: &[],
        consumer_groups: &[],
    })
    .unwrap()
    .into_ops()
}

/// The bytes `layout`'s regions hold when the request's tokens carry the pattern and everything
/// else is zero.
fn expected_regions(layout: &Layout, blocks: &[BlockId]) -> Vec<Vec<u8>> {
    let mut regions: Vec<Vec<u8>> = (0..layout.region_count())
        .map(|_| vec![0; layout.region_len() as usize])
        .collect();
    let mut views: Vec<&mut [u8]> = regions.iter_mut().map(Vec::as_mut_slice).collect();
    synth::fill_request(layout, &mut views, blocks, TOKENS, SEED);
    regions
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}

fn wait_for<T>(
    transport: &mut NixlTransport,
    what: &str,
    mut pick: impl FnMut(&Event) -> Option<T>,
) -> T {
    let deadline = Instant::now() + DEADLINE;
    let mut events = Vec::new();
    loop {
        assert!(Instant::now() < deadline, "no {what} before the deadline");
        events.clear();
        transport
            .wait(&mut events, Duration::from_millis(100))
            .unwrap();
        if let Some(found) = events.iter().find_map(&mut pick) {
            return found;
        }
    }
}

/// The consumer child: registers its regions, prints its description, and then (role `verify`)
/// reads the producer's description from stdin, waits for the notice, checks every byte, reads
/// a range of the producer's memory back and reports over a control message; or (role `sink`)
/// waits until it is killed; or (role `missing-runtime`) reports what opening an endpoint
/// without a runtime does.
#[test]
#[ignore = "child role of the cross-process tests; started by them"]
fn child_role() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    if role == "missing-runtime" {
        let config = NixlConfig {
            library: lib_dir(),
            ..NixlConfig::ucx_tcp(Some("lo"))
        };
        match NixlTransport::open(&config) {
            Err(OpenError::Runtime(RuntimeError::Load { library, reason })) => {
                println!("KVX:RUNTIME-ERROR {library}: {reason}");
            }
            Err(other) => println!("KVX:FAIL unexpected error {other:?}"),
            Ok(_) => println!("KVX:FAIL opened without a runtime"),
        }
        return;
    }
    let mut transport = NixlTransport::open(&config()).expect("child: open");
    let layout = consumer_layout();
    let buffers: Vec<Arc<HostBuffer>> = (0..layout.region_count())
        .map(|index| {
            let buffer = Arc::new(HostBuffer::new(layout.region_len() as usize).unwrap());
            transport
                .register(LocalRegion::host(index, Arc::clone(&buffer)))
                .unwrap();
            buffer
        })
        .collect();
    let read_back = Arc::new(HostBuffer::new(READ_LEN as usize).unwrap());
    transport
        .register(LocalRegion::host(READ_REGION, Arc::clone(&read_back)))
        .unwrap();
    println!("KVX:DESC {}", hex(&transport.local_desc().to_bytes()));
    let deadline = Instant::now() + DEADLINE;
    let mut events = Vec::new();
    if role == "sink" {
        while Instant::now() < deadline {
            events.clear();
            transport
                .wait(&mut events, Duration::from_millis(100))
                .expect("child: wait");
        }
        return;
    }

    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .expect("child: producer description");
    let desc = EndpointDesc::from_bytes(&unhex(line.trim())).expect("child: description decodes");
    let peer = transport.connect(&desc).expect("child: connect");
    let notice = wait_for(&mut transport, "notice", |e| match e {
        Event::Notice(n) => Some(*n),
        _ => None,
    });
    assert_eq!(notice, Notice(NOTICE));
    let expected = expected_regions(&layout, &consumer_blocks());
    for (i, (buffer, want)) in buffers.iter().zip(&expected).enumerate() {
        let got = buffer.to_vec();
        if let Some(at) = got.iter().zip(want).position(|(g, w)| g != w) {
            println!("KVX:FAIL region {i} differs at byte {at}");
            std::process::exit(1);
        }
    }
    let verified: usize = expected.iter().map(Vec::len).sum();

    // Pull: read a range of the producer's region 1 (whose bytes the child knows too).
    let read = CopyOp {
        producer: Rank(0),
        src_region: 1,
        src_offset: READ_OFFSET,
        dst_region: READ_REGION,
        dst_offset: 0,
        len: READ_LEN,
        count: 1,
        src_stride: 0,
        dst_stride: 0,
    };
    let id = transport.read(peer, &[read]).expect("child: read");
    wait_for(&mut transport, "read completion", |e| match e {
        Event::ReadDone { op, .. } if *op == id => Some(()),
        Event::Failed { error, .. } => panic!("child: read failed: {error:?}"),
        _ => None,
    });
    let source = &expected_regions(&producer_layout(), &producer_blocks())[1];
    let (from, to) = (READ_OFFSET as usize, (READ_OFFSET + READ_LEN) as usize);
    if read_back.to_vec() != source[from..to] {
        println!("KVX:FAIL the read-back differs");
        std::process::exit(1);
    }
    transport
        .send(peer, format!("verified {verified}").as_bytes())
        .expect("child: send");
    wait_for(&mut transport, "send completion", |e| match e {
        Event::SendDone { .. } => Some(()),
        _ => None,
    });
    println!("KVX:OK {verified}");
    // Keep driving the endpoint until the producer has seen the message (it closes stdin then).
    let (closed_tx, closed) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_line(&mut String::new());
        let _ = closed_tx.send(());
    });
    while closed.try_recv().is_err() && Instant::now() < deadline {
        events.clear();
        transport
            .wait(&mut events, Duration::from_millis(20))
            .expect("child: wait");
    }
}

/// A child process that is killed when dropped, with its `KVX:` lines on a channel.
struct ChildProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl ChildProcess {
    fn spawn(role: &str, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args([
                "--ignored",
                "--exact",
                "child_role",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE_ENV, role)
            // UCX over TCP; keep UCX from loading its InfiniBand modules (whose bundled libnl
            // can crash at exit on a machine without RDMA devices).
            .env("UCX_TLS", "tcp")
            .env("UCX_MODULES", "^ib,mlx5,efa")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("spawn child");
        let stdout = child.stdout.take().unwrap();
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest may print "test child_role ... " on the same line first.
                if let Some(at) = line.find("KVX:") {
                    if tx.send(line[at + 4..].to_owned()).is_err() {
                        break;
                    }
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
        }
    }

    fn line(&self) -> String {
        self.lines
            .recv_timeout(DEADLINE)
            .expect("child line before the deadline")
    }

    fn desc(&self) -> EndpointDesc {
        let line = self.line();
        let hex_desc = line.strip_prefix("DESC ").expect("DESC line");
        EndpointDesc::from_bytes(&unhex(hex_desc)).expect("child description decodes")
    }

    fn tell(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("child stdin");
        writeln!(stdin, "{line}").expect("write to the child");
        stdin.flush().expect("flush to the child");
    }

    fn wait_exit(&mut self) -> bool {
        self.stdin = None;
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.success();
            }
            assert!(Instant::now() < deadline, "child did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn producer() -> (NixlTransport, Vec<Arc<HostBuffer>>) {
    let mut transport = NixlTransport::open(&config()).expect("producer: open");
    let layout = producer_layout();
    let buffers = expected_regions(&layout, &producer_blocks())
        .into_iter()
        .enumerate()
        .map(|(index, bytes)| {
            let buffer = Arc::new(HostBuffer::new(bytes.len()).unwrap());
            buffer.write_at(0, &bytes).unwrap();
            transport
                .register(LocalRegion::host(index as u32, Arc::clone(&buffer)))
                .unwrap();
            buffer
        })
        .collect();
    (transport, buffers)
}

/// The CPUs this process may run on (the transport must never change it).
fn affinity() -> String {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("Cpus_allowed_list"))
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn tcp_plan_crosses_processes_and_is_verified() {
    if !runtime_or_skip("tcp_plan_crosses_processes_and_is_verified") {
        return;
    }
    let cpus = affinity();
    let mut child = ChildProcess::spawn("verify", &[]);
    let (mut transport, _buffers) = producer();
    let desc = child.desc();
    assert_eq!(desc.backend, "nixl");
    let peer = transport.connect(&desc).unwrap();
    child.tell(&hex(&transport.local_desc().to_bytes()));

    let plan = the_plan();
    let regions: std::collections::BTreeSet<u32> = plan.iter().map(|op| op.dst_region).collect();
    assert!(regions.len() > 2, "the plan spans several regions");
    assert!(
        plan.iter().any(|op| op.count > 1),
        "the plan has strided operations"
    );

    // An out-of-bounds operation is refused before anything moves (the consumer checks that
    // nothing outside the plan was written).
    let mut bad = plan.clone();
    let region_len = consumer_layout().region_len();
    bad.push(CopyOp {
        producer: Rank(0),
        src_region: 0,
        src_offset: 0,
        dst_region: 1,
        dst_offset: region_len - 100,
        len: 101,
        count: 1,
        src_stride: 0,
        dst_stride: 0,
    });
    match transport.write(peer, &bad, Some(Notice(NOTICE))) {
        Err(WriteError::Plan(PlanError::OutOfBounds {
            side: Side::Dst,
            region: 1,
            ..
        })) => {}
        other => panic!("expected an out-of-bounds error, got {other:?}"),
    }

    let total: u64 = plan.iter().map(CopyOp::bytes).sum();
    let id = transport.write(peer, &plan, Some(Notice(NOTICE))).unwrap();
    let bytes = wait_for(&mut transport, "write completion", |e| match e {
        Event::WriteDone { op, bytes, .. } if *op == id => Some(*bytes),
        Event::Failed { error, .. } => panic!("write failed: {error:?}"),
        _ => None,
    });
    assert_eq!(bytes, total);
    // The consumer's verdict (a failure ends the test at once) and its control message.
    let deadline = Instant::now() + DEADLINE;
    let (mut verdict, mut message) = (None, None);
    let mut events = Vec::new();
    while verdict.is_none() || message.is_none() {
        assert!(
            Instant::now() < deadline,
            "no verdict and message before the deadline"
        );
        if let Ok(line) = child.lines.try_recv() {
            assert!(line.starts_with("OK "), "consumer: {line}");
            verdict = Some(line);
        }
        events.clear();
        transport
            .wait(&mut events, Duration::from_millis(20))
            .unwrap();
        for event in &events {
            if let Event::Message(m) = event {
                message = Some(String::from_utf8_lossy(m).into_owned());
            }
        }
    }
    let (verdict, message) = (verdict.unwrap_or_default(), message.unwrap_or_default());
    assert_eq!(message, format!("verified {}", &verdict[3..]));
    assert!(child.wait_exit(), "consumer exited with failure");
    assert_eq!(affinity(), cpus, "the transport changed the CPU affinity");
}

#[test]
fn peer_killed_mid_transfer_is_a_typed_error() {
    if !runtime_or_skip("peer_killed_mid_transfer_is_a_typed_error") {
        return;
    }
    let mut child = ChildProcess::spawn("sink", &[]);
    let (mut transport, _buffers) = producer();
    let peer = transport.connect(&child.desc()).unwrap();
    let plan = the_plan();
    let deadline = Instant::now() + DEADLINE;
    let mut killed = false;
    let mut events = Vec::new();
    loop {
        assert!(
            Instant::now() < deadline,
            "no failure reported before the deadline"
        );
        match transport.write(peer, &plan, Some(Notice(1))) {
            Ok(_) => {}
            Err(WriteError::Backend(error)) => {
                // NIXL refused to create the request: the peer is gone.
                assert!(killed, "write refused before the peer was killed: {error}");
                return;
            }
            Err(other) => panic!("unexpected write error: {other:?}"),
        }
        events.clear();
        transport
            .wait(&mut events, Duration::from_millis(100))
            .unwrap();
        if !killed && events.iter().any(|e| matches!(e, Event::WriteDone { .. })) {
            child.child.kill().unwrap();
            child.child.wait().unwrap();
            killed = true;
        }
        if let Some(error) = events.iter().find_map(|e| match e {
            Event::Failed { error, .. } => Some(error),
            _ => None,
        }) {
            assert!(killed, "failure before the peer was killed: {error:?}");
            assert!(
                matches!(
                    error,
                    OpError::PeerUnreachable { .. } | OpError::TimedOut(_)
                ),
                "unexpected error kind: {error:?}"
            );
            return;
        }
    }
}

#[test]
fn bad_descriptions_are_typed_errors() {
    if !runtime_or_skip("bad_descriptions_are_typed_errors") {
        return;
    }
    let child = ChildProcess::spawn("sink", &[]);
    let line = child.line();
    let bytes = unhex(line.strip_prefix("DESC ").unwrap());
    let desc = EndpointDesc::from_bytes(&bytes).unwrap();
    let mut transport = NixlTransport::open(&config()).unwrap();

    // Corrupted bytes never decode into a description.
    for cut in [0, 5, bytes.len() / 2, bytes.len() - 1] {
        assert!(EndpointDesc::from_bytes(&bytes[..cut]).is_err());
    }
    // Another backend's or plugin's description.
    let mut other = desc.clone();
    other.provider = "LIBFABRIC".into();
    assert!(matches!(
        transport.connect(&other),
        Err(ConnectError::Mismatch { .. })
    ));
    other.backend = "libfabric".into();
    assert!(matches!(
        transport.connect(&other),
        Err(ConnectError::Mismatch { .. })
    ));
    // An inconsistent region table.
    let mut dup = desc.clone();
    dup.regions[1].index = dup.regions[0].index;
    assert!(matches!(
        transport.connect(&dup),
        Err(ConnectError::BadDescription(_))
    ));
    // Addresses that are not a NIXL agent's: foreign bytes, a metadata blob cut short, a
    // flipped byte in the metadata.
    for address in [
        b"not an address".to_vec(),
        desc.address[..desc.address.len() * 2 / 3].to_vec(),
        {
            let mut a = desc.address.clone();
            let last = a.len() - 1;
            a[last] ^= 0x55;
            a
        },
    ] {
        let mut broken = desc.clone();
        broken.address = address;
        assert!(matches!(
            transport.connect(&broken),
            Err(ConnectError::BadAddress { .. })
        ));
    }

    // A well-formed description of a peer that is gone: connecting or writing fails, typed, no
    // hang.
    drop(child);
    transport
        .register(LocalRegion::host(
            0,
            Arc::new(HostBuffer::new(4096).unwrap()),
        ))
        .unwrap();
    let peer = match transport.connect(&desc) {
        Ok(peer) => peer,
        Err(ConnectError::BadAddress { .. } | ConnectError::Unreachable { .. }) => return,
        Err(other) => panic!("unexpected connect error: {other:?}"),
    };
    let op = CopyOp {
        producer: Rank(0),
        src_region: 0,
        src_offset: 0,
        dst_region: 0,
        dst_offset: 0,
        len: 4096,
        count: 1,
        src_stride: 0,
        dst_stride: 0,
    };
    match transport.write(peer, &[op], Some(Notice(1))) {
        Ok(_) => {}
        Err(WriteError::Backend(_)) => return,
        Err(other) => panic!("unexpected write error: {other:?}"),
    }
    let error = wait_for(&mut transport, "failure", |e| match e {
        Event::Failed { error, .. } => Some(format!("{error:?}")),
        Event::WriteDone { .. } => panic!("a write to a dead peer succeeded"),
        _ => None,
    });
    assert!(
        error.starts_with("PeerUnreachable") || error.starts_with("TimedOut"),
        "{error}"
    );
}

/// Needs no runtime: a child whose runtime path leads nowhere gets a typed error, not an abort.
#[test]
fn missing_runtime_is_a_typed_error() {
    let nowhere = tempfile::tempdir().unwrap();
    let path = nowhere.path().join("no-such-dir");
    let child = ChildProcess::spawn(
        "missing-runtime",
        &[
            (LIB_DIR_ENV, path.to_str().unwrap()),
            ("LD_LIBRARY_PATH", ""),
        ],
    );
    let line = child.line();
    assert!(line.starts_with("RUNTIME-ERROR "), "child: {line}");
    assert!(line.contains("no-such-dir"), "child: {line}");
}

/// The NIXL runtime's directory, from [`LIB_DIR_ENV`] (which `cargo xtask test` sets): tests read
/// the environment, the crate does not.
fn lib_dir() -> Option<std::path::PathBuf> {
    std::env::var_os(LIB_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
}
