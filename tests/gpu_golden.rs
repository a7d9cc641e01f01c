//! Writes `tests/data/gpu_e2e_cpu_golden.json`: the CPU backend's per-window
//! NLL sums for the end-to-end workloads of `tests/gpu_e2e.rs` (both real
//! models; wiki.test.raw chunks c=512, first 40; sliding 4096/2048, first 4
//! windows). The GPU's FP32 route must match these within 1e-4 nats per
//! window. The CPU backend is itself checked against the exact float64
//! reference (tests/cpu_reference.rs). Ignored by default (about 15 minutes
//! on 2 cores):
//! `cargo test --release --test gpu_golden -- --ignored --nocapture`.

#[path = "gpu_e2e/cases.rs"]
mod cases;

use infernix_perplexity::backend::cpu::CpuBackend;
use infernix_perplexity::model::{ScoreOptions, Transformer, WindowScorer};

#[test]
#[ignore = "slow: regenerates the golden file with the CPU backend"]
fn write_cpu_golden() {
    let mut golden = cases::Golden {
        source: "CPU backend (tests/gpu_golden.rs), one prefill pass per window; regenerate with \
                 `cargo test --release --test gpu_golden -- --ignored`"
            .into(),
        runs: Default::default(),
    };
    for m in &cases::MODELS {
        let art = cases::artifact(m);
        let tokens = cases::wiki_tokens(m, &art);
        let mut model = Transformer::load(CpuBackend::default(), &art).expect("load");
        for p in &cases::PROTOCOLS {
            let mut out = Vec::new();
            for (w, t, first) in cases::windows(&art, &tokens, p) {
                let started = std::time::Instant::now();
                let s = model.score_window(&t, first, &ScoreOptions::default(), &[]).expect("score");
                let nll_sum: f64 = s.iter().map(|r| r.nll).sum();
                eprintln!(
                    "{}/{} window {}: {} targets, mean NLL {:.9} ({:.1} s)",
                    m.key,
                    p.key,
                    w.index,
                    s.len(),
                    nll_sum / s.len() as f64,
                    started.elapsed().as_secs_f64()
                );
                assert!(nll_sum.is_finite());
                out.push(cases::WindowGolden { begin: w.begin, end: w.end, n_scored: s.len(), nll_sum });
            }
            golden.runs.insert(format!("{}/{}", m.key, p.key), out);
            // Written after every run, so a partial file is usable for a quick look.
            let json = serde_json::to_string_pretty(&golden).expect("json");
            std::fs::write(cases::golden_path(), json).expect("write golden");
        }
    }
    assert_eq!(golden.runs.len(), 4);
}
