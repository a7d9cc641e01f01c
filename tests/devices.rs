//! Issue 14: `--devices`. The hand-out (window g to worker g % n, one host
//! thread and one model copy per worker) and the join are the same code on
//! every backend; on the CPU `--devices 0,0` runs two workers, and the report
//! must equal a one-worker run number for number (all but wall times).
//! SmolLM2, bundled quick corpus, 64-token windows. The CUDA run of the same
//! check is `.devcarry/devices/run.sh` (docs/cluster.md).

mod common;

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn run(out: &Path, extra: &[&str]) -> Value {
    let o = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
        .arg(common::model("SmolLM2-135M-Instruct.Q4_1.ninfer"))
        .args(["--quick", "--context", "64", "--stride", "32", "--chunks", "2", "--backend", "cpu", "--log-level=warn", "--output"])
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&o.stderr));
    common::reports::without_wall_times(common::reports::read_json(out))
}

#[test]
fn two_workers_give_the_one_worker_report() {
    let t = tempfile::tempdir().unwrap();
    let one = run(&t.path().join("one"), &[]);
    let two = run(&t.path().join("two"), &["--devices", "0,0"]);
    let three = run(&t.path().join("three"), &["--devices", "0,0,0"]);
    assert_eq!(one["results"]["overall"]["n_windows"], 10);
    assert_eq!(two, one);
    assert_eq!(three, one);
}
