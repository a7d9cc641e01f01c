//! Single-precision matrix products for the CPU backend: a bounds-checked
//! strided view over `matrixmultiply::sgemm` (a blocked, packed GEMM with
//! AVX2/FMA kernels chosen at run time) and the row-parallel `x · wᵀ` the
//! projections use.
//!
//! Determinism: each output element is one dot product whose summation order
//! depends only on the inner dimension `k` (matrixmultiply blocks `k` the
//! same way whatever `m`, `n` or the thread split), so results are
//! bit-identical across runs and thread counts. `matmul_nt_plain` is the
//! plain twin the tests compare against.

use anyhow::{ensure, Result};
use rayon::prelude::*;

/// A strided read-only matrix view: element `(i, j)` is `data[i*rs + j*cs]`.
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub n_rows: usize,
    pub n_cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// A contiguous row-major `(n_rows, n_cols)` matrix.
    pub fn row_major(data: &'a [f32], n_rows: usize, n_cols: usize) -> Self {
        Self { data, n_rows, n_cols, rs: n_cols, cs: 1 }
    }

    /// The transpose (no copy).
    pub fn t(self) -> Self {
        Self { data: self.data, n_rows: self.n_cols, n_cols: self.n_rows, rs: self.cs, cs: self.rs }
    }

    fn check(&self, what: &str) -> Result<()> {
        if self.n_rows == 0 || self.n_cols == 0 {
            return Ok(());
        }
        let last = (self.n_rows - 1) * self.rs + (self.n_cols - 1) * self.cs;
        ensure!(
            last < self.data.len(),
            "gemm: {what} view ({} x {}, strides {} {}) reaches element {last} of a buffer of {}",
            self.n_rows,
            self.n_cols,
            self.rs,
            self.cs,
            self.data.len()
        );
        Ok(())
    }
}

/// `c (m, n) = a (m, k) · b (k, n)`, `c` row-major with row stride `c_rs`
/// (columns contiguous); `c` is overwritten.
pub fn gemm(a: MatRef, b: MatRef, c: &mut [f32], c_rs: usize) -> Result<()> {
    let (m, k, n) = (a.n_rows, a.n_cols, b.n_cols);
    ensure!(b.n_rows == k, "gemm: inner dimensions differ ({m} x {k}) · ({} x {n})", b.n_rows);
    a.check("a")?;
    b.check("b")?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    ensure!(c_rs >= n, "gemm: output row stride {c_rs} is below its {n} columns");
    ensure!(
        (m - 1) * c_rs + n <= c.len(),
        "gemm: output ({m} x {n}, row stride {c_rs}) does not fit a buffer of {}",
        c.len()
    );
    if k == 0 {
        for i in 0..m {
            c[i * c_rs..i * c_rs + n].fill(0.0);
        }
        return Ok(());
    }
    // SAFETY: the three views were bounds-checked above (every element the
    // product reads or writes lies inside its slice); `c` is borrowed mutably
    // so nothing else aliases it; beta = 0 means `c` need not be initialized.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr(),
            b.rs as isize,
            b.cs as isize,
            0.0,
            c.as_mut_ptr(),
            c_rs as isize,
            1,
        );
    }
    Ok(())
}

/// Output columns per parallel task of [`matmul_nt`].
const COLS_PER_TASK: usize = 128;

/// `x (m, k) · wᵀ` with `w` row-major `(n, k)` -> row-major `(m, n)`.
/// Parallel over blocks of output columns (weight rows), so each thread
/// streams its own part of the weight.
pub fn matmul_nt(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Result<Vec<f32>> {
    ensure!(x.len() == m * k, "matmul: x has {} elements, expected {m} x {k}", x.len());
    ensure!(w.len() == n * k, "matmul: weight has {} elements, expected {n} x {k}", w.len());
    let blocks: Vec<usize> = (0..n).step_by(COLS_PER_TASK).collect();
    let parts: Vec<Vec<f32>> = blocks
        .par_iter()
        .map(|&j0| {
            let nb = COLS_PER_TASK.min(n - j0);
            let mut part = vec![0f32; m * nb];
            let wb = MatRef::row_major(&w[j0 * k..(j0 + nb) * k], nb, k).t();
            gemm(MatRef::row_major(x, m, k), wb, &mut part, nb)?;
            Ok(part)
        })
        .collect::<Result<_>>()?;
    let mut out = vec![0f32; m * n];
    for (&j0, part) in blocks.iter().zip(&parts) {
        let nb = COLS_PER_TASK.min(n - j0);
        for i in 0..m {
            out[i * n + j0..i * n + j0 + nb].copy_from_slice(&part[i * nb..(i + 1) * nb]);
        }
    }
    Ok(out)
}

/// The plain twin of [`matmul_nt`]: one f64 dot product per element.
pub fn matmul_nt_plain(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum();
            out[i * n + j] = dot as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeded(n: usize, seed: u32) -> Vec<f32> {
        // A small LCG: values in [-1, 1), reproducible without a dependency.
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    }

    #[test]
    fn matmul_matches_plain_twin() {
        for &(m, n, k) in &[(1, 1, 1), (3, 5, 7), (17, 300, 64), (130, 129, 576)] {
            let x = seeded(m * k, 1);
            let w = seeded(n * k, 2);
            let fast = matmul_nt(&x, m, &w, n, k).unwrap();
            let plain = matmul_nt_plain(&x, m, &w, n, k);
            for (i, (a, b)) in fast.iter().zip(&plain).enumerate() {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "({m},{n},{k}) element {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn matmul_hand_computed() {
        // x = [[1, 2], [3, 4]], w = [[1, 0], [1, 1], [0, 2]] -> x·wᵀ = [[1, 3, 4], [3, 7, 8]]
        let out = matmul_nt(&[1., 2., 3., 4.], 2, &[1., 0., 1., 1., 0., 2.], 3, 2).unwrap();
        assert_eq!(out, vec![1., 3., 4., 3., 7., 8.]);
    }

    #[test]
    fn matmul_rows_do_not_depend_on_batch() {
        // Row i of a batched product equals the product of row i alone, bit for bit.
        let (m, n, k) = (37, 200, 320);
        let x = seeded(m * k, 3);
        let w = seeded(n * k, 4);
        let all = matmul_nt(&x, m, &w, n, k).unwrap();
        for i in [0, 5, 36] {
            let one = matmul_nt(&x[i * k..(i + 1) * k], 1, &w, n, k).unwrap();
            assert_eq!(&all[i * n..(i + 1) * n], &one[..], "row {i}");
        }
    }

    #[test]
    fn views_out_of_bounds_are_errors() {
        let a = [0f32; 6];
        let mut c = [0f32; 4];
        let bad = MatRef { data: &a, n_rows: 2, n_cols: 4, rs: 4, cs: 1 };
        let err = gemm(bad, MatRef::row_major(&a, 4, 1), &mut c, 1).unwrap_err();
        assert!(format!("{err}").contains("reaches element"), "{err}");
    }
}
