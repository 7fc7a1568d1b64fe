//! `kvx`: the command-line tool of kvx.
//!
//! - `kvx plan`: print the transfer plan between a producer and a consumer layout;
//! - `kvx topo`: print each accelerator's PCIe placement and RDMA rails;
//! - `kvx pd prefill|decode`: a prefill/decode pair with a synthetic engine (`--set KEY=VALUE`
//!   for any connector setting);
//! - `kvx proxy`: the router in front of vLLM instances;
//! - `kvx settings`: the connector's settings, from the one table;
//! - `kvx keygen PATH`: a deployment key for authenticated control connections.

use clap::{Parser, Subcommand};

mod pd;
mod plan_cmd;
mod proxy;
mod settings_cmd;
mod topo;

/// kvx: push-based KV-cache transfer for disaggregated LLM serving.
#[derive(Parser, Debug)]
#[command(name = "kvx", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// An OpenTelemetry collector's OTLP/HTTP endpoint (`http://HOST:PORT`): request spans
    /// (`kvx proxy`'s dispatches, `kvx pd`'s transfers) are exported there. None: not exported.
    #[arg(long, global = true, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
}

// Parsed once per process: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Print the copy operations that move one request's KV from prefill to a decode rank.
    Plan(plan_cmd::PlanArgs),
    /// Print each accelerator's PCI address, NUMA node and the RDMA NICs (rails) it uses.
    Topo(topo::TopoArgs),
    /// A prefill/decode pair with a synthetic engine over a real transport.
    Pd(pd::PdArgs),
    /// An OpenAI-compatible router in front of prefill and decode vLLM instances (kvx connector).
    Proxy(proxy::ProxyArgs),
    /// List the connector's settings: key, what it takes, default, meaning.
    Settings(settings_cmd::SettingsArgs),
    /// Make a deployment key: 32 random bytes in a new file of mode 0600, for every prefill,
    /// decode and router of one deployment (`--auth-key-file`, `auth_key_file`).
    Keygen {
        /// The new key file (never overwritten).
        path: std::path::PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The operator's libfabric, where named (the library reads no environment).
    #[cfg(feature = "libfabric")]
    kvx_vllm::transport::choose_libfabric(|k| std::env::var_os(k));
    let service = match &cli.command {
        Command::Proxy(_) => "kvx-proxy",
        Command::Pd(args) => args.service(),
        _ => "kvx",
    };
    // Logs go to stderr, filtered by RUST_LOG (default: warnings); request spans to the OTLP
    // endpoint, where one is named.
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"))
    };
    let endpoint = cli.otlp_endpoint.as_deref().filter(|e| !e.is_empty());
    if let Err(e) = kvx_vllm::trace::otlp::init(filter(), endpoint, service) {
        // The variable may be set for other programs: the run goes on without exporting.
        kvx_vllm::trace::otlp::init(filter(), None, service)?;
        tracing::warn!(%e, "request spans are not exported");
    }
    let result = match &cli.command {
        Command::Plan(args) => plan_cmd::run(args),
        Command::Topo(args) => topo::run(args),
        Command::Pd(args) => pd::run(args),
        Command::Proxy(args) => proxy::run(args),
        Command::Settings(args) => settings_cmd::run(args),
        Command::Keygen { path } => {
            kvx_vllm::AuthKey::generate(path)?;
            println!(
                "kvx: a deployment key is in {} (mode 0600): copy it to every prefill, decode \
                 and router host of the deployment",
                path.display()
            );
            Ok(())
        }
    };
    // The spans of the last second go out before the process ends.
    kvx_vllm::trace::otlp::flush(std::time::Duration::from_secs(3));
    result
}
