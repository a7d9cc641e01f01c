//! Token-id parity with llama.cpp: for both real models, the tokenizer built
//! from the GGUF metadata must give exactly llama.cpp's ids on every corpus
//! file. Reference: `llama-cpp-token-ids.txt` in INFERNIX_REFERENCE
//! (llama.cpp b11434, `llama-tokenize --ids --no-parse-special --no-escape`;
//! see that folder's README.md). Every mismatch is reported, not just the first.

mod common;

use std::collections::BTreeMap;
use std::time::Instant;

use infernix_perplexity::convert::gguf::GgufFile;
use infernix_perplexity::convert::tokenizer::tokenizer_from_gguf;
use infernix_perplexity::text::tokenizer::{token_ids_sha256, TextTokenizer};

/// (model file, corpus path) -> (n_tokens, sha256), duplicates checked equal.
fn reference() -> BTreeMap<(String, String), (usize, String)> {
    let path = common::reference_dir().join("llama-cpp-token-ids.txt");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let mut out = BTreeMap::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 4, "{}:{}: expected 4 fields: {line}", path.display(), i + 1);
        let n: usize =
            f[2].parse().unwrap_or_else(|e| panic!("{}:{}: count {}: {e}", path.display(), i + 1, f[2]));
        let value = (n, f[3].to_string());
        if let Some(prev) = out.insert((f[0].to_string(), f[1].to_string()), value.clone()) {
            assert_eq!(prev, value, "{}:{}: conflicting duplicate line", path.display(), i + 1);
        }
    }
    out
}

#[test]
fn token_ids_match_llama_cpp_on_every_corpus_file() {
    let reference = reference();
    let data = common::data_root();
    let mut mismatches = Vec::new();
    let mut n_checked = 0;
    for model in [common::SMOLLM2_GGUF, common::GEMMA3_GGUF] {
        let files: Vec<_> = reference.iter().filter(|((m, _), _)| m == model).collect();
        assert_eq!(files.len(), 21, "{model}: reference lists {} corpus files, expected 21", files.len());
        let t0 = Instant::now();
        let g = GgufFile::open(&common::model(model)).unwrap();
        let (json, meta) = tokenizer_from_gguf(&g).unwrap();
        let t_built = t0.elapsed();
        let tk = TextTokenizer::from_json(&json, &meta).unwrap();
        eprintln!(
            "{model}: tokenizer.json {} bytes, built in {t_built:.1?}, loaded in {:.1?}",
            json.len(),
            t0.elapsed() - t_built
        );
        let t0 = Instant::now();
        let mut n_tokens = 0;
        for ((_, rel), (n_ref, sha_ref)) in files {
            let path = data.join(rel);
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            let text =
                String::from_utf8(bytes).unwrap_or_else(|e| panic!("{} is not UTF-8: {e}", path.display()));
            let ids = tk.encode(&text).unwrap();
            let sha = token_ids_sha256(&ids);
            n_tokens += ids.len();
            n_checked += 1;
            if ids.len() != *n_ref || sha != *sha_ref {
                mismatches.push(format!(
                    "{model} {rel}: {} tokens sha256 {sha}, llama.cpp {n_ref} tokens sha256 {sha_ref}",
                    ids.len()
                ));
            }
        }
        eprintln!("{model}: {n_tokens} tokens encoded in {:.1?}", t0.elapsed());
    }
    assert!(
        mismatches.is_empty(),
        "{} of {n_checked} files differ:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
    assert_eq!(n_checked, 42);
}
