//! `cargo xtask bench gpu`: the CUDA IPC transport and the layout kernels beside a plain
//! device-to-device copy of the same bytes, measured in the same run.
//!
//! - **IPC**: a consumer process (this binary re-executed) registers a 256 MiB region; the producer
//!   posts `n` writes of one size back to back, each with its notice, and waits for all of them
//!   (wall clock, first post to last completion). The baseline is `n` plain copies of that size on
//!   one stream, timed the same way. With two GPUs the consumer is on GPU 1 and the baseline is a
//!   peer copy GPU 0 → GPU 1 (peer access on).
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

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The consumer process: one region, notices counted until stdin closes.
fn consumer(device: u32) -> Res<()> {
    let mut t = CudaIpcTransport::open(CudaIpcConfig::new(device))?;
    let gpu = Arc::clone(t.gpu());
    let region = Arc::new(DeviceBuffer::new(&gpu, REGION)?);
    t.register(LocalRegion::cuda(0, region))?;
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

fn wait_writes(t: &mut CudaIpcTransport, mut left: usize) -> Res<()> {
    let mut events = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while left > 0 {
        events.clear();
        t.wait(&mut events, Duration::from_millis(100))?;
        for e in &events {
            match e {
                Event::WriteDone { .. } => left -= 1,
                Event::Failed { error, .. } => return Err(format!("write failed: {error}").into()),
                _ => {}
            }
        }
        if Instant::now() > deadline {
            return Err("writes did not finish in 60 s".into());
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

fn gbps(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

fn ipc_rows(gpus: u32, rows: &mut Vec<Row>) -> Res<()> {
    let consumer_device = if gpus > 1 { 1 } else { 0 };
    let mut child = Command::new(std::env::current_exe()?)
        .env(ROLE, consumer_device.to_string())
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
    let mut config = CudaIpcConfig::new(0);
    config.copy = CopyMethod::CopyEngine;
    let mut t = CudaIpcTransport::open(config)?;
    let gpu = Arc::clone(t.gpu());
    let src = Arc::new(DeviceBuffer::new(&gpu, REGION)?);
    src.fill_with(|i| (i >> 12) as u8)?;
    t.register(LocalRegion::cuda(0, Arc::clone(&src)))?;
    let peer = t.connect(&desc)?;
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
    for size in [MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB] {
        let n = ((4 << 30) / size).clamp(8, 512) as usize;
        let op = CopyOp::run(Rank(0), (0, 0), (0, 0), size);
        let mut ours = Vec::new();
        let mut base = Vec::new();
        for round in 0..4 {
            let start = Instant::now();
            for i in 0..n {
                t.write(peer, &[op], Some(Notice(i as u64)))?;
            }
            wait_writes(&mut t, n)?;
            let ipc = start.elapsed().as_secs_f64();
            let start = Instant::now();
            for _ in 0..n {
                stream.copy(&dst, 0, &src, 0, size)?;
            }
            stream.synchronize()?;
            let plain = start.elapsed().as_secs_f64();
            if round > 0 {
                ours.push(gbps(size * n as u64, ipc));
                base.push(gbps(size * n as u64, plain));
            }
        }
        rows.push(Row {
            name: format!("ipc write {label}, {} MiB x{n}", size / MIB),
            bytes: size,
            ours_gbps: median(ours),
            baseline_gbps: median(base),
        });
        // One transfer alone: latency to the completion, against one copy and a sync.
        let mut one = Vec::new();
        let mut plain_one = Vec::new();
        for _ in 0..20 {
            let start = Instant::now();
            t.write(peer, &[op], Some(Notice(7)))?;
            wait_writes(&mut t, 1)?;
            one.push(start.elapsed().as_secs_f64());
            let start = Instant::now();
            stream.copy(&dst, 0, &src, 0, size)?;
            stream.synchronize()?;
            plain_one.push(start.elapsed().as_secs_f64());
        }
        rows.push(Row {
            name: format!(
                "ipc single {label}, {} MiB (us: {:.0} vs {:.0})",
                size / MIB,
                median(one.clone()) * 1e6,
                median(plain_one.clone()) * 1e6
            ),
            bytes: size,
            ours_gbps: gbps(size, median(one)),
            baseline_gbps: gbps(size, median(plain_one)),
        });
    }
    drop(child.stdin.take());
    let _ = child.wait();
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
    if let Ok(device) = std::env::var(ROLE) {
        return consumer(device.parse()?);
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
    // `KVX_GPU_BENCH_ONLY=kernels|ipc` runs one part (for profiling).
    let only = std::env::var("KVX_GPU_BENCH_ONLY").unwrap_or_default();
    let (kernels, ipc) = (only != "ipc", only != "kernels");
    let skip = || Ok(());
    for (name, result) in [
        (
            "kernels",
            if kernels {
                kernel_rows(&mut rows)
            } else {
                skip()
            },
        ),
        (
            "ipc, one GPU",
            if ipc { ipc_rows(1, &mut rows) } else { skip() },
        ),
        (
            "ipc, two GPUs",
            if ipc && gpus > 1 {
                ipc_rows(gpus, &mut rows)
            } else {
                skip()
            },
        ),
    ] {
        if let Err(e) = result {
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
