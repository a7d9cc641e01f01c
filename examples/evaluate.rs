//! The library API: one evaluation from flags to a typed report, without the
//! command line's output folder checks, progress bar or table.
//!
//! ```sh
//! cargo run --release --example evaluate -- models/SmolLM2-135M-Instruct.Q4_1.ninfer
//! ```
//!
//! Scores the first two 512-token windows of each stream of the bundled
//! quick corpus on the CPU, prints each stream as it finishes, then the
//! domain table from the returned `report::Report`.

use anyhow::{Context, Result};
use clap::Parser;
use infernix_perplexity::cli::Args;
use infernix_perplexity::config::RunConfig;
use infernix_perplexity::{evaluate, Event};

fn main() -> Result<()> {
    let model = std::env::args().nth(1).context("usage: evaluate MODEL.ninfer")?;
    let out = tempfile::tempdir().context("a scratch folder")?;
    let args = Args::try_parse_from([
        "infernix-perplexity",
        &model,
        "--quick",
        "--context",
        "512",
        "--stride",
        "256",
        "--chunks",
        "2",
        "--backend",
        "cpu",
        "--output",
        &out.path().display().to_string(),
    ])?;
    let cfg = RunConfig::from_args(&args)?;
    let report = evaluate(&cfg, &mut |e| {
        if let Event::Stream { stream, summary, seconds } = e {
            eprintln!("{stream}: PPL {:.4} over {} targets ({seconds:.1} s)", summary.perplexity, summary.scored_tokens);
        }
    })?;
    print!("{}", infernix_perplexity::report::domain_table(&report.results));
    let overall = report.results.overall.context("a scored run has an overall summary")?;
    println!("overall PPL {:.4} +- {:.4} (clustered by window)", overall.summary.perplexity, overall.summary.ppl_uncertainty_clustered.unwrap_or(f64::NAN));
    Ok(())
}
