//! The CUDA backend: kernels from `kernels/*.cu`, compiled to PTX by
//! `build.rs`, loaded through the driver API (cudarc, libcuda loaded at run
//! time so the binary starts on machines without CUDA).
//!
//! `device` opens a GPU (driver probe first: "no CUDA driver found" is an
//! error, never a panic) and loads every module; `buffer` holds device memory
//! and weight matrices in their stored formats; `ops` has one typed launcher
//! per kernel family; `backend` implements the backend seam on top of them
//! (the model's forward pass, two numeric routes); `moe` the routed experts (grouped by expert); `delta_net` Qwen3-Next's Gated DeltaNet step and sigmoid gates; `profile` times its ops per
//! family with CUDA events when asked (`INFERNIX_CUDA_PROFILE=1`). A binary built without nvcc still compiles this module;
//! every entry point then reports "built without CUDA kernels".

pub mod backend;
pub mod buffer;
pub mod delta_net;
pub mod device;
pub mod moe;
pub mod ops;
pub mod profile;
pub mod ptx;

pub use backend::{CudaBackend, FastPathUse, Route, RouteOptions};
pub use buffer::{DevView, DevViewMut, DeviceBuffer, Elem, QuantMatrix};
pub use device::{device_count, driver_present, driver_version, CudaDevice, DeviceInfo, NO_KERNELS};
pub use ptx::{build_info, source_file_hashes, KernelBuildInfo};
