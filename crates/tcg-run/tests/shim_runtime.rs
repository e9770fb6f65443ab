//! The shim runtime, in a process without libtorch (nothing in this test
//! binary opens libtorch): the runtime is chosen from each package's
//! imports; a real CPU package minted with `aot_inductor.link_libtorch=False`
//! loads through `Graph::load_request` on `libtcg_shim.so` (embedded in
//! tcg-run, opened into a link-map namespace of its own), its weight bound by
//! the weights pipeline, and its outputs equal eager's; libtorch is never
//! mapped; the reference package (which imports `aoti_torch_cpu_addmm_out`)
//! goes to libtorch and a forced shim is refused naming that function.
//!
//! The mint needs a Python with torch (`TCG_TORCH_PYTHON`, else the
//! workspace's `.venv/bin/python`), as crates/tcg-shim/tests/package_host.rs;
//! without one the mint test says so on stderr and passes. The mint takes
//! 10-60 s.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use tcg_core::artifact::weights::WeightsContract;
use tcg_core::artifact::{unpack, ConstantRow, ConstantSource, Metadata};
use tcg_core::Code;
use tcg_run::runtime::{
    choose_for_package, libtorch_mapped, OptionSource, RuntimeChoice, RuntimeOption,
    NO_CUDA_RUNTIME, SHIM_LACKS,
};
use tcg_run::shim_set::shim_set_v1;
use tcg_run::weights::{Checkpoint, Naming};
use tcg_run::{Device, Graph, Input, LoadRequest, Runtime, Torch, WeightsSource};

fn torch_python() -> Option<PathBuf> {
    let py = match std::env::var_os("TCG_TORCH_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => common::root().join(".venv/bin/python"),
    };
    let ok = Command::new(&py)
        .args(["-c", "import torch"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(py)
}

fn maps() -> String {
    std::fs::read_to_string("/proc/self/maps").unwrap()
}

#[test]
fn the_embedded_shim_provides_every_function_of_shim_set_v1_it_claims() {
    let shim = Torch::open_shim().unwrap();
    assert_eq!(shim.runtime(), Runtime::ShimV1);
    let missing: Vec<&str> = shim_set_v1()
        .into_iter()
        .filter(|name| !SHIM_LACKS.contains(name) && !shim.provides(name))
        .collect();
    assert!(missing.is_empty(), "the shim lacks {missing:?}");
    // What it says it lacks, it lacks (else the list is stale).
    for name in SHIM_LACKS {
        assert!(!shim.provides(name), "{name} is provided now");
    }
    // The shim is not in the process's global scope: a library loaded
    // later (libtorch's PLT calls) can never bind to it.
    let global = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"aoti_torch_empty_strided".as_ptr()) };
    assert!(
        global.is_null(),
        "the shim's symbols leaked into the global scope"
    );
    // CUDA is refused by this runtime, not attempted.
    assert_eq!(shim.cuda().unwrap_err().code(), Code::RunDeviceMismatch);
}

#[test]
fn the_reference_package_runs_on_libtorch_and_a_forced_shim_names_addmm() {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("graph");
    let envelope = common::fixture("mlp-cpu.tar.gz");
    unpack(&envelope, &dest, &mut |_: &Metadata| Ok(())).unwrap();
    let package = dest.join("model.pt2");
    let auto = (RuntimeOption::Auto, OptionSource::Default);
    let c = choose_for_package(&package, "model/mlp", "cpu", auto.0, auto.1).unwrap();
    assert_eq!(c.runtime, Runtime::Libtorch);
    assert_eq!(
        c.reason,
        "imports outside shim set v1: aoti_torch_cpu_addmm_out"
    );
    let err = choose_for_package(
        &package,
        "model/mlp",
        "cpu",
        RuntimeOption::Shim,
        OptionSource::Option,
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::RunNativeUnsupported);
    assert!(
        err.message().ends_with(": aoti_torch_cpu_addmm_out"),
        "{}",
        err.message()
    );
}

fn f32_file(path: &Path) -> Vec<f32> {
    common::f32s(&std::fs::read(path).unwrap())
}

#[test]
fn a_link_libtorch_false_cpu_package_runs_on_the_shim_without_libtorch() {
    let Some(python) = torch_python() else {
        eprintln!("skipped: no Python with torch (set TCG_TORCH_PYTHON)");
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let mint = Command::new(&python)
        .arg(common::root().join("crates/tcg-shim/tests/py/mint_host_package.py"))
        .arg(work.path())
        .output()
        .unwrap();
    assert!(
        mint.status.success(),
        "mint failed: {}",
        String::from_utf8_lossy(&mint.stderr)
    );
    let package = work.path().join("model.pt2");
    let auto = (RuntimeOption::Auto, OptionSource::Default);
    assert!(!libtorch_mapped());
    let choice = choose_for_package(&package, "model", "cpu", auto.0, auto.1).unwrap();
    assert_eq!(choice.runtime, Runtime::ShimV1, "{}", choice.reason);
    assert!(
        choice.reason.starts_with("every import ("),
        "{}",
        choice.reason
    );
    // On CUDA the imports decide in the same way, and `auto` also needs a
    // CUDA runtime for the shim: named as a file that does not exist (looked
    // for again at every choice, never kept), the graph stays on libtorch.
    std::env::set_var(
        tcg_run::cudart::ENV,
        work.path().join("no-such-dir/libcudart.so.13"),
    );
    let on_cuda = choose_for_package(&package, "model", "cuda:0", auto.0, auto.1);
    std::env::remove_var(tcg_run::cudart::ENV);
    assert_eq!(on_cuda.unwrap(), RuntimeChoice::libtorch(NO_CUDA_RUNTIME));

    // The weight, as the mint script made it: linspace(-1, 1, 16).
    let w: Vec<f32> = (0..16).map(|i| -1.0 + 2.0 * i as f32 / 15.0).collect();
    let weights = work.path().join("w.safetensors");
    common::write_f32(&weights, &[("w", vec![16], w)], None);
    let rows = vec![ConstantRow {
        fqn: "w".into(),
        source: ConstantSource::StateDict,
        dtype: "float32".into(),
        shape: vec![16],
    }];
    let checkpoint = Checkpoint::open(&[weights], &Naming::default()).unwrap();
    let (graph, report) = Graph::load_request(LoadRequest {
        // Never opened on the shim runtime.
        torch_lib: Path::new("/nonexistent/torch/lib"),
        package: &package,
        entry: "model",
        device: "cpu",
        sm: "cpu",
        contract: WeightsContract::from_rows(&rows),
        rows: rows.clone(),
        weights: WeightsSource::Files(&checkpoint),
        literals: None,
        runtime: choice.clone(),
    })
    .unwrap();
    assert_eq!(graph.runtime(), Runtime::ShimV1);
    assert_eq!(graph.runtime_reason(), choice.reason);
    assert_eq!(report.bytes, 64);
    let phases: Vec<&str> = graph.load_timings().iter().map(|(k, _)| *k).collect();
    for phase in [
        "open_libraries",
        "open_model",
        "read_weights",
        "bind_weights",
    ] {
        assert!(phases.contains(&phase), "{phase} missing from {phases:?}");
    }

    let x = std::fs::read(work.path().join("x.bin")).unwrap();
    let input = Input {
        data: x.as_ptr() as usize,
        nbytes: x.len(),
        dtype: "float32".into(),
        shape: vec![4, 16],
        device: Device::Cpu,
    };
    for _ in 0..2 {
        // SAFETY: `x` is a live float32 buffer of 4x16 for the call.
        let outputs = unsafe { graph.run(std::slice::from_ref(&input)) }.unwrap();
        assert_eq!(outputs.len(), 3);
        for (i, out) in outputs.iter().enumerate() {
            let eager = f32_file(&work.path().join(format!("out{i}.bin")));
            let got = common::f32s(&out.to_host().unwrap());
            assert_eq!(got.len(), eager.len(), "output {i}");
            for (a, b) in got.iter().zip(&eager) {
                assert!(
                    (a - b).abs() <= 1e-5 + 1e-5 * b.abs(),
                    "output {i}: {a} vs {b}"
                );
            }
        }
    }
    // torch 2.11's runtime binds constants only through a std::unordered_map,
    // which the shim runtime lays out itself: forced here, the same graph
    // binds and runs the same through it.
    let (mut mapped, _) = Graph::load_request(LoadRequest {
        torch_lib: Path::new("/nonexistent/torch/lib"),
        package: &package,
        entry: "model",
        device: "cpu",
        sm: "cpu",
        contract: WeightsContract::from_rows(&rows),
        rows,
        weights: WeightsSource::Files(&checkpoint),
        literals: None,
        runtime: choice.clone(),
    })
    .unwrap();
    mapped.bind_through_std_map().unwrap();
    mapped
        .bind(&work.path().join("w.safetensors"), None)
        .unwrap();
    // SAFETY: `x` is a live float32 buffer of 4x16 for both calls.
    let (a, b) = unsafe {
        (
            graph.run(std::slice::from_ref(&input)),
            mapped.run(std::slice::from_ref(&input)),
        )
    };
    let (a, b) = (a.unwrap(), b.unwrap());
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        assert_eq!(a.to_host().unwrap(), b.to_host().unwrap(), "output {i}");
    }
    let maps = maps();
    assert!(
        !tcg_run::runtime::maps_have_libtorch(&maps),
        "libtorch is mapped:\n{maps}"
    );
    assert!(maps.contains("libtcg_shim.so"), "the shim is not mapped");
    drop(mapped);
    drop(graph);
}
