//! The CUDA device: driver probe, context and stream on one GPU chosen by
//! index, and every embedded kernel module loaded when the device is opened
//! (its cubin where it was assembled for this GPU's compute capability, else
//! its PTX, JIT-compiled by the driver), so a bad module fails before any work.
//!
//! This module owns the only calls that create driver state; it does not know
//! about ops (see `ops`) or buffers (see `buffer`). One stream per device: all
//! launches and copies are ordered on it.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream};
use cudarc::nvrtc::Ptx;

use super::ptx::{self, build_info, KernelBuildInfo};

/// The message of every CUDA entry point in a binary built without nvcc.
pub const NO_KERNELS: &str = "CUDA backend unavailable: this binary was built without CUDA kernels \
     (nvcc was not found at build time; set NVCC or CUDA_HOME and rebuild)";

/// Module-name suffix of the PTX built for compute_90a (build.rs's `SM90A_SUFFIX`).
pub const SM90A_MODULE_SUFFIX: &str = "_sm90a";

/// True when the CUDA driver library (libcuda) can be loaded. Calls nothing
/// else in the driver, so it is safe on a machine without one.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda under its usual names; no driver call is made.
    unsafe { sys::is_culib_present() }
}

/// The driver library, or the error every CUDA entry point gives without one.
fn require_driver() -> Result<()> {
    if !ptx::KERNELS_BUILT {
        bail!(NO_KERNELS);
    }
    if !driver_present() {
        bail!("no CUDA driver found (libcuda.so could not be loaded); use --backend cpu");
    }
    Ok(())
}

/// Number of CUDA devices; an error (not a panic) without kernels or driver.
pub fn device_count() -> Result<usize> {
    require_driver()?;
    let n = CudaContext::device_count().map_err(|e| anyhow!("cuDeviceGetCount: {e}"))?;
    Ok(n.max(0) as usize)
}

/// The driver's CUDA version as (major, minor); requires the driver.
pub fn driver_version() -> Result<(i32, i32)> {
    require_driver()?;
    let mut v = 0i32;
    // SAFETY: the library is present (checked above); cuDriverGetVersion writes one int.
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(|e| anyhow!("cuDriverGetVersion: {e}"))?;
    Ok((v / 1000, (v % 1000) / 10))
}

/// What we know about the opened GPU.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_mem_bytes: usize,
    pub n_sms: i32,
    /// Opt-in shared memory per block (bytes).
    pub max_smem_per_block_bytes: i32,
    pub driver_version: (i32, i32),
    pub kernels: KernelBuildInfo,
    /// Modules loaded from their cubin (the rest were JIT-compiled from PTX).
    pub n_modules_from_cubin: usize,
    /// Modules loaded in all.
    pub n_modules_loaded: usize,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GPU {} {} (sm_{}{}, {} SMs, {:.1} GiB), driver CUDA {}.{}, kernels compute_{} from nvcc {}",
            self.index,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.n_sms,
            self.total_mem_bytes as f64 / (1u64 << 30) as f64,
            self.driver_version.0,
            self.driver_version.1,
            self.kernels.arch,
            self.kernels.nvcc_version
        )
    }
}

/// Lets the device's default memory pool (the one `cuMemAllocAsync` draws
/// from) keep freed memory instead of returning it to the driver at every
/// synchronization: the backend allocates and frees its activations per op,
/// and with the default release threshold of 0 each window's first
/// allocations would go back to the driver after the host waited.
fn keep_pool_memory(ctx: &CudaContext) -> Result<()> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the context is current on this thread (CudaContext::new binds it);
    // the call writes one pool handle.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .map_err(|e| anyhow!("cuDeviceGetDefaultMemPool: {e}"))?;
    let mut threshold = u64::MAX;
    // SAFETY: the release threshold attribute takes a pointer to a cuuint64_t,
    // read during the call.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
    .map_err(|e| anyhow!("cuMemPoolSetAttribute(release threshold): {e}"))?;
    Ok(())
}

/// One GPU with its stream and every kernel loaded.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<String, CudaFunction>,
    info: DeviceInfo,
    /// `--reproducible`: every bf16 matmul on one kernel whatever its M
    /// (`ops::bf16_kernel_for`), so a row's bits do not depend on the pass.
    one_gemm_kernel: bool,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice").field("info", &self.info).field("n_kernels", &self.functions.len()).finish()
    }
}

impl CudaDevice {
    /// Opens GPU `index`: probes the driver first (an error, not a panic,
    /// without one), checks the compute capability against the kernels' arch
    /// and loads every PTX module.
    pub fn open(index: usize) -> Result<Self> {
        require_driver()?;
        let n = device_count()?;
        if index >= n {
            bail!("CUDA device {index} requested but the driver reports {n} device(s)");
        }
        let driver_version = driver_version()?;
        let ctx = CudaContext::new(index).map_err(|e| anyhow!("creating a context on CUDA device {index}: {e}"))?;
        // SAFETY: this backend uses one stream per context, so cudarc's
        // cross-stream event tracking is not needed; all work is ordered on `stream`.
        unsafe { ctx.disable_event_tracking() };
        let attr = |a: sys::CUdevice_attribute, what: &str| {
            ctx.attribute(a).map_err(|e| anyhow!("reading {what} of CUDA device {index}: {e}"))
        };
        let cc = (
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "compute capability")?,
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "compute capability")?,
        );
        let mut info = DeviceInfo {
            index,
            name: ctx.name().map_err(|e| anyhow!("reading the name of CUDA device {index}: {e}"))?,
            compute_capability: cc,
            total_mem_bytes: ctx.total_mem().map_err(|e| anyhow!("reading memory of CUDA device {index}: {e}"))?,
            n_sms: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "SM count")?,
            max_smem_per_block_bytes: attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "shared memory per block",
            )?,
            driver_version,
            kernels: build_info(),
            n_modules_from_cubin: 0,
            n_modules_loaded: 0,
        };
        let arch_num: i32 = info.kernels.arch.trim_end_matches('a').parse().unwrap_or(0);
        if cc.0 * 10 + cc.1 < arch_num {
            bail!(
                "CUDA device {index} ({}) has compute capability {}.{}, below the kernels' target compute_{} \
                 (rebuild with INFERNIX_CUDA_ARCH={}{})",
                info.name,
                cc.0,
                cc.1,
                info.kernels.arch,
                cc.0,
                cc.1
            );
        }
        keep_pool_memory(&ctx).with_context(|| format!("CUDA device {index}"))?;
        let stream = ctx.default_stream();
        let mut functions = HashMap::new();
        for m in ptx::MODULES {
            let module_name = m.name;
            // compute_90a PTX (wgmma) runs on compute capability 9.0 alone; elsewhere the
            // launchers fall back to the portable kernels (`has_function` says which exist).
            if module_name.ends_with(SM90A_MODULE_SUFFIX) && cc != (9, 0) {
                continue;
            }
            // The cubin is this PTX assembled ahead of time; a driver that refuses it still
            // gets the PTX (the same code, JIT-compiled), so only the load time differs.
            let from_cubin = if m.cubin_runs_on(cc) {
                match ctx.load_module(Ptx::from_binary(m.cubin.to_vec())) {
                    Ok(module) => Some(module),
                    Err(e) => {
                        tracing::warn!("CUDA module {module_name}: its sm_{} cubin did not load ({e}); JIT-compiling its PTX", m.cubin_arch);
                        None
                    }
                }
            } else {
                None
            };
            info.n_modules_loaded += 1;
            if from_cubin.is_some() {
                info.n_modules_from_cubin += 1;
            }
            let loaded = match from_cubin {
                Some(module) => Ok(module),
                None => ctx.load_module(Ptx::from_src(m.ptx)),
            };
            let module = loaded.map_err(|e| {
                anyhow!(
                    "loading CUDA module {module_name}.ptx on {} (sm_{}{}): {e}; driver CUDA {}.{}, \
                     PTX for compute_{} from nvcc {} (kernel sources sha256 {})",
                    info.name,
                    cc.0,
                    cc.1,
                    driver_version.0,
                    driver_version.1,
                    info.kernels.arch,
                    info.kernels.nvcc_version,
                    info.kernels.sources_sha256
                )
            })?;
            for entry in ptx::entry_names(m.ptx) {
                let f = module
                    .load_function(entry)
                    .map_err(|e| anyhow!("loading kernel {entry} from module {module_name}: {e}"))?;
                functions.insert(entry.to_string(), f);
            }
        }
        Ok(Self { ctx, stream, functions, info, one_gemm_kernel: false })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// `--reproducible`: from now on `ops::bf16_kernel_for` picks mma.sync for
    /// every product, whatever its M (no switch to wgmma at M >= 128).
    pub fn pin_one_gemm_kernel(&mut self) {
        self.one_gemm_kernel = true;
    }

    /// Whether [`CudaDevice::pin_one_gemm_kernel`] was called.
    pub fn one_gemm_kernel(&self) -> bool {
        self.one_gemm_kernel
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A loaded kernel by its `extern "C"` name.
    pub fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions.get(name).ok_or_else(|| {
            anyhow!("CUDA kernel {name} is not in the embedded PTX modules (kernels sha256 {})", self.info.kernels.sources_sha256)
        })
    }

    /// True when kernel `name` was loaded (the sm_90a modules only load on sm_90).
    pub fn has_function(&self, name: &str) -> bool {
        self.functions.contains_key(name)
    }

    /// Names of every loaded kernel, sorted.
    pub fn kernel_names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.functions.keys().map(|s| s.as_str()).collect();
        v.sort_unstable();
        v
    }

    /// Waits for all queued work; surfaces asynchronous kernel errors.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| anyhow!("CUDA stream synchronize on GPU {}: {e}", self.info.index))
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().context("cuMemGetInfo")
    }
}
