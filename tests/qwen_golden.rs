//! qwen2 (QKV bias, tied head) and qwen3 (QK norm, head_dim != d_model /
//! n_heads, separate head) against Hugging Face transformers: two tiny seeded
//! checkpoints are rebuilt here as Hugging Face folders with the Rust twin of
//! the weight generator of `tools/qwen_golden.py`, converted to artifacts,
//! scored on the CPU backend, and compared per position with
//! `tests/data/qwen_golden.json` (transformers 5.17 in float64, made by that
//! script; the file records the versions and the generator).

use std::path::Path;

use infernix_perplexity::artifact::{Architecture, Artifact, ArtifactMeta};
use infernix_perplexity::backend::BackendKind;
use infernix_perplexity::convert::{convert, ConvertOptions};
use infernix_perplexity::model::{load_model, ScoreOptions};
use serde_json::{json, Value};

#[path = "common/seeded.rs"]
mod seeded;
use seeded::{worst, Tensor};

/// Absolute tolerance on NLL, log-sum-exp and target logit (nats). The golden
/// is float64 throughout; our CPU backend keeps weights, activations and
/// logits in f32 (f64 reductions), and a logit near 10 is already rounded by
/// up to 5e-7 when stored. Seen: worst 2.2e-6 (qwen2), 1.6e-6 (qwen3); a
/// mapping bug moves the NLL by far more (`tolerance_catches_mapping_bugs`).
const TOL: f64 = 1e-5;

fn golden() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/qwen_golden.json");
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// A deliberate change to a folder (config, tensors) before it is written.
type Edit = dyn Fn(&mut Value, &mut Vec<Tensor>);

/// Writes the Hugging Face folder of `model` (a golden entry) into `dir`,
/// checking every generated tensor against the golden SHA-256, then applying `edit`.
fn write_hf_folder(model: &Value, dir: &Path, edit: &Edit) {
    let mut data = seeded::tensors_of(&model["tensors"]);
    let mut config = model["config"].clone();
    edit(&mut config, &mut data);
    seeded::write_folder(dir, &config, &data);
}

fn tokens(g: &Value) -> Vec<u32> {
    let tokens: Vec<u32> = g["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let formula: Vec<u32> = (0..48u32).map(|j| (31 * j * j + 17 * j + 3) % 256).collect();
    assert_eq!(tokens, formula, "golden token sequence");
    tokens
}

/// Builds, converts and scores `model_type` (after `edit`); returns the
/// artifact's metadata and per field (nll, lse, target_logit) the worst
/// |ours - golden| with its position and both values.
fn score_against_golden(model_type: &str, edit: &Edit) -> (ArtifactMeta, Vec<(&'static str, f64, usize, f64, f64)>) {
    let g = golden();
    let model = &g["models"][model_type];
    let tokens = tokens(&g);
    let tmp = tempfile::tempdir().unwrap();
    let folder = tmp.path().join(model_type);
    write_hf_folder(model, &folder, edit);
    let out = tmp.path().join(format!("{model_type}.ninfer"));
    convert(&folder, &out, &ConvertOptions::default()).unwrap();
    let artifact = Artifact::open(&out).unwrap();
    artifact.verify().unwrap();

    let mut m = load_model(&artifact, BackendKind::Cpu(Default::default()), 1.0).unwrap();
    let scores = m.score_window(&tokens, 1, &ScoreOptions::default(), &[]).unwrap();
    assert_eq!(scores.len(), tokens.len() - 1);
    let fields = [
        ("nll", scores.iter().map(|s| s.nll).collect::<Vec<_>>()),
        ("lse", scores.iter().map(|s| s.lse).collect()),
        ("target_logit", scores.iter().map(|s| s.target_logit).collect()),
    ];
    let worst = fields
        .into_iter()
        .map(|(field, ours)| {
            let want = f64s(&model[field]);
            let (d, at) = worst(&ours, &want);
            (field, d, at, ours[at], want[at])
        })
        .collect();
    (artifact.meta.clone(), worst)
}

fn check_model(model_type: &str, arch: Architecture) {
    let g = golden();
    let cfg = &g["models"][model_type]["config"];
    let (meta, worst) = score_against_golden(model_type, &|_, _| {});
    assert_eq!(meta.architecture, arch);
    assert_eq!(meta.hparams.d_head as u64, cfg["head_dim"].as_u64().unwrap());
    assert_eq!(meta.hparams.rope_base, cfg["rope_theta"].as_f64().unwrap());
    assert_eq!(meta.hparams.tied_embeddings, cfg["tie_word_embeddings"].as_bool().unwrap());
    assert_eq!((meta.hparams.qkv_bias, meta.hparams.qk_norm), (arch == Architecture::Qwen2, arch == Architecture::Qwen3));
    assert!(!meta.tokenizer.add_bos && !meta.tokenizer.add_eos);

    let report: Vec<String> = worst
        .iter()
        .map(|(field, d, at, ours, want)| {
            format!(
                "{field}: worst |diff| {d:.3e} at position {at} (ours {ours:.12}, golden {want:.12}), {:.0}% of the {TOL:e} budget",
                100.0 * d / TOL
            )
        })
        .collect();
    let report = report.join("\n  ");
    eprintln!("{model_type}:\n  {report}");
    assert!(worst.iter().all(|w| w.1 <= TOL), "{model_type} disagrees with transformers:\n  {report}");
}

#[test]
fn qwen2_qkv_bias_tied_head_matches_transformers() {
    check_model("qwen2", Architecture::Qwen2);
}

#[test]
fn qwen3_qk_norm_wide_heads_matches_transformers() {
    check_model("qwen3", Architecture::Qwen3);
}

/// The comparison has teeth: plausible mapping bugs move the NLL by far more
/// than the tolerance.
#[test]
fn tolerance_catches_mapping_bugs() {
    let swap_names = |a: &'static str, b: &'static str| {
        move |_: &mut Value, tensors: &mut Vec<Tensor>| {
            for t in tensors.iter_mut() {
                if t.0.ends_with(a) {
                    t.0 = t.0.replace(a, b);
                } else if t.0.ends_with(b) {
                    t.0 = t.0.replace(b, a);
                }
            }
        }
    };
    let wrong_rope_base = |cfg: &mut Value, _: &mut Vec<Tensor>| cfg["rope_theta"] = json!(10_000.0);
    let zero_v_bias = |_: &mut Value, tensors: &mut Vec<Tensor>| {
        for t in tensors.iter_mut().filter(|t| t.0.ends_with("v_proj.bias")) {
            t.2.fill(0);
        }
    };
    let bugs: [(&str, &str, &Edit); 4] = [
        ("qwen2", "RoPE base 1e4 instead of 1e6", &wrong_rope_base),
        ("qwen2", "V bias dropped", &zero_v_bias),
        ("qwen3", "q_norm and k_norm swapped", &swap_names("q_norm.weight", "k_norm.weight")),
        ("qwen3", "gate and up swapped", &swap_names("gate_proj.weight", "up_proj.weight")),
    ];
    for (model_type, bug, edit) in bugs {
        let (_, worst) = score_against_golden(model_type, edit);
        let nll = worst[0].1;
        eprintln!("{model_type} with {bug}: worst NLL |diff| {nll:.3e}");
        assert!(nll > 100.0 * TOL, "{model_type} with {bug}: worst NLL |diff| only {nll:.3e}");
    }
}
