//! Random interleavings of everything both engines, both peers and the clock can do to a few
//! transfers, checked against what must hold whatever the order.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;
use crate::producer::SendOutcome;
use crate::sim_support::ids;

/// Transfers 1 to 3, attempts 0 and 1; every request is 8 tokens (2 blocks). Transfer 3
/// moves by pull, the others by push.
const TOKENS: u64 = 8;
const LEASE: Duration = Duration::from_secs(2);
/// Decode's bound for prefill's word that nothing writes any more: longer than all the
/// steps (at most 40 waits of 3 s), so that within them every end is confirmed or waits.
const QUIESCE: Duration = Duration::from_secs(150);
const PULLED: u8 = 3;
/// Prefill blocks no request ends in.
const STALE: [BlockId; 2] = [BlockId(12), BlockId(13)];

#[derive(Clone, Copy, Debug)]
enum Step {
    Register {
        transfer: u8,
        attempt: u8,
    },
    /// Prefill computed `tokens` in `layers`; `elsewhere`: in blocks it later leaves (the
    /// engine computes the request again in its own blocks before it finishes).
    Progress {
        transfer: u8,
        attempt: u8,
        tokens: u8,
        layers: Option<u8>,
        elsewhere: bool,
    },
    Seal {
        transfer: u8,
        attempt: u8,
    },
    Finish {
        transfer: u8,
        attempt: u8,
    },
    Abort {
        transfer: u8,
    },
    Preempt {
        transfer: u8,
        attempt: u8,
    },
    Cancel {
        transfer: u8,
    },
    Wait {
        ms: u16,
    },
    HoldTransfers(bool),
    LoseNotice,
    /// Decode's engine drops a pushed transfer it never registered (and never will).
    Abandon {
        transfer: u8,
    },
    /// The control connection between these ranks (modulo the sizes) breaks.
    Disconnect {
        decode_rank: u8,
        prefill_rank: u8,
    },
}

fn step() -> impl Strategy<Value = Step> {
    let t = 1u8..=3;
    // Mostly the first attempt, so that registrations and finishes meet.
    let a = prop_oneof![3 => Just(0u8), 1 => Just(1u8)];
    prop_oneof![
        3 => (t.clone(), a.clone()).prop_map(|(transfer, attempt)| Step::Register { transfer, attempt }),
        2 => (t.clone(), a.clone(), 1u8..=2, proptest::option::of(0u8..=2), any::<bool>())
            .prop_map(|(transfer, attempt, blocks, layers, elsewhere)| Step::Progress {
                transfer,
                attempt,
                tokens: blocks * 4,
                layers,
                elsewhere,
            }),
        1 => (t.clone(), a.clone()).prop_map(|(transfer, attempt)| Step::Seal { transfer, attempt }),
        3 => (t.clone(), a.clone()).prop_map(|(transfer, attempt)| Step::Finish { transfer, attempt }),
        1 => t.clone().prop_map(|transfer| Step::Abort { transfer }),
        1 => (t.clone(), a).prop_map(|(transfer, attempt)| Step::Preempt { transfer, attempt }),
        1 => t.prop_map(|transfer| Step::Cancel { transfer }),
        3 => (0u16..3000).prop_map(|ms| Step::Wait { ms }),
        1 => any::<bool>().prop_map(Step::HoldTransfers),
        1 => Just(Step::LoseNotice),
        1 => (1u8..PULLED).prop_map(|transfer| Step::Abandon { transfer }),
        1 => (0u8..2, 0u8..2).prop_map(|(decode_rank, prefill_rank)| Step::Disconnect {
            decode_rank,
            prefill_rank,
        }),
    ]
}

fn key_of(transfer: u8, attempt: u8) -> AttemptKey {
    let mut a = Attempt::FIRST;
    for _ in 0..attempt {
        a = a.next();
    }
    AttemptKey::new(TransferId(u128::from(transfer)), a)
}

/// Prefill computes transfer `t` into blocks `2(t-1)..`.
fn prefill_blocks(transfer: u8) -> Vec<BlockId> {
    let first = u32::from(transfer - 1) * 2;
    ids(first..first + 2)
}

/// Decode lands attempt `a` of transfer `t` in blocks of its own.
fn decode_blocks(key: AttemptKey) -> Vec<BlockId> {
    let t = u32::try_from(key.transfer.0).expect("small") - 1;
    let a = u32::from(key.attempt != Attempt::FIRST);
    let first = (t * 2 + a) * 2;
    ids(first..first + 2)
}

/// What the test saw, to check against.
#[derive(Default)]
struct Seen {
    registered: HashSet<AttemptKey>,
    /// Each decode rank's ends of each request, as many as came.
    ends: HashMap<(usize, AttemptKey), Vec<RecvEvent>>,
    /// Prefill's computed (progress or seal), and finished, requests.
    computed: HashSet<AttemptKey>,
    finished: HashSet<AttemptKey>,
    /// Each prefill rank's blocks given back, for each request.
    given_back: HashMap<(usize, AttemptKey), Vec<SendOutcome>>,
    /// Whether a control connection broke.
    disconnected: bool,
    /// Transfers decode's engine dropped unregistered.
    abandoned: HashSet<u8>,
}

impl Seen {
    /// Reads what every rank's engine heard, checking each Ready's bytes as it comes.
    fn collect(&mut self, pair: &Pair) {
        for d in 0..pair.decode_ranks() {
            for event in pair.rank_events(d) {
                let key = match &event {
                    RecvEvent::Ready { key, .. } => {
                        assert!(
                            self.computed.contains(key) || self.finished.contains(key),
                            "{key} ready, but prefill never computed it"
                        );
                        let t = u8::try_from(key.transfer.0).expect("small");
                        let (from, to) = (prefill_blocks(t), decode_blocks(*key));
                        assert!(
                            pair.rank_landed(d, &from, &to, 0..TOKENS),
                            "{key} ready on decode rank {d}, but its KV is not all there"
                        );
                        *key
                    }
                    RecvEvent::Failed { key, .. } => *key,
                };
                assert!(
                    self.registered.contains(&key),
                    "an end for {key}, never registered"
                );
                // Decode's engine may reuse the blocks at once: nothing may still write
                // there (decode's bound for prefill's word is longer than the steps; the
                // transfers held in flight end before it passes).
                assert!(
                    !pair.in_flight(d, key),
                    "{key} ended on decode rank {d} with a transfer in flight: {event:?}"
                );
                self.ends.entry((d, key)).or_default().push(event);
            }
        }
        for p in 0..pair.prefill_ranks() {
            for done in pair.rank_finished(p) {
                assert!(
                    self.finished.contains(&done.key),
                    "{} given back, but never finished",
                    done.key
                );
                let given_back = self.given_back.entry((p, done.key)).or_default();
                given_back.push(done.outcome);
            }
        }
    }
}

fn run((prefill_tp, decode_tp): (u32, u32), steps: &[Step]) {
    let mut pair = Pair::ranks(
        prefill_tp,
        decode_tp,
        |_| {},
        |decode| {
            decode.registration_lease = LEASE;
            decode.quiesce_timeout = Some(QUIESCE);
        },
    );
    for t in 1..=3 {
        pair.fill(&prefill_blocks(t), t);
    }
    pair.fill(&STALE, 99);
    let mut seen = Seen::default();
    let mut now = Duration::ZERO;
    for &step in steps {
        match step {
            Step::Register { transfer, attempt } => {
                let key = key_of(transfer, attempt);
                if !seen.abandoned.contains(&transfer) && seen.registered.insert(key) {
                    if transfer == PULLED {
                        let from = prefill_blocks(transfer);
                        pair.pull(key, TOKENS, decode_blocks(key), from);
                    } else {
                        pair.register(key, TOKENS, decode_blocks(key));
                    }
                }
            }
            Step::Progress {
                transfer,
                attempt,
                tokens,
                layers,
                elsewhere,
            } => {
                let key = key_of(transfer, attempt);
                if transfer != PULLED && !seen.finished.contains(&key) {
                    let blocks = if elsewhere {
                        STALE.to_vec()
                    } else {
                        prefill_blocks(transfer)
                    };
                    let blocks = blocks[..usize::from(tokens / 4)].to_vec();
                    pair.progress(key, blocks, u64::from(tokens), layers.map(u32::from));
                }
            }
            Step::Seal { transfer, attempt } => {
                let key = key_of(transfer, attempt);
                if transfer != PULLED && !seen.finished.contains(&key) {
                    seen.computed.insert(key);
                    pair.seal(key, TOKENS, prefill_blocks(transfer));
                }
            }
            Step::Finish { transfer, attempt } => {
                let key = key_of(transfer, attempt);
                if seen.finished.insert(key) {
                    if transfer == PULLED {
                        pair.finish_pull(key, TOKENS, prefill_blocks(transfer));
                    } else {
                        pair.finish(key, TOKENS, prefill_blocks(transfer));
                    }
                }
            }
            Step::Abort { transfer } => {
                pair.abort(TransferId(u128::from(transfer)), None);
            }
            Step::Preempt { transfer, attempt } => {
                let key = key_of(transfer, attempt);
                if !seen.finished.contains(&key) {
                    pair.preempt(key);
                }
            }
            Step::Cancel { transfer } => {
                pair.cancel(TransferId(u128::from(transfer)), None);
            }
            Step::Wait { ms } => {
                now += Duration::from_millis(u64::from(ms));
                pair.at(now);
            }
            Step::HoldTransfers(hold) => {
                pair.hold_transfers = hold;
                pair.at(now);
            }
            Step::LoseNotice => pair.notices_to_lose += 1,
            Step::Abandon { transfer } => {
                let registered = seen
                    .registered
                    .iter()
                    .any(|k| k.transfer.0 == u128::from(transfer));
                if !registered && seen.abandoned.insert(transfer) {
                    pair.abandon(TransferId(u128::from(transfer)));
                }
            }
            Step::Disconnect {
                decode_rank,
                prefill_rank,
            } => {
                let d = usize::from(decode_rank) % pair.decode_ranks();
                let p = usize::from(prefill_rank) % pair.prefill_ranks();
                seen.disconnected |= pair.disconnect(d, p);
            }
        }
        seen.collect(&pair);
    }
    // The writes end, every request prefill computed is finished, and every bound passes.
    pair.hold_transfers = false;
    now += QUIESCE + LEASE;
    pair.at(now);
    seen.collect(&pair);
    for key in seen.computed.clone() {
        if seen.finished.insert(key) {
            let transfer = u8::try_from(key.transfer.0).expect("small");
            pair.finish(key, TOKENS, prefill_blocks(transfer));
        }
    }
    now += QUIESCE + LEASE;
    pair.at(now);
    seen.collect(&pair);

    for key in &seen.registered {
        for d in 0..pair.decode_ranks() {
            let ends = seen.ends.get(&(d, *key));
            let n = ends.map_or(0, Vec::len);
            assert_eq!(n, 1, "{key} ended {n} times on decode rank {d}: {ends:?}");
        }
    }
    for key in &seen.finished {
        for p in 0..pair.prefill_ranks() {
            let back = seen.given_back.get(&(p, *key));
            let n = back.map_or(0, Vec::len);
            assert_eq!(
                n, 1,
                "{key} given back {n} times on prefill rank {p}: {back:?}"
            );
        }
    }
    assert_eq!(pair.prefill_held(), 0, "prefill holds blocks at the end");
    assert_eq!(
        pair.decode_held(),
        0,
        "decode holds registrations at the end"
    );
    // Without prefill's word, only where a connection broke (and only past the bound).
    assert!(seen.disconnected || pair.released_unconfirmed() == 0);
}

/// The cases the property test shrank its failures to, kept as they were (the strategy's
/// seeds in `proptest-regressions/` stop naming them once the strategy changes).
#[test]
fn the_interleavings_that_failed_once() {
    let (t, a) = (2, 0);
    run(
        (1, 1),
        &[
            Step::Progress {
                transfer: t,
                attempt: a,
                tokens: 4,
                layers: None,
                elsewhere: false,
            },
            Step::HoldTransfers(true),
            Step::Register {
                transfer: t,
                attempt: a,
            },
            Step::Seal {
                transfer: t,
                attempt: a,
            },
        ],
    );
    let (t, a) = (1, 0);
    run(
        (1, 1),
        &[
            Step::Seal {
                transfer: t,
                attempt: a,
            },
            Step::HoldTransfers(true),
            Step::Register {
                transfer: t,
                attempt: a,
            },
            Step::LoseNotice,
        ],
    );
}

/// Prefill and decode tensor-parallel sizes: equal, or either twice the other.
fn sizes() -> impl Strategy<Value = (u32, u32)> {
    prop_oneof![Just((1, 1)), Just((1, 2)), Just((2, 1)), Just((2, 2))]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever the order of both engines' calls, peers' messages, lost notices, slow
    /// writes and time: every registered request ends exactly once, a ready one holds all
    /// its KV, every finished request's blocks go back exactly once, and nothing stays held.
    #[test]
    fn every_interleaving_ends_each_request_once_and_holds_nothing(
        sizes in sizes(),
        steps in proptest::collection::vec(step(), 0..40),
    ) {
        run(sizes, &steps);
    }
}
