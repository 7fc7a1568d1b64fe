//! A rank's KV cache in host memory for the connector tests: its layout and buffers (filled
//! with a background pattern), a request's KV written into it and checked byte by byte.
#![allow(dead_code)] // each test binary uses its part

use std::sync::Arc;

use kvx_core::{BlockId, LayoutSpec};
use kvx_layout::synth::{fill_request, verify_request};
use kvx_layout::Layout;
use kvx_rdma::region::{HostBuffer, LocalRegion};
use kvx_vllm::KvCache;

/// The seed of the KV pattern prefill writes and decode checks.
pub(crate) const SEED: u64 = 0x5eed;

pub(crate) struct Side {
    pub(crate) layout: Layout,
    pub(crate) buffers: Vec<Arc<HostBuffer>>,
}

impl Side {
    pub(crate) fn new(spec: LayoutSpec) -> (Self, KvCache) {
        let layout = Layout::new(spec.clone()).unwrap();
        let buffers: Vec<Arc<HostBuffer>> = (0..layout.region_count())
            .map(|_| {
                let b = Arc::new(HostBuffer::new(layout.region_len() as usize).unwrap());
                b.fill_with(|i| (i * 31 % 251) as u8);
                b
            })
            .collect();
        let regions = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| LocalRegion::host(i as u32, Arc::clone(b)))
            .collect();
        (
            Self { layout, buffers },
            KvCache {
                layout: spec,
                regions,
            },
        )
    }

    pub(crate) fn fill(&self, blocks: &[BlockId], tokens: u64) {
        let mut mem: Vec<Vec<u8>> = self.buffers.iter().map(|b| b.to_vec()).collect();
        let mut slices: Vec<&mut [u8]> = mem.iter_mut().map(Vec::as_mut_slice).collect();
        fill_request(&self.layout, &mut slices, blocks, tokens, SEED);
        for (b, m) in self.buffers.iter().zip(&mem) {
            b.write_at(0, m).unwrap();
        }
    }

    pub(crate) fn verify(&self, blocks: &[BlockId], skip: u64, tokens: u64) {
        let mem: Vec<Vec<u8>> = self.buffers.iter().map(|b| b.to_vec()).collect();
        let views: Vec<&[u8]> = mem.iter().map(Vec::as_slice).collect();
        verify_request(&self.layout, &views, blocks, skip, tokens, SEED).unwrap();
    }
}
