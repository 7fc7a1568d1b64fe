//! Transfers: NIXL descriptor lists built from copy operations (per transfer, or as indices into
//! lists prepared once: [`Prepared`]), the requests in flight ([`Pending`]), and how they finish
//! or fail.

use std::time::Instant;

use kvx_core::MemoryKind;
use kvx_layout::CopyOp;
use nixl_sys as sys;

use super::notify::{tagged, TAG_NOTICE, TAG_PROBE};
use super::{nixl_error, NixlTransport, Peer, PREPARE_FROM_PIECES};
use crate::error::{BackendError, OpError};
use crate::transport::{Event, Notice, OpId, OpKind, PeerId};

/// A memory range handed to NIXL's registration: host memory, or CUDA memory of a device.
#[derive(Debug)]
pub(super) struct Span {
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) kind: MemoryKind,
}

/// NIXL's memory type and device id for a region kind (only host and CUDA memory get here).
pub(super) fn nixl_memory(kind: MemoryKind) -> (sys::MemType, u64) {
    match kind {
        MemoryKind::Cuda { device } => (sys::MemType::Vram, u64::from(device)),
        _ => (sys::MemType::Dram, 0),
    }
}

/// Whether NIXL's UCX backend registers this kind here.
pub(super) fn nixl_accepts(kind: MemoryKind) -> bool {
    matches!(kind, MemoryKind::Host | MemoryKind::Cuda { .. })
}

impl sys::MemoryRegion for Span {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl sys::NixlDescriptor for Span {
    fn mem_type(&self) -> sys::MemType {
        nixl_memory(self.kind).0
    }

    fn device_id(&self) -> u64 {
        nixl_memory(self.kind).1
    }
}

/// A NIXL descriptor list prepared once (`prepXferDlist`): every registered region of one side
/// (this endpoint's, or a peer's) cut into `unit`-byte descriptors, in region order. A transfer
/// whose pieces are multiples of `unit` at multiples of `unit` names them by index
/// (`makeXferReq`, which merges consecutive descriptors that are adjacent on both sides back into
/// one), so NIXL does not look each piece up in the registrations per transfer.
pub(super) struct Prepared {
    pub(super) unit: u64,
    /// Index of each region's first descriptor, by region index (-1: no such region).
    first: Vec<i64>,
    descriptors: usize,
    handle: PreparedHandle,
}

/// Owns NIXL's prepared list; released (`releasedDlistH`) when dropped.
struct PreparedHandle(sys::XferDlistHandle);

// SAFETY: the handle is a pointer to NIXL's prepared list and to the agent that made it. It is
// used only by the `NixlTransport` that owns it, through `&mut self` (one thread at a time, as the
// agent itself, created with `ThreadSync::None`), and the transport drops it before the agent
// (field order); moving it to another thread with its transport is no different from moving the
// agent.
unsafe impl Send for PreparedHandle {}

/// A local and a remote descriptor list of equal length.
pub(super) type DescPair = (sys::XferDescList<'static>, sys::XferDescList<'static>);

/// Highest region index + 1 a prepared list takes.
const MAX_REGION_SLOTS: usize = 1 << 16;

/// A memory range of a prepared list: region index, its address, length and kind.
pub(super) type SideRegion = (u32, u64, u64, MemoryKind);

impl Prepared {
    /// Prepares `regions` in `unit`-byte descriptors for `agent_name` (`""`: this endpoint's own
    /// memory); `None` when they are more than `limit` descriptors, mix host and GPU memory, or
    /// are none at all.
    pub(super) fn build(
        agent: &sys::Agent,
        agent_name: &str,
        regions: &mut [SideRegion],
        unit: u64,
        limit: usize,
    ) -> Result<Option<Self>, BackendError> {
        let gpu = |k: MemoryKind| matches!(k, MemoryKind::Cuda { .. });
        let Some(&(_, _, _, kind)) = regions.first() else {
            return Ok(None);
        };
        if unit == 0 || regions.iter().any(|r| gpu(r.3) != gpu(kind)) {
            return Ok(None);
        }
        let total: u64 = regions.iter().map(|r| r.2 / unit).sum();
        if total == 0 || total > limit.min(i32::MAX as usize) as u64 {
            return Ok(None);
        }
        regions.sort_unstable_by_key(|r| r.0);
        // Region indices are layout indices (layers, K/V): small.
        let slots = regions.last().map_or(0, |r| r.0 as usize + 1);
        if slots > MAX_REGION_SLOTS {
            return Ok(None);
        }
        let mut list =
            sys::XferDescList::new(nixl_memory(kind).0).map_err(nixl_error("createXferDlist"))?;
        let mut first = vec![-1; slots];
        let mut next = 0u64;
        for &(index, addr, len, kind) in regions.iter() {
            first[index as usize] = next as i64;
            let device = nixl_memory(kind).1;
            for k in 0..len / unit {
                list.add_desc((addr + k * unit) as usize, unit as usize, device);
            }
            next += len / unit;
        }
        let handle = agent
            .prepare_xfer_dlist(agent_name, &list, None)
            .map_err(nixl_error("prepXferDlist"))?;
        Ok(Some(Self {
            unit,
            first,
            descriptors: next as usize,
            handle: PreparedHandle(handle),
        }))
    }

    /// Descriptors in the list.
    pub(super) fn len(&self) -> usize {
        self.descriptors
    }

    /// Index of the descriptor at `offset` (`unit`-aligned) of `region`.
    fn index_of(&self, region: u32, offset: u64) -> i64 {
        // Every region of an accepted operation is in the list (it was prepared over all).
        self.first.get(region as usize).copied().unwrap_or(0) + (offset / self.unit) as i64
    }
}

/// The indices of the pieces of `ops` in the local and the remote prepared lists (every piece a
/// multiple of their unit at a multiple of it); `write` says whether local is the source side.
fn indices<'a>(
    local: &Prepared,
    remote: &Prepared,
    ops: impl Iterator<Item = &'a CopyOp> + Clone,
    write: bool,
) -> (Vec<i32>, Vec<i32>) {
    let unit = local.unit;
    let total: u64 = ops.clone().map(|op| op.count * (op.len / unit)).sum();
    let (mut local_indices, mut remote_indices) = (
        Vec::with_capacity(total as usize),
        Vec::with_capacity(total as usize),
    );
    for op in ops {
        let (src, dst) = (
            (op.src_region, op.src_offset, op.src_stride),
            (op.dst_region, op.dst_offset, op.dst_stride),
        );
        let (l, r) = if write { (src, dst) } else { (dst, src) };
        // One lookup per operation; its pieces are arithmetic.
        let (l_first, r_first) = (local.index_of(l.0, l.1), remote.index_of(r.0, r.1));
        let (l_step, r_step) = ((l.2 / unit) as i64, (r.2 / unit) as i64);
        let units = (op.len / unit) as i64;
        for i in 0..op.count as i64 {
            let (l0, r0) = (l_first + i * l_step, r_first + i * r_step);
            // In range of `i32`: a prepared list holds at most `i32::MAX` descriptors.
            local_indices.extend((l0..l0 + units).map(|x| x as i32));
            remote_indices.extend((r0..r0 + units).map(|x| x as i32));
        }
    }
    (local_indices, remote_indices)
}

/// The largest unit every piece of `op` is made of: the greatest common divisor of its offsets,
/// length and (for several pieces) strides.
pub(super) fn op_unit(op: &CopyOp) -> u64 {
    let mut g = gcd(gcd(op.src_offset, op.dst_offset), op.len);
    if op.count > 1 {
        g = gcd(gcd(g, op.src_stride), op.dst_stride);
    }
    g
}

/// Whether every piece of `op` is a whole number of `unit`s at a multiple of `unit`.
fn made_of(op: &CopyOp, unit: u64) -> bool {
    let strides = if op.count > 1 {
        [op.src_stride, op.dst_stride]
    } else {
        [0, 0]
    };
    let values = [op.src_offset, op.dst_offset, op.len, strides[0], strides[1]];
    if unit.is_power_of_two() {
        values.iter().fold(0, |all, v| all | v) & (unit - 1) == 0
    } else {
        values.iter().all(|v| v.is_multiple_of(unit))
    }
}

/// The operations of `ops` whose `aligned` flag is `flag`.
fn only<'a>(
    ops: &'a [CopyOp],
    aligned: &'a [bool],
    flag: bool,
) -> impl Iterator<Item = &'a CopyOp> + Clone {
    ops.iter()
        .zip(aligned)
        .filter(move |(_, &a)| a == flag)
        .map(|(op, _)| op)
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// An accepted transfer.
pub(super) struct Pending {
    /// The NIXL requests, posted in order: the pieces of the prepared lists' unit, then the
    /// others, each cut at [`NixlConfig::max_request_descriptors`] (the notification rides on
    /// the last, see [`NixlTransport::submit`]).
    pub(super) requests: Vec<sys::XferRequest>,
    /// The first failure seen (a request that could not be posted, which left those after it
    /// unposted, or a request's failed status) while others were still in flight: reported once
    /// they have settled.
    pub(super) failed: Option<BackendError>,
    pub(super) kind: OpKind,
    pub(super) peer: PeerId,
    pub(super) bytes: u64,
    pub(super) deadline: Instant,
    pub(super) local_regions: Vec<u32>,
    /// Reported as timed out; NIXL still owns the request, which is released silently once it
    /// finishes.
    pub(super) abandoned: bool,
}

impl NixlTransport {
    /// Builds the local and remote descriptor lists of `ops`, at most `max` descriptors a pair
    /// (at least one pair, empty without pieces); `write` says whether local is the source side.
    /// Every lookup succeeds: `check_ops` accepted the operations against the same tables.
    pub(super) fn descriptors<'a>(
        &self,
        peer: &Peer,
        ops: impl Iterator<Item = &'a CopyOp> + Clone,
        write: bool,
        max: usize,
    ) -> Result<Vec<DescPair>, BackendError> {
        // One list holds one memory type: every local region of the operations must be host
        // memory, or every one GPU memory (of any devices), and the same for the remote side.
        let kinds =
            |side: &dyn Fn(&CopyOp) -> Option<MemoryKind>| -> Result<sys::MemType, BackendError> {
                let mut kinds = ops.clone().filter_map(side);
                let first = kinds.next().unwrap_or(MemoryKind::Host);
                let is_gpu = |k: MemoryKind| matches!(k, MemoryKind::Cuda { .. });
                match kinds.find(|k| is_gpu(*k) != is_gpu(first)) {
                    Some(other) => Err(format!(
                    "one transfer mixes {first} and {other} memory on one side; NIXL takes one \
                     memory type per descriptor list"
                )
                    .into()),
                    None => Ok(nixl_memory(first).0),
                }
            };
        let local_of = |op: &CopyOp| if write { op.src_region } else { op.dst_region };
        let remote_of = |op: &CopyOp| if write { op.dst_region } else { op.src_region };
        let local_type = kinds(&|op| self.regions.get(&local_of(op)).map(|r| r.region.kind()))?;
        let remote_type = kinds(&|op| peer.desc.region(remote_of(op)).map(|r| r.kind))?;
        let pair = || -> Result<DescPair, BackendError> {
            Ok((
                sys::XferDescList::new(local_type).map_err(nixl_error("createXferDlist"))?,
                sys::XferDescList::new(remote_type).map_err(nixl_error("createXferDlist"))?,
            ))
        };
        let mut lists = vec![pair()?];
        let mut in_last = 0;
        for op in ops {
            let (local_region, remote_region) = (local_of(op), remote_of(op));
            let (Some(l), Some(r)) = (
                self.regions.get(&local_region),
                peer.desc.region(remote_region),
            ) else {
                return Err(format!(
                    "region {local_region} or the peer's region {remote_region} vanished"
                )
                .into());
            };
            let local_base = l.region.addr() as u64;
            // Each region's own device (one side may span several GPUs).
            let (local_dev, remote_dev) = (nixl_memory(l.region.kind()).1, nixl_memory(r.kind).1);
            for (src, dst, len) in op.pieces() {
                if in_last == max {
                    lists.push(pair()?);
                    in_last = 0;
                }
                in_last += 1;
                let (local, remote) = lists.last_mut().expect("one pair at least");
                let (local_offset, remote_offset) = if write { (src, dst) } else { (dst, src) };
                // In range: `check_ops` bounded every piece by the registered lengths, and a
                // registered region lies inside the (unified) address space.
                local.add_desc(
                    (local_base + local_offset) as usize,
                    len as usize,
                    local_dev,
                );
                remote.add_desc((r.addr + remote_offset) as usize, len as usize, remote_dev);
            }
        }
        Ok(lists)
    }

    /// The unit of the prepared lists that a transfer of `ops` to `peer_id` uses for its
    /// operations of that unit, preparing the lists first where needed; `None`: every piece
    /// is described per transfer.
    ///
    /// This endpoint's list is prepared at the first transfer of at least
    /// [`PREPARE_FROM_PIECES`] pieces, in the unit of its largest operation, and keeps that
    /// unit (its regions changing prepares it again); each peer's list follows it. Operations
    /// of another unit (the partial last block of a request, say) are described per transfer.
    fn prepared_unit(&mut self, peer_id: PeerId, ops: &[CopyOp]) -> Option<u64> {
        if self.prepared_limit == 0 {
            return None;
        }
        let unit = match &self.prepared_local {
            Some(local) => local.unit,
            None => {
                let pieces: u64 = ops.iter().map(|op| op.count).sum();
                if pieces < PREPARE_FROM_PIECES {
                    return None;
                }
                let largest = ops
                    .iter()
                    .max_by_key(|op| op.len.saturating_mul(op.count))?;
                let unit = op_unit(largest);
                let mut regions: Vec<SideRegion> = self
                    .regions
                    .values()
                    .map(|r| (r.remote.index, r.remote.addr, r.remote.len, r.remote.kind))
                    .collect();
                self.prepared_local = self.prepare("", &mut regions, unit);
                self.prepared_local.as_ref()?.unit
            }
        };
        if self
            .prepared_remote
            .get(&peer_id)
            .is_none_or(|r| r.unit != unit)
        {
            self.prepared_remote.remove(&peer_id);
            let peer = self.peers.get(peer_id)?;
            let name = peer.name.clone();
            let mut regions: Vec<SideRegion> = peer
                .desc
                .regions
                .iter()
                .map(|r| (r.index, r.addr, r.len, r.kind))
                .collect();
            let prepared = self.prepare(&name, &mut regions, unit)?;
            self.prepared_remote.insert(peer_id, prepared);
        }
        Some(unit)
    }

    /// [`Prepared::build`], logged; a NIXL failure turns preparing off for this endpoint.
    fn prepare(
        &mut self,
        agent_name: &str,
        regions: &mut [SideRegion],
        unit: u64,
    ) -> Option<Prepared> {
        let start = Instant::now();
        match Prepared::build(&self.agent, agent_name, regions, unit, self.prepared_limit) {
            Ok(Some(prepared)) => {
                tracing::debug!(
                    agent = %self.name,
                    side = if agent_name.is_empty() { "local" } else { agent_name },
                    unit,
                    descriptors = prepared.len(),
                    took_us = start.elapsed().as_micros() as u64,
                    "kvx nixl: descriptor list prepared"
                );
                Some(prepared)
            }
            Ok(None) => None,
            Err(error) => {
                tracing::warn!(
                    agent = %self.name,
                    %error,
                    "kvx nixl: preparing a descriptor list failed; every transfer describes \
                     its pieces itself from now on"
                );
                self.prepared_limit = 0;
                None
            }
        }
    }

    /// Transfers that used prepared descriptor lists.
    #[must_use]
    pub fn prepared_transfers(&self) -> u64 {
        self.prepared_transfers
    }

    /// Descriptors in this endpoint's prepared list (0: none prepared).
    #[must_use]
    pub fn prepared_descriptors(&self) -> usize {
        self.prepared_local.as_ref().map_or(0, Prepared::len)
    }

    /// Creates and posts a transfer; `Err` when a request could not be created (nothing moved).
    ///
    /// The operations of the prepared lists' unit go in one request made from indices
    /// (`makeXferReq`), the others in one described piece by piece (`createXferReq`); the
    /// second is posted after the first and carries the notification. Both go through the one
    /// UCX endpoint to the peer (one worker), and the UCX plugin sends a notification only after
    /// flushing that endpoint, which completes every put posted on it before, those of the first
    /// request included: so the notice follows all the data (see the module documentation).
    pub(super) fn submit(
        &mut self,
        kind: OpKind,
        peer_id: PeerId,
        ops: &[CopyOp],
        bytes: u64,
        notice: Option<Notice>,
    ) -> Result<u64, BackendError> {
        let write = kind == OpKind::Write;
        let unit = self.prepared_unit(peer_id, ops);
        // Which operations are made of whole units (by index), once per operation.
        let aligned: Vec<bool> = ops
            .iter()
            .map(|op| unit.is_some_and(|u| made_of(op, u)))
            .collect();
        let indexed = aligned.iter().any(|&a| a);
        let peer = self
            .peers
            .get(peer_id)
            .ok_or_else(|| BackendError::from("unknown peer"))?;
        let operation = if write {
            sys::XferOp::Write
        } else {
            sys::XferOp::Read
        };
        let args_with = |notice: Option<Notice>| -> Result<sys::OptArgs, BackendError> {
            let mut args = sys::OptArgs::new().map_err(nixl_error("createOptArgs"))?;
            if let Some(Notice(value)) = notice {
                args.set_notification_message(&tagged(TAG_NOTICE, &value.to_le_bytes()))
                    .map_err(nixl_error("setNotifMsg"))?;
                args.set_has_notification(true)
                    .map_err(nixl_error("setHasNotif"))?;
            }
            Ok(args)
        };
        // Requests of at most `max` descriptors each (UCX has been seen aborting the target
        // process of a read of about 100,000 descriptors in one request).
        let max = self.max_request_descriptors.max(1);
        let mut by_index = None;
        if let (true, Some(local), Some(remote)) = (
            indexed,
            self.prepared_local.as_ref(),
            self.prepared_remote.get(&peer_id),
        ) {
            let (l, r) = indices(local, remote, only(ops, &aligned, true), write);
            by_index = (!l.is_empty()).then_some((local, remote, l, r));
        }
        let indexed = by_index.is_some();
        // Without indices every operation is described (a notice always goes).
        let describe = |op: &CopyOp, aligned: bool| !indexed || !aligned || op.len == 0;
        let described = !indexed || ops.iter().zip(&aligned).any(|(op, &a)| describe(op, a));
        let mut requests = Vec::new();
        if let Some((local, remote, local_indices, remote_indices)) = &by_index {
            let chunks = local_indices.len().div_ceil(max);
            for (i, (l, r)) in local_indices
                .chunks(max)
                .zip(remote_indices.chunks(max))
                .enumerate()
            {
                let last = !described && i + 1 == chunks;
                let args = args_with(if last { notice } else { None })?;
                let request = self
                    .agent
                    .make_xfer_req(
                        operation,
                        &local.handle.0,
                        l,
                        &remote.handle.0,
                        r,
                        Some(&args),
                    )
                    .map_err(nixl_error("makeXferReq"))?;
                requests.push((request, args));
            }
        }
        if described {
            let rest = ops
                .iter()
                .zip(&aligned)
                .filter(|&(op, &a)| describe(op, a))
                .map(|(op, _)| op);
            let lists = self.descriptors(peer, rest, write, max)?;
            let count = lists.len();
            for (i, (local, remote)) in lists.into_iter().enumerate() {
                let args = args_with(if i + 1 == count { notice } else { None })?;
                let request = self
                    .agent
                    .create_xfer_req(operation, &local, &remote, &peer.name, Some(&args))
                    .map_err(nixl_error("createXferReq"))?;
                requests.push((request, args));
            }
        }
        if indexed {
            self.prepared_transfers += 1;
        }
        // The local regions in use (a plan's operations come grouped by region: a lookup per
        // change of region, not per operation).
        let mut locals: Vec<u32> = Vec::new();
        let mut last = None;
        for op in ops {
            let region = if write { op.src_region } else { op.dst_region };
            if last != Some(region) && !locals.contains(&region) {
                locals.push(region);
            }
            last = Some(region);
        }
        let op = self.new_op();
        for index in &locals {
            if let Some(r) = self.regions.get_mut(index) {
                r.users += 1;
            }
        }
        let mut posted = Vec::with_capacity(requests.len());
        let mut post_failed = None;
        for (request, args) in requests {
            match self.agent.post_xfer_req(&request, Some(&args)) {
                // Done at once, or in flight: either way `poll` reads the status.
                Ok(_) => posted.push(request),
                Err(e) => {
                    // Those after it are not posted (they would carry the notification).
                    post_failed = Some(nixl_error("postXferReq")(e));
                    break;
                }
            }
        }
        let nothing_in_flight = posted.is_empty();
        self.pending.insert(
            op,
            Pending {
                requests: posted,
                failed: post_failed,
                kind,
                peer: peer_id,
                bytes,
                deadline: Instant::now() + self.op_timeout,
                local_regions: locals,
                abandoned: false,
            },
        );
        if nothing_in_flight {
            self.check_transfers();
        }
        Ok(op)
    }

    /// The asynchronous error for a failed transfer to `peer` (see the module documentation).
    pub(super) fn classify(&self, peer: PeerId, source: BackendError) -> OpError {
        let Some(p) = self.peers.get(peer) else {
            return OpError::Backend { source };
        };
        match self.agent.send_notification(&p.name, TAG_PROBE, None) {
            Err(_) => OpError::PeerUnreachable { source },
            Ok(()) => OpError::Backend { source },
        }
    }

    /// Forgets `op`, releases its request and regions, and reports it (unless abandoned).
    pub(super) fn finish(&mut self, op: u64, failed: Option<OpError>) {
        let Some(p) = self.pending.remove(&op) else {
            return;
        };
        let Pending {
            requests,
            kind,
            peer,
            bytes,
            local_regions,
            abandoned,
            ..
        } = p;
        // The requests go before the peer's metadata may (the backend may still need it).
        drop(requests);
        if self.peers.is_closing(peer) {
            self.release_if_idle(peer);
        }
        for index in &local_regions {
            if let Some(r) = self.regions.get_mut(index) {
                r.users = r.users.saturating_sub(1);
            }
        }
        if abandoned {
            return;
        }
        let id = OpId(op);
        self.events.push_back(match failed {
            Some(error) => Event::Failed {
                op: id,
                kind,
                peer,
                error,
            },
            None if kind == OpKind::Read => Event::ReadDone {
                op: id,
                peer,
                bytes,
            },
            None => Event::WriteDone {
                op: id,
                peer,
                bytes,
            },
        });
    }

    /// Reads the status of every transfer in flight (which also sends deferred notifications)
    /// and reports what finished or expired. A transfer of several requests is reported once
    /// all have settled, failed if any failed.
    pub(super) fn check_transfers(&mut self) {
        let now = Instant::now();
        let ops: Vec<u64> = self.pending.keys().copied().collect();
        for op in ops {
            let Some(p) = self.pending.get_mut(&op) else {
                continue;
            };
            let mut in_progress = false;
            let mut failed = p.failed.take();
            for request in &p.requests {
                match self.agent.get_xfer_status(request) {
                    Ok(sys::XferStatus::Success) => {}
                    Ok(sys::XferStatus::InProgress) => in_progress = true,
                    Err(e) => {
                        failed = failed.or_else(|| Some(nixl_error("getXferStatus")(e)));
                    }
                }
            }
            if in_progress {
                // Settled later: keep what failed for then.
                p.failed = failed;
                if !p.abandoned && p.deadline <= now {
                    p.abandoned = true;
                    let (kind, peer) = (p.kind, p.peer);
                    self.events.push_back(Event::Failed {
                        op: OpId(op),
                        kind,
                        peer,
                        error: OpError::TimedOut(self.op_timeout),
                    });
                }
                continue;
            }
            let (peer, abandoned) = (p.peer, p.abandoned);
            let error = match failed {
                Some(source) if !abandoned => Some(self.classify(peer, source)),
                _ => None,
            };
            self.finish(op, error);
        }
    }
}
