//! The routed mixture-of-experts FFN on the CPU (the oracle of
//! [`Backend::moe_ffn`](crate::backend::Backend::moe_ffn)): routing in f64
//! with a fixed tie rule, each expert's SwiGLU through the backend's own
//! matrix products (so `--emulate-bf16-tc` rounds them as it rounds every
//! product), and the weighted sum in ascending expert order in f64.
//!
//! It owns the routing rule ([`route`]); it does not load the expert banks
//! (that is `crate::model`).

use anyhow::{ensure, Result};

use super::{CpuBackend, CpuMatrix, CpuTensor};
use crate::backend::{Backend, Expert, MoeRouting};

/// The experts row `logits` (`n_experts` router logits) is routed to, with
/// their weights, in ascending expert index.
///
/// Probabilities are the softmax of the logits in f64 (max subtracted; the
/// exponential is [`exp_f64`], which the CUDA routing kernel reproduces bit for bit).
/// The `top_k` largest are selected; equal probabilities rank the lower
/// expert index first (deterministic; `torch.topk` documents no tie order).
/// With `norm_topk_prob` the selected probabilities are divided by their sum
/// (accumulated in selection order), as transformers' Qwen3-MoE router and
/// llama.cpp's `build_moe_ffn(norm_w = true)` do.
pub fn route(logits: &[f32], top_k: usize, norm_topk_prob: bool) -> Vec<(usize, f64)> {
    let max = logits.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let exps: Vec<f64> = logits.iter().map(|&v| exp_f64(v as f64 - max)).collect();
    let sum: f64 = exps.iter().sum();
    let probs: Vec<f64> = exps.iter().map(|e| e / sum).collect();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Descending probability, then ascending index; total_cmp keeps NaN ordered (it sorts as largest).
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    order.truncate(top_k);
    let total: f64 = order.iter().map(|&e| probs[e]).sum();
    let mut picked: Vec<(usize, f64)> =
        order.iter().map(|&e| (e, if norm_topk_prob { probs[e] / total } else { probs[e] })).collect();
    picked.sort_by_key(|&(e, _)| e);
    picked
}

/// `e^x` by one fixed sequence of correctly rounded f64 operations (no fused
/// multiply-add), so that the CUDA twin (`moe_exp_f64` in kernels/moe.cu,
/// written with `__dmul_rn` / `__dadd_rn`) gives the same bits on the GPU; the
/// platform's `f64::exp` differs between libm builds (and from CUDA's `exp`) in
/// the last place. Within 2 units in the last place of the exact value over
/// the routing's range (x <= 0; tested against `f64::exp`).
///
/// x = k ln 2 + r with k = floor(x / ln 2 + 1/2), r by Cody-Waite (ln 2 in two
/// parts, k ln2_hi exact), e^r by the Taylor series to r^13 / 13! in Horner
/// form (|r| <= ln 2 / 2: the next term is below 2^-60), then times 2^k (two
/// exact power-of-two steps, one rounding into the subnormals below 2^-1022).
pub fn exp_f64(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x > 709.782712893384 {
        return f64::INFINITY;
    }
    if x < -745.1332191019412 {
        return 0.0;
    }
    const INV_LN2: f64 = std::f64::consts::LOG2_E; // 1.4426950408889634
    const LN2_HI: f64 = 6.931_471_803_691_238e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    const C: [f64; 14] = [
        1.0,
        1.0,
        0.5,
        0.16666666666666666,
        0.041666666666666664,
        0.008333333333333333,
        0.001388888888888889,
        0.0001984126984126984,
        2.48015873015873e-05,
        2.7557319223985893e-06,
        2.755731922398589e-07,
        2.505210838544172e-08,
        2.08767569878681e-09,
        1.6059043836821613e-10,
    ];
    let k = (x * INV_LN2 + 0.5).floor();
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let mut p = C[13];
    for c in C[..13].iter().rev() {
        p = p * r + c;
    }
    // 2^k as two exact factors: 2^k1 * 2^k2 with k1 = max(k, -1022).
    let k = k as i64;
    let k1 = k.max(-1022);
    let pow2 = |e: i64| f64::from_bits(((e + 1023) as u64) << 52);
    let y = p * pow2(k1);
    if k < -1022 {
        y * pow2(k - k1)
    } else {
        y
    }
}

impl CpuBackend {
    /// See [`Backend::moe_ffn`]; the CPU definition.
    pub(super) fn moe_ffn_cpu(
        &self,
        x: &CpuTensor,
        router_logits: &CpuTensor,
        experts: &[Expert<CpuMatrix>],
        p: &MoeRouting,
        counts: &mut [u64],
    ) -> Result<CpuTensor> {
        let (n, d) = (x.n_rows, x.n_cols);
        p.check_inputs(n, router_logits.n_rows, router_logits.n_cols, experts.len(), counts.len())?;
        // Per row, its experts and weights (ascending expert index).
        let routes: Vec<Vec<(usize, f64)>> =
            router_logits.data.chunks_exact(p.n_experts).map(|l| route(l, p.top_k, p.norm_topk_prob)).collect();
        // Per expert, the rows routed to it (ascending), then its output rows.
        let mut rows_of: Vec<Vec<usize>> = vec![Vec::new(); p.n_experts];
        for (r, picked) in routes.iter().enumerate() {
            for &(e, _) in picked {
                rows_of[e].push(r);
            }
        }
        let mut outputs: Vec<Option<CpuTensor>> = Vec::with_capacity(p.n_experts);
        for (e, rows) in rows_of.iter().enumerate() {
            counts[e] += rows.len() as u64;
            if rows.is_empty() {
                outputs.push(None);
                continue;
            }
            let mut gathered = Vec::with_capacity(rows.len() * d);
            for &r in rows {
                gathered.extend_from_slice(&x.data[r * d..(r + 1) * d]);
            }
            let xe = CpuTensor::new(rows.len(), d, gathered)?;
            let ex = &experts[e];
            // (rows, d_ffn_expert)
            let g = self.gated_act(&self.matmul(&xe, &ex.gate)?, &self.matmul(&xe, &ex.up)?, p.activation)?;
            // (rows, d_model)
            let y = self.matmul(&g, &ex.down)?;
            ensure!(y.n_cols == d, "moe_ffn: expert {e} returns {} columns, d_model is {d}", y.n_cols);
            outputs.push(Some(y));
        }
        // Where each row's output sits in its expert's block.
        let mut cursor = vec![0usize; p.n_experts];
        let mut out = vec![0f32; n * d];
        let mut acc = vec![0f64; d];
        for (r, picked) in routes.iter().enumerate() {
            acc.fill(0.0);
            for &(e, w) in picked {
                let y = outputs[e].as_ref().expect("a routed expert has an output block");
                let i = cursor[e];
                cursor[e] += 1;
                for (a, &v) in acc.iter_mut().zip(&y.data[i * d..(i + 1) * d]) {
                    *a += w * v as f64;
                }
            }
            for (o, &a) in out[r * d..(r + 1) * d].iter_mut().zip(&acc) {
                *o = a as f32;
            }
        }
        CpuTensor::new(n, d, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::meta::Activation;

    #[test]
    fn exp_f64_is_within_two_units_in_the_last_place_of_libm() {
        // The routing range (x <= 0, into the subnormals) and the positive side.
        let mut worst = 0u64;
        for i in 0..200_000u64 {
            let t = (i as f64 + 0.5) / 200_000.0;
            for x in [-745.0 * t, -30.0 * t, -t * t, 709.0 * t] {
                let (a, b) = (exp_f64(x), x.exp());
                worst = worst.max(a.to_bits().abs_diff(b.to_bits()));
            }
        }
        assert!(worst <= 2, "exp_f64 is {worst} units in the last place from f64::exp");
        assert_eq!(exp_f64(0.0), 1.0);
        assert_eq!(exp_f64(f64::NEG_INFINITY), 0.0);
        assert_eq!(exp_f64(-746.0), 0.0);
        assert!(exp_f64(f64::NAN).is_nan());
        assert_eq!(exp_f64(710.0), f64::INFINITY);
        assert!(exp_f64(-740.0) > 0.0 && exp_f64(-740.0) < f64::MIN_POSITIVE, "the subnormal step");
    }

    #[test]
    fn routing_picks_top_k_with_lower_index_on_ties() {
        // Logits 1, 3, 3, 0: experts 1 and 2 tie; top 1 takes expert 1.
        let r = route(&[1.0, 3.0, 3.0, 0.0], 1, true);
        assert_eq!(r, vec![(1, 1.0)]);
        // Top 2 of the same: both tied experts, 1/2 each after renormalizing.
        assert_eq!(route(&[1.0, 3.0, 3.0, 0.0], 2, true), vec![(1, 0.5), (2, 0.5)]);
        // Without renormalizing, the raw softmax probabilities: e^3 / (e + 2e^3 + 1).
        let z = 1f64.exp() + 2.0 * 3f64.exp() + 1.0;
        let r = route(&[1.0, 3.0, 3.0, 0.0], 3, false);
        let want = [(0, 1f64.exp() / z), (1, 3f64.exp() / z), (2, 3f64.exp() / z)];
        for ((e, w), (we, ww)) in r.iter().zip(want) {
            assert_eq!(*e, we);
            assert!((w - ww).abs() < 1e-15, "{r:?}");
        }
        // All equal: the lowest indices win.
        assert_eq!(route(&[0.5; 6], 3, true).iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    fn m(name: &str, n_out: usize, n_in: usize, f: impl Fn(usize) -> f32) -> CpuMatrix {
        CpuMatrix { name: name.into(), n_out, n_in, data: (0..n_out * n_in).map(f).collect() }
    }

    #[test]
    fn moe_ffn_is_the_weighted_sum_of_the_routed_experts() {
        let (d, f, n_e) = (3, 2, 3);
        let b = CpuBackend::default();
        let experts: Vec<Expert<CpuMatrix>> = (0..n_e)
            .map(|e| Expert {
                gate: m("g", f, d, |i| 0.1 * (i + e) as f32),
                up: m("u", f, d, |i| 0.2 - 0.05 * (i * (e + 1)) as f32),
                down: m("d", d, f, |i| 0.3 * i as f32 - 0.1 * e as f32),
            })
            .collect();
        let x = CpuTensor::new(2, d, vec![1.0, -0.5, 0.25, 0.0, 2.0, -1.0]).unwrap();
        // Row 0 prefers experts 2 then 0; row 1 experts 1 then 2.
        let logits = CpuTensor::new(2, n_e, vec![1.0, -2.0, 1.5, -1.0, 2.0, 0.5]).unwrap();
        let p = MoeRouting { n_experts: n_e, top_k: 2, norm_topk_prob: true, activation: Activation::Silu };
        let mut counts = vec![0u64; n_e];
        let got = b.moe_ffn(&x, &logits, &experts, &p, &mut counts).unwrap();
        assert_eq!(counts, vec![1, 1, 2]);
        // Each row alone through its two experts by hand.
        for r in 0..2 {
            let xr = CpuTensor::new(1, d, x.data[r * d..(r + 1) * d].to_vec()).unwrap();
            let mut want = vec![0f64; d];
            for (e, w) in route(&logits.data[r * n_e..(r + 1) * n_e], 2, true) {
                let ex = &experts[e];
                let g = b.gated_act(&b.matmul(&xr, &ex.gate).unwrap(), &b.matmul(&xr, &ex.up).unwrap(), Activation::Silu).unwrap();
                let y = b.matmul(&g, &ex.down).unwrap();
                for (a, v) in want.iter_mut().zip(&y.data) {
                    *a += w * *v as f64;
                }
            }
            let want: Vec<f32> = want.iter().map(|&v| v as f32).collect();
            assert_eq!(&got.data[r * d..(r + 1) * d], &want[..], "row {r}");
        }
        // Shapes are checked.
        assert!(b.moe_ffn(&x, &logits, &experts[..2], &p, &mut counts).is_err());
        let p5 = MoeRouting { top_k: 4, ..p };
        assert!(b.moe_ffn(&x, &logits, &experts, &p5, &mut counts).is_err());
    }
}
