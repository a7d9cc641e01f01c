//! Text excerpts of the windows that moved most (`compare --model ARTIFACT`).
//!
//! Reports hold no tokens, only positions and fingerprints, so the excerpt is
//! rebuilt: the stream is read again from what BASE's workload recorded (the
//! corpus manifest and data root, or the `--text` / `--tokens` file),
//! tokenized with the artifact's tokenizer, checked against the stream's
//! `token_ids_sha256`, and the window's scored targets are decoded. Anything
//! that fails leaves a note and the token range instead; it never fails the
//! comparison.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::input::{ReportView, WindowRow};
use crate::artifact::Artifact;
use crate::report::worst::clip;
use crate::text::corpus;
use crate::text::tokenizer::{token_ids_sha256, TextTokenizer};

/// Characters of decoded text per excerpt.
pub const EXCERPT_CHARS: usize = 100;

/// Decoded excerpts keyed by `(stream_index, window index)`, plus notes about
/// streams that could not be rebuilt.
pub fn excerpts(
    model: &Path,
    data_root: Option<&Path>,
    base: &ReportView,
    rows: &[&WindowRow],
) -> (BTreeMap<(usize, usize), String>, Vec<String>) {
    let mut out = BTreeMap::new();
    let mut notes = Vec::new();
    let tokenizer = match open_tokenizer(model) {
        Ok(t) => t,
        Err(e) => {
            notes.push(format!("no excerpts: {e:#}"));
            return (out, notes);
        }
    };
    let mut streams: Vec<usize> = rows.iter().map(|r| r.stream_index).collect();
    streams.sort_unstable();
    streams.dedup();
    for si in streams {
        let stream = &base.streams[si];
        match stream_tokens(&tokenizer, data_root, base, si) {
            Ok(tokens) => {
                for r in rows.iter().filter(|r| r.stream_index == si) {
                    let ids = tokens.get(r.first_target..r.end).unwrap_or(&[]);
                    out.insert((si, r.index), clip(&tokenizer.decode(ids), EXCERPT_CHARS));
                }
            }
            Err(e) => notes.push(format!("no excerpts for stream '{}': {e:#}", stream.name)),
        }
    }
    (out, notes)
}

fn open_tokenizer(model: &Path) -> Result<TextTokenizer> {
    let artifact = Artifact::open(model)?;
    TextTokenizer::from_json(artifact.tokenizer_json(), &artifact.meta.tokenizer)
        .with_context(|| format!("{}: tokenizer", model.display()))
}

/// The stream's token ids, rebuilt from BASE's workload and checked against
/// its recorded fingerprint.
fn stream_tokens(tok: &TextTokenizer, data_root: Option<&Path>, base: &ReportView, si: usize) -> Result<Vec<u32>> {
    let stream = &base.streams[si];
    let w = &base.workload;
    let tokens = match w.input.as_str() {
        "corpus" => {
            let c = w.corpus.as_ref().context("the report's workload has no corpus block")?;
            let manifest_path = PathBuf::from(&c.manifest);
            // The bundled corpus (recorded as corpus::BUNDLED_MANIFEST) needs no data root.
            let root = data_root.map(Path::to_path_buf).or_else(|| Some(PathBuf::from(&c.data_root)));
            let (manifest, files) = corpus::open_corpus(Some(&manifest_path), root.as_deref())?;
            let spec = manifest
                .streams
                .iter()
                .find(|s| s.id == stream.name)
                .with_context(|| format!("manifest {} has no stream '{}'", c.manifest, stream.name))?;
            tok.encode(&files.read(spec)?)?
        }
        "text" | "tokens" => {
            let p = w.input_path.as_ref().context("the report does not record its input file (workload.input_path)")?;
            if w.input == "text" {
                tok.encode(&corpus::read_text_file(Path::new(p))?)?
            } else {
                corpus::read_tokens_file(Path::new(p))?
            }
        }
        other => bail!("unknown workload input '{other}'"),
    };
    let got = token_ids_sha256(&tokens);
    if got != stream.token_ids_sha256 {
        bail!("re-tokenized ids have sha256 {got}, the report recorded {} (another tokenizer or file?)", stream.token_ids_sha256);
    }
    Ok(tokens)
}
