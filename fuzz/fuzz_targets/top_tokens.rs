//! Top-tokens reference files (`score::topk::TopTokensReader`): the reader
//! takes a path, so each input is written to one file in /dev/shm (or the
//! temp folder) first.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    use std::sync::OnceLock;
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    let path = PATH.get_or_init(|| {
        let dir = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
        dir.join(format!("infernix-fuzz-topk-{}", std::process::id()))
    });
    if std::fs::write(path, data).is_ok() {
        if let Ok(mut r) = infernix_perplexity::score::topk::TopTokensReader::open(path) {
            let n = r.header.n_positions.min(64);
            let _ = r.read_records(n);
        }
    }
});
