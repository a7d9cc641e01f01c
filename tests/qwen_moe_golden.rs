//! qwen3moe (8 experts, top-3, renormalized top-k weights, QK norm) against
//! Hugging Face transformers: the tiny seeded checkpoint of
//! `tools/qwen_moe_golden.py` is rebuilt here as a Hugging Face folder (one
//! matrix per expert, the Hub layout), as transformers' fused-bank layout,
//! and as a GGUF twin whose tensor names and metadata keys are the ones
//! llama.cpp's gguf-py assigned (recorded in the golden file), converted, and
//! scored on the CPU backend in one pass and in several prefill passes per
//! window. Compared per position with `tests/data/qwen_moe_golden.json`
//! (transformers 5.24 in float64, made by that script; it records the
//! versions), and the expert-routing counts with transformers' router's.

use std::path::{Path, PathBuf};

use infernix_perplexity::artifact::{Architecture, Artifact};
use infernix_perplexity::convert::gguf::GgufValue;
use infernix_perplexity::convert::{convert, ConvertOptions};
use infernix_perplexity::model::TargetScore;
use serde_json::{json, Value};

#[path = "common/seeded.rs"]
mod seeded;
use seeded::{counts_of, f64s, usize_of, worst, GgufEdit, GgufTensor, Tensor};

/// Absolute tolerance on NLL, log-sum-exp and target logit per position
/// (nats): the bound. The golden is float64 throughout (transformers'
/// float32 norms and softmaxes patched to float64); ours keeps weights and
/// activations in f32 with f64 reductions.
const TOL: f64 = 1e-6;

fn golden() -> Value {
    seeded::golden_file("qwen_moe_golden.json")
}

/// The per-expert tensors of one bank (`model.layers.{l}.mlp.experts.{proj}`),
/// concatenated in expert order.
fn bank_bytes(tensors: &[Tensor], l: usize, proj: &str, n_experts: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for e in 0..n_experts {
        let name = format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight");
        out.extend_from_slice(&tensors.iter().find(|t| t.0 == name).unwrap_or_else(|| panic!("{name}")).2);
    }
    out
}

/// transformers' fused layout: `mlp.experts.gate_up_proj` `(E, 2F, D)` (per
/// expert gate rows, then up rows) and `mlp.experts.down_proj` `(E, D, F)`.
fn fuse_experts(tensors: &[Tensor], cfg: &Value) -> Vec<Tensor> {
    let (n_e, f, d, n_l) = (usize_of(cfg, "num_experts"), usize_of(cfg, "moe_intermediate_size"), usize_of(cfg, "hidden_size"), usize_of(cfg, "num_hidden_layers"));
    let mut out: Vec<Tensor> = tensors.iter().filter(|t| !t.0.contains(".mlp.experts.")).cloned().collect();
    for l in 0..n_l {
        let (gate, up) = (bank_bytes(tensors, l, "gate_proj", n_e), bank_bytes(tensors, l, "up_proj", n_e));
        let per = f * d * 4;
        let mut gate_up = Vec::new();
        for e in 0..n_e {
            gate_up.extend_from_slice(&gate[e * per..(e + 1) * per]);
            gate_up.extend_from_slice(&up[e * per..(e + 1) * per]);
        }
        out.push((format!("model.layers.{l}.mlp.experts.gate_up_proj"), vec![n_e, 2 * f, d], gate_up));
        out.push((format!("model.layers.{l}.mlp.experts.down_proj"), vec![n_e, d, f], bank_bytes(tensors, l, "down_proj", n_e)));
    }
    out
}

/// The GGUF twin, written with llama.cpp's names and keys from the golden
/// file: F32 tensors, expert banks stacked expert-major (GGUF dims innermost
/// first: `[d_model, d_ffn_expert, n_experts]`), a byte-free gpt2 vocabulary
/// of the same tokens. `edit` may change the metadata and tensors first.
fn write_gguf(g: &Value, path: &Path, edit: &GgufEdit<'_>) {
    let cfg = &g["config"];
    let names = &g["gguf"]["tensors"];
    let hf = seeded::tensors_of(&g["tensors"]);
    let n_e = usize_of(cfg, "num_experts");
    let mut tensors: Vec<GgufTensor> = Vec::new();
    for (name, shape, bytes) in &hf {
        if name.contains(".mlp.experts.") {
            continue;
        }
        let gguf = names[name.as_str()].as_str().unwrap_or_else(|| panic!("no GGUF name for {name}"));
        tensors.push((gguf.to_string(), shape.iter().rev().map(|&d| d as u64).collect(), 0, bytes.clone()));
    }
    for l in 0..usize_of(cfg, "num_hidden_layers") {
        for proj in ["gate_proj", "up_proj", "down_proj"] {
            let bank = format!("model.layers.{l}.mlp.experts.{proj}");
            let gguf = names[bank.as_str()].as_str().unwrap_or_else(|| panic!("no GGUF name for {bank}"));
            let one = hf.iter().find(|t| t.0 == format!("model.layers.{l}.mlp.experts.0.{proj}.weight")).unwrap();
            let dims = vec![one.1[1] as u64, one.1[0] as u64, n_e as u64];
            tensors.push((gguf.to_string(), dims, 0, bank_bytes(&hf, l, proj, n_e)));
        }
    }
    let metadata = seeded::gguf_moe_metadata(cfg, &g["gguf"]["keys"], "tiny qwen3moe twin");
    seeded::write_gguf_twin(cfg, metadata, tensors, path, edit);
}

/// Converts `source` into `out` and scores the golden tokens on the CPU with
/// passes of `chunk` tokens. -> scores and the expert counts.
fn score(source: &Path, out: &Path, chunk: Option<usize>) -> (Artifact, Vec<TargetScore>, Vec<Vec<u64>>) {
    seeded::score_moe(&golden(), source, out, chunk)
}

/// Per field, the worst |ours - golden|; panics past `TOL` with the details.
fn check_scores(what: &str, scores: &[TargetScore]) -> f64 {
    check_scores_against(what, scores, &golden())
}

/// [`check_scores`] against the golden section `g` (its `nll`, `lse`, `target_logit`).
fn check_scores_against(what: &str, scores: &[TargetScore], g: &Value) -> f64 {
    seeded::check_scores_against(what, scores, g, TOL)
}

fn golden_counts() -> Vec<Vec<u64>> {
    counts_of(&golden()["expert_counts"])
}

fn hf_folder(dir: &Path, fused: bool) -> PathBuf {
    let g = golden();
    let tensors = seeded::tensors_of(&g["tensors"]);
    let tensors = if fused { fuse_experts(&tensors, &g["config"]) } else { tensors };
    let folder = dir.join(if fused { "fused" } else { "hub" });
    seeded::write_folder(&folder, &g["config"], &tensors);
    folder
}

#[test]
fn qwen3moe_hf_folder_matches_transformers_in_one_and_several_passes() {
    let tmp = tempfile::tempdir().unwrap();
    let folder = hf_folder(tmp.path(), false);
    let (artifact, one, counts) = score(&folder, &tmp.path().join("one.ninfer"), None);
    let meta = &artifact.meta;
    assert_eq!(meta.architecture, Architecture::Qwen3Moe);
    let moe = meta.hparams.moe.expect("moe hyperparameters");
    assert_eq!((moe.n_experts, moe.n_experts_used, moe.d_ffn_expert, moe.norm_topk_prob), (8, 3, 32, true));
    assert!(meta.hparams.qk_norm);
    let bank = meta.tensors.iter().find(|t| t.name == "blk.1.ffn_down_exps.weight").unwrap();
    assert_eq!(bank.shape, vec![8, 64, 32]);
    check_scores("qwen3moe, Hugging Face folder, one pass", &one);
    assert_eq!(counts, golden_counts(), "expert routing counts differ from transformers' router");
    // Several prefill passes per window (16 + 16 + 16, and 7-token passes): the KV cache carries over.
    for chunk in [16, 7] {
        let (_, passes, counts) = score(&folder, &tmp.path().join(format!("c{chunk}.ninfer")), Some(chunk));
        check_scores(&format!("qwen3moe, passes of {chunk}"), &passes);
        assert_eq!(counts, golden_counts(), "passes of {chunk}: routing counts");
    }
}

/// The same checkpoint with `norm_topk_prob` false (a Hugging Face-only
/// setting): the raw softmax weights of the top 3.
#[test]
fn qwen3moe_without_norm_topk_prob_matches_transformers() {
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = g["config"].clone();
    cfg["norm_topk_prob"] = json!(false);
    let folder = tmp.path().join("raw");
    seeded::write_folder(&folder, &cfg, &seeded::tensors_of(&g["tensors"]));
    let (artifact, scores, counts) = score(&folder, &tmp.path().join("raw.ninfer"), Some(16));
    assert!(!artifact.meta.hparams.moe.unwrap().norm_topk_prob);
    let raw = &g["without_norm_topk_prob"];
    check_scores_against("qwen3moe without norm_topk_prob, passes of 16", &scores, raw);
    assert_eq!(counts, counts_of(&raw["expert_counts"]));
}

#[test]
fn qwen3moe_fused_hf_layout_and_gguf_twin_give_the_same_artifact_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let (hub, _, _) = score(&hf_folder(tmp.path(), false), &tmp.path().join("hub.ninfer"), None);
    let (fused, fused_scores, _) = score(&hf_folder(tmp.path(), true), &tmp.path().join("fused.ninfer"), None);
    check_scores("qwen3moe, fused Hugging Face layout", &fused_scores);
    let gguf_path = tmp.path().join("twin.gguf");
    write_gguf(&golden(), &gguf_path, &|_, _| {});
    let (gguf, gguf_scores, counts) = score(&gguf_path, &tmp.path().join("gguf.ninfer"), Some(20));
    check_scores("qwen3moe, GGUF twin (llama.cpp names), passes of 20", &gguf_scores);
    assert_eq!(counts, golden_counts());
    // GGUF stores rms_eps as f32 (as llama.cpp writes it); everything else is equal.
    let mut want = hub.meta.hparams.clone();
    want.rms_eps = want.rms_eps as f32 as f64;
    assert_eq!(gguf.meta.hparams, want, "GGUF and Hugging Face hyperparameters");
    // Every tensor byte for byte the same from all three sources (names, shapes, formats, SHA-256).
    let table = |a: &Artifact| {
        let mut t: Vec<_> = a.meta.tensors.iter().map(|t| (t.name.clone(), t.shape.clone(), t.format, t.sha256.clone())).collect();
        t.sort();
        t
    };
    assert_eq!(table(&hub), table(&fused), "fused layout");
    assert_eq!(table(&hub), table(&gguf), "GGUF twin");
}

/// The comparison has teeth: plausible routing and mapping bugs move the
/// NLL far past the tolerance.
#[test]
fn tolerance_catches_routing_and_mapping_bugs() {
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    let base = seeded::tensors_of(&g["tensors"]);
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
        ("top-k weights not renormalized", Box::new(|c: &mut Value, _: &mut Vec<Tensor>| c["norm_topk_prob"] = json!(false))),
        ("top-2 instead of top-3", Box::new(|c: &mut Value, _: &mut Vec<Tensor>| c["num_experts_per_tok"] = json!(2))),
        ("experts 2 and 5 of layer 0 swapped (down only)", swap("model.layers.0.mlp.experts.2.down_proj.weight", "model.layers.0.mlp.experts.5.down_proj.weight")),
        ("gate and up of expert 1 swapped", swap("model.layers.1.mlp.experts.1.gate_proj.weight", "model.layers.1.mlp.experts.1.up_proj.weight")),
    ];
    for (i, (bug, edit)) in bugs.iter().enumerate() {
        let mut cfg = g["config"].clone();
        let mut ts = base.clone();
        edit(&mut cfg, &mut ts);
        let folder = tmp.path().join(format!("bug{i}"));
        seeded::write_folder(&folder, &cfg, &ts);
        let (_, scores, _) = score(&folder, &tmp.path().join(format!("bug{i}.ninfer")), None);
        let (d, _) = worst(&scores.iter().map(|s| s.nll).collect::<Vec<_>>(), &f64s(&g["nll"]));
        eprintln!("with {bug}: worst NLL |diff| {d:.3e}");
        assert!(d > 1000.0 * TOL, "with {bug}: worst NLL |diff| only {d:.3e}");
    }
}

/// Issue 13's bad inputs, through the real `ninfer-convert`: a missing
/// expert tensor, an expert count or top-k the tensors contradict. Each: exit
/// 2, one stderr line naming the file (or folder) and the tensor or key, and
/// nothing written.
#[test]
fn bad_moe_sources_fail_with_one_line_naming_file_and_field() {
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    let base = seeded::tensors_of(&g["tensors"]);
    let mut cases: Vec<(String, PathBuf, Vec<String>)> = Vec::new();

    let hf_case = |name: &str, edit: &dyn Fn(&mut Value, &mut Vec<Tensor>)| -> PathBuf {
        let mut cfg = g["config"].clone();
        let mut ts = base.clone();
        edit(&mut cfg, &mut ts);
        let folder = tmp.path().join(name);
        seeded::write_folder(&folder, &cfg, &ts);
        folder
    };
    let missing = "model.layers.1.mlp.experts.3.up_proj.weight";
    let p = hf_case("hf_missing_expert", &|_, ts| ts.retain(|t| t.0 != missing));
    cases.push(("HF: missing expert".into(), p.clone(), vec![p.display().to_string(), format!("tensor {missing} is missing")]));
    let p = hf_case("hf_topk", &|c, _| c["num_experts_per_tok"] = json!(9));
    cases.push(("HF: top-k above the expert count".into(), p.clone(), vec!["config.json".into(), "num_experts_per_tok 9".into()]));
    let p = hf_case("hf_count", &|c, _| c["num_experts"] = json!(6));
    cases.push((
        "HF: fewer experts in config than tensors".into(),
        p.clone(),
        vec!["model.safetensors".into(), "mlp.experts.6.".into(), "num_experts 6".into()],
    ));
    let p = hf_case("hf_router", &|_, ts| {
        let t = ts.iter_mut().find(|t| t.0 == "model.layers.0.mlp.gate.weight").unwrap();
        t.1 = vec![7, 64];
        t.2.truncate(7 * 64 * 4);
    });
    cases.push(("HF: router rows disagree with num_experts".into(), p.clone(), vec![p.display().to_string(), "blk.0.ffn_gate_inp.weight".into(), "expert_count".into()]));

    let gguf_case = |name: &str, edit: &GgufEdit<'_>| -> PathBuf {
        let p = tmp.path().join(format!("{name}.gguf"));
        write_gguf(&g, &p, edit);
        p
    };
    let set = |k: &'static str, v: u32| {
        move |m: &mut Vec<(String, GgufValue)>, _: &mut Vec<GgufTensor>| {
            m.iter_mut().find(|(key, _)| key == k).unwrap().1 = GgufValue::U32(v);
        }
    };
    let p = gguf_case("gguf_count", &set("qwen3moe.expert_count", 4));
    cases.push(("GGUF: expert_count below the banks".into(), p.clone(), vec![p.display().to_string(), "ffn_gate_inp.weight".into(), "expert_count".into()]));
    let p = gguf_case("gguf_topk", &set("qwen3moe.expert_used_count", 0));
    cases.push(("GGUF: expert_used_count 0".into(), p.clone(), vec![p.display().to_string(), "qwen3moe.expert_used_count 0".into()]));
    let p = gguf_case("gguf_missing", &|_, ts| ts.retain(|t| t.0 != "blk.1.ffn_up_exps.weight"));
    cases.push(("GGUF: missing expert bank".into(), p.clone(), vec![p.display().to_string(), "tensor blk.1.ffn_up_exps.weight is missing".into()]));
    let p = gguf_case("gguf_no_count", &|m, _| m.retain(|(k, _)| k != "qwen3moe.expert_count"));
    cases.push(("GGUF: expert_count absent".into(), p.clone(), vec![p.display().to_string(), "qwen3moe.expert_count is missing".into()]));

    seeded::assert_convert_fails(env!("CARGO_BIN_EXE_ninfer-convert"), tmp.path(), &cases);
}

/// MXFP4 expert banks run on the CPU exactly as F32 banks holding the decoded
/// values; the CUDA backend's pre-device check accepts both (it runs routed
/// experts and multiplies MXFP4, tests/gpu_e2e.rs) and refuses an MXFP4
/// token-embedding table by name, before any device is touched.
#[test]
fn mxfp4_banks_run_on_the_cpu_and_cuda_accepts_them_but_not_an_mxfp4_embedding() {
    use infernix_perplexity::model::check_cuda_support;
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    // Bank bytes in MXFP4: per 32-weight block, E8M0 scale 2^-3 (e = 124) and
    // nibbles from the seeded generator; and the same weights decoded by hand
    // (E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign) as F32.
    let e2m1 = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let mxfp4 = |name: &str, n: usize| -> (Vec<u8>, Vec<u8>) {
        let noise = seeded::generate(name, n / 2, 0.5, 0.5);
        let (mut q, mut f) = (Vec::new(), Vec::new());
        for block in noise.chunks(16) {
            q.push(124u8);
            let nibbles: Vec<u8> = block.iter().map(|u| (u * 255.0) as u8).collect();
            q.extend(&nibbles);
            let dec = |c: u8| (if c & 8 != 0 { -1.0 } else { 1.0 }) * e2m1[(c & 7) as usize] * 0.125;
            let lo = nibbles.iter().map(|b| dec(b & 15));
            let hi = nibbles.iter().map(|b| dec(b >> 4));
            f.extend(lo.chain(hi).flat_map(|v| v.to_le_bytes()));
        }
        (q, f)
    };
    let write = |path: &Path, as_mxfp4: bool| {
        write_gguf(&g, path, &|_, ts| {
            for (name, dims, ty, bytes) in ts.iter_mut().filter(|t| t.0.contains("_exps.")) {
                let (q, f) = mxfp4(name, dims.iter().product::<u64>() as usize);
                (*ty, *bytes) = if as_mxfp4 { (39, q) } else { (0, f) };
            }
        })
    };
    let (q_path, f_path) = (tmp.path().join("mxfp4.gguf"), tmp.path().join("decoded.gguf"));
    write(&q_path, true);
    write(&f_path, false);
    let (q_art, q_scores, _) = score(&q_path, &tmp.path().join("mxfp4.ninfer"), Some(16));
    let (f_art, f_scores, _) = score(&f_path, &tmp.path().join("decoded.ninfer"), Some(16));
    let bank = q_art.meta.tensors.iter().find(|t| t.name == "blk.0.ffn_gate_exps.weight").unwrap();
    assert_eq!(bank.format.name(), "MXFP4");
    assert_eq!(bank.n_bytes, 8 * 32 * 64 / 32 * 17, "MXFP4 bank kept as 17-byte blocks");
    assert_eq!(q_scores, f_scores, "MXFP4 banks must score exactly as F32 banks of the decoded values");

    check_cuda_support(&q_art).expect("CUDA runs MXFP4 expert banks");
    check_cuda_support(&f_art).expect("CUDA runs routed experts");
    // The same model with its token embedding in MXFP4: refused by name.
    let e_path = tmp.path().join("mxfp4_embd.gguf");
    write_gguf(&g, &e_path, &|_, ts| {
        for (name, dims, ty, bytes) in ts.iter_mut().filter(|t| t.0 == "token_embd.weight") {
            (*ty, *bytes) = (39, mxfp4(name, dims.iter().product::<u64>() as usize).0);
        }
    });
    let (e_art, _, _) = score(&e_path, &tmp.path().join("mxfp4_embd.ninfer"), None);
    let e = format!("{:#}", check_cuda_support(&e_art).expect_err("CUDA must refuse an MXFP4 embedding"));
    assert!(e.contains("token_embd.weight") && e.contains("MXFP4") && e.contains("--backend cpu"), "{e}");
}

/// End to end through `infernix-perplexity`: report.json carries the
/// expert-usage counts (every processed row routed to top_k experts), and
/// batching several windows per pass changes neither a score nor a count.
#[test]
fn report_json_carries_expert_usage_and_batching_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let art = tmp.path().join("moe.ninfer");
    convert(&hf_folder(tmp.path(), false), &art, &ConvertOptions::default()).unwrap();
    let ids: Vec<u32> = (0..200u32).map(|j| (7 * j * j + 3 * j + 1) % 256).collect();
    let tokens = tmp.path().join("tokens.json");
    std::fs::write(&tokens, serde_json::to_vec(&ids).unwrap()).unwrap();
    let run = |name: &str, batch_tokens: &str| -> Value {
        let out = tmp.path().join(name);
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
            .arg(&art)
            .args(["--tokens"])
            .arg(&tokens)
            .args(["--context", "64", "--stride", "32", "--backend", "cpu", "--lossless", "--batch-tokens", batch_tokens])
            .args(["--log-level", "warn", "--output"])
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap()
    };
    let batched = run("batched", "8192");
    let single = run("single", "64");
    let usage = &batched["results"]["expert_usage"];
    assert_eq!(usage["n_experts"], json!(8));
    assert_eq!(usage["top_k"], json!(3));
    let processed = batched["timing"]["tokens_processed"].as_u64().unwrap();
    assert_eq!(usage["rows"].as_u64().unwrap(), processed, "every processed row is routed once per layer");
    let layers = usage["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2);
    for l in layers {
        let routed: Vec<u64> = l["routed"].as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).collect();
        assert_eq!(routed.iter().sum::<u64>(), 3 * processed);
        assert_eq!(l["never_routed"].as_u64().unwrap() as usize, routed.iter().filter(|&&c| c == 0).count());
    }
    assert_eq!(usage, &single["results"]["expert_usage"], "batching changed the routing counts");
    assert_eq!(batched["results"]["overall"], single["results"]["overall"], "batching changed the scores");
    assert!(batched["execution"]["details"]["windows_per_pass"].as_u64().unwrap() > 1, "the batched run must batch");
    assert_eq!(single["execution"]["details"]["windows_per_pass"], json!(1));
}
