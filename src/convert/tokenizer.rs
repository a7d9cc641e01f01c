//! TEMPORARY placeholder until the `tok` branch lands (replaced by the real module).
use anyhow::Result;
use std::path::Path;
use super::gguf::GgufFile;
use crate::artifact::meta::{BlobRef, TokenizerMeta};
fn policy() -> TokenizerMeta {
    TokenizerMeta { kind: "placeholder".into(), pre: None, bos_id: None, eos_id: None, add_bos: false, add_eos: false, blob: BlobRef { offset: 0, n_bytes: 0, sha256: String::new() } }
}
pub fn tokenizer_from_gguf(_g: &GgufFile) -> Result<(Vec<u8>, TokenizerMeta)> { Ok((b"{}".to_vec(), policy())) }
pub fn tokenizer_policy_from_hf(_f: &Path) -> Result<TokenizerMeta> { Ok(policy()) }
