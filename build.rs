//! Build script: compiles `kernels/*.cu` to PTX with nvcc, then each PTX to a
//! cubin (machine code for exactly the target, `sm_<arch>`) with the same nvcc,
//! and generates `$OUT_DIR/cuda_kernels.rs` (included by
//! `src/backend/cuda/ptx.rs`) holding each module's PTX and cubin, the nvcc
//! version, the target arch and a SHA-256 of the kernel sources.
//!
//! The device loads a module's cubin when the GPU's compute capability is the
//! cubin's, and the PTX otherwise (the driver then JIT-compiles it; on an H200
//! with an empty JIT cache that took about 60 s for all modules). The cubin is
//! the same PTX assembled ahead of time, so no result depends on which one
//! loads. `INFERNIX_CUBIN=0` skips the cubins (PTX only: a faster build); a
//! cubin is rebuilt only when its module's PTX changed.
//!
//! nvcc is looked up through `NVCC` (path to the executable), then
//! `CUDA_HOME`/bin/nvcc and `CUDA_PATH`/bin/nvcc, then `PATH`. The target arch
//! comes from `INFERNIX_CUDA_ARCH` (default `90`; `90a` for wgmma code);
//! modules named `*_sm90a.cu` (Hopper-only instructions: wgmma, setmaxnreg)
//! are always compiled for `compute_90a`, whatever that variable says, and
//! the device loads them only on a compute capability 9.0 GPU.
//! Without nvcc the build warns and the CUDA backend reports "built without
//! CUDA kernels" at run time; a kernel that fails to compile fails the build
//! with the exact command and nvcc's output. No GPU is probed here.

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sha2::{Digest, Sha256};

const KERNEL_DIR: &str = "kernels";
/// File-stem suffix of the modules built for compute_90a regardless of `INFERNIX_CUDA_ARCH`
/// (the same suffix `src/backend/cuda/device.rs` checks before loading one).
const SM90A_SUFFIX: &str = "_sm90a";
const ENV_VARS: [&str; 6] = ["NVCC", "CUDA_HOME", "CUDA_PATH", "PATH", "INFERNIX_CUDA_ARCH", "INFERNIX_CUBIN"];

fn main() {
    println!("cargo:rerun-if-changed={KERNEL_DIR}");
    println!("cargo:rerun-if-changed=build.rs");
    for var in ENV_VARS {
        println!("cargo:rerun-if-env-changed={var}");
    }
    emit_git_revision();
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let arch = env::var("INFERNIX_CUDA_ARCH").unwrap_or_else(|_| "90".to_string());
    if arch.is_empty() || !arch.trim_end_matches('a').chars().all(|c| c.is_ascii_digit()) {
        panic!("INFERNIX_CUDA_ARCH={arch:?}: expected a compute capability such as 90 or 90a");
    }

    let (sources, headers) = kernel_sources();
    let sources_sha256 = hash_sources(sources.iter().chain(headers.iter()));
    let file_hashes = hash_each(sources.iter().chain(headers.iter()));

    let Some(nvcc) = find_nvcc() else {
        println!(
            "cargo:warning=nvcc not found (NVCC, CUDA_HOME, CUDA_PATH, PATH): building without CUDA kernels; \
             the CUDA backend will report \"built without CUDA kernels\""
        );
        write_generated(&out_dir, None, &arch, &sources_sha256, &file_hashes, &[]);
        return;
    };
    let version = nvcc_version(&nvcc);
    let include_dirs = nvcc_include_dirs(&nvcc);

    // Compile every module concurrently; report every failure.
    let mut jobs = Vec::new();
    for src in &sources {
        let stem = src.file_stem().and_then(|s| s.to_str()).expect("kernel file names are UTF-8");
        let ptx = out_dir.join(format!("{stem}.ptx"));
        let module_arch = if stem.ends_with(SM90A_SUFFIX) { "90a" } else { arch.as_str() };
        let mut cmd = Command::new(&nvcc);
        cmd.arg("-ptx")
            .arg(format!("-arch=compute_{module_arch}"))
            .arg("-O3")
            .arg("-std=c++17")
            .arg("-I")
            .arg(KERNEL_DIR);
        for dir in &include_dirs {
            cmd.arg("-I").arg(dir);
        }
        cmd.arg("-o").arg(&ptx).arg(src);
        let shown = format!("{cmd:?}");
        let child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn();
        jobs.push((stem.to_string(), ptx, shown, child));
    }
    let mut modules = Vec::new();
    let mut failures = String::new();
    for (stem, ptx, shown, child) in jobs {
        let output = child.and_then(|c| c.wait_with_output());
        match output {
            Ok(out) if out.status.success() => {
                let module_arch = if stem.ends_with(SM90A_SUFFIX) { "90a" } else { arch.as_str() };
                modules.push(Module { stem, ptx, arch: module_arch.to_string(), cubin: None })
            }
            Ok(out) => {
                let _ = writeln!(failures, "nvcc failed ({}):\n  {shown}\n{}", out.status, both(&out));
            }
            Err(e) => {
                let _ = writeln!(failures, "could not run nvcc:\n  {shown}\n  {e}");
            }
        }
    }
    if !failures.is_empty() {
        panic!("compiling CUDA kernels to PTX failed:\n{failures}");
    }
    if env::var("INFERNIX_CUBIN").map(|v| v != "0").unwrap_or(true) {
        assemble_cubins(&nvcc, &mut modules);
    }
    write_generated(&out_dir, Some(&version), &arch, &sources_sha256, &file_hashes, &modules);
}

/// One compiled kernel module: its PTX and, once assembled, its cubin for `sm_<arch>`.
struct Module {
    stem: String,
    ptx: PathBuf,
    arch: String,
    cubin: Option<PathBuf>,
}

/// Assembles every module's PTX into a cubin for `sm_<arch>` (`nvcc -cubin`, concurrently),
/// skipping a module whose cubin was built from PTX with the same SHA-256 (kept beside it),
/// so an edit to one kernel file re-assembles only the modules whose PTX changed.
fn assemble_cubins(nvcc: &Path, modules: &mut [Module]) {
    let mut jobs = Vec::new();
    for (i, m) in modules.iter().enumerate() {
        let ptx_bytes = std::fs::read(&m.ptx).unwrap_or_else(|e| panic!("read {}: {e}", m.ptx.display()));
        let ptx_sha: String = Sha256::digest(&ptx_bytes).iter().map(|b| format!("{b:02x}")).collect();
        let cubin = m.ptx.with_extension("cubin");
        let stamp = m.ptx.with_extension("cubin.ptx-sha256");
        if cubin.is_file() && std::fs::read_to_string(&stamp).map(|s| s == ptx_sha).unwrap_or(false) {
            jobs.push((i, cubin, stamp, ptx_sha, String::new(), None));
            continue;
        }
        let mut cmd = Command::new(nvcc);
        cmd.arg("-cubin").arg(format!("-arch=sm_{}", m.arch)).arg("-o").arg(&cubin).arg(&m.ptx);
        let shown = format!("{cmd:?}");
        let child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn();
        jobs.push((i, cubin, stamp, ptx_sha, shown, Some(child)));
    }
    let mut failures = String::new();
    for (i, cubin, stamp, ptx_sha, shown, child) in jobs {
        match child.map(|c| c.and_then(|c| c.wait_with_output())) {
            None => {}
            Some(Ok(out)) if out.status.success() => {
                std::fs::write(&stamp, &ptx_sha).unwrap_or_else(|e| panic!("write {}: {e}", stamp.display()));
            }
            Some(Ok(out)) => {
                let _ = writeln!(failures, "nvcc -cubin failed ({}):\n  {shown}\n{}", out.status, both(&out));
                continue;
            }
            Some(Err(e)) => {
                let _ = writeln!(failures, "could not run nvcc:\n  {shown}\n  {e}");
                continue;
            }
        }
        modules[i].cubin = Some(cubin);
    }
    if !failures.is_empty() {
        panic!("assembling the kernels' PTX into cubins failed (INFERNIX_CUBIN=0 builds PTX only):\n{failures}");
    }
}

/// The `.cu` modules and the headers under `kernels/`, sorted by name.
fn kernel_sources() -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut sources = Vec::new();
    let mut headers = Vec::new();
    let entries = std::fs::read_dir(KERNEL_DIR).unwrap_or_else(|e| panic!("read {KERNEL_DIR}/: {e}"));
    for entry in entries {
        let path = entry.unwrap_or_else(|e| panic!("read {KERNEL_DIR}/: {e}")).path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("cu") => sources.push(path),
            Some("cuh") | Some("h") => headers.push(path),
            _ => {}
        }
    }
    sources.sort();
    headers.sort();
    (sources, headers)
}

/// SHA-256 over (file name, NUL, contents, NUL) of every kernel source, in name order.
fn hash_sources<'a>(paths: impl Iterator<Item = &'a PathBuf>) -> String {
    let mut all: Vec<&PathBuf> = paths.collect();
    all.sort();
    let mut h = Sha256::new();
    for p in all {
        let bytes = std::fs::read(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
        h.update(p.file_name().and_then(|n| n.to_str()).unwrap_or("").as_bytes());
        h.update([0u8]);
        h.update(&bytes);
        h.update([0u8]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// (path relative to the crate, SHA-256 of the contents) of every kernel source, in path order.
fn hash_each<'a>(paths: impl Iterator<Item = &'a PathBuf>) -> Vec<(String, String)> {
    let mut all: Vec<(String, String)> = paths
        .map(|p| {
            let bytes = std::fs::read(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
            let name = p.file_name().and_then(|n| n.to_str()).expect("kernel file names are UTF-8");
            (format!("{KERNEL_DIR}/{name}"), Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect())
        })
        .collect();
    all.sort();
    all
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
        println!("cargo:warning=NVCC={} is not a file; looking further", p.display());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env::var_os(var).filter(|p| !p.is_empty()) {
            let p = Path::new(&root).join("bin").join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let path = env::var_os("PATH")?;
    env::split_paths(&path).map(|d| d.join("nvcc")).find(|p| p.is_file())
}

/// The "release X.Y, VX.Y.Z" line of `nvcc --version` (the whole output when absent).
fn nvcc_version(nvcc: &Path) -> String {
    let out = Command::new(nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("running {} --version: {e}", nvcc.display()));
    if !out.status.success() {
        panic!("{} --version failed ({}):\n{}", nvcc.display(), out.status, both(&out));
    }
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .find(|l| l.contains("release"))
        .map(|l| l.trim().to_string())
        .unwrap_or_else(|| text.trim().replace('\n', " "))
}

/// `<nvcc>/../include` and `<nvcc>/../include/cccl` when they exist (the PyPI
/// layout of nvcc keeps the CUDA headers there).
fn nvcc_include_dirs(nvcc: &Path) -> Vec<PathBuf> {
    let Some(root) = nvcc.parent().and_then(|b| b.parent()) else { return Vec::new() };
    [root.join("include"), root.join("include").join("cccl")].into_iter().filter(|d| d.is_dir()).collect()
}

fn both(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn write_generated(
    out_dir: &Path,
    nvcc_version: Option<&str>,
    arch: &str,
    sha: &str,
    file_hashes: &[(String, String)],
    modules: &[Module],
) {
    let mut s = String::new();
    s.push_str("// @generated by build.rs: PTX and cubins of kernels/*.cu and the toolchain that built them.\n");
    let _ = writeln!(s, "pub const KERNELS_BUILT: bool = {};", nvcc_version.is_some());
    let _ = writeln!(s, "pub const NVCC_VERSION: &str = {:?};", nvcc_version.unwrap_or(""));
    let _ = writeln!(s, "pub const CUDA_ARCH: &str = {arch:?};");
    let _ = writeln!(s, "pub const SOURCES_SHA256: &str = {sha:?};");
    s.push_str("pub const SOURCE_FILES_SHA256: &[(&str, &str)] = &[\n");
    for (path, h) in file_hashes {
        let _ = writeln!(s, "    ({path:?}, {h:?}),");
    }
    s.push_str("];\n");
    s.push_str("pub const MODULES: &[Module] = &[\n");
    for m in modules {
        let path = m.ptx.to_str().expect("OUT_DIR is UTF-8");
        let cubin = match &m.cubin {
            Some(c) => format!("include_bytes!({:?})", c.to_str().expect("OUT_DIR is UTF-8")),
            None => "&[]".to_string(),
        };
        let _ = writeln!(
            s,
            "    Module {{ name: {:?}, ptx: include_str!({path:?}), cubin: {cubin}, cubin_arch: {:?} }},",
            m.stem, m.arch
        );
    }
    s.push_str("];\n");
    let dst = out_dir.join("cuda_kernels.rs");
    std::fs::write(&dst, s).unwrap_or_else(|e| panic!("write {}: {e}", dst.display()));
}

/// Records `git rev-parse HEAD` (plus `-dirty` for uncommitted changes to
/// tracked files) as `INFERNIX_GIT_REVISION` for the report; `unknown`
/// outside a git checkout.
///
/// Nothing here writes to the repository: `git status` would rewrite
/// `.git/index` to refresh its stat cache, so it runs with
/// `--no-optional-locks`, which leaves the index as it is (checked: the
/// index's mtime is unchanged after the build). The script reruns when HEAD
/// moves (the HEAD file, and the branch's ref file or packed-refs), not on
/// index changes, so a fresh clone compiles once; `-dirty` is as of the
/// build script's last run.
fn emit_git_revision() {
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("--no-optional-locks")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    if let (Some(dir), Some(common)) = (git(&["rev-parse", "--git-dir"]), git(&["rev-parse", "--git-common-dir"])) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            let loose = std::path::Path::new(&common).join(&branch);
            let packed = std::path::Path::new(&common).join("packed-refs");
            // A missing path would rerun the script on every build: name only what exists.
            for p in [loose, packed].iter().filter(|p| p.exists()) {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        }
    }
    let rev = match (git(&["rev-parse", "HEAD"]), git(&["status", "--porcelain", "--untracked-files=no"])) {
        (Some(rev), Some(status)) if !status.is_empty() => format!("{rev}-dirty"),
        (Some(rev), _) => rev,
        _ => "unknown".to_string(),
    };
    println!("cargo:rustc-env=INFERNIX_GIT_REVISION={rev}");
}
