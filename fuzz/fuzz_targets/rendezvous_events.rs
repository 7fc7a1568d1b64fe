//! Drives the rendezvous matcher through an arbitrary sequence of events and time steps decoded
//! from the fuzzer's bytes, and checks its invariants after every step (the simulator's
//! ledger: at most one transfer per attempt, no stale pairing, every payload back exactly once,
//! nothing held past its lease, an exact `poll_timeout`, bounded size). Any violation panics.
#![no_main]

use std::time::Duration;

use kvx_rendezvous::sim::{events_from_bytes, Sim};
use kvx_rendezvous::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first two bytes pick the limits, so that capacity, tombstone eviction and timeouts
    // are all reachable; the rest are events (4 bytes each).
    let [limits, leases, rest @ ..] = data else {
        return;
    };
    let mut config = Config::default();
    config.max_entries = usize::from(limits % 8) + 1;
    config.max_tombstones = usize::from(limits / 8 % 8);
    config.tombstone_ttl = Duration::from_millis(u64::from(limits / 64) * 2_000 + 1);
    config.producer_lease = Duration::from_millis(u64::from(leases % 16) * 100 + 1);
    config.max_registration_lease = Duration::from_millis(u64::from(leases / 16) * 100 + 1);
    config.transfer_timeout = Duration::from_millis(u64::from(leases % 7) * 300 + 1);
    let Ok(mut sim) = Sim::new(config) else {
        return;
    };
    for event in events_from_bytes(rest) {
        if let Err(violation) = sim.step(event.clone()) {
            panic!("{event:?}: {violation}");
        }
    }
    if let Err(violation) = sim.finish() {
        panic!("at the end: {violation}");
    }
});
