//! The end-to-end workloads shared by `tests/gpu_e2e.rs` (which scores them on
//! the GPU) and `tests/gpu_golden.rs` (which scores them with the CPU backend
//! and writes the golden file): both real models, `wiki.test.raw` as
//! llama.cpp tokenizes it, planned by `plan::plan_windows` exactly as the
//! evaluator binary plans them.
#![allow(dead_code)]

use std::path::PathBuf;

use infernix_perplexity::artifact::Artifact;
use infernix_perplexity::plan::{plan_windows, Method, Window};
use infernix_perplexity::text::tokenizer::{token_ids_sha256, TextTokenizer};
use serde::{Deserialize, Serialize};

#[path = "../common/mod.rs"]
mod common;

pub use common::{data_root, models_dir, reference_dir};

/// One real model.
pub struct Model {
    /// Short name used in the golden file.
    pub key: &'static str,
    pub gguf: &'static str,
    /// The exact float64 reference of the c=512 chunks (shared/reference).
    pub exact_f64: &'static str,
}

pub const MODELS: [Model; 2] = [
    Model { key: "smollm2", gguf: common::SMOLLM2_GGUF, exact_f64: "exact-f64-smollm2-wiki-test-c512.txt" },
    Model { key: "gemma3", gguf: common::GEMMA3_GGUF, exact_f64: "exact-f64-gemma3-wiki-test-c512.txt" },
];

/// One window protocol with the number of windows the tests score.
pub struct Protocol {
    pub key: &'static str,
    pub method: Method,
    pub n_windows: usize,
}

pub const PROTOCOLS: [Protocol; 2] = [
    Protocol { key: "chunks512", method: Method::Chunks { context: 512 }, n_windows: 40 },
    Protocol { key: "sliding4096", method: Method::Sliding { context: 4096, stride: 2048 }, n_windows: 4 },
];

/// The artifact of a model: `<gguf stem>.ninfer` in the models folder
/// (`scripts/fetch-models.sh` makes it).
pub fn artifact(m: &Model) -> Artifact {
    let stem = m.gguf.trim_end_matches(".gguf");
    let path: PathBuf = models_dir().join(format!("{stem}.ninfer"));
    assert!(path.exists(), "{} missing: run scripts/fetch-models.sh", path.display());
    Artifact::open(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()))
}

/// wiki.test.raw tokenized by the artifact's tokenizer, checked against
/// llama.cpp's token-id hash (shared/reference/llama-cpp-token-ids.txt).
pub fn wiki_tokens(m: &Model, art: &Artifact) -> Vec<u32> {
    let text_path = data_root().join("wikitext-2-raw/wiki.test.raw");
    let bytes = std::fs::read(&text_path).unwrap_or_else(|e| panic!("{}: {e}", text_path.display()));
    let text = String::from_utf8(bytes).expect("wiki.test.raw is UTF-8");
    let tok = TextTokenizer::from_json(art.tokenizer_json(), &art.meta.tokenizer).expect("tokenizer");
    let ids = tok.encode(&text).expect("encode");
    let ref_path = reference_dir().join("llama-cpp-token-ids.txt");
    let refs = std::fs::read_to_string(&ref_path).unwrap_or_else(|e| panic!("{}: {e}", ref_path.display()));
    let line = refs
        .lines()
        .find(|l| l.starts_with(m.gguf) && l.contains("wikitext-2-raw/wiki.test.raw"))
        .unwrap_or_else(|| panic!("{}: no line for {}", ref_path.display(), m.gguf));
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(ids.len().to_string(), f[2], "{}: token count differs from llama.cpp", m.gguf);
    assert_eq!(token_ids_sha256(&ids), f[3], "{}: token ids differ from llama.cpp", m.gguf);
    ids
}

/// The windows of a protocol with their input tokens (BOS substituted) and
/// the index of the first target inside the window.
pub fn windows(art: &Artifact, tokens: &[u32], p: &Protocol) -> Vec<(Window, Vec<u32>, usize)> {
    let bos = art.meta.tokenizer.add_bos.then_some(art.meta.tokenizer.bos_id).flatten();
    plan_windows(tokens.len(), &p.method, bos, Some(p.n_windows))
        .expect("plan")
        .into_iter()
        .map(|w| {
            let mut t = tokens[w.begin..w.end].to_vec();
            if w.replace_first_with_bos {
                t[0] = bos.expect("bos");
            }
            let first = w.first_target - w.begin;
            (w, t, first)
        })
        .collect()
}

/// Per-window scores of one (model, protocol).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WindowGolden {
    pub begin: usize,
    pub end: usize,
    pub n_scored: usize,
    /// Σ NLL over the window's targets (nats).
    pub nll_sum: f64,
}

/// The golden file: CPU-backend scores of every (model, protocol).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Golden {
    pub source: String,
    /// key "<model>/<protocol>" -> windows
    pub runs: std::collections::BTreeMap<String, Vec<WindowGolden>>,
}

pub fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/gpu_e2e_cpu_golden.json")
}

/// Mean NLL per chunk of the exact float64 reference file.
pub fn exact_f64(m: &Model) -> Vec<f64> {
    let path = reference_dir().join(m.exact_f64);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| l.split_whitespace().nth(2).expect("3 columns").parse().expect("mean NLL"))
        .collect()
}
