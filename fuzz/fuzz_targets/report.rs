//! report.json as `compare` reads it (`compare::input::parse_report`), then
//! pairing it with itself and the KL block lookup.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    use infernix_perplexity::compare::{input, kl};
    if let Ok((view, raw)) = input::parse_report(data) {
        let _ = input::pair_windows(&view, &view);
        let _ = kl::compare(&raw, &raw);
    }
});
