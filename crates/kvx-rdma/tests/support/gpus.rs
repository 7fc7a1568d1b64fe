//! The GPU tests' skip rule, shared by the GPU test binaries.

use kvx_rdma::cuda::device_count;

/// The number of CUDA devices, or `None` after saying (on stderr) why `test` is skipped. With
/// `KVX_REQUIRE_GPU=1` (set on GPU machines) a missing GPU fails the test instead.
pub(crate) fn gpus(test: &str, needed: u32) -> Option<u32> {
    let why = match device_count() {
        Ok(n) if n >= needed => return Some(n),
        Ok(n) => format!("needs {needed} CUDA devices, this machine has {n}"),
        Err(e) => e.to_string(),
    };
    assert!(
        std::env::var_os("KVX_REQUIRE_GPU").is_none(),
        "{test}: KVX_REQUIRE_GPU is set but {why}"
    );
    eprintln!("SKIPPED {test}: {why}");
    None
}
