//! Byte figures (issue 15, item 1): on the real SmolLM2 (byte-level BPE)
//! and Gemma-3 (SentencePiece with byte fallback) tokenizers of the
//! artifacts in INFERNIX_MODELS, the bytes `score::bytes` gives each token
//! concatenate to the text, byte for byte, for every stream of the bundled
//! corpus and for arbitrary texts (proptest); so the bytes of a window's
//! scored targets are exactly the bytes of the text span they cover, and
//! per stream they add up to the text's bytes less the unscored ones.

mod common;

use std::sync::OnceLock;

use infernix_perplexity::artifact::Artifact;
use infernix_perplexity::plan::{plan_windows, Method};
use infernix_perplexity::score::bytes::TokenBytes;
use infernix_perplexity::text::corpus;
use infernix_perplexity::text::tokenizer::TextTokenizer;
use proptest::prelude::*;

struct Model {
    tokenizer: TextTokenizer,
    bytes: TokenBytes,
    bos: Option<u32>,
}

fn load(file: &str) -> Model {
    let a = Artifact::open(&common::model(file)).unwrap();
    let tokenizer = TextTokenizer::from_json(a.tokenizer_json(), &a.meta.tokenizer).unwrap();
    let control: Vec<u32> = [a.meta.tokenizer.bos_id, a.meta.tokenizer.eos_id].into_iter().flatten().collect();
    let bytes = TokenBytes::from_tokenizer_json(a.tokenizer_json(), &control).unwrap();
    let bos = a.meta.tokenizer.add_bos.then_some(a.meta.tokenizer.bos_id).flatten();
    Model { tokenizer, bytes, bos }
}

fn smollm2() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| load("SmolLM2-135M-Instruct.Q4_1.ninfer"))
}

fn gemma3() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| load("gemma-3-270m-q4_k_m.ninfer"))
}

/// Checks `text` on `m`: token bytes concatenate to the text; every planned
/// window's targets cover exactly their span; per stream the scored bytes
/// are the text's bytes less those of the unscored tokens.
fn check(m: &Model, text: &str, methods: &[Method]) -> Result<(), TestCaseError> {
    let ids = m.tokenizer.encode(text).unwrap();
    prop_assert_eq!(m.bytes.stream_bytes(&ids), text.as_bytes().to_vec(), "token bytes != text bytes");
    let counts = m.bytes.stream_counts(&ids);
    prop_assert_eq!(counts.iter().map(|&c| c as usize).sum::<usize>(), text.len());
    // offset[i]: the text byte where token i starts.
    let mut offset = vec![0usize; ids.len() + 1];
    for i in 0..ids.len() {
        offset[i + 1] = offset[i] + counts[i] as usize;
    }
    for method in methods {
        let Ok(windows) = plan_windows(ids.len(), method, m.bos, None) else { continue };
        let mut n_stream = 0usize;
        let mut scored = vec![false; ids.len()];
        for w in &windows {
            let n: usize = counts[w.first_target..w.end].iter().map(|&c| c as usize).sum();
            let span = &text.as_bytes()[offset[w.first_target]..offset[w.end]];
            let decoded: Vec<u8> = ids[w.first_target..w.end].iter().flat_map(|&t| m.bytes.piece(t).to_vec()).collect();
            // With no prepended marker, each target's bytes are its own piece's.
            prop_assert_eq!(span, &decoded[decoded.len() - n..], "window {} of {:?}", w.index, method);
            prop_assert_eq!(n, span.len());
            n_stream += n;
            scored[w.first_target..w.end].iter_mut().for_each(|s| *s = true);
        }
        let unscored: usize = counts.iter().zip(&scored).filter(|(_, &s)| !s).map(|(&c, _)| c as usize).sum();
        prop_assert_eq!(n_stream + unscored, text.len(), "{:?}: scored + unscored bytes != text bytes", method);
    }
    Ok(())
}

const METHODS: [Method; 2] = [Method::Sliding { context: 64, stride: 32 }, Method::Chunks { context: 32 }];

#[test]
fn every_corpus_stream_on_both_tokenizers() {
    let (manifest, files) = corpus::open_corpus(None, None).unwrap();
    let methods = [Method::Sliding { context: 4096, stride: 2048 }, Method::Chunks { context: 512 }];
    let mut n_checked = 0;
    for (name, m) in [("SmolLM2", smollm2()), ("Gemma-3", gemma3())] {
        for spec in corpus::select(&manifest, false) {
            let text = files.read(spec).unwrap();
            check(m, &text, &methods).unwrap_or_else(|e| panic!("{name} {}: {e}", spec.id));
            n_checked += 1;
        }
    }
    assert_eq!(n_checked, 2 * corpus::select(&manifest, false).len());
    assert!(n_checked >= 42, "{n_checked}");
}

#[test]
fn byte_fallback_and_split_characters_count_their_own_bytes() {
    // Gemma-3 spells a rare character with byte tokens, each one byte.
    let g = gemma3();
    let ids = g.tokenizer.encode("\u{10348}").unwrap(); // 4-byte Gothic letter
    let counts = g.bytes.stream_counts(&ids);
    assert_eq!(counts.iter().sum::<u32>(), 4, "{ids:?} {counts:?}");
    assert_eq!(counts[0], 0, "BOS covers no byte");
    assert!(counts.len() >= 3, "a rare 4-byte character takes several tokens: {ids:?}");
    // The leading-space marker is the space's one byte.
    let ids = g.tokenizer.encode("a b").unwrap();
    assert_eq!(g.bytes.stream_counts(&ids).iter().sum::<u32>(), 3);
    // A literal U+2581 normalizes to a space's marker: 1 byte, not 3 (documented).
    let ids = g.tokenizer.encode("\u{2581}").unwrap();
    assert_eq!(g.bytes.stream_counts(&ids).iter().sum::<u32>(), 1);
    // SmolLM2: byte-level, no BOS; a 3-byte CJK character in one or more tokens.
    let s = smollm2();
    let ids = s.tokenizer.encode("中文").unwrap();
    assert_eq!(s.bytes.stream_counts(&ids).iter().sum::<u32>(), 6);
    assert_eq!(s.bytes.style, "byte-level");
    assert_eq!(g.bytes.style, "sentencepiece");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_texts_smollm2(text in "\\PC{0,300}") {
        check(smollm2(), &text, &METHODS)?;
    }

    #[test]
    fn arbitrary_texts_gemma3(text in "[^\u{2581}]{0,300}") {
        check(gemma3(), &text, &METHODS)?;
    }
}
