//! The shipped corpus manifest (`eval/corpora/ppl-v1/manifest.json`) against
//! the real files under the data root (`INFERNIX_DATA`): every stream exists
//! with the manifest's size and SHA-256 and decodes as UTF-8, and every corpus
//! file of the data root is listed.

mod common;

use std::path::{Path, PathBuf};

use infernix_perplexity::text::corpus::{load_manifest, read_stream, select, Corpus};

fn manifest_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("eval/corpora/ppl-v1/manifest.json")
}

#[test]
fn every_stream_matches_the_real_file() {
    let m = load_manifest(&manifest_path()).unwrap();
    let root = common::data_root();
    assert_eq!((m.name.as_str(), m.version), ("ppl-v1", 1));
    let mut total_bytes = 0;
    for s in &m.streams {
        let text = read_stream(&root, s).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(text.len() as u64, s.bytes, "{}", s.id);
        assert!(s.url.starts_with("https://raw.githubusercontent.com/"), "{}: {}", s.id, s.url);
        // The URL names the pinned commit of `source` (owner/repo@commit:path).
        let (repo, rest) = s.source.split_once('@').unwrap();
        let (commit, path) = rest.split_once(':').unwrap();
        assert_eq!(commit.len(), 40, "{}", s.id);
        assert_eq!(s.url, format!("https://raw.githubusercontent.com/{repo}/{commit}/{path}"));
        total_bytes += s.bytes;
    }
    // The sum of the `bytes` column of SOURCES.md without the two LICENSE files and .gitattributes.
    assert_eq!(total_bytes, 5_868_356);
}

#[test]
fn domains_and_quick_selection() {
    let m = load_manifest(&manifest_path()).unwrap();
    let count = |d: &str| m.streams.iter().filter(|s| s.domain == d).count();
    assert_eq!(
        [count("en-reference"), count("en-longform"), count("zh"), count("code"), count("multilingual")],
        [2, 3, 1, 13, 2]
    );
    let code_bytes: u64 = m.streams.iter().filter(|s| s.domain == "code").map(|s| s.bytes).sum();
    assert_eq!(code_bytes, 516_731, "SOURCES.md: code corpus total without the license files");
    let quick: Vec<&str> = select(&m, true).iter().map(|s| s.path.as_str()).collect();
    assert_eq!(
        quick,
        [
            "wikitext-2-raw/wiki.test.raw",
            "pg19/frankenstein_pg84.txt",
            "zh/rulin_waishi_pg24032.txt",
            "code/cutlass/basic_gemm.cu",
            "multilingual/de_die_verwandlung_pg22367.txt",
        ]
    );
    assert_eq!(Corpus::from_manifest(&m, false).streams.len(), 21);
    let fr = m.streams.iter().find(|s| s.id == "fr-tour-du-monde").unwrap();
    assert_eq!(fr.source_encoding.as_deref(), Some("ISO-8859-1"));
}

#[test]
fn every_corpus_file_is_listed() {
    let m = load_manifest(&manifest_path()).unwrap();
    let root = common::data_root();
    let mut files = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                files.push(p.strip_prefix(&root).unwrap().to_string_lossy().replace('\\', "/"));
            }
        }
    }
    let not_corpus = |f: &str| f == "manifest.json" || f == "SOURCES.md" || f == ".gitattributes" || f.contains("LICENSE");
    let mut unlisted: Vec<_> =
        files.iter().filter(|f| !not_corpus(f) && !m.streams.iter().any(|s| &s.path == *f)).collect();
    unlisted.sort();
    assert!(unlisted.is_empty(), "corpus files missing from the manifest: {unlisted:?}");
}

/// Every licence text beside the corpus is in SOURCES.md with its SHA-256,
/// and WikiText's two licences (CC BY-SA 3.0 and GFDL) are both there.
#[test]
fn licence_texts_are_present_and_pinned() {
    let root = common::data_root();
    let sources = std::fs::read_to_string(root.join("SOURCES.md")).unwrap();
    let licences = [
        ("wikitext-2-raw/LICENSE-CC-BY-SA-3.0.txt", "Attribution-ShareAlike 3.0 Unported"),
        ("wikitext-2-raw/LICENSE-GFDL-1.3.txt", "GNU Free Documentation License"),
        ("code/cutlass/LICENSE.txt", "Redistribution and use in source and binary forms"),
        ("code/llm.c/LICENSE", "MIT License"),
    ];
    for (path, phrase) in licences {
        let bytes = std::fs::read(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(String::from_utf8_lossy(&bytes).contains(phrase), "{path} lacks {phrase:?}");
        let sha = infernix_perplexity::text::corpus::sha256_hex(&bytes);
        assert!(sources.contains(&format!("| `{path}` |")) && sources.contains(&sha), "SOURCES.md lacks {path} / {sha}");
    }
}
