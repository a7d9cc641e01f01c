//! Byte layout of a `.ninfer` file, shared by the reader and the writer.
//!
//! ```text
//! 0   magic  b"NINFER\0\0"       8 bytes
//! 8   version u32 LE = 4
//! 12  reserved u32 = 0
//! 16  metadata_bytes u64 LE      length of the JSON block
//! 24  data_offset u64 LE         first byte of the data section (multiple of ALIGNMENT)
//! 32  metadata_sha256 [u8; 32]   SHA-256 of the JSON block (v4; absent in v3)
//! 64  metadata JSON (UTF-8)      ArtifactMeta (at 32 in v3)
//! ... zero padding
//! data_offset: tensors and blobs, each starting on an ALIGNMENT boundary
//! ```
//!
//! Version 4 adds the metadata digest: every open checks it (the JSON is a
//! few hundred kB at most), so the hyperparameters and the tensor table are
//! covered as the tensors are by their own SHA-256. Version 3 files (no
//! digest) still open; `--verify` refuses them ("reconvert with
//! ninfer-convert"), since their metadata cannot be checked.

pub const MAGIC: &[u8; 8] = b"NINFER\0\0";
pub const VERSION: u32 = 4;
/// The version before the metadata digest; still read.
pub const VERSION_V3: u32 = 3;
/// Header bytes of a version-4 file (metadata digest included).
pub const HEADER_BYTES: usize = 64;
/// Header bytes of a version-3 file.
pub const HEADER_BYTES_V3: usize = 32;
/// Every tensor and blob starts on this boundary (enough for 16-byte vector
/// loads and for mapping pages to a device directly).
pub const ALIGNMENT: u64 = 256;

pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGNMENT) * ALIGNMENT
}

/// The version-4 header for a metadata block `json` and the data section at `data_offset`.
pub fn encode_header(json: &[u8], data_offset: u64) -> [u8; HEADER_BYTES] {
    use sha2::{Digest, Sha256};
    let mut h = [0u8; HEADER_BYTES];
    h[0..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&(json.len() as u64).to_le_bytes());
    h[24..32].copy_from_slice(&data_offset.to_le_bytes());
    h[32..64].copy_from_slice(&Sha256::digest(json));
    h
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex(&Sha256::digest(bytes))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
