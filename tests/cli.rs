//! The evaluator binary end to end: dry runs on the real models (token ids
//! equal llama.cpp's through the artifact's embedded tokenizer), bad input
//! (one-line error, exit code 2, nothing left behind) and bit-identical
//! reports across two identical CPU runs; the bundled corpus found with no
//! flag from any folder; the habits users bring (help, --version, a .gguf
//! MODEL, llama.cpp's flag spellings, the plan and progress on stderr).

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{data_root, model, models_dir, os, reference_dir, run};

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.ninfer";
const GEMMA3: &str = "gemma-3-270m-q4_k_m.ninfer";

/// llama.cpp's token-id hash for (model file, corpus path).
fn reference_hash(model_gguf: &str, corpus_path: &str) -> (usize, String) {
    let text = std::fs::read_to_string(reference_dir().join("llama-cpp-token-ids.txt")).unwrap();
    let line = text
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() == 4 && f[0] == model_gguf && f[1] == corpus_path)
        .unwrap_or_else(|| panic!("no reference line for {model_gguf} {corpus_path}"));
    (line[2].parse().unwrap(), line[3].to_string())
}

fn read_report(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap()
}

#[test]
fn dry_run_text_matches_llama_cpp_token_ids() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("r");
    let text = data_root().join("wikitext-2-raw/wiki.test.raw");
    let o = run(&[os(&model(SMOLLM2)), os("--text"), os(&text), os("--dry-run"), os("--output"), os(&dir)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(o.stdout.is_empty(), "a dry run prints no table");
    let r = read_report(&dir);
    assert_eq!(r["schema_version"], 4);
    assert_eq!(r["artifact"]["architecture"], "llama");
    assert_eq!(r["artifact"]["weight_formats"]["attn_q"]["Q4_1"], 30);
    assert_eq!(r["artifact"]["sources"][0]["sha256"], "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53");
    let s = &r["results"]["streams"][0];
    let (n, sha) = reference_hash("SmolLM2-135M-Instruct.Q4_1.gguf", "wikitext-2-raw/wiki.test.raw");
    assert_eq!(s["n_tokens"], n);
    assert_eq!(s["token_ids_sha256"], sha.as_str());
    assert_eq!(r["workload"]["method"], "sliding");
    assert_eq!(r["workload"]["context"], 4096);
}

#[test]
fn dry_run_corpus_quick_gemma3() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("r");
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("eval/corpora/ppl-v1/manifest.json");
    let o = run(&[
        os(&model(GEMMA3)),
        os("--corpus"),
        os(&manifest),
        os("--quick"),
        os("--data-root"),
        os(&data_root()),
        os("--dry-run"),
        os("--output"),
        os(&dir),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = read_report(&dir);
    let manifest_json: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    let streams = r["results"]["streams"].as_array().unwrap();
    let domains: std::collections::BTreeSet<&str> =
        manifest_json["streams"].as_array().unwrap().iter().map(|s| s["domain"].as_str().unwrap()).collect();
    assert_eq!(streams.len(), domains.len(), "--quick: one stream per domain");
    for s in streams {
        let spec = manifest_json["streams"].as_array().unwrap().iter().find(|m| m["id"] == s["name"]).unwrap();
        let (n, sha) = reference_hash("gemma-3-270m-q4_k_m.gguf", spec["path"].as_str().unwrap());
        assert_eq!(s["n_tokens"], n, "{}", s["name"]);
        assert_eq!(s["token_ids_sha256"], sha.as_str(), "{}", s["name"]);
    }
    assert_eq!(r["workload"]["bos"]["add_bos"], true);
    assert_eq!(r["workload"]["bos"]["bos_id"], 2);
    assert_eq!(r["workload"]["corpus"]["name"], "ppl-v1");
}

/// Runs with `args` expecting exit 2, exactly one stderr line containing each
/// of `expect`, and no report.
fn assert_rejected(args: &[&std::ffi::OsStr], out_dir: &Path, expect: &[&str]) {
    let mut all: Vec<&std::ffi::OsStr> = args.to_vec();
    all.extend([os("--log-level"), os("error"), os("--output"), os(out_dir)]);
    let o = run(&all);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "stderr: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line expected: {stderr}");
    for e in expect {
        assert!(stderr.contains(e), "expected {e:?} in {stderr}");
    }
    assert!(o.stdout.is_empty());
    assert!(!out_dir.join("report.json").exists());
}

#[test]
fn bad_input_is_one_line_exit_2_and_no_report() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model(SMOLLM2);
    let text = data_root().join("wikitext-2-raw/wiki.test.raw");
    let fresh = |n: &str| tmp.path().join(n);

    // Output folder not empty.
    let full = fresh("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("x"), b"x").unwrap();
    assert_rejected(&[os(&model), os("--text"), os(&text)], &full, &["--output", "not empty"]);

    let common = [os(&model), os("--text"), os(&text)];
    let with = |extra: &[&'static str]| -> Vec<&std::ffi::OsStr> {
        let mut v = common.to_vec();
        v.extend(extra.iter().map(|s| os(*s)));
        v
    };
    assert_rejected(&with(&["--context", "1024", "--stride", "1024"]), &fresh("a"), &["--context 1024", "--stride 1024"]);
    assert_rejected(&with(&["--stride", "0"]), &fresh("b"), &["--stride 0"]);
    assert_rejected(&with(&["--prefill-chunk", "100"]), &fresh("c"), &["--prefill-chunk", "100"]);
    assert_rejected(&with(&["--emulate-bf16-tc"]), &fresh("i"), &["--emulate-bf16-tc", "--backend cpu"]);
    assert_rejected(&with(&["--backend", "cpu", "--emulate-bf16-tc", "--lossless"]), &fresh("j"), &["--emulate-bf16-tc", "--lossless"]);
    // The numeric-route flags (issue 11).
    let route_cases: [(&str, &[&str], &[&str]); 12] = [
        ("k1", &["--kv-dtype", "fp4"], &["--kv-dtype fp4", "unknown KV format", "nvfp4"]),
        ("k2", &["--lossless", "--kv-dtype", "int8"], &["--kv-dtype int8 with --lossless", "--reference"]),
        ("k3", &["--fast-path", "int8-attn"], &["--fast-path int8-attn", "no such fast path (valid: delta-chunk-tf32, delta-chunk-3xtf32, attn-fp8-qk, attn-int8-qk, attn-f16, lm-head-fused)"]),
        ("k4", &["--use-original-int8-prefill-kernel"], &["--use-original-int8-prefill-kernel", "needs --kv-dtype int8"]),
        ("k6", &["--rope-yarn-factor", "4.5"], &["--rope-yarn-factor 4.5", "[1, 4]"]),
        ("k7", &["--rope-yarn-factor", "NaN"], &["--rope-yarn-factor NaN"]),
        ("k8", &["--backend", "cpu", "--reference", "--emulate-bf16-tc"], &["--emulate-bf16-tc with --reference"]),
        ("k9", &["--rope-yarn-factor", "0.9"], &["--rope-yarn-factor 0.9"]),
        // --kv-rotation forces the rotation of quantized rows only.
        ("r1", &["--kv-dtype", "bf16", "--kv-rotation", "on"], &["--kv-rotation on with --kv-dtype bf16", "never rotated"]),
        ("r2", &["--lossless", "--kv-rotation", "off"], &["--kv-rotation off with --kv-dtype f32", "never rotated"]),
        ("r3", &["--kv-rotation", "yes"], &["--kv-rotation yes", "unknown KV rotation", "auto, on, off"]),
        ("r4", &["--reference", "--kv-dtype", "bf16", "--kv-rotation", "on"], &["--kv-rotation on with --kv-dtype bf16"]),
    ];
    // The trained context (SmolLM2: 8192), raised only by --rope-yarn-factor.
    assert_rejected(&with(&["--context", "9000", "--stride", "1000"]), &fresh("t1"), &["--context 9000", "8192", "--rope-yarn-factor"]);
    let yarn_ok = fresh("t2");
    let o = run(&[&with(&["--context", "9000", "--stride", "1000", "--rope-yarn-factor", "1.5", "--dry-run"])[..], &[os("--output"), os(&yarn_ok)]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(read_report(&yarn_ok)["workload"]["context"], 9000);
    for (dir, extra, expect) in route_cases {
        assert_rejected(&with(extra), &fresh(dir), expect);
        assert!(!fresh(dir).exists(), "no folder left behind for {extra:?}");
    }
    for d in ["a", "b", "c", "i", "j"] {
        assert!(!fresh(d).exists(), "no folder left behind for a rejected run");
    }

    // An empty stream.
    let empty = fresh("empty.txt");
    std::fs::write(&empty, b"").unwrap();
    assert_rejected(&[os(&model), os("--text"), os(&empty)], &fresh("d"), &["empty.txt"]);

    // A stream shorter than two chunks in chunks mode.
    let short = fresh("short.txt");
    std::fs::write(&short, "The quick brown fox jumps over the lazy dog. ".repeat(20)).unwrap();
    assert_rejected(
        &[os(&model), os("--text"), os(&short), os("--method"), os("chunks"), os("--context"), os("512")],
        &fresh("e"),
        &["short.txt", "two chunks"],
    );

    // Not UTF-8.
    let bad = fresh("latin1.txt");
    std::fs::write(&bad, b"caf\xe9 au lait").unwrap();
    assert_rejected(&[os(&model), os("--text"), os(&bad)], &fresh("f"), &["latin1.txt", "UTF-8"]);

    // A manifest with a duplicate stream id.
    let manifest = fresh("manifest.json");
    let stream = serde_json::json!({"id": "a", "domain": "d", "path": "x.txt", "bytes": 1, "sha256": "0".repeat(64),
        "url": "https://example.org/x.txt", "license": "none", "source": "test"});
    let m = serde_json::json!({"name": "dup", "version": 1, "description": "", "streams": [stream, stream]});
    std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
    assert_rejected(&[os(&model), os("--corpus"), os(&manifest)], &fresh("g"), &["manifest.json", "duplicate", "\"a\""]);

    // Not an artifact.
    assert_rejected(&[os(&text), os("--text"), os(&text)], &fresh("h"), &["wiki.test.raw", "magic"]);
}

#[test]
fn two_identical_cpu_runs_give_bit_identical_results() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model(SMOLLM2);
    let text = data_root().join("wikitext-2-raw/wiki.test.raw");
    let mut results = Vec::new();
    // The second run names the lossless route's own KV format: recorded, and
    // nothing changes. The third emulates the CUDA bf16 route's roundings;
    // the fourth is the default (fp8 KV, f32 matmuls on the CPU).
    let runs: [(&str, &[&str], &str, &str); 4] = [
        ("one", &["--lossless"], "f32", "fp32"),
        ("two", &["--lossless", "--kv-dtype", "f32"], "f32", "fp32"),
        ("emulated", &["--kv-dtype", "bf16", "--emulate-bf16-tc"], "bf16", "bf16-tc-emulated"),
        ("default", &[], "fp8", "fp32"),
    ];
    for (name, extra, kv_dtype, route) in runs {
        let dir = tmp.path().join(name);
        let mut args = vec![
            os(&model), os("--text"), os(&text), os("--method"), os("chunks"), os("--context"), os("128"),
            os("--chunks"), os("3"), os("--backend"), os("cpu"), os("--output"), os(&dir),
        ];
        args.extend(extra.iter().map(os));
        let o = run(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let table = String::from_utf8(o.stdout).unwrap();
        assert!(table.lines().any(|l| l.starts_with("overall")), "{table}");
        let header = table.lines().next().unwrap();
        assert!(header.contains("+-(llama)") && header.contains("+-(windows)"), "{table}");
        let stderr = String::from_utf8_lossy(&o.stderr);
        // The plan before scoring; progress with the final counts when redirected; no hash at info.
        assert!(stderr.contains("plan: 1 streams, 3 windows (chunks), 384 tokens evaluated, 189 scored; estimated"), "{stderr}");
        assert!(stderr.contains("progress: 189/189 targets"), "{stderr}");
        assert!(!stderr.contains("sha256"), "hashes stay at debug level: {stderr}");
        let mut r = read_report(&dir);
        let e = &r["execution"];
        assert_eq!(e["kv_format"], serde_json::json!(kv_dtype));
        assert!(e.get("kv_dtype").is_none(), "one KV field (kv_format): {e}");
        assert_eq!(e["route"], route);
        assert_eq!(e["lossless"], extra.first() == Some(&"--lossless"));
        assert_eq!(e["matmul_inputs"], if name == "emulated" { "bf16" } else { "f32" });
        assert_eq!((e["reference"].as_bool(), e["reproducible"].as_bool()), (Some(false), Some(false)));
        assert_eq!(e["rope_yarn_factor"], 1.0);
        assert_eq!(e["fast_paths"], serde_json::json!([]));
        assert_eq!(e["prefill_chunk_tokens"], serde_json::json!({"requested": 1024, "effective": 1024}));
        assert_eq!(e["original_int8_prefill_kernel"], false);
        let windows = r["results"]["streams"][0]["windows"].as_array_mut().unwrap();
        assert_eq!(windows.len(), 3);
        for w in windows.iter_mut() {
            assert_eq!(w["scored"], 63);
            w.as_object_mut().unwrap().remove("seconds");
        }
        results.push(r["results"].clone());
    }
    assert_eq!(results[0], results[1]);
    // bf16 rounding moves every window a little, never much.
    assert_ne!(results[0], results[2]);
    let ppl_emulated = results[2]["overall"]["perplexity"].as_f64().unwrap();
    let ppl = results[0]["overall"]["perplexity"].as_f64().unwrap();
    assert!((ppl_emulated / ppl - 1.0).abs() < 0.01, "ppl {ppl} emulated {ppl_emulated}");
    // fp8 KV changes the scores, by little.
    assert_ne!(results[0], results[3]);
    let ppl_fp8 = results[3]["overall"]["perplexity"].as_f64().unwrap();
    assert!((ppl_fp8 / ppl - 1.0).abs() < 0.05, "ppl {ppl} fp8 KV {ppl_fp8}");
    assert!(ppl.is_finite() && ppl > 1.0 && ppl < 1000.0, "ppl {ppl}");
}

/// Issue 11: `--kv-rotation auto|on|off` reaches the codec and the scores, and
/// report.json records it (`execution.kv_rotation`, the codec names in
/// `details`); `auto` is the format table's choice.
#[test]
fn kv_rotation_changes_the_codec_and_the_scores() {
    use infernix_perplexity::kv::KvFormat;
    let tmp = tempfile::tempdir().unwrap();
    let model = model(SMOLLM2);
    let text = data_root().join("wikitext-2-raw/wiki.test.raw");
    for (format, f) in [("int8", KvFormat::Int8), ("fp8", KvFormat::Fp8)] {
        let mut results = std::collections::BTreeMap::new();
        for rotation in ["auto", "on", "off"] {
            let dir = tmp.path().join(format!("{format}-{rotation}"));
            let o = run(&[
                os(&model), os("--text"), os(&text), os("--method"), os("chunks"), os("--context"), os("128"),
                os("--chunks"), os("2"), os("--backend"), os("cpu"), os("--kv-dtype"), os(format),
                os("--kv-rotation"), os(rotation), os("--output"), os(&dir),
            ]);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let mut r = read_report(&dir);
            let e = &r["execution"];
            assert_eq!(e["kv_format"], format);
            assert_eq!(e["kv_rotation"], rotation);
            let rotated = match rotation {
                "on" => (true, true),
                "off" => (false, false),
                _ => (f.k().rotate, f.v().rotate),
            };
            let name = |rot: bool, elem: &str| if rot { format!("{elem}+hadamard") } else { elem.to_string() };
            let elem = if format == "fp8" { "fp8-e4m3" } else { "int8" };
            assert_eq!(e["details"]["kv_k_codec"], name(rotated.0, elem), "{format} {rotation}");
            assert_eq!(e["details"]["kv_v_codec"], name(rotated.1, elem), "{format} {rotation}");
            for w in r["results"]["streams"][0]["windows"].as_array_mut().unwrap() {
                w.as_object_mut().unwrap().remove("seconds");
            }
            results.insert(rotation, r["results"].clone());
        }
        assert_ne!(results["on"], results["off"], "{format}: the rotation changes the scores");
        let table = if f.k().rotate { "on" } else { "off" };
        assert_eq!(results["auto"], results[table], "{format}: auto is the table's rotation ({table})");
    }
}

/// Issue 17: with no input flag the corpus compiled into the binary is scored,
/// from any folder, whatever INFERNIX_DATA says.
#[test]
fn bundled_corpus_without_a_flag_from_another_folder() {
    let elsewhere = tempfile::tempdir().unwrap();
    let model = std::fs::canonicalize(model(SMOLLM2)).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
        .current_dir(elsewhere.path())
        .env("INFERNIX_DATA", elsewhere.path().join("no-such-folder"))
        .args([os(&model), os("--quick"), os("--dry-run"), os("--output"), os("r")])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = read_report(&elsewhere.path().join("r"));
    assert_eq!(r["workload"]["corpus"]["manifest"], "bundled:ppl-v1");
    assert_eq!(r["workload"]["corpus"]["quick"], true);
    let streams = r["results"]["streams"].as_array().unwrap();
    let paths = [
        "wikitext-2-raw/wiki.test.raw",
        "pg19/frankenstein_pg84.txt",
        "zh/rulin_waishi_pg24032.txt",
        "code/cutlass/basic_gemm.cu",
        "multilingual/de_die_verwandlung_pg22367.txt",
    ];
    assert_eq!(streams.len(), paths.len());
    for (s, path) in streams.iter().zip(paths) {
        let (n, sha) = reference_hash("SmolLM2-135M-Instruct.Q4_1.gguf", path);
        assert_eq!((s["n_tokens"].as_u64().unwrap() as usize, s["token_ids_sha256"].as_str().unwrap()), (n, sha.as_str()), "{path}");
    }
}

#[test]
fn gguf_model_says_convert_it_first() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let want = format!("convert it first with `ninfer-convert {} --out {}`", gguf.display(), gguf.with_extension("ninfer").display());
    assert_rejected(&[os(&gguf), os("--quick")], &tmp.path().join("r"), &[&want]);
}

#[test]
fn help_and_version_describe_their_own_program() {
    let convert = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_ninfer-convert")).args(args).output().unwrap();
    let text = |o: Output| {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let help = text(run(&[os("help")]));
    assert!(help.contains("perplexity and KL-divergence evaluator") && help.contains("Usage: infernix-perplexity"), "{help}");
    for alias in ["--ctx-size", "--file", "--ppl-stride", "--kl-divergence-base", "--kl-divergence"] {
        assert!(help.contains(alias), "help names llama.cpp's {alias}: {help}");
    }
    assert_eq!(help, text(run(&[os("--help")])));
    let compare = text(run(&[os("help"), os("compare")]));
    assert!(compare.contains("Compares two report.json files") && compare.contains("Usage: infernix-perplexity compare"), "{compare}");
    let convert_help = text(convert(&["--help"]));
    assert!(convert_help.contains("Usage: ninfer-convert") && convert_help.contains("into a .ninfer v3 artifact"), "{convert_help}");
    let v = text(run(&[os("--version")]));
    assert!(v.starts_with(&format!("infernix-perplexity {} (git ", env!("CARGO_PKG_VERSION"))), "{v}");
    let v = text(convert(&["--version"]));
    assert!(v.starts_with(&format!("ninfer-convert {} (git ", env!("CARGO_PKG_VERSION"))), "{v}");
    for t in [&help, &compare, &convert_help] {
        assert!(!t.to_lowercase().contains("issue"), "help names an internal issue: {t}");
    }
}
