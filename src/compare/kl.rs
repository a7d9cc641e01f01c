//! The KL-divergence side of `compare`: the overall KL statistics a report
//! carries in `results.kl_divergence` when it was scored with
//! `--kl-reference` (typed: `report::KlReport`, or the version-3 block), and
//! the KL gates (`--max-mean-kl`, `--min-top1`, `--max-flips`) on the NEW
//! report.
//!
//! The gates read NEW's own block (measured against the reference NEW
//! names); a gate asked for without that block fails (`gate::kl_checks`).
//! `comparable` and `note` say whether BASE's block shares NEW's reference
//! (`reference.sha256`), for the record. The gated figures are `mean` with
//! its standard error `mean_se` (positions independent, as llama.cpp),
//! `top1_agreement` and `n_confident_flips`.
//!
//! It owns no PPL statistics and no output formatting.

use serde::Serialize;

/// 0.975 quantile of the standard normal: the upper bound of mean KL is
/// `mean + Z975 · uncertainty` (upper end of the two-sided 95 % interval).
pub const Z975: f64 = 1.959_963_984_540_054;

/// The overall KL statistics of one report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KlSummary {
    pub mean: f64,
    pub uncertainty: Option<f64>,
    pub top1_agreement: Option<f64>,
    pub confident_flips: Option<u64>,
    pub reference: Option<String>,
}

impl KlSummary {
    /// `mean + 1.96 · uncertainty`, or the mean when there is no uncertainty.
    pub fn mean_upper95(&self) -> f64 {
        self.mean + self.uncertainty.map_or(0.0, |u| Z975 * u)
    }
}

impl KlSummary {
    /// The gated figures of a version-4 report's block.
    pub fn of(r: &crate::report::KlReport) -> Self {
        KlSummary {
            mean: r.summary.mean,
            uncertainty: r.summary.mean_se,
            top1_agreement: Some(r.summary.top1_agreement),
            confident_flips: Some(r.summary.n_confident_flips as u64),
            reference: Some(r.reference.sha256.clone()),
        }
    }

    /// The gated figures of a version-3 report's block.
    pub fn of_v3(r: &crate::report::v3::KlReportV3) -> Self {
        KlSummary {
            mean: r.mean,
            uncertainty: r.mean_se,
            top1_agreement: Some(r.top1_agreement),
            confident_flips: Some(r.n_confident_flips as u64),
            reference: Some(r.reference.sha256.clone()),
        }
    }
}

/// Whether the KL gates can run, and on what.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KlComparison {
    pub base: Option<KlSummary>,
    pub new: Option<KlSummary>,
    /// Both reports carry KL against the same reference.
    pub comparable: bool,
    /// Why the gates were skipped (when they were).
    pub note: Option<String>,
}

pub fn compare(base: Option<&KlSummary>, new: Option<&KlSummary>) -> KlComparison {
    let (base, new) = (base.cloned(), new.cloned());
    let note = match (&base, &new) {
        (None, None) => Some("neither report carries kl_divergence".to_string()),
        (None, Some(_)) => Some("BASE carries no kl_divergence".to_string()),
        (Some(_), None) => Some("NEW carries no kl_divergence".to_string()),
        (Some(b), Some(n)) => match (&b.reference, &n.reference) {
            (Some(x), Some(y)) if x == y => None,
            (Some(x), Some(y)) => Some(format!("the reports' KL references differ (BASE {x}, NEW {y})")),
            _ => Some("a kl_divergence block has no reference fingerprint (reference.sha256)".to_string()),
        },
    };
    KlComparison { comparable: note.is_none(), base, new, note }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kl(mean: f64, reference: Option<&str>) -> KlSummary {
        KlSummary { mean, uncertainty: Some(mean / 10.0), top1_agreement: Some(0.99), confident_flips: Some(1), reference: reference.map(str::to_string) }
    }

    #[test]
    fn upper_bound_uses_the_uncertainty() {
        let s = kl(0.002, Some("abc"));
        assert!((s.mean_upper95() - (0.002 + 1.959963984540054 * 0.0002)).abs() < 1e-15);
        assert_eq!(KlSummary { uncertainty: None, ..s }.mean_upper95(), 0.002);
    }

    #[test]
    fn skips_without_a_common_reference() {
        let (x, y) = (kl(0.1, Some("x")), kl(0.1, Some("y")));
        assert!(!compare(None, Some(&x)).comparable);
        let c = compare(Some(&x), Some(&y));
        assert!(!c.comparable && c.note.unwrap().contains("differ"));
        let c = compare(Some(&kl(0.1, None)), Some(&x));
        assert!(c.note.unwrap().contains("no reference fingerprint"));
        assert!(compare(Some(&x), Some(&x)).comparable);
    }
}
