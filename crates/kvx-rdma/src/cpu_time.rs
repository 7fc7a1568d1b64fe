//! The calling thread's own CPU time: for polling loops that must tell "this read did work"
//! from "this thread was preempted while reading", and for measuring an engine loop's own work
//! apart from the time it spent descheduled.

use std::time::Duration;

/// CPU time the calling thread has used so far (`CLOCK_THREAD_CPUTIME_ID`); zero where the
/// clock cannot be read.
#[must_use]
pub fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a live, writable timespec; the clock id is a constant the kernel knows.
    let ret = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if ret != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn counts_work_but_not_sleep() {
        let before = thread_cpu_time();
        std::thread::sleep(Duration::from_millis(50));
        let slept = thread_cpu_time() - before;
        assert!(slept < Duration::from_millis(25), "sleeping used {slept:?}");
        let started = Instant::now();
        let mut x = 0u64;
        while started.elapsed() < Duration::from_millis(30) {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let worked = thread_cpu_time() - before;
        assert!(
            worked > slept,
            "{worked:?} after work, {slept:?} after sleep"
        );
    }
}
