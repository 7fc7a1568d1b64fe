//! The posting path: operations resolved into stripes of segments, one stripe per rail
//! ([`Stripe`]), queued as [`Pending`], and posted piece by piece (then the flushes and the notice)
//! as far as the provider takes them; settling reports an operation once nothing of it is left.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use kvx_layout::CopyOp;
use libfabric_sys as sys;

use super::completion::op_error;
use super::context::{Scratch, Use};
use super::fi::{self, FabricError, FiErrno};
use super::peer::Peer;
use super::{posters, stripe, LibfabricTransport, MESSAGE_SLOT};
use crate::board;
use crate::error::OpError;
use crate::transport::{Event, OpId, OpKind, PeerId};

/// Retries of a post that keeps returning `-FI_EAGAIN` (each after reading the completion queue,
/// blocking up to a millisecond when nothing completed) before it is reported as failed.
const MAX_AGAIN: usize = 10_000;

/// The error of an operation whose peer link is gone (see `post_one`).
pub(super) fn no_link() -> FiErrno {
    FiErrno::new(-i64::from(sys::FI_ENOENT))
}

/// One resolved copy operation: where its pieces start on both sides.
#[derive(Clone, Copy, Debug)]
pub(super) struct Segment {
    pub(super) local: usize,
    pub(super) desc: *mut c_void,
    pub(super) remote: u64,
    pub(super) key: u64,
    pub(super) len: u64,
    pub(super) count: u64,
    pub(super) local_stride: u64,
    pub(super) remote_stride: u64,
}

/// A position in a stripe: segment, piece, byte within the piece.
pub(super) type Cursor = (usize, u64, u64);

/// One piece of a stripe, ready to post.
#[derive(Clone, Copy, Debug)]
pub(super) struct PieceAt {
    pub(super) seg: Segment,
    pub(super) local: usize,
    pub(super) remote: u64,
    pub(super) len: u64,
    /// The cursor after this piece.
    pub(super) next: Cursor,
}

/// The part of an operation that one link (rail) moves.
#[derive(Debug)]
pub(super) struct Stripe {
    pub(super) link: usize,
    pub(super) segments: Vec<Segment>,
    /// Next piece to post.
    pub(super) cursor: Cursor,
}

impl Stripe {
    pub(super) fn has_data(&self) -> bool {
        self.cursor.0 < self.segments.len()
    }

    /// The piece at `cursor` (at most `max_chunk` bytes); `None` past the last segment.
    pub(super) fn piece_at(&self, cursor: Cursor, max_chunk: u64) -> Option<PieceAt> {
        let (seg_index, piece, within) = cursor;
        let seg = *self.segments.get(seg_index)?;
        let chunk = (seg.len - within).min(max_chunk);
        let local = seg.local + (piece * seg.local_stride + within) as usize;
        let remote = seg.remote + piece * seg.remote_stride + within;
        let mut next = (seg_index, piece, within + chunk);
        if next.2 >= seg.len {
            next = (seg_index, piece + 1, 0);
            if next.1 >= seg.count {
                next = (seg_index + 1, 0, 0);
            }
        }
        Some(PieceAt {
            seg,
            local,
            remote,
            len: chunk,
            next,
        })
    }
}

#[derive(Debug)]
pub(super) struct Pending {
    pub(super) kind: OpKind,
    pub(super) peer: PeerId,
    pub(super) bytes: u64,
    pub(super) stripes: Vec<Stripe>,
    /// The stripe to post from next (the rails take turns).
    pub(super) next_stripe: usize,
    pub(super) in_flight: usize,
    pub(super) notice: Option<u64>,
    /// The link the notice goes on.
    pub(super) notice_link: usize,
    /// Links (other than the notice's) that carried data of a write with a notice and must be
    /// flushed before the notice goes: a tiny RMA read of the peer's notice slot on that link
    /// completes only after the link's earlier writes are in the peer's memory (the provider
    /// processes a link's operations in order), which holds even where a provider's
    /// delivery-complete completion comes early (`tcp;ofi_rxm`).
    pub(super) flush: Vec<usize>,
    /// The flush reads have started.
    pub(super) flushing: bool,
    pub(super) notice_posted: bool,
    /// Where the notice goes instead, written by cross-memory attach: the peer's process and
    /// the slot's address in its notice board.
    pub(super) board: Option<(i32, u64)>,
    pub(super) failed: Option<OpError>,
    /// Reported as timed out; completions still owed by the provider are drained silently.
    pub(super) abandoned: bool,
    pub(super) deadline: Instant,
    pub(super) local_regions: Vec<u32>,
    /// A send not posted yet: its send slot and length.
    pub(super) send: Option<(usize, usize)>,
}

impl Pending {
    pub(super) fn data_left(&self) -> bool {
        self.failed.is_none() && (self.send.is_some() || self.stripes.iter().any(Stripe::has_data))
    }

    /// A flush read is due: the data completions are in (or the flush has begun).
    pub(super) fn flush_due(&self) -> bool {
        self.failed.is_none()
            && !self.data_left()
            && self.notice.is_some()
            && !self.flush.is_empty()
            && (self.in_flight == 0 || self.flushing)
    }

    pub(super) fn wants_post(&self) -> bool {
        self.data_left()
            || self.flush_due()
            || (self.failed.is_none()
                && self.in_flight == 0
                && self.flush.is_empty()
                && self.notice.is_some()
                && !self.notice_posted)
    }
}

impl LibfabricTransport {
    pub(super) fn post_recv(&mut self, rail: usize, slot: usize) -> Result<(), FabricError> {
        let ctx = self.contexts.take(Use::Recv { rail, slot });
        let r = &self.rails[rail];
        let ptr = r.scratch.ptr(Scratch::RECV_BASE + slot * MESSAGE_SLOT);
        let desc = r.scratch.mr.desc();
        let mut tries = 0;
        loop {
            // SAFETY: the receive slot lies inside the rail's registered scratch buffer, which
            // outlives the endpoint's operations (drop order); the context stays in the pool
            // until its completion is read.
            let result = unsafe {
                self.rails[rail]
                    .ep
                    .post_msg(ptr, self.max_message, desc, None, ctx)
            };
            match result {
                Ok(()) => return Ok(()),
                Err(e) if e.is_again() && tries < MAX_AGAIN => {
                    // Receives are posted at start-up and after each received message; the
                    // receive queue has room again once the provider made progress.
                    tries += 1;
                    if self.drain(rail, None)? == 0 {
                        self.drain(rail, Some(1))?;
                    }
                }
                Err(e) => {
                    self.contexts.give_back(ctx);
                    return Err(FabricError::PostRecv(e));
                }
            }
        }
    }

    pub(super) fn new_op(&mut self) -> u64 {
        self.next_op += 1;
        self.next_op
    }

    /// The local regions `ops` use; `write` says whether local is the source side.
    pub(super) fn local_regions(ops: &[CopyOp], write: bool) -> Vec<u32> {
        let mut locals = Vec::new();
        for op in ops {
            let index = if write { op.src_region } else { op.dst_region };
            if !locals.contains(&index) {
                locals.push(index);
            }
        }
        locals
    }

    /// Resolves `ops` into segments on link `link` of `peer`; `write` says whether local is the
    /// source side.
    pub(super) fn resolve(
        &self,
        peer: &Peer,
        link: usize,
        ops: &[CopyOp],
        write: bool,
    ) -> Vec<Segment> {
        let mut segments = Vec::with_capacity(ops.len());
        for op in ops {
            let (
                local_region,
                local_offset,
                local_stride,
                remote_region,
                remote_offset,
                remote_stride,
            ) = if write {
                (
                    op.src_region,
                    op.src_offset,
                    op.src_stride,
                    op.dst_region,
                    op.dst_offset,
                    op.dst_stride,
                )
            } else {
                (
                    op.dst_region,
                    op.dst_offset,
                    op.dst_stride,
                    op.src_region,
                    op.src_offset,
                    op.src_stride,
                )
            };
            // Every lookup succeeds: `check_ops` accepted the operations against the same tables,
            // every region is registered on every rail, and `connect` checked that the peer's
            // rail table has a key for each of its regions on each rail.
            let (Some(local), Some(remote), Some(key)) = (
                self.regions.get(&local_region),
                peer.desc.region(remote_region),
                peer.rails.key(&peer.desc, link, remote_region),
            ) else {
                continue;
            };
            let Some(mr) = local.mrs.get(link) else {
                continue;
            };
            segments.push(Segment {
                local: local.region.addr() + local_offset as usize,
                desc: mr.desc(),
                remote: remote.addr + remote_offset,
                key,
                len: op.len,
                count: op.count,
                local_stride,
                remote_stride,
            });
        }
        segments
    }

    /// Splits `ops` into one stripe per link of `peer` that gets any (see [`stripe::stripe`]).
    pub(super) fn stripes(&mut self, peer: PeerId, ops: &[CopyOp], write: bool) -> Vec<Stripe> {
        let Some(links) = self.peers.get(peer).map(|p| p.links.len()) else {
            return Vec::new();
        };
        if links <= 1 {
            let Some(p) = self.peers.get(peer) else {
                return Vec::new();
            };
            return vec![Stripe {
                link: 0,
                segments: self.resolve(p, 0, ops, write),
                cursor: (0, 0, 0),
            }];
        }
        let first = self.next_rail % links;
        self.next_rail = self.next_rail.wrapping_add(1);
        let Some(peer) = self.peers.get(peer) else {
            return Vec::new();
        };
        stripe::stripe(ops, links, self.stripe_threshold, first)
            .into_iter()
            .enumerate()
            .filter(|(_, ops)| !ops.is_empty())
            .map(|(link, ops)| Stripe {
                link,
                segments: self.resolve(peer, link, &ops, write),
                cursor: (0, 0, 0),
            })
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn submit(
        &mut self,
        kind: OpKind,
        peer: PeerId,
        bytes: u64,
        stripes: Vec<Stripe>,
        locals: Vec<u32>,
        notice: Option<u64>,
        board: Option<(i32, u64)>,
    ) -> u64 {
        let op = self.new_op();
        for index in &locals {
            if let Some(r) = self.regions.get_mut(index) {
                r.users += 1;
            }
        }
        let notice_link = stripes.first().map_or(0, |s| s.link);
        let flush = if notice.is_some() {
            stripes
                .iter()
                .map(|s| s.link)
                .filter(|&link| link != notice_link)
                .collect()
        } else {
            Vec::new()
        };
        self.pending.insert(
            op,
            Pending {
                kind,
                peer,
                bytes,
                stripes,
                next_stripe: 0,
                in_flight: 0,
                notice,
                notice_link,
                flush,
                flushing: false,
                notice_posted: false,
                board,
                failed: None,
                abandoned: false,
                deadline: Instant::now() + self.op_timeout,
                local_regions: locals,
                send: None,
            },
        );
        self.post_queue.push_back(op);
        // The operation is accepted: a failure of the endpoint while posting it is reported by
        // the next poll or wait.
        if let Err(error) = self.pump() {
            self.broken.get_or_insert(error);
        }
        op
    }

    /// Posts queued work until the queue is empty or the provider pushes back; on `-FI_EAGAIN`
    /// reads the completion queues (progress) and tries again while that frees anything.
    pub(super) fn pump(&mut self) -> Result<(), FabricError> {
        loop {
            let blocked = self.post_queued();
            if !blocked {
                return Ok(());
            }
            if self.drain_all()? == 0 {
                // Nothing completed: leave the rest for the next poll or wait.
                return Ok(());
            }
        }
    }

    /// Posts from the queue; returns whether the provider (or the in-flight limit) pushed back.
    ///
    /// A peer whose post was pushed back is skipped for the rest of the pass (its operations
    /// keep their order), so that one peer that does not take writes (one never contacted that
    /// does not read, one whose queue is full) holds up no other.
    pub(super) fn post_queued(&mut self) -> bool {
        let mut refused: Vec<PeerId> = Vec::new();
        let mut at = 0;
        while let Some(&op) = self.post_queue.get(at) {
            let Some(p) = self.pending.get(&op) else {
                self.post_queue.remove(at);
                continue;
            };
            if !p.wants_post() {
                self.post_queue.remove(at);
                continue;
            }
            let peer = p.peer;
            if refused.contains(&peer) {
                at += 1;
                continue;
            }
            if self.contexts.in_flight() >= self.in_flight_cap {
                return true;
            }
            if self.peer_terminated(peer) {
                // Never posted to: the post could spin for ever on a lock it died holding.
                self.abandon(op, || OpError::PeerUnreachable {
                    source: "the peer's process has exited".into(),
                });
                continue;
            }
            if self.peer_region_locked(peer) {
                // Posted later: the post would spin on the lock (for ever, were its holder
                // dead); the operation's timeout still bounds the wait.
                refused.push(peer);
                at += 1;
                continue;
            }
            match self.post_one(op) {
                Ok(()) => {}
                Err(e) if e.is_again() => {
                    refused.push(peer);
                    at += 1;
                }
                Err(e) => {
                    let kind = self.pending.get(&op).map(|p| p.kind);
                    let error = match kind {
                        Some(OpKind::Read) => FabricError::PostRead(e),
                        Some(OpKind::Send) => FabricError::PostSend(e),
                        _ => FabricError::PostWrite(e),
                    };
                    self.fail(op, op_error(error));
                }
            }
        }
        !refused.is_empty()
    }

    /// Posts the next piece (or the notice, or the send) of `op`.
    pub(super) fn post_one(&mut self, op: u64) -> Result<(), FiErrno> {
        let Some(p) = self.pending.get(&op) else {
            return Ok(());
        };
        // A pending operation's peer stays until the operation settles (`disconnect`); a link
        // it cannot find (a reconnect that described fewer rails) fails the operation rather
        // than leaving it queued for ever.
        let peer_id = p.peer;
        let Some(peer) = self.peers.get(peer_id) else {
            return Err(no_link());
        };
        if p.flush_due() {
            let link = p.flush[p.flush.len() - 1];
            let (Some(&peer_addr), Some(target)) =
                (peer.links.get(link), peer.rails.rails.get(link))
            else {
                return Err(no_link());
            };
            let slot = target.notice;
            let rail = &self.rails[link];
            let ctx = self.contexts.take(Use::Flush { op });
            // SAFETY: the landing place (8 bytes after the notice source) lies inside the rail's
            // registered scratch buffer, which outlives every operation, and nothing reads it;
            // the context stays in the pool until its completion is read.
            let result = unsafe {
                rail.ep.post_read(
                    rail.scratch.ptr(Scratch::FLUSH_TARGET),
                    8,
                    rail.scratch.mr.desc(),
                    peer_addr,
                    slot.addr,
                    slot.key,
                    ctx,
                )
            };
            self.note_post(peer_id, link, &result);
            if let Err(e) = result {
                self.contexts.give_back(ctx);
                return Err(e);
            }
            if let Some(p) = self.pending.get_mut(&op) {
                p.flush.pop();
                p.flushing = true;
                p.in_flight += 1;
            }
            return Ok(());
        }
        if !p.data_left() {
            // The notice: every data completion of every rail has been read (`wants_post`).
            if let Some((pid, addr)) = p.board {
                self.write_board_notice(op, pid, addr);
                return Ok(());
            }
            let link = p.notice_link;
            let (Some(&peer_addr), Some(target)) =
                (peer.links.get(link), peer.rails.rails.get(link))
            else {
                return Err(no_link());
            };
            let slot = target.notice;
            let data = p.notice.unwrap_or(0);
            let rail = &self.rails[link];
            let ctx = self.contexts.take(Use::Notice { op });
            // SAFETY: the notice source lies inside the rail's registered scratch buffer, which
            // outlives every operation; the context stays in the pool until its completion is
            // read.
            let result = unsafe {
                rail.ep.post_write(
                    rail.scratch.ptr(Scratch::NOTICE_SOURCE),
                    8,
                    rail.scratch.mr.desc(),
                    peer_addr,
                    slot.addr,
                    slot.key,
                    Some(data),
                    ctx,
                )
            };
            self.note_post(peer_id, link, &result);
            return match result {
                Ok(()) => {
                    if let Some(p) = self.pending.get_mut(&op) {
                        p.notice_posted = true;
                    }
                    Ok(())
                }
                Err(e) => {
                    self.contexts.give_back(ctx);
                    Err(e)
                }
            };
        }
        if let Some((slot, len)) = p.send {
            let peer_addr = peer.links[0];
            let rail = &self.rails[0];
            let ctx = self.contexts.take(Use::Send { op, slot });
            // SAFETY: the send slot lies inside rail 0's registered scratch buffer and is not
            // reused until its completion is read (free list); the context stays in the pool
            // until then.
            let result = unsafe {
                rail.ep.post_msg(
                    rail.scratch.ptr(Scratch::SEND_BASE + slot * MESSAGE_SLOT),
                    len,
                    rail.scratch.mr.desc(),
                    Some(peer_addr),
                    ctx,
                )
            };
            self.note_post(peer_id, 0, &result);
            if let Err(e) = result {
                self.contexts.give_back(ctx);
                return Err(e);
            }
            if let Some(p) = self.pending.get_mut(&op) {
                p.send = None;
                p.in_flight += 1;
            }
            return Ok(());
        }
        if self.posters.is_some() && p.stripes.len() > 1 {
            return self.post_stripes_together(op);
        }
        // The rails take turns; one that pushes back lets the others go on.
        let (count, start) = (p.stripes.len(), p.next_stripe);
        let mut again = None;
        for k in 0..count {
            let s = (start + k) % count;
            match self.post_piece(op, s) {
                Ok(true) => {
                    if let Some(p) = self.pending.get_mut(&op) {
                        p.next_stripe = (s + 1) % count;
                    }
                    return Ok(());
                }
                Ok(false) => {}
                Err(e) if e.is_again() => again = Some(e),
                Err(e) => return Err(e),
            }
        }
        again.map_or(Ok(()), Err)
    }

    /// Posts the next piece of stripe `s` of `op`; `Ok(false)` when the stripe has nothing left.
    pub(super) fn post_piece(&mut self, op: u64, s: usize) -> Result<bool, FiErrno> {
        let Some(p) = self.pending.get(&op) else {
            return Ok(false);
        };
        let Some(stripe) = p.stripes.get(s) else {
            return Ok(false);
        };
        let Some(PieceAt {
            seg,
            local,
            remote,
            len: chunk,
            next,
        }) = stripe.piece_at(stripe.cursor, self.max_chunk as u64)
        else {
            return Ok(false);
        };
        let link = stripe.link;
        let (kind, peer_id) = (p.kind, p.peer);
        let Some(&peer_addr) = self
            .peers
            .get(peer_id)
            .and_then(|peer| peer.links.get(link))
        else {
            return Err(no_link());
        };
        let ep = &self.rails[link].ep;
        let ctx = self.contexts.take(Use::Data { op });
        // SAFETY: the range was checked against the local registration, which cannot be
        // deregistered while the operation is pending (`users`); the context stays in the pool
        // until its completion is read.
        let result = unsafe {
            if kind == OpKind::Read {
                ep.post_read(
                    local as *mut u8,
                    chunk as usize,
                    seg.desc,
                    peer_addr,
                    remote,
                    seg.key,
                    ctx,
                )
            } else {
                ep.post_write(
                    local as *const u8,
                    chunk as usize,
                    seg.desc,
                    peer_addr,
                    remote,
                    seg.key,
                    None,
                    ctx,
                )
            }
        };
        self.note_post(peer_id, link, &result);
        if let Err(e) = result {
            self.contexts.give_back(ctx);
            return Err(e);
        }
        if let Some(p) = self.pending.get_mut(&op) {
            p.in_flight += 1;
            if let Some(stripe) = p.stripes.get_mut(s) {
                stripe.cursor = next;
            }
        }
        Ok(true)
    }

    /// Posts as many pieces of every stripe of `op` as the in-flight limit allows, each rail's
    /// on its own thread at the same time ([`posters`]); `Ok` when anything was posted.
    pub(super) fn post_stripes_together(&mut self, op: u64) -> Result<(), FiErrno> {
        let Some(posters) = &self.posters else {
            return Ok(());
        };
        let Some(p) = self.pending.get(&op) else {
            return Ok(());
        };
        let room = self.in_flight_cap.saturating_sub(self.contexts.in_flight());
        let per_stripe = (room / p.stripes.len().max(1)).max(1);
        let read = p.kind == OpKind::Read;
        let Some(links) = self.peers.get(p.peer).map(|peer| &peer.links) else {
            return Ok(());
        };
        let max_chunk = self.max_chunk as u64;
        let mut work: Vec<Vec<posters::Piece>> = vec![Vec::new(); self.rails.len()];
        // Per rail: the stripe it carries and the cursor after each of its pieces.
        let mut plans: Vec<Option<(usize, Vec<Cursor>)>> = vec![None; self.rails.len()];
        for (s, stripe) in p.stripes.iter().enumerate() {
            let link = stripe.link;
            if plans[link].is_some() {
                continue; // one stripe per rail and pass
            }
            let mut cursor = stripe.cursor;
            let mut after = Vec::new();
            while after.len() < per_stripe {
                let Some(at) = stripe.piece_at(cursor, max_chunk) else {
                    break;
                };
                work[link].push(posters::Piece {
                    read,
                    local: at.local,
                    len: at.len as usize,
                    desc: at.seg.desc,
                    peer: links[link],
                    remote: at.remote,
                    key: at.seg.key,
                    context: self.contexts.take(Use::Data { op }),
                });
                after.push(at.next);
                cursor = at.next;
            }
            plans[link] = Some((s, after));
        }
        let eps: Vec<Arc<fi::Endpoint>> = self.rails.iter().map(|r| Arc::clone(&r.ep)).collect();
        let contexts: Vec<Vec<*mut c_void>> = work
            .iter()
            .map(|pieces| pieces.iter().map(|piece| piece.context).collect())
            .collect();
        // SAFETY: every range was checked against the local registration, which cannot be
        // deregistered while the operation is pending; the contexts stay in the pool until their
        // completions are read (those of pieces not posted are given back below); no rail is
        // used by this thread while the posting threads run (`post` returns after all of them).
        let outcomes = unsafe { posters.post(&eps, work) };
        let peer = self.pending.get(&op).map(|p| p.peer);
        let (mut posted_any, mut again, mut failed) = (false, None, None);
        for (link, (posted, error)) in outcomes.into_iter().enumerate() {
            if let Some(peer) = peer {
                if posted > 0 {
                    self.note_post(peer, link, &Ok(()));
                } else if let Some(e) = &error {
                    self.note_post(peer, link, &Err(e.clone()));
                }
            }
            for &ctx in contexts[link].iter().skip(posted) {
                self.contexts.give_back(ctx);
            }
            if let (Some((s, after)), Some(p)) = (&plans[link], self.pending.get_mut(&op)) {
                if posted > 0 {
                    p.in_flight += posted;
                    p.stripes[*s].cursor = after[posted - 1];
                    posted_any = true;
                }
            }
            match error {
                Some(e) if e.is_again() => again = Some(e),
                Some(e) => failed = Some(e),
                None => {}
            }
        }
        match (failed, again) {
            (Some(e), _) => Err(e),
            (None, Some(e)) if !posted_any => Err(e),
            _ => Ok(()),
        }
    }

    /// Writes `op`'s notice into the peer's notice board (its data is in place: every data
    /// completion has been read, and `shm` completes a write on delivery) and settles `op`. A
    /// peer that is gone fails it; one whose memory this process may not write (a setting that
    /// changed after its description was made) gets the notice as a message instead.
    pub(super) fn write_board_notice(&mut self, op: u64, pid: i32, addr: u64) {
        let Some(p) = self.pending.get_mut(&op) else {
            return;
        };
        p.board = None;
        let value = p.notice.unwrap_or(0);
        match board::write_remote(pid, addr, value) {
            Ok(()) => {
                p.notice = None;
                self.settle(op);
            }
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                if !self.post_queue.contains(&op) {
                    self.post_queue.push_back(op);
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => self.fail(
                op,
                OpError::PeerUnreachable {
                    source: format!("writing the notice: the peer's process is gone ({e})").into(),
                },
            ),
            Err(e) => self.fail(
                op,
                OpError::RemoteAccess {
                    source: format!("writing the notice into the peer's board: {e}").into(),
                },
            ),
        }
    }

    /// Marks `op` failed (the first error wins); it is reported once nothing is in flight.
    pub(super) fn fail(&mut self, op: u64, error: OpError) {
        if let Some(p) = self.pending.get_mut(&op) {
            if p.failed.is_none() {
                p.failed = Some(error);
            }
        }
        self.settle(op);
    }

    /// Reports and forgets `op` if nothing of it is in flight any more and nothing is left to post.
    pub(super) fn settle(&mut self, op: u64) {
        let Some(p) = self.pending.get(&op) else {
            return;
        };
        if p.in_flight > 0 || p.notice_posted || p.wants_post() {
            if p.wants_post() && !self.post_queue.contains(&op) {
                self.post_queue.push_back(op);
            }
            return;
        }
        let Some(p) = self.pending.remove(&op) else {
            return;
        };
        if self.peers.is_closing(p.peer) {
            self.release_if_idle(p.peer);
        }
        if let Some((slot, _)) = p.send {
            // Never posted (failed or timed out before): the slot is free again.
            self.rails[0].scratch.free_sends.push(slot);
        }
        for index in &p.local_regions {
            if let Some(r) = self.regions.get_mut(index) {
                r.users = r.users.saturating_sub(1);
            }
        }
        if p.abandoned {
            return;
        }
        let id = OpId(op);
        self.events.push_back(match p.failed {
            Some(error) => Event::Failed {
                op: id,
                kind: p.kind,
                peer: p.peer,
                error,
            },
            None if p.kind == OpKind::Read => Event::ReadDone {
                op: id,
                peer: p.peer,
                bytes: p.bytes,
            },
            None if p.kind == OpKind::Send => Event::SendDone {
                op: id,
                peer: p.peer,
            },
            None => Event::WriteDone {
                op: id,
                peer: p.peer,
                bytes: p.bytes,
            },
        });
    }

    /// Gives up on `op`: nothing more is posted for it, no notice goes, and it is reported
    /// failed with the error `error` makes.
    pub(super) fn abandon(&mut self, op: u64, error: impl Fn() -> OpError) {
        let Some(p) = self.pending.get_mut(&op) else {
            return;
        };
        p.abandoned = true;
        for stripe in &mut p.stripes {
            stripe.cursor = (stripe.segments.len(), 0, 0);
        }
        p.notice = None;
        p.flush.clear();
        if p.failed.is_none() {
            p.failed = Some(error());
        }
        let (kind, peer) = (p.kind, p.peer);
        self.events.push_back(Event::Failed {
            op: OpId(op),
            kind,
            peer,
            error: error(),
        });
        self.settle(op);
    }
}
