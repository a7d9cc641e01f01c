//! Prefill attention benchmark on the GPU (not a timed test): causal, context
//! 4096, bf16 KV, FlashAttention's benchmark shapes (batch 16384 / seqlen,
//! heads 2048 / head dim, MHA), the kernels side by side (`ops::AttnKernel`),
//! timed with CUDA events (3 warm-up launches, then the median of 20), TFLOP/s
//! counted as FlashAttention counts them (4 * batch * seqlen^2 * heads * d / 2
//! for causal), next to this project's targets and FlashAttention-2/3's
//! published H100 figures at seqlen 4096 (causal, bf16; from the research notes
//! in ../shared/research/speed-and-kv-facts.md). Also the two real models'
//! attention shapes (SmolLM2: 9/3 heads of 64; Gemma-3-270M: 4/1 heads of 256,
//! sliding window 512). Kernel v3 (wgmma, kernels/attention_sm90a.cu) first, on
//! the shapes and caches it covers (bf16 and every quantized format; d_head 64/128), then kernel v2
//! (exactly v2: `ops::attention_exact`, `ops::attention_coded_exact`) on bf16 and on a
//! cache of each quantized format (src/kv's rows, encoded by `kv_encode` from the
//! same kind of random values; its tile loads decode and round to bf16, rotated
//! formats rotate q and the output in the kernel) on the same shapes, for the
//! quantized formats' target (within 20 % of bf16). Beside each fp8 row of v3, the fast
//! path attn-fp8-qk (`v3+qk`: Q·Kᵀ by e4m3 wgmma on K's stored codes); beside each int8
//! and k8v4 row, attn-int8-qk (`v3+qk`: by f16 wgmma on K's codes written in f16);
//! beside each nvfp4, k4v2 and vq2 row, attn-f16 (`v3+f16`: K and V decoded to f16).
//! Prints one `BENCH` line per row.
//! For one device call, `INFERNIX_BENCH_SHAPES`, `INFERNIX_BENCH_FORMATS` and
//! `INFERNIX_BENCH_V3_ONLY=1` narrow the rows (main()).
//!
//!   cargo bench --bench attention --no-run   (here; carry the executable)
//!   ./attention                             (on the GPU machine)
//!
//! Without a CUDA device or kernels it prints why and exits 2.

use anyhow::{bail, Context, Result};
use half::bf16;
use infernix_perplexity::backend::cuda::ops::{self, AttnKernel, AttnParams, KvShape};
use infernix_perplexity::backend::cuda::{self as cuda, CudaDevice, DeviceBuffer};
use infernix_perplexity::kv::KvFormat;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

struct Shape {
    name: &'static str,
    n_seqs: usize,
    n_tokens: usize,
    n_heads: usize,
    n_kv_heads: usize,
    d_head: usize,
    window: usize,
    /// (target TFLOP/s, FA2 H100, FA3 H100) where published.
    targets: Option<(f64, f64, f64)>,
}

fn random_bf16(rng: &mut ChaCha8Rng, n: usize) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_f32(rng.gen_range(-1.0f32..1.0))).collect()
}

/// Median milliseconds of `reps` launches, each between two CUDA events.
fn time_ms(dev: &CudaDevice, reps: usize, mut launch: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        launch()?;
    }
    dev.synchronize()?;
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = dev.stream().record_event(flags).context("recording a CUDA event")?;
        launch()?;
        let end = dev.stream().record_event(flags).context("recording a CUDA event")?;
        times.push(start.elapsed_ms(&end).context("reading CUDA event times")? as f64);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[reps / 2])
}

/// One row: `format` bf16 or a quantized format, on exactly `kernel`; `qk`: kernel v3's
/// fast path attn-fp8-qk (`ops::attention_coded_fp8_qk`, fp8) or attn-int8-qk
/// (`ops::attention_coded_int8_qk`, int8 and k8v4), row label `v3+qk`, or attn-f16
/// (`ops::attention_coded_f16`, nvfp4, k4v2 and vq2), row label `v3+f16`.
fn bench(dev: &CudaDevice, s: &Shape, kernel: AttnKernel, format: KvFormat, book: &ops::VqBook, rng: &mut ChaCha8Rng, qk: bool) -> Result<()> {
    let kv = KvShape { n_seqs: s.n_seqs, n_kv_heads: s.n_kv_heads, n_ctx: s.n_tokens, d_head: s.d_head };
    let width = s.n_heads * s.d_head;
    let n_rows = s.n_seqs * s.n_tokens;
    let q: Vec<f32> = (0..n_rows * width).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let qd = dev.upload(&q)?;
    let kc = dev.upload(&random_bf16(rng, kv.len()))?;
    let vc = dev.upload(&random_bf16(rng, kv.len()))?;
    // A quantized format: the same shape's rows encoded on the device from random f32.
    let quantized = format.is_quantized();
    let bytes = |c| if quantized { kv.coded_bytes(c) } else { 16 };
    let (mut kcq, mut vcq) = (dev.alloc_zeros::<u8>(bytes(format.k()))?, dev.alloc_zeros::<u8>(bytes(format.v()))?);
    if quantized {
        let mut n_bad = dev.alloc_zeros::<u64>(1)?;
        let src_w = s.n_kv_heads * s.d_head;
        for (c, codec) in [(&mut kcq, format.k()), (&mut vcq, format.v())] {
            let x: Vec<f32> = (0..n_rows * src_w).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            let xd = dev.upload(&x)?;
            ops::kv_encode(dev, codec, xd.view(), s.n_seqs, s.n_tokens, src_w, c.view_mut(), kv, 0, n_bad.view_mut(), Some(book))?;
        }
        if dev.download(&n_bad)?[0] != 0 {
            bail!("{}: the {format} encoder counted non-finite inputs in finite data", s.name);
        }
    }
    let mut out: DeviceBuffer<f32> = dev.upload(&vec![f32::NAN; n_rows * width])?;
    let p = AttnParams {
        n_seqs: s.n_seqs,
        n_tokens: s.n_tokens,
        n_heads: s.n_heads,
        pos0: 0,
        window: s.window,
        scale: 1.0 / (s.d_head as f32).sqrt(),
        softcap: 0.0,
        q_stride: width,
        out_stride: width,
    };
    let reps = if kernel == AttnKernel::V1 { 5 } else { 20 };
    let ms = if qk {
        match format {
            KvFormat::Fp8 => time_ms(dev, reps, || ops::attention_coded_fp8_qk::<f32>(dev, format, qd.view(), kcq.view(), vcq.view(), kv, out.view_mut(), &p))?,
            KvFormat::Int8 | KvFormat::K8v4 => {
                time_ms(dev, reps, || ops::attention_coded_int8_qk::<f32>(dev, format, qd.view(), kcq.view(), vcq.view(), kv, out.view_mut(), &p))?
            }
            _ => time_ms(dev, reps, || ops::attention_coded_f16::<f32>(dev, format, qd.view(), kcq.view(), vcq.view(), kv, out.view_mut(), &p, Some(book)))?,
        }
    } else if quantized {
        time_ms(dev, reps, || ops::attention_coded_exact::<f32>(dev, kernel, format, qd.view(), kcq.view(), vcq.view(), kv, out.view_mut(), &p, Some(book)))?
    } else {
        time_ms(dev, reps, || ops::attention_exact::<bf16, f32>(dev, kernel, qd.view(), kc.view(), vc.view(), kv, out.view_mut(), &p))?
    };
    let sample = dev.download_range(&out, 0..n_rows * width)?;
    let bad = sample.iter().filter(|v| !v.is_finite()).count();
    if bad > 0 {
        bail!("{} {} ({format}, qk {qk}): {bad} outputs not finite", s.name, kernel.name());
    }
    // FlashAttention's count: 4 * b * s^2 * h * d, halved for causal. With a window, the
    // visible pairs instead (each query sees min(pos + 1, window) keys).
    let pairs: f64 = if s.window == 0 {
        (s.n_tokens * s.n_tokens) as f64 / 2.0
    } else {
        (0..s.n_tokens).map(|t| (t + 1).min(s.window) as f64).sum()
    };
    let flop = 4.0 * s.n_seqs as f64 * pairs * s.n_heads as f64 * s.d_head as f64;
    let tflops = flop / (ms * 1e-3) / 1e12;
    let refs = match s.targets {
        Some((t, fa2, fa3)) => format!("target >= {t:.0}, FA2 (H100) {fa2:.0}, FA3 (H100) {fa3:.0}"),
        None => "-".to_string(),
    };
    println!(
        "BENCH attention {:<34} kernel {} {:<5} : {:9.3} ms  {:7.1} TFLOP/s   [{refs}]",
        s.name,
        if !qk {
            kernel.name()
        } else if matches!(format, KvFormat::Nvfp4 | KvFormat::K4v2 | KvFormat::Vq2) {
            "v3+f16"
        } else {
            "v3+qk"
        },
        format.name(),
        ms,
        tflops
    );
    Ok(())
}

fn main() -> Result<()> {
    let info = cuda::build_info();
    if !info.kernels_built || !cuda::driver_present() || cuda::device_count().unwrap_or(0) == 0 {
        eprintln!("attention bench: no CUDA device or kernels (kernels built: {})", info.kernels_built);
        std::process::exit(2);
    }
    let dev = CudaDevice::open(0)?;
    println!("BENCH device {} (kernels {} for compute_{})", dev.info(), info.sources_sha256, info.arch);
    let mut rng = ChaCha8Rng::seed_from_u64(4096);
    let shapes = [
        Shape { name: "causal ctx4096 d128 b4 h16", n_seqs: 4, n_tokens: 4096, n_heads: 16, n_kv_heads: 16, d_head: 128, window: 0, targets: Some((350.0, 319.0, 579.0)) },
        Shape { name: "causal ctx4096 d64 b4 h32", n_seqs: 4, n_tokens: 4096, n_heads: 32, n_kv_heads: 32, d_head: 64, window: 0, targets: Some((250.0, 284.0, 420.0)) },
        Shape { name: "causal ctx512 d128 b32 h16", n_seqs: 32, n_tokens: 512, n_heads: 16, n_kv_heads: 16, d_head: 128, window: 0, targets: None },
        Shape { name: "causal ctx512 d64 b32 h32", n_seqs: 32, n_tokens: 512, n_heads: 32, n_kv_heads: 32, d_head: 64, window: 0, targets: None },
        Shape { name: "causal ctx4096 d256 b4 h8", n_seqs: 4, n_tokens: 4096, n_heads: 8, n_kv_heads: 8, d_head: 256, window: 0, targets: None },
        Shape { name: "SmolLM2 9/3 d64 ctx4096 b8", n_seqs: 8, n_tokens: 4096, n_heads: 9, n_kv_heads: 3, d_head: 64, window: 0, targets: None },
        Shape { name: "Gemma-3 4/1 d256 ctx4096 b8 win512", n_seqs: 8, n_tokens: 4096, n_heads: 4, n_kv_heads: 1, d_head: 256, window: 512, targets: None },
        Shape { name: "Gemma-3 4/1 d256 ctx4096 b8 global", n_seqs: 8, n_tokens: 4096, n_heads: 4, n_kv_heads: 1, d_head: 256, window: 0, targets: None },
        // The 8B twin's passes at the default --batch-tokens 32768: chunks c=512 (64 windows) and c=4096 (8).
        Shape { name: "8B 32/8 d128 ctx512 b64", n_seqs: 64, n_tokens: 512, n_heads: 32, n_kv_heads: 8, d_head: 128, window: 0, targets: None },
        Shape { name: "8B 32/8 d128 ctx4096 b8", n_seqs: 8, n_tokens: 4096, n_heads: 32, n_kv_heads: 8, d_head: 128, window: 0, targets: None },
    ];
    let book = ops::VqBook::upload(&dev)?;
    // Narrowing for one device call (all optional): INFERNIX_BENCH_SHAPES (indices into
    // `shapes`), INFERNIX_BENCH_FORMATS (names), INFERNIX_BENCH_V3_ONLY=1 (no v2 / v1
    // rows).
    let list = |name: &str| std::env::var(name).ok().map(|v| v.split(',').map(|x| x.trim().to_string()).collect::<Vec<_>>());
    let shape_ix: Vec<usize> = match list("INFERNIX_BENCH_SHAPES") {
        Some(v) => v.iter().map(|x| x.parse().with_context(|| format!("INFERNIX_BENCH_SHAPES: {x:?}"))).collect::<Result<_>>()?,
        None => (0..shapes.len()).collect(),
    };
    let formats = list("INFERNIX_BENCH_FORMATS");
    let wanted = |f: KvFormat| formats.as_ref().is_none_or(|v| v.iter().any(|x| x == f.name()));
    let v3_only = std::env::var("INFERNIX_BENCH_V3_ONLY").is_ok_and(|v| v == "1");
    let chosen = || shape_ix.iter().filter_map(|&i| shapes.get(i));
    // Kernel v3 (wgmma, sm_90a) where it covers the shape and the cache.
    for format in KvFormat::ALL.into_iter().filter(|f| (*f == KvFormat::Bf16 || f.is_quantized()) && wanted(*f)) {
        for s in chosen() {
            if AttnKernel::covers(&dev, format.name(), s.d_head) {
                bench(&dev, s, AttnKernel::V3, format, &book, &mut rng, false)?;
            }
            // The fast path attn-fp8-qk beside fp8's v3 row.
            if format == KvFormat::Fp8 && ops::attn_fp8_qk_covers(&dev, s.d_head) {
                bench(&dev, s, AttnKernel::V3, format, &book, &mut rng, true)?;
            }
            // The fast path attn-int8-qk beside int8's and k8v4's v3 rows.
            if ops::attn_int8_qk_covers(&dev, format, s.d_head) {
                bench(&dev, s, AttnKernel::V3, format, &book, &mut rng, true)?;
            }
            // The fast path attn-f16 beside nvfp4's, k4v2's and vq2's v3 rows.
            if ops::attn_f16_covers(&dev, format, s.d_head) {
                bench(&dev, s, AttnKernel::V3, format, &book, &mut rng, true)?;
            }
        }
    }
    if v3_only {
        return Ok(());
    }
    for format in KvFormat::ALL.into_iter().filter(|f| (*f == KvFormat::Bf16 || f.is_quantized()) && wanted(*f)) {
        for s in chosen() {
            bench(&dev, s, AttnKernel::V2, format, &book, &mut rng, false)?;
        }
    }
    bench(&dev, &shapes[0], AttnKernel::V1, KvFormat::Bf16, &book, &mut rng, false)?;
    bench(&dev, &shapes[1], AttnKernel::V1, KvFormat::Bf16, &book, &mut rng, false)?;
    Ok(())
}
