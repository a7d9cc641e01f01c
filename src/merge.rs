//! `infernix-perplexity merge OUT_DIR SHARD_DIR...`: joins the reports of the
//! `--shard K/N` runs of one plan into the report one process writes.
//!
//! Every window is copied as its shard scored it (a window's numbers do not
//! depend on which other windows share its process: batching changes no
//! number, and memory and batch sizes come from the whole plan), then every
//! stream, domain and overall figure is pooled from the windows in plan order
//! by the same code as a single run (`score::Summary::over`), so they are the
//! same bits. Only wall times differ: per-window `seconds` are each shard's,
//! and `timing` gives the slowest shard's seconds (the shards run side by
//! side) with the token counts summed.
//!
//! The merge refuses, naming the shard: a report that is not a shard, shards
//! of another count, a missing or repeated shard, another artifact
//! (`artifact.digest`), another plan (`workload`), another route, KV format
//! or any other setting of `execution` (all but `device` and `threads`),
//! other streams, shards scored against another `--kl-reference` (its
//! records' SHA-256), and a window in the wrong shard or in two. Nothing is
//! written unless the merge succeeds.
//!
//! With `--kl-reference`, every KL figure is pooled from the windows' KL
//! records and their per-position detail (`windows[].kl_detail`, kept in
//! shard reports only) by `top_tokens::pool_kl`, the code one process pools
//! with: the quantiles are recomputed from the merged per-position KLs.
//! `--save-top-tokens FILE` joins the shards' top-tokens files (named in
//! their reports) into the file one process writes (`topk::join_files`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::Value;

use crate::plan::Shard;
use crate::report::{self, DomainResult, Report, StreamResult, Timing, WindowResult};
use crate::score::{domain_summaries, overall_summary, StreamStats, Summary};
use crate::util::json::first_difference;
use crate::util::outputs::{check_outputs, Named, OutputDir};

/// Joins the reports of `--shard K/N` runs into the report of the whole run.
#[derive(Parser, Debug)]
#[command(name = "infernix-perplexity merge", bin_name = "infernix-perplexity merge", version,
    about = "Joins the report.json files of --shard K/N runs into the report one process writes (docs/cluster.md)",
    long_about = None)]
pub struct MergeArgs {
    /// The folder to write the merged report.json to (created; must be empty).
    pub out_dir: PathBuf,
    /// The shards' output folders (or their report.json files), all N of them, in any order.
    #[arg(required = true, num_args = 1..)]
    pub shard_dirs: Vec<PathBuf>,
    /// Join the shards' --save-top-tokens files (each shard's report names
    /// its own) into FILE: byte for byte the file one process writes.
    #[arg(long, value_name = "FILE")]
    pub save_top_tokens: Option<PathBuf>,
}

/// The whole subcommand: check, read, merge, write, print the table.
pub fn run(args: &MergeArgs) -> Result<Report> {
    let paths: Vec<PathBuf> = args.shard_dirs.iter().map(|p| report::report_path(p)).collect();
    let inputs: Vec<Named<'_>> = paths.iter().map(|p| Named::new("SHARD_DIR", p)).collect();
    let report_path = args.out_dir.join(report::REPORT_FILE);
    let mut shards = Vec::with_capacity(paths.len());
    for p in &paths {
        shards.push((p.clone(), report::read_report(p, "SHARD_DIR")?));
    }
    // The shards' top-tokens files are inputs too.
    let top_parts = top_tokens_parts(&shards, args.save_top_tokens.is_some())?;
    let mut inputs = inputs;
    inputs.extend(top_parts.iter().map(|(_, p)| Named::new("SHARD_DIR top tokens", p)));
    let extra: Vec<Named<'_>> = args.save_top_tokens.iter().map(|p| Named::new("--save-top-tokens", p)).collect();
    check_outputs(&extra, &[Named::new("OUT_DIR", &report_path)], &inputs)?;
    let merged = merge(&shards)?;
    let mut out = OutputDir::claim("OUT_DIR", &args.out_dir)?;
    if let Some(path) = &args.save_top_tokens {
        join_top_tokens(&shards, &top_parts, path)?;
    }
    report::write_report(&args.out_dir, &merged)?;
    out.keep();
    print!("{}", report::domain_table(&merged.results));
    Ok(merged)
}

/// The shards' `--save-top-tokens` files (`workload.shard.top_tokens`), in
/// shard order; with `wanted`, every shard must have one.
fn top_tokens_parts(shards: &[(PathBuf, Report)], wanted: bool) -> Result<Vec<(String, PathBuf)>> {
    let mut parts = Vec::new();
    let mut n_without = 0;
    for (p, r) in shards {
        match r.workload.shard.as_ref().and_then(|s| s.top_tokens.as_ref()) {
            Some(f) => parts.push((format!("SHARD_DIR {}: its top tokens", p.display()), PathBuf::from(f))),
            None if wanted => bail!("SHARD_DIR {}: the shard wrote no top-tokens file (run it with --save-top-tokens), --save-top-tokens asks to join them", p.display()),
            None => n_without += 1,
        }
    }
    if !wanted && n_without < shards.len() {
        tracing::warn!("{} shards wrote top-tokens files; give --save-top-tokens FILE to join them", shards.len() - n_without);
        parts.clear();
    }
    Ok(parts)
}

/// Joins the shards' top-tokens files into `out`, with the header one
/// process writes: the union of their windows (every window of the plan,
/// checked against `workload.shard.n_windows`) and the first shard's producer.
fn join_top_tokens(shards: &[(PathBuf, Report)], parts: &[(String, PathBuf)], out: &Path) -> Result<()> {
    let mut headers = Vec::with_capacity(parts.len());
    for (what, p) in parts {
        let r = crate::score::topk::TopTokensReader::open(p).with_context(|| what.clone())?;
        headers.push(r.header);
    }
    let first = headers.first().context("merge --save-top-tokens: no shard top-tokens files")?;
    let mut fingerprint = first.fingerprint.clone();
    for (s, si) in fingerprint.streams.iter_mut().zip(0..) {
        s.windows = headers.iter().filter_map(|h| h.fingerprint.streams.get(si)).flat_map(|t| t.windows.iter().cloned()).collect();
        s.windows.sort_by_key(|w| w.index);
    }
    let n_windows = shards.first().and_then(|(_, r)| r.workload.shard.as_ref()).map(|s| s.n_windows.clone()).unwrap_or_default();
    for (s, &n) in fingerprint.streams.iter().zip(&n_windows) {
        if s.windows.len() != n || s.windows.iter().enumerate().any(|(i, w)| w.index != i) {
            bail!("--save-top-tokens: the shards' top-tokens files hold {} windows of stream '{}', the plan {n} (a window missing or in two files)", s.windows.len(), s.name);
        }
    }
    let header = crate::score::topk::FileHeader {
        format: crate::score::topk::FORMAT.into(),
        producer: first.producer.clone(),
        n_positions: fingerprint.n_positions(),
        fingerprint,
    };
    crate::score::topk::join_files(parts, &header, out).with_context(|| format!("merge --save-top-tokens {}", out.display()))
}

fn json<T: serde::Serialize>(v: &T) -> Result<Value> {
    serde_json::to_value(v).context("serialize a report block")
}

/// The blocks every shard must share with the first, as JSON (the shard
/// block, the device and the thread count left out).
fn shared_blocks(r: &Report) -> Result<[(&'static str, Value); 4]> {
    let mut workload = json(&r.workload)?;
    if let Value::Object(m) = &mut workload {
        m.remove("shard");
    }
    let mut execution = json(&r.execution)?;
    if let Value::Object(m) = &mut execution {
        m.remove("device");
        m.remove("threads");
    }
    let streams: Vec<Value> = r
        .results
        .streams
        .iter()
        .map(|s| serde_json::json!({"name": s.name, "domain": s.domain, "n_tokens": s.n_tokens, "token_ids_sha256": s.token_ids_sha256}))
        .collect();
    Ok([
        ("artifact", serde_json::json!({"digest": r.artifact.digest, "public_name": r.artifact.public_name})),
        ("workload", workload),
        ("execution", execution),
        ("results.streams", Value::Array(streams)),
    ])
}

/// Merges shard reports (`(path, report)`, any order) into the whole run's.
pub fn merge(shards: &[(PathBuf, Report)]) -> Result<Report> {
    let Some((first_path, first)) = shards.first() else { bail!("merge: no shard reports given") };
    let show = |p: &Path| p.display().to_string();
    let info_of = |p: &Path, r: &Report| {
        r.workload
            .shard
            .clone()
            .with_context(|| format!("SHARD_DIR {}: not a shard report (no workload.shard; score with --shard K/N)", show(p)))
    };
    let first_info = info_of(first_path, first)?;
    let n = first_info.count;
    let mut by_index: Vec<Option<&Path>> = vec![None; n];
    let first_blocks = shared_blocks(first)?;
    for (p, r) in shards {
        let info = info_of(p, r)?;
        if info.count != n {
            bail!("SHARD_DIR {}: shard {}/{} of another split than {} (shard {}/{n})", show(p), info.index, info.count, show(first_path), first_info.index);
        }
        if info.n_windows != first_info.n_windows {
            bail!("SHARD_DIR {}: another plan than {} (windows per stream {:?} vs {:?})", show(p), show(first_path), info.n_windows, first_info.n_windows);
        }
        if let Some(q) = by_index[info.index] {
            bail!("SHARD_DIR {}: shard {}/{n} is given twice (also {})", show(p), info.index, show(q));
        }
        by_index[info.index] = Some(p);
        let reference = |r: &Report| r.results.kl_divergence.as_ref().map(|k| (k.reference.sha256.clone(), k.reference.top_k));
        if reference(r) != reference(first) {
            let say = |r: &Report| match &r.results.kl_divergence {
                Some(k) => format!("reference {} (records sha256 {}, top-{})", k.reference.path, k.reference.sha256, k.reference.top_k),
                None => "no --kl-reference".into(),
            };
            bail!("SHARD_DIR {}: scored against {}, {} against {}", show(p), say(r), show(first_path), say(first));
        }
        for ((name, a), (_, b)) in first_blocks.iter().zip(shared_blocks(r)?) {
            if let Some(d) = first_difference(a, &b, name) {
                let what = match *name {
                    "artifact" => "another artifact",
                    "workload" => "another plan",
                    "execution" => "another route, KV format or setting",
                    _ => "other streams",
                };
                bail!("SHARD_DIR {}: {what} than {}: {d}", show(p), show(first_path));
            }
        }
    }
    if let Some(k) = by_index.iter().position(Option::is_none) {
        bail!("shard {k}/{n} is missing: {} of {n} shard reports given", shards.len());
    }

    // Every window of the plan exactly once, each from the shard that owns it.
    let mut offset = 0;
    let mut streams = Vec::with_capacity(first.results.streams.len());
    for (si, s0) in first.results.streams.iter().enumerate() {
        let n_planned = first_info.n_windows.get(si).copied().with_context(|| format!("SHARD_DIR {}: no window count for stream '{}'", show(first_path), s0.name))?;
        let mut windows: Vec<Option<(WindowResult, &Path)>> = vec![None; n_planned];
        for (p, r) in shards {
            let info = info_of(p, r)?;
            let shard = Shard { index: info.index, count: info.count };
            for w in &r.results.streams[si].windows {
                let at = || format!("SHARD_DIR {}: stream '{}' window {}", show(p), s0.name, w.index);
                if w.index >= n_planned {
                    bail!("{}: the plan has {n_planned} windows in this stream", at());
                }
                if !shard.takes(offset + w.index) {
                    bail!("{}: overlaps shard {} (window {} of the plan is shard {}'s)", at(), (offset + w.index) % n, offset + w.index, (offset + w.index) % n);
                }
                if let Some((_, q)) = &windows[w.index] {
                    bail!("{}: also in {}", at(), show(q));
                }
                windows[w.index] = Some((w.clone(), p));
            }
        }
        let windows: Vec<WindowResult> = windows
            .into_iter()
            .enumerate()
            .map(|(i, w)| w.map(|(w, _)| w).with_context(|| format!("stream '{}' window {i} is in no shard report (shard {} lost it?)", s0.name, (offset + i) % n)))
            .collect::<Result<_>>()?;
        offset += n_planned;
        let stats: Vec<_> = windows.iter().map(WindowResult::stats).collect();
        streams.push((
            StreamStats { id: s0.name.clone(), domain: s0.domain.clone(), windows: stats },
            StreamResult { summary: None, kl_divergence: None, windows, ..s0.clone() },
        ));
    }
    let stats: Vec<StreamStats> = streams.iter().map(|(st, _)| st.clone()).collect();
    let overall = overall_summary(&stats);
    let domains = domain_summaries(&stats)
        .into_iter()
        .map(|(domain, summary)| DomainResult { streams: stats.iter().filter(|s| s.domain == domain).count(), domain, summary, bytes: None })
        .collect();
    let mut results_streams: Vec<StreamResult> =
        streams.into_iter().map(|(st, r)| StreamResult { summary: Some(Summary::over(&st.windows)), ..r }).collect();
    // KL: every window's record and detail pooled in plan order, as one process pools them.
    let mut kl_by_position = None;
    let mut kl_report = None;
    if let Some(k0) = &first.results.kl_divergence {
        let windows: Vec<&[WindowResult]> = results_streams.iter().map(|s| s.windows.as_slice()).collect();
        let names: Vec<&str> = results_streams.iter().map(|s| s.name.as_str()).collect();
        let (per_stream, mut kl, by_position) = crate::top_tokens::pool_kl(&windows, &names, k0.reference.clone()).context("merge")?;
        // The excerpts were decoded by the shard that scored the window.
        let shard_kl: Vec<&crate::report::KlReport> = shards.iter().filter_map(|(_, r)| r.results.kl_divergence.as_ref()).collect();
        for w in &mut kl.worst_positions {
            if let Some(o) = shard_kl.iter().flat_map(|k| &k.worst_positions).find(|o| (&o.stream, o.window, o.token_index) == (&w.stream, w.window, w.token_index)) {
                w.text = o.text.clone();
                w.reference_top_text = o.reference_top_text.clone();
            }
        }
        for w in &mut kl.worst_windows {
            if let Some(o) = shard_kl.iter().flat_map(|k| &k.worst_windows).find(|o| (&o.stream, o.window) == (&w.stream, w.window)) {
                w.text = o.text.clone();
            }
        }
        for (s, k) in results_streams.iter_mut().zip(per_stream) {
            s.kl_divergence = Some(k);
        }
        kl_by_position = Some(by_position);
        kl_report = Some(kl);
    }
    results_streams.iter_mut().flat_map(|s| &mut s.windows).for_each(|w| w.kl_detail = None);
    let timing = merged_timing(shards.iter().map(|(_, r)| &r.timing), &overall);
    let mut merged = first.clone();
    merged.workload.shard = None;
    merged.results.streams = results_streams;
    merged.results.domains = domains;
    merged.results.overall = Some(crate::report::Overall { summary: overall, bytes: None });
    merged.results.kl_divergence = kl_report;
    // Byte figures, NLL and KL by position pool the windows as the writer does.
    crate::report::pool_window_figures(&mut merged.results, kl_by_position);
    merged.timing = timing;
    merged.memory = crate::report::MemoryPeaks::merged(shards.iter().map(|(_, r)| r.memory.as_ref()));
    // Expert-usage counts are additive over windows, and the shards' windows partition the plan.
    merged.results.expert_usage =
        crate::model::ExpertUsage::sum(shards.iter().map(|(_, r)| r.results.expert_usage.as_ref())).context("merge: expert_usage")?;
    Ok(merged)
}

/// The shards ran side by side: the slowest shard's seconds, the summed
/// token counts, and rates over the slowest shard's scoring time.
fn merged_timing<'a>(shards: impl Iterator<Item = &'a Timing>, overall: &Summary) -> Timing {
    let mut t = Timing::default();
    for s in shards {
        t.elapsed_seconds = t.elapsed_seconds.max(s.elapsed_seconds);
        t.load_seconds = t.load_seconds.max(s.load_seconds);
        t.tokenize_seconds = t.tokenize_seconds.max(s.tokenize_seconds);
        t.scoring_seconds = t.scoring_seconds.max(s.scoring_seconds);
        t.tokens_processed += s.tokens_processed;
    }
    t.tokens_scored = overall.scored_tokens;
    let rate = |n: usize| (t.scoring_seconds > 0.0).then(|| n as f64 / t.scoring_seconds);
    t.tokens_per_second_processed = rate(t.tokens_processed);
    t.tokens_per_second_scored = rate(t.tokens_scored);
    t
}
