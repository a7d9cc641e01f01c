//! Numeric primitives of the score statistics: compensated summation and the
//! two standard errors of a mean NLL.
//!
//! Everything here is sequential f64 arithmetic in the order the caller gives,
//! so results are bit-identical from run to run. It owns no notion of windows
//! or streams; `score` (the parent module) feeds it.

/// Neumaier's compensated sum (Kahan-Babuska): the error of each addition is
/// kept in `compensation` and added back at the end, so summing 10^6 NLLs of
/// similar size loses nothing measurable. Order-dependent only in the last
/// bits, and the order here is always the caller's (sequential).
#[derive(Clone, Copy, Debug, Default)]
pub struct NeumaierSum {
    sum: f64,
    compensation: f64,
}

impl NeumaierSum {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn add(&mut self, x: f64) {
        let t = self.sum + x;
        if self.sum.abs() >= x.abs() {
            self.compensation += (self.sum - t) + x;
        } else {
            self.compensation += (x - t) + self.sum;
        }
        self.sum = t;
    }

    pub fn value(&self) -> f64 {
        self.sum + self.compensation
    }
}

/// Compensated sum of `xs` in iteration order.
pub fn sum(xs: impl IntoIterator<Item = f64>) -> f64 {
    let mut s = NeumaierSum::new();
    for x in xs {
        s.add(x);
    }
    s.value()
}

/// llama.cpp's standard error of the mean NLL, transcribed from
/// `tools/perplexity/perplexity.cpp` (`perplexity()`, end of the chunk loop):
///
/// ```text
/// nll2 /= count; nll /= count;
/// nll2 -= nll * nll;
/// if (nll2 > 0) nll2 = sqrt(nll2/(count-1));   // printed: PPL +/- nll2*ppl
/// ```
///
/// with `nll = Σ v`, `nll2 = Σ v²` over every scored token. This is the
/// standard error of a mean of `count` independent draws (the population
/// variance over `count - 1`), i.e. it treats tokens as independent.
/// Returns `None` when `count < 2`; when the variance term is not positive
/// (all values equal, or rounding) llama.cpp prints an error and no figure,
/// and this returns `Some(0.0)`.
pub fn llama_cpp_se(count: usize, nll_sum: f64, nll_sq_sum: f64) -> Option<f64> {
    if count < 2 {
        return None;
    }
    let n = count as f64;
    let mean = nll_sum / n;
    let var = nll_sq_sum / n - mean * mean;
    if var > 0.0 {
        Some((var / (n - 1.0)).sqrt())
    } else {
        Some(0.0)
    }
}

/// Cluster-robust standard error of the token-weighted mean NLL, each cluster
/// one window (tokens inside a window share context and are correlated, so
/// the independent-token SE above is too small).
///
/// For clusters `g = 1..G` with `n_g` tokens and NLL sum `S_g`, the mean is
/// `m = Σ S_g / Σ n_g` and (CR1, the usual small-sample factor `G/(G-1)`)
///
/// ```text
/// Var(m) = G/(G-1) · Σ_g (S_g - n_g·m)² / (Σ_g n_g)²
/// ```
///
/// With one token per cluster this equals [`llama_cpp_se`]² exactly in
/// exact arithmetic. Clusters with `n_g = 0` contribute nothing and are not
/// counted in `G`. Returns `None` with fewer than 2 non-empty clusters.
/// `clusters` yields `(n_g, S_g)`.
pub fn clustered_se(clusters: impl IntoIterator<Item = (usize, f64)> + Clone) -> Option<f64> {
    let mut n_total = 0usize;
    let mut g = 0usize;
    let mut s_total = NeumaierSum::new();
    for (n, s) in clusters.clone() {
        if n > 0 {
            n_total += n;
            g += 1;
            s_total.add(s);
        }
    }
    if g < 2 {
        return None;
    }
    let n_total = n_total as f64;
    let mean = s_total.value() / n_total;
    let mut ss = NeumaierSum::new();
    for (n, s) in clusters {
        if n > 0 {
            let r = s - n as f64 * mean;
            ss.add(r * r);
        }
    }
    let g = g as f64;
    Some((g / (g - 1.0) * ss.value()).sqrt() / n_total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neumaier_recovers_small_terms() {
        // 1 + 1e-16 ten million times: the naive sum stays 1.0.
        let mut s = NeumaierSum::new();
        s.add(1.0);
        for _ in 0..10_000_000 {
            s.add(1e-16);
        }
        assert!((s.value() - (1.0 + 1e-9)).abs() < 1e-15, "{}", s.value());
        assert_eq!(sum([1e100, 1.0, -1e100]), 1.0);
    }

    #[test]
    fn llama_se_hand_computed() {
        // values 1, 2, 3, 4: mean 2.5, population variance 1.25, SE = sqrt(1.25/3).
        let se = llama_cpp_se(4, 10.0, 30.0).unwrap();
        assert!((se - (1.25f64 / 3.0).sqrt()).abs() < 1e-15, "{se}");
        assert_eq!(llama_cpp_se(1, 3.0, 9.0), None);
        assert_eq!(llama_cpp_se(3, 6.0, 12.0), Some(0.0));
    }

    #[test]
    fn clustered_hand_computed() {
        // Clusters (n, S): (2, 4), (1, 1), (3, 3): m = 8/6 = 4/3.
        // residuals: 4 - 8/3 = 4/3, 1 - 4/3 = -1/3, 3 - 4 = -1; squares sum = 16/9 + 1/9 + 1 = 26/9.
        // Var = 3/2 * 26/9 / 36 = 13/108.
        let se = clustered_se([(2, 4.0), (1, 1.0), (3, 3.0)]).unwrap();
        assert!((se - (13.0f64 / 108.0).sqrt()).abs() < 1e-15, "{se}");
        // Empty clusters are ignored.
        let se2 = clustered_se([(2, 4.0), (0, 0.0), (1, 1.0), (3, 3.0)]).unwrap();
        assert_eq!(se, se2);
        assert_eq!(clustered_se([(5, 1.0), (0, 0.0)]), None);
    }

    #[test]
    fn clustered_with_singletons_equals_llama() {
        let xs = [0.5, 2.25, 3.0, 1.125, 7.5, 0.0625];
        let cl = clustered_se(xs.iter().map(|&x| (1, x))).unwrap();
        let ll = llama_cpp_se(xs.len(), sum(xs), sum(xs.iter().map(|x| x * x))).unwrap();
        assert!((cl - ll).abs() < 1e-14 * ll, "clustered {cl} llama {ll}");
    }
}
