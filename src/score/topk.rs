//! The top-tokens file (`--save-top-tokens`, read by `--kl-reference`), the
//! run fingerprint both carry, and the token list of `--save-tokens`.
//!
//! Layout (all integers little-endian; `docs/top-tokens.md` is the spec):
//!
//! ```text
//! offset 0   magic "INFXTOPK"            8 bytes
//!        8   version (1)                 u32
//!       12   K, ids per position (1..=64) u32
//!       16   H, header bytes             u64
//!       24   header: UTF-8 JSON, H bytes ({format, producer, n_positions, fingerprint})
//!   24 + H   n_positions records, window after window in fingerprint order,
//!            target after target, each 8 + 8K bytes (520 for K = 64):
//!              target_logp f32, log_rest f32, ids [u32; K], logps [f32; K]
//!     end    trailer: magic "INFXTEND" 8 bytes, n_positions u64,
//!            SHA-256 of every record byte 32 bytes
//! ```
//!
//! `logps` are natural-log probabilities, most probable first (ties: smaller
//! id first); `log_rest = ln(1 - Σ exp(logps))` computed in f64 before
//! rounding (`kl::log_rest_mass`). Records are streamed as windows finish and
//! the file appears under its name only when complete (temporary file, then
//! rename). The reader checks the whole file (size, trailer, hash, every
//! record's ids and values) before the first window is scored.
//!
//! This module owns bytes and fingerprints; the KL arithmetic is `kl`, the
//! scoring loop `crate::top_tokens`.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::util::fs::AtomicFile;

pub const MAGIC: &[u8; 8] = b"INFXTOPK";
pub const TRAILER_MAGIC: &[u8; 8] = b"INFXTEND";
pub const VERSION: u32 = 1;
/// Ids recorded per position (fewer only for a vocabulary smaller than this).
pub const TOP_K: usize = 64;
/// Bytes before the JSON header.
pub const PREAMBLE_BYTES: usize = 24;
/// Bytes of the trailer.
pub const TRAILER_BYTES: usize = 8 + 8 + 32;
/// `format` of the JSON header.
pub const FORMAT: &str = "infernix-top-tokens";
/// `format` of a `--save-tokens` file.
pub const TOKENS_FORMAT: &str = "infernix-tokens";
pub const TOKENS_VERSION: u32 = 1;

/// Bytes of one position's record for `k` ids.
pub const fn record_bytes(k: usize) -> usize {
    4 + 4 + 8 * k
}
const _: () = assert!(record_bytes(TOP_K) == 520);

/// What identifies the corpus a run read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputFingerprint {
    /// `corpus`, `text` or `tokens`.
    pub kind: String,
    /// Corpus name or file name (informational, not compared).
    pub name: String,
    /// Manifest SHA-256 (corpus), file SHA-256 (text) or SHA-256 of the ids
    /// as u32 little-endian (tokens).
    pub sha256: String,
    /// `--quick` (corpus only).
    pub quick: Option<bool>,
}

/// One window: its place in the stream and the SHA-256 of its input ids
/// after BOS replacement (u32 little-endian).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowFingerprint {
    pub index: usize,
    pub begin: usize,
    pub end: usize,
    pub first_target: usize,
    pub tokens_sha256: String,
}

impl WindowFingerprint {
    /// Targets of the window (0 for a malformed one whose first target lies past its end).
    pub fn n_targets(&self) -> usize {
        self.end.saturating_sub(self.first_target)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamFingerprint {
    pub name: String,
    pub n_tokens: usize,
    pub token_ids_sha256: String,
    pub windows: Vec<WindowFingerprint>,
}

/// Everything that decides which positions a run scores with which inputs.
/// Model, backend and `--prefill-chunk` are deliberately absent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunFingerprint {
    /// SHA-256 of the artifact's tokenizer blob.
    pub tokenizer_sha256: String,
    pub n_vocab: usize,
    pub input: InputFingerprint,
    pub method: String,
    pub context: usize,
    pub stride: Option<usize>,
    pub chunks_limit: Option<usize>,
    pub streams: Vec<StreamFingerprint>,
}

fn opt(v: Option<usize>) -> String {
    v.map_or("none".to_string(), |n| n.to_string())
}

impl RunFingerprint {
    /// Scored positions over every window.
    pub fn n_positions(&self) -> usize {
        self.streams.iter().flat_map(|s| &s.windows).map(WindowFingerprint::n_targets).fold(0, usize::saturating_add)
    }

    /// The first way `run` differs from this (recorded) fingerprint, as a
    /// phrase naming both values; `None` when they match.
    pub fn first_difference(&self, run: &RunFingerprint) -> Option<String> {
        let r = self;
        if r.tokenizer_sha256 != run.tokenizer_sha256 {
            return Some(format!(
                "tokenizer: recorded with tokenizer sha256 {}, this run's is {}",
                r.tokenizer_sha256, run.tokenizer_sha256
            ));
        }
        if r.n_vocab != run.n_vocab {
            return Some(format!("vocabulary: recorded with {} tokens, this run has {}", r.n_vocab, run.n_vocab));
        }
        if r.input.kind != run.input.kind || r.input.sha256 != run.input.sha256 {
            return Some(format!(
                "input: recorded for {} {} (sha256 {}), this run reads {} {} (sha256 {})",
                r.input.kind, r.input.name, r.input.sha256, run.input.kind, run.input.name, run.input.sha256
            ));
        }
        if r.input.quick != run.input.quick {
            return Some(format!("--quick: recorded {:?}, this run {:?}", r.input.quick, run.input.quick));
        }
        if r.method != run.method {
            return Some(format!("--method: recorded with {}, this run uses {}", r.method, run.method));
        }
        if r.context != run.context {
            return Some(format!("--context: recorded with {}, this run uses {}", r.context, run.context));
        }
        if r.stride != run.stride {
            return Some(format!("--stride: recorded with {}, this run uses {}", opt(r.stride), opt(run.stride)));
        }
        if r.chunks_limit != run.chunks_limit {
            return Some(format!(
                "--chunks: recorded with {}, this run uses {}",
                opt(r.chunks_limit),
                opt(run.chunks_limit)
            ));
        }
        if r.streams.len() != run.streams.len() {
            return Some(format!("streams: recorded {}, this run has {}", r.streams.len(), run.streams.len()));
        }
        for (i, (a, b)) in r.streams.iter().zip(&run.streams).enumerate() {
            let at = format!("stream {i} ({})", b.name);
            if a.n_tokens != b.n_tokens || a.token_ids_sha256 != b.token_ids_sha256 {
                return Some(format!(
                    "{at}: token ids differ (recorded {} tokens, sha256 {}; this run {} tokens, sha256 {})",
                    a.n_tokens, a.token_ids_sha256, b.n_tokens, b.token_ids_sha256
                ));
            }
            if a.windows.len() != b.windows.len() {
                return Some(format!("{at}: recorded {} windows, this run plans {}", a.windows.len(), b.windows.len()));
            }
            for (wa, wb) in a.windows.iter().zip(&b.windows) {
                let span = |w: &WindowFingerprint| format!("inputs [{}, {}) targets [{}, {})", w.begin, w.end, w.first_target, w.end);
                if (wa.index, wa.begin, wa.end, wa.first_target) != (wb.index, wb.begin, wb.end, wb.first_target) {
                    return Some(format!("{at} window {}: recorded {}, this run {}", wb.index, span(wa), span(wb)));
                }
                if wa.tokens_sha256 != wb.tokens_sha256 {
                    return Some(format!(
                        "{at} window {}: input tokens differ (recorded sha256 {}, this run {})",
                        wb.index, wa.tokens_sha256, wb.tokens_sha256
                    ));
                }
            }
        }
        None
    }
}

/// The JSON header of a top-tokens file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileHeader {
    /// Always [`FORMAT`].
    pub format: String,
    /// Who wrote the file (tool, model, backend): informational.
    pub producer: serde_json::Value,
    pub n_positions: usize,
    pub fingerprint: RunFingerprint,
}

/// One position's record.
#[derive(Clone, Debug, PartialEq)]
pub struct TopRecord {
    /// ln p(target).
    pub target_logp: f32,
    /// ln(1 - Σ exp(logps)): the mass outside the listed ids.
    pub log_rest: f32,
    /// The K most probable ids, most probable first.
    pub ids: Vec<u32>,
    /// Their ln p, aligned with `ids`.
    pub logps: Vec<f32>,
}

impl TopRecord {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.target_logp.to_le_bytes());
        out.extend_from_slice(&self.log_rest.to_le_bytes());
        for id in &self.ids {
            out.extend_from_slice(&id.to_le_bytes());
        }
        for v in &self.logps {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    fn decode(bytes: &[u8], k: usize) -> TopRecord {
        debug_assert_eq!(bytes.len(), record_bytes(k));
        let word = |i: usize| [bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]];
        TopRecord {
            target_logp: f32::from_le_bytes(word(0)),
            log_rest: f32::from_le_bytes(word(1)),
            ids: (0..k).map(|i| u32::from_le_bytes(word(2 + i))).collect(),
            logps: (0..k).map(|i| f32::from_le_bytes(word(2 + k + i))).collect(),
        }
    }

    /// Why this record cannot be used, if it cannot: an id outside the
    /// vocabulary, a repeated id, a NaN or positive log-probability.
    fn problem(&self, n_vocab: usize) -> Option<String> {
        if let Some(&bad) = self.ids.iter().find(|&&id| id as usize >= n_vocab) {
            return Some(format!("id {bad} is outside the vocabulary of {n_vocab}"));
        }
        let mut sorted = self.ids.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Some(format!("id {} is listed twice", w[0]));
        }
        // A log-probability may exceed 0 only by rounding.
        let bad = |v: f32| v.is_nan() || v > 1e-5;
        if let Some(v) = self.logps.iter().chain([&self.target_logp, &self.log_rest]).find(|&&v| bad(v)) {
            return Some(format!("log-probability {v} is NaN or positive"));
        }
        None
    }
}

/// Streams records into `<path>.tmp-<pid>`; [`finish`](Self::finish) writes
/// the trailer and renames the file over `path`. Dropped unfinished, the
/// temporary file is removed.
pub struct TopTokensWriter {
    path: PathBuf,
    atomic: AtomicFile,
    out: BufWriter<File>,
    k: usize,
    n_expected: usize,
    n_written: usize,
    hash: Sha256,
    buf: Vec<u8>,
}

impl TopTokensWriter {
    pub fn create(path: &Path, k: usize, header: &FileHeader) -> Result<Self> {
        ensure!((1..=TOP_K).contains(&k), "top-tokens file {}: K = {k} outside 1..={TOP_K}", path.display());
        ensure!(header.n_positions == header.fingerprint.n_positions(), "top-tokens header: n_positions disagrees with its windows");
        let atomic = AtomicFile::create(path)?;
        let file = atomic.file().try_clone().with_context(|| format!("open {}", path.display()))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let json = serde_json::to_vec(header).context("serialize top-tokens header")?;
        let mut pre = Vec::with_capacity(PREAMBLE_BYTES);
        pre.extend_from_slice(MAGIC);
        pre.extend_from_slice(&VERSION.to_le_bytes());
        pre.extend_from_slice(&(k as u32).to_le_bytes());
        pre.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.write_all(&pre).and_then(|_| out.write_all(&json)).with_context(|| format!("write {}", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            atomic,
            out,
            k,
            n_expected: header.n_positions,
            n_written: 0,
            hash: Sha256::new(),
            buf: Vec::with_capacity(record_bytes(k)),
        })
    }

    pub fn write(&mut self, rec: &TopRecord) -> Result<()> {
        ensure!(
            rec.ids.len() == self.k && rec.logps.len() == self.k,
            "top-tokens file {}: record with {} ids / {} log-probabilities, K is {}",
            self.path.display(),
            rec.ids.len(),
            rec.logps.len(),
            self.k
        );
        ensure!(self.n_written < self.n_expected, "top-tokens file {}: more records than the {} positions of the header", self.path.display(), self.n_expected);
        self.buf.clear();
        rec.encode(&mut self.buf);
        self.hash.update(&self.buf);
        self.out.write_all(&self.buf).with_context(|| format!("write {}", self.path.display()))?;
        self.n_written += 1;
        Ok(())
    }

    /// Writes the trailer, flushes and renames the file into place.
    pub fn finish(mut self) -> Result<()> {
        ensure!(
            self.n_written == self.n_expected,
            "top-tokens file {}: {} records written, the header announces {}",
            self.path.display(),
            self.n_written,
            self.n_expected
        );
        let digest = std::mem::take(&mut self.hash).finalize();
        let mut t = Vec::with_capacity(TRAILER_BYTES);
        t.extend_from_slice(TRAILER_MAGIC);
        t.extend_from_slice(&(self.n_written as u64).to_le_bytes());
        t.extend_from_slice(&digest);
        self.out.write_all(&t).and_then(|_| self.out.flush()).with_context(|| format!("write {}", self.path.display()))?;
        let Self { atomic, out, .. } = self;
        drop(out);
        atomic.commit()
    }
}

/// Reads a top-tokens file window by window, after checking all of it.
pub struct TopTokensReader {
    pub path: PathBuf,
    pub header: FileHeader,
    pub k: usize,
    /// SHA-256 of every record byte (the trailer's, checked): identifies
    /// the reference's content.
    pub records_sha256: String,
    input: BufReader<File>,
    /// The record the input is at.
    n_read: usize,
    /// Offset of the first record.
    records_from: u64,
}

fn read_exact(r: &mut impl Read, buf: &mut [u8], path: &Path, what: &str) -> Result<()> {
    r.read_exact(buf).with_context(|| format!("{}: read {what}", path.display()))
}

impl TopTokensReader {
    /// Opens `path` and checks it whole: magic, version, header, size,
    /// trailer, the SHA-256 of the records and every record's ids (inside the
    /// vocabulary, distinct) and values (no NaN, none positive).
    pub fn open(path: &Path) -> Result<Self> {
        let regen = "write it again with --save-top-tokens or tools/fp64_reference.py";
        let file = File::open(path).with_context(|| format!("open {}", path.display()))?;
        let n_file_bytes = file.metadata().with_context(|| format!("stat {}", path.display()))?.len();
        let mut input = BufReader::with_capacity(1 << 20, file);
        let mut pre = [0u8; PREAMBLE_BYTES];
        read_exact(&mut input, &mut pre, path, "preamble").with_context(|| format!("not a top-tokens file ({regen})"))?;
        if &pre[0..8] != MAGIC {
            bail!("{}: not a top-tokens file (magic {:?}, expected {:?})", path.display(), String::from_utf8_lossy(&pre[0..8]), "INFXTOPK");
        }
        let version = u32::from_le_bytes([pre[8], pre[9], pre[10], pre[11]]);
        if version != VERSION {
            bail!("{}: top-tokens format version {version}, this build reads version {VERSION} ({regen})", path.display());
        }
        let k = u32::from_le_bytes([pre[12], pre[13], pre[14], pre[15]]) as usize;
        ensure!((1..=TOP_K).contains(&k), "{}: K = {k} outside 1..={TOP_K}", path.display());
        let n_header = u64::from_le_bytes(pre[16..24].try_into().expect("8 bytes"));
        ensure!(n_header < n_file_bytes, "{}: header of {n_header} bytes in a file of {n_file_bytes}", path.display());
        let mut json = vec![0u8; n_header as usize];
        read_exact(&mut input, &mut json, path, "header")?;
        let header: FileHeader =
            serde_json::from_slice(&json).with_context(|| format!("{}: top-tokens header", path.display()))?;
        ensure!(header.format == FORMAT, "{}: header format {:?}, expected {FORMAT:?}", path.display(), header.format);
        for (si, s) in header.fingerprint.streams.iter().enumerate() {
            for w in &s.windows {
                ensure!(
                    w.begin <= w.first_target && w.first_target <= w.end,
                    "{}: header: stream {si} window {}: first_target {} is outside [begin {}, end {}]",
                    path.display(),
                    w.index,
                    w.first_target,
                    w.begin,
                    w.end
                );
            }
        }
        let n = header.fingerprint.n_positions();
        ensure!(
            header.n_positions == n,
            "{}: header announces {} positions, its windows hold {n}",
            path.display(),
            header.n_positions
        );
        // Checked: the counts come from the file.
        let expected = (n as u64)
            .checked_mul(record_bytes(k) as u64)
            .and_then(|r| r.checked_add(PREAMBLE_BYTES as u64 + n_header + TRAILER_BYTES as u64));
        if expected != Some(n_file_bytes) {
            let expected = expected.map_or_else(|| "more than 2^64".to_string(), |e| e.to_string());
            bail!(
                "{}: {n_file_bytes} bytes, expected {expected} for {n} positions of K = {k} (truncated or not finished; {regen})",
                path.display()
            );
        }
        // One pass over the records: hash and per-record checks.
        let mut hash = Sha256::new();
        let mut buf = vec![0u8; record_bytes(k)];
        let n_vocab = header.fingerprint.n_vocab;
        let mut pos = 0usize;
        for (si, s) in header.fingerprint.streams.iter().enumerate() {
            for w in &s.windows {
                for t in w.first_target..w.end {
                    read_exact(&mut input, &mut buf, path, "records")?;
                    hash.update(&buf);
                    if let Some(p) = TopRecord::decode(&buf, k).problem(n_vocab) {
                        bail!("{}: record {pos} (stream {si} window {} target {t}): {p}", path.display(), w.index);
                    }
                    pos += 1;
                }
            }
        }
        let mut trailer = [0u8; TRAILER_BYTES];
        read_exact(&mut input, &mut trailer, path, "trailer")?;
        ensure!(&trailer[0..8] == TRAILER_MAGIC, "{}: no trailer (not finished; {regen})", path.display());
        let n_trailer = u64::from_le_bytes(trailer[8..16].try_into().expect("8 bytes"));
        ensure!(n_trailer as usize == n, "{}: trailer counts {n_trailer} records, header {n}", path.display());
        let digest = hash.finalize();
        ensure!(digest.as_slice() == &trailer[16..48], "{}: the records' SHA-256 does not match the trailer (corrupted; {regen})", path.display());
        let records_sha256: String = digest.iter().map(|b| format!("{b:02x}")).collect();

        // Rewind to the first record for the scoring pass.
        let mut file = input.into_inner();
        use std::io::Seek;
        file.seek(std::io::SeekFrom::Start(PREAMBLE_BYTES as u64 + n_header)).with_context(|| format!("seek {}", path.display()))?;
        let records_from = PREAMBLE_BYTES as u64 + n_header;
        Ok(Self { path: path.to_path_buf(), header, k, records_sha256, input: BufReader::with_capacity(1 << 20, file), n_read: 0, records_from })
    }

    /// The `n` records from record `first` on (counted over the whole file):
    /// random access for shards, workers and resumed runs, which skip other
    /// windows. Reading on from the last record does not seek.
    pub fn read_at(&mut self, first: usize, n: usize) -> Result<Vec<TopRecord>> {
        if first != self.n_read {
            ensure!(first <= self.header.n_positions, "{}: record {first} asked, the file holds {}", self.path.display(), self.header.n_positions);
            use std::io::Seek;
            let at = self.records_from + (first as u64) * record_bytes(self.k) as u64;
            self.input.seek(std::io::SeekFrom::Start(at)).with_context(|| format!("seek {}", self.path.display()))?;
            self.n_read = first;
        }
        self.read_records(n)
    }

    /// Where each window's records start, `[stream][window]` (counted in records).
    pub fn window_offsets(&self) -> Vec<Vec<usize>> {
        let mut at = 0;
        self.header
            .fingerprint
            .streams
            .iter()
            .map(|s| {
                s.windows
                    .iter()
                    .map(|w| {
                        let first = at;
                        at += w.n_targets();
                        first
                    })
                    .collect()
            })
            .collect()
    }

    /// The next `n` records (the targets of the next window, in order).
    pub fn read_records(&mut self, n: usize) -> Result<Vec<TopRecord>> {
        ensure!(
            self.n_read + n <= self.header.n_positions,
            "{}: asked for records {}..{}, the file holds {}",
            self.path.display(),
            self.n_read,
            self.n_read + n,
            self.header.n_positions
        );
        let mut buf = vec![0u8; record_bytes(self.k)];
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            read_exact(&mut self.input, &mut buf, &self.path, "records")?;
            out.push(TopRecord::decode(&buf, self.k));
        }
        self.n_read += n;
        Ok(out)
    }
}

impl RunFingerprint {
    /// The same run with only the windows `keep(stream, window index)` takes.
    pub fn restricted(&self, keep: impl Fn(usize, usize) -> bool) -> RunFingerprint {
        let mut fp = self.clone();
        for (si, s) in fp.streams.iter_mut().enumerate() {
            s.windows.retain(|w| keep(si, w.index));
        }
        fp
    }
}

/// Joins top-tokens files that each hold some windows of one run (shards,
/// workers, resumed windows: `parts`, each `(what, path)`, any order) into
/// the file of `header`'s windows, written at `out` (temporary file, then
/// rename): its records window by window in `header`'s order, each copied
/// from the part that holds it. Byte for byte the file one process writes
/// with this header. Every part is checked whole first ([`TopTokensReader::open`]);
/// refused, naming the part: another K, a fingerprint that is not
/// `header`'s restricted to the part's windows, a window in two parts, and
/// a window in none.
pub fn join_files(parts: &[(String, PathBuf)], header: &FileHeader, out: &Path) -> Result<()> {
    let mut readers = Vec::with_capacity(parts.len());
    let mut k = None;
    // (stream, window index) -> (part, first record in that part).
    let mut owner: std::collections::HashMap<(usize, usize), (usize, usize)> = std::collections::HashMap::new();
    for (pi, (what, path)) in parts.iter().enumerate() {
        let r = TopTokensReader::open(path).with_context(|| format!("{what} {}", path.display()))?;
        if *k.get_or_insert(r.k) != r.k {
            bail!("{what} {}: K = {}, other parts hold {}", path.display(), r.k, k.unwrap_or(0));
        }
        let fp = &r.header.fingerprint;
        let expected = header.fingerprint.restricted(|si, wi| fp.streams.get(si).is_some_and(|s| s.windows.iter().any(|w| w.index == wi)));
        if let Some(d) = fp.first_difference(&expected) {
            bail!("{what} {}: not a part of this run: {d}", path.display());
        }
        for ((si, s), offsets) in fp.streams.iter().enumerate().zip(r.window_offsets()) {
            for (w, first) in s.windows.iter().zip(offsets) {
                if let Some((q, _)) = owner.insert((si, w.index), (pi, first)) {
                    bail!("{what} {}: stream '{}' window {} is also in {} {}", path.display(), s.name, w.index, parts[q].0, parts[q].1.display());
                }
            }
        }
        readers.push(r);
    }
    let k = k.context("top-tokens join: no parts given")?;
    let mut w = TopTokensWriter::create(out, k, header)?;
    for (si, s) in header.fingerprint.streams.iter().enumerate() {
        for win in &s.windows {
            let &(pi, first) = owner
                .get(&(si, win.index))
                .with_context(|| format!("top tokens of stream '{}' window {}: in no part ({} given)", s.name, win.index, parts.len()))?;
            for rec in readers[pi].read_at(first, win.n_targets())? {
                w.write(&rec)?;
            }
        }
    }
    w.finish()
}

/// `--save-tokens`: the fingerprint plus every window's input ids (after BOS
/// replacement), `tokens[stream][window]`, so an external program can score
/// exactly these windows and write a top-tokens file for them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedTokens {
    /// Always [`TOKENS_FORMAT`].
    pub format: String,
    pub version: u32,
    /// The K a top-tokens file for this run must hold (64, or the vocabulary size if smaller).
    pub top_k: usize,
    pub fingerprint: RunFingerprint,
    pub tokens: Vec<Vec<Vec<u32>>>,
}

/// Writes `saved` as JSON to `path` (temporary file, then rename).
pub fn write_saved_tokens(path: &Path, saved: &SavedTokens) -> Result<()> {
    write_saved_tokens_pending(path, saved)?.commit()
}

/// Writes `saved` as JSON to `path`'s temporary file and returns it
/// uncommitted: the caller renames it into place once the run succeeded.
pub fn write_saved_tokens_pending(path: &Path, saved: &SavedTokens) -> Result<AtomicFile> {
    let atomic = AtomicFile::create(path)?;
    {
        let mut out = BufWriter::new(atomic.file());
        serde_json::to_writer(&mut out, saved).with_context(|| format!("write {}", path.display()))?;
        out.flush().with_context(|| format!("write {}", path.display()))?;
    }
    Ok(atomic)
}

/// Reads a `--save-tokens` file and checks every window's ids against its fingerprint.
pub fn read_saved_tokens(path: &Path) -> Result<SavedTokens> {
    let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    let saved: SavedTokens = serde_json::from_slice(&bytes).with_context(|| format!("{}: saved tokens", path.display()))?;
    ensure!(saved.format == TOKENS_FORMAT && saved.version == TOKENS_VERSION, "{}: format {:?} version {}, expected {TOKENS_FORMAT:?} {TOKENS_VERSION}", path.display(), saved.format, saved.version);
    ensure!(saved.tokens.len() == saved.fingerprint.streams.len(), "{}: {} token lists for {} streams", path.display(), saved.tokens.len(), saved.fingerprint.streams.len());
    for (s, ts) in saved.fingerprint.streams.iter().zip(&saved.tokens) {
        ensure!(ts.len() == s.windows.len(), "{}: stream {}: {} token lists for {} windows", path.display(), s.name, ts.len(), s.windows.len());
        for (w, t) in s.windows.iter().zip(ts) {
            let sha = crate::text::tokenizer::token_ids_sha256(t);
            ensure!(t.len() == w.end - w.begin && sha == w.tokens_sha256, "{}: stream {} window {}: tokens do not match the fingerprint", path.display(), s.name, w.index);
        }
    }
    Ok(saved)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn fingerprint(windows: &[(usize, usize, usize)]) -> RunFingerprint {
        RunFingerprint {
            tokenizer_sha256: "t".repeat(64),
            n_vocab: 100,
            input: InputFingerprint { kind: "text".into(), name: "a.txt".into(), sha256: "s".repeat(64), quick: None },
            method: "chunks".into(),
            context: 8,
            stride: None,
            chunks_limit: Some(2),
            streams: vec![StreamFingerprint {
                name: "a.txt".into(),
                n_tokens: 16,
                token_ids_sha256: "x".into(),
                windows: windows
                    .iter()
                    .enumerate()
                    .map(|(i, &(begin, first_target, end))| WindowFingerprint {
                        index: i,
                        begin,
                        end,
                        first_target,
                        tokens_sha256: format!("w{i}"),
                    })
                    .collect(),
            }],
        }
    }

    fn record(seed: u32, k: usize) -> TopRecord {
        TopRecord {
            target_logp: -(seed as f32) / 7.0,
            log_rest: -3.5,
            ids: (0..k as u32).map(|i| (seed * 13 + i * 7) % 100).collect(),
            logps: (0..k).map(|i| -0.1 * (i as f32 + 1.0) - seed as f32 * 1e-3).collect(),
        }
    }

    fn write_file(path: &Path, fp: &RunFingerprint, k: usize) -> Vec<TopRecord> {
        let header = FileHeader { format: FORMAT.into(), producer: serde_json::json!({"test": true}), n_positions: fp.n_positions(), fingerprint: fp.clone() };
        let mut w = TopTokensWriter::create(path, k, &header).unwrap();
        let recs: Vec<TopRecord> = (0..fp.n_positions() as u32).map(|s| record(s, k)).collect();
        for r in &recs {
            w.write(r).unwrap();
        }
        w.finish().unwrap();
        recs
    }

    #[test]
    fn round_trip_and_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ref.topk");
        let fp = fingerprint(&[(0, 4, 8), (8, 12, 16)]);
        let recs = write_file(&path, &fp, 10);
        let mut r = TopTokensReader::open(&path).unwrap();
        assert_eq!((r.k, r.header.n_positions), (10, 8));
        assert_eq!(r.header.fingerprint, fp);
        assert_eq!(r.read_records(4).unwrap(), recs[..4]);
        assert_eq!(r.read_records(4).unwrap(), recs[4..]);
        assert!(r.read_records(1).is_err());
        let header_bytes = serde_json::to_vec(&r.header).unwrap().len();
        let n = std::fs::metadata(&path).unwrap().len() as usize;
        assert_eq!(n, PREAMBLE_BYTES + header_bytes + 8 * record_bytes(10) + TRAILER_BYTES);
        // No temporary file left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    fn write_records(path: &Path, fp: &RunFingerprint, k: usize, recs: &[TopRecord]) {
        let header = FileHeader { format: FORMAT.into(), producer: serde_json::json!({"test": true}), n_positions: fp.n_positions(), fingerprint: fp.clone() };
        let mut w = TopTokensWriter::create(path, k, &header).unwrap();
        for r in recs {
            w.write(r).unwrap();
        }
        w.finish().unwrap();
    }

    #[test]
    fn parts_join_into_the_whole_file_byte_for_byte() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        let fp = fingerprint(&[(0, 4, 8), (8, 12, 16), (16, 18, 20)]);
        let recs = write_file(&p("whole.topk"), &fp, 6);
        // Windows 0 and 2 in one part, window 1 in another.
        write_records(&p("a.topk"), &fp.restricted(|_, w| w != 1), 6, &[&recs[..4], &recs[8..]].concat());
        write_records(&p("b.topk"), &fp.restricted(|_, w| w == 1), 6, &recs[4..8]);
        let header = TopTokensReader::open(&p("whole.topk")).unwrap().header;
        let part = |n: &str| (format!("part {n}"), p(n));
        join_files(&[part("b.topk"), part("a.topk")], &header, &p("joined.topk")).unwrap();
        assert_eq!(std::fs::read(p("joined.topk")).unwrap(), std::fs::read(p("whole.topk")).unwrap());
        let err = |parts: &[(String, PathBuf)]| format!("{:#}", join_files(parts, &header, &p("bad.topk")).unwrap_err());
        let e = err(&[part("a.topk"), part("b.topk"), part("b.topk")]);
        assert!(e.contains("part b.topk") && e.contains("window 1 is also in part b.topk"), "{e}");
        let e = err(&[part("a.topk")]);
        assert!(e.contains("window 1: in no part"), "{e}");
        // A part of another plan (another context) is named.
        let mut other = fp.restricted(|_, w| w == 1);
        other.context = 16;
        write_records(&p("c.topk"), &other, 6, &recs[4..8]);
        let e = err(&[part("a.topk"), part("c.topk")]);
        assert!(e.contains("part c.topk") && e.contains("not a part of this run") && e.contains("--context"), "{e}");
        assert!(!p("bad.topk").exists());
    }

    #[test]
    fn damage_is_detected_before_use() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ref.topk");
        let fp = fingerprint(&[(0, 4, 8)]);
        write_file(&path, &fp, 4);
        let good = std::fs::read(&path).unwrap();
        let check = |bytes: &[u8], expect: &str| {
            std::fs::write(&path, bytes).unwrap();
            let e = format!("{:#}", TopTokensReader::open(&path).err().expect("refused"));
            assert!(e.contains(expect), "{e:?} lacks {expect:?}");
        };
        check(&good[..good.len() - 1], "bytes, expected");
        let mut flipped = good.clone();
        let first_record = good.len() - TRAILER_BYTES - 4 * record_bytes(4);
        flipped[first_record + 1] ^= 1;
        check(&flipped, "SHA-256");
        let mut magic = good.clone();
        magic[0] = b'X';
        check(&magic, "not a top-tokens file");
        let mut version = good.clone();
        version[8] = 9;
        check(&version, "version 9");
        check(b"short", "not a top-tokens file");
    }

    #[test]
    fn bad_records_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ref.topk");
        let fp = fingerprint(&[(0, 6, 8)]);
        let header = FileHeader { format: FORMAT.into(), producer: serde_json::Value::Null, n_positions: 2, fingerprint: fp };
        let mut w = TopTokensWriter::create(&path, 2, &header).unwrap();
        w.write(&TopRecord { target_logp: -1.0, log_rest: -1.0, ids: vec![1, 2], logps: vec![-1.0, -2.0] }).unwrap();
        w.write(&TopRecord { target_logp: -1.0, log_rest: -1.0, ids: vec![5, 5], logps: vec![-1.0, -2.0] }).unwrap();
        w.finish().unwrap();
        let e = format!("{:#}", TopTokensReader::open(&path).err().unwrap());
        assert!(e.contains("record 1") && e.contains("target 7") && e.contains("listed twice"), "{e}");
    }

    #[test]
    fn unfinished_writer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ref.topk");
        let fp = fingerprint(&[(0, 4, 8)]);
        let header = FileHeader { format: FORMAT.into(), producer: serde_json::Value::Null, n_positions: 4, fingerprint: fp };
        let mut w = TopTokensWriter::create(&path, 4, &header).unwrap();
        w.write(&record(0, 4)).unwrap();
        assert!(w.finish().unwrap_err().to_string().contains("1 records written"));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn first_difference_names_it() {
        let a = fingerprint(&[(0, 4, 8), (8, 12, 16)]);
        assert_eq!(a.first_difference(&a), None);
        let mut b = a.clone();
        b.context = 16;
        b.chunks_limit = None;
        assert_eq!(a.first_difference(&b).unwrap(), "--context: recorded with 8, this run uses 16");
        let mut c = a.clone();
        c.streams[0].windows[1].tokens_sha256 = "other".into();
        let d = a.first_difference(&c).unwrap();
        assert!(d.starts_with("stream 0 (a.txt) window 1: input tokens differ"), "{d}");
        let mut e = a.clone();
        e.input.sha256 = "z".repeat(64);
        assert!(a.first_difference(&e).unwrap().starts_with("input: recorded for text a.txt"));
        let mut f = a.clone();
        f.chunks_limit = None;
        assert_eq!(a.first_difference(&f).unwrap(), "--chunks: recorded with 2, this run uses none");
        let mut g = a.clone();
        g.tokenizer_sha256 = "u".into();
        assert!(a.first_difference(&g).unwrap().starts_with("tokenizer:"));
        // The name of the input file is informational.
        let mut h = a.clone();
        h.input.name = "renamed.txt".into();
        assert_eq!(a.first_difference(&h), None);
    }

    #[test]
    fn saved_tokens_round_trip_and_check() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.json");
        let toks = vec![vec![1u32, 2, 3, 4], vec![5u32, 6, 7, 8]];
        let mut fp = fingerprint(&[(0, 2, 4), (4, 6, 8)]);
        for (w, t) in fp.streams[0].windows.iter_mut().zip(&toks) {
            w.tokens_sha256 = crate::text::tokenizer::token_ids_sha256(t);
        }
        let saved = SavedTokens { format: TOKENS_FORMAT.into(), version: TOKENS_VERSION, top_k: 64, fingerprint: fp, tokens: vec![toks] };
        write_saved_tokens(&path, &saved).unwrap();
        assert_eq!(read_saved_tokens(&path).unwrap(), saved);
        let mut bad = saved.clone();
        bad.tokens[0][1][0] = 9;
        write_saved_tokens(&path, &bad).unwrap();
        assert!(read_saved_tokens(&path).unwrap_err().to_string().contains("window 1"));
    }
}
