//! A chaos run with real processes: a `kvx pd` load over `cma`, push or pull by round, in which prefill and decode
//! are killed with SIGKILL and started again at points a seeded generator picks (a bounded
//! number of kills). Prefill serves one router after another (`--keep-serving`); decode
//! connects to a restarted prefill again. Every request of a decode that runs to its end is
//! done (its bytes verified) or failed with a cause, and the connector holds nothing at its end;
//! after every kill, prefill gives back everything the dead decode left it holding; a last clean
//! run delivers every request; and once the leases passed, no prefill rank holds anything.
//! `KVX_CHAOS_SEED` replays a schedule (the seed is printed).

#[path = "support/pair.rs"]
mod pair;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvx_testkit::free_ports;
use pair::{kvx_bin, wait_with_deadline, Killer};

/// Prefill's producer lease and decode's registration lease, in seconds.
const LEASE_S: u64 = 2;

/// A xorshift generator: the schedule from its seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

struct Ports {
    kvx: SocketAddr,
    bench: SocketAddr,
    metrics: SocketAddr,
}

fn start_prefill(ports: &Ports) -> Killer {
    let child = Command::new(kvx_bin())
        .args(["pd", "prefill", "--model", "tiny", "--blocks", "4096"])
        .args(["--transport", "cma", "--keep-serving"])
        .args(["--lease-s", &LEASE_S.to_string(), "--per-token-us", "200"])
        .args(["--listen", &ports.kvx.to_string()])
        .args(["--bench-listen", &ports.bench.to_string()])
        .args(["--metrics-listen", &ports.metrics.to_string()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    Killer::new(child)
}

fn start_decode(ports: &Ports, mode: &str, requests: u32, out: &std::path::Path) -> Killer {
    let child = Command::new(kvx_bin())
        .args(["pd", "decode", "--model", "tiny", "--blocks", "4096"])
        .args(["--transport", "cma", "--mode", mode])
        .args(["--lease-s", &LEASE_S.to_string()])
        .args(["--rate", "30", "--output-tokens", "4", "--step-ms", "1"])
        .args([
            "--requests",
            &requests.to_string(),
            "--input-tokens",
            "64,400",
        ])
        .args(["--prefill", &ports.kvx.to_string()])
        .args(["--prefill-bench", &ports.bench.to_string()])
        .arg("--out")
        .arg(out)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    Killer::new(child)
}

/// The sum over prefill's ranks of the series `name`, from its metrics endpoint.
fn prefill_series(metrics: SocketAddr, name: &str) -> Option<i64> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(metrics).ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let sum = answer
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<i64>().ok())
        .sum();
    Some(sum)
}

/// The sum of prefill's `kvx_held` gauges (every rank).
fn prefill_held(metrics: SocketAddr) -> Option<i64> {
    prefill_series(metrics, "kvx_held")
}

/// Prefill's transfers started (push) and delivered (push and pull), summed over its ranks.
fn progress(metrics: SocketAddr) -> i64 {
    prefill_series(metrics, "kvx_transfers_started_total").unwrap_or(0)
        + prefill_series(metrics, "kvx_transfers_ok_total").unwrap_or(0)
}

/// Waits (up to a minute) until prefill's [`progress`] is `n` past `before`: the load is under
/// way.
fn wait_started(metrics: SocketAddr, before: i64, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while progress(metrics) < before + n {
        assert!(Instant::now() < deadline, "the load never started");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits (up to `limit`) until prefill holds nothing; the last reading.
fn wait_prefill_empty(metrics: SocketAddr, limit: Duration) -> Option<i64> {
    let deadline = Instant::now() + limit;
    loop {
        let held = prefill_held(metrics);
        if held == Some(0) || Instant::now() > deadline {
            return held;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Decode's report of a run that ended, checked: every request done and verified or failed
/// with a cause, nothing held; returns (done, failed).
fn check_report(out: &std::path::Path, requests: u64, log: &str) -> (u64, u64) {
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
    let s = &report["summary"];
    let (done, failed) = (
        s["completed"].as_u64().unwrap(),
        s["failed"].as_u64().unwrap(),
    );
    assert_eq!(
        done + failed,
        requests,
        "every request ends once: {s}\n{log}"
    );
    assert_eq!(
        s["verification_failures"], 0,
        "a delivered byte was wrong: {s}"
    );
    assert_eq!(s["held_at_end"], 0, "decode's connector still holds: {s}");
    for row in report["per_request"].as_array().into_iter().flatten() {
        if let Some(why) = row["failed"].as_str() {
            assert!(!why.trim().is_empty(), "a failure without a cause: {row}");
        }
    }
    (done, failed)
}

#[test]
fn killed_and_restarted_processes_end_every_request_once_and_leave_nothing_held() {
    let seed = std::env::var("KVX_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("chaos seed {seed} (KVX_CHAOS_SEED={seed} replays it)");
    let mut rng = Rng(seed);
    let ports = Ports {
        kvx: free_ports(1),
        bench: free_ports(1),
        metrics: free_ports(1),
    };
    let out = std::env::temp_dir().join(format!("kvx-chaos-{}.json", std::process::id()));
    let mut prefill = start_prefill(&ports);
    let requests = 40;
    for round in 0..3 {
        let mode = if rng.below(2) == 0 { "push" } else { "pull" };
        let _ = std::fs::remove_file(&out);
        let started = progress(ports.metrics);
        let mut decode = start_decode(&ports, mode, requests, &out);
        // Let the load run a while (some transfers started, and a random time more), then
        // kill one side.
        wait_started(ports.metrics, started, 1 + rng.below(8) as i64);
        std::thread::sleep(Duration::from_millis(rng.below(300)));
        if rng.below(2) == 0 {
            eprintln!("round {round} ({mode}): killing decode");
            let _ = decode.0.kill();
            let _ = decode.0.wait();
            // Everything the dead decode left held goes back within the leases (writes in
            // flight to it end with its death: cma reports them failed at once).
            let held = wait_prefill_empty(ports.metrics, Duration::from_secs(LEASE_S * 5 + 10));
            assert_eq!(
                held,
                Some(0),
                "round {round}: prefill still holds after decode died"
            );
        } else {
            eprintln!("round {round} ({mode}): killing prefill");
            let _ = prefill.0.kill();
            let _ = prefill.0.wait();
            std::thread::sleep(Duration::from_millis(rng.below(500)));
            prefill = start_prefill(&ports);
            // Decode carries on with the new prefill and ends every request once (it exits
            // with an error where some failed, after writing its report).
            let _ = std::fs::remove_file(&out);
            wait_with_deadline(&mut decode, Duration::from_secs(120));
            let log = decode.log();
            assert!(out.exists(), "round {round}: decode wrote no report: {log}");
            let (done, failed) = check_report(&out, u64::from(requests), &log);
            eprintln!("round {round}: {done} done, {failed} failed");
        }
    }
    // The survivors serve correctly afterwards: a clean run delivers every request.
    let _ = std::fs::remove_file(&out);
    let mut decode = start_decode(&ports, "push", 12, &out);
    let status = wait_with_deadline(&mut decode, Duration::from_secs(120));
    let log = decode.log();
    assert!(
        status.success(),
        "the last decode exited with {status}: {log}"
    );
    assert_eq!(check_report(&out, 12, &log), (12, 0), "{log}");
    let held = wait_prefill_empty(ports.metrics, Duration::from_secs(LEASE_S * 5 + 10));
    assert_eq!(held, Some(0), "prefill still holds at the end");
    let _ = std::fs::remove_file(&out);
}
