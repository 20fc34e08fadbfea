//! kvshard gds: the device-facing memory and copy layer.
//!
//! Nothing here needs CUDA to build or to run the CPU paths: the CUDA driver,
//! NVRTC and cuFile are loaded at run time, after a probe that finds out
//! whether they exist, so a host without a GPU gets a reason instead of a
//! panic.
pub mod cuda;
pub mod cufile;
pub mod devdax;
pub mod device;
pub mod kernel;
pub mod libfind;
pub mod nvrtc;
pub mod slab;
