//! What the producer's and the consumer's state-machine tests (`producer::sim`,
//! `consumer::sim`) share: a small cache layout, endpoints with it registered on a loopback
//! fabric, reading a peer's messages without waiting, and ids.

use std::os::unix::net::UnixStream;
use std::sync::Arc;

use kvx_core::wire::Message;
use kvx_core::{Arrangement, Attempt, BlockId, Dtype, LayoutSpec, MemoryOrder, TransferId};
use kvx_layout::Layout;
use kvx_rdma::loopback::LoopbackFabric;
use kvx_rdma::region::{HostBuffer, LocalRegion};
use kvx_rdma::transport::{Event, Transport};
use kvx_rendezvous::AttemptKey;

use crate::control;
use crate::driver::Driven;

/// 2 layers, 2 KV heads of 8 f32s, 4-token blocks, 16 blocks, NHD, K and V apart.
pub(crate) fn spec() -> LayoutSpec {
    LayoutSpec {
        num_layers: 2,
        total_kv_heads: 2,
        head_dim: 8,
        dtype: Dtype::F32,
        mla: false,
        block_tokens: 4,
        num_blocks: 16,
        tp_size: 1,
        tp_rank: 0,
        order: MemoryOrder::Nhd,
        arrangement: Arrangement::PerLayerSplit,
    }
}

/// An endpoint of `fabric` with the cache of [`spec`] registered, and its regions.
pub(crate) fn endpoint(fabric: &LoopbackFabric) -> (Box<dyn Transport>, Vec<LocalRegion>) {
    let (transport, regions, _) = cache_endpoint_of(fabric, &spec());
    (transport, regions)
}

/// An endpoint of `fabric` with a cache laid out as `spec` registered, its regions, and their
/// memory (to fill and to read).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn cache_endpoint_of(
    fabric: &LoopbackFabric,
    spec: &LayoutSpec,
) -> (Box<dyn Transport>, Vec<LocalRegion>, Vec<Arc<HostBuffer>>) {
    let mut transport: Box<dyn Transport> = Box::new(fabric.endpoint());
    let layout = Layout::new(spec.clone()).expect("a valid layout");
    let (mut regions, mut buffers) = (Vec::new(), Vec::new());
    for i in 0..layout.region_count() {
        let buffer = Arc::new(HostBuffer::new(layout.region_len() as usize).expect("memory"));
        let region = LocalRegion::host(i, Arc::clone(&buffer));
        transport.register(region.clone()).expect("registered");
        regions.push(region);
        buffers.push(buffer);
    }
    (transport, regions, buffers)
}

/// The next message on `stream`, if one is there now.
pub(crate) fn message(stream: &mut UnixStream) -> Option<Message> {
    match incoming(stream) {
        Incoming::Message(message) => Some(message),
        Incoming::Nothing | Incoming::Closed(_) => None,
    }
}

/// What a control connection's end holds now.
pub(crate) enum Incoming {
    Message(Message),
    Nothing,
    /// The other end closed the connection (or sent what is no message).
    Closed(String),
}

/// What `stream` holds now, without waiting.
pub(crate) fn incoming(stream: &mut UnixStream) -> Incoming {
    stream.set_nonblocking(true).expect("a socket");
    let read = control::read_message(stream);
    stream.set_nonblocking(false).expect("a socket");
    match read {
        Ok(message) => Incoming::Message(message),
        Err(control::ControlError::Read(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {
            Incoming::Nothing
        }
        Err(e) => Incoming::Closed(e.to_string()),
    }
}

/// The first attempt of `transfer`.
pub(crate) fn key(transfer: u128) -> AttemptKey {
    AttemptKey::new(TransferId(transfer), Attempt::FIRST)
}

/// Block ids `range`.
pub(crate) fn ids(range: std::ops::Range<u32>) -> Vec<BlockId> {
    range.map(BlockId).collect()
}

/// Hands `driver` what its transport reported, as a turn of the driver loop does.
pub(crate) fn transport_events(driver: &mut impl Driven) {
    deliver(driver, Vec::new(), Some);
}

/// Hands `driver` `earlier` events, then those its transport reported, each as `route` passes it
/// on (`None`: kept from it); whether any came.
pub(crate) fn deliver(
    driver: &mut impl Driven,
    mut events: Vec<Event>,
    mut route: impl FnMut(Event) -> Option<Event>,
) -> bool {
    driver
        .transport()
        .expect("open")
        .poll(&mut events)
        .expect("a loopback poll");
    let came = !events.is_empty();
    for event in events.into_iter().filter_map(&mut route) {
        driver.transport_event(event);
    }
    came
}

/// Hands `driver` `command` and lets its time pass, as one turn of the driver loop does.
pub(crate) fn turn<D: Driven>(driver: &mut D, command: D::Command) {
    driver.command(command);
    driver.tick(driver.clock().now());
}

/// Moves the virtual clock `now` to `at` after the start and lets `driver` see it.
pub(crate) fn advance(
    driver: &mut impl Driven,
    now: &std::sync::atomic::AtomicU64,
    at: std::time::Duration,
) {
    now.store(
        u64::try_from(at.as_nanos()).unwrap_or(u64::MAX),
        std::sync::atomic::Ordering::SeqCst,
    );
    driver.tick(driver.clock().now());
}

/// A fuzz harness's input (`producer::fuzz`, `consumer::fuzz`); past its end, zeros.
pub(crate) struct FuzzBytes<'a>(pub(crate) &'a [u8]);

impl FuzzBytes<'_> {
    /// Whether input is left.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    pub(crate) fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    /// One of a few transfers (two attempts each), so that peers' messages and the engine's
    /// requests meet.
    pub(crate) fn key(&mut self) -> AttemptKey {
        let b = self.byte();
        let attempt = if b & 0x80 == 0 {
            Attempt::FIRST
        } else {
            Attempt::FIRST.next()
        };
        AttemptKey::new(TransferId(u128::from(b % 5)), attempt)
    }

    /// Up to 20 block ids, some past the cache's 16.
    pub(crate) fn blocks(&mut self) -> Vec<BlockId> {
        let n = self.byte() % 21;
        (0..n)
            .map(|_| BlockId(u32::from(self.byte() % 20)))
            .collect()
    }

    /// Any failure reason.
    pub(crate) fn reason(&mut self) -> kvx_core::wire::FailureReason {
        use kvx_core::wire::FailureReason as R;
        [
            R::LeaseExpired,
            R::PeerUnreachable,
            R::TransferFailed,
            R::Aborted,
            R::Rejected,
            R::IncompatibleLayout,
            R::Preempted,
        ][usize::from(self.byte() % 7)]
    }
}

/// A process of this host that runs until the test kills it (`sleep`), and what it is known by.
pub(crate) fn a_process() -> (std::process::Child, kvx_rdma::local_peer::Process) {
    let child = std::process::Command::new("sleep")
        .arg("120")
        .spawn()
        .expect("sleep runs");
    let pid = i32::try_from(child.id()).expect("a pid");
    (child, kvx_rdma::local_peer::Process::of(pid))
}
