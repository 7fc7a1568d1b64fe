//! The proxy's Prometheus series, served at `/metrics` (OpenMetrics text):
//!
//! | series | type | labels | what |
//! |---|---|---|---|
//! | `kvx_proxy_requests_total` | counter | `mode`, `outcome` (`ok`, `error`), `code` | client requests by how they ended |
//! | `kvx_proxy_ttft_seconds` | histogram | `mode` | from a client request's arrival to the first byte of its answer's body, as the client sees it |
//! | `kvx_proxy_first_byte_seconds` | histogram | `role` (`prefill`, `decode`) | from the client request's arrival to an instance's answer (its headers) |
//! | `kvx_proxy_retries_total` | counter | `leg` | dispatches tried again because an instance could not be reached |
//! | `kvx_proxy_instances_passed_over_total` | counter | `role` | instances passed over for `--skip-unreachable-s` after a failed connection |
//! | `kvx_proxy_in_flight` | gauge | `role`, `instance` | requests in flight on each instance |
//!
//! Recording is a few atomic additions per request; rendering happens only when scraped.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::args::Mode;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RequestLabels {
    pub(super) mode: &'static str,
    pub(super) outcome: &'static str,
    pub(super) code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ModeLabel {
    pub(super) mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RoleLabel {
    pub(super) role: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct LegLabel {
    pub(super) leg: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct InstanceLabels {
    pub(super) role: &'static str,
    pub(super) instance: String,
}

fn latency_histogram() -> Histogram {
    // 1 ms to about 65 s, doubling.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// The proxy's series and their registry.
#[derive(Debug)]
pub(super) struct Metrics {
    registry: Registry,
    pub(super) requests: Family<RequestLabels, Counter>,
    pub(super) ttft: Family<ModeLabel, Histogram>,
    pub(super) first_byte: Family<RoleLabel, Histogram>,
    pub(super) retries: Family<LegLabel, Counter>,
    pub(super) passed_over: Family<RoleLabel, Counter>,
    pub(super) in_flight: Family<InstanceLabels, Gauge>,
}

impl Metrics {
    pub(super) fn new() -> Self {
        let mut registry = Registry::with_prefix("kvx_proxy");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Client requests by mode, outcome and HTTP status code",
            requests.clone(),
        );
        let ttft = Family::<ModeLabel, Histogram>::new_with_constructor(latency_histogram);
        registry.register(
            "ttft_seconds",
            "From a client request's arrival to the first byte of its answer's body",
            ttft.clone(),
        );
        let first_byte = Family::<RoleLabel, Histogram>::new_with_constructor(latency_histogram);
        registry.register(
            "first_byte_seconds",
            "From a client request's arrival to an instance's answer, by the instance's role",
            first_byte.clone(),
        );
        let retries = Family::<LegLabel, Counter>::default();
        registry.register(
            "retries",
            "Dispatches tried again because the named leg's instance could not be reached",
            retries.clone(),
        );
        let passed_over = Family::<RoleLabel, Counter>::default();
        registry.register(
            "instances_passed_over",
            "Instances passed over for a while after a failed connection",
            passed_over.clone(),
        );
        let in_flight = Family::<InstanceLabels, Gauge>::default();
        registry.register(
            "in_flight",
            "Requests in flight on each instance",
            in_flight.clone(),
        );
        Self {
            registry,
            requests,
            ttft,
            first_byte,
            retries,
            passed_over,
            in_flight,
        }
    }

    /// The series as OpenMetrics text.
    pub(super) fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// A client request ended with `code` (`ok`: a successful status).
    pub(super) fn request_ended(&self, mode: Mode, code: u16) {
        let outcome = if (200..300).contains(&code) {
            "ok"
        } else {
            "error"
        };
        self.requests
            .get_or_create(&RequestLabels {
                mode: mode_name(mode),
                outcome,
                code,
            })
            .inc();
    }
}

/// The `mode` label's value.
pub(super) fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Push => "push",
        Mode::Pull => "pull",
    }
}
