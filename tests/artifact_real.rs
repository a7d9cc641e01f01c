//! Converting the real models: every tensor's bytes in the artifact equal the
//! GGUF's (SHA-256 per tensor), the recorded hashes verify, `--layers`
//! renumbers blocks and records their source, and a Hugging Face folder
//! converts with its names mapped and its dtypes kept.

mod common;

use std::collections::HashMap;

use common::{model, GEMMA3_GGUF, SMOLLM2_GGUF};
use infernix_perplexity::artifact::container::sha256_hex;
use infernix_perplexity::artifact::meta::{Architecture, RopeStyle};
use infernix_perplexity::artifact::{Artifact, TensorFormat};
use infernix_perplexity::convert::gguf::GgufFile;
use infernix_perplexity::convert::{convert, ConvertOptions};

fn check_bytes_equal(gguf_name: &str, arch: Architecture) {
    let src = model(gguf_name);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.ninfer");
    let meta = convert(&src, &out, &ConvertOptions::default()).unwrap();
    assert_eq!(meta.architecture, arch);
    let g = GgufFile::open(&src).unwrap();
    let a = Artifact::open(&out).unwrap();
    a.verify().unwrap();
    assert_eq!(a.meta.tensors.len(), g.tensors.len());
    for t in &g.tensors {
        let v = a.tensor(&t.name).unwrap();
        assert_eq!(v.entry.format as u32, t.ggml_type, "{}", t.name);
        assert_eq!(v.entry.shape, t.shape(), "{}", t.name);
        assert_eq!(sha256_hex(v.bytes), sha256_hex(g.tensor_bytes(t)), "{}", t.name);
    }
    assert_eq!(a.meta.provenance.sources[0].sha256, sha256_hex(&std::fs::read(&src).unwrap()));
}

#[test]
fn smollm2_tensors_are_byte_identical() {
    check_bytes_equal(SMOLLM2_GGUF, Architecture::Llama);
}

#[test]
fn gemma3_tensors_are_byte_identical_and_hparams_mapped() {
    check_bytes_equal(GEMMA3_GGUF, Architecture::Gemma3);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("g.ninfer");
    let meta = convert(&model(GEMMA3_GGUF), &out, &ConvertOptions::default()).unwrap();
    let hp = &meta.hparams;
    // llama.cpp's gemma3: every sixth layer global, local RoPE base 10000, 1/sqrt(d_head).
    let globals: Vec<usize> = (0..hp.n_layers).filter(|&l| hp.sliding_window[l].is_none()).collect();
    assert_eq!(globals, vec![5, 11, 17]);
    assert!(hp.sliding_window.iter().flatten().all(|&w| w == 512));
    assert_eq!((hp.rope_base, hp.rope_base_local), (1e6, 1e4));
    assert_eq!(hp.attn_scale, 1.0 / 16.0);
    assert_eq!(hp.rope_style, RopeStyle::Neox);
    assert!(hp.qk_norm && hp.post_norms && hp.tied_embeddings);
    assert!(meta.tokenizer.add_bos && meta.tokenizer.bos_id == Some(2));
}

#[test]
fn layers_range_keeps_blocks_and_records_their_source() {
    let src = model(SMOLLM2_GGUF);
    let tmp = tempfile::tempdir().unwrap();
    let full = tmp.path().join("full.ninfer");
    let part = tmp.path().join("part.ninfer");
    convert(&src, &full, &ConvertOptions::default()).unwrap();
    convert(&src, &part, &ConvertOptions { layers: Some(2..5) }).unwrap();
    let (f, p) = (Artifact::open(&full).unwrap(), Artifact::open(&part).unwrap());
    assert_eq!(p.meta.hparams.n_layers, 3);
    assert_eq!(p.meta.provenance.source_layers, Some(vec![2, 3, 4]));
    let by_name: HashMap<&str, &str> = f.meta.tensors.iter().map(|t| (t.name.as_str(), t.sha256.as_str())).collect();
    for t in &p.meta.tensors {
        let src_name = match t.name.strip_prefix("blk.") {
            Some(rest) => {
                let (n, tail) = rest.split_once('.').unwrap();
                format!("blk.{}.{tail}", n.parse::<usize>().unwrap() + 2)
            }
            None => t.name.clone(),
        };
        assert_eq!(by_name[src_name.as_str()], t.sha256, "{}", t.name);
    }
    assert_eq!(p.meta.tensors.len(), 3 * 9 + 2, "3 blocks of 9 tensors, embedding and final norm");
    let err = convert(&src, &tmp.path().join("bad.ninfer"), &ConvertOptions { layers: Some(28..31) }).unwrap_err();
    assert!(format!("{err:#}").contains("--layers 28..31"), "{err:#}");
}

#[test]
fn hugging_face_folder_converts_with_mapped_names() {
    use safetensors::tensor::{serialize, TensorView};
    use safetensors::Dtype;
    // A two-layer qwen2-shaped model with the SmolLM2 tokenizer.
    let tmp = tempfile::tempdir().unwrap();
    let folder = tmp.path().join("hf");
    std::fs::create_dir(&folder).unwrap();
    let smol = tmp.path().join("smol.ninfer");
    convert(&model(SMOLLM2_GGUF), &smol, &ConvertOptions::default()).unwrap();
    let tok = Artifact::open(&smol).unwrap().tokenizer_json().to_vec();
    std::fs::write(folder.join("tokenizer.json"), &tok).unwrap();
    std::fs::write(folder.join("tokenizer_config.json"), br#"{"add_bos_token": false}"#).unwrap();
    let (d, ffn, vocab, layers) = (64usize, 128usize, 49152usize, 2usize);
    let cfg = serde_json::json!({
        "model_type": "qwen2", "hidden_size": d, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "tie_word_embeddings": true, "max_position_embeddings": 4096
    });
    std::fs::write(folder.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, d], vec![0x3c; vocab * d * 2]),
        ("model.norm.weight".into(), vec![d], vec![0x3c; d * 2]),
    ];
    for l in 0..layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        blobs.push((p("input_layernorm.weight"), vec![d], vec![0x3c; d * 2]));
        blobs.push((p("post_attention_layernorm.weight"), vec![d], vec![0x3c; d * 2]));
        for (n, rows) in [("q_proj", d), ("k_proj", d / 2), ("v_proj", d / 2)] {
            blobs.push((p(&format!("self_attn.{n}.weight")), vec![rows, d], vec![0x3b; rows * d * 2]));
            blobs.push((p(&format!("self_attn.{n}.bias")), vec![rows], vec![0x3b; rows * 2]));
        }
        blobs.push((p("self_attn.o_proj.weight"), vec![d, d], vec![0x3b; d * d * 2]));
        blobs.push((p("mlp.gate_proj.weight"), vec![ffn, d], vec![0x3b; ffn * d * 2]));
        blobs.push((p("mlp.up_proj.weight"), vec![ffn, d], vec![0x3b; ffn * d * 2]));
        blobs.push((p("mlp.down_proj.weight"), vec![d, ffn], vec![0x3b; ffn * d * 2]));
    }
    blobs.push(("model.rotary_emb.inv_freq".into(), vec![8], vec![0; 16]));
    let views: Vec<(String, TensorView)> = blobs
        .iter()
        .map(|(n, s, b)| (n.clone(), TensorView::new(Dtype::BF16, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(folder.join("model.safetensors"), serialize(views, None).unwrap()).unwrap();

    let out = tmp.path().join("q.ninfer");
    let meta = convert(&folder, &out, &ConvertOptions::default()).unwrap();
    assert_eq!(meta.architecture, Architecture::Qwen2);
    assert!(meta.hparams.qkv_bias && meta.hparams.tied_embeddings);
    assert_eq!(meta.hparams.n_kv_heads, 2);
    let a = Artifact::open(&out).unwrap();
    let q = a.tensor("blk.1.attn_q.bias").unwrap();
    assert_eq!(q.format(), TensorFormat::Bf16);
    assert_eq!(q.entry.shape, vec![d as u64]);
    assert_eq!(a.tensor("blk.0.ffn_norm.weight").unwrap().bytes, &vec![0x3c; d * 2][..]);
    assert_eq!(a.tokenizer_json(), &tok[..]);
    assert_eq!(meta.provenance.source_metadata["skipped_tensors"][0], "model.rotary_emb.inv_freq");
}
