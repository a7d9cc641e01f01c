//! `--resume DIR`: per-window checkpoints, so an interrupted run continues
//! from the windows it already scored and writes the report an uninterrupted
//! run writes.
//!
//! Layout: `DIR/plan.json` identifies the run ([`ResumePlan`]: artifact
//! digest, workload, route and every execution setting, the streams and
//! their window counts); `DIR/windows/S-W.json` holds window `W` of stream
//! `S` (both counted from 0) exactly as report.json records it, written
//! atomically (temporary file, then rename) as the window completes. A
//! window's record holds all its numbers (`nll_sum`, `nll_sq_sum`, ...) and
//! JSON floats read back to the same bits, so the pooled figures of a resumed
//! run are those of an uninterrupted one; only wall times differ (a resumed
//! window keeps the `seconds` of the run that scored it).
//!
//! A folder recorded for another plan is refused before any window runs,
//! naming the first differing field. SIGINT/SIGTERM stop at a window
//! boundary (`util::signal`) and leave every finished checkpoint. The
//! checkpoints stay after the run succeeds (delete the folder when done).
//! With `--save-top-tokens` each window's records are kept beside its
//! checkpoint (`windows/S-W.topk`, [`top_tokens_file`]) and the run's file is
//! joined from them at the end (`score::topk::join_files`); with
//! `--kl-reference` a checkpoint holds the window's KL record and its
//! per-position detail, so the resumed KL figures are the uninterrupted
//! run's too.
//!
//! Mixture-of-experts models: the expert-usage counts are the backend's, per
//! batched pass (the windows scored together), not per window. The last
//! window saved of each pass carries the pass's counts and the list of its
//! windows ([`BatchUsage`]); on resume a window counts as scored only if the
//! checkpoint of its pass's carrier is there with all of the pass's windows,
//! so the resumed counts (carriers' sums plus the new passes') are those of
//! an uninterrupted run, and a pass cut short is scored again whole. It does
//! not score anything; `evaluate` calls it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::backend::ExecutionSpec;
use crate::model::ExpertUsage;
use crate::report::{WindowResult, Workload};
use crate::util::json::first_difference;

pub const PLAN_FILE: &str = "plan.json";
pub const WINDOWS_DIR: &str = "windows";

/// What identifies a run for `--resume`: everything that changes a number.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResumePlan {
    pub schema_version: u32,
    pub artifact_digest: String,
    pub workload: Workload,
    pub backend: String,
    pub route: String,
    pub spec: ExecutionSpec,
    /// `execution.details`: kernels, pass sizes, batching.
    pub details: serde_json::Value,
    pub streams: Vec<PlanStream>,
    /// `--save-top-tokens`: each window's top-k records are kept beside its
    /// checkpoint (`windows/S-W.topk`), and the file is joined from them.
    pub save_top_tokens: bool,
    /// `--kl-reference`: the SHA-256 of the reference's records (its trailer's).
    pub kl_reference_sha256: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanStream {
    pub name: String,
    pub token_ids_sha256: String,
    pub n_windows: usize,
}

/// One window's checkpoint file.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Checkpoint {
    stream: String,
    window: WindowResult,
    /// Mixture-of-experts models: set on the last window saved of a pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    batch_usage: Option<BatchUsage>,
}

/// The expert-usage counts of one batched pass and the windows it scored
/// (indices within the carrier's stream).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct BatchUsage {
    windows: Vec<usize>,
    usage: ExpertUsage,
}

/// The checkpoints of one run folder.
pub struct Checkpoints {
    dir: PathBuf,
    done: HashMap<(usize, usize), WindowResult>,
    /// Mixture-of-experts models: the counts of every pass read back.
    resumed_usage: Option<ExpertUsage>,
    /// Checkpoints left out because their pass was cut short.
    n_orphans: usize,
}

fn window_file(dir: &Path, stream: usize, window: usize) -> PathBuf {
    dir.join(WINDOWS_DIR).join(format!("{stream}-{window}.json"))
}

/// The top-k records of window `window` of stream `stream` (a top-tokens
/// file of that one window), kept with `--save-top-tokens`; written before
/// the window's checkpoint, so a checkpoint implies its records.
pub fn top_tokens_file(dir: &Path, stream: usize, window: usize) -> PathBuf {
    dir.join(WINDOWS_DIR).join(format!("{stream}-{window}.topk"))
}

impl Checkpoints {
    /// Opens (or starts) `dir` for `plan`: refuses a folder of another plan,
    /// reads every checkpoint of this one. `moe`: the model routes experts, so
    /// only windows of complete passes count ([`BatchUsage`]).
    pub fn open(dir: &Path, plan: &ResumePlan, moe: bool) -> Result<Self> {
        let plan_path = dir.join(PLAN_FILE);
        let ours = serde_json::to_value(plan).context("serialize the resume plan")?;
        if plan_path.exists() {
            let bytes = crate::util::fs::read_bounded(&plan_path, 64 << 20, "--resume")?;
            let theirs: serde_json::Value =
                serde_json::from_slice(&bytes).with_context(|| format!("--resume {}: not JSON", plan_path.display()))?;
            if let Some(d) = first_difference(&theirs, &ours, "plan") {
                bail!("--resume {}: the folder holds checkpoints of another plan ({}: {d}); use a new folder", dir.display(), plan_path.display());
            }
        } else {
            std::fs::create_dir_all(dir.join(WINDOWS_DIR)).with_context(|| format!("--resume {}: create", dir.display()))?;
            let json = serde_json::to_vec_pretty(plan).context("serialize the resume plan")?;
            crate::util::fs::write_atomic(&plan_path, &json).with_context(|| format!("--resume {}", dir.display()))?;
        }
        let mut done = HashMap::new();
        for (si, s) in plan.streams.iter().enumerate() {
            for wi in 0..s.n_windows {
                let p = window_file(dir, si, wi);
                if !p.exists() {
                    continue;
                }
                let bytes = crate::util::fs::read_bounded(&p, 64 << 20, "--resume")?;
                let c: Checkpoint = serde_json::from_slice(&bytes).with_context(|| format!("--resume checkpoint {}", p.display()))?;
                if c.stream != s.name || c.window.index != wi {
                    bail!("--resume checkpoint {}: holds stream '{}' window {}, not '{}' window {wi}", p.display(), c.stream, c.window.index, s.name);
                }
                done.insert((si, wi), (c.window, c.batch_usage));
            }
        }
        let (mut resumed_usage, mut complete) = (None, std::collections::HashSet::new());
        if moe {
            for (&(si, wi), (_, batch)) in &done {
                let Some(b) = batch else { continue };
                if !b.windows.contains(&wi) {
                    bail!("--resume checkpoint {}: carries the expert counts of a pass without itself", window_file(dir, si, wi).display());
                }
                // A carrier is saved after the rest of its pass, so the rest is there unless removed since.
                if b.windows.iter().all(|w| done.contains_key(&(si, *w))) {
                    complete.extend(b.windows.iter().map(|w| (si, *w)));
                    match &mut resumed_usage {
                        None => resumed_usage = Some(b.usage.clone()),
                        Some(u) => u.add(&b.usage).with_context(|| format!("--resume checkpoint {}", window_file(dir, si, wi).display()))?,
                    }
                }
            }
        }
        let n_read = done.len();
        let done: HashMap<_, _> = done.into_iter().filter(|(k, _)| !moe || complete.contains(k)).map(|(k, (w, _))| (k, w)).collect();
        Ok(Self { dir: dir.to_path_buf(), n_orphans: n_read - done.len(), done, resumed_usage })
    }

    /// Checkpoints read but left out: windows of a pass whose carrier
    /// (mixture-of-experts models) is missing, to be scored again.
    pub fn n_orphans(&self) -> usize {
        self.n_orphans
    }

    /// Mixture-of-experts models: the expert-usage counts of the passes read
    /// back (`None` when none was, or for a dense model).
    pub fn resumed_usage(&self) -> Option<&ExpertUsage> {
        self.resumed_usage.as_ref()
    }

    /// Windows read back from the folder.
    pub fn n_done(&self) -> usize {
        self.done.len()
    }

    /// The recorded result of window `window` of stream `stream`, if any.
    pub fn get(&self, stream: usize, window: usize) -> Option<WindowResult> {
        self.done.get(&(stream, window)).cloned()
    }

    /// The folder (for the per-window top-tokens files).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Records the windows of one finished pass (each atomically); with
    /// `usage` (mixture-of-experts models, the pass's expert counts) the last
    /// one saved carries it.
    pub fn save_pass(&self, stream: usize, name: &str, windows: &[WindowResult], usage: Option<ExpertUsage>) -> Result<()> {
        let mut usage = usage.map(|usage| BatchUsage { windows: windows.iter().map(|w| w.index).collect(), usage });
        for (i, w) in windows.iter().enumerate() {
            let batch_usage = if i + 1 == windows.len() { usage.take() } else { None };
            let c = Checkpoint { stream: name.to_string(), window: w.clone(), batch_usage };
            let json = serde_json::to_vec(&c).context("serialize a checkpoint")?;
            crate::util::fs::write_atomic(&window_file(&self.dir, stream, w.index), &json)
                .with_context(|| format!("--resume {}: checkpoint of stream '{name}' window {}", self.dir.display(), w.index))?;
        }
        Ok(())
    }
}
