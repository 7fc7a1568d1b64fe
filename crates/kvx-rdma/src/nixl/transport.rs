//! [`Transport`] for [`NixlTransport`]: registration, descriptions, connecting, the
//! operations (write, read, send) and the polling and waiting that drive them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{MemoryKind, RegionDesc};
use kvx_layout::CopyOp;
use nixl_sys as sys;

use super::address::decode_address;
use super::notify::{tagged, TAG_MESSAGE};
use super::transfer::{nixl_accepts, Span};
use super::{nixl_error, NixlTransport, Peer, Registration, BACKEND, MAX_MESSAGE, MIN_IDLE_SLEEP};
use crate::cpu_time::thread_cpu_time;
use crate::desc::EndpointDesc;
use crate::error::{
    ConnectError, DeregisterError, PollError, ReadError, RegisterError, SendError, WriteError,
};
use crate::region::LocalRegion;
use crate::transport::{Capabilities, Event, Notice, OpId, OpKind, PeerId, Transport, Waker};
use crate::validate::check_ops;

/// A poll that takes longer than this made progress on something.
const BUSY_POLL: Duration = Duration::from_micros(20);

impl Transport for NixlTransport {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn rails(&self) -> Vec<String> {
        self.rails.clone()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            notice_bits: 64,
            max_message_len: MAX_MESSAGE,
            // CUDA memory of any device (`VRAM`); the ordinal here only names the kind.
            memory_kinds: vec![MemoryKind::Host, MemoryKind::Cuda { device: 0 }],
            polls_to_wait: true,
            peer_rma_unassisted: false,
            peer_rma_occasional_reads: false,
        }
    }

    fn register(&mut self, region: LocalRegion) -> Result<RegionDesc, RegisterError> {
        let index = region.index();
        let len = crate::validate::check_registration_of(
            &region,
            self.regions.contains_key(&index),
            BACKEND,
            nixl_accepts,
        )?;
        let span = Span {
            addr: region.addr(),
            len,
            kind: region.kind(),
        };
        // Prepared again (with the new region) when next used.
        self.prepared_local = None;
        // The registration covers memory that `LocalRegion` keeps valid until it is dropped;
        // `Registration` releases the NIXL registration (field order) before the region.
        let handle =
            self.agent
                .register_memory(&span, None)
                .map_err(|e| RegisterError::Backend {
                    index,
                    source: nixl_error(if matches!(span.kind, MemoryKind::Cuda { .. }) {
                        // The usual cause (seen on the H200): UCX's memory-type cache.
                        "registerMem (CUDA memory: was the endpoint opened with \
                         NixlConfig::with_device_memory()?)"
                    } else {
                        "registerMem"
                    })(e),
                })?;
        let remote = RegionDesc {
            index,
            kind: region.kind(),
            addr: region.addr() as u64,
            len: region.len(),
            key: 0,
        };
        self.regions.insert(
            index,
            Registration {
                handle,
                region,
                remote,
                users: 0,
            },
        );
        if let Err(source) = self.refresh_address() {
            // Undo: the description must describe what is registered.
            self.regions.remove(&index);
            let _ = self.refresh_address();
            return Err(RegisterError::Backend { index, source });
        }
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
        // No prepared list may name a region that is gone.
        self.prepared_local = None;
        if let Some(mut registration) = self.regions.remove(&index) {
            registration
                .handle
                .deregister()
                .map_err(|e| DeregisterError::Backend {
                    index,
                    source: nixl_error("deregisterMem")(e),
                })?;
        }
        self.refresh_address()
            .map_err(|source| DeregisterError::Backend { index, source })
    }

    fn local_desc(&self) -> EndpointDesc {
        let mut regions: Vec<RegionDesc> = self.regions.values().map(|r| r.remote).collect();
        regions.sort_by_key(|r| r.index);
        EndpointDesc {
            backend: BACKEND.into(),
            provider: self.plugin.clone(),
            address: self.address.clone(),
            notice_slot: None,
            board: None,
            regions,
        }
    }

    fn connect(&mut self, peer: &EndpointDesc) -> Result<PeerId, ConnectError> {
        peer.validate().map_err(ConnectError::BadDescription)?;
        if peer.backend != BACKEND || peer.provider != self.plugin {
            return Err(ConnectError::Mismatch {
                expected: format!("{BACKEND}/{}", self.plugin),
                found: format!("{}/{}", peer.backend, peer.provider),
            });
        }
        if let Some(r) = peer.regions.iter().find(|r| !nixl_accepts(r.kind)) {
            return Err(ConnectError::BadAddress {
                source: format!("peer region {} is {} memory", r.index, r.kind).into(),
            });
        }
        let (name, metadata) = decode_address(&peer.address)
            .map_err(|e| ConnectError::BadAddress { source: e.into() })?;
        if name == self.name {
            return Err(ConnectError::BadAddress {
                source: "the description is this endpoint's own".into(),
            });
        }
        let known = self.peers.find(|p| p.name == name);
        if let Some(id) = known {
            if let Some(p) = self.peers.get_mut(id) {
                if p.metadata() == metadata {
                    // Same registrations: nothing to load again (a disconnected peer whose
                    // transfers still settle is taken back under its id).
                    p.desc = peer.clone();
                    self.peers.reopen(id);
                    return Ok(id);
                }
            }
        }
        // `nixl-sys` panics on an agent name that is not UTF-8 inside the metadata; a corrupt
        // blob must be an error, not a panic, so the call is fenced. No lock is held across the
        // panic (the agent's lock guard is a temporary of the finished FFI call).
        let agent = &self.agent;
        let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            agent.load_remote_md(metadata)
        }));
        let loaded = match loaded {
            Ok(Ok(loaded)) => loaded,
            // The blob passed its checksum, so a failure in the backend is most likely the
            // connection to the peer (UCX cannot create an endpoint to a dead agent).
            Ok(Err(e @ sys::NixlError::BackendError)) => {
                return Err(ConnectError::Unreachable {
                    source: nixl_error("loadRemoteMD")(e),
                })
            }
            Ok(Err(e)) => {
                return Err(ConnectError::BadAddress {
                    source: nixl_error("loadRemoteMD")(e),
                })
            }
            Err(_) => {
                return Err(ConnectError::BadAddress {
                    source: "loadRemoteMD: the metadata's agent name is not UTF-8".into(),
                })
            }
        };
        if loaded != name {
            if self.peers.find(|p| p.name == loaded).is_none() {
                let _ = self.agent.invalidate_remote_md(&loaded);
            }
            return Err(ConnectError::BadAddress {
                source: format!("the address names agent {name} but its metadata is {loaded}")
                    .into(),
            });
        }
        if let Some(id) = known {
            if let Some(p) = self.peers.get_mut(id) {
                p.desc = peer.clone();
            }
            // Its regions changed: prepared again when next used.
            self.prepared_remote.remove(&id);
            self.peers.reopen(id);
            return Ok(id);
        }
        Ok(self.peers.insert(Peer {
            name: name.to_owned(),
            desc: peer.clone(),
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
        let bytes = check_ops(
            ops,
            |i| self.regions.get(&i).map(|r| r.region.len()),
            |i| peer.desc.region(i).map(|r| r.len),
        )?;
        let op = self
            .submit(OpKind::Write, peer_id, ops, bytes, notice)
            .map_err(WriteError::Backend)?;
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
        let op = self
            .submit(OpKind::Read, peer_id, ops, bytes, None)
            .map_err(ReadError::Backend)?;
        Ok(OpId(op))
    }

    fn send(&mut self, peer_id: PeerId, message: &[u8]) -> Result<OpId, SendError> {
        let peer = self
            .peers
            .live(peer_id)
            .ok_or(SendError::UnknownPeer(peer_id))?;
        if message.len() > MAX_MESSAGE {
            return Err(SendError::TooLarge {
                len: message.len(),
                max: MAX_MESSAGE,
            });
        }
        // genNotif hands the message to UCX (an eager active message) and owns it from there:
        // the send is complete for this endpoint once the call returns.
        self.agent
            .send_notification(&peer.name, &tagged(TAG_MESSAGE, message), None)
            .map_err(|e| SendError::Backend(nixl_error("genNotif")(e)))?;
        let op = self.new_op();
        self.events.push_back(Event::SendDone {
            op: OpId(op),
            peer: peer_id,
        });
        Ok(OpId(op))
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, PollError> {
        self.check_transfers();
        self.check_notifications().map_err(PollError::Backend)?;
        Ok(self.take_events(events))
    }

    fn wait(&mut self, events: &mut Vec<Event>, timeout: Duration) -> Result<usize, PollError> {
        let deadline = Instant::now() + timeout;
        loop {
            let started = thread_cpu_time();
            let n = self.poll(events)?;
            if n > 0 {
                self.idle_sleep = MIN_IDLE_SLEEP;
                return Ok(n);
            }
            let now = Instant::now();
            if now >= deadline || self.wake.take() {
                return Ok(0);
            }
            // Nothing to block on (NIXL exposes no wait object): sleep a little, backing off
            // from 50 µs to `max_idle_sleep` while idle; a poll that used much CPU did work (it
            // moved incoming bytes, which produces no event), so go straight back to it. (CPU
            // time, not wall time: a poll that only waited for a core did no work, and going
            // straight back would then keep the machine busy.)
            if thread_cpu_time().saturating_sub(started) < BUSY_POLL {
                std::thread::sleep(self.idle_sleep.min(deadline - now));
                self.idle_sleep = (self.idle_sleep * 2).min(self.max_idle_sleep);
            } else {
                self.idle_sleep = MIN_IDLE_SLEEP;
            }
        }
    }

    fn waker(&self) -> Option<Arc<dyn Waker>> {
        Some(Arc::clone(&self.wake) as Arc<dyn Waker>)
    }
}
