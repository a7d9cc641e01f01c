//! qwen3next (Gated DeltaNet layers interleaved with gated full attention,
//! routed experts plus a gated shared expert) against Hugging Face
//! transformers: the tiny seeded checkpoint of `tools/qwen_next_golden.py` is
//! rebuilt here as a Hugging Face folder and as a GGUF twin (llama.cpp's
//! tensor names and keys as gguf-py assigns them, recorded in the golden
//! file, and llama.cpp's conversion transforms), converted, and scored on the CPU
//! backend in one pass and in several prefill passes per window (the KV cache,
//! the recurrent state and the convolution history carried across passes).
//! Compared per position with `tests/data/qwen_next_golden.json`
//! (transformers 5.24 in float64, made by that script; it records the
//! versions), and the expert-routing counts with transformers' router's.

use std::path::{Path, PathBuf};

use infernix_perplexity::artifact::{Architecture, Artifact};
use infernix_perplexity::backend::BackendKind;
use infernix_perplexity::convert::gguf::GgufValue;
use infernix_perplexity::convert::{convert, ConvertOptions};
use infernix_perplexity::model::{load_model, TargetScore};
use serde_json::{json, Value};

#[path = "common/seeded.rs"]
mod seeded;
use seeded::{f64s, usize_of, worst, GgufEdit, GgufTensor, Tensor};

/// Absolute tolerance on NLL, log-sum-exp and target logit per position
/// (nats): the bound. The golden is float64 throughout (every
/// float32 path of transformers' Qwen3-Next kept in float64 but RoPE cos/sin);
/// ours keeps weights and activations in f32 with f64 reductions and the
/// recurrent state in f64.
const TOL: f64 = 1e-6;

fn golden() -> Value {
    seeded::golden_file("qwen_next_golden.json")
}

fn golden_counts() -> Vec<Vec<u64>> {
    seeded::counts_of(&golden()["expert_counts"])
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

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The GGUF twin as llama.cpp's converter (`conversion/qwen.py`,
/// `Qwen3NextModel`) writes it, with the names and keys gguf-py assigned
/// (from the golden file): F32 tensors; `A_log` as `-exp(A_log)` (in f32,
/// as torch computes it there); conv taps squeezed to `(C, K)`; every
/// `norm.weight` but `linear_attn.norm` plus 1; `in_proj_qkvz` regrouped
/// into `attn_qkv` and `attn_gate`; expert banks stacked expert-major; both
/// `attention.recurrent_layers` and `full_attention_interval`.
fn write_gguf(g: &Value, path: &Path, edit: &GgufEdit<'_>) {
    let cfg = &g["config"];
    let names = &g["gguf"]["tensors"];
    let keys = &g["gguf"]["keys"];
    let hf = seeded::tensors_of(&g["tensors"]);
    let (n_e, d) = (usize_of(cfg, "num_experts"), usize_of(cfg, "hidden_size"));
    let (nk, nv, dk, dv) = (
        usize_of(cfg, "linear_num_key_heads"),
        usize_of(cfg, "linear_num_value_heads"),
        usize_of(cfg, "linear_key_head_dim"),
        usize_of(cfg, "linear_value_head_dim"),
    );
    let gguf_name = |n: &str| names[n].as_str().unwrap_or_else(|| panic!("no GGUF name for {n}")).to_string();
    let dims = |shape: &[usize]| -> Vec<u64> { shape.iter().rev().map(|&x| x as u64).collect() };
    let mut tensors: Vec<GgufTensor> = Vec::new();
    for (name, shape, bytes) in &hf {
        if name.contains(".mlp.experts.") {
            continue;
        }
        if name.ends_with("in_proj_qkvz.weight") {
            let (per, rdv) = (2 * dk + 2 * nv / nk * dv, nv / nk * dv);
            let rows = |lo: usize, n: usize| -> Vec<u8> {
                (0..nk).flat_map(|gk| bytes[(gk * per + lo) * d * 4..(gk * per + lo + n) * d * 4].to_vec()).collect()
            };
            let mut qkv = rows(0, dk);
            qkv.extend(rows(dk, dk));
            qkv.extend(rows(2 * dk, rdv));
            let pair = names[name.as_str()].as_array().unwrap();
            tensors.push((pair[0].as_str().unwrap().into(), vec![d as u64, (nk * (2 * dk + rdv)) as u64], 0, qkv));
            tensors.push((pair[1].as_str().unwrap().into(), vec![d as u64, (nk * rdv) as u64], 0, rows(2 * dk + rdv, rdv)));
            continue;
        }
        let (shape, bytes) = if name.ends_with(".A_log") {
            (shape.clone(), bytes_of(&f32s(bytes).iter().map(|v| -v.exp()).collect::<Vec<_>>()))
        } else if name.ends_with("conv1d.weight") {
            (vec![shape[0], shape[2]], bytes.clone())
        } else if name.ends_with("norm.weight") && !name.ends_with("linear_attn.norm.weight") {
            (shape.clone(), bytes_of(&f32s(bytes).iter().map(|v| v + 1.0).collect::<Vec<_>>()))
        } else {
            (shape.clone(), bytes.clone())
        };
        tensors.push((gguf_name(name), dims(&shape), 0, bytes));
    }
    for l in 0..usize_of(cfg, "num_hidden_layers") {
        for proj in ["gate_proj", "up_proj", "down_proj"] {
            let gguf = gguf_name(&format!("model.layers.{l}.mlp.experts.{proj}"));
            let one = hf.iter().find(|t| t.0 == format!("model.layers.{l}.mlp.experts.0.{proj}.weight")).unwrap();
            let mut bank = Vec::new();
            for e in 0..n_e {
                let n = format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight");
                bank.extend_from_slice(&hf.iter().find(|t| t.0 == n).unwrap().2);
            }
            tensors.push((gguf, vec![one.1[1] as u64, one.1[0] as u64, n_e as u64], 0, bank));
        }
    }
    let k = |name: &str| keys[name].as_str().unwrap().to_string();
    let u32v = |v: usize| GgufValue::U32(v as u32);
    let recurrent: Vec<GgufValue> =
        cfg["layer_types"].as_array().unwrap().iter().map(|t| GgufValue::Bool(t == "linear_attention")).collect();
    let head_dim = usize_of(cfg, "head_dim");
    let mut metadata = seeded::gguf_moe_metadata(cfg, keys, "tiny qwen3next twin");
    metadata.extend([
        (k("expert_shared_feed_forward_length"), u32v(usize_of(cfg, "shared_expert_intermediate_size"))),
        (k("rope_dimension_count"), u32v((head_dim as f64 * cfg["partial_rotary_factor"].as_f64().unwrap()) as usize)),
        (k("recurrent_layers"), GgufValue::Array(recurrent)),
        (k("full_attention_interval"), u32v(usize_of(cfg, "full_attention_interval"))),
        (k("ssm_conv_kernel"), u32v(usize_of(cfg, "linear_conv_kernel_dim"))),
        (k("ssm_state_size"), u32v(dk)),
        (k("ssm_group_count"), u32v(nk)),
        (k("ssm_time_step_rank"), u32v(nv)),
        (k("ssm_inner_size"), u32v(nv * dv)),
    ]);
    seeded::write_gguf_twin(cfg, metadata, tensors, path, edit);
}

/// Converts `source` to `out` and scores the golden tokens on the CPU in
/// passes of `chunk` tokens. -> the artifact, scores and expert counts.
fn score(source: &Path, out: &Path, chunk: Option<usize>) -> (Artifact, Vec<TargetScore>, Vec<Vec<u64>>) {
    seeded::score_moe(&golden(), source, out, chunk)
}

/// Scores against the golden's; panics past `TOL`.
fn check_scores(what: &str, scores: &[TargetScore]) -> f64 {
    seeded::check_scores_against(what, scores, &golden(), TOL)
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

/// The GGUF twin scores within the bound in several passes, with the same
/// routing counts, the same hyperparameters and the same tensors as the
/// Hugging Face folder's artifact (byte for byte; `ssm_a`, which llama.cpp
/// computes as `-exp` in f32 and we in f64, within one f32 step).
#[test]
fn qwen3next_gguf_twin_matches_transformers_and_the_hf_artifact() {
    let tmp = tempfile::tempdir().unwrap();
    let g = golden();
    let (hub, _, _) = score(&folder(tmp.path(), "hub", &|_, _| {}), &tmp.path().join("hub.ninfer"), None);
    let path = tmp.path().join("twin.gguf");
    write_gguf(&g, &path, &|_, _| {});
    let (twin, scores, counts) = score(&path, &tmp.path().join("twin.ninfer"), Some(20));
    check_scores("qwen3next, GGUF twin (llama.cpp names and transforms), passes of 20", &scores);
    assert_eq!(counts, golden_counts());
    let mut want = hub.meta.hparams.clone();
    want.rms_eps = want.rms_eps as f32 as f64;
    assert_eq!(twin.meta.hparams, want, "GGUF and Hugging Face hyperparameters");
    let table = |a: &Artifact| {
        let mut t: Vec<_> = a.meta.tensors.iter().map(|t| (t.name.clone(), t.shape.clone(), t.format)).collect();
        t.sort();
        t
    };
    assert_eq!(table(&hub), table(&twin), "tensor names, shapes and formats");
    for t in &hub.meta.tensors {
        let (a, b) = (hub.tensor(&t.name).unwrap(), twin.tensor(&t.name).unwrap());
        if t.name.ends_with(".ssm_a") {
            for (x, y) in f32s(a.bytes).iter().zip(f32s(b.bytes)) {
                assert!((x - y).abs() <= x.abs() * f32::EPSILON, "{}: {x} vs {y}", t.name);
            }
        } else {
            assert_eq!(a.bytes, b.bytes, "tensor {} differs between the sources", t.name);
        }
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
/// no routing count; and the CUDA backend no longer refuses qwen3next: without
/// a device the error is the device's, with one the model loads (its scores on
/// CUDA are tests/gpu_e2e.rs's).
#[test]
fn batching_windows_changes_nothing_and_cuda_accepts_qwen3next() {
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
    if let Err(e) = load_model(&artifact, cuda, 1.0) {
        let e = format!("{e:#}");
        assert!(!e.contains("qwen3next") && !e.contains("not supported"), "CUDA refused qwen3next: {e}");
    }
}

/// Issue 13's bad inputs for qwen3next, through the real `ninfer-convert`: an
/// unknown layer type, a missing tensor of a linear-attention layer, head
/// counts that do not divide or that contradict the tensors. Each: exit 2,
/// one stderr line naming the file (or folder) and the tensor or key, and
/// nothing written.
#[test]
fn bad_qwen3next_sources_fail_with_one_line_naming_file_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cases: Vec<(String, PathBuf, Vec<String>)> = Vec::new();
    let p = folder(tmp.path(), "layer_type", &|c, _| c["layer_types"][1] = json!("mamba"));
    cases.push(("unknown layer type".into(), p, vec!["config.json".into(), "layer_types[1]".into(), "mamba".into()]));
    let p = folder(tmp.path(), "missing", &|_, ts| ts.retain(|t| t.0 != "model.layers.2.linear_attn.out_proj.weight"));
    cases.push(("missing linear-attention tensor".into(), p.clone(), vec![p.display().to_string(), "tensor blk.2.ssm_out.weight is missing".into()]));
    let p = folder(tmp.path(), "heads", &|c, _| c["linear_num_value_heads"] = json!(3));
    cases.push(("value heads not a multiple of key heads".into(), p, vec!["config.json".into(), "linear_num_value_heads 3".into()]));
    let p = folder(tmp.path(), "key_dim", &|c, _| c["linear_key_head_dim"] = json!(4));
    cases.push((
        "key head width contradicting in_proj_qkvz".into(),
        p,
        vec!["model.safetensors".into(), "in_proj_qkvz".into(), "linear_key_head_dim 4".into()],
    ));
    let p = folder(tmp.path(), "v_heads", &|c, _| c["linear_num_value_heads"] = json!(2));
    cases.push(("value heads contradicting in_proj_qkvz".into(), p, vec!["in_proj_qkvz".into(), "linear_num_value_heads 2".into()]));
    let p = folder(tmp.path(), "attn_heads", &|c, _| c["num_attention_heads"] = json!(2));
    cases.push(("attention heads contradicting the gated q_proj".into(), p, vec!["blk.1.attn_q.weight".into(), "n_heads".into()]));

    let g = golden();
    let set = |k: &'static str, v: u32| {
        move |m: &mut Vec<(String, GgufValue)>, _: &mut Vec<GgufTensor>| {
            m.iter_mut().find(|(key, _)| key == k).unwrap_or_else(|| panic!("{k}")).1 = GgufValue::U32(v);
        }
    };
    let p = tmp.path().join("heads.gguf");
    write_gguf(&g, &p, &set("qwen3next.ssm.time_step_rank", 3));
    cases.push(("GGUF: value heads not a multiple of key heads".into(), p.clone(), vec![p.display().to_string(), "qwen3next.ssm.time_step_rank 3".into()]));
    let p = tmp.path().join("missing.gguf");
    write_gguf(&g, &p, &|_, ts| ts.retain(|t| t.0 != "blk.0.ssm_conv1d.weight"));
    cases.push(("GGUF: missing linear-attention tensor".into(), p.clone(), vec![p.display().to_string(), "tensor blk.0.ssm_conv1d.weight is missing".into()]));
    let p = tmp.path().join("layer_type.gguf");
    write_gguf(&g, &p, &|m, _| {
        m.iter_mut().find(|(k, _)| k == "qwen3next.attention.recurrent_layers").unwrap().1 =
            GgufValue::Array(vec![GgufValue::U32(1), GgufValue::U32(2), GgufValue::U32(1)]);
    });
    cases.push(("GGUF: layer types that are not flags".into(), p.clone(), vec![p.display().to_string(), "recurrent_layers[0]".into()]));
    seeded::assert_convert_fails(env!("CARGO_BIN_EXE_ninfer-convert"), tmp.path(), &cases);
}
