//! Locations of the data the integration tests read: the real models
//! (`INFERNIX_MODELS`, else `models/`, filled by `scripts/fetch-models.sh`),
//! the corpora (`INFERNIX_DATA`, else the bundled `eval/corpora/ppl-v1`) and
//! the reference figures (`INFERNIX_REFERENCE`, else the repository's
//! `tests/data/reference`, whose README gives their provenance). A missing
//! location fails the test with the variable to set: nothing is skipped.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

pub mod reports;

fn located(var: &str, default: &str, what: &str) -> PathBuf {
    let p = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(default));
    assert!(p.exists(), "{what} not found at {} (set {var}, or run scripts/fetch-models.sh)", p.display());
    p
}

pub fn models_dir() -> PathBuf {
    located("INFERNIX_MODELS", "models", "model folder")
}

pub fn data_root() -> PathBuf {
    located("INFERNIX_DATA", "eval/corpora/ppl-v1", "corpus data root")
}

pub fn reference_dir() -> PathBuf {
    located("INFERNIX_REFERENCE", "tests/data/reference", "reference folder")
}

pub const SMOLLM2_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GEMMA3_GGUF: &str = "gemma-3-270m-q4_k_m.gguf";

pub fn model(file: &str) -> PathBuf {
    let p = models_dir().join(file);
    assert!(p.exists(), "{} missing: run scripts/fetch-models.sh", p.display());
    p
}

/// Runs the evaluator binary with `args` and waits for it.
pub fn run(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_infernix-perplexity")).args(args).output().expect("run infernix-perplexity")
}

/// `x` as an argument of [`run`].
pub fn os<S: AsRef<std::ffi::OsStr> + ?Sized>(s: &S) -> &std::ffi::OsStr {
    s.as_ref()
}
