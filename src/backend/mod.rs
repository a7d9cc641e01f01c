//! Compute backends for the model forward pass: `cpu` (the reference) and
//! `cuda` (hand-written kernels loaded as PTX through the CUDA driver API).
//! This module owns the backend seam; each submodule owns its device.

pub mod cuda;
