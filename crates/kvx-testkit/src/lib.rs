//! Helpers the kvx tests share, so that each is written once: free loopback ports for the
//! servers a test starts, a test's body run in a child process ([`in_child`]), two "hosts" on
//! one machine ([`netns::TwoHosts`]), fake sysfs trees ([`sysfs`]) and an OTLP/HTTP receiver
//! for request traces ([`otlp`]).
//!
//! ```
//! let base = kvx_testkit::free_ports(2);
//! assert!(std::net::TcpListener::bind(base).is_ok());
//! ```

use std::net::{SocketAddr, TcpListener};

pub mod netns;
pub mod otlp;
pub mod sysfs;

/// `count` consecutive free loopback ports, below the ephemeral range (where connections'
/// source ports come from, so a probed port there could be taken before the server binds it).
/// Calls (also from tests running in parallel) get distinct candidates.
///
/// # Panics
/// When no `count` consecutive ports are free after many tries.
#[must_use]
pub fn free_ports(count: u16) -> SocketAddr {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .next()
                .and_then(|w| w.parse::<u16>().ok())
        })
        .unwrap_or(32768);
    // Distinct candidates for every call, also between tests running in parallel.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut state = (u64::from(std::process::id()) << 32 | u64::from(nanos))
        ^ call.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        | 1;
    for _ in 0..1000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let span = 12_000u16.min(low - 1024);
        let base = low - span + (state % u64::from(span - count)) as u16;
        let held: Vec<_> = (0..count)
            .map_while(|i| TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], base + i))).ok())
            .collect();
        if held.len() == count as usize {
            return SocketAddr::from(([127, 0, 0, 1], base));
        }
    }
    panic!("no {count} consecutive free ports below the ephemeral range");
}

/// Runs the test `test` (its path within the test binary, e.g. `module::tests::name`) again in
/// a child process, for a body that changes process-wide state (a signal's action, say).
/// Returns `true` in that child, whose caller then runs the body; in the parent, waits for the
/// child and returns `false` once it passed.
///
/// # Panics
/// In the parent, when the child did not pass (with its output).
#[must_use]
pub fn in_child(test: &str) -> bool {
    const CHILD: &str = "KVX_TESTKIT_CHILD";
    if std::env::var(CHILD).is_ok_and(|t| t == test) {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let child = std::process::Command::new(exe)
        .args(["--exact", test, "--test-threads=1"])
        .env(CHILD, test)
        .output()
        .expect("the test binary runs");
    let stdout = String::from_utf8_lossy(&child.stdout);
    assert!(
        child.status.success() && stdout.contains("1 passed"),
        "{test} in a child process: {}\n{stdout}{}",
        child.status,
        String::from_utf8_lossy(&child.stderr)
    );
    false
}
