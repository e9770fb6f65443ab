//! CUDA through the driver API, opened at run time: the stream-ordered pool
//! allocator, the thread's current device, and device copies.
//!
//! **No link-time CUDA dependency.** `libcuda.so.1` is opened with
//! `dlopen(RTLD_NOW | RTLD_LOCAL)` on first use (an allocation, a copy or a
//! guard on a CUDA device), so the shim loads and serves host memory on a
//! machine without CUDA; there every CUDA call fails with
//! `shim.cuda_unavailable`. `TCG_SHIM_LIBCUDA` names another library to open
//! instead (for tests of that path, and for drivers installed elsewhere).
//! Everything works in each device's *primary* context, the one the CUDA
//! runtime, libtorch and the compiled graph use.
//!
//! **The allocator.** [`CudaAllocator`] takes blocks from one memory pool per
//! device, created by the shim (`cuMemPoolCreate`, not the device's default
//! pool, so a libtorch in the same process keeps its own settings), with a
//! release threshold of `u64::MAX`: freed memory stays in the pool and is
//! reused by the next allocation instead of going back to the driver.
//! Allocation is `cuMemAllocFromPoolAsync` on the stream that is current when
//! the storage is made; free is `cuMemFreeAsync` on that same stream, so no
//! free ever synchronises the device or the host.
//!
//! **Capture.** While the allocation stream is capturing a CUDA graph, the
//! driver records `cuMemAllocFromPoolAsync` as a graph memory node: the block
//! belongs to the graph (its virtual address is fixed for the graph's
//! lifetime), it is not taken from the pool, and nothing else is ever given
//! that address while the graph exists. The rules for frees:
//!
//! - a block allocated in a capture and freed in the same capture becomes a
//!   free node of the graph (the intermediates of a captured run);
//! - a block allocated in a capture and freed after it ended (outside the
//!   graph) is freed with `cuMemFreeAsync` on its stream: legal once the
//!   graph has been launched; tcg-run's captures instantiate with
//!   `AutoFreeOnLaunch` and keep the outputs of the capture for the graph's
//!   life (`crates/tcg-run/src/capture.rs`), destroying them only with it;
//! - any other free while the stream is capturing (a block from outside the
//!   capture, or from another capture) is *deferred*: recording it would make
//!   every replay free it again. It is freed on its own stream by the first
//!   allocator call that finds that stream no longer capturing.
//!
//! A failed free cannot be reported (it runs in a destructor); it is counted
//! in [`CudaStats::free_failures`].

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

use crate::alloc::{Allocator, Stream};
use crate::dtype::{Device, DeviceType};
use crate::error::ShimError;

/// The environment variable naming the driver library to open instead of
/// `libcuda.so.1`.
pub const LIBCUDA_ENV: &str = "TCG_SHIM_LIBCUDA";

/// The release threshold of the shim's pools: memory is never returned to
/// the driver between allocations.
pub const POOL_RELEASE_THRESHOLD: u64 = u64::MAX;

type CuResult = c_int;
type CuContext = *mut c_void;
type CuStream = *mut c_void;
type CuPool = *mut c_void;

const RTLD_NOW: c_int = 2;
const RTLD_LOCAL: c_int = 0;
const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
const CUDA_ERROR_INVALID_CONTEXT: CuResult = 201;
const MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
const MEM_LOCATION_TYPE_DEVICE: c_int = 1;
const MEMPOOL_ATTR_RELEASE_THRESHOLD: c_int = 4;
const MEMPOOL_ATTR_RESERVED_MEM_CURRENT: c_int = 5;
const MEMPOOL_ATTR_USED_MEM_CURRENT: c_int = 7;
const CAPTURE_STATUS_NONE: c_int = 0;
const CAPTURE_STATUS_ACTIVE: c_int = 1;

#[link(name = "dl")]
extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}

/// `CUmemPoolProps` (cuda.h): 88 bytes; the fields after the security
/// attributes (`maxSize`, `usage` in newer drivers) are zero, their defaults.
#[repr(C)]
struct MemPoolProps {
    alloc_type: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32_security_attributes: *mut c_void,
    reserved: [u8; 64],
}

/// How the capture-info function of this driver is called.
#[derive(Clone, Copy)]
enum CaptureInfo {
    /// `cuStreamGetCaptureInfo_v2(stream, status, id, graph, deps, ndeps)`.
    V2(
        unsafe extern "C" fn(
            CuStream,
            *mut c_int,
            *mut u64,
            *mut c_void,
            *mut c_void,
            *mut usize,
        ) -> CuResult,
    ),
    /// `cuStreamGetCaptureInfo(stream, status, id)` (the CUDA 11.0 ABI).
    V1(unsafe extern "C" fn(CuStream, *mut c_int, *mut u64) -> CuResult),
}

/// The driver entry points the shim calls.
pub struct Driver {
    handle: usize,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, c_int) -> CuResult,
    ctx_get_current: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_get_device: unsafe extern "C" fn(*mut c_int) -> CuResult,
    pool_create: unsafe extern "C" fn(*mut CuPool, *const MemPoolProps) -> CuResult,
    pool_set_attribute: unsafe extern "C" fn(CuPool, c_int, *mut c_void) -> CuResult,
    pool_get_attribute: unsafe extern "C" fn(CuPool, c_int, *mut c_void) -> CuResult,
    alloc_from_pool_async: unsafe extern "C" fn(*mut u64, usize, CuPool, CuStream) -> CuResult,
    free_async: unsafe extern "C" fn(u64, CuStream) -> CuResult,
    memcpy_async: unsafe extern "C" fn(u64, u64, usize, CuStream) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(CuStream) -> CuResult,
    capture_info: CaptureInfo,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver").finish_non_exhaustive()
    }
}

/// A symbol's address as the function pointer type `T`.
///
/// # Safety
///
/// `T` must be a function pointer type matching the symbol's C signature.
unsafe fn fn_from<T: Copy>(p: *mut c_void) -> T {
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: the caller's contract; sizes checked above.
    unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) }
}

fn dl_error_text() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by libc,
    // copied at once.
    let p = unsafe { dlerror() };
    if p.is_null() {
        "no error message".to_string()
    } else {
        // SAFETY: non-null and NUL-terminated (above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

impl Driver {
    /// Opens `library` (a file name the loader searches, or a path) and looks
    /// up every entry point; initialises the driver (`cuInit`) and requires
    /// at least one device.
    pub fn open(library: &str) -> Result<Driver, ShimError> {
        let unavailable = |reason: String| ShimError::CudaUnavailable { reason };
        let name = CString::new(library)
            .map_err(|_| unavailable(format!("{library:?} has a NUL byte")))?;
        // SAFETY: a NUL-terminated name; the NVIDIA driver's initialisers only
        // set up its own state.
        let handle = unsafe { dlopen(name.as_ptr(), RTLD_NOW | RTLD_LOCAL) };
        if handle.is_null() {
            return Err(unavailable(format!(
                "cannot load {library}: {}",
                dl_error_text()
            )));
        }
        let handle = handle as usize;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: `handle` is a live library handle; the symbol is
                // transmuted to the signature cuda.h declares for it (the
                // field's type), checked by the driver's documented ABI.
                let p = unsafe { Driver::raw_symbol(handle, $name) };
                if p.is_null() {
                    return Err(unavailable(format!(
                        "{library} lacks {}, which the shim needs",
                        $name
                    )));
                }
                // SAFETY: as above: a function of that signature.
                unsafe { fn_from(p) }
            }};
        }
        // SAFETY: looked up in a live handle; null is checked.
        let v2 = unsafe { Driver::raw_symbol(handle, "cuStreamGetCaptureInfo_v2") };
        let capture_info = if v2.is_null() {
            CaptureInfo::V1(sym!("cuStreamGetCaptureInfo"))
        } else {
            // SAFETY: cuStreamGetCaptureInfo_v2's signature since CUDA 11.3.
            CaptureInfo::V2(unsafe { fn_from(v2) })
        };
        let init: unsafe extern "C" fn(c_uint) -> CuResult = sym!("cuInit");
        let driver = Driver {
            handle,
            device_get_count: sym!("cuDeviceGetCount"),
            device_get: sym!("cuDeviceGet"),
            primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
            ctx_get_current: sym!("cuCtxGetCurrent"),
            ctx_set_current: sym!("cuCtxSetCurrent"),
            ctx_get_device: sym!("cuCtxGetDevice"),
            pool_create: sym!("cuMemPoolCreate"),
            pool_set_attribute: sym!("cuMemPoolSetAttribute"),
            pool_get_attribute: sym!("cuMemPoolGetAttribute"),
            alloc_from_pool_async: sym!("cuMemAllocFromPoolAsync"),
            free_async: sym!("cuMemFreeAsync"),
            memcpy_async: sym!("cuMemcpyAsync"),
            stream_synchronize: sym!("cuStreamSynchronize"),
            capture_info,
            get_error_name: sym!("cuGetErrorName"),
        };
        // SAFETY: flags must be 0.
        let rc = unsafe { init(0) };
        if rc != 0 {
            return Err(unavailable(format!(
                "cuInit failed: {} ({rc})",
                driver.error_name(rc)
            )));
        }
        let count = driver.device_count()?;
        if count <= 0 {
            return Err(unavailable("no CUDA device is visible".to_string()));
        }
        Ok(driver)
    }

    /// Looks up `name` in the driver library `handle`.
    ///
    /// # Safety
    ///
    /// `handle` must be a live handle from `dlopen`.
    unsafe fn raw_symbol(handle: usize, name: &str) -> *mut c_void {
        let Ok(c) = CString::new(name) else {
            return std::ptr::null_mut();
        };
        // SAFETY: the caller's contract; a NUL-terminated name.
        unsafe { dlsym(handle as *mut c_void, c.as_ptr()) }
    }

    /// Any driver function by name, for callers that need more of the driver
    /// than the shim does (the device tests create streams and graphs).
    ///
    /// # Safety
    ///
    /// `T` must be the function pointer type cuda.h declares for `name`.
    pub unsafe fn symbol<T: Copy>(&self, name: &str) -> Option<T> {
        // SAFETY: `handle` stays open for the process (never closed).
        let p = unsafe { Driver::raw_symbol(self.handle, name) };
        if p.is_null() {
            None
        } else {
            // SAFETY: the caller's contract on `T`.
            Some(unsafe { fn_from(p) })
        }
    }

    /// The `CUresult`'s name (`CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn error_name(&self, rc: CuResult) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: writes one pointer to a static string.
        let ok = unsafe { (self.get_error_name)(rc, &mut p) } == 0;
        if !ok || p.is_null() {
            return format!("CUresult {rc}");
        }
        // SAFETY: a static NUL-terminated string of the driver.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// `Ok` for `CUDA_SUCCESS`, else `shim.cuda_driver` with the name.
    pub fn check(&self, rc: CuResult, call: &'static str) -> Result<(), ShimError> {
        if rc == 0 {
            Ok(())
        } else {
            Err(ShimError::CudaDriver {
                call,
                result: rc,
                name: self.error_name(rc),
            })
        }
    }

    /// The number of visible devices.
    pub fn device_count(&self) -> Result<i32, ShimError> {
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        self.check(
            unsafe { (self.device_get_count)(&mut n) },
            "cuDeviceGetCount",
        )?;
        Ok(n)
    }
}

static DRIVER: OnceLock<Result<Driver, ShimError>> = OnceLock::new();

/// The process's driver, opened and initialised once (`libcuda.so.1`, or
/// [`LIBCUDA_ENV`]); `shim.cuda_unavailable` where it cannot be used. The
/// answer is kept: a machine without a driver is asked once.
pub fn driver() -> Result<&'static Driver, ShimError> {
    DRIVER
        .get_or_init(|| {
            let name = std::env::var(LIBCUDA_ENV)
                .ok()
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| "libcuda.so.1".to_string());
            Driver::open(&name)
        })
        .as_ref()
        .map_err(Clone::clone)
}

fn no_such_device(index: i32) -> ShimError {
    ShimError::UnsupportedDevice {
        device_type: DeviceType::Cuda.code(),
        device_index: index,
        reason: "no such CUDA device",
    }
}

/// Primary contexts retained so far, by device index (never released: the
/// shim keeps a device's context for the process's life, as the runtime does).
static PRIMARY: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// The primary context of device `index`, retained once.
pub fn primary_context(index: i32) -> Result<usize, ShimError> {
    let d = driver()?;
    if index < 0 || index >= d.device_count()? {
        return Err(no_such_device(index));
    }
    let mut cache = PRIMARY.lock().unwrap_or_else(|p| p.into_inner());
    if cache.len() <= index as usize {
        cache.resize(index as usize + 1, 0);
    }
    if cache[index as usize] == 0 {
        let mut dev: c_int = 0;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: writes one device / one context for a valid ordinal.
        unsafe {
            d.check((d.device_get)(&mut dev, index), "cuDeviceGet")?;
            d.check(
                (d.primary_ctx_retain)(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
        }
        cache[index as usize] = ctx as usize;
    }
    Ok(cache[index as usize])
}

/// The device of this thread's current context, `None` when it has none.
pub fn current_device() -> Result<Option<i32>, ShimError> {
    let d = driver()?;
    let mut dev: c_int = 0;
    // SAFETY: writes one int.
    match unsafe { (d.ctx_get_device)(&mut dev) } {
        0 => Ok(Some(dev)),
        CUDA_ERROR_INVALID_CONTEXT => Ok(None),
        rc => d.check(rc, "cuCtxGetDevice").map(|()| None),
    }
}

/// Makes device `index`'s primary context this thread's current one (what
/// `cudaSetDevice` does).
pub fn set_device(index: i32) -> Result<(), ShimError> {
    let d = driver()?;
    let ctx = primary_context(index)?;
    // SAFETY: a retained primary context.
    d.check(
        unsafe { (d.ctx_set_current)(ctx as CuContext) },
        "cuCtxSetCurrent",
    )
}

/// `device` with a CUDA index of `-1` ("the current device") made concrete.
pub fn resolve(device: Device) -> Result<Device, ShimError> {
    if device.device_type != DeviceType::Cuda || device.index >= 0 {
        return Ok(device);
    }
    Ok(Device {
        index: crate::guards::current_device_index()?,
        ..device
    })
}

/// Makes a device's primary context current for a scope and restores the
/// thread's previous context after it.
struct ContextScope {
    previous: Option<usize>,
}

impl ContextScope {
    fn enter(index: i32) -> Result<ContextScope, ShimError> {
        let d = driver()?;
        let target = primary_context(index)?;
        let mut current: CuContext = std::ptr::null_mut();
        // SAFETY: writes one context handle.
        d.check(
            unsafe { (d.ctx_get_current)(&mut current) },
            "cuCtxGetCurrent",
        )?;
        if current as usize == target {
            return Ok(ContextScope { previous: None });
        }
        // SAFETY: a retained primary context.
        d.check(
            unsafe { (d.ctx_set_current)(target as CuContext) },
            "cuCtxSetCurrent",
        )?;
        Ok(ContextScope {
            previous: Some(current as usize),
        })
    }
}

impl Drop for ContextScope {
    fn drop(&mut self) {
        if let (Some(previous), Ok(d)) = (self.previous, driver()) {
            // SAFETY: the context that was current before the scope (or null).
            unsafe { (d.ctx_set_current)(previous as CuContext) };
        }
    }
}

/// What a stream is doing with respect to CUDA-graph capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capture {
    /// Not capturing: work runs.
    None,
    /// Capturing, with the capture's unique id.
    Active(u64),
    /// A capture that failed and waits for its end.
    Invalidated,
}

/// The capture state of `stream` (on the device's context).
pub fn capture_state(stream: Stream) -> Result<Capture, ShimError> {
    let d = driver()?;
    let mut status: c_int = 0;
    let mut id: u64 = 0;
    // SAFETY: the outputs are locals or null (optional in the _v2 form).
    let rc = unsafe {
        match d.capture_info {
            CaptureInfo::V2(f) => f(
                stream.as_ptr(),
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            ),
            CaptureInfo::V1(f) => f(stream.as_ptr(), &mut status, &mut id),
        }
    };
    d.check(rc, "cuStreamGetCaptureInfo")?;
    Ok(match status {
        CAPTURE_STATUS_NONE => Capture::None,
        CAPTURE_STATUS_ACTIVE => Capture::Active(id),
        _ => Capture::Invalidated,
    })
}

/// `cuMemcpyAsync(dst, src, n, stream)` in `device`'s context (either side
/// may be host memory: the driver infers the direction from the addresses),
/// then, when `blocking`, `cuStreamSynchronize(stream)`.
///
/// # Safety
///
/// `dst` and `src` must address `n` bytes that stay valid until the copy ran
/// (until this returns when `blocking`).
pub unsafe fn memcpy(
    device: i32,
    dst: *mut c_void,
    src: *const c_void,
    n: usize,
    stream: Stream,
    blocking: bool,
) -> Result<(), ShimError> {
    if n == 0 {
        return Ok(());
    }
    let d = driver()?;
    let _scope = ContextScope::enter(device)?;
    // SAFETY: the caller's contract.
    d.check(
        unsafe { (d.memcpy_async)(dst as u64, src as u64, n, stream.as_ptr()) },
        "cuMemcpyAsync",
    )?;
    if blocking {
        // SAFETY: a stream of this context, or the legacy stream.
        d.check(
            unsafe { (d.stream_synchronize)(stream.as_ptr()) },
            "cuStreamSynchronize",
        )?;
    }
    Ok(())
}

/// Counters of the CUDA allocator, for tests and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaStats {
    /// Blocks allocated outside any capture.
    pub allocations: u64,
    /// Blocks allocated while their stream was capturing (graph memory nodes).
    pub captured_allocations: u64,
    /// Frees issued (`cuMemFreeAsync`), deferred ones included once issued.
    pub frees: u64,
    /// Frees deferred because their stream was capturing.
    pub deferred: u64,
    /// Frees the driver refused (lost: a destructor cannot report them).
    pub free_failures: u64,
}

struct Live {
    /// The capture the block was allocated in, if any.
    capture: Option<u64>,
}

#[derive(Default)]
struct State {
    pools: Vec<usize>,
    live: HashMap<usize, Live>,
    deferred: Vec<(usize, i32, Stream)>,
    stats: CudaStats,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn with_state<R>(f: impl FnOnce(&mut State) -> R) -> R {
    let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(State::default))
}

/// The shim's pool of device `index`, created on first use with
/// [`POOL_RELEASE_THRESHOLD`]. Call with the device's context current.
fn pool(state: &mut State, index: i32) -> Result<CuPool, ShimError> {
    let i = index as usize;
    if state.pools.len() <= i {
        state.pools.resize(i + 1, 0);
    }
    if state.pools[i] == 0 {
        let d = driver()?;
        let props = MemPoolProps {
            alloc_type: MEM_ALLOCATION_TYPE_PINNED,
            handle_types: 0,
            location_type: MEM_LOCATION_TYPE_DEVICE,
            location_id: index,
            win32_security_attributes: std::ptr::null_mut(),
            reserved: [0; 64],
        };
        let mut pool: CuPool = std::ptr::null_mut();
        // SAFETY: writes one pool handle; `props` is a complete CUmemPoolProps.
        d.check(
            unsafe { (d.pool_create)(&mut pool, &props) },
            "cuMemPoolCreate",
        )?;
        let mut threshold = POOL_RELEASE_THRESHOLD;
        // SAFETY: the attribute takes a cuuint64_t.
        d.check(
            unsafe {
                (d.pool_set_attribute)(
                    pool,
                    MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut threshold as *mut u64).cast(),
                )
            },
            "cuMemPoolSetAttribute",
        )?;
        state.pools[i] = pool as usize;
    }
    Ok(state.pools[i] as CuPool)
}

/// Bytes `(reserved, used)` of the shim's pool of device `index` (`(0, 0)`
/// before its first allocation).
pub fn pool_usage(index: i32) -> Result<(u64, u64), ShimError> {
    let d = driver()?;
    let Some(pool) = with_state(|s| s.pools.get(index as usize).copied().filter(|&p| p != 0))
    else {
        return Ok((0, 0));
    };
    let (mut reserved, mut used) = (0u64, 0u64);
    // SAFETY: both attributes write a cuuint64_t.
    unsafe {
        d.check(
            (d.pool_get_attribute)(
                pool as CuPool,
                MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                (&mut reserved as *mut u64).cast(),
            ),
            "cuMemPoolGetAttribute",
        )?;
        d.check(
            (d.pool_get_attribute)(
                pool as CuPool,
                MEMPOOL_ATTR_USED_MEM_CURRENT,
                (&mut used as *mut u64).cast(),
            ),
            "cuMemPoolGetAttribute",
        )?;
    }
    Ok((reserved, used))
}

/// The allocator's counters so far.
pub fn stats() -> CudaStats {
    with_state(|s| s.stats)
}

/// Frees the deferred blocks whose stream has stopped capturing.
fn drain_deferred(state: &mut State, d: &Driver) {
    if state.deferred.is_empty() {
        return;
    }
    let pending = std::mem::take(&mut state.deferred);
    for (ptr, index, stream) in pending {
        let Ok(_scope) = ContextScope::enter(index) else {
            state.deferred.push((ptr, index, stream));
            continue;
        };
        match capture_state(stream) {
            Ok(Capture::None) => {
                // SAFETY: a block of the pool (or of a finished capture's
                // graph) whose last view is gone.
                let rc = unsafe { (d.free_async)(ptr as u64, stream.as_ptr()) };
                state.stats.frees += 1;
                if rc != 0 {
                    state.stats.free_failures += 1;
                }
            }
            _ => state.deferred.push((ptr, index, stream)),
        }
    }
}

/// The stream-ordered pool allocator of [`DeviceType::Cuda`] (module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct CudaAllocator;

impl Allocator for CudaAllocator {
    fn allocate(
        &self,
        nbytes: usize,
        device: Device,
        stream: Stream,
    ) -> Result<*mut c_void, ShimError> {
        let d = driver()?;
        let device = resolve(device)?;
        let _scope = ContextScope::enter(device.index)?;
        let capture = match capture_state(stream)? {
            Capture::None => None,
            Capture::Active(id) => Some(id),
            Capture::Invalidated => {
                return Err(ShimError::AllocationFailed {
                    nbytes,
                    device: device.to_string(),
                    reason: "the stream's CUDA-graph capture has been invalidated".to_string(),
                })
            }
        };
        with_state(|state| {
            if capture.is_none() {
                drain_deferred(state, d);
            }
            let pool = pool(state, device.index)?;
            let mut ptr: u64 = 0;
            // SAFETY: writes one device pointer; the pool is of this device
            // and the stream of its context (or the legacy stream).
            let rc = unsafe { (d.alloc_from_pool_async)(&mut ptr, nbytes, pool, stream.as_ptr()) };
            if rc == CUDA_ERROR_OUT_OF_MEMORY {
                return Err(ShimError::AllocationFailed {
                    nbytes,
                    device: device.to_string(),
                    reason: format!("cuMemAllocFromPoolAsync: {}", d.error_name(rc)),
                });
            }
            d.check(rc, "cuMemAllocFromPoolAsync")?;
            if ptr % crate::alloc::HOST_ALIGNMENT as u64 != 0 {
                // Never seen (pool blocks are 256-byte aligned); refused
                // rather than handed to kernels that assume 64.
                // SAFETY: the block just allocated, on the same stream.
                unsafe { (d.free_async)(ptr, stream.as_ptr()) };
                return Err(ShimError::AllocationFailed {
                    nbytes,
                    device: device.to_string(),
                    reason: format!("the driver returned {ptr:#x}, not 64-byte aligned"),
                });
            }
            state.live.insert(ptr as usize, Live { capture });
            if capture.is_some() {
                state.stats.captured_allocations += 1;
            } else {
                state.stats.allocations += 1;
            }
            Ok(ptr as *mut c_void)
        })
    }

    unsafe fn free(&self, ptr: *mut c_void, _nbytes: usize, device: Device, stream: Stream) {
        let Ok(d) = driver() else { return };
        let index = match resolve(device) {
            Ok(dev) => dev.index,
            Err(_) => return,
        };
        let scope = ContextScope::enter(index);
        with_state(|state| {
            let live = state.live.remove(&(ptr as usize));
            let now = match scope {
                Ok(_) => capture_state(stream).unwrap_or(Capture::Invalidated),
                Err(_) => Capture::Invalidated,
            };
            let same_capture = matches!(
                (live.as_ref().and_then(|l| l.capture), now),
                (Some(a), Capture::Active(b)) if a == b
            );
            match now {
                Capture::None => {
                    drain_deferred(state, d);
                }
                _ if same_capture => {}
                _ => {
                    state.deferred.push((ptr as usize, index, stream));
                    state.stats.deferred += 1;
                    return;
                }
            }
            // SAFETY: the caller's contract: a block of this allocator whose
            // last view is gone, freed on its allocation stream.
            let rc = unsafe { (d.free_async)(ptr as u64, stream.as_ptr()) };
            state.stats.frees += 1;
            if rc != 0 {
                state.stats.free_failures += 1;
            }
        });
    }
}
