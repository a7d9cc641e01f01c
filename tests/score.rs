//! Pooling of per-window statistics against the reference figures in
//! `shared/reference/README.md`: the exact float64 per-chunk NLL sums
//! (`exact-f64-*-wiki-test-c512.txt`, 255 scored tokens per 512-token chunk)
//! pooled by `Summary` must give the README's perplexities, and the planner's
//! chunk count must match the reference's.

mod common;

use infernix_perplexity::plan::{plan_windows, Method, Window};
use infernix_perplexity::score::{Summary, WindowStats};

/// Per-chunk statistics from an exact-f64 reference file (columns: chunk index,
/// NLL sum over the chunk's 255 scored tokens, mean NLL). Σ NLL² is not in the
/// file and is left 0, so only means and the clustered SE are meaningful.
fn reference_chunks(file: &str) -> Vec<WindowStats> {
    let path = common::reference_dir().join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .enumerate()
        .map(|(k, l)| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(cols[0].parse::<usize>().unwrap(), k, "{file}: chunk index");
            let nll_sum: f64 = cols[1].parse().unwrap();
            let mean: f64 = cols[2].parse().unwrap();
            assert!((nll_sum / 255.0 - mean).abs() < 1e-8, "{file} chunk {k}: sum/255 != mean");
            WindowStats { input_tokens: 512, scored_tokens: 255, n_nonfinite: 0, nll_sum, nll_sq_sum: 0.0 }
        })
        .collect()
}

fn check(file: &str, n_tokens: usize, ppl_all: f64, ppl_40: f64) {
    let chunks = reference_chunks(file);
    // The planner cuts llama.cpp's token count into the reference's number of chunks.
    let windows = plan_windows(n_tokens, &Method::Chunks { context: 512 }, None, None).unwrap();
    assert_eq!(windows.len(), chunks.len(), "{file}");
    assert_eq!(windows.iter().map(Window::scored).sum::<usize>(), 255 * chunks.len());

    let all = Summary::over(&chunks);
    assert_eq!((all.scored_tokens, all.input_tokens, all.n_windows), (255 * chunks.len(), 512 * chunks.len(), chunks.len()));
    // README figures are printed to 4 decimals.
    assert!((all.perplexity - ppl_all).abs() < 5e-5, "{file}: all chunks {} vs README {ppl_all}", all.perplexity);
    let first40 = Summary::over(&chunks[..40]);
    assert!((first40.perplexity - ppl_40).abs() < 5e-5, "{file}: 40 chunks {} vs README {ppl_40}", first40.perplexity);
    // Windows differ, so the clustered SE is positive and, propagated, a small fraction of PPL.
    let se = all.mean_nll_se_clustered.unwrap();
    assert!(se > 0.0 && se < 0.05, "{file}: clustered SE {se}");
    assert_eq!(all.ppl_uncertainty_clustered.unwrap(), all.perplexity * se);
}

#[test]
fn smollm2_exact_f64_reference_pools_to_readme_ppl() {
    // README: 303,415 tokens (592 chunks); exact float64 23.2370, first 40 chunks 23.5115.
    check("exact-f64-smollm2-wiki-test-c512.txt", 303_415, 23.2370, 23.5115);
}

#[test]
fn gemma3_exact_f64_reference_pools_to_readme_ppl() {
    // README: 295,216 tokens (576 chunks); exact float64 18.3312, first 40 chunks 17.1290.
    check("exact-f64-gemma3-wiki-test-c512.txt", 295_216, 18.3312, 17.1290);
}
