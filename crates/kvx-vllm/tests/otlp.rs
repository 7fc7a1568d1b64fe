//! Request traces exported over OTLP/HTTP (feature `otlp`): a producer and a consumer in this
//! process, with the exporter installed as the process's subscriber, post their request spans
//! to a minimal OTLP/HTTP receiver that the test runs; both spans carry the router's trace id and
//! parent span, and the request's steps as events.
#![cfg(feature = "otlp")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{
    Arrangement, Attempt, BlockId, Dtype, EngineId, LayoutSpec, MemoryOrder, RequestId, TransferId,
};
use kvx_layout::Layout;
use kvx_rdma::region::{HostBuffer, LocalRegion};
use kvx_rendezvous::AttemptKey;
use kvx_vllm::trace::TraceContext;
use kvx_vllm::{
    ConnectorConfig, Consumer, KvCache, Producer, PushRequest, RecvEvent, SendOutcome,
    TransportSpec,
};

use kvx_testkit::otlp::receiver as otlp_receiver;

fn cache() -> KvCache {
    let spec = LayoutSpec {
        num_layers: 2,
        total_kv_heads: 2,
        head_dim: 8,
        dtype: Dtype::F32,
        mla: false,
        block_tokens: 4,
        num_blocks: 16,
        tp_size: 1,
        tp_rank: 0,
        order: MemoryOrder::Nhd,
        arrangement: Arrangement::PerLayerSplit,
    };
    let layout = Layout::new(spec.clone()).unwrap();
    let regions = (0..layout.region_count())
        .map(|i| {
            let buffer = Arc::new(HostBuffer::new(layout.region_len() as usize).unwrap());
            LocalRegion::host(i, buffer)
        })
        .collect();
    KvCache {
        layout: spec,
        regions,
    }
}

/// The span named `name` in the posted bodies, as the JSON text from its name on.
fn span_text(bodies: &[(String, String)], name: &str) -> Option<String> {
    bodies.iter().find_map(|(_, body)| {
        body.find(&format!("\"name\":\"{name}\""))
            .map(|at| body[at..].to_owned())
    })
}

#[test]
fn a_traced_request_exports_one_span_per_side_under_the_routers_trace() {
    let (endpoint, bodies) = otlp_receiver();
    let installed = kvx_vllm::trace::otlp::init(
        tracing_subscriber::EnvFilter::new("warn"),
        Some(&endpoint),
        "kvx-test",
    )
    .unwrap();
    assert!(installed, "this test binary has no other subscriber");

    let loopback: TransportSpec = "loopback".parse().unwrap();
    let producer = Producer::start(
        ConnectorConfig::new(EngineId(1)),
        cache(),
        loopback.open().unwrap(),
    )
    .unwrap();
    let consumer = Consumer::start(
        ConnectorConfig::new(EngineId(2)),
        cache(),
        loopback.open().unwrap(),
    )
    .unwrap();
    // The router's dispatch span in the trace of a client's request.
    let trace: TraceContext = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        .parse()
        .unwrap();
    let key = AttemptKey::new(TransferId::from_str_hash("traced"), Attempt(0));
    producer.trace(key.transfer, trace).unwrap();
    consumer
        .request_allocated(PushRequest {
            groups: Vec::new(),
            key,
            request: RequestId(1),
            prefill: producer.control_addr(),
            num_tokens: 8,
            skip_tokens: 0,
            blocks: vec![BlockId(3), BlockId(4)],
            capability: None,
            trace: Some(trace),
        })
        .unwrap();
    producer
        .request_finished(key, RequestId(1), vec![BlockId(0), BlockId(1)], 8)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut ready, mut freed) = (false, false);
    while !(ready && freed) {
        assert!(Instant::now() < deadline, "the request was not decided");
        for event in consumer.wait_events(Duration::from_millis(5)) {
            assert!(matches!(event, RecvEvent::Ready { .. }), "{event:?}");
            ready = true;
        }
        for done in producer.take_finished() {
            assert_eq!(done.outcome, SendOutcome::Sent);
            freed = true;
        }
    }
    // The exporter posts what closed within a second.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (send, receive) = loop {
        let got = bodies.lock().unwrap().clone();
        if let (Some(send), Some(receive)) =
            (span_text(&got, "kvx.send"), span_text(&got, "kvx.receive"))
        {
            assert!(got
                .iter()
                .all(|(line, _)| line.starts_with("POST /v1/traces ")));
            assert!(got[0]
                .1
                .contains("\"service.name\",\"value\":{\"stringValue\":\"kvx-test\"}"));
            break (send, receive);
        }
        assert!(Instant::now() < deadline, "spans not exported: {got:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    for (side, text, events) in [
        (
            "prefill",
            &send,
            &[
                "registered",
                "finished",
                "writes posted",
                "written",
                "released",
            ][..],
        ),
        ("decode", &receive, &["registered", "ready"][..]),
    ] {
        for event in events {
            assert!(
                text.contains(&format!("\"name\":\"{event}\"")),
                "{side}: no `{event}` event in {text}"
            );
        }
    }
    // Both spans are children of the router's span, in its trace.
    for body in bodies.lock().unwrap().iter().map(|(_, b)| b) {
        for span in body.split("{\"traceId\":").skip(1) {
            assert!(
                span.starts_with("\"4bf92f3577b34da6a3ce929d0e0e4736\""),
                "{span}"
            );
            assert!(
                span.contains("\"parentSpanId\":\"00f067aa0ba902b7\""),
                "{span}"
            );
        }
    }
    drop(producer);
    drop(consumer);
}
