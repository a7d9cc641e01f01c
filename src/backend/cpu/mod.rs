//! The CPU reference backend: plain loops, f64 reductions where they matter;
//! every optimised path elsewhere is checked against it.
//!
//! Precision: weights are dequantized to f32 once at load (exactly as ggml
//! decodes them), activations are stored in f32, matrix products accumulate
//! in f32 in a blocked GEMM (`gemm`), and everything that decides a result --
//! RMSNorm's sum of squares, softmax, log-sum-exp, NLL, rotary angles'
//! rotation, activations -- is evaluated in f64. This meets the float64
//! reference to well under 1e-4 nats per chunk (tests/cpu_reference.rs).
//!
//! Parallelism: rayon across output columns, heads and vocabulary tiles;
//! partial results are always combined in a fixed order, so two runs give
//! bit-identical numbers.
//!
//! KV formats: K and V rows enter the cache through the codec of the run's
//! KV format (`crate::kv`, the reference definition of every format):
//! `decode(encode(row))` is what attention reads. `CpuBackend::default()`
//! stores f32 (nothing lost); the CLI's default is fp8 (`--lossless`: f32).
//!
//! Emulation: on request the backend rounds where a faster route rounds --
//! both inputs of every matrix product to bf16 (the CUDA default route's
//! tensor-core inputs; `ExecutionSpec::matmul_inputs`) -- and nowhere else
//! but the KV codec. Its distance from the exact reference then measures that
//! rounding alone, with no kernel in the way (docs/numerical-quality.md).

pub mod attention;
pub mod delta_net;
pub mod dequant;
pub mod gemm;
pub mod head;
pub mod moe;
pub mod ops;

use std::borrow::Cow;

use anyhow::{bail, ensure, Context, Result};
use half::bf16;
use rayon::prelude::*;

use crate::artifact::meta::Activation;
use crate::artifact::TensorView;
use crate::backend::{
    AttnParams, Backend, DeltaNetParams, DeltaNetWeights, ExecutionInfo, ExecutionSpec, Expert, HeadRequest, KvGeometry, MoeRouting, PassRows, Precision,
    RecurrentState, RopeParams, RowScore,
};
use crate::kv::{ElemCodec, KvFormat, RowCodec};

/// Row-major `(n_rows, n_cols)` f32 activations.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub n_rows: usize,
    pub n_cols: usize,
    pub data: Vec<f32>,
}

impl CpuTensor {
    pub fn new(n_rows: usize, n_cols: usize, data: Vec<f32>) -> Result<Self> {
        ensure!(data.len() == n_rows * n_cols, "tensor: {} values for {n_rows} x {n_cols}", data.len());
        Ok(Self { n_rows, n_cols, data })
    }
}

/// A weight `(n_out, n_in)` dequantized to f32, row-major.
#[derive(Debug, Clone)]
pub struct CpuMatrix {
    pub name: String,
    pub n_out: usize,
    pub n_in: usize,
    pub data: Vec<f32>,
}

/// K `(n_seqs, max_pos, n_kv_heads * d_head)` and V `(n_seqs, max_pos,
/// n_kv_heads * d_head_v)` per layer, holding what the KV codec's decode
/// gives back for each stored row: `decode(encode(row))` is computed once as
/// the row is stored, which is what every later read of the encoded bytes
/// would return (decode is a pure function of the bytes).
#[derive(Debug, Clone)]
pub struct CpuKvCache {
    pub geometry: KvGeometry,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Elements the codecs counted as non-finite as they were stored.
    n_nonfinite: usize,
}

impl CpuKvCache {
    /// Elements counted non-finite by the KV codecs so far (`kv::RowCodec::encode_row`).
    pub fn n_nonfinite(&self) -> usize {
        self.n_nonfinite
    }
}

/// The CPU backend. Threads come from rayon's global pool
/// (`RAYON_NUM_THREADS`). `CpuBackend::default()` is the reference: f32
/// everywhere, nothing rounded on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuBackend {
    /// Round both inputs of every matrix product (activations and dequantized
    /// weights, LM head included) to bf16 before the f32 product, as the CUDA
    /// default route feeds its tensor cores (`--emulate-bf16-tc`); with a
    /// bf16 KV cache also the queries before attention, as the CUDA
    /// tensor-core attention (kernel v2) rounds them.
    pub bf16_matmul_inputs: bool,
    /// The KV format (for the report).
    pub kv_format: KvFormat,
    /// Codecs K and V rows go through as they are stored (`crate::kv`).
    pub kv_k: RowCodec,
    pub kv_v: RowCodec,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::with_kv(KvFormat::F32)
    }
}

/// `x` rounded to the nearest bf16 (ties to even), back in f32.
fn to_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Every element of `v` through [`to_bf16`].
fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.par_iter().map(|&x| to_bf16(x)).collect()
}

impl CpuBackend {
    /// f32 matrix products, K and V stored in `kv`.
    pub fn with_kv(kv: KvFormat) -> Self {
        Self { bf16_matmul_inputs: false, kv_format: kv, kv_k: kv.k(), kv_v: kv.v() }
    }

    /// The backend a spec asks for: its matmul precision and KV codecs. The
    /// LM head is rounded with the other products (one flag, as on CUDA).
    pub fn from_spec(spec: &ExecutionSpec) -> Result<Self> {
        ensure!(
            spec.matmul_inputs == spec.lm_head_inputs,
            "cpu backend: matmul inputs {} but LM-head inputs {}: one precision for both",
            spec.matmul_inputs.name(),
            spec.lm_head_inputs.name()
        );
        if let Some(name) = spec.fast_paths.first() {
            bail!("--fast-path {name}: the CPU backend runs no fast path (they are CUDA kernels): drop it or use --backend cuda");
        }
        Ok(Self {
            bf16_matmul_inputs: spec.matmul_inputs == Precision::Bf16,
            kv_format: spec.kv_format,
            kv_k: spec.kv_k(),
            kv_v: spec.kv_v(),
        })
    }

    /// A matrix-product input as this backend feeds it: as is, or rounded to bf16.
    fn matmul_input<'a>(&self, v: &'a [f32]) -> Cow<'a, [f32]> {
        if self.bf16_matmul_inputs {
            Cow::Owned(round_bf16(v))
        } else {
            Cow::Borrowed(v)
        }
    }

    /// The queries as attention reads them: rounded to bf16 where the CUDA
    /// default route's tensor-core attention (kernel v2, every cache but f32)
    /// rounds q itself, that is where K is stored unrotated (bf16, fp8 by the
    /// table, any format under `--kv-rotation off`). Under a Hadamard-rotated K
    /// (the other quantized formats, `KvFormat::k`; any under `--kv-rotation on`)
    /// v2 rounds the rotated `Hq` instead, in the basis the CPU cache does not
    /// keep, so q stays f32 here.
    fn rounds_attention_query(&self) -> bool {
        self.bf16_matmul_inputs && self.kv_format != KvFormat::F32 && !self.kv_k.rotate
    }

    /// q through [`Self::rounds_attention_query`].
    fn attention_query<'a>(&self, q: &'a [f32]) -> Cow<'a, [f32]> {
        if self.rounds_attention_query() {
            Cow::Owned(round_bf16(q))
        } else {
            Cow::Borrowed(q)
        }
    }

    /// Stores `src` `(n_pos, n_kv_heads * d)` into a KV cache slice of the
    /// same shape through `codec`, row by row (one row per position and KV
    /// head): `dst = decode(encode(src))`. Returns the elements the codec
    /// counted non-finite.
    fn kv_store(codec: RowCodec, d: usize, dst: &mut [f32], src: &[f32]) -> Result<usize> {
        if codec.elem == ElemCodec::F32 {
            dst.copy_from_slice(src);
            return Ok(src.iter().filter(|v| !v.is_finite()).count());
        }
        codec.check_len(d)?;
        let n_bytes = codec.row_bytes(d);
        let counts = dst
            .par_chunks_mut(d)
            .zip(src.par_chunks(d))
            .map_init(
                || vec![0u8; n_bytes],
                |bytes, (o, x)| -> Result<usize> {
                    let n_bad = codec.encode_row(x, bytes)?;
                    codec.decode_row(bytes, o)?;
                    Ok(n_bad)
                },
            )
            .collect::<Result<Vec<usize>>>()?;
        Ok(counts.iter().sum())
    }
}

fn same_shape(op: &str, a: &CpuTensor, b: &CpuTensor) -> Result<()> {
    ensure!(
        a.n_rows == b.n_rows && a.n_cols == b.n_cols,
        "{op}: shapes differ ({} x {} and {} x {})",
        a.n_rows,
        a.n_cols,
        b.n_rows,
        b.n_cols
    );
    Ok(())
}

impl Backend for CpuBackend {
    type Act = CpuTensor;
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type KvCache = CpuKvCache;
    type Recurrent = Vec<RecurrentState>;
    type ExpertCounts = Vec<u64>;

    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn load_matrix(&self, view: &TensorView) -> Result<CpuMatrix> {
        let shape = &view.entry.shape;
        ensure!(shape.len() == 2, "tensor {}: shape {shape:?} is not a matrix", view.entry.name);
        let (n_out, n_in) = view.rows_cols();
        let data = dequant::dequantize(view)?;
        Ok(CpuMatrix { name: view.entry.name.clone(), n_out, n_in, data })
    }

    fn load_vector(&self, view: &TensorView) -> Result<Vec<f32>> {
        let shape = &view.entry.shape;
        ensure!(shape.len() == 1, "tensor {}: shape {shape:?} is not a vector", view.entry.name);
        dequant::dequantize(view)
    }

    fn new_kv_cache(&self, g: KvGeometry) -> Result<CpuKvCache> {
        let slots = g.n_seqs * g.max_pos;
        let k = (0..g.n_layers).map(|_| vec![0f32; slots * g.n_kv_heads * g.d_head]).collect();
        let v = (0..g.n_layers).map(|_| vec![0f32; slots * g.n_kv_heads * g.d_head_v]).collect();
        self.kv_k.check_len(g.d_head).context("kv cache: K rows")?;
        self.kv_v.check_len(g.d_head_v).context("kv cache: V rows")?;
        Ok(CpuKvCache { geometry: g, k, v, n_nonfinite: 0 })
    }

    fn new_recurrent(&self, p: &DeltaNetParams, n_seqs: usize) -> Result<Vec<RecurrentState>> {
        Ok(vec![RecurrentState::new(p); n_seqs])
    }

    fn recurrent_states(&self, r: &Vec<RecurrentState>) -> Result<Vec<RecurrentState>> {
        Ok(r.clone())
    }

    fn embed(&self, table: &CpuMatrix, tokens: &[u32], scale: f64) -> Result<CpuTensor> {
        let d = table.n_in;
        let mut out = vec![0f32; tokens.len() * d];
        for (row, &t) in out.chunks_exact_mut(d).zip(tokens) {
            ensure!((t as usize) < table.n_out, "embed: token {t} is outside the vocabulary of {}", table.n_out);
            let src = &table.data[t as usize * d..(t as usize + 1) * d];
            for (o, &v) in row.iter_mut().zip(src) {
                *o = (v as f64 * scale) as f32;
            }
        }
        CpuTensor::new(tokens.len(), d, out)
    }

    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f64) -> Result<CpuTensor> {
        ensure!(w.len() == x.n_cols, "rms_norm: weight has {} elements, rows have {}", w.len(), x.n_cols);
        let mut out = vec![0f32; x.data.len()];
        out.par_chunks_mut(x.n_cols)
            .zip(x.data.par_chunks(x.n_cols))
            .for_each(|(o, r)| ops::rms_norm_row(r, w, eps, o));
        CpuTensor::new(x.n_rows, x.n_cols, out)
    }

    fn rms_norm_heads(&self, x: &mut CpuTensor, w: &Vec<f32>, d_head: usize, eps: f64) -> Result<()> {
        ensure!(w.len() == d_head, "rms_norm_heads: weight has {} elements, d_head is {d_head}", w.len());
        ensure!(x.n_cols % d_head == 0, "rms_norm_heads: rows of {} are not whole heads of {d_head}", x.n_cols);
        let mut tmp = vec![0f32; d_head];
        for head in x.data.chunks_exact_mut(d_head) {
            ops::rms_norm_row(head, w, eps, &mut tmp);
            head.copy_from_slice(&tmp);
        }
        Ok(())
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuMatrix) -> Result<CpuTensor> {
        ensure!(
            x.n_cols == w.n_in,
            "matmul {}: x has {} columns, the weight takes {}",
            w.name,
            x.n_cols,
            w.n_in
        );
        let (xs, ws) = (self.matmul_input(&x.data), self.matmul_input(&w.data));
        let out = gemm::matmul_nt(&xs, x.n_rows, &ws, w.n_out, w.n_in).with_context(|| format!("matmul {}", w.name))?;
        CpuTensor::new(x.n_rows, w.n_out, out)
    }

    fn add_bias(&self, x: &mut CpuTensor, b: &Vec<f32>) -> Result<()> {
        ensure!(b.len() == x.n_cols, "add_bias: bias has {} elements, rows have {}", b.len(), x.n_cols);
        for row in x.data.chunks_exact_mut(x.n_cols) {
            for (v, &c) in row.iter_mut().zip(b) {
                *v = (*v as f64 + c as f64) as f32;
            }
        }
        Ok(())
    }

    fn rope(&self, x: &mut CpuTensor, n_heads: usize, d_head: usize, rows: PassRows, p: &RopeParams) -> Result<()> {
        ensure!(
            x.n_cols == n_heads * d_head,
            "rope: rows have {} columns, expected {n_heads} heads x {d_head}",
            x.n_cols
        );
        ensure!(
            p.rope_dim % 2 == 0 && p.rope_dim <= d_head,
            "rope: rope_dim {} is odd or exceeds d_head {d_head}",
            p.rope_dim
        );
        ensure!(x.n_rows == rows.n_rows(), "rope: {} rows for a pass of {rows:?}", x.n_rows);
        let n_cols = x.n_cols;
        x.data.par_chunks_mut(n_cols).enumerate().for_each(|(i, row)| {
            let cs = ops::rope_cos_sin(rows.position(i), p);
            for head in row.chunks_exact_mut(d_head) {
                ops::rope_head(head, &cs, p.style);
            }
        });
        Ok(())
    }

    fn attention(
        &self,
        cache: &mut CpuKvCache,
        layer: usize,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        rows: PassRows,
        p: &AttnParams,
    ) -> Result<CpuTensor> {
        let g = cache.geometry;
        let (n, pos0) = (rows.n_tokens, rows.pos0);
        ensure!(layer < g.n_layers, "attention: layer {layer} of a cache for {}", g.n_layers);
        ensure!(rows.n_seqs <= g.n_seqs, "attention: {} windows in a pass, the KV cache has {} slots", rows.n_seqs, g.n_seqs);
        ensure!(
            pos0 + n <= g.max_pos,
            "attention: positions {pos0}..{} exceed the KV cache's {}",
            pos0 + n,
            g.max_pos
        );
        ensure!(
            q.n_rows == rows.n_rows() && k.n_rows == q.n_rows && v.n_rows == q.n_rows,
            "attention: q, k, v have {}, {}, {} rows for a pass of {rows:?}",
            q.n_rows,
            k.n_rows,
            v.n_rows
        );
        let (k_cols, v_cols) = (g.n_kv_heads * g.d_head, g.n_kv_heads * g.d_head_v);
        ensure!(
            k.n_cols == k_cols && v.n_cols == v_cols && q.n_cols == p.n_heads * p.d_head,
            "attention: k has {} columns (cache {k_cols}), v {} (cache {v_cols}), q {} ({} heads x {})",
            k.n_cols,
            v.n_cols,
            q.n_cols,
            p.n_heads,
            p.d_head
        );
        let out_cols = p.n_heads * p.d_head_v;
        let mut out = Vec::with_capacity(rows.n_rows() * out_cols);
        for s in 0..rows.n_seqs {
            // Slot s of this layer's cache: (max_pos, cols).
            let kc = &mut cache.k[layer][s * g.max_pos * k_cols..(s + 1) * g.max_pos * k_cols];
            let vc = &mut cache.v[layer][s * g.max_pos * v_cols..(s + 1) * g.max_pos * v_cols];
            let k_src = &k.data[s * n * k_cols..(s + 1) * n * k_cols];
            let v_src = &v.data[s * n * v_cols..(s + 1) * n * v_cols];
            cache.n_nonfinite += Self::kv_store(self.kv_k, g.d_head, &mut kc[pos0 * k_cols..(pos0 + n) * k_cols], k_src)
                .context("attention: store K")?;
            cache.n_nonfinite += Self::kv_store(self.kv_v, g.d_head_v, &mut vc[pos0 * v_cols..(pos0 + n) * v_cols], v_src)
                .context("attention: store V")?;
            let q_s = self.attention_query(&q.data[s * n * q.n_cols..(s + 1) * n * q.n_cols]);
            out.extend(attention::attention(&q_s, n, kc, vc, pos0, p)?);
        }
        CpuTensor::new(rows.n_rows(), out_cols, out)
    }

    fn gated_act(&self, gate: &CpuTensor, up: &CpuTensor, act: Activation) -> Result<CpuTensor> {
        same_shape("gated_act", gate, up)?;
        let mut out = vec![0f32; gate.data.len()];
        out.par_chunks_mut(gate.n_cols.max(1))
            .zip(gate.data.par_chunks(gate.n_cols.max(1)).zip(up.data.par_chunks(gate.n_cols.max(1))))
            .for_each(|(o, (g, u))| {
                for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                    *o = (ops::activate(act, g as f64) * u as f64) as f32;
                }
            });
        CpuTensor::new(gate.n_rows, gate.n_cols, out)
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        same_shape("add", x, y)?;
        for (a, &b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
        Ok(())
    }

    fn new_expert_counts(&self, n_experts: usize) -> Result<Vec<u64>> {
        Ok(vec![0; n_experts])
    }

    fn read_expert_counts(&self, c: &Vec<u64>) -> Result<Vec<u64>> {
        Ok(c.clone())
    }

    fn moe_ffn(
        &self,
        x: &CpuTensor,
        router_logits: &CpuTensor,
        experts: &[Expert<CpuMatrix>],
        p: &MoeRouting,
        counts: &mut Vec<u64>,
    ) -> Result<CpuTensor> {
        self.moe_ffn_cpu(x, router_logits, experts, p, counts)
    }

    fn sigmoid_mul(&self, x: &mut CpuTensor, gate: &CpuTensor) -> Result<()> {
        ensure!(
            gate.n_rows == x.n_rows && (gate.n_cols == x.n_cols || gate.n_cols == 1),
            "sigmoid_mul: gate is {} x {}, x is {} x {} (same shape, or one gate column)",
            gate.n_rows,
            gate.n_cols,
            x.n_rows,
            x.n_cols
        );
        let d = x.n_cols.max(1);
        for (r, row) in x.data.chunks_exact_mut(d).enumerate() {
            let g = &gate.data[r * gate.n_cols..(r + 1) * gate.n_cols];
            for (j, v) in row.iter_mut().enumerate() {
                let gj = g[if gate.n_cols == 1 { 0 } else { j }] as f64;
                *v = (*v as f64 * ops::sigmoid(gj)) as f32;
            }
        }
        Ok(())
    }

    fn delta_net(
        &self,
        qkv: &CpuTensor,
        z: &CpuTensor,
        ba: &CpuTensor,
        w: &DeltaNetWeights<Vec<f32>>,
        p: &DeltaNetParams,
        states: &mut Vec<RecurrentState>,
        rows: PassRows,
    ) -> Result<CpuTensor> {
        delta_net::delta_net_layer(qkv, z, ba, w, p, states, rows)
    }

    fn score_rows(&self, x: &CpuTensor, rows: &[usize], head: &CpuMatrix, req: &HeadRequest) -> Result<Vec<RowScore>> {
        ensure!(
            x.n_cols == head.n_in,
            "score_rows: rows have {} columns, the head {} takes {}",
            x.n_cols,
            head.name,
            head.n_in
        );
        let d = x.n_cols;
        let mut gathered = Vec::with_capacity(rows.len() * d);
        for &r in rows {
            ensure!(r < x.n_rows, "score_rows: row {r} of {}", x.n_rows);
            gathered.extend_from_slice(&x.data[r * d..(r + 1) * d]);
        }
        let (xs, ws) = (self.matmul_input(&gathered), self.matmul_input(&head.data));
        head::score_rows(&xs, rows.len(), &ws, head.n_out, d, req)
    }

    fn execution(&self) -> ExecutionInfo {
        let route = if self.bf16_matmul_inputs { "bf16-tc-emulated" } else { "fp32" };
        let matmul = if self.bf16_matmul_inputs {
            "inputs rounded to bf16 (round to nearest even), f32 products (emulates the CUDA default route)"
        } else {
            "f32 inputs, f32 products"
        };
        ExecutionInfo {
            backend: "cpu".into(),
            device: self.describe(),
            kv_dtype: self.kv_format.name().into(),
            route: route.into(),
            details: serde_json::json!({
                "matmul": matmul,
                "lm_head": matmul,
                "attention": if self.rounds_attention_query() {
                    "q rounded to bf16 (emulates the CUDA tensor-core attention, kernel v2); f64 softmax"
                } else {
                    "f32 q; f64 softmax"
                },
                "kv_k_codec": self.kv_k.name(),
                "kv_v_codec": self.kv_v.name(),
                "kv_storage": "decode(encode(row)) through crate::kv, stored as f32",
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::meta::RopeStyle;

    fn t(n_rows: usize, n_cols: usize, data: &[f32]) -> CpuTensor {
        CpuTensor::new(n_rows, n_cols, data.to_vec()).unwrap()
    }

    #[test]
    fn qk_norm_is_per_head() {
        // Two heads of 2: [3, 4] and [0, 2], eps 0, weight [1, 1]:
        // rms 3.5355 -> [0.8485, 1.1314]; rms sqrt(2) -> [0, 1.4142].
        let mut x = t(1, 4, &[3.0, 4.0, 0.0, 2.0]);
        CpuBackend::default().rms_norm_heads(&mut x, &vec![1.0, 1.0], 2, 0.0).unwrap();
        let want = [3.0 / 12.5f64.sqrt(), 4.0 / 12.5f64.sqrt(), 0.0, 2.0 / 2f64.sqrt()];
        for (a, b) in x.data.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{:?}", x.data);
        }
    }

    #[test]
    fn gated_act_and_bias() {
        let g = t(1, 2, &[0.0, 2.0]);
        let u = t(1, 2, &[5.0, 3.0]);
        let y = CpuBackend::default().gated_act(&g, &u, Activation::Silu).unwrap();
        assert_eq!(y.data[0], 0.0);
        assert!((y.data[1] as f64 - 3.0 * ops::silu(2.0)).abs() < 1e-6);
        let mut x = t(2, 2, &[1.0, 2.0, 3.0, 4.0]);
        CpuBackend::default().add_bias(&mut x, &vec![10.0, 20.0]).unwrap();
        assert_eq!(x.data, vec![11.0, 22.0, 13.0, 24.0]);
        assert!(CpuBackend::default().add_bias(&mut x, &vec![1.0]).is_err());
    }

    #[test]
    fn rope_uses_row_positions() {
        // Row i is at position pos0 + i: with pos0 = 1, row 0 turns by 1 rad (inv_freq 1).
        let p = RopeParams { style: RopeStyle::Neox, base: 10000.0, scale: 1.0, rope_dim: 2, yarn: None };
        let mut x = t(2, 2, &[1.0, 0.0, 1.0, 0.0]);
        CpuBackend::default().rope(&mut x, 1, 2, PassRows::single(2, 1), &p).unwrap();
        assert!((x.data[0] as f64 - 1f64.cos()).abs() < 1e-6 && (x.data[1] as f64 - 1f64.sin()).abs() < 1e-6);
        assert!((x.data[2] as f64 - 2f64.cos()).abs() < 1e-6 && (x.data[3] as f64 - 2f64.sin()).abs() < 1e-6);
        // Two windows of one row each at pos0 = 1: both rows turn by 1 rad.
        let mut x = t(2, 2, &[1.0, 0.0, 1.0, 0.0]);
        CpuBackend::default().rope(&mut x, 1, 2, PassRows { n_seqs: 2, n_tokens: 1, pos0: 1 }, &p).unwrap();
        assert_eq!(x.data[0..2], x.data[2..4]);
        assert!((x.data[2] as f64 - 1f64.cos()).abs() < 1e-6);
        assert!(CpuBackend::default().rope(&mut x, 1, 2, PassRows::single(3, 0), &p).is_err());
    }

    /// Values in [-2, 2) with full f32 mantissas (none is a bf16 value).
    fn ragged(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761) | 1;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 8) as f32 / (1u32 << 22) as f32 - 2.0 + 1e-3
            })
            .collect()
    }

    const EMULATED: CpuBackend = CpuBackend {
        bf16_matmul_inputs: true,
        kv_format: KvFormat::Bf16,
        kv_k: RowCodec::new(ElemCodec::Bf16, false),
        kv_v: RowCodec::new(ElemCodec::Bf16, false),
    };

    #[test]
    fn emulated_default_route_rounds_queries_where_cuda_attention_v2_does() {
        let q = vec![1.0f32 + 1.0 / 1024.0, 0.3, -7.77];
        assert_ne!(round_bf16(&q), q, "the test values must not be bf16 already");
        assert_eq!(&*EMULATED.attention_query(&q), &round_bf16(&q)[..]);
        let f32_kv = CpuBackend { bf16_matmul_inputs: true, ..CpuBackend::with_kv(KvFormat::F32) };
        let fp32_route = CpuBackend::with_kv(KvFormat::Bf16);
        for b in [CpuBackend::default(), f32_kv, fp32_route] {
            assert_eq!(&*b.attention_query(&q), &q[..], "{b:?} runs kernel v1 on CUDA: q stays f32");
        }
        // A rotated K (every quantized format's but fp8's, and any under --kv-rotation on):
        // v2 rounds Hq, not q, so q stays f32; an unrotated K (fp8, --kv-rotation off): v2 rounds q.
        for f in KvFormat::ALL.into_iter().filter(|f| f.is_quantized()) {
            assert_eq!(f.k().rotate, f != KvFormat::Fp8, "{f}: the table's rotation");
            for r in [crate::kv::KvRotation::On, crate::kv::KvRotation::Off] {
                let b = CpuBackend { bf16_matmul_inputs: true, kv_k: f.k_with(r), kv_v: f.v_with(r), ..CpuBackend::with_kv(f) };
                let want = if b.kv_k.rotate { q.clone() } else { round_bf16(&q) };
                assert_eq!(&*b.attention_query(&q), &want[..], "{f} {r}");
            }
        }
    }

    #[test]
    fn emulation_rounds_both_matmul_inputs_and_nothing_else() {
        let (m, n, k) = (5, 70, 96);
        let x = t(m, k, &ragged(m * k, 1));
        let w = CpuMatrix { name: "w".into(), n_out: n, n_in: k, data: ragged(n * k, 2) };
        let reference = CpuBackend::default();
        let rounded_x = t(m, k, &round_bf16(&x.data));
        let rounded_w = CpuMatrix { data: round_bf16(&w.data), ..w.clone() };
        assert!(rounded_x.data.iter().zip(&x.data).all(|(a, b)| a != b), "the inputs must not be bf16 values already");
        // Emulated product == reference product of rounded inputs, bit for bit.
        let emulated = EMULATED.matmul(&x, &w).unwrap();
        assert_eq!(emulated, reference.matmul(&rounded_x, &rounded_w).unwrap());
        // Rounding only one side gives something else, and so does no rounding.
        assert_ne!(emulated, reference.matmul(&rounded_x, &w).unwrap());
        assert_ne!(emulated, reference.matmul(&x, &w).unwrap());
        // The LM head likewise: scores of the rounded rows against the rounded head.
        let req = HeadRequest { targets: &[3, 0, 69, 12, 5], top_k: 4, ..Default::default() };
        let got = EMULATED.score_rows(&x, &[0, 1, 2, 3, 4], &w, &req).unwrap();
        assert_eq!(got, reference.score_rows(&rounded_x, &[0, 1, 2, 3, 4], &rounded_w, &req).unwrap());
        assert_ne!(got, reference.score_rows(&x, &[0, 1, 2, 3, 4], &w, &req).unwrap());
        // Elementwise ops do not round.
        let y = EMULATED.rms_norm(&x, &vec![1.0; k], 1e-6).unwrap();
        assert_eq!(y, reference.rms_norm(&x, &vec![1.0; k], 1e-6).unwrap());
    }

    #[test]
    fn bf16_kv_rounds_what_the_cache_stores() {
        let (n, d) = (6, 8);
        let p = AttnParams { n_heads: 2, n_kv_heads: 1, d_head: d, d_head_v: d, scale: 0.3, window: None, softcap: None };
        let g = KvGeometry { n_layers: 1, n_kv_heads: 1, d_head: d, d_head_v: d, max_pos: n, n_seqs: 1 };
        let (q, k, v) = (t(n, 2 * d, &ragged(n * 2 * d, 3)), t(n, d, &ragged(n * d, 4)), t(n, d, &ragged(n * d, 5)));
        let bf16_kv = CpuBackend::with_kv(KvFormat::Bf16);
        let mut cache = bf16_kv.new_kv_cache(g).unwrap();
        let got = bf16_kv.attention(&mut cache, 0, &q, &k, &v, PassRows::single(n, 0), &p).unwrap();
        assert_eq!(cache.k[0], round_bf16(&k.data));
        assert_eq!(cache.v[0], round_bf16(&v.data));
        // The same as the reference attending over pre-rounded K and V (q is not rounded).
        let reference = CpuBackend::default();
        let mut ref_cache = reference.new_kv_cache(g).unwrap();
        let (kr, vr) = (t(n, d, &round_bf16(&k.data)), t(n, d, &round_bf16(&v.data)));
        assert_eq!(got, reference.attention(&mut ref_cache, 0, &q, &kr, &vr, PassRows::single(n, 0), &p).unwrap());
        let mut f32_cache = reference.new_kv_cache(g).unwrap();
        assert_ne!(got, reference.attention(&mut f32_cache, 0, &q, &k, &v, PassRows::single(n, 0), &p).unwrap());
    }

    #[test]
    fn quantized_kv_stores_each_row_through_its_codec_and_counts_non_finite() {
        let (n, d) = (5, 32);
        let p = AttnParams { n_heads: 2, n_kv_heads: 2, d_head: d, d_head_v: d, scale: 0.2, window: None, softcap: None };
        let g = KvGeometry { n_layers: 1, n_kv_heads: 2, d_head: d, d_head_v: d, max_pos: n, n_seqs: 1 };
        let (q, k, mut v) = (t(n, 2 * d, &ragged(n * 2 * d, 6)), t(n, 2 * d, &ragged(n * 2 * d, 7)), t(n, 2 * d, &ragged(n * 2 * d, 8)));
        for f in [KvFormat::Fp8, KvFormat::K4v2, KvFormat::Vq2] {
            let b = CpuBackend::with_kv(f);
            let mut cache = b.new_kv_cache(g).unwrap();
            b.attention(&mut cache, 0, &q, &k, &v, PassRows::single(n, 0), &p).unwrap();
            // Row r (position r / 2, KV head r % 2) is decode(encode(row)).
            for (r, (stored, x)) in cache.k[0].chunks(d).zip(k.data.chunks(d)).enumerate() {
                let mut bytes = vec![0u8; f.k().row_bytes(d)];
                f.k().encode_row(x, &mut bytes).unwrap();
                let mut want = vec![0f32; d];
                f.k().decode_row(&bytes, &mut want).unwrap();
                assert_eq!(stored, &want[..], "{f}: K row {r}");
                assert_ne!(stored, x, "{f}: K row {r} must be quantized");
            }
            assert_eq!(cache.n_nonfinite(), 0);
        }
        // One NaN in V: its row (position 1, head 1) decodes to NaN and is counted.
        v.data[3 * d + 3] = f32::NAN;
        let b = CpuBackend::with_kv(KvFormat::Int8);
        let mut cache = b.new_kv_cache(g).unwrap();
        b.attention(&mut cache, 0, &q, &k, &v, PassRows::single(n, 0), &p).unwrap();
        assert_eq!(cache.n_nonfinite(), 1);
        let row = &cache.v[0][3 * d..4 * d];
        assert!(row.iter().all(|x| x.is_nan()));
        assert!(cache.v[0][..3 * d].iter().chain(&cache.v[0][4 * d..]).all(|x| x.is_finite()));
        // A head the codec cannot code is refused when the cache is made.
        let g40 = KvGeometry { d_head: 40, d_head_v: 40, ..g };
        assert!(b.new_kv_cache(g40).unwrap_err().to_string().contains("K rows"));
    }

    #[test]
    fn execution_names_the_emulation() {
        let r = CpuBackend::default().execution();
        assert_eq!((r.route.as_str(), r.kv_dtype.as_str()), ("fp32", "f32"));
        let e = EMULATED.execution();
        assert_eq!((e.route.as_str(), e.kv_dtype.as_str()), ("bf16-tc-emulated", "bf16"));
        assert!(e.details["matmul"].as_str().unwrap().contains("bf16"));
    }

    #[test]
    fn embed_scales_rows_and_checks_ids() {
        let table = CpuMatrix { name: "e".into(), n_out: 2, n_in: 2, data: vec![1.0, 2.0, 3.0, 4.0] };
        let x = CpuBackend::default().embed(&table, &[1, 0, 1], 2.0).unwrap();
        assert_eq!(x.data, vec![6.0, 8.0, 2.0, 4.0, 6.0, 8.0]);
        assert!(CpuBackend::default().embed(&table, &[2], 1.0).is_err());
    }
}
