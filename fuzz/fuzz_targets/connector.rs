//! A producer rank's state machine under hostile consumers and an arbitrary (well-formed)
//! engine, on a virtual clock: every request the engine finished is given back exactly once
//! after the leases, nothing else is, and no block stays held; a panic anywhere is a finding.
//! The harness is `kvx_vllm::producer::fuzz` (feature `fuzzing`), which `cargo test` also runs
//! over random input.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvx_vllm::producer::fuzz::session(data);
});
