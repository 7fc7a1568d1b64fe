//! Benchmarks: criterion benches by name, their estimates gathered into
//! `target/kvx-bench/<name>.json` (mean, median and bounds in nanoseconds per iteration).

use std::fs;
use std::path::Path;

use anyhow::{bail, Context as _};

use crate::{cargo, root, step};

// Declared here rather than in main.rs: a child module, found beside this file.
#[path = "vllm_bench.rs"]
mod vllm_bench;

/// (name, package, bench target, criterion groups, comma-separated)
pub(crate) const BENCHES: &[(&str, &str, &str, &str)] = &[
    ("plan", "kvx-layout", "plan", "plan_qwen3_32b_16k"),
    ("codec", "kvx-core", "codec", "codec"),
    (
        "rendezvous",
        "kvx-rendezvous",
        "matcher",
        "matcher,expiry,waiter",
    ),
    ("transfer", "kvx-rdma", "transfer", "transfer"),
    ("auth", "kvx-vllm", "auth", "auth"),
    ("gpu", "kvx-rdma", "gpu", "gpu"),
];

/// Runs the named benchmarks (all when `names` is empty, except `vllm`, which runs only when
/// named: it needs the vLLM venv and takes about 35 minutes).
pub(crate) fn run(names: &[String], quick: bool) -> anyhow::Result<()> {
    for name in names {
        if !["pd", "gpu-pd", "vllm"].contains(&name.as_str())
            && !BENCHES.iter().any(|(n, ..)| n == name)
        {
            let known: Vec<&str> = BENCHES.iter().map(|(n, ..)| *n).collect();
            bail!(
                "unknown benchmark `{name}` (known: pd, gpu-pd, vllm, {})",
                known.join(", ")
            );
        }
    }
    // The GPU sweep alone needs no toolchain set-up when given a built `kvx` (KVX_BIN): it runs
    // on GPU machines that have none.
    if names.len() == 1 && names[0] == "gpu-pd" {
        return crate::gpu_pd::run_sweep(quick);
    }
    crate::setup::ensure_packages()?;
    let out_dir = root().join("target/kvx-bench");
    fs::create_dir_all(&out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    for (name, package, target, group) in BENCHES {
        if !names.is_empty() && !names.iter().any(|n| n == name) {
            continue;
        }
        if !root()
            .join(format!("crates/{package}/benches/{target}.rs"))
            .exists()
        {
            println!("\n==> {name}: not built in this checkout, skipped");
            continue;
        }
        step(&format!("benchmark {name} ({package})"));
        let mut cmd = cargo();
        cmd.env("KVX_BENCH_OUT", &out_dir);
        // `gpu` (CUDA IPC, NIXL VRAM, the layout kernels) and `transfer` run with the NIXL
        // backend; each of their NIXL cases names UCX's transports itself (TCP, shared memory,
        // or CUDA IPC within the host), so UCX_TLS is not forced here.
        if *name == "gpu" || *name == "transfer" {
            let nixl_dir = crate::nixl::ensure_nixl_runtime()?;
            let env = crate::nixl::nixl_test_env(&nixl_dir);
            cmd.envs(env.into_iter().filter(|(key, _)| *key != "UCX_TLS"))
                .args([
                    "bench",
                    "-p",
                    package,
                    "--features",
                    "nixl",
                    "--bench",
                    target,
                ]);
        } else {
            cmd.args(["bench", "-p", package, "--bench", target]);
        }
        if *name == "gpu" {
            // Its own harness, which skips (saying why) without a GPU; the device machine runs
            // the same binary.
            crate::run(&mut cmd)?;
            println!("    results: {}", out_dir.join("gpu.json").display());
            continue;
        }
        cmd.arg("--");
        if quick && *name == "transfer" {
            cmd.arg("--quick");
        } else if quick {
            cmd.args(["--warm-up-time", "0.5", "--measurement-time", "1"]);
        }
        crate::run(&mut cmd)?;
        if *name == "transfer" {
            // Its own harness writes transfer.json and transfer.md itself.
            println!("    results: {}", out_dir.join("transfer.json").display());
            continue;
        }
        let summary = collect(
            &root().join("target/criterion"),
            &group.split(',').collect::<Vec<_>>(),
        )?;
        let path = out_dir.join(format!("{name}.json"));
        fs::write(&path, summary).with_context(|| format!("cannot write {}", path.display()))?;
        println!("    results: {}", path.display());
    }
    if names.is_empty() || names.iter().any(|n| n == "pd") {
        crate::pd::run_sweep(quick)?;
    }
    if names.iter().any(|n| n == "gpu-pd") {
        crate::gpu_pd::run_sweep(quick)?;
    }
    if names.iter().any(|n| n == "vllm") {
        vllm_bench::run_sweep(quick)?;
    }
    Ok(())
}

/// Gathers criterion's `new/estimates.json` of every benchmark under `<criterion>/<group>`,
/// for each group.
fn collect(criterion: &Path, groups: &[&str]) -> anyhow::Result<String> {
    let mut rows = Vec::new();
    let mut stack: Vec<_> = groups.iter().map(|g| criterion.join(g)).collect();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n == "new") {
                    let estimates = path.join("estimates.json");
                    if let Ok(text) = fs::read_to_string(&estimates) {
                        let id = dir
                            .strip_prefix(criterion)
                            .unwrap_or(&dir)
                            .display()
                            .to_string();
                        rows.push(format!(
                            "  {{\"id\":\"{id}\",\"estimates\":{}}}",
                            text.trim()
                        ));
                    }
                } else if path
                    .file_name()
                    .is_some_and(|n| n != "base" && n != "report")
                {
                    stack.push(path);
                }
            }
        }
    }
    rows.sort();
    Ok(format!("[\n{}\n]\n", rows.join(",\n")))
}
