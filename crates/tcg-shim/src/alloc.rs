//! Where storage bytes come from: the [`Allocator`] trait, the host
//! allocator, the per-device-type registry and the thread's current stream.
//!
//! The tensor code never allocates directly: [`crate::Storage::allocate`]
//! asks [`allocator_for`] and hands the block back to the same allocator, on
//! the same stream, when the last view of it is gone. A stream-ordered CUDA
//! allocator (`cuMemAllocAsync` / `cuMemFreeAsync` on the current stream,
//! which a CUDA-graph capture records as graph memory nodes) is a second
//! implementation registered with [`register_allocator`] for
//! [`DeviceType::Cuda`]; nothing in the tensor code changes.

use std::alloc::Layout;
use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::{Arc, RwLock};

use crate::dtype::{Device, DeviceType};
use crate::error::ShimError;

/// An opaque stream handle (a `cudaStream_t` on CUDA; ignored on the host).
///
/// Kept as an address so that it is `Send` and `Sync`; the allocator that
/// receives it is the only one that interprets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Stream(pub usize);

impl Stream {
    /// The default stream (a null `cudaStream_t`; the only stream of the host).
    pub const DEFAULT: Stream = Stream(0);

    /// The stream as the raw pointer the driver API takes.
    pub fn as_ptr(self) -> *mut c_void {
        self.0 as *mut c_void
    }
}

/// A source of storage memory for one device type.
///
/// Implementations must be thread-safe: tensors are created and dropped on
/// any thread.
pub trait Allocator: Send + Sync {
    /// Allocates `nbytes` (> 0) on `device`, ordered on `stream` for
    /// stream-ordered allocators. The block must be aligned to at least 64
    /// bytes (what c10 guarantees and generated kernels assume for vector loads).
    fn allocate(
        &self,
        nbytes: usize,
        device: Device,
        stream: Stream,
    ) -> Result<*mut c_void, ShimError>;

    /// Returns a block to the allocator.
    ///
    /// # Safety
    ///
    /// `ptr` must come from `self.allocate(nbytes, device, stream)` with the
    /// same `nbytes`, `device` and `stream`, and must not be used afterwards
    /// (on a stream-ordered allocator: by work enqueued after this call on
    /// streams not ordered after `stream`).
    unsafe fn free(&self, ptr: *mut c_void, nbytes: usize, device: Device, stream: Stream);
}

/// Alignment of every host block, as c10's CPU allocator uses.
pub const HOST_ALIGNMENT: usize = 64;

/// Host memory from the global Rust allocator, 64-byte aligned.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostAllocator;

impl HostAllocator {
    fn layout(nbytes: usize) -> Result<Layout, ShimError> {
        Layout::from_size_align(nbytes, HOST_ALIGNMENT).map_err(|e| ShimError::AllocationFailed {
            nbytes,
            device: Device::CPU.to_string(),
            reason: e.to_string(),
        })
    }
}

impl Allocator for HostAllocator {
    fn allocate(
        &self,
        nbytes: usize,
        device: Device,
        _stream: Stream,
    ) -> Result<*mut c_void, ShimError> {
        if nbytes == 0 {
            return Err(ShimError::InvalidArgument {
                detail: "zero-byte allocation requested from the host allocator".to_string(),
            });
        }
        let layout = Self::layout(nbytes)?;
        // SAFETY: the layout has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(ShimError::AllocationFailed {
                nbytes,
                device: device.to_string(),
                reason: "out of host memory".to_string(),
            });
        }
        Ok(ptr.cast())
    }

    unsafe fn free(&self, ptr: *mut c_void, nbytes: usize, _device: Device, _stream: Stream) {
        // The layout was valid when the block was allocated, so it is now.
        if let Ok(layout) = Self::layout(nbytes) {
            // SAFETY: the caller guarantees `ptr` came from `allocate(nbytes)`,
            // which used this very layout, and is not used again.
            unsafe { std::alloc::dealloc(ptr.cast(), layout) };
        }
    }
}

static CUDA_ALLOCATOR: RwLock<Option<Arc<dyn Allocator>>> = RwLock::new(None);

/// Installs the allocator for a device type. The host allocator is built in
/// and cannot be replaced (a [`DeviceType::Cpu`] registration is refused).
/// Returns the previous allocator for that type; storage allocated by it
/// keeps its own reference and is freed by it.
pub fn register_allocator(
    device_type: DeviceType,
    allocator: Arc<dyn Allocator>,
) -> Result<Option<Arc<dyn Allocator>>, ShimError> {
    match device_type {
        DeviceType::Cpu => Err(ShimError::InvalidArgument {
            detail: "the host allocator is built in and cannot be replaced".to_string(),
        }),
        DeviceType::Cuda => {
            let mut slot = CUDA_ALLOCATOR.write().unwrap_or_else(|p| p.into_inner());
            Ok(slot.replace(allocator))
        }
    }
}

/// The allocator for `device`, or `shim.unsupported_device` when none is
/// registered for its type.
pub fn allocator_for(device: Device) -> Result<Arc<dyn Allocator>, ShimError> {
    match device.device_type {
        DeviceType::Cpu => Ok(Arc::new(HostAllocator)),
        DeviceType::Cuda => {
            if let Some(registered) = CUDA_ALLOCATOR
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
            {
                return Ok(registered);
            }
            // None registered: the driver-backed pool allocator, installed
            // once the driver is known to work (`shim.cuda_unavailable`
            // otherwise, asked again on the next allocation).
            crate::cuda::driver()?;
            let mut slot = CUDA_ALLOCATOR.write().unwrap_or_else(|p| p.into_inner());
            Ok(slot
                .get_or_insert_with(|| Arc::new(crate::cuda::CudaAllocator))
                .clone())
        }
    }
}

thread_local! {
    static CURRENT_STREAMS: RefCell<Vec<(Device, Stream)>> = const { RefCell::new(Vec::new()) };
}

/// This thread's current stream on `device` ([`Stream::DEFAULT`] unless set).
/// `aoti_torch_empty_strided` allocates on it; the stream guards of shim.h
/// will set it.
pub fn current_stream(device: Device) -> Stream {
    CURRENT_STREAMS
        .try_with(|s| {
            s.borrow()
                .iter()
                .find(|(d, _)| *d == device)
                .map(|(_, st)| *st)
                .unwrap_or(Stream::DEFAULT)
        })
        .unwrap_or(Stream::DEFAULT)
}

/// Sets this thread's current stream on `device`, returning the previous one.
pub fn set_current_stream(device: Device, stream: Stream) -> Stream {
    CURRENT_STREAMS.with(|s| {
        let mut s = s.borrow_mut();
        match s.iter_mut().find(|(d, _)| *d == device) {
            Some((_, st)) => std::mem::replace(st, stream),
            None => {
                s.push((device, stream));
                Stream::DEFAULT
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_blocks_are_aligned_and_zero_bytes_are_refused() {
        let a = HostAllocator;
        for n in [1usize, 3, 64, 1000] {
            let p = a.allocate(n, Device::CPU, Stream::DEFAULT).unwrap();
            assert_eq!(p as usize % HOST_ALIGNMENT, 0);
            // SAFETY: `p` came from `allocate(n)` on this allocator.
            unsafe { a.free(p, n, Device::CPU, Stream::DEFAULT) };
        }
        assert!(a.allocate(0, Device::CPU, Stream::DEFAULT).is_err());
    }

    #[test]
    fn the_host_allocator_cannot_be_replaced() {
        match register_allocator(DeviceType::Cpu, Arc::new(HostAllocator)) {
            Err(err) => assert_eq!(err.code(), "shim.invalid_argument"),
            Ok(_) => panic!("the host allocator was replaced"),
        }
    }

    #[test]
    fn current_stream_is_per_device_and_per_thread() {
        let dev = Device {
            device_type: DeviceType::Cuda,
            index: 0,
        };
        assert_eq!(current_stream(dev), Stream::DEFAULT);
        assert_eq!(set_current_stream(dev, Stream(0x10)), Stream::DEFAULT);
        assert_eq!(current_stream(dev), Stream(0x10));
        assert_eq!(current_stream(Device { index: 1, ..dev }), Stream::DEFAULT);
        std::thread::spawn(move || assert_eq!(current_stream(dev), Stream::DEFAULT))
            .join()
            .unwrap();
        assert_eq!(set_current_stream(dev, Stream::DEFAULT), Stream(0x10));
    }
}
