//! The KL-divergence side of `compare`: reads the `kl_divergence` block a
//! report carries when it was scored with `--kl-reference` and checks the KL
//! gates (`--max-mean-kl`, `--min-top1`, `--max-flips`) on the NEW report.
//!
//! The gates read NEW's own block (measured against the reference NEW
//! names); a gate asked for without that block fails (`gate::kl_checks`).
//! `comparable` and `note` say whether BASE's block shares NEW's reference,
//! for the record. Field names (with the aliases accepted
//! while the KL report format settles; the first is the documented one):
//!
//! | meaning | fields |
//! |---|---|
//! | the block | `kl_divergence` at the top level, in `results`, or in `results.overall` |
//! | overall statistics | the block itself, or its `overall` object |
//! | mean KL (nats) | `mean`, `mean_kl` |
//! | its standard error | `uncertainty`, `mean_uncertainty`, `se`, `mean_se` |
//! | top-1 agreement (0..1) | `top1_agreement`, `same_top1`, `top1` (a number or an object with `value`) |
//! | confident flips | `confident_flips`, `n_confident_flips` |
//! | reference fingerprint | `reference_sha256`, `reference.sha256`, `reference.fingerprint`, `reference_fingerprint` |
//!
//! It owns no PPL statistics and no output formatting.

use serde::Serialize;
use serde_json::Value;

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

/// Finds the report's `kl_divergence` block.
pub fn find_block(raw: &Value) -> Option<&Value> {
    [
        raw.get("kl_divergence"),
        raw.get("results").and_then(|r| r.get("kl_divergence")),
        raw.get("results").and_then(|r| r.get("overall")).and_then(|o| o.get("kl_divergence")),
    ]
    .into_iter()
    .flatten()
    .find(|v| v.is_object())
}

fn first_f64(obj: &Value, names: &[&str]) -> Option<f64> {
    names.iter().find_map(|n| {
        let v = obj.get(*n)?;
        v.as_f64().or_else(|| v.get("value").and_then(Value::as_f64))
    })
}

fn reference_of(block: &Value) -> Option<String> {
    let s = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
    s(block.get("reference_sha256"))
        .or_else(|| s(block.get("reference").and_then(|r| r.get("sha256"))))
        .or_else(|| s(block.get("reference").and_then(|r| r.get("fingerprint"))))
        .or_else(|| s(block.get("reference_fingerprint")))
}

/// Parses a report's KL statistics; `None` when the report has no block or the
/// block has no mean.
pub fn summary(raw: &Value) -> Option<KlSummary> {
    let block = find_block(raw)?;
    let stats = block.get("overall").filter(|o| o.is_object()).unwrap_or(block);
    let mean = first_f64(stats, &["mean", "mean_kl"])?;
    let top1_agreement = first_f64(stats, &["top1_agreement", "same_top1", "top1"]);
    // An agreement object may carry its own uncertainty; the mean's comes first.
    let uncertainty = first_f64(stats, &["uncertainty", "mean_uncertainty", "se", "mean_se"]);
    let confident_flips = ["confident_flips", "n_confident_flips"]
        .iter()
        .find_map(|n| stats.get(*n).and_then(Value::as_u64));
    Some(KlSummary { mean, uncertainty, top1_agreement, confident_flips, reference: reference_of(block) })
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

pub fn compare(base_raw: &Value, new_raw: &Value) -> KlComparison {
    let (base, new) = (summary(base_raw), summary(new_raw));
    let note = match (&base, &new) {
        (None, None) => Some("neither report carries kl_divergence".to_string()),
        (None, Some(_)) => Some("BASE carries no kl_divergence".to_string()),
        (Some(_), None) => Some("NEW carries no kl_divergence".to_string()),
        (Some(b), Some(n)) => match (&b.reference, &n.reference) {
            (Some(x), Some(y)) if x == y => None,
            (Some(x), Some(y)) => Some(format!("the reports' KL references differ (BASE {x}, NEW {y})")),
            _ => Some("a kl_divergence block has no reference fingerprint (reference_sha256)".to_string()),
        },
    };
    KlComparison { comparable: note.is_none(), base, new, note }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_documented_and_alias_fields() {
        let a = json!({"kl_divergence": {"mean": 0.002, "uncertainty": 0.0001, "top1_agreement": 0.991,
                       "confident_flips": 3, "reference_sha256": "abc"}});
        let s = summary(&a).unwrap();
        assert_eq!((s.mean, s.uncertainty, s.top1_agreement, s.confident_flips), (0.002, Some(0.0001), Some(0.991), Some(3)));
        assert_eq!(s.reference.as_deref(), Some("abc"));
        assert!((s.mean_upper95() - (0.002 + 1.959963984540054 * 0.0001)).abs() < 1e-15);
        let b = json!({"results": {"kl_divergence": {"reference": {"sha256": "abc"},
                       "overall": {"mean_kl": 0.5, "same_top1": {"value": 0.9, "uncertainty": 0.01}}}}});
        let s = summary(&b).unwrap();
        assert_eq!((s.mean, s.top1_agreement, s.confident_flips, s.uncertainty), (0.5, Some(0.9), None, None));
        assert_eq!(s.mean_upper95(), 0.5);
        let c = compare(&a, &b);
        assert!(c.comparable, "{:?}", c.note);
    }

    #[test]
    fn skips_without_a_common_reference() {
        let with = |r: &str| json!({"kl_divergence": {"mean": 0.1, "reference_sha256": r}});
        assert!(!compare(&json!({}), &with("x")).comparable);
        let c = compare(&with("x"), &with("y"));
        assert!(!c.comparable && c.note.unwrap().contains("differ"));
        let c = compare(&json!({"kl_divergence": {"mean": 0.1}}), &with("x"));
        assert!(c.note.unwrap().contains("no reference fingerprint"));
        assert!(compare(&with("x"), &with("x")).comparable);
    }
}
