//! The fused LM head on the CPU: hidden rows against the whole vocabulary in
//! tiles of vocabulary rows, each tile's logits reduced at once to what
//! [`RowScore`] holds (max, sum of exponentials in f64, the target's logit,
//! top-k candidates, listed ids). No logits row is ever kept whole.
//!
//! Tiles run in parallel; their partial results are combined in tile order,
//! so the result does not depend on scheduling. `score_rows_plain` is the
//! plain twin (whole f64 rows) the tests compare against.

use std::cmp::Ordering;

use anyhow::{ensure, Result};
use rayon::prelude::*;

use super::gemm::{gemm, MatRef};
use super::ops::softcap;
use crate::backend::{HeadRequest, RowScore, MAX_TOP_K};

/// Vocabulary rows per tile.
const VOCAB_TILE: usize = 2048;

/// One tile's reduction of one row.
struct Partial {
    max: f64,
    /// Σ exp(logit - max) over the tile.
    sum: f64,
    target: Option<f64>,
    top: Vec<(u32, f32)>,
    /// (index into the row's extra ids, logit)
    extra: Vec<(usize, f32)>,
}

/// Larger logit first, then smaller id.
fn by_logit_desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

fn keep_top(v: &mut Vec<(u32, f32)>, k: usize) {
    if v.len() > k {
        v.select_nth_unstable_by(k, by_logit_desc);
        v.truncate(k);
    }
    v.sort_by(by_logit_desc);
}

pub(crate) fn check_request(n_rows: usize, n_vocab: usize, req: &HeadRequest) -> Result<()> {
    ensure!(req.targets.len() == n_rows, "score_rows: {} targets for {n_rows} rows", req.targets.len());
    ensure!(req.top_k <= MAX_TOP_K, "score_rows: top_k {} exceeds {MAX_TOP_K}", req.top_k);
    ensure!(
        req.extra_ids.is_empty() || req.extra_ids.len() == n_rows,
        "score_rows: {} extra-id lists for {n_rows} rows",
        req.extra_ids.len()
    );
    let ids = req.targets.iter().chain(req.extra_ids.iter().flatten());
    if let Some(&bad) = ids.into_iter().find(|&&t| t as usize >= n_vocab) {
        anyhow::bail!("score_rows: id {bad} is outside the vocabulary of {n_vocab}");
    }
    Ok(())
}

/// `x`: the `(n_rows, d)` rows to score (already gathered and final-normed);
/// `w`: the head `(n_vocab, d)`.
pub fn score_rows(x: &[f32], n_rows: usize, w: &[f32], n_vocab: usize, d: usize, req: &HeadRequest) -> Result<Vec<RowScore>> {
    ensure!(x.len() == n_rows * d, "score_rows: x has {} elements, expected {n_rows} x {d}", x.len());
    ensure!(w.len() == n_vocab * d, "score_rows: head has {} elements, expected {n_vocab} x {d}", w.len());
    check_request(n_rows, n_vocab, req)?;
    let tiles: Vec<usize> = (0..n_vocab).step_by(VOCAB_TILE).collect();
    let partials: Vec<Vec<Partial>> = tiles
        .par_iter()
        .map(|&v0| {
            let nv = VOCAB_TILE.min(n_vocab - v0);
            let mut logits = vec![0f32; n_rows * nv];
            let wt = MatRef::row_major(&w[v0 * d..(v0 + nv) * d], nv, d).t();
            gemm(MatRef::row_major(x, n_rows, d), wt, &mut logits, nv)?;
            Ok((0..n_rows).map(|r| reduce_tile(&logits[r * nv..(r + 1) * nv], v0, r, req)).collect())
        })
        .collect::<Result<_>>()?;
    Ok((0..n_rows).map(|r| combine(partials.iter().map(|p| &p[r]), r, req)).collect())
}

fn reduce_tile(row: &[f32], v0: usize, r: usize, req: &HeadRequest) -> Partial {
    let logit = |v: f32| req.softcap.map_or(v as f64, |c| softcap(v as f64, c));
    let max = row.iter().map(|&v| logit(v)).fold(f64::NEG_INFINITY, f64::max);
    let sum = row.iter().map(|&v| (logit(v) - max).exp()).sum();
    let in_tile = |id: u32| (id as usize).checked_sub(v0).filter(|&i| i < row.len());
    let target = in_tile(req.targets[r]).map(|i| logit(row[i]));
    let mut top = Vec::new();
    if req.top_k > 0 {
        top = row.iter().enumerate().map(|(i, &v)| ((v0 + i) as u32, logit(v) as f32)).collect();
        keep_top(&mut top, req.top_k);
    }
    let extra = match req.extra_ids.get(r) {
        Some(ids) => ids.iter().enumerate().filter_map(|(e, &id)| in_tile(id).map(|i| (e, logit(row[i]) as f32))).collect(),
        None => Vec::new(),
    };
    Partial { max, sum, target, top, extra }
}

fn combine<'a>(parts: impl Iterator<Item = &'a Partial> + Clone, r: usize, req: &HeadRequest) -> RowScore {
    let max = parts.clone().map(|p| p.max).fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = parts.clone().map(|p| p.sum * (p.max - max).exp()).sum();
    let target_logit = parts.clone().find_map(|p| p.target).unwrap_or(f64::NAN);
    let mut top: Vec<(u32, f32)> = parts.clone().flat_map(|p| p.top.iter().copied()).collect();
    keep_top(&mut top, req.top_k);
    let n_extra = req.extra_ids.get(r).map_or(0, Vec::len);
    let mut extra = vec![f32::NAN; n_extra];
    for p in parts {
        for &(e, v) in &p.extra {
            extra[e] = v;
        }
    }
    RowScore { max_logit: max, lse: max + sum.ln(), target_logit, top, extra }
}

/// The plain twin: each logits row whole, as f64 dot products.
pub fn score_rows_plain(x: &[f32], n_rows: usize, w: &[f32], n_vocab: usize, d: usize, req: &HeadRequest) -> Result<Vec<RowScore>> {
    check_request(n_rows, n_vocab, req)?;
    Ok((0..n_rows)
        .map(|r| {
            let logits: Vec<f64> = (0..n_vocab)
                .map(|v| {
                    let l: f64 = (0..d).map(|c| x[r * d + c] as f64 * w[v * d + c] as f64).sum();
                    req.softcap.map_or(l, |cap| softcap(l, cap))
                })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f64>().ln();
            let mut top: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l as f32)).collect();
            top.sort_by(by_logit_desc);
            top.truncate(req.top_k);
            let extra = req.extra_ids.get(r).map_or(Vec::new(), |ids| ids.iter().map(|&i| logits[i as usize] as f32).collect());
            RowScore { max_logit: max, lse, target_logit: logits[req.targets[r] as usize], top, extra }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_lse_and_target() {
        // d = 1, x = [1], head rows [0, ln 2, ln 5]: logits (0, ln 2, ln 5),
        // Σ exp = 1 + 2 + 5 = 8 -> lse = ln 8; max = ln 5.
        let w = [0f32, 2f32.ln(), 5f32.ln()];
        let req = HeadRequest { targets: &[1], top_k: 2, ..Default::default() };
        let s = &score_rows(&[1.0], 1, &w, 3, 1, &req).unwrap()[0];
        assert!((s.lse - 8f64.ln()).abs() < 1e-6, "{s:?}");
        assert!((s.max_logit - 5f64.ln()).abs() < 1e-6);
        assert!((s.target_logit - 2f64.ln()).abs() < 1e-6);
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
    }

    #[test]
    fn tiles_match_the_plain_twin() {
        // A vocabulary of 5000 spans three tiles; extra ids come back in their order.
        let (n_rows, n_vocab, d) = (3, 5000, 8);
        let x: Vec<f32> = (0..n_rows * d).map(|i| ((i * 7) % 11) as f32 / 11.0 - 0.5).collect();
        let w: Vec<f32> = (0..n_vocab * d).map(|i| ((i * 13) % 17) as f32 / 17.0 - 0.5).collect();
        let extra = vec![vec![4999, 0, 2048], vec![], vec![4099]];
        let req = HeadRequest { targets: &[5, 2048, 4999], top_k: 5, extra_ids: &extra, softcap: Some(30.0) };
        let fast = score_rows(&x, n_rows, &w, n_vocab, d, &req).unwrap();
        let plain = score_rows_plain(&x, n_rows, &w, n_vocab, d, &req).unwrap();
        for (f, p) in fast.iter().zip(&plain) {
            assert!((f.lse - p.lse).abs() < 1e-5 && (f.target_logit - p.target_logit).abs() < 1e-5, "{f:?} vs {p:?}");
            assert_eq!(f.top.iter().map(|t| t.0).collect::<Vec<_>>(), p.top.iter().map(|t| t.0).collect::<Vec<_>>());
            assert_eq!(f.extra.len(), p.extra.len());
            assert!(f.extra.iter().zip(&p.extra).all(|(a, b)| (a - b).abs() < 1e-5));
        }
    }

    #[test]
    fn ties_across_tiles_come_out_in_id_order() {
        // Logits 5 at ids 4099 and 7 (different tiles), 0 elsewhere.
        let mut w = vec![0f32; 4100];
        w[4099] = 5.0;
        w[7] = 5.0;
        let req = HeadRequest { targets: &[0], top_k: 3, ..Default::default() };
        let s = &score_rows(&[1.0], 1, &w, 4100, 1, &req).unwrap()[0];
        assert_eq!(s.top, vec![(7, 5.0), (4099, 5.0), (0, 0.0)]);
    }

    #[test]
    fn bad_requests_are_errors() {
        let w = [0f32; 4];
        let too_big = HeadRequest { targets: &[4], ..Default::default() };
        assert!(format!("{}", score_rows(&[1.0], 1, &w, 4, 1, &too_big).unwrap_err()).contains("outside the vocabulary"));
        let k = HeadRequest { targets: &[0], top_k: MAX_TOP_K + 1, ..Default::default() };
        assert!(score_rows(&[1.0], 1, &w, 4, 1, &k).is_err());
    }
}
