//! Routing one client request: picking the least loaded instances, then push (both legs at once)
//! or pull (prefill, then decode with prefill's parameters), with retries on instances that
//! cannot be connected.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use futures_util::StreamExt as _;
use kvx_vllm::trace::TraceContext;
use serde_json::{json, Map, Value};
use tracing::Instrument as _;

use super::abandon::{Abandoner, Unclaimed};
use super::http::ApiError;
use super::stream::{forward, respond};
use super::{Instance, Load, Mode, Proxy};

/// Why one leg failed: the instance could not be reached (try another), or it answered badly.
pub(super) enum LegError {
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
pub(super) struct Call {
    pub(super) path: &'static str,
    /// The client's headers that go on to the instances ([`FORWARDED_HEADERS`]).
    pub(super) headers: HeaderMap,
    /// When the whole request must be over.
    pub(super) deadline: Instant,
    /// When the client's request arrived.
    pub(super) started: Instant,
    /// The trace the client's request belongs to (its `traceparent`, else a new one), and the
    /// proxy's dispatch span in it: the parent of the instances' spans.
    pub(super) trace: TraceContext,
    /// The client's span (its `traceparent`'s), if it sent one.
    pub(super) client_span: Option<u64>,
    /// The proxy's dispatch span.
    pub(super) span_id: u64,
}

impl Call {
    pub(super) fn new(path: &'static str, client_headers: &HeaderMap, timeout: Duration) -> Self {
        let mut headers = HeaderMap::new();
        for name in FORWARDED_HEADERS {
            for value in client_headers.get_all(name) {
                headers.append(name, value.clone());
            }
        }
        let started = Instant::now();
        let client = client_headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<TraceContext>().ok());
        let span_id = kvx_vllm::trace::random_span_id();
        let trace =
            client.map_or_else(|| TraceContext::new_trace(span_id), |c| c.child_of(span_id));
        // The instances see the proxy's dispatch as the parent of their work.
        if let Ok(value) = trace.to_string().parse() {
            headers.insert("traceparent", value);
        }
        Self {
            path,
            headers,
            deadline: started + timeout,
            started,
            trace,
            client_span: client.map(|c| c.parent_span),
            span_id,
        }
    }

    /// The span of this dispatch (`kvx.dispatch`), under the client's trace.
    pub(super) fn span(&self, mode: Mode) -> tracing::Span {
        tracing::info_span!(
            target: "kvx_trace",
            "kvx.dispatch",
            trace_id = %self.trace.trace_hex(),
            parent_span_id = %self.client_span.map(|s| format!("{s:016x}")).unwrap_or_default(),
            span_id = %format!("{:016x}", self.span_id),
            mode = ?mode,
            path = self.path,
        )
    }
}

impl Proxy {
    pub(super) fn pick_prefill(&self, exclude: &[usize]) -> Option<usize> {
        least_loaded(&self.prefill, &self.prefill_turn, exclude)
    }

    pub(super) fn pick_decode(&self, exclude: &[usize]) -> Option<usize> {
        least_loaded(&self.decode, &self.decode_turn, exclude)
    }

    /// `transfer`'s KV on prefill instance `p`, not claimed by a decode yet (nothing to give
    /// back where the proxy was not given that instance's kvx control address).
    pub(super) fn unclaimed(&self, p: usize, transfer: &str) -> Unclaimed {
        let abandoner = self.prefill[p].kvx.clone().map(|kvx| Abandoner {
            kvx,
            timeout: self.connect_timeout,
            abandons: Arc::clone(&self.abandons),
            key: self.auth_key.clone(),
        });
        Unclaimed {
            abandoner,
            transfer: transfer.to_owned(),
        }
    }

    /// The decode leg's `kv_transfer_params`: `params` with, where the proxy has the
    /// deployment key, a capability for `transfer` naming decode instance `d` and the prefill
    /// control address `kvx`, valid until the call's deadline.
    pub(super) fn with_capability(
        &self,
        mut params: Map<String, Value>,
        call: &Call,
        d: usize,
        kvx: &str,
        transfer: &str,
    ) -> Value {
        if let Some(key) = &self.auth_key {
            let left = call.deadline.saturating_duration_since(Instant::now());
            let capability = key.grant(
                kvx_core::TransferId::from_str_hash(transfer),
                self.decode[d].engine,
                kvx,
                std::time::SystemTime::now() + left,
            );
            params.insert(
                "kvx_capability".into(),
                Value::String(kvx_vllm::capability::to_text(&capability)),
            );
        }
        Value::Object(params)
    }

    /// A fresh transfer id: unique per proxy process and dispatch.
    pub(super) fn transfer_id(&self) -> String {
        self.ids.fresh()
    }

    pub(super) async fn send(
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

    pub(super) async fn dispatch(&self, call: Call, body: Value) -> Result<Response, ApiError> {
        let span = call.span(self.mode);
        self.dispatch_traced(call, body).instrument(span).await
    }

    async fn dispatch_traced(&self, call: Call, body: Value) -> Result<Response, ApiError> {
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
                    let leg = match which {
                        Leg::Prefill => "prefill",
                        Leg::Decode => "decode",
                    };
                    self.metrics
                        .retries
                        .get_or_create(&super::metrics::LegLabel { leg })
                        .inc();
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

    pub(super) async fn push(
        &self,
        call: &Call,
        request: &Map<String, Value>,
        p: usize,
        d: usize,
        transfer: &str,
    ) -> Result<Response, (Leg, LegError)> {
        let (pi, di) = (&self.prefill[p], &self.decode[d]);
        let kvx = pi.kvx.clone().unwrap_or_default();
        let trace = call.trace.to_string();
        let p_body = prefill_body(
            request,
            json!({"do_remote_decode": true, "kvx_transfer_id": transfer, "kvx_trace": trace}),
        );
        let d_params = json!({"do_remote_prefill": true, "kvx_transfer_id": transfer,
            "kvx_prefill": kvx, "kvx_trace": trace});
        let Value::Object(d_params) = d_params else {
            unreachable!("an object")
        };
        let d_body = decode_body(
            request,
            self.with_capability(d_params, call, d, &kvx, transfer),
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
    pub(super) async fn pull(
        &self,
        call: &Call,
        request: &Map<String, Value>,
        p: usize,
        mut d: usize,
        bad_decode: &mut Vec<usize>,
        transfer: &str,
    ) -> Result<Response, (Leg, LegError)> {
        let pi = &self.prefill[p];
        let trace = call.trace.to_string();
        let p_body = prefill_body(
            request,
            json!({"do_remote_decode": true, "kvx_transfer_id": transfer, "kvx_trace": trace}),
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
        // Only the proxy grants capabilities, for the id it dispatched.
        params.remove("kvx_capability");
        params.insert("kvx_transfer_id".into(), Value::String(transfer.to_owned()));
        params.insert("kvx_trace".into(), Value::String(trace));
        let kvx = pi.kvx.clone().unwrap_or_default();
        loop {
            let di = &self.decode[d];
            let d_body = decode_body(
                request,
                self.with_capability(params.clone(), call, d, &kvx, transfer),
            );
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
pub(super) enum Leg {
    Prefill,
    Decode,
}

/// The prefill leg's request: one output token, not streamed.
pub(super) fn prefill_body(request: &Map<String, Value>, params: Value) -> Value {
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
pub(super) fn decode_body(request: &Map<String, Value>, params: Value) -> Value {
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
        Ok(r) => {
            instance
                .first_byte
                .observe(call.started.elapsed().as_secs_f64());
            Ok(r)
        }
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
