//! Builds `tests/cpp/smoke.cpp` against torch's own `shim.h` and this crate's
//! `libtcg_shim.so` (no libtorch), runs it, and expects `ok`: the header's
//! prototypes fix the argument types at each call, so a signature of ours
//! that differs from shim.h gives wrong values there.
//!
//! Needs torch's headers (`TCG_TORCH_INCLUDE`, else the workspace's `.venv`;
//! without them the test says so on stderr and passes) and the C++ compiler
//! the shim's build uses (`CXX`, else `c++`).
//!
//! It loads `target/<profile>/deps/libtcg_shim.so`, whose name carries no
//! hash: a `cargo build` and a `cargo test` of different sources can leave a
//! stale one there (seen while mutation-testing this crate); `cargo clean -p
//! tcg-shim` clears it.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn torch_include() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("TCG_TORCH_INCLUDE") {
        return Some(PathBuf::from(dir));
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = manifest.parent()?.parent()?.join(".venv").join("lib");
    std::fs::read_dir(lib)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path().join("site-packages/torch/include"))
        .find(|p| p.join("torch/csrc/inductor/aoti_torch/c/shim.h").is_file())
}

#[test]
fn torch_shim_header_calls_reach_our_library_with_the_right_arguments() {
    let Some(include) = torch_include() else {
        eprintln!("skipped: no torch headers (set TCG_TORCH_INCLUDE)");
        return;
    };
    let out_dir = std::env::temp_dir().join(format!("tcg-shim-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).unwrap();
    let exe = out_dir.join("smoke");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cpp/smoke.cpp");
    common::build_cpp_against_shim(&src, &include, &[], &exe);
    let run = Command::new(&exe).output().unwrap();
    let _ = std::fs::remove_dir_all(&out_dir);
    assert!(
        run.status.success(),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&run.stdout).trim(), "ok");
}
