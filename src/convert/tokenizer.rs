//! Tokenizer conversion: builds a Hugging Face `tokenizer.json` from GGUF
//! tokenizer metadata so that `text::tokenizer::TextTokenizer` gives the same
//! token ids as llama.cpp, and reads the tokenizer policy (BOS/EOS) of a
//! Hugging Face folder.
//!
//! Two GGUF vocabulary kinds are supported:
//! - `gpt2` (byte-level BPE): the GGUF vocabulary and merges, with
//!   llama.cpp's pre-tokenizer regexes for `tokenizer.ggml.pre` applied in
//!   order as isolating splits, then the byte-level mapping.
//! - `llama` (SentencePiece BPE, e.g. Gemma-3): a BPE model with byte
//!   fallback whose merges are every split of a vocabulary piece into two
//!   vocabulary pieces, ranked by the merged piece's score (llama.cpp's SPM
//!   tokenizer merges the adjacent pair whose concatenation scores highest);
//!   spaces normalized to `▁`; user-defined tokens (type 4) matched first, on
//!   the raw text, as added tokens.
//!
//! Control tokens are never added tokens: like `llama-tokenize
//! --no-parse-special`, their text in a corpus is tokenized as plain text.
//! BOS/EOS are not in the tokenizer.json (no post-processor): the policy is
//! returned as `TokenizerMeta` and applied by the text tokenizer.
//! Checked against llama.cpp b11434 on every corpus file
//! (`tests/token_parity.rs`, `shared/reference/llama-cpp-token-ids.txt`).
//!
//! It does not own reading text or encoding (`text::tokenizer`), nor writing
//! the blob into the artifact (`artifact::writer`).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::{json, Value};

use super::gguf::{GgufFile, GgufValue};
use crate::artifact::meta::{BlobRef, TokenizerMeta};

/// SentencePiece's escaped space, U+2581.
const SPM_SPACE: &str = "\u{2581}";

/// llama.cpp token types (`tokenizer.ggml.token_type`).
const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

// Pre-tokenizer regexes, copied from llama.cpp's `llm_tokenizer_bpe`
// constructor (src/llama-vocab.cpp, b11434). llama.cpp applies the list in
// order, each regex splitting the pieces of the previous one into matches and
// the gaps between them; a `Split` pre-tokenizer with `Isolated` behaviour per
// regex does the same.

/// GPT-2's pattern as llama.cpp writes it (without the final `|\s+`: a gap
/// becomes its own piece anyway).
const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Every digit on its own (starcoder / smollm family).
const RE_DIGIT: &str = r"\p{N}";
const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_DEFAULT: [&str; 4] = [r"[\p{P}\$\+<=>\^~\|]+", RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];

/// How llama.cpp pre-tokenizes one `tokenizer.ggml.pre` family.
struct BpePre {
    regexes: &'static [&'static str],
    /// A word found whole in the vocabulary is one token, merges unused.
    ignore_merges: bool,
    /// llama.cpp's default when `tokenizer.ggml.add_bos_token` is absent.
    default_add_bos: bool,
}

/// The pre-tokenizer families we support, with llama.cpp's name groupings.
fn bpe_pre(pre: &str) -> Option<BpePre> {
    let plain = |regexes| Some(BpePre { regexes, ignore_merges: false, default_add_bos: false });
    match pre {
        "default" => plain(&RE_DEFAULT),
        "gpt-2" | "phi-2" | "mpt" | "olmo" => plain(&[RE_GPT2]),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            plain(&[RE_DIGIT, RE_GPT2])
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => {
            Some(BpePre { regexes: &[RE_LLAMA3], ignore_merges: true, default_add_bos: true })
        }
        "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" => plain(&[RE_QWEN2]),
        _ => None,
    }
}

const SUPPORTED_PRE: &str = "default, gpt-2, phi-2, mpt, olmo, smollm, starcoder, refact, command-r, \
codeshell, exaone, minerva-7b, llama3, llama-v3, llama-bpe, falcon3, pixtral, qwen2, \
deepseek-r1-qwen, megrez, stablelm2";

/// The GGUF vocabulary, validated.
struct Vocab {
    tokens: Vec<String>,
    types: Vec<i32>,
    scores: Option<Vec<f64>>,
}

impl Vocab {
    fn read(g: &GgufFile) -> Result<Self> {
        let file = g.path.display();
        let raw = g.get_array("tokenizer.ggml.tokens")?;
        let mut tokens = Vec::with_capacity(raw.len());
        for (i, v) in raw.iter().enumerate() {
            let s =
                v.as_str().ok_or_else(|| anyhow!("{file}: tokenizer.ggml.tokens[{i}] is not a string"))?;
            // llama.cpp renames empty pieces the same way.
            tokens.push(if s.is_empty() { format!("[EMPTY_{i}]") } else { s.to_string() });
        }
        let n_vocab = tokens.len();
        if n_vocab == 0 {
            bail!("{file}: tokenizer.ggml.tokens is empty");
        }
        let mut seen: HashMap<&str, usize> = HashMap::with_capacity(n_vocab);
        for (i, t) in tokens.iter().enumerate() {
            if let Some(first) = seen.insert(t, i) {
                bail!("{file}: tokenizer.ggml.tokens: {t:?} appears at ids {first} and {i}");
            }
        }
        let types = match g.get("tokenizer.ggml.token_type") {
            None => vec![TOKEN_TYPE_NORMAL; n_vocab],
            Some(v) => {
                let a = v
                    .as_array()
                    .ok_or_else(|| anyhow!("{file}: tokenizer.ggml.token_type is not an array"))?;
                if a.len() < n_vocab {
                    bail!("{file}: tokenizer.ggml.token_type has {} entries, vocabulary {n_vocab}", a.len());
                }
                a[..n_vocab]
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        t.as_i64().and_then(|t| i32::try_from(t).ok()).ok_or_else(|| {
                            anyhow!("{file}: tokenizer.ggml.token_type[{i}] is not an integer")
                        })
                    })
                    .collect::<Result<Vec<_>>>()?
            }
        };
        let scores = match g.get("tokenizer.ggml.scores") {
            None => None,
            Some(v) => {
                let a =
                    v.as_array().ok_or_else(|| anyhow!("{file}: tokenizer.ggml.scores is not an array"))?;
                if a.len() < n_vocab {
                    bail!("{file}: tokenizer.ggml.scores has {} entries, vocabulary {n_vocab}", a.len());
                }
                let s = a[..n_vocab]
                    .iter()
                    .enumerate()
                    .map(|(i, s)| match s {
                        // llama.cpp keeps scores as f32: rank by exactly that value.
                        GgufValue::F32(x) => Ok(f64::from(*x)),
                        GgufValue::I32(x) => Ok(f64::from(*x as f32)),
                        _ => Err(anyhow!("{file}: tokenizer.ggml.scores[{i}] is not f32 or i32")),
                    })
                    .collect::<Result<Vec<_>>>()?;
                Some(s)
            }
        };
        Ok(Self { tokens, types, scores })
    }

    fn index(&self) -> HashMap<&str, u32> {
        self.tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i as u32)).collect()
    }

    /// User-defined tokens, matched on the raw text before the model runs
    /// (llama.cpp partitions them out even with special-token parsing off).
    fn added_tokens(&self) -> Vec<AddedTokenJson<'_>> {
        self.tokens
            .iter()
            .zip(&self.types)
            .enumerate()
            .filter(|(_, (_, &ty))| ty == TOKEN_TYPE_USER_DEFINED)
            .map(|(id, (content, _))| AddedTokenJson {
                id: id as u32,
                content,
                single_word: false,
                lstrip: false,
                rstrip: false,
                normalized: false,
                special: false,
            })
            .collect()
    }
}

/// The vocabulary as a JSON object, written in id order.
struct VocabJson<'a>(&'a [String]);

impl Serialize for VocabJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (id, t) in self.0.iter().enumerate() {
            m.serialize_entry(t, &(id as u32))?;
        }
        m.end()
    }
}

#[derive(Serialize)]
struct AddedTokenJson<'a> {
    id: u32,
    content: &'a str,
    single_word: bool,
    lstrip: bool,
    rstrip: bool,
    normalized: bool,
    special: bool,
}

#[derive(Serialize)]
struct BpeJson<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    dropout: Option<f64>,
    unk_token: Option<&'a str>,
    continuing_subword_prefix: Option<&'a str>,
    end_of_word_suffix: Option<&'a str>,
    fuse_unk: bool,
    byte_fallback: bool,
    ignore_merges: bool,
    vocab: VocabJson<'a>,
    /// Pairs, not "a b" strings, so pieces containing spaces stay unambiguous.
    merges: Vec<(&'a str, &'a str)>,
}

#[derive(Serialize)]
struct TokenizerJson<'a> {
    version: &'static str,
    truncation: Option<Value>,
    padding: Option<Value>,
    added_tokens: Vec<AddedTokenJson<'a>>,
    normalizer: Option<Value>,
    pre_tokenizer: Option<Value>,
    /// None: BOS/EOS are the caller's policy (`TokenizerMeta`).
    post_processor: Option<Value>,
    decoder: Option<Value>,
    model: BpeJson<'a>,
}

/// Builds the tokenizer.json bytes and the BOS/EOS policy for a GGUF file.
/// `blob` is left empty for the artifact writer to fill.
pub fn tokenizer_from_gguf(g: &GgufFile) -> Result<(Vec<u8>, TokenizerMeta)> {
    let file = g.path.display();
    let model = g.get_str("tokenizer.ggml.model")?;
    let pre = match g.get("tokenizer.ggml.pre") {
        None => None,
        Some(v) => Some(
            v.as_str()
                .ok_or_else(|| anyhow!("{file}: metadata tokenizer.ggml.pre is not a string"))?
                .to_string(),
        ),
    };
    let vocab = Vocab::read(g)?;
    let n_vocab = vocab.tokens.len();
    let (json, default_add_bos, default_bos, default_eos) = match model {
        "gpt2" => {
            // llama.cpp falls back to "default" (with a warning) when the key is absent.
            let pre_name = pre.as_deref().unwrap_or("default");
            let spec = bpe_pre(pre_name).ok_or_else(|| {
                anyhow!(
                    "{file}: tokenizer.ggml.pre {pre_name:?} is not supported (supported: {SUPPORTED_PRE})"
                )
            })?;
            (gpt2_json(g, &vocab, &spec)?, spec.default_add_bos, None, None)
        }
        "llama" => {
            let add_space_prefix = optional_bool(g, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
            (spm_json(g, &vocab, add_space_prefix)?, true, Some(1), Some(2))
        }
        other => bail!("{file}: tokenizer.ggml.model {other:?} is not supported (supported: gpt2, llama)"),
    };
    let special_id = |key: &str, default: Option<u32>| -> Result<Option<u32>> {
        match g.get(key) {
            None => Ok(default.filter(|&id| (id as usize) < n_vocab)),
            Some(v) => {
                let id = v
                    .as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| anyhow!("{file}: metadata {key} is not a token id"))?;
                if id as usize >= n_vocab {
                    bail!("{file}: metadata {key} = {id} is outside the vocabulary ({n_vocab} tokens)");
                }
                Ok(Some(id))
            }
        }
    };
    let bos_id = special_id("tokenizer.ggml.bos_token_id", default_bos)?;
    let eos_id = special_id("tokenizer.ggml.eos_token_id", default_eos)?;
    let add_bos = optional_bool(g, "tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);
    let add_eos = optional_bool(g, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    if add_bos && bos_id.is_none() {
        bail!("{file}: the vocabulary adds BOS but tokenizer.ggml.bos_token_id is not set");
    }
    if add_eos && eos_id.is_none() {
        bail!("{file}: the vocabulary adds EOS but tokenizer.ggml.eos_token_id is not set");
    }
    let meta = TokenizerMeta {
        kind: model.to_string(),
        pre,
        bos_id,
        eos_id,
        add_bos,
        add_eos,
        blob: BlobRef { offset: 0, n_bytes: 0, sha256: String::new() },
    };
    Ok((json, meta))
}

fn optional_bool(g: &GgufFile, key: &str) -> Result<Option<bool>> {
    g.get(key)
        .map(|v| v.as_bool().ok_or_else(|| anyhow!("{}: metadata {key} is not a bool", g.path.display())))
        .transpose()
}

fn gpt2_json(g: &GgufFile, vocab: &Vocab, spec: &BpePre) -> Result<Vec<u8>> {
    let file = g.path.display();
    let index = vocab.index();
    let raw = g.get_array("tokenizer.ggml.merges")?;
    let mut merges = Vec::with_capacity(raw.len());
    for (i, m) in raw.iter().enumerate() {
        let m = m.as_str().ok_or_else(|| anyhow!("{file}: tokenizer.ggml.merges[{i}] is not a string"))?;
        // llama.cpp splits at the first space after the first byte.
        // (bytes: a space is ASCII, so the split is on a char boundary).
        let pos = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
        let (a, b) = match pos {
            Some(p) => (&m[..p], &m[p + 1..]),
            None => bail!("{file}: tokenizer.ggml.merges[{i}] {m:?} has no space"),
        };
        let merged = format!("{a}{b}");
        for piece in [a, b, merged.as_str()] {
            if !index.contains_key(piece) {
                bail!("{file}: tokenizer.ggml.merges[{i}] {m:?}: {piece:?} is not in the vocabulary");
            }
        }
        merges.push((a, b));
    }
    let mut pretokenizers: Vec<Value> = spec
        .regexes
        .iter()
        .map(|re| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false}))
        .collect();
    let byte_level =
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    pretokenizers.push(byte_level.clone());
    let doc = TokenizerJson {
        version: "1.0",
        truncation: None,
        padding: None,
        added_tokens: vocab.added_tokens(),
        normalizer: None,
        pre_tokenizer: Some(json!({"type": "Sequence", "pretokenizers": pretokenizers})),
        post_processor: None,
        decoder: Some(byte_level),
        model: BpeJson {
            kind: "BPE",
            dropout: None,
            unk_token: None,
            continuing_subword_prefix: None,
            end_of_word_suffix: None,
            fuse_unk: false,
            byte_fallback: false,
            ignore_merges: spec.ignore_merges,
            vocab: VocabJson(&vocab.tokens),
            merges,
        },
    };
    serde_json::to_vec(&doc).context("serialize tokenizer.json")
}

/// BPE merges equivalent to llama.cpp's SentencePiece tokenizer: every way of
/// writing a vocabulary piece as two vocabulary pieces, ranked by the merged
/// piece's score (highest first; ties by id, then by the left piece's length).
fn spm_merges<'a>(tokens: &'a [String], scores: &[f64]) -> Vec<(&'a str, &'a str)> {
    let index: HashMap<&str, u32> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i as u32)).collect();
    // (merged id, split byte offset)
    let mut found: Vec<(u32, usize)> = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        for (k, _) in t.char_indices().skip(1) {
            if index.contains_key(&t[..k]) && index.contains_key(&t[k..]) {
                found.push((id as u32, k));
            }
        }
    }
    found.sort_by(|&(ia, ka), &(ib, kb)| {
        scores[ib as usize].total_cmp(&scores[ia as usize]).then(ia.cmp(&ib)).then(ka.cmp(&kb))
    });
    found
        .into_iter()
        .map(|(id, k)| {
            let t = tokens[id as usize].as_str();
            (&t[..k], &t[k..])
        })
        .collect()
}

fn spm_json(g: &GgufFile, vocab: &Vocab, add_space_prefix: bool) -> Result<Vec<u8>> {
    let file = g.path.display();
    let scores = vocab.scores.as_deref().ok_or_else(|| {
        anyhow!("{file}: tokenizer.ggml.model is llama but tokenizer.ggml.scores is missing")
    })?;
    let merges = spm_merges(&vocab.tokens, scores);
    let unk_token = g
        .get("tokenizer.ggml.unknown_token_id")
        .map(|v| {
            v.as_u64()
                .ok_or_else(|| anyhow!("{file}: metadata tokenizer.ggml.unknown_token_id is not an integer"))
        })
        .transpose()?
        .or(Some(0))
        .and_then(|id| vocab.tokens.get(id as usize))
        .map(String::as_str);
    let replace_space = json!({"type": "Replace", "pattern": {"String": " "}, "content": SPM_SPACE});
    // llama.cpp prefixes every raw-text fragment (each one follows the start
    // or a user-defined token) with a space when add_space_prefix is set.
    let normalizer = if add_space_prefix {
        json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPM_SPACE}, replace_space]})
    } else {
        replace_space
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let doc = TokenizerJson {
        version: "1.0",
        truncation: None,
        padding: None,
        added_tokens: vocab.added_tokens(),
        normalizer: Some(normalizer),
        pre_tokenizer: None,
        post_processor: None,
        decoder: Some(json!({"type": "Sequence", "decoders": decoders})),
        model: BpeJson {
            kind: "BPE",
            dropout: None,
            unk_token,
            continuing_subword_prefix: None,
            end_of_word_suffix: None,
            fuse_unk: false,
            byte_fallback: true,
            ignore_merges: false,
            vocab: VocabJson(&vocab.tokens),
            merges,
        },
    };
    serde_json::to_vec(&doc).context("serialize tokenizer.json")
}

/// The BOS/EOS policy of a Hugging Face folder: `tokenizer_config.json`'s
/// `add_bos_token` / `add_eos_token` (else what tokenizer.json's
/// post-processor template adds), token ids resolved through tokenizer.json's
/// added tokens and vocabulary, `config.json`'s `bos_token_id` /
/// `eos_token_id` as fallback.
pub fn tokenizer_policy_from_hf(folder: &Path) -> Result<TokenizerMeta> {
    let tok_path = folder.join("tokenizer.json");
    if !tok_path.is_file() {
        bail!("{}: tokenizer.json is missing (needed for the tokenizer)", folder.display());
    }
    let tok = read_json(&tok_path)?;
    let tok_config = read_optional_json(&folder.join("tokenizer_config.json"))?;
    let config = read_optional_json(&folder.join("config.json"))?;

    let resolve = |field: &str| -> Result<Option<u32>> {
        let Some(cfg) = &tok_config else { return Ok(None) };
        let content = match cfg.get(field) {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(s)) => s.as_str(),
            Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).ok_or_else(|| {
                anyhow!(
                    "{}: {field} has no \"content\" string",
                    folder.join("tokenizer_config.json").display()
                )
            })?,
            Some(other) => bail!(
                "{}: {field} is neither a string nor an object: {other}",
                folder.join("tokenizer_config.json").display()
            ),
        };
        token_id_in_tokenizer_json(&tok, content).map(Some).ok_or_else(|| {
            anyhow!("{}: {field} {content:?} is not a token of tokenizer.json", folder.display())
        })
    };
    let config_id = |field: &str| -> Option<u32> {
        let v = config.as_ref()?.get(field)?;
        let v = match v {
            Value::Array(a) => a.first()?,
            v => v,
        };
        v.as_u64().and_then(|id| u32::try_from(id).ok())
    };
    let bos_id = resolve("bos_token")?.or_else(|| config_id("bos_token_id"));
    let eos_id = resolve("eos_token")?.or_else(|| config_id("eos_token_id"));
    let config_flag = |field: &str| -> Result<Option<bool>> {
        match tok_config.as_ref().and_then(|c| c.get(field)) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => {
                bail!("{}: {field} is not a bool: {other}", folder.join("tokenizer_config.json").display())
            }
        }
    };
    let (template_bos, template_eos) = template_adds(&tok, bos_id, eos_id);
    let add_bos = config_flag("add_bos_token")?.unwrap_or(template_bos);
    let add_eos = config_flag("add_eos_token")?.unwrap_or(template_eos);
    if add_bos && bos_id.is_none() {
        bail!("{}: the tokenizer adds BOS but no BOS token id is set", folder.display());
    }
    if add_eos && eos_id.is_none() {
        bail!("{}: the tokenizer adds EOS but no EOS token id is set", folder.display());
    }
    Ok(TokenizerMeta {
        kind: "hf".to_string(),
        pre: None,
        bos_id,
        eos_id,
        add_bos,
        add_eos,
        blob: BlobRef { offset: 0, n_bytes: 0, sha256: String::new() },
    })
}

fn read_json(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parse {}", path.display()))
}

fn read_optional_json(path: &Path) -> Result<Option<Value>> {
    if path.is_file() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// The id of `content` in a tokenizer.json: added tokens first, then the
/// model's vocabulary (an object for BPE/WordPiece/WordLevel, a list of
/// `[piece, score]` for Unigram).
fn token_id_in_tokenizer_json(tok: &Value, content: &str) -> Option<u32> {
    let added = tok
        .get("added_tokens")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().find(|t| t.get("content").and_then(Value::as_str) == Some(content)));
    if let Some(id) = added.and_then(|t| t.get("id")).and_then(Value::as_u64) {
        return u32::try_from(id).ok();
    }
    match tok.get("model")?.get("vocab")? {
        Value::Object(m) => m.get(content)?.as_u64().and_then(|id| u32::try_from(id).ok()),
        Value::Array(a) => a
            .iter()
            .position(|e| e.get(0).and_then(Value::as_str) == Some(content))
            .and_then(|i| u32::try_from(i).ok()),
        _ => None,
    }
}

/// Whether tokenizer.json's `TemplateProcessing` post-processor (alone or in
/// a `Sequence`) starts the single-sequence template with BOS / ends it with EOS.
fn template_adds(tok: &Value, bos_id: Option<u32>, eos_id: Option<u32>) -> (bool, bool) {
    let Some(pp) = tok.get("post_processor") else { return (false, false) };
    let template = match pp.get("type").and_then(Value::as_str) {
        Some("TemplateProcessing") => Some(pp),
        Some("Sequence") => pp.get("processors").and_then(Value::as_array).and_then(|a| {
            a.iter().find(|p| p.get("type").and_then(Value::as_str) == Some("TemplateProcessing"))
        }),
        _ => None,
    };
    let Some(template) = template else { return (false, false) };
    let Some(single) = template.get("single").and_then(Value::as_array) else { return (false, false) };
    let special_id = |piece: Option<&Value>| -> Option<u32> {
        let name = piece?.get("SpecialToken")?.get("id")?.as_str()?;
        let ids = template.get("special_tokens")?.get(name)?.get("ids")?.as_array()?;
        ids.first()?.as_u64().and_then(|id| u32::try_from(id).ok())
    };
    let first = special_id(single.first());
    let last = special_id(single.last());
    (first.is_some() && first == bos_id, last.is_some() && last == eos_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::gguf::GgufWriter;

    fn strings(v: &[&str]) -> GgufValue {
        GgufValue::Array(v.iter().map(|s| GgufValue::String(s.to_string())).collect())
    }

    fn write_gguf(dir: &Path, metadata: Vec<(String, GgufValue)>) -> GgufFile {
        let path = dir.join("t.gguf");
        let bytes = GgufWriter { metadata, tensors: vec![] }.to_bytes();
        std::fs::write(&path, bytes).unwrap();
        GgufFile::open(&path).unwrap()
    }

    fn kv(k: &str, v: GgufValue) -> (String, GgufValue) {
        (k.to_string(), v)
    }

    #[test]
    fn spm_merges_rank_by_merged_score_and_keep_every_split() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"].iter().map(|s| s.to_string()).collect();
        let scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0];
        let merges = spm_merges(&tokens, &scores);
        // "bc" scores above "ab"; "abc" has two splits, both kept, left-short first.
        assert_eq!(merges, vec![("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]);
    }

    #[test]
    fn unknown_pre_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let g = write_gguf(
            dir.path(),
            vec![
                kv("tokenizer.ggml.model", GgufValue::String("gpt2".into())),
                kv("tokenizer.ggml.pre", GgufValue::String("no-such-pre".into())),
                kv("tokenizer.ggml.tokens", strings(&["a", "b", "ab"])),
                kv("tokenizer.ggml.merges", strings(&["a b"])),
            ],
        );
        let err = format!("{:#}", tokenizer_from_gguf(&g).unwrap_err());
        assert!(err.contains("no-such-pre"), "{err}");
    }

    #[test]
    fn unknown_model_and_duplicate_tokens_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let g = write_gguf(
            dir.path(),
            vec![
                kv("tokenizer.ggml.model", GgufValue::String("t5".into())),
                kv("tokenizer.ggml.tokens", strings(&["a"])),
            ],
        );
        let err = format!("{:#}", tokenizer_from_gguf(&g).unwrap_err());
        assert!(err.contains("\"t5\""), "{err}");
        let g = write_gguf(
            dir.path(),
            vec![
                kv("tokenizer.ggml.model", GgufValue::String("gpt2".into())),
                kv("tokenizer.ggml.tokens", strings(&["a", "b", "a"])),
                kv("tokenizer.ggml.merges", strings(&[])),
            ],
        );
        let err = format!("{:#}", tokenizer_from_gguf(&g).unwrap_err());
        assert!(err.contains("ids 0 and 2"), "{err}");
    }

    #[test]
    fn gguf_policy_reads_keys_and_llama_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let g = write_gguf(
            dir.path(),
            vec![
                kv("tokenizer.ggml.model", GgufValue::String("llama".into())),
                kv("tokenizer.ggml.tokens", strings(&["<unk>", "<s>", "</s>", "\u{2581}a"])),
                kv("tokenizer.ggml.scores", GgufValue::Array(vec![GgufValue::F32(0.0); 4])),
                kv("tokenizer.ggml.add_eos_token", GgufValue::Bool(true)),
            ],
        );
        let (json, meta) = tokenizer_from_gguf(&g).unwrap();
        assert_eq!(meta.kind, "llama");
        assert_eq!((meta.bos_id, meta.eos_id), (Some(1), Some(2)));
        assert!(meta.add_bos && meta.add_eos);
        let v: Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(v["model"]["vocab"]["\u{2581}a"], 3);
        assert!(v["post_processor"].is_null());
        // add_space_prefix defaults to true for SentencePiece vocabularies.
        assert_eq!(v["normalizer"]["type"], "Sequence");
    }

    #[test]
    fn bos_id_outside_vocabulary_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let g = write_gguf(
            dir.path(),
            vec![
                kv("tokenizer.ggml.model", GgufValue::String("gpt2".into())),
                kv("tokenizer.ggml.pre", GgufValue::String("gpt-2".into())),
                kv("tokenizer.ggml.tokens", strings(&["a", "b", "ab"])),
                kv("tokenizer.ggml.merges", strings(&["a b"])),
                kv("tokenizer.ggml.bos_token_id", GgufValue::U32(7)),
            ],
        );
        let err = format!("{:#}", tokenizer_from_gguf(&g).unwrap_err());
        assert!(err.contains("bos_token_id = 7"), "{err}");
    }

    #[test]
    fn hf_folder_without_tokenizer_json_names_folder_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = format!("{:#}", tokenizer_policy_from_hf(dir.path()).unwrap_err());
        assert!(err.contains("tokenizer.json") && err.contains(&dir.path().display().to_string()), "{err}");
    }

    #[test]
    fn hf_policy_from_config_and_template() {
        let dir = tempfile::tempdir().unwrap();
        let tok = json!({
            "added_tokens": [{"id": 5, "content": "<bos>"}, {"id": 6, "content": "<eos>"}],
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "special_tokens": {"<bos>": {"id": "<bos>", "ids": [5], "tokens": ["<bos>"]}}},
            "model": {"type": "BPE", "vocab": {"a": 0, "<eos>": 6}}
        });
        std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            json!({"bos_token": "<bos>", "eos_token": {"content": "<eos>"}}).to_string(),
        )
        .unwrap();
        let meta = tokenizer_policy_from_hf(dir.path()).unwrap();
        assert_eq!((meta.bos_id, meta.eos_id), (Some(5), Some(6)));
        // No add_bos_token key: the template's leading BOS decides.
        assert!(meta.add_bos && !meta.add_eos);
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            json!({"add_bos_token": false, "add_eos_token": true, "eos_token": "<eos>"}).to_string(),
        )
        .unwrap();
        std::fs::write(dir.path().join("config.json"), json!({"bos_token_id": 5}).to_string()).unwrap();
        let meta = tokenizer_policy_from_hf(dir.path()).unwrap();
        assert_eq!((meta.bos_id, meta.eos_id), (Some(5), Some(6)));
        assert!(!meta.add_bos && meta.add_eos);
        assert_eq!(meta.kind, "hf");
    }
}
