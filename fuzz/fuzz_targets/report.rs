//! report.json as `compare` reads it (`compare::input::parse_report`, schema
//! version 4 or 3), then pairing it with itself and the KL comparison.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    use infernix_perplexity::compare::{input, kl};
    if let Ok(view) = input::parse_report(data) {
        let _ = input::pair_windows(&view, &view);
        let _ = kl::compare(view.kl.as_ref(), view.kl.as_ref());
    }
});
