//! `kvx pd` on a GPU: the caches in GPU memory and the GPU engine, over CUDA IPC and NIXL.

#[path = "support/pair.rs"]
mod pair;

use pair::*;

/// The pair with its caches in GPU memory and the GPU engine (`--device cuda`: prefill's and
/// decode's steps as cuBLAS products, the pattern written and checked by kernels), over CUDA
/// IPC and NIXL (`VRAM`), push and pull: every byte verified on the GPU. Skipped, saying so,
/// without a CUDA device (failing instead under `KVX_REQUIRE_GPU=1`), the NIXL half without a
/// NIXL runtime (`KVX_NIXL_LIB_DIR`).
#[test]
fn on_a_gpu_push_and_pull_verify_every_byte() {
    let test = "on_a_gpu_push_and_pull_verify_every_byte";
    if let Err(why) = kvx_rdma::cuda::device_count().and_then(|n| {
        if n > 0 {
            Ok(n)
        } else {
            Err(kvx_rdma::cuda::CudaError::NoDevice)
        }
    }) {
        assert!(
            std::env::var_os("KVX_REQUIRE_GPU").is_none(),
            "{test}: KVX_REQUIRE_GPU is set but {why}"
        );
        eprintln!("SKIPPED {test}: {why}");
        return;
    }
    let gpu = ["--device", "cuda", "--layers", "6", "--hidden", "256"];
    for transport in ["cuda-ipc", "nixl"] {
        if transport == "nixl" && std::env::var_os("KVX_NIXL_LIB_DIR").is_none() {
            eprintln!("SKIPPED {test} over nixl: no NIXL runtime (KVX_NIXL_LIB_DIR)");
            continue;
        }
        for mode in ["push", "pull"] {
            let (report, _, _) = run_pair(&Run {
                transport,
                mode,
                prefill: &gpu,
                decode: &gpu,
                requests: 6,
                tokens: "100,300",
                hosts: None,
            });
            check(&report, 6, 3 * 100 + 3 * 300);
            assert_eq!(report["device"], "cuda", "{report}");
            eprintln!("{test}: {transport} {mode}: 6 requests, every byte verified on the GPU");
        }
    }
}
