//! Reading two report.json files for `compare` and pairing their windows.
//!
//! A version-4 report is read through the writer's own typed structs
//! (`report::Report`), a version-3 one through `report::v3`; either becomes
//! the [`ReportView`] the comparison works on (only what it needs). It also
//! refuses reports whose windows differ. It computes no statistics.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::kl::KlSummary;
use crate::report::{self, v3, Report, Workload};

/// A report as `compare` reads it.
#[derive(Debug)]
pub struct LoadedReport {
    pub path: PathBuf,
    pub view: ReportView,
}

/// What the comparison reads of a report, whichever its schema version.
#[derive(Debug)]
pub struct ReportView {
    pub schema_version: u32,
    /// The artifact's public name (its path when it has none).
    pub artifact: String,
    /// `execution.backend` and the KV format (absent in a dry run).
    pub backend: Option<String>,
    pub kv_format: Option<String>,
    pub workload: Workload,
    pub streams: Vec<StreamView>,
    pub noise_floor: Option<NoiseFloorView>,
    /// The overall KL statistics (`results.kl_divergence`).
    pub kl: Option<KlSummary>,
}

#[derive(Debug)]
pub struct StreamView {
    pub name: String,
    pub domain: String,
    pub token_ids_sha256: String,
    pub windows: Vec<WindowView>,
}

#[derive(Debug)]
pub struct WindowView {
    pub index: usize,
    pub begin: usize,
    pub end: usize,
    pub first_target: usize,
    pub scored: usize,
    pub n_nonfinite: usize,
    pub nll_sum: f64,
    pub tokens_sha256: String,
}

/// What `compare` needs of a report's `noise_floor` block.
#[derive(Debug)]
pub struct NoiseFloorView {
    pub floor_pct: f64,
    pub bit_identical: bool,
}

fn artifact_name(public_name: &str, path: &str) -> String {
    if public_name.is_empty() { path } else { public_name }.to_string()
}

/// The streams and windows of either schema version's typed report, whose
/// stream and window structs name these fields alike.
macro_rules! stream_views {
    ($streams:expr) => {
        $streams
            .into_iter()
            .map(|s| StreamView {
                name: s.name,
                domain: s.domain,
                token_ids_sha256: s.token_ids_sha256,
                windows: s
                    .windows
                    .into_iter()
                    .map(|w| WindowView {
                        index: w.index,
                        begin: w.begin,
                        end: w.end,
                        first_target: w.first_target,
                        scored: w.scored,
                        n_nonfinite: w.n_nonfinite,
                        nll_sum: w.nll_sum,
                        tokens_sha256: w.tokens_sha256,
                    })
                    .collect(),
            })
            .collect()
    };
}

impl From<Report> for ReportView {
    fn from(r: Report) -> Self {
        let streams = stream_views!(r.results.streams);
        ReportView {
            schema_version: r.schema_version,
            artifact: artifact_name(&r.artifact.public_name, &r.artifact.path),
            backend: r.execution.as_ref().map(|e| e.backend.clone()),
            kv_format: r.execution.as_ref().map(|e| e.spec.kv_format.name().to_string()),
            workload: r.workload,
            streams,
            noise_floor: r.noise_floor.map(|f| NoiseFloorView { floor_pct: f.floor_pct, bit_identical: f.bit_identical }),
            kl: r.results.kl_divergence.as_ref().map(KlSummary::of),
        }
    }
}

impl From<v3::ReportV3> for ReportView {
    fn from(r: v3::ReportV3) -> Self {
        let streams = stream_views!(r.results.streams);
        ReportView {
            schema_version: r.schema_version,
            artifact: artifact_name(&r.artifact.public_name, &r.artifact.path),
            backend: r.execution.as_ref().map(|e| e.backend.clone()),
            kv_format: r.execution.as_ref().map(|e| e.kv_dtype.clone()),
            workload: r.workload,
            streams,
            noise_floor: r.noise_floor.map(|f| NoiseFloorView { floor_pct: f.floor_pct, bit_identical: f.bit_identical }),
            kl: r.results.kl_divergence.as_ref().map(KlSummary::of_v3),
        }
    }
}

/// Reads and parses a report (a file or a folder holding report.json).
pub fn load_report(path: &Path, role: &str) -> Result<LoadedReport> {
    let path = report::report_path(path);
    let bytes = crate::util::fs::read_bounded(&path, report::MAX_REPORT_BYTES, role)?;
    parse_report(&bytes).with_context(|| format!("{role} {}", path.display())).map(|view| LoadedReport { path, view })
}

/// A report from its bytes: schema version 4 (or 3), typed, at least one
/// window, and every window's values possible.
pub fn parse_report(bytes: &[u8]) -> Result<ReportView> {
    let view: ReportView = match report::schema_version_of(bytes)? {
        report::SCHEMA_VERSION => report::parse_report(bytes)?.into(),
        3 => serde_json::from_slice::<v3::ReportV3>(bytes).context("not an infernix-perplexity report of schema version 3")?.into(),
        v => bail!("schema_version {v} (this compare reads versions 3 and {})", report::SCHEMA_VERSION),
    };
    let n_windows: usize = view.streams.iter().map(|s| s.windows.len()).sum();
    if n_windows == 0 {
        bail!("no scored windows (a --dry-run report?)");
    }
    for s in &view.streams {
        for w in &s.windows {
            check_window(w).with_context(|| format!("stream '{}' window {}", s.name, w.index))?;
        }
    }
    Ok(view)
}

/// Refuses values no run can produce: a negative or non-finite NLL sum
/// (every NLL is -log p >= 0; non-finite scores are counted, not summed),
/// more scored or non-finite targets than the window has tokens, targets
/// outside the window.
fn check_window(w: &WindowView) -> Result<()> {
    // 2^40 tokens: far beyond any corpus; keeps every sum of counts exact.
    const MAX_POSITION: usize = 1 << 40;
    if w.end > MAX_POSITION {
        bail!("end {} is impossible (more than 2^40 tokens)", w.end);
    }
    if !(w.nll_sum.is_finite() && w.nll_sum >= 0.0) {
        bail!("nll_sum {} is impossible (a sum of NLLs is finite and >= 0)", w.nll_sum);
    }
    if w.end <= w.begin {
        bail!("end {} is not after begin {}", w.end, w.begin);
    }
    if !(w.begin..=w.end).contains(&w.first_target) {
        bail!("first_target {} is outside [begin {}, end {}]", w.first_target, w.begin, w.end);
    }
    if w.scored > w.end - w.begin {
        bail!("scored {} is more than the window's {} input tokens", w.scored, w.end - w.begin);
    }
    if w.n_nonfinite > w.scored {
        bail!("n_nonfinite {} is more than scored {}", w.n_nonfinite, w.scored);
    }
    Ok(())
}

/// One window scored in both reports.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowRow {
    /// Position of the stream in the reports (0-based).
    pub stream_index: usize,
    pub stream: String,
    pub domain: String,
    pub index: usize,
    pub begin: usize,
    pub end: usize,
    pub first_target: usize,
    pub scored: usize,
    pub base_nonfinite: usize,
    pub new_nonfinite: usize,
    pub base_nll_sum: f64,
    pub new_nll_sum: f64,
}

impl WindowRow {
    /// Scored in both runs with finite NLLs only: usable for the paired statistics.
    pub fn finite(&self) -> bool {
        self.base_nonfinite == 0 && self.new_nonfinite == 0
    }
}

/// Pairs the windows of two reports, or names the first difference that
/// makes them incomparable (stream names or token ids, window counts,
/// positions, scored counts, window token fingerprints).
pub fn pair_windows(base: &ReportView, new: &ReportView) -> Result<Vec<WindowRow>> {
    let (bs, ns) = (&base.streams, &new.streams);
    if bs.len() != ns.len() {
        bail!("the reports differ: BASE has {} streams, NEW has {}", bs.len(), ns.len());
    }
    let mut rows = Vec::new();
    for (si, (b, n)) in bs.iter().zip(ns).enumerate() {
        if b.name != n.name {
            bail!("the reports differ: stream {si} is '{}' in BASE and '{}' in NEW", b.name, n.name);
        }
        if b.domain != n.domain {
            bail!("the reports differ: stream '{}' is in domain '{}' in BASE and '{}' in NEW", b.name, b.domain, n.domain);
        }
        if b.token_ids_sha256 != n.token_ids_sha256 {
            bail!(
                "the reports differ: stream '{}' has token ids sha256 {} in BASE and {} in NEW",
                b.name,
                b.token_ids_sha256,
                n.token_ids_sha256
            );
        }
        if b.windows.len() != n.windows.len() {
            bail!(
                "the reports differ: stream '{}' has {} windows in BASE and {} in NEW",
                b.name,
                b.windows.len(),
                n.windows.len()
            );
        }
        for (bw, nw) in b.windows.iter().zip(&n.windows) {
            let at = || format!("stream '{}' window {}", b.name, bw.index);
            let fields = [
                ("index", bw.index, nw.index),
                ("begin", bw.begin, nw.begin),
                ("end", bw.end, nw.end),
                ("first_target", bw.first_target, nw.first_target),
                ("scored", bw.scored, nw.scored),
            ];
            for (name, x, y) in fields {
                if x != y {
                    bail!("the reports differ: {} has {name} {x} in BASE and {y} in NEW", at());
                }
            }
            if bw.tokens_sha256 != nw.tokens_sha256 {
                bail!("the reports differ: {} has tokens_sha256 {} in BASE and {} in NEW", at(), bw.tokens_sha256, nw.tokens_sha256);
            }
            rows.push(WindowRow {
                stream_index: si,
                stream: b.name.clone(),
                domain: b.domain.clone(),
                index: bw.index,
                begin: bw.begin,
                end: bw.end,
                first_target: bw.first_target,
                scored: bw.scored,
                base_nonfinite: bw.n_nonfinite,
                new_nonfinite: nw.n_nonfinite,
                base_nll_sum: bw.nll_sum,
                new_nll_sum: nw.nll_sum,
            });
        }
    }
    Ok(rows)
}
