//! `kvx pd … --metrics-listen HOST:PORT`: the connector's counters as Prometheus series, read
//! from each rank's live counters when scraped (OpenMetrics text at `/metrics`), labelled by
//! `side` (`prefill`, `decode`) and `rank`.
//!
//! | series | type | what |
//! |---|---|---|
//! | `kvx_held` | gauge | requests whose blocks (prefill) or registrations (decode) are held now |
//! | `kvx_transfers_started_total` | counter | transfers started |
//! | `kvx_transfers_ok_total` | counter | transfers that delivered |
//! | `kvx_transfers_failed_total` | counter | transfers that failed |
//! | `kvx_bytes_written_total` | counter | bytes posted (prefill in push, decode in pull) |
//! | `kvx_bytes_streamed_total` | counter | of those, bytes written while their request computed |
//! | `kvx_router_aborts_total` | counter | routers' aborts handled |
//! | `kvx_released_unconfirmed_total` | counter | failed requests whose blocks went back without every writer's confirmation |
//! | `kvx_handshakes_failed_total` | counter | control connections refused at the handshake (no or another key, no hello in time, another protocol) |
//! | `kvx_idle_closed_total` | counter | control connections closed because their peer said nothing for the idle timeout |
//! | `kvx_handshakes_evicted_total` | counter | control connections dropped while too many handshakes waited |
//! | `kvx_unauthorized_total` | counter | requests, registrations and aborts refused for their capability or peer |
//! | `kvx_ops_posted_total` | counter | transport operations posted (writes, reads) |
//! | `kvx_in_flight` | gauge | transfers in flight now (writes posted and not completed; reads in pull) |
//! | `kvx_requests_failed_total` | counter | requests that ended failed, by `cause` (`lease_expired`, `peer_failed`, …) |
//! | `kvx_rail` | gauge | 1 for each rail (NIC or interface, label `rail`) the rank's transport opened on |
//! | `kvx_transfer_seconds` | histogram | prefill, push: seconds from the post of a transfer's last writes to their completion |
//! | `kvx_transfer_bytes` | histogram | prefill, push: bytes of a transfer's last writes |
//! | `kvx_kv_wait_seconds` | histogram | decode: seconds a request waited for its KV, from its registration (push) or the post of its reads (pull) to ready |
//!
//! The histograms take each rank's samples when scraped (the endpoint is their only reader),
//! with the buckets of vLLM's `vllm:kvx_*` histograms.

use std::net::SocketAddr;

use anyhow::Context as _;
use kvx_vllm::{StatsReader, StatsSnapshot};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// One rank of one side.
#[derive(Clone, Debug)]
pub(crate) struct Side {
    pub(crate) side: &'static str,
    pub(crate) rank: u32,
    pub(crate) stats: StatsReader,
}

type Counter = (&'static str, &'static str, fn(&StatsSnapshot) -> u64);

const COUNTERS: &[Counter] = &[
    ("transfers_started", "Transfers started", |s| {
        s.transfers_started
    }),
    ("transfers_ok", "Transfers that delivered", |s| {
        s.transfers_ok
    }),
    ("transfers_failed", "Transfers that failed", |s| {
        s.transfers_failed
    }),
    ("bytes_written", "Bytes posted", |s| s.bytes_written),
    (
        "bytes_streamed",
        "Bytes written while their request was still computing",
        |s| s.bytes_streamed,
    ),
    ("router_aborts", "Routers' aborts handled", |s| {
        s.router_aborts
    }),
    (
        "released_unconfirmed",
        "Failed requests whose blocks went back without every writer's confirmation",
        |s| s.released_unconfirmed,
    ),
    (
        "handshakes_failed",
        "Control connections refused at the handshake",
        |s| s.handshakes_failed,
    ),
    (
        "handshakes_evicted",
        "Control connections dropped while too many handshakes waited",
        |s| s.handshakes_evicted,
    ),
    (
        "idle_closed",
        "Control connections closed for saying nothing for the idle timeout",
        |s| s.idle_closed,
    ),
    (
        "unauthorized",
        "Requests, registrations and aborts refused for their capability or peer",
        |s| s.unauthorized,
    ),
    (
        "ops_posted",
        "Transport operations posted (writes, reads)",
        |s| s.ops_posted,
    ),
];

/// The gauges: name, help, value.
type Gauge = (&'static str, &'static str, fn(&StatsSnapshot) -> i64);

const GAUGES: [Gauge; 2] = [
    (
        "held",
        "Requests whose blocks (prefill) or registrations (decode) are held now",
        |s| s.held,
    ),
    (
        "in_flight",
        "Transfers in flight now (writes posted and not completed; reads in pull)",
        |s| s.in_flight,
    ),
];

/// A histogram's name, help and buckets (those of vLLM's `vllm:kvx_*` series).
struct HistogramKind {
    name: &'static str,
    help: &'static str,
    buckets: fn() -> Vec<f64>,
}

const HISTOGRAMS: [HistogramKind; 3] = [
    HistogramKind {
        name: "transfer_seconds",
        help: "Push transfers: seconds from the post of their last writes to their completion",
        buckets: || (0..18).map(|i| 1e-4 * f64::from(1u32 << i)).collect(),
    },
    HistogramKind {
        name: "transfer_bytes",
        help: "Push transfers: bytes of their last writes",
        buckets: || (0..13).map(|i| 4096.0 * 4f64.powi(i)).collect(),
    },
    HistogramKind {
        name: "kv_wait_seconds",
        help: "Decode: seconds a request waited for its KV, from its registration (push) or the \
               post of its reads (pull) to ready",
        buckets: || (0..17).map(|i| 1e-3 * f64::from(1u32 << i)).collect(),
    },
];

/// One rank's histograms, in the order of [`HISTOGRAMS`].
#[derive(Debug)]
struct RankHistograms([Histogram; 3]);

impl RankHistograms {
    fn new() -> Self {
        Self(HISTOGRAMS.map(|kind| Histogram::new((kind.buckets)())))
    }

    /// Observes what `stats` sampled since the last scrape.
    fn take(&self, stats: &StatsReader) {
        let [seconds, bytes, waits] = &self.0;
        for sample in stats.take_transfer_samples() {
            seconds.observe(sample.seconds);
            bytes.observe(sample.bytes as f64);
        }
        for wait in stats.take_wait_samples() {
            waits.observe(wait);
        }
    }
}

#[derive(Debug)]
struct Connector {
    sides: Vec<Side>,
    histograms: std::sync::Arc<Vec<RankHistograms>>,
}

impl Collector for Connector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let snapshots: Vec<(&Side, StatsSnapshot)> =
            self.sides.iter().map(|s| (s, s.stats.snapshot())).collect();
        let labels = |s: &Side| [("side", s.side.to_owned()), ("rank", s.rank.to_string())];
        for (side, histograms) in self.sides.iter().zip(self.histograms.iter()) {
            histograms.take(&side.stats);
        }
        for (i, kind) in HISTOGRAMS.iter().enumerate() {
            let metric_type = self.histograms[0].0[i].metric_type();
            let mut family = encoder.encode_descriptor(kind.name, kind.help, None, metric_type)?;
            for (side, histograms) in self.sides.iter().zip(self.histograms.iter()) {
                histograms.0[i].encode(family.encode_family(&labels(side))?)?;
            }
        }
        for (name, help, value) in GAUGES {
            let gauge = ConstGauge::new(0i64);
            let mut family = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
            for (side, snap) in &snapshots {
                ConstGauge::new(value(snap)).encode(family.encode_family(&labels(side))?)?;
            }
        }
        {
            let counter = ConstCounter::new(0u64);
            let mut family = encoder.encode_descriptor(
                "requests_failed",
                "Requests that ended failed, by cause",
                None,
                counter.metric_type(),
            )?;
            for side in &self.sides {
                for (cause, n) in side.stats.failures_by_cause() {
                    let [s, r] = labels(side);
                    let labels = [s, r, ("cause", cause.to_owned())];
                    ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        {
            let gauge = ConstGauge::new(0i64);
            let mut family = encoder.encode_descriptor(
                "rail",
                "1 for each rail (NIC or interface) the rank's transport opened on",
                None,
                gauge.metric_type(),
            )?;
            for side in &self.sides {
                for rail in side.stats.rails() {
                    let [s, r] = labels(side);
                    let labels = [s, r, ("rail", rail)];
                    ConstGauge::new(1i64).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        for (name, help, value) in COUNTERS {
            let counter = ConstCounter::new(0u64);
            let mut family = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            for (side, snap) in &snapshots {
                ConstCounter::new(value(snap)).encode(family.encode_family(&labels(side))?)?;
            }
        }
        Ok(())
    }
}

/// The series of `sides` as OpenMetrics text, their histograms (one per rank of `sides`, in
/// order) first taking the samples since the last scrape.
fn render(sides: &[Side], histograms: &std::sync::Arc<Vec<RankHistograms>>) -> String {
    let mut registry = Registry::with_prefix("kvx");
    registry.register_collector(Box::new(Connector {
        sides: sides.to_vec(),
        histograms: std::sync::Arc::clone(histograms),
    }));
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
    out
}

/// Serves `/metrics` for `sides` on `listen` from a thread of its own; returns the address.
pub(crate) fn serve(listen: SocketAddr, sides: Vec<Side>) -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind(listen)
        .with_context(|| format!("--metrics-listen {listen}"))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("the metrics endpoint's runtime")?;
    let histograms = std::sync::Arc::new(sides.iter().map(|_| RankHistograms::new()).collect());
    std::thread::Builder::new()
        .name("kvx-metrics".into())
        .spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let app = axum::Router::new().route(
                    "/metrics",
                    axum::routing::get(move || {
                        let text = render(&sides, &histograms);
                        async move {
                            (
                                [(
                                    axum::http::header::CONTENT_TYPE,
                                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                                )],
                                text,
                            )
                        }
                    }),
                );
                let _ = axum::serve(listener, app).await;
            });
        })
        .context("cannot start the metrics thread")?;
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read as _, Write as _};

    #[test]
    fn a_ranks_counters_are_served_with_their_labels() {
        // A real producer rank and consumer rank over the loopback transport.
        let spec = kvx_core::LayoutSpec {
            num_layers: 1,
            total_kv_heads: 1,
            head_dim: 8,
            dtype: kvx_core::Dtype::F32,
            mla: false,
            block_tokens: 4,
            num_blocks: 4,
            tp_size: 1,
            tp_rank: 0,
            order: kvx_core::MemoryOrder::Nhd,
            arrangement: kvx_core::Arrangement::PerLayerSplit,
        };
        let (_memory, cache) =
            super::super::prefill::RankMemory::new(spec.clone(), super::super::gpu::Device::Host)
                .unwrap();
        let fabric = kvx_rdma::loopback::LoopbackFabric::new();
        let mut config = kvx_vllm::ConnectorConfig::new(kvx_core::EngineId(1));
        config.producer_lease = std::time::Duration::from_millis(20);
        let mut producer =
            kvx_vllm::Producer::start(config, cache, Box::new(fabric.endpoint())).unwrap();
        // A request nobody registers for: it fails at the producer lease.
        let key = kvx_rendezvous::AttemptKey::new(kvx_core::TransferId(5), kvx_core::Attempt(0));
        producer
            .request_finished(key, kvx_core::RequestId(1), vec![kvx_core::BlockId(0)], 4)
            .unwrap();
        let done = producer.wait_finished(std::time::Duration::from_secs(10));
        assert_eq!(done.len(), 1, "{done:?}");
        // And one a decode rank registers for: a push transfer, sampled on both sides.
        let (_decode_memory, decode_cache) =
            super::super::prefill::RankMemory::new(spec, super::super::gpu::Device::Host).unwrap();
        let mut consumer = kvx_vllm::Consumer::start(
            kvx_vllm::ConnectorConfig::new(kvx_core::EngineId(2)),
            decode_cache,
            Box::new(fabric.endpoint()),
        )
        .unwrap();
        let pushed = kvx_rendezvous::AttemptKey::new(kvx_core::TransferId(6), kvx_core::Attempt(0));
        consumer
            .request_allocated(kvx_vllm::PushRequest {
                groups: Vec::new(),
                key: pushed,
                request: kvx_core::RequestId(2),
                prefill: producer.control_addr(),
                num_tokens: 4,
                skip_tokens: 0,
                blocks: vec![kvx_core::BlockId(1)],
                capability: None,
                trace: None,
            })
            .unwrap();
        producer
            .request_finished(
                pushed,
                kvx_core::RequestId(2),
                vec![kvx_core::BlockId(2)],
                4,
            )
            .unwrap();
        let events = consumer.wait_events(std::time::Duration::from_secs(10));
        assert!(
            matches!(events.as_slice(), [kvx_vllm::RecvEvent::Ready { .. }]),
            "{events:?}"
        );
        let done = producer.wait_finished(std::time::Duration::from_secs(10));
        assert_eq!(done.len(), 1, "{done:?}");
        let sides = vec![
            Side {
                side: "prefill",
                rank: 0,
                stats: producer.stats_reader(),
            },
            Side {
                side: "decode",
                rank: 0,
                stats: consumer.stats_reader(),
            },
        ];
        let addr = serve("127.0.0.1:0".parse().unwrap(), sides).unwrap();
        let scrape = || {
            let mut stream = std::net::TcpStream::connect(addr).unwrap();
            stream
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .unwrap();
            let mut answer = String::new();
            stream.read_to_string(&mut answer).unwrap();
            answer
        };
        let answer = scrape();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        // One transfer of one 4-token block (1 layer, K and V, 8 f32 a head: 256 bytes).
        let bytes = 4 * 2 * 8 * 4;
        for want in [
            "# TYPE kvx_transfer_seconds histogram".to_owned(),
            r#"kvx_transfer_seconds_count{side="prefill",rank="0"} 1"#.to_owned(),
            format!(r#"kvx_transfer_bytes_sum{{side="prefill",rank="0"}} {bytes}.0"#),
            r#"kvx_kv_wait_seconds_count{side="decode",rank="0"} 1"#.to_owned(),
            r#"kvx_kv_wait_seconds_count{side="prefill",rank="0"} 0"#.to_owned(),
        ] {
            assert!(answer.contains(&want), "no `{want}` in {answer}");
        }
        // Samples are taken once: a second scrape counts the same transfer once.
        let again = scrape();
        assert!(
            again.contains(r#"kvx_transfer_seconds_count{side="prefill",rank="0"} 1"#),
            "{again}"
        );
        consumer.shutdown();
        for want in [
            r#"kvx_held{side="prefill",rank="0"} 0"#,
            r#"kvx_transfers_started_total{side="prefill",rank="0"} 1"#,
            r#"kvx_handshakes_failed_total{side="prefill",rank="0"} 0"#,
            "# TYPE kvx_bytes_written counter",
            r#"kvx_in_flight{side="prefill",rank="0"} 0"#,
            r#"kvx_ops_posted_total{side="prefill",rank="0"} 1"#,
            r#"kvx_held{side="decode",rank="0"} 0"#,
            r#"kvx_requests_failed_total{side="prefill",rank="0",cause="lease_expired"} 1"#,
        ] {
            assert!(answer.contains(want), "no `{want}` in {answer}");
        }
        producer.shutdown();
    }
}
