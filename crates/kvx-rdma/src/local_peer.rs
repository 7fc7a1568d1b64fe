//! Who is at the other end of a Unix socket (`SO_PEERCRED`): the same-host control planes (the
//! `cma` and `cuda-ipc` transports', the connector's local control socket) talk only to peers of
//! their own user.

use std::io;
use std::os::fd::AsRawFd as _;
use std::os::unix::net::UnixStream;

/// The effective user id of the process at the other end of `conn` (as it was when that process
/// connected or listened).
///
/// # Errors
/// When the kernel does not say.
pub fn peer_uid(conn: &UnixStream) -> io::Result<u32> {
    peer_credentials(conn).map(|(_, uid)| uid)
}

/// The pid and effective user id of the process at the other end of `conn` (as they were when
/// that process connected or listened).
///
/// # Errors
/// When the kernel does not say.
pub fn peer_credentials(conn: &UnixStream) -> io::Result<(i32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: u32::MAX,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes a `ucred` into the live local `cred`, whose size is passed; the
    // descriptor is `conn`'s own, open for the call.
    let ret = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &raw mut len,
        )
    };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.pid, cred.uid))
}

/// This process's effective user id.
#[must_use]
pub fn own_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether the process at the other end of `conn` runs as this process's effective user.
#[must_use]
pub fn same_user(conn: &UnixStream) -> bool {
    peer_uid(conn).is_ok_and(|uid| uid == own_uid())
}

/// A process of this host, known by its pid and its start time, so that a later process given
/// the same pid is not taken for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Process {
    pid: i32,
    /// Its start time (`/proc/PID/stat`'s field 22), where `/proc` said.
    started: Option<u64>,
}

impl Process {
    /// Process `pid` as it runs now; known by its pid alone where `/proc` does not say when it
    /// started.
    #[must_use]
    pub fn of(pid: i32) -> Self {
        Self {
            pid,
            started: stat(pid).and_then(|s| s.started),
        }
    }

    /// The process at the other end of `conn` (the one that connected, or listened).
    ///
    /// # Errors
    /// When the kernel does not say.
    pub fn peer_of(conn: &UnixStream) -> io::Result<Self> {
        peer_credentials(conn).map(|(pid, _)| Self::of(pid))
    }

    /// Its pid.
    #[must_use]
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Whether it has exited: no process of its pid exists (in this pid namespace), another
    /// one has its pid now, or it is a zombie that its parent has not reaped yet.
    #[must_use]
    pub fn exited(&self) -> bool {
        if pid_exited(self.pid) {
            return true;
        }
        match (self.started, stat(self.pid)) {
            (Some(then), Some(now)) => now.started.is_some_and(|s| s != then),
            _ => false,
        }
    }
}

/// Whether process `pid` has exited: it no longer exists (in this pid namespace), or it is a
/// zombie that its parent has not reaped yet. A pid of 0 or below names no process: `false`.
#[must_use]
pub fn pid_exited(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 checks existence and permission only; nothing is delivered.
    let ret = unsafe { libc::kill(pid, 0) };
    if ret != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return true;
    }
    // A zombie leader of a thread group whose other threads still run is a live process.
    stat(pid).is_some_and(|s| matches!(s.state, 'Z' | 'X'))
        && std::fs::read_dir(format!("/proc/{pid}/task")).map_or(true, |tasks| tasks.count() <= 1)
}

/// What this module reads of `/proc/PID/stat`.
struct Stat {
    state: char,
    started: Option<u64>,
}

fn stat(pid: i32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything: fields are counted
    // from the last `)`.
    let (_, rest) = text.rsplit_once(") ")?;
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 is the state; field 22 the start time.
    let started = fields.nth(18).and_then(|f| f.parse().ok());
    Some(Stat { state, started })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_running_until_it_exits_and_then_exited_zombie_or_reaped() {
        let me = Process::of(i32::try_from(std::process::id()).unwrap());
        assert!(me.started.is_some(), "no start time read for this process");
        assert!(!me.exited());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let process = Process::of(i32::try_from(child.id()).unwrap());
        assert!(!process.exited());
        child.kill().unwrap();
        // Killed and not reaped: a zombie, which has exited.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !process.exited() {
            assert!(
                std::time::Instant::now() < deadline,
                "a killed child still runs"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(process.exited());
    }

    #[test]
    fn another_process_under_the_same_pid_is_not_taken_for_the_first() {
        let me = Process::of(i32::try_from(std::process::id()).unwrap());
        let earlier = Process {
            started: me.started.map(|s| s.wrapping_sub(1)),
            ..me
        };
        assert!(earlier.exited());
    }

    #[test]
    fn the_peer_of_a_socket_is_the_process_that_made_it() {
        let (a, _b) = UnixStream::pair().unwrap();
        let peer = Process::peer_of(&a).unwrap();
        assert_eq!(peer.pid(), i32::try_from(std::process::id()).unwrap());
        assert!(!peer.exited());
    }
}

/// Who may attach to this process with `ptrace` (Yama's `PR_SET_PTRACER`), which a peer's
/// cross-memory attach (`process_vm_writev`, `process_vm_readv`) needs under Yama's
/// `ptrace_scope` 1: the one peer process known to copy, or any process of the user.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tracer {
    /// Only this process (and its descendants).
    Process(i32),
    /// Any process (`PR_SET_PTRACER_ANY`).
    Any,
}

/// The peers that may copy into or out of this process, each counted once per grant: `Some`
/// for a process known by its pid, `None` for one that is not (reached over TCP).
static TRACEES: std::sync::Mutex<Vec<Option<i32>>> = std::sync::Mutex::new(Vec::new());

/// A peer's leave to copy into or out of this process by cross-memory attach, held for as long
/// as the peer may: while exactly one known process holds leave, only it may attach
/// ([`Tracer::Process`]); with none, several, or any unknown one, any process of the user may
/// ([`Tracer::Any`], what a `cma` endpoint declares when it opens). Dropping it gives it back.
#[derive(Debug)]
#[must_use = "the leave ends when this is dropped"]
pub struct TracerLeave {
    peer: Option<i32>,
}

impl TracerLeave {
    /// Gives `peer` leave (`None`: a peer whose process is not known) and declares the tracer
    /// that follows.
    pub fn grant(peer: Option<i32>) -> Self {
        let mut tracees = TRACEES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        tracees.push(peer);
        declare(tracer_for(&tracees));
        Self { peer }
    }
}

impl Drop for TracerLeave {
    fn drop(&mut self) {
        let mut tracees = TRACEES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(at) = tracees.iter().position(|p| *p == self.peer) {
            tracees.swap_remove(at);
        }
        declare(tracer_for(&tracees));
    }
}

/// The tracer that the leaves held now call for.
#[must_use]
pub fn tracer_now() -> Tracer {
    tracer_for(
        &TRACEES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    )
}

/// Declares the tracer the leaves held now call for (a `cma` endpoint calls it when it opens).
pub fn declare_tracer() {
    declare(tracer_now());
}

/// The tracer for peers `tracees`: the one known process among them, else any.
fn tracer_for(tracees: &[Option<i32>]) -> Tracer {
    match tracees.first() {
        Some(Some(pid)) if tracees.iter().all(|p| *p == Some(*pid)) => Tracer::Process(*pid),
        _ => Tracer::Any,
    }
}

/// Tells the kernel. Without Yama the call fails (`EINVAL`) and nothing needs declaring.
fn declare(tracer: Tracer) {
    let arg = match tracer {
        Tracer::Process(pid) => libc::c_ulong::try_from(pid).unwrap_or(libc::PR_SET_PTRACER_ANY),
        Tracer::Any => libc::PR_SET_PTRACER_ANY,
    };
    // SAFETY: prctl with PR_SET_PTRACER takes a pid (or PR_SET_PTRACER_ANY) and no pointers.
    let _ = unsafe { libc::prctl(libc::PR_SET_PTRACER, arg, 0, 0, 0) };
}

#[cfg(test)]
mod tracer_tests {
    use super::*;

    #[test]
    fn one_known_peer_is_the_tracer_and_anything_else_is_any() {
        assert_eq!(tracer_for(&[]), Tracer::Any);
        assert_eq!(tracer_for(&[Some(7)]), Tracer::Process(7));
        assert_eq!(tracer_for(&[Some(7), Some(7)]), Tracer::Process(7));
        assert_eq!(tracer_for(&[Some(7), Some(8)]), Tracer::Any);
        assert_eq!(tracer_for(&[Some(7), None]), Tracer::Any);
        assert_eq!(tracer_for(&[None]), Tracer::Any);
    }

    #[test]
    fn leaves_widen_the_tracer_and_narrow_it_again_when_given_back() {
        // The only test of this process that holds leaves.
        assert_eq!(tracer_now(), Tracer::Any);
        let first = TracerLeave::grant(Some(4242));
        assert_eq!(tracer_now(), Tracer::Process(4242));
        let again = TracerLeave::grant(Some(4242));
        let other = TracerLeave::grant(Some(4343));
        assert_eq!(tracer_now(), Tracer::Any);
        drop(other);
        assert_eq!(tracer_now(), Tracer::Process(4242));
        let unknown = TracerLeave::grant(None);
        assert_eq!(tracer_now(), Tracer::Any);
        drop((unknown, again));
        assert_eq!(tracer_now(), Tracer::Process(4242));
        drop(first);
        assert_eq!(tracer_now(), Tracer::Any);
    }
}
