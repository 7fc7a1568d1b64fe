//! `kvx proxy`: an OpenAI-compatible router in front of prefill and decode vLLM instances that
//! run the kvx connector (`kvx_vllm.KvxPushConnector` / `KvxPullConnector`).
//!
//! - **push**: picks the decode instance first and sends the request to both at once, with a
//!   fresh transfer id in `kv_transfer_params` (prefill: `do_remote_decode`, `max_tokens` 1;
//!   decode: `do_remote_prefill` and the prefill instance's kvx control address), so decode
//!   registers its blocks while prefill computes;
//! - **pull**: sends to prefill first, then to decode with the `kv_transfer_params` prefill
//!   returned.
//!
//! Decode's answer (streamed or not) goes back to the client. Instances are chosen by fewest
//! requests in flight; an instance that cannot be connected is skipped (the dispatch is retried
//! elsewhere with a new transfer id; in pull, a decode leg goes to another decode with the same
//! prefilled KV) and passed over for `--skip-unreachable-s` unless no other is left; when none
//! of a kind is reachable the client gets 503. A dispatch no decode instance saw has its
//! prefill's KV given back at once: the proxy tells that prefill instance over its kvx control
//! port, as a router ([`kvx_vllm::router::abandon`]).
//! A prefill that fails while decode waits ends the client's request with 502 instead of
//! leaving it hanging; a decode answer that breaks off once streaming has started ends with an
//! error event (`data: {"error": ...}`). In push mode decode's
//! answer goes to the client as soon as decode answers, without waiting for prefill's HTTP
//! answer (a busy prefill API server can send it long after the KV went out); the prefill
//! request then runs to its end on its own.

mod abandon;
mod args;
mod http;
mod metrics;
mod route;
mod stream;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use abandon::ABANDONS_IN_FLIGHT;
pub(crate) use args::{Mode, ProxyArgs};
use http::app;

/// One upstream instance and its load.
#[derive(Debug)]
struct Instance {
    url: String,
    kvx: Option<String>,
    /// A decode instance's engine, which the capabilities of its dispatches name
    /// (`EngineId(0)`: not given, any decode engine).
    engine: kvx_core::EngineId,
    in_flight: AtomicUsize,
    /// Its series: requests in flight, times passed over, time to its answers.
    in_flight_gauge: prometheus_client::metrics::gauge::Gauge,
    passed_over: prometheus_client::metrics::counter::Counter,
    first_byte: prometheus_client::metrics::histogram::Histogram,
    /// Until when it is passed over after a failed connection.
    skip_until: Mutex<Option<Instant>>,
    /// Connections to it that failed.
    unreachable: AtomicU64,
}

impl Instance {
    /// Whether it is passed over at `now` (a connection to it failed lately).
    fn skipped(&self, now: Instant) -> bool {
        self.skip_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|until| until > now)
    }

    /// A connection to it failed: it is passed over for `skip`.
    fn unreachable(&self, skip: Duration, why: &str) {
        *self
            .skip_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now().checked_add(skip);
        self.unreachable.fetch_add(1, Ordering::Relaxed);
        self.passed_over.inc();
        eprintln!("kvx proxy: {why}; passing {} over for {skip:?}", self.url);
    }
}

/// Counts a request in flight on an instance for as long as it lives.
struct Load(Arc<Instance>);

impl Load {
    fn new(i: &Arc<Instance>) -> Self {
        i.in_flight.fetch_add(1, Ordering::SeqCst);
        i.in_flight_gauge.inc();
        Self(Arc::clone(i))
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.0.in_flight_gauge.dec();
    }
}

struct Proxy {
    mode: Mode,
    prefill: Vec<Arc<Instance>>,
    decode: Vec<Arc<Instance>>,
    client: reqwest::Client,
    /// Round-robin turns among equally loaded instances, one per pool.
    prefill_turn: AtomicUsize,
    decode_turn: AtomicUsize,
    /// Makes transfer ids.
    ids: TransferIds,
    /// The series `/metrics` serves.
    metrics: metrics::Metrics,
    /// Bound on one whole client request.
    request_timeout: Duration,
    /// Bound on the silence between two pieces of a streamed answer (after its first).
    stream_idle: Option<Duration>,
    /// Largest request body accepted.
    max_request_bytes: usize,
    skip_unreachable: Duration,
    /// Bounds each step of telling a prefill instance to give a transfer's KV back.
    connect_timeout: Duration,
    /// Bounds how many of those run at once (each holds a blocking thread): beyond it, the
    /// lease frees the KV.
    abandons: Arc<tokio::sync::Semaphore>,
    /// The deployment key the prefill instances' control ports ask for (`--auth-key-file`).
    auth_key: Option<Arc<kvx_vllm::AuthKey>>,
    /// Client requests served at once (`--max-requests`).
    requests: Arc<tokio::sync::Semaphore>,
    max_requests: usize,
    /// Bound on receiving a request's headers (`--header-timeout-s`).
    header_timeout: Duration,
    /// Bound on receiving a request's body (`--body-timeout-s`).
    body_timeout: Duration,
}

/// Transfer ids no one can predict: the dispatch counter under two secret, random SipHash keys
/// (a pseudo-random function), 128 bits. An id seen in a log or an `X-Request-Id` says nothing
/// of the next.
pub(super) struct TransferIds {
    next: AtomicU64,
    keys: [std::collections::hash_map::RandomState; 2],
}

impl TransferIds {
    fn new() -> Self {
        Self {
            next: AtomicU64::new(0),
            keys: [
                std::collections::hash_map::RandomState::new(),
                std::collections::hash_map::RandomState::new(),
            ],
        }
    }

    /// A fresh id, unique per proxy process and dispatch.
    pub(super) fn fresh(&self) -> String {
        use std::hash::BuildHasher as _;
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let [a, b] = &self.keys;
        format!("kvx-{:016x}{:016x}", a.hash_one(n), b.hash_one(n))
    }
}

fn build(args: &ProxyArgs) -> anyhow::Result<Arc<Proxy>> {
    if args.decode.is_empty() || args.prefill.is_empty() {
        bail!("at least one --prefill and one --decode are needed");
    }
    let connect =
        Duration::try_from_secs_f64(args.connect_timeout_s).context("--connect-timeout-s")?;
    let skip_unreachable =
        Duration::try_from_secs_f64(args.skip_unreachable_s).context("--skip-unreachable-s")?;
    let total =
        Duration::try_from_secs_f64(args.request_timeout_s).context("--request-timeout-s")?;
    let stream_idle = Duration::try_from_secs_f64(args.stream_idle_timeout_s)
        .context("--stream-idle-timeout-s")?;
    let header_timeout =
        Duration::try_from_secs_f64(args.header_timeout_s).context("--header-timeout-s")?;
    let body_timeout =
        Duration::try_from_secs_f64(args.body_timeout_s).context("--body-timeout-s")?;
    if args.max_requests == 0 || header_timeout.is_zero() || body_timeout.is_zero() {
        bail!("--max-requests, --header-timeout-s and --body-timeout-s must be above zero");
    }
    let client = reqwest::Client::builder()
        .connect_timeout(connect)
        // Below vLLM's keep-alive (uvicorn's, `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, 5 s): a pooled
        // connection is never reused just as the server closes it.
        .pool_idle_timeout(Duration::from_secs(4))
        // The instances are reached directly, never through a proxy named by `HTTP_PROXY`.
        .no_proxy()
        .build()
        .context("cannot build the HTTP client")?;
    let metrics = metrics::Metrics::new();
    let instance = |url: &str, kvx: Option<String>| {
        let role = if kvx.is_some() { "prefill" } else { "decode" };
        let (url, engine) = match url.split_once('#') {
            Some((url, engine)) => (url, kvx_core::EngineId::from_name(engine)),
            None => (url, kvx_core::EngineId(0)),
        };
        let url = url.trim_end_matches('/').to_owned();
        Arc::new(Instance {
            in_flight_gauge: metrics
                .in_flight
                .get_or_create(&metrics::InstanceLabels {
                    role,
                    instance: url.clone(),
                })
                .clone(),
            passed_over: metrics
                .passed_over
                .get_or_create(&metrics::RoleLabel { role })
                .clone(),
            first_byte: metrics
                .first_byte
                .get_or_create(&metrics::RoleLabel { role })
                .clone(),
            url,
            kvx,
            engine,
            in_flight: AtomicUsize::new(0),
            skip_until: Mutex::new(None),
            unreachable: AtomicU64::new(0),
        })
    };
    Ok(Arc::new(Proxy {
        mode: args.mode,
        prefill: args
            .prefill
            .iter()
            .map(|p| instance(&p.url, Some(p.kvx.clone())))
            .collect(),
        decode: args.decode.iter().map(|u| instance(u, None)).collect(),
        client,
        prefill_turn: AtomicUsize::new(0),
        decode_turn: AtomicUsize::new(0),
        ids: TransferIds::new(),
        metrics,
        request_timeout: total,
        stream_idle: (!stream_idle.is_zero()).then_some(stream_idle),
        max_request_bytes: args.max_request_mib.saturating_mul(1 << 20),
        skip_unreachable,
        connect_timeout: connect,
        abandons: Arc::new(tokio::sync::Semaphore::new(ABANDONS_IN_FLIGHT)),
        auth_key: args
            .auth_key_file
            .as_deref()
            .map(kvx_vllm::AuthKey::load)
            .transpose()?
            .map(Arc::new),
        requests: Arc::new(tokio::sync::Semaphore::new(args.max_requests)),
        max_requests: args.max_requests,
        header_timeout,
        body_timeout,
    }))
}

/// Runs the proxy until interrupted (Ctrl-C or SIGTERM).
pub(crate) fn run(args: &ProxyArgs) -> anyhow::Result<()> {
    let proxy = build(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("kvx-proxy")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        eprintln!(
            "kvx proxy ({:?}) on http://{}: prefill {:?}, decode {:?}",
            args.mode,
            listener.local_addr()?,
            args.prefill
                .iter()
                .map(|p| format!("{}@{}", p.url, p.kvx))
                .collect::<Vec<_>>(),
            args.decode
        );
        serve(listener, proxy).await;
        Ok(())
    })
}

/// Serves the proxy's API on `listener` until interrupted, then lets the requests in flight
/// finish. Each connection has Nagle's algorithm off, and a client gets `header_timeout` to send
/// a request's headers (hyper's own bound, which `axum::serve` leaves unset).
///
/// A streamed completion is a run of small writes: the headers, then an event per token. With
/// Nagle's algorithm on, a small write waits while the one before it is unacknowledged, and
/// the client acknowledges late (Linux delays an acknowledgement up to 40 ms): a first token
/// waited behind the headers, and tokens behind each other.
async fn serve(listener: tokio::net::TcpListener, proxy: Arc<Proxy>) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;

    let header_timeout = proxy.header_timeout;
    let service = TowerToHyperService::new(app(proxy));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown_signal());
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors, say: the next accept may work.
                    eprintln!("kvx proxy: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        without_nagle(&stream);
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .serve_connection(TokioIo::new(stream), service.clone());
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // A client that goes away, or is too slow with its headers, ends its connection.
            let _ = connection.await;
        });
    }
    graceful.shutdown().await;
}

/// Turns Nagle's algorithm off on a client's connection (see [`serve`]).
fn without_nagle(stream: &tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        // The connection still works, only its small writes may wait.
        eprintln!("kvx proxy: cannot turn Nagle's algorithm off on a connection: {e}");
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

#[cfg(test)]
mod tests;
