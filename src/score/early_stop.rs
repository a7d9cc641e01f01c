//! `--target-uncertainty X`: the order windows are scored in and the rule
//! that stops scoring, so a run can spend only the windows it needs.
//!
//! **Order.** Every window of the plan (all streams) is put in one seeded
//! random permutation (ChaCha8 seeded with [`SEED`], Fisher–Yates through
//! `rand`'s `shuffle`), fixed before any window is scored and independent of
//! every score. A prefix of it is a simple random sample of the windows, so
//! the pooled mean NLL over the windows scored (the token-weighted ratio
//! estimator the report always uses) estimates the full run's mean without
//! a bias from the order; stopping in plan order instead would score only
//! the first streams and domains.
//!
//! **Rule.** After each scored window, once at least [`MIN_WINDOWS`] are
//! scored, the window-clustered standard error of the overall mean NLL is
//! computed over the windows scored; scoring stops when its 95 % half-width
//! `1.96 · se` is below X (nats). Stopping on an estimated half-width adds a
//! small optional-stopping bias of the order of the standard error squared;
//! the minimum of 10 windows keeps it far below X. When the rule never
//! fires, every window is scored and the report says so.
//!
//! **With `--kl-reference`** the statistic is the mean KL instead
//! ([`kl_half_width`]): the window-clustered standard error of the mean KL
//! over the windows scored (each window one cluster, as in the report). The
//! reference is read at random, each window at its own offset, so the order
//! needs no more of it than one window's records at a time.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::kl::{KlMoments, KlSums};
use super::{Summary, WindowStats};

/// Seed of the permutation (recorded in the report).
pub const SEED: u64 = 0x1f15_0015;

/// Windows scored before the rule may stop.
pub const MIN_WINDOWS: usize = 10;

/// The two-sided 95 % normal quantile.
pub const Z95: f64 = 1.959_963_984_540_054;

/// `(stream, window)` indices of every window, in the early-stop order.
pub fn order(n_windows_per_stream: &[usize]) -> Vec<(usize, usize)> {
    let mut all: Vec<(usize, usize)> =
        n_windows_per_stream.iter().enumerate().flat_map(|(s, &n)| (0..n).map(move |w| (s, w))).collect();
    all.shuffle(&mut ChaCha8Rng::seed_from_u64(SEED));
    all
}

/// The 95 % half-width of the mean NLL over `scored`, once [`MIN_WINDOWS`]
/// are scored (`None` before, or when the SE is undefined).
pub fn half_width(scored: &[WindowStats]) -> Option<f64> {
    if scored.len() < MIN_WINDOWS {
        return None;
    }
    Summary::over(scored).mean_nll_se_clustered.map(|se| Z95 * se)
}

/// The 95 % half-width of the mean KL over the scored windows' KL sums
/// (window-clustered), once [`MIN_WINDOWS`] windows are scored (`None`
/// before, or when the SE is undefined).
pub fn kl_half_width<'a>(scored: impl ExactSizeIterator<Item = &'a KlSums>) -> Option<f64> {
    if scored.len() < MIN_WINDOWS {
        return None;
    }
    let mut m = KlMoments::default();
    scored.for_each(|s| m.add_window(s));
    m.summary().mean_se_clustered.map(|se| Z95 * se)
}

/// `results.early_stop` in report.json.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EarlyStop {
    /// `--target-uncertainty`: the 95 % half-width to reach, nats.
    pub target_half_width: f64,
    /// Whose half-width: `mean NLL`, or `mean KL` with `--kl-reference`.
    #[serde(default)]
    pub statistic: String,
    /// The order: `seeded permutation of all windows (ChaCha8, seed ...)`.
    pub order: String,
    pub seed: u64,
    pub min_windows: usize,
    pub n_windows_planned: usize,
    pub n_windows_scored: usize,
    /// Scoring stopped before the last window.
    pub stopped_early: bool,
    /// Why it stopped (or why it did not).
    pub reason: String,
    /// The half-width when it stopped (null with fewer than `min_windows` windows).
    pub half_width: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_a_fixed_permutation() {
        let a = order(&[3, 0, 5]);
        assert_eq!(a, order(&[3, 0, 5]), "seeded: the same every run");
        let mut sorted = a.clone();
        sorted.sort_unstable();
        let all: Vec<(usize, usize)> = (0..3).map(|w| (0, w)).chain((0..5).map(|w| (2, w))).collect();
        assert_eq!(sorted, all, "every window exactly once");
        assert_ne!(a, all, "not the plan order");
    }

    #[test]
    fn half_width_waits_for_min_windows() {
        let w = |s: f64| WindowStats { input_tokens: 4, scored_tokens: 2, n_nonfinite: 0, nll_sum: s, nll_sq_sum: s * s / 2.0 };
        let few: Vec<WindowStats> = (0..MIN_WINDOWS - 1).map(|i| w(i as f64)).collect();
        assert_eq!(half_width(&few), None);
        let enough: Vec<WindowStats> = (0..MIN_WINDOWS).map(|i| w(i as f64)).collect();
        let se = Summary::over(&enough).mean_nll_se_clustered.unwrap();
        assert_eq!(half_width(&enough), Some(Z95 * se));
    }
}
