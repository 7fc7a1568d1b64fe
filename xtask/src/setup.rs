//! System packages: checked with dpkg, installed with apt-get where missing.

use std::process::Command;

use anyhow::{bail, Context as _};

use crate::{run, step};

/// Debian packages the build needs: libfabric (headers and library) for the libfabric backend,
/// libclang for bindgen, pkg-config to find libfabric, a C/C++ compiler for the shim and the
/// fuzzers' runtime, and iproute2 (`ip`) for the tests that put two "hosts" in two network
/// namespaces.
pub(crate) const PACKAGES: &[&str] = &[
    "libfabric-dev",
    "libclang-dev",
    "pkg-config",
    "build-essential",
    "iproute2",
];

/// Whether this process runs as root (and so may create network namespaces).
pub(crate) fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("install ok installed"))
}

/// Installs whatever of [`PACKAGES`] is missing.
pub(crate) fn ensure_packages() -> anyhow::Result<()> {
    step("system packages");
    let missing: Vec<&str> = PACKAGES.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        println!("    all present: {}", PACKAGES.join(", "));
        return Ok(());
    }
    if Command::new("apt-get").arg("--version").output().is_err() {
        bail!(
            "missing packages {} and no apt-get here: install them with your package manager",
            missing.join(" ")
        );
    }
    println!("    installing missing packages: {}", missing.join(", "));
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let apt = |args: &[&str]| {
        let mut cmd = if is_root {
            Command::new("apt-get")
        } else {
            let mut c = Command::new("sudo");
            c.arg("apt-get");
            c
        };
        cmd.env("DEBIAN_FRONTEND", "noninteractive").args(args);
        cmd
    };
    run(&mut apt(&["update", "-q"])).context("apt-get update failed")?;
    let mut install = apt(&["install", "-y", "-q", "--no-install-recommends"]);
    install.args(&missing);
    run(&mut install).context("apt-get install failed")?;
    Ok(())
}
