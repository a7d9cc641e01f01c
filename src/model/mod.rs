//! The transformer forward pass, written once against the backend seam
//! ([`Backend`]) and scoring API the scorer calls.
//!
//! One decoder covers every architecture we run; the differences are
//! `HParams` flags, not code paths per family:
//! - `llama` (SmolLM2): RMSNorm, SwiGLU, RoPE on llama.cpp's permuted Q/K rows
//!   (`RopeStyle::Normal`), optionally tied head.
//! - `gemma3`: embeddings times `embed_scale` (sqrt(d_model)), QK RMSNorm per
//!   head, norms after attention and after the FFN (`post_norms`), GeGLU with
//!   tanh GELU, per-layer sliding windows whose layers use `rope_base_local`,
//!   attention scale from `attn_scale`, tied head.
//! - `qwen2`: biases on Q, K, V (`qkv_bias`); `qwen3`: QK norm.
//! - `qwen3moe`: qwen3's attention; every FFN is a routed mixture of
//!   experts (`hp.moe`): router logits `h·Wrᵀ`, then the backend's
//!   [`Backend::moe_ffn`] (softmax in f64, top-k, lowest index on ties,
//!   renormalized weights, sum in ascending expert order; `moe`). Routing
//!   counts per layer and expert accumulate over every pass
//!   ([`WindowScorer::expert_usage`]).
//! - `qwen3next` (`hp.hybrid`): the layer schedule mixes Gated DeltaNet
//!   layers (`qkv = h·Wqkvᵀ`, `z`, `ba`, then [`Backend::delta_net`], then
//!   `ssm_out`) with gated full attention (qwen3's, with the query's gate
//!   half: `attn · sigmoid(gate)` before `Wo`; partial RoPE through
//!   `rope_dim`); every FFN is qwen3moe's routed experts plus a shared
//!   expert scaled by `sigmoid(h·w)` (`hybrid`). Its zero-centered norms are
//!   stored as `1 + w` at conversion; the pre-FFN norm is llama.cpp's
//!   `post_attention_norm`. A DeltaNet layer's recurrent state and
//!   convolution history carry across the passes of a window exactly as the
//!   KV cache does, and are zeroed at each window's start.
//!
//! Per layer: `h = norm(x)`; `q, k, v = h·Wqᵀ, h·Wkᵀ, h·Wvᵀ` (+ bias); QK norm;
//! RoPE; attention through the KV cache; `o = attn·Woᵀ` (post-norm);
//! `x += o`; `h = norm(x)`; `f = down(act(gate h) * up h)` (post-norm);
//! `x += f`. Then the final norm and the fused LM head, which returns per
//! scored position only max, log-sum-exp, the target's logit and optional
//! top-k / listed logits.
//!
//! A window is processed in passes of `prefill_chunk` tokens; the KV cache
//! carries over between the passes of a window and is overwritten by the
//! next window (every window starts from empty state). Windows of equal
//! length can be scored together ([`Transformer::score_windows`]): their
//! rows share each pass (larger matrix products, fewer launches) and each
//! keeps its own KV slot, so the numbers are those of one window at a time. This module owns
//! neither window planning (`crate::plan`) nor NLL statistics
//! (`crate::score`).

use anyhow::{bail, ensure, Context, Result};

use crate::artifact::meta::{Architecture, HParams};
use crate::artifact::names::{self, blk};
use crate::artifact::{Artifact, TensorView};
use crate::backend::cuda::{CudaBackend, FastPathUse, Route, RouteOptions};
use crate::backend::{
    AttnParams, Backend, BackendKind, DeviceMemory, ExecutionInfo, ExecutionSpec, Expert, HeadRequest, KvGeometry, MoeRouting, PassRows, Precision,
    RopeParams, Yarn, MAX_TOP_K,
};
use hybrid::{DeltaNetLayer, SharedExpert};

pub mod hybrid;
pub mod moe;
pub use moe::{ExpertUsage, LayerExpertUsage};

/// The score of one target position `j` of a window: `-log p(tokens[j] |
/// tokens[..j])` and the numbers it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetScore {
    /// `lse - target_logit`, in f64.
    pub nll: f64,
    pub target_logit: f64,
    /// log Σ exp over the vocabulary's logits.
    pub lse: f64,
    pub max_logit: f64,
    /// The `top_k` largest `(id, logit)`, largest first (empty when not asked).
    pub top: Vec<(u32, f32)>,
    /// Logits of the ids listed for this target (empty when not asked).
    pub extra: Vec<f32>,
}

/// One window of a batch for [`Transformer::score_windows`].
#[derive(Debug, Clone, Copy)]
pub struct WindowInput<'a> {
    pub tokens: &'a [u32],
    /// The first scored target (`1..=tokens.len()`).
    pub first_target: usize,
    /// Empty, or per target the ids whose logits are returned.
    pub extra_ids: &'a [Vec<u32>],
}

/// How to score a window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ScoreOptions {
    /// Return the `top_k` largest logits per target (0..=64).
    pub top_k: usize,
    /// Process the window in passes of this many tokens (the KV cache
    /// carries over). `None`: one pass.
    pub prefill_chunk: Option<usize>,
}

/// Everything a layer reads.
struct Layer<B: Backend> {
    attn_norm: B::Vector,
    mixer: Mixer<B>,
    /// Norms of the attention output and the FFN output (gemma3).
    post_norms: Option<[B::Vector; 2]>,
    ffn_norm: B::Vector,
    ffn: Ffn<B>,
}

/// A layer's token mixer.
enum Mixer<B: Backend> {
    Attention(Attention<B>),
    /// A Gated DeltaNet layer (qwen3next).
    DeltaNet(DeltaNetLayer<B>),
}

/// Softmax attention through the KV cache.
struct Attention<B: Backend> {
    wq: B::Matrix,
    wk: B::Matrix,
    wv: B::Matrix,
    wo: B::Matrix,
    /// Q, K, V biases (qwen2).
    bias: Option<[B::Vector; 3]>,
    /// Q and K per-head norms (gemma3, qwen3).
    qk_norm: Option<[B::Vector; 2]>,
    /// `(n_heads * d_head, d_model)`: the output gate, `attn · sigmoid(h·Wgᵀ)` (qwen3next).
    gate: Option<B::Matrix>,
    attn: AttnParams,
    rope: RopeParams,
}

/// A layer's feed-forward block.
enum Ffn<B: Backend> {
    /// `down(act(gate h) * up h)`.
    Dense { gate: B::Matrix, up: B::Matrix, down: B::Matrix },
    /// Routed experts: router `(n_experts, d_model)`, one [`Expert`] each.
    /// With qwen3next's gated shared expert added.
    Moe { router: B::Matrix, experts: Vec<Expert<B::Matrix>>, routing: MoeRouting, shared: Option<SharedExpert<B>> },
}

/// A loaded model on backend `B`.
pub struct Transformer<B: Backend> {
    backend: B,
    arch: Architecture,
    hp: HParams,
    embd: B::Matrix,
    /// `None` when the head is the token embedding (tied).
    head: Option<B::Matrix>,
    output_norm: B::Vector,
    layers: Vec<Layer<B>>,
    cache: Option<B::KvCache>,
    cache_geometry: Option<KvGeometry>,
    /// Per layer of a MoE model, rows routed to each expert so far, kept where
    /// the backend routes (empty for dense models).
    expert_counts: Vec<B::ExpertCounts>,
    /// Per DeltaNet layer (by slot), the states of the pass's windows
    /// (`None` before the first pass).
    recurrent: Vec<Option<B::Recurrent>>,
}

fn check_hparams(hp: &HParams) -> Result<()> {
    ensure!(hp.n_layers > 0 && hp.d_model > 0 && hp.n_vocab > 0, "hparams: empty model ({hp:?})");
    ensure!(
        hp.n_kv_heads > 0 && hp.n_heads % hp.n_kv_heads == 0,
        "hparams: {} heads do not share {} KV heads evenly",
        hp.n_heads,
        hp.n_kv_heads
    );
    ensure!(
        hp.sliding_window.len() == hp.n_layers,
        "hparams: sliding_window has {} entries for {} layers",
        hp.sliding_window.len(),
        hp.n_layers
    );
    ensure!(
        hp.rope_dim % 2 == 0 && hp.rope_dim <= hp.d_head,
        "hparams: rope_dim {} is odd or exceeds d_head {}",
        hp.rope_dim,
        hp.d_head
    );
    ensure!(hp.rope_scale > 0.0, "hparams: rope_scale {} is not positive", hp.rope_scale);
    if let Some(h) = &hp.hybrid {
        ensure!(
            h.linear_layers.len() == hp.n_layers && hp.moe.is_some(),
            "hparams: a hybrid schedule of {} layers for {} layers (routed experts: {})",
            h.linear_layers.len(),
            hp.n_layers,
            hp.moe.is_some()
        );
    }
    Ok(())
}

impl<B: Backend> Transformer<B> {
    /// Loads the text model of `artifact` onto `backend`.
    pub fn load(backend: B, artifact: &Artifact) -> Result<Self> {
        let meta = &artifact.meta;
        Self::load_with(backend, meta.architecture, meta.hparams.clone(), &|name| artifact.tensor(name))
            .with_context(|| format!("load {}", artifact.path.display()))
    }

    /// Loads from any source of GGUF-named tensors (an artifact, or a test's
    /// in-memory tensors).
    pub fn load_with<'a>(
        backend: B,
        arch: Architecture,
        hp: HParams,
        tensor: &dyn Fn(&str) -> Result<TensorView<'a>>,
    ) -> Result<Self> {
        check_hparams(&hp)?;
        let matrix = |name: &str, n_out: usize, n_in: usize| -> Result<B::Matrix> {
            let view = tensor(name)?;
            ensure!(
                view.entry.shape == [n_out as u64, n_in as u64],
                "tensor {name}: shape {:?}, expected [{n_out}, {n_in}]",
                view.entry.shape
            );
            backend.load_matrix(&view)
        };
        let vector = |name: &str, n: usize| -> Result<B::Vector> {
            let view = tensor(name)?;
            ensure!(view.entry.shape == [n as u64], "tensor {name}: shape {:?}, expected [{n}]", view.entry.shape);
            backend.load_vector(&view)
        };
        let (d, d_q, d_k, d_v) = (hp.d_model, hp.n_heads * hp.d_head, hp.n_kv_heads * hp.d_head, hp.n_kv_heads * hp.d_head_v);
        let embd = matrix(names::TOKEN_EMBD, hp.n_vocab, d)?;
        let head = if hp.tied_embeddings { None } else { Some(matrix(names::OUTPUT, hp.n_vocab, d)?) };
        let output_norm = vector(names::OUTPUT_NORM, d)?;
        let mut layers = Vec::with_capacity(hp.n_layers);
        let mut n_linear = 0;
        for l in 0..hp.n_layers {
            let n = |s: &str| blk(l, s);
            let window = hp.sliding_window[l];
            let linear = hp.hybrid.as_ref().filter(|h| h.linear_layers[l]);
            let mixer = if let Some(h) = linear {
                n_linear += 1;
                Mixer::DeltaNet(hybrid::load_delta_net(&backend, tensor, l, n_linear - 1, &hp, h)?)
            } else {
                let (wq, gate) = match &hp.hybrid {
                    Some(_) => {
                        let (q, g) = hybrid::load_gated_q(&backend, &tensor(&n("attn_q.weight"))?, &hp)?;
                        (q, Some(g))
                    }
                    None => (matrix(&n("attn_q.weight"), d_q, d)?, None),
                };
                Mixer::Attention(Attention {
                    wq,
                    gate,
                    wk: matrix(&n("attn_k.weight"), d_k, d)?,
                    wv: matrix(&n("attn_v.weight"), d_v, d)?,
                    wo: matrix(&n("attn_output.weight"), d, hp.n_heads * hp.d_head_v)?,
                    bias: if hp.qkv_bias {
                        Some([vector(&n("attn_q.bias"), d_q)?, vector(&n("attn_k.bias"), d_k)?, vector(&n("attn_v.bias"), d_v)?])
                    } else {
                        None
                    },
                    qk_norm: if hp.qk_norm {
                        Some([vector(&n("attn_q_norm.weight"), hp.d_head)?, vector(&n("attn_k_norm.weight"), hp.d_head)?])
                    } else {
                        None
                    },
                    attn: AttnParams {
                        n_heads: hp.n_heads,
                        n_kv_heads: hp.n_kv_heads,
                        d_head: hp.d_head,
                        d_head_v: hp.d_head_v,
                        scale: hp.attn_scale,
                        window,
                        softcap: hp.attn_softcap,
                    },
                    // Sliding-window layers use the local base and no scaling (gemma3).
                    rope: RopeParams {
                        style: hp.rope_style,
                        base: if window.is_some() { hp.rope_base_local } else { hp.rope_base },
                        scale: if window.is_some() { 1.0 } else { hp.rope_scale },
                        rope_dim: hp.rope_dim,
                        yarn: None,
                    },
                })
            };
            layers.push(Layer {
                attn_norm: vector(&n("attn_norm.weight"), d)?,
                mixer,
                post_norms: if hp.post_norms {
                    Some([vector(&n("post_attention_norm.weight"), d)?, vector(&n("post_ffw_norm.weight"), d)?])
                } else {
                    None
                },
                // llama.cpp names qwen3next's pre-FFN norm post_attention_norm.
                ffn_norm: vector(&n(if hp.hybrid.is_some() { "post_attention_norm.weight" } else { "ffn_norm.weight" }), d)?,
                ffn: match &hp.moe {
                    None => Ffn::Dense {
                        gate: matrix(&n("ffn_gate.weight"), hp.d_ffn, d)?,
                        up: matrix(&n("ffn_up.weight"), hp.d_ffn, d)?,
                        down: matrix(&n("ffn_down.weight"), d, hp.d_ffn)?,
                    },
                    Some(m) => Ffn::Moe {
                        router: matrix(&n("ffn_gate_inp.weight"), m.n_experts, d)?,
                        experts: moe::load_experts(&backend, tensor, l, &hp, m)?,
                        routing: MoeRouting {
                            n_experts: m.n_experts,
                            top_k: m.n_experts_used,
                            norm_topk_prob: m.norm_topk_prob,
                            activation: hp.activation,
                        },
                        shared: match &hp.hybrid {
                            Some(h) => Some(hybrid::load_shared_expert(&backend, tensor, l, &hp, h)?),
                            None => None,
                        },
                    },
                },
            });
        }
        let expert_counts = match &hp.moe {
            Some(m) => (0..hp.n_layers).map(|_| backend.new_expert_counts(m.n_experts)).collect::<Result<Vec<_>>>().context("expert-usage counters")?,
            None => Vec::new(),
        };
        let recurrent = (0..n_linear).map(|_| None).collect();
        Ok(Self {
            backend,
            arch,
            hp,
            embd,
            head,
            output_norm,
            layers,
            cache: None,
            cache_geometry: None,
            expert_counts,
            recurrent,
        })
    }

    /// YaRN of `factor` on every full-attention layer (sliding-window layers
    /// keep native RoPE, as transformers applies `rope_scaling` to gemma3's
    /// global layers only); `factor == 1` changes nothing.
    pub fn with_rope_yarn(mut self, factor: f64) -> Result<Self> {
        ensure!(factor.is_finite() && (1.0..=4.0).contains(&factor), "--rope-yarn-factor {factor}: not in [1, 4]");
        if factor == 1.0 {
            return Ok(self);
        }
        ensure!(
            self.hp.context_length > 0,
            "--rope-yarn-factor {factor}: the artifact records no trained context (context_length 0)"
        );
        for layer in &mut self.layers {
            let Mixer::Attention(layer) = &mut layer.mixer else {
                continue;
            };
            if layer.attn.window.is_none() {
                let r = &mut layer.rope;
                r.yarn = Some(Yarn::new(factor, self.hp.context_length, r.base, r.rope_dim));
            }
        }
        Ok(self)
    }

    pub fn hparams(&self) -> &HParams {
        &self.hp
    }

    pub fn architecture(&self) -> Architecture {
        self.arch
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Expert-usage counts so far (`None` for a dense model); reads the
    /// backend's counters (on CUDA one download per layer, so once per pass or
    /// at the end, never inside one).
    pub fn expert_usage(&self) -> Result<Option<ExpertUsage>> {
        let Some(m) = &self.hp.moe else {
            return Ok(None);
        };
        let counts = self.expert_counts.iter().map(|c| self.backend.read_expert_counts(c)).collect::<Result<Vec<_>>>()?;
        Ok(Some(ExpertUsage::from_counts(m, &counts)))
    }

    /// Scores several windows of the same length together: every prefill
    /// pass runs their rows side by side (window `s` in KV slot `s`), and one
    /// LM-head call scores all their targets. Each window's scores are those
    /// [`score_window`](Self::score_window) would give it alone: rows never
    /// mix, so batching changes no number. One result per window, in order.
    pub fn score_windows(&mut self, windows: &[WindowInput], opts: &ScoreOptions) -> Result<Vec<Vec<TargetScore>>> {
        let Some(first) = windows.first() else {
            return Ok(Vec::new());
        };
        let n = first.tokens.len();
        ensure!(n > 0, "score_windows: empty window");
        ensure!(opts.top_k <= MAX_TOP_K, "score_windows: top_k {} exceeds {MAX_TOP_K}", opts.top_k);
        for (s, w) in windows.iter().enumerate() {
            ensure!(w.tokens.len() == n, "score_windows: window {s} has {} tokens, window 0 {n}", w.tokens.len());
            ensure!(
                (1..=n).contains(&w.first_target),
                "score_windows: window {s}: first target {} outside 1..={n} (position 0 has no context)",
                w.first_target
            );
            let n_targets = n - w.first_target;
            ensure!(
                w.extra_ids.is_empty() || w.extra_ids.len() == n_targets,
                "score_windows: window {s}: {} extra-id lists for {n_targets} targets",
                w.extra_ids.len()
            );
            if let Some(&bad) = w.tokens.iter().find(|&&t| t as usize >= self.hp.n_vocab) {
                bail!("score_windows: window {s}: token {bad} is outside the vocabulary of {}", self.hp.n_vocab);
            }
        }
        let chunk = opts.prefill_chunk.unwrap_or(n);
        ensure!(chunk > 0, "score_windows: prefill chunk of 0 tokens");
        self.ensure_cache(n, windows.len())?;
        // Every window starts from empty recurrent state, as from an empty KV cache.
        for layer in &self.layers {
            if let Mixer::DeltaNet(dn) = &layer.mixer {
                self.recurrent[dn.slot] = Some(self.backend.new_recurrent(&dn.params, windows.len()).context("score_windows: recurrent state")?);
            }
        }

        let mut scores: Vec<Vec<TargetScore>> = windows.iter().map(|w| Vec::with_capacity(n - w.first_target)).collect();
        for pos0 in (0..n).step_by(chunk) {
            let pos1 = (pos0 + chunk).min(n);
            let pass = PassRows { n_seqs: windows.len(), n_tokens: pos1 - pos0, pos0 };
            let tokens: Vec<u32> = windows.iter().flat_map(|w| &w.tokens[pos0..pos1]).copied().collect();
            let x = self.forward_pass(&tokens, pass)?;
            // Hidden row at position p predicts tokens[p + 1]; window s needs
            // p in first_target - 1 ..= n - 2. Rows of all windows, window-major.
            let (mut rows, mut targets, mut extra, mut counts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for (s, w) in windows.iter().enumerate() {
                let lo = (w.first_target - 1).max(pos0);
                let hi = (n - 1).min(pos1);
                let range = lo..hi.max(lo);
                counts.push(range.len());
                rows.extend(range.clone().map(|p| s * pass.n_tokens + p - pos0));
                targets.extend(range.clone().map(|p| w.tokens[p + 1]));
                if !w.extra_ids.is_empty() {
                    extra.extend_from_slice(&w.extra_ids[range.start + 1 - w.first_target..range.end + 1 - w.first_target]);
                }
            }
            if rows.is_empty() {
                continue;
            }
            ensure!(
                extra.is_empty() || extra.len() == rows.len(),
                "score_windows: extra ids given for some windows of a batch only"
            );
            let h = self.backend.rms_norm(&x, &self.output_norm, self.hp.rms_eps)?;
            let req = HeadRequest { targets: &targets, top_k: opts.top_k, extra_ids: &extra, softcap: self.hp.final_softcap };
            let head = self.head.as_ref().unwrap_or(&self.embd);
            let mut rows_out = self.backend.score_rows(&h, &rows, head, &req)?.into_iter();
            for (s, &count) in counts.iter().enumerate() {
                scores[s].extend(rows_out.by_ref().take(count).map(|r| TargetScore {
                    nll: r.lse - r.target_logit,
                    target_logit: r.target_logit,
                    lse: r.lse,
                    max_logit: r.max_logit,
                    top: r.top,
                    extra: r.extra,
                }));
            }
        }
        for (s, (w, sc)) in windows.iter().zip(&scores).enumerate() {
            ensure!(
                sc.len() == n - w.first_target,
                "score_windows: window {s}: {} scores for {} targets",
                sc.len(),
                n - w.first_target
            );
        }
        Ok(scores)
    }

    /// Before the first window: finds how many windows of up to
    /// `n_max_window` tokens, prefilled together in passes of
    /// `prefill_chunk`, fit the backend's memory (at most `max_seqs`,
    /// halving until they fit; an error that gives the sizes when not even
    /// one does), then allocates the KV cache for them once. -> the number of
    /// windows per pass.
    pub fn prepare(&mut self, n_max_window: usize, prefill_chunk: usize, max_seqs: usize) -> Result<usize> {
        ensure!(
            n_max_window > 0 && prefill_chunk > 0 && max_seqs > 0,
            "prepare: windows of {n_max_window} tokens, passes of {prefill_chunk}, {max_seqs} windows per pass"
        );
        let hp = &self.hp;
        let d_expert = hp.moe.map_or(0, |m| m.d_ffn_expert.max(m.n_experts));
        let widest =
            [hp.d_model, hp.n_heads * hp.d_head, hp.n_heads * hp.d_head_v, hp.d_ffn, d_expert].into_iter().max().unwrap_or(0);
        let mut n_seqs = max_seqs;
        loop {
            let g = self.kv_geometry(n_max_window, n_seqs);
            match self.backend.check_memory(g, n_seqs * prefill_chunk.min(n_max_window), widest, hp.n_vocab) {
                Ok(()) => break,
                Err(e) if n_seqs == 1 => return Err(e),
                Err(_) => n_seqs /= 2,
            }
        }
        self.ensure_cache(n_max_window, n_seqs)?;
        Ok(n_seqs)
    }

    fn kv_geometry(&self, max_pos: usize, n_seqs: usize) -> KvGeometry {
        let hp = &self.hp;
        KvGeometry { n_layers: hp.n_layers, n_kv_heads: hp.n_kv_heads, d_head: hp.d_head, d_head_v: hp.d_head_v, max_pos, n_seqs }
    }

    fn ensure_cache(&mut self, n_positions: usize, n_seqs: usize) -> Result<()> {
        let fits = self.cache.is_some() && self.cache_geometry.is_some_and(|g| g.max_pos >= n_positions && g.n_seqs >= n_seqs);
        if !fits {
            let g = self.kv_geometry(n_positions, n_seqs);
            self.cache = None;
            self.cache = Some(self.backend.new_kv_cache(g)?);
            self.cache_geometry = Some(g);
        }
        Ok(())
    }

    /// Runs `tokens` (the pass's rows, window-major) through every layer; the
    /// KV cache must hold positions `..rows.pos0` of these windows.
    /// -> `(rows.n_rows(), d_model)`, the residual stream before the final norm.
    fn forward_pass(&mut self, tokens: &[u32], rows: PassRows) -> Result<B::Act> {
        let b = &self.backend;
        let hp = &self.hp;
        ensure!(tokens.len() == rows.n_rows(), "forward: {} tokens for a pass of {rows:?}", tokens.len());
        let cache = self.cache.as_mut().context("forward: no KV cache")?;
        // (n, d_model)
        let mut x = b.embed(&self.embd, tokens, hp.embed_scale)?;
        // The previous layer's FFN output when it still has to be added to x: then
        // this layer's first norm adds it (`add_rms_norm`: the numbers of the add
        // then the norm). Without post norms the output projections add their
        // products to x themselves (`matmul_add`: the numbers of the matmul then
        // the add), and the norms after them only read x.
        let mut pending: Option<B::Act> = None;
        for (l, layer) in self.layers.iter().enumerate() {
            let fail = || format!("layer {l}");
            // Attention and DeltaNet read their normed input only through matmuls.
            let h = match pending.take() {
                Some(f) => b.add_rms_norm(&mut x, &f, &layer.attn_norm, hp.rms_eps),
                None => b.rms_norm_for_matmul(&x, &layer.attn_norm, hp.rms_eps),
            }
            .with_context(fail)?;
            // (n, n_heads * d_head_v) or (n, n_v_heads * d_v): the output projection's input
            let (a, wo) = match &layer.mixer {
                Mixer::Attention(at) => (attend(b, hp, cache, l, at, &h, rows).with_context(fail)?, &at.wo),
                Mixer::DeltaNet(dn) => {
                    // (n, conv_channels), (n, n_v_heads * d_v), (n, 2 * n_v_heads)
                    let qkv = b.matmul(&h, &dn.qkv).with_context(fail)?;
                    let z = b.matmul(&h, &dn.z).with_context(fail)?;
                    let ba = b.matmul(&h, &dn.ba).with_context(fail)?;
                    let states = self.recurrent.get_mut(dn.slot).and_then(Option::as_mut).context("forward: no recurrent state")?;
                    (b.delta_net(&qkv, &z, &ba, &dn.weights, &dn.params, states, rows).with_context(fail)?, &dn.out)
                }
            };
            drop(h);
            let dense = matches!(layer.ffn, Ffn::Dense { .. });
            // (n, d_model)
            let h = match &layer.post_norms {
                Some([post_attn, _]) => {
                    let o = b.matmul(&a, wo).with_context(fail)?;
                    let o = b.rms_norm(&o, post_attn, hp.rms_eps)?;
                    b.add_rms_norm(&mut x, &o, &layer.ffn_norm, hp.rms_eps)
                }
                None => {
                    b.matmul_add(&mut x, &a, wo).with_context(fail)?;
                    // A dense FFN reads h only through its gated GEMM; the MoE path may read f32.
                    if dense {
                        b.rms_norm_for_matmul(&x, &layer.ffn_norm, hp.rms_eps)
                    } else {
                        b.rms_norm(&x, &layer.ffn_norm, hp.rms_eps)
                    }
                }
            }
            .with_context(fail)?;
            drop(a);
            match &layer.ffn {
                Ffn::Dense { gate, up, down } => {
                    // (n, d_ffn)
                    let g = b.gated_ffn(&h, gate, up, hp.activation).with_context(fail)?;
                    match &layer.post_norms {
                        Some([_, post_ffn]) => {
                            let f = b.matmul(&g, down).with_context(fail)?;
                            pending = Some(b.rms_norm(&f, post_ffn, hp.rms_eps)?);
                        }
                        None => b.matmul_add(&mut x, &g, down).with_context(fail)?,
                    }
                }
                Ffn::Moe { router, experts, routing, shared } => {
                    // (n, n_experts)
                    let logits = b.matmul(&h, router).with_context(fail)?;
                    let counts = self.expert_counts.get_mut(l).context("forward: no expert counters")?;
                    let mut y = b.moe_ffn(&h, &logits, experts, routing, counts).with_context(fail)?;
                    if let Some(s) = shared {
                        // (n, d_ffn_shared), then (n, d_model) scaled by (n, 1)
                        let g = b.gated_ffn(&h, &s.gate, &s.up, hp.activation)?;
                        let mut sh = b.matmul(&g, &s.down).with_context(fail)?;
                        b.sigmoid_mul(&mut sh, &b.matmul(&h, &s.gate_inp)?).with_context(fail)?;
                        b.add_assign(&mut y, &sh)?;
                    }
                    pending = Some(match &layer.post_norms {
                        Some([_, post_ffn]) => b.rms_norm(&y, post_ffn, hp.rms_eps)?,
                        None => y,
                    });
                }
            }
        }
        if let Some(f) = pending {
            b.add_assign(&mut x, &f)?;
        }
        Ok(x)
    }
}

/// Attention of one layer over the KV cache: `h` `(n, d_model)` -> `(n, n_heads
/// * d_head_v)`, the output projection's input (the caller applies `wo`).
fn attend<B: Backend>(
    b: &B,
    hp: &HParams,
    cache: &mut B::KvCache,
    l: usize,
    layer: &Attention<B>,
    h: &B::Act,
    rows: PassRows,
) -> Result<B::Act> {
    let fail = || format!("layer {l}");
    // (n, n_heads * d_head), (n, n_kv_heads * d_head), (n, n_kv_heads * d_head_v)
    let w = [&layer.wq, &layer.wk, &layer.wv];
    let [q, k, v] = match &layer.qk_norm {
        // RoPE straight after the projections: one seam, so a backend can rotate
        // in the GEMM's epilogue.
        None => b.qkv_rope(h, w, layer.bias.as_ref(), hp.n_heads, hp.n_kv_heads, hp.d_head, rows, &layer.rope).with_context(fail)?,
        // QK norm (gemma3, qwen3) sits between the projections and RoPE.
        Some([nq, nk]) => {
            let [mut q, mut k, v] = b.qkv(h, w, layer.bias.as_ref()).with_context(fail)?;
            b.rms_norm_heads(&mut q, nq, hp.d_head, hp.rms_eps).with_context(fail)?;
            b.rms_norm_heads(&mut k, nk, hp.d_head, hp.rms_eps).with_context(fail)?;
            b.rope(&mut q, hp.n_heads, hp.d_head, rows, &layer.rope).with_context(fail)?;
            b.rope(&mut k, hp.n_kv_heads, hp.d_head, rows, &layer.rope).with_context(fail)?;
            [q, k, v]
        }
    };
    // (n, n_heads * d_head_v)
    let mut a = b.attention(cache, l, &q, &k, &v, rows, &layer.attn).with_context(fail)?;
    if let Some(gate) = &layer.gate {
        b.sigmoid_mul(&mut a, &b.matmul(h, gate)?).with_context(fail)?;
    }
    Ok(a)
}

/// What the scorer holds: a loaded model on some backend, behind one
/// object-safe interface.
pub trait WindowScorer: Send {
    /// See [`Transformer::score_windows`].
    fn score_windows(&mut self, windows: &[WindowInput], opts: &ScoreOptions) -> Result<Vec<Vec<TargetScore>>>;
    /// One window alone: scores its targets `first_target..tokens.len()`; target `j`
    /// is predicted from `tokens[..j]`. One entry per target, in order.
    /// `extra_ids`: empty, or one list of ids per target whose logits are
    /// returned in `TargetScore::extra`.
    fn score_window(
        &mut self,
        tokens: &[u32],
        first_target: usize,
        opts: &ScoreOptions,
        extra_ids: &[Vec<u32>],
    ) -> Result<Vec<TargetScore>> {
        let mut all = self.score_windows(&[WindowInput { tokens, first_target, extra_ids }], opts)?;
        all.pop().context("score_window: no result")
    }
    fn hparams(&self) -> &HParams;
    /// The backend, for logs and the report (`cpu (2 threads)`).
    fn describe_backend(&self) -> String;
    /// What the report records about the backend (device, routes, kernels).
    fn execution(&self) -> ExecutionInfo;
    /// See [`Transformer::prepare`].
    fn prepare(&mut self, n_max_window: usize, prefill_chunk: usize, max_seqs: usize) -> Result<usize>;
    /// See [`Transformer::expert_usage`].
    fn expert_usage(&self) -> Result<Option<ExpertUsage>>;
    /// The backend's device memory so far ([`Backend::device_memory`]).
    fn device_memory(&self) -> Result<Option<DeviceMemory>>;
}

impl<B: Backend> WindowScorer for Transformer<B>
where
    Transformer<B>: Send,
{
    fn score_windows(&mut self, windows: &[WindowInput], opts: &ScoreOptions) -> Result<Vec<Vec<TargetScore>>> {
        Transformer::score_windows(self, windows, opts)
    }
    fn hparams(&self) -> &HParams {
        &self.hp
    }
    fn describe_backend(&self) -> String {
        self.backend.describe()
    }
    fn execution(&self) -> ExecutionInfo {
        self.backend.execution()
    }
    fn prepare(&mut self, n_max_window: usize, prefill_chunk: usize, max_seqs: usize) -> Result<usize> {
        Transformer::prepare(self, n_max_window, prefill_chunk, max_seqs)
    }
    fn expert_usage(&self) -> Result<Option<ExpertUsage>> {
        Transformer::expert_usage(self)
    }
    fn device_memory(&self) -> Result<Option<DeviceMemory>> {
        self.backend.device_memory()
    }
}

/// Refuses, before any device is opened, what the CUDA backend cannot run
/// yet: a token-embedding table in a format its embedding kernel does not read
/// (MXFP4, which it multiplies but does not embed). The message names the
/// tensor and format. (qwen3next runs on CUDA: `backend::cuda::delta_net`.)
pub fn check_cuda_support(artifact: &Artifact) -> Result<()> {
    let meta = &artifact.meta;
    if let Some(t) = meta.tensors.iter().find(|t| t.name == names::TOKEN_EMBD && !t.format.cuda_embeds()) {
        bail!(
            "{}: tensor {} is {}, a format the CUDA embedding kernel does not read (it multiplies {} weights, \
             it does not embed them): use --backend cpu",
            artifact.path.display(),
            t.name,
            t.format,
            t.format
        );
    }
    Ok(())
}

/// The CUDA route of `spec`: `Fp32` for f32 matmul inputs (`--lossless`, and
/// `--reference`, which implies it), else `Bf16TensorCore`; with the
/// `--reference` / `--reproducible` settings. Refuses LM-head inputs that
/// differ from the matmuls' and `--reference` off the FP32 route.
pub fn cuda_route(spec: &ExecutionSpec) -> Result<(Route, RouteOptions)> {
    let route = match spec.matmul_inputs {
        Precision::F32 => Route::Fp32,
        Precision::Bf16 => Route::Bf16TensorCore,
    };
    ensure!(
        spec.lm_head_inputs == spec.matmul_inputs,
        "backend cuda: LM-head inputs {} differ from matmul inputs {} (one route sets both)",
        spec.lm_head_inputs.name(),
        spec.matmul_inputs.name()
    );
    ensure!(
        !spec.reference || route == Route::Fp32,
        "--reference on CUDA: the route has {} matmul inputs; --reference implies --lossless (f32)",
        spec.matmul_inputs.name()
    );
    Ok((
        route,
        RouteOptions {
            reference: spec.reference,
            reproducible: spec.reproducible,
            kv_rotation: spec.kv_rotation,
            attn_fp8_qk: FastPathUse::of(spec, crate::backend::FAST_PATH_ATTN_FP8_QK),
            attn_int8_qk: if spec.original_int8_prefill_kernel {
                FastPathUse::Off
            } else {
                FastPathUse::of(spec, crate::backend::FAST_PATH_ATTN_INT8_QK)
            },
            attn_f16: if spec.original_nvfp4_prefill_kernel {
                FastPathUse::Off
            } else {
                FastPathUse::of(spec, crate::backend::FAST_PATH_ATTN_F16)
            },
            lm_head_fused: FastPathUse::of(spec, crate::backend::FAST_PATH_LM_HEAD_FUSED),
        },
    ))
}

/// Loads `artifact` on the chosen backend, with YaRN of `rope_yarn_factor`
/// (1: native RoPE) on its full-attention layers.
pub fn load_model(artifact: &Artifact, kind: BackendKind, rope_yarn_factor: f64) -> Result<Box<dyn WindowScorer>> {
    match kind {
        BackendKind::Cpu(cpu) => Ok(Box::new(Transformer::load(cpu, artifact)?.with_rope_yarn(rope_yarn_factor)?)),
        BackendKind::Cuda { device, spec } => {
            check_cuda_support(artifact)?;
            let (route, opts) = cuda_route(&spec)?;
            let mut backend = CudaBackend::open_with(device, route, spec.kv_format, opts).context("backend cuda")?;
            use crate::backend::cuda::delta_net::DeltaScan;
            if let Some(kernel) = DeltaScan::for_fast_paths(&spec.fast_paths)? {
                backend.set_delta_scan(kernel);
            } else if FastPathUse::of(&spec, crate::backend::FAST_PATH_DELTA_CHUNK_3XTF32) == FastPathUse::Off {
                // --no-fast-path turns the route's default chunked scan off.
                backend.set_delta_scan(DeltaScan::Exact);
            }
            Ok(Box::new(Transformer::load(backend, artifact)?.with_rope_yarn(rope_yarn_factor)?))
        }
    }
}

#[cfg(test)]
mod tests;
