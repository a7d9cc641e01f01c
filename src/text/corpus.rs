//! Corpus input: the corpus manifest (`--corpus manifest.json`), the choice of
//! streams (`--quick`), the data root, and reading stream texts with their
//! size and SHA-256 checked; also the single-stream inputs `--text FILE` and
//! `--tokens FILE`.
//!
//! Texts are returned exactly as their bytes are on disk, decoded as UTF-8:
//! no BOM stripping, no line-ending translation, no trailing-newline removal
//! (llama.cpp's token-id references in `tests/data/reference` are of the bytes
//! as they are). Tokenization belongs to `text::tokenizer`, not here.
//!
//! The bundled corpus: `eval/corpora/ppl-v1` (manifest and its 21 streams,
//! 5.7 MB) is compiled into the binary with `include_bytes!`, so a run with no
//! input flag scores it from any folder, also after `cargo install`, with no
//! data files to find ([`bundled_manifest`], [`CorpusFiles::Bundled`]). The
//! embedded bytes are checked against the manifest like files on disk. A
//! report records such a run's manifest as [`BUNDLED_MANIFEST`].
//!
//! Manifest format (version 1):
//! ```json
//! { "name": "ppl-v1", "version": 1, "description": "...",
//!   "streams": [ { "id": "wiki-test", "domain": "en-reference",
//!                  "path": "wikitext-2-raw/wiki.test.raw", "bytes": 1290590,
//!                  "sha256": "173c...", "url": "https://raw.githubusercontent.com/...",
//!                  "license": "...", "source": "owner/repo@commit:path",
//!                  "source_encoding": "ISO-8859-1", "source_sha256": "e3fb..." } ] }
//! ```
//! `path` is relative to the data root; `source_encoding` (optional) says the
//! file at `url` is in that encoding and the stream is its UTF-8 conversion
//! (it was converted once; SOURCES.md says how) and `source_sha256` (optional)
//! pins the downloaded bytes before conversion; `bytes` and `sha256` are
//! always of the stream as stored (UTF-8).

use std::collections::HashSet;
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::tokenizer::{check_text_size, MAX_TEXT_BYTES};
use crate::util::fs::read_bounded;

/// The manifest version this reader understands.
pub const MANIFEST_VERSION: u32 = 1;
/// Environment variable naming the data root when `--data-root` is absent.
pub const DATA_ROOT_ENV: &str = "INFERNIX_DATA";
/// The largest corpus manifest read (the shipped one is 12 kB).
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;
/// The largest `--tokens` file read: 64 MiB of JSON, at least 2 bytes per id.
pub const MAX_TOKENS_FILE_BYTES: u64 = 64 << 20;
/// The only `source_encoding` the download script can convert from.
pub const SOURCE_ENCODING_LATIN1: &str = "ISO-8859-1";

/// One text stream of a corpus, as the manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StreamSpec {
    /// Unique within the manifest; names the stream in reports and errors.
    pub id: String,
    /// Domain the stream is pooled into (`en-reference`, `code`, ...).
    pub domain: String,
    /// File path relative to the data root, `/`-separated.
    pub path: String,
    /// Size of the stored (UTF-8) file.
    pub bytes: u64,
    /// Lowercase hex SHA-256 of the stored file.
    pub sha256: String,
    /// Canonical download URL (pinned commit).
    pub url: String,
    pub license: String,
    /// Where it comes from: `owner/repo@commit:path`.
    pub source: String,
    /// Encoding of the file at `url` when it is not UTF-8 (the stream is its conversion).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_encoding: Option<String>,
    /// SHA-256 of the file at `url` before conversion (with `source_encoding`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_sha256: Option<String>,
}

/// A parsed and validated corpus manifest.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub name: String,
    pub version: u32,
    pub description: String,
    pub streams: Vec<StreamSpec>,
    /// SHA-256 of the manifest file's bytes (not part of the JSON).
    #[serde(skip)]
    pub sha256: String,
}

/// The streams one run scores, with the identity of their manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Corpus {
    pub name: String,
    pub manifest_sha256: String,
    pub streams: Vec<StreamSpec>,
}

impl Corpus {
    /// The run's corpus: [`select`]ed streams of `manifest`, in manifest order.
    pub fn from_manifest(manifest: &Manifest, quick: bool) -> Corpus {
        Corpus {
            name: manifest.name.clone(),
            manifest_sha256: manifest.sha256.clone(),
            streams: select(manifest, quick).into_iter().cloned().collect(),
        }
    }
}

/// Reads, parses and validates a manifest. Errors name the file and the
/// offending field or value (serde names a missing field: "missing field `sha256`").
pub fn load_manifest(path: &Path) -> Result<Manifest> {
    let bytes = read_bounded(path, MAX_MANIFEST_BYTES, "corpus manifest")?;
    parse_manifest(&bytes).with_context(|| format!("corpus manifest {}", path.display()))
}

/// A manifest from its bytes, validated (the fuzzed entry point).
pub fn parse_manifest(bytes: &[u8]) -> Result<Manifest> {
    let mut manifest: Manifest = serde_json::from_slice(bytes).context("invalid manifest")?;
    manifest.sha256 = sha256_hex(bytes);
    validate(&manifest)?;
    Ok(manifest)
}

fn validate(m: &Manifest) -> Result<()> {
    if m.version != MANIFEST_VERSION {
        bail!("version is {}, this program reads version {MANIFEST_VERSION}", m.version);
    }
    if m.name.is_empty() {
        bail!("field `name` is empty");
    }
    if m.streams.is_empty() {
        bail!("field `streams` is empty");
    }
    let mut ids = HashSet::new();
    for (i, s) in m.streams.iter().enumerate() {
        if s.id.is_empty() {
            bail!("streams[{i}]: field `id` is empty");
        }
        if !ids.insert(s.id.as_str()) {
            bail!("duplicate stream id {:?} (streams[{i}])", s.id);
        }
        if s.domain.is_empty() {
            bail!("stream {}: field `domain` is empty", s.id);
        }
        let p = Path::new(&s.path);
        if s.path.is_empty() || !p.components().all(|c| matches!(c, Component::Normal(_))) {
            bail!("stream {}: field `path` {:?} must be a relative path without `..`", s.id, s.path);
        }
        if !is_sha256_hex(&s.sha256) {
            bail!("stream {}: field `sha256` {:?} is not 64 lowercase hex digits", s.id, s.sha256);
        }
        if let Some(h) = s.source_sha256.as_deref().filter(|h| !is_sha256_hex(h)) {
            bail!("stream {}: field `source_sha256` {h:?} is not 64 lowercase hex digits", s.id);
        }
        if let Some(enc) = &s.source_encoding {
            if enc != SOURCE_ENCODING_LATIN1 {
                bail!("stream {}: field `source_encoding` {enc:?} is not supported (only {SOURCE_ENCODING_LATIN1})", s.id);
            }
        }
    }
    Ok(())
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The streams to score: with `quick`, the first stream of each domain (in
/// manifest order); otherwise all of them.
pub fn select(manifest: &Manifest, quick: bool) -> Vec<&StreamSpec> {
    if !quick {
        return manifest.streams.iter().collect();
    }
    let mut seen = HashSet::new();
    manifest.streams.iter().filter(|s| seen.insert(s.domain.as_str())).collect()
}

/// The data root: `--data-root`, else `$INFERNIX_DATA` (when set and not
/// empty), else the folder holding the manifest.
pub fn resolve_data_root(cli: Option<&Path>, manifest_path: &Path) -> PathBuf {
    let env = std::env::var_os(DATA_ROOT_ENV).filter(|v| !v.is_empty()).map(PathBuf::from);
    resolve_data_root_from(cli, env, manifest_path)
}

fn resolve_data_root_from(cli: Option<&Path>, env: Option<PathBuf>, manifest_path: &Path) -> PathBuf {
    if let Some(p) = cli {
        return p.to_path_buf();
    }
    if let Some(p) = env {
        return p;
    }
    match manifest_path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Reads one stream below `root`, checks its size and SHA-256 against the
/// manifest and decodes it as UTF-8. Errors name the stream id and the file.
pub fn read_stream(root: &Path, spec: &StreamSpec) -> Result<String> {
    let path = root.join(&spec.path);
    check_text_size(spec.bytes).with_context(|| format!("stream {}: field `bytes`", spec.id))?;
    // One byte more than the manifest says: a longer file is reported below, never read whole.
    let bytes = read_bounded(&path, spec.bytes + 1, &format!("stream {} (data root {})", spec.id, root.display()))?;
    checked_text(spec, bytes, &path)
}

/// The stream's bytes as text, after checking size and SHA-256 against the
/// manifest (`path` names where they came from in errors).
fn checked_text(spec: &StreamSpec, bytes: Vec<u8>, path: &Path) -> Result<String> {
    if bytes.len() as u64 != spec.bytes {
        bail!(
            "stream {}: {} has {} bytes, the manifest says {} (the file is not the one the manifest pins)",
            spec.id,
            path.display(),
            bytes.len(),
            spec.bytes
        );
    }
    let digest = sha256_hex(&bytes);
    if digest != spec.sha256 {
        bail!(
            "stream {}: {} has SHA-256 {digest}, the manifest says {} (the file is not the one the manifest pins)",
            spec.id,
            path.display(),
            spec.sha256
        );
    }
    decode_utf8(bytes, path).with_context(|| format!("stream {}", spec.id))
}

/// How a report names the manifest of the corpus compiled into the binary.
pub const BUNDLED_MANIFEST: &str = "bundled:ppl-v1";

/// `include_bytes!` of files under `eval/corpora/ppl-v1/`, by manifest path.
macro_rules! bundled_files {
    ($($path:literal),* $(,)?) => {
        &[$(($path, include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/eval/corpora/ppl-v1/", $path)) as &[u8])),*]
    };
}

/// The bundled manifest's bytes.
static BUNDLED_MANIFEST_BYTES: &[u8] =
    include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/eval/corpora/ppl-v1/manifest.json"));

/// Every stream of the bundled manifest, (manifest path, bytes); a unit test
/// checks this list against the manifest both ways.
static BUNDLED_FILES: &[(&str, &[u8])] = bundled_files![
    "wikitext-2-raw/wiki.test.raw",
    "wikitext-2-raw/wiki.valid.raw",
    "pg19/frankenstein_pg84.txt",
    "pg19/adventures_of_sherlock_holmes_pg1661.txt",
    "pg19/news_from_nowhere_pg3261.txt",
    "zh/rulin_waishi_pg24032.txt",
    "code/cutlass/basic_gemm.cu",
    "code/cutlass/48_hopper_warp_specialized_gemm.cu",
    "code/cutlass/gemm_device_gemm.h",
    "code/cutlass/half.h",
    "code/cutlass/layout.hpp",
    "code/cutlass/sm90_mma_tma_gmma_ss_warpspecialized.hpp",
    "code/cutlass/tgv_gqa.cuh",
    "code/llm.c/train_gpt2.cu",
    "code/llm.c/attention_forward.cu",
    "code/llm.c/attention.cuh",
    "code/llm.c/matmul.cuh",
    "code/llm.c/layernorm.cuh",
    "code/llm.c/cudnn_att.cpp",
    "multilingual/de_die_verwandlung_pg22367.txt",
    "multilingual/fr_le_tour_du_monde_pg800.txt",
];

/// The manifest compiled into the binary (`eval/corpora/ppl-v1/manifest.json`).
pub fn bundled_manifest() -> Result<Manifest> {
    let mut manifest: Manifest = serde_json::from_slice(BUNDLED_MANIFEST_BYTES)
        .with_context(|| format!("corpus manifest {BUNDLED_MANIFEST}: invalid manifest"))?;
    manifest.sha256 = sha256_hex(BUNDLED_MANIFEST_BYTES);
    validate(&manifest).with_context(|| format!("corpus manifest {BUNDLED_MANIFEST}"))?;
    Ok(manifest)
}

/// Where a corpus's stream files are read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CorpusFiles {
    /// Files below a data root folder.
    Dir(PathBuf),
    /// The copies compiled into the binary ([`bundled_manifest`]'s streams only).
    Bundled,
}

impl CorpusFiles {
    /// Reads and checks one stream (see [`read_stream`]).
    pub fn read(&self, spec: &StreamSpec) -> Result<String> {
        match self {
            CorpusFiles::Dir(root) => read_stream(root, spec),
            CorpusFiles::Bundled => {
                let bytes = BUNDLED_FILES
                    .iter()
                    .find(|(p, _)| *p == spec.path)
                    .map(|(_, b)| b.to_vec())
                    .with_context(|| format!("stream {}: {} is not in the bundled corpus", spec.id, spec.path))?;
                checked_text(spec, bytes, &Path::new(BUNDLED_MANIFEST).join(&spec.path))
            }
        }
    }

    /// The data root as a report records it.
    pub fn describe(&self) -> String {
        match self {
            CorpusFiles::Dir(root) => root.display().to_string(),
            CorpusFiles::Bundled => BUNDLED_MANIFEST.to_string(),
        }
    }
}

/// The manifest and the files of a run's corpus: `manifest` `None` (or
/// [`BUNDLED_MANIFEST`], as a report records it) is the bundled corpus;
/// otherwise the manifest file, its streams below [`resolve_data_root`].
pub fn open_corpus(manifest: Option<&Path>, data_root: Option<&Path>) -> Result<(Manifest, CorpusFiles)> {
    match manifest.filter(|m| *m != Path::new(BUNDLED_MANIFEST)) {
        None => Ok((bundled_manifest()?, CorpusFiles::Bundled)),
        Some(m) => Ok((load_manifest(m)?, CorpusFiles::Dir(resolve_data_root(data_root, m)))),
    }
}

/// Reads `--text FILE`: the file's bytes as they are, which must be UTF-8.
pub fn read_text_file(path: &Path) -> Result<String> {
    let bytes = read_bounded(path, MAX_TEXT_BYTES, "--text")?;
    decode_utf8(bytes, path)
}

/// Reads `--tokens FILE`: a JSON array of token ids (`[1, 2, 3]`).
pub fn read_tokens_file(path: &Path) -> Result<Vec<u32>> {
    let bytes = read_bounded(path, MAX_TOKENS_FILE_BYTES, "--tokens")?;
    parse_tokens(&bytes).with_context(|| format!("token file {}", path.display()))
}

/// The ids of a `--tokens` file's bytes: a non-empty JSON array of u32.
pub fn parse_tokens(bytes: &[u8]) -> Result<Vec<u32>> {
    let ids: Vec<u32> = serde_json::from_slice(bytes).context("expected a JSON array of token ids (u32)")?;
    if ids.is_empty() {
        bail!("the array is empty");
    }
    Ok(ids)
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn decode_utf8(bytes: Vec<u8>, path: &Path) -> Result<String> {
    String::from_utf8(bytes).map_err(|e| {
        let err = e.utf8_error();
        anyhow::anyhow!("{} is not valid UTF-8: invalid byte sequence at byte offset {}", path.display(), err.valid_up_to())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn spec(id: &str, domain: &str, path: &str, content: &[u8]) -> serde_json::Value {
        serde_json::json!({
            "id": id, "domain": domain, "path": path, "bytes": content.len(),
            "sha256": sha256_hex(content), "url": format!("https://example.invalid/{path}"),
            "license": "CC0", "source": "test@0:x"
        })
    }

    fn write_manifest(dir: &Path, streams: Vec<serde_json::Value>) -> PathBuf {
        let m = serde_json::json!({ "name": "t", "version": 1, "description": "test", "streams": streams });
        let p = dir.join("manifest.json");
        fs::write(&p, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
        p
    }

    #[test]
    fn loads_selects_and_reads() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("sub")).unwrap();
        let files: [(&str, &str, &str, &[u8]); 4] = [
            ("a", "en", "a.txt", b"hello\r\n"),
            ("b", "zh", "sub/b.txt", "\u{feff}\u{5112}\u{6797}\n".as_bytes()),
            ("c", "en", "c.txt", b"second en"),
            ("d", "code", "d.txt", b"int x;"),
        ];
        for (_, _, p, c) in files {
            fs::write(dir.path().join(p), c).unwrap();
        }
        let mp = write_manifest(dir.path(), files.iter().map(|(i, d, p, c)| spec(i, d, p, c)).collect());
        let m = load_manifest(&mp).unwrap();
        assert_eq!(m.sha256, sha256_hex(&fs::read(&mp).unwrap()));
        let ids = |v: Vec<&StreamSpec>| v.iter().map(|s| s.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(select(&m, true)), ["a", "b", "d"]);
        assert_eq!(ids(select(&m, false)), ["a", "b", "c", "d"]);
        let corpus = Corpus::from_manifest(&m, true);
        assert_eq!((corpus.name.as_str(), corpus.streams.len()), ("t", 3));
        assert_eq!(corpus.manifest_sha256, m.sha256);
        // Bytes come back as they are: CRLF and the BOM kept.
        assert_eq!(read_stream(dir.path(), &m.streams[0]).unwrap(), "hello\r\n");
        assert!(read_stream(dir.path(), &m.streams[1]).unwrap().starts_with('\u{feff}'));
    }

    #[test]
    fn bad_manifests_name_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let mp = write_manifest(dir.path(), vec![spec("x", "en", "a", b"1"), spec("x", "en", "b", b"2")]);
        let e = format!("{:#}", load_manifest(&mp).unwrap_err());
        assert!(e.contains("duplicate stream id \"x\"") && e.contains("manifest.json"), "{e}");

        let mut s = spec("y", "en", "a", b"1");
        s.as_object_mut().unwrap().remove("sha256");
        let mp = write_manifest(dir.path(), vec![s]);
        let e = format!("{:#}", load_manifest(&mp).unwrap_err());
        assert!(e.contains("missing field `sha256`") && e.contains("manifest.json"), "{e}");

        let mp = write_manifest(dir.path(), vec![spec("z", "en", "../etc/passwd", b"1")]);
        let e = format!("{:#}", load_manifest(&mp).unwrap_err());
        assert!(e.contains("stream z: field `path`"), "{e}");

        let mut s = spec("w", "en", "a", b"1");
        s["source_encoding"] = "KOI8-R".into();
        let mp = write_manifest(dir.path(), vec![s]);
        let e = format!("{:#}", load_manifest(&mp).unwrap_err());
        assert!(e.contains("KOI8-R"), "{e}");

        let e = format!("{:#}", load_manifest(&dir.path().join("nope.json")).unwrap_err());
        assert!(e.contains("nope.json"), "{e}");
    }

    #[test]
    fn stream_errors_name_the_stream() {
        let dir = tempfile::tempdir().unwrap();
        let s: StreamSpec = serde_json::from_value(spec("s1", "en", "f.txt", b"abc")).unwrap();
        let e = format!("{:#}", read_stream(dir.path(), &s).unwrap_err());
        assert!(e.contains("stream s1") && e.contains("f.txt"), "{e}");
        fs::write(dir.path().join("f.txt"), b"abcd").unwrap();
        let e = format!("{:#}", read_stream(dir.path(), &s).unwrap_err());
        assert!(e.contains("stream s1") && e.contains("4 bytes") && e.contains("says 3"), "{e}");
        fs::write(dir.path().join("f.txt"), b"abd").unwrap();
        let e = format!("{:#}", read_stream(dir.path(), &s).unwrap_err());
        assert!(e.contains("stream s1") && e.contains("SHA-256"), "{e}");
        let bad = b"ab\xe9";
        let s: StreamSpec = serde_json::from_value(spec("s2", "en", "g.txt", bad)).unwrap();
        fs::write(dir.path().join("g.txt"), bad).unwrap();
        let e = format!("{:#}", read_stream(dir.path(), &s).unwrap_err());
        assert!(e.contains("stream s2") && e.contains("g.txt") && e.contains("byte offset 2"), "{e}");
    }

    #[test]
    fn text_and_token_files() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t.txt");
        fs::write(&t, "x\u{e9}\n").unwrap();
        assert_eq!(read_text_file(&t).unwrap(), "x\u{e9}\n");
        fs::write(&t, b"xyz\xff").unwrap();
        let e = format!("{:#}", read_text_file(&t).unwrap_err());
        assert!(e.contains("t.txt") && e.contains("byte offset 3"), "{e}");

        let k = dir.path().join("k.json");
        fs::write(&k, "[1, 2, 4294967295]").unwrap();
        assert_eq!(read_tokens_file(&k).unwrap(), vec![1, 2, u32::MAX]);
        for bad in ["[1, -2]", "{\"a\": 1}", "[]", "[1, 4294967296]"] {
            fs::write(&k, bad).unwrap();
            let e = format!("{:#}", read_tokens_file(&k).unwrap_err());
            assert!(e.contains("k.json"), "{bad}: {e}");
        }
    }

    #[test]
    fn data_root_precedence() {
        let m = Path::new("/x/y/manifest.json");
        let cli = Path::new("/cli");
        assert_eq!(resolve_data_root_from(Some(cli), Some("/env".into()), m), PathBuf::from("/cli"));
        assert_eq!(resolve_data_root_from(None, Some("/env".into()), m), PathBuf::from("/env"));
        assert_eq!(resolve_data_root_from(None, None, m), PathBuf::from("/x/y"));
        assert_eq!(resolve_data_root_from(None, None, Path::new("manifest.json")), PathBuf::from("."));
    }

    #[test]
    fn bundled_corpus_is_the_manifest_exactly() {
        let m = bundled_manifest().unwrap();
        let on_disk = load_manifest(&Path::new(env!("CARGO_MANIFEST_DIR")).join("eval/corpora/ppl-v1/manifest.json")).unwrap();
        assert_eq!(m, on_disk);
        let listed: Vec<&str> = m.streams.iter().map(|s| s.path.as_str()).collect();
        let bundled: Vec<&str> = BUNDLED_FILES.iter().map(|(p, _)| *p).collect();
        assert_eq!(listed, bundled, "BUNDLED_FILES must list the manifest's streams in order");
        for s in &m.streams {
            let text = CorpusFiles::Bundled.read(s).unwrap_or_else(|e| panic!("{e:#}"));
            assert_eq!(text.len() as u64, s.bytes, "{}", s.id);
        }
        let (m2, files) = open_corpus(None, Some(Path::new("/ignored"))).unwrap();
        assert_eq!((m2.sha256, files.describe()), (m.sha256.clone(), BUNDLED_MANIFEST.to_string()));
        assert_eq!(open_corpus(Some(Path::new(BUNDLED_MANIFEST)), None).unwrap().1, CorpusFiles::Bundled);
        let mut other = m.streams[0].clone();
        other.path = "nope.txt".into();
        let e = format!("{:#}", CorpusFiles::Bundled.read(&other).unwrap_err());
        assert!(e.contains("nope.txt") && e.contains("not in the bundled corpus"), "{e}");
    }

    #[test]
    fn sha256_known_value() {
        // FIPS 180-2 example: SHA-256("abc").
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
