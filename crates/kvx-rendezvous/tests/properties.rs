//! Random interleavings: proptest generates sequences of events and time steps, and the
//! simulator checks the invariants after every step (at most one transfer per attempt, no stale
//! pairing, every payload back exactly once, nothing held past its lease, exact
//! `poll_timeout`, bounded size).

use std::time::Duration;

use kvx_rendezvous::sim::{events_from_bytes, Sim, SimEvent};
use kvx_rendezvous::Config;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

fn event() -> impl Strategy<Value = SimEvent> {
    let transfer = 0u8..6;
    let attempt = 0u8..4;
    prop_oneof![
        4 => (transfer.clone(), attempt.clone(), 0u8..3, 0u32..3_000).prop_map(
            |(transfer, attempt, consumer, lease_ms)| SimEvent::Register {
                transfer,
                attempt,
                consumer,
                lease_ms,
            }
        ),
        4 => (transfer.clone(), attempt.clone())
            .prop_map(|(transfer, attempt)| SimEvent::PrefillDone { transfer, attempt }),
        1 => (transfer.clone(), proptest::option::weighted(0.8, attempt.clone()))
            .prop_map(|(transfer, attempt)| SimEvent::Abort { transfer, attempt }),
        1 => (transfer.clone(), attempt.clone())
            .prop_map(|(transfer, attempt)| SimEvent::Preempt { transfer, attempt }),
        2 => (0u8..3, vec(transfer.clone(), 0..4))
            .prop_map(|(consumer, transfers)| SimEvent::Heartbeat { consumer, transfers }),
        2 => (transfer, attempt, any::<bool>())
            .prop_map(|(transfer, attempt, ok)| SimEvent::Finish { transfer, attempt, ok }),
        3 => (0u32..1_500).prop_map(|ms| SimEvent::Advance { ms }),
        1 => (0u32..1_000).prop_map(|ms| SimEvent::Rewind { ms }),
    ]
}

/// Configurations with small limits and short leases, so that capacity, expiry and timeouts
/// all happen; tombstones outlive the run, so the strict checks apply.
fn strict_config() -> impl Strategy<Value = Config> {
    (1usize..8, 1u64..2_500, 1u64..3_000, 1u64..3_000).prop_map(
        |(max_entries, producer_ms, registration_ms, transfer_ms)| {
            let mut c = Config::default();
            c.max_entries = max_entries;
            c.producer_lease = Duration::from_millis(producer_ms);
            c.max_registration_lease = Duration::from_millis(registration_ms);
            c.transfer_timeout = Duration::from_millis(transfer_ms);
            c.tombstone_ttl = Duration::from_secs(1_000_000);
            c.max_tombstones = 10_000;
            c
        },
    )
}

/// Tiny, short-lived tombstone memory: duplicates may be served again once forgotten (the
/// documented limit), but the ledger, lease, timeout and size invariants must still hold.
fn forgetful_config() -> impl Strategy<Value = Config> {
    (1usize..8, 0usize..4, 1u64..3_000).prop_map(|(max_entries, max_tombstones, ttl_ms)| {
        let mut c = Config::default();
        c.max_entries = max_entries;
        c.max_tombstones = max_tombstones;
        c.tombstone_ttl = Duration::from_millis(ttl_ms);
        c.producer_lease = Duration::from_millis(700);
        c.max_registration_lease = Duration::from_millis(900);
        c.transfer_timeout = Duration::from_millis(1_100);
        c
    })
}

fn run(config: Config, events: Vec<SimEvent>, shutdown: bool) -> Result<(), TestCaseError> {
    let mut sim = Sim::new(config).map_err(|e| TestCaseError::fail(e.to_string()))?;
    for (i, event) in events.into_iter().enumerate() {
        let shown = format!("{event:?}");
        sim.step(event)
            .map_err(|v| TestCaseError::fail(format!("step {i} ({shown}): {v}")))?;
    }
    let end = if shutdown {
        sim.shutdown()
    } else {
        sim.finish()
    };
    end.map_err(|v| TestCaseError::fail(format!("at the end: {v}")))?;
    prop_assert_eq!(sim.outstanding(), 0);
    prop_assert!(sim.matcher().is_empty());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        // Relative to the package root, where cargo runs tests.
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/properties.txt",
        ))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn invariants_hold_for_any_interleaving(config in strict_config(), events in vec(event(), 0..120)) {
        run(config, events, false)?;
    }

    #[test]
    fn invariants_hold_when_shut_down_midway(config in strict_config(), events in vec(event(), 0..80)) {
        run(config, events, true)?;
    }

    #[test]
    fn ledger_and_bounds_hold_with_forgetful_tombstones(
        config in forgetful_config(),
        events in vec(event(), 0..120),
    ) {
        run(config, events, false)?;
    }

    #[test]
    fn fuzzer_byte_decoding_drives_valid_runs(bytes in vec(any::<u8>(), 0..400)) {
        let mut c = Config::default();
        c.max_entries = 5;
        c.producer_lease = Duration::from_millis(800);
        c.max_registration_lease = Duration::from_millis(1_000);
        c.transfer_timeout = Duration::from_millis(1_500);
        run(c, events_from_bytes(&bytes), false)?;
    }
}

#[test]
fn every_attempt_ends_exactly_one_way_in_a_long_random_run() {
    // A long deterministic run (a fixed byte pattern through the fuzzer's decoder) over the
    // default configuration: many transfers start, and every token comes back.
    let bytes: Vec<u8> = (0u32..40_000)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut sim = Sim::new(Config::default()).expect("default config is valid");
    for event in events_from_bytes(&bytes) {
        sim.step(event).expect("no violation");
    }
    assert!(sim.started() > 0);
    sim.finish().expect("clean end");
}
