//! Issue 16: the bad-input table. Every case runs a real binary
//! (`infernix-perplexity`, `infernix-perplexity compare`, `ninfer-convert`)
//! in a scratch folder (also its working folder, so a default
//! `profiles/perplexity/` would show) and asserts: the exit code, exactly one
//! stderr line that names the file or flag and the field, no panic text, and
//! the scratch folder, the model and `/dev/full` unchanged (nothing written,
//! nothing left behind, no input replaced).
//!
//! Classes (the numbers): 1 outputs against inputs, 2 special files,
//! 3 corrupted counts, 4 compare fails closed, 5 a claimed output folder,
//! 6 the metadata digest, 8 nothing left on failure, 10 input size,
//! 11 hyperparameters, 12 --threads; plus flags and damaged inputs.
//! Signals (9) have their own test at the end.

mod common;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

#[path = "common/tiny_artifact.rs"]
mod tiny;

use infernix_perplexity::convert::gguf::{GgufValue, GgufWriter};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.ninfer";

#[derive(Clone, Copy, Debug)]
enum Prog {
    Eval,
    Compare,
    Merge,
    Convert,
}

struct Case {
    name: &'static str,
    prog: Prog,
    args: Vec<OsString>,
    code: i32,
    /// Substrings of the one stderr line (file or flag, field).
    want: Vec<String>,
}

/// What a folder holds: per path, its kind, length, mtime and (small files) SHA-256.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let ft = m.file_type();
            let mut desc = format!("{:?} {} {} {}", ft, m.len(), m.mtime(), m.mtime_nsec());
            if ft.is_dir() {
                stack.push(p.clone());
            } else if ft.is_file() && m.len() <= 1 << 22 {
                desc.push_str(&format!(" {:x}", Sha256::digest(std::fs::read(&p).unwrap())));
            }
            out.insert(p, desc);
        }
    }
    out
}

fn file_state(p: &Path) -> String {
    let m = std::fs::symlink_metadata(p).unwrap();
    format!("{:?} {} {} {}", m.file_type(), m.len(), m.mtime(), m.ino())
}

fn exe(prog: Prog) -> Command {
    match prog {
        Prog::Eval => Command::new(env!("CARGO_BIN_EXE_infernix-perplexity")),
        Prog::Compare => {
            let mut c = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"));
            c.arg("compare");
            c
        }
        Prog::Merge => {
            let mut c = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"));
            c.arg("merge");
            c
        }
        Prog::Convert => Command::new(env!("CARGO_BIN_EXE_ninfer-convert")),
    }
}

fn run_case(dir: &Path, watched: &[PathBuf], c: &Case) {
    let before = snapshot(dir);
    let watched_before: Vec<String> = watched.iter().map(|p| file_state(p)).collect();
    let mut cmd = exe(c.prog);
    cmd.args(&c.args).current_dir(dir).env("RUST_BACKTRACE", "1").stdin(Stdio::null());
    if matches!(c.prog, Prog::Eval) {
        cmd.args(["--log-level", "warn"]);
    }
    let o: Output = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    let ctx = format!("case {}: {:?}\nstderr: {stderr}", c.name, c.args);
    assert_eq!(o.status.code(), Some(c.code), "exit code, {ctx}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one stderr line, {ctx}");
    for bad in ["panicked", "RUST_BACKTRACE", "stack backtrace", "memory allocation"] {
        assert!(!stderr.contains(bad), "panic text, {ctx}");
    }
    assert!(stderr.contains("error:"), "{ctx}");
    for w in &c.want {
        assert!(stderr.contains(w.as_str()), "want {w:?}, {ctx}");
    }
    let after = snapshot(dir);
    let changed: Vec<(&PathBuf, Option<&String>, Option<&String>)> = before
        .keys()
        .chain(after.keys())
        .filter(|k| before.get(*k) != after.get(*k))
        .map(|k| (k, before.get(k), after.get(k)))
        .collect();
    assert!(changed.is_empty(), "the scratch folder changed: {changed:?}, {ctx}");
    let watched_after: Vec<String> = watched.iter().map(|p| file_state(p)).collect();
    assert_eq!(watched_before, watched_after, "a watched file changed, {ctx}");
}

fn os(p: impl AsRef<std::ffi::OsStr>) -> OsString {
    p.as_ref().to_os_string()
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// The tiny artifact at `dir/name`, its metadata JSON changed by `edit`;
/// `redigest` keeps the header's digest in step (else the digest check trips).
fn tiny_artifact(dir: &Path, name: &str, redigest: bool, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let path = dir.join(name);
    tiny::write_tiny(&path);
    tiny::patch_json(&path, redigest, edit);
    path
}

/// The tiny artifact as version 3 (no digest, JSON at 32).
fn tiny_v3(dir: &Path) -> PathBuf {
    let p = tiny_artifact(dir, "v3.ninfer", true, |_| {});
    tiny::to_v3(&p);
    p
}

/// A tiny GGUF (llama, an embedding and a norm) with `patch` applied to its bytes.
fn tiny_gguf(dir: &Path, name: &str, patch: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let emb = vec![1u8; 34 * 4];
    let norm = vec![0u8; 128];
    let w = GgufWriter {
        metadata: vec![
            ("general.architecture".into(), GgufValue::String("llama".into())),
            ("tokenizer.ggml.tokens".into(), GgufValue::Array(vec![GgufValue::String("a".into()), GgufValue::String("b".into())])),
        ],
        tensors: vec![("token_embd.weight".into(), vec![32, 4], 8, &emb), ("output_norm.weight".into(), vec![32], 0, &norm)],
    };
    let mut b = w.to_bytes();
    patch(&mut b);
    let p = dir.join(name);
    std::fs::write(&p, b).unwrap();
    p
}

/// Byte position just after the first occurrence of `needle`.
fn after(b: &[u8], needle: &[u8]) -> usize {
    b.windows(needle.len()).position(|w| w == needle).unwrap() + needle.len()
}

/// A typed schema-4 report of one stream of 6 windows (`common::reports`), as JSON to edit.
fn report(edit: impl FnOnce(&mut Value)) -> Value {
    let r = common::reports::constructed(&[("s", "d")], 6, 255, |_, i| (600.0 + i as f64) / 255.0);
    let mut v = serde_json::to_value(r).unwrap();
    edit(&mut v);
    v
}

fn write_json(dir: &Path, name: &str, v: &Value) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_vec(v).unwrap()).unwrap();
    p
}

/// A one-stream corpus in `dir/corpus` whose manifest is edited by `edit`.
fn corpus(dir: &Path, name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let root = dir.join("corpus");
    std::fs::create_dir_all(&root).unwrap();
    let text = b"Hello world. This is a small stream of text.\n";
    std::fs::write(root.join("s.txt"), text).unwrap();
    let mut m = json!({"name": "t", "version": 1, "description": "test",
        "streams": [{"id": "s", "domain": "d", "path": "s.txt", "bytes": text.len(),
                     "sha256": format!("{:x}", Sha256::digest(text)), "url": "u", "license": "l", "source": "s"}]});
    edit(&mut m);
    write_json(&root, name, &m)
}

fn sparse(p: &Path, n: u64) -> PathBuf {
    let f = std::fs::File::create(p).unwrap();
    f.set_len(n).unwrap();
    p.to_path_buf()
}

#[test]
fn bad_input_table() {
    let model = common::models_dir().join(SMOLLM2);
    assert!(model.exists(), "{} missing: run scripts/fetch-models.sh", model.display());
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().canonicalize().unwrap();
    let d = d.as_path();
    let text = d.join("text.txt");
    std::fs::write(&text, "Hello world, a short text to score.\n").unwrap();
    let link = d.join("text-link.txt");
    std::os::unix::fs::symlink(&text, &link).unwrap();
    let hard = d.join("text-hard.txt");
    std::fs::hard_link(&text, &hard).unwrap();
    let tokens = write_json(d, "tokens.json", &json!([1, 2, 3, 4, 5]));
    let fifo = d.join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let sub = d.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let full = d.join("full-out");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("report.json"), "{}").unwrap();
    let locked = d.join("locked-out");
    std::fs::create_dir(&locked).unwrap();
    std::fs::write(locked.join(".infernix-perplexity.lock"), "").unwrap();
    let garbage = d.join("garbage.bin");
    std::fs::write(&garbage, b"not a top-tokens file at all, just some bytes").unwrap();
    let short_topk = d.join("short.topk");
    std::fs::write(&short_topk, b"INFXTOPK\x01\x00").unwrap();
    let big_text = sparse(&d.join("nul-50mb.txt"), 50 << 20);
    let over_limit = d.join("over-limit.txt");
    std::fs::write(&over_limit, vec![b'a'; (8 << 20) + 1]).unwrap();
    let latin1 = d.join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9\n").unwrap();
    let good_manifest = corpus(d, "good.json", |_| {});
    let stream_file = d.join("corpus/s.txt");
    let m_json = corpus(d, "broken.json", |_| {});
    std::fs::write(&m_json, b"{ not json").unwrap();
    let m_version = corpus(d, "version.json", |m| m["version"] = json!(2));
    let m_dotdot = corpus(d, "dotdot.json", |m| m["streams"][0]["path"] = json!("../text.txt"));
    let m_sha = corpus(d, "sha.json", |m| m["streams"][0]["sha256"] = json!("0".repeat(64)));
    let m_bytes = corpus(d, "bytes.json", |m| m["streams"][0]["bytes"] = json!(3));
    let m_huge = corpus(d, "huge.json", |m| m["streams"][0]["bytes"] = json!(1u64 << 40));
    let m_missing = corpus(d, "missing.json", |m| m["streams"][0]["path"] = json!("nope.txt"));
    let m_dup = corpus(d, "dup.json", |m| {
        let s = m["streams"][0].clone();
        m["streams"].as_array_mut().unwrap().push(s);
    });
    let tok_bad = |name: &str, body: &str| {
        let p = d.join(name);
        std::fs::write(&p, body).unwrap();
        p
    };
    let t_json = tok_bad("t-json.json", "[1, 2,");
    let t_empty = tok_bad("t-empty.json", "[]");
    let t_vocab = tok_bad("t-vocab.json", "[1, 2, 4000000000]");
    let t_neg = tok_bad("t-neg.json", "[1, -2]");
    let t_obj = tok_bad("t-obj.json", "{\"ids\": [1]}");
    // Artifacts.
    let a_text = tok_bad("not-model.ninfer", "plain text, not an artifact, long enough to hold a whole header");
    let a_short = tok_bad("short.ninfer", "NINFER\0\0\x04");
    let a_v9 = tiny_artifact(d, "v9.ninfer", true, |_| {});
    {
        let mut b = std::fs::read(&a_v9).unwrap();
        b[8..12].copy_from_slice(&9u32.to_le_bytes());
        std::fs::write(&a_v9, b).unwrap();
    }
    let a_meta_len = tiny_artifact(d, "meta-len.ninfer", true, |_| {});
    {
        let mut b = std::fs::read(&a_meta_len).unwrap();
        b[16..24].copy_from_slice(&(1u64 << 50).to_le_bytes());
        std::fs::write(&a_meta_len, b).unwrap();
    }
    let a_edited = tiny_artifact(d, "edited.ninfer", false, |v| v["hparams"]["rope_base"] = json!(10001.0));
    let a_eps = tiny_artifact(d, "eps.ninfer", true, |v| v["hparams"]["rms_eps"] = json!(-1.0));
    let a_rope = tiny_artifact(d, "rope.ninfer", true, |v| v["hparams"]["rope_base"] = json!(0.0));
    let a_ropedim = tiny_artifact(d, "ropedim.ninfer", true, |v| v["hparams"]["rope_dim"] = json!(0));
    let a_scale = tiny_artifact(d, "scale.ninfer", true, |v| v["hparams"]["attn_scale"] = json!(1e9));
    let a_vocab = tiny_artifact(d, "vocab.ninfer", true, |v| v["hparams"]["n_vocab"] = json!(5));
    let a_window = tiny_artifact(d, "window.ninfer", true, |v| v["hparams"]["sliding_window"] = json!([0]));
    let a_layers = tiny_artifact(d, "layers.ninfer", true, |v| {
        v["hparams"]["n_layers"] = json!(2);
        v["hparams"]["sliding_window"] = json!([null, null]);
    });
    let a_dmodel = tiny_artifact(d, "dmodel.ninfer", true, |v| v["hparams"]["d_model"] = json!(64));
    let a_heads = tiny_artifact(d, "heads.ninfer", true, |v| v["hparams"]["n_kv_heads"] = json!(3));
    let a_v3 = tiny_v3(d);
    // Reports.
    let base = write_json(d, "base.json", &report(|_| {}));
    let r_nonfinite = write_json(d, "nonfinite.json", &report(|v| {
        for w in v["results"]["streams"][0]["windows"].as_array_mut().unwrap() {
            w["n_nonfinite"] = json!(1);
        }
    }));
    let r_neg = write_json(d, "neg.json", &report(|v| v["results"]["streams"][0]["windows"][2]["nll_sum"] = json!(-3.0)));
    let r_scored = write_json(d, "scored.json", &report(|v| v["results"]["streams"][0]["windows"][1]["scored"] = json!(9999)));
    let r_schema = write_json(d, "schema.json", &report(|v| v["schema_version"] = json!(99)));
    let r_dry = write_json(d, "dry.json", &report(|v| v["results"]["streams"][0]["windows"] = json!([])));
    let r_text = tok_bad("r-text.json", "this is not json");
    let r_other = write_json(d, "other.json", &report(|v| v["results"]["streams"][0]["name"] = json!("t")));
    // Shard reports: shard k of 2 holds the windows of even / odd index.
    let shard = |k: usize, edit: &dyn Fn(&mut Value)| {
        report(|v| {
            v["workload"]["shard"] = json!({"index": k, "count": 2, "n_windows": [6]});
            v["results"]["streams"][0]["windows"].as_array_mut().unwrap().retain(|w| w["index"].as_u64().unwrap() as usize % 2 == k);
            edit(v);
        })
    };
    let sh0 = write_json(d, "shard0.json", &shard(0, &|_| {}));
    let sh1 = write_json(d, "shard1.json", &shard(1, &|_| {}));
    let sh1_other = write_json(d, "shard1-other-model.json", &shard(1, &|v| v["artifact"]["digest"] = json!("f".repeat(64))));
    let sh1_kv = write_json(d, "shard1-bf16.json", &shard(1, &|v| v["execution"]["kv_format"] = json!("bf16")));
    let sh1_plan = write_json(d, "shard1-ctx.json", &shard(1, &|v| v["workload"]["context"] = json!(1024)));
    let sh1_overlap = write_json(d, "shard1-overlap.json", &shard(1, &|v| v["results"]["streams"][0]["windows"][0]["index"] = json!(2)));
    let sh1_bytes = serde_json::to_vec(&shard(1, &|_| {})).unwrap();
    let sh1_cut = d.join("shard1-truncated.json");
    std::fs::write(&sh1_cut, &sh1_bytes[..sh1_bytes.len() / 2]).unwrap();
    // GGUF sources.
    let g_good = tiny_gguf(d, "good.gguf", |_| {});
    let g_kv = tiny_gguf(d, "kv.gguf", |b| b[16..24].copy_from_slice(&4_000_000_000u64.to_le_bytes()));
    let g_tensors = tiny_gguf(d, "tensors.gguf", |b| b[8..16].copy_from_slice(&4_000_000_000u64.to_le_bytes()));
    let g_array = tiny_gguf(d, "array.gguf", |b| {
        // tokenizer.ggml.tokens: key, then type u32 (9), item type u32 (8), then the length u64.
        let at = after(b, b"tokenizer.ggml.tokens") + 8;
        b[at..at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    });
    let g_string = tiny_gguf(d, "string.gguf", |b| {
        // general.architecture's value: type u32 (8), then the string length u64.
        let at = after(b, b"general.architecture") + 4;
        b[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    });
    let g_magic = tiny_gguf(d, "magic.gguf", |b| b[0..4].copy_from_slice(b"GGML"));
    let g_ndims = tiny_gguf(d, "ndims.gguf", |b| {
        let at = after(b, b"token_embd.weight");
        b[at..at + 4].copy_from_slice(&9u32.to_le_bytes());
    });
    let dev_full = PathBuf::from("/dev/full");

    let e = |name, args: Vec<OsString>, want: Vec<String>| Case { name, prog: Prog::Eval, args, code: 2, want };
    let c = |name, args: Vec<OsString>, want: Vec<String>| Case { name, prog: Prog::Compare, args, code: 2, want };
    let g = |name, args: Vec<OsString>, want: Vec<String>| Case { name, prog: Prog::Merge, args, code: 2, want };
    let v = |name, args: Vec<OsString>, want: Vec<String>| Case { name, prog: Prog::Convert, args, code: 2, want };
    let w = |xs: &[&str]| xs.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let m = || os(&model);
    let out = || vec![os("--output"), os(d.join("new-out"))];
    let with = |mut a: Vec<OsString>, b: Vec<OsString>| {
        a.extend(b);
        a
    };
    let text_run = |extra: Vec<OsString>| with(with(vec![m(), os("--text"), os(&text)], out()), extra);
    let cases = vec![
        // 1: outputs against inputs, by any spelling.
        e("save-tokens over the model", text_run(vec![os("--save-tokens"), m()]), w(&["--save-tokens", "is the MODEL"])),
        e("save-top-tokens over the model", text_run(vec![os("--save-top-tokens"), m()]), w(&["--save-top-tokens", "is the MODEL"])),
        e("save-tokens over --text", text_run(vec![os("--save-tokens"), os(&text)]), vec!["is the --text".into(), s(&text)]),
        e("save-tokens over ./text", text_run(vec![os("--save-tokens"), os(d.join("sub/../text.txt"))]), w(&["is the --text"])),
        e("save-tokens over a hard link", text_run(vec![os("--save-tokens"), os(&hard)]), w(&["--save-tokens", "is the --text"])),
        e("save-tokens over a symlink", text_run(vec![os("--save-tokens"), os(&link)]), w(&["--save-tokens", "symbolic link"])),
        e("save-top-tokens over the manifest", with(with(vec![m(), os("--corpus"), os(&good_manifest)], out()), vec![os("--save-top-tokens"), os(&good_manifest)]), w(&["--save-top-tokens", "is the --corpus"])),
        e("save-tokens over a corpus stream", with(with(vec![m(), os("--corpus"), os(&good_manifest)], out()), vec![os("--save-tokens"), os(&stream_file)]), w(&["--save-tokens", "is the corpus stream s"])),
        e("save-tokens over --kl-reference", text_run(vec![os("--kl-reference"), os(&garbage), os("--save-tokens"), os(&garbage)]), w(&["--save-tokens", "is the --kl-reference"])),
        e("save-tokens over --tokens", with(with(vec![m(), os("--tokens"), os(&tokens)], out()), vec![os("--save-tokens"), os(&tokens)]), w(&["--save-tokens", "is the --tokens"])),
        e("two outputs, one file", text_run(vec![os("--save-tokens"), os(d.join("x.json")), os("--save-top-tokens"), os(d.join("sub/../x.json"))]), w(&["--save-top-tokens", "is also the --save-tokens"])),
        // 2: special files and folders.
        e("save-top-tokens /dev/full", text_run(vec![os("--save-top-tokens"), os(&dev_full)]), w(&["--save-top-tokens /dev/full", "character device"])),
        e("save-tokens /dev/null", text_run(vec![os("--save-tokens"), os("/dev/null")]), w(&["--save-tokens /dev/null", "character device"])),
        e("save-tokens a FIFO", text_run(vec![os("--save-tokens"), os(&fifo)]), w(&["--save-tokens", "a FIFO"])),
        e("save-tokens a folder", text_run(vec![os("--save-tokens"), os(&sub)]), w(&["--save-tokens", "a folder"])),
        e("save-tokens in a missing folder", text_run(vec![os("--save-tokens"), os(d.join("no/x.json"))]), w(&["--save-tokens", "does not exist"])),
        e("output is a file", vec![m(), os("--text"), os(&text), os("--output"), os(&text)], w(&["--output", "not a folder"])),
        // 5 and 8: a claimed or used folder.
        e("output not empty", vec![m(), os("--text"), os(&text), os("--output"), os(&full)], w(&["--output", "not empty"])),
        e("output claimed by another run", vec![m(), os("--text"), os(&text), os("--output"), os(&locked)], w(&["--output", "another run"])),
        // 8: default output folder never left behind (no --output), damaged inputs.
        e("missing --text, default folder", vec![m(), os("--text"), os(d.join("nope.txt"))], w(&["--text", "nope.txt"])),
        e("tokens not JSON", with(vec![m(), os("--tokens"), os(&t_json)], out()), vec!["token file".into(), s(&t_json)]),
        e("tokens empty", with(vec![m(), os("--tokens"), os(&t_empty)], out()), w(&["t-empty.json", "empty"])),
        e("tokens out of vocabulary", with(vec![m(), os("--tokens"), os(&t_vocab)], out()), w(&["t-vocab.json", "token id 4000000000 is outside the vocabulary"])),
        e("tokens negative", with(vec![m(), os("--tokens"), os(&t_neg)], out()), w(&["t-neg.json", "u32"])),
        e("tokens object", with(vec![m(), os("--tokens"), os(&t_obj)], out()), w(&["t-obj.json", "array"])),
        e("text not UTF-8", with(vec![m(), os("--text"), os(&latin1)], out()), w(&["latin1.txt", "UTF-8"])),
        e("kl-reference not top-tokens, save-tokens not left", text_run(vec![os("--kl-reference"), os(&garbage), os("--save-tokens"), os(d.join("saved.json"))]), w(&["--kl-reference", "garbage.bin", "not a top-tokens file"])),
        e("kl-reference truncated", text_run(vec![os("--kl-reference"), os(&short_topk)]), w(&["--kl-reference", "short.topk", "preamble"])),
        // 10: input size.
        e("50 MB of NUL bytes", with(vec![m(), os("--text"), os(&big_text)], out()), w(&["--text", "nul-50mb.txt", "larger than the limit"])),
        e("text one byte over the limit", with(vec![m(), os("--text"), os(&over_limit)], out()), w(&["--text", "over-limit.txt", "8388608"])),
        e("manifest stream over the limit", with(vec![m(), os("--corpus"), os(&m_huge)], out()), w(&["stream s", "field `bytes`", "larger than the limit"])),
        // Manifests.
        e("manifest not JSON", with(vec![m(), os("--corpus"), os(&m_json)], out()), w(&["corpus manifest", "broken.json", "invalid manifest"])),
        e("manifest version", with(vec![m(), os("--corpus"), os(&m_version)], out()), w(&["version.json", "version is 2"])),
        e("manifest path with ..", with(vec![m(), os("--corpus"), os(&m_dotdot)], out()), w(&["dotdot.json", "field `path`"])),
        e("manifest sha256 mismatch", with(vec![m(), os("--corpus"), os(&m_sha)], out()), w(&["stream s", "s.txt", "SHA-256"])),
        e("manifest bytes mismatch", with(vec![m(), os("--corpus"), os(&m_bytes)], out()), w(&["stream s", "s.txt", "bytes"])),
        e("manifest stream missing", with(vec![m(), os("--corpus"), os(&m_missing)], out()), w(&["stream s", "nope.txt"])),
        e("manifest duplicate id", with(vec![m(), os("--corpus"), os(&m_dup)], out()), w(&["dup.json", "duplicate stream id"])),
        // 12 and flags.
        e("threads 100000", text_run(vec![os("--threads"), os("100000")]), w(&["--threads 100000", "at most --threads"])),
        e("threads 0", text_run(vec![os("--threads"), os("0")]), w(&["--threads 0"])),
        e("context not above stride", text_run(vec![os("--context"), os("2048"), os("--stride"), os("2048")]), w(&["--context 2048", "--stride 2048"])),
        e("chunks 0", text_run(vec![os("--chunks"), os("0")]), w(&["--chunks 0"])),
        e("prefill chunk 100", text_run(vec![os("--prefill-chunk"), os("100")]), w(&["--prefill-chunk"])),
        e("batch tokens 0", text_run(vec![os("--batch-tokens"), os("0")]), w(&["--batch-tokens 0"])),
        // Issue 15: --plots, --verify-invariance, --target-uncertainty, compare --plots.
        e("verify-invariance 0", text_run(vec![os("--verify-invariance"), os("0")]), w(&["--verify-invariance 0"])),
        e("target-uncertainty 0", text_run(vec![os("--target-uncertainty"), os("0")]), w(&["--target-uncertainty 0", "positive"])),
        e("target-uncertainty NaN", text_run(vec![os("--target-uncertainty"), os("NaN")]), w(&["--target-uncertainty NaN"])),
        e("target-uncertainty inf", text_run(vec![os("--target-uncertainty"), os("inf")]), w(&["--target-uncertainty inf"])),
        e("target-uncertainty -0.1", text_run(vec![os("--target-uncertainty=-0.1")]), w(&["--target-uncertainty -0.1"])),
        // Early stop on mean KL is allowed (issue 15 item 6); a bad reference is still named.
        e("target-uncertainty with a bad --kl-reference", text_run(vec![os("--target-uncertainty"), os("0.1"), os("--kl-reference"), os(&garbage)]), w(&["--kl-reference", "garbage.bin", "not a top-tokens file"])),
        e("target-uncertainty with --chunks", text_run(vec![os("--target-uncertainty"), os("0.1"), os("--chunks"), os("2")]), w(&["--target-uncertainty", "--chunks"])),
        e("target-uncertainty with --noise-floor", text_run(vec![os("--target-uncertainty"), os("0.1"), os("--noise-floor")]), w(&["--target-uncertainty", "--noise-floor"])),
        e("plots with --dry-run", text_run(vec![os("--plots"), os("--dry-run")]), w(&["--plots", "--dry-run"])),
        e("verify-invariance with --dry-run", text_run(vec![os("--verify-invariance"), os("2"), os("--dry-run")]), w(&["--verify-invariance", "--dry-run"])),
        // 6 and 11: artifacts.
        e("model missing", vec![os(d.join("nope.ninfer")), os("--text"), os(&text), os("--output"), os(d.join("o"))], w(&["nope.ninfer", "open"])),
        e("model is text", with(vec![os(&a_text), os("--text"), os(&text)], out()), w(&["not-model.ninfer", "magic"])),
        e("model header short", with(vec![os(&a_short), os("--text"), os(&text)], out()), w(&["short.ninfer", "header"])),
        e("model version 9", with(vec![os(&a_v9), os("--text"), os(&text)], out()), w(&["v9.ninfer", "version 9", "reconvert with ninfer-convert"])),
        e("model metadata_bytes huge", with(vec![os(&a_meta_len), os("--text"), os(&text)], out()), w(&["meta-len.ninfer", "metadata_bytes"])),
        e("model metadata edited", with(vec![os(&a_edited), os("--text"), os(&text)], out()), w(&["edited.ninfer", "metadata_sha256"])),
        e("model rms_eps -1", with(vec![os(&a_eps), os("--text"), os(&text)], out()), w(&["eps.ninfer", "hparams.rms_eps", "-1"])),
        e("model rope_base 0", with(vec![os(&a_rope), os("--text"), os(&text)], out()), w(&["rope.ninfer", "hparams.rope_base"])),
        e("model rope_dim 0", with(vec![os(&a_ropedim), os("--text"), os(&text)], out()), w(&["ropedim.ninfer", "hparams.rope_dim"])),
        e("model attn_scale 1e9", with(vec![os(&a_scale), os("--text"), os(&text)], out()), w(&["scale.ninfer", "hparams.attn_scale"])),
        e("model n_vocab wrong", with(vec![os(&a_vocab), os("--text"), os(&text)], out()), w(&["vocab.ninfer", "token_embd.weight has shape [4, 32]"])),
        e("model sliding_window 0", with(vec![os(&a_window), os("--text"), os(&text)], out()), w(&["window.ninfer", "hparams.sliding_window[0]"])),
        e("model n_layers wrong", with(vec![os(&a_layers), os("--text"), os(&text)], out()), w(&["layers.ninfer", "blk.1.attn_norm.weight is missing"])),
        e("model d_model wrong", with(vec![os(&a_dmodel), os("--text"), os(&text)], out()), w(&["dmodel.ninfer", "has shape"])),
        e("model n_kv_heads", with(vec![os(&a_heads), os("--text"), os(&text)], out()), w(&["heads.ninfer", "hparams.n_kv_heads"])),
        e("v3 model --verify", with(vec![os(&a_v3), os("--text"), os(&text), os("--verify")], out()), w(&["v3.ninfer", "version 3", "reconvert with ninfer-convert"])),
        // 4: compare fails closed, and its outputs.
        c("BASE all non-finite", vec![os(&r_nonfinite), os(&base)], w(&["no window is finite in both reports"])),
        c("NEW negative NLL", vec![os(&base), os(&r_neg)], w(&["NEW", "neg.json", "window 2", "nll_sum -3 is impossible"])),
        c("NEW scored above tokens", vec![os(&base), os(&r_scored)], w(&["NEW", "scored.json", "scored 9999"])),
        c("BASE schema", vec![os(&r_schema), os(&base)], w(&["BASE", "schema.json", "schema_version 99"])),
        c("BASE dry run", vec![os(&r_dry), os(&base)], w(&["BASE", "dry.json", "no scored windows"])),
        c("BASE not JSON", vec![os(&r_text), os(&base)], w(&["BASE", "r-text.json", "not JSON"])),
        c("BASE missing", vec![os(d.join("nope.json")), os(&base)], w(&["BASE", "nope.json", "open"])),
        c("streams differ", vec![os(&base), os(&r_other)], w(&["the reports differ", "stream 0"])),
        c("--json over BASE", vec![os(&base), os(&base), os("--json"), os(&base)], w(&["--json", "is the BASE"])),
        c("--markdown /dev/full", vec![os(&base), os(&base), os("--markdown"), os(&dev_full)], w(&["--markdown /dev/full", "character device"])),
        c("--alpha 2", vec![os(&base), os(&base), os("--alpha"), os("2")], w(&["--alpha 2"])),
        c("--plots a file", vec![os(&base), os(&base), os("--plots"), os(&base)], w(&["--plots", "not a folder"])),
        c("--min-top1 NaN", vec![os(&base), os(&base), os("--min-top1"), os("NaN")], w(&["--min-top1"])),
        // Issue 14: --shard and merge.
        e("--shard 0/0", with(vec![m(), os("--text"), os(&text), os("--shard"), os("0/0")], out()), w(&["--shard 0/0", "at least 1"])),
        e("--shard 3/2", with(vec![m(), os("--text"), os(&text), os("--shard"), os("3/2")], out()), w(&["--shard 3/2", "below N"])),
        e("--shard a/b", with(vec![m(), os("--text"), os(&text), os("--shard"), os("a/b")], out()), w(&["--shard a/b", "K/N"])),
        e("--shard with --noise-floor", with(vec![m(), os("--text"), os(&text), os("--shard"), os("0/2"), os("--noise-floor")], out()), w(&["--shard with --noise-floor", "not supported yet"])),
        e("--resume with --noise-floor", with(vec![m(), os("--text"), os(&text), os("--resume"), os(d.join("ck")), os("--noise-floor")], out()), w(&["--resume with --noise-floor", "not supported yet"])),
        e("--devices 1 on the CPU", with(vec![m(), os("--text"), os(&text), os("--backend"), os("cpu"), os("--devices"), os("0,1")], out()), w(&["--devices 0,1", "device 0 only"])),
        e("--devices a", with(vec![m(), os("--text"), os(&text), os("--devices"), os("0,a")], out()), w(&["--devices 0,a", "device indices"])),
        g("merge two artifacts", vec![os(d.join("merged")), os(&sh0), os(&sh1_other)], w(&["shard1-other-model.json", "another artifact", "artifact.digest"])),
        g("merge two KV formats", vec![os(d.join("merged")), os(&sh0), os(&sh1_kv)], w(&["shard1-bf16.json", "another route", "execution.kv_format"])),
        g("merge two plans", vec![os(d.join("merged")), os(&sh0), os(&sh1_plan)], w(&["shard1-ctx.json", "another plan", "workload.context"])),
        g("merge a truncated shard", vec![os(d.join("merged")), os(&sh0), os(&sh1_cut)], w(&["SHARD_DIR", "shard1-truncated.json", "EOF"])),
        g("merge a missing shard", vec![os(d.join("merged")), os(&sh0)], w(&["shard 1/2 is missing"])),
        g("merge a shard twice", vec![os(d.join("merged")), os(&sh0), os(&sh1), os(&sh1)], w(&["shard1.json", "shard 1/2 is given twice"])),
        g("merge overlapping shards", vec![os(d.join("merged")), os(&sh0), os(&sh1_overlap)], w(&["shard1-overlap.json", "window 2", "overlaps shard 0"])),
        g("merge a plain report", vec![os(d.join("merged")), os(&base)], w(&["base.json", "not a shard report"])),
        // 1, 2, 3: the converter.
        v("--out over the source", vec![os(&g_good), os("--out"), os(&g_good)], w(&["--out", "is the SOURCE"])),
        v("--out over ./source", vec![os(&g_good), os("--out"), os(d.join("sub/../good.gguf"))], w(&["--out", "is the SOURCE"])),
        v("--out /dev/full", vec![os(&g_good), os("--out"), os(&dev_full)], w(&["--out /dev/full", "character device"])),
        v("--out a folder", vec![os(&g_good), os("--out"), os(&sub)], w(&["--out", "a folder"])),
        v("--out in a missing folder", vec![os(&g_good), os("--out"), os(d.join("no/x.ninfer"))], w(&["--out", "does not exist"])),
        v("--gguf-twin is --out", vec![os(&g_good), os("--out"), os(d.join("s.ninfer")), os("--synthetic"), os("smollm2-135m"), os("--gguf-twin"), os(d.join("s.ninfer"))], w(&["--gguf-twin", "is also the --out"])),
        v("kv_count 4e9", vec![os(&g_kv), os("--out"), os(d.join("o.ninfer"))], w(&["kv.gguf", "kv_count 4000000000"])),
        v("tensor_count 4e9", vec![os(&g_tensors), os("--out"), os(d.join("o.ninfer"))], w(&["tensors.gguf", "tensor_count 4000000000"])),
        v("array length 2^60", vec![os(&g_array), os("--out"), os(d.join("o.ninfer"))], w(&["array.gguf", "tokenizer.ggml.tokens: array length"])),
        v("string length 2^40", vec![os(&g_string), os("--out"), os(d.join("o.ninfer"))], w(&["string.gguf", "general.architecture", "claims a string"])),
        v("GGUF magic", vec![os(&g_magic), os("--out"), os(d.join("o.ninfer"))], w(&["magic.gguf", "magic"])),
        v("GGUF n_dims 9", vec![os(&g_ndims), os("--out"), os(d.join("o.ninfer"))], w(&["ndims.gguf", "token_embd.weight", "n_dims 9"])),
        v("GGUF source missing", vec![os(d.join("nope.gguf")), os("--out"), os(d.join("o.ninfer"))], w(&["nope.gguf"])),
    ];
    assert!(cases.len() >= 60, "{} cases", cases.len());
    let dev_full_before = std::fs::metadata(&dev_full).unwrap().file_type().is_char_device();
    let watched = vec![model.clone()];
    for case in &cases {
        run_case(d, &watched, case);
    }
    assert!(dev_full_before && std::fs::metadata(&dev_full).unwrap().file_type().is_char_device(), "/dev/full is no longer a device");
    assert!(!d.join("profiles").exists(), "a default profiles/ folder was left behind");
}

/// Class 9: SIGINT and SIGTERM stop a scoring run at the next window: exit
/// 128 + signal, a last line saying how far it got, and nothing left behind
/// (no output folder, no --save-tokens file, no temporary).
#[test]
fn signals_stop_cleanly_and_leave_nothing() {
    use std::io::{BufRead, BufReader};
    let model = common::models_dir().join(SMOLLM2);
    let text = common::data_root().join("wikitext-2-raw/wiki.test.raw");
    for (signal, code) in [("-INT", 130), ("-TERM", 143)] {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let mut child = Command::new(env!("CARGO_BIN_EXE_infernix-perplexity"))
            .arg(&model)
            .args(["--text".as_ref(), text.as_os_str()])
            // Small one-window passes: the run reaches a window boundary soon after the signal.
            .args(["--method", "chunks", "--context", "64", "--batch-tokens", "64", "--prefill-chunk", "128"])
            .args(["--backend", "cpu", "--log-level", "info"])
            .arg("--save-tokens")
            .arg(d.join("tokens.json"))
            .arg("--output")
            .arg(d.join("out"))
            .current_dir(d)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = Vec::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            let ready = line.contains("ready in");
            seen.push(line);
            if ready {
                break;
            }
        }
        assert!(seen.last().is_some_and(|l| l.contains("ready in")), "no backend line: {seen:?}");
        assert!(Command::new("kill").arg(signal).arg(child.id().to_string()).status().unwrap().success());
        let t = std::time::Instant::now();
        seen.extend(lines.map(Result::unwrap));
        let status = child.wait().unwrap();
        assert!(t.elapsed().as_secs() < 60, "{signal}: took {:?} to stop", t.elapsed());
        let last = seen.last().cloned().unwrap_or_default();
        assert_eq!(status.code(), Some(code), "{signal}: {seen:?}");
        assert!(last.contains("error: stopped") && last.contains("interrupted by SIG"), "{signal}: {last}");
        assert!(last.contains(" windows") || last.contains("every window"), "{signal}: says what was completed: {last}");
        let left: Vec<_> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "{signal}: left behind: {left:?}");
    }
}
