//! The JSON metadata block of a `.ninfer` v3 artifact: architecture,
//! hyperparameters, components, tokenizer policy, provenance and the tensor
//! table. Serde types only; validation against the file is `reader`.

use serde::{Deserialize, Serialize};

use super::format::TensorFormat;

/// Model families the evaluator can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Llama,
    Gemma3,
    Qwen2,
    Qwen3,
    /// Qwen3-MoE: qwen3 attention, every FFN a routed mixture of experts.
    Qwen3Moe,
    /// Qwen3-Next: Gated DeltaNet layers interleaved with gated full
    /// attention (partial RoPE, QK norm), routed experts plus a gated shared expert.
    Qwen3Next,
}

impl Architecture {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "gemma3" => Some(Self::Gemma3),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            "qwen3moe" => Some(Self::Qwen3Moe),
            "qwen3next" => Some(Self::Qwen3Next),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Gemma3 => "gemma3",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3moe",
            Self::Qwen3Next => "qwen3next",
        }
    }

    /// Every architecture we run, for messages (`llama, gemma3, ...`).
    pub const ALL: [Self; 6] = [Self::Llama, Self::Gemma3, Self::Qwen2, Self::Qwen3, Self::Qwen3Moe, Self::Qwen3Next];

    /// `llama, gemma3, qwen2, qwen3, qwen3moe, qwen3next`.
    pub fn names() -> String {
        Self::ALL.map(Self::name).join(", ")
    }
}

/// A routed mixture-of-experts FFN (qwen3moe): per token, a router picks
/// `n_experts_used` of `n_experts` SwiGLU experts of width `d_ffn_expert`.
/// Expert banks are stored expert-major: `ffn_gate_exps`/`ffn_up_exps`
/// `(n_experts, d_ffn_expert, d_model)`, `ffn_down_exps` `(n_experts,
/// d_model, d_ffn_expert)`, so expert `e` is one contiguous byte range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeParams {
    /// GGUF `<arch>.expert_count`, config `num_experts`.
    pub n_experts: usize,
    /// Experts routed per token (top-k): GGUF `<arch>.expert_used_count`, config `num_experts_per_tok`.
    pub n_experts_used: usize,
    /// Width of one expert: GGUF `<arch>.expert_feed_forward_length`, config `moe_intermediate_size`.
    pub d_ffn_expert: usize,
    /// Renormalize the top-k probabilities to sum to 1 (config `norm_topk_prob`;
    /// llama.cpp always does for qwen3moe).
    pub norm_topk_prob: bool,
}

/// The hybrid layer schedule of Qwen3-Next and the geometry of its Gated
/// DeltaNet (linear-attention) layers. Full-attention layers of such a model
/// are gated: `attn_q` holds per head `d_head` query rows then `d_head`
/// gate rows, and the attention output is multiplied by `sigmoid(gate)`.
/// Every MoE layer adds a shared SwiGLU expert of width `d_ffn_shared`
/// scaled by `sigmoid(h · ffn_gate_inp_shexp)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HybridParams {
    /// Per layer: `true` for a Gated DeltaNet layer, `false` for full attention
    /// (config `layer_types`, else every `full_attention_interval`-th layer is full).
    pub linear_layers: Vec<bool>,
    /// Query/key heads of a DeltaNet layer (config `linear_num_key_heads`, GGUF `ssm.group_count`).
    pub n_k_heads: usize,
    /// Value heads (config `linear_num_value_heads`, GGUF `ssm.time_step_rank`).
    pub n_v_heads: usize,
    /// Per-head key width (config `linear_key_head_dim`, GGUF `ssm.state_size`).
    pub d_k: usize,
    /// Per-head value width (config `linear_value_head_dim`; GGUF `ssm.inner_size / time_step_rank`).
    pub d_v: usize,
    /// Width of the causal convolution (config `linear_conv_kernel_dim`, GGUF `ssm.conv_kernel`).
    pub conv_kernel: usize,
    /// Width of the shared expert (config `shared_expert_intermediate_size`).
    pub d_ffn_shared: usize,
}

impl HybridParams {
    /// Channels of the causal convolution: q, k (`n_k_heads * d_k` each) and v (`n_v_heads * d_v`).
    pub fn conv_channels(&self) -> usize {
        2 * self.n_k_heads * self.d_k + self.n_v_heads * self.d_v
    }
}

/// How rotary embeddings pair dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): GGUF llama weights (llama.cpp permutes Q/K rows).
    Normal,
    /// Halves (i, i + d/2): Hugging Face layout, gemma3, qwen2, qwen3.
    Neox,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// SwiGLU: silu(gate) * up.
    Silu,
    /// GeGLU with the tanh approximation of GELU: gelu_tanh(gate) * up.
    GeluTanh,
}

/// Hyperparameters of the text model. Everything the forward pass reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HParams {
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Per-head dimension of queries and keys.
    pub d_head: usize,
    /// Per-head dimension of values.
    pub d_head_v: usize,
    pub d_ffn: usize,
    pub n_vocab: usize,
    pub rms_eps: f64,
    /// RoPE base of global-attention layers.
    pub rope_base: f64,
    /// RoPE base of sliding-window layers (gemma3: 10000); equals `rope_base` otherwise.
    pub rope_base_local: f64,
    /// Linear RoPE scaling factor of global layers (positions divided by it); 1 when none.
    pub rope_scale: f64,
    /// Dimensions rotated per head (the first `rope_dim` of `d_head`).
    pub rope_dim: usize,
    pub rope_style: RopeStyle,
    /// Per layer: `Some(w)` for sliding-window attention over the last `w` positions
    /// (the query's own included), `None` for global attention.
    pub sliding_window: Vec<Option<usize>>,
    /// Training context length, for information.
    pub context_length: usize,
    /// Multiplier on the embedding rows (gemma3: sqrt(d_model)); 1 otherwise.
    pub embed_scale: f64,
    /// Multiplier on q·k (usually d_head^-0.5; gemma3: query_pre_attn_scalar^-0.5).
    pub attn_scale: f64,
    /// tanh soft-cap on attention logits, when the architecture has one.
    pub attn_softcap: Option<f64>,
    /// tanh soft-cap on final logits, when the architecture has one.
    pub final_softcap: Option<f64>,
    pub activation: Activation,
    /// Q/K/V projections carry biases (qwen2).
    pub qkv_bias: bool,
    /// RMSNorm on each head of Q and K before RoPE (gemma3, qwen3).
    pub qk_norm: bool,
    /// RMSNorm after attention and after the FFN, before the residual add (gemma3).
    pub post_norms: bool,
    /// The LM head is the token embedding (no `output.weight`).
    pub tied_embeddings: bool,
    /// Routed experts in place of the dense FFN on every layer (qwen3moe);
    /// absent for dense models (and from their JSON).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeParams>,
    /// The Qwen3-Next layer schedule and DeltaNet geometry; absent otherwise
    /// (and from the JSON of other models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hybrid: Option<HybridParams>,
}

/// The tokenizer's policy; the tokenizer.json itself is a blob in the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizerMeta {
    /// Source vocabulary kind (`gpt2` BPE, `llama` SentencePiece, `hf`).
    pub kind: String,
    /// Pre-tokenizer name from the source (`tokenizer.ggml.pre`), when known.
    pub pre: Option<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub blob: BlobRef,
}

/// A byte range of the file holding something other than a tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlobRef {
    pub offset: u64,
    pub n_bytes: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceFile {
    pub path: String,
    pub n_bytes: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    pub sources: Vec<SourceFile>,
    pub converter: String,
    pub converter_version: String,
    /// Source block indices kept, in order, for a `--layers A..B` qualification artifact.
    pub source_layers: Option<Vec<usize>>,
    /// For `--synthetic`: geometry name, format and seed.
    pub synthetic: Option<serde_json::Value>,
    /// Selected source metadata (GGUF keys or config.json), for the record.
    pub source_metadata: serde_json::Value,
}

/// Which model component a tensor belongs to. Only `text` is ever loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Component {
    Text,
    Vision,
    Mtp,
    Ngram,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub component: Component,
    pub format: TensorFormat,
    /// Logical shape, outermost first: a weight of `(n_out, n_in)` stores
    /// `n_out` rows of `n_in` contiguous elements.
    pub shape: Vec<u64>,
    /// Absolute byte offset in the file (a multiple of `ALIGNMENT`).
    pub offset: u64,
    pub n_bytes: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactMeta {
    pub architecture: Architecture,
    pub public_name: String,
    pub hparams: HParams,
    /// Components present; `text` is required.
    pub components: Vec<Component>,
    pub tokenizer: TokenizerMeta,
    pub provenance: Provenance,
    pub tensors: Vec<TensorEntry>,
}
