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

use libloading::os::unix::{Library, Symbol, RTLD_GLOBAL, RTLD_NOW};
use tcg_core::{Code, Error, Result};

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
    pub(crate) device_cpu: i32,
}

/// libtorch, loaded from one directory.
pub struct Torch {
    dir: PathBuf,
    shim: Shim,
    dtypes: Vec<Dtype>,
    _cpu: Library,
    _torch: Library,
}

impl std::fmt::Debug for Torch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Torch").field("dir", &self.dir).finish()
    }
}

static LOADED: Mutex<Option<Arc<Torch>>> = Mutex::new(None);

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
            "libtorch lacks the shim function {name} this graph needs: {e}"
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
        let device_cpu: Constant = symbol(&cpu, "aoti_torch_device_type_cpu")?;
        let shim = Shim {
            create_from_blob: symbol(&cpu, "aoti_torch_create_tensor_from_blob")?,
            delete: symbol(&cpu, "aoti_torch_delete_tensor_object")?,
            data_ptr: symbol(&cpu, "aoti_torch_get_data_ptr")?,
            dim: symbol(&cpu, "aoti_torch_get_dim")?,
            sizes: symbol(&cpu, "aoti_torch_get_sizes")?,
            strides: symbol(&cpu, "aoti_torch_get_strides")?,
            dtype: symbol(&cpu, "aoti_torch_get_dtype")?,
            // SAFETY: `aoti_torch_device_type_cpu` takes nothing and returns an int32.
            device_cpu: unsafe { device_cpu() },
        };
        let mut dtypes = Vec::with_capacity(DTYPES.len());
        for (name, size) in DTYPES {
            let f: Constant = symbol(&cpu, &format!("aoti_torch_dtype_{name}"))?;
            // SAFETY: `aoti_torch_dtype_<name>` takes nothing and returns an int32.
            let code = unsafe { f() };
            dtypes.push(Dtype { name, code, size });
        }
        let torch = Arc::new(Torch {
            dir: canonical,
            shim,
            dtypes,
            _cpu: cpu,
            _torch: torch,
        });
        *loaded = Some(Arc::clone(&torch));
        Ok(torch)
    }

    /// The canonical directory libtorch was loaded from.
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
}

/// Row-major strides, in elements, of `shape`.
pub fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1].max(1));
    }
    strides
}

/// A tensor handle this crate created over memory it does not own (a
/// weight in a mapped file, a caller's input buffer). Deleting it frees the
/// handle only, never the memory.
pub(crate) struct BorrowedTensor {
    handle: TensorHandle,
    delete: DeleteTensor,
}

impl BorrowedTensor {
    /// A CPU tensor over `data`, C-contiguous with `shape`.
    ///
    /// # Safety
    /// `data` must point to at least `product(shape) * dtype.size` readable
    /// bytes that stay valid, and are not freed, for as long as libtorch may
    /// read them through this handle (or any handle it derives from it).
    pub(crate) unsafe fn new(
        torch: &Torch,
        data: *mut c_void,
        shape: &[i64],
        dtype: Dtype,
    ) -> Result<BorrowedTensor> {
        let strides = contiguous_strides(shape);
        let shim = torch.shim();
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
                shim.device_cpu,
                0,
                &mut handle,
            )
        };
        if rc != 0 || handle.is_null() {
            return Err(Error::new(
                Code::RunExecutionFailed,
                format!(
                    "libtorch could not describe a {} tensor of shape {shape:?}",
                    dtype.name
                ),
            ));
        }
        Ok(BorrowedTensor {
            handle,
            delete: shim.delete,
        })
    }

    pub(crate) fn handle(&self) -> TensorHandle {
        self.handle
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

/// A tensor the compiled graph returned; this value owns its handle and
/// deletes it on drop, which frees the memory once no other reference holds it.
pub struct OwnedTensor {
    torch: Arc<Torch>,
    handle: TensorHandle,
    dtype: Dtype,
    sizes: Vec<i64>,
    strides: Vec<i64>,
    data: *mut c_void,
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
            .finish()
    }
}

impl OwnedTensor {
    /// Take ownership of `handle`, an output the graph handed to its caller.
    ///
    /// # Safety
    /// `handle` must be a live tensor handle whose ownership passes to the
    /// returned value (no one else deletes it).
    pub(crate) unsafe fn from_raw(torch: Arc<Torch>, handle: TensorHandle) -> Result<OwnedTensor> {
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
        let (mut dim, mut code) = (0i64, 0i32);
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
        };
        if !ok || !(0..=64).contains(&dim) || (dim > 0 && (sizes.is_null() || strides.is_null())) {
            return Err(fail("shape"));
        }
        let dtype = torch
            .dtype_by_code(code)
            .ok_or_else(|| fail(&format!("dtype (code {code} is not supported)")))?;
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
        })
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
    /// The address of the first element (valid while this value lives).
    pub fn data_ptr(&self) -> usize {
        self.data as usize
    }
}

impl Drop for OwnedTensor {
    fn drop(&mut self) {
        // SAFETY: this value owns `handle` (see `from_raw`) and deletes it once.
        unsafe { (self.torch.shim().delete)(self.handle) };
    }
}
