//! `kvx pd prefill`: the prefill instance of the pair.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use kvx_core::{Attempt, BlockId, EngineId, RequestId, TransferId};
use kvx_layout::synth::{for_each_head_vector, for_each_head_vector_in, head_vector};
use kvx_layout::Layout;
use kvx_rdma::cuda::synth::SynthKv;
use kvx_rdma::cuda::{DeviceBuffer, Event as GpuEvent, Gpu, Stream};
use kvx_rdma::region::{HostBuffer, LocalRegion};
use kvx_rendezvous::AttemptKey;
use kvx_vllm::{ConnectorConfig, KvCache, Producer, TransportSpec};

use super::gpu::{Device, GpuEngine};
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
    /// Serve one router after another until killed: when a router goes, what it left held
    /// drains and the next may connect (a restarted decode). Without it prefill exits once its
    /// router is gone and nothing is held.
    #[arg(long)]
    pub(crate) keep_serving: bool,
    /// The longest prompt the GPU engine is sized for (`--device cuda`).
    #[arg(long, default_value_t = 16384)]
    pub(crate) max_tokens: u64,
    #[command(flatten)]
    pub(crate) model: ModelArgs,
}

/// A rank's cache memory, kept for the synthetic engine to write into.
pub(crate) struct RankMemory {
    pub(crate) layout: Layout,
    memory: Memory,
}

enum Memory {
    Host(Vec<Arc<HostBuffer>>),
    Cuda(Box<GpuCache>),
}

/// A cache in GPU memory with its pattern kernels and a stream of their own (decode's checks,
/// `kvx pd raw --fresh-source`); the prefill engine launches them on its own stream.
pub(crate) struct GpuCache {
    pub(crate) synth: Mutex<SynthKv>,
    stream: Mutex<Stream>,
}

impl RankMemory {
    /// Allocates a rank's cache for `spec` on `device`, every page touched (as an engine that
    /// zeroes its cache does, so that page faults never land on a transfer's critical path).
    pub(crate) fn new(
        spec: kvx_core::LayoutSpec,
        device: Device,
    ) -> anyhow::Result<(Self, KvCache)> {
        let layout = Layout::new(spec.clone()).context("invalid layout")?;
        let (memory, regions) = match device {
            Device::Host => {
                let buffers = (0..layout.region_count())
                    .map(|_| HostBuffer::new(layout.region_len() as usize).map(Arc::new))
                    .collect::<Result<Vec<_>, _>>()
                    .context("cannot allocate the KV cache")?;
                for b in &buffers {
                    b.fill_with(|_| 0);
                }
                let regions = buffers
                    .iter()
                    .enumerate()
                    .map(|(i, b)| LocalRegion::host(i as u32, Arc::clone(b)))
                    .collect();
                (Memory::Host(buffers), regions)
            }
            Device::Cuda(ordinal) => {
                let gpu =
                    Gpu::open(ordinal).with_context(|| format!("opening CUDA device {ordinal}"))?;
                let need = layout.region_len() * u64::from(layout.region_count());
                let (free, total) = gpu.memory_info()?;
                if need > free {
                    bail!(
                        "the KV cache of {} blocks needs {:.1} GiB on CUDA device {ordinal}, which \
                         has {:.1} GiB free of {:.1}: lower --blocks",
                        spec.num_blocks,
                        need as f64 / f64::from(1 << 30),
                        free as f64 / f64::from(1 << 30),
                        total as f64 / f64::from(1 << 30)
                    );
                }
                let buffers = (0..layout.region_count())
                    .map(|_| DeviceBuffer::new(&gpu, layout.region_len()).map(Arc::new))
                    .collect::<Result<Vec<_>, _>>()
                    .context("cannot allocate the KV cache in GPU memory")?;
                let regions = buffers
                    .iter()
                    .enumerate()
                    .map(|(i, b)| LocalRegion::cuda(i as u32, Arc::clone(b)))
                    .collect();
                let synth = SynthKv::new(&layout, buffers).context("the synthetic KV kernels")?;
                let cache = GpuCache {
                    synth: Mutex::new(synth),
                    stream: Mutex::new(Stream::new(&gpu)?),
                };
                (Memory::Cuda(Box::new(cache)), regions)
            }
        };
        Ok((
            Self { layout, memory },
            KvCache {
                layout: spec,
                regions,
            },
        ))
    }

    /// The cache's GPU side, when it is in GPU memory.
    pub(crate) fn gpu(&self) -> Option<&GpuCache> {
        match &self.memory {
            Memory::Cuda(c) => Some(c),
            Memory::Host(_) => None,
        }
    }

    /// Writes the synthetic KV of `tokens` in `layers` into `blocks` (this rank's heads), and
    /// waits for it.
    pub(crate) fn fill(
        &self,
        blocks: &[BlockId],
        tokens: std::ops::Range<u64>,
        layers: std::ops::Range<u32>,
        seed: u64,
    ) -> anyhow::Result<()> {
        let buffers = match &self.memory {
            Memory::Host(b) => b,
            Memory::Cuda(c) => {
                return c.with_blocks(blocks, |stream, synth| {
                    synth.fill(stream, tokens, layers, seed)?;
                    Ok(stream.synchronize()?)
                });
            }
        };
        let hb = self.layout.head_bytes();
        let mut vector = vec![0u8; hb as usize];
        let mut result = Ok(());
        for_each_head_vector_in(&self.layout, blocks, tokens, layers, |v| {
            head_vector(seed, v.layer, v.kv, v.token, v.head, &mut vector);
            let buffer = &buffers[v.region as usize];
            result = v.runs(hb).try_for_each(|(at, from, len)| {
                buffer.write_at(at as usize, &vector[from as usize..(from + len) as usize])
            });
            result.is_ok()
        });
        Ok(result?)
    }

    /// Checks the synthetic KV of tokens `0..tokens` in `blocks`; returns the bytes checked, or
    /// the first wrong head vector (host memory) or the count of wrong words (GPU memory, where
    /// one kernel checks every byte and only its count comes back).
    pub(crate) fn verify(&self, blocks: &[BlockId], tokens: u64, seed: u64) -> anyhow::Result<u64> {
        let hb = self.layout.head_bytes() as usize;
        let buffers = match &self.memory {
            Memory::Host(b) => b,
            Memory::Cuda(c) => {
                let bad = c.with_blocks(blocks, |stream, synth| {
                    Ok(synth.verify(stream, tokens, seed)?)
                })?;
                if bad > 0 {
                    bail!("wrong KV: {bad} 8-byte words differ from the pattern");
                }
                let l = &self.layout;
                return Ok(tokens
                    * u64::from(l.spec().num_layers)
                    * u64::from(l.kv_parts())
                    * u64::from(l.local_heads())
                    * hb as u64);
            }
        };
        let (mut expected, mut found) = (vec![0u8; hb], vec![0u8; hb]);
        let mut bytes = 0;
        let mut result = Ok(());
        for_each_head_vector(&self.layout, blocks, 0..tokens, |v| {
            head_vector(seed, v.layer, v.kv, v.token, v.head, &mut expected);
            let buffer = &buffers[v.region as usize];
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

impl GpuCache {
    /// Runs `f` on the cache's own stream with the kernels' block table set to `blocks`.
    fn with_blocks<T>(
        &self,
        blocks: &[BlockId],
        f: impl FnOnce(&Stream, &mut SynthKv) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let stream = lock(&self.stream);
        let mut synth = lock(&self.synth);
        synth.load_blocks(&stream, blocks)?;
        f(&stream, &mut synth)
    }
}

/// Locks `m`, whatever an earlier holder's panic left (the kernels' state stays consistent:
/// each call loads what it uses).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The seed of a transfer's synthetic KV.
pub(crate) fn kv_seed(transfer: TransferId) -> u64 {
    (transfer.0 as u64) ^ ((transfer.0 >> 64) as u64)
}

struct Job {
    key: AttemptKey,
    tokens: u64,
    pull: bool,
    /// The router's trace of the request (`kvx pd decode` traces where it exports spans).
    trace: Option<kvx_vllm::trace::TraceContext>,
}

/// `P TRANSFER ATTEMPT TOKENS MODE [TRACEPARENT]`: a request from the router.
fn parse_job(line: &str) -> anyhow::Result<Job> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let (transfer, attempt, tokens, mode, trace) = match f.as_slice() {
        ["P", transfer, attempt, tokens, mode] => (transfer, attempt, tokens, mode, None),
        ["P", transfer, attempt, tokens, mode, trace] => {
            (transfer, attempt, tokens, mode, Some(trace.parse()?))
        }
        _ => bail!("malformed request line `{line}`"),
    };
    Ok(Job {
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
        trace,
    })
}

/// Runs the prefill instance until the router disconnects.
pub(crate) fn run(args: &PrefillArgs) -> anyhow::Result<()> {
    let spec: TransportSpec = args.model.transport()?;
    let device = args.model.device()?;
    let mut memories = Vec::new();
    let mut producers = Vec::new();
    for rank in 0..args.model.tp {
        let (memory, cache) = RankMemory::new(args.model.layout(rank)?, device)?;
        let mut config = ConnectorConfig::new(EngineId(1));
        config.listen = kvx_vllm::rank_addr(args.listen, kvx_core::Rank(rank));
        config.producer_lease = Duration::from_secs(args.lease_s);
        args.model.apply_settings(&mut config)?;
        let listen = config.listen.ip();
        let rails = super::rail_overrides(&args.model.rails)?;
        let transport = super::open_transport(&spec, |o| {
            o.reached_at(listen)
                .with_rail_overrides(rails)
                .for_cuda_device(device.cuda())
        })?;
        producers
            .push(Producer::start(config, cache, transport).context("cannot start the producer")?);
        memories.push(memory);
    }
    super::serve_metrics(
        &args.model,
        "prefill",
        producers.iter().map(Producer::stats_reader),
    )?;
    let engine = match device {
        Device::Host => None,
        Device::Cuda(ordinal) => {
            let gpu = Gpu::open(ordinal)?;
            let chunk = if args.chunk_tokens == 0 {
                args.max_tokens
            } else {
                args.chunk_tokens
            };
            let engine = GpuEngine::new(&gpu, args.model.shape()?, chunk, args.max_tokens, 1)?;
            let events = (0..engine.shape().layers)
                .map(|_| GpuEvent::new(&gpu))
                .collect::<Result<Vec<_>, _>>()?;
            Some((engine, events))
        }
    };
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
    let (mut reply, mut rx) = router_lines(stream)?;

    let mut pool = BlockPool::new(args.model.blocks);
    let mut queue: VecDeque<Job> = VecDeque::new();
    // Blocks of finished requests, freed when every rank has let go of them, with whether
    // they are pushed and when the last rank's writes had all landed.
    let mut outstanding: HashMap<AttemptKey, Outstanding> = HashMap::new();
    let mut router_open = true;
    let (mut served, mut sent, mut not_sent) = (0u64, 0u64, 0u64);
    while args.keep_serving || router_open || !queue.is_empty() || !outstanding.is_empty() {
        if !router_open && args.keep_serving {
            // The next router (a restarted decode), once one connects.
            if let Ok((stream, _)) = listener.accept() {
                (reply, rx) = router_lines(stream)?;
                router_open = true;
                eprintln!("kvx pd prefill: a router connected");
            }
        }
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
        if let Some(trace) = job.trace {
            for producer in &producers {
                producer.trace(job.key.transfer, trace)?;
            }
        }
        let chunk = match args.chunk_tokens {
            0 => job.tokens,
            n => n,
        };
        let num_layers = memories[0].layout.spec().num_layers;
        let layered = args.layer_progress && !job.pull;
        let parts = if layered { num_layers } else { 1 };
        let mut computed = 0;
        if let Some((engine, events)) = &engine {
            if job.tokens > args.max_tokens {
                bail!(
                    "a {}-token request is longer than the GPU engine's --max-tokens {}",
                    job.tokens,
                    args.max_tokens
                );
            }
            let step = GpuStep {
                engine,
                events,
                memories: &memories,
                producers: &producers,
                job: &job,
                blocks: &blocks,
                block_tokens: u64::from(args.model.block_tokens),
                layered,
            };
            step.run(chunk)?;
            computed = job.tokens;
        }
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

/// The router's connection `stream` as prefill uses it: the stream to reply on, and its request
/// lines (`None` once it closed) from a reader thread.
fn router_lines(stream: TcpStream) -> anyhow::Result<(TcpStream, mpsc::Receiver<Option<String>>)> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    let reply = stream.try_clone()?;
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
    Ok((reply, rx))
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

/// One request's prefill on the GPU engine: per chunk, every layer's products then its KV
/// (the pattern, where the model's K and V projections would write it), each layer followed by
/// an event; the chunk's layers are reported to the producers as their events complete
/// (push), while the GPU computes the next ones.
struct GpuStep<'a> {
    engine: &'a GpuEngine,
    events: &'a [GpuEvent],
    memories: &'a [RankMemory],
    producers: &'a [Producer],
    job: &'a Job,
    blocks: &'a [BlockId],
    block_tokens: u64,
    layered: bool,
}

impl GpuStep<'_> {
    fn run(&self, chunk: u64) -> anyhow::Result<()> {
        let stream = self.engine.stream();
        let seed = kv_seed(self.job.key.transfer);
        let mut synths = Vec::new();
        for memory in self.memories {
            let cache = memory.gpu().context("a host cache with the GPU engine")?;
            let mut synth = lock(&cache.synth);
            synth.load_blocks(stream, self.blocks)?;
            synths.push(synth);
        }
        let num_layers = self.engine.shape().layers;
        let mut computed = 0;
        while computed < self.job.tokens {
            let next = (computed + chunk).min(self.job.tokens);
            for layer in 0..num_layers {
                for synth in &synths {
                    self.engine.layer(next - computed, 1, next)?;
                    synth.fill(stream, computed..next, layer..layer + 1, seed)?;
                }
                self.events[layer as usize].record(stream)?;
            }
            let used = next.div_ceil(self.block_tokens) as usize;
            if self.layered {
                for layer in 0..num_layers - 1 {
                    self.events[layer as usize].synchronize()?;
                    for producer in self.producers {
                        producer.request_layer_progress(
                            self.job.key,
                            self.blocks[..used].to_vec(),
                            next,
                            layer + 1,
                        )?;
                    }
                }
            }
            stream.synchronize()?;
            computed = next;
            if !self.job.pull && computed < self.job.tokens {
                for producer in self.producers {
                    producer.request_progress(
                        self.job.key,
                        self.blocks[..used].to_vec(),
                        computed,
                    )?;
                }
            }
        }
        Ok(())
    }
}
