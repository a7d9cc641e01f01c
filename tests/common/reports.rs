//! Reports built from the writer's typed structs (`report::Report`), for
//! the tests of `compare` and `merge` that need many windows and no model,
//! and the reading of written reports for the scale-out tests.

use infernix_perplexity::backend::ExecutionSpec;
use infernix_perplexity::report::{
    ArtifactInfo, BosPolicy, Execution, Report, Results, StreamResult, Timing, ToolInfo, WindowResult, Workload, SCHEMA_VERSION,
};

/// A schema-4 report of `streams` (name, domain), each with `n_windows`
/// chunks-method windows of 512 tokens whose `scored` targets start at
/// `end - scored - 1` (the chunks method's 256 of 512 for 255 scored);
/// window `(s, i)` has mean NLL `mean(s, i)` (every target the same NLL).
pub fn constructed(streams: &[(&str, &str)], n_windows: usize, scored: usize, mean: impl Fn(usize, usize) -> f64) -> Report {
    let streams: Vec<StreamResult> = streams
        .iter()
        .enumerate()
        .map(|(s, (name, domain))| {
            let windows: Vec<WindowResult> = (0..n_windows)
                .map(|i| {
                    let m = mean(s, i);
                    WindowResult {
                        index: i,
                        begin: i * 512,
                        end: (i + 1) * 512,
                        first_target: (i + 1) * 512 - scored - 1,
                        scored,
                        tokens_sha256: format!("{:064x}", s * 1000 + i),
                        input_tokens: 512,
                        n_nonfinite: 0,
                        nll_sum: m * scored as f64,
                        nll_sq_sum: m * m * scored as f64,
                        mean_nll: m,
                        perplexity: m.exp(),
                        seconds: 0.5,
                        bytes: None,
                        by_position: Vec::new(),
                        kl_divergence: None,
                        kl_detail: None,
                    }
                })
                .collect();
            StreamResult {
                name: name.to_string(),
                domain: domain.to_string(),
                n_tokens: n_windows * 512,
                token_ids_sha256: format!("{:064x}", s + 7),
                summary: None,
                text_bytes: None,
                token_bytes: None,
                bytes: None,
                kl_divergence: None,
                windows,
            }
        })
        .collect();
    Report {
        schema_version: SCHEMA_VERSION,
        tool: ToolInfo::current(),
        artifact: ArtifactInfo {
            path: "m.ninfer".into(),
            architecture: "llama".into(),
            public_name: "constructed".into(),
            digest: "0".repeat(64),
            file_bytes: 0,
            sources: Vec::new(),
            weight_formats: Default::default(),
            tokenizer_sha256: "0".repeat(64),
            verified: false,
        },
        workload: Workload {
            input: "tokens".into(),
            input_path: None,
            corpus: None,
            method: "chunks".into(),
            context: 512,
            stride: None,
            chunks_limit: Some(n_windows),
            prefill_chunk_tokens: 1024,
            bos: BosPolicy { add_bos: true, bos_id: Some(1), replace_window_first_token: true },
            shard: None,
        },
        execution: Some(Execution {
            backend: "cpu".into(),
            device: "test".into(),
            route: "fp32".into(),
            threads: 1,
            spec: ExecutionSpec::lossless(1024),
            details: serde_json::json!({}),
        }),
        results: Results { overall: None, domains: Vec::new(), streams, by_position: Vec::new(), kl_divergence: None, expert_usage: None, invariance: None, early_stop: None },
        timing: Timing::default(),
        noise_floor: None,
        memory: None,
    }
}

/// `dir/report.json` as JSON.
pub fn read_json(dir: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap()
}

/// A report without its wall times (`timing`, each window's `seconds`) and
/// its memory peaks (`memory`, measured per process): what a sharded, resumed
/// or multi-worker run must reproduce exactly.
pub fn without_wall_times(mut r: serde_json::Value) -> serde_json::Value {
    r.as_object_mut().unwrap().remove("timing");
    r.as_object_mut().unwrap().remove("memory");
    for s in r["results"]["streams"].as_array_mut().unwrap() {
        for w in s["windows"].as_array_mut().unwrap() {
            w.as_object_mut().unwrap().remove("seconds");
        }
    }
    r
}
