//! Connector configuration, with defaults that work on one machine.

use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::time::Duration;

use kvx_core::{EngineId, Incarnation};

/// What a consumer adds to a producer's write timeout (or its own, for reads) when it waits
/// for a failed request's writers by default ([`ConnectorConfig::quiesce_timeout`] `None`):
/// the producer's timeout runs from when its transfer started, and its failure notice still
/// has to come.
pub const QUIESCE_MARGIN: Duration = Duration::from_secs(2);

/// Settings shared by both sides of the connector.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ConnectorConfig {
    /// This engine instance.
    pub engine: EngineId,
    /// This process's incarnation (random by default): peers recognise a restart by it.
    pub incarnation: Incarnation,
    /// Producer: this rank's control address (decode connects here). Port 0 picks a free port.
    pub listen: SocketAddr,
    /// Consumer: how long a request may wait for its KV, from registration; a hard bound (the
    /// consumer's heartbeats keep the producer's copy of the registration alive meanwhile).
    pub registration_lease: Duration,
    /// Producer: how long finished blocks wait for a registration (push) or a read (pull).
    pub producer_lease: Duration,
    /// How often the consumer sends heartbeats for the transfers it waits for. Prefill keeps a
    /// registration for three intervals (at most `registration_lease`) from its arrival or last
    /// heartbeat, so that one whose decode fell silent does not wait for the whole lease.
    pub heartbeat_interval: Duration,
    /// Bound on connecting to a peer's control address.
    pub connect_timeout: Duration,
    /// Producer: a control connection that carries nothing from its peer for this long after
    /// its handshake is closed (its registrations with it), so that idle connections cannot
    /// hold the connection slots. Decode heartbeats every `heartbeat_interval` on each of its
    /// connections, waiting or not: keep this several of decode's intervals.
    pub idle_timeout: Duration,
    /// Producer: how long a started transfer may run.
    pub transfer_timeout: Duration,
    /// Most requests held or in flight on one side.
    pub max_entries: usize,
    /// Consumer: after a request fails (cancelled, its lease ran out, a producer rank failed),
    /// how long its blocks stay held, at most, for the other producer ranks to confirm that
    /// they write no more (a write already posted cannot be recalled). The failure is reported
    /// when every rank has confirmed, or after this. `None` (the default): as long as the
    /// slowest of those ranks says its writes can run (its `transfer_timeout`, which it sends
    /// in its hello) plus [`QUIESCE_MARGIN`]; this side's own reads (pull) are waited for its
    /// own `transfer_timeout` plus the margin. A shorter fixed bound trades that safety for
    /// blocks given back sooner when a producer falls silent.
    pub quiesce_timeout: Option<Duration>,
    /// Consumer: ask the producer ranks for a `Finishing` message before each transfer's final
    /// writes, and read the transport only while a notice is due (not for as long as a request
    /// waits). `None` (the default): where this side's transport polls to wait and peers'
    /// writes land without its help ([`Capabilities`](kvx_rdma::Capabilities)'
    /// `polls_to_wait` and `peer_rma_unassisted`: libfabric `shm` with cross-memory attach).
    pub finishing_hints: Option<bool>,
    /// Consumer: where the transport can (`cma`, loopback), let producers write push
    /// notices into a notice board in this rank's memory, which [`Consumer::take_events`]
    /// reads: a transfer then costs decode's driver thread no wake-up. True by default; false
    /// delivers every notice as a message to the driver.
    ///
    /// [`Consumer::take_events`]: crate::Consumer::take_events
    pub notice_board: bool,
    /// Control connections between two processes of one host use a Unix socket instead of TCP
    /// (Linux): a producer listens on one beside its TCP address, and a consumer whose
    /// producer's address is one of this host's tries it first. True by default; false: TCP
    /// only.
    pub local_sockets: bool,
    /// The deployment key: every control connection proves both ends hold it, then is
    /// encrypted (`docs/security.md`). `None`: no authentication, which a producer accepts
    /// only on a loopback address unless [`ConnectorConfig::allow_unauthenticated`].
    pub auth_key: Option<std::sync::Arc<crate::AuthKey>>,
    /// Producer: listen on a non-loopback address without a key (anyone who reaches the port
    /// then gets the region table and can register for transfers); warned about at start.
    pub allow_unauthenticated: bool,
    /// Consumer: the prefill instances it may connect to. Empty: those that the requests'
    /// capabilities name (with a deployment key), any (without one).
    pub peers: Peers,
}

/// The prefill instances a consumer may connect to: addresses (`IP:PORT`, rank 0's control
/// address) or whole hosts (`IP`), written comma-separated. Empty: no list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Peers(Vec<PeerEntry>);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PeerEntry {
    Host(std::net::IpAddr),
    Address(SocketAddr),
}

/// A `peers` entry that is neither `IP` nor `IP:PORT`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{0}` is neither IP nor IP:PORT (peers are comma-separated addresses of prefill instances)"
)]
pub struct BadPeer(pub String);

impl std::str::FromStr for Peers {
    type Err = BadPeer;

    fn from_str(s: &str) -> Result<Self, BadPeer> {
        s.split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| {
                e.parse()
                    .map(PeerEntry::Address)
                    .or_else(|_| {
                        e.trim_start_matches('[')
                            .trim_end_matches(']')
                            .parse()
                            .map(PeerEntry::Host)
                    })
                    .map_err(|_| BadPeer(e.to_owned()))
            })
            .collect::<Result<_, _>>()
            .map(Self)
    }
}

impl Peers {
    /// Whether the list is empty (no list).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The host of the list's first entry: where a decode's transport looks for its peers
    /// before it has met one (the interface the route to it leaves by).
    #[must_use]
    pub fn first_host(&self) -> Option<std::net::IpAddr> {
        self.0.first().map(|e| match *e {
            PeerEntry::Host(ip) => ip,
            PeerEntry::Address(a) => a.ip(),
        })
    }

    /// Whether the prefill instance at `prefill` is on the list (always, where there is none).
    #[must_use]
    pub fn allows(&self, prefill: SocketAddr) -> bool {
        self.0.is_empty()
            || self.0.iter().any(|e| match *e {
                PeerEntry::Host(ip) => ip == prefill.ip(),
                PeerEntry::Address(a) => a == prefill,
            })
    }
}

impl ConnectorConfig {
    /// Defaults for `engine`: control on 127.0.0.1 (free port), and every setting of
    /// [`settings::SETTINGS`](crate::settings::SETTINGS) at its default there (120 s for a
    /// request to arrive, 30 s for finished blocks to be claimed, 5 s heartbeats, 30 s to
    /// connect, 60 s for a silent connection, 60 s for a transfer).
    #[must_use]
    pub fn new(engine: EngineId) -> Self {
        let mut config = Self {
            engine,
            incarnation: random_incarnation(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            // Each set from the settings table just below.
            registration_lease: Duration::ZERO,
            producer_lease: Duration::ZERO,
            heartbeat_interval: Duration::ZERO,
            connect_timeout: Duration::ZERO,
            idle_timeout: Duration::ZERO,
            transfer_timeout: Duration::ZERO,
            max_entries: 0,
            quiesce_timeout: None,
            finishing_hints: None,
            notice_board: true,
            local_sockets: true,
            auth_key: None,
            allow_unauthenticated: false,
            peers: Peers::default(),
        };
        for setting in crate::settings::SETTINGS
            .iter()
            .filter(|s| s.field.is_some())
        {
            crate::settings::apply(&mut config, setting.key, &setting.default)
                .expect("the settings table's defaults fit their fields");
        }
        config
    }
}

impl ConnectorConfig {
    /// Checks that every duration and count that must be positive is.
    pub(crate) fn validate(&self) -> Result<(), crate::StartError> {
        let durations = [
            ("registration_lease", self.registration_lease),
            ("producer_lease", self.producer_lease),
            ("heartbeat_interval", self.heartbeat_interval),
            ("connect_timeout", self.connect_timeout),
            ("idle_timeout", self.idle_timeout),
            ("transfer_timeout", self.transfer_timeout),
        ];
        if let Some((name, _)) = durations.iter().find(|(_, d)| d.is_zero()) {
            return Err(crate::StartError::ZeroSetting(name));
        }
        if self.max_entries == 0 {
            return Err(crate::StartError::ZeroSetting("max_entries"));
        }
        if self.auth_key.is_none() && !self.listen.ip().is_loopback() {
            if !self.allow_unauthenticated {
                return Err(crate::StartError::Unauthenticated {
                    listen: self.listen,
                });
            }
            tracing::warn!(
                listen = %self.listen,
                "kvx: the control address is open to the network without authentication \
                 (allow_unauthenticated)"
            );
        }
        if self.transfer_timeout > MAX_TRANSFER_TIMEOUT {
            return Err(crate::StartError::TooLong {
                setting: "transfer_timeout",
                max: MAX_TRANSFER_TIMEOUT,
            });
        }
        Ok(())
    }
}

/// The longest `transfer_timeout`: a write runs at most an hour. Decode trusts a producer's
/// word for how long its writes can run (its hello's `write_timeout_ms`) only up to this, so
/// that a peer cannot make it hold a request's blocks for weeks.
pub const MAX_TRANSFER_TIMEOUT: Duration = Duration::from_secs(3600);

/// A random incarnation, from the standard library's per-process random hash keys.
#[must_use]
pub fn random_incarnation() -> Incarnation {
    Incarnation(random_seed())
}

/// A number no peer can know, from the standard library's per-process random hash keys (mixed
/// with the process id): incarnations, and the seeds of the tables keyed by peers' ids.
pub(crate) fn random_seed() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_allow_their_addresses_and_hosts_and_no_list_allows_all() {
        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        let none = Peers::default();
        assert!(none.allows(addr("10.9.9.9:1")));
        let peers: Peers = " 10.0.0.1:7100, 10.0.0.2 ,[::1]".parse().unwrap();
        assert!(peers.allows(addr("10.0.0.1:7100")));
        assert!(!peers.allows(addr("10.0.0.1:7101")));
        assert!(peers.allows(addr("10.0.0.2:9")));
        assert!(peers.allows(addr("[::1]:7100")));
        assert!(!peers.allows(addr("10.0.0.3:7100")));
        assert_eq!(peers.first_host(), Some("10.0.0.1".parse().unwrap()));
        assert_eq!(none.first_host(), None);
        assert_eq!(
            "10.0.0.1:7100,prefill-0".parse::<Peers>(),
            Err(BadPeer("prefill-0".into()))
        );
        assert!("".parse::<Peers>().unwrap().is_empty());
    }
}
