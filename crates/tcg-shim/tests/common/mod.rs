//! Helpers shared by the C ABI tests: every call goes through the exported
//! `extern "C"` functions, as generated code makes them.
#![allow(dead_code)]

use std::ptr;

use tcg_shim::*;

/// Asserts success, printing the last error otherwise.
pub fn ok(rc: AotiTorchError) {
    assert_eq!(rc, AOTI_TORCH_SUCCESS, "{:?}", last_error_message());
}

/// Asserts failure with the given code, and that a message was recorded.
pub fn fails(rc: AotiTorchError, code: &str) -> String {
    assert_eq!(rc, AOTI_TORCH_FAILURE, "expected {code}");
    let err = take_last_error().expect("a failure records an error");
    assert_eq!(err.code(), code, "{err}");
    let msg = err.to_string();
    assert!(!msg.is_empty());
    msg
}

pub fn empty(
    sizes: &[i64],
    strides: &[i64],
    dtype: i32,
    device_type: i32,
    index: i32,
) -> Result<AtenTensorHandle, ShimError> {
    let mut h = ptr::null_mut();
    // SAFETY: the arrays have `sizes.len()` elements; `h` is writable.
    let rc = unsafe {
        aoti_torch_empty_strided(
            sizes.len() as i64,
            sizes.as_ptr(),
            strides.as_ptr(),
            dtype,
            device_type,
            index,
            &mut h,
        )
    };
    if rc == AOTI_TORCH_SUCCESS {
        Ok(h)
    } else {
        Err(take_last_error().unwrap())
    }
}

pub fn empty_f32(sizes: &[i64], strides: &[i64]) -> AtenTensorHandle {
    empty(
        sizes,
        strides,
        aoti_torch_dtype_float32(),
        aoti_torch_device_type_cpu(),
        -1,
    )
    .unwrap()
}

pub fn reinterpret(
    h: AtenTensorHandle,
    sizes: &[i64],
    strides: &[i64],
    offset: i64,
) -> Result<AtenTensorHandle, ShimError> {
    let mut v = ptr::null_mut();
    // SAFETY: as in `empty`.
    let rc = unsafe {
        aoti_torch__reinterpret_tensor(
            h,
            sizes.len() as i64,
            sizes.as_ptr(),
            strides.as_ptr(),
            offset,
            &mut v,
        )
    };
    if rc == AOTI_TORCH_SUCCESS {
        Ok(v)
    } else {
        Err(take_last_error().unwrap())
    }
}

pub fn delete(h: AtenTensorHandle) {
    // SAFETY: any value is accepted and checked.
    ok(unsafe { aoti_torch_delete_tensor_object(h) });
}

pub fn sizes(h: AtenTensorHandle) -> Vec<i64> {
    let (mut dim, mut p) = (0i64, ptr::null_mut());
    // SAFETY: outputs are writable locals.
    unsafe {
        ok(aoti_torch_get_dim(h, &mut dim));
        ok(aoti_torch_get_sizes(h, &mut p));
        std::slice::from_raw_parts(p, dim as usize).to_vec()
    }
}

pub fn strides(h: AtenTensorHandle) -> Vec<i64> {
    let (mut dim, mut p) = (0i64, ptr::null_mut());
    // SAFETY: outputs are writable locals.
    unsafe {
        ok(aoti_torch_get_dim(h, &mut dim));
        ok(aoti_torch_get_strides(h, &mut p));
        std::slice::from_raw_parts(p, dim as usize).to_vec()
    }
}

pub fn data_ptr(h: AtenTensorHandle) -> *mut u8 {
    let mut p = ptr::null_mut();
    // SAFETY: output is a writable local.
    ok(unsafe { aoti_torch_get_data_ptr(h, &mut p) });
    p.cast()
}

pub fn get_i64(
    f: unsafe extern "C" fn(AtenTensorHandle, *mut i64) -> AotiTorchError,
    h: AtenTensorHandle,
) -> i64 {
    let mut v = -7;
    // SAFETY: output is a writable local.
    ok(unsafe { f(h, &mut v) });
    v
}

pub fn get_i32(
    f: unsafe extern "C" fn(AtenTensorHandle, *mut i32) -> AotiTorchError,
    h: AtenTensorHandle,
) -> i32 {
    let mut v = -7;
    // SAFETY: output is a writable local.
    ok(unsafe { f(h, &mut v) });
    v
}

/// Byte offsets of the elements of a view in logical order, from its getters.
fn offsets(h: AtenTensorHandle, item: usize) -> Vec<usize> {
    let (sz, st) = (sizes(h), strides(h));
    let numel: i64 = sz.iter().product();
    let mut out = Vec::with_capacity(numel as usize);
    let mut idx = vec![0i64; sz.len()];
    for _ in 0..numel {
        let off: i64 = idx.iter().zip(&st).map(|(i, s)| i * s).sum();
        out.push(off as usize * item);
        for d in (0..sz.len()).rev() {
            idx[d] += 1;
            if idx[d] < sz[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// Reads an f32 view in logical order through its data pointer and strides.
pub fn read_f32(h: AtenTensorHandle) -> Vec<f32> {
    let base = data_ptr(h);
    offsets(h, 4)
        .into_iter()
        // SAFETY: offsets of a live view inside its checked storage.
        .map(|o| unsafe { base.add(o).cast::<f32>().read_unaligned() })
        .collect()
}

/// Writes an f32 view in logical order.
pub fn write_f32(h: AtenTensorHandle, values: &[f32]) {
    let base = data_ptr(h);
    let offs = offsets(h, 4);
    assert_eq!(offs.len(), values.len());
    for (o, v) in offs.into_iter().zip(values) {
        // SAFETY: as in `read_f32`.
        unsafe { base.add(o).cast::<f32>().write_unaligned(*v) };
    }
}

/// A weak reference to the storage behind a handle (dead once it is freed).
pub fn storage_weak(h: AtenTensorHandle) -> std::sync::Weak<Storage> {
    with_tensor(h, "h", |t| Ok(std::sync::Arc::downgrade(t.storage()))).unwrap()
}

pub fn iota(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32).collect()
}

/// Build the C++ program `src` against torch's headers in `include` and this
/// crate's `libtcg_shim.so` (found next to the test binary, in
/// target/<profile>/deps, with an rpath to it) into `exe`, with `extra`
/// compiler arguments; panics with the compiler's output when it fails. The
/// compiler is `CXX`, else `c++`: the one the shim's own build needs.
pub fn build_cpp_against_shim(
    src: &std::path::Path,
    include: &std::path::Path,
    extra: &[&str],
    exe: &std::path::Path,
) {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let deps = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    assert!(
        deps.join("libtcg_shim.so").is_file(),
        "no libtcg_shim.so in {}",
        deps.display()
    );
    let build = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O0", "-I"])
        .arg(include)
        .arg(src)
        .arg("-L")
        .arg(&deps)
        .arg("-ltcg_shim")
        .arg(format!("-Wl,-rpath,{}", deps.display()))
        .args(extra)
        .arg("-o")
        .arg(exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C++ compiler {cxx:?}: {e}"));
    assert!(
        build.status.success(),
        "{}",
        String::from_utf8_lossy(&build.stderr)
    );
}
