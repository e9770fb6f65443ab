//! The CUDA shim runtime's loading (crates/tcg-shim/README.md, "Loading on
//! CUDA"), checked on the host: the shim opened in the base namespace with
//! `RTLD_LOCAL` and a graph's `.so` bound to it through a binding stub with
//! `RTLD_DEEPBIND`. A stand-in for libtorch is loaded `RTLD_GLOBAL` first,
//! exporting the same `aoti_torch_*` name: the package must bind to the shim
//! anyway, and the global scope must never see the shim. Needs a C compiler
//! (`cc`); no GPU and no driver (the shim loads without one). Its own test
//! binary: it loads a library globally. A stand-in CUDA runtime
//! (`libcudart.so.13` exporting `cudaFree`) is named through
//! `TORCH_COMPILED_GRAPHS_CUDART`, as an operator would name the real one.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
use tcg_core::Code;
use tcg_run::{Runtime, Torch};

fn compile(dir: &Path, name: &str, source: &str) -> std::path::PathBuf {
    build(dir, name, "c", source, "cc", &[])
}

/// `dir/lib{name}.so` built from `source` (a file `{name}.{ext}`) by
/// `compiler`, with `extra` flags.
fn build(
    dir: &Path,
    name: &str,
    ext: &str,
    source: &str,
    compiler: &str,
    extra: &[&str],
) -> std::path::PathBuf {
    let src = dir.join(format!("{name}.{ext}"));
    let so = dir.join(format!("lib{name}.so"));
    std::fs::write(&src, source).unwrap();
    let out = Command::new(compiler)
        .args(["-shared", "-fPIC", "-O1"])
        .args(extra)
        .arg("-o")
        .arg(&so)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| {
            panic!("{compiler} is needed to build the stand-in libraries (as for the shim's own build): {e}")
        });
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    so
}

/// Runs the test `name` alone in a child of this test binary with `env` set
/// (the child's branch of the test checks its case) and requires it to pass.
fn in_child(name: &str, env: &[(&str, &std::ffi::OsStr)]) {
    let mut child = Command::new(std::env::current_exe().unwrap());
    child.args(["--exact", name, "--test-threads=1", "--nocapture"]);
    for (k, v) in env {
        child.env(k, v);
    }
    let out = child.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child ended with {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The stand-in CUDA runtime, built once and named in the environment before
/// any test opens the CUDA shim.
fn fake_cudart() -> &'static Path {
    static FAKE: OnceLock<PathBuf> = OnceLock::new();
    FAKE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        let built = compile(
            &dir,
            "cudart",
            "int cudaFree(void *p) { return p ? 1 : 42; }\n",
        );
        let path = dir.join("libcudart.so.13");
        std::fs::rename(built, &path).unwrap();
        if std::env::var_os("TCG_CHILD_NO_CUDART").is_none() {
            std::env::set_var(tcg_run::cudart::ENV, &path);
        }
        path
    })
}

fn global_symbol(name: &std::ffi::CStr) -> *mut libc::c_void {
    // SAFETY: a lookup in the global scope only.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

#[test]
fn a_package_binds_to_the_base_namespace_shim_even_with_a_global_aoti_torch_provider() {
    fake_cudart();
    let dir = tempfile::tempdir().unwrap();
    // What libtorch would be: a global provider of the same shim name.
    let fake = compile(
        dir.path(),
        "fake_torch",
        "int aoti_torch_dtype_float32(void) { return 999; }\n",
    );
    // SAFETY: a library of one function, loaded as libtorch is.
    let _fake = unsafe { Library::open(Some(&fake), RTLD_NOW | RTLD_GLOBAL) }.unwrap();
    // What a link_libtorch=False package is: undefined shim imports, and a
    // CUDA runtime import without a DT_NEEDED naming libcudart.
    let package = compile(
        dir.path(),
        "package",
        "extern int aoti_torch_dtype_float32(void);\n\
         extern int aoti_torch_dtype_bfloat16(void);\n\
         extern int cudaFree(void *);\n\
         int package_dtype(void) { return aoti_torch_dtype_float32() * 100 + aoti_torch_dtype_bfloat16(); }\n\
         int package_free(void) { return cudaFree(0); }\n",
    );

    let shim = Torch::open_shim_cuda().unwrap();
    assert_eq!(shim.runtime(), Runtime::ShimV1);
    assert!(shim.provides("aoti_torch_create_cuda_stream_guard"));
    assert!(shim.provides("tcg_shim_set_current_cuda_stream"));
    let lib = tcg_run::shim_bind::open_bound(shim.dir(), fake_cudart(), &package).unwrap();
    // SAFETY: the package's function, `int(void)`.
    let f = unsafe { lib.get::<unsafe extern "C" fn() -> i32>(b"package_dtype") }.unwrap();
    // c10's float32 (6) and bfloat16 (15) from the shim; 999 would be the
    // global provider's.
    // SAFETY: calls into the package, which calls the shim.
    assert_eq!(unsafe { f() }, 615);
    // The CUDA runtime import binds to the runtime the stub names.
    // SAFETY: the package's function, `int(void)`.
    let free = unsafe { lib.get::<unsafe extern "C" fn() -> i32>(b"package_free") }.unwrap();
    // SAFETY: calls into the package, which calls the stand-in runtime.
    assert_eq!(unsafe { free() }, 42);

    // The other direction: the global scope still answers with the
    // provider, and never sees the shim's own symbols.
    let p = global_symbol(c"aoti_torch_dtype_float32");
    assert!(!p.is_null());
    // SAFETY: the provider's `int(void)`.
    let g: unsafe extern "C" fn() -> i32 = unsafe { std::mem::transmute(p) };
    // SAFETY: as above.
    assert_eq!(unsafe { g() }, 999);
    assert!(global_symbol(c"tcg_shim_set_current_cuda_stream").is_null());
    assert!(global_symbol(c"aoti_torch_create_cuda_stream_guard").is_null());

    // Opened once per process.
    let again = Torch::open_shim_cuda().unwrap();
    assert!(std::sync::Arc::ptr_eq(&shim, &again));
}

#[test]
fn the_cuda_shim_loads_without_a_driver_and_cuda_is_then_a_typed_refusal() {
    fake_cudart();
    let shim = Torch::open_shim_cuda().unwrap();
    let has_driver =
        // SAFETY: only whether the driver library can be opened is asked.
        unsafe { Library::open(Some("libcuda.so.1"), RTLD_NOW) }.is_ok();
    if has_driver {
        // A GPU machine: the driver-backed CUDA state opens, or is refused
        // with the same typed error (a driver without a device).
        if let Err(err) = shim.cuda() {
            assert_eq!(err.code(), Code::RunDeviceMismatch, "{}", err.message());
        }
        return;
    }
    let err = shim.cuda().unwrap_err();
    assert_eq!(err.code(), Code::RunDeviceMismatch);
    assert!(err.message().contains("libcuda.so.1"), "{}", err.message());
}

#[test]
fn a_missing_cuda_runtime_is_a_typed_refusal_that_says_where_to_name_one() {
    const NAME: &str = "a_missing_cuda_runtime_is_a_typed_refusal_that_says_where_to_name_one";
    if std::env::var_os("TCG_CHILD_NO_CUDART").is_some() {
        // The child: the variable names a file that does not exist.
        let err = Torch::open_shim_cuda().unwrap_err();
        assert_eq!(err.code(), Code::RunDeviceMismatch);
        assert!(
            err.message().contains(tcg_run::cudart::ENV)
                && err.message().contains("libcudart.so.13"),
            "{}",
            err.message()
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("libcudart.so.13");
    in_child(
        NAME,
        &[
            ("TCG_CHILD_NO_CUDART", "1".as_ref()),
            (tcg_run::cudart::ENV, missing.as_os_str()),
        ],
    );
}

/// What the H200's default `g++` makes: a package carrying its own static
/// copy of libstdc++, whose container creation parses the device string with
/// `std::regex` (AOTInductor's `parse_device_str`). The process's own
/// `libstdc++.so.6` has numbered the locale's facets first (as it has in any
/// process that built a `std::locale`); the package must still work, through
/// the process's C++ runtime, not abort or crash. Run in a child: the failure
/// this guards against is a `bad_cast` abort or a segfault.
#[test]
fn a_package_carrying_its_own_static_libstdcxx_uses_the_process_cxx_runtime() {
    const NAME: &str = "a_package_carrying_its_own_static_libstdcxx_uses_the_process_cxx_runtime";
    if std::env::var_os("TCG_CHILD_STATIC_CXX").is_none() {
        in_child(NAME, &[("TCG_CHILD_STATIC_CXX", "1".as_ref())]);
        return;
    }
    fake_cudart();
    let dir = tempfile::tempdir().unwrap();
    let package = build(
        dir.path(),
        "package",
        "cpp",
        "#include <regex>\n#include <string>\n\
         extern \"C\" int parse_device(const char* s) {\n\
           std::regex re(\"(cpu|cuda)(:([0-9]+))?\");\n\
           std::smatch m; std::string text(s);\n\
           if (!std::regex_match(text, m, re)) return -1;\n\
           return m[3].matched ? std::stoi(m[3].str()) : 0;\n\
         }\n",
        "c++",
        &["-static-libstdc++", "-static-libgcc"],
    );

    let shim = Torch::open_shim_cuda().unwrap();
    // The process's libstdc++ (the shim's dependency) builds its classic
    // locale, numbering every standard facet id, as libstdc++ 13 and later
    // do when they load and any C++ program does at its first locale.
    // SAFETY: an already loaded library; `std::locale::locale()` and
    // `~locale()` construct and destroy one pointer-sized value in `buf`.
    unsafe {
        let cxx = Library::open(
            Some("libstdc++.so.6"),
            RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_LOCAL,
        )
        .expect("the shim loaded libstdc++.so.6");
        let ctor = cxx
            .get::<unsafe extern "C" fn(*mut u64)>(b"_ZNSt6localeC1Ev")
            .unwrap();
        let dtor = cxx
            .get::<unsafe extern "C" fn(*mut u64)>(b"_ZNSt6localeD1Ev")
            .unwrap();
        let mut buf = [0u64; 4];
        ctor(buf.as_mut_ptr());
        dtor(buf.as_mut_ptr());
    }
    let lib = tcg_run::shim_bind::open_bound(shim.dir(), fake_cudart(), &package).unwrap();
    // SAFETY: the package's `int(const char*)`.
    let parse =
        unsafe { lib.get::<unsafe extern "C" fn(*const libc::c_char) -> i32>(b"parse_device") }
            .unwrap();
    // SAFETY: a NUL-terminated string.
    assert_eq!(unsafe { parse(c"cuda:3".as_ptr()) }, 3);
    // SAFETY: as above.
    assert_eq!(unsafe { parse(c"cpu".as_ptr()) }, 0);
}
