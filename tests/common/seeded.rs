//! The Rust twin of the seeded weight generator of `tools/qwen_golden.py`
//! (also used by `tools/qwen_moe_golden.py` and `tools/qwen_next_golden.py`)
//! and the Hugging Face folder pieces the golden tests rebuild: tensors from
//! a golden file's records (each checked against its SHA-256), the WordLevel
//! `tokenizer.json`, and the safetensors/config writer; and what the
//! mixture-of-experts goldens share: reading a golden file and its config,
//! the GGUF twin's common metadata and writer, converting and scoring on the
//! CPU with the expert counts, the per-position score check and the
//! bad-source runner of `ninfer-convert`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use infernix_perplexity::artifact::container::sha256_hex;
use infernix_perplexity::artifact::Artifact;
use infernix_perplexity::backend::BackendKind;
use infernix_perplexity::convert::gguf::{GgufValue, GgufWriter};
use infernix_perplexity::convert::{convert, ConvertOptions};
use infernix_perplexity::model::{load_model, ScoreOptions, TargetScore};
use safetensors::tensor::{serialize_to_file, TensorView};
use safetensors::Dtype;
use serde_json::{json, Value};

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

fn fnv1a64(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3))
}

/// Output `i` of the splitmix64 stream seeded with `h`.
fn splitmix64(h: u64, i: u64) -> u64 {
    let mut z = h.wrapping_add((i + 1).wrapping_mul(GAMMA));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The tensor `name` (`n` elements, row-major), as `tools/qwen_golden.py`'s `generate`.
pub fn generate(name: &str, n: usize, scale: f64, offset: f64) -> Vec<f32> {
    let h = fnv1a64(name);
    (0..n as u64)
        .map(|i| {
            let u = (splitmix64(h, i) >> 11) as f64 * (-53f64).exp2();
            (scale * (2.0 * u - 1.0) + offset) as f32
        })
        .collect()
}

/// One generated tensor: Hugging Face name, shape, F32 little-endian bytes.
pub type Tensor = (String, Vec<usize>, Vec<u8>);

/// The tensors of a golden file's `tensors` records, each checked against its SHA-256.
pub fn tensors_of(records: &Value) -> Vec<Tensor> {
    let mut data = Vec::new();
    for t in records.as_array().expect("tensor records") {
        let name = t["name"].as_str().unwrap();
        let shape: Vec<usize> = t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
        let values = generate(name, shape.iter().product(), t["scale"].as_f64().unwrap(), t["offset"].as_f64().unwrap());
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(sha256_hex(&bytes), t["sha256"].as_str().unwrap(), "generator twin disagrees on {name}");
        data.push((name.to_string(), shape, bytes));
    }
    data
}

/// The WordLevel vocabulary of the scripts: "<unk>" is id 0, "t1".."t{n-1}" are ids 1..n.
pub fn tokenizer_json(n_vocab: u64) -> Value {
    let mut vocab = serde_json::Map::new();
    vocab.insert("<unk>".into(), json!(0));
    for i in 1..n_vocab {
        vocab.insert(format!("t{i}"), json!(i));
    }
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
}

/// Writes `model.safetensors` (F32 `tensors`), `config.json`, `tokenizer.json`
/// and `tokenizer_config.json` into `dir`.
pub fn write_folder(dir: &Path, config: &Value, tensors: &[Tensor]) {
    std::fs::create_dir_all(dir).unwrap();
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().map(|(n, s, b)| (n.clone(), TensorView::new(Dtype::F32, s.clone(), b).unwrap())).collect();
    let st_meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    serialize_to_file(views, Some(st_meta), &dir.join("model.safetensors")).unwrap();
    let n_vocab = config["vocab_size"].as_u64().unwrap();
    let files = [
        ("config.json", config.clone()),
        ("tokenizer.json", tokenizer_json(n_vocab)),
        ("tokenizer_config.json", json!({"add_bos_token": false, "add_eos_token": false})),
    ];
    for (file, doc) in files {
        std::fs::write(dir.join(file), serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
    }
}

/// Largest |ours - golden| with its position, after checking lengths.
pub fn worst(ours: &[f64], want: &[f64]) -> (f64, usize) {
    assert_eq!(ours.len(), want.len());
    ours.iter().zip(want).map(|(a, b)| (a - b).abs()).enumerate().fold((0.0, 0), |w, (i, d)| if d > w.0 { (d, i) } else { w })
}

/// The numbers of a JSON array.
pub fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// A golden file's token sequence, checked against the scripts' formula.
pub fn golden_tokens(g: &Value) -> Vec<u32> {
    let t: Vec<u32> = g["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let formula: Vec<u32> = (0..48u32).map(|j| (31 * j * j + 17 * j + 3) % 256).collect();
    assert_eq!(t, formula, "golden token sequence");
    t
}

/// Per field (NLL, log-sum-exp, target logit) the worst |ours - golden| of
/// the golden section `g`; prints them and panics past `tol`. -> the worst.
pub fn check_scores_against(what: &str, scores: &[TargetScore], g: &Value, tol: f64) -> f64 {
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
            "{field}: worst |diff| {d:.3e} at position {at} (ours {:.12}, golden {:.12}), {:.0}% of the {tol:e} budget",
            ours[at],
            want[at],
            100.0 * d / tol
        ));
    }
    let report = report.join("\n  ");
    eprintln!("{what}:\n  {report}");
    assert!(worst_all <= tol, "{what} disagrees with transformers:\n  {report}");
    worst_all
}

/// Runs `ninfer-convert` (`exe`) on each `(what, source, wanted substrings)`
/// in `dir`: exit 2, one stderr line holding every wanted substring, no
/// panic, no artifact and no temporary file left behind.
pub fn assert_convert_fails(exe: &str, dir: &Path, cases: &[(String, PathBuf, Vec<String>)]) {
    for (what, source, want) in cases {
        let out = dir.join("out.ninfer");
        let o = std::process::Command::new(exe).arg(source).arg("--out").arg(&out).current_dir(dir).output().unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        let ctx = format!("{what}: stderr {stderr:?}");
        assert_eq!(o.status.code(), Some(2), "exit code, {ctx}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "one stderr line, {ctx}");
        assert!(!stderr.contains("panicked"), "{ctx}");
        for w in want {
            assert!(stderr.contains(w.as_str()), "want {w:?}, {ctx}");
        }
        assert!(!out.exists(), "{what}: an artifact was written");
        let stray: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .filter(|n| n.to_string_lossy().contains("tmp"))
            .collect();
        assert!(stray.is_empty(), "{what}: left behind {stray:?}");
    }
}

/// The golden file `tests/data/{file}`.
pub fn golden_file(file: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(file);
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

/// The integer `k` of a golden config.
pub fn usize_of(cfg: &Value, k: &str) -> usize {
    cfg[k].as_u64().unwrap_or_else(|| panic!("config {k}")) as usize
}

/// Per layer, per expert routing counts (a golden's `expert_counts`).
pub fn counts_of(v: &Value) -> Vec<Vec<u64>> {
    v.as_array().unwrap().iter().map(|l| l.as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).collect()).collect()
}

/// A GGUF tensor being written: name, dims (innermost first), ggml type, bytes.
pub type GgufTensor = (String, Vec<u64>, u32, Vec<u8>);

/// A deliberate change to a GGUF twin's metadata and tensors before it is written.
pub type GgufEdit<'a> = dyn Fn(&mut Vec<(String, GgufValue)>, &mut Vec<GgufTensor>) + 'a;

/// The metadata every mixture-of-experts twin shares, with llama.cpp's keys
/// (`keys`: the golden's `gguf.keys`): architecture, name, the dense and
/// expert geometry, heads, norm epsilon and RoPE base from the config.
pub fn gguf_moe_metadata(cfg: &Value, keys: &Value, name: &str) -> Vec<(String, GgufValue)> {
    let k = |key: &str| keys[key].as_str().unwrap_or_else(|| panic!("no GGUF key {key}")).to_string();
    let u32v = |key: &str| GgufValue::U32(usize_of(cfg, key) as u32);
    vec![
        ("general.architecture".to_string(), GgufValue::String(k("architecture"))),
        ("general.name".to_string(), GgufValue::String(name.into())),
        (k("block_count"), u32v("num_hidden_layers")),
        (k("context_length"), u32v("max_position_embeddings")),
        (k("embedding_length"), u32v("hidden_size")),
        (k("feed_forward_length"), u32v("intermediate_size")),
        (k("expert_feed_forward_length"), u32v("moe_intermediate_size")),
        (k("expert_count"), u32v("num_experts")),
        (k("expert_used_count"), u32v("num_experts_per_tok")),
        (k("head_count"), u32v("num_attention_heads")),
        (k("head_count_kv"), u32v("num_key_value_heads")),
        (k("key_length"), u32v("head_dim")),
        (k("value_length"), u32v("head_dim")),
        (k("layer_norm_rms_epsilon"), GgufValue::F32(cfg["rms_norm_eps"].as_f64().unwrap() as f32)),
        (k("rope_freq_base"), GgufValue::F32(cfg["rope_theta"].as_f64().unwrap() as f32)),
    ]
}

/// Writes a twin to `path`: `metadata` plus a byte-free gpt2 vocabulary of the
/// golden tokens, after `edit` of the metadata and `tensors`.
pub fn write_gguf_twin(cfg: &Value, mut metadata: Vec<(String, GgufValue)>, mut tensors: Vec<GgufTensor>, path: &Path, edit: &GgufEdit<'_>) {
    let mut vocab = vec![GgufValue::String("<unk>".into())];
    vocab.extend((1..usize_of(cfg, "vocab_size")).map(|i| GgufValue::String(format!("t{i}"))));
    metadata.extend([
        ("tokenizer.ggml.model".to_string(), GgufValue::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), GgufValue::String("default".into())),
        ("tokenizer.ggml.tokens".to_string(), GgufValue::Array(vocab)),
        ("tokenizer.ggml.merges".to_string(), GgufValue::Array(vec![])),
        ("tokenizer.ggml.add_bos_token".to_string(), GgufValue::Bool(false)),
    ]);
    edit(&mut metadata, &mut tensors);
    let w = GgufWriter { metadata, tensors: tensors.iter().map(|(n, d, ty, b)| (n.clone(), d.clone(), *ty, b.as_slice())).collect() };
    w.write(path).unwrap();
}

/// Converts `source` into `out` and scores the golden's tokens on the CPU
/// in passes of `chunk` tokens. -> the artifact, the scores and the expert
/// counts per layer.
pub fn score_moe(golden: &Value, source: &Path, out: &Path, chunk: Option<usize>) -> (Artifact, Vec<TargetScore>, Vec<Vec<u64>>) {
    convert(source, out, &ConvertOptions::default()).unwrap();
    let artifact = Artifact::open(out).unwrap();
    artifact.verify().unwrap();
    let toks = golden_tokens(golden);
    let mut m = load_model(&artifact, BackendKind::Cpu(Default::default()), 1.0).unwrap();
    let s = m.score_window(&toks, 1, &ScoreOptions { top_k: 0, prefill_chunk: chunk }, &[]).unwrap();
    let usage = m.expert_usage().expect("expert usage read back").expect("a MoE model reports expert usage");
    (artifact, s, usage.layers.iter().map(|l| l.routed.clone()).collect())
}
