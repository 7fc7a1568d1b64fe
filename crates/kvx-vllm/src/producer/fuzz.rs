//! One producer rank's state machine under arbitrary input (feature `fuzzing`; what the
//! `connector` fuzz target runs, not an API): two consumer connections send whatever the bytes
//! say (registrations of any blocks, token counts, leases and notices, for transfers the engine
//! has or not; aborts, failures, completions, read claims, heartbeats, closed connections), the engine
//! finishes, seals, streams, aborts and preempts requests, and the virtual clock moves. The
//! session then lets every lease run out and checks what must hold whatever the peers did:
//!
//! - nothing panicked;
//! - every request the engine finished was given back to it exactly once, and nothing else was;
//! - no block is held any more.
//!
//! A broken invariant panics, naming it.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvx_core::wire::{
    Abort, Claim, Completion, FailureNotice, Heartbeat, Message, Registration, Role,
};
use kvx_core::{BlockId, EngineId, GroupBlocks, Rank, RequestBlocks, RequestId, TransferId};
use kvx_layout::Layout;
use kvx_rdma::loopback::LoopbackFabric;
use kvx_rdma::transport::Transport;
use kvx_rendezvous::AttemptKey;

use super::{Command, FinishedBlocks, FinishedSending, Machine};
use crate::config::ConnectorConfig;
use crate::control::{self, ControlStream, Queued};
use crate::driver::{Clock, Mailbox};
use crate::sim_support::{advance, endpoint, spec, transport_events, turn, FuzzBytes};
use crate::stats::Stats;

/// The session's virtual clock (one session at a time per process, as a fuzzer runs them).
static NOW: AtomicU64 = AtomicU64::new(0);

/// A consumer connection: its id at the producer and its end of the control stream (drained,
/// so that the producer's sends never back up).
struct Peer {
    conn: u64,
    stream: UnixStream,
    _endpoint: Box<dyn Transport>,
}

/// Runs one session over `data`; panics when an invariant breaks (see the module doc).
pub fn session(data: &[u8]) {
    let mut bytes = FuzzBytes(data);
    let mut config = ConnectorConfig::new(EngineId(1));
    config.producer_lease = Duration::from_millis(100 + 100 * u64::from(bytes.byte() % 20));
    let fabric = LoopbackFabric::new();
    NOW.store(0, Ordering::SeqCst);
    let finished = Arc::new(Mailbox::default());
    let stats = Arc::new(Stats::default());
    let mut driver = Machine::new(
        &config,
        Layout::new(spec()).expect("a valid layout"),
        endpoint(&fabric).0,
        Clock::virtual_at(&NOW),
        Arc::clone(&finished),
        Arc::clone(&stats),
    )
    .expect("a valid configuration");
    let consumer_config = ConnectorConfig::new(EngineId(2));
    let mut peers = Vec::new();
    for conn in 1..=2 {
        let consumer = endpoint(&fabric).0;
        let (ours, theirs) = UnixStream::pair().expect("a socket pair");
        theirs.set_nonblocking(true).expect("a socket");
        let sender = control::sender(&ControlStream::local(ours)).expect("a sender");
        let hello = control::hello(
            &consumer_config,
            Role::Consumer,
            &Layout::new(spec()).expect("a valid layout"),
            &consumer.local_desc(),
            conn == 2,
        );
        turn(
            &mut driver,
            Command::Accepted(conn, sender, Box::new(hello), None),
        );
        peers.push(Peer {
            conn,
            stream: theirs,
            _endpoint: consumer,
        });
    }
    let mut engine: HashMap<AttemptKey, Planned> = HashMap::new();
    let mut now = Duration::ZERO;
    while !bytes.is_empty() {
        let op = bytes.byte();
        let peer = &peers[usize::from(op & 1)];
        let conn = peer.conn;
        let peer_says = |message| Command::Peer(conn, message, Queued::unbounded());
        let command = match (op >> 1) % 13 {
            0 => {
                let key = bytes.key();
                let num_tokens = u32::from(bytes.byte() % 70);
                let shape = bytes.byte();
                // Now and then a hybrid model's further group, kept from some token.
                let groups = if shape & 2 == 0 {
                    Vec::new()
                } else {
                    vec![GroupBlocks {
                        first_token: u32::from(bytes.byte()) % (num_tokens + 1),
                        blocks: (0..num_tokens.div_ceil(4))
                            .map(|i| BlockId((u32::from(shape >> 2) + 8 + i) % 16))
                            .collect(),
                    }]
                };
                Some(peer_says(Message::Registration(Registration {
                    groups,
                    transfer: key.transfer,
                    attempt: key.attempt,
                    request: RequestId(u64::from(bytes.byte())),
                    consumer: consumer_config.engine,
                    consumer_incarnation: consumer_config.incarnation,
                    consumer_rank: Rank(u32::from(bytes.byte() % 3)),
                    num_tokens,
                    skip_tokens: u32::from(bytes.byte().saturating_sub(200)),
                    lease_ms: u32::from(bytes.u16()) * 8,
                    notice: u64::from(bytes.u16()),
                    // As many distinct blocks as the tokens need, or anything.
                    blocks: if shape & 1 == 0 {
                        (0..num_tokens.div_ceil(4))
                            .map(|i| BlockId((u32::from(shape >> 1) + i) % 16))
                            .collect()
                    } else {
                        bytes.blocks()
                    },
                    capability: None,
                })))
            }
            1 => {
                let key = bytes.key();
                let every = bytes.byte() & 1 == 1;
                Some(peer_says(Message::Abort(Abort {
                    transfer: key.transfer,
                    attempt: (!every).then_some(key.attempt),
                    reason: "fuzz".into(),
                    capability: None,
                })))
            }
            2 => {
                let key = bytes.key();
                Some(peer_says(Message::Failure(FailureNotice {
                    transfer: key.transfer,
                    attempt: key.attempt,
                    rank: Rank(u32::from(bytes.byte() % 3)),
                    reason: bytes.reason(),
                    detail: String::new(),
                })))
            }
            3 => {
                let key = bytes.key();
                Some(peer_says(if bytes.byte() & 1 == 0 {
                    Message::Completion(Completion {
                        transfer: key.transfer,
                        attempt: key.attempt,
                        producer: EngineId(u64::from(bytes.byte() % 3)),
                        producer_rank: Rank(0),
                        bytes: u64::from(bytes.u16()),
                        capability: None,
                    })
                } else {
                    // A read claim, for a pull held here or not, before its finish or after.
                    Message::Claim(Claim {
                        transfer: key.transfer,
                        attempt: key.attempt,
                        capability: None,
                    })
                }))
            }
            4 => {
                let transfers = (0..bytes.byte() % 4)
                    .map(|_| TransferId(u128::from(bytes.byte() % 5)))
                    .collect();
                Some(peer_says(Message::Heartbeat(Heartbeat {
                    engine: consumer_config.engine,
                    incarnation: consumer_config.incarnation,
                    transfers,
                })))
            }
            5 => Some(Command::PeerClosed(conn, "fuzz".into())),
            // The engine (trusted, so well-formed): each request is push or pull, has 1 to 64
            // tokens in distinct blocks, may stream (push), is sealed at most once (push), and
            // finishes once with the blocks and tokens it was planned with.
            6 => {
                let key = bytes.key();
                let request = plan(&mut engine, key, &mut bytes);
                (!request.finished).then(|| {
                    request.finished = true;
                    Command::Finished {
                        key,
                        held: FinishedBlocks::new(
                            request.id,
                            request.blocks.clone(),
                            request.tokens,
                        ),
                        pull: request.pull,
                    }
                })
            }
            7 => {
                let key = bytes.key();
                let request = plan(&mut engine, key, &mut bytes);
                (!request.pull && !request.sealed && !request.finished).then(|| {
                    request.sealed = true;
                    Command::Sealed {
                        key,
                        held: FinishedBlocks::new(
                            request.id,
                            request.blocks.clone(),
                            request.tokens,
                        ),
                    }
                })
            }
            8 => {
                let key = bytes.key();
                let (fraction, layers) = (u64::from(bytes.byte()), bytes.byte());
                let request = plan(&mut engine, key, &mut bytes);
                let tokens = request.tokens * fraction / 255;
                (!request.pull && !request.sealed && !request.finished).then(|| Command::Progress {
                    key,
                    blocks: request.blocks.blocks[..tokens.div_ceil(4) as usize].to_vec(),
                    tokens,
                    layers: (layers < 3).then_some(u32::from(layers)),
                })
            }
            9 => {
                let key = bytes.key();
                Some(Command::Abort {
                    transfer: key.transfer,
                    attempt: (bytes.byte() & 1 == 0).then_some(key.attempt),
                })
            }
            10 => Some(Command::Preempted(bytes.key())),
            11 => {
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
        drain(&mut peers);
    }
    // Every lease runs out: writes land, and what waits expires.
    for _ in 0..40 {
        now += Duration::from_secs(5);
        transport_events(&mut driver);
        advance(&mut driver, &NOW, now);
        drain(&mut peers);
    }
    let mut given_back: HashMap<AttemptKey, usize> = HashMap::new();
    for (FinishedSending { key, .. }, _) in finished.take() {
        *given_back.entry(key).or_default() += 1;
    }
    for (key, request) in &engine {
        let times = given_back.remove(key).unwrap_or(0);
        assert!(
            times == usize::from(request.finished),
            "{key}: finished {}, given back {times} times",
            request.finished
        );
    }
    assert!(
        given_back.is_empty(),
        "given back without being finished: {given_back:?}"
    );
    let held = stats.held.load(Ordering::Relaxed);
    assert_eq!(held, 0, "requests still held after every lease");
}

/// A request of the engine's.
struct Planned {
    id: RequestId,
    pull: bool,
    blocks: RequestBlocks,
    tokens: u64,
    sealed: bool,
    finished: bool,
}

/// The engine's request for `key`, planned from the next bytes when it is new.
fn plan<'a>(
    engine: &'a mut HashMap<AttemptKey, Planned>,
    key: AttemptKey,
    bytes: &mut FuzzBytes<'_>,
) -> &'a mut Planned {
    let next = RequestId(engine.len() as u64 + 1);
    engine.entry(key).or_insert_with(|| {
        let (mode, tokens, first) = (bytes.byte(), bytes.byte(), bytes.byte());
        let tokens = u64::from(tokens % 64) + 1;
        Planned {
            id: next,
            pull: mode & 1 == 1,
            // Distinct blocks of the cache's 16, from any start.
            blocks: RequestBlocks {
                blocks: (0..tokens.div_ceil(4) as u32)
                    .map(|i| BlockId((u32::from(first) + i) % 16))
                    .collect(),
                // A hybrid model's further group now and then (its window from some token).
                groups: (mode & 2 == 2)
                    .then(|| GroupBlocks {
                        first_token: u32::from(mode >> 2).min(tokens as u32),
                        blocks: (0..tokens.div_ceil(4) as u32)
                            .map(|i| BlockId((u32::from(first) + 8 + i) % 16))
                            .collect(),
                    })
                    .into_iter()
                    .collect(),
            },
            tokens,
            sealed: false,
            finished: false,
        }
    })
}

/// Reads whatever the producer sent the consumers (their side ignores it).
fn drain(peers: &mut [Peer]) {
    let mut sink = [0_u8; 4096];
    for peer in peers {
        while matches!(std::io::Read::read(&mut peer.stream, &mut sink), Ok(n) if n > 0) {}
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
