//! GPU tests of the CUDA backend: real device memory, real CUDA IPC between processes, the NVRTC
//! kernels against the CPU reference. On a machine without a CUDA driver every test prints
//! `SKIPPED` and why, and passes; on a GPU machine they run in full (`cargo xtask test` here, the
//! GPU machine through the built test binary).
//!
//! The cross-process tests re-execute this binary once per rank (`KVX_GPU_ROLE`): every process
//! derives the same scenario (layouts, blocks, pattern) from its name, so only endpoint
//! descriptions travel (consumers print theirs, producers read them on stdin). Producer ranks run
//! on GPU `rank % n` and consumer ranks on GPU `(rank + 1) % n`: with two GPUs, prefill on GPU 0
//! writes into decode on GPU 1 over NVLink.
#![cfg(feature = "cuda")]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{Arrangement, BlockId, Dtype, LayoutSpec, MemoryOrder, Rank};
use kvx_layout::{synth, CopyOp, Layout, Permute, PlanRequest};
use kvx_rdma::cuda::ipc::{CopyMethod, CudaIpcConfig, CudaIpcTransport};
use kvx_rdma::cuda::kernels::LayoutKernels;
use kvx_rdma::cuda::{device_count, CudaError, DeviceBuffer, Gpu};
use kvx_rdma::{EndpointDesc, Event, LocalRegion, Notice, OpError, Transport};

#[path = "support/gpus.rs"]
mod support;
use support::gpus;

const ROLE: &str = "KVX_GPU_ROLE";
const SCENARIO: &str = "KVX_GPU_SCENARIO";
const RANK: &str = "KVX_GPU_RANK";
const SEED: u64 = 0x6b76_7867_7075;
const DEADLINE: Duration = Duration::from_secs(60);

struct Scenario {
    producer_tp: u32,
    consumer_tp: u32,
    producer_block: u32,
    consumer_block: u32,
    producer_order: MemoryOrder,
    consumer_order: MemoryOrder,
    copy: CopyMethod,
    num_tokens: u64,
}

fn scenario(name: &str) -> Scenario {
    let base = Scenario {
        producer_tp: 1,
        consumer_tp: 1,
        producer_block: 16,
        consumer_block: 16,
        producer_order: MemoryOrder::Nhd,
        consumer_order: MemoryOrder::Nhd,
        copy: CopyMethod::Auto,
        num_tokens: 1000,
    };
    match name {
        "same-layout" => Scenario {
            copy: CopyMethod::CopyEngine,
            ..base
        },
        "relayout-kernel" => Scenario {
            producer_block: 16,
            consumer_block: 64,
            producer_order: MemoryOrder::Hnd,
            consumer_order: MemoryOrder::Nhd,
            copy: CopyMethod::Kernel,
            ..base
        },
        "tp2-to-tp1" => Scenario {
            producer_tp: 2,
            ..base
        },
        "tp1-to-tp2" => Scenario {
            consumer_tp: 2,
            consumer_block: 32,
            ..base
        },
        other => panic!("unknown scenario {other}"),
    }
}

fn layout(tp: u32, rank: u32, block: u32, order: MemoryOrder) -> Layout {
    Layout::new(LayoutSpec {
        num_layers: 8,
        total_kv_heads: 8,
        head_dim: 128,
        dtype: Dtype::Bf16,
        mla: false,
        block_tokens: block,
        num_blocks: 4096 / block,
        tp_size: tp,
        tp_rank: rank,
        order,
        arrangement: Arrangement::PerLayerSplit,
    })
    .expect("valid layout")
}

/// The request's blocks: scattered, in a fixed pseudo-random order.
fn blocks(layout: &Layout, tokens: u64) -> Vec<BlockId> {
    let total = layout.spec().num_blocks;
    let needed = tokens.div_ceil(u64::from(layout.spec().block_tokens)) as u32;
    (0..needed)
        .map(|i| BlockId((i * 37 + 11) % total))
        .collect()
}

impl Scenario {
    fn producers(&self) -> Vec<Layout> {
        (0..self.producer_tp)
            .map(|r| {
                layout(
                    self.producer_tp,
                    r,
                    self.producer_block,
                    self.producer_order,
                )
            })
            .collect()
    }
    fn consumer(&self, rank: u32) -> Layout {
        layout(
            self.consumer_tp,
            rank,
            self.consumer_block,
            self.consumer_order,
        )
    }
}

fn device_for(rank: u32, offset: u32, gpus: u32) -> u32 {
    (rank + offset) % gpus
}

fn alloc_regions(gpu: &Arc<Gpu>, layout: &Layout) -> Vec<Arc<DeviceBuffer>> {
    (0..layout.region_count())
        .map(|_| Arc::new(DeviceBuffer::new(gpu, layout.region_len()).expect("device memory")))
        .collect()
}

fn wait_for(transport: &mut CudaIpcTransport, mut want: impl FnMut(&Event) -> bool) -> Event {
    let deadline = Instant::now() + DEADLINE;
    let mut events = Vec::new();
    loop {
        events.clear();
        transport
            .wait(&mut events, Duration::from_millis(200))
            .expect("wait");
        if let Some(i) = events.iter().position(&mut want) {
            return events.swap_remove(i);
        }
        assert!(
            Instant::now() < deadline,
            "no matching event in {DEADLINE:?}"
        );
    }
}

/// A child process of the cross-process tests (selected by `KVX_GPU_ROLE`).
#[test]
#[ignore = "child role of the cross-process GPU tests; started by them"]
fn child_role() {
    let (Ok(role), Ok(name), Ok(rank)) = (
        std::env::var(ROLE),
        std::env::var(SCENARIO),
        std::env::var(RANK),
    ) else {
        return;
    };
    let rank: u32 = rank.parse().expect("rank");
    let s = scenario(&name);
    let n = device_count().expect("cuda");
    let stdout = std::io::stdout();
    match role.as_str() {
        "consumer" => {
            let consumer = s.consumer(rank);
            let mut config = CudaIpcConfig::new(device_for(rank, 1, n));
            if s.copy != CopyMethod::Auto {
                config.copy = s.copy;
            }
            let mut transport = CudaIpcTransport::open(config).expect("open");
            let gpu = Arc::clone(transport.gpu());
            let regions = alloc_regions(&gpu, &consumer);
            for (i, buffer) in regions.iter().enumerate() {
                transport
                    .register(LocalRegion::cuda(i as u32, Arc::clone(buffer)))
                    .expect("register");
            }
            writeln!(stdout.lock(), "DESC {}", transport.local_desc().to_hex()).ok();
            let writers = kvx_layout::writers_for(&consumer, s.producer_tp).expect("writers");
            let mut seen = Vec::new();
            while seen.len() < writers.len() {
                if let Event::Notice(Notice(n)) =
                    wait_for(&mut transport, |e| matches!(e, Event::Notice(_)))
                {
                    seen.push(n);
                }
            }
            let cblocks = blocks(&consumer, s.num_tokens);
            let producers = s.producers();
            if let Some(permute) =
                kvx_layout::permute_for(&producers[0], &consumer, s.num_tokens, 0, &cblocks, &[])
                    .expect("permute plan")
            {
                let mut kernels = LayoutKernels::new(&gpu).expect("kernels");
                let lookup = |r: u32| regions.get(r as usize).map(|b| (b.device_ptr(), b.len()));
                // SAFETY: the regions are live device buffers, idle until the queue is synced.
                unsafe { kernels.permute(&permute.chunks, &lookup) }.expect("permute");
                kernels.synchronize().expect("permute ran");
            }
            let host: Vec<Vec<u8>> = regions
                .iter()
                .map(|b| b.to_vec().expect("copy back"))
                .collect();
            let views: Vec<&[u8]> = host.iter().map(Vec::as_slice).collect();
            match synth::verify_request(&consumer, &views, &cblocks, 0, s.num_tokens, SEED) {
                Ok(()) => writeln!(stdout.lock(), "VERIFIED {} notices", seen.len()).ok(),
                Err(m) => writeln!(stdout.lock(), "MISMATCH {m}").ok(),
            };
        }
        "producer" => {
            let producers = s.producers();
            let me = &producers[rank as usize];
            let mut config = CudaIpcConfig::new(device_for(rank, 0, n));
            if s.copy != CopyMethod::Auto {
                config.copy = s.copy;
            }
            let mut transport = CudaIpcTransport::open(config).expect("open");
            let gpu = Arc::clone(transport.gpu());
            let pblocks = blocks(me, s.num_tokens);
            let mut host: Vec<Vec<u8>> = (0..me.region_count())
                .map(|_| vec![0u8; me.region_len() as usize])
                .collect();
            {
                let mut views: Vec<&mut [u8]> = host.iter_mut().map(Vec::as_mut_slice).collect();
                synth::fill_request(me, &mut views, &pblocks, s.num_tokens, SEED);
            }
            let regions = alloc_regions(&gpu, me);
            for (i, (buffer, bytes)) in regions.iter().zip(&host).enumerate() {
                buffer.write_at(0, bytes).expect("upload");
                transport
                    .register(LocalRegion::cuda(i as u32, Arc::clone(buffer)))
                    .expect("register");
            }
            // One description per consumer rank, on stdin.
            let stdin = std::io::stdin();
            let mut sent = 0;
            for c in 0..s.consumer_tp {
                let mut line = String::new();
                stdin.lock().read_line(&mut line).expect("desc line");
                let consumer = s.consumer(c);
                let desc = EndpointDesc::from_hex(line.trim()).expect("desc");
                let plan = kvx_layout::plan(&PlanRequest {
                    producers: &producers,
                    consumer: &consumer,
                    num_tokens: s.num_tokens,
                    skip_tokens: 0,
                    producer_blocks: &pblocks,
                    consumer_blocks: &blocks(&consumer, s.num_tokens),
                    only_producer: Some(Rank(rank)),
                    producer_groups: &[],
                    consumer_groups: &[],
                })
                .expect("plan");
                let ops = plan.ops_for(Rank(rank));
                if ops.is_empty() {
                    continue;
                }
                let peer = transport.connect(&desc).expect("connect");
                transport
                    .write(
                        peer,
                        ops,
                        Some(Notice(u64::from(rank) << 32 | u64::from(c))),
                    )
                    .expect("write");
                let done = wait_for(&mut transport, |e| {
                    matches!(e, Event::WriteDone { .. } | Event::Failed { .. })
                });
                assert!(matches!(done, Event::WriteDone { .. }), "{done:?}");
                sent += 1;
            }
            writeln!(stdout.lock(), "SENT {sent}").ok();
        }
        "dead" => {
            let mut transport =
                CudaIpcTransport::open(CudaIpcConfig::new(device_for(rank, 1, n))).expect("open");
            let gpu = Arc::clone(transport.gpu());
            let buffer = Arc::new(DeviceBuffer::new(&gpu, 1 << 20).expect("alloc"));
            transport
                .register(LocalRegion::cuda(0, buffer))
                .expect("register");
            writeln!(stdout.lock(), "DESC {}", transport.local_desc().to_hex()).ok();
            std::process::exit(0);
        }
        other => panic!("unknown role {other}"),
    }
}

struct Kid {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Kid {
    fn spawn(role: &str, scenario: &str, rank: u32) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "child_role",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, role)
            .env(SCENARIO, scenario)
            .env(RANK, rank.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn child");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, lines }
    }

    /// The first line starting with one of `prefixes`.
    fn expect_line(&self, prefixes: &[&str]) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("child printed none of {prefixes:?} in time"));
            // libtest prints "test child_role ... " without a newline before the child's
            // first line, so the marker may sit mid-line.
            if let Some(at) = prefixes.iter().filter_map(|p| line.find(p)).min() {
                return line[at..].to_owned();
            }
        }
    }

    fn send_line(&mut self, line: &str) {
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{line}").expect("write to child");
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run_scenario(name: &str) {
    let Some(n) = gpus(name, 1) else { return };
    let s = scenario(name);
    eprintln!(
        "{name}: TP{} -> TP{}, {} GPU(s): producers on {:?}, consumers on {:?}",
        s.producer_tp,
        s.consumer_tp,
        n,
        (0..s.producer_tp)
            .map(|r| device_for(r, 0, n))
            .collect::<Vec<_>>(),
        (0..s.consumer_tp)
            .map(|r| device_for(r, 1, n))
            .collect::<Vec<_>>(),
    );
    let consumers: Vec<Kid> = (0..s.consumer_tp)
        .map(|r| Kid::spawn("consumer", name, r))
        .collect();
    let descs: Vec<String> = consumers
        .iter()
        .map(|k| k.expect_line(&["DESC "])[5..].to_owned())
        .collect();
    let mut producers: Vec<Kid> = (0..s.producer_tp)
        .map(|r| Kid::spawn("producer", name, r))
        .collect();
    for p in &mut producers {
        for d in &descs {
            p.send_line(d);
        }
    }
    for p in &producers {
        let line = p.expect_line(&["SENT "]);
        eprintln!("{name}: producer {line}");
    }
    for (r, c) in consumers.iter().enumerate() {
        let line = c.expect_line(&["VERIFIED", "MISMATCH"]);
        assert!(
            line.starts_with("VERIFIED"),
            "{name}, consumer rank {r}: {line}"
        );
        eprintln!("{name}: consumer {r} {line}");
    }
}

#[test]
fn ipc_moves_a_multilayer_plan_between_processes() {
    run_scenario("same-layout");
}

#[test]
fn ipc_with_block_size_and_memory_order_relayout() {
    run_scenario("relayout-kernel");
}

#[test]
fn ipc_two_producer_ranks_into_one_consumer() {
    run_scenario("tp2-to-tp1");
}

#[test]
fn ipc_one_producer_rank_into_two_consumers() {
    run_scenario("tp1-to-tp2");
}

#[test]
fn ipc_write_to_an_exited_peer_is_a_typed_error() {
    let Some(_) = gpus("ipc_write_to_an_exited_peer_is_a_typed_error", 1) else {
        return;
    };
    let dead = Kid::spawn("dead", "same-layout", 0);
    let desc = EndpointDesc::from_hex(&dead.expect_line(&["DESC "])[5..]).expect("desc");
    let mut kid = dead;
    let _ = kid.child.wait();
    let mut transport = CudaIpcTransport::open(CudaIpcConfig::new(0)).expect("open");
    let gpu = Arc::clone(transport.gpu());
    let src = Arc::new(DeviceBuffer::new(&gpu, 1 << 20).expect("alloc"));
    transport
        .register(LocalRegion::cuda(0, src))
        .expect("register");
    // The peer is gone: either connecting fails, or the first write reports it.
    let Ok(peer) = transport.connect(&desc) else {
        return;
    };
    let op = CopyOp::run(Rank(0), (0, 0), (0, 0), 4096);
    transport
        .write(peer, &[op], Some(Notice(1)))
        .expect("accepted");
    let event = wait_for(&mut transport, |e| {
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

#[test]
fn ipc_refuses_out_of_bounds_and_foreign_memory() {
    let Some(_) = gpus("ipc_refuses_out_of_bounds_and_foreign_memory", 1) else {
        return;
    };
    let mut a = CudaIpcTransport::open(CudaIpcConfig::new(0)).expect("open");
    let mut b = CudaIpcTransport::open(CudaIpcConfig::new(0)).expect("open");
    let gpu = Arc::clone(a.gpu());
    let src = Arc::new(DeviceBuffer::new(&gpu, 1 << 20).expect("alloc"));
    src.fill_with(|i| (i % 253) as u8).expect("fill");
    let dst = Arc::new(DeviceBuffer::new(&gpu, 1 << 20).expect("alloc"));
    a.register(LocalRegion::cuda(0, Arc::clone(&src)))
        .expect("register");
    b.register(LocalRegion::cuda(0, Arc::clone(&dst)))
        .expect("register");
    let host = Arc::new(kvx_rdma::HostBuffer::new(4096).expect("host"));
    assert!(
        a.register(LocalRegion::host(1, host)).is_err(),
        "host memory"
    );
    // Two endpoints of one process reach each other directly (no IPC handle needed).
    let peer = a.connect(&b.local_desc()).expect("connect");
    let op = CopyOp::run(Rank(0), (0, 4096), (0, (1 << 20) - 8192), 8192);
    assert!(a
        .write(
            peer,
            &[CopyOp {
                dst_offset: (1 << 20) - 4096,
                ..op
            }],
            None
        )
        .is_err());
    assert!(a
        .write(
            peer,
            &[CopyOp {
                dst_region: 5,
                ..op
            }],
            None
        )
        .is_err());
    a.write(peer, &[op], Some(Notice(9))).expect("write");
    wait_for(&mut a, |e| matches!(e, Event::WriteDone { .. }));
    assert!(matches!(
        wait_for(&mut b, |e| matches!(e, Event::Notice(_))),
        Event::Notice(Notice(9))
    ));
    let got = dst.to_vec().expect("read back");
    let want = src.to_vec().expect("read back");
    assert_eq!(got[(1 << 20) - 8192..], want[4096..4096 + 8192]);
    assert!(got[..(1 << 20) - 8192].iter().all(|&b| b == 0));
}

/// A copy in flight when its peer is disconnected still ends and delivers its notice (the
/// peer's streams are synchronised before its mappings close); the old id is refused, and a
/// new connection works.
#[test]
fn ipc_a_disconnected_peer_is_refused_and_a_new_connection_works() {
    let Some(_) = gpus(
        "ipc_a_disconnected_peer_is_refused_and_a_new_connection_works",
        1,
    ) else {
        return;
    };
    let mut a = CudaIpcTransport::open(CudaIpcConfig::new(0)).expect("open");
    let mut b = CudaIpcTransport::open(CudaIpcConfig::new(0)).expect("open");
    let gpu = Arc::clone(a.gpu());
    let len = 64 << 20;
    let src = Arc::new(DeviceBuffer::new(&gpu, len).expect("alloc"));
    src.fill_with(|i| (i % 251) as u8).expect("fill");
    let dst = Arc::new(DeviceBuffer::new(&gpu, len).expect("alloc"));
    a.register(LocalRegion::cuda(0, Arc::clone(&src)))
        .expect("register");
    b.register(LocalRegion::cuda(0, Arc::clone(&dst)))
        .expect("register");
    let op = CopyOp::run(Rank(0), (0, 0), (0, 0), len);
    let first = a.connect(&b.local_desc()).expect("connect");
    a.write(first, &[op], Some(Notice(7))).expect("write");
    a.disconnect(first);
    assert!(matches!(
        a.write(first, &[op], None),
        Err(kvx_rdma::WriteError::UnknownPeer(_))
    ));
    wait_for(&mut a, |e| matches!(e, Event::WriteDone { .. }));
    assert!(matches!(
        wait_for(&mut b, |e| matches!(e, Event::Notice(_))),
        Event::Notice(Notice(7))
    ));
    assert_eq!(
        dst.to_vec().expect("read back"),
        src.to_vec().expect("read back")
    );
    let again = a.connect(&b.local_desc()).expect("connect again");
    assert_ne!(again, first);
    a.write(again, &[op], Some(Notice(8))).expect("write again");
    wait_for(&mut a, |e| matches!(e, Event::WriteDone { .. }));
    assert!(matches!(
        wait_for(&mut b, |e| matches!(e, Event::Notice(_))),
        Event::Notice(Notice(8))
    ));
}

/// Random permute chunks on the GPU against `Permute::apply`.
#[test]
fn permute_kernels_match_the_cpu_reference() {
    let Some(_) = gpus("permute_kernels_match_the_cpu_reference", 1) else {
        return;
    };
    let gpu = Gpu::open(0).expect("gpu");
    let mut kernels = match LayoutKernels::new(&gpu) {
        Ok(k) => k,
        Err(CudaError::NvrtcMissing) => {
            eprintln!("SKIPPED permute kernels: NVRTC is not installed");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let mut rng = 0x1234_5678_u64;
    let mut next = |m: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % m
    };
    // Head sizes for every vector width (16, 4 and 1 byte), chunks past one block's shared
    // memory (the cluster path on Hopper: 1 MiB over 8 blocks, 256 KiB over 2; the scratch path
    // elsewhere, and for 5 heads, which no cluster splits), and partial blocks.
    for (head_bytes, block_tokens, heads) in [
        (256, 16, 8),
        (128, 64, 4),
        (12, 16, 3),
        (7, 8, 5),
        (256, 512, 8),
        (256, 128, 8),
        (16, 4096, 5),
    ] {
        let chunk = u64::from(block_tokens) * u64::from(heads) * head_bytes;
        let chunks = 24u64;
        let region = Arc::new(DeviceBuffer::new(&gpu, chunk * chunks + 4096).expect("alloc"));
        let original: Vec<u8> = (0..region.len()).map(|_| next(256) as u8).collect();
        region.write_at(0, &original).expect("upload");
        let mut permutes = Vec::new();
        for c in 0..chunks {
            if next(3) == 0 {
                continue; // chunks left alone must stay untouched
            }
            let first_slot = if next(2) == 0 {
                0
            } else {
                next(u64::from(block_tokens)) as u32
            };
            let slots = 1 + next(u64::from(block_tokens - first_slot)) as u32;
            let (from, to) = if next(2) == 0 {
                (MemoryOrder::Hnd, MemoryOrder::Nhd)
            } else {
                (MemoryOrder::Nhd, MemoryOrder::Hnd)
            };
            permutes.push(Permute {
                region: 0,
                offset: c * chunk,
                from,
                to,
                block_tokens,
                first_slot,
                slots,
                heads,
                head_bytes,
            });
        }
        let lookup = |r: u32| (r == 0).then(|| (region.device_ptr(), region.len()));
        // SAFETY: the region is a live device buffer, idle until the queue is synced.
        unsafe { kernels.permute(&permutes, &lookup) }.expect("permute");
        kernels.synchronize().expect("ran");
        let mut expected = original.clone();
        let mut scratch = Vec::new();
        for p in &permutes {
            p.apply(&mut expected[p.offset as usize..], &mut scratch);
        }
        assert!(
            region.to_vec().expect("read back") == expected,
            "permute mismatch for head {head_bytes} B, block {block_tokens}, {heads} heads"
        );
        // A chunk outside the region is refused before anything runs.
        let outside = Permute {
            offset: region.len() - chunk / 2,
            ..permutes[0]
        };
        // SAFETY: as above; the call must fail before launching anything.
        assert!(unsafe { kernels.permute(&[outside], &lookup) }.is_err());
    }
}

/// The batched-copy kernel on random strided operations against a CPU model.
#[test]
fn batched_copy_kernel_matches_the_cpu_model() {
    let Some(_) = gpus("batched_copy_kernel_matches_the_cpu_model", 1) else {
        return;
    };
    let gpu = Gpu::open(0).expect("gpu");
    let mut kernels = match LayoutKernels::new(&gpu) {
        Ok(k) => k,
        Err(CudaError::NvrtcMissing) => {
            eprintln!("SKIPPED batched copy: NVRTC is not installed");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    const LEN: u64 = 8 << 20;
    let src = Arc::new(DeviceBuffer::new(&gpu, LEN).expect("alloc"));
    let dst = Arc::new(DeviceBuffer::new(&gpu, LEN).expect("alloc"));
    src.fill_with(|i| (i.wrapping_mul(31) >> 3) as u8)
        .expect("fill");
    let source = src.to_vec().expect("read");
    // Non-overlapping destinations: op k writes inside its own 512 KiB window.
    let mut ops = Vec::new();
    for k in 0..16u64 {
        let len = [1, 7, 16, 100, 4096, 65_536][k as usize % 6];
        let count = 1 + (k * 5) % 7;
        let dst_stride = len + (k % 3) * 16;
        ops.push(CopyOp {
            producer: Rank(0),
            src_region: 0,
            src_offset: k * 300_001 % (LEN / 2),
            dst_region: 1,
            dst_offset: k * (512 << 10) + k,
            len,
            count,
            src_stride: len + k,
            dst_stride,
        });
    }
    let lookup = |r: u32| match r {
        0 => Some((src.device_ptr(), src.len())),
        1 => Some((dst.device_ptr(), dst.len())),
        _ => None,
    };
    // SAFETY: both buffers are live and idle until the queue is synced.
    unsafe { kernels.copy_ops(&ops, &lookup, &lookup) }.expect("copy");
    kernels.synchronize().expect("ran");
    let mut expected = vec![0u8; LEN as usize];
    for op in &ops {
        for (s, d, len) in op.pieces() {
            expected[d as usize..(d + len) as usize]
                .copy_from_slice(&source[s as usize..(s + len) as usize]);
        }
    }
    assert!(
        dst.to_vec().expect("read") == expected,
        "batched copy mismatch"
    );
    let too_far = CopyOp {
        dst_offset: LEN - 10,
        ..ops[4]
    };
    // SAFETY: as above; refused before launching.
    assert!(unsafe { kernels.copy_ops(&[too_far], &lookup, &lookup) }.is_err());
}

/// The device's synthetic KV is the CPU's, byte for byte, in every memory order the kernels
/// take, and its check finds a single wrong byte.
#[test]
fn synthetic_kv_on_the_gpu_matches_the_cpu_pattern() {
    use kvx_rdma::cuda::synth::SynthKv;
    use kvx_rdma::cuda::Stream;
    let Some(_) = gpus("synthetic_kv_on_the_gpu_matches_the_cpu_pattern", 1) else {
        return;
    };
    let gpu = Gpu::open(0).expect("gpu");
    for (order, tp, rank, block) in [
        (MemoryOrder::Hnd, 1, 0, 16),
        (MemoryOrder::Nhd, 2, 1, 32),
        (MemoryOrder::Hnd, 4, 2, 64),
    ] {
        let layout = layout(tp, rank, block, order);
        let regions = alloc_regions(&gpu, &layout);
        let stream = Stream::new(&gpu).expect("stream");
        let mut synth = match SynthKv::new(&layout, regions.clone()) {
            Ok(s) => s,
            Err(CudaError::NvrtcMissing) => {
                eprintln!("SKIPPED synthetic KV kernels: NVRTC is not installed");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let tokens = 300;
        let ids = blocks(&layout, tokens);
        synth.load_blocks(&stream, &ids).expect("blocks");
        // Layer by layer and in two token ranges, as a chunked, layer-wise engine writes.
        for layer in 0..layout.spec().num_layers {
            synth
                .fill(&stream, 0..200, layer..layer + 1, SEED)
                .expect("fill");
        }
        synth
            .fill(&stream, 200..tokens, 0..layout.spec().num_layers, SEED)
            .expect("fill");
        stream.synchronize().expect("sync");
        // The CPU's check of the GPU's bytes.
        let mut host: Vec<Vec<u8>> = regions.iter().map(|r| r.to_vec().expect("read")).collect();
        let views: Vec<&[u8]> = host.iter().map(Vec::as_slice).collect();
        synth::verify_request(&layout, &views, &ids, 0, tokens, SEED)
            .unwrap_or_else(|m| panic!("{order:?} tp {tp}: {m}"));
        assert_eq!(synth.verify(&stream, tokens, SEED).expect("verify"), 0);
        assert!(synth.verify(&stream, tokens, SEED + 1).expect("verify") > 0);
        // The GPU's check of the CPU's bytes, and of one wrong byte.
        for h in &mut host {
            h.fill(0);
        }
        {
            let mut views: Vec<&mut [u8]> = host.iter_mut().map(Vec::as_mut_slice).collect();
            synth::fill_request(&layout, &mut views, &ids, tokens, SEED + 7);
        }
        for (r, h) in regions.iter().zip(&host) {
            r.write_at(0, h).expect("write");
        }
        assert_eq!(synth.verify(&stream, tokens, SEED + 7).expect("verify"), 0);
        let (region, offset) = layout.head_vector(3, 1, ids[ids.len() - 1], 2, 0);
        let mut byte = [0u8];
        regions[region as usize]
            .read_at(offset + 9, &mut byte)
            .expect("read");
        regions[region as usize]
            .write_at(offset + 9, &[byte[0] ^ 0x40])
            .expect("write");
        assert_eq!(synth.verify(&stream, tokens, SEED + 7).expect("verify"), 1);
        // Block ids past the cache, and tokens past the loaded blocks, are refused.
        let past = BlockId(layout.spec().num_blocks);
        assert!(matches!(
            synth.load_blocks(&stream, &[past]),
            Err(CudaError::Invalid(_))
        ));
        assert!(matches!(
            synth.fill(&stream, 0..tokens + 1000, 0..1, SEED),
            Err(CudaError::Invalid(_))
        ));
    }
}

/// cuBLAS products through `gemm::Blas` match a CPU product (small integers are exact in bf16),
/// batched with a shared operand too; operands past their buffers are refused.
#[cfg(feature = "cublas")]
#[test]
fn bf16_products_match_the_cpu() {
    use kvx_rdma::cuda::gemm::{Blas, Operand};
    use kvx_rdma::cuda::Stream;
    let Some(_) = gpus("bf16_products_match_the_cpu", 1) else {
        return;
    };
    let gpu = Gpu::open(0).expect("gpu");
    let stream = Stream::new(&gpu).expect("stream");
    let blas = match Blas::new(&stream) {
        Ok(b) => b,
        Err(e) if std::env::var_os("KVX_REQUIRE_GPU").is_none() => {
            eprintln!("SKIPPED bf16 products: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let bf16 = |v: f32| ((v.to_bits() >> 16) as u16).to_le_bytes();
    let from_bf16 = |b: &[u8]| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
    let (m, n, k, batch) = (5u64, 7u64, 3u64, 2u64);
    let a: Vec<f32> = (0..batch * m * k).map(|i| (i % 5) as f32 - 2.0).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 3) as f32).collect();
    let upload = |v: &[f32]| {
        let bytes: Vec<u8> = v.iter().flat_map(|&x| bf16(x)).collect();
        let buf = DeviceBuffer::new(&gpu, bytes.len() as u64).expect("alloc");
        buf.write_at(0, &bytes).expect("write");
        buf
    };
    let (da, db) = (upload(&a), upload(&b));
    let dc = DeviceBuffer::new(&gpu, batch * m * n * 2).expect("alloc");
    blas.matmul(
        (m, n, k),
        batch,
        Operand::batched(&da, m * k),
        Operand::whole(&db),
        Operand::batched(&dc, m * n),
    )
    .expect("matmul");
    stream.synchronize().expect("sync");
    let c = dc.to_vec().expect("read");
    for p in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k)
                    .map(|x| a[(p * m * k + i * k + x) as usize] * b[(x * n + j) as usize])
                    .sum();
                let at = ((p * m * n + i * n + j) * 2) as usize;
                assert_eq!(from_bf16(&c[at..at + 2]), want, "batch {p} ({i},{j})");
            }
        }
    }
    let err = blas
        .matmul(
            (m, n, k),
            batch + 1,
            Operand::batched(&da, m * k),
            Operand::whole(&db),
            Operand::batched(&dc, m * n),
        )
        .unwrap_err();
    assert!(matches!(err, CudaError::Invalid(_)), "{err}");
}
