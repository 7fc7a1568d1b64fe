//! An OpenTelemetry exporter for kvx's request spans (feature `otlp`): a `tracing-subscriber`
//! layer ([`OtlpLayer`]) that turns each closed span carrying a [`TRACE_ID_FIELD`] (`kvx.send`,
//! `kvx.receive`, `kvx.dispatch`) into an OTLP span, with its fields as attributes and the events
//! logged inside it as span events, and a thread that posts them in batches to a collector's
//! OTLP/HTTP endpoint (`POST /v1/traces`, JSON encoding) at most once a second.
//!
//! Plain HTTP to a collector or agent on the host's network (`http://HOST:PORT`); spans that
//! cannot be delivered are dropped and counted ([`OtlpLayer::dropped`]), never retried at the
//! engine's expense, and the layer never blocks the thread that closes a span (a full queue
//! drops too). A process that ends calls [`flush`] first, so that its last second of spans is
//! posted too.

use std::fmt::{self, Write as _};
use std::io::{Read as _, Write as _};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use super::{random_span_id, NAME_FIELD, PARENT_SPAN_FIELD, SPAN_ID_FIELD, TRACE_ID_FIELD};

/// Spans waiting to be posted, at most.
const QUEUE: usize = 8192;
/// Spans in one post, at most.
const BATCH: usize = 512;
/// How long the exporter gathers spans before it posts what it has.
const EVERY: Duration = Duration::from_secs(1);
/// Bound on connecting to the collector and on each write and read.
const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Why an exporter cannot be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OtlpError {
    /// The endpoint is not `http://HOST:PORT[/]`.
    #[error("`{0}` is not an OTLP/HTTP endpoint of the form http://HOST:PORT")]
    Endpoint(String),
    /// The exporter thread could not start.
    #[error("cannot start the OTLP exporter thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// What the exporter thread takes: a closed span, or a request to post what it has now (answered
/// once posted).
enum Item {
    Span(SpanRecord),
    Flush(SyncSender<()>),
}

/// The queue of this process's exporter, for [`flush`] (the last layer made).
static FLUSH_QUEUE: OnceLock<Mutex<Option<SyncSender<Item>>>> = OnceLock::new();

/// Posts the spans the exporter holds now, waiting at most `timeout` for the collector; `false`
/// where there is no exporter or it did not finish in time. For a process about to end.
pub fn flush(timeout: Duration) -> bool {
    let queue = FLUSH_QUEUE.get().and_then(|q| {
        q.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    });
    let Some(queue) = queue else { return false };
    let (done, posted) = mpsc::sync_channel(1);
    queue.send(Item::Flush(done)).is_ok() && posted.recv_timeout(timeout).is_ok()
}

/// One finished span, as OTLP wants it.
#[derive(Clone, Debug, Default)]
struct SpanRecord {
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    name: String,
    start_unix_nanos: u128,
    end_unix_nanos: u128,
    attributes: Vec<(String, String)>,
    events: Vec<EventRecord>,
}

#[derive(Clone, Debug, Default)]
struct EventRecord {
    name: String,
    unix_nanos: u128,
    attributes: Vec<(String, String)>,
}

/// The fields of a span or an event, as text.
#[derive(Default)]
struct Fields(Vec<(String, String)>);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_owned(), value.to_owned()));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
}

fn unix_nanos(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A layer that exports kvx's request spans to an OTLP/HTTP collector.
pub struct OtlpLayer {
    queue: SyncSender<Item>,
    dropped: Arc<AtomicU64>,
}

impl fmt::Debug for OtlpLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OtlpLayer")
            .field("dropped", &self.dropped.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl OtlpLayer {
    /// A layer posting to `endpoint` (`http://HOST:PORT`) as service `service` (the OTLP
    /// resource's `service.name`, e.g. `kvx-prefill`), with its exporter thread.
    ///
    /// # Errors
    /// [`OtlpError::Endpoint`] or [`OtlpError::Thread`].
    pub fn new(endpoint: &str, service: &str) -> Result<Self, OtlpError> {
        let authority = endpoint
            .strip_prefix("http://")
            .map(|rest| rest.trim_end_matches('/'))
            .filter(|a| !a.is_empty() && !a.contains('/') && a.contains(':'))
            .ok_or_else(|| OtlpError::Endpoint(endpoint.to_owned()))?
            .to_owned();
        let (queue, spans) = mpsc::sync_channel(QUEUE);
        let dropped = Arc::new(AtomicU64::new(0));
        let exporter = Exporter {
            authority,
            service: service.to_owned(),
            dropped: Arc::clone(&dropped),
        };
        thread::Builder::new()
            .name("kvx-otlp".into())
            .spawn(move || exporter.run(&spans))
            .map_err(OtlpError::Thread)?;
        *FLUSH_QUEUE
            .get_or_init(|| Mutex::new(None))
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(queue.clone());
        Ok(Self { queue, dropped })
    }

    /// Spans dropped so far (the queue was full, or the collector could not take them).
    #[must_use]
    pub fn dropped(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.dropped)
    }
}

impl<S> Layer<S> for OtlpLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let Some(trace_id) = fields
            .0
            .iter()
            .find(|(k, v)| k == TRACE_ID_FIELD && is_hex(v, 32))
            .map(|(_, v)| v.to_ascii_lowercase())
        else {
            return;
        };
        let field = |name: &str| {
            fields
                .0
                .iter()
                .find(|(k, v)| k == name && is_hex(v, 16))
                .map(|(_, v)| v.to_ascii_lowercase())
        };
        let record = SpanRecord {
            trace_id,
            span_id: field(SPAN_ID_FIELD).unwrap_or_else(|| format!("{:016x}", random_span_id())),
            parent_span_id: field(PARENT_SPAN_FIELD).unwrap_or_default(),
            name: fields
                .0
                .iter()
                .find(|(k, _)| k == NAME_FIELD)
                .map_or_else(|| attrs.metadata().name().to_owned(), |(_, v)| v.clone()),
            start_unix_nanos: unix_nanos(SystemTime::now()),
            attributes: fields
                .0
                .into_iter()
                .filter(|(k, _)| {
                    ![TRACE_ID_FIELD, PARENT_SPAN_FIELD, SPAN_ID_FIELD, NAME_FIELD]
                        .contains(&k.as_str())
                })
                .collect(),
            ..SpanRecord::default()
        };
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(record);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut extensions = span.extensions_mut();
        if let Some(record) = extensions.get_mut::<SpanRecord>() {
            let mut fields = Fields::default();
            values.record(&mut fields);
            record.attributes.extend(fields.0);
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let mut extensions = span.extensions_mut();
        let Some(record) = extensions.get_mut::<SpanRecord>() else {
            return;
        };
        let mut fields = Fields::default();
        event.record(&mut fields);
        let name = fields
            .0
            .iter()
            .position(|(k, _)| k == "message")
            .map_or_else(
                || event.metadata().name().to_owned(),
                |i| fields.0.remove(i).1,
            );
        record.events.push(EventRecord {
            name,
            unix_nanos: unix_nanos(SystemTime::now()),
            attributes: fields.0,
        });
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let Some(mut record) = span.extensions_mut().remove::<SpanRecord>() else {
            return;
        };
        record.end_unix_nanos = unix_nanos(SystemTime::now());
        if self.queue.try_send(Item::Span(record)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Installs this process's logging: `fmt` lines on standard error filtered by `filter`, and,
/// where `endpoint` is given, the OTLP exporter of kvx's request spans as service `service`.
/// Returns false when the process had a subscriber already (nothing is installed then).
///
/// # Errors
/// [`OtlpError`] for an endpoint that is not `http://HOST:PORT`.
pub fn init(
    filter: tracing_subscriber::EnvFilter,
    endpoint: Option<&str>,
    service: &str,
) -> Result<bool, OtlpError> {
    use tracing_subscriber::prelude::*;
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal, not in redirected logs.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(filter);
    let otlp = endpoint
        .map(|e| OtlpLayer::new(e, service))
        .transpose()?
        .map(|layer| {
            layer.with_filter(
                tracing_subscriber::filter::Targets::new()
                    .with_target(super::TARGET, tracing::Level::INFO),
            )
        });
    Ok(tracing_subscriber::registry()
        .with(fmt)
        .with(otlp)
        .try_init()
        .is_ok())
}

/// The exporter thread's side.
struct Exporter {
    authority: String,
    service: String,
    dropped: Arc<AtomicU64>,
}

impl Exporter {
    fn run(&self, items: &Receiver<Item>) {
        let mut batch = Vec::new();
        let mut due = Instant::now() + EVERY;
        loop {
            let mut flushed = None;
            match items.recv_timeout(due.saturating_duration_since(Instant::now())) {
                Ok(Item::Span(span)) => {
                    batch.push(span);
                    if batch.len() < BATCH {
                        continue;
                    }
                }
                Ok(Item::Flush(done)) => flushed = Some(done),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    self.post(&batch);
                    return;
                }
            }
            if !batch.is_empty() {
                self.post(&batch);
                batch.clear();
            }
            if let Some(done) = flushed {
                let _ = done.try_send(());
            }
            due = Instant::now() + EVERY;
        }
    }

    /// Posts `spans`; counts them dropped if the collector does not answer 2xx.
    fn post(&self, spans: &[SpanRecord]) {
        if spans.is_empty() {
            return;
        }
        let body = encode(&self.service, spans);
        if post_json(&self.authority, "/v1/traces", &body).is_err() {
            self.dropped
                .fetch_add(spans.len() as u64, Ordering::Relaxed);
        }
    }
}

/// One HTTP/1.1 POST of a JSON body; `Ok` on a 2xx answer.
fn post_json(authority: &str, path: &str, body: &str) -> std::io::Result<()> {
    let addr = authority
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other("the collector's name resolves to nothing"))?;
    let mut stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut status = [0u8; 12];
    stream.read_exact(&mut status)?;
    // "HTTP/1.1 200"
    if status.starts_with(b"HTTP/1.") && status[9] == b'2' {
        Ok(())
    } else {
        Err(std::io::Error::other("the collector refused the spans"))
    }
}

/// A JSON string literal.
fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn json_attributes(out: &mut String, attributes: &[(String, String)]) {
    out.push('[');
    for (i, (k, v)) in attributes.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"key\":");
        json_string(out, k);
        out.push_str(",\"value\":{\"stringValue\":");
        json_string(out, v);
        out.push_str("}}");
    }
    out.push(']');
}

/// The OTLP/HTTP JSON body (`ExportTraceServiceRequest`) for `spans` of service `service`.
fn encode(service: &str, spans: &[SpanRecord]) -> String {
    let mut out = String::with_capacity(256 + 512 * spans.len());
    out.push_str("{\"resourceSpans\":[{\"resource\":{\"attributes\":");
    json_attributes(&mut out, &[("service.name".into(), service.into())]);
    out.push_str("},\"scopeSpans\":[{\"scope\":{\"name\":\"kvx\"},\"spans\":[");
    for (i, s) in spans.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(
            out,
            "{{\"traceId\":\"{}\",\"spanId\":\"{}\",\"parentSpanId\":\"{}\",\"name\":",
            s.trace_id, s.span_id, s.parent_span_id
        );
        json_string(&mut out, &s.name);
        let _ = write!(
            out,
            ",\"kind\":1,\"startTimeUnixNano\":\"{}\",\"endTimeUnixNano\":\"{}\",\"attributes\":",
            s.start_unix_nanos, s.end_unix_nanos
        );
        json_attributes(&mut out, &s.attributes);
        out.push_str(",\"events\":[");
        for (j, e) in s.events.iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            let _ = write!(out, "{{\"timeUnixNano\":\"{}\",\"name\":", e.unix_nanos);
            json_string(&mut out, &e.name);
            out.push_str(",\"attributes\":");
            json_attributes(&mut out, &e.attributes);
            out.push('}');
        }
        out.push_str("]}");
    }
    out.push_str("]}]}]}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_must_be_plain_http_host_and_port() {
        for bad in [
            "",
            "https://c:4318",
            "http://",
            "http://c",
            "http://c:4318/v1/traces",
        ] {
            assert!(
                matches!(OtlpLayer::new(bad, "t"), Err(OtlpError::Endpoint(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_body_is_otlp_json_with_escaped_text() {
        let span = SpanRecord {
            trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
            span_id: "00f067aa0ba902b7".into(),
            parent_span_id: String::new(),
            name: "kvx.send".into(),
            start_unix_nanos: 1,
            end_unix_nanos: 2,
            attributes: vec![("transfer".into(), "a\"b\\c\n".into())],
            events: vec![EventRecord {
                name: "written".into(),
                unix_nanos: 2,
                attributes: vec![],
            }],
        };
        let body = encode("kvx-prefill", &[span]);
        assert_eq!(
            body,
            "{\"resourceSpans\":[{\"resource\":{\"attributes\":[{\"key\":\"service.name\",\
             \"value\":{\"stringValue\":\"kvx-prefill\"}}]},\"scopeSpans\":[{\"scope\":{\"name\":\
             \"kvx\"},\"spans\":[{\"traceId\":\"4bf92f3577b34da6a3ce929d0e0e4736\",\"spanId\":\
             \"00f067aa0ba902b7\",\"parentSpanId\":\"\",\"name\":\"kvx.send\",\"kind\":1,\
             \"startTimeUnixNano\":\"1\",\"endTimeUnixNano\":\"2\",\"attributes\":[{\"key\":\
             \"transfer\",\"value\":{\"stringValue\":\"a\\\"b\\\\c\\n\"}}],\"events\":[{\
             \"timeUnixNano\":\"2\",\"name\":\"written\",\"attributes\":[]}]}]}]}]}"
        );
    }
}
