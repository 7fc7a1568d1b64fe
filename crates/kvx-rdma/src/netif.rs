//! This host's network interfaces and their addresses, from `getifaddrs(3)` (the one place of
//! the topology's host queries that needs the C library).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// This host's interfaces that are up and running, with each IP address (an interface with two
/// addresses is listed twice), in the system's order.
///
/// # Errors
/// When `getifaddrs(3)` fails.
pub fn interfaces() -> std::io::Result<Vec<(String, IpAddr)>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head it allocated (or fails and writes nothing).
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut entry = list;
    while !entry.is_null() {
        // SAFETY: `entry` is an element of the list getifaddrs returned, freed only below; its
        // name is a NUL-terminated string and `ifa_addr` is null or a socket address whose
        // family says its size.
        unsafe {
            let e = &*entry;
            let running = libc::IFF_UP as u32 | libc::IFF_RUNNING as u32;
            let ip = socket_ip(e.ifa_addr).filter(|_| e.ifa_flags & running == running);
            if let Some(ip) = ip {
                let name = std::ffi::CStr::from_ptr(e.ifa_name)
                    .to_string_lossy()
                    .into_owned();
                out.push((name, ip));
            }
            entry = e.ifa_next;
        }
    }
    // SAFETY: `list` came from getifaddrs and is freed once; nothing points into it any more.
    unsafe { libc::freeifaddrs(list) };
    Ok(out)
}

/// The IP address of the socket address `addr`, if it is an IPv4 or IPv6 one.
///
/// # Safety
/// `addr` is null or points at a socket address at least as large as its family's.
unsafe fn socket_ip(addr: *const libc::sockaddr) -> Option<IpAddr> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: the caller's promise: the family is readable, and the struct of that family.
    unsafe {
        match i32::from((*addr).sa_family) {
            libc::AF_INET => {
                let sin = std::ptr::read_unaligned(addr.cast::<libc::sockaddr_in>());
                Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    sin.sin_addr.s_addr,
                ))))
            }
            libc::AF_INET6 => {
                let sin6 = std::ptr::read_unaligned(addr.cast::<libc::sockaddr_in6>());
                Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
            }
            _ => None,
        }
    }
}
