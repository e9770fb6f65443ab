//! DLPack capsules: consuming a producer's (`DLPackInput`) and making ours
//! for `NativeTensor.__dlpack__`. The capsule protocol (names, renaming on
//! consumption, the destructor that frees an unconsumed tensor) is the one
//! the Python array API standard specifies; the structs are `tcg_run::dlpack`.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use tcg_core::{Code, Error};
use tcg_run::dlpack::{
    export, export_versioned, DLManagedTensor, DLManagedTensorVersioned, Imported,
};
use tcg_run::{Device, Input, OwnedTensor};

use crate::errors::IntoPyResult;

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const USED_LEGACY: &CStr = c"used_dltensor";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";

/// A tensor another library exported through DLPack, checked and held
/// (the producer's deleter runs when this object is collected).
#[pyclass(module = "torch_compiled_graphs._native", frozen)]
pub struct DLPackInput {
    pub(crate) inner: Imported,
}

#[pymethods]
impl DLPackInput {
    /// Consume `capsule` (what `__dlpack__()` returned): a `dltensor` or
    /// `dltensor_versioned` capsule that no one consumed yet.
    #[new]
    fn new(capsule: &Bound<'_, PyAny>) -> PyResult<Self> {
        let cap = capsule.as_ptr();
        let refused =
            |m: &str| Error::new(Code::RunInputLayout, format!("not a DLPack capsule: {m}"));
        // SAFETY: `cap` is a live object (borrowed from `capsule`); the capsule
        // calls only read its name and pointer, and the rename marks it
        // consumed so that its destructor leaves the tensor to us.
        let inner = unsafe {
            if ffi::PyCapsule_IsValid(cap, VERSIONED.as_ptr()) == 1 {
                let p = ffi::PyCapsule_GetPointer(cap, VERSIONED.as_ptr());
                if ffi::PyCapsule_SetName(cap, USED_VERSIONED.as_ptr()) != 0 {
                    return Err(PyErr::fetch(capsule.py()));
                }
                Imported::from_versioned(p.cast::<DLManagedTensorVersioned>())
            } else if ffi::PyCapsule_IsValid(cap, LEGACY.as_ptr()) == 1 {
                let p = ffi::PyCapsule_GetPointer(cap, LEGACY.as_ptr());
                if ffi::PyCapsule_SetName(cap, USED_LEGACY.as_ptr()) != 0 {
                    return Err(PyErr::fetch(capsule.py()));
                }
                Imported::from_legacy(p.cast::<DLManagedTensor>())
            } else {
                Err(refused("expected an unconsumed \"dltensor\" capsule"))
            }
        }
        .py()?;
        Ok(DLPackInput { inner })
    }

    /// Inductor's dtype name.
    #[getter]
    fn dtype(&self) -> String {
        self.inner.input().dtype.clone()
    }
    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.inner.input().shape.clone()
    }
    /// `"cpu"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        self.inner.input().device.to_string()
    }
}

impl DLPackInput {
    pub(crate) fn input(&self) -> Input {
        self.inner.input().clone()
    }
}

unsafe extern "C" fn drop_legacy(cap: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule being destroyed; a capsule
    // still named "dltensor" was never consumed, so its tensor is ours to free.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, LEGACY.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(cap, LEGACY.as_ptr()).cast::<DLManagedTensor>();
            if let Some(d) = (*p).deleter {
                d(p);
            }
        }
    }
}

unsafe extern "C" fn drop_versioned(cap: *mut ffi::PyObject) {
    // SAFETY: as `drop_legacy`.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, VERSIONED.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(cap, VERSIONED.as_ptr())
                .cast::<DLManagedTensorVersioned>();
            if let Some(d) = (*p).deleter {
                d(p);
            }
        }
    }
}

/// The `cudaStream_t` a DLPack consumer names: `None` and 1 are the legacy
/// default stream (handle 0), 2 the per-thread default stream (its handle is
/// 2), larger values a stream handle; -1 asks for no synchronisation.
fn consumer_stream(stream: Option<i64>) -> PyResult<Option<usize>> {
    match stream {
        None | Some(1) => Ok(Some(0)),
        Some(-1) => Ok(None),
        Some(s) if s >= 2 => Ok(Some(s as usize)),
        Some(s) => Err(PyBufferError::new_err(format!(
            "stream {s} is not a CUDA stream for DLPack (use None, 1, 2, a handle, or -1)"
        ))),
    }
}

/// A capsule exporting `tensor` without a copy, after ordering the consumer's
/// stream behind the work that produced it (`__dlpack__` of the array API).
pub(crate) fn capsule(
    py: Python<'_>,
    tensor: &Arc<OwnedTensor>,
    stream: Option<i64>,
    versioned: bool,
) -> PyResult<Py<PyAny>> {
    if let Device::Cuda(_) = tensor.device() {
        if let Some(consumer) = consumer_stream(stream)? {
            let cuda = tensor.torch().cuda().py()?;
            cuda.order_streams(tensor.stream(), consumer).py()?;
        }
    } else if stream.is_some_and(|s| s != -1) {
        return Err(PyBufferError::new_err(
            "a host tensor is exported without a stream (stream must be None)",
        ));
    }
    // SAFETY: the managed tensor is a fresh box whose deleter frees it; the
    // capsule owns it until a consumer renames the capsule and takes it.
    let raw = unsafe {
        if versioned {
            ffi::PyCapsule_New(
                export_versioned(tensor).cast::<c_void>(),
                VERSIONED.as_ptr(),
                Some(drop_versioned),
            )
        } else {
            ffi::PyCapsule_New(
                export(tensor).cast::<c_void>(),
                LEGACY.as_ptr(),
                Some(drop_legacy),
            )
        }
    };
    if raw.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference just returned by PyCapsule_New.
    Ok(unsafe { Bound::from_owned_ptr(py, raw) }.unbind())
}
