//! The thread's current CUDA device and the CUDA guards of shim.h.
//!
//! A guard sets a value (the current device; or, for a stream guard, the
//! current device and that device's current stream) and restores what was
//! current before it when deleted. Guards live on a per-thread stack. Deleted
//! in the reverse order of creation (what the generated code's RAII guards
//! do), each restores the value it found, as c10's guards do. Deleted in any
//! other order, the result is still sane: deleting a guard that is not the
//! newest of its value hands what it would have restored to the next newer
//! guard of that value, so the current value is always the one set by the
//! newest live guard, and the value before the first guard once all are gone.
//!
//! A guard handle is a number, never an address: it is looked up in this
//! thread's stack, so a null, foreign, already-deleted or other-thread handle,
//! or a stream guard passed to `aoti_torch_delete_cuda_guard`, is refused
//! (`shim.unknown_guard`) and nothing is dereferenced.
//!
//! The device is applied through a [`DeviceBackend`]: the driver's primary
//! contexts in the library ([`DriverBackend`]), a recording fake in the unit
//! tests. Streams are the bookkeeping of [`crate::alloc::current_stream`].

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::alloc::{current_stream, set_current_stream, Stream};
use crate::dtype::{Device, DeviceType};
use crate::error::ShimError;

/// Where the current device really lives (the driver's current context).
pub trait DeviceBackend {
    /// The thread's current device index (0 when none was ever set, as
    /// `cudaGetDevice` answers).
    fn current(&self) -> Result<i32, ShimError>;
    /// Makes `index` the thread's current device.
    fn set(&self, index: i32) -> Result<(), ShimError>;
}

/// The driver: a device's primary context made current.
#[derive(Debug, Default, Clone, Copy)]
pub struct DriverBackend;

impl DeviceBackend for DriverBackend {
    fn current(&self) -> Result<i32, ShimError> {
        Ok(crate::cuda::current_device()?.unwrap_or(0))
    }

    fn set(&self, index: i32) -> Result<(), ShimError> {
        crate::cuda::set_device(index)
    }
}

/// Which kind of guard a handle is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardKind {
    /// `aoti_torch_create_cuda_guard`.
    Device,
    /// `aoti_torch_create_cuda_stream_guard`.
    Stream,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Device,
    Stream(i32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Value {
    Device(i32),
    Stream(Stream),
}

#[derive(Debug)]
struct Entry {
    id: usize,
    kind: GuardKind,
    slot: Slot,
    restore: Value,
}

thread_local! {
    static STACK: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

fn cuda(index: i32) -> Device {
    Device {
        device_type: DeviceType::Cuda,
        index,
    }
}

fn apply(backend: &dyn DeviceBackend, slot: Slot, value: Value) -> Result<(), ShimError> {
    match (slot, value) {
        (Slot::Device, Value::Device(i)) => backend.set(i),
        (Slot::Stream(d), Value::Stream(s)) => {
            set_current_stream(cuda(d), s);
            Ok(())
        }
        _ => Ok(()),
    }
}

fn check_index(index: i32) -> Result<(), ShimError> {
    if index < 0 {
        return Err(ShimError::UnsupportedDevice {
            device_type: DeviceType::Cuda.code(),
            device_index: index,
            reason: "a CUDA guard needs a device index >= 0",
        });
    }
    Ok(())
}

/// Creates a device guard: makes `index` current, returns the handle.
pub fn create_device_guard(backend: &dyn DeviceBackend, index: i32) -> Result<usize, ShimError> {
    check_index(index)?;
    let previous = backend.current()?;
    backend.set(index)?;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    STACK.with(|s| {
        s.borrow_mut().push(Entry {
            id,
            kind: GuardKind::Device,
            slot: Slot::Device,
            restore: Value::Device(previous),
        })
    });
    Ok(id)
}

/// Creates a stream guard: makes `index` current and `stream` its current
/// stream, returns the handle.
pub fn create_stream_guard(
    backend: &dyn DeviceBackend,
    stream: Stream,
    index: i32,
) -> Result<usize, ShimError> {
    check_index(index)?;
    let previous_device = backend.current()?;
    backend.set(index)?;
    let previous_stream = set_current_stream(cuda(index), stream);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        s.push(Entry {
            id,
            kind: GuardKind::Stream,
            slot: Slot::Device,
            restore: Value::Device(previous_device),
        });
        s.push(Entry {
            id,
            kind: GuardKind::Stream,
            slot: Slot::Stream(index),
            restore: Value::Stream(previous_stream),
        });
    });
    Ok(id)
}

fn unknown(arg: &'static str, id: usize) -> ShimError {
    ShimError::UnknownGuard { arg, handle: id }
}

/// Deletes guard `id` of `kind`, restoring (or handing on) what it replaced.
pub fn delete_guard(
    backend: &dyn DeviceBackend,
    id: usize,
    kind: GuardKind,
    arg: &'static str,
) -> Result<(), ShimError> {
    let restores = STACK.with(|s| -> Result<Vec<(Slot, Value)>, ShimError> {
        let mut s = s.borrow_mut();
        if id == 0 || !s.iter().any(|e| e.id == id && e.kind == kind) {
            return Err(unknown(arg, id));
        }
        let mut restores = Vec::new();
        while let Some(i) = s.iter().position(|e| e.id == id) {
            let entry = s.remove(i);
            match s[i..].iter_mut().find(|e| e.slot == entry.slot) {
                // A newer guard of the same value is live: it restores what
                // this one would have.
                Some(newer) => newer.restore = entry.restore,
                None => restores.push((entry.slot, entry.restore)),
            }
        }
        Ok(restores)
    })?;
    let mut result = Ok(());
    for (slot, value) in restores {
        if let Err(e) = apply(backend, slot, value) {
            result = result.and(Err(e));
        }
    }
    result
}

/// `CUDAGuard::set_index`: makes `index` current now; the guard still
/// restores what it found when it was created.
pub fn set_guard_index(
    backend: &dyn DeviceBackend,
    id: usize,
    index: i32,
    arg: &'static str,
) -> Result<(), ShimError> {
    check_index(index)?;
    let live = STACK.with(|s| {
        s.borrow()
            .iter()
            .any(|e| e.id == id && e.kind == GuardKind::Device)
    });
    if id == 0 || !live {
        return Err(unknown(arg, id));
    }
    backend.set(index)
}

/// Number of live guards on this thread (both kinds).
pub fn live_guards() -> usize {
    STACK.with(|s| {
        let s = s.borrow();
        let mut ids: Vec<usize> = s.iter().map(|e| e.id).collect();
        ids.dedup();
        ids.len()
    })
}

/// The thread's current CUDA device index, from the driver.
pub fn current_device_index() -> Result<i32, ShimError> {
    DriverBackend.current()
}

/// The thread's current stream of CUDA device `index` (`-1`: the current
/// device).
pub fn current_cuda_stream(backend: &dyn DeviceBackend, index: i32) -> Result<Stream, ShimError> {
    let index = if index < 0 { backend.current()? } else { index };
    Ok(current_stream(cuda(index)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A device that records every switch.
    #[derive(Default)]
    struct Fake {
        current: Cell<i32>,
        sets: RefCell<Vec<i32>>,
        fail_on: Cell<Option<i32>>,
    }

    impl DeviceBackend for Fake {
        fn current(&self) -> Result<i32, ShimError> {
            Ok(self.current.get())
        }
        fn set(&self, index: i32) -> Result<(), ShimError> {
            if self.fail_on.get() == Some(index) {
                return Err(ShimError::CudaDriver {
                    call: "cuCtxSetCurrent",
                    result: 101,
                    name: "CUDA_ERROR_INVALID_DEVICE".into(),
                });
            }
            self.current.set(index);
            self.sets.borrow_mut().push(index);
            Ok(())
        }
    }

    fn stream_of(index: i32) -> Stream {
        current_stream(cuda(index))
    }

    #[test]
    fn nested_device_guards_restore_in_reverse_order() {
        let f = Fake::default();
        let a = create_device_guard(&f, 1).unwrap();
        let b = create_device_guard(&f, 2).unwrap();
        assert_eq!(f.current.get(), 2);
        delete_guard(&f, b, GuardKind::Device, "guard").unwrap();
        assert_eq!(f.current.get(), 1);
        delete_guard(&f, a, GuardKind::Device, "guard").unwrap();
        assert_eq!(f.current.get(), 0);
        assert_eq!(*f.sets.borrow(), [1, 2, 1, 0]);
        assert_eq!(live_guards(), 0);
    }

    #[test]
    fn deleting_the_older_guard_first_keeps_the_newer_value_then_restores_the_original() {
        let f = Fake::default();
        f.current.set(3);
        let a = create_device_guard(&f, 1).unwrap();
        let b = create_device_guard(&f, 2).unwrap();
        delete_guard(&f, a, GuardKind::Device, "guard").unwrap();
        assert_eq!(f.current.get(), 2, "the newest live guard's device stays");
        delete_guard(&f, b, GuardKind::Device, "guard").unwrap();
        assert_eq!(f.current.get(), 3, "the device before the first guard");
    }

    #[test]
    fn stream_guards_set_and_restore_device_and_stream_per_device() {
        let f = Fake::default();
        let dev = create_device_guard(&f, 1).unwrap();
        let s1 = create_stream_guard(&f, Stream(0x100), 0).unwrap();
        assert_eq!((f.current.get(), stream_of(0)), (0, Stream(0x100)));
        let s2 = create_stream_guard(&f, Stream(0x200), 0).unwrap();
        let s3 = create_stream_guard(&f, Stream(0x300), 1).unwrap();
        assert_eq!(stream_of(0), Stream(0x200));
        assert_eq!(stream_of(1), Stream(0x300));
        assert_eq!(current_cuda_stream(&f, -1).unwrap(), Stream(0x300));
        // Out of order: the middle one first.
        delete_guard(&f, s2, GuardKind::Stream, "guard").unwrap();
        assert_eq!(stream_of(0), Stream(0x100), "s2 restored s1's stream");
        assert_eq!(f.current.get(), 1, "s3 is still the newest device setter");
        delete_guard(&f, s3, GuardKind::Stream, "guard").unwrap();
        assert_eq!((f.current.get(), stream_of(1)), (0, Stream::DEFAULT));
        delete_guard(&f, s1, GuardKind::Stream, "guard").unwrap();
        assert_eq!((f.current.get(), stream_of(0)), (1, Stream::DEFAULT));
        delete_guard(&f, dev, GuardKind::Device, "guard").unwrap();
        assert_eq!(f.current.get(), 0);
        assert_eq!(live_guards(), 0);
    }

    #[test]
    fn set_index_switches_now_and_the_guard_still_restores_the_original() {
        let f = Fake::default();
        let g = create_device_guard(&f, 1).unwrap();
        set_guard_index(&f, g, 2, "guard").unwrap();
        assert_eq!(f.current.get(), 2);
        delete_guard(&f, g, GuardKind::Device, "guard").unwrap();
        assert_eq!(f.current.get(), 0);
    }

    #[test]
    fn unknown_deleted_foreign_and_wrong_kind_handles_are_refused() {
        let f = Fake::default();
        let code = |r: Result<(), ShimError>| r.unwrap_err().code();
        assert_eq!(
            code(delete_guard(&f, 0, GuardKind::Device, "guard")),
            "shim.unknown_guard"
        );
        let s = create_stream_guard(&f, Stream(0x10), 0).unwrap();
        assert_eq!(
            code(delete_guard(&f, s, GuardKind::Device, "guard")),
            "shim.unknown_guard"
        );
        assert_eq!(
            code(set_guard_index(&f, s, 1, "guard")),
            "shim.unknown_guard"
        );
        let other_thread = std::thread::spawn(move || {
            let f = Fake::default();
            delete_guard(&f, s, GuardKind::Stream, "guard")
                .unwrap_err()
                .code()
        });
        assert_eq!(other_thread.join().unwrap(), "shim.unknown_guard");
        delete_guard(&f, s, GuardKind::Stream, "guard").unwrap();
        assert_eq!(
            code(delete_guard(&f, s, GuardKind::Stream, "guard")),
            "shim.unknown_guard",
            "a second delete"
        );
        assert_eq!(
            create_device_guard(&f, -1).unwrap_err().code(),
            "shim.unsupported_device"
        );
    }

    #[test]
    fn a_failing_switch_creates_no_guard() {
        let f = Fake::default();
        f.fail_on.set(Some(7));
        assert_eq!(
            create_device_guard(&f, 7).unwrap_err().code(),
            "shim.cuda_driver"
        );
        assert_eq!(live_guards(), 0);
        assert_eq!(f.current.get(), 0);
    }

    #[test]
    fn each_thread_has_its_own_guards_and_streams() {
        let f = Fake::default();
        let g = create_stream_guard(&f, Stream(0x77), 0).unwrap();
        std::thread::spawn(|| {
            assert_eq!(stream_of(0), Stream::DEFAULT);
            assert_eq!(live_guards(), 0);
        })
        .join()
        .unwrap();
        delete_guard(&f, g, GuardKind::Stream, "guard").unwrap();
    }
}
