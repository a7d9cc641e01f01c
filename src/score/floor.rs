//! The noise floor (`infernix-perplexity MODEL ... --noise-floor`): how far the
//! numbers move under a benign perturbation, recorded in report.json so that
//! `compare --max-delta-over-floor X` can gate relative to it.
//!
//! The perturbation is a different prefill chunk: the run scores every window
//! a second time in passes of [`alternate_prefill_chunk`] tokens instead of
//! `--prefill-chunk`. That changes where the KV cache is split between passes
//! (and, on CUDA, which kernels and tile shapes run), not what is computed;
//! any difference is rounding. The floor is
//!
//! ```text
//! floor_pct = max(|lo|, |hi|) of the 95 % interval of the PPL change (percent)
//! ```
//!
//! between the two scorings (the point estimate with a single window, 0 when
//! every window is bit-identical): the largest PPL change the perturbation is
//! compatible with. This module computes it; `app` runs the second scoring.

use serde::{Deserialize, Serialize};

use super::paired::{PairedStats, PairedWindow};

/// The `noise_floor` block of report.json.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NoiseFloor {
    /// What was changed: `prefill_chunk`.
    pub perturbation: String,
    /// The run's `--prefill-chunk` (the scores in `results`).
    pub prefill_chunk_tokens: usize,
    /// The prefill chunk of the second scoring.
    pub alternate_prefill_chunk_tokens: usize,
    /// Every window's NLL sum is bit-identical between the two scorings.
    pub bit_identical: bool,
    /// Windows whose NLL sum differs in any bit.
    pub n_windows_changed: usize,
    /// The floor in percent of PPL (see the module doc).
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub floor_pct: f64,
    /// Paired statistics, second scoring minus the reported one.
    pub overall: PairedStats,
    pub domains: Vec<DomainPaired>,
    /// Windows left out because a score was non-finite in either scoring.
    pub n_windows_excluded: usize,
    /// Wall time of the second scoring.
    pub seconds: f64,
    pub note: String,
}

/// Paired statistics of one domain.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DomainPaired {
    pub domain: String,
    #[serde(flatten)]
    pub stats: PairedStats,
}

/// Groups `(domain, window)` pairs by domain, domains in order of first appearance.
pub fn by_domain(rows: &[(String, PairedWindow)]) -> Vec<(String, Vec<PairedWindow>)> {
    let mut out: Vec<(String, Vec<PairedWindow>)> = Vec::new();
    for (d, w) in rows {
        match out.iter_mut().find(|(name, _)| name == d) {
            Some((_, v)) => v.push(*w),
            None => out.push((d.clone(), vec![*w])),
        }
    }
    out
}

/// The prefill chunk of the second scoring: half of `min(prefill_chunk,
/// longest window)` rounded down to a multiple of 128, at least 128, so the
/// longest windows really are split differently. When that equals
/// `prefill_chunk` (e.g. `--prefill-chunk 128`), the next multiple up (256):
/// still a different split for windows longer than 128.
pub fn alternate_prefill_chunk(prefill_chunk: usize, longest_window: usize) -> usize {
    let m = crate::plan::PREFILL_CHUNK_MULTIPLE;
    let half = (prefill_chunk.min(longest_window) / 2) / m * m;
    let alt = half.max(m);
    if alt == prefill_chunk {
        prefill_chunk + m
    } else {
        alt
    }
}

/// The floor between the reported scoring and the second one. `rows`:
/// `(domain, window)` with `base` = reported, `new` = second scoring, finite
/// windows only; `n_excluded`: windows left out for non-finite scores.
pub fn noise_floor(
    rows: &[(String, PairedWindow)],
    n_excluded: usize,
    prefill_chunk: usize,
    alternate: usize,
    longest_window: usize,
    seconds: f64,
) -> NoiseFloor {
    let all: Vec<PairedWindow> = rows.iter().map(|(_, w)| *w).collect();
    let overall = PairedStats::of(&all);
    let domains = by_domain(rows).into_iter().map(|(domain, w)| DomainPaired { domain, stats: PairedStats::of(&w) }).collect();
    let n_changed = all.iter().filter(|w| !w.identical()).count();
    let floor_pct = overall.max_abs_change_pct();
    let note = if longest_window <= alternate.min(prefill_chunk) {
        format!(
            "no window is longer than {} tokens: both scorings ran each window in one pass, so the perturbation changed nothing",
            alternate.min(prefill_chunk)
        )
    } else if n_changed == 0 {
        format!(
            "prefill chunks {prefill_chunk} and {alternate} gave bit-identical scores: this backend's results do not depend on the pass boundaries, the floor is 0"
        )
    } else {
        format!("prefill chunks {prefill_chunk} and {alternate}: {n_changed} of {} windows changed in the last bits", all.len())
    };
    NoiseFloor {
        perturbation: "prefill_chunk".into(),
        prefill_chunk_tokens: prefill_chunk,
        alternate_prefill_chunk_tokens: alternate,
        bit_identical: n_changed == 0,
        n_windows_changed: n_changed,
        floor_pct,
        overall,
        domains,
        n_windows_excluded: n_excluded,
        seconds,
        note,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alternate_chunk_splits_the_longest_window() {
        assert_eq!(alternate_prefill_chunk(1024, 4096), 512);
        assert_eq!(alternate_prefill_chunk(1024, 512), 256);
        assert_eq!(alternate_prefill_chunk(1024, 300), 128);
        assert_eq!(alternate_prefill_chunk(128, 4096), 256);
        assert_eq!(alternate_prefill_chunk(256, 4096), 128);
    }

    #[test]
    fn floor_of_identical_and_noisy_runs() {
        let w = |b: f64, n: f64| PairedWindow { n_scored: 255, base_nll_sum: b, new_nll_sum: n };
        let same = vec![("a".to_string(), w(700.0, 700.0)), ("b".to_string(), w(800.0, 800.0))];
        let f = noise_floor(&same, 0, 1024, 256, 512, 1.0);
        assert!(f.bit_identical && f.floor_pct == 0.0 && f.note.contains("bit-identical"));
        assert_eq!(f.domains.len(), 2);
        let noisy = vec![
            ("a".to_string(), w(700.0, 700.0 + 1e-9)),
            ("a".to_string(), w(710.0, 710.0 - 2e-9)),
            ("b".to_string(), w(800.0, 800.0 + 3e-9)),
        ];
        let f = noise_floor(&noisy, 1, 1024, 256, 512, 1.0);
        assert_eq!((f.n_windows_changed, f.n_windows_excluded, f.bit_identical), (3, 1, false));
        let [lo, hi] = f.overall.ppl_change_ci95_pct.unwrap();
        assert_eq!(f.floor_pct, lo.abs().max(hi.abs()));
        assert!(f.floor_pct > 0.0 && f.floor_pct < 1e-8, "{}", f.floor_pct);
        assert_eq!(f.domains.iter().map(|d| d.domain.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    }
}
