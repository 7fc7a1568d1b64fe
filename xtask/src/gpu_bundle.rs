//! `cargo xtask gpu-bundle`: what a GPU machine without Rust, Python or NIXL needs to run the GPU
//! tests and `bench gpu`, in one folder (`.gpu/` at the repository root, which git ignores):
//! the test and benchmark binaries built here (stripped), and the part of the `nixl-cu12`
//! runtime they load (`libnixl_capi.so`, the UCX plugin, UCX's `cma` and `cuda` modules, and
//! every library of the wheel that those need, found with `readelf -d`) as `nixl.tar.xz`.
//! Beside them, the Python glue's GPU test (`python/tests/test_gpu.py`) with the package's Python
//! files and a native module built without libfabric (`python/`), which `run.sh` runs under the
//! GPU machine's own Python and PyTorch where it has them. `.gpu/run.sh` unpacks the runtime and
//! runs them all; `.gpu/README` says how.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};

use crate::{cargo, root, run, step};

/// The binaries: (name in the bundle, cargo arguments that build it).
const BINARIES: &[(&str, &[&str])] = &[
    (
        "bench_gpu",
        &[
            "bench",
            "-p",
            "kvx-rdma",
            "--features",
            "nixl",
            "--bench",
            "gpu",
        ],
    ),
    (
        "gpu_cuda",
        &["test", "-p", "kvx-rdma", "--test", "gpu_cuda"],
    ),
    (
        "gpu_nixl",
        &[
            "test",
            "-p",
            "kvx-rdma",
            "--features",
            "nixl",
            "--test",
            "gpu_nixl",
        ],
    ),
    (
        "gpu_connector",
        &[
            "test",
            "-p",
            "kvx-vllm",
            "--features",
            "nixl",
            "--test",
            "gpu_connector",
        ],
    ),
];

/// What the bundle's script runs on the GPU machine.
const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs kvx's GPU tests and `bench gpu` from this bundle (see README); arguments go to bench_gpu's
# environment as KVX_GPU_BENCH_ONLY (default: every part).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
runtime="$(mktemp -d)"
tar xJf "$here/nixl.tar.xz" -C "$runtime"
export KVX_NIXL_LIB_DIR="$runtime/nixl/.nixl_cu12.mesonpy.libs" KVX_REQUIRE_GPU=1
status=0
for t in gpu_cuda gpu_nixl gpu_connector; do
    echo "==> $t"
    "$here/$t" --test-threads=1 || status=1
done
echo "==> test_gpu.py (the Python glue with CUDA tensors)"
if python3 -c 'import torch, pytest' 2>/dev/null; then
    (cd "$here/python" && PYTHONPATH="$here/python" python3 -m pytest -q -p no:cacheprovider \
        tests/test_gpu.py) || status=1
else
    echo "SKIPPED (test_gpu.py): no python3 with torch and pytest on this machine"
fi
echo "==> bench gpu"
KVX_GPU_BENCH_ONLY="${1:-}" KVX_BENCH_OUT="${OUT:-$here}" "$here/bench_gpu" || status=1
exit $status
"#;

const README: &str =
    "kvx GPU bundle (cargo xtask gpu-bundle): `./run.sh [writes,plan,read,kernels]` \
runs the GPU tests and bench gpu on a machine with an NVIDIA GPU and its driver; nothing else \
is needed (test_gpu.py, the Python glue's, runs where python3 has torch and pytest). Results of the benchmark go to $OUT (or here) as gpu.json.\n";

/// Builds the bundle; returns its folder.
pub(crate) fn build() -> anyhow::Result<PathBuf> {
    let out = root().join(".gpu");
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    for (name, args) in BINARIES {
        step(&format!("building {name}"));
        let path = build_binary(args)?;
        let target = out.join(name);
        std::fs::copy(&path, &target)
            .with_context(|| format!("cannot copy {} to {}", path.display(), target.display()))?;
        run(Command::new("strip").arg(&target))?;
    }
    step("building the native Python module without libfabric (cuda, cma, nixl)");
    bundle_python(&out)?;
    step("packing the NIXL runtime's part that the GPU tests load");
    let runtime = crate::nixl::ensure_nixl_runtime()?;
    pack_runtime(&runtime, &out.join("nixl.tar.xz"))?;
    let script = out.join("run.sh");
    std::fs::write(&script, RUN_SH)?;
    run(Command::new("chmod").arg("+x").arg(&script))?;
    std::fs::write(out.join("README"), README)?;
    println!(
        "    bundle in {} (carry it to the GPU machine and run ./run.sh there)",
        out.display()
    );
    Ok(out)
}

/// The Python package's files, its native module (built here with the GPU machine's transports:
/// no libfabric) and the GPU test with its helpers, under `out/python`.
fn bundle_python(out: &Path) -> anyhow::Result<()> {
    let features = "python,pyo3/extension-module,cuda,cma,nixl";
    let args = [
        "build",
        "--release",
        "-p",
        "kvx-vllm",
        "--lib",
        "--no-default-features",
        "--features",
        features,
    ];
    let library = built(&args, "kvx_vllm")?
        .into_iter()
        .filter_map(|m| m["filenames"].as_array().cloned())
        .flatten()
        .filter_map(|f| f.as_str().map(PathBuf::from))
        .find(|f| f.extension().is_some_and(|e| e == "so"))
        .context("cargo built no kvx_vllm shared library")?;
    let python = out.join("python");
    let _ = std::fs::remove_dir_all(&python);
    let (package, tests) = (python.join("kvx_vllm"), python.join("tests"));
    std::fs::create_dir_all(&package)?;
    std::fs::create_dir_all(&tests)?;
    let source = root().join("python");
    for entry in std::fs::read_dir(source.join("kvx_vllm"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "py") {
            std::fs::copy(
                &path,
                package.join(path.file_name().context("a file name")?),
            )?;
        }
    }
    for test in ["test_gpu.py", "kv_helpers.py"] {
        std::fs::copy(source.join("tests").join(test), tests.join(test))?;
    }
    let native = package.join("_native.abi3.so");
    std::fs::copy(&library, &native)
        .with_context(|| format!("cannot copy {}", library.display()))?;
    run(Command::new("strip").arg(&native))
}

/// Builds one test or benchmark binary (`--no-run`) and returns its path.
fn build_binary(args: &[&str]) -> anyhow::Result<PathBuf> {
    let target = args.last().copied().unwrap_or_default();
    let args: Vec<&str> = args.iter().copied().chain(["--no-run"]).collect();
    built(&args, target)?
        .into_iter()
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .with_context(|| format!("cargo {} built no executable", args.join(" ")))
}

/// Runs cargo with `args` and returns its messages (JSON) about the target named `target`.
fn built(args: &[&str], target: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    let output = cargo()
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .output()
        .with_context(|| format!("cannot run cargo {}", args.join(" ")))?;
    if !output.status.success() {
        bail!(
            "cargo {} failed:\n{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["target"]["name"] == target)
        .collect())
}

/// `dir` holds the unpacked wheel's `.nixl_cu12.mesonpy.libs` (NIXL) beside `nixl_cu12.libs`
/// (UCX and the rest): packs the closure of the C API, the UCX plugin and UCX's modules for CMA
/// and CUDA, with the wheel's folder layout (the libraries' `RPATH`s depend on it).
fn pack_runtime(capi_dir: &Path, archive: &Path) -> anyhow::Result<()> {
    let unpacked = capi_dir
        .parent()
        .context("the NIXL runtime has no parent folder")?
        .to_path_buf();
    let folders = [
        capi_dir.to_path_buf(),
        capi_dir.join("plugins"),
        unpacked.join("nixl_cu12.libs"),
        unpacked.join("nixl_cu12.libs/ucx"),
    ];
    // Every library of the wheel by file name (the first folder that has it).
    let mut by_name: BTreeMap<String, PathBuf> = BTreeMap::new();
    for folder in &folders {
        for entry in std::fs::read_dir(folder)
            .with_context(|| format!("cannot read {}", folder.display()))?
        {
            let path = entry?.path();
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            if path.is_file() && name.contains(".so") {
                by_name.entry(name).or_insert(path);
            }
        }
    }
    let mut todo: Vec<PathBuf> = vec![
        capi_dir.join("libnixl_capi.so"),
        capi_dir.join("plugins/libplugin_UCX.so"),
    ];
    todo.extend(by_name.iter().filter_map(|(name, path)| {
        let module = ["libuct_cma.so", "libuct_cuda.so", "libucm_cuda.so"]
            .iter()
            .any(|m| name.starts_with(m));
        (module && path.starts_with(&folders[3])).then(|| path.clone())
    }));
    let mut seen = BTreeSet::new();
    while let Some(path) = todo.pop() {
        if !seen.insert(path.clone()) {
            continue;
        }
        let out = Command::new("readelf")
            .arg("-d")
            .arg(&path)
            .output()
            .context("cannot run readelf (binutils)")?;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let needed = line
                .split_once("Shared library: [")
                .and_then(|(_, rest)| rest.strip_suffix(']'));
            if let Some(path) = needed.and_then(|n| by_name.get(n)) {
                todo.push(path.clone());
            }
        }
    }
    let staging = archive.with_extension("staging");
    let _ = std::fs::remove_dir_all(&staging);
    for path in &seen {
        let relative = path.strip_prefix(&unpacked)?;
        let target = staging.join("nixl").join(relative);
        std::fs::create_dir_all(target.parent().context("a file has a folder")?)?;
        std::fs::copy(path, &target).with_context(|| format!("cannot copy {}", path.display()))?;
    }
    run(Command::new("tar")
        .arg("cJf")
        .arg(archive)
        .arg("-C")
        .arg(&staging)
        .arg("nixl"))?;
    std::fs::remove_dir_all(&staging)?;
    println!(
        "    {} libraries packed into {}",
        seen.len(),
        archive.display()
    );
    Ok(())
}
