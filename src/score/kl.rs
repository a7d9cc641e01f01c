//! KL divergence against a recorded top-k reference: the per-position
//! comparison and its statistics (overall, per stream, per window, by
//! context length).
//!
//! A reference position holds the reference model's `K` most probable ids
//! with their log-probabilities `ln P_i`, the target's log-probability and
//! `ln P_rest = ln(1 - Σ_i P_i)`. This run supplies, for the same position,
//! its own logits of those `K` ids (the backend's `extra_ids`) and its
//! log-sum-exp, hence `ln Q_i` and `Q_rest = 1 - Σ_i Q_i`. The reported
//! divergence is KL(P || Q) between the two distributions *merged* to `K + 1`
//! outcomes (the `K` ids and one bucket for every other token). Merging
//! outcomes can only lower a KL divergence (data-processing inequality; for
//! the bucket, the log-sum inequality `Σ p ln(p/q) >= (Σp) ln(Σp/Σq)`), so
//! the figure is a **lower bound** of the full-vocabulary KL, equal to it
//! when the top `K` hold all the reference's mass.
//!
//! Numerics ([`kl_merged`]): each outcome contributes
//! `P ln(P/Q) - P + Q = P·φ(ln Q - ln P)` with `φ(d) = e^d - 1 - d >= 0`.
//! When both sides sum to one this is exactly KL (the `-P + Q` terms cancel);
//! when rounding leaves them a hair off it still never goes negative, and two
//! identical inputs give exactly 0. `φ` uses its Taylor series for small `d`
//! so near-identical distributions lose no relative precision.
//! `ln(1 - Σ P_i)` is computed by [`log_rest_mass`] without cancellation.
//!
//! Both sides are compared at the file's precision: this run's
//! log-probabilities are rounded to f32 exactly as the writer rounds them
//! ([`logp_f32`]), so a run compared with its own reference gives KL 0, NLL
//! change 0 and top-1 agreement 1 bit for bit.
//!
//! This module owns no file format (that is `topk`) and no scoring loop.

use serde::{Deserialize, Serialize};

use super::stats::{self, NeumaierSum};

/// Below this `|d|`, `φ(d) = e^d - 1 - d` is evaluated by its Taylor series
/// (`d²/2 + d³/6 + d⁴/24`; the first dropped term is under 1e-22 relative).
const PHI_SERIES_BELOW: f64 = 1e-4;

/// The reference top-1 probability above which a different top-1 here counts
/// as a confident flip.
pub const CONFIDENT_FLIP_P: f64 = 0.95;

/// Context-length buckets: `[0, 1024)`, `[1024, 2048)`, `[2048, 4096)`, ...
pub const FIRST_BUCKET_TOKENS: usize = 1024;

/// The log-probability the top-tokens file stores: `(logit - lse)` rounded
/// to f32. Writer and comparison both go through this one function.
pub fn logp_f32(logit: f64, lse: f64) -> f32 {
    (logit - lse) as f32
}

/// `ln(1 - Σ exp(logps[i]))`, in f64, the log of the probability mass left
/// outside the listed ids.
///
/// - `covers_vocab`: the ids are the whole vocabulary, so the rest is exactly
///   empty: returns `-inf`.
/// - For a listed mass `s <= 1/2`, `ln1p(-s)`; above, `ln(-expm1(ln s))`
///   with `ln s` a log-sum-exp, which keeps full relative precision of a
///   small rest (`1 - s` is never formed by subtraction).
/// - Clamp: when rounding makes the listed mass reach 1 (possible only when
///   the rest is below f64's resolution of a sum near 1), the rest is clamped
///   to [`REST_FLOOR`] (`2^-53`), so the result is always finite and at least
///   `ln 2^-53 ≈ -36.74` unless `covers_vocab`.
/// - Any NaN input gives NaN.
pub fn log_rest_mass(logps: &[f64], covers_vocab: bool) -> f64 {
    if logps.iter().any(|v| v.is_nan()) {
        return f64::NAN;
    }
    if covers_vocab {
        return f64::NEG_INFINITY;
    }
    let m = logps.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return 0.0; // nothing listed: the rest is everything
    }
    let log_s = m + logps.iter().map(|&l| (l - m).exp()).sum::<f64>().ln();
    let rest = if log_s < -std::f64::consts::LN_2 { (-log_s.exp()).ln_1p() } else { (-log_s.exp_m1()).ln() };
    if rest.is_nan() || rest < REST_FLOOR.ln() {
        REST_FLOOR.ln()
    } else {
        rest
    }
}

/// Smallest rest mass [`log_rest_mass`] reports for a vocabulary larger
/// than the listed ids: `2^-53`, half an f64 ulp of 1.
pub const REST_FLOOR: f64 = 1.0 / 9_007_199_254_740_992.0;

/// `φ(d) = e^d - 1 - d`, non-negative, `φ(0) = 0`, `φ(-inf) = +inf`.
pub fn phi(d: f64) -> f64 {
    if d.abs() < PHI_SERIES_BELOW {
        let d2 = d * d;
        d2 * (0.5 + d * (1.0 / 6.0 + d / 24.0))
    } else {
        d.exp_m1() - d
    }
}

/// One outcome's term `P ln(P/Q) - P + Q` from log-probabilities.
fn term(log_p: f64, log_q: f64) -> f64 {
    if log_p == f64::NEG_INFINITY {
        return log_q.exp(); // P = 0: only Q remains (0 when Q = 0 too)
    }
    log_p.exp() * phi(log_q - log_p)
}

/// KL(P || Q) over `K` listed outcomes plus one merged rest bucket, from
/// log-probabilities (see the module doc). `ref_logp` and `own_logq` are
/// aligned (same ids). Non-negative for any inputs; NaN in, NaN out; `+inf`
/// when this run gives probability 0 to an outcome the reference does not.
pub fn kl_merged(ref_logp: &[f64], ref_log_rest: f64, own_logq: &[f64], own_log_rest: f64) -> f64 {
    debug_assert_eq!(ref_logp.len(), own_logq.len());
    let listed: f64 = ref_logp.iter().zip(own_logq).map(|(&p, &q)| term(p, q)).sum();
    listed + term(ref_log_rest, own_log_rest)
}

/// What the reference recorded for one position (log-probabilities as
/// stored, widened to f64 by the caller).
#[derive(Clone, Copy, Debug)]
pub struct ReferencePosition<'a> {
    /// The `K` ids, most probable first.
    pub ids: &'a [u32],
    pub logps: &'a [f32],
    pub target_logp: f32,
    pub log_rest: f32,
}

/// What this run computed for the same position.
#[derive(Clone, Copy, Debug)]
pub struct OwnPosition<'a> {
    /// log Σ exp over this run's logits.
    pub lse: f64,
    pub target_logit: f64,
    /// This run's argmax id (its top-1).
    pub top1: Option<u32>,
    /// This run's logits of `ReferencePosition::ids`, in that order.
    pub extra_logits: &'a [f32],
    /// The ids cover the whole vocabulary (`K == n_vocab`).
    pub covers_vocab: bool,
    /// Tokens before the predicted one in its window.
    pub n_context: usize,
}

/// The comparison at one position.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PositionKl {
    /// The lower bound of KL(reference || this run), nats.
    pub kl: f64,
    /// `Σ P_i` over the reference's listed ids.
    pub reference_top_mass: f64,
    pub same_top1: bool,
    /// Reference top-1 probability above [`CONFIDENT_FLIP_P`] and a different top-1 here.
    pub confident_flip: bool,
    /// This run's target NLL (from the f32-rounded log-probability).
    pub nll: f64,
    /// The reference's target NLL.
    pub reference_nll: f64,
    /// `p(target)` here minus in the reference.
    pub delta_p: f64,
    pub n_context: usize,
}

impl PositionKl {
    /// Target NLL change, `nll - reference_nll` (its mean is ln PPL(Q)/PPL(base)).
    pub fn nll_delta(&self) -> f64 {
        self.nll - self.reference_nll
    }

    /// Every figure finite: the position counts in the sums and quantiles.
    pub fn is_finite(&self) -> bool {
        self.kl.is_finite() && self.nll.is_finite() && self.reference_nll.is_finite() && self.delta_p.is_finite()
    }
}

/// Compares one position. `own.extra_logits` must align with `reference.ids`.
pub fn compare_position(reference: &ReferencePosition, own: &OwnPosition) -> PositionKl {
    let k = reference.ids.len();
    let ref_logp: Vec<f64> = reference.logps.iter().map(|&v| f64::from(v)).collect();
    let own_exact: Vec<f64> = own.extra_logits.iter().map(|&l| f64::from(l) - own.lse).collect();
    let own_logq: Vec<f64> = own.extra_logits.iter().map(|&l| f64::from(logp_f32(f64::from(l), own.lse))).collect();
    let own_log_rest = f64::from(log_rest_mass(&own_exact, own.covers_vocab) as f32);
    let ref_log_rest = f64::from(reference.log_rest);
    let kl = if own_logq.len() == k { kl_merged(&ref_logp, ref_log_rest, &own_logq, own_log_rest) } else { f64::NAN };
    let same_top1 = k > 0 && own.top1 == Some(reference.ids[0]);
    let ref_top1_p = ref_logp.first().map_or(0.0, |l| l.exp());
    let nll = -f64::from(logp_f32(own.target_logit, own.lse));
    let reference_nll = -f64::from(reference.target_logp);
    PositionKl {
        kl,
        reference_top_mass: -ref_log_rest.exp_m1(),
        same_top1,
        confident_flip: ref_top1_p > CONFIDENT_FLIP_P && !same_top1,
        nll,
        reference_nll,
        delta_p: (-nll).exp() - (-reference_nll).exp(),
        n_context: own.n_context,
    }
}

/// Sufficient statistics of a set of positions: enough for every figure of
/// [`KlSummary`] except the quantiles.
#[derive(Clone, Debug, Default)]
pub struct KlMoments {
    /// Positions seen, non-finite ones included.
    pub n: usize,
    /// Positions with a non-finite KL, NLL or Δp (left out of every sum).
    pub n_nonfinite: usize,
    kl: NeumaierSum,
    kl_sq: NeumaierSum,
    top_mass: NeumaierSum,
    n_same_top1: usize,
    n_confident_flips: usize,
    nll: NeumaierSum,
    nll_sq: NeumaierSum,
    reference_nll: NeumaierSum,
    reference_nll_sq: NeumaierSum,
    nll_delta: NeumaierSum,
    nll_delta_sq: NeumaierSum,
    delta_p: NeumaierSum,
    delta_p_sq: NeumaierSum,
    delta_p_4: NeumaierSum,
    /// Per window (cluster): (finite positions, Σ KL, Σ NLL change).
    clusters: Vec<(usize, f64, f64)>,
    open_cluster: (usize, NeumaierSum, NeumaierSum),
}

impl KlMoments {
    pub fn add(&mut self, p: &PositionKl) {
        self.n += 1;
        if !p.is_finite() {
            self.n_nonfinite += 1;
            return;
        }
        self.kl.add(p.kl);
        self.kl_sq.add(p.kl * p.kl);
        self.top_mass.add(p.reference_top_mass);
        self.n_same_top1 += usize::from(p.same_top1);
        self.n_confident_flips += usize::from(p.confident_flip);
        self.nll.add(p.nll);
        self.nll_sq.add(p.nll * p.nll);
        self.reference_nll.add(p.reference_nll);
        self.reference_nll_sq.add(p.reference_nll * p.reference_nll);
        let d = p.nll_delta();
        self.nll_delta.add(d);
        self.nll_delta_sq.add(d * d);
        self.delta_p.add(p.delta_p);
        let dp2 = p.delta_p * p.delta_p;
        self.delta_p_sq.add(dp2);
        self.delta_p_4.add(dp2 * dp2);
        self.open_cluster.0 += 1;
        self.open_cluster.1.add(p.kl);
        self.open_cluster.2.add(d);
    }

    /// Closes the current window's cluster (for the clustered uncertainties).
    pub fn end_window(&mut self) {
        let (n, kl, d) = std::mem::take(&mut self.open_cluster);
        if n > 0 {
            self.clusters.push((n, kl.value(), d.value()));
        }
    }

    /// The values of the sums (for one window: what report.json records).
    pub fn sums(&self) -> KlSums {
        KlSums {
            positions: self.n,
            n_nonfinite: self.n_nonfinite,
            n_same_top1: self.n_same_top1,
            n_confident_flips: self.n_confident_flips,
            kl: self.kl.value(),
            kl_sq: self.kl_sq.value(),
            top_mass: self.top_mass.value(),
            nll: self.nll.value(),
            nll_sq: self.nll_sq.value(),
            reference_nll: self.reference_nll.value(),
            reference_nll_sq: self.reference_nll_sq.value(),
            nll_delta: self.nll_delta.value(),
            nll_delta_sq: self.nll_delta_sq.value(),
            delta_p: self.delta_p.value(),
            delta_p_sq: self.delta_p_sq.value(),
            delta_p_4: self.delta_p_4.value(),
        }
    }

    /// Pools one window's sums into `self`; the window becomes one cluster.
    /// Pooling the windows of a run in order gives the same bits whether
    /// they were scored in one process or merged from shards.
    pub fn add_window(&mut self, w: &KlSums) {
        self.n += w.positions;
        self.n_nonfinite += w.n_nonfinite;
        for (a, b) in [
            (&mut self.kl, w.kl),
            (&mut self.kl_sq, w.kl_sq),
            (&mut self.top_mass, w.top_mass),
            (&mut self.nll, w.nll),
            (&mut self.nll_sq, w.nll_sq),
            (&mut self.reference_nll, w.reference_nll),
            (&mut self.reference_nll_sq, w.reference_nll_sq),
            (&mut self.nll_delta, w.nll_delta),
            (&mut self.nll_delta_sq, w.nll_delta_sq),
            (&mut self.delta_p, w.delta_p),
            (&mut self.delta_p_sq, w.delta_p_sq),
            (&mut self.delta_p_4, w.delta_p_4),
        ] {
            a.add(b);
        }
        self.n_same_top1 += w.n_same_top1;
        self.n_confident_flips += w.n_confident_flips;
        let n_finite = w.positions - w.n_nonfinite;
        if n_finite > 0 {
            self.clusters.push((n_finite, w.kl, w.nll_delta));
        }
    }

    /// Positions with finite figures: the count every mean divides by.
    pub fn n_finite(&self) -> usize {
        self.n - self.n_nonfinite
    }

    /// The statistics without quantiles or context buckets.
    pub fn summary(&self) -> KlSummary {
        let n = self.n_finite();
        let nf = n as f64;
        let mean = |s: &NeumaierSum| if n == 0 { f64::NAN } else { s.value() / nf };
        let kl_mean = mean(&self.kl);
        let sd = (n >= 2).then(|| {
            let var = (self.kl_sq.value() - nf * kl_mean * kl_mean) / (nf - 1.0);
            var.max(0.0).sqrt()
        });
        let p_same = if n == 0 { f64::NAN } else { self.n_same_top1 as f64 / nf };
        let dp_ms = mean(&self.delta_p_sq);
        let clustered = |pick: fn(&(usize, f64, f64)) -> f64| {
            let cl: Vec<(usize, f64)> = self.clusters.iter().map(|c| (c.0, pick(c))).collect();
            stats::clustered_se(cl)
        };
        KlSummary {
            positions: self.n,
            n_nonfinite: self.n_nonfinite,
            mean: kl_mean,
            sd,
            mean_se: stats::llama_cpp_se(n, self.kl.value(), self.kl_sq.value()),
            mean_se_clustered: clustered(|c| c.1),
            quantiles: None,
            mean_reference_top_mass: mean(&self.top_mass),
            top1_agreement: p_same,
            top1_agreement_se: (n >= 2).then(|| (p_same * (1.0 - p_same) / (nf - 1.0)).max(0.0).sqrt()),
            n_confident_flips: self.n_confident_flips,
            mean_nll: mean(&self.nll),
            mean_nll_reference: mean(&self.reference_nll),
            mean_nll_se: stats::llama_cpp_se(n, self.nll.value(), self.nll_sq.value()),
            mean_nll_reference_se: stats::llama_cpp_se(n, self.reference_nll.value(), self.reference_nll_sq.value()),
            mean_nll_delta: mean(&self.nll_delta),
            mean_nll_delta_se: stats::llama_cpp_se(n, self.nll_delta.value(), self.nll_delta_sq.value()),
            mean_nll_delta_se_clustered: clustered(|c| c.2),
            delta_p_mean: mean(&self.delta_p),
            delta_p_rms: dp_ms.sqrt(),
            delta_p_rms_se: stats::llama_cpp_se(n, self.delta_p_sq.value(), self.delta_p_4.value())
                .map(|se| if dp_ms > 0.0 { 0.5 / dp_ms.sqrt() * se } else { 0.0 }),
            by_context: None,
        }
    }
}

/// The sums of one window's positions ([`KlMoments::sums`]), as report.json
/// records them per window (`kl_divergence.sums`): counts and plain f64 sums
/// over the finite positions. Enough to pool windows into every figure of
/// [`KlSummary`] but the quantiles (those need [`KlPositions`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KlSums {
    /// Positions seen, non-finite ones included.
    pub positions: usize,
    pub n_nonfinite: usize,
    pub n_same_top1: usize,
    pub n_confident_flips: usize,
    /// Σ KL and Σ KL².
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub kl: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub kl_sq: f64,
    /// Σ of the reference's listed mass.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub top_mass: f64,
    /// Σ and Σ² of this run's target NLL, of the reference's, and of their difference.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub nll: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub nll_sq: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub reference_nll: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub reference_nll_sq: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub nll_delta: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub nll_delta_sq: f64,
    /// Σ Δp, Σ Δp² and Σ Δp⁴.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub delta_p: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub delta_p_sq: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub delta_p_4: f64,
}

/// One window's per-position KL, for the quantiles: position `j` (its
/// `j`-th scored target) has `first_n_context + j` tokens of context; a
/// position left out of the statistics (a non-finite figure) is NaN.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KlPositions {
    pub first_n_context: usize,
    /// NaN is written as `null` and read back as NaN.
    #[serde(with = "nan_as_null")]
    pub kl: Vec<f32>,
}

/// serde for `Vec<f32>` holding NaN: serde_json writes NaN as `null` but
/// cannot read `null` back as an `f32`.
mod nan_as_null {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
        v.iter().map(|x| (!x.is_nan()).then_some(*x)).collect::<Vec<Option<f32>>>().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f32>, D::Error> {
        Ok(Vec::<Option<f32>>::deserialize(d)?.into_iter().map(|x| x.unwrap_or(f32::NAN)).collect())
    }
}

/// The KL sums of a window's targets in one position bucket
/// (`score::position`, 256 tokens of context each).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlPositionSums {
    pub position_from: usize,
    pub sums: KlSums,
}

/// What a window's comparison leaves besides its [`WindowKl`] record, so its
/// positions pool into every run-wide figure wherever the window was scored
/// (another shard, another worker, an earlier run of `--resume`): every
/// position's KL (quantiles, histogram), its KL sums by position bucket
/// (KL by position in the window), its own largest-KL positions (the run's
/// [`N_WORST_POSITIONS`] are among its windows') and its worst-window entry.
/// report.json keeps it per window only in a shard's report
/// (`windows[].kl_detail`); checkpoints always keep it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlDetail {
    pub positions: KlPositions,
    pub by_position: Vec<KlPositionSums>,
    pub worst_positions: Vec<WorstPosition>,
    pub worst_window: WorstWindow,
}

impl KlPositions {
    /// The value a position contributes: its KL at f32, NaN when excluded.
    pub fn value(p: &PositionKl) -> f32 {
        if p.is_finite() {
            p.kl as f32
        } else {
            f32::NAN
        }
    }
}

/// A window's KL record in report.json (`windows[].kl_divergence`): its
/// statistics (no quantiles, no buckets), its sums, and the sums of each
/// context bucket it has positions in.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WindowKl {
    #[serde(flatten)]
    pub summary: KlSummary,
    pub sums: KlSums,
    pub bucket_sums: Vec<KlBucketSums>,
}

/// The sums of a window's positions in one context bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlBucketSums {
    pub context_from: usize,
    pub context_to: usize,
    pub sums: KlSums,
}

/// Quantiles of the per-position KL, linearly interpolated between order
/// statistics as llama.cpp's `percentile` (`fraction * (n - 1)`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlQuantiles {
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub p50: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub p90: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub p99: f64,
    #[serde(rename = "p99.9", deserialize_with = "crate::util::json::f64_or_nan")]
    pub p99_9: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub max: f64,
}

/// The KL statistics of a set of positions (a window, a stream, a context
/// bucket or the whole run). Means are NaN (serialized `null`) without a
/// finite position; uncertainties `None` when undefined.
///
/// Uncertainties: `*_se` treat positions as independent (llama.cpp's
/// formulas: standard error of a mean, `sqrt(p(1-p)/(n-1))` for the
/// agreement, the delta method for the RMS); `*_se_clustered` are
/// cluster-robust with one cluster per window (see `stats::clustered_se`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlSummary {
    pub positions: usize,
    pub n_nonfinite: usize,
    /// Mean KL lower bound, nats.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub mean: f64,
    /// Standard deviation of the per-position KL.
    pub sd: Option<f64>,
    pub mean_se: Option<f64>,
    pub mean_se_clustered: Option<f64>,
    pub quantiles: Option<KlQuantiles>,
    /// Mean probability mass of the reference's listed ids (how much of the
    /// distribution the bound sees).
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub mean_reference_top_mass: f64,
    /// Share of positions where this run's argmax equals the reference's.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub top1_agreement: f64,
    pub top1_agreement_se: Option<f64>,
    /// Reference top-1 probability > 0.95 and a different top-1 here.
    pub n_confident_flips: usize,
    /// Mean target NLL here (ln PPL(Q)) and in the reference (ln PPL(base)).
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub mean_nll: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub mean_nll_reference: f64,
    pub mean_nll_se: Option<f64>,
    pub mean_nll_reference_se: Option<f64>,
    /// Mean target NLL change = ln(PPL(Q) / PPL(base)).
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub mean_nll_delta: f64,
    pub mean_nll_delta_se: Option<f64>,
    pub mean_nll_delta_se_clustered: Option<f64>,
    /// Mean and RMS of p(target) here minus p(target) in the reference.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub delta_p_mean: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub delta_p_rms: f64,
    pub delta_p_rms_se: Option<f64>,
    /// The same statistics by context length (tokens before the predicted
    /// one): `[0, 1024)`, `[1024, 2048)`, `[2048, 4096)`, ... (non-empty only).
    pub by_context: Option<Vec<KlBucket>>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlBucket {
    /// Context lengths `context_from <= n < context_to`.
    pub context_from: usize,
    pub context_to: usize,
    #[serde(flatten)]
    pub summary: KlSummary,
}

/// The context bucket of `n_context` and its bounds.
pub fn context_bucket(n_context: usize) -> (usize, usize, usize) {
    let b = if n_context < FIRST_BUCKET_TOKENS { 0 } else { (n_context / FIRST_BUCKET_TOKENS).ilog2() as usize + 1 };
    let (from, to) = bucket_bounds(b);
    (b, from, to)
}

/// Bounds `[from, to)` of context bucket `b`.
fn bucket_bounds(b: usize) -> (usize, usize) {
    (if b == 0 { 0 } else { FIRST_BUCKET_TOKENS << (b - 1) }, FIRST_BUCKET_TOKENS << b)
}

/// Moments plus every finite per-position KL (f32, 4 bytes a position) for
/// the quantiles.
#[derive(Clone, Debug, Default)]
pub struct KlSample {
    pub moments: KlMoments,
    kl: Vec<f32>,
}

impl KlSample {
    pub fn add(&mut self, p: &PositionKl) {
        self.moments.add(p);
        if p.is_finite() {
            self.kl.push(p.kl as f32);
        }
    }

    pub fn end_window(&mut self) {
        self.moments.end_window();
    }

    /// Pools one window: its sums and its positions' KLs (NaN ones left out).
    pub fn add_window(&mut self, sums: &KlSums, kl: impl IntoIterator<Item = f32>) {
        self.moments.add_window(sums);
        self.kl.extend(kl.into_iter().filter(|v| !v.is_nan()));
    }

    pub fn quantiles(&self) -> Option<KlQuantiles> {
        let mut v = self.kl.clone();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f32::total_cmp);
        let at = |f: f64| {
            let x = f * (v.len() - 1) as f64;
            let i = x.floor() as usize;
            let frac = x - i as f64;
            let lo = f64::from(v[i]);
            let hi = f64::from(v[(i + 1).min(v.len() - 1)]);
            (1.0 - frac) * lo + frac * hi
        };
        Some(KlQuantiles { p50: at(0.5), p90: at(0.9), p99: at(0.99), p99_9: at(0.999), max: f64::from(v[v.len() - 1]) })
    }

    pub fn summary(&self) -> KlSummary {
        KlSummary { quantiles: self.quantiles(), ..self.moments.summary() }
    }
}

/// The positions of a stream or of the run: all of them and by context bucket.
#[derive(Clone, Debug, Default)]
pub struct KlAccumulator {
    pub all: KlSample,
    /// Indexed by [`context_bucket`]'s first value.
    pub buckets: Vec<KlSample>,
}

impl KlAccumulator {
    pub fn add(&mut self, p: &PositionKl) {
        self.all.add(p);
        let (b, _, _) = context_bucket(p.n_context);
        if self.buckets.len() <= b {
            self.buckets.resize_with(b + 1, KlSample::default);
        }
        self.buckets[b].add(p);
    }

    /// Closes the current window in every sample (each window is one cluster).
    pub fn end_window(&mut self) {
        self.all.end_window();
        self.buckets.iter_mut().for_each(KlSample::end_window);
    }

    /// The record of the one window this accumulator saw (after
    /// [`end_window`](Self::end_window)): statistics without quantiles or
    /// buckets, the sums, and the sums of each non-empty bucket.
    pub fn window_record(&self) -> WindowKl {
        let bucket_sums = self
            .buckets
            .iter()
            .enumerate()
            .filter(|(_, s)| s.moments.n > 0)
            .map(|(b, s)| {
                let (from, to) = bucket_bounds(b);
                KlBucketSums { context_from: from, context_to: to, sums: s.moments.sums() }
            })
            .collect();
        WindowKl { summary: self.all.moments.summary(), sums: self.all.moments.sums(), bucket_sums }
    }

    /// Pools one window's record and its positions (a stream's or the run's
    /// statistics are their windows', pooled in order).
    pub fn add_window(&mut self, w: &WindowKl, positions: &KlPositions) {
        self.all.add_window(&w.sums, positions.kl.iter().copied());
        for b in &w.bucket_sums {
            let (i, _, _) = context_bucket(b.context_from);
            if self.buckets.len() <= i {
                self.buckets.resize_with(i + 1, KlSample::default);
            }
            let in_bucket = positions
                .kl
                .iter()
                .enumerate()
                .filter(|(j, _)| context_bucket(positions.first_n_context + j).0 == i)
                .map(|(_, &v)| v);
            self.buckets[i].add_window(&b.sums, in_bucket);
        }
    }

    /// Full statistics: quantiles and the non-empty context buckets.
    pub fn summary(&self) -> KlSummary {
        let by_context = self
            .buckets
            .iter()
            .enumerate()
            .filter(|(_, s)| s.moments.n > 0)
            .map(|(b, s)| {
                let (from, to) = bucket_bounds(b);
                KlBucket { context_from: from, context_to: to, summary: s.summary() }
            })
            .collect();
        KlSummary { by_context: Some(by_context), ..self.all.summary() }
    }
}

/// Positions with the largest KL the report names.
pub const N_WORST_POSITIONS: usize = 50;

/// Windows with the largest mean KL the report names.
pub const N_WORST_WINDOWS: usize = 20;

/// One of a run's largest-KL positions, with what moved there.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorstPosition {
    pub kl: f64,
    pub stream: String,
    pub window: usize,
    /// Index in the stream of the predicted token.
    pub token_index: usize,
    /// Tokens before it in its window.
    pub n_context: usize,
    /// The reference's most probable ids (at most 3): `[id, reference p, this run's p]`.
    pub reference_top: Vec<(u32, f64, f64)>,
    /// This run's most probable id.
    pub top1: Option<u32>,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub nll: f64,
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub reference_nll: f64,
    /// The decoded text around it, the predicted token in `[[ ]]` (`report::worst`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The decoded text of each `reference_top` id, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reference_top_text: Vec<String>,
}

/// One of a run's windows with the largest mean KL.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorstWindow {
    /// Mean KL of the window's finite positions.
    pub mean_kl: f64,
    pub stream: String,
    pub window: usize,
    pub begin: usize,
    pub end: usize,
    pub scored: usize,
    /// The window's largest KL and the stream index of its predicted token.
    pub max_kl: f64,
    pub max_kl_token_index: usize,
    /// Mean target NLL change against the reference, nats.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub mean_nll_delta: f64,
    /// The decoded text around `max_kl_token_index` (`report::worst`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// What [`keep_worst`] ranks by.
pub trait Ranked {
    fn rank_key(&self) -> f64;
}

impl Ranked for WorstPosition {
    fn rank_key(&self) -> f64 {
        self.kl
    }
}

impl Ranked for WorstWindow {
    fn rank_key(&self) -> f64 {
        self.mean_kl
    }
}

/// Keeps `worst` the `n` largest finite, positive keys seen, largest first
/// (the earlier entry first among equals). `make` builds the entry only
/// when it is kept.
pub fn keep_worst<T: Ranked>(worst: &mut Vec<T>, n: usize, kl: f64, make: impl FnOnce() -> T) {
    if !(kl.is_finite() && kl > 0.0) || (worst.len() >= n && worst.last().is_some_and(|w| w.rank_key() >= kl)) {
        return;
    }
    let at = worst.partition_point(|w| w.rank_key() >= kl);
    worst.insert(at, make());
    worst.truncate(n);
}

/// A figure as llama.cpp prints it (`%10.6f`), or in scientific notation
/// when that would show only zeros (KLs of a lossless route are ~1e-11).
fn fixed_or_sci(v: f64, width: usize, decimals: usize) -> String {
    if v != 0.0 && v.abs() < 0.5 * 10f64.powi(-(decimals as i32)) * 100.0 {
        format!("{v:width$.3e}")
    } else {
        format!("{v:width$.decimals$}")
    }
}

/// llama.cpp-style summary lines (`llama-perplexity --kl-divergence`), for
/// stderr. Values too small for llama.cpp's fixed format are printed in
/// scientific notation.
pub fn summary_lines(s: &KlSummary, k: usize) -> Vec<String> {
    let f6 = |v: f64| fixed_or_sci(v, 10, 6);
    let pm6 = |v: Option<f64>| v.map_or("-".to_string(), f6);
    let pct = |v: f64| fixed_or_sci(100.0 * v, 6, 3);
    let pm_pct = |v: Option<f64>| v.map_or("-".to_string(), pct);
    let ppl_q = s.mean_nll.exp();
    let ppl_b = s.mean_nll_reference.exp();
    let mut out = vec![
        format!("====== KL divergence (lower bound: reference top-{k} + one bucket for the rest) ======"),
        format!("Mean PPL(Q)                   : {} ± {}", f6(ppl_q), pm6(s.mean_nll_se.map(|se| se * ppl_q))),
        format!("Mean PPL(base)                : {} ± {}", f6(ppl_b), pm6(s.mean_nll_reference_se.map(|se| se * ppl_b))),
        format!("Mean ln(PPL(Q)/PPL(base))     : {} ± {}", f6(s.mean_nll_delta), pm6(s.mean_nll_delta_se)),
        format!("Mean    KLD: {} ± {}", f6(s.mean), pm6(s.mean_se)),
    ];
    if let Some(q) = &s.quantiles {
        out.push(format!("Maximum KLD: {}", f6(q.max)));
        out.push(format!("99.9%   KLD: {}", f6(q.p99_9)));
        out.push(format!("99.0%   KLD: {}", f6(q.p99)));
        out.push(format!("90.0%   KLD: {}", f6(q.p90)));
        out.push(format!("Median  KLD: {}", f6(q.p50)));
    }
    out.push(format!("Mean    Δp: {} %", pct(s.delta_p_mean)));
    out.push(format!("RMS Δp    : {} ± {} %", pct(s.delta_p_rms), pm_pct(s.delta_p_rms_se)));
    out.push(format!("Same top p: {} ± {} %", pct(s.top1_agreement), pm_pct(s.top1_agreement_se)));
    out.push(format!(
        "Confident flips (reference top-1 p > {CONFIDENT_FLIP_P}): {} of {} positions",
        s.n_confident_flips, s.positions
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Full-vocabulary KL(p || q) in f64, the brute force.
    fn kl_full(p: &[f64], q: &[f64]) -> f64 {
        p.iter().zip(q).filter(|(&pi, _)| pi > 0.0).map(|(&pi, &qi)| pi * (pi / qi).ln()).sum()
    }

    fn softmax(logits: &[f64]) -> Vec<f64> {
        let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        logits.iter().map(|l| (l - m).exp() / s).collect()
    }

    /// The bound from two full distributions: the top-k of `p`, their q's,
    /// and the rest buckets, through the same code paths the run uses.
    fn kl_bound(p: &[f64], q: &[f64], k: usize) -> f64 {
        let mut ids: Vec<usize> = (0..p.len()).collect();
        ids.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        ids.truncate(k);
        let covers = k == p.len();
        let lp: Vec<f64> = ids.iter().map(|&i| p[i].ln()).collect();
        let lq: Vec<f64> = ids.iter().map(|&i| q[i].ln()).collect();
        kl_merged(&lp, log_rest_mass(&lp, covers), &lq, log_rest_mass(&lq, covers))
    }

    #[test]
    fn phi_series_and_closed_form_agree_at_the_switch() {
        for d in [PHI_SERIES_BELOW * 0.999, -PHI_SERIES_BELOW * 0.999] {
            let series = phi(d);
            let closed = d.exp_m1() - d;
            assert!((series - closed).abs() <= 1e-9 * closed, "{d}: {series} vs {closed}");
        }
        assert_eq!(phi(0.0), 0.0);
        assert_eq!(phi(f64::NEG_INFINITY), f64::INFINITY);
        // d = 1e-8: φ = 5e-17 (+ 1.7e-25), full precision.
        assert!((phi(1e-8) / 5e-17 - 1.0).abs() < 1e-8);
    }

    #[test]
    fn hand_computed_two_outcomes() {
        // P = (0.5, 0.5), Q = (0.25, 0.75), K = 1: listed id 0, rest id 1.
        // KL = 0.5 ln 2 + 0.5 ln(2/3).
        let lp = [0.5f64.ln()];
        let lq = [0.25f64.ln()];
        let kl = kl_merged(&lp, log_rest_mass(&lp, false), &lq, log_rest_mass(&lq, false));
        let exact = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
        assert!((kl - exact).abs() < 1e-15, "{kl} vs {exact}");
    }

    #[test]
    fn rest_mass_keeps_precision_near_one() {
        // Listed mass 1 - 1e-12: the rest is 1e-12 to ~1e-4 relative.
        let lp = [(0.5f64).ln(), (0.5 - 1e-12f64).ln()];
        let r = log_rest_mass(&lp, false).exp();
        assert!((r / 1e-12 - 1.0).abs() < 1e-3, "{r}");
        // Small listed mass: ln1p branch.
        assert!((log_rest_mass(&[0.1f64.ln()], false) - 0.9f64.ln()).abs() < 1e-15);
        // Mass rounding to 1 clamps to the floor; the whole vocabulary gives -inf.
        assert_eq!(log_rest_mass(&[0.0], false), REST_FLOOR.ln());
        assert_eq!(log_rest_mass(&[0.5f64.ln(), 0.5f64.ln()], true), f64::NEG_INFINITY);
        assert!(log_rest_mass(&[f64::NAN], false).is_nan());
        assert_eq!(log_rest_mass(&[], false), 0.0);
    }

    #[test]
    fn identical_inputs_give_exactly_zero() {
        let p = softmax(&[3.0, 1.0, 0.5, -2.0, 0.0, 7.0]);
        assert_eq!(kl_bound(&p, &p, 3), 0.0);
        assert_eq!(kl_bound(&p, &p, 6), 0.0);
    }

    #[test]
    fn a_zero_in_q_where_p_has_mass_is_infinite() {
        let kl = kl_merged(&[0.0], f64::NEG_INFINITY, &[f64::NEG_INFINITY], 0.0);
        assert_eq!(kl, f64::INFINITY);
        assert!(kl_merged(&[f64::NAN], 0.0, &[0.0], 0.0).is_nan());
    }

    fn logits(n: usize) -> impl Strategy<Value = Vec<f64>> {
        proptest::collection::vec(-8.0f64..8.0, n)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// The bound never exceeds the full KL, and equals it when the top-k
        /// covers the vocabulary.
        #[test]
        fn bound_holds_and_is_tight_when_k_covers(
            (lp, lq, k) in (2usize..40).prop_flat_map(|n| (logits(n), logits(n), 1..=n)),
            sharpen in 0.2f64..6.0,
        ) {
            let p = softmax(&lp.iter().map(|x| x * sharpen).collect::<Vec<_>>());
            let q = softmax(&lq);
            let full = kl_full(&p, &q);
            let bound = kl_bound(&p, &q, k);
            prop_assert!(bound >= 0.0);
            // The rest buckets come from the listed masses (1 - s is never
            // formed, but s near 1 is only known to an ulp): ln(rest) carries
            // an error of about eps / rest, so the rest term p_rest ln(p_rest / q_rest)
            // can exceed its exact value by about eps (1 + p_rest / q_rest).
            let mut top: Vec<usize> = (0..p.len()).collect();
            top.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let rest = |d: &[f64]| top[k..].iter().map(|&i| d[i]).sum::<f64>();
            let (p_rest, q_rest) = (rest(&p), rest(&q));
            let rest_err = if k < p.len() { 8.0 * f64::EPSILON * (1.0 + p_rest / q_rest) } else { 0.0 };
            prop_assert!(bound <= full + 1e-12 * full.max(1.0) + rest_err, "bound {} > full {} (rest p {}, q {})", bound, full, p_rest, q_rest);
            let all = kl_bound(&p, &q, p.len());
            prop_assert!((all - full).abs() <= 1e-12 * full.max(1.0), "k = n: {} vs {}", all, full);
        }

        /// Nearby distributions (KL down to ~1e-17): the bound with full
        /// coverage matches the second-order expansion `eps²/2 · Var_p(b)`
        /// of KL(p || softmax(l + eps·b)) to its third-order remainder, so no
        /// precision is lost to cancellation; a smaller top-k stays below it.
        #[test]
        fn nearby_distributions_keep_precision(lp in logits(30), b in logits(30), eps in 1e-9f64..1e-4) {
            let p = softmax(&lp);
            let q = softmax(&lp.iter().zip(&b).map(|(x, y)| x + eps * y).collect::<Vec<_>>());
            let mean_b: f64 = p.iter().zip(&b).map(|(pi, bi)| pi * bi).sum();
            let var_b: f64 = p.iter().zip(&b).map(|(pi, bi)| pi * (bi - mean_b).powi(2)).sum();
            let second_order = 0.5 * eps * eps * var_b;
            let bound = kl_bound(&p, &q, 30);
            // Third-order term relative to the second: below eps * max|b - mean| <= 16 eps.
            prop_assert!((bound / second_order - 1.0).abs() <= 20.0 * eps + 1e-6, "{} vs {}", bound, second_order);
            prop_assert!(kl_bound(&p, &q, 10) <= bound * (1.0 + 1e-9));
        }
    }

    #[test]
    fn compare_position_self_is_zero_and_flips_are_counted() {
        // Own logits (0, ln 2, ln 5) on a 3-token vocabulary, reference = same, K = 2.
        let logits = [0f32, 2f32.ln(), 5f32.ln()];
        let lse = 8f64.ln();
        let ids = [2u32, 1];
        let exact: Vec<f64> = ids.iter().map(|&i| f64::from(logits[i as usize]) - lse).collect();
        let logps: Vec<f32> = ids.iter().map(|&i| logp_f32(f64::from(logits[i as usize]), lse)).collect();
        let r = ReferencePosition {
            ids: &ids,
            logps: &logps,
            target_logp: logp_f32(f64::from(logits[1]), lse),
            log_rest: log_rest_mass(&exact, false) as f32,
        };
        let extra = [logits[2], logits[1]];
        let own = OwnPosition {
            lse,
            target_logit: f64::from(logits[1]),
            top1: Some(2),
            extra_logits: &extra,
            covers_vocab: false,
            n_context: 5,
        };
        let c = compare_position(&r, &own);
        assert_eq!((c.kl, c.nll_delta(), c.delta_p, c.same_top1, c.confident_flip), (0.0, 0.0, 0.0, true, false));
        assert!((c.reference_top_mass - 7.0 / 8.0).abs() < 1e-6);
        // Another top-1 here: a flip, but not a confident one (reference top-1 p = 5/8).
        let c2 = compare_position(&r, &OwnPosition { top1: Some(1), ..own });
        assert!(!c2.same_top1 && !c2.confident_flip);
    }

    /// A position of the hand-computed tests: top mass 0.9, reference NLL 1,
    /// a confident flip whenever the top-1 differs.
    fn pos(kl: f64, nll: f64, same: bool, n_context: usize) -> PositionKl {
        PositionKl {
            kl,
            reference_top_mass: 0.9,
            same_top1: same,
            confident_flip: !same,
            nll,
            reference_nll: 1.0,
            delta_p: (-nll).exp() - (-1.0f64).exp(),
            n_context,
        }
    }

    #[test]
    fn moments_hand_computed() {
        let mut acc = KlAccumulator::default();
        acc.add(&pos(1.0, 1.0, true, 0));
        acc.add(&pos(3.0, 2.0, false, 1500));
        acc.end_window();
        acc.add(&pos(2.0, 1.5, true, 5000));
        acc.add(&pos(f64::NAN, 1.0, true, 5000));
        acc.end_window();
        let s = acc.summary();
        assert_eq!((s.positions, s.n_nonfinite, s.n_confident_flips), (4, 1, 1));
        assert_eq!(s.mean, 2.0);
        assert_eq!(s.sd, Some(1.0)); // values 1, 3, 2: sample variance 1
        assert!((s.top1_agreement - 2.0 / 3.0).abs() < 1e-15);
        assert!((s.mean_nll_delta - 0.5).abs() < 1e-15); // deltas 0, 1, 0.5
        let q = s.quantiles.unwrap();
        assert_eq!((q.p50, q.max), (2.0, 3.0));
        assert!((q.p90 - 2.8).abs() < 1e-12); // 0.9 * 2 = 1.8 -> 2 + 0.8 * 1
        let b = s.by_context.unwrap();
        assert_eq!(b.iter().map(|b| (b.context_from, b.context_to, b.summary.positions)).collect::<Vec<_>>(),
            vec![(0, 1024, 1), (1024, 2048, 1), (4096, 8192, 2)]);
        // Two windows: (2, 4) and (1, 2) -> clustered SE defined.
        assert!(s.mean_se_clustered.is_some());
    }

    #[test]
    fn pooling_window_records_gives_the_hand_figures() {
        // The positions of `moments_hand_computed`, one accumulator per window,
        // pooled through the records report.json keeps (sums and per-position KLs).
        let windows = [vec![pos(1.0, 1.0, true, 0), pos(3.0, 2.0, false, 1500)], vec![pos(2.0, 1.5, true, 5000), pos(f64::NAN, 1.0, true, 5001)]];
        let mut pooled = KlAccumulator::default();
        for w in &windows {
            let mut acc = KlAccumulator::default();
            for p in w {
                acc.add(p);
            }
            acc.end_window();
            let record = acc.window_record();
            let positions = KlPositions { first_n_context: w[0].n_context, kl: w.iter().map(KlPositions::value).collect() };
            // Contexts here are not consecutive: bucket each position by its own context.
            let mut by_own = KlAccumulator::default();
            by_own.all.add_window(&record.sums, positions.kl.iter().copied());
            for b in &record.bucket_sums {
                let (i, _, _) = context_bucket(b.context_from);
                if by_own.buckets.len() <= i {
                    by_own.buckets.resize_with(i + 1, KlSample::default);
                }
                let vals = w.iter().filter(|p| context_bucket(p.n_context).0 == i).map(KlPositions::value);
                by_own.buckets[i].add_window(&b.sums, vals);
            }
            pooled.all.add_window(&record.sums, positions.kl.iter().copied());
            if pooled.buckets.len() < by_own.buckets.len() {
                pooled.buckets.resize_with(by_own.buckets.len(), KlSample::default);
            }
            for (a, b) in pooled.buckets.iter_mut().zip(&by_own.buckets) {
                if b.moments.n > 0 {
                    a.add_window(&b.moments.sums(), b.kl.iter().copied());
                }
            }
        }
        let s = pooled.summary();
        assert_eq!((s.positions, s.n_nonfinite, s.n_confident_flips), (4, 1, 1));
        assert_eq!((s.mean, s.sd), (2.0, Some(1.0)));
        let q = s.quantiles.unwrap();
        assert_eq!((q.p50, q.max), (2.0, 3.0));
        assert!(s.mean_se_clustered.is_some());
        let b = s.by_context.unwrap();
        assert_eq!(b.iter().map(|b| (b.context_from, b.summary.positions)).collect::<Vec<_>>(), vec![(0, 1), (1024, 1), (4096, 2)]);
    }

    #[test]
    fn consecutive_positions_pool_by_bucket() {
        // A window of 4 positions at contexts 1022..1026 straddles buckets 0 and 1.
        let p = |kl: f64, n_context: usize| PositionKl {
            kl,
            reference_top_mass: 1.0,
            same_top1: true,
            confident_flip: false,
            nll: 1.0,
            reference_nll: 1.0,
            delta_p: 0.0,
            n_context,
        };
        let ps = [p(0.5, 1022), p(1.5, 1023), p(2.5, 1024), p(3.5, 1025)];
        let mut direct = KlAccumulator::default();
        for q in &ps {
            direct.add(q);
        }
        direct.end_window();
        let record = direct.window_record();
        assert_eq!(record.bucket_sums.iter().map(|b| (b.context_from, b.sums.positions)).collect::<Vec<_>>(), vec![(0, 2), (1024, 2)]);
        let mut pooled = KlAccumulator::default();
        pooled.add_window(&record, &KlPositions { first_n_context: 1022, kl: ps.iter().map(KlPositions::value).collect() });
        let (a, b) = (direct.summary(), pooled.summary());
        assert_eq!(a, b, "one window pooled through its record equals the window itself");
    }

    #[test]
    fn small_figures_switch_to_scientific() {
        assert_eq!(fixed_or_sci(0.0, 10, 6), "  0.000000");
        assert_eq!(fixed_or_sci(0.017475, 10, 6), "  0.017475");
        assert_eq!(fixed_or_sci(8.5e-12, 10, 6), " 8.500e-12");
        assert_eq!(fixed_or_sci(100.0, 6, 3), "100.000");
        assert_eq!(fixed_or_sci(8.3e-5, 6, 3), "8.300e-5");
    }

    #[test]
    fn worst_positions_keep_the_largest_in_order() {
        let entry = |kl: f64, window: usize| WorstPosition {
            kl,
            stream: "s".into(),
            window,
            token_index: window,
            n_context: 0,
            reference_top: Vec::new(),
            top1: None,
            nll: 0.0,
            reference_nll: 0.0,
            text: None,
            reference_top_text: Vec::new(),
        };
        let mut worst = Vec::new();
        for (i, kl) in [0.1, 0.0, 0.5, f64::NAN, 0.3, 0.5, f64::INFINITY, 0.2, 0.05].into_iter().enumerate() {
            keep_worst(&mut worst, 3, kl, || entry(kl, i));
        }
        let got: Vec<(f64, usize)> = worst.iter().map(|w| (w.kl, w.window)).collect();
        assert_eq!(got, vec![(0.5, 2), (0.5, 5), (0.3, 4)]);
        // Zero and non-finite KLs are never listed; a smaller one is not built.
        keep_worst(&mut worst, 3, 0.25, || panic!("must not be built"));
        let mut none = Vec::new();
        keep_worst(&mut none, 3, 0.0, || entry(0.0, 0));
        assert!(none.is_empty());
    }

    #[test]
    fn buckets_double() {
        assert_eq!(context_bucket(0), (0, 0, 1024));
        assert_eq!(context_bucket(1023), (0, 0, 1024));
        assert_eq!(context_bucket(1024), (1, 1024, 2048));
        assert_eq!(context_bucket(4095), (2, 2048, 4096));
        assert_eq!(context_bucket(4096), (3, 4096, 8192));
        assert_eq!(context_bucket(131_071), (7, 65_536, 131_072));
    }
}
