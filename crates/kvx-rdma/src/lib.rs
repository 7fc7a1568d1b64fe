//! # kvx-rdma
//!
//! The transports of kvx behind one trait, [`Transport`]: register memory regions, export the
//! endpoint's description ([`EndpointDesc`]: address and region table with keys), connect to a
//! peer from its description, write a list of [`CopyOp`](kvx_layout::CopyOp)s to a peer with a
//! completion [`Notice`] that the peer sees only after the data is visible, read (pull mode),
//! send small control messages, and poll or wait for completions and received notices.
//!
//! Backends:
//! - [`loopback`]: in-process, for the unit tests of the layers above;
//! - `libfabric` (feature `libfabric`, on by default): one-sided RMA over the system libfabric
//!   (`shm`, `tcp;ofi_rxm`, `efa`), through the own bindgen crate `libfabric-sys`;
//! - `nixl` (feature `nixl`, off by default): NVIDIA NIXL (its UCX plugin) through `nixl-sys`,
//!   with the runtime library loaded at run time;
//! - [`cma`] (feature `cma`, on by default): host memory between processes of one host with
//!   cross-memory attach (`process_vm_writev`), one-sided, no receiver-side work;
//! - `cuda::ipc` (feature `cuda`, on by default): CUDA IPC between processes of one host, with
//!   CUDA device memory as a region kind and NVRTC layout kernels ([`cuda`]).
//!
//! Memory kinds beyond host memory: CUDA device memory ([`cuda`], feature `cuda`) and AWS Neuron
//! device memory (`neuron`, feature `neuron`, through the run-time-loaded `neuron-sys`). Also
//! here: the PCIe [`topology`] and rail selection.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use kvx_core::Rank;
//! use kvx_layout::CopyOp;
//! use kvx_rdma::loopback::LoopbackFabric;
//! use kvx_rdma::{Event, HostBuffer, LocalRegion, Notice, Transport};
//!
//! let fabric = LoopbackFabric::new();
//! let (mut producer, mut consumer) = (fabric.endpoint(), fabric.endpoint());
//!
//! let src = Arc::new(HostBuffer::new(4096)?);
//! src.fill_with(|i| i as u8);
//! producer.register(LocalRegion::host(0, Arc::clone(&src)))?;
//! let dst = Arc::new(HostBuffer::new(4096)?);
//! consumer.register(LocalRegion::host(0, Arc::clone(&dst)))?;
//!
//! // The consumer's description travels to the producer (in kvx: inside the registration).
//! let peer = producer.connect(&consumer.local_desc())?;
//! let op = CopyOp {
//!     producer: Rank(0),
//!     src_region: 0,
//!     src_offset: 0,
//!     dst_region: 0,
//!     dst_offset: 1024,
//!     len: 1024,
//!     count: 1,
//!     src_stride: 0,
//!     dst_stride: 0,
//! };
//! producer.write(peer, &[op], Some(Notice(42)))?;
//!
//! // The consumer sees the notice only once the bytes are there.
//! let mut events = Vec::new();
//! consumer.wait(&mut events, Duration::from_secs(5))?;
//! assert!(matches!(events[..], [Event::Notice(Notice(42))]));
//! assert_eq!(dst.to_vec()[1024..2048], src.to_vec()[..1024]);
//!
//! // An operation outside the registered memory is refused before anything moves.
//! let too_far = CopyOp { dst_offset: 4000, ..op };
//! assert!(producer.write(peer, &[too_far], None).is_err());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#[cfg(feature = "cma")]
pub mod cma;
pub mod cpu_time;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "libfabric")]
pub mod libfabric;
pub mod local_peer;
pub mod loopback;
pub mod netif;
#[cfg(feature = "neuron")]
pub mod neuron;
#[cfg(feature = "nixl")]
pub mod nixl;
#[cfg(any(feature = "cuda", feature = "cma"))]
mod same_host;
pub mod topology;
pub mod transport;

// The transport's vocabulary keeps its paths at the root.
#[cfg(any(
    feature = "libfabric",
    feature = "cuda",
    feature = "cma",
    feature = "nixl"
))]
use transport::wake;
pub use transport::{board, desc, error, region, validate};
use transport::{ids, peers};

pub use desc::{BoardPlace, DescError, EndpointDesc, NoticeSlot};
pub use error::{
    AddressError, BackendError, ConnectError, DeregisterError, OpError, PlanError, PollError,
    ReadError, RegisterError, SendError, Side, WriteError,
};
pub use region::{BufferError, HostBuffer, LocalRegion};
pub use transport::{Capabilities, Event, Notice, OpId, OpKind, PeerId, Transport, Waker};
