//! A device allocator plugs in without the tensor code knowing: a recording
//! allocator registered for CUDA (backed by host memory, so no GPU is needed)
//! sees every allocation and free with the device and the stream that was
//! current when the storage was allocated. Its own test binary: the
//! registration is process-wide.

mod common;

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use common::*;
use tcg_shim::alloc::{register_allocator, set_current_stream};
use tcg_shim::*;

/// What happened, the block's address, its size, device and stream.
type Event = (&'static str, usize, usize, Device, Stream);

#[derive(Default)]
struct Recording {
    events: Mutex<Vec<Event>>,
}

impl Allocator for Recording {
    fn allocate(
        &self,
        nbytes: usize,
        device: Device,
        stream: Stream,
    ) -> Result<*mut c_void, ShimError> {
        let p = HostAllocator.allocate(nbytes, Device::CPU, Stream::DEFAULT)?;
        self.events
            .lock()
            .unwrap()
            .push(("alloc", p as usize, nbytes, device, stream));
        Ok(p)
    }

    unsafe fn free(&self, ptr: *mut c_void, nbytes: usize, device: Device, stream: Stream) {
        self.events
            .lock()
            .unwrap()
            .push(("free", ptr as usize, nbytes, device, stream));
        // SAFETY: `ptr` came from `HostAllocator.allocate(nbytes)` above.
        unsafe { HostAllocator.free(ptr, nbytes, Device::CPU, Stream::DEFAULT) };
    }
}

#[test]
fn a_registered_device_allocator_serves_empty_strided_on_the_current_stream() {
    let rec = Arc::new(Recording::default());
    assert!(register_allocator(DeviceType::Cuda, rec.clone())
        .unwrap()
        .is_none());
    let cuda0 = Device {
        device_type: DeviceType::Cuda,
        index: 0,
    };
    set_current_stream(cuda0, Stream(0x5000));

    let h = empty(&[4, 4], &[4, 1], aoti_torch_dtype_bfloat16(), 1, 0).unwrap();
    assert_eq!(get_i32(aoti_torch_get_device_type, h), 1);
    assert_eq!(get_i32(aoti_torch_get_device_index, h), 0);
    let view = reinterpret(h, &[4], &[1], 12).unwrap();
    // The stream changes before the free: the block goes back on the stream
    // it was allocated on.
    set_current_stream(cuda0, Stream(0x6000));
    delete(h);
    {
        let ev = rec.events.lock().unwrap();
        assert_eq!(ev.len(), 1, "a live view keeps the block");
        assert_eq!(
            (ev[0].0, ev[0].2, ev[0].3, ev[0].4),
            ("alloc", 32, cuda0, Stream(0x5000))
        );
    }
    // A device view copied onto itself is refused before any driver call
    // (one cuMemcpyAsync cannot copy overlapping device memory).
    // SAFETY: handles are checked.
    unsafe {
        fails(aoti_torch_copy_(view, view, 0), "shim.strided_device_copy");
    }
    delete(view);
    let ev = rec.events.lock().unwrap();
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[1].0, "free");
    assert_eq!(
        (ev[1].1, ev[1].2, ev[1].3, ev[1].4),
        (ev[0].1, 32, cuda0, Stream(0x5000))
    );
    // Zero-byte tensors never reach the allocator.
    drop(ev);
    let z = empty(&[0], &[1], aoti_torch_dtype_float32(), 1, 0).unwrap();
    delete(z);
    assert_eq!(rec.events.lock().unwrap().len(), 2);
}
