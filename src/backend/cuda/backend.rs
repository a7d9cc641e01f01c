//! [`CudaBackend`]: the backend seam ([`Backend`]) on one GPU, built from the
//! typed launchers in `ops`. Every op of the forward pass runs on the device;
//! there is no CPU fallback (an unsupported shape or format is an error that
//! names the op). Only [`Backend::score_rows`] copies anything back: per
//! scored position the max logit, the sum of exponentials, the target's logit
//! and, when asked, top-k entries and listed ids' logits.
//!
//! Two numeric routes ([`Route`]):
//! - `Bf16TensorCore` (the default): each matmul input is rounded to bf16 and
//!   multiplied on the tensor cores with f32 accumulation (on sm_90 larger
//!   products run on wgmma after the weight is dequantized to a bf16 scratch,
//!   smaller ones on mma.sync with the tile dequantized in shared memory; the
//!   same bf16 operands either way); the KV cache is bf16.
//! - `Fp32` (`--lossless`): f32 matmul inputs, f32 FFMA accumulation, f32 KV.
//!
//! Beside the route, [`RouteOptions`]: `--reference` runs the FP32 route with
//! an f32 cache whose every K/V row is the CPU backend's decode(encode(row))
//! through the format's codec (`kv_roundtrip_<codec>`, bit-identical; V as fp16
//! under bf16), read by kernel v1; `--reproducible` pins the device to one GEMM
//! kernel for every M (`CudaDevice::pin_one_gemm_kernel`), so no row's bits
//! depend on the pass (tests/gpu_e2e.rs checks batched and chunked passes).
//!
//! `--kv-dtype` sets the KV cache type apart from the route (bf16 KV on the
//! FP32 route, f32 KV on the default route), to measure what each costs. The
//! quantized formats (src/kv's rows: codes and their scales per position and
//! KV head, Hadamard-rotated where the table says so) are stored by
//! `kv_encode_<codec>` (kernels/kv_codec.cu, bit-identical to the CPU codec)
//! on the default route; a format without kernels (`ops::kv_format_has_kernels`)
//! is refused with an error naming it. Like the CPU backend's cache,
//! [`CudaKvCache`] counts the non-finite elements its codec reported
//! ([`CudaKvCache::n_nonfinite`]).
//!
//! Attention ([`CudaBackend::attention_kernel`]): on the default route with a
//! bf16 or quantized cache the tensor-core flash attention (kernel v2: q and P
//! rounded to bf16, f32 accumulation and softmax; quantized K/V decoded and
//! rounded to bf16 in its tile loads; on sm_90a a bf16 cache at the head sizes of
//! `ops::ATTN_V3_DEFAULT_HEAD_DIMS` runs kernel v3, wgmma, the same numerics up to
//! the order of f32 sums); on the FP32 route and with an f32 cache the f32
//! CUDA-core kernel (v1). The report names the one that ran and the cache's
//! store and read kernels.
//!
//! Common to both: the residual stream is an f32 device matrix; norms, RoPE
//! and activations compute in f32. On the default route an activation that only
//! feeds matmuls is held as its bf16 rounding ([`CudaAct`]): attention writes its
//! output in bf16, the gated product too, and RMSNorm writes f32 and bf16 in one
//! pass, so no matmul casts its input (the route rounds every matmul input to
//! bf16 anyway: no number changes). The gated FFN's gate and up products run as
//! one GEMM with the activation in its epilogue ([`Backend::gated_ffn`]). The
//! q, k and v projections as one GEMM over their stacked bf16 weights with the
//! bias in its epilogue ([`Backend::qkv`], `ops::matmul_qkv_bf16`: the same bits
//! as three) is built, parity-tested and off by default
//! ([`CudaBackend::set_fused_qkv`]): it measured 1.6-2.2 % slower than three
//! GEMMs on the 8B shapes with block-quantized weights and 8 % with BF16 (the
//! stacked copy), and no faster end to end (benches/gemm.rs `QKV` lines,
//! docs/performance.md). The
//! residual add is in the output projections' GEMM epilogue ([`Backend::matmul_add`],
//! `ops::matmul_add_bf16`: a TMA f32 reduce-add of the product into x, the bits of
//! the GEMM then `add_f32`), and the norm after it, read only by matmuls, writes
//! only its bf16 rounding ([`Backend::rms_norm_for_matmul`], `rmsnorm_bf16`: the
//! bf16 bits of `rmsnorm_dual`); a layer with post norms (gemma3) adds in the next
//! RMSNorm instead ([`Backend::add_rms_norm`], `add_rmsnorm_dual`: the bits of
//! `add_f32` then `rmsnorm_dual`). RoPE reads (cos, sin) from one table per
//! set of frequencies, built once by `rope_table_f32` with `rope_f32`'s f64
//! expression and kept for every layer and pass; on the wgmma GEMM, the q and k
//! projections of a layer without QK norm rotate in the GEMM's epilogue
//! ([`Backend::qkv_rope`], `ops::matmul_rope_bf16`: the bits of the GEMM then
//! `rope_tabled_f32`, no f32 round trip; `ops::gemm_rope_fits` says when). The LM head
//! multiplies the final-normed rows with the head like any matmul of the
//! route (bf16 on the tensor cores, or f32 FFMA) into f32 logits, reduced on
//! the GPU with an f64 sum of exponentials. Weights stay in their stored block format
//! (`QuantMatrix`); 1-D weights (norms, biases) are decoded to f32 at load.
//!
//! Buffers are allocated per op from the driver's stream-ordered pool
//! (`cuMemAllocAsync`) and freed in stream order when dropped, so nothing
//! waits on the host except `score_rows`' final copy.
//!
//! This module does not plan windows or decode formats on the host (except
//! the small 1-D weights, via the CPU reference decoder).

use std::cell::RefCell;

use anyhow::{bail, ensure, Context, Result};
use half::bf16;

use super::buffer::{DevView, DeviceBuffer, QuantMatrix};
use super::device::CudaDevice;
use super::ops::{self, LmHeadOut, Rows};
use super::profile::OpProfile;
use crate::artifact::meta::{Activation, RopeStyle};
use crate::artifact::TensorView;
use crate::backend::cpu::{dequant, head::check_request};
use crate::backend::{
    AttnParams, Backend, DeltaNetParams, DeltaNetWeights, DeviceMemory, ExecutionInfo, Expert, HeadRequest, KvGeometry, MoeRouting,
    PassRows, RecurrentState, RopeParams, RowScore,
};
use crate::kv::KvFormat;

/// The numeric route of the CUDA backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// bf16 activations into tensor-core matmuls, f32 accumulation, bf16 KV cache.
    Bf16TensorCore,
    /// f32 everywhere (`--lossless`).
    Fp32,
}

impl Route {
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16TensorCore => "bf16-tc",
            Self::Fp32 => "fp32",
        }
    }
    /// The KV format this route had before `--kv-dtype` existed (tests).
    pub fn kv_dtype(self) -> KvFormat {
        match self {
            Self::Bf16TensorCore => KvFormat::Bf16,
            Self::Fp32 => KvFormat::F32,
        }
    }
}

/// Row-major `(n_rows, n_cols)` activations on the device: f32 values, their
/// bf16 rounding (round to nearest even), or both. The default route's
/// attention output and gated product are bf16 alone (only matmuls read them),
/// its norms write both; every other op writes f32. An op that changes the f32
/// values in place drops the bf16 copy, so a bf16 copy always equals the
/// rounding of the current f32 values.
#[derive(Debug)]
pub struct CudaAct {
    pub n_rows: usize,
    pub n_cols: usize,
    /// (n_rows, n_cols) f32; `None` when the activation is a matmul input held in bf16 only.
    f32: Option<DeviceBuffer<f32>>,
    /// (n_rows, n_cols) bf16, the rounding of the f32 values (or the op's bf16 output).
    bf16: Option<DeviceBuffer<bf16>>,
}

impl CudaAct {
    /// The f32 values; an error naming `op` for a bf16-only activation (an op's
    /// result that the model may only pass to a matmul).
    pub fn f32(&self, op: &str) -> Result<&DeviceBuffer<f32>> {
        self.f32.as_ref().with_context(|| {
            format!("{op}: this ({} x {}) activation is held in bf16 only (a matmul input of the default route)", self.n_rows, self.n_cols)
        })
    }

    /// The f32 values for writing in place; drops the bf16 copy, which would be stale.
    pub(super) fn f32_mut(&mut self, op: &str) -> Result<&mut DeviceBuffer<f32>> {
        self.bf16 = None;
        let (r, c) = (self.n_rows, self.n_cols);
        self.f32
            .as_mut()
            .with_context(|| format!("{op}: this ({r} x {c}) activation is held in bf16 only (a matmul input of the default route)"))
    }

    /// The bf16 copy, when the op that wrote this activation made one.
    pub fn bf16(&self) -> Option<&DeviceBuffer<bf16>> {
        self.bf16.as_ref()
    }
}

/// A weight `(n_out, n_in)` in its stored format on the device.
#[derive(Debug)]
pub struct CudaMatrix {
    pub name: String,
    pub q: QuantMatrix,
}

/// Per layer: K `(n_seqs, n_kv_heads, max_pos, d_head)` and V of the same shape
/// (a quantized format: the same rows, K rows of `format.k().row_bytes(d_head)`
/// bytes, V rows of `format.v().row_bytes(d_head)`).
#[derive(Debug)]
enum KvLayers {
    Bf16(Vec<[DeviceBuffer<bf16>; 2]>),
    F32(Vec<[DeviceBuffer<f32>; 2]>),
    Coded(Vec<[DeviceBuffer<u8>; 2]>),
    /// `--reference`: f32 rows holding decode(encode(row)) through the K and V
    /// codecs ([`CudaBackend::reference_codecs`]), as the CPU backend's cache.
    Decoded(Vec<[DeviceBuffer<f32>; 2]>),
}

/// How a named fast path that is on by default where qualified is used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FastPathUse {
    /// Where qualified (its default head sizes, devices, formats).
    #[default]
    Auto,
    /// Named by `--fast-path`: wherever it has a kernel, else an error.
    Forced,
    /// `--no-fast-path`, or `--reproducible` (no fast path there).
    Off,
}

impl FastPathUse {
    /// The use `spec` asks for of the fast path `name`.
    pub fn of(spec: &crate::backend::ExecutionSpec, name: &str) -> Self {
        let named = |list: &[String]| list.iter().any(|n| n == name);
        if spec.reproducible || spec.lossless || named(&spec.fast_paths_off) {
            Self::Off
        } else if named(&spec.fast_paths) {
            Self::Forced
        } else {
            Self::Auto
        }
    }
}

/// The route settings beside [`Route`] and the KV format (`ExecutionSpec`'s
/// `reference`, `reproducible`, `kv_rotation` and the attention's fast path).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteOptions {
    /// `--reference`: the FP32 route with the KV codec applied exactly (the CPU's
    /// definition: every stored K/V row is decode(encode(row)), V as fp16 under bf16).
    pub reference: bool,
    /// `--reproducible`: deterministic kernels, one GEMM kernel for every M.
    pub reproducible: bool,
    /// `--kv-rotation`: the quantized codecs' rotation (`auto`: the format table's),
    /// given to the encoders and the attention kernels (their `rotate` / `rot` flags).
    pub kv_rotation: crate::kv::KvRotation,
    /// [`crate::backend::FAST_PATH_ATTN_FP8_QK`]: fp8 attention with Q·Kᵀ on K's stored codes.
    pub attn_fp8_qk: FastPathUse,
    /// [`crate::backend::FAST_PATH_ATTN_INT8_QK`]: int8 / k8v4 attention with Q·Kᵀ on K's stored codes.
    pub attn_int8_qk: FastPathUse,
    /// [`crate::backend::FAST_PATH_ATTN_F16`]: nvfp4 / k4v2 / vq2 attention decoding to f16.
    pub attn_f16: FastPathUse,
    /// [`crate::backend::FAST_PATH_LM_HEAD_FUSED`]: the LM head reduced in its GEMM's epilogue.
    pub lm_head_fused: FastPathUse,
}

/// The KV cache of the windows of one pass on the device.
#[derive(Debug)]
pub struct CudaKvCache {
    pub geometry: KvGeometry,
    layers: KvLayers,
    /// (1) elements the encoders counted non-finite (`kv::RowCodec::encode_row`'s count).
    n_bad: DeviceBuffer<u64>,
    /// The vq2 codebook (vq2 caches only).
    book: Option<ops::VqBook>,
}

impl CudaKvCache {
    /// Elements counted non-finite by the KV codec so far, as the CPU backend's
    /// `CpuKvCache::n_nonfinite` (quantized formats only: the bf16 and f32 stores count nothing).
    /// Waits for the stream.
    pub fn n_nonfinite(&self, dev: &CudaDevice) -> Result<usize> {
        let n = dev.download(&self.n_bad)?;
        usize::try_from(n[0]).context("kv cache: non-finite count")
    }
}

/// The CUDA backend on one GPU.
pub struct CudaBackend {
    dev: CudaDevice,
    route: Route,
    kv_dtype: KvFormat,
    opts: RouteOptions,
    /// q, k, v in one GEMM where it applies (off by default; [`CudaBackend::set_fused_qkv`]).
    fuse_qkv: bool,
    /// The Gated DeltaNet scan kernel: by route (3xtf32 chunks on the default
    /// route, exact on FP32) unless forced ([`CudaBackend::set_delta_scan`]).
    delta_scan: super::delta_net::DeltaScan,
    /// `delta_scan` was forced: heads it does not take are an error, not the exact scan.
    delta_scan_forced: bool,
    /// Positions 0..len as i32 (RoPE reads a sub-range), grown on demand.
    positions: RefCell<Option<DeviceBuffer<i32>>>,
    /// RoPE (cos, sin) tables `(n_pos, n_rot/2)` pairs, one per set of frequencies
    /// (gemma3: its local and global bases), built once and shared by every layer
    /// and pass; rebuilt longer when a pass needs a later position.
    rope_tables: RefCell<Vec<RopeTable>>,
    /// The LM head's logits tile `(ops::lm_head_tile_rows(n_vocab), n_vocab)`, kept between calls.
    head_scratch: RefCell<Option<DeviceBuffer<f32>>>,
    /// GPU time per op family (`INFERNIX_CUDA_PROFILE=1`), logged when the backend is dropped.
    pub(super) prof: OpProfile,
    /// The MoE layers' bf16 banks under `INFERNIX_MOE_BANKS=resident` (empty otherwise).
    pub(super) moe_banks: super::moe::ResidentBanks,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if !self.prof.enabled() {
            return;
        }
        // stderr: the profile was asked for explicitly; an error only loses the profile.
        match self.prof.report() {
            Ok(lines) => lines.iter().for_each(|l| eprintln!("{l}")),
            Err(e) => eprintln!("PROFILE unavailable: {e:#}"),
        }
    }
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", self.dev.info())
            .field("route", &self.route)
            .field("kv_dtype", &self.kv_dtype)
            .finish()
    }
}

/// One RoPE (cos, sin) table: `table` `(n_pos, n_rot)` f32 (n_rot/2 interleaved
/// pairs per position) for the frequencies `key` names.
struct RopeTable {
    /// (n_rot, base, scale, YaRN factor, ramp low, ramp high, attention factor), as bits.
    key: [u64; 7],
    n_pos: usize,
    table: DeviceBuffer<f32>,
}

/// The kernels' RoPE parameters of a `rope` call on `n_heads` heads of `d_head`.
fn rope_params(n_heads: usize, d_head: usize, p: &RopeParams) -> ops::RopeParams {
    ops::RopeParams {
        n_heads,
        d_head,
        n_rot: p.rope_dim,
        mode: match p.style {
            RopeStyle::Normal => ops::RopeMode::Normal,
            RopeStyle::Neox => ops::RopeMode::Neox,
        },
        freq_base: p.base,
        // The seam divides the position by `scale`; the kernel multiplies by freq_scale.
        freq_scale: 1.0 / p.scale,
        yarn: p.yarn,
    }
}

/// The frequencies of `p` as a table key: every input of the table's expression.
fn rope_table_key(p: &ops::RopeParams) -> [u64; 7] {
    let (yf, yl, yh, ya) = p.yarn.map_or((1.0, 0.0, 1.0, 1.0), |y| (y.factor, y.ramp_low, y.ramp_high, y.attn_factor));
    [p.n_rot as u64, p.freq_base.to_bits(), p.freq_scale.to_bits(), f64::to_bits(yf), f64::to_bits(yl), f64::to_bits(yh), f64::to_bits(ya)]
}

/// At most this many tables are kept (least recently built dropped first).
const MAX_ROPE_TABLES: usize = 8;

/// Bytes kept free on the device beyond the estimate (driver, pool rounding,
/// module code).
const MEMORY_MARGIN_BYTES: usize = 512 << 20;

fn same_shape(op: &str, a: &CudaAct, b: &CudaAct) -> Result<()> {
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

fn ops_activation(act: Activation) -> ops::Activation {
    match act {
        Activation::Silu => ops::Activation::Silu,
        Activation::GeluTanh => ops::Activation::GeluTanh,
    }
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

impl CudaBackend {
    /// Opens GPU `index` (driver probe first: no driver is an error, not a
    /// panic) and loads every kernel.
    pub fn open(index: usize, route: Route, kv_dtype: KvFormat) -> Result<Self> {
        Self::open_with(index, route, kv_dtype, RouteOptions::default())
    }

    /// [`CudaBackend::open`] with the `--reference` / `--reproducible` settings
    /// ([`RouteOptions`]): `reference` needs the FP32 route; `reproducible` pins
    /// the device to one GEMM kernel (`CudaDevice::pin_one_gemm_kernel`).
    pub fn open_with(index: usize, route: Route, kv_dtype: KvFormat, opts: RouteOptions) -> Result<Self> {
        ensure!(
            !opts.reference || route == Route::Fp32,
            "--reference on CUDA runs the FP32 route (it implies --lossless); the {} route was asked for",
            route.name()
        );
        ensure!(
            ops::kv_format_has_kernels(kv_dtype),
            "--kv-dtype {kv_dtype}: this KV format is not implemented on the CUDA backend yet (there: {}; \
             every format runs on --backend cpu)",
            KvFormat::ALL.iter().filter(|f| ops::kv_format_has_kernels(**f)).map(|f| f.name()).collect::<Vec<_>>().join(", ")
        );
        ensure!(
            !(kv_dtype.is_quantized() && route == Route::Fp32 && !opts.reference),
            "--kv-dtype {kv_dtype} on the CUDA FP32 route: its attention kernel (v1) reads bf16 or f32 caches; \
             the quantized formats run on the default (bf16 tensor-core) route"
        );
        let mut dev = CudaDevice::open(index)?;
        if opts.reproducible {
            dev.pin_one_gemm_kernel();
        }
        Ok(Self {
            dev,
            route,
            kv_dtype,
            opts,
            fuse_qkv: false,
            // --reproducible keeps the exact scan: the chunked scans' sums depend on
            // where a pass starts (a new pass starts a new chunk).
            delta_scan: if opts.reproducible { super::delta_net::DeltaScan::Exact } else { super::delta_net::DeltaScan::default_for(route) },
            delta_scan_forced: false,
            positions: RefCell::new(None),
            rope_tables: RefCell::new(Vec::new()),
            head_scratch: RefCell::new(None),
            prof: OpProfile::from_env(),
            moe_banks: Default::default(),
        })
    }

    /// Off by default (measured no faster, see the module doc): q, k and v in
    /// one GEMM where `ops::qkv_fusable`, the same bits as three matmuls
    /// (tests/gpu_e2e.rs compares the two through whole windows).
    pub fn set_fused_qkv(&mut self, on: bool) {
        self.fuse_qkv = on;
    }

    /// Forces the kernel of the Gated DeltaNet recurrence (`--fast-path`, tests):
    /// a chunked one then refuses heads it does not take instead of running the
    /// exact scan there.
    pub fn set_delta_scan(&mut self, kernel: super::delta_net::DeltaScan) {
        self.delta_scan = kernel;
        self.delta_scan_forced = true;
    }

    /// The scan a layer of `d_k` x `d_v` heads runs: the chosen one, or the
    /// exact one where the route's default chunked scan does not take the heads.
    pub fn delta_scan_for(&self, d_k: usize, d_v: usize) -> super::delta_net::DeltaScan {
        use super::delta_net::{chunk_supports, DeltaScan};
        if self.delta_scan != DeltaScan::Exact && !self.delta_scan_forced && chunk_supports(d_k, d_v).is_err() {
            DeltaScan::Exact
        } else {
            self.delta_scan
        }
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    pub fn route(&self) -> Route {
        self.route
    }

    pub fn route_options(&self) -> RouteOptions {
        self.opts
    }

    /// The codecs of the `--reference` cache's K and V rows: the format's
    /// (`ExecutionSpec::kv_k` / `kv_v`: V as fp16 under bf16); `None` off that route.
    fn reference_codecs(&self) -> Option<(crate::kv::RowCodec, crate::kv::RowCodec)> {
        if !self.opts.reference {
            return None;
        }
        let spec = crate::backend::ExecutionSpec {
            kv_format: self.kv_dtype,
            kv_rotation: self.opts.kv_rotation,
            reference: true,
            ..crate::backend::ExecutionSpec::lossless(1)
        };
        Some((spec.kv_k(), spec.kv_v()))
    }

    /// The K and V codecs of the quantized cache: the format's under `--kv-rotation`.
    fn kv_codecs(&self) -> crate::kv::KvCodecs {
        self.kv_dtype.codecs(self.opts.kv_rotation)
    }

    /// The codecs every stored K and V row went through, for the report (as the CPU
    /// backend's `kv_k_codec` / `kv_v_codec`): `--reference`'s, else the cache's.
    fn stored_codecs(&self) -> (crate::kv::RowCodec, crate::kv::RowCodec) {
        self.reference_codecs().unwrap_or_else(|| {
            let c = self.kv_codecs();
            (c.k, c.v)
        })
    }

    pub(super) fn new_act(&self, n_rows: usize, n_cols: usize) -> Result<CudaAct> {
        Ok(CudaAct { n_rows, n_cols, f32: Some(self.dev.alloc_uninit(n_rows * n_cols)?), bf16: None })
    }

    pub(super) fn new_act_bf16(&self, n_rows: usize, n_cols: usize) -> Result<CudaAct> {
        Ok(CudaAct { n_rows, n_cols, f32: None, bf16: Some(self.dev.alloc_uninit(n_rows * n_cols)?) })
    }

    /// The default route: results that only feed matmuls are written in bf16.
    fn bf16_matmul_inputs(&self) -> bool {
        self.route == Route::Bf16TensorCore
    }

    /// x as the default route's bf16 matmul input: its bf16 copy, or a rounding of
    /// its f32 values into `tmp`.
    pub(super) fn bf16_input<'a>(&self, x: &'a CudaAct, tmp: &'a mut Option<DeviceBuffer<bf16>>) -> Result<DevView<'a, bf16>> {
        if let Some(b) = x.bf16() {
            return Ok(b.view());
        }
        let src = x.f32("matmul")?;
        let mut xb = self.dev.alloc_uninit::<bf16>(src.len())?;
        ops::cast_bf16(&self.dev, src.view(), xb.view_mut())?;
        Ok(tmp.insert(xb).view())
    }

    /// Runs `f` on positions `pos0..pos0 + n` as a device view.
    fn with_positions<R>(&self, pos0: usize, n: usize, f: impl FnOnce(DevView<i32>) -> Result<R>) -> Result<R> {
        let end = pos0 + n;
        let mut cell = self.positions.borrow_mut();
        if cell.as_ref().is_none_or(|b| b.len() < end) {
            let len = end.next_power_of_two().max(4096);
            let host: Vec<i32> = (0..len).map(|p| i32::try_from(p).context("rope: position past i32")).collect::<Result<_>>()?;
            *cell = Some(self.dev.upload(&host)?);
        }
        let buf = cell.as_ref().context("rope: positions buffer")?;
        f(buf.slice(pos0..end)?)
    }

    /// The (cos, sin) table of `p`'s frequencies covering positions `..n_pos`,
    /// built (or rebuilt longer: a power of two, at least 4096) when missing.
    fn rope_table<'t>(&self, tables: &'t mut Vec<RopeTable>, p: &ops::RopeParams, n_pos: usize) -> Result<&'t RopeTable> {
        let key = rope_table_key(p);
        let found = tables.iter().position(|t| t.key == key && t.n_pos >= n_pos);
        let i = match found {
            Some(i) => i,
            None => {
                tables.retain(|t| t.key != key);
                if tables.len() >= MAX_ROPE_TABLES {
                    tables.remove(0);
                }
                let len = n_pos.next_power_of_two().max(4096);
                let mut table = self.dev.alloc_uninit::<f32>(len * p.n_rot)?;
                ops::rope_table(&self.dev, table.view_mut(), len, p)?;
                tables.push(RopeTable { key, n_pos: len, table });
                tables.len() - 1
            }
        };
        Ok(&tables[i])
    }

    /// Zeroed K and V buffers of `len` elements for each of `n_layers` layers.
    fn kv_buffers<KV: super::buffer::Elem>(&self, n_layers: usize, len: usize) -> Result<Vec<[DeviceBuffer<KV>; 2]>> {
        (0..n_layers).map(|_| Ok([self.dev.alloc_zeros(len)?, self.dev.alloc_zeros(len)?])).collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn kv_store_and_attend<KV: ops::KvElem, O: ops::OutElem>(
        &self,
        kv: &mut [DeviceBuffer<KV>; 2],
        shape: ops::KvShape,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        out: &mut DeviceBuffer<O>,
        p: &ops::AttnParams,
    ) -> Result<()> {
        let [kc, vc] = kv;
        let (n_seqs, n) = (p.n_seqs, p.n_tokens);
        ops::kv_store(&self.dev, k.f32("attention")?.view(), n_seqs, n, k.n_cols, kc.view_mut(), shape, p.pos0)?;
        ops::kv_store(&self.dev, v.f32("attention")?.view(), n_seqs, n, v.n_cols, vc.view_mut(), shape, p.pos0)?;
        ops::attention::<KV, O>(&self.dev, self.attention_kernel(), q.f32("attention")?.view(), kc.view(), vc.view(), shape, out.view_mut(), p)
    }

    /// A quantized format: K and V rows encoded into the cache (non-finite counts
    /// into `n_bad`), then the attention decoding them in its tile loads
    /// (`ops::attention_coded`: kernel v3 where `AttnKernel::routes_to_v3`, else v2).
    #[allow(clippy::too_many_arguments)]
    fn kv_encode_and_attend<O: ops::OutElem>(
        &self,
        kv: &mut [DeviceBuffer<u8>; 2],
        n_bad: &mut DeviceBuffer<u64>,
        book: Option<&ops::VqBook>,
        shape: ops::KvShape,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        out: &mut DeviceBuffer<O>,
        p: &ops::AttnParams,
    ) -> Result<()> {
        let [kc, vc] = kv;
        let (n_seqs, n, f) = (p.n_seqs, p.n_tokens, self.kv_codecs());
        ops::kv_encode(&self.dev, f.k, k.f32("attention")?.view(), n_seqs, n, k.n_cols, kc.view_mut(), shape, p.pos0, n_bad.view_mut(), book)
            .with_context(|| format!("attention: store K ({})", f.format))?;
        ops::kv_encode(&self.dev, f.v, v.f32("attention")?.view(), n_seqs, n, v.n_cols, vc.view_mut(), shape, p.pos0, n_bad.view_mut(), book)
            .with_context(|| format!("attention: store V ({})", f.format))?;
        if self.fp8_qk_at(shape.d_head)? {
            return ops::attention_coded_fp8_qk::<O>(&self.dev, f, q.f32("attention")?.view(), kc.view(), vc.view(), shape, out.view_mut(), p);
        }
        // attn-int8-qk writes f32 (as kernel v3's int8 and k8v4 kernels).
        if O::NAME == "f32" && self.int8_qk_at(shape.d_head)? {
            return ops::attention_coded_int8_qk::<O>(&self.dev, f, q.f32("attention")?.view(), kc.view(), vc.view(), shape, out.view_mut(), p);
        }
        // attn-f16 writes f32 (as kernel v3's nvfp4, k4v2 and vq2 kernels).
        if O::NAME == "f32" && self.f16_at(shape.d_head)? {
            return ops::attention_coded_f16::<O>(&self.dev, f, q.f32("attention")?.view(), kc.view(), vc.view(), shape, out.view_mut(), p, book);
        }
        ops::attention_coded::<O>(&self.dev, f, q.f32("attention")?.view(), kc.view(), vc.view(), shape, out.view_mut(), p, book)
    }

    /// Whether an fp8 cache's attention at `d_head` runs the fast path
    /// [`crate::backend::FAST_PATH_ATTN_FP8_QK`]: by default at the head sizes of
    /// `ops::ATTN_FP8_QK_DEFAULT_HEAD_DIMS` where the device has its kernel; forced,
    /// wherever it has one (else an error naming it); never when turned off.
    fn fp8_qk_at(&self, d_head: usize) -> Result<bool> {
        if self.kv_dtype != KvFormat::Fp8 || self.route != Route::Bf16TensorCore || self.opts.reference {
            return Ok(false);
        }
        let covers = ops::attn_fp8_qk_covers(&self.dev, d_head);
        Ok(match self.opts.attn_fp8_qk {
            FastPathUse::Off => false,
            FastPathUse::Auto => covers && ops::ATTN_FP8_QK_DEFAULT_HEAD_DIMS.contains(&d_head),
            FastPathUse::Forced => {
                ensure!(
                    covers,
                    "--fast-path {}: no kernel at d_head {d_head} on this device (d_head 64 or 128 on sm_90a); drop it",
                    crate::backend::FAST_PATH_ATTN_FP8_QK
                );
                true
            }
        })
    }

    /// Whether an int8 or k8v4 cache's attention at `d_head` runs the fast path
    /// [`crate::backend::FAST_PATH_ATTN_INT8_QK`]: by default at the format's head sizes
    /// of `ops::ATTN_INT8_QK_DEFAULT_HEAD_DIMS` where the device has its kernel (f32
    /// output only: the caller checks the output type); forced, wherever
    /// it has one (else an error naming it); never when turned off.
    fn int8_qk_at(&self, d_head: usize) -> Result<bool> {
        if !matches!(self.kv_dtype, KvFormat::Int8 | KvFormat::K8v4) {
            return Ok(false);
        }
        let covers = ops::attn_int8_qk_covers(&self.dev, self.kv_dtype, d_head);
        self.coded_fast_path_at(self.opts.attn_int8_qk, crate::backend::FAST_PATH_ATTN_INT8_QK, covers, ops::attn_int8_qk_default(self.kv_dtype, d_head), d_head)
    }

    /// Whether an nvfp4, k4v2 or vq2 cache's attention at `d_head` runs the fast path
    /// [`crate::backend::FAST_PATH_ATTN_F16`], as [`Self::int8_qk_at`] decides for its
    /// formats (`ops::ATTN_F16_DEFAULT_HEAD_DIMS`).
    fn f16_at(&self, d_head: usize) -> Result<bool> {
        if !matches!(self.kv_dtype, KvFormat::Nvfp4 | KvFormat::K4v2 | KvFormat::Vq2) {
            return Ok(false);
        }
        let covers = ops::attn_f16_covers(&self.dev, self.kv_dtype, d_head);
        self.coded_fast_path_at(self.opts.attn_f16, crate::backend::FAST_PATH_ATTN_F16, covers, ops::attn_f16_default(self.kv_dtype, d_head), d_head)
    }

    /// A coded-cache fast path's decision on the default route: `by_default` (and
    /// `covers`) unless turned off; forced, `covers` or an error naming `name`.
    fn coded_fast_path_at(&self, use_: FastPathUse, name: &str, covers: bool, by_default: bool, d_head: usize) -> Result<bool> {
        if self.route != Route::Bf16TensorCore || self.opts.reference {
            return Ok(false);
        }
        Ok(match use_ {
            FastPathUse::Off => false,
            FastPathUse::Auto => covers && by_default,
            FastPathUse::Forced => {
                ensure!(covers, "--fast-path {name}: no kernel at d_head {d_head} on this device (d_head 64 or 128 on sm_90a); drop it");
                true
            }
        })
    }

    /// Whether a pass of `n_rows` scored rows runs the LM head of the fast path
    /// [`crate::backend::FAST_PATH_LM_HEAD_FUSED`] (the caller checked that it asks for
    /// no top-k, no listed ids and no soft-cap): on the default route where the device
    /// has the kernel and the product is wgmma-sized, unless turned off; forced, an
    /// error on a device without the kernel.
    fn lm_head_fused_for(&self, n_rows: usize, n_vocab: usize) -> Result<bool> {
        if self.route != Route::Bf16TensorCore {
            return Ok(false);
        }
        Ok(match self.opts.lm_head_fused {
            FastPathUse::Off => false,
            FastPathUse::Auto => ops::lm_head_fused_fits(&self.dev, n_rows, n_vocab),
            FastPathUse::Forced => {
                ensure!(
                    self.dev.has_function(ops::GEMM_LMHEAD_KERNEL),
                    "--fast-path {}: this device has no {} kernel (sm_90a builds only); drop it",
                    crate::backend::FAST_PATH_LM_HEAD_FUSED,
                    ops::GEMM_LMHEAD_KERNEL
                );
                ops::lm_head_fused_fits(&self.dev, n_rows, n_vocab)
            }
        })
    }

    /// The report's line on the LM head's fast path.
    fn lm_head_fast_path(&self) -> String {
        let name = crate::backend::FAST_PATH_LM_HEAD_FUSED;
        if self.route != Route::Bf16TensorCore {
            return format!("none ({name} runs on the default route)");
        }
        if !self.dev.has_function(ops::GEMM_LMHEAD_KERNEL) || self.dev.one_gemm_kernel() {
            return format!("none (no {} kernel on this device, or --reproducible's one GEMM kernel)", ops::GEMM_LMHEAD_KERNEL);
        }
        let how = match self.opts.lm_head_fused {
            FastPathUse::Off => return format!("{name} off (--no-fast-path or --reproducible): the tiled head"),
            FastPathUse::Auto => "on by default",
            FastPathUse::Forced => "forced (--fast-path)",
        };
        format!(
            "{name} {how}: passes of at least {} scored rows that ask for no top-k, no listed ids and no soft-cap run {} \
             (per row and 256-column tile the max and an f32 sum of ex2.approx terms, combined in f64 by lmhead_merge; \
             no logits written); the others the tiled head",
            ops::GEMM_WGMMA_MIN_M,
            ops::GEMM_LMHEAD_KERNEL
        )
    }

    /// The report's line on the attention fast path.
    fn attention_fast_path(&self) -> String {
        if matches!(self.kv_dtype, KvFormat::Nvfp4 | KvFormat::K4v2 | KvFormat::Vq2) && self.route == Route::Bf16TensorCore && !self.opts.reference {
            let name = crate::backend::FAST_PATH_ATTN_F16;
            let how = match self.opts.attn_f16 {
                FastPathUse::Off => {
                    return format!("{name} off (--no-fast-path, --use-original-nvfp4-prefill-kernel or --reproducible): kernel v3's decoding kernel")
                }
                FastPathUse::Auto => "on by default",
                FastPathUse::Forced => "forced (--fast-path)",
            };
            let dims: Vec<usize> = ops::ATTN_V3_HEAD_DIMS.iter().copied().filter(|&d| self.f16_at(d).unwrap_or(false)).collect();
            return format!(
                "{name} {how}, at d_head {dims:?} on this device: attn_wgmma_d<D>_{}f16 (kernel v3; K and V decoded to f16 as \
                 code value * f16(scale * 2^-e), e a power of two per key tile; q in f16 times a per-row power of two, P in f16; \
                 S and P·V by f16 wgmma)",
                self.kv_dtype.name()
            );
        }
        if matches!(self.kv_dtype, KvFormat::Int8 | KvFormat::K8v4) && self.route == Route::Bf16TensorCore && !self.opts.reference {
            let name = crate::backend::FAST_PATH_ATTN_INT8_QK;
            let how = match self.opts.attn_int8_qk {
                FastPathUse::Off => {
                    return format!("{name} off (--no-fast-path, --use-original-int8-prefill-kernel or --reproducible): kernel v3's decoding kernel")
                }
                FastPathUse::Auto => "on by default",
                FastPathUse::Forced => "forced (--fast-path)",
            };
            let dims: Vec<usize> = ops::ATTN_V3_HEAD_DIMS.iter().copied().filter(|&d| self.int8_qk_at(d).unwrap_or(false)).collect();
            return format!(
                "{name} {how}, at d_head {dims:?} on this device: attn_wgmma_d<D>_{}qk (kernel v3; S = Q·Kᵀ by f16 wgmma on K's \
                 stored codes written in f16, q in f16 times a per-row power of two, K's row scales folded into S's columns; \
                 P·V by f16 wgmma on V's codes times f16(scale * 2^-e), e a power of two per key tile)",
                self.kv_dtype.name()
            );
        }
        let name = crate::backend::FAST_PATH_ATTN_FP8_QK;
        if self.kv_dtype != KvFormat::Fp8 || self.route != Route::Bf16TensorCore || self.opts.reference {
            return format!("none ({name} reads an fp8 cache on the default route)");
        }
        let how = match self.opts.attn_fp8_qk {
            FastPathUse::Off => return format!("{name} off (--no-fast-path or --reproducible): kernel v3's decoding fp8 kernel"),
            FastPathUse::Auto => "on by default",
            FastPathUse::Forced => "forced (--fast-path)",
        };
        let dims: Vec<usize> = ops::ATTN_V3_HEAD_DIMS.iter().copied().filter(|&d| self.fp8_qk_at(d).unwrap_or(false)).collect();
        if dims.is_empty() {
            return format!("{name} not on by default at any head size on this device (--fast-path {name} forces it): kernel v3's decoding fp8 kernel");
        }
        format!(
            "{name} {how}, at d_head {dims:?} on this device: attn_wgmma_d<D>_fp8qk (kernel v3; S = Q·Kᵀ by e4m3 wgmma on K's \
             stored codes, q as e4m3 hi + lo times a per-row power of two, K's row scales folded into S's columns; V decoded \
             as kernel v3's fp8 kernel does)"
        )
    }

    /// `--reference`: K and V rows stored as decode(encode(row)) through their codecs
    /// (`ops::kv_roundtrip`, bit for bit the CPU backend's store; f32 rows as they are)
    /// into the f32 cache, non-finite counts into `n_bad`, then the FP32 route's
    /// attention (kernel v1) on that cache, as on `--lossless`.
    #[allow(clippy::too_many_arguments)]
    fn kv_roundtrip_and_attend<O: ops::OutElem>(
        &self,
        kv: &mut [DeviceBuffer<f32>; 2],
        n_bad: &mut DeviceBuffer<u64>,
        book: Option<&ops::VqBook>,
        shape: ops::KvShape,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        out: &mut DeviceBuffer<O>,
        p: &ops::AttnParams,
    ) -> Result<()> {
        let (kcodec, vcodec) = self.reference_codecs().context("attention: a decoded cache off the --reference route")?;
        let [kc, vc] = kv;
        let (n_seqs, n) = (p.n_seqs, p.n_tokens);
        for (codec, src, cache, what) in [(kcodec, k, &mut *kc, "K"), (vcodec, v, &mut *vc, "V")] {
            let src_f32 = src.f32("attention")?.view();
            if codec.elem == crate::kv::ElemCodec::F32 {
                ops::kv_store(&self.dev, src_f32, n_seqs, n, src.n_cols, cache.view_mut(), shape, p.pos0)
            } else {
                ops::kv_roundtrip(&self.dev, codec, src_f32, n_seqs, n, src.n_cols, cache.view_mut(), shape, p.pos0, n_bad.view_mut(), book)
            }
            .with_context(|| format!("attention: store {what} ({}, --reference)", codec.name()))?;
        }
        ops::attention::<f32, O>(&self.dev, self.attention_kernel(), q.f32("attention")?.view(), kc.view(), vc.view(), shape, out.view_mut(), p)
    }

    /// Stores k and v in `layer`'s cache and attends q into `out` (f32 or bf16).
    #[allow(clippy::too_many_arguments)]
    fn store_and_attend<O: ops::OutElem>(
        &self,
        cache: &mut CudaKvCache,
        layer: usize,
        shape: ops::KvShape,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        out: &mut DeviceBuffer<O>,
        p: &ops::AttnParams,
    ) -> Result<()> {
        match &mut cache.layers {
            KvLayers::Bf16(l) => self.kv_store_and_attend(&mut l[layer], shape, q, k, v, out, p),
            KvLayers::F32(l) => self.kv_store_and_attend(&mut l[layer], shape, q, k, v, out, p),
            KvLayers::Coded(l) => self.kv_encode_and_attend(&mut l[layer], &mut cache.n_bad, cache.book.as_ref(), shape, q, k, v, out, p),
            KvLayers::Decoded(l) => self.kv_roundtrip_and_attend(&mut l[layer], &mut cache.n_bad, cache.book.as_ref(), shape, q, k, v, out, p),
        }
    }

    /// The prefill attention kernel of this backend's route and KV type: the
    /// tensor-core kernel (v2) on the default route with a bf16 or quantized cache
    /// (the quantized formats only run there, `open` refuses the rest but for
    /// `--reference`); the f32 CUDA-core kernel (v1) on the FP32 route (its exact
    /// path, and `--reference`'s on its f32 cache) and for an f32 cache.
    pub fn attention_kernel(&self) -> ops::AttnKernel {
        match self.route {
            Route::Bf16TensorCore if self.kv_dtype != KvFormat::F32 => ops::AttnKernel::V2,
            _ => ops::AttnKernel::V1,
        }
    }

    /// The head sizes at which this backend's calls for kernel v2 run kernel v3 instead
    /// (`ops::AttnKernel::routes_to_v3`: sm_90a, a cache of `ops::ATTN_V3_DEFAULT_KV`, the head sizes of
    /// `ops::ATTN_V3_DEFAULT_HEAD_DIMS`); empty on other routes, caches and devices.
    fn v3_head_dims(&self) -> Vec<usize> {
        if self.attention_kernel() != ops::AttnKernel::V2 {
            return Vec::new();
        }
        ops::ATTN_V3_DEFAULT_HEAD_DIMS.iter().copied().filter(|&d| ops::AttnKernel::routes_to_v3(&self.dev, self.kv_dtype.name(), d)).collect()
    }

    /// The report's line on attention: the route's kernel, and where kernel v3 runs its calls.
    fn attention_description(&self) -> String {
        let mut s = self.attention_kernel().describe().to_string();
        let v3 = self.v3_head_dims();
        if !v3.is_empty() {
            s.push_str(&format!("; on this device kernel v3 runs it at d_head {v3:?}: {}", ops::AttnKernel::V3.describe()));
        }
        s
    }

    /// The kernels that store and read the KV cache, for the report.
    fn kv_cache_kernels(&self) -> String {
        let f = self.kv_dtype;
        if let Some((k, v)) = self.reference_codecs() {
            let store = |c: crate::kv::RowCodec| ops::kv_roundtrip_kernel(c.elem).unwrap_or("kv_store_f32");
            return format!(
                "--reference: an f32 cache; K ({}) stored by {}, V ({}) stored by {} (kernels/kv_codec.cu: each row \
                 decode(encode(row)) through src/kv's codec, inverse rotation included, bit-identical to the CPU backend's \
                 stored row); read by attn_prefill_d<D>_f32 (kernel v1, as --lossless)",
                k.name(),
                store(k),
                v.name(),
                store(v)
            );
        }
        let v3 = self.v3_head_dims();
        let reader = match self.attention_kernel() {
            ops::AttnKernel::V1 => format!("attn_prefill_d<D>_{f}"),
            ops::AttnKernel::V2 if !v3.is_empty() => format!("attn_flash_d<D>_{f} (attn_wgmma_d<D>_{f}, kernel v3, at d_head {v3:?})"),
            ops::AttnKernel::V2 => format!("attn_flash_d<D>_{f}"),
            ops::AttnKernel::V3 => format!("attn_wgmma_d<D>_{f}"),
        };
        if !f.is_quantized() {
            return format!("stored by kv_store_{f} (round to nearest even); read by {reader}");
        }
        let crate::kv::KvCodecs { k, v, .. } = self.kv_codecs();
        let enc = |c: crate::kv::RowCodec| ops::kv_encode_kernel(c.elem).unwrap_or("none");
        format!(
            "K ({}) stored by {}, V ({}) stored by {} (kernels/kv_codec.cu: src/kv's rows, bit-identical to the CPU codec); \
             read by {reader} (each element decoded as src/kv decodes it, rounded to bf16 in the K/V tile load{}{})",
            k.name(),
            enc(k),
            v.name(),
            enc(v),
            {
                // kernels/attention.cu keeps fp8/int8 codes unscaled in the tile at d_head <= 128.
                let folds = |c: crate::kv::RowCodec| matches!(c.elem, crate::kv::ElemCodec::Fp8 | crate::kv::ElemCodec::Int8);
                match (folds(k), folds(v)) {
                    (true, true) => "; at d_head <= 128 the fp8/int8 codes themselves in the tile (exact in bf16), K's row scale folded into the scores' scale and V's into P before its bf16 rounding",
                    (true, false) => "; at d_head <= 128 K's int8/fp8 codes themselves in the tile (exact in bf16), its row scale folded into the scores' scale",
                    (false, true) => "; at d_head <= 128 V's int8/fp8 codes themselves in the tile (exact in bf16), its row scale folded into P before its bf16 rounding",
                    (false, false) => "",
                }
            },
            if k.rotate || v.rotate { "; q rotated in the kernel for rotated K, the output rotated back for rotated V" } else { "" }
        )
    }
}

impl Backend for CudaBackend {
    type Act = CudaAct;
    type Matrix = CudaMatrix;
    type Vector = DeviceBuffer<f32>;
    type KvCache = CudaKvCache;
    type Recurrent = super::delta_net::CudaRecurrent;
    type ExpertCounts = DeviceBuffer<u64>;

    fn describe(&self) -> String {
        let mut extra = String::new();
        if self.opts.reference {
            extra.push_str(", --reference");
        }
        if self.opts.reproducible {
            extra.push_str(", --reproducible");
        }
        format!("cuda {} (route {}, KV {}{extra})", self.dev.info(), self.route.name(), self.kv_dtype.name())
    }

    fn load_matrix(&self, view: &TensorView) -> Result<CudaMatrix> {
        let shape = &view.entry.shape;
        ensure!(shape.len() == 2, "tensor {}: shape {shape:?} is not a matrix", view.entry.name);
        let (n_out, n_in) = view.rows_cols();
        let q = QuantMatrix::upload(&self.dev, view.format(), n_out, n_in, view.bytes)
            .with_context(|| format!("load {} onto the GPU", view.entry.name))?;
        Ok(CudaMatrix { name: view.entry.name.clone(), q })
    }

    fn load_vector(&self, view: &TensorView) -> Result<DeviceBuffer<f32>> {
        let shape = &view.entry.shape;
        ensure!(shape.len() == 1, "tensor {}: shape {shape:?} is not a vector", view.entry.name);
        self.dev.upload(&dequant::dequantize(view)?)
    }

    fn new_recurrent(&self, p: &DeltaNetParams, n_seqs: usize) -> Result<super::delta_net::CudaRecurrent> {
        super::delta_net::CudaRecurrent::new(&self.dev, p, n_seqs)
    }

    fn recurrent_states(&self, r: &super::delta_net::CudaRecurrent) -> Result<Vec<RecurrentState>> {
        r.to_host(&self.dev)
    }

    fn new_kv_cache(&self, g: KvGeometry) -> Result<CudaKvCache> {
        ensure!(
            g.d_head == g.d_head_v,
            "attention on CUDA: d_head_v {} differs from d_head {} (not supported by the kernels)",
            g.d_head_v,
            g.d_head
        );
        let shape = ops::KvShape { n_seqs: g.n_seqs, n_kv_heads: g.n_kv_heads, n_ctx: g.max_pos, d_head: g.d_head };
        let layers = match self.kv_dtype {
            f if self.opts.reference => {
                let (kc, vc) = self.reference_codecs().context("kv cache on CUDA: --reference codecs")?;
                kc.check_len(g.d_head).context("kv cache on CUDA (--reference): K rows")?;
                vc.check_len(g.d_head_v).context("kv cache on CUDA (--reference): V rows")?;
                ensure!(ops::kv_format_has_kernels(f), "kv cache on CUDA: format {f} is not implemented");
                KvLayers::Decoded(self.kv_buffers(g.n_layers, shape.len())?)
            }
            KvFormat::Bf16 => KvLayers::Bf16(self.kv_buffers(g.n_layers, shape.len())?),
            KvFormat::F32 => KvLayers::F32(self.kv_buffers(g.n_layers, shape.len())?),
            f if f.is_quantized() && ops::kv_format_has_kernels(f) => {
                f.check_dims(g.d_head, g.d_head_v).context("kv cache on CUDA")?;
                let c = self.kv_codecs();
                let (nk, nv) = (shape.coded_bytes(c.k), shape.coded_bytes(c.v));
                KvLayers::Coded((0..g.n_layers).map(|_| Ok([self.dev.alloc_zeros(nk)?, self.dev.alloc_zeros(nv)?])).collect::<Result<_>>()?)
            }
            other => bail!("kv cache on CUDA: format {other} is not implemented"),
        };
        let c = self.kv_codecs();
        let uses_book = [c.k, c.v].iter().any(|c| c.elem == crate::kv::ElemCodec::Vq2);
        let book = if uses_book { Some(ops::VqBook::upload(&self.dev)?) } else { None };
        Ok(CudaKvCache { geometry: g, layers, n_bad: self.dev.alloc_zeros(1)?, book })
    }

    fn embed(&self, table: &CudaMatrix, tokens: &[u32], scale: f64) -> Result<CudaAct> {
        let _prof = self.prof.scope(&self.dev, "embed")?;
        let n_vocab = table.q.n_rows;
        let ids: Vec<i32> = tokens
            .iter()
            .map(|&t| {
                ensure!((t as usize) < n_vocab, "embed: token {t} is outside the vocabulary of {n_vocab}");
                Ok(t as i32)
            })
            .collect::<Result<_>>()?;
        let mut out = self.new_act(tokens.len(), table.q.n_cols)?;
        if tokens.is_empty() {
            return Ok(out);
        }
        let ids = self.dev.upload(&ids)?;
        ops::embed(&self.dev, ids.view(), &table.q, out.f32_mut("embed")?.view_mut(), scale as f32)
            .with_context(|| format!("embed {}", table.name))?;
        Ok(out)
    }

    fn rms_norm(&self, x: &CudaAct, w: &DeviceBuffer<f32>, eps: f64) -> Result<CudaAct> {
        let _prof = self.prof.scope(&self.dev, "rms_norm")?;
        ensure!(w.len() == x.n_cols, "rms_norm: weight has {} elements, rows have {}", w.len(), x.n_cols);
        let mut out = self.new_act(x.n_rows, x.n_cols)?;
        let rows = Rows::contiguous(x.n_rows, x.n_cols);
        let xf = x.f32("rms_norm")?.view();
        if self.bf16_matmul_inputs() {
            // f32 for a residual add after a post norm, bf16 for the matmuls (one pass).
            let mut ob = self.dev.alloc_uninit::<bf16>(x.n_rows * x.n_cols)?;
            ops::rmsnorm_dual(&self.dev, xf, rows, w.view(), out.f32_mut("rms_norm")?.view_mut(), ob.view_mut(), eps as f32)?;
            out.bf16 = Some(ob);
        } else {
            ops::rmsnorm::<f32>(&self.dev, xf, rows, w.view(), out.f32_mut("rms_norm")?.view_mut(), x.n_cols, eps as f32)?;
        }
        Ok(out)
    }

    fn rms_norm_for_matmul(&self, x: &CudaAct, w: &DeviceBuffer<f32>, eps: f64) -> Result<CudaAct> {
        if !self.bf16_matmul_inputs() {
            return self.rms_norm(x, w, eps);
        }
        let _prof = self.prof.scope(&self.dev, "rms_norm")?;
        ensure!(w.len() == x.n_cols, "rms_norm: weight has {} elements, rows have {}", w.len(), x.n_cols);
        // Only matmuls read it: the bf16 rounding alone (rmsnorm_dual's bf16 bits).
        let mut out = self.new_act_bf16(x.n_rows, x.n_cols)?;
        let rows = Rows::contiguous(x.n_rows, x.n_cols);
        let ov = out.bf16.as_mut().context("rms_norm: bf16 output")?.view_mut();
        ops::rmsnorm::<bf16>(&self.dev, x.f32("rms_norm")?.view(), rows, w.view(), ov, x.n_cols, eps as f32)?;
        Ok(out)
    }

    fn rms_norm_heads(&self, x: &mut CudaAct, w: &DeviceBuffer<f32>, d_head: usize, eps: f64) -> Result<()> {
        let _prof = self.prof.scope(&self.dev, "rms_norm")?;
        ensure!(w.len() == d_head, "rms_norm_heads: weight has {} elements, d_head is {d_head}", w.len());
        ensure!(d_head > 0 && x.n_cols % d_head == 0, "rms_norm_heads: rows of {} are not whole heads of {d_head}", x.n_cols);
        let rows = Rows::contiguous(x.n_rows * (x.n_cols / d_head), d_head);
        ops::rmsnorm_inplace(&self.dev, x.f32_mut("rms_norm_heads")?.view_mut(), rows, w.view(), eps as f32)
    }

    fn matmul(&self, x: &CudaAct, w: &CudaMatrix) -> Result<CudaAct> {
        let _prof = self.prof.scope(&self.dev, "matmul")?;
        ensure!(
            x.n_cols == w.q.n_cols,
            "matmul {}: x has {} columns, the weight takes {}",
            w.name,
            x.n_cols,
            w.q.n_cols
        );
        let mut y = self.new_act(x.n_rows, w.q.n_rows)?;
        let ldy = y.n_cols;
        let mut run = || -> Result<()> {
            let yv = y.f32_mut("matmul")?.view_mut();
            match self.route {
                Route::Bf16TensorCore => {
                    let mut tmp = None;
                    let xb = self.bf16_input(x, &mut tmp)?;
                    ops::matmul::<bf16>(&self.dev, xb, x.n_rows, &w.q, yv, ldy)
                }
                Route::Fp32 => ops::matmul::<f32>(&self.dev, x.f32("matmul")?.view(), x.n_rows, &w.q, yv, ldy),
            }
        };
        run().with_context(|| format!("matmul {}", w.name))?;
        Ok(y)
    }

    fn matmul_add(&self, x: &mut CudaAct, a: &CudaAct, w: &CudaMatrix) -> Result<()> {
        if !self.bf16_matmul_inputs() {
            let y = self.matmul(a, w)?;
            return self.add_assign(x, &y);
        }
        let _prof = self.prof.scope(&self.dev, "matmul")?;
        ensure!(
            a.n_cols == w.q.n_cols && x.n_rows == a.n_rows && x.n_cols == w.q.n_rows,
            "matmul_add {}: a is {} x {}, x {} x {}, the weight {} x {}",
            w.name,
            a.n_rows,
            a.n_cols,
            x.n_rows,
            x.n_cols,
            w.q.n_rows,
            w.q.n_cols
        );
        let mut tmp = None;
        let ab = self.bf16_input(a, &mut tmp)?;
        let xv = x.f32_mut("matmul_add")?.view_mut();
        ops::matmul_add_bf16(&self.dev, ab, a.n_rows, &w.q, xv).with_context(|| format!("matmul_add {}", w.name))
    }

    fn qkv(&self, h: &CudaAct, w: [&CudaMatrix; 3], bias: Option<&[DeviceBuffer<f32>; 3]>) -> Result<[CudaAct; 3]> {
        let widths = [w[0].q.n_rows, w[1].q.n_rows, w[2].q.n_rows];
        if !self.fuse_qkv || !self.bf16_matmul_inputs() || !ops::qkv_fusable(&self.dev, h.n_rows, widths) {
            return crate::backend::qkv_unfused(self, h, w, bias);
        }
        let _prof = self.prof.scope(&self.dev, "matmul")?;
        let names = || format!("qkv {} / {} / {}", w[0].name, w[1].name, w[2].name);
        for wi in w {
            ensure!(h.n_cols == wi.q.n_cols, "{}: h has {} columns, {} takes {}", names(), h.n_cols, wi.name, wi.q.n_cols);
        }
        let mut ys = [self.new_act(h.n_rows, widths[0])?, self.new_act(h.n_rows, widths[1])?, self.new_act(h.n_rows, widths[2])?];
        let mut tmp = None;
        let hb = self.bf16_input(h, &mut tmp)?;
        let [y0, y1, y2] = &mut ys;
        let outs = [y0.f32_mut("qkv")?.view_mut(), y1.f32_mut("qkv")?.view_mut(), y2.f32_mut("qkv")?.view_mut()];
        let bias = bias.map(|[bq, bk, bv]| [bq.view(), bk.view(), bv.view()]);
        ops::matmul_qkv_bf16(&self.dev, hb, h.n_rows, [&w[0].q, &w[1].q, &w[2].q], bias, outs).with_context(names)?;
        Ok(ys)
    }

    fn add_bias(&self, x: &mut CudaAct, b: &DeviceBuffer<f32>) -> Result<()> {
        let _prof = self.prof.scope(&self.dev, "elementwise")?;
        ensure!(b.len() == x.n_cols, "add_bias: bias has {} elements, rows have {}", b.len(), x.n_cols);
        ops::add_bias(&self.dev, x.f32_mut("add_bias")?.view_mut(), b.view())
    }

    fn rope(&self, x: &mut CudaAct, n_heads: usize, d_head: usize, rows: PassRows, p: &RopeParams) -> Result<()> {
        let _prof = self.prof.scope(&self.dev, "rope")?;
        ensure!(
            x.n_cols == n_heads * d_head,
            "rope: rows have {} columns, expected {n_heads} heads x {d_head}",
            x.n_cols
        );
        ensure!(p.rope_dim % 2 == 0 && p.rope_dim <= d_head, "rope: rope_dim {} is odd or exceeds d_head {d_head}", p.rope_dim);
        ensure!(p.scale > 0.0, "rope: scale {} is not positive", p.scale);
        ensure!(x.n_rows == rows.n_rows(), "rope: {} rows for a pass of {rows:?}", x.n_rows);
        if p.rope_dim == 0 || x.n_rows == 0 {
            return Ok(());
        }
        let params = rope_params(n_heads, d_head, p);
        let n_cols = x.n_cols;
        let n_rows = x.n_rows;
        let max_pos = rows.pos0 + rows.n_tokens - 1;
        let mut tables = self.rope_tables.borrow_mut();
        let t = self.rope_table(&mut tables, &params, max_pos + 1)?;
        let xv = x.f32_mut("rope")?.view_mut();
        self.with_positions(rows.pos0, rows.n_tokens, |pos| {
            ops::rope_tabled(&self.dev, xv, n_cols, n_rows, pos, max_pos, t.table.view(), &params)
        })
    }

    fn matmul_rope(&self, x: &CudaAct, w: &CudaMatrix, n_heads: usize, d_head: usize, rows: PassRows, p: &RopeParams) -> Result<CudaAct> {
        let params = rope_params(n_heads, d_head, p);
        let fused = self.bf16_matmul_inputs()
            && p.rope_dim > 0
            && p.scale > 0.0
            && x.n_rows == rows.n_rows()
            && x.n_cols == w.q.n_cols
            && w.q.n_rows == n_heads * d_head
            && ops::gemm_rope_fits(&self.dev, x.n_rows, &params);
        if !fused {
            let mut y = self.matmul(x, w)?;
            self.rope(&mut y, n_heads, d_head, rows, p)?;
            return Ok(y);
        }
        let _prof = self.prof.scope(&self.dev, "matmul")?;
        let mut y = self.new_act(x.n_rows, w.q.n_rows)?;
        // gemm_rope_fits: the wgmma kernel, so rows (and tokens) are not 0.
        let max_pos = rows.pos0 + rows.n_tokens - 1;
        let mut tables = self.rope_tables.borrow_mut();
        let t = self.rope_table(&mut tables, &params, max_pos + 1)?;
        let mut tmp = None;
        let xb = self.bf16_input(x, &mut tmp)?;
        let yv = y.f32_mut("matmul_rope")?.view_mut();
        self.with_positions(rows.pos0, rows.n_tokens, |pos| {
            ops::matmul_rope_bf16(&self.dev, xb, x.n_rows, &w.q, yv, pos, max_pos, t.table.view(), &params)
        })
        .with_context(|| format!("matmul_rope {}", w.name))?;
        Ok(y)
    }

    fn qkv_rope(
        &self,
        h: &CudaAct,
        w: [&CudaMatrix; 3],
        bias: Option<&[DeviceBuffer<f32>; 3]>,
        n_heads: usize,
        n_kv_heads: usize,
        d_head: usize,
        rows: PassRows,
        p: &RopeParams,
    ) -> Result<[CudaAct; 3]> {
        // The stacked QKV GEMM (when on) and a bias (added after the product, before
        // RoPE) keep the unfused order.
        let widths = [w[0].q.n_rows, w[1].q.n_rows, w[2].q.n_rows];
        let stacked = self.fuse_qkv && self.bf16_matmul_inputs() && ops::qkv_fusable(&self.dev, h.n_rows, widths);
        if stacked || bias.is_some() {
            return crate::backend::qkv_rope_unfused(self, h, w, bias, [n_heads, n_kv_heads], d_head, rows, p);
        }
        let q = self.matmul_rope(h, w[0], n_heads, d_head, rows, p)?;
        let k = self.matmul_rope(h, w[1], n_kv_heads, d_head, rows, p)?;
        Ok([q, k, self.matmul(h, w[2])?])
    }

    fn attention(
        &self,
        cache: &mut CudaKvCache,
        layer: usize,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        rows: PassRows,
        p: &AttnParams,
    ) -> Result<CudaAct> {
        let _prof = self.prof.scope(&self.dev, "attention")?;
        let g = cache.geometry;
        let (n, pos0) = (rows.n_rows(), rows.pos0);
        ensure!(layer < g.n_layers, "attention: layer {layer} of a cache for {}", g.n_layers);
        ensure!(rows.n_seqs <= g.n_seqs, "attention: {} windows in a pass, the KV cache has {} slots", rows.n_seqs, g.n_seqs);
        ensure!(
            pos0 + rows.n_tokens <= g.max_pos,
            "attention: positions {pos0}..{} exceed the KV cache's {}",
            pos0 + rows.n_tokens,
            g.max_pos
        );
        ensure!(
            q.n_rows == n && k.n_rows == n && v.n_rows == n,
            "attention: q, k, v have {}, {}, {} rows for a pass of {rows:?}",
            q.n_rows,
            k.n_rows,
            v.n_rows
        );
        ensure!(
            p.d_head == p.d_head_v && p.d_head == g.d_head && p.n_kv_heads == g.n_kv_heads,
            "attention on CUDA: d_head {} / d_head_v {} / {} KV heads do not match the cache ({} / {} / {}); \
             d_head_v != d_head is not supported by the kernels",
            p.d_head,
            p.d_head_v,
            p.n_kv_heads,
            g.d_head,
            g.d_head_v,
            g.n_kv_heads
        );
        let kv_cols = g.n_kv_heads * g.d_head;
        ensure!(
            k.n_cols == kv_cols && v.n_cols == kv_cols && q.n_cols == p.n_heads * p.d_head,
            "attention: k has {} columns, v {} (cache {kv_cols}), q {} ({} heads x {})",
            k.n_cols,
            v.n_cols,
            q.n_cols,
            p.n_heads,
            p.d_head
        );
        let shape = ops::KvShape { n_seqs: g.n_seqs, n_kv_heads: g.n_kv_heads, n_ctx: g.max_pos, d_head: g.d_head };
        let width = p.n_heads * p.d_head;
        let params = ops::AttnParams {
            n_seqs: rows.n_seqs,
            n_tokens: rows.n_tokens,
            n_heads: p.n_heads,
            pos0,
            window: p.window.unwrap_or(0),
            scale: p.scale as f32,
            softcap: p.softcap.unwrap_or(0.0) as f32,
            q_stride: width,
            out_stride: width,
        };
        ensure!(p.window != Some(0), "attention: a sliding window of 0 positions");
        // The default route's output feeds only the output projection: bf16, as that matmul rounds it
        // (where the cache's attention kernel has a bf16 output: bf16, f32 and fp8 caches).
        let bf16_out = self.bf16_matmul_inputs() && matches!(self.kv_dtype, KvFormat::Bf16 | KvFormat::F32 | KvFormat::Fp8);
        let mut out = if bf16_out { self.new_act_bf16(n, width)? } else { self.new_act(n, width)? };
        if n == 0 {
            return Ok(out);
        }
        match (&mut out.f32, &mut out.bf16) {
            (Some(o), _) => self.store_and_attend(cache, layer, shape, q, k, v, o, &params)?,
            (None, Some(o)) => self.store_and_attend(cache, layer, shape, q, k, v, o, &params)?,
            (None, None) => bail!("attention: output buffer missing"),
        }
        Ok(out)
    }

    fn gated_act(&self, gate: &CudaAct, up: &CudaAct, act: Activation) -> Result<CudaAct> {
        let _prof = self.prof.scope(&self.dev, "elementwise")?;
        same_shape("gated_act", gate, up)?;
        let a = ops_activation(act);
        let (rows, c) = (Rows::contiguous(gate.n_rows, gate.n_cols), gate.n_cols);
        let (g, u) = (gate.f32("gated_act")?.view(), up.f32("gated_act")?.view());
        // The default route's product feeds only the down projection: bf16, as that matmul rounds it.
        if self.bf16_matmul_inputs() {
            let mut out = self.new_act_bf16(gate.n_rows, gate.n_cols)?;
            let ov = out.bf16.as_mut().context("gated_act: bf16 output")?.view_mut();
            ops::gated::<bf16>(&self.dev, a, g, rows, u, c, ov, c)?;
            Ok(out)
        } else {
            let mut out = self.new_act(gate.n_rows, gate.n_cols)?;
            ops::gated::<f32>(&self.dev, a, g, rows, u, c, out.f32_mut("gated_act")?.view_mut(), c)?;
            Ok(out)
        }
    }

    fn gated_ffn(&self, h: &CudaAct, gate: &CudaMatrix, up: &CudaMatrix, act: Activation) -> Result<CudaAct> {
        let _prof = self.prof.scope(&self.dev, "gated_ffn")?;
        ensure!(
            h.n_cols == gate.q.n_cols && gate.q.n_rows == up.q.n_rows && gate.q.n_cols == up.q.n_cols,
            "gated_ffn {} / {}: h has {} columns, gate is {} x {}, up {} x {}",
            gate.name,
            up.name,
            h.n_cols,
            gate.q.n_rows,
            gate.q.n_cols,
            up.q.n_rows,
            up.q.n_cols
        );
        if !self.bf16_matmul_inputs() {
            let g = self.matmul(h, gate)?;
            let u = self.matmul(h, up)?;
            return self.gated_act(&g, &u, act);
        }
        let a = ops_activation(act);
        let mut tmp = None;
        let hb = self.bf16_input(h, &mut tmp)?;
        // bf16 out: it feeds only the down projection, which rounds it so.
        let mut out = self.new_act_bf16(h.n_rows, gate.q.n_rows)?;
        let ov = out.bf16.as_mut().context("gated_ffn: bf16 output")?.view_mut();
        ops::matmul_gated_bf16(&self.dev, a, hb, h.n_rows, &gate.q, &up.q, ov)
            .with_context(|| format!("gated_ffn {} / {}", gate.name, up.name))?;
        Ok(out)
    }

    fn new_expert_counts(&self, n_experts: usize) -> Result<DeviceBuffer<u64>> {
        self.dev.alloc_zeros(n_experts)
    }

    fn read_expert_counts(&self, c: &DeviceBuffer<u64>) -> Result<Vec<u64>> {
        self.dev.download(c).context("expert-usage counts to the host")
    }

    fn moe_ffn(&self, x: &CudaAct, router_logits: &CudaAct, experts: &[Expert<CudaMatrix>], p: &MoeRouting, counts: &mut DeviceBuffer<u64>) -> Result<CudaAct> {
        // Timed inside, per part (moe_route, moe_gate_up, ...).
        self.moe_ffn_cuda(x, router_logits, experts, p, counts)
    }

    fn sigmoid_mul(&self, x: &mut CudaAct, gate: &CudaAct) -> Result<()> {
        let _prof = self.prof.scope(&self.dev, "elementwise")?;
        self.sigmoid_mul_cuda(x, gate)
    }

    fn delta_net(
        &self,
        qkv: &CudaAct,
        z: &CudaAct,
        ba: &CudaAct,
        w: &DeltaNetWeights<DeviceBuffer<f32>>,
        p: &DeltaNetParams,
        states: &mut super::delta_net::CudaRecurrent,
        rows: PassRows,
    ) -> Result<CudaAct> {
        let _prof = self.prof.scope(&self.dev, "delta_net")?;
        self.delta_net_cuda(qkv, z, ba, w, p, states, rows)
    }

    fn add_assign(&self, x: &mut CudaAct, y: &CudaAct) -> Result<()> {
        let _prof = self.prof.scope(&self.dev, "elementwise")?;
        same_shape("add", x, y)?;
        let yv = y.f32("add")?.view();
        ops::add_inplace(&self.dev, x.f32_mut("add")?.view_mut(), yv)
    }

    fn add_rms_norm(&self, x: &mut CudaAct, y: &CudaAct, w: &DeviceBuffer<f32>, eps: f64) -> Result<CudaAct> {
        if !self.bf16_matmul_inputs() {
            self.add_assign(x, y)?;
            return self.rms_norm(x, w, eps);
        }
        let _prof = self.prof.scope(&self.dev, "add_rms_norm")?;
        same_shape("add_rms_norm", x, y)?;
        ensure!(w.len() == x.n_cols, "add_rms_norm: weight has {} elements, rows have {}", w.len(), x.n_cols);
        let mut out = self.new_act(x.n_rows, x.n_cols)?;
        let mut ob = self.dev.alloc_uninit::<bf16>(x.n_rows * x.n_cols)?;
        let rows = Rows::contiguous(x.n_rows, x.n_cols);
        let yv = y.f32("add_rms_norm")?.view();
        let xv = x.f32_mut("add_rms_norm")?.view_mut();
        ops::add_rmsnorm_dual(&self.dev, xv, yv, rows, w.view(), out.f32_mut("add_rms_norm")?.view_mut(), ob.view_mut(), eps as f32)?;
        out.bf16 = Some(ob);
        Ok(out)
    }

    fn score_rows(&self, x: &CudaAct, rows: &[usize], head: &CudaMatrix, req: &HeadRequest) -> Result<Vec<RowScore>> {
        let _prof = self.prof.scope(&self.dev, "lm_head")?;
        let (d, n_vocab) = (x.n_cols, head.q.n_rows);
        ensure!(d == head.q.n_cols, "score_rows: rows have {d} columns, the head {} takes {}", head.name, head.q.n_cols);
        let n = rows.len();
        check_request(n, n_vocab, req)?;
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.n_rows) {
            bail!("score_rows: row {bad} of {}", x.n_rows);
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let dev = &self.dev;
        // (n, d): a sub-range when the rows are consecutive (the model's case), else gathered.
        let consecutive = rows.windows(2).all(|w| w[1] == w[0] + 1);
        let gathered;
        let h: DevView<f32> = if consecutive {
            x.f32("score_rows")?.slice(rows[0] * d..(rows[0] + n) * d)?
        } else {
            let ids: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
            let ids = dev.upload(&ids)?;
            let mut g = dev.alloc_uninit::<f32>(n * d)?;
            ops::gather_rows(dev, x.f32("score_rows")?.view(), d, ids.view(), g.view_mut())?;
            gathered = g;
            gathered.view()
        };
        let targets: Vec<i32> = req.targets.iter().map(|&t| t as i32).collect();
        let targets = dev.upload(&targets)?;
        let mut out = LmHeadOut::new(dev, n, req.top_k)?;

        // Listed ids: flattened (row, id) pairs, row-major, with each row's offset.
        let mut offsets = vec![0usize; n + 1];
        let mut pair_rows = Vec::new();
        let mut pair_ids = Vec::new();
        for r in 0..n {
            if let Some(ids) = req.extra_ids.get(r) {
                pair_ids.extend(ids.iter().map(|&i| i as i32));
            }
            offsets[r + 1] = pair_ids.len();
        }
        let mut extra_dev = if pair_ids.is_empty() { None } else { Some(dev.alloc_uninit::<f32>(pair_ids.len())?) };

        let tile_len = ops::lm_head_tile_rows(n_vocab).min(n) * n_vocab;
        let mut scratch_cell = self.head_scratch.borrow_mut();
        if scratch_cell.as_ref().is_none_or(|s| s.len() < tile_len) {
            *scratch_cell = None;
            *scratch_cell = Some(dev.alloc_uninit::<f32>(tile_len)?);
        }
        let scratch = scratch_cell.as_mut().context("score_rows: LM-head scratch")?;
        let h_cast;
        // The default route rounds the rows to bf16 once, for the tensor cores (the
        // norm's bf16 copy when the rows are consecutive).
        let h_bf16: Option<DevView<bf16>> = match (self.route, x.bf16()) {
            (Route::Bf16TensorCore, Some(xb)) if consecutive => Some(xb.slice(rows[0] * d..(rows[0] + n) * d)?),
            (Route::Bf16TensorCore, _) => {
                let mut hb = dev.alloc_uninit::<bf16>(n * d)?;
                ops::cast_bf16(dev, h, hb.view_mut())?;
                h_cast = hb;
                Some(h_cast.view())
            }
            (Route::Fp32, _) => None,
        };
        // Listed ids' logits, gathered from each tile before the next overwrites it.
        let gather = |row0: usize, n_tile: usize, logits: DevView<f32>| -> Result<()> {
            let Some(extra) = extra_dev.as_mut() else { return Ok(()) };
            let (p0, p1) = (offsets[row0], offsets[row0 + n_tile]);
            if p1 > p0 {
                pair_rows.clear();
                for r in row0..row0 + n_tile {
                    pair_rows.extend(std::iter::repeat_n((r - row0) as i32, offsets[r + 1] - offsets[r]));
                }
                let rows_d = dev.upload(&pair_rows)?;
                let ids_d = dev.upload(&pair_ids[p0..p1])?;
                ops::gather_pairs(dev, logits, n_vocab, rows_d.view(), ids_d.view(), extra.slice_mut(p0..p1)?)?;
                // The uploads are freed in stream order after the gather.
            }
            Ok(())
        };
        // (n_tile, n_vocab) f32 logits a tile: bf16 rows on the tensor cores (default
        // route) or f32 rows with FFMA (FP32 route), f32 accumulation either way.
        let softcap = req.softcap.map(|c| c as f32);
        let fused = softcap.is_none() && req.top_k == 0 && pair_ids.is_empty() && self.lm_head_fused_for(n, n_vocab)?;
        match h_bf16 {
            Some(hb) if fused => ops::lm_head_fused(dev, hb, n, &head.q, targets.view(), scratch, &mut out),
            Some(hb) => ops::lm_head::<bf16>(dev, hb, n, &head.q, targets.view(), softcap, scratch, &mut out, gather),
            None => ops::lm_head::<f32>(dev, h, n, &head.q, targets.view(), softcap, scratch, &mut out, gather),
        }
        .with_context(|| format!("LM head {}", head.name))?;
        drop(scratch_cell);
        self.prof.note_memory(dev)?;
    let host = out.download(dev)?;
        let extra_host = match &extra_dev {
            Some(e) => dev.download(e)?,
            None => Vec::new(),
        };
        let k = req.top_k;
        Ok((0..n)
            .map(|r| {
                let max_logit = host.row_max[r] as f64;
                RowScore {
                    max_logit,
                    lse: max_logit + host.row_sumexp[r].ln(),
                    target_logit: host.target_logit[r] as f64,
                    top: (0..k).map(|i| (host.topk_ids[r * k + i] as u32, host.topk_logits[r * k + i])).collect(),
                    extra: extra_host.get(offsets[r]..offsets[r + 1]).map_or_else(Vec::new, <[f32]>::to_vec),
                }
            })
            .collect())
    }

    fn execution(&self) -> ExecutionInfo {
        let info = self.dev.info();
        ExecutionInfo {
            backend: "cuda".into(),
            device: format!("GPU {} {}", info.index, info.name),
            kv_dtype: self.kv_dtype.name().into(),
            route: self.route.name().into(),
            details: serde_json::json!({
                "delta_net_scan": if self.delta_scan_forced || self.delta_scan == super::delta_net::DeltaScan::Exact {
                    format!("{} (forced: {})", self.delta_scan.describe(), self.delta_scan_forced)
                } else {
                    format!("{} (this route's default; heads it does not take run the exact scan)", self.delta_scan.describe())
                },
                "compute_capability": format!("{}.{}", info.compute_capability.0, info.compute_capability.1),
                "n_sms": info.n_sms,
                "total_mem_bytes": info.total_mem_bytes,
                "driver_cuda_version": format!("{}.{}", info.driver_version.0, info.driver_version.1),
                "ptx_arch": format!("compute_{}", info.kernels.arch),
                "nvcc_version": info.kernels.nvcc_version,
                "kernel_sources_sha256": info.kernels.sources_sha256,
                "kernel_modules": format!(
                    "{} of {} modules loaded from cubins assembled at build time for this compute capability, the rest JIT-compiled from their PTX by the driver",
                    info.n_modules_from_cubin, info.n_modules_loaded
                ),
                "matmul": match self.route {
                    Route::Bf16TensorCore if self.dev.one_gemm_kernel() => "bf16 inputs (weights dequantized to bf16 in shared memory), \
                         mma.sync 64x64x32 for every M (--reproducible: one GEMM kernel, no switch to wgmma at M >= 128), f32 accumulation"
                        .to_string(),
                    Route::Bf16TensorCore if self.dev.has_function(ops::GEMM_WGMMA_KERNEL) => format!(
                        "bf16 inputs, f32 accumulation; M >= {} and N >= {}: the weight dequantized to a bf16 scratch per matmul \
                         (stored BF16 read as is), then wgmma 128x256x64 with a TMA 4-stage pipeline (sm_90a); smaller products: \
                         mma.sync 64x64x32 with the weight dequantized to bf16 in shared memory; wgmma epilogue: {} (f32 out), {} (gated); \
                         wgmma dequant: {}",
                        ops::GEMM_WGMMA_MIN_M,
                        ops::GEMM_WGMMA_MIN_N,
                        ops::GemmEpilogue::from_env().name(),
                        ops::GemmEpilogue::gated_from_env().name(),
                        ops::GemmDequant::from_env().name()
                    ),
                    Route::Bf16TensorCore => "bf16 inputs (weights dequantized to bf16 in shared memory), mma.sync tensor cores, \
                         f32 accumulation (no sm_90a wgmma kernel on this GPU)".to_string(),
                    Route::Fp32 => "f32 inputs, weights dequantized to f32 in shared memory, FFMA, f32 accumulation".to_string(),
                },
                "fusions": match self.route {
                    Route::Bf16TensorCore if self.dev.one_gemm_kernel() => "numbers unchanged (the route rounds every matmul input to \
                         bf16 anyway): RMSNorm writes f32 and its bf16 rounding in one pass (rmsnorm_dual); attention and the gated \
                         product are written in bf16; --reproducible: gate and up as two mma.sync matmuls then gated_<act>_bf16 (no \
                         wgmma GEMM, so no fused gated epilogue or fused q/k/v); the output projections' residual add after their \
                         matmul (add_f32), a norm read only by matmuls in bf16 alone (rmsnorm_bf16), with post norms the add \
                         folded into the next RMSNorm (add_rmsnorm_dual); RoPE's (cos, sin) from one table per base and scale (rope_table_f32)"
                        .to_string(),
                    Route::Bf16TensorCore => format!(
                        "numbers unchanged (the route rounds every matmul input to bf16 anyway): RMSNorm writes f32 and its bf16 \
                         rounding in one pass (rmsnorm_dual); attention and the gated product are written in bf16 (matmul inputs only); \
                         M >= {} and d_ffn >= {}: gate and up in one wgmma GEMM with act(gate) * up in its epilogue \
                         (gemm_bf16_wgmma_gated_<act>); {}; the residual add in the output projections' GEMM epilogue (x += a·Wᵀ, a TMA \
                         f32 reduce-add: the bits of the GEMM then add_f32) and the norm after it, read only by matmuls, in bf16 alone \
                         (rmsnorm_bf16: rmsnorm_dual's bf16 bits); with post norms (gemma3) the add folded into the next RMSNorm \
                         (add_rmsnorm_dual, the bits of add_f32 then rmsnorm_dual; the last layer's add a separate add_f32); RoPE's (cos, sin) from one table per \
                         base and scale (rope_table_f32, the same f64 expression as rope_f32), the rotation reading it, for q and k \
                         (no QK norm, no bias, heads of 16-256 a power of two) in the wgmma GEMM's epilogue (gemm_bf16_wgmma rope_*)",
                        ops::GEMM_WGMMA_MIN_M,
                        ops::GEMM_WGMMA_MIN_N,
                        if self.fuse_qkv && self.dev.has_function(ops::GEMM_QKV_KERNEL) {
                            format!(
                                "M >= {} and n_q + n_k + n_v >= {}: q, k, v in one wgmma GEMM over the three weights dequantized into \
                                 one stacked bf16 scratch, the bias added in its epilogue (gemm_bf16_wgmma_qkv; the same bits as three)",
                                ops::GEMM_WGMMA_MIN_M,
                                ops::GEMM_WGMMA_MIN_N
                            )
                        } else {
                            "q, k, v as three matmuls (the fused QKV GEMM is built but off: measured no faster)".to_string()
                        }
                    ),
                    Route::Fp32 => "none (f32 everywhere)".to_string(),
                },
                "moe_experts": super::moe::MoeKernel::describe_for(&self.dev, self.route),
                "reference": if self.opts.reference {
                    "the FP32 route with the KV codec applied exactly: every stored K/V row is the CPU backend's \
                     decode(encode(row)) (V as fp16 under bf16), in an f32 cache"
                } else {
                    "off"
                },
                "reproducible": if self.opts.reproducible {
                    match self.route {
                        Route::Bf16TensorCore => "one GEMM kernel for every M (mma.sync; the gated FFN as two of them then the \
                             activation, the LM head's tiles too); every other kernel already sums in a fixed order that does not \
                             depend on the pass (no split reductions, no atomics in any sum; attention's key tiles at fixed \
                             positions; MoE slots in ascending expert order, f64 combine)",
                        Route::Fp32 => "the FP32 route's kernels sum in a fixed order that does not depend on the pass \
                             (FFMA in K order, no split reductions, attention v1's key tiles at fixed positions)",
                    }
                } else {
                    "off"
                },
                "attention_kernel": self.attention_kernel().name(),
                "attention_fast_path": self.attention_fast_path(),
                "lm_head_fast_path": self.lm_head_fast_path(),
                "attention": self.attention_description(),
                "kv_cache": self.kv_cache_kernels(),
                "kv_k_codec": self.stored_codecs().0.name(),
                "kv_v_codec": self.stored_codecs().1.name(),
                "lm_head": format!("{} in tiles of up to {} MiB of logits (ops::lm_head_tile_rows: 256 to 2048 rows); max, f64 sum of exp, target, top-k on the GPU \
                     (the tiled head; lm_head_fast_path says which passes reduce in the GEMM's epilogue instead)", match self.route {
                    Route::Bf16TensorCore => "bf16 rows x head on the tensor cores (f32 accumulation, f32 logits)",
                    Route::Fp32 => "f32 rows x head (FFMA, f32 logits)",
                }, ops::LM_HEAD_TILE_BYTES >> 20),
            }),
        }
    }

    fn device_memory(&self) -> Result<Option<DeviceMemory>> {
        self.dev.synchronize()?;
        let (used_peak, reserved_peak) = self.dev.pool_high_water()?;
        let (free, total) = self.dev.mem_info()?;
        Ok(Some(DeviceMemory {
            device: self.describe(),
            pool_used_peak_bytes: used_peak,
            pool_reserved_peak_bytes: reserved_peak,
            device_used_at_end_bytes: (total - free) as u64,
            device_total_bytes: total as u64,
        }))
    }

    fn check_memory(&self, kv: KvGeometry, n_pass_tokens: usize, n_pass_cols: usize, n_vocab: usize) -> Result<()> {
        // The --reference cache holds f32 rows whatever the codec.
        let stored = if self.opts.reference { KvFormat::F32 } else { self.kv_dtype };
        let kv_bytes = kv.n_seqs * kv.n_layers * kv.max_pos * stored.bytes_per_position_per_layer(kv.n_kv_heads, kv.d_head, kv.d_head_v);
        // Live activations of one pass: the residual stream, a normed copy, q/k/v,
        // attention out, gate/up/product (widest row), a bf16 copy of a matmul input.
        let act_bytes = 12 * n_pass_tokens * n_pass_cols * 4;
        let head_bytes = ops::lm_head_tile_rows(n_vocab) * n_vocab * 4 + n_pass_tokens * (4 * 4 + 8 + 2 * 4 * crate::backend::MAX_TOP_K);
        // The wgmma route's bf16 copy of one weight at a time: at most max(n_vocab, widest row) x widest row.
        let scratch_bytes = if self.route == Route::Bf16TensorCore && self.dev.has_function(ops::GEMM_WGMMA_KERNEL) {
            n_vocab.max(n_pass_cols) * n_pass_cols * 2
        } else {
            0
        };
        let need = kv_bytes + act_bytes + head_bytes + scratch_bytes;
        let (free, total) = self.dev.mem_info()?;
        if need + MEMORY_MARGIN_BYTES > free {
            bail!(
                "the plan does not fit GPU {} ({:.2} GiB free of {:.2}): it needs {:.2} GiB \
                 (KV cache {:.2} GiB for {} windows of {} tokens, activations {:.2} GiB for passes of {} rows, \
                 LM head {:.2} GiB, bf16 weight scratch {:.2} GiB) plus {:.2} GiB of margin; lower --context, --prefill-chunk or --batch-tokens",
                self.dev.info().index,
                gib(free),
                gib(total),
                gib(need),
                gib(kv_bytes),
                kv.n_seqs,
                kv.max_pos,
                gib(act_bytes),
                n_pass_tokens,
                gib(head_bytes),
                gib(scratch_bytes),
                gib(MEMORY_MARGIN_BYTES)
            );
        }
        Ok(())
    }
}
