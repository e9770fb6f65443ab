//! Builds `libtcg_shim.so` (crates/tcg-shim, a crate with no dependencies)
//! with `rustc` alone and leaves it in OUT_DIR, where `src/shim_runtime.rs`
//! embeds its bytes: the shim runtime then travels inside every binary that
//! links tcg-run (the Python extension of the wheel, the serve example), and
//! the library it loads is always the one built from the same sources.
//!
//! `aoti_torch_check` throws a C++ exception, from `src/check.cpp` of the
//! shim, compiled here with `CXX` (else `c++`) and linked in with libstdc++.
//!
//! No Rust crate depends on tcg-shim (its `#[no_mangle]` symbols would be
//! exported from the binary that links it): only its bytes are carried here.

use std::path::PathBuf;
use std::process::Command;

include!("../tcg-shim/build_check.rs");

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let shim = manifest.join("../tcg-shim");
    let lib = shim.join("src/lib.rs");
    println!("cargo:rerun-if-changed={}", shim.join("src").display());
    println!(
        "cargo:rerun-if-changed={}",
        shim.join("README.md").display()
    );
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"));
    let so = out.join("libtcg_shim.so");
    // The C++ throw behind `aoti_torch_check` (crates/tcg-shim/src/check.cpp,
    // as the shim's own build.rs compiles it).
    let obj = out.join("tcg_shim_check.o");
    compile_check_object(&shim.join("src/check.cpp"), &obj);
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let mut cmd = Command::new(rustc);
    cmd.arg("--crate-name")
        .arg("tcg_shim")
        .args(["--crate-type", "cdylib", "--edition", "2021"])
        // Optimised in every profile: generated kernels call the getters and
        // allocation on every run.
        .args([
            "-C",
            "opt-level=2",
            "-C",
            "debuginfo=0",
            "-C",
            "strip=debuginfo",
        ])
        .args(["-C", "link-arg=-Wl,-soname,libtcg_shim.so"])
        .arg("-C")
        .arg(format!("link-arg={}", obj.display()))
        .args(["-C", "link-arg=-lstdc++"])
        .args(["--cap-lints", "allow"])
        .arg("-o")
        .arg(&so)
        .arg(&lib);
    let target = std::env::var("TARGET").unwrap_or_default();
    let host = std::env::var("HOST").unwrap_or_default();
    if !target.is_empty() && target != host {
        cmd.args(["--target", &target]);
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run rustc to build libtcg_shim.so: {e}"));
    assert!(
        status.success(),
        "rustc failed to build libtcg_shim.so from {}",
        lib.display()
    );
}
