//! Byte layout of a `.ninfer` v3 file, shared by the reader and the writer.
//!
//! ```text
//! 0   magic  b"NINFER\0\0"       8 bytes
//! 8   version u32 LE = 3
//! 12  reserved u32 = 0
//! 16  metadata_bytes u64 LE      length of the JSON block
//! 24  data_offset u64 LE         first byte of the data section (multiple of ALIGNMENT)
//! 32  metadata JSON (UTF-8)      ArtifactMeta
//! ... zero padding
//! data_offset: tensors and blobs, each starting on an ALIGNMENT boundary
//! ```

pub const MAGIC: &[u8; 8] = b"NINFER\0\0";
pub const VERSION: u32 = 3;
pub const HEADER_BYTES: usize = 32;
/// Every tensor and blob starts on this boundary (enough for 16-byte vector
/// loads and for mapping pages to a device directly).
pub const ALIGNMENT: u64 = 256;

pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGNMENT) * ALIGNMENT
}

pub fn encode_header(metadata_bytes: u64, data_offset: u64) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&metadata_bytes.to_le_bytes());
    h[24..32].copy_from_slice(&data_offset.to_le_bytes());
    h
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex(&Sha256::digest(bytes))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
