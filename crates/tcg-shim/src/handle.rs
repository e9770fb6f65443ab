//! The registry of live tensor handles.
//!
//! A handle is the address of a boxed [`Tensor`]. Every handle this shim
//! returns is recorded until `aoti_torch_delete_tensor_object`; every handle
//! it receives is looked up first, so a null, foreign or already-deleted
//! handle is refused with an error instead of being dereferenced. (An address
//! freed and then reused by a new handle is indistinguishable from it; that
//! is the one misuse this cannot catch.)
//!
//! Lookups take a shared lock held for the whole use of the tensor, so a
//! delete on another thread waits for it to finish.

use std::collections::BTreeSet;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::error::ShimError;
use crate::tensor::Tensor;

/// `AtenTensorHandle` of shim.h: a pointer to our [`Tensor`], opaque to C.
pub type AtenTensorHandle = *mut Tensor;

static LIVE: RwLock<BTreeSet<usize>> = RwLock::new(BTreeSet::new());

fn read() -> RwLockReadGuard<'static, BTreeSet<usize>> {
    // Poisoning is ignored: the set is only changed by single insert/remove
    // calls, which cannot be left half-done by a panic.
    LIVE.read().unwrap_or_else(|p| p.into_inner())
}

fn write() -> RwLockWriteGuard<'static, BTreeSet<usize>> {
    LIVE.write().unwrap_or_else(|p| p.into_inner())
}

/// Boxes `tensor` and records the new handle.
pub fn new_handle(tensor: Tensor) -> AtenTensorHandle {
    let ptr = Box::into_raw(Box::new(tensor));
    write().insert(ptr as usize);
    ptr
}

fn check(
    live: &BTreeSet<usize>,
    handle: AtenTensorHandle,
    arg: &'static str,
) -> Result<(), ShimError> {
    if handle.is_null() {
        return Err(ShimError::NullPointer { arg });
    }
    if !live.contains(&(handle as usize)) {
        return Err(ShimError::UnknownHandle {
            arg,
            handle: handle as usize,
        });
    }
    Ok(())
}

/// Runs `f` on the tensor behind `handle`, refusing null and unknown handles.
/// `arg` names the parameter in errors.
// Safe to call with any pointer value: it is dereferenced only after the
// registry has confirmed it is a live handle of ours.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn with_tensor<R>(
    handle: AtenTensorHandle,
    arg: &'static str,
    f: impl FnOnce(&Tensor) -> Result<R, ShimError>,
) -> Result<R, ShimError> {
    let live = read();
    check(&live, handle, arg)?;
    // SAFETY: the handle is in the live set, so it is a `Box<Tensor>` from
    // `new_handle` not yet freed; freeing takes the write lock, which waits
    // for our read guard, so the reference outlives no free.
    let tensor = unsafe { &*handle };
    f(tensor)
}

/// Runs `f` on the tensors behind two handles (they may be the same).
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn with_tensors<R>(
    a: AtenTensorHandle,
    a_arg: &'static str,
    b: AtenTensorHandle,
    b_arg: &'static str,
    f: impl FnOnce(&Tensor, &Tensor) -> Result<R, ShimError>,
) -> Result<R, ShimError> {
    let live = read();
    check(&live, a, a_arg)?;
    check(&live, b, b_arg)?;
    // SAFETY: as in `with_tensor`, for both handles; shared references to
    // one tensor twice are fine.
    let (ta, tb) = unsafe { (&*a, &*b) };
    f(ta, tb)
}

/// Removes `handle` from the live set and frees its tensor (and the storage,
/// if it was the last view of it).
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn delete_handle(handle: AtenTensorHandle, arg: &'static str) -> Result<(), ShimError> {
    let boxed = {
        let mut live = write();
        check(&live, handle, arg)?;
        live.remove(&(handle as usize));
        // SAFETY: the handle was live, hence a `Box<Tensor>` from `new_handle`
        // that nobody else frees: we removed it from the set under the write
        // lock, so no other delete or lookup can reach it any more.
        unsafe { Box::from_raw(handle) }
    };
    // Dropped outside the lock: freeing storage may call a device allocator.
    drop(boxed);
    Ok(())
}

/// Number of live handles in the process (for leak checks in tests and logs).
pub fn live_handle_count() -> usize {
    read().len()
}
