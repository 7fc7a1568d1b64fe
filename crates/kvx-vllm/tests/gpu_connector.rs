//! The connector with the KV cache in GPU memory, over CUDA IPC and over NIXL (`VRAM`; UCX's
//! `cuda_ipc` within the host): two prefill ranks (TP2, HND, 16-token blocks) push into one
//! decode rank (TP1, NHD, 32-token blocks), so the consumer re-lays-out the chunks with the GPU
//! kernels before it reports the request ready; then every byte is verified. Without a CUDA
//! driver the tests say that they were skipped (with `KVX_REQUIRE_GPU=1` they fail instead);
//! the NIXL one also without a NIXL runtime (`KVX_NIXL_LIB_DIR`).
#![cfg(feature = "cuda")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{
    Arrangement, Attempt, BlockId, Dtype, EngineId, LayoutSpec, MemoryOrder, RequestId, TransferId,
};
use kvx_layout::synth::{fill_request, verify_request};
use kvx_layout::Layout;
use kvx_rdma::cuda::{device_count, DeviceBuffer, Gpu};
use kvx_rdma::LocalRegion;
use kvx_rendezvous::AttemptKey;
use kvx_vllm::{
    ConnectorConfig, Consumer, KvCache, OpenOptions, Producer, PushRequest, RecvEvent, SendOutcome,
    TransportSpec,
};

const SEED: u64 = 0x6770_7573;

fn spec(tp: u32, rank: u32, block_tokens: u32, order: MemoryOrder) -> LayoutSpec {
    LayoutSpec {
        num_layers: 4,
        total_kv_heads: 8,
        head_dim: 128,
        dtype: Dtype::Bf16,
        mla: false,
        block_tokens,
        num_blocks: 128,
        tp_size: tp,
        tp_rank: rank,
        order,
        arrangement: Arrangement::PerLayerSplit,
    }
}

struct Side {
    layout: Layout,
    buffers: Vec<Arc<DeviceBuffer>>,
}

impl Side {
    fn new(gpu: &Arc<Gpu>, spec: LayoutSpec) -> (Self, KvCache) {
        let layout = Layout::new(spec.clone()).expect("layout");
        let buffers: Vec<Arc<DeviceBuffer>> = (0..layout.region_count())
            .map(|_| {
                let b = Arc::new(DeviceBuffer::new(gpu, layout.region_len()).expect("alloc"));
                b.fill_with(|i| (i * 31 % 251) as u8).expect("fill");
                b
            })
            .collect();
        let regions = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| LocalRegion::cuda(i as u32, Arc::clone(b)))
            .collect();
        (
            Self { layout, buffers },
            KvCache {
                layout: spec,
                regions,
            },
        )
    }

    fn host(&self) -> Vec<Vec<u8>> {
        self.buffers
            .iter()
            .map(|b| b.to_vec().expect("read back"))
            .collect()
    }
}

/// Two consecutive free loopback ports (the producer's control address and the next).
fn free_port() -> SocketAddr {
    kvx_testkit::free_ports(2)
}

#[test]
fn push_tp2_into_tp1_on_the_gpu_with_relayout_and_streaming() {
    push_tp2_into_tp1(
        "push_tp2_into_tp1_on_the_gpu_with_relayout_and_streaming",
        "cuda-ipc",
    );
}

#[cfg(feature = "nixl")]
#[test]
fn push_tp2_into_tp1_over_nixl_vram_with_relayout_and_streaming() {
    let test = "push_tp2_into_tp1_over_nixl_vram_with_relayout_and_streaming";
    if std::env::var_os(kvx_vllm::transport::NIXL_LIB_DIR_ENV).is_none() {
        eprintln!("SKIPPED {test}: KVX_NIXL_LIB_DIR is unset (no NIXL runtime)");
        return;
    }
    push_tp2_into_tp1(test, "nixl");
}

/// Opens `transport` for a cache on `gpu`, as the plugin does.
fn open(transport: &str, gpu: &Gpu) -> Box<dyn kvx_rdma::Transport> {
    let name = kvx_vllm::resolve_for_cache(transport, Some(gpu.ordinal())).expect("resolves");
    let spec: TransportSpec = name.parse().expect("a transport name");
    let options = OpenOptions::default()
        .for_cuda_device(Some(gpu.ordinal()))
        .with_nixl_library(std::env::var_os(kvx_vllm::transport::NIXL_LIB_DIR_ENV).map(Into::into));
    spec.open_with(&options).expect("open")
}

fn push_tp2_into_tp1(test: &str, transport: &str) {
    let n = match device_count() {
        Ok(n) if n > 0 => n,
        other => {
            assert!(
                std::env::var_os("KVX_REQUIRE_GPU").is_none(),
                "KVX_REQUIRE_GPU is set but CUDA is unusable: {other:?}"
            );
            eprintln!("SKIPPED {test}: {other:?}");
            return;
        }
    };
    let gpu = Gpu::open(n - 1).expect("gpu");
    let tokens = 300u64;
    let base = free_port();
    let mut sides = Vec::new();
    let mut producers = Vec::new();
    let p_blocks: Vec<BlockId> = (0..tokens.div_ceil(16) as u32)
        .map(|i| BlockId(3 + i * 2))
        .collect();
    for rank in 0..2 {
        let (side, cache) = Side::new(&gpu, spec(2, rank, 16, MemoryOrder::Hnd));
        let mut host = side.host();
        {
            let mut views: Vec<&mut [u8]> = host.iter_mut().map(Vec::as_mut_slice).collect();
            fill_request(&side.layout, &mut views, &p_blocks, tokens, SEED);
        }
        for (b, h) in side.buffers.iter().zip(&host) {
            b.write_at(0, h).expect("upload");
        }
        let mut config = ConnectorConfig::new(EngineId(1));
        config.listen = SocketAddr::from(([127, 0, 0, 1], base.port() + rank as u16));
        producers.push(Producer::start(config, cache, open(transport, &gpu)).expect("producer"));
        sides.push(side);
    }
    let (decode, cache) = Side::new(&gpu, spec(1, 0, 32, MemoryOrder::Nhd));
    let consumer = Consumer::start(
        ConnectorConfig::new(EngineId(2)),
        cache,
        open(transport, &gpu),
    )
    .expect("consumer");
    let c_blocks: Vec<BlockId> = (0..tokens.div_ceil(32) as u32)
        .map(|i| BlockId(60 - i))
        .collect();
    let key = AttemptKey::new(TransferId(4242), Attempt(0));
    consumer
        .request_allocated(PushRequest {
            groups: Vec::new(),
            key,
            request: RequestId(5),
            prefill: base,
            num_tokens: tokens,
            skip_tokens: 0,
            blocks: c_blocks.clone(),
            capability: None,
            trace: None,
        })
        .expect("registration");
    // Chunked prefill: 200 of the 300 tokens are computed first; the whole 32-token blocks of
    // both sides among them (192 tokens) are written before the request finishes.
    std::thread::sleep(Duration::from_millis(50));
    for p in &producers {
        p.request_progress(key, p_blocks[..13].to_vec(), 200)
            .expect("progress");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while producers.iter().any(|p| p.stats().bytes_streamed == 0) {
        assert!(Instant::now() < deadline, "no early write in time");
        std::thread::sleep(Duration::from_millis(2));
    }
    // The last step, layer by layer: layers 0 and 1 of tokens up to 288 (the last whole block
    // before the last token) go before the finish too.
    for p in &producers {
        p.request_layer_progress(key, p_blocks.clone(), tokens, 2)
            .expect("layer progress");
    }
    // One rank's bytes of one token (each holds half of the heads).
    let l = &sides[0].layout;
    let per_token =
        l.head_bytes() * u64::from(l.local_heads() * l.kv_parts() * l.spec().num_layers);
    let deadline = Instant::now() + Duration::from_secs(60);
    while producers
        .iter()
        .any(|p| p.stats().bytes_streamed < per_token * (192 + 96 / 2))
    {
        assert!(
            Instant::now() < deadline,
            "no layer-wise early write in time"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    for p in &producers {
        p.request_finished(key, RequestId(9), p_blocks.clone(), tokens)
            .expect("finished");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut events = Vec::new();
    while events.is_empty() {
        events.extend(consumer.take_events());
        assert!(Instant::now() < deadline, "no event in time");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(
        events,
        vec![RecvEvent::Ready {
            key,
            request: RequestId(5)
        }]
    );
    let host = decode.host();
    let views: Vec<&[u8]> = host.iter().map(Vec::as_slice).collect();
    verify_request(&decode.layout, &views, &c_blocks, 0, tokens, SEED).expect("every byte");
    for p in &producers {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut done = Vec::new();
        while done.is_empty() {
            done.extend(p.take_finished());
            assert!(Instant::now() < deadline, "blocks not released");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(done[0].outcome, SendOutcome::Sent);
        // Each rank wrote its half of every token once: 192 tokens of them early, and 96 more
        // in two of the four layers.
        let stats = p.stats();
        assert_eq!(stats.bytes_written % tokens, 0, "{stats:?}");
        assert_eq!(
            stats.bytes_streamed,
            stats.bytes_written / tokens * (192 + 96 / 2),
            "{stats:?}"
        );
    }
}
