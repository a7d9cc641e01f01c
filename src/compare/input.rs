//! Reading two report.json files for `compare` and pairing their windows.
//!
//! It owns the read-side view of a report (only the fields the comparison
//! needs; anything else in the file is ignored, so later schema additions do
//! not break it) and the refusal of reports whose windows differ. It computes
//! no statistics.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;

/// A report as `compare` reads it, plus the raw JSON (for optional blocks such
/// as `kl_divergence`, looked up by [`super::kl`]).
#[derive(Debug)]
pub struct LoadedReport {
    pub path: PathBuf,
    pub view: ReportView,
    pub raw: Value,
}

#[derive(Debug, Deserialize)]
pub struct ReportView {
    pub schema_version: u32,
    #[serde(default)]
    pub artifact: Option<ArtifactView>,
    pub workload: WorkloadView,
    #[serde(default)]
    pub execution: Option<ExecutionView>,
    pub results: ResultsView,
    #[serde(default)]
    pub noise_floor: Option<NoiseFloorView>,
}

#[derive(Debug, Deserialize)]
pub struct ArtifactView {
    #[serde(default)]
    pub path: String,
    #[serde(default)]
    pub public_name: String,
}

#[derive(Debug, Deserialize)]
pub struct ExecutionView {
    #[serde(default)]
    pub backend: String,
    #[serde(default)]
    pub kv_dtype: String,
}

#[derive(Debug, Deserialize)]
pub struct WorkloadView {
    #[serde(default)]
    pub input: String,
    /// The `--text` / `--tokens` file (absent for corpora and older reports).
    #[serde(default)]
    pub input_path: Option<String>,
    #[serde(default)]
    pub corpus: Option<CorpusView>,
    pub method: String,
    pub context: usize,
    #[serde(default)]
    pub stride: Option<usize>,
    #[serde(default)]
    pub prefill_chunk_tokens: Option<usize>,
    #[serde(default)]
    pub bos: Option<BosView>,
}

#[derive(Debug, Deserialize)]
pub struct CorpusView {
    pub manifest: String,
    #[serde(default)]
    pub quick: bool,
    #[serde(default)]
    pub data_root: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct BosView {
    #[serde(default)]
    pub bos_id: Option<u32>,
}

#[derive(Debug, Deserialize)]
pub struct ResultsView {
    #[serde(default)]
    pub streams: Vec<StreamView>,
}

#[derive(Debug, Deserialize)]
pub struct StreamView {
    pub name: String,
    pub domain: String,
    #[serde(default)]
    pub token_ids_sha256: Option<String>,
    #[serde(default)]
    pub windows: Vec<WindowView>,
}

#[derive(Debug, Deserialize)]
pub struct WindowView {
    pub index: usize,
    pub begin: usize,
    pub end: usize,
    pub first_target: usize,
    pub scored: usize,
    #[serde(default)]
    pub n_nonfinite: usize,
    pub nll_sum: f64,
    #[serde(default)]
    pub tokens_sha256: Option<String>,
}

/// What `compare` needs of a report's `noise_floor` block.
#[derive(Debug, Deserialize)]
pub struct NoiseFloorView {
    pub floor_pct: f64,
    #[serde(default)]
    pub bit_identical: bool,
    #[serde(default)]
    pub alternate_prefill_chunk_tokens: Option<usize>,
}

/// `PATH` itself when it is a file, `PATH/report.json` when it is a folder.
pub fn report_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join(crate::report::REPORT_FILE)
    } else {
        path.to_path_buf()
    }
}

/// The largest report.json read (a full-corpus report is a few MB).
pub const MAX_REPORT_BYTES: u64 = 1 << 30;

/// Reads and parses a report (a file or a folder holding report.json).
pub fn load_report(path: &Path, role: &str) -> Result<LoadedReport> {
    let path = report_path(path);
    let bytes = crate::util::fs::read_bounded(&path, MAX_REPORT_BYTES, role)?;
    parse_report(&bytes).with_context(|| format!("{role} {}", path.display())).map(|(view, raw)| LoadedReport { path, view, raw })
}

/// A report from its bytes: JSON, the fields `compare` reads, the schema
/// version, at least one window, and every window's values possible.
pub fn parse_report(bytes: &[u8]) -> Result<(ReportView, Value)> {
    let raw: Value = serde_json::from_slice(bytes).context("not JSON")?;
    let view: ReportView = serde_json::from_value(raw.clone()).context("not an infernix-perplexity report")?;
    if view.schema_version != crate::report::SCHEMA_VERSION {
        bail!("schema_version {} (this compare reads version {})", view.schema_version, crate::report::SCHEMA_VERSION);
    }
    let n_windows: usize = view.results.streams.iter().map(|s| s.windows.len()).sum();
    if n_windows == 0 {
        bail!("no scored windows (a --dry-run report?)");
    }
    for s in &view.results.streams {
        for w in &s.windows {
            check_window(w).with_context(|| format!("stream '{}' window {}", s.name, w.index))?;
        }
    }
    Ok((view, raw))
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
/// positions, scored counts, window token fingerprints where both carry them).
pub fn pair_windows(base: &ReportView, new: &ReportView) -> Result<Vec<WindowRow>> {
    let (bs, ns) = (&base.results.streams, &new.results.streams);
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
        if let (Some(x), Some(y)) = (&b.token_ids_sha256, &n.token_ids_sha256) {
            if x != y {
                bail!("the reports differ: stream '{}' has token ids sha256 {x} in BASE and {y} in NEW", b.name);
            }
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
            if let (Some(x), Some(y)) = (&bw.tokens_sha256, &nw.tokens_sha256) {
                if x != y {
                    bail!("the reports differ: {} has tokens_sha256 {x} in BASE and {y} in NEW", at());
                }
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
