//! Atomic output: write to a temporary sibling, rename over the target only
//! when complete, remove the temporary on every error path (a failed sync,
//! a failed rename, an early return or a drop).
//!
//! The target itself is checked before any work by [`super::outputs`]; this
//! module only writes.

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// A file being written at `<target>.tmp-<pid>`; dropped without a
/// successful `commit`, the temporary is removed.
pub struct AtomicFile {
    target: PathBuf,
    tmp: PathBuf,
    file: Option<File>,
    /// The temporary has been renamed over the target (nothing to remove).
    renamed: bool,
}

impl AtomicFile {
    pub fn create(target: &Path) -> Result<Self> {
        let tmp = tmp_path(target);
        // create_new: never truncate something that happens to have this name.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .with_context(|| format!("create {}", tmp.display()))?;
        Ok(Self { target: target.to_path_buf(), tmp, file: Some(file), renamed: false })
    }

    /// The open temporary file.
    pub fn file(&self) -> &File {
        // Only `commit` takes the file, and it consumes `self`.
        self.file.as_ref().unwrap_or_else(|| unreachable!("AtomicFile::file after commit"))
    }

    /// The temporary's path (for tests and messages).
    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// Flushes to disk and renames over the target. On any error the
    /// temporary is removed (by `drop`).
    pub fn commit(mut self) -> Result<()> {
        if let Some(file) = self.file.take() {
            file.sync_all().with_context(|| format!("sync {}", self.tmp.display()))?;
        }
        std::fs::rename(&self.tmp, &self.target)
            .with_context(|| format!("rename {} to {}", self.tmp.display(), self.target.display()))?;
        self.renamed = true;
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        drop(self.file.take());
        if !self.renamed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// `<target>.tmp-<pid>`.
pub fn tmp_path(target: &Path) -> PathBuf {
    let mut name = target.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".tmp-{}", std::process::id()));
    target.with_file_name(name)
}

/// Writes `bytes` to `target` atomically.
pub fn write_atomic(target: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let f = AtomicFile::create(target)?;
    f.file().write_all(bytes).with_context(|| format!("write {}", target.display()))?;
    f.commit()
}

/// Reads a whole file of at most `max_bytes`, refusing a larger one before
/// reading it (`what` names the flag or role in the message).
pub fn read_bounded(path: &Path, max_bytes: u64, what: &str) -> Result<Vec<u8>> {
    use std::io::Read;
    let file = File::open(path).with_context(|| format!("{what} {}: open", path.display()))?;
    let n = file.metadata().with_context(|| format!("{what} {}: stat", path.display()))?.len();
    let too_big = |n: u64| anyhow::anyhow!("{what} {}: {n} bytes, larger than the limit of {max_bytes} bytes", path.display());
    if n > max_bytes {
        return Err(too_big(n));
    }
    let mut bytes = Vec::with_capacity(n as usize);
    // take(): a file that grows while read (or a special file reporting 0) stays bounded.
    file.take(max_bytes + 1).read_to_end(&mut bytes).with_context(|| format!("{what} {}: read", path.display()))?;
    if bytes.len() as u64 > max_bytes {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_rename_removes_the_temporary() {
        let dir = tempfile::tempdir().unwrap();
        // A non-empty folder as the target: rename(2) of a file over it fails.
        let target = dir.path().join("out");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("keep"), b"x").unwrap();
        let f = AtomicFile::create(&target).unwrap();
        let tmp = f.tmp_path().to_path_buf();
        assert!(tmp.exists());
        let err = f.commit().unwrap_err();
        assert!(format!("{err:#}").contains("rename"), "{err:#}");
        assert!(!tmp.exists(), "the temporary survived a failed rename");
        assert!(target.join("keep").exists());
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("out")]);
    }

    #[test]
    fn dropped_unfinished_removes_the_temporary_and_commit_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("a.json");
        std::fs::write(&target, b"old").unwrap();
        {
            let f = AtomicFile::create(&target).unwrap();
            std::io::Write::write_all(&mut f.file(), b"half").unwrap();
        }
        assert_eq!(std::fs::read(&target).unwrap(), b"old");
        assert!(!tmp_path(&target).exists());
        write_atomic(&target, b"new").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert!(!tmp_path(&target).exists());
    }

    #[test]
    fn read_bounded_refuses_a_file_over_the_limit_and_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.json");
        std::fs::write(&path, b"0123456789").unwrap();
        assert_eq!(read_bounded(&path, 10, "--x").unwrap(), b"0123456789");
        let err = format!("{:#}", read_bounded(&path, 9, "--x").unwrap_err());
        assert!(err.starts_with("--x ") && err.contains("m.json") && err.contains("10 bytes") && err.contains("9 bytes"), "{err}");
        let err = format!("{:#}", read_bounded(&dir.path().join("absent"), 9, "--x").unwrap_err());
        assert!(err.contains("absent: open"), "{err}");
    }
}
