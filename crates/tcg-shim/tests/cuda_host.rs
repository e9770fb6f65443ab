//! The CUDA half of the shim on a process whose driver cannot be loaded:
//! every test points `TCG_SHIM_LIBCUDA` at a library that does not exist
//! before anything asks for the driver, so these run the same on a machine
//! with a GPU. The shim must stay usable for host memory and answer every
//! CUDA call with a typed error (`shim.cuda_unavailable`), never a crash.
//! Its own test binary: the driver is opened once per process.

mod common;

use std::ffi::c_void;
use std::ptr;

use common::*;
use tcg_shim::cuda::LIBCUDA_ENV;
use tcg_shim::*;

const MISSING: &str = "libcuda-missing-for-tcg-shim-tests.so.1";

fn no_driver() {
    std::env::set_var(LIBCUDA_ENV, MISSING);
}

fn blob_on_cuda(data: *mut c_void, sizes: &[i64], strides: &[i64]) -> AtenTensorHandle {
    let mut h = ptr::null_mut();
    // SAFETY: arrays of `sizes.len()` values; `h` writable. The address is
    // never dereferenced on the host (CUDA memory by declaration).
    ok(unsafe {
        aoti_torch_create_tensor_from_blob(
            data,
            sizes.len() as i64,
            sizes.as_ptr(),
            strides.as_ptr(),
            0,
            aoti_torch_dtype_float32(),
            aoti_torch_device_type_cuda(),
            0,
            &mut h,
        )
    });
    h
}

#[test]
fn without_a_driver_cuda_allocation_is_cuda_unavailable_and_host_memory_still_works() {
    no_driver();
    let err = empty(
        &[4],
        &[1],
        aoti_torch_dtype_float32(),
        aoti_torch_device_type_cuda(),
        0,
    )
    .unwrap_err();
    assert_eq!(err.code(), "shim.cuda_unavailable");
    assert!(err.to_string().contains(MISSING), "{err}");
    // `cuda:-1` needs the driver to know the current device.
    let err = empty(
        &[4],
        &[1],
        aoti_torch_dtype_float32(),
        aoti_torch_device_type_cuda(),
        -1,
    )
    .unwrap_err();
    assert_eq!(err.code(), "shim.cuda_unavailable");
    fails(tcg_shim_cuda_available(), "shim.cuda_unavailable");
    // Asked twice, answered the same (the failed open is kept, not retried).
    fails(tcg_shim_cuda_available(), "shim.cuda_unavailable");
    let h = empty_f32(&[2, 2], &[2, 1]);
    write_f32(h, &iota(4));
    assert_eq!(read_f32(h), iota(4));
    delete(h);
}

#[test]
fn guards_without_a_driver_are_refused_and_write_no_handle() {
    no_driver();
    let mut g: *mut c_void = ptr::null_mut();
    // SAFETY: `g` is writable; handles are looked up, never dereferenced.
    unsafe {
        fails(
            aoti_torch_create_cuda_guard(0, &mut g),
            "shim.cuda_unavailable",
        );
        assert!(g.is_null());
        fails(
            aoti_torch_create_cuda_stream_guard(0x10 as *mut c_void, 0, &mut g),
            "shim.cuda_unavailable",
        );
        assert!(g.is_null());
        fails(
            aoti_torch_create_cuda_guard(0, ptr::null_mut()),
            "shim.null_pointer",
        );
        fails(
            aoti_torch_delete_cuda_guard(ptr::null_mut()),
            "shim.unknown_guard",
        );
        fails(
            aoti_torch_delete_cuda_stream_guard(0xdead as *mut c_void),
            "shim.unknown_guard",
        );
        fails(
            aoti_torch_cuda_guard_set_index(0x1234 as *mut c_void, 0),
            "shim.unknown_guard",
        );
    }
}

#[test]
fn the_current_stream_is_the_legacy_stream_until_the_runtime_sets_one_per_thread() {
    no_driver();
    let get = |index: i32| -> *mut c_void {
        let mut s: *mut c_void = 0x10 as *mut c_void;
        // SAFETY: `s` is writable.
        ok(unsafe { aoti_torch_get_current_cuda_stream(index, &mut s) });
        s
    };
    assert!(get(0).is_null(), "the legacy default stream");
    let mut previous: *mut c_void = 0x10 as *mut c_void;
    // SAFETY: `previous` is writable; the stream is only recorded.
    ok(unsafe { tcg_shim_set_current_cuda_stream(0, 0x5000 as *mut c_void, &mut previous) });
    assert!(previous.is_null());
    assert_eq!(get(0) as usize, 0x5000);
    assert!(get(1).is_null(), "per device");
    std::thread::spawn(move || assert!(get(0).is_null(), "per thread"))
        .join()
        .unwrap();
    // SAFETY: a null previous pointer is allowed.
    ok(unsafe { tcg_shim_set_current_cuda_stream(0, ptr::null_mut(), ptr::null_mut()) });
    assert!(get(0).is_null());
    // SAFETY: as above; refusals write nothing.
    unsafe {
        fails(
            tcg_shim_set_current_cuda_stream(-1, ptr::null_mut(), ptr::null_mut()),
            "shim.unsupported_device",
        );
        fails(
            aoti_torch_get_current_cuda_stream(0, ptr::null_mut()),
            "shim.null_pointer",
        );
        let mut s: *mut c_void = ptr::null_mut();
        // The current device is the driver's to say.
        fails(
            aoti_torch_get_current_cuda_stream(-1, &mut s),
            "shim.cuda_unavailable",
        );
    }
}

#[test]
fn device_copies_without_a_driver_are_refused_with_the_reason() {
    no_driver();
    // Addresses declared as CUDA memory; the shim must not touch them.
    let dense = blob_on_cuda(0x7000_0000 as *mut c_void, &[2, 3], &[3, 1]);
    let transposed = blob_on_cuda(0x7100_0000 as *mut c_void, &[2, 3], &[1, 2]);
    let host = empty_f32(&[2, 3], &[3, 1]);
    let host_t = empty_f32(&[2, 3], &[1, 2]);
    let mut out = ptr::null_mut();
    // SAFETY: live handles; `out` writable.
    unsafe {
        // Dense to dense needs the driver.
        fails(aoti_torch_copy_(dense, host, 0), "shim.cuda_unavailable");
        fails(aoti_torch_copy_(host, dense, 1), "shim.cuda_unavailable");
        // A strided host side is staged: still the driver's to copy.
        fails(aoti_torch_copy_(dense, host_t, 0), "shim.cuda_unavailable");
        // Two device views of different strides need a kernel: refused
        // before any driver call, whatever the machine.
        let msg = fails(
            aoti_torch_copy_(dense, transposed, 0),
            "shim.strided_device_copy",
        );
        assert!(msg.contains("[1, 2]"), "{msg}");
        // A device side that is not dense (rows padded to 4), with a host
        // side: also a kernel.
        let padded = blob_on_cuda(0x7200_0000 as *mut c_void, &[2, 3], &[4, 1]);
        fails(
            aoti_torch_copy_(padded, host, 0),
            "shim.strided_device_copy",
        );
        fails(
            aoti_torch_copy_(host, padded, 0),
            "shim.strided_device_copy",
        );
        // Column-major is dense: staged through the host, so the driver's.
        fails(
            aoti_torch_copy_(transposed, host, 0),
            "shim.cuda_unavailable",
        );
        delete(padded);
        // Shape and dtype are checked first, as on the host.
        let small = empty_f32(&[3], &[1]);
        fails(aoti_torch_copy_(dense, small, 0), "shim.copy_mismatch");
        delete(small);
        // Clones allocate on the device first.
        fails(aoti_torch_clone(dense, &mut out), "shim.cuda_unavailable");
        fails(
            aoti_torch_clone_preserve_strides(transposed, &mut out),
            "shim.cuda_unavailable",
        );
    }
    assert!(out.is_null());
    for h in [dense, transposed, host, host_t] {
        delete(h);
    }
}

#[test]
fn driver_errors_carry_stable_codes_and_the_cuda_result_name() {
    let e = ShimError::CudaDriver {
        call: "cuMemcpyAsync",
        result: 1,
        name: "CUDA_ERROR_INVALID_VALUE".into(),
    };
    assert_eq!(e.code(), "shim.cuda_driver");
    assert_eq!(
        e.to_string(),
        "CUDA driver call cuMemcpyAsync failed: CUDA_ERROR_INVALID_VALUE (1)"
    );
    let e = tcg_shim::cuda::Driver::open("/nonexistent/libcuda.so.1").unwrap_err();
    assert_eq!(e.code(), "shim.cuda_unavailable");
    assert!(e.to_string().contains("/nonexistent/libcuda.so.1"), "{e}");
}
