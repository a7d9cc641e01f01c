//! Qwen3-Next's Gated DeltaNet mixing step and its sigmoid gates on CUDA
//! ([`Backend::delta_net`] and [`Backend::sigmoid_mul`] of
//! [`CudaBackend`]), kernels/delta_net.cu: the typed launchers of its kernels
//! (`delta_net_conv`, the scans `delta_net_scan` and `delta_net_chunk_*` with
//! `delta_net_gated_norm`, `sigmoid_mul_*`), the choice of scan
//! ([`DeltaScan`]) and the backend methods built on them.
//!
//! The exact scan is the per-token recurrence the CPU oracle defines
//! (`backend::cpu::delta_net`), in its order of operations and in f64, with
//! the head's state in shared memory; the convolution, gates and gated RMSNorm
//! round once to f32 as the CPU does. The chunked scans (fast paths
//! `delta-chunk-tf32`, `delta-chunk-3xtf32`; the 3xtf32 one is the default
//! route's) run 64 tokens per step on the tensor cores with an f32 state and
//! round differently (bounds measured in docs/performance.md). The carried state stays on the device
//! ([`CudaRecurrent`]: the windows' convolution histories in f32 and their
//! recurrent states in f64, the CPU oracle's [`RecurrentState`] values), so a
//! pass neither uploads nor downloads it; it is read back only on request
//! (`Backend::recurrent_states`, for tests).
//!
//! This module does not do the input and output projections (matmuls of the
//! model code) and does not route experts (`moe`).
//!
//! [`Backend::delta_net`]: crate::backend::Backend::delta_net
//! [`Backend::sigmoid_mul`]: crate::backend::Backend::sigmoid_mul

use anyhow::{ensure, Context, Result};
use cudarc::driver::PushKernelArg;

use super::backend::{CudaAct, CudaBackend, Route};
use super::buffer::{DevView, DevViewMut, DeviceBuffer};
use super::device::CudaDevice;
use super::ops::{cfg, func, grid_1d, i32_of, launch_err};
use crate::backend::{
    DeltaNetParams, DeltaNetWeights, PassRows, RecurrentState, FAST_PATH_DELTA_CHUNK_3XTF32, FAST_PATH_DELTA_CHUNK_TF32,
};

/// The carried state of one DeltaNet layer for the `n_seqs` windows of a
/// pass, in device memory ([`Backend::Recurrent`](crate::backend::Backend::Recurrent) of
/// [`CudaBackend`]).
pub struct CudaRecurrent {
    p: DeltaNetParams,
    n_seqs: usize,
    /// `(n_seqs, conv_kernel - 1, conv_channels)` and one spare element (a
    /// width-1 convolution carries no history, and no buffer is empty).
    hist: DeviceBuffer<f32>,
    /// `(n_seqs, n_v_heads, d_k, d_v)`
    ssm: DeviceBuffer<f64>,
}

impl CudaRecurrent {
    fn hist_len(&self) -> usize {
        (self.p.conv_kernel - 1) * self.p.conv_channels()
    }

    fn state_len(&self) -> usize {
        self.p.n_v_heads * self.p.d_k * self.p.d_v
    }

    /// Zero state (a window's start).
    pub fn new(dev: &CudaDevice, p: &DeltaNetParams, n_seqs: usize) -> Result<Self> {
        let (hist_len, state_len) = ((p.conv_kernel - 1) * p.conv_channels(), p.n_v_heads * p.d_k * p.d_v);
        let hist = dev.alloc_zeros::<f32>(n_seqs * hist_len + 1).context("delta_net: convolution histories")?;
        let ssm = dev.alloc_zeros::<f64>((n_seqs * state_len).max(1)).context("delta_net: recurrent states")?;
        Ok(Self { p: *p, n_seqs, hist, ssm })
    }

    /// The windows' states on the host (synchronizing).
    pub fn to_host(&self, dev: &CudaDevice) -> Result<Vec<RecurrentState>> {
        let (hist_len, state_len) = (self.hist_len(), self.state_len());
        let hist = dev.download(&self.hist).context("delta_net: convolution histories to the host")?;
        let ssm = dev.download(&self.ssm).context("delta_net: recurrent states to the host")?;
        Ok((0..self.n_seqs)
            .map(|s| RecurrentState {
                conv: hist[s * hist_len..(s + 1) * hist_len].to_vec(),
                ssm: ssm[s * state_len..(s + 1) * state_len].to_vec(),
            })
            .collect())
    }
}

/// The widest causal convolution `delta_net_conv` holds in registers (`DELTA_CONV_MAX_WIDTH`).
pub const CONV_MAX_WIDTH: usize = 8;

/// Threads per block of `delta_net_conv` (one per channel).
const CONV_BLOCK: u32 = 128;

/// Parameters of `delta_net_conv`, mirrored by `DeltaConvArgs` in kernels/common.cuh.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DeltaConvArgs {
    /// (n_seqs * n_tokens, n_channels) f32.
    x: u64,
    /// (n_channels, width) f32.
    w: u64,
    /// (n_seqs, width - 1, n_channels) f32, read then overwritten.
    history: u64,
    /// (n_seqs * n_tokens, n_channels) f32.
    out: u64,
    n_seqs: i32,
    n_tokens: i32,
    n_channels: i32,
    width: i32,
}
const _: () = assert!(size_of::<DeltaConvArgs>() == 48);
// SAFETY: plain data with the layout of the CUDA struct (size asserted on both sides); passed by value.
unsafe impl cudarc::driver::DeviceRepr for DeltaConvArgs {}

/// Parameters of `delta_net_scan`, mirrored by `DeltaScanArgs` in kernels/common.cuh.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DeltaScanArgs {
    /// (n_rows, conv_channels) f32: the convolved q | k | v.
    mixed: u64,
    /// (n_rows, n_v_heads * d_v) f32.
    z: u64,
    /// (n_rows, 2 * n_v_heads) f32.
    ba: u64,
    /// (n_v_heads) f32.
    a: u64,
    /// (n_v_heads) f32.
    dt_bias: u64,
    /// (d_v) f32.
    norm: u64,
    /// (n_seqs, n_v_heads, d_k, d_v) f64, read then overwritten.
    state: u64,
    /// (n_rows, n_v_heads * d_v) f32.
    out: u64,
    eps: f64,
    n_tokens: i32,
    n_k_heads: i32,
    n_v_heads: i32,
    d_k: i32,
    d_v: i32,
    pad_: i32,
}
const _: () = assert!(size_of::<DeltaScanArgs>() == 96);
// SAFETY: plain data with the layout of the CUDA struct (size asserted on both sides); passed by value.
unsafe impl cudarc::driver::DeviceRepr for DeltaScanArgs {}

/// Dynamic shared memory of `delta_net_scan`: the `(d_k, d_v)` f64 state, then q, k
/// `(d_k)` and o `(d_v)` in f32.
pub fn scan_smem_bytes(d_k: usize, d_v: usize) -> usize {
    d_k * d_v * 8 + (2 * d_k + d_v) * 4
}

/// The depthwise causal convolution + SiLU of `x` `(rows.n_rows(), n_channels)`
/// with taps `w` `(n_channels, width)`, each window's earlier inputs read from
/// `history` `(rows.n_seqs, width - 1, n_channels)`, which is updated.
/// -> `out` `(rows.n_rows(), n_channels)`.
pub fn conv(
    dev: &CudaDevice,
    x: DevView<f32>,
    w: DevView<f32>,
    width: usize,
    history: DevViewMut<f32>,
    out: DevViewMut<f32>,
    rows: PassRows,
) -> Result<()> {
    let n = rows.n_rows();
    ensure!((1..=CONV_MAX_WIDTH).contains(&width), "delta_net_conv: width {width} outside 1..={CONV_MAX_WIDTH}");
    ensure!(width > 0 && w.len() % width == 0, "delta_net_conv: {} taps are not channels of {width}", w.len());
    let c = w.len() / width;
    ensure!(
        x.len() == n * c && out.len() == n * c && history.len() == rows.n_seqs * (width - 1) * c,
        "delta_net_conv: x {}, out {}, history {} values for {rows:?} of {c} channels, width {width}",
        x.len(),
        out.len(),
        history.len()
    );
    if n == 0 || c == 0 {
        return Ok(());
    }
    let name = "delta_net_conv";
    let f = func(dev, name)?;
    let args = DeltaConvArgs {
        x: x.ptr(),
        w: w.ptr(),
        history: history.ptr(),
        out: out.ptr(),
        n_seqs: i32_of(rows.n_seqs, "n_seqs")?,
        n_tokens: i32_of(rows.n_tokens, "n_tokens")?,
        n_channels: i32_of(c, "n_channels")?,
        width: i32_of(width, "width")?,
    };
    let gy = u32::try_from(rows.n_seqs).context("delta_net_conv: windows")?;
    ensure!(gy <= 65535, "{name}: {gy} windows exceed the grid's y limit 65535");
    let mut b = dev.stream().launch_builder(f);
    b.arg(&args);
    // SAFETY: `args` mirrors DeltaConvArgs of kernels/common.cuh (size asserted); every buffer holds
    // the elements the kernel indexes (checked above).
    unsafe { b.launch(cfg((grid_1d(c, CONV_BLOCK)?, gy, 1), CONV_BLOCK, 0)) }.map_err(|e| launch_err(name, e))?;
    Ok(())
}

/// Which kernel runs the Gated DeltaNet recurrence (`Backend::delta_net` of
/// [`CudaBackend`]): the exact one, or a chunked tensor-core fast path (named in
/// [`crate::backend::FAST_PATHS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaScan {
    /// `delta_net_scan`: the exact per-token recurrence in f64, the oracle's order
    /// (the FP32 route's, `--lossless`).
    Exact,
    /// `delta_net_chunk_tf32`: chunks of [`CHUNK_TOKENS`], tf32 mma.sync products, f32
    /// state; only forced (its measured share of the tiny model's difference on the
    /// default route exceeds that route's 0.005-nat bound: docs/performance.md).
    ChunkTf32,
    /// `delta_net_chunk_3xtf32`: the same with each product as three tf32 products
    /// (about f32 accuracy); the default route's scan (within its bound, measured).
    Chunk3xTf32,
}

impl DeltaScan {
    /// The fast path of each chunked kernel.
    const BY_FAST_PATH: [(&'static str, DeltaScan); 2] =
        [(FAST_PATH_DELTA_CHUNK_TF32, DeltaScan::ChunkTf32), (FAST_PATH_DELTA_CHUNK_3XTF32, DeltaScan::Chunk3xTf32)];

    /// The scan of `route` when none is forced: the 3xtf32 chunks on the default
    /// (bf16 tensor-core) route, the exact recurrence on FP32 (`--lossless`).
    pub fn default_for(route: Route) -> Self {
        match route {
            Route::Bf16TensorCore => Self::Chunk3xTf32,
            Route::Fp32 => Self::Exact,
        }
    }

    /// The kernel the forced fast paths `names` (`--fast-path`) select, if one
    /// of the chunked ones is named; both named is an error.
    pub fn for_fast_paths(names: &[String]) -> Result<Option<Self>> {
        let chosen: Vec<DeltaScan> =
            Self::BY_FAST_PATH.iter().filter(|(n, _)| names.iter().any(|x| x == n)).map(|(_, k)| *k).collect();
        ensure!(
            chosen.len() <= 1,
            "--fast-path {FAST_PATH_DELTA_CHUNK_TF32} and --fast-path {FAST_PATH_DELTA_CHUNK_3XTF32}: choose one DeltaNet scan"
        );
        Ok(chosen.first().copied())
    }

    /// What the report records.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Exact => "exact per-token recurrence, f64 state (delta_net_scan)",
            Self::ChunkTf32 => {
                "fast path delta-chunk-tf32: chunks of 64 tokens (WY/UT form), tf32 mma.sync products, f32 state (delta_net_chunk_tf32)"
            }
            Self::Chunk3xTf32 => {
                "fast path delta-chunk-3xtf32: chunks of 64 tokens (WY/UT form), 3xtf32 mma.sync products, f32 state (delta_net_chunk_3xtf32)"
            }
        }
    }

    fn kernel(self) -> &'static str {
        match self {
            Self::Exact => "delta_net_scan",
            Self::ChunkTf32 => "delta_net_chunk_tf32",
            Self::Chunk3xTf32 => "delta_net_chunk_3xtf32",
        }
    }
}

/// Tokens per chunk of the chunked scan (`DC_C` in kernels/delta_net.cu).
pub const CHUNK_TOKENS: usize = 64;

/// Threads per block of the chunked scan (`DC_THREADS`).
const CHUNK_BLOCK: u32 = 256;

/// The value columns one block of the chunked scan carries: `d_v` up to 64, else 64.
fn chunk_bv(d_v: usize) -> usize {
    d_v.min(64)
}

/// Dynamic shared memory of `delta_net_chunk_*`: the chunk's cumulative decay
/// `(C)` f64, then in f32 the state slice `(d_k, bv)`, Q/U `(C, max(d_k, bv))`,
/// K `(C, d_k)`, V, K S, Q S `(C, bv)`, L, T, P `(C, C)` (rows padded by 4) and
/// three `(C)` gate vectors.
pub fn chunk_smem_bytes(d_k: usize, d_v: usize) -> usize {
    let (c, bv) = (CHUNK_TOKENS, chunk_bv(d_v));
    let floats = d_k * (bv + 4) + c * (d_k.max(bv) + 4) + c * (d_k + 4) + 3 * c * (bv + 4) + 3 * c * (c + 4) + 3 * c;
    c * 8 + floats * 4
}

/// Whether the chunked scan takes heads of `d_k` x `d_v`: an error saying why not.
pub fn chunk_supports(d_k: usize, d_v: usize) -> Result<()> {
    let bv = chunk_bv(d_v);
    ensure!(
        d_k % 16 == 0 && (16..=128).contains(&d_k) && bv % 16 == 0 && bv > 0 && d_v % bv == 0,
        "the chunked DeltaNet scan takes d_k a multiple of 16 up to 128 and d_v a multiple of 16 up to 64 or of 64; \
         this layer has d_k {d_k}, d_v {d_v} (drop --fast-path {FAST_PATH_DELTA_CHUNK_TF32}/{FAST_PATH_DELTA_CHUNK_3XTF32})"
    );
    Ok(())
}

/// The checked parameters of the scan kernels (`DeltaScanArgs`).
#[allow(clippy::too_many_arguments)]
fn scan_args(
    name: &str,
    mixed: DevView<f32>,
    z: DevView<f32>,
    ba: DevView<f32>,
    w: &DeltaNetWeights<DeviceBuffer<f32>>,
    p: &DeltaNetParams,
    state: &DevViewMut<f64>,
    out: &DevViewMut<f32>,
    rows: PassRows,
) -> Result<DeltaScanArgs> {
    let n = rows.n_rows();
    let (nv, dk, dv) = (p.n_v_heads, p.d_k, p.d_v);
    ensure!(p.n_k_heads > 0 && nv % p.n_k_heads == 0, "{name}: {nv} value heads do not share {} key heads evenly", p.n_k_heads);
    ensure!(
        w.a.len() == nv && w.dt_bias.len() == nv && w.norm.len() == dv,
        "{name}: a {}, dt_bias {}, norm {} values for {p:?}",
        w.a.len(),
        w.dt_bias.len(),
        w.norm.len()
    );
    ensure!(
        mixed.len() == n * p.conv_channels() && z.len() == n * nv * dv && ba.len() == n * 2 * nv && out.len() == n * nv * dv,
        "{name}: mixed {}, z {}, ba {}, out {} values for {n} rows of {p:?}",
        mixed.len(),
        z.len(),
        ba.len(),
        out.len()
    );
    ensure!(state.len() == rows.n_seqs * nv * dk * dv, "{name}: state of {} values for {} windows of {p:?}", state.len(), rows.n_seqs);
    ensure!(rows.n_seqs <= 65535, "{name}: {} windows exceed the grid's y limit 65535", rows.n_seqs);
    Ok(DeltaScanArgs {
        mixed: mixed.ptr(),
        z: z.ptr(),
        ba: ba.ptr(),
        a: w.a.view().ptr(),
        dt_bias: w.dt_bias.view().ptr(),
        norm: w.norm.view().ptr(),
        state: state.ptr(),
        out: out.ptr(),
        eps: p.eps,
        n_tokens: i32_of(rows.n_tokens, "n_tokens")?,
        n_k_heads: i32_of(p.n_k_heads, "n_k_heads")?,
        n_v_heads: i32_of(nv, "n_v_heads")?,
        d_k: i32_of(dk, "d_k")?,
        d_v: i32_of(dv, "d_v")?,
        pad_: 0,
    })
}

/// Raises `name`'s dynamic shared memory limit to `smem` bytes when above the default 48 KiB.
fn allow_smem(dev: &CudaDevice, name: &str, smem: usize) -> Result<()> {
    let max = dev.info().max_smem_per_block_bytes as usize;
    ensure!(smem <= max, "{name}: needs {smem} bytes of shared memory, the device allows {max}");
    if smem > 48 << 10 {
        func(dev, name)?
            .set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .map_err(|e| anyhow::anyhow!("{name}: raising dynamic shared memory to {smem} bytes: {e}"))?;
    }
    Ok(())
}

/// The gated delta rule and the gated RMSNorm of every value head of every
/// window (see kernels/delta_net.cu) by `kernel`: `mixed` `(n, conv_channels)`,
/// `z` `(n, n_v_heads * d_v)`, `ba` `(n, 2 * n_v_heads)`, `state` `(n_seqs,
/// n_v_heads, d_k, d_v)` f64 (updated; the chunked kernels store f32 values in
/// it). -> `out` `(n, n_v_heads * d_v)`.
#[allow(clippy::too_many_arguments)]
pub fn scan_with(
    dev: &CudaDevice,
    kernel: DeltaScan,
    mixed: DevView<f32>,
    z: DevView<f32>,
    ba: DevView<f32>,
    w: &DeltaNetWeights<DeviceBuffer<f32>>,
    p: &DeltaNetParams,
    state: DevViewMut<f64>,
    out: DevViewMut<f32>,
    rows: PassRows,
) -> Result<()> {
    let name = kernel.kernel();
    let args = scan_args(name, mixed, z, ba, w, p, &state, &out, rows)?;
    let (n, nv, dk, dv) = (rows.n_rows(), p.n_v_heads, p.d_k, p.d_v);
    if n == 0 || nv == 0 {
        return Ok(());
    }
    let gy = rows.n_seqs as u32;
    if kernel == DeltaScan::Exact {
        ensure!((1..=1024).contains(&dv) && dk >= 1, "{name}: d_v {dv} outside 1..=1024 (one thread per column), d_k {dk}");
        let smem = scan_smem_bytes(dk, dv);
        allow_smem(dev, name, smem)?;
        let gx = u32::try_from(nv).context("delta_net_scan: heads")?;
        let block = dv.div_ceil(32) as u32 * 32;
        let mut b = dev.stream().launch_builder(func(dev, name)?);
        b.arg(&args);
        // SAFETY: `args` mirrors DeltaScanArgs of kernels/common.cuh (size asserted); every buffer holds
        // the elements the kernel indexes (checked by scan_args, the weights by check_inputs); the shared
        // memory asked for is what the kernel lays out (scan_smem_bytes) and within the device's limit.
        unsafe { b.launch(cfg((gx, gy, 1), block, smem as u32)) }.map_err(|e| launch_err(name, e))?;
        return Ok(());
    }
    chunk_supports(dk, dv).with_context(|| name.to_string())?;
    let smem = chunk_smem_bytes(dk, dv);
    allow_smem(dev, name, smem)?;
    let gx = u32::try_from(nv * (dv / chunk_bv(dv))).context("delta_net_chunk: heads")?;
    let mut b = dev.stream().launch_builder(func(dev, name)?);
    b.arg(&args);
    // SAFETY: as above; the chunked kernel's shapes are within what it lays out (chunk_supports) and
    // its shared memory is chunk_smem_bytes, within the device's limit.
    unsafe { b.launch(cfg((gx, gy, 1), CHUNK_BLOCK, smem as u32)) }.map_err(|e| launch_err(name, e))?;
    let norm = "delta_net_gated_norm";
    let n_rows = n as i64;
    let mut b = dev.stream().launch_builder(func(dev, norm)?);
    b.arg(&args).arg(&n_rows);
    // SAFETY: the same checked arguments; out and z hold n rows of n_v_heads * d_v, norm d_v values;
    // one warp per (row, head), 8 per block.
    unsafe { b.launch(cfg((grid_1d(n * nv, 8)?, 1, 1), 256, 0)) }.map_err(|e| launch_err(norm, e))?;
    Ok(())
}

/// [`scan_with`] the exact kernel.
#[allow(clippy::too_many_arguments)]
pub fn scan(
    dev: &CudaDevice,
    mixed: DevView<f32>,
    z: DevView<f32>,
    ba: DevView<f32>,
    w: &DeltaNetWeights<DeviceBuffer<f32>>,
    p: &DeltaNetParams,
    state: DevViewMut<f64>,
    out: DevViewMut<f32>,
    rows: PassRows,
) -> Result<()> {
    scan_with(dev, DeltaScan::Exact, mixed, z, ba, w, p, state, out, rows)
}

/// `out[r, c] = x[r, c] * sigmoid(gate[r, c or 0])` in f64, one f32 rounding; `x`
/// `(n_rows, n_cols)` of f32 or bf16 (`bf16_x`), `gate` `(n_rows, gate_cols)`
/// with `gate_cols` 1 or `n_cols`. `out` may be `x` itself (f32).
fn sigmoid_mul_raw(dev: &CudaDevice, x: u64, bf16_x: bool, gate: DevView<f32>, gate_cols: usize, out: DevViewMut<f32>, n_cols: usize) -> Result<()> {
    let n = out.len();
    ensure!(n_cols > 0 && n % n_cols == 0, "sigmoid_mul: {n} outputs are not rows of {n_cols}");
    ensure!(gate_cols == 1 || gate_cols == n_cols, "sigmoid_mul: gate of {gate_cols} columns for rows of {n_cols}");
    ensure!(gate.len() == n / n_cols * gate_cols, "sigmoid_mul: gate has {} values for {} rows of {gate_cols}", gate.len(), n / n_cols);
    if n == 0 {
        return Ok(());
    }
    let name = if bf16_x { "sigmoid_mul_bf16" } else { "sigmoid_mul_f32" };
    let f = func(dev, name)?;
    let (gp, op, nn) = (gate.ptr(), out.ptr(), n as i64);
    let (nc, gc) = (i32_of(n_cols, "n_cols")?, i32_of(gate_cols, "gate_cols")?);
    let mut b = dev.stream().launch_builder(f);
    b.arg(&x).arg(&gp).arg(&op).arg(&nn).arg(&nc).arg(&gc);
    // SAFETY: arguments match `sigmoid_mul_{f32,bf16}` in kernels/delta_net.cu; x (the caller's
    // buffer of n elements of its type) and out hold n elements, gate n / n_cols rows of gate_cols.
    unsafe { b.launch(cfg((grid_1d(n, 256)?, 1, 1), 256, 0)) }.map_err(|e| launch_err(name, e))?;
    Ok(())
}

impl CudaBackend {
    /// An f32 activation `(n_rows, n_cols)` holding `host` (the parity tests'
    /// inputs of any width; `embed` takes rows of multiples of 32 only).
    pub fn upload_act(&self, n_rows: usize, n_cols: usize, host: &[f32]) -> Result<CudaAct> {
        ensure!(host.len() == n_rows * n_cols, "upload_act: {} values for {n_rows} x {n_cols}", host.len());
        let mut act = self.new_act(n_rows, n_cols)?;
        if !host.is_empty() {
            self.device().copy_to_device(host, act.f32_mut("upload_act")?)?;
        }
        Ok(act)
    }

    /// See [`Backend::sigmoid_mul`](crate::backend::Backend::sigmoid_mul): in
    /// place on f32 values; a bf16-only activation (the default route's
    /// attention output) is replaced by the f32 product of its bf16 values
    /// (one rounding more than the CPU's emulation of the route, which keeps
    /// the attention output in f32 until the next matmul).
    pub(super) fn sigmoid_mul_cuda(&self, x: &mut CudaAct, gate: &CudaAct) -> Result<()> {
        ensure!(
            gate.n_rows == x.n_rows && (gate.n_cols == x.n_cols || gate.n_cols == 1),
            "sigmoid_mul: gate is {} x {}, x is {} x {} (same shape, or one gate column)",
            gate.n_rows,
            gate.n_cols,
            x.n_rows,
            x.n_cols
        );
        let dev = self.device();
        let g = gate.f32("sigmoid_mul")?.view();
        if x.f32("sigmoid_mul").is_ok() {
            let n_cols = x.n_cols;
            let xv = x.f32_mut("sigmoid_mul")?.view_mut();
            let ptr = xv.ptr();
            return sigmoid_mul_raw(dev, ptr, false, g, gate.n_cols, xv, n_cols);
        }
        let xb = x.bf16().context("sigmoid_mul: activation without values")?;
        let mut out = self.new_act(x.n_rows, x.n_cols)?;
        sigmoid_mul_raw(dev, xb.view().ptr(), true, g, gate.n_cols, out.f32_mut("sigmoid_mul")?.view_mut(), x.n_cols)?;
        *x = out;
        Ok(())
    }

    /// See [`Backend::delta_net`](crate::backend::Backend::delta_net); window
    /// `s` of the pass carries `states[s]` (uploaded, updated on the device,
    /// downloaded: the call waits for the stream).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn delta_net_cuda(
        &self,
        qkv: &CudaAct,
        z: &CudaAct,
        ba: &CudaAct,
        w: &DeltaNetWeights<DeviceBuffer<f32>>,
        p: &DeltaNetParams,
        states: &mut CudaRecurrent,
        rows: PassRows,
    ) -> Result<CudaAct> {
        let n = rows.n_rows();
        let lens = [w.conv.len(), w.a.len(), w.dt_bias.len(), w.norm.len()];
        p.check_inputs(n, (qkv.n_rows, qkv.n_cols), (z.n_rows, z.n_cols), (ba.n_rows, ba.n_cols), lens, states.n_seqs, rows.n_seqs)?;
        ensure!(states.p == *p, "delta_net: recurrent state made for {:?}, the layer is {p:?}", states.p);
        if n == 0 {
            return self.new_act(0, p.n_v_heads * p.d_v);
        }
        let dev = self.device();
        // Windows 0..n_seqs of the pass: the leading part of the state buffers.
        let hist_len = rows.n_seqs * states.hist_len();
        // (n, channels)
        let mut mixed = dev.alloc_uninit::<f32>(n * p.conv_channels())?;
        let hv = states.hist.slice_mut(0..hist_len)?;
        conv(dev, qkv.f32("delta_net")?.view(), w.conv.view(), p.conv_kernel, hv, mixed.view_mut(), rows)?;
        let mut out = self.new_act(n, p.n_v_heads * p.d_v)?;
        let (zv, bav) = (z.f32("delta_net")?.view(), ba.f32("delta_net")?.view());
        let sv = states.ssm.slice_mut(0..rows.n_seqs * states.state_len())?;
        let kernel = self.delta_scan_for(p.d_k, p.d_v);
        scan_with(dev, kernel, mixed.view(), zv, bav, w, p, sv, out.f32_mut("delta_net")?.view_mut(), rows)?;
        Ok(out)
    }
}
