//! Notifications: the tags that tell a write's notice, a control message and a liveness probe
//! apart, and reading what peers sent.

use nixl_sys as sys;

use super::{nixl_error, NixlTransport};
use crate::error::BackendError;
use crate::transport::{Event, Notice};

/// Tag of a write's notice.
pub(super) const TAG_NOTICE: &[u8; 4] = b"kvxN";
/// Tag of a control message.
pub(super) const TAG_MESSAGE: &[u8; 4] = b"kvxM";
/// Tag of a liveness probe (ignored by receivers).
pub(super) const TAG_PROBE: &[u8; 4] = b"kvxP";

/// What a received notification is.
#[derive(Debug)]
pub(super) enum Incoming {
    /// A notice or a control message.
    Event(Event),
    /// A liveness probe.
    Probe,
    /// Not from a kvx endpoint.
    Foreign,
}

pub(super) fn parse_notification(bytes: &[u8]) -> Incoming {
    let Some((tag, payload)) = bytes.split_first_chunk::<4>() else {
        return Incoming::Foreign;
    };
    match tag {
        TAG_NOTICE => match <[u8; 8]>::try_from(payload) {
            Ok(value) => Incoming::Event(Event::Notice(Notice(u64::from_le_bytes(value)))),
            Err(_) => Incoming::Foreign,
        },
        TAG_MESSAGE => Incoming::Event(Event::Message(payload.to_vec())),
        TAG_PROBE => Incoming::Probe,
        _ => Incoming::Foreign,
    }
}

pub(super) fn tagged(tag: &[u8; 4], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + payload.len());
    out.extend_from_slice(tag);
    out.extend_from_slice(payload);
    out
}

impl NixlTransport {
    /// Drives the worker and collects notifications.
    pub(super) fn check_notifications(&mut self) -> Result<(), BackendError> {
        let mut map = sys::NotificationMap::new().map_err(nixl_error("createNotifMap"))?;
        self.agent
            .get_notifications(&mut map, None)
            .map_err(nixl_error("getNotifs"))?;
        let agents = map.len().map_err(nixl_error("notifMapSize"))?;
        if agents == 0 {
            return Ok(());
        }
        let names: Vec<String> = map
            .agents()
            .map(|name| name.map(str::to_owned))
            .collect::<Result<_, _>>()
            .map_err(nixl_error("notifMapGetAgent"))?;
        for name in names {
            let notifications = map
                .get_notifications(&name)
                .map_err(nixl_error("notifMapGetNotifs"))?;
            for bytes in notifications {
                let bytes = bytes.map_err(nixl_error("notifMapGetNotif"))?;
                self.on_notification(&bytes);
            }
        }
        Ok(())
    }

    pub(super) fn on_notification(&mut self, bytes: &[u8]) {
        match parse_notification(bytes) {
            Incoming::Event(event) => self.events.push_back(event),
            Incoming::Probe => {}
            Incoming::Foreign => self.foreign += 1,
        }
    }
}
