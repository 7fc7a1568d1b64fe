//! `cargo xtask bench pd`: push against pull through the `kvx pd` pair, side by side in one run.
//!
//! For every transport (`KVX_PD_TRANSPORTS`, default `cma,libfabric:shm`), input length and
//! request rate, a prefill and a decode process run a Poisson request stream, once in push mode
//! and once in pull mode. Results (TTFT, the post-prefill critical path and its ratio to the bare
//! transfer time of the request's bytes on that transport — `kvx pd raw`, between cold blocks and
//! with the source just written (`--fresh-source`, as the synthetic prefill leaves it) — TPOT, and
//! the decode
//! engine loop's time on transfer work per step) go to `target/kvx-bench/pd.json`, with plots
//! shaped like the seed's figures (TTFT and TPOT against the request rate, one line per mode and
//! input length) in `pd-<transport>-ttft.svg` and `pd-<transport>-tpot.svg`.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use plotters::prelude::*;
use serde_json::{json, Value};

use crate::{cargo, root, run, step};

/// Chunked prefill in the synthetic engine: tokens per step (each chunk is pushed while the next
/// one computes).
const CHUNK_TOKENS: &str = "1024";
/// Warm-up requests per point, one at a time, before the timed stream (`kvx pd decode --warmup`).
const WARMUP_REQUESTS: &str = "2";

/// The sweep: prompt lengths, request rates, requests per point.
struct Sweep {
    lengths: Vec<u64>,
    rates: Vec<f64>,
    requests: u32,
}

pub(crate) fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

pub(crate) struct Guard(pub(crate) Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What one side of a point runs with besides the stream's flags: the model, cache and transport
/// flags of each process.
pub(crate) struct PairArgs {
    pub(crate) prefill: Vec<String>,
    pub(crate) decode: Vec<String>,
}

/// The pair's arguments for the CPU sweep's `length`-token point over `transport`.
fn cpu_pair(transport: &str, length: u64) -> PairArgs {
    let model: Vec<String> = [
        "--model",
        "qwen2.5-0.5b",
        "--blocks",
        &blocks_for(length).to_string(),
        "--transport",
        transport,
    ]
    .map(str::to_owned)
    .into();
    let mut prefill = model.clone();
    prefill.extend(["--per-token-us", "10", "--chunk-tokens", CHUNK_TOKENS].map(str::to_owned));
    let mut decode = model;
    decode.extend(["--output-tokens", "32", "--step-ms", "5"].map(str::to_owned));
    PairArgs { prefill, decode }
}

/// Runs one point: a fresh prefill and decode, `requests` Poisson arrivals at `rate` of
/// `length`-token prompts after a warm-up, in `mode`; returns decode's report.
#[allow(clippy::too_many_arguments)]
pub(crate) fn point(
    kvx: &Path,
    pair: &PairArgs,
    mode: &str,
    length: u64,
    rate: f64,
    requests: u32,
    out: &Path,
) -> anyhow::Result<Value> {
    let control = free_port()?;
    let side = free_port()?;
    let prefill = Command::new(kvx)
        .args(["pd", "prefill"])
        .args(&pair.prefill)
        .args([
            "--listen",
            &control.to_string(),
            "--bench-listen",
            &side.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start kvx pd prefill")?;
    let mut prefill = Guard(prefill);
    let status = Command::new(kvx)
        .args(["pd", "decode"])
        .args(&pair.decode)
        .args([
            "--prefill",
            &control.to_string(),
            "--prefill-bench",
            &side.to_string(),
        ])
        .args([
            "--mode",
            mode,
            "--rate",
            &rate.to_string(),
            "--requests",
            &requests.to_string(),
            // Each point starts fresh processes: the first requests pay for the connections
            // and the first contact, which the timed stream leaves out.
            "--warmup",
            WARMUP_REQUESTS,
        ])
        .args(["--input-tokens", &length.to_string()])
        .arg("--out")
        .arg(out)
        .stdout(Stdio::null())
        .output()
        .context("cannot run kvx pd decode")?;
    if !status.status.success() {
        bail!(
            "kvx pd decode failed ({mode}, {length} tokens, {rate}/s): {}",
            String::from_utf8_lossy(&status.stderr)
        );
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while prefill.0.try_wait()?.is_none() {
        if Instant::now() > deadline {
            bail!("kvx pd prefill did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let text =
        std::fs::read_to_string(out).with_context(|| format!("no results in {}", out.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// Blocks of 16 tokens in each process's cache: room for 8 requests of `length` tokens at once
/// (at least 8,192 blocks, 1.5 GiB of Qwen2.5-0.5B KV), so that admission waits for free
/// blocks only under overload.
fn blocks_for(length: u64) -> u64 {
    (length.div_ceil(16) * 8).max(8192)
}

/// Runs `kvx ARGS` and returns the JSON of its last line of output; a failure names the
/// command and the error with its causes (no backtrace).
pub(crate) fn kvx_json(kvx: &Path, args: &[&str]) -> anyhow::Result<Value> {
    let out = Command::new(kvx)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {}", kvx.display()))?;
    if !out.status.success() {
        // The error and its causes, without a backtrace.
        let stderr = String::from_utf8_lossy(&out.stderr);
        let why: Vec<&str> = stderr
            .lines()
            .take_while(|l| !l.starts_with("Stack backtrace"))
            .map(str::trim)
            .filter(|l| !l.is_empty() && *l != "Caused by:")
            .collect();
        bail!("kvx {}: {}", args.join(" "), why.join(": "));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("kvx {}: not JSON: {text}", args[1]))
}

pub(crate) fn get(v: &Value, path: &[&str]) -> f64 {
    path.iter()
        .fold(v, |v, k| &v[*k])
        .as_f64()
        .unwrap_or(f64::NAN)
}

/// Runs the sweep.
pub(crate) fn run_sweep(quick: bool) -> anyhow::Result<()> {
    let sweep = if quick {
        Sweep {
            lengths: vec![1024, 4096],
            rates: vec![1.0, 4.0],
            requests: 8,
        }
    } else {
        Sweep {
            lengths: vec![1024, 4096, 8192, 16384],
            rates: vec![1.0, 2.0, 4.0, 8.0],
            requests: 24,
        }
    };
    let mut sweep = sweep;
    if let Ok(lengths) = std::env::var("KVX_PD_LENGTHS") {
        sweep.lengths = lengths
            .split(',')
            .map(|l| l.trim().parse::<u64>())
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("KVX_PD_LENGTHS must list token counts: {e}"))?;
        anyhow::ensure!(!sweep.lengths.is_empty(), "KVX_PD_LENGTHS is empty");
    }
    step("benchmark pd: building kvx (release)");
    run(cargo().args(["build", "--release", "-p", "kvx-cli"]))?;
    let kvx = root().join("target/release/kvx");
    let out_dir = root().join("target/kvx-bench");
    std::fs::create_dir_all(&out_dir)?;
    let transports: Vec<String> = std::env::var("KVX_PD_TRANSPORTS")
        .unwrap_or_else(|_| "cma,libfabric:shm".into())
        .split(',')
        .map(str::to_owned)
        .collect();
    let scratch = out_dir.join("pd-point.json");
    let mut sections = Vec::new();
    for transport in &transports {
        step(&format!("benchmark pd over {transport}"));
        // The bare transfer of each length's request on this transport, for the critical path's
        // ratio: between cold blocks, and with the source written just before (as the synthetic
        // prefill leaves it; on a CPU the copy then competes with that write-back).
        let mut raw = std::collections::BTreeMap::new();
        for &length in &sweep.lengths {
            let mut both = Vec::new();
            for fresh in [false, true] {
                let (blocks, tokens) = (blocks_for(length).to_string(), length.to_string());
                let mut args = vec![
                    "pd",
                    "raw",
                    "--model",
                    "qwen2.5-0.5b",
                    "--blocks",
                    &blocks,
                    "--transport",
                    transport,
                    "--input-tokens",
                    &tokens,
                ];
                if fresh {
                    args.push("--fresh-source");
                }
                both.push(kvx_json(&kvx, &args)?);
            }
            raw.insert(length, both);
        }
        println!(
            "\n{:>7} {:>5} | {:>21} | {:>21} | {:>17} | {:>17} | {:>15} | {:>15} | {:>17} | {:>17} | {:>13}",
            "tokens",
            "req/s",
            "TTFT p50/p99 push ms",
            "TTFT p50/p99 pull ms",
            "raw cold/fresh ms",
            "crit. path p50 ms",
            "push/raw c / f",
            "TPOT p50 ms",
            "loop CPU us/step",
            "decode CPU us/step",
            "CPU push/pull"
        );
        // A short unmeasured run first: the bare transfers above allocate and free gigabytes,
        // and the kernel's clean-up after them slowed whichever point came next.
        point(
            &kvx,
            &cpu_pair(transport, sweep.lengths[0]),
            "push",
            sweep.lengths[0],
            4.0,
            8,
            &scratch,
        )?;
        let mut points = Vec::new();
        for &length in &sweep.lengths {
            let raw_ms = get(&raw[&length][0], &["transfer_ms_p50"]);
            let fresh_ms = get(&raw[&length][1], &["transfer_ms_p50"]);
            for &rate in &sweep.rates {
                let pair = cpu_pair(transport, length);
                let push = point(&kvx, &pair, "push", length, rate, sweep.requests, &scratch)?;
                let pull = point(&kvx, &pair, "pull", length, rate, sweep.requests, &scratch)?;
                let s = |v: &Value, k: &str, q: &str| get(v, &["summary", k, q]);
                // Decode's CPU on transfer work per step: the engine loop's own (its thread's
                // CPU clock, not wall time) and the connector threads'.
                let decode_cpu = |v: &Value| {
                    s(v, "loop_transfer_cpu_us_per_step", "mean")
                        + get(v, &["summary", "connector_cpu_us_per_step"])
                };
                let cpu_ratio = decode_cpu(&push) / decode_cpu(&pull);
                println!(
                    "{length:>7} {rate:>5} | {:>9.1} / {:>9.1} | {:>9.1} / {:>9.1} | {raw_ms:>7.2} / {fresh_ms:>7.2} | {:>7.2} / {:>7.2} | {:>6.2} / {:>6.2} | {:>6.2} / {:>6.2} | {:>7.1} / {:>7.1} | {:>7.1} / {:>7.1} | {:>13.3}",
                    s(&push, "ttft_ms", "p50"),
                    s(&push, "ttft_ms", "p99"),
                    s(&pull, "ttft_ms", "p50"),
                    s(&pull, "ttft_ms", "p99"),
                    s(&push, "critical_path_ms", "p50"),
                    s(&pull, "critical_path_ms", "p50"),
                    s(&push, "critical_path_ms", "p50") / raw_ms,
                    s(&push, "critical_path_ms", "p50") / fresh_ms,
                    s(&push, "tpot_ms", "p50"),
                    s(&pull, "tpot_ms", "p50"),
                    s(&push, "loop_transfer_cpu_us_per_step", "mean"),
                    s(&pull, "loop_transfer_cpu_us_per_step", "mean"),
                    get(&push, &["summary", "connector_cpu_us_per_step"]),
                    get(&pull, &["summary", "connector_cpu_us_per_step"]),
                    cpu_ratio,
                );
                points.push(json!({
                    "input_tokens": length,
                    "rate": rate,
                    "raw_transfer": raw[&length][0],
                    "raw_transfer_fresh_source": raw[&length][1],
                    "push": push["summary"],
                    "pull": pull["summary"],
                    "decode_transfer_cpu_push_over_pull": cpu_ratio,
                }));
            }
        }
        let section = json!({ "transport": transport, "points": points });
        let name = transport.replace([':', ';'], "-");
        plot(
            &section,
            &out_dir.join(format!("pd-{name}-ttft.svg")),
            "ttft_ms",
            &format!("TTFT p50 (ms), {transport}"),
        )?;
        plot(
            &section,
            &out_dir.join(format!("pd-{name}-tpot.svg")),
            "tpot_ms",
            &format!("TPOT p50 (ms), {transport}"),
        )?;
        sections.push(section);
    }
    let authentication = auth_cost(&kvx, &transports[0], &sweep, &scratch, &out_dir)?;
    let metrics = metrics_cost(&kvx, &transports[0], &sweep, &scratch)?;
    let _ = std::fs::remove_file(&scratch);
    let report = json!({
        "what": "kvx pd pair, push vs pull, side by side in one run, per transport",
        "authentication": authentication,
        "metrics": metrics,
        "model_kv": "Qwen2.5-0.5B shape: 24 layers, 2 KV heads, head dim 64, bf16 (12 KiB per token)",
        "prefill_compute_us_per_token": 10,
        "prefill_chunk_tokens": CHUNK_TOKENS.parse::<u64>()?,
        "decode_step_ms": 5,
        "output_tokens": 32,
        "requests_per_point": sweep.requests,
        "transports": sections,
    });
    let json_path = out_dir.join("pd.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)?;
    println!(
        "    results: {} and pd-<transport>-ttft.svg / -tpot.svg beside it",
        json_path.display()
    );
    Ok(())
}

/// What the deployment key costs: push at the first length and 4 requests/s over `transport`,
/// with and without a key, alternating (two of each), side by side; TTFT p50 and the control
/// plane's share of it.
fn auth_cost(
    kvx: &Path,
    transport: &str,
    sweep: &Sweep,
    scratch: &Path,
    out_dir: &Path,
) -> anyhow::Result<Value> {
    step(&format!(
        "benchmark pd: authentication's cost over {transport}"
    ));
    let key = out_dir.join("pd-auth.key");
    let _ = std::fs::remove_file(&key);
    let made = Command::new(kvx)
        .args(["keygen"])
        .arg(&key)
        .output()
        .context("cannot run kvx keygen")?;
    if !made.status.success() {
        bail!("kvx keygen: {}", String::from_utf8_lossy(&made.stderr));
    }
    let length = sweep.lengths[0];
    let runs = on_and_off(kvx, transport, sweep, scratch, |pair| {
        for side in [&mut pair.prefill, &mut pair.decode] {
            side.extend(["--auth-key-file".to_owned(), key.display().to_string()]);
        }
        Ok(None)
    })?;
    let _ = std::fs::remove_file(&key);
    let ttft = |v: &Value| get(v, &["summary", "ttft_ms", "p50"]);
    let (with, without) = (mean_of(&runs, true, ttft), mean_of(&runs, false, ttft));
    let runs: Vec<(bool, f64)> = runs.iter().map(|(on, v, _)| (*on, ttft(v))).collect();
    println!(
        "    push, {length} tokens, 4/s: TTFT p50 {with:.2} ms with a key, {without:.2} ms \
         without ({:+.1} %)",
        (with / without - 1.0) * 100.0
    );
    Ok(json!({
        "transport": transport,
        "input_tokens": length,
        "rate": 4.0,
        "ttft_p50_ms_runs": runs.iter().map(|(k, t)| json!({"key": k, "ttft_p50_ms": t})).collect::<Vec<_>>(),
        "ttft_p50_ms_with_key": with,
        "ttft_p50_ms_without_key": without,
        "overhead_fraction": with / without - 1.0,
    }))
}

/// What serving and scraping the metrics costs the decode loop: push at the first length and 4
/// requests/s over `transport`, with `--metrics-listen` on both sides and a scraper reading both
/// every 50 ms (300 times Prometheus's default rate), and without, alternating (two of each);
/// TPOT p50 (the decode step) and the connector's CPU per decode step.
fn metrics_cost(
    kvx: &Path,
    transport: &str,
    sweep: &Sweep,
    scratch: &Path,
) -> anyhow::Result<Value> {
    step(&format!("benchmark pd: the metrics' cost over {transport}"));
    let length = sweep.lengths[0];
    let raw = on_and_off(kvx, transport, sweep, scratch, |pair| {
        let ports = [free_port()?, free_port()?];
        pair.prefill
            .extend(["--metrics-listen".to_owned(), ports[0].to_string()]);
        pair.decode
            .extend(["--metrics-listen".to_owned(), ports[1].to_string()]);
        Ok(Some(Scraper::start(ports.to_vec())))
    })?;
    let summary = |key: &'static str| move |v: &Value| get(v, &["summary", key]);
    let tpot = |v: &Value| get(v, &["summary", "tpot_ms", "p50"]);
    let (tpot_on, tpot_off) = (mean_of(&raw, true, tpot), mean_of(&raw, false, tpot));
    let cpu = summary("connector_cpu_us_per_step");
    let (cpu_on, cpu_off) = (mean_of(&raw, true, cpu), mean_of(&raw, false, cpu));
    let metrics_cpu = mean_of(&raw, true, summary("metrics_cpu_us_per_step"));
    let runs: Vec<Value> = raw
        .iter()
        .map(|(on, v, scrapes)| {
            json!({
                "metrics": on,
                "scrapes": scrapes,
                "tpot_p50_ms": tpot(v),
                "ttft_p50_ms": get(v, &["summary", "ttft_ms", "p50"]),
                "connector_cpu_us_per_step": cpu(v),
                "metrics_cpu_us_per_step": get(v, &["summary", "metrics_cpu_us_per_step"]),
            })
        })
        .collect();
    println!(
        "    push, {length} tokens, 4/s: TPOT p50 {tpot_on:.3} ms with metrics served and \
         scraped, {tpot_off:.3} ms without ({:+.1} %); the connector's CPU per step {cpu_on:.2} µs \
         against {cpu_off:.2} µs; the metrics thread's {metrics_cpu:.1} µs",
        (tpot_on / tpot_off - 1.0) * 100.0
    );
    Ok(json!({
        "transport": transport,
        "input_tokens": length,
        "rate": 4.0,
        "runs": runs,
        "tpot_p50_ms_on": tpot_on,
        "tpot_p50_ms_off": tpot_off,
        "tpot_overhead_fraction": tpot_on / tpot_off - 1.0,
        "connector_cpu_us_per_step_on": cpu_on,
        "connector_cpu_us_per_step_off": cpu_off,
        "metrics_thread_cpu_us_per_step": metrics_cpu,
    }))
}

/// Push at the first length and 4 requests/s over `transport`, alternately without and with
/// what `with` adds to the pair (two runs of each, without first), side by side: for each run,
/// whether it had it, decode's report and the scrapes of the scraper `with` started, if any.
fn on_and_off(
    kvx: &Path,
    transport: &str,
    sweep: &Sweep,
    scratch: &Path,
    mut with: impl FnMut(&mut PairArgs) -> anyhow::Result<Option<Scraper>>,
) -> anyhow::Result<Vec<(bool, Value, u64)>> {
    let length = sweep.lengths[0];
    let mut runs = Vec::new();
    for round in 0..4 {
        let on = round % 2 == 1;
        let mut pair = cpu_pair(transport, length);
        let scraper = if on { with(&mut pair)? } else { None };
        let v = point(kvx, &pair, "push", length, 4.0, sweep.requests, scratch)?;
        runs.push((on, v, scraper.map_or(0, Scraper::stop)));
    }
    Ok(runs)
}

/// The mean of `value` over the runs that had the thing compared (`on`), or did not.
fn mean_of(runs: &[(bool, Value, u64)], on: bool, value: impl Fn(&Value) -> f64) -> f64 {
    let v: Vec<f64> = runs
        .iter()
        .filter(|r| r.0 == on)
        .map(|r| value(&r.1))
        .filter(|x| x.is_finite())
        .collect();
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Reads `/metrics` at each address every 50 ms from a thread of its own until stopped.
struct Scraper {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Scraper {
    fn start(addrs: Vec<SocketAddr>) -> Self {
        use std::io::{Read as _, Write as _};
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut scrapes = 0;
            while !flag.load(Ordering::Relaxed) {
                for addr in &addrs {
                    // The sides start after the scraper: a refused connection is tried again.
                    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
                        continue;
                    };
                    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                    let mut answer = Vec::new();
                    if s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                        .and_then(|()| s.read_to_end(&mut answer))
                        .is_ok()
                        && answer.starts_with(b"HTTP/1.1 200")
                    {
                        scrapes += 1;
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            scrapes
        });
        Self { stop, thread }
    }

    /// Stops it; returns how many scrapes succeeded.
    fn stop(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}

fn plot(report: &Value, path: &PathBuf, metric: &str, label: &str) -> anyhow::Result<()> {
    let points = report["points"].as_array().cloned().unwrap_or_default();
    let mut lengths: Vec<u64> = points
        .iter()
        .filter_map(|p| p["input_tokens"].as_u64())
        .collect();
    lengths.dedup();
    let rates: Vec<f64> = points.iter().filter_map(|p| p["rate"].as_f64()).collect();
    let max_rate = rates.iter().copied().fold(1.0, f64::max);
    let values: Vec<f64> = points
        .iter()
        .flat_map(|p| ["push", "pull"].map(|m| get(p, &[m, metric, "p50"])))
        .filter(|v| v.is_finite())
        .collect();
    let max_y = values.iter().copied().fold(1.0, f64::max) * 1.1;
    let root_area = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root_area.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root_area)
        .caption(format!("kvx push vs pull: {label}"), ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_rate * 1.05, 0.0..max_y)?;
    chart
        .configure_mesh()
        .x_desc("request rate (requests/s)")
        .y_desc(label)
        .draw()?;
    let palette = crate::plot::PALETTE;
    for (i, length) in lengths.iter().enumerate() {
        let color = palette[i % palette.len()];
        for (mode, dashed) in [("push", false), ("pull", true)] {
            let series: Vec<(f64, f64)> = points
                .iter()
                .filter(|p| p["input_tokens"].as_u64() == Some(*length))
                .map(|p| {
                    (
                        p["rate"].as_f64().unwrap_or(0.0),
                        get(p, &[mode, metric, "p50"]),
                    )
                })
                .filter(|(_, y)| y.is_finite())
                .collect();
            let style = if dashed {
                color.mix(0.5).stroke_width(2)
            } else {
                color.stroke_width(3)
            };
            crate::plot::line_with_dots(
                &mut chart,
                series,
                color,
                style,
                format!("{mode} {length} tokens"),
            )?;
        }
    }
    crate::plot::legend(&mut chart)?;
    root_area.present()?;
    Ok(())
}
