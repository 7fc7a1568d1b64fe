//! `kvx pd`: a prefill and a decode process with a synthetic engine, over a real transport.
//!
//! The synthetic engine stands in for the model: prefill "computes" a request by writing a
//! deterministic KV pattern (`kvx_layout::synth`) into its blocks and taking time proportional to
//! the prompt; decode runs a step loop that emits one token per running request per step. The
//! decode process is also the load generator and router: it sends each request to prefill over a
//! side channel and (push) registers its blocks at once, or (pull) reads them after prefill
//! reports its block ids. Decode verifies every received byte.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _};
use kvx_core::{Arrangement, Dtype, LayoutSpec, MemoryOrder};

pub(crate) mod decode;
pub(crate) mod gpu;
pub(crate) mod metrics;
pub(crate) mod prefill;
pub(crate) mod raw;

use gpu::{ComputeShape, Device};

/// Opens `spec` with what the operator asks for in the environment
/// ([`kvx_vllm::OpenOptions::from_environment`]: the binary reads it, the library does not) and
/// with `adjust` applied to the options (where the peers are).
pub(crate) fn open_transport(
    spec: &kvx_vllm::TransportSpec,
    adjust: impl FnOnce(kvx_vllm::OpenOptions) -> kvx_vllm::OpenOptions,
) -> Result<Box<dyn kvx_rdma::Transport>, kvx_vllm::TransportError> {
    let options = kvx_vllm::OpenOptions::from_environment(|k| std::env::var_os(k));
    spec.open_with(&adjust(options))
}

/// Serves `--metrics-listen`, if given, for `side`'s ranks.
pub(crate) fn serve_metrics(
    model: &ModelArgs,
    side: &'static str,
    readers: impl Iterator<Item = kvx_vllm::StatsReader>,
) -> anyhow::Result<()> {
    let Some(listen) = model.metrics_listen else {
        return Ok(());
    };
    let sides = readers
        .enumerate()
        .map(|(rank, stats)| metrics::Side {
            side,
            rank: rank as u32,
            stats,
        })
        .collect();
    let addr = metrics::serve(listen, sides)?;
    eprintln!("kvx pd {side}: metrics at http://{addr}/metrics");
    Ok(())
}

/// The rail overrides of `--rails`, else of `KVX_RAILS`.
pub(crate) fn rail_overrides(rails: &str) -> anyhow::Result<kvx_rdma::topology::RailOverrides> {
    let env = std::env::var_os(kvx_rdma::topology::RailOverrides::ENV_VAR);
    kvx_vllm::transport::rail_overrides(rails, env).context("--rails (or KVX_RAILS)")
}

/// Arguments of `kvx pd`.
#[derive(clap::Args, Debug)]
pub(crate) struct PdArgs {
    #[command(subcommand)]
    role: PdRole,
}

impl PdArgs {
    /// The service name of this side's request spans (`--otlp-endpoint`).
    pub(crate) fn service(&self) -> &'static str {
        match self.role {
            PdRole::Prefill(_) => "kvx-prefill",
            PdRole::Decode(_) => "kvx-decode",
            _ => "kvx",
        }
    }
}

#[derive(clap::Subcommand, Debug)]
enum PdRole {
    /// Run the prefill instance (serves until decode disconnects).
    Prefill(prefill::PrefillArgs),
    /// Run the decode instance and the request stream; prints and writes the results.
    Decode(decode::DecodeArgs),
    /// Time the bare transfer of one request's KV on the transport (no connector, no engine).
    Raw(raw::RawArgs),
    /// Measure the synthetic engine on a GPU: the bf16 product rate, a prefill against its FLOP
    /// count at that rate, decode steps (one JSON object).
    Engine(EngineArgs),
}

/// Arguments of `kvx pd engine`.
#[derive(clap::Args, Debug)]
pub(crate) struct EngineArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens of the timed prefill.
    #[arg(long, default_value_t = 1024)]
    input_tokens: u64,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = 1024)]
    chunk_tokens: u64,
}

fn engine(args: &EngineArgs) -> anyhow::Result<()> {
    let Device::Cuda(ordinal) = args.model.device()? else {
        bail!("kvx pd engine measures the GPU engine: pass --device cuda[:N]");
    };
    let gpu = kvx_rdma::cuda::Gpu::open(ordinal).context("opening the GPU")?;
    let engine = gpu::GpuEngine::new(
        &gpu,
        args.model.shape()?,
        args.chunk_tokens.max(8192),
        args.input_tokens.max(1024),
        32,
    )?;
    let report = engine.calibrate(args.input_tokens, args.chunk_tokens)?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// Runs `kvx pd`.
pub(crate) fn run(args: &PdArgs) -> anyhow::Result<()> {
    match &args.role {
        PdRole::Prefill(a) => prefill::run(a),
        PdRole::Decode(a) => decode::run(a),
        PdRole::Raw(a) => raw::run(a),
        PdRole::Engine(a) => engine(a),
    }
}

/// The synthetic model's KV shape, shared by both processes' flags.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct ModelArgs {
    /// Model shape: `qwen2.5-0.5b` (24 layers, 2 KV heads, head dim 64, bf16: 12 KiB of KV per
    /// token), `tiny` (2 layers, 4 KV heads, head dim 16, f32: 1 KiB), `qwen3-32b-tp8` (one rank
    /// of Qwen3-32B at TP8: 64 layers, hidden 5120, 8 query heads and 1 KV head of 128, MLP
    /// 25600/8, bf16: 32 KiB) or `qwen3-8b-tp1` (36 layers, hidden 4096, 32 query and 8 KV heads
    /// of 128, MLP 12288, bf16: 144 KiB).
    #[arg(long, default_value = "qwen2.5-0.5b")]
    pub(crate) model: String,
    /// Where the KV cache lives and the engine computes: `host` (compute simulated by
    /// `--per-token-us` and `--step-ms`), or `cuda[:N]` (the cache in GPU memory, prefill and
    /// decode steps as cuBLAS products at the model's shape, decode's checks on the GPU).
    #[arg(long, default_value = "host")]
    pub(crate) device: String,
    /// Layers (overrides the model's).
    #[arg(long)]
    pub(crate) layers: Option<u32>,
    /// KV heads of the instance, split over `--tp` (overrides the model's).
    #[arg(long)]
    pub(crate) kv_heads: Option<u32>,
    /// Head dimension (overrides the model's).
    #[arg(long)]
    pub(crate) head_dim: Option<u32>,
    /// Hidden size (overrides the model's; GPU compute only).
    #[arg(long)]
    pub(crate) hidden: Option<u64>,
    /// Query heads of the instance, split over `--tp` (overrides the model's; GPU compute only).
    #[arg(long)]
    pub(crate) q_heads: Option<u64>,
    /// MLP intermediate size of the instance, split over `--tp` (overrides the model's; GPU
    /// compute only).
    #[arg(long)]
    pub(crate) mlp: Option<u64>,
    /// Tensor-parallel size of this instance (ranks run as threads of one process).
    #[arg(long, default_value_t = 1)]
    pub(crate) tp: u32,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub(crate) block_tokens: u32,
    /// Blocks in each rank's cache.
    #[arg(long, default_value_t = 4096)]
    pub(crate) blocks: u32,
    /// Memory order: nhd, hnd or hnd-kt.
    #[arg(long, default_value = "hnd")]
    pub(crate) order: String,
    /// Transport: auto (libfabric:shm for a host cache, cuda-ipc on the cache's GPU for a CUDA
    /// one), libfabric:shm, cma, libfabric:tcp[@IFACE], libfabric:auto, nixl[:ucx|:libfabric]
    /// [@IFACE], cuda-ipc[:N], loopback.
    #[arg(long, default_value = "auto")]
    pub(crate) transport: String,
    /// RDMA NICs for named GPUs, `GPU=NIC,NIC;…` by PCI address (as `kvx topo --override`);
    /// the rule (NICs behind the GPU's PCIe switch, else its NUMA node's) for the others.
    /// Empty: KVX_RAILS, else the rule everywhere.
    #[arg(long, default_value = "")]
    pub(crate) rails: String,
    /// The deployment key (`kvx keygen PATH`): every control connection is authenticated and
    /// encrypted with it. Needed (or `--allow-unauthenticated`) where prefill listens on a
    /// non-loopback address.
    #[arg(long, env = "KVX_AUTH_KEY_FILE")]
    pub(crate) auth_key_file: Option<std::path::PathBuf>,
    /// Prefill: listen on a non-loopback address without a key (anyone who reaches it can
    /// join the transfers).
    #[arg(long)]
    pub(crate) allow_unauthenticated: bool,
    /// Serve the connector's counters as Prometheus series at `http://HOST:PORT/metrics`.
    #[arg(long)]
    pub(crate) metrics_listen: Option<std::net::SocketAddr>,
    /// A connector setting, KEY=VALUE (`kvx settings` lists them; those of the vLLM plugin's
    /// own are refused); repeatable, applied after the other flags.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub(crate) settings: Vec<String>,
}

impl ModelArgs {
    /// Applies the key flags and the `--set` settings to `config`.
    pub(crate) fn apply_settings(
        &self,
        config: &mut kvx_vllm::ConnectorConfig,
    ) -> anyhow::Result<()> {
        use kvx_vllm::settings;
        if let Some(path) = &self.auth_key_file {
            config.auth_key = Some(std::sync::Arc::new(kvx_vllm::AuthKey::load(path)?));
        }
        config.allow_unauthenticated = self.allow_unauthenticated;
        for entry in &self.settings {
            let (key, value) = entry
                .split_once('=')
                .with_context(|| format!("--set {entry}: expected KEY=VALUE"))?;
            let value = settings::parse(key, settings::Raw::Text(value))?;
            settings::apply(config, key, &value)?;
        }
        Ok(())
    }

    /// The flags that give another process this model, cache and transport (not `--tp`,
    /// `--rails` or `--set`).
    pub(crate) fn to_args(&self) -> Vec<String> {
        let mut out: Vec<String> = [
            ("--model", self.model.clone()),
            ("--device", self.device.clone()),
            ("--transport", self.transport.clone()),
            ("--blocks", self.blocks.to_string()),
            ("--block-tokens", self.block_tokens.to_string()),
            ("--order", self.order.clone()),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_owned(), value])
        .collect();
        if let Some(path) = &self.auth_key_file {
            out.extend(["--auth-key-file".to_owned(), path.display().to_string()]);
        }
        let overrides = [
            ("--layers", self.layers.map(u64::from)),
            ("--kv-heads", self.kv_heads.map(u64::from)),
            ("--head-dim", self.head_dim.map(u64::from)),
            ("--hidden", self.hidden),
            ("--q-heads", self.q_heads),
            ("--mlp", self.mlp),
        ];
        for (flag, value) in overrides {
            if let Some(v) = value {
                out.extend([flag.to_owned(), v.to_string()]);
            }
        }
        out
    }

    /// The model preset, with the explicit flags applied.
    fn preset(&self) -> anyhow::Result<Preset> {
        let mut p = match self.model.as_str() {
            "qwen2.5-0.5b" => Preset::new(24, 2, 64, Dtype::Bf16, 896, 14, 4864),
            "tiny" => Preset::new(2, 4, 16, Dtype::F32, 64, 4, 128),
            "qwen3-32b-tp8" => Preset::new(64, 1, 128, Dtype::Bf16, 5120, 8, 3200),
            "qwen3-8b-tp1" => Preset::new(36, 8, 128, Dtype::Bf16, 4096, 32, 12288),
            other => {
                bail!("unknown model `{other}` (qwen2.5-0.5b, tiny, qwen3-32b-tp8, qwen3-8b-tp1)")
            }
        };
        p.layers = self.layers.unwrap_or(p.layers);
        p.kv_heads = self.kv_heads.unwrap_or(p.kv_heads);
        p.head_dim = self.head_dim.unwrap_or(p.head_dim);
        p.hidden = self.hidden.unwrap_or(p.hidden);
        p.q_heads = self.q_heads.unwrap_or(p.q_heads);
        p.mlp = self.mlp.unwrap_or(p.mlp);
        if p.layers == 0 || p.kv_heads == 0 || p.head_dim == 0 || p.hidden == 0 || p.q_heads == 0 {
            bail!("the model's layers, heads, head dimension and hidden size must not be 0");
        }
        Ok(p)
    }

    /// Where the cache lives (`--device`).
    pub(crate) fn device(&self) -> anyhow::Result<Device> {
        self.device.parse()
    }

    /// The transport for this cache: `--transport`, with `auto` and `cuda-ipc` resolved for the
    /// device, and a transport that cannot move the cache's memory refused.
    pub(crate) fn transport(&self) -> anyhow::Result<kvx_vllm::TransportSpec> {
        let setting =
            kvx_vllm::transport::resolve_for_cache(&self.transport, self.device()?.cuda())
                .context("--transport")?;
        Ok(setting.parse()?)
    }

    /// One rank's compute shape: the model's query heads, KV heads and MLP split over `--tp`.
    pub(crate) fn shape(&self) -> anyhow::Result<ComputeShape> {
        let p = self.preset()?;
        let tp = u64::from(self.tp.max(1));
        Ok(ComputeShape {
            layers: p.layers,
            hidden: p.hidden,
            q_heads: p.q_heads.div_ceil(tp),
            kv_heads: u64::from(p.kv_heads).div_ceil(tp),
            head_dim: u64::from(p.head_dim),
            mlp: p.mlp.div_ceil(tp),
        })
    }

    /// The layout of rank `rank`.
    pub(crate) fn layout(&self, rank: u32) -> anyhow::Result<LayoutSpec> {
        let p = self.preset()?;
        let order: MemoryOrder = self.order.parse()?;
        Ok(LayoutSpec {
            num_layers: p.layers,
            total_kv_heads: p.kv_heads,
            head_dim: p.head_dim,
            dtype: p.dtype,
            mla: false,
            block_tokens: self.block_tokens,
            num_blocks: self.blocks,
            tp_size: self.tp,
            tp_rank: rank,
            order,
            arrangement: Arrangement::PerLayerSplit,
        })
    }

    /// KV bytes per token of the whole model.
    pub(crate) fn bytes_per_token(&self) -> anyhow::Result<u64> {
        let l = self.layout(0)?;
        Ok(u64::from(l.num_layers)
            * 2
            * u64::from(l.total_kv_heads)
            * u64::from(l.head_dim)
            * u64::from(l.dtype.size()))
    }
}

/// A model's shapes: the KV cache's and the compute's.
#[derive(Clone, Copy, Debug)]
struct Preset {
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    dtype: Dtype,
    hidden: u64,
    q_heads: u64,
    mlp: u64,
}

impl Preset {
    #[allow(clippy::too_many_arguments)]
    fn new(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype: Dtype,
        hidden: u64,
        q_heads: u64,
        mlp: u64,
    ) -> Self {
        Self {
            layers,
            kv_heads,
            head_dim,
            dtype,
            hidden,
            q_heads,
            mlp,
        }
    }
}

/// Microseconds since the Unix epoch: comparable between the two processes of one machine.
pub(crate) fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_micros() as u64
}

/// A fixed-capacity block allocator (ids 0..n), the same ids on every rank of an instance. Like
/// vLLM's free-block queue it is first-in first-out: freed blocks go to the back, so requests
/// walk through the whole cache (and its bytes are not still in the CPU's caches when reused).
#[derive(Debug)]
pub(crate) struct BlockPool {
    free: std::collections::VecDeque<kvx_core::BlockId>,
}

impl BlockPool {
    pub(crate) fn new(blocks: u32) -> Self {
        Self {
            free: (0..blocks).map(kvx_core::BlockId).collect(),
        }
    }

    /// The `n` blocks at the front of the free queue, or `None` if too few are free.
    pub(crate) fn alloc(&mut self, n: usize) -> Option<Vec<kvx_core::BlockId>> {
        (self.free.len() >= n).then(|| self.free.drain(..n).collect())
    }

    pub(crate) fn free(&mut self, blocks: Vec<kvx_core::BlockId>) {
        self.free.extend(blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(settings: &[&str]) -> ModelArgs {
        ModelArgs {
            model: "tiny".into(),
            device: "host".into(),
            layers: None,
            kv_heads: None,
            head_dim: None,
            hidden: None,
            q_heads: None,
            mlp: None,
            tp: 1,
            block_tokens: 16,
            blocks: 64,
            order: "hnd".into(),
            transport: "loopback".into(),
            rails: String::new(),
            auth_key_file: None,
            allow_unauthenticated: false,
            metrics_listen: None,
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn rails_come_from_the_flag_else_the_environment() {
        let o = rail_overrides("0000:53:00.0=rdmap79s0,rdmap80s0").unwrap();
        assert_eq!(o.len(), 1);
        let err = rail_overrides("0000:53:00.0").unwrap_err();
        assert!(format!("{err:#}").contains("--rails"), "{err:#}");
    }

    #[test]
    fn set_flags_go_through_the_settings_table() {
        let mut config = kvx_vllm::ConnectorConfig::new(kvx_core::EngineId(1));
        model(&["producer_lease_s=2.5", "max_entries=7"])
            .apply_settings(&mut config)
            .unwrap();
        assert_eq!(config.producer_lease, Duration::from_millis(2500));
        assert_eq!(config.max_entries, 7);
        for bad in ["seal=true", "nope=1", "producer_lease_s=soon", "no-equals"] {
            let e = model(&[bad]).apply_settings(&mut config).unwrap_err();
            assert!(!format!("{e:#}").is_empty(), "{bad}");
        }
    }
}
