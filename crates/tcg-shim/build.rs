//! Compiles `src/check.cpp` (the C++ throw behind `aoti_torch_check`) into a
//! static library linked into this crate, with the C++ runtime it needs.
//! `crates/tcg-run/build.rs` builds the shim with `rustc` alone and does the
//! same, passing the object to its `rustc`.

use std::path::PathBuf;
use std::process::Command;

include!("build_check.rs");

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"));
    let obj = out.join("check.o");
    compile_check_object(&manifest.join("src/check.cpp"), &obj);
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
