//! Giving a dispatch's KV back: a dispatch no decode claimed ([`Unclaimed`]) has its prefill
//! instance told, over its kvx control port, to release the KV at once ([`Abandoner`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// How many abandons ([`Abandoner`]) may run at once.
pub(super) const ABANDONS_IN_FLIGHT: usize = 8;

/// Tells one prefill instance, over its kvx control port, to give the KV of a transfer back at
/// once (or as soon as it finishes) instead of at its lease. Prefill honours that only for a
/// transfer no decode registered (push) or finished reading (pull): in pull the proxy sends it
/// only where no decode may have been handed the dispatch; in push wherever decode did not take
/// it in ([`Unclaimed`]).
#[derive(Clone)]
pub(super) struct Abandoner {
    pub(super) kvx: String,
    /// Bounds each step (connect, handshake, send).
    pub(super) timeout: Duration,
    /// Bounds how many abandons run at once (each holds a blocking thread): beyond it, the
    /// lease frees the KV.
    pub(super) abandons: Arc<tokio::sync::Semaphore>,
    /// The deployment key, where the control ports ask for one.
    pub(super) key: Option<Arc<kvx_vllm::AuthKey>>,
}

impl Abandoner {
    /// In the background (a blocking thread of the runtime it is called on; outside a runtime
    /// nothing is sent); a failure is only reported, the lease still bounds the hold.
    pub(super) fn abandon(&self, transfer: String) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let kvx = self.kvx.clone();
        let Ok(permit) = Arc::clone(&self.abandons).try_acquire_owned() else {
            eprintln!(
                "kvx proxy: {ABANDONS_IN_FLIGHT} abandons already running: prefill {kvx} keeps \
                 the KV of {transfer} until its lease"
            );
            return;
        };
        let timeout = self.timeout;
        let key = self.key.clone();
        runtime.spawn_blocking(move || {
            let _permit = permit;
            let told = abandon_at(&kvx, &transfer, timeout, key.as_deref());
            if let Err(why) = told {
                eprintln!(
                    "kvx proxy: cannot tell prefill {kvx} to give back the KV of {transfer} \
                     (held until its lease): {why}"
                );
            }
        });
    }
}

/// A dispatch whose KV no decode has claimed yet: dropped unclaimed, it has prefill give that KV
/// back (an [`Abandoner`]). Pull claims it while a decode instance may have been handed the
/// parameters (from the decode leg's start, unless its connection is refused). Push claims it once decode's answer shows
/// that decode took the request in: a successful answer that is not a stream (decode has finished), or the first
/// piece of a successful stream (decode has its first token, so it registered). Dropped
/// unclaimed: decode was unreachable, refused or failed the request, the prefill leg failed,
/// or the client went away first; a decode that registered in the meantime keeps the KV
/// (prefill refuses a router's abort of a registered transfer) and gives it back itself.
pub(super) struct Unclaimed {
    pub(super) abandoner: Option<Abandoner>,
    pub(super) transfer: String,
}

impl Unclaimed {
    pub(super) fn claim(&mut self) {
        self.abandoner = None;
    }

    /// Claims it until [`Unclaimed::take_back`] is given what this returns: for a leg that
    /// hands a decode the dispatch, claimed however the leg ends (even dropped) unless it
    /// shows that the decode never got it.
    pub(super) fn hand_over(&mut self) -> Option<Abandoner> {
        self.abandoner.take()
    }

    /// Unclaimed again (the leg's decode never got the dispatch).
    pub(super) fn take_back(&mut self, handed: Option<Abandoner>) {
        self.abandoner = handed;
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if let Some(a) = self.abandoner.take() {
            a.abandon(std::mem::take(&mut self.transfer));
        }
    }
}

/// Tells the prefill instance at `kvx` (`HOST:PORT`) to give back the KV of `transfer`: at its
/// first IPv4 address, as decode reaches it (a name such as `localhost` often lists `::1` first
/// while prefill listens on IPv4), then at the others.
fn abandon_at(
    kvx: &str,
    transfer: &str,
    timeout: Duration,
    key: Option<&kvx_vllm::AuthKey>,
) -> Result<u32, String> {
    let mut addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(kvx)
        .map_err(|e| e.to_string())?
        .collect();
    addrs.sort_by_key(|a| !a.is_ipv4());
    let mut last = "no address".to_owned();
    for addr in addrs {
        match kvx_vllm::router::abandon(
            addr,
            transfer,
            "the router gave the dispatch up: no decode instance took it in",
            timeout,
            key,
        ) {
            Ok(ranks) => return Ok(ranks),
            Err(e) => last = e.to_string(),
        }
    }
    Err(last)
}
