//! `infernix-perplexity compare` end to end on report.json files built from
//! the writer's typed structs (no model): verdicts and exit codes for
//! identical reports, small noise, a uniform 1 % and 5 % shift, mismatched
//! windows, the floor and KL gates, and the output files. Tests at the end
//! run the real evaluator on SmolLM2 (`--noise-floor` and a self-compare;
//! KL against a recorded reference, through the binary's own fields) and
//! read the committed version-3 reports of tests/data/report-v3.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use infernix_perplexity::report::{self, KlReferenceInfo, KlReport};
use infernix_perplexity::score::floor::noise_floor;
use infernix_perplexity::score::kl::KlSummary;
use infernix_perplexity::score::paired::PairedWindow;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use common::os;

fn compare(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
        .arg("compare")
        .args(args)
        .output()
        .expect("run infernix-perplexity compare")
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exit code")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Domains and streams of the constructed reports: 3 domains, 4 streams,
/// 12 chunks-method windows each (255 scored targets of 512 tokens).
const STREAMS: [(&str, &str); 4] = [("wiki", "en"), ("book", "en"), ("zh-1", "zh"), ("code-1", "code")];
const N_WINDOWS: usize = 12;
const SCORED: usize = 255;

/// A typed schema-4 report (the writer's own structs) whose window
/// `(stream s, window i)` has mean NLL `base_mean(s, i) + shift(s, i)`
/// (a spread of window difficulty like real text: 2.0 .. 3.6 nats), as JSON
/// for the tests to edit.
fn report(shift: impl Fn(usize, usize) -> f64) -> Value {
    let mean = |s: usize, i: usize| 2.0 + 0.4 * s as f64 + 0.1 * ((i * 7 + s * 3) % 11) as f64 + shift(s, i);
    serde_json::to_value(common::reports::constructed(&STREAMS, N_WINDOWS, SCORED, mean)).unwrap()
}

/// Writes `value` as `dir/name/report.json` and returns the folder.
fn write(dir: &Path, name: &str, value: &Value) -> PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("report.json"), serde_json::to_vec_pretty(value).unwrap()).unwrap();
    d
}

/// Runs compare on BASE / NEW folders (with extra flags) and returns the
/// output and the `--json` verdict.
fn gate(base: &Value, new: &Value, extra: &[&str]) -> (Output, Option<Value>) {
    let t = tempfile::tempdir().unwrap();
    let (b, n) = (write(t.path(), "base", base), write(t.path(), "new", new));
    let json_path = t.path().join("verdict.json");
    let mut args: Vec<&std::ffi::OsStr> = vec![os(&b), os(&n), os("--json"), os(&json_path)];
    args.extend(extra.iter().map(os));
    let o = compare(&args);
    let v = std::fs::read(&json_path).ok().map(|bytes| serde_json::from_slice(&bytes).unwrap());
    (o, v)
}

fn check<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["checks"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no check {name}: {v:#}"))
}

#[test]
fn identical_reports_pass() {
    let base = report(|_, _| 0.0);
    let (o, v) = gate(&base, &base, &[]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    let v = v.unwrap();
    assert_eq!(v["verdict"], "PASS");
    assert_eq!(v["overall"]["identical"], true);
    assert_eq!(v["overall"]["n_windows"], 4 * N_WINDOWS);
    assert_eq!(v["overall"]["ppl_change_pct"], 0.0);
    assert_eq!(check(&v, "identical")["status"], "PASS");
    assert!(stdout(&o).contains("verdict: PASS (exit 0)"), "{}", stdout(&o));
    assert!(stdout(&o).contains("no window moved"));
}

#[test]
fn small_zero_mean_noise_passes() {
    // "+0.1 % uniform noise": every window's mean NLL moves by u ~ U(-0.001, +0.001)
    // nats (about +-0.1 % of its PPL), zero mean, seeded.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(6);
    let noise: Vec<f64> = (0..4 * N_WINDOWS).map(|_| rng.gen_range(-0.001..0.001)).collect();
    let (base, new) = (report(|_, _| 0.0), report(|s, i| noise[s * N_WINDOWS + i]));
    let (o, v) = gate(&base, &new, &[]);
    let v = v.unwrap();
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    assert_eq!(v["verdict"], "PASS");
    let ov = &v["overall"];
    assert!(ov["ppl_change_pct"].as_f64().unwrap().abs() < 0.05, "{ov:#}");
    assert!(ov["p_t"].as_f64().unwrap() > 0.05, "{ov:#}");
    let [lo, hi] = [ov["ppl_change_ci95_pct"][0].as_f64().unwrap(), ov["ppl_change_ci95_pct"][1].as_f64().unwrap()];
    assert!(lo < 0.0 && hi > 0.0, "the interval covers 0: [{lo}, {hi}]");
    // Mean diff = Σ d / Σ n with equal windows = mean of the noise.
    let expected = noise.iter().sum::<f64>() / noise.len() as f64;
    assert!((ov["mean_diff"].as_f64().unwrap() - expected).abs() < 1e-12);
    // Every window moved: the list holds --top 10 rows, largest |dNLL| first.
    let top = v["top_windows"].as_array().unwrap();
    assert_eq!(top.len(), 10);
    let d: Vec<f64> = top.iter().map(|w| w["dnll"].as_f64().unwrap().abs()).collect();
    assert!(d.windows(2).all(|p| p[0] >= p[1]), "{d:?}");
    let max_noise = noise.iter().fold(0.0f64, |m, x| m.max(x.abs())) * SCORED as f64;
    assert!((d[0] - max_noise).abs() < 1e-9, "{} vs {max_noise}", d[0]);
}

#[test]
fn one_percent_on_every_window_warns() {
    // ln(1.01) nats per token on every window, plus +-0.0002 of noise.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let noise: Vec<f64> = (0..4 * N_WINDOWS).map(|_| rng.gen_range(-0.0002..0.0002)).collect();
    let new = report(|s, i| 1.01f64.ln() + noise[s * N_WINDOWS + i]);
    let (o, v) = gate(&report(|_, _| 0.0), &new, &[]);
    let v = v.unwrap();
    assert_eq!(code(&o), 3, "{}", stdout(&o));
    assert_eq!(v["verdict"], "WARN");
    let change = v["overall"]["ppl_change_pct"].as_f64().unwrap();
    assert!((change - 1.0).abs() < 0.01, "{change}");
    assert_eq!(check(&v, "significance")["status"], "WARN");
    assert_eq!(check(&v, "max_delta")["status"], "WARN");
    assert_eq!(check(&v, "fail_delta")["status"], "PASS");
    assert!(v["overall"]["p_t"].as_f64().unwrap() < 1e-10);
    // Sign test: all 48 windows worse -> 2 / 2^48.
    assert_eq!(v["overall"]["n_worse"], 48);
    assert!((v["overall"]["p_sign"].as_f64().unwrap() - 2.0 / 2f64.powi(48)).abs() < 1e-20);
    // Every domain is shifted alike.
    for d in v["domains"].as_array().unwrap() {
        assert!((d["ppl_change_pct"].as_f64().unwrap() - 1.0).abs() < 0.02, "{d:#}");
    }
    assert_eq!(v["domains"].as_array().unwrap().len(), 3);
    // A looser limit turns the size check green, but significance still warns.
    let (o, _) = gate(&report(|_, _| 0.0), &new, &["--max-delta-pct", "1.5"]);
    assert_eq!(code(&o), 3);
}

#[test]
fn five_percent_fails() {
    let (o, v) = gate(&report(|_, _| 0.0), &report(|_, _| 1.05f64.ln()), &[]);
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    let v = v.unwrap();
    assert_eq!(v["verdict"], "FAIL");
    assert_eq!(check(&v, "fail_delta")["status"], "FAIL");
    assert!((v["overall"]["ppl_change_pct"].as_f64().unwrap() - 5.0).abs() < 1e-9);
    assert!(stdout(&o).contains("verdict: FAIL (exit 1)"));
    // An improvement of 5 % fails as well: it is as suspicious as a regression.
    let (o, _) = gate(&report(|_, _| 0.0), &report(|_, _| -(1.05f64.ln())), &[]);
    assert_eq!(code(&o), 1);
    // --fail-delta-pct moves the line.
    let (o, _) = gate(&report(|_, _| 0.0), &report(|_, _| 1.05f64.ln()), &["--fail-delta-pct", "6"]);
    assert_eq!(code(&o), 3);
}

#[test]
fn mismatched_windows_exit_2() {
    let base = report(|_, _| 0.0);
    let mutate = |f: &dyn Fn(&mut Value)| {
        let mut v = base.clone();
        f(&mut v);
        v
    };
    let cases: Vec<(Value, &str)> = vec![
        (mutate(&|v| v["results"]["streams"][1]["windows"][3]["scored"] = json!(254)), "stream 'book' window 3 has scored 255 in BASE and 254 in NEW"),
        (mutate(&|v| v["results"]["streams"][2]["name"] = json!("zh-2")), "stream 2 is 'zh-1' in BASE and 'zh-2' in NEW"),
        (mutate(&|v| { v["results"]["streams"][0]["windows"].as_array_mut().unwrap().pop(); }), "stream 'wiki' has 12 windows in BASE and 11 in NEW"),
        (mutate(&|v| v["results"]["streams"][3]["windows"][0]["tokens_sha256"] = json!("ff")), "stream 'code-1' window 0 has tokens_sha256"),
        (mutate(&|v| v["results"]["streams"][0]["windows"][5]["first_target"] = json!(2600)), "first_target 2816 in BASE and 2600 in NEW"),
        (mutate(&|v| v["results"]["streams"][0]["token_ids_sha256"] = json!("00")), "stream 'wiki' has token ids sha256"),
        (mutate(&|v| { v["results"]["streams"].as_array_mut().unwrap().pop(); }), "BASE has 4 streams, NEW has 3"),
    ];
    for (new, expected) in cases {
        let (o, v) = gate(&base, &new, &[]);
        let err = stderr(&o);
        assert_eq!(code(&o), 2, "{expected}: {err}");
        assert!(err.contains(expected), "expected '{expected}' in: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert!(o.stdout.is_empty() && v.is_none(), "no table, no verdict file on error");
    }
    // Every window carries its fingerprint: one without is not a report of the schema.
    let no_fp = mutate(&|v| {
        v["results"]["streams"][0]["windows"][0].as_object_mut().unwrap().remove("tokens_sha256");
    });
    let (o, _) = gate(&base, &no_fp, &[]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("NEW") && stderr(&o).contains("missing field `tokens_sha256`"), "{}", stderr(&o));
}

#[test]
fn bad_input_exit_2() {
    let t = tempfile::tempdir().unwrap();
    let b = write(t.path(), "base", &report(|_, _| 0.0));
    let missing = t.path().join("nope");
    let o = compare(&[os(&b), os(&missing)]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("NEW") && stderr(&o).contains("nope"), "{}", stderr(&o));
    // A dry-run report (no windows).
    let mut dry = report(|_, _| 0.0);
    for s in dry["results"]["streams"].as_array_mut().unwrap() {
        s["windows"] = json!([]);
    }
    let d = write(t.path(), "dry", &dry);
    let o = compare(&[os(&b), os(&d)]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("no scored windows"), "{}", stderr(&o));
    // Invalid flags.
    let o = compare(&[os(&b), os(&b), os("--alpha"), os("1.5")]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("--alpha"), "{}", stderr(&o));
    let o = compare(&[os(&b)]);
    assert_eq!(code(&o), 2, "clap usage error");
    // Another schema version.
    let mut v2 = report(|_, _| 0.0);
    v2["schema_version"] = json!(2);
    let o = compare(&[os(&b), os(&write(t.path(), "v2", &v2))]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("schema_version 2"), "{}", stderr(&o));
}

#[test]
fn files_and_report_paths() {
    let t = tempfile::tempdir().unwrap();
    let b = write(t.path(), "base", &report(|_, _| 0.0));
    let n = write(t.path(), "new", &report(|s, i| if s == 1 && i == 4 { 0.01 } else { 0.0 }));
    let (md, js) = (t.path().join("gate.md"), t.path().join("gate.json"));
    // BASE as a file, NEW as a folder.
    let o = compare(&[os(&b.join("report.json")), os(&n), os("--markdown"), os(&md), os("--json"), os(&js), os("--top"), os("3")]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    let md = std::fs::read_to_string(&md).unwrap();
    assert!(md.starts_with("## Quality gate: **PASS**"), "{md}");
    assert!(md.contains("| overall |") && md.contains("| en |") && md.contains("| significance | overall |"), "{md}");
    let v: Value = serde_json::from_slice(&std::fs::read(&js).unwrap()).unwrap();
    assert_eq!((v["schema"].as_str(), v["exit_code"].as_u64()), (Some("infernix-compare"), Some(0)));
    // One window moved: it tops the list with its stream, index, range and dNLL.
    let top = v["top_windows"].as_array().unwrap();
    assert_eq!(top.len(), 1);
    assert_eq!((top[0]["stream"].as_str(), top[0]["index"].as_u64()), (Some("book"), Some(4)));
    assert!((top[0]["dnll"].as_f64().unwrap() - 0.01 * SCORED as f64).abs() < 1e-9);
    assert!(stdout(&o).contains("tokens [2304, 2560)"), "{}", stdout(&o));
    // Every statistic is in the verdict, per domain and per stream too.
    for key in ["mean_diff", "mean_diff_se", "t", "p_t", "df", "mean_diff_ci95", "ppl_change_ci95_pct", "p_sign", "n_worse"] {
        assert!(v["overall"].get(key).is_some(), "overall lacks {key}");
        assert!(v["domains"][0].get(key).is_some(), "domain lacks {key}");
    }
    assert_eq!(v["streams"].as_array().unwrap().len(), 4);
    assert_eq!(v["domains"][0]["domain"], "en");
}

#[test]
fn noise_floor_gate() {
    let mut base = report(|_, _| 0.0);
    // Per-token shifts cycling +0.0004, -0.0004, +0.0003, -0.0002: mean +0.000025 nats
    // (+0.0025 %), not significant (t about 0.5).
    let new = report(|s, i| [0.0004, -0.0004, 0.0003, -0.0002][(s * N_WINDOWS + i) % 4]);
    // Without a recorded floor the gate cannot run: an error, not a guess.
    let (o, _) = gate(&base, &new, &["--max-delta-over-floor", "2"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("records no noise_floor"), "{}", stderr(&o));
    // A recorded floor of 0.0005 %: the evaluator's own block, with its figure set.
    let rows: Vec<(String, PairedWindow)> =
        (0..4).map(|i| ("en".to_string(), PairedWindow { n_scored: 10, base_nll_sum: 20.0, new_nll_sum: 20.0 + 1e-6 * i as f64 })).collect();
    let mut floor = noise_floor(&rows, 0, 1024, 512, 4096, 1.0);
    floor.floor_pct = 0.0005;
    base["noise_floor"] = serde_json::to_value(&floor).unwrap();
    let (o, v) = gate(&base, &new, &["--max-delta-over-floor", "2"]);
    let v = v.unwrap();
    assert_eq!(code(&o), 3, "{}", stdout(&o));
    assert_eq!(check(&v, "noise_floor")["status"], "WARN");
    assert_eq!(v["noise_floor"]["limit_pct"], 0.001);
    assert!((v["overall"]["ppl_change_pct"].as_f64().unwrap() - 0.0025).abs() < 1e-6);
    let (o, _) = gate(&base, &new, &["--max-delta-over-floor", "20"]);
    assert_eq!(code(&o), 0, "{}", stdout(&o));
}

#[test]
fn kl_gates_read_new_and_fail_closed() {
    let mut base = report(|_, _| 0.0);
    let mut new = report(|_, _| 0.0);
    base["results"]["kl_divergence"] = kl_block(1e-4, 0.999, 0, "ref-a");
    new["results"]["kl_divergence"] = kl_block(5e-3, 0.97, 12, "ref-a");
    // PPL identical, KL breached -> FAIL.
    let (o, v) = gate(&base, &new, &["--max-mean-kl", "1e-3"]);
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    assert_eq!(check(&v.unwrap(), "max_mean_kl")["status"], "FAIL");
    let (o, _) = gate(&base, &new, &["--min-top1", "0.99"]);
    assert_eq!(code(&o), 1);
    let (o, _) = gate(&base, &new, &["--max-flips", "20", "--min-top1", "0.95", "--max-mean-kl", "0.01"]);
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    // Another reference: NEW's own block is gated (its reference is the one it names), with a note.
    new["results"]["kl_divergence"]["reference"]["sha256"] = json!("ref-b");
    let (o, v) = gate(&base, &new, &["--max-mean-kl", "1e-3"]);
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    assert_eq!(check(&v.unwrap(), "max_mean_kl")["status"], "FAIL");
    assert!(stdout(&o).contains("KL references differ"), "{}", stdout(&o));
    // The documented recipe: BASE without a block, NEW scored against BASE's --save-top-tokens file.
    let plain = report(|_, _| 0.0);
    let (o, _) = gate(&plain, &new, &["--max-mean-kl", "1e-3"]);
    assert_eq!(code(&o), 1, "a breached gate against NEW's own reference must fail: {}", stdout(&o));
    let (o, _) = gate(&plain, &new, &["--max-mean-kl", "0.01", "--min-top1", "0.95", "--max-flips", "20"]);
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    // A gate that cannot be evaluated fails: NEW without a block, or without the gated field.
    let (o, v) = gate(&base, &plain, &["--max-flips", "20"]);
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    assert_eq!(check(&v.unwrap(), "kl")["status"], "FAIL");
    // A block without a gated field is not a report of the schema: an error naming it.
    new["results"]["kl_divergence"].as_object_mut().unwrap().remove("n_confident_flips");
    let (o, _) = gate(&plain, &new, &["--max-flips", "20"]);
    assert_eq!(code(&o), 2, "{}", stdout(&o));
    assert!(stderr(&o).contains("n_confident_flips"), "{}", stderr(&o));
}

/// A `results.kl_divergence` block (typed) with the gated figures.
fn kl_block(mean: f64, top1: f64, flips: usize, reference: &str) -> Value {
    let summary = KlSummary {
        positions: 1000,
        n_nonfinite: 0,
        mean,
        sd: Some(mean),
        mean_se: Some(mean / 10.0),
        mean_se_clustered: Some(mean / 5.0),
        quantiles: None,
        mean_reference_top_mass: 0.9,
        top1_agreement: top1,
        top1_agreement_se: Some(0.001),
        n_confident_flips: flips,
        mean_nll: 2.0,
        mean_nll_reference: 2.0,
        mean_nll_se: Some(0.01),
        mean_nll_reference_se: Some(0.01),
        mean_nll_delta: 0.0,
        mean_nll_delta_se: Some(0.001),
        mean_nll_delta_se_clustered: Some(0.001),
        delta_p_mean: 0.0,
        delta_p_rms: 0.01,
        delta_p_rms_se: Some(0.001),
        by_context: None,
    };
    serde_json::to_value(KlReport {
        reference: KlReferenceInfo { path: "ref.top".into(), sha256: reference.into(), producer: json!({}), top_k: 64 },
        bound: KlReport::BOUND.into(),
        summary,
        worst_positions: Vec::new(),
        worst_windows: Vec::new(),
        histogram: None,
    })
    .unwrap()
}

#[test]
fn compare_fails_closed_on_impossible_or_unpairable_data() {
    let base = report(|_, _| 0.0);
    // Every window non-finite in BASE: nothing pairs -> error, not PASS.
    let mut all_bad = base.clone();
    for s in all_bad["results"]["streams"].as_array_mut().unwrap() {
        for w in s["windows"].as_array_mut().unwrap() {
            w["n_nonfinite"] = json!(1);
        }
    }
    let (o, _) = gate(&all_bad, &base, &[]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("no window is finite in both reports"), "{}", stderr(&o));
    // Overflowing NLL sums: non-finite statistics -> FAIL.
    let huge = |_: usize, _: usize| 1e305;
    let (o, v) = gate(&report(huge), &report(|_, _| 6e305), &[]);
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    assert_eq!(check(&v.unwrap(), "finite")["status"], "FAIL");
    // Impossible values: exit 2 naming the report, the window and the field.
    for (field, value, want) in [
        ("nll_sum", json!(-1.0), "nll_sum -1 is impossible"),
        ("scored", json!(100_000), "scored 100000 is more than"),
        ("first_target", json!(10_000_000), "first_target 10000000 is outside"),
        ("n_nonfinite", json!(1000), "n_nonfinite 1000 is more than scored"),
    ] {
        let mut bad = base.clone();
        bad["results"]["streams"][1]["windows"][3][field] = value;
        let (o, _) = gate(&base, &bad, &[]);
        assert_eq!(code(&o), 2, "{field}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains(want) && e.contains("NEW") && e.contains("window 3"), "{field}: {e}");
    }
}

#[test]
fn nonfinite_scores_fail() {
    let base = report(|_, _| 0.0);
    let mut new = base.clone();
    new["results"]["streams"][0]["windows"][2]["n_nonfinite"] = json!(3);
    let (o, v) = gate(&base, &new, &[]);
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    let v = v.unwrap();
    assert_eq!(check(&v, "nonfinite")["status"], "FAIL");
    assert_eq!(v["overall"]["n_windows"], 4 * N_WINDOWS - 1, "the window is left out of the statistics");
}

#[test]
fn help_documents_exit_codes() {
    let o = compare(&[os("--help")]);
    assert_eq!(code(&o), 0);
    let h = stdout(&o);
    for s in ["0  PASS", "3  WARN", "1  FAIL", "2  error", "--max-delta-over-floor", "--max-mean-kl", "Usage: infernix-perplexity compare"] {
        assert!(h.contains(s), "compare --help lacks '{s}':\n{h}");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity")).arg("--help").output().unwrap();
    let h = stdout(&o);
    assert!(h.contains("infernix-perplexity compare BASE NEW") && h.contains("--noise-floor"), "{h}");
}

/// The real evaluator: SmolLM2 on the CPU, 2 chunks of 512 of wiki.test.raw,
/// with --noise-floor. Windows carry 64-hex fingerprints, the floor is
/// recorded, and the report compared with itself passes with excerpts.
#[test]
fn real_noise_floor_and_self_compare() {
    let model = common::models_dir().join("SmolLM2-135M-Instruct.Q4_1.ninfer");
    assert!(model.exists(), "{} missing: run scripts/fetch-models.sh", model.display());
    let text = common::data_root().join("wikitext-2-raw/wiki.test.raw");
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("r");
    let o = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
        .args([os(&model), os("--text"), os(&text), os("--method"), os("chunks"), os("--context"), os("512")])
        .args([os("--chunks"), os("2"), os("--backend"), os("cpu"), os("--lossless"), os("--noise-floor"), os("--output"), os(&out)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let r: Value = serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    let w = &r["results"]["streams"][0]["windows"];
    assert_eq!(w.as_array().unwrap().len(), 2);
    for win in w.as_array().unwrap() {
        let fp = win["tokens_sha256"].as_str().unwrap();
        assert!(fp.len() == 64 && fp.bytes().all(|b| b.is_ascii_hexdigit()), "{fp}");
    }
    assert_ne!(w[0]["tokens_sha256"], w[1]["tokens_sha256"]);
    let f = &r["noise_floor"];
    assert_eq!(f["perturbation"], "prefill_chunk");
    // Chunks of 512: the alternate prefill chunk halves them (256), the reported 1024 runs one pass.
    assert_eq!((f["prefill_chunk_tokens"].as_u64(), f["alternate_prefill_chunk_tokens"].as_u64()), (Some(1024), Some(256)));
    assert_eq!(f["overall"]["n_windows"], 2);
    let floor = f["floor_pct"].as_f64().unwrap();
    assert!((0.0..0.01).contains(&floor), "a prefill split moves PPL by rounding only: {floor} %");
    assert_eq!(f["bit_identical"].as_bool().unwrap(), floor == 0.0);
    assert_eq!(r["workload"]["input_path"], text.display().to_string());

    // The report against itself: PASS, the floor gate passes at any factor, excerpts decode.
    let o = compare(&[os(&out), os(&out), os("--max-delta-over-floor"), os("1"), os("--model"), os(&model)]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("all 2 windows bit-identical"), "{}", stdout(&o));

    // Move window 1 by half a nat: it is listed, with its text decoded through the
    // artifact's tokenizer from the recorded --text file.
    let mut moved = r.clone();
    moved["results"]["streams"][0]["windows"][1]["nll_sum"] = json!(w[1]["nll_sum"].as_f64().unwrap() + 0.5);
    let m = t.path().join("moved");
    std::fs::create_dir_all(&m).unwrap();
    std::fs::write(m.join("report.json"), serde_json::to_vec(&moved).unwrap()).unwrap();
    let js = t.path().join("v.json");
    let o = compare(&[os(&out), os(&m), os("--model"), os(&model), os("--json"), os(&js)]);
    assert_eq!(code(&o), 0, "half a nat over 510 targets is 0.1 %: {}{}", stdout(&o), stderr(&o));
    let v: Value = serde_json::from_slice(&std::fs::read(&js).unwrap()).unwrap();
    let top = &v["top_windows"][0];
    assert_eq!((top["index"].as_u64(), top["dnll"].as_f64()), (Some(1), Some(0.5)));
    let excerpt = top["excerpt"].as_str().expect("an excerpt");
    let plain = excerpt.trim_end_matches("...").replace("\\n", "\n");
    assert!(plain.chars().count() >= 50, "{excerpt}");
    let corpus = std::fs::read_to_string(&text).unwrap();
    assert!(corpus.contains(plain.trim()), "the excerpt is text of the corpus: {excerpt}");
    assert!(stdout(&o).contains(&excerpt.chars().take(20).collect::<String>()), "{}", stdout(&o));
}

/// Runs the evaluator on SmolLM2 on the CPU over 3 chunks of 128 tokens of
/// tests/data/report-v3/wiki-head.txt, with `extra` flags, into `out`.
fn score_tiny(out: &Path, extra: &[&std::ffi::OsStr]) {
    let model = common::models_dir().join("SmolLM2-135M-Instruct.Q4_1.ninfer");
    assert!(model.exists(), "{} missing: run scripts/fetch-models.sh", model.display());
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/report-v3/wiki-head.txt");
    let o = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
        .args([os(&model), os("--text"), os(&text), os("--method"), os("chunks"), os("--context"), os("128")])
        .args([os("--chunks"), os("3"), os("--backend"), os("cpu"), os("--output"), os(out)])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Real reports with `kl_divergence` written by the binary: base lossless
/// with --save-top-tokens, new with fp8 KV against it. `compare` reads the
/// KL figures through the typed schema (the verdict carries the report's own
/// values), a breached gate fails, and the written field names are the
/// documented ones (docs/report.md), so renaming one fails here.
#[test]
fn real_kl_reports_compare_through_the_schema() {
    let t = tempfile::tempdir().unwrap();
    let (base, new, top) = (t.path().join("base"), t.path().join("new"), t.path().join("base.top"));
    score_tiny(&base, &[os("--lossless"), os("--save-top-tokens"), os(&top)]);
    score_tiny(&new, &[os("--kv-dtype"), os("fp8"), os("--kl-reference"), os(&top)]);
    let r = report::read_report(&new, "NEW").unwrap();
    let kl = r.results.kl_divergence.as_ref().expect("the KL block");
    assert!(kl.summary.mean > 0.0 && kl.summary.mean < 0.1, "fp8 KV moves KL a little: {}", kl.summary.mean);
    let raw: Value = serde_json::from_slice(&std::fs::read(new.join("report.json")).unwrap()).unwrap();
    for pointer in [
        "/schema_version",
        "/execution/kv_format",
        "/results/overall/mean_nll_se_clustered",
        "/results/kl_divergence/reference/sha256",
        "/results/kl_divergence/mean",
        "/results/kl_divergence/mean_se",
        "/results/kl_divergence/top1_agreement",
        "/results/kl_divergence/n_confident_flips",
        "/results/kl_divergence/quantiles/p99.9",
        "/results/streams/0/n_tokens",
        "/results/streams/0/input_tokens",
        "/results/streams/0/windows/0/nll_sq_sum",
        "/results/streams/0/windows/0/input_tokens",
        "/results/streams/0/windows/0/kl_divergence/sums/kl_sq",
        "/results/streams/0/windows/0/kl_divergence/bucket_sums/0/sums/delta_p_4",
    ] {
        assert!(raw.pointer(pointer).is_some(), "report.json lacks the documented field {pointer}");
    }
    assert!(raw.pointer("/execution/kv_dtype").is_none(), "one KV field: kv_format");
    assert_eq!(raw["schema_version"], 4);

    let js = t.path().join("v.json");
    let o = compare(&[os(&base), os(&new), os("--json"), os(&js), os("--max-mean-kl"), os("1"), os("--min-top1"), os("0.5")]);
    assert!(matches!(code(&o), 0 | 3), "{}{}", stdout(&o), stderr(&o));
    let v: Value = serde_json::from_slice(&std::fs::read(&js).unwrap()).unwrap();
    let got = &v["kl_divergence"]["new"];
    assert_eq!(got["mean"].as_f64(), Some(kl.summary.mean));
    assert_eq!(got["uncertainty"].as_f64(), kl.summary.mean_se);
    assert_eq!(got["top1_agreement"].as_f64(), Some(kl.summary.top1_agreement));
    assert_eq!(got["confident_flips"].as_u64(), Some(kl.summary.n_confident_flips as u64));
    assert_eq!(got["reference"].as_str(), Some(kl.reference.sha256.as_str()));
    assert_eq!(check(&v, "max_mean_kl")["status"], "PASS");
    let o = compare(&[os(&base), os(&new), os("--max-mean-kl"), os("1e-9")]);
    assert_eq!(code(&o), 1, "a breached KL gate fails: {}", stdout(&o));
}

/// The committed version-3 reports (written by the binary before schema 4;
/// tests/data/report-v3/README.md) still compare, KL gates included.
#[test]
fn version_3_reports_still_compare() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/report-v3");
    let (base, new) = (dir.join("base.json"), dir.join("new.json"));
    let raw: Value = serde_json::from_slice(&std::fs::read(&new).unwrap()).unwrap();
    assert_eq!(raw["schema_version"], 3);
    let t = tempfile::tempdir().unwrap();
    let js = t.path().join("v.json");
    let o = compare(&[os(&base), os(&new), os("--json"), os(&js), os("--max-mean-kl"), os("1")]);
    assert!(matches!(code(&o), 0 | 3), "{}{}", stdout(&o), stderr(&o));
    let v: Value = serde_json::from_slice(&std::fs::read(&js).unwrap()).unwrap();
    assert_eq!(v["overall"]["n_windows"], 3);
    assert_eq!(v["kl_divergence"]["new"]["mean"], raw["results"]["kl_divergence"]["mean"]);
    assert_eq!(v["kl_divergence"]["new"]["reference"], raw["results"]["kl_divergence"]["reference"]["sha256"]);
    assert_eq!(v["new"]["kv_dtype"], "fp8");
    let o = compare(&[os(&base), os(&new), os("--max-mean-kl"), os("1e-9")]);
    assert_eq!(code(&o), 1, "{}", stdout(&o));
}
