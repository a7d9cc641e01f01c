//! The CPU reference backend: plain loops, f64 reductions where they matter;
//! every optimised path elsewhere is checked against it.

pub mod dequant;
