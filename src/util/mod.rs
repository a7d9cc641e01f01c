//! Small shared helpers around the file system and the process: atomic file
//! output (`fs`), the checks every output passes before any work and the
//! exclusive claim of an output folder (`outputs`), and SIGINT/SIGTERM
//! handling at safe points (`signal`).

pub mod fs;
pub mod outputs;
pub mod signal;
