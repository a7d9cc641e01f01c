//! Gated DeltaNet mixing-step benchmark on the GPU (not a timed test): the
//! exact per-token recurrence (`delta_net_scan`, f64) against the chunked
//! tensor-core scans (fast paths `delta-chunk-tf32`, `delta-chunk-3xtf32`) on
//! Qwen3-Next-80B-A3B's linear-attention shape (16 key heads, 32 value heads,
//! d_k = d_v = 128, convolution width 4), windows of 4096 tokens, 1, 4 and 8
//! windows per pass. Each row times the whole mixing step as the backend runs
//! it (delta_net_conv, then the scan, then for the chunked scans
//! delta_net_gated_norm) and the scan alone, with CUDA events (2 warm-up
//! launches, then the median of `reps`; the carried state keeps evolving from
//! launch to launch, the same work each time). Prints one
//! `BENCH` line per row: milliseconds, tokens/s (windows x tokens / time) and
//! the speed-up over the exact scan at the same windows.
//!
//!   cargo bench --bench delta_net --no-run   (here; carry the executable)
//!   ./delta_net                              (on the GPU machine)
//!
//! Without a CUDA device or kernels it prints why and exits 2.

use anyhow::{Context, Result};
use infernix_perplexity::backend::cuda::delta_net::{self as dn, DeltaScan};
use infernix_perplexity::backend::cuda::{self as cuda, CudaDevice};
use infernix_perplexity::backend::{DeltaNetParams, DeltaNetWeights, PassRows};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Median milliseconds of `reps` launches, each between two CUDA events (after 2 warm-up launches).
fn time_ms(dev: &CudaDevice, reps: usize, mut launch: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
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

fn uniform(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(lo..hi)).collect()
}

fn main() -> Result<()> {
    let info = cuda::build_info();
    if !info.kernels_built || !cuda::driver_present() || cuda::device_count().unwrap_or(0) == 0 {
        eprintln!("delta_net bench: no CUDA device or kernels (kernels built: {})", info.kernels_built);
        std::process::exit(2);
    }
    let dev = CudaDevice::open(0)?;
    println!("BENCH device {} (kernels {} for compute_{})", dev.info(), info.sources_sha256, info.arch);
    let mut rng = ChaCha8Rng::seed_from_u64(4096);
    let p = DeltaNetParams { n_k_heads: 16, n_v_heads: 32, d_k: 128, d_v: 128, conv_kernel: 4, eps: 1e-6 };
    let (ch, vd, nv) = (p.conv_channels(), p.n_v_heads * p.d_v, p.n_v_heads);
    let t = 4096;
    let w = DeltaNetWeights {
        conv: dev.upload(&uniform(&mut rng, ch * 4, -0.5, 0.5))?,
        a: dev.upload(&uniform(&mut rng, nv, -1.5, -0.5))?,
        dt_bias: dev.upload(&uniform(&mut rng, nv, -0.5, 0.5))?,
        norm: dev.upload(&uniform(&mut rng, p.d_v, 0.8, 1.2))?,
    };
    for n_seqs in [1usize, 4, 8] {
        let rows = PassRows { n_seqs, n_tokens: t, pos0: 0 };
        let n = rows.n_rows();
        let qkv = dev.upload(&uniform(&mut rng, n * ch, -1.0, 1.0))?;
        let z = dev.upload(&uniform(&mut rng, n * vd, -1.0, 1.0))?;
        let ba = dev.upload(&uniform(&mut rng, n * 2 * nv, -2.0, 2.0))?;
        let mut hist = dev.alloc_zeros::<f32>(n_seqs * 3 * ch)?;
        let mut state = dev.alloc_zeros::<f64>(n_seqs * nv * p.d_k * p.d_v)?;
        let mut mixed = dev.alloc_zeros::<f32>(n * ch)?;
        let mut out = dev.alloc_zeros::<f32>(n * vd)?;
        let mut exact_ms = None;
        for kernel in [DeltaScan::Exact, DeltaScan::ChunkTf32, DeltaScan::Chunk3xTf32] {
            let reps = if kernel == DeltaScan::Exact { 3 } else { 10 };
            let step = time_ms(&dev, reps, || {
                dn::conv(&dev, qkv.view(), w.conv.view(), 4, hist.view_mut(), mixed.view_mut(), rows)?;
                dn::scan_with(&dev, kernel, mixed.view(), z.view(), ba.view(), &w, &p, state.view_mut(), out.view_mut(), rows)
            })?;
            let scan = time_ms(&dev, reps, || {
                dn::scan_with(&dev, kernel, mixed.view(), z.view(), ba.view(), &w, &p, state.view_mut(), out.view_mut(), rows)
            })?;
            let host = dev.download(&out)?;
            anyhow::ensure!(host.iter().all(|v| v.is_finite()), "{kernel:?}: non-finite output");
            let base = *exact_ms.get_or_insert(step);
            println!(
                "BENCH delta_net {:<12} 16k/32v 128x128 {n_seqs} x {t} tokens: step {step:9.3} ms ({:10.0} tokens/s), scan alone {scan:9.3} ms, {:6.1}x the exact step",
                format!("{kernel:?}"),
                (n_seqs * t) as f64 / (step * 1e-3),
                base / step
            );
        }
    }
    Ok(())
}
