//! Validated run configuration: turns raw flags (`cli::Args`) into a
//! [`RunConfig`] whose every field is known to be usable, or a one-line error.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::backend::{
    effective_prefill_chunk, ExecutionSpec, Precision, PrefillChunk, FAST_PATHS, FAST_PATH_ATTN_F16, FAST_PATH_ATTN_FP8_QK, FAST_PATH_ATTN_INT8_QK, FAST_PATH_LM_HEAD_FUSED,
};
use crate::cli::{Args, BackendArg, MethodArg};
use crate::kv::{KvFormat, KvRotation};
use crate::plan::{validate_prefill_chunk, Method, Shard};

/// Where the streams come from.
#[derive(Debug, Clone)]
pub enum Input {
    Text(PathBuf),
    Tokens(PathBuf),
    /// `manifest` `None`: the corpus compiled into the binary.
    Corpus { manifest: Option<PathBuf>, quick: bool, data_root: Option<PathBuf> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    Auto,
    Cuda { device: usize },
    Cpu,
}

#[derive(Debug, Clone)]
pub struct RunConfig {
    pub model: PathBuf,
    pub input: Input,
    pub method: Method,
    pub chunks_limit: Option<usize>,
    /// The prefill chunk every pass uses: `execution.prefill_chunk_tokens.effective`.
    pub prefill_chunk: usize,
    /// `--batch-tokens`: the most rows of one batched prefill pass; `None`: the
    /// backend's default ([`default_batch_tokens`]).
    pub batch_tokens: Option<usize>,
    pub backend: BackendChoice,
    pub device: usize,
    /// Every numeric setting (route, KV format, fast paths, ...). Its
    /// `matmul_inputs` are the CPU's (f32, bf16 under `--emulate-bf16-tc`);
    /// [`RunConfig::spec_for_cuda`] gives CUDA's (bf16 unless `--lossless`).
    pub execution: ExecutionSpec,
    pub threads: usize,
    /// The output folder; created (or checked empty) before any work.
    pub output: PathBuf,
    pub dry_run: bool,
    pub verify: bool,
    pub allow_nonfinite: bool,
    /// Score twice (second time with another prefill chunk) and record the noise floor.
    pub noise_floor: bool,
    /// `--save-top-tokens FILE`.
    pub save_top_tokens: Option<PathBuf>,
    /// `--kl-reference FILE`.
    pub kl_reference: Option<PathBuf>,
    /// `--save-tokens FILE`.
    pub save_tokens: Option<PathBuf>,
    /// `--plots`: SVG charts beside report.json.
    pub plots: bool,
    /// `--verify-invariance N`: windows rescored alone (at least 1).
    pub verify_invariance: Option<usize>,
    /// `--target-uncertainty X`: the 95 % half-width (nats) to stop at.
    pub target_uncertainty: Option<f64>,
    /// `--shard K/N`: score only this shard's windows.
    pub shard: Option<Shard>,
    /// `--resume DIR`: per-window checkpoints.
    pub resume: Option<PathBuf>,
    /// `--devices LIST`: one scoring worker per entry (empty: one worker on `device`).
    pub devices: Vec<usize>,
}

impl RunConfig {
    pub fn from_args(args: &Args) -> Result<Self> {
        if args.model.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            let out = args.model.with_extension("ninfer");
            bail!(
                "{}: this program reads .ninfer artifacts; convert it first with `ninfer-convert {} --out {}`",
                args.model.display(),
                args.model.display(),
                out.display()
            );
        }
        let input = match (&args.text, &args.tokens, &args.corpus) {
            (Some(t), None, None) => Input::Text(t.clone()),
            (None, Some(t), None) => Input::Tokens(t.clone()),
            (None, None, m) => Input::Corpus { manifest: m.clone(), quick: args.quick, data_root: args.data_root.clone() },
            _ => bail!("give only one of --text, --tokens, --corpus"),
        };
        // --ppl-stride S is --method ppl-stride --stride S (llama.cpp's spelling).
        let method = match (args.method, args.ppl_stride) {
            (MethodArg::Chunks, Some(_)) => bail!("--ppl-stride selects the ppl-stride method: drop --method chunks"),
            (MethodArg::PplStride, None) => ppl_stride_method(args.context, args.stride)?,
            (_, Some(stride)) => ppl_stride_method(args.context, stride)?,
            (MethodArg::Sliding, None) => {
                if args.stride == 0 {
                    bail!("--stride 0: the stride must be at least 1");
                }
                if args.context <= args.stride {
                    bail!("--context {} must be larger than --stride {}", args.context, args.stride);
                }
                Method::Sliding { context: args.context, stride: args.stride }
            }
            (MethodArg::Chunks, None) => {
                if args.context < 4 {
                    bail!("--context {}: a chunk needs at least 4 tokens", args.context);
                }
                Method::Chunks { context: args.context }
            }
        };
        // llama.cpp's --kl-divergence-base FILE writes FILE, or with --kl-divergence reads it back.
        let (save_top_tokens, kl_reference) = match (&args.kl_divergence_base, args.kl_divergence) {
            (Some(base), true) => (None, Some(base.clone())),
            (Some(base), false) => (Some(base.clone()), None),
            (None, _) => (args.save_top_tokens.clone(), args.kl_reference.clone()),
        };
        if args.chunks == Some(0) {
            bail!("--chunks 0: nothing would be scored");
        }
        validate_prefill_chunk(args.prefill_chunk).context("--prefill-chunk")?;
        if args.batch_tokens == Some(0) {
            bail!("--batch-tokens 0: a pass needs at least one row");
        }
        let backend = match args.backend {
            BackendArg::Auto => BackendChoice::Auto,
            BackendArg::Cuda => BackendChoice::Cuda { device: args.device },
            BackendArg::Cpu => BackendChoice::Cpu,
        };
        if args.emulate_bf16_tc && backend != BackendChoice::Cpu {
            bail!("--emulate-bf16-tc emulates the CUDA default route on the CPU backend: add --backend cpu");
        }
        if args.emulate_bf16_tc && (args.lossless || args.reference) {
            let flag = if args.reference { "--reference" } else { "--lossless" };
            bail!("--emulate-bf16-tc with {flag}: the lossless route rounds no matmul input; pick one");
        }
        let n_cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let execution = execution_spec(args)?;
        let threads = match args.threads {
            Some(0) => bail!("--threads 0: at least one thread"),
            Some(n) if n > n_cpus => bail!("--threads {n}: this machine runs {n_cpus} threads at once (at most --threads {n_cpus})"),
            Some(n) => n,
            None => n_cpus,
        };
        if args.dry_run && save_top_tokens.is_some() {
            bail!("--save-top-tokens needs scoring: drop --dry-run");
        }
        let shard = args.shard.as_deref().map(Shard::parse).transpose()?;
        // --save-top-tokens, --kl-reference and --save-tokens work with all three (docs/cluster.md).
        let with = [(args.noise_floor, "--noise-floor")];
        let devices = match &args.devices {
            None => Vec::new(),
            Some(list) => parse_devices(list, backend)?,
        };
        for (on, mode) in [(shard.is_some(), "--shard"), (args.resume.is_some(), "--resume"), (devices.len() > 1, "--devices")] {
            if let Some((_, flag)) = with.iter().find(|(with, _)| on && *with) {
                bail!("{mode} with {flag} is not supported yet: run without {mode}, or without {flag}");
            }
        }
        if args.resume.is_some() && args.dry_run {
            bail!("--resume keeps checkpoints of scored windows: drop --dry-run");
        }
        // Output paths against inputs and special files: `util::outputs`, when the run starts.
        let output = match &args.output {
            Some(dir) => dir.clone(),
            None => PathBuf::from("profiles/perplexity").join(timestamp_utc()),
        };
        check_report_extras(args)?;
        Ok(Self {
            model: args.model.clone(),
            input,
            method,
            chunks_limit: args.chunks,
            prefill_chunk: execution.prefill_chunk_tokens.effective,
            batch_tokens: args.batch_tokens,
            backend,
            device: args.device,
            execution,
            threads,
            output,
            dry_run: args.dry_run,
            verify: args.verify,
            allow_nonfinite: args.allow_nonfinite,
            noise_floor: args.noise_floor,
            save_top_tokens,
            kl_reference,
            save_tokens: args.save_tokens.clone(),
            plots: args.plots,
            verify_invariance: args.verify_invariance,
            target_uncertainty: args.target_uncertainty,
            shard,
            resume: args.resume.clone(),
            devices,
        })
    }
}

/// `--devices 0,1,...`: device indices (repeats allowed); on the CPU backend only 0.
fn parse_devices(list: &str, backend: BackendChoice) -> Result<Vec<usize>> {
    let devices: Vec<usize> = list
        .split(',')
        .map(|d| d.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| anyhow::anyhow!("--devices {list}: expected device indices separated by commas (e.g. 0,1)"))?;
    if devices.is_empty() || devices.len() > 64 {
        bail!("--devices {list}: give 1 to 64 devices");
    }
    if backend == BackendChoice::Cpu && devices.iter().any(|&d| d != 0) {
        bail!("--devices {list} with --backend cpu: the CPU is device 0 only (0,0 runs two CPU workers)");
    }
    Ok(devices)
}

impl RunConfig {
    /// The spec as the CUDA backend runs it: its default route feeds bf16 to
    /// the tensor cores (matmuls and LM head); `--lossless` keeps f32.
    pub fn spec_for_cuda(&self) -> ExecutionSpec {
        let p = if self.execution.lossless { Precision::F32 } else { Precision::Bf16 };
        ExecutionSpec { matmul_inputs: p, lm_head_inputs: p, ..self.execution.clone() }
    }
}

/// `--plots`, `--verify-invariance`, `--target-uncertainty`: values and
/// the combinations that cannot work, refused before any work.
fn check_report_extras(args: &Args) -> Result<()> {
    if args.dry_run {
        for (set, flag) in [(args.plots, "--plots"), (args.verify_invariance.is_some(), "--verify-invariance"), (args.target_uncertainty.is_some(), "--target-uncertainty")] {
            if set {
                bail!("{flag} needs scores: drop --dry-run");
            }
        }
    }
    if args.verify_invariance == Some(0) {
        bail!("--verify-invariance 0: give the number of windows to rescore alone (at least 1)");
    }
    if let Some(x) = args.target_uncertainty {
        if !(x.is_finite() && x > 0.0) {
            bail!("--target-uncertainty {x}: the target 95 % half-width must be a positive finite number of nats");
        }
        let refused = [
            (args.save_top_tokens.is_some() || args.kl_divergence_base.is_some(), "--save-top-tokens/--kl-divergence-base (the file covers every window)"),
            (args.save_tokens.is_some(), "--save-tokens (the file covers every window)"),
            (args.noise_floor, "--noise-floor (it rescores every window)"),
            (args.chunks.is_some(), "--chunks (early stop chooses the windows)"),
            (args.verify_invariance.is_some(), "--verify-invariance (it rescores the plan's first windows, which early stop may skip)"),
            (args.shard.is_some(), "--shard (early stop chooses windows from the whole plan)"),
            (args.resume.is_some(), "--resume (early stop keeps no checkpoints)"),
            (args.devices.is_some(), "--devices (early stop scores one window at a time)"),
        ];
        if let Some((_, what)) = refused.iter().find(|(set, _)| *set) {
            bail!("--target-uncertainty cannot be combined with {what}");
        }
    }
    Ok(())
}

/// The numeric flags checked together and turned into the run's [`ExecutionSpec`].
fn execution_spec(args: &Args) -> Result<ExecutionSpec> {
    let reference = args.reference;
    let lossless = args.lossless || reference;
    let kv_arg = match &args.kv_dtype {
        Some(name) => Some(name.parse::<KvFormat>().with_context(|| format!("--kv-dtype {name}"))?),
        None => None,
    };
    let kv_format = match (kv_arg, lossless && !reference) {
        (None, true) => KvFormat::F32,
        (None, false) => KvFormat::Fp8,
        (Some(f @ (KvFormat::F32 | KvFormat::Bf16)), true) => f,
        (Some(f), true) => bail!(
            "--kv-dtype {f} with --lossless: the lossless route keeps K and V exact (f32 or bf16); \
             --reference applies the {f} codec exactly"
        ),
        (Some(f), false) => f,
    };
    let kv_rotation = match &args.kv_rotation {
        Some(name) => name.parse::<KvRotation>().with_context(|| format!("--kv-rotation {name}"))?,
        None => KvRotation::Auto,
    };
    if kv_rotation != KvRotation::Auto && !kv_format.is_quantized() {
        bail!(
            "--kv-rotation {kv_rotation} with --kv-dtype {kv_format}: {kv_format} rows are never rotated \
             (the flag applies to the quantized formats; drop it or use auto)"
        );
    }
    for (flag, name) in args.fast_paths.iter().map(|n| ("--fast-path", n)).chain(args.no_fast_paths.iter().map(|n| ("--no-fast-path", n))) {
        if !FAST_PATHS.contains(&name.as_str()) {
            bail!("{flag} {name}: no such fast path (valid: {})", FAST_PATHS.join(", "));
        }
    }
    for name in &args.fast_paths {
        if args.no_fast_paths.contains(name) {
            bail!("--fast-path {name} and --no-fast-path {name}: choose one");
        }
        if name == FAST_PATH_ATTN_FP8_QK && kv_format != KvFormat::Fp8 {
            bail!("--fast-path {name} reads an fp8 cache: it needs --kv-dtype fp8 (the run's KV format is {kv_format})");
        }
        if name == FAST_PATH_ATTN_INT8_QK && !matches!(kv_format, KvFormat::Int8 | KvFormat::K8v4) {
            bail!("--fast-path {name} reads an int8 or k8v4 cache: it needs --kv-dtype int8 or k8v4 (the run's KV format is {kv_format})");
        }
        if name == FAST_PATH_LM_HEAD_FUSED && (args.save_top_tokens.is_some() || args.kl_reference.is_some()) {
            let flag = if args.save_top_tokens.is_some() { "--save-top-tokens" } else { "--kl-reference" };
            bail!("--fast-path {name} with {flag}: the fused LM head writes no logits, so it cannot give the top tokens {flag} needs");
        }
        if name == FAST_PATH_ATTN_INT8_QK && args.use_original_int8_prefill_kernel {
            bail!("--fast-path {name} and --use-original-int8-prefill-kernel: choose one");
        }
        if name == FAST_PATH_ATTN_F16 && !matches!(kv_format, KvFormat::Nvfp4 | KvFormat::K4v2 | KvFormat::Vq2) {
            bail!("--fast-path {name} reads an nvfp4, k4v2 or vq2 cache: it needs --kv-dtype nvfp4, k4v2 or vq2 (the run's KV format is {kv_format})");
        }
        if name == FAST_PATH_ATTN_F16 && args.use_original_nvfp4_prefill_kernel {
            bail!("--fast-path {name} and --use-original-nvfp4-prefill-kernel: choose one");
        }
        if lossless || args.reproducible {
            let flag = if reference { "--reference" } else if lossless { "--lossless" } else { "--reproducible" };
            bail!("--fast-path {name} with {flag}: fast paths change rounding and are off on that route");
        }
    }
    let originals = [
        ("--use-original-int8-prefill-kernel", args.use_original_int8_prefill_kernel, KvFormat::Int8),
        ("--use-original-nvfp4-prefill-kernel", args.use_original_nvfp4_prefill_kernel, KvFormat::Nvfp4),
    ];
    for (flag, on, needs) in originals {
        if !on {
            continue;
        }
        // The original kernel is the decoding one (kernel v3 on sm_90a at d 64 / 128, else v2):
        // for int8 the fast path attn-int8-qk is turned off, for nvfp4 attn-f16
        // (model::cuda_route).
        if kv_format != needs {
            bail!("{flag} needs --kv-dtype {needs} (the run's KV format is {kv_format})");
        }
    }
    let f = args.rope_yarn_factor;
    if !(f.is_finite() && (1.0..=4.0).contains(&f)) {
        bail!("--rope-yarn-factor {f}: must be a finite number in [1, 4] (1 is native RoPE)");
    }
    let requested = args.prefill_chunk;
    Ok(ExecutionSpec {
        matmul_inputs: if args.emulate_bf16_tc { Precision::Bf16 } else { Precision::F32 },
        lm_head_inputs: if args.emulate_bf16_tc { Precision::Bf16 } else { Precision::F32 },
        kv_format,
        kv_rotation,
        fast_paths: args.fast_paths.clone(),
        fast_paths_off: args.no_fast_paths.clone(),
        original_int8_prefill_kernel: args.use_original_int8_prefill_kernel,
        original_nvfp4_prefill_kernel: args.use_original_nvfp4_prefill_kernel,
        lossless,
        reference,
        reproducible: args.reproducible,
        rope_yarn_factor: f,
        prefill_chunk_tokens: PrefillChunk { requested, effective: effective_prefill_chunk(requested, kv_format) },
    })
}

/// The ppl-stride method for llama.cpp's `-c context --ppl-stride stride`.
fn ppl_stride_method(context: usize, stride: usize) -> Result<Method> {
    crate::plan::validate_ppl_stride(context, stride)?;
    Ok(Method::PplStride { context, stride })
}

/// `--batch-tokens` when not given: 32768 rows a pass on CUDA, 8192 on the CPU.
/// On the H200 (2026-12-02 18:21 UTC, one call, the same scores to every bit at each size;
/// docs/performance.md "Issue 12: larger passes") 32768 against 16384 measured +0.5-0.6 % (8B
/// Q4_0 twin, chunks c=512 and c=4096), +5.5-7.1 % (SmolLM2 twin) and +2.3-5.2 % (Gemma-3 twin);
/// 65536 gained a further 0.05-0.13 % on the 8B and 3.6-5.1 % on SmolLM2 for 1.7x the device
/// memory (28.2 GB against 16.4 at c=4096 on the 8B), so 32768. A pass that does not fit the device's
/// memory is halved (`Transformer::prepare`). The CPU keeps 8192, where a pass's memory (the LM
/// head's logits of every scored row) would grow for no measured gain.
pub fn default_batch_tokens(cuda: bool) -> usize {
    if cuda {
        32768
    } else {
        8192
    }
}

/// `YYYYMMDDTHHMMSSZ` for now, UTC.
pub fn timestamp_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use clap::Parser;

    fn cfg(extra: &[&str]) -> Result<RunConfig> {
        let mut argv = vec!["infernix-perplexity", "m.ninfer", "--text", "t.txt"];
        argv.extend_from_slice(extra);
        RunConfig::from_args(&Args::try_parse_from(argv)?)
    }

    #[test]
    fn rejects_bad_windows() {
        assert!(cfg(&["--context", "2048", "--stride", "2048"]).unwrap_err().to_string().contains("larger than --stride"));
        assert!(cfg(&["--stride", "0"]).unwrap_err().to_string().contains("--stride 0"));
        assert!(format!("{:#}", cfg(&["--prefill-chunk", "100"]).unwrap_err()).contains("--prefill-chunk"));
        assert!(cfg(&["--chunks", "0"]).is_err());
        let ok = cfg(&["--method", "chunks", "--context", "512"]).unwrap();
        assert_eq!(ok.method, Method::Chunks { context: 512 });
    }

    #[test]
    fn gguf_model_says_convert_first_and_no_input_is_the_bundled_corpus() {
        let args = Args::try_parse_from(["infernix-perplexity", "models/M.Q4_1.GGUF", "--quick"]).unwrap();
        let e = RunConfig::from_args(&args).unwrap_err().to_string();
        assert!(e.contains("convert it first with `ninfer-convert models/M.Q4_1.GGUF --out models/M.Q4_1.ninfer`"), "{e}");
        let args = Args::try_parse_from(["infernix-perplexity", "m.ninfer", "--quick"]).unwrap();
        let cfg = RunConfig::from_args(&args).unwrap();
        assert!(matches!(cfg.input, Input::Corpus { manifest: None, quick: true, data_root: None }), "{:?}", cfg.input);
        assert!(Args::try_parse_from(["infernix-perplexity", "m.ninfer", "--data-root", "d"]).is_err());
        assert!(Args::try_parse_from(["infernix-perplexity", "m.ninfer", "--quick", "--text", "t"]).is_err());
    }

    #[test]
    fn llama_cpp_spellings_are_aliases() {
        let args = Args::try_parse_from(["infernix-perplexity", "m.ninfer", "-f", "t.txt", "-c", "512", "--ppl-stride", "256", "--chunks", "3"]).unwrap();
        let c = RunConfig::from_args(&args).unwrap();
        assert_eq!(c.method, Method::PplStride { context: 512, stride: 256 });
        assert!(matches!(&c.input, Input::Text(p) if p == Path::new("t.txt")));
        assert_eq!(c.chunks_limit, Some(3));
        let c = RunConfig::from_args(&Args::try_parse_from(["x", "m.ninfer", "--file", "t", "--ctx-size", "128", "--method", "ppl-stride", "--stride", "64"]).unwrap()).unwrap();
        assert_eq!(c.method, Method::PplStride { context: 128, stride: 64 });
        assert!(cfg(&["--method", "chunks", "--ppl-stride", "4"]).unwrap_err().to_string().contains("drop --method chunks"));
        assert!(cfg(&["-c", "8", "--ppl-stride", "0"]).is_err());
        assert!(cfg(&["-c", "8", "--ppl-stride", "300"]).unwrap_err().to_string().contains("--ppl-stride 300"));
        // --kl-divergence-base writes the base; with --kl-divergence it is read back.
        let c = cfg(&["--kl-divergence-base", "b.topk"]).unwrap();
        assert_eq!((c.save_top_tokens.as_deref(), c.kl_reference.as_deref()), (Some(Path::new("b.topk")), None));
        let c = cfg(&["--kl-divergence-base", "b.topk", "--kl-divergence"]).unwrap();
        assert_eq!((c.save_top_tokens.as_deref(), c.kl_reference.as_deref()), (None, Some(Path::new("b.topk"))));
        assert!(cfg(&["--kl-divergence"]).is_err(), "--kl-divergence needs the base file");
        assert!(cfg(&["--kl-divergence-base", "b", "--kl-reference", "c"]).is_err());
    }

    #[test]
    fn rejects_clashing_top_token_files() {
        assert!(cfg(&["--save-top-tokens", "a", "--dry-run"]).unwrap_err().to_string().contains("--dry-run"));
        let ok = cfg(&["--save-top-tokens", "a", "--kl-reference", "b", "--save-tokens", "c"]).unwrap();
        assert_eq!(ok.kl_reference.as_deref(), Some(std::path::Path::new("b")));
    }

    #[test]
    fn threads_are_bounded_by_the_machine() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(cfg(&["--threads", &n.to_string()]).unwrap().threads, n);
        let e = cfg(&["--threads", &(n + 1).to_string()]).unwrap_err().to_string();
        assert!(e.contains("--threads") && e.contains(&format!("at most --threads {n}")), "{e}");
        assert!(cfg(&["--threads", "100000"]).is_err());
    }

    #[test]
    fn kv_format_defaults_and_lossless_rules() {
        let spec = |extra: &[&str]| cfg(extra).map(|c| c.execution);
        assert_eq!(spec(&[]).unwrap().kv_format, KvFormat::Fp8);
        let e = format!("{:#}", spec(&["--kv-dtype", "fp4"]).unwrap_err());
        assert!(e.starts_with("--kv-dtype fp4: unknown KV format") && e.contains("nvfp4"), "{e}");
        assert_eq!(spec(&["--kv-dtype", "vq2"]).unwrap().kv_format, KvFormat::Vq2);
        let l = spec(&["--lossless"]).unwrap();
        assert_eq!((l.kv_format, l.lossless, l.reference), (KvFormat::F32, true, false));
        assert_eq!(spec(&["--lossless", "--kv-dtype", "bf16"]).unwrap().kv_format, KvFormat::Bf16);
        let e = spec(&["--lossless", "--kv-dtype", "int8"]).unwrap_err().to_string();
        assert!(e.contains("--kv-dtype int8") && e.contains("--reference"), "{e}");
        let r = spec(&["--reference"]).unwrap();
        assert_eq!((r.kv_format, r.lossless, r.reference), (KvFormat::Fp8, true, true));
        let rb = spec(&["--reference", "--kv-dtype", "bf16"]).unwrap();
        assert_eq!((rb.kv_v().name(), rb.kv_k().name()), ("fp16".to_string(), "bf16".to_string()));
        assert_eq!(spec(&["--kv-dtype", "bf16"]).unwrap().kv_v().name(), "bf16");
        assert!(spec(&["--reference", "--reproducible"]).unwrap().reproducible);
        let c = cfg(&["--emulate-bf16-tc", "--backend", "cpu"]).unwrap();
        assert_eq!(c.execution.matmul_inputs, Precision::Bf16);
        assert_eq!(cfg(&[]).unwrap().spec_for_cuda().matmul_inputs, Precision::Bf16);
        assert_eq!(cfg(&["--lossless"]).unwrap().spec_for_cuda().lm_head_inputs, Precision::F32);
        assert!(cfg(&["--reference", "--emulate-bf16-tc", "--backend", "cpu"]).unwrap_err().to_string().contains("--reference"));
    }

    #[test]
    fn route_flags_are_checked() {
        let err = |extra: &[&str]| cfg(extra).unwrap_err().to_string();
        assert!(err(&["--fast-path", "int8-attn"])
            .contains("--fast-path int8-attn: no such fast path (valid: delta-chunk-tf32, delta-chunk-3xtf32, attn-fp8-qk, attn-int8-qk, attn-f16, lm-head-fused)"));
        assert!(err(&["--no-fast-path", "int8-attn"]).contains("--no-fast-path int8-attn: no such fast path"));
        assert_eq!(cfg(&["--fast-path", "delta-chunk-tf32"]).unwrap().execution.fast_paths, vec!["delta-chunk-tf32".to_string()]);
        let off = cfg(&["--no-fast-path", "attn-fp8-qk"]).unwrap().execution;
        assert_eq!((off.fast_paths.len(), off.fast_paths_off), (0, vec!["attn-fp8-qk".to_string()]));
        assert!(err(&["--fast-path", "attn-fp8-qk", "--no-fast-path", "attn-fp8-qk"]).contains("choose one"));
        let e = err(&["--fast-path", "attn-fp8-qk", "--kv-dtype", "int8"]);
        assert!(e.contains("--fast-path attn-fp8-qk") && e.contains("needs --kv-dtype fp8"), "{e}");
        assert_eq!(cfg(&["--fast-path", "attn-fp8-qk"]).unwrap().execution.fast_paths, vec!["attn-fp8-qk".to_string()]);
        for flag in ["--lossless", "--reproducible", "--reference"] {
            let e = err(&["--fast-path", "delta-chunk-3xtf32", flag]);
            assert!(e.contains(&format!("--fast-path delta-chunk-3xtf32 with {flag}")), "{e}");
        }
        let e = err(&["--use-original-int8-prefill-kernel"]);
        assert!(e.contains("needs --kv-dtype int8") && e.contains("fp8"), "{e}");
        let c = cfg(&["--use-original-int8-prefill-kernel", "--kv-dtype", "int8"]).unwrap();
        assert!(c.execution.original_int8_prefill_kernel);
        let e = err(&["--fast-path", "attn-int8-qk", "--kv-dtype", "fp8"]);
        assert!(e.contains("needs --kv-dtype int8 or k8v4"), "{e}");
        let e = err(&["--fast-path", "attn-int8-qk", "--kv-dtype", "int8", "--use-original-int8-prefill-kernel"]);
        assert!(e.contains("choose one"), "{e}");
        assert_eq!(cfg(&["--fast-path", "attn-int8-qk", "--kv-dtype", "k8v4"]).unwrap().execution.fast_paths, vec!["attn-int8-qk".to_string()]);
        for kv in ["fp8", "int8", "k8v4", "bf16"] {
            let e = err(&["--fast-path", "attn-f16", "--kv-dtype", kv]);
            assert!(e.contains("--fast-path attn-f16") && e.contains("needs --kv-dtype nvfp4, k4v2 or vq2"), "{e}");
        }
        for kv in ["nvfp4", "k4v2", "vq2"] {
            assert_eq!(cfg(&["--fast-path", "attn-f16", "--kv-dtype", kv]).unwrap().execution.fast_paths, vec!["attn-f16".to_string()]);
        }
        let e = err(&["--fast-path", "attn-f16", "--kv-dtype", "nvfp4", "--use-original-nvfp4-prefill-kernel"]);
        assert!(e.contains("--fast-path attn-f16 and --use-original-nvfp4-prefill-kernel: choose one"), "{e}");
        let e = err(&["--fast-path", "lm-head-fused", "--save-top-tokens", "top.bin"]);
        assert!(e.contains("--fast-path lm-head-fused with --save-top-tokens"), "{e}");
        let e = err(&["--fast-path", "lm-head-fused", "--kl-reference", "top.bin"]);
        assert!(e.contains("--fast-path lm-head-fused with --kl-reference"), "{e}");
        assert_eq!(cfg(&["--fast-path", "lm-head-fused"]).unwrap().execution.fast_paths, vec!["lm-head-fused".to_string()]);
        assert!(err(&["--use-original-nvfp4-prefill-kernel", "--kv-dtype", "int8"]).contains("needs --kv-dtype nvfp4"));
        let c = cfg(&["--use-original-nvfp4-prefill-kernel", "--kv-dtype", "nvfp4"]).unwrap();
        assert!(c.execution.original_nvfp4_prefill_kernel && !c.execution.original_int8_prefill_kernel);
        for bad in ["0.5", "4.5", "NaN", "inf"] {
            assert!(err(&["--rope-yarn-factor", bad]).contains("--rope-yarn-factor"), "{bad}");
        }
        assert_eq!(cfg(&["--rope-yarn-factor", "4"]).unwrap().execution.rope_yarn_factor, 4.0);
        let c = cfg(&["--prefill-chunk", "384"]).unwrap();
        assert_eq!(c.execution.prefill_chunk_tokens, PrefillChunk { requested: 384, effective: 384 });
        assert_eq!(c.prefill_chunk, 384);
    }

    #[test]
    fn timestamp_shape() {
        let t = timestamp_utc();
        assert_eq!(t.len(), 16);
        assert!(t.starts_with("20") && t.ends_with('Z'));
    }
}
