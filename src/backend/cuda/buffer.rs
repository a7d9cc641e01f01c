//! Device memory: `DeviceBuffer<T>` (an owned allocation of `len` elements),
//! borrowed views `DevView` / `DevViewMut` (a sub-range, passed to kernels as
//! a raw device address), and `QuantMatrix` (a weight matrix kept in its
//! stored block format, rows of `n_cols` elements).
//!
//! This module owns allocation, its high-water marks and host <-> device copies; kernels see only
//! addresses and lengths, checked by the launchers in `ops`.

use std::marker::PhantomData;
use std::ops::Range;

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, ValidAsZeroBits};

use super::device::CudaDevice;
use crate::artifact::format::TensorFormat;

/// Element types the kernels read and write, with the suffix their kernel names use.
pub trait Elem: DeviceRepr + ValidAsZeroBits + Copy + Default + 'static {
    const NAME: &'static str;
}
impl Elem for f32 {
    const NAME: &'static str = "f32";
}
impl Elem for half::bf16 {
    const NAME: &'static str = "bf16";
}
impl Elem for f64 {
    const NAME: &'static str = "f64";
}
impl Elem for i32 {
    const NAME: &'static str = "i32";
}
impl Elem for u8 {
    const NAME: &'static str = "u8";
}
impl Elem for u64 {
    const NAME: &'static str = "u64";
}

/// An owned device allocation of `len()` elements of `T`.
pub struct DeviceBuffer<T: Elem> {
    slice: CudaSlice<T>,
}

impl<T: Elem> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer<{}>[{}]", T::NAME, self.len())
    }
}

/// A borrowed, read-only range of a device buffer.
#[derive(Clone, Copy)]
pub struct DevView<'a, T> {
    ptr: u64,
    len: usize,
    _borrow: PhantomData<&'a T>,
}

/// A borrowed, writable range of a device buffer.
pub struct DevViewMut<'a, T> {
    ptr: u64,
    len: usize,
    _borrow: PhantomData<&'a mut T>,
}

impl<'a, T> DevView<'a, T> {
    /// The sub-range [start, start + len).
    pub fn sub(self, start: usize, len: usize) -> Result<DevView<'a, T>> {
        check_range(&(start..start + len), self.len)?;
        Ok(DevView { ptr: self.ptr + (start * size_of::<T>()) as u64, len, _borrow: PhantomData })
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device address (what kernels receive).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl<'a, T> DevViewMut<'a, T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// A read-only view of the same range (for an in-place op's input).
    pub fn as_view(&self) -> DevView<'_, T> {
        DevView { ptr: self.ptr, len: self.len, _borrow: PhantomData }
    }
    /// Re-borrows a sub-range.
    pub fn slice_mut(&mut self, range: Range<usize>) -> Result<DevViewMut<'_, T>> {
        check_range(&range, self.len)?;
        Ok(DevViewMut { ptr: self.ptr + (range.start * size_of::<T>()) as u64, len: range.len(), _borrow: PhantomData })
    }
}

fn check_range(range: &Range<usize>, len: usize) -> Result<()> {
    if range.start > range.end || range.end > len {
        bail!("device range {}..{} out of bounds for a buffer of {len} elements", range.start, range.end);
    }
    Ok(())
}

impl<T: Elem> DeviceBuffer<T> {
    pub fn len(&self) -> usize {
        self.slice.len()
    }
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }
    pub fn size_bytes(&self) -> usize {
        self.slice.len() * size_of::<T>()
    }
    fn base(&self) -> u64 {
        let (ptr, _sync) = self.slice.device_ptr(self.slice.stream());
        ptr
    }
    pub fn view(&self) -> DevView<'_, T> {
        DevView { ptr: self.base(), len: self.len(), _borrow: PhantomData }
    }
    pub fn view_mut(&mut self) -> DevViewMut<'_, T> {
        DevViewMut { ptr: self.base(), len: self.len(), _borrow: PhantomData }
    }
    pub fn slice(&self, range: Range<usize>) -> Result<DevView<'_, T>> {
        check_range(&range, self.len())?;
        Ok(DevView { ptr: self.base() + (range.start * size_of::<T>()) as u64, len: range.len(), _borrow: PhantomData })
    }
    pub fn slice_mut(&mut self, range: Range<usize>) -> Result<DevViewMut<'_, T>> {
        check_range(&range, self.len())?;
        let ptr = self.base() + (range.start * size_of::<T>()) as u64;
        Ok(DevViewMut { ptr, len: range.len(), _borrow: PhantomData })
    }
}

impl CudaDevice {
    /// A new buffer holding a copy of `host`.
    pub fn upload<T: Elem>(&self, host: &[T]) -> Result<DeviceBuffer<T>> {
        let slice = self.stream().clone_htod(host).map_err(|e| {
            anyhow!("copying {} x {} ({} bytes) to the GPU: {e}", host.len(), T::NAME, std::mem::size_of_val(host))
        })?;
        Ok(DeviceBuffer { slice })
    }

    /// A new zero-filled buffer of `len` elements.
    pub fn alloc_zeros<T: Elem>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let slice = self
            .stream()
            .alloc_zeros::<T>(len)
            .map_err(|e| anyhow!("allocating {len} x {} ({} bytes) on the GPU: {e}", T::NAME, len * size_of::<T>()))?;
        Ok(DeviceBuffer { slice })
    }

    /// A new buffer of `len` elements whose contents are unspecified (every
    /// caller writes all of it before reading; no memset is queued).
    pub fn alloc_uninit<T: Elem>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        // SAFETY: the memory is only ever read after a kernel or copy wrote it
        // (each op allocates its output and fully writes it); T is plain data.
        let slice = unsafe { self.stream().alloc::<T>(len) }
            .map_err(|e| anyhow!("allocating {len} x {} ({} bytes) on the GPU: {e}", T::NAME, len * size_of::<T>()))?;
        Ok(DeviceBuffer { slice })
    }

    /// Copies `host` into the start of `dst` (which must be at least as long).
    pub fn copy_to_device<T: Elem>(&self, host: &[T], dst: &mut DeviceBuffer<T>) -> Result<()> {
        if host.len() > dst.len() {
            bail!("copy of {} x {} into a device buffer of {}", host.len(), T::NAME, dst.len());
        }
        self.stream()
            .memcpy_htod(host, &mut dst.slice)
            .map_err(|e| anyhow!("copying {} x {} to the GPU: {e}", host.len(), T::NAME))
    }

    /// Copies a whole buffer back (waits for queued work first and surfaces its errors).
    pub fn download<T: Elem>(&self, buf: &DeviceBuffer<T>) -> Result<Vec<T>> {
        let host = self
            .stream()
            .clone_dtoh(&buf.slice)
            .map_err(|e| anyhow!("copying {} x {} from the GPU: {e}", buf.len(), T::NAME))?;
        self.synchronize()?;
        Ok(host)
    }

    /// Copies `range` of a buffer back (waits for queued work first).
    pub fn download_range<T: Elem>(&self, buf: &DeviceBuffer<T>, range: Range<usize>) -> Result<Vec<T>> {
        check_range(&range, buf.len())?;
        let view = buf.slice.slice(range.clone());
        let host = self
            .stream()
            .clone_dtoh(&view)
            .map_err(|e| anyhow!("copying {}..{} of {} x {} from the GPU: {e}", range.start, range.end, buf.len(), T::NAME))?;
        self.synchronize()?;
        Ok(host)
    }
}

impl CudaDevice {
    /// The high-water marks of the device's default memory pool, the one every
    /// `DeviceBuffer` is drawn from (`cuMemAllocAsync`): (bytes held by live
    /// allocations at most, bytes the pool reserved from the driver at most), since
    /// this process opened the device.
    pub fn pool_high_water(&self) -> Result<(u64, u64)> {
        use cudarc::driver::sys;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        self.context().bind_to_thread().map_err(|e| anyhow!("binding the CUDA context: {e}"))?;
        // SAFETY: the context is current on this thread (bound above); the call writes one handle.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.context().cu_device()) }
            .result()
            .map_err(|e| anyhow!("cuDeviceGetDefaultMemPool: {e}"))?;
        let get = |attr: sys::CUmemPool_attribute| -> Result<u64> {
            let mut v = 0u64;
            // SAFETY: the USED/RESERVED_MEM_HIGH attributes write one cuuint64_t.
            unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) }
                .result()
                .map_err(|e| anyhow!("cuMemPoolGetAttribute({attr:?}): {e}"))?;
            Ok(v)
        };
        Ok((get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?, get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?))
    }
}

/// A weight matrix on the device in its stored format: (n_rows, n_cols)
/// logical elements, `row_bytes` bytes per row, never expanded.
#[derive(Debug)]
pub struct QuantMatrix {
    pub data: DeviceBuffer<u8>,
    pub format: TensorFormat,
    pub n_rows: usize,
    pub n_cols: usize,
    pub row_bytes: usize,
}

impl QuantMatrix {
    /// Uploads `bytes` (n_rows rows of n_cols elements in `format`). The
    /// kernels need n_cols % 32 == 0.
    pub fn upload(dev: &CudaDevice, format: TensorFormat, n_rows: usize, n_cols: usize, bytes: &[u8]) -> Result<Self> {
        if n_cols % 32 != 0 {
            bail!("{format} matrix ({n_rows}, {n_cols}): the CUDA kernels need a row length that is a multiple of 32");
        }
        let row_bytes = format.row_bytes(n_cols)?;
        if bytes.len() != n_rows * row_bytes {
            bail!(
                "{format} matrix ({n_rows}, {n_cols}) needs {} bytes ({row_bytes} per row), got {}",
                n_rows * row_bytes,
                bytes.len()
            );
        }
        let data = dev.upload(bytes)?;
        Ok(Self { data, format, n_rows, n_cols, row_bytes })
    }

    /// The lower-case format suffix of the kernel names (`q4_k`, `iq4_nl`, ...).
    pub fn kernel_suffix(&self) -> String {
        self.format.name().to_ascii_lowercase()
    }
}
