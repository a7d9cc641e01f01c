//! Where the loss lives: NLL (and KL against a reference) by position in
//! the window, in buckets of [`POSITION_BUCKET_TOKENS`] positions.
//!
//! A target's position is the number of tokens before it in its window
//! (its context length, `target - window.begin`), so bucket `b` holds the
//! targets predicted from `256·b .. 256·(b+1) - 1` tokens of context. Each
//! bucket pools the targets of every window that reaches it, with the same
//! statistics as any other pool ([`Summary`]: token-weighted mean NLL,
//! perplexity, llama.cpp's and the window-clustered uncertainty; each
//! window's share of the bucket is one cluster). This module only
//! accumulates; it writes no report.

use serde::{Deserialize, Serialize};

use super::kl::{KlMoments, KlPositionSums, KlSummary, PositionKl};
use super::{Summary, WindowScores, WindowStats};

/// Width of a position bucket, in tokens of context.
pub const POSITION_BUCKET_TOKENS: usize = 256;

/// One bucket of the report's `by_position`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PositionBucket {
    /// Context lengths `position_from <= n < position_to`.
    pub position_from: usize,
    pub position_to: usize,
    /// NLL statistics of the bucket's targets.
    pub nll: Summary,
    /// KL against `--kl-reference` of the same targets (absent without one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_divergence: Option<KlSummary>,
}

/// One window's targets in one position bucket (`windows[].by_position` in
/// report.json): what pooling windows into [`PositionBucket`]s needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PositionSums {
    pub position_from: usize,
    pub scored: usize,
    pub n_nonfinite: usize,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub nll_sum: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub nll_sq_sum: f64,
}

/// Splits one window's NLLs by position bucket; `first_context` is the
/// context length of its first scored target (`first_target - begin`).
pub fn window_sums(first_context: usize, nll: &[f64]) -> Vec<PositionSums> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < nll.len() {
        let b = (first_context + i) / POSITION_BUCKET_TOKENS;
        let n = ((b + 1) * POSITION_BUCKET_TOKENS - (first_context + i)).min(nll.len() - i);
        let st = WindowScores { input_tokens: 0, nll: nll[i..i + n].to_vec() }.stats();
        out.push(PositionSums {
            position_from: b * POSITION_BUCKET_TOKENS,
            scored: st.scored_tokens,
            n_nonfinite: st.n_nonfinite,
            nll_sum: st.nll_sum,
            nll_sq_sum: st.nll_sq_sum,
        });
        i += n;
    }
    out
}

/// Accumulates targets by position bucket, window by window.
#[derive(Clone, Debug, Default)]
pub struct PositionAccumulator {
    /// Per bucket: one [`WindowStats`] per window that reached it.
    nll: Vec<Vec<WindowStats>>,
    /// Per bucket: KL moments, one cluster per window.
    kl: Vec<KlMoments>,
}

/// One window's KL sums by position bucket, from its compared positions
/// (in target order).
pub fn window_kl_sums(positions: &[PositionKl]) -> Vec<KlPositionSums> {
    let mut buckets: Vec<(usize, KlMoments)> = Vec::new();
    for p in positions {
        let from = p.n_context / POSITION_BUCKET_TOKENS * POSITION_BUCKET_TOKENS;
        match buckets.last_mut() {
            Some((f, m)) if *f == from => m.add(p),
            _ => {
                let mut m = KlMoments::default();
                m.add(p);
                buckets.push((from, m));
            }
        }
    }
    buckets.into_iter().map(|(position_from, m)| KlPositionSums { position_from, sums: m.sums() }).collect()
}

impl PositionAccumulator {
    /// Adds one window's bucket sums (windows in plan order).
    pub fn add_window(&mut self, sums: &[PositionSums]) {
        for p in sums {
            let b = p.position_from / POSITION_BUCKET_TOKENS;
            if self.nll.len() <= b {
                self.nll.resize_with(b + 1, Vec::new);
            }
            // The bucket's own input-token count is not meaningful; 0.
            let st = WindowStats { input_tokens: 0, scored_tokens: p.scored, n_nonfinite: p.n_nonfinite, nll_sum: p.nll_sum, nll_sq_sum: p.nll_sq_sum };
            self.nll[b].push(st);
        }
    }

    /// Adds one window's KL sums by position bucket (windows in plan order;
    /// each window's share of a bucket is one cluster).
    pub fn add_kl_window(&mut self, sums: &[KlPositionSums]) {
        for p in sums {
            let b = p.position_from / POSITION_BUCKET_TOKENS;
            if self.kl.len() <= b {
                self.kl.resize_with(b + 1, KlMoments::default);
            }
            self.kl[b].add_window(&p.sums);
        }
    }

    /// The non-empty buckets, in position order.
    pub fn buckets(&self) -> Vec<PositionBucket> {
        let n = self.nll.len().max(self.kl.len());
        (0..n)
            .filter(|&b| self.nll.get(b).is_some_and(|w| !w.is_empty()))
            .map(|b| PositionBucket {
                position_from: b * POSITION_BUCKET_TOKENS,
                position_to: (b + 1) * POSITION_BUCKET_TOKENS,
                nll: Summary::over(&self.nll[b]),
                kl_divergence: self.kl.get(b).filter(|m| m.n > 0).map(KlMoments::summary),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_split_at_bucket_edges() {
        let mut acc = PositionAccumulator::default();
        // Targets at context 255, 256, 257 (first window) and 1..=300 of a second.
        acc.add_window(&window_sums(255, &[1.0, 2.0, 3.0]));
        acc.add_window(&window_sums(1, &vec![0.5; 300]));
        let b = acc.buckets();
        assert_eq!(b.len(), 2);
        assert_eq!((b[0].position_from, b[0].position_to), (0, 256));
        // Bucket 0: one target of window 1 (NLL 1) and 255 of window 2 (0.5).
        assert_eq!((b[0].nll.scored_tokens, b[0].nll.n_windows), (256, 2));
        assert!((b[0].nll.mean_nll - (1.0 + 255.0 * 0.5) / 256.0).abs() < 1e-15);
        // Bucket 1: 2 + 45 targets.
        assert_eq!((b[1].nll.scored_tokens, b[1].nll.n_windows), (47, 2));
        assert!((b[1].nll.nll_sum - (5.0 + 45.0 * 0.5)).abs() < 1e-12);
        assert!(b[1].nll.mean_nll_se_clustered.is_some() && b[0].kl_divergence.is_none());
    }
}
