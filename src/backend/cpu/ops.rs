//! Element-wise and per-row reference ops of the CPU backend, on plain
//! slices: RMSNorm, rotary embedding, the gated activations and the tanh
//! soft-cap. Values are stored as f32 and every reduction and transcendental
//! is evaluated in f64.
//!
//! Matrix products are `gemm`, attention is `attention`, the LM head is
//! `head`; this module holds what they share and what the trait's small ops
//! call.

use crate::artifact::meta::{Activation, RopeStyle};
use crate::backend::RopeParams;

/// `out = x / sqrt(mean(x²) + eps) * w`, the sum of squares in f64.
pub fn rms_norm_row(x: &[f32], w: &[f32], eps: f64, out: &mut [f32]) {
    debug_assert!(x.len() == w.len() && x.len() == out.len());
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let inv = 1.0 / (ss / x.len() as f64 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = (v as f64 * inv * g as f64) as f32;
    }
}

/// GELU with the tanh approximation (PyTorch's `gelu(approximate="tanh")`).
pub fn gelu_tanh(x: f64) -> f64 {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// SiLU: `x * sigmoid(x)`.
pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// The logistic function `1 / (1 + e^-x)`.
pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

pub fn activate(act: Activation, x: f64) -> f64 {
    match act {
        Activation::Silu => silu(x),
        Activation::GeluTanh => gelu_tanh(x),
    }
}

/// `cap * tanh(x / cap)`.
pub fn softcap(x: f64, cap: f64) -> f64 {
    cap * (x / cap).tanh()
}

/// Cosine and sine of the rotary angles of one position, one pair per
/// rotated dimension pair (`rope_dim / 2` of them).
///
/// The inverse frequencies and the angle `pos * inv_freq` are rounded to f32
/// and the cosine and sine are rounded to f32, as transformers computes them
/// (its rotary embedding forces float32, also in a float64 model) and as
/// llama.cpp does (f32 throughout); the rotation itself is done in f64. The
/// float64 reference we are checked against therefore uses exactly these
/// angles.
///
/// YaRN (`p.yarn`) changes the inverse frequencies ([`RopeParams::inv_freq`])
/// and multiplies the f32 cosine and sine by its attention factor in f32,
/// as transformers does.
pub fn rope_cos_sin(pos: usize, p: &RopeParams) -> Vec<(f64, f64)> {
    let n_pairs = p.rope_dim / 2;
    let m = p.attn_factor() as f32;
    (0..n_pairs)
        .map(|i| {
            let inv_freq = p.inv_freq(i) as f32;
            let angle = (pos as f32) * inv_freq;
            let (s, c) = (angle as f64).sin_cos();
            if p.yarn.is_none() {
                (c as f32 as f64, s as f32 as f64)
            } else {
                ((c as f32 * m) as f64, (s as f32 * m) as f64)
            }
        })
        .collect()
}

/// Rotates one head `x` (`d_head` elements) in place with the angles of
/// `cs` (from [`rope_cos_sin`]). `Normal` pairs `(2i, 2i+1)`, `Neox` pairs
/// `(i, i + rope_dim/2)`; dimensions past `rope_dim` are left alone.
pub fn rope_head(x: &mut [f32], cs: &[(f64, f64)], style: RopeStyle) {
    let half = cs.len();
    for (i, &(c, s)) in cs.iter().enumerate() {
        let (a, b) = match style {
            RopeStyle::Normal => (2 * i, 2 * i + 1),
            RopeStyle::Neox => (i, i + half),
        };
        let (x0, x1) = (x[a] as f64, x[b] as f64);
        x[a] = (x0 * c - x1 * s) as f32;
        x[b] = (x0 * s + x1 * c) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_hand_computed() {
        // x = [3, 4]: mean(x²) = 12.5, eps = 0.5 -> 1/sqrt(13) ; w = [1, 2]
        let mut out = [0f32; 2];
        rms_norm_row(&[3.0, 4.0], &[1.0, 2.0], 0.5, &mut out);
        let r = 1.0 / 13f64.sqrt();
        assert_eq!(out, [(3.0 * r) as f32, (8.0 * r) as f32]);
    }

    #[test]
    fn gelu_tanh_known_values() {
        // Python math: 0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3))) for x = 1, -1, 3
        // = [0.8411919906082768, -0.15880800939172324, 2.996362607918227]
        assert!((gelu_tanh(1.0) - 0.841_191_990_608_276_8).abs() < 1e-15);
        assert!((gelu_tanh(-1.0) + 0.158_808_009_391_723_24).abs() < 1e-15);
        assert!((gelu_tanh(3.0) - 2.996_362_607_918_227).abs() < 1e-14);
        assert_eq!(gelu_tanh(0.0), 0.0);
    }

    #[test]
    fn silu_known_values() {
        assert_eq!(silu(0.0), 0.0);
        // 2 * sigmoid(2) = 2 / (1 + e^-2) = 1.7615941559557646 (Python math)
        assert!((silu(2.0) - 1.761_594_155_955_764_6).abs() < 1e-15);
    }

    #[test]
    fn softcap_bounds_and_small_values() {
        assert!((softcap(1e-3, 30.0) - 1e-3).abs() < 1e-9); // ~identity near 0
        assert!(softcap(1e6, 30.0) <= 30.0 && softcap(1e6, 30.0) > 29.999);
        assert!((softcap(30.0, 30.0) - 30.0 * 1f64.tanh()).abs() < 1e-12);
        assert_eq!(softcap(-5.0, 50.0), -softcap(5.0, 50.0));
    }

    fn params(style: RopeStyle, rope_dim: usize) -> RopeParams {
        RopeParams { style, base: 10000.0, scale: 1.0, rope_dim, yarn: None }
    }

    #[test]
    fn rope_normal_pairs_adjacent_dimensions() {
        // d_head 4, base 10000: pair 0 has inv_freq 1, pair 1 has 10000^-0.5 = 0.01.
        // At pos 1, pair (x0, x1) = (1, 0) turns by 1 rad; pair (x2, x3) = (0, 1) by 0.01 rad.
        let p = params(RopeStyle::Normal, 4);
        let cs = rope_cos_sin(1, &p);
        let mut x = [1.0f32, 0.0, 0.0, 1.0];
        rope_head(&mut x, &cs, p.style);
        let want = [1f64.cos(), 1f64.sin(), -(0.01f64.sin()), 0.01f64.cos()];
        for (a, b) in x.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{x:?} vs {want:?}");
        }
    }

    #[test]
    fn rope_neox_pairs_halves() {
        // Same angles, but pair 0 is (x0, x2) and pair 1 is (x1, x3).
        let p = params(RopeStyle::Neox, 4);
        let cs = rope_cos_sin(1, &p);
        let mut x = [1.0f32, 0.0, 0.0, 1.0];
        rope_head(&mut x, &cs, p.style);
        let want = [1f64.cos(), -(0.01f64.sin()), 1f64.sin(), 0.01f64.cos()];
        for (a, b) in x.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{x:?} vs {want:?}");
        }
    }

    #[test]
    fn rope_partial_and_scaled() {
        // rope_dim 2 of d_head 4: only (x0, x1) turns; scale 2 halves the angle.
        let p = RopeParams { style: RopeStyle::Neox, base: 10000.0, scale: 2.0, rope_dim: 2, yarn: None };
        let cs = rope_cos_sin(2, &p);
        let mut x = [1.0f32, 0.0, 5.0, 6.0];
        rope_head(&mut x, &cs, p.style);
        assert!((x[0] as f64 - 1f64.cos()).abs() < 1e-6 && (x[1] as f64 - 1f64.sin()).abs() < 1e-6);
        assert_eq!(&x[2..], &[5.0, 6.0]);
    }

    #[test]
    fn yarn_keeps_high_frequencies_interpolates_low_ones_and_scales() {
        // Factor 4 over 8192 trained positions, base 1e4, 64 dims: correction
        // range floor(12.88) = 12 .. ceil(24.92) = 25 (hand-computed).
        let y = crate::backend::Yarn::new(4.0, 8192, 10000.0, 64);
        assert_eq!((y.ramp_low, y.ramp_high), (12.0, 25.0));
        assert!((y.attn_factor - (1.0 + 0.1 * 4f64.ln())).abs() < 1e-15);
        let native = params(RopeStyle::Neox, 64);
        let p = RopeParams { yarn: Some(y), ..native };
        for i in 0..32 {
            let (f, f0) = (p.inv_freq(i), native.inv_freq(i));
            if i <= 12 {
                assert_eq!(f, f0, "pair {i} keeps its frequency");
            } else if i >= 25 {
                assert!((f - f0 / 4.0).abs() <= 1e-15 * f0, "pair {i} is interpolated");
            } else {
                assert!(f < f0 && f > f0 / 4.0, "pair {i} is blended");
            }
        }
        // cos and sin carry the attention factor: |(cos, sin)| = factor.
        let cs = rope_cos_sin(1000, &p);
        for (c, s) in cs {
            assert!(((c * c + s * s).sqrt() - y.attn_factor).abs() < 1e-6);
        }
    }

    #[test]
    fn rope_position_zero_is_identity() {
        let p = params(RopeStyle::Neox, 8);
        let mut x = [1.5f32, -2.0, 3.0, 0.25, 7.0, -1.0, 0.5, 2.0];
        let before = x;
        rope_head(&mut x, &rope_cos_sin(0, &p), p.style);
        assert_eq!(x, before);
    }
}
