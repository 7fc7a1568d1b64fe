//! Unit tests of the same-host control plane: frames, identities, the ledger, and a socket
//! round trip.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::control::{parse_frames, FRAME_MESSAGE, FRAME_NOTICE};
use super::*;
use crate::error::OpError;
use crate::transport::{Event, Notice, OpId, OpKind, PeerId};

#[test]
fn frames_parse_across_partial_reads_and_reject_garbage() {
    let mut events = VecDeque::new();
    let mut stream = vec![FRAME_NOTICE];
    stream.extend_from_slice(&42u64.to_le_bytes());
    stream.push(FRAME_MESSAGE);
    stream.extend_from_slice(&3u32.to_le_bytes());
    stream.extend_from_slice(b"abc");
    let mut buf = Vec::new();
    for byte in &stream {
        buf.push(*byte);
        assert!(!parse_frames(&mut buf, &mut events));
    }
    assert!(buf.is_empty());
    assert!(matches!(events[0], Event::Notice(Notice(42))));
    assert!(matches!(&events[1], Event::Message(m) if m == b"abc"));
    let mut garbage = vec![0x77, 1, 2];
    assert!(parse_frames(&mut garbage, &mut events));
    let mut huge = vec![FRAME_MESSAGE];
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(parse_frames(&mut huge, &mut events));
}

#[test]
fn identities_round_trip_and_truncation_is_named() {
    let who = Identity {
        pid: 7,
        incarnation: 0xfeed,
        socket: "kvx-test/7/0/feed".into(),
    };
    let bytes = encode_head(*b"KVXT", 3, &who);
    let mut reader = Reader::open(&bytes, *b"KVXT", 3).unwrap();
    assert_eq!(Identity::decode(&mut reader).unwrap(), who);
    reader.finish().unwrap();
    for cut in 0..bytes.len() {
        let decoded =
            Reader::open(&bytes[..cut], *b"KVXT", 3).and_then(|mut r| Identity::decode(&mut r));
        assert!(decoded.is_err(), "prefix {cut}");
    }
    assert!(Reader::open(&bytes, *b"KVXT", 4).is_err());
    assert!(Reader::open(&bytes, *b"XXXX", 3).is_err());
}

#[test]
fn the_ledger_reports_each_operation_once_and_times_out_the_rest() {
    let mut ledger = Ledger::default();
    let a = ledger.start(PeerId(0), OpKind::Write, 100, vec![3]);
    let b = ledger.start(PeerId(1), OpKind::Read, 50, vec![4]);
    assert_eq!((a, b), (OpId(0), OpId(1)));
    assert_eq!(ledger.using(3), 1);
    assert_eq!(ledger.using(9), 0);
    // `a` finishes, an unknown id is ignored, `b` stays in flight.
    ledger.settle(vec![(0, Ok(())), (77, Ok(()))], Duration::from_secs(60));
    let mut events = Vec::new();
    assert_eq!(ledger.drain_into(&mut events), 1);
    assert!(matches!(
        events[0],
        Event::WriteDone {
            op: OpId(0),
            bytes: 100,
            ..
        }
    ));
    assert!(ledger.busy());
    // A zero timeout expires `b`; its late result is dropped, not reported twice.
    ledger.settle(Vec::new(), Duration::ZERO);
    ledger.settle(vec![(1, Ok(()))], Duration::ZERO);
    events.clear();
    assert_eq!(ledger.drain_into(&mut events), 1);
    assert!(matches!(
        events[0],
        Event::Failed {
            op: OpId(1),
            error: OpError::TimedOut(_),
            ..
        }
    ));
    assert!(!ledger.busy());
    assert_eq!(ledger.using(4), 0);
    // Immediate outcomes get ids of their own.
    let c = ledger.done_now(PeerId(0), OpKind::Send, Ok(()));
    assert_eq!(c, OpId(2));
}

#[test]
fn messages_and_notices_cross_a_socket_and_wake_the_waiter() {
    let mut control = Control::open("test").unwrap();
    let mut link = Link::connect(&control.identity().socket, Some(std::process::id())).unwrap();
    assert!(link.alive());
    link.send_message(b"hello").unwrap();
    assert_eq!(link.notices().send_all(&[99, 100, 101]).0, 3);
    let mut events = VecDeque::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while events.len() < 4 {
        control.block(Duration::from_millis(100)).unwrap();
        control.receive(&mut events).unwrap();
        assert!(Instant::now() < deadline);
    }
    assert!(matches!(&events[0], Event::Message(m) if m == b"hello"));
    // One write of three frames: three notices, in order.
    for (event, want) in events.iter().skip(1).zip([99, 100, 101]) {
        assert!(
            matches!(event, Event::Notice(Notice(n)) if *n == want),
            "{event:?}"
        );
    }
    // Nothing new: the poll reads nothing and the wake-up descriptor is not readable.
    assert!(!control.receive(&mut events).unwrap());
    assert_eq!(events.len(), 4);
    control.completions().push_all([(5, Ok(()))]);
    control.block(Duration::from_secs(5)).unwrap();
    let signalled = control.receive(&mut events).unwrap();
    assert!(
        signalled,
        "the worker's report made the descriptor readable"
    );
    let done = control.completed(signalled);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].0, 5);
    // Emptied: the next poll finds it quiet again.
    assert!(!control.receive(&mut events).unwrap());
    drop(control);
    // The peer's socket is gone: the link notices within a millisecond or two.
    std::thread::sleep(Duration::from_millis(5));
    assert!(!link.alive());
}

/// Notices and messages to a peer that closed its socket are errors, never `SIGPIPE`, which
/// would end a process that keeps the signal's default action (an engine written in C; the
/// test harness, like any Rust program, ignores it): the standard library's `UnixStream` sends
/// with `MSG_NOSIGNAL`, and this keeps it so. Checked in a child process (this test run again)
/// that restores the default.
#[test]
fn sending_to_a_closed_peer_is_an_error_not_a_sigpipe() {
    if !kvx_testkit::in_child(
        "same_host::tests::sending_to_a_closed_peer_is_an_error_not_a_sigpipe",
    ) {
        return;
    }
    // SAFETY: sets the default action of one signal before this test sends on a socket; no
    // handler (no Rust code) runs on a signal.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let mut control = Control::open("test").unwrap();
    let mut link = Link::connect(&control.identity().socket, Some(std::process::id())).unwrap();
    let notices = link.notices();
    // Accepted (a message read), then closed.
    link.send_message(b"first").unwrap();
    let mut events = VecDeque::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while events.is_empty() {
        control.block(Duration::from_millis(100)).unwrap();
        control.receive(&mut events).unwrap();
        assert!(Instant::now() < deadline);
    }
    drop(control);
    std::thread::sleep(Duration::from_millis(5));
    let (sent, result) = notices.send_all(&[1, 2]);
    assert_eq!(sent, 0);
    assert!(result.is_err());
    assert!(link.send_message(b"late").is_err());
}
