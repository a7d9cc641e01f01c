//! No kernel edit lands unchecked on the GPU: every kernel source file
//! (`kernels/*.cu`, `*.cuh`) this build compiled must have the SHA-256 that
//! `tests/data/gpu_parity.json` records from the last passing device run of
//! the parity suite (`scripts/gpu-test.sh`, whose `KERNEL_FILE` lines print the
//! hashes of the binary that ran). Per file, so independent kernel changes are
//! recorded independently.
//!
//! After a kernel edit: build, run the parity suite on the device, and copy the
//! run's `KERNEL_FILE` hashes (with the run's date, device and result) into the
//! JSON file.

use std::collections::BTreeMap;

use infernix_perplexity::backend::cuda;
use serde::Deserialize;

#[derive(Deserialize)]
struct Record {
    files: BTreeMap<String, FileRecord>,
}

#[derive(Deserialize)]
struct FileRecord {
    sha256: String,
    /// Which device run checked this version (date, device, command, result).
    run: String,
}

#[test]
fn every_kernel_source_matches_its_last_recorded_device_run() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/gpu_parity.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let record: Record = serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {path}: {e}"));
    let built = cuda::source_file_hashes();
    assert!(!built.is_empty(), "the build recorded no kernel sources");
    let mut stale = Vec::new();
    for (file, sha) in built {
        match record.files.get(*file) {
            None => stale.push(format!("{file}: never run on the device (sha256 {sha})")),
            Some(r) if r.sha256 != *sha => {
                stale.push(format!("{file}: sha256 {sha}, the last device run ({}) checked {}", r.run, r.sha256))
            }
            Some(r) => assert!(!r.run.trim().is_empty(), "{file}: the record names no run"),
        }
    }
    for file in record.files.keys() {
        if !built.iter().any(|(f, _)| f == file) {
            stale.push(format!("{file}: recorded but no longer a kernel source"));
        }
    }
    assert!(
        stale.is_empty(),
        "kernel sources changed since their last recorded device parity run (run scripts/gpu-test.sh on the GPU \
         and record its KERNEL_FILE lines in tests/data/gpu_parity.json):\n  {}",
        stale.join("\n  ")
    );
}
