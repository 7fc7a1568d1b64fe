//! kvx-rendezvous: being written.
#![forbid(unsafe_code)]
