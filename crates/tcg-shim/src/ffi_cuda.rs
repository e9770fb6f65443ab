//! The CUDA functions of shim.h (guards, stream guards, the current stream)
//! and the runtime's setter, with shim.h's exact signatures.
//!
//! `CUDAGuardHandle` and `CUDAStreamGuardHandle` are opaque pointers to C;
//! here they carry a guard number ([`crate::guards`]), never an address, so
//! a bad handle is refused without being dereferenced.

use std::ffi::c_void;

use crate::alloc::{set_current_stream, Stream};
use crate::dtype::{Device, DeviceType};
use crate::error::{guard, AotiTorchError, ShimError};
use crate::guards::{self, DriverBackend, GuardKind};

/// `CUDAGuardHandle` of shim.h.
pub type CudaGuardHandle = *mut c_void;
/// `CUDAStreamGuardHandle` of shim.h.
pub type CudaStreamGuardHandle = *mut c_void;

fn out<T>(ret: *mut T, arg: &'static str) -> Result<(), ShimError> {
    if ret.is_null() {
        Err(ShimError::NullPointer { arg })
    } else {
        Ok(())
    }
}

/// Makes `device_index` the thread's current CUDA device (its primary
/// context) until the guard is deleted.
///
/// # Safety
///
/// `ret_guard` must be writable when non-null.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_create_cuda_guard(
    device_index: i32,
    ret_guard: *mut CudaGuardHandle,
) -> AotiTorchError {
    guard("aoti_torch_create_cuda_guard", || {
        out(ret_guard, "ret_guard")?;
        let id = guards::create_device_guard(&DriverBackend, device_index)?;
        // SAFETY: non-null (checked) and writable by contract.
        unsafe { ret_guard.write(id as CudaGuardHandle) };
        Ok(())
    })
}

/// Deletes a CUDA guard, restoring the device it replaced.
///
/// # Safety
///
/// None beyond the C contract: the handle is looked up, not dereferenced.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_delete_cuda_guard(guard_: CudaGuardHandle) -> AotiTorchError {
    guard("aoti_torch_delete_cuda_guard", || {
        guards::delete_guard(&DriverBackend, guard_ as usize, GuardKind::Device, "guard")
    })
}

/// Switches a live CUDA guard to `device_index` (it still restores the
/// device it found when created).
///
/// # Safety
///
/// None beyond the C contract: the handle is looked up, not dereferenced.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_cuda_guard_set_index(
    guard_: CudaGuardHandle,
    device_index: i32,
) -> AotiTorchError {
    guard("aoti_torch_cuda_guard_set_index", || {
        guards::set_guard_index(&DriverBackend, guard_ as usize, device_index, "guard")
    })
}

/// Makes `device_index` current and `stream` (a `cudaStream_t` of that
/// device, or null for the legacy default stream) its current stream until
/// the guard is deleted.
///
/// # Safety
///
/// `ret_guard` must be writable when non-null.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_create_cuda_stream_guard(
    stream: *mut c_void,
    device_index: i32,
    ret_guard: *mut CudaStreamGuardHandle,
) -> AotiTorchError {
    guard("aoti_torch_create_cuda_stream_guard", || {
        out(ret_guard, "ret_guard")?;
        let id =
            guards::create_stream_guard(&DriverBackend, Stream(stream as usize), device_index)?;
        // SAFETY: non-null (checked) and writable by contract.
        unsafe { ret_guard.write(id as CudaStreamGuardHandle) };
        Ok(())
    })
}

/// Deletes a stream guard, restoring the device and stream it replaced.
///
/// # Safety
///
/// None beyond the C contract: the handle is looked up, not dereferenced.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_delete_cuda_stream_guard(
    guard_: CudaStreamGuardHandle,
) -> AotiTorchError {
    guard("aoti_torch_delete_cuda_stream_guard", || {
        guards::delete_guard(&DriverBackend, guard_ as usize, GuardKind::Stream, "guard")
    })
}

/// The thread's current stream of CUDA device `device_index` (`-1`: the
/// current device): the legacy default stream (null) unless a stream guard
/// or [`tcg_shim_set_current_cuda_stream`] set another.
///
/// # Safety
///
/// `ret_stream` must be writable when non-null.
#[no_mangle]
pub unsafe extern "C" fn aoti_torch_get_current_cuda_stream(
    device_index: i32,
    ret_stream: *mut *mut c_void,
) -> AotiTorchError {
    guard("aoti_torch_get_current_cuda_stream", || {
        out(ret_stream, "ret_stream")?;
        let stream = if device_index >= 0 {
            crate::alloc::current_stream(Device {
                device_type: DeviceType::Cuda,
                index: device_index,
            })
        } else {
            guards::current_cuda_stream(&DriverBackend, device_index)?
        };
        // SAFETY: non-null (checked) and writable by contract.
        unsafe { ret_stream.write(stream.as_ptr()) };
        Ok(())
    })
}

/// Not part of shim.h: sets this thread's current stream of CUDA device
/// `device_index` (>= 0) without a guard, for the runtime driving a graph
/// (tcg-run) before it calls the container. Returns the previous stream
/// through `ret_previous` when non-null.
///
/// # Safety
///
/// `ret_previous` must be writable when non-null.
#[no_mangle]
pub unsafe extern "C" fn tcg_shim_set_current_cuda_stream(
    device_index: i32,
    stream: *mut c_void,
    ret_previous: *mut *mut c_void,
) -> AotiTorchError {
    guard("tcg_shim_set_current_cuda_stream", || {
        if device_index < 0 {
            return Err(ShimError::UnsupportedDevice {
                device_type: DeviceType::Cuda.code(),
                device_index,
                reason: "the stream setter needs a device index >= 0",
            });
        }
        let previous = set_current_stream(
            Device {
                device_type: DeviceType::Cuda,
                index: device_index,
            },
            Stream(stream as usize),
        );
        if !ret_previous.is_null() {
            // SAFETY: non-null and writable by contract.
            unsafe { ret_previous.write(previous.as_ptr()) };
        }
        Ok(())
    })
}

/// Not part of shim.h: whether this shim can use CUDA in this process (the
/// driver loads, initialises and sees a device). `0` yes, `1` no with the
/// reason (`shim.cuda_unavailable`) as the thread's last error.
#[no_mangle]
pub extern "C" fn tcg_shim_cuda_available() -> AotiTorchError {
    guard("tcg_shim_cuda_available", || {
        crate::cuda::driver().map(|_| ())
    })
}
