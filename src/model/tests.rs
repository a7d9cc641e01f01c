//! The generic forward on tiny seeded random models of every architecture's
//! flag set, against a naive float64 forward written independently here
//! (one token at a time, no KV cache, no GEMM): catches wiring mistakes
//! (bias before RoPE, QK norm before RoPE, post-norms, windows that really
//! slide, GQA mapping, soft-caps) that the real-model tests cannot reach
//! (SmolLM2 has none of these; Gemma-3's window of 512 never slides at c=512).

use std::collections::HashMap;

use super::*;
use crate::backend::cpu::CpuBackend;
use crate::artifact::format::TensorFormat;
use crate::artifact::meta::{Activation, Component, RopeStyle, TensorEntry};

struct Tiny {
    hp: HParams,
    entries: HashMap<String, TensorEntry>,
    bytes: HashMap<String, Vec<u8>>,
    /// The same weights as f64, for the naive forward.
    w: HashMap<String, Vec<f64>>,
}

fn hparams(arch: Architecture) -> HParams {
    let mut hp = HParams {
        n_layers: 3,
        d_model: 32,
        n_heads: 4,
        n_kv_heads: 2,
        d_head: 8,
        d_head_v: 8,
        d_ffn: 48,
        n_vocab: 61,
        rms_eps: 1e-6,
        rope_base: 10000.0,
        rope_base_local: 10000.0,
        rope_scale: 1.0,
        rope_dim: 8,
        rope_style: RopeStyle::Neox,
        sliding_window: vec![None; 3],
        context_length: 64,
        embed_scale: 1.0,
        attn_scale: 1.0 / 8f64.sqrt(),
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
            hp.rope_base = 100000.0;
            hp.rope_base_local = 100000.0;
            hp.tied_embeddings = true;
        }
        Architecture::Gemma3 => {
            // Two sliding layers of window 5 around a global one, each kind with its own base;
            // soft-caps as gemma2 has them, to exercise those paths too.
            hp.sliding_window = vec![Some(5), None, Some(5)];
            hp.rope_base = 1_000_000.0;
            hp.rope_base_local = 10_000.0;
            hp.rope_scale = 2.0;
            hp.embed_scale = 32f64.sqrt();
            hp.attn_scale = 0.25;
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
            hp.rope_dim = 6; // partial rotary
        }
        Architecture::Qwen3Moe => panic!("the routed-expert forward is checked by tests/qwen_moe_golden.rs"),
        Architecture::Qwen3Next => panic!("the hybrid forward is checked by tests/qwen_next_golden.rs"),
    }
    hp
}

fn tiny(arch: Architecture, seed: u64) -> Tiny {
    tiny_from(hparams(arch), seed)
}

fn tiny_from(hp: HParams, seed: u64) -> Tiny {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    let mut shapes: Vec<(String, Vec<u64>, f64, f64)> = Vec::new(); // name, shape, offset, spread
    let (d, dq, dk, dv) = (hp.d_model as u64, (hp.n_heads * hp.d_head) as u64, (hp.n_kv_heads * hp.d_head) as u64, (hp.n_kv_heads * hp.d_head_v) as u64);
    shapes.push((names::TOKEN_EMBD.into(), vec![hp.n_vocab as u64, d], 0.0, 1.0));
    shapes.push((names::OUTPUT_NORM.into(), vec![d], 1.0, 0.2));
    if !hp.tied_embeddings {
        shapes.push((names::OUTPUT.into(), vec![hp.n_vocab as u64, d], 0.0, 0.5));
    }
    for l in 0..hp.n_layers {
        let mut m = |n: &str, shape: Vec<u64>, off: f64, spread: f64| shapes.push((blk(l, n), shape, off, spread));
        m("attn_norm.weight", vec![d], 1.0, 0.2);
        m("attn_q.weight", vec![dq, d], 0.0, 0.4);
        m("attn_k.weight", vec![dk, d], 0.0, 0.4);
        m("attn_v.weight", vec![dv, d], 0.0, 0.4);
        m("attn_output.weight", vec![d, (hp.n_heads * hp.d_head_v) as u64], 0.0, 0.3);
        m("ffn_norm.weight", vec![d], 1.0, 0.2);
        m("ffn_gate.weight", vec![hp.d_ffn as u64, d], 0.0, 0.4);
        m("ffn_up.weight", vec![hp.d_ffn as u64, d], 0.0, 0.4);
        m("ffn_down.weight", vec![d, hp.d_ffn as u64], 0.0, 0.3);
        if hp.qkv_bias {
            m("attn_q.bias", vec![dq], 0.0, 0.5);
            m("attn_k.bias", vec![dk], 0.0, 0.5);
            m("attn_v.bias", vec![dv], 0.0, 0.5);
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
    let (mut entries, mut bytes, mut w) = (HashMap::new(), HashMap::new(), HashMap::new());
    for (name, shape, off, spread) in shapes {
        let n: u64 = shape.iter().product();
        let vals: Vec<f32> = (0..n).map(|_| (off + spread * next()) as f32).collect();
        let b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let entry = TensorEntry {
            name: name.clone(),
            component: Component::Text,
            format: TensorFormat::F32,
            shape,
            offset: 0,
            n_bytes: b.len() as u64,
            sha256: String::new(),
        };
        w.insert(name.clone(), vals.iter().map(|&v| v as f64).collect());
        entries.insert(name.clone(), entry);
        bytes.insert(name, b);
    }
    Tiny { hp, entries, bytes, w }
}

fn load(arch: Architecture, t: &Tiny) -> Transformer<CpuBackend> {
    load_on(CpuBackend::default(), arch, t)
}

fn load_on(b: CpuBackend, arch: Architecture, t: &Tiny) -> Transformer<CpuBackend> {
    let get = |name: &str| -> Result<TensorView<'_>> {
        let entry = t.entries.get(name).with_context(|| format!("tensor {name} not found"))?;
        Ok(TensorView { entry, bytes: &t.bytes[name] })
    };
    Transformer::load_with(b, arch, t.hp.clone(), &get).expect("load tiny model")
}

// ---------------------------------------------------------------------------
// The naive float64 forward.

fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    x.iter().zip(w).map(|(v, g)| v / (ms + eps).sqrt() * g).collect()
}

/// `W (n_out, n_in) · x`.
fn mv(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks(x.len()).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn rope(x: &mut [f64], pos: usize, base: f64, scale: f64, rope_dim: usize, style: RopeStyle) {
    let half = rope_dim / 2;
    for i in 0..half {
        let theta = pos as f64 / scale * base.powf(-2.0 * i as f64 / rope_dim as f64);
        let (a, b) = match style {
            RopeStyle::Normal => (2 * i, 2 * i + 1),
            RopeStyle::Neox => (i, i + half),
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * theta.cos() - x1 * theta.sin();
        x[b] = x0 * theta.sin() + x1 * theta.cos();
    }
}

fn naive_nlls(t: &Tiny, tokens: &[u32], first_target: usize) -> Vec<f64> {
    let hp = &t.hp;
    let w = |n: &str| &t.w[n];
    let (d, dh, dv) = (hp.d_model, hp.d_head, hp.d_head_v);
    let act = |g: f64| match hp.activation {
        Activation::Silu => g / (1.0 + (-g).exp()),
        Activation::GeluTanh => 0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh()),
    };
    let cap = |x: f64, c: Option<f64>| c.map_or(x, |c| c * (x / c).tanh());
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&tok| w(names::TOKEN_EMBD)[tok as usize * d..][..d].iter().map(|v| v * hp.embed_scale).collect())
        .collect();
    for l in 0..hp.n_layers {
        let n = |s: &str| blk(l, s);
        let window = hp.sliding_window[l];
        let (base, scale) = if window.is_some() { (hp.rope_base_local, 1.0) } else { (hp.rope_base, hp.rope_scale) };
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, x) in xs.iter().enumerate() {
            let h = rms(x, w(&n("attn_norm.weight")), hp.rms_eps);
            let mut q = mv(w(&n("attn_q.weight")), &h);
            let mut k = mv(w(&n("attn_k.weight")), &h);
            let mut v = mv(w(&n("attn_v.weight")), &h);
            if hp.qkv_bias {
                for (y, b) in [(&mut q, "attn_q.bias"), (&mut k, "attn_k.bias"), (&mut v, "attn_v.bias")] {
                    y.iter_mut().zip(w(&n(b))).for_each(|(a, c)| *a += c);
                }
            }
            for (y, norm) in [(&mut q, "attn_q_norm.weight"), (&mut k, "attn_k_norm.weight")] {
                for head in y.chunks_mut(dh) {
                    if hp.qk_norm {
                        let normed = rms(head, w(&n(norm)), hp.rms_eps);
                        head.copy_from_slice(&normed);
                    }
                    rope(head, pos, base, scale, hp.rope_dim, hp.rope_style);
                }
            }
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        let group = hp.n_heads / hp.n_kv_heads;
        for pos in 0..xs.len() {
            let mut attn = vec![0.0; hp.n_heads * dv];
            for h in 0..hp.n_heads {
                let g = h / group;
                let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let logits: Vec<f64> = (first..=pos)
                    .map(|j| {
                        let dot: f64 = (0..dh).map(|c| qs[pos][h * dh + c] * ks[j][g * dh + c]).sum();
                        cap(dot * hp.attn_scale, hp.attn_softcap)
                    })
                    .collect();
                let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = logits.iter().map(|l| (l - max).exp()).sum();
                for (j, l) in (first..=pos).zip(&logits) {
                    for c in 0..dv {
                        attn[h * dv + c] += (l - max).exp() / z * vs[j][g * dv + c];
                    }
                }
            }
            let mut o = mv(w(&n("attn_output.weight")), &attn);
            if hp.post_norms {
                o = rms(&o, w(&n("post_attention_norm.weight")), hp.rms_eps);
            }
            xs[pos].iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let h = rms(&xs[pos], w(&n("ffn_norm.weight")), hp.rms_eps);
            let gate = mv(w(&n("ffn_gate.weight")), &h);
            let up = mv(w(&n("ffn_up.weight")), &h);
            let a: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| act(*g) * u).collect();
            let mut f = mv(w(&n("ffn_down.weight")), &a);
            if hp.post_norms {
                f = rms(&f, w(&n("post_ffw_norm.weight")), hp.rms_eps);
            }
            xs[pos].iter_mut().zip(&f).for_each(|(a, b)| *a += b);
        }
    }
    let head = if hp.tied_embeddings { w(names::TOKEN_EMBD) } else { w(names::OUTPUT) };
    (first_target..tokens.len())
        .map(|j| {
            let h = rms(&xs[j - 1], w(names::OUTPUT_NORM), hp.rms_eps);
            let logits: Vec<f64> = mv(head, &h).into_iter().map(|l| cap(l, hp.final_softcap)).collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
            lse - logits[tokens[j] as usize]
        })
        .collect()
}

// ---------------------------------------------------------------------------

const ARCHS: [Architecture; 4] = [Architecture::Llama, Architecture::Gemma3, Architecture::Qwen2, Architecture::Qwen3];

fn tokens(n: usize, n_vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 37 + 11) % n_vocab) as u32).collect()
}

#[test]
fn every_architecture_matches_the_naive_f64_forward() {
    for arch in ARCHS {
        let t = tiny(arch, 7);
        let mut model = load(arch, &t);
        let toks = tokens(23, t.hp.n_vocab);
        let want = naive_nlls(&t, &toks, 3);
        for chunk in [None, Some(4)] {
            let opts = ScoreOptions { top_k: 0, prefill_chunk: chunk };
            let got = model.score_window(&toks, 3, &opts, &[]).unwrap();
            assert_eq!(got.len(), want.len());
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g.nll - w).abs() < 2e-5,
                    "{} target {} (prefill {chunk:?}): nll {} vs naive f64 {w}",
                    arch.name(),
                    j + 3,
                    g.nll
                );
            }
        }
    }
}

#[test]
fn the_flags_matter() {
    // Each flag changes the result: the naive forward with the flag flipped
    // (and the weights it needs present) disagrees with the model.
    let t = tiny(Architecture::Gemma3, 3);
    let toks = tokens(23, t.hp.n_vocab);
    let base = naive_nlls(&t, &toks, 3);
    for flip in ["window", "post_norms", "qk_norm", "softcap"] {
        let mut t2 = tiny(Architecture::Gemma3, 3);
        match flip {
            "window" => t2.hp.sliding_window = vec![None; 3],
            "post_norms" => t2.hp.post_norms = false,
            "qk_norm" => t2.hp.qk_norm = false,
            _ => t2.hp.attn_softcap = None,
        }
        let other = naive_nlls(&t2, &toks, 3);
        let diff = base.iter().zip(&other).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(diff > 1e-3, "flipping {flip} changes nothing (max diff {diff})");
    }
}

#[test]
fn extra_ids_and_top_k_are_consistent() {
    let arch = Architecture::Qwen2;
    let t = tiny(arch, 5);
    let mut model = load(arch, &t);
    let toks = tokens(12, t.hp.n_vocab);
    let extra: Vec<Vec<u32>> = (2..12).map(|j| vec![toks[j], 0, 60]).collect();
    let opts = ScoreOptions { top_k: 5, prefill_chunk: None };
    let s = model.score_window(&toks, 2, &opts, &extra).unwrap();
    for (j, r) in s.iter().enumerate() {
        assert_eq!(r.extra.len(), 3);
        assert_eq!(r.extra[0] as f64, r.target_logit, "target {j}: listed target logit");
        assert_eq!(r.top.len(), 5);
        assert_eq!(r.top[0].1 as f64, r.max_logit);
        assert!(r.top.windows(2).all(|p| p[0].1 >= p[1].1));
        assert!((r.nll - (r.lse - r.target_logit)).abs() == 0.0 && r.nll > 0.0);
    }
}

#[test]
fn batched_windows_score_exactly_as_alone() {
    // Three windows of equal length with different first targets, extra ids
    // on every target and top-k, in passes of 4 tokens: scored together they
    // give bit-identical results to each alone (gemma3 exercises the sliding
    // window and both RoPE bases; every layer reads its own KV slot).
    for arch in [Architecture::Gemma3, Architecture::Qwen2] {
        let t = tiny(arch, 9);
        let mut model = load(arch, &t);
        let n_vocab = t.hp.n_vocab;
        let toks: Vec<Vec<u32>> = (0..3).map(|s| tokens(14 + s, n_vocab)[s..].to_vec()).collect();
        let firsts = [1, 7, 13];
        let extra: Vec<Vec<Vec<u32>>> =
            firsts.iter().zip(&toks).map(|(&f, w)| (f..14).map(|j| vec![w[j], (j % n_vocab) as u32]).collect()).collect();
        let opts = ScoreOptions { top_k: 4, prefill_chunk: Some(4) };
        let inputs: Vec<WindowInput> =
            (0..3).map(|s| WindowInput { tokens: &toks[s], first_target: firsts[s], extra_ids: &extra[s] }).collect();
        let together = model.score_windows(&inputs, &opts).unwrap();
        assert_eq!(together.len(), 3);
        for (s, got) in together.iter().enumerate() {
            let alone = model.score_window(&toks[s], firsts[s], &opts, &extra[s]).unwrap();
            assert_eq!(got.len(), 14 - firsts[s], "{} window {s}: target count", arch.name());
            assert_eq!(got, &alone, "{} window {s}: batched differs from alone", arch.name());
        }
        // Different lengths cannot share a pass.
        let bad = [inputs[0], WindowInput { tokens: &toks[1][..10], first_target: 1, extra_ids: &[] }];
        assert!(format!("{:#}", model.score_windows(&bad, &opts).unwrap_err()).contains("window 1 has 10 tokens"));
    }
}

#[test]
fn bad_windows_are_errors() {
    let arch = Architecture::Llama;
    let t = tiny(arch, 1);
    let mut model = load(arch, &t);
    let o = ScoreOptions::default();
    let msg = |r: Result<Vec<TargetScore>>| format!("{:#}", r.unwrap_err());
    assert!(msg(model.score_window(&[], 1, &o, &[])).contains("empty window"));
    assert!(msg(model.score_window(&[1, 2, 3], 0, &o, &[])).contains("first target 0"));
    assert!(msg(model.score_window(&[1, 2, 61], 1, &o, &[])).contains("token 61"));
    assert!(msg(model.score_window(&[1, 2, 3], 1, &o, &[vec![1]])).contains("extra-id lists"));
    let big_k = ScoreOptions { top_k: 65, prefill_chunk: None };
    assert!(msg(model.score_window(&[1, 2, 3], 1, &big_k, &[])).contains("top_k 65"));
    assert_eq!(model.score_window(&[1, 2, 3], 3, &o, &[]).unwrap().len(), 0);
}

#[test]
fn missing_or_misshapen_tensors_are_named() {
    let arch = Architecture::Qwen2;
    let mut t = tiny(arch, 2);
    t.entries.remove("blk.1.attn_k.bias");
    let get = |name: &str| -> Result<TensorView<'_>> {
        let entry = t.entries.get(name).with_context(|| format!("tensor {name} not found"))?;
        Ok(TensorView { entry, bytes: &t.bytes[name] })
    };
    let err = Transformer::load_with(CpuBackend::default(), arch, t.hp.clone(), &get).err().expect("must fail");
    assert!(format!("{err:#}").contains("blk.1.attn_k.bias"), "{err:#}");

    let mut t = tiny(arch, 2);
    t.hp.d_ffn = 40;
    let get = |name: &str| -> Result<TensorView<'_>> { Ok(TensorView { entry: &t.entries[name], bytes: &t.bytes[name] }) };
    let err = Transformer::load_with(CpuBackend::default(), arch, t.hp.clone(), &get).err().expect("must fail");
    assert!(format!("{err:#}").contains("ffn_gate.weight: shape [48, 32], expected [40, 32]"), "{err:#}");
}

#[test]
fn yarn_goes_to_full_attention_layers_only_and_changes_scores() {
    let t = tiny(Architecture::Gemma3, 5);
    assert_eq!(t.hp.sliding_window, vec![Some(5), None, Some(5)]);
    let toks = tokens(20, t.hp.n_vocab);
    let opts = ScoreOptions { top_k: 0, prefill_chunk: None };
    let native = load(Architecture::Gemma3, &t).score_window(&toks, 1, &opts, &[]).unwrap();
    let m = load(Architecture::Gemma3, &t).with_rope_yarn(2.0).unwrap();
    let yarns: Vec<bool> = m
        .layers
        .iter()
        .map(|l| match &l.mixer {
            super::Mixer::Attention(a) => a.rope.yarn.is_some(),
            super::Mixer::DeltaNet(_) => panic!("gemma3 has no DeltaNet layer"),
        })
        .collect();
    assert_eq!(yarns, vec![false, true, false]);
    let mut m = m;
    let scaled = m.score_window(&toks, 1, &opts, &[]).unwrap();
    assert_ne!(native, scaled);
    // Factor 1 is native RoPE exactly; factors outside [1, 4] and an unknown trained context are refused.
    let mut same = load(Architecture::Gemma3, &t).with_rope_yarn(1.0).unwrap();
    assert_eq!(same.score_window(&toks, 1, &opts, &[]).unwrap(), native);
    assert!(load(Architecture::Gemma3, &t).with_rope_yarn(4.5).is_err());
    let mut t0 = tiny(Architecture::Gemma3, 5);
    t0.hp.context_length = 0;
    let err = load(Architecture::Gemma3, &t0).with_rope_yarn(2.0).err().expect("must fail");
    assert!(err.to_string().contains("context_length 0"), "{err}");
}

#[test]
fn quantized_kv_scores_do_not_depend_on_chunking_or_batching() {
    // Heads of 32 so every codec applies; per-row codecs make the CPU's
    // results independent of how positions are split into passes (--reproducible).
    let mut hp = hparams(Architecture::Llama);
    (hp.d_head, hp.d_head_v, hp.rope_dim, hp.attn_scale) = (32, 32, 32, 1.0 / 32f64.sqrt());
    let t = tiny_from(hp, 13);
    let toks = tokens(21, t.hp.n_vocab);
    let whole = ScoreOptions { top_k: 3, prefill_chunk: None };
    let exact = load(Architecture::Llama, &t).score_window(&toks, 2, &whole, &[]).unwrap();
    for f in [crate::kv::KvFormat::Fp8, crate::kv::KvFormat::K4v2, crate::kv::KvFormat::Vq2] {
        let mut m = load_on(CpuBackend::with_kv(f), Architecture::Llama, &t);
        let one = m.score_window(&toks, 2, &whole, &[]).unwrap();
        assert_ne!(one, exact, "{f} changes the scores");
        for chunk in [4, 7] {
            let opts = ScoreOptions { top_k: 3, prefill_chunk: Some(chunk) };
            assert_eq!(m.score_window(&toks, 2, &opts, &[]).unwrap(), one, "{f}: passes of {chunk}");
        }
    }
}

#[test]
fn every_quantized_format_scores_with_kv_rotation_on_and_off() {
    // --kv-rotation on the CPU backend (the spec's codecs): every format's
    // unrotated and rotated paths score finitely, the two differ, and `auto`
    // is whichever of them the format table names.
    use crate::backend::ExecutionSpec;
    use crate::kv::{KvFormat, KvRotation};
    let mut hp = hparams(Architecture::Llama);
    (hp.d_head, hp.d_head_v, hp.rope_dim, hp.attn_scale) = (64, 64, 64, 1.0 / 8.0);
    let t = tiny_from(hp, 17);
    let toks = tokens(21, t.hp.n_vocab);
    let opts = ScoreOptions { top_k: 3, prefill_chunk: None };
    for f in KvFormat::ALL.into_iter().filter(|f| f.is_quantized()) {
        let score = |r: KvRotation| {
            let spec = ExecutionSpec { kv_format: f, kv_rotation: r, lossless: false, ..ExecutionSpec::lossless(1024) };
            let b = CpuBackend::from_spec(&spec).unwrap();
            assert_eq!((b.kv_k, b.kv_v), (f.k_with(r), f.v_with(r)), "{f} {r}");
            load_on(b, Architecture::Llama, &t).score_window(&toks, 2, &opts, &[]).unwrap()
        };
        let (on, off, auto) = (score(KvRotation::On), score(KvRotation::Off), score(KvRotation::Auto));
        assert!(on.iter().chain(&off).all(|s| s.nll.is_finite()), "{f}: finite scores");
        assert_ne!(on, off, "{f}: rotation changes the scores");
        let table = if f.k().rotate || f.v().rotate { &on } else { &off };
        if f.k().rotate == f.v().rotate {
            assert_eq!(&auto, table, "{f}: auto is the table's choice");
        }
    }
}

#[test]
fn cuda_runs_reference_and_reproducible_and_refuses_a_reference_off_the_fp32_route() {
    use crate::backend::cuda::{Route, RouteOptions};
    use clap::Parser;
    let spec = |extra: &[&str]| {
        let mut argv = vec!["infernix-perplexity", "m.ninfer", "--text", "t.txt", "--backend", "cuda"];
        argv.extend_from_slice(extra);
        crate::config::RunConfig::from_args(&crate::cli::Args::try_parse_from(argv).unwrap()).unwrap().spec_for_cuda()
    };
    // The attention fast path is off wherever the route runs no fast path.
    let both = |reference, reproducible| RouteOptions {
        reference,
        reproducible,
        attn_fp8_qk: if reference || reproducible { FastPathUse::Off } else { FastPathUse::Auto },
        attn_int8_qk: if reference || reproducible { FastPathUse::Off } else { FastPathUse::Auto },
        attn_f16: if reference || reproducible { FastPathUse::Off } else { FastPathUse::Auto },
        lm_head_fused: if reference || reproducible { FastPathUse::Off } else { FastPathUse::Auto },
        ..RouteOptions::default()
    };
    // --reference implies --lossless: the FP32 route, with the codec applied exactly.
    let s = spec(&["--reference", "--kv-dtype", "int8"]);
    assert_eq!(cuda_route(&s).unwrap(), (Route::Fp32, both(true, false)));
    assert_eq!(s.kv_format, crate::kv::KvFormat::Int8);
    assert_eq!(cuda_route(&spec(&["--reproducible"])).unwrap(), (Route::Bf16TensorCore, both(false, true)));
    assert_eq!(cuda_route(&spec(&["--reference", "--reproducible"])).unwrap(), (Route::Fp32, both(true, true)));
    assert_eq!(cuda_route(&spec(&["--lossless", "--reproducible"])).unwrap(), (Route::Fp32, both(false, true)));
    assert_eq!(cuda_route(&spec(&[])).unwrap(), (Route::Bf16TensorCore, both(false, false)));
    assert_eq!(cuda_route(&spec(&["--lossless"])).unwrap().1.attn_fp8_qk, FastPathUse::Off);
    assert_eq!(cuda_route(&spec(&["--fast-path", "attn-fp8-qk"])).unwrap().1.attn_fp8_qk, FastPathUse::Forced);
    assert_eq!(cuda_route(&spec(&["--no-fast-path", "attn-fp8-qk"])).unwrap().1.attn_fp8_qk, FastPathUse::Off);
    let int8 = |extra: &[&str]| cuda_route(&spec(&[&["--kv-dtype", "int8"][..], extra].concat())).unwrap().1.attn_int8_qk;
    assert_eq!(int8(&[]), FastPathUse::Auto);
    assert_eq!(int8(&["--fast-path", "attn-int8-qk"]), FastPathUse::Forced);
    assert_eq!(int8(&["--no-fast-path", "attn-int8-qk"]), FastPathUse::Off);
    assert_eq!(int8(&["--use-original-int8-prefill-kernel"]), FastPathUse::Off);
    let f16 = |kv: &str, extra: &[&str]| cuda_route(&spec(&[&["--kv-dtype", kv][..], extra].concat())).unwrap().1.attn_f16;
    assert_eq!(f16("nvfp4", &[]), FastPathUse::Auto);
    assert_eq!(f16("vq2", &["--fast-path", "attn-f16"]), FastPathUse::Forced);
    assert_eq!(f16("k4v2", &["--no-fast-path", "attn-f16"]), FastPathUse::Off);
    assert_eq!(f16("nvfp4", &["--use-original-nvfp4-prefill-kernel"]), FastPathUse::Off);
    assert_eq!(f16("nvfp4", &["--reproducible"]), FastPathUse::Off);
    let lm = |extra: &[&str]| cuda_route(&spec(extra)).unwrap().1.lm_head_fused;
    assert_eq!(lm(&["--fast-path", "lm-head-fused"]), FastPathUse::Forced);
    assert_eq!(lm(&["--no-fast-path", "lm-head-fused"]), FastPathUse::Off);
    assert_eq!(lm(&["--lossless"]), FastPathUse::Off);
    // A spec built by hand that asks for --reference on bf16 inputs, or two precisions, is refused.
    let mut bad = spec(&["--reference"]);
    (bad.matmul_inputs, bad.lm_head_inputs) = (Precision::Bf16, Precision::Bf16);
    let e = cuda_route(&bad).unwrap_err().to_string();
    assert!(e.contains("--reference") && e.contains("bf16"), "{e}");
    let mut bad = spec(&[]);
    bad.lm_head_inputs = Precision::F32;
    assert!(cuda_route(&bad).unwrap_err().to_string().contains("LM-head inputs f32"));
}
