//! Small shared helpers around the file system and the process: atomic file
//! output (`fs`), the checks every output passes before any work and the
//! exclusive claim of an output folder (`outputs`), and SIGINT/SIGTERM
//! handling at safe points (`signal`), serde helpers for report floats
//! (`json`).

pub mod fs;
pub mod json;
pub mod outputs;
pub mod signal;
