//! The NIXL backend with CUDA memory (`VRAM` registrations): a producer process writes a
//! multi-layer KV plan from its GPU memory into a consumer process's GPU memory through NIXL's
//! UCX backend (which moves device memory with its CUDA transports), the consumer verifies every
//! byte when the notice arrives, then reads a range back (pull). With two GPUs the consumer runs
//! on GPU 1. Needs a CUDA driver and a NIXL runtime (`$KVX_NIXL_LIB_DIR`): without either the test
//! says it was skipped and why; `KVX_REQUIRE_GPU=1` makes a missing GPU a failure.
#![cfg(all(feature = "nixl", feature = "cuda"))]

use std::io::{BufRead, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{Arrangement, BlockId, Dtype, LayoutSpec, MemoryKind, MemoryOrder};
use kvx_layout::{synth, Layout, PlanRequest};
use kvx_rdma::cuda::{DeviceBuffer, Gpu};
use kvx_rdma::nixl::{runtime, NixlConfig, NixlTransport, LIB_DIR_ENV};
use kvx_rdma::{EndpointDesc, Event, LocalRegion, Notice, Transport};

#[path = "support/gpus.rs"]
mod support;
use support::gpus;

const ROLE: &str = "KVX_GPU_NIXL_ROLE";
const SEED: u64 = 0x6e69_786c_7672_616d;
const NOTICE: u64 = 0x7672_616d;
const TOKENS: u64 = 600;
const DEADLINE: Duration = Duration::from_secs(60);

/// Both sides' layouts: different block sizes, so the plan is many strided pieces.
fn layout(producer: bool) -> Layout {
    Layout::new(LayoutSpec {
        num_layers: 3,
        total_kv_heads: 4,
        head_dim: 64,
        dtype: Dtype::Bf16,
        mla: false,
        block_tokens: if producer { 16 } else { 32 },
        num_blocks: 64,
        tp_size: 1,
        tp_rank: 0,
        order: MemoryOrder::Hnd,
        arrangement: if producer {
            Arrangement::PerLayerSplit
        } else {
            Arrangement::PerLayerKvHalves
        },
    })
    .expect("layout")
}

fn blocks(producer: bool) -> Vec<BlockId> {
    let (bt, scatter) = if producer { (16, 7) } else { (32, 5) };
    let n = TOKENS.div_ceil(bt) as u32;
    (0..n).map(|i| BlockId((i * scatter) % 64)).collect()
}

/// The producer's memory, as the host sees it: a background pattern with the request's KV on
/// top. Both processes compute it (the consumer checks its read-back against it).
fn producer_memory() -> Vec<Vec<u8>> {
    let producer = layout(true);
    let mut memory: Vec<Vec<u8>> = (0..producer.region_count())
        .map(|r| {
            (0..producer.region_len())
                .map(|i| ((i + u64::from(r)) % 251) as u8)
                .collect()
        })
        .collect();
    let mut views: Vec<&mut [u8]> = memory.iter_mut().map(Vec::as_mut_slice).collect();
    synth::fill_request(&producer, &mut views, &blocks(true), TOKENS, SEED);
    memory
}

fn config() -> NixlConfig {
    let mut config = NixlConfig::ucx().with_device_memory();
    config.library = lib_dir();
    config.op_timeout = Duration::from_secs(20);
    config
}

/// The number of GPUs, or `None` after saying why the test is skipped.
fn ready(test: &str) -> Option<u32> {
    let gpus = gpus(test, 1)?;
    if runtime::locate(lib_dir().as_deref()).is_none() {
        eprintln!(
            "SKIPPED {test}: no NIXL runtime: {LIB_DIR_ENV} is unset or does not hold \
             libnixl_capi.so"
        );
        return None;
    }
    Some(gpus)
}

/// Device buffers for `layout`'s regions on `gpu`, registered with `transport` as CUDA memory.
fn device_regions(
    transport: &mut NixlTransport,
    gpu: &Arc<Gpu>,
    layout: &Layout,
) -> Vec<Arc<DeviceBuffer>> {
    (0..layout.region_count())
        .map(|index| {
            let buffer = Arc::new(DeviceBuffer::new(gpu, layout.region_len()).expect("alloc"));
            let desc = transport
                .register(LocalRegion::cuda(index, Arc::clone(&buffer)))
                .expect("register VRAM");
            assert_eq!(
                desc.kind,
                MemoryKind::Cuda {
                    device: gpu.ordinal()
                }
            );
            buffer
        })
        .collect()
}

fn host_copy(buffers: &[Arc<DeviceBuffer>]) -> Vec<Vec<u8>> {
    buffers
        .iter()
        .map(|b| b.to_vec().expect("read back"))
        .collect()
}

/// The consumer process: registers GPU memory, prints its description, verifies the plan's bytes
/// once the notice arrives, reads a range of the producer's memory back and checks it.
#[test]
#[ignore = "child role of the GPU NIXL test; started by it"]
fn child_role() {
    let Ok(device) = std::env::var(ROLE) else {
        return;
    };
    let gpu = Gpu::open(device.parse().expect("device")).expect("open GPU");
    let consumer = layout(false);
    let mut transport = NixlTransport::open(&config()).expect("open NIXL");
    let buffers = device_regions(&mut transport, &gpu, &consumer);
    println!("DESC {}", transport.local_desc().to_hex());
    std::io::stdout().flush().expect("flush");
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .expect("producer description");
    let producer_desc = EndpointDesc::from_hex(line.trim()).expect("producer description");
    let peer = transport
        .connect(&producer_desc)
        .expect("connect to the producer");

    let deadline = Instant::now() + DEADLINE;
    let mut events = Vec::new();
    while !events
        .iter()
        .any(|e| matches!(e, Event::Notice(Notice(NOTICE))))
    {
        assert!(Instant::now() < deadline, "no notice: {events:?}");
        transport
            .wait(&mut events, Duration::from_millis(50))
            .expect("wait");
    }
    let memory = host_copy(&buffers);
    let views: Vec<&[u8]> = memory.iter().map(Vec::as_slice).collect();
    synth::verify_request(&consumer, &views, &blocks(false), 0, TOKENS, SEED)
        .expect("every byte of the plan in GPU memory");

    // Pull: read all of producer region 1 into a fresh device buffer.
    let len = layout(true).region_len();
    let back = Arc::new(DeviceBuffer::new(&gpu, len).expect("alloc"));
    transport
        .register(LocalRegion::cuda(99, Arc::clone(&back)))
        .expect("register");
    let read = transport
        .read(
            peer,
            &[kvx_layout::CopyOp::run(
                kvx_core::Rank(0),
                (1, 0),
                (99, 0),
                len,
            )],
        )
        .expect("post the read");
    let mut events = Vec::new();
    loop {
        assert!(Instant::now() < deadline, "read never finished: {events:?}");
        transport
            .wait(&mut events, Duration::from_millis(50))
            .expect("wait");
        let outcome = events.iter().find(
            |e| matches!(e, Event::ReadDone { op, .. } | Event::Failed { op, .. } if *op == read),
        );
        if let Some(e) = outcome {
            assert!(matches!(e, Event::ReadDone { .. }), "read failed: {e:?}");
            break;
        }
    }
    assert!(
        back.to_vec().expect("read back") == producer_memory()[1],
        "the bytes read back differ from the producer's region 1"
    );
    println!("OK");
    std::io::stdout().flush().expect("flush");
}

#[test]
fn nixl_moves_gpu_memory_between_processes() {
    let Some(gpus) = ready("nixl_moves_gpu_memory_between_processes") else {
        return;
    };
    let consumer_device = u32::from(gpus > 1);
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--ignored", "--exact", "child_role", "--nocapture"])
        .env(ROLE, consumer_device.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the consumer");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let consumer_desc = loop {
        let line = lines.next().expect("consumer output").expect("line");
        if let Some(at) = line.find("DESC ") {
            break EndpointDesc::from_hex(&line[at + 5..]).expect("consumer description");
        }
    };
    assert!(consumer_desc.regions.iter().all(|r| r.kind
        == MemoryKind::Cuda {
            device: consumer_device
        }));

    let gpu = Gpu::open(0).expect("open GPU 0");
    let producer = layout(true);
    let mut transport = NixlTransport::open(&config()).expect("open NIXL");
    let buffers = device_regions(&mut transport, &gpu, &producer);
    for (buffer, bytes) in buffers.iter().zip(producer_memory()) {
        buffer.write_at(0, &bytes).expect("upload");
    }
    let pblocks = blocks(true);
    let peer = transport.connect(&consumer_desc).expect("connect");
    let mut stdin = child.stdin.take().expect("stdin");
    writeln!(stdin, "{}", transport.local_desc().to_hex()).expect("send description");
    let consumer = layout(false);
    let planned = kvx_layout::plan(&PlanRequest {
        producers: std::slice::from_ref(&producer),
        consumer: &consumer,
        num_tokens: TOKENS,
        skip_tokens: 0,
        producer_blocks: &pblocks,
        consumer_blocks: &blocks(false),
        only_producer: None,
        producer_groups: &[],
        consumer_groups: &[],
    })
    .expect("plan");
    let op = transport
        .write(peer, planned.ops(), Some(Notice(NOTICE)))
        .expect("post the writes");
    let deadline = Instant::now() + DEADLINE;
    let mut events = Vec::new();
    loop {
        assert!(
            Instant::now() < deadline,
            "write never finished: {events:?}"
        );
        transport
            .wait(&mut events, Duration::from_millis(50))
            .expect("wait");
        let outcome = events.iter().find(|e| {
            matches!(e, Event::WriteDone { op: o, .. } | Event::Failed { op: o, .. } if *o == op)
        });
        if let Some(e) = outcome {
            assert!(matches!(e, Event::WriteDone { .. }), "write failed: {e:?}");
            break;
        }
    }
    // Serve the consumer's read until it reports.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            if line.contains("OK") {
                let _ = tx.send(());
            }
        }
    });
    let verdict = loop {
        if rx.try_recv().is_ok() {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        let mut events = Vec::new();
        let _ = transport.wait(&mut events, Duration::from_millis(20));
        if let Ok(Some(status)) = child.try_wait() {
            // The reader thread may still be passing the child's last line on.
            break rx.recv_timeout(Duration::from_secs(5)).is_ok() && status.success();
        }
    };
    drop(stdin);
    let status = child.wait().expect("consumer exit");
    assert!(
        verdict && status.success(),
        "the consumer failed ({status})"
    );
}

/// NIXL takes one memory type per descriptor list: a transfer whose local side mixes host and GPU
/// memory is refused with a typed error before anything moves (two agents in this process).
#[test]
fn a_transfer_mixing_host_and_gpu_memory_on_one_side_is_refused() {
    if ready("a_transfer_mixing_host_and_gpu_memory_on_one_side_is_refused").is_none() {
        return;
    }
    let gpu = Gpu::open(0).expect("open GPU 0");
    let mut a = NixlTransport::open(&config()).expect("open NIXL");
    let mut b = NixlTransport::open(&config()).expect("open NIXL");
    let host = Arc::new(kvx_rdma::HostBuffer::new(1 << 16).expect("host buffer"));
    let device = Arc::new(DeviceBuffer::new(&gpu, 1 << 16).expect("device buffer"));
    a.register(LocalRegion::host(0, Arc::clone(&host)))
        .expect("register host");
    a.register(LocalRegion::cuda(1, Arc::clone(&device)))
        .expect("register VRAM");
    let target = Arc::new(kvx_rdma::HostBuffer::new(1 << 17).expect("host buffer"));
    b.register(LocalRegion::host(0, Arc::clone(&target)))
        .expect("register host");
    let peer = a.connect(&b.local_desc()).expect("connect");
    let op = |src_region, dst_offset| {
        kvx_layout::CopyOp::run(kvx_core::Rank(0), (src_region, 0), (0, dst_offset), 1 << 16)
    };
    let refused = a.write(peer, &[op(0, 0), op(1, 1 << 16)], Some(Notice(1)));
    let message = match refused {
        Err(kvx_rdma::WriteError::Backend(e)) => e.to_string(),
        other => panic!("expected a typed refusal, got {other:?}"),
    };
    assert!(message.contains("mixes"), "{message}");
    // Each kind alone is fine.
    for (region, offset) in [(0, 0), (1, 1 << 16)] {
        let id = a
            .write(peer, &[op(region, offset)], None)
            .expect("one kind per side");
        let deadline = Instant::now() + DEADLINE;
        let mut events = Vec::new();
        loop {
            assert!(Instant::now() < deadline, "write never finished");
            a.wait(&mut events, Duration::from_millis(20))
                .expect("wait");
            let _ = b.poll(&mut Vec::new());
            if events
                .iter()
                .any(|e| matches!(e, Event::WriteDone { op, .. } if *op == id))
            {
                break;
            }
            assert!(
                !events.iter().any(|e| matches!(e, Event::Failed { .. })),
                "{events:?}"
            );
        }
    }
}

/// The NIXL runtime's directory, from [`LIB_DIR_ENV`] (which `cargo xtask test` sets): tests read
/// the environment, the crate does not.
fn lib_dir() -> Option<std::path::PathBuf> {
    std::env::var_os(LIB_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
}
