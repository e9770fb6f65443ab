//! The CUDA half of the shim on a real device: allocation and free on
//! streams from the pool, host↔device and device↔device copies checked byte
//! for byte, guards, and an allocation made during a stream capture whose
//! graph is then replayed.
//!
//! Every test here is `#[ignore]`d: cargo reports them as ignored (never as
//! passed) on a machine without a GPU. On a GPU machine run them with
//! `--ignored`; there a missing driver or device is a failure, not a skip.
//!
//! ```text
//! CARGO_TARGET_DIR=... cargo test -p tcg-shim --test cuda_device --no-run
//! <the printed binary> --ignored --test-threads=1
//! ```

mod common;

use std::ffi::c_void;
use std::ptr;

use common::*;
use tcg_shim::cuda::{self, Driver};
use tcg_shim::*;

type CuStream = *mut c_void;

/// The driver functions the tests need beyond the shim's.
struct Extra {
    stream_create: unsafe extern "C" fn(*mut CuStream, u32) -> i32,
    stream_destroy: unsafe extern "C" fn(CuStream) -> i32,
    stream_synchronize: unsafe extern "C" fn(CuStream) -> i32,
    begin_capture: unsafe extern "C" fn(CuStream, i32) -> i32,
    end_capture: unsafe extern "C" fn(CuStream, *mut *mut c_void) -> i32,
    instantiate: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u64) -> i32,
    launch: unsafe extern "C" fn(*mut c_void, CuStream) -> i32,
    exec_destroy: unsafe extern "C" fn(*mut c_void) -> i32,
    graph_destroy: unsafe extern "C" fn(*mut c_void) -> i32,
}

fn driver() -> &'static Driver {
    cuda::driver().unwrap_or_else(|e| {
        panic!(
            "these tests need a CUDA device and driver ({}): {e}",
            e.code()
        )
    })
}

fn extra() -> Extra {
    let d = driver();
    // SAFETY: each type is cuda.h's signature for the name.
    unsafe {
        Extra {
            stream_create: d.symbol("cuStreamCreate").unwrap(),
            stream_destroy: d.symbol("cuStreamDestroy_v2").unwrap(),
            stream_synchronize: d.symbol("cuStreamSynchronize").unwrap(),
            begin_capture: d.symbol("cuStreamBeginCapture_v2").unwrap(),
            end_capture: d.symbol("cuStreamEndCapture").unwrap(),
            instantiate: d.symbol("cuGraphInstantiateWithFlags").unwrap(),
            launch: d.symbol("cuGraphLaunch").unwrap(),
            exec_destroy: d.symbol("cuGraphExecDestroy").unwrap(),
            graph_destroy: d.symbol("cuGraphDestroy").unwrap(),
        }
    }
}

fn check(rc: i32, what: &str) {
    if rc != 0 {
        panic!("{what} failed: {} ({rc})", driver().error_name(rc));
    }
}

/// A non-blocking stream on device 0 (its context made current first).
fn new_stream(x: &Extra) -> CuStream {
    cuda::set_device(0).unwrap();
    let mut s: CuStream = ptr::null_mut();
    // SAFETY: writes one stream; flag 1 is CU_STREAM_NON_BLOCKING.
    check(unsafe { (x.stream_create)(&mut s, 1) }, "cuStreamCreate");
    s
}

fn sync(x: &Extra, s: CuStream) {
    // SAFETY: a live stream.
    check(unsafe { (x.stream_synchronize)(s) }, "cuStreamSynchronize");
}

fn set_stream(s: CuStream) {
    // SAFETY: the stream is only recorded.
    ok(unsafe { tcg_shim_set_current_cuda_stream(0, s, ptr::null_mut()) });
}

fn cuda_f32(sizes: &[i64], strides: &[i64]) -> AtenTensorHandle {
    empty(
        sizes,
        strides,
        aoti_torch_dtype_float32(),
        aoti_torch_device_type_cuda(),
        0,
    )
    .unwrap()
}

fn copy(dst: AtenTensorHandle, src: AtenTensorHandle) {
    // SAFETY: live handles.
    ok(unsafe { aoti_torch_copy_(dst, src, 0) });
}

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| seed + i as f32 * 0.5).collect()
}

#[test]
#[ignore = "needs a CUDA device: run with --ignored on a GPU machine"]
fn host_device_round_trips_keep_every_byte_on_a_stream() {
    let x = extra();
    let s = new_stream(&x);
    set_stream(s);
    let host = empty_f32(&[4, 5], &[5, 1]);
    write_f32(host, &values(20, 1.0));
    let dev = cuda_f32(&[4, 5], &[5, 1]);
    assert_eq!(get_i32(aoti_torch_get_device_type, dev), 1);
    assert_eq!(get_i32(aoti_torch_get_device_index, dev), 0);
    assert_eq!(data_ptr(dev) as usize % 64, 0);
    copy(dev, host);
    // Device to device: clone and clone_preserve_strides of a view.
    let mut c = ptr::null_mut();
    let mut cp = ptr::null_mut();
    let col = reinterpret(dev, &[4, 2], &[5, 2], 1).unwrap();
    // SAFETY: live handles; outputs writable.
    unsafe {
        ok(aoti_torch_clone(dev, &mut c));
        ok(aoti_torch_clone_preserve_strides(col, &mut cp));
    }
    assert_eq!(strides(cp), [5, 2]);
    let back = empty_f32(&[4, 5], &[5, 1]);
    copy(back, c);
    assert_eq!(read_f32(back), values(20, 1.0));
    // Strided host destination from a dense device source (staged).
    let host_t = empty_f32(&[5, 4], &[1, 5]);
    let dev_t = reinterpret(dev, &[5, 4], &[1, 5], 0).unwrap();
    copy(host_t, dev_t);
    let want: Vec<f32> = (0..5)
        .flat_map(|i| (0..4).map(move |j| 1.0 + (j * 5 + i) as f32 * 0.5))
        .collect();
    assert_eq!(read_f32(host_t), want);
    let host_cp = empty_f32(&[4, 2], &[2, 1]);
    let cp_dense = reinterpret(cp, &[4, 2], &[5, 2], 0).unwrap();
    // SAFETY: live handles.
    unsafe {
        fails(
            aoti_torch_copy_(host_cp, cp_dense, 0),
            "shim.strided_device_copy",
        );
    }
    for h in [
        host, dev, c, cp, col, back, host_t, dev_t, host_cp, cp_dense,
    ] {
        delete(h);
    }
    sync(&x, s);
    set_stream(ptr::null_mut());
    // SAFETY: idle stream, destroyed once.
    unsafe { (x.stream_destroy)(s) };
}

#[test]
#[ignore = "needs a CUDA device: run with --ignored on a GPU machine"]
fn freed_blocks_stay_in_the_pool_and_are_reused() {
    let x = extra();
    let s = new_stream(&x);
    set_stream(s);
    let n = 1 << 18; // 1 MiB of f32
    let a = cuda_f32(&[n], &[1]);
    let first = data_ptr(a) as usize;
    delete(a);
    sync(&x, s);
    let (reserved, used) = cuda::pool_usage(0).unwrap();
    assert!(
        reserved >= 4 * n as u64,
        "released to the driver: {reserved}"
    );
    assert_eq!(used, 0);
    let b = cuda_f32(&[n], &[1]);
    assert_eq!(data_ptr(b) as usize, first, "the freed block comes back");
    assert_eq!(cuda::pool_usage(0).unwrap().0, reserved);
    delete(b);
    sync(&x, s);
    set_stream(ptr::null_mut());
    // SAFETY: idle stream, destroyed once.
    unsafe { (x.stream_destroy)(s) };
}

#[test]
#[ignore = "needs a CUDA device: run with --ignored on a GPU machine"]
fn guards_switch_device_and_stream_and_restore_them() {
    let x = extra();
    let s = new_stream(&x);
    let mut g: *mut c_void = ptr::null_mut();
    let mut sg: *mut c_void = ptr::null_mut();
    let mut cur: *mut c_void = ptr::null_mut();
    // SAFETY: outputs writable; guards deleted once, in reverse order.
    unsafe {
        ok(aoti_torch_create_cuda_guard(0, &mut g));
        assert_eq!(cuda::current_device().unwrap(), Some(0));
        ok(aoti_torch_create_cuda_stream_guard(s, 0, &mut sg));
        ok(aoti_torch_get_current_cuda_stream(-1, &mut cur));
        assert_eq!(cur, s);
        ok(aoti_torch_delete_cuda_stream_guard(sg));
        ok(aoti_torch_get_current_cuda_stream(0, &mut cur));
        assert!(cur.is_null());
        let count = cuda::driver().unwrap().device_count().unwrap();
        fails(
            aoti_torch_cuda_guard_set_index(g, count),
            "shim.unsupported_device",
        );
        ok(aoti_torch_delete_cuda_guard(g));
        fails(aoti_torch_delete_cuda_guard(g), "shim.unknown_guard");
        (x.stream_destroy)(s);
    }
}

#[test]
#[ignore = "needs a CUDA device: run with --ignored on a GPU machine"]
fn an_allocation_during_capture_is_graph_memory_and_the_graph_replays() {
    let x = extra();
    let s = new_stream(&x);
    set_stream(s);
    let n = 1024usize;
    let host_in = empty_f32(&[n as i64], &[1]);
    let host_out = empty_f32(&[n as i64], &[1]);
    let input = cuda_f32(&[n as i64], &[1]);
    let output = cuda_f32(&[n as i64], &[1]);
    // Made outside the capture, freed inside it: must not become a free node.
    let outsider = cuda_f32(&[n as i64], &[1]);
    sync(&x, s);
    let before = cuda::stats();

    // SAFETY: the capture is begun and ended on `s` by this thread.
    check(
        unsafe { (x.begin_capture)(s, 1) },
        "cuStreamBeginCapture (thread-local)",
    );
    let scratch = cuda_f32(&[n as i64], &[1]);
    copy(scratch, input);
    copy(output, scratch);
    delete(scratch);
    delete(outsider);
    let mut graph: *mut c_void = ptr::null_mut();
    // SAFETY: ends the capture begun above.
    check(
        unsafe { (x.end_capture)(s, &mut graph) },
        "cuStreamEndCapture",
    );
    let during = cuda::stats();
    assert_eq!(during.captured_allocations, before.captured_allocations + 1);
    assert_eq!(during.deferred, before.deferred + 1, "the outsider waits");
    assert_eq!(during.frees, before.frees + 1, "the scratch's free node");

    let mut exec: *mut c_void = ptr::null_mut();
    // SAFETY: instantiates the captured graph; AutoFreeOnLaunch = 1.
    check(
        unsafe { (x.instantiate)(&mut exec, graph, 1) },
        "cuGraphInstantiateWithFlags",
    );
    for round in 0..3 {
        let want = values(n, 10.0 * round as f32);
        write_f32(host_in, &want);
        copy(input, host_in);
        // SAFETY: an executable graph on its stream.
        check(unsafe { (x.launch)(exec, s) }, "cuGraphLaunch");
        copy(host_out, output);
        assert_eq!(read_f32(host_out), want, "replay {round}");
    }
    // The next allocation outside any capture frees the outsider.
    let after = cuda_f32(&[4], &[1]);
    assert_eq!(cuda::stats().frees, during.frees + 1);
    assert_eq!(cuda::stats().free_failures, before.free_failures);
    delete(after);
    sync(&x, s);
    // SAFETY: destroyed once each, after the stream is idle.
    unsafe {
        (x.exec_destroy)(exec);
        (x.graph_destroy)(graph);
    }
    for h in [host_in, host_out, input, output] {
        delete(h);
    }
    sync(&x, s);
    set_stream(ptr::null_mut());
    // SAFETY: idle stream, destroyed once.
    unsafe { (x.stream_destroy)(s) };
}
