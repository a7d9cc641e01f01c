//! Cross-checks `backend::cpu::dequant` against the `gguf` Python package
//! (llama.cpp's numpy implementation), through `tests/data/dequant_golden.json`
//! written by `scripts/golden_dequant.py` (gguf-py version recorded in the
//! file): real tensors of both models (row and whole-tensor float64 sums,
//! sampled values) and random / quantized blocks of every format we keep
//! (bit-exact values).

mod common;

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use infernix_perplexity::artifact::format::{TensorFormat, ALL_FORMATS};
use infernix_perplexity::backend::cpu::dequant::{dequantize_matrix, dequantize_row, gather_rows};
use infernix_perplexity::convert::gguf::GgufFile;
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    gguf_py_version: String,
    real: Vec<RealTensor>,
    blocks: Vec<BlockCase>,
}

#[derive(Deserialize)]
struct Sums {
    sum: f64,
    sum_abs: f64,
    sum_sq: f64,
}

#[derive(Deserialize)]
struct RealRow {
    row: usize,
    #[serde(flatten)]
    sums: Sums,
    /// `(column, value)`; each value is an f32 written exactly as a float64.
    samples: Vec<(usize, f64)>,
}

#[derive(Deserialize)]
struct RealTensor {
    model: String,
    tensor: String,
    format: String,
    n_rows: usize,
    n_cols: usize,
    total: Sums,
    rows: Vec<RealRow>,
}

#[derive(Deserialize)]
struct BlockCase {
    format: String,
    origin: String,
    n_elems: usize,
    bytes_hex: String,
    values_f32_le_hex: String,
}

fn golden() -> Golden {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/dequant_golden.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e} (regenerate with scripts/golden_dequant.py)"))
}

fn from_hex(s: &str) -> Vec<u8> {
    assert!(s.len() % 2 == 0, "odd hex length {}", s.len());
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// float64 sums in order, as the golden file's (which were summed by numpy, pairwise).
fn sums_of(y: &[f32]) -> Sums {
    let mut s = Sums {
        sum: 0.0,
        sum_abs: 0.0,
        sum_sq: 0.0,
    };
    for &v in y {
        let v = f64::from(v);
        s.sum += v;
        s.sum_abs += v.abs();
        s.sum_sq += v * v;
    }
    s
}

/// Sums differ only by float64 summation order: allow 1e-9 of the summed magnitudes.
fn assert_sums(got: &Sums, want: &Sums, what: &str) {
    let close = |a: f64, b: f64, scale: f64| (a - b).abs() <= 1e-9 * scale.max(f64::MIN_POSITIVE);
    assert!(
        close(got.sum, want.sum, want.sum_abs),
        "{what}: sum {} vs gguf-py {}",
        got.sum,
        want.sum
    );
    assert!(
        close(got.sum_abs, want.sum_abs, want.sum_abs),
        "{what}: sum_abs {} vs gguf-py {}",
        got.sum_abs,
        want.sum_abs
    );
    assert!(
        close(got.sum_sq, want.sum_sq, want.sum_sq),
        "{what}: sum_sq {} vs gguf-py {}",
        got.sum_sq,
        want.sum_sq
    );
}

#[test]
fn real_tensors_match_gguf_py() {
    let g = golden();
    let mut files: HashMap<String, GgufFile> = HashMap::new();
    let mut formats_seen = BTreeSet::new();
    for t in &g.real {
        let file = files
            .entry(t.model.clone())
            .or_insert_with(|| GgufFile::open(&common::model(&t.model)).unwrap());
        let info = file
            .tensor(&t.tensor)
            .unwrap_or_else(|| panic!("{}: no tensor {}", t.model, t.tensor));
        let format = info.format().unwrap();
        assert_eq!(format, TensorFormat::from_name(&t.format).unwrap(), "{}", t.tensor);
        let n_cols = info.dims[0] as usize;
        let n_rows = (info.n_elems() / info.dims[0]) as usize;
        assert_eq!((n_rows, n_cols), (t.n_rows, t.n_cols), "{}", t.tensor);
        let bytes = file.tensor_bytes(info);
        let what = format!("{} {} ({format}, {n_rows} x {n_cols})", t.model, t.tensor);

        let start = Instant::now();
        let all = dequantize_matrix(format, bytes, n_rows, n_cols).unwrap(); // (n_rows, n_cols)
        eprintln!("{what}: dequantized in {:.3} s", start.elapsed().as_secs_f64());
        assert_sums(&sums_of(&all), &t.total, &format!("{what} whole tensor"));

        for r in &t.rows {
            let mut y = vec![0.0f32; n_cols];
            gather_rows(format, bytes, n_cols, &[r.row as u32], &mut y).unwrap();
            assert_eq!(
                &y[..],
                &all[r.row * n_cols..(r.row + 1) * n_cols],
                "{what} row {}",
                r.row
            );
            assert_sums(&sums_of(&y), &r.sums, &format!("{what} row {}", r.row));
            for &(c, want) in &r.samples {
                assert_eq!(f64::from(y[c]), want, "{what} row {} col {c}", r.row);
            }
        }
        formats_seen.insert(format);
    }
    let want: BTreeSet<_> = ["F32", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"]
        .iter()
        .map(|n| TensorFormat::from_name(n).unwrap())
        .collect();
    assert_eq!(
        formats_seen, want,
        "golden file (gguf-py {}) covers the real models' formats",
        g.gguf_py_version
    );
}

#[test]
fn random_blocks_of_every_format_match_gguf_py_bit_for_bit() {
    let g = golden();
    let mut covered = BTreeSet::new();
    for case in &g.blocks {
        let format = TensorFormat::from_name(&case.format).unwrap();
        let bytes = from_hex(&case.bytes_hex);
        let want: Vec<f32> = from_hex(&case.values_f32_le_hex)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(want.len(), case.n_elems);
        let mut got = vec![0.0f32; case.n_elems];
        dequantize_row(format, &bytes, &mut got).unwrap();
        let mismatches: Vec<_> = got
            .iter()
            .zip(&want)
            .enumerate()
            // NaN payloads are not part of the format's contract (only F16/F32 random bits make them).
            .filter(|(_, (a, b))| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()))
            .take(5)
            .collect();
        assert!(
            mismatches.is_empty(),
            "{format} ({}): first mismatches (index, (ours, gguf-py)): {mismatches:?}",
            case.origin
        );
        covered.insert(format);
    }
    assert_eq!(
        covered,
        ALL_FORMATS.into_iter().collect::<BTreeSet<_>>(),
        "every kept format has a cross-check"
    );
}
