//! Raw command-line flags of `infernix-perplexity`, as clap parses them.
//! Nothing here is validated beyond its type: `config` does that.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MethodArg {
    /// Fixed windows of --context tokens advancing by --stride scored targets (default).
    Sliding,
    /// llama.cpp's perplexity method: non-overlapping chunks, second half scored.
    Chunks,
    /// llama.cpp's strided method (`llama-perplexity -c C --ppl-stride S`):
    /// windows of C + S/2 tokens padded to 256, every S tokens, last S scored.
    PplStride,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// CUDA when a driver and a device exist, else the CPU.
    Auto,
    Cuda,
    Cpu,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

/// Scores a text corpus with a .ninfer model and reports causal perplexity.
///
/// Exit codes: 0 success, 1 the run finished but failed a check (non-finite scores
/// without --allow-nonfinite), 2 bad input or error.
#[derive(Parser, Debug)]
#[command(
    name = "infernix-perplexity",
    version = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("INFERNIX_GIT_REVISION"), ")"),
    about,
    long_about = None,
    after_help = "Compare two reports (CI quality gate): infernix-perplexity compare BASE NEW\n\
                  (exit codes 0 PASS, 3 WARN, 1 FAIL, 2 error; see infernix-perplexity compare --help)."
)]
pub struct Args {
    /// The .ninfer v3 artifact to evaluate.
    pub model: PathBuf,

    /// Score one text file (read as raw UTF-8 bytes) as a single stream.
    /// `-f`/`--file` are llama.cpp's spellings (aliases).
    #[arg(long, short = 'f', visible_alias = "file", value_name = "FILE", conflicts_with_all = ["tokens", "corpus"])]
    pub text: Option<PathBuf>,
    /// Score a JSON array of token ids as a single stream.
    #[arg(long, value_name = "FILE", conflicts_with = "corpus")]
    pub tokens: Option<PathBuf>,
    /// A corpus manifest. Without --text, --tokens or --corpus, the corpus
    /// compiled into this program (ppl-v1, 21 streams) is scored.
    #[arg(long, value_name = "MANIFEST")]
    pub corpus: Option<PathBuf>,
    /// Only the first stream of each domain of the corpus (the bundled one or --corpus).
    #[arg(long, conflicts_with_all = ["text", "tokens"])]
    pub quick: bool,
    /// Folder the manifest's paths are relative to (else $INFERNIX_DATA, else the manifest's folder).
    #[arg(long, value_name = "DIR", requires = "corpus")]
    pub data_root: Option<PathBuf>,

    /// Window method.
    #[arg(long, value_enum, default_value_t = MethodArg::Sliding)]
    pub method: MethodArg,
    /// Tokens per window (sliding), per chunk (chunks), or llama.cpp's -c
    /// (ppl-stride). `-c`/`--ctx-size` are llama.cpp's spellings (aliases).
    #[arg(long, short = 'c', visible_alias = "ctx-size", default_value_t = 4096)]
    pub context: usize,
    /// Scored targets a sliding (or ppl-stride) window advances by.
    #[arg(long, default_value_t = 2048)]
    pub stride: usize,
    /// llama.cpp's `--ppl-stride S`: alias of `--method ppl-stride --stride S`.
    #[arg(long, value_name = "S", conflicts_with = "stride")]
    pub ppl_stride: Option<usize>,
    /// Score only the first N windows (sliding, ppl-stride) or chunks (chunks)
    /// of each stream; llama.cpp's `--chunks N` means the same.
    #[arg(long, value_name = "N")]
    pub chunks: Option<usize>,
    /// Tokens per prefill pass (multiple of 128).
    #[arg(long, default_value_t = 1024)]
    pub prefill_chunk: usize,
    /// Most rows in one forward pass: consecutive windows of equal length are
    /// prefilled side by side while their passes together stay within this
    /// many tokens (fewer when the device's memory says so; 1 window when a
    /// single pass is already larger). Changes speed, never a score. Default:
    /// 32768 on CUDA, 8192 on the CPU.
    #[arg(long, value_name = "TOKENS")]
    pub batch_tokens: Option<usize>,

    /// Where the forward pass runs.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// CUDA device index.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    // ---- Numeric route and KV format (issue 11); config.rs validates them into an ExecutionSpec ----
    /// The lossless route (the oracle): f32 matmul inputs and logits, f32 KV
    /// (or --kv-dtype bf16), no fast path.
    #[arg(long)]
    pub lossless: bool,
    /// KV-cache format: f32, bf16, int8, fp8, k8v4, nvfp4, k4v2, vq2
    /// (docs/kv-formats.md). Default fp8 on every backend, f32 under --lossless.
    /// (Parsed by config, so a bad name is a one-line error.)
    #[arg(long, value_name = "FORMAT")]
    pub kv_dtype: Option<String>,
    /// Hadamard rotation of the K and V rows of a quantized --kv-dtype: auto
    /// (the format table's per-format choice, docs/kv-formats.md), on or off
    /// (forced for K and V). bf16 and f32 rows are never rotated: on/off with
    /// them is an error. (Parsed by config.)
    #[arg(long, value_name = "auto|on|off")]
    pub kv_rotation: Option<String>,
    /// The lossless route with the --kv-dtype codec applied exactly as the CPU
    /// reference defines it (under bf16, V stored as fp16). Implies --lossless.
    #[arg(long)]
    pub reference: bool,
    /// Deterministic kernels only: results independent of batch composition and prefill chunk; no fast path.
    #[arg(long)]
    pub reproducible: bool,
    /// Force the named fast path (repeatable). Unknown names are an error that lists the valid ones.
    #[arg(long = "fast-path", value_name = "NAME")]
    pub fast_paths: Vec<String>,
    /// Turn off the named fast path where it is on by default (repeatable).
    #[arg(long = "no-fast-path", value_name = "NAME")]
    pub no_fast_paths: Vec<String>,
    /// Use the original int8 prefill attention kernel, kernel v3's decoding kernel: the fast path
    /// attn-int8-qk off (needs --kv-dtype int8).
    #[arg(long)]
    pub use_original_int8_prefill_kernel: bool,
    /// Use the original nvfp4 prefill attention kernel, kernel v3's decoding kernel: the fast path
    /// attn-f16 off (needs --kv-dtype nvfp4).
    #[arg(long)]
    pub use_original_nvfp4_prefill_kernel: bool,
    /// YaRN scaling of the rotary embedding, finite in [1, 4] (1: native RoPE).
    /// Raises the longest allowed context to the trained context times F.
    #[arg(long, value_name = "F", default_value_t = 1.0)]
    pub rope_yarn_factor: f64,
    /// With --backend cpu: round both inputs of every matrix product (LM head
    /// included) to bf16, as the CUDA default route feeds its tensor cores,
    /// and nothing else. Measures that rounding apart from any kernel.
    #[arg(long)]
    pub emulate_bf16_tc: bool,
    // ---- end of the numeric-route block ----
    /// CPU threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,

    /// Output folder for report.json (must be new or empty); default profiles/perplexity/<timestamp>/.
    #[arg(long, value_name = "DIR")]
    pub output: Option<PathBuf>,
    /// Open the artifact and tokenize, write report.json, but run no model.
    #[arg(long)]
    pub dry_run: bool,
    /// Hash every tensor of the artifact against its recorded SHA-256 before use.
    #[arg(long)]
    pub verify: bool,
    /// Finish (exit 0) even when some scores are NaN or infinite; they are still counted and reported.
    #[arg(long)]
    pub allow_nonfinite: bool,
    /// Score every window a second time with another prefill chunk and record
    /// the difference as `noise_floor` in report.json (for `compare --max-delta-over-floor`).
    #[arg(long)]
    pub noise_floor: bool,
    /// Write every scored position's 64 most probable ids and log-probabilities (docs/top-tokens.md).
    #[arg(long, value_name = "FILE")]
    pub save_top_tokens: Option<PathBuf>,
    /// Compare with a top-tokens file recorded for the same windows: KL divergence (lower bound), top-1 agreement, NLL change.
    #[arg(long, value_name = "FILE")]
    pub kl_reference: Option<PathBuf>,
    /// Write every window's input token ids and the run fingerprint as JSON (for tools/fp64_reference.py).
    #[arg(long, value_name = "FILE")]
    pub save_tokens: Option<PathBuf>,
    /// llama.cpp's `--kl-divergence-base FILE`: alias of `--save-top-tokens FILE`,
    /// or of `--kl-reference FILE` with `--kl-divergence` (as in llama.cpp,
    /// where the base file is written, or read back with --kl-divergence).
    /// The file is this program's top-tokens file, not llama.cpp's logits file.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["save_top_tokens", "kl_reference"])]
    pub kl_divergence_base: Option<PathBuf>,
    /// llama.cpp's `--kl-divergence`: compare with the file given by
    /// `--kl-divergence-base` instead of writing it.
    #[arg(long, requires = "kl_divergence_base")]
    pub kl_divergence: bool,
    /// Write SVG charts beside report.json: PPL by domain and by position in
    /// the window; with a reference, KL by position and its histogram.
    #[arg(long)]
    pub plots: bool,
    /// Batch-invariance self-check: score the first N windows again, each
    /// alone (a batch of one, one prefill pass), and record the largest
    /// |dNLL| and the KL against the batched scores in report.json.
    #[arg(long, value_name = "N")]
    pub verify_invariance: Option<usize>,
    /// Early stop: score windows in a seeded random order and stop once the
    /// 95 % half-width (clustered by window) of the overall mean NLL (of the
    /// mean KL with --kl-reference) falls below X nats (docs/report-extras.md).
    #[arg(long, value_name = "X")]
    pub target_uncertainty: Option<f64>,
    /// Score only shard K of N (K counted from 0): window g of the plan (stream
    /// order, then window order) is shard g % N's. `infernix-perplexity merge`
    /// joins the N reports into the one a single process writes (docs/cluster.md).
    #[arg(long, value_name = "K/N")]
    pub shard: Option<String>,
    /// Keep a checkpoint of every finished window in DIR, and continue from
    /// the checkpoints already there (same plan only): an interrupted run
    /// resumed gives the report of an uninterrupted one.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Spread the windows over these CUDA devices (e.g. 0,1,2,3): one model
    /// copy, host thread and stream each, windows handed out in a fixed order,
    /// the report equal to a one-device run. An index may repeat (0,0: two
    /// workers on one device). With --backend cpu only 0s: CPU workers.
    #[arg(long, value_name = "LIST")]
    pub devices: Option<String>,
    /// Log verbosity on stderr.
    #[arg(long, value_enum, default_value_t = LogLevel::Info)]
    pub log_level: LogLevel,
}
