//! `cargo xtask wheel`: the Python package `kvx-vllm` as a manylinux wheel under
//! `target/wheels/`, built by maturin (from a small tools venv, `.kvx-cache/tools/`, made on
//! first use) with the features `pyproject.toml` names. The wheel holds the native module and
//! the Python glue; it links neither libfabric nor NIXL (both are opened at run time), so it
//! installs with `pip install` where no Rust toolchain is.
//!
//! [`test_release`] is how `cargo xtask test` and `cargo xtask vllm-versions` check it: the wheel
//! installed with pip into the venv of a vLLM release (which holds vLLM and its requirements,
//! never the checkout's package), and end-to-end tests run against the installed package.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};

/// maturin's versions that build the project (as in `pyproject.toml`'s build system).
const MATURIN: &str = "maturin>=1.5,<2";

/// Builds the wheel and returns its path.
///
/// # Errors
/// When Python cannot make the tools venv, pip cannot install maturin, or the build fails.
pub(crate) fn build() -> anyhow::Result<PathBuf> {
    let maturin = ensure_maturin()?;
    let out = crate::root().join("target").join("wheels");
    // Only this build's wheel is left there, so that what is installed is what was built.
    if let Ok(entries) = std::fs::read_dir(&out) {
        for entry in entries.flatten() {
            if is_kvx_wheel(&entry.path()) {
                std::fs::remove_file(entry.path())
                    .with_context(|| format!("cannot remove {}", entry.path().display()))?;
            }
        }
    }
    crate::step("kvx-vllm wheel (maturin build --release, features from pyproject.toml)");
    crate::run(
        Command::new(maturin)
            .args(["build", "--release", "--out"])
            .arg(&out),
    )?;
    let wheel = std::fs::read_dir(&out)
        .with_context(|| format!("cannot read {}", out.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| is_kvx_wheel(p))
        .with_context(|| format!("maturin left no kvx_vllm wheel in {}", out.display()))?;
    println!("    wheel: {}", wheel.display());
    Ok(wheel)
}

fn is_kvx_wheel(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("kvx_vllm-") && n.ends_with(".whl"))
}

/// maturin in `.kvx-cache/tools/` (a venv made, and maturin installed into it, on first use).
fn ensure_maturin() -> anyhow::Result<PathBuf> {
    let tools = crate::root().join(".kvx-cache").join("tools");
    let maturin = tools.join("bin").join("maturin");
    if maturin.is_file() {
        return Ok(maturin);
    }
    crate::step(&format!(
        "tools venv with maturin ({}; first use)",
        tools.display()
    ));
    crate::run(Command::new("python3").args(["-m", "venv"]).arg(&tools))
        .context("making the tools venv needs Python 3 with venv (Debian: python3-venv)")?;
    crate::run(pip_install(&tools.join("bin").join("python")).arg(MATURIN))?;
    if !maturin.is_file() {
        bail!("pip installed no maturin at {}", maturin.display());
    }
    Ok(maturin)
}

/// Installs `wheel` with pip into the venv of `python` (replacing any kvx-vllm there, without
/// touching its other packages).
///
/// # Errors
/// When pip fails.
pub(crate) fn install(wheel: &Path, python: &Path) -> anyhow::Result<()> {
    crate::step(&format!(
        "pip install {} (with {})",
        wheel.display(),
        python.display()
    ));
    crate::run(
        pip_install(python)
            .args(["--no-deps", "--force-reinstall"])
            .arg(wheel),
    )
}

/// `pip install` with `python`, quiet and without pip's cache (the wheels would stay on disk
/// twice).
fn pip_install(python: &Path) -> Command {
    let mut pip = Command::new(python);
    pip.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-cache-dir",
    ]);
    pip
}

/// Runs the end-to-end tests `tests` (a pytest `-k` expression) on vLLM `version` with the
/// package installed from `wheel`: in the venv of that release (`python/setup_env.sh`, cached),
/// which never holds the checkout's package, with `KVX_REQUIRE_INSTALLED=1` (the tests then fail
/// unless `kvx_vllm` and its native module come from that venv's site-packages), with `env` as
/// for the other Python tests.
///
/// # Errors
/// When the venv cannot be made, or the install or a test fails.
pub(crate) fn test_release(
    wheel: &Path,
    version: &str,
    tests: &str,
    env: &[(&str, std::ffi::OsString)],
) -> anyhow::Result<()> {
    let venv = crate::vllm::ensure_vllm_env(Some(version))?;
    let python = venv.join("bin").join("python");
    install(wheel, &python)?;
    crate::step(&format!(
        "end-to-end on vLLM {version}, against the installed wheel (not the checkout): {tests}"
    ));
    crate::vllm::pytest(
        &python,
        &["python/tests/test_e2e_vllm.py", "-k", tests],
        env,
        &[("KVX_REQUIRE_INSTALLED", "1")],
    )
}
