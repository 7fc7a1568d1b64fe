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

impl Side {
    /// Writes `seed`'s pattern for tokens `0..tokens` of `blocks` (as an engine reusing them
    /// would), touching no other byte: writes of other requests may land meanwhile.
    pub(crate) fn overwrite(&self, blocks: &[BlockId], tokens: u64, seed: u64) {
        let mut vector = vec![0u8; self.layout.head_bytes() as usize];
        kvx_layout::synth::for_each_head_vector(&self.layout, blocks, 0..tokens, |v| {
            kvx_layout::synth::head_vector(seed, v.layer, v.kv, v.token, v.head, &mut vector);
            let buffer = &self.buffers[v.region as usize];
            for (at, from, len) in v.runs(vector.len() as u64) {
                let (from, len) = (from as usize, len as usize);
                buffer
                    .write_at(at as usize, &vector[from..from + len])
                    .unwrap();
            }
            true
        });
    }

    /// Whether `blocks` hold `seed`'s pattern for tokens `skip..tokens`.
    pub(crate) fn holds(&self, blocks: &[BlockId], skip: u64, tokens: u64, seed: u64) -> bool {
        let mem: Vec<Vec<u8>> = self.buffers.iter().map(|b| b.to_vec()).collect();
        let views: Vec<&[u8]> = mem.iter().map(Vec::as_slice).collect();
        verify_request(&self.layout, &views, blocks, skip, tokens, seed).is_ok()
    }
}
