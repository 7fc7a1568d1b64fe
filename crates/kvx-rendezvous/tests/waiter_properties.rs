//! Random sequences against the consumer-side [`Waiter`], checked against a small model after
//! every step: every payload comes back exactly once; `Ready` only when every expected rank of
//! that very attempt reported; stale and duplicate notices change nothing; nothing waits past
//! its lease; `poll_timeout` is the earliest deadline; size stays bounded.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use kvx_core::{Attempt, Rank, TransferId};
use kvx_rendezvous::{AttemptKey, Reason, Timestamp, Waiter, WaiterAction, WaiterConfig};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

#[derive(Clone, Debug)]
enum Op {
    Expect {
        t: u8,
        a: u8,
        ranks: u8,
        lease_ms: u32,
    },
    Complete {
        t: u8,
        a: u8,
        rank: u8,
    },
    Fail {
        t: u8,
        a: u8,
    },
    Cancel {
        t: u8,
        a: Option<u8>,
    },
    Heartbeat {
        ts: Vec<u8>,
    },
    Advance {
        ms: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..5, 0u8..3, any::<u8>(), 1u32..2_000)
            .prop_map(|(t, a, ranks, lease_ms)| Op::Expect { t, a, ranks, lease_ms }),
        6 => (0u8..5, 0u8..3, 0u8..5).prop_map(|(t, a, rank)| Op::Complete { t, a, rank }),
        1 => (0u8..5, 0u8..3).prop_map(|(t, a)| Op::Fail { t, a }),
        1 => (0u8..5, proptest::option::of(0u8..3)).prop_map(|(t, a)| Op::Cancel { t, a }),
        1 => vec(0u8..5, 0..3).prop_map(|ts| Op::Heartbeat { ts }),
        2 => (0u32..1_500).prop_map(|ms| Op::Advance { ms }),
    ]
}

fn key(t: u8, a: u8) -> AttemptKey {
    AttemptKey::new(TransferId(u128::from(t)), Attempt(u32::from(a)))
}

/// The model's view of one wait.
struct Model {
    key: AttemptKey,
    payload: u64,
    expected: BTreeSet<u8>,
    completed: BTreeSet<u8>,
}

#[derive(Default)]
struct Ledger {
    next: u64,
    /// Payloads inside the waiter.
    inside: HashMap<u64, AttemptKey>,
    /// The model's waits, by transfer.
    waits: HashMap<TransferId, Model>,
}

fn check_actions(waiter: &mut Waiter<u64>, ledger: &mut Ledger) -> Result<(), TestCaseError> {
    while let Some(action) = waiter.poll_action() {
        let (key, payload, ready, reason) = match action {
            WaiterAction::Ready { key, payload } => (key, payload, true, None),
            WaiterAction::Failed {
                key,
                payload,
                reason,
            } => (key, payload, false, Some(reason)),
        };
        let Some(inside_key) = ledger.inside.remove(&payload) else {
            // Refused on arrival: never went inside, handed back at once.
            prop_assert!(!ready, "payload {} ready but never held", payload);
            prop_assert!(
                matches!(
                    reason,
                    Some(
                        Reason::Stale | Reason::Duplicate | Reason::Capacity | Reason::NoProducers
                    )
                ),
                "refusal reason {:?}",
                reason
            );
            continue;
        };
        prop_assert_eq!(inside_key, key);
        let model = ledger.waits.remove(&key.transfer);
        let Some(model) = model else {
            return Err(TestCaseError::fail(format!(
                "{key} came back but not modelled"
            )));
        };
        prop_assert_eq!(model.payload, payload);
        prop_assert_eq!(model.key, key);
        if ready {
            prop_assert_eq!(&model.completed, &model.expected, "ready too early");
        }
    }
    Ok(())
}

fn run(ops: Vec<Op>, max_waiting: usize) -> Result<(), TestCaseError> {
    let mut config = WaiterConfig::default();
    config.max_waiting = max_waiting;
    config.max_lease = Duration::from_millis(1_500);
    let mut waiter: Waiter<u64> =
        Waiter::new(config).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut ledger = Ledger::default();
    let mut now = Timestamp::ZERO;
    for op in ops {
        // Which transfer's wait this op must end (Some(true)) or leave alone (Some(false)).
        let mut must_end: Option<(TransferId, bool)> = None;
        match op {
            Op::Expect {
                t,
                a,
                ranks,
                lease_ms,
            } => {
                ledger.next += 1;
                let payload = ledger.next;
                let expected: BTreeSet<u8> = (0..5).filter(|r| ranks & (1 << r) != 0).collect();
                let k = key(t, a);
                let accepted = !expected.is_empty()
                    && match ledger.waits.get(&k.transfer) {
                        Some(m) => k.attempt > m.key.attempt,
                        None => ledger.waits.len() < max_waiting,
                    };
                waiter.expect(
                    now,
                    k,
                    expected.iter().map(|r| Rank(u32::from(*r))),
                    Duration::from_millis(u64::from(lease_ms)),
                    payload,
                );
                if accepted {
                    // The superseded wait (if any) comes back through check_actions first.
                    check_actions(&mut waiter, &mut ledger)?;
                    ledger.inside.insert(payload, k);
                    ledger.waits.insert(
                        k.transfer,
                        Model {
                            key: k,
                            payload,
                            expected,
                            completed: BTreeSet::new(),
                        },
                    );
                } else {
                    let refused = waiter.poll_action();
                    prop_assert!(
                        matches!(refused, Some(WaiterAction::Failed { payload: p, .. }) if p == payload),
                        "expected the refusal of {}",
                        payload
                    );
                }
            }
            Op::Complete { t, a, rank } => {
                let k = key(t, a);
                if let Some(m) = ledger.waits.get_mut(&k.transfer) {
                    if m.key == k && m.expected.contains(&rank) {
                        m.completed.insert(rank);
                    }
                    must_end = Some((k.transfer, m.completed == m.expected));
                }
                waiter.completion(now, k, Rank(u32::from(rank)));
            }
            Op::Fail { t, a } => {
                let k = key(t, a);
                if let Some(m) = ledger.waits.get(&k.transfer) {
                    must_end = Some((k.transfer, m.key == k));
                }
                waiter.failure(now, k, Reason::PeerFailed);
            }
            Op::Cancel { t, a } => {
                let transfer = TransferId(u128::from(t));
                if let Some(m) = ledger.waits.get(&transfer) {
                    let hits = a.is_none_or(|a| m.key.attempt == Attempt(u32::from(a)));
                    must_end = Some((transfer, hits));
                }
                waiter.cancel(
                    now,
                    TransferId(u128::from(t)),
                    a.map(|a| Attempt(u32::from(a))),
                    Reason::Aborted,
                );
            }
            Op::Heartbeat { ts } => {
                waiter.heartbeat(now, ts.into_iter().map(|t| TransferId(u128::from(t))));
            }
            Op::Advance { ms } => {
                now = now + Duration::from_millis(u64::from(ms));
            }
        }
        check_actions(&mut waiter, &mut ledger)?;
        if let Some((transfer, ends)) = must_end {
            prop_assert_eq!(
                !ledger.waits.contains_key(&transfer),
                ends,
                "wait of {} should end: {}",
                transfer,
                ends
            );
        }
        waiter.handle_timeout(now);
        check_actions(&mut waiter, &mut ledger)?;
        // The model and the waiter agree on what is waited for, nothing is past its lease,
        // and the wake-up time is exact.
        prop_assert_eq!(waiter.len(), ledger.waits.len());
        prop_assert!(waiter.len() <= max_waiting);
        let mut earliest = None;
        for (k, deadline) in waiter.entries() {
            prop_assert!(deadline > now, "{} waits past its lease", k);
            prop_assert_eq!(ledger.waits.get(&k.transfer).map(|m| m.key), Some(k));
            earliest = Some(earliest.map_or(deadline, |e: Timestamp| e.min(deadline)));
        }
        prop_assert_eq!(waiter.poll_timeout(), earliest);
    }
    waiter.handle_timeout(now + Duration::from_secs(10));
    check_actions(&mut waiter, &mut ledger)?;
    prop_assert!(
        ledger.inside.is_empty(),
        "payloads never returned: {:?}",
        ledger.inside
    );
    prop_assert!(waiter.is_empty());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/waiter_properties.txt",
        ))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn waiter_matches_its_model(ops in vec(op(), 0..150), max_waiting in 1usize..6) {
        run(ops, max_waiting)?;
    }
}
