//! A real AOTInductor package, minted on the CPU with
//! `aot_inductor.link_libtorch=False`, runs against `libtcg_shim.so` alone:
//! `tests/py/mint_host_package.py` mints it with the workspace's torch,
//! `tests/cpp/run_package.cpp` opens its `.so` in a process that links only
//! our library, runs the container three times and compares every output
//! (one of them transposed) with eager's, and checks that no libtorch is
//! mapped.
//!
//! Needs a Python with torch (`TCG_TORCH_PYTHON`, else the workspace's
//! `.venv/bin/python`; without it the test says so on stderr and passes) and
//! the C++ compiler the shim's build uses (`CXX`, else `c++`).
//!
//! It loads `target/<profile>/deps/libtcg_shim.so`, whose name carries no
//! hash: a `cargo build` and a `cargo test` of different sources can leave a
//! stale one there (seen while mutation-testing this crate); `cargo clean -p
//! tcg-shim` clears it. The mint takes 10-60 s.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn torch_python() -> Option<PathBuf> {
    let py = match std::env::var_os("TCG_TORCH_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"),
    };
    let ok = Command::new(&py)
        .args(["-c", "import torch"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(py)
}

#[test]
fn a_libtorch_free_cpu_package_runs_on_the_shim_alone() {
    let Some(python) = torch_python() else {
        eprintln!("skipped: no Python with torch (set TCG_TORCH_PYTHON)");
        return;
    };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let work = std::env::temp_dir().join(format!("tcg-shim-package-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    let mint = Command::new(&python)
        .arg(manifest.join("tests/py/mint_host_package.py"))
        .arg(&work)
        .output()
        .unwrap();
    assert!(
        mint.status.success(),
        "mint failed: {}",
        String::from_utf8_lossy(&mint.stderr)
    );
    let stdout = String::from_utf8(mint.stdout).unwrap();
    let mut lines = stdout.lines().rev();
    let include = lines.next().unwrap().to_string();
    let model_so = lines.next().unwrap().to_string();

    let exe = work.join("run_package");
    common::build_cpp_against_shim(
        &manifest.join("tests/cpp/run_package.cpp"),
        Path::new(&include),
        &["-ldl"],
        &exe,
    );
    let run = Command::new(&exe)
        .arg(&model_so)
        .arg(&work)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&run.stdout).to_string();
    eprintln!("{out}");
    let _ = std::fs::remove_dir_all(&work);
    assert!(
        run.status.success(),
        "stdout: {out}\nstderr: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(out.lines().last(), Some("ok"), "{out}");
}
