//! Counters a side keeps, readable at any time.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

use kvx_rendezvous::Reason;

/// Most transfer samples kept between two reads; beyond it the oldest are dropped.
pub const MAX_TRANSFER_SAMPLES: usize = 4096;

/// One transfer this side posted, from its post to its completion.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct TransferSample {
    /// Seconds from the post of its (last) writes to their completion.
    pub seconds: f64,
    /// Bytes those writes moved.
    pub bytes: u64,
}

/// Live counters.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) held: AtomicI64,
    pub(crate) transfers_started: AtomicU64,
    pub(crate) transfers_ok: AtomicU64,
    pub(crate) transfers_failed: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) bytes_streamed: AtomicU64,
    pub(crate) finishing_hints: AtomicU64,
    pub(crate) nudges: AtomicU64,
    pub(crate) remembered_registrations: AtomicU64,
    pub(crate) board_ready: AtomicU64,
    pub(crate) router_aborts: AtomicU64,
    pub(crate) driver_turns: AtomicU64,
    pub(crate) local_connections: AtomicU64,
    pub(crate) released_unconfirmed: AtomicU64,
    pub(crate) handshakes_evicted: AtomicU64,
    pub(crate) handshakes_failed: AtomicU64,
    pub(crate) idle_closed: AtomicU64,
    pub(crate) unauthorized: AtomicU64,
    pub(crate) ops_posted: AtomicU64,
    pub(crate) in_flight: AtomicI64,
    /// Requests that ended failed, by cause ([`Reason::as_str`]): a short lock, on failures only.
    failures: Mutex<std::collections::BTreeMap<&'static str, u64>>,
    /// The rails (NICs, or network interfaces) the transport opened on.
    rails: Mutex<Vec<String>>,
    /// Transfers finished since the last [`Stats::take_samples`] (producer).
    samples: Samples<TransferSample>,
    /// Seconds requests waited for their KV, since the last [`Stats::take_waits`] (consumer).
    waits: Samples<f64>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Samples kept between two reads: at most [`MAX_TRANSFER_SAMPLES`], the newest.
#[derive(Debug)]
struct Samples<T>(Mutex<VecDeque<T>>);

impl<T> Default for Samples<T> {
    fn default() -> Self {
        Self(Mutex::new(VecDeque::new()))
    }
}

impl<T> Samples<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<T>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn record(&self, sample: T) {
        let mut samples = self.lock();
        if samples.len() == MAX_TRANSFER_SAMPLES {
            samples.pop_front();
        }
        samples.push_back(sample);
    }

    fn take(&self) -> Vec<T> {
        self.lock().drain(..).collect()
    }
}

/// A copy of a side's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Requests whose blocks (producer) or registrations (consumer) are held right now.
    pub held: i64,
    /// Transfers started.
    pub transfers_started: u64,
    /// Transfers that delivered.
    pub transfers_ok: u64,
    /// Transfers that failed.
    pub transfers_failed: u64,
    /// Bytes posted.
    pub bytes_written: u64,
    /// Of those, bytes written while their request was still computing (producer, push).
    pub bytes_streamed: u64,
    /// `Finishing` hints sent (producer) or received (consumer).
    pub finishing_hints: u64,
    /// Empty heartbeats sent to make a consumer that takes hints read its transport, because
    /// an early write to it waited (producer).
    pub nudges: u64,
    /// Registrations the producer's consumer connections remember, to abort them if their
    /// consumer disconnects: those still live, plus at most as many that ended since the last
    /// clean-up (a gauge that stays bounded however long a connection lives).
    pub remembered_registrations: u64,
    /// Push requests found ready in the notice board by the engine thread (consumer): their
    /// notices cost the driver thread no wake-up.
    pub board_ready: u64,
    /// Aborts from routers handled by the producer's driver, honoured or refused (a router
    /// may abort only what no decode registered or reads).
    pub router_aborts: u64,
    /// Times the driver thread woke up and took its turn (consumer): for a timer, a command, a
    /// transport event.
    pub driver_turns: u64,
    /// Control connections to producer ranks made over a Unix socket (consumer; see
    /// `ConnectorConfig::local_sockets`).
    pub local_connections: u64,
    /// Failed requests whose blocks went back to the engine at the quiesce bound, without
    /// every producer rank's confirmation that it writes no more (consumer). Each is a request
    /// whose blocks a late write could still reach: worth an alert.
    pub released_unconfirmed: u64,
    /// Control connections dropped before their hello arrived because newer ones came while
    /// [`MAX_WAITING_HANDSHAKES`](crate::producer::MAX_WAITING_HANDSHAKES) waited (producer):
    /// a peer opening connections it does not use.
    pub handshakes_evicted: u64,
    /// Control connections whose hello did not come in time, or was not a hello of this
    /// protocol version (producer).
    pub handshakes_failed: u64,
    /// Control connections closed because their peer said nothing for the idle timeout
    /// (producer; `ConnectorConfig::idle_timeout`).
    pub idle_closed: u64,
    /// Requests refused before connecting (consumer), and registrations and aborts refused
    /// (producer), because their capability did not verify or named another engine, or their
    /// prefill is not on the `peers` list.
    pub unauthorized: u64,
    /// Transport operations posted (writes and reads; a request's layers or chunks may take
    /// several).
    pub ops_posted: u64,
    /// Transfers in flight right now: writes posted and not completed (producer), reads
    /// (consumer, pull).
    pub in_flight: i64,
}

/// A handle on a side's live counters that can go to another thread (a metrics endpoint reads
/// it when scraped).
#[derive(Clone, Debug)]
pub struct StatsReader(pub(crate) std::sync::Arc<Stats>);

impl StatsReader {
    /// The counters now.
    #[must_use]
    pub fn snapshot(&self) -> StatsSnapshot {
        self.0.snapshot()
    }

    /// Requests that ended failed so far, by cause (`lease_expired`, `peer_failed`, …: the
    /// names of `kvx_rendezvous::Reason`), causes that never happened left out.
    #[must_use]
    pub fn failures_by_cause(&self) -> Vec<(&'static str, u64)> {
        self.0.failures_by_cause()
    }

    /// The producer's transfer samples since the last take (what
    /// [`Producer::take_transfer_samples`](crate::Producer::take_transfer_samples) returns), for
    /// a metrics endpoint that is their only reader.
    #[must_use]
    pub fn take_transfer_samples(&self) -> Vec<TransferSample> {
        self.0.take_samples()
    }

    /// The consumer's wait samples since the last take (what
    /// [`Consumer::take_wait_samples`](crate::Consumer::take_wait_samples) returns), for a
    /// metrics endpoint that is their only reader.
    #[must_use]
    pub fn take_wait_samples(&self) -> Vec<f64> {
        self.0.take_waits()
    }

    /// The rails the side's transport opened on (NIC or interface names; empty for same-host
    /// transports).
    #[must_use]
    pub fn rails(&self) -> Vec<String> {
        self.0.rails()
    }
}

impl Stats {
    /// Records a finished transfer (off the hot path's locks: a short lock of its own).
    pub(crate) fn record(&self, seconds: f64, bytes: u64) {
        self.samples.record(TransferSample { seconds, bytes });
    }

    pub(crate) fn take_samples(&self) -> Vec<TransferSample> {
        self.samples.take()
    }

    /// Records how long a request waited for its KV, from its registration to ready.
    pub(crate) fn record_wait(&self, seconds: f64) {
        self.waits.record(seconds);
    }

    pub(crate) fn take_waits(&self) -> Vec<f64> {
        self.waits.take()
    }

    /// A request ended failed, for `reason`.
    pub(crate) fn failed(&self, reason: Reason) {
        *lock(&self.failures).entry(reason.as_str()).or_default() += 1;
    }

    pub(crate) fn failures_by_cause(&self) -> Vec<(&'static str, u64)> {
        lock(&self.failures).iter().map(|(k, v)| (*k, *v)).collect()
    }

    pub(crate) fn set_rails(&self, rails: Vec<String>) {
        *lock(&self.rails) = rails;
    }

    pub(crate) fn rails(&self) -> Vec<String> {
        lock(&self.rails).clone()
    }

    pub(crate) fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            held: self.held.load(Ordering::Relaxed),
            transfers_started: self.transfers_started.load(Ordering::Relaxed),
            transfers_ok: self.transfers_ok.load(Ordering::Relaxed),
            transfers_failed: self.transfers_failed.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            bytes_streamed: self.bytes_streamed.load(Ordering::Relaxed),
            finishing_hints: self.finishing_hints.load(Ordering::Relaxed),
            nudges: self.nudges.load(Ordering::Relaxed),
            remembered_registrations: self.remembered_registrations.load(Ordering::Relaxed),
            board_ready: self.board_ready.load(Ordering::Relaxed),
            router_aborts: self.router_aborts.load(Ordering::Relaxed),
            driver_turns: self.driver_turns.load(Ordering::Relaxed),
            local_connections: self.local_connections.load(Ordering::Relaxed),
            released_unconfirmed: self.released_unconfirmed.load(Ordering::Relaxed),
            handshakes_evicted: self.handshakes_evicted.load(Ordering::Relaxed),
            handshakes_failed: self.handshakes_failed.load(Ordering::Relaxed),
            idle_closed: self.idle_closed.load(Ordering::Relaxed),
            unauthorized: self.unauthorized.load(Ordering::Relaxed),
            ops_posted: self.ops_posted.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_taken_once_and_bounded_newest_kept() {
        let stats = Stats::default();
        assert!(stats.take_samples().is_empty());
        for i in 0..MAX_TRANSFER_SAMPLES + 10 {
            stats.record(i as f64, i as u64);
        }
        let taken = stats.take_samples();
        assert_eq!(taken.len(), MAX_TRANSFER_SAMPLES);
        assert_eq!(taken[0].bytes, 10);
        assert_eq!(
            taken.last().unwrap().bytes,
            (MAX_TRANSFER_SAMPLES + 9) as u64
        );
        assert!(stats.take_samples().is_empty());
    }
}
