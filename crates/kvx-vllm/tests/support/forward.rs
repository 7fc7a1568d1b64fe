//! `forward_transport!`: a test's transport wrapper (a struct with an `inner: Box<dyn
//! Transport>`) forwards what it does not change to the transport it wraps. The caller's scope
//! names `Arc`, `Duration`, `Capabilities`, `Event`, `LocalRegion`, `Notice`, `OpId` and
//! `PeerId`.

macro_rules! forward_transport {
    // `write` as it is.
    (writes) => {
        fn write(
            &mut self,
            peer: PeerId,
            ops: &[kvx_layout::CopyOp],
            notice: Option<Notice>,
        ) -> Result<OpId, kvx_rdma::WriteError> {
            self.inner.write(peer, ops, notice)
        }
    };
    // `poll` and `wait`, each counted first by `self.count()`.
    (polls counted) => {
        fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, kvx_rdma::PollError> {
            self.count();
            self.inner.poll(events)
        }
        fn wait(
            &mut self,
            events: &mut Vec<Event>,
            timeout: Duration,
        ) -> Result<usize, kvx_rdma::PollError> {
            self.count();
            self.inner.wait(events, timeout)
        }
    };
    // `poll` and `wait`, with the events they add passed through `self.$filter(events, first)`.
    (polls $filter:ident) => {
        fn poll(&mut self, events: &mut Vec<Event>) -> Result<usize, kvx_rdma::PollError> {
            let first = events.len();
            self.inner.poll(events)?;
            Ok(self.$filter(events, first))
        }
        fn wait(
            &mut self,
            events: &mut Vec<Event>,
            timeout: Duration,
        ) -> Result<usize, kvx_rdma::PollError> {
            let first = events.len();
            self.inner.wait(events, timeout)?;
            Ok(self.$filter(events, first))
        }
    };
    (connections) => {
        fn capabilities(&self) -> Capabilities {
            self.inner.capabilities()
        }
        forward_transport!(connections_only);
    };
    // `connect` and `disconnect`; the implementation says its own capabilities.
    (connections_only) => {
        forward_transport!(base);
        forward_transport!(reads);
        fn connect(
            &mut self,
            peer: &kvx_rdma::EndpointDesc,
        ) -> Result<PeerId, kvx_rdma::ConnectError> {
            self.inner.connect(peer)
        }
        fn disconnect(&mut self, peer: PeerId) {
            self.inner.disconnect(peer);
        }
    };
    // `read` as it is.
    (reads) => {
        fn read(
            &mut self,
            peer: PeerId,
            ops: &[kvx_layout::CopyOp],
        ) -> Result<OpId, kvx_rdma::ReadError> {
            self.inner.read(peer, ops)
        }
    };
    // What every wrapper forwards: registration, description, sends, the waker.
    (base) => {
        fn backend(&self) -> &'static str {
            self.inner.backend()
        }
        fn register(
            &mut self,
            region: LocalRegion,
        ) -> Result<kvx_core::RegionDesc, kvx_rdma::RegisterError> {
            self.inner.register(region)
        }
        fn deregister(&mut self, index: u32) -> Result<(), kvx_rdma::DeregisterError> {
            self.inner.deregister(index)
        }
        fn local_desc(&self) -> kvx_rdma::EndpointDesc {
            self.inner.local_desc()
        }
        fn send(&mut self, peer: PeerId, message: &[u8]) -> Result<OpId, kvx_rdma::SendError> {
            self.inner.send(peer, message)
        }
        fn waker(&self) -> Option<Arc<dyn kvx_rdma::Waker>> {
            self.inner.waker()
        }
    };
}
