//! The CLI's side of a run: check every output against every input and claim
//! the output folder before any work, run the evaluation
//! ([`crate::evaluate`]) with a progress display on stderr, write report.json
//! and print the domain table on stdout, and turn non-finite scores into the
//! exit status.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use tracing::info;

use crate::config::{Input, RunConfig};
use crate::evaluate::{evaluate, Event};
use crate::report;
use crate::text::corpus;
use crate::util::outputs::{check_outputs, Named, OutputDir};

/// How a run that produced its report ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    /// The report was written, but a check failed (non-finite scores).
    ChecksFailed,
}

pub fn run(cfg: &RunConfig) -> Result<Outcome> {
    check_run_outputs(cfg)?;
    let mut out = OutputDir::claim("--output", &cfg.output)?;
    // On an error (or a signal) `out` removes its lock and every folder it created.
    let outcome = run_inner(cfg)?;
    out.keep();
    Ok(outcome)
}

/// Every output of the run (`--save-tokens`, `--save-top-tokens`, the
/// report) against every input (the model, the text, token or manifest
/// file, every corpus stream, `--kl-reference`), before any work.
fn check_run_outputs(cfg: &RunConfig) -> Result<()> {
    let mut inputs: Vec<(String, PathBuf)> = vec![("MODEL".into(), cfg.model.clone())];
    match &cfg.input {
        Input::Text(p) => inputs.push(("--text".into(), p.clone())),
        Input::Tokens(p) => inputs.push(("--tokens".into(), p.clone())),
        Input::Corpus { manifest, quick, data_root } => {
            if let Some(m) = manifest {
                inputs.push(("--corpus".into(), m.clone()));
            }
            // A manifest that does not load is reported by read_inputs, with its
            // field; the bundled corpus has no files to protect.
            if let Ok((m, corpus::CorpusFiles::Dir(root))) = corpus::open_corpus(manifest.as_deref(), data_root.as_deref()) {
                for spec in corpus::select(&m, *quick) {
                    inputs.push((format!("corpus stream {}", spec.id), root.join(&spec.path)));
                }
            }
        }
    }
    if let Some(p) = &cfg.kl_reference {
        inputs.push(("--kl-reference".into(), p.clone()));
    }
    let report_path = cfg.output.join(report::REPORT_FILE);
    let mut outputs = Vec::new();
    if let Some(p) = &cfg.save_tokens {
        outputs.push(Named::new("--save-tokens", p));
    }
    if let Some(p) = &cfg.save_top_tokens {
        outputs.push(Named::new("--save-top-tokens", p));
    }
    let inputs: Vec<Named<'_>> = inputs.iter().map(|(w, p)| Named::new(w, p)).collect();
    check_outputs(&outputs, &[Named::new("--output", &report_path)], &inputs)
}

fn run_inner(cfg: &RunConfig) -> Result<Outcome> {
    let mut progress: Option<Progress> = None;
    let report = evaluate(cfg, &mut |e| match e {
        Event::Scoring { n_targets } => progress = Some(Progress::new(n_targets as u64)),
        Event::Pass { stream, n_scored } => {
            if let Some(p) = &mut progress {
                p.advance(n_scored as u64, stream);
            }
        }
        Event::Stream { stream, summary: s, seconds } => {
            let line = || format!("stream {stream}: {} targets, mean NLL {:.6}, PPL {:.4} ({seconds:.1} s)", s.scored_tokens, s.mean_nll, s.perplexity);
            match progress.as_ref().and_then(|p| p.bar.as_ref()) {
                Some(b) => b.suspend(|| info!("{}", line())),
                None => info!("{}", line()),
            }
        }
        Event::Scored => {
            if let Some(p) = progress.take() {
                p.finish();
            }
        }
    })?;
    report::write_report(&cfg.output, &report)?;
    let path = cfg.output.join(report::REPORT_FILE);
    let Some(overall) = &report.results.overall else {
        info!("dry run: wrote {}", path.display());
        return Ok(Outcome::Success);
    };
    if let Some(kl) = &report.results.kl_divergence {
        report::worst::write_markdown(&cfg.output, &report::worst::markdown(kl, &report.artifact.public_name))?;
    }
    if cfg.plots {
        for p in report::plots::write_run_plots(&cfg.output, &report.results)? {
            info!("wrote {}", p.display());
        }
    }
    print!("{}", report::domain_table(&report.results));
    // llama-perplexity's closing line, for scripts written for it (its uncertainty: tokens independent).
    eprintln!("{}", report::llama_cpp_final_estimate(&overall.summary));
    info!(
        "wrote {} ({:.0} tokens/s processed, {:.0} scored)",
        path.display(),
        report.timing.tokens_per_second_processed.unwrap_or(0.0),
        report.timing.tokens_per_second_scored.unwrap_or(0.0)
    );
    let n_nonfinite = overall.summary.n_nonfinite;
    if n_nonfinite > 0 {
        if cfg.allow_nonfinite {
            tracing::warn!("{n_nonfinite} non-finite scores were left out of every mean (--allow-nonfinite)");
        } else {
            tracing::error!("{n_nonfinite} scores are NaN or infinite (left out of every mean; --allow-nonfinite accepts them)");
            return Ok(Outcome::ChecksFailed);
        }
    }
    Ok(Outcome::Success)
}

/// Progress on stderr: a bar on a terminal, a log line every 10 s otherwise.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    n_total: u64,
    n_done: u64,
    last_line: Instant,
    started: Instant,
}

impl Progress {
    fn new(n_total: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new(n_total);
            b.set_style(
                indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} targets {per_sec} eta {eta}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b
        });
        Self { bar, n_total, n_done: 0, last_line: Instant::now(), started: Instant::now() }
    }

    fn advance(&mut self, n: u64, stream: &str) {
        self.n_done += n;
        match &self.bar {
            Some(b) => b.set_position(self.n_done),
            None if self.last_line.elapsed() >= Duration::from_secs(10) => {
                self.last_line = Instant::now();
                let rate = self.n_done as f64 / self.started.elapsed().as_secs_f64().max(1e-9);
                info!("progress: {}/{} targets ({stream}), {rate:.0} targets/s", self.n_done, self.n_total);
            }
            None => {}
        }
    }

    fn finish(&self) {
        match &self.bar {
            Some(b) => b.finish_and_clear(),
            None => info!("progress: {}/{} targets, {:.1} s", self.n_done, self.n_total, self.started.elapsed().as_secs_f64()),
        }
    }
}

