//! Device kernels for what kvx-layout plans, compiled at run time with NVRTC (to machine code for
//! the device at hand, so a newer NVRTC than the driver still works):
//!
//! - **batched copy** (`kvx_copy_pieces`): every piece of a list of strided [`CopyOp`]s in one
//!   launch: the re-layout between different block sizes (many small runs), and the gather of
//!   fragmented blocks into a contiguous staging area. One launch replaces thousands of copy-engine
//!   calls.
//! - **permute** (`kvx_permute_*`): the receiver's NHD ↔ HND re-layout of [`Permute`] chunks, in
//!   place through shared memory when a chunk fits (one read and one write of each byte), else
//!   through a scratch copy.
//!
//! [`Permute::apply`] is the CPU reference both are checked against (tests, `bench gpu`).

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use cudarc::nvrtc::sys as nvrtc;
use kvx_core::MemoryOrder;
use kvx_layout::{CopyOp, Permute};

use super::driver::{check, CudaError, DeviceBuffer, Event, Gpu, Stream};

const SOURCE: &str = r#"
struct Piece { unsigned long long src, dst, len; };
struct Op { unsigned long long src, dst, len, src_stride, dst_stride, first_row; };
struct Chunk { unsigned long long src, dst; unsigned int first_slot, slots; };
// Shifts are log2 of heads / head_units when those are powers of two, else 0xffffffff.
struct Geo { unsigned int from_hnd, to_hnd, block_tokens, heads, head_units, heads_shift, units_shift; };

// One warp copies one run: lanes take consecutive vectors, four in flight each.
template <typename T>
__device__ __forceinline__ void warp_copy(const char* src, char* dst, unsigned long long len,
                                          unsigned int lane) {
    const T* s = reinterpret_cast<const T*>(src);
    T* d = reinterpret_cast<T*>(dst);
    unsigned long long n = len / sizeof(T);
    unsigned long long i = lane;
    for (; i + 224 < n; i += 256) {
        T r[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) r[k] = s[i + 32 * k];
#pragma unroll
        for (int k = 0; k < 8; ++k) d[i + 32 * k] = r[k];
    }
    for (; i < n; i += 32) d[i] = s[i];
}

extern "C" __global__ void kvx_copy_pieces(const Piece* pieces, unsigned int n) {
    unsigned int lane = threadIdx.x & 31;
    unsigned int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    unsigned int warps = (gridDim.x * blockDim.x) >> 5;
    for (unsigned int p = warp; p < n; p += warps) {
        Piece pc = pieces[p];
        unsigned long long bits = pc.src | pc.dst | pc.len;
        if ((bits & 15ull) == 0) {
            warp_copy<uint4>((const char*)pc.src, (char*)pc.dst, pc.len, lane);
        } else if ((bits & 3ull) == 0) {
            warp_copy<unsigned int>((const char*)pc.src, (char*)pc.dst, pc.len, lane);
        } else {
            warp_copy<unsigned char>((const char*)pc.src, (char*)pc.dst, pc.len, lane);
        }
    }
}

// Strided operations expanded on the device: one warp per row, the row's operation found by a
// binary search over the operations' first rows.
extern "C" __global__ void kvx_copy_ops(const Op* ops, unsigned int n, unsigned long long rows) {
    unsigned int lane = threadIdx.x & 31;
    unsigned long long warp = (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x) >> 5;
    unsigned long long warps = (gridDim.x * (unsigned long long)blockDim.x) >> 5;
    // Each warp takes a contiguous range of rows: one binary search for its first row, then
    // it walks the table forward (no dependent search per row).
    unsigned long long per_warp = (rows + warps - 1) / warps;
    unsigned long long row = warp * per_warp;
    unsigned long long end = row + per_warp < rows ? row + per_warp : rows;
    if (row >= end) return;
    unsigned int lo = 0, hi = n;
    while (hi - lo > 1) {
        unsigned int mid = (lo + hi) >> 1;
        if (ops[mid].first_row <= row) lo = mid; else hi = mid;
    }
    Op op = ops[lo];
    unsigned long long next = lo + 1 < n ? ops[lo + 1].first_row : rows;
    for (; row < end; ++row) {
        while (row >= next) {
            ++lo;
            op = ops[lo];
            next = lo + 1 < n ? ops[lo + 1].first_row : rows;
        }
        unsigned long long r = row - op.first_row;
        const char* src = (const char*)(op.src + r * op.src_stride);
        char* dst = (char*)(op.dst + r * op.dst_stride);
        unsigned long long bits = (unsigned long long)src | (unsigned long long)dst | op.len;
        if ((bits & 15ull) == 0) {
            warp_copy<uint4>(src, dst, op.len, lane);
        } else if ((bits & 3ull) == 0) {
            warp_copy<unsigned int>(src, dst, op.len, lane);
        } else {
            warp_copy<unsigned char>(src, dst, op.len, lane);
        }
    }
}

__device__ __forceinline__ unsigned int vec_at(const Geo& g, unsigned int hnd, unsigned int slot,
                                               unsigned int head) {
    return (hnd ? head * g.block_tokens + slot : slot * g.heads + head) * g.head_units;
}

template <typename T>
__device__ __forceinline__ void permute_chunk(const Geo& g, const Chunk& c, const T* src, T* dst) {
    unsigned int work = c.slots * g.heads * g.head_units;
    bool shifts = g.heads_shift != 0xffffffffu && g.units_shift != 0xffffffffu;
    for (unsigned int i = threadIdx.x; i < work; i += blockDim.x) {
        unsigned int v, rest, head, slot;
        if (shifts) {
            v = i & (g.head_units - 1);
            rest = i >> g.units_shift;
            head = rest & (g.heads - 1);
            slot = c.first_slot + (rest >> g.heads_shift);
        } else {
            v = i % g.head_units;
            rest = i / g.head_units;
            head = rest % g.heads;
            slot = c.first_slot + rest / g.heads;
        }
        dst[vec_at(g, g.to_hnd, slot, head) + v] = src[vec_at(g, g.from_hnd, slot, head) + v];
    }
}

template <typename T>
__device__ void permute_in_place(const Chunk* chunks, unsigned int n, Geo g) {
    extern __shared__ uint4 shared_raw[];
    T* shared = reinterpret_cast<T*>(shared_raw);
    unsigned int units = g.block_tokens * g.heads * g.head_units;
    for (unsigned int k = blockIdx.x; k < n; k += gridDim.x) {
        Chunk c = chunks[k];
        T* data = reinterpret_cast<T*>(c.dst);
        unsigned int i = threadIdx.x;
        for (; i + 3 * blockDim.x < units; i += 4 * blockDim.x) {
            T a = data[i], b = data[i + blockDim.x], c2 = data[i + 2 * blockDim.x], e = data[i + 3 * blockDim.x];
            shared[i] = a; shared[i + blockDim.x] = b; shared[i + 2 * blockDim.x] = c2; shared[i + 3 * blockDim.x] = e;
        }
        for (; i < units; i += blockDim.x) shared[i] = data[i];
        __syncthreads();
        permute_chunk<T>(g, c, shared, data);
        __syncthreads();
    }
}

template <typename T>
__device__ void permute_out_of_place(const Chunk* chunks, unsigned int n, Geo g) {
    for (unsigned int k = blockIdx.x; k < n; k += gridDim.x) {
        Chunk c = chunks[k];
        permute_chunk<T>(g, c, reinterpret_cast<const T*>(c.src), reinterpret_cast<T*>(c.dst));
    }
}

#if __CUDA_ARCH__ >= 900
// Chunks larger than one block's shared memory, in place: a cluster of C blocks takes one chunk,
// each block loads the vectors of its share of the heads (every slot) into its own shared memory,
// the cluster waits until all have loaded, then each writes its heads in the target order. The
// chunk's bytes are read once and written once, like a copy.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

template <unsigned int C>
__device__ void permute_cluster(const Chunk* chunks, unsigned int n, Geo g) {
    extern __shared__ uint4 shared[];
    unsigned int rank = blockIdx.x % C;
    unsigned int heads = g.heads / C;
    unsigned int h0 = rank * heads;
    for (unsigned int k = blockIdx.x / C; k < n; k += gridDim.x / C) {
        Chunk c = chunks[k];
        uint4* data = reinterpret_cast<uint4*>(c.dst);
        unsigned int work = c.slots * heads * g.head_units;
        for (unsigned int i = threadIdx.x; i < work; i += blockDim.x) {
            unsigned int v = i % g.head_units, rest = i / g.head_units;
            unsigned int slot = c.first_slot + rest / heads, head = h0 + rest % heads;
            shared[i] = data[vec_at(g, g.from_hnd, slot, head) + v];
        }
        cluster_sync();
        for (unsigned int i = threadIdx.x; i < work; i += blockDim.x) {
            unsigned int v = i % g.head_units, rest = i / g.head_units;
            unsigned int slot = c.first_slot + rest / heads, head = h0 + rest % heads;
            data[vec_at(g, g.to_hnd, slot, head) + v] = shared[i];
        }
        cluster_sync();
    }
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) kvx_permute_cluster_2(const Chunk* c, unsigned int n, Geo g) { permute_cluster<2>(c, n, g); }
extern "C" __global__ void __cluster_dims__(4, 1, 1) kvx_permute_cluster_4(const Chunk* c, unsigned int n, Geo g) { permute_cluster<4>(c, n, g); }
extern "C" __global__ void __cluster_dims__(8, 1, 1) kvx_permute_cluster_8(const Chunk* c, unsigned int n, Geo g) { permute_cluster<8>(c, n, g); }
#endif

extern "C" __global__ void kvx_permute_shared_16(const Chunk* c, unsigned int n, Geo g) { permute_in_place<uint4>(c, n, g); }
extern "C" __global__ void kvx_permute_shared_4(const Chunk* c, unsigned int n, Geo g) { permute_in_place<unsigned int>(c, n, g); }
extern "C" __global__ void kvx_permute_shared_1(const Chunk* c, unsigned int n, Geo g) { permute_in_place<unsigned char>(c, n, g); }
extern "C" __global__ void kvx_permute_copy_16(const Chunk* c, unsigned int n, Geo g) { permute_out_of_place<uint4>(c, n, g); }
extern "C" __global__ void kvx_permute_copy_4(const Chunk* c, unsigned int n, Geo g) { permute_out_of_place<unsigned int>(c, n, g); }
extern "C" __global__ void kvx_permute_copy_1(const Chunk* c, unsigned int n, Geo g) { permute_out_of_place<unsigned char>(c, n, g); }
"#;

/// One contiguous run for the batched-copy kernel (device addresses).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Chunk {
    src: u64,
    dst: u64,
    first_slot: u32,
    slots: u32,
}

/// What the chunks of one permute launch share.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Geo {
    from_hnd: u32,
    to_hnd: u32,
    block_tokens: u32,
    heads: u32,
    head_units: u32,
    heads_shift: u32,
    units_shift: u32,
}

/// log2 of `n` when it is a power of two, else `u32::MAX` (the kernels divide then).
fn shift_of(n: u32) -> u32 {
    if n.is_power_of_two() {
        n.trailing_zeros()
    } else {
        u32::MAX
    }
}

/// One strided operation for `kvx_copy_ops` (device addresses; rows numbered across the table).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct OpRow {
    src: u64,
    dst: u64,
    len: u64,
    src_stride: u64,
    dst_stride: u64,
    first_row: u64,
}

/// Longest piece one warp copies: longer runs are split so that every multiprocessor gets work.
const MAX_PIECE: u64 = 64 << 10;
/// Threads per block of the copy kernels.
const THREADS: u32 = 512;
/// Threads per block of the permute kernels.
const PERMUTE_THREADS: u32 = 256;
/// Function names, in the order of [`Module::functions`].
const NAMES: [&str; 11] = [
    "kvx_copy_pieces",
    "kvx_permute_shared_16",
    "kvx_permute_shared_4",
    "kvx_permute_shared_1",
    "kvx_permute_copy_16",
    "kvx_permute_copy_4",
    "kvx_permute_copy_1",
    "kvx_copy_ops",
    // Hopper and later only (absent from the module below compute capability 9.0).
    "kvx_permute_cluster_2",
    "kvx_permute_cluster_4",
    "kvx_permute_cluster_8",
];
/// Index of the first cluster permute in [`NAMES`].
const CLUSTER: usize = 8;

/// The compiled module of one device (compiled once per process and device).
struct Module {
    gpu: Arc<Gpu>,
    raw: sys::CUmodule,
    functions: [sys::CUfunction; 11],
    shared_limit: Mutex<u32>,
}

// SAFETY: module and function handles belong to the device's primary context and may be used
// from any thread that binds it; the only mutable state is behind a mutex.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: loaded once in `compile`; no launch outlives the `Arc<Module>` its queue
            // holds (queues synchronise on drop).
            let _ = unsafe { sys::cuModuleUnload(self.raw) };
        }
    }
}

fn nvrtc_check(call: &str, result: nvrtc::nvrtcResult) -> Result<(), CudaError> {
    if result == nvrtc::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Compile {
            log: format!("{call}: {result:?}"),
        })
    }
}

/// Compiles `source` (named `name` in NVRTC's messages) to machine code for `gpu` with NVRTC
/// and loads it into the device's primary context; the caller unloads it.
pub(crate) fn load_module(
    gpu: &Arc<Gpu>,
    source: &str,
    name: &std::ffi::CStr,
) -> Result<sys::CUmodule, CudaError> {
    // SAFETY: only probes whether the library can be loaded.
    if !unsafe { nvrtc::is_culib_present() } {
        return Err(CudaError::NvrtcMissing);
    }
    let (major, minor) = gpu.compute_capability();
    let source = CString::new(source).map_err(|e| CudaError::Compile { log: e.to_string() })?;
    let mut program: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid NUL-terminated source and name; no headers; valid out-pointer.
    nvrtc_check("nvrtcCreateProgram", unsafe {
        nvrtc::nvrtcCreateProgram(
            &raw mut program,
            source.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    })?;
    let result = (|| {
        let options = [
            CString::new(format!("--gpu-architecture=sm_{major}{minor}")).unwrap_or_default(),
            CString::new("-std=c++17").unwrap_or_default(),
            CString::new("-default-device").unwrap_or_default(),
        ];
        let pointers: Vec<*const std::ffi::c_char> = options.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: `program` is live; the option pointers are valid for the call.
        let compiled = unsafe {
            nvrtc::nvrtcCompileProgram(program, pointers.len() as i32, pointers.as_ptr())
        };
        if compiled != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            let mut len = 0;
            // SAFETY: live program, valid out-pointer.
            unsafe { nvrtc::nvrtcGetProgramLogSize(program, &raw mut len) };
            let mut log = vec![0u8; len.max(1)];
            // SAFETY: the buffer has the size NVRTC reported.
            unsafe { nvrtc::nvrtcGetProgramLog(program, log.as_mut_ptr().cast()) };
            return Err(CudaError::Compile {
                log: format!(
                    "{compiled:?}: {}",
                    String::from_utf8_lossy(&log).trim_end_matches('\0')
                ),
            });
        }
        let mut len = 0;
        // SAFETY: compiled program, valid out-pointer.
        nvrtc_check("nvrtcGetCUBINSize", unsafe {
            nvrtc::nvrtcGetCUBINSize(program, &raw mut len)
        })?;
        let mut cubin = vec![0u8; len];
        // SAFETY: the buffer has the size NVRTC reported.
        nvrtc_check("nvrtcGetCUBIN", unsafe {
            nvrtc::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast())
        })?;
        Ok(cubin)
    })();
    // SAFETY: created above, destroyed once.
    unsafe { nvrtc::nvrtcDestroyProgram(&raw mut program) };
    let cubin = result?;

    gpu.bind()?;
    let mut raw = std::ptr::null_mut();
    // SAFETY: bound context; `cubin` is a complete image produced by NVRTC for this device.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&raw mut raw, cubin.as_ptr().cast())
    })?;
    Ok(raw)
}

/// The function `name` of a loaded module.
pub(crate) fn function(module: sys::CUmodule, name: &str) -> Result<sys::CUfunction, CudaError> {
    let cname = CString::new(name).map_err(|e| CudaError::Invalid(e.to_string()))?;
    let mut function = std::ptr::null_mut();
    // SAFETY: live module, NUL-terminated name, valid out-pointer.
    check("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&raw mut function, module, cname.as_ptr())
    })?;
    Ok(function)
}

/// Compiles [`SOURCE`] to machine code for `gpu` with NVRTC and loads it.
fn compile(gpu: &Arc<Gpu>) -> Result<Module, CudaError> {
    let (major, _) = gpu.compute_capability();
    let raw = load_module(gpu, SOURCE, c"kvx_kernels.cu")?;
    let mut module = Module {
        gpu: Arc::clone(gpu),
        raw,
        functions: [std::ptr::null_mut(); 11],
        shared_limit: Mutex::new(0),
    };
    for (i, (slot, name)) in module.functions.iter_mut().zip(NAMES).enumerate() {
        if i >= CLUSTER && major < 9 {
            continue; // compiled out: no thread block clusters before Hopper
        }
        *slot = function(raw, name)?;
    }
    Ok(module)
}

/// The module for `gpu`, compiled on first use.
fn module(gpu: &Arc<Gpu>) -> Result<Arc<Module>, CudaError> {
    static MODULES: OnceLock<Mutex<HashMap<u32, Arc<Module>>>> = OnceLock::new();
    let modules = MODULES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut modules = modules
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(module) = modules.get(&gpu.ordinal()) {
        return Ok(Arc::clone(module));
    }
    let module = Arc::new(compile(gpu)?);
    modules.insert(gpu.ordinal(), Arc::clone(&module));
    Ok(module)
}

/// Resolves a region index to its device address and length.
pub type RegionLookup<'a> = &'a dyn Fn(u32) -> Option<(u64, u64)>;

/// A queue of layout kernels on one stream of one device. Launches are asynchronous;
/// [`LayoutKernels::synchronize`] waits for them. Dropping the queue waits too.
pub struct LayoutKernels {
    module: Arc<Module>,
    stream: Stream,
    table: Option<DeviceBuffer>,
    /// Two staging blocks used in turn, so preparing the next call waits only for the upload
    /// before last (the host's planning overlaps the device's work).
    staging: [Option<PinnedHost>; 2],
    /// Recorded after the last upload from each staging block: it must finish before the block
    /// is rewritten.
    staged: [Event; 2],
    /// The staging block the next upload uses.
    turn: usize,
    scratch: Option<DeviceBuffer>,
}

/// Page-locked host memory for table uploads (a true asynchronous copy, several times faster
/// than from pageable memory), freed on drop.
struct PinnedHost {
    ptr: *mut c_void,
    len: usize,
}

// SAFETY: a plain host allocation owned by one queue; accessed only through `LayoutKernels`.
unsafe impl Send for PinnedHost {}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAllocHost; no upload from it is pending (the queue syncs
        // before dropping it).
        let _ = unsafe { sys::cuMemFreeHost(self.ptr) };
    }
}

impl LayoutKernels {
    /// Compiles (once per process and device) and opens a queue on a new stream of `gpu`.
    ///
    /// # Errors
    /// [`CudaError::NvrtcMissing`], [`CudaError::Compile`], or the failing driver call.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Self, CudaError> {
        Ok(Self {
            module: module(gpu)?,
            stream: Stream::new(gpu)?,
            table: None,
            staging: [None, None],
            staged: [Event::new(gpu)?, Event::new(gpu)?],
            turn: 0,
            scratch: None,
        })
    }

    /// The queue's stream (to order other work against it, or to time it with events).
    #[must_use]
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Uploads `items` into the reusable device table on the queue's stream through pinned
    /// staging memory (stream-ordered, so an earlier launch still reading the table finishes
    /// first).
    fn upload<T: Copy>(&mut self, items: &[T]) -> Result<u64, CudaError> {
        let bytes = std::mem::size_of_val(items);
        let gpu = Arc::clone(self.stream.gpu());
        gpu.bind()?;
        let turn = self.turn;
        self.turn ^= 1;
        // This block's previous upload must have left it before it is rewritten.
        self.staged[turn].synchronize()?;
        if self.staging[turn].as_ref().is_none_or(|p| p.len < bytes) {
            self.staging[turn] = None;
            let len = bytes.next_power_of_two().max(4096);
            let mut ptr = std::ptr::null_mut();
            // SAFETY: bound context, valid out-pointer; freed in PinnedHost::drop.
            check("cuMemAllocHost", unsafe {
                sys::cuMemAllocHost_v2(&raw mut ptr, len)
            })?;
            self.staging[turn] = Some(PinnedHost { ptr, len });
        }
        if self.table.as_ref().is_none_or(|t| t.len() < bytes as u64) {
            if let Some(old) = self.table.take() {
                self.stream.synchronize()?;
                drop(old);
            }
            self.table = Some(DeviceBuffer::new(
                &gpu,
                (bytes as u64).next_power_of_two().max(4096),
            )?);
        }
        let staging = self.staging[turn]
            .as_ref()
            .map_or(std::ptr::null_mut(), |p| p.ptr);
        let table = self.table.as_ref().map_or(0, DeviceBuffer::device_ptr);
        // SAFETY: the staging block holds at least `bytes` and no upload reads it any more
        // (synchronised above); `items` is a live slice of `Copy` data of that size.
        unsafe {
            std::ptr::copy_nonoverlapping(items.as_ptr().cast::<u8>(), staging.cast::<u8>(), bytes);
        }
        // SAFETY: the device table holds at least `bytes` (stream order keeps an earlier launch's
        // reads before this write); the staging block stays untouched until `staged` completes.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(table, staging, bytes, self.stream.raw())
        })?;
        self.staged[turn].record(&self.stream)?;
        Ok(table)
    }

    /// Launches `function` over a table of `count` entries, with `geo` as the third argument
    /// when given (the permute kernels), and `cluster` blocks per work item (1, or more for the
    /// cluster permutes).
    fn launch(
        &self,
        function: usize,
        table: u64,
        count: usize,
        geo: Option<Geo>,
        shared: u32,
        cluster: u32,
    ) -> Result<(), CudaError> {
        let mut table = table;
        let mut n = u32::try_from(count)
            .map_err(|_| CudaError::Invalid(format!("{count} work items in one launch")))?;
        // Permutes: one block of PERMUTE_THREADS per chunk (many resident blocks hide each
        // chunk's load latency); copies: one warp per piece, grid-strided.
        let (grid, threads) = if geo.is_some() {
            // Chunks so large that few blocks fit on a multiprocessor get more threads each, to
            // keep enough loads in flight.
            let threads = if shared > 56 << 10 {
                4 * PERMUTE_THREADS
            } else {
                PERMUTE_THREADS
            };
            (n.max(1).saturating_mul(cluster), threads)
        } else {
            let limit = self.stream.gpu().multiprocessors().max(1) * 16;
            (n.div_ceil(THREADS / 32).clamp(1, limit), THREADS)
        };
        let mut geo_arg = geo.unwrap_or(Geo {
            from_hnd: 0,
            to_hnd: 0,
            block_tokens: 0,
            heads: 0,
            head_units: 0,
            heads_shift: 0,
            units_shift: 0,
        });
        let mut params = [
            (&raw mut table).cast::<c_void>(),
            (&raw mut n).cast::<c_void>(),
            (&raw mut geo_arg).cast::<c_void>(),
        ];
        // SAFETY: the function takes (const T*, unsigned int[, Geo]), matching the leading
        // entries of `params` (extra entries are not read); the table holds `n` entries uploaded
        // on this stream; every address in it was bounds-checked by the caller against live
        // memory; `shared` is within the limit set for the function.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.module.functions[function],
                grid,
                1,
                1,
                threads,
                1,
                1,
                shared,
                self.stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Enqueues the batched copy of every piece.
    ///
    /// # Errors
    /// The failing driver call.
    ///
    /// # Safety
    /// Every piece's source must be readable and destination writable device memory (local, or
    /// a peer's mapped through IPC or peer access) until the queue is synchronised, and no two
    /// destinations may overlap.
    pub unsafe fn copy_pieces(&mut self, pieces: &[Piece]) -> Result<(), CudaError> {
        if pieces.is_empty() {
            return Ok(());
        }
        let table = self.upload(pieces)?;
        self.launch(0, table, pieces.len(), None, 0, 1)
    }

    /// Enqueues the copy of `ops` (strided copy operations, as planned) in one launch, `src` and
    /// `dst` resolving region indices to device addresses; checks every piece against the
    /// regions' lengths first.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for an operation outside its regions (nothing is enqueued then),
    /// or the failing driver call.
    ///
    /// # Safety
    /// The regions that `src` and `dst` describe must be live device memory (readable,
    /// writable) until the queue is synchronised.
    pub unsafe fn copy_ops(
        &mut self,
        ops: &[CopyOp],
        src: RegionLookup<'_>,
        dst: RegionLookup<'_>,
    ) -> Result<(), CudaError> {
        let (table, rows) = op_rows(ops, src, dst)?;
        let device_table = self.upload(&table)?;
        self.launch_rows(device_table, table.len(), rows)
    }

    /// Launches `kvx_copy_ops` over `rows` rows of a table of `n` operations.
    fn launch_rows(&self, table: u64, n: usize, rows: u64) -> Result<(), CudaError> {
        let mut table = table;
        let mut n = u32::try_from(n)
            .map_err(|_| CudaError::Invalid(format!("{n} operations in one launch")))?;
        let mut rows = rows;
        let warps_per_block = u64::from(THREADS / 32);
        let limit = u64::from(self.stream.gpu().multiprocessors().max(1) * 16);
        let grid = rows.div_ceil(warps_per_block).clamp(1, limit) as u32;
        let mut params = [
            (&raw mut table).cast::<c_void>(),
            (&raw mut n).cast::<c_void>(),
            (&raw mut rows).cast::<c_void>(),
        ];
        // SAFETY: `kvx_copy_ops` takes (const Op*, unsigned int, unsigned long long), matching
        // `params`; the table holds `n` operations uploaded on this stream, each checked against
        // live memory by the caller.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.module.functions[7],
                grid,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                self.stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Enqueues the in-place re-layout of every chunk of `permutes` (the receiver's side of a
    /// plan between different memory orders). Checks every chunk against its region first.
    /// Chunks that fit in shared memory are permuted there (one read and one write of each
    /// byte); larger ones through a scratch copy.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a chunk outside its region or with a zero size, or the failing
    /// driver call.
    ///
    /// # Safety
    /// The regions `regions` describes must be live device memory until the queue is
    /// synchronised, and nothing else may access the chunks meanwhile.
    pub unsafe fn permute(
        &mut self,
        permutes: &[Permute],
        regions: RegionLookup<'_>,
    ) -> Result<(), CudaError> {
        // Check everything first, then group chunks of one geometry into one launch.
        let mut groups: Vec<(Geo, u64, Vec<Chunk>)> = Vec::new();
        for p in permutes {
            let bytes = p.chunk_bytes();
            if bytes == 0
                || p.slots == 0
                || u64::from(p.first_slot) + u64::from(p.slots) > u64::from(p.block_tokens)
                || bytes > u64::from(u32::MAX)
            {
                return Err(CudaError::Invalid(format!(
                    "degenerate permute chunk {p:?}"
                )));
            }
            let (base, len) = regions(p.region)
                .ok_or_else(|| CudaError::Invalid(format!("region {} is unknown", p.region)))?;
            if p.offset.checked_add(bytes).is_none_or(|end| end > len) {
                return Err(CudaError::Invalid(format!(
                    "permute chunk at {}+{bytes} is outside region {} of {len} bytes",
                    p.offset, p.region
                )));
            }
            let addr = base + p.offset;
            let width = [16u64, 4, 1]
                .into_iter()
                .find(|w| p.head_bytes % w == 0 && addr % w == 0)
                .unwrap_or(1);
            let geo = Geo {
                from_hnd: u32::from(p.from == MemoryOrder::Hnd),
                to_hnd: u32::from(p.to == MemoryOrder::Hnd),
                block_tokens: p.block_tokens,
                heads: p.heads,
                head_units: (p.head_bytes / width) as u32,
                heads_shift: shift_of(p.heads),
                units_shift: shift_of((p.head_bytes / width) as u32),
            };
            let chunk = Chunk {
                src: addr,
                dst: addr,
                first_slot: p.first_slot,
                slots: p.slots,
            };
            match groups.iter_mut().find(|(g, w, _)| *g == geo && *w == width) {
                Some((_, _, chunks)) => chunks.push(chunk),
                None => groups.push((geo, width, vec![chunk])),
            }
        }
        let limit = u64::from(self.module.gpu.max_shared_optin());
        for (geo, width, mut chunks) in groups {
            let variant = match width {
                16 => 0,
                4 => 1,
                _ => 2,
            };
            let bytes = u64::from(geo.block_tokens)
                * u64::from(geo.heads)
                * u64::from(geo.head_units)
                * width;
            if bytes <= limit {
                let shared = bytes as u32;
                self.allow_shared(shared)?;
                let table = self.upload(&chunks)?;
                self.launch(1 + variant, table, chunks.len(), Some(geo), shared, 1)?;
            } else if let Some(c) = self.cluster_for(&geo, width, bytes, limit) {
                // Hopper: a cluster of `c` blocks shares each chunk; one pass, in place.
                let shared = (bytes / u64::from(c)) as u32;
                self.allow_shared_for(CLUSTER + c.trailing_zeros() as usize - 1, shared)?;
                let table = self.upload(&chunks)?;
                self.launch(
                    CLUSTER + c.trailing_zeros() as usize - 1,
                    table,
                    chunks.len(),
                    Some(geo),
                    shared,
                    c,
                )?;
            } else {
                let total = bytes * chunks.len() as u64;
                if self.scratch.as_ref().is_none_or(|s| s.len() < total) {
                    self.stream.synchronize()?;
                    self.scratch = None;
                    self.scratch = Some(DeviceBuffer::new(self.stream.gpu(), total)?);
                }
                let scratch = self.scratch.as_ref().map_or(0, DeviceBuffer::device_ptr);
                let mut pieces = Vec::with_capacity(chunks.len());
                for (i, chunk) in chunks.iter_mut().enumerate() {
                    chunk.src = scratch + i as u64 * bytes;
                    let mut done = 0;
                    while done < bytes {
                        let n = MAX_PIECE.min(bytes - done);
                        pieces.push(Piece {
                            src: chunk.dst + done,
                            dst: chunk.src + done,
                            len: n,
                        });
                        done += n;
                    }
                }
                // SAFETY: every chunk lies inside its region (checked) and the scratch buffer
                // holds all of them back to back.
                unsafe { self.copy_pieces(&pieces)? };
                let table = self.upload(&chunks)?;
                self.launch(4 + variant, table, chunks.len(), Some(geo), 0, 1)?;
            }
        }
        Ok(())
    }

    /// The cluster size (2, 4 or 8 blocks) that holds a chunk of `bytes` in shared memory, on a
    /// device with thread block clusters, for 16-byte vectors and heads that split evenly.
    fn cluster_for(&self, geo: &Geo, width: u64, bytes: u64, limit: u64) -> Option<u32> {
        if self.module.gpu.compute_capability().0 < 9 || width != 16 {
            return None;
        }
        // Prefer shares of at most 64 KiB (several blocks per multiprocessor hide the loads'
        // latency), else the smallest cluster that fits.
        let fits = |cap: u64| {
            [2u32, 4, 8]
                .into_iter()
                .find(|&c| geo.heads.is_multiple_of(c) && bytes / u64::from(c) <= cap)
        };
        fits(limit.min(64 << 10)).or_else(|| fits(limit))
    }

    /// Raises the dynamic shared memory of one function (the cluster permutes; each once).
    fn allow_shared_for(&self, function: usize, bytes: u32) -> Result<(), CudaError> {
        // SAFETY: a live function of the module (present: `cluster_for` checked the device);
        // the size is within the device's opt-in limit (checked by the caller).
        check("cuFuncSetAttribute", unsafe {
            sys::cuFuncSetAttribute(
                self.module.functions[function],
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        })
    }

    /// Raises the dynamic shared memory the in-place permute functions may use.
    fn allow_shared(&self, bytes: u32) -> Result<(), CudaError> {
        let mut limit = self
            .module
            .shared_limit
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if bytes <= *limit {
            return Ok(());
        }
        for function in 1..4 {
            // SAFETY: a live function of the module; 100 asks for the largest shared-memory
            // carve-out, so more chunk-sized blocks stay resident per multiprocessor.
            check("cuFuncSetAttribute", unsafe {
                sys::cuFuncSetAttribute(
                    self.module.functions[function],
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    100,
                )
            })?;
            // SAFETY: a live function of the module; the size is within the device's opt-in
            // limit (checked by the caller).
            check("cuFuncSetAttribute", unsafe {
                sys::cuFuncSetAttribute(
                    self.module.functions[function],
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            })?;
        }
        *limit = bytes;
        Ok(())
    }

    /// Waits until everything enqueued has run.
    ///
    /// # Errors
    /// The failing driver call (a kernel fault surfaces here).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize()
    }
}

impl Drop for LayoutKernels {
    fn drop(&mut self) {
        // The table and scratch buffers must outlive the launches that read them.
        let _ = self.stream.synchronize();
    }
}

/// The table of `kvx_copy_ops` for `ops` (device addresses), with the number of rows, after
/// checking every operation against its regions. Long rows are cut into column ranges of at most
/// [`MAX_PIECE`], so each warp copies a bounded run and long contiguous operations still spread
/// over the whole device.
fn op_rows(
    ops: &[CopyOp],
    src: RegionLookup<'_>,
    dst: RegionLookup<'_>,
) -> Result<(Vec<OpRow>, u64), CudaError> {
    crate::validate::check_ops(ops, |r| src(r).map(|x| x.1), |r| dst(r).map(|x| x.1))
        .map_err(|e| CudaError::Invalid(e.to_string()))?;
    let mut table = Vec::with_capacity(ops.len());
    let mut rows = 0u64;
    for op in ops {
        let (src_base, _) = src(op.src_region).unwrap_or_default();
        let (dst_base, _) = dst(op.dst_region).unwrap_or_default();
        let contiguous = op.count == 1 || (op.src_stride == op.len && op.dst_stride == op.len);
        let (len, count, src_stride, dst_stride) = if contiguous {
            (op.len * op.count, 1, 0, 0)
        } else {
            (op.len, op.count, op.src_stride, op.dst_stride)
        };
        let mut column = 0;
        while column < len {
            let width = MAX_PIECE.min(len - column);
            table.push(OpRow {
                src: src_base + op.src_offset + column,
                dst: dst_base + op.dst_offset + column,
                len: width,
                src_stride,
                dst_stride,
                first_row: rows,
            });
            rows += count;
            column += width;
        }
    }
    Ok((table, rows))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::Rank;

    /// Expands a table the way the kernel does: row `r` belongs to the last entry whose
    /// `first_row` is at most `r`.
    fn expand(table: &[OpRow], rows: u64) -> Vec<(u64, u64, u64)> {
        (0..rows)
            .map(|row| {
                let op = table.iter().rev().find(|o| o.first_row <= row).unwrap();
                let r = row - op.first_row;
                (
                    op.src + r * op.src_stride,
                    op.dst + r * op.dst_stride,
                    op.len,
                )
            })
            .collect()
    }

    #[test]
    fn op_rows_cover_every_byte_once_and_respect_bounds() {
        let strided = CopyOp {
            producer: Rank(0),
            src_region: 0,
            src_offset: 10,
            dst_region: 1,
            dst_offset: 0,
            len: MAX_PIECE + 5,
            count: 3,
            src_stride: MAX_PIECE + 100,
            dst_stride: MAX_PIECE + 5,
        };
        let contiguous = CopyOp {
            src_offset: 0,
            dst_offset: 3 * (MAX_PIECE + 5),
            len: 1000,
            count: 7,
            src_stride: 1000,
            dst_stride: 1000,
            ..strided
        };
        let regions = |r: u32| match r {
            0 => Some((0x1000_0000, 4 * MAX_PIECE)),
            1 => Some((0x2000_0000, 4 * MAX_PIECE)),
            _ => None,
        };
        let (table, rows) = op_rows(&[strided, contiguous], &regions, &regions).unwrap();
        let mut expected = Vec::new();
        for op in [strided, contiguous] {
            for (s, d, len) in op.pieces() {
                for i in 0..len {
                    expected.push((0x1000_0000 + s + i, 0x2000_0000 + d + i));
                }
            }
        }
        let mut got = Vec::new();
        for (s, d, len) in expand(&table, rows) {
            assert!(len <= MAX_PIECE);
            for i in 0..len {
                got.push((s + i, d + i));
            }
        }
        expected.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, expected);
        let too_far = CopyOp {
            count: 4,
            ..strided
        };
        assert!(matches!(
            op_rows(&[too_far], &regions, &regions),
            Err(CudaError::Invalid(_))
        ));
        let unknown = CopyOp {
            dst_region: 7,
            ..strided
        };
        assert!(op_rows(&[unknown], &regions, &regions).is_err());
    }
}
