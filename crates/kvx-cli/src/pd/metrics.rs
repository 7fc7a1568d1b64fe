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

use std::net::SocketAddr;

use anyhow::Context as _;
use kvx_vllm::{StatsReader, StatsSnapshot};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
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

#[derive(Debug)]
struct Connector(Vec<Side>);

impl Collector for Connector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let snapshots: Vec<(&Side, StatsSnapshot)> =
            self.0.iter().map(|s| (s, s.stats.snapshot())).collect();
        let labels = |s: &Side| [("side", s.side.to_owned()), ("rank", s.rank.to_string())];
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
            for side in &self.0 {
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
            for side in &self.0 {
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

/// The series of `sides` as OpenMetrics text.
pub(crate) fn render(sides: &[Side]) -> String {
    let mut registry = Registry::with_prefix("kvx");
    registry.register_collector(Box::new(Connector(sides.to_vec())));
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
                        let text = render(&sides);
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
        // A real producer rank over the loopback transport, with its counters at zero.
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
            super::super::prefill::RankMemory::new(spec, super::super::gpu::Device::Host).unwrap();
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
        let sides = vec![Side {
            side: "prefill",
            rank: 0,
            stats: producer.stats_reader(),
        }];
        let addr = serve("127.0.0.1:0".parse().unwrap(), sides).unwrap();
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        for want in [
            r#"kvx_held{side="prefill",rank="0"} 0"#,
            r#"kvx_transfers_started_total{side="prefill",rank="0"} 0"#,
            r#"kvx_handshakes_failed_total{side="prefill",rank="0"} 0"#,
            "# TYPE kvx_bytes_written counter",
            r#"kvx_in_flight{side="prefill",rank="0"} 0"#,
            r#"kvx_ops_posted_total{side="prefill",rank="0"} 0"#,
            r#"kvx_requests_failed_total{side="prefill",rank="0",cause="lease_expired"} 1"#,
        ] {
            assert!(answer.contains(want), "no `{want}` in {answer}");
        }
        producer.shutdown();
    }
}
