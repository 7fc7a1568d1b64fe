//! Stale `shm` regions.
//!
//! libfabric's `shm` provider (1.17) keeps each endpoint's region in a file
//! `/dev/shm/<pid>:<domain>:<endpoint>`, removed when the endpoint closes or when the process
//! exits on a signal it can catch. A process killed with `SIGKILL` (an engine the orchestrator
//! killed, a crashed test child) leaves its regions behind: tmpfs memory that is never freed,
//! and — once the pid is reused — a process that cannot open its own endpoint (`fi_enable`
//! fails with `EBUSY`, because its region's name is taken).
//!
//! When asked to ([`LibfabricConfig::sweep_stale_shm`](super::LibfabricConfig), which the `kvx`
//! binary and the vLLM plugin set from `KVX_SHM_SWEEP=1`), kvx removes, before an `shm` endpoint opens, this user's regions whose
//! process no longer exists, and, the first time in a process, the regions named after this
//! process's own pid, which only a dead predecessor with the same pid can have left.
//!
//! It is off by default because "no longer exists" is judged in this process's pid namespace:
//! where containers share `/dev/shm` but not their pid namespaces, a live region of another
//! container looks stale, and removing it (or one that merely has this process's pid) would break
//! that container's transfers. Without the sweep, a reused pid makes opening the endpoint fail
//! with a clear error instead.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Mutex;

/// Where the provider keeps its regions.
pub(super) const SHM_DIR: &str = "/dev/shm";

/// Serialises sweeping with opening `shm` endpoints in this process, so a sweep never removes a
/// region this process is creating; holds whether the own-pid sweep is still to be done.
pub(super) static OPENING: Mutex<bool> = Mutex::new(true);

/// The pid a provider region's file name starts with: `<pid>:<digits>:<digits>`.
fn region_pid(name: &str) -> Option<i32> {
    let mut parts = name.split(':');
    let pid = parts.next()?.parse().ok()?;
    let digits =
        |p: Option<&str>| p.is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    (digits(parts.next()) && digits(parts.next()) && parts.next().is_none()).then_some(pid)
}

/// The pid of the process that owns an `shm` endpoint address (the provider names endpoints
/// `fi_shm://<pid>:<domain>:<endpoint>`), if the address has that form.
pub(super) fn address_pid(address: &[u8]) -> Option<i32> {
    let text = std::str::from_utf8(address).ok()?.trim_end_matches('\0');
    region_pid(text.strip_prefix("fi_shm://")?)
}

/// Whether process `pid` has exited: it no longer exists (in this pid namespace), or it is a
/// zombie that its parent has not reaped yet.
pub(super) fn exited(pid: i32) -> bool {
    crate::local_peer::pid_exited(pid)
}

/// Whether a process `pid` exists (in this pid namespace).
fn alive(pid: i32) -> bool {
    if pid <= 0 {
        return true; // never a region's owner: leave it alone
    }
    // SAFETY: signal 0 checks existence and permission only; nothing is delivered.
    let ret = unsafe { libc::kill(pid, 0) };
    ret == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Removes the stale regions in `dir` (see the module doc); `own_pid_too` also removes those
/// named after this process. Returns how many were removed. Files of other users, and names that
/// are not provider regions, are never touched; a file that cannot be removed is left.
pub(super) fn sweep(dir: &Path, own_pid_too: bool) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    // SAFETY: no arguments, cannot fail.
    let uid = unsafe { libc::geteuid() };
    let me = i32::try_from(std::process::id()).unwrap_or(-1);
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(region_pid) else {
            continue;
        };
        let stale = if pid == me { own_pid_too } else { !alive(pid) };
        let owned = entry
            .metadata()
            .is_ok_and(|m| m.uid() == uid && m.is_file());
        if stale && owned && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watch sees a process end at once, before and after it is reaped; none is made for a
    /// pid that names no process.
    #[test]
    fn a_process_watch_sees_its_process_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let Some(watch) = ProcessWatch::open(pid) else {
            eprintln!("SKIPPED: this kernel has no pidfd_open");
            child.kill().unwrap();
            child.wait().unwrap();
            return;
        };
        assert!(!watch.exited());
        child.kill().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !watch.exited() {
            assert!(
                std::time::Instant::now() < deadline,
                "the kill was never seen"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        child.wait().unwrap();
        assert!(watch.exited());
        assert!(ProcessWatch::open(0).is_none());
        assert!(ProcessWatch::open(i32::MAX).is_none());
    }

    #[test]
    fn an_endpoint_address_names_its_process() {
        assert_eq!(address_pid(b"fi_shm://1234:0:1\0\0"), Some(1234));
        assert_eq!(address_pid(b"fi_shm://x:0:1"), None);
        assert_eq!(address_pid(b"1234:0:1"), None);
        assert_eq!(address_pid(&[0xff, 0xfe]), None);
    }

    #[test]
    fn a_process_that_exited_is_seen_so_even_unreaped() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert!(!exited(me));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        // Not reaped yet: a zombie once it has exited.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !exited(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "the child never exited"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(exited(pid));
    }

    #[test]
    fn only_provider_region_names_count() {
        assert_eq!(region_pid("1234:0:0"), Some(1234));
        assert_eq!(region_pid("1234:0:12"), Some(1234));
        for name in [
            "1234:0",
            "1234:0:0:0",
            "x:0:0",
            "1234:a:0",
            "1234::0",
            "sem.x",
            "kvx",
        ] {
            assert_eq!(region_pid(name), None, "{name}");
        }
    }

    #[test]
    fn regions_of_dead_processes_and_of_a_dead_namesake_go_the_rest_stays() {
        let dir = std::env::temp_dir().join(format!("kvx-shm-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A process that has exited: its pid is free (until reused, which the test tolerates by
        // checking again below).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let me = std::process::id();
        let names = [
            format!("{dead}:0:0"),
            format!("{dead}:1:3"),
            format!("{me}:0:0"),
            "1:0:0".to_owned(), // init: alive
            format!("{dead}-not-a-region"),
        ];
        for name in &names {
            std::fs::write(dir.join(name), b"x").unwrap();
        }
        let dead_still_dead = !alive(dead as i32);
        let removed = sweep(&dir, false);
        let left = |name: &str| dir.join(name).exists();
        if dead_still_dead {
            assert_eq!(removed, 2);
            assert!(!left(&names[0]) && !left(&names[1]));
        }
        assert!(
            left(&names[2]),
            "this process's own region stays unless asked"
        );
        assert!(left(&names[3]) && left(&names[4]));
        assert_eq!(sweep(&dir, true), 1);
        assert!(!left(&names[2]));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Whether a peer process has terminated, in one system call that never blocks (a pidfd, which
/// becomes readable when its process exits, before or after it is reaped). `shm` 1.17 takes a
/// spin lock in the receiver's region for every post to it; a receiver killed while holding it
/// (its own queue reads take it) leaves it held for ever, and a post to it would spin for ever:
/// posts to a terminated process must not be made at all.
#[derive(Debug)]
pub(super) struct ProcessWatch(OwnedFd);

impl ProcessWatch {
    /// A watch on `pid`; `None` where the kernel has no `pidfd_open` (before 5.3) or the
    /// process is gone already.
    pub(super) fn open(pid: i32) -> Option<Self> {
        if pid <= 0 {
            return None;
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor, or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let fd = i32::try_from(fd).ok().filter(|&fd| fd >= 0)?;
        // SAFETY: the descriptor was just created for this watch and nothing else owns it.
        Some(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Whether the process has terminated.
    pub(super) fn exited(&self) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd that lives across the call; a zero timeout never blocks.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        n > 0 && pfd.revents & libc::POLLIN != 0
    }
}
