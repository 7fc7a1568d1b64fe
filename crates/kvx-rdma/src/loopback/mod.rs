//! The in-process loopback backend: endpoints of one [`LoopbackFabric`] move bytes between each
//! other's registered memory with plain copies, for the unit tests of the layers above.
//!
//! It keeps the contract of the real backends: bounds are checked against the peer's
//! *description* before anything moves; a write's bytes are copied before its notice is queued
//! at the peer (under one lock, so the peer can never see the notice first); an operation on a
//! peer that has gone away (dropped endpoint) fails asynchronously with
//! [`OpError::PeerUnreachable`], and one on a region the peer has deregistered since with
//! [`OpError::RemoteAccess`]. [`Transport::wait`] blocks on a condition variable.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kvx_core::{MemoryKind, RegionDesc};
use kvx_layout::CopyOp;

use crate::board::{self, NoticeBoard};
use crate::desc::EndpointDesc;
use crate::error::{
    ConnectError, DeregisterError, OpError, PollError, ReadError, RegisterError, SendError,
    WriteError,
};
use crate::peers::PeerTable;
use crate::region::LocalRegion;
use crate::transport::{Capabilities, Event, Notice, OpId, OpKind, PeerId, Transport, Waker};
use crate::validate::check_ops;

/// Backend name of loopback endpoints.
pub const BACKEND: &str = "loopback";
/// Longest control message a loopback endpoint carries.
pub const MAX_MESSAGE_LEN: usize = 64 * 1024;

/// An operation failed inside the loopback fabric.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoopbackError {
    /// The peer endpoint no longer exists.
    #[error("loopback endpoint {0} is gone")]
    EndpointGone(u64),
    /// The peer no longer has the region (or registered it again under a new key).
    #[error("loopback endpoint {endpoint} has no region {region} with key {key}")]
    StaleKey {
        /// Peer endpoint.
        endpoint: u64,
        /// Region index.
        region: u32,
        /// Key used.
        key: u64,
    },
}

/// An in-process fabric: a namespace of loopback endpoints that can reach each other. Cheap to
/// clone (all clones are the same fabric).
#[derive(Clone, Debug, Default)]
pub struct LoopbackFabric {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// A fabric-wide id so that endpoints of different fabrics never collide by accident.
    fabric_id: u64,
    next_endpoint: u64,
    next_key: u64,
    endpoints: HashMap<u64, EndpointState>,
}

#[derive(Debug)]
struct EndpointState {
    regions: HashMap<u32, (LocalRegion, u64)>,
    inbox: VecDeque<Event>,
    wake: Arc<Condvar>,
    /// Set by the endpoint's [`Waker`]: the next wait returns even without events.
    woken: bool,
    /// Where board notices for this endpoint go.
    board: Option<Arc<NoticeBoard>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the maps half-updated in a way that breaks
        // memory safety (copies finish before any map changes), so recover the guard.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl LoopbackFabric {
    /// A new, empty fabric.
    #[must_use]
    pub fn new() -> Self {
        let fabric = Self::default();
        // Distinguish fabrics by the address of their shared state.
        fabric.shared.lock().fabric_id = Arc::as_ptr(&fabric.shared) as u64;
        fabric
    }

    /// A new endpoint on this fabric.
    #[must_use]
    pub fn endpoint(&self) -> LoopbackEndpoint {
        let wake = Arc::new(Condvar::new());
        let mut state = self.shared.lock();
        state.next_endpoint += 1;
        let id = state.next_endpoint;
        let fabric_id = state.fabric_id;
        state.endpoints.insert(
            id,
            EndpointState {
                regions: HashMap::new(),
                inbox: VecDeque::new(),
                wake: Arc::clone(&wake),
                woken: false,
                board: None,
            },
        );
        LoopbackEndpoint {
            shared: Arc::clone(&self.shared),
            id,
            fabric_id,
            wake,
            peers: PeerTable::default(),
            next_op: 0,
        }
    }
}

/// One endpoint of a [`LoopbackFabric`]. Dropping it removes it (and its registrations) from the
/// fabric; peers' later operations on it fail with [`OpError::PeerUnreachable`].
#[derive(Debug)]
pub struct LoopbackEndpoint {
    shared: Arc<Shared>,
    id: u64,
    fabric_id: u64,
    wake: Arc<Condvar>,
    peers: PeerTable<Peer>,
    next_op: u64,
}

#[derive(Debug)]
struct Peer {
    endpoint: u64,
    desc: EndpointDesc,
}

fn encode_address(fabric_id: u64, endpoint: u64) -> Vec<u8> {
    let mut address = fabric_id.to_le_bytes().to_vec();
    address.extend_from_slice(&endpoint.to_le_bytes());
    address
}

/// Copies `len` bytes between two registered regions.
///
/// # Safety
/// Both ranges must lie inside live registrations (guaranteed by the bounds checks and by holding
/// the fabric lock, which every deregistration takes).
unsafe fn copy_bytes(src: usize, dst: usize, len: u64) {
    // SAFETY: per the function contract both ranges are valid for `len` bytes; `ptr::copy`
    // tolerates overlap (an endpoint may write into its own memory).
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) }
}

impl LoopbackEndpoint {
    fn new_op(&mut self) -> OpId {
        self.next_op += 1;
        OpId(self.next_op)
    }

    fn peer(&self, peer: PeerId) -> Option<&Peer> {
        self.peers.get(peer)
    }

    /// Runs the copies of `ops` from `from`'s memory into `to`'s, under the fabric lock.
    /// `remote_is_dst` says which side the remote table (the peer's description) describes.
    fn copy(
        state: &State,
        local: u64,
        peer: &Peer,
        ops: &[CopyOp],
        remote_is_dst: bool,
    ) -> Result<(), OpError> {
        let gone = || OpError::PeerUnreachable {
            source: Box::new(LoopbackError::EndpointGone(peer.endpoint)),
        };
        let me = state.endpoints.get(&local).ok_or_else(gone)?;
        let them = state.endpoints.get(&peer.endpoint).ok_or_else(gone)?;
        // Resolve every region first, so that a stale key fails the whole operation before any
        // byte moves.
        let mut resolved = Vec::with_capacity(ops.len());
        for op in ops {
            let (local_index, remote_index) = if remote_is_dst {
                (op.src_region, op.dst_region)
            } else {
                (op.dst_region, op.src_region)
            };
            let local_addr = me
                .regions
                .get(&local_index)
                .map(|(r, _)| r.addr())
                .ok_or_else(|| OpError::Backend {
                    source: format!("local region {local_index} was deregistered").into(),
                })?;
            let advertised = peer.desc.region(remote_index).map_or(0, |r| r.key);
            let remote_addr = match them.regions.get(&remote_index) {
                Some((region, key)) if *key == advertised => region.addr(),
                _ => {
                    return Err(OpError::RemoteAccess {
                        source: Box::new(LoopbackError::StaleKey {
                            endpoint: peer.endpoint,
                            region: remote_index,
                            key: advertised,
                        }),
                    })
                }
            };
            resolved.push((local_addr, remote_addr));
        }
        for (op, (local_addr, remote_addr)) in ops.iter().zip(resolved) {
            let (src_base, dst_base) = if remote_is_dst {
                (local_addr, remote_addr)
            } else {
                (remote_addr, local_addr)
            };
            for (src, dst, len) in op.pieces() {
                // SAFETY: every piece was checked against the advertised region lengths, and the
                // key check above proves the live registration is the advertised one (same
                // length); the fabric lock is held, so neither side can deregister meanwhile.
                unsafe { copy_bytes(src_base + src as usize, dst_base + dst as usize, len) };
            }
        }
        Ok(())
    }
}

impl Drop for LoopbackEndpoint {
    fn drop(&mut self) {
        self.shared.lock().endpoints.remove(&self.id);
    }
}

impl Transport for LoopbackEndpoint {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            notice_bits: 64,
            max_message_len: MAX_MESSAGE_LEN,
            memory_kinds: vec![MemoryKind::Host],
            polls_to_wait: false,
            peer_rma_unassisted: true,
            peer_rma_occasional_reads: false,
        }
    }

    fn register(&mut self, region: LocalRegion) -> Result<RegionDesc, RegisterError> {
        let index = region.index();
        if region.is_empty() {
            return Err(RegisterError::Empty(index));
        }
        if region.kind() != MemoryKind::Host {
            return Err(RegisterError::UnsupportedKind {
                index,
                kind: region.kind(),
                backend: BACKEND,
            });
        }
        let mut state = self.shared.lock();
        state.next_key += 1;
        let key = state.next_key;
        let me = state
            .endpoints
            .get_mut(&self.id)
            .ok_or_else(|| RegisterError::Backend {
                index,
                source: Box::new(LoopbackError::EndpointGone(self.id)),
            })?;
        if me.regions.contains_key(&index) {
            return Err(RegisterError::Duplicate(index));
        }
        let desc = RegionDesc {
            index,
            kind: region.kind(),
            addr: region.addr() as u64,
            len: region.len(),
            key,
        };
        me.regions.insert(index, (region, key));
        Ok(desc)
    }

    fn deregister(&mut self, index: u32) -> Result<(), DeregisterError> {
        // Loopback operations finish inside the call that posts them: nothing is ever in flight.
        let mut state = self.shared.lock();
        let removed = state
            .endpoints
            .get_mut(&self.id)
            .and_then(|me| me.regions.remove(&index));
        drop(state);
        removed.map(drop).ok_or(DeregisterError::Unknown(index))
    }

    fn local_desc(&self) -> EndpointDesc {
        let state = self.shared.lock();
        let mut regions: Vec<RegionDesc> = state
            .endpoints
            .get(&self.id)
            .map(|me| {
                me.regions
                    .values()
                    .map(|(r, key)| RegionDesc {
                        index: r.index(),
                        kind: r.kind(),
                        addr: r.addr() as u64,
                        len: r.len(),
                        key: *key,
                    })
                    .collect()
            })
            .unwrap_or_default();
        regions.sort_by_key(|r| r.index);
        let board = state
            .endpoints
            .get(&self.id)
            .and_then(|me| me.board.as_ref())
            .map(|b| b.place());
        EndpointDesc {
            backend: BACKEND.into(),
            provider: String::new(),
            address: encode_address(self.fabric_id, self.id),
            notice_slot: None,
            board,
            regions,
        }
    }

    fn connect(&mut self, peer: &EndpointDesc) -> Result<PeerId, ConnectError> {
        peer.validate().map_err(ConnectError::BadDescription)?;
        if peer.backend != BACKEND {
            return Err(ConnectError::Mismatch {
                expected: BACKEND.into(),
                found: format!("{}/{}", peer.backend, peer.provider),
            });
        }
        let Ok(bytes) = <[u8; 16]>::try_from(peer.address.as_slice()) else {
            return Err(ConnectError::BadAddress {
                source: format!("loopback address has {} bytes, not 16", peer.address.len()).into(),
            });
        };
        let (fabric, endpoint) = bytes.split_at(8);
        let fabric = u64::from_le_bytes(fabric.try_into().unwrap_or_default());
        let endpoint = u64::from_le_bytes(endpoint.try_into().unwrap_or_default());
        if fabric != self.fabric_id {
            return Err(ConnectError::Unreachable {
                source: "the peer is on another loopback fabric".into(),
            });
        }
        if let Some(id) = self.peers.find(|p| p.endpoint == endpoint) {
            if let Some(known) = self.peers.get_mut(id) {
                known.desc = peer.clone();
            }
            return Ok(id);
        }
        Ok(self.peers.insert(Peer {
            endpoint,
            desc: peer.clone(),
        }))
    }

    fn disconnect(&mut self, peer: PeerId) {
        // Operations run to their end under the fabric lock when they are posted: nothing of
        // the peer's is in use afterwards.
        self.peers.remove(peer);
    }

    fn write(
        &mut self,
        peer_id: PeerId,
        ops: &[CopyOp],
        notice: Option<Notice>,
    ) -> Result<OpId, WriteError> {
        let peer = self.peer(peer_id).ok_or(WriteError::UnknownPeer(peer_id))?;
        // A peer with a notice board (in its description) takes board notices there; to one
        // without, every notice is a message.
        let to_board = board::slot_for(notice, peer.desc.board)?.is_some();
        let state = self.shared.lock();
        let me = state.endpoints.get(&self.id);
        let bytes = check_ops(
            ops,
            |i| me.and_then(|m| m.regions.get(&i)).map(|(r, _)| r.len()),
            |i| peer.desc.region(i).map(|r| r.len),
        )?;
        let result = Self::copy(&state, self.id, peer, ops, true);
        let target = peer.endpoint;
        drop(state);
        let op = self.new_op();
        let mut state = self.shared.lock();
        let event = match result {
            Ok(()) => {
                if let Some(notice) = notice {
                    if let Some(them) = state.endpoints.get_mut(&target) {
                        // The data was copied above. A board never changes once made, so the
                        // slot checked against the description is there.
                        match them.board.as_ref().filter(|_| to_board) {
                            Some(b) => {
                                let _ = b.deliver(notice);
                            }
                            None => {
                                them.inbox.push_back(Event::Notice(notice));
                                them.wake.notify_all();
                            }
                        }
                    }
                }
                Event::WriteDone {
                    op,
                    peer: peer_id,
                    bytes,
                }
            }
            Err(error) => Event::Failed {
                op,
                kind: OpKind::Write,
                peer: peer_id,
                error,
            },
        };
        if let Some(me) = state.endpoints.get_mut(&self.id) {
            me.inbox.push_back(event);
        }
        self.wake.notify_all();
        Ok(op)
    }

    fn notice_board(&mut self, slots: usize) -> Option<Arc<NoticeBoard>> {
        let mut state = self.shared.lock();
        let me = state.endpoints.get_mut(&self.id)?;
        Some(Arc::clone(
            me.board
                .get_or_insert_with(|| Arc::new(NoticeBoard::new(slots))),
        ))
    }

    fn read(&mut self, peer_id: PeerId, ops: &[CopyOp]) -> Result<OpId, ReadError> {
        let peer = self.peer(peer_id).ok_or(ReadError::UnknownPeer(peer_id))?;
        let state = self.shared.lock();
        let me = state.endpoints.get(&self.id);
        let bytes = check_ops(
            ops,
            |i| peer.desc.region(i).map(|r| r.len),
            |i| me.and_then(|m| m.regions.get(&i)).map(|(r, _)| r.len()),
        )?;
        let result = Self::copy(&state, self.id, peer, ops, false);
        drop(state);
        let op = self.new_op();
        let event = match result {
            Ok(()) => Event::ReadDone {
                op,
                peer: peer_id,
                bytes,
            },
            Err(error) => Event::Failed {
                op,
                kind: OpKind::Read,
                peer: peer_id,
                error,
            },
        };
        let mut state = self.shared.lock();
        if let Some(me) = state.endpoints.get_mut(&self.id) {
            me.inbox.push_back(event);
        }
        self.wake.notify_all();
        Ok(op)
    }

    fn send(&mut self, peer_id: PeerId, message: &[u8]) -> Result<OpId, SendError> {
        let target = self
            .peer(peer_id)
            .ok_or(SendError::UnknownPeer(peer_id))?
            .endpoint;
        if message.len() > MAX_MESSAGE_LEN {
            return Err(SendError::TooLarge {
                len: message.len(),
                max: MAX_MESSAGE_LEN,
            });
        }
        let op = self.new_op();
        let mut state = self.shared.lock();
        let event = match state.endpoints.get_mut(&target) {
            Some(them) => {
                them.inbox.push_back(Event::Message(message.to_vec()));
                them.wake.notify_all();
                Event::SendDone { op, peer: peer_id }
            }
            None => Event::Failed {
                op,
                kind: OpKind::Send,
                peer: peer_id,
                error: OpError::PeerUnreachable {
                    source: Box::new(LoopbackError::EndpointGone(target)),
                },
            },
        };
        if let Some(me) = state.endpoints.get_mut(&self.id) {
            me.inbox.push_back(event);
        }
        self.wake.notify_all();
        Ok(op)
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, PollError> {
        let mut state = self.shared.lock();
        let Some(me) = state.endpoints.get_mut(&self.id) else {
            return Ok(0);
        };
        let n = me.inbox.len();
        events.extend(me.inbox.drain(..));
        Ok(n)
    }

    fn wait(&mut self, events: &mut Vec<Event>, timeout: Duration) -> Result<usize, PollError> {
        let deadline = Instant::now() + timeout;
        let mut state = self.shared.lock();
        loop {
            let Some(me) = state.endpoints.get_mut(&self.id) else {
                return Ok(0);
            };
            if !me.inbox.is_empty() {
                let n = me.inbox.len();
                events.extend(me.inbox.drain(..));
                return Ok(n);
            }
            if std::mem::take(&mut me.woken) {
                return Ok(0);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(0);
            }
            state = self
                .wake
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn waker(&self) -> Option<Arc<dyn Waker>> {
        Some(Arc::new(LoopbackWaker {
            shared: Arc::clone(&self.shared),
            id: self.id,
            wake: Arc::clone(&self.wake),
        }))
    }
}

/// Interrupts one loopback endpoint's wait.
struct LoopbackWaker {
    shared: Arc<Shared>,
    id: u64,
    wake: Arc<Condvar>,
}

impl Waker for LoopbackWaker {
    fn wake(&self) {
        let mut state = self.shared.lock();
        if let Some(me) = state.endpoints.get_mut(&self.id) {
            me.woken = true;
        }
        drop(state);
        self.wake.notify_all();
    }
}

#[cfg(test)]
mod tests;
