//! Raw flags of `infernix-perplexity compare` (clap). `main` dispatches here
//! when the first argument is `compare`; validation lives in
//! [`super::gate::Thresholds::validate`].

use std::path::PathBuf;

use clap::Parser;

use super::gate::{DEFAULT_ALPHA, DEFAULT_FAIL_DELTA_PCT, DEFAULT_MAX_DELTA_PCT};

const AFTER_HELP: &str = "\
Verdicts and exit codes:
  0  PASS  every window bit-identical, or NEW is not significantly worse
           (paired t test at --alpha) and |PPL change| < --max-delta-pct
  3  WARN  NEW is significantly worse, or |PPL change| >= --max-delta-pct,
           or |PPL change| > --max-delta-over-floor x BASE's noise floor
  1  FAIL  |PPL change| > --fail-delta-pct, non-finite scores appeared,
           or a KL gate is breached (--max-mean-kl, --min-top1, --max-flips)
  2  error the reports cannot be compared (different windows, streams, token
           ids), a file is missing or unreadable, or a flag is invalid

Each window is a fresh prefill scoring its own targets, so the per-window
differences of total NLL (NEW - BASE) are independent samples: the mean change
per scored token is sum(d)/sum(n), its standard error comes from the spread
between windows (ratio estimator), the t test has windows - 1 degrees of
freedom, and the sign test is exact. See docs/quality-gate.md.";

/// Compares two report.json files window by window and gives a verdict.
#[derive(Parser, Debug)]
#[command(name = "infernix-perplexity compare", bin_name = "infernix-perplexity compare",
    version,
    about = "Compares two report.json files window by window and gives a verdict (the CI quality gate)",
    long_about = None,
    after_help = AFTER_HELP)]
pub struct CompareArgs {
    /// The baseline: a report.json, or a folder holding one.
    pub base: PathBuf,
    /// The candidate: a report.json, or a folder holding one.
    pub new: PathBuf,

    /// Significance level of the paired t test ("significantly worse").
    #[arg(long, default_value_t = DEFAULT_ALPHA)]
    pub alpha: f64,
    /// WARN when |PPL change| is at or above this many percent.
    #[arg(long, value_name = "PCT", default_value_t = DEFAULT_MAX_DELTA_PCT)]
    pub max_delta_pct: f64,
    /// FAIL when |PPL change| is above this many percent.
    #[arg(long, value_name = "PCT", default_value_t = DEFAULT_FAIL_DELTA_PCT)]
    pub fail_delta_pct: f64,
    /// WARN when |PPL change| exceeds X times the noise floor recorded in BASE
    /// (record it with `infernix-perplexity MODEL ... --noise-floor`).
    #[arg(long, value_name = "X")]
    pub max_delta_over_floor: Option<f64>,
    /// Apply the PPL rules to every domain as well; the verdict is the worst.
    #[arg(long)]
    pub per_domain: bool,

    /// FAIL when NEW's mean KL (upper end of its 95 % interval) exceeds this (nats).
    #[arg(long, value_name = "NATS")]
    pub max_mean_kl: Option<f64>,
    /// FAIL when NEW's top-1 agreement with the reference is below this fraction.
    #[arg(long, value_name = "FRACTION")]
    pub min_top1: Option<f64>,
    /// FAIL when NEW has more confident flips than this.
    #[arg(long, value_name = "N")]
    pub max_flips: Option<u64>,

    /// Write a Markdown summary (for CI job pages) to FILE.
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    /// Write the verdict with every statistic as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// How many of the windows that moved most to list.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub top: usize,
    /// A .ninfer artifact whose tokenizer decodes text excerpts of the listed
    /// windows (their corpus files must be readable); without it, token ranges.
    #[arg(long, value_name = "ARTIFACT")]
    pub model: Option<PathBuf>,
    /// Write `window_nll_differences.svg` (each window's NLL change per token
    /// with the overall mean and its 95 % interval) into DIR (created if missing).
    #[arg(long, value_name = "DIR")]
    pub plots: Option<PathBuf>,
    /// Where the corpus files are, for excerpts (else the folder BASE recorded).
    #[arg(long, value_name = "DIR")]
    pub data_root: Option<PathBuf>,
}
