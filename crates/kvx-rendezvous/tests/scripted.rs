//! Scripted interleavings of a producer and a consumer, driven on a virtual clock by the
//! simulator, which checks every invariant after every step. Each test also pins the exact
//! actions the matcher emits.

use std::time::Duration;

use kvx_rendezvous::sim::{key, Observed, Sim, SimEvent, Violation};
use kvx_rendezvous::{Config, Reason};

use Observed::{Cancel, Fail, Reject, Release, Start};
use SimEvent::{Abort, Advance, Finish, Heartbeat, Preempt, PrefillDone, Register, Rewind};

const LEASE_MS: u32 = 1_000;

fn config() -> Config {
    let mut c = Config::default();
    c.producer_lease = Duration::from_millis(2_000);
    c.max_registration_lease = Duration::from_millis(5_000);
    c.transfer_timeout = Duration::from_millis(3_000);
    c.tombstone_ttl = Duration::from_secs(3_600);
    c
}

fn reg(transfer: u8, attempt: u8) -> SimEvent {
    Register {
        transfer,
        attempt,
        consumer: 0,
        lease_ms: LEASE_MS,
    }
}

fn done(transfer: u8, attempt: u8) -> SimEvent {
    PrefillDone { transfer, attempt }
}

/// Runs `events`, returns the actions seen, and checks the whole run ends clean.
fn run(
    config: Config,
    events: impl IntoIterator<Item = SimEvent>,
) -> Result<Vec<Observed>, Violation> {
    let mut sim = Sim::new(config).expect("valid config");
    for event in events {
        sim.step(event)?;
    }
    let log = sim.take_log();
    sim.finish()?;
    Ok(log)
}

#[test]
fn registration_first_then_prefill_starts_once() -> Result<(), Violation> {
    let log = run(
        config(),
        [
            reg(1, 0),
            done(1, 0),
            Finish {
                transfer: 1,
                attempt: 0,
                ok: true,
            },
        ],
    )?;
    assert_eq!(log, vec![Start(key(1, 0))]);
    Ok(())
}

#[test]
fn prefill_first_then_registration_starts_once() -> Result<(), Violation> {
    let log = run(config(), [done(1, 0), Advance { ms: 500 }, reg(1, 0)])?;
    assert_eq!(log, vec![Start(key(1, 0))]);
    Ok(())
}

#[test]
fn duplicates_are_idempotent_before_during_and_after_the_transfer() -> Result<(), Violation> {
    let other_consumer = Register {
        transfer: 1,
        attempt: 0,
        consumer: 1,
        lease_ms: LEASE_MS,
    };
    let log = run(
        config(),
        [
            reg(1, 0),
            reg(1, 0),
            other_consumer,
            done(1, 0),
            done(1, 0),
            reg(1, 0),
            Finish {
                transfer: 1,
                attempt: 0,
                ok: true,
            },
            Finish {
                transfer: 1,
                attempt: 0,
                ok: true,
            },
            reg(1, 0),
            done(1, 0),
        ],
    )?;
    assert_eq!(
        log,
        vec![
            Reject(key(1, 0), Reason::Duplicate),
            Reject(key(1, 0), Reason::Conflict),
            Start(key(1, 0)),
            Release(key(1, 0), Reason::Duplicate),
            Reject(key(1, 0), Reason::Duplicate),
            Reject(key(1, 0), Reason::Duplicate),
            Release(key(1, 0), Reason::Duplicate),
        ]
    );
    Ok(())
}

#[test]
fn preemption_drops_the_stale_half_and_the_next_attempt_matches() -> Result<(), Violation> {
    let log = run(
        config(),
        [
            reg(1, 0),
            Preempt {
                transfer: 1,
                attempt: 0,
            },
            // Prefill of the preempted attempt finishes anyway: refused, blocks released.
            done(1, 0),
            // The request returns with a higher attempt.
            reg(1, 1),
            done(1, 1),
            // A straggler of attempt 0 never pairs with attempt 1.
            reg(1, 0),
        ],
    )?;
    assert_eq!(
        log,
        vec![
            Fail(key(1, 0), Reason::Preempted),
            Release(key(1, 0), Reason::Preempted),
            Start(key(1, 1)),
            Reject(key(1, 0), Reason::Stale),
        ]
    );
    Ok(())
}

#[test]
fn a_newer_attempt_supersedes_a_held_half_of_either_side() -> Result<(), Violation> {
    let log = run(
        config(),
        [
            done(1, 0),
            reg(1, 1),  // supersedes the held prefill of attempt 0
            done(1, 0), // stale
            done(1, 1),
            reg(2, 0),
            done(2, 2), // supersedes the held registration of attempt 0
            reg(2, 2),
        ],
    )?;
    assert_eq!(
        log,
        vec![
            Release(key(1, 0), Reason::Superseded),
            Release(key(1, 0), Reason::Stale),
            Start(key(1, 1)),
            Fail(key(2, 0), Reason::Superseded),
            Start(key(2, 2)),
        ]
    );
    Ok(())
}

#[test]
fn a_newer_attempt_cancels_a_running_transfer_of_an_older_one() -> Result<(), Violation> {
    let log = run(config(), [reg(1, 0), done(1, 0), reg(1, 1), done(1, 1)])?;
    assert_eq!(
        log,
        vec![
            Start(key(1, 0)),
            Cancel(key(1, 0), Reason::Superseded),
            Start(key(1, 1)),
        ]
    );
    Ok(())
}

#[test]
fn retry_under_a_new_transfer_id_after_aborting_the_old_one() -> Result<(), Violation> {
    let log = run(
        config(),
        [
            done(1, 0),
            Abort {
                transfer: 1,
                attempt: None,
            },
            reg(2, 0),
            done(2, 0),
            // Late halves of the aborted transfer, any attempt, are refused.
            reg(1, 0),
            reg(1, 5),
        ],
    )?;
    assert_eq!(
        log,
        vec![
            Release(key(1, 0), Reason::Aborted),
            Start(key(2, 0)),
            Reject(key(1, 0), Reason::Aborted),
            Reject(key(1, 5), Reason::Aborted),
        ]
    );
    Ok(())
}

#[test]
fn abort_before_matching_releases_and_refuses_the_other_half() -> Result<(), Violation> {
    let log = run(
        config(),
        [
            reg(1, 0),
            Abort {
                transfer: 1,
                attempt: Some(0),
            },
            done(1, 0),
            // An abort before either half arrives also refuses both.
            Abort {
                transfer: 2,
                attempt: Some(0),
            },
            done(2, 0),
            reg(2, 0),
            // A higher attempt of an attempt-scoped abort is served.
            reg(2, 1),
            done(2, 1),
        ],
    )?;
    assert_eq!(
        log,
        vec![
            Fail(key(1, 0), Reason::Aborted),
            Release(key(1, 0), Reason::Aborted),
            Release(key(2, 0), Reason::Aborted),
            Reject(key(2, 0), Reason::Aborted),
            Start(key(2, 1)),
        ]
    );
    Ok(())
}

#[test]
fn aborting_or_preempting_an_older_attempt_leaves_the_live_one_alone() -> Result<(), Violation> {
    let log = run(
        config(),
        [
            reg(1, 1),
            Preempt {
                transfer: 1,
                attempt: 0,
            },
            Abort {
                transfer: 1,
                attempt: Some(0),
            },
            done(1, 1),
        ],
    )?;
    assert_eq!(log, vec![Start(key(1, 1))]);
    Ok(())
}

#[test]
fn abort_after_matching_cancels_the_transfer() -> Result<(), Violation> {
    let log = run(
        config(),
        [
            reg(1, 0),
            done(1, 0),
            Abort {
                transfer: 1,
                attempt: Some(0),
            },
            // The driver's late report of the cancelled transfer is harmless.
            Finish {
                transfer: 1,
                attempt: 0,
                ok: false,
            },
            reg(1, 0),
            // Aborting a stale attempt does nothing.
            Abort {
                transfer: 1,
                attempt: Some(0),
            },
        ],
    )?;
    assert_eq!(
        log,
        vec![
            Start(key(1, 0)),
            Cancel(key(1, 0), Reason::Aborted),
            Reject(key(1, 0), Reason::Duplicate),
        ]
    );
    Ok(())
}

#[test]
fn heartbeats_extend_leases_and_a_lost_heartbeat_expires_cleanly() -> Result<(), Violation> {
    let hb = |transfers: Vec<u8>| Heartbeat {
        consumer: 0,
        transfers,
    };
    let log = run(
        config(),
        [
            reg(1, 0),  // lease until 1000 ms
            done(2, 0), // producer lease until 2000 ms
            Advance { ms: 800 },
            hb(vec![1, 2]),        // 1 until 1800, 2 until 2800
            Advance { ms: 900 },   // 1700: nothing expires
            Advance { ms: 100 },   // 1800: the registration's heartbeat was lost
            Advance { ms: 1_000 }, // 2800: the prefill's too
            done(1, 0),            // too late: the registration is gone
            reg(2, 0),             // too late: the blocks are gone
        ],
    )?;
    assert_eq!(
        log,
        vec![
            Fail(key(1, 0), Reason::LeaseExpired),
            Release(key(2, 0), Reason::LeaseExpired),
            Release(key(1, 0), Reason::CounterpartExpired),
            Reject(key(2, 0), Reason::CounterpartExpired),
        ]
    );
    Ok(())
}

#[test]
fn a_heartbeat_from_another_consumer_does_not_keep_a_registration() -> Result<(), Violation> {
    let log = run(
        config(),
        [
            reg(1, 0),
            Advance { ms: 900 },
            Heartbeat {
                consumer: 2,
                transfers: vec![1],
            },
            Advance { ms: 100 },
        ],
    )?;
    assert_eq!(log, vec![Fail(key(1, 0), Reason::LeaseExpired)]);
    Ok(())
}

#[test]
fn expiries_out_of_order_and_in_one_late_wake_up_all_fire() -> Result<(), Violation> {
    // Leases that end in the reverse order of arrival, one extended past the others, and a
    // clock that stalls and reads backwards: the reaper must still release everything, once.
    let mut events = Vec::new();
    for t in 0..6u8 {
        events.push(Register {
            transfer: t,
            attempt: 0,
            consumer: 0,
            lease_ms: 4_000 - u32::from(t) * 500,
        });
    }
    events.push(done(7, 0));
    events.push(Advance { ms: 1_000 });
    events.push(Heartbeat {
        consumer: 0,
        transfers: vec![5],
    }); // 5: 1500 -> 2500
    events.push(Rewind { ms: 900 });
    events.push(Advance { ms: 10_000 });
    let log = run(config(), events)?;
    let mut expired: Vec<_> = log
        .iter()
        .filter_map(|o| match o {
            Fail(k, Reason::LeaseExpired) | Release(k, Reason::LeaseExpired) => Some(*k),
            _ => None,
        })
        .collect();
    assert_eq!(expired.len(), 7, "{log:?}");
    expired.sort();
    expired.dedup();
    assert_eq!(expired.len(), 7);
    Ok(())
}

#[test]
fn a_clock_that_reads_backwards_never_undoes_expiry() -> Result<(), Violation> {
    let mut sim = Sim::new(config()).expect("valid config");
    sim.step(reg(1, 0))?;
    sim.step(Advance { ms: 1_000 })?;
    assert_eq!(sim.take_log(), vec![Fail(key(1, 0), Reason::LeaseExpired)]);
    sim.step(Rewind { ms: 1_000 })?;
    sim.step(done(1, 0))?;
    assert_eq!(
        sim.take_log(),
        vec![Release(key(1, 0), Reason::CounterpartExpired)]
    );
    // New entries take their lease from the matcher's latest time, not the stale reading.
    sim.step(reg(2, 0))?;
    let entry = sim.matcher().entries().next().expect("held");
    assert!(entry.deadline > sim.matcher().now());
    sim.finish()
}

#[test]
fn a_transfer_that_never_finishes_is_cancelled_at_the_timeout() -> Result<(), Violation> {
    let log = run(
        config(),
        [
            reg(1, 0),
            done(1, 0),
            Advance { ms: 2_999 },
            Advance { ms: 1 },
            reg(1, 0),
        ],
    )?;
    assert_eq!(
        log,
        vec![
            Start(key(1, 0)),
            Cancel(key(1, 0), Reason::TransferTimeout),
            Reject(key(1, 0), Reason::Duplicate),
        ]
    );
    Ok(())
}

#[test]
fn capacity_refuses_new_entries_with_a_reason_and_still_completes_pairs() -> Result<(), Violation> {
    let mut c = config();
    c.max_entries = 2;
    let log = run(
        c,
        [
            reg(1, 0),
            done(2, 0),
            reg(3, 0),  // full: refused, never silently dropped
            done(3, 0), // its other half is refused at once, not held
            done(1, 0), // completes a pair: no new entry needed
            reg(4, 1),  // still full (one held, one in flight)
            Finish {
                transfer: 1,
                attempt: 0,
                ok: true,
            },
            // Room again, but a refused attempt is dead: the retry needs a higher attempt.
            reg(4, 1),
            reg(4, 2),
            done(4, 2),
        ],
    )?;
    assert_eq!(
        log,
        vec![
            Reject(key(3, 0), Reason::Capacity),
            Release(key(3, 0), Reason::CounterpartRejected),
            Start(key(1, 0)),
            Reject(key(4, 1), Reason::Capacity),
            Reject(key(4, 1), Reason::Capacity),
            Start(key(4, 2)),
        ]
    );
    Ok(())
}

#[test]
fn shutdown_hands_everything_back() -> Result<(), Violation> {
    let mut sim = Sim::new(config()).expect("valid config");
    for event in [reg(1, 0), done(2, 0), reg(3, 0), done(3, 0)] {
        sim.step(event)?;
    }
    sim.take_log();
    sim.shutdown()?;
    let mut log = sim.take_log();
    log.sort_by_key(|o| format!("{o}"));
    assert_eq!(
        log,
        vec![
            Cancel(key(3, 0), Reason::Shutdown),
            Fail(key(1, 0), Reason::Shutdown),
            Release(key(2, 0), Reason::Shutdown),
        ]
    );
    assert_eq!(sim.outstanding(), 0);
    Ok(())
}

#[test]
fn tombstones_are_bounded_and_forgotten_after_their_ttl() -> Result<(), Violation> {
    // The documented limit of idempotence: once an attempt's tombstone is forgotten, a replay of
    // both halves is served again. Keep `tombstone_ttl` well above any retransmission delay.
    let mut c = config();
    c.tombstone_ttl = Duration::from_millis(10_000);
    c.max_tombstones = 4;
    let mut sim = Sim::new(c).expect("valid config");
    for t in 0..8 {
        sim.step(Abort {
            transfer: t,
            attempt: None,
        })?;
        assert!(sim.matcher().tombstones() <= 4);
    }
    // The most recent max_tombstones / 2 are always remembered.
    assert_eq!(sim.matcher().tombstones(), 2);
    assert_eq!(sim.matcher().stats().tombstones_forgotten, 6);
    sim.step(reg(1, 0))?; // transfer 1's tombstone was forgotten: served again
    sim.step(reg(7, 0))?; // transfer 7's is remembered: refused
    assert_eq!(sim.take_log(), vec![Reject(key(7, 0), Reason::Aborted)]);
    // Age: the registration of 1 expires into a tombstone; a tombstone lives at least one ttl
    // and is gone after two.
    sim.step(Advance { ms: 10_000 })?;
    assert_eq!(sim.take_log(), vec![Fail(key(1, 0), Reason::LeaseExpired)]);
    assert_eq!(sim.matcher().tombstones(), 1);
    sim.step(done(1, 0))?;
    assert_eq!(
        sim.take_log(),
        vec![Release(key(1, 0), Reason::CounterpartExpired)]
    );
    sim.step(Advance { ms: 10_000 })?;
    assert_eq!(sim.matcher().tombstones(), 1);
    sim.step(Advance { ms: 10_000 })?;
    assert_eq!(sim.matcher().tombstones(), 0);
    sim.finish()
}

#[test]
fn invalid_configurations_are_refused() {
    let mut c = Config::default();
    c.max_entries = 0;
    assert!(Sim::new(c).is_err());
    let mut c = Config::default();
    c.producer_lease = Duration::ZERO;
    let err = Sim::new(c).expect_err("zero lease");
    assert!(err.to_string().contains("producer_lease"), "{err}");
}
