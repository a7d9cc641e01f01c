//! Seeded random-weight artifacts with real models' shapes (`--synthetic`),
//! plus the same weights as a GGUF twin, so speed can be compared with other
//! engines on identical bytes. The tokenizer is taken from a real GGUF.
//!
//! Weights are random blocks, not quantized floats: each block's scale is
//! chosen so a row's values have standard deviation about `1/sqrt(n_in)`,
//! which keeps activations finite through any depth (RMSNorm renormalizes).

use std::borrow::Cow;
use std::path::Path;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::gguf::{GgufFile, GgufValue, GgufWriter};
use super::{source_file, tokenizer, CONVERTER};
use crate::artifact::format::TensorFormat;
use crate::artifact::meta::{Activation, Architecture, ArtifactMeta, Component, HParams, Provenance, RopeStyle};
use crate::artifact::names::{blk, OUTPUT, OUTPUT_NORM, TOKEN_EMBD};
use crate::artifact::writer::{write_artifact, TensorSource};

/// A named model shape (llama architecture).
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    pub name: &'static str,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub d_ffn: usize,
    pub rope_base: f64,
    pub tied: bool,
}

pub const GEOMETRIES: [Geometry; 3] = [
    Geometry { name: "smollm2-135m", n_layers: 30, d_model: 576, n_heads: 9, n_kv_heads: 3, d_ffn: 1536, rope_base: 100_000.0, tied: true },
    Geometry { name: "llama-8b", n_layers: 32, d_model: 4096, n_heads: 32, n_kv_heads: 8, d_ffn: 14336, rope_base: 500_000.0, tied: false },
    // Llama-3-70B's body (about 40 GB as Q4_0 with a 49k vocabulary): write it with
    // no --gguf-twin where disk is short.
    Geometry { name: "llama-70b", n_layers: 80, d_model: 8192, n_heads: 64, n_kv_heads: 8, d_ffn: 28672, rope_base: 500_000.0, tied: false },
];

pub fn geometry(name: &str) -> Result<Geometry> {
    match GEOMETRIES.iter().find(|g| g.name == name) {
        Some(g) => Ok(*g),
        None => bail!(
            "--synthetic {name:?}: unknown geometry (known: {})",
            GEOMETRIES.map(|g| g.name).join(", ")
        ),
    }
}

/// Formats whose random blocks we can generate.
const SYNTHETIC_FORMATS: [TensorFormat; 8] = [
    TensorFormat::F32,
    TensorFormat::F16,
    TensorFormat::Bf16,
    TensorFormat::Q4_0,
    TensorFormat::Q4_1,
    TensorFormat::Q8_0,
    TensorFormat::Q4K,
    TensorFormat::Q6K,
];

/// Random bytes of a `(n_rows, n_cols)` matrix in `format`, values with
/// standard deviation about `sigma`.
pub fn random_matrix(format: TensorFormat, n_rows: usize, n_cols: usize, sigma: f32, seed: u64) -> Result<Vec<u8>> {
    if !SYNTHETIC_FORMATS.contains(&format) {
        bail!(
            "--format {format}: synthetic weights support {}",
            SYNTHETIC_FORMATS.map(|f| f.name()).join(", ")
        );
    }
    let row_bytes = format.row_bytes(n_cols)?;
    let mut out = vec![0u8; n_rows * row_bytes];
    // One stream per row band, so generation is parallel and still seeded.
    const BAND_ROWS: usize = 64;
    out.par_chunks_mut(row_bytes * BAND_ROWS).enumerate().for_each(|(band, chunk)| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (band as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        fill_random(format, chunk, sigma, &mut rng);
    });
    Ok(out)
}

fn fill_random(format: TensorFormat, out: &mut [u8], sigma: f32, rng: &mut ChaCha8Rng) {
    let uniform = |rng: &mut ChaCha8Rng| (rng.gen::<f32>() * 2.0 - 1.0) * sigma * 3f32.sqrt();
    match format {
        TensorFormat::F32 => out.chunks_exact_mut(4).for_each(|b| b.copy_from_slice(&uniform(rng).to_le_bytes())),
        TensorFormat::F16 => out
            .chunks_exact_mut(2)
            .for_each(|b| b.copy_from_slice(&half::f16::from_f32(uniform(rng)).to_le_bytes())),
        TensorFormat::Bf16 => out
            .chunks_exact_mut(2)
            .for_each(|b| b.copy_from_slice(&half::bf16::from_f32(uniform(rng)).to_le_bytes())),
        // Uniform 4-bit codes around 8 have standard deviation ~4.6.
        TensorFormat::Q4_0 => out.chunks_exact_mut(18).for_each(|b| {
            b[0..2].copy_from_slice(&half::f16::from_f32(sigma / 4.6).to_le_bytes());
            rng.fill(&mut b[2..]);
        }),
        // Q4_1: x = d*q + m with m = -8d centres the codes.
        TensorFormat::Q4_1 => out.chunks_exact_mut(20).for_each(|b| {
            let d = sigma / 4.6;
            b[0..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
            b[2..4].copy_from_slice(&half::f16::from_f32(-8.0 * d).to_le_bytes());
            rng.fill(&mut b[4..]);
        }),
        // Uniform i8 codes have standard deviation ~73.9.
        TensorFormat::Q8_0 => out.chunks_exact_mut(34).for_each(|b| {
            b[0..2].copy_from_slice(&half::f16::from_f32(sigma / 73.9).to_le_bytes());
            rng.fill(&mut b[2..]);
        }),
        // Q4_K super-block of 256 (144 bytes): d, dmin (f16), 12 bytes of packed 6-bit
        // (scale, min) for 8 sub-blocks, 128 bytes of 4-bit codes; x = d*sc*q - dmin*m.
        // Every sub-block gets sc = 2, m = 15 and dmin = d: x = 2d (q - 7.5), spread 9.2 d.
        TensorFormat::Q4K => out.chunks_exact_mut(144).for_each(|b| {
            let d = half::f16::from_f32(sigma / 9.2).to_le_bytes();
            b[0..2].copy_from_slice(&d);
            b[2..4].copy_from_slice(&d);
            // Sub-blocks 0-3: scale in bytes 0-3, min in 4-7 (low 6 bits; top 2 bits are
            // sub-blocks 4-7's high bits, 0 here); sub-blocks 4-7: low nibbles of bytes
            // 8-11 (scale) and high nibbles (min).
            b[4..8].fill(2);
            b[8..12].fill(15);
            b[12..16].fill(0xF2);
            rng.fill(&mut b[16..]);
        }),
        // Q6_K super-block of 256 (210 bytes): 128 bytes of low nibbles, 64 of high
        // 2-bit pairs, 16 i8 sub-block scales, d (f16); x = d * scale * (q - 32),
        // q uniform in 0..64 (spread 18.5) with every scale 1.
        TensorFormat::Q6K => out.chunks_exact_mut(210).for_each(|b| {
            rng.fill(&mut b[..192]);
            b[192..208].fill(1);
            b[208..210].copy_from_slice(&half::f16::from_f32(sigma / 18.5).to_le_bytes());
        }),
        _ => unreachable!("checked against SYNTHETIC_FORMATS"),
    }
}

fn ones(n: usize) -> Vec<u8> {
    (0..n).flat_map(|_| 1.0f32.to_le_bytes()).collect()
}

/// Writes `out` (.ninfer) and, when given, `gguf_out` (the GGUF twin).
pub fn write_synthetic(
    geo: &Geometry,
    format: TensorFormat,
    seed: u64,
    tokenizer_source: &Path,
    out: &Path,
    gguf_out: Option<&Path>,
) -> Result<ArtifactMeta> {
    let tok_gguf = GgufFile::open(tokenizer_source)?;
    let (tokenizer_json, tokenizer) = tokenizer::tokenizer_from_gguf(&tok_gguf)
        .with_context(|| tokenizer_source.display().to_string())?;
    let n_vocab = tok_gguf.get_array("tokenizer.ggml.tokens")?.len();
    let d_head = geo.d_model / geo.n_heads;
    let d = geo.d_model;
    let n_kv = geo.n_kv_heads * d_head;

    // (name, shape (n_rows, n_cols), format) in GGUF order; norms are F32 ones.
    let mut plan: Vec<(String, usize, usize, TensorFormat)> = vec![(TOKEN_EMBD.into(), n_vocab, d, format)];
    for l in 0..geo.n_layers {
        plan.push((blk(l, "attn_norm.weight"), 1, d, TensorFormat::F32));
        plan.push((blk(l, "attn_q.weight"), d, d, format));
        plan.push((blk(l, "attn_k.weight"), n_kv, d, format));
        plan.push((blk(l, "attn_v.weight"), n_kv, d, format));
        plan.push((blk(l, "attn_output.weight"), d, d, format));
        plan.push((blk(l, "ffn_norm.weight"), 1, d, TensorFormat::F32));
        plan.push((blk(l, "ffn_gate.weight"), geo.d_ffn, d, format));
        plan.push((blk(l, "ffn_up.weight"), geo.d_ffn, d, format));
        plan.push((blk(l, "ffn_down.weight"), d, geo.d_ffn, format));
    }
    plan.push((OUTPUT_NORM.into(), 1, d, TensorFormat::F32));
    if !geo.tied {
        plan.push((OUTPUT.into(), n_vocab, d, format));
    }
    let mut tensors = Vec::with_capacity(plan.len());
    for (i, (name, n_rows, n_cols, fmt)) in plan.into_iter().enumerate() {
        let bytes = if name.ends_with("norm.weight") {
            ones(n_cols)
        } else {
            // Logits of a unit-RMS hidden state against rows of this spread have unit spread.
            let sigma = 1.0 / (n_cols as f32).sqrt();
            random_matrix(fmt, n_rows, n_cols, sigma, seed.wrapping_add(i as u64 * 0x1000_0000))?
        };
        let shape = if n_rows == 1 { vec![n_cols as u64] } else { vec![n_rows as u64, n_cols as u64] };
        tensors.push(TensorSource { name, component: Component::Text, format: fmt, shape, bytes: Cow::Owned(bytes) });
    }

    let hparams = HParams {
        n_layers: geo.n_layers,
        d_model: d,
        n_heads: geo.n_heads,
        n_kv_heads: geo.n_kv_heads,
        d_head,
        d_head_v: d_head,
        d_ffn: geo.d_ffn,
        n_vocab,
        rms_eps: 1e-5,
        rope_base: geo.rope_base,
        rope_base_local: geo.rope_base,
        rope_scale: 1.0,
        rope_dim: d_head,
        rope_style: RopeStyle::Normal,
        sliding_window: vec![None; geo.n_layers],
        context_length: 8192,
        embed_scale: 1.0,
        attn_scale: 1.0 / (d_head as f64).sqrt(),
        attn_softcap: None,
        final_softcap: None,
        activation: Activation::Silu,
        qkv_bias: false,
        qk_norm: false,
        post_norms: false,
        tied_embeddings: geo.tied,
        moe: None, hybrid: None,
    };
    let tok_bytes = std::fs::read(tokenizer_source).with_context(|| format!("read {}", tokenizer_source.display()))?;
    let meta = ArtifactMeta {
        architecture: Architecture::Llama,
        public_name: format!("synthetic {} {format} seed {seed}", geo.name),
        hparams: hparams.clone(),
        components: vec![Component::Text],
        tokenizer,
        provenance: Provenance {
            sources: vec![source_file(tokenizer_source, &tok_bytes)],
            converter: CONVERTER.into(),
            converter_version: env!("CARGO_PKG_VERSION").into(),
            source_layers: None,
            synthetic: Some(serde_json::json!({ "geometry": geo.name, "format": format.name(), "seed": seed })),
            source_metadata: serde_json::json!({}),
        },
        tensors: Vec::new(),
    };
    drop(tok_bytes);
    let meta = write_artifact(out, meta, &tensors, &tokenizer_json)?;

    if let Some(gguf_out) = gguf_out {
        write_gguf_twin(&hparams, &tok_gguf, &tensors, gguf_out, &meta.public_name)?;
    }
    Ok(meta)
}

fn write_gguf_twin(hp: &HParams, tok: &GgufFile, tensors: &[TensorSource<'_>], out: &Path, name: &str) -> Result<()> {
    let u32v = |v: usize| GgufValue::U32(v as u32);
    let mut metadata = vec![
        ("general.architecture".to_string(), GgufValue::String("llama".into())),
        ("general.name".to_string(), GgufValue::String(name.into())),
        ("llama.block_count".to_string(), u32v(hp.n_layers)),
        ("llama.context_length".to_string(), u32v(hp.context_length)),
        ("llama.embedding_length".to_string(), u32v(hp.d_model)),
        ("llama.feed_forward_length".to_string(), u32v(hp.d_ffn)),
        ("llama.attention.head_count".to_string(), u32v(hp.n_heads)),
        ("llama.attention.head_count_kv".to_string(), u32v(hp.n_kv_heads)),
        ("llama.rope.freq_base".to_string(), GgufValue::F32(hp.rope_base as f32)),
        ("llama.rope.dimension_count".to_string(), u32v(hp.rope_dim)),
        ("llama.attention.layer_norm_rms_epsilon".to_string(), GgufValue::F32(hp.rms_eps as f32)),
        ("llama.vocab_size".to_string(), u32v(hp.n_vocab)),
    ];
    metadata.extend(tok.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.")).cloned());
    let w = GgufWriter {
        metadata,
        tensors: tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.iter().rev().copied().collect(), t.format as u32, t.bytes.as_ref()))
            .collect(),
    };
    w.write(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::dequant::dequantize_matrix;

    /// Every format's random blocks decode (through the CPU decoder) to values of
    /// mean about 0 and standard deviation about sigma.
    #[test]
    fn random_blocks_have_the_asked_spread() {
        let (n_rows, n_cols, sigma) = (64, 1024, 0.03f32);
        for format in SYNTHETIC_FORMATS {
            let bytes = random_matrix(format, n_rows, n_cols, sigma, 5).unwrap();
            assert_eq!(bytes.len(), n_rows * format.row_bytes(n_cols).unwrap());
            let v = dequantize_matrix(format, &bytes, n_rows, n_cols).unwrap();
            let n = v.len() as f64;
            let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
            let sd = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
            assert!(mean.abs() < 0.15 * sigma as f64, "{format}: mean {mean}");
            assert!((sd / sigma as f64 - 1.0).abs() < 0.05, "{format}: sd {sd}, asked {sigma}");
        }
        assert!(random_matrix(TensorFormat::Q5K, 1, 256, sigma, 1).is_err());
    }

    #[test]
    fn llama_70b_geometry() {
        let g = geometry("llama-70b").unwrap();
        assert_eq!((g.n_layers, g.d_model, g.n_heads, g.n_kv_heads, g.d_ffn), (80, 8192, 64, 8, 28672));
    }
}
