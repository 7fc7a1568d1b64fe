//! [`Transport`] for [`CudaIpcTransport`]: registration (exporting IPC handles), descriptions,
//! connecting (opening the peer's handles), the operations, and polling and waiting.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use kvx_core::{MemoryKind, RegionDesc};
use kvx_layout::CopyOp;

use super::super::driver::{check, CudaError, Stream};
use super::address::{Address, ExportedRegion};
use super::{
    boxed, socket_error, CudaIpcTransport, IpcError, Local, Mapping, Peer, BACKEND, MAX_MESSAGE_LEN,
};
use crate::desc::EndpointDesc;
use crate::error::{
    AddressError, ConnectError, DeregisterError, PollError, ReadError, RegisterError, SendError,
    WriteError,
};
use crate::region::LocalRegion;
use crate::same_host::{self, peer_gone, Link, SameHost};
use crate::transport::{Capabilities, Event, Notice, OpId, OpKind, PeerId, Transport, Waker};

impl Transport for CudaIpcTransport {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            notice_bits: 64,
            max_message_len: MAX_MESSAGE_LEN,
            memory_kinds: vec![MemoryKind::Cuda {
                device: self.gpu.ordinal(),
            }],
            polls_to_wait: false,
            peer_rma_unassisted: true,
            peer_rma_occasional_reads: false,
        }
    }

    fn register(&mut self, region: LocalRegion) -> Result<RegionDesc, RegisterError> {
        let index = region.index();
        if self.regions.contains_key(&index) {
            return Err(RegisterError::Duplicate(index));
        }
        if region.is_empty() {
            return Err(RegisterError::Empty(index));
        }
        let device = match region.kind() {
            MemoryKind::Cuda { device } => device,
            kind => {
                return Err(RegisterError::UnsupportedKind {
                    index,
                    kind,
                    backend: BACKEND,
                })
            }
        };
        let backend = |e: IpcError| RegisterError::Backend {
            index,
            source: boxed(e),
        };
        if device != self.gpu.ordinal() {
            return Err(backend(IpcError::WrongDevice {
                region: device,
                endpoint: self.gpu.ordinal(),
            }));
        }
        self.gpu.bind().map_err(|e| backend(e.into()))?;
        let addr = region.addr() as u64;
        let (mut base, mut size) = (0, 0);
        // SAFETY: valid out-pointers; the driver checks that `addr` is device memory.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, addr)
        })
        .map_err(|e| backend(e.into()))?;
        if addr + region.len() > base + size as u64 {
            return Err(backend(IpcError::Cuda(CudaError::Invalid(format!(
                "region {index} ({} bytes at {addr:#x}) runs past its allocation ({size} bytes at {base:#x})",
                region.len()
            )))));
        }
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `base` is the start of a live cuMemAlloc allocation (reported by the driver).
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&raw mut handle, base)
        })
        .map_err(|e| backend(e.into()))?;
        let desc = RegionDesc {
            index,
            kind: region.kind(),
            addr,
            len: region.len(),
            key: 0,
        };
        self.regions.insert(
            index,
            Local {
                region,
                handle: handle.reserved.map(|b| b as u8),
                offset: addr - base,
            },
        );
        Ok(desc)
    }

    fn deregister(&mut self, index: u32) -> Result<(), DeregisterError> {
        self.ledger.deregister(&mut self.regions, index)
    }

    fn local_desc(&self) -> EndpointDesc {
        EndpointDesc {
            backend: BACKEND.to_owned(),
            provider: String::new(),
            address: self.address().encode(),
            notice_slot: None,
            board: None,
            regions: self
                .regions
                .values()
                .map(|l| RegionDesc {
                    index: l.region.index(),
                    kind: l.region.kind(),
                    addr: l.region.addr() as u64,
                    len: l.region.len(),
                    key: 0,
                })
                .collect(),
        }
    }

    fn connect(&mut self, desc: &EndpointDesc) -> Result<PeerId, ConnectError> {
        desc.validate().map_err(ConnectError::BadDescription)?;
        if desc.backend != BACKEND {
            return Err(ConnectError::Mismatch {
                expected: BACKEND.to_owned(),
                found: format!("{}/{}", desc.backend, desc.provider),
            });
        }
        let bad = |e: IpcError| ConnectError::BadAddress { source: boxed(e) };
        let address = Address::decode(&desc.address).map_err(bad)?;
        let same_process = address.who.is_this_process();
        let existing = self.peers.iter().position(|p| {
            p.as_ref().is_some_and(|p| {
                p.socket == address.who.socket && p.incarnation == address.who.incarnation
            })
        });
        let id = match existing {
            Some(i) => i,
            None => {
                let link = Link::connect(&address.who.socket, None).map_err(|e| {
                    ConnectError::Unreachable {
                        source: boxed(socket_error("connecting to the peer")(e)),
                    }
                })?;
                let stream = Stream::new(&self.gpu).map_err(|e| bad(e.into()))?;
                self.peers.push(Some(Peer {
                    socket: address.who.socket.clone(),
                    pid: address.who.pid,
                    incarnation: address.who.incarnation,
                    link,
                    regions: HashMap::new(),
                    mappings: HashMap::new(),
                    stream,
                    kernels: None,
                    kernels_unavailable: false,
                    unflushed: Vec::new(),
                    last_on_kernels: false,
                }));
                self.peers.len() - 1
            }
        };
        let gpu = Arc::clone(&self.gpu);
        let Some(peer) = self.peers[id].as_mut() else {
            return Err(bad(IpcError::PeerClosed));
        };
        let handles: HashMap<u32, &ExportedRegion> =
            address.regions.iter().map(|r| (r.index, r)).collect();
        let mut regions = HashMap::new();
        for region in &desc.regions {
            let addr = if same_process || peer.pid == std::process::id() {
                region.addr
            } else {
                let exported = handles.get(&region.index).ok_or_else(|| {
                    bad(IpcError::Address(AddressError::MissingRegion(region.index)))
                })?;
                let base = match peer.mappings.entry(exported.handle) {
                    std::collections::hash_map::Entry::Occupied(m) => m.get().base,
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        gpu.bind().map_err(|e| bad(e.into()))?;
                        let handle = sys::CUipcMemHandle {
                            reserved: exported.handle.map(|b| b as std::ffi::c_char),
                        };
                        let mut base = 0;
                        // SAFETY: valid out-pointer; the driver validates the handle (a stale or
                        // foreign one is an error, not undefined behaviour). Closed in
                        // Mapping::drop.
                        check("cuIpcOpenMemHandle", unsafe {
                            sys::cuIpcOpenMemHandle_v2(
                                &raw mut base,
                                handle,
                                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                            )
                        })
                        .map_err(|e| bad(e.into()))?;
                        slot.insert(Mapping {
                            gpu: Arc::clone(&gpu),
                            base,
                        });
                        base
                    }
                };
                base + exported.offset
            };
            regions.insert(region.index, (addr, region.len));
        }
        peer.regions = regions;
        Ok(PeerId(id as u32))
    }

    fn disconnect(&mut self, peer: PeerId) {
        // Its posted copies get their completion events first (with handles on its socket for
        // their notices); dropping it then waits on its streams for them to end before its
        // mappings of the peer's memory close (`Peer::drop`). Its slot stays empty: ids are
        // not reused.
        self.flush();
        if let Some(slot) = self.peers.get_mut(peer.0 as usize) {
            drop(slot.take());
        }
    }

    fn write(
        &mut self,
        peer: PeerId,
        ops: &[CopyOp],
        notice: Option<Notice>,
    ) -> Result<OpId, WriteError> {
        let Some(p) = self.peers.get(peer.0 as usize).and_then(Option::as_ref) else {
            return Err(WriteError::UnknownPeer(peer));
        };
        let bytes = crate::validate::check_ops(
            ops,
            |r| self.regions.get(&r).map(|l| l.region.len()),
            |r| p.regions.get(&r).map(|x| x.1),
        )?;
        if !self.peer_mut(peer).is_some_and(|p| p.link.alive()) {
            return Ok(self.ledger.done_now(peer, OpKind::Write, Err(peer_gone())));
        }
        self.post(peer, OpKind::Write, ops, notice, bytes)
            .map_err(WriteError::Backend)
    }

    fn read(&mut self, peer: PeerId, ops: &[CopyOp]) -> Result<OpId, ReadError> {
        let Some(p) = self.peers.get(peer.0 as usize).and_then(Option::as_ref) else {
            return Err(ReadError::UnknownPeer(peer));
        };
        let bytes = crate::validate::check_ops(
            ops,
            |r| p.regions.get(&r).map(|x| x.1),
            |r| self.regions.get(&r).map(|l| l.region.len()),
        )?;
        if !self.peer_mut(peer).is_some_and(|p| p.link.alive()) {
            return Ok(self.ledger.done_now(peer, OpKind::Read, Err(peer_gone())));
        }
        self.post(peer, OpKind::Read, ops, None, bytes)
            .map_err(ReadError::Backend)
    }

    fn send(&mut self, peer: PeerId, message: &[u8]) -> Result<OpId, SendError> {
        let link = self
            .peers
            .get_mut(peer.0 as usize)
            .and_then(Option::as_mut)
            .map(|p| &mut p.link);
        same_host::send(link, &mut self.ledger, peer, message)
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, PollError> {
        self.poll_now(events)
    }

    fn wait(&mut self, events: &mut Vec<Event>, timeout: Duration) -> Result<usize, PollError> {
        same_host::wait(self, events, timeout)
    }

    fn waker(&self) -> Option<Arc<dyn Waker>> {
        Some(self.control.completions())
    }
}
