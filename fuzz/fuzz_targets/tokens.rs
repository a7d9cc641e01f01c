//! `--tokens` JSON (`text::corpus::parse_tokens`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = infernix_perplexity::text::corpus::parse_tokens(data);
});
