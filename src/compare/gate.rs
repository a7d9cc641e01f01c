//! Verdicts: the thresholds of `compare` and the checks that turn paired
//! statistics (and KL summaries) into PASS / WARN / FAIL.
//!
//! Rules, per scope (overall, and every domain with `--per-domain`):
//! - PASS when every window is bit-identical, or the change is neither
//!   significantly worse nor as large as `--max-delta-pct`;
//! - WARN when NEW is significantly worse (`mean_diff > 0` and `p_t < alpha`),
//!   or `|ppl_change_pct| >= max_delta_pct`, or `|ppl_change_pct|` exceeds
//!   `--max-delta-over-floor` times BASE's recorded noise floor;
//! - FAIL when `|ppl_change_pct| > fail_delta_pct`, when NEW has non-finite
//!   scores in windows where BASE had none, when a statistic is not finite
//!   (overflowing NLL sums), or when a KL gate is breached or cannot be
//!   evaluated (NEW carries no `kl_divergence`, or not the gated field).
//!
//! KL gates are evaluated from NEW's own `kl_divergence` block: it was
//! measured against the reference NEW names (typically BASE's
//! `--save-top-tokens` file), whether or not BASE carries a block itself.
//! Nothing fails open: a check that cannot be evaluated on data that should
//! be there is a FAIL, never a silent PASS.
//!
//! Changes are judged by their absolute size: a large improvement is as
//! suspicious as a large regression (a causal-mask bug lowers perplexity).
//! The verdict is the worst check. This module formats nothing.

use serde::Serialize;

use super::kl::KlComparison;
use crate::score::paired::PairedStats;

/// Default `--alpha`.
pub const DEFAULT_ALPHA: f64 = 0.05;
/// Default `--max-delta-pct`.
pub const DEFAULT_MAX_DELTA_PCT: f64 = 0.5;
/// Default `--fail-delta-pct`: four times the warning limit; a 2 % PPL move is
/// far outside any numerical noise we have measured and larger than most
/// quantization steps (Q8_0 -> Q4_K moves PPL by about 1-3 %).
pub const DEFAULT_FAIL_DELTA_PCT: f64 = 2.0;

/// The verdict of one check, and of the comparison (the worst check).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    Pass,
    Warn,
    Fail,
}

impl Verdict {
    /// The process exit code: 0 PASS, 3 WARN, 1 FAIL (2 is an error).
    pub fn exit_code(self) -> u8 {
        match self {
            Verdict::Pass => 0,
            Verdict::Warn => 3,
            Verdict::Fail => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Warn => "WARN",
            Verdict::Fail => "FAIL",
        }
    }
}

/// A check's outcome; `Skip` when it could not be evaluated (with a reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Status {
    Pass,
    Warn,
    Fail,
    Skip,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        }
    }

    fn verdict(self) -> Option<Verdict> {
        match self {
            Status::Pass => Some(Verdict::Pass),
            Status::Warn => Some(Verdict::Warn),
            Status::Fail => Some(Verdict::Fail),
            Status::Skip => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Check {
    /// `identical`, `significance`, `max_delta`, `fail_delta`, `noise_floor`,
    /// `nonfinite`, `max_mean_kl`, `min_top1`, `max_flips`.
    pub name: &'static str,
    /// `overall`, a domain, or `kl`.
    pub scope: String,
    pub status: Status,
    /// One line: the value, the limit, the rule.
    pub detail: String,
}

/// Thresholds, validated by [`Thresholds::validate`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Thresholds {
    pub alpha: f64,
    pub max_delta_pct: f64,
    pub fail_delta_pct: f64,
    pub max_delta_over_floor: Option<f64>,
    pub max_mean_kl: Option<f64>,
    pub min_top1: Option<f64>,
    pub max_flips: Option<u64>,
    pub per_domain: bool,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            alpha: DEFAULT_ALPHA,
            max_delta_pct: DEFAULT_MAX_DELTA_PCT,
            fail_delta_pct: DEFAULT_FAIL_DELTA_PCT,
            max_delta_over_floor: None,
            max_mean_kl: None,
            min_top1: None,
            max_flips: None,
            per_domain: false,
        }
    }
}

impl Thresholds {
    pub fn validate(&self) -> anyhow::Result<()> {
        use anyhow::bail;
        if !(self.alpha > 0.0 && self.alpha < 1.0) {
            bail!("--alpha {}: must be between 0 and 1", self.alpha);
        }
        if !(self.max_delta_pct.is_finite() && self.max_delta_pct > 0.0) {
            bail!("--max-delta-pct {}: must be a positive percentage", self.max_delta_pct);
        }
        if !(self.fail_delta_pct.is_finite() && self.fail_delta_pct >= self.max_delta_pct) {
            bail!("--fail-delta-pct {} must be at least --max-delta-pct {}", self.fail_delta_pct, self.max_delta_pct);
        }
        if let Some(x) = self.max_delta_over_floor {
            if !(x.is_finite() && x > 0.0) {
                bail!("--max-delta-over-floor {x}: must be a positive factor");
            }
        }
        if let Some(x) = self.max_mean_kl {
            if !(x.is_finite() && x >= 0.0) {
                bail!("--max-mean-kl {x}: must be a non-negative number of nats");
            }
        }
        if let Some(x) = self.min_top1 {
            if !(0.0..=1.0).contains(&x) {
                bail!("--min-top1 {x}: must be a fraction between 0 and 1");
            }
        }
        Ok(())
    }
}

/// The PPL checks of one scope. `floor_pct`: BASE's recorded noise floor
/// (only read with `--max-delta-over-floor`).
pub fn ppl_checks(scope: &str, s: &PairedStats, th: &Thresholds, floor_pct: Option<f64>) -> Vec<Check> {
    let mut out = Vec::new();
    let mut push = |name, status, detail: String| out.push(Check { name, scope: scope.to_string(), status, detail });
    let change = s.ppl_change_pct;
    if !(change.is_finite() && s.mean_diff.is_finite()) {
        push(
            "finite",
            Status::Fail,
            format!("statistics are not finite (dPPL {change}%, mean NLL change {}): the NLL sums overflow or are corrupted", s.mean_diff),
        );
        return out;
    }
    if s.identical {
        push("identical", Status::Pass, format!("all {} windows bit-identical", s.n_windows));
    }
    match s.p_t {
        Some(p) if s.mean_diff > 0.0 && p < th.alpha => push(
            "significance",
            Status::Warn,
            format!("significantly worse: dPPL {change:+.4}%, p = {} < alpha {}", fmt_p(p), th.alpha),
        ),
        Some(p) => push(
            "significance",
            Status::Pass,
            if s.mean_diff > 0.0 {
                format!("not significantly worse: p = {} >= alpha {}", fmt_p(p), th.alpha)
            } else {
                format!("not worse: dPPL {change:+.4}% (p = {})", fmt_p(p))
            },
        ),
        None => push("significance", Status::Skip, format!("{} window(s): no paired test", s.n_windows)),
    }
    let abs = change.abs();
    let status = if abs >= th.max_delta_pct { Status::Warn } else { Status::Pass };
    push("max_delta", status, format!("|dPPL| {abs:.4}% {} --max-delta-pct {}", if abs >= th.max_delta_pct { ">=" } else { "<" }, th.max_delta_pct));
    let status = if abs > th.fail_delta_pct { Status::Fail } else { Status::Pass };
    push("fail_delta", status, format!("|dPPL| {abs:.4}% {} --fail-delta-pct {}", if abs > th.fail_delta_pct { ">" } else { "<=" }, th.fail_delta_pct));
    if let (Some(x), Some(floor)) = (th.max_delta_over_floor, floor_pct) {
        let limit = x * floor;
        let status = if abs > limit { Status::Warn } else { Status::Pass };
        push(
            "noise_floor",
            status,
            format!("|dPPL| {abs:.4}% {} {x} x BASE noise floor {floor:.4}% = {limit:.4}%", if abs > limit { ">" } else { "<=" }),
        );
    }
    out
}

/// The non-finite check: FAIL when NEW has non-finite scores in more windows
/// than BASE did.
pub fn nonfinite_check(base_windows: usize, new_windows: usize) -> Check {
    let (status, detail) = if new_windows > base_windows {
        (Status::Fail, format!("NEW has non-finite scores in {new_windows} windows, BASE in {base_windows}"))
    } else if new_windows > 0 || base_windows > 0 {
        (Status::Pass, format!("non-finite scores in {base_windows} BASE and {new_windows} NEW windows (left out of the statistics)"))
    } else {
        (Status::Pass, "no non-finite scores".to_string())
    };
    Check { name: "nonfinite", scope: "overall".to_string(), status, detail }
}

/// The KL gates on NEW, from NEW's own `kl_divergence` block; FAIL when a
/// gate was asked for and cannot be evaluated.
pub fn kl_checks(kl: &KlComparison, th: &Thresholds) -> Vec<Check> {
    let asked = th.max_mean_kl.is_some() || th.min_top1.is_some() || th.max_flips.is_some();
    if !asked {
        return Vec::new();
    }
    let check = |name, status, detail: String| Check { name, scope: "kl".to_string(), status, detail };
    let Some(new) = &kl.new else {
        return vec![check(
            "kl",
            Status::Fail,
            "KL gates asked for, but NEW carries no kl_divergence (score NEW with --kl-reference)".to_string(),
        )];
    };
    let mut out = Vec::new();
    let unc_ok = new.uncertainty.is_none_or(|u| u.is_finite() && u >= 0.0);
    if !(new.mean.is_finite() && new.mean >= 0.0 && unc_ok) {
        out.push(check(
            "kl",
            Status::Fail,
            format!("NEW's kl_divergence is impossible: mean {} nats, uncertainty {:?} (KL is finite and >= 0)", new.mean, new.uncertainty),
        ));
        return out;
    }
    if let Some(limit) = th.max_mean_kl {
        let ub = new.mean_upper95();
        let status = if ub > limit { Status::Fail } else { Status::Pass };
        let how = if new.uncertainty.is_some() { "mean + 1.96 se" } else { "mean (no uncertainty recorded)" };
        out.push(check("max_mean_kl", status, format!("KL upper bound {ub:.3e} ({how}) {} --max-mean-kl {limit:e}", if ub > limit { ">" } else { "<=" })));
    }
    if let Some(limit) = th.min_top1 {
        out.push(match new.top1_agreement {
            Some(v) if (0.0..=1.0).contains(&v) => check(
                "min_top1",
                if v < limit { Status::Fail } else { Status::Pass },
                format!("top-1 agreement {v:.6} {} --min-top1 {limit}", if v < limit { "<" } else { ">=" }),
            ),
            Some(v) => check("min_top1", Status::Fail, format!("NEW's top1_agreement {v} is not a fraction")),
            None => check("min_top1", Status::Fail, "NEW's kl_divergence has no top1_agreement: --min-top1 cannot be evaluated".to_string()),
        });
    }
    if let Some(limit) = th.max_flips {
        out.push(match new.confident_flips {
            Some(v) => check(
                "max_flips",
                if v > limit { Status::Fail } else { Status::Pass },
                format!("confident flips {v} {} --max-flips {limit}", if v > limit { ">" } else { "<=" }),
            ),
            None => check("max_flips", Status::Fail, "NEW's kl_divergence has no confident_flips: --max-flips cannot be evaluated".to_string()),
        });
    }
    out
}

/// The worst verdict among the checks (PASS when all were skipped).
pub fn verdict(checks: &[Check]) -> Verdict {
    checks.iter().filter_map(|c| c.status.verdict()).max().unwrap_or(Verdict::Pass)
}

/// A p-value for humans: 4 decimals, scientific below 1e-4.
pub fn fmt_p(p: f64) -> String {
    if p == 0.0 {
        "0".to_string()
    } else if p < 1e-4 {
        format!("{p:.2e}")
    } else {
        format!("{p:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::kl::KlSummary;
    use crate::score::paired::PairedWindow;

    fn stats(per_token: &[f64]) -> PairedStats {
        let w: Vec<PairedWindow> = per_token
            .iter()
            .map(|&x| PairedWindow { n_scored: 100, base_nll_sum: 300.0, new_nll_sum: 300.0 + 100.0 * x })
            .collect();
        PairedStats::of(&w)
    }

    #[test]
    fn verdict_rules() {
        let th = Thresholds::default();
        assert_eq!(verdict(&ppl_checks("overall", &stats(&[0.0; 4]), &th, None)), Verdict::Pass);
        // Noisy, tiny, not significant.
        assert_eq!(verdict(&ppl_checks("overall", &stats(&[1e-4, -2e-4, 1.5e-4, -1e-4]), &th, None)), Verdict::Pass);
        // Consistently but slightly worse (0.1 %): significant -> WARN.
        let s = stats(&[0.001, 0.0011, 0.0009, 0.001]);
        assert_eq!(verdict(&ppl_checks("overall", &s, &th, None)), Verdict::Warn);
        // Better by 1 %: not worse, but |change| >= 0.5 % -> WARN.
        assert_eq!(verdict(&ppl_checks("overall", &stats(&[-0.01; 4]), &th, None)), Verdict::Warn);
        // 3 % either way -> FAIL.
        assert_eq!(verdict(&ppl_checks("overall", &stats(&[0.03; 4]), &th, None)), Verdict::Fail);
        assert_eq!(verdict(&ppl_checks("overall", &stats(&[-0.03; 4]), &th, None)), Verdict::Fail);
        // Floor gate: 0.02 % against a floor of 0.001 % with factor 3 -> WARN.
        let th_floor = Thresholds { max_delta_over_floor: Some(3.0), ..Thresholds::default() };
        let s = stats(&[2e-4, -1e-4, 4e-4, 1e-4]);
        assert_eq!(verdict(&ppl_checks("overall", &s, &th, None)), Verdict::Pass);
        assert_eq!(verdict(&ppl_checks("overall", &s, &th_floor, Some(0.001))), Verdict::Warn);
        assert_eq!(verdict(&ppl_checks("overall", &s, &th_floor, Some(0.1))), Verdict::Pass);
        assert_eq!(Verdict::Warn.exit_code(), 3);
    }

    #[test]
    fn kl_gates() {
        let new = KlSummary { mean: 1e-3, uncertainty: Some(1e-4), top1_agreement: Some(0.99), confident_flips: Some(2), reference: Some("r".into()) };
        let kl = KlComparison { base: Some(new.clone()), new: Some(new), comparable: true, note: None };
        let th = |kl_max, top1, flips| Thresholds { max_mean_kl: kl_max, min_top1: top1, max_flips: flips, ..Thresholds::default() };
        assert!(kl_checks(&kl, &Thresholds::default()).is_empty());
        // Upper bound 1e-3 + 1.96e-4 = 1.196e-3: passes 1.2e-3, fails 1.1e-3 although the mean passes.
        assert_eq!(verdict(&kl_checks(&kl, &th(Some(1.2e-3), None, None))), Verdict::Pass);
        assert_eq!(verdict(&kl_checks(&kl, &th(Some(1.1e-3), None, None))), Verdict::Fail);
        assert_eq!(verdict(&kl_checks(&kl, &th(None, Some(0.995), None))), Verdict::Fail);
        assert_eq!(verdict(&kl_checks(&kl, &th(None, Some(0.98), Some(2)))), Verdict::Pass);
        assert_eq!(verdict(&kl_checks(&kl, &th(None, None, Some(1)))), Verdict::Fail);
        // BASE without a block (NEW scored against BASE's own --save-top-tokens): NEW's block is gated.
        let own = KlComparison { base: None, note: Some("BASE carries no kl_divergence".into()), comparable: false, ..kl.clone() };
        assert_eq!(verdict(&kl_checks(&own, &th(Some(1e-4), None, None))), Verdict::Fail);
        assert_eq!(verdict(&kl_checks(&own, &th(Some(1.2e-3), None, None))), Verdict::Pass);
        // A gate that cannot be evaluated fails.
        let none = KlComparison { new: None, note: Some("NEW carries no kl_divergence".into()), comparable: false, ..kl.clone() };
        let c = kl_checks(&none, &th(Some(1.0), None, None));
        assert_eq!((c.len(), c[0].status), (1, Status::Fail));
        assert!(c[0].detail.contains("NEW carries no kl_divergence"));
        let bare = KlSummary { top1_agreement: None, confident_flips: None, ..kl.new.clone().unwrap() };
        let partial = KlComparison { new: Some(bare), ..kl.clone() };
        assert_eq!(verdict(&kl_checks(&partial, &th(None, Some(0.5), None))), Verdict::Fail);
        assert_eq!(verdict(&kl_checks(&partial, &th(None, None, Some(10)))), Verdict::Fail);
        let nan = KlSummary { mean: f64::NAN, ..kl.new.clone().unwrap() };
        assert_eq!(verdict(&kl_checks(&KlComparison { new: Some(nan), ..kl.clone() }, &th(Some(1.0), None, None))), Verdict::Fail);
        let negative = KlSummary { mean: -0.5, ..kl.new.clone().unwrap() };
        assert_eq!(verdict(&kl_checks(&KlComparison { new: Some(negative), ..kl }, &th(Some(1.0), None, None))), Verdict::Fail);
    }

    #[test]
    fn non_finite_statistics_fail() {
        let w = [
            PairedWindow { n_scored: 10, base_nll_sum: 1e308, new_nll_sum: 1.7e308 },
            PairedWindow { n_scored: 10, base_nll_sum: 1e308, new_nll_sum: 1.7e308 },
        ];
        let s = PairedStats::of(&w);
        let c = ppl_checks("overall", &s, &Thresholds::default(), None);
        assert_eq!(verdict(&c), Verdict::Fail, "{c:?}");
        assert_eq!(c[0].name, "finite");
    }

    #[test]
    fn threshold_validation() {
        assert!(Thresholds::default().validate().is_ok());
        assert!(Thresholds { alpha: 0.0, ..Thresholds::default() }.validate().is_err());
        assert!(Thresholds { fail_delta_pct: 0.1, ..Thresholds::default() }.validate().is_err());
        assert!(Thresholds { min_top1: Some(1.5), ..Thresholds::default() }.validate().is_err());
    }
}
