//! KV-cache formats: the one table of formats ([`KvFormat`]) and the CPU
//! reference encode/decode of every row codec ([`RowCodec`]). Every KV
//! kernel (the CUDA encode kernels, the attention tile loaders) is checked
//! against this module; docs/kv-formats.md is its prose twin. It owns no
//! cache storage (the backends do) and no attention.
//!
//! # API
//! - [`KvFormat`]: `f32 | bf16 | int8 | fp8 | nvfp4 | k8v4 | vq2 | k4v2`;
//!   `FromStr` (the `--kv-dtype` names), [`KvFormat::name`],
//!   [`KvFormat::ALL`], [`KvFormat::k`] / [`KvFormat::v`] (the row codec of
//!   K and of V), [`KvFormat::is_quantized`],
//!   [`KvFormat::bytes_per_position_per_layer`], [`KvFormat::k_with`] /
//!   [`KvFormat::v_with`] (the codecs under a [`KvRotation`]).
//! - [`KvCodecs`] `{ format, k, v }`: [`KvFormat::codecs`]`(rotation)`;
//!   `From<KvFormat>` (the table's rotation).
//! - [`KvRotation`]: `auto | on | off` (`--kv-rotation`): the table's
//!   per-format rotation, or rotation forced on or off for K and V of a
//!   quantized format; [`KvRotation::apply`].
//! - [`RowCodec`] `{ elem: ElemCodec, rotate: bool }`: [`RowCodec::row_bytes`]`(d)`,
//!   [`RowCodec::check_len`]`(d)`, [`RowCodec::encode_row`]`(&[f32], &mut [u8]) ->
//!   Result<usize>` (the count of non-finite elements),
//!   [`RowCodec::decode_row`]`(&[u8], &mut [f32])`.
//! - [`ElemCodec`]: element code, `elem_bits`, `group_size`, `scale_type`,
//!   `data_bytes`, `f32_scale_count`, `u8_scale_count` (the layout).
//! - [`vq::codebook`]: the 256 x 4 f32 codebook of `vq2` (upload it to the GPU).
//!
//! # The unit: one row
//! A row is the `d` elements of one (position, KV head): `d = d_head` for K,
//! `d_head_v` for V. It encodes to `row_bytes(d)` bytes, a multiple of 16,
//! self-contained (its scales are inside it). The scaled codecs need
//! `d % 32 == 0`. Layout, offsets in bytes from the row start, all
//! little-endian:
//!
//! | codec      | codes at 0                         | then                              | then                 |
//! |------------|------------------------------------|-----------------------------------|----------------------|
//! | `f32`      | d x f32                            |                                   |                      |
//! | `bf16`     | d x bf16 bits (u16)                |                                   |                      |
//! | `fp16`     | d x binary16 bits (u16)            |                                   |                      |
//! | `int8`     | d x i8                             | f32 scale at d                    |                      |
//! | `fp8-e4m3` | d x E4M3                           | f32 scale at d                    |                      |
//! | `nvfp4`    | d/2 bytes, E2M1 nibbles            | f32 row scale at d/2              | d/16 x E4M3 at d/2+4 |
//! | `int4-g32` | d/2 bytes, nibble = q + 8          | d/32 x f32 at d/2                 |                      |
//! | `int2-g32` | d/4 bytes, 2-bit q                 | d/32 x f32 at d/4                 |                      |
//! | `vq2-4x256`| d/4 x u8 codeword index (4 elems)  | f32 RMS at d/4                    |                      |
//!
//! then zeros up to the 16-byte boundary. Nibbles: element `2i` is the low
//! nibble of byte `i`, `2i + 1` the high one. 2-bit codes: element `4i + j`
//! is bits `2j..2j+2` of byte `i`. Group `g` (of 32, or 16 for nvfp4's E4M3
//! scales) covers elements `g*G .. (g+1)*G`.
//!
//! # Encode, exactly (the GPU reproduces these bits)
//! All arithmetic is f32, IEEE round-to-nearest-even, no FMA contraction, no
//! flush of subnormals (do not build with `--use_fast_math` / `-ftz=true`).
//! `x / s` is a true division (`__fdiv_rn`), never `x * (1/s)`. Rounding to
//! an integer is `rint` (ties to even, `__float2int_rn`); minifloat codes
//! round to nearest even from the exact f32 value and saturate
//! (`cvt.rn.satfinite`), see [`scalar`]. `amax` is `max |v|` (exact in any
//! order).
//! 1. Non-finite input: if any element of a row of a scaled codec is NaN or
//!    ±Inf, the row is poisoned: all codes 0, every f32 scale field the NaN
//!    `0x7FC00000`, so every element decodes to NaN; `encode_row` returns the
//!    number of non-finite inputs, which the backend counts. Unscaled
//!    codecs code each element alone (NaN -> `0x7FFF` in bf16 and fp16, ±Inf
//!    stays ±Inf; a finite value beyond the type's range rounds to ±Inf, as
//!    IEEE conversion does, and is counted too).
//! 2. Rotation (when `rotate`): `y = H x` per block ([`hadamard`]); a
//!    non-finite `y` (overflow) poisons the row and counts `d`.
//! 3. Per codec, on `y` (`y = x` without rotation). After each scale `s`
//!    is computed, a non-finite `QMAX * s` (the largest decoded value: 127,
//!    448, 2688, 7, 1.5 times the scale; amax within a rounding of
//!    `f32::MAX`) poisons the row and counts `d`.
//!    - `int8`: `s = amax / 127`; `q = clamp(rint(y / s), -127, 127)`; `s == 0` -> all `q = 0`.
//!    - `fp8`: `s = amax / 448`; `c = e4m3(y / s)`; `s == 0` -> all `c = 0`.
//!    - `nvfp4`: `S = amax_row / 2688` (2688 = 448 * 6); per block of 16:
//!      `b = e4m3(amax_blk / (S * 6))` (`__fmul_rn` then `__fdiv_rn`), `0` when
//!      `S == 0`; `eff = e4m3_value(b) * S` (`__fmul_rn`); `c = e2m1(y / eff)`,
//!      all `c = 0` when `eff == 0`.
//!    - `int4-g32`: per group of 32: `s = amax_g / 7`; `q = clamp(rint(y / s), -7, 7)`,
//!      stored `q + 8`; `s == 0` -> `q = 0`.
//!    - `int2-g32`: per group of 32: `s = amax_g / 1.5`; `q = clamp(rint(y / s + 1.5), 0, 3)`
//!      (`__fdiv_rn` then `__fadd_rn`); `s == 0` -> `q = 2`.
//!    - `vq2`: `s = sqrt(sum_sq / d)` with `sum_sq` in the warp order of
//!      [`codec::sum_sq_lanes`] (`__fmul_rn`, `__fadd_rn`; `__fdiv_rn`;
//!      `__fsqrt_rn`); a non-finite `s` poisons the row and counts `d`; per 4
//!      elements `z_j = y_j / s` and the code is [`vq::nearest`]`(z)` (its
//!      distance order, ties to the lowest index); `s == 0` -> all codes 0.
//!
//! # Decode, exactly
//! One f32 multiply per element: `q * s` (int8, int4 `(nibble - 8) * s`,
//! int2 `(q - 1.5) * s`), `e4m3_value(c) * s`, nvfp4 `(e2m1_value(c) *
//! e4m3_value(b)) * S` (the inner product is exact), vq2 `codeword_j * s`;
//! then, when `rotate`, the inverse rotation `(H v) * (1/n)`. Attention may
//! instead rotate the query (`q·k = (Hq)·(Hk)/n`) and the output (`Σ p v =
//! H⁻¹ Σ p (Hv)`): the same numbers up to f32 rounding.
//!
//! # Which GPU operations must be written explicitly
//! Everything in encode that multiplies then adds: `int2`'s `y / s + 1.5`
//! (a division, not fusable, but write `__fadd_rn`), vq2's distance
//! `e*e + acc` and `sum_sq`'s `p + v*v` (`__fmul_rn` then `__fadd_rn`, or
//! nvcc fuses them into FMA), nvfp4's `S * 6` and `e4m3_value(b) * S`
//! (`__fmul_rn`). Decode's products are single multiplies.

pub mod codec;
pub mod hadamard;
pub mod scalar;
pub mod vq;

#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;

use anyhow::Result;

pub use codec::{ElemCodec, RowCodec, ScaleType};

/// `--kv-rotation`: whether the rows of a quantized format are Hadamard-rotated
/// before they are coded. `Auto` is the table's per-format choice
/// ([`KvFormat::k`], [`KvFormat::v`]); `On` / `Off` force it for K and V
/// alike. Unscaled rows (f32, bf16, fp16) are never rotated: config refuses
/// `on` / `off` with them, and [`KvRotation::apply`] leaves them alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvRotation {
    #[default]
    Auto,
    On,
    Off,
}

impl KvRotation {
    pub const ALL: [KvRotation; 3] = [Self::Auto, Self::On, Self::Off];

    /// The `--kv-rotation` name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        }
    }

    /// `c` under this setting: a scaled codec rotated as forced (`On`, `Off`)
    /// or as the table says (`Auto`); an unscaled codec unchanged.
    pub fn apply(self, c: RowCodec) -> RowCodec {
        match self {
            _ if !c.elem.is_scaled() => c,
            Self::Auto => c,
            Self::On => RowCodec { rotate: true, ..c },
            Self::Off => RowCodec { rotate: false, ..c },
        }
    }
}

impl fmt::Display for KvRotation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvRotation {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| anyhow::anyhow!("unknown KV rotation '{s}' (valid: auto, on, off)"))
    }
}

/// A KV-cache format: the codec of K rows and of V rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// f32 K and V (the FP32 route; the CPU oracle's exact cache).
    F32,
    Bf16,
    Int8,
    Fp8,
    Nvfp4,
    K8v4,
    Vq2,
    K4v2,
}

impl KvFormat {
    /// Every format, in the order of the docs' table (widest first).
    pub const ALL: [KvFormat; 8] =
        [Self::F32, Self::Bf16, Self::Int8, Self::Fp8, Self::K8v4, Self::Nvfp4, Self::K4v2, Self::Vq2];

    /// The `--kv-dtype` name.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
            Self::Fp8 => "fp8",
            Self::Nvfp4 => "nvfp4",
            Self::K8v4 => "k8v4",
            Self::Vq2 => "vq2",
            Self::K4v2 => "k4v2",
        }
    }

    /// The codec of K rows (`d_head` elements). Rotation (the default of
    /// `--kv-rotation auto`): every quantized format rotates K and V but
    /// `fp8`, which rotates neither. Chosen per format by the mean KL against
    /// bf16 KV summed over SmolLM2-135M and Gemma-3-270M on the H200
    /// (docs/kv-formats.md, "Rotation per format (rot8)", 2026-12-02): rotation
    /// lowers it for int8, k8v4, nvfp4, k4v2 and vq2, and raises it for fp8
    /// (0.0208 rotated against 0.0163 unrotated: rotation halves fp8's KL on
    /// SmolLM2 and multiplies it by 2.4 on Gemma-3).
    pub fn k(self) -> RowCodec {
        match self {
            Self::F32 => RowCodec::new(ElemCodec::F32, false),
            Self::Bf16 => RowCodec::new(ElemCodec::Bf16, false),
            Self::Int8 | Self::K8v4 => RowCodec::new(ElemCodec::Int8, true),
            Self::Fp8 => RowCodec::new(ElemCodec::Fp8, false),
            Self::Nvfp4 => RowCodec::new(ElemCodec::Nvfp4, true),
            Self::K4v2 => RowCodec::new(ElemCodec::Int4G32, true),
            Self::Vq2 => RowCodec::new(ElemCodec::Vq2, true),
        }
    }

    /// The codec of V rows (`d_head_v` elements); rotation as [`KvFormat::k`] says.
    pub fn v(self) -> RowCodec {
        match self {
            Self::F32 => RowCodec::new(ElemCodec::F32, false),
            Self::Bf16 => RowCodec::new(ElemCodec::Bf16, false),
            Self::Int8 => RowCodec::new(ElemCodec::Int8, true),
            Self::Fp8 => RowCodec::new(ElemCodec::Fp8, false),
            Self::Nvfp4 => RowCodec::new(ElemCodec::Nvfp4, true),
            Self::K8v4 => RowCodec::new(ElemCodec::Int4G32, true),
            Self::K4v2 => RowCodec::new(ElemCodec::Int2G32, true),
            Self::Vq2 => RowCodec::new(ElemCodec::Vq2, true),
        }
    }

    /// [`KvFormat::k`] under `--kv-rotation r`.
    pub fn k_with(self, r: KvRotation) -> RowCodec {
        r.apply(self.k())
    }

    /// [`KvFormat::v`] under `--kv-rotation r`.
    pub fn v_with(self, r: KvRotation) -> RowCodec {
        r.apply(self.v())
    }

    /// Both codecs under `--kv-rotation r`, with the format.
    pub fn codecs(self, r: KvRotation) -> KvCodecs {
        KvCodecs { format: self, k: self.k_with(r), v: self.v_with(r) }
    }

    /// Whether the format loses more than bf16 rounding (scaled codes).
    pub fn is_quantized(self) -> bool {
        self.k().elem.is_scaled() || self.v().elem.is_scaled()
    }

    /// Checks that heads of `d_head` (K) and `d_head_v` (V) can be stored.
    pub fn check_dims(self, d_head: usize, d_head_v: usize) -> Result<()> {
        self.k().check_len(d_head)?;
        self.v().check_len(d_head_v)
    }

    /// Bytes of one position of one layer: `n_kv_heads` K rows and V rows.
    pub fn bytes_per_position_per_layer(self, n_kv_heads: usize, d_head: usize, d_head_v: usize) -> usize {
        n_kv_heads * (self.k().row_bytes(d_head) + self.v().row_bytes(d_head_v))
    }

    /// The valid names, for error messages.
    pub fn names() -> String {
        Self::ALL.iter().map(|f| f.name()).collect::<Vec<_>>().join(", ")
    }
}

/// A format's K and V row codecs as a run stores them ([`KvFormat::codecs`]):
/// what the encoders and the attention tile loaders are given. A bare
/// [`KvFormat`] converts with the table's rotation (`--kv-rotation auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCodecs {
    pub format: KvFormat,
    pub k: RowCodec,
    pub v: RowCodec,
}

impl From<KvFormat> for KvCodecs {
    fn from(f: KvFormat) -> Self {
        f.codecs(KvRotation::Auto)
    }
}

impl fmt::Display for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvFormat {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| anyhow::anyhow!("unknown KV format '{s}' (valid: {})", Self::names()))
    }
}
