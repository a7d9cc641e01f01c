//! `infernix-perplexity compare BASE NEW`: the CI quality gate. Pairs the
//! windows of two report.json files, computes paired statistics per domain
//! and overall, applies the gates and gives a verdict with an exit code
//! (0 PASS, 3 WARN, 1 FAIL, 2 error).
//!
//! Submodules: `args` (flags), `input` (reading and pairing reports), `gate`
//! (thresholds and verdicts), `kl` (the KL gates), `excerpt` (decoded text
//! of moved windows), `output` (table, Markdown, JSON). The paired
//! statistics (`score::paired`) and the noise floor (`score::floor`) sit
//! upstream in `score`, since the evaluator computes them too. This module
//! wires them; it scores nothing.

pub mod args;
pub mod excerpt;
pub mod gate;
pub mod input;
pub mod kl;
pub mod output;

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde::Serialize;

pub use self::args::CompareArgs;
use crate::score::floor::{by_domain, DomainPaired};
use self::gate::{Check, Thresholds, Verdict};
use self::input::{LoadedReport, WindowRow};
use self::kl::KlComparison;
use crate::score::paired::{PairedStats, PairedWindow};

/// A report as the comparison describes it.
#[derive(Clone, Debug, Serialize)]
pub struct RunInfo {
    pub path: PathBuf,
    pub artifact: String,
    pub backend: String,
    pub kv_dtype: String,
    pub prefill_chunk_tokens: usize,
    pub method: String,
    pub context: usize,
    pub stride: Option<usize>,
}

impl RunInfo {
    fn of(r: &LoadedReport) -> Self {
        let v = &r.view;
        Self {
            path: r.path.clone(),
            artifact: v.artifact.clone(),
            backend: v.backend.clone().unwrap_or_default(),
            kv_dtype: v.kv_format.clone().unwrap_or_default(),
            prefill_chunk_tokens: v.workload.prefill_chunk_tokens,
            method: v.workload.method.clone(),
            context: v.workload.context,
            stride: v.workload.stride,
        }
    }
}

/// Paired statistics of one stream.
#[derive(Clone, Debug, Serialize)]
pub struct StreamPaired {
    pub stream: String,
    pub domain: String,
    #[serde(flatten)]
    pub stats: PairedStats,
}

/// One of the windows that moved most.
#[derive(Clone, Debug, Serialize)]
pub struct MovedWindow {
    pub rank: usize,
    pub stream: String,
    pub domain: String,
    pub index: usize,
    pub begin: usize,
    pub end: usize,
    pub first_target: usize,
    pub scored: usize,
    pub base_nll_sum: f64,
    pub new_nll_sum: f64,
    /// NEW - BASE, total nats of the window.
    pub dnll: f64,
    /// `dnll / scored`.
    pub dnll_per_token: f64,
    /// Decoded scored text (with `--model`), else `None`.
    pub excerpt: Option<String>,
}

/// Non-finite bookkeeping.
#[derive(Clone, Debug, Serialize)]
pub struct NonfiniteInfo {
    /// Windows with a non-finite score in BASE / NEW.
    pub base_windows: usize,
    pub new_windows: usize,
    /// Windows left out of the paired statistics (non-finite in either).
    pub excluded_windows: usize,
}

/// The noise floor the gate used.
#[derive(Clone, Debug, Serialize)]
pub struct FloorInfo {
    pub base_floor_pct: f64,
    pub base_bit_identical: bool,
    pub factor: Option<f64>,
    pub limit_pct: Option<f64>,
}

/// Everything `compare` found; serialized as the `--json` verdict.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    /// `infernix-compare`.
    pub schema: &'static str,
    pub schema_version: u32,
    pub verdict: Verdict,
    pub exit_code: u8,
    pub base: RunInfo,
    pub new: RunInfo,
    pub thresholds: Thresholds,
    pub n_streams: usize,
    pub overall: PairedStats,
    pub domains: Vec<DomainPaired>,
    pub streams: Vec<StreamPaired>,
    pub nonfinite: NonfiniteInfo,
    pub noise_floor: Option<FloorInfo>,
    pub kl_divergence: KlComparison,
    pub checks: Vec<Check>,
    pub notes: Vec<String>,
    pub top_windows: Vec<MovedWindow>,
}

impl Comparison {
    /// Recomputes the verdict from the checks.
    fn settle(&mut self) {
        self.verdict = gate::verdict(&self.checks);
        self.exit_code = self.verdict.exit_code();
    }
}

fn paired(r: &WindowRow) -> PairedWindow {
    PairedWindow { n_scored: r.scored, base_nll_sum: r.base_nll_sum, new_nll_sum: r.new_nll_sum }
}

/// Compares two loaded reports. Errors (exit 2): windows that differ, a floor
/// gate without a recorded floor, invalid thresholds.
pub fn compare(base: &LoadedReport, new: &LoadedReport, th: &Thresholds, n_top: usize) -> Result<Comparison> {
    th.validate()?;
    let rows = input::pair_windows(&base.view, &new.view)?;
    let finite: Vec<&WindowRow> = rows.iter().filter(|r| r.finite()).collect();
    if finite.is_empty() {
        anyhow::bail!(
            "no window is finite in both reports ({} windows; BASE {} and NEW {} have non-finite scores in {} and {}): nothing to compare",
            rows.len(),
            base.path.display(),
            new.path.display(),
            rows.iter().filter(|r| r.base_nonfinite > 0).count(),
            rows.iter().filter(|r| r.new_nonfinite > 0).count()
        );
    }
    let mut notes = Vec::new();

    let overall = PairedStats::of(&finite.iter().map(|r| paired(r)).collect::<Vec<_>>());
    let tagged: Vec<(String, PairedWindow)> = finite.iter().map(|r| (r.domain.clone(), paired(r))).collect();
    let domains: Vec<DomainPaired> =
        by_domain(&tagged).into_iter().map(|(domain, w)| DomainPaired { domain, stats: PairedStats::of(&w) }).collect();
    let streams: Vec<StreamPaired> = base
        .view
        .streams
        .iter()
        .enumerate()
        .map(|(si, s)| {
            let w: Vec<PairedWindow> = finite.iter().filter(|r| r.stream_index == si).map(|r| paired(r)).collect();
            StreamPaired { stream: s.name.clone(), domain: s.domain.clone(), stats: PairedStats::of(&w) }
        })
        .collect();

    let nonfinite = NonfiniteInfo {
        base_windows: rows.iter().filter(|r| r.base_nonfinite > 0).count(),
        new_windows: rows.iter().filter(|r| r.new_nonfinite > 0).count(),
        excluded_windows: rows.len() - finite.len(),
    };
    if nonfinite.excluded_windows > 0 {
        notes.push(format!("{} windows with non-finite scores are left out of the statistics", nonfinite.excluded_windows));
    }

    let noise_floor = match (&base.view.noise_floor, th.max_delta_over_floor) {
        (Some(f), factor) => Some(FloorInfo {
            base_floor_pct: f.floor_pct,
            base_bit_identical: f.bit_identical,
            factor,
            limit_pct: factor.map(|x| x * f.floor_pct),
        }),
        (None, Some(_)) => anyhow::bail!(
            "--max-delta-over-floor: BASE {} records no noise_floor (score the baseline with --noise-floor)",
            base.path.display()
        ),
        (None, None) => None,
    };
    let floor_pct = noise_floor.as_ref().map(|f| f.base_floor_pct);

    let mut checks = gate::ppl_checks("overall", &overall, th, floor_pct);
    if th.per_domain && domains.len() > 1 {
        for d in &domains {
            checks.extend(gate::ppl_checks(&d.domain, &d.stats, th, None).into_iter().filter(|c| c.name != "identical"));
        }
    }
    checks.push(gate::nonfinite_check(nonfinite.base_windows, nonfinite.new_windows));
    let kl = kl::compare(base.view.kl.as_ref(), new.view.kl.as_ref());
    checks.extend(gate::kl_checks(&kl, th));
    if let Some(note) = &kl.note {
        if kl.base.is_some() || kl.new.is_some() {
            notes.push(format!("KL: {note} (the KL gates read NEW's own kl_divergence)"));
        }
    }

    let mut moved: Vec<&WindowRow> = finite.iter().copied().filter(|r| r.new_nll_sum != r.base_nll_sum).collect();
    moved.sort_by(|a, b| {
        let (da, db) = ((a.new_nll_sum - a.base_nll_sum).abs(), (b.new_nll_sum - b.base_nll_sum).abs());
        db.total_cmp(&da)
    });
    let top_windows = moved
        .into_iter()
        .take(n_top)
        .enumerate()
        .map(|(i, r)| {
            let d = r.new_nll_sum - r.base_nll_sum;
            MovedWindow {
                rank: i + 1,
                stream: r.stream.clone(),
                domain: r.domain.clone(),
                index: r.index,
                begin: r.begin,
                end: r.end,
                first_target: r.first_target,
                scored: r.scored,
                base_nll_sum: r.base_nll_sum,
                new_nll_sum: r.new_nll_sum,
                dnll: d,
                dnll_per_token: d / r.scored.max(1) as f64,
                excerpt: None,
            }
        })
        .collect();

    let mut c = Comparison {
        schema: "infernix-compare",
        schema_version: 1,
        verdict: Verdict::Pass,
        exit_code: 0,
        base: RunInfo::of(base),
        new: RunInfo::of(new),
        thresholds: th.clone(),
        n_streams: base.view.streams.len(),
        overall,
        domains,
        streams,
        nonfinite,
        noise_floor,
        kl_divergence: kl,
        checks,
        notes,
        top_windows,
    };
    c.settle();
    Ok(c)
}

/// `--markdown` / `--json` against BASE, NEW and `--model`, before any work.
fn check_compare_outputs(args: &CompareArgs) -> Result<()> {
    use crate::util::outputs::{check_outputs, Named};
    let (base, new) = (crate::report::report_path(&args.base), crate::report::report_path(&args.new));
    let mut inputs = vec![Named::new("BASE", &base), Named::new("NEW", &new)];
    if let Some(m) = &args.model {
        inputs.push(Named::new("--model", m));
    }
    let mut outputs = Vec::new();
    if let Some(p) = &args.markdown {
        outputs.push(Named::new("--markdown", p));
    }
    if let Some(p) = &args.json {
        outputs.push(Named::new("--json", p));
    }
    let plot = args.plots.as_ref().map(|d| d.join(crate::report::plots::WINDOW_DIFFERENCES));
    if let (Some(dir), Some(p)) = (&args.plots, &plot) {
        if dir.exists() && !dir.is_dir() {
            anyhow::bail!("--plots {}: exists and is not a folder", dir.display());
        }
        // A folder still to be created holds nothing to clash with.
        if dir.is_dir() {
            outputs.push(Named::new("--plots", p));
        }
    }
    check_outputs(&outputs, &[], &inputs)
}

impl CompareArgs {
    pub fn thresholds(&self) -> Thresholds {
        Thresholds {
            alpha: self.alpha,
            max_delta_pct: self.max_delta_pct,
            fail_delta_pct: self.fail_delta_pct,
            max_delta_over_floor: self.max_delta_over_floor,
            max_mean_kl: self.max_mean_kl,
            min_top1: self.min_top1,
            max_flips: self.max_flips,
            per_domain: self.per_domain,
        }
    }
}

/// The whole subcommand: read, compare, decode excerpts, print the table,
/// write the optional files. Returns the verdict (errors are exit 2).
pub fn run(args: &CompareArgs) -> Result<Comparison> {
    let th = args.thresholds();
    th.validate()?;
    check_compare_outputs(args)?;
    let base = input::load_report(&args.base, "BASE")?;
    let new = input::load_report(&args.new, "NEW")?;
    let mut c = compare(&base, &new, &th, args.top)?;
    if let Some(model) = &args.model {
        let rows = input::pair_windows(&base.view, &new.view)?;
        let shown: Vec<&WindowRow> = c
            .top_windows
            .iter()
            .filter_map(|m| rows.iter().find(|r| r.stream == m.stream && r.index == m.index))
            .collect();
        let (texts, notes) = excerpt::excerpts(model, args.data_root.as_deref(), &base.view, &shown);
        for (m, r) in c.top_windows.iter_mut().zip(&shown) {
            m.excerpt = texts.get(&(r.stream_index, r.index)).cloned();
        }
        c.notes.extend(notes);
    }
    print!("{}", output::table(&c));
    if let Some(dir) = &args.plots {
        // The windows of the paired statistics (finite in both), in pairing order.
        let rows = input::pair_windows(&base.view, &new.view)?;
        let per_window: Vec<f64> =
            rows.iter().filter(|r| r.finite()).map(|r| (r.new_nll_sum - r.base_nll_sum) / r.scored.max(1) as f64).collect();
        let svg = crate::report::plots::window_differences(&per_window, c.overall.mean_diff, c.overall.mean_diff_ci95)?;
        std::fs::create_dir_all(dir).with_context(|| format!("--plots {}: create the folder", dir.display()))?;
        crate::report::plots::write_svg(dir, crate::report::plots::WINDOW_DIFFERENCES, &svg).with_context(|| format!("--plots {}", dir.display()))?;
    }
    if let Some(p) = &args.markdown {
        crate::util::fs::write_atomic(p, output::markdown(&c).as_bytes()).with_context(|| format!("--markdown {}", p.display()))?;
    }
    if let Some(p) = &args.json {
        let json = serde_json::to_vec_pretty(&c).context("serialize the verdict")?;
        crate::util::fs::write_atomic(p, &json).with_context(|| format!("--json {}", p.display()))?;
    }
    Ok(c)
}
