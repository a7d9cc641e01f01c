//! `--plots`: SVG charts beside report.json, and `compare --plots DIR`'s
//! chart of per-window NLL differences, drawn with `plotters` (SVG backend).
//!
//! Every interval drawn is a 95 % interval from the report's own standard
//! errors (normal quantile 1.96; `compare`'s uses its t quantile), on the
//! scale the statistic is estimated on: perplexity intervals are
//! `exp(mean NLL ± 1.96·se)` (asymmetric), so a bar never dips below zero.
//! A point without a bar has no uncertainty (a bucket only one window
//! reaches). This module draws what the report holds; it computes no
//! statistics of its own beyond the interval ends and the histogram's bins.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use super::{Results, DomainResult};
use crate::score::position::PositionBucket;
use crate::score::Summary;

/// The normal quantile of a two-sided 95 % interval.
const Z95: f64 = 1.959_963_984_540_054;

const SIZE: (u32, u32) = (960, 560);
const FONT: &str = "sans-serif";
const POINT: RGBColor = RGBColor(31, 119, 180);
const OVERALL: RGBColor = RGBColor(214, 39, 40);
const BAND: RGBColor = RGBColor(255, 187, 120);

pub const PPL_BY_DOMAIN: &str = "ppl_by_domain.svg";
pub const PPL_BY_POSITION: &str = "ppl_by_position.svg";
pub const KL_BY_POSITION: &str = "kl_by_position.svg";
pub const KL_HISTOGRAM: &str = "kl_histogram.svg";
pub const WINDOW_DIFFERENCES: &str = "window_nll_differences.svg";

/// A value with its 95 % interval (`None`: no uncertainty).
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    pub value: f64,
    pub ci: Option<(f64, f64)>,
}

impl Estimate {
    /// Perplexity with `exp(mean ± 1.96·se)` from a summary's clustered SE.
    pub fn perplexity(s: &Summary) -> Self {
        Self {
            value: s.perplexity,
            ci: s.mean_nll_se_clustered.map(|se| ((s.mean_nll - Z95 * se).exp(), (s.mean_nll + Z95 * se).exp())),
        }
    }

    /// `mean ± 1.96·se`.
    pub fn mean(mean: f64, se: Option<f64>) -> Self {
        Self { value: mean, ci: se.map(|se| (mean - Z95 * se, mean + Z95 * se)) }
    }

    fn hi(&self) -> f64 {
        self.ci.map_or(self.value, |c| c.1)
    }

    fn lo(&self) -> f64 {
        self.ci.map_or(self.value, |c| c.0)
    }
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

fn draw_svg(draw: impl FnOnce(&Area<'_>) -> Result<()>) -> Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).context("plot: fill")?;
        draw(&root)?;
        root.present().context("plot: finish the SVG")?;
    }
    Ok(svg)
}

/// The legend box every chart uses.
fn legend<'a, 'b: 'a, CT: plotters::coord::CoordTranslate>(chart: &mut ChartContext<'a, SVGBackend<'b>, CT>, at: SeriesLabelPosition) -> Result<()> {
    chart
        .configure_series_labels()
        .position(at)
        .label_font((FONT, 15))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .context("plot: legend")?;
    Ok(())
}

/// Upper end of a y axis from 0 that holds `hi` with some room.
fn y_top(hi: f64) -> f64 {
    if hi.is_finite() && hi > 0.0 {
        hi * 1.12
    } else {
        1.0
    }
}

/// A tick label: plain for ordinary magnitudes, scientific for tiny or huge ones.
fn tick(v: f64) -> String {
    let a = v.abs();
    if v == 0.0 {
        "0".into()
    } else if !(1e-2..1e5).contains(&a) {
        format!("{v:.1e}")
    } else if a < 1.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.1}")
    }
}

/// Perplexity by domain, then the overall figure, each with its interval.
pub fn ppl_by_domain(domains: &[DomainResult], overall: Option<&Summary>) -> Result<String> {
    let mut rows: Vec<(String, Estimate, bool)> =
        domains.iter().map(|d| (d.domain.clone(), Estimate::perplexity(&d.summary), false)).collect();
    if let Some(o) = overall {
        rows.push(("overall".into(), Estimate::perplexity(o), true));
    }
    let rows: Vec<_> = rows.into_iter().filter(|r| r.1.value.is_finite()).collect();
    let n = rows.len().max(1);
    let top = y_top(rows.iter().map(|r| r.1.hi()).fold(0.0, f64::max));
    draw_svg(|root| {
        let mut chart = ChartBuilder::on(root)
            .caption("Perplexity by domain (95 % interval, clustered by window)", (FONT, 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(72)
            .build_cartesian_2d((0..n as i32 - 1).into_segmented(), 0.0..top)
            .context("plot: axes")?;
        let names: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n)
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => names.get(*i as usize).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .y_label_formatter(&|v| tick(*v))
            .x_desc("domain (overall, in red: every domain pooled)")
            .y_desc("perplexity per token")
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 16))
            .draw()
            .context("plot: mesh")?;
        // No legend: the x axis names each point, and a legend box would hide the tallest bars.
        for (is_overall, color) in [(false, POINT), (true, OVERALL)] {
            let pick: Vec<(i32, &Estimate)> =
                rows.iter().enumerate().filter(|(_, r)| r.2 == is_overall).map(|(i, r)| (i as i32, &r.1)).collect();
            if pick.is_empty() {
                continue;
            }
            chart
                .draw_series(pick.iter().filter_map(|(i, e)| {
                    e.ci.map(|(lo, hi)| ErrorBar::new_vertical(SegmentValue::CenterOf(*i), lo, e.value, hi, color.stroke_width(2), 14))
                }))
                .context("plot: error bars")?;
            chart
                .draw_series(pick.iter().map(|(i, e)| Circle::new((SegmentValue::CenterOf(*i), e.value), 5, color.filled())))
                .context("plot: points")?;
        }
        Ok(())
    })
}

/// One statistic by position bucket: points joined by a line, with bars.
fn by_position(caption: &str, y_desc: &str, points: &[(f64, Estimate)], x_max: f64, label: &str) -> Result<String> {
    let top = y_top(points.iter().map(|p| p.1.hi()).fold(0.0, f64::max));
    let bottom = points.iter().map(|p| p.1.lo()).fold(0.0, f64::min);
    draw_svg(|root| {
        let mut chart = ChartBuilder::on(root)
            .caption(caption, (FONT, 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(80)
            .build_cartesian_2d(0.0..x_max, bottom..top)
            .context("plot: axes")?;
        chart
            .configure_mesh()
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| tick(*v))
            .x_desc("tokens of context before the target (buckets of 256; point at the bucket's middle)")
            .y_desc(y_desc)
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 16))
            .draw()
            .context("plot: mesh")?;
        chart
            .draw_series(LineSeries::new(points.iter().map(|p| (p.0, p.1.value)), POINT.stroke_width(2)))
            .context("plot: line")?
            .label(label)
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], POINT.stroke_width(2)));
        chart
            .draw_series(points.iter().filter_map(|(x, e)| e.ci.map(|(lo, hi)| ErrorBar::new_vertical(*x, lo, e.value, hi, POINT.stroke_width(1), 10))))
            .context("plot: error bars")?
            .label("95 % interval, clustered by window (none: one window)")
            .legend(|(x, y)| PathElement::new(vec![(x + 10, y - 6), (x + 10, y + 6)], POINT.stroke_width(1)));
        chart.draw_series(points.iter().map(|(x, e)| Circle::new((*x, e.value), 4, POINT.filled()))).context("plot: points")?;
        legend(&mut chart, SeriesLabelPosition::LowerRight)?;
        Ok(())
    })
}

fn bucket_x(b: &PositionBucket) -> f64 {
    (b.position_from + b.position_to) as f64 / 2.0
}

fn x_max(buckets: &[PositionBucket]) -> f64 {
    buckets.iter().map(|b| b.position_to).max().unwrap_or(256) as f64
}

/// Perplexity by position in the window.
pub fn ppl_by_position(buckets: &[PositionBucket]) -> Result<String> {
    let points: Vec<(f64, Estimate)> =
        buckets.iter().filter(|b| b.nll.perplexity.is_finite()).map(|b| (bucket_x(b), Estimate::perplexity(&b.nll))).collect();
    by_position("Perplexity by position in the window", "perplexity per token", &points, x_max(buckets), "perplexity of the bucket's targets")
}

/// Mean KL against the reference by position in the window (`None` without KL).
pub fn kl_by_position(buckets: &[PositionBucket]) -> Option<Result<String>> {
    let points: Vec<(f64, Estimate)> = buckets
        .iter()
        .filter_map(|b| b.kl_divergence.as_ref().map(|k| (bucket_x(b), Estimate::mean(k.mean, k.mean_se_clustered))))
        .filter(|p| p.1.value.is_finite())
        .collect();
    (!points.is_empty()).then(|| {
        by_position(
            "KL divergence from the reference by position in the window",
            "mean KL per position (nats, lower bound)",
            &points,
            x_max(buckets),
            "mean KL of the bucket's positions",
        )
    })
}

/// Bins of `log10 KL` for the histogram: (left edge, count), and the bin width.
pub fn log_histogram(kl: &[f32], n_bins: usize) -> (Vec<(f64, usize)>, f64) {
    let logs: Vec<f64> = kl.iter().filter(|v| v.is_finite() && **v > 0.0).map(|&v| f64::from(v).log10()).collect();
    if logs.is_empty() {
        return (Vec::new(), 1.0);
    }
    let lo = logs.iter().copied().fold(f64::INFINITY, f64::min).floor();
    let hi = logs.iter().copied().fold(f64::NEG_INFINITY, f64::max).ceil().max(lo + 1.0);
    let width = (hi - lo) / n_bins as f64;
    let mut counts = vec![0usize; n_bins];
    for l in logs {
        counts[(((l - lo) / width) as usize).min(n_bins - 1)] += 1;
    }
    (counts.into_iter().enumerate().map(|(i, c)| (lo + i as f64 * width, c)).collect(), width)
}

/// Bins of the KL histogram.
pub const N_HISTOGRAM_BINS: usize = 48;

/// `results.kl_divergence.histogram`: the per-position KL in
/// [`N_HISTOGRAM_BINS`] equal bins of `log10 KL` from the smallest positive
/// KL's decade to the largest's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlHistogram {
    /// Left edge of the first bin, `log10` nats.
    pub log10_from: f64,
    /// Bin width in decades.
    pub bin_decades: f64,
    /// Positions per bin.
    pub counts: Vec<usize>,
    /// Positions with KL exactly 0 (not on a log scale).
    pub n_zero: usize,
    /// Positions left out (non-finite).
    pub n_nonfinite: usize,
}

impl KlHistogram {
    pub fn of(kl: &[f32]) -> Self {
        let (bins, width) = log_histogram(kl, N_HISTOGRAM_BINS);
        Self {
            log10_from: bins.first().map_or(0.0, |b| b.0),
            bin_decades: width,
            counts: bins.iter().map(|b| b.1).collect(),
            n_zero: kl.iter().filter(|v| **v == 0.0).count(),
            n_nonfinite: kl.iter().filter(|v| !v.is_finite()).count(),
        }
    }

    fn bins(&self) -> Vec<(f64, usize)> {
        self.counts.iter().enumerate().map(|(i, &c)| (self.log10_from + i as f64 * self.bin_decades, c)).collect()
    }
}

/// Histogram of the per-position KL on a log scale, with the mean and the
/// 99th percentile marked. Positions with KL exactly 0 cannot be placed on
/// it and are counted in the caption.
pub fn kl_histogram(h: &KlHistogram, mean: f64, p99: Option<f64>) -> Result<String> {
    let (bins, width, n_zero) = (h.bins(), h.bin_decades, h.n_zero);
    let n_total = h.counts.iter().sum::<usize>() + n_zero;
    let x0 = bins.first().map_or(-6.0, |b| b.0);
    let x1 = bins.last().map_or(0.0, |b| b.0 + width);
    // Headroom above the tallest bar for the legend box.
    let top = 1.3 * y_top(bins.iter().map(|b| b.1).max().unwrap_or(1) as f64);
    let caption = format!("Per-position KL from the reference ({n_total} positions; {n_zero} with KL = 0 not shown)");
    draw_svg(|root| {
        let mut chart = ChartBuilder::on(root)
            .caption(caption, (FONT, 20))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(72)
            .build_cartesian_2d(x0..x1, 0.0..top)
            .context("plot: axes")?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&|v| format!("1e{v:.0}"))
            .y_label_formatter(&|v| format!("{v:.0}"))
            .x_desc("KL per position (nats, lower bound; log scale)")
            .y_desc("positions per bin")
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 16))
            .draw()
            .context("plot: mesh")?;
        chart
            .draw_series(bins.iter().map(|&(x, c)| Rectangle::new([(x, 0.0), (x + width * 0.92, c as f64)], POINT.mix(0.75).filled())))
            .context("plot: bars")?
            .label(format!("positions (bins of {width:.2} decades)"))
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 16, y + 5)], POINT.mix(0.75).filled()));
        let mut marks = vec![(mean, OVERALL, format!("mean KL {}", tick(mean)))];
        if let Some(p) = p99 {
            marks.push((p, BLACK, format!("99th percentile {}", tick(p))));
        }
        for (v, color, label) in marks {
            if v > 0.0 && v.is_finite() {
                let x = v.log10();
                chart
                    .draw_series(LineSeries::new([(x, 0.0), (x, top)], color.stroke_width(2)))
                    .context("plot: marks")?
                    .label(label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            }
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        Ok(())
    })
}

/// `compare --plots`: each window's NEW − BASE mean NLL per scored token,
/// in pairing order, with the overall mean change and its 95 % interval.
pub fn window_differences(per_window: &[f64], mean: f64, ci95: Option<[f64; 2]>) -> Result<String> {
    let n = per_window.len();
    let finite = per_window.iter().copied().filter(|v| v.is_finite());
    let mut lo = finite.clone().fold(0.0, f64::min);
    let mut hi = finite.fold(0.0, f64::max);
    if let Some([a, b]) = ci95 {
        lo = lo.min(a);
        hi = hi.max(b);
    }
    let pad = ((hi - lo) * 0.1).max(1e-12);
    // Room above the data for the legend box (upper right), so it hides no point.
    let head = ((hi - lo) * 0.45).max(1e-12);
    draw_svg(|root| {
        let mut chart = ChartBuilder::on(root)
            .caption("Per-window NLL change, NEW − BASE", (FONT, 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(88)
            .build_cartesian_2d(-0.5..(n.max(1) as f64 - 0.5), (lo - pad)..(hi + head))
            .context("plot: axes")?;
        chart
            .configure_mesh()
            // Windows are whole numbers: no label between them.
            .x_label_formatter(&|v| if (v - v.round()).abs() < 1e-9 && *v > -0.5 { format!("{}", v.round() as i64) } else { String::new() })
            .y_label_formatter(&|v| tick(*v))
            .x_desc("window (streams in report order, windows in plan order)")
            .y_desc("NLL change per scored token (nats)")
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 16))
            .draw()
            .context("plot: mesh")?;
        if let Some([a, b]) = ci95 {
            chart
                .draw_series([Rectangle::new([(-0.5, a), (n as f64 - 0.5, b)], BAND.mix(0.45).filled())])
                .context("plot: band")?
                .label("95 % interval of the mean change (t, windows - 1 df)")
                .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 16, y + 5)], BAND.mix(0.45).filled()));
        }
        chart
            .draw_series(LineSeries::new([(-0.5, 0.0), (n as f64 - 0.5, 0.0)], BLACK.stroke_width(1)))
            .context("plot: zero")?
            .label("no change")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(1)));
        chart
            .draw_series(LineSeries::new([(-0.5, mean), (n as f64 - 0.5, mean)], OVERALL.stroke_width(2)))
            .context("plot: mean")?
            .label(format!("mean change per token {}", tick(mean)))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], OVERALL.stroke_width(2)));
        chart
            .draw_series(per_window.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| Circle::new((i as f64, v), 3, POINT.filled())))
            .context("plot: points")?
            .label("one window")
            .legend(|(x, y)| Circle::new((x + 10, y), 3, POINT.filled()));
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        Ok(())
    })
}

/// Writes `name` into `dir` atomically and returns its path.
pub fn write_svg(dir: &Path, name: &str, svg: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    crate::util::fs::write_atomic(&path, svg.as_bytes())?;
    Ok(path)
}

/// `--plots`: every chart of a run into `dir` (beside report.json), from the report alone.
pub fn write_run_plots(dir: &Path, results: &Results) -> Result<Vec<PathBuf>> {
    let mut out = vec![write_svg(dir, PPL_BY_DOMAIN, &ppl_by_domain(&results.domains, results.overall.as_ref().map(|o| &o.summary))?)?];
    if !results.by_position.is_empty() {
        out.push(write_svg(dir, PPL_BY_POSITION, &ppl_by_position(&results.by_position)?)?);
    }
    if let Some(svg) = kl_by_position(&results.by_position) {
        out.push(write_svg(dir, KL_BY_POSITION, &svg?)?);
    }
    if let Some((k, h)) = results.kl_divergence.as_ref().and_then(|k| k.histogram.as_ref().map(|h| (k, h))) {
        out.push(write_svg(dir, KL_HISTOGRAM, &kl_histogram(h, k.summary.mean, k.summary.quantiles.map(|q| q.p99))?)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_bins_cover_every_positive_kl() {
        // 2e-6: log10 well inside its decade whatever the f32 rounding (1e-6 as f32 is below 1e-6).
        let kl = [0.0f32, 2e-6, 1e-5, 3e-5, 0.01, 0.5, f32::NAN];
        let (bins, width) = log_histogram(&kl, 12);
        assert_eq!(bins.len(), 12);
        assert_eq!(bins.iter().map(|b| b.1).sum::<usize>(), 5, "zero and NaN left out");
        assert_eq!(bins[0].0, -6.0);
        assert!((bins[11].0 + width - 0.0).abs() < 1e-12, "the last bin ends at 1e0");
    }

    #[test]
    fn perplexity_interval_is_exp_of_the_nll_interval() {
        let s = Summary {
            scored_tokens: 10,
            input_tokens: 10,
            nll_sum: 20.0,
            mean_nll: 2.0,
            perplexity: 2.0f64.exp(),
            ppl_uncertainty_llama: None,
            mean_nll_se_llama: None,
            mean_nll_se_clustered: Some(0.5),
            ppl_uncertainty_clustered: None,
            n_nonfinite: 0,
            n_windows: 3,
        };
        let e = Estimate::perplexity(&s);
        let (lo, hi) = e.ci.unwrap();
        assert!((lo - (2.0 - Z95 * 0.5f64).exp()).abs() < 1e-12 && (hi - (2.0 + Z95 * 0.5f64).exp()).abs() < 1e-12);
        assert!(lo < e.value && e.value < hi);
        assert_eq!(tick(0.0), "0");
        assert_eq!(tick(1.5e-4), "1.5e-4");
        assert_eq!(tick(12.25), "12.2");
    }

    #[test]
    fn charts_are_svg_with_their_labels() {
        let svg = window_differences(&[1e-4, -2e-4, 3e-4], 6.7e-5, Some([-1e-4, 2e-4])).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("NLL change per scored token (nats)") && svg.contains("one window"));
        let h = KlHistogram::of(&[1e-5, 2e-4, 0.0, f32::NAN]);
        assert_eq!((h.n_zero, h.n_nonfinite, h.counts.iter().sum::<usize>()), (1, 1, 2));
        let svg = kl_histogram(&h, 1e-4, Some(2e-4)).unwrap();
        assert!(svg.contains("1 with KL = 0 not shown") && svg.contains("99th percentile"));
    }
}
