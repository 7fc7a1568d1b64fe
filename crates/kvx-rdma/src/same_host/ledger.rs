//! The operations of a same-host endpoint ([`Ledger`]): ids, what is in flight and which regions
//! it uses, timeouts, and the events waiting for the next poll.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::error::OpError;
use crate::transport::{Event, OpId, OpKind, PeerId};

struct Pending {
    peer: PeerId,
    kind: OpKind,
    bytes: u64,
    /// Local regions the operation uses (they cannot be deregistered meanwhile).
    regions: Vec<u32>,
    started: Instant,
}

/// The operations of one endpoint: ids, what is in flight, and the events waiting for the next
/// poll.
#[derive(Default)]
pub(crate) struct Ledger {
    next: u64,
    pending: HashMap<u64, Pending>,
    events: VecDeque<Event>,
}

impl Ledger {
    /// The id the next operation gets.
    pub(crate) fn next_id(&self) -> u64 {
        self.next
    }

    /// Records an accepted operation as in flight under [`Ledger::next_id`].
    pub(crate) fn start(
        &mut self,
        peer: PeerId,
        kind: OpKind,
        bytes: u64,
        regions: Vec<u32>,
    ) -> OpId {
        let op = self.next;
        self.next += 1;
        self.pending.insert(
            op,
            Pending {
                peer,
                kind,
                bytes,
                regions,
                started: Instant::now(),
            },
        );
        OpId(op)
    }

    /// An operation that completes at once (a sent message) or fails at once (a dead peer).
    pub(crate) fn done_now(
        &mut self,
        peer: PeerId,
        kind: OpKind,
        result: Result<(), OpError>,
    ) -> OpId {
        let op = OpId(self.next);
        self.next += 1;
        self.events.push_back(match result {
            Ok(()) => Event::SendDone { op, peer },
            Err(error) => Event::Failed {
                op,
                kind,
                peer,
                error,
            },
        });
        op
    }

    /// Fails an in-flight operation now (it could not be handed to the worker).
    pub(crate) fn fail(&mut self, op: u64, error: OpError) {
        if let Some(p) = self.pending.remove(&op) {
            self.events.push_back(Event::Failed {
                op: OpId(op),
                kind: p.kind,
                peer: p.peer,
                error,
            });
        }
    }

    /// Turns the worker's results into events (results of operations that already timed out are
    /// dropped), then fails what has been in flight longer than `timeout`.
    pub(crate) fn settle(&mut self, results: Vec<(u64, Result<(), OpError>)>, timeout: Duration) {
        for (op, result) in results {
            let Some(p) = self.pending.remove(&op) else {
                continue;
            };
            let (op, peer, bytes) = (OpId(op), p.peer, p.bytes);
            self.events.push_back(match (result, p.kind) {
                (Ok(()), OpKind::Read) => Event::ReadDone { op, peer, bytes },
                (Ok(()), OpKind::Send) => Event::SendDone { op, peer },
                (Ok(()), OpKind::Write) => Event::WriteDone { op, peer, bytes },
                (Err(error), kind) => Event::Failed {
                    op,
                    kind,
                    peer,
                    error,
                },
            });
        }
        let expired: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.started.elapsed() > timeout)
            .map(|(&op, _)| op)
            .collect();
        for op in expired {
            self.fail(op, OpError::TimedOut(timeout));
        }
    }

    /// Operations in flight that use local region `index`.
    pub(crate) fn using(&self, index: u32) -> usize {
        self.pending
            .values()
            .filter(|p| p.regions.contains(&index))
            .count()
    }

    /// [`Transport::deregister`](crate::Transport::deregister) for a same-host transport: forgets
    /// region `index` of `regions` unless an operation in flight uses it.
    pub(crate) fn deregister<V>(
        &self,
        regions: &mut std::collections::BTreeMap<u32, V>,
        index: u32,
    ) -> Result<(), crate::error::DeregisterError> {
        use crate::error::DeregisterError;
        if !regions.contains_key(&index) {
            return Err(DeregisterError::Unknown(index));
        }
        let ops = self.using(index);
        if ops > 0 {
            return Err(DeregisterError::InUse { index, ops });
        }
        regions.remove(&index);
        Ok(())
    }

    /// Whether anything is in flight.
    pub(crate) fn busy(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Moves the waiting events into `events`; returns how many.
    pub(crate) fn drain_into(&mut self, events: &mut Vec<Event>) -> usize {
        let n = self.events.len();
        events.extend(self.events.drain(..));
        n
    }

    /// Where received notices and messages go.
    pub(crate) fn inbox(&mut self) -> &mut VecDeque<Event> {
        &mut self.events
    }
}
