//! Paired statistics of two scorings of the same windows: the per-window
//! differences of total NLL, their ratio-estimator mean per scored token, its
//! standard error from the spread between windows, the paired t test, the 95 %
//! interval of the perplexity change, and the exact sign test.
//!
//! Every window is a fresh prefill scoring its own targets, so the window
//! differences `d_i = NLL_new_i - NLL_base_i` (totals, nats) are independent
//! samples of the perturbation. With `n_i` scored tokens in window `i` and `G`
//! windows:
//!
//! ```text
//! mean_diff = Σ d_i / Σ n_i                                  (nats per token)
//! se²       = G/(G-1) · Σ (d_i - n_i·mean_diff)² / (Σ n_i)²  (ratio estimator, CR1)
//! t         = mean_diff / se,  df = G - 1,  p_t = 2·P(T_df > |t|)
//! CI95      = mean_diff ± t_{0.975, df} · se
//! ppl_change_pct = 100 · (exp(mean_diff) - 1)   (= 100 · (PPL_new / PPL_base - 1))
//! ```
//!
//! When every window scores the same number of tokens this is exactly the
//! textbook paired t test on the per-window mean-NLL differences. The sign test
//! counts windows that got worse (`d_i > 0`) and better (`d_i < 0`), drops ties,
//! and gives the exact two-sided binomial p at 1/2.
//!
//! This module owns only arithmetic over `(n_i, d_i)` pairs; it knows nothing
//! of reports, thresholds or verdicts.

use serde::{Deserialize, Serialize};
use statrs::distribution::{Binomial, ContinuousCDF, DiscreteCDF, StudentsT};

use crate::score::stats::NeumaierSum;

/// One window's contribution: scored tokens (finite in both runs) and the NLL
/// sums of both runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PairedWindow {
    pub n_scored: usize,
    pub base_nll_sum: f64,
    pub new_nll_sum: f64,
}

impl PairedWindow {
    /// `new - base`, total nats of the window.
    pub fn diff(&self) -> f64 {
        self.new_nll_sum - self.base_nll_sum
    }

    /// The two sums are the same f64 (bit for bit).
    pub fn identical(&self) -> bool {
        self.new_nll_sum.to_bits() == self.base_nll_sum.to_bits()
    }
}

/// Paired statistics of a set of windows (a stream, a domain or the whole run).
/// `None` marks a statistic that is undefined for this set (see each field).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairedStats {
    /// Windows paired (windows with non-finite scores are not among them).
    pub n_windows: usize,
    /// Scored tokens over the paired windows.
    pub scored_tokens: usize,
    /// Windows whose NLL sums are bit-identical in both runs.
    pub n_identical_windows: usize,
    /// Every paired window is bit-identical (and there is at least one).
    pub identical: bool,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub base_mean_nll: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub new_mean_nll: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub base_perplexity: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub new_perplexity: f64,
    /// Σ d_i, nats.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub nll_diff_sum: f64,
    /// Σ d_i / Σ n_i: nats per scored token (= ln of the PPL ratio).
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub mean_diff: f64,
    /// Standard error of `mean_diff` from the spread between windows (ratio
    /// estimator, factor G/(G-1)); `None` with fewer than 2 windows.
    pub mean_diff_se: Option<f64>,
    /// Degrees of freedom of the t test: windows - 1.
    pub df: usize,
    /// `mean_diff / se`; `None` when undefined (se missing or 0).
    pub t: Option<f64>,
    /// Two-sided p of the paired t test; 1 when nothing changed, 0 when every
    /// window moved by the same amount per token (se 0, mean not 0).
    pub p_t: Option<f64>,
    /// 95 % interval of `mean_diff` (t quantile with `df` degrees of freedom).
    pub mean_diff_ci95: Option<[f64; 2]>,
    /// 100 · (exp(mean_diff) - 1): the PPL change in percent.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub ppl_change_pct: f64,
    /// 100 · (exp(CI95) - 1).
    pub ppl_change_ci95_pct: Option<[f64; 2]>,
    /// Windows with d_i > 0 (new worse).
    pub n_worse: usize,
    /// Windows with d_i < 0 (new better).
    pub n_better: usize,
    /// Windows with d_i = 0 (dropped from the sign test).
    pub n_ties: usize,
    /// Exact two-sided sign-test p (binomial, 1/2) over the non-tied windows.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub p_sign: f64,
}

impl PairedStats {
    /// The paired statistics of `windows` (in the caller's order; sums are
    /// compensated and sequential, so the result is reproducible bit for bit).
    pub fn of(windows: &[PairedWindow]) -> PairedStats {
        let mut base = NeumaierSum::new();
        let mut new = NeumaierSum::new();
        let mut diff = NeumaierSum::new();
        let mut n_total = 0usize;
        let (mut n_worse, mut n_better, mut n_ties, mut n_identical) = (0, 0, 0, 0);
        for w in windows {
            base.add(w.base_nll_sum);
            new.add(w.new_nll_sum);
            let d = w.diff();
            diff.add(d);
            n_total += w.n_scored;
            if w.identical() {
                n_identical += 1;
            }
            if d > 0.0 {
                n_worse += 1;
            } else if d < 0.0 {
                n_better += 1;
            } else {
                n_ties += 1;
            }
        }
        let g = windows.len();
        let n = n_total as f64;
        let nll_diff_sum = diff.value();
        let mean_diff = if n_total == 0 { 0.0 } else { nll_diff_sum / n };
        let mean_diff_se = ratio_se(windows, mean_diff);
        let df = g.saturating_sub(1);
        let (t, p_t) = match mean_diff_se {
            Some(se) if se > 0.0 => {
                let t = mean_diff / se;
                (Some(t), Some(t_two_sided_p(t, df)))
            }
            Some(_) if mean_diff == 0.0 => (None, Some(1.0)),
            Some(_) => (None, Some(0.0)),
            None => (None, None),
        };
        let mean_diff_ci95 = mean_diff_se.map(|se| {
            let h = t_quantile_975(df) * se;
            [mean_diff - h, mean_diff + h]
        });
        let base_mean_nll = base.value() / n;
        let new_mean_nll = new.value() / n;
        PairedStats {
            n_windows: g,
            scored_tokens: n_total,
            n_identical_windows: n_identical,
            identical: g > 0 && n_identical == g,
            base_mean_nll,
            new_mean_nll,
            base_perplexity: base_mean_nll.exp(),
            new_perplexity: new_mean_nll.exp(),
            nll_diff_sum,
            mean_diff,
            mean_diff_se,
            df,
            t,
            p_t,
            mean_diff_ci95,
            ppl_change_pct: pct(mean_diff),
            ppl_change_ci95_pct: mean_diff_ci95.map(|[lo, hi]| [pct(lo), pct(hi)]),
            n_worse,
            n_better,
            n_ties,
            p_sign: sign_test_p(n_worse, n_better),
        }
    }

    /// The largest |PPL change| in percent that the 95 % interval allows (the
    /// point estimate when there is no interval); 0 when identical.
    pub fn max_abs_change_pct(&self) -> f64 {
        if self.identical {
            return 0.0;
        }
        match self.ppl_change_ci95_pct {
            Some([lo, hi]) => lo.abs().max(hi.abs()),
            None => self.ppl_change_pct.abs(),
        }
    }
}

/// PPL change in percent for a mean-NLL change in nats.
pub fn pct(mean_diff: f64) -> f64 {
    100.0 * mean_diff.exp_m1()
}

/// Ratio-estimator standard error of `Σd/Σn` with one cluster per window:
/// `sqrt(G/(G-1) · Σ (d_i - n_i·m)²) / Σ n_i`. `None` with fewer than 2
/// windows or no tokens.
fn ratio_se(windows: &[PairedWindow], mean_diff: f64) -> Option<f64> {
    let g = windows.len();
    let n_total: usize = windows.iter().map(|w| w.n_scored).sum();
    if g < 2 || n_total == 0 {
        return None;
    }
    let mut ss = NeumaierSum::new();
    for w in windows {
        let r = w.diff() - w.n_scored as f64 * mean_diff;
        ss.add(r * r);
    }
    let g = g as f64;
    Some((g / (g - 1.0) * ss.value()).sqrt() / n_total as f64)
}

/// Two-sided p of Student's t with `df` degrees of freedom: `2·P(T > |t|)`.
/// `df` must be at least 1 (callers only ask with 2 or more windows).
pub fn t_two_sided_p(t: f64, df: usize) -> f64 {
    match StudentsT::new(0.0, 1.0, df.max(1) as f64) {
        Ok(dist) => (2.0 * dist.sf(t.abs())).min(1.0),
        Err(_) => f64::NAN,
    }
}

/// The 0.975 quantile of Student's t with `df` degrees of freedom.
pub fn t_quantile_975(df: usize) -> f64 {
    match StudentsT::new(0.0, 1.0, df.max(1) as f64) {
        Ok(dist) => dist.inverse_cdf(0.975),
        Err(_) => f64::NAN,
    }
}

/// Exact two-sided sign test: `min(1, 2·P(X <= min(k, n-k)))` for
/// `X ~ Binomial(n, 1/2)`, `n = n_worse + n_better`, `k = n_worse` (ties are
/// dropped before). This is scipy's `binomtest(k, n, 0.5).pvalue` (for p = 1/2
/// its "sum of outcomes no more likely" rule reduces to twice the smaller
/// tail). 1 when no window moved.
pub fn sign_test_p(n_worse: usize, n_better: usize) -> f64 {
    let n = (n_worse + n_better) as u64;
    if n == 0 {
        return 1.0;
    }
    let k = n_worse.min(n_better) as u64;
    if 2 * k == n {
        return 1.0;
    }
    match Binomial::new(0.5, n) {
        Ok(dist) => (2.0 * dist.cdf(k)).min(1.0),
        Err(_) => f64::NAN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-300)
    }

    /// Windows of equal size whose per-token differences are `per_token`.
    fn equal_windows(per_token: &[f64], n: usize) -> Vec<PairedWindow> {
        per_token
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let base = 3.0 * n as f64 + i as f64;
                PairedWindow { n_scored: n, base_nll_sum: base, new_nll_sum: base + x * n as f64 }
            })
            .collect()
    }

    #[test]
    fn paired_t_matches_scipy() {
        // scipy 1.x: d = [0.3, -0.1, 0.4, 0.2, 0.5, -0.2, 0.1, 0.35];
        // stats.ttest_1samp(d, 0) -> t = 2.231428827320953, p = 0.06084245936006798,
        // confidence_interval(0.95) -> (-0.01156506232092136, 0.39906506232092137).
        let d = [0.3, -0.1, 0.4, 0.2, 0.5, -0.2, 0.1, 0.35];
        // Equal window sizes: the ratio estimator is the textbook paired t test.
        let s = PairedStats::of(&equal_windows(&d, 4));
        assert_eq!((s.n_windows, s.df, s.scored_tokens), (8, 7, 32));
        assert!(close(s.mean_diff, 0.19375, 1e-12), "{}", s.mean_diff);
        assert!(close(s.t.unwrap(), 2.231428827320953, 1e-9), "t {:?}", s.t);
        assert!(close(s.p_t.unwrap(), 0.06084245936006798, 1e-7), "p {:?}", s.p_t);
        let [lo, hi] = s.mean_diff_ci95.unwrap();
        assert!(close(lo, -0.01156506232092136, 1e-6), "lo {lo}");
        assert!(close(hi, 0.39906506232092137, 1e-7), "hi {hi}");
        assert!(close(s.ppl_change_pct, 100.0 * (0.19375f64.exp() - 1.0), 1e-12));
        // Sign test: 6 worse, 2 better -> scipy binomtest(6, 8).pvalue = 0.2890625.
        assert_eq!((s.n_worse, s.n_better, s.n_ties), (6, 2, 0));
        assert!(close(s.p_sign, 0.2890625, 1e-12), "{}", s.p_sign);
        assert!(!s.identical);
    }

    #[test]
    fn t_distribution_matches_scipy() {
        // scipy: 2*stats.t.sf(2.0, 5) = 0.10193947882985835,
        //        2*stats.t.sf(3.5, 30) = 0.0014768074376442532,
        //        stats.t.ppf(0.975, 1) = 12.706204736174694, (7) = 2.364624251592784,
        //        (99) = 1.9842169515864174.
        assert!(close(t_two_sided_p(2.0, 5), 0.10193947882985835, 1e-9));
        assert!(close(t_two_sided_p(-3.5, 30), 0.0014768074376442532, 1e-8));
        assert!(close(t_quantile_975(1), 12.706204736174694, 1e-8));
        assert!(close(t_quantile_975(7), 2.364624251592784, 1e-8));
        assert!(close(t_quantile_975(99), 1.9842169515864174, 1e-8));
    }

    #[test]
    fn sign_test_matches_scipy() {
        // scipy: stats.binomtest(k, n, 0.5).pvalue for (k, n):
        // (7,10) 0.34375, (3,10) 0.34375, (5,10) 1.0, (0,20) 1.9073486328125e-06,
        // (15,20) 0.04138946533203125, (60,100) 0.05688793364098089, (10,11) 0.01171875.
        let cases = [
            (7, 10, 0.34375),
            (3, 10, 0.34375),
            (5, 10, 1.0),
            (0, 20, 1.9073486328125e-06),
            (15, 20, 0.04138946533203125),
            (60, 100, 0.05688793364098089),
            (10, 11, 0.01171875),
        ];
        for (k, n, p) in cases {
            let got = sign_test_p(k, n - k);
            assert!(close(got, p, 1e-9), "binomtest({k}, {n}): {got} vs scipy {p}");
        }
        assert_eq!(sign_test_p(0, 0), 1.0);
    }

    #[test]
    fn ratio_estimator_weights_by_tokens() {
        // Windows (n, d): (1, 1.0), (3, 0.0): mean = 1/4; residuals 1 - 1/4 = 3/4,
        // 0 - 3/4 = -3/4; se² = 2/1 · (9/16 + 9/16) / 16 = 9/64 -> se = 3/8.
        let w = [
            PairedWindow { n_scored: 1, base_nll_sum: 2.0, new_nll_sum: 3.0 },
            PairedWindow { n_scored: 3, base_nll_sum: 6.0, new_nll_sum: 6.0 },
        ];
        let s = PairedStats::of(&w);
        assert_eq!(s.mean_diff, 0.25);
        assert!(close(s.mean_diff_se.unwrap(), 0.375, 1e-15));
        assert_eq!((s.n_worse, s.n_ties, s.n_identical_windows), (1, 1, 1));
        assert_eq!(s.base_mean_nll, 2.0);
        assert_eq!(s.new_mean_nll, 2.25);
    }

    #[test]
    fn identical_and_constant_shift() {
        let same = equal_windows(&[0.0; 5], 10);
        let s = PairedStats::of(&same);
        assert!(s.identical);
        assert_eq!((s.mean_diff, s.p_t, s.p_sign, s.max_abs_change_pct()), (0.0, Some(1.0), 1.0, 0.0));
        // Every window exactly 0.01 nats per token worse: se 0 -> p 0, no t.
        let shifted: Vec<PairedWindow> = (0..5)
            .map(|_| PairedWindow { n_scored: 4, base_nll_sum: 8.0, new_nll_sum: 8.04 })
            .collect();
        let s = PairedStats::of(&shifted);
        assert_eq!(s.mean_diff_se, Some(0.0));
        assert_eq!((s.t, s.p_t), (None, Some(0.0)));
        assert!(close(s.mean_diff, 0.01, 1e-12));
        // Single window: no spread, no test.
        let one = PairedStats::of(&shifted[..1]);
        assert_eq!((one.mean_diff_se, one.p_t, one.ppl_change_ci95_pct), (None, None, None));
        assert!(close(one.max_abs_change_pct(), pct(0.01), 1e-12));
    }
}
