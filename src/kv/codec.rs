//! Row codecs: the byte layout of one encoded K or V row and its CPU
//! reference encode and decode. The arithmetic is the definition the GPU
//! reproduces bit for bit; `super` (mod.rs) states it step by step.
//!
//! Every row is `d` f32 values in, [`RowCodec::row_bytes`] bytes out:
//! element codes first (offset 0), then the f32 scale fields, then the
//! one-byte scale fields, then zero padding to a multiple of 16 bytes. All
//! multi-byte fields are little-endian.

use anyhow::{ensure, Result};
use half::{bf16, f16};

use super::hadamard;
use super::scalar::{e2m1_from_f32, e2m1_to_f32, e4m3_from_f32, e4m3_to_f32, round_clamp, E2M1_MAX, E4M3_MAX};
use super::vq;

/// How the elements of a row are coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElemCodec {
    /// f32 as is (the FP32 route).
    F32,
    /// bf16, round to nearest even.
    Bf16,
    /// IEEE binary16, round to nearest even (V under `--reference --kv-dtype bf16`).
    Fp16,
    /// Symmetric int8 in [-127, 127], one f32 scale per row (amax / 127).
    Int8,
    /// E4M3, one f32 scale per row (amax / 448).
    Fp8,
    /// NVFP4: E2M1 elements, one E4M3 scale per 16 elements, one f32 scale per row.
    Nvfp4,
    /// Symmetric 4-bit in [-7, 7], one f32 scale per 32 elements (amax / 7).
    Int4G32,
    /// 2-bit midrise levels {-1.5, -0.5, 0.5, 1.5} * s, one f32 scale per 32 elements (s = amax / 1.5).
    Int2G32,
    /// One byte per 4 elements: the index of the nearest codeword of
    /// [`vq::codebook`] after division by the row's RMS (one f32 per row).
    Vq2,
}

/// Kind and granularity of a codec's scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleType {
    None,
    /// One f32 per row: max-abs / QMAX.
    F32Row,
    /// One f32 per group of `group_size` elements: max-abs / QMAX.
    F32Group,
    /// One E4M3 per 16 elements times one f32 per row (NVFP4).
    E4m3BlockF32Row,
    /// One f32 per row: the root mean square of the (rotated) row.
    F32RowRms,
}

impl ScaleType {
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::F32Row => "f32 per row (amax/QMAX)",
            Self::F32Group => "f32 per group (amax/QMAX)",
            Self::E4m3BlockF32Row => "e4m3 per 16 + f32 per row",
            Self::F32RowRms => "f32 per row (rms)",
        }
    }
}

/// The canonical quiet NaN written into every f32 scale field of a poisoned row.
pub const POISON_SCALE: f32 = f32::from_bits(0x7FC0_0000);

/// Rows are multiples of this many bytes.
pub const ROW_ALIGN: usize = 16;

/// `n` rounded up to a multiple of [`ROW_ALIGN`].
pub fn align_row(n: usize) -> usize {
    n.div_ceil(ROW_ALIGN) * ROW_ALIGN
}

impl ElemCodec {
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
            Self::Int8 => "int8",
            Self::Fp8 => "fp8-e4m3",
            Self::Nvfp4 => "nvfp4",
            Self::Int4G32 => "int4-g32",
            Self::Int2G32 => "int2-g32",
            Self::Vq2 => "vq2-4x256",
        }
    }

    /// Bits of one element code (without scales).
    pub fn elem_bits(self) -> usize {
        match self {
            Self::F32 => 32,
            Self::Bf16 | Self::Fp16 => 16,
            Self::Int8 | Self::Fp8 => 8,
            Self::Nvfp4 | Self::Int4G32 => 4,
            Self::Int2G32 | Self::Vq2 => 2,
        }
    }

    /// Elements sharing one scale (the row length `d` for per-row scales, 0 for none).
    pub fn group_size(self, d: usize) -> usize {
        match self {
            Self::F32 | Self::Bf16 | Self::Fp16 => 0,
            Self::Int8 | Self::Fp8 | Self::Vq2 => d,
            Self::Nvfp4 => 16,
            Self::Int4G32 | Self::Int2G32 => 32,
        }
    }

    pub fn scale_type(self) -> ScaleType {
        match self {
            Self::F32 | Self::Bf16 | Self::Fp16 => ScaleType::None,
            Self::Int8 | Self::Fp8 => ScaleType::F32Row,
            Self::Nvfp4 => ScaleType::E4m3BlockF32Row,
            Self::Int4G32 | Self::Int2G32 => ScaleType::F32Group,
            Self::Vq2 => ScaleType::F32RowRms,
        }
    }

    /// Whether the codec has scales (and so the poison-row rule and `d % 32 == 0`).
    pub fn is_scaled(self) -> bool {
        self.scale_type() != ScaleType::None
    }

    /// Bytes of the element codes of a row of `d`.
    pub fn data_bytes(self, d: usize) -> usize {
        d * self.elem_bits() / 8
    }

    /// Number of f32 scale fields (at offset `data_bytes`).
    pub fn f32_scale_count(self, d: usize) -> usize {
        match self {
            Self::F32 | Self::Bf16 | Self::Fp16 => 0,
            Self::Int8 | Self::Fp8 | Self::Nvfp4 | Self::Vq2 => 1,
            Self::Int4G32 | Self::Int2G32 => d / 32,
        }
    }

    /// Number of one-byte scale fields (at offset `data_bytes + 4 * f32_scale_count`).
    pub fn u8_scale_count(self, d: usize) -> usize {
        match self {
            Self::Nvfp4 => d / 16,
            _ => 0,
        }
    }
}

/// The codec of one K or V row: an element code and whether the row is
/// Hadamard-rotated ([`hadamard`]) before it is coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowCodec {
    pub elem: ElemCodec,
    pub rotate: bool,
}

impl RowCodec {
    pub const fn new(elem: ElemCodec, rotate: bool) -> Self {
        Self { elem, rotate }
    }

    /// A name such as `int4-g32+hadamard`.
    pub fn name(&self) -> String {
        if self.rotate {
            format!("{}+hadamard", self.elem.name())
        } else {
            self.elem.name().to_string()
        }
    }

    /// Checks that rows of `d` elements can be coded: `d > 0`, and for the
    /// scaled codecs `d % 32 == 0`.
    pub fn check_len(&self, d: usize) -> Result<()> {
        ensure!(d > 0, "kv codec {}: row length is 0", self.name());
        if self.elem.is_scaled() || self.rotate {
            ensure!(d % 32 == 0, "kv codec {}: row length {d} is not a multiple of 32", self.name());
        }
        Ok(())
    }

    /// Encoded bytes of a row of `d` elements (a multiple of 16).
    pub fn row_bytes(&self, d: usize) -> usize {
        let e = self.elem;
        align_row(e.data_bytes(d) + 4 * e.f32_scale_count(d) + e.u8_scale_count(d))
    }

    /// Average stored bits per element of a row of `d`, scales and padding included.
    pub fn bits_per_element(&self, d: usize) -> f64 {
        (self.row_bytes(d) * 8) as f64 / d as f64
    }

    /// Encodes `x` (`d` values) into `out` (`row_bytes(d)` bytes). Returns
    /// the number of elements counted as non-finite: the non-finite inputs,
    /// plus all `d` when finite inputs overflow the rotation, the RMS or the
    /// largest decoded value `QMAX * s`, plus
    /// (bf16, fp16) the finite inputs that round to ±Inf.
    pub fn encode_row(&self, x: &[f32], out: &mut [u8]) -> Result<usize> {
        let d = x.len();
        self.check_len(d)?;
        ensure!(
            out.len() == self.row_bytes(d),
            "kv codec {}: encode of {d} values into {} bytes (a row is {})",
            self.name(),
            out.len(),
            self.row_bytes(d)
        );
        out.fill(0);
        match self.elem {
            ElemCodec::F32 => {
                for (o, &v) in out.chunks_exact_mut(4).zip(x) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
                Ok(x.iter().filter(|v| !v.is_finite()).count())
            }
            ElemCodec::Bf16 | ElemCodec::Fp16 => {
                let mut n_bad = 0;
                for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                    let h = if self.elem == ElemCodec::Bf16 { bf16_bits(v) } else { fp16_bits(v) };
                    // Exponent all ones in either type: ±Inf or NaN.
                    let exp_mask = if self.elem == ElemCodec::Bf16 { 0x7F80 } else { 0x7C00 };
                    n_bad += usize::from(h & exp_mask == exp_mask);
                    o.copy_from_slice(&h.to_le_bytes());
                }
                Ok(n_bad)
            }
            _ => self.encode_scaled(x, out),
        }
    }

    fn encode_scaled(&self, x: &[f32], out: &mut [u8]) -> Result<usize> {
        let d = x.len();
        let n_bad_in = x.iter().filter(|v| !v.is_finite()).count();
        if n_bad_in > 0 {
            self.poison(d, out);
            return Ok(n_bad_in);
        }
        let mut y = x.to_vec();
        if self.rotate {
            hadamard::forward(&mut y);
            if y.iter().any(|v| !v.is_finite()) {
                self.poison(d, out);
                return Ok(d);
            }
        }
        let e = self.elem;
        let (data, scales) = out.split_at_mut(e.data_bytes(d));
        match e {
            ElemCodec::Int8 => {
                // One group of d: q = clamp(rint(y / s), -127, 127); s = 0 -> q = 0.
                if !encode_groups(&y, d, data, scales, 127.0, 0, |t| round_clamp(t, -127, 127) as i8 as u8, put_byte) {
                    self.poison(d, out);
                    return Ok(d);
                }
            }
            ElemCodec::Fp8 => {
                // One group of d: c = e4m3(y / s); s = 0 -> c = 0.
                if !encode_groups(&y, d, data, scales, E4M3_MAX, 0, e4m3_from_f32, put_byte) {
                    self.poison(d, out);
                    return Ok(d);
                }
            }
            ElemCodec::Nvfp4 => {
                let row_scale = amax(&y) / (E4M3_MAX * E2M1_MAX); // / 2688
                if overflows(row_scale, E4M3_MAX * E2M1_MAX) {
                    self.poison(d, out);
                    return Ok(d);
                }
                put_f32(scales, 0, row_scale);
                for (b, blk) in y.chunks_exact(16).enumerate() {
                    let bs_code = if row_scale != 0.0 { e4m3_from_f32(amax(blk) / (row_scale * E2M1_MAX)) } else { 0 };
                    scales[4 + b] = bs_code;
                    let eff = e4m3_to_f32(bs_code) * row_scale;
                    if eff != 0.0 {
                        for (i, &v) in blk.iter().enumerate() {
                            put_nibble(data, b * 16 + i, e2m1_from_f32(v / eff));
                        }
                    }
                }
            }
            ElemCodec::Int4G32 => {
                // q = clamp(rint(y / s), -7, 7), stored q + 8; s = 0 -> q = 0.
                if !encode_groups(&y, 32, data, scales, 7.0, 8, |t| (round_clamp(t, -7, 7) + 8) as u8, put_nibble) {
                    self.poison(d, out);
                    return Ok(d);
                }
            }
            ElemCodec::Int2G32 => {
                // q = clamp(rint(y / s + 1.5), 0, 3); s = 0 -> q = 2.
                if !encode_groups(&y, 32, data, scales, 1.5, 2, |t| round_clamp(t + 1.5, 0, 3) as u8, put_crumb) {
                    self.poison(d, out);
                    return Ok(d);
                }
            }
            ElemCodec::Vq2 => {
                let s = (sum_sq_lanes(&y) / d as f32).sqrt();
                if !s.is_finite() {
                    self.poison(d, out);
                    return Ok(d);
                }
                put_f32(scales, 0, s);
                if s != 0.0 {
                    for (o, grp) in data.iter_mut().zip(y.chunks_exact(vq::DIM)) {
                        let z = [grp[0] / s, grp[1] / s, grp[2] / s, grp[3] / s];
                        *o = vq::nearest(&z);
                    }
                }
            }
            ElemCodec::F32 | ElemCodec::Bf16 | ElemCodec::Fp16 => {
                anyhow::bail!("kv codec {}: not a scaled codec", self.name())
            }
        }
        Ok(0)
    }

    /// A row whose inputs are not all finite: codes 0, every f32 scale NaN,
    /// so every element decodes to NaN.
    fn poison(&self, d: usize, out: &mut [u8]) {
        out.fill(0);
        let e = self.elem;
        let scales = &mut out[e.data_bytes(d)..];
        for i in 0..e.f32_scale_count(d) {
            put_f32(scales, i, POISON_SCALE);
        }
    }

    /// Decodes `b` (`row_bytes(d)` bytes) into `out` (`d` values).
    pub fn decode_row(&self, b: &[u8], out: &mut [f32]) -> Result<()> {
        let d = out.len();
        self.check_len(d)?;
        ensure!(
            b.len() == self.row_bytes(d),
            "kv codec {}: decode of {} bytes into {d} values (a row is {})",
            self.name(),
            b.len(),
            self.row_bytes(d)
        );
        let e = self.elem;
        let (data, scales) = b.split_at(e.data_bytes(d));
        match e {
            ElemCodec::F32 => {
                for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            ElemCodec::Bf16 => {
                for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                    *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            ElemCodec::Fp16 => {
                for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                    *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            ElemCodec::Int8 => {
                let s = get_f32(scales, 0);
                for (o, &c) in out.iter_mut().zip(data) {
                    *o = (c as i8) as f32 * s;
                }
            }
            ElemCodec::Fp8 => {
                let s = get_f32(scales, 0);
                for (o, &c) in out.iter_mut().zip(data) {
                    *o = e4m3_to_f32(c) * s;
                }
            }
            ElemCodec::Nvfp4 => {
                let row_scale = get_f32(scales, 0);
                for (i, o) in out.iter_mut().enumerate() {
                    let bs = e4m3_to_f32(scales[4 + i / 16]);
                    *o = (e2m1_to_f32(get_nibble(data, i)) * bs) * row_scale;
                }
            }
            ElemCodec::Int4G32 => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = (get_nibble(data, i) as i32 - 8) as f32 * get_f32(scales, i / 32);
                }
            }
            ElemCodec::Int2G32 => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = (get_crumb(data, i) as f32 - 1.5) * get_f32(scales, i / 32);
                }
            }
            ElemCodec::Vq2 => {
                let s = get_f32(scales, 0);
                let book = vq::codebook();
                for (o4, &c) in out.chunks_exact_mut(vq::DIM).zip(data) {
                    for (o, &cv) in o4.iter_mut().zip(&book[c as usize]) {
                        *o = cv * s;
                    }
                }
            }
        }
        if self.rotate {
            hadamard::inverse(out);
        }
        Ok(())
    }
}

/// bf16 bits of `v`: round to nearest even; NaN becomes `0x7FFF` (as
/// `__float2bfloat16_rn`).
pub fn bf16_bits(v: f32) -> u16 {
    if v.is_nan() {
        0x7FFF
    } else {
        bf16::from_f32(v).to_bits()
    }
}

/// fp16 bits of `v`: round to nearest even, overflow to ±Inf; NaN becomes
/// `0x7FFF` (as `__float2half_rn`).
pub fn fp16_bits(v: f32) -> u16 {
    if v.is_nan() {
        0x7FFF
    } else {
        f16::from_f32(v).to_bits()
    }
}

/// The amax-scaled codecs' encode: per group `g` of `group` elements (`d`
/// for the per-row codecs, 32 for the group codecs), `s = amax_g / qmax`
/// stored as f32 scale `g`, then element `i`'s code `code(y_i / s)` (`zero`
/// when `s == 0`) written by `put`. False when `qmax * s` overflows (the
/// caller poisons the row).
#[allow(clippy::too_many_arguments)]
fn encode_groups(
    y: &[f32],
    group: usize,
    data: &mut [u8],
    scales: &mut [u8],
    qmax: f32,
    zero: u8,
    code: impl Fn(f32) -> u8,
    put: fn(&mut [u8], usize, u8),
) -> bool {
    for (g, grp) in y.chunks_exact(group).enumerate() {
        let s = amax(grp) / qmax;
        if overflows(s, qmax) {
            return false;
        }
        put_f32(scales, g, s);
        for (i, &v) in grp.iter().enumerate() {
            put(data, g * group + i, if s != 0.0 { code(v / s) } else { zero });
        }
    }
    true
}

/// Whether the largest decoded value `qmax * s` is beyond f32 (amax within
/// a rounding of `f32::MAX`): such a row is poisoned and counted.
fn overflows(s: f32, qmax: f32) -> bool {
    !(s * qmax).is_finite()
}

/// The largest |v| (exact in any order; inputs are finite).
fn amax(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |m, &x| m.max(x.abs()))
}

/// Σ v² in the order of a 32-lane warp reduction: lane `l` accumulates
/// `v[l], v[l + 32], ..` in that order (`p = p + v*v`, multiply then add),
/// then `for off in [16, 8, 4, 2, 1]: p[l] = p[l] + p[l + off]` (the
/// `__shfl_down_sync` tree; lane 0 holds the sum). `v.len() % 32 == 0`.
pub fn sum_sq_lanes(v: &[f32]) -> f32 {
    let mut p = [0.0f32; 32];
    for chunk in v.chunks_exact(32) {
        for (pl, &x) in p.iter_mut().zip(chunk) {
            let sq = x * x;
            *pl += sq;
        }
    }
    let mut off = 16;
    while off > 0 {
        for l in 0..off {
            p[l] += p[l + off];
        }
        off /= 2;
    }
    p[0]
}

fn put_f32(b: &mut [u8], i: usize, v: f32) {
    b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
}

fn get_f32(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

fn put_byte(b: &mut [u8], i: usize, c: u8) {
    b[i] = c;
}

/// Element `i`'s 4 bits: low nibble of byte `i / 2` for even `i`, high for odd.
fn put_nibble(b: &mut [u8], i: usize, c: u8) {
    let sh = 4 * (i % 2);
    b[i / 2] = (b[i / 2] & !(0xF << sh)) | ((c & 0xF) << sh);
}

fn get_nibble(b: &[u8], i: usize) -> u8 {
    (b[i / 2] >> (4 * (i % 2))) & 0xF
}

/// Element `i`'s 2 bits: bits `2 * (i % 4)` of byte `i / 4`.
fn put_crumb(b: &mut [u8], i: usize, c: u8) {
    let sh = 2 * (i % 4);
    b[i / 4] = (b[i / 4] & !(0x3 << sh)) | ((c & 0x3) << sh);
}

fn get_crumb(b: &[u8], i: usize) -> u8 {
    (b[i / 4] >> (2 * (i % 4))) & 0x3
}
