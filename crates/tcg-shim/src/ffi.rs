//! The exported `aoti_torch_*` functions, with the exact signatures of
//! torch's `torch/csrc/inductor/aoti_torch/c/shim.h`.
//!
//! Every function that returns `AOTITorchError` checks each pointer it is
//! given (a null or unknown handle, or a null output pointer, is
//! `AOTI_TORCH_FAILURE`, never a crash) and runs its body under
//! [`crate::error`]'s guard, so no panic crosses the ABI; the reason of a
//! failure is this thread's [`crate::last_error`].
//!
//! Departures from libtorch, all refusals rather than different results:
//! negative strides and offsets are refused (as `as_strided` refuses them);
//! `copy_` copies neither across dtypes nor with broadcasting; a strided copy
//! on a device that one driver copy cannot do is refused (`crate::copy`). A
//! null `strides_ptr` means row-major strides. The CUDA guards and streams
//! are in [`crate::ffi_cuda`].

use std::ffi::c_void;

use crate::copy::{clone_host, clone_preserve_strides, copy_tensor};
use crate::dtype::{DType, Device, DeviceType};
use crate::error::{guard, AotiTorchError, ShimError};
use crate::handle::{delete_handle, new_handle, with_tensor, with_tensors, AtenTensorHandle};
use crate::tensor::{contiguous_strides, required_storage_bytes, Storage, Tensor, MAX_DIMS};

/// Reads `ndim` values from a C array, refusing a negative or excessive
/// `ndim` and a null pointer with `ndim > 0`.
///
/// # Safety
///
/// When non-null, `ptr` must point to `ndim` readable `i64`s.
unsafe fn read_dims(ndim: i64, ptr: *const i64, arg: &'static str) -> Result<Vec<i64>, ShimError> {
    if ndim < 0 || ndim as u64 > MAX_DIMS as u64 {
        return Err(ShimError::InvalidArgument {
            detail: format!("ndim {ndim} outside 0..={MAX_DIMS}"),
        });
    }
    if ndim == 0 {
        return Ok(Vec::new());
    }
    if ptr.is_null() {
        return Err(ShimError::NullPointer { arg });
    }
    // SAFETY: non-null, and the caller guarantees `ndim` readable values.
    Ok(unsafe { std::slice::from_raw_parts(ptr, ndim as usize) }.to_vec())
}

/// Sizes and strides from C arrays; a null `strides_ptr` means row-major.
///
/// # Safety
///
/// As [`read_dims`] for both arrays.
unsafe fn read_shape(
    ndim: i64,
    sizes_ptr: *const i64,
    strides_ptr: *const i64,
) -> Result<(Vec<i64>, Vec<i64>), ShimError> {
    // SAFETY: forwarded caller contract.
    let sizes = unsafe { read_dims(ndim, sizes_ptr, "sizes_ptr") }?;
    let strides = if strides_ptr.is_null() {
        contiguous_strides(&sizes)
    } else {
        // SAFETY: forwarded caller contract.
        unsafe { read_dims(ndim, strides_ptr, "strides_ptr") }?
    };
    Ok((sizes, strides))
}

/// Writes `value` through an output pointer, refusing null.
///
/// # Safety
///
/// When non-null, `out` must be valid for a write of `T`.
unsafe fn write_out<T>(out: *mut T, arg: &'static str, value: T) -> Result<(), ShimError> {
    if out.is_null() {
        return Err(ShimError::NullPointer { arg });
    }
    // SAFETY: non-null and valid for writes by the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

fn check_out<T>(out: *mut T, arg: &'static str) -> Result<(), ShimError> {
    if out.is_null() {
        Err(ShimError::NullPointer { arg })
    } else {
        Ok(())
    }
}

macro_rules! dtype_constants {
    ($($name:ident => $dtype:expr),* $(,)?) => {$(
        #[doc = concat!("c10's number for `", stringify!($dtype), "`.")]
        #[no_mangle]
        pub extern "C" fn $name() -> i32 {
            $dtype.code()
        }
    )*};
}

dtype_constants! {
    aoti_torch_dtype_float8_e5m2 => DType::Float8E5M2,
    aoti_torch_dtype_float8_e4m3fn => DType::Float8E4M3Fn,
    aoti_torch_dtype_float8_e5m2fnuz => DType::Float8E5M2Fnuz,
    aoti_torch_dtype_float8_e4m3fnuz => DType::Float8E4M3Fnuz,
    aoti_torch_dtype_float8_e8m0fnu => DType::Float8E8M0Fnu,
    aoti_torch_dtype_float4_e2m1fn_x2 => DType::Float4E2M1FnX2,
    aoti_torch_dtype_bfloat16 => DType::BFloat16,
    aoti_torch_dtype_float16 => DType::Float16,
    aoti_torch_dtype_float32 => DType::Float32,
    aoti_torch_dtype_float64 => DType::Float64,
    aoti_torch_dtype_uint8 => DType::UInt8,
    aoti_torch_dtype_uint16 => DType::UInt16,
    aoti_torch_dtype_uint32 => DType::UInt32,
    aoti_torch_dtype_uint64 => DType::UInt64,
    aoti_torch_dtype_int8 => DType::Int8,
    aoti_torch_dtype_int16 => DType::Int16,
    aoti_torch_dtype_int32 => DType::Int32,
    aoti_torch_dtype_int64 => DType::Int64,
    aoti_torch_dtype_bool => DType::Bool,
    aoti_torch_dtype_complex32 => DType::Complex32,
    aoti_torch_dtype_complex64 => DType::Complex64,
    aoti_torch_dtype_complex128 => DType::Complex128,
}

/// Bytes per element of `dtype`; 0 (and the thread's last error set) for a
/// number that is not a dtype.
#[no_mangle]
pub extern "C" fn aoti_torch_dtype_element_size(dtype: i32) -> usize {
    let mut size = 0;
    guard("aoti_torch_dtype_element_size", || {
        size = DType::from_code(dtype)?.element_size();
        Ok(())
    });
    size
}

/// c10's number for the host device type.
#[no_mangle]
pub extern "C" fn aoti_torch_device_type_cpu() -> i32 {
    DeviceType::Cpu.code()
}

/// c10's number for the CUDA device type.
#[no_mangle]
pub extern "C" fn aoti_torch_device_type_cuda() -> i32 {
    DeviceType::Cuda.code()
}

/// c10's number for the strided layout (the only one this shim has).
#[no_mangle]
pub extern "C" fn aoti_torch_layout_strided() -> i32 {
    0
}

thread_local! {
    static GRAD_MODE: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// This thread's grad mode (enabled by default, as in c10). The shim never
/// records autograd; the flag is kept so that the generated code's
/// no-grad guard saves and restores what it set.
#[no_mangle]
pub extern "C" fn aoti_torch_grad_mode_is_enabled() -> bool {
    GRAD_MODE.try_with(|g| g.get()).unwrap_or(false)
}

/// Sets this thread's grad mode.
#[no_mangle]
pub extern "C" fn aoti_torch_grad_mode_set_enabled(enabled: bool) {
    let _ = GRAD_MODE.try_with(|g| g.set(enabled));
}

/// Wraps caller-owned memory in a new tensor handle. The storage spans the
/// bytes the view reaches (offset included), so views reinterpreted from it
/// stay inside those bytes.
///
/// # Safety
///
/// `sizes_ptr` (and `strides_ptr` when non-null) must point to `ndim`
/// readable `int64_t`s; `data` must stay valid for the bytes the view
/// reaches for as long as any handle over it lives; `ret` must be writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn aoti_torch_create_tensor_from_blob(
    data: *mut c_void,
    ndim: i64,
    sizes_ptr: *const i64,
    strides_ptr: *const i64,
    storage_offset: i64,
    dtype: i32,
    device_type: i32,
    device_index: i32,
    ret: *mut AtenTensorHandle,
) -> AotiTorchError {
    guard("aoti_torch_create_tensor_from_blob", || {
        check_out(ret, "ret")?;
        let dtype = DType::from_code(dtype)?;
        let device = Device::from_codes(device_type, device_index)?;
        // SAFETY: forwarded caller contract on the arrays.
        let (sizes, strides) = unsafe { read_shape(ndim, sizes_ptr, strides_ptr) }?;
        let needed = required_storage_bytes(&sizes, &strides, storage_offset, dtype)?;
        let nbytes = usize::try_from(needed).map_err(|_| ShimError::SizeOverflow {
            detail: format!("{needed} bytes for sizes {sizes:?}"),
        })?;
        if data.is_null() && nbytes > 0 {
            return Err(ShimError::NullPointer { arg: "data" });
        }
        let storage = Storage::borrowed(data, nbytes, device);
        let tensor = Tensor::view(storage, sizes, strides, storage_offset, dtype)?;
        // SAFETY: `ret` is non-null (checked) and writable by contract.
        unsafe { write_out(ret, "ret", new_handle(tensor)) }
    })
}

/// `create_tensor_from_blob` with a layout and opaque metadata: only the
/// strided layout without metadata is accepted (the opaque form is MKLDNN's).
///
/// # Safety
///
/// As [`aoti_torch_create_tensor_from_blob`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn aoti_torch_create_tensor_from_blob_v2(
    data: *mut c_void,
    ndim: i64,
    sizes_ptr: *const i64,
    strides_ptr: *const i64,
    storage_offset: i64,
    dtype: i32,
    device_type: i32,
    device_index: i32,
    ret: *mut AtenTensorHandle,
    layout: i32,
    opaque_metadata: *const u8,
    opaque_metadata_size: i64,
) -> AotiTorchError {
    if layout != aoti_torch_layout_strided()
        || !opaque_metadata.is_null()
        || opaque_metadata_size != 0
    {
        return guard("aoti_torch_create_tensor_from_blob_v2", || {
            Err(ShimError::InvalidArgument {
                detail: format!(
                    "layout {layout} with {opaque_metadata_size} bytes of opaque metadata: only the strided layout is supported"
                ),
            })
        });
    }
    // SAFETY: forwarded caller contract.
    unsafe {
        aoti_torch_create_tensor_from_blob(
            data,
            ndim,
            sizes_ptr,
            strides_ptr,
            storage_offset,
            dtype,
            device_type,
            device_index,
            ret,
        )
    }
}

/// A new tensor with freshly allocated, uninitialised storage on the device,
/// from that device type's allocator on this thread's current stream.
///
/// # Safety
///
/// `sizes_ptr` (and `strides_ptr` when non-null) must point to `ndim`
/// readable `int64_t`s; `ret_new_tensor` must be writable.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_empty_strided(
    ndim: i64,
    sizes_ptr: *const i64,
    strides_ptr: *const i64,
    dtype: i32,
    device_type: i32,
    device_index: i32,
    ret_new_tensor: *mut AtenTensorHandle,
) -> AotiTorchError {
    guard("aoti_torch_empty_strided", || {
        check_out(ret_new_tensor, "ret_new_tensor")?;
        let dtype = DType::from_code(dtype)?;
        let device = Device::from_codes(device_type, device_index)?;
        // SAFETY: forwarded caller contract on the arrays.
        let (sizes, strides) = unsafe { read_shape(ndim, sizes_ptr, strides_ptr) }?;
        let tensor = Tensor::empty_strided(sizes, strides, dtype, device)?;
        // SAFETY: non-null (checked) and writable by contract.
        unsafe { write_out(ret_new_tensor, "ret_new_tensor", new_handle(tensor)) }
    })
}

/// Frees a handle; its storage is freed with its last view.
///
/// # Safety
///
/// None beyond the C contract: any value is checked against the live handles.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_delete_tensor_object(
    tensor: AtenTensorHandle,
) -> AotiTorchError {
    guard("aoti_torch_delete_tensor_object", || {
        delete_handle(tensor, "tensor")
    })
}

/// A new handle aliasing the same view (shares storage and metadata).
///
/// # Safety
///
/// `new_handle` must be writable when non-null.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_new_tensor_handle(
    orig_handle: AtenTensorHandle,
    new_handle_out: *mut AtenTensorHandle,
) -> AotiTorchError {
    guard("aoti_torch_new_tensor_handle", || {
        check_out(new_handle_out, "new_handle")?;
        let alias = with_tensor(orig_handle, "orig_handle", |t| Ok(t.alias()))?;
        // SAFETY: non-null (checked) and writable by contract.
        unsafe { write_out(new_handle_out, "new_handle", new_handle(alias)) }
    })
}

/// A new view of `self`'s storage with the given sizes, strides and absolute
/// storage offset (in elements of `self`'s dtype); refused if it reaches
/// outside the storage.
///
/// # Safety
///
/// `sizes_ptr` (and `strides_ptr` when non-null) must point to `ndim`
/// readable `int64_t`s; `ret_new_tensor` must be writable.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch__reinterpret_tensor(
    self_: AtenTensorHandle,
    ndim: i64,
    sizes_ptr: *const i64,
    strides_ptr: *const i64,
    storage_offset: i64,
    ret_new_tensor: *mut AtenTensorHandle,
) -> AotiTorchError {
    guard("aoti_torch__reinterpret_tensor", || {
        check_out(ret_new_tensor, "ret_new_tensor")?;
        // SAFETY: forwarded caller contract on the arrays.
        let (sizes, strides) = unsafe { read_shape(ndim, sizes_ptr, strides_ptr) }?;
        let view = with_tensor(self_, "self", |t| {
            Tensor::view(
                t.storage().clone(),
                sizes,
                strides,
                storage_offset,
                t.dtype(),
            )
        })?;
        // SAFETY: non-null (checked) and writable by contract.
        unsafe { write_out(ret_new_tensor, "ret_new_tensor", new_handle(view)) }
    })
}

macro_rules! getter {
    ($(#[$doc:meta])* $name:ident, $out:ident: $ty:ty, |$t:ident| $value:expr) => {
        $(#[$doc])*
        ///
        /// # Safety
        ///
        /// The output pointer must be writable when non-null.
        #[no_mangle]
        pub unsafe extern "C" fn $name(tensor: AtenTensorHandle, $out: *mut $ty) -> AotiTorchError {
            guard(stringify!($name), || {
                check_out($out, stringify!($out))?;
                let value = with_tensor(tensor, "tensor", |$t| Ok($value))?;
                // SAFETY: non-null (checked) and writable by contract.
                unsafe { write_out($out, stringify!($out), value) }
            })
        }
    };
}

getter!(
    /// Address of element 0 (a borrowed pointer into the storage).
    aoti_torch_get_data_ptr, ret_data_ptr: *mut c_void, |t| t.data_ptr()
);
getter!(
    /// Bytes of the whole storage under the view.
    aoti_torch_get_storage_size, ret_size: i64, |t| t.storage().nbytes() as i64
);
getter!(
    /// Elements of the whole storage, in the view's dtype.
    aoti_torch_get_storage_numel, ret_numel: i64,
    |t| (t.storage().nbytes() / t.dtype().element_size()) as i64
);
getter!(
    /// Number of dimensions.
    aoti_torch_get_dim, ret_dim: i64, |t| t.dim() as i64
);
getter!(
    /// Number of elements.
    aoti_torch_get_numel, ret_numel: i64, |t| t.numel()
);
getter!(
    /// The sizes array (borrowed; valid while the handle lives).
    aoti_torch_get_sizes, ret_sizes: *mut i64, |t| t.sizes().as_ptr().cast_mut()
);
getter!(
    /// The strides array (borrowed; valid while the handle lives).
    aoti_torch_get_strides, ret_strides: *mut i64, |t| t.strides().as_ptr().cast_mut()
);
getter!(
    /// Offset of element 0 into the storage, in elements.
    aoti_torch_get_storage_offset, ret_storage_offset: i64, |t| t.storage_offset()
);
getter!(
    /// c10's number for the dtype.
    aoti_torch_get_dtype, ret_dtype: i32, |t| t.dtype().code()
);
getter!(
    /// c10's number for the device type.
    aoti_torch_get_device_type, ret_device_type: i32, |t| t.device().device_type.code()
);
getter!(
    /// The device index (`-1` for an unspecified host device).
    aoti_torch_get_device_index, ret_device_index: i32, |t| t.device().index
);
getter!(
    /// c10's number for the layout (always strided).
    aoti_torch_get_layout, ret_layout: i32, |_t| aoti_torch_layout_strided()
);
getter!(
    /// Whether the strides are row-major.
    aoti_torch_is_contiguous, ret_is_contiguous: bool, |t| t.is_contiguous()
);

fn dim_index(t: &Tensor, d: i64) -> Result<usize, ShimError> {
    let ndim = t.dim() as i64;
    let wrapped = if d < 0 { d + ndim } else { d };
    if wrapped < 0 || wrapped >= ndim {
        return Err(ShimError::InvalidArgument {
            detail: format!("dimension {d} out of range for a {ndim}-dimensional tensor"),
        });
    }
    Ok(wrapped as usize)
}

/// Size of dimension `d` (negative `d` counts from the end).
///
/// # Safety
///
/// `ret_size` must be writable when non-null.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_get_size(
    tensor: AtenTensorHandle,
    d: i64,
    ret_size: *mut i64,
) -> AotiTorchError {
    guard("aoti_torch_get_size", || {
        check_out(ret_size, "ret_size")?;
        let v = with_tensor(tensor, "tensor", |t| Ok(t.sizes()[dim_index(t, d)?]))?;
        // SAFETY: non-null (checked) and writable by contract.
        unsafe { write_out(ret_size, "ret_size", v) }
    })
}

/// Stride of dimension `d` (negative `d` counts from the end).
///
/// # Safety
///
/// `ret_stride` must be writable when non-null.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_get_stride(
    tensor: AtenTensorHandle,
    d: i64,
    ret_stride: *mut i64,
) -> AotiTorchError {
    guard("aoti_torch_get_stride", || {
        check_out(ret_stride, "ret_stride")?;
        let v = with_tensor(tensor, "tensor", |t| Ok(t.strides()[dim_index(t, d)?]))?;
        // SAFETY: non-null (checked) and writable by contract.
        unsafe { write_out(ret_stride, "ret_stride", v) }
    })
}

/// Copies `src` into `self_` (same dtype and sizes). On the host any
/// strides, overlapping views included; with a device on either side on the
/// current stream (`crate::copy`), blocking the host for a host side unless
/// `non_blocking`.
///
/// # Safety
///
/// None beyond the C contract: both handles are checked.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_copy_(
    self_: AtenTensorHandle,
    src: AtenTensorHandle,
    non_blocking: i32,
) -> AotiTorchError {
    guard("aoti_torch_copy_", || {
        with_tensors(self_, "self", src, "src", |d, s| {
            copy_tensor(d, s, non_blocking != 0)
        })
    })
}

/// A new tensor with its own storage and `self_`'s values (strides kept when
/// `self_` is dense, row-major otherwise), on `self_`'s device.
///
/// # Safety
///
/// `ret` must be writable when non-null.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_clone(
    self_: AtenTensorHandle,
    ret: *mut AtenTensorHandle,
) -> AotiTorchError {
    guard("aoti_torch_clone", || {
        check_out(ret, "ret")?;
        let out = with_tensor(self_, "self", clone_host)?;
        // SAFETY: non-null (checked) and writable by contract.
        unsafe { write_out(ret, "ret", new_handle(out)) }
    })
}

/// A new tensor with its own storage, `self_`'s sizes and strides kept
/// exactly (also for a view that is not dense: the new storage spans what
/// the strides reach from offset 0), and `self_`'s values, on `self_`'s
/// device.
///
/// # Safety
///
/// `ret` must be writable when non-null.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_clone_preserve_strides(
    self_: AtenTensorHandle,
    ret: *mut AtenTensorHandle,
) -> AotiTorchError {
    guard("aoti_torch_clone_preserve_strides", || {
        check_out(ret, "ret")?;
        let out = with_tensor(self_, "self", clone_preserve_strides)?;
        // SAFETY: non-null (checked) and writable by contract.
        unsafe { write_out(ret, "ret", new_handle(out)) }
    })
}

/// A new handle to the same view as `src` (a shallow copy: storage and
/// metadata shared), written to `ret_dst`.
///
/// # Safety
///
/// `ret_dst` must be writable when non-null.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_assign_tensors_out(
    src: AtenTensorHandle,
    ret_dst: *mut AtenTensorHandle,
) -> AotiTorchError {
    guard("aoti_torch_assign_tensors_out", || {
        check_out(ret_dst, "ret_dst")?;
        let alias = with_tensor(src, "src", |t| Ok(t.alias()))?;
        // SAFETY: non-null (checked) and writable by contract.
        unsafe { write_out(ret_dst, "ret_dst", new_handle(alias)) }
    })
}

/// Whether the handle holds a tensor: every live handle of this shim does
/// (it has no undefined tensors); an unknown handle is refused.
///
/// # Safety
///
/// `ret_is_defined` must be writable when non-null.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_is_defined(
    tensor: AtenTensorHandle,
    ret_is_defined: *mut bool,
) -> AotiTorchError {
    guard("aoti_torch_is_defined", || {
        check_out(ret_is_defined, "ret_is_defined")?;
        with_tensor(tensor, "tensor", |_| Ok(()))?;
        // SAFETY: non-null (checked) and writable by contract.
        unsafe { write_out(ret_is_defined, "ret_is_defined", true) }
    })
}

/// A warning of the generated code, written to stderr as c10 does (`func`,
/// `file` and `msg` may each be null).
///
/// # Safety
///
/// Each non-null pointer must be a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_warn(
    func: *const std::ffi::c_char,
    file: *const std::ffi::c_char,
    line: u32,
    msg: *const std::ffi::c_char,
) {
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: non-null and NUL-terminated by contract.
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned()
        }
    };
    let _ = std::panic::catch_unwind(|| {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "Warning: {} (function {} in {}:{line})",
            text(msg),
            text(func),
            text(file)
        );
    });
}
