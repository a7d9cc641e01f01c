//! Issue 14 with `--save-top-tokens` and `--kl-reference`: `--shard` plus
//! `merge`, `--devices 0,0` and `--resume` each give exactly the one-process
//! report (every KL statistic and quantile, the worst lists, KL by position,
//! the histogram; all but wall times) and a top-tokens file byte-identical
//! (`cmp`) to the one a single process writes. SmolLM2 on the CPU, bundled
//! quick corpus, 10 windows of 64 tokens; the reference is the same model
//! with f32 KV (`--lossless`) and the runs use the default fp8 KV, so the
//! KLs are not zero.

mod common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const FLAGS: [&str; 10] = ["--quick", "--context", "64", "--stride", "32", "--chunks", "2", "--backend", "cpu", "--log-level=warn"];

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
}

fn eval(out: &Path, extra: &[OsString]) -> Output {
    bin().arg(common::model("SmolLM2-135M-Instruct.Q4_1.ninfer")).args(FLAGS).arg("--output").arg(out).args(extra).output().unwrap()
}

fn ok(o: Output, what: &str) -> Output {
    assert!(o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
    o
}

fn os(s: impl Into<OsString>) -> OsString {
    s.into()
}

fn same_bytes(a: &Path, b: &Path) {
    let st = Command::new("cmp").arg(a).arg(b).status().unwrap();
    assert!(st.success(), "cmp {} {}", a.display(), b.display());
}

fn report(dir: &Path) -> Value {
    common::reports::without_wall_times(common::reports::read_json(dir))
}

#[test]
fn shards_devices_and_resume_give_the_one_process_kl_report_and_top_tokens() {
    let t = tempfile::tempdir().unwrap();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    // The reference: f32 KV.
    ok(eval(&p("ref"), &[os("--lossless"), os("--save-top-tokens"), os(p("ref.topk"))]), "reference");
    let kl = |top: &Path| vec![os("--kl-reference"), os(p("ref.topk")), os("--save-top-tokens"), os(top)];

    // One process.
    ok(eval(&p("one"), &kl(&p("one.topk"))), "one process");
    let one = report(&p("one"));
    let k = &one["results"]["kl_divergence"];
    assert!(k["mean"].as_f64().unwrap() > 0.0, "fp8 KV against f32 KV moves the distribution: {k}");
    assert!(k["quantiles"]["p99"].as_f64().unwrap() > 0.0 && k["worst_positions"].as_array().unwrap().len() == 50);
    assert!(k["worst_positions"][0]["text"].is_string(), "excerpts decoded");
    assert!(one["results"]["by_position"][0]["kl_divergence"]["mean"].as_f64().unwrap() > 0.0);
    assert!(one["results"]["streams"][0]["windows"][0].get("kl_detail").is_none(), "a whole run's report keeps no per-position detail");
    assert_eq!(one["results"]["overall"]["n_windows"], 10);

    // Three shards and a merge.
    for s in 0..3 {
        let mut a = kl(&p(&format!("shard{s}.topk")));
        a.extend([os("--shard"), os(format!("{s}/3"))]);
        ok(eval(&p(&format!("shard{s}")), &a), "shard");
        let r = common::reports::read_json(&p(&format!("shard{s}")));
        let windows: Vec<&Value> = r["results"]["streams"].as_array().unwrap().iter().flat_map(|s| s["windows"].as_array().unwrap()).collect();
        assert!(!windows.is_empty() && windows.iter().all(|w| w["kl_detail"]["positions"]["kl"].is_array()), "a shard keeps the detail merge needs");
    }
    let o = ok(
        bin().arg("merge").arg(p("merged")).args([p("shard2"), p("shard0"), p("shard1")]).arg("--save-top-tokens").arg(p("merged.topk")).output().unwrap(),
        "merge",
    );
    assert!(!o.stdout.is_empty());
    assert_eq!(report(&p("merged")), one, "merged shards");
    same_bytes(&p("merged.topk"), &p("one.topk"));

    // Two workers.
    let mut a = kl(&p("two.topk"));
    a.extend([os("--devices"), os("0,0")]);
    ok(eval(&p("two"), &a), "--devices 0,0");
    assert_eq!(report(&p("two")), one, "--devices 0,0");
    same_bytes(&p("two.topk"), &p("one.topk"));
    assert!(std::fs::read_dir(t.path()).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().contains(".worker")), "worker parts removed");

    // Resume: a complete run, then 6 of its 10 checkpoints deleted and the run resumed.
    let ck = p("ck");
    let resume = |out: &str, top: &str, extra: &[&str]| {
        let mut a = kl(&p(top));
        a.extend([os("--resume"), os(&ck)]);
        a.extend(extra.iter().map(os));
        ok(eval(&p(out), &a), out);
    };
    resume("r1", "r1.topk", &[]);
    let mut deleted = 0;
    for e in std::fs::read_dir(ck.join("windows")).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "json") && deleted < 6 {
            std::fs::remove_file(&path).unwrap();
            deleted += 1;
        }
    }
    assert_eq!(deleted, 6);
    // Resumed by two workers: each takes its windows' checkpoints and writes the rest.
    resume("r2", "r2.topk", &["--devices", "0,0"]);
    assert_eq!(std::fs::read_dir(ck.join("windows")).unwrap().filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "json")).count(), 10);
    assert_eq!(report(&p("r1")), one, "resume, all scored");
    assert_eq!(report(&p("r2")), one, "resumed from 4 checkpoints by two workers");
    same_bytes(&p("r2.topk"), &p("one.topk"));

    // A shard scored against another reference is refused, naming it; nothing written.
    let mut other = common::reports::read_json(&p("shard1"));
    other["results"]["kl_divergence"]["reference"]["sha256"] = Value::String("e".repeat(64));
    std::fs::create_dir(p("other1")).unwrap();
    std::fs::write(p("other1/report.json"), serde_json::to_vec(&other).unwrap()).unwrap();
    let o = bin().arg("merge").arg(p("bad")).args([p("shard0"), p("other1"), p("shard2")]).arg("--save-top-tokens").arg(p("bad.topk")).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("other1") && err.contains("scored against reference") && err.contains(&"e".repeat(64)), "{err}");
    assert!(!p("bad").exists() && !p("bad.topk").exists());
}
