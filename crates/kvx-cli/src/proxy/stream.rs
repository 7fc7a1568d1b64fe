//! Decode's answer to the client: streamed through as it comes, with the silence between the
//! pieces of an event stream bounded and a broken stream ended by an error event.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::StreamExt as _;
use serde_json::json;

use super::abandon::Unclaimed;
use super::Load;

/// A server-sent event carrying an OpenAI-style error object.
pub(super) fn error_event(message: &str) -> axum::body::Bytes {
    let event = json!({"error": {"object": "error", "message": message, "type": "BadGateway", "code": 502}});
    axum::body::Bytes::from(format!("data: {event}\n\n"))
}

/// Sends decode's answer to the client, streaming it through.
pub(super) fn forward(
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
pub(super) fn respond(
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
