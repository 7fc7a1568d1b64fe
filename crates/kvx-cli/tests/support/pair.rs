//! What the `kvx pd` pair tests share: starting the two processes, waiting for them, and
//! checking decode's report.
#![allow(dead_code)] // each test binary uses its part

use kvx_testkit::free_ports;
use kvx_testkit::netns::{Host, TwoHosts};
use std::net::SocketAddr;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The `kvx` binary cargo built beside this test; `KVX_BIN` names another (a copy of both
/// carried to a GPU machine, where the build's path does not exist).
pub(crate) fn kvx_bin() -> String {
    std::env::var("KVX_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvx").to_owned())
}

/// A child process, killed when dropped, whose standard error (if piped) is read as it comes,
/// so that a chatty child never blocks on a full pipe.
pub(crate) struct Killer(
    pub(crate) Child,
    pub(crate) Option<std::thread::JoinHandle<String>>,
);

impl Killer {
    pub(crate) fn new(mut child: Child) -> Self {
        let drain = child.stderr.take().map(|mut stderr| {
            std::thread::spawn(move || {
                use std::io::Read as _;
                let mut log = String::new();
                let _ = stderr.read_to_string(&mut log);
                log
            })
        });
        Self(child, drain)
    }

    /// What the process wrote on its standard error (all of it once it has exited).
    pub(crate) fn log(&mut self) -> String {
        self.1
            .take()
            .map(|drain| drain.join().unwrap_or_default())
            .unwrap_or_default()
    }
}

impl Drop for Killer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for `child` to exit; past `limit` it is stopped and the test fails with what it
/// wrote on its standard error (its log says where it was).
pub(crate) fn wait_with_deadline(child: &mut Killer, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            return status;
        }
        if Instant::now() >= deadline {
            let _ = child.0.kill();
            let _ = child.0.wait();
            panic!(
                "process did not exit within {limit:?}; its log:\n{}",
                child.log()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(crate) struct Run<'a> {
    pub(crate) transport: &'a str,
    pub(crate) mode: &'a str,
    pub(crate) prefill: &'a [&'a str],
    pub(crate) decode: &'a [&'a str],
    pub(crate) requests: u32,
    pub(crate) tokens: &'a str,
    /// Prefill on host A and decode on host B; `None`: both on this host.
    pub(crate) hosts: Option<&'a TwoHosts>,
}

impl Run<'_> {
    /// The `kvx` binary on `host`.
    fn kvx(&self, host: Host) -> Command {
        let mut command = match self.hosts {
            Some(hosts) => hosts.command(host, kvx_bin()),
            None => Command::new(kvx_bin()),
        };
        // The interface a `tcp` endpoint chose is logged (at info).
        command.env("RUST_LOG", "warn,kvx_vllm::transport=info");
        command
    }
}

/// Runs the pair; returns decode's report and output, and prefill's standard error.
pub(crate) fn run_pair(run: &Run<'_>) -> (serde_json::Value, Output, String) {
    let (kvx, bench) = match run.hosts {
        // Ports are free in a fresh namespace.
        Some(hosts) => (
            SocketAddr::new(hosts.addr(Host::A), 7100),
            SocketAddr::new(hosts.addr(Host::A), 7200),
        ),
        None => (free_ports(4), free_ports(1)),
    };
    let out =
        std::env::temp_dir().join(format!("kvx-pd-{}-{}.json", std::process::id(), kvx.port()));
    let prefill = run
        .kvx(Host::A)
        .args([
            "pd",
            "prefill",
            "--model",
            "tiny",
            "--blocks",
            "256",
            "--transport",
            run.transport,
        ])
        .args([
            "--listen",
            &kvx.to_string(),
            "--bench-listen",
            &bench.to_string(),
        ])
        .args(if run.prefill.contains(&"--per-token-us") {
            &[][..]
        } else {
            &["--per-token-us", "5"][..]
        })
        .args(run.prefill)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut prefill = Killer::new(prefill);
    let decode = run
        .kvx(Host::B)
        .args([
            "pd",
            "decode",
            "--model",
            "tiny",
            "--blocks",
            "256",
            "--transport",
            run.transport,
        ])
        .args([
            "--prefill",
            &kvx.to_string(),
            "--prefill-bench",
            &bench.to_string(),
        ])
        .args([
            "--mode",
            run.mode,
            "--rate",
            "40",
            "--output-tokens",
            "4",
            "--step-ms",
            "1",
        ])
        .args([
            "--requests",
            &run.requests.to_string(),
            "--input-tokens",
            run.tokens,
        ])
        .arg("--out")
        .arg(&out)
        .args(run.decode)
        .output()
        .unwrap();
    assert!(
        decode.status.success(),
        "decode failed: {}\n{}",
        String::from_utf8_lossy(&decode.stdout),
        String::from_utf8_lossy(&decode.stderr)
    );
    let status = wait_with_deadline(&mut prefill, Duration::from_secs(30));
    let prefill_err = prefill.log();
    assert!(
        status.success(),
        "prefill exited with {status}: {prefill_err}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    (report, decode, prefill_err)
}

/// Prefill wrote some bytes early, in whole pieces of `piece` bytes (a unit of tokens in one
/// layer, or in all), and at most `max` bytes. (How many depends on how soon each registration
/// arrives, a race with the computation.)
pub(crate) fn assert_streamed(prefill_err: &str, piece: u64, max: u64) {
    let bytes = streamed_bytes(prefill_err);
    assert!(
        bytes > 0 && bytes <= max && bytes.is_multiple_of(piece),
        "{bytes} bytes streamed (pieces of {piece}, at most {max}): {prefill_err}"
    );
}

/// Bytes prefill wrote while their request was still computing (its summary line).
pub(crate) fn streamed_bytes(prefill_err: &str) -> u64 {
    summary_numbers(prefill_err, "while their request was computing").1[1]
}

/// The line of prefill's output that contains `marker`, and the numbers in it, in order.
pub(crate) fn summary_numbers<'a>(output: &'a str, marker: &str) -> (&'a str, Vec<u64>) {
    let line = output
        .lines()
        .find(|l| l.contains(marker))
        .unwrap_or_else(|| panic!("no summary in {output}"));
    let numbers = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    (line, numbers)
}

pub(crate) fn check(report: &serde_json::Value, requests: u64, tokens_total: u64) {
    check_delivery(report, requests, tokens_total);
    // Both processes are on this host: their control connections are Unix sockets.
    let s = &report["summary"];
    assert!(s["local_connections"].as_u64().unwrap_or(0) > 0, "{s}");
}

/// Every request delivered and verified, and the engine loop's transfer work measured.
pub(crate) fn check_delivery(report: &serde_json::Value, requests: u64, tokens_total: u64) {
    let s = &report["summary"];
    assert_eq!(s["completed"], requests, "{s}");
    assert_eq!(s["failed"], 0, "{s}");
    assert_eq!(s["verification_failures"], 0, "{s}");
    // Nothing failed, so nothing was given back without its writers' confirmation.
    assert_eq!(s["released_unconfirmed"], 0, "{s}");
    let per_token = report["kv_bytes_per_token"].as_u64().unwrap();
    assert_eq!(
        s["verified_bytes"].as_u64().unwrap(),
        tokens_total * per_token,
        "{s}"
    );
    // The engine loop's transfer work is measured per decode step, on the wall clock and on
    // the loop thread's CPU clock (less the clocks' own cost, which is measured too).
    let steps = s["loop_transfer_us_per_step"]["n"].as_u64().unwrap_or(0);
    assert!(steps > 0, "{s}");
    assert_eq!(
        s["loop_transfer_cpu_us_per_step"]["n"].as_u64(),
        Some(steps),
        "{s}"
    );
    let cpu = s["loop_transfer_cpu_us_per_step"]["mean"].as_f64().unwrap();
    assert!(cpu.is_finite() && cpu >= 0.0, "{s}");
    assert!(s["loop_measuring_ns"]["cpu"].as_u64().is_some(), "{s}");
    assert_eq!(
        s["loop_clock_warm_up_cpu_us"]["n"].as_u64(),
        Some(steps),
        "{s}"
    );
}
