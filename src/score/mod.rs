//! NLL accumulation and the perplexity statistics of item 5 of the scoring
//! protocol: per window, per stream, per domain (token-weighted) and overall.
//!
//! The model side hands over one [`WindowScores`] per evaluated window (the
//! f64 NLL of every scored target, non-finite values included); this module
//! reduces each to a [`WindowStats`] (counts and compensated sums) and pools
//! window statistics into a [`Summary`]. Pooling always goes through the
//! per-window statistics in the caller's order (stream order, then window
//! order), sequentially, so two runs give bit-identical numbers.
//!
//! Two uncertainties are reported, both as the standard error of the mean NLL
//! and propagated to perplexity as `exp(mean) * se` (the delta method, as
//! llama.cpp prints `PPL +/- ...`):
//! - `*_llama`: llama.cpp's formula, tokens treated as independent
//!   ([`stats::llama_cpp_se`]); comparable with `llama-perplexity` output;
//! - `*_clustered`: cluster-robust with one cluster per window
//!   ([`stats::clustered_se`]); larger and more honest, since tokens that
//!   share a window's context are correlated.
//!
//! Non-finite NLLs are counted (`n_nonfinite`) and left out of every sum and
//! mean; the caller decides whether that fails the run (`--allow-nonfinite`).
//! Submodules: `stats` (compensated sums, both standard errors), `kl` (KL
//! against a top-k reference), `topk` (the top-tokens file), `paired` (paired
//! statistics of two scorings of the same windows) and `floor` (the noise
//! floor built on them). This module does not write reports or tables.

pub mod bytes;
pub mod early_stop;
pub mod floor;
pub mod invariance;
pub mod kl;
pub mod paired;
pub mod position;
pub mod stats;
pub mod topk;

use serde::{Deserialize, Serialize};

use self::stats::NeumaierSum;

/// The NLLs of one evaluated window, one per scored target in target order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WindowScores {
    /// Number of input tokens the model evaluated for this window.
    pub input_tokens: usize,
    /// `-log p(target)` in nats per scored target; may hold NaN or ±Inf.
    pub nll: Vec<f64>,
}

impl WindowScores {
    /// Reduces the NLLs to counts and compensated sums (finite values only).
    pub fn stats(&self) -> WindowStats {
        let mut sum = NeumaierSum::new();
        let mut sq_sum = NeumaierSum::new();
        let mut n_nonfinite = 0;
        for &v in &self.nll {
            if v.is_finite() {
                sum.add(v);
                sq_sum.add(v * v);
            } else {
                n_nonfinite += 1;
            }
        }
        WindowStats {
            input_tokens: self.input_tokens,
            scored_tokens: self.nll.len(),
            n_nonfinite,
            nll_sum: sum.value(),
            nll_sq_sum: sq_sum.value(),
        }
    }
}

/// Sufficient statistics of one window: enough to pool windows into any
/// summary, including the clustered uncertainty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct WindowStats {
    /// Input tokens evaluated.
    pub input_tokens: usize,
    /// Scored targets, non-finite ones included.
    pub scored_tokens: usize,
    /// Scored targets whose NLL was NaN or infinite (excluded from the sums).
    pub n_nonfinite: usize,
    /// Σ NLL over the finite targets.
    pub nll_sum: f64,
    /// Σ NLL² over the finite targets.
    pub nll_sq_sum: f64,
}

impl WindowStats {
    /// Scored targets with a finite NLL: the count every mean divides by.
    pub fn n_finite(&self) -> usize {
        self.scored_tokens - self.n_nonfinite
    }

    /// Mean NLL over the finite targets; NaN when there are none.
    pub fn mean_nll(&self) -> f64 {
        mean(self.nll_sum, self.n_finite())
    }

    /// `exp(mean_nll)`.
    pub fn perplexity(&self) -> f64 {
        self.mean_nll().exp()
    }
}

/// Statistics of a set of windows (a stream, a domain or the whole run).
///
/// Means are token-weighted: pooling streams pools their tokens, so a long
/// stream weighs more than a short one. `mean_nll` and `perplexity` are NaN
/// (serialized as `null`) when no finite target was scored; the standard
/// errors are `None` when they are undefined (fewer than 2 tokens or windows).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Scored targets, non-finite ones included.
    pub scored_tokens: usize,
    /// Input tokens evaluated (a token in two overlapping windows counts twice).
    pub input_tokens: usize,
    /// Σ NLL over the finite targets, nats.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub nll_sum: f64,
    /// `nll_sum / (scored_tokens - n_nonfinite)`, nats.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub mean_nll: f64,
    /// `exp(mean_nll)`.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub perplexity: f64,
    /// llama.cpp's uncertainty of the perplexity: `perplexity * mean_nll_se_llama`.
    pub ppl_uncertainty_llama: Option<f64>,
    /// llama.cpp's standard error of the mean NLL (tokens independent).
    pub mean_nll_se_llama: Option<f64>,
    /// Cluster-robust standard error of the mean NLL, one cluster per window.
    pub mean_nll_se_clustered: Option<f64>,
    /// `perplexity * mean_nll_se_clustered`.
    pub ppl_uncertainty_clustered: Option<f64>,
    /// Non-finite NLLs seen (excluded from every sum).
    pub n_nonfinite: usize,
    /// Windows pooled.
    pub n_windows: usize,
}

impl Summary {
    /// Pools `windows` in iteration order.
    pub fn over<'a>(windows: impl IntoIterator<Item = &'a WindowStats>) -> Summary {
        let windows: Vec<&WindowStats> = windows.into_iter().collect();
        let mut nll_sum = NeumaierSum::new();
        let mut nll_sq_sum = NeumaierSum::new();
        let (mut scored_tokens, mut input_tokens, mut n_nonfinite) = (0, 0, 0);
        for w in &windows {
            nll_sum.add(w.nll_sum);
            nll_sq_sum.add(w.nll_sq_sum);
            scored_tokens += w.scored_tokens;
            input_tokens += w.input_tokens;
            n_nonfinite += w.n_nonfinite;
        }
        let n_finite = scored_tokens - n_nonfinite;
        let nll_sum = nll_sum.value();
        let mean_nll = mean(nll_sum, n_finite);
        let perplexity = mean_nll.exp();
        let mean_nll_se_llama = stats::llama_cpp_se(n_finite, nll_sum, nll_sq_sum.value());
        let mean_nll_se_clustered = stats::clustered_se(windows.iter().map(|w| (w.n_finite(), w.nll_sum)));
        Summary {
            scored_tokens,
            input_tokens,
            nll_sum,
            mean_nll,
            perplexity,
            ppl_uncertainty_llama: mean_nll_se_llama.map(|se| perplexity * se),
            mean_nll_se_llama,
            mean_nll_se_clustered,
            ppl_uncertainty_clustered: mean_nll_se_clustered.map(|se| perplexity * se),
            n_nonfinite,
            n_windows: windows.len(),
        }
    }

    /// Pools several groups of windows (the streams of a domain, or every
    /// stream of the run), in order: token-weighted, each window one cluster.
    pub fn over_groups<'a, G>(groups: G) -> Summary
    where
        G: IntoIterator<Item = &'a [WindowStats]>,
    {
        Summary::over(groups.into_iter().flatten())
    }
}

/// The windows of one scored stream, tagged with its id and domain.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamStats {
    pub id: String,
    pub domain: String,
    pub windows: Vec<WindowStats>,
}

impl StreamStats {
    pub fn summary(&self) -> Summary {
        Summary::over(&self.windows)
    }
}

/// Per-domain summaries, domains in order of first appearance in `streams`,
/// each pooling its streams' windows in stream order.
pub fn domain_summaries(streams: &[StreamStats]) -> Vec<(String, Summary)> {
    let mut domains: Vec<&str> = Vec::new();
    for s in streams {
        if !domains.contains(&s.domain.as_str()) {
            domains.push(&s.domain);
        }
    }
    domains
        .into_iter()
        .map(|d| {
            let summary = Summary::over_groups(streams.iter().filter(|s| s.domain == d).map(|s| s.windows.as_slice()));
            (d.to_string(), summary)
        })
        .collect()
}

/// The overall summary: every window of every stream, in stream order.
pub fn overall_summary(streams: &[StreamStats]) -> Summary {
    Summary::over_groups(streams.iter().map(|s| s.windows.as_slice()))
}

fn mean(sum: f64, n: usize) -> f64 {
    if n == 0 {
        f64::NAN
    } else {
        sum / n as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws(input_tokens: usize, nll: &[f64]) -> WindowStats {
        WindowScores { input_tokens, nll: nll.to_vec() }.stats()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-14 * b.abs().max(1.0)
    }

    #[test]
    fn three_windows_hand_computed() {
        // Window NLLs: [1, 3], [2], [0.5, 1.5, 4]. Tokens: 1, 3, 2, 0.5, 1.5, 4.
        // n = 6, Σ = 12, Σ² = 1 + 9 + 4 + 0.25 + 2.25 + 16 = 32.5, mean = 2.
        // llama SE: var = 32.5/6 - 4 = 1.41666..; se = sqrt(1.416666/5) = sqrt(17/60).
        // Clustered: (n, S) = (2, 4), (1, 2), (3, 6); residuals S - 2n all 0 -> se 0.
        let w = [ws(4, &[1.0, 3.0]), ws(2, &[2.0]), ws(5, &[0.5, 1.5, 4.0])];
        let s = Summary::over(&w);
        assert_eq!((s.scored_tokens, s.input_tokens, s.n_windows, s.n_nonfinite), (6, 11, 3, 0));
        assert_eq!(s.nll_sum, 12.0);
        assert_eq!(s.mean_nll, 2.0);
        assert!(close(s.perplexity, 2.0f64.exp()));
        let se = s.mean_nll_se_llama.unwrap();
        assert!(close(se, (17.0f64 / 60.0).sqrt()), "{se}");
        assert!(close(s.ppl_uncertainty_llama.unwrap(), 2.0f64.exp() * se));
        assert_eq!(s.mean_nll_se_clustered, Some(0.0));
        assert_eq!(s.ppl_uncertainty_clustered, Some(0.0));
    }

    #[test]
    fn clustered_differs_when_windows_differ() {
        // (n, S) = (2, 2), (2, 6): m = 2, residuals -2, 2; Var = 2/1 * 8 / 16 = 1.
        let w = [ws(2, &[1.0, 1.0]), ws(2, &[3.0, 3.0])];
        let s = Summary::over(&w);
        assert!(close(s.mean_nll_se_clustered.unwrap(), 1.0));
        // llama: Σ² = 20, var = 5 - 4 = 1, se = sqrt(1/3).
        assert!(close(s.mean_nll_se_llama.unwrap(), (1.0f64 / 3.0).sqrt()));
    }

    #[test]
    fn nonfinite_counted_and_excluded() {
        let w = ws(4, &[1.0, f64::NAN, 3.0, f64::INFINITY]);
        assert_eq!((w.scored_tokens, w.n_nonfinite, w.n_finite()), (4, 2, 2));
        assert_eq!(w.nll_sum, 4.0);
        assert_eq!(w.nll_sq_sum, 10.0);
        assert_eq!(w.mean_nll(), 2.0);
        let s = Summary::over([&w]);
        assert_eq!((s.n_nonfinite, s.scored_tokens, s.mean_nll), (2, 4, 2.0));
        assert_eq!(s.mean_nll_se_clustered, None, "one window: no clustered SE");
        let empty = Summary::over(&[ws(3, &[f64::NAN])]);
        assert!(empty.mean_nll.is_nan() && empty.mean_nll_se_llama.is_none());
        // NaN serializes as null, so the report stays valid JSON.
        let json = serde_json::to_value(empty).unwrap();
        assert!(json["mean_nll"].is_null() && json["perplexity"].is_null());
    }

    #[test]
    fn domains_are_token_weighted_and_ordered() {
        let streams = vec![
            StreamStats { id: "a".into(), domain: "en".into(), windows: vec![ws(3, &[1.0, 1.0])] },
            StreamStats { id: "b".into(), domain: "zh".into(), windows: vec![ws(2, &[5.0])] },
            StreamStats { id: "c".into(), domain: "en".into(), windows: vec![ws(9, &[4.0; 8])] },
        ];
        let d = domain_summaries(&streams);
        assert_eq!(d.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["en", "zh"]);
        // en: (2 + 32) / 10 = 3.4, not the stream average (1 + 4) / 2.
        assert!(close(d[0].1.mean_nll, 3.4));
        assert_eq!((d[0].1.scored_tokens, d[0].1.input_tokens, d[0].1.n_windows), (10, 12, 2));
        let all = overall_summary(&streams);
        assert!(close(all.mean_nll, 39.0 / 11.0));
        assert_eq!(all.n_windows, 3);
        assert_eq!(streams[1].summary().mean_nll, 5.0);
    }

    #[test]
    fn pooling_is_bit_identical_across_runs() {
        // A pseudo-random but fixed set of NLLs; the same input twice gives the same bits.
        let nll: Vec<f64> = (0..10_000).map(|i| ((i * 7919 % 1000) as f64).sqrt() / 3.0).collect();
        let make = || -> Vec<WindowStats> { nll.chunks(255).map(|c| ws(512, c)).collect() };
        let (a, b) = (Summary::over(&make()), Summary::over(&make()));
        assert_eq!(a.nll_sum.to_bits(), b.nll_sum.to_bits());
        assert_eq!(a.mean_nll_se_clustered.unwrap().to_bits(), b.mean_nll_se_clustered.unwrap().to_bits());
        // And pooling through windows agrees with one flat window to rounding.
        let flat = ws(0, &nll);
        assert!(close(a.nll_sum, flat.nll_sum));
    }
}
