//! The evaluator's tokenizer: a Hugging Face `tokenizers` tokenizer loaded
//! from the artifact's tokenizer.json blob plus the artifact's BOS/EOS policy.
//!
//! Encoding never parses special-token text (like `llama-tokenize
//! --no-parse-special`) and ignores any post-processor: BOS/EOS come only
//! from the policy, so they are never doubled. The text is taken as given
//! (reading files as raw UTF-8 bytes, CRLF and BOM kept, is the caller's job).
//!
//! `encode` runs the crate's own pipeline (added tokens and normalizer, then
//! pre-tokenizer, then the model on each piece) with the model step spread
//! over threads; `encode_reference` is its plain twin, the crate's `encode`.

use anyhow::{anyhow, bail, Result};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use tokenizers::{Model, OffsetReferential, OffsetType, PostProcessorWrapper, PreTokenizer, Tokenizer};

use crate::artifact::meta::TokenizerMeta;

pub struct TextTokenizer {
    inner: Tokenizer,
    /// Prepended when the policy adds BOS.
    bos: Option<u32>,
    /// Appended when the policy adds EOS.
    eos: Option<u32>,
}

impl TextTokenizer {
    /// Loads tokenizer.json bytes and checks the policy against the vocabulary.
    pub fn from_json(json: &[u8], policy: &TokenizerMeta) -> Result<Self> {
        let mut inner = Tokenizer::from_bytes(json).map_err(|e| anyhow!("parse tokenizer.json: {e}"))?;
        inner.with_post_processor(None::<PostProcessorWrapper>);
        inner.set_encode_special_tokens(true);
        let n_vocab = inner.get_vocab_size(true);
        let check = |what: &str, add: bool, id: Option<u32>| -> Result<Option<u32>> {
            match (add, id) {
                (false, _) => Ok(None),
                (true, None) => bail!("tokenizer policy adds {what} but has no {what} id"),
                (true, Some(id)) if id as usize >= n_vocab => {
                    bail!("tokenizer policy: {what} id {id} is outside the vocabulary ({n_vocab} tokens)")
                }
                (true, Some(id)) => Ok(Some(id)),
            }
        };
        let bos = check("BOS", policy.add_bos, policy.bos_id)?;
        let eos = check("EOS", policy.add_eos, policy.eos_id)?;
        Ok(Self { inner, bos, eos })
    }

    /// Token ids of `text`, with BOS/EOS as the policy says. Texts above
    /// [`MAX_TEXT_BYTES`] are refused (the tokenizer's memory grows about
    /// 150-fold with some inputs: 50 MB of NUL bytes took 7.3 GB).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        check_text_size(text.len() as u64)?;
        let mut pieces =
            self.inner.get_added_vocabulary().extract_and_normalize(self.inner.get_normalizer(), text);
        if let Some(pre) = self.inner.get_pre_tokenizer() {
            pre.pre_tokenize(&mut pieces).map_err(|e| anyhow!("pre-tokenize: {e}"))?;
        }
        let splits = pieces.get_splits(OffsetReferential::Original, OffsetType::None);
        let model = self.inner.get_model();
        // Added tokens come with their token; every other piece goes through the model.
        let per_split: Vec<Vec<u32>> = splits
            .par_iter()
            .with_min_len(64)
            .map(|(piece, _, tokens)| match tokens {
                Some(tokens) => Ok(tokens.iter().map(|t| t.id).collect()),
                None => model
                    .tokenize(piece)
                    .map(|tokens| tokens.into_iter().map(|t| t.id).collect())
                    .map_err(|e| anyhow!("tokenize {piece:?}: {e}")),
            })
            .collect::<Result<_>>()?;
        let n_ids = per_split.iter().map(Vec::len).sum::<usize>() + 2;
        let mut ids = Vec::with_capacity(n_ids);
        ids.extend(self.bos);
        per_split.into_iter().for_each(|p| ids.extend(p));
        ids.extend(self.eos);
        Ok(ids)
    }

    /// The plain twin of `encode`: the crate's sequential `encode`.
    pub fn encode_reference(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| anyhow!("encode: {e}"))?;
        let mut ids = Vec::with_capacity(enc.len() + 2);
        ids.extend(self.bos);
        ids.extend_from_slice(enc.get_ids());
        ids.extend(self.eos);
        Ok(ids)
    }

    /// Text of `ids`, special tokens included, for excerpts in reports.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_else(|e| format!("<cannot decode {} ids: {e}>", ids.len()))
    }

    /// Vocabulary size, added tokens included.
    pub fn n_vocab(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// The largest text one stream may hold: 8 MiB, six times the largest
/// stream of the shipped corpus (wiki.test.raw, 1.3 MB). Tokenized in one
/// piece (token ids identical to llama.cpp's), a text's tokenizer memory is
/// bounded by about 150 times this (1.2 GB); longer texts are split into
/// several streams by the user, never silently here.
pub const MAX_TEXT_BYTES: u64 = 8 << 20;

/// Refuses a text above [`MAX_TEXT_BYTES`].
pub fn check_text_size(n_bytes: u64) -> Result<()> {
    if n_bytes > MAX_TEXT_BYTES {
        anyhow::bail!("text of {n_bytes} bytes is larger than the limit of {MAX_TEXT_BYTES} bytes per stream (split it into several streams)");
    }
    Ok(())
}

/// SHA-256 (lowercase hex) of the ids as u32 little-endian, the form of
/// `shared/reference/llama-cpp-token-ids.txt`.
pub fn token_ids_sha256(ids: &[u32]) -> String {
    let mut h = Sha256::new();
    for id in ids {
        h.update(id.to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::gguf::{GgufFile, GgufValue, GgufWriter};
    use crate::convert::tokenizer::tokenizer_from_gguf;

    fn strings(v: &[String]) -> GgufValue {
        GgufValue::Array(v.iter().map(|s| GgufValue::String(s.clone())).collect())
    }

    fn build(dir: &std::path::Path, metadata: Vec<(&str, GgufValue)>) -> TextTokenizer {
        let path = dir.join("t.gguf");
        let metadata = metadata.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        std::fs::write(&path, GgufWriter { metadata, tensors: vec![] }.to_bytes()).unwrap();
        let g = GgufFile::open(&path).unwrap();
        let (json, meta) = tokenizer_from_gguf(&g).unwrap();
        TextTokenizer::from_json(&json, &meta).unwrap()
    }

    /// A tiny SentencePiece vocabulary in the style of Gemma-3: control
    /// tokens, user-defined newline/space runs, byte tokens, scored pieces.
    fn spm(dir: &std::path::Path, add_space_prefix: bool) -> (TextTokenizer, Vec<String>) {
        let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"].map(String::from).to_vec();
        let mut types = vec![3, 3, 3, 2];
        for (t, ty) in [("\n", 4), ("\n\n", 4), ("  ", 4)] {
            tokens.push(t.to_string());
            types.push(ty);
        }
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
        }
        for t in ["▁", "a", "b", "s", "o", "▁a", "ab", "▁ab", "ba"] {
            tokens.push(t.to_string());
            types.push(1);
        }
        // Later pieces score lower, as in SentencePiece models.
        let scores = (0..tokens.len()).map(|i| GgufValue::F32(-(i as f32))).collect();
        let tk = build(
            dir,
            vec![
                ("tokenizer.ggml.model", GgufValue::String("llama".into())),
                ("tokenizer.ggml.pre", GgufValue::String("default".into())),
                ("tokenizer.ggml.tokens", strings(&tokens)),
                ("tokenizer.ggml.scores", GgufValue::Array(scores)),
                (
                    "tokenizer.ggml.token_type",
                    GgufValue::Array(types.into_iter().map(GgufValue::I32).collect()),
                ),
                ("tokenizer.ggml.bos_token_id", GgufValue::U32(2)),
                ("tokenizer.ggml.add_bos_token", GgufValue::Bool(true)),
                ("tokenizer.ggml.add_space_prefix", GgufValue::Bool(add_space_prefix)),
            ],
        );
        (tk, tokens)
    }

    fn pieces(tokens: &[String], ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&i| tokens[i as usize].clone()).collect()
    }

    #[test]
    fn spm_bos_spaces_added_tokens_crlf_and_byte_fallback() {
        let dir = tempfile::tempdir().unwrap();
        let (tk, tokens) = spm(dir.path(), false);
        let enc = |s: &str| pieces(&tokens, &tk.encode(s).unwrap());
        // BOS first; "▁ab" is preferred over "▁a"+"b" because merge "▁a"+"b" exists.
        assert_eq!(enc("ab ab"), ["<bos>", "ab", "▁ab"]);
        // Two spaces are a user-defined token matched on the raw text, before "▁".
        assert_eq!(enc("a  ab"), ["<bos>", "a", "  ", "ab"]);
        assert_eq!(enc(" a"), ["<bos>", "▁a"]);
        // CR has no piece: byte fallback; LF runs are user-defined tokens.
        assert_eq!(enc("a\r\n\nb"), ["<bos>", "a", "<0x0D>", "\n\n", "b"]);
        // "é" is not in the vocabulary: its UTF-8 bytes.
        assert_eq!(enc("é"), ["<bos>", "<0xC3>", "<0xA9>"]);
        // Special-token text is plain text.
        let ids = tk.encode("<bos>").unwrap();
        assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1, "{:?}", pieces(&tokens, &ids));
        assert_eq!(tk.decode(&tk.encode("ab ab\né").unwrap()[1..]), "ab ab\né");
    }

    #[test]
    fn spm_space_prefix_goes_before_every_raw_text_fragment() {
        let dir = tempfile::tempdir().unwrap();
        let (tk, tokens) = spm(dir.path(), true);
        let ids = tk.encode("ab\nab").unwrap();
        // llama.cpp prefixes a space to each fragment after the start or a user-defined token.
        assert_eq!(pieces(&tokens, &ids), ["<bos>", "▁ab", "\n", "▁ab"]);
        assert_eq!(tk.decode(&ids[1..2]), "ab");
    }

    fn byte_chars() -> Vec<char> {
        // GPT-2's byte-to-unicode table: printable bytes map to themselves,
        // the rest to 256.. in byte order.
        let mut out = vec!['\0'; 256];
        let mut n = 0;
        for b in 0..256u32 {
            let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
            out[b as usize] = if printable {
                char::from_u32(b).unwrap()
            } else {
                n += 1;
                char::from_u32(255 + n).unwrap()
            };
        }
        out
    }

    fn gpt2(dir: &std::path::Path, pre: &str) -> (TextTokenizer, Vec<String>) {
        let mut tokens: Vec<String> = byte_chars().iter().map(|c| c.to_string()).collect();
        let merges = ["Ġ Ġ", "Ġ a", "1 2", "a b", "Ġa b", "Ċ Ċ"];
        for m in merges {
            tokens.push(m.replace(' ', ""));
        }
        tokens.push("<|endoftext|>".to_string());
        let mut types = vec![GgufValue::I32(1); tokens.len() - 1];
        types.push(GgufValue::I32(3));
        let tk = build(
            dir,
            vec![
                ("tokenizer.ggml.model", GgufValue::String("gpt2".into())),
                ("tokenizer.ggml.pre", GgufValue::String(pre.into())),
                ("tokenizer.ggml.tokens", strings(&tokens)),
                ("tokenizer.ggml.token_type", GgufValue::Array(types)),
                ("tokenizer.ggml.merges", strings(&merges.map(String::from))),
                ("tokenizer.ggml.bos_token_id", GgufValue::U32(tokens.len() as u32 - 1)),
                ("tokenizer.ggml.add_bos_token", GgufValue::Bool(false)),
            ],
        );
        (tk, tokens)
    }

    #[test]
    fn gpt2_smollm_digits_spaces_crlf() {
        let dir = tempfile::tempdir().unwrap();
        let (tk, tokens) = gpt2(dir.path(), "smollm");
        let enc = |s: &str| pieces(&tokens, &tk.encode(s).unwrap());
        // smollm splits every digit, so the merge "1 2" never applies; no BOS.
        assert_eq!(enc("12"), ["1", "2"]);
        assert_eq!(enc(" ab"), ["Ġab"]);
        // "\s+(?!\S)": the last space of a run goes with the word.
        assert_eq!(enc("a   ab"), ["a", "ĠĠ", "Ġab"]);
        // "\s+(?!\S)" leaves the last LF before "b" alone: no "ĊĊ" although the merge exists.
        assert_eq!(enc("a\r\n\nb"), ["a", "č", "Ċ", "Ċ", "b"]);
        // No special-token parsing.
        assert!(!tk.encode("<|endoftext|>").unwrap().contains(&(tokens.len() as u32 - 1)));
        assert_eq!(tk.decode(&tk.encode("a\r\n 12 é").unwrap()), "a\r\n 12 é");
        // gpt-2 keeps digit runs together.
        let dir2 = tempfile::tempdir().unwrap();
        let (tk2, tokens2) = gpt2(dir2.path(), "gpt-2");
        assert_eq!(pieces(&tokens2, &tk2.encode("12").unwrap()), ["12"]);
    }

    #[test]
    fn parallel_encode_equals_the_crate_encode() {
        let dir = tempfile::tempdir().unwrap();
        let (spm_tk, _) = spm(dir.path(), false);
        let dir2 = tempfile::tempdir().unwrap();
        let (gpt_tk, _) = gpt2(dir2.path(), "smollm");
        let text = "ab ab\r\n\n  a  b 12 é\u{feff}<bos> \t\n".repeat(500);
        for tk in [&spm_tk, &gpt_tk] {
            let ids = tk.encode(&text).unwrap();
            assert!(ids.len() > 5000);
            assert_eq!(ids, tk.encode_reference(&text).unwrap());
        }
    }

    #[test]
    fn policy_without_bos_id_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let tokens: Vec<String> = ["a", "b", "ab"].map(String::from).to_vec();
        let metadata = vec![
            ("tokenizer.ggml.model".to_string(), GgufValue::String("gpt2".into())),
            ("tokenizer.ggml.pre".to_string(), GgufValue::String("gpt-2".into())),
            ("tokenizer.ggml.tokens".to_string(), strings(&tokens)),
            ("tokenizer.ggml.merges".to_string(), strings(&["a b".to_string()])),
        ];
        std::fs::write(&path, GgufWriter { metadata, tensors: vec![] }.to_bytes()).unwrap();
        let (json, mut meta) = tokenizer_from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        meta.add_bos = true;
        let err = TextTokenizer::from_json(&json, &meta).err().unwrap().to_string();
        assert!(err.contains("BOS"), "{err}");
        meta.bos_id = Some(3);
        let err = TextTokenizer::from_json(&json, &meta).err().unwrap().to_string();
        assert!(err.contains("id 3"), "{err}");
    }

    #[test]
    fn sha256_of_ids_is_little_endian_u32() {
        // sha256 of the 8 bytes 01 00 00 00 02 01 00 00 (python: hashlib.sha256(struct.pack("<2I", 1, 258))).
        let expected = {
            let mut h = Sha256::new();
            h.update([1u8, 0, 0, 0, 2, 1, 0, 0]);
            h.finalize().iter().map(|b| format!("{b:02x}")).collect::<String>()
        };
        assert_eq!(token_ids_sha256(&[1, 258]), expected);
        // sha256 of the empty input.
        assert_eq!(token_ids_sha256(&[]), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    }
}
