//! Transfers: NIXL descriptor lists built from copy operations, the requests in flight
//! ([`Pending`]), and how they finish or fail.

use std::time::Instant;

use kvx_core::MemoryKind;
use kvx_layout::CopyOp;
use nixl_sys as sys;

use super::notify::{tagged, TAG_NOTICE, TAG_PROBE};
use super::{nixl_error, NixlTransport, Peer};
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

/// An accepted transfer.
pub(super) struct Pending {
    pub(super) request: sys::XferRequest,
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
    /// Builds the local and remote descriptor lists of `ops`; `write` says whether local is the
    /// source side. Every lookup succeeds: `check_ops` accepted the operations against the same
    /// tables.
    pub(super) fn descriptors(
        &self,
        peer: &Peer,
        ops: &[CopyOp],
        write: bool,
    ) -> Result<
        (
            sys::XferDescList<'static>,
            sys::XferDescList<'static>,
            Vec<u32>,
        ),
        BackendError,
    > {
        // One list holds one memory type: every local region of the operations must be host
        // memory, or every one GPU memory (of any devices), and the same for the remote side.
        let kinds =
            |side: &dyn Fn(&CopyOp) -> Option<MemoryKind>| -> Result<sys::MemType, BackendError> {
                let mut kinds = ops.iter().filter_map(side);
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
        let mut local =
            sys::XferDescList::new(local_type).map_err(nixl_error("createXferDlist"))?;
        let mut remote =
            sys::XferDescList::new(remote_type).map_err(nixl_error("createXferDlist"))?;
        let mut locals = Vec::new();
        for op in ops {
            let (local_region, remote_region) = if write {
                (op.src_region, op.dst_region)
            } else {
                (op.dst_region, op.src_region)
            };
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
            if !locals.contains(&local_region) {
                locals.push(local_region);
            }
        }
        Ok((local, remote, locals))
    }

    /// Creates and posts a transfer; `Err` when the request could not be created (nothing moved).
    pub(super) fn submit(
        &mut self,
        kind: OpKind,
        peer_id: PeerId,
        ops: &[CopyOp],
        bytes: u64,
        notice: Option<Notice>,
    ) -> Result<u64, BackendError> {
        let peer = self
            .peers
            .get(peer_id)
            .ok_or_else(|| BackendError::from("unknown peer"))?;
        let write = kind == OpKind::Write;
        let (local, remote, locals) = self.descriptors(peer, ops, write)?;
        let mut args = sys::OptArgs::new().map_err(nixl_error("createOptArgs"))?;
        if let Some(Notice(value)) = notice {
            args.set_notification_message(&tagged(TAG_NOTICE, &value.to_le_bytes()))
                .map_err(nixl_error("setNotifMsg"))?;
            args.set_has_notification(true)
                .map_err(nixl_error("setHasNotif"))?;
        }
        let operation = if write {
            sys::XferOp::Write
        } else {
            sys::XferOp::Read
        };
        let request = self
            .agent
            .create_xfer_req(operation, &local, &remote, &peer.name, Some(&args))
            .map_err(nixl_error("createXferReq"))?;
        drop((local, remote));
        let op = self.new_op();
        for index in &locals {
            if let Some(r) = self.regions.get_mut(index) {
                r.users += 1;
            }
        }
        let posted = self.agent.post_xfer_req(&request, Some(&args));
        self.pending.insert(
            op,
            Pending {
                request,
                kind,
                peer: peer_id,
                bytes,
                deadline: Instant::now() + self.op_timeout,
                local_regions: locals,
                abandoned: false,
            },
        );
        match posted {
            // Done at once, or in flight: either way `poll` reads the status.
            Ok(_) => {}
            Err(e) => {
                let error = self.classify(peer_id, nixl_error("postXferReq")(e));
                self.finish(op, Some(error));
            }
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
            request,
            kind,
            peer,
            bytes,
            local_regions,
            abandoned,
            ..
        } = p;
        // The request goes before the peer's metadata may (the backend may still need it).
        drop(request);
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
    /// and reports what finished or expired.
    pub(super) fn check_transfers(&mut self) {
        let now = Instant::now();
        let ops: Vec<u64> = self.pending.keys().copied().collect();
        for op in ops {
            let Some(p) = self.pending.get(&op) else {
                continue;
            };
            match self.agent.get_xfer_status(&p.request) {
                Ok(sys::XferStatus::Success) => self.finish(op, None),
                Ok(sys::XferStatus::InProgress) => {
                    if !p.abandoned && p.deadline <= now {
                        let (kind, peer) = (p.kind, p.peer);
                        if let Some(p) = self.pending.get_mut(&op) {
                            p.abandoned = true;
                        }
                        self.events.push_back(Event::Failed {
                            op: OpId(op),
                            kind,
                            peer,
                            error: OpError::TimedOut(self.op_timeout),
                        });
                    }
                }
                Err(e) => {
                    let error = if p.abandoned {
                        None
                    } else {
                        Some(self.classify(p.peer, nixl_error("getXferStatus")(e)))
                    };
                    self.finish(op, error);
                }
            }
        }
    }
}
