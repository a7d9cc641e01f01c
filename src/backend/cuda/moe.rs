//! The routed mixture-of-experts FFN on CUDA ([`Backend::moe_ffn`] of
//! [`CudaBackend`]) and the typed launchers of `kernels/moe.cu`.
//!
//! Routing is the CPU oracle's rule, bit for bit: on the device
//! ([`DevicePlan::route`]: `moe_route` per row, f64 softmax with
//! [`cpu::moe::exp_f64`], top-k under `total_cmp` with the lower index on ties,
//! `norm_topk_prob`; `moe_count`; `moe_plan_slots`), or with
//! `INFERNIX_MOE_ROUTING=host` on the host (the logits downloaded, routed by
//! [`cpu::moe::route`] itself, the plan uploaded); both lay the (row, expert)
//! pairs out as slots, expert-major and rows ascending inside an expert
//! ([`MoePlan`] is the host layout). From the per-expert counts `moe_plan_tiles`
//! makes the slot segments and the tile table on the device (sized for the
//! worst case, [`max_tiles`], the real count in a sentinel row where the kernels
//! stop), adds the counts to the layer's expert-usage counters, which stay on the
//! device ([`Backend::ExpertCounts`], read once by the model's `expert_usage`),
//! and clears the bank pointers of experts without rows: on the default route a
//! MoE layer enqueues without the host waiting for the device. On the default route the expert
//! products run on wgmma where the sm_90a module is loaded ([`MoeKernel::Wgmma`]:
//! the banks of the experts that took rows dequantized to bf16 scratches indexed by expert, the
//! rows gathered into slot order (with `INFERNIX_MOE_BANKS=resident` each layer's
//! banks are dequantized once, every expert, and kept: [`MoeBankSite`]), `moe_wgmma_gated_<act>` then
//! `moe_wgmma_plain`), else on mma.sync (`moe_gemm_gated_<act>_<fmt>`,
//! `moe_gemm_<fmt>`, weights dequantized in the loader), both covering every
//! expert through a tile table, then the weighted sum in ascending expert order
//! in f64 (`moe_combine`), which makes the result independent of scheduling. On
//! the FP32 route (`--lossless`; it downloads the segments, one wait a layer) each expert's rows are gathered and run through
//! the route's f32 matmuls and gated kernel (one product per expert for all its
//! rows), then the same `moe_combine`. With `INFERNIX_CUDA_PROFILE=1` the parts
//! are timed apart (`moe_route`, `moe_dequant_gather`, `moe_gate_up`,
//! `moe_down`, `moe_combine`; the router product is in `matmul`).
//!
//! It does not load the expert banks (`crate::model::moe`) and does not own the
//! routing rule (`backend::cpu::moe`).
//!
//! [`Backend::moe_ffn`]: crate::backend::Backend::moe_ffn
//! [`Backend::ExpertCounts`]: crate::backend::Backend::ExpertCounts
//! [`cpu::moe::route`]: crate::backend::cpu::moe::route
//! [`cpu::moe::exp_f64`]: crate::backend::cpu::moe::exp_f64

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

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

/// `MoeDequantArgs` of kernels/common.cuh (moe_dequant_bank_<fmt>'s one parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeDequantArgs {
    /// (n_experts) u64: base of each expert's (n_rows, K) weight.
    w: u64,
    /// (n_experts, n_rows, K) bf16.
    out: u64,
    row_bytes: i64,
    n_rows: i32,
    groups_per_row: i32,
}
const _: () = assert!(size_of::<MoeDequantArgs>() == 32);
// SAFETY: plain data with the layout of the CUDA struct (size asserted on both sides); passed by value.
unsafe impl cudarc::driver::DeviceRepr for MoeDequantArgs {}

/// `MoeGatherArgs` of kernels/common.cuh (moe_gather_bf16's one parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeGatherArgs {
    /// (n_x_rows, d) bf16.
    x: u64,
    /// (n_slots) i32.
    rows: u64,
    /// (n_slots, d) bf16.
    out: u64,
    n_slots: i32,
    groups_per_row: i32,
}
const _: () = assert!(size_of::<MoeGatherArgs>() == 32);
// SAFETY: plain data with the layout of the CUDA struct (size asserted on both sides); passed by value.
unsafe impl cudarc::driver::DeviceRepr for MoeGatherArgs {}

/// `MoeWgmmaParams` of kernels/common.cuh (moe_wgmma_*'s one `__grid_constant__` parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeWgmmaParams {
    /// The slot-ordered rows (n_slots, K) bf16, box (64, 128).
    a: cudarc::driver::sys::CUtensorMap,
    /// The bank (n_live * n, K) bf16, box (64, 256) plain, (64, 128) gated (the gate bank).
    b: cudarc::driver::sys::CUtensorMap,
    /// The up bank (gated), box (64, 128); a copy of `b` for the plain kernel (unused).
    b_up: cudarc::driver::sys::CUtensorMap,
    /// (n_tiles, 3) i32: live-expert index, first slot, end slot.
    tiles: u64,
    /// (n_slots, ldy) f32 (plain) or bf16 (gated).
    y: u64,
    ldy: i64,
    n: i32,
    k: i32,
    n_tiles: i32,
    pad_: i32,
}
const _: () = assert!(size_of::<MoeWgmmaParams>() == 512 && align_of::<MoeWgmmaParams>() == 128);
// SAFETY: plain data with the layout of the CUDA struct (asserted above); passed by value.
unsafe impl cudarc::driver::DeviceRepr for MoeWgmmaParams {}

/// Slots per tile of the wgmma kernels (kernels/moe_sm90a.cu: two consumer warpgroups of 64).
pub const MOE_WGMMA_TILE_SLOTS: usize = 128;
/// The kernel that `moe_wgmma_plain`'s presence stands for (kernels/moe_sm90a.cu, sm_90a only).
const MOE_WGMMA_PROBE: &str = "moe_wgmma_plain";
/// `mma_sync` here keeps the mma.sync kernels where wgmma would run (for comparisons);
/// report.json's `execution.moe_experts` names the kernels that ran.
pub const MOE_KERNEL_ENV: &str = "INFERNIX_MOE_KERNEL";

/// The kernels of the default route's expert products (the FP32 route has its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeKernel {
    /// `moe_gemm_gated_<act>_<fmt>` and `moe_gemm_<fmt>` (kernels/moe.cu): mma.sync
    /// 64x64x32 over 64-slot tiles, the weights dequantized in the loader.
    MmaSync,
    /// `moe_dequant_bank_<fmt>` and `moe_gather_bf16` (kernels/moe.cu), then
    /// `moe_wgmma_gated_<act>` and `moe_wgmma_plain` (kernels/moe_sm90a.cu).
    Wgmma,
}

impl MoeKernel {
    /// wgmma when the sm_90a module is loaded, the widths suit its tensor maps and
    /// paired stores (d and f multiples of 8) and [`MOE_KERNEL_ENV`] is not `mma_sync`.
    /// Never depends on the pass (its rows), so a row's bits do not either.
    pub fn for_shape(dev: &CudaDevice, d: usize, f: usize) -> Self {
        let forced = std::env::var(MOE_KERNEL_ENV).is_ok_and(|v| v == "mma_sync");
        if !forced && dev.has_function(MOE_WGMMA_PROBE) && d % 8 == 0 && f % 8 == 0 {
            Self::Wgmma
        } else {
            Self::MmaSync
        }
    }

    /// What report.json records (`execution.moe_experts`) for the experts on `route`.
    pub fn describe_for(dev: &CudaDevice, route: Route) -> String {
        match route {
            Route::Fp32 => "per live expert: its rows gathered, the route's f32 matmuls and gated kernel; f64 combine in ascending expert order".to_string(),
            Route::Bf16TensorCore => {
                let k = Self::for_shape(dev, 8, 8);
                let rest = if k == Self::Wgmma { "; widths not multiples of 8: mma.sync" } else { "" };
                let site = match MoeRouteSite::for_top_k(1) {
                    MoeRouteSite::Device => "routing on the device (moe_route: the CPU oracle's rule bit for bit; slot layout, tile table and expert-usage counts on the device, no wait per layer)",
                    MoeRouteSite::Host => "routing on the host by the CPU oracle's rule (INFERNIX_MOE_ROUTING=host)",
                };
                let banks = match (k, MoeBankSite::from_env()) {
                    (Self::Wgmma, MoeBankSite::Resident) => "; bf16 banks resident (every expert dequantized once per layer, INFERNIX_MOE_BANKS=resident)",
                    _ => "",
                };
                format!("{site}; {}{rest}{banks}; f64 combine in ascending expert order", k.describe())
            }
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::MmaSync => "grouped by expert: mma.sync 64x64x32 over 64-slot tiles, weights dequantized to bf16 in the loader",
            Self::Wgmma => {
                "grouped by expert: each bank of the experts that took rows dequantized to one bf16 scratch per layer call, \
                 the rows gathered into slot order, wgmma 128x256x64 (gate and up with act(gate) * up in one, then down) \
                 over (128-slot tile, column tile) items with a TMA 4-stage pipeline (sm_90a)"
            }
        }
    }
}

/// One layer's routing laid out for the device: slots expert-major, rows
/// ascending inside an expert. Pure host data (unit-tested without a GPU).
#[derive(Debug, Clone, PartialEq)]
pub struct MoePlan {
    /// (n_experts + 1): expert e owns slots `seg[e]..seg[e + 1]`.
    pub seg: Vec<usize>,
    /// (n_slots): the row each slot reads.
    pub slot_rows: Vec<i32>,
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
        Ok(Self { seg, slot_rows, combine_slots, combine_weights })
    }

    /// The tile table: [`tiles_of`] of the segments.
    pub fn tiles_of(&self, slots_per_tile: usize) -> Result<Vec<i32>> {
        tiles_of(&self.seg, slots_per_tile)
    }

    pub fn n_slots(&self) -> usize {
        self.slot_rows.len()
    }

    /// Rows routed to expert `e`.
    pub fn rows_of(&self, e: usize) -> usize {
        self.seg[e + 1] - self.seg[e]
    }
}

/// `MoeRouteArgs` of kernels/common.cuh (moe_route's one parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeRouteArgs {
    /// (n_rows, n_experts) f32.
    logits: u64,
    /// (n_rows, top_k) i32, ascending per row.
    experts: u64,
    /// (n_rows, top_k) f64.
    weights: u64,
    n_experts: i32,
    top_k: i32,
    norm_topk_prob: i32,
    pad_: i32,
}
const _: () = assert!(size_of::<MoeRouteArgs>() == 40);
// SAFETY: plain data with the layout of the CUDA struct (size asserted on both sides); passed by value.
unsafe impl cudarc::driver::DeviceRepr for MoeRouteArgs {}

/// `MoePlanArgs` of kernels/common.cuh (moe_plan_slots's one parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct MoePlanArgs {
    /// (n_rows, top_k) i32 from moe_route.
    experts: u64,
    /// (n_experts + 1) i32.
    seg: u64,
    /// (n_slots) i32.
    slot_rows: u64,
    /// (n_rows, top_k) i32.
    combine_slots: u64,
    n_rows: i32,
    top_k: i32,
}
const _: () = assert!(size_of::<MoePlanArgs>() == 40);
// SAFETY: plain data with the layout of the CUDA struct (size asserted on both sides); passed by value.
unsafe impl cudarc::driver::DeviceRepr for MoePlanArgs {}

/// Most experts a row may pick on the device (`MOE_MAX_TOP_K` of kernels/common.cuh).
pub const MOE_MAX_TOP_K: usize = 32;
/// `host` here routes on the host (the router logits downloaded, [`route`] per
/// row, the plan uploaded), the route before moe4; the same selections and weights.
pub const MOE_ROUTING_ENV: &str = "INFERNIX_MOE_ROUTING";

/// Where a layer's rows are routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeRouteSite {
    /// `moe_route`, `moe_count`, `moe_plan_tiles`, `moe_plan_slots`
    /// (kernels/moe.cu); nothing comes to the host.
    Device,
    /// The router logits downloaded and routed by [`route`], the plan uploaded.
    Host,
}

impl MoeRouteSite {
    /// Device unless [`MOE_ROUTING_ENV`] is `host`, or top_k exceeds [`MOE_MAX_TOP_K`].
    pub fn for_top_k(top_k: usize) -> Self {
        if std::env::var(MOE_ROUTING_ENV).is_ok_and(|v| v == "host") || top_k > MOE_MAX_TOP_K {
            Self::Host
        } else {
            Self::Device
        }
    }
}

/// `resident` here keeps every MoE layer's bf16 banks (all its experts, gate,
/// up and down, `3 n_experts d_ffn_expert d_model` bf16 a layer: 1.125 GiB on
/// the 30B-A3B shape) in device memory from the layer's first call to the end
/// of the run, dequantized once instead of once per layer call (the wgmma route
/// only). The same operands, so the same numbers; it costs that memory, and a
/// layer whose banks do not fit (with [`MOE_RESIDENT_SPARE_BYTES`] left free)
/// is an error naming the variable.
pub const MOE_BANKS_ENV: &str = "INFERNIX_MOE_BANKS";
/// Device memory left free after a layer's resident banks are allocated.
pub const MOE_RESIDENT_SPARE_BYTES: usize = 4 << 30;

/// Where the wgmma route's bf16 banks live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeBankSite {
    /// Dequantized per layer call, the experts that took rows only (the default).
    PerCall,
    /// Dequantized once per layer and kept ([`MOE_BANKS_ENV`] `resident`).
    Resident,
}

impl MoeBankSite {
    pub fn from_env() -> Self {
        if std::env::var(MOE_BANKS_ENV).is_ok_and(|v| v == "resident") {
            Self::Resident
        } else {
            Self::PerCall
        }
    }
}

/// One layer's banks as bf16, expert-major `(n_experts, rows, cols)` each.
pub struct Bf16Banks {
    gate: DeviceBuffer<bf16>,
    up: DeviceBuffer<bf16>,
    down: DeviceBuffer<bf16>,
}

/// The resident banks of [`MoeBankSite::Resident`], per layer: keyed by the
/// device address of the layer's first gate matrix, kept with the addresses of
/// every matrix they were made from (a call with other matrices makes them
/// again). A model's backend lives as long as its matrices.
#[derive(Default)]
pub struct ResidentBanks {
    layers: RefCell<HashMap<u64, (Vec<u64>, Arc<Bf16Banks>)>>,
}

/// The three banks of the experts whose pointers `tables` `(3, n_experts)`
/// holds (gate, up, down; a null entry is skipped), dequantized to bf16.
fn dequant_banks(dev: &CudaDevice, tables: &DeviceBuffer<u64>, likes: [&QuantMatrix; 3]) -> Result<Bf16Banks> {
    let n_e = tables.len() / 3;
    let mut out = Vec::with_capacity(3);
    for (i, like) in likes.into_iter().enumerate() {
        let mut bank = dev.alloc_uninit::<bf16>(n_e * like.n_rows * like.n_cols)?;
        moe_dequant_bank(dev, like, tables.slice(i * n_e..(i + 1) * n_e)?, bank.view_mut())?;
        out.push(bank);
    }
    let [gate, up, down]: [DeviceBuffer<bf16>; 3] = out.try_into().map_err(|_| anyhow::anyhow!("moe_ffn: three banks"))?;
    Ok(Bf16Banks { gate, up, down })
}

/// `MoeTilesArgs` of kernels/common.cuh (moe_plan_tiles's one parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeTilesArgs {
    /// (n_experts) i32: rows routed to each expert in this layer call.
    counts: u64,
    /// (n_experts + 1) i32, written.
    seg: u64,
    /// (n_table_rows, 3) i32, written: the tiles, then sentinel rows.
    tiles: u64,
    /// (n_experts) u64 += counts, or 0.
    usage: u64,
    /// (n_banks, n_experts) u64 pointer tables: entries of experts without rows cleared, or 0.
    banks: u64,
    n_experts: i32,
    slots_per_tile: i32,
    n_table_rows: i32,
    n_banks: i32,
}
const _: () = assert!(size_of::<MoeTilesArgs>() == 56);
// SAFETY: plain data with the layout of the CUDA struct (size asserted on both sides); passed by value.
unsafe impl cudarc::driver::DeviceRepr for MoeTilesArgs {}

/// The most tiles of at most `slots_per_tile` slots that `n_pairs` slots over
/// `n_experts` experts can need: `Σ ceil(c_e / T) <= Σ (c_e + T - 1) / T` over
/// the at most `min(n_experts, n_pairs)` experts with rows. The device tile
/// table has this many rows plus one sentinel. 0 for tiles of 0 slots (which
/// [`DevicePlan`] refuses).
pub fn max_tiles(n_pairs: usize, n_experts: usize, slots_per_tile: usize) -> usize {
    match slots_per_tile {
        0 => 0,
        t => (n_pairs + n_experts.min(n_pairs) * (t - 1)) / t,
    }
}

/// The sink of one layer call's per-expert counts on the device: the layer's
/// expert-usage counters (`(n_experts)` u64, added to) and the bank pointer
/// tables to clear for experts without rows (`(n_banks, n_experts)` u64).
pub struct PlanSinks<'a> {
    pub usage: Option<DevViewMut<'a, u64>>,
    pub banks: Option<DevViewMut<'a, u64>>,
}

/// One layer call's routing on the device: the slot layout of [`MoePlan`]
/// (expert-major, rows ascending inside an expert) and its tile table, all in
/// device memory; making it never waits for the device.
pub struct DevicePlan {
    /// (n_experts + 1) i32: expert e owns slots `seg[e]..seg[e + 1]`.
    pub seg: DeviceBuffer<i32>,
    /// (n_table_rows, 3) i32: expert, first slot, end slot of each tile (at most
    /// `slots_per_tile` slots), experts ascending, then sentinel rows (-1, n_real,
    /// n_real); n_table_rows = [`max_tiles`] + 1.
    pub tiles: DeviceBuffer<i32>,
    /// (n_slots) i32: the row each slot reads.
    pub slot_rows: DeviceBuffer<i32>,
    /// (n_rows, top_k) i32: per row its experts' slots, ascending expert.
    pub combine_slots: DeviceBuffer<i32>,
    /// (n_rows, top_k) f64: the matching routing weights.
    pub combine_weights: DeviceBuffer<f64>,
    /// (n_rows, top_k) i32: per row its experts, ascending (None when routed on the host).
    pub experts: Option<DeviceBuffer<i32>>,
}

impl DevicePlan {
    /// [`MoePlan`] of the host, uploaded; its counts go through `moe_plan_tiles`
    /// like the device route's, so the tile table and the sinks are the same.
    pub fn upload(dev: &CudaDevice, plan: &MoePlan, slots_per_tile: usize, sinks: PlanSinks) -> Result<Self> {
        let counts = (0..plan.seg.len() - 1).map(|e| i32_of(plan.rows_of(e), "count")).collect::<Result<Vec<i32>>>()?;
        let counts = dev.upload(&counts)?;
        let n_rows = plan.combine_slots.len();
        let (seg, tiles) = plan_tiles(dev, counts.view(), plan.n_slots(), slots_per_tile, sinks)?;
        ensure!(n_rows == plan.combine_weights.len(), "moe_ffn: {n_rows} slots per row but {} weights", plan.combine_weights.len());
        Ok(Self {
            seg,
            tiles,
            slot_rows: dev.upload(&plan.slot_rows)?,
            combine_slots: dev.upload(&plan.combine_slots)?,
            combine_weights: dev.upload(&plan.combine_weights)?,
            experts: None,
        })
    }

    /// Routes the `(n_rows, n_experts)` logits on the device, bit for bit as
    /// [`route`] does, and lays the slots out as [`MoePlan::new`] does, with
    /// tiles of at most `slots_per_tile` slots; the counts go to `sinks`.
    /// Nothing comes to the host.
    pub fn route(dev: &CudaDevice, logits: DevView<f32>, p: &MoeRouting, slots_per_tile: usize, sinks: PlanSinks) -> Result<Self> {
        let (n_e, top_k) = (p.n_experts, p.top_k);
        ensure!(n_e > 0 && logits.len() % n_e == 0, "moe_route: {} router logits for {n_e} experts", logits.len());
        ensure!((1..=MOE_MAX_TOP_K.min(n_e)).contains(&top_k), "moe_route: top_k {top_k} for {n_e} experts (at most {MOE_MAX_TOP_K} on the device)");
        let n_rows = logits.len() / n_e;
        let n_pairs = n_rows * top_k;
        let mut experts = dev.alloc_uninit::<i32>(n_pairs)?;
        let mut weights = dev.alloc_uninit::<f64>(n_pairs)?;
        let mut counts = dev.alloc_zeros::<i32>(n_e)?;
        let mut slot_rows = dev.alloc_uninit::<i32>(n_pairs)?;
        let mut combine_slots = dev.alloc_uninit::<i32>(n_pairs)?;
        if n_rows > 0 {
            let args = MoeRouteArgs {
                logits: logits.ptr(),
                experts: experts.view_mut().ptr(),
                weights: weights.view_mut().ptr(),
                n_experts: i32_of(n_e, "experts")?,
                top_k: i32_of(top_k, "top_k")?,
                norm_topk_prob: i32::from(p.norm_topk_prob),
                pad_: 0,
            };
            let smem = u32::try_from(n_e * 8).context("moe_route: shared memory")?;
            ensure!(smem <= 48 * 1024, "moe_route: {n_e} experts need {smem} bytes of shared memory (at most 48 KiB)");
            let f = func(dev, "moe_route")?;
            let mut b = dev.stream().launch_builder(f);
            b.arg(&args);
            let gx = u32::try_from(n_rows).context("moe_route: rows")?;
            // SAFETY: `args` mirrors MoeRouteArgs of kernels/common.cuh (size asserted); logits hold
            // (n_rows, n_e) f32, experts and weights (n_rows, top_k) (allocated above), top_k <=
            // MOE_MAX_TOP_K and <= n_e (checked), n_e doubles of dynamic shared memory.
            unsafe { b.launch(cfg((gx, 1, 1), 32, smem)) }.map_err(|e| launch_err("moe_route", e))?;
            let f = func(dev, "moe_count")?;
            let (ep, cp, ni) = (experts.view().ptr(), counts.view_mut().ptr(), i32_of(n_pairs, "pairs")?);
            let mut b = dev.stream().launch_builder(f);
            b.arg(&ep).arg(&cp).arg(&ni);
            // SAFETY: arguments match moe_count in kernels/moe.cu; experts holds n_pairs ids below
            // n_e (moe_route), counts n_e i32.
            unsafe { b.launch(cfg((grid_1d(n_pairs, 256)?, 1, 1), 256, 0)) }.map_err(|e| launch_err("moe_count", e))?;
        }
        let (seg, tiles) = plan_tiles(dev, counts.view(), n_pairs, slots_per_tile, sinks)?;
        if n_rows > 0 {
            let args = MoePlanArgs {
                experts: experts.view().ptr(),
                seg: seg.view().ptr(),
                slot_rows: slot_rows.view_mut().ptr(),
                combine_slots: combine_slots.view_mut().ptr(),
                n_rows: i32_of(n_rows, "rows")?,
                top_k: i32_of(top_k, "top_k")?,
            };
            let f = func(dev, "moe_plan_slots")?;
            let mut b = dev.stream().launch_builder(f);
            b.arg(&args);
            // SAFETY: `args` mirrors MoePlanArgs of kernels/common.cuh (size asserted); seg holds
            // n_e + 1 offsets summing the counts of `experts` (moe_plan_tiles from moe_count), so
            // every slot written is below n_pairs = the length of slot_rows; combine_slots holds
            // (n_rows, top_k).
            unsafe { b.launch(cfg((u32::try_from(n_e).context("experts")?, 1, 1), 256, 0)) }.map_err(|e| launch_err("moe_plan_slots", e))?;
        }
        Ok(Self { seg, tiles, slot_rows, combine_slots, combine_weights: weights, experts: Some(experts) })
    }

    pub fn n_slots(&self) -> usize {
        self.slot_rows.len()
    }

    /// The slot segments on the host (one synchronizing download; the FP32
    /// route's per-expert loop and the tests need them).
    pub fn seg_host(&self, dev: &CudaDevice) -> Result<Vec<usize>> {
        let seg = dev.download(&self.seg).context("moe_ffn: slot segments to the host")?;
        seg.iter().map(|&s| usize::try_from(s).context("moe_ffn: a negative slot offset")).collect()
    }
}

/// `moe_plan_tiles` (kernels/moe.cu) over the per-expert `counts` `(n_experts)`
/// of `n_pairs` slots: -> the slot segments `(n_experts + 1)` and the tile table
/// `(max_tiles + 1, 3)` (tiles of at most `slots_per_tile` slots, then sentinels),
/// the counts added to `sinks.usage` and the bank pointers of experts without
/// rows cleared in `sinks.banks`. Enqueued only: nothing waits.
fn plan_tiles(dev: &CudaDevice, counts: DevView<i32>, n_pairs: usize, slots_per_tile: usize, sinks: PlanSinks) -> Result<(DeviceBuffer<i32>, DeviceBuffer<i32>)> {
    let n_e = counts.len();
    ensure!(n_e > 0 && slots_per_tile > 0, "moe_plan_tiles: {n_e} experts, tiles of {slots_per_tile} slots");
    let n_table_rows = max_tiles(n_pairs, n_e, slots_per_tile) + 1;
    let mut seg = dev.alloc_uninit::<i32>(n_e + 1)?;
    let mut tiles = dev.alloc_uninit::<i32>(n_table_rows * 3)?;
    if let Some(u) = &sinks.usage {
        ensure!(u.len() == n_e, "moe_plan_tiles: {} usage counters for {n_e} experts", u.len());
    }
    let n_banks = match &sinks.banks {
        Some(b) => {
            ensure!(b.len() % n_e == 0, "moe_plan_tiles: a pointer table of {} entries for {n_e} experts", b.len());
            b.len() / n_e
        }
        None => 0,
    };
    let smem = u32::try_from(2 * (n_e + 1) * 4).context("moe_plan_tiles: shared memory")?;
    ensure!(smem <= 48 * 1024, "moe_plan_tiles: {n_e} experts need {smem} bytes of shared memory (at most 48 KiB)");
    let args = MoeTilesArgs {
        counts: counts.ptr(),
        seg: seg.view_mut().ptr(),
        tiles: tiles.view_mut().ptr(),
        usage: sinks.usage.as_ref().map_or(0, |u| u.ptr()),
        banks: sinks.banks.as_ref().map_or(0, |b| b.ptr()),
        n_experts: i32_of(n_e, "experts")?,
        slots_per_tile: i32_of(slots_per_tile, "slots per tile")?,
        n_table_rows: i32_of(n_table_rows, "tile table rows")?,
        n_banks: i32_of(n_banks, "banks")?,
    };
    let f = func(dev, "moe_plan_tiles")?;
    let mut b = dev.stream().launch_builder(f);
    b.arg(&args);
    // SAFETY: `args` mirrors MoeTilesArgs of kernels/common.cuh (size asserted); counts holds
    // n_e i32 summing to n_pairs (moe_count, or the host plan), seg n_e + 1 and tiles
    // n_table_rows rows (allocated above; the kernel bounds its writes by n_table_rows), usage
    // n_e u64 and banks n_banks * n_e u64 (checked) or null; 2 (n_e + 1) i32 of shared memory.
    unsafe { b.launch(cfg((1, 1, 1), 256, smem)) }.map_err(|e| launch_err("moe_plan_tiles", e))?;
    Ok((seg, tiles))
}

/// The tile table `(n_tiles + 1, 3)` of the slot segments `seg` `(n_experts +
/// 1)`: expert, first slot, end slot, at most `slots_per_tile` slots a tile,
/// experts ascending, then one sentinel row (-1, n_tiles, n_tiles): the host
/// twin of `moe_plan_tiles` (whose table has the same rows, then more sentinels).
pub fn tiles_of(seg: &[usize], slots_per_tile: usize) -> Result<Vec<i32>> {
    ensure!(slots_per_tile > 0 && !seg.is_empty(), "moe_ffn: tiles of {slots_per_tile} slots over {} segments", seg.len());
    let mut tiles = Vec::new();
    for e in 0..seg.len() - 1 {
        let (a, b) = (seg[e], seg[e + 1]);
        for s0 in (a..b).step_by(slots_per_tile) {
            let s1 = (s0 + slots_per_tile).min(b);
            tiles.extend([i32_of(e, "expert")?, i32_of(s0, "slot")?, i32_of(s1, "slot")?]);
        }
    }
    let n = i32_of(tiles.len() / 3, "tiles")?;
    tiles.extend([-1, n, n]);
    Ok(tiles)
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

/// The grouped GEMM over every real tile of `tiles` `(n_table_rows, 3)` (sentinel
/// rows, expert -1, are skipped): `y[s] = x[row(s)] ·
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
    // bf16 for every row id (the caller's ids are rows of x), every real tile's slots lie in
    // 0..n_slots and sentinel rows are skipped (DevicePlan::tiles), the pointer tables hold one (n, k) matrix of `like`'s layout per
    // expert (same_bank), y holds (n_slots, n) of the kernel's output type (checked).
    unsafe { b.launch(cfg((grid_1d(n, MOE_TILE_COLS as u32)?, gy, 1), 128, 0)) }.map_err(|e| launch_err(&name, e))?;
    Ok(())
}

/// `out[i] = bf16(dequant(W[i]))` for each expert `i` of `ptrs` `(n_live)` (matrices
/// laid out like `like`): `out` `(n_live, n, k)` bf16, expert-major.
pub fn moe_dequant_bank(dev: &CudaDevice, like: &QuantMatrix, ptrs: DevView<u64>, out: DevViewMut<bf16>) -> Result<()> {
    let (n, k) = (like.n_rows, like.n_cols);
    let name = format!("moe_dequant_bank_{}", like.kernel_suffix());
    ensure!(k % 8 == 0 && out.ptr() % 16 == 0, "{name}: rows of {k} or an unaligned output");
    ensure!(out.len() == ptrs.len() * n * k, "{name}: out has {} elements for {} experts x {n} x {k}", out.len(), ptrs.len());
    if out.is_empty() {
        return Ok(());
    }
    let n_e = u32::try_from(ptrs.len()).ok().filter(|&e| e <= 65535).with_context(|| format!("{name}: {} experts", ptrs.len()))?;
    let f = func(dev, &name)?;
    let args = MoeDequantArgs {
        w: ptrs.ptr(),
        out: out.ptr(),
        row_bytes: like.row_bytes as i64,
        n_rows: i32_of(n, "rows")?,
        groups_per_row: i32_of(k / 8, "groups per row")?,
    };
    let mut b = dev.stream().launch_builder(f);
    b.arg(&args);
    // SAFETY: `args` mirrors MoeDequantArgs of kernels/common.cuh (size asserted); each pointer is
    // an (n, k) matrix of `like`'s layout (same_bank), out holds n_live * n * k bf16 (checked).
    unsafe { b.launch(cfg((grid_1d(n * k / 8, 256)?, n_e, 1), 256, 0)) }.map_err(|e| launch_err(&name, e))?;
    Ok(())
}

/// `out[s] = x[rows[s]]`: `x` `(n_x_rows, d)` bf16, `rows` `(n_slots)`, `out` `(n_slots, d)`.
pub fn moe_gather_bf16(dev: &CudaDevice, x: DevView<bf16>, d: usize, rows: DevView<i32>, out: DevViewMut<bf16>) -> Result<()> {
    ensure!(d % 8 == 0 && x.ptr() % 16 == 0 && out.ptr() % 16 == 0 && x.len() % d.max(1) == 0, "moe_gather_bf16: rows of {d}, or unaligned");
    ensure!(out.len() == rows.len() * d, "moe_gather_bf16: out has {} elements for {} slots x {d}", out.len(), rows.len());
    if out.is_empty() {
        return Ok(());
    }
    let f = func(dev, "moe_gather_bf16")?;
    let args = MoeGatherArgs {
        x: x.ptr(),
        rows: rows.ptr(),
        out: out.ptr(),
        n_slots: i32_of(rows.len(), "slots")?,
        groups_per_row: i32_of(d / 8, "groups per row")?,
    };
    let mut b = dev.stream().launch_builder(f);
    b.arg(&args);
    // SAFETY: `args` mirrors MoeGatherArgs of kernels/common.cuh (size asserted); every row id is a
    // row of x (the caller's plan routes rows of x), out holds (n_slots, d) bf16 (checked).
    unsafe { b.launch(cfg((grid_1d(out.len() / 8, 256)?, 1, 1), 256, 0)) }.map_err(|e| launch_err("moe_gather_bf16", e))?;
    Ok(())
}

/// The wgmma kernels' name: the plain product, or the gated one with `act`.
fn moe_wgmma_kernel(act: Option<Activation>) -> &'static str {
    match act {
        None => "moe_wgmma_plain",
        Some(Activation::Silu) => "moe_wgmma_gated_silu",
        Some(Activation::GeluTanh) => "moe_wgmma_gated_gelu",
    }
}

/// The grouped wgmma product over every real tile of `tiles` `(n_table_rows, 3)`
/// (expert index into the banks, first slot, end slot, at most
/// [`MOE_WGMMA_TILE_SLOTS`]; the last row a sentinel, as [`DevicePlan::tiles`]):
/// `y[s] = a[s] · B[e]ᵀ` (f32, `gate_act` None) or `y[s] = bf16(act(a[s] · G[e]ᵀ) *
/// (a[s] · U[e]ᵀ))`. `a` `(n_slots, k)` bf16; `bank` (and `bank_up`) `(n_live, n,
/// k)` bf16 (`n_live`: the experts the tiles name, every expert of the layer
/// here); `y` `(n_slots, n)`.
#[allow(clippy::too_many_arguments)]
pub fn moe_wgmma<Y: ops::OutElem>(
    dev: &CudaDevice,
    gate_act: Option<Activation>,
    a: DevView<bf16>,
    bank: DevView<bf16>,
    bank_up: Option<DevView<bf16>>,
    n: usize,
    k: usize,
    tiles: DevView<i32>,
    y: DevViewMut<Y>,
) -> Result<()> {
    let name = moe_wgmma_kernel(gate_act);
    ensure!(k % 8 == 0 && n % 2 == 0 && n > 0, "{name}: n = {n}, k = {k} (k a multiple of 8, n even)");
    ensure!(gate_act.is_some() == bank_up.is_some(), "{name}: the up bank goes with the gated kernel only");
    ensure!((Y::NAME == "bf16") == gate_act.is_some(), "{name}: the gated kernel writes bf16, the plain one f32 (asked for {})", Y::NAME);
    ensure!(a.len() % k == 0 && bank.len() % (n * k) == 0, "{name}: a has {} elements, the bank {}, for n = {n}, k = {k}", a.len(), bank.len());
    let n_slots = a.len() / k;
    ensure!(y.len() == n_slots * n && y.ptr() % 8 == 0, "{name}: y has {} elements for {n_slots} slots x {n}, or is unaligned", y.len());
    if let Some(u) = bank_up {
        ensure!(u.len() == bank.len(), "{name}: up bank of {} elements, gate bank {}", u.len(), bank.len());
    }
    ensure!(tiles.len() % 3 == 0, "{name}: a tile table of {} entries", tiles.len());
    let n_tiles = tiles.len() / 3;
    if n_tiles == 0 {
        return Ok(());
    }
    let bank_rows = bank.len() / k;
    let b_box = if gate_act.is_some() { ops::GEMM_BN / 2 } else { ops::GEMM_BN } as u32;
    let b = ops::tensor_map_bf16(bank.ptr(), bank_rows, k, b_box)?;
    let params = MoeWgmmaParams {
        a: ops::tensor_map_bf16(a.ptr(), n_slots, k, ops::GEMM_BM as u32)?,
        b,
        b_up: match bank_up {
            Some(u) => ops::tensor_map_bf16(u.ptr(), bank_rows, k, b_box)?,
            None => b,
        },
        tiles: tiles.ptr(),
        y: y.ptr(),
        ldy: n as i64,
        n: i32_of(n, "N")?,
        k: i32_of(k, "K")?,
        n_tiles: i32_of(n_tiles, "tiles")?,
        pad_: 0,
    };
    let n_items = n_tiles * n.div_ceil(b_box as usize);
    let f = ops::wgmma_func(dev, name)?;
    let grid = ops::wgmma_grid(dev, name, n_items)?;
    let mut lb = dev.stream().launch_builder(f);
    lb.arg(&params);
    // SAFETY: `params` mirrors MoeWgmmaParams of kernels/common.cuh (size asserted); the tensor
    // maps cover a (n_slots, k) and the banks (n_experts * n, k); every real tile's slots lie in
    // 0..n_slots and its expert below n_experts, and the table's last row is a sentinel giving
    // the real count (moe_plan_tiles, tiles_of); y holds (n_slots, n) of the kernel's output
    // type, 8-byte aligned with n even (checked).
    unsafe { lb.launch(cfg((grid, 1, 1), ops::GEMM_THREADS, ops::GEMM_SMEM_BYTES as u32)) }.map_err(|e| launch_err(name, e))?;
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
        counts: &mut DeviceBuffer<u64>,
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
        let n_e = experts.len();
        let act = ops_activation(p.activation);
        let kernel = MoeKernel::for_shape(dev, d, f);
        let wgmma = self.route() == Route::Bf16TensorCore && kernel == MoeKernel::Wgmma;
        // The routing (on the device, or on the host by the oracle itself), the plan's
        // tables and the tile table, made on the device; the counts are added to the
        // layer's device counters. (3, n_e) u64: every expert's gate, up and down base;
        // on the wgmma route those of experts without rows are cleared (not dequantized).
        let route_scope = self.prof.scope(dev, "moe_route")?;
        let picks: [fn(&Expert<CudaMatrix>) -> &CudaMatrix; 3] = [|e| &e.gate, |e| &e.up, |e| &e.down];
        let ptr_list: Vec<u64> = picks.iter().flat_map(|pick| experts.iter().map(|e| pick(e).q.data.view().ptr())).collect();
        let mut ptrs = dev.upload(&ptr_list)?;
        let per = if wgmma { MOE_WGMMA_TILE_SLOTS } else { MOE_TILE_SLOTS };
        let resident = wgmma && MoeBankSite::from_env() == MoeBankSite::Resident;
        let sinks = PlanSinks { usage: Some(counts.view_mut()), banks: (wgmma && !resident).then(|| ptrs.view_mut()) };
        let plan = match MoeRouteSite::for_top_k(p.top_k) {
            MoeRouteSite::Device => DevicePlan::route(dev, router_logits.f32("moe_ffn")?.view(), p, per, sinks)?,
            MoeRouteSite::Host => {
                let logits = dev.download(router_logits.f32("moe_ffn")?).context("moe_ffn: router logits to the host")?;
                DevicePlan::upload(dev, &MoePlan::new(&logits, p)?, per, sinks)?
            }
        };
        drop(route_scope);
        let n_slots = plan.n_slots();
        let (rows, slots, weights, tiles) = (&plan.slot_rows, &plan.combine_slots, &plan.combine_weights, &plan.tiles);
        let (wg, wu, wd) = (ptrs.slice(0..n_e)?, ptrs.slice(n_e..2 * n_e)?, ptrs.slice(2 * n_e..3 * n_e)?);
        // (n_slots, d): each slot's expert output.
        let mut y = dev.alloc_uninit::<f32>(n_slots * d)?;
        match (self.route(), kernel) {
            (Route::Bf16TensorCore, MoeKernel::Wgmma) => {
                let prep = self.prof.scope(dev, "moe_dequant_gather")?;
                let mut tmp = None;
                let xb = self.bf16_input(x, &mut tmp)?;
                // Each bank as bf16, expert-major: (n_e, rows, cols): per call only the experts
                // with rows written, or every expert once per layer (resident).
                let banks = if resident {
                    let key = ptr_list[0];
                    let kept = self.moe_banks.layers.borrow().get(&key).filter(|(made_from, _)| *made_from == ptr_list).map(|(_, b)| Arc::clone(b));
                    match kept {
                        Some(b) => b,
                        None => {
                            let bytes = 3 * n_e * f * d * 2;
                            let (free, _) = dev.mem_info()?;
                            ensure!(
                                free >= bytes + MOE_RESIDENT_SPARE_BYTES,
                                "{MOE_BANKS_ENV}=resident: a layer's bf16 expert banks take {:.2} GiB and {:.2} GiB of device memory are free \
                                 ({:.0} GiB must stay free): unset {MOE_BANKS_ENV} to dequantize per layer call",
                                bytes as f64 / (1u64 << 30) as f64,
                                free as f64 / (1u64 << 30) as f64,
                                (MOE_RESIDENT_SPARE_BYTES >> 30) as f64
                            );
                            let b = Arc::new(dequant_banks(dev, &ptrs, [gate, up, down])?);
                            self.moe_banks.layers.borrow_mut().insert(key, (ptr_list.clone(), Arc::clone(&b)));
                            b
                        }
                    }
                } else {
                    Arc::new(dequant_banks(dev, &ptrs, [gate, up, down])?)
                };
                let (bg, bu, bd) = (&banks.gate, &banks.up, &banks.down);
                // (n_slots, d) bf16: the rows of x in slot order.
                let mut xg = dev.alloc_uninit::<bf16>(n_slots * d)?;
                moe_gather_bf16(dev, xb, d, rows.view(), xg.view_mut())?;
                drop(prep);
                // (n_slots, f) bf16: act(gate) * up of each slot's expert.
                let mut h = dev.alloc_uninit::<bf16>(n_slots * f)?;
                {
                    let _s = self.prof.scope(dev, "moe_gate_up")?;
                    moe_wgmma(dev, Some(act), xg.view(), bg.view(), Some(bu.view()), f, d, tiles.view(), h.view_mut())
                        .context("moe_ffn: gate and up")?;
                }
                let _s = self.prof.scope(dev, "moe_down")?;
                moe_wgmma::<f32>(dev, None, h.view(), bd.view(), None, d, f, tiles.view(), y.view_mut()).context("moe_ffn: down")?;
                // The banks, xg and h are freed in stream order after the launches.
            }
            (Route::Bf16TensorCore, MoeKernel::MmaSync) => {
                let mut tmp = None;
                let xb = self.bf16_input(x, &mut tmp)?;
                // (n_slots, f) bf16: act(gate) * up of each slot's expert.
                let mut h = dev.alloc_uninit::<bf16>(n_slots * f)?;
                {
                    let _s = self.prof.scope(dev, "moe_gate_up")?;
                    moe_gemm(dev, Some(act), xb, Some(rows.view()), gate, wg, Some(wu), tiles.view(), n_slots, h.view_mut())
                        .context("moe_ffn: gate and up")?;
                }
                let _s = self.prof.scope(dev, "moe_down")?;
                moe_gemm::<f32>(dev, None, h.view(), None, down, wd, None, tiles.view(), n_slots, y.view_mut()).context("moe_ffn: down")?;
                // h is freed in stream order after the launches.
            }
            (Route::Fp32, _) => {
                let _s = self.prof.scope(dev, "moe_experts_fp32")?;
                // The per-expert loop runs on the host: one download of the segments.
                let seg = plan.seg_host(dev)?;
                let xf = x.f32("moe_ffn")?;
                for (e, ex) in experts.iter().enumerate() {
                    let (s0, s1) = (seg[e], seg[e + 1]);
                    if s0 == s1 {
                        continue;
                    }
                    let m = s1 - s0;
                    let mut xe = dev.alloc_uninit::<f32>(m * d)?;
                    ops::gather_rows(dev, xf.view(), d, rows.slice(s0..s1)?, xe.view_mut())?;
                    let (mut g, mut u, mut h) = (dev.alloc_uninit::<f32>(m * f)?, dev.alloc_uninit::<f32>(m * f)?, dev.alloc_uninit::<f32>(m * f)?);
                    ops::matmul::<f32>(dev, xe.view(), m, &ex.gate.q, g.view_mut(), f).with_context(|| format!("moe_ffn: {}", ex.gate.name))?;
                    ops::matmul::<f32>(dev, xe.view(), m, &ex.up.q, u.view_mut(), f).with_context(|| format!("moe_ffn: {}", ex.up.name))?;
                    ops::gated::<f32>(dev, act, g.view(), Rows::contiguous(m, f), u.view(), f, h.view_mut(), f)?;
                    ops::matmul::<f32>(dev, h.view(), m, &ex.down.q, y.slice_mut(s0 * d..s1 * d)?, d)
                        .with_context(|| format!("moe_ffn: {}", ex.down.name))?;
                }
            }
        }
        let _s = self.prof.scope(dev, "moe_combine")?;
        moe_combine(dev, y.view(), d, slots.view(), weights.view(), p.top_k, out.f32_mut("moe_ffn")?.view_mut())?;
        drop(_s);
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
        assert_eq!(plan.tiles_of(MOE_TILE_SLOTS).unwrap(), vec![0, 0, 1, 1, 1, 4, 2, 4, 5, 3, 5, 6, -1, 4, 4]);
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
        assert_eq!(plan.tiles_of(MOE_TILE_SLOTS).unwrap(), vec![0, 0, 64, 0, 64, 128, 0, 128, 150, -1, 3, 3]);
        assert_eq!(plan.rows_of(1), 0);
        assert!(MoePlan::new(&logits[..7], &p).is_err());
        // The wgmma route's tables: 128-slot tiles, an expert without rows has none.
        let p3 = MoeRouting { n_experts: 3, top_k: 1, ..p };
        let three: Vec<f32> = (0..200).flat_map(|r| if r < 130 { [0.0f32, 0.0, 1.0] } else { [1.0, 0.0, 0.0] }).collect();
        let plan = MoePlan::new(&three, &p3).unwrap();
        assert_eq!(plan.tiles_of(128).unwrap(), vec![0, 0, 70, 2, 70, 198, 2, 198, 200, -1, 3, 3]);
        assert!(plan.tiles_of(0).is_err());
    }

    /// `max_tiles` bounds the tiles of every way to spread the slots over the
    /// experts, and some spreads reach it (it is the least such bound).
    #[test]
    fn max_tiles_is_the_worst_case_of_the_tile_table() {
        for (n_pairs, n_e, per) in [(0usize, 4usize, 64usize), (1, 4, 64), (5, 8, 2), (64, 128, 64), (300, 7, 128), (65536, 128, 128), (65536, 128, 64), (100, 1, 3)] {
            let bound = max_tiles(n_pairs, n_e, per);
            let tiles = |counts: &[usize]| counts.iter().map(|c| c.div_ceil(per)).sum::<usize>();
            // Worst spread: every expert that can take one slot takes one (a tile each), the
            // rest goes to expert 0 (a tile per whole `per` more: its count stays 1 mod per).
            let live = n_e.min(n_pairs);
            let mut worst: Vec<usize> = (0..n_e).map(|e| usize::from(e < live)).collect();
            worst[0] += n_pairs - live;
            assert_eq!(worst.iter().sum::<usize>(), n_pairs);
            assert_eq!(tiles(&worst), bound, "({n_pairs}, {n_e}, {per}): the worst spread {worst:?}");
            // Pseudo-random spreads never exceed it.
            let mut state = (n_pairs * 31 + n_e * 7 + per) as u64 | 1;
            for _ in 0..200 {
                let mut counts = vec![0usize; n_e];
                for _ in 0..n_pairs.min(5000) {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    counts[(state % n_e as u64) as usize] += 1;
                }
                counts[0] += n_pairs - n_pairs.min(5000);
                assert!(tiles(&counts) <= bound, "({n_pairs}, {n_e}, {per}): {counts:?}");
            }
        }
    }
}
