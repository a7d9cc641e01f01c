//! Byte-level figures: the UTF-8 bytes each scored target covers, and bits
//! per byte / byte perplexity per window, stream, domain and overall, so that
//! models with different tokenizers can be compared on the same text.
//!
//! # How a target's bytes are counted
//!
//! A token's bytes are the bytes it contributes to the decoded text, read
//! from the artifact's tokenizer.json (never by decoding one token at a
//! time, which would turn a partial character into U+FFFD):
//!
//! - **control tokens**: the artifact's BOS and EOS ids (its tokenizer
//!   policy) and `added_tokens` with `special: true`: 0 bytes. The BOS a
//!   window starts with is context only and never a target anyway. (Other
//!   control pieces of a vocabulary, such as Gemma's `<start_of_turn>`, can
//!   only come from text here, since special-token text is never parsed, and
//!   count the bytes of that text.)
//! - other **added tokens**: the UTF-8 bytes of their `content`.
//! - **byte-level BPE** (decoder `ByteLevel`, GPT-2's byte-to-character
//!   table; SmolLM2, Llama 3, Qwen): each character of the piece is one byte.
//!   A character split over several tokens gives each token the bytes it
//!   holds (e.g. 2 + 1 for a 3-byte character split 2/1).
//! - **SentencePiece-style BPE** (any other decoder, with `byte_fallback`;
//!   Gemma): a byte-fallback piece `<0xNN>` is exactly 1 byte, so a character
//!   spelt as three byte tokens counts 1 + 1 + 1; the leading-space marker
//!   `▁` (U+2581) is the one byte of the space it stands for; every other
//!   character counts its UTF-8 length.
//! - a **prepended space marker** (a `Prepend` normalizer, SentencePiece's
//!   `add_space_prefix`): the tokenizer inserts a `▁` that is not in the
//!   text and the decoder strips it, so the first text token of the stream
//!   counts one byte less when it starts with `▁`.
//!
//! So the bytes of consecutive tokens concatenate to the decoded text, and
//! the bytes of a window's scored targets are exactly the bytes of the text
//! span they cover: `tests/bytes.rs` checks, on both real tokenizers, that
//! every corpus stream's token bytes concatenate to the stream's text byte
//! for byte (so each byte is counted once, on its own token) and the same
//! for arbitrary texts (proptest). One case differs from the raw text: a
//! literal `▁` in a SentencePiece tokenizer's input is indistinguishable from
//! a space after normalization and counts 1 byte, not 3 (the report's
//! per-stream `text_bytes` beside `token_bytes` shows any such difference).
//!
//! # Figures
//!
//! Over the finite targets (non-finite NLLs are left out of the bytes as of
//! the NLL sum): `bits_per_byte = Σ NLL / ln 2 / Σ bytes`,
//! `byte_perplexity = exp(Σ NLL / Σ bytes) = 2^bits_per_byte`, with a
//! window-clustered standard error of `bits_per_byte` (the ratio estimator's,
//! [`stats::clustered_se`] with each window's bytes as its weight).
//!
//! This module reads no files and writes no report.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::stats::{self, NeumaierSum};

/// The byte content of every token id of a vocabulary.
#[derive(Clone, Debug)]
pub struct TokenBytes {
    /// (n_vocab) the bytes each id contributes to the decoded text.
    pieces: Vec<Vec<u8>>,
    /// A `Prepend` normalizer inserts a `▁` before the text.
    strips_prefix_space: bool,
    /// `byte-level` or `sentencepiece`.
    pub style: &'static str,
}

/// GPT-2's byte-to-character table, inverted: the character each byte is
/// written as in a byte-level vocabulary, back to the byte.
fn byte_level_inverse() -> HashMap<char, u8> {
    let mut map = HashMap::with_capacity(256);
    let mut n_shifted = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            n_shifted += 1;
            char::from_u32(255 + n_shifted).unwrap_or('\u{0}')
        };
        map.insert(c, b);
    }
    map
}

/// `<0xNN>`: a SentencePiece byte-fallback piece.
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

/// True when `v` (a normalizer or one of a sequence's) is a `Prepend`.
fn has_prepend(v: &serde_json::Value) -> bool {
    match v["type"].as_str() {
        Some("Prepend") => true,
        Some("Sequence") => v["normalizers"].as_array().is_some_and(|a| a.iter().any(has_prepend)),
        _ => false,
    }
}

impl TokenBytes {
    /// Builds the table from tokenizer.json bytes (see the module doc for
    /// the rules); `control_ids` (the policy's BOS and EOS) count 0 bytes.
    pub fn from_tokenizer_json(json: &[u8], control_ids: &[u32]) -> Result<Self> {
        let doc: serde_json::Value = serde_json::from_slice(json).context("tokenizer.json: parse")?;
        let vocab = doc["model"]["vocab"].as_object().ok_or_else(|| anyhow!("tokenizer.json: model.vocab is not a map"))?;
        let byte_level = doc["decoder"]["type"].as_str() == Some("ByteLevel");
        let fallback = doc["model"]["byte_fallback"].as_bool().unwrap_or(false);
        if !byte_level && !fallback {
            bail!("tokenizer.json: byte counts need a ByteLevel decoder or a byte_fallback model (this one has neither)");
        }
        // Added tokens first: their ids take their own rule, whatever the vocabulary spells.
        let mut entries: Vec<(usize, Vec<u8>)> = Vec::with_capacity(vocab.len());
        for t in doc["added_tokens"].as_array().map_or(&[][..], Vec::as_slice) {
            let id = t["id"].as_u64().ok_or_else(|| anyhow!("tokenizer.json: added token without an id"))? as usize;
            let bytes =
                if t["special"].as_bool().unwrap_or(false) { Vec::new() } else { t["content"].as_str().unwrap_or("").as_bytes().to_vec() };
            entries.push((id, bytes));
        }
        entries.extend(control_ids.iter().map(|&id| (id as usize, Vec::new())));
        let added: std::collections::HashSet<usize> = entries.iter().map(|e| e.0).collect();
        let inverse = byte_level_inverse();
        for (piece, id) in vocab {
            let id = id.as_u64().ok_or_else(|| anyhow!("tokenizer.json: model.vocab[{piece:?}] is not an id"))? as usize;
            if added.contains(&id) {
                continue;
            }
            let bytes = if byte_level {
                piece
                    .chars()
                    .map(|c| {
                        inverse.get(&c).copied().ok_or_else(|| anyhow!("tokenizer.json: piece {piece:?} has {c:?}, not a byte-level character"))
                    })
                    .collect::<Result<Vec<u8>>>()?
            } else if let Some(b) = byte_fallback(piece) {
                vec![b]
            } else {
                piece.replace('\u{2581}', " ").into_bytes()
            };
            entries.push((id, bytes));
        }
        let n_vocab = entries.iter().map(|e| e.0 + 1).max().unwrap_or(0);
        let mut pieces = vec![Vec::new(); n_vocab];
        for (id, bytes) in entries {
            pieces[id] = bytes;
        }
        Ok(Self {
            pieces,
            strips_prefix_space: !byte_level && has_prepend(&doc["normalizer"]),
            style: if byte_level { "byte-level" } else { "sentencepiece" },
        })
    }

    /// The bytes id `id` contributes (empty for an id outside the table).
    pub fn piece(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// Per position of a stream's tokens: the bytes that token covers.
    pub fn stream_counts(&self, tokens: &[u32]) -> Vec<u32> {
        let mut counts: Vec<u32> = tokens.iter().map(|&t| self.piece(t).len() as u32).collect();
        if self.strips_prefix_space {
            if let Some(i) = tokens.iter().position(|&t| !self.piece(t).is_empty()) {
                if self.piece(tokens[i]).first() == Some(&b' ') {
                    counts[i] -= 1;
                }
            }
        }
        counts
    }

    /// The decoded bytes of a stream, token by token, as counted (the
    /// prepended space, when stripped, left out): what `stream_counts` sums.
    pub fn stream_bytes(&self, tokens: &[u32]) -> Vec<u8> {
        let counts = self.stream_counts(tokens);
        let mut out = Vec::new();
        for (&t, &n) in tokens.iter().zip(&counts) {
            let p = self.piece(t);
            out.extend_from_slice(&p[p.len() - n as usize..]);
        }
        out
    }
}

/// Bytes of one window's scored targets.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WindowBytes {
    /// Bytes of every scored target.
    pub scored_bytes: u64,
    /// Bytes of the targets with a finite NLL (the denominator).
    pub finite_bytes: u64,
    /// Σ NLL over the finite targets, nats.
    pub nll_sum: f64,
}

impl WindowBytes {
    /// `counts`: the bytes of each scored target; `nll`: their NLLs.
    pub fn of(counts: &[u32], nll: &[f64]) -> Self {
        debug_assert_eq!(counts.len(), nll.len());
        let mut sum = NeumaierSum::new();
        let (mut scored, mut finite) = (0u64, 0u64);
        for (&c, &v) in counts.iter().zip(nll) {
            scored += u64::from(c);
            if v.is_finite() {
                finite += u64::from(c);
                sum.add(v);
            }
        }
        Self { scored_bytes: scored, finite_bytes: finite, nll_sum: sum.value() }
    }
}

/// The byte figures of a window or a pool of windows (report fields).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ByteSummary {
    /// UTF-8 bytes the scored targets cover (module doc: how they are counted).
    pub scored_bytes: u64,
    /// Of those, the bytes of targets with a finite NLL (the denominator);
    /// with a window's `nll_sum`, all that pooling windows needs.
    pub finite_bytes: u64,
    /// `Σ NLL / ln 2 / Σ bytes` over the finite targets; null without bytes.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub bits_per_byte: f64,
    /// `exp(Σ NLL / Σ bytes) = 2^bits_per_byte`.
    #[serde(deserialize_with = "crate::util::json::f64_or_nan")]
    pub byte_perplexity: f64,
    /// Window-clustered standard error of `bits_per_byte` (null with fewer than 2 windows).
    pub bits_per_byte_se_clustered: Option<f64>,
}

impl WindowBytes {
    /// A window's bytes back from its report record (`ByteSummary` and `nll_sum`).
    pub fn of_record(b: &ByteSummary, nll_sum: f64) -> Self {
        Self { scored_bytes: b.scored_bytes, finite_bytes: b.finite_bytes, nll_sum }
    }
}

impl ByteSummary {
    /// Pools windows in order (each window one cluster).
    pub fn over<'a>(windows: impl IntoIterator<Item = &'a WindowBytes>) -> Self {
        let windows: Vec<&WindowBytes> = windows.into_iter().collect();
        let mut nll = NeumaierSum::new();
        let (mut scored, mut finite) = (0u64, 0u64);
        for w in &windows {
            nll.add(w.nll_sum);
            scored += w.scored_bytes;
            finite += w.finite_bytes;
        }
        let nats_per_byte = if finite == 0 { f64::NAN } else { nll.value() / finite as f64 };
        let se = stats::clustered_se(windows.iter().map(|w| (w.finite_bytes as usize, w.nll_sum)));
        Self {
            scored_bytes: scored,
            finite_bytes: finite,
            bits_per_byte: nats_per_byte / std::f64::consts::LN_2,
            byte_perplexity: nats_per_byte.exp(),
            bits_per_byte_se_clustered: se.map(|s| s / std::f64::consts::LN_2),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection() {
        let inv = byte_level_inverse();
        assert_eq!(inv.len(), 256);
        let mut seen: Vec<u8> = inv.values().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..=255).collect::<Vec<u8>>());
        // GPT-2's table: space is 'Ġ' (U+0120), newline 'Ċ' (U+010A).
        assert_eq!(inv[&'\u{120}'], b' ');
        assert_eq!(inv[&'\u{10A}'], b'\n');
        assert_eq!(inv[&'a'], b'a');
    }

    #[test]
    fn sentencepiece_rules() {
        let json = serde_json::json!({
            "added_tokens": [{"id": 0, "content": "<bos>", "special": true}, {"id": 5, "content": "<x>", "special": false}],
            "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"}]},
            "decoder": {"type": "Sequence", "decoders": []},
            "model": {"byte_fallback": true, "vocab": {"<bos>": 0, "\u{2581}ab": 1, "<0xE4>": 2, "<0xB8>": 3, "é": 4, "<x>": 5, "</s>": 6}}
        });
        let tb = TokenBytes::from_tokenizer_json(json.to_string().as_bytes(), &[6]).unwrap();
        assert_eq!(tb.style, "sentencepiece");
        assert_eq!(tb.piece(1), b" ab");
        assert_eq!(tb.piece(2), [0xE4]);
        assert_eq!(tb.piece(4).len(), 2);
        assert_eq!(tb.piece(5), b"<x>");
        assert_eq!(tb.piece(6), b"", "a control id of the policy");
        // BOS 0 bytes; the prepended marker stripped from the first text token only.
        assert_eq!(tb.stream_counts(&[0, 1, 1, 2, 3, 4, 5]), vec![0, 2, 3, 1, 1, 2, 3]);
        assert_eq!(tb.stream_bytes(&[0, 1, 1]), b"ab ab");
    }

    #[test]
    fn refuses_a_tokenizer_without_byte_rules() {
        let json = serde_json::json!({"decoder": {"type": "WordPiece"}, "model": {"vocab": {"a": 0}}});
        let e = TokenBytes::from_tokenizer_json(json.to_string().as_bytes(), &[]).unwrap_err().to_string();
        assert!(e.contains("ByteLevel") && e.contains("byte_fallback"), "{e}");
    }

    #[test]
    fn bits_per_byte_hand_computed() {
        // Window 1: bytes 3 + 1, NLL 2 ln 2 + 2 ln 2 -> 4 ln 2 nats over 4 bytes = 1 bit/byte.
        let ln2 = std::f64::consts::LN_2;
        let a = WindowBytes::of(&[3, 1], &[2.0 * ln2, 2.0 * ln2]);
        assert_eq!((a.scored_bytes, a.finite_bytes), (4, 4));
        let s = ByteSummary::over([&a]);
        assert!((s.bits_per_byte - 1.0).abs() < 1e-15 && (s.byte_perplexity - 2.0).abs() < 1e-15);
        assert_eq!(s.bits_per_byte_se_clustered, None);
        // A non-finite target's bytes leave the denominator, not the scored count.
        let b = WindowBytes::of(&[2, 5], &[6.0 * ln2, f64::NAN]);
        assert_eq!((b.scored_bytes, b.finite_bytes), (7, 2));
        let s = ByteSummary::over([&a, &b]);
        assert_eq!(s.scored_bytes, 11);
        assert!((s.bits_per_byte - 10.0 / 6.0).abs() < 1e-14, "{}", s.bits_per_byte);
        // Clustered: (n, S/ln2) = (4, 4), (2, 6); m = 10/6; residuals 4 - 40/6, 6 - 20/6.
        let m: f64 = 10.0 / 6.0;
        let want = (2.0f64 * ((4.0 - 4.0 * m).powi(2) + (6.0 - 2.0 * m).powi(2))).sqrt() / 6.0;
        assert!((s.bits_per_byte_se_clustered.unwrap() - want).abs() < 1e-12);
    }
}
