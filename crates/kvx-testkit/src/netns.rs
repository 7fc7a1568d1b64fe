//! Two hosts on one machine: two network namespaces joined by a veth pair, each with its own
//! address and loopback, and nothing else (no route out, no shared abstract Unix sockets). A
//! process started in one ([`TwoHosts::command`]) reaches the other only over the veth link, as
//! on two hosts; same-host shortcuts (abstract Unix sockets, which belong to a network namespace)
//! cannot connect across.
//!
//! Creating namespaces needs `CAP_NET_ADMIN` and `ip` (iproute2). Where they are missing,
//! [`TwoHosts::new`] says why; [`TwoHosts::for_test`] then skips the test with a line that says
//! so, unless `KVX_REQUIRE_NETNS=1` (which `cargo xtask test` sets where it runs as root), where
//! it fails.

use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// One of the two hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Host {
    /// The first host (10.231.0.1), e.g. prefill.
    A,
    /// The second host (10.231.0.2), e.g. decode.
    B,
}

/// Two network namespaces joined by a veth pair; removed on drop (also when a test panics), and
/// those a killed test left behind are removed by the next one.
#[derive(Debug)]
pub struct TwoHosts {
    names: [String; 2],
}

/// Namespace names start with this, then the creating process's id.
const PREFIX: &str = "kvxt-";

/// The environment variable that turns a skip into a failure.
pub const REQUIRE_ENV: &str = "KVX_REQUIRE_NETNS";

impl TwoHosts {
    /// Creates the pair, or says why it cannot.
    ///
    /// # Errors
    /// The failing `ip` command and its message (no permission, no iproute2).
    pub fn new() -> Result<Self, String> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        sweep_stale();
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let names = [
            format!("{PREFIX}{pid}-{n}-a"),
            format!("{PREFIX}{pid}-{n}-b"),
        ];
        // Interface names are at most 15 bytes.
        let link = |side: char| format!("kx{}{n}{side}", pid % 1_000_000);
        let (link_a, link_b) = (link('a'), link('b'));
        ip(&["netns", "add", &names[0]])?;
        let hosts = Self { names };
        ip(&["netns", "add", &hosts.names[1]])?;
        ip(&[
            "link",
            "add",
            &link_a,
            "netns",
            &hosts.names[0],
            "type",
            "veth",
            "peer",
            "name",
            &link_b,
            "netns",
            &hosts.names[1],
        ])?;
        for (host, link) in [(Host::A, &link_a), (Host::B, &link_b)] {
            let ns = hosts.name(host);
            let cidr = format!("{}/24", hosts.addr(host));
            ip(&["-n", ns, "addr", "add", &cidr, "dev", link])?;
            ip(&["-n", ns, "link", "set", link, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        // A veth link carries traffic (and is listed as running) once both ends are up, a
        // moment after: wait for it, as a host's boot does.
        for (host, link) in [(Host::A, &link_a), (Host::B, &link_b)] {
            hosts.wait_running(host, link)?;
        }
        Ok(hosts)
    }

    /// [`TwoHosts::new`] for a test: `None` (after printing why the test is skipped) where
    /// namespaces cannot be made, unless [`REQUIRE_ENV`] is `1`.
    ///
    /// # Panics
    /// Where namespaces cannot be made and [`REQUIRE_ENV`] is `1`.
    #[must_use]
    pub fn for_test(test: &str) -> Option<Self> {
        match Self::new() {
            Ok(hosts) => Some(hosts),
            Err(why) => {
                assert!(
                    std::env::var(REQUIRE_ENV).as_deref() != Ok("1"),
                    "{test}: two network namespaces are required ({REQUIRE_ENV}=1) but: {why}"
                );
                println!("SKIPPED {test}: cannot create network namespaces ({why})");
                None
            }
        }
    }

    /// The namespace of `host`.
    #[must_use]
    pub fn name(&self, host: Host) -> &str {
        match host {
            Host::A => &self.names[0],
            Host::B => &self.names[1],
        }
    }

    /// The address of `host` on the link.
    #[must_use]
    pub fn addr(&self, host: Host) -> IpAddr {
        IpAddr::V4(match host {
            Host::A => Ipv4Addr::new(10, 231, 0, 1),
            Host::B => Ipv4Addr::new(10, 231, 0, 2),
        })
    }

    /// Waits up to 10 s until `link` on `host` is operationally up.
    fn wait_running(&self, host: Host, link: &str) -> Result<(), String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let out = Command::new("ip")
                .args(["-n", self.name(host), "-o", "link", "show", "dev", link])
                .output()
                .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
            let text = String::from_utf8_lossy(&out.stdout);
            if text.contains("state UP") {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(format!("link {link} did not come up: {text}"));
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// A command that runs `program` on `host`.
    #[must_use]
    pub fn command(&self, host: Host, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", self.name(host)])
            .arg(program);
        command
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// Runs `ip ARGS`.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Removes the namespaces of test processes that are gone.
fn sweep_stale() {
    let Ok(entries) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", &name]);
        }
    }
}
