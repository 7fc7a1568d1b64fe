//! `kvx pd prefill`: the prefill instance of the pair.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use kvx_core::{Attempt, BlockId, EngineId, RequestId, TransferId};
use kvx_layout::synth::{for_each_head_vector, for_each_head_vector_in, head_vector};
use kvx_layout::Layout;
use kvx_rdma::region::{HostBuffer, LocalRegion};
use kvx_rendezvous::AttemptKey;
use kvx_vllm::{ConnectorConfig, KvCache, Producer, TransportSpec};

use super::{unix_micros, BlockPool, ModelArgs};

/// Arguments of `kvx pd prefill`.
#[derive(clap::Args, Debug)]
pub(crate) struct PrefillArgs {
    /// kvx control address of rank 0 (rank r listens on port + r).
    #[arg(long, default_value = "127.0.0.1:7100")]
    pub(crate) listen: SocketAddr,
    /// Side channel for the request stream (the router's connection).
    #[arg(long, default_value = "127.0.0.1:7200")]
    pub(crate) bench_listen: SocketAddr,
    /// Simulated prefill compute per prompt token, in microseconds.
    #[arg(long, default_value_t = 20.0)]
    pub(crate) per_token_us: f64,
    /// Chunked prefill: tokens computed per engine step (0: the whole prompt in one step). In
    /// push mode each finished chunk is reported to the connector, which writes it to a
    /// registered decode while the next chunk computes.
    #[arg(long, default_value_t = 1024)]
    pub(crate) chunk_tokens: u64,
    /// Push: compute each step layer by layer and report every finished layer to the
    /// connector, which writes it while the next layers compute (as an engine with per-layer
    /// hooks does); `false`: report whole steps only.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub(crate) layer_progress: bool,
    /// Seconds finished blocks wait for their registration (push) or read (pull).
    #[arg(long, default_value_t = 30)]
    pub(crate) lease_s: u64,
    /// Seconds to wait for the router to connect before giving up.
    #[arg(long, default_value_t = 120)]
    pub(crate) router_timeout_s: u64,
    #[command(flatten)]
    pub(crate) model: ModelArgs,
}

/// A rank's cache memory, kept for the synthetic engine to write into.
pub(crate) struct RankMemory {
    pub(crate) layout: Layout,
    pub(crate) buffers: Vec<Arc<HostBuffer>>,
}

impl RankMemory {
    pub(crate) fn new(spec: kvx_core::LayoutSpec) -> anyhow::Result<(Self, KvCache)> {
        let layout = Layout::new(spec.clone()).context("invalid layout")?;
        let buffers = (0..layout.region_count())
            .map(|_| HostBuffer::new(layout.region_len() as usize).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()
            .context("cannot allocate the KV cache")?;
        // Touch every page now, as an engine that zeroes its cache does, so that page faults
        // never land on a transfer's critical path.
        for b in &buffers {
            b.fill_with(|_| 0);
        }
        let regions = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| LocalRegion::host(i as u32, Arc::clone(b)))
            .collect();
        Ok((
            Self { layout, buffers },
            KvCache {
                layout: spec,
                regions,
            },
        ))
    }

    /// Writes the synthetic KV of `tokens` in `layers` into `blocks` (this rank's heads).
    pub(crate) fn fill(
        &self,
        blocks: &[BlockId],
        tokens: std::ops::Range<u64>,
        layers: std::ops::Range<u32>,
        seed: u64,
    ) -> anyhow::Result<()> {
        let hb = self.layout.head_bytes();
        let mut vector = vec![0u8; hb as usize];
        let mut result = Ok(());
        for_each_head_vector_in(&self.layout, blocks, tokens, layers, |v| {
            head_vector(seed, v.layer, v.kv, v.token, v.head, &mut vector);
            let buffer = &self.buffers[v.region as usize];
            result = v.runs(hb).try_for_each(|(at, from, len)| {
                buffer.write_at(at as usize, &vector[from as usize..(from + len) as usize])
            });
            result.is_ok()
        });
        Ok(result?)
    }

    /// Checks the synthetic KV of tokens `0..tokens` in `blocks`; returns the bytes checked, or
    /// the first wrong head vector.
    pub(crate) fn verify(&self, blocks: &[BlockId], tokens: u64, seed: u64) -> anyhow::Result<u64> {
        let hb = self.layout.head_bytes() as usize;
        let (mut expected, mut found) = (vec![0u8; hb], vec![0u8; hb]);
        let mut bytes = 0;
        let mut result = Ok(());
        for_each_head_vector(&self.layout, blocks, 0..tokens, |v| {
            head_vector(seed, v.layer, v.kv, v.token, v.head, &mut expected);
            let buffer = &self.buffers[v.region as usize];
            result = v
                .runs(hb as u64)
                .try_for_each(|(at, to, len)| {
                    buffer.read_at(at as usize, &mut found[to as usize..(to + len) as usize])
                })
                .map_err(anyhow::Error::from)
                .and_then(|()| {
                    if found == expected {
                        Ok(())
                    } else {
                        Err(anyhow::anyhow!("wrong KV: {v:?}"))
                    }
                });
            bytes += hb as u64;
            result.is_ok()
        });
        result.map(|()| bytes)
    }
}

/// The seed of a transfer's synthetic KV.
pub(crate) fn kv_seed(transfer: TransferId) -> u64 {
    (transfer.0 as u64) ^ ((transfer.0 >> 64) as u64)
}

struct Job {
    key: AttemptKey,
    tokens: u64,
    pull: bool,
}

fn parse_job(line: &str) -> anyhow::Result<Job> {
    let f: Vec<&str> = line.split_whitespace().collect();
    match f.as_slice() {
        ["P", transfer, attempt, tokens, mode] => Ok(Job {
            key: AttemptKey::new(
                TransferId(u128::from_str_radix(transfer, 16)?),
                Attempt(attempt.parse()?),
            ),
            tokens: tokens.parse()?,
            pull: match *mode {
                "push" => false,
                "pull" => true,
                m => bail!("unknown mode {m}"),
            },
        }),
        _ => bail!("malformed request line `{line}`"),
    }
}

/// Runs the prefill instance until the router disconnects.
pub(crate) fn run(args: &PrefillArgs) -> anyhow::Result<()> {
    let spec: TransportSpec = args.model.transport.parse()?;
    let mut memories = Vec::new();
    let mut producers = Vec::new();
    for rank in 0..args.model.tp {
        let (memory, cache) = RankMemory::new(args.model.layout(rank)?)?;
        let mut config = ConnectorConfig::new(EngineId(1));
        config.listen = kvx_vllm::rank_addr(args.listen, kvx_core::Rank(rank));
        config.producer_lease = Duration::from_secs(args.lease_s);
        args.model.apply_settings(&mut config)?;
        let listen = config.listen.ip();
        let rails = super::rail_overrides(&args.model.rails)?;
        let transport =
            super::open_transport(&spec, |o| o.reached_at(listen).with_rail_overrides(rails))?;
        producers
            .push(Producer::start(config, cache, transport).context("cannot start the producer")?);
        memories.push(memory);
    }
    let listener = TcpListener::bind(args.bench_listen)
        .with_context(|| format!("cannot listen on {}", args.bench_listen))?;
    eprintln!(
        "kvx pd prefill: {} rank(s) on {} ({}), waiting for the router on {}",
        args.model.tp, args.listen, spec, args.bench_listen
    );
    // Wait for the router, but not forever.
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + Duration::from_secs(args.router_timeout_s);
    let stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                bail!("no router connected within {} s", args.router_timeout_s)
            }
            Err(e) => return Err(e).context("accepting the router failed"),
        }
    };
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    let mut reply = stream.try_clone()?;
    let (tx, rx) = mpsc::channel::<Option<String>>();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            match line {
                Ok(l) => {
                    if tx.send(Some(l)).is_err() {
                        return;
                    }
                }
                Err(_) => break,
            }
        }
        let _ = tx.send(None);
    });

    let mut pool = BlockPool::new(args.model.blocks);
    let mut queue: VecDeque<Job> = VecDeque::new();
    // Blocks of finished requests, freed when every rank has let go of them, with whether
    // they are pushed and when the last rank's writes had all landed.
    let mut outstanding: HashMap<AttemptKey, Outstanding> = HashMap::new();
    let mut router_open = true;
    let (mut served, mut sent, mut not_sent) = (0u64, 0u64, 0u64);
    while router_open || !queue.is_empty() || !outstanding.is_empty() {
        for producer in &producers {
            for (done, at) in producer.take_finished_timed() {
                let delivered = done.outcome == kvx_vllm::SendOutcome::Sent;
                if delivered {
                    sent += 1;
                } else {
                    not_sent += 1;
                }
                let Some(entry) = outstanding.get_mut(&done.key) else {
                    continue;
                };
                entry.ranks -= 1;
                entry.delivered &= delivered;
                entry.landed = entry.landed.max(at);
                if entry.ranks > 0 {
                    continue;
                }
                let entry = outstanding.remove(&done.key).expect("present");
                pool.free(entry.blocks);
                if entry.push && entry.delivered && router_open {
                    // When the KV was in decode's memory, by prefill's account: a decode that
                    // reads its notices only at its engine steps learns it later.
                    let at_us = entry
                        .landed
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_micros() as u64);
                    let line = format!(
                        "S {:x} {} {at_us}\n",
                        done.key.transfer.0, done.key.attempt.0
                    );
                    if reply.write_all(line.as_bytes()).is_err() {
                        router_open = false;
                        queue.clear();
                    }
                }
            }
        }
        let wait = if queue.is_empty() {
            Duration::from_millis(2)
        } else {
            Duration::ZERO
        };
        if !router_open {
            std::thread::sleep(wait);
        }
        match rx.recv_timeout(wait) {
            Ok(Some(line)) => queue.push_back(parse_job(&line)?),
            Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                // The router is gone: its queued requests are moot; what is held drains.
                router_open = false;
                queue.clear();
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        let Some(job) = queue.front() else { continue };
        let needed = job.tokens.div_ceil(u64::from(args.model.block_tokens)) as usize;
        let Some(blocks) = pool.alloc(needed) else {
            if outstanding.is_empty() {
                bail!(
                    "a {}-token request needs more blocks than the cache has",
                    job.tokens
                );
            }
            continue; // wait for frees
        };
        let job = queue.pop_front().expect("front exists");
        let chunk = match args.chunk_tokens {
            0 => job.tokens,
            n => n,
        };
        let num_layers = memories[0].layout.spec().num_layers;
        let layered = args.layer_progress && !job.pull;
        let parts = if layered { num_layers } else { 1 };
        let mut computed = 0;
        while computed < job.tokens {
            let started = Instant::now();
            let next = (computed + chunk).min(job.tokens);
            let compute =
                Duration::from_secs_f64((next - computed) as f64 * args.per_token_us / 1e6);
            for part in 0..parts {
                let layers = if layered {
                    part..part + 1
                } else {
                    0..num_layers
                };
                for memory in &memories {
                    memory.fill(
                        &blocks,
                        computed..next,
                        layers.clone(),
                        kv_seed(job.key.transfer),
                    )?;
                }
                // The step's compute time, spread evenly over its layers.
                if let Some(rest) = (compute * (part + 1) / parts).checked_sub(started.elapsed()) {
                    std::thread::sleep(rest);
                }
                if layered && part + 1 < num_layers {
                    let used = next.div_ceil(u64::from(args.model.block_tokens)) as usize;
                    for producer in &producers {
                        producer.request_layer_progress(
                            job.key,
                            blocks[..used].to_vec(),
                            next,
                            part + 1,
                        )?;
                    }
                }
            }
            computed = next;
            if !job.pull && computed < job.tokens {
                let used = computed.div_ceil(u64::from(args.model.block_tokens)) as usize;
                for producer in &producers {
                    producer.request_progress(job.key, blocks[..used].to_vec(), computed)?;
                }
            }
        }
        let done_at = unix_micros();
        for producer in &producers {
            let request = RequestId(job.key.transfer.0 as u64);
            if job.pull {
                producer.request_finished_pull(job.key, request, blocks.clone(), job.tokens)?;
            } else {
                producer.request_finished(job.key, request, blocks.clone(), job.tokens)?;
            }
        }
        let ids: Vec<String> = blocks.iter().map(|b| b.0.to_string()).collect();
        let line = format!(
            "D {:x} {} {} {}\n",
            job.key.transfer.0,
            job.key.attempt.0,
            done_at,
            ids.join(",")
        );
        if reply.write_all(line.as_bytes()).is_err() {
            // The router is gone: stop taking work, let what is held drain or expire.
            router_open = false;
            queue.clear();
        }
        outstanding.insert(
            job.key,
            Outstanding {
                blocks,
                ranks: args.model.tp,
                push: !job.pull,
                delivered: true,
                landed: std::time::UNIX_EPOCH,
            },
        );
        served += 1;
    }
    eprintln!("kvx pd prefill: served {served} requests; per-rank releases: {sent} sent, {not_sent} not sent");
    let (written, streamed) = producers.iter().fold((0, 0), |(w, e), p| {
        let s = p.stats();
        (w + s.bytes_written, e + s.bytes_streamed)
    });
    eprintln!(
        "kvx pd prefill: wrote {written} bytes, {streamed} of them while their request was computing"
    );
    for mut p in producers {
        p.shutdown();
    }
    Ok(())
}

/// Connects to the prefill's side channel, retrying until `timeout`.
pub(crate) fn connect_router(addr: SocketAddr, timeout: Duration) -> anyhow::Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                return Err(e).with_context(|| format!("prefill side channel {addr} not reachable"))
            }
        }
    }
}

/// A finished request whose blocks some producer rank still holds.
struct Outstanding {
    blocks: Vec<BlockId>,
    ranks: u32,
    push: bool,
    delivered: bool,
    landed: std::time::SystemTime,
}
