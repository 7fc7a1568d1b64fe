//! Byte-level simulation of plans: producer memory holds a pattern that encodes (layer, K/V,
//! token, head, byte); the plan (and the permute) is applied to consumer memory that starts as
//! noise; then every requested byte must hold the right value, no byte may be written twice, and
//! nothing outside the destination may change.

use kvx_core::{Arrangement, BlockId, Dtype, LayoutSpec, MemoryOrder, Rank};
use kvx_layout::synth::{fill_request, verify_request};
use kvx_layout::{plan, plan_layers, Layout, PlanError, PlanRequest};
use proptest::prelude::*;

const ARRANGEMENTS: [Arrangement; 6] = Arrangement::ALL;
const ORDERS: [MemoryOrder; 3] = MemoryOrder::ALL;

/// `per-layer-head-kv` needs a head-major order; `nhd` becomes `hnd` there. `per-layer-cell-kv`
/// keeps key vectors whole; `hnd-kt` becomes `hnd` there.
fn fit_order(side: &mut SideParams) {
    if side.arrangement == Arrangement::PerLayerHeadKv && side.order == MemoryOrder::Nhd {
        side.order = MemoryOrder::Hnd;
    }
    if side.arrangement == Arrangement::PerLayerCellKv && side.order == MemoryOrder::HndKt {
        side.order = MemoryOrder::Hnd;
    }
}

#[derive(Clone, Debug)]
struct SideParams {
    tp: u32,
    block_tokens: u32,
    order: MemoryOrder,
    arrangement: Arrangement,
    extra_blocks: u32,
    fragmented: bool,
    first_block: u32,
}

#[derive(Clone, Debug)]
struct Case {
    layers: u32,
    heads: u32,
    head_dim: u32,
    dtype: Dtype,
    mla: bool,
    producer: SideParams,
    consumer: SideParams,
    consumer_rank: u32,
    tokens: u64,
    skip: u64,
    shuffle_seed: u64,
}

fn tp_for(heads: u32, mla: bool) -> impl Strategy<Value = u32> {
    let options: Vec<u32> = [1u32, 2, 3, 4, 6, 8, 12, 16]
        .into_iter()
        .filter(|&tp| {
            mla && tp <= 4 || !mla && (heads.is_multiple_of(tp) || tp.is_multiple_of(heads))
        })
        .collect();
    prop::sample::select(options)
}

fn side(heads: u32, mla: bool) -> impl Strategy<Value = SideParams> {
    (
        tp_for(heads, mla),
        1u32..=8,
        0..ORDERS.len(),
        0..ARRANGEMENTS.len(),
        0u32..4,
        any::<bool>(),
        0u32..5,
    )
        .prop_map(
            |(tp, block_tokens, order, arr, extra_blocks, fragmented, first_block)| {
                let mut side = SideParams {
                    tp,
                    block_tokens,
                    order: ORDERS[order],
                    arrangement: ARRANGEMENTS[arr],
                    extra_blocks,
                    fragmented,
                    first_block,
                };
                fit_order(&mut side);
                side
            },
        )
}

fn case() -> impl Strategy<Value = Case> {
    (prop::sample::select(vec![1u32, 2, 3, 4, 8]), any::<bool>()).prop_flat_map(|(heads, mla)| {
        (
            (
                1u32..=3,
                1u32..=3,
                prop::sample::select(vec![Dtype::Int8, Dtype::Bf16, Dtype::F32]),
            ),
            side(heads, mla),
            side(heads, mla),
            any::<prop::sample::Index>(),
            0u64..=40,
            any::<prop::sample::Index>(),
            (any::<u64>(), any::<bool>()),
        )
            .prop_map(
                move |(
                    (layers, head_dim, dtype),
                    producer,
                    mut consumer,
                    rank,
                    tokens,
                    skip,
                    (shuffle_seed, same_order),
                )| {
                    // Half the cases use one order on both sides, so that orders without a
                    // re-layout (`hnd-kt`) are planned, not only refused.
                    if same_order {
                        consumer.order = producer.order;
                        fit_order(&mut consumer);
                    }
                    Case {
                        layers,
                        heads,
                        head_dim,
                        dtype,
                        mla,
                        consumer_rank: rank.index(consumer.tp as usize) as u32,
                        producer,
                        consumer,
                        tokens,
                        skip: skip.index(tokens as usize + 1) as u64,
                        shuffle_seed,
                    }
                },
            )
    })
}

fn spec(case: &Case, side: &SideParams, rank: u32, num_blocks: u32) -> LayoutSpec {
    LayoutSpec {
        num_layers: case.layers,
        total_kv_heads: case.heads,
        head_dim: case.head_dim,
        dtype: case.dtype,
        mla: case.mla,
        block_tokens: side.block_tokens,
        num_blocks,
        tp_size: side.tp,
        tp_rank: rank,
        order: side.order,
        arrangement: side.arrangement,
    }
}

/// Block ids for a side: contiguous from `first_block`, or a shuffled choice.
fn block_ids(side: &SideParams, needed: u32, seed: u64) -> (Vec<BlockId>, u32) {
    let num_blocks = (side.first_block + needed + side.extra_blocks).max(1);
    if !side.fragmented {
        return (
            (side.first_block..side.first_block + needed)
                .map(BlockId)
                .collect(),
            num_blocks,
        );
    }
    let mut ids: Vec<u32> = (0..num_blocks).collect();
    let mut state = seed | 1;
    for i in (1..ids.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ids.swap(i, (state % (i as u64 + 1)) as usize);
    }
    (
        ids[..needed as usize]
            .iter()
            .copied()
            .map(BlockId)
            .collect(),
        num_blocks,
    )
}

fn noise(len: u64, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    kvx_layout::synth::head_vector(seed, 99, 9, 0, 0, &mut out);
    out
}

/// Runs the simulation; returns the plan's op count.
fn simulate(case: &Case) -> Result<usize, TestCaseError> {
    let pb = u64::from(case.producer.block_tokens);
    let cb = u64::from(case.consumer.block_tokens);
    let (p_blocks, p_num) = block_ids(
        &case.producer,
        case.tokens.div_ceil(pb) as u32,
        case.shuffle_seed,
    );
    let (c_blocks, c_num) = block_ids(
        &case.consumer,
        case.tokens.div_ceil(cb) as u32,
        !case.shuffle_seed,
    );
    let producers: Vec<Layout> = (0..case.producer.tp)
        .map(|r| Layout::new(spec(case, &case.producer, r, p_num)).unwrap())
        .collect();
    let consumer = Layout::new(spec(case, &case.consumer, case.consumer_rank, c_num)).unwrap();
    let seed = case.shuffle_seed.rotate_left(17);

    let mut skip = case.skip;
    let request = |skip: u64| PlanRequest {
        producers: &producers,
        consumer: &consumer,
        num_tokens: case.tokens,
        skip_tokens: skip,
        producer_blocks: &p_blocks,
        consumer_blocks: &c_blocks,
        only_producer: None,
        producer_groups: &[],
        consumer_groups: &[],
    };
    let planned = match plan(&request(skip)) {
        Err(PlanError::ArrangementMismatch { .. }) => {
            let cells = |s: &SideParams| s.arrangement == Arrangement::PerLayerCellKv;
            prop_assert!(cells(&case.producer) != cells(&case.consumer));
            let permute =
                kvx_layout::permute_for(&producers[0], &consumer, case.tokens, 0, &c_blocks, &[]);
            prop_assert!(
                matches!(permute, Err(PlanError::ArrangementMismatch { .. })),
                "permute_for must refuse the pairing too: {:?}",
                permute
            );
            return Ok(0);
        }
        Err(PlanError::UnsupportedReLayout { .. }) => {
            let (p, c) = (&case.producer, &case.consumer);
            prop_assert!(p.order != c.order || p.arrangement != c.arrangement);
            prop_assert!(
                p.order == MemoryOrder::HndKt
                    || c.order == MemoryOrder::HndKt
                    || c.arrangement == Arrangement::PerLayerHeadKv
                    || c.arrangement == Arrangement::PerLayerCellKv
            );
            prop_assert!(kvx_layout::permute_for(
                &producers[0],
                &consumer,
                case.tokens,
                0,
                &c_blocks,
                &[]
            )
            .is_err());
            return Ok(0);
        }
        Err(PlanError::UnalignedSkip { .. }) => {
            prop_assert!(
                !skip.is_multiple_of(cb) && consumer.spec().order != producers[0].spec().order
            );
            skip -= skip % cb;
            plan(&request(skip)).unwrap()
        }
        other => other.unwrap(),
    };

    // Producer memory with the pattern.
    let mut p_mem: Vec<Vec<Vec<u8>>> = producers
        .iter()
        .map(|l| {
            (0..l.region_count())
                .map(|i| noise(l.region_len(), u64::from(i) + 1000))
                .collect()
        })
        .collect();
    for (layout, mem) in producers.iter().zip(&mut p_mem) {
        let mut slices: Vec<&mut [u8]> = mem.iter_mut().map(Vec::as_mut_slice).collect();
        fill_request(layout, &mut slices, &p_blocks, case.tokens, seed);
    }
    // Consumer memory: noise, remembered.
    let before: Vec<Vec<u8>> = (0..consumer.region_count())
        .map(|i| noise(consumer.region_len(), u64::from(i) + 7))
        .collect();
    let mut c_mem = before.clone();
    let mut writes: Vec<Vec<u8>> = c_mem.iter().map(|r| vec![0u8; r.len()]).collect();

    for op in planned.ops() {
        let src_region = &p_mem[op.producer.0 as usize][op.src_region as usize];
        for (src, dst, len) in op.pieces() {
            let (src, dst, len) = (src as usize, dst as usize, len as usize);
            prop_assert!(
                src + len <= src_region.len(),
                "source out of bounds: {:?}",
                op
            );
            let dst_region = &mut c_mem[op.dst_region as usize];
            prop_assert!(
                dst + len <= dst_region.len(),
                "destination out of bounds: {:?}",
                op
            );
            dst_region[dst..dst + len].copy_from_slice(&src_region[src..src + len]);
            for count in &mut writes[op.dst_region as usize][dst..dst + len] {
                *count += 1;
                prop_assert!(
                    *count == 1,
                    "a destination byte was written twice by {:?}",
                    op
                );
            }
        }
    }
    // Bytes written equal the requested KV bytes of this consumer rank.
    let requested = (case.tokens - skip)
        * u64::from(case.layers)
        * u64::from(consumer.kv_parts())
        * u64::from(consumer.local_heads())
        * consumer.head_bytes();
    prop_assert_eq!(planned.bytes(), requested);
    let written: u64 = writes.iter().flatten().map(|&c| u64::from(c)).sum();
    prop_assert_eq!(written, requested);

    if let Some(permute) = planned.permute() {
        let mut scratch = Vec::new();
        for p in &permute.chunks {
            let region = &mut c_mem[p.region as usize];
            p.apply(&mut region[p.offset as usize..], &mut scratch);
        }
    }

    let views: Vec<&[u8]> = c_mem.iter().map(Vec::as_slice).collect();
    if let Err(m) = verify_request(&consumer, &views, &c_blocks, skip, case.tokens, seed) {
        return Err(TestCaseError::fail(format!("{m} in {case:?}")));
    }

    // Nothing outside the requested head vectors changed; with a permute, only bytes inside the
    // destination chunks may have.
    let mut may_change: Vec<Vec<bool>> = c_mem.iter().map(|r| vec![false; r.len()]).collect();
    let hb = consumer.head_bytes() as usize;
    if planned.permute().is_some() {
        for p in &planned.permute().unwrap().chunks {
            let at = p.offset as usize;
            may_change[p.region as usize][at..at + p.chunk_bytes() as usize].fill(true);
        }
    } else {
        for token in skip..case.tokens {
            let block = c_blocks[(token / cb) as usize];
            for layer in 0..case.layers {
                for kv in 0..consumer.kv_parts() {
                    let stride = consumer.element_stride(kv) as usize;
                    let element = case.dtype.size() as usize;
                    for h in 0..consumer.local_heads() {
                        let (r, o) = consumer.head_vector(layer, kv, block, (token % cb) as u32, h);
                        for e in 0..hb / element {
                            let at = o as usize + e * stride;
                            may_change[r as usize][at..at + element].fill(true);
                        }
                    }
                }
            }
        }
    }
    for (r, region) in c_mem.iter().enumerate() {
        for (i, byte) in region.iter().enumerate() {
            if !may_change[r][i] && *byte != before[r][i] {
                return Err(TestCaseError::fail(format!(
                    "byte {i} of region {r} outside the destination changed in {case:?}"
                )));
            }
        }
    }

    // The consumer computes the same re-layout without the producer's block ids.
    let alone =
        kvx_layout::permute_for(&producers[0], &consumer, case.tokens, skip, &c_blocks, &[])
            .unwrap();
    prop_assert_eq!(alone.as_ref(), planned.permute());
    // The consumer can tell its writers from the producer's TP size alone.
    if case.tokens > skip {
        let writers: Vec<Rank> = planned.writers().collect();
        prop_assert_eq!(
            kvx_layout::writers_for(&consumer, case.producer.tp).unwrap(),
            writers
        );
    }
    // A producer rank is idle for the consumer engine exactly when it has no reader there.
    for rank in (0..case.producer.tp).map(Rank) {
        let readers = kvx_layout::readers_for(rank, case.producer.tp, &consumer).unwrap();
        let idle = kvx_layout::idle_producers(case.producer.tp, &consumer).unwrap();
        prop_assert_eq!(readers.is_empty(), idle.contains(&rank), "{}", rank);
    }
    // Each writer counts this consumer rank among its readers.
    if case.tokens > skip {
        for rank in planned.writers() {
            let readers = kvx_layout::readers_for(rank, case.producer.tp, &consumer).unwrap();
            prop_assert!(
                readers.contains(&consumer.rank()),
                "{:?} not a reader of {}",
                consumer.rank(),
                rank
            );
        }
    }
    // Every writer has operations, and each producer's own plan is its slice of the whole.
    for rank in planned.writers() {
        let own = plan(&PlanRequest {
            only_producer: Some(rank),
            ..request(skip)
        })
        .unwrap();
        prop_assert_eq!(own.ops(), planned.ops_for(rank));
        prop_assert!(!own.ops().is_empty());
        prop_assert!(own.ops().iter().all(|op| op.producer == rank));
        // Layer-wise streaming: the plans of a split of the layers are the whole plan's parts.
        let layers = consumer.spec().num_layers;
        let split = (case.shuffle_seed % u64::from(layers + 1)) as u32;
        let part = |range: std::ops::Range<u32>| {
            plan_layers(
                &PlanRequest {
                    only_producer: Some(rank),
                    ..request(skip)
                },
                range,
            )
            .unwrap()
        };
        let (low, high) = (part(0..split), part(split..layers));
        prop_assert_eq!(low.bytes() + high.bytes(), own.bytes());
        prop_assert_eq!([low.ops(), high.ops()].concat(), own.ops());
    }
    Ok(planned.ops().len())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn plans_move_exactly_the_requested_kv(case in case()) {
        simulate(&case)?;
    }
}

fn base_case() -> Case {
    let side = SideParams {
        tp: 2,
        block_tokens: 4,
        order: MemoryOrder::Hnd,
        arrangement: Arrangement::PerLayerSplit,
        extra_blocks: 1,
        fragmented: false,
        first_block: 2,
    };
    Case {
        layers: 2,
        heads: 4,
        head_dim: 2,
        dtype: Dtype::Bf16,
        mla: false,
        producer: side.clone(),
        consumer: side,
        consumer_rank: 1,
        tokens: 37,
        skip: 0,
        shuffle_seed: 5,
    }
}

/// Every named combination, simulated explicitly (the property test covers them at random too).
#[test]
fn every_named_combination_simulates() {
    let mut count = 0;
    for (p_tp, c_tp, heads, mla) in [
        (2, 2, 4, false),
        (4, 2, 4, false),
        (2, 4, 4, false),
        (8, 2, 2, false), // producer TP > heads
        (1, 8, 2, false), // consumer TP > heads
        (8, 4, 2, false), // both above heads
        (2, 3, 1, true),  // MLA
    ] {
        for (p_bt, c_bt) in [(4, 4), (2, 8), (8, 2), (3, 5)] {
            for p_order in [MemoryOrder::Nhd, MemoryOrder::Hnd] {
                for c_order in [MemoryOrder::Nhd, MemoryOrder::Hnd] {
                    for (p_arr, c_arr) in [(0, 0), (1, 2), (3, 0), (2, 3), (5, 5)] {
                        for fragmented in [false, true] {
                            for skip in [0, 8] {
                                let mut case = base_case();
                                case.heads = heads;
                                case.mla = mla;
                                case.skip = skip;
                                case.consumer_rank = c_tp - 1;
                                for (side, tp, bt, order, arr) in [
                                    (&mut case.producer, p_tp, p_bt, p_order, p_arr),
                                    (&mut case.consumer, c_tp, c_bt, c_order, c_arr),
                                ] {
                                    side.tp = tp;
                                    side.block_tokens = bt;
                                    side.order = order;
                                    side.arrangement = ARRANGEMENTS[arr];
                                    side.fragmented = fragmented;
                                }
                                simulate(&case).unwrap();
                                count += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    assert_eq!(count, 7 * 4 * 4 * 5 * 2 * 2);
}

#[test]
fn contiguous_requests_need_ops_independent_of_length() {
    // Same shape, 1x and 8x the tokens: the op count does not grow.
    for (p_tp, c_tp) in [(2, 2), (4, 2), (2, 4)] {
        for order in [MemoryOrder::Nhd, MemoryOrder::Hnd] {
            for (p_bt, c_bt) in [(4, 4), (2, 8), (8, 2)] {
                let mut short = base_case();
                short.tokens = 64;
                for (side, tp, bt) in [
                    (&mut short.producer, p_tp, p_bt),
                    (&mut short.consumer, c_tp, c_bt),
                ] {
                    side.tp = tp;
                    side.block_tokens = bt;
                    side.order = order;
                }
                short.consumer_rank = 0;
                // HND with several heads on both sides and different block sizes interleaves
                // three levels (head, consumer block, producer block): one strided op per head
                // run per larger block. See docs/planner.md.
                let heads_each = |tp: u32| short.heads / tp.min(short.heads);
                if order == MemoryOrder::Hnd
                    && p_bt != c_bt
                    && heads_each(p_tp) > 1
                    && heads_each(c_tp) > 1
                {
                    continue;
                }
                let mut long = short.clone();
                long.tokens = 512;
                let (a, b) = (simulate(&short).unwrap(), simulate(&long).unwrap());
                assert_eq!(a, b, "op count grew with length for {short:?}");
            }
        }
    }
}

#[test]
fn same_geometry_needs_one_op_per_layer_and_kv() {
    let case = base_case();
    let ops = simulate(&Case {
        tokens: 40,
        ..case.clone()
    })
    .unwrap();
    assert_eq!(
        ops,
        2 * 2,
        "one op per (layer, K/V) from the one producer that serves rank 1"
    );
    // Rank 1 of TP 2 with 4 heads and a TP-2 producer: the whole request is one run per family.
    let _ = Rank(0);
}

/// Both sides in `order` and `arrangement`: a 70-token request moves token-exactly between
/// block sizes 16, 32, 3 and 5 and TP degrees 1, 2 and 4, fragmented or not, with and without a
/// prefix skip; with equal sides and 64 tokens it is `aligned_ops` operations.
fn moves_token_exactly(order: MemoryOrder, arrangement: Arrangement, aligned_ops: usize) {
    for (p_bt, c_bt) in [(16, 16), (16, 32), (32, 16), (3, 5)] {
        for (p_tp, c_tp) in [(2, 2), (4, 2), (1, 2), (2, 1)] {
            for fragmented in [false, true] {
                for skip in [0, 16] {
                    let mut case = base_case();
                    case.tokens = 70;
                    case.skip = skip;
                    case.consumer_rank = c_tp - 1;
                    for (side, tp, bt) in [
                        (&mut case.producer, p_tp, p_bt),
                        (&mut case.consumer, c_tp, c_bt),
                    ] {
                        side.tp = tp;
                        side.block_tokens = bt;
                        side.order = order;
                        side.arrangement = arrangement;
                        side.fragmented = fragmented;
                    }
                    let ops = simulate(&case).unwrap();
                    assert!(ops > 0, "refused: {case:?}");
                    if p_bt == c_bt && p_tp == c_tp && !fragmented {
                        case.tokens = 64;
                        let ops = simulate(&case).unwrap();
                        assert_eq!(ops, aligned_ops, "aligned request: {case:?}");
                    }
                }
            }
        }
    }
}

/// vLLM's CPU cache (`hnd-kt` in `per-layer-head-kv`) moves token-exactly between any block
/// sizes and TP degrees, as long as both sides use it: one op per (layer, K/V) when aligned.
#[test]
fn vllm_cpu_layout_moves_token_exactly_across_block_sizes() {
    moves_token_exactly(MemoryOrder::HndKt, Arrangement::PerLayerHeadKv, 2 * 2);
}

/// vLLM's GPU caches from 0.32 on (K then V per token and head: `per-layer-cell-kv`, in its
/// `LBHNC` or `LBNHC` layout) move token-exactly between any block sizes and TP degrees when both
/// sides use them, each cell whole (one op per layer when aligned); a pairing with another
/// arrangement is refused.
#[test]
fn vllm_gpu_cells_move_token_exactly_across_block_sizes_and_tp() {
    for order in [MemoryOrder::Hnd, MemoryOrder::Nhd] {
        moves_token_exactly(order, Arrangement::PerLayerCellKv, 2);
    }
    for other in Arrangement::ALL {
        if other == Arrangement::PerLayerCellKv {
            continue;
        }
        let mut case = base_case();
        case.producer.order = MemoryOrder::Hnd;
        case.producer.arrangement = Arrangement::PerLayerCellKv;
        case.consumer.order = MemoryOrder::Hnd;
        case.consumer.arrangement = other;
        assert_eq!(simulate(&case).unwrap(), 0, "{other} must be refused");
        std::mem::swap(&mut case.producer, &mut case.consumer);
        assert_eq!(simulate(&case).unwrap(), 0, "{other} must be refused");
    }
}

/// Dimension-major keys have no receiver permute: a pairing with a token-major side is refused
/// (`simulate` checks that the refusal is `UnsupportedReLayout` and returns no ops), unless that
/// side's blocks hold one token.
#[test]
fn dimension_major_keys_pair_only_with_themselves() {
    for (order, arrangement) in [
        (MemoryOrder::Hnd, Arrangement::PerLayerSplit),
        (MemoryOrder::Nhd, Arrangement::PerLayerKvInBlock),
        (MemoryOrder::Hnd, Arrangement::PerLayerHeadKv),
    ] {
        for consumer_tokens in [4, 1] {
            let mut case = base_case();
            case.producer.order = MemoryOrder::HndKt;
            case.producer.arrangement = Arrangement::PerLayerHeadKv;
            case.consumer.order = order;
            case.consumer.arrangement = arrangement;
            case.consumer.block_tokens = consumer_tokens;
            let ops = simulate(&case).unwrap();
            assert_eq!(ops > 0, consumer_tokens == 1, "{case:?}");
        }
    }
}

#[test]
fn a_layer_range_beyond_the_model_is_refused() {
    let case = base_case();
    let blocks: Vec<BlockId> = (0..8).map(BlockId).collect();
    let layout = Layout::new(spec(&case, &case.producer, 0, 16)).unwrap();
    let request = PlanRequest {
        producers: std::slice::from_ref(&layout),
        consumer: &layout,
        num_tokens: 20,
        skip_tokens: 0,
        producer_blocks: &blocks,
        consumer_blocks: &blocks,
        only_producer: None,
        producer_groups: &[],
        consumer_groups: &[],
    };
    for layers in [0..3, 2..3] {
        assert_eq!(
            plan_layers(&request, layers.clone()).unwrap_err(),
            PlanError::LayersOutOfRange {
                layers,
                num_layers: 2
            }
        );
    }
    assert!(plan_layers(&request, 1..1).unwrap().ops().is_empty());
    assert_eq!(
        plan_layers(&request, 1..2).unwrap().bytes() * 2,
        plan(&request).unwrap().bytes()
    );
}

/// A layout may declare a tensor-parallel size up to `MAX_TP_SIZE`, no more (a peer's hello
/// sizes tables and loops by it).
#[test]
fn a_tp_size_beyond_the_bound_is_refused() {
    let case = base_case();
    let mut big = spec(&case, &case.producer, 0, 16);
    big.total_kv_heads = kvx_layout::MAX_TP_SIZE;
    big.tp_size = kvx_layout::MAX_TP_SIZE;
    assert!(Layout::new(big.clone()).is_ok());
    // A multiple of the heads, so that nothing else refuses it.
    big.tp_size = 1 << 31;
    let err = Layout::new(big).unwrap_err();
    assert!(
        matches!(err, kvx_layout::LayoutError::TpSizeTooLarge { tp_size, .. } if tp_size == 1 << 31),
        "{err}"
    );
}
