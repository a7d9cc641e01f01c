//! The routed mixture-of-experts FFN on CUDA ([`Backend::moe_ffn`] of
//! [`CudaBackend`]) and the typed launchers of `kernels/moe.cu`.
//!
//! Routing is the CPU oracle's, not a second copy of it: the `(n_rows,
//! n_experts)` router logits (the model's router matmul, on the device) are
//! copied to the host and routed by [`cpu::moe::route`] (f64 softmax, top-k,
//! lower index on ties, `norm_topk_prob`), so both backends pick the same
//! experts with the same weights from the same logits. That copy is one small
//! synchronizing download per MoE layer and pass. The host then lays the
//! (row, expert) pairs out as slots, expert-major and rows ascending inside an
//! expert ([`MoePlan`]), and the device computes, on the default route, one
//! grouped launch for the gate and up products with the activation
//! (`moe_gemm_gated_<act>_<fmt>`), one for the down products (`moe_gemm_<fmt>`),
//! both covering every expert through a tile table and a table of expert base
//! pointers, and the weighted sum in ascending expert order in f64
//! (`moe_combine`), which makes the result independent of scheduling. On the FP32
//! route (`--lossless`) each expert's rows are gathered and run through the
//! route's f32 matmuls and gated kernel (one product per expert for all its
//! rows), then the same `moe_combine`.
//!
//! It does not load the expert banks (`crate::model::moe`) and does not own the
//! routing rule (`backend::cpu::moe`).
//!
//! [`Backend::moe_ffn`]: crate::backend::Backend::moe_ffn
//! [`cpu::moe::route`]: crate::backend::cpu::moe::route

use anyhow::{ensure, Context, Result};
use cudarc::driver::PushKernelArg;
use half::bf16;
use rayon::prelude::*;

use super::backend::{CudaAct, CudaBackend, CudaMatrix, Route};
use super::buffer::{DevView, DevViewMut, DeviceBuffer, QuantMatrix};
use super::device::CudaDevice;
use super::ops::{self, cfg, func, grid_1d, i32_of, launch_err, Activation, Rows};
use crate::backend::cpu::moe::route;
use crate::backend::{Expert, MoeRouting};

/// Slots per tile of the grouped GEMMs (`MOE_BM` of kernels/moe.cu).
pub const MOE_TILE_SLOTS: usize = 64;
/// Output columns per block of the grouped GEMMs (`MOE_BN`).
const MOE_TILE_COLS: usize = 64;

/// `MoeGemmArgs` of kernels/common.cuh (moe_gemm_*'s one parameter).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MoeGemmArgs {
    /// (n_x_rows, k) bf16.
    x: u64,
    /// (n_slots) i32 row of x per slot, or 0: slot s reads row s.
    x_rows: u64,
    /// (n_experts) u64: base of expert e's (n, k) rows (the gate weights of the gated kernels).
    w: u64,
    /// (n_experts) u64: the up weights (gated kernels), or 0.
    w_up: u64,
    /// (n_tiles, 3) i32: expert, first slot, end slot.
    tiles: u64,
    /// (n_slots, ldy): f32 (plain) or bf16 (gated).
    y: u64,
    row_bytes: i64,
    ldy: i64,
    n: i32,
    k: i32,
}
const _: () = assert!(size_of::<MoeGemmArgs>() == 72);
// SAFETY: plain data with the layout of the CUDA struct (size asserted on both sides); passed by value.
unsafe impl cudarc::driver::DeviceRepr for MoeGemmArgs {}

/// `MoeCombineArgs` of kernels/common.cuh (moe_combine's one parameter).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MoeCombineArgs {
    /// (n_slots, d) f32.
    y: u64,
    /// (n_rows, top_k) i32.
    slot: u64,
    /// (n_rows, top_k) f64.
    weight: u64,
    /// (n_rows, d) f32.
    out: u64,
    n_rows: i32,
    d: i32,
    top_k: i32,
    pad_: i32,
}
const _: () = assert!(size_of::<MoeCombineArgs>() == 48);
// SAFETY: plain data with the layout of the CUDA struct (size asserted on both sides); passed by value.
unsafe impl cudarc::driver::DeviceRepr for MoeCombineArgs {}

/// One layer's routing laid out for the device: slots expert-major, rows
/// ascending inside an expert. Pure host data (unit-tested without a GPU).
#[derive(Debug, Clone, PartialEq)]
pub struct MoePlan {
    /// (n_experts + 1): expert e owns slots `seg[e]..seg[e + 1]`.
    pub seg: Vec<usize>,
    /// (n_slots): the row each slot reads.
    pub slot_rows: Vec<i32>,
    /// (n_tiles, 3): expert, first slot, end slot; at most [`MOE_TILE_SLOTS`] slots each.
    pub tiles: Vec<i32>,
    /// (n_rows, top_k): per row its experts' slots, in ascending expert index.
    pub combine_slots: Vec<i32>,
    /// (n_rows, top_k): the matching routing weights.
    pub combine_weights: Vec<f64>,
}

impl MoePlan {
    /// Routes every row of `logits` `(n_rows, n_experts)` with the CPU oracle's [`route`].
    pub fn new(logits: &[f32], p: &MoeRouting) -> Result<Self> {
        let n_e = p.n_experts;
        ensure!(n_e > 0 && logits.len() % n_e == 0, "moe_ffn: {} router logits for {n_e} experts", logits.len());
        // Rows are routed independently (in parallel; each by the same function,
        // so the plan does not depend on the thread count).
        let routes: Vec<Vec<(usize, f64)>> = logits.par_chunks_exact(n_e).map(|l| route(l, p.top_k, p.norm_topk_prob)).collect();
        let mut per_expert = vec![0usize; n_e];
        for picked in &routes {
            ensure!(picked.len() == p.top_k, "moe_ffn: a row routed to {} experts, top_k is {}", picked.len(), p.top_k);
            for &(e, _) in picked {
                per_expert[e] += 1;
            }
        }
        let mut seg = vec![0usize; n_e + 1];
        for e in 0..n_e {
            seg[e + 1] = seg[e] + per_expert[e];
        }
        let n_slots = seg[n_e];
        let mut slot_rows = vec![0i32; n_slots];
        let mut cursor = seg[..n_e].to_vec();
        let mut combine_slots = Vec::with_capacity(n_slots);
        let mut combine_weights = Vec::with_capacity(n_slots);
        for (r, picked) in routes.iter().enumerate() {
            for &(e, w) in picked {
                let s = cursor[e];
                cursor[e] += 1;
                slot_rows[s] = i32_of(r, "moe_ffn: row")?;
                combine_slots.push(i32_of(s, "moe_ffn: slot")?);
                combine_weights.push(w);
            }
        }
        let mut tiles = Vec::new();
        for e in 0..n_e {
            for s0 in (seg[e]..seg[e + 1]).step_by(MOE_TILE_SLOTS) {
                let s1 = (s0 + MOE_TILE_SLOTS).min(seg[e + 1]);
                tiles.extend([i32_of(e, "expert")?, i32_of(s0, "slot")?, i32_of(s1, "slot")?]);
            }
        }
        Ok(Self { seg, slot_rows, tiles, combine_slots, combine_weights })
    }

    pub fn n_slots(&self) -> usize {
        self.slot_rows.len()
    }

    /// Rows routed to expert `e`.
    pub fn rows_of(&self, e: usize) -> usize {
        self.seg[e + 1] - self.seg[e]
    }
}

/// The name of the grouped GEMM for a weight format: the plain product, or
/// the gated one with `act`.
pub fn moe_gemm_kernel(w: &QuantMatrix, act: Option<Activation>) -> String {
    let sfx = w.kernel_suffix();
    match act {
        None => format!("moe_gemm_{sfx}"),
        Some(Activation::Silu) => format!("moe_gemm_gated_silu_{sfx}"),
        Some(Activation::GeluTanh) => format!("moe_gemm_gated_gelu_{sfx}"),
    }
}

/// Every expert's matrix `pick(e)` has `(n, k)` in one format: the grouped
/// kernels read them all with one row length.
fn same_bank<'a>(experts: &'a [Expert<CudaMatrix>], what: &str, pick: impl Fn(&'a Expert<CudaMatrix>) -> &'a CudaMatrix) -> Result<&'a QuantMatrix> {
    let first = &pick(experts.first().context("moe_ffn: no experts")?).q;
    for m in experts.iter().map(&pick) {
        ensure!(
            m.q.format == first.format && m.q.n_rows == first.n_rows && m.q.n_cols == first.n_cols,
            "moe_ffn: expert {what} matrix {} is {} ({} x {}), the first is {} ({} x {})",
            m.name,
            m.q.format,
            m.q.n_rows,
            m.q.n_cols,
            first.format,
            first.n_rows,
            first.n_cols
        );
    }
    Ok(first)
}

/// Device base pointers of every expert's `pick(e)` matrix: (n_experts) u64.
fn pointer_table<'a>(dev: &CudaDevice, experts: &'a [Expert<CudaMatrix>], pick: impl Fn(&'a Expert<CudaMatrix>) -> &'a CudaMatrix) -> Result<DeviceBuffer<u64>> {
    let ptrs: Vec<u64> = experts.iter().map(|e| pick(e).q.data.view().ptr()).collect();
    dev.upload(&ptrs)
}

/// The grouped GEMM over every tile of `tiles` `(n_tiles, 3)`: `y[s] = x[row(s)] ·
/// W[e]ᵀ` (f32, `gate_act` None) or `y[s] = bf16(act(x[row(s)] · Wg[e]ᵀ) *
/// (x[row(s)] · Wu[e]ᵀ))`. `x` `(n_x_rows, k)` bf16; `x_rows` the row of each
/// slot (None: slot s reads row s, then `n_x_rows` >= n_slots); `w`, `w_up`:
/// per-expert base pointers of `(n, k)` matrices laid out like `like`.
#[allow(clippy::too_many_arguments)]
pub fn moe_gemm<Y: ops::OutElem>(
    dev: &CudaDevice,
    gate_act: Option<Activation>,
    x: DevView<bf16>,
    x_rows: Option<DevView<i32>>,
    like: &QuantMatrix,
    w: DevView<u64>,
    w_up: Option<DevView<u64>>,
    tiles: DevView<i32>,
    n_slots: usize,
    y: DevViewMut<Y>,
) -> Result<()> {
    let (n, k) = (like.n_rows, like.n_cols);
    let name = moe_gemm_kernel(like, gate_act);
    ensure!(k % 32 == 0 && x.len() % k.max(1) == 0 && x.ptr() % 16 == 0, "{name}: x of {} elements for K = {k}, or unaligned", x.len());
    ensure!(gate_act.is_some() == w_up.is_some(), "{name}: the up weights go with the gated kernel only");
    ensure!(
        (Y::NAME == "bf16") == gate_act.is_some(),
        "{name}: the gated kernel writes bf16, the plain one f32 (asked for {})",
        Y::NAME
    );
    ensure!(y.len() == n_slots * n, "{name}: y has {} elements for {n_slots} slots x {n}", y.len());
    ensure!(tiles.len() % 3 == 0, "{name}: a tile table of {} entries", tiles.len());
    match x_rows {
        Some(r) => ensure!(r.len() == n_slots, "{name}: {} row ids for {n_slots} slots", r.len()),
        None => ensure!(x.len() / k.max(1) >= n_slots, "{name}: {} rows of x for {n_slots} slots", x.len() / k.max(1)),
    }
    let n_tiles = tiles.len() / 3;
    if n_tiles == 0 || n == 0 {
        return Ok(());
    }
    let f = func(dev, &name)?;
    let args = MoeGemmArgs {
        x: x.ptr(),
        x_rows: x_rows.map_or(0, |r| r.ptr()),
        w: w.ptr(),
        w_up: w_up.map_or(0, |u| u.ptr()),
        tiles: tiles.ptr(),
        y: y.ptr(),
        row_bytes: like.row_bytes as i64,
        ldy: n as i64,
        n: i32_of(n, "N")?,
        k: i32_of(k, "K")?,
    };
    let gy = u32::try_from(n_tiles).context("moe_gemm: tiles")?;
    ensure!(gy <= 65535, "{name}: {n_tiles} slot tiles exceed the grid's y limit 65535");
    let mut b = dev.stream().launch_builder(f);
    b.arg(&args);
    // SAFETY: `args` mirrors MoeGemmArgs of kernels/common.cuh (size asserted); x holds rows of K
    // bf16 for every row id (the caller's ids are rows of x), every tile's slots lie in
    // 0..n_slots (MoePlan), the pointer tables hold one (n, k) matrix of `like`'s layout per
    // expert (same_bank), y holds (n_slots, n) of the kernel's output type (checked).
    unsafe { b.launch(cfg((grid_1d(n, MOE_TILE_COLS as u32)?, gy, 1), 128, 0)) }.map_err(|e| launch_err(&name, e))?;
    Ok(())
}

/// `out[r] = Σ_k weight[r, k] * y[slot[r, k]]` in f64, in the table's order
/// (ascending expert), rounded to f32 once. `y` `(n_slots, d)`, `slot` and
/// `weight` `(n_rows, top_k)`, `out` `(n_rows, d)`.
pub fn moe_combine(
    dev: &CudaDevice,
    y: DevView<f32>,
    d: usize,
    slot: DevView<i32>,
    weight: DevView<f64>,
    top_k: usize,
    out: DevViewMut<f32>,
) -> Result<()> {
    ensure!(top_k > 0 && slot.len() == weight.len() && slot.len() % top_k == 0, "moe_combine: {} slots, {} weights, top {top_k}", slot.len(), weight.len());
    let n_rows = slot.len() / top_k;
    ensure!(out.len() == n_rows * d, "moe_combine: out has {} elements for {n_rows} rows x {d}", out.len());
    ensure!(y.len() == slot.len() * d, "moe_combine: y has {} elements for {} slots x {d}", y.len(), slot.len());
    if out.is_empty() {
        return Ok(());
    }
    let f = func(dev, "moe_combine")?;
    let args = MoeCombineArgs {
        y: y.ptr(),
        slot: slot.ptr(),
        weight: weight.ptr(),
        out: out.ptr(),
        n_rows: i32_of(n_rows, "rows")?,
        d: i32_of(d, "d")?,
        top_k: i32_of(top_k, "top_k")?,
        pad_: 0,
    };
    let mut b = dev.stream().launch_builder(f);
    b.arg(&args);
    // SAFETY: `args` mirrors MoeCombineArgs of kernels/common.cuh (size asserted); every slot id
    // is below n_slots = y.len() / d (MoePlan), the lengths are checked above.
    unsafe { b.launch(cfg((grid_1d(out.len(), 256)?, 1, 1), 256, 0)) }.map_err(|e| launch_err("moe_combine", e))?;
    Ok(())
}

fn ops_activation(act: crate::artifact::meta::Activation) -> Activation {
    match act {
        crate::artifact::meta::Activation::Silu => Activation::Silu,
        crate::artifact::meta::Activation::GeluTanh => Activation::GeluTanh,
    }
}

impl CudaBackend {
    /// See [`Backend::moe_ffn`](crate::backend::Backend::moe_ffn); the module
    /// documentation says how.
    pub(super) fn moe_ffn_cuda(
        &self,
        x: &CudaAct,
        router_logits: &CudaAct,
        experts: &[Expert<CudaMatrix>],
        p: &MoeRouting,
        counts: &mut [u64],
    ) -> Result<CudaAct> {
        let dev = self.device();
        let (n, d) = (x.n_rows, x.n_cols);
        p.check_inputs(n, router_logits.n_rows, router_logits.n_cols, experts.len(), counts.len())?;
        let gate = same_bank(experts, "gate", |e| &e.gate)?;
        let up = same_bank(experts, "up", |e| &e.up)?;
        let down = same_bank(experts, "down", |e| &e.down)?;
        let f = gate.n_rows;
        ensure!(
            gate.n_cols == d && up.n_rows == f && up.n_cols == d && up.format == gate.format && down.n_rows == d && down.n_cols == f,
            "moe_ffn: x has {d} columns; experts' gate is {} x {}, up {} x {} ({} and {}), down {} x {}",
            gate.n_rows,
            gate.n_cols,
            up.n_rows,
            up.n_cols,
            gate.format,
            up.format,
            down.n_rows,
            down.n_cols
        );
        let mut out = self.new_act(n, d)?;
        if n == 0 {
            return Ok(out);
        }
        // The routing: the logits to the host, the CPU oracle's rule.
        let logits = dev.download(router_logits.f32("moe_ffn")?).context("moe_ffn: router logits to the host")?;
        let plan = MoePlan::new(&logits, p)?;
        for (e, c) in counts.iter_mut().enumerate() {
            *c += plan.rows_of(e) as u64;
        }
        let n_slots = plan.n_slots();
        let act = ops_activation(p.activation);
        // (n_slots, d): each slot's expert output.
        let mut y = dev.alloc_uninit::<f32>(n_slots * d)?;
        match self.route() {
            Route::Bf16TensorCore => {
                let mut tmp = None;
                let xb = self.bf16_input(x, &mut tmp)?;
                let rows = dev.upload(&plan.slot_rows)?;
                let tiles = dev.upload(&plan.tiles)?;
                let (wg, wu, wd) = (
                    pointer_table(dev, experts, |e| &e.gate)?,
                    pointer_table(dev, experts, |e| &e.up)?,
                    pointer_table(dev, experts, |e| &e.down)?,
                );
                // (n_slots, f) bf16: act(gate) * up of each slot's expert.
                let mut h = dev.alloc_uninit::<bf16>(n_slots * f)?;
                moe_gemm(dev, Some(act), xb, Some(rows.view()), gate, wg.view(), Some(wu.view()), tiles.view(), n_slots, h.view_mut())
                    .context("moe_ffn: gate and up")?;
                moe_gemm::<f32>(dev, None, h.view(), None, down, wd.view(), None, tiles.view(), n_slots, y.view_mut())
                    .context("moe_ffn: down")?;
                // The uploads and h are freed in stream order after the launches.
            }
            Route::Fp32 => {
                let xf = x.f32("moe_ffn")?;
                for (e, ex) in experts.iter().enumerate() {
                    let (s0, s1) = (plan.seg[e], plan.seg[e + 1]);
                    if s0 == s1 {
                        continue;
                    }
                    let m = s1 - s0;
                    let ids = dev.upload(&plan.slot_rows[s0..s1])?;
                    let mut xe = dev.alloc_uninit::<f32>(m * d)?;
                    ops::gather_rows(dev, xf.view(), d, ids.view(), xe.view_mut())?;
                    let (mut g, mut u, mut h) = (dev.alloc_uninit::<f32>(m * f)?, dev.alloc_uninit::<f32>(m * f)?, dev.alloc_uninit::<f32>(m * f)?);
                    ops::matmul::<f32>(dev, xe.view(), m, &ex.gate.q, g.view_mut(), f).with_context(|| format!("moe_ffn: {}", ex.gate.name))?;
                    ops::matmul::<f32>(dev, xe.view(), m, &ex.up.q, u.view_mut(), f).with_context(|| format!("moe_ffn: {}", ex.up.name))?;
                    ops::gated::<f32>(dev, act, g.view(), Rows::contiguous(m, f), u.view(), f, h.view_mut(), f)?;
                    ops::matmul::<f32>(dev, h.view(), m, &ex.down.q, y.slice_mut(s0 * d..s1 * d)?, d)
                        .with_context(|| format!("moe_ffn: {}", ex.down.name))?;
                }
            }
        }
        let slots = dev.upload(&plan.combine_slots)?;
        let weights = dev.upload(&plan.combine_weights)?;
        moe_combine(dev, y.view(), d, slots.view(), weights.view(), p.top_k, out.f32_mut("moe_ffn")?.view_mut())?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::meta::Activation as Act;

    #[test]
    fn plan_groups_slots_by_expert_and_keeps_the_oracle_order() {
        // 3 rows, 4 experts, top 2. Row 0: experts 1, 3; row 1: 1, 2 (tie 2/3 -> 2); row 2: 0, 1.
        let logits = [0.0f32, 2.0, -1.0, 1.0, -5.0, 3.0, 1.0, 1.0, 4.0, 3.0, 0.0, -2.0];
        let p = MoeRouting { n_experts: 4, top_k: 2, norm_topk_prob: true, activation: Act::Silu };
        let plan = MoePlan::new(&logits, &p).unwrap();
        assert_eq!(plan.seg, vec![0, 1, 4, 5, 6]);
        assert_eq!(plan.slot_rows, vec![2, 0, 1, 2, 1, 0]);
        assert_eq!(plan.tiles, vec![0, 0, 1, 1, 1, 4, 2, 4, 5, 3, 5, 6]);
        // Per row, ascending expert: row 0 -> slots of (1, row 0) = 1 and (3, row 0) = 5.
        assert_eq!(plan.combine_slots, vec![1, 5, 2, 4, 0, 3]);
        for (r, l) in logits.chunks(4).enumerate() {
            let want: Vec<f64> = route(l, 2, true).iter().map(|x| x.1).collect();
            assert_eq!(&plan.combine_weights[2 * r..2 * r + 2], &want[..], "row {r}");
        }
        // An expert with more rows than one tile is cut into tiles of 64.
        let many: Vec<f32> = (0..150).flat_map(|_| [1.0f32, 0.0]).collect();
        let p1 = MoeRouting { n_experts: 2, top_k: 1, ..p };
        let plan = MoePlan::new(&many, &p1).unwrap();
        assert_eq!(plan.tiles, vec![0, 0, 64, 0, 64, 128, 0, 128, 150]);
        assert_eq!(plan.rows_of(1), 0);
        assert!(MoePlan::new(&logits[..7], &p).is_err());
    }
}
