//! Compiles `src/check.cpp` (the C++ throw behind `aoti_torch_check`) into a
//! static library linked into this crate, with the C++ runtime it needs.
//! `crates/tcg-run/build.rs` builds the shim with `rustc` alone and does the
//! same, passing the object to its `rustc`.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let src = manifest.join("src/check.cpp");
    println!("cargo:rerun-if-changed={}", src.display());
    println!("cargo:rerun-if-env-changed=CXX");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"));
    let obj = out.join("check.o");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let status = Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-fPIC", "-c"])
        .arg(&src)
        .arg("-o")
        .arg(&obj)
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run the C++ compiler {cxx} for {}: {e}",
                src.display()
            )
        });
    assert!(
        status.success(),
        "{cxx} failed to compile {}",
        src.display()
    );
    let archive = out.join("libtcg_shim_check.a");
    let _ = std::fs::remove_file(&archive);
    let status = Command::new("ar")
        .arg("crs")
        .arg(&archive)
        .arg(&obj)
        .status()
        .unwrap_or_else(|e| panic!("cannot run ar: {e}"));
    assert!(status.success(), "ar failed to archive {}", obj.display());
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=tcg_shim_check");
    println!("cargo:rustc-link-lib=dylib=stdc++");
}
