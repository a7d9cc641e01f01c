//! `--verify-invariance N`: the batch-invariance self-check's figures.
//!
//! The first N windows of the plan (stream order, then window order) are
//! scored twice more: batched exactly as the run batches them (consecutive
//! windows of equal length, the run's windows per pass and prefill chunk),
//! and each alone (a batch of one, prefill chunk = the window's length, so
//! one prefill pass). Per target this module compares the two: `|dNLL|`
//! (alone minus batched) and the KL lower bound of the alone scoring from
//! the batched one over the batched run's top-k ids plus a rest bucket
//! (`kl::compare_position`, the batched scores standing in for a
//! reference). The batched rescore is also checked against the run's own
//! window sums. Runs nothing itself; the loop is `app`'s.

use serde::{Deserialize, Serialize};

use super::kl::PositionKl;
use super::stats::NeumaierSum;

/// `results.invariance` in report.json.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Invariance {
    /// Windows rescored (the first N of the plan, or all if fewer).
    pub n_windows: usize,
    /// Their targets.
    pub n_targets: usize,
    /// How the batched rescore ran: windows per pass and prefill chunk (as the run).
    pub batched_windows_per_pass: usize,
    pub batched_prefill_chunk: usize,
    /// How the alone rescore ran.
    pub alone: String,
    /// Largest |NLL alone − NLL batched| over the targets, nats.
    pub max_abs_dnll: f64,
    /// Where it is: stream, window, stream index of the target.
    pub max_abs_dnll_at: Option<(String, usize, usize)>,
    /// Mean |dNLL|, nats.
    pub mean_abs_dnll: f64,
    /// KL lower bound of the alone scores from the batched ones: mean and largest, nats.
    pub mean_kl: f64,
    pub max_kl: f64,
    /// Targets whose alone argmax differs from the batched one.
    pub n_top1_changed: usize,
    /// Targets with a non-finite NLL or KL on either side (left out).
    pub n_nonfinite: usize,
    /// Largest |Σ NLL of a window, batched rescore − the run's own|: 0 when
    /// the rescore reproduced the run (the check is of the run's numbers).
    pub max_abs_window_nll_sum_diff_vs_run: f64,
}

/// Accumulates the per-target comparisons.
#[derive(Debug, Default)]
pub struct InvarianceAcc {
    n_windows: usize,
    n_targets: usize,
    n_nonfinite: usize,
    n_top1_changed: usize,
    max_abs_dnll: f64,
    max_at: Option<(String, usize, usize)>,
    abs_dnll: NeumaierSum,
    kl: NeumaierSum,
    max_kl: f64,
    max_vs_run: f64,
}

impl InvarianceAcc {
    /// One window: its per-target comparisons (`alone_nll`, the batched NLL
    /// and the KL record), and its batched sum next to the run's.
    pub fn add_window(&mut self, stream: &str, window: usize, first_target: usize, targets: &[(f64, f64, PositionKl)], batched_sum: f64, run_sum: f64) {
        self.n_windows += 1;
        self.max_vs_run = self.max_vs_run.max((batched_sum - run_sum).abs());
        for (j, (alone, batched, p)) in targets.iter().enumerate() {
            self.n_targets += 1;
            let d = (alone - batched).abs();
            if !(d.is_finite() && p.kl.is_finite()) {
                self.n_nonfinite += 1;
                continue;
            }
            if d > self.max_abs_dnll || self.max_at.is_none() {
                self.max_abs_dnll = d;
                self.max_at = Some((stream.to_string(), window, first_target + j));
            }
            self.abs_dnll.add(d);
            self.kl.add(p.kl);
            self.max_kl = self.max_kl.max(p.kl);
            self.n_top1_changed += usize::from(!p.same_top1);
        }
    }

    pub fn finish(self, batched_windows_per_pass: usize, batched_prefill_chunk: usize) -> Invariance {
        let n = (self.n_targets - self.n_nonfinite) as f64;
        let mean = |s: &NeumaierSum| if n > 0.0 { s.value() / n } else { f64::NAN };
        Invariance {
            n_windows: self.n_windows,
            n_targets: self.n_targets,
            batched_windows_per_pass,
            batched_prefill_chunk,
            alone: "each window alone: a batch of one, prefill chunk = the window's length (one prefill pass)".into(),
            max_abs_dnll: self.max_abs_dnll,
            max_abs_dnll_at: self.max_at,
            mean_abs_dnll: mean(&self.abs_dnll),
            mean_kl: mean(&self.kl),
            max_kl: self.max_kl,
            n_top1_changed: self.n_top1_changed,
            n_nonfinite: self.n_nonfinite,
            max_abs_window_nll_sum_diff_vs_run: self.max_vs_run,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(kl: f64, same_top1: bool) -> PositionKl {
        PositionKl { kl, reference_top_mass: 1.0, same_top1, confident_flip: false, nll: 0.0, reference_nll: 0.0, delta_p: 0.0, n_context: 0 }
    }

    #[test]
    fn largest_difference_and_its_place() {
        let mut acc = InvarianceAcc::default();
        acc.add_window("a", 0, 5, &[(1.0, 1.0, p(0.0, true)), (2.5, 2.0, p(0.25, false))], 3.0, 3.0);
        acc.add_window("b", 3, 10, &[(1.0, 1.125, p(0.125, true)), (f64::NAN, 1.0, p(0.0, true))], 2.125, 2.0);
        let r = acc.finish(4, 1024);
        assert_eq!((r.n_windows, r.n_targets, r.n_nonfinite, r.n_top1_changed), (2, 4, 1, 1));
        assert_eq!(r.max_abs_dnll, 0.5);
        assert_eq!(r.max_abs_dnll_at, Some(("a".into(), 0, 6)));
        assert_eq!(r.mean_abs_dnll, 0.625 / 3.0);
        assert_eq!((r.mean_kl, r.max_kl), (0.375 / 3.0, 0.25));
        assert_eq!(r.max_abs_window_nll_sum_diff_vs_run, 0.125);
    }
}
