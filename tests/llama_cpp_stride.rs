//! `--ppl-stride` against llama.cpp's strided perplexity on SmolLM2
//! (`tests/data/reference/llama-cpp-ppl-stride-smollm2.txt`: llama.cpp b11434,
//! CPU build, `llama-perplexity -c 512 -b 512 --ppl-stride 256` on the first
//! 60 lines of wiki.test.raw). Two claims:
//! - the plan: the same number of tokens, the same windows (llama.cpp prints
//!   each window's first position and its window length) and so the same
//!   scored targets (the last 256 of each window);
//! - the scores: each window's mean NLL, recovered from llama.cpp's running
//!   PPL, within the spread between this CPU oracle and llama.cpp's CPU build
//!   documented in tests/data/reference/README.md for SmolLM2 (chunks of 255
//!   targets at c=512: worst chunk 0.040 nats, 95 % within 0.013).

mod common;

use std::process::Command;

use common::{data_root, models_dir, reference_dir};

/// The documented worst chunk difference, llama.cpp CPU minus exact, SmolLM2 (nats).
const WORST_NATS: f64 = 0.040;
/// The documented 95 % band of that difference (nats).
const BAND95_NATS: f64 = 0.013;

struct Reference {
    n_lines: usize,
    n_tokens: usize,
    window: usize,
    stride: usize,
    /// (window start, running PPL after that window).
    rows: Vec<(usize, f64)>,
}

fn field(header: &str, key: &str) -> usize {
    let at = header.find(key).unwrap_or_else(|| panic!("reference header lacks {key:?}: {header}")) + key.len();
    header[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

fn reference() -> Reference {
    let text = std::fs::read_to_string(reference_dir().join("llama-cpp-ppl-stride-smollm2.txt")).unwrap();
    let header: String = text.lines().filter(|l| l.starts_with("# ")).collect::<Vec<_>>().join(" ");
    let rows: Vec<(usize, f64)> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].parse().unwrap(), f[1].parse().unwrap())
        })
        .collect();
    Reference {
        n_lines: field(&header, "first_lines="),
        n_tokens: field(&header, "n_tokens="),
        window: field(&header, "n_ctx="),
        stride: field(&header, "--ppl-stride "),
        rows,
    }
}

#[test]
fn ppl_stride_scores_llama_cpp_targets_and_agrees_per_window() {
    let r = reference();
    // The slice llama.cpp read: the first lines of wiki.test.raw, no final newline
    // (llama.cpp's -f drops one trailing newline anyway).
    let wiki = std::fs::read(data_root().join("wikitext-2-raw/wiki.test.raw")).unwrap();
    let slice: Vec<u8> = wiki.split(|&b| b == b'\n').take(r.n_lines).collect::<Vec<_>>().join(&b'\n');
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("slice.txt");
    std::fs::write(&text, &slice).unwrap();
    let run = |name: &str, extra: &[&str]| -> serde_json::Value {
        let out = dir.path().join(name);
        let o = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
            .arg(models_dir().join("SmolLM2-135M-Instruct.Q4_1.ninfer"))
            .arg("-f")
            .arg(&text)
            .args(["-c", "512", "--ppl-stride", &r.stride.to_string(), "--backend", "cpu", "--lossless"])
            .args(extra)
            .arg("--output")
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap()
    };
    // The stream's token count, from a dry run.
    let dry = run("dry", &["--dry-run"]);
    assert_eq!(dry["results"]["streams"][0]["n_tokens"].as_u64().unwrap() as usize, r.n_tokens, "token count differs from llama.cpp's");
    let report = run("scored", &[]);
    assert_eq!(report["workload"]["method"], "ppl-stride");
    let stream = &report["results"]["streams"][0];
    let windows = stream["windows"].as_array().unwrap();
    assert_eq!(windows.len(), r.rows.len(), "window count differs from llama.cpp's");

    // The plan: window i starts at llama.cpp's printed start and scores its last `stride` tokens.
    let mut ours = Vec::new();
    for (w, (start, _)) in windows.iter().zip(&r.rows) {
        let at = |k: &str| w[k].as_u64().unwrap() as usize;
        assert_eq!((at("begin"), at("end") - at("begin")), (*start, r.window), "{w}");
        assert_eq!((at("first_target"), at("scored")), (at("end") - r.stride, r.stride), "{w}");
        ours.push(w["mean_nll"].as_f64().unwrap());
    }

    // llama.cpp's window means from its running PPL (printed to 4 decimals, so
    // each mean carries about 1e-4 nats of rounding): sum_i = ln(P_i) * (i+1) * S.
    let sums: Vec<f64> = r.rows.iter().enumerate().map(|(i, (_, p))| p.ln() * ((i + 1) * r.stride) as f64).collect();
    let theirs: Vec<f64> =
        (0..sums.len()).map(|i| (sums[i] - if i == 0 { 0.0 } else { sums[i - 1] }) / r.stride as f64).collect();
    let diffs: Vec<f64> = theirs.iter().zip(&ours).map(|(t, o)| t - o).collect();
    let n_band = diffs.iter().filter(|d| d.abs() <= BAND95_NATS).count();
    let mean = diffs.iter().sum::<f64>() / diffs.len() as f64;
    eprintln!("llama.cpp - ours per window (nats): {diffs:.4?}; mean {mean:+.4}; {n_band}/{} within {BAND95_NATS}", diffs.len());
    let worst = diffs.iter().fold(0.0f64, |m, d| m.max(d.abs()));
    assert!(worst <= WORST_NATS, "a window differs by {worst:.4} nats, beyond the documented worst {WORST_NATS}: {diffs:?}");
    // 95 % of the windows, less one for the small sample (11 windows).
    assert!(
        n_band as f64 >= 0.95 * diffs.len() as f64 - 1.0,
        "only {n_band}/{} windows within the documented 95 % band {BAND95_NATS}: {diffs:?}",
        diffs.len()
    );
}
