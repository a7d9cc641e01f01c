//! Typed launchers: one Rust function per kernel family, the only callers of
//! the raw launches. Each checks shapes, lengths and alignment first (an error
//! naming the op and the values), then launches on the device's stream
//! without waiting; `CudaDevice::synchronize` or a download surfaces
//! asynchronous errors.
//!
//! Kernel parameters are passed in the order of the `extern "C"` signatures in
//! `kernels/*.cu`: pointers as u64 device addresses, `int` as i32,
//! `long long` as i64, `float` as f32, `double` as f64.

use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use half::bf16;

use super::buffer::{DevView, DevViewMut, DeviceBuffer, Elem, QuantMatrix};
use super::device::CudaDevice;
use crate::artifact::format::TensorFormat;
use crate::kv::{ElemCodec, KvCodecs, KvFormat, RowCodec};

/// Element types a kernel can write as its activation output (f32 or bf16).
pub trait OutElem: Elem {}
impl OutElem for f32 {}
impl OutElem for bf16 {}

/// Matmul input element: bf16 selects the tensor-core route, f32 the FP32 route.
pub trait MatmulInput: Elem {}
impl MatmulInput for f32 {}
impl MatmulInput for bf16 {}

/// KV-cache element types (BF16 default, f32 for the FP32 route).
pub trait KvElem: Elem {}
impl KvElem for f32 {}
impl KvElem for bf16 {}

pub(super) fn i32_of(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| anyhow!("{what} = {v} does not fit the kernels' 32-bit index"))
}

pub(super) fn grid_1d(n: usize, block: u32) -> Result<u32> {
    u32::try_from(n.div_ceil(block as usize)).map_err(|_| anyhow!("{n} elements exceed one 1-D grid"))
}

/// The most blocks of a grid's y dimension (CUDA's limit).
pub(super) const GRID_Y_MAX: usize = 65535;

/// One launch of a kernel with a row (token) per `blockIdx.y`, over rows `row0..row0 + n_rows`
/// of the whole call: its position index `t % n_per_seq` (t counted from the slice's first row)
/// reads `pos[pos0..]`, so every row sees the position it has in the whole call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RowSlice {
    pub row0: usize,
    pub n_rows: usize,
    pub pos0: usize,
    pub n_per_seq: usize,
}

/// Slices of at most `max` rows covering `n_rows` rows made of whole windows of `n_per_seq`
/// positions (row t at position index t % n_per_seq): whole windows per slice while a window fits
/// (slices start at multiples of n_per_seq), else each window in parts (pos0 the part's offset,
/// n_per_seq its length). Kernels with a row per `blockIdx.y` run one launch per slice, so a pass
/// of more than 65535 rows (`--batch-tokens 65536`) launches, with every row's arithmetic unchanged.
pub(super) fn row_slices(n_rows: usize, n_per_seq: usize, max: usize) -> Vec<RowSlice> {
    debug_assert!(n_per_seq > 0 && max > 0 && n_rows % n_per_seq == 0);
    let mut out = Vec::new();
    if n_per_seq <= max {
        let step = max / n_per_seq * n_per_seq;
        for row0 in (0..n_rows).step_by(step) {
            out.push(RowSlice { row0, n_rows: step.min(n_rows - row0), pos0: 0, n_per_seq });
        }
    } else {
        for w0 in (0..n_rows).step_by(n_per_seq) {
            for s0 in (0..n_per_seq).step_by(max) {
                let n = max.min(n_per_seq - s0);
                out.push(RowSlice { row0: w0 + s0, n_rows: n, pos0: s0, n_per_seq: n });
            }
        }
    }
    out
}

pub(super) fn launch_err(name: &str, e: cudarc::driver::DriverError) -> anyhow::Error {
    anyhow!("launching CUDA kernel {name}: {e}")
}

pub(super) fn cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: smem }
}

pub(super) fn func<'a>(dev: &'a CudaDevice, name: &str) -> Result<&'a CudaFunction> {
    dev.function(name)
}

// ------------------------------------------------------------------ embedding

/// out[t, :] = dequant(table[ids[t], :]) * scale. ids: (n_tokens), out: (n_tokens, d_model).
/// Ids must be in [0, n_vocab) (checked by the caller on the host; the kernel
/// writes NaN rows for ids outside).
pub fn embed(dev: &CudaDevice, ids: DevView<i32>, table: &QuantMatrix, out: DevViewMut<f32>, scale: f32) -> Result<()> {
    let n_tokens = ids.len();
    let d_model = table.n_cols;
    ensure!(
        out.len() == n_tokens * d_model,
        "embed: out has {} elements, n_tokens * d_model = {n_tokens} * {d_model}",
        out.len()
    );
    if n_tokens == 0 {
        return Ok(());
    }
    let name = format!("embed_{}", table.kernel_suffix());
    let f = func(dev, &name)?;
    let (ip, tp, op) = (ids.ptr(), table.data.view().ptr(), out.ptr());
    let (n_vocab, d, rb) = (i32_of(table.n_rows, "n_vocab")?, i32_of(d_model, "d_model")?, table.row_bytes as i64);
    let mut b = dev.stream().launch_builder(f);
    b.arg(&ip).arg(&tp).arg(&op).arg(&n_vocab).arg(&d).arg(&rb).arg(&scale);
    // SAFETY: arguments match `embed_<fmt>` in kernels/embed.cu; out holds n_tokens * d_model
    // f32 (checked), table holds n_vocab rows of row_bytes (QuantMatrix invariant, d_model % 32 == 0).
    unsafe { b.launch(cfg((n_tokens as u32, 1, 1), 128, 0)) }.map_err(|e| launch_err(&name, e))?;
    Ok(())
}

// ------------------------------------------------------------------ RMSNorm

/// Row layout of a strided 2-D activation: n_rows rows of n_cols, `stride` elements apart.
#[derive(Debug, Clone, Copy)]
pub struct Rows {
    pub n_rows: usize,
    pub n_cols: usize,
    pub stride: usize,
}

impl Rows {
    pub fn contiguous(n_rows: usize, n_cols: usize) -> Self {
        Self { n_rows, n_cols, stride: n_cols }
    }
    /// Elements a buffer must hold for this layout.
    pub fn span(&self) -> usize {
        if self.n_rows == 0 {
            0
        } else {
            (self.n_rows - 1) * self.stride + self.n_cols
        }
    }
    fn check(&self, len: usize, op: &str, what: &str) -> Result<()> {
        ensure!(self.stride >= self.n_cols, "{op}: {what} row stride {} < n_cols {}", self.stride, self.n_cols);
        ensure!(
            len >= self.span(),
            "{op}: {what} has {len} elements, ({} rows - 1) * stride {} + {} cols need {}",
            self.n_rows,
            self.stride,
            self.n_cols,
            self.span()
        );
        Ok(())
    }
}

/// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w. Rows of d_model for the
/// layer norms, rows of d_head (n_rows = n_tokens * n_heads) for the QK norm.
pub fn rmsnorm<O: OutElem>(
    dev: &CudaDevice,
    x: DevView<f32>,
    x_rows: Rows,
    w: DevView<f32>,
    out: DevViewMut<O>,
    out_stride: usize,
    eps: f32,
) -> Result<()> {
    rmsnorm_raw::<O>(dev, x.ptr(), x.len(), x_rows, w, out.ptr(), out.len(), out_stride, eps)
}

/// The same norm of contiguous rows written twice: `out` f32 and `out_bf16` its
/// bf16 rounding (round to nearest even), both (rows.n_rows, rows.n_cols)
/// contiguous: the default route's norm, read by a residual add (f32) or by
/// matmuls (bf16) without a separate cast.
pub fn rmsnorm_dual(dev: &CudaDevice, x: DevView<f32>, rows: Rows, w: DevView<f32>, out: DevViewMut<f32>, out_bf16: DevViewMut<bf16>, eps: f32) -> Result<()> {
    rows.check(x.len(), "rmsnorm_dual", "x")?;
    check_norm_dual("rmsnorm_dual", rows, w.len(), out.len(), out_bf16.len())?;
    if rows.n_rows == 0 {
        return Ok(());
    }
    let f = func(dev, "rmsnorm_dual")?;
    let (xp, wp, op, bp) = (x.ptr(), w.ptr(), out.ptr(), out_bf16.ptr());
    let (n_cols, xs, os) = (i32_of(rows.n_cols, "n_cols")?, rows.stride as i64, rows.n_cols as i64);
    let grid = u32::try_from(rows.n_rows).map_err(|_| anyhow!("rmsnorm_dual: {} rows", rows.n_rows))?;
    let mut b = dev.stream().launch_builder(f);
    b.arg(&xp).arg(&wp).arg(&op).arg(&bp).arg(&n_cols).arg(&xs).arg(&os).arg(&eps);
    // SAFETY: arguments match `rmsnorm_dual` in kernels/norm.cu; x's layout and both outputs'
    // lengths (contiguous rows) checked.
    unsafe { b.launch(cfg((grid, 1, 1), 128, 0)) }.map_err(|e| launch_err("rmsnorm_dual", e))?;
    Ok(())
}

/// The dual norms' outputs (f32 and bf16, contiguous rows) and weight against `rows`.
fn check_norm_dual(op: &str, rows: Rows, n_w: usize, n_out: usize, n_out_bf16: usize) -> Result<()> {
    let n = rows.n_rows * rows.n_cols;
    ensure!(
        n_out == n && n_out_bf16 == n,
        "{op}: outputs of {n_out} and {n_out_bf16} elements for {} rows of {}",
        rows.n_rows,
        rows.n_cols
    );
    ensure!(n_w == rows.n_cols, "{op}: weight has {n_w} elements, rows have {}", rows.n_cols);
    Ok(())
}

/// x += y (in place, add_f32's rounding), then `rmsnorm_dual` of the new x into
/// `out` and `out_bf16`, in one pass: the bits of `add_inplace` then
/// `rmsnorm_dual`. x, y, out and out_bf16: (rows.n_rows, rows.n_cols) contiguous.
#[allow(clippy::too_many_arguments)]
pub fn add_rmsnorm_dual(
    dev: &CudaDevice,
    x: DevViewMut<f32>,
    y: DevView<f32>,
    rows: Rows,
    w: DevView<f32>,
    out: DevViewMut<f32>,
    out_bf16: DevViewMut<bf16>,
    eps: f32,
) -> Result<()> {
    let n = rows.n_rows * rows.n_cols;
    ensure!(rows.stride == rows.n_cols, "add_rmsnorm_dual: rows of {} with stride {} (contiguous only)", rows.n_cols, rows.stride);
    ensure!(x.len() == n && y.len() == n, "add_rmsnorm_dual: x {} and y {} elements for {} rows of {}", x.len(), y.len(), rows.n_rows, rows.n_cols);
    check_norm_dual("add_rmsnorm_dual", rows, w.len(), out.len(), out_bf16.len())?;
    if rows.n_rows == 0 {
        return Ok(());
    }
    let f = func(dev, "add_rmsnorm_dual")?;
    let (xp, yp, wp, op, bp) = (x.ptr(), y.ptr(), w.ptr(), out.ptr(), out_bf16.ptr());
    let (n_cols, st) = (i32_of(rows.n_cols, "n_cols")?, rows.n_cols as i64);
    let grid = u32::try_from(rows.n_rows).map_err(|_| anyhow!("add_rmsnorm_dual: {} rows", rows.n_rows))?;
    let mut b = dev.stream().launch_builder(f);
    b.arg(&xp).arg(&yp).arg(&wp).arg(&op).arg(&bp).arg(&n_cols).arg(&st).arg(&eps);
    // SAFETY: arguments match `add_rmsnorm_dual` in kernels/norm.cu; all four buffers hold
    // n_rows * n_cols contiguous elements (checked).
    unsafe { b.launch(cfg((grid, 1, 1), 128, 0)) }.map_err(|e| launch_err("add_rmsnorm_dual", e))?;
    Ok(())
}

/// RMSNorm in place on f32 rows.
pub fn rmsnorm_inplace(dev: &CudaDevice, x: DevViewMut<f32>, rows: Rows, w: DevView<f32>, eps: f32) -> Result<()> {
    rmsnorm_raw::<f32>(dev, x.ptr(), x.len(), rows, w, x.ptr(), x.len(), rows.stride, eps)
}

#[allow(clippy::too_many_arguments)]
fn rmsnorm_raw<O: OutElem>(
    dev: &CudaDevice,
    xp: u64,
    x_len: usize,
    rows: Rows,
    w: DevView<f32>,
    op: u64,
    out_len: usize,
    out_stride: usize,
    eps: f32,
) -> Result<()> {
    rows.check(x_len, "rmsnorm", "x")?;
    Rows { stride: out_stride, ..rows }.check(out_len, "rmsnorm", "out")?;
    ensure!(w.len() == rows.n_cols, "rmsnorm: weight has {} elements, rows have {}", w.len(), rows.n_cols);
    if rows.n_rows == 0 {
        return Ok(());
    }
    let name = format!("rmsnorm_{}", O::NAME);
    let f = func(dev, &name)?;
    let wp = w.ptr();
    let (n_cols, xs, os) = (i32_of(rows.n_cols, "n_cols")?, rows.stride as i64, out_stride as i64);
    let grid = u32::try_from(rows.n_rows).map_err(|_| anyhow!("rmsnorm: {} rows", rows.n_rows))?;
    let mut b = dev.stream().launch_builder(f);
    b.arg(&xp).arg(&wp).arg(&op).arg(&n_cols).arg(&xs).arg(&os).arg(&eps);
    // SAFETY: arguments match `rmsnorm_<out>` in kernels/norm.cu; both layouts checked against the lengths.
    unsafe { b.launch(cfg((grid, 1, 1), 128, 0)) }.map_err(|e| launch_err(&name, e))?;
    Ok(())
}

// ------------------------------------------------------------------ RoPE

/// Which dimensions RoPE pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// (2i, 2i+1): llama in GGUF layout.
    Normal,
    /// (i, i + n_rot/2): gemma, GPT-NeoX.
    Neox,
}

/// RoPE parameters of one call (gemma3's local and global layers differ in `freq_base`).
#[derive(Debug, Clone, Copy)]
pub struct RopeParams {
    pub n_heads: usize,
    pub d_head: usize,
    /// Rotated dimensions (<= d_head, even).
    pub n_rot: usize,
    pub mode: RopeMode,
    pub freq_base: f64,
    /// Linear position scaling: angle uses pos * freq_scale (1 = none).
    pub freq_scale: f64,
    /// YaRN, as `crate::backend::Yarn` defines it; `None`: native RoPE.
    pub yarn: Option<crate::backend::Yarn>,
}

/// Rotates x in place. x: (n_tokens, token_stride) with heads of d_head
/// contiguous; row t is at position pos[t % pos.len()] (a batched pass: n_tokens
/// / pos.len() windows at the same positions).
pub fn rope(dev: &CudaDevice, x: DevViewMut<f32>, token_stride: usize, n_tokens: usize, pos: DevView<i32>, p: &RopeParams) -> Result<()> {
    let n_per_seq = pos.len();
    ensure!(
        n_per_seq > 0 && n_tokens % n_per_seq == 0,
        "rope: {n_tokens} rows are not whole windows of {n_per_seq} positions"
    );
    ensure!(p.n_rot % 2 == 0 && p.n_rot <= p.d_head && p.n_rot > 0, "rope: n_rot {} with d_head {}", p.n_rot, p.d_head);
    Rows { n_rows: n_tokens, n_cols: p.n_heads * p.d_head, stride: token_stride }.check(x.len(), "rope", "x")?;
    ensure!(p.freq_base > 0.0 && p.freq_scale > 0.0, "rope: base {} scale {}", p.freq_base, p.freq_scale);
    if n_tokens == 0 {
        return Ok(());
    }
    let f = func(dev, "rope_f32")?;
    i32_of(n_per_seq, "positions")?;
    let (xp, pp) = (x.ptr(), pos.ptr());
    let (nh, dh, nr) = (i32_of(p.n_heads, "n_heads")?, i32_of(p.d_head, "d_head")?, i32_of(p.n_rot, "n_rot")?);
    let ts = token_stride as i64;
    let mode = rope_mode_arg(p.mode);
    let gx = grid_1d(p.n_heads * p.n_rot / 2, 128)?;
    let (yf, yl, yh, ya) = yarn_args(p)?;
    for sl in row_slices(n_tokens, n_per_seq, GRID_Y_MAX) {
        let (xs, ps, nps) = (xp + (sl.row0 * token_stride * 4) as u64, pp + (sl.pos0 * 4) as u64, sl.n_per_seq as i32);
        let mut b = dev.stream().launch_builder(f);
        b.arg(&xs).arg(&ps).arg(&nps).arg(&nh).arg(&dh).arg(&nr).arg(&ts).arg(&mode).arg(&p.freq_base).arg(&p.freq_scale);
        b.arg(&yf).arg(&yl).arg(&yh).arg(&ya);
        // SAFETY: arguments match `rope_f32` in kernels/rope.cu; x covers n_tokens rows of n_heads * d_head,
        // the slice's rows lie within them and its positions within pos (row_slices).
        unsafe { b.launch(cfg((gx, sl.n_rows as u32, 1), 128, 0)) }.map_err(|e| launch_err("rope_f32", e))?;
    }
    Ok(())
}

/// The (cos, sin) table of `rope_tabled` for `p`'s frequencies: (n_pos, n_rot/2)
/// pairs, interleaved, for positions 0..n_pos; the same f64 expression as
/// `rope`, rounded to f32 as it rounds. `table` must hold n_pos * n_rot f32.
pub fn rope_table(dev: &CudaDevice, table: DevViewMut<f32>, n_pos: usize, p: &RopeParams) -> Result<()> {
    ensure!(p.n_rot % 2 == 0 && p.n_rot > 0, "rope_table: n_rot {}", p.n_rot);
    ensure!(table.len() == n_pos * p.n_rot, "rope_table: table has {} f32, n_pos * n_rot = {n_pos} * {}", table.len(), p.n_rot);
    ensure!(p.freq_base > 0.0 && p.freq_scale > 0.0, "rope_table: base {} scale {}", p.freq_base, p.freq_scale);
    i32_of(n_pos, "rope_table positions")?;
    if n_pos == 0 {
        return Ok(());
    }
    let (yf, yl, yh, ya) = yarn_args(p)?;
    let f = func(dev, "rope_table_f32")?;
    let (tp, nr) = (table.ptr(), i32_of(p.n_rot, "n_rot")?);
    let gy = grid_1d(p.n_rot / 2, 128)?;
    let mut b = dev.stream().launch_builder(f);
    b.arg(&tp).arg(&nr).arg(&p.freq_base).arg(&p.freq_scale).arg(&yf).arg(&yl).arg(&yh).arg(&ya);
    // SAFETY: arguments match `rope_table_f32` in kernels/rope.cu; table holds n_pos * n_rot/2 float2 (checked).
    unsafe { b.launch(cfg((n_pos as u32, gy, 1), 128, 0)) }.map_err(|e| launch_err("rope_table_f32", e))?;
    Ok(())
}

/// `rope` with (cos, sin) read from `table`, built by [`rope_table`] for the same
/// `p` (n_rot, base, scale, YaRN) over at least `max_pos + 1` positions, where
/// `max_pos` is the largest of `pos` (the caller knows it: positions are a range).
/// The same bits as `rope`.
#[allow(clippy::too_many_arguments)]
pub fn rope_tabled(
    dev: &CudaDevice,
    x: DevViewMut<f32>,
    token_stride: usize,
    n_tokens: usize,
    pos: DevView<i32>,
    max_pos: usize,
    table: DevView<f32>,
    p: &RopeParams,
) -> Result<()> {
    let n_per_seq = pos.len();
    ensure!(
        n_per_seq > 0 && n_tokens % n_per_seq == 0,
        "rope: {n_tokens} rows are not whole windows of {n_per_seq} positions"
    );
    ensure!(p.n_rot % 2 == 0 && p.n_rot <= p.d_head && p.n_rot > 0, "rope: n_rot {} with d_head {}", p.n_rot, p.d_head);
    Rows { n_rows: n_tokens, n_cols: p.n_heads * p.d_head, stride: token_stride }.check(x.len(), "rope", "x")?;
    ensure!(
        table.len() % p.n_rot == 0 && table.len() / p.n_rot > max_pos,
        "rope: the (cos, sin) table covers {} positions of {} pairs, position {max_pos} is needed",
        table.len() / p.n_rot,
        p.n_rot / 2
    );
    if n_tokens == 0 {
        return Ok(());
    }
    let f = func(dev, "rope_tabled_f32")?;
    i32_of(n_per_seq, "positions")?;
    let (xp, pp, tp) = (x.ptr(), pos.ptr(), table.ptr());
    let (nh, dh, nr) = (i32_of(p.n_heads, "n_heads")?, i32_of(p.d_head, "d_head")?, i32_of(p.n_rot, "n_rot")?);
    let ts = token_stride as i64;
    let mode = rope_mode_arg(p.mode);
    let gx = grid_1d(p.n_heads * p.n_rot / 2, 128)?;
    for sl in row_slices(n_tokens, n_per_seq, GRID_Y_MAX) {
        let (xs, ps, nps) = (xp + (sl.row0 * token_stride * 4) as u64, pp + (sl.pos0 * 4) as u64, sl.n_per_seq as i32);
        let mut b = dev.stream().launch_builder(f);
        b.arg(&xs).arg(&ps).arg(&nps).arg(&nh).arg(&dh).arg(&nr).arg(&ts).arg(&mode).arg(&tp);
        // SAFETY: arguments match `rope_tabled_f32` in kernels/rope.cu; x covers n_tokens rows of
        // n_heads * d_head, the slice's rows lie within them and its positions within pos (row_slices);
        // the table covers every position up to max_pos (checked; pos holds a range the caller
        // bounded by max_pos).
        unsafe { b.launch(cfg((gx, sl.n_rows as u32, 1), 128, 0)) }.map_err(|e| launch_err("rope_tabled_f32", e))?;
    }
    Ok(())
}

fn rope_mode_arg(mode: RopeMode) -> i32 {
    match mode {
        RopeMode::Normal => 0,
        RopeMode::Neox => 2,
    }
}

/// (factor, ramp low, ramp high, attention factor) for the kernels; native RoPE:
/// factor 1 (the kernels' unchanged expression), attention factor 1.
fn yarn_args(p: &RopeParams) -> Result<(f64, f64, f64, f64)> {
    let (yf, yl, yh, ya) = p.yarn.map_or((1.0, 0.0, 1.0, 1.0), |y| (y.factor, y.ramp_low, y.ramp_high, y.attn_factor));
    ensure!(yf >= 1.0 && yh > yl, "rope: YaRN factor {yf}, ramp {yl}..{yh}");
    Ok((yf, yl, yh, ya))
}

// ------------------------------------------------------------------ activations, residual, cast

/// The gate nonlinearity of a gated FFN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// tanh approximation (gemma's gelu_pytorch_tanh).
    GeluTanh,
}

/// out = act(gate) * up, row by row (gate, up and out with their own strides).
pub fn gated<O: OutElem>(
    dev: &CudaDevice,
    act: Activation,
    gate: DevView<f32>,
    gate_rows: Rows,
    up: DevView<f32>,
    up_stride: usize,
    out: DevViewMut<O>,
    out_stride: usize,
) -> Result<()> {
    gate_rows.check(gate.len(), "gated", "gate")?;
    Rows { stride: up_stride, ..gate_rows }.check(up.len(), "gated", "up")?;
    Rows { stride: out_stride, ..gate_rows }.check(out.len(), "gated", "out")?;
    if gate_rows.n_rows == 0 {
        return Ok(());
    }
    let name = format!(
        "gated_{}_{}",
        match act {
            Activation::Silu => "silu",
            Activation::GeluTanh => "gelu",
        },
        O::NAME
    );
    let f = func(dev, &name)?;
    let (gp, upp, op) = (gate.ptr(), up.ptr(), out.ptr());
    let n_cols = i32_of(gate_rows.n_cols, "n_cols")?;
    let (gs, us, os) = (gate_rows.stride as i64, up_stride as i64, out_stride as i64);
    let gx = grid_1d(gate_rows.n_cols, 256)?;
    for sl in row_slices(gate_rows.n_rows, 1, GRID_Y_MAX) {
        let r0 = sl.row0 as u64;
        let (gs0, us0) = (gp + r0 * gate_rows.stride as u64 * 4, upp + r0 * up_stride as u64 * 4);
        let os0 = op + r0 * out_stride as u64 * std::mem::size_of::<O>() as u64;
        let mut b = dev.stream().launch_builder(f);
        b.arg(&gs0).arg(&us0).arg(&os0).arg(&n_cols).arg(&gs).arg(&us).arg(&os);
        // SAFETY: arguments match `gated_<act>_<out>` in kernels/elementwise.cu; three layouts checked,
        // the slice's rows lie within them (row_slices).
        unsafe { b.launch(cfg((gx, sl.n_rows as u32, 1), 256, 0)) }.map_err(|e| launch_err(&name, e))?;
    }
    Ok(())
}

/// y += x (same length), the residual add.
pub fn add_inplace(dev: &CudaDevice, y: DevViewMut<f32>, x: DevView<f32>) -> Result<()> {
    ensure!(y.len() == x.len(), "add: y has {} elements, x {}", y.len(), x.len());
    if y.is_empty() {
        return Ok(());
    }
    let f = func(dev, "add_f32")?;
    let (yp, xp, n) = (y.ptr(), x.ptr(), y.len() as i64);
    let mut b = dev.stream().launch_builder(f);
    b.arg(&yp).arg(&xp).arg(&n);
    // SAFETY: arguments match `add_f32` in kernels/elementwise.cu; both views hold n elements.
    unsafe { b.launch(cfg((grid_1d(y.len(), 256)?, 1, 1), 256, 0)) }.map_err(|e| launch_err("add_f32", e))?;
    Ok(())
}

/// out = bf16(x), round to nearest even.
pub fn cast_bf16(dev: &CudaDevice, x: DevView<f32>, out: DevViewMut<bf16>) -> Result<()> {
    ensure!(out.len() == x.len(), "cast_bf16: out has {} elements, x {}", out.len(), x.len());
    if x.is_empty() {
        return Ok(());
    }
    let f = func(dev, "cast_bf16")?;
    let (xp, op, n) = (x.ptr(), out.ptr(), x.len() as i64);
    let mut b = dev.stream().launch_builder(f);
    b.arg(&xp).arg(&op).arg(&n);
    // SAFETY: arguments match `cast_bf16` in kernels/elementwise.cu; both views hold n elements.
    unsafe { b.launch(cfg((grid_1d(x.len(), 256)?, 1, 1), 256, 0)) }.map_err(|e| launch_err("cast_bf16", e))?;
    Ok(())
}

/// x[r, c] += b[c] for every row of x (n_rows, b.len()) contiguous.
pub fn add_bias(dev: &CudaDevice, x: DevViewMut<f32>, b: DevView<f32>) -> Result<()> {
    ensure!(!b.is_empty() && x.len() % b.len() == 0, "add_bias: x has {} elements, not whole rows of the bias's {}", x.len(), b.len());
    if x.is_empty() {
        return Ok(());
    }
    let f = func(dev, "add_bias_f32")?;
    let (xp, bp, nc, n) = (x.ptr(), b.ptr(), i32_of(b.len(), "n_cols")?, x.len() as i64);
    let mut l = dev.stream().launch_builder(f);
    l.arg(&xp).arg(&bp).arg(&nc).arg(&n);
    // SAFETY: arguments match `add_bias_f32` in kernels/elementwise.cu; x holds whole rows of b.len().
    unsafe { l.launch(cfg((grid_1d(x.len(), 256)?, 1, 1), 256, 0)) }.map_err(|e| launch_err("add_bias_f32", e))?;
    Ok(())
}

/// x = cap * tanh(x / cap), in place.
pub fn softcap(dev: &CudaDevice, x: DevViewMut<f32>, cap: f32) -> Result<()> {
    ensure!(cap > 0.0 && cap.is_finite(), "softcap: cap {cap} is not a positive number");
    if x.is_empty() {
        return Ok(());
    }
    let f = func(dev, "softcap_f32")?;
    let (xp, n) = (x.ptr(), x.len() as i64);
    let mut l = dev.stream().launch_builder(f);
    l.arg(&xp).arg(&n).arg(&cap);
    // SAFETY: arguments match `softcap_f32` in kernels/elementwise.cu; x holds n elements.
    unsafe { l.launch(cfg((grid_1d(x.len(), 256)?, 1, 1), 256, 0)) }.map_err(|e| launch_err("softcap_f32", e))?;
    Ok(())
}

/// out[r, :] = x[rows[r], :]. x: (n_x_rows, n_cols); rows: (n) device ids,
/// each < n_x_rows (checked by the caller on the host); out: (n, n_cols).
pub fn gather_rows(dev: &CudaDevice, x: DevView<f32>, n_cols: usize, rows: DevView<i32>, out: DevViewMut<f32>) -> Result<()> {
    ensure!(n_cols > 0 && x.len() % n_cols == 0, "gather_rows: x has {} elements, not rows of {n_cols}", x.len());
    ensure!(out.len() == rows.len() * n_cols, "gather_rows: out has {} elements for {} rows of {n_cols}", out.len(), rows.len());
    if out.is_empty() {
        return Ok(());
    }
    let f = func(dev, "gather_rows_f32")?;
    let (xp, rp, op, nc, n) = (x.ptr(), rows.ptr(), out.ptr(), i32_of(n_cols, "n_cols")?, out.len() as i64);
    let mut l = dev.stream().launch_builder(f);
    l.arg(&xp).arg(&rp).arg(&op).arg(&nc).arg(&n);
    // SAFETY: arguments match `gather_rows_f32` in kernels/elementwise.cu; out holds rows * n_cols,
    // every row id is below x's row count (caller's contract, checked on the host).
    unsafe { l.launch(cfg((grid_1d(out.len(), 256)?, 1, 1), 256, 0)) }.map_err(|e| launch_err("gather_rows_f32", e))?;
    Ok(())
}

/// out[i] = x[rows[i] * ld + cols[i]]: listed logits out of a (n_rows, ld)
/// tile; rows[i] < n_rows and cols[i] < ld (checked by the caller on the host).
pub fn gather_pairs(dev: &CudaDevice, x: DevView<f32>, ld: usize, rows: DevView<i32>, cols: DevView<i32>, out: DevViewMut<f32>) -> Result<()> {
    ensure!(rows.len() == cols.len() && out.len() == rows.len(), "gather_pairs: {} rows, {} cols, {} outputs", rows.len(), cols.len(), out.len());
    if out.is_empty() {
        return Ok(());
    }
    let f = func(dev, "gather_pairs_f32")?;
    let (xp, rp, cp, op, ldi, n) = (x.ptr(), rows.ptr(), cols.ptr(), out.ptr(), ld as i64, i32_of(out.len(), "n")?);
    let mut l = dev.stream().launch_builder(f);
    l.arg(&xp).arg(&ldi).arg(&rp).arg(&cp).arg(&op).arg(&n);
    // SAFETY: arguments match `gather_pairs_f32` in kernels/elementwise.cu; the (row, col) pairs
    // lie inside x (caller's contract, checked on the host).
    unsafe { l.launch(cfg((grid_1d(out.len(), 256)?, 1, 1), 256, 0)) }.map_err(|e| launch_err("gather_pairs_f32", e))?;
    Ok(())
}

// ------------------------------------------------------------------ matmul

/// The kernel that multiplies a bf16 matmul (the default route).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKernel {
    /// `matmul_bf16_<fmt>` (kernels/matmul.cu): mma.sync 64x64x32, W dequantized in the loader.
    MmaSync,
    /// `dequant_bf16_<fmt>` into a bf16 scratch (none for stored BF16), then
    /// `gemm_bf16_wgmma` (kernels/gemm_sm90a.cu): wgmma 128x256x64, TMA, 4-stage mbarrier pipeline.
    Wgmma,
}

impl MatmulKernel {
    pub fn name(self) -> &'static str {
        match self {
            Self::MmaSync => "mma.sync",
            Self::Wgmma => "wgmma",
        }
    }
}

/// Name of the wgmma GEMM kernel (loaded on compute capability 9.0 only).
pub const GEMM_WGMMA_KERNEL: &str = "gemm_bf16_wgmma";
/// Smallest M and N sent to the wgmma kernel; smaller products keep mma.sync,
/// whose 64 x 64 tiles fill the GPU there. Below these a 128 x 256 tile is mostly padding.
pub const GEMM_WGMMA_MIN_M: usize = 128;
pub const GEMM_WGMMA_MIN_N: usize = 128;

// Tile and pipeline of gemm_bf16_wgmma (kernels/common.cuh GEMM_*).
pub(super) const GEMM_BM: usize = 128;
pub(super) const GEMM_BN: usize = 256;
const GEMM_BK: usize = 64;
const GEMM_STAGES: usize = 4;
pub(super) const GEMM_THREADS: u32 = 384;
/// Stages of (A 128x64 + B 256x64) bf16, the 2 x GEMM_STAGES mbarriers, and 1 KiB
/// of slack for the kernel's 1024-byte alignment of the swizzled tiles.
pub(super) const GEMM_SMEM_BYTES: usize = GEMM_STAGES * (GEMM_BM + GEMM_BN) * GEMM_BK * 2 + 2 * GEMM_STAGES * 8 + 1024;
/// gemm_bf16_wgmma and the gated GEMMs (kernels/gemm_sm90a.cu GEMM_EPI_*): the
/// stages, a 1 KiB block for the mbarriers, then the epilogue's 16 KiB shared buffer
/// per consumer warpgroup, plus the 1 KiB of alignment slack.
const GEMM_EPI_SMEM_BYTES: usize = 1024 + GEMM_STAGES * (GEMM_BM + GEMM_BN) * GEMM_BK * 2 + 1024 + 2 * 16384;

/// How the wgmma GEMMs' epilogue writes the output tile (the same values either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmEpilogue {
    /// Each consumer thread stores its accumulators to global memory (the
    /// residual add reads y first), the tensor cores idle meanwhile.
    Direct,
    /// Through a 128-byte-swizzled shared buffer and TMA stores (the residual
    /// add as a TMA f32 reduce-add): the consumers go back to the next tile's
    /// MMAs while the copies drain. Needs a 16-byte-aligned output with rows
    /// of a multiple of 16 bytes; `Direct` otherwise.
    TmaStore,
}

/// Whether a GEMM output at `ptr` with rows `ld_bytes` apart, each `row_bytes`
/// written, takes the TMA-store epilogue: 16-byte aligned base and row stride, and
/// rows of a multiple of 16 bytes (the TMA store does not clip a box at a row end
/// inside a 16-byte unit: on the H200 an f32 output of N = 513 with ldy = 516 had
/// its row gap written); `GemmEpilogue::Direct` otherwise.
pub fn gemm_tma_store_fits(ptr: u64, ld_bytes: usize, row_bytes: usize) -> bool {
    ptr % 16 == 0 && ld_bytes % 16 == 0 && row_bytes % 16 == 0
}

/// The default route's wgmma epilogues (the same output bits whichever; for timing
/// comparisons): `INFERNIX_GEMM_EPILOGUE=direct` every GEMM `Direct`, `tma` every
/// GEMM `TmaStore`, `tma-gated` the gated GEMM `TmaStore` and the f32 ones `Direct`;
/// unset, `GEMM_EPILOGUE_DEFAULT` (f32 output) and `GEMM_GATED_EPILOGUE_DEFAULT`.
pub const GEMM_EPILOGUE_ENV: &str = "INFERNIX_GEMM_EPILOGUE";
/// The f32-output GEMMs' default epilogue: TMA stores, 1-4 % faster than direct
/// stores on the 8B shapes and 10-33 % with the residual add (benches/gemm.rs,
/// docs/performance.md "Issue 12: GEMM epilogue overlap").
const GEMM_EPILOGUE_DEFAULT: GemmEpilogue = GemmEpilogue::TmaStore;
/// The gated GEMM's default epilogue: direct stores, since its TMA epilogue measured
/// 6-11 % slower on the 8B gate/up shape (same bench).
const GEMM_GATED_EPILOGUE_DEFAULT: GemmEpilogue = GemmEpilogue::Direct;

impl GemmEpilogue {
    /// The epilogue of the f32-output GEMMs (`GEMM_EPILOGUE_ENV`).
    pub fn from_env() -> Self {
        match std::env::var(GEMM_EPILOGUE_ENV).as_deref() {
            Ok("direct" | "tma-gated") => Self::Direct,
            Ok("tma") => Self::TmaStore,
            _ => GEMM_EPILOGUE_DEFAULT,
        }
    }
    /// The epilogue of the gated GEMM (`GEMM_EPILOGUE_ENV`).
    pub fn gated_from_env() -> Self {
        match std::env::var(GEMM_EPILOGUE_ENV).as_deref() {
            Ok("direct") => Self::Direct,
            Ok("tma" | "tma-gated") => Self::TmaStore,
            _ => GEMM_GATED_EPILOGUE_DEFAULT,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct stores",
            Self::TmaStore => "TMA stores",
        }
    }
}

/// Where the wgmma GEMMs expand a block-quantized weight to bf16 (the same bf16
/// operands, so the same output bits, either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmDequant {
    /// `dequant_bf16_<fmt>` writes the whole weight to a bf16 scratch in device
    /// memory, then the GEMM's TMA reads it (every format; the default).
    Scratch,
    /// The GEMM's producer warpgroup reads the stored blocks (TMA) and writes the
    /// swizzled bf16 B tile itself (`gemm_q4_0_wgmma*`, kernels/gemm_sm90a.cu): no
    /// scratch. Q4_0 weights where `gemm_producer_dequant_fits`; `Scratch` otherwise.
    Producer,
}

/// `INFERNIX_GEMM_DEQUANT=producer` picks `GemmDequant::Producer` for the default
/// route's wgmma GEMMs; unset or anything else, `GemmDequant::Scratch`. Off by
/// default: written without a device run of its own (docs/performance.md, gemm6).
pub const GEMM_DEQUANT_ENV: &str = "INFERNIX_GEMM_DEQUANT";

/// Name of the producer-dequant Q4_0 GEMM (kernels/gemm_sm90a.cu).
pub const GEMM_Q4_0_KERNEL: &str = "gemm_q4_0_wgmma";

impl GemmDequant {
    pub fn from_env() -> Self {
        match std::env::var(GEMM_DEQUANT_ENV).as_deref() {
            Ok("producer") => Self::Producer,
            _ => Self::Scratch,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::Scratch => "bf16 scratch (dequant_bf16 per matmul)",
            Self::Producer => "in the GEMM's producer warpgroup for Q4_0 (K % 256 == 0), else a bf16 scratch",
        }
    }
}

/// Whether the producer-dequant kernels take `w`: Q4_0 with K % 256 == 0 (rows of a
/// multiple of 16 bytes, as the tensor map over the stored blocks needs) at a
/// 16-byte-aligned address, on a device that has them.
pub fn gemm_producer_dequant_fits(dev: &CudaDevice, w: &QuantMatrix) -> bool {
    w.format == TensorFormat::Q4_0
        && w.n_cols % 256 == 0
        && w.row_bytes % 16 == 0
        && w.data.view().ptr() % 16 == 0
        && dev.has_function(GEMM_Q4_0_KERNEL)
}

/// The producer-dequant kernels' dynamic shared memory (kernels/sm90a.cuh
/// GEMM_RAW_*): the stages, the 1 KiB mbarrier block, two 12 KiB raw buffers (256
/// rows x 48 bytes of stored Q4_0 blocks), the 1 KiB alignment slack; no epilogue
/// buffers (direct stores only).
const GEMM_RAW_SMEM_BYTES: usize = 1024 + GEMM_STAGES * (GEMM_BM + GEMM_BN) * GEMM_BK * 2 + 1024 + 2 * 12288;

/// A tensor map over the stored blocks of a Q4_0 `w` for the producer-dequant
/// kernels: uint8 (row_bytes, n_rows), boxes of 48 bytes x 128 rows, no swizzle.
fn tensor_map_q4_0_raw(w: &QuantMatrix) -> Result<cudarc::driver::sys::CUtensorMap> {
    let ptr = w.data.view().ptr();
    ensure!(ptr % 16 == 0 && w.row_bytes % 16 == 0, "Q4_0 tensor map: base {ptr:#x} or row of {} bytes not 16-byte aligned", w.row_bytes);
    encode_map(TmaElem::U8, false, ptr, [w.row_bytes as u64, w.n_rows as u64], [w.row_bytes as u64], [48, (GEMM_BN / 2) as u32])
        .with_context(|| format!("tensor map of {} x {} Q4_0 blocks", w.n_rows, w.row_bytes))
}

/// `GemmParams` of kernels/common.cuh (gemm_bf16_wgmma's one `__grid_constant__` parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct GemmParams {
    /// x: (M, K) bf16, box (64, 128).
    a: cudarc::driver::sys::CUtensorMap,
    /// W: (N, K) bf16, box (64, 256).
    b: cudarc::driver::sys::CUtensorMap,
    /// y: (M, N) f32 with row stride ldy, box (32, 64) (store_tma only; else zeros).
    y_map: cudarc::driver::sys::CUtensorMap,
    y: u64,
    ldy: i64,
    m: i32,
    n: i32,
    k: i32,
    /// 1 when ldy is even and y 8-byte aligned: column pairs stored as float2.
    y_pairs: i32,
    /// 1: y += x · Wᵀ (the residual add in the epilogue); 0: y = x · Wᵀ.
    accumulate: i32,
    /// 1: the epilogue through shared memory and TMA stores (GemmEpilogue::TmaStore).
    store_tma: i32,
    /// RoPE in the epilogue ([`GemmRope`]; rope_n_rot 0: none): the (n_pos, n_rot/2)
    /// (cos, sin) table and the (rope_n_per_seq) positions.
    rope_table: u64,
    rope_pos: u64,
    rope_n_per_seq: i32,
    rope_d_head: i32,
    rope_n_rot: i32,
    /// 0 normal, 2 neox (rope_mode_arg).
    rope_mode: i32,
}
const _: () = assert!(size_of::<GemmParams>() == 512 && align_of::<GemmParams>() == 128);
// SAFETY: plain data with the layout of the CUDA struct (asserted above); passed by value.
unsafe impl cudarc::driver::DeviceRepr for GemmParams {}

/// `GemmLmParams` of kernels/common.cuh (gemm_bf16_wgmma_lmhead's one parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct GemmLmParams {
    /// h: (M, K) bf16, box (64, 128).
    a: cudarc::driver::sys::CUtensorMap,
    /// The head: (N = n_vocab, K) bf16, box (64, 256).
    b: cudarc::driver::sys::CUtensorMap,
    /// (M, n_parts) (max, sum of exp) pairs, f32 each.
    part: u64,
    /// (M) token ids.
    targets: u64,
    /// (M) f32.
    target_logit: u64,
    m: i32,
    n: i32,
    k: i32,
    n_parts: i32,
}
const _: () = assert!(size_of::<GemmLmParams>() == 384 && align_of::<GemmLmParams>() == 128);
// SAFETY: plain data with the layout of the CUDA struct (asserted above); passed by value.
unsafe impl cudarc::driver::DeviceRepr for GemmLmParams {}

/// `GemmGatedParams` of kernels/common.cuh (gemm_bf16_wgmma_gated_<act>'s one parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct GemmGatedParams {
    /// x: (M, K) bf16, box (64, 128).
    a: cudarc::driver::sys::CUtensorMap,
    /// Wg: (n_ffn, K) bf16, box (64, 128).
    b_gate: cudarc::driver::sys::CUtensorMap,
    /// Wu: (n_ffn, K) bf16, box (64, 128).
    b_up: cudarc::driver::sys::CUtensorMap,
    /// out: (M, n_ffn) bf16 with row stride ldo, box (64, 64) (store_tma only; else zeros).
    out_map: cudarc::driver::sys::CUtensorMap,
    /// (M, ldo) bf16.
    out: u64,
    ldo: i64,
    m: i32,
    n_ffn: i32,
    k: i32,
    /// 1: the epilogue through shared memory and TMA stores (GemmEpilogue::TmaStore).
    store_tma: i32,
}
const _: () = assert!(size_of::<GemmGatedParams>() == 640 && align_of::<GemmGatedParams>() == 128);
// SAFETY: plain data with the layout of the CUDA struct (asserted above); passed by value.
unsafe impl cudarc::driver::DeviceRepr for GemmGatedParams {}

/// Name of the fused QKV wgmma GEMM (kernels/gemm_sm90a.cu).
pub const GEMM_QKV_KERNEL: &str = "gemm_bf16_wgmma_qkv";

/// `GemmQkvParams` of kernels/common.cuh (gemm_bf16_wgmma_qkv's one parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct GemmQkvParams {
    /// x: (M, K) bf16, box (64, 128).
    a: cudarc::driver::sys::CUtensorMap,
    /// The fused W: (n_q + n_k + n_v, K) bf16, box (64, 256).
    b: cudarc::driver::sys::CUtensorMap,
    /// q (M, n_q), k (M, n_k), v (M, n_v) f32, contiguous.
    y: [u64; 3],
    /// Each projection's (width) f32 bias, or 0 for none.
    bias: [u64; 3],
    m: i32,
    n: i32,
    k: i32,
    /// First column of k (= n_q) and of v (= n_q + n_k) in the fused product.
    col1: i32,
    col2: i32,
    pad_: i32,
}
const _: () = assert!(size_of::<GemmQkvParams>() == 384 && align_of::<GemmQkvParams>() == 128);
// SAFETY: plain data with the layout of the CUDA struct (asserted above); passed by value.
unsafe impl cudarc::driver::DeviceRepr for GemmQkvParams {}

/// Names of the gated wgmma GEMMs (kernels/gemm_sm90a.cu), one per activation.
pub fn gemm_gated_kernel(act: Activation) -> &'static str {
    match act {
        Activation::Silu => "gemm_bf16_wgmma_gated_silu",
        Activation::GeluTanh => "gemm_bf16_wgmma_gated_gelu",
    }
}

/// Names of the producer-dequant gated Q4_0 GEMMs (kernels/gemm_sm90a.cu).
pub fn gemm_q4_0_gated_kernel(act: Activation) -> &'static str {
    match act {
        Activation::Silu => "gemm_q4_0_wgmma_gated_silu",
        Activation::GeluTanh => "gemm_q4_0_wgmma_gated_gelu",
    }
}

/// The kernel `matmul::<bf16>` uses for an (m, n) product on this device:
/// always mma.sync on a device pinned to one GEMM kernel (`--reproducible`,
/// `CudaDevice::pin_one_gemm_kernel`: the two kernels sum a row's products in
/// different orders, so a row's bits would depend on the pass's M).
pub fn bf16_kernel_for(dev: &CudaDevice, m: usize, n: usize) -> MatmulKernel {
    if !dev.one_gemm_kernel() && dev.has_function(GEMM_WGMMA_KERNEL) && m >= GEMM_WGMMA_MIN_M && n >= GEMM_WGMMA_MIN_N {
        MatmulKernel::Wgmma
    } else {
        MatmulKernel::MmaSync
    }
}

fn check_matmul_shapes(op: &str, x_len: usize, x_ptr: u64, m: usize, w: &QuantMatrix, y: &DevViewMut<f32>, ldy: usize) -> Result<()> {
    let (n, k) = (w.n_rows, w.n_cols);
    ensure!(k % 32 == 0, "{op}: K = {k} is not a multiple of 32");
    ensure!(x_len == m * k, "{op}: x has {x_len} elements, m * K = {m} * {k}");
    Rows { n_rows: m, n_cols: n, stride: ldy }.check(y.len(), op, "y")?;
    ensure!(x_ptr % 16 == 0, "{op}: x is not 16-byte aligned");
    Ok(())
}

/// y = x · Wᵀ. x: (m, w.n_cols) contiguous, bf16 (tensor cores) or f32 (FP32
/// route); y: (m, ldy) f32, columns [0, w.n_rows) written. bf16 goes to the
/// kernel `bf16_kernel_for` picks.
pub fn matmul<X: MatmulInput>(
    dev: &CudaDevice,
    x: DevView<X>,
    m: usize,
    w: &QuantMatrix,
    y: DevViewMut<f32>,
    ldy: usize,
) -> Result<()> {
    if X::NAME == "bf16" {
        let kernel = bf16_kernel_for(dev, m, w.n_rows);
        return matmul_bf16_raw(dev, kernel, x.ptr(), x.len(), m, w, y, ldy);
    }
    matmul_portable(dev, X::NAME, x.ptr(), x.len(), m, w, y, ldy)
}

/// The bf16 matmul on a chosen kernel (tests and the GEMM benchmark compare them).
pub fn matmul_bf16_with(
    dev: &CudaDevice,
    kernel: MatmulKernel,
    x: DevView<bf16>,
    m: usize,
    w: &QuantMatrix,
    y: DevViewMut<f32>,
    ldy: usize,
) -> Result<()> {
    matmul_bf16_raw(dev, kernel, x.ptr(), x.len(), m, w, y, ldy)
}

#[allow(clippy::too_many_arguments)]
fn matmul_bf16_raw(dev: &CudaDevice, kernel: MatmulKernel, xp: u64, x_len: usize, m: usize, w: &QuantMatrix, y: DevViewMut<f32>, ldy: usize) -> Result<()> {
    match kernel {
        MatmulKernel::MmaSync => matmul_portable(dev, "bf16", xp, x_len, m, w, y, ldy),
        MatmulKernel::Wgmma => wgmma_with_scratch(dev, GemmEpilogue::from_env(), GemmDequant::from_env(), xp, x_len, m, w, y, ldy, false, None),
    }
}

/// The bf16 matmul on the wgmma kernel with a chosen epilogue and dequant (tests and
/// the GEMM benchmark compare them): `matmul_bf16_with(.., MatmulKernel::Wgmma, ..)`
/// otherwise. The producer dequant stores directly (no TMA epilogue).
#[allow(clippy::too_many_arguments)]
pub fn matmul_wgmma_with(
    dev: &CudaDevice,
    epilogue: GemmEpilogue,
    dequant: GemmDequant,
    x: DevView<bf16>,
    m: usize,
    w: &QuantMatrix,
    y: DevViewMut<f32>,
    ldy: usize,
    accumulate: bool,
) -> Result<()> {
    wgmma_with_scratch(dev, epilogue, dequant, x.ptr(), x.len(), m, w, y, ldy, accumulate, None)
}

/// The wgmma GEMM of x (m, K) bf16 at `xp` with W, a block-quantized W first
/// dequantized to a bf16 scratch (or, `GemmDequant::Producer` where it fits, inside
/// the GEMM); `accumulate`: y += the product; `rope`: RoPE in the epilogue (the
/// caller checked `gemm_rope_fits`; not with `accumulate`, nor the producer dequant).
#[allow(clippy::too_many_arguments)]
fn wgmma_with_scratch(
    dev: &CudaDevice,
    epilogue: GemmEpilogue,
    dequant: GemmDequant,
    xp: u64,
    x_len: usize,
    m: usize,
    w: &QuantMatrix,
    y: DevViewMut<f32>,
    ldy: usize,
    accumulate: bool,
    rope: Option<&GemmRope>,
) -> Result<()> {
    check_matmul_shapes("matmul (wgmma)", x_len, xp, m, w, &y, ldy)?;
    ensure!(rope.is_none() || !accumulate, "matmul (wgmma): RoPE in the epilogue of an accumulating GEMM");
    if m == 0 || w.n_rows == 0 {
        return Ok(());
    }
    if w.format == TensorFormat::Bf16 {
        return gemm_wgmma(dev, epilogue, xp, m, w.data.view().ptr(), w.n_rows, w.n_cols, y, ldy, accumulate, rope);
    }
    if rope.is_none() && dequant == GemmDequant::Producer && gemm_producer_dequant_fits(dev, w) {
        return gemm_q4_0_wgmma(dev, xp, m, w, y, ldy, accumulate);
    }
    let mut scratch = dev.alloc_uninit::<bf16>(w.n_rows * w.n_cols)?;
    dequant_bf16(dev, w, scratch.view_mut())?;
    gemm_wgmma(dev, epilogue, xp, m, scratch.view().ptr(), w.n_rows, w.n_cols, y, ldy, accumulate, rope)
    // `scratch` is freed in stream order, after the GEMM that reads it.
}

/// out = bf16(act(x · Wgᵀ) * (x · Wuᵀ)), (m, n_ffn) contiguous: the gated FFN's
/// two products and its activation in one pass (the default route; x (m, K)
/// bf16). On the wgmma kernel (M and n_ffn large enough) one GEMM computes both
/// products per tile and applies the activation in its epilogue, a block-
/// quantized Wg and Wu first dequantized to bf16 scratches; otherwise two
/// mma.sync matmuls into f32 temporaries, then gated_<act>_bf16. The same numbers
/// either way: the f32 products, then act(gate) * up in f32, rounded once.
#[allow(clippy::too_many_arguments)]
pub fn matmul_gated_bf16(
    dev: &CudaDevice,
    act: Activation,
    x: DevView<bf16>,
    m: usize,
    gate: &QuantMatrix,
    up: &QuantMatrix,
    out: DevViewMut<bf16>,
) -> Result<()> {
    matmul_gated_bf16_with(dev, GemmEpilogue::gated_from_env(), GemmDequant::from_env(), act, x, m, gate, up, out)
}

/// `matmul_gated_bf16` with a chosen epilogue and dequant for the wgmma kernel (tests
/// and the GEMM benchmark compare them; the mma.sync route has neither). The
/// producer dequant (Wg and Wu both Q4_0 where `gemm_producer_dequant_fits`) stores
/// directly.
#[allow(clippy::too_many_arguments)]
pub fn matmul_gated_bf16_with(
    dev: &CudaDevice,
    epilogue: GemmEpilogue,
    dequant: GemmDequant,
    act: Activation,
    x: DevView<bf16>,
    m: usize,
    gate: &QuantMatrix,
    up: &QuantMatrix,
    out: DevViewMut<bf16>,
) -> Result<()> {
    let (n, k) = (gate.n_rows, gate.n_cols);
    ensure!(
        up.n_rows == n && up.n_cols == k,
        "matmul_gated: gate is {n} x {k}, up {} x {}",
        up.n_rows,
        up.n_cols
    );
    ensure!(x.len() == m * k, "matmul_gated: x has {} elements, m * K = {m} * {k}", x.len());
    ensure!(out.len() == m * n, "matmul_gated: out has {} elements, m * n_ffn = {m} * {n}", out.len());
    if m == 0 || n == 0 {
        return Ok(());
    }
    let name = gemm_gated_kernel(act);
    let wgmma = bf16_kernel_for(dev, m, n) == MatmulKernel::Wgmma && dev.has_function(name) && n % 2 == 0;
    if !wgmma {
        let (mut g, mut u) = (dev.alloc_uninit::<f32>(m * n)?, dev.alloc_uninit::<f32>(m * n)?);
        matmul::<bf16>(dev, x, m, gate, g.view_mut(), n)?;
        matmul::<bf16>(dev, x, m, up, u.view_mut(), n)?;
        return gated::<bf16>(dev, act, g.view(), Rows::contiguous(m, n), u.view(), n, out, n);
    }
    ensure!(k % 32 == 0 && x.ptr() % 16 == 0 && out.ptr() % 4 == 0, "matmul_gated: K = {k}, or x / out unaligned");
    let producer = dequant == GemmDequant::Producer && gemm_producer_dequant_fits(dev, gate) && gemm_producer_dequant_fits(dev, up);
    // bf16 operands: stored BF16 as is, else a dequantized scratch (freed in stream order
    // after the GEMM); none for the producer dequant, whose maps cover the stored blocks.
    let scratch = |w: &QuantMatrix| -> Result<Option<DeviceBuffer<bf16>>> {
        if producer || w.format == TensorFormat::Bf16 {
            return Ok(None);
        }
        let mut s = dev.alloc_uninit::<bf16>(w.n_rows * w.n_cols)?;
        dequant_bf16(dev, w, s.view_mut())?;
        Ok(Some(s))
    };
    let (sg, su) = (scratch(gate)?, scratch(up)?);
    let half_rows = (GEMM_BN / 2) as u32;
    let b_map = |w: &QuantMatrix, s: &Option<DeviceBuffer<bf16>>| {
        if producer {
            tensor_map_q4_0_raw(w)
        } else {
            tensor_map_bf16(s.as_ref().map_or(w.data.view().ptr(), |s| s.view().ptr()), n, k, half_rows)
        }
    };
    let (name, smem) = if producer { (gemm_q4_0_gated_kernel(act), GEMM_RAW_SMEM_BYTES) } else { (name, GEMM_EPI_SMEM_BYTES) };
    // TMA stores: 64 x 64 bf16 boxes, rows of n_ffn bf16 a multiple of 16 bytes (not
    // with the producer dequant, whose raw buffers take the epilogue's shared memory).
    let tma = !producer && epilogue == GemmEpilogue::TmaStore && gemm_tma_store_fits(out.ptr(), n * 2, n * 2);
    let params = GemmGatedParams {
        a: tensor_map_bf16(x.ptr(), m, k, GEMM_BM as u32)?,
        b_gate: b_map(gate, &sg)?,
        b_up: b_map(up, &su)?,
        out_map: if tma { output_map(TmaElem::Bf16, out.ptr(), m, n, n, 64)? } else { zero_tensor_map() },
        out: out.ptr(),
        ldo: n as i64,
        m: i32_of(m, "M")?,
        n_ffn: i32_of(n, "n_ffn")?,
        k: i32_of(k, "K")?,
        store_tma: i32::from(tma),
    };
    let f = wgmma_func_with(dev, name, smem)?;
    let grid = wgmma_grid(dev, name, m.div_ceil(GEMM_BM) * n.div_ceil(GEMM_BN / 2))?;
    let mut b = dev.stream().launch_builder(f);
    b.arg(&params);
    // SAFETY: `params` mirrors GemmGatedParams of kernels/common.cuh (size asserted); the tensor
    // maps cover x (m, k), Wg and Wu (n, k) as bf16, or their stored Q4_0 blocks (n rows of
    // row_bytes, K % 256 == 0: gemm_producer_dequant_fits) for the producer kernels (shapes
    // checked above); out holds (m, n) bf16, 4-byte aligned with n even (checked), as the
    // epilogue's paired stores need, and out_map covers the same (16-byte aligned, n % 8 == 0)
    // when store_tma is 1.
    unsafe { b.launch(cfg((grid, 1, 1), GEMM_THREADS, smem as u32)) }.map_err(|e| launch_err(name, e))?;
    drop((sg, su));
    Ok(())
}

/// Whether `matmul_qkv_bf16` runs the fused GEMM for an x of `m` rows and
/// projections of `widths` columns (sm_90a, the wgmma sizes, even widths);
/// otherwise the caller runs three matmuls.
pub fn qkv_fusable(dev: &CudaDevice, m: usize, widths: [usize; 3]) -> bool {
    let n: usize = widths.iter().sum();
    dev.has_function(GEMM_QKV_KERNEL) && bf16_kernel_for(dev, m, n) == MatmulKernel::Wgmma && widths.iter().all(|w| w % 2 == 0)
}

/// The q, k and v projections of x in one wgmma GEMM: `ys[s] = x · w[s]ᵀ (+
/// bias[s])`, x (m, K) bf16 contiguous, w[s] (width_s, K) in any stored format,
/// ys[s] (m, width_s) f32 contiguous, bias[s] (width_s) f32. The three weights
/// are dequantized (stored BF16: copied) into one (n_q + n_k + n_v, K) bf16
/// scratch, freed in stream order after the GEMM; the epilogue writes each
/// column into its projection's matrix. The same bits as three `matmul`s on the
/// wgmma kernel then `add_bias`. Only when `qkv_fusable` (an error otherwise).
pub fn matmul_qkv_bf16(
    dev: &CudaDevice,
    x: DevView<bf16>,
    m: usize,
    w: [&QuantMatrix; 3],
    bias: Option<[DevView<f32>; 3]>,
    ys: [DevViewMut<f32>; 3],
) -> Result<()> {
    let k = w[0].n_cols;
    let widths = [w[0].n_rows, w[1].n_rows, w[2].n_rows];
    let n: usize = widths.iter().sum();
    ensure!(
        w.iter().all(|w| w.n_cols == k),
        "matmul_qkv: q, k, v weights take {}, {}, {} columns",
        w[0].n_cols,
        w[1].n_cols,
        w[2].n_cols
    );
    ensure!(qkv_fusable(dev, m, widths), "matmul_qkv: no fused GEMM for M = {m}, widths {widths:?} on this device");
    ensure!(k % 32 == 0 && x.len() == m * k && x.ptr() % 16 == 0, "matmul_qkv: x has {} elements (m * K = {m} * {k}) or is unaligned", x.len());
    for (s, y) in ys.iter().enumerate() {
        ensure!(y.len() == m * widths[s] && y.ptr() % 8 == 0, "matmul_qkv: output {s} has {} elements, m * width = {m} * {}", y.len(), widths[s]);
    }
    if let Some(b) = &bias {
        for (s, b) in b.iter().enumerate() {
            ensure!(b.len() == widths[s], "matmul_qkv: bias {s} has {} elements, the projection {}", b.len(), widths[s]);
        }
    }
    // (n_q + n_k + n_v, K) bf16: the three weights one after another.
    let mut scratch = dev.alloc_uninit::<bf16>(n * k)?;
    let mut row0 = 0;
    for wi in w {
        dequant_bf16(dev, wi, scratch.slice_mut(row0 * k..(row0 + wi.n_rows) * k)?)?;
        row0 += wi.n_rows;
    }
    let params = GemmQkvParams {
        a: tensor_map_bf16(x.ptr(), m, k, GEMM_BM as u32)?,
        b: tensor_map_bf16(scratch.view().ptr(), n, k, GEMM_BN as u32)?,
        y: [ys[0].ptr(), ys[1].ptr(), ys[2].ptr()],
        bias: bias.map_or([0; 3], |b| [b[0].ptr(), b[1].ptr(), b[2].ptr()]),
        m: i32_of(m, "M")?,
        n: i32_of(n, "N")?,
        k: i32_of(k, "K")?,
        col1: i32_of(widths[0], "n_q")?,
        col2: i32_of(widths[0] + widths[1], "n_q + n_k")?,
        pad_: 0,
    };
    let f = wgmma_func(dev, GEMM_QKV_KERNEL)?;
    let grid = wgmma_grid(dev, GEMM_QKV_KERNEL, m.div_ceil(GEMM_BM) * n.div_ceil(GEMM_BN))?;
    let mut b = dev.stream().launch_builder(f);
    b.arg(&params);
    // SAFETY: `params` mirrors GemmQkvParams of kernels/common.cuh (size asserted); the tensor
    // maps cover x (m, k) and the scratch (n, k); each output holds (m, width) f32, 8-byte
    // aligned with an even width, each bias (width) f32 (all checked above).
    unsafe { b.launch(cfg((grid, 1, 1), GEMM_THREADS, GEMM_SMEM_BYTES as u32)) }.map_err(|e| launch_err(GEMM_QKV_KERNEL, e))?;
    drop(scratch);
    Ok(())
}

/// y += x · Wᵀ (the residual add fused into the matmul; the default route's
/// attention output and down projections, `Backend::matmul_add`, since gemm5's TMA
/// reduce-add made it 3-6 % over the plain product and the norm after it then only
/// reads the residual, docs/performance.md "e2e7"):
/// x (m, w.n_cols) bf16, y (m, w.n_rows) f32 contiguous. On the wgmma kernel the
/// epilogue adds the f32 product to y (one correctly rounded add per element,
/// the numbers of `matmul` then `add_inplace`); on mma.sync the product goes
/// to a temporary first, then `add_inplace`.
pub fn matmul_add_bf16(dev: &CudaDevice, x: DevView<bf16>, m: usize, w: &QuantMatrix, y: DevViewMut<f32>) -> Result<()> {
    let n = w.n_rows;
    ensure!(y.len() == m * n, "matmul_add: y has {} elements, m * N = {m} * {n}", y.len());
    match bf16_kernel_for(dev, m, n) {
        MatmulKernel::Wgmma => wgmma_with_scratch(dev, GemmEpilogue::from_env(), GemmDequant::from_env(), x.ptr(), x.len(), m, w, y, n, true, None),
        MatmulKernel::MmaSync => {
            let mut t = dev.alloc_uninit::<f32>(m * n)?;
            matmul_portable(dev, "bf16", x.ptr(), x.len(), m, w, t.view_mut(), n)?;
            add_inplace(dev, y, t.view())
        }
    }
}

/// RoPE in the plain wgmma GEMM's epilogue, as the kernel takes it (GemmParams'
/// rope_* fields): the (cos, sin) table and positions of `rope_tabled`.
#[derive(Debug, Clone, Copy)]
struct GemmRope {
    table: u64,
    pos: u64,
    n_per_seq: usize,
    d_head: usize,
    n_rot: usize,
    /// `rope_mode_arg`.
    mode: i32,
}

/// Whether `matmul_rope_bf16` rotates in the GEMM's epilogue for an x of `m` rows
/// and `p` (N = n_heads * d_head); otherwise it runs `matmul` then `rope_tabled`.
/// The rule: the wgmma kernel (`bf16_kernel_for`; mma.sync has no such epilogue);
/// whole heads in the 256-column tile (d_head a power of two, 16 to 256, so a
/// tile's first column starts a head); n_rot even, 0 < n_rot <= d_head; neox: a
/// pair (i, i + n_rot/2) sits in one thread's accumulators n_rot/16 column blocks
/// apart, a compile-time offset, so n_rot a power of two from 16 (16, 32, ..., 256).
/// Normal pairs (2i, 2i + 1) are always in one thread.
pub fn gemm_rope_fits(dev: &CudaDevice, m: usize, p: &RopeParams) -> bool {
    let n = p.n_heads * p.d_head;
    let heads = p.d_head.is_power_of_two() && (16..=GEMM_BN).contains(&p.d_head);
    let rot = p.n_rot > 0 && p.n_rot % 2 == 0 && p.n_rot <= p.d_head;
    let pairs = match p.mode {
        RopeMode::Normal => true,
        RopeMode::Neox => p.n_rot.is_power_of_two() && p.n_rot >= 16,
    };
    n > 0 && heads && rot && pairs && bf16_kernel_for(dev, m, n) == MatmulKernel::Wgmma
}

/// y = x · Wᵀ, then RoPE of each head of every row, the rotation of `rope_tabled`
/// (row t at position pos[t % pos.len()], (cos, sin) from `table`, built by
/// `rope_table` for `p` over at least `max_pos + 1` positions): x (m, K) bf16, W
/// (n_heads * d_head, K), y (m, n_heads * d_head) f32 contiguous. Where
/// `gemm_rope_fits`, on the wgmma GEMM's accumulators in its epilogue (no f32 round
/// trip: the same bits, rope.cu's expression on the same f32 products); otherwise
/// `matmul` then `rope_tabled`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_rope_bf16(
    dev: &CudaDevice,
    x: DevView<bf16>,
    m: usize,
    w: &QuantMatrix,
    y: DevViewMut<f32>,
    pos: DevView<i32>,
    max_pos: usize,
    table: DevView<f32>,
    p: &RopeParams,
) -> Result<()> {
    matmul_rope_bf16_with(dev, GemmEpilogue::from_env(), x, m, w, y, pos, max_pos, table, p)
}

/// `matmul_rope_bf16` with a chosen wgmma epilogue (tests compare both).
#[allow(clippy::too_many_arguments)]
pub fn matmul_rope_bf16_with(
    dev: &CudaDevice,
    epilogue: GemmEpilogue,
    x: DevView<bf16>,
    m: usize,
    w: &QuantMatrix,
    mut y: DevViewMut<f32>,
    pos: DevView<i32>,
    max_pos: usize,
    table: DevView<f32>,
    p: &RopeParams,
) -> Result<()> {
    let n = p.n_heads * p.d_head;
    ensure!(
        w.n_rows == n,
        "matmul_rope: the weight has {} rows, n_heads * d_head = {} * {}",
        w.n_rows,
        p.n_heads,
        p.d_head
    );
    ensure!(y.len() == m * n, "matmul_rope: y has {} elements, m * N = {m} * {n}", y.len());
    if !gemm_rope_fits(dev, m, p) {
        matmul::<bf16>(dev, x, m, w, y.slice_mut(0..m * n)?, n)?;
        return rope_tabled(dev, y, n, m, pos, max_pos, table, p);
    }
    // rope_tabled's checks, for the epilogue's reads.
    let n_per_seq = pos.len();
    ensure!(n_per_seq > 0 && m % n_per_seq == 0, "matmul_rope: {m} rows are not whole windows of {n_per_seq} positions");
    ensure!(
        table.len() % p.n_rot == 0 && table.len() / p.n_rot > max_pos,
        "matmul_rope: the (cos, sin) table covers {} positions of {} pairs, position {max_pos} is needed",
        table.len() / p.n_rot,
        p.n_rot / 2
    );
    ensure!(table.ptr() % 8 == 0, "matmul_rope: the (cos, sin) table is not 8-byte aligned");
    let rope = GemmRope { table: table.ptr(), pos: pos.ptr(), n_per_seq, d_head: p.d_head, n_rot: p.n_rot, mode: rope_mode_arg(p.mode) };
    wgmma_with_scratch(dev, epilogue, GemmDequant::from_env(), x.ptr(), x.len(), m, w, y, n, false, Some(&rope))
}

/// The mma.sync (bf16) or FFMA (f32) kernel of kernels/matmul.cu; `route` is "bf16" or "f32".
#[allow(clippy::too_many_arguments)]
fn matmul_portable(dev: &CudaDevice, route: &str, xp: u64, x_len: usize, m: usize, w: &QuantMatrix, y: DevViewMut<f32>, ldy: usize) -> Result<()> {
    let (n, k) = (w.n_rows, w.n_cols);
    check_matmul_shapes("matmul", x_len, xp, m, w, &y, ldy)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let name = format!("matmul_{route}_{}", w.kernel_suffix());
    let f = func(dev, &name)?;
    let (wp, yp) = (w.data.view().ptr(), y.ptr());
    let (mi, ni, ki) = (i32_of(m, "M")?, i32_of(n, "N")?, i32_of(k, "K")?);
    let (rb, ld) = (w.row_bytes as i64, ldy as i64);
    let gx = grid_1d(n, 64)?;
    let gy = grid_1d(m, 64)?;
    ensure!(gy <= 65535, "matmul: M = {m} needs {gy} row blocks, over the grid's y limit");
    let block = if route == "bf16" { 128 } else { 256 };
    let mut b = dev.stream().launch_builder(f);
    b.arg(&xp).arg(&wp).arg(&yp).arg(&mi).arg(&ni).arg(&ki).arg(&rb).arg(&ld);
    // SAFETY: arguments match `matmul_<route>_<fmt>` in kernels/matmul.cu; x holds (m, K)
    // elements of the route's type (checked), y covers (m, ldy) with ldy >= N, W holds N rows
    // of row_bytes with K % 32 == 0.
    unsafe { b.launch(cfg((gx, gy, 1), block, 0)) }.map_err(|e| launch_err(&name, e))?;
    Ok(())
}

/// out = bf16(dequant(W)), (n_rows, n_cols) row-major: the wgmma GEMM's weight operand.
pub fn dequant_bf16(dev: &CudaDevice, w: &QuantMatrix, out: DevViewMut<bf16>) -> Result<()> {
    let n_elems = w.n_rows * w.n_cols;
    ensure!(out.len() == n_elems, "dequant_bf16: out has {} elements, W is {} x {}", out.len(), w.n_rows, w.n_cols);
    ensure!(w.n_cols % 8 == 0 && out.ptr() % 16 == 0, "dequant_bf16: rows of {} or an unaligned output", w.n_cols);
    if n_elems == 0 {
        return Ok(());
    }
    let name = format!("dequant_bf16_{}", w.kernel_suffix());
    let f = func(dev, &name)?;
    let (wp, op) = (w.data.view().ptr(), out.ptr());
    let n_groups = (n_elems / 8) as i64;
    let (gpr, rb) = (i32_of(w.n_cols / 8, "groups per row")?, w.row_bytes as i64);
    let mut b = dev.stream().launch_builder(f);
    b.arg(&wp).arg(&op).arg(&n_groups).arg(&gpr).arg(&rb);
    // SAFETY: arguments match `dequant_bf16_<fmt>` in kernels/matmul.cu; out holds n_rows * n_cols
    // bf16 (checked), W holds n_rows rows of row_bytes (QuantMatrix invariant).
    unsafe { b.launch(cfg((grid_1d(n_elems / 8, 256)?, 1, 1), 256, 0)) }.map_err(|e| launch_err(&name, e))?;
    Ok(())
}

/// A 2-D bf16 tensor map over a row-major (rows, k) matrix, boxes of (64, box_rows)
/// elements, 128-byte swizzle, zeros outside the matrix.
pub(super) fn tensor_map_bf16(ptr: u64, rows: usize, k: usize, box_rows: u32) -> Result<cudarc::driver::sys::CUtensorMap> {
    ensure!(ptr % 16 == 0 && (k * 2) % 16 == 0, "tensor map: base {ptr:#x} or row of {k} bf16 not 16-byte aligned");
    encode_bf16_map(ptr, [k as u64, rows as u64], [(k * 2) as u64], [GEMM_BK as u32, box_rows])
        .with_context(|| format!("tensor map of {rows} x {k} bf16, box 64 x {box_rows}"))
}

/// Element type of a tensor map.
#[derive(Debug, Clone, Copy)]
enum TmaElem {
    Bf16,
    F32,
    /// Raw bytes (a coded KV cache's rows).
    U8,
}

impl TmaElem {
    fn bytes(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::Bf16 => 2,
            Self::F32 => 4,
        }
    }
}

/// The tensor map of a GEMM epilogue's TMA stores: a row-major (rows, cols)
/// output with row stride `ld` elements, boxes of 128 bytes (one swizzled row)
/// x `box_rows` rows.
fn output_map(elem: TmaElem, ptr: u64, rows: usize, cols: usize, ld: usize, box_rows: u32) -> Result<cudarc::driver::sys::CUtensorMap> {
    let e = elem.bytes();
    ensure!(ptr % 16 == 0 && (ld * e) % 16 == 0 && ld >= cols, "output tensor map: base {ptr:#x} or row stride {ld} not 16-byte aligned");
    encode_map(elem, true, ptr, [cols as u64, rows as u64], [(ld * e) as u64], [(128 / e) as u32, box_rows])
        .with_context(|| format!("output tensor map of {rows} x {cols} {elem:?} (stride {ld})"))
}

/// The placeholder map of a kernel parameter its launch does not use.
fn zero_tensor_map() -> cudarc::driver::sys::CUtensorMap {
    // SAFETY: CUtensorMap is plain bytes (an opaque array); all-zero is a valid value,
    // never handed to a TMA instruction (store_tma 0).
    unsafe { std::mem::zeroed() }
}

/// cuTensorMapEncodeTiled for a bf16 tensor of rank R at `ptr` (`encode_map`).
fn encode_bf16_map<const R: usize, const S: usize>(ptr: u64, dims: [u64; R], strides: [u64; S], boxes: [u32; R]) -> Result<cudarc::driver::sys::CUtensorMap> {
    encode_map(TmaElem::Bf16, true, ptr, dims, strides, boxes)
}

/// cuTensorMapEncodeTiled for a tensor of rank R at `ptr`: `dims` innermost
/// first, `strides` the bytes between consecutive indices of dims 1.. R - 1, `boxes`
/// the box per dim; 128-byte swizzle (or none), zeros outside the tensor, L2 promotion 256 B.
fn encode_map<const R: usize, const S: usize>(elem: TmaElem, swizzle_128b: bool, ptr: u64, dims: [u64; R], strides: [u64; S], boxes: [u32; R]) -> Result<cudarc::driver::sys::CUtensorMap> {
    use cudarc::driver::sys;
    const { assert!(S + 1 == R, "a tensor map of rank R has R - 1 strides") };
    let dtype = match elem {
        TmaElem::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        TmaElem::F32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        TmaElem::U8 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
    };
    let swizzle = if swizzle_128b { sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B } else { sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE };
    let elem_strides = [1u32; R];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: dims, boxes and elem_strides have the rank's length R, strides R - 1
    // (asserted above); the map is written by the call.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            R as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    r.result().map_err(|e| anyhow!("cuTensorMapEncodeTiled (dims {dims:?}, strides {strides:?}, box {boxes:?}): {e}"))?;
    // SAFETY: the call succeeded, so it wrote the whole map.
    Ok(unsafe { map.assume_init() })
}

/// A wgmma GEMM kernel with its dynamic shared memory raised to GEMM_SMEM_BYTES.
pub(super) fn wgmma_func<'a>(dev: &'a CudaDevice, name: &str) -> Result<&'a CudaFunction> {
    wgmma_func_with(dev, name, GEMM_SMEM_BYTES)
}

/// A wgmma GEMM kernel with its dynamic shared memory raised to `smem` bytes.
fn wgmma_func_with<'a>(dev: &'a CudaDevice, name: &str, smem: usize) -> Result<&'a CudaFunction> {
    let f = func(dev, name)?;
    ensure!(
        smem <= dev.info().max_smem_per_block_bytes as usize,
        "{name}: needs {smem} bytes of shared memory, the device allows {}",
        dev.info().max_smem_per_block_bytes
    );
    f.set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
        .map_err(|e| anyhow!("{name}: raising dynamic shared memory to {smem} bytes: {e}"))?;
    Ok(f)
}

/// The persistent grid of a wgmma GEMM of `n_tiles` tiles: one block per SM at most.
pub(super) fn wgmma_grid(dev: &CudaDevice, name: &str, n_tiles: usize) -> Result<u32> {
    ensure!(n_tiles <= i32::MAX as usize, "{name}: {n_tiles} tiles exceed the kernel's 32-bit tile index");
    Ok(n_tiles.min(dev.info().n_sms.max(1) as usize) as u32)
}

/// y = x · Wᵀ (or y += it) on gemm_bf16_wgmma: x (m, k) bf16 at `xp`, W (n, k) bf16 at `wp`.
#[allow(clippy::too_many_arguments)]
fn gemm_wgmma(
    dev: &CudaDevice,
    epilogue: GemmEpilogue,
    xp: u64,
    m: usize,
    wp: u64,
    n: usize,
    k: usize,
    y: DevViewMut<f32>,
    ldy: usize,
    accumulate: bool,
    rope: Option<&GemmRope>,
) -> Result<()> {
    // TMA stores: 64 x 32 f32 boxes, rows of ldy f32 a multiple of 16 bytes.
    let tma = epilogue == GemmEpilogue::TmaStore && gemm_tma_store_fits(y.ptr(), ldy * 4, n * 4);
    let b = tensor_map_bf16(wp, n, k, GEMM_BN as u32)?;
    gemm_wgmma_launch(dev, GEMM_WGMMA_KERNEL, GEMM_EPI_SMEM_BYTES, b, tma, xp, m, n, k, y, ldy, accumulate, rope)
}

/// y = x · Wᵀ (or y += it) on gemm_q4_0_wgmma: x (m, k) bf16 at `xp`, W's stored Q4_0
/// blocks dequantized by the GEMM's producer (`gemm_producer_dequant_fits(w)`, which
/// the caller checked); direct stores.
fn gemm_q4_0_wgmma(dev: &CudaDevice, xp: u64, m: usize, w: &QuantMatrix, y: DevViewMut<f32>, ldy: usize, accumulate: bool) -> Result<()> {
    let b = tensor_map_q4_0_raw(w)?;
    gemm_wgmma_launch(dev, GEMM_Q4_0_KERNEL, GEMM_RAW_SMEM_BYTES, b, false, xp, m, w.n_rows, w.n_cols, y, ldy, accumulate, None)
}

/// Launches the plain wgmma GEMM `name` (gemm_bf16_wgmma, or gemm_q4_0_wgmma with `b` over
/// the stored blocks) with `smem` bytes of dynamic shared memory; `tma`: the TMA-store
/// epilogue; `rope`: RoPE in the epilogue (`gemm_rope_fits`, checked by the callers).
#[allow(clippy::too_many_arguments)]
fn gemm_wgmma_launch(
    dev: &CudaDevice,
    name: &str,
    smem: usize,
    b: cudarc::driver::sys::CUtensorMap,
    tma: bool,
    xp: u64,
    m: usize,
    n: usize,
    k: usize,
    y: DevViewMut<f32>,
    ldy: usize,
    accumulate: bool,
    rope: Option<&GemmRope>,
) -> Result<()> {
    let f = wgmma_func_with(dev, name, smem)?;
    let params = GemmParams {
        a: tensor_map_bf16(xp, m, k, GEMM_BM as u32)?,
        b,
        y_map: if tma { output_map(TmaElem::F32, y.ptr(), m, n, ldy, 64)? } else { zero_tensor_map() },
        y: y.ptr(),
        ldy: ldy as i64,
        m: i32_of(m, "M")?,
        n: i32_of(n, "N")?,
        k: i32_of(k, "K")?,
        y_pairs: i32::from(ldy % 2 == 0 && y.ptr() % 8 == 0),
        accumulate: i32::from(accumulate),
        store_tma: i32::from(tma),
        rope_table: rope.map_or(0, |r| r.table),
        rope_pos: rope.map_or(0, |r| r.pos),
        rope_n_per_seq: rope.map_or(Ok(0), |r| i32_of(r.n_per_seq, "positions"))?,
        rope_d_head: rope.map_or(Ok(0), |r| i32_of(r.d_head, "d_head"))?,
        rope_n_rot: rope.map_or(Ok(0), |r| i32_of(r.n_rot, "n_rot"))?,
        rope_mode: rope.map_or(0, |r| r.mode),
    };
    // Persistent: one block per SM (its shared memory allows no second), each looping over tiles.
    let grid = wgmma_grid(dev, name, m.div_ceil(GEMM_BM) * n.div_ceil(GEMM_BN))?;
    let mut lb = dev.stream().launch_builder(f);
    lb.arg(&params);
    // SAFETY: `params` mirrors GemmParams of kernels/common.cuh (size asserted); the tensor maps
    // cover x (m, k) and W (n, k) as bf16, or W's n rows of stored Q4_0 blocks for
    // gemm_q4_0_wgmma (K % 256 == 0: gemm_producer_dequant_fits), which the callers checked; y
    // covers (m, ldy) with ldy >= n, and so does y_map (16-byte aligned, checked) when store_tma is 1;
    // with rope_n_rot > 0 the table covers every position of rope_pos and the heads fit the tile
    // (matmul_rope_bf16 checked both).
    unsafe { lb.launch(cfg((grid, 1, 1), GEMM_THREADS, smem as u32)) }.map_err(|e| launch_err(name, e))?;
    Ok(())
}

// ------------------------------------------------------------------ KV cache and attention

/// Shape of one layer's KV cache: (n_seqs, n_kv_heads, n_ctx, d_head), one
/// slot per window of a batched pass.
#[derive(Debug, Clone, Copy)]
pub struct KvShape {
    pub n_seqs: usize,
    pub n_kv_heads: usize,
    pub n_ctx: usize,
    pub d_head: usize,
}

impl KvShape {
    /// Elements of an unscaled cache (bf16, f32): rows * d_head.
    pub fn len(&self) -> usize {
        self.rows() * self.d_head
    }
    /// Rows (one per slot, KV head and position).
    pub fn rows(&self) -> usize {
        self.n_seqs * self.n_kv_heads * self.n_ctx
    }
    /// Bytes of a cache of rows coded by `codec` (src/kv): rows * `codec.row_bytes(d_head)`.
    pub fn coded_bytes(&self, codec: RowCodec) -> usize {
        self.rows() * codec.row_bytes(self.d_head)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// cache[s, h, pos0 + t, :] = src[s * n_tokens + t, h*d_head ..] for the
/// first `n_seqs` slots. src: (n_seqs * n_tokens, src_stride) f32.
#[allow(clippy::too_many_arguments)]
pub fn kv_store<KV: KvElem>(
    dev: &CudaDevice,
    src: DevView<f32>,
    n_seqs: usize,
    n_tokens: usize,
    src_stride: usize,
    cache: DevViewMut<KV>,
    shape: KvShape,
    pos0: usize,
) -> Result<()> {
    ensure!(n_seqs <= shape.n_seqs, "kv_store: {n_seqs} windows, the cache has {} slots", shape.n_seqs);
    Rows { n_rows: n_seqs * n_tokens, n_cols: shape.n_kv_heads * shape.d_head, stride: src_stride }.check(src.len(), "kv_store", "src")?;
    ensure!(cache.len() == shape.len(), "kv_store: cache has {} elements, shape {shape:?} needs {}", cache.len(), shape.len());
    ensure!(
        pos0 + n_tokens <= shape.n_ctx,
        "kv_store: positions {pos0}..{} past the cache's {} slots",
        pos0 + n_tokens,
        shape.n_ctx
    );
    if n_tokens == 0 || n_seqs == 0 {
        return Ok(());
    }
    let name = format!("kv_store_{}", KV::NAME);
    let f = func(dev, &name)?;
    let (sp, cp) = (src.ptr(), cache.ptr());
    let (dh, nc, p0, ss) = (i32_of(shape.d_head, "d_head")?, i32_of(shape.n_ctx, "n_ctx")?, i32_of(pos0, "pos0")?, src_stride as i64);
    let mut b = dev.stream().launch_builder(f);
    b.arg(&sp).arg(&cp).arg(&dh).arg(&nc).arg(&p0).arg(&ss);
    // SAFETY: arguments match `kv_store_<kv>` in kernels/attention.cu; src rows and cache slots checked.
    unsafe { b.launch(cfg((n_tokens as u32, shape.n_kv_heads as u32, n_seqs as u32), 128, 0)) }.map_err(|e| launch_err(&name, e))?;
    Ok(())
}

/// Whether the CUDA backend stores and reads `f`: bf16 and f32 through
/// `kv_store_*`, the quantized formats through `kv_encode_*` and attention v2's
/// decoders (kernels/kv_codec.cu, attention.cu).
pub fn kv_format_has_kernels(f: KvFormat) -> bool {
    match f {
        KvFormat::F32 | KvFormat::Bf16 => true,
        KvFormat::Int8 | KvFormat::Fp8 | KvFormat::Nvfp4 | KvFormat::K8v4 | KvFormat::K4v2 | KvFormat::Vq2 => true,
    }
}

/// The encode kernel of a scaled element codec (kernels/kv_codec.cu).
pub fn kv_encode_kernel(e: ElemCodec) -> Result<&'static str> {
    Ok(match e {
        ElemCodec::Int8 => "kv_encode_int8",
        ElemCodec::Fp8 => "kv_encode_fp8",
        ElemCodec::Nvfp4 => "kv_encode_nvfp4",
        ElemCodec::Int4G32 => "kv_encode_int4g32",
        ElemCodec::Int2G32 => "kv_encode_int2g32",
        ElemCodec::Vq2 => "kv_encode_vq2",
        ElemCodec::F32 | ElemCodec::Bf16 | ElemCodec::Fp16 => bail!("kv_encode: codec {} has no encode kernel (kv_store_* stores it)", e.name()),
    })
}

/// The vq2 codebook on the device: `kv::vq::codebook()`, (256, 4) f32 row-major,
/// uploaded as is (never regenerated in CUDA); kv_encode_vq2 searches it and the
/// vq2 attention decodes with it.
#[derive(Debug)]
pub struct VqBook(DeviceBuffer<f32>);

impl VqBook {
    pub fn upload(dev: &CudaDevice) -> Result<Self> {
        let host: Vec<f32> = crate::kv::vq::codebook().iter().flatten().copied().collect();
        Ok(Self(dev.upload(&host).context("upload the vq2 codebook")?))
    }
    fn ptr(&self) -> u64 {
        self.0.view().ptr()
    }
}

/// The codebook pointer a codec's kernel needs (vq2), or 0.
fn book_ptr(e: ElemCodec, book: Option<&VqBook>, op: &str) -> Result<u64> {
    if e != ElemCodec::Vq2 {
        return Ok(0);
    }
    let b = book.with_context(|| format!("{op}: the vq2 codec needs the codebook (ops::VqBook)"))?;
    ensure!(b.0.len() == crate::kv::vq::N_CODES * crate::kv::vq::DIM && b.ptr() % 16 == 0, "{op}: the vq2 codebook has {} values", b.0.len());
    Ok(b.ptr())
}

/// Parameters of `kv_encode_<codec>` and `kv_roundtrip_<codec>` (there `cache` is the f32
/// cache and `row_bytes` the encoded row of the shared scratch), mirrored by `struct
/// KvEncodeArgs` in kernels/common.cuh.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct KvEncodeArgs {
    src: u64,
    cache: u64,
    n_bad: u64,
    src_stride: i64,
    d: i32,
    n_kv_heads: i32,
    n_ctx: i32,
    pos0: i32,
    row_bytes: i32,
    rotate: i32,
    n_tokens: i32,
    n_seqs: i32,
    book: u64,
}
const _: () = assert!(size_of::<KvEncodeArgs>() == 72, "KvEncodeArgs must match kernels/common.cuh");
// SAFETY: plain data of fixed C layout (asserted above), passed by value as the kernel's parameter.
unsafe impl cudarc::driver::DeviceRepr for KvEncodeArgs {}

/// Largest row the encode kernels take (their shared memory holds one row a warp).
const KV_ENCODE_MAX_D: usize = 4096;
/// Most rows (warps) in one block of the row kernels: `KV_ROWS_MAX_THREADS` / 32 in
/// kernels/common.cuh.
const KV_ROWS_MAX_WARPS: usize = 8;
/// The row kernels' dynamic shared memory per block stays within the default 48 KiB.
const KV_ROWS_MAX_SMEM_BYTES: usize = 48 * 1024;

/// Encodes rows into a cache of `codec` rows exactly as `kv::RowCodec::encode_row`
/// (kernels/kv_codec.cu `kv_encode_<codec>`, rotation included when the codec
/// rotates): cache row (s, h, pos0 + t) = encode(src[s * n_tokens + t, h*d_head ..])
/// for the first `n_seqs` slots; the non-finite count of the rows (the codec's
/// return) is added to `n_bad[0]`. src: (n_seqs * n_tokens, src_stride) f32; cache:
/// `shape.coded_bytes(codec)` bytes; `book`: the codebook, for vq2.
#[allow(clippy::too_many_arguments)]
pub fn kv_encode(
    dev: &CudaDevice,
    codec: RowCodec,
    src: DevView<f32>,
    n_seqs: usize,
    n_tokens: usize,
    src_stride: usize,
    cache: DevViewMut<u8>,
    shape: KvShape,
    pos0: usize,
    n_bad: DevViewMut<u64>,
    book: Option<&VqBook>,
) -> Result<()> {
    let name = kv_encode_kernel(codec.elem)?;
    let need = shape.coded_bytes(codec);
    ensure!(cache.len() == need, "{name}: cache has {} bytes, shape {shape:?} needs {need}", cache.len());
    let rows = KvRowsLaunch { name, codec, src, n_seqs, n_tokens, src_stride, shape, pos0 };
    // Shared memory per row: the row and its scales.
    rows.launch(dev, cache.ptr(), n_bad, book, (shape.d_head + shape.d_head / 16) * 4)
}

/// The `--reference` route's store kernel of a row codec (kernels/kv_codec.cu
/// `kv_roundtrip_<codec>`: decode(encode(row)) into an f32 cache); f32 rows have
/// none (`kv_store_f32` stores them as they are).
pub fn kv_roundtrip_kernel(e: ElemCodec) -> Result<&'static str> {
    Ok(match e {
        ElemCodec::Int8 => "kv_roundtrip_int8",
        ElemCodec::Fp8 => "kv_roundtrip_fp8",
        ElemCodec::Nvfp4 => "kv_roundtrip_nvfp4",
        ElemCodec::Int4G32 => "kv_roundtrip_int4g32",
        ElemCodec::Int2G32 => "kv_roundtrip_int2g32",
        ElemCodec::Vq2 => "kv_roundtrip_vq2",
        ElemCodec::Bf16 => "kv_roundtrip_bf16",
        ElemCodec::Fp16 => "kv_roundtrip_fp16",
        ElemCodec::F32 => bail!("kv_roundtrip: f32 rows are stored as they are (kv_store_f32)"),
    })
}

/// Stores rows into an f32 cache as the CPU backend stores them under any codec
/// (`CpuBackend::kv_store`: `decode(encode(row))`, bit for bit; kernels/kv_codec.cu
/// `kv_roundtrip_<codec>`): cache[s, h, pos0 + t, :] = decode(encode(src[s *
/// n_tokens + t, h*d_head ..])) for the first `n_seqs` slots, the codec's
/// non-finite count added to `n_bad[0]`. src: (n_seqs * n_tokens, src_stride) f32;
/// cache: `shape.len()` f32; `book`: the codebook, for vq2.
#[allow(clippy::too_many_arguments)]
pub fn kv_roundtrip(
    dev: &CudaDevice,
    codec: RowCodec,
    src: DevView<f32>,
    n_seqs: usize,
    n_tokens: usize,
    src_stride: usize,
    cache: DevViewMut<f32>,
    shape: KvShape,
    pos0: usize,
    n_bad: DevViewMut<u64>,
    book: Option<&VqBook>,
) -> Result<()> {
    let name = kv_roundtrip_kernel(codec.elem)?;
    ensure!(cache.len() == shape.len(), "{name}: cache has {} f32, shape {shape:?} needs {}", cache.len(), shape.len());
    let rows = KvRowsLaunch { name, codec, src, n_seqs, n_tokens, src_stride, shape, pos0 };
    // Shared memory per row: the row, its scales, then the encoded row (scaled codecs only).
    let d = shape.d_head;
    let smem = if codec.elem.is_scaled() { (d + d / 16) * 4 + codec.row_bytes(d) } else { 0 };
    rows.launch(dev, cache.ptr(), n_bad, book, smem)
}

/// One launch of a kv_codec.cu row kernel (`kv_encode_*`, `kv_roundtrip_*`): the
/// rows (s, t, h) of `src` into cache slots `(s, h, pos0 + t)`, one warp per row, up
/// to [`KV_ROWS_MAX_WARPS`] rows a block in (s, t, h) order.
struct KvRowsLaunch<'a> {
    name: &'static str,
    codec: RowCodec,
    src: DevView<'a, f32>,
    n_seqs: usize,
    n_tokens: usize,
    src_stride: usize,
    shape: KvShape,
    pos0: usize,
}

impl KvRowsLaunch<'_> {
    /// Checks the rows, the cache pointer (its size the caller checked), the
    /// counter and the codebook, then launches with `row_smem` bytes of shared
    /// memory for each row of a block.
    fn launch(&self, dev: &CudaDevice, cache_ptr: u64, n_bad: DevViewMut<u64>, book: Option<&VqBook>, row_smem: usize) -> Result<()> {
        let Self { name, codec, n_seqs, n_tokens, src_stride, shape, pos0, .. } = *self;
        let d = shape.d_head;
        codec.check_len(d).with_context(|| name.to_string())?;
        ensure!(d <= KV_ENCODE_MAX_D, "{name}: rows of {d} elements, at most {KV_ENCODE_MAX_D}");
        ensure!(n_seqs <= shape.n_seqs, "{name}: {n_seqs} windows, the cache has {} slots", shape.n_seqs);
        Rows { n_rows: n_seqs * n_tokens, n_cols: shape.n_kv_heads * d, stride: src_stride }.check(self.src.len(), name, "src")?;
        ensure!(cache_ptr % 16 == 0, "{name}: the cache is not 16-byte aligned");
        ensure!(n_bad.len() == 1 && n_bad.ptr() % 8 == 0, "{name}: the counter must be one aligned u64");
        ensure!(pos0 + n_tokens <= shape.n_ctx, "{name}: positions {pos0}..{} past the cache's {} slots", pos0 + n_tokens, shape.n_ctx);
        let book = book_ptr(codec.elem, book, name)?;
        if n_tokens == 0 || n_seqs == 0 {
            return Ok(());
        }
        let n_rows = n_seqs * n_tokens * shape.n_kv_heads;
        let rows_per_block = (KV_ROWS_MAX_SMEM_BYTES / row_smem.max(1)).clamp(1, KV_ROWS_MAX_WARPS);
        let n_blocks = u32::try_from(n_rows.div_ceil(rows_per_block)).with_context(|| format!("{name}: {n_rows} rows exceed the grid"))?;
        let args = KvEncodeArgs {
            src: self.src.ptr(),
            cache: cache_ptr,
            n_bad: n_bad.ptr(),
            src_stride: src_stride as i64,
            d: i32_of(d, "d_head")?,
            n_kv_heads: i32_of(shape.n_kv_heads, "n_kv_heads")?,
            n_ctx: i32_of(shape.n_ctx, "n_ctx")?,
            pos0: i32_of(pos0, "pos0")?,
            row_bytes: i32_of(codec.row_bytes(d), "row_bytes")?,
            rotate: i32::from(codec.rotate),
            n_tokens: i32_of(n_tokens, "n_tokens")?,
            n_seqs: i32_of(n_seqs, "n_seqs")?,
            book,
        };
        let f = func(dev, name)?;
        let mut b = dev.stream().launch_builder(f);
        b.arg(&args);
        // SAFETY: the one KvEncodeArgs of the row kernels in kernels/kv_codec.cu; src rows, the
        // cache (its size checked by the caller for the kernel's element type, 16-byte aligned),
        // the counter, d % 32 == 0 for the scaled codecs, the codebook (vq2) and the shared
        // memory the caller sized per row for the kernel checked above, times the block's rows
        // (at most KV_ROWS_MAX_THREADS threads, the kernels' launch bound).
        let smem = u32::try_from(rows_per_block * row_smem)?;
        unsafe { b.launch(cfg((n_blocks, 1, 1), (32 * rows_per_block) as u32, smem)) }.map_err(|e| launch_err(name, e))?;
        Ok(())
    }
}

/// Parameters of one prefill attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnParams {
    /// Windows in the pass (cache slots 0..n_seqs); rows are window-major.
    pub n_seqs: usize,
    /// Rows per window.
    pub n_tokens: usize,
    pub n_heads: usize,
    /// Keys visible to query t (position pos0 + t): kp <= pos0 + t, and with a
    /// window w > 0 also pos0 + t - kp < w. The cache holds positions [0, pos0 + n_tokens).
    pub pos0: usize,
    /// Sliding window in positions (0 = full causal).
    pub window: usize,
    /// Multiplies q·k (1/sqrt(d_head), or gemma's query_pre_attn_scalar^-1/2).
    pub scale: f32,
    /// tanh soft-cap on the scaled logits (0 = none).
    pub softcap: f32,
    /// Elements between tokens in q and in out.
    pub q_stride: usize,
    pub out_stride: usize,
}

const ATTN_HEAD_DIMS: [usize; 4] = [64, 96, 128, 256];

/// The prefill attention kernels, kept side by side for comparison
/// (kernels/attention.cu: v1, v2; kernels/attention_sm90a.cu: v3); execution info
/// names the one that ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKernel {
    /// `attn_prefill_*`: f32 FMA on the CUDA cores, q in f32, cache read as
    /// stored (bf16 or f32). The FP32 route's exact path.
    V1,
    /// `attn_flash_*`: FlashAttention-2 style, QKᵀ and PV with mma.sync
    /// m16n8k16 bf16 (q rounded to bf16 in the kernel, P rounded to bf16, f32
    /// accumulation and f32 online softmax); a bf16 cache, or a quantized one
    /// decoded and rounded to bf16 in its tile loads ([`attention_coded`]).
    V2,
    /// `attn_wgmma_*` (kernels/attention_sm90a.cu, sm_90a only): FlashAttention-3's
    /// design, wgmma for QKᵀ (Q and K from swizzled shared memory) and PV (P from
    /// registers), K/V stages filled by TMA from a producer warp, two consumer
    /// warpgroups; v2's numerics. A cache of [`ATTN_V3_KV`] at d_head 64 or 128 only
    /// ([`AttnKernel::covers`]); [`attention`] sends v2's calls there when it does
    /// at the head sizes of [`ATTN_V3_DEFAULT_HEAD_DIMS`].
    V3,
}

impl AttnKernel {
    pub fn name(self) -> &'static str {
        match self {
            Self::V1 => "v1",
            Self::V2 => "v2",
            Self::V3 => "v3",
        }
    }
    /// Whether kernel v3 runs this case: the sm_90a module is loaded (a compute
    /// capability 9.0 device, nvcc present at build time), a cache of one of
    /// [`ATTN_V3_KV`] (bf16 and every quantized format), d_head 64 or 128.
    pub fn covers(dev: &CudaDevice, kv: &str, d_head: usize) -> bool {
        ATTN_V3_KV.contains(&kv) && ATTN_V3_HEAD_DIMS.contains(&d_head) && dev.has_function(&attn_v3_name(d_head, kv, "f32"))
    }
    /// Whether [`attention`] and [`attention_coded`] send a call for v2 to v3: where v3
    /// covers it, at the head sizes of [`ATTN_V3_DEFAULT_HEAD_DIMS`], for the caches of
    /// [`ATTN_V3_DEFAULT_KV`].
    pub fn routes_to_v3(dev: &CudaDevice, kv: &str, d_head: usize) -> bool {
        ATTN_V3_DEFAULT_HEAD_DIMS.contains(&d_head) && ATTN_V3_DEFAULT_KV.contains(&kv) && Self::covers(dev, kv, d_head)
    }
    /// One line for the report's execution info.
    pub fn describe(self) -> &'static str {
        match self {
            Self::V1 => "v1: f32 FMA on the CUDA cores (online softmax), f32 q, cache read as stored",
            Self::V2 => {
                "v2: flash attention on the tensor cores (mma.sync m16n8k16 bf16, ldmatrix, K/V double \
                 buffer); q rounded to bf16 (nearest even) in the kernel, P rounded to bf16, f32 \
                 accumulation and f32 online softmax; a bf16 cache fetched with cp.async, or a quantized cache's \
                 stored rows fetched with cp.async two tiles ahead and decoded from shared memory (src/kv's \
                 decode, code * scale, rounded to bf16; fp8 and int8 rows up to d_head 128: the exact codes, \
                 their row scale applied in f32 to the key's column of the scores (K) or of P before its bf16 \
                 rounding (V)), tile n + 1 between tile n's MMAs, 8 warps per block for a quantized cache up to \
                 d_head 128; Hadamard-rotated \
                 K: q rotated (f32) in the kernel before its rounding; rotated V: the output rotated back (f32); \
                 on a compute capability 9.0 device a cache of ops::ATTN_V3_DEFAULT_KV (bf16 and every quantized format) at the head sizes of \
                 ops::ATTN_V3_DEFAULT_HEAD_DIMS runs kernel v3 (attn_wgmma) instead"
            }
            Self::V3 => {
                "v3: flash attention on Hopper's wgmma (FlashAttention-3's design: 128 queries per block in two \
                 consumer warpgroups, S = Q·Kᵀ with Q and K from 128-byte-swizzled shared memory, P from \
                 registers for P·V, 128-key K/V stages filled by TMA from a producer warp through mbarriers, \
                 a persistent grid of one block per SM walking the query tiles longest first); v2's numerics \
                 (q and P rounded to bf16, f32 scores, softmax and accumulation); a bf16 cache, or the rows of a \
                 quantized one (fp8, int8, k8v4, nvfp4, k4v2, vq2) brought raw by TMA and decoded by the \
                 producer warpgroup into the same bf16 stages (src/kv's decode, code * scale, rounded to bf16; \
                 rotated K: q rotated (f32) before its rounding; rotated V: the output rotated back (f32)); \
                 d_head 64/128"
            }
        }
    }
}

/// Parameters of `attn_flash_*`, mirrored by `struct AttnArgs` in kernels/common.cuh.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AttnArgs {
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    n_tokens: i32,
    n_heads: i32,
    n_kv_heads: i32,
    n_ctx: i32,
    pos0: i32,
    window: i32,
    scale: f32,
    softcap: f32,
    q_stride: i64,
    out_stride: i64,
    /// Bytes between K rows and between V rows (2 * d_head for bf16, the codecs' row_bytes).
    k_row_bytes: i32,
    v_row_bytes: i32,
    /// Bit 0: K rows Hadamard-rotated; bit 1: V rows.
    rot: i32,
    pad_: i32,
    /// The vq2 codebook, or 0.
    book: u64,
}
const _: () = assert!(size_of::<AttnArgs>() == 104, "AttnArgs must match kernels/common.cuh");
// SAFETY: plain data of fixed C layout (asserted above), passed by value as the kernel's parameter.
unsafe impl cudarc::driver::DeviceRepr for AttnArgs {}

/// Head sizes at which the default route's attention (calls for v2 on a bf16 cache)
/// runs kernel v3: where the H200 measurement (benches/attention.rs;
/// docs/performance.md, "Prefill attention kernels", attn4) has v3 ahead of v2.
/// Both of v3's: measured on 2026-12-01 (branch attn4), causal, v3 / v2 TFLOP/s:
/// context 4096 d 128 421.8 / 231.4, d 64 300.1 / 197.8; context 512 d 128
/// 193.3 / 150.0, d 64 155.8 / 139.0.
pub const ATTN_V3_DEFAULT_HEAD_DIMS: &[usize] = &[64, 128];

/// Caches (kv::KvFormat::name) whose calls for v2 run kernel v3 at the head sizes of
/// [`ATTN_V3_DEFAULT_HEAD_DIMS`]: where the H200 measurement has v3 ahead of v2
/// (benches/attention.rs; docs/performance.md, "Issue 11/12: quantized KV on kernel
/// v3 (attnq5)") and its parity cases ran on the device. fp8, causal, v3 / v2 TFLOP/s
/// (2026-12-01, attnq5; v2: attnq4's call): ctx 4096 d 128 249.1 / 147.7, d 64 241.1
/// / 109.5; ctx 512 d 128 139.2 / 90.0, d 64 130.7 / 69.1. int8 on v3 measured as fast
/// (247.1 / 235.5 / 137.8 / 127.6 against v2's 145.0 / 109.2 / 88.3 / 68.8 in the same
/// call); its parity cases (gpu_ops attention_v3_coded_against_cpu_backend) ran in the
/// merged tree's device call of 2026-12-01 (docs/performance.md). With attn6's producer
/// (batched decode loads, two raw K stages; 2026-12-02 02:31 UTC, same call, v3 bf16 /
/// fp8 / int8): ctx 4096 d 128 416.1 / 323.5 / 312.3, d 64 298.4 / 261.9 / 255.2
/// (docs/performance.md, "Issue 11/12: quantized attention speed on v3 (attn6)").
/// k8v4 (attn7: v3 294.1 / 241.6 against v2 148.6 / 114.8 at ctx 4096, d 128 / 64),
/// nvfp4, k4v2 and vq2 since v3q8, whose device calls (2026-12-02 11:00 and 11:15 UTC)
/// passed their parity cases and the tiny models end to end on this route, v3 / v2 at
/// ctx 4096 d 128 / d 64: nvfp4 256.9 / 164.1, 208.5 / 110.5; k4v2 283.4 / 169.9, 227.1
/// / 121.2; vq2 244.4 / 136.3, 207.0 / 115.1 (docs/performance.md, "Issue 11: nvfp4,
/// k4v2, vq2 on v3 (v3q8)").
pub const ATTN_V3_DEFAULT_KV: &[&str] = &["bf16", "fp8", "int8", "k8v4", "nvfp4", "k4v2", "vq2"];

/// Head sizes of kernel v3 (`attn_wgmma_d<D>_<kv>_<out>`).
pub const ATTN_V3_HEAD_DIMS: [usize; 2] = [64, 128];
/// Caches kernel v3 reads: bf16 (TMA into the swizzled stages) and, decoded by its
/// producer warpgroup, every quantized format (kv::KvFormat::name): fp8, int8, k8v4
/// (since attn7), nvfp4, k4v2, vq2 (since v3q8); the stored rows of
/// [`attn_v3_coded_row_bytes`].
pub const ATTN_V3_KV: &[&str] = &["bf16", "fp8", "int8", "k8v4", "nvfp4", "k4v2", "vq2"];
/// Bytes of the stored K and V rows kernel v3's producer decodes for a quantized cache
/// `kv` at `d_head` (the `bytes(D)` of the row structs in kernels/attention_sm90a.cu:
/// RowBytes, RowInt4G32, RowInt2G32, RowNvfp4, RowVq2), or None for a cache it does not
/// decode. The same as src/kv's `RowCodec::row_bytes` (tests: `v3_rows_are_src_kv_rows`).
pub fn attn_v3_coded_row_bytes(kv: &str, d_head: usize) -> Option<(usize, usize)> {
    let d = d_head;
    let r16 = |n: usize| n.div_ceil(16) * 16;
    let byte = r16(d + 4); // d one-byte codes, the f32 row scale
    let int4 = r16(d / 2 + 4 * (d / 32)); // d/2 bytes of nibbles, d/32 f32 group scales
    let int2 = r16(d / 4 + 4 * (d / 32)); // d/4 bytes of 2-bit codes, d/32 f32 group scales
    let nvfp4 = r16(d / 2 + 4 + d / 16); // d/2 bytes of nibbles, the f32 row scale, d/16 E4M3 block scales
    let vq2 = r16(d / 4 + 4); // d/4 codeword indices, the f32 RMS
    Some(match kv {
        "fp8" | "int8" => (byte, byte),
        "k8v4" => (byte, int4),
        "nvfp4" => (nvfp4, nvfp4),
        "k4v2" => (int4, int2),
        "vq2" => (vq2, vq2),
        _ => return None,
    })
}
/// Whether kernel v3 folds the row scale of a coded cache's K rows (one-byte codes) into
/// S's columns as kernel v2 does, its K tile holding the exact code values
/// (kernels/attention_sm90a.cu `FOLD_K`), rather than rounding code * scale to bf16.
/// Off: measured on the H200 (attn7, 2026-12-02 07:31 UTC, same call, ctx 4096,
/// TFLOP/s folded / not): fp8 d 128 310.3, 313.7 / 314.1, 316.0; d 64 245.8, 247.5 /
/// 259.2, 259.4 (docs/performance.md, "Issue 11/12: the K fold and k8v4 on v3 (attn7)").
pub const ATTN_V3_FOLDS_K: bool = false;
/// Queries per block and keys per K/V stage of kernel v3 (BM, BN in kernels/attention_sm90a.cu).
const ATTN_V3_BM: usize = 128;
const ATTN_V3_BN: usize = 128;
/// K/V stages of kernel v3 (`stages(D)` in kernels/attention_sm90a.cu).
fn attn_v3_stages(d_head: usize) -> usize {
    if d_head <= 64 { 4 } else { 2 }
}
/// The (cache type, head size) pairs whose decoding kernel and attn-f16 kernel have two
/// producer warpgroups (wg2, 2026-12-04: each decodes half of every tile's rows; the
/// last argument of the kernels' `ATTN_WGMMA_CODED` / `ATTN_WGMMA_QF`). H200, causal,
/// TFLOP/s, two against one in the same call (docs/performance.md, "wg2"): ctx 4096
/// vq2 d 128 attn-f16 325.9 / 314.1 (335.6 since a decoding thread loads all 8 of its
/// chunks first), decoding 311.4 / 300.2, d 64 decoding 263.2 / 259.8; int8 d 64
/// decoding 263.9 / 254.8, k8v4 255.1 / 246.1. Not at d 128 for int8,
/// k8v4 and nvfp4 (their decoding kernels 1-2 % slower at ctx 4096 and 3-5 % at ctx
/// 512), nor for fp8 and k4v2 (slower).
const ATTN_V3_TWO_PRODUCERS: &[(&str, usize)] = &[("int8", 64), ("k8v4", 64), ("vq2", 64), ("vq2", 128)];

/// Threads per block of kernel v3 for cache type `kv` at `d_head` under `variant`: a
/// producer and two consumer warpgroups, or, for [`ATTN_V3_TWO_PRODUCERS`]' decoding
/// and attn-f16 kernels, two producers and two consumers.
fn attn_v3_threads(kv: &str, d_head: usize, variant: V3Variant) -> u32 {
    let two = matches!(variant, V3Variant::Decode | V3Variant::F16) && ATTN_V3_TWO_PRODUCERS.contains(&(kv, d_head));
    if two { 512 } else { 384 }
}

fn attn_v3_name(d_head: usize, kv: &str, out: &str) -> String {
    format!("attn_wgmma_d{d_head}_{kv}_{out}")
}

/// Dynamic shared memory of kernel v3: 1 KiB alignment slack, Q (BM x d_head bf16),
/// the stages of K and of V (BN x d_head bf16 each), 4 mbarriers per stage; a coded
/// cache (`raw_row_bytes` = the stored rows' bytes, K's and V's) adds two raw stages
/// of BN stored K rows and one of V rows, four mbarriers, and K's column factors (one
/// f32 per key) for each bf16 K stage; `book` (vq2) the codebook's replicated copies,
/// 128 bytes per codeword (the kernel's BOOK_BYTES: 8 copies in f32, 16 in f16).
fn attn_v3_smem_bytes(d_head: usize, raw_row_bytes: Option<(usize, usize)>, book: bool) -> usize {
    let st = attn_v3_stages(d_head);
    let raw = raw_row_bytes.map_or(0, |(kb, vb)| ATTN_V3_BN * (2 * kb + vb) + 4 * 8 + st * ATTN_V3_BN * 4);
    let book_bytes = if book { crate::kv::vq::N_CODES * 128 } else { 0 };
    1024 + ATTN_V3_BM * d_head * 2 + 2 * st * ATTN_V3_BN * d_head * 2 + 4 * st * 8 + raw + book_bytes
}

/// `AttnWgmmaArgs` of kernels/common.cuh (attn_wgmma_*'s one `__grid_constant__` parameter).
#[repr(C)]
#[derive(Clone, Copy)]
struct AttnWgmmaArgs {
    /// K cache as (d_head, kv_len, n_seqs * n_kv_heads) bf16, box (64, 128, 1).
    k: cudarc::driver::sys::CUtensorMap,
    /// V cache, the same.
    v: cudarc::driver::sys::CUtensorMap,
    q: u64,
    out: u64,
    q_stride: i64,
    out_stride: i64,
    n_tokens: i32,
    n_heads: i32,
    n_kv_heads: i32,
    pos0: i32,
    window: i32,
    scale: f32,
    softcap: f32,
    /// Windows of the pass (the kernel's persistent grid walks n_qt * n_heads * n_seqs items).
    n_seqs: i32,
}
const _: () = assert!(size_of::<AttnWgmmaArgs>() == 384 && align_of::<AttnWgmmaArgs>() == 128);
// SAFETY: plain data with the layout of the CUDA struct (asserted above); passed by value.
unsafe impl cudarc::driver::DeviceRepr for AttnWgmmaArgs {}

/// `AttnWgmmaCodedArgs` of kernels/common.cuh (attn_wgmma_d<D>_<fmt>_<out>'s parameter):
/// `a.k` / `a.v` are byte maps over the coded rows ([`tensor_map_kv_coded`]).
#[repr(C)]
#[derive(Clone, Copy)]
struct AttnWgmmaCodedArgs {
    a: AttnWgmmaArgs,
    /// Bit 0: K rows Hadamard-rotated; bit 1: V rows.
    rot: i32,
    pad_: i32,
    /// vq2's codebook (256 x 4 f32), or 0.
    book: u64,
}
const _: () = assert!(size_of::<AttnWgmmaCodedArgs>() == 512);
// SAFETY: plain data with the layout of the CUDA struct (asserted above); passed by value.
unsafe impl cudarc::driver::DeviceRepr for AttnWgmmaCodedArgs {}

/// `AttnWgmmaQkArgs` of kernels/common.cuh (attn_wgmma_d<D>_fp8qk_<out>'s parameter,
/// [`FAST_PATH_ATTN_FP8_QK`]): `c.a.k` maps the 16 bytes from byte d_head of each K row
/// (the scale), `kc` the rows' d_head code bytes, swizzled for wgmma ([`tensor_map_u8_rows`]).
#[repr(C)]
#[derive(Clone, Copy)]
struct AttnWgmmaQkArgs {
    c: AttnWgmmaCodedArgs,
    kc: cudarc::driver::sys::CUtensorMap,
}
const _: () = assert!(size_of::<AttnWgmmaQkArgs>() == 640);
// SAFETY: plain data with the layout of the CUDA struct (asserted above); passed by value.
unsafe impl cudarc::driver::DeviceRepr for AttnWgmmaQkArgs {}

/// A 3-D byte tensor map over `width` bytes of each row of one layer's coded cache
/// (n_slabs, n_ctx, rows of `row_bytes`; `ptr` the first row's first mapped byte), seen
/// as (width, kv_len, n_slabs): rows at or past kv_len read as zeros; boxes of
/// (width, ATTN_V3_BN, 1). `swizzle`: the wgmma swizzle of rows of `width` bytes (128-byte
/// for 128, 64-byte for 64), else none.
fn tensor_map_u8_rows(ptr: u64, width: usize, row_bytes: usize, kv_len: usize, n_ctx: usize, n_slabs: usize, swizzle: bool) -> Result<cudarc::driver::sys::CUtensorMap> {
    use cudarc::driver::sys;
    ensure!(
        ptr % 16 == 0 && row_bytes % 16 == 0 && width % 16 == 0 && width <= row_bytes,
        "attention v3: map of {width} of {row_bytes} bytes per row at {ptr:#x} not 16-byte aligned"
    );
    let sw = match (swizzle, width) {
        (false, _) => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        (true, 128) => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        (true, 64) => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        (true, w) => bail!("attention v3: no wgmma swizzle for rows of {w} bytes"),
    };
    let dims = [width as u64, kv_len as u64, n_slabs as u64];
    let strides = [row_bytes as u64, (n_ctx * row_bytes) as u64];
    let boxes = [width as u32, ATTN_V3_BN as u32, 1u32];
    let elem_strides = [1u32; 3];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: dims, boxes and elem_strides have rank 3's length, strides 2; the map is
    // written by the call.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            3,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sw,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    r.result().map_err(|e| anyhow!("cuTensorMapEncodeTiled (dims {dims:?}, strides {strides:?}, box {boxes:?}): {e}"))?;
    // SAFETY: the call succeeded, so it wrote the whole map.
    Ok(unsafe { map.assume_init() })
}

/// A 3-D bf16 tensor map over one layer's cache (n_slabs, n_ctx, d_head) seen as
/// (d_head, kv_len, n_slabs): rows at or past kv_len read as zeros; boxes of
/// (64, ATTN_V3_BN, 1), 128-byte swizzle.
fn tensor_map_kv(ptr: u64, d_head: usize, kv_len: usize, n_ctx: usize, n_slabs: usize) -> Result<cudarc::driver::sys::CUtensorMap> {
    ensure!(ptr % 16 == 0, "attention v3: cache base {ptr:#x} not 16-byte aligned");
    let dims = [d_head as u64, kv_len as u64, n_slabs as u64];
    let strides = [(d_head * 2) as u64, (n_ctx * d_head * 2) as u64];
    encode_bf16_map(ptr, dims, strides, [64, ATTN_V3_BN as u32, 1])
        .with_context(|| format!("attention v3: tensor map of a cache of {n_slabs} x {kv_len} (of {n_ctx}) rows of {d_head} bf16"))
}

/// A 3-D byte tensor map over one layer's coded cache (n_slabs, n_ctx, rows of
/// `row_bytes`) seen as (row_bytes, kv_len, n_slabs): rows at or past kv_len read as
/// zeros; boxes of one tile of whole rows (row_bytes, ATTN_V3_BN, 1), no swizzle.
fn tensor_map_kv_coded(ptr: u64, row_bytes: usize, kv_len: usize, n_ctx: usize, n_slabs: usize) -> Result<cudarc::driver::sys::CUtensorMap> {
    ensure!(ptr % 16 == 0 && row_bytes % 16 == 0 && row_bytes <= 256, "attention v3: coded cache base {ptr:#x} or rows of {row_bytes} bytes not 16-byte aligned (or over 256)");
    let dims = [row_bytes as u64, kv_len as u64, n_slabs as u64];
    let strides = [row_bytes as u64, (n_ctx * row_bytes) as u64];
    let boxes = [row_bytes as u32, ATTN_V3_BN as u32, 1];
    encode_map(TmaElem::U8, false, ptr, dims, strides, boxes)
        .with_context(|| format!("attention v3: tensor map of a coded cache of {n_slabs} x {kv_len} (of {n_ctx}) rows of {row_bytes} bytes"))
}

/// (queries per block, keys per tile) of `attn_flash_d<d_head>_*` for a bf16 cache or
/// (`coded`) a quantized one: the kernel's `warps(D, raw) * 16 * m_tiles(D)` and
/// `key_tile(D, raw)` (kernels/attention.cu).
pub fn attn_flash_tiles(d_head: usize, coded: bool) -> (usize, usize) {
    let m_tiles = 1;
    let key_tile = if coded && d_head > 128 { 32 } else { 64 };
    (attn_flash_warps(d_head, coded) * 16 * m_tiles, key_tile)
}

/// Warps per block of `attn_flash_d<d_head>_*`: the kernel's `warps(D, raw)`, 8 for a
/// quantized cache up to d_head 128 (each decoded tile shared by 128 query rows), else 4.
fn attn_flash_warps(d_head: usize, coded: bool) -> usize {
    if coded && d_head <= 128 {
        8
    } else {
        4
    }
}

/// Dynamic shared memory of attn_prefill (v1) for d_head and cache element size.
fn attn_smem_bytes(d_head: usize, kv_bytes: usize) -> usize {
    let kpad = if kv_bytes == 2 { 2 } else { 1 };
    16 * d_head * 4 + 32 * (d_head + kpad) * kv_bytes + 32 * d_head * kv_bytes
}

/// Dynamic shared memory of attn_flash (v2), bf16 rows padded by 8: Q (only above
/// d_head 128, the kernel's `q_in_regs`), two bf16 stages of K and of V, and for a
/// quantized cache (`raw_row_bytes` = K's and V's row bytes) two raw stages of the
/// stored rows and two stages of K's and of V's per-key f32 factors (the row scales a
/// folding decoder applies to S's and P's columns).
fn attn_flash_smem_bytes(d_head: usize, raw_row_bytes: Option<(usize, usize)>) -> usize {
    let (bq, bk) = attn_flash_tiles(d_head, raw_row_bytes.is_some());
    let row = (d_head + 8) * 2;
    let q = if d_head <= 128 { 0 } else { bq * row };
    q + 4 * bk * row + raw_row_bytes.map_or(0, |(krb, vrb)| 2 * bk * (krb + vrb) + 4 * bk * 4)
}

/// out[t, h*d_head ..] = softmax(q·Kᵀ * scale, causal/window mask) · V, per head with GQA,
/// with the chosen kernel (`AttnKernel::V2` needs a bf16 cache), except that a call for
/// v2 runs v3 (the same numerics) where [`AttnKernel::routes_to_v3`] says so (sm_90a,
/// bf16 cache, the head sizes of [`ATTN_V3_DEFAULT_HEAD_DIMS`]). [`attention_exact`] runs the
/// kernel named, always.
/// q: (n_seqs * n_tokens, q_stride) f32; caches: `shape`; out: (n_seqs * n_tokens, out_stride).
#[allow(clippy::too_many_arguments)]
pub fn attention<KV: KvElem, O: OutElem>(
    dev: &CudaDevice,
    kernel: AttnKernel,
    q: DevView<f32>,
    k_cache: DevView<KV>,
    v_cache: DevView<KV>,
    shape: KvShape,
    out: DevViewMut<O>,
    p: &AttnParams,
) -> Result<()> {
    let kernel = if kernel == AttnKernel::V2 && AttnKernel::routes_to_v3(dev, KV::NAME, shape.d_head) { AttnKernel::V3 } else { kernel };
    attention_exact::<KV, O>(dev, kernel, q, k_cache, v_cache, shape, out, p)
}

/// [`attention`] on exactly the kernel named (`V3`: a bf16 cache at d_head 64/128 on a
/// device with the sm_90a module, else an error naming what is missing).
#[allow(clippy::too_many_arguments)]
pub fn attention_exact<KV: KvElem, O: OutElem>(
    dev: &CudaDevice,
    kernel: AttnKernel,
    q: DevView<f32>,
    k_cache: DevView<KV>,
    v_cache: DevView<KV>,
    shape: KvShape,
    out: DevViewMut<O>,
    p: &AttnParams,
) -> Result<()> {
    ensure!(k_cache.len() == shape.len() && v_cache.len() == shape.len(), "attention: caches ({}, {}) vs shape {shape:?}", k_cache.len(), v_cache.len());
    let row_bytes = shape.d_head * size_of::<KV>();
    let cache = CacheRef { kv: KV::NAME, k: k_cache.ptr(), v: v_cache.ptr(), k_row_bytes: row_bytes, v_row_bytes: row_bytes, rot: 0, book: 0 };
    attention_launch::<O>(dev, kernel, q, cache, shape, out, p)
}

/// The same attention over a cache of a quantized format (K rows of
/// `kv.k`, V rows of `kv.v`, as `kv_encode` writes them; a bare `KvFormat`
/// gives the table's codecs, `KvFormat::codecs` another `--kv-rotation`), with
/// kernel v2 `attn_flash_d<D>_<format>_<out>`: its K/V tile loads decode each
/// element as src/kv decodes it and round it to bf16; a rotated K is met by
/// rotating q in the kernel, a rotated V by rotating the output back. Where
/// [`AttnKernel::routes_to_v3`] says so (fp8 at d_head 64/128 on sm_90a), kernel
/// v3 instead (`attn_wgmma_d<D>_<format>_<out>`: its producer warpgroup decodes,
/// code * scale rounded to bf16; the same rotations).
/// k_cache, v_cache: `shape.coded_bytes(kv.k)` / `(kv.v)` bytes;
/// `book`: the codebook, for vq2.
#[allow(clippy::too_many_arguments)]
pub fn attention_coded<O: OutElem>(
    dev: &CudaDevice,
    kv: impl Into<KvCodecs>,
    q: DevView<f32>,
    k_cache: DevView<u8>,
    v_cache: DevView<u8>,
    shape: KvShape,
    out: DevViewMut<O>,
    p: &AttnParams,
    book: Option<&VqBook>,
) -> Result<()> {
    let kv = kv.into();
    let kernel = if AttnKernel::routes_to_v3(dev, kv.format.name(), shape.d_head) { AttnKernel::V3 } else { AttnKernel::V2 };
    attention_coded_exact::<O>(dev, kernel, kv, q, k_cache, v_cache, shape, out, p, book)
}

/// [`attention_coded`] on exactly the kernel named: V2, or V3 (every quantized format
/// at d_head 64/128 on a device with the sm_90a module, else an error naming what is
/// missing).
#[allow(clippy::too_many_arguments)]
pub fn attention_coded_exact<O: OutElem>(
    dev: &CudaDevice,
    kernel: AttnKernel,
    kv: impl Into<KvCodecs>,
    q: DevView<f32>,
    k_cache: DevView<u8>,
    v_cache: DevView<u8>,
    shape: KvShape,
    out: DevViewMut<O>,
    p: &AttnParams,
    book: Option<&VqBook>,
) -> Result<()> {
    let KvCodecs { format, k: kc, v: vc } = kv.into();
    ensure!(format.is_quantized(), "attention {format}: not a quantized format (bf16 and f32 caches run ops::attention)");
    let (nk, nv) = (shape.coded_bytes(kc), shape.coded_bytes(vc));
    ensure!(
        k_cache.len() == nk && v_cache.len() == nv,
        "attention {format}: caches of ({}, {}) bytes, shape {shape:?} needs ({nk}, {nv})",
        k_cache.len(),
        v_cache.len()
    );
    format.check_dims(shape.d_head, shape.d_head).with_context(|| format!("attention {format}"))?;
    let uses_book = kc.elem == ElemCodec::Vq2 || vc.elem == ElemCodec::Vq2;
    let book = if uses_book { book_ptr(ElemCodec::Vq2, book, "attention")? } else { 0 };
    let cache = CacheRef {
        kv: format.name(),
        k: k_cache.ptr(),
        v: v_cache.ptr(),
        k_row_bytes: kc.row_bytes(shape.d_head),
        v_row_bytes: vc.row_bytes(shape.d_head),
        rot: i32::from(kc.rotate) | (i32::from(vc.rotate) << 1),
        book,
    };
    ensure!(kernel != AttnKernel::V1, "attention {format}: kernel v1 reads bf16 or f32 caches; a quantized cache runs kernel v2 or v3");
    attention_launch::<O>(dev, kernel, q, cache, shape, out, p)
}

/// [`attention_coded_exact`] with kernel v3 and the named fast path
/// [`FAST_PATH_ATTN_FP8_QK`] (`attn_wgmma_d<D>_fp8qk_<out>`): an fp8 cache at d_head 64 or
/// 128 on sm_90a, S = Q·Kᵀ by e4m3 wgmma on K's stored codes (q as e4m3 hi + lo times a
/// per-row power of two, K's row scales folded into S's columns); V as kernel v3's fp8.
/// H200, causal ctx 4096, TFLOP/s, this / v3 fp8 / v3 bf16 in the same call (qk9,
/// 2026-12-02 14:37 UTC): d 128 372.3 / 329.7 / 424.2, d 64 245.9 / 267.4 / 296.6
/// (docs/performance.md); parity: tests/gpu_ops.rs `attention_v3_fp8_qk_against_cpu_backend`.
#[allow(clippy::too_many_arguments)]
pub fn attention_coded_fp8_qk<O: OutElem>(
    dev: &CudaDevice,
    kv: impl Into<KvCodecs>,
    q: DevView<f32>,
    k_cache: DevView<u8>,
    v_cache: DevView<u8>,
    shape: KvShape,
    out: DevViewMut<O>,
    p: &AttnParams,
) -> Result<()> {
    attention_coded_v3_fast::<O>(dev, V3Variant::QkCodes, kv.into(), q, k_cache, v_cache, shape, out, p, None)
}

/// [`attention_coded_exact`] with kernel v3 and the named fast path
/// [`FAST_PATH_ATTN_INT8_QK`] (`attn_wgmma_d<D>_<int8|k8v4>qk_f32`): an int8 or k8v4 cache
/// (K rows of int8 codes and an f32 scale in both) at d_head 64 or 128 on sm_90a, S =
/// Q·Kᵀ on K's stored codes: since qh by f16 wgmma, the producer writing the codes in
/// f16 (exact) and q rounded to f16 times a power of two per row (qk10/qk11 had s8
/// wgmma on the codes as stored and q as int8 hi + lo / 256: slower at every shape
/// measured), K's row scales folded into S's columns as attn-fp8-qk; since pv16 P·V in
/// f16 on V's codes (each V element code * f16(scale * 2^-e), e a power of two per key
/// tile, O rescaled between tiles; kernels/attention_sm90a.cu, "The named fast path
/// attn-int8-qk" and "P·V under attn-int8-qk").
/// f32 output only (as the int8 and k8v4 kernels). Parity: tests/gpu_ops.rs
/// `attention_v3_int8_qk_against_cpu_backend`.
#[allow(clippy::too_many_arguments)]
pub fn attention_coded_int8_qk<O: OutElem>(
    dev: &CudaDevice,
    kv: impl Into<KvCodecs>,
    q: DevView<f32>,
    k_cache: DevView<u8>,
    v_cache: DevView<u8>,
    shape: KvShape,
    out: DevViewMut<O>,
    p: &AttnParams,
) -> Result<()> {
    attention_coded_v3_fast::<O>(dev, V3Variant::QkF16, kv.into(), q, k_cache, v_cache, shape, out, p, None)
}

/// [`attention_coded_exact`] with kernel v3 and the named fast path
/// [`FAST_PATH_ATTN_F16`] (`attn_wgmma_d<D>_<nvfp4|k4v2|vq2>f16_f32`): an nvfp4, k4v2 or
/// vq2 cache at d_head 64 or 128 on sm_90a, the producer decoding K and V to f16 (each
/// element code value * f16(scale * 2^-e), e a power of two per key tile; nvfp4's
/// e2m1 / 64 exact in f16 times f16(e4m3 * f16(S * 64 * 2^-e)) since c2; vq2's codewords
/// from f16 copies of the codebook, one per lane a load serves, since vqbook), q in f16 times a power of two per row, S and P·V by f16 wgmma, K's
/// power of two folded into S's columns, O rescaled between tiles as attn-int8-qk's
/// (kernels/attention_sm90a.cu, "attn-f16"). f32 output only. Parity:
/// tests/gpu_ops.rs `attention_v3_f16_against_cpu_backend`.
#[allow(clippy::too_many_arguments)]
pub fn attention_coded_f16<O: OutElem>(
    dev: &CudaDevice,
    kv: impl Into<KvCodecs>,
    q: DevView<f32>,
    k_cache: DevView<u8>,
    v_cache: DevView<u8>,
    shape: KvShape,
    out: DevViewMut<O>,
    p: &AttnParams,
    book: Option<&VqBook>,
) -> Result<()> {
    attention_coded_v3_fast::<O>(dev, V3Variant::F16, kv.into(), q, k_cache, v_cache, shape, out, p, book)
}

/// The fast path of `variant` (attn-fp8-qk, attn-int8-qk or attn-f16) over a coded
/// cache: the format, head size, cache lengths and output type (f32, or bf16 for
/// attn-fp8-qk) checked, then kernel v3.
#[allow(clippy::too_many_arguments)]
fn attention_coded_v3_fast<O: OutElem>(
    dev: &CudaDevice,
    variant: V3Variant,
    kv: KvCodecs,
    q: DevView<f32>,
    k_cache: DevView<u8>,
    v_cache: DevView<u8>,
    shape: KvShape,
    out: DevViewMut<O>,
    p: &AttnParams,
    book: Option<&VqBook>,
) -> Result<()> {
    let KvCodecs { format, k: kc, v: vc } = kv;
    let name = variant.fast_path().context("attention: kernel v3's decoding kernel is not a fast path")?;
    ensure!(variant.reads(format), "attention: {name} reads a {} cache, not {format}", variant.formats());
    ensure!(
        fast_path_covers(dev, variant, format, shape.d_head),
        "attention: {name} has no kernel at d_head {} on this device (d_head 64 or 128, sm_90a)",
        shape.d_head
    );
    let (nk, nv) = (shape.coded_bytes(kc), shape.coded_bytes(vc));
    ensure!(k_cache.len() == nk && v_cache.len() == nv, "attention {format}: caches of ({}, {}) bytes, shape {shape:?} needs ({nk}, {nv})", k_cache.len(), v_cache.len());
    format.check_dims(shape.d_head, shape.d_head).with_context(|| format!("attention {format}"))?;
    let uses_book = kc.elem == ElemCodec::Vq2 || vc.elem == ElemCodec::Vq2;
    let cache = CacheRef {
        kv: format.name(),
        k: k_cache.ptr(),
        v: v_cache.ptr(),
        k_row_bytes: kc.row_bytes(shape.d_head),
        v_row_bytes: vc.row_bytes(shape.d_head),
        rot: i32::from(kc.rotate) | (i32::from(vc.rotate) << 1),
        book: if uses_book { book_ptr(ElemCodec::Vq2, book, "attention")? } else { 0 },
    };
    attention_launch_checks(q, shape, &out, p)?;
    if p.n_seqs * p.n_tokens == 0 {
        return Ok(());
    }
    ensure!(O::NAME == "f32" || variant == V3Variant::QkCodes, "attention: {name} writes f32 output (as the {format} decoding kernel)");
    attention_v3::<O>(dev, q, &cache, shape, out, p, variant)
}

pub use crate::backend::FAST_PATH_ATTN_FP8_QK;
pub use crate::backend::FAST_PATH_ATTN_F16;
pub use crate::backend::FAST_PATH_ATTN_INT8_QK;

/// The (format, head sizes) at which the default route runs [`FAST_PATH_ATTN_INT8_QK`]
/// unless it is turned off: where the H200 measured it faster than kernel v3's decoding
/// kernel of that format (qk10, 2026-12-02 15:30 UTC, causal ctx 4096, TFLOP/s, fast
/// path / decoding kernel: int8 d 128 317.1 / 302.7, k8v4 d 128 303.1 / 293.0; at d 64
/// slower, 220.1 / 246.0 and 212.8 / 240.1, so d 64 keeps the decoding kernel unless
/// named; at ctx 512 d 128 also slower, 137.7 / 147.0 and 136.1 / 144.6:
/// docs/performance.md). Since qh (the f16 kernel, 2026-12-03 13:13 UTC): int8 d 128
/// 339.5 / 306.2, k8v4 330.7 / 295.2; d 64 still slower (235.5 / 248.7, 233.3 / 242.6),
/// ctx 512 d 128 too (144.0 / 149.8, 141.5 / 146.2). Since pp (2026-12-04: ping-pong
/// between the consumer warpgroups in the fast path's kernels, not in the d 64 decoding
/// kernels) k8v4 at d 64 runs it by default: ctx 4096 d 64 263.5 / 250.4 and 265.1 /
/// 254.2 in two calls, ctx 512 d 64 126.1 / 125.2; int8 at d 64 measured level (262.6 /
/// 260.8 and 265.8 / 262.8, ctx 512 124.6 / 124.2) and keeps the decoding kernel
/// (docs/performance.md, "pp").
pub const ATTN_INT8_QK_DEFAULT_HEAD_DIMS: &[(KvFormat, &[usize])] = &[(KvFormat::Int8, &[128]), (KvFormat::K8v4, &[64, 128])];

/// Whether the default route runs [`FAST_PATH_ATTN_INT8_QK`] for `format` at `d_head`
/// ([`ATTN_INT8_QK_DEFAULT_HEAD_DIMS`]).
pub fn attn_int8_qk_default(format: KvFormat, d_head: usize) -> bool {
    ATTN_INT8_QK_DEFAULT_HEAD_DIMS.iter().any(|(f, dims)| *f == format && dims.contains(&d_head))
}

/// Whether [`attention_coded_int8_qk`] has a kernel for `format` (int8 or k8v4) at
/// `d_head` on this device.
pub fn attn_int8_qk_covers(dev: &CudaDevice, format: KvFormat, d_head: usize) -> bool {
    fast_path_covers(dev, V3Variant::QkF16, format, d_head)
}

/// The (format, head sizes) at which the default route runs [`FAST_PATH_ATTN_F16`]
/// unless it is turned off: where the H200 measured it faster than kernel v3's decoding
/// kernel at the tool's default context. prod56 (2026-12-03 17:59 UTC, both kernels with
/// the decoders at 56 registers; causal ctx 4096, TFLOP/s, fast path / decoding kernel,
/// mean of two rounds): d 128 nvfp4 294.8 / 286.5, k4v2 306.5 / 289.9, vq2 283.5 / 258.6;
/// 8B 32/8 nvfp4 314.0 / 304.5, k4v2 327.5 / 309.4, vq2 303.0 / 279.9; d 64 k4v2 243.4 /
/// 237.7, vq2 244.8 / 228.8, nvfp4 238.3 / 244.0 (so nvfp4 at d 64 keeps the decoding
/// kernel unless named). At ctx 512 d 128 the fast path is 0.4-5 % slower (nvfp4 147.6 /
/// 154.8). Before prod56 (attn-f16, 14:37 UTC) k4v2 had measured no faster (d 128 286.6
/// / 287.6) and was not on by default (docs/performance.md, "Issue 11: prod56"). Since
/// vqbook (2026-12-03 20:05 UTC: vq2's codebook one copy per lane, no bank conflicts; mean
/// of two rounds) vq2's decoding kernel is faster at d 64, 257.1 / 247.3, so d 64 keeps
/// it; at d 128 the fast path still leads, 308.1 / 300.5 (8B 330.9 / 318.0). Since pp
/// (2026-12-04: ping-pong between the consumer warpgroups) nvfp4 at d 64 runs the fast
/// path by default too: ctx 4096 d 64 267.5 / 256.8 and 269.4 / 258.2 in two calls (at
/// ctx 512 d 64 slower, 125.8 / 129.4: the tool's default context decides, as at d 128);
/// vq2 at d 64 still keeps the decoding kernel (266.1 / 249.9) (docs/performance.md, "pp").
pub const ATTN_F16_DEFAULT_HEAD_DIMS: &[(KvFormat, &[usize])] =
    &[(KvFormat::Nvfp4, &[64, 128]), (KvFormat::K4v2, &[64, 128]), (KvFormat::Vq2, &[128])];

/// Whether the default route runs [`FAST_PATH_ATTN_F16`] for `format` at `d_head`
/// ([`ATTN_F16_DEFAULT_HEAD_DIMS`]).
pub fn attn_f16_default(format: KvFormat, d_head: usize) -> bool {
    ATTN_F16_DEFAULT_HEAD_DIMS.iter().any(|(f, dims)| *f == format && dims.contains(&d_head))
}

/// Whether [`attention_coded_f16`] has a kernel for `format` (nvfp4, k4v2 or vq2) at
/// `d_head` on this device.
pub fn attn_f16_covers(dev: &CudaDevice, format: KvFormat, d_head: usize) -> bool {
    fast_path_covers(dev, V3Variant::F16, format, d_head)
}

/// Whether the fast path `variant` has a kernel for `format` at `d_head` on this device.
fn fast_path_covers(dev: &CudaDevice, variant: V3Variant, format: KvFormat, d_head: usize) -> bool {
    variant.reads(format) && ATTN_V3_HEAD_DIMS.contains(&d_head) && dev.has_function(&attn_v3_name(d_head, &variant.kv_name(format.name()), "f32"))
}

/// The head sizes at which the default route runs [`FAST_PATH_ATTN_FP8_QK`] for an fp8
/// cache unless it is turned off: where the H200 measured it faster than kernel v3's
/// decoding fp8 kernel. None since 2026-12-04: qk9 had measured it faster at d 128
/// (causal ctx 4096, 372.3 against 329.7 TFLOP/s; at d 64 slower, 245.9 against 267.4),
/// but since e4m3 halves the decoding kernel is within 1.3 % of it at ctx 4096 d 128 b4
/// h16 and faster at the other d 128 shapes. H200, TFLOP/s, decoding / fast path, three
/// calls (2026-12-04 16:55, 17:29 and 17:36 UTC; six, three and two samples): ctx 4096 d
/// 128 375.2 / 377.4, 375.1 / 377.1, 372.4 / 377.4; 8B 32/8 ctx 4096 400.1 / 395.6,
/// 399.4 / 396.2, 399.0 / 396.0; ctx 512 d 128 193.9 / 184.8; d 64 273.4 / 250.6
/// (docs/performance.md, "hadd"). `--fast-path attn-fp8-qk` still runs it at d 64 and
/// 128.
pub const ATTN_FP8_QK_DEFAULT_HEAD_DIMS: &[usize] = &[];

/// Whether [`attention_coded_fp8_qk`] has a kernel for `d_head` on this device.
pub fn attn_fp8_qk_covers(dev: &CudaDevice, d_head: usize) -> bool {
    fast_path_covers(dev, V3Variant::QkCodes, KvFormat::Fp8, d_head)
}

/// One layer's K and V caches as a kernel sees them (lengths checked by the caller).
struct CacheRef {
    /// Kernel-name suffix of the cache type: bf16, f32, or a quantized format's name.
    kv: &'static str,
    k: u64,
    v: u64,
    /// Bytes between rows.
    k_row_bytes: usize,
    v_row_bytes: usize,
    /// AttnArgs::rot.
    rot: i32,
    /// The vq2 codebook, or 0.
    book: u64,
}

/// The checks every attention launch makes (shapes, GQA, positions, q and out lengths).
fn attention_launch_checks<O: OutElem>(q: DevView<f32>, shape: KvShape, out: &DevViewMut<O>, p: &AttnParams) -> Result<()> {
    let d = shape.d_head;
    ensure!(ATTN_HEAD_DIMS.contains(&d), "attention: d_head {d} has no kernel (built: {ATTN_HEAD_DIMS:?})");
    ensure!(
        shape.n_kv_heads > 0 && p.n_heads % shape.n_kv_heads == 0,
        "attention: n_heads {} is not a multiple of n_kv_heads {}",
        p.n_heads,
        shape.n_kv_heads
    );
    ensure!(p.pos0 + p.n_tokens <= shape.n_ctx, "attention: positions up to {} past the cache's {} slots", p.pos0 + p.n_tokens, shape.n_ctx);
    ensure!(p.n_seqs <= shape.n_seqs, "attention: {} windows, the cache has {} slots", p.n_seqs, shape.n_seqs);
    ensure!(p.softcap >= 0.0 && p.softcap.is_finite(), "attention: soft-cap {}", p.softcap);
    let n_rows = p.n_seqs * p.n_tokens;
    Rows { n_rows, n_cols: p.n_heads * d, stride: p.q_stride }.check(q.len(), "attention", "q")?;
    Rows { n_rows, n_cols: p.n_heads * d, stride: p.out_stride }.check(out.len(), "attention", "out")?;
    Ok(())
}

fn attention_launch<O: OutElem>(
    dev: &CudaDevice,
    kernel: AttnKernel,
    q: DevView<f32>,
    cache: CacheRef,
    shape: KvShape,
    out: DevViewMut<O>,
    p: &AttnParams,
) -> Result<()> {
    let d = shape.d_head;
    attention_launch_checks(q, shape, &out, p)?;
    let n_rows = p.n_seqs * p.n_tokens;
    if n_rows == 0 {
        return Ok(());
    }
    let (name, smem, block_q, threads) = match kernel {
        AttnKernel::V3 => return attention_v3::<O>(dev, q, &cache, shape, out, p, V3Variant::Decode),
        AttnKernel::V1 => {
            ensure!(
                matches!(cache.kv, "bf16" | "f32"),
                "attention kernel v1 reads bf16 or f32 caches; a {} cache runs kernel v2",
                cache.kv
            );
            (format!("attn_prefill_d{d}_{}_{}", cache.kv, O::NAME), attn_smem_bytes(d, cache.k_row_bytes / d), 16u32, 128u32)
        }
        AttnKernel::V2 => {
            ensure!(
                cache.kv != "f32",
                "attention kernel v2 (tensor cores) reads a bf16 or quantized cache; a {} cache runs kernel v1",
                cache.kv
            );
            // float4 loads of q, 16-byte loads of cache rows, paired stores of out.
            ensure!(q.ptr() % 16 == 0 && p.q_stride % 4 == 0, "attention v2: q must be 16-byte aligned with a stride that is a multiple of 4");
            ensure!(
                cache.k % 16 == 0 && cache.v % 16 == 0 && cache.k_row_bytes % 16 == 0 && cache.v_row_bytes % 16 == 0,
                "attention v2: the caches must be 16-byte aligned"
            );
            ensure!(out.ptr() % 8 == 0 && p.out_stride % 2 == 0, "attention v2: out must be 8-byte aligned with an even stride");
            let raw = (!matches!(cache.kv, "bf16")).then_some((cache.k_row_bytes, cache.v_row_bytes));
            let threads = 32 * attn_flash_warps(d, raw.is_some()) as u32;
            (format!("attn_flash_d{d}_{}_{}", cache.kv, O::NAME), attn_flash_smem_bytes(d, raw), attn_flash_tiles(d, raw.is_some()).0 as u32, threads)
        }
    };
    let f = func(dev, &name)?;
    ensure!(
        smem <= dev.info().max_smem_per_block_bytes as usize,
        "attention: {name} needs {smem} bytes of shared memory, the device allows {}",
        dev.info().max_smem_per_block_bytes
    );
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| anyhow!("{name}: raising dynamic shared memory to {smem} bytes: {e}"))?;
    let nt = i32_of(p.n_tokens, "n_tokens")?;
    let (nh, nkv, nc) = (i32_of(p.n_heads, "n_heads")?, i32_of(shape.n_kv_heads, "n_kv_heads")?, i32_of(shape.n_ctx, "n_ctx")?);
    let (p0, win) = (i32_of(p.pos0, "pos0")?, i32_of(p.window, "window")?);
    let (qs, os) = (p.q_stride as i64, p.out_stride as i64);
    let grid = (grid_1d(p.n_tokens, block_q)?, u32::try_from(p.n_heads)?, u32::try_from(p.n_seqs)?);
    ensure!(grid.1 <= 65535 && grid.2 <= 65535, "attention: {} heads x {} windows exceed the grid", p.n_heads, p.n_seqs);
    let (qp, kp, vp, op) = (q.ptr(), cache.k, cache.v, out.ptr());
    let mut b = dev.stream().launch_builder(f);
    let args = AttnArgs {
        q: qp,
        k: kp,
        v: vp,
        out: op,
        n_tokens: nt,
        n_heads: nh,
        n_kv_heads: nkv,
        n_ctx: nc,
        pos0: p0,
        window: win,
        scale: p.scale,
        softcap: p.softcap,
        q_stride: qs,
        out_stride: os,
        k_row_bytes: i32_of(cache.k_row_bytes, "k_row_bytes")?,
        v_row_bytes: i32_of(cache.v_row_bytes, "v_row_bytes")?,
        rot: cache.rot,
        pad_: 0,
        book: cache.book,
    };
    match kernel {
        AttnKernel::V1 => {
            b.arg(&qp).arg(&kp).arg(&vp).arg(&op).arg(&nt).arg(&nh).arg(&nkv).arg(&nc).arg(&p0).arg(&win).arg(&p.scale).arg(&p.softcap).arg(&qs).arg(&os);
        }
        AttnKernel::V2 | AttnKernel::V3 => {
            b.arg(&args);
        }
    }
    // SAFETY: arguments match `attn_prefill_d<D>_<kv>_<out>` (v1, positional) or
    // `attn_flash_d<D>_<kv>_<out>` (v2, one AttnArgs) in kernels/attention.cu; q, out and
    // both caches checked above and by the callers (lengths; v2: alignment too); dynamic
    // shared memory set to the kernel's need.
    unsafe { b.launch(cfg(grid, threads, smem as u32)) }.map_err(|e| launch_err(&name, e))?;
    Ok(())
}

/// Which kernel v3 reads a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum V3Variant {
    /// `attn_wgmma_d<D>_<kv>_<out>`: bf16, or the producer decodes K and V.
    Decode,
    /// `..._fp8qk_<out>` (attn-fp8-qk): K's codes by TMA as stored (`AttnWgmmaQkArgs`).
    QkCodes,
    /// `..._<kv>qk_<out>` (attn-int8-qk): K's codes decoded to f16 by the producer.
    QkF16,
    /// `..._<kv>f16_<out>` (attn-f16): K and V decoded to f16 by the producer.
    F16,
}

impl V3Variant {
    /// The kernel-name part of the cache type (`attn_wgmma_d<D>_<this>_<out>`).
    fn kv_name(self, kv: &str) -> String {
        match self {
            Self::Decode => kv.to_string(),
            Self::QkCodes | Self::QkF16 => format!("{kv}qk"),
            Self::F16 => format!("{kv}f16"),
        }
    }

    /// The named fast path this variant is (none for the decoding kernel).
    fn fast_path(self) -> Option<&'static str> {
        match self {
            Self::Decode => None,
            Self::QkCodes => Some(FAST_PATH_ATTN_FP8_QK),
            Self::QkF16 => Some(FAST_PATH_ATTN_INT8_QK),
            Self::F16 => Some(FAST_PATH_ATTN_F16),
        }
    }

    /// The formats whose caches this variant reads, for messages.
    fn formats(self) -> &'static str {
        match self {
            Self::Decode => "bf16 or quantized",
            Self::QkCodes => "fp8",
            Self::QkF16 => "int8 or k8v4",
            Self::F16 => "nvfp4, k4v2 or vq2",
        }
    }

    /// Whether this variant reads a `format` cache.
    fn reads(self, format: KvFormat) -> bool {
        match self {
            Self::Decode => true,
            Self::QkCodes => format == KvFormat::Fp8,
            Self::QkF16 => matches!(format, KvFormat::Int8 | KvFormat::K8v4),
            Self::F16 => matches!(format, KvFormat::Nvfp4 | KvFormat::K4v2 | KvFormat::Vq2),
        }
    }
}

/// Kernel v3 (`attn_wgmma_d<D>_<kv>_<out>`, kv of [`ATTN_V3_KV`]) for a call `attention_launch` checked
/// (shapes, GQA, positions, q and out lengths).
fn attention_v3<O: OutElem>(dev: &CudaDevice, q: DevView<f32>, cache: &CacheRef, shape: KvShape, out: DevViewMut<O>, p: &AttnParams, variant: V3Variant) -> Result<()> {
    let d = shape.d_head;
    let qk = variant != V3Variant::Decode;
    ensure!(
        !qk || cache.kv.parse::<KvFormat>().is_ok_and(|f| variant.reads(f)),
        "attention: {} reads a {} cache, not {}",
        variant.fast_path().unwrap_or("kernel v3"),
        variant.formats(),
        cache.kv
    );
    ensure!(
        ATTN_V3_KV.contains(&cache.kv),
        "attention kernel v3 reads a bf16 or quantized cache ({ATTN_V3_KV:?}); a {} cache runs kernel v2",
        cache.kv
    );
    ensure!(ATTN_V3_HEAD_DIMS.contains(&d), "attention kernel v3: d_head {d} has no kernel (built: {ATTN_V3_HEAD_DIMS:?}); it runs kernel v2");
    let coded = cache.kv != "bf16";
    let kv_name = variant.kv_name(cache.kv);
    let name = attn_v3_name(d, &kv_name, O::NAME);
    ensure!(
        dev.has_function(&name),
        "attention kernel v3: {name} is not loaded (it needs a compute capability 9.0 device and nvcc at build time)"
    );
    ensure!(q.ptr() % 16 == 0 && p.q_stride % 4 == 0, "attention v3: q must be 16-byte aligned with a stride that is a multiple of 4");
    ensure!(out.ptr() % 8 == 0 && p.out_stride % 2 == 0, "attention v3: out must be 8-byte aligned with an even stride");
    // A coded cache: the stored rows of the kernel's row structs.
    let (k_row_bytes, v_row_bytes) = if coded {
        attn_v3_coded_row_bytes(cache.kv, d).with_context(|| format!("attention kernel v3: no row decoder for a {} cache", cache.kv))?
    } else {
        (2 * d, 2 * d)
    };
    let uses_book = cache.kv == "vq2";
    ensure!(!uses_book || cache.book != 0, "attention kernel v3: a vq2 cache needs the codebook (ops::VqBook)");
    ensure!(
        !coded || (cache.k_row_bytes == k_row_bytes && cache.v_row_bytes == v_row_bytes),
        "attention kernel v3: {} rows of ({}, {}) bytes, expected ({k_row_bytes}, {v_row_bytes})",
        cache.kv,
        cache.k_row_bytes,
        cache.v_row_bytes
    );
    let f = func(dev, &name)?;
    // attn-fp8-qk, attn-int8-qk, attn-f16: K's factors have 2 ST slots (not ST), and BM
    // f32 of the query rows' 1 / sq follow, then 32 bytes for the tile exponents (4 warp
    // maxima, one exponent per stage); attn-fp8-qk's raw K stages hold 16 bytes per row
    // (the scales), the others' the stored rows.
    let smem = if qk {
        let raw_k_row_bytes = if variant == V3Variant::QkCodes { 16 } else { k_row_bytes };
        attn_v3_smem_bytes(d, Some((raw_k_row_bytes, v_row_bytes)), uses_book) + attn_v3_stages(d) * ATTN_V3_BN * 4 + ATTN_V3_BM * 4 + 32
    } else {
        attn_v3_smem_bytes(d, coded.then_some((k_row_bytes, v_row_bytes)), uses_book)
    };
    ensure!(
        smem <= dev.info().max_smem_per_block_bytes as usize,
        "attention: {name} needs {smem} bytes of shared memory, the device allows {}",
        dev.info().max_smem_per_block_bytes
    );
    f.set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
        .map_err(|e| anyhow!("{name}: raising dynamic shared memory to {smem} bytes: {e}"))?;
    let kv_len = p.pos0 + p.n_tokens;
    let n_slabs = p.n_seqs * shape.n_kv_heads;
    let map = |ptr, row_bytes| {
        if coded {
            tensor_map_kv_coded(ptr, row_bytes, kv_len, shape.n_ctx, n_slabs)
        } else {
            tensor_map_kv(ptr, d, kv_len, shape.n_ctx, n_slabs)
        }
    };
    let args = AttnWgmmaArgs {
        k: if variant == V3Variant::QkCodes {
            tensor_map_u8_rows(cache.k + d as u64, 16, k_row_bytes, kv_len, shape.n_ctx, n_slabs, false)?
        } else {
            map(cache.k, k_row_bytes)?
        },
        v: map(cache.v, v_row_bytes)?,
        q: q.ptr(),
        out: out.ptr(),
        q_stride: p.q_stride as i64,
        out_stride: p.out_stride as i64,
        n_tokens: i32_of(p.n_tokens, "n_tokens")?,
        n_heads: i32_of(p.n_heads, "n_heads")?,
        n_kv_heads: i32_of(shape.n_kv_heads, "n_kv_heads")?,
        pos0: i32_of(p.pos0, "pos0")?,
        window: i32_of(p.window, "window")?,
        scale: p.scale,
        softcap: p.softcap,
        n_seqs: i32_of(p.n_seqs, "n_seqs")?,
    };
    // A persistent grid: one block per SM at most, each walking the work items
    // (query tile, head, window) longest causal rows first.
    let n_items = p.n_tokens.div_ceil(ATTN_V3_BM) * p.n_heads * p.n_seqs;
    ensure!(n_items <= i32::MAX as usize, "attention: {n_items} work items exceed kernel v3's 32-bit item index");
    let grid = (n_items.min(dev.info().n_sms.max(1) as usize) as u32, 1, 1);
    let coded_args = AttnWgmmaCodedArgs { a: args, rot: cache.rot, pad_: 0, book: cache.book };
    let qk_args = if variant == V3Variant::QkCodes {
        Some(AttnWgmmaQkArgs { c: coded_args, kc: tensor_map_u8_rows(cache.k, d, k_row_bytes, kv_len, shape.n_ctx, n_slabs, true)? })
    } else {
        None
    };
    let mut b = dev.stream().launch_builder(f);
    if let Some(qa) = &qk_args {
        b.arg(qa);
    } else if coded {
        b.arg(&coded_args);
    } else {
        b.arg(&args);
    }
    // SAFETY: `args` mirrors AttnWgmmaArgs of kernels/common.cuh, `coded_args`
    // AttnWgmmaCodedArgs, `qk_args` AttnWgmmaQkArgs (sizes asserted), the one the kernel
    // named takes; the tensor maps
    // cover the first p.n_seqs slots' positions [0, pos0 + n_tokens) of both caches
    // (lengths checked by the callers, coded row bytes above); q and out checked by
    // attention_launch and above; a vq2 cache's codebook pointer checked by book_ptr (256
    // x 4 f32, 16-byte aligned); dynamic shared memory set to the kernel's need.
    unsafe { b.launch(cfg(grid, attn_v3_threads(cache.kv, d, variant), smem as u32)) }.map_err(|e| launch_err(&name, e))?;
    Ok(())
}

// ------------------------------------------------------------------ LM head

/// Largest top-k the reduction keeps per row.
pub const MAX_TOP_K: usize = 64;

/// Device outputs of the LM head for `n_rows` positions.
#[derive(Debug)]
pub struct LmHeadOut {
    /// (n_rows) max logit.
    pub row_max: DeviceBuffer<f32>,
    /// (n_rows) sum of exp(logit - max), f64.
    pub row_sumexp: DeviceBuffer<f64>,
    /// (n_rows) logit of the target (NaN without one).
    pub target_logit: DeviceBuffer<f32>,
    /// (n_rows, k)
    pub topk_ids: DeviceBuffer<i32>,
    /// (n_rows, k)
    pub topk_logits: DeviceBuffer<f32>,
    pub k: usize,
}

/// The same numbers on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct LmHeadHost {
    pub row_max: Vec<f32>,
    pub row_sumexp: Vec<f64>,
    pub target_logit: Vec<f32>,
    pub topk_ids: Vec<i32>,
    pub topk_logits: Vec<f32>,
    pub k: usize,
}

impl LmHeadOut {
    pub fn new(dev: &CudaDevice, n_rows: usize, k: usize) -> Result<Self> {
        ensure!(k <= MAX_TOP_K, "lm head: top-k {k} above the maximum {MAX_TOP_K}");
        Ok(Self {
            row_max: dev.alloc_zeros(n_rows)?,
            row_sumexp: dev.alloc_zeros(n_rows)?,
            target_logit: dev.alloc_zeros(n_rows)?,
            topk_ids: dev.alloc_zeros(n_rows * k)?,
            topk_logits: dev.alloc_zeros(n_rows * k)?,
            k,
        })
    }

    pub fn n_rows(&self) -> usize {
        self.row_max.len()
    }

    pub fn download(&self, dev: &CudaDevice) -> Result<LmHeadHost> {
        Ok(LmHeadHost {
            row_max: dev.download(&self.row_max)?,
            row_sumexp: dev.download(&self.row_sumexp)?,
            target_logit: dev.download(&self.target_logit)?,
            topk_ids: dev.download(&self.topk_ids)?,
            topk_logits: dev.download(&self.topk_logits)?,
            k: self.k,
        })
    }
}

/// Reduces a logits block (n_rows, ld) into rows [row0, row0 + n_rows) of `out`.
pub fn lmhead_reduce(
    dev: &CudaDevice,
    logits: DevView<f32>,
    n_rows: usize,
    n_vocab: usize,
    ld: usize,
    targets: DevView<i32>,
    out: &mut LmHeadOut,
    row0: usize,
) -> Result<()> {
    Rows { n_rows, n_cols: n_vocab, stride: ld }.check(logits.len(), "lmhead_reduce", "logits")?;
    ensure!(targets.len() == n_rows, "lmhead_reduce: {} targets for {n_rows} rows", targets.len());
    ensure!(row0 + n_rows <= out.n_rows(), "lmhead_reduce: rows {row0}..{} past the {} outputs", row0 + n_rows, out.n_rows());
    let k = out.k;
    ensure!(k <= n_vocab, "lmhead_reduce: top-k {k} above the vocabulary {n_vocab}");
    if n_rows == 0 {
        return Ok(());
    }
    let f = func(dev, "lmhead_reduce")?;
    let (lp, tp) = (logits.ptr(), targets.ptr());
    let mx = out.row_max.slice(row0..row0 + n_rows)?.ptr();
    let se = out.row_sumexp.slice(row0..row0 + n_rows)?.ptr();
    let tl = out.target_logit.slice(row0..row0 + n_rows)?.ptr();
    let ti = out.topk_ids.slice(row0 * k..(row0 + n_rows) * k)?.ptr();
    let tv = out.topk_logits.slice(row0 * k..(row0 + n_rows) * k)?.ptr();
    let (ldi, nv, ki) = (ld as i64, i32_of(n_vocab, "n_vocab")?, k as i32);
    let mut b = dev.stream().launch_builder(f);
    b.arg(&lp).arg(&ldi).arg(&nv).arg(&tp).arg(&ki).arg(&mx).arg(&se).arg(&tl).arg(&ti).arg(&tv);
    // SAFETY: arguments match `lmhead_reduce` in kernels/lmhead.cu; logits layout, targets and
    // the output row range checked above; k <= 64 (LmHeadOut::new).
    unsafe { b.launch(cfg((n_rows as u32, 1, 1), 512, 0)) }.map_err(|e| launch_err("lmhead_reduce", e))?;
    Ok(())
}

/// Bytes of the LM head's f32 logits tile (the scratch kept between calls): a
/// (256, n_vocab) tile for gemma3's 262k vocabulary.
pub const LM_HEAD_TILE_BYTES: usize = 256 << 20;

/// Rows per LM-head tile for a vocabulary of `n_vocab`: as many as fit
/// [`LM_HEAD_TILE_BYTES`], a multiple of 128, from 256 to 2048. Each tile reads the
/// whole head once and is one GEMM and one reduce launch, so larger tiles amortize
/// both (a 49,152-token vocabulary: 1280 rows; 256 before lmtile, when a tile of the
/// 8B twin's head was a GEMM of 2.9 waves of 128 x 256 tiles). The tile changes no
/// number: each logit and each row's reduction are computed alike in any tile.
pub fn lm_head_tile_rows(n_vocab: usize) -> usize {
    (LM_HEAD_TILE_BYTES / (4 * n_vocab.max(1)) / 128 * 128).clamp(256, 2048)
}

/// The tiled LM head: for each tile of up to `lm_head_tile_rows(n_vocab)` rows of h
/// (n_rows, d_model), logits = h_tile · embᵀ (f32 accumulation, into
/// `scratch`, (tile, n_vocab) f32 on the device), optionally soft-capped, then
/// `lmhead_reduce` into `out`; `per_tile(row0, n_tile, logits)` then sees the
/// tile's logits (to gather listed ids). Only `out`'s few numbers per row are
/// ever copied to the host. h in bf16 uses the tensor-core matmul, in f32 the
/// FP32 one; on the wgmma kernel a block-quantized head is dequantized to bf16
/// once per call (n_vocab x d_model bf16 of device memory while it runs).
#[allow(clippy::too_many_arguments)]
pub fn lm_head<X: MatmulInput>(
    dev: &CudaDevice,
    h: DevView<X>,
    n_rows: usize,
    emb: &QuantMatrix,
    targets: DevView<i32>,
    softcap: Option<f32>,
    scratch: &mut DeviceBuffer<f32>,
    out: &mut LmHeadOut,
    mut per_tile: impl FnMut(usize, usize, DevView<f32>) -> Result<()>,
) -> Result<()> {
    let (n_vocab, d_model) = (emb.n_rows, emb.n_cols);
    ensure!(h.len() == n_rows * d_model, "lm_head: h has {} elements, n_rows * d_model = {n_rows} * {d_model}", h.len());
    ensure!(targets.len() == n_rows, "lm_head: {} targets for {n_rows} rows", targets.len());
    ensure!(out.n_rows() == n_rows, "lm_head: outputs sized for {} rows, h has {n_rows}", out.n_rows());
    let tile_rows = lm_head_tile_rows(n_vocab);
    let tile_len = tile_rows.min(n_rows) * n_vocab;
    if scratch.len() < tile_len {
        bail!("lm_head: scratch holds {} f32, a tile needs {} * {n_vocab}", scratch.len(), tile_rows.min(n_rows));
    }
    // Tiles on the wgmma kernel read a bf16 head: a block-quantized one is dequantized
    // once here for all tiles (not once per tile, as `matmul` would).
    let wgmma_tile = |rows: usize| X::NAME == "bf16" && bf16_kernel_for(dev, rows, n_vocab) == MatmulKernel::Wgmma;
    let head_bf16 = if wgmma_tile(tile_rows.min(n_rows)) && emb.format != TensorFormat::Bf16 {
        let mut wb = dev.alloc_uninit::<bf16>(n_vocab * d_model)?;
        dequant_bf16(dev, emb, wb.view_mut())?;
        Some(wb)
    } else {
        None
    };
    for row0 in (0..n_rows).step_by(tile_rows) {
        let rows = tile_rows.min(n_rows - row0);
        let h_tile = h.sub(row0 * d_model, rows * d_model)?;
        match &head_bf16 {
            Some(wb) if wgmma_tile(rows) => {
                let y = scratch.slice_mut(0..rows * n_vocab)?;
                check_matmul_shapes("lm_head (wgmma)", h_tile.len(), h_tile.ptr(), rows, emb, &y, n_vocab)?;
                gemm_wgmma(dev, GemmEpilogue::from_env(), h_tile.ptr(), rows, wb.view().ptr(), n_vocab, d_model, y, n_vocab, false, None)?;
            }
            _ => matmul::<X>(dev, h_tile, rows, emb, scratch.slice_mut(0..rows * n_vocab)?, n_vocab)?,
        }
        if let Some(cap) = softcap {
            self::softcap(dev, scratch.slice_mut(0..rows * n_vocab)?, cap)?;
        }
        lmhead_reduce(dev, scratch.slice(0..rows * n_vocab)?, rows, n_vocab, n_vocab, targets.sub(row0, rows)?, out, row0)?;
        per_tile(row0, rows, scratch.slice(0..rows * n_vocab)?)?;
    }
    Ok(())
}

/// The LM-head GEMM that reduces in its epilogue (kernels/gemm_sm90a.cu; the fast path
/// [`crate::backend::FAST_PATH_LM_HEAD_FUSED`]).
pub const GEMM_LMHEAD_KERNEL: &str = "gemm_bf16_wgmma_lmhead";

/// Columns of the fused LM head's tiles, one (max, sum of exp) pair each per row.
fn lm_head_fused_parts(n_vocab: usize) -> usize {
    n_vocab.div_ceil(GEMM_BN)
}

/// Rows per launch of the fused LM head when `scratch_f32` f32 hold the pairs: all
/// `n_rows` when they fit, else the most whole 128-row tiles that do (0: not even one).
pub fn lm_head_fused_rows(n_rows: usize, n_vocab: usize, scratch_f32: usize) -> usize {
    let fit = scratch_f32 / (2 * lm_head_fused_parts(n_vocab).max(1));
    if fit >= n_rows {
        n_rows
    } else {
        fit / GEMM_BM * GEMM_BM
    }
}

/// Whether this device runs the fused LM head for `n_rows` rows of a vocabulary of
/// `n_vocab` (the wgmma route, its kernel loaded, a product large enough for wgmma).
pub fn lm_head_fused_fits(dev: &CudaDevice, n_rows: usize, n_vocab: usize) -> bool {
    dev.has_function(GEMM_LMHEAD_KERNEL) && bf16_kernel_for(dev, n_rows, n_vocab) == MatmulKernel::Wgmma
}

/// The LM head without logits (the fast path lm-head-fused, no top-k, no soft-cap): for
/// rows of h (n_rows, d_model) bf16, gemm_bf16_wgmma_lmhead multiplies by the head (a
/// block-quantized one dequantized to bf16 once per call) and keeps per row and
/// 256-column tile the max and the f32 sum of exp in `scratch` (as (rows, n_parts) f32
/// pairs), and the target's logit; lmhead_merge combines the pairs into `out`'s
/// row_max and f64 row_sumexp. As many rows a launch as `scratch` holds pairs for. The
/// same row_max and target_logit bits as [`lm_head`]; row_sumexp from f32 partial sums of
/// ex2.approx terms (about 1e-6 relative) where `lm_head` sums f64 exp of every logit.
pub fn lm_head_fused(
    dev: &CudaDevice,
    h: DevView<bf16>,
    n_rows: usize,
    emb: &QuantMatrix,
    targets: DevView<i32>,
    scratch: &mut DeviceBuffer<f32>,
    out: &mut LmHeadOut,
) -> Result<()> {
    let (n_vocab, d_model) = (emb.n_rows, emb.n_cols);
    ensure!(h.len() == n_rows * d_model, "lm_head_fused: h has {} elements, n_rows * d_model = {n_rows} * {d_model}", h.len());
    ensure!(targets.len() == n_rows, "lm_head_fused: {} targets for {n_rows} rows", targets.len());
    ensure!(out.n_rows() == n_rows, "lm_head_fused: outputs sized for {} rows, h has {n_rows}", out.n_rows());
    ensure!(out.k == 0, "lm_head_fused: no top-k (asked for {})", out.k);
    ensure!(d_model % 8 == 0 && h.ptr() % 16 == 0, "lm_head_fused: h rows of {d_model} bf16 at {:#x} not 16-byte aligned", h.ptr());
    if n_rows == 0 || n_vocab == 0 {
        return Ok(());
    }
    let n_parts = lm_head_fused_parts(n_vocab);
    let per_call = lm_head_fused_rows(n_rows, n_vocab, scratch.len());
    ensure!(per_call > 0, "lm_head_fused: a scratch of {} f32 holds no 128-row tile of {n_parts} pairs", scratch.len());
    let head_scratch;
    let wp = if emb.format == TensorFormat::Bf16 {
        emb.data.view().ptr()
    } else {
        let mut wb = dev.alloc_uninit::<bf16>(n_vocab * d_model)?;
        dequant_bf16(dev, emb, wb.view_mut())?;
        head_scratch = wb;
        head_scratch.view().ptr()
    };
    let gemm = wgmma_func_with(dev, GEMM_LMHEAD_KERNEL, GEMM_SMEM_BYTES)?;
    let merge = func(dev, "lmhead_merge")?;
    for row0 in (0..n_rows).step_by(per_call) {
        let rows = per_call.min(n_rows - row0);
        let part = scratch.slice_mut(0..rows * 2 * n_parts)?.ptr();
        let tp = targets.sub(row0, rows)?.ptr();
        let tl = out.target_logit.slice(row0..row0 + rows)?.ptr();
        let params = GemmLmParams {
            a: tensor_map_bf16(h.sub(row0 * d_model, rows * d_model)?.ptr(), rows, d_model, GEMM_BM as u32)?,
            b: tensor_map_bf16(wp, n_vocab, d_model, GEMM_BN as u32)?,
            part,
            targets: tp,
            target_logit: tl,
            m: i32_of(rows, "M")?,
            n: i32_of(n_vocab, "n_vocab")?,
            k: i32_of(d_model, "d_model")?,
            n_parts: i32_of(n_parts, "n_parts")?,
        };
        let grid = wgmma_grid(dev, GEMM_LMHEAD_KERNEL, rows.div_ceil(GEMM_BM) * n_parts)?;
        let mut lb = dev.stream().launch_builder(gemm);
        lb.arg(&params);
        // SAFETY: `params` mirrors GemmLmParams of kernels/common.cuh (size asserted); the tensor
        // maps cover h's rows (rows, d_model) and the bf16 head (n_vocab, d_model); part holds
        // rows * n_parts float2 of the scratch (8-byte aligned: an allocation's start); targets and
        // target_logit cover the rows.
        unsafe { lb.launch(cfg((grid, 1, 1), GEMM_THREADS, GEMM_SMEM_BYTES as u32)) }.map_err(|e| launch_err(GEMM_LMHEAD_KERNEL, e))?;
        let (np, nr, nv) = (i32_of(n_parts, "n_parts")?, i32_of(rows, "rows")?, i32_of(n_vocab, "n_vocab")?);
        let mx = out.row_max.slice(row0..row0 + rows)?.ptr();
        let se = out.row_sumexp.slice(row0..row0 + rows)?.ptr();
        let mut mb = dev.stream().launch_builder(merge);
        mb.arg(&part).arg(&np).arg(&nr).arg(&nv).arg(&tp).arg(&mx).arg(&se).arg(&tl);
        // SAFETY: arguments match `lmhead_merge` in kernels/lmhead.cu; the pairs were written by
        // the GEMM just before on the same stream; the output rows lie inside `out`.
        unsafe { mb.launch(cfg((rows.div_ceil(8) as u32, 1, 1), 256, 0)) }.map_err(|e| launch_err("lmhead_merge", e))?;
    }
    Ok(())
    // `head_scratch` is freed in stream order, after the GEMMs that read it.
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// ATTN_V3_TWO_PRODUCERS mirrors the NPW argument of every coded kernel instantiated
    /// in kernels/attention_sm90a.cu (a mismatch launches 384 threads where the kernel
    /// waits on a second producer warpgroup, or 512 past a 384-thread launch bound).
    #[test]
    fn two_producer_table_mirrors_the_kernel_source() {
        let src = include_str!("../../../kernels/attention_sm90a.cu");
        let mut n_seen = 0;
        for line in src.lines() {
            let Some(args) = line.strip_prefix("ATTN_WGMMA_CODED(").or_else(|| line.strip_prefix("ATTN_WGMMA_QF(")) else { continue };
            let args: Vec<&str> = args.trim_end_matches(')').split(',').map(str::trim).collect();
            let (d, kv, npw): (usize, &str, &str) = (args[0].parse().unwrap(), args[1], args[args.len() - 1]);
            let variant = if line.starts_with("ATTN_WGMMA_QF") { V3Variant::F16 } else { V3Variant::Decode };
            let threads = if npw == "2" { 512 } else { 384 };
            assert!(npw == "1" || npw == "2", "{line}");
            assert_eq!(attn_v3_threads(kv, d, variant), threads, "{line}");
            n_seen += 1;
        }
        assert_eq!(n_seen, 20, "the coded kernels' instantiations");
        for (kv, d) in ATTN_V3_TWO_PRODUCERS {
            assert!(src.lines().any(|l| l.starts_with(&format!("ATTN_WGMMA_CODED({d}, {kv},")) && l.ends_with(", 2)")), "{kv} d {d}");
        }
        // The fast paths with K's codes keep one producer warpgroup.
        assert_eq!(attn_v3_threads("int8", 64, V3Variant::QkF16), 384);
        assert_eq!(attn_v3_threads("fp8", 128, V3Variant::QkCodes), 384);
    }

    #[test]
    fn lm_head_tiles_fill_the_scratch() {
        // gemma3's 262k vocabulary keeps 256 rows; SmolLM2's (and the 8B twin's) 49,152
        // get 1280, Llama-3's 128,256 get 512; small vocabularies stop at 2048.
        for (n_vocab, rows) in [(262_144, 256), (49_152, 1280), (128_256, 512), (5_007, 2048), (0, 2048), (4_000_000, 256)] {
            assert_eq!(lm_head_tile_rows(n_vocab), rows, "n_vocab {n_vocab}");
        }
        for n_vocab in (1..300_000).step_by(997) {
            let r = lm_head_tile_rows(n_vocab);
            assert!(r % 128 == 0 && (256..=2048).contains(&r), "{n_vocab}: {r}");
            assert!(r == 256 || r * n_vocab * 4 <= LM_HEAD_TILE_BYTES, "{n_vocab}: {r}");
        }
    }

    #[test]
    fn lm_head_fused_rows_fill_the_scratch_in_whole_tiles() {
        // 49,152 tokens: 192 pairs a row, 384 f32.
        assert_eq!(lm_head_fused_rows(1000, 49_152, 384 * 1000), 1000);
        assert_eq!(lm_head_fused_rows(1000, 49_152, 384 * 999), 896);
        assert_eq!(lm_head_fused_rows(1000, 49_152, 384 * 127), 0);
        // gemma3's 262,144: 1024 pairs; the 256 MiB logits scratch holds 32,768 rows of them.
        assert_eq!(lm_head_fused_rows(40_000, 262_144, LM_HEAD_TILE_BYTES / 4), 32_768);
        // A vocabulary that is not a multiple of 256: the last, partial tile has its pair too.
        assert_eq!(lm_head_fused_parts(5_007), 20);
        assert_eq!(lm_head_fused_rows(300, 5_007, 40 * 300), 300);
    }

    proptest! {
        /// Every row is launched exactly once, no launch exceeds the limit, and each row reads
        /// the position index it has in the whole call.
        #[test]
        fn row_slices_cover_each_row_once_at_its_position(n_windows in 1usize..20, n_per_seq in 1usize..40, max in 1usize..50) {
            let n_rows = n_windows * n_per_seq;
            let mut seen = vec![0u32; n_rows];
            for sl in row_slices(n_rows, n_per_seq, max) {
                prop_assert!(sl.n_rows >= 1 && sl.n_rows <= max, "{sl:?}");
                for t in 0..sl.n_rows {
                    let row = sl.row0 + t;
                    seen[row] += 1;
                    prop_assert_eq!(sl.pos0 + t % sl.n_per_seq, row % n_per_seq, "{:?} row {}", sl, row);
                }
            }
            prop_assert!(seen.iter().all(|&c| c == 1), "{seen:?}");
        }
    }

    #[test]
    fn row_slices_keep_one_launch_below_the_limit() {
        // 16 windows of 4096 rows: the limit holds 15 whole windows, then one.
        let s = row_slices(65536, 4096, GRID_Y_MAX);
        assert_eq!(s, vec![
            RowSlice { row0: 0, n_rows: 61440, pos0: 0, n_per_seq: 4096 },
            RowSlice { row0: 61440, n_rows: 4096, pos0: 0, n_per_seq: 4096 },
        ]);
        assert_eq!(row_slices(16384, 512, GRID_Y_MAX).len(), 1);
        // Windows longer than the limit (a pass of 70000 positions each: --context and --prefill-chunk 70000).
        let s = row_slices(2 * 70000, 70000, GRID_Y_MAX);
        assert_eq!(s.len(), 4);
        assert_eq!(s[1], RowSlice { row0: 65535, n_rows: 4465, pos0: 65535, n_per_seq: 4465 });
        assert_eq!(s[2], RowSlice { row0: 70000, n_rows: 65535, pos0: 0, n_per_seq: 65535 });
    }
}
