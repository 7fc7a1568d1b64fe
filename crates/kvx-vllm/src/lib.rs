//! # kvx-vllm
//!
//! The kvx connector, engine-agnostic: the decode side ([`Consumer`]) registers where a request's
//! KV must land while prefill is still computing; the prefill side ([`Producer`]) matches that
//! registration with the finished request in either order and writes the blocks from a
//! background thread; decode reports the request ready when every producer rank's completion
//! notice has arrived. Pull mode (decode reads after prefill) runs on the same transport for
//! comparison. The vLLM glue sits on top of this API; `docs/connector-api.md` is the contract
//! for any other engine, and `examples/push_pull.rs` drives both sides without vLLM.
//!
//! Engine-facing calls never block on the network; background threads block on a wait object
//! (a socket, a channel, the transport's completion wait) and never spin, and nothing here
//! changes the engine's CPU affinity.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::{Duration, Instant};
//!
//! use kvx_core::{Arrangement, Attempt, BlockId, Dtype, EngineId, LayoutSpec, MemoryOrder, RequestId, TransferId};
//! use kvx_rdma::loopback::LoopbackFabric;
//! use kvx_rdma::region::{HostBuffer, LocalRegion};
//! use kvx_rendezvous::AttemptKey;
//! use kvx_vllm::{Consumer, ConnectorConfig, KvCache, Producer, PushRequest, RecvEvent};
//!
//! let spec = LayoutSpec {
//!     num_layers: 2, total_kv_heads: 2, head_dim: 8, dtype: Dtype::F32, mla: false,
//!     block_tokens: 4, num_blocks: 16, tp_size: 1, tp_rank: 0,
//!     order: MemoryOrder::Nhd, arrangement: Arrangement::CrossLayer,
//! };
//! let cache = |spec: &LayoutSpec| -> Result<KvCache, Box<dyn std::error::Error>> {
//!     let len = 2 * 2 * 4 * 2 * 8 * 4 * 16;
//!     Ok(KvCache { layout: spec.clone(), regions: vec![LocalRegion::host(0, Arc::new(HostBuffer::new(len)?))] })
//! };
//! let fabric = LoopbackFabric::new();
//! let producer = Producer::start(ConnectorConfig::new(EngineId(1)), cache(&spec)?, Box::new(fabric.endpoint()))?;
//! let consumer = Consumer::start(ConnectorConfig::new(EngineId(2)), cache(&spec)?, Box::new(fabric.endpoint()))?;
//!
//! let key = AttemptKey::new(TransferId(9), Attempt::FIRST);
//! consumer.request_allocated(PushRequest {
//!     key, request: RequestId(1), prefill: producer.control_addr(),
//!     num_tokens: 10, skip_tokens: 0, blocks: vec![BlockId(5), BlockId(6), BlockId(7)],
//!     groups: Vec::new(), // a model of one KV cache group
//!     capability: None, // no deployment key here
//!     trace: None,
//! })?;
//! producer.request_finished(key, RequestId(1), vec![BlockId(0), BlockId(1), BlockId(2)], 10)?;
//!
//! let deadline = Instant::now() + Duration::from_secs(10);
//! let ready = loop {
//!     let events = consumer.take_events();
//!     if let Some(e) = events.into_iter().next() { break e; }
//!     assert!(Instant::now() < deadline, "no result");
//!     std::thread::sleep(Duration::from_millis(5));
//! };
//! assert!(matches!(ready, RecvEvent::Ready { .. }));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod cache;
pub mod consumer;
mod control;
mod driver;
pub mod error;
pub mod producer;
#[cfg(feature = "python")]
mod python;
pub mod router;
pub mod settings;
pub use settings::config;
#[cfg(test)]
mod pair_sim;
#[cfg(any(test, feature = "fuzzing"))]
#[cfg_attr(not(test), allow(dead_code))]
mod sim_support;
mod stats;
pub mod trace;
pub mod transport;

pub use cache::KvCache;
pub use config::{ConnectorConfig, QUIESCE_MARGIN};
pub use consumer::{Consumer, PullRequest, PushRequest, RecvEvent};
pub use control::capability::{self, CapabilityError};
pub use control::secure::{AuthKey, AuthKeyError, HandshakeError, NOISE_PATTERN};
pub use control::ControlError;
pub use error::{Closed, StartError};
pub use producer::{FinishedSending, Producer, SendOutcome};
pub use router::RouterError;
pub use settings::{rank_addr, rank_port};
pub use stats::{StatsReader, StatsSnapshot, TransferSample, MAX_TRANSFER_SAMPLES};
pub use transport::{
    resolve_for_cache, CacheTransportError, OpenOptions, TransportError, TransportSpec,
};
