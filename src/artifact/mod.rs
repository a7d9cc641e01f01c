//! The `.ninfer` v3 container: format table, metadata schema, reader (mmap,
//! validation, typed tensor views) and writer. See `docs/ninfer-v3.md`.

pub mod check;
pub mod container;
pub mod format;
pub mod meta;
pub mod names;
pub mod reader;
pub mod writer;

pub use format::TensorFormat;
pub use meta::{Architecture, ArtifactMeta, HParams};
pub use reader::{Artifact, TensorView};
