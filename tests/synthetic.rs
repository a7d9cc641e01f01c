//! `--synthetic`: seeded random weights with a real shape, written as an
//! artifact and as a GGUF twin holding the same bytes; same seed, same
//! artifact; the model runs and gives finite scores.

mod common;

use common::{model, SMOLLM2_GGUF};
use infernix_perplexity::artifact::container::sha256_hex;
use infernix_perplexity::artifact::{Artifact, TensorFormat};
use infernix_perplexity::backend::BackendKind;
use infernix_perplexity::convert::gguf::GgufFile;
use infernix_perplexity::convert::synthetic::{geometry, write_synthetic};
use infernix_perplexity::model::{load_model, ScoreOptions};

#[test]
fn synthetic_smollm2_shape_with_gguf_twin() {
    let tmp = tempfile::tempdir().unwrap();
    let geo = geometry("smollm2-135m").unwrap();
    let (a_path, g_path) = (tmp.path().join("s.ninfer"), tmp.path().join("s.gguf"));
    let meta = write_synthetic(&geo, TensorFormat::Q8_0, 7, &model(SMOLLM2_GGUF), &a_path, Some(&g_path)).unwrap();
    assert_eq!(meta.provenance.synthetic.as_ref().unwrap()["seed"], 7);
    let a = Artifact::open(&a_path).unwrap();
    a.verify().unwrap();
    assert_eq!(a.meta.hparams.n_layers, 30);
    assert_eq!(a.tensor("blk.3.attn_k.weight").unwrap().entry.shape, vec![192, 576]);
    assert_eq!(a.tensor("blk.3.ffn_down.weight").unwrap().format(), TensorFormat::Q8_0);

    // The twin holds the same bytes under the same names.
    let g = GgufFile::open(&g_path).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.tensors.len(), a.meta.tensors.len());
    for t in &g.tensors {
        let v = a.tensor(&t.name).unwrap();
        assert_eq!(t.shape(), v.entry.shape, "{}", t.name);
        assert_eq!(sha256_hex(g.tensor_bytes(t)), v.entry.sha256, "{}", t.name);
    }

    // Same seed, same artifact; another seed, other weights.
    let again = tmp.path().join("again.ninfer");
    write_synthetic(&geo, TensorFormat::Q8_0, 7, &model(SMOLLM2_GGUF), &again, None).unwrap();
    assert_eq!(Artifact::open(&again).unwrap().digest, a.digest);
    let other = tmp.path().join("other.ninfer");
    write_synthetic(&geo, TensorFormat::Q8_0, 8, &model(SMOLLM2_GGUF), &other, None).unwrap();
    let o = Artifact::open(&other).unwrap();
    assert_ne!(o.tensor("blk.0.attn_q.weight").unwrap().entry.sha256, a.tensor("blk.0.attn_q.weight").unwrap().entry.sha256);

    // It runs: random weights give finite scores near ln(n_vocab).
    let mut m = load_model(&a, BackendKind::Cpu(Default::default()), 1.0).unwrap();
    let tokens: Vec<u32> = (0..64u32).map(|i| i * 701 % 49152).collect();
    let s = m.score_window(&tokens, 1, &ScoreOptions::default(), &[]).unwrap();
    assert_eq!(s.len(), 63);
    let mean = s.iter().map(|r| r.nll).sum::<f64>() / s.len() as f64;
    assert!(mean.is_finite() && mean > 1.0 && mean < 40.0, "mean NLL {mean}");

    let err = write_synthetic(&geo, TensorFormat::Q5K, 1, &model(SMOLLM2_GGUF), &tmp.path().join("k.ninfer"), None).unwrap_err();
    assert!(format!("{err:#}").contains("Q5_K"), "{err:#}");
    assert!(!tmp.path().join("k.ninfer").exists());
}

/// NaN scores are counted and reported, fail the run (exit 1) unless
/// `--allow-nonfinite`, and never enter a mean.
#[test]
fn nonfinite_scores_are_counted_and_fail_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let geo = geometry("smollm2-135m").unwrap();
    let path = tmp.path().join("nan.ninfer");
    write_synthetic(&geo, TensorFormat::Q8_0, 3, &model(SMOLLM2_GGUF), &path, None).unwrap();
    // Poison one element of the final norm: every logit row becomes NaN.
    let off = Artifact::open(&path).unwrap().tensor("output_norm.weight").unwrap().entry.offset as usize;
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[off..off + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    let text = common::data_root().join("wikitext-2-raw/wiki.test.raw");
    for (allow, code) in [(false, 1), (true, 0)] {
        let out = tmp.path().join(format!("out-{allow}"));
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"));
        cmd.arg(&path).arg("--text").arg(&text).args(["--method", "chunks", "--context", "128", "--chunks", "2", "--backend", "cpu", "--lossless", "--output"]).arg(&out);
        if allow {
            cmd.arg("--allow-nonfinite");
        }
        let o = cmd.output().unwrap();
        assert_eq!(o.status.code(), Some(code), "{}", String::from_utf8_lossy(&o.stderr));
        let r: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
        let overall = &r["results"]["overall"];
        assert_eq!(overall["n_nonfinite"], 126);
        assert_eq!(overall["scored_tokens"], 126);
        assert_eq!(overall["nll_sum"], 0.0);
        assert!(overall["perplexity"].is_null(), "no finite score, no perplexity: {overall}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("126"), "the count is reported on stderr");
    }
}

/// `--synthetic qwen3moe-*`: a qwen3moe body (routed experts, QK norm) as an
/// artifact and a GGUF twin with llama.cpp's qwen3moe keys and names; the twin
/// converts back to the same hyperparameters and tensor bytes, and the CPU
/// backend scores the tiny shape with finite scores and every layer routing
/// `top_k` experts per row.
#[test]
fn synthetic_qwen3moe_with_gguf_twin_converts_back_and_scores() {
    use infernix_perplexity::convert::synthetic::{moe_geometry, write_synthetic_moe};
    let tmp = tempfile::tempdir().unwrap();
    let big = moe_geometry("qwen3moe-30b-a3b").unwrap();
    assert_eq!(
        (big.n_layers, big.d_model, big.n_heads, big.n_kv_heads, big.d_head, big.n_experts, big.n_experts_used, big.d_ffn_expert),
        (48, 2048, 32, 4, 128, 128, 8, 768)
    );
    assert!(moe_geometry("llama-8b").is_none() && geometry("qwen3moe-tiny").is_err());

    let geo = moe_geometry("qwen3moe-tiny").unwrap();
    let (a_path, g_path) = (tmp.path().join("m.ninfer"), tmp.path().join("m.gguf"));
    write_synthetic_moe(&geo, TensorFormat::Q4_0, 5, &model(SMOLLM2_GGUF), &a_path, Some(&g_path)).unwrap();
    let a = Artifact::open(&a_path).unwrap();
    a.verify().unwrap();
    let moe = a.meta.hparams.moe.expect("moe hyperparameters");
    assert_eq!((moe.n_experts, moe.n_experts_used, moe.d_ffn_expert, moe.norm_topk_prob), (8, 3, 64, true));
    assert_eq!(a.tensor("blk.1.ffn_gate_exps.weight").unwrap().entry.shape, vec![8, 64, 64]);
    assert_eq!(a.tensor("blk.1.ffn_down_exps.weight").unwrap().format(), TensorFormat::Q4_0);
    assert_eq!(a.tensor("blk.0.attn_q.weight").unwrap().entry.shape, vec![128, 64]);
    assert_eq!(a.tensor("blk.0.ffn_gate_inp.weight").unwrap().format(), TensorFormat::F32);

    // The twin: llama.cpp's keys and names, GGUF shapes reversed, the same bytes.
    let g = GgufFile::open(&g_path).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "qwen3moe");
    for (key, want) in [("expert_count", 8), ("expert_used_count", 3), ("expert_feed_forward_length", 64), ("attention.key_length", 32)] {
        assert_eq!(g.get_u64(&format!("qwen3moe.{key}")).unwrap(), want, "{key}");
    }
    let bank = g.tensors.iter().find(|t| t.name == "blk.0.ffn_up_exps.weight").unwrap();
    assert_eq!(bank.dims, vec![64, 64, 8]);
    assert_eq!(g.tensors.len(), a.meta.tensors.len());

    // Converted back by the GGUF path: the same hyperparameters and bytes.
    let back_path = tmp.path().join("back.ninfer");
    infernix_perplexity::convert::convert(&g_path, &back_path, &Default::default()).unwrap();
    let back = Artifact::open(&back_path).unwrap();
    assert_eq!(back.meta.architecture, a.meta.architecture);
    assert_eq!(back.meta.hparams, a.meta.hparams);
    assert_eq!(back.meta.tensors.len(), a.meta.tensors.len());
    for t in &a.meta.tensors {
        let b = back.tensor(&t.name).unwrap();
        assert_eq!((&b.entry.shape, b.format(), &b.entry.sha256), (&t.shape, t.format, &t.sha256), "{}", t.name);
    }

    // It runs on the CPU: finite scores near ln(n_vocab), top_k experts per row.
    let mut m = load_model(&a, BackendKind::Cpu(Default::default()), 1.0).unwrap();
    let tokens: Vec<u32> = (0..48u32).map(|i| i * 701 % 49152).collect();
    let s = m.score_window(&tokens, 1, &ScoreOptions::default(), &[]).unwrap();
    assert_eq!(s.len(), 47);
    let mean = s.iter().map(|r| r.nll).sum::<f64>() / s.len() as f64;
    assert!(mean.is_finite() && mean > 1.0 && mean < 40.0, "mean NLL {mean}");
    let usage = m.expert_usage().expect("expert usage read back").expect("a MoE model reports expert usage");
    assert_eq!(usage.layers.len(), 2);
    assert_eq!(usage.rows, 48);
    for l in &usage.layers {
        assert_eq!(l.routed.iter().sum::<u64>(), 48 * 3, "layer {}", l.layer);
        assert!(l.routed.iter().filter(|&&c| c > 0).count() > 3, "layer {}: routing collapsed, {:?}", l.layer, l.routed);
    }
}

/// Synthetic weights of every format have mean zero and the asked spread
/// (decoded by the CPU dequantizer). Codes with a mean offset (Q4_0 codes
/// 0..=15 around 8 have mean -0.5) put a common all-ones component in every
/// row; through 48 layers it made every token's hidden state point the same
/// way, and the qwen3moe-30b-a3b twin routed every token to the same 8 of 128
/// experts in every layer (measured on the H200, docs/performance.md).
#[test]
fn synthetic_weights_have_mean_zero_and_the_asked_spread() {
    use infernix_perplexity::backend::cpu::dequant::dequantize_matrix;
    use infernix_perplexity::convert::synthetic::{random_matrix, SYNTHETIC_FORMATS};
    let (n_rows, n_cols, sigma) = (64, 4096, 1.0 / 64.0);
    for format in SYNTHETIC_FORMATS {
        let bytes = random_matrix(format, n_rows, n_cols, sigma, 11).unwrap();
        let v = dequantize_matrix(format, &bytes, n_rows, n_cols).unwrap();
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let sd = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        // The standard error of the mean is sigma / 512 here; the old Q4_0 offset was -0.109 sigma.
        assert!(mean.abs() < 0.01 * sigma as f64, "{format}: mean {mean:e}, sigma {sigma}");
        assert!((sd / sigma as f64 - 1.0).abs() < 0.05, "{format}: standard deviation {sd:e}, asked {sigma}");
    }
}

/// A deep, narrow qwen3moe body (48 layers like qwen3moe-30b-a3b): no layer
/// sends every row to the same top_k experts. With Q4_0 codes of mean -0.5
/// (before this test) 22 of these 48 layers did. Routing is still skewed
/// (some layer has an expert that takes every row: random attention averages
/// the tokens together), which the test prints but does not forbid.
#[test]
fn synthetic_qwen3moe_routing_stays_spread_through_48_layers() {
    use infernix_perplexity::convert::synthetic::{moe_geometry, write_synthetic_moe, MoeGeometry};
    let tmp = tempfile::tempdir().unwrap();
    let geo = MoeGeometry { name: "deep-test", n_layers: 48, n_experts: 16, n_experts_used: 4, ..moe_geometry("qwen3moe-tiny").unwrap() };
    let path = tmp.path().join("deep.ninfer");
    write_synthetic_moe(&geo, TensorFormat::Q4_0, 3, &model(SMOLLM2_GGUF), &path, None).unwrap();
    let a = Artifact::open(&path).unwrap();
    let mut m = load_model(&a, BackendKind::Cpu(Default::default()), 1.0).unwrap();
    let tokens: Vec<u32> = (0..128u32).map(|i| i * 701 % 49152).collect();
    m.score_window(&tokens, 1, &ScoreOptions::default(), &[]).unwrap();
    let usage = m.expert_usage().unwrap().unwrap();
    let worst = usage.layers.iter().map(|l| *l.routed.iter().max().unwrap()).max().unwrap();
    let spread: Vec<usize> = usage.layers.iter().map(|l| l.routed.iter().filter(|&&c| c > 0).count()).collect();
    eprintln!("experts used per layer: {spread:?}");
    let collapsed = usage.layers.iter().filter(|l| l.routed.iter().filter(|&&c| c > 0).count() == 4).count();
    eprintln!("busiest expert {worst} of {} rows; layers with only top_k experts used: {collapsed}", usage.rows);
    assert_eq!(collapsed, 0, "layers routing every row to the same experts");
}

/// `ninfer-convert --synthetic G --context-length N`: the artifact records N
/// as its trained context (hyperparameters and the synthetic provenance), the
/// GGUF twin carries the same value and converts back to it, the weights are
/// those of the geometry's own context, and `--context` is checked against
/// the new ceiling (refused above N, accepted at N).
#[test]
fn synthetic_context_length_is_recorded_in_the_artifact_and_its_twin() {
    use std::process::Command;
    let tmp = tempfile::tempdir().unwrap();
    let tok = model(SMOLLM2_GGUF);
    let convert = |args: &[&std::ffi::OsStr]| Command::new(env!("CARGO_BIN_EXE_ninfer-convert")).arg(&tok).args(args).output().unwrap();
    let p = |name: &str| tmp.path().join(name);
    let os = |p: &std::path::Path| p.as_os_str().to_os_string();

    // MoE path (qwen3moe-tiny, geometry context 4096), with its twin.
    let (a, g) = (p("m.ninfer"), p("m.gguf"));
    let o = convert(&["--synthetic".as_ref(), "qwen3moe-tiny".as_ref(), "--context-length".as_ref(), "65536".as_ref(), "--out".as_ref(), a.as_os_str(), "--gguf-twin".as_ref(), g.as_os_str()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let art = Artifact::open(&a).unwrap();
    art.verify().unwrap();
    assert_eq!(art.meta.hparams.context_length, 65536);
    assert_eq!(art.meta.provenance.synthetic.as_ref().unwrap()["context_length"], 65536);
    assert_eq!(GgufFile::open(&g).unwrap().get_u64("qwen3moe.context_length").unwrap(), 65536);
    let back = p("back.ninfer");
    infernix_perplexity::convert::convert(&g, &back, &Default::default()).unwrap();
    assert_eq!(Artifact::open(&back).unwrap().meta.hparams, art.meta.hparams);
    // Without the flag: the geometry's own context, the same weights.
    let plain = p("plain.ninfer");
    let o = convert(&["--synthetic".as_ref(), "qwen3moe-tiny".as_ref(), "--out".as_ref(), plain.as_os_str()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let plain = Artifact::open(&plain).unwrap();
    assert_eq!(plain.meta.hparams.context_length, 4096);
    assert_eq!(plain.meta.provenance.synthetic.as_ref().unwrap()["context_length"], 4096);
    for t in &art.meta.tensors {
        assert_eq!(plain.tensor(&t.name).unwrap().entry.sha256, t.sha256, "{}", t.name);
    }

    // Dense path (the llama geometries; smollm2-135m is the small one): a context of
    // 128 positions, refused by --context 256 and accepted at 128.
    let (d, dg) = (p("d.ninfer"), p("d.gguf"));
    let o = convert(&["--synthetic".as_ref(), "smollm2-135m".as_ref(), "--context-length".as_ref(), "128".as_ref(), "--out".as_ref(), d.as_os_str(), "--gguf-twin".as_ref(), dg.as_os_str()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let dense = Artifact::open(&d).unwrap();
    assert_eq!(dense.meta.hparams.context_length, 128);
    assert_eq!(dense.meta.provenance.synthetic.as_ref().unwrap()["context_length"], 128);
    assert_eq!(GgufFile::open(&dg).unwrap().get_u64("llama.context_length").unwrap(), 128);
    let text = common::data_root().join("wikitext-2-raw/wiki.test.raw");
    let score = |ctx: &str, out: &str| {
        Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
            .arg(&d)
            .arg("--text")
            .arg(&text)
            .args(["--method", "chunks", "--context", ctx, "--chunks", "1", "--backend", "cpu", "--lossless", "--output"])
            .arg(p(out))
            .output()
            .unwrap()
    };
    let o = score("256", "over");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--context 256") && err.contains("trained context 128"), "{err}");
    assert!(!p("over").join("report.json").exists());
    let o = score("128", "at");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(p("at").join("report.json").exists());

    // Bad values and misuse: one stderr line naming the flag, exit 2, nothing written.
    let bad_out = p("bad.ninfer");
    let mut cases: Vec<Vec<std::ffi::OsString>> = ["0", "-5", "abc", "1048577", "1e5", "8192.5", ""]
        .iter()
        .map(|v| vec!["--synthetic".into(), "qwen3moe-tiny".into(), format!("--context-length={v}").into(), "--out".into(), os(&bad_out)])
        .collect();
    cases.push(vec!["--context-length".into(), "65536".into(), "--out".into(), os(&bad_out)]);
    for args in &cases {
        let o = Command::new(env!("CARGO_BIN_EXE_ninfer-convert")).arg(&tok).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("ninfer-convert: error: --context-length"), "{args:?}: {err}");
        assert!(!bad_out.exists(), "{args:?}: wrote {}", bad_out.display());
    }
}
