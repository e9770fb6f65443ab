//! The CUDA runtime library (`libcudart.so.N`) that a CUDA graph's `.so`
//! calls on the shim runtime.
//!
//! AOTInductor's CUDA wrapper code calls a handful of CUDA runtime functions
//! (`cudaFree`, `cudaMalloc`, `cudaStreamSynchronize`, `cudaEvent*`,
//! `cudaGetDevice`, ...) without naming `libcudart` in its `DT_NEEDED`: on
//! libtorch they bind to the copy `libtorch_cuda.so` brought in. On the shim
//! runtime nothing brings one, so the graph's binding stub
//! ([`crate::shim_bind`]) names the file found here. The runtime works on the
//! driver's primary context, as the shim does, so both see one context per
//! device.
//!
//! Where it is looked for, first found wins (docs/run.md, "Runtime"):
//! 1. `TORCH_COMPILED_GRAPHS_CUDART`: the path of the file;
//! 2. a `libcudart.so.N` already loaded in this process (the Python side
//!    loads the one of the `nvidia-cuda-runtime` wheel it finds on
//!    `sys.path`; a process holding torch has torch's);
//! 3. `libcudart.so.N` by the dynamic loader's own search (`LD_LIBRARY_PATH`,
//!    the `ldconfig` cache), for `N` from the driver's CUDA major down to 11;
//! 4. the CUDA toolkit's default directories under `/usr/local/cuda`.

use std::ffi::{c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The environment variable that names the CUDA runtime's file.
pub const ENV: &str = "TORCH_COMPILED_GRAPHS_CUDART";

/// Whether `name` (a file name) is a versioned CUDA runtime library.
fn is_cudart(name: &str) -> bool {
    name.strip_prefix("libcudart.so.")
        .and_then(|rest| rest.split('.').next())
        .is_some_and(|major| !major.is_empty() && major.bytes().all(|b| b.is_ascii_digit()))
}

/// The paths of the objects loaded in this process whose file name is a
/// versioned `libcudart`, in load order.
fn loaded() -> Vec<PathBuf> {
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: the loader hands a valid info for the callback's duration;
        // `data` is the Vec passed below, used on this thread only.
        let (info, found) = unsafe { (&*info, &mut *(data as *mut Vec<PathBuf>)) };
        if !info.dlpi_name.is_null() {
            // SAFETY: a NUL-terminated name owned by the loader.
            let name = unsafe { CStr::from_ptr(info.dlpi_name) };
            if let Ok(name) = name.to_str() {
                let path = Path::new(name);
                if path.is_absolute()
                    && path
                        .file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(is_cudart)
                {
                    found.push(path.to_owned());
                }
            }
        }
        0
    }
    let mut found: Vec<PathBuf> = Vec::new();
    // SAFETY: the callback only reads the loader's records and appends to
    // `found`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut found as *mut Vec<PathBuf> as *mut c_void) };
    found
}

/// The CUDA majors to try, newest first: from the driver's down to 11.
fn majors() -> Vec<i32> {
    let top = crate::driver::Driver::library()
        .and_then(|d| d.version())
        .map(|v| v / 1000)
        .unwrap_or(13)
        .clamp(11, 99);
    (11..=top).rev().collect()
}

fn search() -> Result<PathBuf, String> {
    if let Some(value) = std::env::var_os(ENV).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(&value);
        let named = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libcudart.so"));
        return match std::fs::metadata(&path) {
            Ok(m) if m.is_file() && named => {
                std::fs::canonicalize(&path).map_err(|e| format!("{ENV}={}: {e}", path.display()))
            }
            Ok(_) => Err(format!(
                "{ENV}={} is not a libcudart.so.N file",
                path.display()
            )),
            Err(e) => Err(format!("{ENV}={}: {e}", path.display())),
        };
    }
    if let Some(path) = loaded().into_iter().next() {
        return Ok(path);
    }
    let majors = majors();
    for major in &majors {
        let soname = CString::new(format!("libcudart.so.{major}")).expect("no NUL");
        // SAFETY: NVIDIA's CUDA runtime, found by the loader's own search;
        // its initialisers only set up its own state (the driver is opened
        // lazily, at its first call). The handle is kept for the process.
        let handle = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !handle.is_null() {
            if let Some(path) = loaded().into_iter().next() {
                return Ok(path);
            }
        }
    }
    let arch = if cfg!(target_arch = "aarch64") {
        ["sbsa-linux", "aarch64-linux"]
    } else {
        ["x86_64-linux", "x86_64-linux"]
    };
    for major in &majors {
        let name = format!("libcudart.so.{major}");
        let dirs = [
            PathBuf::from("/usr/local/cuda/lib64"),
            PathBuf::from(format!("/usr/local/cuda/targets/{}/lib", arch[0])),
            PathBuf::from(format!("/usr/local/cuda/targets/{}/lib", arch[1])),
        ];
        for dir in dirs {
            let path = dir.join(&name);
            if path.is_file() {
                return std::fs::canonicalize(&path)
                    .map_err(|e| format!("{}: {e}", path.display()));
            }
        }
    }
    let tried: Vec<String> = majors.iter().map(|m| format!("libcudart.so.{m}")).collect();
    Err(format!(
        "a CUDA graph's code calls the CUDA runtime, and none of {} was found: install it \
         (pip install nvidia-cuda-runtime, or the CUDA toolkit's libcudart on the library \
         path) or set {ENV} to the file",
        tried.join(", ")
    ))
}

/// The CUDA runtime library for graphs on the shim runtime (module docs):
/// once found it is kept for the process; not found is looked for again at
/// the next load (a library loaded since then is found).
pub fn locate() -> Result<PathBuf, String> {
    static FOUND: OnceLock<PathBuf> = OnceLock::new();
    if let Some(path) = FOUND.get() {
        return Ok(path.clone());
    }
    let path = search()?;
    Ok(FOUND.get_or_init(|| path).clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versioned_cuda_runtime_names_are_recognised() {
        assert!(is_cudart("libcudart.so.13"));
        assert!(is_cudart("libcudart.so.12.8.90"));
        assert!(!is_cudart("libcudart.so"));
        assert!(!is_cudart("libcudart.so."));
        assert!(!is_cudart("libcudart.so.x1"));
        assert!(!is_cudart("libcudart_static.a"));
        assert!(!is_cudart("libcuda.so.1"));
    }
}
