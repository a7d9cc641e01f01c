//! Issue 14: `--resume DIR`. A run is interrupted (SIGINT) after some
//! windows, resumed from its checkpoints, and its report equals an
//! uninterrupted run's, number for number (all but wall times); a folder of
//! another plan is refused. SmolLM2 on the CPU, bundled quick corpus,
//! 64-token windows.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const FLAGS: [&str; 9] = ["--quick", "--context", "64", "--stride", "32", "--chunks", "2", "--backend", "cpu"];

fn eval() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"));
    c.arg(common::model("SmolLM2-135M-Instruct.Q4_1.ninfer")).args(FLAGS);
    c
}

fn n_checkpoints(dir: &Path) -> usize {
    std::fs::read_dir(dir.join("windows")).map_or(0, |d| d.filter_map(|e| e.ok()).filter(|e| e.path().extension().is_some_and(|x| x == "json")).count())
}

#[test]
fn interrupted_then_resumed_equals_uninterrupted() {
    let t = tempfile::tempdir().unwrap();
    let (ck, out1, out2, whole) = (t.path().join("ck"), t.path().join("r1"), t.path().join("r2"), t.path().join("whole"));
    // 1. Interrupt once 3 of the 10 windows are checkpointed.
    let mut child = eval().arg("--log-level=warn").arg("--resume").arg(&ck).arg("--output").arg(&out1).stderr(Stdio::piped()).spawn().unwrap();
    let started = Instant::now();
    while n_checkpoints(&ck) < 3 {
        assert!(started.elapsed() < Duration::from_secs(300), "no checkpoints appeared");
        assert!(child.try_wait().unwrap().is_none(), "the run ended before it was interrupted");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(Command::new("kill").arg("-INT").arg(child.id().to_string()).status().unwrap().success());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!out1.exists(), "an interrupted run writes no report");
    let n_kept = n_checkpoints(&ck);
    assert!((3..10).contains(&n_kept), "{n_kept} checkpoints left");
    assert!(ck.join("plan.json").exists());

    // 2. Resume: only the rest is scored, and the report is the uninterrupted one.
    let o = eval().arg("--resume").arg(&ck).arg("--output").arg(&out2).arg("--log-level=info").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains(&format!("{n_kept} of 10 windows already scored")), "{err}");
    assert_eq!(n_checkpoints(&ck), 10);
    let o = eval().arg("--log-level=warn").arg("--output").arg(&whole).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (resumed, single) = (common::reports::read_json(&out2), common::reports::read_json(&whole));
    assert_eq!(resumed["results"]["overall"]["n_windows"], 10);
    assert_eq!(common::reports::without_wall_times(resumed), common::reports::without_wall_times(single));

    // 3. Another plan into the same folder: one line, exit 2, nothing written.
    let before = std::fs::read(ck.join("plan.json")).unwrap();
    let mut other = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"));
    other.arg(common::model("SmolLM2-135M-Instruct.Q4_1.ninfer")).args(["--quick", "--context", "64", "--stride", "16", "--chunks", "2", "--backend", "cpu", "--log-level=warn"]);
    let o = other.arg("--resume").arg(&ck).arg("--output").arg(t.path().join("r3")).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("--resume") && err.contains("another plan") && err.contains("plan.workload.stride"), "{err}");
    assert!(!t.path().join("r3").exists());
    assert_eq!(std::fs::read(ck.join("plan.json")).unwrap(), before);
}

/// A mixture-of-experts model (the tiny synthetic qwen3moe, two windows per
/// pass): the expert-usage counts of a resumed run are an uninterrupted
/// run's. Removing a pass's carrier (its last window's checkpoint, which
/// holds the pass's counts) makes the resumed run score that whole pass
/// again; removing another pass's first window leaves its carrier without
/// the pass, which is scored again too.
#[test]
fn resumed_moe_run_keeps_the_expert_counts() {
    use infernix_perplexity::convert::synthetic::{moe_geometry, write_synthetic_moe};
    use infernix_perplexity::artifact::TensorFormat;
    let t = tempfile::tempdir().unwrap();
    let model = t.path().join("moe.ninfer");
    write_synthetic_moe(&moe_geometry("qwen3moe-tiny").unwrap(), TensorFormat::Q4_0, 11, &common::model(common::SMOLLM2_GGUF), &model, None).unwrap();
    let run = |out: &Path, resume: Option<&Path>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"));
        c.arg(&model).args(FLAGS).args(["--batch-tokens", "128", "--log-level=info", "--output"]).arg(out);
        if let Some(dir) = resume {
            c.arg("--resume").arg(dir);
        }
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{err}");
        err
    };
    let (ck, whole, first, again) = (t.path().join("ck"), t.path().join("whole"), t.path().join("first"), t.path().join("again"));
    run(&whole, None);
    run(&first, Some(&ck));
    let single = common::reports::read_json(&whole);
    let usage = &single["results"]["expert_usage"];
    assert!(usage["rows"].as_u64().unwrap() > 0, "{usage}");
    assert_eq!(common::reports::without_wall_times(common::reports::read_json(&first)), common::reports::without_wall_times(single.clone()));

    // The carriers: checkpoints holding a pass's counts, and the windows (files) of each pass.
    let mut passes: Vec<Vec<String>> = Vec::new();
    for e in std::fs::read_dir(ck.join("windows")).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "json") {
            let c: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            if let Some(b) = c.get("batch_usage") {
                let stream = path.file_name().unwrap().to_string_lossy().split('-').next().unwrap().to_string();
                passes.push(b["windows"].as_array().unwrap().iter().map(|w| format!("{stream}-{w}.json")).collect());
            }
        }
    }
    passes.sort();
    assert!(passes.iter().filter(|p| p.len() == 2).count() >= 2, "two windows per pass: {passes:?}");
    assert_eq!(passes.iter().map(Vec::len).sum::<usize>(), 10, "every window in exactly one pass: {passes:?}");
    let (a, b) = (&passes[0], &passes.iter().find(|p| p.len() == 2 && *p != &passes[0]).unwrap());
    std::fs::remove_file(ck.join("windows").join(&a[a.len() - 1])).unwrap();
    std::fs::remove_file(ck.join("windows").join(&b[0])).unwrap();
    let err = run(&again, Some(&ck));
    let n_kept = 10 - a.len() - b.len();
    assert!(err.contains(&format!("{n_kept} of 10 windows already scored")), "{err}");
    assert!(err.contains(&format!("{} checkpoints of passes cut short", a.len() + b.len() - 2)), "{err}");
    assert_eq!(n_checkpoints(&ck), 10);
    let resumed = common::reports::read_json(&again);
    assert_eq!(resumed["results"]["expert_usage"], *usage);
    assert_eq!(common::reports::without_wall_times(resumed), common::reports::without_wall_times(single));
}
