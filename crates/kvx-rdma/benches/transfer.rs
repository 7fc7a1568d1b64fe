//! Transfer throughput of each backend beside a single-thread memcpy of the same bytes.
//!
//! `cargo bench -p kvx-rdma --bench transfer [-- --quick] [--backend NAME] [--case NAME]` (what
//! `cargo xtask bench transfer` runs; `--features nixl` adds the NIXL backend, `nixl-ucx-tcp`,
//! which needs `KVX_NIXL_LIB_DIR`). The `-2rail` libfabric backends run the same plans over
//! two-rail endpoints, in the same run as the single-rail ones. For op sizes from 4 KiB to 64 MiB it moves 64 MiB per
//! iteration as a list of equal operations, and it moves two 16k-token request plans (runs of 8
//! blocks, and every block scattered: 131,072 operations); each time from
//! `write` to the consumer seeing the notice, with the consumer endpoint on its own thread; both
//! sides block in `wait` (as the connector's threads do), so wake-up latency counts. The
//! memcpy baseline copies the same bytes in the same pieces on one thread, in the same run. The
//! time spent inside `write` (building and posting the operations) is reported apart.
//! Results go to `target/kvx-bench/transfer.json` and `transfer.md` (or `$KVX_BENCH_OUT`).
//!
//! A benchmark reports; it asserts nothing about time.
#![allow(missing_docs)]

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use kvx_core::Rank;
use kvx_layout::CopyOp;
use kvx_rdma::loopback::LoopbackFabric;
use kvx_rdma::{Event, HostBuffer, LocalRegion, Notice, Transport};

#[path = "transfer/across.rs"]
mod across;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
/// Bytes moved per iteration of the size sweep.
const SWEEP_BYTES: u64 = 64 * MIB;

/// The 16k-token request: 16 layers (one region per layer holding K and V), 2 KV heads of 128
/// dims in bf16 on this rank, 16-token blocks: 8 KiB per block per K/V, 1024 blocks. The producer's
/// blocks are contiguous (freshly prefilled); the consumer's come in runs of 8 at scattered places,
/// so the plan is 16 x 2 x 128 operations of 64 KiB (256 MiB).
const PLAN_LAYERS: u32 = 16;
const PLAN_BLOCKS: u64 = 1024;
const PLAN_CHUNK: u64 = 8 * KIB;
const PLAN_RUN: u64 = 8;

/// The same length as one rank of Qwen3-32B at TP8 (64 layers, one KV head of 128 in bf16, 16-token
/// blocks: 4 KiB per block per K/V), into a consumer whose blocks are all scattered: 64 x 2 x 1024
/// operations of 4 KiB (512 MiB), the most operations a 16k-token request can take.
const SCATTERED_LAYERS: u32 = 64;
const SCATTERED_CHUNK: u64 = 4 * KIB;

struct Row {
    backend: String,
    case: String,
    op_bytes: u64,
    ops: usize,
    bytes: u64,
    seconds: f64,
    /// Of `seconds`, the time spent in the producer's `write` call (building and posting).
    post_seconds: f64,
    memcpy_seconds: f64,
}

impl Row {
    fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds / 1e9
    }
    fn memcpy_gbps(&self) -> f64 {
        self.bytes as f64 / self.memcpy_seconds / 1e9
    }
    fn per_op_us(&self) -> f64 {
        self.seconds * 1e6 / self.ops as f64
    }
}

fn op(src: (u32, u64), dst: (u32, u64), len: u64) -> CopyOp {
    CopyOp::run(Rank(0), src, dst, len)
}

fn sweep_plan(op_bytes: u64) -> Vec<CopyOp> {
    (0..SWEEP_BYTES / op_bytes)
        .map(|i| op((0, i * op_bytes), (0, i * op_bytes), op_bytes))
        .collect()
}

/// A 16k-token request: `layers` regions each holding K and V of 1,024 blocks of `chunk` bytes;
/// the producer's blocks contiguous, the consumer's in runs of `run` blocks at scattered places.
fn request_plan(layers: u32, chunk: u64, run: u64) -> Vec<CopyOp> {
    let runs = PLAN_BLOCKS / run;
    // A fixed scatter of the consumer's runs (a multiplicative permutation of 0..runs).
    let place = |r: u64| (r * 37 + 11) % runs;
    let mut ops = Vec::new();
    for layer in 0..layers {
        for kv in 0..2 {
            let base = kv * PLAN_BLOCKS * chunk;
            for r in 0..runs {
                ops.push(op(
                    (layer, base + r * run * chunk),
                    (layer, base + place(r) * run * chunk),
                    run * chunk,
                ));
            }
        }
    }
    ops
}

/// One producer/consumer pair with `regions` regions of `region_len` bytes on each side.
struct Pair {
    producer: Box<dyn Transport>,
    consumer_thread: Option<thread::JoinHandle<()>>,
    notices: mpsc::Receiver<Instant>,
    stop: Arc<AtomicBool>,
    peer: kvx_rdma::PeerId,
    _buffers: Vec<Arc<HostBuffer>>,
}

impl Pair {
    fn new(
        mut producer: Box<dyn Transport>,
        mut consumer: Box<dyn Transport>,
        regions: u32,
        region_len: usize,
    ) -> Self {
        let mut buffers = Vec::new();
        for index in 0..regions {
            for side in [&mut producer, &mut consumer] {
                let buffer = Arc::new(HostBuffer::new(region_len).expect("bench buffer"));
                buffer.fill_with(|i| i as u8);
                side.register(LocalRegion::host(index, Arc::clone(&buffer)))
                    .expect("register");
                buffers.push(buffer);
            }
        }
        let peer = producer.connect(&consumer.local_desc()).expect("connect");
        let (tx, notices) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stop_consumer = Arc::clone(&stop);
        let consumer_thread = thread::spawn(move || {
            let mut events = Vec::new();
            while !stop_consumer.load(Ordering::Relaxed) {
                events.clear();
                if consumer
                    .wait(&mut events, Duration::from_millis(20))
                    .is_err()
                {
                    return;
                }
                for event in &events {
                    if let Event::Notice(_) = event {
                        let _ = tx.send(Instant::now());
                    }
                }
            }
        });
        Self {
            producer,
            consumer_thread: Some(consumer_thread),
            notices,
            stop,
            peer,
            _buffers: buffers,
        }
    }

    /// Seconds from `write` until the consumer saw the notice (and the producer its completion),
    /// and of those the seconds `write` itself took.
    fn transfer(&mut self, plan: &[CopyOp]) -> Option<(f64, f64)> {
        let start = Instant::now();
        self.producer
            .write(self.peer, plan, Some(Notice(1)))
            .expect("write");
        let posted = start.elapsed().as_secs_f64();
        let mut events = Vec::new();
        let mut done = false;
        let mut seen = None;
        let deadline = start + Duration::from_secs(120);
        while !(done && seen.is_some()) {
            if Instant::now() > deadline {
                eprintln!("transfer did not finish in time");
                return None;
            }
            events.clear();
            self.producer
                .wait(
                    &mut events,
                    Duration::from_millis(if done { 1 } else { 20 }),
                )
                .expect("wait");
            for event in &events {
                match event {
                    Event::WriteDone { .. } => done = true,
                    Event::Failed { error, .. } => {
                        eprintln!("transfer failed: {error}");
                        return None;
                    }
                    _ => {}
                }
            }
            if seen.is_none() {
                seen = self.notices.try_recv().ok();
            }
        }
        seen.map(|at| (at.duration_since(start).as_secs_f64(), posted))
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.consumer_thread.take() {
            let _ = handle.join();
        }
    }
}

/// Best of `reps` single-thread memcpys of the plan's pieces between two plain buffers.
/// A single-thread `memcpy` of a plan's bytes between buffers of the same shape: the baseline,
/// timed in turn with the transfer (one copy after each transfer), so that both see the same
/// machine (this one is shared and its speed drifts).
/// The buffers are [`HostBuffer`]s like the transports' (same alignment, same huge-page advice).
struct Memcpy {
    src: Vec<HostBuffer>,
    dst: Vec<HostBuffer>,
}

impl Memcpy {
    fn new(regions: usize, region_len: usize) -> Self {
        let buffer = |byte: u8| {
            let b = HostBuffer::new(region_len).expect("memcpy buffer");
            b.fill_with(|_| byte);
            b
        };
        Self {
            src: (0..regions).map(|_| buffer(1)).collect(),
            dst: (0..regions).map(|_| buffer(0)).collect(),
        }
    }

    fn seconds(&mut self, plan: &[CopyOp]) -> f64 {
        let start = Instant::now();
        for op in plan {
            for (s, d, len) in op.pieces() {
                let (s, d, len) = (s as usize, d as usize, len as usize);
                let from = self.src[op.src_region as usize].as_ptr();
                let to = self.dst[op.dst_region as usize].as_ptr();
                // SAFETY: both ranges lie inside their buffers (the plan is built for buffers
                // of this length) and the two buffers are distinct allocations.
                unsafe { std::ptr::copy_nonoverlapping(from.add(s), to.add(d), len) };
            }
        }
        let took = start.elapsed().as_secs_f64();
        std::hint::black_box(&mut self.dst);
        took
    }
}

/// Best of `reps` transfers (with the post time of that transfer) and best of `reps` copies,
/// taken in turn after a warm-up of each.
fn best_of(
    pair: &mut Pair,
    copier: &mut Memcpy,
    plan: &[CopyOp],
    reps: usize,
) -> ((f64, f64), f64) {
    let _ = pair.transfer(plan);
    let _ = copier.seconds(plan);
    let (mut transfer, mut copy) = ((f64::INFINITY, 0.0), f64::INFINITY);
    for _ in 0..reps {
        if let Some(t) = pair.transfer(plan) {
            if t.0 < transfer.0 {
                transfer = t;
            }
        }
        copy = copy.min(copier.seconds(plan));
    }
    (transfer, copy)
}

type Factory = Box<dyn Fn() -> Option<(Box<dyn Transport>, Box<dyn Transport>)>>;

fn backends() -> Vec<(&'static str, Factory)> {
    #[cfg_attr(
        not(any(feature = "libfabric", feature = "nixl", feature = "cma")),
        allow(unused_mut)
    )]
    let mut out: Vec<(&'static str, Factory)> = vec![(
        "loopback",
        Box::new(|| {
            let fabric = LoopbackFabric::new();
            Some((
                Box::new(fabric.endpoint()) as Box<dyn Transport>,
                Box::new(fabric.endpoint()) as Box<dyn Transport>,
            ))
        }),
    )];
    #[cfg(feature = "cma")]
    {
        use kvx_rdma::cma::{CmaConfig, CmaTransport};
        out.push((
            "cma",
            Box::new(|| {
                let open = || {
                    CmaTransport::open(CmaConfig::default())
                        .map_err(|e| eprintln!("cma: {e}"))
                        .ok()
                };
                let (a, b) = (open()?, open()?);
                Some((
                    Box::new(a) as Box<dyn Transport>,
                    Box::new(b) as Box<dyn Transport>,
                ))
            }),
        ));
    }
    #[cfg(feature = "libfabric")]
    {
        use kvx_rdma::libfabric::{LibfabricConfig, LibfabricTransport, Rails};
        fn open(mut config: LibfabricConfig) -> Option<(Box<dyn Transport>, Box<dyn Transport>)> {
            config.sweep_stale_shm =
                std::env::var_os(kvx_rdma::libfabric::SHM_SWEEP_ENV).is_some_and(|v| v == "1");
            let a = LibfabricTransport::open(&config)
                .map_err(|e| eprintln!("{e}"))
                .ok()?;
            let b = LibfabricTransport::open(&config)
                .map_err(|e| eprintln!("{e}"))
                .ok()?;
            Some((Box::new(a), Box::new(b)))
        }
        out.push(("libfabric-shm", Box::new(|| open(LibfabricConfig::shm()))));
        out.push((
            "libfabric-tcp",
            Box::new(|| open(LibfabricConfig::tcp(Some("lo")))),
        ));
        // The same plans over two rails (two endpoints of the provider on each side, plans of
        // 256 KiB and more striped over both): one host has no second NIC, so this measures the
        // striping's cost rather than a gain.
        out.push((
            "libfabric-shm-2rail",
            Box::new(|| open(LibfabricConfig::shm().with_rails(Rails::Count(2)))),
        ));
        out.push((
            "libfabric-tcp-2rail",
            Box::new(|| open(LibfabricConfig::tcp(Some("lo")).with_rails(Rails::Count(2)))),
        ));
    }
    #[cfg(feature = "nixl")]
    {
        use kvx_rdma::nixl::{NixlConfig, NixlTransport};
        // Needs the runtime: `KVX_NIXL_LIB_DIR` (set by `cargo xtask bench`). Over UCX's TCP
        // transport on loopback, and over its shared-memory ones (what UCX takes within a host).
        fn nixl(config: NixlConfig) -> Option<(Box<dyn Transport>, Box<dyn Transport>)> {
            let config = NixlConfig {
                library: std::env::var_os(kvx_rdma::nixl::LIB_DIR_ENV).map(Into::into),
                ..config
            };
            let open = || {
                NixlTransport::open(&config)
                    .map_err(|e| match std::error::Error::source(&e) {
                        Some(why) => eprintln!("nixl: {e}: {why}"),
                        None => eprintln!("nixl: {e}"),
                    })
                    .ok()
            };
            let (a, b) = (open()?, open()?);
            Some((
                Box::new(a) as Box<dyn Transport>,
                Box::new(b) as Box<dyn Transport>,
            ))
        }
        out.push((
            "nixl-ucx-tcp",
            Box::new(|| nixl(NixlConfig::ucx_tcp(Some("lo")))),
        ));
        out.push((
            "nixl-ucx-shm",
            Box::new(|| nixl(NixlConfig::ucx_shm().with_engine_setting("TLS", "sm,self"))),
        ));
        // The same without prepared descriptor lists: every piece described per transfer.
        out.push((
            "nixl-ucx-shm-unprepared",
            Box::new(|| {
                nixl(NixlConfig {
                    prepared_list_limit: 0,
                    ..NixlConfig::ucx_shm().with_engine_setting("TLS", "sm,self")
                })
            }),
        ));
    }
    out
}

fn main() {
    if let Ok(role) = std::env::var(across::ROLE_ENV) {
        if let Err(e) = across::child(&role) {
            eprintln!("{role}: {e}");
            std::process::exit(1);
        }
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let only = args
        .windows(2)
        .find(|w| w[0] == "--backend")
        .map(|w| w[1].clone());
    // `--case sweep|request-16k|request-16k-scattered|across`: one case only (`across`: the
    // cross-host backends alone).
    let case = args
        .windows(2)
        .find(|w| w[0] == "--case")
        .map(|w| w[1].clone());
    let wanted = |name: &str| case.as_deref().is_none_or(|c| c == name);
    let reps = if quick { 2 } else { 5 };
    let sizes: Vec<u64> = if quick {
        vec![4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB]
    } else {
        vec![
            4 * KIB,
            16 * KIB,
            64 * KIB,
            256 * KIB,
            MIB,
            4 * MIB,
            16 * MIB,
            64 * MIB,
        ]
    };

    let mut rows = Vec::new();
    for (name, factory) in backends() {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let Some((producer, consumer)) = factory() else {
            eprintln!("{name}: not available, skipped");
            continue;
        };
        let mut pair = Pair::new(producer, consumer, 1, SWEEP_BYTES as usize);
        let mut copier = Memcpy::new(1, SWEEP_BYTES as usize);
        for &size in sizes.iter().filter(|_| wanted("sweep")) {
            let plan = sweep_plan(size);
            let ((best, post), memcpy) = best_of(&mut pair, &mut copier, &plan, reps);
            if best.is_finite() {
                rows.push(Row {
                    backend: name.into(),
                    case: "sweep".into(),
                    op_bytes: size,
                    ops: plan.len(),
                    bytes: SWEEP_BYTES,
                    seconds: best,
                    post_seconds: post,
                    memcpy_seconds: memcpy,
                });
                eprintln!(
                    "{name} {size} B: {:.2} GB/s",
                    SWEEP_BYTES as f64 / best / 1e9
                );
            }
        }
        drop(pair);

        for (case, layers, chunk, run) in [
            ("request-16k", PLAN_LAYERS, PLAN_CHUNK, PLAN_RUN),
            (
                "request-16k-scattered",
                SCATTERED_LAYERS,
                SCATTERED_CHUNK,
                1,
            ),
        ] {
            if !wanted(case) {
                continue;
            }
            let Some((producer, consumer)) = factory() else {
                continue;
            };
            let region_len = (2 * PLAN_BLOCKS * chunk) as usize;
            let mut pair = Pair::new(producer, consumer, layers, region_len);
            let plan = request_plan(layers, chunk, run);
            let bytes: u64 = plan.iter().map(CopyOp::bytes).sum();
            let mut copier = Memcpy::new(layers as usize, region_len);
            let ((best, post), memcpy) = best_of(&mut pair, &mut copier, &plan, reps.min(3));
            if best.is_finite() {
                rows.push(Row {
                    backend: name.into(),
                    case: case.into(),
                    op_bytes: run * chunk,
                    ops: plan.len(),
                    bytes,
                    seconds: best,
                    post_seconds: post,
                    memcpy_seconds: memcpy,
                });
            }
        }
    }
    if wanted("across") {
        match kvx_testkit::netns::TwoHosts::new() {
            Ok(hosts) => {
                for backend in across::backends() {
                    if only.as_deref().is_some_and(|o| o != backend) {
                        continue;
                    }
                    match across::measure(&hosts, backend) {
                        Ok(more) => rows.extend(more),
                        Err(e) => eprintln!("{backend} across hosts: {e}"),
                    }
                }
            }
            Err(why) => {
                eprintln!("across hosts: skipped: cannot create network namespaces ({why})")
            }
        }
    }
    report(&rows);
}

fn report(rows: &[Row]) {
    let mut md = String::from(
        "| backend | case | op size | ops | bytes | time (ms) | of it in write (ms) | GB/s | memcpy GB/s | % of memcpy | per op (µs) |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut json = String::from("[\n");
    for (i, r) in rows.iter().enumerate() {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0}% | {:.2} |",
            r.backend,
            r.case,
            human(r.op_bytes),
            r.ops,
            human(r.bytes),
            r.seconds * 1e3,
            r.post_seconds * 1e3,
            r.gbps(),
            r.memcpy_gbps(),
            100.0 * r.gbps() / r.memcpy_gbps(),
            r.per_op_us(),
        );
        let _ = writeln!(
            json,
            "  {{\"backend\": \"{}\", \"case\": \"{}\", \"op_bytes\": {}, \"ops\": {}, \"bytes\": {}, \
             \"seconds\": {:.6}, \"post_seconds\": {:.6}, \"gbps\": {:.3}, \"memcpy_seconds\": {:.6}, \"memcpy_gbps\": {:.3}, \
             \"per_op_us\": {:.3}}}{}",
            r.backend,
            r.case,
            r.op_bytes,
            r.ops,
            r.bytes,
            r.seconds,
            r.post_seconds,
            r.gbps(),
            r.memcpy_seconds,
            r.memcpy_gbps(),
            r.per_op_us(),
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    json.push_str("]\n");
    println!("{md}");
    let dir = std::env::var_os("KVX_BENCH_OUT").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/kvx-bench"),
        PathBuf::from,
    );
    if let Err(e) = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join("transfer.md"), &md))
        .and_then(|()| std::fs::write(dir.join("transfer.json"), &json))
    {
        eprintln!("could not write results to {}: {e}", dir.display());
    } else {
        eprintln!("results in {}", dir.display());
    }
}

fn human(bytes: u64) -> String {
    if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{} MiB", bytes / MIB)
    } else if bytes >= KIB && bytes.is_multiple_of(KIB) {
        format!("{} KiB", bytes / KIB)
    } else {
        format!("{bytes} B")
    }
}
