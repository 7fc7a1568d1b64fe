//! `kvx pd decode`: the decode instance of the pair, and the request stream (the router).

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use kvx_core::{Attempt, BlockId, EngineId, RequestId, TransferId};
use kvx_rdma::cpu_time::thread_cpu_time;
use kvx_rendezvous::AttemptKey;
use kvx_vllm::{ConnectorConfig, Consumer, PullRequest, PushRequest, RecvEvent, TransportSpec};
use serde_json::json;

use super::gpu::{Device, GpuEngine};
use super::prefill::{connect_router, kv_seed, RankMemory};

/// The largest decode batch the GPU engine computes in one pass (larger ones take several).
const MAX_BATCH: u64 = 64;
use super::{unix_micros, BlockPool, ModelArgs};

/// Arguments of `kvx pd decode`.
#[derive(clap::Args, Debug)]
pub(crate) struct DecodeArgs {
    /// The prefill instance's kvx control address (rank 0).
    #[arg(long, default_value = "127.0.0.1:7100")]
    prefill: SocketAddr,
    /// The prefill instance's side channel.
    #[arg(long, default_value = "127.0.0.1:7200")]
    prefill_bench: SocketAddr,
    /// push or pull.
    #[arg(long, default_value = "push")]
    mode: String,
    /// Mean request rate (Poisson arrivals), requests per second.
    #[arg(long, default_value_t = 2.0)]
    rate: f64,
    /// Requests to send.
    #[arg(long, default_value_t = 20)]
    requests: usize,
    /// Warm-up requests first, one at a time, of the first input length; the stream and its
    /// measurements start when they are done (connections made, first contact, caches warm).
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Prompt lengths, used in turn.
    #[arg(long, value_delimiter = ',', default_value = "1024")]
    input_tokens: Vec<u64>,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 16)]
    output_tokens: u32,
    /// Duration of one simulated decode step (host; on a GPU a step is the model's products).
    #[arg(long, default_value_t = 5.0)]
    step_ms: f64,
    /// Seconds a request may wait for its KV.
    #[arg(long, default_value_t = 60)]
    lease_s: u64,
    /// Random seed of the arrival process.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Ask the producers for finishing hints: `auto` (where the transport polls to wait and
    /// peers' RMA lands unassisted: libfabric `shm` with cross-memory attach), `on` or `off`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "on", "off"])]
    finishing_hints: String,
    /// Let prefill write push notices into decode's notice board, read at each engine step
    /// (where the transport has one: `cma`), or deliver them as messages to decode's driver.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    notice_board: String,
    /// Write the results as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

struct Request {
    key: AttemptKey,
    tokens: u64,
    blocks: Vec<BlockId>,
    arrival: Instant,
    arrival_us: u64,
    prefill_done_us: Option<u64>,
    ready: Option<Instant>,
    ready_us: Option<u64>,
    /// When prefill saw its last write land (push).
    landed_us: Option<u64>,
    ranks_ready: u32,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    emitted: u32,
    failed: Option<String>,
    verified: Option<Result<u64, String>>,
    /// A warm-up request: left out of every measurement.
    warmup: bool,
    /// The request's span as the router (`kvx.pd.request`) until it is ready or failed, where
    /// spans are exported; `trace` hands it on to prefill and to decode's consumers.
    span: tracing::Span,
    trace: Option<kvx_vllm::trace::TraceContext>,
}

impl Request {
    fn resolved(&self, output_tokens: u32) -> bool {
        self.failed.is_some() || (self.emitted >= output_tokens && self.verified.is_some())
    }
}

/// What the side channel's reader thread passes on.
enum SideLine {
    /// A line from prefill.
    Text(String),
    /// The connection closed (prefill gone).
    Closed,
}

/// The side channel to prefill: the router's requests out, prefill's reports in, connected
/// again after prefill goes (killed and restarted with `--keep-serving`).
struct SideChannel {
    addr: SocketAddr,
    writer: Option<std::net::TcpStream>,
    lines: mpsc::Receiver<(u64, SideLine)>,
    tx: mpsc::Sender<(u64, SideLine)>,
    /// The connection now (lines of an earlier one are dropped).
    generation: u64,
    /// When to try connecting again while down.
    next_try: Instant,
}

impl SideChannel {
    /// Connects to prefill at `addr`, retrying for up to `timeout`.
    fn connect(addr: SocketAddr, timeout: Duration) -> anyhow::Result<Self> {
        let stream = connect_router(addr, timeout)?;
        let (tx, lines) = mpsc::channel();
        let mut side = Self {
            addr,
            writer: None,
            lines,
            tx,
            generation: 0,
            next_try: Instant::now(),
        };
        side.adopt(stream)?;
        Ok(side)
    }

    /// Takes `stream` as the connection, with a reader thread of its own.
    fn adopt(&mut self, stream: std::net::TcpStream) -> anyhow::Result<()> {
        self.generation += 1;
        let generation = self.generation;
        self.writer = Some(stream.try_clone()?);
        let tx = self.tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if tx.send((generation, SideLine::Text(line))).is_err() {
                    return;
                }
            }
            let _ = tx.send((generation, SideLine::Closed));
        });
        Ok(())
    }

    fn is_up(&self) -> bool {
        self.writer.is_some()
    }

    /// Tries to connect again (at most every 100 ms); whether it is up now.
    fn reconnect(&mut self, now: Instant) -> bool {
        if now < self.next_try {
            return false;
        }
        self.next_try = now + Duration::from_millis(100);
        let Ok(stream) =
            std::net::TcpStream::connect_timeout(&self.addr, Duration::from_millis(200))
        else {
            return false;
        };
        stream.set_nodelay(true).is_ok() && self.adopt(stream).is_ok()
    }

    /// Sends `line`; `false` (and down) where the connection is gone.
    fn send(&mut self, line: &str) -> bool {
        let sent = self
            .writer
            .as_mut()
            .is_some_and(|w| w.write_all(line.as_bytes()).is_ok());
        if !sent {
            self.writer = None;
        }
        sent
    }

    /// The next line or closing of the connection now, waiting up to `timeout`.
    fn recv_timeout(&mut self, timeout: Duration) -> Option<SideLine> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (generation, line) = self.lines.recv_timeout(left).ok()?;
            if let Some(line) = self.current(generation, line) {
                return Some(line);
            }
        }
    }

    /// [`SideChannel::recv_timeout`] without waiting.
    fn try_recv(&mut self) -> Option<SideLine> {
        loop {
            let (generation, line) = self.lines.try_recv().ok()?;
            if let Some(line) = self.current(generation, line) {
                return Some(line);
            }
        }
    }

    /// `line` if it is of the connection now (its closing takes the channel down).
    fn current(&mut self, generation: u64, line: SideLine) -> Option<SideLine> {
        if generation != self.generation {
            return None;
        }
        if matches!(line, SideLine::Closed) {
            self.writer = None;
        }
        Some(line)
    }
}

/// A new trace for the request `key`, and the router's span in it (`kvx.pd.request`, the parent
/// of prefill's `kvx.send` and decode's `kvx.receive` spans), as `kvx proxy`'s dispatch is.
fn router_span(
    key: AttemptKey,
    tokens: u64,
    mode: &str,
) -> (Option<kvx_vllm::trace::TraceContext>, tracing::Span) {
    let span_id = kvx_vllm::trace::random_span_id();
    let trace = kvx_vllm::trace::TraceContext::new_trace(span_id);
    let span = tracing::info_span!(
        target: "kvx_trace",
        "kvx.pd.request",
        trace_id = %trace.trace_hex(),
        parent_span_id = "",
        span_id = %format!("{span_id:016x}"),
        transfer = %key.transfer,
        tokens,
        mode,
    );
    (Some(trace), span)
}

/// Exponential inter-arrival gaps from a xorshift generator.
fn arrivals(n: usize, rate: f64, seed: u64) -> Vec<Duration> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            let at = t;
            t += -u.ln() / rate;
            Duration::from_secs_f64(at)
        })
        .collect()
}

fn stats(mut v: Vec<f64>) -> serde_json::Value {
    if v.is_empty() {
        return json!(null);
    }
    v.sort_by(f64::total_cmp);
    let pick = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    json!({
        "mean": v.iter().sum::<f64>() / v.len() as f64,
        "p50": pick(0.5),
        "p99": pick(0.99),
        "max": v[v.len() - 1],
        "n": v.len(),
    })
}

/// Runs decode and the request stream; prints a summary and writes JSON.
#[allow(clippy::too_many_lines)]
pub(crate) fn run(args: &DecodeArgs) -> anyhow::Result<()> {
    let pull = match args.mode.as_str() {
        "push" => false,
        "pull" => true,
        m => bail!("unknown mode `{m}` (push, pull)"),
    };
    if args.input_tokens.is_empty() || args.rate <= 0.0 {
        bail!("need at least one input length and a positive rate");
    }
    let spec: TransportSpec = args.model.transport()?;
    let device = args.model.device()?;
    let mut memories = Vec::new();
    let mut consumers = Vec::new();
    // This run is its own router: with a deployment key it grants each request's capability.
    let mut grant_key = None;
    for rank in 0..args.model.tp {
        let (memory, cache) = RankMemory::new(args.model.layout(rank)?, device)?;
        let mut config = ConnectorConfig::new(EngineId(2));
        config.registration_lease = Duration::from_secs(args.lease_s);
        config.notice_board = args.notice_board == "on";
        config.finishing_hints = match args.finishing_hints.as_str() {
            "on" => Some(true),
            "off" => Some(false),
            _ => None,
        };
        args.model.apply_settings(&mut config)?;
        grant_key.clone_from(&config.auth_key);
        let rails = super::rail_overrides(&args.model.rails)?;
        consumers.push(
            Consumer::start(
                config,
                cache,
                super::open_transport(&spec, |o| {
                    o.with_peer(args.prefill.ip())
                        .with_rail_overrides(rails)
                        .for_cuda_device(device.cuda())
                })?,
            )
            .context("cannot start the consumer")?,
        );
        memories.push(memory);
    }
    let prefill_name = args.prefill.to_string();
    let grant_for = Duration::from_secs(args.lease_s) + Duration::from_secs(60);
    let grant = |transfer| {
        grant_key.as_ref().map(|k| {
            k.grant(
                transfer,
                EngineId(2),
                &prefill_name,
                std::time::SystemTime::now() + grant_for,
            )
        })
    };
    super::serve_metrics(
        &args.model,
        "decode",
        consumers.iter().map(Consumer::stats_reader),
    )?;
    let memories = Arc::new(memories);
    // On a GPU, decode steps are the model's products for the running batch.
    let engine = match device {
        Device::Host => None,
        Device::Cuda(ordinal) => {
            let longest = args.input_tokens.iter().copied().max().unwrap_or(0);
            Some(GpuEngine::new(
                &kvx_rdma::cuda::Gpu::open(ordinal)?,
                args.model.shape()?,
                MAX_BATCH,
                longest + u64::from(args.output_tokens),
                MAX_BATCH,
            )?)
        }
    };
    let mut side = SideChannel::connect(args.prefill_bench, Duration::from_secs(60))?;
    eprintln!(
        "kvx pd decode: running {} requests ({} mode)",
        args.requests, args.mode
    );
    // Verification off the engine loop: every received byte is checked.
    let (verify_tx, verify_rx) = mpsc::channel::<(AttemptKey, Vec<BlockId>, u64)>();
    let (verified_tx, verified_rx) = mpsc::channel::<(AttemptKey, Result<u64, String>)>();
    let verifier_memories = Arc::clone(&memories);
    std::thread::spawn(move || {
        for (key, blocks, tokens) in verify_rx {
            let result = verifier_memories
                .iter()
                .try_fold(0u64, |acc, m| {
                    m.verify(&blocks, tokens, kv_seed(key.transfer))
                        .map(|b| acc + b)
                })
                .map_err(|e| e.to_string());
            if verified_tx.send((key, result)).is_err() {
                return;
            }
        }
    });

    let schedule = arrivals(args.requests, args.rate, args.seed);
    let mut cpu_before = connector_cpu_ns();
    let mut start = Instant::now();
    let mut warmups_left = args.warmup;
    let mut warming = args.warmup > 0;
    let mut pending: VecDeque<(usize, Duration)> = schedule.iter().copied().enumerate().collect();
    let mut requests: Vec<Request> = Vec::new();
    // Decode is the router: where request spans are exported (`--otlp-endpoint`), it starts a
    // trace per request, as `kvx proxy` does.
    let traced = tracing::enabled!(target: "kvx_trace", tracing::Level::INFO);
    let mut by_key: HashMap<AttemptKey, usize> = HashMap::new();
    let mut pool = BlockPool::new(args.model.blocks);
    let mut running: Vec<usize> = Vec::new();
    let mut loop_work: Vec<f64> = Vec::new();
    let mut loop_cpu: Vec<f64> = Vec::new();
    let measuring = StepWork::overhead();
    let mut clock_warm_ups: Vec<f64> = Vec::new();
    let step = Duration::from_secs_f64(args.step_ms / 1e3);
    let timeout = Duration::from_secs(args.lease_s + 120);
    let base_transfer = (u128::from(std::process::id()) << 64) | (unix_micros() as u128) << 16;

    loop {
        let now = Instant::now();
        if now.duration_since(start) > timeout {
            bail!("the run did not finish within {timeout:?}");
        }
        let mut transfer_work = StepWork::default();
        // The clocks' first reads after the loop slept cost more than the warm calibration
        // says: one empty measurement first warms them (kept apart, not counted as work).
        let mut clock_warm_up = StepWork::default();
        clock_warm_up.add_since(StepWork::mark(), &measuring);
        // Warm-up requests one at a time; then the stream, timed from the end of the warm-up.
        if warming && warmups_left == 0 && requests.iter().all(|r| r.resolved(args.output_tokens)) {
            warming = false;
            cpu_before = connector_cpu_ns();
            start = Instant::now();
        }
        // A prefill that went (killed, restarted) is connected to again.
        if !side.is_up() && side.reconnect(now) {
            eprintln!("kvx pd decode: the prefill's side channel is back");
        }
        // Arrivals that are due, while prefill can be told of them.
        while side.is_up() {
            let (i, at) = if warming {
                if warmups_left == 0 || requests.iter().any(|r| !r.resolved(args.output_tokens)) {
                    break;
                }
                (
                    args.requests + args.warmup - warmups_left,
                    now.duration_since(start),
                )
            } else {
                match pending.front() {
                    Some(&(i, at)) if start + at <= now => (i, at),
                    _ => break,
                }
            };
            // Warm-up requests take the first length.
            let tokens = args.input_tokens[if warming {
                0
            } else {
                i % args.input_tokens.len()
            }];
            let needed = tokens.div_ceil(u64::from(args.model.block_tokens)) as usize;
            let Some(blocks) = pool.alloc(needed) else {
                if running.is_empty()
                    && by_key
                        .values()
                        .all(|&r| requests[r].resolved(args.output_tokens))
                {
                    bail!("a {tokens}-token request needs more blocks than the decode cache has");
                }
                break; // wait for blocks
            };
            if warming {
                warmups_left -= 1;
            } else {
                pending.pop_front();
            }
            let key = AttemptKey::new(TransferId(base_transfer + i as u128), Attempt::FIRST);
            let (trace, span) = if traced {
                router_span(key, tokens, &args.mode)
            } else {
                (None, tracing::Span::none())
            };
            let line = match trace {
                Some(trace) => format!(
                    "P {:x} {} {} {} {trace}\n",
                    key.transfer.0, key.attempt.0, tokens, args.mode
                ),
                None => format!(
                    "P {:x} {} {} {}\n",
                    key.transfer.0, key.attempt.0, tokens, args.mode
                ),
            };
            // Prefill gone on the way: the request fails now (it never reached prefill).
            let lost =
                (!side.send(&line)).then(|| "prefill lost before it took the request".to_owned());
            let index = requests.len();
            requests.push(Request {
                key,
                tokens,
                blocks: blocks.clone(),
                arrival: start + at,
                arrival_us: unix_micros() - now.duration_since(start + at).as_micros() as u64,
                prefill_done_us: None,
                ready: None,
                ready_us: None,
                landed_us: None,
                ranks_ready: 0,
                first_token: None,
                last_token: None,
                emitted: 0,
                failed: None,
                verified: None,
                warmup: warming,
                span,
                trace,
            });
            by_key.insert(key, index);
            if let Some(lost) = lost {
                requests[index].failed = Some(lost);
                continue;
            }
            if !pull {
                let t = StepWork::mark();
                let capability = grant(key.transfer);
                for consumer in &consumers {
                    consumer.request_allocated(PushRequest {
                        groups: Vec::new(),
                        key,
                        request: RequestId(i as u64),
                        prefill: args.prefill,
                        num_tokens: tokens,
                        skip_tokens: 0,
                        blocks: blocks.clone(),
                        capability: capability.clone(),
                        trace,
                    })?;
                }
                transfer_work.add_since(t, &measuring);
            }
        }
        // The router relays prefill completions (and, in pull mode, the prefill's blocks).
        let idle = running.is_empty();
        let first = if idle {
            side.recv_timeout(Duration::from_micros(500))
        } else {
            side.try_recv()
        };
        let lines: Vec<SideLine> = first
            .into_iter()
            .chain(std::iter::from_fn(|| side.try_recv()))
            .collect();
        for line in lines {
            let line = match line {
                SideLine::Text(line) => line,
                SideLine::Closed => {
                    // Prefill is gone: what it had not reported computed never will be (pull:
                    // nothing was asked of the connector for it); push registrations fail in
                    // the connector with the lost connection.
                    eprintln!("kvx pd decode: the prefill's side channel closed");
                    for r in requests
                        .iter_mut()
                        .filter(|r| pull && r.failed.is_none() && r.prefill_done_us.is_none())
                    {
                        r.failed = Some("prefill lost before it computed the request".into());
                    }
                    continue;
                }
            };
            if let Some((key, at)) = landed_line(&line)? {
                if let Some(&index) = by_key.get(&key) {
                    requests[index].landed_us = Some(at);
                }
                continue;
            }
            let f: Vec<&str> = line.split_whitespace().collect();
            let ["D", transfer, attempt, done_us, ids] = f.as_slice() else {
                bail!("malformed line from prefill: {line}");
            };
            let key = parse_key(transfer, attempt)?;
            let Some(&index) = by_key.get(&key) else {
                continue;
            };
            requests[index].prefill_done_us = Some(done_us.parse()?);
            if pull {
                let producer_blocks = ids
                    .split(',')
                    .map(|b| b.parse().map(BlockId))
                    .collect::<Result<Vec<_>, _>>()?;
                let r = &requests[index];
                let t = StepWork::mark();
                let capability = grant(key.transfer);
                for consumer in &consumers {
                    consumer.pull(PullRequest {
                        producer_groups: Vec::new(),
                        push: PushRequest {
                            groups: Vec::new(),
                            key,
                            request: RequestId(index as u64),
                            prefill: args.prefill,
                            num_tokens: r.tokens,
                            skip_tokens: 0,
                            blocks: r.blocks.clone(),
                            capability: capability.clone(),
                            trace: r.trace,
                        },
                        producer_blocks: producer_blocks.clone(),
                    })?;
                }
                transfer_work.add_since(t, &measuring);
            }
        }
        // Completions.
        let t = StepWork::mark();
        let events: Vec<(RecvEvent, std::time::SystemTime)> = consumers
            .iter()
            .flat_map(Consumer::take_events_timed)
            .collect();
        transfer_work.add_since(t, &measuring);
        for (event, at) in events {
            match event {
                RecvEvent::Ready { key, .. } => {
                    let Some(&index) = by_key.get(&key) else {
                        continue;
                    };
                    let r = &mut requests[index];
                    r.ranks_ready += 1;
                    // The critical path ends when the connector decided the last rank's KV was
                    // in place, not when this loop polled (that is the engine's step).
                    let at_us = at
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or_else(|_| unix_micros(), |d| d.as_micros() as u64);
                    r.ready_us = Some(r.ready_us.map_or(at_us, |prev| prev.max(at_us)));
                    if r.ranks_ready == args.model.tp && r.failed.is_none() {
                        r.ready = Some(Instant::now());
                        r.span = tracing::Span::none();
                        verify_tx.send((key, r.blocks.clone(), r.tokens))?;
                        running.push(index);
                    }
                }
                RecvEvent::Failed {
                    key,
                    reason,
                    detail,
                    ..
                } => {
                    let Some(&index) = by_key.get(&key) else {
                        continue;
                    };
                    let r = &mut requests[index];
                    if r.failed.is_none() {
                        r.span.in_scope(|| {
                            tracing::info!(target: "kvx_trace", %reason, %detail, "failed");
                        });
                        r.span = tracing::Span::none();
                        r.failed = Some(format!("{reason} {detail}"));
                        running.retain(|&x| x != index);
                    }
                }
            }
        }
        while let Ok((key, result)) = verified_rx.try_recv() {
            if let Some(&index) = by_key.get(&key) {
                requests[index].verified = Some(result);
            }
        }
        // One decode step for the running batch.
        if !running.is_empty() {
            if !warming {
                loop_work.push(transfer_work.wall.as_secs_f64() * 1e6);
                loop_cpu.push(transfer_work.cpu.as_secs_f64() * 1e6);
                clock_warm_ups.push(clock_warm_up.cpu.as_secs_f64() * 1e6);
            }
            if let Some(engine) = &engine {
                let contexts: Vec<u64> = running
                    .iter()
                    .map(|&i| requests[i].tokens + u64::from(requests[i].emitted))
                    .collect();
                engine.decode_step(&contexts)?;
            } else {
                std::thread::sleep(step);
            }
            let now = Instant::now();
            for &index in &running {
                let r = &mut requests[index];
                r.emitted += 1;
                r.first_token.get_or_insert(now);
                r.last_token = Some(now);
            }
            running.retain(|&index| requests[index].emitted < args.output_tokens);
        }
        // Free the blocks of resolved requests.
        for r in &mut requests {
            if r.resolved(args.output_tokens)
                && !r.blocks.is_empty()
                && !running.contains(&by_key[&r.key])
            {
                pool.free(std::mem::take(&mut r.blocks));
            }
        }
        if !warming && pending.is_empty() && requests.iter().all(|r| r.resolved(args.output_tokens))
        {
            break;
        }
    }
    // Prefill reports when each push request's writes landed as it notices: wait a little
    // for the last ones.
    let landed_deadline = Instant::now() + Duration::from_secs(2);
    while !pull
        && side.is_up()
        && requests
            .iter()
            .any(|r| r.failed.is_none() && r.landed_us.is_none())
        && Instant::now() < landed_deadline
    {
        if let Some(SideLine::Text(line)) = side.recv_timeout(Duration::from_millis(50)) {
            if let Some((key, at)) = landed_line(&line)? {
                if let Some(&index) = by_key.get(&key) {
                    requests[index].landed_us = Some(at);
                }
            }
        }
    }
    drop(side);
    // Before shutdown: the connector's threads are still there to be asked.
    let connector_cpu_ms: Option<HashMap<String, f64>> =
        cpu_before.zip(connector_cpu_ns()).map(|(before, after)| {
            after
                .into_iter()
                .map(|(name, ns)| {
                    let spent = ns.saturating_sub(before.get(&name).copied().unwrap_or(0));
                    (name, spent as f64 / 1e6)
                })
                .collect()
        });
    // The connector's own threads; the metrics endpoint's (`--metrics-listen`) apart.
    let per_step = |observability: bool| {
        connector_cpu_ms
            .as_ref()
            .filter(|_| !loop_work.is_empty())
            .map(|by_thread| {
                by_thread
                    .iter()
                    .filter(|(name, _)| {
                        OBSERVABILITY_THREADS.contains(&name.as_str()) == observability
                    })
                    .map(|(_, ms)| ms)
                    .sum::<f64>()
                    * 1e3
                    / loop_work.len() as f64
            })
    };
    let connector_cpu_us_per_step = per_step(false);
    let metrics_cpu_us_per_step = per_step(true);
    let finishing_hints: u64 = consumers.iter().map(|c| c.stats().finishing_hints).sum();
    let board_ready: u64 = consumers.iter().map(|c| c.stats().board_ready).sum();
    let driver_turns: u64 = consumers.iter().map(|c| c.stats().driver_turns).sum();
    let local_connections: u64 = consumers.iter().map(|c| c.stats().local_connections).sum();
    let released_unconfirmed: u64 = consumers
        .iter()
        .map(|c| c.stats().released_unconfirmed)
        .sum();
    // What the connector still holds once every request ended (0 unless something leaked).
    let held_at_end: i64 = consumers.iter().map(|c| c.stats().held).sum();
    for mut c in consumers {
        c.shutdown();
    }

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut rows = Vec::new();
    let (mut ttft, mut critical, mut tpot) = (Vec::new(), Vec::new(), Vec::new());
    let mut seen_by_engine = Vec::new();
    let mut by_len: HashMap<u64, (Vec<f64>, Vec<f64>)> = HashMap::new();
    let (mut failed, mut bad, mut verified_bytes) = (0, 0, 0u64);
    // Warm-up requests count only where something went wrong: a failure or a wrong byte.
    let mut warmup_failed = 0;
    for r in requests.iter().filter(|r| r.warmup) {
        if r.failed.is_some() {
            warmup_failed += 1;
        }
        if let Some(Err(e)) = &r.verified {
            bad += 1;
            eprintln!("verification failed for warm-up request {}: {e}", r.key);
        }
    }
    for r in requests.iter().filter(|r| !r.warmup) {
        let t = r.first_token.map(|f| ms(f - r.arrival));
        // The KV is in decode's memory when the first of the two sides knows it: decode's
        // connector (a message notice, pull's reads) or prefill (its writes and their notice
        // landed; a notice in decode's board is seen only at decode's next engine step).
        let in_place = match (r.ready_us, r.landed_us) {
            (Some(ready), Some(landed)) => Some(ready.min(landed)),
            (ready, landed) => ready.or(landed),
        };
        let since_done = |at: Option<u64>| match (at, r.prefill_done_us) {
            (Some(at), Some(done)) => Some(at.saturating_sub(done) as f64 / 1e3),
            _ => None,
        };
        let c = since_done(in_place);
        let seen = since_done(r.ready_us);
        let p = match (r.first_token, r.last_token) {
            (Some(f), Some(l)) if r.emitted > 1 => Some(ms(l - f) / f64::from(r.emitted - 1)),
            _ => None,
        };
        if r.failed.is_some() {
            failed += 1;
        }
        match &r.verified {
            Some(Ok(b)) => verified_bytes += b,
            Some(Err(e)) => {
                bad += 1;
                eprintln!("verification failed for {}: {e}", r.key);
            }
            None => {}
        }
        ttft.extend(t);
        critical.extend(c);
        seen_by_engine.extend(seen);
        tpot.extend(p);
        let entry = by_len.entry(r.tokens).or_default();
        entry.0.extend(t);
        entry.1.extend(c);
        rows.push(json!({
            "tokens": r.tokens,
            "arrival_us": r.arrival_us,
            "ttft_ms": t,
            "critical_path_ms": c,
            "seen_by_engine_ms": seen,
            "prefill_done_ms": r
                .prefill_done_us
                .map(|d| d.saturating_sub(r.arrival_us) as f64 / 1e3),
            "tpot_ms": p,
            "failed": r.failed,
        }));
    }
    let mut per_len: Vec<_> = by_len.into_iter().collect();
    per_len.sort_by_key(|(l, _)| *l);
    let bytes_per_token = args.model.bytes_per_token()?;
    let summary = json!({
        "completed": requests.len() - args.warmup - failed,
        "warmup_requests": args.warmup,
        "warmup_failed": warmup_failed,
        "failed": failed,
        "verification_failures": bad,
        "verified_bytes": verified_bytes,
        "ttft_ms": stats(ttft),
        "critical_path_ms": stats(critical),
        "seen_by_engine_ms": stats(seen_by_engine),
        "tpot_ms": stats(tpot),
        "loop_transfer_us_per_step": stats(loop_work),
        "loop_transfer_cpu_us_per_step": stats(loop_cpu),
        "loop_measuring_ns": json!({
            "wall": measuring.wall.as_nanos() as u64,
            "cpu": measuring.cpu.as_nanos() as u64,
        }),
        "loop_clock_warm_up_cpu_us": stats(clock_warm_ups),
        "connector_cpu_us_per_step": connector_cpu_us_per_step,
        "metrics_cpu_us_per_step": metrics_cpu_us_per_step,
        "connector_cpu_ms_by_thread": connector_cpu_ms,
        "finishing_hints": finishing_hints,
        "held_at_end": held_at_end,
        "board_ready": board_ready,
        "driver_turns": driver_turns,
        "local_connections": local_connections,
        "released_unconfirmed": released_unconfirmed,
        "by_input_tokens": per_len.into_iter().map(|(len, (t, c))| json!({
            "input_tokens": len,
            "kv_bytes": len * bytes_per_token,
            "ttft_ms": stats(t),
            "critical_path_ms": stats(c),
        })).collect::<Vec<_>>(),
    });
    let report = json!({
        "mode": args.mode,
        "transport": spec.to_string(),
        "model": args.model.model,
        "kv_bytes_per_token": bytes_per_token,
        "prefill_tp": null,
        "decode_tp": args.model.tp,
        "rate": args.rate,
        "requests": args.requests,
        "input_tokens": args.input_tokens,
        "output_tokens": args.output_tokens,
        "step_ms": engine.is_none().then_some(args.step_ms),
        "device": args.model.device,
        "summary": summary,
        "per_request": rows,
    });
    println!("{}", serde_json::to_string_pretty(&report["summary"])?);
    if let Some(path) = &args.out {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if failed > 0 || warmup_failed > 0 || bad > 0 {
        bail!(
            "{failed} request(s) and {warmup_failed} warm-up request(s) failed, {bad} \
             verification failure(s)"
        );
    }
    Ok(())
}

/// The engine loop's transfer work in one step: wall time, and the loop thread's own CPU time
/// (the same work without the time the thread spent descheduled on a busy machine).
#[derive(Default)]
struct StepWork {
    wall: Duration,
    cpu: Duration,
}

impl StepWork {
    /// Where a piece of transfer work starts: (wall clock, thread CPU clock).
    fn mark() -> (Instant, Duration) {
        (Instant::now(), thread_cpu_time())
    }

    /// Adds the work since `mark`, less what reading the clocks costs (`overhead`).
    fn add_since(&mut self, (wall, cpu): (Instant, Duration), overhead: &StepWork) {
        self.wall += wall.elapsed().saturating_sub(overhead.wall);
        self.cpu += thread_cpu_time()
            .saturating_sub(cpu)
            .saturating_sub(overhead.cpu);
    }

    /// What measuring an empty piece of work takes (the median of many): the clock reads'
    /// own cost, which is not transfer work. The thread CPU clock is a system call, about a
    /// microsecond on a virtual machine: without this, a step's reading of its events would
    /// look several times its real cost, the same in push and pull.
    fn overhead() -> StepWork {
        let mut walls = Vec::with_capacity(2001);
        let mut cpus = Vec::with_capacity(2001);
        for _ in 0..2001 {
            let mut empty = StepWork::default();
            empty.add_since(Self::mark(), &StepWork::default());
            walls.push(empty.wall);
            cpus.push(empty.cpu);
        }
        walls.sort_unstable();
        cpus.sort_unstable();
        StepWork {
            wall: walls[walls.len() / 2],
            cpu: cpus[cpus.len() / 2],
        }
    }
}

/// CPU time so far of this process's connector threads (named `kvx-…`: the connector's driver
/// and control threads, the transports' copy and posting threads), in nanoseconds, by thread
/// name, from `/proc/self/task/*/schedstat`: the transfer work that competes with the engine
/// loop for the decode instance's cores (threads that ended are no longer counted). `None`
/// where the kernel does not say.
/// Threads that serve or export what the connector records, not the connector.
const OBSERVABILITY_THREADS: [&str; 2] = ["kvx-metrics", "kvx-otlp"];

fn connector_cpu_ns() -> Option<HashMap<String, u64>> {
    let mut by_thread = HashMap::new();
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let dir = task.path();
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue; // the thread ended meanwhile
        };
        let comm = comm.trim_end();
        if !comm.starts_with("kvx-") {
            continue;
        }
        let Ok(schedstat) = std::fs::read_to_string(dir.join("schedstat")) else {
            continue;
        };
        let Some(ns) = schedstat
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        *by_thread.entry(comm.to_owned()).or_default() += ns;
    }
    Some(by_thread)
}

/// A `S TRANSFER ATTEMPT MICROS` line from prefill: when a push request's writes had landed.
fn landed_line(line: &str) -> anyhow::Result<Option<(AttemptKey, u64)>> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let ["S", transfer, attempt, at] = f.as_slice() else {
        return Ok(None);
    };
    Ok(Some((parse_key(transfer, attempt)?, at.parse()?)))
}

/// A request's key as prefill's lines carry it: the transfer id in hex, then the attempt.
fn parse_key(transfer: &str, attempt: &str) -> anyhow::Result<AttemptKey> {
    Ok(AttemptKey::new(
        TransferId(u128::from_str_radix(transfer, 16)?),
        Attempt(attempt.parse()?),
    ))
}
