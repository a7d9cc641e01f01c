//! The scoring loop's hooks for `--save-tokens`, `--save-top-tokens` and
//! `--kl-reference`: fingerprint the run, check a reference against it
//! before anything is scored, then per window hand the backend the
//! reference's ids, write this run's top-k records and compare.
//!
//! `evaluate` calls, in order: [`TopTokensRun::prepare`] (after planning,
//! before any `--shard` selection; writes `--save-tokens`, refuses a
//! mismatched reference), [`TopTokensRun::set_producer`] (once the backend is
//! known), then [`TopTokensRun::part`] once per scoring worker and on it per
//! window [`TopTokensPart::begin_window`] / [`TopTokensPart::end_window`],
//! and [`TopTokensPart::finish`]; after scoring, [`pool_kl`] over the
//! windows in plan order (`merge` pools shards' windows with it too). The
//! reference is read at random (each window at its own offset), so shards,
//! workers and resumed runs compare exactly the windows they score. Nothing
//! here touches the model: every backend plugs in through
//! `WindowScorer::score_window`'s `top_k` and `extra_ids`. The file format is
//! `score::topk`, the arithmetic `score::kl`.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{ensure, Context, Result};
use tracing::info;

use crate::plan::{Stream, Window};
use crate::artifact::Artifact;
use crate::config::{Input, RunConfig};
use crate::model::TargetScore;
use crate::report::{CorpusInfo, KlReferenceInfo, KlReport, WindowResult};
use crate::score::kl::{
    self, KlAccumulator, KlDetail, KlPositions, KlSummary, OwnPosition, ReferencePosition, WindowKl, WorstPosition, WorstWindow,
};
use crate::score::position::{window_kl_sums, PositionAccumulator};
use crate::score::topk::{
    self, FileHeader, InputFingerprint, RunFingerprint, SavedTokens, StreamFingerprint, TopRecord, TopTokensReader,
    TopTokensWriter, WindowFingerprint, TOP_K,
};
use crate::text::tokenizer::token_ids_sha256;

/// A window's input ids as the model sees them: `stream[begin..end)` with
/// the first replaced by BOS when the plan says so.
pub fn window_tokens(tokens: &[u32], w: &Window, bos: Option<u32>) -> Result<Vec<u32>> {
    let mut t = tokens[w.begin..w.end].to_vec();
    if w.replace_first_with_bos {
        t[0] = bos.context("window asks for BOS but the vocabulary has none")?;
    }
    Ok(t)
}

/// What identifies the run's input: the manifest (corpus), the file's bytes
/// (text) or the ids (tokens).
fn input_fingerprint(cfg: &RunConfig, corpus: Option<&CorpusInfo>, streams: &[Stream]) -> Result<InputFingerprint> {
    let name = |p: &Path| p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned());
    Ok(match (&cfg.input, corpus) {
        (Input::Corpus { quick, .. }, Some(c)) => {
            InputFingerprint { kind: "corpus".into(), name: c.name.clone(), sha256: c.manifest_sha256.clone(), quick: Some(*quick) }
        }
        (Input::Text(p), _) => {
            let bytes = std::fs::read(p).with_context(|| format!("read text file {}", p.display()))?;
            InputFingerprint { kind: "text".into(), name: name(p), sha256: crate::text::corpus::sha256_hex(&bytes), quick: None }
        }
        (Input::Tokens(p), _) => InputFingerprint {
            kind: "tokens".into(),
            name: name(p),
            sha256: streams.first().map_or_else(String::new, |s| s.token_ids_sha256.clone()),
            quick: None,
        },
        (Input::Corpus { manifest, .. }, None) => {
            anyhow::bail!("corpus {}: no corpus information", manifest.as_deref().unwrap_or(std::path::Path::new(crate::text::corpus::BUNDLED_MANIFEST)).display())
        }
    })
}

/// The run's fingerprint and every window's input ids (`[stream][window]`).
pub fn fingerprint(
    cfg: &RunConfig,
    artifact: &Artifact,
    corpus: Option<&CorpusInfo>,
    streams: &[Stream],
    bos: Option<u32>,
) -> Result<(RunFingerprint, Vec<Vec<Vec<u32>>>)> {
    let mut all_tokens = Vec::with_capacity(streams.len());
    let mut fps = Vec::with_capacity(streams.len());
    for s in streams {
        let mut toks = Vec::with_capacity(s.windows.len());
        let mut windows = Vec::with_capacity(s.windows.len());
        for w in &s.windows {
            let t = window_tokens(&s.tokens, w, bos)?;
            windows.push(WindowFingerprint {
                index: w.index,
                begin: w.begin,
                end: w.end,
                first_target: w.first_target,
                tokens_sha256: token_ids_sha256(&t),
            });
            toks.push(t);
        }
        fps.push(StreamFingerprint {
            name: s.name.clone(),
            n_tokens: s.tokens.len(),
            token_ids_sha256: s.token_ids_sha256.clone(),
            windows,
        });
        all_tokens.push(toks);
    }
    let fp = RunFingerprint {
        tokenizer_sha256: artifact.meta.tokenizer.blob.sha256.clone(),
        n_vocab: artifact.meta.hparams.n_vocab,
        input: input_fingerprint(cfg, corpus, streams)?,
        method: cfg.method.name().to_string(),
        context: cfg.method.context(),
        stride: cfg.method.stride(),
        chunks_limit: cfg.chunks_limit,
        streams: fps,
    };
    Ok((fp, all_tokens))
}

/// The state of `--save-tokens`, `--save-top-tokens` and `--kl-reference`
/// during one run, shared by every scoring worker (`&self`; the reference
/// reader sits behind a lock). Each worker writes and compares through its
/// own [`TopTokensPart`].
pub struct TopTokensRun {
    /// The whole plan's (every window, also with `--shard`).
    fingerprint: RunFingerprint,
    /// Ids per position in the files (64, or the vocabulary if smaller).
    k: usize,
    /// `--save-tokens`, written to its temporary file; renamed into place by
    /// [`commit_saved_tokens`](Self::commit_saved_tokens) once the run succeeded.
    saved_tokens: Option<crate::util::fs::AtomicFile>,
    /// `--save-top-tokens` and the `producer` of its header (set by [`Self::set_producer`]).
    save: Option<(PathBuf, serde_json::Value)>,
    reference: Option<Reference>,
}

/// `--kl-reference`, read at random: window `w` of stream `s` starts at record `first[s][w]`.
struct Reference {
    reader: Mutex<TopTokensReader>,
    first: Vec<Vec<usize>>,
    info: KlReferenceInfo,
}

/// Where a worker's top-k records go.
pub enum PartFile {
    /// One file for the worker's windows (`header`'s), renamed into place by
    /// [`TopTokensPart::finish`].
    Whole(PathBuf),
    /// One file per window, `resume::top_tokens_file(dir, stream, window)`,
    /// each complete when its window is (`--resume` with `--save-top-tokens`).
    PerWindow(PathBuf),
}

/// One scoring worker's side of [`TopTokensRun`]: its top-tokens file and
/// the reference records of the windows it began and has not ended.
pub struct TopTokensPart<'a> {
    run: &'a TopTokensRun,
    writer: Option<TopTokensWriter>,
    per_window: Option<PathBuf>,
    window_records: VecDeque<Vec<TopRecord>>,
}

impl TopTokensRun {
    /// Fingerprints the whole plan (`streams` before any `--shard`
    /// selection); writes `--save-tokens` (the whole plan's, also for a
    /// shard); opens `--kl-reference`, checks it whole and refuses it, naming
    /// the first difference, unless it was recorded for exactly this plan.
    /// `None` when no flag asks for top tokens or KL.
    pub fn prepare(
        cfg: &RunConfig,
        artifact: &Artifact,
        corpus: Option<&CorpusInfo>,
        streams: &[Stream],
        bos: Option<u32>,
    ) -> Result<Option<Self>> {
        if cfg.save_tokens.is_none() && cfg.save_top_tokens.is_none() && cfg.kl_reference.is_none() {
            return Ok(None);
        }
        let (fp, tokens) = fingerprint(cfg, artifact, corpus, streams, bos)?;
        let k = TOP_K.min(fp.n_vocab);
        let mut saved_tokens = None;
        if let Some(path) = &cfg.save_tokens {
            let saved = SavedTokens {
                format: topk::TOKENS_FORMAT.into(),
                version: topk::TOKENS_VERSION,
                top_k: k,
                fingerprint: fp.clone(),
                tokens,
            };
            saved_tokens = Some(topk::write_saved_tokens_pending(path, &saved).with_context(|| format!("--save-tokens {}", path.display()))?);
            info!("wrote (pending the run's end) the input ids of {} windows to {}", fp.streams.iter().map(|s| s.windows.len()).sum::<usize>(), path.display());
        }
        let reference = match &cfg.kl_reference {
            None => None,
            Some(path) => {
                let r = TopTokensReader::open(path).with_context(|| format!("--kl-reference {}", path.display()))?;
                if let Some(d) = r.header.fingerprint.first_difference(&fp) {
                    anyhow::bail!("--kl-reference {} was recorded for another run: {d}", path.display());
                }
                info!(
                    "KL reference {}: {} positions, top-{} (producer {})",
                    path.display(),
                    r.header.n_positions,
                    r.k,
                    r.header.producer
                );
                let info = KlReferenceInfo {
                    path: r.path.display().to_string(),
                    sha256: r.records_sha256.clone(),
                    producer: r.header.producer.clone(),
                    top_k: r.k,
                };
                Some(Reference { first: r.window_offsets(), reader: Mutex::new(r), info })
            }
        };
        Ok(Some(Self { fingerprint: fp, k, saved_tokens, save: cfg.save_top_tokens.clone().map(|p| (p, serde_json::Value::Null)), reference }))
    }

    /// Records who writes the `--save-top-tokens` file (its header's
    /// `producer`: tool, model, backend), once the backend is known.
    pub fn set_producer(&mut self, producer: serde_json::Value) {
        if let Some((_, p)) = &mut self.save {
            *p = producer;
        }
    }

    /// The `top_k` to ask the backend for: `K` when writing records, 1 (this
    /// run's argmax) when only comparing.
    pub fn top_k(&self) -> usize {
        if self.save.is_some() {
            self.k
        } else if self.reference.is_some() {
            1
        } else {
            0
        }
    }

    /// `--kl-reference`: what the report records of it.
    pub fn reference(&self) -> Option<&KlReferenceInfo> {
        self.reference.as_ref().map(|r| &r.info)
    }

    /// `--save-top-tokens`: the file's path.
    pub fn save_path(&self) -> Option<&Path> {
        self.save.as_ref().map(|(p, _)| p.as_path())
    }

    /// The header of a top-tokens file holding the windows of `streams`
    /// (the plan's, or a shard's or worker's selection of them).
    pub fn header_for(&self, streams: &[Stream]) -> FileHeader {
        self.header_of(|si, wi| streams.get(si).is_some_and(|s| s.windows.iter().any(|w| w.index == wi)))
    }

    /// The header of a top-tokens file holding the windows `keep(stream, window)` takes.
    fn header_of(&self, keep: impl Fn(usize, usize) -> bool) -> FileHeader {
        let fingerprint = self.fingerprint.restricted(keep);
        FileHeader {
            format: topk::FORMAT.into(),
            producer: self.save.as_ref().map_or(serde_json::Value::Null, |(_, p)| p.clone()),
            n_positions: fingerprint.n_positions(),
            fingerprint,
        }
    }

    /// A worker's side for the windows of `streams`: with `--save-top-tokens`
    /// its records go to `file` (none without the flag).
    pub fn part(&self, streams: &[Stream], file: Option<PartFile>) -> Result<TopTokensPart<'_>> {
        let (writer, per_window) = match (self.save.is_some(), file) {
            (false, _) | (true, None) => (None, None),
            (true, Some(PartFile::Whole(path))) => {
                let w = TopTokensWriter::create(&path, self.k, &self.header_for(streams)).with_context(|| format!("--save-top-tokens {}", path.display()))?;
                (Some(w), None)
            }
            (true, Some(PartFile::PerWindow(dir))) => (None, Some(dir)),
        };
        Ok(TopTokensPart { run: self, writer, per_window, window_records: VecDeque::new() })
    }

    /// Renames the `--save-tokens` file into place (at the end of a run).
    pub fn commit_saved_tokens(&mut self) -> Result<()> {
        match self.saved_tokens.take() {
            Some(f) => f.commit().context("--save-tokens"),
            None => Ok(()),
        }
    }
}

impl TopTokensPart<'_> {
    /// [`TopTokensRun::top_k`].
    pub fn top_k(&self) -> usize {
        self.run.top_k()
    }

    /// Reads the reference's records of window `w` of stream `stream` (index
    /// into the plan's streams) and returns their ids, one list per target
    /// (the backend's `extra_ids`); empty without a reference. Windows of a
    /// batch are begun in order, then ended in the same order.
    pub fn begin_window(&mut self, stream: usize, w: &Window) -> Result<Vec<Vec<u32>>> {
        match &self.run.reference {
            None => Ok(Vec::new()),
            Some(r) => {
                let first = r.first.get(stream).and_then(|s| s.get(w.index)).copied().with_context(|| {
                    format!("--kl-reference {}: no stream {stream} window {} in its plan", r.info.path, w.index)
                })?;
                let records = r.reader.lock().map_err(|_| anyhow::anyhow!("--kl-reference: a worker panicked while reading"))?.read_at(first, w.scored())?;
                let ids = records.iter().map(|rec| rec.ids.clone()).collect();
                self.window_records.push_back(records);
                Ok(ids)
            }
        }
    }

    /// Writes this window's records and compares it with the reference.
    /// Returns the window's KL record (statistics without quantiles or
    /// buckets, and the sums) and what pooling it needs besides
    /// ([`KlDetail`]); nothing is pooled here (see [`KlPool`]).
    pub fn end_window(&mut self, stream: usize, stream_name: &str, w: &Window, scores: &[TargetScore]) -> Result<Option<(WindowKl, KlDetail)>> {
        ensure!(scores.len() == w.scored(), "window {}: {} scores for {} targets", w.index, scores.len(), w.scored());
        let run = self.run;
        let covers_vocab = run.k == run.fingerprint.n_vocab;
        let mut one_window = match &self.per_window {
            Some(dir) => {
                let path = crate::resume::top_tokens_file(dir, stream, w.index);
                let header = run.header_of(|si, wi| (si, wi) == (stream, w.index));
                Some(TopTokensWriter::create(&path, run.k, &header).with_context(|| format!("--resume: top tokens of stream '{stream_name}' window {}", w.index))?)
            }
            None => None,
        };
        for writer in self.writer.iter_mut().chain(one_window.as_mut()) {
            for s in scores {
                writer.write(&record_of(s, run.k, covers_vocab)?)?;
            }
        }
        if let Some(writer) = one_window {
            writer.finish()?;
        }
        if run.reference.is_none() {
            return Ok(None);
        }
        let records = self.window_records.pop_front().with_context(|| format!("window {}: ended before it began", w.index))?;
        ensure!(records.len() == scores.len(), "window {}: {} reference records for {} scores", w.index, records.len(), scores.len());
        let mut window = KlAccumulator::default();
        let mut positions = KlPositions { first_n_context: w.first_target - w.begin, kl: Vec::with_capacity(scores.len()) };
        let mut compared = Vec::with_capacity(scores.len());
        let mut worst = Vec::new();
        let mut window_max: (f64, usize) = (f64::NEG_INFINITY, w.first_target);
        for (j, (s, rec)) in scores.iter().zip(&records).enumerate() {
            ensure!(
                s.extra.len() == rec.ids.len(),
                "window {} target {}: the backend returned {} of the reference's {} logits",
                w.index,
                w.first_target + j,
                s.extra.len(),
                rec.ids.len()
            );
            let p = compare_with_record(rec, s, covers_vocab, w.first_target + j - w.begin);
            let own_top1 = s.top.first().map(|t| t.0);
            window.add(&p);
            positions.kl.push(KlPositions::value(&p));
            if p.kl.is_finite() && p.kl > window_max.0 {
                window_max = (p.kl, w.first_target + j);
            }
            kl::keep_worst(&mut worst, kl::N_WORST_POSITIONS, p.kl, || WorstPosition {
                kl: p.kl,
                stream: stream_name.to_string(),
                window: w.index,
                token_index: w.first_target + j,
                n_context: p.n_context,
                reference_top: (0..rec.ids.len().min(3))
                    .map(|i| (rec.ids[i], f64::from(rec.logps[i]).exp(), (f64::from(s.extra[i]) - s.lse).exp()))
                    .collect(),
                top1: own_top1,
                nll: p.nll,
                reference_nll: p.reference_nll,
                text: None,
                reference_top_text: Vec::new(),
            });
            compared.push(p);
        }
        window.end_window();
        let record = window.window_record();
        let summary = &record.summary;
        let worst_window = WorstWindow {
            mean_kl: summary.mean,
            stream: stream_name.to_string(),
            window: w.index,
            begin: w.begin,
            end: w.end,
            scored: w.scored(),
            max_kl: window_max.0,
            max_kl_token_index: window_max.1,
            mean_nll_delta: summary.mean_nll_delta,
            text: None,
        };
        let detail = KlDetail { positions, by_position: window_kl_sums(&compared), worst_positions: worst, worst_window };
        Ok(Some((record, detail)))
    }

    /// Renames this worker's top-tokens file into place (nothing for
    /// per-window files, each complete already).
    pub fn finish(self) -> Result<()> {
        match self.writer {
            Some(w) => w.finish(),
            None => Ok(()),
        }
    }
}

/// Pools windows' KL records, in plan order, into the stream, run and
/// position-bucket statistics and the worst lists: the one way every
/// figure of `results.kl_divergence` is made, whether the windows were
/// scored here, by other workers, by other shards (`merge`) or by an
/// earlier run (`--resume`), so all give the same bits.
#[derive(Default)]
pub struct KlPool {
    stream: KlAccumulator,
    overall: KlAccumulator,
    by_position: PositionAccumulator,
    worst: Vec<WorstPosition>,
    worst_windows: Vec<WorstWindow>,
    /// Every compared position's KL (f32; NaN where excluded), for the histogram.
    kl_values: Vec<f32>,
}

impl KlPool {
    pub fn add_window(&mut self, record: &WindowKl, detail: &KlDetail) {
        self.stream.add_window(record, &detail.positions);
        self.overall.add_window(record, &detail.positions);
        self.by_position.add_kl_window(&detail.by_position);
        self.kl_values.extend_from_slice(&detail.positions.kl);
        for p in &detail.worst_positions {
            kl::keep_worst(&mut self.worst, kl::N_WORST_POSITIONS, p.kl, || p.clone());
        }
        let ww = &detail.worst_window;
        kl::keep_worst(&mut self.worst_windows, kl::N_WORST_WINDOWS, ww.mean_kl, || ww.clone());
    }

    /// Closes a stream: its full KL statistics (quantiles and buckets).
    pub fn end_stream(&mut self) -> KlSummary {
        std::mem::take(&mut self.stream).summary()
    }

    /// The run's KL report and the KL side of `by_position`.
    pub fn finish(self, reference: KlReferenceInfo) -> (KlReport, PositionAccumulator) {
        let report = KlReport {
            reference,
            bound: KlReport::BOUND.into(),
            summary: self.overall.summary(),
            worst_positions: self.worst,
            worst_windows: self.worst_windows,
            histogram: Some(crate::report::plots::KlHistogram::of(&self.kl_values)),
        };
        (report, self.by_position)
    }
}

/// The KL of every window of `streams` (windows in plan order, each with
/// its `kl_divergence` record and `kl_detail`) pooled by [`KlPool`]: each
/// stream's statistics, the run's report and the KL side of `by_position`.
pub fn pool_kl(streams: &[&[WindowResult]], names: &[&str], reference: KlReferenceInfo) -> Result<(Vec<KlSummary>, KlReport, PositionAccumulator)> {
    let mut pool = KlPool::default();
    let mut per_stream = Vec::with_capacity(streams.len());
    for (windows, name) in streams.iter().zip(names) {
        for w in *windows {
            let (Some(record), Some(detail)) = (&w.kl_divergence, &w.kl_detail) else {
                anyhow::bail!("stream '{name}' window {}: no KL record with its per-position detail (scored without --kl-reference, or by an older build)", w.index);
            };
            pool.add_window(record, detail);
        }
        per_stream.push(pool.end_stream());
    }
    let (report, by_position) = pool.finish(reference);
    Ok((per_stream, report, by_position))
}

/// Logs the run's KL statistics on stderr, llama.cpp-style.
pub fn log_kl_summary(kl: &KlReport) {
    for line in kl::summary_lines(&kl.summary, kl.reference.top_k) {
        info!("{line}");
    }
    if let Some(w) = kl.worst_positions.first() {
        let moved: Vec<String> = w.reference_top.iter().map(|(id, p, q)| format!("{id}: {p:.4} -> {q:.4}")).collect();
        info!(
            "Largest KLD: {:.6} at {} window {} token {} (reference top ids, p -> this run's: {})",
            w.kl,
            w.stream,
            w.window,
            w.token_index,
            moved.join(", ")
        );
    }
}

/// This run's record of one position: top-K ids and log-probabilities, the
/// target's, and the rest mass, from the backend's logits and log-sum-exp.
pub fn record_of(s: &TargetScore, k: usize, covers_vocab: bool) -> Result<TopRecord> {
    ensure!(s.top.len() == k, "the backend returned {} top entries, {k} asked", s.top.len());
    let exact: Vec<f64> = s.top.iter().map(|&(_, l)| f64::from(l) - s.lse).collect();
    Ok(TopRecord {
        target_logp: kl::logp_f32(s.target_logit, s.lse),
        log_rest: kl::log_rest_mass(&exact, covers_vocab) as f32,
        ids: s.top.iter().map(|t| t.0).collect(),
        logps: s.top.iter().map(|&(_, l)| kl::logp_f32(f64::from(l), s.lse)).collect(),
    })
}

/// Compares this run's score of one position with a recorded top-k record
/// (`--kl-reference`, or the batched scores of `--verify-invariance`);
/// `s.extra` holds this run's logits of `rec.ids`.
pub fn compare_with_record(rec: &TopRecord, s: &TargetScore, covers_vocab: bool, n_context: usize) -> kl::PositionKl {
    let reference = ReferencePosition { ids: &rec.ids, logps: &rec.logps, target_logp: rec.target_logp, log_rest: rec.log_rest };
    let own = OwnPosition {
        lse: s.lse,
        target_logit: s.target_logit,
        top1: s.top.first().map(|t| t.0),
        extra_logits: &s.extra,
        covers_vocab,
        n_context,
    };
    kl::compare_position(&reference, &own)
}
