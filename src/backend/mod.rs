//! The backend seam: the handful of ops a transformer forward pass needs,
//! written as one trait ([`Backend`]) that each device implements (the CPU
//! reference in `cpu`, the CUDA backend in `cuda`). The model code in
//! `crate::model` is written once against this trait and never sees device
//! memory.
//!
//! The seam is at the level of ops, as in candle's `BackendStorage`: a
//! backend owns its activation buffers ([`Backend::Act`]), its weights in
//! whatever storage it chooses ([`Backend::Matrix`], [`Backend::Vector`]) and
//! its KV cache ([`Backend::KvCache`]). Only two things ever come back to the
//! host: nothing during the forward pass, and a few numbers per scored
//! position from [`Backend::score_rows`] (max, log-sum-exp, the target's
//! logit, optionally top-k and the logits of listed ids). No vocabulary-sized
//! row leaves an op.
//!
//! Shapes: activations are row-major `(n_tokens, n_cols)` matrices, one row
//! per token of the current pass; heads are contiguous column blocks
//! (`(n_tokens, n_heads * d_head)`, head `h` at columns `h*d_head..`).
//! Weights are `(n_out, n_in)` as the artifact stores them, and
//! `matmul(x, w)` is `x · wᵀ`.
//!
//! This module does not decode quantized blocks (that is
//! `cpu::dequant`) and does not plan windows (that is `crate::plan`).

pub mod cpu;
pub mod cuda;

use anyhow::{bail, ensure, Result};
use serde::{Deserialize, Serialize};

use crate::artifact::meta::{Activation, RopeStyle};
use crate::artifact::TensorView;
use crate::kv::{ElemCodec, KvCodecs, KvFormat, KvRotation, RowCodec};

/// Rotary embedding of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    pub style: RopeStyle,
    /// Frequency base (per layer: gemma3's sliding layers use their own).
    pub base: f64,
    /// Linear position scaling: the angle uses `pos / scale`. 1 when none.
    pub scale: f64,
    /// Dimensions rotated per head (the first `rope_dim` of `d_head`), even.
    pub rope_dim: usize,
    /// YaRN scaling (`--rope-yarn-factor`), `None` for native RoPE.
    pub yarn: Option<Yarn>,
}

/// YaRN ("YaRN: Efficient Context Window Extension", Peng et al. 2023), as
/// transformers' `_compute_yarn_parameters` defines it with its defaults
/// (beta_fast 32, beta_slow 1, truncated correction range, attention
/// factor `0.1 ln(factor) + 1` on cos and sin). Pair `i`'s inverse frequency
/// `f_i` becomes `f_i / factor * r + f_i * (1 - r)` with the ramp `r =
/// clamp((i - low) / (high - low), 0, 1)`: high-frequency pairs (below
/// `low`) keep their frequency, low-frequency pairs (above `high`) are
/// interpolated by `factor`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub ramp_low: f64,
    pub ramp_high: f64,
    /// Multiplier on cos and sin (so on q·k twice).
    pub attn_factor: f64,
}

impl Yarn {
    pub const BETA_FAST: f64 = 32.0;
    pub const BETA_SLOW: f64 = 1.0;

    /// YaRN for `factor` (> 1) over a model trained on `original_context`
    /// positions with frequency base `base` and `rope_dim` rotated dimensions.
    pub fn new(factor: f64, original_context: usize, base: f64, rope_dim: usize) -> Self {
        let dim = rope_dim as f64;
        let correction_dim =
            |n_rot: f64| dim * (original_context as f64 / (n_rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
        let low = correction_dim(Self::BETA_FAST).floor().max(0.0);
        let mut high = correction_dim(Self::BETA_SLOW).ceil().min(dim - 1.0);
        if low == high {
            high += 0.001;
        }
        Self { factor, ramp_low: low, ramp_high: high, attn_factor: 0.1 * factor.ln() + 1.0 }
    }
}

impl RopeParams {
    /// The inverse frequency of rotated pair `i` (f64): `base^(-2i/rope_dim) / scale`, then YaRN's blend.
    pub fn inv_freq(&self, i: usize) -> f64 {
        let f = 1.0 / self.base.powf(2.0 * i as f64 / self.rope_dim as f64) / self.scale;
        match self.yarn {
            None => f,
            Some(y) => {
                let r = ((i as f64 - y.ramp_low) / (y.ramp_high - y.ramp_low)).clamp(0.0, 1.0);
                f / y.factor * r + f * (1.0 - r)
            }
        }
    }

    /// The multiplier on cos and sin: YaRN's attention factor, else 1.
    pub fn attn_factor(&self) -> f64 {
        self.yarn.map_or(1.0, |y| y.attn_factor)
    }
}

/// Causal grouped-query attention of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub d_head: usize,
    pub d_head_v: usize,
    /// Multiplier on q·k.
    pub scale: f64,
    /// `Some(w)`: a query at `pos` sees keys at `pos - w + 1 ..= pos`.
    pub window: Option<usize>,
    /// tanh soft-cap on the scaled attention logits.
    pub softcap: Option<f64>,
}

impl AttnParams {
    /// The KV head query head `h` reads: consecutive query heads share one
    /// KV head (`n_heads / n_kv_heads` of them), as in llama.cpp and
    /// transformers' `repeat_kv`.
    pub fn kv_head_of(&self, h: usize) -> usize {
        h / (self.n_heads / self.n_kv_heads)
    }

    /// The first key position a query at `pos` may attend to.
    pub fn first_key(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }
}

/// Geometry of a KV cache: one K and one V buffer per layer, each holding
/// `n_seqs` slots (one per window of a batched pass) of `max_pos` positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub d_head: usize,
    pub d_head_v: usize,
    pub max_pos: usize,
    pub n_seqs: usize,
}

/// The rows of one forward pass: `n_seqs` windows side by side, `n_tokens`
/// rows each, window-major. Row `s * n_tokens + i` is window `s`'s token at
/// position `pos0 + i`; window `s` writes and reads KV slot `s`, which must
/// already hold its positions `..pos0` (earlier passes of the same windows).
/// Batching never mixes rows of different windows: every op is per row except
/// attention, which is per window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassRows {
    pub n_seqs: usize,
    pub n_tokens: usize,
    pub pos0: usize,
}

impl PassRows {
    /// One window's rows at positions `pos0..pos0 + n_tokens`.
    pub fn single(n_tokens: usize, pos0: usize) -> Self {
        Self { n_seqs: 1, n_tokens, pos0 }
    }

    /// Rows in the pass: `n_seqs * n_tokens`.
    pub fn n_rows(&self) -> usize {
        self.n_seqs * self.n_tokens
    }

    /// The position of row `r`.
    pub fn position(&self, r: usize) -> usize {
        self.pos0 + r % self.n_tokens.max(1)
    }
}

/// What the LM-head op reduces each requested row to, besides max and
/// log-sum-exp.
#[derive(Debug, Clone, Default)]
pub struct HeadRequest<'a> {
    /// One target id per requested row: its logit is returned.
    pub targets: &'a [u32],
    /// Return the `top_k` largest logits with their ids (0 = none, at most
    /// [`MAX_TOP_K`]).
    pub top_k: usize,
    /// Per requested row, ids whose logits are returned in that order (for KL
    /// against a recorded reference). Empty: none.
    pub extra_ids: &'a [Vec<u32>],
    /// tanh soft-cap applied to every logit first, when the model has one.
    pub softcap: Option<f64>,
}

/// The most top-k entries the LM-head op returns per row.
pub const MAX_TOP_K: usize = 64;

/// One logits row, reduced. The log-probability of id `i` is
/// `logit_i - lse`.
#[derive(Debug, Clone, PartialEq)]
pub struct RowScore {
    pub max_logit: f64,
    /// log Σ exp(logit), accumulated in f64.
    pub lse: f64,
    pub target_logit: f64,
    /// `(id, logit)`, largest first; ties broken by the smaller id.
    pub top: Vec<(u32, f32)>,
    /// Logits of `HeadRequest::extra_ids[row]`, in that order.
    pub extra: Vec<f32>,
}

/// The routing of one mixture-of-experts layer (qwen3moe): per row, the
/// softmax of the router logits in f64, the `top_k` most probable experts
/// (ties: the lower expert index wins), their probabilities renormalized to
/// sum 1 when `norm_topk_prob`, and the weighted sum of the selected
/// experts' outputs added in ascending expert index, in f64.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeRouting {
    pub n_experts: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    /// The experts' gated activation (SwiGLU for qwen3moe).
    pub activation: Activation,
}

impl MoeRouting {
    /// The shape checks of every backend's [`Backend::moe_ffn`]: `n_experts`
    /// experts and counters, `1 <= top_k <= n_experts`, router logits
    /// `(n_rows, n_experts)` as `(logit_rows, logit_cols)`.
    pub fn check_inputs(&self, n_rows: usize, logit_rows: usize, logit_cols: usize, n_experts: usize, n_counts: usize) -> Result<()> {
        ensure!(
            n_experts == self.n_experts && n_counts == self.n_experts,
            "moe_ffn: {n_experts} experts and {n_counts} counters for a router over {}",
            self.n_experts
        );
        ensure!((1..=self.n_experts).contains(&self.top_k), "moe_ffn: top {} of {} experts", self.top_k, self.n_experts);
        ensure!(
            logit_rows == n_rows && logit_cols == self.n_experts,
            "moe_ffn: router logits are {logit_rows} x {logit_cols}, expected {n_rows} x {}",
            self.n_experts
        );
        Ok(())
    }
}

/// One expert of a routed FFN: `down(act(gate x) * up x)`, each matrix
/// loaded from the expert's contiguous byte range of its bank.
#[derive(Debug)]
pub struct Expert<M> {
    /// `(d_ffn_expert, d_model)`
    pub gate: M,
    /// `(d_ffn_expert, d_model)`
    pub up: M,
    /// `(d_model, d_ffn_expert)`
    pub down: M,
}

/// One Gated DeltaNet layer (Qwen3-Next's linear attention) as the backend
/// runs it after the input projections: `qkv` `(n, conv_channels)` (q of
/// `n_k_heads * d_k`, k of the same, v of `n_v_heads * d_v`, llama.cpp's
/// `attn_qkv` order), `z` `(n, n_v_heads * d_v)` (the output gate), `ba`
/// `(n, 2 * n_v_heads)` in transformers' per-key-head order (for key head
/// `g`, the `n_v_heads / n_k_heads` beta inputs, then as many alpha inputs).
#[derive(Debug)]
pub struct DeltaNetWeights<V> {
    /// `(conv_channels * conv_kernel)`: channel-major taps of the depthwise causal convolution.
    pub conv: V,
    /// `(n_v_heads)`: `A = -exp(A_log)` (llama.cpp's `ssm_a`).
    pub a: V,
    /// `(n_v_heads)`: the time-step bias (`dt_bias`, llama.cpp's `ssm_dt.bias`).
    pub dt_bias: V,
    /// `(d_v)`: the gated RMSNorm weight shared by every value head (`ssm_norm`; plain, not `1 + w`).
    pub norm: V,
}

/// Geometry of a Gated DeltaNet layer (see [`crate::artifact::meta::HybridParams`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeltaNetParams {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub d_k: usize,
    pub d_v: usize,
    pub conv_kernel: usize,
    /// Epsilon of the gated RMSNorm.
    pub eps: f64,
}

impl DeltaNetParams {
    /// Channels of the causal convolution: q, k (`n_k_heads * d_k` each), v (`n_v_heads * d_v`).
    pub fn conv_channels(&self) -> usize {
        2 * self.n_k_heads * self.d_k + self.n_v_heads * self.d_v
    }

    /// The shape checks of every backend's [`Backend::delta_net`]: heads that
    /// share key heads evenly, inputs of `n_rows` rows of their widths
    /// (`(rows, cols)` of `qkv`, `z`, `ba`), weights of their lengths (`conv`,
    /// `a`, `dt_bias`, `norm`), a state per window.
    #[allow(clippy::too_many_arguments)]
    pub fn check_inputs(&self, n_rows: usize, qkv: (usize, usize), z: (usize, usize), ba: (usize, usize), weights: [usize; 4], n_states: usize, n_seqs: usize) -> Result<()> {
        let (nk, nv) = (self.n_k_heads, self.n_v_heads);
        ensure!(nk > 0 && nv % nk == 0, "delta_net: {nv} value heads do not share {nk} key heads evenly");
        let (channels, vd) = (self.conv_channels(), nv * self.d_v);
        ensure!(
            qkv == (n_rows, channels) && z == (n_rows, vd) && ba == (n_rows, 2 * nv),
            "delta_net: qkv {} x {}, z {} x {}, ba {} x {}; a pass of {n_rows} rows of {self:?} needs {channels}, {vd}, {}",
            qkv.0,
            qkv.1,
            z.0,
            z.1,
            ba.0,
            ba.1,
            2 * nv
        );
        ensure!(
            self.conv_kernel >= 1 && weights == [channels * self.conv_kernel, nv, nv, self.d_v],
            "delta_net: weights of {}, {}, {}, {} values for {self:?}",
            weights[0],
            weights[1],
            weights[2],
            weights[3]
        );
        ensure!(n_states >= n_seqs, "delta_net: {n_states} recurrent states for {n_seqs} windows");
        Ok(())
    }
}

/// The state a Gated DeltaNet layer carries from one prefill pass of a
/// window to the next, as attention carries its KV cache: the last
/// `conv_kernel - 1` convolution inputs and the recurrent state, in f64 for
/// the state (the CPU oracle's precision). Zero at a window's start. The CPU
/// backend holds these; CUDA holds the same values in device memory
/// ([`Backend::Recurrent`]) and gives them back as these.
#[derive(Debug, Clone, PartialEq)]
pub struct RecurrentState {
    /// `(conv_kernel - 1, conv_channels)`
    pub conv: Vec<f32>,
    /// `(n_v_heads, d_k, d_v)`
    pub ssm: Vec<f64>,
}

impl RecurrentState {
    pub fn new(p: &DeltaNetParams) -> Self {
        let channels = p.conv_channels();
        Self { conv: vec![0.0; (p.conv_kernel - 1) * channels], ssm: vec![0.0; p.n_v_heads * p.d_k * p.d_v] }
    }
}

/// [`Backend::qkv`] as three matmuls, each followed by its bias.
pub fn qkv_unfused<B: Backend + ?Sized>(b: &B, h: &B::Act, w: [&B::Matrix; 3], bias: Option<&[B::Vector; 3]>) -> Result<[B::Act; 3]> {
    let [mut q, mut k, mut v] = [b.matmul(h, w[0])?, b.matmul(h, w[1])?, b.matmul(h, w[2])?];
    if let Some([bq, bk, bv]) = bias {
        b.add_bias(&mut q, bq)?;
        b.add_bias(&mut k, bk)?;
        b.add_bias(&mut v, bv)?;
    }
    Ok([q, k, v])
}

/// [`Backend::qkv_rope`] as [`Backend::qkv`], then [`Backend::rope`] of q and
/// of k (`n_heads`: q's and k's head counts).
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_unfused<B: Backend + ?Sized>(
    b: &B,
    h: &B::Act,
    w: [&B::Matrix; 3],
    bias: Option<&[B::Vector; 3]>,
    n_heads: [usize; 2],
    d_head: usize,
    rows: PassRows,
    p: &RopeParams,
) -> Result<[B::Act; 3]> {
    let [mut q, mut k, v] = b.qkv(h, w, bias)?;
    b.rope(&mut q, n_heads[0], d_head, rows, p)?;
    b.rope(&mut k, n_heads[1], d_head, rows, p)?;
    Ok([q, k, v])
}

/// The ops a device provides. Every op checks the shapes it is given and
/// names the op and the values in its error.
pub trait Backend {
    /// Activations: a dense row-major `(n_rows, n_cols)` matrix.
    type Act;
    /// A weight matrix `(n_out, n_in)` in the backend's storage.
    type Matrix;
    /// A weight vector (norm weight, bias).
    type Vector;
    /// K and V for every layer of one window.
    type KvCache;
    /// What one Gated DeltaNet layer carries from one prefill pass to the
    /// next for every window of the pass ([`RecurrentState`] each), kept
    /// where the backend computes (device memory on CUDA).
    type Recurrent;
    /// One MoE layer's expert-usage counters (rows routed to each expert so
    /// far), kept where the backend routes (device memory on CUDA, so that
    /// a layer never waits to count); read by [`read_expert_counts`](Self::read_expert_counts).
    type ExpertCounts;

    /// A short description for logs and reports (`cpu (2 threads)`).
    fn describe(&self) -> String;

    /// Loads a 2-D weight (any format the backend supports).
    fn load_matrix(&self, view: &TensorView) -> Result<Self::Matrix>;
    /// Loads a 1-D weight as f32.
    fn load_vector(&self, view: &TensorView) -> Result<Self::Vector>;
    fn new_kv_cache(&self, geometry: KvGeometry) -> Result<Self::KvCache>;

    /// Zero recurrent state (a window's start) for `n_seqs` windows of a
    /// Gated DeltaNet layer of shape `p`. The default refuses, as
    /// [`delta_net`](Self::delta_net) does.
    fn new_recurrent(&self, p: &DeltaNetParams, n_seqs: usize) -> Result<Self::Recurrent> {
        let _ = (p, n_seqs);
        bail!("{}: Gated DeltaNet linear attention (qwen3next) is not supported on this backend: use --backend cpu", self.describe())
    }

    /// The carried states of `r`, one per window, on the host (for tests and checks).
    fn recurrent_states(&self, r: &Self::Recurrent) -> Result<Vec<RecurrentState>> {
        let _ = r;
        bail!("{}: Gated DeltaNet linear attention (qwen3next) is not supported on this backend: use --backend cpu", self.describe())
    }

    /// Rows `tokens[i]` of `table`, times `scale`. -> `(n_tokens, n_in)`.
    fn embed(&self, table: &Self::Matrix, tokens: &[u32], scale: f64) -> Result<Self::Act>;

    /// RMSNorm of every row of `x` `(n, d)`: `x / sqrt(mean(x²) + eps) * w`,
    /// `w` of `d` elements (gemma's `1 + w` is already in the weight).
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f64) -> Result<Self::Act>;

    /// [`rms_norm`](Self::rms_norm) of a row set that only matmuls read (the
    /// layer norm before q/k/v or a dense gated FFN): the same numbers, which
    /// is the default body; the CUDA default route then writes only the bf16
    /// rounding those matmuls take (no f32 copy that nothing reads).
    fn rms_norm_for_matmul(&self, x: &Self::Act, w: &Self::Vector, eps: f64) -> Result<Self::Act> {
        self.rms_norm(x, w, eps)
    }

    /// In place, RMSNorm of each `d_head` slice of every row of `x`
    /// `(n, n_heads * d_head)` with one shared `w` of `d_head` elements
    /// (QK norm).
    fn rms_norm_heads(&self, x: &mut Self::Act, w: &Self::Vector, d_head: usize, eps: f64) -> Result<()>;

    /// `x (n, n_in) · wᵀ` -> `(n, n_out)`.
    fn matmul(&self, x: &Self::Act, w: &Self::Matrix) -> Result<Self::Act>;

    /// The residual add folded into a matmul: in place `x (n, n_out) += a (n,
    /// n_in) · wᵀ`; the numbers of [`matmul`](Self::matmul) then
    /// [`add_assign`](Self::add_assign), which is the default body (the CUDA
    /// default route adds the f32 product to `x` in the GEMM's epilogue).
    fn matmul_add(&self, x: &mut Self::Act, a: &Self::Act, w: &Self::Matrix) -> Result<()> {
        let y = self.matmul(a, w)?;
        self.add_assign(x, &y)
    }

    /// In place, `x[i, j] += b[j]`.
    fn add_bias(&self, x: &mut Self::Act, b: &Self::Vector) -> Result<()>;

    /// The attention's input projections: `h (n, n_in) · w[s]ᵀ (+ bias[s])` for
    /// s = q, k, v -> `[(n, n_q), (n, n_k), (n, n_v)]`; the numbers of three
    /// [`matmul`](Self::matmul)s then [`add_bias`](Self::add_bias), which is the
    /// default body ([`qkv_unfused`]; the CUDA backend can run one GEMM over
    /// the three weights stacked, the bias in its epilogue, off by default).
    fn qkv(&self, h: &Self::Act, w: [&Self::Matrix; 3], bias: Option<&[Self::Vector; 3]>) -> Result<[Self::Act; 3]> {
        qkv_unfused(self, h, w, bias)
    }

    /// In place, rotates each head of `x` `(rows.n_rows(), n_heads * d_head)`;
    /// row `r` is at position `rows.position(r)`.
    fn rope(&self, x: &mut Self::Act, n_heads: usize, d_head: usize, rows: PassRows, p: &RopeParams) -> Result<()>;

    /// RoPE folded into a projection: `x (n, n_in) · wᵀ` -> `(n, n_heads *
    /// d_head)`, each head rotated as [`rope`](Self::rope) rotates it; the numbers
    /// of [`matmul`](Self::matmul) then `rope`, which is the default body (the
    /// CUDA default route rotates the f32 products in the GEMM's epilogue).
    fn matmul_rope(&self, x: &Self::Act, w: &Self::Matrix, n_heads: usize, d_head: usize, rows: PassRows, p: &RopeParams) -> Result<Self::Act> {
        let mut y = self.matmul(x, w)?;
        self.rope(&mut y, n_heads, d_head, rows, p)?;
        Ok(y)
    }

    /// [`qkv`](Self::qkv), then [`rope`](Self::rope) of q `(n, n_heads * d_head)`
    /// and k `(n, n_kv_heads * d_head)` (a layer without QK norm); the numbers of
    /// those calls, which is the default body ([`qkv_rope_unfused`]; the CUDA
    /// default route runs q and k through [`matmul_rope`](Self::matmul_rope)).
    #[allow(clippy::too_many_arguments)]
    fn qkv_rope(
        &self,
        h: &Self::Act,
        w: [&Self::Matrix; 3],
        bias: Option<&[Self::Vector; 3]>,
        n_heads: usize,
        n_kv_heads: usize,
        d_head: usize,
        rows: PassRows,
        p: &RopeParams,
    ) -> Result<[Self::Act; 3]> {
        qkv_rope_unfused(self, h, w, bias, [n_heads, n_kv_heads], d_head, rows, p)
    }

    /// For each window `s` of the pass: writes its rows of `k` `(n, n_kv_heads
    /// * d_head)` and `v` `(n, n_kv_heads * d_head_v)` to slot `s` of
    /// `layer`'s cache at positions `pos0..pos0 + n_tokens`, then attends each
    /// of its rows of `q` `(n, n_heads * d_head)` causally over the slot's
    /// positions `first_key(pos)..=pos`. -> `(n, n_heads * d_head_v)`, with
    /// `n = rows.n_rows()`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        cache: &mut Self::KvCache,
        layer: usize,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        rows: PassRows,
        p: &AttnParams,
    ) -> Result<Self::Act>;

    /// `act(gate) * up`, both `(n, d_ffn)`.
    fn gated_act(&self, gate: &Self::Act, up: &Self::Act, act: Activation) -> Result<Self::Act>;

    /// The gated FFN's input to its down projection: `act(h · gateᵀ) * (h ·
    /// upᵀ)`, `h (n, d_model)`, `gate` and `up` `(d_ffn, d_model)` -> `(n,
    /// d_ffn)`; the numbers of two [`matmul`](Self::matmul)s then
    /// [`gated_act`](Self::gated_act), which is the default body (the CUDA
    /// backend computes both products in one GEMM with the activation in its
    /// epilogue).
    fn gated_ffn(&self, h: &Self::Act, gate: &Self::Matrix, up: &Self::Matrix, act: Activation) -> Result<Self::Act> {
        let g = self.matmul(h, gate)?;
        let u = self.matmul(h, up)?;
        self.gated_act(&g, &u, act)
    }

    /// In place, `x += y`.
    fn add_assign(&self, x: &mut Self::Act, y: &Self::Act) -> Result<()>;

    /// The residual add folded into the next norm: in place `x += y`, then
    /// [`rms_norm`](Self::rms_norm) of the new `x` (`(n, d)`, `w` of `d`); the
    /// numbers of [`add_assign`](Self::add_assign) then `rms_norm`, which is the
    /// default body (the CUDA backend does both in one pass).
    fn add_rms_norm(&self, x: &mut Self::Act, y: &Self::Act, w: &Self::Vector, eps: f64) -> Result<Self::Act> {
        self.add_assign(x, y)?;
        self.rms_norm(x, w, eps)
    }

    /// Zero expert-usage counters for a layer of `n_experts` experts.
    fn new_expert_counts(&self, n_experts: usize) -> Result<Self::ExpertCounts>;

    /// The counts of `c`, on the host (one wait for the device on CUDA).
    fn read_expert_counts(&self, c: &Self::ExpertCounts) -> Result<Vec<u64>>;

    /// The routed experts of one layer: for each row of `x` `(n, d_model)`,
    /// with its router logits `(n, n_experts)`, routes as [`MoeRouting`]
    /// says and returns the weighted sum of the selected experts' outputs
    /// `(n, d_model)`. Adds to `counts` (its entry `e`) the rows routed to
    /// expert `e` (on CUDA on the device: the call does not wait to count).
    /// Rows never mix, so batching changes no number. The default refuses:
    /// only the CPU reference implements it so far.
    fn moe_ffn(
        &self,
        _x: &Self::Act,
        _router_logits: &Self::Act,
        _experts: &[Expert<Self::Matrix>],
        p: &MoeRouting,
        _counts: &mut Self::ExpertCounts,
    ) -> Result<Self::Act> {
        bail!(
            "{}: the routed mixture-of-experts FFN ({} experts, top {}) is not supported on this backend: use --backend cpu",
            self.describe(),
            p.n_experts,
            p.top_k
        )
    }

    /// In place, `x[i, j] *= sigmoid(gate[i, j])`, or `sigmoid(gate[i, 0])`
    /// when `gate` has one column (Qwen3-Next's attention gate and shared-expert
    /// gate). The default refuses (the CPU and CUDA backends implement it).
    fn sigmoid_mul(&self, _x: &mut Self::Act, _gate: &Self::Act) -> Result<()> {
        bail!("{}: sigmoid gating (qwen3next) is not supported on this backend: use --backend cpu", self.describe())
    }

    /// One Gated DeltaNet layer after its input projections (see
    /// [`DeltaNetWeights`] for the inputs): causal convolution + SiLU over
    /// `qkv`, `beta = sigmoid(b)`, `g = A * softplus(alpha + dt_bias)`, the
    /// gated delta rule with L2-normed q and k, then per value head
    /// `norm · rmsnorm(o) · silu(z)`. Window `s` of the pass reads and updates
    /// its state in `states` ([`new_recurrent`](Self::new_recurrent)).
    /// -> `(n, n_v_heads * d_v)`, before the out-projection.
    /// The default refuses (the CPU and CUDA backends implement it).
    #[allow(clippy::too_many_arguments)]
    fn delta_net(
        &self,
        _qkv: &Self::Act,
        _z: &Self::Act,
        _ba: &Self::Act,
        _w: &DeltaNetWeights<Self::Vector>,
        _p: &DeltaNetParams,
        _states: &mut Self::Recurrent,
        _rows: PassRows,
    ) -> Result<Self::Act> {
        bail!("{}: Gated DeltaNet linear attention (qwen3next) is not supported on this backend: use --backend cpu", self.describe())
    }

    /// The fused LM head: for each `rows[r]` of `x` `(n, d_model)` (already
    /// final-normed), the logits row `x[rows[r]] · headᵀ` reduced as
    /// [`HeadRequest`] asks. Nothing of vocabulary size is returned.
    fn score_rows(&self, x: &Self::Act, rows: &[usize], head: &Self::Matrix, req: &HeadRequest) -> Result<Vec<RowScore>>;

    /// What the report records about this backend: where it runs and every
    /// setting that changes a number.
    fn execution(&self) -> ExecutionInfo;

    /// The device memory used so far (a GPU backend); `None` on the CPU, whose
    /// memory is the process's (report.json `memory.host_peak_rss_bytes`).
    fn device_memory(&self) -> Result<Option<DeviceMemory>> {
        Ok(None)
    }

    /// Checks, before any window runs, that a model of `hp`-sized buffers
    /// fits: a KV cache of `kv.n_seqs` slots of `kv.max_pos` positions,
    /// passes of `n_pass_tokens` rows (all windows of a batch together) with
    /// `n_pass_cols` as the widest activation row, and an LM head over
    /// `n_vocab`. The default (host memory) accepts every plan.
    fn check_memory(&self, _kv: KvGeometry, _n_pass_tokens: usize, _n_pass_cols: usize, _n_vocab: usize) -> Result<()> {
        Ok(())
    }
}

/// Device memory of one GPU worker over a run (report.json `memory.devices`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceMemory {
    /// The device in words.
    pub device: String,
    /// The allocator's high-water mark: the most bytes the run's device buffers
    /// (weights, KV cache, activations, bf16 weight scratch) held at once, from the
    /// default memory pool's `CU_MEMPOOL_ATTR_USED_MEM_HIGH`.
    pub pool_used_peak_bytes: u64,
    /// The most bytes that pool reserved from the driver (`CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`).
    pub pool_reserved_peak_bytes: u64,
    /// `total - free` of cuMemGetInfo after scoring: everything resident on the
    /// device then (this context, its modules, the pool's reserve; other processes too).
    pub device_used_at_end_bytes: u64,
    pub device_total_bytes: u64,
}

/// What a run's report says about where and how the forward pass ran.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecutionInfo {
    /// `cpu` or `cuda`.
    pub backend: String,
    /// The device in words (`cpu (2 threads)`, `NVIDIA H200 ...`).
    pub device: String,
    /// The KV format (`--kv-dtype` name).
    pub kv_dtype: String,
    /// Numeric route: `fp32` (f32 everywhere) or `bf16-tc` (bf16 activations
    /// into tensor-core matmuls, f32 accumulation); `bf16-tc-emulated` on the CPU.
    pub route: String,
    /// Everything else that can change a number (kernels, PTX arch, nvcc, driver).
    pub details: serde_json::Value,
}

/// Element precision of a matrix product's inputs (accumulation is f32 on every route).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    /// Inputs rounded to bf16 (round to nearest even), as tensor cores take them.
    Bf16,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

/// The chunked Gated DeltaNet scan with tf32 tensor-core products (CUDA;
/// kernels/delta_net.cu `delta_net_chunk_tf32`).
pub const FAST_PATH_DELTA_CHUNK_TF32: &str = "delta-chunk-tf32";
/// The chunked Gated DeltaNet scan with 3xtf32 products (about f32 accuracy;
/// `delta_net_chunk_3xtf32`): on by default on the CUDA default route, where it
/// stays within that route's bound (docs/performance.md); naming it forces it
/// (heads it does not take are then an error rather than the exact scan).
pub const FAST_PATH_DELTA_CHUNK_3XTF32: &str = "delta-chunk-3xtf32";

/// Named fast paths: kernels that change rounding for speed, each qualified
/// per configuration (docs/performance.md); `--fast-path NAME` forces one,
/// rejects names not in this table (listing it) and refuses every one under
/// `--lossless`, `--reference` and `--reproducible`.
pub const FAST_PATHS: &[&str] = &[
    FAST_PATH_DELTA_CHUNK_TF32,
    FAST_PATH_DELTA_CHUNK_3XTF32,
    FAST_PATH_ATTN_FP8_QK,
    FAST_PATH_ATTN_INT8_QK,
    FAST_PATH_ATTN_F16,
    FAST_PATH_LM_HEAD_FUSED,
];

/// The LM head reduced in its GEMM's epilogue (`cuda::ops::lm_head_fused`,
/// kernels/gemm_sm90a.cu `gemm_bf16_wgmma_lmhead`): no logits written; per row and
/// 256-column tile the max and an f32 sum of exp (ex2.approx), combined in f64, where
/// the tiled head sums the f64 exp of every logit (the sums of exp within 2.5e-7
/// relative of the tiled head's on the H200, so log-probabilities within as many nats;
/// the max and the target's logit keep their bits). On by default on the CUDA default route (wgmma devices) for the passes that
/// ask for no top-k and no listed ids (`--save-top-tokens` and `--kl-reference` runs
/// keep the tiled head, and naming it with those flags is an error).
/// `--fast-path lm-head-fused` is an error on a device without its kernel; elsewhere it
/// runs where a pass can take it (at least 128 scored rows, no final soft-cap), as by
/// default. `--no-fast-path lm-head-fused` turns it off.
pub const FAST_PATH_LM_HEAD_FUSED: &str = "lm-head-fused";

/// Attention kernel v3 over an fp8 cache with S = Q·Kᵀ by e4m3 wgmma on K's
/// stored codes (q as two e4m3 terms times a per-row power of two, K's row
/// scales folded into S's columns; kernels/attention_sm90a.cu
/// `attn_wgmma_d<D>_fp8qk`): on by default on the CUDA default route at the head
/// sizes of `cuda::ops::ATTN_FP8_QK_DEFAULT_HEAD_DIMS` (d 128 from qk9, where the H200
/// measured it faster than the decoding kernel, docs/performance.md, qk9; none since
/// 2026-12-04, when the decoding kernel measured within 1.3 % of it at ctx 4096 d 128
/// and faster on the 8B shape and at ctx 512, "hadd"); naming it forces it at d 64 and
/// 128; `--no-fast-path attn-fp8-qk` turns it off.
pub const FAST_PATH_ATTN_FP8_QK: &str = "attn-fp8-qk";

/// Kernel v3 with S = Q·Kᵀ by f16 wgmma on an int8 (or k8v4) cache's stored K codes,
/// written in f16 (exact) by the producer (`cuda::ops::attention_coded_int8_qk`,
/// `attn_wgmma_d<D>_<int8|k8v4>qk`; since qh, before it s8 wgmma): q rounded to f16
/// (2^-11) times a power of two per row where the decoding kernel rounds q to bf16
/// (2^-9); K exact where that kernel rounds code * scale to bf16; P·V in f16 on V's stored codes (P to 2^-12, each V element code * f16(scale *
/// 2^-e) with a power of two per key tile, where the decoding kernel rounds P and code *
/// scale to bf16, 2^-9). On by default on the CUDA default route at the head sizes of
/// `cuda::ops::ATTN_INT8_QK_DEFAULT_HEAD_DIMS` (per format, where the H200 measured
/// it faster than the decoding kernel; docs/performance.md, qk10); naming it forces
/// it wherever it has a kernel; `--no-fast-path attn-int8-qk` or
/// `--use-original-int8-prefill-kernel` turn it off.
pub const FAST_PATH_ATTN_INT8_QK: &str = "attn-int8-qk";

/// Kernel v3 over an nvfp4, k4v2 or vq2 cache computing in f16 where the decoding
/// kernel rounds to bf16 (`cuda::ops::attention_coded_f16`, `attn_wgmma_d<D>_<fmt>f16`):
/// the producer decodes K and V to f16, each element code value * f16(scale * 2^-e)
/// rounded to f16, e a power of two per key tile (nvfp4: (e2m1 * e4m3) exact times
/// f16(S * 2^-e); vq2: the codeword rounded to f16); q rounded to f16 times a power of
/// two per row and P to f16, S and P·V by f16 wgmma, K's power of two folded into S's
/// columns. Each element to about 2^-11 relative where the decoding kernel rounds to
/// bf16 (2^-9), except rows whose scales lie 2^14 or more below their tile's largest
/// (f16's subnormals). On by default on the CUDA default route at the head sizes of
/// `cuda::ops::ATTN_F16_DEFAULT_HEAD_DIMS` (per format, where the H200 measured it
/// faster than the decoding kernel); naming it forces it wherever it has a kernel;
/// `--no-fast-path attn-f16` turns it off, and `--use-original-nvfp4-prefill-kernel`
/// for nvfp4.
pub const FAST_PATH_ATTN_F16: &str = "attn-f16";

/// Tokens of one prompt-attention wave of the kernel that stores the
/// quantized KV formats: the query rows one launch of the CUDA prefill
/// attention covers per (head, window) before the next wave starts. The CUDA
/// kernel owns the value (its launch geometry: query-tile rows times tiles
/// per wave); 128 until it says otherwise.
pub const PROMPT_ATTENTION_WAVE_TOKENS: usize = 128;

/// The prefill chunk a run uses for `requested` tokens under `kv`: for the
/// quantized formats rounded down to whole prompt-attention waves (at least
/// one wave), so every pass stores whole waves; otherwise as requested.
pub fn effective_prefill_chunk(requested: usize, kv: KvFormat) -> usize {
    if kv.is_quantized() {
        let w = PROMPT_ATTENTION_WAVE_TOKENS;
        (requested / w * w).max(w)
    } else {
        requested
    }
}

/// Every numeric setting of a run, independent of the backend: built once
/// from the flags (`config`), consumed by both backends, recorded typed in
/// report.json `execution`.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ExecutionSpec {
    /// Inputs of every matrix product but the LM head.
    pub matmul_inputs: Precision,
    /// Inputs of the LM-head product.
    pub lm_head_inputs: Precision,
    /// `--kv-dtype` (resolved: fp8 by default, f32 under `--lossless`).
    #[serde(serialize_with = "serialize_name", deserialize_with = "deserialize_name")]
    pub kv_format: KvFormat,
    /// `--kv-rotation` as asked (`auto`: the format table's choice); the
    /// effective rotation of K and V is in [`ExecutionSpec::kv_k`] /
    /// [`ExecutionSpec::kv_v`] (the report's codec names end in `+hadamard`).
    /// Absent in reports written before it existed: `auto`.
    #[serde(default, serialize_with = "serialize_name", deserialize_with = "deserialize_name")]
    pub kv_rotation: KvRotation,
    /// Forced fast paths (`--fast-path`), by name.
    pub fast_paths: Vec<String>,
    /// Fast paths turned off where they are on by default (`--no-fast-path`), by
    /// name. Absent in reports written before it existed: none.
    #[serde(default)]
    pub fast_paths_off: Vec<String>,
    /// `--use-original-int8-prefill-kernel`: an int8 cache's attention on kernel v3's
    /// decoding kernel (the fast path [`FAST_PATH_ATTN_INT8_QK`] turned off).
    pub original_int8_prefill_kernel: bool,
    pub original_nvfp4_prefill_kernel: bool,
    /// Every operation correctly rounded in f32, exact KV (f32 or bf16), no fast path.
    pub lossless: bool,
    /// The lossless route with the KV codec applied exactly (CPU definition); V as fp16 under bf16.
    pub reference: bool,
    /// Deterministic kernels only: results independent of batching and chunking.
    pub reproducible: bool,
    /// YaRN factor of the rotary embedding (1: native).
    pub rope_yarn_factor: f64,
    pub prefill_chunk_tokens: PrefillChunk,
}

/// `--prefill-chunk` as asked and as used ([`effective_prefill_chunk`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct PrefillChunk {
    pub requested: usize,
    pub effective: usize,
}

/// A setting written by its flag name (`KvFormat`, `KvRotation`: `Display` is the name).
fn serialize_name<T: std::fmt::Display, S: serde::Serializer>(v: &T, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// A setting read back from its flag name (`FromStr`).
fn deserialize_name<'de, T, D>(d: D) -> std::result::Result<T, D::Error>
where
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
    D: serde::Deserializer<'de>,
{
    let name = <String as serde::Deserialize>::deserialize(d)?;
    name.parse().map_err(serde::de::Error::custom)
}

impl ExecutionSpec {
    /// The exact reference: f32 everywhere, f32 KV, one chunk size as given.
    pub fn lossless(prefill_chunk: usize) -> Self {
        Self {
            matmul_inputs: Precision::F32,
            lm_head_inputs: Precision::F32,
            kv_format: KvFormat::F32,
            kv_rotation: KvRotation::Auto,
            fast_paths: Vec::new(),
            fast_paths_off: Vec::new(),
            original_int8_prefill_kernel: false,
            original_nvfp4_prefill_kernel: false,
            lossless: true,
            reference: false,
            reproducible: false,
            rope_yarn_factor: 1.0,
            prefill_chunk_tokens: PrefillChunk { requested: prefill_chunk, effective: prefill_chunk },
        }
    }

    /// The codec of stored K rows (the format's under `--kv-rotation`).
    pub fn kv_k(&self) -> RowCodec {
        self.kv_format.k_with(self.kv_rotation)
    }

    /// The codec of stored V rows: the format's, but fp16 under `--reference --kv-dtype bf16`.
    pub fn kv_v(&self) -> RowCodec {
        if self.reference && self.kv_format == KvFormat::Bf16 {
            RowCodec::new(ElemCodec::Fp16, false)
        } else {
            self.kv_format.v_with(self.kv_rotation)
        }
    }

    /// The stored codecs of the default route's quantized cache: the format
    /// under `--kv-rotation` (what the CUDA encoders and attention are given).
    pub fn kv_codecs(&self) -> KvCodecs {
        self.kv_format.codecs(self.kv_rotation)
    }

    /// The route's name: `fp32` (f32 matmul inputs) or `bf16-tc`.
    pub fn route(&self) -> &'static str {
        match self.matmul_inputs {
            Precision::F32 => "fp32",
            Precision::Bf16 => "bf16-tc",
        }
    }
}

/// Which backend runs the forward pass, under which spec.
#[derive(Debug, Clone, PartialEq)]
pub enum BackendKind {
    Cpu(cpu::CpuBackend),
    /// GPU `device`.
    Cuda { device: usize, spec: ExecutionSpec },
}

impl BackendKind {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Cpu(_) => "cpu",
            Self::Cuda { .. } => "cuda",
        }
    }
}

/// Whether `--backend auto` picks CUDA: a driver and at least one device.
pub fn cuda_available() -> bool {
    cuda::build_info().kernels_built && cuda::driver_present() && cuda::device_count().is_ok_and(|n| n > 0)
}
