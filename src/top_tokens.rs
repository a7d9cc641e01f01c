//! The scoring loop's hooks for `--save-tokens`, `--save-top-tokens` and
//! `--kl-reference`: fingerprint the run, check a reference against it
//! before anything is scored, then per window hand the backend the
//! reference's ids, write this run's top-k records and compare.
//!
//! `app` calls, in order: [`TopTokensRun::prepare`] (after planning; writes
//! `--save-tokens`, refuses a mismatched reference), [`TopTokensRun::create_writer`]
//! (once the backend is known), then per window [`TopTokensRun::begin_window`]
//! / [`TopTokensRun::end_window`], per stream [`TopTokensRun::end_stream`],
//! and [`TopTokensRun::finish`]. Nothing here touches the model: every
//! backend plugs in through `WindowScorer::score_window`'s `top_k` and
//! `extra_ids`. The file format is `score::topk`, the arithmetic `score::kl`.

use std::collections::VecDeque;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use tracing::info;

use crate::plan::{Stream, Window};
use crate::artifact::Artifact;
use crate::config::{Input, RunConfig};
use crate::model::TargetScore;
use crate::report::{CorpusInfo, KlReport, KlReferenceInfo};
use crate::score::kl::{
    self, KlAccumulator, KlPositions, KlSummary, OwnPosition, ReferencePosition, WindowKl, WorstPosition, WorstWindow,
};
use crate::score::position::PositionAccumulator;
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

/// The state of `--save-top-tokens` / `--kl-reference` during one run.
pub struct TopTokensRun {
    fingerprint: RunFingerprint,
    /// Ids per position in the files (64, or the vocabulary if smaller).
    k: usize,
    /// `--save-tokens`, written to its temporary file; renamed into place by
    /// [`commit_saved_tokens`](Self::commit_saved_tokens) once the run succeeded.
    saved_tokens: Option<crate::util::fs::AtomicFile>,
    writer: Option<TopTokensWriter>,
    reference: Option<TopTokensReader>,
    /// The reference's records of each window begun and not yet ended, oldest first.
    window_records: VecDeque<Vec<TopRecord>>,
    stream: KlAccumulator,
    overall: KlAccumulator,
    /// The stream being scored (index into the fingerprint's streams).
    stream_index: usize,
    worst: Vec<WorstPosition>,
    worst_windows: Vec<WorstWindow>,
    /// KL by position in the window of every compared position (its NLL side unused).
    pub kl_by_position: PositionAccumulator,
    /// Every compared position's KL (f32; NaN where excluded), for the histogram.
    kl_values: Vec<f32>,
}

impl TopTokensRun {
    /// Fingerprints the run; writes `--save-tokens`; opens `--kl-reference`,
    /// checks it whole and refuses it, naming the first difference, unless it
    /// was recorded for exactly these windows. `None` when no flag asks for
    /// top tokens or KL.
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
                Some(r)
            }
        };
        Ok(Some(Self {
            fingerprint: fp,
            k,
            saved_tokens,
            writer: None,
            reference,
            window_records: VecDeque::new(),
            stream: KlAccumulator::default(),
            overall: KlAccumulator::default(),
            stream_index: 0,
            worst: Vec::new(),
            worst_windows: Vec::new(),
            kl_by_position: PositionAccumulator::default(),
            kl_values: Vec::new(),
        }))
    }

    /// Creates the `--save-top-tokens` file (temporary until [`finish`](Self::finish)).
    pub fn create_writer(&mut self, cfg: &RunConfig, producer: serde_json::Value) -> Result<()> {
        if let Some(path) = &cfg.save_top_tokens {
            let header = FileHeader {
                format: topk::FORMAT.into(),
                producer,
                n_positions: self.fingerprint.n_positions(),
                fingerprint: self.fingerprint.clone(),
            };
            self.writer = Some(TopTokensWriter::create(path, self.k, &header).with_context(|| format!("--save-top-tokens {}", path.display()))?);
        }
        Ok(())
    }

    /// The `top_k` to ask the backend for: `K` when writing records, 1 (this
    /// run's argmax) when only comparing.
    pub fn top_k(&self) -> usize {
        if self.writer.is_some() {
            self.k
        } else if self.reference.is_some() {
            1
        } else {
            0
        }
    }

    /// Reads the reference's records of `w` and returns their ids, one list
    /// per target (the backend's `extra_ids`); empty without a reference.
    /// Windows of a batch are begun in order, then ended in the same order.
    pub fn begin_window(&mut self, w: &Window) -> Result<Vec<Vec<u32>>> {
        match &mut self.reference {
            None => Ok(Vec::new()),
            Some(r) => {
                let records = r.read_records(w.scored())?;
                let ids = records.iter().map(|rec| rec.ids.clone()).collect();
                self.window_records.push_back(records);
                Ok(ids)
            }
        }
    }

    /// Writes this window's records and compares it with the reference.
    /// Returns the window's KL record (statistics without quantiles or
    /// buckets, and the sums) and its per-position KLs. Every compared
    /// position also goes to [`Self::kl_by_position`] and the histogram.
    pub fn end_window(&mut self, w: &Window, scores: &[TargetScore]) -> Result<Option<(WindowKl, KlPositions)>> {
        ensure!(scores.len() == w.scored(), "window {}: {} scores for {} targets", w.index, scores.len(), w.scored());
        let covers_vocab = self.k == self.fingerprint.n_vocab;
        if let Some(writer) = &mut self.writer {
            for s in scores {
                writer.write(&record_of(s, self.k, covers_vocab)?)?;
            }
        }
        if self.reference.is_none() {
            return Ok(None);
        }
        let records = self.window_records.pop_front().with_context(|| format!("window {}: ended before it began", w.index))?;
        ensure!(records.len() == scores.len(), "window {}: {} reference records for {} scores", w.index, records.len(), scores.len());
        let mut window = KlAccumulator::default();
        let mut positions = KlPositions { first_n_context: w.first_target - w.begin, kl: Vec::with_capacity(scores.len()) };
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
            self.kl_by_position.add_kl(&p);
            if p.kl.is_finite() && p.kl > window_max.0 {
                window_max = (p.kl, w.first_target + j);
            }
            kl::keep_worst(&mut self.worst, kl::N_WORST_POSITIONS, p.kl, || WorstPosition {
                kl: p.kl,
                stream: self.fingerprint.streams.get(self.stream_index).map_or_else(String::new, |st| st.name.clone()),
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
        }
        window.end_window();
        self.kl_by_position.end_kl_window();
        self.kl_values.extend_from_slice(&positions.kl);
        let record = window.window_record();
        let summary = &record.summary;
        kl::keep_worst(&mut self.worst_windows, kl::N_WORST_WINDOWS, summary.mean, || WorstWindow {
            mean_kl: summary.mean,
            stream: self.fingerprint.streams.get(self.stream_index).map_or_else(String::new, |st| st.name.clone()),
            window: w.index,
            begin: w.begin,
            end: w.end,
            scored: w.scored(),
            max_kl: window_max.0,
            max_kl_token_index: window_max.1,
            mean_nll_delta: summary.mean_nll_delta,
            text: None,
        });
        self.add_window(&record, &positions);
        Ok(Some((record, positions)))
    }

    /// Pools a window's KL record into the stream's and the run's statistics
    /// (windows in plan order).
    pub fn add_window(&mut self, record: &WindowKl, positions: &KlPositions) {
        self.stream.add_window(record, positions);
        self.overall.add_window(record, positions);
    }

    /// Closes a stream: its full KL statistics (quantiles and buckets).
    pub fn end_stream(&mut self) -> Option<KlSummary> {
        let acc = std::mem::take(&mut self.stream);
        self.stream_index += 1;
        self.reference.as_ref()?;
        Some(acc.summary())
    }

    /// Renames the `--save-tokens` file into place (at the end of a run).
    pub fn commit_saved_tokens(&mut self) -> Result<()> {
        match self.saved_tokens.take() {
            Some(f) => f.commit().context("--save-tokens"),
            None => Ok(()),
        }
    }

    /// Renames the `--save-tokens` and `--save-top-tokens` files into place and returns (and logs
    /// on stderr, llama.cpp-style) the overall KL statistics.
    pub fn finish(mut self) -> Result<Option<KlReport>> {
        self.commit_saved_tokens()?;
        if let Some(w) = self.writer {
            w.finish()?;
        }
        let Some(r) = self.reference else { return Ok(None) };
        let summary = self.overall.summary();
        for line in kl::summary_lines(&summary, r.k) {
            info!("{line}");
        }
        if let Some(w) = self.worst.first() {
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
        Ok(Some(KlReport {
            reference: KlReferenceInfo {
                path: r.path.display().to_string(),
                sha256: r.records_sha256.clone(),
                producer: r.header.producer.clone(),
                top_k: r.k,
            },
            bound: KlReport::BOUND.into(),
            summary,
            worst_positions: self.worst,
            worst_windows: self.worst_windows,
            histogram: Some(crate::report::plots::KlHistogram::of(&self.kl_values)),
        }))
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
