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
