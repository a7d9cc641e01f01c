//! Atomic output: write to a temporary sibling, rename over the target only
//! when complete, remove the temporary on every error path (drop).

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// A file being written at `<target>.tmp-<pid>`; dropped without `commit`, it is removed.
pub struct AtomicFile {
    target: PathBuf,
    tmp: PathBuf,
    file: Option<File>,
}

impl AtomicFile {
    pub fn create(target: &Path) -> Result<Self> {
        let mut name = target.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        name.push(format!(".tmp-{}", std::process::id()));
        let tmp = target.with_file_name(name);
        let file = File::create(&tmp).with_context(|| format!("create {}", tmp.display()))?;
        Ok(Self { target: target.to_path_buf(), tmp, file: Some(file) })
    }

    pub fn file(&self) -> &File {
        self.file.as_ref().expect("file present until commit")
    }

    /// Flushes to disk and renames over the target.
    pub fn commit(mut self) -> Result<()> {
        let file = self.file.take().expect("file present until commit");
        file.sync_all().with_context(|| format!("sync {}", self.tmp.display()))?;
        drop(file);
        std::fs::rename(&self.tmp, &self.target)
            .with_context(|| format!("rename {} to {}", self.tmp.display(), self.target.display()))
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `bytes` to `target` atomically.
pub fn write_atomic(target: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let f = AtomicFile::create(target)?;
    f.file().write_all(bytes).with_context(|| format!("write {}", target.display()))?;
    f.commit()
}
