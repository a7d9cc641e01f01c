//! The `vq2` codebook: 256 codewords of 4 dimensions (8 bits per 4
//! elements = 2 bits per element), fixed for every model and layer, and the
//! nearest-codeword search the encoder uses.
//!
//! Rule (docs/kv-formats.md, "vq2"): after the Hadamard rotation and the
//! division by the row's RMS, the elements of a K or V row are close to
//! independent N(0, 1) whatever the model (the rotation mixes every channel
//! into every element), so one codebook fitted to N(0, 1)^4 serves all of
//! them and needs no calibration. It is generated deterministically here:
//! Lloyd's algorithm (k-means, f64) for [`LLOYD_ITERS`] iterations over
//! [`N_TRAIN`] pseudo-Gaussian 4-vectors (each coordinate the Irwin-Hall sum
//! of 12 uniforms from SplitMix64 minus 6: integer and f64 additions only, so
//! the same bits on every machine), started from the first 256 samples,
//! then rounded to f32. The GPU receives these 256 x 4 f32 values from
//! [`codebook`] (upload them; do not regenerate them in CUDA) and must
//! search them exactly as [`nearest`] does.

use std::sync::OnceLock;

/// Codewords.
pub const N_CODES: usize = 256;
/// Dimensions per codeword.
pub const DIM: usize = 4;
/// Training vectors of the codebook.
pub const N_TRAIN: usize = 16384;
/// Lloyd iterations.
pub const LLOYD_ITERS: usize = 16;

/// The codebook, `(N_CODES, DIM)` row-major, generated once per process.
pub fn codebook() -> &'static [[f32; DIM]; N_CODES] {
    static BOOK: OnceLock<[[f32; DIM]; N_CODES]> = OnceLock::new();
    BOOK.get_or_init(generate)
}

/// The index of the codeword nearest to `z` in squared distance, computed
/// in f32 as `((e0*e0 + e1*e1) + e2*e2) + e3*e3` with `e_j = z_j - c_j`
/// (GPU: `__fsub_rn`, `__fmul_rn`, `__fadd_rn`; no FMA); codewords are
/// visited in index order and a later one wins only if strictly nearer, so
/// ties go to the lowest index.
pub fn nearest(z: &[f32; DIM]) -> u8 {
    let book = codebook();
    let mut best = 0usize;
    let mut best_d = f32::INFINITY;
    for (i, c) in book.iter().enumerate() {
        let e0 = z[0] - c[0];
        let e1 = z[1] - c[1];
        let e2 = z[2] - c[2];
        let e3 = z[3] - c[3];
        let d = ((e0 * e0 + e1 * e1) + e2 * e2) + e3 * e3;
        if d < best_d {
            best_d = d;
            best = i;
        }
    }
    best as u8
}

struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 bits.
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Approximately N(0, 1): Irwin-Hall of 12 uniforms, minus 6.
    fn gaussian(&mut self) -> f64 {
        let mut s = 0.0;
        for _ in 0..12 {
            s += self.uniform();
        }
        s - 6.0
    }
}

/// Pseudo-Gaussian training vectors, `(N_TRAIN, DIM)`.
fn training_set() -> Vec<[f64; DIM]> {
    let mut rng = SplitMix64(0x6b76_3271_5f76_3031); // "kv2q_v01"
    (0..N_TRAIN).map(|_| [rng.gaussian(), rng.gaussian(), rng.gaussian(), rng.gaussian()]).collect()
}

fn dist2(a: &[f64; DIM], b: &[f64; DIM]) -> f64 {
    (0..DIM).map(|j| (a[j] - b[j]) * (a[j] - b[j])).sum()
}

fn generate() -> [[f32; DIM]; N_CODES] {
    let data = training_set();
    let mut cent: Vec<[f64; DIM]> = data[..N_CODES].to_vec();
    for _ in 0..LLOYD_ITERS {
        let mut sum = vec![[0.0f64; DIM]; N_CODES];
        let mut count = vec![0usize; N_CODES];
        for x in &data {
            let mut best = 0;
            let mut best_d = f64::INFINITY;
            for (i, c) in cent.iter().enumerate() {
                let d = dist2(x, c);
                if d < best_d {
                    best_d = d;
                    best = i;
                }
            }
            count[best] += 1;
            for j in 0..DIM {
                sum[best][j] += x[j];
            }
        }
        for i in 0..N_CODES {
            // An empty cell keeps its codeword.
            if count[i] > 0 {
                for j in 0..DIM {
                    cent[i][j] = sum[i][j] / count[i] as f64;
                }
            }
        }
    }
    let mut out = [[0.0f32; DIM]; N_CODES];
    for (o, c) in out.iter_mut().zip(&cent) {
        for j in 0..DIM {
            o[j] = c[j] as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mean squared error per element of `quant` over fresh pseudo-Gaussian vectors.
    fn mse(quant: impl Fn(&[f32; DIM]) -> [f32; DIM]) -> f64 {
        let mut rng = SplitMix64(12345);
        let n = 20000;
        let mut s = 0.0;
        for _ in 0..n {
            let z = [rng.gaussian() as f32, rng.gaussian() as f32, rng.gaussian() as f32, rng.gaussian() as f32];
            let q = quant(&z);
            s += (0..DIM).map(|j| ((z[j] - q[j]) as f64).powi(2)).sum::<f64>();
        }
        s / (n * DIM) as f64
    }

    #[test]
    fn codebook_beats_the_best_scalar_two_bit_quantizer() {
        let book = codebook();
        let vq = mse(|z| book[nearest(z) as usize]);
        // Lloyd-Max 2-bit levels for N(0, 1): ±0.4528, ±1.5104 (MSE 0.1175).
        let lm = |v: f32| {
            let a = if v.abs() < 0.9816 { 0.4528 } else { 1.5104 };
            a * v.signum()
        };
        let scalar = mse(|z| [lm(z[0]), lm(z[1]), lm(z[2]), lm(z[3])]);
        eprintln!("vq2 codebook MSE {vq:.5}, scalar 2-bit Lloyd-Max {scalar:.5}");
        assert!((scalar - 0.1175).abs() < 0.01, "scalar Lloyd-Max MSE {scalar}");
        assert!(vq < scalar * 0.97, "vq2 codebook MSE {vq} vs scalar 2-bit {scalar}");
    }

    #[test]
    fn codewords_are_distinct_and_finite() {
        let book = codebook();
        for (i, a) in book.iter().enumerate() {
            assert!(a.iter().all(|v| v.is_finite()));
            for b in &book[..i] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn each_codeword_is_its_own_nearest() {
        let book = codebook();
        for (i, c) in book.iter().enumerate() {
            assert_eq!(nearest(c) as usize, i);
        }
    }
}
