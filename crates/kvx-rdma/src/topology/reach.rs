//! Which network interface a TCP endpoint opens on, so that its peers on other hosts can reach
//! it: the libfabric `tcp` provider's domain (one per interface) or UCX's `NET_DEVICES`.
//!
//! An endpoint advertises the address of the interface it opened on. The `tcp` provider's first
//! domain is whatever interface the system lists first (often `lo`), which a peer on another host
//! cannot reach: every write to such an endpoint times out. [`choose_interface`] picks the
//! interface by what the caller knows of where its peers are, in this order:
//!
//! 1. **This instance's own address** ([`Reach::local`], e.g. its control `listen` address):
//!    the interface that carries it (a loopback address: the loopback interface, for peers on
//!    this host). Peers reach the control plane there, so they reach the data plane there too.
//! 2. **A peer's address** ([`Reach::peer`]): the interface the route to it leaves by.
//! 3. **The default route's interface.**
//! 4. **The only interface** besides loopback.
//! 5. **Loopback**, where nothing else is up (peers on this host only).
//!
//! A route to a peer is looked up by connecting a UDP socket (which sends nothing); the default
//! route is read from `/proc/net/route`.
//!
//! Rules 3 and 4 rest on nothing the caller knew of its peers ([`ReachRule::is_a_guess`]): such
//! an instance (a decode that has not met its prefill yet) may be served by a peer of this host
//! that listens on loopback, and so opened on the loopback interface. A transport that pairs
//! interfaces by reachability itself (UCX) is better left to its own choice of all of them then.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, UdpSocket};

/// What is known of where the peers of an endpoint are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Reach {
    /// An address of this host at which its peers reach it (its control `listen` address);
    /// an unspecified address (`0.0.0.0`) says nothing.
    pub local: Option<IpAddr>,
    /// The address of a peer (for an instance that connects out, e.g. decode to prefill).
    pub peer: Option<IpAddr>,
}

impl Reach {
    /// Peers reach this host at `local`.
    #[must_use]
    pub fn local(local: IpAddr) -> Self {
        Self {
            local: Some(local),
            peer: None,
        }
    }

    /// A peer is at `peer`.
    #[must_use]
    pub fn peer(peer: IpAddr) -> Self {
        Self {
            local: None,
            peer: Some(peer),
        }
    }
}

/// Why [`choose_interface`] picked an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReachRule {
    /// It carries this instance's own address.
    LocalAddress(IpAddr),
    /// The route to this peer leaves by it.
    RouteToPeer(IpAddr),
    /// The default route leaves by it.
    DefaultRoute,
    /// It is the only interface besides loopback.
    OnlyInterface,
    /// Nothing else is up: peers on this host only.
    Loopback,
}

impl ReachRule {
    /// Whether the choice rests on nothing known of the peers (the default route's interface,
    /// or the only one besides loopback).
    #[must_use]
    pub fn is_a_guess(self) -> bool {
        matches!(self, Self::DefaultRoute | Self::OnlyInterface)
    }
}

impl std::fmt::Display for ReachRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::LocalAddress(ip) => write!(f, "carries this instance's address {ip}"),
            Self::RouteToPeer(ip) => write!(f, "the route to the peer {ip} leaves by it"),
            Self::DefaultRoute => f.write_str("the default route leaves by it"),
            Self::OnlyInterface => f.write_str("the only interface besides loopback"),
            Self::Loopback => f.write_str("nothing else is up: peers on this host only"),
        }
    }
}

/// The interface [`choose_interface`] picked.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct InterfaceChoice {
    /// The interface name (the libfabric `tcp` domain, UCX's network device).
    pub interface: String,
    /// The address the endpoint advertises there.
    pub address: IpAddr,
    /// Why.
    pub rule: ReachRule,
}

/// No interface can be chosen.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReachError {
    /// The host has no interface that is up and has an address.
    #[error("no network interface of this host is up with an IP address")]
    NoInterfaces,
    /// No interface carries the instance's own address.
    #[error(
        "no network interface of this host carries this instance's address {address} \
         (interfaces: {offered}); set the listen address to one of them, or name the interface"
    )]
    NoInterfaceWithAddress {
        /// The address asked for.
        address: IpAddr,
        /// The interfaces and their addresses, as one line.
        offered: String,
    },
}

/// The interface of this host that peers described by `reach` can reach it on (see the module
/// doc).
///
/// # Errors
/// [`ReachError`] when no interface is up with an address, or none carries [`Reach::local`].
pub fn choose_interface(reach: Reach) -> Result<InterfaceChoice, ReachError> {
    let offered = crate::netif::interfaces().map_err(|_| ReachError::NoInterfaces)?;
    let default_route = std::fs::read_to_string("/proc/net/route")
        .ok()
        .and_then(|table| default_route_interface(&table));
    choose_from(&offered, reach, route_source, default_route.as_deref())
}

/// The interface of the IPv4 default route in `table` (the text of `/proc/net/route`: a header,
/// then `Iface Destination Gateway Flags … Mask …`, addresses in hex), the one of lowest metric.
fn default_route_interface(table: &str) -> Option<String> {
    const UP: u32 = 0x1;
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let hex = |i: usize| f.get(i).and_then(|v| u32::from_str_radix(v, 16).ok());
            let (destination, flags, metric, mask) = (hex(1)?, hex(3)?, f.get(6)?, hex(7)?);
            (destination == 0 && mask == 0 && flags & UP != 0)
                .then(|| (metric.parse::<u32>().unwrap_or(u32::MAX), f[0].to_owned()))
        })
        .min()
        .map(|(_, iface)| iface)
}

/// The source address of the route to `peer`, as the kernel would pick it.
fn route_source(peer: IpAddr) -> Option<IpAddr> {
    let any = match peer {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let socket = UdpSocket::bind((any, 0)).ok()?;
    socket.connect((peer, 9)).ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

/// [`choose_interface`] over the `offered` interfaces and their addresses, looking routes up with
/// `route` (a peer's address to the source address of the route to it); the default route
/// leaves by the interface `default_route`.
fn choose_from(
    offered: &[(String, IpAddr)],
    reach: Reach,
    route: impl Fn(IpAddr) -> Option<IpAddr>,
    default_route: Option<&str>,
) -> Result<InterfaceChoice, ReachError> {
    // Addresses a peer can be given: not IPv6 link-local ones (they need a scope), and each
    // interface's IPv4 addresses before its IPv6 ones.
    let mut usable: Vec<&(String, IpAddr)> = offered
        .iter()
        .filter(|(_, a)| !matches!(a, IpAddr::V6(v6) if v6.is_unicast_link_local()))
        .collect();
    usable.sort_by_key(|(_, a)| a.is_ipv6());
    if usable.is_empty() {
        return Err(ReachError::NoInterfaces);
    }
    let chosen = |(interface, address): &(String, IpAddr), rule| InterfaceChoice {
        interface: interface.clone(),
        address: *address,
        rule,
    };
    let with_address = |ip: IpAddr| usable.iter().copied().find(|(_, a)| *a == ip);
    let loopback = || usable.iter().copied().find(|(_, a)| a.is_loopback());
    if let Some(local) = reach.local.filter(|ip| !ip.is_unspecified()) {
        let found = if local.is_loopback() {
            loopback()
        } else {
            with_address(local)
        };
        return found
            .map(|d| chosen(d, ReachRule::LocalAddress(local)))
            .ok_or_else(|| ReachError::NoInterfaceWithAddress {
                address: local,
                offered: describe(offered),
            });
    }
    if let Some(peer) = reach.peer.filter(|ip| !ip.is_unspecified()) {
        let found = if peer.is_loopback() {
            loopback()
        } else {
            route(peer).and_then(with_address)
        };
        if let Some(d) = found {
            return Ok(chosen(d, ReachRule::RouteToPeer(peer)));
        }
    }
    let by_name = default_route.and_then(|iface| {
        usable
            .iter()
            .copied()
            .find(|(d, a)| d == iface && !a.is_loopback())
    });
    if let Some(d) = by_name {
        return Ok(chosen(d, ReachRule::DefaultRoute));
    }
    let mut others = usable.iter().copied().filter(|(_, a)| !a.is_loopback());
    if let Some(first) = others.next() {
        if others.all(|(d, _)| *d == first.0) {
            return Ok(chosen(first, ReachRule::OnlyInterface));
        }
    }
    Ok(chosen(loopback().unwrap_or(usable[0]), ReachRule::Loopback))
}

/// `offered` as `name (address), …`.
fn describe(offered: &[(String, IpAddr)]) -> String {
    offered
        .iter()
        .map(|(d, a)| format!("{d} ({a})"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn host() -> Vec<(String, IpAddr)> {
        vec![
            ("lo".into(), ip("127.0.0.1")),
            ("eth0".into(), ip("192.168.1.5")),
            ("data0".into(), ip("10.0.0.5")),
            ("lo".into(), ip("::1")),
        ]
    }

    /// Routes: 10.0.0.0/24 by data0, everything else by eth0.
    fn routes(peer: IpAddr) -> Option<IpAddr> {
        match peer {
            IpAddr::V4(v4) if v4.octets()[..3] == [10, 0, 0] => Some(ip("10.0.0.5")),
            IpAddr::V4(_) => Some(ip("192.168.1.5")),
            IpAddr::V6(_) => None,
        }
    }

    fn no_routes(_: IpAddr) -> Option<IpAddr> {
        None
    }

    #[test]
    fn the_own_address_picks_its_interface() {
        let c = choose_from(&host(), Reach::local(ip("10.0.0.5")), routes, None).unwrap();
        assert_eq!(c.interface, "data0");
        assert_eq!(c.rule, ReachRule::LocalAddress(ip("10.0.0.5")));
        let c = choose_from(&host(), Reach::local(ip("127.0.0.1")), routes, None).unwrap();
        assert_eq!(c.interface, "lo");
        let err = choose_from(&host(), Reach::local(ip("10.9.9.9")), routes, None).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("10.9.9.9") && text.contains("data0 (10.0.0.5)"),
            "{text}"
        );
    }

    #[test]
    fn a_peer_picks_the_interface_its_route_leaves_by() {
        let c = choose_from(&host(), Reach::peer(ip("10.0.0.9")), routes, None).unwrap();
        assert_eq!(
            (c.interface.as_str(), c.rule),
            ("data0", ReachRule::RouteToPeer(ip("10.0.0.9")))
        );
        let c = choose_from(&host(), Reach::peer(ip("127.0.0.1")), routes, None).unwrap();
        assert_eq!(c.interface, "lo");
    }

    #[test]
    fn an_unspecified_address_falls_to_the_default_route() {
        let reach = Reach::local(ip("0.0.0.0"));
        let c = choose_from(&host(), reach, routes, Some("eth0")).unwrap();
        assert_eq!(
            (c.interface.as_str(), c.rule),
            ("eth0", ReachRule::DefaultRoute)
        );
        // A peer without a route of its own goes by the default route too.
        let reach = Reach::peer(ip("::5"));
        let c = choose_from(&host(), reach, routes, Some("eth0")).unwrap();
        assert_eq!(
            (c.interface.as_str(), c.rule),
            ("eth0", ReachRule::DefaultRoute)
        );
    }

    #[test]
    fn without_routes_the_only_interface_then_loopback() {
        // The veth link has an IPv6 link-local address too (unusable for a peer), and a global
        // one after its IPv4 one: still one interface, its IPv4 address advertised.
        let two_hosts_on_one_machine = vec![
            ("lo".into(), ip("127.0.0.1")),
            ("veth-d".into(), ip("fe80::1c2b:3aff:fe4d:5e6f")),
            ("veth-d".into(), ip("fd00::2")),
            ("veth-d".into(), ip("10.231.0.2")),
            ("lo".into(), ip("::1")),
        ];
        let c = choose_from(&two_hosts_on_one_machine, Reach::default(), no_routes, None).unwrap();
        assert_eq!(
            (c.interface.as_str(), c.rule),
            ("veth-d", ReachRule::OnlyInterface)
        );
        assert_eq!(c.address, ip("10.231.0.2"));
        let c = choose_from(&host(), Reach::default(), no_routes, None).unwrap();
        assert_eq!((c.interface.as_str(), c.rule), ("lo", ReachRule::Loopback));
        let alone = vec![("lo".into(), ip("127.0.0.1"))];
        let c = choose_from(&alone, Reach::default(), no_routes, None).unwrap();
        assert_eq!((c.interface.as_str(), c.rule), ("lo", ReachRule::Loopback));
        assert!(matches!(
            choose_from(&[], Reach::default(), no_routes, None),
            Err(ReachError::NoInterfaces)
        ));
    }

    #[test]
    fn the_default_route_is_read_from_the_route_table() {
        let table =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth1\t00000000\t0102000A\t0003\t0\t0\t200\t00000000\t0\t0\t0
eth0\t00000000\t010200C0\t0003\t0\t0\t100\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
";
        assert_eq!(default_route_interface(table).as_deref(), Some("eth0"));
        let no_default = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask
veth0\t0000E70A\t00000000\t0001\t0\t0\t0\t00FFFFFF
";
        assert_eq!(default_route_interface(no_default), None);
    }

    #[test]
    fn this_hosts_interfaces_carry_addresses() {
        let offered = crate::netif::interfaces().expect("getifaddrs");
        assert!(
            offered.iter().any(|(d, a)| d == "lo" && a.is_loopback()),
            "{offered:?}"
        );
        let c = choose_interface(Reach::local(ip("127.0.0.1"))).unwrap();
        assert_eq!(c.interface, "lo");
    }
}
