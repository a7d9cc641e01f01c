//! `--target-uncertainty` and `--verify-invariance` end to end on SmolLM2
//! (CPU, 64-token chunks of the head of wiki.test.raw: 43 windows).

mod common;

use std::process::Command;

use serde_json::Value;

fn head_text(dir: &std::path::Path) -> std::path::PathBuf {
    let text = std::fs::read_to_string(common::data_root().join("wikitext-2-raw/wiki.test.raw")).unwrap();
    let cut = text[..12_000].rfind('\n').unwrap() + 1;
    let p = dir.join("wiki-head.txt");
    std::fs::write(&p, &text[..cut]).unwrap();
    p
}

fn score(text: &std::path::Path, out: &std::path::Path, extra: &[&str]) -> Value {
    let model = common::models_dir().join("SmolLM2-135M-Instruct.Q4_1.ninfer");
    let o = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
        .arg(&model)
        .args(["--text".as_ref(), text.as_os_str(), "--output".as_ref(), out.as_os_str()])
        .args(["--method", "chunks", "--context", "64", "--backend", "cpu", "--log-level", "warn"])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap()
}

#[test]
fn early_stop_scores_a_seeded_sample_until_the_half_width() {
    let tmp = tempfile::tempdir().unwrap();
    let text = head_text(tmp.path());
    let r = score(&text, &tmp.path().join("stop"), &["--target-uncertainty", "0.3"]);
    let e = &r["results"]["early_stop"];
    let (planned, scored) = (e["n_windows_planned"].as_u64().unwrap(), e["n_windows_scored"].as_u64().unwrap());
    assert_eq!(planned, 43, "{e}");
    assert!(e["stopped_early"].as_bool().unwrap() && (10..planned).contains(&scored), "{e}");
    let half = e["half_width"].as_f64().unwrap();
    assert!(half < 0.3, "{e}");
    assert!(e["reason"].as_str().unwrap().contains("fell below --target-uncertainty 0.3"), "{e}");
    // The report holds exactly the scored windows, in plan order, not a prefix of the plan.
    let windows = r["results"]["streams"][0]["windows"].as_array().unwrap();
    assert_eq!(windows.len() as u64, scored);
    let idx: Vec<u64> = windows.iter().map(|w| w["index"].as_u64().unwrap()).collect();
    assert!(idx.windows(2).all(|p| p[0] < p[1]), "{idx:?}");
    assert_ne!(idx, (0..scored).collect::<Vec<_>>(), "a seeded sample, not the first windows");
    // The half-width is the overall clustered SE's, over those windows.
    let o = &r["results"]["overall"];
    assert_eq!(o["n_windows"].as_u64().unwrap(), scored);
    let se = o["mean_nll_se_clustered"].as_f64().unwrap();
    assert!((1.959963984540054 * se - half).abs() < 1e-12 * half.max(1.0), "{se} {half}");

    // A target no sample reaches: every window, and the report says why.
    let all = score(&text, &tmp.path().join("all"), &["--target-uncertainty", "1e-9"]);
    let e = &all["results"]["early_stop"];
    assert!(!e["stopped_early"].as_bool().unwrap() && e["n_windows_scored"].as_u64() == Some(43), "{e}");
    assert!(e["reason"].as_str().unwrap().contains("every window was scored"), "{e}");
    // The same windows as a plain run, hence the same pooled figures up to summation order.
    let plain = score(&text, &tmp.path().join("plain"), &[]);
    let (a, b) = (&all["results"]["overall"], &plain["results"]["overall"]);
    assert_eq!(a["scored_tokens"], b["scored_tokens"]);
    let (ma, mb) = (a["mean_nll"].as_f64().unwrap(), b["mean_nll"].as_f64().unwrap());
    assert!((ma - mb).abs() < 1e-12, "{ma} {mb}");
    assert!(plain["results"].get("early_stop").is_none());
}

#[test]
fn batch_invariance_is_exact_on_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let text = head_text(tmp.path());
    let r = score(&text, &tmp.path().join("inv"), &["--chunks", "6", "--verify-invariance", "5"]);
    let v = &r["results"]["invariance"];
    assert_eq!((v["n_windows"].as_u64(), v["n_targets"].as_u64()), (Some(5), Some(5 * 31)), "{v}");
    assert_eq!(v["batched_windows_per_pass"].as_u64(), Some(6), "the six windows share one pass: {v}");
    // The CPU backend reduces each window alone in f64: batching changes nothing, bit for bit.
    assert_eq!(v["max_abs_dnll"].as_f64(), Some(0.0), "{v}");
    assert_eq!(v["max_kl"].as_f64(), Some(0.0), "{v}");
    assert_eq!(v["n_top1_changed"].as_u64(), Some(0), "{v}");
    assert_eq!(v["max_abs_window_nll_sum_diff_vs_run"].as_f64(), Some(0.0), "the rescore reproduces the run: {v}");
}

/// Issue 15 item 6 with a reference: early stop on the clustered 95 %
/// half-width of the mean KL. The reference is SmolLM2 with f32 KV
/// (`--lossless`), the runs use fp8 KV; the target is 3x the half-width of
/// the full 43-window run, which a sample of 10 to 42 windows reaches.
#[test]
fn early_stop_on_mean_kl_against_a_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let text = head_text(tmp.path());
    let reference = tmp.path().join("ref.topk");
    score(&text, &tmp.path().join("ref"), &["--lossless", "--save-top-tokens", reference.to_str().unwrap()]);
    let full = score(&text, &tmp.path().join("full"), &["--kl-reference", reference.to_str().unwrap()]);
    let full_half = 1.959963984540054 * full["results"]["kl_divergence"]["mean_se_clustered"].as_f64().unwrap();
    assert!(full_half > 0.0);
    let target = 3.0 * full_half;
    let x = format!("{target:e}");
    let r = score(&text, &tmp.path().join("stop"), &["--kl-reference", reference.to_str().unwrap(), "--target-uncertainty", &x]);
    let e = &r["results"]["early_stop"];
    let scored = e["n_windows_scored"].as_u64().unwrap();
    assert_eq!(e["statistic"], "mean KL", "{e}");
    assert!(e["stopped_early"].as_bool().unwrap() && (10..43).contains(&scored), "{e}");
    assert!(e["reason"].as_str().unwrap().contains("overall mean KL"), "{e}");
    let half = e["half_width"].as_f64().unwrap();
    assert!(half < target, "{e}");
    // The report's KL is pooled over exactly the scored windows; its clustered SE gives the half-width
    // (pooled in plan order there, in the early-stop order here: equal up to summation order).
    let kl = &r["results"]["kl_divergence"];
    let windows = r["results"]["streams"][0]["windows"].as_array().unwrap();
    assert_eq!(windows.len() as u64, scored);
    let n_positions: u64 = windows.iter().map(|w| w["kl_divergence"]["sums"]["positions"].as_u64().unwrap()).sum();
    assert_eq!(kl["positions"].as_u64().unwrap(), n_positions);
    let se = kl["mean_se_clustered"].as_f64().unwrap();
    assert!((1.959963984540054 * se - half).abs() < 1e-9 * half, "{se} {half}");
    assert!(kl["quantiles"]["p50"].is_number() && kl["mean"].as_f64().unwrap() > 0.0);
}
