//! Throughput of the rendezvous state machines with 100,000 requests in flight, and the cost of
//! `poll_timeout`, heartbeats and expiry.
//!
//! Run: `cargo bench -p kvx-rendezvous -- --warm-up-time 1 --measurement-time 3`
//!
//! The event-throughput benchmarks time the thread's on-CPU time where Linux reports it
//! (`/proc/thread-self/schedstat`, scheduler-tick resolution, so each sample runs for
//! milliseconds), so that other load on a shared machine does not inflate them: "events per
//! second on one core". Everything else is wall-clock time.

// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvx_core::{Attempt, EngineId, Incarnation, Rank, TransferId};
use kvx_rendezvous::{
    AttemptKey, Config, ConsumerId, Matcher, Timestamp, TransferOutcome, Waiter, WaiterConfig,
};

const IN_FLIGHT: u64 = 100_000;
const LEASE: Duration = Duration::from_secs(60);
const CONSUMER: ConsumerId = ConsumerId {
    engine: EngineId(2),
    incarnation: Incarnation(1),
};

/// A stopwatch over the thread's on-CPU time, or wall time where that is unavailable.
struct CpuClock {
    cpu: Option<u64>,
    wall: Instant,
}

impl CpuClock {
    fn thread_cpu_nanos() -> Option<u64> {
        std::fs::read_to_string("/proc/thread-self/schedstat")
            .ok()?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }

    fn start() -> Self {
        Self {
            cpu: Self::thread_cpu_nanos(),
            wall: Instant::now(),
        }
    }

    fn elapsed(&self) -> Duration {
        match (self.cpu, Self::thread_cpu_nanos()) {
            (Some(start), Some(end)) => Duration::from_nanos(end.saturating_sub(start)),
            _ => self.wall.elapsed(),
        }
    }
}

fn key(i: u64) -> AttemptKey {
    // Spread ids over the whole 128 bits like hashed request ids.
    let id = u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
    AttemptKey::new(TransferId(id), Attempt::FIRST)
}

fn config() -> Config {
    let mut c = Config::default();
    c.max_entries = 4 * IN_FLIGHT as usize;
    c
}

/// A matcher holding `held` registrations, one every `spacing` of virtual time from zero.
fn loaded(held: u64, spacing: Duration) -> Matcher<u64, u64> {
    let mut m = Matcher::new(config()).expect("valid config");
    let mut now = Timestamp::ZERO;
    for i in 0..held {
        m.register(now, key(i), CONSUMER, LEASE, i);
        now = now + spacing;
    }
    assert_eq!(m.held_consumers() as u64, held);
    m
}

fn steady_state(c: &mut Criterion) {
    let mut group = c.benchmark_group("matcher");
    // One cycle: the oldest held registration's prefill finishes (start), its transfer ends,
    // and a new request registers. Three events; 100,000 registrations stay held throughout.
    const CYCLES: u64 = 10_000;
    group.throughput(Throughput::Elements(3 * CYCLES));
    let mut m = loaded(IN_FLIGHT, Duration::from_nanos(100));
    let mut next = IN_FLIGHT;
    let mut now = Timestamp::from_nanos(IN_FLIGHT * 100);
    group.bench_function("events_100k_in_flight", |b| {
        b.iter_custom(|iters| {
            let clock = CpuClock::start();
            for _ in 0..iters * CYCLES {
                let old = key(next - IN_FLIGHT);
                m.prefill_done(now, old, next);
                m.transfer_finished(now, old, TransferOutcome::Succeeded);
                m.register(now, key(next), CONSUMER, LEASE, next);
                while let Some(action) = m.poll_action() {
                    black_box(action);
                }
                next += 1;
                now = now + Duration::from_nanos(100);
            }
            clock.elapsed()
        });
    });
    assert_eq!(m.held_consumers() as u64, IN_FLIGHT);
    assert_eq!(m.stats().started, m.stats().succeeded);

    group.throughput(Throughput::Elements(1));
    group.bench_function("poll_timeout_100k_held", |b| {
        b.iter(|| black_box(m.poll_timeout()));
    });
    group.bench_function("heartbeat_one_transfer_100k_held", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % IN_FLIGHT;
            m.heartbeat(now, CONSUMER, [key(next - 1 - i).transfer]);
        });
    });
    group.bench_function("handle_timeout_nothing_due_100k_held", |b| {
        b.iter(|| m.handle_timeout(black_box(now)));
    });
    group.finish();
}

fn expiry(c: &mut Criterion) {
    let mut group = c.benchmark_group("expiry");
    const EXPIRING: u64 = 1_000;
    group.throughput(Throughput::Elements(EXPIRING));
    // One wake-up expires the 1,000 earliest of `held` registrations; only `handle_timeout` is
    // timed. Between wake-ups 1,000 new registrations (untimed) keep `held` constant. The cost
    // per expired entry should not depend on how many stay held.
    for held in [10_000u64, 100_000, 1_000_000] {
        let mut c = config();
        c.max_entries = 2 * held as usize;
        let mut m: Matcher<u64, u64> = Matcher::new(c).expect("valid config");
        // Deadlines 1 µs apart: (0, held] µs.
        for i in 0..held {
            let lease = Duration::from_micros(i + 1);
            m.register(Timestamp::ZERO, key(i), CONSUMER, lease, i);
        }
        let mut round = 0u64;
        group.bench_function(format!("expire_1000_of_{held}_held"), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    // Held deadlines are (round * 1000, round * 1000 + held] µs.
                    let due = Timestamp::from_nanos((round + 1) * EXPIRING * 1_000);
                    // Wall time: the thread's CPU time is only as fine as the scheduler tick.
                    let start = Instant::now();
                    m.handle_timeout(due);
                    timed += start.elapsed();
                    assert_eq!(m.drain_actions().count() as u64, EXPIRING);
                    for j in 0..EXPIRING {
                        let i = held + round * EXPIRING + j;
                        let lease = Duration::from_micros(held - EXPIRING + j + 1);
                        m.register(due, key(i), CONSUMER, lease, i);
                    }
                    round += 1;
                }
                timed
            });
        });
        assert_eq!(m.held_consumers() as u64, held);
    }
    group.finish();
}

fn waiter(c: &mut Criterion) {
    let mut group = c.benchmark_group("waiter");
    const CYCLES: u64 = 10_000;
    // One cycle: a new wait for two producer ranks, and both completions of the oldest one.
    group.throughput(Throughput::Elements(3 * CYCLES));
    let mut config = WaiterConfig::default();
    config.max_waiting = 4 * IN_FLIGHT as usize;
    let mut w: Waiter<u64> = Waiter::new(config).expect("valid config");
    let ranks = [Rank(0), Rank(1)];
    for i in 0..IN_FLIGHT {
        w.expect(Timestamp::ZERO, key(i), ranks, LEASE, i);
    }
    let mut next = IN_FLIGHT;
    group.bench_function("events_100k_waiting", |b| {
        b.iter_custom(|iters| {
            let clock = CpuClock::start();
            for _ in 0..iters * CYCLES {
                let now = Timestamp::from_nanos(next);
                w.expect(now, key(next), ranks, LEASE, next);
                let old = key(next - IN_FLIGHT);
                w.completion(now, old, Rank(1));
                w.completion(now, old, Rank(0));
                while let Some(action) = w.poll_action() {
                    black_box(action);
                }
                next += 1;
            }
            clock.elapsed()
        });
    });
    assert_eq!(w.len() as u64, IN_FLIGHT);
    group.finish();
}

criterion_group!(benches, steady_state, expiry, waiter);
criterion_main!(benches);
