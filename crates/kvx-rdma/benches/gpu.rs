//! `cargo xtask bench gpu`: the CUDA IPC transport and the layout kernels beside a plain
//! device-to-device copy of the same bytes, measured in the same run.
//!
//! - **Writes** over CUDA IPC and (feature `nixl`, with `KVX_NIXL_LIB_DIR`) NIXL `VRAM`: a
//!   consumer process (this binary re-executed) registers a 256 MiB region; the producer
//!   posts `n` writes of one size back to back, each with its notice, and waits for all of them
//!   (wall clock, first post to last completion). The baseline is `n` plain copies of that size on
//!   one stream (`cuMemcpyAsync`), timed the same way. With two GPUs the consumer is on GPU 1 and
//!   the baseline is a peer copy GPU 0 → GPU 1 (peer access on).
//! - **A 16k-token plan** of one Qwen3-32B rank at TP8 into scattered consumer blocks (131,072
//!   operations of 4 KiB) as one write, over each transport (NIXL with and without prepared
//!   descriptor lists), against one copy of the same 512 MiB.
//! - **Kernels** (CUDA events): the in-place permute (NHD → HND) and the batched copy of a
//!   block-size re-layout plan, against a copy of the same bytes.
//!
//! Rates count the bytes moved once. Results: a table on stdout and
//! `target/kvx-bench/gpu.json` (or `$KVX_BENCH_OUT/gpu.json`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{Arrangement, BlockId, Dtype, LayoutSpec, MemoryOrder, Rank};
use kvx_layout::{CopyOp, Layout, Permute, PlanRequest};
use kvx_rdma::cuda::ipc::{CopyMethod, CudaIpcConfig, CudaIpcTransport};
use kvx_rdma::cuda::kernels::LayoutKernels;
use kvx_rdma::cuda::{device_count, DeviceBuffer, Event as CudaEvent, Gpu, Stream};
use kvx_rdma::{EndpointDesc, Event, LocalRegion, Notice, Transport};

const ROLE: &str = "KVX_GPU_BENCH_ROLE";
const REGION: u64 = 256 << 20;
const MIB: u64 = 1 << 20;

/// The 16k-token plan of one Qwen3-32B rank at TP8 (64 layers, one KV head of 128 in bf16,
/// 16-token blocks: 4 KiB per block per K/V; one region per layer holding K then V of 1,024
/// blocks), from the producer's contiguous blocks into a consumer whose blocks are all
/// scattered: 131,072 operations of 4 KiB, 512 MiB.
const PLAN_LAYERS: u32 = 64;
const PLAN_BLOCKS: u64 = 1024;
const PLAN_CHUNK: u64 = 4096;
const PLAN_REGION: u64 = 2 * PLAN_BLOCKS * PLAN_CHUNK;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The transports measured: CUDA IPC, and (feature `nixl`, with `KVX_NIXL_LIB_DIR`) NIXL with
/// `VRAM` registrations, with and without prepared descriptor lists.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Ipc,
    #[cfg(feature = "nixl")]
    Nixl,
    #[cfg(feature = "nixl")]
    NixlUnprepared,
    /// NIXL with a transfer in one request however many descriptors it has.
    #[cfg(feature = "nixl")]
    NixlOneRequest,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Ipc => "ipc",
            #[cfg(feature = "nixl")]
            Self::Nixl => "nixl",
            #[cfg(feature = "nixl")]
            Self::NixlUnprepared => "nixl-unprepared",
            #[cfg(feature = "nixl")]
            Self::NixlOneRequest => "nixl-one-request",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        Self::all().into_iter().find(|k| k.name() == name)
    }

    fn all() -> Vec<Self> {
        #[cfg_attr(not(feature = "nixl"), allow(unused_mut))]
        let mut all = vec![Self::Ipc];
        #[cfg(feature = "nixl")]
        if std::env::var_os(kvx_rdma::nixl::LIB_DIR_ENV).is_some() {
            all.extend([Self::Nixl, Self::NixlUnprepared, Self::NixlOneRequest]);
        }
        all
    }

    /// An endpoint on `device`, and the GPU it uses; `copy_engine`: CUDA IPC copies with the
    /// copy engines only (never its batched-copy kernel), as a single large write does anyway.
    fn open(self, device: u32, copy_engine: bool) -> Res<(Box<dyn Transport>, Arc<Gpu>)> {
        match self {
            Self::Ipc => {
                let mut config = CudaIpcConfig::new(device);
                if copy_engine {
                    config.copy = CopyMethod::CopyEngine;
                }
                let t = CudaIpcTransport::open(config)?;
                let gpu = Arc::clone(t.gpu());
                Ok((Box::new(t), gpu))
            }
            #[cfg(feature = "nixl")]
            Self::Nixl | Self::NixlUnprepared | Self::NixlOneRequest => {
                use kvx_rdma::nixl::{NixlConfig, NixlTransport, LIB_DIR_ENV};
                let mut config = NixlConfig::ucx().with_device_memory();
                config.library = std::env::var_os(LIB_DIR_ENV).map(Into::into);
                config.op_timeout = Duration::from_secs(60);
                if self == Self::NixlUnprepared {
                    config.prepared_list_limit = 0;
                }
                if self == Self::NixlOneRequest {
                    config.max_request_descriptors = usize::MAX;
                }
                Ok((Box::new(NixlTransport::open(&config)?), Gpu::open(device)?))
            }
        }
    }
}

/// Registers `regions` device buffers of `len` bytes (region indices 0..) on `t`.
fn register(
    t: &mut dyn Transport,
    gpu: &Arc<Gpu>,
    regions: u32,
    len: u64,
) -> Res<Vec<Arc<DeviceBuffer>>> {
    let mut buffers = Vec::new();
    for index in 0..regions {
        let buffer = Arc::new(DeviceBuffer::new(gpu, len)?);
        t.register(LocalRegion::cuda(index, Arc::clone(&buffer)))?;
        buffers.push(buffer);
    }
    Ok(buffers)
}

/// The consumer process (`ROLE` = `kind:device:regions:len`): its regions, notices drained
/// until stdin closes.
fn consumer(role: &str) -> Res<()> {
    let parts: Vec<&str> = role.split(':').collect();
    let [kind, device, regions, len] = parts[..] else {
        return Err(format!("bad {ROLE} {role}").into());
    };
    let kind = Kind::parse(kind).ok_or("unknown transport")?;
    let (mut t, gpu) = kind.open(device.parse()?, true)?;
    let _buffers = register(t.as_mut(), &gpu, regions.parse()?, len.parse()?)?;
    println!("DESC {}", t.local_desc().to_hex());
    std::io::stdout().flush()?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        let _ = tx.send(());
    });
    let mut events = Vec::new();
    while rx.try_recv().is_err() {
        events.clear();
        t.wait(&mut events, Duration::from_millis(50))?;
    }
    Ok(())
}

/// Waits for `left` writes or reads to complete.
fn wait_writes(t: &mut dyn Transport, mut left: usize) -> Res<()> {
    let mut events = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while left > 0 {
        events.clear();
        t.wait(&mut events, Duration::from_millis(100))?;
        for e in &events {
            match e {
                Event::WriteDone { .. } | Event::ReadDone { .. } => left -= 1,
                Event::Failed { error, .. } => {
                    return Err(format!("transfer failed: {error}").into())
                }
                _ => {}
            }
        }
        if Instant::now() > deadline {
            return Err("transfers did not finish in 60 s".into());
        }
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Row {
    name: String,
    bytes: u64,
    ours_gbps: f64,
    baseline_gbps: f64,
}

impl Row {
    fn ratio(&self) -> f64 {
        self.ours_gbps / self.baseline_gbps
    }
}

/// One part of the benchmark, adding its rows.
type Part = Box<dyn FnOnce(&mut Vec<Row>) -> Res<()>>;

fn gbps(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

/// A producer endpoint of `kind` on GPU 0 connected to a consumer process on `device`, each
/// with `regions` regions of `len` bytes.
struct Pair {
    t: Box<dyn Transport>,
    gpu: Arc<Gpu>,
    src: Vec<Arc<DeviceBuffer>>,
    peer: kvx_rdma::PeerId,
    child: std::process::Child,
}

impl Pair {
    fn new(kind: Kind, device: u32, regions: u32, len: u64, copy_engine: bool) -> Res<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .env(ROLE, format!("{}:{device}:{regions}:{len}", kind.name()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
        let desc = loop {
            let line = lines.next().ok_or("consumer exited")??;
            if let Some(d) = line.strip_prefix("DESC ") {
                break EndpointDesc::from_hex(d)?;
            }
        };
        let (mut t, gpu) = kind.open(0, copy_engine)?;
        let src = register(t.as_mut(), &gpu, regions, len)?;
        for s in &src {
            s.fill_with(|i| (i >> 12) as u8)?;
        }
        let peer = t.connect(&desc)?;
        Ok(Self {
            t,
            gpu,
            src,
            peer,
            child,
        })
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

fn write_rows(kind: Kind, gpus: u32, rows: &mut Vec<Row>) -> Res<()> {
    let consumer_device = if gpus > 1 { 1 } else { 0 };
    let mut pair = Pair::new(kind, consumer_device, 1, REGION, true)?;
    let (gpu, src) = (Arc::clone(&pair.gpu), Arc::clone(&pair.src[0]));
    // Baseline: plain copies into a buffer on the consumer's device.
    let target_gpu = Gpu::open(consumer_device)?;
    if consumer_device != 0 {
        gpu.enable_peer_access(&target_gpu)?;
    }
    let dst = DeviceBuffer::new(&target_gpu, REGION)?;
    let stream = Stream::new(&gpu)?;
    let label = if consumer_device == 0 {
        "same GPU"
    } else {
        "GPU0->GPU1"
    };
    let name = kind.name();
    let t = pair.t.as_mut();
    for size in [MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB] {
        let n = ((4 << 30) / size).clamp(8, 512) as usize;
        let op = CopyOp::run(Rank(0), (0, 0), (0, 0), size);
        let mut ours = Vec::new();
        let mut base = Vec::new();
        for round in 0..4 {
            let start = Instant::now();
            for i in 0..n {
                t.write(pair.peer, &[op], Some(Notice(i as u64)))?;
            }
            wait_writes(t, n)?;
            let took = start.elapsed().as_secs_f64();
            let start = Instant::now();
            for _ in 0..n {
                stream.copy(&dst, 0, &src, 0, size)?;
            }
            stream.synchronize()?;
            let plain = start.elapsed().as_secs_f64();
            if round > 0 {
                ours.push(gbps(size * n as u64, took));
                base.push(gbps(size * n as u64, plain));
            }
        }
        rows.push(Row {
            name: format!("{name} write {label}, {} MiB x{n}", size / MIB),
            bytes: size,
            ours_gbps: median(ours),
            baseline_gbps: median(base),
        });
        // One transfer alone: latency to the completion, against one copy and a sync.
        let mut one = Vec::new();
        let mut plain_one = Vec::new();
        for _ in 0..20 {
            let start = Instant::now();
            t.write(pair.peer, &[op], Some(Notice(7)))?;
            wait_writes(t, 1)?;
            one.push(start.elapsed().as_secs_f64());
            let start = Instant::now();
            stream.copy(&dst, 0, &src, 0, size)?;
            stream.synchronize()?;
            plain_one.push(start.elapsed().as_secs_f64());
        }
        rows.push(Row {
            name: format!(
                "{name} single {label}, {} MiB (us: {:.0} vs {:.0})",
                size / MIB,
                median(one.clone()) * 1e6,
                median(plain_one.clone()) * 1e6
            ),
            bytes: size,
            ours_gbps: gbps(size, median(one)),
            baseline_gbps: gbps(size, median(plain_one)),
        });
    }
    Ok(())
}

/// The 16k-token TP8-rank plan (see [`PLAN_LAYERS`]) as one write with a notice (or, `read`, as
/// one read by the side whose blocks are scattered, as pull does), the consumer's blocks in runs
/// of `run` at scattered places, from the call to its completion, against one copy of the same
/// bytes; the time inside the call (building and posting the operations) is reported in the
/// name.
fn plan_rows(kind: Kind, run: u64, read: bool, rows: &mut Vec<Row>) -> Res<()> {
    let mut pair = Pair::new(kind, 0, PLAN_LAYERS, PLAN_REGION, false)?;
    let runs = PLAN_BLOCKS / run;
    let place = |r: u64| (r * 37 + 11) % runs;
    let mut plan = Vec::new();
    for layer in 0..PLAN_LAYERS {
        for kv in 0..2 {
            let base = kv * PLAN_BLOCKS * PLAN_CHUNK;
            for r in 0..runs {
                plan.push(CopyOp::run(
                    Rank(0),
                    (layer, base + r * run * PLAN_CHUNK),
                    (layer, base + place(r) * run * PLAN_CHUNK),
                    run * PLAN_CHUNK,
                ));
            }
        }
    }
    let bytes: u64 = plan.iter().map(CopyOp::bytes).sum();
    let dst = DeviceBuffer::new(&pair.gpu, bytes)?;
    let big = DeviceBuffer::new(&pair.gpu, bytes)?;
    let stream = Stream::new(&pair.gpu)?;
    let (mut total, mut posting, mut plain) = (Vec::new(), Vec::new(), Vec::new());
    let t = pair.t.as_mut();
    for round in 0..4 {
        let start = Instant::now();
        if read {
            t.read(pair.peer, &plan)?;
        } else {
            t.write(pair.peer, &plan, Some(Notice(round)))?;
        }
        let posted = start.elapsed().as_secs_f64();
        wait_writes(t, 1)?;
        let took = start.elapsed().as_secs_f64();
        let start = Instant::now();
        stream.copy(&dst, 0, &big, 0, bytes)?;
        stream.synchronize()?;
        // The first round prepares descriptor lists (NIXL) and opens handles: reported apart.
        if round == 0 {
            eprintln!(
                "{} plan (runs of {run}, {}), first: {:.1} ms ({:.1} ms in the call)",
                kind.name(),
                if read { "read" } else { "write" },
                took * 1e3,
                posted * 1e3
            );
        } else {
            total.push(took);
            posting.push(posted);
            plain.push(start.elapsed().as_secs_f64());
        }
    }
    rows.push(Row {
        name: format!(
            "{} 16k-token TP8-rank plan {}, consumer blocks in runs of {run}: {} ops of {} KiB (ms: {:.2} of which {:.2} in the call, vs {:.2})",
            kind.name(),
            if read { "read" } else { "written" },
            plan.len(),
            (run * PLAN_CHUNK) >> 10,
            median(total.clone()) * 1e3,
            median(posting) * 1e3,
            median(plain.clone()) * 1e3
        ),
        bytes,
        ours_gbps: gbps(bytes, median(total)),
        baseline_gbps: gbps(bytes, median(plain)),
    });
    Ok(())
}

/// Times `f` (which enqueues on `stream`) with events: median over rounds, after a warm-up.
fn time_events(gpu: &Arc<Gpu>, stream: &Stream, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    let (a, b) = (CudaEvent::new(gpu)?, CudaEvent::new(gpu)?);
    f()?;
    stream.synchronize()?;
    let mut times = Vec::new();
    for _ in 0..10 {
        a.record(stream)?;
        f()?;
        b.record(stream)?;
        times.push(f64::from(b.elapsed_ms_since(&a)?) / 1e3);
    }
    Ok(median(times))
}

fn kernel_rows(rows: &mut Vec<Row>) -> Res<()> {
    let gpu = Gpu::open(0)?;
    let mut kernels = LayoutKernels::new(&gpu)?;
    let region = Arc::new(DeviceBuffer::new(&gpu, REGION)?);
    region.fill_with(|i| ((i * 7) >> 2) as u8)?;
    let copy_dst = DeviceBuffer::new(&gpu, REGION)?;
    let lookup = |r: u32| (r == 0).then(|| (region.device_ptr(), region.len()));
    // Permute NHD -> HND: bf16, 128-dim heads, 8 heads; 16-token blocks (32 KiB chunks, shared
    // memory path) and 128-token blocks (256 KiB chunks, scratch path).
    for block_tokens in [16u32, 64, 128] {
        let head_bytes = 256;
        let heads = 8;
        let chunk = u64::from(block_tokens) * heads * head_bytes;
        let permutes: Vec<Permute> = (0..REGION / chunk)
            .map(|c| Permute {
                region: 0,
                offset: c * chunk,
                from: MemoryOrder::Nhd,
                to: MemoryOrder::Hnd,
                block_tokens,
                first_slot: 0,
                slots: block_tokens,
                heads: heads as u32,
                head_bytes,
            })
            .collect();
        let bytes = chunk * permutes.len() as u64;
        // The kernels' stream is private; time with wall clock around a synchronised launch.
        let mut ours = Vec::new();
        for round in 0..6 {
            let start = Instant::now();
            // SAFETY: the region is live and idle; nothing else touches it.
            unsafe { kernels.permute(&permutes, &lookup)? };
            kernels.synchronize()?;
            if round > 0 {
                ours.push(gbps(bytes, start.elapsed().as_secs_f64()));
            }
        }
        let stream = Stream::new(&gpu)?;
        let mut base = Vec::new();
        for round in 0..6 {
            let start = Instant::now();
            stream.copy(&copy_dst, 0, &region, 0, bytes)?;
            stream.synchronize()?;
            if round > 0 {
                base.push(gbps(bytes, start.elapsed().as_secs_f64()));
            }
        }
        let evt = time_events(&gpu, &stream, || {
            Ok(stream.copy(&copy_dst, 0, &region, 0, bytes)?)
        })?;
        // Back to back (an engine re-laying out consecutive requests): the host's planning and
        // table upload of one call overlap the previous call's kernel.
        let (a, b) = (CudaEvent::new(&gpu)?, CudaEvent::new(&gpu)?);
        let mut kernel = Vec::new();
        let mut host = Vec::new();
        for _ in 0..5 {
            a.record(kernels.stream())?;
            for _ in 0..8 {
                let start = Instant::now();
                // SAFETY: as above.
                unsafe { kernels.permute(&permutes, &lookup)? };
                host.push(start.elapsed().as_secs_f64());
            }
            b.record(kernels.stream())?;
            kernel.push(f64::from(b.elapsed_ms_since(&a)?) / 1e3 / 8.0);
        }
        eprintln!(
            "permute {block_tokens}-token blocks: {} chunks, host time per call {:.0} us, device time per call {:.0} us",
            permutes.len(),
            median(host) * 1e6,
            median(kernel.clone()) * 1e6
        );
        rows.push(Row {
            name: format!(
                "permute NHD->HND, {block_tokens}-token blocks ({} KiB chunks), back to back by events (one call alone, wall clock: {:.0} vs {:.0} GB/s)",
                chunk >> 10,
                median(ours),
                median(base)
            ),
            bytes,
            ours_gbps: gbps(bytes, median(kernel)),
            baseline_gbps: gbps(bytes, evt),
        });
    }
    // Batched copy: a block-size re-layout plan (HND, 16-token producer blocks into 64-token
    // consumer blocks, 32 layers, 8 heads): many short strided runs.
    let spec = |block: u32| LayoutSpec {
        num_layers: 32,
        total_kv_heads: 8,
        head_dim: 128,
        dtype: Dtype::Bf16,
        mla: false,
        block_tokens: block,
        num_blocks: 8192 / block,
        tp_size: 1,
        tp_rank: 0,
        order: MemoryOrder::Hnd,
        arrangement: Arrangement::CrossLayer,
    };
    let producer = Layout::new(spec(16))?;
    let consumer = Layout::new(spec(64))?;
    let tokens: u64 = 8000;
    let pblocks: Vec<BlockId> = (0..tokens / 16)
        .map(|i| BlockId((i * 7) as u32 % 512))
        .collect();
    let cblocks: Vec<BlockId> = (0..tokens.div_ceil(64))
        .map(|i| BlockId((i * 5) as u32 % 128))
        .collect();
    let plan = kvx_layout::plan(&PlanRequest {
        producers: std::slice::from_ref(&producer),
        consumer: &consumer,
        num_tokens: tokens,
        skip_tokens: 0,
        producer_blocks: &pblocks,
        consumer_blocks: &cblocks,
        only_producer: None,
        producer_groups: &[],
        consumer_groups: &[],
    })?;
    let src = Arc::new(DeviceBuffer::new(&gpu, producer.region_len())?);
    let dst = Arc::new(DeviceBuffer::new(&gpu, consumer.region_len())?);
    let src_lookup = |r: u32| (r == 0).then(|| (src.device_ptr(), src.len()));
    let dst_lookup = |r: u32| (r == 0).then(|| (dst.device_ptr(), dst.len()));
    let runs: u64 = plan.ops().iter().map(|o| o.count).sum();
    let mut ours = Vec::new();
    for round in 0..6 {
        let start = Instant::now();
        // SAFETY: both buffers are live and idle.
        unsafe { kernels.copy_ops(plan.ops(), &src_lookup, &dst_lookup)? };
        kernels.synchronize()?;
        if round > 0 {
            ours.push(gbps(plan.bytes(), start.elapsed().as_secs_f64()));
        }
    }
    let stream = Stream::new(&gpu)?;
    let mut base = Vec::new();
    for round in 0..6 {
        let start = Instant::now();
        stream.copy(&dst, 0, &src, 0, plan.bytes())?;
        stream.synchronize()?;
        if round > 0 {
            base.push(gbps(plan.bytes(), start.elapsed().as_secs_f64()));
        }
    }
    let copy_evt = time_events(&gpu, &stream, || {
        Ok(stream.copy(&dst, 0, &src, 0, plan.bytes())?)
    })?;
    let (a, b) = (CudaEvent::new(&gpu)?, CudaEvent::new(&gpu)?);
    let mut kernel = Vec::new();
    for _ in 0..5 {
        a.record(kernels.stream())?;
        for _ in 0..4 {
            // SAFETY: as above.
            unsafe { kernels.copy_ops(plan.ops(), &src_lookup, &dst_lookup)? };
        }
        b.record(kernels.stream())?;
        kernel.push(f64::from(b.elapsed_ms_since(&a)?) / 1e3 / 4.0);
    }
    rows.push(Row {
        name: format!(
            "batched copy, block 16->64 HND plan ({} ops, {runs} runs of {} B), back to back by events (one call alone, wall clock: {:.0} vs {:.0} GB/s)",
            plan.ops().len(),
            plan.bytes() / runs.max(1),
            median(ours),
            median(base)
        ),
        bytes: plan.bytes(),
        ours_gbps: gbps(plan.bytes(), median(kernel)),
        baseline_gbps: gbps(plan.bytes(), copy_evt),
    });
    Ok(())
}

fn main() -> Res<()> {
    if let Ok(role) = std::env::var(ROLE) {
        return consumer(&role);
    }
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    let gpus = match device_count() {
        Ok(n) if n > 0 => n,
        Ok(_) => {
            println!("SKIPPED bench gpu: the CUDA driver sees no device");
            return Ok(());
        }
        Err(e) => {
            println!("SKIPPED bench gpu: {e}");
            return Ok(());
        }
    };
    let gpu = Gpu::open(0)?;
    println!(
        "bench gpu: {gpus} GPU(s); GPU 0 at {} (sm_{}{})",
        gpu.pci_address(),
        gpu.compute_capability().0,
        gpu.compute_capability().1
    );
    let mut rows = Vec::new();
    let mut failed = false;
    // `KVX_GPU_BENCH_ONLY=kernels,writes,plan,read` (any of them) runs those parts;
    // `KVX_GPU_BENCH_KINDS` (comma-separated: ipc, nixl, nixl-unprepared, nixl-one-request)
    // narrows the transports.
    let only = std::env::var("KVX_GPU_BENCH_ONLY").unwrap_or_default();
    let wanted = |part: &str| only.is_empty() || only.split(',').any(|p| p == part);
    let kinds: Vec<Kind> = match std::env::var("KVX_GPU_BENCH_KINDS") {
        Ok(list) => list.split(',').filter_map(Kind::parse).collect(),
        Err(_) => Kind::all(),
    };
    let mut parts: Vec<(String, Part)> = Vec::new();
    if wanted("kernels") {
        parts.push(("kernels".into(), Box::new(kernel_rows)));
    }
    for &kind in &kinds {
        // Prepared lists change nothing for writes of one operation.
        #[cfg(feature = "nixl")]
        let writes = wanted("writes") && matches!(kind, Kind::Ipc | Kind::Nixl);
        #[cfg(not(feature = "nixl"))]
        let writes = wanted("writes");
        if writes {
            parts.push((
                format!("{} writes, one GPU", kind.name()),
                Box::new(move |rows| write_rows(kind, 1, rows)),
            ));
            if gpus > 1 {
                parts.push((
                    format!("{} writes, two GPUs", kind.name()),
                    Box::new(move |rows| write_rows(kind, gpus, rows)),
                ));
            }
        }
        for run in [1, 64] {
            if wanted("plan") {
                parts.push((
                    format!("{} plan, runs of {run}", kind.name()),
                    Box::new(move |rows| plan_rows(kind, run, false, rows)),
                ));
            }
        }
        // Pull: reads of the scattered plan.
        if wanted("read") {
            parts.push((
                format!("{} plan read", kind.name()),
                Box::new(move |rows| plan_rows(kind, 1, true, rows)),
            ));
        }
    }
    for (name, part) in parts {
        if let Err(e) = part(&mut rows) {
            println!("FAILED {name}: {e}");
            failed = true;
        }
    }
    println!("\n| case | bytes | kvx GB/s | plain copy GB/s | ratio |\n|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.2} |",
            r.name,
            r.bytes,
            r.ours_gbps,
            r.baseline_gbps,
            r.ratio()
        );
    }
    let dir = std::env::var("KVX_BENCH_OUT").map_or_else(
        |_| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/kvx-bench"),
        std::path::PathBuf::from,
    );
    std::fs::create_dir_all(&dir)?;
    let json: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"case\":{:?},\"bytes\":{},\"kvx_gbps\":{:.3},\"copy_gbps\":{:.3},\"ratio\":{:.4}}}",
                r.name, r.bytes, r.ours_gbps, r.baseline_gbps, r.ratio()
            )
        })
        .collect();
    std::fs::write(dir.join("gpu.json"), format!("[{}]\n", json.join(",\n")))?;
    if failed {
        return Err("some benchmark cases failed".into());
    }
    Ok(())
}
