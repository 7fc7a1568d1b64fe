//! `kvx pd raw`: the bare transfer time of one request's KV on a transport — the plan the
//! connector would post (same model, layouts and block ids), written from this process into a
//! second one (`kvx pd raw --serve`, started here) with a notice: no connector, no rendezvous, no
//! engine. The time runs from the post to the notice's arrival in the other process (one clock:
//! the same machine). `cargo xtask bench pd` divides the connector's critical path by it.
//!
//! Each repeat moves the request between *other* blocks, walking through both caches the way an
//! engine's allocator does: repeating one transfer between the same blocks would time copies
//! between cached bytes (this machine's last-level cache, 260 MiB, holds a 4,096-token request's
//! source and destination twice over), not the memory-to-memory copy a request costs.
//!
//! With `--fresh-source` the request's KV is written into the source blocks (the synthetic
//! engine's pattern) right before each transfer, as `kvx pd prefill` does when it computes a
//! request: on a CPU the copy then competes with the write-back of the just-written bytes.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use kvx_core::{BlockId, Rank};
use kvx_layout::{Layout, PlanRequest};
use kvx_rdma::{Event, Notice, Transport};
use kvx_vllm::TransportSpec;
use serde_json::json;

use super::gpu::Device;
use super::ModelArgs;

/// Arguments of `kvx pd raw`.
#[derive(clap::Args, Debug)]
pub(crate) struct RawArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens of the request.
    #[arg(long)]
    input_tokens: u64,
    /// Transfers to time (the median is reported).
    #[arg(long, default_value_t = 20)]
    repeats: usize,
    /// Write the request's KV into the source blocks right before each transfer, as the
    /// synthetic prefill engine does.
    #[arg(long)]
    fresh_source: bool,
    /// Be the receiving process (started by `kvx pd raw` itself).
    #[arg(long, hide = true)]
    serve: bool,
}

/// Registers a cache like the sender's (every page touched, as an engine's), prints its
/// description, and reports each notice's arrival (Unix microseconds) until stdin closes.
fn serve(layout: &Layout, spec: &TransportSpec, device: Device) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut transport = super::open_transport(spec, |o| o.for_cuda_device(device.cuda()))?;
    let (_memory, cache) = super::prefill::RankMemory::new(layout.spec().clone(), device)?;
    for region in cache.regions {
        transport.register(region)?;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "DESC {}", transport.local_desc().to_hex())?;
    out.flush()?;
    let (closed_tx, closed) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        let _ = closed_tx.send(());
    });
    let mut events = Vec::new();
    while closed.try_recv().is_err() {
        events.clear();
        transport.wait(&mut events, Duration::from_millis(20))?;
        for e in &events {
            if let Event::Notice(Notice(n)) = e {
                writeln!(out, "N {n} {}", super::unix_micros())?;
                out.flush()?;
            }
        }
    }
    Ok(())
}

fn wait_for(
    transport: &mut dyn Transport,
    deadline: Instant,
    mut want: impl FnMut(&Event) -> bool,
) -> anyhow::Result<()> {
    let mut events = Vec::new();
    loop {
        events.clear();
        transport.wait(&mut events, Duration::from_millis(20))?;
        for e in &events {
            if let Event::Failed { error, .. } = e {
                bail!("transfer failed: {error}");
            }
        }
        if events.iter().any(&mut want) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("transfer did not finish in 60 s");
        }
    }
}

/// Writes the plan `repeats + 1` times into the child and returns the times of all but the first
/// (post → notice arrival), in milliseconds.
fn time_into(
    child: &mut std::process::Child,
    spec: &TransportSpec,
    layout: &Layout,
    tokens: u64,
    repeats: usize,
    fresh_source: bool,
    device: Device,
) -> anyhow::Result<Vec<f64>> {
    use std::io::BufRead as _;
    let stdout = child.stdout.take().context("no stdout from the receiver")?;
    let mut lines = std::io::BufReader::new(stdout).lines();
    let desc = loop {
        let line = lines.next().context("the receiver exited")??;
        if let Some(h) = line.strip_prefix("DESC ") {
            break kvx_rdma::EndpointDesc::from_hex(h)?;
        }
    };
    let mut producer = super::open_transport(spec, |o| o.for_cuda_device(device.cuda()))?;
    // The prefill engine's memory (every page touched), so that `--fresh-source` writes the same
    // pattern the same way.
    let (memory, cache) = super::prefill::RankMemory::new(layout.spec().clone(), device)?;
    for region in cache.regions {
        producer.register(region)?;
    }
    let peer = producer.connect(&desc)?;
    let mut times = Vec::new();
    for i in 0..=repeats {
        let (plan, source_blocks) = plan_at(layout, tokens, i)?;
        if fresh_source {
            memory.fill(
                &source_blocks,
                0..tokens,
                0..layout.spec().num_layers,
                i as u64,
            )?;
        }
        let ops = plan.ops_for(Rank(0));
        let deadline = Instant::now() + Duration::from_secs(60);
        let start_us = super::unix_micros();
        producer.write(peer, ops, Some(Notice(i as u64)))?;
        wait_for(producer.as_mut(), deadline, |e| {
            matches!(e, Event::WriteDone { .. })
        })?;
        let line = lines.next().context("the receiver exited")??;
        let at_us: u64 = line
            .rsplit(' ')
            .next()
            .and_then(|t| t.parse().ok())
            .context("bad notice line from the receiver")?;
        if i > 0 {
            times.push(at_us.saturating_sub(start_us) as f64 / 1e3);
        }
    }
    Ok(times)
}

/// The plan of repeat `repeat` and its source blocks: the request's blocks moved to the next
/// free stretch of each cache (producer and consumer at different stretches), wrapping around.
fn plan_at(
    layout: &Layout,
    tokens: u64,
    repeat: usize,
) -> anyhow::Result<(kvx_layout::Plan, Vec<BlockId>)> {
    let blocks = tokens.div_ceil(u64::from(layout.spec().block_tokens)) as u32;
    let stretches = (layout.spec().num_blocks / blocks.max(1)).max(1) as usize;
    let ids = |stretch: usize| -> Vec<BlockId> {
        let first = (stretch % stretches) as u32 * blocks;
        (first..first + blocks).map(BlockId).collect()
    };
    let (producer_blocks, consumer_blocks) = (ids(repeat), ids(repeat + stretches / 2));
    let plan = kvx_layout::plan(&PlanRequest {
        producers: std::slice::from_ref(layout),
        consumer: layout,
        num_tokens: tokens,
        skip_tokens: 0,
        producer_blocks: &producer_blocks,
        consumer_blocks: &consumer_blocks,
        only_producer: None,
        producer_groups: &[],
        consumer_groups: &[],
    })?;
    Ok((plan, producer_blocks))
}

/// Runs `kvx pd raw` and prints one JSON line.
pub(crate) fn run(args: &RawArgs) -> anyhow::Result<()> {
    let spec: TransportSpec = args.model.transport()?;
    let device = args.model.device()?;
    let layout = Layout::new(args.model.layout(0)?).context("model layout")?;
    let tokens = args.input_tokens;
    let blocks = tokens.div_ceil(u64::from(layout.spec().block_tokens)) as u32;
    if blocks > layout.spec().num_blocks {
        bail!(
            "{tokens} tokens need {blocks} blocks; the cache has {}",
            layout.spec().num_blocks
        );
    }
    let (plan, _) = plan_at(&layout, tokens, 0)?;
    if !args.serve && layout.spec().num_blocks / blocks < 3 {
        eprintln!(
            "kvx pd raw: warning: the cache holds fewer than 3 requests of {tokens} tokens \
             ({} blocks), so repeats reuse recently copied blocks and may time cached bytes; \
             give --blocks at least {}",
            layout.spec().num_blocks,
            3 * blocks
        );
    }
    if args.serve {
        return serve(&layout, &spec, device);
    }
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["pd", "raw", "--serve"])
        .args(args.model.to_args())
        .args(["--input-tokens", &tokens.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("cannot start the receiving process")?;
    let result = time_into(
        &mut child,
        &spec,
        &layout,
        tokens,
        args.repeats,
        args.fresh_source,
        device,
    );
    drop(child.stdin.take());
    let _ = child.wait();
    let mut times = result?;
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "{}",
        json!({
            "transport": spec.to_string(),
            "input_tokens": tokens,
            "bytes": plan.bytes(),
            "ops": plan.ops_for(Rank(0)).len(),
            "transfer_ms_p50": median,
            "transfer_ms_min": times[0],
            "fresh_source": args.fresh_source,
        })
    );
    Ok(())
}
