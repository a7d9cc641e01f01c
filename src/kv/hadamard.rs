//! The Hadamard rotation some KV codecs apply before quantizing: an
//! unnormalized fast Walsh-Hadamard transform over blocks of `n` elements,
//! `n` the largest power of two dividing the row length (64 for d_head 64,
//! 256 for 256, 32 for 96). Forward `y = H x`; inverse `x = (H y) * (1/n)`,
//! exact because `H H = n I` and `1/n` is a power of two.
//!
//! Arithmetic (the GPU must do exactly this, in f32, `__fadd_rn`/`__fsub_rn`
//! not needed since there is no multiply to fuse): stages `h = 1, 2, 4, ..,
//! n/2`; in each stage every pair `(j, j + h)` with `j % (2h) < h` becomes
//! `(a + b, a - b)`. Each output is a fixed tree of adds over the inputs, so
//! any thread mapping that runs the stages in this order gives these bits.
//! The inverse multiplies by `1/n` last (`__fmul_rn`).

/// The rotation block of a row of `d` elements: the largest power of two dividing `d`.
pub fn block_len(d: usize) -> usize {
    if d == 0 {
        return 1;
    }
    1 << d.trailing_zeros()
}

/// In place, `x <- H x` block by block (unnormalized).
pub fn forward(x: &mut [f32]) {
    let n = block_len(x.len());
    for block in x.chunks_exact_mut(n) {
        fwht(block);
    }
}

/// In place, `x <- (H x) / n` block by block: the inverse of [`forward`].
pub fn inverse(x: &mut [f32]) {
    let n = block_len(x.len());
    let inv_n = 1.0 / n as f32; // a power of two: exact
    for block in x.chunks_exact_mut(n) {
        fwht(block);
        for v in block.iter_mut() {
            *v *= inv_n;
        }
    }
}

/// The butterfly network on one block of power-of-two length.
fn fwht(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let a = x[j];
                let b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_is_largest_power_of_two_divisor() {
        assert_eq!(block_len(64), 64);
        assert_eq!(block_len(256), 256);
        assert_eq!(block_len(96), 32);
        assert_eq!(block_len(160), 32);
    }

    #[test]
    fn inverse_undoes_forward_and_norm_scales_by_n() {
        let x: Vec<f32> = (0..96).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.125).collect();
        let mut y = x.clone();
        forward(&mut y);
        let nx: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
        let ny: f64 = y.iter().map(|&v| (v as f64).powi(2)).sum();
        assert!((ny - 32.0 * nx).abs() < 1e-9 * ny, "{ny} vs 32 * {nx}");
        inverse(&mut y);
        // Small integers times 1/8: every partial sum is exact, so the round trip is too.
        assert_eq!(x, y);
    }

    #[test]
    fn a_spike_spreads_evenly() {
        let mut x = vec![0.0f32; 64];
        x[5] = 3.0;
        forward(&mut x);
        assert!(x.iter().all(|&v| v.abs() == 3.0));
    }
}
