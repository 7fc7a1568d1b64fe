//! Router-issued capabilities: a router's grant that one decode engine may take one transfer's
//! KV from one prefill instance until a time (see `docs/security.md`).
//!
//! The router (`kvx proxy`) makes one per dispatch and puts it in the decode leg's
//! `kv_transfer_params`; decode checks it before it connects to the prefill it names and sends
//! it with its registration; prefill accepts a registration, abort or abandon for a transfer
//! only with a capability that verifies, has not expired and names the registering decode
//! engine (or any). The MAC is keyed BLAKE2s-128 under the deployment key, personalised for
//! this use (so it is never a value the Noise handshake computes), over the transfer id, the
//! decode engine, the expiry and the prefill's address.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use blake2::digest::consts::U16;
use blake2::digest::Mac as _;
use blake2::Blake2sMac;
use kvx_core::wire::Capability;
use kvx_core::{EngineId, TransferId};

use super::secure::AuthKey;

/// The BLAKE2s personalisation of capability MACs.
const PERSONAL: &[u8; 8] = b"kvx-cap1";
/// How far the clocks of a deployment's hosts may disagree: a capability is accepted this long
/// after its expiry.
pub const CLOCK_SKEW: Duration = Duration::from_secs(10);

/// Why a capability does not allow what it was presented for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CapabilityError {
    /// None came, and this side has a deployment key.
    #[error(
        "no capability for this transfer (with a deployment key, requests must come through a \
         router that holds it, such as `kvx proxy --auth-key-file`)"
    )]
    Missing,
    /// Its MAC does not verify under the deployment key: forged, altered, for another
    /// transfer, or made with another key.
    #[error(
        "the capability does not verify under the deployment key (forged, or for another transfer)"
    )]
    Forged,
    /// It expired.
    #[error("the capability expired {ago_ms} ms ago")]
    Expired {
        /// How long ago, in milliseconds.
        ago_ms: u64,
    },
    /// It names another decode engine.
    #[error("the capability names decode engine {named}, not {presenter}")]
    OtherDecode {
        /// The engine it names.
        named: EngineId,
        /// The engine that presented it.
        presenter: EngineId,
    },
    /// It names another prefill address than the one the request goes to.
    #[error("the capability names prefill {named}, not {requested}")]
    OtherPrefill {
        /// The address it names.
        named: String,
        /// The address the request names.
        requested: String,
    },
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl AuthKey {
    fn capability_mac(
        &self,
        transfer: TransferId,
        decode: EngineId,
        prefill: &str,
        expires_unix_ms: u64,
    ) -> Blake2sMac<U16> {
        let mut mac = Blake2sMac::<U16>::new_with_salt_and_personal(self.bytes(), &[], PERSONAL)
            .expect("a 32-byte key and an 8-byte personalisation are within BLAKE2s's bounds");
        mac.update(&transfer.0.to_le_bytes());
        mac.update(&decode.0.to_le_bytes());
        mac.update(&expires_unix_ms.to_le_bytes());
        mac.update(prefill.as_bytes());
        mac
    }

    /// A capability for `transfer`: `decode` (or `EngineId(0)`: any decode engine) may take its
    /// KV from the prefill instance whose control address is `prefill` until `expires`.
    #[must_use]
    pub fn grant(
        &self,
        transfer: TransferId,
        decode: EngineId,
        prefill: &str,
        expires: SystemTime,
    ) -> Capability {
        let expires_unix_ms = unix_ms(expires);
        let tag = self
            .capability_mac(transfer, decode, prefill, expires_unix_ms)
            .finalize()
            .into_bytes()
            .into();
        Capability {
            decode,
            prefill: prefill.to_owned(),
            expires_unix_ms,
            tag,
        }
    }

    /// Checks that `capability` allows `presenter` (`None`: a router, which any capability of
    /// the transfer allows) to act on `transfer` at `now`.
    ///
    /// # Errors
    /// [`CapabilityError::Missing`], [`CapabilityError::Forged`], [`CapabilityError::Expired`]
    /// or [`CapabilityError::OtherDecode`].
    pub fn check(
        &self,
        transfer: TransferId,
        capability: Option<&Capability>,
        presenter: Option<EngineId>,
        now: SystemTime,
    ) -> Result<(), CapabilityError> {
        let c = capability.ok_or(CapabilityError::Missing)?;
        self.capability_mac(transfer, c.decode, &c.prefill, c.expires_unix_ms)
            .verify_slice(&c.tag)
            .map_err(|_| CapabilityError::Forged)?;
        let now_ms = unix_ms(now);
        let skew_ms = u64::try_from(CLOCK_SKEW.as_millis()).unwrap_or(u64::MAX);
        if now_ms > c.expires_unix_ms.saturating_add(skew_ms) {
            return Err(CapabilityError::Expired {
                ago_ms: now_ms - c.expires_unix_ms,
            });
        }
        match presenter {
            Some(presenter) if c.decode != EngineId(0) && c.decode != presenter => {
                Err(CapabilityError::OtherDecode {
                    named: c.decode,
                    presenter,
                })
            }
            _ => Ok(()),
        }
    }

    /// Decode's check before it connects: [`AuthKey::check`] for this engine, and the
    /// capability names `prefill`, the address the request goes to. (Where the router named
    /// the prefill by a host name, which decode resolved from that same name, the ports must
    /// agree.)
    ///
    /// # Errors
    /// As [`AuthKey::check`], and [`CapabilityError::OtherPrefill`].
    pub fn check_before_connecting(
        &self,
        transfer: TransferId,
        capability: Option<&Capability>,
        decode: EngineId,
        prefill: SocketAddr,
        now: SystemTime,
    ) -> Result<(), CapabilityError> {
        self.check(transfer, capability, Some(decode), now)?;
        let Some(c) = capability else {
            return Ok(());
        };
        let names = match c.prefill.parse::<SocketAddr>() {
            Ok(named) => named == prefill,
            Err(_) => c
                .prefill
                .rsplit_once(':')
                .is_some_and(|(_, port)| port.parse() == Ok(prefill.port())),
        };
        if names {
            Ok(())
        } else {
            Err(CapabilityError::OtherPrefill {
                named: c.prefill.clone(),
                requested: prefill.to_string(),
            })
        }
    }
}

/// A capability as text, for `kv_transfer_params` (`kvx_capability`):
/// `1.DECODE.EXPIRES_UNIX_MS.TAG` (decode and tag in hex); the prefill address travels beside it
/// (`kvx_prefill`).
#[must_use]
pub fn to_text(c: &Capability) -> String {
    use std::fmt::Write as _;
    let mut tag = String::with_capacity(32);
    for b in c.tag {
        let _ = write!(tag, "{b:02x}");
    }
    format!("1.{:016x}.{}.{tag}", c.decode.0, c.expires_unix_ms)
}

/// Parses [`to_text`]'s form, with the prefill address it goes with; `None` if malformed.
#[must_use]
pub fn from_text(text: &str, prefill: &str) -> Option<Capability> {
    let mut parts = text.split('.');
    if parts.next()? != "1" {
        return None;
    }
    let decode = u64::from_str_radix(parts.next()?, 16).ok()?;
    let expires_unix_ms = parts.next()?.parse().ok()?;
    let hex = parts.next()?;
    if parts.next().is_some() || hex.len() != 32 {
        return None;
    }
    let mut tag = [0u8; 16];
    for (i, b) in tag.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(Capability {
        decode: EngineId(decode),
        prefill: prefill.to_owned(),
        expires_unix_ms,
        tag,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> AuthKey {
        AuthKey::from_bytes([b; 32])
    }

    const T: TransferId = TransferId(0xfeed_f00d);
    const D: EngineId = EngineId(7);

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn at(s: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(s)
    }

    #[test]
    fn a_grant_verifies_for_its_transfer_decode_and_prefill_until_it_expires() {
        let k = key(1);
        let c = k.grant(T, D, "10.0.0.1:7100", at(1_000));
        assert_eq!(k.check(T, Some(&c), Some(D), at(999)), Ok(()));
        assert_eq!(k.check(T, Some(&c), None, at(999)), Ok(()));
        assert_eq!(
            k.check_before_connecting(T, Some(&c), D, addr("10.0.0.1:7100"), at(999)),
            Ok(())
        );
        // A host name: the ports must agree.
        let named = k.grant(T, D, "prefill-0:7100", at(1_000));
        assert_eq!(
            k.check_before_connecting(T, Some(&named), D, addr("10.0.0.1:7100"), at(999)),
            Ok(())
        );
        assert!(k
            .check_before_connecting(T, Some(&named), D, addr("10.0.0.1:7101"), at(999))
            .is_err());
        // Within the clock skew, then not.
        assert_eq!(k.check(T, Some(&c), Some(D), at(1_009)), Ok(()));
        assert_eq!(
            k.check(T, Some(&c), Some(D), at(1_011)),
            Err(CapabilityError::Expired { ago_ms: 11_000 })
        );
    }

    #[test]
    fn every_mismatch_is_refused_with_its_reason() {
        let k = key(1);
        let c = k.grant(T, D, "10.0.0.1:7100", at(1_000));
        let now = at(500);
        assert_eq!(
            k.check(T, None, Some(D), now),
            Err(CapabilityError::Missing)
        );
        assert_eq!(
            k.check(TransferId(T.0 + 1), Some(&c), Some(D), now),
            Err(CapabilityError::Forged)
        );
        assert_eq!(
            key(2).check(T, Some(&c), Some(D), now),
            Err(CapabilityError::Forged)
        );
        assert_eq!(
            k.check(T, Some(&c), Some(EngineId(8)), now),
            Err(CapabilityError::OtherDecode {
                named: D,
                presenter: EngineId(8)
            })
        );
        assert_eq!(
            k.check_before_connecting(T, Some(&c), D, addr("10.0.0.9:7100"), now),
            Err(CapabilityError::OtherPrefill {
                named: "10.0.0.1:7100".into(),
                requested: "10.0.0.9:7100".into()
            })
        );
        // Any field altered breaks the MAC.
        for alter in [
            |c: &mut Capability| c.decode = EngineId(0),
            |c: &mut Capability| c.expires_unix_ms += 1,
            |c: &mut Capability| c.prefill.push('0'),
            |c: &mut Capability| c.tag[15] ^= 1,
        ] {
            let mut bad = c.clone();
            alter(&mut bad);
            assert_eq!(
                k.check(T, Some(&bad), Some(D), now),
                Err(CapabilityError::Forged)
            );
        }
    }

    #[test]
    fn a_grant_for_any_decode_allows_every_decode() {
        let k = key(3);
        let c = k.grant(T, EngineId(0), "p:1", at(10));
        assert_eq!(k.check(T, Some(&c), Some(EngineId(99)), at(5)), Ok(()));
    }

    #[test]
    fn text_round_trips_and_malformed_text_is_none() {
        let c = key(4).grant(T, D, "h:7100", at(77));
        let text = to_text(&c);
        assert_eq!(from_text(&text, "h:7100"), Some(c));
        for bad in [
            "",
            "2.0.0.00",
            "1.zz.1.00",
            "1.7.1.abc",
            &format!("{text}.1"),
        ] {
            assert_eq!(from_text(bad, "h:7100"), None, "{bad}");
        }
    }
}
