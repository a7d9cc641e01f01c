//! Validated run configuration: turns raw flags (`cli::Args`) into a
//! [`RunConfig`] whose every field is known to be usable, or a one-line error.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::backend::KvDtype;
use crate::cli::{Args, BackendArg, KvDtypeArg, MethodArg};
use crate::plan::{validate_prefill_chunk, Method};

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
    pub prefill_chunk: usize,
    /// `--batch-tokens`: the most rows of one batched prefill pass.
    pub batch_tokens: usize,
    pub backend: BackendChoice,
    pub device: usize,
    /// The FP32 route on CUDA (`--lossless`); recorded, and a no-op, on the CPU.
    pub lossless: bool,
    /// `--kv-dtype`; `None` keeps the route's own.
    pub kv_dtype: Option<KvDtype>,
    /// `--emulate-bf16-tc` (CPU only): bf16 matrix-product inputs.
    pub emulate_bf16_tc: bool,
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
        if args.batch_tokens == 0 {
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
        if args.emulate_bf16_tc && args.lossless {
            bail!("--emulate-bf16-tc with --lossless: the lossless route rounds nothing; pick one");
        }
        let threads = match args.threads {
            Some(0) => bail!("--threads 0: at least one thread"),
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        if args.dry_run && save_top_tokens.is_some() {
            bail!("--save-top-tokens needs scoring: drop --dry-run");
        }
        let outputs = [("--save-top-tokens", &save_top_tokens), ("--save-tokens", &args.save_tokens)];
        for (flag, path) in outputs.iter().filter_map(|(f, p)| p.as_ref().map(|p| (*f, p))) {
            if kl_reference.as_ref() == Some(path) {
                bail!("{flag} {} is also the --kl-reference file", path.display());
            }
        }
        if save_top_tokens.is_some() && save_top_tokens == args.save_tokens {
            bail!("--save-top-tokens and --save-tokens name the same file");
        }
        let output = match &args.output {
            Some(dir) => dir.clone(),
            None => PathBuf::from("profiles/perplexity").join(timestamp_utc()),
        };
        Ok(Self {
            model: args.model.clone(),
            input,
            method,
            chunks_limit: args.chunks,
            prefill_chunk: args.prefill_chunk,
            batch_tokens: args.batch_tokens,
            backend,
            device: args.device,
            lossless: args.lossless,
            kv_dtype: match args.kv_dtype {
                KvDtypeArg::Auto => None,
                KvDtypeArg::Bf16 => Some(KvDtype::Bf16),
                KvDtypeArg::F32 => Some(KvDtype::F32),
            },
            emulate_bf16_tc: args.emulate_bf16_tc,
            threads,
            output,
            dry_run: args.dry_run,
            verify: args.verify,
            allow_nonfinite: args.allow_nonfinite,
            noise_floor: args.noise_floor,
            save_top_tokens,
            kl_reference,
            save_tokens: args.save_tokens.clone(),
        })
    }
}

/// The ppl-stride method for llama.cpp's `-c context --ppl-stride stride`.
fn ppl_stride_method(context: usize, stride: usize) -> Result<Method> {
    crate::plan::validate_ppl_stride(context, stride)?;
    Ok(Method::PplStride { context, stride })
}

/// Creates `dir` (and parents) or accepts it when it exists and is empty.
pub fn prepare_output_dir(dir: &Path) -> Result<()> {
    if dir.exists() {
        let mut entries = std::fs::read_dir(dir).with_context(|| format!("--output {}: read folder", dir.display()))?;
        if entries.next().is_some() {
            bail!("--output {}: the folder is not empty", dir.display());
        }
        return Ok(());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("--output {}: create folder", dir.display()))
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
        assert!(cfg(&["--save-top-tokens", "a", "--kl-reference", "a"]).unwrap_err().to_string().contains("--kl-reference"));
        assert!(cfg(&["--save-tokens", "a", "--save-top-tokens", "a"]).is_err());
        let ok = cfg(&["--save-top-tokens", "a", "--kl-reference", "b", "--save-tokens", "c"]).unwrap();
        assert_eq!(ok.kl_reference.as_deref(), Some(Path::new("b")));
    }

    #[test]
    fn timestamp_shape() {
        let t = timestamp_utc();
        assert_eq!(t.len(), 16);
        assert!(t.starts_with("20") && t.ends_with('Z'));
    }
}
