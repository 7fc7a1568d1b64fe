//! The peers an endpoint is connected to, by [`PeerId`]. Ids are never reused, so an id kept
//! after [`Transport::disconnect`](crate::Transport::disconnect) names no peer rather than
//! another one. A backend whose operations need their peer until they end marks it closing
//! ([`PeerTable::close`]): refused to new operations ([`PeerTable::live`]), still there for
//! those in flight ([`PeerTable::get`]), handed back for release once the last one has ended
//! ([`PeerTable::release`]).

use std::collections::HashMap;

use crate::transport::PeerId;

#[derive(Debug)]
struct Entry<P> {
    peer: P,
    // Only the backends that release peers late (libfabric, NIXL) close them.
    #[cfg_attr(
        not(any(feature = "libfabric", feature = "nixl", test)),
        allow(dead_code)
    )]
    closing: bool,
}

/// A backend's peers.
#[derive(Debug)]
pub(crate) struct PeerTable<P> {
    peers: HashMap<u32, Entry<P>>,
    next: u32,
}

impl<P> Default for PeerTable<P> {
    fn default() -> Self {
        Self {
            peers: HashMap::new(),
            next: 0,
        }
    }
}

impl<P> PeerTable<P> {
    /// Adds a peer under a fresh id.
    pub(crate) fn insert(&mut self, peer: P) -> PeerId {
        let id = self.next;
        // Wrapping after 2^32 new peers in one endpoint's life; an id is never handed out
        // twice while in use.
        self.next = self.next.wrapping_add(1);
        self.peers.insert(
            id,
            Entry {
                peer,
                closing: false,
            },
        );
        PeerId(id)
    }

    /// The peer, closing or not (for the operations in flight to it).
    pub(crate) fn get(&self, id: PeerId) -> Option<&P> {
        self.peers.get(&id.0).map(|e| &e.peer)
    }

    pub(crate) fn get_mut(&mut self, id: PeerId) -> Option<&mut P> {
        self.peers.get_mut(&id.0).map(|e| &mut e.peer)
    }

    /// The peer, unless it is closing (for new operations).
    #[cfg(any(feature = "libfabric", feature = "nixl", test))]
    pub(crate) fn live(&self, id: PeerId) -> Option<&P> {
        self.peers
            .get(&id.0)
            .filter(|e| !e.closing)
            .map(|e| &e.peer)
    }

    /// The id of the first peer, closing or not, that `matches` accepts.
    pub(crate) fn find(&self, mut matches: impl FnMut(&P) -> bool) -> Option<PeerId> {
        self.peers
            .iter()
            .find(|(_, e)| matches(&e.peer))
            .map(|(&id, _)| PeerId(id))
    }

    /// Removes a peer at once.
    pub(crate) fn remove(&mut self, id: PeerId) -> Option<P> {
        self.peers.remove(&id.0).map(|e| e.peer)
    }

    /// Marks a peer closing; whether it was known.
    #[cfg(any(feature = "libfabric", feature = "nixl", test))]
    pub(crate) fn close(&mut self, id: PeerId) -> bool {
        self.peers
            .get_mut(&id.0)
            .map(|e| e.closing = true)
            .is_some()
    }

    /// Takes a closing peer back into use (connected again before it was released).
    #[cfg(any(feature = "libfabric", feature = "nixl", test))]
    pub(crate) fn reopen(&mut self, id: PeerId) {
        if let Some(e) = self.peers.get_mut(&id.0) {
            e.closing = false;
        }
    }

    /// Whether the peer is closing.
    #[cfg(any(feature = "libfabric", feature = "nixl", test))]
    pub(crate) fn is_closing(&self, id: PeerId) -> bool {
        self.peers.get(&id.0).is_some_and(|e| e.closing)
    }

    /// Removes and returns a closing peer, unless operations of its are still `in_flight`.
    #[cfg(any(feature = "libfabric", feature = "nixl", test))]
    pub(crate) fn release(&mut self, id: PeerId, in_flight: bool) -> Option<P> {
        if in_flight || !self.is_closing(id) {
            return None;
        }
        self.remove(id)
    }

    #[cfg(any(feature = "libfabric", feature = "nixl", test))]
    pub(crate) fn len(&self) -> usize {
        self.peers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_not_reused_after_a_removal() {
        let mut table = PeerTable::default();
        let a = table.insert("a");
        let b = table.insert("b");
        assert_eq!(table.remove(a), Some("a"));
        let c = table.insert("c");
        assert_ne!(c, a);
        assert_eq!(table.get(a), None);
        assert_eq!(table.get(b), Some(&"b"));
        assert_eq!(table.find(|p| *p == "c"), Some(c));
        assert_eq!(table.len(), 2);
    }

    #[test]
    fn a_closing_peer_serves_its_operations_until_it_is_released() {
        let mut table = PeerTable::default();
        let a = table.insert("a");
        assert!(table.close(a));
        assert!(!table.close(PeerId(99)));
        assert_eq!(table.live(a), None, "refused to new operations");
        assert_eq!(table.get(a), Some(&"a"), "there for those in flight");
        assert_eq!(table.release(a, true), None, "operations still in flight");
        table.reopen(a);
        assert_eq!(table.live(a), Some(&"a"));
        assert_eq!(table.release(a, false), None, "not closing");
        table.close(a);
        assert_eq!(table.release(a, false), Some("a"));
        assert_eq!(table.get(a), None);
    }
}
