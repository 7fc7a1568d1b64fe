//! Tests of `kvx proxy` against fake prefill and decode instances.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use futures_util::StreamExt as _;
use serde_json::{json, Value};

use super::args::{parse_decode, parse_prefill, parse_url, Prefill};
use super::http::ApiError;
use super::route::{decode_body, prefill_body, Call};
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
    assert_eq!(parse_decode("http://d:8200/").unwrap(), "http://d:8200");
    assert_eq!(
        parse_decode("http://d:8200/#decode-0").unwrap(),
        "http://d:8200#decode-0"
    );
    assert!(parse_decode("http://d:8200#").is_err());
    assert!(parse_decode("d:8200#x").is_err());
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
        max_requests: 64,
        header_timeout_s: 5.0,
        body_timeout_s: 5.0,
        auth_key_file: None,
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
fn test_proxy(mode: Mode, prefill: &str, decodes: &[&str], skip_unreachable_s: f64) -> Arc<Proxy> {
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
        max_requests: 64,
        header_timeout_s: 5.0,
        body_timeout_s: 5.0,
        auth_key_file: None,
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
        // Anything but kvx ends the connection, as a real prefill's would.
        let header = FrameHeader::parse(&header).ok()?;
        let mut payload = vec![0; header.payload_len as usize];
        s.read_exact(&mut payload).ok()?;
        Message::decode_payload(header.kind, &payload).ok()
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

/// The URL of an instance that is down: a port nobody listens on, below the ephemeral range
/// (a port the kernel picked for a listener of its own and freed would be handed to the next
/// one, a fake prefill of this very test, say, which then got the proxy's HTTP).
fn dead_url() -> String {
    format!("http://{}", kvx_testkit::free_ports(1))
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
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = plain.local_addr().unwrap();
        let (accepted, _client) =
            tokio::join!(plain.accept(), tokio::net::TcpStream::connect(addr));
        let accepted = accepted.unwrap().0;
        assert!(!accepted.nodelay().unwrap());
        without_nagle(&accepted);
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
                let paced = futures_util::stream::iter(pieces).then(|(delay, piece)| async move {
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
        let error: Value = serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
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
        let proxy = proxy_with_control(Mode::Push, &p_url, &kvx, &[&format!("http://{addr}")], 2.0);
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

/// Serves `proxy` with its own accept loop on a free port; returns its URL.
async fn serve_proxy(proxy: Arc<Proxy>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(super::serve(listener, proxy));
    url
}

/// What the client reads on a raw connection to `url` after sending `bytes`: an answer's
/// status line and headers, or nothing, until the proxy answers, closes the connection or
/// `within` passes; and how long that took.
async fn raw_exchange(url: &str, bytes: &[u8], within: Duration) -> (String, Duration) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(url.trim_start_matches("http://"))
        .await
        .unwrap();
    s.write_all(bytes).await.unwrap();
    let started = std::time::Instant::now();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(within, async {
        let mut buf = [0u8; 1024];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    (
        String::from_utf8_lossy(&got).into_owned(),
        started.elapsed(),
    )
}

/// An instance's failure reaches the client without the instance's address (the proxy's log
/// has it): `prefill 0` instead.
#[test]
fn error_bodies_name_no_internal_address() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (p_url, _) = fake_instance(500, "engine died", Duration::ZERO).await;
        let (d_url, _) = fake_instance(200, r#"{"text":"late"}"#, Duration::from_secs(2)).await;
        let url = serve_proxy(push_proxy(&p_url, &d_url)).await;
        let r = reqwest::Client::new()
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": "x"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 500);
        let body = r.text().await.unwrap();
        assert!(
            body.contains("engine died") && body.contains("prefill 0"),
            "{body}"
        );
        let port = p_url.rsplit(':').next().unwrap();
        assert!(
            !body.contains(port) && !body.contains("127.0.0.1"),
            "{body}"
        );
    });
}

/// Past `--max-requests` in flight, a request is answered 503 at once; once one ends there is
/// room again.
#[test]
fn requests_beyond_the_bound_are_refused_at_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (p_url, _) = fake_instance(200, r#"{"kv_transfer_params":null}"#, Duration::ZERO).await;
        let (d_url, _) = fake_instance(200, r#"{"text":"slow"}"#, Duration::from_millis(800)).await;
        let proxy = build(&ProxyArgs {
            max_requests: 1,
            ..test_args(Mode::Push, &p_url, "127.0.0.1:1", &[&d_url], 2.0)
        })
        .unwrap();
        let url = serve_proxy(proxy).await;
        let client = reqwest::Client::new();
        let send = || {
            client
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": "x"}))
                .send()
        };
        let first = tokio::spawn(send());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = std::time::Instant::now();
        let second = send().await.unwrap();
        assert_eq!(second.status().as_u16(), 503);
        assert!(started.elapsed() < Duration::from_millis(500));
        assert!(second.text().await.unwrap().contains("in flight"));
        assert_eq!(first.await.unwrap().unwrap().status().as_u16(), 200);
        assert_eq!(send().await.unwrap().status().as_u16(), 200);
    });
}

/// A client that sends its headers slowly is disconnected at the header timeout, and one that
/// sends its body slowly is answered 408 at the body timeout.
#[test]
fn slow_headers_and_bodies_are_cut_off() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let proxy = build(&ProxyArgs {
            header_timeout_s: 0.3,
            body_timeout_s: 0.3,
            ..test_args(Mode::Push, &dead_url(), "127.0.0.1:1", &[&dead_url()], 2.0)
        })
        .unwrap();
        let url = serve_proxy(proxy).await;
        let (got, took) = raw_exchange(&url, b"POST /v1/compl", Duration::from_secs(5)).await;
        assert!(took < Duration::from_secs(2), "headers waited {took:?}: {got}");
        assert!(!got.contains("200 OK"), "{got}");
        let (got, took) = raw_exchange(
            &url,
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"pro",
            Duration::from_secs(5),
        )
        .await;
        assert!(got.starts_with("HTTP/1.1 408"), "{got}");
        assert!(took < Duration::from_secs(2), "the body waited {took:?}");
    });
}

/// Transfer ids are 128 bits, unique, and two proxies (two secret keys) make different ones
/// for the same dispatch number: nothing in one id tells the next.
#[test]
fn transfer_ids_are_unique_and_unrelated_to_their_numbers() {
    use super::TransferIds;
    let (a, b) = (TransferIds::new(), TransferIds::new());
    let ids: Vec<String> = (0..10_000).map(|_| a.fresh()).collect();
    let unique: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len());
    for id in &ids[..3] {
        let hex = id.strip_prefix("kvx-").unwrap();
        assert_eq!(hex.len(), 32, "{id}");
        assert!(hex.bytes().all(|c| c.is_ascii_hexdigit()), "{id}");
    }
    // Consecutive ids share no prefix a reader could extrapolate from.
    assert_ne!(ids[0][..12], ids[1][..12]);
    assert_ne!(b.fresh(), ids[0]);
}

/// `/metrics` counts the client's requests by outcome and times them, counts the retry and the
/// instance passed over after a failed connection, times each instance's answer, and leaves no
/// request in flight; every series name follows Prometheus's rules.
#[test]
fn metrics_count_requests_retries_and_load() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (p_url, _) = recording_instance().await;
        let (d_url, _) = recording_instance().await;
        let down = dead_url();
        let proxy = test_proxy(Mode::Push, &p_url, &[&down, &d_url], 30.0);
        let url = serve_proxy(Arc::clone(&proxy)).await;
        let client = reqwest::Client::new();
        for _ in 0..3 {
            let r = client
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": "x"}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            r.bytes().await.unwrap();
        }
        let r = client.get(format!("{url}/metrics")).send().await.unwrap();
        let kind = r.headers()["content-type"].to_str().unwrap().to_owned();
        assert!(kind.starts_with("application/openmetrics-text"), "{kind}");
        let text = r.text().await.unwrap();
        for want in [
            r#"kvx_proxy_requests_total{mode="push",outcome="ok",code="200"} 3"#.to_owned(),
            r#"kvx_proxy_ttft_seconds_count{mode="push"} 3"#.to_owned(),
            r#"kvx_proxy_retries_total{leg="decode"} 1"#.to_owned(),
            r#"kvx_proxy_instances_passed_over_total{role="decode"} 1"#.to_owned(),
            r#"kvx_proxy_first_byte_seconds_count{role="decode"} 3"#.to_owned(),
            format!(r#"kvx_proxy_in_flight{{role="decode",instance="{d_url}"}} 0"#),
        ] {
            assert!(text.contains(&want), "no `{want}` in\n{text}");
        }
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let name = line.split(['{', ' ']).next().unwrap();
            let mut chars = name.chars();
            assert!(
                chars
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                    && chars.all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{name}"
            );
            assert!(name.starts_with("kvx_proxy_"), "{name}");
        }
    });
}

/// An instance that answers `/v1/completions` with 200 and `answer`, and records each request's
/// whole `kv_transfer_params`.
async fn params_recorder(answer: Value) -> (String, Arc<std::sync::Mutex<Vec<Value>>>) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let app = Router::new().route(
        "/v1/completions",
        post(move |axum::Json(body): axum::Json<Value>| {
            let (log, answer) = (Arc::clone(&log), answer.clone());
            async move {
                log.lock().unwrap().push(body["kv_transfer_params"].clone());
                axum::Json(answer)
            }
        }),
    );
    (serve(app).await, seen)
}

/// With the deployment key, every decode leg (push and pull) carries a capability for its
/// transfer that names its decode engine (`#ENGINE_ID`) and its prefill's control address and
/// verifies under the key; a client's or prefill's own `kvx_capability` never reaches decode.
#[test]
fn with_a_key_each_decode_leg_carries_a_capability_for_its_decode_and_prefill() {
    use kvx_core::{EngineId, TransferId};
    let dir = std::env::temp_dir().join(format!("kvx-proxy-cap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key_file = dir.join("key");
    let _ = std::fs::remove_file(&key_file);
    let key = kvx_vllm::AuthKey::generate(&key_file).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for mode in [Mode::Push, Mode::Pull] {
            let (p_url, _) = params_recorder(json!({"choices": [], "kv_transfer_params": {
                "do_remote_prefill": true, "kvx_capability": "1.0.0.forged"}}))
            .await;
            let (d_url, d_seen) = params_recorder(json!({"choices": []})).await;
            let kvx = "127.0.0.1:7100";
            let mut args = test_args(mode, &p_url, kvx, &[&format!("{d_url}#decode-0")], 2.0);
            args.auth_key_file = Some(key_file.clone());
            let proxy = build(&args).unwrap();
            let client =
                json!({"prompt": "x", "kv_transfer_params": {"kvx_capability": "1.0.0.client"}});
            proxy.route("/v1/completions", client).await.unwrap();
            let seen = d_seen.lock().unwrap().clone();
            let [params] = seen.as_slice() else {
                panic!("{mode:?}: {seen:?}")
            };
            let text = params["kvx_capability"].as_str().expect("a capability");
            assert_eq!(params["kvx_prefill"], kvx, "{mode:?}");
            let capability = kvx_vllm::capability::from_text(text, kvx).expect("well formed");
            let transfer = TransferId::from_str_hash(params["kvx_transfer_id"].as_str().unwrap());
            let now = std::time::SystemTime::now();
            let decode = EngineId::from_name("decode-0");
            assert_eq!(
                key.check(transfer, Some(&capability), Some(decode), now),
                Ok(())
            );
            assert!(matches!(
                key.check(
                    transfer,
                    Some(&capability),
                    Some(EngineId::from_name("decode-1")),
                    now
                ),
                Err(kvx_vllm::CapabilityError::OtherDecode { .. })
            ));
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}
