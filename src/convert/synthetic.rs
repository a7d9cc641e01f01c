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
use crate::artifact::meta::{Activation, Architecture, ArtifactMeta, Component, HParams, Provenance, RopeStyle, TokenizerMeta};
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
    /// The trained context the artifact records (`--context-length` replaces it).
    pub context_length: usize,
}

pub const GEOMETRIES: [Geometry; 3] = [
    Geometry { name: "smollm2-135m", n_layers: 30, d_model: 576, n_heads: 9, n_kv_heads: 3, d_ffn: 1536, rope_base: 100_000.0, tied: true, context_length: 8192 },
    // Llama-3-8B's body; its trained context, 8192, caps --context at 32768 even with
    // --rope-yarn-factor 4, so long-context runs write it with --context-length.
    Geometry { name: "llama-8b", n_layers: 32, d_model: 4096, n_heads: 32, n_kv_heads: 8, d_ffn: 14336, rope_base: 500_000.0, tied: false, context_length: 8192 },
    // Llama-3-70B's body (about 40 GB as Q4_0 with a 49k vocabulary): write it with
    // no --gguf-twin where disk is short.
    Geometry { name: "llama-70b", n_layers: 80, d_model: 8192, n_heads: 64, n_kv_heads: 8, d_ffn: 28672, rope_base: 500_000.0, tied: false, context_length: 8192 },
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

/// The largest `--context-length` a synthetic artifact may record (2^20 positions).
pub const MAX_CONTEXT_LENGTH: usize = 1 << 20;

/// `ninfer-convert --synthetic ... --context-length N`: the trained context the
/// artifact (and its GGUF twin's `*.context_length`) records in place of the
/// geometry's own, a whole number of positions in 1..=[`MAX_CONTEXT_LENGTH`].
/// It only moves the ceiling `--context` is checked against (times
/// `--rope-yarn-factor`) and YaRN's original context; the weights stay the same.
pub fn parse_context_length(s: &str) -> Result<usize> {
    let bad = || anyhow::anyhow!("--context-length {s:?}: expected a whole number of positions from 1 to {MAX_CONTEXT_LENGTH}");
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX_CONTEXT_LENGTH).contains(&n) => Ok(n),
        _ => Err(bad()),
    }
}

/// Formats whose random blocks we can generate.
pub const SYNTHETIC_FORMATS: [TensorFormat; 8] = [
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
        // Every format's values have mean zero: codes with a mean offset give
        // every row of every matrix a common component along the all-ones
        // direction, which compounds through the layers until every token's
        // hidden state points the same way (a MoE router then sends every token
        // to the same experts).
        // Q4_0: x = d*(q - 8); codes uniform in 1..=15 (-7..7, standard deviation ~4.32).
        TensorFormat::Q4_0 => out.chunks_exact_mut(18).for_each(|b| {
            b[0..2].copy_from_slice(&half::f16::from_f32(sigma / 4.32).to_le_bytes());
            b[2..].iter_mut().for_each(|c| *c = rng.gen_range(1u8..16) | (rng.gen_range(1u8..16) << 4));
        }),
        // Q4_1: x = d*q + m; codes uniform in 0..=15 (standard deviation ~4.61), m = -7.5d centres them.
        TensorFormat::Q4_1 => out.chunks_exact_mut(20).for_each(|b| {
            let d = sigma / 4.61;
            b[0..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
            b[2..4].copy_from_slice(&half::f16::from_f32(-7.5 * d).to_le_bytes());
            rng.fill(&mut b[4..]);
        }),
        // Q8_0: i8 codes uniform in -127..=127 (standard deviation ~73.6).
        TensorFormat::Q8_0 => out.chunks_exact_mut(34).for_each(|b| {
            b[0..2].copy_from_slice(&half::f16::from_f32(sigma / 73.6).to_le_bytes());
            b[2..].iter_mut().for_each(|c| *c = rng.gen_range(-127i8..=127) as u8);
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
        // q uniform in 0..64 (spread 18.5, mean -0.5) with the sub-block scales
        // alternating +1 and -1, so the offsets cancel over every super-block.
        TensorFormat::Q6K => out.chunks_exact_mut(210).for_each(|b| {
            rng.fill(&mut b[..192]);
            b[192..208].iter_mut().enumerate().for_each(|(j, c)| *c = if j % 2 == 0 { 1 } else { (-1i8) as u8 });
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
    let (tok_gguf, tokenizer_json, tokenizer, n_vocab) = tokenizer_of(tokenizer_source)?;
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
        context_length: geo.context_length,
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
    let meta = synthetic_meta(Architecture::Llama, geo.name, format, seed, &hparams, tokenizer, tokenizer_source)?;
    let meta = write_artifact(out, meta, &tensors, &tokenizer_json)?;

    if let Some(gguf_out) = gguf_out {
        write_gguf_twin(&hparams, &tok_gguf, &tensors, gguf_out, &meta.public_name)?;
    }
    Ok(meta)
}

/// The tokenizer of a synthetic model, from the GGUF `source`: the file, the
/// tokenizer.json bytes, its metadata and the vocabulary size.
fn tokenizer_of(source: &Path) -> Result<(GgufFile, Vec<u8>, TokenizerMeta, usize)> {
    let g = GgufFile::open(source)?;
    let (json, meta) = tokenizer::tokenizer_from_gguf(&g).with_context(|| source.display().to_string())?;
    let n_vocab = g.get_array("tokenizer.ggml.tokens")?.len();
    Ok((g, json, meta, n_vocab))
}

/// The metadata of a synthetic artifact of `geometry` (tensors filled in by the writer).
fn synthetic_meta(
    architecture: Architecture,
    geometry: &str,
    format: TensorFormat,
    seed: u64,
    hparams: &HParams,
    tokenizer: TokenizerMeta,
    tokenizer_source: &Path,
) -> Result<ArtifactMeta> {
    let tok_bytes = std::fs::read(tokenizer_source).with_context(|| format!("read {}", tokenizer_source.display()))?;
    Ok(ArtifactMeta {
        architecture,
        public_name: format!("synthetic {geometry} {format} seed {seed}"),
        hparams: hparams.clone(),
        components: vec![Component::Text],
        tokenizer,
        provenance: Provenance {
            sources: vec![source_file(tokenizer_source, &tok_bytes)],
            converter: CONVERTER.into(),
            converter_version: env!("CARGO_PKG_VERSION").into(),
            source_layers: None,
            synthetic: Some(serde_json::json!({
                "geometry": geometry,
                "format": format.name(),
                "seed": seed,
                "context_length": hparams.context_length,
            })),
            source_metadata: serde_json::json!({}),
        },
        tensors: Vec::new(),
    })
}

fn write_gguf_twin(hp: &HParams, tok: &GgufFile, tensors: &[TensorSource<'_>], out: &Path, name: &str) -> Result<()> {
    let u32v = |v: usize| GgufValue::U32(v as u32);
    let metadata = vec![
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
    write_gguf(metadata, tok, tensors, out)
}

/// A GGUF file of `metadata`, `tok`'s tokenizer keys and `tensors` (shapes
/// reversed into GGUF order, bytes as they are).
fn write_gguf(mut metadata: Vec<(String, GgufValue)>, tok: &GgufFile, tensors: &[TensorSource<'_>], out: &Path) -> Result<()> {
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

// --- moe: mixture-of-experts geometries (qwen3moe) ---------------------------

/// A named mixture-of-experts model shape (qwen3moe: routed SwiGLU experts,
/// `norm_topk_prob`, no shared expert, QK norm, NeoX RoPE), kept apart from
/// the dense [`GEOMETRIES`].
#[derive(Debug, Clone, Copy)]
pub struct MoeGeometry {
    pub name: &'static str,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Per-head width (qwen3moe's heads are not d_model / n_heads wide).
    pub d_head: usize,
    pub n_experts: usize,
    /// Experts per token (top-k).
    pub n_experts_used: usize,
    pub d_ffn_expert: usize,
    /// `feed_forward_length` (config `intermediate_size`): informational for a MoE model.
    pub d_ffn: usize,
    pub rope_base: f64,
    pub context_length: usize,
}

/// Qwen3-30B-A3B's body (its config.json: 48 layers, hidden 2048, 32/4 heads
/// of 128, 128 experts of 768, top 8, intermediate 6144, RoPE base 1e6,
/// 40960 positions), and a tiny shape of the same family for tests.
pub const MOE_GEOMETRIES: [MoeGeometry; 2] = [
    MoeGeometry {
        name: "qwen3moe-30b-a3b",
        n_layers: 48,
        d_model: 2048,
        n_heads: 32,
        n_kv_heads: 4,
        d_head: 128,
        n_experts: 128,
        n_experts_used: 8,
        d_ffn_expert: 768,
        d_ffn: 6144,
        rope_base: 1_000_000.0,
        context_length: 40960,
    },
    MoeGeometry {
        name: "qwen3moe-tiny",
        n_layers: 2,
        d_model: 64,
        n_heads: 4,
        n_kv_heads: 2,
        d_head: 32,
        n_experts: 8,
        n_experts_used: 3,
        d_ffn_expert: 64,
        d_ffn: 128,
        rope_base: 1_000_000.0,
        context_length: 4096,
    },
];

/// The MoE geometry called `name`, if it is one (the dense ones are [`geometry`]'s).
pub fn moe_geometry(name: &str) -> Option<MoeGeometry> {
    MOE_GEOMETRIES.iter().find(|g| g.name == name).copied()
}

/// Every synthetic geometry name, dense and MoE, for messages.
pub fn all_geometry_names() -> String {
    GEOMETRIES.iter().map(|g| g.name).chain(MOE_GEOMETRIES.iter().map(|g| g.name)).collect::<Vec<_>>().join(", ")
}

/// qwen3moe's RMSNorm epsilon as its GGUF stores it (an f32), so the
/// artifact and the one converted from its twin agree to the bit.
const QWEN3MOE_RMS_EPS: f32 = 1e-6;

/// The hyperparameters of `geo` exactly as [`super::arch::hparams_from_gguf`]
/// derives them from the twin's metadata.
fn moe_hparams(geo: &MoeGeometry, n_vocab: usize) -> HParams {
    HParams {
        n_layers: geo.n_layers,
        d_model: geo.d_model,
        n_heads: geo.n_heads,
        n_kv_heads: geo.n_kv_heads,
        d_head: geo.d_head,
        d_head_v: geo.d_head,
        d_ffn: geo.d_ffn,
        n_vocab,
        rms_eps: QWEN3MOE_RMS_EPS as f64,
        rope_base: geo.rope_base,
        rope_base_local: geo.rope_base,
        rope_scale: 1.0,
        rope_dim: geo.d_head,
        rope_style: RopeStyle::Neox,
        sliding_window: vec![None; geo.n_layers],
        context_length: geo.context_length,
        embed_scale: 1.0,
        attn_scale: 1.0 / (geo.d_head as f64).sqrt(),
        attn_softcap: None,
        final_softcap: None,
        activation: Activation::Silu,
        qkv_bias: false,
        qk_norm: true,
        post_norms: false,
        tied_embeddings: false,
        moe: Some(crate::artifact::meta::MoeParams {
            n_experts: geo.n_experts,
            n_experts_used: geo.n_experts_used,
            d_ffn_expert: geo.d_ffn_expert,
            norm_topk_prob: true,
        }),
        hybrid: None,
    }
}

/// Writes a qwen3moe synthetic model of `geo`: `out` (.ninfer) and, when
/// given, `gguf_out`, a GGUF twin with llama.cpp's qwen3moe keys and tensor
/// names (`blk.N.ffn_{gate,up,down}_exps.weight` banks of GGUF shape
/// `[n_in, n_out, n_experts]`, `ffn_gate_inp`, `attn_{q,k}_norm`). Every
/// matrix and expert bank is in `format`; the router and the norms are F32,
/// as llama.cpp's quantizer leaves them.
pub fn write_synthetic_moe(
    geo: &MoeGeometry,
    format: TensorFormat,
    seed: u64,
    tokenizer_source: &Path,
    out: &Path,
    gguf_out: Option<&Path>,
) -> Result<ArtifactMeta> {
    let (tok_gguf, tokenizer_json, tokenizer, n_vocab) = tokenizer_of(tokenizer_source)?;
    let (d, n_q, n_kv) = (geo.d_model, geo.n_heads * geo.d_head, geo.n_kv_heads * geo.d_head);
    let (n_e, fe) = (geo.n_experts, geo.d_ffn_expert);

    // (name, artifact shape (rows first), format) in GGUF order; norms are F32 ones.
    let mut plan: Vec<(String, Vec<usize>, TensorFormat)> = vec![(TOKEN_EMBD.into(), vec![n_vocab, d], format)];
    for l in 0..geo.n_layers {
        plan.push((blk(l, "attn_norm.weight"), vec![d], TensorFormat::F32));
        plan.push((blk(l, "attn_q.weight"), vec![n_q, d], format));
        plan.push((blk(l, "attn_k.weight"), vec![n_kv, d], format));
        plan.push((blk(l, "attn_v.weight"), vec![n_kv, d], format));
        plan.push((blk(l, "attn_output.weight"), vec![d, n_q], format));
        plan.push((blk(l, "attn_q_norm.weight"), vec![geo.d_head], TensorFormat::F32));
        plan.push((blk(l, "attn_k_norm.weight"), vec![geo.d_head], TensorFormat::F32));
        plan.push((blk(l, "ffn_norm.weight"), vec![d], TensorFormat::F32));
        plan.push((blk(l, "ffn_gate_inp.weight"), vec![n_e, d], TensorFormat::F32));
        plan.push((blk(l, "ffn_gate_exps.weight"), vec![n_e, fe, d], format));
        plan.push((blk(l, "ffn_up_exps.weight"), vec![n_e, fe, d], format));
        plan.push((blk(l, "ffn_down_exps.weight"), vec![n_e, d, fe], format));
    }
    plan.push((OUTPUT_NORM.into(), vec![d], TensorFormat::F32));
    plan.push((OUTPUT.into(), vec![n_vocab, d], format));
    let mut tensors = Vec::with_capacity(plan.len());
    for (i, (name, shape, fmt)) in plan.into_iter().enumerate() {
        let n_cols = *shape.last().context("synthetic: a tensor without a shape")?;
        let n_rows: usize = shape.iter().rev().skip(1).product();
        let bytes = if name.ends_with("norm.weight") {
            ones(n_cols)
        } else {
            // Unit-RMS inputs against rows of this spread give unit-spread outputs
            // (router logits included, so routing is neither flat nor one-hot).
            let sigma = 1.0 / (n_cols as f32).sqrt();
            random_matrix(fmt, n_rows, n_cols, sigma, seed.wrapping_add(i as u64 * 0x1000_0000))?
        };
        let shape = shape.iter().map(|&s| s as u64).collect();
        tensors.push(TensorSource { name, component: Component::Text, format: fmt, shape, bytes: Cow::Owned(bytes) });
    }

    let hparams = moe_hparams(geo, n_vocab);
    let meta = synthetic_meta(Architecture::Qwen3Moe, geo.name, format, seed, &hparams, tokenizer, tokenizer_source)?;
    let meta = write_artifact(out, meta, &tensors, &tokenizer_json)?;
    if let Some(gguf_out) = gguf_out {
        write_gguf_twin_moe(&hparams, &tok_gguf, &tensors, gguf_out, &meta.public_name)?;
    }
    Ok(meta)
}

/// The qwen3moe GGUF twin: llama.cpp's `qwen3moe.*` keys (llama-arch.cpp
/// `LLM_KV_*` with the architecture prefix) and the tokenizer keys of `tok`.
fn write_gguf_twin_moe(hp: &HParams, tok: &GgufFile, tensors: &[TensorSource<'_>], out: &Path, name: &str) -> Result<()> {
    let moe = hp.moe.context("write_gguf_twin_moe: no MoE hyperparameters")?;
    let u32v = |v: usize| GgufValue::U32(v as u32);
    let a = Architecture::Qwen3Moe.name();
    let k = |key: &str| format!("{a}.{key}");
    let metadata = vec![
        ("general.architecture".to_string(), GgufValue::String(a.into())),
        ("general.name".to_string(), GgufValue::String(name.into())),
        (k("block_count"), u32v(hp.n_layers)),
        (k("context_length"), u32v(hp.context_length)),
        (k("embedding_length"), u32v(hp.d_model)),
        (k("feed_forward_length"), u32v(hp.d_ffn)),
        (k("expert_feed_forward_length"), u32v(moe.d_ffn_expert)),
        (k("expert_count"), u32v(moe.n_experts)),
        (k("expert_used_count"), u32v(moe.n_experts_used)),
        (k("attention.head_count"), u32v(hp.n_heads)),
        (k("attention.head_count_kv"), u32v(hp.n_kv_heads)),
        (k("attention.key_length"), u32v(hp.d_head)),
        (k("attention.value_length"), u32v(hp.d_head_v)),
        (k("attention.layer_norm_rms_epsilon"), GgufValue::F32(hp.rms_eps as f32)),
        (k("rope.freq_base"), GgufValue::F32(hp.rope_base as f32)),
        (k("vocab_size"), u32v(hp.n_vocab)),
    ];
    write_gguf(metadata, tok, tensors, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_without_a_generator_are_refused() {
        assert!(random_matrix(TensorFormat::Q5K, 1, 256, 0.03, 1).is_err());
    }

    #[test]
    fn context_length_values() {
        assert_eq!(parse_context_length("65536").unwrap(), 65536);
        assert_eq!(parse_context_length("1").unwrap(), 1);
        assert_eq!(parse_context_length(&MAX_CONTEXT_LENGTH.to_string()).unwrap(), MAX_CONTEXT_LENGTH);
        let too_big = (MAX_CONTEXT_LENGTH + 1).to_string();
        for bad in ["0", "", "-5", "+5", "1e5", "65536.0", " 65536", "abc", too_big.as_str(), "99999999999999999999999"] {
            let e = parse_context_length(bad).unwrap_err().to_string();
            assert!(e.starts_with("--context-length ") && e.contains("1 to 1048576") && !e.contains('\n'), "{bad:?}: {e}");
        }
    }

    #[test]
    fn llama_70b_geometry() {
        let g = geometry("llama-70b").unwrap();
        assert_eq!((g.n_layers, g.d_model, g.n_heads, g.n_kv_heads, g.d_ffn), (80, 8192, 64, 8, 28672));
    }
}
