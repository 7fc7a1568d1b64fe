//! The connector's settings, defined once: each key of the vLLM plugin's
//! `kv_connector_extra_config` with its type, default, bounds and meaning, and (for the settings
//! of [`ConnectorConfig`]) the field it sets. The plugin reads this table from the native module
//! (`kvx_vllm._native.settings()`, `check_settings()`) instead of restating it, and the defaults
//! of [`ConnectorConfig::new`] come from it.
//!
//! ```
//! use kvx_core::EngineId;
//! use kvx_vllm::settings::{self, Raw};
//! use kvx_vllm::ConnectorConfig;
//!
//! // What an operator wrote, checked and normalised: strings become numbers.
//! let lease = settings::parse("producer_lease_s", Raw::Text("2.5"))?;
//! let mut config = ConnectorConfig::new(EngineId(1));
//! settings::apply(&mut config, "producer_lease_s", &lease)?;
//! assert_eq!(config.producer_lease.as_secs_f64(), 2.5);
//! // Out-of-range and unknown settings are refused with the key in the message.
//! assert!(settings::parse("idle_wait_ms", Raw::Float(500.0)).is_err());
//! assert!(settings::parse("no_such_key", Raw::Int(1)).is_err());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use crate::transport::TransportSpec;
use config::ConnectorConfig;

pub mod config;

/// What values a setting takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    /// A duration in seconds (a number, or a string holding one), at least 0.
    Seconds,
    /// A duration in seconds, or unset.
    OptionalSeconds,
    /// A duration in milliseconds between the bounds.
    Milliseconds {
        /// Most milliseconds.
        max: u32,
    },
    /// A whole number, at least 1.
    Count,
    /// True or false (`true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`).
    Flag,
    /// Free text.
    Text,
    /// One of a few words.
    Choice(&'static [&'static str]),
    /// `HOST:PORT`.
    Address,
    /// `auto` or a transport name ([`TransportSpec`]).
    Transport,
    /// Rails for named GPUs, `GPU=NIC,NIC;…` (`kvx_rdma::topology::RailOverrides`), or empty.
    Rails,
    /// Comma-separated `IP` or `IP:PORT` ([`Peers`](crate::config::Peers)), or empty.
    Peers,
}

impl Kind {
    /// The kind's name as the plugin sees it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Seconds => "seconds",
            Self::OptionalSeconds => "optional_seconds",
            Self::Milliseconds { .. } => "milliseconds",
            Self::Count => "count",
            Self::Flag => "flag",
            Self::Text => "text",
            Self::Choice(_) => "choice",
            Self::Address => "address",
            Self::Transport => "transport",
            Self::Rails => "rails",
            Self::Peers => "peers",
        }
    }
}

/// A setting's value, checked against its [`Kind`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Value {
    /// Seconds or milliseconds, as the kind says.
    Number(f64),
    /// An unset optional value.
    Unset,
    /// A whole number.
    Count(u64),
    /// A flag.
    Flag(bool),
    /// Text, a choice, an address or a transport name.
    Text(Cow<'static, str>),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Number(n) => write!(f, "{n}"),
            Self::Unset => f.write_str("unset"),
            Self::Count(n) => write!(f, "{n}"),
            Self::Flag(b) => write!(f, "{b}"),
            Self::Text(t) => f.write_str(t),
        }
    }
}

/// A value as an operator wrote it (a JSON or Python value), before it is checked.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum Raw<'a> {
    /// A boolean.
    Flag(bool),
    /// An integer.
    Int(i64),
    /// A floating-point number.
    Float(f64),
    /// Text.
    Text(&'a str),
    /// Nothing (`None`, `null`).
    Unset,
}

impl fmt::Display for Raw<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Flag(b) => write!(f, "{b}"),
            Self::Int(i) => write!(f, "{i}"),
            Self::Float(x) => write!(f, "{x}"),
            Self::Text(t) => write!(f, "{t:?}"),
            Self::Unset => f.write_str("None"),
        }
    }
}

/// One setting.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Setting {
    /// Its key in `kv_connector_extra_config`.
    pub key: &'static str,
    /// The [`ConnectorConfig`] field it sets; `None`: a setting of the vLLM plugin's own.
    pub field: Option<&'static str>,
    /// What values it takes.
    pub kind: Kind,
    /// Its default.
    pub default: Value,
    /// What it means.
    pub doc: &'static str,
}

const fn text(s: &'static str) -> Value {
    Value::Text(Cow::Borrowed(s))
}

/// Every setting, in the order the documentation lists them.
pub const SETTINGS: &[Setting] = &[
    Setting {
        key: "listen",
        field: None,
        kind: Kind::Address,
        default: text("127.0.0.1:7100"),
        doc:
            "Prefill: this instance's kvx control address HOST:PORT (rank r listens on PORT + r); \
              the KVX_ADDR given to `kvx proxy --prefill URL@KVX_ADDR`. Unused on decode.",
    },
    Setting {
        key: "transport",
        field: None,
        kind: Kind::Transport,
        default: text("auto"),
        doc: "Data transport: auto (cuda-ipc on the KV cache's own GPU for a CUDA cache, \
              libfabric:shm for a host cache: both for one machine), libfabric:shm, \
              libfabric:tcp[@IFACE] (across hosts; without IFACE on the interface the peers \
              reach), libfabric:efa, libfabric:auto, nixl[:ucx|:libfabric][@IFACE] (host or CUDA \
              caches across hosts), cma (host memory between processes of one host, one-sided), \
              cuda-ipc[:DEVICE] (CUDA KV caches of processes on one host; without DEVICE the \
              cache's own GPU), or loopback (one process only; tests). A libfabric name may end \
              in ,rails=N. Prefill and decode must name the same one.",
    },
    Setting {
        key: "rails",
        field: None,
        kind: Kind::Rails,
        default: text(""),
        doc: "RDMA NICs for named GPUs, GPU=NIC,NIC;… by PCI address (as `kvx topo --override`), \
              winning over the rule (the NICs behind the GPU's PCIe switch, else on its NUMA \
              node) for those GPUs; empty: the rule everywhere (the plugin then reads KVX_RAILS). \
              A NIC or GPU this host lacks is a start-up error.",
    },
    Setting {
        key: "layout",
        field: None,
        kind: Kind::Choice(&["auto", "exact", "block"]),
        default: text("auto"),
        doc: "How the KV cache is described to kvx: auto or exact (token by token: vLLM's CPU \
              backend's cache and FlashAttention's), or block (the CPU cache block by block, \
              which needs equal block sizes on both sides).",
    },
    Setting {
        key: "stream",
        field: None,
        kind: Kind::Flag,
        default: Value::Flag(true),
        doc: "Prefill, push: write a request's KV computed so far while the rest is still being \
              computed (chunked prefill: each step's finished blocks go to a registered decode \
              during the next step; with a host cache also layer by layer within a step, as vLLM \
              saves each layer), so that only the last chunk's last layer is left when the \
              request finishes.",
    },
    Setting {
        key: "seal",
        field: None,
        kind: Kind::Flag,
        default: Value::Flag(true),
        doc: "Prefill, push, host cache: when the forward pass that computes a one-token \
              prefill's last prompt token ends, write what is left of its KV and tell decode at \
              once, instead of after vLLM has finished the request (an engine iteration later). \
              Needs stream.",
    },
    Setting {
        key: "registration_lease_s",
        field: Some("registration_lease"),
        kind: Kind::Seconds,
        default: Value::Number(120.0),
        doc: "Decode: how long a request may wait for its KV from registration before it fails.",
    },
    Setting {
        key: "producer_lease_s",
        field: Some("producer_lease"),
        kind: Kind::Seconds,
        default: Value::Number(30.0),
        doc: "Prefill: how long finished blocks wait for decode's registration (push) or read \
              (pull) before they are freed.",
    },
    Setting {
        key: "heartbeat_interval_s",
        field: Some("heartbeat_interval"),
        kind: Kind::Seconds,
        default: Value::Number(5.0),
        doc: "Decode: heartbeat period on each of its control connections (naming the \
              transfers it waits for there); prefill drops a registration after three periods \
              without one.",
    },
    Setting {
        key: "connect_timeout_s",
        field: Some("connect_timeout"),
        kind: Kind::Seconds,
        default: Value::Number(30.0),
        doc: "Bound on looking up a peer's host name, on connecting to its control address and \
              on its handshake answer. Generous because vLLM's CPU workers pin themselves (and so \
              the connector's threads) to few cores, and an engine busy with its first forward \
              pass answers late.",
    },
    Setting {
        key: "idle_timeout_s",
        field: Some("idle_timeout"),
        kind: Kind::Seconds,
        default: Value::Number(60.0),
        doc: "Prefill: a control connection over which nothing came for this long after its \
              handshake is closed, and its registrations dropped (decode heartbeats on each \
              connection every heartbeat_interval_s, so a live decode is never idle): idle or \
              abandoned connections cannot hold prefill's connection slots. Keep it several of \
              decode's heartbeat intervals.",
    },
    Setting {
        key: "transfer_timeout_s",
        field: Some("transfer_timeout"),
        kind: Kind::Seconds,
        default: Value::Number(60.0),
        doc: "Prefill: how long one started transfer may run, at most 3600 (decode learns it at \
              the handshake, and believes at most that: see quiesce_timeout_s).",
    },
    Setting {
        key: "quiesce_timeout_s",
        field: Some("quiesce_timeout"),
        kind: Kind::OptionalSeconds,
        default: Value::Unset,
        doc: "Decode: after a request fails or is aborted, how long its blocks stay held at most \
              for every prefill rank to confirm that it writes no more (a posted write cannot be \
              recalled); the failure is reported to vLLM when all have, or after this. Unset (the \
              default): as long as the slowest of those prefill ranks says its writes can run \
              (its transfer_timeout_s, sent when it connects) plus 2 s.",
    },
    Setting {
        key: "idle_wait_ms",
        field: None,
        kind: Kind::Milliseconds { max: 100 },
        default: Value::Number(2.0),
        doc: "When vLLM runs an engine step with nothing to compute while a transfer of this \
              instance can end (decode: requests wait for their KV; prefill: blocks are held for \
              a decode), the worker waits up to this long for one to end before the step \
              returns, and returns as soon as one does. vLLM otherwise repeats such steps about \
              every millisecond, and its engine and worker processes spin through them. 0: \
              return at once.",
    },
    Setting {
        key: "max_entries",
        field: Some("max_entries"),
        kind: Kind::Count,
        default: Value::Count(65_536),
        doc: "Most requests held or waited for on one side.",
    },
    Setting {
        key: "auth_key_file",
        field: None,
        kind: Kind::Text,
        default: text(""),
        doc: "The deployment key file (32 random bytes, mode 0600: `kvx keygen PATH`), the same \
              on every prefill, decode and router of the deployment: each control connection \
              proves both ends hold it, then is encrypted (docs/security.md). Empty: \
              KVX_AUTH_KEY_FILE, else none, which prefill accepts only on a loopback listen \
              address unless allow_unauthenticated.",
    },
    Setting {
        key: "allow_unauthenticated",
        field: Some("allow_unauthenticated"),
        kind: Kind::Flag,
        default: Value::Flag(false),
        doc: "Prefill: listen on a non-loopback address without a deployment key (anyone who \
              reaches the port gets the region table and can join transfers); warned about at \
              start.",
    },
    Setting {
        key: "peers",
        field: Some("peers"),
        kind: Kind::Peers,
        default: text(""),
        doc: "Decode: the prefill instances it may connect to, comma-separated IP or IP:PORT \
              (rank 0's control address); a request naming another is refused before any \
              connection. Empty: with a deployment key, the instances the requests' \
              capabilities name; without one, any.",
    },
    Setting {
        key: "otlp_endpoint",
        field: None,
        kind: Kind::Text,
        default: text(""),
        doc: "An OpenTelemetry collector's OTLP/HTTP endpoint (http://HOST:PORT): each request's \
              kvx.send (prefill) or kvx.receive (decode) span, under the trace kvx proxy hands \
              on, is exported there. Empty: OTEL_EXPORTER_OTLP_ENDPOINT, else not exported.",
    },
    Setting {
        key: "log",
        field: None,
        kind: Kind::Text,
        default: text("warn"),
        doc: "Filter for kvx's own logs on standard error (RUST_LOG syntax, e.g. \
              kvx_vllm=debug); the environment variable KVX_LOG overrides it.",
    },
];

/// A setting that is unknown or whose value does not fit it.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SettingError {
    /// No setting has this key (or field name).
    #[error("unknown kvx setting {key:?}; known: {}", known())]
    Unknown {
        /// The key.
        key: String,
    },
    /// The value does not fit the setting.
    #[error("kvx {key} must be {expected}, not {given}")]
    Invalid {
        /// The setting.
        key: &'static str,
        /// What it takes.
        expected: Cow<'static, str>,
        /// What was given.
        given: String,
    },
    /// The setting is the plugin's own, not [`ConnectorConfig`]'s.
    #[error("kvx {key} is a setting of the vLLM plugin, not of the connector")]
    NotConnector {
        /// The setting.
        key: &'static str,
    },
}

fn known() -> String {
    SETTINGS
        .iter()
        .map(|s| s.key)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The setting with this key (`producer_lease_s`) or, for a [`ConnectorConfig`] setting, field
/// name (`producer_lease`).
#[must_use]
pub fn find(name: &str) -> Option<&'static Setting> {
    SETTINGS
        .iter()
        .find(|s| s.key == name || s.field == Some(name))
}

/// Checks `raw` against the setting `name` (key or field name) and gives it in its normalised
/// form.
///
/// # Errors
/// [`SettingError::Unknown`] for an unknown name, [`SettingError::Invalid`] for a value that
/// does not fit.
pub fn parse(name: &str, raw: Raw<'_>) -> Result<Value, SettingError> {
    let setting = find(name).ok_or_else(|| SettingError::Unknown { key: name.into() })?;
    let invalid = |expected: Cow<'static, str>| SettingError::Invalid {
        key: setting.key,
        expected,
        given: raw.to_string(),
    };
    let number = || -> Option<f64> {
        match raw {
            Raw::Int(i) => Some(i as f64),
            Raw::Float(x) => Some(x),
            Raw::Text(t) => t.trim().parse().ok(),
            Raw::Flag(_) | Raw::Unset => None,
        }
    };
    match setting.kind {
        Kind::Seconds => number()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Value::Number)
            .ok_or_else(|| invalid("a number of seconds, at least 0".into())),
        Kind::OptionalSeconds => match raw {
            Raw::Unset => Ok(Value::Unset),
            _ => number()
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(Value::Number)
                .ok_or_else(|| invalid("a number of seconds, at least 0, or unset".into())),
        },
        Kind::Milliseconds { max } => number()
            .filter(|ms| (0.0..=f64::from(max)).contains(ms))
            .map(Value::Number)
            .ok_or_else(|| invalid(format!("between 0 and {max}").into())),
        Kind::Count => {
            let n = match raw {
                Raw::Int(i) => u64::try_from(i).ok(),
                Raw::Float(x) if x.is_finite() && x >= 0.0 => Some(x as u64),
                Raw::Text(t) => t.trim().parse().ok(),
                _ => None,
            };
            n.filter(|n| *n >= 1)
                .map(Value::Count)
                .ok_or_else(|| invalid("a whole number, at least 1".into()))
        }
        Kind::Flag => {
            let word = match raw {
                Raw::Flag(b) => return Ok(Value::Flag(b)),
                Raw::Int(i) => i.to_string(),
                Raw::Text(t) => t.trim().to_lowercase(),
                Raw::Float(_) | Raw::Unset => String::new(),
            };
            match word.as_str() {
                "1" | "true" | "yes" | "on" => Ok(Value::Flag(true)),
                "0" | "false" | "no" | "off" => Ok(Value::Flag(false)),
                _ => Err(invalid("true or false".into())),
            }
        }
        Kind::Text => match raw {
            Raw::Text(t) => Ok(Value::Text(Cow::Owned(t.to_owned()))),
            Raw::Unset => Err(invalid("text".into())),
            other => Ok(Value::Text(Cow::Owned(other.to_string()))),
        },
        Kind::Choice(words) => match raw {
            Raw::Text(t) if words.contains(&t) => Ok(Value::Text(Cow::Owned(t.to_owned()))),
            _ => Err(invalid(one_of(words).into())),
        },
        Kind::Address => match raw {
            Raw::Text(t) if is_host_port(t) => Ok(Value::Text(Cow::Owned(t.to_owned()))),
            _ => Err(invalid("HOST:PORT".into())),
        },
        Kind::Transport => match raw {
            Raw::Text(t) if t == "auto" || t.parse::<TransportSpec>().is_ok() => {
                Ok(Value::Text(Cow::Owned(t.to_owned())))
            }
            _ => Err(invalid("auto or a transport name".into())),
        },
        Kind::Rails => match raw {
            Raw::Text(t) => match t.parse::<kvx_rdma::topology::RailOverrides>() {
                Ok(_) => Ok(Value::Text(Cow::Owned(t.to_owned()))),
                Err(e) => Err(invalid(format!("GPU=NIC,NIC;… ({e})").into())),
            },
            _ => Err(invalid("GPU=NIC,NIC;…".into())),
        },
        Kind::Peers => match raw {
            Raw::Text(t) => match t.parse::<crate::config::Peers>() {
                Ok(_) => Ok(Value::Text(Cow::Owned(t.to_owned()))),
                Err(e) => Err(invalid(e.to_string().into())),
            },
            _ => Err(invalid("IP or IP:PORT, comma-separated".into())),
        },
    }
}

fn one_of(words: &[&str]) -> String {
    match words {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

fn is_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => {
            !host.is_empty()
                && !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit())
                && port.parse::<u16>().is_ok()
        }
        None => false,
    }
}

/// Sets the [`ConnectorConfig`] field of the setting `name` (key or field name) to `value`
/// (checked by [`parse`]).
///
/// # Errors
/// [`SettingError::Unknown`], [`SettingError::NotConnector`] for a setting of the plugin's own,
/// [`SettingError::Invalid`] for a value of another kind.
pub fn apply(config: &mut ConnectorConfig, name: &str, value: &Value) -> Result<(), SettingError> {
    let setting = find(name).ok_or_else(|| SettingError::Unknown { key: name.into() })?;
    let field = setting
        .field
        .ok_or(SettingError::NotConnector { key: setting.key })?;
    let invalid = || SettingError::Invalid {
        key: setting.key,
        expected: Cow::Borrowed(setting.kind.name()),
        given: value.to_string(),
    };
    let seconds = || match value {
        Value::Number(s) => Duration::try_from_secs_f64(*s).map_err(|_| invalid()),
        _ => Err(invalid()),
    };
    match field {
        "registration_lease" => config.registration_lease = seconds()?,
        "producer_lease" => config.producer_lease = seconds()?,
        "heartbeat_interval" => config.heartbeat_interval = seconds()?,
        "connect_timeout" => config.connect_timeout = seconds()?,
        "idle_timeout" => config.idle_timeout = seconds()?,
        "transfer_timeout" => config.transfer_timeout = seconds()?,
        "quiesce_timeout" => {
            config.quiesce_timeout = match value {
                Value::Unset => None,
                _ => Some(seconds()?),
            }
        }
        "allow_unauthenticated" => {
            config.allow_unauthenticated = match value {
                Value::Flag(b) => *b,
                _ => return Err(invalid()),
            }
        }
        "peers" => {
            config.peers = match value {
                Value::Text(t) => t.parse().map_err(|_| invalid())?,
                _ => return Err(invalid()),
            }
        }
        "max_entries" => {
            config.max_entries = match value {
                Value::Count(n) => usize::try_from(*n).map_err(|_| invalid())?,
                _ => return Err(invalid()),
            }
        }
        other => unreachable!("setting field {other} has no place in ConnectorConfig"),
    }
    Ok(())
}

/// The control address of rank `rank` for the `listen` setting `HOST:PORT`: port `PORT + rank`,
/// or port 0 (each rank picks a free port) where `PORT` is 0: [`rank_port`] on the setting's
/// text (the host may be a name).
///
/// # Errors
/// [`SettingError::Invalid`] when `listen` is not `HOST:PORT` or the rank's port passes 65535.
pub fn rank_listen(listen: &str, rank: u32) -> Result<String, SettingError> {
    let invalid = |expected: &'static str| SettingError::Invalid {
        key: "listen",
        expected: Cow::Borrowed(expected),
        given: format!("{listen:?} for rank {rank}"),
    };
    let (host, port) = listen
        .rsplit_once(':')
        .filter(|_| is_host_port(listen))
        .ok_or_else(|| invalid("HOST:PORT"))?;
    let port: u16 = port.parse().map_err(|_| invalid("HOST:PORT"))?;
    let port = rank_port(port, rank).ok_or_else(|| invalid("a port that leaves room"))?;
    Ok(format!("{host}:{port}"))
}

/// The control address of rank `rank` of an instance whose rank 0 listens at `base`
/// ([`rank_port`]).
#[must_use]
pub fn rank_addr(base: std::net::SocketAddr, rank: kvx_core::Rank) -> std::net::SocketAddr {
    let mut addr = base;
    addr.set_port(rank_port(base.port(), rank.0).unwrap_or(0));
    addr
}

/// The port of rank `rank` of an instance whose rank 0 listens on `port`: `port + rank`, or 0
/// (each rank picks a free port) where `port` is 0; `None` past 65535. The one rule for rank
/// ports, of addresses ([`rank_addr`]) and of the `listen` setting's text
/// ([`rank_listen`]).
#[must_use]
pub fn rank_port(port: u16, rank: u32) -> Option<u16> {
    if port == 0 {
        return Some(0);
    }
    u16::try_from(u32::from(port) + rank).ok()
}

#[cfg(test)]
mod tests {
    use kvx_core::EngineId;

    use super::*;

    #[test]
    fn every_default_fits_its_setting_and_keys_are_unique() {
        for (i, s) in SETTINGS.iter().enumerate() {
            assert!(
                SETTINGS[..i].iter().all(|o| o.key != s.key),
                "{} twice",
                s.key
            );
            let raw = match &s.default {
                Value::Number(x) => Raw::Float(*x),
                Value::Unset => Raw::Unset,
                Value::Count(n) => Raw::Int(*n as i64),
                Value::Flag(b) => Raw::Flag(*b),
                Value::Text(t) => Raw::Text(t),
            };
            assert_eq!(parse(s.key, raw).as_ref(), Ok(&s.default), "{}", s.key);
        }
    }

    #[test]
    fn the_connector_config_takes_every_default_from_the_table() {
        let config = ConnectorConfig::new(EngineId(1));
        let seconds = |key: &str| match &find(key).unwrap().default {
            Value::Number(s) => Duration::from_secs_f64(*s),
            other => panic!("{key} defaults to {other}"),
        };
        assert_eq!(config.registration_lease, seconds("registration_lease_s"));
        assert_eq!(config.producer_lease, seconds("producer_lease_s"));
        assert_eq!(config.heartbeat_interval, seconds("heartbeat_interval_s"));
        assert_eq!(config.connect_timeout, seconds("connect_timeout_s"));
        assert_eq!(config.idle_timeout, seconds("idle_timeout_s"));
        assert_eq!(config.transfer_timeout, seconds("transfer_timeout_s"));
        assert_eq!(find("quiesce_timeout_s").unwrap().default, Value::Unset);
        assert_eq!(config.quiesce_timeout, None);
        assert_eq!(
            find("max_entries").unwrap().default,
            Value::Count(config.max_entries as u64)
        );
        assert_eq!(
            find("allow_unauthenticated").unwrap().default,
            Value::Flag(config.allow_unauthenticated)
        );
        assert_eq!(find("peers").unwrap().default, text(""));
        assert!(config.peers.is_empty());
        // Every ConnectorConfig setting of the table was looked at above.
        assert_eq!(SETTINGS.iter().filter(|s| s.field.is_some()).count(), 10);
    }

    #[test]
    fn values_are_normalised_and_bad_ones_refused_with_the_key() {
        assert_eq!(
            parse("quiesce_timeout_s", Raw::Text("2.5")),
            Ok(Value::Number(2.5))
        );
        assert_eq!(parse("quiesce_timeout", Raw::Unset), Ok(Value::Unset));
        assert_eq!(parse("seal", Raw::Text(" Off ")), Ok(Value::Flag(false)));
        assert_eq!(parse("stream", Raw::Int(1)), Ok(Value::Flag(true)));
        assert_eq!(parse("max_entries", Raw::Text("12")), Ok(Value::Count(12)));
        for (key, raw) in [
            ("idle_wait_ms", Raw::Int(-1)),
            ("idle_wait_ms", Raw::Int(101)),
            ("idle_wait_ms", Raw::Text("soon")),
            ("layout", Raw::Text("sideways")),
            ("listen", Raw::Text("no-port")),
            ("listen", Raw::Text("h:70000")),
            ("seal", Raw::Text("maybe")),
            ("peers", Raw::Text("10.0.0.1:7100,prefill-0")),
            ("peers", Raw::Int(1)),
            ("max_entries", Raw::Int(0)),
            ("producer_lease_s", Raw::Float(f64::NAN)),
            ("transport", Raw::Text("carrier-pigeon")),
        ] {
            let e = parse(key, raw).unwrap_err();
            assert!(e.to_string().contains(key), "{e}");
        }
        assert!(matches!(
            parse("nope", Raw::Int(1)),
            Err(SettingError::Unknown { .. })
        ));
        let mut config = ConnectorConfig::new(EngineId(1));
        assert!(matches!(
            apply(&mut config, "seal", &Value::Flag(true)),
            Err(SettingError::NotConnector { key: "seal" })
        ));
    }

    #[test]
    fn rank_ports_follow_rank_zeros() {
        assert_eq!(rank_listen("10.0.0.1:7100", 3).unwrap(), "10.0.0.1:7103");
        assert_eq!(rank_listen("prefill-0:7100", 0).unwrap(), "prefill-0:7100");
        assert_eq!(rank_listen("127.0.0.1:0", 2).unwrap(), "127.0.0.1:0");
        assert_eq!(rank_listen("[::1]:7100", 1).unwrap(), "[::1]:7101");
        assert!(rank_listen("h:65535", 1).is_err());
        assert!(rank_listen("nohost", 1).is_err());
    }
}
