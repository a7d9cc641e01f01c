//! One evaluation as a library function: open the artifact, read and
//! tokenize every stream, plan every window (a shard's only with `--shard`),
//! then (unless `--dry-run`) score the windows on the chosen backend and
//! return the typed [`Report`]. [`evaluate`] is the entry point; the scoring
//! loop ([`score_streams`]) takes the planned windows and returns their
//! results, and reports its progress through [`Event`]s.
//!
//! Everything that can be checked is checked before the first window runs:
//! inputs, checksums, tokenization, plans. It owns no output folder, no
//! progress display and no stdout (that is `app`, the CLI).

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tracing::info;

use crate::artifact::Artifact;
use crate::backend::cpu::CpuBackend;
use crate::backend::BackendKind;
use crate::config::{BackendChoice, Input, RunConfig};
use crate::model::{load_model, ExpertUsage, ScoreOptions, WindowInput, WindowScorer};
use crate::plan::{plan_windows, Shard, Stream, Window};
use crate::resume::{Checkpoints, PlanStream, ResumePlan};
use crate::report::{
    self, ArtifactInfo, BosPolicy, CorpusInfo, DomainResult, Execution, Overall, Report, Results, ShardInfo, StreamResult,
    Timing, ToolInfo, WindowResult, Workload,
};
use crate::score::bytes::{ByteSummary, TokenBytes, WindowBytes};
use crate::score::early_stop::{self, EarlyStop};
use crate::score::invariance::{Invariance, InvarianceAcc};
use crate::score::position::window_sums;
use crate::score::topk::TopRecord;
use crate::score::floor::{alternate_prefill_chunk, NoiseFloor};
use crate::score::kl::{KlDetail, WindowKl};
use crate::score::paired::PairedWindow;
use crate::score::{domain_summaries, overall_summary, StreamStats, Summary, WindowScores, WindowStats};
use crate::text::corpus;
use crate::text::tokenizer::{token_ids_sha256, TextTokenizer};
use crate::top_tokens::{compare_with_record, record_of, window_tokens, PartFile, TopTokensPart, TopTokensRun};
use crate::util::signal;

/// What the scoring loop reports as it goes.
#[derive(Clone, Copy, Debug)]
pub enum Event<'a> {
    /// A scoring of every window begins (twice with `--noise-floor`).
    Scoring { n_targets: usize },
    /// A batched pass finished: its windows' scored targets.
    Pass { stream: &'a str, n_scored: usize },
    /// A stream's windows are all scored.
    Stream { stream: &'a str, summary: &'a Summary, seconds: f64 },
    /// Every window is scored.
    Scored,
}

/// Runs one evaluation as `cfg` says: opens the artifact, reads and
/// tokenizes every stream, plans every window (only `cfg.shard`'s with
/// `--shard`), scores them on the chosen backend and returns the report.
///
/// `on_event` hears the scoring's progress ([`Event`]); the caller writes the
/// report (`report::write_report`) and prints what it likes. The files named
/// by `--save-tokens` and `--save-top-tokens` are written here, renamed into
/// place just before this returns. With `cfg.dry_run` nothing is scored: the
/// report lists each stream's tokens.
///
/// ```no_run
/// use clap::Parser;
/// use infernix_perplexity::{cli::Args, config::RunConfig};
/// let args = Args::parse_from(["infernix-perplexity", "model.ninfer", "--quick", "--output", "out"]);
/// let cfg = RunConfig::from_args(&args)?;
/// let report = infernix_perplexity::evaluate(&cfg, &mut |_event| {})?;
/// println!("{}", infernix_perplexity::report::domain_table(&report.results));
/// # anyhow::Ok(())
/// ```
pub fn evaluate(cfg: &RunConfig, on_event: &mut dyn FnMut(Event<'_>)) -> Result<Report> {
    let started = Instant::now();
    let artifact = Artifact::open(&cfg.model)?;
    if cfg.verify {
        artifact.verify()?;
        info!("verified every tensor's SHA-256");
    }
    let open_ms = started.elapsed().as_secs_f64() * 1e3;
    let meta = &artifact.meta;
    info!(
        "artifact {} opened in {open_ms:.1} ms ({}, {} layers, d_model {}, vocabulary {})",
        artifact.path.display(),
        meta.architecture.name(),
        meta.hparams.n_layers,
        meta.hparams.d_model,
        meta.hparams.n_vocab
    );
    check_trained_context(cfg.method.context(), meta.hparams.context_length, cfg.execution.rope_yarn_factor)
        .with_context(|| format!("{}", artifact.path.display()))?;
    let tokenizer = TextTokenizer::from_json(artifact.tokenizer_json(), &meta.tokenizer)
        .with_context(|| format!("{}: tokenizer", artifact.path.display()))?;
    let control_ids: Vec<u32> = [meta.tokenizer.bos_id, meta.tokenizer.eos_id].into_iter().flatten().collect();
    let token_bytes = match TokenBytes::from_tokenizer_json(artifact.tokenizer_json(), &control_ids) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!("{}: no byte figures (scored_bytes, bits_per_byte): {e:#}", artifact.path.display());
            None
        }
    };
    let load_seconds = started.elapsed().as_secs_f64();

    let t_tok = Instant::now();
    let (texts, corpus_info) = read_inputs(cfg)?;
    let bos = meta.tokenizer.add_bos.then_some(meta.tokenizer.bos_id).flatten();
    let mut streams = Vec::with_capacity(texts.len());
    for input in texts {
        signal::check().context("stopped while tokenizing; nothing written")?;
        let (tokens, text_bytes) = match input.content {
            Content::Text(t) => (tokenizer.encode(&t).with_context(|| format!("stream {}: tokenize", input.name))?, Some(t.len())),
            Content::Tokens(t) => (t, None),
        };
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= meta.hparams.n_vocab) {
            bail!("stream {}: token id {bad} is outside the vocabulary ({} tokens)", input.name, meta.hparams.n_vocab);
        }
        let windows = plan_windows(tokens.len(), &cfg.method, bos, cfg.chunks_limit)
            .with_context(|| format!("stream {} ({} tokens)", input.name, tokens.len()))?;
        let sha = token_ids_sha256(&tokens);
        info!("stream {}: {} tokens, {} windows", input.name, tokens.len(), windows.len());
        tracing::debug!("stream {}: token ids sha256 {sha}", input.name);
        let byte_counts = token_bytes.as_ref().map(|t| t.stream_counts(&tokens));
        if let (Some(c), Some(n_text)) = (&byte_counts, text_bytes) {
            let n_token_bytes: u64 = c.iter().map(|&b| u64::from(b)).sum();
            if n_token_bytes != n_text as u64 {
                tracing::warn!("stream {}: its tokens cover {n_token_bytes} bytes, its text has {n_text} (docs/byte-figures.md)", input.name);
            }
        }
        streams.push(Stream { name: input.name, domain: input.domain, tokens, token_ids_sha256: sha, windows, byte_counts, text_bytes });
    }
    let tokenize_seconds = t_tok.elapsed().as_secs_f64();
    // Memory and batching are sized from the whole plan, so a shard runs as the one process would.
    let sizes = PlanSizes::of(&streams);
    // --save-tokens is written and --kl-reference checked here, for the whole plan, before any scoring.
    let mut top_tokens = TopTokensRun::prepare(cfg, &artifact, corpus_info.as_ref(), &streams, bos)?;
    let shard = match cfg.shard {
        None => None,
        Some(sh) => {
            let mut info = select_shard(&mut streams, sh);
            if let Some(p) = &cfg.save_top_tokens {
                info.top_tokens = Some(std::path::absolute(p).with_context(|| format!("--save-top-tokens {}", p.display()))?.display().to_string());
            }
            Some(info)
        }
    };

    let workload = Workload {
        input: match cfg.input {
            Input::Text(_) => "text",
            Input::Tokens(_) => "tokens",
            Input::Corpus { .. } => "corpus",
        }
        .into(),
        input_path: match &cfg.input {
            Input::Text(p) | Input::Tokens(p) => Some(p.display().to_string()),
            Input::Corpus { .. } => None,
        },
        corpus: corpus_info,
        method: cfg.method.name().into(),
        context: cfg.method.context(),
        stride: cfg.method.stride(),
        chunks_limit: cfg.chunks_limit,
        prefill_chunk_tokens: cfg.prefill_chunk,
        bos: BosPolicy { add_bos: meta.tokenizer.add_bos, bos_id: bos, replace_window_first_token: bos.is_some() },
        shard,
    };

    let mut report = Report {
        schema_version: report::SCHEMA_VERSION,
        tool: ToolInfo::current(),
        artifact: ArtifactInfo::of(&artifact, cfg.verify),
        workload,
        execution: None,
        results: Results {
            overall: None,
            domains: Vec::new(),
            streams: Vec::new(),
            by_position: Vec::new(),
            kl_divergence: None,
            expert_usage: None,
            invariance: None,
            early_stop: None,
        },
        timing: Timing { load_seconds, tokenize_seconds, ..Default::default() },
        noise_floor: None,
        memory: None,
    };
    if cfg.dry_run {
        if let Some(t) = &mut top_tokens {
            t.commit_saved_tokens()?;
        }
        report.results.streams = streams.iter().map(|s| stream_result(s, None, Vec::new())).collect();
        report.timing.elapsed_seconds = started.elapsed().as_secs_f64();
        return Ok(report);
    }

    let kinds = choose_backends(cfg)?;
    let spec = match &kinds[0] {
        BackendKind::Cpu(_) => cfg.execution.clone(),
        BackendKind::Cuda { spec, .. } => spec.clone(),
    };
    info!("{}", plan_statement(cfg, &artifact, &streams, &kinds[0], top_tokens.as_ref().map(TopTokensRun::top_k)));
    let t_load = Instant::now();
    // Size memory from the model and the plan before the first window.
    let PlanSizes { n_max_window, n_most_windows } = sizes;
    let pass_tokens = cfg.prefill_chunk.min(n_max_window);
    let batch_tokens = cfg.batch_tokens.unwrap_or_else(|| crate::config::default_batch_tokens(matches!(kinds[0], BackendKind::Cuda { .. })));
    let max_seqs = windows_per_pass(batch_tokens, pass_tokens).min(n_most_windows);
    // One model copy per worker (--devices); the batch is what every worker's memory admits.
    let mut scorers = Vec::with_capacity(kinds.len());
    let mut n_seqs = max_seqs;
    for (i, kind) in kinds.into_iter().enumerate() {
        let mut scorer = load_model(&artifact, kind, cfg.execution.rope_yarn_factor).with_context(|| format!("worker {i}"))?;
        let n = scorer.prepare(n_max_window, cfg.prefill_chunk, max_seqs).with_context(|| {
            format!("windows of up to {n_max_window} tokens, prefill passes of {}, {max_seqs} windows per pass", cfg.prefill_chunk)
        })?;
        n_seqs = n_seqs.min(n);
        scorers.push(scorer);
    }
    let mut scorer = scorers.remove(0);
    if n_seqs < max_seqs {
        info!("batching {n_seqs} windows per pass ({max_seqs} would not fit the device's memory)");
    }
    report.timing.load_seconds += t_load.elapsed().as_secs_f64();
    info!("backend {} ready in {:.2} s", scorer.describe_backend(), t_load.elapsed().as_secs_f64());
    let exec = scorer.execution();
    let mut details = exec.details;
    if let serde_json::Value::Object(map) = &mut details {
        map.insert("pass_tokens".into(), cfg.prefill_chunk.min(n_max_window).into());
        map.insert("max_window_tokens".into(), n_max_window.into());
        map.insert("passes_per_max_window".into(), n_max_window.div_ceil(cfg.prefill_chunk).into());
        map.insert("batch_tokens".into(), batch_tokens.into());
        map.insert("windows_per_pass".into(), n_seqs.into());
    }
    report.execution = Some(Execution {
        backend: exec.backend,
        device: exec.device,
        route: exec.route,
        threads: cfg.threads,
        spec,
        details,
    });
    let checkpoints = match &cfg.resume {
        None => None,
        Some(dir) => {
            let execution = report.execution.as_ref().context("execution is recorded before scoring")?;
            let plan = ResumePlan {
                save_top_tokens: cfg.save_top_tokens.is_some(),
                kl_reference_sha256: top_tokens.as_ref().and_then(TopTokensRun::reference).map(|r| r.sha256.clone()),
                schema_version: report::SCHEMA_VERSION,
                artifact_digest: artifact.digest.clone(),
                workload: report.workload.clone(),
                backend: execution.backend.clone(),
                route: execution.route.clone(),
                spec: execution.spec.clone(),
                details: execution.details.clone(),
                streams: streams
                    .iter()
                    .map(|s| PlanStream { name: s.name.clone(), token_ids_sha256: s.token_ids_sha256.clone(), n_windows: s.windows.len() })
                    .collect(),
            };
            let c = Checkpoints::open(dir, &plan, artifact.meta.hparams.moe.is_some())?;
            info!("--resume {}: {} of {} windows already scored", dir.display(), c.n_done(), streams.iter().map(|s| s.windows.len()).sum::<usize>());
            if c.n_orphans() > 0 {
                info!("--resume {}: {} checkpoints of passes cut short are scored again (their expert counts were not saved)", dir.display(), c.n_orphans());
            }
            Some(c)
        }
    };
    if let Some(t) = &mut top_tokens {
        let producer = serde_json::json!({
            "tool": report.tool,
            "model": artifact.meta.public_name,
            "artifact_digest": artifact.digest,
            "backend": scorer.describe_backend(),
        });
        t.set_producer(producer);
    }

    let t_score = Instant::now();
    let n_workers = scorers.len() + 1;
    // --save-top-tokens: where each worker's records go; `joined` are the parts to join into the file.
    let mut parts = Vec::with_capacity(n_workers);
    let mut joined: Vec<(String, std::path::PathBuf)> = Vec::new();
    let mut scratch = RemoveOnDrop(Vec::new());
    if let Some(t) = &top_tokens {
        for i in 0..n_workers {
            let mine = if n_workers > 1 { worker_windows(&streams, i, n_workers) } else { streams.clone() };
            let file = match (t.save_path(), &checkpoints) {
                (None, _) => None,
                (Some(_), Some(c)) => Some(PartFile::PerWindow(c.dir().to_path_buf())),
                (Some(path), None) if n_workers == 1 => Some(PartFile::Whole(path.to_path_buf())),
                (Some(path), None) => {
                    let p = std::path::PathBuf::from(format!("{}.worker{i}-{}", path.display(), std::process::id()));
                    joined.push((format!("worker {i}'s top tokens"), p.clone()));
                    scratch.0.push(p.clone());
                    Some(PartFile::Whole(p))
                }
            };
            parts.push(Some(t.part(&mine, file)?));
        }
        if let (Some(_), Some(c)) = (t.save_path(), &checkpoints) {
            for (si, s) in streams.iter().enumerate() {
                joined.extend(s.windows.iter().map(|w| (format!("--resume top tokens of stream '{}' window {}", s.name, w.index), crate::resume::top_tokens_file(c.dir(), si, w.index))));
            }
        }
    } else {
        parts.resize_with(n_workers, || None);
    }
    let (stats, mut window_results) = if let Some(x) = cfg.target_uncertainty {
        let (out, e) = score_early_stop(&streams, scorer.as_mut(), bos, cfg.prefill_chunk, x, parts[0].as_mut(), on_event)?;
        report.results.early_stop = Some(e);
        out
    } else if scorers.is_empty() {
        score_streams(&streams, scorer.as_mut(), bos, cfg.prefill_chunk, n_seqs, parts[0].as_mut(), checkpoints.as_ref(), on_event)?
    } else {
        scorers.insert(0, scorer);
        let out = score_on_workers(&streams, &mut scorers, bos, cfg.prefill_chunk, n_seqs, &mut parts, checkpoints.as_ref(), on_event)?;
        scorer = scorers.remove(0);
        out
    };
    let scoring_seconds = t_score.elapsed().as_secs_f64();
    // Before the noise-floor rescoring, which would count its windows again.
    // --resume: the passes read back count too.
    let usages = std::iter::once(&scorer).chain(scorers.iter()).map(|s| s.expert_usage()).collect::<Result<Vec<_>>>().context("expert usage")?;
    let resumed = checkpoints.as_ref().and_then(Checkpoints::resumed_usage);
    report.results.expert_usage = ExpertUsage::sum(usages.iter().map(Option::as_ref).chain([resumed]))?;
    if let Some(n) = cfg.verify_invariance {
        let v = verify_invariance(n, &streams, &window_results, scorer.as_mut(), bos, cfg.prefill_chunk, n_seqs, meta.hparams.n_vocab)?;
        info!(
            "batch invariance ({} windows, {} targets alone vs batched): max |dNLL| {:.3e} nats, mean KL {:.3e}, max KL {:.3e}, {} top-1 changes",
            v.n_windows, v.n_targets, v.max_abs_dnll, v.mean_kl, v.max_kl, v.n_top1_changed
        );
        report.results.invariance = Some(v);
    }
    if cfg.noise_floor {
        report.noise_floor = Some(noise_floor(cfg, &streams, &stats, scorer.as_mut(), bos, n_seqs, on_event)?);
    }
    signal::check().context("stopped after scoring every window; no report written")?;
    // Every KL figure pooled from the windows in plan order (as `merge` pools shards' windows).
    let mut stream_kl = vec![None; streams.len()];
    let mut kl_by_position = None;
    if let Some(info) = top_tokens.as_ref().and_then(TopTokensRun::reference) {
        let windows: Vec<&[WindowResult]> = window_results.iter().map(Vec::as_slice).collect();
        let names: Vec<&str> = streams.iter().map(|s| s.name.as_str()).collect();
        let (per_stream, mut kl, by_position) = crate::top_tokens::pool_kl(&windows, &names, info.clone())?;
        report::worst::add_excerpts(&mut kl, &tokenizer, |name| streams.iter().find(|s| s.name == name).map(|s| s.tokens.as_slice()));
        crate::top_tokens::log_kl_summary(&kl);
        stream_kl = per_stream.into_iter().map(Some).collect();
        kl_by_position = Some(by_position);
        report.results.kl_divergence = Some(kl);
    }
    // A shard's report keeps each window's KL detail for `merge`; a whole run's does not.
    if report.workload.shard.is_none() {
        window_results.iter_mut().flatten().for_each(|w| w.kl_detail = None);
    }
    // The --save-tokens and --save-top-tokens files are renamed into place here, just before the report.
    for p in parts.into_iter().flatten() {
        p.finish()?;
    }
    if let Some(t) = &mut top_tokens {
        if let (Some(path), false) = (t.save_path(), joined.is_empty()) {
            crate::score::topk::join_files(&joined, &t.header_for(&streams), path).with_context(|| format!("--save-top-tokens {}", path.display()))?;
            info!("joined {} parts into {}", joined.len(), path.display());
        }
        t.commit_saved_tokens()?;
    }
    drop(scratch);

    let overall = overall_summary(&stats);
    report.results.domains = domain_summaries(&stats)
        .into_iter()
        .map(|(domain, summary)| DomainResult {
            streams: stats.iter().filter(|s| s.domain == domain).count(),
            bytes: None,
            domain,
            summary,
        })
        .collect();
    report.results.streams = streams
        .iter()
        .zip(stats.iter().zip(window_results).zip(stream_kl))
        .map(|(s, ((st, w), kl))| StreamResult { kl_divergence: kl, ..stream_result(s, Some(st.summary()), w) })
        .collect();
    let n_processed: usize = stats.iter().flat_map(|s| &s.windows).map(|w| w.input_tokens).sum();
    report.timing = Timing {
        elapsed_seconds: started.elapsed().as_secs_f64(),
        scoring_seconds,
        tokens_processed: n_processed,
        tokens_scored: overall.scored_tokens,
        tokens_per_second_processed: (scoring_seconds > 0.0).then(|| n_processed as f64 / scoring_seconds),
        tokens_per_second_scored: (scoring_seconds > 0.0).then(|| overall.scored_tokens as f64 / scoring_seconds),
        ..report.timing
    };
    let devices = std::iter::once(&scorer).chain(scorers.iter()).map(|s| s.device_memory()).collect::<Result<Vec<_>>>()?;
    report.memory = Some(report::MemoryPeaks::now(devices.into_iter().flatten().collect()));
    report.results.overall = Some(Overall { summary: overall, bytes: None });
    report::pool_window_figures(&mut report.results, kl_by_position);
    Ok(report)
}

/// Files removed when dropped (the workers' top-tokens parts once joined, or after a failure).
struct RemoveOnDrop(Vec<std::path::PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        for p in &self.0 {
            // Best effort: a part that was never written is not there.
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The plan-wide sizes memory and batching are computed from.
#[derive(Clone, Copy, Debug)]
struct PlanSizes {
    /// Tokens of the longest window.
    n_max_window: usize,
    /// Windows of the stream with the most.
    n_most_windows: usize,
}

impl PlanSizes {
    fn of(streams: &[Stream]) -> Self {
        PlanSizes {
            n_max_window: streams.iter().flat_map(|s| &s.windows).map(|w| w.end - w.begin).max().unwrap_or(1),
            n_most_windows: streams.iter().map(|s| s.windows.len()).max().unwrap_or(1).max(1),
        }
    }
}

/// Keeps only `shard`'s windows in `streams` (numbered in plan order, see
/// [`Shard`]) and returns what the report records of the split.
fn select_shard(streams: &mut [Stream], shard: Shard) -> ShardInfo {
    let n_windows: Vec<usize> = streams.iter().map(|s| s.windows.len()).collect();
    select_windows(streams, shard);
    let n_mine: usize = streams.iter().map(|s| s.windows.len()).sum();
    info!("shard {}/{}: {n_mine} of {} windows", shard.index, shard.count, n_windows.iter().sum::<usize>());
    ShardInfo { index: shard.index, count: shard.count, n_windows, top_tokens: None }
}

/// Keeps only the windows `part` takes, numbering windows in plan order
/// (the split of `--shard` and of `--devices`).
fn select_windows(streams: &mut [Stream], part: Shard) {
    let mut g = 0;
    for s in streams.iter_mut() {
        s.windows.retain(|_| {
            let keep = part.takes(g);
            g += 1;
            keep
        });
    }
}

enum Content {
    Text(String),
    Tokens(Vec<u32>),
}

struct InputStream {
    name: String,
    domain: String,
    content: Content,
}

fn file_name(p: &Path) -> String {
    p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// Reads every stream (checksums included) before any scoring.
fn read_inputs(cfg: &RunConfig) -> Result<(Vec<InputStream>, Option<CorpusInfo>)> {
    Ok(match &cfg.input {
        Input::Text(p) => (
            vec![InputStream { name: file_name(p), domain: "text".into(), content: Content::Text(corpus::read_text_file(p)?) }],
            None,
        ),
        Input::Tokens(p) => (
            vec![InputStream { name: file_name(p), domain: "tokens".into(), content: Content::Tokens(corpus::read_tokens_file(p)?) }],
            None,
        ),
        Input::Corpus { manifest, quick, data_root } => {
            let (m, files) = corpus::open_corpus(manifest.as_deref(), data_root.as_deref())?;
            let mut out = Vec::new();
            for spec in corpus::select(&m, *quick) {
                let text = files.read(spec)?;
                out.push(InputStream { name: spec.id.clone(), domain: spec.domain.clone(), content: Content::Text(text) });
            }
            let info = CorpusInfo {
                name: m.name.clone(),
                manifest: manifest.as_ref().map_or_else(|| corpus::BUNDLED_MANIFEST.to_string(), |p| p.display().to_string()),
                manifest_sha256: m.sha256.clone(),
                quick: *quick,
                data_root: files.describe(),
            };
            (out, Some(info))
        }
    })
}

/// Refuses a window longer than the model was trained for, times the YaRN
/// factor (issue 16, item 7), and an artifact that records no trained context.
fn check_trained_context(context: usize, trained: usize, yarn_factor: f64) -> Result<()> {
    if trained == 0 {
        bail!("the artifact records a trained context (context_length) of 0: cannot check --context {context}; re-convert it with the model's context length");
    }
    let ceiling = (trained as f64 * yarn_factor).floor() as usize;
    if context > ceiling {
        bail!(
            "--context {context} exceeds the model's trained context {trained} x --rope-yarn-factor {yarn_factor} = {ceiling}; \
             lower --context or raise --rope-yarn-factor (at most 4)"
        );
    }
    Ok(())
}

/// The backend of each worker and the spec it runs under
/// (`RunConfig::execution` on the CPU, `RunConfig::spec_for_cuda` on CUDA):
/// one per `--devices` entry, else one on `--device`.
fn choose_backends(cfg: &RunConfig) -> Result<Vec<BackendKind>> {
    let cuda = match cfg.backend {
        BackendChoice::Cpu => false,
        BackendChoice::Cuda { .. } => true,
        BackendChoice::Auto => crate::backend::cuda_available(),
    };
    let devices = if cfg.devices.is_empty() { vec![cfg.device] } else { cfg.devices.clone() };
    devices
        .into_iter()
        .map(|device| {
            Ok(if cuda {
                BackendKind::Cuda { device, spec: cfg.spec_for_cuda() }
            } else {
                if device != 0 {
                    bail!("--devices: device {device} on the CPU backend (the CPU is device 0)");
                }
                BackendKind::Cpu(CpuBackend::from_spec(&cfg.execution)?)
            })
        })
        .collect()
}

/// `--devices`: scores the windows on several workers at once, one host
/// thread each. Window `g` of the plan (stream order, then window order) goes
/// to worker `g % n`, a fixed hand-out; each worker runs [`score_streams`] on
/// its windows, and the results are joined per stream in window order, so
/// every pooled figure is that of one worker scoring them all (as `merge`
/// joins shards).
#[allow(clippy::too_many_arguments)]
fn score_on_workers(
    streams: &[Stream],
    scorers: &mut [Box<dyn WindowScorer>],
    bos: Option<u32>,
    prefill_chunk: usize,
    n_seqs: usize,
    top_tokens: &mut [Option<TopTokensPart<'_>>],
    checkpoints: Option<&Checkpoints>,
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<StreamScores> {
    let n = scorers.len();
    let parts: Vec<Vec<Stream>> = (0..n).map(|i| worker_windows(streams, i, n)).collect();
    on_event(Event::Scoring { n_targets: streams.iter().flat_map(|s| &s.windows).map(Window::scored).sum() });
    let (tx, rx) = std::sync::mpsc::channel::<(String, usize)>();
    let outs: Vec<Result<StreamScores>> = std::thread::scope(|scope| {
        let handles: Vec<_> = scorers
            .iter_mut()
            .zip(&parts)
            .zip(top_tokens.iter_mut())
            .enumerate()
            .map(|(i, ((scorer, part), top))| {
                let tx = tx.clone();
                scope.spawn(move || {
                    let mut events = |e: Event<'_>| {
                        if let Event::Pass { stream, n_scored } = e {
                            // The receiver lives until every worker ended.
                            let _ = tx.send((stream.to_string(), n_scored));
                        }
                    };
                    score_streams(part, scorer.as_mut(), bos, prefill_chunk, n_seqs, top.as_mut(), checkpoints, &mut events)
                        .with_context(|| format!("worker {i}"))
                })
            })
            .collect();
        drop(tx);
        for (stream, n_scored) in rx {
            on_event(Event::Pass { stream: &stream, n_scored });
        }
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a scoring worker panicked")))).collect()
    });
    let outs: Vec<StreamScores> = outs.into_iter().collect::<Result<_>>()?;
    let mut all_stats = Vec::with_capacity(streams.len());
    let mut all_windows = Vec::with_capacity(streams.len());
    for (si, s) in streams.iter().enumerate() {
        let mut windows: Vec<WindowResult> = outs.iter().flat_map(|(_, w)| w[si].iter().cloned()).collect();
        windows.sort_by_key(|w| w.index);
        if windows.len() != s.windows.len() {
            bail!("stream {}: the workers returned {} of its {} windows", s.name, windows.len(), s.windows.len());
        }
        let st = StreamStats { id: s.name.clone(), domain: s.domain.clone(), windows: windows.iter().map(WindowResult::stats).collect() };
        on_event(Event::Stream { stream: &s.name, summary: &st.summary(), seconds: 0.0 });
        all_stats.push(st);
        all_windows.push(windows);
    }
    on_event(Event::Scored);
    Ok((all_stats, all_windows))
}

/// Worker `i` of `n`'s windows (`--devices`): window `g` of the plan goes to worker `g % n`.
fn worker_windows(streams: &[Stream], i: usize, n: usize) -> Vec<Stream> {
    let mut part = streams.to_vec();
    select_windows(&mut part, Shard { index: i, count: n });
    part
}

fn stream_result(s: &Stream, summary: Option<Summary>, windows: Vec<WindowResult>) -> StreamResult {
    StreamResult {
        name: s.name.clone(),
        domain: s.domain.clone(),
        n_tokens: s.tokens.len(),
        token_ids_sha256: s.token_ids_sha256.clone(),
        summary,
        text_bytes: s.text_bytes,
        token_bytes: s.byte_counts.as_ref().map(|c| c.iter().map(|&b| u64::from(b)).sum()),
        bytes: None,
        kl_divergence: None,
        windows,
    }
}

/// Effective matrix-product throughput (FLOP/s) behind the time estimate of
/// [`plan_statement`], measured: the CUDA backend's default route ran SmolLM2
/// chunks c=512 at 150,837 tokens/s on an H200 (docs/performance.md), i.e.
/// about 4.1e13 FLOP/s at 2.69e8 FLOP a token; the CPU backend ran the README's
/// first command (SmolLM2, 10,240 tokens) at 115 tokens/s on 2 threads of a
/// shared 2-core machine, about 1.5e10 FLOP/s a thread.
const CUDA_FLOPS: f64 = 4.1e13;
const CPU_FLOPS_PER_THREAD: f64 = 1.5e10;

/// The plan stated on stderr before scoring: windows, tokens, an estimated
/// time (matrix-product FLOPs of the tokens evaluated over a measured
/// throughput of the backend; attention's cost, which grows with the window,
/// is left out, so long windows take longer) and the size of any top-tokens
/// file to be written (`docs/top-tokens.md`: 8 + 8K bytes a scored position,
/// about 140 a window, 48 of trailer).
fn plan_statement(cfg: &RunConfig, artifact: &Artifact, streams: &[Stream], kind: &BackendKind, top_k: Option<usize>) -> String {
    let windows = || streams.iter().flat_map(|s| &s.windows);
    let n_windows = windows().count();
    let n_input: usize = windows().map(Window::n_input).sum();
    let n_scored: usize = windows().map(Window::scored).sum();
    let h = &artifact.meta.hparams;
    let per_layer = h.d_model * (h.n_heads * h.d_head + 2 * h.n_kv_heads * h.d_head)
        + h.n_heads * h.d_head_v * h.d_model
        + 3 * h.d_model * h.d_ffn;
    let flop_per_token = 2.0 * (h.n_layers * per_layer + h.d_model * h.n_vocab) as f64;
    let (rate, on) = match kind {
        BackendKind::Cpu(_) => (CPU_FLOPS_PER_THREAD * cfg.threads as f64, format!("the CPU with {} threads", cfg.threads)),
        BackendKind::Cuda { .. } => (CUDA_FLOPS, "an H200-class GPU".to_string()),
    };
    let seconds = n_input as f64 * flop_per_token / rate;
    let mut line = format!(
        "plan: {} streams, {n_windows} windows ({}), {n_input} tokens evaluated, {n_scored} scored; \
         estimated {seconds:.0} s on {on} ({:.2e} FLOP a token at {rate:.1e} FLOP/s, a measured rate; attention not counted)",
        streams.len(),
        cfg.method.name(),
        flop_per_token
    );
    if let (Some(k), Some(path)) = (top_k, &cfg.save_top_tokens) {
        let bytes = n_scored * (8 + 8 * k) + n_windows * 140 + 48;
        line.push_str(&format!("; writes about {:.1} MB to {}", bytes as f64 / 1e6, path.display()));
    }
    line
}

/// Per stream: its window statistics and its report windows.
type StreamScores = (Vec<StreamStats>, Vec<Vec<WindowResult>>);

/// `--noise-floor`: scores every window again with another prefill chunk and
/// pairs the result with the reported scores (`stats`).
fn noise_floor(
    cfg: &RunConfig,
    streams: &[Stream],
    stats: &[StreamStats],
    scorer: &mut dyn WindowScorer,
    bos: Option<u32>,
    n_seqs: usize,
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<NoiseFloor> {
    let longest = streams.iter().flat_map(|s| &s.windows).map(|w| w.end - w.begin).max().unwrap_or(0);
    let alternate = alternate_prefill_chunk(cfg.prefill_chunk, longest);
    info!("noise floor: scoring every window again with prefill chunk {alternate} (reported: {})", cfg.prefill_chunk);
    // No more rows per pass than the memory check admitted for the reported run.
    let rows_checked = n_seqs * cfg.prefill_chunk.min(longest.max(1));
    let n_seqs_again = windows_per_pass(rows_checked, alternate.min(longest.max(1))).min(n_seqs);
    let t = Instant::now();
    let (again, _) = score_streams(streams, scorer, bos, alternate, n_seqs_again, None, None, on_event)?;
    let seconds = t.elapsed().as_secs_f64();
    let mut rows = Vec::new();
    let mut n_excluded = 0;
    for (a, b) in stats.iter().zip(&again) {
        for (wa, wb) in a.windows.iter().zip(&b.windows) {
            if wa.n_nonfinite > 0 || wb.n_nonfinite > 0 {
                n_excluded += 1;
                continue;
            }
            let w = PairedWindow { n_scored: wa.scored_tokens, base_nll_sum: wa.nll_sum, new_nll_sum: wb.nll_sum };
            rows.push((a.domain.clone(), w));
        }
    }
    let f = crate::score::floor::noise_floor(&rows, n_excluded, cfg.prefill_chunk, alternate, longest, seconds);
    info!(
        "noise floor: {}; PPL change {:+.3e} %, floor {:.3e} % ({:.1} s)",
        f.note, f.overall.ppl_change_pct, f.floor_pct, seconds
    );
    Ok(f)
}

/// How many windows of passes of `pass_tokens` rows share one pass within
/// `row_budget` rows (at least one).
fn windows_per_pass(row_budget: usize, pass_tokens: usize) -> usize {
    (row_budget / pass_tokens.max(1)).max(1)
}

/// Scores every window of every stream, up to `n_seqs` consecutive windows
/// of equal length per batched pass (a stream's windows only; results are
/// per window either way).
fn score_streams(
    streams: &[Stream],
    scorer: &mut dyn WindowScorer,
    bos: Option<u32>,
    prefill_chunk: usize,
    n_seqs: usize,
    mut top_tokens: Option<&mut TopTokensPart<'_>>,
    checkpoints: Option<&Checkpoints>,
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<StreamScores> {
    let top_k = top_tokens.as_ref().map_or(0, |t| t.top_k());
    let opts = ScoreOptions { top_k, prefill_chunk: Some(prefill_chunk) };
    let n_total: usize = streams.iter().flat_map(|s| &s.windows).map(Window::scored).sum();
    on_event(Event::Scoring { n_targets: n_total });
    let mut all_stats = Vec::with_capacity(streams.len());
    let mut all_windows = Vec::with_capacity(streams.len());
    for (si, s) in streams.iter().enumerate() {
        let mut results: Vec<WindowResult> = Vec::with_capacity(s.windows.len());
        let t_stream = Instant::now();
        let at = |w: &Window| format!("stream {} window {} [{}, {})", s.name, w.index, w.begin, w.end);
        // --resume: windows already checkpointed are taken as recorded, the rest scored.
        let mut pending = Vec::with_capacity(s.windows.len());
        for w in &s.windows {
            match checkpoints.and_then(|c| c.get(si, w.index)) {
                Some(r) => {
                    if (r.begin, r.end, r.first_target, r.scored) != (w.begin, w.end, w.first_target, w.scored()) {
                        bail!("--resume: the checkpoint of {} covers [{}, {}) from {}", at(w), r.begin, r.end, r.first_target);
                    }
                    results.push(r);
                }
                None => pending.push(*w),
            }
        }
        if !results.is_empty() {
            on_event(Event::Pass { stream: &s.name, n_scored: results.iter().map(|r| r.scored).sum() });
        }
        for batch in equal_length_batches(&pending, n_seqs) {
            signal::check().with_context(|| {
                let n_done: usize = all_stats.iter().map(|st: &StreamStats| st.windows.len()).sum::<usize>() + results.len();
                let n_windows: usize = streams.iter().map(|s| s.windows.len()).sum();
                format!("stopped after {n_done} of {n_windows} windows (at stream {}); no report written", s.name)
            })?;
            let mut tokens = Vec::with_capacity(batch.len());
            let mut extra_ids = Vec::with_capacity(batch.len());
            for w in batch {
                tokens.push(window_tokens(&s.tokens, w, bos)?);
                extra_ids.push(match top_tokens.as_mut() {
                    Some(t) => t.begin_window(si, w).with_context(|| at(w))?,
                    None => Vec::new(),
                });
            }
            let inputs: Vec<WindowInput> = batch
                .iter()
                .zip(&tokens)
                .zip(&extra_ids)
                .map(|((w, t), e)| WindowInput { tokens: t, first_target: w.first_target - w.begin, extra_ids: e })
                .collect();
            // --resume: the pass's expert counts (mixture-of-experts models) go with its checkpoints.
            let usage_before = if checkpoints.is_some() { scorer.expert_usage().context("expert usage before a pass")? } else { None };
            let t = Instant::now();
            let batch_scores = scorer.score_windows(&inputs, &opts).with_context(|| match batch {
                [w] => at(w),
                [a, .., b] => format!("{} .. {} (one batched pass)", at(a), at(b)),
                [] => String::new(),
            })?;
            // The batch's wall time, shared evenly by its windows.
            let seconds = t.elapsed().as_secs_f64() / batch.len() as f64;
            let n_before = results.len();
            for ((w, tokens), scores) in batch.iter().zip(&tokens).zip(batch_scores) {
                let window_kl = match top_tokens.as_mut() {
                    Some(t) => t.end_window(si, &s.name, w, &scores).with_context(|| at(w))?,
                    None => None,
                };
                let nll: Vec<f64> = scores.iter().map(|r| r.nll).collect();
                results.push(window_result(s, w, tokens, nll, seconds, window_kl));
            }
            if let Some(c) = checkpoints {
                let usage = match &usage_before {
                    Some(before) => Some(scorer.expert_usage()?.context("expert usage after a pass")?.since(before)?),
                    None => None,
                };
                c.save_pass(si, &s.name, &results[n_before..], usage)?;
            }
            // Once per pass, after all its windows: the line counts every finished window.
            on_event(Event::Pass { stream: &s.name, n_scored: batch.iter().map(Window::scored).sum::<usize>() });
        }
        results.sort_by_key(|r| r.index);
        let stats: Vec<WindowStats> = results.iter().map(WindowResult::stats).collect();
        let st = StreamStats { id: s.name.clone(), domain: s.domain.clone(), windows: stats };
        on_event(Event::Stream { stream: &s.name, summary: &st.summary(), seconds: t_stream.elapsed().as_secs_f64() });
        all_stats.push(st);
        all_windows.push(results);
    }
    on_event(Event::Scored);
    Ok((all_stats, all_windows))
}

/// A window's entry in report.json from its NLLs (its byte figures and
/// position-bucket sums included).
fn window_result(s: &Stream, w: &Window, tokens: &[u32], nll: Vec<f64>, seconds: f64, kl: Option<(WindowKl, KlDetail)>) -> WindowResult {
    let (kl_divergence, kl_detail) = kl.unzip();
    let wb = s.byte_counts.as_ref().map(|c| WindowBytes::of(&c[w.first_target..w.end], &nll));
    let by_position = window_sums(w.first_target - w.begin, &nll);
    let ws = WindowScores { input_tokens: tokens.len(), nll }.stats();
    WindowResult {
        index: w.index,
        begin: w.begin,
        end: w.end,
        first_target: w.first_target,
        scored: ws.scored_tokens,
        tokens_sha256: report::window_tokens_sha256(tokens),
        input_tokens: ws.input_tokens,
        n_nonfinite: ws.n_nonfinite,
        nll_sum: ws.nll_sum,
        nll_sq_sum: ws.nll_sq_sum,
        mean_nll: ws.mean_nll(),
        perplexity: ws.perplexity(),
        seconds,
        bytes: wb.as_ref().map(|b| ByteSummary::over([b])),
        by_position,
        kl_divergence,
        kl_detail,
    }
}

/// `--target-uncertainty X`: scores windows one per pass in the seeded order
/// of `score::early_stop` until the 95 % half-width of the overall mean NLL
/// (of the mean KL with `--kl-reference`: `top_tokens` compares) is below X;
/// returns the scored windows per stream, in plan order.
fn score_early_stop(
    streams: &[Stream],
    scorer: &mut dyn WindowScorer,
    bos: Option<u32>,
    prefill_chunk: usize,
    target: f64,
    mut top_tokens: Option<&mut TopTokensPart<'_>>,
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<(StreamScores, EarlyStop)> {
    let on_kl = top_tokens.as_ref().is_some_and(|t| t.top_k() > 0);
    let statistic = if on_kl { "mean KL" } else { "mean NLL" };
    let opts = ScoreOptions { top_k: top_tokens.as_ref().map_or(0, |t| t.top_k()), prefill_chunk: Some(prefill_chunk) };
    let order = early_stop::order(&streams.iter().map(|s| s.windows.len()).collect::<Vec<_>>());
    let n_planned = order.len();
    on_event(Event::Scoring { n_targets: streams.iter().flat_map(|s| &s.windows).map(Window::scored).sum() });
    // Per stream, per window: its result (None: not scored).
    let mut slots: Vec<Vec<Option<WindowResult>>> = streams.iter().map(|s| vec![None; s.windows.len()]).collect();
    let mut scored: Vec<WindowStats> = Vec::new();
    let mut scored_kl = Vec::new();
    let mut half = None;
    for &(si, wi) in &order {
        let (s, w) = (&streams[si], &streams[si].windows[wi]);
        let at = || format!("stream {} window {} [{}, {})", s.name, w.index, w.begin, w.end);
        signal::check().with_context(|| format!("stopped after {} of {n_planned} windows (early-stop order); no report written", scored.len()))?;
        let tokens = window_tokens(&s.tokens, w, bos)?;
        let extra_ids = match top_tokens.as_mut() {
            Some(t) => t.begin_window(si, w).with_context(at)?,
            None => Vec::new(),
        };
        let input = WindowInput { tokens: &tokens, first_target: w.first_target - w.begin, extra_ids: &extra_ids };
        let t = Instant::now();
        let scores = scorer.score_windows(&[input], &opts).with_context(at)?.pop().context("the backend returned no scores")?;
        let seconds = t.elapsed().as_secs_f64();
        let kl = match top_tokens.as_mut() {
            Some(t) => t.end_window(si, &s.name, w, &scores).with_context(at)?,
            None => None,
        };
        if let Some((record, _)) = &kl {
            scored_kl.push(record.sums.clone());
        }
        let r = window_result(s, w, &tokens, scores.iter().map(|x| x.nll).collect(), seconds, kl);
        scored.push(r.stats());
        slots[si][wi] = Some(r);
        on_event(Event::Pass { stream: &s.name, n_scored: w.scored() });
        half = if on_kl { early_stop::kl_half_width(scored_kl.iter()) } else { early_stop::half_width(&scored) };
        if half.is_some_and(|h| h < target) {
            break;
        }
    }
    let n_scored = scored.len();
    let reason = match half {
        Some(h) if h < target => format!(
            "the 95 % half-width of the overall {statistic}, {h:.3e} nats (window-clustered), fell below --target-uncertainty {target} after {n_scored} of {n_planned} windows"
        ),
        Some(h) => format!("every window was scored; the 95 % half-width is {h:.3e} nats, not below --target-uncertainty {target}"),
        None => format!("every window was scored; {n_scored} windows are too few for the rule (at least {})", early_stop::MIN_WINDOWS),
    };
    info!("early stop: {reason}");
    let (mut all_stats, mut all_windows) = (Vec::new(), Vec::new());
    for (s, slot) in streams.iter().zip(slots) {
        let results: Vec<WindowResult> = slot.into_iter().flatten().collect();
        let st = StreamStats { id: s.name.clone(), domain: s.domain.clone(), windows: results.iter().map(WindowResult::stats).collect() };
        on_event(Event::Stream { stream: &s.name, summary: &st.summary(), seconds: 0.0 });
        all_stats.push(st);
        all_windows.push(results);
    }
    on_event(Event::Scored);
    let info = EarlyStop {
        target_half_width: target,
        statistic: statistic.into(),
        order: format!("seeded permutation of all {n_planned} windows (ChaCha8, seed {:#x}), one window per pass", early_stop::SEED),
        seed: early_stop::SEED,
        min_windows: early_stop::MIN_WINDOWS,
        n_windows_planned: n_planned,
        n_windows_scored: n_scored,
        stopped_early: n_scored < n_planned,
        reason,
        half_width: half,
    };
    Ok(((all_stats, all_windows), info))
}

/// `--verify-invariance N`: the first N windows of the plan rescored batched
/// (as the run batches them, the run's top-k ids asked for) and alone (one
/// window, prefill chunk = its length), compared target by target
/// (`score::invariance`); `results` are the run's own windows.
#[allow(clippy::too_many_arguments)]
fn verify_invariance(
    n_max: usize,
    streams: &[Stream],
    results: &[Vec<WindowResult>],
    scorer: &mut dyn WindowScorer,
    bos: Option<u32>,
    prefill_chunk: usize,
    n_seqs: usize,
    n_vocab: usize,
) -> Result<Invariance> {
    let k = crate::score::topk::TOP_K.min(n_vocab);
    let covers_vocab = k == n_vocab;
    let mut acc = InvarianceAcc::default();
    let mut n_left = n_max;
    for (s, run) in streams.iter().zip(results) {
        if n_left == 0 {
            break;
        }
        let take = n_left.min(s.windows.len());
        n_left -= take;
        for batch in equal_length_batches(&s.windows[..take], n_seqs) {
            let tokens: Vec<Vec<u32>> = batch.iter().map(|w| window_tokens(&s.tokens, w, bos)).collect::<Result<_>>()?;
            let inputs: Vec<WindowInput> = batch
                .iter()
                .zip(&tokens)
                .map(|(w, t)| WindowInput { tokens: t, first_target: w.first_target - w.begin, extra_ids: &[] })
                .collect();
            let batched = scorer
                .score_windows(&inputs, &ScoreOptions { top_k: k, prefill_chunk: Some(prefill_chunk) })
                .with_context(|| format!("--verify-invariance: stream {} batched rescore", s.name))?;
            for ((w, t), b) in batch.iter().zip(&tokens).zip(batched) {
                let records: Vec<TopRecord> = b.iter().map(|sc| record_of(sc, k, covers_vocab)).collect::<Result<_>>()?;
                let extra: Vec<Vec<u32>> = records.iter().map(|r| r.ids.clone()).collect();
                let one = WindowInput { tokens: t, first_target: w.first_target - w.begin, extra_ids: &extra };
                let alone = scorer
                    .score_windows(&[one], &ScoreOptions { top_k: 1, prefill_chunk: Some(t.len()) })
                    .with_context(|| format!("--verify-invariance: stream {} window {} alone", s.name, w.index))?
                    .pop()
                    .context("the backend returned no scores")?;
                let targets: Vec<(f64, f64, crate::score::kl::PositionKl)> = alone
                    .iter()
                    .zip(&b)
                    .zip(&records)
                    .enumerate()
                    .map(|(j, ((a, bs), rec))| (a.nll, bs.nll, compare_with_record(rec, a, covers_vocab, w.first_target + j - w.begin)))
                    .collect();
                let batched_sum = WindowScores { input_tokens: t.len(), nll: b.iter().map(|x| x.nll).collect() }.stats().nll_sum;
                let run_sum = run.iter().find(|r| r.index == w.index).map_or(f64::NAN, |r| r.nll_sum);
                acc.add_window(&s.name, w.index, w.first_target, &targets, batched_sum, run_sum);
            }
        }
    }
    Ok(acc.finish(n_seqs, prefill_chunk))
}

/// Splits `windows` into runs of consecutive windows of equal length, at most
/// `n_max` each, in order.
fn equal_length_batches(windows: &[Window], n_max: usize) -> Vec<&[Window]> {
    let mut out = Vec::new();
    let mut rest = windows;
    while let Some(w0) = rest.first() {
        let len = w0.end - w0.begin;
        let n = rest.iter().take(n_max.max(1)).take_while(|w| w.end - w.begin == len).count();
        let (batch, tail) = rest.split_at(n);
        out.push(batch);
        rest = tail;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(index: usize, begin: usize, end: usize) -> Window {
        Window { index, begin, end, first_target: begin + 1, replace_first_with_bos: false }
    }

    #[test]
    fn trained_context_is_checked() {
        assert!(check_trained_context(8192, 8192, 1.0).is_ok());
        let e = check_trained_context(8193, 8192, 1.0).unwrap_err().to_string();
        assert!(e.contains("8193") && e.contains("8192") && e.contains("--rope-yarn-factor"), "{e}");
        assert!(check_trained_context(65536, 32768, 2.0).is_ok());
        assert!(check_trained_context(65537, 32768, 2.0).is_err());
        let e = check_trained_context(512, 0, 1.0).unwrap_err().to_string();
        assert!(e.contains("context_length") && e.contains("0"), "{e}");
    }

    #[test]
    fn batches_are_consecutive_equal_length_runs() {
        let ws = [w(0, 0, 8), w(1, 4, 12), w(2, 8, 16), w(3, 12, 18), w(4, 16, 24)];
        let sizes: Vec<Vec<usize>> = equal_length_batches(&ws, 2).iter().map(|b| b.iter().map(|w| w.index).collect()).collect();
        assert_eq!(sizes, vec![vec![0, 1], vec![2], vec![3], vec![4]]);
        assert_eq!(equal_length_batches(&ws, 1).len(), 5);
        assert_eq!(equal_length_batches(&ws, 16).iter().map(|b| b.len()).collect::<Vec<_>>(), vec![3, 1, 1]);
        assert!(equal_length_batches(&[], 4).is_empty());
        assert_eq!(windows_per_pass(8192, 512), 16);
        assert_eq!(windows_per_pass(8192, 1024), 8);
        assert_eq!(windows_per_pass(100, 1024), 1);
    }
}
