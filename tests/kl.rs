//! `--save-top-tokens`, `--kl-reference` and `--save-tokens` end to end on
//! SmolLM2 (CPU, two chunks of 128 tokens): a run compared with its own
//! reference gives KL exactly 0, top-1 agreement 1 and NLL change 0; the
//! file costs 520 bytes a position; a reference recorded for another run is
//! refused before scoring with one line naming the first difference.

mod common;

use std::path::{Path, PathBuf};

use common::{data_root, os, run};
use infernix_perplexity::score::topk::{self, TopTokensReader};

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.ninfer";
const GEMMA3: &str = "gemma-3-270m-q4_k_m.ninfer";

fn read_report(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap()
}

/// The first ~30 KB of wiki.test.raw (cut at a line end): enough for two
/// 128-token chunks, quick to tokenize.
fn small_text(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(data_root().join("wikitext-2-raw/wiki.test.raw")).unwrap();
    let cut = text[..30_000].rfind('\n').unwrap() + 1;
    let p = dir.join("wiki-head.txt");
    std::fs::write(&p, &text[..cut]).unwrap();
    p
}

fn chunks_args<'a>(model: &'a Path, text: &'a Path, context: &'a str, chunks: &'a str) -> Vec<&'a std::ffi::OsStr> {
    vec![
        os(model),
        os("--text"),
        os(text),
        os("--method"),
        os("chunks"),
        os("--context"),
        os(context),
        os("--chunks"),
        os(chunks),
        os("--backend"),
        os("cpu"),
        // The exact route: the reference these tests compare with is f32 everywhere.
        os("--lossless"),
    ]
}

/// Expects exit 2, one stderr line holding every `expect`, no report.
fn assert_refused<'a>(mut args: Vec<&'a std::ffi::OsStr>, out: &'a Path, expect: &[&str]) {
    args.extend([os("--log-level"), os("error"), os("--output"), os(out)]);
    let o = run(&args);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "stderr: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line expected: {stderr}");
    for e in expect {
        assert!(stderr.contains(e), "expected {e:?} in {stderr}");
    }
    assert!(!out.join("report.json").exists());
}

#[test]
fn self_comparison_is_exactly_zero_and_mismatches_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::model(SMOLLM2);
    let text = small_text(tmp.path());
    let reference = tmp.path().join("ref.topk");
    let tokens = tmp.path().join("tokens.json");
    let (n_chunks, n_scored) = (2usize, 63usize); // c = 128: positions 64..126 predict 65..127

    // 1. Record the reference and the token list.
    let base_dir = tmp.path().join("base");
    let mut args = chunks_args(&model, &text, "128", "2");
    args.extend([os("--save-top-tokens"), os(&reference), os("--save-tokens"), os(&tokens), os("--output"), os(&base_dir)]);
    let o = run(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let base = read_report(&base_dir);
    assert!(base["results"].get("kl_divergence").is_none(), "no reference, no KL");

    // The file: K = 64, 520 bytes a position, the header's fingerprint as the run planned.
    let r = TopTokensReader::open(&reference).unwrap();
    let n_positions = n_chunks * n_scored;
    assert_eq!((r.k, r.header.n_positions), (64, n_positions));
    let fp = &r.header.fingerprint;
    assert_eq!((fp.method.as_str(), fp.context, fp.chunks_limit, fp.n_vocab), ("chunks", 128, Some(2), 49152));
    assert_eq!(fp.tokenizer_sha256, base["artifact"]["tokenizer_sha256"].as_str().unwrap());
    assert_eq!(fp.streams[0].token_ids_sha256, base["results"]["streams"][0]["token_ids_sha256"].as_str().unwrap());
    let n_header = serde_json::to_vec(&r.header).unwrap().len();
    let n_bytes = std::fs::metadata(&reference).unwrap().len() as usize;
    assert_eq!(n_bytes, topk::PREAMBLE_BYTES + n_header + n_positions * 520 + topk::TRAILER_BYTES);
    eprintln!(
        "top-tokens file: {n_bytes} bytes for {n_positions} positions = {:.1} bytes/position (records 520, header {n_header})",
        n_bytes as f64 / n_positions as f64
    );
    let saved = topk::read_saved_tokens(&tokens).unwrap();
    assert_eq!(&saved.fingerprint, fp);
    assert_eq!(saved.tokens[0].len(), n_chunks);
    assert_eq!(saved.tokens[0][0].len(), 128);

    // 2. Compare a second identical run with it: exactly zero.
    let kl_dir = tmp.path().join("kl");
    let mut args = chunks_args(&model, &text, "128", "2");
    args.extend([os("--kl-reference"), os(&reference), os("--output"), os(&kl_dir)]);
    let o = run(&args);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    for line in ["Mean PPL(Q)", "Mean ln(PPL(Q)/PPL(base))", "Mean    KLD:", "Same top p: 100.000", "RMS Δp"] {
        assert!(stderr.contains(line), "stderr lacks {line:?}: {stderr}");
    }
    let rep = read_report(&kl_dir);
    let kl = &rep["results"]["kl_divergence"];
    assert_eq!(kl["positions"], n_positions);
    assert_eq!(kl["n_nonfinite"], 0);
    assert_eq!(kl["mean"], 0.0);
    assert_eq!(kl["quantiles"]["max"], 0.0);
    assert_eq!(kl["top1_agreement"], 1.0);
    assert_eq!(kl["mean_nll_delta"], 0.0);
    assert_eq!(kl["delta_p_mean"], 0.0);
    assert_eq!(kl["delta_p_rms"], 0.0);
    assert_eq!(kl["n_confident_flips"], 0);
    assert_eq!(kl["reference"]["top_k"], 64);
    assert_eq!(kl["reference"]["sha256"].as_str().unwrap().len(), 64);
    assert!(kl["bound"].as_str().unwrap().starts_with("lower bound"));
    let mass = kl["mean_reference_top_mass"].as_f64().unwrap();
    assert!(mass > 0.5 && mass < 1.0, "top-64 mass {mass}");
    let buckets = kl["by_context"].as_array().unwrap();
    assert_eq!(buckets.len(), 1, "c = 128: every position in [0, 1024)");
    assert_eq!((buckets[0]["context_from"].as_u64(), buckets[0]["context_to"].as_u64()), (Some(0), Some(1024)));
    // The comparison does not move the run's own numbers.
    assert_eq!(rep["results"]["overall"], base["results"]["overall"]);
    let stream = &rep["results"]["streams"][0];
    assert_eq!(stream["kl_divergence"]["mean"], 0.0);
    assert!(stream["kl_divergence"]["quantiles"].is_object());
    for w in stream["windows"].as_array().unwrap() {
        assert_eq!(w["kl_divergence"]["positions"], n_scored);
        assert_eq!(w["kl_divergence"]["mean"], 0.0);
        assert!(w["kl_divergence"]["quantiles"].is_null() && w["kl_divergence"]["by_context"].is_null());
    }
    // KL's own-mean NLL is the run's, rounded through f32 log-probabilities.
    let own = kl["mean_nll"].as_f64().unwrap();
    let run_nll = rep["results"]["overall"]["mean_nll"].as_f64().unwrap();
    assert!((own - run_nll).abs() < 1e-6, "{own} vs {run_nll}");
    assert_eq!(kl["worst_positions"], serde_json::json!([]), "no position moved");

    // 2b. The CPU emulating the CUDA default route's bf16 roundings against
    // the same reference: every position moves a little; the report names
    // the ten that moved most.
    let emu_dir = tmp.path().join("emulated");
    let mut args = chunks_args(&model, &text, "128", "2");
    args.retain(|a| *a != os("--lossless"));
    args.extend([os("--emulate-bf16-tc"), os("--kv-dtype"), os("bf16"), os("--kl-reference"), os(&reference), os("--output"), os(&emu_dir)]);
    let o = run(&args);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(stderr.contains("Largest KLD:"), "{stderr}");
    let kl = &read_report(&emu_dir)["results"]["kl_divergence"];
    let mean = kl["mean"].as_f64().unwrap();
    assert!(mean > 1e-7 && mean < 1e-2, "bf16 rounding moves the distributions a little: mean KL {mean}");
    let worst = kl["worst_positions"].as_array().unwrap();
    assert_eq!(worst.len(), infernix_perplexity::score::kl::N_WORST_POSITIONS, "issue 15: the 50 positions that moved most");
    let kls: Vec<f64> = worst.iter().map(|w| w["kl"].as_f64().unwrap()).collect();
    assert!(kls.windows(2).all(|p| p[0] >= p[1]), "largest first: {kls:?}");
    let max = kl["quantiles"]["max"].as_f64().unwrap();
    assert!((kls[0] - max).abs() <= 1e-6 * max, "the first is the maximum: {} vs {max}", kls[0]);
    for w in worst {
        assert_eq!(w["stream"], "wiki-head.txt");
        let (window, token) = (w["window"].as_u64().unwrap(), w["token_index"].as_u64().unwrap());
        assert!(window < n_chunks as u64);
        assert!((window * 128 + 65..window * 128 + 128).contains(&token), "window {window} token {token}");
        assert_eq!(w["n_context"].as_u64().unwrap(), token - window * 128);
        let top = w["reference_top"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        let p_ref: Vec<f64> = top.iter().map(|t| t[1].as_f64().unwrap()).collect();
        assert!(p_ref.windows(2).all(|p| p[0] >= p[1]) && p_ref.iter().all(|&p| p > 0.0 && p <= 1.0), "{top:?}");
    }

    // 3. Refusals: one line naming the first difference, before any scoring.
    let out = |n: &str| tmp.path().join(n);
    let kl_ref = [os("--kl-reference"), os(&reference)];
    let dry = [os("--kl-reference"), os(&reference), os("--dry-run")];
    // Not --dry-run: the refusal comes before the model is loaded or anything scored.
    assert_refused(with(chunks_args(&model, &text, "256", "2"), &kl_ref), &out("r1"), &["--context: recorded with 128, this run uses 256"]);
    assert_refused(with(chunks_args(&model, &text, "128", "1"), &dry), &out("r2"), &["--chunks: recorded with 2, this run uses 1"]);
    let mut sliding = chunks_args(&model, &text, "128", "2");
    sliding[4] = os("sliding");
    sliding.extend([os("--stride"), os("64")]);
    assert_refused(with(sliding, &dry), &out("r3"), &["--method: recorded with chunks, this run uses sliding"]);
    let other_text = tmp.path().join("other.txt");
    let mut changed = std::fs::read_to_string(&text).unwrap();
    changed.insert_str(0, "Changed. ");
    std::fs::write(&other_text, changed).unwrap();
    assert_refused(with(chunks_args(&model, &other_text, "128", "2"), &dry), &out("r4"), &["input: recorded for text wiki-head.txt"]);
    let gemma = common::model(GEMMA3);
    assert_refused(with(chunks_args(&gemma, &text, "128", "2"), &dry), &out("r5"), &["tokenizer: recorded with tokenizer sha256"]);

    // Same settings, different tokens in a window: the header's window
    // fingerprint is altered (same length, so the file stays consistent).
    let bytes = std::fs::read(&reference).unwrap();
    let sha = &fp.streams[0].windows[1].tokens_sha256;
    let flipped: String = sha.chars().rev().collect();
    let at = bytes.windows(64).position(|w| w == sha.as_bytes()).unwrap();
    let mut altered = bytes.clone();
    altered[at..at + 64].copy_from_slice(flipped.as_bytes());
    let altered_path = tmp.path().join("altered.topk");
    std::fs::write(&altered_path, &altered).unwrap();
    assert_refused(
        with(chunks_args(&model, &text, "128", "2"), &[os("--kl-reference"), os(&altered_path), os("--dry-run")]),
        &out("r6"),
        &["stream 0 (wiki-head.txt) window 1: input tokens differ"],
    );

    // A truncated file.
    let truncated = tmp.path().join("truncated.topk");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    assert_refused(
        with(chunks_args(&model, &text, "128", "2"), &[os("--kl-reference"), os(&truncated), os("--dry-run")]),
        &out("r7"),
        &["truncated.topk", "truncated or not finished"],
    );

    // A matching reference passes a dry run.
    let ok = out("ok");
    let o = run(&with(chunks_args(&model, &text, "128", "2"), &[os("--kl-reference"), os(&reference), os("--dry-run"), os("--output"), os(&ok)]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn with<'a>(mut a: Vec<&'a std::ffi::OsStr>, extra: &[&'a std::ffi::OsStr]) -> Vec<&'a std::ffi::OsStr> {
    a.extend_from_slice(extra);
    a
}
