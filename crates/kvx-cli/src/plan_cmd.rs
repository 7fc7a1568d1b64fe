//! `kvx plan`: print the transfer plan for a producer and a consumer layout.

use std::fmt::Write as _;
use std::str::FromStr;

use anyhow::{bail, Context as _};
use kvx_core::{Arrangement, BlockId, Dtype, LayoutSpec, MemoryOrder, Rank};
use kvx_layout::{plan, Layout, Plan, PlanRequest};
use serde::Serialize;

/// Arguments of `kvx plan`.
#[derive(clap::Args, Debug)]
pub(crate) struct PlanArgs {
    /// Model layers.
    #[arg(long, default_value_t = 64)]
    layers: u32,
    /// Model KV heads (ignored with --mla).
    #[arg(long, default_value_t = 8)]
    kv_heads: u32,
    /// Elements per head vector (for MLA, the latent dimension).
    #[arg(long, default_value_t = 128)]
    head_dim: u32,
    /// Element type: f32, f16, bf16, fp8_e4m3, fp8_e5m2, int8.
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    dtype: Dtype,
    /// Multi-head latent attention (one latent vector per token).
    #[arg(long)]
    mla: bool,
    /// The prefill side: `tp=8,block=16,order=hnd,arrangement=per-layer-split,blocks=4096`
    /// (every key optional; those are the defaults).
    #[arg(long, default_value = "")]
    producer: SideSpec,
    /// The decode side, same keys as --producer.
    #[arg(long, default_value = "")]
    consumer: SideSpec,
    /// The consumer rank to plan for.
    #[arg(long, default_value_t = 0)]
    consumer_rank: u32,
    /// Prompt tokens.
    #[arg(long, default_value_t = 16384)]
    tokens: u64,
    /// Leading tokens the consumer already has.
    #[arg(long, default_value_t = 0)]
    skip: u64,
    /// Producer block ids: `auto` (contiguous from 0) or a list like `0-99,200,300-310`.
    #[arg(long, default_value = "auto")]
    producer_blocks: BlockList,
    /// Consumer block ids, as --producer-blocks.
    #[arg(long, default_value = "auto")]
    consumer_blocks: BlockList,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Operations shown in the table (all of them in JSON).
    #[arg(long, default_value_t = 20)]
    max_rows: usize,
}

/// One side's engine configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SideSpec {
    tp: u32,
    block_tokens: u32,
    order: MemoryOrder,
    arrangement: Arrangement,
    num_blocks: u32,
}

impl FromStr for SideSpec {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        let mut spec = Self {
            tp: 8,
            block_tokens: 16,
            order: MemoryOrder::Hnd,
            arrangement: Arrangement::PerLayerSplit,
            num_blocks: 4096,
        };
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .with_context(|| format!("`{item}` is not KEY=VALUE"))?;
            let number = || -> anyhow::Result<u32> {
                value
                    .parse()
                    .with_context(|| format!("`{key}` needs a number, got `{value}`"))
            };
            match key {
                "tp" => spec.tp = number()?,
                "block" => spec.block_tokens = number()?,
                "blocks" => spec.num_blocks = number()?,
                "order" => spec.order = value.parse()?,
                "arrangement" => spec.arrangement = value.parse()?,
                _ => bail!("unknown key `{key}` (keys: tp, block, blocks, order, arrangement)"),
            }
        }
        Ok(spec)
    }
}

/// Block ids given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum BlockList {
    /// Contiguous from 0, as many as the tokens need.
    Auto,
    /// Explicit ids.
    Ids(Vec<BlockId>),
}

impl FromStr for BlockList {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        if s == "auto" {
            return Ok(Self::Auto);
        }
        let mut ids = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let parse = |v: &str| -> anyhow::Result<u32> {
                v.trim()
                    .parse()
                    .with_context(|| format!("`{v}` is not a block id"))
            };
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (parse(a)?, parse(b)?);
                    if b < a {
                        bail!("block range `{part}` runs backwards");
                    }
                    ids.extend((a..=b).map(BlockId));
                }
                None => ids.push(BlockId(parse(part)?)),
            }
        }
        Ok(Self::Ids(ids))
    }
}

impl BlockList {
    fn resolve(&self, tokens: u64, block_tokens: u32) -> Vec<BlockId> {
        match self {
            Self::Auto => (0..tokens.div_ceil(u64::from(block_tokens)) as u32)
                .map(BlockId)
                .collect(),
            Self::Ids(ids) => ids.clone(),
        }
    }
}

fn parse_dtype(s: &str) -> Result<Dtype, String> {
    Dtype::ALL
        .into_iter()
        .find(|d| d.name() == s)
        .ok_or_else(|| format!("unknown dtype `{s}` (f32, f16, bf16, fp8_e4m3, fp8_e5m2, int8)"))
}

#[derive(Serialize)]
struct JsonPlan<'a> {
    tokens: u64,
    skip_tokens: u64,
    consumer_rank: u32,
    bytes: u64,
    op_count: usize,
    pieces: u64,
    writers: Vec<JsonWriter>,
    permute: Option<JsonPermute>,
    ops: &'a [kvx_layout::CopyOp],
}

#[derive(Serialize)]
struct JsonWriter {
    rank: Rank,
    ops: usize,
    bytes: u64,
}

#[derive(Serialize)]
struct JsonPermute {
    from: MemoryOrder,
    to: MemoryOrder,
    chunks: usize,
}

impl PlanArgs {
    fn layout(&self, side: &SideSpec, rank: u32) -> anyhow::Result<Layout> {
        Layout::new(LayoutSpec {
            num_layers: self.layers,
            total_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dtype: self.dtype,
            mla: self.mla,
            block_tokens: side.block_tokens,
            num_blocks: side.num_blocks,
            tp_size: side.tp,
            tp_rank: rank,
            order: side.order,
            arrangement: side.arrangement,
        })
        .with_context(|| format!("invalid layout for rank {rank} of TP {}", side.tp))
    }
}

/// Plans and renders; the output text.
pub(crate) fn render(args: &PlanArgs) -> anyhow::Result<String> {
    let producers = (0..args.producer.tp)
        .map(|r| args.layout(&args.producer, r))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let consumer = args.layout(&args.consumer, args.consumer_rank)?;
    let p_blocks = args
        .producer_blocks
        .resolve(args.tokens, args.producer.block_tokens);
    let c_blocks = args
        .consumer_blocks
        .resolve(args.tokens, args.consumer.block_tokens);
    let planned = plan(&PlanRequest {
        producers: &producers,
        consumer: &consumer,
        num_tokens: args.tokens,
        skip_tokens: args.skip,
        producer_blocks: &p_blocks,
        consumer_blocks: &c_blocks,
        only_producer: None,
        producer_groups: &[],
        consumer_groups: &[],
    })
    .context("cannot plan this transfer")?;
    let writers: Vec<JsonWriter> = planned
        .writers()
        .map(|rank| {
            let ops = planned.ops_for(rank);
            JsonWriter {
                rank,
                ops: ops.len(),
                bytes: ops.iter().map(kvx_layout::CopyOp::bytes).sum(),
            }
        })
        .collect();
    let permute = planned.permute().and_then(|p| {
        p.chunks.first().map(|c| JsonPermute {
            from: c.from,
            to: c.to,
            chunks: p.chunks.len(),
        })
    });
    if args.json {
        let json = JsonPlan {
            tokens: args.tokens,
            skip_tokens: args.skip,
            consumer_rank: args.consumer_rank,
            bytes: planned.bytes(),
            op_count: planned.ops().len(),
            pieces: planned.ops().iter().map(|op| op.count).sum(),
            writers,
            permute,
            ops: planned.ops(),
        };
        return Ok(serde_json::to_string_pretty(&json)? + "\n");
    }
    Ok(table(args, &planned, &writers, permute.as_ref()))
}

fn table(
    args: &PlanArgs,
    planned: &Plan,
    writers: &[JsonWriter],
    permute: Option<&JsonPermute>,
) -> String {
    let mut out = String::new();
    let pieces: u64 = planned.ops().iter().map(|op| op.count).sum();
    let _ = writeln!(
        out,
        "plan for consumer rank {} of TP {}: {} tokens ({} skipped), {} bytes in {} ops ({} pieces)",
        args.consumer_rank,
        args.consumer.tp,
        args.tokens,
        args.skip,
        planned.bytes(),
        planned.ops().len(),
        pieces
    );
    for w in writers {
        let _ = writeln!(
            out,
            "  producer {:<8} {:>7} ops {:>14} bytes",
            w.rank, w.ops, w.bytes
        );
    }
    match permute {
        Some(p) => {
            let _ = writeln!(
                out,
                "  receiver re-layout: {} chunks from {} to {} after the data lands",
                p.chunks, p.from, p.to
            );
        }
        None => {
            let _ = writeln!(out, "  no receiver re-layout needed");
        }
    }
    let _ = writeln!(
        out,
        "\n{:<9} {:>6} {:>14} {:>6} {:>14} {:>12} {:>7} {:>12} {:>12}",
        "producer",
        "src",
        "src_offset",
        "dst",
        "dst_offset",
        "len",
        "count",
        "src_stride",
        "dst_stride"
    );
    for op in planned.ops().iter().take(args.max_rows) {
        let _ = writeln!(
            out,
            "{:<9} {:>6} {:>14} {:>6} {:>14} {:>12} {:>7} {:>12} {:>12}",
            op.producer.to_string(),
            op.src_region,
            op.src_offset,
            op.dst_region,
            op.dst_offset,
            op.len,
            op.count,
            op.src_stride,
            op.dst_stride
        );
    }
    if planned.ops().len() > args.max_rows {
        let _ = writeln!(
            out,
            "... {} more (--max-rows to show more, --json for all)",
            planned.ops().len() - args.max_rows
        );
    }
    out
}

/// Runs `kvx plan`.
pub(crate) fn run(args: &PlanArgs) -> anyhow::Result<()> {
    print!("{}", render(args)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: PlanArgs,
    }

    fn render_with(argv: &[&str]) -> anyhow::Result<String> {
        let cli = Cli::try_parse_from(std::iter::once("plan").chain(argv.iter().copied()))?;
        render(&cli.args)
    }

    #[test]
    fn json_reports_ops_writers_and_bytes() {
        let out = render_with(&[
            "--producer",
            "tp=8",
            "--consumer",
            "tp=4",
            "--tokens",
            "16384",
            "--json",
        ])
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        // Consumer rank 0 of TP 4 holds heads 0-1, written by producer ranks 0 and 1.
        assert_eq!(v["writers"].as_array().unwrap().len(), 2);
        assert_eq!(v["op_count"], 2 * 64 * 2);
        assert_eq!(v["bytes"], 16384u64 * 64 * 2 * 2 * 128 * 2);
        assert_eq!(v["ops"].as_array().unwrap().len(), 256);
        assert!(v["permute"].is_null());
    }

    #[test]
    fn table_shows_a_summary_and_limits_rows() {
        let out = render_with(&[
            "--layers",
            "2",
            "--producer",
            "tp=2,order=nhd",
            "--consumer",
            "tp=1,order=hnd,block=32",
            "--tokens",
            "100",
            "--max-rows",
            "3",
        ])
        .unwrap();
        assert!(out.contains("100 tokens (0 skipped)"), "{out}");
        assert!(out.contains("receiver re-layout"), "{out}");
        assert!(out.contains("more (--max-rows"), "{out}");
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        let err = render_with(&["--producer", "tp=3"]).unwrap_err();
        assert!(format!("{err:#}").contains("cannot be split"), "{err:#}");
        let err = render_with(&["--consumer-blocks", "0-3", "--tokens", "100"]).unwrap_err();
        assert!(format!("{err:#}").contains("blocks but"), "{err:#}");
        assert!(render_with(&["--producer", "order=xyz"]).is_err());
        assert!(render_with(&["--producer-blocks", "5-1"]).is_err());
    }

    #[test]
    fn block_lists_parse() {
        assert_eq!(
            "1,3-5".parse::<BlockList>().unwrap(),
            BlockList::Ids(vec![BlockId(1), BlockId(3), BlockId(4), BlockId(5)])
        );
        assert_eq!("auto".parse::<BlockList>().unwrap(), BlockList::Auto);
    }
}
