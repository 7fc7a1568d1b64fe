//! One consumer rank's state machine under arbitrary input (feature `fuzzing`; half of what the
//! `connector` fuzz target runs, not an API): the engine pushes and cancels well-formed requests
//! to one prefill instance whose only rank is hostile: it sends whatever the bytes say (failures,
//! finishing hints, completions, read-claim answers, hellos, heartbeats and aborts for any transfer and rank, on
//! its connection or a stale one, and its connection closes), and writes with the notices of
//! the registrations it received or with notices of its own guessing; the virtual clock moves.
//! The session then lets every lease run out and checks:
//!
//! - nothing panicked;
//! - every request the engine pushed ended exactly once (ready or failed), and nothing else did;
//! - a request is ready only after a write with its own notice came.
//!
//! A broken invariant panics, naming it.

use std::collections::{HashMap, HashSet};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvx_core::wire::{Abort, Completion, FailureNotice, Finishing, Heartbeat, Held, Message, Role};
use kvx_core::{BlockId, EngineId, Rank, RequestId};
use kvx_layout::{CopyOp, Layout};
use kvx_rdma::loopback::LoopbackFabric;
use kvx_rdma::transport::{Notice, Transport};
use kvx_rendezvous::AttemptKey;

use super::{Command, Machine, Outbox, PollHints, PushRequest, RecvEvent};
use crate::config::ConnectorConfig;
use crate::control::{self, ControlStream, Dialled, Queued};
use crate::driver::{self, Clock, Mailbox};
use crate::error::LinkError;
use crate::sim_support::{advance, endpoint, message, spec, transport_events, turn, FuzzBytes};
use crate::stats::Stats;

/// The session's virtual clock (one session at a time per process, as a fuzzer runs them).
static NOW: AtomicU64 = AtomicU64::new(0);

/// Where the prefill instance is said to listen.
const INSTANCE: std::net::SocketAddr = std::net::SocketAddr::new(
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 1)),
    1,
);

/// Runs one session over `data`; panics when an invariant breaks (see the module doc).
pub fn session(data: &[u8]) {
    let mut bytes = FuzzBytes(data);
    let fabric = LoopbackFabric::new();
    let mut config = ConnectorConfig::new(EngineId(2));
    config.registration_lease = Duration::from_millis(100 + 100 * u64::from(bytes.byte() % 20));
    config.notice_board = false;
    NOW.store(0, Ordering::SeqCst);
    let (transport, regions) = endpoint(&fabric);
    let (tx, _queue) = driver::command_queue(None);
    let outbox = Arc::new(Outbox {
        hints: Arc::new(PollHints::default()),
        events: Mailbox::default(),
    });
    let mut driver = Machine::new(
        config,
        Layout::new(spec()).expect("a valid layout"),
        regions,
        transport,
        None,
        Clock::virtual_at(&NOW),
        tx,
        Arc::clone(&outbox),
        Arc::new(Stats::default()),
    )
    .expect("a valid configuration");
    let (mut producer, _) = endpoint(&fabric);
    let producer_config = ConnectorConfig::new(EngineId(1));
    let producer_hello = control::hello(
        &producer_config,
        Role::Producer,
        &Layout::new(spec()).expect("a valid layout"),
        &producer.local_desc(),
        false,
    );
    // The producer's end of its control connection, once the handshake ended.
    let mut control: Option<UnixStream> = None;
    let mut pushed: HashMap<AttemptKey, RequestId> = HashMap::new();
    // Notices received in registrations, and those written (by the rogue or as the real one).
    let mut registered: Vec<(AttemptKey, u64)> = Vec::new();
    let mut written: HashSet<u64> = HashSet::new();
    let mut ended: HashMap<AttemptKey, usize> = HashMap::new();
    let mut now = Duration::ZERO;
    while !bytes.is_empty() {
        let op = bytes.byte();
        let rogue = |message| {
            Command::Peer(
                INSTANCE,
                Rank(0),
                u64::from(op & 1),
                message,
                Queued::unbounded(),
            )
        };
        let command = match (op >> 1) % 12 {
            // The engine: a new request of 1 to 64 tokens in distinct blocks.
            0 | 1 => {
                let key = bytes.key();
                let (tokens, first) = (u64::from(bytes.byte() % 64) + 1, bytes.byte());
                (!pushed.contains_key(&key)).then(|| {
                    let request = RequestId(pushed.len() as u64 + 1);
                    pushed.insert(key, request);
                    Command::Push(PushRequest {
                        groups: Vec::new(),
                        key,
                        request,
                        prefill: INSTANCE,
                        num_tokens: tokens,
                        skip_tokens: 0,
                        blocks: (0..tokens.div_ceil(4) as u32)
                            .map(|i| BlockId((u32::from(first) + i) % 16))
                            .collect(),
                        capability: None,
                        trace: None,
                    })
                })
            }
            2 => {
                let key = bytes.key();
                Some(Command::Cancel {
                    transfer: key.transfer,
                    attempt: (bytes.byte() & 1 == 0).then_some(key.attempt),
                })
            }
            // A handshake with the prefill rank ends (ignored unless one was under way).
            3 => Some(if bytes.byte() & 1 == 0 {
                let (ours, theirs) = UnixStream::pair().expect("a socket pair");
                theirs.set_nonblocking(true).expect("a socket");
                control = Some(theirs);
                Command::Handshaken(
                    INSTANCE,
                    Rank(0),
                    Ok(
                        Dialled::new(ControlStream::local(ours), producer_hello.clone())
                            .expect("a sender"),
                    ),
                )
            } else {
                refused()
            }),
            4 => {
                let key = bytes.key();
                let reason = bytes.reason();
                Some(rogue(Message::Failure(FailureNotice {
                    transfer: key.transfer,
                    attempt: key.attempt,
                    rank: Rank(u32::from(bytes.byte() % 2)),
                    reason,
                    detail: String::new(),
                })))
            }
            5 => {
                let key = bytes.key();
                let rank = Rank(u32::from(bytes.byte() % 2));
                Some(rogue(match bytes.byte() % 5 {
                    0 => Message::Finishing(Finishing {
                        transfer: key.transfer,
                        attempt: key.attempt,
                        producer_rank: rank,
                    }),
                    // An answer to a read claim this side never made.
                    4 => Message::Held(Held {
                        transfer: key.transfer,
                        attempt: key.attempt,
                        producer_rank: rank,
                    }),
                    1 => Message::Completion(Completion {
                        transfer: key.transfer,
                        attempt: key.attempt,
                        producer: producer_config.engine,
                        producer_rank: rank,
                        bytes: 64,
                        capability: None,
                    }),
                    2 => Message::Heartbeat(Heartbeat {
                        engine: producer_config.engine,
                        incarnation: producer_config.incarnation,
                        transfers: vec![key.transfer],
                    }),
                    _ => Message::Abort(Abort {
                        transfer: key.transfer,
                        attempt: Some(key.attempt),
                        reason: "fuzz".into(),
                        capability: None,
                    }),
                }))
            }
            6 => Some(rogue(Message::Hello(producer_hello.clone()))),
            7 => Some(Command::PeerClosed(
                INSTANCE,
                Rank(0),
                u64::from(op & 1),
                "fuzz".into(),
            )),
            // The rank writes, announcing a registration's notice or a guess.
            8 | 9 => {
                let pick = usize::from(bytes.byte());
                let notice = if registered.is_empty() || op & 1 == 1 {
                    u64::from(bytes.byte()) | u64::from(bytes.byte()) << 8
                } else {
                    registered[pick % registered.len()].1
                };
                write(&mut driver, producer.as_mut(), notice);
                written.insert(notice);
                None
            }
            10 => {
                now += Duration::from_millis(u64::from(bytes.byte()) * 10);
                advance(&mut driver, &NOW, now);
                None
            }
            _ => {
                transport_events(&mut driver);
                None
            }
        };
        if let Some(command) = command {
            turn(&mut driver, command);
        }
        if let Some(stream) = control.as_mut() {
            while let Some(m) = message(stream) {
                if let Message::Registration(r) = m {
                    registered.push((AttemptKey::new(r.transfer, r.attempt), r.notice));
                }
            }
        }
        take_events(&outbox, &pushed, &registered, &written, &mut ended);
    }
    // A handshake still under way ends (as the helper thread's would), and every lease runs out.
    turn(&mut driver, refused());
    for _ in 0..40 {
        now += Duration::from_secs(5);
        transport_events(&mut driver);
        advance(&mut driver, &NOW, now);
        take_events(&outbox, &pushed, &registered, &written, &mut ended);
    }
    for key in pushed.keys() {
        let times = ended.remove(key).unwrap_or(0);
        assert_eq!(times, 1, "{key}: pushed, ended {times} times");
    }
    assert!(ended.is_empty(), "ended without being pushed: {ended:?}");
}

/// A failed handshake with the prefill rank.
fn refused() -> Command {
    Command::Handshaken(
        INSTANCE,
        Rank(0),
        Err(LinkError::Timeouts(std::io::Error::other("fuzz"))),
    )
}

/// The rogue producer rank writes a little with `notice`.
fn write(driver: &mut Machine, producer: &mut dyn Transport, notice: u64) {
    let Some(consumer) = crate::driver::Driven::transport(driver).map(|t| t.local_desc()) else {
        return;
    };
    let Ok(peer) = producer.connect(&consumer) else {
        return;
    };
    let op = CopyOp::run(Rank(0), (0, 0), (0, 0), 64);
    let _ = producer.write(peer, &[op], Some(Notice(notice)));
    let mut events = Vec::new();
    let _ = producer.poll(&mut events);
}

/// Reads what the engine learnt, checking that a ready request's notice was written.
fn take_events(
    outbox: &Outbox,
    pushed: &HashMap<AttemptKey, RequestId>,
    registered: &[(AttemptKey, u64)],
    written: &HashSet<u64>,
    ended: &mut HashMap<AttemptKey, usize>,
) {
    for (event, _) in outbox.events.take() {
        let (key, request) = match &event {
            RecvEvent::Ready { key, request } => {
                assert!(
                    registered
                        .iter()
                        .any(|(k, n)| k == key && written.contains(n)),
                    "{key} ready without a write announcing its notice"
                );
                (*key, *request)
            }
            RecvEvent::Failed { key, request, .. } => (*key, *request),
        };
        assert_eq!(
            pushed.get(&key),
            Some(&request),
            "{event:?} for a request the engine did not push"
        );
        *ended.entry(key).or_default() += 1;
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// What `cargo xtask fuzz connector` runs, over random input in every test run.
        #[test]
        fn sessions_of_random_input_keep_the_invariants(
            data in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            super::session(&data);
        }
    }
}
