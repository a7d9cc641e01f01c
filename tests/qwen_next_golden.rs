//! qwen3next (Gated DeltaNet layers interleaved with gated full attention,
//! routed experts plus a gated shared expert) against Hugging Face
//! transformers: the tiny seeded checkpoint of `tools/qwen_next_golden.py` is
//! rebuilt here as a Hugging Face folder, converted, and scored on the CPU
//! backend in one pass and in several prefill passes per window (the KV cache,
//! the recurrent state and the convolution history carried across passes).
//! Compared per position with `tests/data/qwen_next_golden.json`
//! (transformers 5.24 in float64, made by that script; it records the
//! versions), and the expert-routing counts with transformers' router's.

use std::path::{Path, PathBuf};

use infernix_perplexity::artifact::{Architecture, Artifact};
use infernix_perplexity::backend::BackendKind;
use infernix_perplexity::convert::{convert, ConvertOptions};
use infernix_perplexity::model::{load_model, ScoreOptions, TargetScore};
use serde_json::{json, Value};

#[path = "common/seeded.rs"]
mod seeded;
use seeded::{worst, Tensor};

/// Absolute tolerance on NLL, log-sum-exp and target logit per position
/// (nats): the bound. The golden is float64 throughout (every
/// float32 path of transformers' Qwen3-Next kept in float64 but RoPE cos/sin);
/// ours keeps weights and activations in f32 with f64 reductions and the
/// recurrent state in f64.
const TOL: f64 = 1e-6;

fn golden() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/qwen_next_golden.json");
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn tokens(g: &Value) -> Vec<u32> {
    let t: Vec<u32> = g["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let formula: Vec<u32> = (0..48u32).map(|j| (31 * j * j + 17 * j + 3) % 256).collect();
    assert_eq!(t, formula, "golden token sequence");
    t
}

fn golden_counts() -> Vec<Vec<u64>> {
    golden()["expert_counts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).collect())
        .collect()
}

/// The golden checkpoint as a Hugging Face folder, after `edit` of its config and tensors.
fn folder(dir: &Path, name: &str, edit: &dyn Fn(&mut Value, &mut Vec<Tensor>)) -> PathBuf {
    let g = golden();
    let mut cfg = g["config"].clone();
    let mut ts = seeded::tensors_of(&g["tensors"]);
    edit(&mut cfg, &mut ts);
    let p = dir.join(name);
    seeded::write_folder(&p, &cfg, &ts);
    p
}

/// Converts `source` to `out` and scores the golden tokens on the CPU in
/// passes of `chunk` tokens. -> the artifact, scores and expert counts.
fn score(source: &Path, out: &Path, chunk: Option<usize>) -> (Artifact, Vec<TargetScore>, Vec<Vec<u64>>) {
    convert(source, out, &ConvertOptions::default()).unwrap();
    let artifact = Artifact::open(out).unwrap();
    artifact.verify().unwrap();
    let toks = tokens(&golden());
    let mut m = load_model(&artifact, BackendKind::Cpu(Default::default()), 1.0).unwrap();
    let s = m.score_window(&toks, 1, &ScoreOptions { top_k: 0, prefill_chunk: chunk }, &[]).unwrap();
    let usage = m.expert_usage().expect("a MoE model reports expert usage");
    (artifact, s, usage.layers.iter().map(|l| l.routed.clone()).collect())
}

/// The worst |ours - golden| over NLL, log-sum-exp and target logit; panics past `TOL`.
fn check_scores(what: &str, scores: &[TargetScore]) -> f64 {
    let g = golden();
    let fields = [
        ("nll", scores.iter().map(|s| s.nll).collect::<Vec<_>>()),
        ("lse", scores.iter().map(|s| s.lse).collect()),
        ("target_logit", scores.iter().map(|s| s.target_logit).collect()),
    ];
    let mut report = Vec::new();
    let mut worst_all = 0f64;
    for (field, ours) in fields {
        let want = f64s(&g[field]);
        let (d, at) = worst(&ours, &want);
        worst_all = worst_all.max(d);
        report.push(format!(
            "{field}: worst |diff| {d:.3e} at position {at} (ours {:.12}, golden {:.12}), {:.0}% of the {TOL:e} budget",
            ours[at],
            want[at],
            100.0 * d / TOL
        ));
    }
    let report = report.join("\n  ");
    eprintln!("{what}:\n  {report}");
    assert!(worst_all <= TOL, "{what} disagrees with transformers:\n  {report}");
    worst_all
}

#[test]
fn qwen3next_hf_folder_matches_transformers_in_one_and_several_passes() {
    let tmp = tempfile::tempdir().unwrap();
    let src = folder(tmp.path(), "hub", &|_, _| {});
    let (artifact, one, counts) = score(&src, &tmp.path().join("one.ninfer"), None);
    let meta = &artifact.meta;
    assert_eq!(meta.architecture, Architecture::Qwen3Next);
    let h = meta.hparams.hybrid.clone().expect("hybrid hyperparameters");
    assert_eq!(h.linear_layers, vec![true, false, true]);
    assert_eq!((h.n_k_heads, h.n_v_heads, h.d_k, h.d_v, h.conv_kernel, h.d_ffn_shared), (2, 4, 8, 6, 4, 24));
    assert_eq!(meta.hparams.rope_dim, 4, "partial rotary factor 0.25 of 16");
    let t = |n: &str| meta.tensors.iter().find(|t| t.name == n).unwrap_or_else(|| panic!("{n}"));
    assert_eq!(t("blk.0.attn_qkv.weight").shape, vec![56, 64]);
    assert_eq!(t("blk.2.attn_gate.weight").shape, vec![24, 64]);
    assert_eq!(t("blk.0.ssm_conv1d.weight").shape, vec![56, 4]);
    assert_eq!(t("blk.1.attn_q.weight").shape, vec![128, 64]);
    assert!(meta.tensors.iter().all(|t| !t.name.starts_with("blk.1.ssm_") && !t.name.starts_with("blk.0.attn_q.")));
    check_scores("qwen3next, Hugging Face folder, one pass", &one);
    assert_eq!(counts, golden_counts(), "expert routing counts differ from transformers' router");
    // Several prefill passes per window: KV cache, recurrent state and conv history carry over.
    for chunk in [16, 7, 1] {
        let (_, passes, counts) = score(&src, &tmp.path().join(format!("c{chunk}.ninfer")), Some(chunk));
        check_scores(&format!("qwen3next, passes of {chunk}"), &passes);
        assert_eq!(counts, golden_counts(), "passes of {chunk}: routing counts");
    }
}

/// The comparison has teeth: plausible mapping bugs move the NLL far past the tolerance.
#[test]
fn tolerance_catches_schedule_and_mapping_bugs() {
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    type Bug = Box<dyn Fn(&mut Value, &mut Vec<Tensor>)>;
    let swap = |a: &'static str, b: &'static str| -> Bug {
        Box::new(move |_, ts: &mut Vec<Tensor>| {
            for t in ts.iter_mut() {
                if t.0 == a {
                    t.0 = b.into();
                } else if t.0 == b {
                    t.0 = a.into();
                }
            }
        })
    };
    let bugs: Vec<(&str, Bug)> = vec![
        ("full rotary instead of partial", Box::new(|c: &mut Value, _: &mut Vec<Tensor>| c["partial_rotary_factor"] = json!(1.0))),
        ("A_log of layers 0 and 2 swapped", swap("model.layers.0.linear_attn.A_log", "model.layers.2.linear_attn.A_log")),
        ("dt_bias of layers 0 and 2 swapped", swap("model.layers.0.linear_attn.dt_bias", "model.layers.2.linear_attn.dt_bias")),
        ("conv taps of layers 0 and 2 swapped", swap("model.layers.0.linear_attn.conv1d.weight", "model.layers.2.linear_attn.conv1d.weight")),
        (
            "shared expert gate and up swapped",
            swap("model.layers.1.mlp.shared_expert.gate_proj.weight", "model.layers.1.mlp.shared_expert.up_proj.weight"),
        ),
    ];
    for (i, (bug, edit)) in bugs.iter().enumerate() {
        let src = folder(tmp.path(), &format!("bug{i}"), edit.as_ref());
        let (_, scores, _) = score(&src, &tmp.path().join(format!("bug{i}.ninfer")), None);
        let (d, _) = worst(&scores.iter().map(|s| s.nll).collect::<Vec<_>>(), &f64s(&g["nll"]));
        eprintln!("with {bug}: worst NLL |diff| {d:.3e}");
        assert!(d > 1000.0 * TOL, "with {bug}: worst NLL |diff| only {d:.3e}");
    }
}

/// Several windows per pass, through `infernix-perplexity`: every window
/// starts from zero recurrent state, so batching windows changes no score and
/// no routing count; and the CUDA backend refuses qwen3next by name before
/// any device is touched.
#[test]
fn batching_windows_changes_nothing_and_cuda_refuses_qwen3next() {
    use infernix_perplexity::backend::ExecutionSpec;
    let tmp = tempfile::tempdir().unwrap();
    let art = tmp.path().join("next.ninfer");
    convert(&folder(tmp.path(), "hub", &|_, _| {}), &art, &ConvertOptions::default()).unwrap();
    let ids: Vec<u32> = (0..600u32).map(|j| (7 * j * j + 3 * j + 1) % 256).collect();
    let tokens = tmp.path().join("tokens.json");
    std::fs::write(&tokens, serde_json::to_vec(&ids).unwrap()).unwrap();
    let run = |name: &str, batch_tokens: &str, chunk: &str| -> Value {
        let out = tmp.path().join(name);
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
            .arg(&art)
            .args(["--tokens"])
            .arg(&tokens)
            .args(["--context", "256", "--stride", "128", "--backend", "cpu", "--lossless", "--batch-tokens", batch_tokens])
            .args(["--prefill-chunk", chunk, "--log-level", "warn", "--output"])
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap()
    };
    let batched = run("batched", "8192", "256");
    let single = run("single", "256", "256");
    let passes = run("passes", "256", "128");
    assert!(batched["execution"]["details"]["windows_per_pass"].as_u64().unwrap() > 1, "the batched run must batch");
    assert_eq!(batched["results"]["overall"], single["results"]["overall"], "batching changed the scores");
    assert_eq!(batched["results"]["expert_usage"], single["results"]["expert_usage"], "batching changed the routing counts");
    let (a, b) = (&single["results"]["overall"]["mean_nll"], &passes["results"]["overall"]["mean_nll"]);
    let (a, b) = (a.as_f64().expect("mean_nll"), b.as_f64().expect("mean_nll"));
    assert!((a - b).abs() < 1e-9, "passes of 128 moved the mean NLL: {a} vs {b}");

    let artifact = Artifact::open(&art).unwrap();
    let cuda = BackendKind::Cuda { device: 0, spec: ExecutionSpec::lossless(512) };
    let e = format!("{:#}", load_model(&artifact, cuda, 1.0).err().expect("CUDA must refuse"));
    assert!(e.contains("qwen3next") && e.contains("not supported on the CUDA backend") && e.contains("--backend cpu"), "{e}");
}

/// Issue 13's bad inputs for qwen3next, through the real `ninfer-convert`: an
/// unknown layer type, a missing tensor of a linear-attention layer, head
/// counts that do not divide or that contradict the tensors. Each: exit 2,
/// one stderr line naming the file (or folder) and the tensor or key, and
/// nothing written.
#[test]
fn bad_qwen3next_sources_fail_with_one_line_naming_file_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cases: Vec<(&str, PathBuf, Vec<String>)> = Vec::new();
    let p = folder(tmp.path(), "layer_type", &|c, _| c["layer_types"][1] = json!("mamba"));
    cases.push(("unknown layer type", p, vec!["config.json".into(), "layer_types[1]".into(), "mamba".into()]));
    let p = folder(tmp.path(), "missing", &|_, ts| ts.retain(|t| t.0 != "model.layers.2.linear_attn.out_proj.weight"));
    cases.push(("missing linear-attention tensor", p.clone(), vec![p.display().to_string(), "tensor blk.2.ssm_out.weight is missing".into()]));
    let p = folder(tmp.path(), "heads", &|c, _| c["linear_num_value_heads"] = json!(3));
    cases.push(("value heads not a multiple of key heads", p, vec!["config.json".into(), "linear_num_value_heads 3".into()]));
    let p = folder(tmp.path(), "key_dim", &|c, _| c["linear_key_head_dim"] = json!(4));
    cases.push((
        "key head width contradicting in_proj_qkvz",
        p,
        vec!["model.safetensors".into(), "in_proj_qkvz".into(), "linear_key_head_dim 4".into()],
    ));
    let p = folder(tmp.path(), "v_heads", &|c, _| c["linear_num_value_heads"] = json!(2));
    cases.push(("value heads contradicting in_proj_qkvz", p, vec!["in_proj_qkvz".into(), "linear_num_value_heads 2".into()]));
    let p = folder(tmp.path(), "attn_heads", &|c, _| c["num_attention_heads"] = json!(2));
    cases.push(("attention heads contradicting the gated q_proj", p, vec!["blk.1.attn_q.weight".into(), "n_heads".into()]));

    for (what, source, want) in cases {
        let out = tmp.path().join("out.ninfer");
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_ninfer-convert"))
            .arg(&source)
            .arg("--out")
            .arg(&out)
            .current_dir(tmp.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        let ctx = format!("{what}: stderr {stderr:?}");
        assert_eq!(o.status.code(), Some(2), "exit code, {ctx}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "one stderr line, {ctx}");
        assert!(!stderr.contains("panicked"), "{ctx}");
        for w in &want {
            assert!(stderr.contains(w.as_str()), "want {w:?}, {ctx}");
        }
        assert!(!out.exists(), "{what}: an artifact was written");
    }
}
