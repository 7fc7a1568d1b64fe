//! kvx-rdma: being written.
pub mod topology;
