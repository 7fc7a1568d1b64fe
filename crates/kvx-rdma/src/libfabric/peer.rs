//! The two ends of a link: this endpoint's rails ([`Rail`]) and the peers connected to it
//! ([`Peer`]), with how the transport watches an `shm` peer's process and region locks.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libfabric_sys as sys;

use super::address::PeerRails;
use super::context::Scratch;
use super::fi::{self, FiErrno};
use super::{shm_lock, shm_sweep, LibfabricTransport, PROVIDER_SHM};
use crate::desc::EndpointDesc;
use crate::transport::PeerId;

/// How often, at most, the transport looks in its process's mappings for an `shm` peer's region
/// that the provider has not mapped yet (see `peer_region_locked`).
const REGION_LOOKUP_EVERY: Duration = Duration::from_millis(100);

/// One rail: an endpoint with its own domain, completion queue, address vector and buffer.
pub(super) struct Rail {
    // Field order is drop order: the watch of the endpoint's region lock, then the endpoint
    // handle; with `FI_MR_ENDPOINT` the scratch registration keeps it open until it closes
    // itself, before its buffer is freed.
    /// `shm` 1.17: the lock of this endpoint's own region (see [`shm_lock`]).
    pub(super) own_lock: Option<shm_lock::RegionLock>,
    pub(super) ep: Arc<fi::Endpoint>,
    pub(super) scratch: Scratch,
    pub(super) domain: Arc<fi::Domain>,
    pub(super) name: String,
    pub(super) address: Vec<u8>,
}

/// What the provider said about one rail.
pub(super) struct RailInfo {
    pub(super) provider: String,
    pub(super) mr_mode: u64,
    pub(super) mr_key_size: usize,
    pub(super) cq_data: usize,
    pub(super) delivery_complete: bool,
    pub(super) max_msg: usize,
    pub(super) tx_size: usize,
}

pub(super) struct Peer {
    pub(super) desc: EndpointDesc,
    pub(super) rails: PeerRails,
    /// `shm`: the process that owns the peer's endpoint, from its address.
    pub(super) pid: Option<i32>,
    /// `shm`: a watch on that process; nothing is posted to it once it has exited.
    pub(super) watch: Option<shm_sweep::ProcessWatch>,
    /// `shm` 1.17: the lock of the peer's region on each link, once the provider has mapped it
    /// here; nothing is posted while it is held (see [`shm_lock`]).
    pub(super) region_locks: Vec<Option<shm_lock::RegionLock>>,
    /// When the region locks still missing were last looked for.
    pub(super) region_lookup_at: Option<Instant>,
    /// The peer's address in each local rail's address vector, for the links in use: local rail
    /// `i` talks to the peer's rail `i`, for `i` below both rail counts.
    pub(super) links: Vec<sys::fi_addr_t>,
    /// How the provider took posts towards the peer, per link.
    pub(super) contact: Vec<Contact>,
}

impl Peer {
    /// Whether its process has exited (`shm`): by its watch, or, without one (a kernel before
    /// 5.3, or a process gone before this side connected to it: no pidfd can be opened then),
    /// by its pid and `/proc` (other providers: never known).
    pub(super) fn exited(&self) -> bool {
        match &self.watch {
            Some(watch) => watch.exited(),
            None => self.pid.is_some_and(shm_sweep::exited),
        }
    }
}

/// How a link's provider took posts towards a peer. `shm` 1.17 refuses (`-FI_EAGAIN`) every
/// post to a peer until the peer has read this side's name, which the first post sends it; that
/// state stays in the address-vector entry after `fi_av_remove`, for the next address inserted
/// there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Contact {
    /// Nothing posted yet.
    Untried,
    /// Posts were refused, none accepted: the peer may never have read this side's name.
    Refused,
    /// A post was accepted (on `shm`: the peer had read this side's name).
    Accepted,
}

impl LibfabricTransport {
    /// Releases a disconnected peer (its address-vector entries) once no operation of its is
    /// pending.
    pub(super) fn release_if_idle(&mut self, peer: PeerId) {
        let in_flight = self.pending.values().any(|p| p.peer == peer);
        let Some(mut gone) = self.peers.release(peer, in_flight) else {
            return;
        };
        if let Some(watch) = gone.watch.take() {
            let now = Instant::now();
            while self
                .departed
                .front()
                .is_some_and(|(at, _)| now.duration_since(*at) > shm_lock::DEPARTED_KEPT)
            {
                self.departed.pop_front();
            }
            self.departed.push_back((now, watch));
        }
        for ((rail, addr), contact) in self.rails.iter().zip(gone.links).zip(gone.contact) {
            if self.provider == PROVIDER_SHM && contact == Contact::Refused {
                // Removed, the entry would go to the next address inserted with its state: had
                // the peer never read this side's name (killed before first contact), no post
                // to that next peer would ever be accepted. So it stays (one of the provider's
                // 256 peers per endpoint).
                continue;
            }
            // A provider that cannot remove an entry keeps it: nothing refers to it any more,
            // so that costs its memory only.
            let _ = rail.ep.av().remove(addr);
        }
    }

    /// Whether the lock of a peer's region (`shm` 1.17), which a post towards it takes, is held
    /// now. Locks the provider has not mapped yet are looked for at most every
    /// [`REGION_LOOKUP_EVERY`].
    pub(super) fn peer_region_locked(&mut self, peer: PeerId) -> bool {
        let Some(p) = self.peers.get_mut(peer) else {
            return false;
        };
        // Where this side's own region is not 1.17's, no peer's is: nothing to look for (and
        // no scan of the mappings on the posting path).
        let Some(pid) = p
            .pid
            .filter(|_| self.rails.iter().any(|r| r.own_lock.is_some()))
        else {
            return false;
        };
        let now = Instant::now();
        if p.region_locks.iter().any(Option::is_none)
            && p.region_lookup_at
                .is_none_or(|at| now.duration_since(at) >= REGION_LOOKUP_EVERY)
        {
            p.region_lookup_at = Some(now);
            for (slot, rail) in p.region_locks.iter_mut().zip(&p.rails.rails) {
                if slot.is_none() {
                    *slot = shm_lock::RegionLock::find(&rail.address, pid);
                }
            }
        }
        p.region_locks
            .iter_mut()
            .flatten()
            .any(|lock| matches!(lock.look(now), shm_lock::Look::Held(_)))
    }

    /// Whether `rail`'s queue can be read without spinning: its region lock (`shm` 1.17) is
    /// free, or was held by a peer that has died and is released now (see [`shm_lock`]).
    pub(super) fn own_region_readable(&mut self, rail: usize) -> bool {
        let Some(lock) = self.rails[rail].own_lock.as_mut() else {
            return true;
        };
        match lock.look(Instant::now()) {
            shm_lock::Look::Free => true,
            shm_lock::Look::Held(held) if held < shm_lock::ABANDONED_AFTER => false,
            shm_lock::Look::Held(_) => {
                let peer_died = self.peers.find(Peer::exited).is_some()
                    || self.departed.iter().any(|(_, w)| w.exited());
                if !peer_died {
                    return false;
                }
                if let Some(lock) = self.rails[rail].own_lock.as_mut() {
                    lock.release_abandoned();
                }
                self.abandoned_locks += 1;
                true
            }
        }
    }

    /// Notes how the provider took a post towards `peer` on `link` (see [`Contact`]).
    pub(super) fn note_post(&mut self, peer: PeerId, link: usize, result: &Result<(), FiErrno>) {
        let Some(contact) = self
            .peers
            .get_mut(peer)
            .and_then(|p| p.contact.get_mut(link))
        else {
            return;
        };
        match result {
            Ok(()) => *contact = Contact::Accepted,
            Err(e) if e.is_again() && *contact == Contact::Untried => *contact = Contact::Refused,
            Err(_) => {}
        }
    }

    /// The disconnected `shm` peers with operations pending whose process has exited (each
    /// looked up once).
    pub(super) fn exited_peers(&self) -> HashSet<PeerId> {
        let closing: HashSet<PeerId> = self
            .pending
            .values()
            .filter(|p| !p.abandoned && self.peers.is_closing(p.peer))
            .map(|p| p.peer)
            .collect();
        closing
            .into_iter()
            .filter(|&peer| self.peer_exited(peer))
            .collect()
    }

    /// Whether the process of an `shm` peer has terminated, by its watch only: one `poll` that
    /// never blocks, fit for the posting path (no watch, or another provider: never known).
    pub(super) fn peer_terminated(&self, peer: PeerId) -> bool {
        self.peers
            .get(peer)
            .and_then(|p| p.watch.as_ref())
            .is_some_and(shm_sweep::ProcessWatch::exited)
    }

    /// Whether the process of an `shm` peer has exited: by its watch, or, without one (a kernel
    /// before 5.3), by its pid and `/proc` (other providers: never known).
    pub(super) fn peer_exited(&self, peer: PeerId) -> bool {
        self.peers.get(peer).is_some_and(Peer::exited)
    }

    /// The process that owns a peer's `shm` endpoint (other providers: none).
    pub(super) fn shm_pid(&self, rails: &PeerRails) -> Option<i32> {
        if self.provider != PROVIDER_SHM {
            return None;
        }
        rails
            .rails
            .first()
            .and_then(|rail| shm_sweep::address_pid(&rail.address))
    }

    /// Whether an operation waits on a disconnected peer whose process may exit (`shm`).
    pub(super) fn watching_exits(&self) -> bool {
        self.pending.values().any(|p| {
            !p.abandoned
                && self.peers.is_closing(p.peer)
                && self
                    .peers
                    .get(p.peer)
                    .is_some_and(|peer| peer.pid.is_some())
        })
    }
}
