//! Loading a library that is not libfabric fails, says why, and loads nothing (a process of its
//! own: in the unit tests' process the real library is loaded, and stays).

use libfabric_sys::{load, loaded};

#[test]
fn a_library_that_is_not_there_is_an_error_naming_it_and_loads_nothing() {
    let err = load(c"libkvx-no-such-fabric.so.1").unwrap_err();
    assert!(err.contains("libkvx-no-such-fabric.so.1"), "{err}");
    assert!(!loaded());
}

#[test]
fn a_library_without_libfabrics_calls_is_an_error_naming_the_missing_call() {
    // libc is in every process, and exports none of libfabric's calls.
    let err = load(c"libc.so.6").unwrap_err();
    assert!(err.contains("exports no fi_getinfo"), "{err}");
    assert!(!loaded());
}
