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

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt as _;
use axum::{Json, Router};
use futures_util::StreamExt as _;
use serde_json::{json, Map, Value};

/// Arguments of `kvx proxy`.
#[derive(clap::Args, Debug)]
pub(crate) struct ProxyArgs {
    /// push (decode registers while prefill computes) or pull (decode reads after prefill).
    #[arg(long, value_enum, default_value = "push")]
    pub(crate) mode: Mode,
    /// Address to serve the OpenAI API on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub(crate) listen: SocketAddr,
    /// A prefill instance: its HTTP base URL and its kvx control address (the connector's
    /// `listen` key), as `URL@HOST:PORT`, e.g. `http://127.0.0.1:8100@127.0.0.1:7100`. Repeatable.
    #[arg(long = "prefill", required = true, value_parser = parse_prefill)]
    pub(crate) prefill: Vec<Prefill>,
    /// A decode instance's HTTP base URL. Repeatable.
    #[arg(long = "decode", required = true, value_parser = parse_url)]
    pub(crate) decode: Vec<String>,
    /// Bound on connecting to an instance, in seconds.
    #[arg(long, default_value_t = 5.0)]
    pub(crate) connect_timeout_s: f64,
    /// Bound on one whole request (both legs, retries and the streamed answer included), in
    /// seconds.
    #[arg(long, default_value_t = 600.0)]
    pub(crate) request_timeout_s: f64,
    /// Bound on the silence between two pieces of a streamed answer once its first piece has
    /// come, in seconds (0: none): a decode instance that stops sending mid-stream (hung, or
    /// its host stopped) ends the client's stream with an error event then, instead of at
    /// `--request-timeout-s`, and its request is aborted there.
    #[arg(long, default_value_t = 120.0)]
    pub(crate) stream_idle_timeout_s: f64,
    /// Largest request body accepted, in MiB (a request with images inlined can be large).
    #[arg(long, default_value_t = 64)]
    pub(crate) max_request_mib: usize,
    /// How long an instance that could not be connected is passed over, in seconds: requests
    /// meanwhile go to the others (to it only when no other is left), instead of each paying
    /// for a failed connection and, in push mode, leaving a prefill leg behind.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) skip_unreachable_s: f64,
}

/// Transfer mode.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Decode registers its blocks while prefill computes; prefill writes them.
    Push,
    /// Prefill first; decode then reads prefill's blocks.
    Pull,
}

/// A prefill instance: HTTP URL and kvx control address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Prefill {
    pub(crate) url: String,
    pub(crate) kvx: String,
}

/// An instance's base URL: `http://HOST[:PORT][/PATH]` (the proxy speaks plain HTTP to its
/// instances).
fn parse_url(url: &str) -> Result<String, String> {
    if url.starts_with("https://") {
        return Err(format!(
            "`{url}`: https is not supported (kvx proxy speaks plain HTTP to its instances)"
        ));
    }
    let host = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("`{url}` is not an http:// URL"))?;
    if host.is_empty() || host.starts_with(['/', ':']) {
        return Err(format!("`{url}`: no host"));
    }
    Ok(url.trim_end_matches('/').to_owned())
}

fn parse_prefill(s: &str) -> Result<Prefill, String> {
    let (url, kvx) = s
        .rsplit_once('@')
        .ok_or_else(|| format!("`{s}`: expected URL@KVX_HOST:PORT"))?;
    let url = parse_url(url)?;
    let (host, port) = kvx
        .rsplit_once(':')
        .ok_or_else(|| format!("`{kvx}`: expected HOST:PORT"))?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(format!("`{kvx}`: expected HOST:PORT"));
    }
    Ok(Prefill {
        url,
        kvx: kvx.to_owned(),
    })
}

/// One upstream instance and its load.
#[derive(Debug)]
struct Instance {
    url: String,
    kvx: Option<String>,
    in_flight: AtomicUsize,
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
        eprintln!("kvx proxy: {why}; passing {} over for {skip:?}", self.url);
    }
}

/// Counts a request in flight on an instance for as long as it lives.
struct Load(Arc<Instance>);

impl Load {
    fn new(i: &Arc<Instance>) -> Self {
        i.in_flight.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(i))
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
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
    /// Numbers transfer ids.
    next: AtomicU64,
    seed: u64,
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
}

/// How many abandons ([`Abandoner`]) may run at once.
const ABANDONS_IN_FLIGHT: usize = 8;

/// Tells one prefill instance, over its kvx control port, to give the KV of a transfer back at
/// once (or as soon as it finishes) instead of at its lease. Prefill honours that only for a
/// transfer no decode registered (push) or finished reading (pull): in pull the proxy sends it
/// only where no decode may have been handed the dispatch; in push wherever decode did not take
/// it in ([`Unclaimed`]).
#[derive(Clone)]
struct Abandoner {
    kvx: String,
    /// Bounds each step (connect, handshake, send).
    timeout: Duration,
    /// Bounds how many abandons run at once (each holds a blocking thread): beyond it, the
    /// lease frees the KV.
    abandons: Arc<tokio::sync::Semaphore>,
}

impl Abandoner {
    /// In the background (a blocking thread of the runtime it is called on; outside a runtime
    /// nothing is sent); a failure is only reported, the lease still bounds the hold.
    fn abandon(&self, transfer: String) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let kvx = self.kvx.clone();
        let Ok(permit) = Arc::clone(&self.abandons).try_acquire_owned() else {
            eprintln!(
                "kvx proxy: {ABANDONS_IN_FLIGHT} abandons already running: prefill {kvx} keeps \
                 the KV of {transfer} until its lease"
            );
            return;
        };
        let timeout = self.timeout;
        runtime.spawn_blocking(move || {
            let _permit = permit;
            let told = abandon_at(&kvx, &transfer, timeout);
            if let Err(why) = told {
                eprintln!(
                    "kvx proxy: cannot tell prefill {kvx} to give back the KV of {transfer} \
                     (held until its lease): {why}"
                );
            }
        });
    }
}

/// A dispatch whose KV no decode has claimed yet: dropped unclaimed, it has prefill give that KV
/// back (an [`Abandoner`]). Pull claims it while a decode instance may have been handed the
/// parameters (from the decode leg's start, unless its connection is refused). Push claims it once decode's answer shows
/// that decode took the request in: a successful answer that is not a stream (decode has finished), or the first
/// piece of a successful stream (decode has its first token, so it registered). Dropped
/// unclaimed: decode was unreachable, refused or failed the request, the prefill leg failed,
/// or the client went away first; a decode that registered in the meantime keeps the KV
/// (prefill refuses a router's abort of a registered transfer) and gives it back itself.
struct Unclaimed {
    abandoner: Option<Abandoner>,
    transfer: String,
}

impl Unclaimed {
    fn claim(&mut self) {
        self.abandoner = None;
    }

    /// Claims it until [`Unclaimed::take_back`] is given what this returns: for a leg that
    /// hands a decode the dispatch, claimed however the leg ends (even dropped) unless it
    /// shows that the decode never got it.
    fn hand_over(&mut self) -> Option<Abandoner> {
        self.abandoner.take()
    }

    /// Unclaimed again (the leg's decode never got the dispatch).
    fn take_back(&mut self, handed: Option<Abandoner>) {
        self.abandoner = handed;
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if let Some(a) = self.abandoner.take() {
            a.abandon(std::mem::take(&mut self.transfer));
        }
    }
}

/// An error answered to the client in OpenAI's format.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": "kvx_proxy_error",
            "code": self.status.as_u16(),
        }});
        (self.status, Json(body)).into_response()
    }
}

/// Why one leg failed: the instance could not be reached (try another), or it answered badly.
enum LegError {
    Unreachable(String),
    Failed(ApiError),
}

/// The least loaded instance of `pool` not in `exclude`, passing over those that failed to
/// connect lately unless no other is left; ties go round-robin (`turn`, the pool's own).
fn least_loaded(pool: &[Arc<Instance>], turn: &AtomicUsize, exclude: &[usize]) -> Option<usize> {
    let start = turn.fetch_add(1, Ordering::Relaxed);
    let now = Instant::now();
    (0..pool.len())
        .map(|k| start.wrapping_add(k) % pool.len())
        .filter(|i| !exclude.contains(i))
        .min_by_key(|&i| {
            (
                pool[i].skipped(now),
                pool[i].in_flight.load(Ordering::SeqCst),
            )
        })
}

/// Request headers of the client's that go on to the instances: credentials (vLLM's
/// `--api-key`) and trace context. Not the others: hop-by-hop ones, the body's framing, and
/// `Accept-Encoding` (the answer is passed through as it comes).
const FORWARDED_HEADERS: [&str; 4] = ["authorization", "traceparent", "tracestate", "baggage"];

/// What every leg of one client request shares.
#[derive(Clone, Debug)]
struct Call {
    path: &'static str,
    /// The client's headers that go on to the instances ([`FORWARDED_HEADERS`]).
    headers: HeaderMap,
    /// When the whole request must be over.
    deadline: Instant,
}

impl Call {
    fn new(path: &'static str, client_headers: &HeaderMap, timeout: Duration) -> Self {
        let mut headers = HeaderMap::new();
        for name in FORWARDED_HEADERS {
            for value in client_headers.get_all(name) {
                headers.append(name, value.clone());
            }
        }
        Self {
            path,
            headers,
            deadline: Instant::now() + timeout,
        }
    }
}

impl Proxy {
    fn pick_prefill(&self, exclude: &[usize]) -> Option<usize> {
        least_loaded(&self.prefill, &self.prefill_turn, exclude)
    }

    fn pick_decode(&self, exclude: &[usize]) -> Option<usize> {
        least_loaded(&self.decode, &self.decode_turn, exclude)
    }

    /// `transfer`'s KV on prefill instance `p`, not claimed by a decode yet (nothing to give
    /// back where the proxy was not given that instance's kvx control address).
    fn unclaimed(&self, p: usize, transfer: &str) -> Unclaimed {
        let abandoner = self.prefill[p].kvx.clone().map(|kvx| Abandoner {
            kvx,
            timeout: self.connect_timeout,
            abandons: Arc::clone(&self.abandons),
        });
        Unclaimed {
            abandoner,
            transfer: transfer.to_owned(),
        }
    }

    /// A fresh transfer id: unique per proxy process and dispatch.
    fn transfer_id(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("kvx-{:016x}-{n:x}", self.seed)
    }

    async fn send(
        &self,
        instance: &Instance,
        call: &Call,
        request_id: &str,
        body: &Value,
    ) -> Result<reqwest::Response, LegError> {
        send_leg(
            &self.client,
            instance,
            self.skip_unreachable,
            call,
            request_id,
            body,
        )
        .await
    }

    async fn dispatch(&self, call: Call, body: Value) -> Result<Response, ApiError> {
        let Value::Object(request) = body else {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "the request body must be a JSON object",
            ));
        };
        let mut bad_prefill = Vec::new();
        let mut bad_decode = Vec::new();
        let mut last = String::new();
        loop {
            let Some(p) = self.pick_prefill(&bad_prefill) else {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("no prefill instance reachable ({last})"),
                ));
            };
            let Some(d) = self.pick_decode(&bad_decode) else {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("no decode instance reachable ({last})"),
                ));
            };
            let transfer = self.transfer_id();
            let outcome = match self.mode {
                Mode::Push => self.push(&call, &request, p, d, &transfer).await,
                Mode::Pull => {
                    self.pull(&call, &request, p, d, &mut bad_decode, &transfer)
                        .await
                }
            };
            match outcome {
                Ok(r) => return Ok(r),
                Err((which, LegError::Unreachable(why))) => {
                    last = why;
                    match which {
                        Leg::Prefill => bad_prefill.push(p),
                        // The dispatch's `Unclaimed` has had prefill give its KV back (the
                        // retry, if any, has a new id).
                        Leg::Decode => bad_decode.push(d),
                    }
                }
                Err((_, LegError::Failed(e))) => return Err(e),
            }
        }
    }

    async fn push(
        &self,
        call: &Call,
        request: &Map<String, Value>,
        p: usize,
        d: usize,
        transfer: &str,
    ) -> Result<Response, (Leg, LegError)> {
        let (pi, di) = (&self.prefill[p], &self.decode[d]);
        let kvx = pi.kvx.clone().unwrap_or_default();
        let p_body = prefill_body(
            request,
            json!({"do_remote_decode": true, "kvx_transfer_id": transfer}),
        );
        let d_body = decode_body(
            request,
            json!({"do_remote_prefill": true, "kvx_transfer_id": transfer, "kvx_prefill": kvx}),
        );
        let mut unclaimed = self.unclaimed(p, transfer);
        let p_load = Load::new(pi);
        let d_load = Load::new(di);
        // The prefill leg runs as a task of its own: once decode is answering, prefill's HTTP
        // answer no longer matters to the client, but its request must still run to the end
        // (dropping the connection would abort it in vLLM).
        let p_task = {
            let (client, instance, skip, call, id) = (
                self.client.clone(),
                Arc::clone(pi),
                self.skip_unreachable,
                call.clone(),
                transfer.to_owned(),
            );
            tokio::spawn(async move {
                let _load = p_load;
                let r = send_leg(&client, &instance, skip, &call, &id, &p_body).await?;
                check_prefill(r).await
            })
        };
        let mut p_task = AbortOnDrop(Some(p_task));
        let d_leg = self.send(di, call, transfer, &d_body);
        let mut d_leg = Box::pin(d_leg);
        // A failed prefill ends the request (dropping decode's leg closes its connection, which
        // aborts the request there) — unless decode is already answering: it then has the KV
        // (or recomputed it, per its load-failure policy), and its answer goes to the client at
        // once instead of waiting for prefill's HTTP answer, which can come much later than the
        // KV (a busy prefill API server).
        let d_resp = tokio::select! {
            p = p_task.join() => {
                p.map_err(|e| prefill_failed(&mut unclaimed, e))?;
                let d = d_leg.await.map_err(|e| (Leg::Decode, e))?;
                return Ok(forward(d, d_load, Some(unclaimed), self.stream_idle));
            }
            d = &mut d_leg => d.map_err(|e| (Leg::Decode, e))?,
        };
        if !d_resp.status().is_success() {
            // Decode refused or failed the request: its answer goes to the client at once, and
            // prefill's leg is dropped (vLLM aborts it there; what it finished meanwhile is
            // given back through `unclaimed`).
            return Ok(forward(d_resp, d_load, Some(unclaimed), self.stream_idle));
        }
        let status = d_resp.status();
        let content_type = d_resp.headers().get(reqwest::header::CONTENT_TYPE).cloned();
        let mut body = d_resp.bytes_stream();
        let first = tokio::select! {
            p = p_task.join() => {
                p.map_err(|e| prefill_failed(&mut unclaimed, e))?;
                None
            }
            chunk = body.next() => Some(chunk),
        };
        if first.is_some() {
            // Decode is answering before prefill did: let prefill finish on its own.
            p_task.detach();
        }
        Ok(respond(
            status,
            content_type,
            first,
            body,
            d_load,
            Some(unclaimed),
            self.stream_idle,
        ))
    }

    /// Prefill first, then decode with prefill's `kv_transfer_params`. A decode instance that
    /// cannot be reached never saw the request: the next one gets the same parameters, and the
    /// KV prefill holds for them is read by it instead of being computed again (the unreachable
    /// ones are added to `bad_decode`).
    async fn pull(
        &self,
        call: &Call,
        request: &Map<String, Value>,
        p: usize,
        mut d: usize,
        bad_decode: &mut Vec<usize>,
        transfer: &str,
    ) -> Result<Response, (Leg, LegError)> {
        let pi = &self.prefill[p];
        let p_body = prefill_body(
            request,
            json!({"do_remote_decode": true, "kvx_transfer_id": transfer}),
        );
        // Unclaimed from the start: a client that leaves while prefill computes or answers
        // (its answer can come long after it finished), or a prefill leg that fails after
        // reaching prefill, has prefill give back whatever it finished for this dispatch.
        let mut unclaimed = self.unclaimed(p, transfer);
        let params = {
            let _load = Load::new(pi);
            let r = self
                .send(pi, call, transfer, &p_body)
                .await
                .map_err(|e| prefill_failed(&mut unclaimed, e))?;
            check_prefill(r)
                .await
                .map_err(|e| prefill_failed(&mut unclaimed, e))?
        };
        let Some(Value::Object(mut params)) = params else {
            return Err((
                Leg::Prefill,
                LegError::Failed(ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    format!(
                        "prefill {} returned no kv_transfer_params: is it running KvxPullConnector?",
                        pi.url
                    ),
                )),
            ));
        };
        if let Some(kvx) = &pi.kvx {
            params.insert("kvx_prefill".into(), Value::String(kvx.clone()));
        }
        let d_body = decode_body(request, Value::Object(params));
        loop {
            let di = &self.decode[d];
            let d_load = Load::new(di);
            // Claimed while a decode instance may have the parameters (a read in progress is
            // invisible to prefill): during the leg, so that a client leaving meanwhile gives
            // nothing back, and after it, unless the instance could not be connected.
            let handed = unclaimed.hand_over();
            match self.send(di, call, transfer, &d_body).await {
                Err(LegError::Unreachable(why)) => {
                    unclaimed.take_back(handed);
                    bad_decode.push(d);
                    let Some(next) = self.pick_decode(bad_decode) else {
                        return Err((Leg::Decode, LegError::Unreachable(why)));
                    };
                    d = next;
                }
                answered => {
                    return answered
                        .map(|r| forward(r, d_load, None, self.stream_idle))
                        .map_err(|e| (Leg::Decode, e));
                }
            }
        }
    }
}

/// A dispatch's prefill leg failed: one that never reached prefill leaves nothing there to
/// give back (and its host is likely down: an abandon would only wait for its timeout).
fn prefill_failed(unclaimed: &mut Unclaimed, e: LegError) -> (Leg, LegError) {
    if matches!(e, LegError::Unreachable(_)) {
        unclaimed.claim();
    }
    (Leg::Prefill, e)
}

#[derive(Clone, Copy)]
enum Leg {
    Prefill,
    Decode,
}

/// The prefill leg's request: one output token, not streamed.
fn prefill_body(request: &Map<String, Value>, params: Value) -> Value {
    let mut b = request.clone();
    b.insert("max_tokens".into(), json!(1));
    b.remove("max_completion_tokens");
    b.remove("min_tokens");
    b.insert("stream".into(), json!(false));
    b.remove("stream_options");
    b.insert("n".into(), json!(1));
    b.insert("kv_transfer_params".into(), params);
    Value::Object(b)
}

/// The decode leg's request: the client's, with the transfer parameters.
fn decode_body(request: &Map<String, Value>, params: Value) -> Value {
    let mut b = request.clone();
    b.insert("kv_transfer_params".into(), params);
    Value::Object(b)
}

/// Sends one leg of `call` to `instance`, with the client's forwarded headers and the request
/// id both legs share, bounded by what is left of the call's time (the answer's body
/// included); an instance that cannot be connected is passed over for `skip`.
async fn send_leg(
    client: &reqwest::Client,
    instance: &Instance,
    skip: Duration,
    call: &Call,
    request_id: &str,
    body: &Value,
) -> Result<reqwest::Response, LegError> {
    let (url, path) = (&instance.url, call.path);
    let result = client
        .post(format!("{url}{path}"))
        .headers(call.headers.clone())
        .header("X-Request-Id", request_id)
        .timeout(call.deadline.saturating_duration_since(Instant::now()))
        .json(body)
        .send()
        .await;
    match result {
        Ok(r) => Ok(r),
        Err(e) if e.is_connect() => {
            let why = format!("{url}: {e}");
            instance.unreachable(skip, &why);
            Err(LegError::Unreachable(why))
        }
        Err(e) if e.is_timeout() => Err(LegError::Failed(ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            format!("{url}{path}: no answer within the request timeout"),
        ))),
        Err(e) => Err(LegError::Failed(ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!("{url}{path}: {e}"),
        ))),
    }
}

/// Tells the prefill instance at `kvx` (`HOST:PORT`) to give back the KV of `transfer`: at its
/// first IPv4 address, as decode reaches it (a name such as `localhost` often lists `::1` first
/// while prefill listens on IPv4), then at the others.
fn abandon_at(kvx: &str, transfer: &str, timeout: Duration) -> Result<u32, String> {
    let mut addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(kvx)
        .map_err(|e| e.to_string())?
        .collect();
    addrs.sort_by_key(|a| !a.is_ipv4());
    let mut last = "no address".to_owned();
    for addr in addrs {
        match kvx_vllm::router::abandon(
            addr,
            transfer,
            "the router gave the dispatch up: no decode instance took it in",
            timeout,
        ) {
            Ok(ranks) => return Ok(ranks),
            Err(e) => last = e.to_string(),
        }
    }
    Err(last)
}

/// Waits for prefill's answer; returns its `kv_transfer_params`.
async fn check_prefill(r: reqwest::Response) -> Result<Option<Value>, LegError> {
    let status = r.status();
    let url = r.url().to_string();
    let bytes = r.bytes().await.map_err(|e| {
        LegError::Failed(ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!("prefill {url} failed: {e}"),
        ))
    })?;
    if !status.is_success() {
        return Err(LegError::Failed(ApiError::new(
            StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY),
            format!("prefill {url}: {}", String::from_utf8_lossy(&bytes)),
        )));
    }
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
        LegError::Failed(ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!("prefill {url} answered something other than JSON: {e}"),
        ))
    })?;
    Ok(v.get("kv_transfer_params")
        .cloned()
        .filter(|p| !p.is_null()))
}

/// A server-sent event carrying an OpenAI-style error object.
fn error_event(message: &str) -> axum::body::Bytes {
    let event = json!({"error": {"object": "error", "message": message, "type": "BadGateway", "code": 502}});
    axum::body::Bytes::from(format!("data: {event}\n\n"))
}

/// Sends decode's answer to the client, streaming it through.
fn forward(
    r: reqwest::Response,
    load: Load,
    unclaimed: Option<Unclaimed>,
    idle: Option<Duration>,
) -> Response {
    let status = r.status();
    let content_type = r.headers().get(reqwest::header::CONTENT_TYPE).cloned();
    respond(
        status,
        content_type,
        None,
        r.bytes_stream(),
        load,
        unclaimed,
        idle,
    )
}

/// `body`'s pieces up to its first error, with a piece that does not come within `idle` of
/// the one before (the first piece is not timed) turned into an error; the stream ends after
/// an error, and dropping `body` closes decode's connection, which aborts the request there.
fn bounded_silence(
    body: impl futures_util::Stream<Item = Result<axum::body::Bytes, String>> + Send + 'static,
    idle: Option<Duration>,
) -> impl futures_util::Stream<Item = Result<axum::body::Bytes, String>> + Send + 'static {
    futures_util::stream::unfold(
        (Box::pin(body), false, false),
        move |(mut body, started, over)| async move {
            if over {
                return None;
            }
            let piece = match idle.filter(|_| started) {
                Some(idle) => tokio::time::timeout(idle, body.next())
                    .await
                    .unwrap_or_else(|_| {
                        Some(Err(format!(
                            "decode sent nothing for {} s",
                            idle.as_secs_f64()
                        )))
                    }),
                None => body.next().await,
            }?;
            let over = piece.is_err();
            Some((piece, (body, true, over)))
        },
    )
}

/// The client's response: `status`, the content type, then `first` (a chunk already read) and
/// the rest of `body`. The decode instance counts as loaded until the whole body has been sent;
/// a push dispatch's `unclaimed` is claimed as decode's answer shows it took the request in. An
/// event stream whose pieces stop coming for `idle` ends there ([`bounded_silence`]).
fn respond(
    status: reqwest::StatusCode,
    content_type: Option<reqwest::header::HeaderValue>,
    first: Option<Option<Result<axum::body::Bytes, reqwest::Error>>>,
    body: impl futures_util::Stream<Item = Result<axum::body::Bytes, reqwest::Error>> + Send + 'static,
    load: Load,
    mut unclaimed: Option<Unclaimed>,
    idle: Option<Duration>,
) -> Response {
    let status = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut headers = HeaderMap::new();
    let events = content_type
        .as_ref()
        .is_some_and(|ct| ct.as_bytes().starts_with(b"text/event-stream"));
    let success = status.is_success();
    if let Some(u) = unclaimed.as_mut().filter(|_| success && !events) {
        u.claim();
    }
    if let Some(v) = content_type.and_then(|ct| HeaderValue::from_bytes(ct.as_bytes()).ok()) {
        headers.insert(axum::http::header::CONTENT_TYPE, v);
    }
    // A stream that already ended (`Some(None)`) has nothing more to give.
    let ended = matches!(first, Some(None));
    let head = futures_util::stream::iter(first.flatten());
    let rest = futures_util::stream::iter((!ended).then_some(body)).flatten();
    let pieces = head
        .chain(rest)
        .map(|piece| piece.map_err(|e| e.to_string()));
    // A stream's silence is bounded; any other body comes whole at the end.
    let pieces = bounded_silence(pieces, idle.filter(|_| events));
    // An event stream that breaks off (`pieces` ends at its first error) ends with an error
    // event, as vLLM's own errors do, so that the client can tell a failed answer from a
    // finished one; any other body is cut.
    let body = pieces.map(move |piece| {
        let _ = &load;
        match piece {
            Ok(bytes) => {
                if let Some(u) = unclaimed.as_mut().filter(|_| success) {
                    u.claim();
                }
                Ok(bytes)
            }
            Err(e) if events => Ok(error_event(&format!("decode's answer broke off: {e}"))),
            Err(e) => Err(std::io::Error::other(e)),
        }
    });
    let mut resp = Response::new(Body::from_stream(body));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

/// The prefill leg's task: aborted when dropped (the client's request is over, or decode failed
/// first), unless detached.
struct AbortOnDrop(Option<tokio::task::JoinHandle<Result<Option<Value>, LegError>>>);

impl AbortOnDrop {
    /// Waits for the leg's outcome (a task that panicked or was aborted counts as a failed leg).
    async fn join(&mut self) -> Result<Option<Value>, LegError> {
        let Some(handle) = self.0.as_mut() else {
            return Err(LegError::Failed(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "the prefill leg was already collected",
            )));
        };
        let outcome = handle.await;
        self.0 = None;
        outcome.unwrap_or_else(|e| {
            Err(LegError::Failed(ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!("the prefill leg ended early: {e}"),
            )))
        })
    }

    /// Lets the leg run to its end on its own; a failure is reported on stderr.
    fn detach(&mut self) {
        if let Some(handle) = self.0.take() {
            tokio::spawn(async move {
                let why = match handle.await {
                    Ok(Ok(_)) => return,
                    Ok(Err(LegError::Failed(e))) => e.message,
                    Ok(Err(LegError::Unreachable(why))) => why,
                    Err(e) => e.to_string(),
                };
                eprintln!("kvx proxy: the prefill leg failed after decode had answered: {why}");
            });
        }
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(handle) = self.0.take() {
            handle.abort();
        }
    }
}

/// The client's request body as JSON; what cannot be read (too large, not JSON) is answered
/// in OpenAI's error format.
fn json_body(body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let bytes = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("the request body is not JSON: {e}"),
        )
    })
}

async fn completions(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let call = Call::new("/v1/completions", &headers, proxy.request_timeout);
    proxy.dispatch(call, json_body(body)?).await
}

async fn chat_completions(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let call = Call::new("/v1/chat/completions", &headers, proxy.request_timeout);
    proxy.dispatch(call, json_body(body)?).await
}

/// Decode's model list: from the first decode instance that answers, those passed over lately
/// last, each bounded by the connect timeout (plus a second to answer).
async fn models(State(proxy): State<Arc<Proxy>>, headers: HeaderMap) -> Result<Response, ApiError> {
    let call = Call::new("/v1/models", &headers, proxy.request_timeout);
    let now = Instant::now();
    let mut order: Vec<&Arc<Instance>> = proxy.decode.iter().collect();
    order.sort_by_key(|d| d.skipped(now));
    for d in order {
        if let Ok(r) = proxy
            .client
            .get(format!("{}{}", d.url, call.path))
            .headers(call.headers.clone())
            .timeout(proxy.connect_timeout + Duration::from_secs(1))
            .send()
            .await
        {
            let status =
                StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            let bytes = r
                .bytes()
                .await
                .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, e.to_string()))?;
            let mut resp = Response::new(Body::from(bytes));
            *resp.status_mut() = status;
            resp.headers_mut().insert(
                axum::http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            return Ok(resp);
        }
    }
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "no decode instance reachable",
    ))
}

async fn health() -> &'static str {
    "ok"
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
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
    let client = reqwest::Client::builder()
        .connect_timeout(connect)
        // Below vLLM's keep-alive (uvicorn's, `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, 5 s): a pooled
        // connection is never reused just as the server closes it.
        .pool_idle_timeout(Duration::from_secs(4))
        // The instances are reached directly, never through a proxy named by `HTTP_PROXY`.
        .no_proxy()
        .build()
        .context("cannot build the HTTP client")?;
    let instance = |url: &str, kvx: Option<String>| {
        Arc::new(Instance {
            url: url.trim_end_matches('/').to_owned(),
            kvx,
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
        next: AtomicU64::new(0),
        seed: random_seed(),
        request_timeout: total,
        stream_idle: (!stream_idle.is_zero()).then_some(stream_idle),
        max_request_bytes: args.max_request_mib.saturating_mul(1 << 20),
        skip_unreachable,
        connect_timeout: connect,
        abandons: Arc::new(tokio::sync::Semaphore::new(ABANDONS_IN_FLIGHT)),
    }))
}

fn app(proxy: Arc<Proxy>) -> Router {
    let limit = DefaultBodyLimit::max(proxy.max_request_bytes);
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .layer(limit)
        .with_state(proxy)
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
        axum::serve(without_nagle(listener), app(proxy))
            .with_graceful_shutdown(shutdown_signal())
            .await
            .context("server failed")
    })
}

/// The proxy's listener, every accepted connection with Nagle's algorithm off (`TCP_NODELAY`).
///
/// A streamed completion is a run of small writes: the headers, then an event per token. With
/// Nagle's algorithm on, a small write waits while the one before it is unacknowledged, and
/// the client acknowledges late (Linux delays an acknowledgement up to 40 ms): a first token
/// waited behind the headers, and tokens behind each other (`axum::serve` leaves the option
/// as the kernel sets it, on).
fn without_nagle(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = SocketAddr> {
    listener.tap_io(|stream| {
        if let Err(e) = stream.set_nodelay(true) {
            // The connection still works, only its small writes may wait.
            eprintln!("kvx proxy: cannot turn Nagle's algorithm off on a connection: {e}");
        }
    })
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
mod tests {
    use super::*;

    impl Proxy {
        /// A client request without headers.
        async fn route(&self, path: &'static str, body: Value) -> Result<Response, ApiError> {
            let call = Call::new(path, &HeaderMap::new(), self.request_timeout);
            self.dispatch(call, body).await
        }
    }

    #[test]
    fn prefill_addresses_parse() {
        assert_eq!(
            parse_prefill("http://127.0.0.1:8100@127.0.0.1:7100").unwrap(),
            Prefill {
                url: "http://127.0.0.1:8100".into(),
                kvx: "127.0.0.1:7100".into()
            }
        );
        assert!(parse_prefill("http://127.0.0.1:8100").is_err());
        assert!(parse_prefill("127.0.0.1:8100@127.0.0.1:7100").is_err());
        assert!(parse_prefill("http://h:1@nope").is_err());
        assert!(parse_prefill("https://127.0.0.1:8100@127.0.0.1:7100").is_err());
        assert_eq!(parse_url("http://d:8200/").unwrap(), "http://d:8200");
        for bad in ["d:8200", "https://d:8200", "http://", "http://:8200"] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn legs_carry_the_transfer_parameters() {
        let Value::Object(req) = json!({"prompt": "hi", "max_tokens": 50, "stream": true,
            "stream_options": {"include_usage": true}, "max_completion_tokens": 9})
        else {
            unreachable!()
        };
        let p = prefill_body(
            &req,
            json!({"do_remote_decode": true, "kvx_transfer_id": "t"}),
        );
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert!(p.get("stream_options").is_none() && p.get("max_completion_tokens").is_none());
        assert_eq!(p["kv_transfer_params"]["kvx_transfer_id"], "t");
        let d = decode_body(&req, json!({"do_remote_prefill": true}));
        assert_eq!(d["max_tokens"], 50);
        assert_eq!(d["stream"], true);
        assert_eq!(d["kv_transfer_params"]["do_remote_prefill"], true);
    }

    fn proxy(n: usize) -> Proxy {
        let args = ProxyArgs {
            mode: Mode::Push,
            listen: "127.0.0.1:0".parse().unwrap(),
            prefill: (0..n)
                .map(|i| Prefill {
                    url: format!("http://127.0.0.1:{}", 9000 + i),
                    kvx: "127.0.0.1:7100".into(),
                })
                .collect(),
            decode: vec!["http://127.0.0.1:9999".into()],
            connect_timeout_s: 1.0,
            request_timeout_s: 5.0,
            stream_idle_timeout_s: 120.0,
            skip_unreachable_s: 2.0,
            max_request_mib: 1,
        };
        Arc::into_inner(build(&args).unwrap()).unwrap()
    }

    #[test]
    fn the_least_loaded_instance_is_picked() {
        let p = proxy(3);
        let _a = Load::new(&p.prefill[0]);
        let _b = Load::new(&p.prefill[0]);
        let _c = Load::new(&p.prefill[2]);
        for _ in 0..5 {
            assert_eq!(p.pick_prefill(&[]), Some(1));
        }
        assert_eq!(p.pick_prefill(&[1]), Some(2));
        assert_eq!(p.pick_prefill(&[0, 1, 2]), None);
        drop(_a);
        drop(_b);
        assert_ne!(p.pick_prefill(&[1]), Some(2));
    }

    #[test]
    fn transfer_ids_are_fresh() {
        let p = proxy(1);
        let ids: std::collections::HashSet<String> = (0..100).map(|_| p.transfer_id()).collect();
        assert_eq!(ids.len(), 100);
    }

    #[test]
    fn unreachable_instances_give_503() {
        let p = Arc::new(proxy(2));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let err = rt
            .block_on(p.route("/v1/completions", json!({"prompt": "x"})))
            .unwrap_err();
        assert_eq!(
            err.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            err.message
        );
        assert!(err.message.contains("reachable"), "{}", err.message);
    }

    /// A fake vLLM instance on a free port: answers `/v1/completions` with `body` and `status`
    /// after `delay`, and counts the requests it answered to the end.
    async fn fake_instance(
        status: u16,
        body: &'static str,
        delay: Duration,
    ) -> (String, Arc<AtomicUsize>) {
        let done = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&done);
        let app = Router::new().route(
            "/v1/completions",
            post(move || {
                let counter = Arc::clone(&counter);
                async move {
                    tokio::time::sleep(delay).await;
                    counter.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::from_u16(status).unwrap(), body)
                }
            }),
        );
        (serve(app).await, done)
    }

    /// Serves `app` on a free port of 127.0.0.1; returns its URL.
    async fn serve(app: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    fn push_proxy(prefill: &str, decode: &str) -> Arc<Proxy> {
        test_proxy(Mode::Push, prefill, &[decode], 2.0)
    }

    /// A proxy for one prefill instance (whose kvx control port nobody listens on) and
    /// `decodes`.
    fn test_proxy(
        mode: Mode,
        prefill: &str,
        decodes: &[&str],
        skip_unreachable_s: f64,
    ) -> Arc<Proxy> {
        // Port 1: nothing listens there, and no test's listener can take it.
        proxy_with_control(mode, prefill, "127.0.0.1:1", decodes, skip_unreachable_s)
    }

    /// A proxy for one prefill instance with kvx control address `kvx`, and `decodes`.
    fn proxy_with_control(
        mode: Mode,
        prefill: &str,
        kvx: &str,
        decodes: &[&str],
        skip_unreachable_s: f64,
    ) -> Arc<Proxy> {
        build(&test_args(mode, prefill, kvx, decodes, skip_unreachable_s)).unwrap()
    }

    /// The arguments of [`proxy_with_control`]'s proxy.
    fn test_args(
        mode: Mode,
        prefill: &str,
        kvx: &str,
        decodes: &[&str],
        skip_unreachable_s: f64,
    ) -> ProxyArgs {
        ProxyArgs {
            mode,
            listen: "127.0.0.1:0".parse().unwrap(),
            prefill: vec![Prefill {
                url: prefill.into(),
                kvx: kvx.into(),
            }],
            decode: decodes.iter().map(|&d| d.to_owned()).collect(),
            connect_timeout_s: 1.0,
            request_timeout_s: 10.0,
            stream_idle_timeout_s: 120.0,
            skip_unreachable_s,
            max_request_mib: 1,
        }
    }

    /// A prefill rank's kvx control port as a router sees it (one rank): it answers a
    /// router's hello with a producer's and records the transfers aborted; returns its
    /// address and that record.
    fn fake_prefill_control() -> (String, Arc<Mutex<Vec<kvx_core::TransferId>>>) {
        use kvx_core::wire::{FrameHeader, Hello, Message, Role, HEADER_LEN};
        use kvx_core::{EngineId, Incarnation};
        use std::io::{Read as _, Write as _};

        fn read(s: &mut std::net::TcpStream) -> Option<Message> {
            let mut header = [0; HEADER_LEN];
            s.read_exact(&mut header).ok()?;
            let header = FrameHeader::parse(&header).unwrap();
            let mut payload = vec![0; header.payload_len as usize];
            s.read_exact(&mut payload).ok()?;
            Some(Message::decode_payload(header.kind, &payload).unwrap())
        }
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let aborted = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&aborted);
        std::thread::spawn(move || {
            for mut s in listener.incoming().map_while(Result::ok) {
                let Some(Message::Hello(theirs)) = read(&mut s) else {
                    continue;
                };
                assert_eq!(theirs.role, Role::Router);
                let mut mine = Hello::router(EngineId(1), Incarnation(1));
                mine.role = Role::Producer;
                mine.layout.tp_size = 1;
                s.write_all(&Message::Hello(mine).to_bytes().unwrap())
                    .unwrap();
                while let Some(m) = read(&mut s) {
                    if let Message::Abort(a) = m {
                        record.lock().unwrap().push(a.transfer);
                    }
                }
            }
        });
        (addr, aborted)
    }

    /// Waits up to 5 s for `record` to hold `n` entries; returns them.
    async fn wait_recorded<T: Clone>(record: &Mutex<Vec<T>>, n: usize) -> Vec<T> {
        for _ in 0..500 {
            if record.lock().unwrap().len() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        record.lock().unwrap().clone()
    }

    /// The URL of an instance that is down: a port nobody listens on.
    fn dead_url() -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    }

    /// Sends `n` requests one after the other; each must be answered 200.
    async fn route_ok(proxy: &Proxy, n: usize) {
        for _ in 0..n {
            let r = proxy
                .route("/v1/completions", json!({"prompt": "x"}))
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::OK);
        }
    }

    /// A client that gives up on its request after `patience`, before `who` answered it.
    async fn client_gives_up(proxy: &Proxy, patience: Duration, who: &str) {
        let gone = tokio::time::timeout(
            patience,
            proxy.route("/v1/completions", json!({"prompt": "x"})),
        )
        .await;
        assert!(gone.is_err(), "{who} answered before the client left");
    }

    async fn body_of(r: Response) -> String {
        let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    /// The proxy's listener turns Nagle's algorithm off on every connection it accepts; the
    /// kernel's default, which a plain listener keeps, is on.
    #[test]
    fn client_connections_have_nagles_algorithm_off() {
        use axum::serve::Listener as _;
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = plain.local_addr().unwrap();
            let (accepted, _client) =
                tokio::join!(plain.accept(), tokio::net::TcpStream::connect(addr));
            assert!(!accepted.unwrap().0.nodelay().unwrap());

            let mut listener =
                without_nagle(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
            let addr = listener.local_addr().unwrap();
            let ((accepted, _), _client) =
                tokio::join!(listener.accept(), tokio::net::TcpStream::connect(addr));
            assert!(accepted.nodelay().unwrap());
        });
    }

    /// Decode's answer goes to the client as soon as it comes, not after prefill's HTTP answer
    /// (which a busy prefill API server can send long after the KV); prefill's request still
    /// runs to its end.
    #[test]
    fn push_forwards_decode_without_waiting_for_a_slow_prefill_answer() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (p_url, p_done) = fake_instance(
                200,
                r#"{"kv_transfer_params":null}"#,
                Duration::from_secs(2),
            )
            .await;
            let (d_url, _) = fake_instance(200, r#"{"text":"decoded"}"#, Duration::ZERO).await;
            let proxy = push_proxy(&p_url, &d_url);
            let started = std::time::Instant::now();
            let r = proxy
                .route("/v1/completions", json!({"prompt": "x"}))
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            assert_eq!(body_of(r).await, r#"{"text":"decoded"}"#);
            let took = started.elapsed();
            assert!(took < Duration::from_secs(1), "waited {took:?} for prefill");
            // The prefill leg was not aborted: it finishes on its own.
            tokio::time::sleep(Duration::from_millis(2500)).await;
            assert_eq!(p_done.load(Ordering::SeqCst), 1);
        });
    }

    /// A decode stream that breaks off reaches the client as the events so far and an error
    /// event, not as a stream that just stops.
    #[test]
    fn a_broken_decode_stream_ends_with_an_error_event() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (p_url, _) = fake_instance(200, "{}", Duration::ZERO).await;
            let app = Router::new().route(
                "/v1/completions",
                post(|| async {
                    let chunks: Vec<Result<&'static str, std::io::Error>> = vec![
                        Ok("data: {\"text\":\"a\"}\n\n"),
                        Err(std::io::Error::other("decode died")),
                    ];
                    // The break comes after the first event has gone out.
                    let paced = futures_util::stream::iter(chunks).then(|chunk| async move {
                        if chunk.is_err() {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        chunk
                    });
                    let mut resp = Response::new(Body::from_stream(paced));
                    resp.headers_mut().insert(
                        axum::http::header::CONTENT_TYPE,
                        HeaderValue::from_static("text/event-stream"),
                    );
                    resp
                }),
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let d_url = format!("http://{}", listener.local_addr().unwrap());
            tokio::spawn(async move { axum::serve(listener, app).await });
            let proxy = push_proxy(&p_url, &d_url);
            let r = proxy
                .route("/v1/completions", json!({"prompt": "x", "stream": true}))
                .await
                .unwrap();
            let body = body_of(r).await;
            let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
            assert_eq!(events.len(), 2, "{body}");
            assert_eq!(events[0], r#"data: {"text":"a"}"#);
            let error: serde_json::Value =
                serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(error["error"]["code"], 502, "{body}");
        });
    }

    /// A decode instance answering `/v1/completions` with `pieces` (each after its delay) under
    /// `content_type`, then nothing more while keeping the connection open when `hang`;
    /// `dropped` is set once its answer's stream is dropped (its connection closed).
    async fn paced_instance(
        pieces: Vec<(Duration, &'static str)>,
        content_type: &'static str,
        hang: bool,
    ) -> (String, Arc<std::sync::atomic::AtomicBool>) {
        struct SetOnDrop(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for SetOnDrop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&dropped);
        let app = Router::new().route(
            "/v1/completions",
            post(move || {
                let (pieces, guard) = (pieces.clone(), SetOnDrop(Arc::clone(&flag)));
                async move {
                    let paced =
                        futures_util::stream::iter(pieces).then(|(delay, piece)| async move {
                            tokio::time::sleep(delay).await;
                            Ok::<_, std::io::Error>(piece)
                        });
                    let tail = futures_util::stream::iter(hang.then(|| {
                        futures_util::stream::pending::<Result<&'static str, std::io::Error>>()
                    }))
                    .flatten();
                    let body = paced.chain(tail).map(move |piece| {
                        let _ = &guard;
                        piece
                    });
                    let mut resp = Response::new(Body::from_stream(body));
                    resp.headers_mut().insert(
                        axum::http::header::CONTENT_TYPE,
                        HeaderValue::from_static(content_type),
                    );
                    resp
                }
            }),
        );
        (serve(app).await, dropped)
    }

    /// A decode that stops sending mid-stream (hung, its host stopped) ends the client's
    /// stream with an error event at the silence bound, not at the request timeout, and its
    /// connection is closed (vLLM aborts the request then).
    #[test]
    fn a_stream_that_falls_silent_ends_at_the_idle_bound() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (p_url, _) = fake_instance(200, "{}", Duration::ZERO).await;
            let (d_url, dropped) = paced_instance(
                vec![(Duration::ZERO, "data: {\"text\":\"a\"}\n\n")],
                "text/event-stream",
                true,
            )
            .await;
            let proxy = build(&ProxyArgs {
                stream_idle_timeout_s: 0.3,
                ..test_args(Mode::Push, &p_url, "127.0.0.1:1", &[&d_url], 2.0)
            })
            .unwrap();
            let t0 = Instant::now();
            let r = proxy
                .route("/v1/completions", json!({"prompt": "x", "stream": true}))
                .await
                .unwrap();
            let body = body_of(r).await;
            let waited = t0.elapsed();
            assert!(
                waited < Duration::from_secs(5),
                "{waited:?} (the request timeout is 10 s)"
            );
            assert!(waited >= Duration::from_millis(300), "{waited:?}");
            let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
            assert_eq!(events.len(), 2, "{body}");
            assert_eq!(events[0], r#"data: {"text":"a"}"#);
            let error: Value =
                serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(error["error"]["code"], 502, "{body}");
            let message = error["error"]["message"].as_str().unwrap();
            assert!(
                message.contains("decode sent nothing for 0.3 s"),
                "{message}"
            );
            let t1 = Instant::now();
            while !dropped.load(Ordering::SeqCst) {
                assert!(
                    t1.elapsed() < Duration::from_secs(5),
                    "decode's connection stayed open"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
    }

    /// Pauses shorter than the bound, the wait for a stream's first piece, and any wait within a
    /// body that is not an event stream (it comes whole at the end) are not cut.
    #[test]
    fn pauses_within_the_idle_bound_and_whole_bodies_pass() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (p_url, _) = fake_instance(200, "{}", Duration::ZERO).await;
            let ms = Duration::from_millis;
            let (stream_url, _) = paced_instance(
                vec![
                    (ms(700), "data: {\"text\":\"a\"}\n\n"),
                    (ms(200), "data: {\"text\":\"b\"}\n\n"),
                    (ms(200), "data: [DONE]\n\n"),
                ],
                "text/event-stream",
                false,
            )
            .await;
            let (json_url, _) = paced_instance(
                vec![(ms(0), "{\"a\":"), (ms(700), "1}")],
                "application/json",
                false,
            )
            .await;
            for (d_url, want) in [
                (
                    &stream_url,
                    "data: {\"text\":\"a\"}\n\ndata: {\"text\":\"b\"}\n\ndata: [DONE]\n\n",
                ),
                (&json_url, "{\"a\":1}"),
            ] {
                let proxy = build(&ProxyArgs {
                    stream_idle_timeout_s: 0.4,
                    ..test_args(Mode::Push, &p_url, "127.0.0.1:1", &[d_url], 2.0)
                })
                .unwrap();
                let r = proxy
                    .route("/v1/completions", json!({"prompt": "x", "stream": true}))
                    .await
                    .unwrap();
                assert_eq!(body_of(r).await, want);
            }
        });
    }

    /// A prefill that fails before decode has answered ends the request with prefill's error.
    #[test]
    fn push_returns_prefill_failure_when_it_comes_first() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (p_url, _) = fake_instance(500, "engine died", Duration::ZERO).await;
            let (d_url, d_done) =
                fake_instance(200, r#"{"text":"late"}"#, Duration::from_secs(2)).await;
            let proxy = push_proxy(&p_url, &d_url);
            let err = proxy
                .route("/v1/completions", json!({"prompt": "x"}))
                .await
                .unwrap_err();
            assert_eq!(err.status, StatusCode::INTERNAL_SERVER_ERROR);
            assert!(err.message.contains("engine died"), "{}", err.message);
            tokio::time::sleep(Duration::from_millis(2500)).await;
            assert_eq!(
                d_done.load(Ordering::SeqCst),
                0,
                "decode's leg should have been dropped"
            );
        });
    }

    /// An instance that answers `/v1/completions` with 200 and no choices, and records each
    /// request's `kv_transfer_params.kvx_transfer_id`.
    async fn recording_instance() -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let app = Router::new().route(
            "/v1/completions",
            post(move |axum::Json(body): axum::Json<Value>| {
                let log = Arc::clone(&log);
                async move {
                    let id = body["kv_transfer_params"]["kvx_transfer_id"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    log.lock().unwrap().push(id);
                    (StatusCode::OK, r#"{"choices":[]}"#)
                }
            }),
        );
        (serve(app).await, seen)
    }

    /// Pull: a decode instance that is down never saw the request, so the next one gets the
    /// same prefilled KV (the same transfer id and parameters); prefill runs once per request.
    #[test]
    fn pull_sends_the_prefilled_kv_to_another_decode_when_one_is_down() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let p_seen = Arc::new(std::sync::Mutex::new(Vec::new()));
            let log = Arc::clone(&p_seen);
            let prefill = Router::new().route(
                "/v1/completions",
                post(move |headers: HeaderMap| {
                    let log = Arc::clone(&log);
                    async move {
                        let id = headers["x-request-id"].to_str().unwrap().to_owned();
                        log.lock().unwrap().push(id.clone());
                        axum::Json(json!({"choices": [], "kv_transfer_params": {
                            "do_remote_prefill": true, "kvx_transfer_id": id}}))
                    }
                }),
            );
            let p_url = serve(prefill).await;
            let (d_url, d_seen) = recording_instance().await;
            let down = dead_url();
            let (kvx, aborted) = fake_prefill_control();
            let proxy = proxy_with_control(Mode::Pull, &p_url, &kvx, &[&down, &d_url], 2.0);
            // Equally loaded instances are picked round-robin, and each dispatch moves the
            // turn on by an odd count: some of these meet the dead decode first.
            route_ok(&proxy, 4).await;
            let p_ids = p_seen.lock().unwrap().clone();
            let d_ids = d_seen.lock().unwrap().clone();
            assert_eq!(proxy.decode[0].unreachable.load(Ordering::Relaxed), 1);
            assert_eq!(p_ids.len(), 4, "prefill ran again for a retry: {p_ids:?}");
            assert_eq!(d_ids, p_ids);
            // Every dispatch reached a decode: prefill is told to give nothing back.
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(aborted.lock().unwrap().is_empty());

            // With every decode down the client gets a 503 naming decode.
            let prefill = serve(Router::new().route(
                "/v1/completions",
                post(|| async { axum::Json(json!({"choices": [], "kv_transfer_params": {}})) }),
            ))
            .await;
            let (kvx, aborted) = fake_prefill_control();
            let proxy = proxy_with_control(Mode::Pull, &prefill, &kvx, &[&down], 2.0);
            let e = proxy
                .route("/v1/completions", json!({"prompt": "x"}))
                .await
                .unwrap_err();
            assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
            assert!(e.message.contains("decode"), "{}", e.message);
            // ... and prefill is told to give back the KV it holds for the one dispatch.
            assert_eq!(wait_recorded(&aborted, 1).await.len(), 1);
        });
    }

    /// A decode instance that is down: the proxy dispatches again to another, with a fresh
    /// transfer id for both legs (prefill's first request, under the old id, is not reused).
    #[test]
    fn push_retries_on_another_decode_with_a_fresh_transfer_id() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (p_url, p_seen) = recording_instance().await;
            let (d_url, d_seen) = recording_instance().await;
            let down = dead_url();
            let (kvx, aborted) = fake_prefill_control();
            // Not passed over: every request that picks the dead decode first meets it.
            let proxy = proxy_with_control(Mode::Push, &p_url, &kvx, &[&down, &d_url], 0.0);
            // Round-robin among equally loaded instances: some of these go to the dead one.
            route_ok(&proxy, 4).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            let d_ids = d_seen.lock().unwrap().clone();
            let p_ids = p_seen.lock().unwrap().clone();
            assert_eq!(d_ids.len(), 4, "{d_ids:?}");
            assert!(p_ids.len() > 4, "no request met the dead decode: {p_ids:?}");
            let distinct: std::collections::HashSet<&String> = p_ids.iter().collect();
            assert_eq!(
                distinct.len(),
                p_ids.len(),
                "an id was dispatched twice: {p_ids:?}"
            );
            assert!(
                d_ids.iter().all(|id| p_ids.contains(id)),
                "{d_ids:?} {p_ids:?}"
            );
            // Prefill was told to give back the KV of each dispatch no decode saw (its prefill
            // leg may have been dropped before it reached prefill), and of no other.
            let hash = |id: &String| kvx_core::TransferId::from_str_hash(id);
            let met_dead = proxy.decode[0].unreachable.load(Ordering::Relaxed) as usize;
            let told = wait_recorded(&aborted, met_dead).await;
            assert_eq!(told.len(), met_dead, "{told:?}");
            assert!(d_ids.iter().all(|id| !told.contains(&hash(id))));
            assert!(p_ids
                .iter()
                .filter(|id| !d_ids.contains(id))
                .all(|id| told.contains(&hash(id))));
        });
    }

    /// Push: a dispatch whose decode refused the request or failed it, or whose client went
    /// away before decode answered, has prefill give its KV back (decode never registered it,
    /// so nobody else would before prefill's lease); a dispatch decode answered, as a whole
    /// answer or as the first piece of a stream, does not.
    #[test]
    fn push_has_prefill_give_back_the_kv_of_a_dispatch_decode_did_not_take() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (p_url, p_seen) = recording_instance().await;
            let (kvx, aborted) = fake_prefill_control();
            let hash = |id: &String| kvx_core::TransferId::from_str_hash(id);
            let last = |seen: &Mutex<Vec<String>>| hash(seen.lock().unwrap().last().unwrap());

            // Decode refuses the request (as vLLM does one longer than its context).
            let (refusing, _) =
                fake_instance(400, r#"{"error":{"message":"too long"}}"#, Duration::ZERO).await;
            let proxy = proxy_with_control(Mode::Push, &p_url, &kvx, &[&refusing], 0.0);
            let r = proxy
                .route("/v1/completions", json!({"prompt": "x"}))
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST);
            assert!(body_of(r).await.contains("too long"));
            assert_eq!(wait_recorded(&aborted, 1).await, vec![last(&p_seen)]);

            // The client goes away while decode still works on the request.
            let (slow, _) = fake_instance(200, r#"{"text":"late"}"#, Duration::from_secs(5)).await;
            let proxy = proxy_with_control(Mode::Push, &p_url, &kvx, &[&slow], 0.0);
            client_gives_up(&proxy, Duration::from_millis(300), "decode").await;
            let told = wait_recorded(&aborted, 2).await;
            assert_eq!(told.len(), 2, "{told:?}");
            assert_eq!(told[1], last(&p_seen));

            // Decode answers, whole or as a stream whose first piece has come: nothing is
            // given back.
            let (d_url, _) = recording_instance().await;
            let proxy = proxy_with_control(Mode::Push, &p_url, &kvx, &[&d_url], 0.0);
            route_ok(&proxy, 2).await;
            let stream = serve(Router::new().route(
                "/v1/completions",
                post(|| async {
                    let mut resp = Response::new(Body::from("data: {\"text\":\"a\"}\n\n"));
                    resp.headers_mut().insert(
                        axum::http::header::CONTENT_TYPE,
                        HeaderValue::from_static("text/event-stream"),
                    );
                    resp
                }),
            ))
            .await;
            let proxy = proxy_with_control(Mode::Push, &p_url, &kvx, &[&stream], 0.0);
            let r = proxy
                .route("/v1/completions", json!({"prompt": "x", "stream": true}))
                .await
                .unwrap();
            assert!(body_of(r).await.contains("text"));
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(
                aborted.lock().unwrap().len(),
                2,
                "{:?}",
                aborted.lock().unwrap()
            );
        });
    }

    /// Push: a decode that refuses the request is answered at once, without waiting for a
    /// slow prefill leg (which is dropped, and its KV given back).
    #[test]
    fn push_answers_decodes_refusal_without_waiting_for_prefill() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (p_url, p_done) = fake_instance(200, "{}", Duration::from_secs(3)).await;
            let (refusing, _) =
                fake_instance(400, r#"{"error":{"message":"too long"}}"#, Duration::ZERO).await;
            let (kvx, aborted) = fake_prefill_control();
            let proxy = proxy_with_control(Mode::Push, &p_url, &kvx, &[&refusing], 0.0);
            let t0 = Instant::now();
            let r = proxy
                .route("/v1/completions", json!({"prompt": "x"}))
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST);
            assert!(body_of(r).await.contains("too long"));
            assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
            assert_eq!(wait_recorded(&aborted, 1).await.len(), 1);
            tokio::time::sleep(Duration::from_millis(3500)).await;
            assert_eq!(p_done.load(Ordering::SeqCst), 0, "prefill's leg ran on");
        });
    }

    /// Pull: a client that leaves while prefill computes has prefill give back what it
    /// finished; one that leaves while decode answers (and may be reading prefill's KV) has
    /// nothing given back.
    #[test]
    fn pull_gives_back_only_what_no_decode_may_be_reading() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let prefill = |delay: Duration| {
                Router::new().route(
                    "/v1/completions",
                    post(move || async move {
                        tokio::time::sleep(delay).await;
                        axum::Json(json!({"choices": [], "kv_transfer_params": {"x": 1}}))
                    }),
                )
            };
            let (kvx, aborted) = fake_prefill_control();
            let (d_url, _) = recording_instance().await;
            let slow_prefill = serve(prefill(Duration::from_secs(5))).await;
            let proxy = proxy_with_control(Mode::Pull, &slow_prefill, &kvx, &[&d_url], 0.0);
            client_gives_up(&proxy, Duration::from_millis(300), "prefill").await;
            assert_eq!(wait_recorded(&aborted, 1).await.len(), 1);

            let fast_prefill = serve(prefill(Duration::ZERO)).await;
            let (slow_decode, _) =
                fake_instance(200, r#"{"text":"late"}"#, Duration::from_secs(5)).await;
            let proxy = proxy_with_control(Mode::Pull, &fast_prefill, &kvx, &[&slow_decode], 0.0);
            client_gives_up(&proxy, Duration::from_millis(500), "decode").await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(
                aborted.lock().unwrap().len(),
                1,
                "a dispatch decode had was given back"
            );
        });
    }

    /// Equally loaded instances take turns in each pool, whatever the pools' sizes (the turn
    /// of one pool does not move with the other's picks or with transfer ids).
    #[test]
    fn idle_instances_take_turns() {
        let p = proxy(3);
        for _ in 0..4 {
            // Three dispatches, each picking a decode and numbering a transfer beside.
            let turn: Vec<usize> = (0..3)
                .map(|_| {
                    let prefill = p.pick_prefill(&[]).unwrap();
                    assert_eq!(p.pick_decode(&[]), Some(0));
                    let _ = p.transfer_id();
                    prefill
                })
                .collect();
            let mut sorted = turn.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, vec![0, 1, 2], "{turn:?}");
        }
    }

    /// The proxy as a client sees it: the client's credentials and trace context reach both
    /// legs; a body that is not JSON, or too large, is answered in OpenAI's error format; a
    /// request over its time is answered 504.
    #[test]
    fn clients_headers_bodies_and_deadlines() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let seen = Arc::new(Mutex::new(Vec::new()));
            let log = Arc::clone(&seen);
            let instance = serve(Router::new().route(
                "/v1/completions",
                post(move |headers: HeaderMap| {
                    let log = Arc::clone(&log);
                    async move {
                        let auth = headers.get("authorization").cloned();
                        log.lock().unwrap().push(auth);
                        axum::Json(json!({"choices": [], "kv_transfer_params": {"x": 1}}))
                    }
                }),
            ))
            .await;
            let proxy = proxy_with_control(Mode::Pull, &instance, "127.0.0.1:1", &[&instance], 0.0);
            let url = serve(app(proxy)).await;
            let client = reqwest::Client::new();
            let r = client
                .post(format!("{url}/v1/completions"))
                .header("Authorization", "Bearer sesame")
                .header("Cookie", "not-forwarded")
                .json(&json!({"prompt": "x"}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), reqwest::StatusCode::OK);
            let bearer = Some(HeaderValue::from_static("Bearer sesame"));
            assert_eq!(*seen.lock().unwrap(), vec![bearer.clone(), bearer]);

            for (body, status) in [
                ("{not json".to_owned(), 400),
                (format!("{{\"prompt\": \"{}\"}}", "x".repeat(2 << 20)), 413),
            ] {
                let r = client
                    .post(format!("{url}/v1/completions"))
                    .header("Content-Type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status().as_u16(), status);
                let v: Value = r.json().await.unwrap();
                assert!(v["error"]["message"].is_string(), "{v}");
            }

            let (slow, _) = fake_instance(200, "{}", Duration::from_secs(3)).await;
            let proxy = build(&ProxyArgs {
                request_timeout_s: 0.5,
                ..test_args(Mode::Push, &slow, "127.0.0.1:1", &[&slow], 0.0)
            })
            .unwrap();
            let t0 = Instant::now();
            let e = proxy
                .route("/v1/completions", json!({"prompt": "x"}))
                .await
                .unwrap_err();
            assert_eq!(e.status, StatusCode::GATEWAY_TIMEOUT, "{}", e.message);
            assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        });
    }

    /// A decode host that does not answer connections (a listener whose backlog is full drops
    /// the SYNs) counts as unreachable once the connect timeout has passed: prefill, which
    /// answered meanwhile, is told to give that dispatch's KV back.
    #[test]
    fn a_decode_that_does_not_answer_connections_has_prefill_give_the_kv_back() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (p_url, p_seen) = recording_instance().await;
            let silent = tokio::net::TcpSocket::new_v4().unwrap();
            silent.bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let silent = silent.listen(0).unwrap();
            let addr = silent.local_addr().unwrap();
            let _filler = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (kvx, aborted) = fake_prefill_control();
            let proxy =
                proxy_with_control(Mode::Push, &p_url, &kvx, &[&format!("http://{addr}")], 2.0);
            let e = proxy
                .route("/v1/completions", json!({"prompt": "x"}))
                .await
                .unwrap_err();
            assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE, "{}", e.message);
            let p_ids = p_seen.lock().unwrap().clone();
            assert_eq!(p_ids.len(), 1, "prefill answered before the timeout");
            assert_eq!(
                wait_recorded(&aborted, 1).await,
                vec![kvx_core::TransferId::from_str_hash(&p_ids[0])]
            );
        });
    }

    /// An instance that refused a connection is passed over for `--skip-unreachable-s`: later
    /// requests go to the others without trying it first, and to it only when no other is left.
    #[test]
    fn an_unreachable_instance_is_passed_over_for_a_while() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (p_url, _) = recording_instance().await;
            let (d_url, d_seen) = recording_instance().await;
            let down = dead_url();
            let proxy = test_proxy(Mode::Push, &p_url, &[&down, &d_url], 30.0);
            // Round-robin would send every other request to the dead decode first.
            route_ok(&proxy, 8).await;
            assert_eq!(proxy.decode[0].unreachable.load(Ordering::Relaxed), 1);
            assert_eq!(d_seen.lock().unwrap().len(), 8);

            let proxy = test_proxy(Mode::Push, &p_url, &[&down], 30.0);
            for tried in 1..=2 {
                let e = proxy
                    .route("/v1/completions", json!({"prompt": "x"}))
                    .await
                    .unwrap_err();
                assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
                assert_eq!(proxy.decode[0].unreachable.load(Ordering::Relaxed), tried);
            }
        });
    }
}
