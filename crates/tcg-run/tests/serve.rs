//! The Rust serving path on the CPU: the reference artifact imported into a
//! real store, resolved and served by `tcg_run::Served` (and by the `serve`
//! example, run as its own process), with the input checks and refusals.
//! The same example runs on a GPU in `scripts/cuda_e2e.py`.

mod common;
use common::{f32s, fixture, torch_lib, KEY};

use std::path::{Path, PathBuf};
use std::process::Command;

use tcg_core::engine::Engine;
use tcg_core::Code;
use tcg_run::{Device, Input, Served};

fn store(dir: &Path) -> PathBuf {
    let store = dir.join("store");
    Engine::open(&store)
        .unwrap()
        .import_artifact(KEY, &fixture("mlp-cpu.tar.gz"))
        .unwrap();
    store
}

fn io() -> (Vec<u8>, Vec<u8>) {
    let bytes = std::fs::read(fixture("mlp-cpu.io.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    (
        st.tensor("x").unwrap().data().to_vec(),
        st.tensor("y").unwrap().data().to_vec(),
    )
}

#[test]
fn a_stored_key_is_resolved_loaded_and_served_without_python() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let weights = fixture("mlp-cpu.weights.safetensors");
    let served = Served::open(
        &store,
        KEY,
        &dir.path().join("g"),
        &torch_lib(),
        "cpu",
        &weights,
    )
    .unwrap()
    .expect("the key is in the store");
    assert_eq!(served.graph().device(), Device::Cpu);
    // The reference fixture records no toolchain digest this project computes.
    assert_eq!(served.torch_check(), "not recorded");
    let (x, y) = io();
    let out = served.run_host(&[(&x, "float32", &[4, 16])]).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].sizes(), &[4, 8]);
    let got = f32s(&out[0].to_host().unwrap());
    for (g, w) in got.iter().zip(f32s(&y)) {
        assert!((g - w).abs() <= 1e-5 + 1e-5 * w.abs(), "{g} vs {w}");
    }
    // Inputs are checked before the graph runs.
    let err = served.run_host(&[(&x, "float64", &[4, 8])]).unwrap_err();
    assert_eq!(err.code(), Code::RunInputMismatch);
    let err = served
        .run_host(&[(&x[..128], "float32", &[2, 16])])
        .unwrap_err();
    assert_eq!(err.code(), Code::RunInputMismatch);
    let err = served.run_host(&[]).unwrap_err();
    assert_eq!(err.code(), Code::RunCallInvalid);
    let err = served
        .run_host(&[(&x[..60], "float32", &[4, 16])])
        .unwrap_err();
    assert_eq!(err.code(), Code::RunInputLayout);
    // A GPU buffer for a CPU graph is refused before anything reads it.
    let gpu = Input {
        data: 0x1000,
        nbytes: 256,
        dtype: "float32".into(),
        shape: vec![4, 16],
        device: Device::Cuda(0),
    };
    // SAFETY: refused before the address is described to libtorch.
    let err = unsafe { served.run(&[gpu], 0) }.unwrap_err();
    assert_eq!(err.code(), Code::RunCallInvalid);
    assert!(err.message().contains("cuda:0") && err.message().contains("cpu"));
    // Rebind refuses a wrong file and keeps the old weights.
    let err = served
        .rebind(&fixture("mlp-cpu.io.safetensors"))
        .unwrap_err();
    assert_eq!(err.code(), Code::RunConstantMissing);
    let again = f32s(
        &served.run_host(&[(&x, "float32", &[4, 16])]).unwrap()[0]
            .to_host()
            .unwrap(),
    );
    assert_eq!(again, got);
}

#[test]
fn a_miss_is_none_and_a_cpu_artifact_is_refused_on_a_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let weights = fixture("mlp-cpu.weights.safetensors");
    let other = format!("{}0", &KEY[..KEY.len() - 1]);
    let missing = Served::open(
        &store,
        &other,
        &dir.path().join("m"),
        &torch_lib(),
        "cpu",
        &weights,
    );
    assert!(missing.unwrap().is_none());
    let err = Served::open(
        &store,
        KEY,
        &dir.path().join("c"),
        &torch_lib(),
        "cuda:0",
        &weights,
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::RunDeviceMismatch);
}

/// The example binary, which `cargo test` builds beside the test binaries
/// (a filtered run such as `--test serve` does not: build it first with
/// `cargo build -p tcg-run --example serve`).
fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let path = dir.join("examples").join("serve");
    assert!(
        path.is_file(),
        "{} is missing: run `cargo test -p tcg-run` (or `cargo build -p tcg-run --example serve`) first",
        path.display()
    );
    path
}

#[test]
fn the_serve_example_runs_as_its_own_process() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let run = |out: &str, dest: &str| {
        Command::new(example())
            .args(if dest == "a" {
                &["--verbose"][..]
            } else {
                &[][..]
            })
            .args(["--store".as_ref(), store.as_os_str()])
            .args(["--key", KEY, "--in", "x", "--out", out, "--repeat", "5"])
            .args(["--dest".as_ref(), dir.path().join(dest).as_os_str()])
            .args(["--torch-lib".as_ref(), torch_lib().as_os_str()])
            .args([
                "--weights".as_ref(),
                fixture("mlp-cpu.weights.safetensors").as_os_str(),
            ])
            .args([
                "--io".as_ref(),
                fixture("mlp-cpu.io.safetensors").as_os_str(),
            ])
            .output()
            .expect("the serve example was built by cargo test")
    };
    let ok = run("y", "a");
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(
        stdout.contains("\"ok\":true") && stdout.contains("\"calls\":5"),
        "{stdout}"
    );
    assert!(stdout.contains("\"device\":\"cpu\""), "{stdout}");
    // The phases of the load: in the JSON line, and on stderr with --verbose.
    let stderr = String::from_utf8_lossy(&ok.stderr);
    for phase in [
        "resolve",
        "open_libraries",
        "extract_package",
        "open_model",
        "create_container",
        "allocate_weights",
        "read_weights",
        "bind_weights",
        "load_total",
        "first_call",
    ] {
        assert!(stdout.contains(&format!("\"{phase}\":")), "{stdout}");
        assert!(stderr.contains(phase), "{stderr}");
    }
    assert!(stderr.contains("time to output"), "{stderr}");
    // Compared against the wrong tensor: an expected negative, exit 1.
    let wrong = run("x", "b");
    assert_eq!(
        wrong.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&wrong.stdout)
    );
    // A refusal (a key the store lacks) is exit 2 with a code on stderr.
    let missing = Command::new(example())
        .args(["--store".as_ref(), store.as_os_str()])
        .args(["--key", "not-a-key", "--in", "x"])
        .args(["--dest".as_ref(), dir.path().join("c").as_os_str()])
        .args(["--torch-lib".as_ref(), torch_lib().as_os_str()])
        .args([
            "--weights".as_ref(),
            fixture("mlp-cpu.weights.safetensors").as_os_str(),
        ])
        .args([
            "--io".as_ref(),
            fixture("mlp-cpu.io.safetensors").as_os_str(),
        ])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("code: "));
}

/// A FIFO at `path` (nobody ever writes it).
fn fifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

/// `f` on a thread; a failure, not a hung suite, when it blocks.
fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .expect("blocked on a non-regular file")
}

/// The example run to its end, killed (and the test failed) past a bound.
fn run_bounded(cmd: &mut Command) -> std::process::Output {
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed().as_secs() > 60 {
            child.kill().unwrap();
            panic!("the serve example blocked: {cmd:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn served_refuses_fifos_as_weights_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let fifos = dir.path().join("fifos");
    std::fs::create_dir_all(fifos.join("dir")).unwrap();
    std::fs::create_dir_all(fifos.join("idx")).unwrap();
    fifo(&fifos.join("w.safetensors"));
    fifo(&fifos.join("dir/model.safetensors"));
    fifo(&fifos.join("idx/model.safetensors.index.json"));
    for (i, weights) in [
        "w.safetensors",
        "dir",
        "idx",
        "idx/model.safetensors.index.json",
    ]
    .into_iter()
    .enumerate()
    {
        let (store, dest, weights) = (
            store.clone(),
            dir.path().join(format!("g{i}")),
            fifos.join(weights),
        );
        let err = within(move || {
            Served::open(&store, KEY, &dest, &torch_lib(), "cpu", &weights).unwrap_err()
        });
        assert_eq!(err.code(), Code::RunWeightsInvalid, "{err}");
        assert!(err.message().contains("not a regular file"), "{err}");
    }
}

#[test]
fn the_serve_example_bounds_its_arguments_and_reports_exactly_what_it_checked() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let base = |dest: &str, io: &Path| {
        let mut c = Command::new(example());
        c.args(["--store".as_ref(), store.as_os_str()])
            .args(["--key", KEY, "--in", "x"])
            .args(["--dest".as_ref(), dir.path().join(dest).as_os_str()])
            .args(["--torch-lib".as_ref(), torch_lib().as_os_str()])
            .args([
                "--weights".as_ref(),
                fixture("mlp-cpu.weights.safetensors").as_os_str(),
            ])
            .args(["--io".as_ref(), io.as_os_str()]);
        c
    };
    let io = fixture("mlp-cpu.io.safetensors");
    // Out of bounds: a usage error (exit 2) before anything is loaded, not a
    // capacity overflow or an allocation that aborts the process.
    for (flag, value) in [
        ("--repeat", "18446744073709551615"),
        ("--repeat", "100000000000"),
        ("--repeat", "1000001"),
        ("--repeat", "-1"),
        ("--rtol", "nan"),
        ("--atol", "-1"),
        ("--atol", "inf"),
    ] {
        let out = run_bounded(base("u", &io).args([flag, value]));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {stderr}");
        assert!(stderr.starts_with(&format!("error: {flag}")), "{stderr}");
    }
    let help = run_bounded(Command::new(example()).arg("--help"));
    assert_eq!(help.status.code(), Some(0));
    let usage = String::from_utf8_lossy(&help.stdout);
    assert!(usage.contains("--repeat N (0..=1000000)"), "{usage}");
    // The graph has one output: a second --out is refused, not reported checked.
    let two = run_bounded(base("a", &io).args(["--out", "y", "--out", "y"]));
    let stderr = String::from_utf8_lossy(&two.stderr);
    assert_eq!(two.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("code: run.call_invalid"), "{stderr}");
    let one = run_bounded(base("b", &io).args(["--out", "y"]));
    let stdout = String::from_utf8_lossy(&one.stdout);
    assert!(one.status.success(), "{stdout}");
    assert!(stdout.contains("\"checked\":1,"), "{stdout}");
    let none = run_bounded(&mut base("c", &io));
    let stdout = String::from_utf8_lossy(&none.stdout);
    assert!(stdout.contains("\"checked\":0,"), "{stdout}");
    // The --io file is read as the weights are: a FIFO is refused at once.
    let pipe = dir.path().join("io.safetensors");
    fifo(&pipe);
    let out = run_bounded(&mut base("d", &pipe));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("code: run.weights_invalid"), "{stderr}");
}
