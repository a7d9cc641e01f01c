//! Reference dequantization of every block format we keep (`TensorFormat`),
//! exactly as ggml defines it (`ggml-quants.c` `dequantize_row_*`,
//! `ggml-common.h` block structs): same field order, same bit packing, same
//! f32 operation order, so each value is bit-identical to ggml's reference
//! C code (compiled without FMA contraction) and to the `gguf` Python package.
//!
//! This module owns the decoding of bytes into f32 weights: one function per
//! format, each with its block layout in a comment (the same layouts are in
//! `docs/block-formats.md`). It does not know about tensors' meaning or shapes
//! beyond "rows of `n_cols` elements"; it does not quantize.
//!
//! All multi-byte fields are little-endian. `f16` fields are IEEE half
//! precision (widened exactly with the `half` crate); `bf16` is the top half of
//! an f32. Where a formula reads `d * sc * q`, it is evaluated left to right
//! in f32, as in ggml.

use std::ops::Range;

use anyhow::{bail, ensure, Context, Result};
use half::f16;
use rayon::prelude::*;

use crate::artifact::format::{TensorFormat, QK_K};
use crate::artifact::reader::TensorView;

/// Decodes one block: `block` holds exactly `format.block_bytes()` bytes and
/// `y` exactly `format.block_elems()` values (the caller's `chunks_exact`
/// guarantees both, so indexing inside cannot go out of bounds).
type BlockFn = fn(block: &[u8], y: &mut [f32]);

/// Dequantizes `bytes`, which must hold exactly the whole blocks of
/// `out.len()` elements of `format`, into `out`.
pub fn dequantize_row(format: TensorFormat, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let n_elems = out.len();
    let n_expected_bytes = format
        .bytes_for(n_elems as u64)
        .with_context(|| format!("dequantize {format}: output of {n_elems} elements"))?;
    ensure!(
        bytes.len() as u64 == n_expected_bytes,
        "dequantize {format}: {} bytes given for {n_elems} elements, expected {n_expected_bytes} \
         ({} blocks of {} bytes)",
        bytes.len(),
        n_elems / format.block_elems(),
        format.block_bytes()
    );
    let block_fn: BlockFn = match format {
        TensorFormat::F32 => block_f32,
        TensorFormat::F16 => block_f16,
        TensorFormat::Bf16 => block_bf16,
        TensorFormat::Q4_0 => block_q4_0,
        TensorFormat::Q4_1 => block_q4_1,
        TensorFormat::Q5_0 => block_q5_0,
        TensorFormat::Q5_1 => block_q5_1,
        TensorFormat::Q8_0 => block_q8_0,
        TensorFormat::Q2K => block_q2_k,
        TensorFormat::Q3K => block_q3_k,
        TensorFormat::Q4K => block_q4_k,
        TensorFormat::Q5K => block_q5_k,
        TensorFormat::Q6K => block_q6_k,
        TensorFormat::Iq4Nl => block_iq4_nl,
        TensorFormat::Mxfp4 => block_mxfp4,
    };
    for (block, y) in bytes
        .chunks_exact(format.block_bytes())
        .zip(out.chunks_exact_mut(format.block_elems()))
    {
        block_fn(block, y);
    }
    Ok(())
}

/// Dequantizes rows `rows` of a matrix of `n_cols` columns whose bytes (all
/// rows, from row 0) are `bytes`, into `out` (`(rows.len(), n_cols)`), rows in
/// parallel.
pub fn dequantize_rows(
    format: TensorFormat,
    bytes: &[u8],
    n_cols: usize,
    rows: Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    let row_bytes = format
        .row_bytes(n_cols)
        .with_context(|| format!("dequantize {format} rows"))?;
    let n_rows = rows.end.saturating_sub(rows.start);
    ensure!(
        out.len() == n_rows * n_cols,
        "dequantize {format} rows {rows:?}: output holds {} values, expected {n_rows} x {n_cols}",
        out.len()
    );
    ensure!(
        rows.end * row_bytes <= bytes.len(),
        "dequantize {format} rows {rows:?}: the matrix has only {} rows of {n_cols} columns \
         ({} bytes of {row_bytes} per row)",
        bytes.len() / row_bytes.max(1),
        bytes.len()
    );
    if n_rows == 0 || n_cols == 0 {
        return Ok(());
    }
    let src = &bytes[rows.start * row_bytes..rows.end * row_bytes];
    out.par_chunks_mut(n_cols)
        .zip(src.par_chunks(row_bytes))
        .enumerate()
        .try_for_each(|(i, (y, row))| dequantize_row(format, row, y).with_context(|| format!("row {}", rows.start + i)))
}

/// Dequantizes the rows `row_ids` (e.g. token ids of an embedding lookup) of
/// a matrix of `n_cols` columns into `out` (`(row_ids.len(), n_cols)`).
pub fn gather_rows(format: TensorFormat, bytes: &[u8], n_cols: usize, row_ids: &[u32], out: &mut [f32]) -> Result<()> {
    let row_bytes = format
        .row_bytes(n_cols)
        .with_context(|| format!("gather {format} rows"))?;
    ensure!(
        out.len() == row_ids.len() * n_cols,
        "gather {format} rows: output holds {} values, expected {} x {n_cols}",
        out.len(),
        row_ids.len()
    );
    if n_cols == 0 {
        return Ok(());
    }
    let n_rows = bytes.len() / row_bytes;
    for (&id, y) in row_ids.iter().zip(out.chunks_exact_mut(n_cols)) {
        let r = id as usize;
        if r >= n_rows {
            bail!("gather {format} rows: row {r} out of range (the matrix has {n_rows} rows)");
        }
        dequantize_row(format, &bytes[r * row_bytes..(r + 1) * row_bytes], y)?;
    }
    Ok(())
}

/// Dequantizes a whole `(n_rows, n_cols)` matrix held in `bytes`.
pub fn dequantize_matrix(format: TensorFormat, bytes: &[u8], n_rows: usize, n_cols: usize) -> Result<Vec<f32>> {
    let row_bytes = format
        .row_bytes(n_cols)
        .with_context(|| format!("dequantize {format}"))?;
    ensure!(
        bytes.len() == n_rows * row_bytes,
        "dequantize {format}: {} bytes for {n_rows} x {n_cols}, expected {}",
        bytes.len(),
        n_rows * row_bytes
    );
    let mut out = vec![0.0f32; n_rows * n_cols];
    dequantize_rows(format, bytes, n_cols, 0..n_rows, &mut out)?;
    Ok(out)
}

/// Dequantizes a whole tensor, row-major (`view.rows_cols()`), rows in parallel.
pub fn dequantize(view: &TensorView) -> Result<Vec<f32>> {
    let (n_rows, n_cols) = view.rows_cols();
    dequantize_matrix(view.format(), view.bytes, n_rows, n_cols)
        .with_context(|| format!("tensor {} {:?}", view.entry.name, view.entry.shape))
}

// ---------------------------------------------------------------------------
// Field readers.

/// The f16 at byte `at`, widened (exactly) to f32.
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

// ---------------------------------------------------------------------------
// Float formats: one element per "block".

/// F32: 4 bytes, IEEE binary32.
fn block_f32(b: &[u8], y: &mut [f32]) {
    y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

/// F16: 2 bytes, IEEE binary16, widened exactly.
fn block_f16(b: &[u8], y: &mut [f32]) {
    y[0] = f16_at(b, 0);
}

/// BF16: 2 bytes, the upper 16 bits of an f32 (`y = bits << 16`).
fn block_bf16(b: &[u8], y: &mut [f32]) {
    y[0] = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
}

// ---------------------------------------------------------------------------
// 32-element blocks. In all of them byte j of `qs` holds weight j in its low
// nibble and weight j + 16 in its high nibble.

/// Q4_0: 32 weights in 18 bytes (`block_q4_0`).
///   bytes 0..2   d    f16 scale
///   bytes 2..18  qs   4-bit quants (see above)
///   y = (q - 8) * d            q in 0..=15
fn block_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        let x0 = i32::from(qs[j] & 0x0F) - 8;
        let x1 = i32::from(qs[j] >> 4) - 8;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

/// Q4_1: 32 weights in 20 bytes (`block_q4_1`).
///   bytes 0..2   d    f16 scale
///   bytes 2..4   m    f16 min
///   bytes 4..20  qs   4-bit quants
///   y = q * d + m              q in 0..=15
fn block_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        let x0 = qs[j] & 0x0F;
        let x1 = qs[j] >> 4;
        y[j] = f32::from(x0) * d + m;
        y[j + 16] = f32::from(x1) * d + m;
    }
}

/// Q5_0: 32 weights in 22 bytes (`block_q5_0`).
///   bytes 0..2   d    f16 scale
///   bytes 2..6   qh   u32: bit j is the 5th bit (value 16) of weight j
///   bytes 6..22  qs   low 4 bits
///   y = (q - 16) * d           q = low | high << 4 in 0..=31
fn block_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32_at(b, 2);
    let qs = &b[6..22];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) as u8;
        let h1 = ((qh >> (j + 16)) & 1) as u8;
        let x0 = i32::from((qs[j] & 0x0F) | (h0 << 4)) - 16;
        let x1 = i32::from((qs[j] >> 4) | (h1 << 4)) - 16;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

/// Q5_1: 32 weights in 24 bytes (`block_q5_1`).
///   bytes 0..2   d    f16 scale
///   bytes 2..4   m    f16 min
///   bytes 4..8   qh   u32: bit j is the 5th bit of weight j
///   bytes 8..24  qs   low 4 bits
///   y = q * d + m              q = low | high << 4 in 0..=31
fn block_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32_at(b, 4);
    let qs = &b[8..24];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) as u8;
        let h1 = ((qh >> (j + 16)) & 1) as u8;
        let x0 = (qs[j] & 0x0F) | (h0 << 4);
        let x1 = (qs[j] >> 4) | (h1 << 4);
        y[j] = f32::from(x0) * d + m;
        y[j + 16] = f32::from(x1) * d + m;
    }
}

/// Q8_0: 32 weights in 34 bytes (`block_q8_0`).
///   bytes 0..2   d    f16 scale
///   bytes 2..34  qs   i8 quants, weight j in byte 2 + j
///   y = q * d
fn block_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..34];
    for (yj, &q) in y.iter_mut().zip(qs) {
        *yj = f32::from(q as i8) * d;
    }
}

/// IQ4_NL's non-linear 4-bit codebook (`kvalues_iq4nl` in ggml-common.h).
const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// IQ4_NL: 32 weights in 18 bytes (`block_iq4_nl`).
///   bytes 0..2   d    f16 scale
///   bytes 2..18  qs   4-bit indices into `KVALUES_IQ4NL`
///   y = d * KVALUES_IQ4NL[q]
fn block_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * f32::from(KVALUES_IQ4NL[usize::from(qs[j] & 0x0F)]);
        y[j + 16] = d * f32::from(KVALUES_IQ4NL[usize::from(qs[j] >> 4)]);
    }
}

/// `kvalues_mxfp4` (ggml-common.h): the E2M1 values doubled (0, 0.5, 1, 1.5,
/// 2, 3, 4, 6 and their negatives), so that the scale below is half the E8M0
/// power of two.
const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `ggml_e8m0_to_fp32_half`: `2^(e - 128)`, i.e. half the E8M0 scale
/// `2^(e - 127)`, built from its bits (e < 2 gives the subnormals 2^-128
/// and 2^-127; e = 255, the E8M0 NaN, gives 2^127 as in ggml).
fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { u32::from(e - 1) << 23 };
    f32::from_bits(bits)
}

/// MXFP4 (`block_mxfp4`, 17 bytes, 32 weights): `e` (E8M0 scale) at 0, then
/// `qs[16]` at 1..17. Weight `j` is the low nibble of `qs[j]` and weight
/// `j + 16` its high nibble: `y = kvalues_mxfp4[nibble] * e8m0_half(e)`.
fn block_mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_to_f32_half(b[0]);
    let qs = &b[1..17];
    for j in 0..16 {
        y[j] = f32::from(KVALUES_MXFP4[usize::from(qs[j] & 0x0F)]) * d;
        y[j + 16] = f32::from(KVALUES_MXFP4[usize::from(qs[j] >> 4)]) * d;
    }
}

// ---------------------------------------------------------------------------
// K-quants: super-blocks of QK_K = 256 weights.

/// The 6-bit scale and min of sub-block `s` (0..8) of Q4_K / Q5_K, packed in
/// 12 bytes (`get_scale_min_k4`):
///   s < 4:  scale = scales[s] & 63,       min = scales[s + 4] & 63
///   s >= 4: scale = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4
///           min   = (scales[s + 4] >> 4) | (scales[s]     >> 6) << 4
/// i.e. bytes 0..4 hold scales 0..4 (low 6 bits), bytes 4..8 mins 0..4, bytes
/// 8..12 the low nibbles of scales 4..8 (low) and mins 4..8 (high), and the
/// top two bits of bytes 0..8 the high bits of scales/mins 4..8.
fn scale_min_k4(s: usize, scales: &[u8]) -> (u8, u8) {
    if s < 4 {
        (scales[s] & 63, scales[s + 4] & 63)
    } else {
        let sc = (scales[s + 4] & 0x0F) | ((scales[s - 4] >> 6) << 4);
        let m = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
        (sc, m)
    }
}

/// Q2_K: 256 weights in 84 bytes (`block_q2_K`), 16 sub-blocks of 16.
///   bytes 0..16   scales  byte s: low nibble = scale of sub-block s, high nibble = its min
///   bytes 16..80  qs      2-bit quants: weight e = 128*h + 32*j + l (h < 2, j < 4, l < 32)
///                         is bits 2j..2j+2 of qs[32*h + l]
///   bytes 80..82  d       f16 super-scale of the scales
///   bytes 82..84  dmin    f16 super-scale of the mins
///   y[e] = (d * scale[e/16]) * q - dmin * min[e/16]
fn block_q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for h in 0..2 {
        for j in 0..4 {
            for l in 0..32 {
                let e = 128 * h + 32 * j + l;
                let sc = scales[e / 16];
                let dl = d * f32::from(sc & 0x0F);
                let ml = dmin * f32::from(sc >> 4);
                let q = (qs[32 * h + l] >> (2 * j)) & 3;
                y[e] = dl * f32::from(q) - ml;
            }
        }
    }
}

/// The 6-bit scale (0..64, stored with offset 32) of sub-block `s` (0..16) of
/// Q3_K, packed in 12 bytes:
///   low 4 bits:  s < 8: scales[s] & 15;  s >= 8: scales[s - 8] >> 4
///   high 2 bits: (scales[8 + s % 4] >> (2 * (s / 4))) & 3
fn scale_q3_k(s: usize, scales: &[u8]) -> i32 {
    let low = if s < 8 { scales[s] & 0x0F } else { scales[s - 8] >> 4 };
    let high = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
    i32::from(low | (high << 4))
}

/// Q3_K: 256 weights in 110 bytes (`block_q3_K`), 16 sub-blocks of 16.
///   bytes 0..32    hmask   high bit of weight e = 128*h + 32*j + l (h < 2, j < 4, l < 32)
///                          is bit 4h + j of hmask[l] (i.e. bit e/32 of hmask[e%32])
///   bytes 32..96   qs      low 2 bits: bits 2j..2j+2 of qs[32*h + l]
///   bytes 96..108  scales  16 6-bit scales, see `scale_q3_k`
///   bytes 108..110 d       f16 super-scale
///   q = low - (high bit set ? 0 : 4)   in -4..=3
///   y[e] = (d * (scale[e/16] - 32)) * q
fn block_q3_k(b: &[u8], y: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let scales = &b[96..108];
    let d = f16_at(b, 108);
    for h in 0..2 {
        for j in 0..4 {
            for l in 0..32 {
                let e = 128 * h + 32 * j + l;
                let dl = d * (scale_q3_k(e / 16, scales) - 32) as f32;
                let low = i32::from((qs[32 * h + l] >> (2 * j)) & 3);
                let high_set = hmask[l] & (1 << (4 * h + j)) != 0;
                let q = low - if high_set { 0 } else { 4 };
                y[e] = dl * q as f32;
            }
        }
    }
}

/// Q4_K: 256 weights in 144 bytes (`block_q4_K`), 8 sub-blocks of 32.
///   bytes 0..2    d       f16 super-scale of the scales
///   bytes 2..4    dmin    f16 super-scale of the mins
///   bytes 4..16   scales  8 6-bit scales + 8 6-bit mins, see `scale_min_k4`
///   bytes 16..144 qs      4-bit quants: weight e = 64*h + 32*k + l (h < 4, k < 2, l < 32)
///                         is the low (k = 0) or high (k = 1) nibble of qs[32*h + l]
///   s = e/32 = 2h + k
///   y[e] = (d * scale[s]) * q - dmin * min[s]
fn block_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for h in 0..4 {
        for k in 0..2 {
            let (sc, m) = scale_min_k4(2 * h + k, scales);
            let d1 = d * f32::from(sc);
            let m1 = dmin * f32::from(m);
            for l in 0..32 {
                let q = (qs[32 * h + l] >> (4 * k)) & 0x0F;
                y[64 * h + 32 * k + l] = d1 * f32::from(q) - m1;
            }
        }
    }
}

/// Q5_K: 256 weights in 176 bytes (`block_q5_K`), 8 sub-blocks of 32.
///   bytes 0..2    d       f16 super-scale of the scales
///   bytes 2..4    dmin    f16 super-scale of the mins
///   bytes 4..16   scales  8 6-bit scales + 8 6-bit mins, see `scale_min_k4`
///   bytes 16..48  qh      5th bit of weight e = 64*h + 32*k + l (h < 4, k < 2, l < 32)
///                         is bit 2h + k of qh[l]
///   bytes 48..176 qs      low 4 bits: nibble k of qs[32*h + l]
///   q = low + 16 * high     in 0..=31;  s = e/32 = 2h + k
///   y[e] = (d * scale[s]) * q - dmin * min[s]
fn block_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for h in 0..4 {
        for k in 0..2 {
            let (sc, m) = scale_min_k4(2 * h + k, scales);
            let d1 = d * f32::from(sc);
            let m1 = dmin * f32::from(m);
            for l in 0..32 {
                let low = (qs[32 * h + l] >> (4 * k)) & 0x0F;
                let high = (qh[l] >> (2 * h + k)) & 1;
                let q = low + 16 * high;
                y[64 * h + 32 * k + l] = d1 * f32::from(q) - m1;
            }
        }
    }
}

/// Q6_K: 256 weights in 210 bytes (`block_q6_K`), 16 sub-blocks of 16.
///   bytes 0..128   ql      low 4 bits of weight e = 128*h + 32*k + l (h < 2, k < 4, l < 32):
///                          ql[64*h + 32*(k % 2) + l], low nibble for k < 2, high for k >= 2
///   bytes 128..192 qh      high 2 bits: bits 2k..2k+2 of qh[32*h + l]
///   bytes 192..208 scales  i8 scale of each sub-block of 16
///   bytes 208..210 d       f16 super-scale
///   q = (low | high << 4) - 32   in -32..=31
///   y[e] = (d * scale[e/16]) * q
fn block_q6_k(b: &[u8], y: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = f16_at(b, 208);
    for h in 0..2 {
        for k in 0..4 {
            for l in 0..32 {
                let e = 128 * h + 32 * k + l;
                let low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
                let high = (qh[32 * h + l] >> (2 * k)) & 3;
                let q = i32::from(low | (high << 4)) - 32;
                let sc = scales[e / 16] as i8;
                y[e] = d * f32::from(sc) * q as f32;
            }
        }
    }
}

const _: () = assert!(QK_K == 256, "the K-quant layouts above assume 256-element super-blocks");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::format::{ALL_FORMATS, MATMUL_ONLY_FORMATS};

    /// f16 bytes of a value that f16 represents exactly.
    fn h(x: f32) -> [u8; 2] {
        let v = f16::from_f32(x);
        assert_eq!(v.to_f32(), x, "{x} is not exact in f16");
        v.to_le_bytes()
    }

    fn deq(format: TensorFormat, bytes: &[u8]) -> Vec<f32> {
        let n = bytes.len() / format.block_bytes() * format.block_elems();
        let mut out = vec![f32::NAN; n];
        dequantize_row(format, bytes, &mut out).unwrap();
        out
    }

    #[test]
    fn float_formats() {
        let f32_bytes: Vec<u8> = [1.5f32, -2.25, 0.0, f32::MAX]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(deq(TensorFormat::F32, &f32_bytes), vec![1.5, -2.25, 0.0, f32::MAX]);

        // f16: 0x3C00 = 1.0, 0xC000 = -2.0, 0x0001 = 2^-24 (smallest subnormal), 0x7BFF = 65504.
        let f16_bytes = [0x00, 0x3C, 0x00, 0xC0, 0x01, 0x00, 0xFF, 0x7B];
        assert_eq!(
            deq(TensorFormat::F16, &f16_bytes),
            vec![1.0, -2.0, 2f32.powi(-24), 65504.0]
        );

        // bf16: 0x3F80 = 1.0, 0xC040 = -3.0, 0x3E20 = 0.15625, 0x0001 = the f32 with bits 0x0001_0000.
        let bf16_bytes = [0x80, 0x3F, 0x40, 0xC0, 0x20, 0x3E, 0x01, 0x00];
        assert_eq!(
            deq(TensorFormat::Bf16, &bf16_bytes),
            vec![1.0, -3.0, 0.15625, f32::from_bits(0x0001_0000)]
        );
    }

    #[test]
    fn q4_0_block() {
        // d = 0.5; byte j = j (low, weight j) | (15 - j) << 4 (weight j + 16).
        let mut b = h(0.5).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = deq(TensorFormat::Q4_0, &b);
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(y[j + 16], (15.0 - j as f32 - 8.0) * 0.5);
        }
        assert_eq!((y[0], y[15], y[16]), (-4.0, 3.5, 3.5));
    }

    #[test]
    fn q4_1_block() {
        // d = 0.25, m = -1.0; byte j = 15 - j | j << 4.
        let mut b = h(0.25).to_vec();
        b.extend(h(-1.0));
        b.extend((0..16u8).map(|j| (15 - j) | (j << 4)));
        let y = deq(TensorFormat::Q4_1, &b);
        for j in 0..16 {
            assert_eq!(y[j], (15 - j) as f32 * 0.25 - 1.0);
            assert_eq!(y[j + 16], j as f32 * 0.25 - 1.0);
        }
        assert_eq!((y[0], y[16]), (2.75, -1.0));
    }

    #[test]
    fn q5_0_block() {
        // d = 2.0; the 5th bit is set for even weights (qh = 0x5555_5555); low nibbles j, 15 - j.
        let mut b = h(2.0).to_vec();
        b.extend(0x5555_5555u32.to_le_bytes());
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = deq(TensorFormat::Q5_0, &b);
        for j in 0..16 {
            let high = if j % 2 == 0 { 16.0 } else { 0.0 };
            assert_eq!(y[j], (j as f32 + high - 16.0) * 2.0);
            assert_eq!(y[j + 16], ((15 - j) as f32 + high - 16.0) * 2.0);
        }
        // weight 0: q = 0 | 16 -> 0; weight 1: q = 1 -> -30; weight 16: q = 15 | 16 = 31 -> 30.
        assert_eq!((y[0], y[1], y[16]), (0.0, -30.0, 30.0));
    }

    #[test]
    fn q5_1_block() {
        // d = 0.5, m = 0.125; only the upper 16 weights have the 5th bit (qh = 0xFFFF_0000).
        let mut b = h(0.5).to_vec();
        b.extend(h(0.125));
        b.extend(0xFFFF_0000u32.to_le_bytes());
        b.extend((0..16u8).map(|j| j | (j << 4)));
        let y = deq(TensorFormat::Q5_1, &b);
        for j in 0..16 {
            assert_eq!(y[j], j as f32 * 0.5 + 0.125);
            assert_eq!(y[j + 16], (j as f32 + 16.0) * 0.5 + 0.125);
        }
        assert_eq!(y[31], 31.0 * 0.5 + 0.125);
    }

    #[test]
    fn q8_0_block() {
        // d = 0.125; q_j = j * 8 - 128 as i8 (-128, -120, ..., 120).
        let mut b = h(0.125).to_vec();
        b.extend((0..32i32).map(|j| (j * 8 - 128) as i8 as u8));
        let y = deq(TensorFormat::Q8_0, &b);
        for (j, &v) in y.iter().enumerate() {
            assert_eq!(v, (j as f32 * 8.0 - 128.0) * 0.125);
        }
        assert_eq!((y[0], y[31]), (-16.0, 15.0));
    }

    #[test]
    fn mxfp4_block() {
        // e = 129: scale 2^(129-127) = 4, half-scale 2; byte j = j | (15 - j) << 4.
        // Low nibble j -> E2M1 value kvalues[j] / 2, times 4.
        let mut b = vec![129u8];
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = deq(TensorFormat::Mxfp4, &b);
        // E2M1 codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; 8..15 the same negated (8 is -0).
        let e2m1 = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
        for j in 0..16 {
            assert_eq!(y[j], e2m1[j] * 4.0, "weight {j}");
            assert_eq!(y[j + 16], e2m1[15 - j] * 4.0, "weight {}", j + 16);
        }
        assert_eq!((y[7], y[15], y[16]), (24.0, -24.0, -24.0));
        // e = 127: scale 1 (half 0.5); e = 0 and 1: the subnormal halves 2^-128, 2^-127;
        // e = 254: 2^127 * 6 overflows to +inf in f32 (as in ggml, no saturation).
        for (e, scale) in [(127u8, 1.0f64), (120, 2f64.powi(-7)), (1, 2f64.powi(-126)), (0, 2f64.powi(-127))] {
            let mut b = vec![e];
            b.extend([0x71u8; 16]); // low nibble 1 (0.5), high nibble 7 (6)
            let y = deq(TensorFormat::Mxfp4, &b);
            assert_eq!(y[0] as f64, 0.5 * scale, "e = {e}");
            assert_eq!(y[16] as f64, 6.0 * scale, "e = {e}");
        }
        let mut b = vec![254u8];
        b.extend([0x07u8; 16]);
        assert_eq!(deq(TensorFormat::Mxfp4, &b)[0], f32::INFINITY);
        assert_eq!(TensorFormat::Mxfp4.block_bytes(), 17);
    }

    #[test]
    fn iq4_nl_block() {
        // d = 0.5; byte j = j | (15 - j) << 4 -> codebook entries j and 15 - j.
        let table = [
            -127.0f32, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0,
        ];
        let mut b = h(0.5).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = deq(TensorFormat::Iq4Nl, &b);
        for j in 0..16 {
            assert_eq!(y[j], 0.5 * table[j]);
            assert_eq!(y[j + 16], 0.5 * table[15 - j]);
        }
        assert_eq!((y[0], y[16]), (-63.5, 56.5));
    }

    /// Packs 2-bit quants as ggml's `quantize_row_q2_K_ref` does.
    fn pack_2bit(l: &[u8; 256]) -> Vec<u8> {
        let mut qs = vec![0u8; 64];
        for j in (0..256).step_by(128) {
            for i in 0..32 {
                qs[j / 4 + i] = l[j + i] | (l[j + i + 32] << 2) | (l[j + i + 64] << 4) | (l[j + i + 96] << 6);
            }
        }
        qs
    }

    #[test]
    fn q2_k_block() {
        // scale s = s % 16, min s = 15 - s; quant of weight e = (e / 7) % 4.
        let sc: Vec<u8> = (0..16).collect();
        let mn: Vec<u8> = (0..16).map(|s| 15 - s).collect();
        let l: [u8; 256] = std::array::from_fn(|e| ((e / 7) % 4) as u8);
        let (d, dmin) = (0.5f32, 0.25f32);
        let mut b: Vec<u8> = (0..16).map(|s| sc[s] | (mn[s] << 4)).collect();
        b.extend(pack_2bit(&l));
        b.extend(h(d));
        b.extend(h(dmin));
        assert_eq!(b.len(), 84);
        let y = deq(TensorFormat::Q2K, &b);
        for e in 0..256 {
            let s = e / 16;
            let want = d * f32::from(sc[s]) * f32::from(l[e]) - dmin * f32::from(mn[s]);
            assert_eq!(y[e], want, "weight {e}");
        }
        // e = 0: scale 0, min 15 -> -3.75; e = 255: scale 15, min 0, q = 36 % 4 = 0 -> 0;
        // e = 253: q = (253 / 7) % 4 = 0; e = 250: q = 35 % 4 = 3 -> 0.5 * 15 * 3 = 22.5.
        assert_eq!((y[0], y[255], y[250]), (-3.75, 0.0, 22.5));
    }

    #[test]
    fn q3_k_block() {
        // 6-bit scale of sub-block s: u = 4 * s + 1 (stored, scale = u - 32);
        // quant of weight e: q = (e % 8) - 4 in -4..=3.
        let u: Vec<u8> = (0..16).map(|s| 4 * s + 1).collect();
        let q: Vec<i32> = (0..256).map(|e| (e % 8) - 4).collect();
        let d = 0.25f32;

        // Pack as ggml's quantize_row_q3_K_ref: L = q + 4; high bit to hmask[e % 32] bit e / 32.
        let mut hmask = [0u8; 32];
        let mut low = [0u8; 256];
        for e in 0..256 {
            let big_l = (q[e] + 4) as u8;
            if big_l > 3 {
                hmask[e % 32] |= 1 << (e / 32);
            }
            low[e] = big_l & 3;
        }
        let mut scales = [0u8; 12];
        for (j, &v) in u.iter().enumerate() {
            if j < 8 {
                scales[j] = v & 0xF;
            } else {
                scales[j - 8] |= (v & 0xF) << 4;
            }
            scales[j % 4 + 8] |= (v >> 4) << (2 * (j / 4));
        }
        let mut b = hmask.to_vec();
        b.extend(pack_2bit(&low));
        b.extend(scales);
        b.extend(h(d));
        assert_eq!(b.len(), 110);
        let y = deq(TensorFormat::Q3K, &b);
        for e in 0..256 {
            let want = d * (i32::from(u[e / 16]) - 32) as f32 * q[e] as f32;
            assert_eq!(y[e], want, "weight {e}");
        }
        // e = 0: 0.25 * (1 - 32) * -4 = 31; e = 255: 0.25 * (61 - 32) * 3 = 21.75.
        assert_eq!((y[0], y[255]), (31.0, 21.75));
    }

    /// Packs 8 6-bit scales and mins as ggml's `quantize_row_q4_K_ref` does.
    fn pack_scale_min_k4(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
        let mut s = [0u8; 12];
        for j in 0..8 {
            let (ls, lm) = (sc[j], mn[j]);
            if j < 4 {
                s[j] = ls;
                s[j + 4] = lm;
            } else {
                s[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
                s[j - 4] |= (ls >> 4) << 6;
                s[j] |= (lm >> 4) << 6;
            }
        }
        s
    }

    const K4_SC: [u8; 8] = [3, 10, 17, 24, 31, 38, 45, 63];
    const K4_MIN: [u8; 8] = [60, 55, 50, 45, 40, 35, 30, 0];

    #[test]
    fn q4_k_block() {
        let (d, dmin) = (0.5f32, 0.25f32);
        let l: [u8; 256] = std::array::from_fn(|e| (e % 16) as u8);
        let mut b = h(d).to_vec();
        b.extend(h(dmin));
        b.extend(pack_scale_min_k4(&K4_SC, &K4_MIN));
        for j in (0..256).step_by(64) {
            b.extend((0..32).map(|i| l[j + i] | (l[j + i + 32] << 4)));
        }
        assert_eq!(b.len(), 144);
        let y = deq(TensorFormat::Q4K, &b);
        for e in 0..256 {
            let s = e / 32;
            let want = d * f32::from(K4_SC[s]) * f32::from(l[e]) - dmin * f32::from(K4_MIN[s]);
            assert_eq!(y[e], want, "weight {e}");
        }
        // e = 0: 0 - 0.25 * 60 = -15; e = 255: 0.5 * 63 * 15 - 0 = 472.5;
        // e = 129 (sub-block 4): 0.5 * 31 * 1 - 0.25 * 40 = 5.5.
        assert_eq!((y[0], y[255], y[129]), (-15.0, 472.5, 5.5));
    }

    #[test]
    fn q5_k_block() {
        let (d, dmin) = (0.25f32, 0.5f32);
        let l: [u8; 256] = std::array::from_fn(|e| ((e * 5) % 32) as u8);
        // Pack as ggml's quantize_row_q5_K_ref.
        let mut qh = [0u8; 32];
        let mut ql = Vec::new();
        let (mut m1, mut m2) = (1u8, 2u8);
        for n in (0..256).step_by(64) {
            for j in 0..32 {
                let mut l1 = l[n + j];
                if l1 > 15 {
                    l1 -= 16;
                    qh[j] |= m1;
                }
                let mut l2 = l[n + j + 32];
                if l2 > 15 {
                    l2 -= 16;
                    qh[j] |= m2;
                }
                ql.push(l1 | (l2 << 4));
            }
            m1 <<= 2;
            m2 <<= 2;
        }
        let mut b = h(d).to_vec();
        b.extend(h(dmin));
        b.extend(pack_scale_min_k4(&K4_SC, &K4_MIN));
        b.extend(qh);
        b.extend(ql);
        assert_eq!(b.len(), 176);
        let y = deq(TensorFormat::Q5K, &b);
        for e in 0..256 {
            let s = e / 32;
            let want = d * f32::from(K4_SC[s]) * f32::from(l[e]) - dmin * f32::from(K4_MIN[s]);
            assert_eq!(y[e], want, "weight {e}");
        }
        // e = 7: q = 35 % 32 = 3 -> 0.25 * 3 * 3 - 0.5 * 60 = -27.75;
        // e = 255: q = 1275 % 32 = 27 -> 0.25 * 63 * 27 = 425.25.
        assert_eq!((y[7], y[255]), (-27.75, 425.25));
    }

    #[test]
    fn q6_k_block() {
        let d = 0.125f32;
        let sc: [i8; 16] = std::array::from_fn(|s| (s as i8 - 8) * 9);
        let q: [i32; 256] = std::array::from_fn(|e| ((e * 11) % 64) as i32 - 32);
        // Pack as ggml's quantize_row_q6_K_ref: L = q + 32.
        let big_l: [u8; 256] = std::array::from_fn(|e| (q[e] + 32) as u8);
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for (hh, j) in (0..256).step_by(128).enumerate() {
            for i in 0..32 {
                let (q1, q2) = (big_l[j + i] & 0xF, big_l[j + i + 32] & 0xF);
                let (q3, q4) = (big_l[j + i + 64] & 0xF, big_l[j + i + 96] & 0xF);
                ql[64 * hh + i] = q1 | (q3 << 4);
                ql[64 * hh + i + 32] = q2 | (q4 << 4);
                qh[32 * hh + i] = (big_l[j + i] >> 4)
                    | ((big_l[j + i + 32] >> 4) << 2)
                    | ((big_l[j + i + 64] >> 4) << 4)
                    | ((big_l[j + i + 96] >> 4) << 6);
            }
        }
        let mut b = ql.to_vec();
        b.extend(qh);
        b.extend(sc.map(|s| s as u8));
        b.extend(h(d));
        assert_eq!(b.len(), 210);
        let y = deq(TensorFormat::Q6K, &b);
        for e in 0..256 {
            let want = d * f32::from(sc[e / 16]) * q[e] as f32;
            assert_eq!(y[e], want, "weight {e}");
        }
        // e = 0: 0.125 * -72 * -32 = 288; e = 255: q = 2805 % 64 - 32 = 21, scale 63 -> 165.375.
        assert_eq!((y[0], y[255]), (288.0, 165.375));
    }

    #[test]
    fn wrong_sizes_are_errors_naming_the_format() {
        let mut out = vec![0.0; 32];
        let err = dequantize_row(TensorFormat::Q8_0, &[0u8; 33], &mut out).unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("Q8_0") && msg.contains("33") && msg.contains("34"),
            "{msg}"
        );

        let mut out = vec![0.0; 100];
        let err = dequantize_row(TensorFormat::Q4K, &[0u8; 144], &mut out).unwrap_err();
        assert!(format!("{err:#}").contains("Q4_K"), "{err:#}");

        let bytes = vec![0u8; 2 * 34];
        let mut out = vec![0.0; 32];
        assert!(dequantize_rows(TensorFormat::Q8_0, &bytes, 32, 1..3, &mut out[..]).is_err());
        assert!(gather_rows(TensorFormat::Q8_0, &bytes, 32, &[2], &mut out).is_err());
        assert!(dequantize_matrix(TensorFormat::Q8_0, &bytes, 3, 32).is_err());
    }

    /// Deterministic pseudo-random bytes (xorshift), with every f16 field kept finite.
    fn random_blocks(format: TensorFormat, n_blocks: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let mut bytes: Vec<u8> = (0..n_blocks * format.block_bytes())
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect();
        if !format.is_float() {
            // Clear the top exponent bit of every byte pair: no f16 inf/NaN scale can occur.
            for b in bytes.iter_mut().skip(1).step_by(2) {
                *b &= 0xBF;
            }
        }
        bytes
    }

    #[test]
    fn rows_gather_and_matrix_agree_with_single_rows() {
        for format in ALL_FORMATS.into_iter().chain(MATMUL_ONLY_FORMATS) {
            let n_cols = 2 * QK_K;
            let n_rows = 5;
            let row_bytes = format.row_bytes(n_cols).unwrap();
            let bytes = random_blocks(format, n_rows * row_bytes / format.block_bytes(), 7 + format as u64);
            let whole = dequantize_matrix(format, &bytes, n_rows, n_cols).unwrap();
            for r in 0..n_rows {
                let mut one = vec![0.0; n_cols];
                dequantize_row(format, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut one).unwrap();
                let got = &whole[r * n_cols..(r + 1) * n_cols];
                assert!(
                    one.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{format} row {r}"
                );
            }
            let mut mid = vec![0.0; 2 * n_cols];
            dequantize_rows(format, &bytes, n_cols, 2..4, &mut mid).unwrap();
            assert!(mid
                .iter()
                .zip(&whole[2 * n_cols..4 * n_cols])
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let mut gathered = vec![0.0; 2 * n_cols];
            gather_rows(format, &bytes, n_cols, &[4, 0], &mut gathered).unwrap();
            assert!(gathered[..n_cols]
                .iter()
                .zip(&whole[4 * n_cols..])
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            assert!(gathered[n_cols..]
                .iter()
                .zip(&whole[..n_cols])
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
