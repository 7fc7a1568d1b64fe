//! The command line of `kvx proxy` ([`ProxyArgs`]): the mode, the instances and the bounds.

use std::net::SocketAddr;

/// Arguments of `kvx proxy`.
#[derive(clap::Args, Debug)]
pub(crate) struct ProxyArgs {
    /// push (decode registers while prefill computes) or pull (decode reads after prefill).
    #[arg(long, value_enum, default_value = "push")]
    pub(crate) mode: Mode,
    /// Address to serve the OpenAI API on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub(crate) listen: SocketAddr,
    /// A prefill instance: its HTTP base URL and its kvx control address (the connector's
    /// `listen` key), as `URL@HOST:PORT`, e.g. `http://127.0.0.1:8100@127.0.0.1:7100`. Repeatable.
    #[arg(long = "prefill", required = true, value_parser = parse_prefill)]
    pub(crate) prefill: Vec<Prefill>,
    /// A decode instance's HTTP base URL, optionally followed by `#ENGINE_ID`, its vLLM
    /// `engine_id` (`kv_transfer_config`): with `--auth-key-file`, each dispatch's capability
    /// then names that decode engine, and no other can use it (without it, any decode engine
    /// of the deployment can). Repeatable.
    #[arg(long = "decode", required = true, value_parser = parse_decode)]
    pub(crate) decode: Vec<String>,
    /// Bound on connecting to an instance, in seconds.
    #[arg(long, default_value_t = 5.0)]
    pub(crate) connect_timeout_s: f64,
    /// Bound on one whole request (both legs, retries and the streamed answer included), in
    /// seconds.
    #[arg(long, default_value_t = 600.0)]
    pub(crate) request_timeout_s: f64,
    /// Bound on the silence between two pieces of a streamed answer once its first piece has
    /// come, in seconds (0: none): a decode instance that stops sending mid-stream (hung, or
    /// its host stopped) ends the client's stream with an error event then, instead of at
    /// `--request-timeout-s`, and its request is aborted there.
    #[arg(long, default_value_t = 120.0)]
    pub(crate) stream_idle_timeout_s: f64,
    /// Largest request body accepted, in MiB (a request with images inlined can be large).
    #[arg(long, default_value_t = 64)]
    pub(crate) max_request_mib: usize,
    /// How long an instance that could not be connected is passed over, in seconds: requests
    /// meanwhile go to the others (to it only when no other is left), instead of each paying
    /// for a failed connection and, in push mode, leaving a prefill leg behind.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) skip_unreachable_s: f64,
    /// Most client requests served at once (a streamed answer counts until it ends); more are
    /// answered 503 at once.
    #[arg(long, default_value_t = 512)]
    pub(crate) max_requests: usize,
    /// Bound on receiving a request's headers, in seconds: a client that sends them slowly
    /// (or not at all) is disconnected then.
    #[arg(long, default_value_t = 30.0)]
    pub(crate) header_timeout_s: f64,
    /// Bound on receiving a request's body once its headers came, in seconds (408 then).
    #[arg(long, default_value_t = 60.0)]
    pub(crate) body_timeout_s: f64,
    /// The deployment key (`kvx keygen PATH`) with which the proxy reaches the prefill
    /// instances' kvx control ports (to give back the KV of a dispatch no decode took).
    #[arg(long, env = "KVX_AUTH_KEY_FILE")]
    pub(crate) auth_key_file: Option<std::path::PathBuf>,
}

/// Transfer mode.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Decode registers its blocks while prefill computes; prefill writes them.
    Push,
    /// Prefill first; decode then reads prefill's blocks.
    Pull,
}

/// A prefill instance: HTTP URL and kvx control address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Prefill {
    pub(crate) url: String,
    pub(crate) kvx: String,
}

/// An instance's base URL: `http://HOST[:PORT][/PATH]` (the proxy speaks plain HTTP to its
/// instances).
pub(super) fn parse_url(url: &str) -> Result<String, String> {
    if url.starts_with("https://") {
        return Err(format!(
            "`{url}`: https is not supported (kvx proxy speaks plain HTTP to its instances)"
        ));
    }
    let host = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("`{url}` is not an http:// URL"))?;
    if host.is_empty() || host.starts_with(['/', ':']) {
        return Err(format!("`{url}`: no host"));
    }
    Ok(url.trim_end_matches('/').to_owned())
}

/// A decode instance: `URL[#ENGINE_ID]` (its URL checked as [`parse_url`]'s).
pub(super) fn parse_decode(s: &str) -> Result<String, String> {
    let (url, engine) = match s.split_once('#') {
        Some((url, engine)) if !engine.is_empty() => (url, Some(engine)),
        Some(_) => return Err(format!("`{s}`: an empty engine id after `#`")),
        None => (s, None),
    };
    let url = parse_url(url)?;
    Ok(engine.map_or_else(|| url.clone(), |e| format!("{url}#{e}")))
}

pub(super) fn parse_prefill(s: &str) -> Result<Prefill, String> {
    let (url, kvx) = s
        .rsplit_once('@')
        .ok_or_else(|| format!("`{s}`: expected URL@KVX_HOST:PORT"))?;
    let url = parse_url(url)?;
    let (host, port) = kvx
        .rsplit_once(':')
        .ok_or_else(|| format!("`{kvx}`: expected HOST:PORT"))?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(format!("`{kvx}`: expected HOST:PORT"));
    }
    Ok(Prefill {
        url,
        kvx: kvx.to_owned(),
    })
}
