//! Storage formats of tensors: the block layouts kept byte for byte from the
//! source (GGML's numbering, so a GGUF type id maps one to one).
//!
//! This module owns the table of block sizes and names; it does not decode
//! blocks (that is `backend::cpu::dequant`). The layouts themselves are
//! documented in `docs/ninfer-v3.md`.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// A tensor's storage format. The discriminant is GGML's type id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TensorFormat {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Iq4Nl = 20,
    Bf16 = 30,
    /// OCP microscaling FP4: 32 E2M1 values with one shared E8M0 scale (gpt-oss experts).
    Mxfp4 = 39,
}

pub const ALL_FORMATS: [TensorFormat; 14] = [
    TensorFormat::F32,
    TensorFormat::F16,
    TensorFormat::Bf16,
    TensorFormat::Q4_0,
    TensorFormat::Q4_1,
    TensorFormat::Q5_0,
    TensorFormat::Q5_1,
    TensorFormat::Q8_0,
    TensorFormat::Q2K,
    TensorFormat::Q3K,
    TensorFormat::Q4K,
    TensorFormat::Q5K,
    TensorFormat::Q6K,
    TensorFormat::Iq4Nl,
];

/// Formats the CUDA backend multiplies (matmul, gated FFN, LM head: its tile
/// loader `dequant8` and `dequant_bf16_<fmt>`) but does not embed (no
/// `embed_<fmt>` kernel: such a token-embedding table is refused by name).
/// Not in [`ALL_FORMATS`], which lists the formats every op of every backend
/// runs (the GPU parity suites iterate it; MXFP4 has its own parity tests).
pub const MATMUL_ONLY_FORMATS: [TensorFormat; 1] = [TensorFormat::Mxfp4];

/// Elements per super-block of the K-quants.
pub const QK_K: usize = 256;

impl TensorFormat {
    /// The format for a GGML type id, or `None` when we do not keep that type.
    pub fn from_ggml_type(id: u32) -> Option<Self> {
        ALL_FORMATS.iter().chain(&MATMUL_ONLY_FORMATS).copied().find(|f| *f as u32 == id)
    }

    /// Whether the CUDA backend's embedding kernel reads this format (`false`:
    /// matrix products only, see [`MATMUL_ONLY_FORMATS`]).
    pub fn cuda_embeds(self) -> bool {
        !MATMUL_ONLY_FORMATS.contains(&self)
    }

    /// GGML's name of a type id, for error messages about types we do not keep.
    pub fn ggml_type_name(id: u32) -> String {
        const NAMES: [&str; 40] = [
            "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K",
            "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
            "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M",
            "BF16", "Q4_0_4_4", "Q4_0_4_8", "Q4_0_8_8", "TQ1_0", "TQ2_0", "IQ4_NL_4_4", "IQ4_NL_4_8",
            "IQ4_NL_8_8", "MXFP4",
        ];
        NAMES.get(id as usize).map_or_else(|| format!("type {id}"), |n| format!("{n} (type {id})"))
    }

    /// The canonical name, as GGML spells it (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Bf16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::Iq4Nl => "IQ4_NL",
            Self::Mxfp4 => "MXFP4",
        }
    }

    pub fn from_name(name: &str) -> Result<Self> {
        match ALL_FORMATS.iter().chain(&MATMUL_ONLY_FORMATS).copied().find(|f| f.name().eq_ignore_ascii_case(name)) {
            Some(f) => Ok(f),
            None => bail!(
                "unknown tensor format {name:?} (known: {}, {})",
                ALL_FORMATS.map(|f| f.name()).join(", "),
                MATMUL_ONLY_FORMATS.map(|f| f.name()).join(", ")
            ),
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 | Self::Iq4Nl | Self::Mxfp4 => 32,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Iq4Nl => 18,
            Self::Mxfp4 => 17,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, Self::F32 | Self::F16 | Self::Bf16)
    }

    /// Bytes of a tensor of this format with `n_elems` elements; an error when
    /// the count is not a whole number of blocks or the size overflows u64
    /// (a corrupted shape: found by fuzzing the GGUF reader).
    pub fn bytes_for(self, n_elems: u64) -> Result<u64> {
        let per = self.block_elems() as u64;
        if n_elems % per != 0 {
            bail!("{} elements is not a multiple of the {} block size {per}", n_elems, self.name());
        }
        match (n_elems / per).checked_mul(self.block_bytes() as u64) {
            Some(n) => Ok(n),
            None => bail!("{n_elems} elements of {} do not fit in 2^64 bytes", self.name()),
        }
    }

    /// Bytes of one row of `n_cols` elements (rows must hold whole blocks).
    pub fn row_bytes(self, n_cols: usize) -> Result<usize> {
        Ok(self.bytes_for(n_cols as u64)? as usize)
    }
}

impl std::fmt::Display for TensorFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_ids_round_trip() {
        for f in ALL_FORMATS.into_iter().chain(MATMUL_ONLY_FORMATS) {
            assert_eq!(TensorFormat::from_ggml_type(f as u32), Some(f));
            assert_eq!(TensorFormat::from_name(f.name()).unwrap(), f);
        }
        assert_eq!(TensorFormat::from_ggml_type(15), None); // Q8_K is not kept
        assert_eq!(TensorFormat::ggml_type_name(23), "IQ4_XS (type 23)");
        assert_eq!(TensorFormat::ggml_type_name(39), "MXFP4 (type 39)");
        assert!(!TensorFormat::Mxfp4.cuda_embeds() && TensorFormat::Q4K.cuda_embeds());
    }

    #[test]
    fn block_sizes_match_ggml() {
        // sizeof(block_q4_K) = 2*2 + 12 + 128, sizeof(block_q6_K) = 128 + 64 + 16 + 2
        assert_eq!(TensorFormat::Q4K.block_bytes(), 2 * 2 + 12 + 128);
        assert_eq!(TensorFormat::Q6K.block_bytes(), 128 + 64 + 16 + 2);
        assert_eq!(TensorFormat::Q3K.block_bytes(), 32 + 64 + 12 + 2);
        assert_eq!(TensorFormat::Q2K.block_bytes(), 16 + 64 + 2 + 2);
        assert_eq!(TensorFormat::Q5K.block_bytes(), 2 * 2 + 12 + 32 + 128);
        assert_eq!(TensorFormat::Q8_0.bytes_for(64).unwrap(), 68);
        // sizeof(block_mxfp4) = 1 (E8M0) + 16 (32 nibbles)
        assert_eq!(TensorFormat::Mxfp4.bytes_for(64).unwrap(), 34);
        assert!(TensorFormat::Q4_0.bytes_for(33).is_err());
        // Issue 16 (fuzzing): a shape whose byte size overflows is an error, not a wrap.
        assert!(TensorFormat::F32.bytes_for(u64::MAX / 2).is_err());
    }
}
