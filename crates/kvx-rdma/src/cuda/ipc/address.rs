//! A CUDA IPC endpoint's address: its identity on the host, its device and the IPC handles of its
//! regions.

use super::IpcError;
use crate::error::AddressError;
use crate::same_host::{self, Identity, Reader};

const ADDRESS_MAGIC: [u8; 4] = *b"KVXC";
const ADDRESS_VERSION: u8 = 1;

/// One exported region in the address blob.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ExportedRegion {
    pub(super) index: u32,
    pub(super) handle: [u8; 64],
    /// The region's offset inside the exported allocation.
    pub(super) offset: u64,
}

/// The backend-specific address: who the endpoint is, where its socket is, its device, and the
/// IPC handles of its regions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Address {
    pub(super) who: Identity,
    pub(super) device: u32,
    pub(super) regions: Vec<ExportedRegion>,
}

impl Address {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = same_host::encode_head(ADDRESS_MAGIC, ADDRESS_VERSION, &self.who);
        out.extend_from_slice(&self.device.to_le_bytes());
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            out.extend_from_slice(&r.index.to_le_bytes());
            out.extend_from_slice(&r.handle);
            out.extend_from_slice(&r.offset.to_le_bytes());
        }
        out
    }

    pub(super) fn decode(bytes: &[u8]) -> Result<Self, IpcError> {
        let parse = || -> Result<Self, AddressError> {
            let mut reader = Reader::open(bytes, ADDRESS_MAGIC, ADDRESS_VERSION)?;
            let who = Identity::decode(&mut reader)?;
            let device = reader.u32("device")?;
            let count = reader.u32("region count")? as usize;
            if count > crate::desc::MAX_REGIONS || count * 76 > reader.remaining() {
                return Err(AddressError::RegionCount(count));
            }
            let mut regions = Vec::with_capacity(count);
            for _ in 0..count {
                let index = reader.u32("region index")?;
                let mut handle = [0; 64];
                handle.copy_from_slice(reader.take(64, "handle")?);
                let offset = reader.u64("region offset")?;
                regions.push(ExportedRegion {
                    index,
                    handle,
                    offset,
                });
            }
            reader.finish()?;
            Ok(Self {
                who,
                device,
                regions,
            })
        };
        parse().map_err(IpcError::Address)
    }
}
