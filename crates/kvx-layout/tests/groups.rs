//! A hybrid model's request: every further KV cache group moves through every layer with its
//! own blocks, only the tokens its consumer keeps, and never from a producer's placeholders.

use kvx_core::{Arrangement, BlockId, Dtype, GroupBlocks, LayoutSpec, MemoryOrder};
use kvx_layout::synth::{fill_request, verify_request};
use kvx_layout::{plan, Layout, Plan, PlanError, PlanRequest};

const TOKENS: u64 = 40;
const FULL: u64 = 11;
const WINDOW: u64 = 29;

fn layout(block_tokens: u32, order: MemoryOrder) -> Layout {
    Layout::new(LayoutSpec {
        num_layers: 3,
        total_kv_heads: 2,
        head_dim: 8,
        dtype: Dtype::F16,
        mla: false,
        block_tokens,
        num_blocks: 32,
        tp_size: 1,
        tp_rank: 0,
        order,
        arrangement: Arrangement::PerLayerSplit,
    })
    .unwrap()
}

/// `count` blocks from `first`, the leading `placeholders` of them block 0 (vLLM's null block).
fn blocks(first: u32, count: u32, placeholders: u32) -> Vec<BlockId> {
    (0..count)
        .map(|i| BlockId(if i < placeholders { 0 } else { first + i }))
        .collect()
}

fn memory(layout: &Layout, seed: u8) -> Vec<Vec<u8>> {
    (0..layout.region_count())
        .map(|r| vec![seed ^ r as u8; layout.region_len() as usize])
        .collect()
}

fn run(plan: &Plan, from: &[Vec<u8>], into: &mut [Vec<u8>]) {
    for op in plan.ops() {
        for (src, dst, len) in op.pieces() {
            let (src, dst, len) = (src as usize, dst as usize, len as usize);
            into[op.dst_region as usize][dst..dst + len]
                .copy_from_slice(&from[op.src_region as usize][src..src + len]);
        }
    }
}

#[test]
fn each_group_lands_in_its_own_blocks_from_the_first_token_its_consumer_keeps() {
    for (order, consumer_block) in [(MemoryOrder::Nhd, 8), (MemoryOrder::Hnd, 4)] {
        let (producer, consumer) = (layout(4, order), layout(consumer_block, order));
        let cb = u64::from(consumer_block);
        // Producer: the full group in blocks 1.., the window group from token 16 (block 4).
        let p_full = blocks(1, 10, 0);
        let p_window = GroupBlocks {
            first_token: 16,
            blocks: blocks(11, 10, 4),
        };
        // Consumer: the window group kept from token 24 (its block 3 for 8-token blocks).
        let c_needed = TOKENS.div_ceil(cb) as u32;
        let c_full = blocks(1, c_needed, 0);
        let c_window = GroupBlocks {
            first_token: 24,
            blocks: blocks(1 + c_needed, c_needed, (24 / cb) as u32),
        };

        let mut p_mem = memory(&producer, 0x5a);
        {
            let mut regions: Vec<&mut [u8]> = p_mem.iter_mut().map(Vec::as_mut_slice).collect();
            fill_request(&producer, &mut regions, &p_full, TOKENS, FULL);
            // The window group's pattern differs; its placeholders alias block 0, which the
            // walk overwrites for every early token: a read of them would show.
            fill_request(&producer, &mut regions, &p_window.blocks, TOKENS, WINDOW);
        }
        let before = memory(&consumer, 0xa5);
        let mut c_mem = before.clone();
        let request = PlanRequest {
            producers: std::slice::from_ref(&producer),
            consumer: &consumer,
            num_tokens: TOKENS,
            skip_tokens: 0,
            producer_blocks: &p_full,
            consumer_blocks: &c_full,
            only_producer: None,
            producer_groups: std::slice::from_ref(&p_window),
            consumer_groups: std::slice::from_ref(&c_window),
        };
        let planned = plan(&request).unwrap();
        run(&planned, &p_mem, &mut c_mem);

        let regions: Vec<&[u8]> = c_mem.iter().map(Vec::as_slice).collect();
        verify_request(&consumer, &regions, &c_full, 0, TOKENS, FULL).unwrap();
        verify_request(&consumer, &regions, &c_window.blocks, 24, TOKENS, WINDOW).unwrap();
        // Nothing landed in the consumer's placeholder block.
        let layout_bytes = consumer.region_len() / 32;
        for (now, was) in c_mem.iter().zip(&before) {
            let null = |m: &[u8]| m[..layout_bytes as usize].to_vec();
            assert_eq!(null(now), null(was), "{order:?}");
        }
        // The bytes are those of both groups' tokens.
        let alone = plan(&PlanRequest {
            producer_groups: &[],
            consumer_groups: &[],
            ..request
        })
        .unwrap();
        assert_eq!(
            planned.bytes(),
            alone.bytes() * (TOKENS + (TOKENS - 24)) / TOKENS
        );
        // A prefix the consumer already has is skipped in every group.
        let skipped = plan(&PlanRequest {
            skip_tokens: 32,
            ..request
        })
        .unwrap();
        assert_eq!(skipped.bytes(), alone.bytes() * 2 * (TOKENS - 32) / TOKENS);
    }
}

#[test]
fn a_group_moves_the_tokens_both_sides_keep_and_both_sides_name_as_many_groups() {
    let (producer, consumer) = (layout(4, MemoryOrder::Nhd), layout(4, MemoryOrder::Nhd));
    let full = blocks(1, 10, 0);
    let keeps = |first_token: u32, first: u32| GroupBlocks {
        first_token,
        blocks: blocks(first, 10, first_token / 4),
    };
    // The bytes planned where prefill keeps the group from `p_first`, decode from `c_first`,
    // and (with `one_sided`) decode names no further group.
    let planned = |p_first: u32, c_first: u32, one_sided: bool| {
        let (p, c) = (keeps(p_first, 11), keeps(c_first, 21));
        plan(&PlanRequest {
            producers: std::slice::from_ref(&producer),
            consumer: &consumer,
            num_tokens: TOKENS,
            skip_tokens: 0,
            producer_blocks: &full,
            consumer_blocks: &full,
            only_producer: None,
            producer_groups: std::slice::from_ref(&p),
            consumer_groups: if one_sided {
                &[]
            } else {
                std::slice::from_ref(&c)
            },
        })
        .map(|plan| plan.bytes())
    };
    let both_whole = planned(0, 0, false).unwrap();
    let per_token = both_whole / (2 * TOKENS);
    // Prefill keeps the group from token 16, decode from 8 (or the other way round): tokens
    // 16.. of it move.
    let from_16 = both_whole - per_token * 16;
    assert_eq!(planned(16, 8, false), Ok(from_16));
    assert_eq!(planned(8, 16, false), Ok(from_16));
    // Nothing of a group that keeps none of the tokens.
    assert_eq!(planned(40, 0, false), Ok(per_token * TOKENS));
    assert_eq!(
        planned(0, 0, true),
        Err(PlanError::GroupCount {
            producer: 1,
            consumer: 0
        })
    );
}
