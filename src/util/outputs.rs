//! The one check every output goes through before any work starts, and the
//! exclusive claim of an output folder.
//!
//! [`check_outputs`] refuses, for every output path:
//! - an existing path that is not a regular file: folders, symbolic links,
//!   character and block devices (`/dev/full`, `/dev/stdout`), FIFOs and
//!   sockets. Writes go to a temporary sibling renamed over the target, which
//!   would replace the special file itself, so none of them is supported;
//!   write to a regular file and read it from there;
//! - a path whose folder does not exist or is not a folder;
//! - a path that is one of the inputs, compared both as canonical paths (so
//!   `./x`, `a/../x` and symbolic links do not slip through) and as
//!   (device, inode) pairs (hard links);
//! - two outputs naming the same file.
//!
//! [`OutputDir::claim`] creates the folder (and any missing parents) or
//! accepts an existing empty one, then takes it with a create-new lock file,
//! so a second run into the same folder is refused while the first runs and
//! after it has written its report. Dropped before [`OutputDir::keep`], it
//! removes the lock and every folder it created (when still empty).
//!
//! Writing is [`super::fs`]; this module writes nothing but the lock.

use std::ffi::OsString;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The lock file inside a claimed output folder (removed when the run ends).
pub const LOCK_FILE: &str = ".infernix-perplexity.lock";

/// A path with the flag or role that names it in messages (`--save-tokens`, `MODEL`).
#[derive(Clone, Copy, Debug)]
pub struct Named<'a> {
    pub what: &'a str,
    pub path: &'a Path,
}

impl<'a> Named<'a> {
    pub fn new(what: &'a str, path: &'a Path) -> Self {
        Self { what, path }
    }
}

/// What identifies a file: its canonical path and, when it exists, (device, inode).
#[derive(Debug, PartialEq, Eq)]
struct Identity {
    canonical: PathBuf,
    dev_ino: Option<(u64, u64)>,
}

impl Identity {
    fn same(&self, other: &Identity) -> bool {
        self.canonical == other.canonical || (self.dev_ino.is_some() && self.dev_ino == other.dev_ino)
    }
}

/// The kind of a non-regular file, for messages.
fn kind_of(ft: &std::fs::FileType) -> &'static str {
    if ft.is_dir() {
        "a folder"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// `path` made absolute and free of `.`/`..`/links as far as it exists; the
/// missing tail is appended as written (`..` there is refused).
fn canonical_target(path: &Path) -> Result<PathBuf> {
    let abs = if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir().context("current folder")?.join(path) };
    let mut existing = abs.as_path();
    let mut tail: Vec<OsString> = Vec::new();
    loop {
        if let Ok(c) = existing.canonicalize() {
            let mut out = c;
            for part in tail.iter().rev() {
                out.push(part);
            }
            return Ok(out);
        }
        let Some(parent) = existing.parent() else { return Ok(abs) };
        match existing.components().next_back() {
            Some(Component::Normal(n)) => tail.push(n.to_os_string()),
            Some(Component::ParentDir) => bail!("{}: `..` after a folder that does not exist", path.display()),
            _ => {}
        }
        existing = parent;
    }
}

fn identity(path: &Path) -> Result<Identity> {
    let dev_ino = std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
    Ok(Identity { canonical: canonical_target(path)?, dev_ino })
}

/// Checks an output file's own path: an existing target must be a regular
/// file, its folder must exist (unless `folder_may_be_created`).
fn check_target(out: Named<'_>, folder_may_be_created: bool) -> Result<()> {
    let p = out.path;
    let at = || format!("{} {}", out.what, p.display());
    if p.file_name().is_none() {
        bail!("{}: not a file name", at());
    }
    if folder_may_be_created {
        if let Some(dir) = p.parent().filter(|d| d.exists() && !d.is_dir()) {
            bail!("{} {}: exists and is not a folder", out.what, dir.display());
        }
    }
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.file_type().is_file() => {}
        Ok(m) => bail!(
            "{}: exists and is {} (outputs are written to a temporary file renamed over the target, so only regular files are replaced; name a regular file)",
            at(),
            kind_of(&m.file_type())
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(anyhow::Error::new(e).context(format!("{}: stat", at()))),
    }
    if folder_may_be_created {
        return Ok(());
    }
    let parent = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    match std::fs::metadata(parent) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => bail!("{}: {} is not a folder", at(), parent.display()),
        Err(_) => bail!("{}: the folder {} does not exist", at(), parent.display()),
    }
}

/// Refuses any output that could destroy an input or a special file, or
/// that two outputs share, before any work starts. `outputs` are files
/// whose folder must exist; `in_new_folders` are files inside a folder the
/// run may still create (the report in `--output`); `inputs` are every file
/// the run reads (missing ones are left to their readers).
pub fn check_outputs(outputs: &[Named<'_>], in_new_folders: &[Named<'_>], inputs: &[Named<'_>]) -> Result<()> {
    let mut seen: Vec<(Named<'_>, Identity)> = Vec::with_capacity(outputs.len());
    let input_ids: Vec<(Named<'_>, Identity)> =
        inputs.iter().filter_map(|i| identity(i.path).ok().map(|id| (*i, id))).collect();
    let all = outputs.iter().map(|o| (o, false)).chain(in_new_folders.iter().map(|o| (o, true)));
    for (out, may_create) in all {
        check_target(*out, may_create)?;
        let id = identity(out.path).with_context(|| format!("{} {}", out.what, out.path.display()))?;
        if let Some((inp, _)) = input_ids.iter().find(|(_, i)| i.same(&id)) {
            bail!(
                "{} {}: is the {} {} (an output never replaces an input)",
                out.what,
                out.path.display(),
                inp.what,
                inp.path.display()
            );
        }
        if let Some((other, _)) = seen.iter().find(|(_, i)| i.same(&id)) {
            bail!("{} {}: is also the {} file", out.what, out.path.display(), other.what);
        }
        seen.push((*out, id));
    }
    Ok(())
}

/// An output folder held exclusively by this process.
#[derive(Debug)]
pub struct OutputDir {
    dir: PathBuf,
    lock: PathBuf,
    /// Folders this claim created, outermost first.
    created: Vec<PathBuf>,
    /// The lock file was created by this claim (so it is ours to remove).
    locked: bool,
    keep: bool,
}

impl OutputDir {
    /// Creates `dir` (and missing parents) or accepts it empty, then takes
    /// it with a create-new lock file. `what` names the flag in messages.
    pub fn claim(what: &str, dir: &Path) -> Result<Self> {
        let at = || format!("{what} {}", dir.display());
        let mut missing = Vec::new();
        let mut p = dir;
        loop {
            match std::fs::symlink_metadata(p) {
                Ok(_) => break,
                Err(_) => {
                    missing.push(p.to_path_buf());
                    match p.parent() {
                        Some(q) if !q.as_os_str().is_empty() => p = q,
                        _ => break,
                    }
                }
            }
        }
        missing.reverse();
        let mut claim = Self { dir: dir.to_path_buf(), lock: dir.join(LOCK_FILE), created: Vec::new(), locked: false, keep: false };
        for m in &missing {
            match std::fs::create_dir(m) {
                Ok(()) => claim.created.push(m.clone()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(anyhow::Error::new(e).context(format!("{}: create folder {}", at(), m.display()))),
            }
        }
        let meta = std::fs::metadata(dir).with_context(|| format!("{}: stat", at()))?;
        if !meta.is_dir() {
            bail!("{}: exists and is not a folder", at());
        }
        // Refuse a used folder before touching it, then lock, then look again (another
        // process may have claimed it in between: the lock decides).
        claim.check_empty(what)?;
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&claim.lock) {
            Ok(_) => claim.locked = true,
            Err(e) => {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    bail!("{}: another run is writing into this folder ({} exists)", at(), LOCK_FILE);
                }
                return Err(anyhow::Error::new(e).context(format!("{}: create {LOCK_FILE}", at())));
            }
        }
        claim.check_empty(what)?;
        Ok(claim)
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Refuses a folder holding anything but this claim's own lock.
    fn check_empty(&self, what: &str) -> Result<()> {
        let at = || format!("{what} {}", self.dir.display());
        let entries = std::fs::read_dir(&self.dir).with_context(|| format!("{}: read folder", at()))?;
        for e in entries {
            let name = e.with_context(|| format!("{}: read folder", at()))?.file_name();
            if name == LOCK_FILE {
                if !self.locked {
                    bail!("{}: another run is writing into this folder ({LOCK_FILE} exists)", at());
                }
                continue;
            }
            bail!("{}: the folder is not empty ({} is there; name a new or empty folder)", at(), name.to_string_lossy());
        }
        Ok(())
    }


    /// The run succeeded: keep the folder (the lock is still removed on drop).
    pub fn keep(&mut self) {
        self.keep = true;
    }
}

impl Drop for OutputDir {
    fn drop(&mut self) {
        if self.locked {
            let _ = std::fs::remove_file(&self.lock);
        }
        if !self.keep {
            // remove_dir only removes empty folders: anything written stays.
            for d in self.created.iter().rev() {
                let _ = std::fs::remove_dir(d);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n<'a>(what: &'a str, p: &'a Path) -> Named<'a> {
        Named::new(what, p)
    }

    #[test]
    fn outputs_never_replace_inputs_by_any_spelling() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m.bin");
        std::fs::write(&model, b"m").unwrap();
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let dotted = sub.join("..").join("m.bin");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&model, &link).unwrap();
        let hard = dir.path().join("hard");
        std::fs::hard_link(&model, &hard).unwrap();
        let inputs = [n("MODEL", &model)];
        for (p, want) in [(&model, "is the MODEL"), (&dotted, "is the MODEL"), (&link, "symbolic link"), (&hard, "is the MODEL")] {
            let e = format!("{:#}", check_outputs(&[n("--save-tokens", p)], &[], &inputs).unwrap_err());
            assert!(e.contains(want) && e.starts_with("--save-tokens"), "{p:?}: {e}");
        }
        let fresh = dir.path().join("new.json");
        check_outputs(&[n("--save-tokens", &fresh)], &[], &inputs).unwrap();
        let e = format!("{:#}", check_outputs(&[n("--a", &fresh)], &[n("--b", &sub.join("../new.json"))], &inputs).unwrap_err());
        assert!(e.contains("is also the --a"), "{e}");
        assert_eq!(std::fs::read(&model).unwrap(), b"m");
    }

    #[test]
    fn special_files_and_missing_folders_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for (p, want) in [
            (PathBuf::from("/dev/full"), "character device"),
            (PathBuf::from("/dev/null"), "character device"),
            (dir.path().to_path_buf(), "a folder"),
            (dir.path().join("no/such/x"), "does not exist"),
        ] {
            let e = format!("{:#}", check_outputs(&[n("--out", &p)], &[], &[]).unwrap_err());
            assert!(e.contains(want), "{p:?}: {e}");
        }
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let e = format!("{:#}", check_outputs(&[n("--out", &fifo)], &[], &[]).unwrap_err());
        assert!(e.contains("a FIFO"), "{e}");
    }

    #[test]
    fn a_folder_is_claimed_once_and_cleaned_up_on_failure() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("a/b/c");
        {
            let first = OutputDir::claim("--output", &out).unwrap();
            let e = format!("{:#}", OutputDir::claim("--output", &out).unwrap_err());
            assert!(e.contains("another run"), "{e}");
            assert!(out.join(LOCK_FILE).exists(), "the refused claim removed the first one's lock");
            drop(first);
        }
        // Dropped without keep: every created folder is gone.
        assert!(!dir.path().join("a").exists());
        let mut kept = OutputDir::claim("--output", &out).unwrap();
        std::fs::write(out.join("report.json"), b"{}").unwrap();
        kept.keep();
        drop(kept);
        assert!(out.join("report.json").exists() && !out.join(LOCK_FILE).exists());
        let e = format!("{:#}", OutputDir::claim("--output", &out).unwrap_err());
        assert!(e.contains("not empty"), "{e}");
        assert!(out.join("report.json").exists());
    }
}
