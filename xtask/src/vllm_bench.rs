//! `cargo xtask bench vllm`: kvx push and pull against vLLM's own `NixlConnector` (pull) and
//! `NixlPushConnector`, on real vLLM (CPU) in the same run, through a router.
//!
//! What it does, in order:
//!
//! 1. the venv with vLLM (`python/setup_env.sh`, cached in `.kvx-cache/venv`);
//! 2. vLLM's NIXL connectors need the Python `nixl` package: when the venv lacks it, installs the
//!    `nixl` meta package and the `nixl-cu12` wheel (version [`NIXL_VERSION`], the runtime the
//!    Rust tests use, cached in `.kvx-cache/nixl/`) into the venv with `pip install --no-deps`.
//!    The meta package picks `nixl_cu13` because the venv's torch reports CUDA 13; the harness
//!    points it at `nixl_cu12` at run time (`python/kvx_bench/nixl_site/sitecustomize.py`);
//! 3. the `kvx` binary (`cargo build --release -p kvx-cli`, for `kvx proxy`) and `kvx_vllm` into the venv
//!    (`maturin develop --release`, as `cargo xtask test` does);
//! 4. the sweep, `python -m kvx_bench.vllm_sweep` with the venv's Python (the method is in its
//!    docstring and in docs/benchmarks.md): `target/kvx-bench/vllm.json` and `vllm.md`, logs in
//!    `target/kvx-bench/vllm-logs/`;
//! 5. plots from `vllm.json`: `vllm-ttft-<input tokens>.svg` (TTFT p50 and p99 against the
//!    request rate, one line per system, log scale) and `vllm-tpot-<input tokens>.svg`.
//!
//! `KVX_BENCH_VLLM_ARGS` (whitespace-separated) is passed on to the harness, e.g.
//! `--systems kvx-push,nixl-push-corrected --rates 1,2`.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context as _};
use plotters::prelude::*;
use serde_json::Value;

use crate::{cargo, root, run, step};

/// The NIXL release installed into the venv: the one `xtask/src/nixl.rs` caches for the Rust
/// tests (its wheel is reused).
const NIXL_VERSION: &str = "1.5.1";

/// Installs `nixl` and `nixl-cu12` into the venv unless they are there at [`NIXL_VERSION`].
fn ensure_nixl_in_venv(python: &Path) -> anyhow::Result<()> {
    let probe = Command::new(python)
        .args([
            "-c",
            "import importlib.metadata as m; print(m.version('nixl'), m.version('nixl-cu12'))",
        ])
        .output()
        .context("cannot run the venv's python")?;
    let want = format!("{NIXL_VERSION} {NIXL_VERSION}");
    if probe.status.success() && String::from_utf8_lossy(&probe.stdout).trim() == want {
        println!("    nixl and nixl-cu12 {NIXL_VERSION} already in the venv");
        return Ok(());
    }
    crate::nixl::ensure_nixl_runtime()?;
    let wheels = root()
        .join(".kvx-cache/nixl")
        .join(NIXL_VERSION)
        .join("wheel");
    let wheel = std::fs::read_dir(&wheels)
        .with_context(|| format!("cannot read {}", wheels.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .with_context(|| format!("no nixl-cu12 wheel in {}", wheels.display()))?;
    step(&format!(
        "installing nixl=={NIXL_VERSION} (meta package, from PyPI) and {} into the venv \
         (pip --no-deps), for vLLM's NIXL connectors",
        wheel.file_name().unwrap_or_default().to_string_lossy()
    ));
    run(Command::new(python)
        .args([
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--disable-pip-version-check",
            "--quiet",
        ])
        .arg(format!("nixl=={NIXL_VERSION}"))
        .arg(&wheel))
}

/// Runs the sweep and draws its plots.
pub(crate) fn run_sweep(quick: bool) -> anyhow::Result<()> {
    let venv = crate::vllm::ensure_vllm_env(None)?;
    let python = venv.join("bin").join("python");
    ensure_nixl_in_venv(&python)?;
    step("benchmark vllm: kvx binary for the proxy (release: it is on every request's path)");
    run(cargo().args(["build", "--release", "-p", "kvx-cli"]))?;
    step("benchmark vllm: kvx_vllm into the venv (maturin develop --release)");
    run(Command::new(venv.join("bin").join("maturin"))
        .args(["develop", "--release", "--quiet"])
        .env("VIRTUAL_ENV", &venv)
        .env("PYO3_PYTHON", &python))?;
    let out_dir = root().join("target/kvx-bench");
    std::fs::create_dir_all(&out_dir)?;
    step(&format!(
        "benchmark vllm: kvx push/pull vs vLLM NixlConnector/NixlPushConnector{} \
         (several minutes; progress below, logs in {})",
        if quick { " (quick)" } else { "" },
        out_dir.join("vllm-logs").display()
    ));
    let mut cmd = Command::new(&python);
    cmd.args(["-m", "kvx_bench.vllm_sweep", "--kvx-bin"])
        .arg(root().join("target/release/kvx"))
        .arg("--out")
        .arg(&out_dir)
        .env("PYTHONPATH", root().join("python"))
        .env("PYTHONUNBUFFERED", "1");
    if quick {
        cmd.arg("--quick");
    }
    if let Ok(extra) = std::env::var("KVX_BENCH_VLLM_ARGS") {
        cmd.args(extra.split_whitespace());
    }
    run(&mut cmd)?;
    let json_path = out_dir.join("vllm.json");
    let text = std::fs::read_to_string(&json_path)
        .with_context(|| format!("no results in {}", json_path.display()))?;
    let report: Value = serde_json::from_str(&text)?;
    let lengths: Vec<u64> = report["lengths"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    if lengths.is_empty() {
        bail!("{} lists no input lengths", json_path.display());
    }
    let mut written = Vec::new();
    for length in lengths {
        let ttft = out_dir.join(format!("vllm-ttft-{length}.svg"));
        plot(&report, &ttft, length, "ttft_ms", "TTFT")?;
        let tpot = out_dir.join(format!("vllm-tpot-{length}.svg"));
        plot(&report, &tpot, length, "tpot_ms", "TPOT")?;
        written.push(ttft);
        written.push(tpot);
    }
    println!(
        "    results: {}, {}, {}",
        json_path.display(),
        out_dir.join("vllm.md").display(),
        written
            .iter()
            .filter_map(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// One (rate, value) series per system for `metric`/`quantile` at `length`.
fn series(
    report: &Value,
    length: u64,
    metric: &str,
    quantile: &str,
) -> Vec<(String, Vec<(f64, f64)>)> {
    let systems = report["systems"].as_array().cloned().unwrap_or_default();
    systems
        .iter()
        .map(|s| {
            let name = s["system"].as_str().unwrap_or("?").to_owned();
            let points = s["points"]
                .as_array()
                .map(|ps| {
                    ps.iter()
                        .filter(|p| p["input_tokens"].as_u64() == Some(length))
                        .filter_map(|p| Some((p["rate"].as_f64()?, p[metric][quantile].as_f64()?)))
                        .filter(|(_, y)| *y > 0.0)
                        .collect()
                })
                .unwrap_or_default();
            (name, points)
        })
        .collect()
}

/// A two-panel plot (p50 left, p99 right) of `metric` against the request rate, one line per
/// system, log-scaled y.
fn plot(report: &Value, path: &Path, length: u64, metric: &str, label: &str) -> anyhow::Result<()> {
    let rates: Vec<f64> = report["rates"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default();
    let max_rate = rates.iter().copied().fold(1.0, f64::max);
    let all: Vec<f64> = ["p50", "p99"]
        .iter()
        .flat_map(|q| series(report, length, metric, q))
        .flat_map(|(_, pts)| pts.into_iter().map(|(_, y)| y))
        .collect();
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = all.iter().copied().fold(0.0, f64::max);
    let (lo, hi) = if all.is_empty() {
        (1.0, 10.0)
    } else {
        (lo * 0.8, hi * 1.25)
    };
    let area = SVGBackend::new(path, (1200, 560)).into_drawing_area();
    area.fill(&WHITE)?;
    let panels = area.split_evenly((1, 2));
    let palette = crate::plot::PALETTE;
    for (panel, quantile) in panels.iter().zip(["p50", "p99"]) {
        let mut chart = ChartBuilder::on(panel)
            .caption(
                format!("{label} {quantile}, {length}-token prompts"),
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..max_rate * 1.1, (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("request rate (requests/s)")
            .y_desc(format!("{label} {quantile} (ms, log scale)"))
            .draw()?;
        for (i, (name, pts)) in series(report, length, metric, quantile)
            .into_iter()
            .enumerate()
        {
            let color = palette[i % palette.len()];
            let style = if name.ends_with("shipped") {
                color.mix(0.45).stroke_width(2)
            } else {
                color.stroke_width(3)
            };
            crate::plot::line_with_dots(&mut chart, pts, color, style, name.to_string())?;
        }
        crate::plot::legend(&mut chart)?;
    }
    area.present()?;
    Ok(())
}
