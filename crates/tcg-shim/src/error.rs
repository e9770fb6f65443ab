//! Errors of the shim, the thread-local last error, and the guard that keeps
//! panics from crossing the C ABI.
//!
//! The generated code only sees `AOTI_TORCH_SUCCESS` (0) or
//! `AOTI_TORCH_FAILURE` (1); the reason is kept per thread, like `errno`, for
//! the runtime to read after a failed call ([`last_error`]). A successful call
//! leaves the previous error in place.

use std::any::Any;
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The `AOTITorchError` type of shim.h.
pub type AotiTorchError = i32;
/// `AOTI_TORCH_SUCCESS` of shim.h's macros.h.
pub const AOTI_TORCH_SUCCESS: AotiTorchError = 0;
/// `AOTI_TORCH_FAILURE` of shim.h's macros.h.
pub const AOTI_TORCH_FAILURE: AotiTorchError = 1;

/// Why a shim call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShimError {
    /// A pointer argument that must not be null was null.
    NullPointer {
        /// The parameter's name in shim.h.
        arg: &'static str,
    },
    /// A tensor handle that this shim did not create, or one already deleted.
    UnknownHandle {
        /// The parameter's name in shim.h.
        arg: &'static str,
        /// The handle's address.
        handle: usize,
    },
    /// A dtype number that is not one of shim.h's dtype constants.
    UnsupportedDtype {
        /// The number passed.
        code: i32,
    },
    /// A device this shim cannot serve (unknown type, bad index, or no
    /// allocator or operation for it yet).
    UnsupportedDevice {
        /// The c10 device type number passed.
        device_type: i32,
        /// The device index passed.
        device_index: i32,
        /// What is missing.
        reason: &'static str,
    },
    /// A size, stride, dimension count or offset outside what the call accepts.
    InvalidArgument {
        /// What was wrong, with the values.
        detail: String,
    },
    /// A size computation overflowed 64 bits.
    SizeOverflow {
        /// Which computation.
        detail: String,
    },
    /// A view that would read or write outside its storage.
    ViewOutOfBounds {
        /// Bytes of storage the view reaches (offset included).
        needed: u128,
        /// Bytes the storage has.
        storage: usize,
    },
    /// The allocator could not provide the memory.
    AllocationFailed {
        /// Bytes requested.
        nbytes: usize,
        /// Where (`cpu:-1`, `cuda:0`).
        device: String,
        /// The allocator's reason.
        reason: String,
    },
    /// `copy_` between tensors it cannot copy (dtype, shape or device).
    CopyMismatch {
        /// What differs.
        detail: String,
    },
    /// The CUDA driver (`libcuda.so.1`) cannot be used: not installed, a
    /// symbol missing, `cuInit` failed, or no device. The shim itself still
    /// loads and serves host memory.
    CudaUnavailable {
        /// Why, with the library's or the driver's words.
        reason: String,
    },
    /// A CUDA driver call returned an error.
    CudaDriver {
        /// The driver function (`cuMemcpyAsync`, ...).
        call: &'static str,
        /// The `CUresult` number.
        result: i32,
        /// The `CUresult` name (`CUDA_ERROR_INVALID_VALUE`), from `cuGetErrorName`.
        name: String,
    },
    /// A CUDA guard or stream guard handle that is not live on this thread
    /// (never created, already deleted, created on another thread, or of the
    /// other kind).
    UnknownGuard {
        /// The parameter's name in shim.h.
        arg: &'static str,
        /// The handle's value.
        handle: usize,
    },
    /// A copy between views on a device that this shim cannot do with one
    /// driver copy (strides that differ, or a view that is not dense on the
    /// device side).
    StridedDeviceCopy {
        /// The two layouts.
        detail: String,
    },
    /// A panic inside the shim, caught at the ABI boundary.
    Panic {
        /// The exported function that panicked.
        function: &'static str,
        /// The panic payload, when it was a string.
        message: String,
    },
}

// Display by hand rather than derived: the crate has no dependency at all, so
// that tcg-run's build script can compile it with `rustc` alone (the library
// it embeds; see the README, "Loading").
impl std::fmt::Display for ShimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShimError::NullPointer { arg, .. } => write!(f, "null pointer passed as {arg}"),
            ShimError::UnknownHandle { arg, handle, .. } => write!(
                f,
                "{arg} is not a live tensor handle of this shim ({handle:#x})"
            ),
            ShimError::UnsupportedDtype { code, .. } => write!(f, "unsupported dtype code {code}"),
            ShimError::UnsupportedDevice {
                device_index,
                device_type,
                reason,
                ..
            } => write!(
                f,
                "unsupported device (type {device_type}, index {device_index}): {reason}"
            ),
            ShimError::InvalidArgument { detail, .. } => write!(f, "invalid argument: {detail}"),
            ShimError::SizeOverflow { detail, .. } => write!(f, "size overflow: {detail}"),
            ShimError::ViewOutOfBounds {
                needed, storage, ..
            } => write!(
                f,
                "view out of bounds: needs {needed} bytes of a storage of {storage} bytes"
            ),
            ShimError::AllocationFailed {
                device,
                nbytes,
                reason,
                ..
            } => write!(
                f,
                "allocation of {nbytes} bytes on {device} failed: {reason}"
            ),
            ShimError::CopyMismatch { detail, .. } => write!(f, "copy refused: {detail}"),
            ShimError::CudaUnavailable { reason } => write!(f, "CUDA is not available: {reason}"),
            ShimError::CudaDriver { call, result, name } => {
                write!(f, "CUDA driver call {call} failed: {name} ({result})")
            }
            ShimError::UnknownGuard { arg, handle } => write!(
                f,
                "{arg} is not a live CUDA guard of this thread ({handle:#x})"
            ),
            ShimError::StridedDeviceCopy { detail } => write!(
                f,
                "strided copy on device memory is not supported: {detail}"
            ),
            ShimError::Panic {
                function, message, ..
            } => write!(f, "internal panic in {function}: {message}"),
        }
    }
}

impl std::error::Error for ShimError {}

impl ShimError {
    /// A stable code for the error, e.g. `shim.null_pointer`.
    pub fn code(&self) -> &'static str {
        match self {
            ShimError::NullPointer { .. } => "shim.null_pointer",
            ShimError::UnknownHandle { .. } => "shim.unknown_handle",
            ShimError::UnsupportedDtype { .. } => "shim.unsupported_dtype",
            ShimError::UnsupportedDevice { .. } => "shim.unsupported_device",
            ShimError::InvalidArgument { .. } => "shim.invalid_argument",
            ShimError::SizeOverflow { .. } => "shim.size_overflow",
            ShimError::ViewOutOfBounds { .. } => "shim.view_out_of_bounds",
            ShimError::AllocationFailed { .. } => "shim.allocation_failed",
            ShimError::CopyMismatch { .. } => "shim.copy_mismatch",
            ShimError::CudaUnavailable { .. } => "shim.cuda_unavailable",
            ShimError::CudaDriver { .. } => "shim.cuda_driver",
            ShimError::UnknownGuard { .. } => "shim.unknown_guard",
            ShimError::StridedDeviceCopy { .. } => "shim.strided_device_copy",
            ShimError::Panic { .. } => "shim.panic",
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<Option<ShimError>> = const { RefCell::new(None) };
}

/// The error of the last failed shim call on this thread, if any.
pub fn last_error() -> Option<ShimError> {
    LAST_ERROR.with(|e| e.borrow().clone())
}

/// The last error's message on this thread (`"<code>: <display>"`).
pub fn last_error_message() -> Option<String> {
    last_error().map(|e| format!("{}: {e}", e.code()))
}

/// Takes and clears this thread's last error.
pub fn take_last_error() -> Option<ShimError> {
    LAST_ERROR.with(|e| e.borrow_mut().take())
}

fn set_last_error(err: ShimError) {
    // `try_with`: a call made while the thread's locals are being torn down
    // still returns FAILURE, it only loses the message.
    let _ = LAST_ERROR.try_with(|e| {
        if let Ok(mut slot) = e.try_borrow_mut() {
            *slot = Some(err);
        }
    });
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs the body of an exported function: maps `Ok` to
/// [`AOTI_TORCH_SUCCESS`], an error or a panic to [`AOTI_TORCH_FAILURE`] with
/// the reason stored as this thread's last error.
pub(crate) fn guard(
    function: &'static str,
    body: impl FnOnce() -> Result<(), ShimError>,
) -> AotiTorchError {
    // AssertUnwindSafe: after a panic we only record a message; no state the
    // body touched is observed again except the handle registry, whose lock
    // ignores poisoning and whose set is only changed by single insert/remove
    // operations that cannot be left half-done.
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => AOTI_TORCH_SUCCESS,
        Ok(Err(err)) => {
            set_last_error(err);
            AOTI_TORCH_FAILURE
        }
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            // Dropping a payload can itself panic; forget it instead.
            std::mem::forget(payload);
            set_last_error(ShimError::Panic { function, message });
            AOTI_TORCH_FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_failure_with_its_message() {
        let rc = guard("test_fn", || panic!("boom {}", 7));
        assert_eq!(rc, AOTI_TORCH_FAILURE);
        let err = take_last_error().unwrap();
        assert_eq!(err.code(), "shim.panic");
        assert!(err.to_string().contains("boom 7"), "{err}");
        assert!(err.to_string().contains("test_fn"), "{err}");
    }

    #[test]
    fn success_keeps_the_previous_error_and_take_clears_it() {
        assert_eq!(
            guard("f", || Err(ShimError::NullPointer { arg: "x" })),
            AOTI_TORCH_FAILURE
        );
        assert_eq!(guard("f", || Ok(())), AOTI_TORCH_SUCCESS);
        assert_eq!(
            last_error_message().unwrap(),
            "shim.null_pointer: null pointer passed as x"
        );
        assert!(take_last_error().is_some());
        assert!(last_error().is_none());
    }
}
