//! The CUDA backend end to end: whole forward passes on the GPU against the
//! CPU backend and the exact float64 reference.
//!
//! - Tiny seeded models of every flag set (llama, gemma3 with sliding windows
//!   that slide, soft-caps and post norms, qwen2 biases, qwen3 partial rotary)
//!   built here in memory: each route and KV type against the CPU backend
//!   rounding at the same points (its bf16 emulation), per target,
//!   with prefill passes on the GPU, top-k and listed ids.
//! - Both real models (`.ninfer` artifacts in `INFERNIX_MODELS`) on
//!   `wiki.test.raw`: chunks c=512 (first 40) and sliding 4096/2048 (first 4
//!   windows). The FP32 route (`--lossless`) must match the CPU backend's
//!   per-window mean NLL within 1e-4 nats (golden file
//!   `tests/data/gpu_e2e_cpu_golden.json`, written by `tests/gpu_golden.rs`);
//!   the default route must stay within 0.005 nats per window and 0.1 % in
//!   overall perplexity of the exact float64 reference (chunks; shared/reference)
//!   and of the CPU backend (sliding windows, which have no float64 figures).
//! - `--backend cuda` on a machine without a driver exits 2 with one line.
//!
//! Without kernels, driver or device, every GPU test prints
//! "skipped: no CUDA device (...)" on stderr and passes. On the GPU machine
//! run `scripts/gpu-e2e.sh` (docs/gpu-testing.md): each comparison prints one
//! `E2E ...` line.

#[path = "gpu_e2e/cases.rs"]
mod cases;

use std::collections::HashMap;
use std::io::Write as _;

use infernix_perplexity::artifact::format::TensorFormat;
use infernix_perplexity::artifact::meta::{Activation, Architecture, Component, HParams, HybridParams, MoeParams, RopeStyle, TensorEntry};
use infernix_perplexity::artifact::names::{self, blk};
use infernix_perplexity::artifact::TensorView;
use infernix_perplexity::backend::cpu::CpuBackend;
use infernix_perplexity::backend::cuda::{self as cuda, CudaBackend, Route};
use infernix_perplexity::backend::{Backend, BackendKind, ExecutionSpec, Precision};
use infernix_perplexity::kv::KvFormat as KvDtype;
use infernix_perplexity::model::{load_model, ScoreOptions, TargetScore, Transformer, WindowInput, WindowScorer};

/// Windows per batched pass in the whole-model GPU tests.
const BATCH: usize = 8;

/// Why the GPU tests cannot run here, or None when a device is present.
fn no_device_reason() -> Option<String> {
    if !cuda::build_info().kernels_built {
        return Some("binary built without CUDA kernels".into());
    }
    if !cuda::driver_present() {
        return Some("no CUDA driver".into());
    }
    match cuda::device_count() {
        Ok(0) => Some("driver reports 0 devices".into()),
        Err(e) => Some(format!("{e:#}")),
        Ok(_) => None,
    }
}

/// True when the test should run; prints the skip line otherwise.
fn have_gpu() -> bool {
    match no_device_reason() {
        None => true,
        Some(why) => {
            let _ = std::io::stderr().lock().write_all(format!("skipped: no CUDA device ({why})\n").as_bytes());
            false
        }
    }
}

fn device_index() -> usize {
    std::env::var("INFERNIX_CUDA_DEVICE").ok().and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// One summary line on stderr (collected by scripts/gpu-e2e.sh).
fn report(line: String) {
    let _ = std::io::stderr().lock().write_all(format!("E2E {line}\n").as_bytes());
}

// ---------------------------------------------------------------- tiny models

/// Seeded weights of one tiny model with the GPU kernels' constraints
/// (row lengths multiples of 32, d_head 64).
struct Tiny {
    arch: Architecture,
    hp: HParams,
    entries: HashMap<String, TensorEntry>,
    bytes: HashMap<String, Vec<u8>>,
}

fn tiny_hparams(arch: Architecture) -> HParams {
    let n_layers = 3;
    let mut hp = HParams {
        n_layers,
        d_model: 64,
        n_heads: 4,
        n_kv_heads: 2,
        d_head: 64,
        d_head_v: 64,
        d_ffn: 96,
        n_vocab: 300,
        rms_eps: 1e-6,
        rope_base: 10000.0,
        rope_base_local: 10000.0,
        rope_scale: 1.0,
        rope_dim: 64,
        rope_style: RopeStyle::Neox,
        sliding_window: vec![None; n_layers],
        context_length: 256,
        embed_scale: 1.0,
        attn_scale: 1.0 / 8.0,
        attn_softcap: None,
        final_softcap: None,
        activation: Activation::Silu,
        qkv_bias: false,
        qk_norm: false,
        post_norms: false,
        tied_embeddings: false,
        moe: None, hybrid: None,
    };
    match arch {
        Architecture::Llama => {
            hp.rope_style = RopeStyle::Normal;
            hp.tied_embeddings = true;
        }
        Architecture::Gemma3 => {
            // Sliding layers of window 7 around a global one (they slide in a
            // 40-token window), soft-caps as gemma2 has them, scaled positions.
            hp.sliding_window = vec![Some(7), None, Some(7)];
            hp.rope_base = 1_000_000.0;
            hp.rope_scale = 2.0;
            hp.embed_scale = 8.0;
            hp.attn_scale = 0.2;
            hp.attn_softcap = Some(5.0);
            hp.final_softcap = Some(3.0);
            hp.activation = Activation::GeluTanh;
            hp.qk_norm = true;
            hp.post_norms = true;
            hp.tied_embeddings = true;
        }
        Architecture::Qwen2 => hp.qkv_bias = true,
        Architecture::Qwen3 => {
            hp.qk_norm = true;
            hp.rope_dim = 32; // partial rotary
        }
        Architecture::Qwen3Moe => {
            // qwen3's attention; 8 experts of width 64, top 3 (the transformers
            // golden of this architecture is tests/qwen_moe_golden.rs, on the CPU).
            hp.qk_norm = true;
            hp.moe = Some(MoeParams { n_experts: 8, n_experts_used: 3, d_ffn_expert: 64, norm_topk_prob: true });
        }
        Architecture::Qwen3Next => {
            // DeltaNet, gated full attention, DeltaNet, with qwen3next's QK norm,
            // partial rotary (16 of 64), 8 experts top 3 and a gated shared expert
            // (the transformers golden of this architecture is
            // tests/qwen_next_golden.rs, on the CPU, whose shapes the GPU kernels
            // do not take: 16-wide heads, 24-wide rows).
            hp.qk_norm = true;
            hp.rope_dim = 16;
            hp.moe = Some(MoeParams { n_experts: 8, n_experts_used: 3, d_ffn_expert: 64, norm_topk_prob: true });
            hp.hybrid = Some(HybridParams {
                linear_layers: vec![true, false, true],
                n_k_heads: 2,
                n_v_heads: 4,
                d_k: 16,
                d_v: 16,
                conv_kernel: 4,
                d_ffn_shared: 32,
            });
        }
    }
    hp
}

fn tiny(arch: Architecture, seed: u64) -> Tiny {
    tiny_with(arch, tiny_hparams(arch), seed)
}

fn tiny_with(arch: Architecture, hp: HParams, seed: u64) -> Tiny {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    let (d, dq, dk) = (hp.d_model as u64, (hp.n_heads * hp.d_head) as u64, (hp.n_kv_heads * hp.d_head) as u64);
    // name, shape, offset, spread
    let mut shapes: Vec<(String, Vec<u64>, f64, f64)> = vec![
        (names::TOKEN_EMBD.into(), vec![hp.n_vocab as u64, d], 0.0, 1.0),
        (names::OUTPUT_NORM.into(), vec![d], 1.0, 0.2),
    ];
    if !hp.tied_embeddings {
        shapes.push((names::OUTPUT.into(), vec![hp.n_vocab as u64, d], 0.0, 0.5));
    }
    for l in 0..hp.n_layers {
        let mut m = |n: &str, shape: Vec<u64>, off: f64, spread: f64| shapes.push((blk(l, n), shape, off, spread));
        m("attn_norm.weight", vec![d], 1.0, 0.2);
        match hp.hybrid.as_ref() {
            Some(h) if h.linear_layers[l] => {
                // A Gated DeltaNet layer (llama.cpp's names, src/model/hybrid.rs).
                let (ch, vd, nv) = (h.conv_channels() as u64, (h.n_v_heads * h.d_v) as u64, h.n_v_heads as u64);
                m("attn_qkv.weight", vec![ch, d], 0.0, 0.3);
                m("attn_gate.weight", vec![vd, d], 0.0, 0.3);
                m("ssm_ba.weight", vec![2 * nv, d], 0.0, 0.3);
                m("ssm_conv1d.weight", vec![ch, h.conv_kernel as u64], 0.0, 0.4);
                m("ssm_a", vec![nv], -0.6, 0.4);
                m("ssm_dt.bias", vec![nv], 0.0, 0.5);
                m("ssm_norm.weight", vec![h.d_v as u64], 1.0, 0.2);
                m("ssm_out.weight", vec![d, vd], 0.0, 0.2);
            }
            hybrid => {
                // Qwen3-Next's gated query: per head d_head query rows, then d_head gate rows.
                m("attn_q.weight", vec![if hybrid.is_some() { 2 * dq } else { dq }, d], 0.0, 0.3);
                m("attn_k.weight", vec![dk, d], 0.0, 0.3);
                m("attn_v.weight", vec![dk, d], 0.0, 0.3);
                m("attn_output.weight", vec![d, dq], 0.0, 0.15);
            }
        }
        // llama.cpp names qwen3next's pre-FFN norm post_attention_norm.
        m(if hp.hybrid.is_some() { "post_attention_norm.weight" } else { "ffn_norm.weight" }, vec![d], 1.0, 0.2);
        if let Some(h) = &hp.hybrid {
            let f = h.d_ffn_shared as u64;
            m("ffn_gate_inp_shexp.weight", vec![1, d], 0.0, 0.5);
            m("ffn_gate_shexp.weight", vec![f, d], 0.0, 0.3);
            m("ffn_up_shexp.weight", vec![f, d], 0.0, 0.3);
            m("ffn_down_shexp.weight", vec![d, f], 0.0, 0.2);
        }
        if let Some(moe) = &hp.moe {
            // The router and the expert-major banks (n_experts, n_out, n_in).
            let (n_e, f) = (moe.n_experts as u64, moe.d_ffn_expert as u64);
            m("ffn_gate_inp.weight", vec![n_e, d], 0.0, 0.5);
            m("ffn_gate_exps.weight", vec![n_e, f, d], 0.0, 0.3);
            m("ffn_up_exps.weight", vec![n_e, f, d], 0.0, 0.3);
            m("ffn_down_exps.weight", vec![n_e, d, f], 0.0, 0.2);
        } else {
            m("ffn_gate.weight", vec![hp.d_ffn as u64, d], 0.0, 0.3);
            m("ffn_up.weight", vec![hp.d_ffn as u64, d], 0.0, 0.3);
            m("ffn_down.weight", vec![d, hp.d_ffn as u64], 0.0, 0.2);
        }
        if hp.qkv_bias {
            m("attn_q.bias", vec![dq], 0.0, 0.5);
            m("attn_k.bias", vec![dk], 0.0, 0.5);
            m("attn_v.bias", vec![dk], 0.0, 0.5);
        }
        if hp.qk_norm {
            m("attn_q_norm.weight", vec![hp.d_head as u64], 1.0, 0.3);
            m("attn_k_norm.weight", vec![hp.d_head as u64], 1.0, 0.3);
        }
        if hp.post_norms {
            m("post_attention_norm.weight", vec![d], 1.0, 0.2);
            m("post_ffw_norm.weight", vec![d], 1.0, 0.2);
        }
    }
    let (mut entries, mut bytes) = (HashMap::new(), HashMap::new());
    for (name, shape, off, spread) in shapes {
        let n: u64 = shape.iter().product();
        let b: Vec<u8> = (0..n).flat_map(|_| ((off + spread * next()) as f32).to_le_bytes()).collect();
        let entry = TensorEntry {
            name: name.clone(),
            component: Component::Text,
            format: TensorFormat::F32,
            shape,
            offset: 0,
            n_bytes: b.len() as u64,
            sha256: String::new(),
        };
        entries.insert(name.clone(), entry);
        bytes.insert(name, b);
    }
    Tiny { arch, hp, entries, bytes }
}

fn load_tiny<B: Backend>(backend: B, t: &Tiny) -> Transformer<B> {
    let get = |name: &str| -> anyhow::Result<TensorView<'_>> {
        let entry = t.entries.get(name).ok_or_else(|| anyhow::anyhow!("no tensor {name}"))?;
        Ok(TensorView { entry, bytes: &t.bytes[name] })
    };
    Transformer::load_with(backend, t.arch, t.hp.clone(), &get).expect("load tiny model")
}

/// Largest |a - b| over the NLLs, and over the extra logits.
fn max_diffs(a: &[TargetScore], b: &[TargetScore]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let nll = a.iter().zip(b).map(|(x, y)| (x.nll - y.nll).abs()).fold(0.0, f64::max);
    let extra = a
        .iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.extra.len(), y.extra.len());
            x.extra.iter().zip(&y.extra).map(|(p, q)| (*p as f64 - *q as f64).abs()).collect::<Vec<_>>()
        })
        .fold(0.0, f64::max);
    (nll, extra)
}

/// Mean |a - b| over the NLLs.
fn mean_nll_diff(a: &[TargetScore], b: &[TargetScore]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x.nll - y.nll).abs()).sum::<f64>() / a.len() as f64
}

#[test]
fn tiny_models_match_the_cpu_emulation_of_each_route() {
    if !have_gpu() {
        return;
    }
    // (route, KV, largest NLL difference, mean NLL difference, listed-logit
    // difference) against the CPU backend rounding at the same points, about
    // twice the worst measured on the H200 over the four models. f32
    // everywhere: 2.0e-5 (accumulation order against logits of size ~15).
    // With bf16 somewhere the GPU and its CPU emulation still differ:
    // accumulation order tips some roundings the other way, and these
    // random, untrained models amplify every rounding through three layers
    // (measured worst: 2.1e-3 for the bf16 KV cache alone, 4.4e-2 for the
    // default route's matmul inputs alone, 0.10 for both; against the
    // unrounded CPU 6.9e-2, 0.17 and 0.21, where the real models move by
    // 3e-3); a wiring mistake moves NLLs by whole nats. The default route with
    // a bf16 cache runs the tensor-core attention (kernel v2), which also
    // rounds the probabilities to bf16 before P·V (not emulated; q's rounding
    // is): measured worst 0.114 / mean 0.030 / listed logits 0.104 (Llama).
    let settings = [
        (Route::Fp32, KvDtype::F32, 1e-4, 1e-4, 1e-3),
        (Route::Fp32, KvDtype::Bf16, 5e-3, 1e-3, 5e-3),
        (Route::Bf16TensorCore, KvDtype::F32, 0.1, 0.02, 0.1),
        (Route::Bf16TensorCore, KvDtype::Bf16, 0.2, 0.06, 0.2),
        // fp8 (E4M3 rows, unrotated since rot8; rotated from kvm2 to rot8, the figures below;
        // the CPU emulation stores
        // them through the same codec): v2 also rounds each decoded K/V element and the
        // rotated q to bf16 (not emulated: the CPU keeps q in f32 under a rotated K), and
        // K/V values that differ by the matmul's accumulation order can land on
        // neighbouring codes. Measured worst on the H200 (2026-12-01, Llama): unrotated
        // 0.274 / mean 0.129 / listed logits 0.446; rotated (kvm2 74dce86) 0.394 / 0.126 /
        // 0.412 (Gemma3 0.042 / 0.011 / 0.046). The bounds, set at twice the unrotated
        // figures, stay: 1.4x the rotated worst NLL, 2x its mean and 2.2x its logits.
        // rot8 made fp8 unrotated again (the table's default): these bounds are 2x the
        // unrotated figures measured before kvm2; not yet rerun on the device.
        (Route::Bf16TensorCore, KvDtype::Fp8, 0.55, 0.26, 0.9),
        // The other quantized formats (rows through the same src/kv codecs; v2 keeps rotated K
        // and V in the rotated basis and rotates q and the output, which the CPU emulation
        // does not, so K/V values that differ by the matmuls' accumulation order land on other
        // codes more often the fewer bits a format has). Measured worst over the four models on
        // the H200 (2026-12-01, kvgpu 5b07306; max / mean / listed logits, Llama each time):
        // int8 0.192 / 0.066 / 0.371; k8v4 0.492 / 0.212 / 0.646; nvfp4 1.46 / 0.328 / 1.68;
        // k4v2 1.53 / 0.533 / 1.67; vq2 1.36 / 0.467 / 1.95. About twice that here; the means
        // stay below the unrounded CPU's (1.4 .. 3.3 nats for the 4- and 2-bit formats on
        // Llama), which the check below requires, so a wiring mistake still fails.
        (Route::Bf16TensorCore, KvDtype::Int8, 0.4, 0.14, 0.75),
        (Route::Bf16TensorCore, KvDtype::K8v4, 1.0, 0.43, 1.3),
        (Route::Bf16TensorCore, KvDtype::Nvfp4, 3.0, 0.66, 3.4),
        (Route::Bf16TensorCore, KvDtype::K4v2, 3.1, 1.07, 3.4),
        (Route::Bf16TensorCore, KvDtype::Vq2, 2.8, 0.94, 3.9),
    ];
    let archs = [Architecture::Llama, Architecture::Gemma3, Architecture::Qwen2, Architecture::Qwen3];
    let mut failures = Vec::new();
    for (i, &arch) in archs.iter().enumerate() {
        let t = tiny(arch, 11 + i as u64);
        let tokens: Vec<u32> = (0..40u32).map(|j| (j * 37 + 5 * i as u32) % t.hp.n_vocab as u32).collect();
        let first = 3;
        let n_targets = tokens.len() - first;
        // Ids listed per target (for KL), out of order and repeated.
        let extra: Vec<Vec<u32>> = (0..n_targets).map(|j| vec![(j as u32 * 7) % 300, 299, 0, (j as u32 * 7) % 300]).collect();
        let cpu_opts = ScoreOptions { top_k: 5, prefill_chunk: None };
        let reference = load_tiny(CpuBackend::default(), &t).score_window(&tokens, first, &cpu_opts, &extra).expect("cpu");
        for (route, kv, tol, tol_mean, tol_logit) in settings {
            let emulation = CpuBackend { bf16_matmul_inputs: route == Route::Bf16TensorCore, ..CpuBackend::with_kv(kv) };
            let want = load_tiny(emulation, &t).score_window(&tokens, first, &cpu_opts, &extra).expect("cpu emulation");
            let mut gpu = load_tiny(CudaBackend::open(device_index(), route, kv).expect("open GPU"), &t);
            // Passes of 16 tokens: the KV cache carries over three passes.
            let gpu_opts = ScoreOptions { top_k: 5, prefill_chunk: Some(16) };
            let got = gpu.score_window(&tokens, first, &gpu_opts, &extra).expect("gpu");
            let (d_nll, d_extra) = max_diffs(&got, &want);
            let (d_mean, d_mean_unrounded) = (mean_nll_diff(&got, &want), mean_nll_diff(&got, &reference));
            let setting = format!("{arch:?} route {} kv {}", route.name(), kv.name());
            report(format!(
                "tiny {setting}: vs emulation max |dNLL| {d_nll:.3e}, mean |dNLL| {d_mean:.3e}, max |d extra logit| {d_extra:.3e}; \
                 vs unrounded max |dNLL| {:.3e}, mean {d_mean_unrounded:.3e}",
                max_diffs(&got, &reference).0,
            ));
            if d_nll > tol || d_mean > tol_mean || d_extra > tol_logit {
                failures.push(format!("{setting}: max |dNLL| {d_nll:.3e} (tolerance {tol:e}), mean {d_mean:.3e} ({tol_mean:e}), listed logits {d_extra:.3e} ({tol_logit:e})"));
            }
            // Where the route rounds, the emulation must explain part of it:
            // the GPU sits closer to it than to the unrounded CPU.
            if (route, kv) != (Route::Fp32, KvDtype::F32) && d_mean >= d_mean_unrounded {
                failures.push(format!("{setting}: mean |dNLL| {d_mean:.3e} against the emulation, {d_mean_unrounded:.3e} against the unrounded CPU"));
            }
            for (j, (g, c)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.top.len(), 5);
                if route == Route::Fp32 && kv == KvDtype::F32 {
                    // Same top ids (no near-ties at this tolerance) and logits.
                    let gi: Vec<u32> = g.top.iter().map(|e| e.0).collect();
                    let ci: Vec<u32> = c.top.iter().map(|e| e.0).collect();
                    assert_eq!(gi, ci, "{arch:?} target {j}: top-5 ids");
                }
                assert!((g.top[0].1 as f64 - g.max_logit).abs() < 1e-6, "{arch:?} target {j}: top-1 is the max");
            }
            // A second run of the same window is bit-identical (deterministic kernels).
            let again = gpu.score_window(&tokens, first, &gpu_opts, &extra).expect("gpu again");
            assert_eq!(again, got, "{setting}: two GPU runs differ");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The fused q/k/v GEMM (`Backend::qkv` on CUDA: one wgmma GEMM over the
/// stacked weights, qwen2's biases in its epilogue) gives the same bits as
/// three matmuls then add_bias, through whole windows: tiny llama and qwen2
/// models scored in one pass of 200 rows (wgmma sizes), with the fusion on and
/// off, every score compared exactly; the fused run's mean NLL also within the
/// default route's mean tolerance of the CPU emulation.
#[test]
fn fused_qkv_scores_the_same_bits_as_three_matmuls() {
    if !have_gpu() {
        return;
    }
    for (i, arch) in [Architecture::Llama, Architecture::Qwen2].into_iter().enumerate() {
        let t = tiny(arch, 40 + i as u64);
        let tokens: Vec<u32> = (0..200u32).map(|j| (j * 53 + 11 * i as u32) % t.hp.n_vocab as u32).collect();
        let opts = ScoreOptions { top_k: 5, prefill_chunk: Some(200) };
        let widths = [t.hp.n_heads * t.hp.d_head, t.hp.n_kv_heads * t.hp.d_head, t.hp.n_kv_heads * t.hp.d_head_v];
        let run = |fused: bool| {
            let mut b = CudaBackend::open(device_index(), Route::Bf16TensorCore, KvDtype::Bf16).expect("open GPU");
            b.set_fused_qkv(fused);
            if fused {
                assert!(cuda::ops::qkv_fusable(b.device(), tokens.len(), widths), "{arch:?}: 200 rows x {widths:?} should fuse");
                let exec = b.execution();
                assert!(exec.details["fusions"].as_str().unwrap().contains("gemm_bf16_wgmma_qkv"), "{:?}", exec.details);
            }
            load_tiny(b, &t).score_window(&tokens, 1, &opts, &[]).expect("gpu")
        };
        let (fused, three) = (run(true), run(false));
        assert_eq!(fused, three, "{arch:?}: fused q/k/v scores differ from three matmuls");
        let emulation = CpuBackend { bf16_matmul_inputs: true, ..CpuBackend::with_kv(KvDtype::Bf16) };
        let want = load_tiny(emulation, &t).score_window(&tokens, 1, &ScoreOptions { top_k: 5, prefill_chunk: None }, &[]).expect("cpu");
        let (d_nll, _) = max_diffs(&fused, &want);
        let d_mean = mean_nll_diff(&fused, &want);
        report(format!("fused qkv {arch:?}: 200 rows, bit-identical to three matmuls; vs emulation max |dNLL| {d_nll:.3e}, mean {d_mean:.3e}"));
        // The default route's mean bound with a bf16 cache (tiny_models_match_the_cpu_emulation_of_each_route;
        // its max bound was set on 40-token windows, so only reported here).
        assert!(d_mean < 0.06, "{arch:?}: mean |dNLL| {d_mean:.3e} against the emulation (max {d_nll:.3e})");
    }
}

/// The expert banks of `t` rewritten as MXFP4 (seeded nibbles, E8M0 scales
/// 2^-5 and 2^-4 so the weights have about the F32 banks' spread).
fn with_mxfp4_banks(t: &mut Tiny, seed: u64) {
    let mut s = seed | 1;
    let mut byte = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 24) as u8
    };
    // Sorted: the byte stream must meet the banks in one order (the map's order varies per process).
    let mut banks: Vec<String> = t.entries.keys().filter(|n| n.ends_with("_exps.weight")).cloned().collect();
    banks.sort();
    for name in banks {
        let entry = t.entries.get_mut(&name).expect("bank entry");
        let n: u64 = entry.shape.iter().product();
        let bytes: Vec<u8> = (0..n / 32).flat_map(|_| std::iter::once(122 + (byte() & 1)).chain((0..16).map(|_| byte())).collect::<Vec<_>>()).collect();
        entry.format = TensorFormat::Mxfp4;
        entry.n_bytes = bytes.len() as u64;
        t.bytes.insert(name, bytes);
    }
}

/// The tiny qwen3moe model (8 experts, top 3, renormalized) on CUDA against the
/// CPU backend (the MoE op's definition; its bf16 emulation for the default
/// route), with F32 and MXFP4 expert banks, scored in prefill passes of 16 on the
/// GPU and one pass on the CPU: per-target NLLs within the tiny models'
/// tolerances of the dense test above. Routing is the CPU oracle's rule on the
/// device's router logits, so on the FP32 route the per-layer expert-usage
/// counts must be equal. On the default route the router logits differ from the
/// emulation's by what the emulation does not reproduce (accumulation order, the
/// tensor-core attention's bf16 probabilities), so a row whose k-th and
/// (k+1)-th experts nearly tie may route differently: measured on the H200
/// (2026-12-01) 1 routing of 360 (one row in one layer) with F32 banks, 0 and 2 with MXFP4;
/// at most 2 % of the routings may move there, and the report says how many did.
#[test]
fn tiny_qwen3moe_on_cuda_matches_the_cpu_and_its_expert_usage() {
    if !have_gpu() {
        return;
    }
    let mut failures = Vec::new();
    for (banks, route, kv, tol, tol_mean) in [
        (TensorFormat::F32, Route::Fp32, KvDtype::F32, 1e-4, 1e-4),
        (TensorFormat::F32, Route::Bf16TensorCore, KvDtype::Bf16, 0.2, 0.06),
        (TensorFormat::Mxfp4, Route::Fp32, KvDtype::F32, 1e-4, 1e-4),
        // Measured on the H200 (2026-12-01) over two draws of the MXFP4 bytes (before their
        // order was fixed): max 0.032 / mean 0.011 with no routing moved, and max 0.192 / mean
        // 0.014 with 2 of 360 moved (a moved routing swaps a whole expert's output); about twice
        // the worst here. This fixed draw has not run on the device yet.
        (TensorFormat::Mxfp4, Route::Bf16TensorCore, KvDtype::Bf16, 0.4, 0.06),
    ] {
        let mut t = tiny(Architecture::Qwen3Moe, 29);
        if banks == TensorFormat::Mxfp4 {
            with_mxfp4_banks(&mut t, 31);
        }
        let tokens: Vec<u32> = (0..40u32).map(|j| (j * 53 + 11) % t.hp.n_vocab as u32).collect();
        let first = 3;
        let emulation = CpuBackend { bf16_matmul_inputs: route == Route::Bf16TensorCore, ..CpuBackend::with_kv(kv) };
        let mut cpu = load_tiny(emulation, &t);
        let want = cpu.score_window(&tokens, first, &ScoreOptions { top_k: 0, prefill_chunk: None }, &[]).expect("cpu");
        let want_usage = cpu.expert_usage().expect("expert usage read back").expect("a MoE model reports expert usage");
        let mut gpu = load_tiny(CudaBackend::open(device_index(), route, kv).expect("open GPU"), &t);
        let got = gpu.score_window(&tokens, first, &ScoreOptions { top_k: 0, prefill_chunk: Some(16) }, &[]).expect("gpu");
        let got_usage = gpu.expert_usage().expect("expert usage read back").expect("a MoE model reports expert usage");
        let (d_nll, _) = max_diffs(&got, &want);
        let d_mean = mean_nll_diff(&got, &want);
        let setting = format!("qwen3moe {} banks route {} kv {}", banks.name(), route.name(), kv.name());
        let never: Vec<usize> = got_usage.layers.iter().map(|l| l.never_routed).collect();
        report(format!("tiny {setting}: vs CPU max |dNLL| {d_nll:.3e}, mean {d_mean:.3e}; never routed per layer {never:?}"));
        // Routings that moved: half the summed count differences (each moved routing leaves one expert, joins another).
        let moved: u64 = got_usage
            .layers
            .iter()
            .zip(&want_usage.layers)
            .map(|(g, w)| g.routed.iter().zip(&w.routed).map(|(a, b)| a.abs_diff(*b)).sum::<u64>() / 2)
            .sum();
        let n_routings = want_usage.rows * want_usage.top_k as u64 * want_usage.layers.len() as u64;
        report(format!("tiny {setting}: {moved} of {n_routings} routings differ from the CPU's"));
        let allowed = if route == Route::Fp32 { 0 } else { n_routings / 50 };
        if moved > allowed {
            failures.push(format!("{setting}: {moved} routings moved (allowed {allowed}): expert usage {:?} on CUDA, {:?} on the CPU", got_usage.layers, want_usage.layers));
        }
        if d_nll > tol || d_mean > tol_mean {
            failures.push(format!("{setting}: max |dNLL| {d_nll:.3e} (tolerance {tol:e}), mean {d_mean:.3e} ({tol_mean:e})"));
        }
        assert_eq!(got_usage.rows, 40, "{setting}: every row routed once per layer");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The tiny qwen3next model (Gated DeltaNet, gated full attention with partial
/// RoPE and QK norm, DeltaNet; 8 experts top 3 plus the gated shared expert) on
/// CUDA against the CPU backend (its bf16 emulation for the default route), three
/// windows per pass scored in one pass and in prefill passes of 16 and 7 tokens
/// (the recurrent state, the convolution history and the KV cache carried
/// across passes per window): per-target NLLs within the tiny models'
/// tolerances of the dense test above (FP32 route 1e-4; default route 0.2 max,
/// 0.06 mean), each window's mean NLL within 1e-4 (FP32) and 0.06 (default) of
/// the CPU's, the FP32 route's expert usage equal to the CPU's (at most 2 % of
/// the routings moved on the default route, as for qwen3moe), and a second GPU
/// run bit-identical. The default route runs its default DeltaNet scan (the
/// 3xtf32 chunks), the FP32 route the exact one.
#[test]
fn tiny_qwen3next_on_cuda_matches_the_cpu_over_passes() {
    let t = tiny(Architecture::Qwen3Next, 37);
    let n_vocab = t.hp.n_vocab as u32;
    let tokens: Vec<Vec<u32>> = (0..3u32).map(|w| (0..48u32).map(|j| (j * 53 + 11 + w * 97) % n_vocab).collect()).collect();
    let first = 2;
    let inputs: Vec<WindowInput> = tokens.iter().map(|tk| WindowInput { tokens: tk, first_target: first, extra_ids: &[] }).collect();
    let one_pass = ScoreOptions { top_k: 0, prefill_chunk: None };
    // The fixture loads and scores on the CPU (here too: the GPU half needs a device).
    let mut reference = load_tiny(CpuBackend::default(), &t);
    let exact = reference.score_windows(&inputs, &one_pass).expect("cpu");
    assert_eq!(exact.len(), 3);
    assert!(exact.iter().flatten().all(|s| s.nll.is_finite() && s.nll > 0.0), "tiny qwen3next: NLLs must be finite");
    if !have_gpu() {
        return;
    }
    let mut failures = Vec::new();
    for (route, kv, tol, tol_mean) in [(Route::Fp32, KvDtype::F32, 1e-4, 1e-4), (Route::Bf16TensorCore, KvDtype::Bf16, 0.2, 0.06)] {
        let emulation = CpuBackend { bf16_matmul_inputs: route == Route::Bf16TensorCore, ..CpuBackend::with_kv(kv) };
        let mut cpu = load_tiny(emulation, &t);
        let want = cpu.score_windows(&inputs, &one_pass).expect("cpu emulation");
        let want_usage = cpu.expert_usage().expect("expert usage read back").expect("a MoE model reports expert usage");
        for chunk in [None, Some(16), Some(7)] {
            let opts = ScoreOptions { top_k: 0, prefill_chunk: chunk };
            let mut gpu = load_tiny(CudaBackend::open(device_index(), route, kv).expect("open GPU"), &t);
            let got = gpu.score_windows(&inputs, &opts).expect("gpu");
            let got_usage = gpu.expert_usage().expect("expert usage read back").expect("a MoE model reports expert usage");
            let setting = format!("qwen3next route {} kv {} passes of {}", route.name(), kv.name(), chunk.map_or("48".into(), |c| c.to_string()));
            let mean = |v: &[TargetScore]| v.iter().map(|s| s.nll).sum::<f64>() / v.len() as f64;
            let (mut d_max, mut d_mean, mut d_window, mut d_exact) = (0f64, 0f64, 0f64, 0f64);
            for ((g, w), e) in got.iter().zip(&want).zip(&exact) {
                d_max = d_max.max(max_diffs(g, w).0);
                d_mean = d_mean.max(mean_nll_diff(g, w));
                d_window = d_window.max((mean(g) - mean(w)).abs());
                d_exact = d_exact.max((mean(g) - mean(e)).abs());
            }
            let moved: u64 = got_usage
                .layers
                .iter()
                .zip(&want_usage.layers)
                .map(|(g, w)| g.routed.iter().zip(&w.routed).map(|(a, b)| a.abs_diff(*b)).sum::<u64>() / 2)
                .sum();
            let n_routings = want_usage.rows * want_usage.top_k as u64 * want_usage.layers.len() as u64;
            report(format!(
                "tiny {setting}: vs CPU max |dNLL| {d_max:.3e}, worst window's mean |dNLL| {d_mean:.3e}, worst window mean-NLL diff \
                 {d_window:.3e} (vs the unrounded CPU {d_exact:.3e}); {moved} of {n_routings} routings differ"
            ));
            if d_max > tol || d_mean > tol_mean || d_window > tol_mean {
                failures.push(format!("{setting}: max |dNLL| {d_max:.3e} (tolerance {tol:e}), mean {d_mean:.3e} and window mean {d_window:.3e} ({tol_mean:e})"));
            }
            let allowed = if route == Route::Fp32 { 0 } else { n_routings / 50 };
            if moved > allowed {
                failures.push(format!("{setting}: {moved} routings moved (allowed {allowed})"));
            }
            let again = gpu.score_windows(&inputs, &opts).expect("gpu again");
            assert_eq!(again, got, "{setting}: two GPU runs differ");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `--reference --kv-dtype X` on CUDA (the FP32 route, every stored K/V row the
/// CPU's decode(encode(row)) by `kv_roundtrip_<codec>`, V as fp16 under bf16)
/// against the CPU backend's `--reference` (`CpuBackend::from_spec`), per target,
/// for the tiny models and every format: f32 and bf16 within the FP32 route's
/// bounds of `tiny_models_match_the_cpu_emulation_of_each_route` (f32 KV: 1e-4 max
/// and mean, 1e-3 listed logits; bf16: 5e-3 / 1e-3 / 5e-3). The quantized formats
/// get their own bounds: the stored rows are the CPU's bit for bit for the same
/// input (gpu_ops `kv_roundtrip_*`), but K and V come out of f32 matmuls whose
/// accumulation order differs from the CPU's, and a value that lands on the other
/// side of a code boundary moves by one code step of the format, not one bf16 ulp.
/// Measured on the H200 (2026-12-01 22:50 UTC, route5 3b0f681), worst over the five
/// models: max 1.97e-2 / mean 9.08e-4 / listed logits 1.24e-2 (Llama k8v4; fp8
/// 5.97e-3 / 6.76e-4 / 7.08e-3; every other format and model at most 2.9e-3 max);
/// about twice that here: 0.04 / 2e-3 / 0.025. The codec must be applied: for the
/// quantized formats the GPU's mean distance to the CPU's lossless f32 scores is
/// more than 10 times its distance to the CPU --reference (measured at least 68
/// times). Passes of 16 tokens carry the cache; the report names the round-trip kernels.
#[test]
fn reference_route_matches_the_cpu_reference_for_every_format() {
    if !have_gpu() {
        return;
    }
    let archs = [Architecture::Llama, Architecture::Gemma3, Architecture::Qwen2, Architecture::Qwen3, Architecture::Qwen3Moe];
    let mut failures = Vec::new();
    for (i, &arch) in archs.iter().enumerate() {
        let t = tiny(arch, 61 + i as u64);
        let tokens: Vec<u32> = (0..40u32).map(|j| (j * 41 + 3 * i as u32) % t.hp.n_vocab as u32).collect();
        let first = 3;
        let n_targets = tokens.len() - first;
        let extra: Vec<Vec<u32>> = (0..n_targets).map(|j| vec![(j as u32 * 11) % 300, 7]).collect();
        let cpu_opts = ScoreOptions { top_k: 5, prefill_chunk: None };
        let lossless = load_tiny(CpuBackend::default(), &t).score_window(&tokens, first, &cpu_opts, &extra).expect("cpu lossless");
        for kv in KvDtype::ALL {
            let spec = ExecutionSpec { kv_format: kv, reference: true, ..ExecutionSpec::lossless(16) };
            let want = load_tiny(CpuBackend::from_spec(&spec).expect("cpu spec"), &t).score_window(&tokens, first, &cpu_opts, &extra).expect("cpu reference");
            let (route, opts) = infernix_perplexity::model::cuda_route(&spec).expect("route");
            assert_eq!((route, opts.reference), (Route::Fp32, true));
            let backend = CudaBackend::open_with(device_index(), route, kv, opts).expect("open GPU");
            let exec = backend.execution();
            let kv_line = exec.details["kv_cache"].as_str().unwrap_or_default().to_string();
            let mut gpu = load_tiny(backend, &t);
            let got = gpu.score_window(&tokens, first, &ScoreOptions { top_k: 5, prefill_chunk: Some(16) }, &extra).expect("gpu reference");
            let (d_nll, d_extra) = max_diffs(&got, &want);
            let d_mean = mean_nll_diff(&got, &want);
            let d_lossless = mean_nll_diff(&got, &lossless);
            let setting = format!("{arch:?} --reference kv {}", kv.name());
            report(format!(
                "reference {setting}: vs CPU --reference max |dNLL| {d_nll:.3e}, mean {d_mean:.3e}, listed logits {d_extra:.3e}; \
                 vs CPU lossless f32 mean {d_lossless:.3e}"
            ));
            let (tol, tol_mean, tol_logit) = match kv {
                KvDtype::F32 => (1e-4, 1e-4, 1e-3),
                KvDtype::Bf16 => (5e-3, 1e-3, 5e-3),
                _ => (0.04, 2e-3, 0.025),
            };
            if d_nll > tol || d_mean > tol_mean || d_extra > tol_logit {
                failures.push(format!("{setting}: max |dNLL| {d_nll:.3e} ({tol:e}), mean {d_mean:.3e} ({tol_mean:e}), listed logits {d_extra:.3e} ({tol_logit:e})"));
            }
            if kv.is_quantized() && d_lossless <= 10.0 * d_mean {
                failures.push(format!("{setting}: mean |dNLL| {d_lossless:.3e} from the lossless CPU, only {d_mean:.3e} x 10 from the CPU --reference: is the codec applied?"));
            }
            let want_kernel = match kv {
                KvDtype::F32 => "kv_store_f32".to_string(),
                KvDtype::Bf16 => "kv_roundtrip_fp16".to_string(),
                f => cuda::ops::kv_roundtrip_kernel(f.k().elem).expect("kernel").to_string(),
            };
            assert!(kv_line.contains("--reference") && kv_line.contains(&want_kernel), "{setting}: kv_cache {kv_line}");
            assert_eq!(exec.details["attention_kernel"], cuda::ops::AttnKernel::V1.name(), "{setting}");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `--reproducible` on CUDA: the same three windows of 640 tokens scored in one
/// batched pass and each alone, with prefill chunks of 128, 512 and the whole
/// window: every target's NLL (so every window's NLL sum) bit-identical to the
/// window scored alone in one pass, for the default route with bf16 and fp8 KV
/// (tiny llama, gemma3 with sliding windows, qwen3moe, qwen3next) and the FP32
/// route; the report says so. Reported, not asserted: whether the default route
/// without the pin differs (its GEMM switches kernels at M = 128). Measured on the
/// H200 (2026-12-01 22:50 UTC, route5 3b0f681): bit-identical in every setting,
/// with and without the pin: on these shapes (K of 64 and 96) no difference between
/// the two GEMM kernels reaches a score, so this test does not show the pin needed.
#[test]
fn reproducible_scores_do_not_depend_on_batching_or_prefill_chunk() {
    if !have_gpu() {
        return;
    }
    let n = 640;
    let mut failures = Vec::new();
    let settings = [
        (Architecture::Llama, Route::Bf16TensorCore, KvDtype::Bf16),
        (Architecture::Llama, Route::Bf16TensorCore, KvDtype::Fp8),
        (Architecture::Gemma3, Route::Bf16TensorCore, KvDtype::Bf16),
        (Architecture::Gemma3, Route::Bf16TensorCore, KvDtype::Fp8),
        (Architecture::Qwen3Moe, Route::Bf16TensorCore, KvDtype::Bf16),
        (Architecture::Qwen3Moe, Route::Bf16TensorCore, KvDtype::Fp8),
        (Architecture::Qwen3Next, Route::Bf16TensorCore, KvDtype::Bf16),
        (Architecture::Llama, Route::Fp32, KvDtype::F32),
    ];
    for (k, &(arch, route, kv)) in settings.iter().enumerate() {
        let t = tiny(arch, 71 + k as u64);
        let n_vocab = t.hp.n_vocab as u32;
        let tokens: Vec<Vec<u32>> = (0..3u32).map(|w| (0..n as u32).map(|j| (j * 53 + 11 + w * 97) % n_vocab).collect()).collect();
        let first = 1;
        let inputs: Vec<WindowInput> = tokens.iter().map(|tk| WindowInput { tokens: tk, first_target: first, extra_ids: &[] }).collect();
        for pinned in [true, false] {
            let opts = cuda::RouteOptions { reference: false, reproducible: pinned, ..Default::default() };
            let backend = CudaBackend::open_with(device_index(), route, kv, opts).expect("open GPU");
            if pinned {
                let exec = backend.execution();
                assert_ne!(exec.details["reproducible"], "off", "{:?}", exec.details);
            }
            let mut gpu = load_tiny(backend, &t);
            let whole = ScoreOptions { top_k: 0, prefill_chunk: None };
            let alone: Vec<Vec<TargetScore>> = inputs.iter().map(|w| gpu.score_windows(std::slice::from_ref(w), &whole).expect("gpu").remove(0)).collect();
            let sums = |v: &[Vec<TargetScore>]| -> Vec<u64> { v.iter().map(|w| w.iter().map(|s| s.nll).sum::<f64>().to_bits()).collect() };
            let (mut differ, mut n_targets_differ) = (Vec::new(), 0usize);
            for chunk in [128, 512, n] {
                let opts = ScoreOptions { top_k: 0, prefill_chunk: Some(chunk) };
                let batched = gpu.score_windows(&inputs, &opts).expect("gpu batched");
                let single: Vec<Vec<TargetScore>> = inputs.iter().map(|w| gpu.score_windows(std::slice::from_ref(w), &opts).expect("gpu").remove(0)).collect();
                for (how, got) in [("batched", &batched), ("alone", &single)] {
                    let nd: usize = got.iter().zip(&alone).map(|(g, a)| g.iter().zip(a).filter(|(x, y)| x.nll.to_bits() != y.nll.to_bits()).count()).sum();
                    if nd > 0 || sums(got) != sums(&alone) {
                        differ.push(format!("{how} chunk {chunk}"));
                        n_targets_differ += nd;
                    }
                }
            }
            let setting = format!("{arch:?} route {} kv {}{}", route.name(), kv.name(), if pinned { " --reproducible" } else { " (no pin)" });
            report(format!(
                "reproducible {setting}: 3 windows of {n}, batched and alone, chunks 128/512/{n}: {}",
                if differ.is_empty() { "every target's NLL bit-identical to the window alone in one pass".to_string() } else { format!("{n_targets_differ} target NLLs differ ({})", differ.join(", ")) }
            ));
            if pinned && !differ.is_empty() {
                failures.push(format!("{setting}: {n_targets_differ} target NLLs differ from the window alone in one pass ({})", differ.join(", ")));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The chunked DeltaNet scans (fast paths `delta-chunk-tf32` and
/// `delta-chunk-3xtf32`) inside the tiny qwen3next model against the oracle,
/// the CPU backend (the exact f64 recurrence, f32 elsewhere), on the FP32
/// route (where the exact kernel agrees with the CPU within 1e-4): three
/// windows of 48 tokens in one pass and in passes of 16 and 7, and a longer
/// synthetic sequence, two windows of 2048 tokens (context 4096) in passes of
/// 512. Every window's mean NLL must stay within 0.005 nats and the overall
/// mean NLL within 0.1 % of the oracle's: the default route's bound
/// (`real_model`), which decides whether a fast path may be on by default.
/// The same scans on the default route are compared with the exact kernel on
/// that route (printed: the fast path's own share of the difference), and the
/// route's default scan (`DeltaScan::default_for`, 3xtf32) must keep that
/// share within the same bound, the condition for being on by default.
#[test]
fn tiny_qwen3next_chunked_delta_scan_within_the_default_bound() {
    use infernix_perplexity::backend::cuda::delta_net::DeltaScan;
    let mut hp = tiny_hparams(Architecture::Qwen3Next);
    hp.context_length = 4096;
    let t = tiny_with(Architecture::Qwen3Next, hp, 37);
    let n_vocab = t.hp.n_vocab as u32;
    let short: Vec<Vec<u32>> = (0..3u32).map(|w| (0..48u32).map(|j| (j * 53 + 11 + w * 97) % n_vocab).collect()).collect();
    let long: Vec<Vec<u32>> = (0..2u32).map(|w| (0..2048u32).map(|j| (j * 53 + 11 + w * 97 + j / 7) % n_vocab).collect()).collect();
    let sets: [(&str, &Vec<Vec<u32>>, Vec<Option<usize>>); 2] =
        [("3 x 48 tokens", &short, vec![None, Some(16), Some(7)]), ("2 x 2048 tokens", &long, vec![Some(512)])];
    if !have_gpu() {
        return;
    }
    let mut failures = Vec::new();
    for (label, tokens, chunks) in &sets {
        let inputs: Vec<WindowInput> = tokens.iter().map(|tk| WindowInput { tokens: tk, first_target: 2, extra_ids: &[] }).collect();
        let one_pass = ScoreOptions { top_k: 0, prefill_chunk: None };
        let exact = load_tiny(CpuBackend::default(), &t).score_windows(&inputs, &one_pass).expect("cpu");
        let mean = |v: &[TargetScore]| v.iter().map(|s| s.nll).sum::<f64>() / v.len() as f64;
        let overall = |w: &[Vec<TargetScore>]| w.iter().flatten().map(|s| s.nll).sum::<f64>() / w.iter().map(Vec::len).sum::<usize>() as f64;
        for kernel in [DeltaScan::ChunkTf32, DeltaScan::Chunk3xTf32] {
            for (route, kv) in [(Route::Fp32, KvDtype::F32), (Route::Bf16TensorCore, KvDtype::Bf16)] {
                // The exact kernel on this route, one pass: the fast path's own share of the difference.
                let mut exact_b = CudaBackend::open(device_index(), route, kv).expect("open GPU");
                exact_b.set_delta_scan(DeltaScan::Exact);
                let on_route = load_tiny(exact_b, &t)
                    .score_windows(&inputs, &one_pass)
                    .expect("gpu exact");
                for chunk in chunks {
                    let mut b = CudaBackend::open(device_index(), route, kv).expect("open GPU");
                    b.set_delta_scan(kernel);
                    let got = load_tiny(b, &t).score_windows(&inputs, &ScoreOptions { top_k: 0, prefill_chunk: *chunk }).expect("gpu chunked");
                    let d_window = got.iter().zip(&exact).map(|(g, e)| (mean(g) - mean(e)).abs()).fold(0.0, f64::max);
                    let d_overall = (overall(&got) - overall(&exact)).abs() / overall(&exact);
                    let d_route = got.iter().zip(&on_route).map(|(g, e)| (mean(g) - mean(e)).abs()).fold(0.0, f64::max);
                    let d_max = got.iter().zip(&on_route).map(|(g, e)| max_diffs(g, e).0).fold(0.0, f64::max);
                    let setting = format!(
                        "qwen3next {label} {kernel:?} route {} passes of {}",
                        route.name(),
                        chunk.map_or("all".into(), |c| c.to_string())
                    );
                    report(format!(
                        "tiny {setting}: vs the CPU oracle worst window mean-NLL diff {d_window:.3e}, overall {:.4} %; vs the exact \
                         kernel on the route worst window {d_route:.3e}, max |dNLL| {d_max:.3e}",
                        d_overall * 100.0
                    ));
                    if route == Route::Fp32 && (d_window > 0.005 || d_overall > 0.001) {
                        failures.push(format!("{setting}: window {d_window:.3e} (bound 0.005), overall {:.4} % (bound 0.1 %)", d_overall * 100.0));
                    }
                    // The default route's own scan: its share of that route's difference within the bound.
                    let d_route_overall = (overall(&got) - overall(&on_route)).abs() / overall(&on_route);
                    if kernel == DeltaScan::default_for(route) && (d_route > 0.005 || d_route_overall > 0.001) {
                        failures.push(format!("{setting}: vs the exact kernel window {d_route:.3e} (bound 0.005), overall {:.4} %", d_route_overall * 100.0));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn unsupported_shapes_are_errors_naming_the_op() {
    if !have_gpu() {
        return;
    }
    // d_head 16 has no attention kernel: the first forward pass says so.
    let mut hp = tiny_hparams(Architecture::Llama);
    hp.d_head = 16;
    hp.d_head_v = 16;
    hp.rope_dim = 16;
    let t = tiny_with(Architecture::Llama, hp, 3);
    let backend = CudaBackend::open(device_index(), Route::Fp32, Route::Fp32.kv_dtype()).expect("open GPU");
    let mut gpu = load_tiny(backend, &t);
    let err = gpu.score_window(&[1, 2, 3], 1, &ScoreOptions::default(), &[]).unwrap_err();
    assert!(format!("{err:#}").contains("attention: d_head 16"), "{err:#}");
}

// ---------------------------------------------------------------- real models

/// Per-window (n_scored, mean NLL) of one (model, protocol) on the GPU.
/// Scores every window of protocol `p` on the GPU, consecutive windows of
/// equal length batched up to `BATCH` per pass (so the comparison with the
/// CPU golden, scored one window at a time, also proves batching changes
/// nothing beyond the tolerance). -> per window (n scored, mean NLL), and
/// tokens processed per second.
fn gpu_windows(scorer: &mut dyn infernix_perplexity::model::WindowScorer, art: &infernix_perplexity::artifact::Artifact, tokens: &[u32], p: &cases::Protocol, prefill: usize) -> (Vec<(usize, f64)>, f64) {
    let started = std::time::Instant::now();
    let windows = cases::windows(art, tokens, p);
    let n_processed: usize = windows.iter().map(|(_, t, _)| t.len()).sum();
    let opts = ScoreOptions { top_k: 0, prefill_chunk: Some(prefill) };
    let mut out = Vec::with_capacity(windows.len());
    let mut i = 0;
    while i < windows.len() {
        let len = windows[i].1.len();
        let n = windows[i..].iter().take(BATCH).take_while(|w| w.1.len() == len).count();
        let inputs: Vec<WindowInput> =
            windows[i..i + n].iter().map(|(_, t, first)| WindowInput { tokens: t, first_target: *first, extra_ids: &[] }).collect();
        for s in scorer.score_windows(&inputs, &opts).expect("score") {
            out.push((s.len(), s.iter().map(|r| r.nll).sum::<f64>() / s.len() as f64));
        }
        i += n;
    }
    (out, n_processed as f64 / started.elapsed().as_secs_f64())
}

/// Overall perplexity of per-window (n, mean NLL).
fn ppl(w: &[(usize, f64)]) -> f64 {
    let n: usize = w.iter().map(|x| x.0).sum();
    (w.iter().map(|&(k, m)| k as f64 * m).sum::<f64>() / n as f64).exp()
}

fn golden() -> cases::Golden {
    let path = std::env::var_os("INFERNIX_E2E_GOLDEN").map_or_else(cases::golden_path, std::path::PathBuf::from);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e} (set INFERNIX_E2E_GOLDEN)", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn real_model(m: &cases::Model) {
    if !have_gpu() {
        return;
    }
    let art = cases::artifact(m);
    let tokens = cases::wiki_tokens(m, &art);
    let golden = golden();
    let exact = cases::exact_f64(m);
    for lossless in [true, false] {
        let route = if lossless { "fp32" } else { "bf16-tc" };
        // The two routes as they were before --kv-dtype fp8 became the default: f32 KV on FP32, bf16 KV on bf16-tc.
        let spec = if lossless {
            ExecutionSpec::lossless(1024)
        } else {
            ExecutionSpec {
                matmul_inputs: Precision::Bf16,
                lm_head_inputs: Precision::Bf16,
                kv_format: KvDtype::Bf16,
                lossless: false,
                ..ExecutionSpec::lossless(1024)
            }
        };
        let mut scorer = load_model(&art, BackendKind::Cuda { device: device_index(), spec }, 1.0).expect("load on GPU");
        assert_eq!(scorer.prepare(4096, 1024, BATCH).expect("the plan fits"), BATCH, "batch of {BATCH} windows fits the GPU");
        for p in &cases::PROTOCOLS {
            let key = format!("{}/{}", m.key, p.key);
            let cpu = golden.runs.get(&key).unwrap_or_else(|| panic!("golden file has no run {key}"));
            // Chunks in passes of 256 tokens on the FP32 route (the KV cache carries over), else 1024.
            let prefill = if lossless && p.key == "chunks512" { 256 } else { 1024 };
            let (got, tok_s) = gpu_windows(scorer.as_mut(), &art, &tokens, p, prefill);
            assert_eq!(got.len(), cpu.len(), "{key}: window count");
            let cpu_w: Vec<(usize, f64)> = cpu.iter().map(|w| (w.n_scored, w.nll_sum / w.n_scored as f64)).collect();
            let worst_cpu = got.iter().zip(&cpu_w).map(|(g, c)| (g.1 - c.1).abs()).fold(0.0, f64::max);
            let (ppl_gpu, ppl_cpu) = (ppl(&got), ppl(&cpu_w));
            let mut line = format!(
                "{key} route {route} prefill {prefill}: {} windows, PPL {ppl_gpu:.4} (CPU {ppl_cpu:.4}), max |d mean NLL| vs CPU {worst_cpu:.2e}, {tok_s:.0} tokens/s",
                got.len()
            );
            if p.key == "chunks512" {
                let ex: Vec<(usize, f64)> = got.iter().zip(&exact).map(|(g, &e)| (g.0, e)).collect();
                let worst_ex = got.iter().zip(&ex).map(|(g, e)| (g.1 - e.1).abs()).fold(0.0, f64::max);
                line += &format!(", vs exact f64 PPL {:.4}: max |d| {worst_ex:.2e}, {:+.4} %", ppl(&ex), (ppl_gpu / ppl(&ex) - 1.0) * 100.0);
                if !lossless {
                    report(line.clone());
                    assert!(worst_ex < 0.005, "{key} {route}: a chunk is {worst_ex:.4} nats from the exact float64 figure");
                    assert!((ppl_gpu / ppl(&ex) - 1.0).abs() < 1e-3, "{key} {route}: PPL {ppl_gpu} vs exact {}", ppl(&ex));
                }
            }
            if lossless {
                report(line);
                assert!(worst_cpu < 1e-4, "{key} fp32: a window is {worst_cpu:.2e} nats from the CPU backend");
            } else if p.key != "chunks512" {
                report(line);
                assert!(worst_cpu < 0.005, "{key} {route}: a window is {worst_cpu:.4} nats from the CPU backend");
                assert!((ppl_gpu / ppl_cpu - 1.0).abs() < 1e-3, "{key} {route}: PPL {ppl_gpu} vs CPU {ppl_cpu}");
            }
        }
    }
}

#[test]
fn smollm2_on_wiki_matches_cpu_and_exact_f64() {
    real_model(&cases::MODELS[0]);
}

#[test]
fn gemma3_on_wiki_matches_cpu_and_exact_f64() {
    real_model(&cases::MODELS[1]);
}

// ---------------------------------------------------------------- no driver

/// `--backend cuda` without a driver: exit 2, one line on stderr naming the
/// cause, no report folder left behind. Runs only where no driver is present.
#[test]
fn backend_cuda_without_a_driver_exits_2() {
    if cuda::build_info().kernels_built && cuda::driver_present() {
        eprintln!("skipped: a CUDA driver is present");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("t.txt");
    std::fs::write(&text, "Hello world. ".repeat(200)).unwrap();
    let out_dir = tmp.path().join("out");
    let art = cases::artifact(&cases::MODELS[0]);
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
        .arg(&art.path)
        .args(["--text"])
        .arg(&text)
        .args(["--backend", "cuda", "--method", "chunks", "--context", "128", "--log-level", "error", "--output"])
        .arg(&out_dir)
        .output()
        .expect("run the binary");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line expected: {stderr}");
    let want = if cuda::build_info().kernels_built { "no CUDA driver found" } else { "built without CUDA kernels" };
    assert!(lines[0].contains(want), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!out_dir.exists(), "the output folder was left behind");
    assert!(run.stdout.is_empty());
}
