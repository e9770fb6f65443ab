// Shared by crates/tcg-shim/build.rs and crates/tcg-run/build.rs (through
// `include!`): compiles `src/check.cpp`, the C++ throw behind
// `aoti_torch_check`, into the object `obj` with `CXX` (else `c++`).

/// Compile `src` (the shim's `check.cpp`) into `obj`; panics with the reason
/// when the compiler cannot run or fails.
fn compile_check_object(src: &std::path::Path, obj: &std::path::Path) {
    println!("cargo:rerun-if-changed={}", src.display());
    println!("cargo:rerun-if-env-changed=CXX");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let status = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-fPIC", "-c"])
        .arg(src)
        .arg("-o")
        .arg(obj)
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run the C++ compiler {cxx} for {}: {e}",
                src.display()
            )
        });
    assert!(status.success(), "{cxx} failed to compile {}", src.display());
}
