//! The CPU backend against the exact float64 reference
//! (`shared/reference/exact-f64-*-wiki-test-c512.txt`: transformers in
//! float64 on the dequantized GGUF, fed llama.cpp's token ids and chunks).
//!
//! Protocol (llama.cpp `perplexity`, c = 512): chunk k is
//! `tokens[512k .. 512k + 512)` of `wiki.test.raw`, its first token replaced
//! by BOS when the vocabulary adds one (Gemma-3: id 2; SmolLM2 adds none),
//! targets are chunk positions 257..=511 (255 per chunk).
//!
//! The quick tests run the first 4 chunks of each model. The full check
//! (40 chunks, overall perplexity within 0.01 %) is ignored by default; run it
//! with
//! `cargo test --release --test cpu_reference -- --ignored --nocapture`.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use infernix_perplexity::artifact::Artifact;
use infernix_perplexity::backend::cpu::CpuBackend;
use infernix_perplexity::convert::{self, ConvertOptions};
use infernix_perplexity::model::{ScoreOptions, Transformer};

const CTX: usize = 512;
const FIRST_TARGET: usize = CTX / 2 + 1;

struct Case {
    gguf: &'static str,
    reference: &'static str,
    /// BOS replacing each chunk's first token, when the vocabulary adds one.
    bos: Option<u32>,
    /// Overall perplexity of the first 40 chunks in the exact float64
    /// reference (shared/reference/README.md).
    ppl_40: f64,
}

const SMOLLM2: Case = Case {
    gguf: common::SMOLLM2_GGUF,
    reference: "exact-f64-smollm2-wiki-test-c512.txt",
    bos: None,
    ppl_40: 23.5115,
};
const GEMMA3: Case = Case {
    gguf: common::GEMMA3_GGUF,
    reference: "exact-f64-gemma3-wiki-test-c512.txt",
    bos: Some(2),
    ppl_40: 17.1290,
};

/// Converts the GGUF once per test process into a temporary artifact.
fn artifact(gguf: &str) -> Artifact {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    let dir = DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"));
    let out = dir.path().join(format!("{gguf}.ninfer"));
    if !out.exists() {
        convert::convert(&common::model(gguf), &out, &ConvertOptions::default()).expect("convert");
    }
    Artifact::open(&out).expect("open artifact")
}

/// llama.cpp's token ids of wiki.test.raw for this model.
fn wiki_tokens(case: &Case) -> Vec<u32> {
    let path = std::env::var_os(format!("SCRATCH_IDS_{}", if case.bos.is_some() { "GEMMA3" } else { "SMOLLM2" }))
        .map(PathBuf::from)
        .expect("scratch ids");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// (chunk, mean NLL) from a reference file: `chunk nll_sum mean_nll` lines.
fn reference(case: &Case) -> Vec<f64> {
    let path: PathBuf = common::reference_dir().join(case.reference);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .enumerate()
        .map(|(i, l)| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f[0].parse::<usize>().unwrap(), i, "{}: line {l:?}", path.display());
            f[2].parse().unwrap()
        })
        .collect()
}

/// Mean NLL of each of the first `n_chunks` chunks.
fn chunk_nlls(case: &Case, n_chunks: usize, opts: &ScoreOptions) -> Vec<f64> {
    let art = artifact(case.gguf);
    let mut model = Transformer::load(CpuBackend, &art).expect("load");
    let tokens = wiki_tokens(case);
    (0..n_chunks)
        .map(|k| {
            let mut chunk = tokens[k * CTX..(k + 1) * CTX].to_vec();
            if let Some(bos) = case.bos {
                chunk[0] = bos;
            }
            let t = std::time::Instant::now();
            let scores = model.score_window(&chunk, FIRST_TARGET, opts, &[]).expect("score");
            assert_eq!(scores.len(), CTX - FIRST_TARGET);
            let mean = scores.iter().map(|s| s.nll).sum::<f64>() / scores.len() as f64;
            eprintln!("{} chunk {k}: mean NLL {mean:.9} ({:.2} s)", case.gguf, t.elapsed().as_secs_f64());
            mean
        })
        .collect()
}

fn check_against_reference(case: &Case, n_chunks: usize) -> Vec<f64> {
    let want = reference(case);
    let got = chunk_nlls(case, n_chunks, &ScoreOptions::default());
    let diffs: Vec<f64> = got.iter().zip(&want).map(|(g, w)| g - w).collect();
    let worst = diffs.iter().map(|d| d.abs()).fold(0.0, f64::max);
    eprintln!("{}: {n_chunks} chunks, max |mean NLL - exact f64| = {worst:.3e}", case.gguf);
    for (k, d) in diffs.iter().enumerate() {
        assert!(d.abs() < 1e-4, "{} chunk {k}: mean NLL {} vs exact {} (diff {d:.3e})", case.gguf, got[k], want[k]);
    }
    got
}

#[test]
fn smollm2_first_chunks_match_exact_f64() {
    check_against_reference(&SMOLLM2, 4);
}

#[test]
fn gemma3_first_chunks_match_exact_f64() {
    check_against_reference(&GEMMA3, 4);
}

fn check_40(case: &Case) {
    let got = check_against_reference(case, 40);
    let ppl = (got.iter().sum::<f64>() / got.len() as f64).exp();
    let rel = (ppl / case.ppl_40 - 1.0).abs();
    eprintln!("{}: 40-chunk PPL {ppl:.6} vs exact {} ({:.4} %)", case.gguf, case.ppl_40, rel * 100.0);
    assert!(rel < 1e-4, "{}: PPL {ppl} vs {} ({:.4} %)", case.gguf, case.ppl_40, rel * 100.0);
}

#[test]
#[ignore = "slow: 40 chunks per model; run with --release -- --ignored"]
fn smollm2_40_chunks_match_exact_f64() {
    check_40(&SMOLLM2);
}

#[test]
#[ignore = "slow: 40 chunks per model; run with --release -- --ignored"]
fn gemma3_40_chunks_match_exact_f64() {
    check_40(&GEMMA3);
}

#[allow(dead_code)]
fn _unused(_: &Path) {}
