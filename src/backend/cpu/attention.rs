//! Causal grouped-query attention with an optional sliding window, on the
//! CPU: for each query head and each block of query rows, scores against the
//! keys the block can see (one GEMM), scale, soft-cap, mask and softmax per
//! row in f64, then the probabilities times the values (a second GEMM).
//!
//! The KV cache layout is `(max_pos, n_kv_heads * d_head)` for K and
//! `(max_pos, n_kv_heads * d_head_v)` for V per layer; the caller has already
//! written the current pass's rows. `attention_plain` is the plain twin the
//! tests check the blocked version against.

use anyhow::{ensure, Result};
use rayon::prelude::*;

use super::gemm::{gemm, MatRef};
use super::ops::softcap;
use crate::backend::AttnParams;

/// Query rows per parallel task.
const ROWS_PER_BLOCK: usize = 64;

/// One layer's attention for `n` query rows at positions `pos0..pos0 + n`.
/// `q`: `(n, n_heads * d_head)`; `k_cache`, `v_cache`: at least `pos0 + n`
/// rows of `n_kv_heads * d_head` (`d_head_v`). -> `(n, n_heads * d_head_v)`.
pub fn attention(q: &[f32], n: usize, k_cache: &[f32], v_cache: &[f32], pos0: usize, p: &AttnParams) -> Result<Vec<f32>> {
    check_shapes(q, n, k_cache, v_cache, pos0, p)?;
    let (d, dv) = (p.d_head, p.d_head_v);
    let (q_cols, k_cols, v_cols) = (p.n_heads * d, p.n_kv_heads * d, p.n_kv_heads * dv);
    let tasks: Vec<(usize, usize)> =
        (0..p.n_heads).flat_map(|h| (0..n).step_by(ROWS_PER_BLOCK).map(move |r0| (h, r0))).collect();
    let blocks: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(h, r0)| {
            let r1 = (r0 + ROWS_PER_BLOCK).min(n);
            let nr = r1 - r0;
            let g = p.kv_head_of(h);
            // Keys visible to some row of the block: [k_lo, k_hi).
            let k_lo = p.first_key(pos0 + r0);
            let k_hi = pos0 + r1;
            let nk = k_hi - k_lo;
            // (nr, d) · (d, nk): scores of the block.
            let qb = MatRef { data: &q[r0 * q_cols + h * d..], n_rows: nr, n_cols: d, rs: q_cols, cs: 1 };
            let kb = MatRef { data: &k_cache[k_lo * k_cols + g * d..], n_rows: nk, n_cols: d, rs: k_cols, cs: 1 };
            let mut s = vec![0f32; nr * nk];
            gemm(qb, kb.t(), &mut s, nk)?;
            let mut buf = Vec::with_capacity(nk);
            for i in 0..nr {
                let pos = pos0 + r0 + i;
                let (lo, hi) = (p.first_key(pos) - k_lo, pos + 1 - k_lo);
                softmax_row(&mut s[i * nk..(i + 1) * nk], lo, hi, p, &mut buf);
            }
            // (nr, nk) · (nk, dv): probabilities times values.
            let vb = MatRef { data: &v_cache[k_lo * v_cols + g * dv..], n_rows: nk, n_cols: dv, rs: v_cols, cs: 1 };
            let mut o = vec![0f32; nr * dv];
            gemm(MatRef::row_major(&s, nr, nk), vb, &mut o, dv)?;
            Ok(o)
        })
        .collect::<Result<_>>()?;
    let out_cols = p.n_heads * dv;
    let mut out = vec![0f32; n * out_cols];
    for (&(h, r0), o) in tasks.iter().zip(&blocks) {
        for (i, row) in o.chunks_exact(dv).enumerate() {
            let at = (r0 + i) * out_cols + h * dv;
            out[at..at + dv].copy_from_slice(row);
        }
    }
    Ok(out)
}

/// Turns raw scores `s` into probabilities in place: entries `lo..hi` are
/// the visible keys (scaled, soft-capped, softmaxed in f64), all others 0.
/// `buf` is scratch space of at least `hi - lo` values.
fn softmax_row(s: &mut [f32], lo: usize, hi: usize, p: &AttnParams, buf: &mut Vec<f64>) {
    buf.clear();
    buf.extend(s[lo..hi].iter().map(|&v| {
        let x = v as f64 * p.scale;
        p.softcap.map_or(x, |c| softcap(x, c))
    }));
    let max = buf.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0f64;
    for e in buf.iter_mut() {
        *e = (*e - max).exp();
        sum += *e;
    }
    let inv = 1.0 / sum;
    s[..lo].fill(0.0);
    s[hi..].fill(0.0);
    for (v, &e) in s[lo..hi].iter_mut().zip(buf.iter()) {
        *v = (e * inv) as f32;
    }
}

fn check_shapes(q: &[f32], n: usize, k_cache: &[f32], v_cache: &[f32], pos0: usize, p: &AttnParams) -> Result<()> {
    ensure!(
        p.n_kv_heads > 0 && p.n_heads % p.n_kv_heads == 0,
        "attention: {} query heads do not share {} KV heads evenly",
        p.n_heads,
        p.n_kv_heads
    );
    ensure!(p.window != Some(0), "attention: a sliding window of 0 positions");
    ensure!(q.len() == n * p.n_heads * p.d_head, "attention: q has {} elements, expected {n} x {} x {}", q.len(), p.n_heads, p.d_head);
    let n_pos = pos0 + n;
    ensure!(
        k_cache.len() >= n_pos * p.n_kv_heads * p.d_head && v_cache.len() >= n_pos * p.n_kv_heads * p.d_head_v,
        "attention: the KV cache holds fewer than the {n_pos} positions a pass at {pos0} of {n} rows reads"
    );
    Ok(())
}

/// The plain twin: one query at a time, f64 dot products and sums.
pub fn attention_plain(q: &[f32], n: usize, k_cache: &[f32], v_cache: &[f32], pos0: usize, p: &AttnParams) -> Result<Vec<f32>> {
    check_shapes(q, n, k_cache, v_cache, pos0, p)?;
    let (d, dv) = (p.d_head, p.d_head_v);
    let (q_cols, k_cols, v_cols) = (p.n_heads * d, p.n_kv_heads * d, p.n_kv_heads * dv);
    let mut out = vec![0f32; n * p.n_heads * dv];
    for i in 0..n {
        let pos = pos0 + i;
        for h in 0..p.n_heads {
            let g = p.kv_head_of(h);
            let qh = &q[i * q_cols + h * d..][..d];
            let keys = p.first_key(pos)..pos + 1;
            let logits: Vec<f64> = keys
                .clone()
                .map(|j| {
                    let kj = &k_cache[j * k_cols + g * d..][..d];
                    let x = qh.iter().zip(kj).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * p.scale;
                    p.softcap.map_or(x, |c| softcap(x, c))
                })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = logits.iter().map(|&l| (l - max).exp()).sum();
            for c in 0..dv {
                let acc: f64 = keys
                    .clone()
                    .zip(&logits)
                    .map(|(j, &l)| (l - max).exp() / sum * v_cache[j * v_cols + g * dv + c] as f64)
                    .sum();
                out[i * p.n_heads * dv + h * dv + c] = acc as f32;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(n_heads: usize, n_kv_heads: usize, d: usize, window: Option<usize>) -> AttnParams {
        AttnParams { n_heads, n_kv_heads, d_head: d, d_head_v: d, scale: 1.0, window, softcap: None }
    }

    #[test]
    fn gqa_head_mapping() {
        // 8 query heads on 2 KV heads: heads 0-3 read KV head 0, heads 4-7 KV head 1.
        let p = params(8, 2, 4, None);
        let map: Vec<usize> = (0..8).map(|h| p.kv_head_of(h)).collect();
        assert_eq!(map, vec![0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(params(9, 3, 4, None).kv_head_of(5), 1);
        assert_eq!(params(4, 4, 4, None).kv_head_of(3), 3);
    }

    #[test]
    fn sliding_window_first_key() {
        // Window 3: position 5 sees 3, 4, 5; position 1 sees 0, 1.
        let p = params(1, 1, 1, Some(3));
        assert_eq!(p.first_key(5), 3);
        assert_eq!(p.first_key(1), 0);
        assert_eq!(params(1, 1, 1, None).first_key(100), 0);
    }

    #[test]
    fn uniform_scores_average_the_visible_values() {
        // q = 0 gives equal scores, so each output is the mean of the values
        // the row can see: causal (mean of v[0..=pos]) and with a window of 2
        // (mean of v[pos-1..=pos]). Values v[j] = j.
        let n = 4;
        let q = vec![0f32; n];
        let k = vec![1f32; n];
        let v: Vec<f32> = (0..n).map(|j| j as f32).collect();
        let causal = attention(&q, n, &k, &v, 0, &params(1, 1, 1, None)).unwrap();
        let windowed = attention(&q, n, &k, &v, 0, &params(1, 1, 1, Some(2))).unwrap();
        for (got, want) in [(causal, [0.0, 0.5, 1.0, 1.5]), (windowed, [0.0, 0.5, 1.5, 2.5])] {
            assert!(got.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn hand_computed_two_keys() {
        // One head, d = 1: q = 1 at position 1, keys 0 and ln 3, values 10 and 20.
        // softmax(0, ln 3) = (1/4, 3/4) -> 10/4 + 60/4 = 17.5.
        let q = [0f32, 1.0];
        let k = [0f32, 3f32.ln()];
        let v = [10f32, 20.0];
        let out = attention(&q, 2, &k, &v, 0, &params(1, 1, 1, None)).unwrap();
        assert_eq!(out[0], 10.0);
        assert!((out[1] - 17.5).abs() < 1e-5, "{out:?}");
    }

    #[test]
    fn softcap_limits_scores() {
        // With cap 1 the scores 0 and 100 become 0 and tanh(100) ~ 1:
        // weights (1, e) / (1 + e) on values 0 and 1.
        let q = [0f32, 1.0];
        let k = [0f32, 100.0];
        let v = [0f32, 1.0];
        let p = AttnParams { softcap: Some(1.0), ..params(1, 1, 1, None) };
        let out = attention(&q, 2, &k, &v, 0, &p).unwrap();
        let e = std::f64::consts::E;
        assert!((out[1] as f64 - e / (1.0 + e)).abs() < 1e-6, "{out:?}");
    }

    fn seeded(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn blocked_matches_plain_in_passes() {
        // GQA 6/2, 150 positions, window 40, processed in passes of 64, 64, 22:
        // every pass equals the plain twin on the same cache.
        let (n_heads, n_kv, d, n_pos) = (6, 2, 16, 150);
        let p = AttnParams { scale: 0.25, ..params(n_heads, n_kv, d, Some(40)) };
        let q = seeded(n_pos * n_heads * d, 1);
        let k = seeded(n_pos * n_kv * d, 2);
        let v = seeded(n_pos * n_kv * d, 3);
        for (pos0, n) in [(0, 64), (64, 64), (128, 22)] {
            let qp = &q[pos0 * n_heads * d..(pos0 + n) * n_heads * d];
            let fast = attention(qp, n, &k, &v, pos0, &p).unwrap();
            let plain = attention_plain(qp, n, &k, &v, pos0, &p).unwrap();
            for (i, (a, b)) in fast.iter().zip(&plain).enumerate() {
                assert!((a - b).abs() < 1e-5, "pass at {pos0}, element {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn short_cache_is_an_error() {
        let p = params(1, 1, 1, None);
        let err = attention(&[0.0; 4], 4, &[0.0; 3], &[0.0; 3], 0, &p).unwrap_err();
        assert!(format!("{err}").contains("KV cache"), "{err}");
    }
}
