//! [`Transport`] for [`LibfabricTransport`]: registration, descriptions, connecting, the
//! operations (write, read, send) and the polling and waiting that drive them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{MemoryKind, RegionDesc};
use kvx_layout::CopyOp;
use libfabric_sys as sys;

use super::context::{Registration, Scratch};
use super::peer::{Contact, Peer};
use super::post::Pending;
use super::{
    address, backend, fi, shm_sweep, LibfabricTransport, BACKEND, MESSAGE_SLOT, PROVIDER_SHM,
    SEND_SLOTS,
};
use crate::board::{self, NoticeBoard};
use crate::desc::EndpointDesc;
use crate::error::{
    ConnectError, DeregisterError, PollError, ReadError, RegisterError, SendError, WriteError,
};
use crate::region::LocalRegion;
use crate::transport::{Capabilities, Event, Notice, OpId, OpKind, PeerId, Transport, Waker};
use crate::validate::check_ops;

impl Transport for LibfabricTransport {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn rails(&self) -> Vec<String> {
        self.rail_domains().into_iter().map(str::to_owned).collect()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            notice_bits: self.notice_bits,
            max_message_len: self.max_message,
            memory_kinds: if self.device_memory {
                vec![MemoryKind::Host, MemoryKind::Cuda { device: 0 }]
            } else {
                vec![MemoryKind::Host]
            },
            polls_to_wait: !self.rails.iter().all(|r| r.ep.cq().can_block()),
            peer_rma_unassisted: self.peer_rma_unassisted,
            peer_rma_occasional_reads: self.provider == PROVIDER_SHM,
        }
    }

    fn register(&mut self, region: LocalRegion) -> Result<RegionDesc, RegisterError> {
        let index = region.index();
        let device_memory = self.device_memory;
        let len = crate::validate::check_registration_of(
            &region,
            self.regions.contains_key(&index),
            BACKEND,
            |kind| match kind {
                MemoryKind::Host => true,
                MemoryKind::Cuda { .. } => device_memory,
                _ => false,
            },
        )?;
        let memory = match region.kind() {
            MemoryKind::Cuda { device } => fi::Hmem::Cuda(device),
            _ => fi::Hmem::System,
        };
        let requested_key = self.next_key;
        let mut mrs = Vec::with_capacity(self.rails.len());
        for rail in &self.rails {
            // SAFETY: `LocalRegion` guarantees the memory stays valid until it is deregistered or
            // the transport dropped; the registrations are closed before the `LocalRegion` is
            // released (field order of `Registration`).
            let mr = unsafe {
                fi::MemoryRegion::register(
                    &rail.domain,
                    self.endpoint_mr.then_some(&rail.ep),
                    region.addr(),
                    len,
                    sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE,
                    requested_key,
                    memory,
                )
            }
            .map_err(|e| RegisterError::Backend {
                index,
                source: backend(e),
            })?;
            mrs.push(mr);
        }
        self.next_key += 1;
        let remote = RegionDesc {
            index,
            kind: region.kind(),
            addr: if self.virt_addr {
                region.addr() as u64
            } else {
                0
            },
            len: region.len(),
            key: mrs[0].key(),
        };
        self.regions.insert(
            index,
            Registration {
                mrs,
                region,
                remote,
                users: 0,
            },
        );
        Ok(remote)
    }

    fn deregister(&mut self, index: u32) -> Result<(), DeregisterError> {
        let users = self
            .regions
            .get(&index)
            .ok_or(DeregisterError::Unknown(index))?
            .users;
        if users > 0 {
            return Err(DeregisterError::InUse { index, ops: users });
        }
        self.regions.remove(&index);
        Ok(())
    }

    fn local_desc(&self) -> EndpointDesc {
        let mut regions: Vec<&Registration> = self.regions.values().collect();
        regions.sort_by_key(|r| r.remote.index);
        let address = if self.rails.len() == 1 {
            self.rails[0].address.clone()
        } else {
            let rails: Vec<address::LocalRail<'_>> = self
                .rails
                .iter()
                .map(|r| address::LocalRail {
                    address: &r.address,
                    notice: r.scratch.notice_slot(),
                })
                .collect();
            let keys: Vec<(u32, Vec<u64>)> = regions
                .iter()
                .map(|r| {
                    (
                        r.remote.index,
                        r.mrs.iter().skip(1).map(fi::MemoryRegion::key).collect(),
                    )
                })
                .collect();
            address::encode(&rails, &keys)
        };
        EndpointDesc {
            backend: BACKEND.into(),
            provider: self.provider.clone(),
            address,
            notice_slot: Some(self.rails[0].scratch.notice_slot()),
            board: self.board.as_ref().map(|b| b.place()),
            regions: regions.iter().map(|r| r.remote).collect(),
        }
    }

    fn connect(&mut self, peer: &EndpointDesc) -> Result<PeerId, ConnectError> {
        peer.validate().map_err(ConnectError::BadDescription)?;
        if peer.backend != BACKEND || peer.provider != self.provider {
            return Err(ConnectError::Mismatch {
                expected: format!("{BACKEND}/{}", self.provider),
                found: format!("{}/{}", peer.backend, peer.provider),
            });
        }
        let Some(slot) = peer.notice_slot else {
            return Err(ConnectError::BadDescription(
                crate::desc::DescError::Truncated {
                    what: "notice slot",
                },
            ));
        };
        if slot.len < 8 {
            return Err(ConnectError::BadDescription(
                crate::desc::DescError::Truncated {
                    what: "notice slot",
                },
            ));
        }
        let rails = address::decode(peer, slot).map_err(ConnectError::BadDescription)?;
        // The same peer (its first rail's address) again: refresh its region table and keys.
        // One disconnected but not yet released (operations of its still settling) is taken
        // back under its id: its address-vector entries are still there.
        if let Some(id) = self
            .peers
            .find(|p| p.rails.rails[0].address == rails.rails[0].address)
        {
            let pid = self.shm_pid(&rails);
            if let Some(known) = self.peers.get_mut(id) {
                known.desc = peer.clone();
                if known.pid != pid {
                    known.watch = pid.and_then(shm_sweep::ProcessWatch::open);
                }
                known.pid = pid;
                known.rails = rails;
            }
            self.peers.reopen(id);
            return Ok(id);
        }
        let links = self.rails.len().min(rails.rails.len());
        let mut addrs = Vec::with_capacity(links);
        for (local, remote) in self.rails.iter().zip(&rails.rails) {
            // Providers read their own address format (fixed-size structures, or NUL-terminated
            // strings for shm) from the pointer: hand them a zero-padded copy at least as long as
            // our own address plus room for a terminator, so that no read goes past the buffer.
            let mut padded = remote.address.clone();
            padded.resize(remote.address.len().max(local.address.len()) + 64, 0);
            match local.ep.av().insert(&padded) {
                Ok(addr) => addrs.push(addr),
                Err(e) => {
                    // The rails inserted already are taken out again.
                    for (rail, addr) in self.rails.iter().zip(addrs) {
                        let _ = rail.ep.av().remove(addr);
                    }
                    return Err(ConnectError::BadAddress { source: backend(e) });
                }
            }
        }
        let pid = self.shm_pid(&rails);
        if let Some(pid) = pid {
            for lock in self.rails.iter().filter_map(|r| r.own_lock.as_ref()) {
                lock.add_peer(pid);
            }
        }
        Ok(self.peers.insert(Peer {
            desc: peer.clone(),
            rails,
            pid,
            watch: pid.and_then(shm_sweep::ProcessWatch::open),
            region_locks: std::iter::repeat_with(|| None).take(addrs.len()).collect(),
            region_lookup_at: None,
            contact: vec![Contact::Untried; addrs.len()],
            links: addrs,
        }))
    }

    fn disconnect(&mut self, peer: PeerId) {
        if self.peers.close(peer) {
            self.release_if_idle(peer);
        }
    }

    fn write(
        &mut self,
        peer_id: PeerId,
        ops: &[CopyOp],
        notice: Option<Notice>,
    ) -> Result<OpId, WriteError> {
        let peer = self
            .peers
            .live(peer_id)
            .ok_or(WriteError::UnknownPeer(peer_id))?;
        if let Some(Notice(value)) = notice {
            if self.notice_bits < 64 && value >> self.notice_bits != 0 {
                return Err(WriteError::NoticeTooWide {
                    notice: value,
                    bits: self.notice_bits,
                });
            }
        }
        // A peer with a notice board takes board notices there, written by cross-memory attach
        // once the data is in; that needs this side's data to move the same way (no help from
        // the peer). Otherwise every notice is a message.
        let board = match (peer.pid, self.peer_rma_unassisted) {
            (Some(pid), true) => board::slot_for(notice, peer.desc.board)?.map(|slot| (pid, slot)),
            _ => None,
        };
        let bytes = check_ops(
            ops,
            |i| self.regions.get(&i).map(|r| r.region.len()),
            |i| peer.desc.region(i).map(|r| r.len),
        )?;
        let stripes = self.stripes(peer_id, ops, true);
        let locals = Self::local_regions(ops, true);
        let op = self.submit(
            OpKind::Write,
            peer_id,
            bytes,
            stripes,
            locals,
            notice.map(|n| n.0),
            board,
        );
        Ok(OpId(op))
    }

    fn read(&mut self, peer_id: PeerId, ops: &[CopyOp]) -> Result<OpId, ReadError> {
        let peer = self
            .peers
            .live(peer_id)
            .ok_or(ReadError::UnknownPeer(peer_id))?;
        let bytes = check_ops(
            ops,
            |i| peer.desc.region(i).map(|r| r.len),
            |i| self.regions.get(&i).map(|r| r.region.len()),
        )?;
        let stripes = self.stripes(peer_id, ops, false);
        let locals = Self::local_regions(ops, false);
        let op = self.submit(OpKind::Read, peer_id, bytes, stripes, locals, None, None);
        Ok(OpId(op))
    }

    fn send(&mut self, peer_id: PeerId, message: &[u8]) -> Result<OpId, SendError> {
        if self.peers.live(peer_id).is_none() {
            return Err(SendError::UnknownPeer(peer_id));
        }
        if message.len() > self.max_message {
            return Err(SendError::TooLarge {
                len: message.len(),
                max: self.max_message,
            });
        }
        if self.rails[0].scratch.free_sends.is_empty() {
            // Reap finished sends first.
            self.drain(0, None)
                .map_err(|e| SendError::Backend(backend(e)))?;
        }
        let Some(slot) = self.rails[0].scratch.free_sends.pop() else {
            return Err(SendError::Busy(SEND_SLOTS));
        };
        let offset = Scratch::SEND_BASE + slot * MESSAGE_SLOT;
        // The slot is inside the buffer and the message fits it (checked above).
        let _ = self.rails[0].scratch.buffer.write_at(offset, message);
        let op = self.new_op();
        self.pending.insert(
            op,
            Pending {
                kind: OpKind::Send,
                peer: peer_id,
                bytes: message.len() as u64,
                stripes: Vec::new(),
                next_stripe: 0,
                in_flight: 0,
                notice: None,
                notice_link: 0,
                flush: Vec::new(),
                flushing: false,
                notice_posted: false,
                board: None,
                failed: None,
                abandoned: false,
                deadline: Instant::now() + self.op_timeout,
                local_regions: Vec::new(),
                send: Some((slot, message.len())),
            },
        );
        self.post_queue.push_back(op);
        if let Err(error) = self.pump() {
            self.broken.get_or_insert(error);
        }
        Ok(OpId(op))
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, PollError> {
        let broken = |e| PollError::Backend(backend(e));
        if let Some(error) = self.broken.take() {
            return Err(broken(error));
        }
        self.pump().map_err(broken)?;
        while self.drain_all().map_err(broken)? > 0 {
            self.pump().map_err(broken)?;
        }
        self.expire();
        Ok(self.take_events(events))
    }

    fn wait(&mut self, events: &mut Vec<Event>, timeout: Duration) -> Result<usize, PollError> {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.poll(events)?;
            if n > 0 {
                return Ok(n);
            }
            let now = Instant::now();
            if now >= deadline || self.wake.take() {
                return Ok(0);
            }
            let mut until = deadline;
            if let Some(op_deadline) = self.nearest_deadline() {
                until = until.min(op_deadline);
            }
            if self.watching_exits() {
                until = until.min(self.next_exit_check);
            }
            let mut ms = until
                .saturating_duration_since(now)
                .as_millis()
                .clamp(1, i32::MAX as u128) as i32;
            if !self.post_queue.is_empty() {
                // Work is queued behind a full provider queue: come back soon to post it even if
                // no completion of ours wakes us.
                ms = ms.min(1);
            }
            self.block(ms).map_err(|e| PollError::Backend(backend(e)))?;
        }
    }

    /// Every libfabric endpoint has one: a wake ends a `poll(2)` on the wait descriptors at
    /// once, and a wait that reads with sleeps in between (no wait object) within one sleep.
    fn waker(&self) -> Option<Arc<dyn Waker>> {
        Some(Arc::clone(&self.wake) as Arc<dyn Waker>)
    }

    /// `shm` with cross-memory attach: peers' data lands without this side's help, and so can
    /// their notices (one more 8-byte `process_vm_writev` into the board once the data write
    /// completed). Other providers: none.
    fn notice_board(&mut self, slots: usize) -> Option<Arc<NoticeBoard>> {
        if !self.peer_rma_unassisted {
            return None;
        }
        Some(Arc::clone(
            self.board
                .get_or_insert_with(|| Arc::new(NoticeBoard::new(slots))),
        ))
    }
}
