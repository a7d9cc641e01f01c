//! Qwen3-Next's Gated DeltaNet ops on the CPU (`backend::cpu::delta_net`,
//! not yet wired into a model) against transformers in float64: the
//! per-token recurrence with L2-normalized q/k and grouped value heads, and
//! the depthwise causal convolution + SiLU, each in one call and in several
//! calls carrying the recurrent state / convolution history.
//! `tests/data/delta_net_golden.json` is made by `tools/delta_net_golden.py`
//! (transformers 5.24; the file records the versions).

use std::path::Path;

use infernix_perplexity::backend::cpu::delta_net::{causal_conv_silu, gated_delta_rule, DeltaNetShape};
use serde_json::Value;

#[path = "common/seeded.rs"]
mod seeded;

/// Absolute bound per output value. The golden is float64; ours reads f32
/// inputs (the same values), keeps the state in f64 and rounds each output
/// to f32 once (half an ulp of values below 4: 2.4e-7).
const TOL: f64 = 5e-7;

fn golden() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/delta_net_golden.json");
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

fn input(g: &Value, name: &str) -> Vec<f32> {
    let spec = g["inputs"].as_array().unwrap().iter().find(|i| i["name"] == name).unwrap();
    let n: usize = spec["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).product();
    seeded::generate(name, n, spec["scale"].as_f64().unwrap(), spec["offset"].as_f64().unwrap())
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn check(what: &str, ours: &[f32], want: &[f64]) {
    let ours: Vec<f64> = ours.iter().map(|&x| x as f64).collect();
    let (d, at) = seeded::worst(&ours, want);
    eprintln!("{what}: worst |diff| {d:.3e} at {at} ({:.0}% of {TOL:e})", 100.0 * d / TOL);
    assert!(d <= TOL, "{what}: worst |diff| {d:.3e} at {at} (ours {}, transformers {})", ours[at], want[at]);
}

#[test]
fn gated_delta_rule_matches_transformers_in_one_and_several_calls() {
    let g = golden();
    let sh = &g["shape"];
    let u = |k: &str| sh[k].as_u64().unwrap() as usize;
    let s = DeltaNetShape { n_k_heads: u("n_k_heads"), n_v_heads: u("n_v_heads"), d_k: u("d_k"), d_v: u("d_v"), qk_l2norm: true };
    let (q, k, v, gate, beta) = (input(&g, "dn.q"), input(&g, "dn.k"), input(&g, "dn.v"), input(&g, "dn.g"), input(&g, "dn.beta"));
    let mut state = vec![0f64; s.state_len()];
    let out = gated_delta_rule(&q, &k, &v, &gate, &beta, &s, &mut state).unwrap();
    check("delta rule, one call", &out, &f64s(&g["delta_out"]));
    let (d, _) = seeded::worst(&state, &f64s(&g["delta_final_state"]));
    assert!(d <= 1e-12, "final recurrent state differs by {d:.3e}");

    // Passes of 6, 1 and 13 tokens, the state carried: the same numbers bit for bit.
    let (qk, vh) = (s.n_k_heads * s.d_k, s.n_v_heads * s.d_v);
    let mut st = vec![0f64; s.state_len()];
    let mut parts = Vec::new();
    for (a, b) in [(0, 6), (6, 7), (7, u("n"))] {
        let nh = s.n_v_heads;
        parts.extend(
            gated_delta_rule(&q[a * qk..b * qk], &k[a * qk..b * qk], &v[a * vh..b * vh], &gate[a * nh..b * nh], &beta[a * nh..b * nh], &s, &mut st)
                .unwrap(),
        );
    }
    assert_eq!(parts, out, "several calls must equal one");
    assert_eq!(st, state);
    // Teeth: without the L2 norm (or with the state dropped between calls) the outputs move far.
    let mut fresh = vec![0f64; s.state_len()];
    let raw = gated_delta_rule(&q, &k, &v, &gate, &beta, &DeltaNetShape { qk_l2norm: false, ..s }, &mut fresh).unwrap();
    let (d, _) = seeded::worst(&raw.iter().map(|&x| x as f64).collect::<Vec<_>>(), &f64s(&g["delta_out"]));
    assert!(d > 1000.0 * TOL, "without the L2 norm only {d:.3e}");
}

#[test]
fn causal_conv_matches_transformers_in_one_and_several_calls() {
    let g = golden();
    let (c, w) = (g["shape"]["conv_channels"].as_u64().unwrap() as usize, g["shape"]["conv_width"].as_u64().unwrap() as usize);
    let (x, weight) = (input(&g, "conv.x"), input(&g, "conv.w"));
    let mut hist = vec![0f32; (w - 1) * c];
    let out = causal_conv_silu(&x, &weight, c, w, &mut hist).unwrap();
    check("causal conv + SiLU, one call", &out, &f64s(&g["conv_out"]));
    let mut h2 = vec![0f32; (w - 1) * c];
    let mut parts = Vec::new();
    for (a, b) in [(0, 1), (1, 9), (9, 20)] {
        parts.extend(causal_conv_silu(&x[a * c..b * c], &weight, c, w, &mut h2).unwrap());
    }
    assert_eq!(parts, out, "several calls must equal one");
    // Dropping the history between calls is caught.
    let mut cold = vec![0f32; (w - 1) * c];
    let restarted = causal_conv_silu(&x[9 * c..], &weight, c, w, &mut cold).unwrap();
    assert_ne!(&restarted[..], &out[9 * c..]);
}
