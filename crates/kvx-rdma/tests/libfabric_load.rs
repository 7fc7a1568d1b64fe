//! Nothing links libfabric: where it cannot be loaded (here the process chose a library that is
//! not there, as `KVX_LIBFABRIC` makes the binaries choose), opening a libfabric transport fails with an error that says what to install,
//! and the process goes on with its other transports.
#![cfg(feature = "libfabric")]

use kvx_rdma::libfabric::{choose_library, load_library, LibfabricConfig, LibfabricTransport};
use kvx_rdma::loopback::LoopbackFabric;
use kvx_rdma::Transport;

/// The whole error chain of `e`, as a log line shows it.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text += &format!(": {s}");
        source = s.source();
    }
    text
}

#[test]
fn without_libfabric_a_libfabric_transport_says_what_to_install_and_others_still_work() {
    // The only test of this process: the library is loaded, or not, once per process.
    assert!(choose_library("libkvx-no-such-fabric.so.1"));
    for config in [LibfabricConfig::shm(), LibfabricConfig::tcp(Some("lo"))] {
        let Err(err) = LibfabricTransport::open(&config) else {
            panic!("a libfabric transport opened without libfabric");
        };
        let text = chain(&err);
        assert!(
            text.contains("cannot load libfabric (libkvx-no-such-fabric.so.1)"),
            "{text}"
        );
        assert!(text.contains("Debian: libfabric1"), "{text}");
    }
    let again = load_library().unwrap_err().to_string();
    assert!(again.contains("libkvx-no-such-fabric.so.1"), "{again}");
    // Loaded (or not) once: another choice comes too late.
    assert!(!choose_library("libfabric.so.1"));
    // Another transport of the same process is not affected.
    let fabric = LoopbackFabric::new();
    let (mut a, b) = (fabric.endpoint(), fabric.endpoint());
    a.connect(&b.local_desc())
        .expect("a loopback peer connects");
}
