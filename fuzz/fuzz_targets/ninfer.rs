//! `.ninfer` header, metadata JSON (digest, schema) and tensor table with the
//! hyperparameter check (`artifact::reader`), as `Artifact::open` runs them.
#![no_main]
use infernix_perplexity::artifact::reader::{check_tensor_table, parse_header_and_meta};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = parse_header_and_meta(data) {
        let _ = check_tensor_table(&h.meta, h.data_offset, data.len() as u64);
    }
});
