//! The routed mixture-of-experts FFN of `qwen3moe` on the model side:
//! loading an expert bank (`(n_experts, n_out, n_in)`, expert-major) as one
//! matrix per expert, each from its own contiguous byte range of the bank
//! (no copy, no conversion: the bank's block format is the experts'), and
//! the per-layer expert-usage counts the report carries.
//!
//! The routing and the weighted sum are the backend's
//! ([`Backend::moe_ffn`](crate::backend::Backend::moe_ffn); the CPU
//! definition is `backend::cpu::moe`).

use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};

use crate::artifact::meta::{HParams, MoeParams, TensorEntry};
use crate::artifact::names::blk;
use crate::artifact::TensorView;
use crate::backend::{Backend, Expert};

/// The experts of layer `l`: banks `blk.{l}.ffn_{gate,up,down}_exps.weight`
/// split into `n_experts` matrices.
pub fn load_experts<'a, B: Backend>(
    backend: &B,
    tensor: &dyn Fn(&str) -> Result<TensorView<'a>>,
    l: usize,
    hp: &HParams,
    moe: &MoeParams,
) -> Result<Vec<Expert<B::Matrix>>> {
    let (d, f, n_e) = (hp.d_model, moe.d_ffn_expert, moe.n_experts);
    let gate = tensor(&blk(l, "ffn_gate_exps.weight"))?;
    let up = tensor(&blk(l, "ffn_up_exps.weight"))?;
    let down = tensor(&blk(l, "ffn_down_exps.weight"))?;
    let mut experts = Vec::with_capacity(n_e);
    for e in 0..n_e {
        experts.push(Expert {
            gate: load_expert(backend, &gate, e, n_e, f, d)?,
            up: load_expert(backend, &up, e, n_e, f, d)?,
            down: load_expert(backend, &down, e, n_e, d, f)?,
        });
    }
    Ok(experts)
}

/// Expert `e` of `bank` `(n_experts, n_out, n_in)`: bytes `e * size ..
/// (e + 1) * size`, loaded as an `(n_out, n_in)` matrix named `bank[e]`.
fn load_expert<B: Backend>(backend: &B, bank: &TensorView, e: usize, n_e: usize, n_out: usize, n_in: usize) -> Result<B::Matrix> {
    let name = &bank.entry.name;
    ensure!(
        bank.entry.shape == [n_e as u64, n_out as u64, n_in as u64],
        "tensor {name}: shape {:?}, expected [{n_e}, {n_out}, {n_in}] (experts, rows, columns)",
        bank.entry.shape
    );
    let size = bank.entry.format.bytes_for((n_out * n_in) as u64).with_context(|| format!("tensor {name}"))? as usize;
    ensure!(bank.bytes.len() == n_e * size, "tensor {name}: {} bytes for {n_e} experts of {size}", bank.bytes.len());
    let entry = TensorEntry {
        name: format!("{name}[{e}]"),
        shape: vec![n_out as u64, n_in as u64],
        n_bytes: size as u64,
        ..bank.entry.clone()
    };
    let view = TensorView { entry: &entry, bytes: &bank.bytes[e * size..(e + 1) * size] };
    backend.load_matrix(&view)
}

/// How often each expert was routed, per MoE layer, over every row the
/// forward pass ran (each window's context rows included: a token in two
/// overlapping windows is routed, and counted, twice). Each row counts once
/// for each of its `top_k` experts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertUsage {
    pub n_experts: usize,
    pub top_k: usize,
    /// Rows routed per layer (every layer routes every row).
    pub rows: u64,
    pub layers: Vec<LayerExpertUsage>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerExpertUsage {
    pub layer: usize,
    /// Per expert, the rows routed to it (sums to `rows * top_k`).
    pub routed: Vec<u64>,
    /// Experts no row was routed to.
    pub never_routed: usize,
}

impl ExpertUsage {
    /// From per-layer counters (`counts[l][e]`).
    pub fn from_counts(moe: &MoeParams, counts: &[Vec<u64>]) -> Self {
        let rows = counts.first().map_or(0, |c| c.iter().sum::<u64>() / moe.n_experts_used as u64);
        Self {
            n_experts: moe.n_experts,
            top_k: moe.n_experts_used,
            rows,
            layers: counts
                .iter()
                .enumerate()
                .map(|(layer, c)| LayerExpertUsage { layer, routed: c.clone(), never_routed: c.iter().filter(|&&n| n == 0).count() })
                .collect(),
        }
    }

    /// Adds the counts of rows routed elsewhere (another `--devices` worker
    /// or `--shard`): counts are additive over windows, so the sum equals
    /// one process's counts over the union of their windows.
    pub fn add(&mut self, other: &ExpertUsage) -> Result<()> {
        ensure!(
            self.n_experts == other.n_experts && self.top_k == other.top_k && self.layers.len() == other.layers.len(),
            "expert usage of another model ({} experts, top-{}, {} layers vs {}, top-{}, {})",
            other.n_experts,
            other.top_k,
            other.layers.len(),
            self.n_experts,
            self.top_k,
            self.layers.len()
        );
        self.rows += other.rows;
        for (a, b) in self.layers.iter_mut().zip(&other.layers) {
            ensure!(a.layer == b.layer && a.routed.len() == b.routed.len(), "expert usage: layer {} differs in shape", a.layer);
            for (x, y) in a.routed.iter_mut().zip(&b.routed) {
                *x += y;
            }
            a.never_routed = a.routed.iter().filter(|&&n| n == 0).count();
        }
        Ok(())
    }

    /// The counts added since `earlier` (an earlier reading of the same
    /// counters): the rows of the passes run in between.
    pub fn since(&self, earlier: &ExpertUsage) -> Result<ExpertUsage> {
        ensure!(
            self.n_experts == earlier.n_experts && self.top_k == earlier.top_k && self.layers.len() == earlier.layers.len() && self.rows >= earlier.rows,
            "expert usage: the earlier reading is not of these counters"
        );
        let mut out = self.clone();
        out.rows -= earlier.rows;
        for (a, b) in out.layers.iter_mut().zip(&earlier.layers) {
            ensure!(a.layer == b.layer && a.routed.len() == b.routed.len(), "expert usage: layer {} differs in shape", a.layer);
            for (x, y) in a.routed.iter_mut().zip(&b.routed) {
                *x = x.checked_sub(*y).with_context(|| format!("expert usage: layer {}'s counts went down", a.layer))?;
            }
            a.never_routed = a.routed.iter().filter(|&&n| n == 0).count();
        }
        Ok(out)
    }

    /// The sum of several parts' counts (`None` for dense models).
    pub fn sum<'a>(parts: impl IntoIterator<Item = Option<&'a ExpertUsage>>) -> Result<Option<ExpertUsage>> {
        let mut total: Option<ExpertUsage> = None;
        for part in parts.into_iter().flatten() {
            match &mut total {
                None => total = Some(part.clone()),
                Some(t) => t.add(part)?,
            }
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_sums_over_parts() {
        let moe = MoeParams { n_experts: 3, n_experts_used: 1, d_ffn_expert: 8, norm_topk_prob: true };
        let a = ExpertUsage::from_counts(&moe, &[vec![2, 0, 0]]);
        let b = ExpertUsage::from_counts(&moe, &[vec![0, 1, 0]]);
        let s = ExpertUsage::sum([Some(&a), None, Some(&b)]).unwrap().unwrap();
        assert_eq!(s, ExpertUsage::from_counts(&moe, &[vec![2, 1, 0]]));
        assert_eq!(s.layers[0].never_routed, 1);
        let other = ExpertUsage::from_counts(&MoeParams { n_experts: 4, ..moe }, &[vec![0, 0, 0, 1]]);
        assert!(ExpertUsage::sum([Some(&a), Some(&other)]).is_err());
        // Readings of the same counters: the later minus the earlier is what was added between.
        assert_eq!(s.since(&a).unwrap(), b);
        assert!(a.since(&s).is_err(), "counts cannot go down");
        assert!(s.since(&other).is_err());
    }

    #[test]
    fn usage_counts_never_routed_experts() {
        let moe = MoeParams { n_experts: 4, n_experts_used: 2, d_ffn_expert: 8, norm_topk_prob: true };
        let u = ExpertUsage::from_counts(&moe, &[vec![3, 0, 2, 1], vec![0, 0, 6, 0]]);
        assert_eq!(u.rows, 3);
        assert_eq!(u.layers[0].never_routed, 1);
        assert_eq!(u.layers[1].never_routed, 3);
        assert_eq!(u.layers[1].routed, vec![0, 0, 6, 0]);
    }
}
