//! Issue 14: `--shard K/N` and `merge` give exactly the one-process report.
//! The Slurm task script (scripts/cluster/slurm-shard.sh) runs locally once
//! per array task with `SLURM_ARRAY_TASK_ID` set, then the merge script, on
//! the real SmolLM2 on the CPU (bundled quick corpus, 64-token windows); the
//! merged report is compared with a one-process run number for number.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

const FLAGS: [&str; 10] = ["--quick", "--context", "64", "--stride", "32", "--chunks", "2", "--backend", "cpu", "--log-level=warn"];

fn model() -> PathBuf {
    common::model("SmolLM2-135M-Instruct.Q4_1.ninfer")
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/cluster").join(name)
}

#[test]
fn slurm_array_shards_merge_to_the_one_process_report() {
    let t = tempfile::tempdir().unwrap();
    let results = t.path().join("results");
    std::fs::create_dir(&results).unwrap();
    let n_shards = 3;
    for k in 0..n_shards {
        let o = Command::new("bash")
            .arg(script("slurm-shard.sh"))
            .args(FLAGS)
            .env("SLURM_ARRAY_TASK_ID", k.to_string())
            .env("N_SHARDS", n_shards.to_string())
            .env("MODEL", model())
            .env("RESULTS", &results)
            .env("INFERNIX_BIN", env!("CARGO_BIN_EXE_infernix-perplexity"))
            .output()
            .unwrap();
        assert!(o.status.success(), "task {k}: {}", String::from_utf8_lossy(&o.stderr));
        let r = common::reports::read_json(&results.join(format!("shard-{k}")));
        assert_eq!(r["workload"]["shard"]["index"], k);
        assert_eq!(r["workload"]["shard"]["n_windows"], serde_json::json!([2, 2, 2, 2, 2]));
    }
    let o = Command::new("bash")
        .arg(script("slurm-merge.sh"))
        .env("RESULTS", &results)
        .env("INFERNIX_BIN", env!("CARGO_BIN_EXE_infernix-perplexity"))
        .output()
        .unwrap();
    assert!(o.status.success(), "merge: {}", String::from_utf8_lossy(&o.stderr));
    let table = String::from_utf8_lossy(&o.stdout).into_owned();

    let one = t.path().join("one");
    let o = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity")).arg(model()).args(FLAGS).arg("--output").arg(&one).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout), table, "the merge prints the one-process table");

    let (merged, single) = (common::reports::read_json(&results.join("merged")), common::reports::read_json(&one));
    assert!(merged["workload"].get("shard").is_none(), "a merged report is a whole run");
    assert_eq!(merged["results"]["overall"]["n_windows"], 10);
    // Every number but wall times, both uncertainties included, bit for bit.
    assert_eq!(common::reports::without_wall_times(merged.clone()), common::reports::without_wall_times(single.clone()));
    assert!(merged["results"]["overall"]["mean_nll_se_clustered"].as_f64().unwrap() > 0.0);
    assert_eq!(merged["timing"]["tokens_scored"], single["timing"]["tokens_scored"]);
    assert_eq!(merged["timing"]["tokens_processed"], single["timing"]["tokens_processed"]);
}
