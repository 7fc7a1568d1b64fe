//! The planner: from producer and consumer layouts, a request's tokens and block ids, the copy
//! operations that move exactly that request's KV.
//!
//! The work is split in two so that planning costs O(fragments), not O(layers × blocks):
//!
//! 1. A *template* in chunk space: for every group of consecutive consumer heads served by one
//!    producer rank, walk the request's tokens in *segments* (maximal runs that stay inside one
//!    block on both sides), turn each segment into a (possibly strided) piece, and merge pieces
//!    that continue each other. Offsets are relative to block 0's chunk of a (layer, K/V) family,
//!    which works because every arrangement places a family's chunks at one fixed stride.
//! 2. *Instantiation*: the template is repeated for every (layer, K/V) with that family's region
//!    and base offset on both sides.

use std::ops::Range;

use kvx_core::{Arrangement, BlockId, GroupBlocks, MemoryOrder, Rank};

use crate::error::{PlanError, Side};
use crate::geometry::Layout;
use crate::plan::{CopyOp, Permute};

/// What to plan: one consumer rank's share of one request.
#[derive(Clone, Copy, Debug)]
pub struct PlanRequest<'a> {
    /// Layouts of the producer ranks (any order; every rank the plan needs must be present).
    pub producers: &'a [Layout],
    /// The consumer rank's layout.
    pub consumer: &'a Layout,
    /// Tokens of the request whose KV exists on the producer.
    pub num_tokens: u64,
    /// Leading tokens the consumer already has; they are not written.
    pub skip_tokens: u64,
    /// The request's blocks on the producer (the same ids on every producer rank), in token
    /// order from token 0.
    pub producer_blocks: &'a [BlockId],
    /// The request's blocks on the consumer rank, in token order from token 0.
    pub consumer_blocks: &'a [BlockId],
    /// Plan only the operations of this producer rank (a producer rank plans its own share).
    pub only_producer: Option<Rank>,
    /// The request's further KV cache groups on the producer (hybrid models; empty for a model
    /// of one group), as many as `consumer_groups`, in the same order.
    pub producer_groups: &'a [GroupBlocks],
    /// The request's further KV cache groups on the consumer rank.
    pub consumer_groups: &'a [GroupBlocks],
}

/// The receiver's in-place re-layouts, needed when the two sides use different memory orders.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PermutePlan {
    /// Every destination chunk to re-lay-out once all notices have arrived.
    pub chunks: Vec<Permute>,
}

/// The result of planning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    ops: Vec<CopyOp>,
    writers: Vec<(Rank, Range<usize>)>,
    permute: Option<PermutePlan>,
    bytes: u64,
}

impl Plan {
    /// All copy operations, grouped by producer rank (ascending), then KV cache group, then
    /// layer, then K/V (K and V together where cells hold both,
    /// [`Arrangement::PerLayerCellKv`]).
    #[must_use]
    pub fn ops(&self) -> &[CopyOp] {
        &self.ops
    }

    /// The producer ranks that write to this consumer rank: the consumer waits for one
    /// completion notice from each.
    pub fn writers(&self) -> impl ExactSizeIterator<Item = Rank> + '_ {
        self.writers.iter().map(|(rank, _)| *rank)
    }

    /// The operations one producer rank performs.
    #[must_use]
    pub fn ops_for(&self, rank: Rank) -> &[CopyOp] {
        self.writers
            .iter()
            .find(|(r, _)| *r == rank)
            .map_or(&[], |(_, range)| &self.ops[range.clone()])
    }

    /// Bytes moved in all.
    #[must_use]
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The re-layout the consumer must apply, if the memory orders differ.
    #[must_use]
    pub fn permute(&self) -> Option<&PermutePlan> {
        self.permute.as_ref()
    }

    /// Consumes the plan, giving its operations.
    #[must_use]
    pub fn into_ops(self) -> Vec<CopyOp> {
        self.ops
    }

    /// One plan doing what `plans` (at least one) do, in their order for each producer rank.
    fn concat(mut plans: Vec<Plan>) -> Plan {
        if plans.len() == 1 {
            return plans.pop().expect("one plan");
        }
        let mut ranks: Vec<Rank> = plans.iter().flat_map(Plan::writers).collect();
        ranks.sort_unstable();
        ranks.dedup();
        let mut ops = Vec::with_capacity(plans.iter().map(|p| p.ops.len()).sum());
        let mut writers = Vec::with_capacity(ranks.len());
        for rank in ranks {
            let start = ops.len();
            for plan in &plans {
                ops.extend_from_slice(plan.ops_for(rank));
            }
            writers.push((rank, start..ops.len()));
        }
        let permutes: Vec<&PermutePlan> = plans.iter().filter_map(|p| p.permute.as_ref()).collect();
        let permute = (!permutes.is_empty()).then(|| PermutePlan {
            chunks: permutes
                .iter()
                .flat_map(|p| p.chunks.iter().copied())
                .collect(),
        });
        Plan {
            bytes: plans.iter().map(|p| p.bytes).sum(),
            ops,
            writers,
            permute,
        }
    }
}

/// A run of consumer heads served by one producer rank, contiguous on both sides.
#[derive(Clone, Copy, Debug)]
struct HeadGroup {
    producer: Rank,
    /// Index into `PlanRequest::producers`.
    producer_index: usize,
    consumer_head: u32,
    producer_head: u32,
    heads: u32,
}

/// A template operation in chunk space (offsets relative to a family's block-0 chunk).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    src: u64,
    dst: u64,
    len: u64,
    count: u64,
    src_stride: u64,
    dst_stride: u64,
}

impl Piece {
    fn strided(src: u64, dst: u64, len: u64, count: u64, src_stride: u64, dst_stride: u64) -> Self {
        if count == 1 || (src_stride == len && dst_stride == len) {
            Self {
                src,
                dst,
                len: len * count,
                count: 1,
                src_stride: 0,
                dst_stride: 0,
            }
        } else {
            Self {
                src,
                dst,
                len,
                count,
                src_stride,
                dst_stride,
            }
        }
    }

    /// Absorbs `next` if it continues this piece; returns whether it did.
    fn absorb(&mut self, next: &Self) -> bool {
        match (self.count, next.count) {
            (1, 1) => {
                if next.src == self.src + self.len && next.dst == self.dst + self.len {
                    self.len += next.len;
                    return true;
                }
                if next.len == self.len
                    && next.src >= self.src + self.len
                    && next.dst >= self.dst + self.len
                {
                    self.count = 2;
                    self.src_stride = next.src - self.src;
                    self.dst_stride = next.dst - self.dst;
                    return true;
                }
                false
            }
            (_, 1) => {
                if next.len == self.len
                    && next.src == self.src + self.count * self.src_stride
                    && next.dst == self.dst + self.count * self.dst_stride
                {
                    self.count += 1;
                    return true;
                }
                false
            }
            (1, _) => {
                if next.len == self.len
                    && next.src == self.src + next.src_stride
                    && next.dst == self.dst + next.dst_stride
                {
                    self.count = next.count + 1;
                    self.src_stride = next.src_stride;
                    self.dst_stride = next.dst_stride;
                    return true;
                }
                false
            }
            (_, _) => {
                if next.len == self.len
                    && next.src_stride == self.src_stride
                    && next.dst_stride == self.dst_stride
                    && next.src == self.src + self.count * self.src_stride
                    && next.dst == self.dst + self.count * self.dst_stride
                {
                    self.count += next.count;
                    return true;
                }
                false
            }
        }
    }
}

/// Two-stage merging: contiguous pieces first grow into runs; finished runs then merge into
/// strided operations. Doing it in this order lets a run that will grow (several segments inside
/// one consumer block) reach its final length before it is compared with the previous run.
#[derive(Clone, Copy, Debug, Default)]
struct Merger {
    run: Option<Piece>,
    strided: Option<Piece>,
}

impl Merger {
    fn push(&mut self, piece: Piece, out: &mut Vec<Piece>) {
        if piece.count == 1 {
            if let Some(run) = &mut self.run {
                if piece.src == run.src + run.len && piece.dst == run.dst + run.len {
                    run.len += piece.len;
                    return;
                }
            }
            if let Some(run) = self.run.replace(piece) {
                self.stage_two(run, out);
            }
        } else {
            if let Some(run) = self.run.take() {
                self.stage_two(run, out);
            }
            self.stage_two(piece, out);
        }
    }

    fn stage_two(&mut self, piece: Piece, out: &mut Vec<Piece>) {
        let absorbed = self.strided.as_mut().is_some_and(|s| s.absorb(&piece));
        if !absorbed {
            out.extend(self.strided.replace(piece));
        }
    }

    fn finish(mut self, out: &mut Vec<Piece>) {
        if let Some(run) = self.run.take() {
            self.stage_two(run, out);
        }
        out.extend(self.strided);
    }
}

fn check_model(p: &Layout, c: &Layout) -> Result<(), PlanError> {
    let (ps, cs) = (p.spec(), c.spec());
    let mismatch = |field: &'static str, a: String, b: String| {
        Err(PlanError::ModelMismatch {
            field,
            producer: a,
            consumer: b,
        })
    };
    if ps.mla != cs.mla {
        return mismatch("mla", ps.mla.to_string(), cs.mla.to_string());
    }
    if ps.num_layers != cs.num_layers {
        return mismatch(
            "num_layers",
            ps.num_layers.to_string(),
            cs.num_layers.to_string(),
        );
    }
    if p.model_heads() != c.model_heads() {
        return mismatch(
            "total_kv_heads",
            p.model_heads().to_string(),
            c.model_heads().to_string(),
        );
    }
    if ps.head_dim != cs.head_dim {
        return mismatch("head_dim", ps.head_dim.to_string(), cs.head_dim.to_string());
    }
    if ps.dtype != cs.dtype {
        return mismatch("dtype", ps.dtype.to_string(), cs.dtype.to_string());
    }
    Ok(())
}

fn check_producers(producers: &[Layout]) -> Result<Vec<Option<usize>>, PlanError> {
    let reference = producers.first().ok_or(PlanError::NoProducers)?;
    let rs = reference.spec();
    let mut by_rank = vec![None; rs.tp_size as usize];
    for (index, layout) in producers.iter().enumerate() {
        let s = layout.spec();
        let differs = [
            ("num_layers", s.num_layers != rs.num_layers),
            ("total_kv_heads", s.total_kv_heads != rs.total_kv_heads),
            ("head_dim", s.head_dim != rs.head_dim),
            ("dtype", s.dtype != rs.dtype),
            ("mla", s.mla != rs.mla),
            ("block_tokens", s.block_tokens != rs.block_tokens),
            ("num_blocks", s.num_blocks != rs.num_blocks),
            ("tp_size", s.tp_size != rs.tp_size),
            ("order", s.order != rs.order),
            ("arrangement", s.arrangement != rs.arrangement),
        ]
        .into_iter()
        .find(|(_, d)| *d);
        if let Some((field, _)) = differs {
            return Err(PlanError::ProducersInconsistent {
                rank: layout.rank(),
                reference: reference.rank(),
                field,
            });
        }
        let slot = &mut by_rank[s.tp_rank as usize];
        if slot.is_some() {
            return Err(PlanError::MissingProducer(layout.rank()));
        }
        *slot = Some(index);
    }
    Ok(by_rank)
}

fn check_blocks(
    side: Side,
    layout: &Layout,
    blocks: &[BlockId],
    used: Range<usize>,
) -> Result<(), PlanError> {
    if blocks.len() < used.end {
        return Err(PlanError::NotEnoughBlocks {
            side,
            needed: used.end,
            given: blocks.len(),
        });
    }
    let num_blocks = layout.spec().num_blocks;
    for &block in &blocks[used.clone()] {
        if block.0 >= num_blocks {
            return Err(PlanError::BlockOutOfRange {
                side,
                block,
                num_blocks,
            });
        }
    }
    if side == Side::Consumer {
        let used = &blocks[used];
        // Strictly increasing ids (the common case) cannot repeat; otherwise sort a copy.
        if used.windows(2).any(|w| w[0] >= w[1]) {
            let mut sorted = used.to_vec();
            sorted.sort_unstable();
            if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                return Err(PlanError::DuplicateConsumerBlock(w[0]));
            }
        }
    }
    Ok(())
}

/// The order a layout's chunks are effectively in: `None` where every order coincides (one
/// head per rank, or one token per block, in a standard arrangement).
fn effective_order(layout: &Layout) -> Option<MemoryOrder> {
    let spec = layout.spec();
    let (heads, tokens) = (layout.local_heads() > 1, spec.block_tokens > 1);
    match spec.order {
        // Dimension-major keys differ from token-major ones whenever a block holds two tokens.
        MemoryOrder::HndKt if tokens => Some(MemoryOrder::HndKt),
        // Heads spread over the block (K, V interleaved per head) are head-major at any size.
        _ if heads && spec.arrangement == Arrangement::PerLayerHeadKv => Some(MemoryOrder::Hnd),
        MemoryOrder::HndKt => None,
        order => (heads && tokens).then_some(order),
    }
}

/// The order bytes travel in, and the order the consumer re-lays-out from afterwards (`None`
/// when no permute is needed). Dimension-major keys and a consumer whose heads are spread over
/// the block have no permute: both sides must then agree.
fn transfer_order(
    producer: &Layout,
    consumer: &Layout,
) -> Result<(MemoryOrder, Option<MemoryOrder>), PlanError> {
    if producer.cells_hold_kv() != consumer.cells_hold_kv() {
        return Err(PlanError::ArrangementMismatch {
            producer: producer.spec().arrangement,
            consumer: consumer.spec().arrangement,
        });
    }
    let (p, c) = (effective_order(producer), effective_order(consumer));
    let arrangement = consumer.spec().arrangement;
    let unsupported = Err(PlanError::UnsupportedReLayout {
        producer: producer.spec().order,
        consumer: consumer.spec().order,
        arrangement,
    });
    if p == Some(MemoryOrder::HndKt) || c == Some(MemoryOrder::HndKt) {
        // Only a one-token block (where keys are both dimension- and token-major) follows
        // dimension-major keys; nothing re-lays them out.
        let follows =
            |side: &Layout, own| own == Some(MemoryOrder::HndKt) || side.spec().block_tokens == 1;
        if follows(producer, p) && follows(consumer, c) {
            return Ok((MemoryOrder::HndKt, None));
        }
        return unsupported;
    }
    let order = p.or(c).unwrap_or(MemoryOrder::Nhd);
    match (p, c) {
        (Some(p), Some(c)) if p != c => {
            if matches!(
                arrangement,
                Arrangement::PerLayerHeadKv | Arrangement::PerLayerCellKv
            ) {
                return unsupported;
            }
            Ok((order, Some(p)))
        }
        _ => Ok((order, None)),
    }
}

fn head_groups(
    req: &PlanRequest<'_>,
    by_rank: &[Option<usize>],
) -> Result<Vec<HeadGroup>, PlanError> {
    let consumer = req.consumer;
    let tp_p = by_rank.len() as u32;
    let mut groups: Vec<HeadGroup> = Vec::new();
    for j in 0..consumer.local_heads() {
        let head = consumer.first_head() + j;
        let rank = producer_for_head(consumer, tp_p, head);
        if req.only_producer.is_some_and(|only| only.0 != rank) {
            continue;
        }
        let producer_index =
            by_rank[rank as usize].ok_or(PlanError::MissingProducer(Rank(rank)))?;
        let producer = &req.producers[producer_index];
        let producer_head = if consumer.spec().mla {
            0
        } else {
            head - producer.first_head()
        };
        match groups.last_mut() {
            Some(g)
                if g.producer.0 == rank
                    && g.consumer_head + g.heads == j
                    && g.producer_head + g.heads == producer_head =>
            {
                g.heads += 1;
            }
            _ => groups.push(HeadGroup {
                producer: Rank(rank),
                producer_index,
                consumer_head: j,
                producer_head,
                heads: 1,
            }),
        }
    }
    Ok(groups)
}

/// The producer rank (of a producer with TP size `producer_tp`) that serves global head `head`
/// of `consumer`. Where the producer replicates heads (TP above the head count, or MLA), consumer
/// ranks are spread over the replicas by `consumer_rank mod replicas`.
fn producer_for_head(consumer: &Layout, producer_tp: u32, head: u32) -> u32 {
    let c_rank = consumer.spec().tp_rank;
    if consumer.spec().mla {
        return c_rank % producer_tp;
    }
    let heads = consumer.model_heads();
    if producer_tp <= heads {
        head / (heads / producer_tp)
    } else {
        let replicas = producer_tp / heads;
        head * replicas + c_rank % replicas
    }
}

/// The producer ranks that write to `consumer` when the producer runs with TP size
/// `producer_tp` (ascending): the consumer registers with each and waits for one completion
/// notice from each. Agrees with [`Plan::writers`] for any request with at least one token.
///
/// # Errors
/// [`PlanError::ModelMismatch`] when the producer's TP size cannot split the model's heads.
pub fn writers_for(consumer: &Layout, producer_tp: u32) -> Result<Vec<Rank>, PlanError> {
    let heads = consumer.model_heads();
    if producer_tp == 0
        || !(consumer.spec().mla
            || heads.is_multiple_of(producer_tp)
            || producer_tp.is_multiple_of(heads))
    {
        return Err(PlanError::ModelMismatch {
            field: "tp_size",
            producer: producer_tp.to_string(),
            consumer: format!("{heads} KV heads"),
        });
    }
    let mut ranks: Vec<Rank> = (0..consumer.local_heads())
        .map(|j| {
            Rank(producer_for_head(
                consumer,
                producer_tp,
                consumer.first_head() + j,
            ))
        })
        .collect();
    ranks.dedup();
    Ok(ranks)
}

/// The consumer ranks that producer rank `producer` (of a producer with TP size `producer_tp`)
/// writes to, for a consumer engine whose ranks are laid out like `consumer` (any of its ranks):
/// the inverse of [`writers_for`]. A producer rank keeps a request's blocks until every one of
/// them has been served.
///
/// # Errors
/// [`PlanError::ModelMismatch`] when `producer_tp` cannot split the model's heads, or a consumer
/// rank's layout is invalid.
pub fn readers_for(
    producer: Rank,
    producer_tp: u32,
    consumer: &Layout,
) -> Result<Vec<Rank>, PlanError> {
    Ok(writers_of_each_rank(consumer, producer_tp)?
        .into_iter()
        .enumerate()
        .filter(|(_, writers)| writers.contains(&producer))
        .map(|(rank, _)| Rank(rank as u32))
        .collect())
}

/// [`writers_for`] of every rank of a consumer engine laid out like `consumer`, by rank.
fn writers_of_each_rank(consumer: &Layout, producer_tp: u32) -> Result<Vec<Vec<Rank>>, PlanError> {
    (0..consumer.spec().tp_size)
        .map(|rank| {
            let mut spec = consumer.spec().clone();
            spec.tp_rank = rank;
            let layout = Layout::new(spec).map_err(|e| PlanError::ModelMismatch {
                field: "consumer layout",
                producer: String::new(),
                consumer: e.to_string(),
            })?;
            writers_for(&layout, producer_tp)
        })
        .collect()
}

/// The producer ranks (of a producer with TP size `producer_tp`) that write to no rank of a
/// consumer engine laid out like `consumer` (any of its ranks), ascending: where the producer
/// replicates what the consumer needs (MLA's latent on every rank, or KV heads replicated by a
/// TP above the head count) and the consumer has fewer ranks than replicas. Such a rank holds a
/// finished request's blocks for nobody: the consumer tells it so ([`readers_for`] is empty for
/// it).
///
/// # Errors
/// As [`readers_for`].
pub fn idle_producers(producer_tp: u32, consumer: &Layout) -> Result<Vec<Rank>, PlanError> {
    let writing: std::collections::HashSet<Rank> = writers_of_each_rank(consumer, producer_tp)?
        .into_iter()
        .flatten()
        .collect();
    Ok((0..producer_tp)
        .map(Rank)
        .filter(|r| !writing.contains(r))
        .collect())
}

/// Plans the copy operations of one request for one consumer rank.
pub fn plan(req: &PlanRequest<'_>) -> Result<Plan, PlanError> {
    plan_layers(req, 0..req.consumer.spec().num_layers)
}

/// Plans the copy operations of one request for one consumer rank, in `layers` only: what a
/// producer writes once those layers of the tokens are final (layer-wise streaming). Planning
/// a partition of the layers one part at a time gives the operations of [`plan`], in the same
/// order for each producer rank.
///
/// # Errors
/// [`PlanError::LayersOutOfRange`] when `layers` is not within the model's layers; otherwise
/// as [`plan`].
pub fn plan_layers(req: &PlanRequest<'_>, layers: Range<u32>) -> Result<Plan, PlanError> {
    if req.producer_groups.is_empty() && req.consumer_groups.is_empty() {
        plan_group(req, layers)
    } else {
        plan_groups(req, layers)
    }
}

/// The plans of every KV cache group of a hybrid model's request, one after the other.
fn plan_groups(req: &PlanRequest<'_>, layers: Range<u32>) -> Result<Plan, PlanError> {
    let mut plans = vec![plan_group(&req.first_group(), layers.clone())?];
    for alone in req.further_groups()? {
        plans.push(plan_group(&alone, layers.clone())?);
    }
    Ok(Plan::concat(plans))
}

impl<'a> PlanRequest<'a> {
    /// The request of its first KV cache group alone.
    #[must_use]
    pub fn first_group(&self) -> PlanRequest<'a> {
        PlanRequest {
            producer_groups: &[],
            consumer_groups: &[],
            ..*self
        }
    }

    /// The requests of its further KV cache groups alone, in order, leaving out those that move
    /// nothing. A further group moves the tokens both sides' groups hold
    /// ([`GroupBlocks::first_token`] on, beyond the request's skip).
    ///
    /// # Errors
    /// [`PlanError::GroupCount`] where the two sides name different numbers of groups.
    pub fn further_groups(&self) -> Result<Vec<PlanRequest<'a>>, PlanError> {
        if self.producer_groups.len() != self.consumer_groups.len() {
            return Err(PlanError::GroupCount {
                producer: self.producer_groups.len(),
                consumer: self.consumer_groups.len(),
            });
        }
        Ok(self
            .producer_groups
            .iter()
            .zip(self.consumer_groups)
            .filter_map(|(produced, wanted)| {
                let skip = self
                    .skip_tokens
                    .max(u64::from(wanted.first_token))
                    .max(u64::from(produced.first_token));
                (skip < self.num_tokens).then(|| PlanRequest {
                    skip_tokens: skip,
                    producer_blocks: &produced.blocks,
                    consumer_blocks: &wanted.blocks,
                    ..self.first_group()
                })
            })
            .collect())
    }
}

/// [`plan_layers`] for the first KV cache group alone.
fn plan_group(req: &PlanRequest<'_>, layers: Range<u32>) -> Result<Plan, PlanError> {
    let consumer = req.consumer;
    let num_layers = consumer.spec().num_layers;
    if layers.start > layers.end || layers.end > num_layers {
        return Err(PlanError::LayersOutOfRange { layers, num_layers });
    }
    let by_rank = check_producers(req.producers)?;
    let reference = &req.producers[0];
    check_model(reference, consumer)?;
    let (n, skip) = (req.num_tokens, req.skip_tokens);
    if skip > n {
        return Err(PlanError::SkipBeyondTokens { skip, tokens: n });
    }
    let bp = u64::from(reference.spec().block_tokens);
    let bc = u64::from(consumer.spec().block_tokens);
    let used = |b: u64| (skip / b) as usize..n.div_ceil(b) as usize;
    check_blocks(Side::Producer, reference, req.producer_blocks, used(bp))?;
    check_blocks(Side::Consumer, consumer, req.consumer_blocks, used(bc))?;

    // Bytes travel in the producer's order; the consumer re-lays-out afterwards if needed.
    let (order, permute_from) = transfer_order(reference, consumer)?;
    let needs_permute = permute_from.is_some();
    if needs_permute && skip % bc != 0 {
        return Err(PlanError::UnalignedSkip {
            skip,
            block_tokens: consumer.spec().block_tokens,
        });
    }

    let groups = head_groups(req, &by_rank)?;
    // Dimension-major keys need their own template; otherwise K and V share one.
    let kv_templates: Vec<Vec<Vec<Piece>>> = if order == MemoryOrder::HndKt {
        (0..consumer.kv_parts())
            .map(|kv| build_templates(req, &groups, order, kv, bp, bc))
            .collect()
    } else {
        vec![build_templates(req, &groups, order, 0, bp, bc)]
    };

    let mut ops = Vec::new();
    let mut writers: Vec<(Rank, Range<usize>)> = Vec::new();
    let mut ranks: Vec<(Rank, usize)> = groups
        .iter()
        .map(|g| (g.producer, g.producer_index))
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    // Cells holding K then V (on both sides: `transfer_order` checked) move whole, as one part
    // of twice the width (`Layout::vector_pitch`).
    let parts = if consumer.cells_hold_kv() {
        1
    } else {
        consumer.kv_parts()
    };
    let template_ops: usize = kv_templates.iter().flatten().map(Vec::len).sum();
    let per_kv = kv_templates.len() as u32;
    ops.reserve(template_ops * (layers.len() as u32 * parts / per_kv) as usize);
    for (rank, producer_index) in ranks {
        let producer = &req.producers[producer_index];
        let start = ops.len();
        for layer in layers.clone() {
            for kv in 0..parts {
                let src = producer.chunk_place(layer, kv);
                let dst = consumer.chunk_place(layer, kv);
                let templates = &kv_templates[if per_kv > 1 { kv as usize } else { 0 }];
                for (group, template) in groups.iter().zip(templates) {
                    if group.producer != rank {
                        continue;
                    }
                    ops.extend(template.iter().map(|piece| CopyOp {
                        producer: rank,
                        src_region: src.region,
                        src_offset: src.base + piece.src,
                        dst_region: dst.region,
                        dst_offset: dst.base + piece.dst,
                        len: piece.len,
                        count: piece.count,
                        src_stride: piece.src_stride,
                        dst_stride: piece.dst_stride,
                    }));
                }
            }
        }
        if ops.len() > start {
            writers.push((rank, start..ops.len()));
        }
    }
    let bytes = ops.iter().map(CopyOp::bytes).sum();
    let permute = (needs_permute && req.only_producer.is_none() && n > skip)
        .then(|| permute_plan(consumer, req.consumer_blocks, n, skip, order, layers));
    debug_assert!(permute_from.is_none_or(|from| from == order));
    Ok(Plan {
        ops,
        writers,
        permute,
        bytes,
    })
}

/// A head group's producer-side numbers, as [`build_templates`] uses them at every segment.
#[derive(Clone, Copy, Debug)]
struct GroupGeometry {
    /// The producer rank's heads.
    hp: u64,
    /// Its head pitch and block stride.
    p_pitch: u64,
    p_stride: u64,
    /// The group's first head on each side, and its number of heads.
    jp: u64,
    jc: u64,
    nh: u64,
}

/// A stretch of the request's tokens that lies in one producer block and one consumer block.
#[derive(Clone, Copy, Debug)]
struct Segment {
    /// The producer block's id.
    p_block: u64,
    /// The stretch's first slot in the producer block.
    ps: u64,
    /// The consumer block's offset in its chunk (`id * block stride`).
    c_chunk: u64,
    /// The stretch's first slot in the consumer block.
    cs: u64,
    /// Its tokens.
    len: u64,
}

/// Calls `f` with each segment of the request's tokens past its skip, in token order. Block
/// indices and offsets advance with the segments: no division per segment. Generic over `f`, so
/// that each memory order's piece arithmetic is compiled into its own loop.
fn for_each_segment(
    req: &PlanRequest<'_>,
    bp: u64,
    bc: u64,
    c_stride: u64,
    mut f: impl FnMut(Segment),
) {
    let n = req.num_tokens;
    let mut t = req.skip_tokens;
    let (mut pbi, mut ps) = (t / bp, t % bp);
    let (mut cbi, mut cs) = (t / bc, t % bc);
    while t < n {
        let len = (bp - ps).min(bc - cs).min(n - t);
        f(Segment {
            p_block: u64::from(req.producer_blocks[pbi as usize].0),
            ps,
            c_chunk: u64::from(req.consumer_blocks[cbi as usize].0) * c_stride,
            cs,
            len,
        });
        t += len;
        ps += len;
        if ps == bp {
            ps = 0;
            pbi += 1;
        }
        cs += len;
        if cs == bc {
            cs = 0;
            cbi += 1;
        }
    }
}

/// The template of part `kv` (which matters only for [`MemoryOrder::HndKt`]).
fn build_templates(
    req: &PlanRequest<'_>,
    groups: &[HeadGroup],
    order: MemoryOrder,
    kv: u32,
    bp: u64,
    bc: u64,
) -> Vec<Vec<Piece>> {
    let consumer = req.consumer;
    // A head vector, or a whole K-then-V cell where cells hold both (the same on both sides).
    let head_bytes = consumer.vector_pitch();
    let hc = u64::from(consumer.local_heads());
    let c_stride = consumer.block_stride();
    let c_pitch = consumer.head_pitch();
    let element = u64::from(consumer.spec().dtype.size());
    let dims = head_bytes / element;
    // Each group: what it needs of its producer rank (read once instead of at every segment),
    // its merger and the template it grows.
    let mut out: Vec<(GroupGeometry, Merger, Vec<Piece>)> = groups
        .iter()
        .map(|g| {
            let producer = &req.producers[g.producer_index];
            let geometry = GroupGeometry {
                hp: u64::from(producer.local_heads()),
                p_pitch: producer.head_pitch(),
                p_stride: producer.block_stride(),
                jp: u64::from(g.producer_head),
                jc: u64::from(g.consumer_head),
                nh: u64::from(g.heads),
            };
            (geometry, Merger::default(), Vec::new())
        })
        .collect();
    match order {
        // One piece per token: the group's heads of that token.
        MemoryOrder::Nhd => for_each_segment(req, bp, bc, c_stride, |s| {
            for (g, merger, template) in &mut out {
                let piece = Piece::strided(
                    s.p_block * g.p_stride + (s.ps * g.hp + g.jp) * head_bytes,
                    s.c_chunk + (s.cs * hc + g.jc) * head_bytes,
                    g.nh * head_bytes,
                    s.len,
                    g.hp * head_bytes,
                    hc * head_bytes,
                );
                merger.push(piece, template);
            }
        }),
        // Dimension-major keys: per head, one piece per dimension, each the segment's tokens
        // of that dimension.
        MemoryOrder::HndKt if kv == 0 => for_each_segment(req, bp, bc, c_stride, |s| {
            for (g, merger, template) in &mut out {
                let p_chunk = s.p_block * g.p_stride;
                for i in 0..g.nh {
                    let piece = Piece::strided(
                        p_chunk + (g.jp + i) * g.p_pitch + s.ps * element,
                        s.c_chunk + (g.jc + i) * c_pitch + s.cs * element,
                        s.len * element,
                        dims,
                        bp * element,
                        bc * element,
                    );
                    merger.push(piece, template);
                }
            }
        }),
        // One piece per head: the segment's tokens of that head.
        MemoryOrder::Hnd | MemoryOrder::HndKt => for_each_segment(req, bp, bc, c_stride, |s| {
            for (g, merger, template) in &mut out {
                let piece = Piece::strided(
                    s.p_block * g.p_stride + g.jp * g.p_pitch + s.ps * head_bytes,
                    s.c_chunk + g.jc * c_pitch + s.cs * head_bytes,
                    s.len * head_bytes,
                    g.nh,
                    g.p_pitch,
                    c_pitch,
                );
                merger.push(piece, template);
            }
        }),
    }
    out.into_iter()
        .map(|(_, merger, mut template)| {
            merger.finish(&mut template);
            template
        })
        .collect()
}

fn permute_plan(
    consumer: &Layout,
    consumer_blocks: &[BlockId],
    num_tokens: u64,
    skip_tokens: u64,
    from: MemoryOrder,
    layers: Range<u32>,
) -> PermutePlan {
    let spec = consumer.spec();
    let bc = u64::from(spec.block_tokens);
    let (n, skip) = (num_tokens, skip_tokens);
    let first_block = skip / bc;
    let last_block = n.div_ceil(bc);
    let mut chunks = Vec::new();
    for layer in layers {
        for kv in 0..consumer.kv_parts() {
            let place = consumer.chunk_place(layer, kv);
            for bi in first_block..last_block {
                let block_start = bi * bc;
                let first_slot = skip.saturating_sub(block_start).min(bc);
                let end = (n - block_start).min(bc);
                chunks.push(Permute {
                    region: place.region,
                    offset: place.base
                        + u64::from(consumer_blocks[bi as usize].0) * consumer.block_stride(),
                    from,
                    to: spec.order,
                    block_tokens: spec.block_tokens,
                    first_slot: first_slot as u32,
                    slots: (end - first_slot) as u32,
                    heads: consumer.local_heads(),
                    head_bytes: consumer.head_bytes(),
                });
            }
        }
    }
    PermutePlan { chunks }
}

/// The re-layout a consumer must apply after a transfer from `producer` (any producer rank's
/// layout) into `consumer_blocks`, computed on the consumer side alone (push mode, where the
/// producer's block ids are never seen by the consumer). `None` when the memory orders agree.
///
/// # Errors
/// [`PlanError::UnalignedSkip`], [`PlanError::SkipBeyondTokens`] and block errors, as [`plan`].
pub fn permute_for(
    producer: &Layout,
    consumer: &Layout,
    num_tokens: u64,
    skip_tokens: u64,
    consumer_blocks: &[BlockId],
    consumer_groups: &[GroupBlocks],
) -> Result<Option<PermutePlan>, PlanError> {
    let Some(mut whole) =
        permute_group(producer, consumer, num_tokens, skip_tokens, consumer_blocks)?
    else {
        return Ok(None);
    };
    // A group's first token need not start a block: the re-layout covers the whole block (the
    // group keeps nothing before it, so nothing there is moved or read).
    let bc = u64::from(consumer.spec().block_tokens);
    for group in consumer_groups {
        let first = u64::from(group.first_token);
        let skip = skip_tokens.max(first - first % bc);
        if let Some(more) = permute_group(producer, consumer, num_tokens, skip, &group.blocks)? {
            whole.chunks.extend(more.chunks);
        }
    }
    Ok(Some(whole))
}

/// [`permute_for`] for one KV cache group.
fn permute_group(
    producer: &Layout,
    consumer: &Layout,
    num_tokens: u64,
    skip_tokens: u64,
    consumer_blocks: &[BlockId],
) -> Result<Option<PermutePlan>, PlanError> {
    if skip_tokens > num_tokens {
        return Err(PlanError::SkipBeyondTokens {
            skip: skip_tokens,
            tokens: num_tokens,
        });
    }
    let (_, from) = transfer_order(producer, consumer)?;
    let Some(from) = from else {
        return Ok(None);
    };
    let bc = u64::from(consumer.spec().block_tokens);
    if !skip_tokens.is_multiple_of(bc) {
        return Err(PlanError::UnalignedSkip {
            skip: skip_tokens,
            block_tokens: consumer.spec().block_tokens,
        });
    }
    let used = (skip_tokens / bc) as usize..num_tokens.div_ceil(bc) as usize;
    check_blocks(Side::Consumer, consumer, consumer_blocks, used)?;
    Ok((num_tokens > skip_tokens).then(|| {
        permute_plan(
            consumer,
            consumer_blocks,
            num_tokens,
            skip_tokens,
            from,
            0..consumer.spec().num_layers,
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(src: u64, dst: u64, len: u64) -> Piece {
        Piece::strided(src, dst, len, 1, 0, 0)
    }

    #[test]
    fn adjacent_pieces_extend() {
        let mut a = p(0, 100, 10);
        assert!(a.absorb(&p(10, 110, 10)));
        assert_eq!(a, p(0, 100, 20));
    }

    #[test]
    fn equal_pieces_at_fixed_spacing_become_strided() {
        let mut a = p(0, 0, 4);
        assert!(a.absorb(&p(4, 8, 4)));
        assert!(a.absorb(&p(8, 16, 4)));
        assert_eq!(
            a,
            Piece {
                src: 0,
                dst: 0,
                len: 4,
                count: 3,
                src_stride: 4,
                dst_stride: 8
            }
        );
        assert!(!a.absorb(&p(12, 20, 4)), "wrong spacing must not merge");
        let mut b = a;
        assert!(b.absorb(&Piece::strided(12, 24, 4, 2, 4, 8)));
        assert_eq!(b.count, 5);
    }

    #[test]
    fn backwards_or_overlapping_pieces_do_not_merge() {
        let mut a = p(100, 100, 4);
        assert!(!a.absorb(&p(0, 200, 4)));
        assert!(!a.absorb(&p(102, 300, 4)));
    }

    #[test]
    fn full_width_strides_collapse_to_runs() {
        assert_eq!(Piece::strided(0, 0, 8, 4, 8, 8), p(0, 0, 32));
    }

    fn consumer(total_kv_heads: u32, mla: bool, tp_size: u32) -> Layout {
        Layout::new(kvx_core::LayoutSpec {
            num_layers: 2,
            total_kv_heads,
            head_dim: 8,
            dtype: kvx_core::Dtype::F32,
            mla,
            block_tokens: 4,
            num_blocks: 8,
            tp_size,
            tp_rank: 0,
            order: kvx_core::MemoryOrder::Nhd,
            arrangement: kvx_core::Arrangement::PerLayerSplit,
        })
        .unwrap()
    }

    /// A producer rank no consumer rank reads from is idle: MLA with fewer consumer ranks than
    /// producer ranks, or KV heads replicated beyond what the consumer's ranks take; none where
    /// every producer rank holds heads of its own.
    #[test]
    fn idle_producers_are_the_replicas_no_consumer_rank_reads() {
        let ranks = |v: &[u32]| v.iter().copied().map(Rank).collect::<Vec<_>>();
        assert_eq!(
            idle_producers(2, &consumer(1, true, 1)).unwrap(),
            ranks(&[1])
        );
        assert_eq!(
            idle_producers(8, &consumer(1, true, 2)).unwrap(),
            ranks(&[2, 3, 4, 5, 6, 7])
        );
        assert_eq!(
            idle_producers(2, &consumer(1, true, 2)).unwrap(),
            ranks(&[])
        );
        // 2 KV heads, each replicated 4 times by TP 8; a TP-2 consumer's ranks read replicas 0
        // (of head 0, rank 0) and 1 (of head 1, rank 5).
        assert_eq!(
            idle_producers(8, &consumer(2, false, 2)).unwrap(),
            ranks(&[1, 2, 3, 4, 6, 7])
        );
        assert_eq!(
            idle_producers(4, &consumer(8, false, 2)).unwrap(),
            ranks(&[])
        );
        for rank in idle_producers(8, &consumer(2, false, 2)).unwrap() {
            assert!(readers_for(rank, 8, &consumer(2, false, 2))
                .unwrap()
                .is_empty());
        }
    }
}
