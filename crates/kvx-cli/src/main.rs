//! `kvx`: the command-line tool of kvx.
//!
//! - `kvx plan`: print the transfer plan between a producer and a consumer layout;
//! - `kvx topo`: print each accelerator's PCIe placement and RDMA rails.

use clap::{Parser, Subcommand};

mod plan_cmd;
mod topo;

/// kvx: push-based KV-cache transfer for disaggregated LLM serving.
#[derive(Parser, Debug)]
#[command(name = "kvx", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the copy operations that move one request's KV from prefill to a decode rank.
    Plan(plan_cmd::PlanArgs),
    /// Print each accelerator's PCI address, NUMA node and the RDMA NICs (rails) it uses.
    Topo(topo::TopoArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match &cli.command {
        Command::Plan(args) => plan_cmd::run(args),
        Command::Topo(args) => topo::run(args),
    }
}
