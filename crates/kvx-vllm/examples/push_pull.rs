//! The connector without vLLM: a prefill rank ([`Producer`]) and a decode rank ([`Consumer`])
//! with different block sizes move one request's KV cache push-style, then another pull-style,
//! and decode checks every byte. Any engine drives the connector the same way; see
//! `docs/connector-api.md`.
//!
//! ```sh
//! cargo run -p kvx-vllm --example push_pull                      # in-process loopback
//! cargo run -p kvx-vllm --example push_pull -- libfabric:shm      # a real transport
//! ```

use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{
    Arrangement, Attempt, BlockId, Dtype, EngineId, LayoutSpec, MemoryOrder, RequestId, TransferId,
};
use kvx_layout::synth::{fill_request, verify_request};
use kvx_layout::Layout;
use kvx_rdma::region::{HostBuffer, LocalRegion};
use kvx_rendezvous::AttemptKey;
use kvx_vllm::{
    ConnectorConfig, Consumer, KvCache, Producer, PullRequest, PushRequest, RecvEvent, SendOutcome,
    TransportSpec,
};

/// The pattern's seed: prefill writes it, decode checks it.
const SEED: u64 = 7;

/// One rank's cache: 2 layers, 4 KV heads of 16 f32s, `block_tokens`-token blocks, K and V of a
/// layer in separate regions.
fn spec(block_tokens: u32) -> LayoutSpec {
    LayoutSpec {
        num_layers: 2,
        total_kv_heads: 4,
        head_dim: 16,
        dtype: Dtype::F32,
        mla: false,
        block_tokens,
        num_blocks: 32,
        tp_size: 1,
        tp_rank: 0,
        order: MemoryOrder::Hnd,
        arrangement: Arrangement::PerLayerSplit,
    }
}

/// A rank's cache as the connector gets it, and the engine's handles on its memory.
type CacheAndMemory = (KvCache, Vec<Arc<HostBuffer>>);

/// The engine's cache memory for `spec`: one host buffer per region of the layout.
fn cache(spec: &LayoutSpec) -> Result<CacheAndMemory, Box<dyn Error>> {
    let layout = Layout::new(spec.clone())?;
    let buffers = (0..layout.region_count())
        .map(|_| HostBuffer::new(layout.region_len() as usize).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()?;
    let regions = buffers
        .iter()
        .enumerate()
        .map(|(i, b)| LocalRegion::host(i as u32, Arc::clone(b)))
        .collect();
    let cache = KvCache {
        layout: spec.clone(),
        regions,
    };
    Ok((cache, buffers))
}

/// What the engine does at each step until the request is decided: decode takes the
/// connector's events, prefill frees the blocks the connector gives back.
fn until_decided(
    producer: &Producer,
    consumer: &Consumer,
    key: AttemptKey,
) -> Result<(), Box<dyn Error>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut ready, mut freed) = (false, false);
    while !(ready && freed) {
        if Instant::now() > deadline {
            return Err("the request was not decided within 10 s".into());
        }
        for event in consumer.wait_events(Duration::from_millis(5)) {
            match event {
                RecvEvent::Ready { key: k, .. } if k == key => ready = true,
                RecvEvent::Failed { reason, detail, .. } => {
                    return Err(format!("the KV did not arrive: {reason:?} {detail}").into())
                }
                _ => {}
            }
        }
        for done in producer.take_finished() {
            if done.key == key {
                if done.outcome != SendOutcome::Sent {
                    return Err(format!("prefill could not send: {:?}", done.outcome).into());
                }
                freed = true;
            }
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    let transport: TransportSpec = std::env::args()
        .nth(1)
        .as_deref()
        .unwrap_or("loopback")
        .parse()?;
    // Prefill with 16-token blocks, decode with 8-token blocks: the planner bridges them.
    let (p_spec, d_spec) = (spec(16), spec(8));
    let (p_layout, d_layout) = (Layout::new(p_spec.clone())?, Layout::new(d_spec.clone())?);
    let (p_cache, p_memory) = cache(&p_spec)?;
    let (d_cache, d_memory) = cache(&d_spec)?;
    let producer = Producer::start(
        ConnectorConfig::new(EngineId(1)),
        p_cache,
        transport.open()?,
    )?;
    let consumer = Consumer::start(
        ConnectorConfig::new(EngineId(2)),
        d_cache,
        transport.open()?,
    )?;

    // The engine's view of prefill's memory, to compute into, and decode's, to check.
    let fill = |blocks: &[BlockId], tokens: u64| {
        let mut bytes: Vec<Vec<u8>> = p_memory.iter().map(|b| b.to_vec()).collect();
        let mut views: Vec<&mut [u8]> = bytes.iter_mut().map(Vec::as_mut_slice).collect();
        fill_request(&p_layout, &mut views, blocks, tokens, SEED);
        for (buffer, written) in p_memory.iter().zip(&bytes) {
            buffer.write_at(0, written).expect("in bounds");
        }
    };
    let check = |blocks: &[BlockId], tokens: u64| {
        let bytes: Vec<Vec<u8>> = d_memory.iter().map(|b| b.to_vec()).collect();
        let views: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        verify_request(&d_layout, &views, blocks, 0, tokens, SEED)
    };
    let ids = |r: std::ops::Range<u32>| r.map(BlockId).collect::<Vec<_>>();

    // Push: decode registers where the KV must land while prefill computes; prefill finishes
    // and writes (the two calls may come in either order).
    let key = AttemptKey::new(TransferId(1), Attempt::FIRST);
    let tokens = 40;
    consumer.request_allocated(PushRequest {
        groups: Vec::new(),
        key,
        request: RequestId(10),
        prefill: producer.control_addr(),
        num_tokens: tokens,
        skip_tokens: 0,
        blocks: ids(20..25),
        capability: None,
        trace: None,
    })?;
    fill(&ids(2..5), tokens);
    producer.request_finished(key, RequestId(1), ids(2..5), tokens)?;
    until_decided(&producer, &consumer, key)?;
    check(&ids(20..25), tokens)?;
    println!("push: {tokens} tokens in decode's blocks 20..25, every byte checked");

    // Pull: prefill finishes first and keeps its blocks; the router relays their ids, and
    // decode reads them.
    let key = AttemptKey::new(TransferId(2), Attempt::FIRST);
    let tokens = 30;
    fill(&ids(8..10), tokens);
    producer.request_finished_pull(key, RequestId(2), ids(8..10), tokens)?;
    consumer.pull(PullRequest {
        producer_groups: Vec::new(),
        push: PushRequest {
            groups: Vec::new(),
            key,
            request: RequestId(11),
            prefill: producer.control_addr(),
            num_tokens: tokens,
            skip_tokens: 0,
            blocks: ids(26..30),
            capability: None,
            trace: None,
        },
        producer_blocks: ids(8..10),
    })?;
    until_decided(&producer, &consumer, key)?;
    check(&ids(26..30), tokens)?;
    println!("pull: {tokens} tokens in decode's blocks 26..30, every byte checked");
    Ok(())
}
