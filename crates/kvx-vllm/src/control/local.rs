//! The same-host control socket: a Unix socket in the abstract namespace beside a producer's
//! TCP listener, which a consumer on the same host tries first. Abstract names belong to no
//! user, so both ends check who is at the other (`SO_PEERCRED`): a producer serves only local
//! peers of its own user, and a consumer talks only to a socket of its own user; another user's
//! socket under the name (a squatter) is refused loudly and TCP used instead.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::unix::net::{UnixListener, UnixStream};

/// The name of the Unix socket beside a control listener bound at `bound` (its real address:
/// a wildcard one stays a wildcard).
pub(crate) fn local_name(bound: SocketAddr) -> String {
    format!("kvx-control/{bound}")
}

/// A Unix listener beside the TCP listener bound at `bound`, in the abstract namespace (nothing
/// in the file system to clean up: the name goes when the socket closes).
///
/// # Errors
/// The name is taken, or this system has no abstract Unix sockets.
pub(crate) fn listen_local(bound: SocketAddr) -> io::Result<UnixListener> {
    UnixListener::bind_addr(&abstract_addr(&local_name(bound))?)
}

#[cfg(target_os = "linux")]
fn abstract_addr(name: &str) -> io::Result<std::os::unix::net::SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
}

#[cfg(not(target_os = "linux"))]
fn abstract_addr(_name: &str) -> io::Result<std::os::unix::net::SocketAddr> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "abstract Unix sockets are Linux's",
    ))
}

/// Whether the process at the other end of `stream` runs as this process's user.
pub(crate) fn same_user(stream: &UnixStream) -> bool {
    use kvx_rdma::local_peer::{own_uid, peer_uid};
    match peer_uid(stream) {
        Ok(uid) if uid == own_uid() => true,
        Ok(uid) => {
            tracing::warn!(
                peer_uid = uid,
                own_uid = own_uid(),
                "kvx: a local control socket's other end is another user's: refused (TCP is used)"
            );
            false
        }
        Err(e) => {
            tracing::warn!(error = %e, "kvx: cannot tell who is at a local control socket's other end: refused");
            false
        }
    }
}

/// Whether `ip` is one of this host's addresses (in this network namespace).
fn is_this_host(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || UdpSocket::bind((ip, 0)).is_ok()
}

/// The Unix socket of a producer on this host that a TCP connection to `addr` would reach: the
/// one beside a listener bound at `addr` itself, or at a wildcard address of its port (an IPv6
/// one takes IPv4 connections too). `None` where `addr` is another host's, or no such socket
/// exists.
pub(crate) fn connect_local(addr: SocketAddr) -> Option<UnixStream> {
    if !is_this_host(addr.ip()) {
        return None;
    }
    let port = addr.port();
    let v4 = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port);
    let v6 = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port);
    let candidates: &[SocketAddr] = if addr.is_ipv4() {
        &[addr, v4, v6]
    } else {
        &[addr, v6]
    };
    candidates.iter().find_map(|&bound| {
        let name = abstract_addr(&local_name(bound)).ok()?;
        UnixStream::connect_addr(&name).ok().filter(same_user)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another host's address is never looked up among this host's Unix sockets, even where
    /// one is named after it.
    #[test]
    fn another_hosts_address_goes_over_tcp() {
        assert!(is_this_host(IpAddr::from([127, 0, 0, 1])));
        assert!(is_this_host(IpAddr::from([0, 0, 0, 0])));
        // TEST-NET-1 (RFC 5737): never a local address.
        let far = SocketAddr::from(([192, 0, 2, 1], 7100));
        assert!(!is_this_host(far.ip()));
        let _decoy = listen_local(far).unwrap();
        assert!(connect_local(far).is_none());
    }
}
