//! The kernel modules compiled by `build.rs` from `kernels/*.cu` (each as PTX
//! and, unless built with `INFERNIX_CUBIN=0`, as a cubin assembled from that
//! PTX), and the toolchain record that came with them (nvcc version, target
//! arch, SHA-256 of the kernel sources, together and per file). This module
//! only exposes the generated constants.

/// One kernel module (`kernels/<name>.cu`) as build.rs embedded it.
#[derive(Debug, Clone, Copy)]
pub struct Module {
    /// The file stem, e.g. `attention_sm90a`.
    pub name: &'static str,
    /// The PTX text (what the kernel names are read from; the JIT's input).
    pub ptx: &'static str,
    /// The same PTX assembled by nvcc for `sm_<cubin_arch>`; empty when not built.
    pub cubin: &'static [u8],
    /// The compute capability the PTX targets and the cubin runs on, e.g. "90a".
    pub cubin_arch: &'static str,
}

impl Module {
    /// Whether the cubin runs on a GPU of compute capability `cc` (a cubin runs on its
    /// own compute capability; an `a` target such as 90a on exactly that one).
    pub fn cubin_runs_on(&self, cc: (i32, i32)) -> bool {
        !self.cubin.is_empty() && self.cubin_arch.trim_end_matches('a') == format!("{}{}", cc.0, cc.1)
    }
}

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
    /// Number of modules embedded.
    pub n_modules: usize,
    /// Number of them with a cubin embedded beside the PTX.
    pub n_cubins: usize,
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
        n_cubins: MODULES.iter().filter(|m| !m.cubin.is_empty()).count(),
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
            for m in MODULES {
                assert!(!entry_names(m.ptx).is_empty(), "module {} has no .entry", m.name);
                // a cubin is an ELF image for the PTX's own target
                if !m.cubin.is_empty() {
                    assert_eq!(&m.cubin[..4], b"\x7fELF", "module {}", m.name);
                }
            }
        }
    }

    #[test]
    fn cubin_matches_only_its_own_compute_capability() {
        let m = |arch| Module { name: "m", ptx: "", cubin: b"\x7fELF", cubin_arch: arch };
        assert!(m("90a").cubin_runs_on((9, 0)));
        assert!(m("90").cubin_runs_on((9, 0)));
        assert!(!m("90a").cubin_runs_on((10, 0)));
        assert!(!m("90").cubin_runs_on((8, 9)));
        assert!(!Module { cubin: &[], ..m("90") }.cubin_runs_on((9, 0)));
    }
}
