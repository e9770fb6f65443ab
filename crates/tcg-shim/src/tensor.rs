//! The tensor behind an `AtenTensorHandle`: a view (sizes, strides, storage
//! offset, dtype) over a reference-counted [`Storage`].
//!
//! Views made by `_reinterpret_tensor` share the storage; the storage frees
//! its block through the allocator that made it when the last view is
//! dropped, whatever the order of deletion.

use std::ffi::c_void;
use std::sync::Arc;

use crate::alloc::{allocator_for, current_stream, Allocator, Stream};
use crate::dtype::{DType, Device};
use crate::error::ShimError;

/// The most dimensions a tensor may have. c10 has no hard limit; a bound
/// keeps a garbage `ndim` from the C side from reading megabytes.
pub const MAX_DIMS: usize = 64;

struct Owner {
    allocator: Arc<dyn Allocator>,
    stream: Stream,
}

/// A block of memory on one device, owned (freed when dropped) or borrowed
/// (`create_tensor_from_blob`: the caller keeps ownership).
pub struct Storage {
    ptr: *mut c_void,
    nbytes: usize,
    device: Device,
    owner: Option<Owner>,
}

// SAFETY: `Storage` only carries the address of its block; it never reads or
// writes through it. Allocators are `Send + Sync` by the trait's bound, and
// freeing from whichever thread drops the last reference is what they accept.
unsafe impl Send for Storage {}
// SAFETY: as above; all methods take `&self` and read plain fields.
unsafe impl Sync for Storage {}

impl Storage {
    /// Allocates `nbytes` on `device` from its registered allocator, on this
    /// thread's current stream. Zero bytes allocate nothing (a null pointer).
    pub fn allocate(nbytes: usize, device: Device) -> Result<Arc<Storage>, ShimError> {
        if nbytes == 0 {
            return Ok(Arc::new(Storage {
                ptr: std::ptr::null_mut(),
                nbytes: 0,
                device,
                owner: None,
            }));
        }
        // `cuda:-1` is the thread's current device, fixed now (as c10 does).
        let device = crate::cuda::resolve(device)?;
        let allocator = allocator_for(device)?;
        let stream = current_stream(device);
        let ptr = allocator.allocate(nbytes, device, stream)?;
        if ptr.is_null() {
            return Err(ShimError::AllocationFailed {
                nbytes,
                device: device.to_string(),
                reason: "allocator returned null".to_string(),
            });
        }
        Ok(Arc::new(Storage {
            ptr,
            nbytes,
            device,
            owner: Some(Owner { allocator, stream }),
        }))
    }

    /// Wraps memory the caller owns and keeps alive for the storage's life.
    pub fn borrowed(ptr: *mut c_void, nbytes: usize, device: Device) -> Arc<Storage> {
        Arc::new(Storage {
            ptr,
            nbytes,
            device,
            owner: None,
        })
    }

    /// The block's address (null for a zero-byte storage).
    pub fn ptr(&self) -> *mut c_void {
        self.ptr
    }

    /// The block's size in bytes.
    pub fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// Where the block lives.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether the storage frees its block when dropped.
    pub fn is_owned(&self) -> bool {
        self.owner.is_some()
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.take() {
            // SAFETY: `ptr` came from `owner.allocator.allocate(nbytes, device,
            // stream)` in `Storage::allocate`, and this is the last reference
            // (we are in `Drop` of the value inside the last `Arc`).
            unsafe {
                owner
                    .allocator
                    .free(self.ptr, self.nbytes, self.device, owner.stream)
            };
        }
    }
}

/// Contiguous (row-major) strides for `sizes`.
pub fn contiguous_strides(sizes: &[i64]) -> Vec<i64> {
    let mut strides = vec![0i64; sizes.len()];
    let mut acc: i64 = 1;
    for (i, &s) in sizes.iter().enumerate().rev() {
        strides[i] = acc;
        acc = acc.saturating_mul(s.max(1));
    }
    strides
}

/// Number of elements of `sizes`, refusing negative sizes and overflow.
pub fn checked_numel(sizes: &[i64]) -> Result<i64, ShimError> {
    let mut n: i64 = 1;
    for &s in sizes {
        if s < 0 {
            return Err(ShimError::InvalidArgument {
                detail: format!("negative size {s} in {sizes:?}"),
            });
        }
        n = n.checked_mul(s).ok_or_else(|| ShimError::SizeOverflow {
            detail: format!("numel of {sizes:?}"),
        })?;
    }
    Ok(n)
}

/// Bytes of storage a view reaches: `(offset + 1 + Σ (size-1)·stride) ·
/// itemsize`, or 0 when the view is empty (c10's `computeStorageNbytes`).
/// Refuses negative sizes, strides or offsets; computed in 128 bits so that
/// no input overflows silently.
pub fn required_storage_bytes(
    sizes: &[i64],
    strides: &[i64],
    storage_offset: i64,
    dtype: DType,
) -> Result<u128, ShimError> {
    if sizes.len() != strides.len() {
        return Err(ShimError::InvalidArgument {
            detail: format!("{} sizes but {} strides", sizes.len(), strides.len()),
        });
    }
    if storage_offset < 0 {
        return Err(ShimError::InvalidArgument {
            detail: format!("negative storage offset {storage_offset}"),
        });
    }
    if let Some(&st) = strides.iter().find(|&&st| st < 0) {
        return Err(ShimError::InvalidArgument {
            detail: format!("negative stride {st} in {strides:?}"),
        });
    }
    if checked_numel(sizes)? == 0 {
        return Ok(0);
    }
    let mut last: u128 = storage_offset as u128;
    for (&size, &stride) in sizes.iter().zip(strides) {
        // size ≥ 1 here, stride ≥ 0: each term < 2^126, at most 64 terms.
        last += (size as u128 - 1) * stride as u128;
    }
    Ok((last + 1) * dtype.element_size() as u128)
}

/// The object an `AtenTensorHandle` points to.
pub struct Tensor {
    storage: Arc<Storage>,
    sizes: Vec<i64>,
    strides: Vec<i64>,
    storage_offset: i64,
    dtype: DType,
}

impl Tensor {
    /// A view of `storage`, refused (`shim.view_out_of_bounds`) if any of its
    /// elements lies outside the storage.
    pub fn view(
        storage: Arc<Storage>,
        sizes: Vec<i64>,
        strides: Vec<i64>,
        storage_offset: i64,
        dtype: DType,
    ) -> Result<Tensor, ShimError> {
        if sizes.len() > MAX_DIMS {
            return Err(ShimError::InvalidArgument {
                detail: format!("{} dimensions, more than {MAX_DIMS}", sizes.len()),
            });
        }
        let needed = required_storage_bytes(&sizes, &strides, storage_offset, dtype)?;
        if needed > storage.nbytes() as u128 {
            return Err(ShimError::ViewOutOfBounds {
                needed,
                storage: storage.nbytes(),
            });
        }
        // The byte offset fits: a non-empty view's offset is below `needed`;
        // an empty one's must still be representable as an address offset.
        (storage_offset as u128)
            .checked_mul(dtype.element_size() as u128)
            .filter(|&b| b <= isize::MAX as u128)
            .ok_or_else(|| ShimError::SizeOverflow {
                detail: format!("storage offset {storage_offset} in bytes"),
            })?;
        Ok(Tensor {
            storage,
            sizes,
            strides,
            storage_offset,
            dtype,
        })
    }

    /// A new tensor with its own freshly allocated storage on `device`, sized
    /// for `sizes` and `strides` (offset 0). The bytes are uninitialised on
    /// the device's side (whatever the allocator returns).
    pub fn empty_strided(
        sizes: Vec<i64>,
        strides: Vec<i64>,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor, ShimError> {
        let needed = required_storage_bytes(&sizes, &strides, 0, dtype)?;
        let nbytes = usize::try_from(needed)
            .ok()
            .filter(|&n| n <= isize::MAX as usize)
            .ok_or_else(|| ShimError::SizeOverflow {
                detail: format!("{needed} bytes for sizes {sizes:?}"),
            })?;
        let storage = Storage::allocate(nbytes, device)?;
        Tensor::view(storage, sizes, strides, 0, dtype)
    }

    /// Another view of the same storage with the same metadata.
    pub fn alias(&self) -> Tensor {
        Tensor {
            storage: Arc::clone(&self.storage),
            sizes: self.sizes.clone(),
            strides: self.strides.clone(),
            storage_offset: self.storage_offset,
            dtype: self.dtype,
        }
    }

    /// The storage this view reads.
    pub fn storage(&self) -> &Arc<Storage> {
        &self.storage
    }

    /// Sizes, one per dimension.
    pub fn sizes(&self) -> &[i64] {
        &self.sizes
    }

    /// Strides in elements, one per dimension.
    pub fn strides(&self) -> &[i64] {
        &self.strides
    }

    /// Offset of element 0 into the storage, in elements.
    pub fn storage_offset(&self) -> i64 {
        self.storage_offset
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device of the storage.
    pub fn device(&self) -> Device {
        self.storage.device()
    }

    /// Number of dimensions.
    pub fn dim(&self) -> usize {
        self.sizes.len()
    }

    /// Number of elements (checked when the view was made).
    pub fn numel(&self) -> i64 {
        self.sizes.iter().product()
    }

    /// Address of element 0: storage address + offset · itemsize.
    pub fn data_ptr(&self) -> *mut c_void {
        let byte_offset = self.storage_offset as usize * self.dtype.element_size();
        // wrapping_add: an empty view over a zero-byte storage has a null base;
        // its address is never dereferenced.
        self.storage
            .ptr()
            .cast::<u8>()
            .wrapping_add(byte_offset)
            .cast()
    }

    /// Whether the strides are the row-major ones (dimensions of size 1
    /// may have any stride, as in c10).
    pub fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut expected: i64 = 1;
        for (&size, &stride) in self.sizes.iter().zip(&self.strides).rev() {
            if size != 1 {
                if stride != expected {
                    return false;
                }
                expected *= size;
            }
        }
        true
    }

    /// Whether the view covers a dense block exactly once, in some order of
    /// the dimensions (c10's `is_non_overlapping_and_dense`).
    pub fn is_non_overlapping_and_dense(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut dims: Vec<usize> = (0..self.dim()).filter(|&d| self.sizes[d] != 1).collect();
        dims.sort_by_key(|&d| (self.strides[d], self.sizes[d]));
        let mut expected: i64 = 1;
        for d in dims {
            if self.strides[d] != expected {
                return false;
            }
            expected *= self.sizes[d];
        }
        true
    }

    /// Byte offsets (from `data_ptr`) of every element, in row-major order of
    /// the logical index.
    pub(crate) fn element_byte_offsets(&self) -> ElementOffsets<'_> {
        ElementOffsets::new(self)
    }
}

/// Iterator over the byte offsets of a view's elements in logical order.
pub(crate) struct ElementOffsets<'a> {
    sizes: &'a [i64],
    byte_strides: Vec<i64>,
    index: Vec<i64>,
    offset: i64,
    remaining: i64,
}

impl<'a> ElementOffsets<'a> {
    fn new(t: &'a Tensor) -> Self {
        let item = t.dtype.element_size() as i64;
        ElementOffsets {
            sizes: &t.sizes,
            byte_strides: t.strides.iter().map(|&s| s * item).collect(),
            index: vec![0; t.sizes.len()],
            offset: 0,
            remaining: t.numel(),
        }
    }
}

impl Iterator for ElementOffsets<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let current = self.offset;
        // Advance the odometer (last dimension fastest).
        for d in (0..self.sizes.len()).rev() {
            self.index[d] += 1;
            self.offset += self.byte_strides[d];
            if self.index[d] < self.sizes[d] {
                break;
            }
            self.offset -= self.byte_strides[d] * self.index[d];
            self.index[d] = 0;
        }
        // Offsets stay within the view's bounds, checked in `Tensor::view`.
        Some(current as usize)
    }
}
