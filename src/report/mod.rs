//! `report.json` (schema version 4, documented in docs/report.md with the
//! changes from version 3) and the stdout domain table.
//!
//! This module owns the report's shape: one set of typed serde structs that
//! the writer serializes and every reader (`compare`, `merge`, the tests)
//! deserializes, so a field renamed here is renamed for all of them. It also
//! owns the atomic write and the checked read ([`read_report`]). It computes
//! no statistics (that is `score`) and runs nothing. `v3` reads the fields
//! `compare` needs from a version-3 report.

pub mod v3;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::artifact::Artifact;
use crate::score::bytes::ByteSummary;
use crate::score::kl::{KlDetail, KlSummary, WindowKl, WorstPosition, WorstWindow};
use crate::score::position::PositionBucket;
use crate::score::{Summary, WindowStats};

pub mod plots;
pub mod worst;

pub const SCHEMA_VERSION: u32 = 4;
pub const REPORT_FILE: &str = "report.json";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub schema_version: u32,
    pub tool: ToolInfo,
    pub artifact: ArtifactInfo,
    pub workload: Workload,
    pub execution: Option<Execution>,
    pub results: Results,
    pub timing: Timing,
    /// `--noise-floor`: the same windows scored with another prefill chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub noise_floor: Option<crate::score::floor::NoiseFloor>,
    /// Peak host and device memory of the run (absent in older reports and dry runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryPeaks>,
}

/// Peak memory of a run: the process's peak resident set and, on CUDA, each
/// GPU worker's allocator high-water mark (see [`crate::backend::DeviceMemory`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryPeaks {
    /// Peak resident set size of the process, bytes (Linux `VmHWM` of
    /// /proc/self/status, read after scoring; mmap'd artifact pages count once
    /// touched); `None` where the kernel does not report it.
    pub host_peak_rss_bytes: Option<u64>,
    /// One per GPU worker, in worker order; empty on the CPU backend.
    pub devices: Vec<crate::backend::DeviceMemory>,
}

impl MemoryPeaks {
    /// The process's peak RSS now, with the given devices' figures.
    pub fn now(devices: Vec<crate::backend::DeviceMemory>) -> Self {
        let status = std::fs::read_to_string("/proc/self/status").ok();
        Self { host_peak_rss_bytes: status.as_deref().and_then(vm_hwm_bytes), devices }
    }

    /// Shards that ran as separate processes: the largest peak RSS, every shard's
    /// devices in shard order; `None` unless every shard recorded its memory.
    pub fn merged<'a>(shards: impl Iterator<Item = Option<&'a MemoryPeaks>>) -> Option<Self> {
        let mut out = MemoryPeaks { host_peak_rss_bytes: Some(0), devices: Vec::new() };
        for m in shards {
            let m = m?;
            out.host_peak_rss_bytes = match (out.host_peak_rss_bytes, m.host_peak_rss_bytes) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            };
            out.devices.extend(m.devices.iter().cloned());
        }
        Some(out)
    }
}

/// The `VmHWM:` line of a /proc/PID/status text, in bytes (the kernel writes kB).
pub fn vm_hwm_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let mut it = line["VmHWM:".len()..].split_whitespace();
    let kb: u64 = it.next()?.parse().ok()?;
    (it.next() == Some("kB")).then_some(kb * 1024)
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolInfo {
    pub name: String,
    pub version: String,
    pub git_revision: String,
}

impl ToolInfo {
    pub fn current() -> Self {
        Self {
            name: "infernix-perplexity".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            git_revision: option_env!("INFERNIX_GIT_REVISION").unwrap_or("unknown").into(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ArtifactInfo {
    pub path: String,
    pub architecture: String,
    pub public_name: String,
    /// SHA-256 of the artifact's metadata block (which holds every tensor's SHA-256).
    pub digest: String,
    pub file_bytes: u64,
    /// Source files the artifact was converted from, with their SHA-256.
    pub sources: Vec<crate::artifact::meta::SourceFile>,
    /// Tensor counts by format for each tensor group.
    pub weight_formats: std::collections::BTreeMap<String, std::collections::BTreeMap<String, usize>>,
    pub tokenizer_sha256: String,
    pub verified: bool,
}

impl ArtifactInfo {
    pub fn of(a: &Artifact, verified: bool) -> Self {
        Self {
            path: a.path.display().to_string(),
            architecture: a.meta.architecture.name().into(),
            public_name: a.meta.public_name.clone(),
            digest: a.digest.clone(),
            file_bytes: a.n_file_bytes,
            sources: a.meta.provenance.sources.clone(),
            weight_formats: a.formats_by_group(),
            tokenizer_sha256: a.meta.tokenizer.blob.sha256.clone(),
            verified,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// `corpus`, `text` or `tokens`.
    pub input: String,
    /// The `--text` / `--tokens` file as given (absent for a corpus).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_path: Option<String>,
    pub corpus: Option<CorpusInfo>,
    pub method: String,
    pub context: usize,
    pub stride: Option<usize>,
    pub chunks_limit: Option<usize>,
    pub prefill_chunk_tokens: usize,
    pub bos: BosPolicy,
    /// `--shard K/N`: this report holds shard K's windows only
    /// (`infernix-perplexity merge` joins the shards; absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardInfo>,
}

/// `workload.shard`: which shard of the plan a report holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// K, counted from 0.
    pub index: usize,
    /// N.
    pub count: usize,
    /// Windows the whole plan has in each stream (the shards hold them all between them).
    pub n_windows: Vec<usize>,
    /// `--save-top-tokens`: the shard's file (its windows' records), as an
    /// absolute path; `merge --save-top-tokens` joins them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_tokens: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CorpusInfo {
    pub name: String,
    pub manifest: String,
    pub manifest_sha256: String,
    pub quick: bool,
    pub data_root: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BosPolicy {
    /// The tokenizer prepends BOS to each stream.
    pub add_bos: bool,
    pub bos_id: Option<u32>,
    /// Windows not starting at the stream's first token have their first
    /// (context-only) token replaced by BOS.
    pub replace_window_first_token: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Execution {
    pub backend: String,
    pub device: String,
    /// `fp32`, `bf16-tc`, or `bf16-tc-emulated` on the CPU.
    pub route: String,
    pub threads: usize,
    /// Every numeric setting, typed (`backend::ExecutionSpec`).
    #[serde(flatten)]
    pub spec: crate::backend::ExecutionSpec,
    /// Everything else that can change a number (kernels, fast paths, PTX arch, nvcc).
    pub details: serde_json::Value,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Results {
    pub overall: Option<Overall>,
    pub domains: Vec<DomainResult>,
    pub streams: Vec<StreamResult>,
    /// NLL (and KL) by position in the window, buckets of 256 (`score::position`).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub by_position: Vec<PositionBucket>,
    /// KL divergence against `--kl-reference` (absent without one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_divergence: Option<KlReport>,
    /// For mixture-of-experts models, per layer how often each expert was
    /// routed over every row the scoring passes ran, and how many never were
    /// (`model::ExpertUsage`); absent for dense models.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_usage: Option<crate::model::ExpertUsage>,
    /// `--verify-invariance N`: the first N windows rescored alone against batched.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub invariance: Option<crate::score::invariance::Invariance>,
    /// `--target-uncertainty X`: how many windows were scored and why it stopped.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub early_stop: Option<crate::score::early_stop::EarlyStop>,
}

/// `results.kl_divergence`: the run against a recorded top-k reference.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlReport {
    pub reference: KlReferenceInfo,
    /// What the figure is: always a lower bound of the full KL.
    pub bound: String,
    #[serde(flatten)]
    pub summary: KlSummary,
    /// The positions with the largest KL (at most `kl::N_WORST_POSITIONS`,
    /// largest first; none with KL 0).
    pub worst_positions: Vec<WorstPosition>,
    /// The windows with the largest mean KL (at most `kl::N_WORST_WINDOWS`,
    /// largest first; none with mean KL 0). `worst.md` beside the report
    /// lists both, readably.
    #[serde(default)]
    pub worst_windows: Vec<WorstWindow>,
    /// Histogram of the per-position KL on a log scale (`report::plots`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub histogram: Option<plots::KlHistogram>,
}

impl KlReport {
    pub const BOUND: &'static str = "lower bound of KL(reference || this run): the reference's top-k ids plus one bucket \
        for every other token (merging outcomes can only lower KL); equal to the full KL when the top-k hold all the mass";
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlReferenceInfo {
    pub path: String,
    /// SHA-256 of the reference file's records (its trailer's): two reports
    /// with the same value were compared with the same reference (`compare`'s
    /// KL gates read it).
    pub sha256: String,
    /// The reference file's `producer` (tool, model, backend).
    pub producer: serde_json::Value,
    pub top_k: usize,
}

/// `results.overall`: every window of the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Overall {
    #[serde(flatten)]
    pub summary: Summary,
    /// `scored_bytes`, `bits_per_byte`, `byte_perplexity` (absent when the tokenizer has no byte rule).
    #[serde(flatten)]
    pub bytes: Option<ByteSummary>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DomainResult {
    pub domain: String,
    pub streams: usize,
    #[serde(flatten)]
    pub summary: Summary,
    #[serde(flatten)]
    pub bytes: Option<ByteSummary>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StreamResult {
    pub name: String,
    pub domain: String,
    /// Tokens of the stream (`input_tokens`, from the summary, counts the
    /// tokens evaluated by its windows).
    pub n_tokens: usize,
    pub token_ids_sha256: String,
    #[serde(flatten)]
    pub summary: Option<Summary>,
    /// Bytes of the stream's text as read (absent for `--tokens` input).
    pub text_bytes: Option<usize>,
    /// Bytes all the stream's tokens cover (`score::bytes`); equals
    /// `text_bytes` unless the text holds what the tokenizer normalizes away.
    pub token_bytes: Option<u64>,
    #[serde(flatten)]
    pub bytes: Option<ByteSummary>,
    /// KL against `--kl-reference`, with quantiles and context buckets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_divergence: Option<KlSummary>,
    pub windows: Vec<WindowResult>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WindowResult {
    pub index: usize,
    pub begin: usize,
    pub end: usize,
    pub first_target: usize,
    pub scored: usize,
    /// [`window_tokens_sha256`] of the window's input tokens (after BOS replacement).
    pub tokens_sha256: String,
    /// Input tokens the model evaluated (`end - begin`).
    pub input_tokens: usize,
    pub n_nonfinite: usize,
    /// Σ NLL and Σ NLL² over the finite targets (compensated sums): with the
    /// counts, all that pooling windows into any summary needs.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub nll_sum: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub nll_sq_sum: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub mean_nll: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub perplexity: f64,
    pub seconds: f64,
    #[serde(flatten)]
    pub bytes: Option<ByteSummary>,
    /// The window's targets by position bucket (`score::position`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub by_position: Vec<crate::score::position::PositionSums>,
    /// KL against `--kl-reference`: statistics (no quantiles, no buckets)
    /// and the sums that pool into the stream's and the run's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_divergence: Option<WindowKl>,
    /// With `kl_divergence`, only in a shard's report (and in `--resume`
    /// checkpoints): what pooling the window into the run's KL figures needs
    /// besides (every position's KL, its sums by position bucket, its
    /// largest-KL positions; `score::kl::KlDetail`). `merge` drops it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_detail: Option<KlDetail>,
}

impl WindowResult {
    /// The window's sufficient statistics, as the scorer produced them.
    pub fn stats(&self) -> WindowStats {
        WindowStats {
            input_tokens: self.input_tokens,
            scored_tokens: self.scored,
            n_nonfinite: self.n_nonfinite,
            nll_sum: self.nll_sum,
            nll_sq_sum: self.nll_sq_sum,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct Timing {
    pub elapsed_seconds: f64,
    pub load_seconds: f64,
    pub tokenize_seconds: f64,
    pub scoring_seconds: f64,
    pub tokens_processed: usize,
    pub tokens_scored: usize,
    /// Input tokens evaluated by the model per second of scoring time.
    pub tokens_per_second_processed: Option<f64>,
    /// Scored targets per second of scoring time.
    pub tokens_per_second_scored: Option<f64>,
}

/// The fingerprint of one window: SHA-256 of its input token ids as the
/// model saw them (after BOS replacement), each id as 4 little-endian bytes;
/// lowercase hex. `compare` refuses windows whose fingerprints differ.
pub fn window_tokens_sha256(tokens: &[u32]) -> String {
    crate::text::tokenizer::token_ids_sha256(tokens)
}

/// Writes `dir/report.json` atomically (temporary file, then rename).
pub fn write_report(dir: &Path, report: &Report) -> Result<()> {
    let json = serde_json::to_vec_pretty(report).context("serialize report")?;
    crate::util::fs::write_atomic(&dir.join(REPORT_FILE), &json)
}

/// `PATH` itself when it is a file, `PATH/report.json` when it is a folder.
pub fn report_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join(REPORT_FILE)
    } else {
        path.to_path_buf()
    }
}

/// The largest report.json read (a full-corpus report is a few MB).
pub const MAX_REPORT_BYTES: u64 = 1 << 30;

/// The `schema_version` of a report's JSON, before anything else is read.
pub fn schema_version_of(bytes: &[u8]) -> Result<u32> {
    #[derive(Deserialize)]
    struct Version {
        schema_version: u32,
    }
    let v: Version = serde_json::from_slice(bytes).context("not JSON with a schema_version")?;
    Ok(v.schema_version)
}

/// A version-4 report from its bytes (any other version is an error naming it).
pub fn parse_report(bytes: &[u8]) -> Result<Report> {
    let version = schema_version_of(bytes)?;
    if version != SCHEMA_VERSION {
        bail!("schema_version {version} (this reader reads version {SCHEMA_VERSION})");
    }
    serde_json::from_slice(bytes).context("not an infernix-perplexity report of schema version 4")
}

/// Reads `PATH` (a report.json or the folder holding it) as a version-4 report;
/// errors name the file and `what` (a flag or a role).
pub fn read_report(path: &Path, what: &str) -> Result<Report> {
    let path = report_path(path);
    let bytes = crate::util::fs::read_bounded(&path, MAX_REPORT_BYTES, what)?;
    parse_report(&bytes).with_context(|| format!("{what} {}", path.display()))
}

/// The stdout table: one row per domain and an `overall` row, with the
/// byte figures (`-` when the tokenizer has no byte rule).
pub fn domain_table(results: &Results) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:>7} {:>10} {:>10} {:>12} {:>12} {:>12} {:>11} {:>8} {:>9}",
        "domain", "streams", "scored", "mean_nll", "ppl", "+-(llama)", "+-(windows)", "bytes", "bpb", "byte_ppl"
    );
    let mut row = |name: &str, streams: usize, s: &Summary, b: Option<&ByteSummary>| {
        let fmt = |u: Option<f64>| u.map_or("-".to_string(), |u| format!("{u:.4}"));
        let (bytes, bpb, bppl) = b.map_or_else(
            || ("-".to_string(), "-".to_string(), "-".to_string()),
            |b| (b.scored_bytes.to_string(), format!("{:.4}", b.bits_per_byte), format!("{:.4}", b.byte_perplexity)),
        );
        let _ = writeln!(
            out,
            "{:<16} {:>7} {:>10} {:>10.6} {:>12.4} {:>12} {:>12} {:>11} {:>8} {:>9}",
            name,
            streams,
            s.scored_tokens,
            s.mean_nll,
            s.perplexity,
            fmt(s.ppl_uncertainty_llama),
            fmt(s.ppl_uncertainty_clustered),
            bytes,
            bpb,
            bppl
        );
    };
    for d in &results.domains {
        row(&d.domain, d.streams, &d.summary, d.bytes.as_ref());
    }
    if let Some(o) = &results.overall {
        row("overall", results.streams.len(), &o.summary, o.bytes.as_ref());
    }
    out.push_str(
        "+-(llama): llama.cpp's uncertainty of the PPL (tokens independent); \
         +-(windows): clustered by window (tokens of one window correlated), the one to trust; \
         bytes: UTF-8 bytes of the scored targets, bpb: bits per byte, byte_ppl: 2^bpb.\n",
    );
    out
}

/// llama-perplexity's closing line, `Final estimate: PPL = X +/- Y` (its
/// `%.4lf` and `%.5lf`, its uncertainty: tokens taken as independent), so
/// scripts written for llama.cpp read this program's stderr unchanged.
pub fn llama_cpp_final_estimate(s: &Summary) -> String {
    format!("Final estimate: PPL = {:.4} +/- {:.5}", s.perplexity, s.ppl_uncertainty_llama.unwrap_or(f64::NAN))
}

/// Pools, from the windows' records in plan order, what the windows alone
/// determine beyond the token summaries: the byte figures of every stream,
/// domain and the overall row (`score::bytes`; only when every window has
/// them), and `by_position` (NLL by position in the window). `kl` brings KL
/// by position, which needs every position's KL (the scoring run's own
/// accumulator; `None` in a merge). Writer and `merge` both call this.
pub fn pool_window_figures(results: &mut Results, kl: Option<crate::score::position::PositionAccumulator>) {
    use crate::score::bytes::WindowBytes;
    let windows = || results.streams.iter().flat_map(|s| &s.windows);
    let have = windows().next().is_some() && windows().all(|w| w.bytes.is_some());
    let of = |s: &StreamResult| -> Vec<WindowBytes> {
        s.windows.iter().filter_map(|w| w.bytes.as_ref().map(|b| WindowBytes::of_record(b, w.nll_sum))).collect()
    };
    let domains: Vec<Option<ByteSummary>> = results
        .domains
        .iter()
        .map(|d| have.then(|| ByteSummary::over(&results.streams.iter().filter(|s| s.domain == d.domain).flat_map(of).collect::<Vec<_>>())))
        .collect();
    let overall = have.then(|| ByteSummary::over(&results.streams.iter().flat_map(of).collect::<Vec<_>>()));
    let mut positions = kl.unwrap_or_default();
    for w in windows() {
        positions.add_window(&w.by_position);
    }
    results.by_position = positions.buckets();
    for s in &mut results.streams {
        s.bytes = have.then(|| ByteSummary::over(&of(s)));
    }
    for (d, b) in results.domains.iter_mut().zip(domains) {
        d.bytes = b;
    }
    if let Some(o) = &mut results.overall {
        o.bytes = overall;
    }
}

#[cfg(test)]
mod memory_tests {
    use super::*;
    use crate::backend::DeviceMemory;

    fn dev(name: &str, used: u64) -> DeviceMemory {
        DeviceMemory {
            device: name.into(),
            pool_used_peak_bytes: used,
            pool_reserved_peak_bytes: used + 1,
            device_used_at_end_bytes: used + 2,
            device_total_bytes: 1 << 40,
        }
    }

    #[test]
    fn vm_hwm_is_read_in_bytes_and_only_in_kb() {
        let status = "Name:\tinfernix\nVmPeak:\t  999 kB\nVmHWM:\t   4321 kB\nVmRSS:\t  100 kB\n";
        assert_eq!(vm_hwm_bytes(status), Some(4321 * 1024));
        assert_eq!(vm_hwm_bytes("VmRSS:\t 5 kB\n"), None);
        assert_eq!(vm_hwm_bytes("VmHWM:\t 5 MB\n"), None);
        assert_eq!(vm_hwm_bytes("VmHWM:\t x kB\n"), None);
    }

    #[test]
    fn this_process_has_a_peak_rss() {
        let m = MemoryPeaks::now(Vec::new());
        if std::path::Path::new("/proc/self/status").exists() {
            assert!(m.host_peak_rss_bytes.is_some_and(|b| b > 1 << 20), "{m:?}");
        }
    }

    #[test]
    fn merged_shards_take_the_largest_rss_and_every_device() {
        let a = MemoryPeaks { host_peak_rss_bytes: Some(10), devices: vec![dev("a", 1)] };
        let b = MemoryPeaks { host_peak_rss_bytes: Some(30), devices: vec![dev("b", 2), dev("c", 3)] };
        let m = MemoryPeaks::merged([Some(&a), Some(&b)].into_iter()).unwrap();
        assert_eq!(m.host_peak_rss_bytes, Some(30));
        assert_eq!(m.devices.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(), ["a", "b", "c"]);
        assert_eq!(MemoryPeaks::merged([Some(&a), None].into_iter()), None);
        let unknown = MemoryPeaks { host_peak_rss_bytes: None, devices: Vec::new() };
        assert_eq!(MemoryPeaks::merged([Some(&a), Some(&unknown)].into_iter()).unwrap().host_peak_rss_bytes, None);
    }

    #[test]
    fn memory_round_trips_and_may_be_absent() {
        let m = MemoryPeaks { host_peak_rss_bytes: Some(7), devices: vec![dev("gpu 0", 5)] };
        let back: MemoryPeaks = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
    }
}
