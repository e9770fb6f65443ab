//! CUDA for the native path: `libtorch_cuda.so` opened at run time, the CUDA
//! runtime functions this crate calls, and the device a graph runs on.
//!
//! `libtorch_cuda.so` is opened only when a CUDA graph is loaded (it is large,
//! and a CPU graph never needs it), with `RTLD_NOW | RTLD_GLOBAL` like the rest
//! of libtorch: a CUDA graph's `.so` needs its symbols and those of the CUDA
//! runtime it depends on. The CUDA runtime functions are looked up through
//! that library's handle, which searches its dependency tree, so they are the
//! very `libcudart` torch itself uses (one runtime, one context per device).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use libloading::os::unix::{Library, Symbol, RTLD_GLOBAL, RTLD_LOCAL, RTLD_NOW};
use tcg_core::{Code, Error, Result};

/// Where a graph runs, or where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// A CUDA device by index.
    Cuda(i32),
}

impl Device {
    /// Parse `cpu`, `cuda` (device 0) or `cuda:N`.
    pub fn parse(text: &str) -> Result<Device> {
        let bad = || {
            Error::new(
                Code::RunDeviceMismatch,
                format!("{text:?} is not a device (expected \"cpu\" or \"cuda:N\")"),
            )
        };
        match text {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => {
                let index = text.strip_prefix("cuda:").ok_or_else(bad)?;
                if index.is_empty() || index.len() > 4 || !index.bytes().all(|b| b.is_ascii_digit())
                {
                    return Err(bad());
                }
                Ok(Device::Cuda(index.parse().map_err(|_| bad())?))
            }
        }
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

/// The CUDA capability an artifact of axis value `sm` needs (`None` for a CPU
/// artifact), refusing (`run.device_mismatch`) a CPU artifact on a GPU and a
/// CUDA artifact on the CPU.
pub fn wanted_capability(device: Device, sm: &str) -> Result<Option<u32>> {
    let wants = tcg_core::artifact::package::cubin::sm_number(sm);
    if device.is_cuda() != wants.is_some() {
        return Err(Error::new(
            Code::RunDeviceMismatch,
            format!("the artifact is for {sm}; it cannot run on {device}"),
        ));
    }
    Ok(wants)
}

/// Refuse (`run.device_mismatch`) a device of capability `(major, minor)` for
/// an artifact built for capability `want` (its axis value `sm`).
pub fn check_capability(
    device: Device,
    sm: &str,
    want: u32,
    (major, minor): (i32, i32),
) -> Result<()> {
    if u32::try_from(major * 10 + minor).unwrap_or(0) != want {
        return Err(Error::new(
            Code::RunDeviceMismatch,
            format!(
                "the artifact is for {sm}; {device} has capability {major}.{minor} (sm_{major}{minor})"
            ),
        ));
    }
    Ok(())
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

type StreamGuardNew = unsafe extern "C" fn(*mut c_void, i32, *mut *mut c_void) -> i32;
type StreamGuardDelete = unsafe extern "C" fn(*mut c_void) -> i32;
type IntOut = unsafe extern "C" fn(*mut c_int) -> c_int;
type Attribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type IntIn = unsafe extern "C" fn(c_int) -> c_int;
pub(crate) type PtrIn = unsafe extern "C" fn(*mut c_void) -> c_int;
type NoArgs = unsafe extern "C" fn() -> c_int;
type EventCreate = unsafe extern "C" fn(*mut *mut c_void, u32) -> c_int;
type EventRecord = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
type WaitEvent = unsafe extern "C" fn(*mut c_void, *mut c_void, u32) -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

// cudaDeviceAttr values (driver_types.h), stable across CUDA releases.
const ATTR_CC_MAJOR: c_int = 75;
const ATTR_CC_MINOR: c_int = 76;
const EVENT_DISABLE_TIMING: u32 = 2;

/// libtorch's CUDA library and the CUDA runtime it uses.
pub struct Cuda {
    stream_guard_new: StreamGuardNew,
    stream_guard_delete: StreamGuardDelete,
    device_count: IntOut,
    attribute: Attribute,
    set_device: IntIn,
    get_device: IntOut,
    stream_synchronize: PtrIn,
    device_synchronize: NoArgs,
    event_create: EventCreate,
    event_record: EventRecord,
    wait_event: WaitEvent,
    event_destroy: PtrIn,
    stream_create: EventCreate,
    stream_destroy: PtrIn,
    error_string: ErrorString,
    /// `aoti_torch_cuda_addmm_out` / `aoti_torch_cuda_mm_out`, to prime cuBLAS
    /// (`crate::warm`); absent from runtimes without them.
    pub(crate) addmm_out: Option<AddmmOut>,
    pub(crate) mm_out: Option<MmOut>,
    /// The CUDA-graph part of the runtime (`crate::capture`); `None` when
    /// the runtime lacks one of its functions (captures then fall back).
    pub(crate) graphs: Option<GraphApi>,
    _lib: Library,
}

/// The CUDA runtime functions a capture and its replays call
/// (cuda_runtime_api.h), all stable since CUDA 11.4.
#[derive(Clone, Copy)]
pub(crate) struct GraphApi {
    pub(crate) stream_create: unsafe extern "C" fn(*mut *mut c_void, u32) -> c_int,
    pub(crate) stream_destroy: PtrIn,
    pub(crate) begin_capture: unsafe extern "C" fn(*mut c_void, c_int) -> c_int,
    pub(crate) end_capture: unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> c_int,
    pub(crate) instantiate: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u64) -> c_int,
    pub(crate) launch: unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int,
    pub(crate) exec_destroy: PtrIn,
    pub(crate) graph_destroy: PtrIn,
    pub(crate) memcpy_async:
        unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, *mut c_void) -> c_int,
    pub(crate) last_error: NoArgs,
}

impl GraphApi {
    fn open(lib: &Library) -> Result<GraphApi> {
        Ok(GraphApi {
            stream_create: symbol(lib, "cudaStreamCreateWithFlags")?,
            stream_destroy: symbol(lib, "cudaStreamDestroy")?,
            begin_capture: symbol(lib, "cudaStreamBeginCapture")?,
            end_capture: symbol(lib, "cudaStreamEndCapture")?,
            instantiate: symbol(lib, "cudaGraphInstantiateWithFlags")?,
            launch: symbol(lib, "cudaGraphLaunch")?,
            exec_destroy: symbol(lib, "cudaGraphExecDestroy")?,
            graph_destroy: symbol(lib, "cudaGraphDestroy")?,
            memcpy_async: symbol(lib, "cudaMemcpyAsync")?,
            last_error: symbol(lib, "cudaGetLastError")?,
        })
    }
}

/// `aoti_torch_cuda_addmm_out(out, self, mat1, mat2, beta, alpha)`.
pub(crate) type AddmmOut =
    unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void, *mut c_void, f64, f64) -> i32;
/// `aoti_torch_cuda_mm_out(out, self, mat2)`.
pub(crate) type MmOut = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void) -> i32;

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda").finish_non_exhaustive()
    }
}

fn unavailable(message: String) -> Error {
    Error::new(Code::RunDeviceMismatch, message)
}

fn symbol<T: Copy>(lib: &Library, name: &str) -> Result<T> {
    // SAFETY: every `T` this is called with is the C signature the CUDA
    // runtime (cuda_runtime_api.h) or torch's shim.h declares for `name`; the
    // library is never closed while a `Cuda` lives (it is process-wide).
    let sym: Symbol<T> = unsafe { lib.get(name.as_bytes()) }.map_err(|e| {
        unavailable(format!(
            "libtorch_cuda or its CUDA runtime lacks {name}, which the native CUDA path needs: {e}"
        ))
    })?;
    Ok(*sym)
}

impl Cuda {
    /// Open `libtorch_cuda.so` from the libtorch directory `dir`.
    pub(crate) fn open(dir: &std::path::Path) -> Result<Cuda> {
        let path = dir.join("libtorch_cuda.so");
        if !path.is_file() {
            return Err(unavailable(format!(
                "{} has no libtorch_cuda.so: this torch installation has no CUDA support",
                dir.display()
            )));
        }
        // SAFETY: loading libtorch_cuda runs its static initialisers (it
        // registers the CUDA kernels and allocator with libtorch, already
        // loaded), which is what `import torch` does on a CUDA build.
        let lib = unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) }
            .map_err(|e| unavailable(format!("cannot load {}: {e}", path.display())))?;
        Ok(Cuda {
            stream_guard_new: symbol(&lib, "aoti_torch_create_cuda_stream_guard")?,
            stream_guard_delete: symbol(&lib, "aoti_torch_delete_cuda_stream_guard")?,
            device_count: symbol(&lib, "cudaGetDeviceCount")?,
            attribute: symbol(&lib, "cudaDeviceGetAttribute")?,
            set_device: symbol(&lib, "cudaSetDevice")?,
            get_device: symbol(&lib, "cudaGetDevice")?,
            stream_synchronize: symbol(&lib, "cudaStreamSynchronize")?,
            device_synchronize: symbol(&lib, "cudaDeviceSynchronize")?,
            event_create: symbol(&lib, "cudaEventCreateWithFlags")?,
            event_record: symbol(&lib, "cudaEventRecord")?,
            wait_event: symbol(&lib, "cudaStreamWaitEvent")?,
            event_destroy: symbol(&lib, "cudaEventDestroy")?,
            stream_create: symbol(&lib, "cudaStreamCreateWithFlags")?,
            stream_destroy: symbol(&lib, "cudaStreamDestroy")?,
            error_string: symbol(&lib, "cudaGetErrorString")?,
            addmm_out: symbol(&lib, "aoti_torch_cuda_addmm_out").ok(),
            mm_out: symbol(&lib, "aoti_torch_cuda_mm_out").ok(),
            graphs: GraphApi::open(&lib).ok(),
            _lib: lib,
        })
    }

    /// The same entry points over the CUDA driver API (`libcuda.so.1`), for
    /// the shim runtime on CUDA, where no libtorch (and so no CUDA runtime of
    /// its) is loaded: the driver functions whose C signatures match the
    /// runtime's are used as they are (`cuStreamSynchronize` for
    /// `cudaStreamSynchronize`, `cuGraphLaunch` for `cudaGraphLaunch`, the
    /// capture mode and instantiate flag numbers agree), the others through
    /// small adapters (`cudaSetDevice` is the device's primary context made
    /// current, `cudaMemcpyAsync` is `cuMemcpyAsync` with the direction
    /// inferred from the addresses). The stream guard is the shim's own, so
    /// the current stream it sets is the one the shim allocates on. Error
    /// codes in messages are then `CUresult` numbers.
    pub(crate) fn open_driver(shim: &Library) -> Result<Cuda> {
        // Opens and initialises the driver the adapters call.
        driver_fns()?;
        // SAFETY: the NVIDIA driver's library, already opened by driver_fns.
        let lib =
            unsafe { Library::open(Some("libcuda.so.1"), RTLD_NOW | RTLD_LOCAL) }.map_err(|e| {
                unavailable(format!(
                    "CUDA is not available: cannot load libcuda.so.1: {e}"
                ))
            })?;
        let graphs = (|| -> Result<GraphApi> {
            Ok(GraphApi {
                stream_create: symbol(&lib, "cuStreamCreate")?,
                stream_destroy: symbol(&lib, "cuStreamDestroy_v2")?,
                begin_capture: symbol(&lib, "cuStreamBeginCapture_v2")?,
                end_capture: symbol(&lib, "cuStreamEndCapture")?,
                instantiate: symbol(&lib, "cuGraphInstantiateWithFlags")?,
                launch: symbol(&lib, "cuGraphLaunch")?,
                exec_destroy: symbol(&lib, "cuGraphExecDestroy")?,
                graph_destroy: symbol(&lib, "cuGraphDestroy")?,
                memcpy_async: drv_memcpy_async,
                last_error: drv_last_error,
            })
        })()
        .ok();
        Ok(Cuda {
            stream_guard_new: symbol(shim, "aoti_torch_create_cuda_stream_guard")?,
            stream_guard_delete: symbol(shim, "aoti_torch_delete_cuda_stream_guard")?,
            device_count: drv_device_count,
            attribute: drv_attribute,
            set_device: drv_set_device,
            get_device: drv_get_device,
            stream_synchronize: symbol(&lib, "cuStreamSynchronize")?,
            device_synchronize: symbol(&lib, "cuCtxSynchronize")?,
            event_create: symbol(&lib, "cuEventCreate")?,
            event_record: symbol(&lib, "cuEventRecord")?,
            wait_event: symbol(&lib, "cuStreamWaitEvent")?,
            event_destroy: symbol(&lib, "cuEventDestroy_v2")?,
            stream_create: symbol(&lib, "cuStreamCreate")?,
            stream_destroy: symbol(&lib, "cuStreamDestroy_v2")?,
            error_string: drv_error_string,
            addmm_out: None,
            mm_out: None,
            graphs,
            _lib: lib,
        })
    }

    pub(crate) fn check(&self, rc: c_int, what: &str) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: cudaGetErrorString returns a static NUL-terminated string for any code.
        let text = unsafe {
            let p = (self.error_string)(rc);
            if p.is_null() {
                String::from("unknown error")
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        Err(Error::new(
            Code::RunExecutionFailed,
            format!("CUDA {what} failed: {text} (error {rc})"),
        ))
    }

    /// The number of visible devices; a machine without a usable driver or
    /// device is `run.device_mismatch`.
    pub fn device_count(&self) -> Result<i32> {
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        let rc = unsafe { (self.device_count)(&mut n) };
        if rc != 0 || n <= 0 {
            let why = self
                .check(rc, "device discovery")
                .err()
                .map(|e| e.message().to_owned())
                .unwrap_or_else(|| "no CUDA device is visible".into());
            return Err(unavailable(format!("CUDA is not available: {why}")));
        }
        Ok(n)
    }

    /// The compute capability `(major, minor)` of device `index`.
    pub fn capability(&self, index: i32) -> Result<(i32, i32)> {
        let count = self.device_count()?;
        if !(0..count).contains(&index) {
            return Err(unavailable(format!(
                "cuda:{index} does not exist ({count} CUDA device(s) are visible)"
            )));
        }
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        // SAFETY: each call writes one int for a device index checked above.
        unsafe {
            self.check(
                (self.attribute)(&mut major, ATTR_CC_MAJOR, index),
                "capability query",
            )?;
            self.check(
                (self.attribute)(&mut minor, ATTR_CC_MINOR, index),
                "capability query",
            )?;
        }
        Ok((major, minor))
    }

    /// Make `index` the calling thread's current device until the guard drops.
    pub(crate) fn device_guard(&self, index: i32) -> Result<DeviceGuard<'_>> {
        let mut previous: c_int = 0;
        // SAFETY: writes one int / takes a device index that exists (callers
        // checked it when the graph was loaded).
        unsafe {
            self.check((self.get_device)(&mut previous), "cudaGetDevice")?;
            self.check((self.set_device)(index), "cudaSetDevice")?;
        }
        Ok(DeviceGuard {
            cuda: self,
            previous,
        })
    }

    /// Make `stream` torch's current stream of `index` until the guard drops,
    /// so that libtorch's copies and allocations are ordered on it.
    pub(crate) fn stream_guard(&self, stream: usize, index: i32) -> Result<StreamGuard<'_>> {
        let mut guard: *mut c_void = std::ptr::null_mut();
        // SAFETY: `stream` is a cudaStream_t of device `index` (the caller's
        // contract for every stream this crate is given), or 0 for the legacy
        // default stream; the guard is deleted exactly once on drop.
        let rc = unsafe { (self.stream_guard_new)(stream as *mut c_void, index, &mut guard) };
        if rc != 0 || guard.is_null() {
            return Err(Error::new(
                Code::RunExecutionFailed,
                format!("libtorch could not make stream {stream:#x} current on cuda:{index}"),
            ));
        }
        Ok(StreamGuard { cuda: self, guard })
    }

    /// Block until all work queued on `stream` (0: the legacy default stream) is done.
    pub fn synchronize(&self, stream: usize) -> Result<()> {
        // SAFETY: the caller passes a live stream handle or 0.
        self.check(
            unsafe { (self.stream_synchronize)(stream as *mut c_void) },
            "stream synchronisation",
        )
    }

    /// Block until the current device is idle.
    pub(crate) fn synchronize_device(&self) -> Result<()> {
        // SAFETY: no arguments.
        self.check(
            unsafe { (self.device_synchronize)() },
            "device synchronisation",
        )
    }

    /// Make `consumer` wait for the work queued so far on `producer` (an event
    /// recorded on one, waited for on the other; the host does not block).
    pub fn order_streams(&self, producer: usize, consumer: usize) -> Result<()> {
        if producer == consumer {
            return Ok(());
        }
        let mut event: *mut c_void = std::ptr::null_mut();
        // SAFETY: the event is created, used on two live streams and destroyed
        // once; destroying a recorded event is allowed before it completes.
        unsafe {
            self.check(
                (self.event_create)(&mut event, EVENT_DISABLE_TIMING),
                "cudaEventCreateWithFlags",
            )?;
            let recorded = self.check(
                (self.event_record)(event, producer as *mut c_void),
                "cudaEventRecord",
            );
            let waited = recorded.and_then(|()| {
                self.check(
                    (self.wait_event)(consumer as *mut c_void, event, 0),
                    "cudaStreamWaitEvent",
                )
            });
            (self.event_destroy)(event);
            waited
        }
    }
}

impl Cuda {
    /// A new non-blocking stream of device `index`, destroyed on drop.
    pub(crate) fn new_stream(&self, index: i32) -> Result<Stream<'_>> {
        let _device = self.device_guard(index)?;
        let mut stream: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one stream handle; flag 1 is cudaStreamNonBlocking.
        self.check(
            unsafe { (self.stream_create)(&mut stream, 1) },
            "cudaStreamCreateWithFlags",
        )?;
        Ok(Stream { cuda: self, stream })
    }
}

/// A CUDA stream this crate created; destroyed on drop (work still queued on
/// it completes first, as `cudaStreamDestroy` guarantees).
pub(crate) struct Stream<'a> {
    cuda: &'a Cuda,
    stream: *mut c_void,
}

// SAFETY: a cudaStream_t may be used and destroyed from any host thread.
unsafe impl Send for Stream<'_> {}
// SAFETY: as above; this value only hands the handle out.
unsafe impl Sync for Stream<'_> {}

impl Stream<'_> {
    /// The `cudaStream_t`, as this crate passes streams.
    pub(crate) fn handle(&self) -> usize {
        self.stream as usize
    }
}

impl Drop for Stream<'_> {
    fn drop(&mut self) {
        // SAFETY: a stream this value created, destroyed once.
        unsafe { (self.cuda.stream_destroy)(self.stream) };
    }
}

/// Restores the thread's previous CUDA device on drop.
pub(crate) struct DeviceGuard<'a> {
    cuda: &'a Cuda,
    previous: c_int,
}

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: `previous` was the thread's current device a moment ago.
        unsafe { (self.cuda.set_device)(self.previous) };
    }
}

/// Restores torch's previous current stream on drop.
pub(crate) struct StreamGuard<'a> {
    cuda: &'a Cuda,
    guard: *mut c_void,
}

impl Drop for StreamGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: created by `stream_guard` and deleted exactly once here.
        unsafe { (self.cuda.stream_guard_delete)(self.guard) };
    }
}

/// The driver functions behind the adapters of [`Cuda::open_driver`].
struct DriverFns {
    init: unsafe extern "C" fn(u32) -> c_int,
    device_get_count: IntOut,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> c_int,
    device_get_attribute: Attribute,
    primary_ctx_retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int,
    ctx_set_current: PtrIn,
    ctx_get_device: IntOut,
    memcpy_async: unsafe extern "C" fn(u64, u64, usize, *mut c_void) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int,
    _lib: Library,
}

static DRIVER_FNS: OnceLock<std::result::Result<DriverFns, String>> = OnceLock::new();

fn driver_fns() -> Result<&'static DriverFns> {
    DRIVER_FNS
        .get_or_init(|| {
            (|| -> Result<DriverFns> {
                // SAFETY: the NVIDIA driver's library; its initialisers only
                // set up its own state.
                let lib = unsafe { Library::open(Some("libcuda.so.1"), RTLD_NOW | RTLD_LOCAL) }
                    .map_err(|e| {
                        unavailable(format!(
                            "CUDA is not available: cannot load libcuda.so.1: {e}"
                        ))
                    })?;
                let fns = DriverFns {
                    init: symbol(&lib, "cuInit")?,
                    device_get_count: symbol(&lib, "cuDeviceGetCount")?,
                    device_get: symbol(&lib, "cuDeviceGet")?,
                    device_get_attribute: symbol(&lib, "cuDeviceGetAttribute")?,
                    primary_ctx_retain: symbol(&lib, "cuDevicePrimaryCtxRetain")?,
                    ctx_set_current: symbol(&lib, "cuCtxSetCurrent")?,
                    ctx_get_device: symbol(&lib, "cuCtxGetDevice")?,
                    memcpy_async: symbol(&lib, "cuMemcpyAsync")?,
                    get_error_string: symbol(&lib, "cuGetErrorString")?,
                    _lib: lib,
                };
                // SAFETY: flags must be 0.
                let rc = unsafe { (fns.init)(0) };
                if rc != 0 {
                    return Err(unavailable(format!(
                        "CUDA is not available: cuInit failed (CUresult {rc})"
                    )));
                }
                Ok(fns)
            })()
            .map_err(|e| e.message().to_owned())
        })
        .as_ref()
        .map_err(|m| unavailable(m.clone()))
}

const CUDA_ERROR_NOT_INITIALIZED: c_int = 3;
const CUDA_ERROR_INVALID_CONTEXT: c_int = 201;

unsafe extern "C" fn drv_device_count(n: *mut c_int) -> c_int {
    match driver_fns() {
        // SAFETY: the caller passes a writable int.
        Ok(d) => unsafe { (d.device_get_count)(n) },
        Err(_) => CUDA_ERROR_NOT_INITIALIZED,
    }
}

unsafe extern "C" fn drv_attribute(value: *mut c_int, attr: c_int, ordinal: c_int) -> c_int {
    let Ok(d) = driver_fns() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let mut dev: c_int = 0;
    // SAFETY: writes one device handle / one int (the caller's).
    unsafe {
        let rc = (d.device_get)(&mut dev, ordinal);
        if rc != 0 {
            return rc;
        }
        (d.device_get_attribute)(value, attr, dev)
    }
}

unsafe extern "C" fn drv_set_device(ordinal: c_int) -> c_int {
    let Ok(d) = driver_fns() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let mut dev: c_int = 0;
    let mut ctx: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes one device and one context; the primary context is
    // retained (never released: the process keeps it, as the runtime does).
    unsafe {
        let rc = (d.device_get)(&mut dev, ordinal);
        if rc != 0 {
            return rc;
        }
        let rc = (d.primary_ctx_retain)(&mut ctx, dev);
        if rc != 0 {
            return rc;
        }
        (d.ctx_set_current)(ctx)
    }
}

unsafe extern "C" fn drv_get_device(out: *mut c_int) -> c_int {
    let Ok(d) = driver_fns() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: the caller passes a writable int.
    match unsafe { (d.ctx_get_device)(out) } {
        // No current context: device 0, as cudaGetDevice answers.
        CUDA_ERROR_INVALID_CONTEXT => {
            // SAFETY: as above.
            unsafe { out.write(0) };
            0
        }
        rc => rc,
    }
}

unsafe extern "C" fn drv_error_string(rc: c_int) -> *const c_char {
    let mut p: *const c_char = std::ptr::null();
    if let Ok(d) = driver_fns() {
        // SAFETY: writes one pointer to a static string (or fails).
        unsafe { (d.get_error_string)(rc, &mut p) };
    }
    p
}

unsafe extern "C" fn drv_memcpy_async(
    dst: *mut c_void,
    src: *const c_void,
    n: usize,
    _kind: c_int,
    stream: *mut c_void,
) -> c_int {
    match driver_fns() {
        // SAFETY: the caller's contract (cudaMemcpyAsync's, cudaMemcpyDefault).
        Ok(d) => unsafe { (d.memcpy_async)(dst as u64, src as u64, n, stream) },
        Err(_) => CUDA_ERROR_NOT_INITIALIZED,
    }
}

/// The driver has no sticky per-thread error to clear.
unsafe extern "C" fn drv_last_error() -> c_int {
    0
}

/// The process-wide CUDA state, opened once from the one libtorch directory.
pub(crate) static CUDA: OnceLock<std::result::Result<Cuda, (Code, String)>> = OnceLock::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::Cpu);
        assert_eq!(Device::parse("cuda").unwrap(), Device::Cuda(0));
        assert_eq!(Device::parse("cuda:3").unwrap(), Device::Cuda(3));
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
        for bad in [
            "",
            "gpu",
            "cuda:",
            "cuda:-1",
            "cuda:x",
            "cuda:99999",
            "cuda:0 ",
        ] {
            let err = Device::parse(bad).unwrap_err();
            assert_eq!(err.code(), Code::RunDeviceMismatch, "{bad:?}");
        }
    }
}
