//! `cargo xtask bench gpu-pd`: the seed's benchmark on a GPU. The `kvx pd` pair with its KV
//! caches in GPU memory and the GPU engine (cuBLAS products at one rank of Qwen3-32B at TP8),
//! push against pull, side by side at every point of the grid: input lengths × request rates
//! (Poisson, the same arrivals for both modes), fresh processes and a warm-up per point, over
//! each transport (`cuda-ipc`, `nixl`). On one GPU both processes share it; with
//! `KVX_GPU_PD_DEVICES` each has its own.
//!
//! Results go to `target/kvx-bench/` (`KVX_BENCH_OUT`): `gpu-pd.json`, `gpu-pd.md` (the table)
//! and `gpu-pd-<transport>.svg` (TTFT and TPOT against the rate, one panel per input length).
//! Without a CUDA GPU it says so and skips. On a machine without a Rust toolchain (the GPU
//! machines) `KVX_BIN` names a `kvx` built elsewhere and the built `xtask` binary runs it.
//!
//! Knobs: `KVX_PD_LENGTHS`, `KVX_PD_RATES`, `KVX_PD_REQUESTS`, `KVX_GPU_PD_TRANSPORTS`
//! (default `cuda-ipc,nixl`; `nixl` needs `KVX_NIXL_LIB_DIR`), `KVX_GPU_PD_MODEL` (default
//! `qwen3-32b-tp8`), `KVX_GPU_PD_DEVICES` (prefill's and decode's device, default
//! `cuda:0,cuda:0`: one GPU shared; `cuda:0,cuda:1` gives each its own).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use plotters::prelude::*;
use serde_json::{json, Value};

use crate::pd::{get, kvx_json, point, PairArgs};
use crate::{cargo, root, run, step};

/// Tokens generated per request.
const OUTPUT_TOKENS: u64 = 128;
/// Tokens per prefill chunk.
const CHUNK_TOKENS: u64 = 1024;
/// Tokens per block.
const BLOCK_TOKENS: u64 = 16;

/// A comma-separated list from the environment variable `var`, else `default`.
fn list<T>(var: &str, default: &[T]) -> anyhow::Result<Vec<T>>
where
    T: Clone + std::str::FromStr,
    T::Err: std::fmt::Display,
{
    match std::env::var(var) {
        Ok(v) => v
            .split(',')
            .map(|x| {
                x.trim()
                    .parse::<T>()
                    .map_err(|e| anyhow::anyhow!("{var}: {e}"))
            })
            .collect(),
        Err(_) => Ok(default.to_vec()),
    }
}

/// Blocks in decode's cache: room for the requests in flight at `rate` (each holds its blocks
/// from its arrival, through its time to first token, to its last token: budgeted at 2 s and
/// 50 ms per output token), and in prefill's: 16 requests (it computes one at a time and holds a
/// request's blocks until decode has them).
fn cache_blocks(length: u64, rate: f64) -> (u64, u64) {
    let per_request = length.div_ceil(BLOCK_TOKENS) + 1;
    let in_flight = (rate * (2.0 + OUTPUT_TOKENS as f64 * 0.05)).ceil() as u64 + 2;
    (16 * per_request, in_flight * per_request)
}

/// The devices of prefill and decode: `KVX_GPU_PD_DEVICES=PREFILL,DECODE` (e.g.
/// `cuda:0,cuda:1`), else both on `cuda:0`.
fn devices() -> anyhow::Result<(String, String)> {
    let both: Vec<String> = list(
        "KVX_GPU_PD_DEVICES",
        &["cuda:0".to_owned(), "cuda:0".to_owned()],
    )?;
    match both.as_slice() {
        [p, d] => Ok((p.clone(), d.clone())),
        _ => bail!("KVX_GPU_PD_DEVICES must name two devices, PREFILL,DECODE"),
    }
}

fn gpu_pair(model: &str, transport: &str, length: u64, rate: f64) -> anyhow::Result<PairArgs> {
    let (prefill_blocks, decode_blocks) = cache_blocks(length, rate);
    let (prefill_device, decode_device) = devices()?;
    let common = |blocks: u64, device: &str| -> Vec<String> {
        [
            "--model",
            model,
            "--device",
            device,
            "--transport",
            transport,
            "--block-tokens",
            &BLOCK_TOKENS.to_string(),
            "--blocks",
            &blocks.to_string(),
        ]
        .map(str::to_owned)
        .into()
    };
    let mut prefill = common(prefill_blocks, &prefill_device);
    prefill.extend(
        [
            "--chunk-tokens",
            &CHUNK_TOKENS.to_string(),
            "--max-tokens",
            &length.to_string(),
        ]
        .map(str::to_owned),
    );
    let mut decode = common(decode_blocks, &decode_device);
    decode.extend(["--output-tokens", &OUTPUT_TOKENS.to_string()].map(str::to_owned));
    Ok(PairArgs { prefill, decode })
}

/// Runs the sweep.
pub(crate) fn run_sweep(quick: bool) -> anyhow::Result<()> {
    let kvx = if let Ok(bin) = std::env::var("KVX_BIN") {
        PathBuf::from(bin)
    } else {
        crate::setup::ensure_packages()?;
        step("benchmark gpu-pd: building kvx (release)");
        run(cargo().args(["build", "--release", "-p", "kvx-cli"]))?;
        root().join("target/release/kvx")
    };
    let out_dir = std::env::var_os("KVX_BENCH_OUT")
        .map_or_else(|| root().join("target/kvx-bench"), PathBuf::from);
    std::fs::create_dir_all(&out_dir)?;
    let model = std::env::var("KVX_GPU_PD_MODEL").unwrap_or_else(|_| "qwen3-32b-tp8".into());
    let (lengths, rates, requests) = if quick {
        (vec![1024, 16384], vec![1.0, 8.0], 8)
    } else {
        (vec![1024, 4096, 8192, 16384], vec![1.0, 2.0, 4.0, 8.0], 16)
    };
    let lengths: Vec<u64> = list("KVX_PD_LENGTHS", &lengths)?;
    let rates: Vec<f64> = list("KVX_PD_RATES", &rates)?;
    let requests: u32 = list("KVX_PD_REQUESTS", &[requests])?[0];
    step("benchmark gpu-pd: the GPU engine");
    let longest = lengths.iter().copied().max().unwrap_or(1024).to_string();
    let mut engine = Vec::new();
    for tokens in ["1024", longest.as_str()] {
        let args = [
            "pd",
            "engine",
            "--model",
            &model,
            "--device",
            "cuda",
            "--input-tokens",
            tokens,
        ];
        match kvx_json(&kvx, &args) {
            Ok(v) => engine.push(v),
            Err(e) if engine.is_empty() => {
                println!("    gpu-pd: skipped: no usable CUDA GPU here ({e:#})");
                return Ok(());
            }
            Err(e) => return Err(e),
        }
    }
    for e in &engine {
        println!(
            "    {} tokens: prefill {:.1} ms ({:.1} ms per 1k tokens), {:.1} TFLOP at the measured \
             {:.0} TFLOP/s would take {:.1} ms: measured/expected {:.2}",
            e["prefill_tokens"],
            get(e, &["prefill_ms"]),
            get(e, &["prefill_ms_per_1k_tokens"]),
            get(e, &["prefill_tflop"]),
            get(e, &["gemm_bf16_tflops"]),
            get(e, &["prefill_expected_ms_at_gemm_rate"]),
            get(e, &["prefill_measured_over_expected"]),
        );
    }
    let transports: Vec<String> = list(
        "KVX_GPU_PD_TRANSPORTS",
        &["cuda-ipc".to_owned(), "nixl".to_owned()],
    )?;
    let scratch = out_dir.join("gpu-pd-point.json");
    let meta = json!({
        "what": "kvx pd on a GPU: push vs pull, side by side at every point, per transport",
        "model": model,
        "engine": engine,
        "output_tokens": OUTPUT_TOKENS,
        "prefill_chunk_tokens": CHUNK_TOKENS,
        "requests_per_point": requests,
        "devices": devices()?,
    });
    let mut sections = Vec::new();
    let mut table = String::new();
    for transport in &transports {
        if transport.starts_with("nixl") && std::env::var_os("KVX_NIXL_LIB_DIR").is_none() {
            println!("    gpu-pd over {transport}: skipped: no NIXL runtime (KVX_NIXL_LIB_DIR)");
            continue;
        }
        step(&format!("benchmark gpu-pd over {transport}"));
        let mut points = Vec::new();
        writeln!(
            table,
            "\n**{transport}** ({model}, {requests} requests a point, {OUTPUT_TOKENS} output \
             tokens)\n\n| tokens | req/s | TTFT p50 push / pull ms | TTFT p99 push / pull ms | \
             TPOT p50 push / pull ms | TPOT p99 push / pull ms | critical path p50 push / pull \
             ms | bare transfer ms (whole / a layer) | push crit. / a layer |\n|---:|---:|---|---|---|---|---|---|---:|"
        )?;
        for &length in &lengths {
            let (_, raw_blocks) = cache_blocks(length, 1.0);
            let raw = kvx_json(
                &kvx,
                &[
                    "pd",
                    "raw",
                    "--model",
                    &model,
                    "--device",
                    "cuda",
                    "--transport",
                    transport,
                    "--blocks",
                    &(raw_blocks.max(3 * (length / BLOCK_TOKENS + 1))).to_string(),
                    "--input-tokens",
                    &length.to_string(),
                    "--repeats",
                    "10",
                ],
            )?;
            let raw_ms = get(&raw, &["transfer_ms_p50"]);
            let layers = get(&engine[0], &["shape", "layers"]);
            for &rate in &rates {
                let pair = gpu_pair(&model, transport, length, rate)?;
                let run_mode = |mode: &str| {
                    point(&kvx, &pair, mode, length, rate, requests, &scratch)
                        .with_context(|| format!("{transport} {mode} {length} tokens {rate}/s"))
                };
                // A point that fails is reported as such, and the sweep goes on.
                let outcome = |mode: &str| {
                    run_mode(mode).unwrap_or_else(|e| {
                        println!("    {mode} failed: {e:#}");
                        json!({ "summary": { "error": format!("{e:#}") } })
                    })
                };
                let push = outcome("push");
                let pull = outcome("pull");
                let s = |v: &Value, k: &str, q: &str| get(v, &["summary", k, q]);
                let crit = s(&push, "critical_path_ms", "p50");
                let row = format!(
                    "| {length} | {rate} | {:.0} / {:.0} | {:.0} / {:.0} | {:.2} / {:.2} | {:.2} / \
                     {:.2} | {:.2} / {:.2} | {raw_ms:.2} / {:.3} | {:.2} |",
                    s(&push, "ttft_ms", "p50"),
                    s(&pull, "ttft_ms", "p50"),
                    s(&push, "ttft_ms", "p99"),
                    s(&pull, "ttft_ms", "p99"),
                    s(&push, "tpot_ms", "p50"),
                    s(&pull, "tpot_ms", "p50"),
                    s(&push, "tpot_ms", "p99"),
                    s(&pull, "tpot_ms", "p99"),
                    crit,
                    s(&pull, "critical_path_ms", "p50"),
                    raw_ms / layers,
                    crit / (raw_ms / layers),
                );
                println!("{row}");
                table.push_str(&row);
                table.push('\n');
                // Written as it grows: a sweep cut short keeps its finished points.
                std::fs::write(out_dir.join("gpu-pd.md"), &table)?;
                let mut so_far = sections.clone();
                so_far.push(json!({ "transport": transport, "points": points }));
                write_report(&out_dir, &meta, &so_far)?;
                points.push(json!({
                    "input_tokens": length,
                    "rate": rate,
                    "raw_transfer": raw,
                    "push": push["summary"],
                    "pull": pull["summary"],
                }));
            }
        }
        let section = json!({ "transport": transport, "points": points });
        let name = transport.replace([':', ';', '@'], "-");
        plot_panels(
            &section,
            &out_dir.join(format!("gpu-pd-{name}.svg")),
            transport,
        )?;
        sections.push(section);
    }
    let _ = std::fs::remove_file(&scratch);
    write_report(&out_dir, &meta, &sections)?;
    std::fs::write(out_dir.join("gpu-pd.md"), &table)?;
    println!(
        "    results: {} (and gpu-pd.md, gpu-pd-<transport>.svg beside it)",
        out_dir.join("gpu-pd.json").display()
    );
    Ok(())
}

/// Writes `gpu-pd.json`: `meta` with the transports' sections.
fn write_report(out_dir: &Path, meta: &Value, sections: &[Value]) -> anyhow::Result<()> {
    let mut report = meta.clone();
    report["transports"] = json!(sections);
    std::fs::write(
        out_dir.join("gpu-pd.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    Ok(())
}

/// TTFT and TPOT (p50) against the rate, one column of panels per input length; push solid,
/// pull dashed.
fn plot_panels(section: &Value, path: &Path, transport: &str) -> anyhow::Result<()> {
    let points = section["points"].as_array().cloned().unwrap_or_default();
    let mut lengths: Vec<u64> = points
        .iter()
        .filter_map(|p| p["input_tokens"].as_u64())
        .collect();
    lengths.dedup();
    if lengths.is_empty() {
        return Ok(());
    }
    let width = 360 * lengths.len() as u32;
    let area = SVGBackend::new(path, (width.max(720), 720)).into_drawing_area();
    area.fill(&WHITE)?;
    let area = area.titled(
        &format!("kvx push vs pull on a GPU, {transport}: p50 against the request rate"),
        ("sans-serif", 20),
    )?;
    let panels = area.split_evenly((2, lengths.len()));
    for (row, (metric, label)) in [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)")]
        .into_iter()
        .enumerate()
    {
        for (col, length) in lengths.iter().enumerate() {
            let mine: Vec<&Value> = points
                .iter()
                .filter(|p| p["input_tokens"].as_u64() == Some(*length))
                .collect();
            let max_rate = mine
                .iter()
                .filter_map(|p| p["rate"].as_f64())
                .fold(1.0, f64::max);
            let max_y = mine
                .iter()
                .flat_map(|p| ["push", "pull"].map(|m| get(p, &[m, metric, "p50"])))
                .filter(|v| v.is_finite())
                .fold(1.0, f64::max)
                * 1.15;
            let mut chart = ChartBuilder::on(&panels[row * lengths.len() + col])
                .caption(format!("{length} tokens"), ("sans-serif", 16))
                .margin(10)
                .x_label_area_size(35)
                .y_label_area_size(55)
                .build_cartesian_2d(0.0..max_rate * 1.05, 0.0..max_y)?;
            chart
                .configure_mesh()
                .x_desc("requests/s")
                .y_desc(label)
                .draw()?;
            for (i, mode) in ["push", "pull"].into_iter().enumerate() {
                let color = crate::plot::PALETTE[i];
                let series: Vec<(f64, f64)> = mine
                    .iter()
                    .map(|p| {
                        (
                            p["rate"].as_f64().unwrap_or(0.0),
                            get(p, &[mode, metric, "p50"]),
                        )
                    })
                    .filter(|(_, y)| y.is_finite())
                    .collect();
                let style = if i == 1 {
                    color.mix(0.6).stroke_width(2)
                } else {
                    color.stroke_width(3)
                };
                crate::plot::line_with_dots(&mut chart, series, color, style, mode.to_owned())?;
            }
            crate::plot::legend(&mut chart)?;
        }
    }
    area.present()?;
    Ok(())
}
