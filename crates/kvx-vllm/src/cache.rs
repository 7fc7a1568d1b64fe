//! The KV cache a side hands the connector at start, and its registration with the transport.

use kvx_core::LayoutSpec;
use kvx_layout::Layout;
use kvx_rdma::region::LocalRegion;
use kvx_rdma::transport::Transport;

use crate::error::StartError;

/// One rank's KV cache, handed to the connector at start: its layout and the memory of each of
/// the layout's regions (index `i` of `regions` is region `i`).
#[derive(Debug)]
pub struct KvCache {
    /// The layout.
    pub layout: LayoutSpec,
    /// The regions, in layout order.
    pub regions: Vec<LocalRegion>,
}

/// Validates the cache and registers its regions with the transport.
pub(crate) fn register_cache(
    transport: &mut dyn Transport,
    cache: KvCache,
) -> Result<(Layout, Vec<LocalRegion>), StartError> {
    let layout = Layout::new(cache.layout)?;
    if cache.regions.len() != layout.region_count() as usize {
        return Err(StartError::RegionCount {
            expected: layout.region_count(),
            given: cache.regions.len(),
        });
    }
    let mut kept = Vec::with_capacity(cache.regions.len());
    for (index, region) in cache.regions.into_iter().enumerate() {
        if region.len() < layout.region_len() {
            return Err(StartError::RegionTooSmall {
                index: index as u32,
                len: region.len(),
                needed: layout.region_len(),
            });
        }
        if region.index() != index as u32 {
            return Err(StartError::RegionIndex {
                position: index,
                index: region.index(),
            });
        }
        transport.register(region.clone())?;
        kept.push(region);
    }
    Ok((layout, kept))
}
