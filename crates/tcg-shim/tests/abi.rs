//! The C ABI on host memory: lifecycle, views, copies and every refusal.

mod common;

use std::ptr;

use common::*;
use tcg_shim::*;

#[test]
fn dtype_constants_are_c10_numbers_with_their_element_sizes() {
    let table: [(i32, i32, usize); 22] = [
        (aoti_torch_dtype_uint8(), 0, 1),
        (aoti_torch_dtype_int8(), 1, 1),
        (aoti_torch_dtype_int16(), 2, 2),
        (aoti_torch_dtype_int32(), 3, 4),
        (aoti_torch_dtype_int64(), 4, 8),
        (aoti_torch_dtype_float16(), 5, 2),
        (aoti_torch_dtype_float32(), 6, 4),
        (aoti_torch_dtype_float64(), 7, 8),
        (aoti_torch_dtype_complex32(), 8, 4),
        (aoti_torch_dtype_complex64(), 9, 8),
        (aoti_torch_dtype_complex128(), 10, 16),
        (aoti_torch_dtype_bool(), 11, 1),
        (aoti_torch_dtype_bfloat16(), 15, 2),
        (aoti_torch_dtype_float8_e5m2(), 23, 1),
        (aoti_torch_dtype_float8_e4m3fn(), 24, 1),
        (aoti_torch_dtype_float8_e5m2fnuz(), 25, 1),
        (aoti_torch_dtype_float8_e4m3fnuz(), 26, 1),
        (aoti_torch_dtype_uint16(), 27, 2),
        (aoti_torch_dtype_uint32(), 28, 4),
        (aoti_torch_dtype_uint64(), 29, 8),
        (aoti_torch_dtype_float8_e8m0fnu(), 44, 1),
        (aoti_torch_dtype_float4_e2m1fn_x2(), 45, 1),
    ];
    for (got, c10, size) in table {
        assert_eq!(got, c10);
        assert_eq!(aoti_torch_dtype_element_size(got), size, "dtype {c10}");
    }
    assert_eq!(aoti_torch_device_type_cpu(), 0);
    assert_eq!(aoti_torch_device_type_cuda(), 1);
    assert_eq!(aoti_torch_layout_strided(), 0);
    take_last_error();
    assert_eq!(
        aoti_torch_dtype_element_size(12),
        0,
        "qint8 has no shim constant"
    );
    assert_eq!(take_last_error().unwrap().code(), "shim.unsupported_dtype");
}

#[test]
fn empty_strided_reports_its_metadata() {
    let h = empty_f32(&[2, 3], &[3, 1]);
    assert_eq!(sizes(h), [2, 3]);
    assert_eq!(strides(h), [3, 1]);
    assert_eq!(get_i64(aoti_torch_get_dim, h), 2);
    assert_eq!(get_i64(aoti_torch_get_numel, h), 6);
    assert_eq!(get_i64(aoti_torch_get_storage_size, h), 24);
    assert_eq!(get_i64(aoti_torch_get_storage_numel, h), 6);
    assert_eq!(get_i64(aoti_torch_get_storage_offset, h), 0);
    assert_eq!(get_i32(aoti_torch_get_dtype, h), 6);
    assert_eq!(get_i32(aoti_torch_get_device_type, h), 0);
    assert_eq!(get_i32(aoti_torch_get_device_index, h), -1);
    assert_eq!(get_i32(aoti_torch_get_layout, h), 0);
    assert_eq!(data_ptr(h) as usize % 64, 0);
    let mut contig = false;
    // SAFETY: output is a writable local.
    ok(unsafe { aoti_torch_is_contiguous(h, &mut contig) });
    assert!(contig);
    let (mut s, mut st) = (0, 0);
    // SAFETY: outputs are writable locals.
    unsafe {
        ok(aoti_torch_get_size(h, -1, &mut s));
        ok(aoti_torch_get_stride(h, 0, &mut st));
    }
    assert_eq!((s, st), (3, 3));
    write_f32(h, &iota(6));
    assert_eq!(read_f32(h), iota(6));
    delete(h);
}

#[test]
fn storage_size_follows_padded_strides_and_dtype() {
    // Rows padded to 4 elements: last element at 1*4 + 2*1 = 6, so 7 elements.
    let h = empty_f32(&[2, 3], &[4, 1]);
    assert_eq!(get_i64(aoti_torch_get_numel, h), 6);
    assert_eq!(get_i64(aoti_torch_get_storage_size, h), 28);
    let mut contig = true;
    // SAFETY: output is a writable local.
    ok(unsafe { aoti_torch_is_contiguous(h, &mut contig) });
    assert!(!contig);
    delete(h);
    let b = empty(&[5], &[1], aoti_torch_dtype_bfloat16(), 0, 0).unwrap();
    assert_eq!(get_i64(aoti_torch_get_storage_size, b), 10);
    assert_eq!(get_i32(aoti_torch_get_device_index, b), 0);
    delete(b);
    // A scalar (0 dims) has one element; an empty tensor none and no bytes.
    let s = empty_f32(&[], &[]);
    assert_eq!(get_i64(aoti_torch_get_numel, s), 1);
    assert_eq!(get_i64(aoti_torch_get_storage_size, s), 4);
    delete(s);
    let z = empty_f32(&[3, 0], &[0, 1]);
    assert_eq!(get_i64(aoti_torch_get_numel, z), 0);
    assert_eq!(get_i64(aoti_torch_get_storage_size, z), 0);
    delete(z);
}

#[test]
fn null_strides_mean_row_major() {
    let sizes_arr = [2i64, 3, 4];
    let mut h = ptr::null_mut();
    // SAFETY: `sizes_arr` has 3 elements; `h` is writable.
    ok(unsafe { aoti_torch_empty_strided(3, sizes_arr.as_ptr(), ptr::null(), 6, 0, -1, &mut h) });
    assert_eq!(strides(h), [12, 4, 1]);
    delete(h);
}

#[test]
fn views_keep_the_storage_alive_in_any_delete_order() {
    let base = empty_f32(&[12], &[1]);
    write_f32(base, &iota(12));
    let weak = storage_weak(base);
    let v1 = reinterpret(base, &[2, 3], &[3, 1], 6).unwrap();
    let v2 = reinterpret(v1, &[4], &[1], 0).unwrap();
    assert_eq!(weak.strong_count(), 3);
    delete(base);
    assert_eq!(weak.strong_count(), 2);
    assert_eq!(read_f32(v1), [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]);
    delete(v1);
    assert_eq!(read_f32(v2), [0.0, 1.0, 2.0, 3.0]);
    write_f32(v2, &[9.0; 4]);
    assert_eq!(read_f32(v2), [9.0; 4]);
    delete(v2);
    assert!(weak.upgrade().is_none(), "the last view frees the storage");
}

#[test]
fn new_tensor_handle_aliases_and_is_deleted_separately() {
    let a = empty_f32(&[3], &[1]);
    let weak = storage_weak(a);
    let mut b = ptr::null_mut();
    // SAFETY: `b` is writable.
    ok(unsafe { aoti_torch_new_tensor_handle(a, &mut b) });
    assert_ne!(a, b);
    assert_eq!(data_ptr(a), data_ptr(b));
    delete(a);
    write_f32(b, &[1.0, 2.0, 3.0]);
    delete(b);
    assert!(weak.upgrade().is_none());
}

#[test]
fn reinterpret_sets_offset_strides_and_data_pointer() {
    let base = empty_f32(&[12], &[1]);
    write_f32(base, &iota(12));
    let v = reinterpret(base, &[2, 3], &[3, 1], 6).unwrap();
    assert_eq!(get_i64(aoti_torch_get_storage_offset, v), 6);
    assert_eq!(data_ptr(v) as usize, data_ptr(base) as usize + 24);
    assert_eq!(
        get_i64(aoti_torch_get_storage_size, v),
        48,
        "the whole storage"
    );
    // The offset is absolute, not relative to the view it was made from.
    let w = reinterpret(v, &[3], &[1], 1).unwrap();
    assert_eq!(read_f32(w), [1.0, 2.0, 3.0]);
    // A transposed view and a broadcast (stride 0) view.
    let t = reinterpret(base, &[3, 2], &[1, 3], 0).unwrap();
    assert_eq!(read_f32(t), [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    let b = reinterpret(base, &[2, 3], &[0, 1], 9).unwrap();
    assert_eq!(read_f32(b), [9.0, 10.0, 11.0, 9.0, 10.0, 11.0]);
    // Exactly at the end is allowed; one past is not.
    let edge = reinterpret(base, &[2, 2], &[2, 1], 8).unwrap();
    assert_eq!(read_f32(edge), [8.0, 9.0, 10.0, 11.0]);
    let err = reinterpret(base, &[2, 2], &[2, 1], 9).unwrap_err();
    assert_eq!(err.code(), "shim.view_out_of_bounds");
    assert!(err.to_string().contains("52"), "{err}");
    // An empty view may sit anywhere (c10 does the same).
    let e = reinterpret(base, &[0, 5], &[5, 1], 1000).unwrap();
    assert_eq!(get_i64(aoti_torch_get_numel, e), 0);
    for h in [base, v, w, t, b, edge, e] {
        delete(h);
    }
}

#[test]
fn copy_between_strided_views() {
    let src = empty_f32(&[3, 4], &[4, 1]);
    write_f32(src, &iota(12));
    // Destination: a [3, 4] view with column-major strides over 12 floats.
    let dst = empty_f32(&[3, 4], &[1, 3]);
    // SAFETY: handles are checked.
    ok(unsafe { aoti_torch_copy_(dst, src, 0) });
    assert_eq!(read_f32(dst), iota(12));
    // Physically transposed in memory.
    let raw = reinterpret(dst, &[12], &[1], 0).unwrap();
    assert_eq!(read_f32(raw)[..4], [0.0, 4.0, 8.0, 1.0]);
    // Strided source (every other column) into a contiguous destination.
    let cols = reinterpret(src, &[3, 2], &[4, 2], 1).unwrap();
    let out = empty_f32(&[3, 2], &[2, 1]);
    // SAFETY: handles are checked.
    ok(unsafe { aoti_torch_copy_(out, cols, 1) });
    assert_eq!(read_f32(out), [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]);
    for h in [src, dst, raw, cols, out] {
        delete(h);
    }
}

#[test]
fn copy_between_overlapping_views_reads_the_old_values() {
    let buf = empty_f32(&[10], &[1]);
    write_f32(buf, &iota(10));
    let src = reinterpret(buf, &[4], &[2], 0).unwrap(); // 0 2 4 6
    let dst = reinterpret(buf, &[4], &[2], 2).unwrap(); // 2 4 6 8
                                                        // SAFETY: handles are checked.
    ok(unsafe { aoti_torch_copy_(dst, src, 0) });
    assert_eq!(
        read_f32(buf),
        [0.0, 1.0, 0.0, 3.0, 2.0, 5.0, 4.0, 7.0, 6.0, 9.0]
    );
    // Contiguous overlap (memmove path).
    write_f32(buf, &iota(10));
    let a = reinterpret(buf, &[6], &[1], 0).unwrap();
    let b = reinterpret(buf, &[6], &[1], 3).unwrap();
    // SAFETY: handles are checked.
    ok(unsafe { aoti_torch_copy_(b, a, 0) });
    assert_eq!(
        read_f32(buf),
        [0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0]
    );
    // Copy onto itself is a no-op.
    // SAFETY: handles are checked.
    ok(unsafe { aoti_torch_copy_(a, a, 0) });
    assert_eq!(read_f32(a), [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]);
    for h in [buf, src, dst, a, b] {
        delete(h);
    }
}

#[test]
fn copy_refuses_dtype_and_shape_mismatches() {
    let f = empty_f32(&[4], &[1]);
    let g = empty_f32(&[2, 2], &[2, 1]);
    let i = empty(&[4], &[1], aoti_torch_dtype_int32(), 0, -1).unwrap();
    // SAFETY: handles are checked.
    unsafe {
        fails(aoti_torch_copy_(f, i, 0), "shim.copy_mismatch");
        fails(aoti_torch_copy_(f, g, 0), "shim.copy_mismatch");
        fails(aoti_torch_copy_(ptr::null_mut(), f, 0), "shim.null_pointer");
        fails(aoti_torch_copy_(f, ptr::null_mut(), 0), "shim.null_pointer");
    }
    for h in [f, g, i] {
        delete(h);
    }
}

#[test]
fn clone_keeps_dense_strides_and_owns_its_storage() {
    let base = empty_f32(&[2, 3], &[3, 1]);
    write_f32(base, &iota(6));
    let t = reinterpret(base, &[3, 2], &[1, 3], 0).unwrap();
    let mut c = ptr::null_mut();
    // SAFETY: `c` is writable.
    ok(unsafe { aoti_torch_clone(t, &mut c) });
    assert_eq!(strides(c), [1, 3], "dense strides are preserved");
    assert_eq!(read_f32(c), read_f32(t));
    assert_ne!(data_ptr(c), data_ptr(base));
    // Not dense (every other element): the clone is row-major.
    let sparse = reinterpret(base, &[3], &[2], 0).unwrap();
    let mut d = ptr::null_mut();
    // SAFETY: `d` is writable.
    ok(unsafe { aoti_torch_clone(sparse, &mut d) });
    assert_eq!(strides(d), [1]);
    assert_eq!(get_i64(aoti_torch_get_storage_size, d), 12);
    assert_eq!(read_f32(d), [0.0, 2.0, 4.0]);
    write_f32(base, &[7.0; 6]);
    assert_eq!(read_f32(d), [0.0, 2.0, 4.0], "independent of the source");
    for h in [base, t, c, sparse, d] {
        delete(h);
    }
}

#[test]
fn from_blob_borrows_caller_memory() {
    let mut blob: Vec<f32> = iota(8);
    let (sz, st) = ([2i64, 2], [2i64, 1]);
    let mut h = ptr::null_mut();
    // SAFETY: `blob` outlives the handle; arrays have 2 elements.
    ok(unsafe {
        aoti_torch_create_tensor_from_blob(
            blob.as_mut_ptr().cast(),
            2,
            sz.as_ptr(),
            st.as_ptr(),
            2,
            6,
            0,
            -1,
            &mut h,
        )
    });
    assert_eq!(data_ptr(h) as usize, blob.as_ptr() as usize + 8);
    assert_eq!(read_f32(h), [2.0, 3.0, 4.0, 5.0]);
    // The storage spans what the view reaches: (2 + 3 + 1) floats.
    assert_eq!(get_i64(aoti_torch_get_storage_size, h), 24);
    let whole = reinterpret(h, &[6], &[1], 0).unwrap();
    assert_eq!(read_f32(whole), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    delete(whole);
    assert_eq!(
        reinterpret(h, &[7], &[1], 0).unwrap_err().code(),
        "shim.view_out_of_bounds"
    );
    let weak = storage_weak(h);
    delete(h);
    assert!(weak.upgrade().is_none());
    // The caller's memory is untouched and still ours to free.
    blob[0] = 42.0;
    assert_eq!(blob[7], 7.0);

    // _v2 with the strided layout and no metadata is the same call.
    let mut h2 = ptr::null_mut();
    // SAFETY: as above.
    ok(unsafe {
        aoti_torch_create_tensor_from_blob_v2(
            blob.as_mut_ptr().cast(),
            2,
            sz.as_ptr(),
            st.as_ptr(),
            0,
            6,
            1,
            0,
            &mut h2,
            0,
            ptr::null(),
            0,
        )
    });
    assert_eq!(
        get_i32(aoti_torch_get_device_type, h2),
        1,
        "a CUDA blob needs no allocator"
    );
    delete(h2);
    let meta = [1u8];
    // SAFETY: as above; refused before any use of the arrays.
    unsafe {
        fails(
            aoti_torch_create_tensor_from_blob_v2(
                blob.as_mut_ptr().cast(),
                2,
                sz.as_ptr(),
                st.as_ptr(),
                0,
                6,
                0,
                -1,
                &mut h2,
                3,
                ptr::null(),
                0,
            ),
            "shim.invalid_argument",
        );
        fails(
            aoti_torch_create_tensor_from_blob_v2(
                blob.as_mut_ptr().cast(),
                2,
                sz.as_ptr(),
                st.as_ptr(),
                0,
                6,
                0,
                -1,
                &mut h2,
                0,
                meta.as_ptr(),
                1,
            ),
            "shim.invalid_argument",
        );
        // Null data is refused unless the view has no bytes.
        fails(
            aoti_torch_create_tensor_from_blob(
                ptr::null_mut(),
                2,
                sz.as_ptr(),
                st.as_ptr(),
                0,
                6,
                0,
                -1,
                &mut h2,
            ),
            "shim.null_pointer",
        );
        let zero = [0i64, 4];
        ok(aoti_torch_create_tensor_from_blob(
            ptr::null_mut(),
            2,
            zero.as_ptr(),
            st.as_ptr(),
            0,
            6,
            0,
            -1,
            &mut h2,
        ));
    }
    delete(h2);
}

/// sizes, strides, dtype, device type, device index, expected code.
type EmptyCase<'a> = (&'a [i64], &'a [i64], i32, i32, i32, &'a str);

#[test]
fn invalid_shapes_dtypes_and_devices_are_refused() {
    let f32c = aoti_torch_dtype_float32();
    let cases: Vec<EmptyCase<'_>> = vec![
        (&[-1], &[1], f32c, 0, -1, "shim.invalid_argument"),
        (&[2], &[-1], f32c, 0, -1, "shim.invalid_argument"),
        (&[2], &[1], 12, 0, -1, "shim.unsupported_dtype"),
        (&[2], &[1], 999, 0, -1, "shim.unsupported_dtype"),
        (&[2], &[1], f32c, 14, 0, "shim.unsupported_device"),
        (&[2], &[1], f32c, -1, 0, "shim.unsupported_device"),
        (&[2], &[1], f32c, 0, -2, "shim.unsupported_device"),
        (&[i64::MAX, 2], &[1, 1], f32c, 0, -1, "shim.size_overflow"),
        (&[1 << 62], &[1], f32c, 0, -1, "shim.size_overflow"),
        (
            &[1 << 60],
            &[1],
            aoti_torch_dtype_uint8(),
            0,
            -1,
            "shim.allocation_failed",
        ),
    ];
    for (sz, st, dt, dev, idx, code) in cases {
        let err = empty(sz, st, dt, dev, idx).unwrap_err();
        assert_eq!(
            err.code(),
            code,
            "{sz:?} {st:?} dtype {dt} device {dev}:{idx}: {err}"
        );
    }
    let sizes_arr = [2i64; 65];
    let mut h = ptr::null_mut();
    // SAFETY: arrays are long enough for every ndim passed; `h` is writable.
    unsafe {
        fails(
            aoti_torch_empty_strided(
                -1,
                sizes_arr.as_ptr(),
                sizes_arr.as_ptr(),
                f32c,
                0,
                -1,
                &mut h,
            ),
            "shim.invalid_argument",
        );
        fails(
            aoti_torch_empty_strided(
                65,
                sizes_arr.as_ptr(),
                sizes_arr.as_ptr(),
                f32c,
                0,
                -1,
                &mut h,
            ),
            "shim.invalid_argument",
        );
        fails(
            aoti_torch_empty_strided(2, ptr::null(), sizes_arr.as_ptr(), f32c, 0, -1, &mut h),
            "shim.null_pointer",
        );
        fails(
            aoti_torch_empty_strided(
                2,
                sizes_arr.as_ptr(),
                sizes_arr.as_ptr(),
                f32c,
                0,
                -1,
                ptr::null_mut(),
            ),
            "shim.null_pointer",
        );
        fails(
            aoti_torch_create_tensor_from_blob(
                sizes_arr.as_ptr().cast_mut().cast(),
                1,
                sizes_arr.as_ptr(),
                sizes_arr.as_ptr(),
                -1,
                f32c,
                0,
                -1,
                &mut h,
            ),
            "shim.invalid_argument",
        );
        fails(
            aoti_torch_create_tensor_from_blob(
                sizes_arr.as_ptr().cast_mut().cast(),
                1,
                sizes_arr.as_ptr(),
                sizes_arr.as_ptr(),
                0,
                f32c,
                0,
                -1,
                ptr::null_mut(),
            ),
            "shim.null_pointer",
        );
    }
    assert!(h.is_null(), "no handle is written on failure");
}

#[test]
fn reinterpret_refuses_bad_arguments() {
    let base = empty_f32(&[8], &[1]);
    let sz = [2i64, 2];
    let mut v = ptr::null_mut();
    // SAFETY: arrays have 2 elements; outputs are writable or null on purpose.
    unsafe {
        fails(
            aoti_torch__reinterpret_tensor(ptr::null_mut(), 2, sz.as_ptr(), sz.as_ptr(), 0, &mut v),
            "shim.null_pointer",
        );
        fails(
            aoti_torch__reinterpret_tensor(base, 2, sz.as_ptr(), sz.as_ptr(), 0, ptr::null_mut()),
            "shim.null_pointer",
        );
        fails(
            aoti_torch__reinterpret_tensor(base, 2, ptr::null(), sz.as_ptr(), 0, &mut v),
            "shim.null_pointer",
        );
        fails(
            aoti_torch__reinterpret_tensor(base, -3, sz.as_ptr(), sz.as_ptr(), 0, &mut v),
            "shim.invalid_argument",
        );
        fails(
            aoti_torch__reinterpret_tensor(base, 2, sz.as_ptr(), sz.as_ptr(), -1, &mut v),
            "shim.invalid_argument",
        );
    }
    assert!(v.is_null());
    delete(base);
}

type GetI64 = unsafe extern "C" fn(AtenTensorHandle, *mut i64) -> AotiTorchError;
type GetI32 = unsafe extern "C" fn(AtenTensorHandle, *mut i32) -> AotiTorchError;

#[test]
fn every_getter_refuses_null_foreign_and_deleted_handles_and_null_outputs() {
    let i64_getters: [(&str, GetI64); 5] = [
        ("dim", aoti_torch_get_dim),
        ("numel", aoti_torch_get_numel),
        ("storage_size", aoti_torch_get_storage_size),
        ("storage_numel", aoti_torch_get_storage_numel),
        ("storage_offset", aoti_torch_get_storage_offset),
    ];
    let i32_getters: [(&str, GetI32); 4] = [
        ("dtype", aoti_torch_get_dtype),
        ("device_type", aoti_torch_get_device_type),
        ("device_index", aoti_torch_get_device_index),
        ("layout", aoti_torch_get_layout),
    ];
    let live = empty_f32(&[2], &[1]);
    let deleted = empty_f32(&[2], &[1]);
    delete(deleted);
    let mut local = 0u64;
    let foreign: AtenTensorHandle = (&mut local as *mut u64).cast();
    for (name, f) in i64_getters {
        let mut v = 0i64;
        // SAFETY: handles are checked; outputs are writable or null on purpose.
        unsafe {
            fails(f(ptr::null_mut(), &mut v), "shim.null_pointer");
            fails(f(foreign, &mut v), "shim.unknown_handle");
            fails(f(deleted, &mut v), "shim.unknown_handle");
            fails(f(live, ptr::null_mut()), "shim.null_pointer");
        }
        assert_eq!(v, 0, "{name} wrote on failure");
    }
    for (name, f) in i32_getters {
        let mut v = 0i32;
        // SAFETY: as above.
        unsafe {
            fails(f(ptr::null_mut(), &mut v), "shim.null_pointer");
            fails(f(foreign, &mut v), "shim.unknown_handle");
            fails(f(live, ptr::null_mut()), "shim.null_pointer");
        }
        assert_eq!(v, 0, "{name} wrote on failure");
    }
    let mut p: *mut i64 = ptr::null_mut();
    let mut d: *mut std::ffi::c_void = ptr::null_mut();
    let mut b = false;
    let mut n = 0i64;
    let mut h = ptr::null_mut();
    // SAFETY: as above.
    unsafe {
        fails(
            aoti_torch_get_sizes(ptr::null_mut(), &mut p),
            "shim.null_pointer",
        );
        fails(
            aoti_torch_get_sizes(live, ptr::null_mut()),
            "shim.null_pointer",
        );
        fails(
            aoti_torch_get_strides(foreign, &mut p),
            "shim.unknown_handle",
        );
        fails(
            aoti_torch_get_strides(live, ptr::null_mut()),
            "shim.null_pointer",
        );
        fails(
            aoti_torch_get_data_ptr(ptr::null_mut(), &mut d),
            "shim.null_pointer",
        );
        fails(
            aoti_torch_get_data_ptr(deleted, &mut d),
            "shim.unknown_handle",
        );
        fails(
            aoti_torch_get_data_ptr(live, ptr::null_mut()),
            "shim.null_pointer",
        );
        fails(
            aoti_torch_is_contiguous(ptr::null_mut(), &mut b),
            "shim.null_pointer",
        );
        fails(
            aoti_torch_get_size(live, 1, &mut n),
            "shim.invalid_argument",
        );
        fails(
            aoti_torch_get_size(live, -2, &mut n),
            "shim.invalid_argument",
        );
        fails(
            aoti_torch_get_stride(live, 5, &mut n),
            "shim.invalid_argument",
        );
        fails(
            aoti_torch_get_size(ptr::null_mut(), 0, &mut n),
            "shim.null_pointer",
        );
        fails(
            aoti_torch_get_stride(live, 0, ptr::null_mut()),
            "shim.null_pointer",
        );
        fails(
            aoti_torch_clone(ptr::null_mut(), &mut h),
            "shim.null_pointer",
        );
        fails(aoti_torch_clone(live, ptr::null_mut()), "shim.null_pointer");
        fails(aoti_torch_clone(foreign, &mut h), "shim.unknown_handle");
        fails(
            aoti_torch_new_tensor_handle(ptr::null_mut(), &mut h),
            "shim.null_pointer",
        );
        fails(
            aoti_torch_new_tensor_handle(live, ptr::null_mut()),
            "shim.null_pointer",
        );
        fails(aoti_torch_copy_(live, foreign, 0), "shim.unknown_handle");
        // Deleting twice, a foreign pointer or null is refused, not a crash.
        fails(
            aoti_torch_delete_tensor_object(deleted),
            "shim.unknown_handle",
        );
        fails(
            aoti_torch_delete_tensor_object(foreign),
            "shim.unknown_handle",
        );
        fails(
            aoti_torch_delete_tensor_object(ptr::null_mut()),
            "shim.null_pointer",
        );
    }
    assert!(p.is_null() && d.is_null() && h.is_null());
    assert_eq!(local, 0, "a foreign handle is never written through");
    delete(live);
}

#[test]
fn grad_mode_is_per_thread_and_enabled_by_default() {
    std::thread::spawn(|| {
        assert!(aoti_torch_grad_mode_is_enabled());
        aoti_torch_grad_mode_set_enabled(false);
        assert!(!aoti_torch_grad_mode_is_enabled());
        std::thread::spawn(|| assert!(aoti_torch_grad_mode_is_enabled()))
            .join()
            .unwrap();
        aoti_torch_grad_mode_set_enabled(true);
        assert!(aoti_torch_grad_mode_is_enabled());
    })
    .join()
    .unwrap();
}

#[test]
fn handles_are_created_used_and_deleted_from_many_threads() {
    let base = empty_f32(&[64], &[1]);
    write_f32(base, &iota(64));
    let weak = storage_weak(base);
    let base_addr = base as usize;
    let threads: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let base = base_addr as AtenTensorHandle;
                for i in 0..200 {
                    let off = (t * 16 + i % 16) as i64;
                    let v = reinterpret(base, &[1], &[1], off).unwrap();
                    assert_eq!(read_f32(v), [off as f32]);
                    let mut c = ptr::null_mut();
                    // SAFETY: `c` is writable.
                    ok(unsafe { aoti_torch_clone(v, &mut c) });
                    delete(v);
                    delete(c);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(weak.strong_count(), 1);
    delete(base);
    assert!(weak.upgrade().is_none());
}
