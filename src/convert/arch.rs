//! Architecture mapping: source hyperparameters (GGUF metadata keys or a
//! Hugging Face `config.json`) into [`HParams`], and Hugging Face tensor names
//! into the artifact's GGUF-style names.
//!
//! Every default here is the one llama.cpp applies for that architecture, so a
//! GGUF and the artifact made from it describe the same computation.

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::gguf::GgufFile;
use crate::artifact::meta::{Activation, Architecture, HParams, HybridParams, MoeParams, RopeStyle};

/// Gemma-3: every sixth layer is global, the others slide (llama.cpp `set_swa_pattern(6)`).
const GEMMA3_SWA_PATTERN: usize = 6;
/// Gemma-3: RoPE base of the sliding layers (llama.cpp `rope_freq_base_train_swa`).
const GEMMA3_ROPE_BASE_LOCAL: f64 = 10_000.0;

/// Hyperparameters from a GGUF file's metadata.
pub fn hparams_from_gguf(g: &GgufFile, arch: Architecture, n_vocab: usize, tied: bool) -> Result<HParams> {
    let a = arch.name();
    let key = |k: &str| format!("{a}.{k}");
    let opt_u = |k: &str| g.get(&key(k)).and_then(|v| v.as_u64()).map(|v| v as usize);
    let opt_f = |k: &str| g.get(&key(k)).and_then(|v| v.as_f64());

    let n_layers = g.get_u64(&key("block_count"))? as usize;
    let d_model = g.get_u64(&key("embedding_length"))? as usize;
    let n_heads = g.get_u64(&key("attention.head_count"))? as usize;
    let n_kv_heads = opt_u("attention.head_count_kv").unwrap_or(n_heads);
    if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
        bail!("{a}.attention.head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}");
    }
    let d_head = opt_u("attention.key_length").unwrap_or(d_model / n_heads);
    let d_head_v = opt_u("attention.value_length").unwrap_or(d_head);
    let moe = match arch {
        Architecture::Qwen3Moe | Architecture::Qwen3Next => Some(moe_from_gguf(g, a)?),
        _ => None,
    };
    // A MoE model has no dense FFN: its feed_forward_length is informational.
    let d_ffn = match (opt_u("feed_forward_length"), moe) {
        (Some(f), _) => f,
        (None, Some(m)) => m.d_ffn_expert,
        (None, None) => g.get_u64(&key("feed_forward_length"))? as usize,
    };
    let rms_eps = g.get_f64(&key("attention.layer_norm_rms_epsilon"))?;
    let rope_base = opt_f("rope.freq_base").unwrap_or(10_000.0);
    let rope_dim = opt_u("rope.dimension_count").unwrap_or(d_head);
    let context_length = opt_u("context_length").unwrap_or(0);
    let rope_scale = match g.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
        None | Some("none") => 1.0,
        Some("linear") => opt_f("rope.scaling.factor").unwrap_or(1.0),
        Some(other) => bail!("{a}.rope.scaling.type: {other:?} is not supported (none, linear)"),
    };
    if g.tensor("rope_freqs.weight").is_some() {
        bail!("tensor rope_freqs.weight: per-frequency RoPE factors (llama3-style scaling) are not supported");
    }
    let sliding = opt_u("attention.sliding_window");

    let mut hp = HParams {
        n_layers,
        d_model,
        n_heads,
        n_kv_heads,
        d_head,
        d_head_v,
        d_ffn,
        n_vocab,
        rms_eps,
        rope_base,
        rope_base_local: rope_base,
        rope_scale,
        rope_dim,
        rope_style: RopeStyle::Neox,
        sliding_window: vec![None; n_layers],
        context_length,
        embed_scale: 1.0,
        attn_scale: 1.0 / (d_head as f64).sqrt(),
        attn_softcap: opt_f("attn_logit_softcapping"),
        final_softcap: opt_f("final_logit_softcapping"),
        activation: Activation::Silu,
        qkv_bias: false,
        qk_norm: false,
        post_norms: false,
        tied_embeddings: tied,
        moe,
        hybrid: None,
    };
    match arch {
        Architecture::Llama => {
            // convert_hf_to_gguf permutes Q/K rows of llama so adjacent pairs rotate.
            hp.rope_style = RopeStyle::Normal;
            if sliding.is_some() {
                bail!("{a}.attention.sliding_window: sliding attention is not supported for llama");
            }
        }
        Architecture::Gemma3 => {
            let w = sliding.with_context(|| format!("{}: metadata {a}.attention.sliding_window is missing", g.path.display()))?;
            hp.sliding_window = (0..n_layers)
                .map(|il| if (il + 1) % GEMMA3_SWA_PATTERN != 0 { Some(w) } else { None })
                .collect();
            hp.rope_base_local = GEMMA3_ROPE_BASE_LOCAL;
            // llama.cpp: 1/sqrt(n_embd_head_k), except Gemma-3-27B (query_pre_attn_scalar = d_model/n_heads).
            if n_layers == 62 {
                hp.attn_scale = 1.0 / ((d_model / n_heads) as f64).sqrt();
            }
        }
        Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => {}
        Architecture::Qwen3Next => hp.hybrid = Some(hybrid_from_gguf(g, a, n_layers)?),
    }
    apply_family_flags(&mut hp, arch);
    Ok(hp)
}

/// The layer schedule and DeltaNet geometry of a qwen3next GGUF, from the
/// keys llama.cpp writes and reads: `ssm.group_count` (key heads),
/// `ssm.time_step_rank` (value heads), `ssm.state_size` (key width),
/// `ssm.inner_size` (value heads times value width), `ssm.conv_kernel`,
/// `expert_shared_feed_forward_length`, and `attention.recurrent_layers`
/// (per layer) or else `full_attention_interval` (default 4; layer `i` is
/// full attention when `(i + 1) % interval == 0`).
fn hybrid_from_gguf(g: &GgufFile, a: &str, n_layers: usize) -> Result<HybridParams> {
    let file = g.path.display();
    let need = |k: &str| -> Result<usize> {
        let key = format!("{a}.{k}");
        let v = g.get(&key).with_context(|| format!("{file}: metadata {key} is missing (a {a} model needs it)"))?;
        v.as_u64().map(|v| v as usize).with_context(|| format!("{file}: metadata {key} is not an unsigned integer"))
    };
    let (n_k_heads, n_v_heads) = (need("ssm.group_count")?, need("ssm.time_step_rank")?);
    if n_k_heads == 0 || n_v_heads % n_k_heads != 0 {
        bail!("{file}: metadata {a}.ssm.time_step_rank {n_v_heads} is not a multiple of {a}.ssm.group_count {n_k_heads}");
    }
    let inner = need("ssm.inner_size")?;
    if n_v_heads == 0 || inner % n_v_heads != 0 {
        bail!("{file}: metadata {a}.ssm.inner_size {inner} is not a multiple of {a}.ssm.time_step_rank {n_v_heads}");
    }
    let key = format!("{a}.attention.recurrent_layers");
    let linear_layers = match g.get(&key) {
        Some(v) => {
            let arr = v.as_array().with_context(|| format!("{file}: metadata {key} is not an array"))?;
            if arr.len() < n_layers {
                bail!("{file}: metadata {key} has {} entries for {a}.block_count {n_layers}", arr.len());
            }
            arr[..n_layers]
                .iter()
                .enumerate()
                .map(|(i, x)| x.as_bool().with_context(|| format!("{file}: metadata {key}[{i}] is not a bool (a known layer type)")))
                .collect::<Result<Vec<bool>>>()?
        }
        None => {
            let every = g.get(&format!("{a}.full_attention_interval")).and_then(|v| v.as_u64()).unwrap_or(4) as usize;
            if every == 0 {
                bail!("{file}: metadata {a}.full_attention_interval is 0");
            }
            (0..n_layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    Ok(HybridParams {
        linear_layers,
        n_k_heads,
        n_v_heads,
        d_k: need("ssm.state_size")?,
        d_v: inner / n_v_heads,
        conv_kernel: need("ssm.conv_kernel")?,
        d_ffn_shared: need("expert_shared_feed_forward_length")?,
    })
}

/// The expert geometry of a MoE GGUF: `<arch>.expert_count` and
/// `<arch>.expert_used_count` (both required, as llama.cpp requires them),
/// `<arch>.expert_feed_forward_length` (llama.cpp's fallback when absent:
/// `feed_forward_length / expert_used_count`). llama.cpp's qwen3moe graph
/// always renormalizes the top-k weights (`build_moe_ffn(..., norm_w = true)`).
fn moe_from_gguf(g: &GgufFile, a: &str) -> Result<MoeParams> {
    let file = g.path.display();
    let need = |k: &str| -> Result<usize> {
        let key = format!("{a}.{k}");
        let v = g.get(&key).with_context(|| format!("{file}: metadata {key} is missing (a {a} model needs it)"))?;
        v.as_u64().map(|v| v as usize).with_context(|| format!("{file}: metadata {key} is not an unsigned integer"))
    };
    let n_experts = need("expert_count")?;
    let n_experts_used = need("expert_used_count")?;
    if n_experts == 0 || n_experts_used == 0 || n_experts_used > n_experts {
        bail!("{file}: metadata {a}.expert_used_count {n_experts_used} is not in 1..={a}.expert_count {n_experts}");
    }
    let d_ffn_expert = match g.get(&format!("{a}.expert_feed_forward_length")).and_then(|v| v.as_u64()) {
        Some(v) => v as usize,
        None => g.get_u64(&format!("{a}.feed_forward_length"))? as usize / n_experts_used,
    };
    Ok(MoeParams { n_experts, n_experts_used, d_ffn_expert, norm_topk_prob: true })
}

/// The expert geometry of a Qwen3-MoE `config.json`. Only the layout where
/// every layer is sparse (`decoder_sparse_step` 1, no `mlp_only_layers`, as
/// llama.cpp's qwen3moe graph assumes) is supported.
fn moe_from_config(cfg: &Value) -> Result<MoeParams> {
    let need = |k: &str| cfg_usize(cfg, k).with_context(|| format!("config.json: field {k} is missing (a qwen3_moe model needs it)"));
    let n_experts = need("num_experts")?;
    let n_experts_used = need("num_experts_per_tok")?;
    if n_experts == 0 || n_experts_used == 0 || n_experts_used > n_experts {
        bail!("config.json: field num_experts_per_tok {n_experts_used} is not in 1..=num_experts {n_experts}");
    }
    let step = cfg_usize(cfg, "decoder_sparse_step").unwrap_or(1);
    if step != 1 {
        bail!("config.json: field decoder_sparse_step {step}: only 1 (every layer routed) is supported");
    }
    if cfg.get("mlp_only_layers").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
        bail!("config.json: field mlp_only_layers: dense layers inside a qwen3_moe model are not supported");
    }
    Ok(MoeParams {
        n_experts,
        n_experts_used,
        d_ffn_expert: need("moe_intermediate_size")?,
        norm_topk_prob: cfg.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(false),
    })
}

/// What follows from the family alone, whatever the source: gemma3's
/// embedding scale, GeGLU, QK norm and post-norms; qwen2's QKV biases;
/// qwen3's QK norm.
fn apply_family_flags(hp: &mut HParams, arch: Architecture) {
    match arch {
        Architecture::Llama => {}
        Architecture::Gemma3 => {
            hp.embed_scale = (hp.d_model as f64).sqrt();
            hp.activation = Activation::GeluTanh;
            hp.qk_norm = true;
            hp.post_norms = true;
        }
        Architecture::Qwen2 => hp.qkv_bias = true,
        Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Qwen3Next => hp.qk_norm = true,
    }
}

fn cfg_usize(cfg: &Value, k: &str) -> Option<usize> {
    cfg.get(k).and_then(Value::as_u64).map(|v| v as usize)
}

fn cfg_f64(cfg: &Value, k: &str) -> Option<f64> {
    cfg.get(k).and_then(Value::as_f64)
}

/// Architecture from a Hugging Face config's `model_type`.
pub fn architecture_from_config(cfg: &Value) -> Result<Architecture> {
    let cfg = text_config(cfg);
    let mt = cfg.get("model_type").and_then(Value::as_str).context("config.json: field model_type is missing")?;
    Ok(match mt {
        "llama" => Architecture::Llama,
        "gemma3" | "gemma3_text" => Architecture::Gemma3,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        "qwen3_moe" => Architecture::Qwen3Moe,
        "qwen3_next" => Architecture::Qwen3Next,
        other => bail!(
            "config.json: model_type {other:?} is not supported (llama, gemma3, gemma3_text, qwen2, qwen3, qwen3_moe, qwen3_next)"
        ),
    })
}

/// Multimodal configs nest the language model under `text_config`.
pub fn text_config(cfg: &Value) -> &Value {
    cfg.get("text_config").filter(|t| t.get("hidden_size").is_some()).unwrap_or(cfg)
}

/// Hyperparameters from a Hugging Face `config.json`.
pub fn hparams_from_config(cfg_root: &Value, arch: Architecture, tied: bool) -> Result<HParams> {
    let cfg = text_config(cfg_root);
    let need = |k: &str| cfg_usize(cfg, k).with_context(|| format!("config.json: field {k} is missing"));
    let n_layers = need("num_hidden_layers")?;
    let d_model = need("hidden_size")?;
    let n_heads = need("num_attention_heads")?;
    let n_kv_heads = cfg_usize(cfg, "num_key_value_heads").unwrap_or(n_heads);
    let d_head = cfg_usize(cfg, "head_dim").unwrap_or(d_model / n_heads);
    let rope_base = cfg_f64(cfg, "rope_theta")
        .or_else(|| cfg.pointer("/rope_parameters/rope_theta").and_then(Value::as_f64))
        .or_else(|| cfg.pointer("/rope_parameters/full_attention/rope_theta").and_then(Value::as_f64))
        .unwrap_or(10_000.0);
    let rope_scale = match cfg.get("rope_scaling").filter(|v| !v.is_null()) {
        None => 1.0,
        Some(s) => match s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str) {
            Some("linear") => s.get("factor").and_then(Value::as_f64).unwrap_or(1.0),
            Some("default") | None => 1.0,
            Some(other) => bail!("config.json: rope_scaling type {other:?} is not supported (linear)"),
        },
    };
    let moe = match arch {
        Architecture::Qwen3Moe | Architecture::Qwen3Next => Some(moe_from_config(cfg)?),
        _ => None,
    };
    let d_ffn = match (cfg_usize(cfg, "intermediate_size"), moe) {
        (Some(f), _) => f,
        (None, Some(m)) => m.d_ffn_expert,
        (None, None) => need("intermediate_size")?,
    };
    let mut hp = HParams {
        n_layers,
        d_model,
        n_heads,
        n_kv_heads,
        d_head,
        d_head_v: d_head,
        d_ffn,
        n_vocab: need("vocab_size")?,
        rms_eps: cfg_f64(cfg, "rms_norm_eps").unwrap_or(1e-6),
        rope_base,
        rope_base_local: rope_base,
        rope_scale,
        rope_dim: d_head,
        rope_style: RopeStyle::Neox,
        sliding_window: vec![None; n_layers],
        context_length: cfg_usize(cfg, "max_position_embeddings").unwrap_or(0),
        embed_scale: 1.0,
        attn_scale: 1.0 / (d_head as f64).sqrt(),
        attn_softcap: cfg_f64(cfg, "attn_logit_softcapping"),
        final_softcap: cfg_f64(cfg, "final_logit_softcapping"),
        activation: Activation::Silu,
        qkv_bias: false,
        qk_norm: false,
        post_norms: false,
        tied_embeddings: tied,
        moe,
        hybrid: None,
    };
    match arch {
        Architecture::Llama => {}
        Architecture::Gemma3 => {
            let w = need("sliding_window")?;
            let layer_types = cfg.get("layer_types").and_then(Value::as_array);
            hp.sliding_window = (0..n_layers)
                .map(|il| {
                    let sliding = match layer_types {
                        Some(t) => t.get(il).and_then(Value::as_str) == Some("sliding_attention"),
                        None => (il + 1) % cfg_usize(cfg, "sliding_window_pattern").unwrap_or(GEMMA3_SWA_PATTERN) != 0,
                    };
                    sliding.then_some(w)
                })
                .collect();
            hp.rope_base_local = cfg_f64(cfg, "rope_local_base_freq").unwrap_or(GEMMA3_ROPE_BASE_LOCAL);
            let q = cfg_f64(cfg, "query_pre_attn_scalar").unwrap_or(d_head as f64);
            hp.attn_scale = 1.0 / q.sqrt();
        }
        Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => {}
        Architecture::Qwen3Next => {
            hp.hybrid = Some(hybrid_from_config(cfg, n_layers)?);
            let factor = cfg_f64(cfg, "partial_rotary_factor")
                .or_else(|| cfg.pointer("/rope_parameters/partial_rotary_factor").and_then(Value::as_f64))
                .unwrap_or(QWEN3NEXT_PARTIAL_ROTARY);
            hp.rope_dim = (d_head as f64 * factor) as usize;
        }
    }
    apply_family_flags(&mut hp, arch);
    Ok(hp)
}

/// Qwen3-Next: the rotated fraction of each head when the config names none
/// (transformers' and llama.cpp's default).
const QWEN3NEXT_PARTIAL_ROTARY: f64 = 0.25;
/// Qwen3-Next: every fourth layer is full attention when the config has no
/// `layer_types` (transformers' default `full_attention_interval`).
const QWEN3NEXT_FULL_ATTENTION_INTERVAL: usize = 4;

/// The layer schedule and DeltaNet geometry of a Qwen3-Next `config.json`:
/// `layer_types` (each `linear_attention` or `full_attention`; anything else
/// is refused by index and value), else layer `i` is full attention when
/// `(i + 1) % full_attention_interval == 0`, as transformers and llama.cpp
/// derive it.
fn hybrid_from_config(cfg: &Value, n_layers: usize) -> Result<HybridParams> {
    let need = |k: &str| cfg_usize(cfg, k).with_context(|| format!("config.json: field {k} is missing (a qwen3_next model needs it)"));
    let linear_layers = match cfg.get("layer_types").filter(|v| !v.is_null()) {
        Some(v) => {
            let types = v.as_array().context("config.json: field layer_types is not a list")?;
            if types.len() != n_layers {
                bail!("config.json: field layer_types has {} entries, num_hidden_layers is {n_layers}", types.len());
            }
            types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("linear_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => bail!("config.json: field layer_types[{i}] {t} is not a known layer type (linear_attention, full_attention)"),
                })
                .collect::<Result<Vec<bool>>>()?
        }
        None => {
            let every = cfg_usize(cfg, "full_attention_interval").unwrap_or(QWEN3NEXT_FULL_ATTENTION_INTERVAL);
            if every == 0 {
                bail!("config.json: field full_attention_interval is 0");
            }
            (0..n_layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    let h = HybridParams {
        linear_layers,
        n_k_heads: need("linear_num_key_heads")?,
        n_v_heads: need("linear_num_value_heads")?,
        d_k: need("linear_key_head_dim")?,
        d_v: need("linear_value_head_dim")?,
        conv_kernel: need("linear_conv_kernel_dim")?,
        d_ffn_shared: need("shared_expert_intermediate_size")?,
    };
    if h.n_k_heads == 0 || h.n_v_heads % h.n_k_heads != 0 {
        bail!(
            "config.json: field linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
            h.n_v_heads,
            h.n_k_heads
        );
    }
    Ok(h)
}

/// A Hugging Face tensor name as the artifact's GGUF-style name, or `None`
/// when the tensor belongs to no text-model role we know.
pub fn hf_tensor_name(arch: Architecture, name: &str) -> Option<String> {
    let name = name.strip_prefix("language_model.").unwrap_or(name);
    let name = name.strip_prefix("model.language_model.").map(|r| format!("model.{r}")).unwrap_or(name.to_string());
    match name.as_str() {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    if arch == Architecture::Qwen3Next {
        // Parameters without a `.weight` suffix, under llama.cpp's names.
        match rest {
            "linear_attn.A_log" => return Some(format!("blk.{layer}.ssm_a")),
            "linear_attn.dt_bias" => return Some(format!("blk.{layer}.ssm_dt.bias")),
            _ => {}
        }
    }
    let (stem, suffix) = rest.rsplit_once('.')?;
    let mapped = match (stem, arch) {
        ("input_layernorm", _) => "attn_norm",
        ("self_attn.q_proj", _) => "attn_q",
        ("self_attn.k_proj", _) => "attn_k",
        ("self_attn.v_proj", _) => "attn_v",
        ("self_attn.o_proj", _) => "attn_output",
        ("self_attn.q_norm", _) => "attn_q_norm",
        ("self_attn.k_norm", _) => "attn_k_norm",
        ("post_attention_layernorm", Architecture::Gemma3 | Architecture::Qwen3Next) => "post_attention_norm",
        ("post_attention_layernorm", _) => "ffn_norm",
        ("pre_feedforward_layernorm", Architecture::Gemma3) => "ffn_norm",
        ("post_feedforward_layernorm", Architecture::Gemma3) => "post_ffw_norm",
        ("mlp.gate_proj", _) => "ffn_gate",
        ("mlp.up_proj", _) => "ffn_up",
        ("mlp.down_proj", _) => "ffn_down",
        ("mlp.gate", Architecture::Qwen3Moe | Architecture::Qwen3Next) => "ffn_gate_inp",
        ("linear_attn.in_proj_ba", Architecture::Qwen3Next) => "ssm_ba",
        ("linear_attn.conv1d", Architecture::Qwen3Next) => "ssm_conv1d",
        ("linear_attn.norm", Architecture::Qwen3Next) => "ssm_norm",
        ("linear_attn.out_proj", Architecture::Qwen3Next) => "ssm_out",
        ("mlp.shared_expert.gate_proj", Architecture::Qwen3Next) => "ffn_gate_shexp",
        ("mlp.shared_expert.up_proj", Architecture::Qwen3Next) => "ffn_up_shexp",
        ("mlp.shared_expert.down_proj", Architecture::Qwen3Next) => "ffn_down_shexp",
        ("mlp.shared_expert_gate", Architecture::Qwen3Next) => "ffn_gate_inp_shexp",
        _ => return None,
    };
    Some(format!("blk.{layer}.{mapped}.{suffix}"))
}

/// Which expert bank a Hugging Face expert tensor belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertPart {
    pub layer: usize,
    pub kind: ExpertTensor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertTensor {
    /// `mlp.experts.{e}.{gate,up,down}_proj.weight` (the checkpoint layout
    /// on the Hub): expert `e`'s matrix of bank `bank`.
    One { expert: usize, bank: ExpertBank },
    /// `mlp.experts.gate_up_proj` `(n_experts, 2 * d_ffn_expert, d_model)`
    /// (transformers' fused layout): per expert, gate rows then up rows.
    FusedGateUp,
    /// `mlp.experts.down_proj` `(n_experts, d_model, d_ffn_expert)`.
    FusedDown,
}

/// The three expert banks of a routed FFN, by their GGUF names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ExpertBank {
    Gate,
    Up,
    Down,
}

impl ExpertBank {
    pub const ALL: [Self; 3] = [Self::Gate, Self::Up, Self::Down];

    /// `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`.
    pub fn gguf_group(self) -> &'static str {
        match self {
            Self::Gate => "ffn_gate_exps",
            Self::Up => "ffn_up_exps",
            Self::Down => "ffn_down_exps",
        }
    }

    /// The Hugging Face name of expert `e`'s matrix of this bank in layer `l`.
    pub fn hf_name(self, l: usize, e: usize) -> String {
        let p = match self {
            Self::Gate => "gate_proj",
            Self::Up => "up_proj",
            Self::Down => "down_proj",
        };
        format!("model.layers.{l}.mlp.experts.{e}.{p}.weight")
    }
}

/// The expert bank a Hugging Face tensor of a MoE model feeds, or `None`.
pub fn hf_expert_part(arch: Architecture, name: &str) -> Option<ExpertPart> {
    if !matches!(arch, Architecture::Qwen3Moe | Architecture::Qwen3Next) {
        return None;
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let rest = rest.strip_prefix("mlp.experts.")?;
    let kind = match rest {
        "gate_up_proj" => ExpertTensor::FusedGateUp,
        "down_proj" => ExpertTensor::FusedDown,
        _ => {
            let (e, proj) = rest.split_once('.')?;
            let bank = match proj {
                "gate_proj.weight" => ExpertBank::Gate,
                "up_proj.weight" => ExpertBank::Up,
                "down_proj.weight" => ExpertBank::Down,
                _ => return None,
            };
            ExpertTensor::One { expert: e.parse().ok()?, bank }
        }
    };
    Some(ExpertPart { layer, kind })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3moe_expert_names() {
        let a = Architecture::Qwen3Moe;
        assert_eq!(hf_tensor_name(a, "model.layers.2.mlp.gate.weight").as_deref(), Some("blk.2.ffn_gate_inp.weight"));
        assert_eq!(hf_tensor_name(Architecture::Qwen3, "model.layers.2.mlp.gate.weight"), None);
        assert_eq!(
            hf_expert_part(a, "model.layers.1.mlp.experts.7.down_proj.weight"),
            Some(ExpertPart { layer: 1, kind: ExpertTensor::One { expert: 7, bank: ExpertBank::Down } })
        );
        assert_eq!(hf_expert_part(a, "model.layers.0.mlp.experts.gate_up_proj").map(|p| p.kind), Some(ExpertTensor::FusedGateUp));
        assert_eq!(hf_expert_part(a, "model.layers.0.mlp.gate.weight"), None);
        assert_eq!(hf_expert_part(Architecture::Qwen3, "model.layers.1.mlp.experts.7.down_proj.weight"), None);
        assert_eq!(ExpertBank::Up.hf_name(3, 5), "model.layers.3.mlp.experts.5.up_proj.weight");
    }

    #[test]
    fn hf_names_map_to_gguf_names() {
        let a = Architecture::Gemma3;
        assert_eq!(hf_tensor_name(a, "model.layers.3.self_attn.q_proj.weight").as_deref(), Some("blk.3.attn_q.weight"));
        assert_eq!(hf_tensor_name(a, "model.layers.0.post_attention_layernorm.weight").as_deref(), Some("blk.0.post_attention_norm.weight"));
        assert_eq!(hf_tensor_name(Architecture::Llama, "model.layers.0.post_attention_layernorm.weight").as_deref(), Some("blk.0.ffn_norm.weight"));
        assert_eq!(hf_tensor_name(Architecture::Qwen2, "model.layers.1.self_attn.k_proj.bias").as_deref(), Some("blk.1.attn_k.bias"));
        assert_eq!(hf_tensor_name(a, "model.embed_tokens.weight").as_deref(), Some("token_embd.weight"));
        assert_eq!(hf_tensor_name(a, "vision_tower.encoder.layers.0.mlp.fc1.weight"), None);
    }

    #[test]
    fn gemma3_layer_pattern_from_config() {
        let cfg = serde_json::json!({
            "model_type": "gemma3_text", "num_hidden_layers": 7, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 128, "vocab_size": 300,
            "sliding_window": 32, "query_pre_attn_scalar": 16, "rope_theta": 1e6
        });
        let hp = hparams_from_config(&cfg, Architecture::Gemma3, true).unwrap();
        let globals: Vec<usize> = hp.sliding_window.iter().enumerate().filter(|(_, w)| w.is_none()).map(|(i, _)| i).collect();
        assert_eq!(globals, vec![5]);
        assert_eq!(hp.attn_scale, 0.25);
        assert_eq!(hp.rope_base_local, 10_000.0);
    }
}
