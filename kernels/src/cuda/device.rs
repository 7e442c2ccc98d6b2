//! Opening a GPU: library probing, the context and its stream, kernel modules, checked allocation and copies.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use half::bf16;

use super::nvrtc::{self, KernelModule};
use super::{driver_err, CudaError, Result};

/// A storage type for activations and weights: kernels exist for each, named `<kernel>_<NAME>`; they compute in f32.
pub trait Elem: DeviceRepr + ValidAsZeroBits + Copy + Default + Unpin + Send + Sync + 'static {
    /// The kernel-name suffix (`f32`, `bf16`).
    const NAME: &'static str;
    /// Rounds an f32 to this type (round to nearest even for bf16, as the kernels do).
    fn from_f32(x: f32) -> Self;
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Fills `len` elements at `ptr` with a quiet NaN, in stream order.
    ///
    /// # Safety
    /// `ptr` must point to at least `len` elements of this type on the stream's device.
    unsafe fn memset_nan(ptr: sys::CUdeviceptr, len: usize, stream: sys::CUstream) -> sys::CUresult;
}

impl Elem for f32 {
    const NAME: &'static str = "f32";
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    unsafe fn memset_nan(ptr: sys::CUdeviceptr, len: usize, stream: sys::CUstream) -> sys::CUresult {
        sys::cuMemsetD32Async(ptr, 0x7fc0_0000, len, stream)
    }
}

impl Elem for bf16 {
    const NAME: &'static str = "bf16";
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    unsafe fn memset_nan(ptr: sys::CUdeviceptr, len: usize, stream: sys::CUstream) -> sys::CUresult {
        sys::cuMemsetD16Async(ptr, 0x7fc0, len, stream)
    }
}

/// Runs `f`, turning a panic (cudarc panics when a symbol or library it expects is missing) into `Unavailable`.
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("panic");
        CudaError::Unavailable(format!("{what}: {msg}"))
    })
}

const LIB_HINT: &str = "install the NVIDIA driver and CUDA 13 libraries, and put their directories \
                        (e.g. /usr/local/cuda/lib64) on LD_LIBRARY_PATH";

/// Checks that the CUDA driver library can be opened, without calling into it.
pub(crate) fn probe_driver() -> Result<()> {
    // SAFETY: only tries to dlopen the library under its usual names.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Unavailable(format!(
            "the CUDA driver library (libcuda.so) cannot be loaded: no NVIDIA driver on this machine? ({LIB_HINT})"
        )))
    }
}

/// Checks that NVRTC can be opened.
pub(crate) fn probe_nvrtc() -> Result<()> {
    // SAFETY: only tries to dlopen the library under its usual names.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Unavailable(format!(
            "NVRTC (libnvrtc.so.13) cannot be loaded ({LIB_HINT})"
        )))
    }
}

/// Number of CUDA devices; `Unavailable` when there is no driver (never panics).
pub fn device_count() -> Result<usize> {
    probe_driver()?;
    let n = guarded("counting CUDA devices", CudaContext::device_count)?;
    match n {
        Ok(n) => Ok(n.max(0) as usize),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => Ok(0),
        Err(e) => Err(CudaError::Unavailable(format!(
            "the CUDA driver failed to initialise: {e}"
        ))),
    }
}

/// How one kernel module was obtained when the device opened.
#[derive(Clone, Debug)]
pub struct ModuleReport {
    /// Module (source file) name.
    pub name: &'static str,
    /// Target it was built for (`sm_90`, or `compute_XY` PTX when NVRTC does not know the device).
    pub arch: String,
    /// Whether the image came from the on-disk cache.
    pub cached: bool,
    /// Seconds spent compiling (or reading the cache) and loading.
    pub seconds: f64,
}

/// A device's shared memory, as its driver reports it: what sizes the blocks of kernels that fill an SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedLimits {
    /// The most dynamic shared memory one block may opt in to (Hopper and B200 / B300: 227 KiB; A100: 163 KiB).
    pub per_block: usize,
    /// Shared memory of one SM (Hopper and B200 / B300: 228 KiB).
    pub per_sm: usize,
    /// What each resident block also takes of the SM's (1 KiB since sm_80).
    pub reserved_per_block: usize,
}

impl SharedLimits {
    /// Hopper's (H100, H200), for host-side planning and tests without a device.
    pub const HOPPER: SharedLimits = SharedLimits {
        per_block: 227 * 1024,
        per_sm: 228 * 1024,
        reserved_per_block: 1024,
    };
}

/// One GPU: its context, the stream all work is ordered on, and the compiled kernels.
///
/// All work goes through one non-blocking stream, so ordering between kernels, copies and frees is stream order;
/// cudarc's per-buffer event tracking is switched off for this context (it only matters across streams and would add
/// event calls to every launch and to graph capture).
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    arch: (u32, u32),
    sm_count: usize,
    shared: SharedLimits,
    functions: HashMap<String, CudaFunction>,
    modules: Vec<ModuleReport>,
    sync_each_launch: bool,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal())
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish()
    }
}

impl CudaDevice {
    /// Opens device `ordinal` and compiles (or loads from the NVRTC cache) every kernel module for its architecture.
    ///
    /// Without a driver, NVRTC or such a device this is [`CudaError::Unavailable`]. Setting `REWIND_CUDA_SYNC=1`
    /// synchronises after every launch, so that an asynchronous fault is reported by the launch that caused it.
    pub fn open(ordinal: usize) -> Result<Self> {
        Self::open_with(ordinal, nvrtc::MODULES)
    }

    /// [`CudaDevice::open`] with an explicit list of kernel modules.
    pub fn open_with(ordinal: usize, modules: &[KernelModule]) -> Result<Self> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::Unavailable(format!(
                "no CUDA device {ordinal}: {count} device(s) visible"
            )));
        }
        probe_nvrtc()?;
        let ctx = guarded("creating the CUDA context", || CudaContext::new(ordinal))?
            .map_err(|e| CudaError::Unavailable(format!("cannot create a context on CUDA device {ordinal}: {e}")))?;
        // SAFETY: this context's buffers are only used on the one stream created below (see the type's docs).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver_err("creating the stream"))?;
        let name = ctx.name().map_err(driver_err("reading the device name"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_err("reading the compute capability"))?;
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_err("reading the multiprocessor count"))?
            .max(1) as usize;
        let attr = |a, what: &str| {
            ctx.attribute(a)
                .map_err(driver_err(format!("reading the {what}")))
                .map(|v| v.max(0) as usize)
        };
        use cudarc::driver::sys::CUdevice_attribute as A;
        let shared = SharedLimits {
            per_block: attr(
                A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "opt-in shared memory per block",
            )?,
            per_sm: attr(
                A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                "shared memory per multiprocessor",
            )?,
            reserved_per_block: attr(
                A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
                "shared memory reserved per block",
            )?,
        };
        let mut dev = Self {
            ctx,
            stream,
            name,
            arch: (major as u32, minor as u32),
            sm_count,
            shared,
            functions: HashMap::new(),
            modules: Vec::new(),
            sync_each_launch: std::env::var("REWIND_CUDA_SYNC").is_ok_and(|v| v == "1"),
        };
        for m in modules {
            dev.load_module(m)?;
        }
        Ok(dev)
    }

    fn load_module(&mut self, module: &KernelModule) -> Result<()> {
        let t0 = Instant::now();
        let image = nvrtc::compile_cached(module, self.arch)?;
        let loaded = match self.ctx.load_module(image.to_ptx()) {
            Ok(m) => m,
            Err(e) if image.cached => {
                // A damaged or stale cache entry: rebuild it once before giving up.
                let fresh = nvrtc::compile_fresh(module, &image.arch)?;
                self.ctx.load_module(fresh.to_ptx()).map_err(driver_err(format!(
                    "loading module {} (cache entry rejected: {e})",
                    module.name
                )))?
            }
            Err(e) => return Err(driver_err(format!("loading module {}", module.name))(e)),
        };
        for f in module.function_names() {
            let func = loaded
                .load_function(&f)
                .map_err(driver_err(format!("finding kernel {f} in module {}", module.name)))?;
            self.functions.insert(f, func);
        }
        self.modules.push(ModuleReport {
            name: module.name,
            arch: image.arch.clone(),
            cached: image.cached,
            seconds: t0.elapsed().as_secs_f64(),
        });
        Ok(())
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability `(major, minor)`.
    pub fn arch(&self) -> (u32, u32) {
        self.arch
    }

    /// Streaming multiprocessors (sizes persistent grids).
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// Shared memory per block and per SM, as the driver reports them.
    pub fn shared_limits(&self) -> SharedLimits {
        self.shared
    }

    /// How each kernel module was built when the device opened.
    pub fn modules(&self) -> &[ModuleReport] {
        &self.modules
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream all of this device's work runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A loaded kernel by its full name (`rms_norm_bf16`).
    pub fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| CudaError::MissingKernel(name.to_string()))
    }

    /// Whether every launch is followed by a synchronisation (`REWIND_CUDA_SYNC=1`).
    pub fn sync_each_launch(&self) -> bool {
        self.sync_each_launch
    }

    /// Waits for all queued work; reports any asynchronous error (a faulting kernel) with `context`.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver_err("synchronising the stream"))?;
        self.ctx.check_err().map_err(driver_err("an earlier asynchronous call"))
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(driver_err("reading memory info"))
    }

    /// Allocates `len` elements; the contents are undefined (see [`CudaDevice::alloc_nan`]).
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: the memory is uninitialised; every kernel writes its outputs before they are read.
        unsafe { self.stream.alloc::<T>(len) }.map_err(driver_err(format!(
            "allocating {len} × {} bytes",
            std::mem::size_of::<T>()
        )))
    }

    /// Allocates `len` zeroed elements.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(len).map_err(driver_err(format!(
            "allocating {len} × {} bytes",
            std::mem::size_of::<T>()
        )))
    }

    /// Allocates `len` elements filled with NaN.
    pub fn alloc_nan<T: Elem>(&self, len: usize) -> Result<CudaSlice<T>> {
        let mut buf = self.alloc::<T>(len)?;
        self.fill_nan(&mut buf)?;
        Ok(buf)
    }

    /// Overwrites every element with NaN (poisoning an output before a kernel writes it).
    pub fn fill_nan<T: Elem>(&self, buf: &mut impl DevicePtrMut<T>) -> Result<()> {
        let len = buf.len();
        let (ptr, _guard) = buf.device_ptr_mut(&self.stream);
        // SAFETY: `ptr` addresses `len` elements of `T` owned by `buf`, on this stream.
        unsafe { T::memset_nan(ptr, len, self.stream.cu_stream()) }
            .result()
            .map_err(driver_err("filling a buffer with NaN"))
    }

    /// Copies host data into a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.stream
            .clone_htod(data)
            .map_err(driver_err(format!("copying {} elements to the device", data.len())))
    }

    /// Copies host data into an existing buffer of the same length.
    pub fn upload_into<T: DeviceRepr>(&self, data: &[T], dst: &mut CudaSlice<T>) -> Result<()> {
        super::check_len("upload_into", "dst", dst.len(), data.len())?;
        self.stream
            .memcpy_htod(data, dst)
            .map_err(driver_err(format!("copying {} elements to the device", data.len())))
    }

    /// Copies a device buffer back to the host (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(&self, src: &impl DevicePtr<T>) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len()];
        self.stream
            .memcpy_dtoh(src, &mut out)
            .map_err(driver_err(format!("copying {} elements to the host", src.len())))?;
        self.synchronize()?;
        Ok(out)
    }

    /// Uploads f32 values stored as `T`.
    pub fn upload_as<T: Elem>(&self, data: &[f32]) -> Result<CudaSlice<T>> {
        let v: Vec<T> = data.iter().map(|&x| T::from_f32(x)).collect();
        self.upload(&v)
    }

    /// Downloads `T` values widened to f32.
    pub fn download_f32<T: Elem>(&self, src: &impl DevicePtr<T>) -> Result<Vec<f32>> {
        Ok(self.download(src)?.into_iter().map(T::to_f32).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half() {
        for &x in &[1.0f32, -3.140_625, 1.0 + 1.0 / 256.0, 65504.0, 1e-30, f32::INFINITY] {
            assert_eq!(<bf16 as Elem>::from_f32(x).to_bits(), bf16::from_f32(x).to_bits());
        }
        assert!(<bf16 as Elem>::from_f32(f32::NAN).to_f32().is_nan());
    }

    /// Without a driver (CI) opening a device is an `Unavailable` error, never a panic; with one it must succeed or
    /// fail for a stated reason.
    #[test]
    fn open_reports_unavailable_without_a_driver() {
        match CudaDevice::open(0) {
            Ok(dev) => assert!(!dev.name().is_empty()),
            Err(CudaError::Unavailable(msg)) => assert!(!msg.is_empty()),
            Err(e) => {
                assert!(
                    probe_driver().is_ok(),
                    "without a driver the error must be Unavailable, got {e}"
                );
            }
        }
        if probe_driver().is_err() {
            assert!(matches!(device_count(), Err(CudaError::Unavailable(_))));
            let err = CudaDevice::open(0).unwrap_err();
            assert!(err.to_string().contains("libcuda"), "{err}");
        }
    }
}
