//! Writes a `.ninfer` v4 file atomically: the layout is computed, every
//! tensor and blob hashed, and the bytes go to `OUT.tmp-<pid>` which is renamed
//! over `OUT` only once complete.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{Context, Result};

use super::container::{align_up, encode_header, sha256_hex, HEADER_BYTES};
use super::check::check_hparams;
use super::format::TensorFormat;
use super::meta::{ArtifactMeta, BlobRef, Component, TensorEntry};
use crate::util::fs::AtomicFile;

/// A tensor to write: its entry fields and its bytes, already in `format`.
pub struct TensorSource<'a> {
    pub name: String,
    pub component: Component,
    pub format: TensorFormat,
    pub shape: Vec<u64>,
    pub bytes: std::borrow::Cow<'a, [u8]>,
}

/// Lays out and writes the artifact. `meta.tensors` and `meta.tokenizer.blob`
/// are filled in here; whatever they held is replaced.
pub fn write_artifact(
    path: &Path,
    mut meta: ArtifactMeta,
    tensors: &[TensorSource<'_>],
    tokenizer_json: &[u8],
) -> Result<ArtifactMeta> {
    // Hash in parallel: the only costly step for a multi-GB source.
    use rayon::prelude::*;
    let hashes: Vec<String> = tensors.par_iter().map(|t| sha256_hex(&t.bytes)).collect();
    for t in tensors {
        let want = t.format.bytes_for(t.shape.iter().product())?;
        anyhow::ensure!(
            want == t.bytes.len() as u64,
            "tensor {}: {} bytes, but {} of shape {:?} needs {want}",
            t.name,
            t.bytes.len(),
            t.format,
            t.shape
        );
    }
    let tok_sha = sha256_hex(tokenizer_json);

    // The JSON holds absolute offsets that depend on its own length: iterate
    // until the data section start no longer moves (two or three rounds).
    let mut data_offset = align_up(HEADER_BYTES as u64 + 4096);
    let json = loop {
        let mut pos = data_offset;
        meta.tokenizer.blob =
            BlobRef { offset: pos, n_bytes: tokenizer_json.len() as u64, sha256: tok_sha.clone() };
        pos = align_up(pos + tokenizer_json.len() as u64);
        meta.tensors = tensors
            .iter()
            .zip(&hashes)
            .map(|(t, sha)| {
                let e = TensorEntry {
                    name: t.name.clone(),
                    component: t.component,
                    format: t.format,
                    shape: t.shape.clone(),
                    offset: pos,
                    n_bytes: t.bytes.len() as u64,
                    sha256: sha.clone(),
                };
                pos = align_up(pos + t.bytes.len() as u64);
                e
            })
            .collect();
        let json = serde_json::to_vec(&meta).context("serialize artifact metadata")?;
        let need = align_up(HEADER_BYTES as u64 + json.len() as u64);
        if need <= data_offset {
            break json;
        }
        data_offset = need;
    };

    // The one hyperparameter check (also run at every open): refuse metadata that disagrees with the tensors.
    let shapes: std::collections::HashMap<&str, &[u64]> = meta.tensors.iter().map(|t| (t.name.as_str(), t.shape.as_slice())).collect();
    check_hparams(&meta.hparams, |n| shapes.get(n).copied(), shapes.keys().copied()).context("metadata")?;
    drop(shapes);

    let out = AtomicFile::create(path)?;
    {
        let mut w = BufWriter::with_capacity(1 << 22, out.file());
        let mut pos = 0u64;
        let mut put = |w: &mut BufWriter<&File>, at: u64, bytes: &[u8]| -> std::io::Result<()> {
            w.write_all(&vec![0u8; (at - pos) as usize])?;
            w.write_all(bytes)?;
            pos = at + bytes.len() as u64;
            Ok(())
        };
        let io = |e| anyhow::Error::new(e).context(format!("write {}", path.display()));
        put(&mut w, 0, &encode_header(&json, data_offset)).map_err(io)?;
        put(&mut w, HEADER_BYTES as u64, &json).map_err(io)?;
        put(&mut w, meta.tokenizer.blob.offset, tokenizer_json).map_err(io)?;
        for (t, e) in tensors.iter().zip(&meta.tensors) {
            crate::util::signal::check().with_context(|| format!("{}: stopped before tensor {}; nothing written", path.display(), t.name))?;
            put(&mut w, e.offset, &t.bytes).map_err(io)?;
        }
        w.flush().map_err(io)?;
    }
    out.commit()?;
    Ok(meta)
}
