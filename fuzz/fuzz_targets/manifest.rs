//! Corpus manifest (`text::corpus::parse_manifest`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = infernix_perplexity::text::corpus::parse_manifest(data) {
        let _ = infernix_perplexity::text::corpus::select(&m, true);
    }
});
