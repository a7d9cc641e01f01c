//! GGUF v2/v3 reader: parses the header, the metadata key/value pairs and the
//! tensor index of a memory-mapped file, validating every offset before use.
//!
//! It owns nothing beyond the file: interpreting metadata (architecture
//! hyperparameters, tokenizer) is `convert::arch` and `convert::tokenizer`.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;

use crate::artifact::format::TensorFormat;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A JSON rendering for provenance; long arrays are summarised by length.
    pub fn to_json_summary(&self) -> serde_json::Value {
        use serde_json::Value;
        match self {
            Self::String(s) => Value::String(s.clone()),
            Self::Bool(b) => Value::Bool(*b),
            Self::F32(v) => serde_json::json!(*v as f64),
            Self::F64(v) => serde_json::json!(*v),
            Self::Array(a) if a.len() > 64 => serde_json::json!({ "array_len": a.len() }),
            Self::Array(a) => Value::Array(a.iter().map(Self::to_json_summary).collect()),
            v => v.as_i64().map_or(Value::Null, |i| serde_json::json!(i)),
        }
    }
}

/// One entry of the tensor index.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub name: String,
    /// GGUF order: dims[0] is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Absolute byte offset in the file.
    pub offset: u64,
    pub n_bytes: u64,
}

impl GgufTensor {
    pub fn n_elems(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Logical shape, outermost first (row-major), as the artifact records it.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    pub fn format(&self) -> Option<TensorFormat> {
        TensorFormat::from_ggml_type(self.ggml_type)
    }
}

/// A parsed, validated GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: Vec<(String, GgufValue)>,
    index: HashMap<String, usize>,
    pub tensors: Vec<GgufTensor>,
    pub data_offset: u64,
    mmap: Mmap,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

/// Bytes of the smallest metadata key/value record: key length (8), one key
/// byte is not required (empty keys parse), value type (4), a 1-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Bytes of the smallest tensor-index record: name length (8), n_dims (4),
/// one dimension (8), type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;
/// The most items reserved up front for any list read from the file; lists
/// grow as their items are actually read.
const MAX_PREALLOC: usize = 1 << 16;

/// Bytes of the smallest encoding of a value of GGUF type `ty`.
fn min_value_bytes(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 4 + 8,
        _ => return None,
    })
}

impl<'a> Cursor<'a> {
    /// Bytes left after the cursor.
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    /// Checks a count read from the file against what the remaining bytes
    /// can hold at `min_bytes` per record.
    fn check_count(&self, n: u64, min_bytes: u64, what: &str) -> Result<()> {
        let fits = self.remaining() / min_bytes.max(1);
        if n > fits {
            bail!(
                "{what} {n}: the remaining {} bytes hold at most {fits} records of at least {min_bytes} bytes (corrupted count)",
                self.remaining()
            );
        }
        Ok(())
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => bail!(
                "truncated: {} needs {n} bytes at offset {}, file has {}",
                what(),
                self.pos,
                self.bytes.len()
            ),
        }
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.u64(what)?;
        let n = usize::try_from(n).ok().filter(|&n| n as u64 <= self.remaining()).ok_or_else(|| {
            anyhow!("truncated: {} claims a string of {n} bytes, {} remain", what(), self.remaining())
        })?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| anyhow!("{} is not valid UTF-8", what()))
    }
    fn value(&mut self, ty: u32, what: &dyn Fn() -> String, depth: u32) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.take(1, what)?[0]),
            1 => GgufValue::I8(self.take(1, what)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.take(2, what)?.try_into().expect("2"))),
            3 => GgufValue::I16(i16::from_le_bytes(self.take(2, what)?.try_into().expect("2"))),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(self.u32(what)? as i32),
            6 => GgufValue::F32(f32::from_bits(self.u32(what)?)),
            7 => GgufValue::Bool(self.take(1, what)?[0] != 0),
            8 => GgufValue::String(self.string(what)?),
            9 => {
                if depth > 2 {
                    bail!("{}: arrays nested too deep", what());
                }
                let item_ty = self.u32(what)?;
                let n = self.u64(what)?;
                let min = min_value_bytes(item_ty).ok_or_else(|| anyhow!("{}: unknown array item type {item_ty}", what()))?;
                self.check_count(n, min, &format!("{}: array length", what()))?;
                let mut items = Vec::with_capacity((n as usize).min(MAX_PREALLOC));
                for _ in 0..n {
                    items.push(self.value(item_ty, what, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(self.u64(what)? as i64),
            12 => GgufValue::F64(f64::from_bits(self.u64(what)?)),
            other => bail!("{}: unknown value type {other}", what()),
        })
    }
}

impl GgufFile {
    /// Maps and parses `path`. Every error names the file and the field.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("open {}", path.display()))?;
        // SAFETY: the file is opened read-only and we never mutate through the map;
        // a concurrent writer would be a user error, as for any mmap-based reader.
        let mmap = unsafe { Mmap::map(&file) }.with_context(|| format!("mmap {}", path.display()))?;
        Self::parse(path, mmap).with_context(|| format!("{}", path.display()))
    }

    fn parse(path: &Path, mmap: Mmap) -> Result<Self> {
        let GgufIndex { version, metadata, index, tensors, data_offset } = parse_index(&mmap)?;
        Ok(Self { path: path.to_path_buf(), version, metadata, index, tensors, data_offset, mmap })
    }
}

/// Everything the header and the tensor index say, validated against the bytes.
pub struct GgufIndex {
    pub version: u32,
    pub metadata: Vec<(String, GgufValue)>,
    index: HashMap<String, usize>,
    pub tensors: Vec<GgufTensor>,
    pub data_offset: u64,
}

/// Parses and validates a GGUF file's header, metadata and tensor index
/// from its bytes (the whole file: tensor spans are checked against its
/// length). Every count is bounded by the bytes that remain.
pub fn parse_index(bytes: &[u8]) -> Result<GgufIndex> {
    let mut cur = Cursor { bytes, pos: 0 };
    let magic = cur.take(4, &|| "magic".into())?;
    if magic != GGUF_MAGIC {
        bail!("magic: expected \"GGUF\", found {:?}", String::from_utf8_lossy(magic));
    }
    let version = cur.u32(&|| "version".into())?;
    if !(2..=3).contains(&version) {
        bail!("version: GGUF version {version} is not supported (2 or 3)");
    }
    let n_tensors = cur.u64(&|| "tensor_count".into())?;
    let n_kv = cur.u64(&|| "kv_count".into())?;
    cur.check_count(n_kv, MIN_KV_BYTES, "kv_count")?;
    cur.check_count(n_tensors, MIN_TENSOR_INFO_BYTES, "tensor_count")?;
    let both = n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES;
    if both > cur.remaining() {
        bail!(
            "kv_count {n_kv} and tensor_count {n_tensors}: need at least {both} bytes, {} remain (corrupted count)",
            cur.remaining()
        );
    }
    let mut metadata = Vec::with_capacity((n_kv as usize).min(MAX_PREALLOC));
    for i in 0..n_kv {
        let key = cur.string(&|| format!("metadata key #{i}"))?;
        let ty = cur.u32(&|| format!("metadata {key}: type"))?;
        let value = cur.value(ty, &|| format!("metadata {key}"), 0)?;
        metadata.push((key, value));
    }
    let alignment = metadata
        .iter()
        .find(|(k, _)| k == "general.alignment")
        .map(|(_, v)| v.as_u64().ok_or_else(|| anyhow!("general.alignment: not an integer")))
        .transpose()?
        .unwrap_or(DEFAULT_ALIGNMENT);
    if alignment == 0 || !alignment.is_power_of_two() {
        bail!("general.alignment: {alignment} is not a power of two");
    }
    cur.check_count(n_tensors, MIN_TENSOR_INFO_BYTES, "tensor_count")?;
    let mut tensors = Vec::with_capacity((n_tensors as usize).min(MAX_PREALLOC));
    for i in 0..n_tensors {
        let name = cur.string(&|| format!("tensor #{i}: name"))?;
        let n_dims = cur.u32(&|| format!("tensor {name}: n_dims"))?;
        if n_dims == 0 || n_dims > 4 {
            bail!("tensor {name}: n_dims {n_dims} is not in 1..=4");
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(cur.u64(&|| format!("tensor {name}: dim {d}"))?);
        }
        let ggml_type = cur.u32(&|| format!("tensor {name}: type"))?;
        let offset = cur.u64(&|| format!("tensor {name}: offset"))?;
        tensors.push(GgufTensor { name, dims, ggml_type, offset, n_bytes: 0 });
    }
    let data_offset = (cur.pos as u64).div_ceil(alignment) * alignment;
    let file_len = bytes.len() as u64;
    let mut index = HashMap::with_capacity(tensors.len());
    for (i, t) in tensors.iter_mut().enumerate() {
        if index.insert(t.name.clone(), i).is_some() {
            bail!("tensor {}: duplicate name", t.name);
        }
        let n_elems = t.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let n_elems = n_elems.ok_or_else(|| anyhow!("tensor {}: shape overflows", t.name))?;
        // Unknown types are kept here (the converter names them); their size is unknown.
        if let Some(f) = t.format() {
            t.n_bytes = f
                .bytes_for(n_elems)
                .with_context(|| format!("tensor {}: shape {:?}", t.name, t.dims))?;
        }
        if t.offset % alignment != 0 {
            bail!("tensor {}: offset {} is not aligned to {alignment}", t.name, t.offset);
        }
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes));
        match (start, end) {
            (Some(s), Some(e)) if e <= file_len => t.offset = s,
            _ => bail!(
                "tensor {}: offset {} + {} bytes is past the end of the file ({file_len} bytes)",
                t.name,
                t.offset,
                t.n_bytes
            ),
        }
    }
    let mut spans: Vec<(u64, u64, &str)> =
        tensors.iter().map(|t| (t.offset, t.offset + t.n_bytes, t.name.as_str())).collect();
    spans.sort();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            bail!("tensor {}: overlaps tensor {}", w[1].2, w[0].2);
        }
    }
    Ok(GgufIndex { version, metadata, index, tensors, data_offset })
}

impl GgufFile {
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    fn require(&self, key: &str) -> Result<&GgufValue> {
        self.get(key).ok_or_else(|| anyhow!("{}: metadata {key} is missing", self.path.display()))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.require(key)?
            .as_str()
            .ok_or_else(|| anyhow!("{}: metadata {key} is not a string", self.path.display()))
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.require(key)?
            .as_u64()
            .ok_or_else(|| anyhow!("{}: metadata {key} is not an unsigned integer", self.path.display()))
    }

    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.require(key)?
            .as_f64()
            .ok_or_else(|| anyhow!("{}: metadata {key} is not a number", self.path.display()))
    }

    pub fn get_array(&self, key: &str) -> Result<&[GgufValue]> {
        self.require(key)?
            .as_array()
            .ok_or_else(|| anyhow!("{}: metadata {key} is not an array", self.path.display()))
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor whose format we keep.
    pub fn tensor_bytes(&self, t: &GgufTensor) -> &[u8] {
        &self.mmap[t.offset as usize..(t.offset + t.n_bytes) as usize]
    }
}

/// Writes a GGUF v3 file: used by the synthetic-model twin and by tests that
/// need small or deliberately broken files.
pub struct GgufWriter<'a> {
    pub metadata: Vec<(String, GgufValue)>,
    /// (name, GGUF dims innermost first, ggml type id, bytes)
    pub tensors: Vec<(String, Vec<u64>, u32, &'a [u8])>,
}

fn value_type_id(v: &GgufValue) -> u32 {
    match v {
        GgufValue::U8(_) => 0,
        GgufValue::I8(_) => 1,
        GgufValue::U16(_) => 2,
        GgufValue::I16(_) => 3,
        GgufValue::U32(_) => 4,
        GgufValue::I32(_) => 5,
        GgufValue::F32(_) => 6,
        GgufValue::Bool(_) => 7,
        GgufValue::String(_) => 8,
        GgufValue::Array(_) => 9,
        GgufValue::U64(_) => 10,
        GgufValue::I64(_) => 11,
        GgufValue::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.push(*x as u8),
        GgufValue::U16(x) => out.extend(x.to_le_bytes()),
        GgufValue::I16(x) => out.extend(x.to_le_bytes()),
        GgufValue::U32(x) => out.extend(x.to_le_bytes()),
        GgufValue::I32(x) => out.extend(x.to_le_bytes()),
        GgufValue::F32(x) => out.extend(x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(*x as u8),
        GgufValue::String(s) => put_str(out, s),
        GgufValue::Array(a) => {
            out.extend(a.first().map_or(4, value_type_id).to_le_bytes());
            out.extend((a.len() as u64).to_le_bytes());
            a.iter().for_each(|x| put_value(out, x));
        }
        GgufValue::U64(x) => out.extend(x.to_le_bytes()),
        GgufValue::I64(x) => out.extend(x.to_le_bytes()),
        GgufValue::F64(x) => out.extend(x.to_le_bytes()),
    }
}

impl GgufWriter<'_> {
    /// Header, metadata and tensor index, padded to the data section, plus
    /// each tensor's offset relative to that section.
    fn header(&self) -> (Vec<u8>, Vec<u64>) {
        let mut out = Vec::new();
        out.extend(GGUF_MAGIC);
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend(value_type_id(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, bytes) in &self.tensors {
            put_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + bytes.len() as u64).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
        }
        out.resize(out.len().div_ceil(DEFAULT_ALIGNMENT as usize) * DEFAULT_ALIGNMENT as usize, 0);
        (out, offsets)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let (mut out, offsets) = self.header();
        let base = out.len();
        for ((_, _, _, bytes), off) in self.tensors.iter().zip(offsets) {
            out.resize(base + off as usize, 0);
            out.extend(*bytes);
        }
        out
    }

    /// Streams the file to `path` atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        use std::io::Write;
        let (header, offsets) = self.header();
        let f = crate::util::fs::AtomicFile::create(path)?;
        let io = |e: std::io::Error| anyhow::Error::new(e).context(format!("write {}", path.display()));
        let mut w = std::io::BufWriter::with_capacity(1 << 22, f.file());
        w.write_all(&header).map_err(io)?;
        let mut pos = 0u64;
        for ((_, _, _, bytes), off) in self.tensors.iter().zip(offsets) {
            w.write_all(&vec![0u8; (off - pos) as usize]).map_err(io)?;
            w.write_all(bytes).map_err(io)?;
            pos = off + bytes.len() as u64;
        }
        w.flush().map_err(io)?;
        drop(w);
        f.commit()
    }
}
