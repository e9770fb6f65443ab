//! libtorch opened at run time, and the part of its C shim this crate calls.
//!
//! Nothing here links torch at build time: `libtorch_cpu.so` and `libtorch.so`
//! are opened with `RTLD_NOW | RTLD_GLOBAL` (the compiled graph's `.so` names
//! them in `DT_NEEDED` without an RPATH, so they must already be loaded
//! globally), and every shim function is looked up by name. The libraries are
//! never closed: libtorch registers global state that does not survive an
//! unload, so one directory is opened once per process and kept.

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use libloading::os::unix::{Library, Symbol, RTLD_GLOBAL, RTLD_LOCAL, RTLD_NOW};
use tcg_core::{Code, Error, Result};

use crate::cuda::{Cuda, Device, CUDA};
use crate::runtime::Runtime;

/// An `AtenTensorHandle`: an opaque pointer to a tensor owned by libtorch.
pub type TensorHandle = *mut c_void;

type CreateFromBlob = unsafe extern "C" fn(
    *mut c_void,
    i64,
    *const i64,
    *const i64,
    i64,
    i32,
    i32,
    i32,
    *mut TensorHandle,
) -> i32;
type DeleteTensor = unsafe extern "C" fn(TensorHandle) -> i32;
type GetPtr = unsafe extern "C" fn(TensorHandle, *mut *mut c_void) -> i32;
type GetI64 = unsafe extern "C" fn(TensorHandle, *mut i64) -> i32;
type GetI64Array = unsafe extern "C" fn(TensorHandle, *mut *mut i64) -> i32;
type GetI32 = unsafe extern "C" fn(TensorHandle, *mut i32) -> i32;
type Constant = unsafe extern "C" fn() -> i32;
type EmptyStrided =
    unsafe extern "C" fn(i64, *const i64, *const i64, i32, i32, i32, *mut TensorHandle) -> i32;
type CopyInto = unsafe extern "C" fn(TensorHandle, TensorHandle, i32) -> i32;
type NewHandle = unsafe extern "C" fn(TensorHandle, *mut TensorHandle) -> i32;

/// The dtypes the native path binds and runs, by inductor's short name, with
/// their element sizes. The numeric code of each is asked from libtorch.
pub const DTYPES: [(&str, usize); 10] = [
    ("float32", 4),
    ("float64", 8),
    ("float16", 2),
    ("bfloat16", 2),
    ("int64", 8),
    ("int32", 4),
    ("int16", 2),
    ("int8", 1),
    ("uint8", 1),
    ("bool", 1),
];

/// One dtype: inductor's name, libtorch's code, the element size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dtype {
    /// Inductor's short name (`float32`).
    pub name: &'static str,
    /// The code libtorch's `aoti_torch_dtype_*()` returns.
    pub code: i32,
    /// Bytes per element.
    pub size: usize,
}

/// The shim functions this crate calls.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shim {
    create_from_blob: CreateFromBlob,
    delete: DeleteTensor,
    data_ptr: GetPtr,
    dim: GetI64,
    sizes: GetI64Array,
    strides: GetI64Array,
    dtype: GetI32,
    device_type: GetI32,
    device_index: GetI32,
    empty_strided: EmptyStrided,
    copy: CopyInto,
    /// `aoti_torch_new_tensor_handle`: a second handle to a tensor's storage.
    new_handle: NewHandle,
    /// `aoti_torch_cpu_addmm_out` (c_shim_cpu.h), for fusing a LoRA on the
    /// CPU; absent from runtimes without it.
    pub(crate) cpu_addmm_out: Option<crate::cuda::AddmmOut>,
    pub(crate) device_cpu: i32,
    pub(crate) device_cuda: i32,
}

/// A runtime that provides the C shim a graph's `.so` calls: libtorch,
/// loaded from one directory, or `libtcg_shim.so` (shim set v1, no torch),
/// loaded into a link-map namespace of its own ([`Torch::open_shim`]).
pub struct Torch {
    dir: PathBuf,
    shim: Shim,
    dtypes: Vec<Dtype>,
    runtime: Runtime,
    // The shim's link-map namespace, where its graphs' `.so`s are opened.
    namespace: Option<libc::Lmid_t>,
    // The CUDA shim, in the base namespace: the path it was opened from,
    // which its graphs' binding stubs name (`crate::shim_bind`), and the
    // CUDA runtime they name beside it (`crate::cudart`).
    bound_shim: Option<(PathBuf, PathBuf)>,
    _libraries: Vec<Library>,
}

impl std::fmt::Debug for Torch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Torch")
            .field("runtime", &self.runtime)
            .field("dir", &self.dir)
            .finish()
    }
}

static LOADED: Mutex<Option<Arc<Torch>>> = Mutex::new(None);
static SHIM_LOADED: Mutex<Option<Arc<Torch>>> = Mutex::new(None);
static SHIM_CUDA_LOADED: Mutex<Option<Arc<Torch>>> = Mutex::new(None);
/// The CUDA state of the CUDA shim runtime (the driver API; no libtorch).
static SHIM_CUDA: std::sync::OnceLock<std::result::Result<Cuda, (Code, String)>> =
    std::sync::OnceLock::new();

fn not_found(message: String) -> Error {
    Error::new(Code::RunTorchNotFound, message)
}

fn symbol<T: Copy>(lib: &Library, name: &str) -> Result<T> {
    // SAFETY: every `T` this is called with is the exact C signature that
    // torch/csrc/inductor/aoti_torch/c/shim.h declares for `name`; the library
    // stays loaded for the life of the process (see `open`), so the copied
    // function pointer never dangles.
    let sym: Symbol<T> = unsafe { lib.get(name.as_bytes()) }.map_err(|e| {
        not_found(format!(
            "the runtime library lacks the shim function {name}: {e}"
        ))
    })?;
    Ok(*sym)
}

impl Torch {
    /// Open libtorch from `dir` (`libtorch_cpu.so`, then `libtorch.so`), or
    /// return the copy already open in this process. A second, different
    /// directory is refused (`run.torch_mismatch`): two libtorch copies in one
    /// process do not work.
    pub fn open(dir: &Path) -> Result<Arc<Torch>> {
        let canonical = std::fs::canonicalize(dir).map_err(|e| {
            not_found(format!(
                "torch library directory {} is not usable: {e}",
                dir.display()
            ))
        })?;
        let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(torch) = loaded.as_ref() {
            if torch.dir == canonical {
                return Ok(Arc::clone(torch));
            }
            return Err(Error::new(
                Code::RunTorchMismatch,
                format!(
                    "libtorch from {} is already loaded in this process; cannot load another from {}",
                    torch.dir.display(),
                    canonical.display()
                ),
            ));
        }
        let open = |name: &str| -> Result<Library> {
            let path = canonical.join(name);
            if !path.is_file() {
                return Err(not_found(format!(
                    "{} has no {name}; pass the lib directory of a torch installation",
                    canonical.display()
                )));
            }
            // SAFETY: loading libtorch runs its static initialisers, which is
            // what importing torch does too; the directory is the one the
            // caller named as its torch installation.
            unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) }
                .map_err(|e| not_found(format!("cannot load {}: {e}", path.display())))
        };
        let cpu = open("libtorch_cpu.so")?;
        let torch = open("libtorch.so")?;
        let (shim, dtypes) = table(&cpu)?;
        let torch = Arc::new(Torch {
            dir: canonical,
            shim,
            dtypes,
            runtime: Runtime::Libtorch,
            namespace: None,
            bound_shim: None,
            _libraries: vec![cpu, torch],
        });
        *loaded = Some(Arc::clone(&torch));
        Ok(torch)
    }

    /// The shim runtime: `libtcg_shim.so` (shim set v1, built from
    /// crates/tcg-shim and carried inside this binary), opened once per
    /// process into a new link-map namespace (`dlmopen(LM_ID_NEWLM)`) and
    /// kept. The first object of a namespace is its global scope, so a
    /// graph's `.so` opened into the same namespace ([`Torch::open_model`])
    /// binds its `aoti_torch_*` imports to the shim and to nothing else,
    /// while libtorch, in the base namespace whether it was loaded before or
    /// is loaded later, never sees the shim's symbols (crates/tcg-shim/README.md,
    /// "Loading").
    pub fn open_shim() -> Result<Arc<Torch>> {
        let mut loaded = SHIM_LOADED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(shim) = loaded.as_ref() {
            return Ok(Arc::clone(shim));
        }
        let (path, handle) = crate::shim_runtime::open_embedded()?;
        let mut namespace: libc::Lmid_t = 0;
        // SAFETY: `handle` is a live handle dlmopen returned; RTLD_DI_LMID
        // writes one Lmid_t.
        let rc = unsafe {
            libc::dlinfo(
                handle,
                libc::RTLD_DI_LMID,
                (&mut namespace as *mut libc::Lmid_t).cast(),
            )
        };
        // SAFETY: a handle from dlmopen, owned from here on by the Library
        // (never closed: the value lives in a static).
        let library = unsafe { Library::from_raw(handle) };
        if rc != 0 {
            return Err(not_found(
                "cannot read the link-map namespace of libtcg_shim.so".into(),
            ));
        }
        let (shim, dtypes) = table(&library)?;
        let torch = Arc::new(Torch {
            dir: path,
            shim,
            dtypes,
            runtime: Runtime::ShimV1,
            namespace: Some(namespace),
            bound_shim: None,
            _libraries: vec![library],
        });
        *loaded = Some(Arc::clone(&torch));
        Ok(torch)
    }

    /// The shim runtime for CUDA graphs: `libtcg_shim.so` opened once per
    /// process into the *base* namespace with `RTLD_LOCAL` (so the package
    /// and the weights pipeline share one `libcuda`, one driver instance),
    /// never into the global scope (so libtorch's own `aoti_torch_*` calls
    /// never reach it). Each graph's `.so` is bound to it through a binding
    /// stub opened with `RTLD_DEEPBIND` ([`crate::shim_bind`];
    /// crates/tcg-shim/README.md, "Loading on CUDA").
    pub fn open_shim_cuda() -> Result<Arc<Torch>> {
        let mut loaded = SHIM_CUDA_LOADED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(shim) = loaded.as_ref() {
            return Ok(Arc::clone(shim));
        }
        let cudart = crate::cudart::locate().map_err(|m| Error::new(Code::RunDeviceMismatch, m))?;
        let (path, handle) = crate::shim_runtime::open_embedded_base()?;
        // SAFETY: a handle from dlopen, owned from here on by the Library
        // (never closed: the value lives in a static).
        let library = unsafe { Library::from_raw(handle) };
        let (shim, dtypes) = table(&library)?;
        let torch = Arc::new(Torch {
            dir: path.clone(),
            shim,
            dtypes,
            runtime: Runtime::ShimV1,
            namespace: None,
            bound_shim: Some((path, cudart)),
            _libraries: vec![library],
        });
        *loaded = Some(Arc::clone(&torch));
        Ok(torch)
    }

    /// The runtime this value is.
    pub fn runtime(&self) -> Runtime {
        self.runtime
    }

    /// Whether the runtime's library exports `name` (a shim function).
    pub fn provides(&self, name: &str) -> bool {
        self._libraries.iter().any(|lib| {
            // SAFETY: only whether the symbol exists is asked; nothing is called.
            unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_ok()
        })
    }

    /// Open a graph's `.so` at `path` against this runtime: for libtorch
    /// globally loaded, `RTLD_NOW | RTLD_LOCAL`; for the shim, into the
    /// shim's namespace, where every import resolves to the shim or a system
    /// library (and `RTLD_NOW` makes a missing one a load-time refusal).
    pub(crate) fn open_model(&self, path: &Path) -> std::result::Result<Library, String> {
        if let Some((shim, cudart)) = &self.bound_shim {
            return crate::shim_bind::open_bound(shim, cudart, path);
        }
        let Some(namespace) = self.namespace else {
            // SAFETY: the .so comes from the package of a verified, admitted
            // artifact (resolve checked its ELF machine and this host's ISA);
            // its initialisers only register the kernels it carries.
            return unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
                .map_err(|e| e.to_string());
        };
        crate::shim_runtime::open_in(namespace, path)
    }
}

/// The shim functions and dtype codes of a runtime library.
fn table(cpu: &Library) -> Result<(Shim, Vec<Dtype>)> {
    {
        let device_cpu: Constant = symbol(cpu, "aoti_torch_device_type_cpu")?;
        let device_cuda: Constant = symbol(cpu, "aoti_torch_device_type_cuda")?;
        let shim = Shim {
            create_from_blob: symbol(cpu, "aoti_torch_create_tensor_from_blob")?,
            delete: symbol(cpu, "aoti_torch_delete_tensor_object")?,
            data_ptr: symbol(cpu, "aoti_torch_get_data_ptr")?,
            dim: symbol(cpu, "aoti_torch_get_dim")?,
            sizes: symbol(cpu, "aoti_torch_get_sizes")?,
            strides: symbol(cpu, "aoti_torch_get_strides")?,
            dtype: symbol(cpu, "aoti_torch_get_dtype")?,
            device_type: symbol(cpu, "aoti_torch_get_device_type")?,
            device_index: symbol(cpu, "aoti_torch_get_device_index")?,
            empty_strided: symbol(cpu, "aoti_torch_empty_strided")?,
            copy: symbol(cpu, "aoti_torch_copy_")?,
            new_handle: symbol(cpu, "aoti_torch_new_tensor_handle")?,
            cpu_addmm_out: symbol(cpu, "aoti_torch_cpu_addmm_out").ok(),
            // SAFETY: `aoti_torch_device_type_*` take nothing and return an int32.
            device_cpu: unsafe { device_cpu() },
            // SAFETY: as above.
            device_cuda: unsafe { device_cuda() },
        };
        let mut dtypes = Vec::with_capacity(DTYPES.len());
        for (name, size) in DTYPES {
            let f: Constant = symbol(cpu, &format!("aoti_torch_dtype_{name}"))?;
            // SAFETY: `aoti_torch_dtype_<name>` takes nothing and returns an int32.
            let code = unsafe { f() };
            dtypes.push(Dtype { name, code, size });
        }
        Ok((shim, dtypes))
    }
}

impl Torch {
    /// The canonical directory libtorch was loaded from (for the shim
    /// runtime: the path `libtcg_shim.so` was opened from).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The dtype of inductor's short `name`, if the native path supports it.
    pub fn dtype_by_name(&self, name: &str) -> Option<Dtype> {
        self.dtypes.iter().copied().find(|d| d.name == name)
    }

    /// The dtype of libtorch's `code`, if the native path supports it.
    pub fn dtype_by_code(&self, code: i32) -> Option<Dtype> {
        self.dtypes.iter().copied().find(|d| d.code == code)
    }

    pub(crate) fn shim(&self) -> &Shim {
        &self.shim
    }

    /// libtorch's CUDA library and the CUDA runtime, opened on first use
    /// (`libtorch_cuda.so` beside the other libraries); a torch without CUDA
    /// support, or a machine without a usable device, is `run.device_mismatch`.
    pub fn cuda(&self) -> Result<&'static Cuda> {
        if self.runtime == Runtime::ShimV1 {
            if self.bound_shim.is_none() {
                return Err(Error::new(
                    Code::RunDeviceMismatch,
                    "the shim runtime in a namespace of its own serves CPU graphs only (CUDA graphs open Torch::open_shim_cuda)",
                ));
            }
            let library = &self._libraries[0];
            return match SHIM_CUDA.get_or_init(|| {
                Cuda::open_driver(library).map_err(|e| (e.code(), e.message().to_owned()))
            }) {
                Ok(cuda) => {
                    cuda.device_count()?;
                    Ok(cuda)
                }
                Err((code, message)) => Err(Error::new(*code, message.clone())),
            };
        }
        // One libtorch directory per process (see `open`), so one CUDA state.
        match CUDA
            .get_or_init(|| Cuda::open(&self.dir).map_err(|e| (e.code(), e.message().to_owned())))
        {
            Ok(cuda) => {
                cuda.device_count()?;
                Ok(cuda)
            }
            Err((code, message)) => Err(Error::new(*code, message.clone())),
        }
    }

    fn device_code(&self, device: Device) -> (i32, i32) {
        match device {
            Device::Cpu => (self.shim.device_cpu, 0),
            Device::Cuda(i) => (self.shim.device_cuda, i),
        }
    }
}

/// Checks what a libtorch tensor constructor returned: a zero status and a
/// handle, or the error that names the tensor it could not `verb`.
fn made(
    rc: i32,
    handle: TensorHandle,
    verb: &str,
    shape: &[i64],
    dtype: Dtype,
    device: Device,
) -> Result<()> {
    if rc != 0 || handle.is_null() {
        return Err(Error::new(
            Code::RunExecutionFailed,
            format!(
                "libtorch could not {verb} a {} tensor of shape {shape:?} on {device}",
                dtype.name
            ),
        ));
    }
    Ok(())
}

/// Row-major strides, in elements, of `shape`.
pub fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1].max(1));
    }
    strides
}

/// The bytes a view of `sizes` and `strides` (in elements, none negative)
/// spans from its first element to one past its farthest one: the element
/// count of a C-contiguous view, fewer where strides overlap (an expanded
/// dimension), more where they leave gaps (a slice), 0 for an empty view.
pub fn span_bytes(sizes: &[i64], strides: &[i64], elem: usize) -> usize {
    if sizes.contains(&0) {
        return 0;
    }
    let last = sizes.iter().zip(strides).fold(0usize, |far, (&n, &s)| {
        let step = usize::try_from(s.max(0)).unwrap_or(0);
        let count = usize::try_from(n.max(1) - 1).unwrap_or(0);
        far.saturating_add(step.saturating_mul(count))
    });
    last.saturating_add(1).saturating_mul(elem)
}

/// A tensor handle this crate created over memory it does not own (a
/// weight in a mapped file, a caller's input buffer). Deleting it frees the
/// handle only, never the memory.
pub(crate) struct BorrowedTensor {
    handle: TensorHandle,
    delete: DeleteTensor,
}

impl BorrowedTensor {
    /// A tensor over `data` on `device`, C-contiguous with `shape`.
    ///
    /// # Safety
    /// `data` must point to at least `product(shape) * dtype.size` readable
    /// bytes on `device` that stay valid, and are not freed, for as long as
    /// libtorch may read them through this handle (or any handle derived from it).
    pub(crate) unsafe fn new(
        torch: &Torch,
        data: *mut c_void,
        shape: &[i64],
        dtype: Dtype,
        device: Device,
    ) -> Result<BorrowedTensor> {
        let strides = contiguous_strides(shape);
        let shim = torch.shim();
        let (device_type, device_index) = torch.device_code(device);
        let mut handle: TensorHandle = std::ptr::null_mut();
        // SAFETY: `shape` and `strides` are arrays of `shape.len()` int64s that
        // outlive the call; the caller guarantees `data` (see above). libtorch
        // copies sizes and strides and does not take ownership of `data`.
        let rc = unsafe {
            (shim.create_from_blob)(
                data,
                shape.len() as i64,
                shape.as_ptr(),
                strides.as_ptr(),
                0,
                dtype.code,
                device_type,
                device_index,
                &mut handle,
            )
        };
        made(rc, handle, "describe", shape, dtype, device)?;
        Ok(BorrowedTensor {
            handle,
            delete: shim.delete,
        })
    }

    pub(crate) fn handle(&self) -> TensorHandle {
        self.handle
    }

    /// Copy `src` (same shape, any dtype and device) into this tensor, cast
    /// to its dtype, on the current stream of its device (the caller makes
    /// the stream current).
    pub(crate) fn copy_from(&self, torch: &Torch, src: TensorHandle) -> Result<()> {
        // SAFETY: both handles are live; a blocking copy (non_blocking = 0).
        let rc = unsafe { (torch.shim.copy)(self.handle, src, 0) };
        if rc != 0 {
            return Err(Error::new(
                Code::RunExecutionFailed,
                "libtorch could not copy into a tensor in place",
            ));
        }
        Ok(())
    }

    /// Give the handle away (to a callee that steals it).
    pub(crate) fn into_raw(self) -> TensorHandle {
        let handle = self.handle;
        std::mem::forget(self);
        handle
    }
}

impl Drop for BorrowedTensor {
    fn drop(&mut self) {
        // SAFETY: `handle` came from `aoti_torch_create_tensor_from_blob` and
        // is deleted exactly once (ownership leaves through `into_raw` only).
        unsafe { (self.delete)(self.handle) };
    }
}

/// A tensor the compiled graph returned (or this crate allocated); this value
/// owns its handle and deletes it on drop, which frees the memory once no
/// other reference holds it.
pub struct OwnedTensor {
    torch: Arc<Torch>,
    handle: TensorHandle,
    dtype: Dtype,
    sizes: Vec<i64>,
    strides: Vec<i64>,
    data: *mut c_void,
    device: Device,
    stream: usize,
    // What must outlive the handle's deletion (dropped after it): the capture
    // stream a static output's memory is freed on.
    keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: the handle is a reference-counted libtorch tensor that this value
// alone owns; it is only read (data pointer, sizes, strides, dtype were copied
// out at construction) and deleted once, which libtorch allows from any thread.
unsafe impl Send for OwnedTensor {}
// SAFETY: all accessors read fields copied at construction; nothing mutates.
unsafe impl Sync for OwnedTensor {}

impl std::fmt::Debug for OwnedTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedTensor")
            .field("dtype", &self.dtype.name)
            .field("sizes", &self.sizes)
            .field("strides", &self.strides)
            .field("device", &self.device)
            .finish()
    }
}

impl OwnedTensor {
    /// Take ownership of `handle`, a tensor whose pending work is queued on
    /// `stream` (0 for a CPU tensor or the legacy default stream).
    ///
    /// # Safety
    /// `handle` must be a live tensor handle whose ownership passes to the
    /// returned value (no one else deletes it).
    pub(crate) unsafe fn from_raw(
        torch: Arc<Torch>,
        handle: TensorHandle,
        stream: usize,
    ) -> Result<OwnedTensor> {
        let shim = *torch.shim();
        let fail = |what: &str| {
            Error::new(
                Code::RunExecutionFailed,
                format!("cannot read the {what} of an output tensor"),
            )
        };
        // From here on the guard owns the handle, so an early return frees it.
        let guard = BorrowedTensor {
            handle,
            delete: shim.delete,
        };
        let (mut dim, mut code, mut device_type, mut device_index) = (0i64, 0i32, 0i32, 0i32);
        let mut data: *mut c_void = std::ptr::null_mut();
        let mut sizes: *mut i64 = std::ptr::null_mut();
        let mut strides: *mut i64 = std::ptr::null_mut();
        // SAFETY: `handle` is live (the caller's contract); each getter writes
        // one value through a valid out-pointer.
        let ok = unsafe {
            (shim.dim)(handle, &mut dim) == 0
                && (shim.dtype)(handle, &mut code) == 0
                && (shim.data_ptr)(handle, &mut data) == 0
                && (shim.sizes)(handle, &mut sizes) == 0
                && (shim.strides)(handle, &mut strides) == 0
                && (shim.device_type)(handle, &mut device_type) == 0
                && (shim.device_index)(handle, &mut device_index) == 0
        };
        if !ok || !(0..=64).contains(&dim) || (dim > 0 && (sizes.is_null() || strides.is_null())) {
            return Err(fail("shape"));
        }
        let dtype = torch
            .dtype_by_code(code)
            .ok_or_else(|| fail(&format!("dtype (code {code} is not supported)")))?;
        let device = if device_type == shim.device_cpu {
            Device::Cpu
        } else if device_type == shim.device_cuda {
            Device::Cuda(device_index)
        } else {
            return Err(fail(&format!(
                "device (type {device_type} is not supported)"
            )));
        };
        let copy = |p: *const i64| -> Vec<i64> {
            if dim == 0 {
                return Vec::new();
            }
            // SAFETY: libtorch returns borrowed arrays of `dim` int64s that
            // live as long as the tensor, which `guard` keeps alive here.
            unsafe { std::slice::from_raw_parts(p, dim as usize) }.to_vec()
        };
        let (sizes, strides) = (copy(sizes), copy(strides));
        let handle = guard.into_raw();
        Ok(OwnedTensor {
            torch,
            handle,
            dtype,
            sizes,
            strides,
            data,
            device,
            stream: if device.is_cuda() { stream } else { 0 },
            keep: None,
        })
    }

    /// A second owner of this tensor's storage (same memory, shape and
    /// strides; the storage lives until both are dropped), ready for work
    /// queued on `stream`; `keep` is dropped only after the new handle was
    /// deleted (what freeing the storage needs, such as the stream it was
    /// allocated on).
    pub(crate) fn alias(
        &self,
        stream: usize,
        keep: Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<OwnedTensor> {
        let mut handle: TensorHandle = std::ptr::null_mut();
        // SAFETY: `self.handle` is live while `self` is; the new handle is
        // owned by the returned value.
        let rc = unsafe { (self.torch.shim.new_handle)(self.handle, &mut handle) };
        if rc != 0 || handle.is_null() {
            return Err(Error::new(
                Code::RunExecutionFailed,
                "cannot make a second handle to an output tensor",
            ));
        }
        // SAFETY: a live handle that nothing else owns.
        let mut alias = unsafe { OwnedTensor::from_raw(Arc::clone(&self.torch), handle, stream) }?;
        alias.keep = Some(keep);
        Ok(alias)
    }

    /// A new, uninitialised C-contiguous tensor on `device`, allocated by
    /// libtorch (on CUDA: its caching allocator, ordered on `stream`).
    pub fn empty(
        torch: &Arc<Torch>,
        shape: &[i64],
        dtype: Dtype,
        device: Device,
        stream: usize,
    ) -> Result<OwnedTensor> {
        let strides = contiguous_strides(shape);
        OwnedTensor::empty_strided(torch, shape, &strides, dtype, device, stream)
    }

    /// A new, uninitialised tensor of `shape` laid out with `strides` (in
    /// elements, none negative) on `device`: its memory holds
    /// [`span_bytes`] bytes from its first element.
    pub fn empty_strided(
        torch: &Arc<Torch>,
        shape: &[i64],
        strides: &[i64],
        dtype: Dtype,
        device: Device,
        stream: usize,
    ) -> Result<OwnedTensor> {
        if shape.len() > 64
            || shape.iter().any(|&d| d < 0)
            || strides.len() != shape.len()
            || strides.iter().any(|&s| s < 0)
        {
            return Err(Error::new(
                Code::RunInputMismatch,
                format!("{shape:?} with strides {strides:?} is not a tensor layout"),
            ));
        }
        let (device_type, device_index) = torch.device_code(device);
        let _guard = match device {
            Device::Cuda(i) => Some(torch.cuda()?.stream_guard(stream, i)?),
            Device::Cpu => None,
        };
        let mut handle: TensorHandle = std::ptr::null_mut();
        // SAFETY: `shape` and `strides` are arrays of `shape.len()` int64s that
        // outlive the call; the new handle is owned by the returned value.
        let rc = unsafe {
            (torch.shim.empty_strided)(
                shape.len() as i64,
                shape.as_ptr(),
                strides.as_ptr(),
                dtype.code,
                device_type,
                device_index,
                &mut handle,
            )
        };
        made(rc, handle, "allocate", shape, dtype, device)?;
        // SAFETY: a live handle just created, owned by nobody else.
        unsafe { OwnedTensor::from_raw(Arc::clone(torch), handle, stream) }
    }

    /// A copy of `src` (a C-contiguous host buffer of `shape` and `dtype`) on
    /// `device`, copied on `stream`; the call returns once the copy is done.
    pub fn from_host(
        torch: &Arc<Torch>,
        src: &[u8],
        shape: &[i64],
        dtype: Dtype,
        device: Device,
        stream: usize,
    ) -> Result<OwnedTensor> {
        let need = shape.iter().try_fold(dtype.size, |n, &d| {
            usize::try_from(d).ok().and_then(|d| n.checked_mul(d))
        });
        if need != Some(src.len()) {
            return Err(Error::new(
                Code::RunInputLayout,
                format!(
                    "a buffer of {} bytes cannot hold a {} tensor of shape {shape:?}",
                    src.len(),
                    dtype.name
                ),
            ));
        }
        let out = OwnedTensor::empty(torch, shape, dtype, device, stream)?;
        // SAFETY: `src` holds exactly the bytes the shape needs (checked above)
        // and lives until `copy_from` returns, which waits for the copy.
        let host = unsafe {
            BorrowedTensor::new(
                torch,
                src.as_ptr() as *mut c_void,
                shape,
                dtype,
                Device::Cpu,
            )?
        };
        out.copy_from(host.handle())?;
        Ok(out)
    }

    /// Copy `src` (same shape and dtype, any device) into this tensor on its
    /// stream; returns once the host may reuse `src`.
    pub(crate) fn copy_from(&self, src: TensorHandle) -> Result<()> {
        let _guard = match self.device {
            Device::Cuda(i) => Some(self.torch.cuda()?.stream_guard(self.stream, i)?),
            Device::Cpu => None,
        };
        // SAFETY: both handles are live; a blocking copy (non_blocking = 0)
        // from pageable host memory returns after the source was read.
        let rc = unsafe { (self.torch.shim.copy)(self.handle, src, 0) };
        if rc != 0 {
            return Err(Error::new(
                Code::RunExecutionFailed,
                format!("libtorch could not copy a tensor to {}", self.device),
            ));
        }
        Ok(())
    }

    /// A C-contiguous copy on `device`, ordered after the work queued on
    /// this tensor's stream; returns once the copy is done when either side is
    /// host memory (a device-to-device copy is queued on the stream).
    pub fn copy_to(&self, device: Device) -> Result<OwnedTensor> {
        let stream = if device.is_cuda() { self.stream } else { 0 };
        let out = OwnedTensor::empty(&self.torch, &self.sizes, self.dtype, device, stream)?;
        let _guard = match (self.device, device) {
            (Device::Cuda(i), _) => Some(self.torch.cuda()?.stream_guard(self.stream, i)?),
            (Device::Cpu, Device::Cuda(i)) => Some(self.torch.cuda()?.stream_guard(stream, i)?),
            (Device::Cpu, Device::Cpu) => None,
        };
        // SAFETY: both handles are live; a blocking copy (non_blocking = 0).
        let rc = unsafe { (self.torch.shim.copy)(out.handle, self.handle, 0) };
        if rc != 0 {
            return Err(Error::new(
                Code::RunExecutionFailed,
                format!(
                    "libtorch could not copy a tensor from {} to {device}",
                    self.device
                ),
            ));
        }
        Ok(out)
    }

    /// The tensor's elements as C-contiguous host bytes (a device tensor is
    /// copied after the work queued on its stream).
    pub fn to_host(&self) -> Result<Vec<u8>> {
        let host = self.copy_to(Device::Cpu)?;
        // SAFETY: `host` is a fresh C-contiguous CPU tensor of `nbytes` bytes.
        Ok(unsafe { std::slice::from_raw_parts(host.data as *const u8, host.nbytes()) }.to_vec())
    }

    /// The handle, still owned by this value (for a call that borrows it).
    pub(crate) fn handle(&self) -> TensorHandle {
        self.handle
    }

    /// Give the handle away (to a callee that steals it, as `Run` does with
    /// its inputs).
    pub(crate) fn into_handle(self) -> TensorHandle {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: each owned field is read out exactly once and dropped, so
        // the libtorch reference and the vectors are released; `Drop` never
        // runs (ManuallyDrop), so the handle is not deleted here.
        unsafe {
            drop(std::ptr::read(&me.torch));
            drop(std::ptr::read(&me.sizes));
            drop(std::ptr::read(&me.strides));
        }
        me.handle
    }

    /// The dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
    /// The sizes.
    pub fn sizes(&self) -> &[i64] {
        &self.sizes
    }
    /// The strides, in elements.
    pub fn strides(&self) -> &[i64] {
        &self.strides
    }
    /// The address of the first element (valid while this value lives; a
    /// device address for a CUDA tensor).
    pub fn data_ptr(&self) -> usize {
        self.data as usize
    }
    /// Where the memory is.
    pub fn device(&self) -> Device {
        self.device
    }
    /// The CUDA stream its producing work was queued on (0: legacy default
    /// stream, or a CPU tensor).
    pub fn stream(&self) -> usize {
        self.stream
    }
    /// The bytes its elements span in memory from the first one (as
    /// [`span_bytes`]): what a copy of its memory, layout kept, moves.
    pub fn span_bytes(&self) -> usize {
        span_bytes(&self.sizes, &self.strides, self.dtype.size)
    }
    /// The number of elements times the element size.
    pub fn nbytes(&self) -> usize {
        self.sizes
            .iter()
            .fold(self.dtype.size, |n, &d| n.saturating_mul(d.max(0) as usize))
    }
    /// libtorch, for the stream operations of a CUDA tensor.
    pub fn torch(&self) -> &Arc<Torch> {
        &self.torch
    }
}

impl Drop for OwnedTensor {
    fn drop(&mut self) {
        // SAFETY: this value owns `handle` (see `from_raw`) and deletes it once.
        unsafe { (self.torch.shim().delete)(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::{contiguous_strides, span_bytes};

    #[test]
    fn span_of_views() {
        // C-contiguous: every element once.
        assert_eq!(
            span_bytes(&[3, 48], &contiguous_strides(&[3, 48]), 4),
            3 * 48 * 4
        );
        // Transposed: the same memory, another order.
        assert_eq!(span_bytes(&[48, 3], &[1, 48], 4), 3 * 48 * 4);
        // A slice with gaps spans past its element count.
        assert_eq!(span_bytes(&[3, 24], &[48, 2], 4), (2 * 48 + 23 * 2 + 1) * 4);
        // An expanded column (stride 0) spans less than it holds.
        assert_eq!(span_bytes(&[3, 5], &[48, 0], 2), (2 * 48 + 1) * 2);
        // Size-1 dimensions are never stepped, whatever their stride.
        assert_eq!(span_bytes(&[1, 24], &[48, 2], 4), (23 * 2 + 1) * 4);
        // Empty tensors span nothing; a scalar spans one element.
        assert_eq!(span_bytes(&[0, 4], &[4, 1], 4), 0);
        assert_eq!(span_bytes(&[], &[], 8), 8);
    }
}
