//! Following one request across the router, prefill and decode: its W3C trace context
//! ([`TraceContext`], `traceparent`), which `kvx proxy` puts in both legs' `kv_transfer_params`
//! (`kvx_trace`), and the `tracing` spans each side keeps for the request's life under it
//! (`kvx.send` on prefill, `kvx.receive` on decode, `kvx.dispatch` in the proxy), with the
//! request's steps as events. Feature `otlp`: [`otlp`] exports those spans to an OpenTelemetry
//! collector (OTLP over HTTP, JSON), off unless an endpoint is named.

use std::fmt;
use std::str::FromStr;

#[cfg(feature = "otlp")]
pub mod otlp;

/// The `tracing` target of kvx's request spans and their events (what an exporter selects).
pub const TARGET: &str = "kvx_trace";

/// The span of one request's life on one side (`kvx.send`, `kvx.receive`), under `trace`; a
/// disabled span where there is no trace or no subscriber wants it (then it costs nothing).
#[must_use]
pub fn request_span(
    name: &'static str,
    trace: Option<TraceContext>,
    transfer: kvx_core::TransferId,
    rank: kvx_core::Rank,
) -> tracing::Span {
    let Some(t) = trace else {
        return tracing::Span::none();
    };
    tracing::info_span!(
        target: "kvx_trace",
        "kvx.request",
        otel.name = name,
        trace_id = %t.trace_hex(),
        parent_span_id = %t.parent_hex(),
        transfer = %transfer,
        rank = rank.0,
    )
}

/// Name of the field that, where present, names a span for OpenTelemetry (the convention of
/// `tracing-opentelemetry`): one call site serves spans of several names.
pub const NAME_FIELD: &str = "otel.name";

/// Name of the field that carries a span's trace id (32 hex digits).
pub const TRACE_ID_FIELD: &str = "trace_id";
/// Name of the field that carries a span's parent span id (16 hex digits).
pub const PARENT_SPAN_FIELD: &str = "parent_span_id";
/// Name of the field that fixes a span's own id (16 hex digits): a router's dispatch span, whose
/// id it hands on as the parent of the instances' spans.
pub const SPAN_ID_FIELD: &str = "span_id";

/// A W3C trace context: the trace a request belongs to and the span that handed it on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceContext {
    /// The trace id (never 0).
    pub trace_id: u128,
    /// The span that handed the request on (never 0).
    pub parent_span: u64,
    /// Whether the trace is sampled (the `traceparent` flags' low bit).
    pub sampled: bool,
}

/// A `traceparent` that is not `00-<32 hex>-<16 hex>-<2 hex>` with non-zero ids.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)")]
pub struct BadTraceparent(pub String);

impl FromStr for TraceContext {
    type Err = BadTraceparent;

    fn from_str(s: &str) -> Result<Self, BadTraceparent> {
        let bad = || BadTraceparent(s.chars().take(80).collect());
        let mut parts = s.trim().split('-');
        let (Some(version), Some(trace), Some(span), Some(flags)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let hex = |t: &str, len: usize| {
            (t.len() == len && t.bytes().all(|b| b.is_ascii_hexdigit())).then_some(())
        };
        hex(version, 2).ok_or_else(bad)?;
        // Version 00 has exactly four fields; later versions may add more.
        if version == "ff" || (version == "00" && parts.next().is_some()) {
            return Err(bad());
        }
        hex(trace, 32).ok_or_else(bad)?;
        hex(span, 16).ok_or_else(bad)?;
        hex(flags, 2).ok_or_else(bad)?;
        let trace_id = u128::from_str_radix(trace, 16).map_err(|_| bad())?;
        let parent_span = u64::from_str_radix(span, 16).map_err(|_| bad())?;
        let flags = u8::from_str_radix(flags, 16).map_err(|_| bad())?;
        if trace_id == 0 || parent_span == 0 {
            return Err(bad());
        }
        Ok(Self {
            trace_id,
            parent_span,
            sampled: flags & 1 == 1,
        })
    }
}

impl fmt::Display for TraceContext {
    /// As a `traceparent` (version 00).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id,
            self.parent_span,
            u8::from(self.sampled)
        )
    }
}

impl TraceContext {
    /// A new trace, sampled, whose first span is `span`.
    #[must_use]
    pub fn new_trace(span: u64) -> Self {
        Self {
            trace_id: random_u128(),
            parent_span: span,
            sampled: true,
        }
    }

    /// The same trace, handed on by `span`.
    #[must_use]
    pub fn child_of(self, span: u64) -> Self {
        Self {
            parent_span: span,
            ..self
        }
    }

    /// The trace id as 32 hex digits.
    #[must_use]
    pub fn trace_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The parent span id as 16 hex digits.
    #[must_use]
    pub fn parent_hex(&self) -> String {
        format!("{:016x}", self.parent_span)
    }
}

/// A random non-zero span id.
#[must_use]
pub fn random_span_id() -> u64 {
    loop {
        let id = random_u128() as u64;
        if id != 0 {
            return id;
        }
    }
}

/// 128 random bits, not zero, from the system's generator (which does not fail on Linux once
/// booted; an id is no secret, so a failure gives 1 rather than an error).
fn random_u128() -> u128 {
    let mut bytes = [0u8; 16];
    let _ = getrandom::fill(&mut bytes);
    u128::from_ne_bytes(bytes).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_and_bad_ones_are_refused() {
        let text = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t: TraceContext = text.parse().unwrap();
        assert_eq!(t.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(t.parent_span, 0x00f067aa0ba902b7);
        assert!(t.sampled);
        assert_eq!(t.to_string(), text);
        assert_eq!(t.trace_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        let child = t.child_of(7);
        assert_eq!(child.trace_id, t.trace_id);
        assert_eq!(child.parent_hex(), "0000000000000007");
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        ] {
            assert!(bad.parse::<TraceContext>().is_err(), "{bad}");
        }
        // A later version may carry more fields.
        assert!("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-x"
            .parse::<TraceContext>()
            .is_ok());
    }

    #[test]
    fn new_traces_and_spans_are_random_and_non_zero() {
        let a = TraceContext::new_trace(random_span_id());
        let b = TraceContext::new_trace(random_span_id());
        assert_ne!(a.trace_id, b.trace_id);
        assert_ne!(a.parent_span, b.parent_span);
        assert!(a.trace_id != 0 && a.parent_span != 0);
    }
}
