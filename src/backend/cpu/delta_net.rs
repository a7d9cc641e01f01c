//! The Gated DeltaNet recurrence and its short causal convolution on the CPU
//! (Qwen3-Next's linear-attention layers): the exact per-token recurrence,
//! in f64, with the recurrent state and the convolution history carried
//! across calls, so a window run in several prefill passes gives the same
//! numbers as one pass.
//!
//! [`delta_net_layer`] is the CPU definition of
//! [`Backend::delta_net`](crate::backend::Backend::delta_net): the whole
//! mixing step of a Qwen3-Next linear-attention layer between its input
//! projections and its out-projection (convolution, gates, recurrence, gated
//! per-head RMSNorm). The two ops are checked against transformers'
//! `torch_recurrent_gated_delta_rule` and its depthwise causal `conv1d` in
//! float64 by `tests/delta_net_golden.rs`; the layer, inside the model, by
//! `tests/qwen_next_golden.rs`.

use anyhow::{ensure, Result};

use super::ops::{sigmoid, silu};
use super::CpuTensor;
use crate::backend::{DeltaNetParams, DeltaNetWeights, PassRows, RecurrentState};

/// Shapes of one Gated DeltaNet layer: `n_k_heads` query/key heads of
/// `d_k`, `n_v_heads` value heads of `d_v`; value head `h` reads key head
/// `h / (n_v_heads / n_k_heads)` (transformers' `repeat_interleave`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaNetShape {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub d_k: usize,
    pub d_v: usize,
    /// L2-normalize q and k per head first (eps 1e-6 inside the square root), as
    /// Qwen3-Next does (`use_qk_l2norm_in_kernel=True`).
    pub qk_l2norm: bool,
}

impl DeltaNetShape {
    /// f64 values of the recurrent state: `(n_v_heads, d_k, d_v)`.
    pub fn state_len(&self) -> usize {
        self.n_v_heads * self.d_k * self.d_v
    }
}

/// `x / sqrt(Σx² + 1e-6)` in f64 (FLA's and transformers' `l2norm`).
fn l2norm(x: &[f64]) -> Vec<f64> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt();
    x.iter().map(|v| v * inv).collect()
}

/// Runs `n` tokens through the gated delta rule, updating `state`
/// `(n_v_heads, d_k, d_v)` in place. Per token `t` and value head `h`, with
/// `q` scaled by `d_k^-1/2` (after the optional L2 norm):
///
/// ```text
/// S   = S * exp(g[t, h])
/// m   = Sᵀ k_t                      (d_v)
/// δ   = (v_t - m) * beta[t, h]
/// S   = S + k_t ⊗ δ
/// o_t = Sᵀ q_t                      (d_v)
/// ```
///
/// `q`, `k`: `(n, n_k_heads * d_k)`; `v`: `(n, n_v_heads * d_v)`; `g` (log
/// decay) and `beta`: `(n, n_v_heads)`. -> `(n, n_v_heads * d_v)`.
pub fn gated_delta_rule(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &DeltaNetShape,
    state: &mut [f64],
) -> Result<Vec<f32>> {
    let (dk, dv) = (s.d_k, s.d_v);
    ensure!(
        s.n_k_heads > 0 && s.n_v_heads % s.n_k_heads == 0,
        "gated_delta_rule: {} value heads do not share {} key heads evenly",
        s.n_v_heads,
        s.n_k_heads
    );
    let n = g.len() / s.n_v_heads.max(1);
    ensure!(
        q.len() == n * s.n_k_heads * dk
            && k.len() == q.len()
            && v.len() == n * s.n_v_heads * dv
            && g.len() == n * s.n_v_heads
            && beta.len() == g.len(),
        "gated_delta_rule: q {}, k {}, v {}, g {}, beta {} values for {n} tokens of {s:?}",
        q.len(),
        k.len(),
        v.len(),
        g.len(),
        beta.len()
    );
    ensure!(state.len() == s.state_len(), "gated_delta_rule: state of {} values, {s:?} needs {}", state.len(), s.state_len());
    let group = s.n_v_heads / s.n_k_heads;
    let scale = 1.0 / (dk as f64).sqrt();
    let mut out = vec![0f32; n * s.n_v_heads * dv];
    let mut mem = vec![0f64; dv];
    for t in 0..n {
        for h in 0..s.n_v_heads {
            let kh = h / group;
            let at = (t * s.n_k_heads + kh) * dk;
            let qv: Vec<f64> = q[at..at + dk].iter().map(|&x| x as f64).collect();
            let kv: Vec<f64> = k[at..at + dk].iter().map(|&x| x as f64).collect();
            let (qv, kv) = if s.qk_l2norm { (l2norm(&qv), l2norm(&kv)) } else { (qv, kv) };
            let vt = &v[(t * s.n_v_heads + h) * dv..(t * s.n_v_heads + h + 1) * dv];
            let decay = (g[t * s.n_v_heads + h] as f64).exp();
            let b = beta[t * s.n_v_heads + h] as f64;
            // (d_k, d_v)
            let st = &mut state[h * dk * dv..(h + 1) * dk * dv];
            st.iter_mut().for_each(|x| *x *= decay);
            mem.fill(0.0);
            for (i, &ki) in kv.iter().enumerate() {
                for (m, &x) in mem.iter_mut().zip(&st[i * dv..(i + 1) * dv]) {
                    *m += x * ki;
                }
            }
            for (i, &ki) in kv.iter().enumerate() {
                for ((x, &vj), &mj) in st[i * dv..(i + 1) * dv].iter_mut().zip(vt).zip(&mem) {
                    *x += ki * (vj as f64 - mj) * b;
                }
            }
            let o = &mut out[(t * s.n_v_heads + h) * dv..(t * s.n_v_heads + h + 1) * dv];
            for (j, oj) in o.iter_mut().enumerate() {
                let mut acc = 0f64;
                for (i, &qi) in qv.iter().enumerate() {
                    acc += st[i * dv + j] * qi * scale;
                }
                *oj = acc as f32;
            }
        }
    }
    Ok(out)
}

/// The depthwise causal convolution of `x` `(n, n_channels)` with `w`
/// `(n_channels, width)` (no bias), then SiLU, as transformers'
/// `F.silu(conv1d(x, padding=width-1)[..., :n])`: output `t`, channel `c` is
/// `silu(Σ_j w[c, j] * x[t - width + 1 + j, c])`, the positions before the
/// first token read `history` `(width - 1, n_channels)` (zeros for a new
/// window), which is updated to the last `width - 1` inputs.
pub fn causal_conv_silu(x: &[f32], w: &[f32], n_channels: usize, width: usize, history: &mut [f32]) -> Result<Vec<f32>> {
    ensure!(width >= 1 && w.len() == n_channels * width, "causal_conv: weight of {} values for {n_channels} x {width}", w.len());
    ensure!(x.len() % n_channels.max(1) == 0, "causal_conv: {} inputs are not rows of {n_channels}", x.len());
    ensure!(history.len() == (width - 1) * n_channels, "causal_conv: history of {} values, expected {}", history.len(), (width - 1) * n_channels);
    let n = x.len() / n_channels;
    // (width - 1 + n, n_channels): history, then this call's rows.
    let mut all = history.to_vec();
    all.extend_from_slice(x);
    let mut out = vec![0f32; n * n_channels];
    for t in 0..n {
        for c in 0..n_channels {
            let mut acc = 0f64;
            for j in 0..width {
                acc += w[c * width + j] as f64 * all[(t + j) * n_channels + c] as f64;
            }
            out[t * n_channels + c] = silu(acc) as f32;
        }
    }
    history.copy_from_slice(&all[n * n_channels..]);
    Ok(out)
}

/// `ln(1 + e^x)` in f64, as torch's `softplus` (beta 1, linear above threshold 20).
fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// See [`Backend::delta_net`](crate::backend::Backend::delta_net). Window
/// `s` of the pass is rows `s * n_tokens ..` and carries `states[s]`.
pub fn delta_net_layer(
    qkv: &CpuTensor,
    z: &CpuTensor,
    ba: &CpuTensor,
    w: &DeltaNetWeights<Vec<f32>>,
    p: &DeltaNetParams,
    states: &mut [RecurrentState],
    rows: PassRows,
) -> Result<CpuTensor> {
    let (nk, nv, dk, dv) = (p.n_k_heads, p.n_v_heads, p.d_k, p.d_v);
    let n = rows.n_rows();
    let lens = [w.conv.len(), w.a.len(), w.dt_bias.len(), w.norm.len()];
    p.check_inputs(n, (qkv.n_rows, qkv.n_cols), (z.n_rows, z.n_cols), (ba.n_rows, ba.n_cols), lens, states.len(), rows.n_seqs)?;
    let (kd, vd) = (nk * dk, nv * dv);
    let channels = p.conv_channels();
    let shape = DeltaNetShape { n_k_heads: nk, n_v_heads: nv, d_k: dk, d_v: dv, qk_l2norm: true };
    let group = nv / nk;
    let t = rows.n_tokens;
    let mut out = vec![0f32; n * vd];
    for (s, state) in states.iter_mut().take(rows.n_seqs).enumerate() {
        let r = s * t..(s + 1) * t;
        // (t, channels)
        let mixed = causal_conv_silu(&qkv.data[r.start * channels..r.end * channels], &w.conv, channels, p.conv_kernel, &mut state.conv)?;
        let (mut q, mut k, mut v) = (Vec::with_capacity(t * kd), Vec::with_capacity(t * kd), Vec::with_capacity(t * vd));
        for row in mixed.chunks_exact(channels) {
            q.extend_from_slice(&row[..kd]);
            k.extend_from_slice(&row[kd..2 * kd]);
            v.extend_from_slice(&row[2 * kd..]);
        }
        // (t, n_v_heads): value head h = g * group + i reads ba[g * 2 * group + i] (beta) and
        // ba[g * 2 * group + group + i] (alpha).
        let (mut beta, mut g) = (Vec::with_capacity(t * nv), Vec::with_capacity(t * nv));
        for row in ba.data[r.start * 2 * nv..r.end * 2 * nv].chunks_exact(2 * nv) {
            for h in 0..nv {
                let (kg, i) = (h / group, h % group);
                let b = row[kg * 2 * group + i] as f64;
                let alpha = row[kg * 2 * group + group + i] as f64;
                beta.push(sigmoid(b) as f32);
                g.push((w.a[h] as f64 * softplus(alpha + w.dt_bias[h] as f64)) as f32);
            }
        }
        // (t, n_v_heads * d_v)
        let o = gated_delta_rule(&q, &k, &v, &g, &beta, &shape, &mut state.ssm)?;
        let zs = &z.data[r.start * vd..r.end * vd];
        let dst = &mut out[r.start * vd..r.end * vd];
        for ((dst, o), z) in dst.chunks_exact_mut(dv).zip(o.chunks_exact(dv)).zip(zs.chunks_exact(dv)) {
            let ms = o.iter().map(|&x| x as f64 * x as f64).sum::<f64>() / dv as f64;
            let inv = 1.0 / (ms + p.eps).sqrt();
            for (((d, &x), &zj), &wj) in dst.iter_mut().zip(o).zip(z).zip(&w.norm) {
                *d = (wj as f64 * x as f64 * inv * silu(zj as f64)) as f32;
            }
        }
    }
    CpuTensor::new(n, vd, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_token_by_hand() {
        // One head, d_k = d_v = 2, empty state, no L2 norm: S = k ⊗ (v * beta),
        // o = Sᵀ q / sqrt(2).
        let s = DeltaNetShape { n_k_heads: 1, n_v_heads: 1, d_k: 2, d_v: 2, qk_l2norm: false };
        let mut st = vec![0f64; 4];
        let o = gated_delta_rule(&[1.0, 2.0], &[0.5, -1.0], &[3.0, 4.0], &[0.0], &[0.5], &s, &mut st).unwrap();
        assert_eq!(st, vec![0.75, 1.0, -1.5, -2.0]);
        let r2 = 2f64.sqrt();
        let close = |a: &[f32], b: &[f64]| a.iter().zip(b).all(|(x, y)| (*x as f64 - y).abs() < 1e-6);
        assert!(close(&o, &[(0.75 - 3.0) / r2, (1.0 - 4.0) / r2]), "{o:?}");
        // A second token decays the state by e^g first, then corrects toward v.
        let o2 = gated_delta_rule(&[0.0, 1.0], &[1.0, 0.0], &[1.0, 1.0], &[-1.0], &[1.0], &s, &mut st).unwrap();
        let d = (-1f64).exp();
        // S = d*S; m = Sᵀ k = row 0 of S; δ = v - m; S[0] += δ.
        let s0 = [0.75 * d, 1.0 * d];
        let row0 = [s0[0] + (1.0 - s0[0]), s0[1] + (1.0 - s0[1])];
        let row1 = [-1.5 * d, -2.0 * d];
        assert_eq!(st, vec![row0[0], row0[1], row1[0], row1[1]]);
        assert!(close(&o2, &[row1[0] / r2, row1[1] / r2]), "{o2:?}");
    }

    #[test]
    fn passes_carry_the_state_and_the_conv_history_exactly() {
        let s = DeltaNetShape { n_k_heads: 1, n_v_heads: 2, d_k: 4, d_v: 3, qk_l2norm: true };
        let n = 9;
        let f = |len: usize, k: f32| (0..len).map(|i| (i as f32 * 0.37 + k).sin()).collect::<Vec<f32>>();
        let (q, kk, v) = (f(n * 4, 0.1), f(n * 4, 0.7), f(n * 6, 1.3));
        let g: Vec<f32> = f(n * 2, 2.0).iter().map(|x| -0.5 * x.abs()).collect();
        let beta: Vec<f32> = f(n * 2, 2.5).iter().map(|x| 0.5 + 0.4 * x).collect();
        let mut whole_state = vec![0f64; s.state_len()];
        let whole = gated_delta_rule(&q, &kk, &v, &g, &beta, &s, &mut whole_state).unwrap();
        let mut st = vec![0f64; s.state_len()];
        let mut parts = Vec::new();
        for (a, b) in [(0, 4), (4, 5), (5, 9)] {
            parts.extend(
                gated_delta_rule(&q[a * 4..b * 4], &kk[a * 4..b * 4], &v[a * 6..b * 6], &g[a * 2..b * 2], &beta[a * 2..b * 2], &s, &mut st)
                    .unwrap(),
            );
        }
        assert_eq!(parts, whole);
        assert_eq!(st, whole_state);

        let (c, width) = (5, 4);
        let x = f(n * c, 0.9);
        let w = f(c * width, 0.2);
        let mut h = vec![0f32; (width - 1) * c];
        let whole = causal_conv_silu(&x, &w, c, width, &mut h).unwrap();
        let mut h2 = vec![0f32; (width - 1) * c];
        let mut parts = Vec::new();
        for (a, b) in [(0, 2), (2, 3), (3, 9)] {
            parts.extend(causal_conv_silu(&x[a * c..b * c], &w, c, width, &mut h2).unwrap());
        }
        assert_eq!(parts, whole);
        assert_eq!(h2, h);
        // Token 0 sees only its own input through the last tap.
        let want = (w[width - 1] as f64 * x[0] as f64) / (1.0 + (-(w[width - 1] as f64 * x[0] as f64)).exp());
        assert_eq!(whole[0], want as f32);
    }
}
