//! Opens a `.ninfer` artifact (v4, or v3 without a metadata digest): maps
//! the file, parses the header and the metadata (checking its digest), and
//! validates every tensor entry (bounds, alignment, overlaps, format against
//! shape against byte length) and the hyperparameters against the shapes
//! (`check`) before anything reads tensor bytes. Hashing the whole file is
//! left to [`Artifact::verify`], so opening a multi-GB file takes milliseconds.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, ensure, Context, Result};
use memmap2::Mmap;

use super::check::check_hparams;
use super::container::{sha256_hex, ALIGNMENT, HEADER_BYTES, HEADER_BYTES_V3, MAGIC, VERSION, VERSION_V3};
use super::format::TensorFormat;
use super::meta::{ArtifactMeta, Component, TensorEntry};

/// A validated, memory-mapped artifact.
pub struct Artifact {
    pub path: PathBuf,
    pub meta: ArtifactMeta,
    /// SHA-256 of the metadata block: identifies the artifact (it holds every
    /// tensor's SHA-256 and the tokenizer's) without hashing the whole file.
    pub digest: String,
    /// The header carries the metadata's SHA-256 (version 4) and it matched.
    pub metadata_digest_checked: bool,
    pub n_file_bytes: u64,
    index: HashMap<String, usize>,
    mmap: Mmap,
}

/// A tensor's entry and its bytes.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    pub entry: &'a TensorEntry,
    pub bytes: &'a [u8],
}

impl TensorView<'_> {
    pub fn format(&self) -> TensorFormat {
        self.entry.format
    }
    /// `(n_rows, n_cols)` of a matrix; a vector is one row.
    pub fn rows_cols(&self) -> (usize, usize) {
        let s = &self.entry.shape;
        let n_cols = *s.last().unwrap_or(&1) as usize;
        let n_rows = s[..s.len().saturating_sub(1)].iter().product::<u64>() as usize;
        (n_rows, n_cols)
    }
    pub fn n_elems(&self) -> usize {
        self.entry.shape.iter().product::<u64>() as usize
    }
}

impl Artifact {
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_inner(path).with_context(|| format!("{}", path.display()))
    }

    fn open_inner(path: &Path) -> Result<Self> {
        let file = File::open(path).context("open")?;
        // SAFETY: read-only map; the artifact is never modified while open.
        let mmap = unsafe { Mmap::map(&file) }.context("mmap")?;
        let n_file_bytes = mmap.len() as u64;
        let parsed = parse_header_and_meta(&mmap)?;
        let (meta, digest, data_offset, metadata_digest_checked) =
            (parsed.meta, parsed.digest, parsed.data_offset, parsed.metadata_digest_checked);

        let index = check_tensor_table(&meta, data_offset, n_file_bytes)?;
        Ok(Self { path: path.to_path_buf(), meta, digest, metadata_digest_checked, n_file_bytes, index, mmap })
    }

    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| anyhow!("{}: tensor {name} not found", self.path.display()))?;
        let entry = &self.meta.tensors[i];
        Ok(TensorView { entry, bytes: &self.mmap[entry.offset as usize..(entry.offset + entry.n_bytes) as usize] })
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn tokenizer_json(&self) -> &[u8] {
        let b = &self.meta.tokenizer.blob;
        &self.mmap[b.offset as usize..(b.offset + b.n_bytes) as usize]
    }

    /// Hashes every tensor and the tokenizer blob against the recorded
    /// SHA-256; with the metadata digest checked at open, everything in the
    /// file is covered. A version-3 file (no metadata digest) is refused.
    pub fn verify(&self) -> Result<()> {
        use rayon::prelude::*;
        ensure!(
            self.metadata_digest_checked,
            "{}: version {VERSION_V3} artifact: its metadata carries no digest, so --verify cannot check the hyperparameters; reconvert with ninfer-convert (scripts/fetch-models.sh does)",
            self.path.display()
        );
        let tok = sha256_hex(self.tokenizer_json());
        ensure!(
            tok == self.meta.tokenizer.blob.sha256,
            "{}: tokenizer.blob: sha256 {tok} does not match the recorded {}",
            self.path.display(),
            self.meta.tokenizer.blob.sha256
        );
        self.meta.tensors.par_iter().try_for_each(|t| {
            let got = sha256_hex(self.tensor(&t.name)?.bytes);
            ensure!(
                got == t.sha256,
                "{}: tensor {}: sha256 {got} does not match the recorded {}",
                self.path.display(),
                t.name,
                t.sha256
            );
            Ok(())
        })
    }

    /// Tensor counts by format for each tensor group (`attn_q`, `ffn_down`, ...).
    pub fn formats_by_group(&self) -> std::collections::BTreeMap<String, std::collections::BTreeMap<String, usize>> {
        let mut out: std::collections::BTreeMap<String, std::collections::BTreeMap<String, usize>> = Default::default();
        for t in &self.meta.tensors {
            let group = super::names::group_of(&t.name);
            *out.entry(group).or_default().entry(t.format.name().to_string()).or_default() += 1;
        }
        out
    }
}

/// Checks the tensor table of `meta` against a file of `n_file_bytes` whose
/// data section starts at `data_offset` (names, shapes against formats and
/// byte lengths, spans inside the data section, aligned, not overlapping),
/// then the hyperparameters against the shapes. Returns the name index.
pub fn check_tensor_table(meta: &ArtifactMeta, data_offset: u64, n_file_bytes: u64) -> Result<HashMap<String, usize>> {
    let mut index = HashMap::with_capacity(meta.tensors.len().min(1 << 16));
    let mut spans = Vec::with_capacity(meta.tensors.len().min(1 << 16) + 1);
    let blob = &meta.tokenizer.blob;
    check_span("tokenizer.blob", blob.offset, blob.n_bytes, data_offset, n_file_bytes)?;
    spans.push((blob.offset, blob.offset + blob.n_bytes, "tokenizer.blob".to_string()));
    for (i, t) in meta.tensors.iter().enumerate() {
        if index.insert(t.name.clone(), i).is_some() {
            bail!("tensors: duplicate tensor name {}", t.name);
        }
        let n_elems = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let n_elems = n_elems.ok_or_else(|| anyhow!("tensor {}: shape overflows", t.name))?;
        let want = t
            .format
            .bytes_for(n_elems)
            .with_context(|| format!("tensor {}: shape {:?}", t.name, t.shape))?;
        ensure!(
            want == t.n_bytes,
            "tensor {}: n_bytes {} does not match {} of shape {:?} ({want} bytes)",
            t.name,
            t.n_bytes,
            t.format,
            t.shape
        );
        if let Some(&n_cols) = t.shape.last() {
            ensure!(
                n_cols % t.format.block_elems() as u64 == 0,
                "tensor {}: rows of {n_cols} elements do not hold whole {} blocks",
                t.name,
                t.format
            );
        }
        check_span(&format!("tensor {}", t.name), t.offset, t.n_bytes, data_offset, n_file_bytes)?;
        spans.push((t.offset, t.offset + t.n_bytes, t.name.clone()));
    }
    spans.sort();
    for w in spans.windows(2) {
        ensure!(w[1].0 >= w[0].1, "tensor {}: overlaps {}", w[1].2, w[0].2);
    }
    let shape_of = |n: &str| index.get(n).map(|&i| meta.tensors[i].shape.as_slice());
    check_hparams(&meta.hparams, shape_of, meta.tensors.iter().map(|t| t.name.as_str())).context("metadata")?;
    Ok(index)
}

/// The header and metadata of an artifact, parsed from its first bytes.
pub struct HeaderAndMeta {
    pub version: u32,
    pub meta: ArtifactMeta,
    /// SHA-256 (hex) of the metadata block.
    pub digest: String,
    pub data_offset: u64,
    pub metadata_digest_checked: bool,
}

/// Parses the header and the metadata JSON from `bytes` (the whole file, or
/// at least up to the data section): magic, version, lengths against the
/// file, the metadata digest (version 4), the JSON, and the `text`
/// component. The tensor table is checked against the file by `Artifact::open`.
pub fn parse_header_and_meta(bytes: &[u8]) -> Result<HeaderAndMeta> {
    let n_file_bytes = bytes.len() as u64;
    ensure!(bytes.len() >= HEADER_BYTES_V3, "header: file is {n_file_bytes} bytes, too short");
    if &bytes[0..8] != MAGIC {
        bail!("magic: not a .ninfer artifact (expected NINFER, found {:?})", &bytes[0..8]);
    }
    let le64 = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or([0; 8]));
    let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or([0; 4]));
    let header_bytes = match version {
        VERSION => HEADER_BYTES,
        VERSION_V3 => HEADER_BYTES_V3,
        _ => bail!("version: artifact version {version}, this build reads {VERSION_V3} and {VERSION}; reconvert with ninfer-convert"),
    };
    ensure!(bytes.len() >= header_bytes, "header: file is {n_file_bytes} bytes, too short for a version {version} header");
    let meta_bytes = le64(16);
    let data_offset = le64(24);
    let meta_end = (header_bytes as u64).checked_add(meta_bytes).filter(|&e| e <= data_offset);
    ensure!(
        meta_end.is_some() && data_offset <= n_file_bytes,
        "metadata_bytes: {meta_bytes} bytes at {header_bytes} with data at {data_offset} do not fit the file ({n_file_bytes} bytes)"
    );
    let raw = &bytes[header_bytes..header_bytes + meta_bytes as usize];
    let digest = sha256_hex(raw);
    let metadata_digest_checked = version == VERSION;
    if metadata_digest_checked {
        let recorded = super::container::hex(&bytes[32..64]);
        ensure!(
            recorded == digest,
            "metadata_sha256: the metadata block hashes to {digest}, the header records {recorded} (the metadata was changed or corrupted; reconvert with ninfer-convert)"
        );
    }
    let meta: ArtifactMeta = serde_json::from_slice(raw).map_err(|e| anyhow!("metadata: {e}"))?;
    ensure!(meta.components.contains(&Component::Text), "components: `text` is required");
    Ok(HeaderAndMeta { version, meta, digest, data_offset, metadata_digest_checked })
}

fn check_span(what: &str, offset: u64, n_bytes: u64, data_offset: u64, n_file_bytes: u64) -> Result<()> {
    ensure!(offset % ALIGNMENT == 0, "{what}: offset {offset} is not aligned to {ALIGNMENT}");
    let end = offset.checked_add(n_bytes);
    ensure!(
        offset >= data_offset && end.is_some_and(|e| e <= n_file_bytes),
        "{what}: offset {offset} + {n_bytes} bytes is outside the data section [{data_offset}, {n_file_bytes})"
    );
    Ok(())
}
