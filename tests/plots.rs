//! `--plots` and `compare --plots` end to end on SmolLM2 (CPU, three sliding
//! windows of 512 tokens): a lossless reference run, a run with bf16 matrix
//! inputs against it, and `compare` between the two. Every chart must exist,
//! be valid SVG that usvg parses, carry its axis titles and legend, and
//! rasterize (resvg) to a PNG with drawn pixels. With `INFERNIX_PLOTS_PNG=DIR`
//! the PNGs are kept in DIR so a person can look at them (docs/report-extras.md).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use resvg::{tiny_skia, usvg};

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.ninfer";

fn run(args: &[&str]) -> std::process::Output {
    let o = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity")).args(args).output().expect("run infernix-perplexity");
    assert!(o.status.success() || o.status.code() == Some(3), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    o
}

/// Parses and rasterizes `svg`; returns the share of non-white pixels.
fn rasterize(svg: &Path, png_dir: Option<&Path>) -> f64 {
    let text = std::fs::read_to_string(svg).unwrap();
    let mut opt = usvg::Options::default();
    opt.fontdb_mut().load_system_fonts();
    opt.fontdb_mut().set_sans_serif_family("DejaVu Sans");
    let tree = usvg::Tree::from_str(&text, &opt).unwrap_or_else(|e| panic!("{}: not valid SVG: {e}", svg.display()));
    let size = tree.size().to_int_size();
    assert_eq!((size.width(), size.height()), (960, 560), "{}", svg.display());
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height()).unwrap();
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    if let Some(dir) = png_dir {
        std::fs::create_dir_all(dir).unwrap();
        pixmap.save_png(dir.join(svg.with_extension("png").file_name().unwrap())).unwrap();
    }
    let px = pixmap.pixels();
    px.iter().filter(|p| p.red() < 200 || p.green() < 200 || p.blue() < 200).count() as f64 / px.len() as f64
}

#[test]
fn run_and_compare_charts_render() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::models_dir().join(SMOLLM2);
    let text = std::fs::read_to_string(common::data_root().join("wikitext-2-raw/wiki.test.raw")).unwrap();
    let cut = text[..12_000].rfind('\n').unwrap() + 1;
    let text_path = tmp.path().join("wiki-head.txt");
    std::fs::write(&text_path, &text[..cut]).unwrap();
    let (m, t) = (model.to_str().unwrap(), text_path.to_str().unwrap());
    let reference = tmp.path().join("ref.top");
    let (base, new, cmp) = (tmp.path().join("base"), tmp.path().join("new"), tmp.path().join("cmp-plots"));
    let common_args = ["--text", t, "--method", "sliding", "--context", "512", "--stride", "256", "--chunks", "3", "--backend", "cpu", "--log-level", "warn"];
    let mut a = vec![m];
    a.extend(common_args);
    a.extend(["--lossless", "--save-top-tokens", reference.to_str().unwrap(), "--output", base.to_str().unwrap()]);
    run(&a);
    let mut a = vec![m];
    a.extend(common_args);
    a.extend(["--emulate-bf16-tc", "--kv-dtype", "bf16", "--kl-reference", reference.to_str().unwrap(), "--plots", "--output", new.to_str().unwrap()]);
    let o = run(&a);
    // The llama.cpp-compatible closing line (item 7).
    let stderr = String::from_utf8_lossy(&o.stderr);
    let line = stderr.lines().find(|l| l.starts_with("Final estimate: PPL = ")).unwrap_or_else(|| panic!("{stderr}"));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(new.join("report.json")).unwrap()).unwrap();
    let o = &report["results"]["overall"];
    assert_eq!(line, format!("Final estimate: PPL = {:.4} +/- {:.5}", o["perplexity"].as_f64().unwrap(), o["ppl_uncertainty_llama"].as_f64().unwrap()));
    run(&["compare", base.to_str().unwrap(), new.to_str().unwrap(), "--plots", cmp.to_str().unwrap()]);

    // Where the loss lives: by position with KL, the worst windows and positions with text, worst.md.
    let results = &report["results"];
    let buckets = results["by_position"].as_array().unwrap();
    assert_eq!(buckets.len(), 2, "sliding 512/256: contexts 0..256 and 256..512");
    assert!(buckets.iter().all(|b| b["kl_divergence"]["mean"].as_f64().unwrap() > 0.0));
    let n_scored: u64 = buckets.iter().map(|b| b["nll"]["scored_tokens"].as_u64().unwrap()).sum();
    assert_eq!(n_scored, o["scored_tokens"].as_u64().unwrap(), "every target in one bucket");
    let kl = &results["kl_divergence"];
    let worst_w = kl["worst_windows"].as_array().unwrap();
    let worst_p = kl["worst_positions"].as_array().unwrap();
    assert_eq!(worst_w.len(), 3, "three windows, each with a positive mean KL");
    assert_eq!(worst_p.len(), 50);
    assert!(worst_p.windows(2).all(|p| p[0]["kl"].as_f64() >= p[1]["kl"].as_f64()));
    assert!(worst_p.iter().chain(worst_w).all(|p| p["text"].as_str().is_some_and(|t| t.contains("[[") && t.contains("]]"))));
    let md = std::fs::read_to_string(new.join("worst.md")).unwrap();
    assert!(md.contains("## The 3 windows with the largest mean KL") && md.contains("## The 50 positions with the largest KL"), "{md}");
    assert_eq!(md.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| #")).count(), 3 + 50, "{md}");

    let png_dir = std::env::var_os("INFERNIX_PLOTS_PNG").map(PathBuf::from);
    let charts: [(PathBuf, &[&str]); 5] = [
        (new.join("ppl_by_domain.svg"), &["Perplexity by domain", "perplexity per token", "every domain pooled"]),
        (new.join("ppl_by_position.svg"), &["tokens of context before the target", "95 % interval, clustered by window"]),
        (new.join("kl_by_position.svg"), &["mean KL per position (nats, lower bound)", "mean KL of the bucket"]),
        (new.join("kl_histogram.svg"), &["log scale", "positions per bin", "mean KL", "99th percentile"]),
        (cmp.join("window_nll_differences.svg"), &["NLL change per scored token (nats)", "95 % interval of the mean change", "one window"]),
    ];
    for (path, labels) in &charts {
        let svg = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for l in *labels {
            assert!(svg.contains(l), "{}: no {l:?}", path.display());
        }
        let ink = rasterize(path, png_dir.as_deref());
        assert!(ink > 0.01 && ink < 0.6, "{}: {:.3} of the pixels drawn", path.display(), ink);
    }
}
