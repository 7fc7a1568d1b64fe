//! `kvx pd raw`: the bare transfer time of one request's KV on a transport — the plan the
//! connector would post (same model, layouts and block ids), written from one endpoint to another
//! of the same process with a notice, no connector, no rendezvous, no engine. `cargo xtask bench
//! pd` divides the connector's post-prefill critical path by it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use kvx_core::{BlockId, Rank};
use kvx_layout::{Layout, PlanRequest};
use kvx_rdma::{Event, HostBuffer, LocalRegion, Notice, Transport};
use kvx_vllm::TransportSpec;
use serde_json::json;

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

/// Runs `kvx pd raw` and prints one JSON line.
pub(crate) fn run(args: &RawArgs) -> anyhow::Result<()> {
    let spec: TransportSpec = args.model.transport.parse()?;
    let layout = Layout::new(args.model.layout(0)?).context("model layout")?;
    let tokens = args.input_tokens;
    let blocks = tokens.div_ceil(u64::from(layout.spec().block_tokens)) as u32;
    if blocks > layout.spec().num_blocks {
        bail!(
            "{tokens} tokens need {blocks} blocks; the cache has {}",
            layout.spec().num_blocks
        );
    }
    let block_ids: Vec<BlockId> = (0..blocks).map(BlockId).collect();
    let plan = kvx_layout::plan(&PlanRequest {
        producers: std::slice::from_ref(&layout),
        consumer: &layout,
        num_tokens: tokens,
        skip_tokens: 0,
        producer_blocks: &block_ids,
        consumer_blocks: &block_ids,
        only_producer: None,
    })?;
    let mut producer = spec.open()?;
    let mut consumer = spec.open()?;
    let mut buffers = Vec::new();
    for index in 0..layout.region_count() {
        for side in [&mut producer, &mut consumer] {
            let buffer = Arc::new(HostBuffer::new(layout.region_len() as usize)?);
            buffer.fill_with(|i| i as u8);
            side.register(LocalRegion::host(index, Arc::clone(&buffer)))?;
            buffers.push(buffer);
        }
    }
    let peer = producer.connect(&consumer.local_desc())?;
    let ops = plan.ops_for(Rank(0));
    // The consumer waits on its own thread, as the connector's decode side does (some providers
    // need both sides to make progress); it reports when each notice arrived.
    let (arrived_tx, arrived) = std::sync::mpsc::channel();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let consumer_thread = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut events = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                events.clear();
                if consumer
                    .wait(&mut events, Duration::from_millis(20))
                    .is_err()
                {
                    return;
                }
                for e in &events {
                    if matches!(e, Event::Notice(_)) {
                        let _ = arrived_tx.send(Instant::now());
                    }
                }
            }
        })
    };
    let mut times = Vec::new();
    let mut result = Ok(());
    for i in 0..=args.repeats {
        let deadline = Instant::now() + Duration::from_secs(60);
        let start = Instant::now();
        if let Err(e) = producer.write(peer, ops, Some(Notice(i as u64))) {
            result = Err(e.into());
            break;
        }
        if let Err(e) = wait_for(producer.as_mut(), deadline, |e| {
            matches!(e, Event::WriteDone { .. })
        }) {
            result = Err(e);
            break;
        }
        // The consumer's notice is the end of the transfer (what the connector waits for).
        match arrived.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(at) if i > 0 => times.push(at.duration_since(start).as_secs_f64() * 1e3),
            Ok(_) => {}
            Err(_) => {
                result = Err(anyhow::anyhow!("no notice within 60 s"));
                break;
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = consumer_thread.join();
    result?;
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "{}",
        json!({
            "transport": spec.to_string(),
            "input_tokens": tokens,
            "bytes": plan.bytes(),
            "ops": ops.len(),
            "transfer_ms_p50": median,
            "transfer_ms_min": times[0],
        })
    );
    Ok(())
}
