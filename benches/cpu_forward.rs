//! Tokens per second of the CPU backend on SmolLM2-135M (Q4_1): one
//! 512-token window scored like a llama.cpp chunk (targets 257..=511), a
//! warm-up run and then `INFERNIX_BENCH_REPS` (default 3) timed runs. The
//! figure counts every processed token of the window (context and scored).
//!
//! Run: `cargo bench --bench cpu_forward` with `INFERNIX_MODELS` pointing at
//! the folder holding `SmolLM2-135M-Instruct.Q4_1.gguf` (else `models/`).
//! The GGUF is converted to a temporary `.ninfer` artifact first. Token ids
//! are a fixed pseudo-random sequence: speed does not depend on them.
//! A last run goes through a timing decorator of the backend and prints the
//! seconds spent in each op.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use infernix_perplexity::artifact::meta::Activation;
use infernix_perplexity::artifact::{Artifact, TensorView};
use infernix_perplexity::backend::cpu::CpuBackend;
use infernix_perplexity::backend::{AttnParams, Backend, ExecutionInfo, HeadRequest, KvGeometry, PassRows, RopeParams, RowScore};
use infernix_perplexity::convert::{self, ConvertOptions};
use infernix_perplexity::model::{ScoreOptions, Transformer, WindowScorer};

const WINDOW: usize = 512;

fn main() -> Result<()> {
    let models = std::env::var_os("INFERNIX_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models"));
    let gguf = models.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let reps: usize = std::env::var("INFERNIX_BENCH_REPS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("smollm2.ninfer");
    convert::convert(&gguf, &out, &ConvertOptions::default()).with_context(|| format!("convert {}", gguf.display()))?;
    let art = Artifact::open(&out)?;
    let t = Instant::now();
    let mut model = Transformer::load(CpuBackend::default(), &art)?;
    eprintln!("loaded in {:.2} s on {}", t.elapsed().as_secs_f64(), CpuBackend::default().describe());

    let n_vocab = model.hparams().n_vocab as u64;
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let tokens: Vec<u32> = (0..WINDOW)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % n_vocab) as u32
        })
        .collect();
    let opts = ScoreOptions::default();
    model.score_window(&tokens, WINDOW / 2 + 1, &opts, &[])?; // warm-up
    let mut best = f64::INFINITY;
    let mut total = 0.0;
    for r in 0..reps {
        let t = Instant::now();
        let scores = model.score_window(&tokens, WINDOW / 2 + 1, &opts, &[])?;
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(scores.len(), WINDOW / 2 - 1);
        eprintln!("run {r}: {secs:.3} s, {:.1} tokens/s", WINDOW as f64 / secs);
        best = best.min(secs);
        total += secs;
    }
    println!(
        "cpu_forward smollm2 window {WINDOW}: mean {:.1} tokens/s, best {:.1} tokens/s over {reps} runs ({})",
        WINDOW as f64 * reps as f64 / total,
        WINDOW as f64 / best,
        CpuBackend::default().describe()
    );

    let mut timed = Transformer::load(Timed::default(), &art)?;
    let t = Instant::now();
    timed.score_window(&tokens, WINDOW / 2 + 1, &opts, &[])?;
    let secs = t.elapsed().as_secs_f64();
    let per_op = timed.backend().seconds.borrow();
    let parts: Vec<String> = per_op.iter().map(|(op, s)| format!("{op} {s:.3} s ({:.0} %)", 100.0 * s / secs)).collect();
    eprintln!("profiled run {secs:.3} s: {}", parts.join(", "));
    Ok(())
}

/// The CPU backend with the wall time of each op added up.
#[derive(Default)]
struct Timed {
    inner: CpuBackend,
    seconds: RefCell<BTreeMap<&'static str, f64>>,
}

// SAFETY: the bench drives the model from one thread; `seconds` is only
// touched by the op calls on that thread.
unsafe impl Send for Timed {}

impl Timed {
    fn time<R>(&self, op: &'static str, f: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let r = f();
        *self.seconds.borrow_mut().entry(op).or_default() += t.elapsed().as_secs_f64();
        r
    }
}

type Cpu = CpuBackend;

impl Backend for Timed {
    type Act = <Cpu as Backend>::Act;
    type Matrix = <Cpu as Backend>::Matrix;
    type Vector = <Cpu as Backend>::Vector;
    type KvCache = <Cpu as Backend>::KvCache;
    type Recurrent = <Cpu as Backend>::Recurrent;
    type ExpertCounts = <Cpu as Backend>::ExpertCounts;
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn execution(&self) -> ExecutionInfo {
        self.inner.execution()
    }
    fn load_matrix(&self, v: &TensorView) -> Result<Self::Matrix> {
        self.inner.load_matrix(v)
    }
    fn load_vector(&self, v: &TensorView) -> Result<Self::Vector> {
        self.inner.load_vector(v)
    }
    fn new_kv_cache(&self, g: KvGeometry) -> Result<Self::KvCache> {
        self.inner.new_kv_cache(g)
    }
    fn new_expert_counts(&self, n_experts: usize) -> Result<Self::ExpertCounts> {
        self.inner.new_expert_counts(n_experts)
    }
    fn read_expert_counts(&self, c: &Self::ExpertCounts) -> Result<Vec<u64>> {
        self.inner.read_expert_counts(c)
    }
    fn embed(&self, t: &Self::Matrix, tokens: &[u32], scale: f64) -> Result<Self::Act> {
        self.time("embed", || self.inner.embed(t, tokens, scale))
    }
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f64) -> Result<Self::Act> {
        self.time("rms_norm", || self.inner.rms_norm(x, w, eps))
    }
    fn rms_norm_heads(&self, x: &mut Self::Act, w: &Self::Vector, d: usize, eps: f64) -> Result<()> {
        self.time("rms_norm_heads", || self.inner.rms_norm_heads(x, w, d, eps))
    }
    fn matmul(&self, x: &Self::Act, w: &Self::Matrix) -> Result<Self::Act> {
        self.time("matmul", || self.inner.matmul(x, w))
    }
    fn add_bias(&self, x: &mut Self::Act, b: &Self::Vector) -> Result<()> {
        self.time("add_bias", || self.inner.add_bias(x, b))
    }
    fn rope(&self, x: &mut Self::Act, n_heads: usize, d: usize, rows: PassRows, p: &RopeParams) -> Result<()> {
        self.time("rope", || self.inner.rope(x, n_heads, d, rows, p))
    }
    fn attention(
        &self,
        c: &mut Self::KvCache,
        l: usize,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        rows: PassRows,
        p: &AttnParams,
    ) -> Result<Self::Act> {
        self.time("attention", || self.inner.attention(c, l, q, k, v, rows, p))
    }
    fn gated_act(&self, g: &Self::Act, u: &Self::Act, a: Activation) -> Result<Self::Act> {
        self.time("gated_act", || self.inner.gated_act(g, u, a))
    }
    fn add_assign(&self, x: &mut Self::Act, y: &Self::Act) -> Result<()> {
        self.time("add", || self.inner.add_assign(x, y))
    }
    fn score_rows(&self, x: &Self::Act, rows: &[usize], h: &Self::Matrix, r: &HeadRequest) -> Result<Vec<RowScore>> {
        self.time("lm_head", || self.inner.score_rows(x, rows, h, r))
    }
}
