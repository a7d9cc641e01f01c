//! Compute backends for the forward pass. `cpu` is the reference (the oracle).

pub mod cpu;
