//! Small shared helpers: atomic file output.

pub mod fs;
