//! Placeholder until kvx-rendezvous lands; replaced by the event-sequence fuzzer.
#![no_main]
use libfuzzer_sys::fuzz_target;
fuzz_target!(|_data: &[u8]| {});
