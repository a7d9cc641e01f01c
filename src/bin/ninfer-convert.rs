//! `ninfer-convert`: GGUF files, Hugging Face folders or synthetic geometries
//! into `.ninfer` artifacts. Exit codes: 0 success, 2 error, 130/143 stopped
//! by SIGINT/SIGTERM (nothing written). `--out` and `--gguf-twin` are checked
//! against the source (every file of a Hugging Face folder) before any work.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Parser;
use infernix_perplexity::artifact::TensorFormat;
use infernix_perplexity::convert::{self, synthetic, ConvertOptions};
use infernix_perplexity::util::outputs::{check_outputs, Named};
use infernix_perplexity::util::signal;

/// Converts a model to a `.ninfer` v3 artifact, keeping every tensor's block format byte for byte.
#[derive(Parser, Debug)]
#[command(
    name = "ninfer-convert",
    version = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("INFERNIX_GIT_REVISION"), ")"),
    about = "Converts a GGUF file or a Hugging Face folder into a .ninfer v3 artifact for infernix-perplexity \
             (every tensor kept in its source block format, byte for byte)",
    long_about = None,
    after_help = "Example: ninfer-convert SmolLM2-135M-Instruct.Q4_1.gguf --out SmolLM2-135M-Instruct.Q4_1.ninfer\n\
                  Exit codes: 0 success, 2 error."
)]
struct Args {
    /// A `.gguf` file (GGUF v2/v3) or a Hugging Face folder (config.json, *.safetensors, tokenizer.json).
    /// With --synthetic: the GGUF whose tokenizer the synthetic model uses.
    source: PathBuf,
    /// Output artifact path.
    #[arg(long)]
    out: PathBuf,
    /// Keep only source blocks A..B (end exclusive): a qualification artifact.
    #[arg(long, value_name = "A..B")]
    layers: Option<String>,
    /// Write a seeded random-weight model of this geometry instead (smollm2-135m, llama-8b, llama-70b, qwen3moe-30b-a3b, qwen3moe-tiny).
    #[arg(long, value_name = "GEOMETRY")]
    synthetic: Option<String>,
    /// Block format of the synthetic weights (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).
    #[arg(long, default_value = "Q4_0")]
    format: String,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write the synthetic weights as a GGUF file (for other engines).
    #[arg(long, value_name = "OUT.gguf")]
    gguf_twin: Option<PathBuf>,
    /// With --synthetic: the trained context to record (1 to 1048576 positions) instead of the
    /// geometry's own (llama-8b: 8192), in the artifact and its GGUF twin.
    #[arg(long, value_name = "N")]
    context_length: Option<String>,
}

fn parse_layers(s: &str) -> Result<std::ops::Range<usize>> {
    let (a, b) = s.split_once("..").with_context(|| format!("--layers {s:?}: expected A..B"))?;
    let a: usize = a.trim().parse().with_context(|| format!("--layers {s:?}: bad start"))?;
    let b: usize = b.trim().parse().with_context(|| format!("--layers {s:?}: bad end"))?;
    if a >= b {
        bail!("--layers {s:?}: empty range");
    }
    Ok(a..b)
}

/// `--out` / `--gguf-twin` against the source file (or every file of a source folder) and each other.
fn check_paths(args: &Args) -> Result<()> {
    let mut inputs: Vec<PathBuf> = vec![args.source.clone()];
    if args.source.is_dir() {
        let entries = std::fs::read_dir(&args.source).with_context(|| format!("SOURCE {}: read folder", args.source.display()))?;
        for e in entries {
            inputs.push(e.with_context(|| format!("SOURCE {}: read folder", args.source.display()))?.path());
        }
    }
    let inputs: Vec<Named<'_>> = inputs.iter().map(|p| Named::new("SOURCE", p)).collect();
    let mut outputs = vec![Named::new("--out", &args.out)];
    if let Some(t) = &args.gguf_twin {
        outputs.push(Named::new("--gguf-twin", t));
    }
    check_outputs(&outputs, &[], &inputs)
}

fn run(args: Args) -> Result<()> {
    let started = std::time::Instant::now();
    signal::install()?;
    check_paths(&args)?;
    let context_length = args.context_length.as_deref().map(synthetic::parse_context_length).transpose()?;
    let meta = if let Some(name) = &args.synthetic {
        let format = TensorFormat::from_name(&args.format).context("--format")?;
        let twin = args.gguf_twin.as_deref();
        match synthetic::moe_geometry(name) {
            Some(mut moe) => {
                moe.context_length = context_length.unwrap_or(moe.context_length);
                synthetic::write_synthetic_moe(&moe, format, args.seed, &args.source, &args.out, twin)?
            }
            None => {
                let mut geo = synthetic::geometry(name)
                    .map_err(|_| anyhow::anyhow!("--synthetic {name:?}: unknown geometry (known: {})", synthetic::all_geometry_names()))?;
                geo.context_length = context_length.unwrap_or(geo.context_length);
                synthetic::write_synthetic(&geo, format, args.seed, &args.source, &args.out, twin)?
            }
        }
    } else {
        if args.gguf_twin.is_some() {
            bail!("--gguf-twin is only for --synthetic");
        }
        if args.context_length.is_some() {
            bail!("--context-length is only for --synthetic (a converted model keeps its source's context length)");
        }
        let layers = args.layers.as_deref().map(parse_layers).transpose()?;
        convert::convert(&args.source, &args.out, &ConvertOptions { layers })?
    };
    let n_bytes: u64 = meta.tensors.iter().map(|t| t.n_bytes).sum();
    eprintln!(
        "ninfer-convert: wrote {} ({}, {} tensors, {:.1} MiB) in {:.2} s",
        args.out.display(),
        meta.architecture.name(),
        meta.tensors.len(),
        n_bytes as f64 / (1u64 << 20) as f64,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ninfer-convert: error: {e:#}");
            ExitCode::from(signal::exit_code_for(&e, 2))
        }
    }
}
