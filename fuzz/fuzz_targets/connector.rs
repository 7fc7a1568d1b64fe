//! The connector's state machines under hostile peers on a virtual clock: the first byte picks
//! the side. A producer rank (`kvx_vllm::producer::fuzz`) under hostile consumers and a
//! well-formed engine: every request the engine finished is given back exactly once after the
//! leases, and no block stays held. A consumer rank (`kvx_vllm::consumer::fuzz`) whose prefill
//! rank is hostile: every pushed request ends exactly once, and is ready only after a write with
//! its own notice. A panic anywhere is a finding. `cargo test` runs both harnesses over random
//! input too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match data.split_first() {
        Some((side, rest)) if side & 1 == 1 => kvx_vllm::consumer::fuzz::session(rest),
        Some((_, rest)) => kvx_vllm::producer::fuzz::session(rest),
        None => {}
    }
});
