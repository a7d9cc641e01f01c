//! The CPU backend against the exact float64 reference
//! (`shared/reference/exact-f64-*-wiki-test-c512.txt`: transformers in
//! float64 on the dequantized GGUF, fed llama.cpp's token ids and chunks).
//!
//! Protocol (llama.cpp `perplexity`, c = 512): chunk k is
//! `tokens[512k .. 512k + 512)` of `wiki.test.raw`, its first token replaced
//! by BOS when the vocabulary adds one (Gemma-3: id 2; SmolLM2 adds none),
//! targets are chunk positions 257..=511 (255 per chunk).
//!
//! Token ids come from the artifact's own tokenizer and are checked against
//! llama.cpp's (count and SHA-256 in `llama-cpp-token-ids.txt`) first.
//!
//! The quick tests run the first 4 chunks of each model, and check that two
//! runs are bit-identical and that prefilling a window in passes gives the
//! same scores. The full check (40 chunks, overall perplexity within 0.01 %)
//! is ignored by default; run it with
//! `cargo test --release --test cpu_reference -- --ignored --nocapture`
//! (about 5 minutes on 2 cores).

mod common;

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use infernix_perplexity::artifact::Artifact;
use infernix_perplexity::backend::cpu::CpuBackend;
use infernix_perplexity::convert::{self, ConvertOptions};
use infernix_perplexity::model::{ScoreOptions, Transformer, WindowScorer};
use infernix_perplexity::text::tokenizer::{token_ids_sha256, TextTokenizer};

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
    static DIR: OnceLock<Mutex<tempfile::TempDir>> = OnceLock::new();
    let dir = DIR.get_or_init(|| Mutex::new(tempfile::tempdir().expect("temp dir")));
    // Held while converting, so parallel tests convert each model once.
    let dir = dir.lock().unwrap_or_else(|e| e.into_inner());
    let out = dir.path().join(format!("{gguf}.ninfer"));
    if !out.exists() {
        convert::convert(&common::model(gguf), &out, &ConvertOptions::default()).expect("convert");
    }
    Artifact::open(&out).expect("open artifact")
}

/// llama.cpp's token ids of wiki.test.raw for this model, from the
/// artifact's tokenizer, checked against `llama-cpp-token-ids.txt`.
fn wiki_tokens(case: &Case, art: &Artifact) -> Vec<u32> {
    let text_path = common::data_root().join("wikitext-2-raw/wiki.test.raw");
    let bytes = std::fs::read(&text_path).unwrap_or_else(|e| panic!("{}: {e}", text_path.display()));
    let text = String::from_utf8(bytes).expect("wiki.test.raw is UTF-8");
    let tok = TextTokenizer::from_json(art.tokenizer_json(), &art.meta.tokenizer).expect("tokenizer");
    let ids = tok.encode(&text).expect("encode");
    let ref_path = common::reference_dir().join("llama-cpp-token-ids.txt");
    let refs = std::fs::read_to_string(&ref_path).unwrap_or_else(|e| panic!("{}: {e}", ref_path.display()));
    let line = refs
        .lines()
        .find(|l| l.starts_with(case.gguf) && l.contains("wikitext-2-raw/wiki.test.raw"))
        .unwrap_or_else(|| panic!("{}: no line for {}", ref_path.display(), case.gguf));
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(ids.len().to_string(), f[2], "{}: token count differs from llama.cpp", case.gguf);
    assert_eq!(token_ids_sha256(&ids), f[3], "{}: token ids differ from llama.cpp", case.gguf);
    ids
}

/// Chunk `k` of the stream, BOS in front when the vocabulary adds one.
fn chunk(case: &Case, tokens: &[u32], k: usize) -> Vec<u32> {
    let mut c = tokens[k * CTX..(k + 1) * CTX].to_vec();
    if let Some(bos) = case.bos {
        c[0] = bos;
    }
    c
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
    assert_eq!(art.meta.tokenizer.add_bos, case.bos.is_some(), "{}: BOS policy", case.gguf);
    let tokens = wiki_tokens(case, &art);
    let mut model = Transformer::load(CpuBackend::default(), &art).expect("load");
    (0..n_chunks)
        .map(|k| {
            let t = std::time::Instant::now();
            let scores = model.score_window(&chunk(case, &tokens, k), FIRST_TARGET, opts, &[]).expect("score");
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
    let ppl = (got.iter().sum::<f64>() / 40.0).exp();
    // The same figure from the reference file's own per-chunk means, unrounded.
    let exact = (reference(case)[..40].iter().sum::<f64>() / 40.0).exp();
    let rel = (ppl / exact - 1.0).abs();
    eprintln!(
        "{}: 40-chunk PPL {ppl:.7} vs exact {exact:.7} (README {}), relative difference {rel:.2e}",
        case.gguf, case.ppl_40
    );
    assert!(rel < 1e-4, "{}: PPL {ppl} vs {exact} ({:.4} %)", case.gguf, rel * 100.0);
    assert!((exact - case.ppl_40).abs() < 1e-4, "{}: reference file gives {exact}, README {}", case.gguf, case.ppl_40);
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

/// Two runs of the same window give bit-identical scores (top-k included),
/// and prefilling it in passes of 128 tokens gives the same NLLs as one pass
/// (within 1e-6: the summation grouping of a few products may differ).
#[test]
fn smollm2_runs_are_bit_identical_and_passes_agree() {
    let art = artifact(SMOLLM2.gguf);
    let tokens = wiki_tokens(&SMOLLM2, &art);
    let window = chunk(&SMOLLM2, &tokens, 1);
    let mut model = Transformer::load(CpuBackend::default(), &art).expect("load");
    let opts = ScoreOptions { top_k: 8, prefill_chunk: None };
    let a = model.score_window(&window, FIRST_TARGET, &opts, &[]).expect("score");
    let b = model.score_window(&window, FIRST_TARGET, &opts, &[]).expect("score");
    assert_eq!(a, b, "two runs differ");
    assert!(a.iter().all(|s| s.top.len() == 8 && s.top[0].1 as f64 == s.max_logit));
    let passes = ScoreOptions { top_k: 8, prefill_chunk: Some(128) };
    let c = model.score_window(&window, FIRST_TARGET, &passes, &[]).expect("score");
    assert_eq!(c.len(), a.len());
    for (j, (x, y)) in a.iter().zip(&c).enumerate() {
        assert!((x.nll - y.nll).abs() < 1e-6, "target {j}: one pass {} vs passes of 128 {}", x.nll, y.nll);
    }
}
