//! The CUDA driver API (`libcuda.so.1`), opened at run time, for the weights
//! pipeline: device memory, pinned host memory, a copy stream and events.
//!
//! The pipeline uses the driver rather than libtorch's CUDA runtime so that it
//! can start before libtorch is loaded: a CUDA load creates the device's
//! context and streams the weights to the device while libtorch's libraries
//! are still being opened (see [`crate::pipeline`]). Everything here works in
//! the device's *primary* context, the one the CUDA runtime (and so libtorch
//! and the compiled graph) uses: memory allocated here is ordinary device
//! memory to them.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use libloading::os::unix::{Library, Symbol, RTLD_LOCAL, RTLD_NOW};
use tcg_core::{Code, Error, Result};

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuStream = *mut c_void;
type CuEvent = *mut c_void;
type CuDevicePtr = u64;

const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
const CU_STREAM_NON_BLOCKING: c_uint = 1;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
const ATTR_CC_MAJOR: c_int = 75;
const ATTR_CC_MINOR: c_int = 76;

type Init = unsafe extern "C" fn(c_uint) -> CuResult;
type DeviceGet = unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult;
type DeviceGetCount = unsafe extern "C" fn(*mut c_int) -> CuResult;
type DeviceGetAttribute = unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult;
type PrimaryCtxRetain = unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult;
type CtxSetCurrent = unsafe extern "C" fn(CuContext) -> CuResult;
type MemAlloc = unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult;
type MemFree = unsafe extern "C" fn(CuDevicePtr) -> CuResult;
type MemHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult;
type MemFreeHost = unsafe extern "C" fn(*mut c_void) -> CuResult;
type MemcpyHtoDAsync =
    unsafe extern "C" fn(CuDevicePtr, *const c_void, usize, CuStream) -> CuResult;
type MemcpyDtoH = unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult;
type StreamCreate = unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult;
type StreamOp = unsafe extern "C" fn(CuStream) -> CuResult;
type EventCreate = unsafe extern "C" fn(*mut CuEvent, c_uint) -> CuResult;
type EventRecord = unsafe extern "C" fn(CuEvent, CuStream) -> CuResult;
type EventOp = unsafe extern "C" fn(CuEvent) -> CuResult;
type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult;
type GetErrorString = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;
type DriverGetVersion = unsafe extern "C" fn(*mut c_int) -> CuResult;

/// The driver's entry points this crate calls.
pub struct Driver {
    init: Init,
    device_get: DeviceGet,
    device_get_count: DeviceGetCount,
    device_get_attribute: DeviceGetAttribute,
    primary_ctx_retain: PrimaryCtxRetain,
    ctx_set_current: CtxSetCurrent,
    mem_alloc: MemAlloc,
    mem_free: MemFree,
    mem_host_alloc: MemHostAlloc,
    mem_free_host: MemFreeHost,
    memcpy_htod_async: MemcpyHtoDAsync,
    memcpy_dtoh: MemcpyDtoH,
    stream_create: StreamCreate,
    stream_synchronize: StreamOp,
    stream_destroy: StreamOp,
    event_create: EventCreate,
    event_record: EventRecord,
    event_synchronize: EventOp,
    event_destroy: EventOp,
    mem_get_info: MemGetInfo,
    get_error_string: GetErrorString,
    driver_get_version: DriverGetVersion,
    _lib: Library,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver").finish_non_exhaustive()
    }
}

fn unavailable(message: String) -> Error {
    Error::new(Code::RunDeviceMismatch, message)
}

fn symbol<T: Copy>(lib: &Library, name: &str) -> Result<T> {
    // SAFETY: each `T` is the C signature cuda.h declares for `name` (the
    // `_v2` names are the ABI the unversioned macros select); the library is
    // process-wide and never closed.
    let sym: Symbol<T> = unsafe { lib.get(name.as_bytes()) }.map_err(|e| {
        unavailable(format!(
            "the CUDA driver (libcuda.so.1) lacks {name}, which the weights pipeline needs: {e}"
        ))
    })?;
    Ok(*sym)
}

static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();
static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();

impl Driver {
    /// The driver's library, opened once (no initialisation yet: opening is
    /// cheap and takes glibc's loader lock, so a load does it first).
    pub fn library() -> Result<&'static Driver> {
        DRIVER
            .get_or_init(|| Driver::open().map_err(|e| e.message().to_owned()))
            .as_ref()
            .map_err(|m| unavailable(m.clone()))
    }

    /// The process-wide driver, opened and initialised once; a machine
    /// without a usable driver is `run.device_mismatch`.
    pub fn get() -> Result<&'static Driver> {
        let driver = Driver::library()?;
        INIT.get_or_init(|| {
            // SAFETY: no pointers; flags must be 0.
            let rc = unsafe { (driver.init)(0) };
            if rc == 0 {
                Ok(())
            } else {
                Err(format!(
                    "CUDA is not available: cuInit failed: {}",
                    driver.describe(rc)
                ))
            }
        })
        .as_ref()
        .map_err(|m| unavailable(m.clone()))?;
        Ok(driver)
    }

    fn open() -> Result<Driver> {
        // SAFETY: the NVIDIA driver's user-space library; its initialisers
        // only set up the driver's own state.
        let lib =
            unsafe { Library::open(Some("libcuda.so.1"), RTLD_NOW | RTLD_LOCAL) }.map_err(|e| {
                unavailable(format!(
                    "CUDA is not available: cannot load libcuda.so.1: {e}"
                ))
            })?;
        Ok(Driver {
            init: symbol(&lib, "cuInit")?,
            device_get: symbol(&lib, "cuDeviceGet")?,
            device_get_count: symbol(&lib, "cuDeviceGetCount")?,
            device_get_attribute: symbol(&lib, "cuDeviceGetAttribute")?,
            primary_ctx_retain: symbol(&lib, "cuDevicePrimaryCtxRetain")?,
            ctx_set_current: symbol(&lib, "cuCtxSetCurrent")?,
            mem_alloc: symbol(&lib, "cuMemAlloc_v2")?,
            mem_free: symbol(&lib, "cuMemFree_v2")?,
            mem_host_alloc: symbol(&lib, "cuMemHostAlloc")?,
            mem_free_host: symbol(&lib, "cuMemFreeHost")?,
            memcpy_htod_async: symbol(&lib, "cuMemcpyHtoDAsync_v2")?,
            memcpy_dtoh: symbol(&lib, "cuMemcpyDtoH_v2")?,
            stream_create: symbol(&lib, "cuStreamCreate")?,
            stream_synchronize: symbol(&lib, "cuStreamSynchronize")?,
            stream_destroy: symbol(&lib, "cuStreamDestroy_v2")?,
            event_create: symbol(&lib, "cuEventCreate")?,
            event_record: symbol(&lib, "cuEventRecord")?,
            event_synchronize: symbol(&lib, "cuEventSynchronize")?,
            event_destroy: symbol(&lib, "cuEventDestroy_v2")?,
            mem_get_info: symbol(&lib, "cuMemGetInfo_v2")?,
            get_error_string: symbol(&lib, "cuGetErrorString")?,
            driver_get_version: symbol(&lib, "cuDriverGetVersion")?,
            _lib: lib,
        })
    }

    fn describe(&self, rc: CuResult) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: writes one pointer to a static string (or leaves it null).
        let known = unsafe { (self.get_error_string)(rc, &mut p) } == 0 && !p.is_null();
        let text = if known {
            // SAFETY: a static NUL-terminated string owned by the driver.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        } else {
            "unknown error".to_owned()
        };
        format!("{text} (CUresult {rc})")
    }

    pub(crate) fn check(&self, rc: CuResult, what: &str) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        let code = if rc == CUDA_ERROR_OUT_OF_MEMORY {
            Code::RunWeightsTooLarge
        } else {
            Code::RunExecutionFailed
        };
        Err(Error::new(
            code,
            format!("CUDA {what} failed: {}", self.describe(rc)),
        ))
    }

    /// The device handle of `index`, refused when no such device is visible.
    fn device(&self, index: i32) -> Result<CuDevice> {
        let mut count: c_int = 0;
        // SAFETY: writes one int.
        self.check(
            unsafe { (self.device_get_count)(&mut count) },
            "device discovery",
        )?;
        if !(0..count).contains(&index) {
            return Err(unavailable(format!(
                "cuda:{index} does not exist ({count} CUDA device(s) are visible)"
            )));
        }
        let mut device: CuDevice = 0;
        // SAFETY: an out-pointer to a local; the ordinal was checked above.
        self.check(
            unsafe { (self.device_get)(&mut device, index) },
            "cuDeviceGet",
        )?;
        Ok(device)
    }

    /// The CUDA version the driver supports (`cuDriverGetVersion`: 13000
    /// for 13.0); callable before `cuInit`.
    pub fn version(&self) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        let rc = unsafe { (self.driver_get_version)(&mut v) };
        if rc != 0 {
            return Err(unavailable(format!(
                "cuDriverGetVersion failed: {}",
                self.describe(rc)
            )));
        }
        Ok(v)
    }

    /// The compute capability `(major, minor)` of device `index`, asked of
    /// the driver alone (no context is created).
    pub fn capability(&self, index: i32) -> Result<(i32, i32)> {
        capability_of(self, self.device(index)?)
    }

    /// The primary context of device `index` (created on first use), made
    /// current on the calling thread.
    pub fn context(&'static self, index: i32) -> Result<Context> {
        let device = self.device(index)?;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local, a device the driver handed out.
        // The primary context is retained for the life of the process (never
        // released: the runtime shares it).
        self.check(
            unsafe { (self.primary_ctx_retain)(&mut ctx, device) },
            "context creation",
        )?;
        let context = Context {
            driver: self,
            ctx: ctx as usize,
            device,
            index,
        };
        context.make_current()?;
        Ok(context)
    }
}

/// The compute capability `(major, minor)` of `device`.
fn capability_of(driver: &Driver, device: CuDevice) -> Result<(i32, i32)> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: each call writes one int for a device the driver handed out.
    unsafe {
        driver.check(
            (driver.device_get_attribute)(&mut major, ATTR_CC_MAJOR, device),
            "capability query",
        )?;
        driver.check(
            (driver.device_get_attribute)(&mut minor, ATTR_CC_MINOR, device),
            "capability query",
        )?;
    }
    Ok((major, minor))
}

/// A device's primary context, retained for the life of the process.
#[derive(Clone, Copy)]
pub struct Context {
    driver: &'static Driver,
    ctx: usize,
    device: CuDevice,
    index: i32,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Context(cuda:{})", self.index)
    }
}

impl Context {
    /// Make this context current on the calling thread.
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: a retained primary context.
        self.driver.check(
            unsafe { (self.driver.ctx_set_current)(self.ctx as CuContext) },
            "cuCtxSetCurrent",
        )
    }

    /// The device's compute capability `(major, minor)`.
    pub fn capability(&self) -> Result<(i32, i32)> {
        capability_of(self.driver, self.device)
    }

    /// Free and total bytes of device memory.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.make_current()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two size_t.
        self.driver.check(
            unsafe { (self.driver.mem_get_info)(&mut free, &mut total) },
            "cuMemGetInfo",
        )?;
        Ok((free, total))
    }

    /// The device index.
    pub fn index(&self) -> i32 {
        self.index
    }

    /// Copy `dst.len()` bytes from the device address `src` to `dst`,
    /// synchronously (after the work queued before it on the legacy default
    /// stream).
    ///
    /// # Safety
    /// `src..src + dst.len()` must be memory of this context's device.
    pub(crate) unsafe fn copy_to_host(&self, dst: &mut [u8], src: usize) -> Result<()> {
        self.make_current()?;
        // SAFETY: `dst` is writable host memory of that length; the source
        // range is device memory (the caller's contract).
        self.driver.check(
            unsafe {
                (self.driver.memcpy_dtoh)(dst.as_mut_ptr().cast(), src as CuDevicePtr, dst.len())
            },
            "device-to-host copy",
        )
    }
}

/// Device memory from `cuMemAlloc`, freed on drop (the primary context is
/// made current first, so any thread may drop it).
pub struct DeviceMemory {
    context: Context,
    ptr: CuDevicePtr,
    len: usize,
}

// SAFETY: a device address is not tied to a thread; freeing it makes the
// context current on the dropping thread first.
unsafe impl Send for DeviceMemory {}
// SAFETY: as above; the value only hands out the address.
unsafe impl Sync for DeviceMemory {}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceMemory({} bytes on {:?})", self.len, self.context)
    }
}

impl DeviceMemory {
    /// The context the memory belongs to.
    pub(crate) fn context(&self) -> Context {
        self.context
    }

    /// `len` bytes (at least one) on the context's device.
    pub fn new(context: Context, len: usize) -> Result<DeviceMemory> {
        context.make_current()?;
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: writes one device pointer; freed once on drop.
        context.driver.check(
            unsafe { (context.driver.mem_alloc)(&mut ptr, len.max(1)) },
            "device allocation",
        )?;
        Ok(DeviceMemory { context, ptr, len })
    }

    /// The device address.
    pub fn ptr(&self) -> usize {
        self.ptr as usize
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the allocation holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let _ = self.context.make_current();
        // SAFETY: allocated by cuMemAlloc and freed once; cuMemFree waits for
        // work that uses it to finish.
        unsafe { (self.context.driver.mem_free)(self.ptr) };
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, freed on drop.
pub(crate) struct PinnedMemory {
    context: Context,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: host memory; the pipeline hands disjoint slots to its threads.
unsafe impl Send for PinnedMemory {}
// SAFETY: as above.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    pub(crate) fn new(context: Context, len: usize) -> Result<PinnedMemory> {
        context.make_current()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer; freed once on drop.
        context.driver.check(
            unsafe { (context.driver.mem_host_alloc)(&mut ptr, len.max(1), 0) },
            "pinned host allocation",
        )?;
        Ok(PinnedMemory {
            context,
            ptr: ptr.cast(),
            len,
        })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        let _ = self.context.make_current();
        // SAFETY: allocated by cuMemHostAlloc, freed once, after every copy
        // from it completed (the pipeline synchronises its stream first).
        unsafe { (self.context.driver.mem_free_host)(self.ptr.cast()) };
        let _ = self.len;
    }
}

/// A non-blocking stream, synchronised and destroyed on drop.
pub(crate) struct Stream {
    context: Context,
    stream: usize,
}

impl Stream {
    pub(crate) fn new(context: Context) -> Result<Stream> {
        context.make_current()?;
        let mut stream: CuStream = std::ptr::null_mut();
        // SAFETY: writes one stream handle; destroyed once on drop.
        context.driver.check(
            unsafe { (context.driver.stream_create)(&mut stream, CU_STREAM_NON_BLOCKING) },
            "stream creation",
        )?;
        Ok(Stream {
            context,
            stream: stream as usize,
        })
    }

    /// Queue a copy of `len` bytes from pinned `src` to device address `dst`.
    ///
    /// # Safety
    /// `src..src+len` must be pinned host memory that stays valid and
    /// unwritten until the copy completes (an event recorded after it), and
    /// `dst..dst+len` must lie inside one device allocation.
    pub(crate) unsafe fn copy(&self, dst: usize, src: *const u8, len: usize) -> Result<()> {
        let d = self.context.driver;
        // SAFETY: the caller's contract.
        d.check(
            unsafe { (d.memcpy_htod_async)(dst as CuDevicePtr, src.cast(), len, self.handle()) },
            "host-to-device copy",
        )
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        let d = self.context.driver;
        // SAFETY: a live stream.
        d.check(
            unsafe { (d.stream_synchronize)(self.handle()) },
            "stream synchronisation",
        )
    }

    fn handle(&self) -> CuStream {
        self.stream as CuStream
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.context.make_current();
        let _ = self.synchronize();
        // SAFETY: created by cuStreamCreate, destroyed once.
        unsafe { (self.context.driver.stream_destroy)(self.handle()) };
    }
}

/// An event without timing, destroyed on drop.
pub(crate) struct Event {
    context: Context,
    event: usize,
}

impl Event {
    pub(crate) fn new(context: Context) -> Result<Event> {
        context.make_current()?;
        let mut event: CuEvent = std::ptr::null_mut();
        // SAFETY: writes one event handle; destroyed once on drop.
        context.driver.check(
            unsafe { (context.driver.event_create)(&mut event, CU_EVENT_DISABLE_TIMING) },
            "event creation",
        )?;
        Ok(Event {
            context,
            event: event as usize,
        })
    }

    /// Record the event after the work queued so far on `stream`.
    pub(crate) fn record(&self, stream: &Stream) -> Result<()> {
        let d = self.context.driver;
        // SAFETY: a live event and stream of the same context.
        d.check(
            unsafe { (d.event_record)(self.event as CuEvent, stream.handle()) },
            "cuEventRecord",
        )
    }

    /// Block until the work recorded before the event is done (at once for
    /// an event never recorded).
    pub(crate) fn synchronize(&self) -> Result<()> {
        let d = self.context.driver;
        // SAFETY: a live event.
        d.check(
            unsafe { (d.event_synchronize)(self.event as CuEvent) },
            "cuEventSynchronize",
        )
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by cuEventCreate, destroyed once.
        unsafe { (self.context.driver.event_destroy)(self.event as CuEvent) };
    }
}
