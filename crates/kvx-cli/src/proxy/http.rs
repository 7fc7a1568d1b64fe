//! The HTTP side of the proxy: the OpenAI-compatible routes and their handlers, and errors
//! answered in OpenAI's format ([`ApiError`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
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

pub(super) fn app(proxy: Arc<Proxy>) -> Router {
    let limit = DefaultBodyLimit::max(proxy.max_request_bytes);
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .layer(limit)
        .with_state(proxy)
}
