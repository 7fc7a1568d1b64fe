//! The HTTP side of the proxy: the OpenAI-compatible routes and their handlers, and errors
//! answered in OpenAI's format ([`ApiError`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::route::Call;
use super::{Instance, Proxy};

/// An error answered to the client in OpenAI's format.
#[derive(Debug)]
pub(super) struct ApiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> Self {
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

/// The client's request body as JSON, all of it within the body timeout; what cannot be read
/// (too slow, too large, not JSON) is answered in OpenAI's error format.
async fn json_body(proxy: &Proxy, body: Body) -> Result<Value, ApiError> {
    let read = axum::body::to_bytes(body, proxy.max_request_bytes);
    let bytes = match tokio::time::timeout(proxy.body_timeout, read).await {
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive within the body timeout",
            ))
        }
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            return Err(if too_large {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "the request body is too large",
                )
            } else {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    format!("cannot read the request body: {e}"),
                )
            });
        }
        Ok(Ok(bytes)) => bytes,
    };
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("the request body is not JSON: {e}"),
        )
    })
}

/// Serves one completion request within the proxy's bound on requests at once (the permit is
/// held until a streamed answer ends); errors go to the client without the instances'
/// addresses, which the proxy's log keeps.
async fn serve_call(
    proxy: Arc<Proxy>,
    path: &'static str,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let Ok(permit) = Arc::clone(&proxy.requests).try_acquire_owned() else {
        proxy
            .metrics
            .request_ended(proxy.mode, StatusCode::SERVICE_UNAVAILABLE.as_u16());
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "{} requests are in flight, the most this proxy serves",
                proxy.max_requests
            ),
        ));
    };
    let answer = async {
        let body = json_body(&proxy, body).await?;
        let call = Call::new(path, &headers, proxy.request_timeout);
        proxy.dispatch(call, body).await
    };
    match answer.await {
        Ok(response) => {
            let (parts, body) = response.into_parts();
            proxy
                .metrics
                .request_ended(proxy.mode, parts.status.as_u16());
            // The time to the answer's first byte, as the client sees it.
            let mut ttft = Some(
                proxy
                    .metrics
                    .ttft
                    .get_or_create(&super::metrics::ModeLabel {
                        mode: super::metrics::mode_name(proxy.mode),
                    })
                    .clone(),
            );
            let body = Body::from_stream(futures_util::StreamExt::map(
                body.into_data_stream(),
                move |chunk| {
                    let _held = &permit;
                    if let Some(h) = ttft.take() {
                        h.observe(started.elapsed().as_secs_f64());
                    }
                    chunk
                },
            ));
            Ok(Response::from_parts(parts, body))
        }
        Err(e) => {
            proxy.metrics.request_ended(proxy.mode, e.status.as_u16());
            Err(proxy.public(e))
        }
    }
}

async fn completions(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    serve_call(proxy, "/v1/completions", headers, body).await
}

async fn chat_completions(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    serve_call(proxy, "/v1/chat/completions", headers, body).await
}

impl Proxy {
    /// `error` as the client sees it: each instance's URL and kvx address replaced by its role
    /// and number (`prefill 0`, `decode 1`); the whole of it goes to the proxy's log.
    pub(super) fn public(&self, error: ApiError) -> ApiError {
        eprintln!("kvx proxy: {}: {}", error.status, error.message);
        let mut message = error.message;
        for (role, pool) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            for (i, instance) in pool.iter().enumerate() {
                message = message.replace(&instance.url, &format!("{role} {i}"));
                if let Some(kvx) = &instance.kvx {
                    message = message.replace(kvx.as_str(), &format!("{role} {i}'s kvx port"));
                }
            }
        }
        ApiError::new(error.status, message)
    }
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
                .map_err(|e| proxy.public(ApiError::new(StatusCode::BAD_GATEWAY, e.to_string())))?;
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

/// The proxy's series (see the `metrics` module), as OpenMetrics text.
async fn metrics(State(proxy): State<Arc<Proxy>>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        proxy.metrics.render(),
    )
        .into_response()
}

pub(super) fn app(proxy: Arc<Proxy>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(proxy)
}
