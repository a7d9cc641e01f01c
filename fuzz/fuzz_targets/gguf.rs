//! GGUF header, metadata key/values and tensor index (`convert::gguf::parse_index`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = infernix_perplexity::convert::gguf::parse_index(data);
});
