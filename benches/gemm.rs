//! GEMM benchmark (not a test): the default route's bf16 matmul on the
//! Llama-3-8B body's shapes at M = 8192 rows (N x K = 6144x4096 fused QKV,
//! 4096x4096 attention out, 28672x4096 fused gate/up, 4096x14336 down) for
//! BF16, Q8_0, Q4_0, Q4_K and Q6_K weights, against cuBLAS bf16 on the same
//! shapes as the ceiling.
//!
//! Per (shape, format): the whole matmul as the backend runs it
//! (`ops::matmul_bf16_with` on the wgmma kernel: dequantization of W to a bf16
//! scratch, then the GEMM; stored BF16 goes straight in), the dequantization
//! alone, and, unless `GEMM_BENCH_MMA=0`, the mma.sync kernel it replaces.
//! cuBLAS (cublasGemmEx, bf16 operands, f32 compute, default algorithm) once per
//! shape with f32 output (our contract) and with bf16 output. Each figure is the
//! median of `GEMM_BENCH_REPS` (default 20) launches timed one by one with CUDA
//! events after 3 warm-ups; TFLOP/s count 2·M·N·K. Inputs are random (seeded),
//! never zeros; the wgmma output is checked against cuBLAS's on every shape (bf16 weights;
//! a mismatch is printed as MISMATCH and fails the run at the end).
//!
//! Per shape (bf16 weights), the GEMM with each epilogue (`EPILOGUE` lines:
//! `ops::GemmEpilogue::TmaStore`, the default, against `Direct`, for y = x · Wᵀ
//! and y += x · Wᵀ; the two outputs must agree bit for bit), then the gated FFN
//! GEMM (gate and up 14336 x 4096, SiLU) with each epilogue, BF16 and Q4_0
//! (`GATED` lines).
//!
//! Q4_0 (gemm6): the producer dequant (`ops::GemmDequant::Producer`: no scratch, the
//! GEMM's producer warpgroup writes the bf16 B tile from the stored blocks) against
//! the scratch path, plain and gated, both with direct stores (`DEQUANT` lines; the
//! outputs must agree bit for bit).
//!
//! Then the attention's q, k, v projections (4096 + 1024 + 1024 rows, K 4096)
//! per format: the fused GEMM (`ops::matmul_qkv_bf16`) against three matmuls
//! (`QKV` lines).
//!
//! Build here: `cargo bench --bench gemm --no-run` (NVCC set); run the
//! executable on the GPU machine with libcublas on LD_LIBRARY_PATH (see
//! docs/performance.md). `GEMM_BENCH_M` overrides M.

#[path = "../tests/gpu_ops/twin.rs"]
#[allow(dead_code)]
mod twin;

use std::sync::Arc;

use anyhow::{anyhow, ensure, Context, Result};
use cudarc::cublas::{sys as blas, CudaBlas};
use cudarc::driver::sys::CUevent_flags;
use half::bf16;
use infernix_perplexity::artifact::format::TensorFormat;
use infernix_perplexity::backend::cuda::ops::{self, Activation, GemmDequant, GemmEpilogue, MatmulKernel};
use infernix_perplexity::backend::cuda::{CudaDevice, DeviceBuffer, QuantMatrix};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const SHAPES: [(&str, usize, usize); 4] = [("qkv", 6144, 4096), ("attn_out", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)];
const FORMATS: [TensorFormat; 5] = [TensorFormat::Bf16, TensorFormat::Q8_0, TensorFormat::Q4_0, TensorFormat::Q4K, TensorFormat::Q6K];
const WARMUP: usize = 3;

fn env_usize(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Ok(v) => v.parse().with_context(|| format!("{name}={v:?} is not a count")),
        Err(_) => Ok(default),
    }
}

/// Median milliseconds of `reps` launches of `f`, each between two CUDA events.
fn time_ms(dev: &CudaDevice, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..WARMUP {
        f()?;
    }
    dev.synchronize()?;
    let stream = dev.stream();
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| anyhow!("event: {e}"))?;
        f()?;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| anyhow!("event: {e}"))?;
        end.synchronize().map_err(|e| anyhow!("event synchronize: {e}"))?;
        times.push(start.elapsed_ms(&end).map_err(|e| anyhow!("event elapsed: {e}"))? as f64);
    }
    dev.synchronize()?;
    times.sort_by(f64::total_cmp);
    Ok(times[reps / 2])
}

/// y (m, n) row-major = x (m, k) · w (n, k)ᵀ through cuBLAS (column-major: yᵀ = w · xᵀ).
#[allow(clippy::too_many_arguments)]
fn cublas_gemm(blas_h: &CudaBlas, x: u64, w: u64, y: u64, m: usize, n: usize, k: usize, out_bf16: bool) -> Result<()> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    let c_type = if out_bf16 { blas::cudaDataType::CUDA_R_16BF } else { blas::cudaDataType::CUDA_R_32F };
    // SAFETY: x holds m*k bf16, w n*k bf16, y m*n elements of c_type (allocated by the caller);
    // alpha and beta are f32 for CUBLAS_COMPUTE_32F.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas_h.handle(),
            blas::cublasOperation_t::CUBLAS_OP_T,
            blas::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            m as i32,
            k as i32,
            (&alpha as *const f32).cast(),
            w as *const std::ffi::c_void,
            blas::cudaDataType::CUDA_R_16BF,
            k as i32,
            x as *const std::ffi::c_void,
            blas::cudaDataType::CUDA_R_16BF,
            k as i32,
            (&beta as *const f32).cast(),
            y as *mut std::ffi::c_void,
            c_type,
            n as i32,
            blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| anyhow!("cublasGemmEx {m}x{n}x{k}: {e:?}"))
}

fn main() -> Result<()> {
    let m = env_usize("GEMM_BENCH_M", 8192)?;
    let reps = env_usize("GEMM_BENCH_REPS", 20)?.max(1);
    let with_mma = std::env::var("GEMM_BENCH_MMA").map_or(true, |v| v != "0");
    let dev = CudaDevice::open(0).context("opening CUDA device 0")?;
    println!("DEVICE {}", dev.info());
    ensure!(dev.has_function(ops::GEMM_WGMMA_KERNEL), "this GPU did not load {} (sm_90a only)", ops::GEMM_WGMMA_KERNEL);
    let blas_h = CudaBlas::new(Arc::clone(dev.stream())).map_err(|e| anyhow!("creating a cuBLAS handle (is libcublas on LD_LIBRARY_PATH?): {e:?}"))?;
    let mut rng = ChaCha8Rng::seed_from_u64(0x6e6d_6d31);
    println!("GEMM M = {m}, median of {reps} event-timed launches after {WARMUP} warm-ups; TFLOP/s = 2MNK / time");
    println!(
        "{:<9} {:>6} {:>6} {:<5} | {:>8} {:>7} | {:>9} {:>7} | {:>8} {:>7} | {:>8} {:>8} | {:>7}",
        "shape", "N", "K", "fmt", "ours ms", "TFLOP/s", "% cuBLAS", "deq ms", "deq %", "GB/s", "mma ms", "TFLOP/s", "max|d|"
    );
    let mut rows = Vec::new();
    let mut mismatches = 0;
    for (label, n, k) in SHAPES {
        let flop = 2.0 * (m * n * k) as f64;
        let x: Vec<bf16> = (0..m * k).map(|_| bf16::from_f32(twin::normal(&mut rng))).collect();
        let xd: DeviceBuffer<bf16> = dev.upload(&x)?;
        drop(x);
        let mut y = dev.alloc_zeros::<f32>(m * n)?;
        let mut y_ref = dev.alloc_zeros::<f32>(m * n)?;
        let mut y_b16 = dev.alloc_zeros::<bf16>(m * n)?;
        let w_bf16 = QuantMatrix::upload(&dev, TensorFormat::Bf16, n, k, &twin::random_matrix(TensorFormat::Bf16, n, k, &mut rng))?;
        let (xp, wp) = (xd.view().ptr(), w_bf16.data.view().ptr());
        let (yrp, ybp) = (y_ref.view_mut().ptr(), y_b16.view_mut().ptr());
        let cublas_f32 = time_ms(&dev, reps, || cublas_gemm(&blas_h, xp, wp, yrp, m, n, k, false))?;
        let cublas_b16 = time_ms(&dev, reps, || cublas_gemm(&blas_h, xp, wp, ybp, m, n, k, true))?;
        println!(
            "{label:<9} {n:>6} {k:>6} cuBLAS bf16 x bf16: f32 out {cublas_f32:.3} ms ({:.1} TFLOP/s), bf16 out {cublas_b16:.3} ms ({:.1} TFLOP/s)",
            flop / cublas_f32 / 1e9,
            flop / cublas_b16 / 1e9
        );
        // Agreement with cuBLAS on the same bf16 operands (f32 accumulation both).
        ops::matmul_bf16_with(&dev, MatmulKernel::Wgmma, xd.view(), m, &w_bf16, y.view_mut(), n)?;
        let (ours, theirs) = (dev.download(&y)?, dev.download(&y_ref)?);
        let scale = theirs.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt() / (theirs.len() as f64).sqrt();
        let max_diff = ours.iter().zip(&theirs).map(|(a, b)| (*a as f64 - *b as f64).abs()).fold(0.0f64, f64::max);
        // Timings of a wrong kernel are still printed (marked), and the run fails at the end.
        if !ours.iter().all(|v| v.is_finite()) || max_diff.is_nan() || max_diff > 1e-3 * scale {
            println!("MISMATCH {label}: wgmma vs cuBLAS max |d| {max_diff:e} (rms of cuBLAS's output {scale:e}); non-finite: {}", ours.iter().filter(|v| !v.is_finite()).count());
            mismatches += 1;
        }
        // The epilogue on the same bf16 operands: TMA stores (the default) against stores
        // from registers, y = x · Wᵀ and y += x · Wᵀ; both buffers start at zero and see
        // the same launches, so their bits must agree.
        for accumulate in [false, true] {
            let mut y_direct = dev.alloc_zeros::<f32>(m * n)?;
            let mut y_tma = dev.alloc_zeros::<f32>(m * n)?;
            let direct = time_ms(&dev, reps, || ops::matmul_wgmma_with(&dev, GemmEpilogue::Direct, GemmDequant::Scratch, xd.view(), m, &w_bf16, y_direct.view_mut(), n, accumulate))?;
            let tma = time_ms(&dev, reps, || ops::matmul_wgmma_with(&dev, GemmEpilogue::TmaStore, GemmDequant::Scratch, xd.view(), m, &w_bf16, y_tma.view_mut(), n, accumulate))?;
            let (a, b) = (dev.download(&y_direct)?, dev.download(&y_tma)?);
            let n_diff = a.iter().zip(&b).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            println!(
                "EPILOGUE {label:<9} BF16 accumulate {accumulate:<5}: direct {direct:.3} ms ({:.1} TFLOP/s), TMA {tma:.3} ms ({:.1} TFLOP/s), TMA/direct {:.3}, {n_diff} outputs differ",
                flop / direct / 1e9,
                flop / tma / 1e9,
                tma / direct
            );
            if n_diff != 0 {
                println!("MISMATCH {label}: the TMA epilogue differs from the direct one in {n_diff} outputs");
                mismatches += 1;
            }
            rows.push(serde_json::json!({
                "shape": label, "m": m, "n": n, "k": k, "format": "BF16", "epilogue_ab": true, "accumulate": accumulate,
                "direct_ms": direct, "tma_ms": tma, "direct_tflops": flop / direct / 1e9, "tma_tflops": flop / tma / 1e9, "outputs_differ": n_diff,
            }));
        }
        drop(w_bf16);

        for format in FORMATS {
            let bytes = twin::random_matrix(format, n, k, &mut rng);
            let w = QuantMatrix::upload(&dev, format, n, k, &bytes)?;
            drop(bytes);
            let ours_ms = time_ms(&dev, reps, || ops::matmul_bf16_with(&dev, MatmulKernel::Wgmma, xd.view(), m, &w, y.view_mut(), n))?;
            let (deq_ms, deq_gbs) = if format == TensorFormat::Bf16 {
                (0.0, 0.0)
            } else {
                let mut scratch = dev.alloc_uninit::<bf16>(n * k)?;
                let t = time_ms(&dev, reps, || ops::dequant_bf16(&dev, &w, scratch.view_mut()))?;
                (t, (w.data.len() + 2 * n * k) as f64 / t / 1e6)
            };
            let mma_ms = if with_mma {
                time_ms(&dev, reps.min(5), || ops::matmul_bf16_with(&dev, MatmulKernel::MmaSync, xd.view(), m, &w, y.view_mut(), n))?
            } else {
                f64::NAN
            };
            let sample = dev.download_range(&y, 0..4096)?;
            ensure!(sample.iter().all(|v| v.is_finite()), "{label} {format}: non-finite output");
            if ops::gemm_producer_dequant_fits(&dev, &w) {
                // The producer dequant (no scratch, direct stores) against the scratch path
                // with direct stores: the same operands, so the same bits.
                let mut y_prod = dev.alloc_zeros::<f32>(m * n)?;
                let mut y_scr = dev.alloc_zeros::<f32>(m * n)?;
                let prod_ms = time_ms(&dev, reps, || ops::matmul_wgmma_with(&dev, GemmEpilogue::Direct, GemmDequant::Producer, xd.view(), m, &w, y_prod.view_mut(), n, false))?;
                let scr_ms = time_ms(&dev, reps, || ops::matmul_wgmma_with(&dev, GemmEpilogue::Direct, GemmDequant::Scratch, xd.view(), m, &w, y_scr.view_mut(), n, false))?;
                let (a, b) = (dev.download(&y_prod)?, dev.download(&y_scr)?);
                let n_diff = a.iter().zip(&b).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                println!(
                    "DEQUANT {label:<9} {}: producer {prod_ms:.3} ms ({:.1} TFLOP/s), scratch + direct {scr_ms:.3} ms ({:.1}), default route {ours_ms:.3} ms; producer/default {:.3}, {n_diff} outputs differ",
                    format.name(),
                    flop / prod_ms / 1e9,
                    flop / scr_ms / 1e9,
                    prod_ms / ours_ms
                );
                if n_diff != 0 {
                    println!("MISMATCH {label} {format}: the producer dequant differs from the scratch path in {n_diff} outputs");
                    mismatches += 1;
                }
                rows.push(serde_json::json!({
                    "shape": label, "m": m, "n": n, "k": k, "format": format.name(), "dequant_ab": true,
                    "producer_ms": prod_ms, "scratch_direct_ms": scr_ms, "default_ms": ours_ms, "outputs_differ": n_diff,
                    "producer_tflops": flop / prod_ms / 1e9, "pct_of_cublas_f32_out": 100.0 * cublas_f32 / prod_ms,
                }));
            }
            let tflops = flop / ours_ms / 1e9;
            println!(
                "{label:<9} {n:>6} {k:>6} {:<5} | {ours_ms:>8.3} {tflops:>7.1} | {:>8.1}% {deq_ms:>7.3} | {:>7.1}% {deq_gbs:>7.0} | {mma_ms:>8.3} {:>8.1} | {:>7.1e}",
                format.name(),
                100.0 * cublas_f32 / ours_ms,
                100.0 * deq_ms / ours_ms,
                flop / mma_ms / 1e9,
                max_diff,
            );
            rows.push(serde_json::json!({
                "shape": label, "m": m, "n": n, "k": k, "format": format.name(),
                "ms": ours_ms, "tflops": tflops, "dequant_ms": deq_ms, "dequant_gbs": deq_gbs,
                "mma_sync_ms": mma_ms, "cublas_f32_out_ms": cublas_f32, "cublas_bf16_out_ms": cublas_b16,
                "pct_of_cublas_f32_out": 100.0 * cublas_f32 / ours_ms,
                "pct_of_cublas_bf16_out": 100.0 * cublas_b16 / ours_ms,
                "max_abs_diff_vs_cublas_bf16": max_diff,
            }));
        }
    }
    // The gated FFN GEMM of the 8B body (gate and up 14336 x 4096, SiLU, bf16 out): both
    // epilogues, stored BF16 and Q4_0 weights (Q4_0: both dequantizations included).
    {
        let (n_ffn, k) = (14336usize, 4096usize);
        let flop = 2.0 * (m * 2 * n_ffn * k) as f64;
        let x: Vec<bf16> = (0..m * k).map(|_| bf16::from_f32(twin::normal(&mut rng))).collect();
        let xd: DeviceBuffer<bf16> = dev.upload(&x)?;
        drop(x);
        let mut out_direct = dev.alloc_zeros::<bf16>(m * n_ffn)?;
        let mut out_tma = dev.alloc_zeros::<bf16>(m * n_ffn)?;
        for format in [TensorFormat::Bf16, TensorFormat::Q4_0] {
            let wg = QuantMatrix::upload(&dev, format, n_ffn, k, &twin::random_matrix(format, n_ffn, k, &mut rng))?;
            let wu = QuantMatrix::upload(&dev, format, n_ffn, k, &twin::random_matrix(format, n_ffn, k, &mut rng))?;
            let gated = |epi: GemmEpilogue, out: &mut DeviceBuffer<bf16>| ops::matmul_gated_bf16_with(&dev, epi, GemmDequant::Scratch, Activation::Silu, xd.view(), m, &wg, &wu, out.view_mut());
            let direct = time_ms(&dev, reps, || gated(GemmEpilogue::Direct, &mut out_direct))?;
            let tma = time_ms(&dev, reps, || gated(GemmEpilogue::TmaStore, &mut out_tma))?;
            let (a, b) = (dev.download(&out_direct)?, dev.download(&out_tma)?);
            let n_diff = a.iter().zip(&b).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            ensure!(a.iter().all(|v| v.is_finite()), "gated {format}: non-finite output");
            println!(
                "GATED {m} x {n_ffn} x {k} {:<5}: direct {direct:.3} ms ({:.1} TFLOP/s), TMA {tma:.3} ms ({:.1} TFLOP/s), TMA/direct {:.3}, {n_diff} outputs differ",
                format.name(),
                flop / direct / 1e9,
                flop / tma / 1e9,
                tma / direct
            );
            if n_diff != 0 {
                println!("MISMATCH gated {format}: the TMA epilogue differs from the direct one in {n_diff} outputs");
                mismatches += 1;
            }
            rows.push(serde_json::json!({
                "shape": "gated_silu", "m": m, "n_ffn": n_ffn, "k": k, "format": format.name(),
                "direct_ms": direct, "tma_ms": tma, "direct_tflops": flop / direct / 1e9, "tma_tflops": flop / tma / 1e9, "outputs_differ": n_diff,
            }));
            if ops::gemm_producer_dequant_fits(&dev, &wg) {
                let mut out_prod = dev.alloc_zeros::<bf16>(m * n_ffn)?;
                let prod = time_ms(&dev, reps, || {
                    ops::matmul_gated_bf16_with(&dev, GemmEpilogue::Direct, GemmDequant::Producer, Activation::Silu, xd.view(), m, &wg, &wu, out_prod.view_mut())
                })?;
                let p = dev.download(&out_prod)?;
                let n_diff = p.iter().zip(&a).filter(|(p, a)| p.to_bits() != a.to_bits()).count();
                println!(
                    "DEQUANT GATED {m} x {n_ffn} x {k} {:<5}: producer {prod:.3} ms ({:.1} TFLOP/s), scratch + direct {direct:.3} ms; producer/scratch {:.3}, {n_diff} outputs differ",
                    format.name(),
                    flop / prod / 1e9,
                    prod / direct
                );
                if n_diff != 0 {
                    println!("MISMATCH gated {format}: the producer dequant differs from the scratch path in {n_diff} outputs");
                    mismatches += 1;
                }
                rows.push(serde_json::json!({
                    "shape": "gated_silu", "m": m, "n_ffn": n_ffn, "k": k, "format": format.name(), "dequant_ab": true,
                    "producer_ms": prod, "scratch_direct_ms": direct, "producer_tflops": flop / prod / 1e9, "outputs_differ": n_diff,
                }));
            }
        }
    }
    // The attention's q, k, v projections of the 8B body (4096 + 1024 + 1024 rows, K 4096):
    // one fused GEMM over the stacked weights (ops::matmul_qkv_bf16) against three matmuls.
    let (widths, k) = ([4096usize, 1024, 1024], 4096usize);
    let flop = 2.0 * (m * widths.iter().sum::<usize>() * k) as f64;
    let x: Vec<bf16> = (0..m * k).map(|_| bf16::from_f32(twin::normal(&mut rng))).collect();
    let xd: DeviceBuffer<bf16> = dev.upload(&x)?;
    drop(x);
    let mut ys = [dev.alloc_zeros::<f32>(m * widths[0])?, dev.alloc_zeros::<f32>(m * widths[1])?, dev.alloc_zeros::<f32>(m * widths[2])?];
    println!("QKV {m} x ({widths:?}) x {k}: fused = ops::matmul_qkv_bf16 (one scratch, one GEMM), three = 3 x matmul (wgmma)");
    for format in FORMATS {
        let ws = widths.map(|w| QuantMatrix::upload(&dev, format, w, k, &twin::random_matrix(format, w, k, &mut rng)));
        let [Ok(wq), Ok(wk), Ok(wv)] = ws else { anyhow::bail!("uploading the {format} q/k/v weights") };
        let w3 = [&wq, &wk, &wv];
        let three = time_ms(&dev, reps, || {
            for (w, y) in w3.iter().zip(ys.iter_mut()) {
                ops::matmul_bf16_with(&dev, MatmulKernel::Wgmma, xd.view(), m, w, y.view_mut(), w.n_rows)?;
            }
            Ok(())
        })?;
        let fused = time_ms(&dev, reps, || {
            let [y0, y1, y2] = &mut ys;
            ops::matmul_qkv_bf16(&dev, xd.view(), m, w3, None, [y0.view_mut(), y1.view_mut(), y2.view_mut()])
        })?;
        let sample = dev.download_range(&ys[2], 0..4096)?;
        ensure!(sample.iter().all(|v| v.is_finite()), "qkv {format}: non-finite output");
        println!(
            "QKV {:<5} fused {fused:.3} ms ({:.1} TFLOP/s), three {three:.3} ms ({:.1} TFLOP/s), fused/three {:.3}",
            format.name(),
            flop / fused / 1e9,
            flop / three / 1e9,
            fused / three
        );
        rows.push(serde_json::json!({
            "shape": "qkv_fused_vs_three", "m": m, "widths": widths, "k": k, "format": format.name(),
            "fused_ms": fused, "three_ms": three, "fused_tflops": flop / fused / 1e9, "three_tflops": flop / three / 1e9,
        }));
    }
    if let Some(out) = std::env::var_os("GEMM_BENCH_JSON") {
        std::fs::write(&out, serde_json::to_string_pretty(&rows)?).with_context(|| format!("writing {}", out.to_string_lossy()))?;
    }
    ensure!(mismatches == 0, "{mismatches} shape(s) where the wgmma GEMM disagrees with cuBLAS");
    Ok(())
}
