//! Reading version-3 reports: the fields `compare` needs, under their
//! version-3 names (frozen; this module changes only if a version-3 field
//! was read wrongly). Version 3 wrote `execution.kv_dtype` beside
//! `kv_format`, a stream's token count and its summary's evaluated-token
//! count under one key `input_tokens` (the later wins on reading; neither is
//! read here), and per window no Σ NLL² and no KL sums, so a version-3 report
//! can be compared but not merged. docs/report.md lists the changes.

use serde::Deserialize;

use super::Workload;

#[derive(Debug, Deserialize)]
pub struct ReportV3 {
    pub schema_version: u32,
    pub artifact: ArtifactV3,
    /// Unchanged in version 4.
    pub workload: Workload,
    pub execution: Option<ExecutionV3>,
    pub results: ResultsV3,
    pub noise_floor: Option<NoiseFloorV3>,
}

#[derive(Debug, Deserialize)]
pub struct ArtifactV3 {
    pub path: String,
    pub public_name: String,
}

#[derive(Debug, Deserialize)]
pub struct ExecutionV3 {
    pub backend: String,
    pub kv_dtype: String,
}

#[derive(Debug, Deserialize)]
pub struct ResultsV3 {
    pub streams: Vec<StreamV3>,
    pub kl_divergence: Option<KlReportV3>,
}

#[derive(Debug, Deserialize)]
pub struct StreamV3 {
    pub name: String,
    pub domain: String,
    pub token_ids_sha256: String,
    pub windows: Vec<WindowV3>,
}

#[derive(Debug, Deserialize)]
pub struct WindowV3 {
    pub index: usize,
    pub begin: usize,
    pub end: usize,
    pub first_target: usize,
    pub scored: usize,
    pub tokens_sha256: String,
    pub n_nonfinite: usize,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub nll_sum: f64,
}

#[derive(Debug, Deserialize)]
pub struct NoiseFloorV3 {
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub floor_pct: f64,
    pub bit_identical: bool,
}

/// `results.kl_divergence` of version 3: the run's overall statistics
/// (flattened into the block) and the reference's fingerprint.
#[derive(Debug, Deserialize)]
pub struct KlReportV3 {
    pub reference: KlReferenceV3,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub mean: f64,
    pub mean_se: Option<f64>,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub top1_agreement: f64,
    pub n_confident_flips: usize,
}

#[derive(Debug, Deserialize)]
pub struct KlReferenceV3 {
    pub sha256: String,
}
