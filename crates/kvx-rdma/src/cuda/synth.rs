//! The synthetic KV pattern of [`kvx_layout::synth`] written and checked on the GPU: a
//! synthetic engine whose cache is device memory fills a request's blocks where its model would
//! write them (one launch per layer, on the engine's stream, behind that layer's compute), and
//! decode checks every received byte with one launch, reading back one counter instead of the
//! request's bytes.
//!
//! The bytes are those of [`kvx_layout::synth::head_vector`], so a cache filled here verifies
//! with the CPU walk and the reverse (`tests/gpu_cuda.rs` checks both ways).

use std::ffi::c_void;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::sys;
use kvx_core::BlockId;
use kvx_layout::Layout;

use super::driver::check;
use super::kernels::{function, load_module};
use super::{CudaError, DeviceBuffer, Gpu, Stream};

const SOURCE: &str = r#"
#define GOLDEN 0x9e3779b97f4a7c15ULL
__device__ __forceinline__ unsigned long long mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
// One (layer, K/V) part of the cache: where its chunks start, and how its elements are spaced.
struct Part { unsigned long long base, element_stride; unsigned int layer, kv; };
struct Geo {
    unsigned long long block_stride, slot_stride, head_stride, seed, first_token, tokens;
    unsigned int block_tokens, local_heads, first_head, head_bytes, element_bytes, words;
};
// One thread per 8-byte word of a head vector: (part, token, head, word). `check`: count the
// words that differ into `bad` instead of writing them.
extern "C" __global__ void kvx_synth(const Part* parts, unsigned int nparts,
                                     const unsigned int* blocks, Geo g, unsigned int check,
                                     unsigned long long* bad) {
    unsigned long long per_part = g.tokens * g.local_heads * g.words;
    unsigned long long total = per_part * nparts;
    unsigned long long wrong = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < total; i += (unsigned long long)gridDim.x * blockDim.x) {
        Part p = parts[i / per_part];
        unsigned long long r = i % per_part;
        unsigned int w = r % g.words;
        r /= g.words;
        unsigned int h = r % g.local_heads;
        unsigned long long t = g.first_token + r / g.local_heads;
        unsigned long long key =
            mix(g.seed ^ mix(((unsigned long long)p.layer << 40) ^
                             ((unsigned long long)p.kv << 32) ^ (g.first_head + h))) ^
            mix(t + GOLDEN);
        unsigned long long state = key + (w + 1ULL) * GOLDEN;
        unsigned long long word = state ^ (state >> 29);
        unsigned long long block = blocks[t / g.block_tokens];
        unsigned long long slot = t % g.block_tokens;
        char* at = (char*)(p.base + block * g.block_stride + slot * g.slot_stride +
                           h * g.head_stride);
        unsigned int from = w * 8;
        unsigned int len = g.head_bytes - from < 8 ? g.head_bytes - from : 8;
        if (p.element_stride == g.element_bytes && len == 8 &&
            (((unsigned long long)(at + from)) & 7) == 0) {
            unsigned long long* q = (unsigned long long*)(at + from);
            if (check) { wrong += *q != word; } else { *q = word; }
        } else {
            bool differs = false;
            for (unsigned int b = 0; b < len; b++) {
                unsigned int k = from + b;
                char* byte = at + (k / g.element_bytes) * p.element_stride + k % g.element_bytes;
                unsigned char v = (unsigned char)(word >> (8 * b));
                if (check) { differs |= (unsigned char)*byte != v; } else { *byte = (char)v; }
            }
            wrong += differs;
        }
    }
    if (check && wrong) atomicAdd(bad, wrong);
}
"#;

const THREADS: u32 = 256;

/// `Part` of the kernel source.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Part {
    base: u64,
    element_stride: u64,
    layer: u32,
    kv: u32,
}

/// `Geo` of the kernel source.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Geo {
    block_stride: u64,
    slot_stride: u64,
    head_stride: u64,
    seed: u64,
    first_token: u64,
    tokens: u64,
    block_tokens: u32,
    local_heads: u32,
    first_head: u32,
    head_bytes: u32,
    element_bytes: u32,
    words: u32,
}

/// The synthetic-KV kernels over one rank's cache in device memory (its regions in layout
/// order). Launches go to the stream passed to each call; a request's block table is loaded
/// first with [`SynthKv::load_blocks`].
pub struct SynthKv {
    gpu: Arc<Gpu>,
    module: sys::CUmodule,
    kernel: sys::CUfunction,
    /// Kept alive: the kernel writes into them.
    _regions: Vec<Arc<DeviceBuffer>>,
    parts: DeviceBuffer,
    parts_per_layer: u32,
    num_layers: u32,
    blocks: DeviceBuffer,
    loaded_blocks: usize,
    bad: DeviceBuffer,
    geo: Geo,
}

// SAFETY: the module and function belong to the device's primary context and are used only
// after binding it; the buffers are `Send`.
unsafe impl Send for SynthKv {}

/// Where one (layer, K/V) part's chunks start: region and offset.
#[derive(Clone, Copy, Debug)]
struct Place {
    region: u32,
    offset: u64,
    element_stride: u64,
    layer: u32,
    kv: u32,
}

/// The kernel's view of `layout`: each part's place, and the strides of blocks, slots and heads
/// (offsets in a chunk are linear in the slot and the head: every order starts its first head
/// vector at the chunk's first byte). Every byte the pattern reaches is checked to lie inside
/// its region, for every block id below the cache's size.
fn geometry(layout: &Layout) -> Result<(Vec<Place>, Geo), CudaError> {
    let spec = layout.spec();
    let element_bytes = u64::from(spec.dtype.size());
    let order = spec.order;
    let slot_stride = layout.inner_offset(order, 0, 1, 0);
    let head_stride = layout.inner_offset(order, 0, 0, 1);
    let head_bytes = layout.head_bytes();
    // The K part of `hnd-kt` spaces its slots by one element.
    if !(0..layout.kv_parts()).all(|kv| layout.inner_offset(order, kv, 1, 0) == slot_stride) {
        return Err(CudaError::Invalid(format!(
            "the GPU synthetic KV needs one token spacing for K and V (order {order:?})"
        )));
    }
    let mut places = Vec::new();
    for layer in 0..spec.num_layers {
        for kv in 0..layout.kv_parts() {
            let (region, offset) = layout.head_vector(layer, kv, BlockId(0), 0, 0);
            let element_stride = layout.element_stride(kv);
            let last = offset
                + u64::from(spec.num_blocks - 1) * layout.block_stride()
                + u64::from(spec.block_tokens - 1) * slot_stride
                + u64::from(layout.local_heads() - 1) * head_stride
                + (head_bytes / element_bytes - 1) * element_stride
                + element_bytes;
            if last > layout.region_len() {
                return Err(CudaError::Invalid(format!(
                    "layer {layer} part {kv} reaches byte {last} of a {}-byte region",
                    layout.region_len()
                )));
            }
            places.push(Place {
                region,
                offset,
                element_stride,
                layer,
                kv,
            });
        }
    }
    let geo = Geo {
        block_stride: layout.block_stride(),
        slot_stride,
        head_stride,
        block_tokens: spec.block_tokens,
        local_heads: layout.local_heads(),
        first_head: layout.first_head(),
        head_bytes: head_bytes as u32,
        element_bytes: element_bytes as u32,
        words: head_bytes.div_ceil(8) as u32,
        ..Geo::default()
    };
    Ok((places, geo))
}

impl SynthKv {
    /// Compiles the kernels for `layout`'s cache, held in `regions` (one per region of the
    /// layout, in order, on one device).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] when `regions` do not match the layout (count, device, a region
    /// too short for the layout's farthest byte), [`CudaError::NvrtcMissing`] or
    /// [`CudaError::Compile`], or the failing driver call.
    pub fn new(layout: &Layout, regions: Vec<Arc<DeviceBuffer>>) -> Result<Self, CudaError> {
        let spec = layout.spec();
        let Some(first) = regions.first() else {
            return Err(CudaError::Invalid("a cache without regions".into()));
        };
        let gpu = Arc::clone(first.gpu());
        if regions.len() != layout.region_count() as usize
            || regions
                .iter()
                .any(|r| r.gpu().ordinal() != gpu.ordinal() || r.len() < layout.region_len())
        {
            return Err(CudaError::Invalid(format!(
                "{} regions for a layout of {} regions of {} bytes on one device",
                regions.len(),
                layout.region_count(),
                layout.region_len()
            )));
        }
        let (places, geo) = geometry(layout)?;
        let parts: Vec<Part> = places
            .iter()
            .map(|p| Part {
                base: regions[p.region as usize].device_ptr() + p.offset,
                element_stride: p.element_stride,
                layer: p.layer,
                kv: p.kv,
            })
            .collect();
        let module = load_module(&gpu, SOURCE, c"kvx_synth.cu")?;
        let kernel = match function(module, "kvx_synth") {
            Ok(k) => k,
            Err(e) => {
                // SAFETY: loaded just above, unused.
                let _ = unsafe { sys::cuModuleUnload(module) };
                return Err(e);
            }
        };
        let part_bytes: Vec<u8> = parts
            .iter()
            .flat_map(|p| {
                let mut b = Vec::with_capacity(24);
                b.extend_from_slice(&p.base.to_le_bytes());
                b.extend_from_slice(&p.element_stride.to_le_bytes());
                b.extend_from_slice(&p.layer.to_le_bytes());
                b.extend_from_slice(&p.kv.to_le_bytes());
                b
            })
            .collect();
        let parts_buffer = DeviceBuffer::new(&gpu, part_bytes.len() as u64)?;
        parts_buffer.write_at(0, &part_bytes)?;
        Ok(Self {
            parts: parts_buffer,
            parts_per_layer: layout.kv_parts(),
            num_layers: spec.num_layers,
            blocks: DeviceBuffer::new(&gpu, u64::from(spec.num_blocks) * 4)?,
            loaded_blocks: 0,
            bad: DeviceBuffer::new(&gpu, 8)?,
            geo,
            gpu,
            module,
            kernel,
            _regions: regions,
        })
    }

    /// Loads a request's block table (waits for `stream`'s earlier launches, which may read the
    /// previous table).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a block id beyond the cache, or the failing driver call.
    pub fn load_blocks(&mut self, stream: &Stream, blocks: &[BlockId]) -> Result<(), CudaError> {
        let capacity = self.blocks.len() / 4;
        if let Some(b) = blocks.iter().find(|b| u64::from(b.0) >= capacity) {
            return Err(CudaError::Invalid(format!(
                "block {} beyond the cache's {capacity}",
                b.0
            )));
        }
        stream.synchronize()?;
        let bytes: Vec<u8> = blocks.iter().flat_map(|b| b.0.to_le_bytes()).collect();
        self.blocks.write_at(0, &bytes)?;
        self.loaded_blocks = blocks.len();
        Ok(())
    }

    /// Enqueues the pattern of `tokens` in `layers` into the loaded blocks, on `stream`.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] when the loaded blocks do not cover `tokens` or a layer is beyond
    /// the cache's, or the failing driver call.
    pub fn fill(
        &self,
        stream: &Stream,
        tokens: Range<u64>,
        layers: Range<u32>,
        seed: u64,
    ) -> Result<(), CudaError> {
        self.launch(stream, tokens, layers, seed, false)
    }

    /// Counts the 8-byte words of tokens `0..tokens` in every layer of the loaded blocks that
    /// differ from the pattern (0: every byte is right). Waits for the answer.
    ///
    /// # Errors
    /// As [`SynthKv::fill`].
    pub fn verify(&self, stream: &Stream, tokens: u64, seed: u64) -> Result<u64, CudaError> {
        self.gpu.bind()?;
        // SAFETY: the counter is a live 8-byte allocation; ordered before the launch on `stream`.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(self.bad.device_ptr(), 0, 8, stream.raw())
        })?;
        self.launch(stream, 0..tokens, 0..self.num_layers, seed, true)?;
        stream.synchronize()?;
        let mut bad = [0u8; 8];
        self.bad.read_at(0, &mut bad)?;
        Ok(u64::from_le_bytes(bad))
    }

    fn launch(
        &self,
        stream: &Stream,
        tokens: Range<u64>,
        layers: Range<u32>,
        seed: u64,
        verify: bool,
    ) -> Result<(), CudaError> {
        let bt = u64::from(self.geo.block_tokens);
        if tokens.end.div_ceil(bt) > self.loaded_blocks as u64 || layers.end > self.num_layers {
            return Err(CudaError::Invalid(format!(
                "tokens {tokens:?} of layers {layers:?}: {} blocks loaded, {} layers",
                self.loaded_blocks, self.num_layers
            )));
        }
        if tokens.is_empty() || layers.is_empty() {
            return Ok(());
        }
        let mut geo = Geo {
            seed,
            first_token: tokens.start,
            tokens: tokens.end - tokens.start,
            ..self.geo
        };
        let mut parts =
            self.parts.device_ptr() + u64::from(layers.start * self.parts_per_layer) * 24;
        let mut nparts = (layers.end - layers.start) * self.parts_per_layer;
        let mut blocks = self.blocks.device_ptr();
        let mut check_flag = u32::from(verify);
        let mut bad = self.bad.device_ptr();
        let words =
            geo.tokens * u64::from(geo.local_heads) * u64::from(geo.words) * u64::from(nparts);
        let limit = u64::from(self.gpu.multiprocessors().max(1) * 8);
        let grid = words.div_ceil(u64::from(THREADS)).clamp(1, limit) as u32;
        let mut params = [
            (&raw mut parts).cast::<c_void>(),
            (&raw mut nparts).cast::<c_void>(),
            (&raw mut blocks).cast::<c_void>(),
            (&raw mut geo).cast::<c_void>(),
            (&raw mut check_flag).cast::<c_void>(),
            (&raw mut bad).cast::<c_void>(),
        ];
        self.gpu.bind()?;
        // SAFETY: `kvx_synth` takes (const Part*, unsigned int, const unsigned int*, Geo,
        // unsigned int, unsigned long long*), matching `params` (`Geo` and `Part` are `repr(C)`
        // copies of the source's structs); the parts point into regions this value keeps alive
        // and were bounds-checked for every block id below the cache's size, the loaded block
        // ids were checked against that size and cover `tokens`.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.kernel,
                grid,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for SynthKv {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: loaded once in `new`; callers synchronise their streams before dropping
            // (`load_blocks` and `verify` do; a pending fill finishes before cuModuleUnload
            // returns, as the driver waits for the context's work on the module).
            let _ = unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

impl std::fmt::Debug for SynthKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SynthKv")
            .field("device", &self.gpu.ordinal())
            .field("layers", &self.num_layers)
            .field("loaded_blocks", &self.loaded_blocks)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::{Arrangement, Dtype, LayoutSpec, MemoryOrder};

    const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// The kernel's loop, thread by thread, on host memory.
    fn kernel(places: &[Place], g: &Geo, blocks: &[BlockId], regions: &mut [Vec<u8>]) {
        let per_part = g.tokens * u64::from(g.local_heads) * u64::from(g.words);
        for i in 0..per_part * places.len() as u64 {
            let p = places[(i / per_part) as usize];
            let mut r = i % per_part;
            let w = (r % u64::from(g.words)) as u32;
            r /= u64::from(g.words);
            let h = r % u64::from(g.local_heads);
            let t = g.first_token + r / u64::from(g.local_heads);
            let key = mix(g.seed
                ^ mix((u64::from(p.layer) << 40)
                    ^ (u64::from(p.kv) << 32)
                    ^ (u64::from(g.first_head) + h)))
                ^ mix(t.wrapping_add(GOLDEN));
            let state = key.wrapping_add((u64::from(w) + 1).wrapping_mul(GOLDEN));
            let word = state ^ (state >> 29);
            let block = u64::from(blocks[(t / u64::from(g.block_tokens)) as usize].0);
            let slot = t % u64::from(g.block_tokens);
            let at = p.offset + block * g.block_stride + slot * g.slot_stride + h * g.head_stride;
            let from = w * 8;
            let len = (g.head_bytes - from).min(8);
            for b in 0..len {
                let k = u64::from(from + b);
                let e = u64::from(g.element_bytes);
                let byte = at + (k / e) * p.element_stride + k % e;
                regions[p.region as usize][byte as usize] = (word >> (8 * b)) as u8;
            }
        }
    }

    /// The kernel's addressing and pattern, run on the CPU, give what `kvx_layout::synth`
    /// checks, in every order and arrangement the kernel takes; `hnd-kt` is refused.
    #[test]
    fn the_kernels_pattern_is_the_cpus() {
        for (order, arrangement, tp, rank, block, dtype) in [
            (
                MemoryOrder::Hnd,
                Arrangement::PerLayerSplit,
                1,
                0,
                16,
                Dtype::Bf16,
            ),
            (
                MemoryOrder::Nhd,
                Arrangement::PerLayerSplit,
                2,
                1,
                32,
                Dtype::Bf16,
            ),
            (
                MemoryOrder::Hnd,
                Arrangement::PerLayerSplit,
                4,
                2,
                64,
                Dtype::F32,
            ),
            (
                MemoryOrder::Nhd,
                Arrangement::PerLayerKvHalves,
                1,
                0,
                16,
                Dtype::Bf16,
            ),
            (
                MemoryOrder::Hnd,
                Arrangement::PerLayerCellKv,
                2,
                0,
                16,
                Dtype::Bf16,
            ),
        ] {
            let layout = Layout::new(LayoutSpec {
                num_layers: 3,
                total_kv_heads: 4,
                head_dim: 12,
                dtype,
                mla: false,
                block_tokens: block,
                num_blocks: 16,
                tp_size: tp,
                tp_rank: rank,
                order,
                arrangement,
            })
            .unwrap();
            let (places, geo) = geometry(&layout).unwrap();
            let tokens: u64 = 70;
            let blocks: Vec<BlockId> = (0..tokens.div_ceil(u64::from(block)))
                .map(|i| BlockId((i as u32 * 7 + 3) % 16))
                .collect();
            let mut regions =
                vec![vec![0u8; layout.region_len() as usize]; layout.region_count() as usize];
            for layer in 0..3 {
                let part =
                    &places[(layer * layout.kv_parts()) as usize..][..layout.kv_parts() as usize];
                let g = Geo {
                    seed: 99,
                    first_token: 0,
                    tokens,
                    ..geo
                };
                kernel(part, &g, &blocks, &mut regions);
            }
            let views: Vec<&[u8]> = regions.iter().map(Vec::as_slice).collect();
            kvx_layout::synth::verify_request(&layout, &views, &blocks, 0, tokens, 99)
                .unwrap_or_else(|m| panic!("{order:?} {arrangement:?}: {m}"));
        }
        let kt = Layout::new(LayoutSpec {
            num_layers: 1,
            total_kv_heads: 1,
            head_dim: 8,
            dtype: Dtype::Bf16,
            mla: false,
            block_tokens: 16,
            num_blocks: 4,
            tp_size: 1,
            tp_rank: 0,
            order: MemoryOrder::HndKt,
            arrangement: Arrangement::PerLayerSplit,
        })
        .unwrap();
        assert!(matches!(geometry(&kt), Err(CudaError::Invalid(_))));
    }
}
