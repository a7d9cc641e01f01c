//! CPU twins of the CUDA kernels, used only by the parity tests in
//! `tests/gpu_ops.rs`: the dequantizers written after ggml's
//! `dequantize_row_*` loops (block by block, not the kernels' 8-element
//! indexing, so a shared indexing mistake cannot hide), and f64 references
//! of every op.

use half::{bf16, f16};
use infernix_perplexity::artifact::format::TensorFormat;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// ggml's kvalues_iq4nl.
const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Dequantizes one row of `n_cols` elements (ggml's dequantize_row_* arithmetic, f32).
pub fn dequant_row(format: TensorFormat, row: &[u8], n_cols: usize) -> Vec<f32> {
    let mut y = Vec::with_capacity(n_cols);
    let bb = format.block_bytes();
    let n_blocks = n_cols / format.block_elems();
    for b in 0..n_blocks {
        let x = &row[b * bb..(b + 1) * bb];
        match format {
            TensorFormat::F32 => y.push(f32::from_le_bytes([x[0], x[1], x[2], x[3]])),
            TensorFormat::F16 => y.push(f16_at(x, 0)),
            TensorFormat::Bf16 => y.push(bf16::from_bits(u16::from_le_bytes([x[0], x[1]])).to_f32()),
            TensorFormat::Q4_0 | TensorFormat::Iq4Nl => {
                let d = f16_at(x, 0);
                let mut lo = [0f32; 16];
                let mut hi = [0f32; 16];
                for j in 0..16 {
                    let (a, c) = ((x[2 + j] & 0xF) as usize, (x[2 + j] >> 4) as usize);
                    if format == TensorFormat::Q4_0 {
                        lo[j] = (a as i32 - 8) as f32 * d;
                        hi[j] = (c as i32 - 8) as f32 * d;
                    } else {
                        lo[j] = d * KVALUES_IQ4NL[a] as f32;
                        hi[j] = d * KVALUES_IQ4NL[c] as f32;
                    }
                }
                y.extend_from_slice(&lo);
                y.extend_from_slice(&hi);
            }
            TensorFormat::Q4_1 => {
                let (d, m) = (f16_at(x, 0), f16_at(x, 2));
                let lo: Vec<f32> = (0..16).map(|j| (x[4 + j] & 0xF) as f32 * d + m).collect();
                let hi: Vec<f32> = (0..16).map(|j| (x[4 + j] >> 4) as f32 * d + m).collect();
                y.extend(lo);
                y.extend(hi);
            }
            TensorFormat::Q5_0 | TensorFormat::Q5_1 => {
                let q51 = format == TensorFormat::Q5_1;
                let d = f16_at(x, 0);
                let m = if q51 { f16_at(x, 2) } else { 0.0 };
                let o = if q51 { 4 } else { 2 };
                let qh = u32::from_le_bytes([x[o], x[o + 1], x[o + 2], x[o + 3]]);
                let qs = &x[o + 4..o + 20];
                let mut lo = [0f32; 16];
                let mut hi = [0f32; 16];
                for j in 0..16 {
                    let xh0 = (((qh >> j) << 4) & 0x10) as i32;
                    let xh1 = ((qh >> (j + 12)) & 0x10) as i32;
                    let x0 = (qs[j] & 0x0F) as i32 | xh0;
                    let x1 = (qs[j] >> 4) as i32 | xh1;
                    if q51 {
                        lo[j] = x0 as f32 * d + m;
                        hi[j] = x1 as f32 * d + m;
                    } else {
                        lo[j] = (x0 - 16) as f32 * d;
                        hi[j] = (x1 - 16) as f32 * d;
                    }
                }
                y.extend_from_slice(&lo);
                y.extend_from_slice(&hi);
            }
            TensorFormat::Q8_0 => {
                let d = f16_at(x, 0);
                y.extend((0..32).map(|j| (x[2 + j] as i8) as f32 * d));
            }
            TensorFormat::Q2K => {
                let (d, min) = (f16_at(x, 80), f16_at(x, 82));
                let scales = &x[0..16];
                let mut is = 0;
                for n in 0..2 {
                    let q = &x[16 + n * 32..16 + n * 32 + 32];
                    for j in 0..4 {
                        let shift = 2 * j;
                        for half_ in 0..2 {
                            let sc = scales[is];
                            is += 1;
                            let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
                            for l in 0..16 {
                                y.push(dl * ((q[l + 16 * half_] >> shift) & 3) as f32 - ml);
                            }
                        }
                    }
                }
            }
            TensorFormat::Q3K => {
                let d_all = f16_at(x, 108);
                let hm = &x[0..32];
                let mut aux = [0u32; 4];
                for (i, a) in aux.iter_mut().take(3).enumerate() {
                    *a = u32::from_le_bytes([x[96 + 4 * i], x[97 + 4 * i], x[98 + 4 * i], x[99 + 4 * i]]);
                }
                let (kmask1, kmask2) = (0x03030303u32, 0x0f0f0f0fu32);
                let tmp = aux[2];
                aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
                aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
                aux[0] = (aux[0] & kmask2) | ((tmp & kmask1) << 4);
                aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
                let scales: Vec<i8> = aux.iter().flat_map(|a| a.to_le_bytes()).map(|b| b as i8).collect();
                let mut is = 0;
                let mut m = 1u8;
                for n in 0..2 {
                    let q = &x[32 + n * 32..32 + n * 32 + 32];
                    for j in 0..4 {
                        let shift = 2 * j;
                        for half_ in 0..2 {
                            let dl = d_all * (scales[is] as i32 - 32) as f32;
                            is += 1;
                            for l in 0..16 {
                                let li = l + 16 * half_;
                                let v = ((q[li] >> shift) & 3) as i32 - if hm[li] & m != 0 { 0 } else { 4 };
                                y.push(dl * v as f32);
                            }
                        }
                        m <<= 1;
                    }
                }
            }
            TensorFormat::Q4K | TensorFormat::Q5K => {
                let q5 = format == TensorFormat::Q5K;
                let (d, min) = (f16_at(x, 0), f16_at(x, 2));
                let sc = &x[4..16];
                let qh = &x[16..48];
                let ql_off = if q5 { 48 } else { 16 };
                let (mut u1, mut u2) = (1u8, 2u8);
                for jj in 0..4 {
                    let q = &x[ql_off + jj * 32..ql_off + jj * 32 + 32];
                    let (s1, m1) = scale_min_k4(2 * jj, sc);
                    let (s2, m2) = scale_min_k4(2 * jj + 1, sc);
                    let (d1, mm1, d2, mm2) = (d * s1 as f32, min * m1 as f32, d * s2 as f32, min * m2 as f32);
                    for l in 0..32 {
                        let h = if q5 && qh[l] & u1 != 0 { 16 } else { 0 };
                        y.push(d1 * ((q[l] & 0xF) as i32 + h) as f32 - mm1);
                    }
                    for l in 0..32 {
                        let h = if q5 && qh[l] & u2 != 0 { 16 } else { 0 };
                        y.push(d2 * ((q[l] >> 4) as i32 + h) as f32 - mm2);
                    }
                    u1 <<= 2;
                    u2 <<= 2;
                }
            }
            TensorFormat::Q6K => {
                let d = f16_at(x, 208);
                let mut out = [0f32; 256];
                for n in 0..2 {
                    let ql = &x[n * 64..n * 64 + 64];
                    let qh = &x[128 + n * 32..128 + n * 32 + 32];
                    let sc = &x[192 + n * 8..192 + n * 8 + 8];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        let s = |i: usize| d * (sc[i] as i8) as f32;
                        out[n * 128 + l] = s(is) * q1 as f32;
                        out[n * 128 + l + 32] = s(is + 2) * q2 as f32;
                        out[n * 128 + l + 64] = s(is + 4) * q3 as f32;
                        out[n * 128 + l + 96] = s(is + 6) * q4 as f32;
                    }
                }
                y.extend_from_slice(&out);
            }
            TensorFormat::Mxfp4 => panic!("MXFP4 is CPU-only (not in ALL_FORMATS)"),
        }
    }
    y
}

/// Byte offsets of the f16 scale fields in one block (set to sane values by `random_matrix`).
fn scale_offsets(format: TensorFormat) -> &'static [usize] {
    match format {
        TensorFormat::Q4_0 | TensorFormat::Q5_0 | TensorFormat::Q8_0 | TensorFormat::Iq4Nl => &[0],
        TensorFormat::Q4_1 | TensorFormat::Q5_1 | TensorFormat::Q4K | TensorFormat::Q5K => &[0, 2],
        TensorFormat::Q2K => &[80, 82],
        TensorFormat::Q3K => &[108],
        TensorFormat::Q6K => &[208],
        TensorFormat::F32 | TensorFormat::F16 | TensorFormat::Bf16 => &[],
        TensorFormat::Mxfp4 => panic!("MXFP4 is CPU-only (not in ALL_FORMATS)"),
    }
}

pub fn normal(rng: &mut ChaCha8Rng) -> f32 {
    // Box-Muller; enough for test data.
    let u1: f64 = rng.gen_range(1e-12..1.0);
    let u2: f64 = rng.gen::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// A random (n_rows, n_cols) matrix in `format`: random payload bytes with
/// f16 scales of magnitude 0.002..0.03 (random sign), or N(0, 0.5^2) floats.
pub fn random_matrix(format: TensorFormat, n_rows: usize, n_cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let row_bytes = format.row_bytes(n_cols).expect("whole blocks");
    let mut out = vec![0u8; n_rows * row_bytes];
    match format {
        TensorFormat::F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&(0.5 * normal(rng)).to_le_bytes());
            }
        }
        TensorFormat::F16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(0.5 * normal(rng)).to_le_bytes());
            }
        }
        TensorFormat::Bf16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&bf16::from_f32(0.5 * normal(rng)).to_le_bytes());
            }
        }
        _ => {
            rng.fill(&mut out[..]);
            let bb = format.block_bytes();
            for blk in out.chunks_exact_mut(bb) {
                for &o in scale_offsets(format) {
                    let mag: f32 = rng.gen_range(0.002..0.03);
                    let v = if rng.gen::<bool>() { mag } else { -mag };
                    blk[o..o + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
        }
    }
    out
}

/// All rows dequantized: (n_rows, n_cols).
pub fn dequant_matrix(format: TensorFormat, bytes: &[u8], n_rows: usize, n_cols: usize) -> Vec<f32> {
    let rb = format.row_bytes(n_cols).expect("whole blocks");
    (0..n_rows).flat_map(|r| dequant_row(format, &bytes[r * rb..(r + 1) * rb], n_cols)).collect()
}

pub fn round_bf16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// y[m, n] = sum_k x[m, k] * w[n, k] in f64.
pub fn matmul_f64(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut y = vec![0f64; m * n];
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for j in 0..n {
            let wr = &w[j * k..(j + 1) * k];
            y[i * n + j] = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
        }
    }
    y
}

/// RMSNorm of one row in f64.
pub fn rmsnorm_f64(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(w).map(|(&v, &g)| v as f64 * s * g as f64).collect()
}

/// RoPE of one head (d_head values) at position `pos`, f64; mode_neox pairs (i, i + n_rot/2).
pub fn rope_f64(x: &[f32], pos: i32, n_rot: usize, neox: bool, base: f64, scale: f64) -> Vec<f64> {
    let mut y: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for i in 0..n_rot / 2 {
        let theta = pos as f64 * scale * base.powf(-2.0 * i as f64 / n_rot as f64);
        let (s, c) = theta.sin_cos();
        let (i0, i1) = if neox { (i, i + n_rot / 2) } else { (2 * i, 2 * i + 1) };
        let (a, b) = (x[i0] as f64, x[i1] as f64);
        y[i0] = a * c - b * s;
        y[i1] = a * s + b * c;
    }
    y
}

/// RoPE in f64 with given per-pair inverse frequencies (`inv.len()` pairs)
/// and a multiplier on cos and sin (YaRN's attention factor).
pub fn rope_inv_freq_f64(x: &[f32], pos: i32, neox: bool, inv: &[f64], attn: f64) -> Vec<f64> {
    let mut y: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let half = inv.len();
    for (i, &f) in inv.iter().enumerate() {
        let (s, c) = (pos as f64 * f).sin_cos();
        let (c, s) = (c * attn, s * attn);
        let (i0, i1) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
        let (a, b) = (x[i0] as f64, x[i1] as f64);
        y[i0] = a * c - b * s;
        y[i1] = a * s + b * c;
    }
    y
}

pub fn silu_f64(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

pub fn gelu_tanh_f64(x: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
}

/// Order-preserving key of an f32 (the kernel's `order_key`).
pub fn order_key(f: f32) -> u32 {
    let u = f.to_bits();
    if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    }
}

/// Top-k of one row ordered by (key descending, id ascending).
pub fn topk(row: &[f32], k: usize) -> Vec<(i32, f32)> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| order_key(row[b]).cmp(&order_key(row[a])).then(a.cmp(&b)));
    idx.into_iter().take(k).map(|i| (i as i32, row[i])).collect()
}
