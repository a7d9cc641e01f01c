//! Bad input to `ninfer-convert` and to the artifact reader: each case gives a
//! one-line error naming the file and the field, exit code 2, and leaves no
//! output file behind.

use std::path::{Path, PathBuf};
use std::process::Command;

use infernix_perplexity::artifact::Artifact;
use infernix_perplexity::convert::gguf::{GgufValue, GgufWriter};

#[path = "common/tiny_artifact.rs"]
mod tiny_artifact;

/// A tiny, structurally valid llama GGUF: one Q8_0 embedding and one F32 norm.
fn tiny_gguf(tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>) -> Vec<u8> {
    let owned = tensors;
    let w = GgufWriter {
        metadata: vec![("general.architecture".into(), GgufValue::String("llama".into()))],
        tensors: owned.iter().map(|(n, d, t, b)| (n.clone(), d.clone(), *t, b.as_slice())).collect(),
    };
    w.to_bytes()
}

fn good_tensors() -> Vec<(String, Vec<u64>, u32, Vec<u8>)> {
    vec![
        ("token_embd.weight".into(), vec![32, 4], 8, vec![1u8; 34 * 4]),
        ("output_norm.weight".into(), vec![32], 0, vec![0u8; 128]),
    ]
}

fn convert(src: &Path, out: &Path) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_ninfer-convert")).arg(src).arg("--out").arg(out).output().unwrap();
    (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stderr).into_owned())
}

fn assert_fails(name: &str, bytes: &[u8], expect: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join(format!("{name}.gguf"));
    std::fs::write(&src, bytes).unwrap();
    let out = dir.path().join("out.ninfer");
    let (code, stderr) = convert(&src, &out);
    assert_eq!(code, 2, "{name}: exit code, stderr: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{name}: one line expected: {stderr}");
    assert!(stderr.contains(&src.display().to_string()), "{name}: error must name the file: {stderr}");
    for e in expect {
        assert!(stderr.contains(e), "{name}: expected {e:?} in: {stderr}");
    }
    let left: Vec<PathBuf> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).filter(|p| p != &src).collect();
    assert!(left.is_empty(), "{name}: output left behind: {left:?}");
}

#[test]
fn wrong_magic() {
    let mut b = tiny_gguf(good_tensors());
    b[0..4].copy_from_slice(b"GGML");
    assert_fails("magic", &b, &["magic"]);
}

#[test]
fn truncated() {
    let b = tiny_gguf(good_tensors());
    assert_fails("truncated-header", &b[..40], &["truncated"]);
    // Cut inside the tensor data: the last tensor runs past the end.
    assert_fails("truncated-data", &b[..b.len() - 10], &["output_norm.weight", "past the end"]);
}

#[test]
fn offset_past_end() {
    let mut t = good_tensors();
    t[1].3 = vec![0u8; 64]; // declared 32 F32 = 128 bytes, file holds 64
    assert_fails("offset", &tiny_gguf(t), &["output_norm.weight", "past the end"]);
}

#[test]
fn overlapping_tensors() {
    // Patch the second tensor's relative offset to 0, onto the first.
    let b = tiny_gguf(good_tensors());
    let name = b"output_norm.weight";
    let at = b.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    // n_dims u32, 1 dim u64, type u32, then the offset u64.
    let off_at = at + 4 + 8 + 4;
    let mut b2 = b.clone();
    b2[off_at..off_at + 8].copy_from_slice(&0u64.to_le_bytes());
    assert_fails("overlap", &b2, &["overlaps"]);
}

#[test]
fn duplicate_names() {
    let mut t = good_tensors();
    t[1].0 = "token_embd.weight".into();
    t[1].1 = vec![32, 4];
    t[1].2 = 8;
    t[1].3 = vec![1u8; 34 * 4];
    assert_fails("duplicate", &tiny_gguf(t), &["token_embd.weight", "duplicate"]);
}

#[test]
fn shape_not_whole_blocks() {
    let mut t = good_tensors();
    t[0].1 = vec![33, 4]; // Q8_0 rows of 33 elements
    assert_fails("shape", &tiny_gguf(t), &["token_embd.weight", "multiple"]);
}

#[test]
fn unknown_block_format() {
    let mut t = good_tensors();
    t[0].2 = 23; // IQ4_XS: not kept
    t[0].3 = vec![0u8; 136 * 4 / 8];
    t[0].1 = vec![256, 1];
    assert_fails("format", &tiny_gguf(t), &["token_embd.weight", "IQ4_XS"]);
}

#[test]
fn hf_folder_without_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("hf");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("config.json"), br#"{"model_type":"llama"}"#).unwrap();
    let out = dir.path().join("out.ninfer");
    let (code, stderr) = convert(&folder, &out);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("tokenizer.json") && stderr.contains(&folder.display().to_string()), "{stderr}");
    assert!(!out.exists());
}

#[test]
fn reader_rejects_bad_tensor_entries() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("tiny.gguf");
    let out = dir.path().join("tiny.ninfer");
    std::fs::write(&src, tiny_gguf(good_tensors())).unwrap();
    // The tiny GGUF lacks hyperparameters: build the artifact with the library writer.
    tiny_artifact::write_tiny(&out);
    let a = Artifact::open(&out).unwrap();
    a.verify().unwrap();
    assert_eq!(a.tensor("token_embd.weight").unwrap().rows_cols(), (4, 32));

    let cases: Vec<(&str, Box<dyn Fn(&mut serde_json::Value)>)> = vec![
        ("n_bytes", Box::new(|v| v["tensors"][0]["n_bytes"] = 100.into())),
        ("past", Box::new(|v| v["tensors"][1]["offset"] = (1u64 << 40).into())),
        ("aligned", Box::new(|v| { let o = v["tensors"][1]["offset"].as_u64().unwrap(); v["tensors"][1]["offset"] = (o + 4).into() })),
        ("overlaps", Box::new(|v| { let o = v["tensors"][0]["offset"].clone(); v["tensors"][1]["offset"] = o })),
        ("duplicate", Box::new(|v| v["tensors"][1]["name"] = "token_embd.weight".into())),
        ("unknown variant", Box::new(|v| v["tensors"][0]["format"] = "IQ1_M".into())),
        ("output_norm.weight is missing", Box::new(|v| v["tensors"][1]["name"] = "other".into())),
        ("hparams.rms_eps", Box::new(|v| v["hparams"]["rms_eps"] = (-1.0).into())),
        ("hparams.rope_base", Box::new(|v| v["hparams"]["rope_base"] = 0.0.into())),
        ("hparams.attn_scale", Box::new(|v| v["hparams"]["attn_scale"] = 1e9.into())),
        ("token_embd.weight has shape [4, 32]", Box::new(|v| v["hparams"]["n_vocab"] = 5.into())),
        ("hparams.sliding_window[0]", Box::new(|v| v["hparams"]["sliding_window"] = serde_json::json!([0]))),
    ];
    for (expect, patch) in cases {
        let p = dir.path().join(format!("case-{}.ninfer", expect.replace([' ', '[', ']', ','], "_")));
        std::fs::copy(&out, &p).unwrap();
        tiny_artifact::patch_json(&p, true, |v| patch(v));
        let err = format!("{:#}", Artifact::open(&p).err().unwrap_or_else(|| panic!("{expect}: opened")));
        assert!(err.contains(expect) && err.contains(&p.display().to_string()), "{expect}: {err}");
    }
    // A version-3 file (no metadata digest, JSON at 32) still opens; --verify refuses it.
    let p = dir.path().join("v3.ninfer");
    std::fs::copy(&out, &p).unwrap();
    tiny_artifact::to_v3(&p);
    let v3 = Artifact::open(&p).unwrap();
    assert!(!v3.metadata_digest_checked);
    let err = format!("{:#}", v3.verify().unwrap_err());
    assert!(err.contains("version 3") && err.contains("reconvert with ninfer-convert"), "{err}");
    // One changed digit of the metadata without its digest: refused at open.
    let p = dir.path().join("edited.ninfer");
    std::fs::copy(&out, &p).unwrap();
    tiny_artifact::patch_json(&p, false, |v| v["hparams"]["rope_base"] = 10001.0.into());
    let err = format!("{:#}", Artifact::open(&p).err().expect("an edited metadata block opened"));
    assert!(err.contains("metadata_sha256") && err.contains("reconvert with ninfer-convert"), "{err}");
    // A flipped tensor byte is caught by --verify, not by open.
    let p = dir.path().join("flipped.ninfer");
    let mut b = std::fs::read(&out).unwrap();
    let off = a.meta.tensors[0].offset as usize;
    b[off] ^= 0xff;
    std::fs::write(&p, b).unwrap();
    let a2 = Artifact::open(&p).unwrap();
    assert!(format!("{:#}", a2.verify().unwrap_err()).contains("token_embd.weight"));
}
