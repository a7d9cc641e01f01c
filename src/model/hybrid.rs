//! Qwen3-Next's parts on the model side: loading a Gated DeltaNet layer
//! (`attn_qkv`, `attn_gate`, `ssm_ba`, `ssm_conv1d`, `ssm_a`, `ssm_dt.bias`,
//! `ssm_norm`, `ssm_out`, llama.cpp's names and layout), the gated query of
//! its full-attention layers (`attn_q` holds per head `d_head` query rows then
//! `d_head` gate rows; split here into two matrices, each row's bytes
//! unchanged, so the block format is kept), and the gated shared expert.
//!
//! The layer's mixing step is the backend's
//! ([`Backend::delta_net`](crate::backend::Backend::delta_net); the CPU
//! definition is `backend::cpu::delta_net`).

use anyhow::{ensure, Context, Result};

use crate::artifact::meta::{HParams, HybridParams, TensorEntry};
use crate::artifact::names::blk;
use crate::artifact::TensorView;
use crate::backend::{Backend, DeltaNetParams, DeltaNetWeights};

/// The tensors of one Gated DeltaNet layer.
pub struct DeltaNetLayer<B: Backend> {
    /// `(conv_channels, d_model)`: q, k, v of every head, in that order.
    pub qkv: B::Matrix,
    /// `(n_v_heads * d_v, d_model)`: the output gate `z`.
    pub z: B::Matrix,
    /// `(2 * n_v_heads, d_model)`: beta and alpha inputs, per key head.
    pub ba: B::Matrix,
    /// `(d_model, n_v_heads * d_v)`
    pub out: B::Matrix,
    pub weights: DeltaNetWeights<B::Vector>,
    pub params: DeltaNetParams,
    /// This layer's index among the model's DeltaNet layers (its recurrent-state slot).
    pub slot: usize,
}

/// The shared expert of a Qwen3-Next MoE layer: `sigmoid(h · gate_inpᵀ) · down(silu(gate h) * up h)`.
pub struct SharedExpert<B: Backend> {
    /// `(1, d_model)`
    pub gate_inp: B::Matrix,
    /// `(d_ffn_shared, d_model)`
    pub gate: B::Matrix,
    /// `(d_ffn_shared, d_model)`
    pub up: B::Matrix,
    /// `(d_model, d_ffn_shared)`
    pub down: B::Matrix,
}

/// The geometry the backend op takes.
pub fn delta_net_params(hp: &HParams, h: &HybridParams) -> DeltaNetParams {
    DeltaNetParams {
        n_k_heads: h.n_k_heads,
        n_v_heads: h.n_v_heads,
        d_k: h.d_k,
        d_v: h.d_v,
        conv_kernel: h.conv_kernel,
        eps: hp.rms_eps,
    }
}

fn check_shape(view: &TensorView, want: &[usize]) -> Result<()> {
    let want: Vec<u64> = want.iter().map(|&d| d as u64).collect();
    ensure!(view.entry.shape == want, "tensor {}: shape {:?}, expected {want:?}", view.entry.name, view.entry.shape);
    Ok(())
}

/// Rows `ranges` (in order) of the `(n_out, n_in)` matrix `view`, loaded as
/// one matrix named `name`, each row's bytes unchanged.
fn load_rows<B: Backend>(backend: &B, view: &TensorView, ranges: &[std::ops::Range<usize>], name: String) -> Result<B::Matrix> {
    let (n_out, n_in) = (view.entry.shape[0] as usize, view.entry.shape[1] as usize);
    let row_bytes = view.entry.format.row_bytes(n_in).with_context(|| format!("tensor {}", view.entry.name))?;
    ensure!(
        view.bytes.len() == n_out * row_bytes,
        "tensor {}: {} bytes for {n_out} rows of {row_bytes}",
        view.entry.name,
        view.bytes.len()
    );
    let mut bytes = Vec::new();
    for r in ranges {
        ensure!(r.end <= n_out, "tensor {}: rows {r:?} of {n_out}", view.entry.name);
        bytes.extend_from_slice(&view.bytes[r.start * row_bytes..r.end * row_bytes]);
    }
    let n_rows = bytes.len() / row_bytes;
    let entry = TensorEntry { name, shape: vec![n_rows as u64, n_in as u64], n_bytes: bytes.len() as u64, ..view.entry.clone() };
    backend.load_matrix(&TensorView { entry: &entry, bytes: &bytes })
}

/// The gated query of a full-attention layer: `attn_q` `(n_heads * 2 * d_head,
/// d_model)` split into the query rows and the gate rows of every head.
/// -> `(query, gate)`, each `(n_heads * d_head, d_model)`.
pub fn load_gated_q<B: Backend>(backend: &B, view: &TensorView, hp: &HParams) -> Result<(B::Matrix, B::Matrix)> {
    let (nh, dh) = (hp.n_heads, hp.d_head);
    check_shape(view, &[nh * 2 * dh, hp.d_model])?;
    let name = &view.entry.name;
    let query: Vec<_> = (0..nh).map(|h| h * 2 * dh..h * 2 * dh + dh).collect();
    let gate: Vec<_> = (0..nh).map(|h| h * 2 * dh + dh..(h + 1) * 2 * dh).collect();
    Ok((load_rows(backend, view, &query, format!("{name}[query]"))?, load_rows(backend, view, &gate, format!("{name}[gate]"))?))
}

/// A 1-D view of any tensor (the convolution's `(channels, width)` taps as one vector).
fn load_flat<B: Backend>(backend: &B, view: &TensorView, want: &[usize]) -> Result<B::Vector> {
    check_shape(view, want)?;
    let entry = TensorEntry { shape: vec![want.iter().product::<usize>() as u64], ..view.entry.clone() };
    backend.load_vector(&TensorView { entry: &entry, bytes: view.bytes })
}

/// The Gated DeltaNet layer `l` (its `slot`-th).
pub fn load_delta_net<'a, B: Backend>(
    backend: &B,
    tensor: &dyn Fn(&str) -> Result<TensorView<'a>>,
    l: usize,
    slot: usize,
    hp: &HParams,
    h: &HybridParams,
) -> Result<DeltaNetLayer<B>> {
    let d = hp.d_model;
    let (channels, vd) = (h.conv_channels(), h.n_v_heads * h.d_v);
    let matrix = |name: &str, n_out: usize, n_in: usize| -> Result<B::Matrix> {
        let view = tensor(&blk(l, name))?;
        check_shape(&view, &[n_out, n_in])?;
        backend.load_matrix(&view)
    };
    let vector = |name: &str, n: usize| -> Result<B::Vector> { load_flat(backend, &tensor(&blk(l, name))?, &[n]) };
    Ok(DeltaNetLayer {
        qkv: matrix("attn_qkv.weight", channels, d)?,
        z: matrix("attn_gate.weight", vd, d)?,
        ba: matrix("ssm_ba.weight", 2 * h.n_v_heads, d)?,
        out: matrix("ssm_out.weight", d, vd)?,
        weights: DeltaNetWeights {
            conv: load_flat(backend, &tensor(&blk(l, "ssm_conv1d.weight"))?, &[channels, h.conv_kernel])?,
            a: vector("ssm_a", h.n_v_heads)?,
            dt_bias: vector("ssm_dt.bias", h.n_v_heads)?,
            norm: vector("ssm_norm.weight", h.d_v)?,
        },
        params: delta_net_params(hp, h),
        slot,
    })
}

/// The shared expert of layer `l`.
pub fn load_shared_expert<'a, B: Backend>(
    backend: &B,
    tensor: &dyn Fn(&str) -> Result<TensorView<'a>>,
    l: usize,
    hp: &HParams,
    h: &HybridParams,
) -> Result<SharedExpert<B>> {
    let (d, f) = (hp.d_model, h.d_ffn_shared);
    let matrix = |name: &str, n_out: usize, n_in: usize| -> Result<B::Matrix> {
        let view = tensor(&blk(l, name))?;
        check_shape(&view, &[n_out, n_in])?;
        backend.load_matrix(&view)
    };
    Ok(SharedExpert {
        gate_inp: matrix("ffn_gate_inp_shexp.weight", 1, d)?,
        gate: matrix("ffn_gate_shexp.weight", f, d)?,
        up: matrix("ffn_up_shexp.weight", f, d)?,
        down: matrix("ffn_down_shexp.weight", d, f)?,
    })
}
