//! A libtorch-free implementation of the `aoti_torch_*` C shim that
//! AOTInductor packages call (issue 34, item 2): host memory, and CUDA
//! through the driver API opened at run time.
//!
//! See the crate's README.md for what exists, what comes next and how a
//! package's `.so` will be bound to this library and only to it.
#![deny(missing_docs)]
#![doc = include_str!("../README.md")]

pub mod alloc;
pub mod check;
mod copy;
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod ffi;
pub mod ffi_cuda;
pub mod guards;
mod handle;
pub mod tensor;

pub use alloc::{Allocator, HostAllocator, Stream};
pub use copy::{clone_host, clone_preserve_strides, copy_host, copy_tensor};
pub use dtype::{DType, Device, DeviceType};
pub use error::{
    last_error, last_error_message, take_last_error, AotiTorchError, ShimError, AOTI_TORCH_FAILURE,
    AOTI_TORCH_SUCCESS,
};
pub use ffi::*;
pub use ffi_cuda::*;
pub use handle::{live_handle_count, with_tensor, AtenTensorHandle};
pub use tensor::{Storage, Tensor, MAX_DIMS};
