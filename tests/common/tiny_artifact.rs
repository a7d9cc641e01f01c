//! A tiny, consistent one-layer llama artifact (dummy tokenizer `{}`) that
//! passes every artifact check, and an in-place editor of a v4 artifact's
//! metadata JSON, for the bad-input tests (`convert_errors`, `bad_inputs`).
#![allow(dead_code)]

use std::path::Path;

use infernix_perplexity::artifact::meta::*;
use infernix_perplexity::artifact::writer::{write_artifact, TensorSource};
use infernix_perplexity::artifact::TensorFormat;
use sha2::Digest;

/// Writes the tiny artifact (d_model 32, d_ffn 64, 4 tokens) to `path`.
pub fn write_tiny(path: &Path) -> ArtifactMeta {
    let hp = HParams {
        n_layers: 1, d_model: 32, n_heads: 1, n_kv_heads: 1, d_head: 32, d_head_v: 32, d_ffn: 64, n_vocab: 4,
        rms_eps: 1e-5, rope_base: 1e4, rope_base_local: 1e4, rope_scale: 1.0, rope_dim: 32,
        rope_style: RopeStyle::Neox, sliding_window: vec![None], context_length: 64, embed_scale: 1.0,
        attn_scale: 0.17, attn_softcap: None, final_softcap: None, activation: Activation::Silu,
        qkv_bias: false, qk_norm: false, post_norms: false, tied_embeddings: true, moe: None, hybrid: None,
    };
    let meta = ArtifactMeta {
        architecture: Architecture::Llama,
        public_name: "tiny".into(),
        hparams: hp,
        components: vec![Component::Text],
        tokenizer: TokenizerMeta { kind: "test".into(), pre: None, bos_id: None, eos_id: None, add_bos: false, add_eos: false,
            blob: BlobRef { offset: 0, n_bytes: 0, sha256: String::new() } },
        provenance: Provenance { sources: vec![], converter: "test".into(), converter_version: "0".into(), source_layers: None, synthetic: None, source_metadata: serde_json::json!({}) },
        tensors: vec![],
    };
    let f32s = |name: String, shape: Vec<u64>| {
        let n: u64 = shape.iter().product();
        TensorSource { name, component: Component::Text, format: TensorFormat::F32, shape, bytes: vec![0u8; 4 * n as usize].into() }
    };
    let mut ts = vec![
        TensorSource { name: "token_embd.weight".into(), component: Component::Text, format: TensorFormat::Q8_0, shape: vec![4, 32], bytes: vec![1u8; 136].into() },
        f32s("output_norm.weight".into(), vec![32]),
    ];
    for (n, shape) in [("attn_norm", vec![32]), ("ffn_norm", vec![32]), ("attn_q", vec![32, 32]), ("attn_k", vec![32, 32]),
                       ("attn_v", vec![32, 32]), ("attn_output", vec![32, 32]), ("ffn_gate", vec![64, 32]), ("ffn_up", vec![64, 32]),
                       ("ffn_down", vec![32, 64])] {
        ts.push(f32s(format!("blk.0.{n}.weight"), shape));
    }
    write_artifact(path, meta, &ts, b"{}").unwrap()
}

/// Rewrites the metadata JSON of a v4 artifact in place (same data offset);
/// with `redigest`, the header's metadata SHA-256 is updated to match.
pub fn patch_json(path: &Path, redigest: bool, f: impl FnOnce(&mut serde_json::Value)) {
    const H: usize = 64;
    let mut b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[16..24].try_into().unwrap()) as usize;
    let data = u64::from_le_bytes(b[24..32].try_into().unwrap()) as usize;
    let mut v: serde_json::Value = serde_json::from_slice(&b[H..H + n]).unwrap();
    f(&mut v);
    let j = serde_json::to_vec(&v).unwrap();
    assert!(H + j.len() <= data);
    b[H..data].fill(0);
    b[16..24].copy_from_slice(&(j.len() as u64).to_le_bytes());
    b[H..H + j.len()].copy_from_slice(&j);
    if redigest {
        b[32..64].copy_from_slice(&sha2::Sha256::digest(&j));
    }
    std::fs::write(path, b).unwrap();
}

/// Rewrites a v4 artifact as version 3 (no digest, JSON at 32).
pub fn to_v3(path: &Path) {
    let mut b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[16..24].try_into().unwrap()) as usize;
    b[8..12].copy_from_slice(&3u32.to_le_bytes());
    b.copy_within(64..64 + n, 32);
    b[32 + n..64 + n].fill(0);
    std::fs::write(path, b).unwrap();
}
