//! Turning model sources (GGUF files, Hugging Face folders, seeded synthetic
//! geometries) into `.ninfer` v3 artifacts without requantization: every
//! tensor keeps its source block format byte for byte.

pub mod arch;
pub mod gguf;
pub mod hf;
pub mod synthetic;
pub mod tokenizer;

use std::borrow::Cow;
use std::ops::Range;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

use crate::artifact::container::sha256_hex;
use crate::artifact::format::TensorFormat;
use crate::artifact::meta::{Architecture, ArtifactMeta, Component, Provenance, SourceFile};
use crate::artifact::names::{OUTPUT, TOKEN_EMBD};
use crate::artifact::writer::{write_artifact, TensorSource};
use gguf::GgufFile;

pub const CONVERTER: &str = "ninfer-convert";

#[derive(Debug, Clone, Default)]
pub struct ConvertOptions {
    /// Keep only source blocks `A..B` (a qualification artifact).
    pub layers: Option<Range<usize>>,
}

/// Converts a `.gguf` file or a Hugging Face folder to `out`.
pub fn convert(source: &Path, out: &Path, opts: &ConvertOptions) -> Result<ArtifactMeta> {
    if source.is_dir() {
        hf::convert_hf(source, out, opts)
    } else {
        convert_gguf(source, out, opts)
    }
}

pub fn source_file(path: &Path, bytes: &[u8]) -> SourceFile {
    SourceFile {
        path: path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned()),
        n_bytes: bytes.len() as u64,
        sha256: sha256_hex(bytes),
    }
}

/// The block index of a `blk.N.*` name.
fn block_of(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (n, tail) = rest.split_once('.')?;
    Some((n.parse().ok()?, tail))
}

/// Applies `--layers A..B`: keeps blocks A..B-1 renumbered from 0, and every
/// non-block tensor. Returns the new name, or `None` for a dropped tensor.
pub fn select_layer_name(name: &str, layers: &Option<Range<usize>>) -> Option<String> {
    match (block_of(name), layers) {
        (Some((n, tail)), Some(r)) => r.contains(&n).then(|| format!("blk.{}.{tail}", n - r.start)),
        _ => Some(name.to_string()),
    }
}

/// Checks `--layers` against the source depth and narrows the hyperparameters.
pub fn apply_layers(meta: &mut ArtifactMeta, layers: &Option<Range<usize>>) -> Result<()> {
    if let Some(r) = layers {
        let n = meta.hparams.n_layers;
        if r.start >= r.end || r.end > n {
            bail!("--layers {}..{}: the source has blocks 0..{n}", r.start, r.end);
        }
        meta.hparams.n_layers = r.len();
        meta.hparams.sliding_window = meta.hparams.sliding_window[r.clone()].to_vec();
        meta.provenance.source_layers = Some(r.clone().collect());
    }
    Ok(())
}

fn convert_gguf(path: &Path, out: &Path, opts: &ConvertOptions) -> Result<ArtifactMeta> {
    let g = GgufFile::open(path)?;
    let ctx = |field: String| format!("{}: {field}", path.display());
    let arch_name = g.get_str("general.architecture")?;
    let arch = Architecture::from_name(arch_name)
        .ok_or_else(|| anyhow!("{}", ctx(format!("general.architecture {arch_name:?} is not supported ({})", Architecture::names()))))?;

    let mut tensors = Vec::with_capacity(g.tensors.len());
    for t in &g.tensors {
        let format = t.format().ok_or_else(|| {
            anyhow!("{}", ctx(format!("tensor {}: block format {} is not supported", t.name, TensorFormat::ggml_type_name(t.ggml_type))))
        })?;
        let Some(name) = select_layer_name(&t.name, &opts.layers) else { continue };
        let mut shape = t.shape();
        if arch == Architecture::Qwen3Next && name.ends_with("ffn_gate_inp_shexp.weight") && shape.len() == 1 {
            // llama.cpp declares the shared-expert gate as {n_embd}: a (1, d_model) matrix.
            shape.insert(0, 1);
        }
        tensors.push(TensorSource {
            name,
            component: Component::Text,
            format,
            shape,
            bytes: Cow::Borrowed(g.tensor_bytes(t)),
        });
    }
    let embd = g.tensor(TOKEN_EMBD).ok_or_else(|| anyhow!("{}", ctx(format!("tensor {TOKEN_EMBD} is missing"))))?;
    let n_vocab = embd.shape()[0] as usize;
    let tied = g.tensor(OUTPUT).is_none();
    let hparams = arch::hparams_from_gguf(&g, arch, n_vocab, tied).with_context(|| path.display().to_string())?;
    let (tokenizer_json, tokenizer) = tokenizer::tokenizer_from_gguf(&g).with_context(|| path.display().to_string())?;

    let source_bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    let source_metadata: serde_json::Map<String, serde_json::Value> = g
        .metadata
        .iter()
        .filter(|(k, _)| !k.starts_with("tokenizer.ggml.") || !matches!(k.as_str(), "tokenizer.ggml.tokens" | "tokenizer.ggml.scores" | "tokenizer.ggml.token_type" | "tokenizer.ggml.merges"))
        .map(|(k, v)| (k.clone(), v.to_json_summary()))
        .collect();
    let public_name = g
        .get("general.name")
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default());
    let mut meta = ArtifactMeta {
        architecture: arch,
        public_name,
        hparams,
        components: vec![Component::Text],
        tokenizer,
        provenance: Provenance {
            sources: vec![source_file(path, &source_bytes)],
            converter: CONVERTER.into(),
            converter_version: env!("CARGO_PKG_VERSION").into(),
            source_layers: None,
            synthetic: None,
            source_metadata: serde_json::Value::Object(source_metadata),
        },
        tensors: Vec::new(),
    };
    drop(source_bytes);
    apply_layers(&mut meta, &opts.layers)?;
    // Hyperparameters are checked against the tensors inside write_artifact; name the source.
    write_artifact(out, meta, &tensors, &tokenizer_json).with_context(|| path.display().to_string())
}
