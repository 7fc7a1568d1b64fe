//! PCIe topology: being written.
