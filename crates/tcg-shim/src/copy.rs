//! Element copies between views (`copy_`, `clone`,
//! `clone_preserve_strides`): on the host element by element, with a device
//! on either side through the driver ([`crate::cuda::memcpy`]) on the
//! current stream of the device involved (the destination's when both are
//! devices).
//!
//! A device copy is one `cuMemcpyAsync` when both views are dense with the
//! same strides (contiguous ones included). Between host and device, a
//! strided host side is packed or unpacked through a host buffer when the
//! device side is dense. Anything else on a device (a view that is not dense
//! on the device side, different strides between two device views,
//! overlapping device views) is refused, `shim.strided_device_copy`: it needs
//! a kernel. A copy with host memory on either side is synchronous unless
//! `non_blocking` (as libtorch's); device to device never blocks the host.

use crate::alloc::current_stream;
use crate::dtype::{Device, DeviceType};
use crate::error::ShimError;
use crate::tensor::{contiguous_strides, required_storage_bytes, Tensor};

fn same_shape(dst: &Tensor, src: &Tensor) -> Result<(), ShimError> {
    if dst.dtype() != src.dtype() {
        return Err(ShimError::CopyMismatch {
            detail: format!(
                "dtype {:?} into {:?} (no conversion)",
                src.dtype(),
                dst.dtype()
            ),
        });
    }
    if dst.sizes() != src.sizes() {
        return Err(ShimError::CopyMismatch {
            detail: format!(
                "sizes {:?} into {:?} (no broadcasting)",
                src.sizes(),
                dst.sizes()
            ),
        });
    }
    Ok(())
}

/// Copies `src` into `dst` element by element in logical order. Both must be
/// host tensors of one dtype and the same sizes (no broadcasting, no dtype
/// conversion). Overlapping views are copied through a temporary buffer, so
/// the result is always `dst[i] = old src[i]`. A destination whose elements
/// alias each other (a zero stride) receives the last value written to each
/// location.
pub fn copy_host(dst: &Tensor, src: &Tensor) -> Result<(), ShimError> {
    same_shape(dst, src)?;
    for t in [dst, src] {
        if t.device().device_type != DeviceType::Cpu {
            return Err(ShimError::UnsupportedDevice {
                device_type: t.device().device_type.code(),
                device_index: t.device().index,
                reason: "copy_host takes host memory (copy_tensor copies device memory)",
            });
        }
    }
    let numel = dst.numel() as usize;
    if numel == 0 {
        return Ok(());
    }
    let item = dst.dtype().element_size();
    let dst_base = dst.data_ptr().cast::<u8>();
    let src_base = src.data_ptr().cast::<u8>();
    if dst.is_contiguous() && src.is_contiguous() {
        // SAFETY: both views are contiguous with `numel` elements, so each
        // spans `numel * item` bytes from its data pointer, inside its
        // storage (bounds checked in `Tensor::view`); host storage is live
        // while the tensors are. `copy` is a memmove: overlap is allowed.
        unsafe { std::ptr::copy(src_base, dst_base, numel * item) };
        return Ok(());
    }
    if byte_spans_overlap(dst, src) {
        let mut tmp = vec![0u8; numel * item];
        for (i, off) in src.element_byte_offsets().enumerate() {
            // SAFETY: `off` is an element's offset inside `src`'s checked
            // bounds; `tmp` has room for `numel` elements.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src_base.add(off),
                    tmp.as_mut_ptr().add(i * item),
                    item,
                )
            };
        }
        for (i, off) in dst.element_byte_offsets().enumerate() {
            // SAFETY: as above for `dst`; `tmp` is a separate allocation.
            unsafe {
                std::ptr::copy_nonoverlapping(tmp.as_ptr().add(i * item), dst_base.add(off), item)
            };
        }
    } else {
        for (d, s) in dst.element_byte_offsets().zip(src.element_byte_offsets()) {
            // SAFETY: both offsets lie inside their views' checked bounds and
            // the two views' byte spans are disjoint (checked above).
            unsafe { std::ptr::copy_nonoverlapping(src_base.add(s), dst_base.add(d), item) };
        }
    }
    Ok(())
}

/// Whether the byte ranges `[first element, last element]` of two views
/// intersect (conservative: interleaved views count as overlapping).
fn byte_spans_overlap(a: &Tensor, b: &Tensor) -> bool {
    let span = |t: &Tensor| {
        let item = t.dtype().element_size();
        let start = t.data_ptr() as usize;
        let last: i64 = t
            .sizes()
            .iter()
            .zip(t.strides())
            .map(|(&n, &s)| (n - 1) * s)
            .sum();
        (start, start + (last as usize + 1) * item)
    };
    let (a0, a1) = span(a);
    let (b0, b1) = span(b);
    a0 < b1 && b0 < a1
}

/// Copies `src` into `dst` (same dtype and sizes) on any devices: host
/// views through [`copy_host`], a device on either side through the driver
/// (module docs).
pub fn copy_tensor(dst: &Tensor, src: &Tensor, non_blocking: bool) -> Result<(), ShimError> {
    let dst_dev = dst.device().device_type == DeviceType::Cuda;
    let src_dev = src.device().device_type == DeviceType::Cuda;
    if !dst_dev && !src_dev {
        return copy_host(dst, src);
    }
    same_shape(dst, src)?;
    let numel = dst.numel() as usize;
    if numel == 0 {
        return Ok(());
    }
    let nbytes = numel * dst.dtype().element_size();
    let device = if dst_dev { dst.device() } else { src.device() };
    let stream = current_stream(device);
    // A host side blocks unless asked not to; device to device never does.
    let blocking = !(non_blocking || dst_dev && src_dev);
    if same_dense_layout(dst, src) {
        if dst_dev && src_dev && byte_spans_overlap(dst, src) {
            return Err(ShimError::StridedDeviceCopy {
                detail: "the two device views overlap".to_string(),
            });
        }
        // SAFETY: both views are dense with the same strides, so each spans
        // exactly `nbytes` from its data pointer, inside its storage
        // (`Tensor::view` checked it); host memory outlives the copy when it
        // blocks; device memory is kept alive in stream order by its owner.
        return unsafe {
            crate::cuda::memcpy(
                device.index,
                dst.data_ptr(),
                src.data_ptr(),
                nbytes,
                stream,
                blocking,
            )
        };
    }
    if !dst_dev && src.is_non_overlapping_and_dense() {
        // Device (dense) to host (strided): through a host buffer laid out
        // as the source, then element by element.
        let staged = host_like(src)?;
        // SAFETY: `staged` spans the source's `nbytes`; the copy blocks, so
        // the buffer is complete before it is read.
        unsafe {
            crate::cuda::memcpy(
                device.index,
                staged.data_ptr(),
                src.data_ptr(),
                nbytes,
                stream,
                true,
            )
        }?;
        return copy_host(dst, &staged);
    }
    if !src_dev && dst.is_non_overlapping_and_dense() {
        // Host (strided) to device (dense): packed into a host buffer laid
        // out as the destination, then one copy.
        let staged = host_like(dst)?;
        copy_host(&staged, src)?;
        // SAFETY: as above; the copy blocks, so the buffer outlives it.
        return unsafe {
            crate::cuda::memcpy(
                device.index,
                dst.data_ptr(),
                staged.data_ptr(),
                nbytes,
                stream,
                true,
            )
        };
    }
    Err(ShimError::StridedDeviceCopy {
        detail: format!(
            "{} view of sizes {:?} and strides {:?} into a {} view of strides {:?}",
            src.device(),
            src.sizes(),
            src.strides(),
            dst.device(),
            dst.strides()
        ),
    })
}

/// A host tensor with `like`'s sizes and strides (offset 0).
fn host_like(like: &Tensor) -> Result<Tensor, ShimError> {
    Tensor::empty_strided(
        like.sizes().to_vec(),
        like.strides().to_vec(),
        like.dtype(),
        Device::CPU,
    )
}

/// Whether both views are dense with the same strides (a dimension of size
/// 1 may have any stride).
fn same_dense_layout(a: &Tensor, b: &Tensor) -> bool {
    a.is_non_overlapping_and_dense()
        && b.is_non_overlapping_and_dense()
        && a.sizes()
            .iter()
            .zip(a.strides().iter().zip(b.strides()))
            .all(|(&n, (&x, &y))| n == 1 || x == y)
}

/// A new tensor on `src`'s device with `src`'s values: same strides when
/// `src` is non-overlapping and dense, row-major strides otherwise (the
/// `preserve_format` rule of `at::clone`). On a device, a view that is not
/// dense is refused (`shim.strided_device_copy`).
pub fn clone_host(src: &Tensor) -> Result<Tensor, ShimError> {
    let strides = if src.is_non_overlapping_and_dense() {
        src.strides().to_vec()
    } else {
        contiguous_strides(src.sizes())
    };
    let out = Tensor::empty_strided(src.sizes().to_vec(), strides, src.dtype(), src.device())?;
    copy_tensor(&out, src, false)?;
    Ok(out)
}

/// A new tensor with its own storage on `src`'s device, `src`'s sizes and
/// strides kept exactly (the new storage spans what the strides reach from
/// offset 0), and `src`'s values. On a device the whole span is copied at
/// once, so any view works there too.
pub fn clone_preserve_strides(src: &Tensor) -> Result<Tensor, ShimError> {
    let out = Tensor::empty_strided(
        src.sizes().to_vec(),
        src.strides().to_vec(),
        src.dtype(),
        src.device(),
    )?;
    if src.device().device_type == DeviceType::Cpu {
        copy_host(&out, src)?;
        return Ok(out);
    }
    let span = required_storage_bytes(src.sizes(), src.strides(), 0, src.dtype())? as usize;
    // SAFETY: `out`'s storage is exactly `span` bytes; `src`'s view reaches
    // `span` bytes from its data pointer inside its storage (checked when the
    // view was made); both on the device, ordered on its current stream.
    unsafe {
        crate::cuda::memcpy(
            out.device().index,
            out.data_ptr(),
            src.data_ptr(),
            span,
            current_stream(out.device()),
            false,
        )
    }?;
    Ok(out)
}
