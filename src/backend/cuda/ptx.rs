//! The PTX modules compiled by `build.rs` from `kernels/*.cu`, and the
//! toolchain record that came with them (nvcc version, target arch, SHA-256 of
//! the kernel sources, together and per file). This module only exposes the
//! generated constants.

include!(concat!(env!("OUT_DIR"), "/cuda_kernels.rs"));

/// What `build.rs` recorded about the embedded kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelBuildInfo {
    /// False when nvcc was not found at build time (no modules embedded).
    pub kernels_built: bool,
    /// nvcc's "release X.Y, VX.Y.Z" line ("" without kernels).
    pub nvcc_version: &'static str,
    /// The compute capability the PTX targets, e.g. "90".
    pub arch: &'static str,
    /// SHA-256 over the kernel sources (hex).
    pub sources_sha256: &'static str,
    /// Number of PTX modules embedded.
    pub n_modules: usize,
}

/// (path such as `kernels/attention.cu`, SHA-256 hex) of each kernel source
/// this binary was built from, in path order: what `tests/data/gpu_parity.json`
/// records per file after a device parity run.
pub fn source_file_hashes() -> &'static [(&'static str, &'static str)] {
    SOURCE_FILES_SHA256
}

pub fn build_info() -> KernelBuildInfo {
    KernelBuildInfo {
        kernels_built: KERNELS_BUILT,
        nvcc_version: NVCC_VERSION,
        arch: CUDA_ARCH,
        sources_sha256: SOURCES_SHA256,
        n_modules: MODULES.len(),
    }
}

/// The names of the kernels (`.entry` symbols) in one PTX module, in file order.
pub fn entry_names(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let rest = l.strip_prefix(".visible .entry ").or_else(|| l.strip_prefix(".entry "))?;
            let end = rest.find(|c: char| c == '(' || c.is_whitespace()).unwrap_or(rest.len());
            Some(&rest[..end])
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_names_parse_ptx_headers() {
        let ptx = "// x\n.visible .entry rmsnorm_f32(\n\t.param .u64 a\n)\n.entry other (\n";
        assert_eq!(entry_names(ptx), vec!["rmsnorm_f32", "other"]);
    }

    #[test]
    fn build_info_is_consistent() {
        let info = build_info();
        assert_eq!(info.kernels_built, info.n_modules > 0);
        assert_eq!(info.sources_sha256.len(), 64);
        assert!(!info.arch.is_empty());
        if info.kernels_built {
            assert!(info.nvcc_version.contains("release"), "{}", info.nvcc_version);
            // every module has at least one kernel
            for (name, ptx) in MODULES {
                assert!(!entry_names(ptx).is_empty(), "module {name} has no .entry");
            }
        }
    }
}
