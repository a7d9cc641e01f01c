//! Hugging Face folders (`config.json`, `*.safetensors`, `tokenizer.json`)
//! into artifacts. Float tensors keep their dtype (F32, F16, BF16) byte for
//! byte, with one documented exception: Gemma-3's RMSNorm multiplies by
//! `1 + w`, so its norm vectors are stored as F32 `1 + w` (the GGUF
//! convention), which the forward pass then uses as plain `x * w`.
//!
//! Mixture-of-experts folders (qwen3_moe) hold one matrix per expert
//! (`mlp.experts.{e}.gate_proj.weight`, the Hub layout) or transformers'
//! fused banks (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); both
//! become the GGUF banks `ffn_{gate,up,down}_exps` `(n_experts, rows, cols)`,
//! expert-major, each expert's bytes copied unchanged. The banks are
//! assembled in memory before the artifact is written, so converting a MoE
//! folder needs about its expert bytes in RAM (a GGUF source needs none:
//! its banks are already contiguous and are borrowed from the map).
//!
//! Qwen3-Next folders (qwen3_next) become llama.cpp's layout: each
//! `linear_attn.in_proj_qkvz` (rows grouped per key head as q, k, v, z) is
//! split into `attn_qkv` (all q rows, all k rows, all v rows) and
//! `attn_gate` (all z rows), rows moved whole with their bytes unchanged;
//! `A_log` is stored as F32 `ssm_a = -exp(A_log)`; the zero-centered norms
//! as F32 `1 + w` (not the gated `ssm_norm`); `conv1d` `(C, 1, K)` as
//! `(C, K)`.

use std::borrow::Cow;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::arch::{ExpertBank, ExpertPart, ExpertTensor};
use super::{apply_layers, arch, select_layer_name, source_file, tokenizer, ConvertOptions, CONVERTER};
use crate::artifact::format::TensorFormat;
use crate::artifact::meta::{Architecture, ArtifactMeta, Component, HParams, HybridParams, Provenance};
use crate::artifact::names::OUTPUT;
use crate::artifact::writer::{write_artifact, TensorSource};

fn list_safetensors(folder: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(folder)
        .with_context(|| format!("read folder {}", folder.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("{}: no *.safetensors file", folder.display());
    }
    Ok(files)
}

fn is_gemma_norm(name: &str) -> bool {
    name.ends_with("norm.weight")
}

fn component_of(name: &str) -> Option<Component> {
    if name.starts_with("vision_tower.") || name.starts_with("multi_modal_projector.") || name.contains(".vision_tower.") {
        Some(Component::Vision)
    } else if name.starts_with("mtp.") || name.contains(".mtp.") {
        Some(Component::Mtp)
    } else {
        None
    }
}

pub fn convert_hf(folder: &Path, out: &Path, opts: &ConvertOptions) -> Result<ArtifactMeta> {
    let tok_path = folder.join("tokenizer.json");
    if !tok_path.is_file() {
        bail!("{}: tokenizer.json is missing (a Hugging Face folder needs config.json, *.safetensors and tokenizer.json)", folder.display());
    }
    let cfg_path = folder.join("config.json");
    let cfg_bytes = std::fs::read(&cfg_path).with_context(|| format!("read {}", cfg_path.display()))?;
    let cfg: serde_json::Value =
        serde_json::from_slice(&cfg_bytes).map_err(|e| anyhow!("{}: {e}", cfg_path.display()))?;
    let arch = arch::architecture_from_config(&cfg).with_context(|| cfg_path.display().to_string())?;
    let tokenizer_json = std::fs::read(&tok_path).with_context(|| format!("read {}", tok_path.display()))?;
    let tokenizer = tokenizer::tokenizer_policy_from_hf(folder)?;

    let files = list_safetensors(folder)?;
    let mut maps = Vec::with_capacity(files.len());
    for f in &files {
        let file = File::open(f).with_context(|| format!("open {}", f.display()))?;
        // SAFETY: read-only map of a file nobody writes while we convert.
        maps.push(unsafe { Mmap::map(&file) }.with_context(|| format!("mmap {}", f.display()))?);
    }
    let mut sources = Vec::with_capacity(files.len() + 2);
    sources.push(source_file(&cfg_path, &cfg_bytes));
    sources.push(source_file(&tok_path, &tokenizer_json));
    let mut tensors: Vec<TensorSource<'_>> = Vec::new();
    let mut experts: Vec<ExpertSource<'_>> = Vec::new();
    let mut skipped = Vec::new();
    // Qwen3-Next's DeltaNet geometry, to reorder in_proj_qkvz while reading.
    let hybrid = match arch {
        Architecture::Qwen3Next => arch::hparams_from_config(&cfg, arch, true).with_context(|| cfg_path.display().to_string())?.hybrid,
        _ => None,
    };
    for (f, map) in files.iter().zip(&maps) {
        sources.push(source_file(f, map));
        let st = SafeTensors::deserialize(map).map_err(|e| anyhow!("{}: header: {e}", f.display()))?;
        let mut names = st.names();
        names.sort();
        for hf_name in names {
            let view = st.tensor(hf_name).map_err(|e| anyhow!("{}: tensor {hf_name}: {e}", f.display()))?;
            let format = match view.dtype() {
                Dtype::F32 => TensorFormat::F32,
                Dtype::F16 => TensorFormat::F16,
                Dtype::BF16 => TensorFormat::Bf16,
                other => bail!("{}: tensor {hf_name}: dtype {other:?} is not supported (F32, F16, BF16)", f.display()),
            };
            if let Some(part) = arch::hf_expert_part(arch, hf_name) {
                let shape = view.shape().to_vec();
                experts.push(ExpertSource { part, file: f.clone(), hf_name: hf_name.to_string(), format, shape, bytes: view.data() });
                continue;
            }
            if let (Some(h), Some(layer)) = (&hybrid, qkvz_layer(hf_name)) {
                for (name, shape, bytes) in split_qkvz(h, layer, format, view.shape(), view.data())
                    .with_context(|| format!("{}: tensor {hf_name}", f.display()))?
                {
                    let Some(name) = select_layer_name(&name, &opts.layers) else { continue };
                    tensors.push(TensorSource { name, component: Component::Text, format, shape, bytes: Cow::Owned(bytes) });
                }
                continue;
            }
            let (name, component) = match (arch::hf_tensor_name(arch, hf_name), component_of(hf_name)) {
                (Some(n), _) => (n, Component::Text),
                (None, Some(c)) => (hf_name.to_string(), c),
                (None, None) => {
                    skipped.push(hf_name.to_string());
                    continue;
                }
            };
            let Some(name) = select_layer_name(&name, &opts.layers) else { continue };
            let mut shape: Vec<u64> = view.shape().iter().map(|&d| d as u64).collect();
            let text = component == Component::Text;
            let (format, bytes) = if arch == Architecture::Gemma3 && text && is_gemma_norm(&name) {
                (TensorFormat::F32, Cow::Owned(gemma_norm_plus_one(format, view.data())))
            } else if arch == Architecture::Qwen3Next && text && is_gemma_norm(&name) && !name.ends_with("ssm_norm.weight") {
                // Qwen3NextRMSNorm multiplies by 1 + w, as Gemma's does (the gated ssm_norm does not).
                (TensorFormat::F32, Cow::Owned(gemma_norm_plus_one(format, view.data())))
            } else if arch == Architecture::Qwen3Next && name.ends_with(".ssm_a") {
                // llama.cpp stores A = -exp(A_log).
                let a: Vec<u8> = f32_values(format, view.data()).iter().flat_map(|&v| (-(v as f64).exp() as f32).to_le_bytes()).collect();
                (TensorFormat::F32, Cow::Owned(a))
            } else {
                (format, Cow::Borrowed(view.data()))
            };
            if arch == Architecture::Qwen3Next && name.ends_with("ssm_conv1d.weight") && shape.len() == 3 && shape[1] == 1 {
                // Conv1d's (channels, 1, width): the middle axis is the group's single input channel.
                shape.remove(1);
            }
            tensors.push(TensorSource { name, component, format, shape, bytes });
        }
    }
    let mut components = vec![Component::Text];
    for t in &tensors {
        if !components.contains(&t.component) {
            components.push(t.component);
        }
    }
    let tied = !tensors.iter().any(|t| t.name == OUTPUT);
    let hparams = arch::hparams_from_config(&cfg, arch, tied).with_context(|| cfg_path.display().to_string())?;
    tensors.extend(expert_banks(folder, &hparams, &experts, &opts.layers)?);
    let public_name = cfg
        .get("_name_or_path")
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .unwrap_or_else(|| folder.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default());
    let mut source_metadata = serde_json::json!({ "config": cfg });
    if !skipped.is_empty() {
        source_metadata["skipped_tensors"] = serde_json::json!(skipped);
    }
    let mut meta = ArtifactMeta {
        architecture: arch,
        public_name,
        hparams,
        components,
        tokenizer,
        provenance: Provenance {
            sources,
            converter: CONVERTER.into(),
            converter_version: env!("CARGO_PKG_VERSION").into(),
            source_layers: None,
            synthetic: None,
            source_metadata,
        },
        tensors: Vec::new(),
    };
    apply_layers(&mut meta, &opts.layers)?;
    // Hyperparameters are checked against the tensors inside write_artifact; name the source.
    write_artifact(out, meta, &tensors, &tokenizer_json).with_context(|| folder.display().to_string())
}

/// One expert tensor of the folder, before it joins its bank.
struct ExpertSource<'a> {
    part: ExpertPart,
    file: PathBuf,
    hf_name: String,
    format: TensorFormat,
    /// Hugging Face shape, outermost first.
    shape: Vec<usize>,
    bytes: &'a [u8],
}

/// The expert banks of every kept layer, expert-major, from the folder's
/// per-expert or fused expert tensors. Errors name the folder or file, the
/// tensor and the config field it disagrees with.
fn expert_banks<'a>(
    folder: &Path,
    hp: &HParams,
    experts: &[ExpertSource<'a>],
    layers: &Option<std::ops::Range<usize>>,
) -> Result<Vec<TensorSource<'a>>> {
    let Some(moe) = hp.moe else {
        return Ok(Vec::new());
    };
    let (n_e, d, f) = (moe.n_experts, hp.d_model, moe.d_ffn_expert);
    if let Some(x) = experts.iter().find(|x| x.part.layer >= hp.n_layers) {
        bail!("{}: tensor {}: layer {} but config.json num_hidden_layers is {}", x.file.display(), x.hf_name, x.part.layer, hp.n_layers);
    }
    let mut out = Vec::new();
    for l in 0..hp.n_layers {
        let in_layer: Vec<&ExpertSource> = experts.iter().filter(|x| x.part.layer == l).collect();
        let fused_gate_up = in_layer.iter().find(|x| x.part.kind == ExpertTensor::FusedGateUp);
        let fused_down = in_layer.iter().find(|x| x.part.kind == ExpertTensor::FusedDown);
        for bank in ExpertBank::ALL {
            let name = format!("blk.{l}.{}.weight", bank.gguf_group());
            let (rows, cols) = if bank == ExpertBank::Down { (d, f) } else { (f, d) };
            let fused = if bank == ExpertBank::Down { fused_down } else { fused_gate_up };
            let (format, bytes) = match fused {
                Some(x) => {
                    let want_rows = if bank == ExpertBank::Down { d } else { 2 * f };
                    if x.shape != [n_e, want_rows, cols] {
                        bail!(
                            "{}: tensor {} has shape {:?}; config.json (num_experts {n_e}, hidden_size {d}, moe_intermediate_size {f}) implies {:?}",
                            x.file.display(), x.hf_name, x.shape, [n_e, want_rows, cols]
                        );
                    }
                    let row_bytes = x.format.row_bytes(cols)?;
                    let per_expert = want_rows * row_bytes;
                    // Gate rows come first in each expert's gate_up block (transformers' `chunk(2)`).
                    let rows_kept = match bank {
                        ExpertBank::Gate => 0..f,
                        ExpertBank::Up => f..2 * f,
                        ExpertBank::Down => 0..d,
                    };
                    let mut b = Vec::with_capacity(n_e * rows * row_bytes);
                    for e in 0..n_e {
                        let base = e * per_expert;
                        b.extend_from_slice(&x.bytes[base + rows_kept.start * row_bytes..base + rows_kept.end * row_bytes]);
                    }
                    (x.format, b)
                }
                None => {
                    let mut b = Vec::new();
                    let mut format = None;
                    for e in 0..n_e {
                        let hf = bank.hf_name(l, e);
                        let x = in_layer
                            .iter()
                            .find(|x| x.part.kind == ExpertTensor::One { expert: e, bank })
                            .with_context(|| format!("{}: tensor {hf} is missing (config.json num_experts is {n_e})", folder.display()))?;
                        if x.shape != [rows, cols] {
                            bail!(
                                "{}: tensor {hf} has shape {:?}; config.json (hidden_size {d}, moe_intermediate_size {f}) implies {:?}",
                                x.file.display(), x.shape, [rows, cols]
                            );
                        }
                        if *format.get_or_insert(x.format) != x.format {
                            bail!("{}: tensor {hf} is {}, expert 0 of its bank is {}", x.file.display(), x.format, format.unwrap_or(x.format));
                        }
                        b.extend_from_slice(x.bytes);
                    }
                    (format.unwrap_or(TensorFormat::F32), b)
                }
            };
            let Some(name) = select_layer_name(&name, layers) else { continue };
            out.push(TensorSource {
                name,
                component: Component::Text,
                format,
                shape: vec![n_e as u64, rows as u64, cols as u64],
                bytes: Cow::Owned(bytes),
            });
        }
        if let Some(x) = in_layer.iter().find(|x| matches!(x.part.kind, ExpertTensor::One { expert, .. } if expert >= n_e)) {
            bail!("{}: tensor {}: expert index beyond config.json num_experts {n_e}", x.file.display(), x.hf_name);
        }
    }
    Ok(out)
}

/// The values of an F32, F16 or BF16 tensor.
fn f32_values(format: TensorFormat, bytes: &[u8]) -> Vec<f32> {
    match format {
        TensorFormat::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        TensorFormat::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        _ => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
    }
}

/// `1 + w` as F32 little-endian bytes.
fn gemma_norm_plus_one(format: TensorFormat, bytes: &[u8]) -> Vec<u8> {
    f32_values(format, bytes).iter().flat_map(|v| (1.0 + v).to_le_bytes()).collect()
}

/// The layer of a Qwen3-Next `linear_attn.in_proj_qkvz.weight`.
fn qkvz_layer(hf_name: &str) -> Option<usize> {
    let rest = hf_name.strip_prefix("model.layers.")?.strip_suffix(".linear_attn.in_proj_qkvz.weight")?;
    rest.parse().ok()
}

/// A tensor made at conversion: GGUF-style name, shape, bytes.
type MadeTensor = (String, Vec<u64>, Vec<u8>);

/// `in_proj_qkvz` `(n_k_heads * (2 d_k + 2 r d_v), d_model)`, `r = n_v_heads /
/// n_k_heads`, grouped per key head as `[q, k, v, z]` (transformers'
/// `fix_query_key_value_ordering`), as llama.cpp stores it: `attn_qkv` (all
/// q rows, then all k rows, then all v rows) and `attn_gate` (all z rows).
/// Rows are moved whole, their bytes unchanged.
fn split_qkvz(h: &HybridParams, layer: usize, format: TensorFormat, shape: &[usize], bytes: &[u8]) -> Result<[MadeTensor; 2]> {
    let (nk, dk, rdv) = (h.n_k_heads, h.d_k, h.n_v_heads / h.n_k_heads * h.d_v);
    let per_group = 2 * dk + 2 * rdv;
    let [rows, cols] = shape else { bail!("shape {shape:?} is not 2-D") };
    if *rows != nk * per_group {
        bail!(
            "shape {shape:?}: {rows} rows, config.json (linear_num_key_heads {nk}, linear_key_head_dim {dk}, linear_num_value_heads {}, \
             linear_value_head_dim {}) implies {}",
            h.n_v_heads,
            h.d_v,
            nk * per_group
        );
    }
    let row_bytes = format.row_bytes(*cols)?;
    let part = |lo: usize, n: usize| -> Vec<u8> {
        (0..nk).flat_map(|g| bytes[(g * per_group + lo) * row_bytes..(g * per_group + lo + n) * row_bytes].iter().copied()).collect()
    };
    let mut qkv = part(0, dk);
    qkv.extend(part(dk, dk));
    qkv.extend(part(2 * dk, rdv));
    let z = part(2 * dk + rdv, rdv);
    Ok([
        (format!("blk.{layer}.attn_qkv.weight"), vec![(nk * (2 * dk + rdv)) as u64, *cols as u64], qkv),
        (format!("blk.{layer}.attn_gate.weight"), vec![(nk * rdv) as u64, *cols as u64], z),
    ])
}
