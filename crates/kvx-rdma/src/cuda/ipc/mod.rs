//! The CUDA IPC backend: prefill and decode on one host, in separate processes, on the same GPU
//! or on GPUs with peer access (NVLink). The common 1P1D-on-one-node deployment.
//!
//! - **Memory**: each registered region's allocation is exported with `cuIpcGetMemHandle`; the
//!   handles travel in the endpoint description's address, and a peer opens them once
//!   (`cuIpcOpenMemHandle`, peer access enabled lazily) and keeps the mapping until it disconnects
//!   or the transport drops. Two endpoints of one process use each other's addresses directly.
//! - **Data**: one non-blocking stream per peer. A plan's operations go to the copy engines
//!   (`cuMemcpyAsync`, `cuMemcpy2DAsync` for strided runs) or, when they are many small runs, to
//!   the batched-copy kernel (one launch); [`CopyMethod`] chooses.
//! - **Completion**: at the next poll or wait, one blocking-sync event is recorded behind a
//!   peer's operations posted since; a watcher thread sleeps on it and only then sends their
//!   notices, so the consumer sees a notice after every byte landed.
//! - **Notices, messages, waiting**: the same-host control plane (`crate::same_host`): a Unix stream
//!   socket per endpoint in the abstract namespace, and `wait` blocking in `poll(2)`; no thread
//!   spins.
//!
//! A peer that died is found when its socket closes: operations towards it fail with
//! [`OpError::PeerUnreachable`] and no notice is sent.

mod address;
mod config;
mod copy;
mod transport;
mod watch;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::sys;

use super::driver::{CudaError, Gpu, Stream};
use super::kernels::LayoutKernels;
#[cfg(doc)]
use crate::error::OpError;
use crate::error::{AddressError, BackendError};
use crate::region::LocalRegion;
use crate::same_host::{self, Control, Ledger, Link, SameHost};
use crate::transport::PeerId;
use address::{Address, ExportedRegion};
pub use config::{CopyMethod, CudaIpcConfig, UnknownCopyMethod};
use watch::{watch, EventPool, Watch};

/// Backend name in endpoint descriptions.
pub const BACKEND: &str = "cuda-ipc";
/// Longest control message.
pub const MAX_MESSAGE_LEN: usize = same_host::MAX_MESSAGE_LEN;

/// A CUDA IPC failure, as the source of the transport's errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// A CUDA call failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A socket operation failed.
    #[error("{what}: {source}")]
    Socket {
        /// What was being done.
        what: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The peer's address blob is malformed.
    #[error("malformed cuda-ipc address: {0}")]
    Address(#[from] AddressError),
    /// The peer closed its socket (it exited or dropped its endpoint).
    #[error("the peer closed its connection")]
    PeerClosed,
    /// The region is on another device than the endpoint.
    #[error("region is on CUDA device {region}, this endpoint on device {endpoint}")]
    WrongDevice {
        /// The region's device.
        region: u32,
        /// The endpoint's device.
        endpoint: u32,
    },
}

fn socket_error(what: &'static str) -> impl FnOnce(std::io::Error) -> IpcError {
    move |source| IpcError::Socket { what, source }
}

fn boxed(e: impl Into<IpcError>) -> BackendError {
    Box::new(e.into())
}

/// A peer's allocation opened in this process.
struct Mapping {
    gpu: Arc<Gpu>,
    base: u64,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: opened once by `cuIpcOpenMemHandle`; the peer's stream was synchronised
            // before mappings drop (`Peer::drop`).
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        }
    }
}

struct Peer {
    socket: String,
    pid: u32,
    incarnation: u64,
    link: Link,
    /// Region index → (address in this process, length).
    regions: HashMap<u32, (u64, u64)>,
    mappings: HashMap<[u8; 64], Mapping>,
    stream: Stream,
    kernels: Option<LayoutKernels>,
    /// Kernels could not be compiled here (no NVRTC): the copy engines are used.
    kernels_unavailable: bool,
    /// Operations posted since the last flush, with their notices: one event recorded behind
    /// the last of them covers them all (the peer's streams are ordered among themselves).
    unflushed: Vec<(u64, Option<u64>)>,
    /// Whether the peer's latest work went to the kernel queue's stream.
    last_on_kernels: bool,
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Copies into the peer's mapped memory must end before the mappings close.
        let _ = self.stream.synchronize();
        if let Some(kernels) = &self.kernels {
            let _ = kernels.synchronize();
        }
    }
}

struct Local {
    region: LocalRegion,
    handle: [u8; 64],
    offset: u64,
}

/// The CUDA IPC endpoint. See the [module documentation](self).
pub struct CudaIpcTransport {
    gpu: Arc<Gpu>,
    config: CudaIpcConfig,
    control: Control,
    regions: BTreeMap<u32, Local>,
    peers: Vec<Option<Peer>>,
    ledger: Ledger,
    pool: Arc<EventPool>,
    /// Sender to the watcher thread (dropped first on drop, which ends the thread).
    watch: Option<std::sync::mpsc::Sender<Watch>>,
    watcher: Option<std::thread::JoinHandle<()>>,
}

impl CudaIpcTransport {
    /// Opens an endpoint on `config.device`.
    ///
    /// # Errors
    /// [`IpcError::Cuda`] where CUDA is missing or the device does not exist, [`IpcError::Socket`]
    /// when the control socket cannot be made.
    pub fn open(config: CudaIpcConfig) -> Result<Self, IpcError> {
        let gpu = Gpu::open(config.device)?;
        let control =
            Control::open("cuda-ipc").map_err(socket_error("opening the control socket"))?;
        let completions = control.completions();
        let pool = Arc::new(EventPool {
            gpu: Arc::clone(&gpu),
            free: Mutex::new(Vec::new()),
        });
        let (watch_tx, watch_rx) = std::sync::mpsc::channel();
        let watcher = {
            let (gpu, pool, completions) = (
                Arc::clone(&gpu),
                Arc::clone(&pool),
                Arc::clone(&completions),
            );
            std::thread::Builder::new()
                .name("kvx-cuda-watch".into())
                .spawn(move || watch(&gpu, &watch_rx, &pool, &completions))
                .map_err(socket_error("starting the completion watcher"))?
        };
        Ok(Self {
            gpu,
            config,
            control,
            regions: BTreeMap::new(),
            peers: Vec::new(),
            ledger: Ledger::default(),
            pool,
            watch: Some(watch_tx),
            watcher: Some(watcher),
        })
    }

    /// The device this endpoint serves.
    #[must_use]
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn address(&self) -> Address {
        Address {
            who: self.control.identity().clone(),
            device: self.gpu.ordinal(),
            regions: self
                .regions
                .iter()
                .map(|(&index, local)| ExportedRegion {
                    index,
                    handle: local.handle,
                    offset: local.offset,
                })
                .collect(),
        }
    }

    fn peer_mut(&mut self, peer: PeerId) -> Option<&mut Peer> {
        self.peers.get_mut(peer.0 as usize).and_then(Option::as_mut)
    }
}

impl SameHost for CudaIpcTransport {
    fn parts(&mut self) -> (&mut Control, &mut Ledger) {
        (&mut self.control, &mut self.ledger)
    }

    fn op_timeout(&self) -> Duration {
        self.config.op_timeout
    }

    fn before_poll(&mut self) {
        self.flush();
    }
}

impl Drop for CudaIpcTransport {
    fn drop(&mut self) {
        // The watcher finishes what it was given (every event completes) and exits; then the
        // peers synchronise their streams and close their mappings.
        drop(self.watch.take());
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join();
        }
        self.peers.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::same_host::Identity;

    fn sample() -> Address {
        Address {
            who: Identity {
                pid: 4242,
                incarnation: 0xdead_beef,
                socket: "kvx-cuda-ipc/4242/0/00000000deadbeef".into(),
            },
            device: 1,
            regions: vec![
                ExportedRegion {
                    index: 0,
                    handle: [7; 64],
                    offset: 0,
                },
                ExportedRegion {
                    index: 3,
                    handle: [9; 64],
                    offset: 1 << 20,
                },
            ],
        }
    }

    #[test]
    fn address_round_trips_and_rejects_damage() {
        let a = sample();
        let bytes = a.encode();
        assert_eq!(Address::decode(&bytes).unwrap(), a);
        for cut in 0..bytes.len() {
            assert!(Address::decode(&bytes[..cut]).is_err(), "prefix {cut}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(Address::decode(&long).is_err());
        let mut magic = bytes.clone();
        magic[0] = b'X';
        assert!(Address::decode(&magic).is_err());
        let mut version = bytes;
        version[4] = 9;
        assert!(Address::decode(&version).is_err());
    }

    #[test]
    fn opening_without_a_driver_is_a_clear_error() {
        match CudaIpcTransport::open(CudaIpcConfig::new(0)) {
            Ok(t) => assert_eq!(t.gpu().ordinal(), 0),
            Err(IpcError::Cuda(CudaError::DriverMissing | CudaError::NoDevice)) => {
                eprintln!("SKIPPED (GPU part): no CUDA driver or device on this machine");
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
}
