//! Who a same-host endpoint is ([`Identity`]: process, incarnation, socket) and the reading of
//! the backends' address blobs ([`Reader`]), whose common head [`encode_head`] writes.

use crate::error::AddressError;

/// Who an endpoint is and where its socket is: the common head of the same-host backends'
/// addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) pid: u32,
    pub(crate) incarnation: u64,
    pub(crate) socket: String,
}

impl Identity {
    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.incarnation.to_le_bytes());
        out.push(self.socket.len() as u8);
        out.extend_from_slice(self.socket.as_bytes());
    }

    pub(crate) fn decode(reader: &mut Reader<'_>) -> Result<Self, AddressError> {
        let pid = reader.u32("pid")?;
        let incarnation = reader.u64("incarnation")?;
        let len = reader.take(1, "socket length")?[0] as usize;
        let socket = String::from_utf8(reader.take(len, "socket")?.to_vec())
            .map_err(|_| AddressError::Text("socket name"))?;
        Ok(Self {
            pid,
            incarnation,
            socket,
        })
    }

    /// Whether the endpoint lives in this process.
    #[cfg(feature = "cuda")]
    pub(crate) fn is_this_process(&self) -> bool {
        self.pid == std::process::id()
    }
}

/// Reads a little-endian address blob front to back; every short read is an error naming the
/// field.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// Starts at the beginning of `bytes`, after checking its magic and version.
    pub(crate) fn open(bytes: &'a [u8], magic: [u8; 4], version: u8) -> Result<Self, AddressError> {
        let mut reader = Self { bytes, at: 0 };
        if reader.take(4, "magic")? != magic {
            return Err(AddressError::BadMagic);
        }
        let found = reader.take(1, "version")?[0];
        if found != version {
            return Err(AddressError::Version(found));
        }
        Ok(reader)
    }

    pub(crate) fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], AddressError> {
        let piece = self
            .bytes
            .get(self.at..self.at + n)
            .ok_or(AddressError::Truncated(what))?;
        self.at += n;
        Ok(piece)
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, AddressError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().unwrap_or_default(),
        ))
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, AddressError> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().unwrap_or_default(),
        ))
    }

    /// Bytes left.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    /// Fails if bytes are left over.
    pub(crate) fn finish(self) -> Result<(), AddressError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(AddressError::Trailing(n)),
        }
    }
}

/// The magic and version that open every same-host address, then the identity.
pub(crate) fn encode_head(magic: [u8; 4], version: u8, who: &Identity) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&magic);
    out.push(version);
    who.encode_into(&mut out);
    out
}
