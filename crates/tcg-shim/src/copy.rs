//! Element copies between views on the host (`copy_`, `clone`).

use crate::dtype::DeviceType;
use crate::error::ShimError;
use crate::tensor::Tensor;

/// Copies `src` into `dst` element by element in logical order. Both must be
/// host tensors of one dtype and the same sizes (no broadcasting, no dtype
/// conversion). Overlapping views are copied through a temporary buffer, so
/// the result is always `dst[i] = old src[i]`. A destination whose elements
/// alias each other (a zero stride) receives the last value written to each
/// location.
pub fn copy_host(dst: &Tensor, src: &Tensor) -> Result<(), ShimError> {
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
    for t in [dst, src] {
        if t.device().device_type != DeviceType::Cpu {
            return Err(ShimError::UnsupportedDevice {
                device_type: t.device().device_type.code(),
                device_index: t.device().index,
                reason: "copy_ on device memory needs the device runtime",
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

/// A new host tensor with the same values as `src`: same strides when `src`
/// is non-overlapping and dense, row-major strides otherwise (the
/// `preserve_format` rule of `at::clone`).
pub fn clone_host(src: &Tensor) -> Result<Tensor, ShimError> {
    if src.device().device_type != DeviceType::Cpu {
        return Err(ShimError::UnsupportedDevice {
            device_type: src.device().device_type.code(),
            device_index: src.device().index,
            reason: "clone of device memory needs the device runtime",
        });
    }
    let strides = if src.is_non_overlapping_and_dense() {
        src.strides().to_vec()
    } else {
        crate::tensor::contiguous_strides(src.sizes())
    };
    let out = Tensor::empty_strided(src.sizes().to_vec(), strides, src.dtype(), src.device())?;
    copy_host(&out, src)?;
    Ok(out)
}
