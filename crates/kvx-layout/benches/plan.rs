//! Planning cost for a Qwen3-32B-like request: 64 layers, 8 KV heads, head dim 128, bf16, 16k
//! tokens, separate K/V regions per layer, HND. Prints (and writes as JSON under
//! `target/kvx-bench/plan-ops.json`) the op count of every case; criterion times the planning.
#![allow(missing_docs)] // criterion_group! generates an undocumented function

use std::hint::black_box;
use std::io::Write as _;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvx_core::{Arrangement, BlockId, Dtype, LayoutSpec, MemoryOrder};
use kvx_layout::{plan, Layout, PlanRequest};

const TOKENS: u64 = 16 * 1024;
const LAYERS: u32 = 64;

fn layouts(tp: u32, block_tokens: u32) -> Vec<Layout> {
    (0..tp)
        .map(|rank| {
            Layout::new(LayoutSpec {
                num_layers: LAYERS,
                total_kv_heads: 8,
                head_dim: 128,
                dtype: Dtype::Bf16,
                mla: false,
                block_tokens,
                num_blocks: 4096,
                tp_size: tp,
                tp_rank: rank,
                order: MemoryOrder::Hnd,
                arrangement: Arrangement::PerLayerSplit,
            })
            .expect("valid layout")
        })
        .collect()
}

/// Block ids for the request: runs of `run` consecutive ids, the runs placed at shuffled
/// positions of a cache twice as large, so that no two runs touch or repeat a spacing.
fn blocks(block_tokens: u32, run: u32) -> Vec<BlockId> {
    let needed = TOKENS.div_ceil(u64::from(block_tokens)) as u32;
    let run = run.min(needed);
    let runs = needed.div_ceil(run);
    let mut slots: Vec<u32> = (0..runs * 2).collect();
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    for i in (1..slots.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        slots.swap(i, (state % (i as u64 + 1)) as usize);
    }
    (0..needed)
        .map(|i| BlockId(slots[(i / run) as usize] * run + i % run))
        .collect()
}

struct Case {
    name: &'static str,
    p_tp: u32,
    c_tp: u32,
    p_bt: u32,
    c_bt: u32,
}

const CASES: [Case; 4] = [
    Case {
        name: "tp8-to-tp8",
        p_tp: 8,
        c_tp: 8,
        p_bt: 16,
        c_bt: 16,
    },
    Case {
        name: "tp8-to-tp4",
        p_tp: 8,
        c_tp: 4,
        p_bt: 16,
        c_bt: 16,
    },
    Case {
        name: "tp4-to-tp8",
        p_tp: 4,
        c_tp: 8,
        p_bt: 16,
        c_bt: 16,
    },
    Case {
        name: "block16-to-block64",
        p_tp: 8,
        c_tp: 8,
        p_bt: 16,
        c_bt: 64,
    },
];

/// Run lengths in blocks: contiguous (one run), then ever more fragments.
const RUNS: [(u32, &str); 4] = [
    (u32::MAX, "contiguous"),
    (64, "runs-of-64"),
    (8, "runs-of-8"),
    (1, "scattered"),
];

fn bench(c: &mut Criterion) {
    let mut report = Vec::new();
    let mut group = c.benchmark_group("plan_qwen3_32b_16k");
    for case in &CASES {
        let producers = layouts(case.p_tp, case.p_bt);
        let consumer = layouts(case.c_tp, case.c_bt).swap_remove(0);
        for (run, run_name) in RUNS {
            let p_blocks = blocks(case.p_bt, run);
            let c_blocks = blocks(case.c_bt, run);
            let request = PlanRequest {
                producers: &producers,
                consumer: &consumer,
                num_tokens: TOKENS,
                skip_tokens: 0,
                producer_blocks: &p_blocks,
                consumer_blocks: &c_blocks,
                only_producer: None,
                producer_groups: &[],
                consumer_groups: &[],
            };
            let planned = plan(&request).expect("plans");
            let writers = planned.writers().len();
            let max_ops_per_producer = planned
                .writers()
                .map(|r| planned.ops_for(r).len())
                .max()
                .unwrap_or(0);
            let pieces: u64 = planned.ops().iter().map(|op| op.count).sum();
            println!(
                "{:<20} {:<11} ops {:>7} (max {:>6} per producer, {} producers) pieces {:>8} bytes {:>11}",
                case.name,
                run_name,
                planned.ops().len(),
                max_ops_per_producer,
                writers,
                pieces,
                planned.bytes()
            );
            report.push(format!(
                "{{\"case\":\"{}\",\"blocks\":\"{}\",\"ops\":{},\"max_ops_per_producer\":{},\"producers\":{},\"pieces\":{},\"bytes\":{}}}",
                case.name, run_name, planned.ops().len(), max_ops_per_producer, writers, pieces, planned.bytes()
            ));
            group.bench_with_input(BenchmarkId::new(case.name, run_name), &request, |b, r| {
                b.iter(|| plan(black_box(r)).expect("plans"));
            });
        }
    }
    group.finish();
    let dir = std::env::var("KVX_BENCH_OUT").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/kvx-bench").to_owned()
    });
    if std::fs::create_dir_all(&dir).is_ok() {
        if let Ok(mut f) = std::fs::File::create(format!("{dir}/plan-ops.json")) {
            let _ = writeln!(f, "[{}]", report.join(",\n"));
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
