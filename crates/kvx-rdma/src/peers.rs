//! The peers an endpoint is connected to, by [`PeerId`]: ids are never reused, so an id kept
//! after [`Transport::disconnect`](crate::Transport::disconnect) names no peer rather than
//! another one.

use std::collections::HashMap;

use crate::transport::PeerId;

/// A backend's peers.
#[derive(Debug)]
pub(crate) struct PeerTable<P> {
    peers: HashMap<u32, P>,
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
        // 2^32 connections to new peers in one endpoint's life: wrapping is not a concern
        // worth a branch elsewhere, but an id is never handed out twice while in use.
        self.next = self.next.wrapping_add(1);
        self.peers.insert(id, peer);
        PeerId(id)
    }

    pub(crate) fn get(&self, id: PeerId) -> Option<&P> {
        self.peers.get(&id.0)
    }

    pub(crate) fn get_mut(&mut self, id: PeerId) -> Option<&mut P> {
        self.peers.get_mut(&id.0)
    }

    /// The id of the first peer `matches` accepts.
    pub(crate) fn find(&self, mut matches: impl FnMut(&P) -> bool) -> Option<PeerId> {
        self.peers
            .iter()
            .find(|(_, p)| matches(p))
            .map(|(&id, _)| PeerId(id))
    }

    pub(crate) fn remove(&mut self, id: PeerId) -> Option<P> {
        self.peers.remove(&id.0)
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
}
