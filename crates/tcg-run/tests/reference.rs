//! The reference artifact of the original implementation (two folded
//! constants) run through libtorch's C ABI, with libtorch from the project's
//! virtual environment (`make test` creates it before `cargo test` runs), or
//! from `TCG_TORCH_LIB`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tcg_core::artifact::{unpack, Metadata};
use tcg_core::Code;
use tcg_run::{Graph, Input, Torch};

const ENTRY: &str = "model/mlp";

/// One tensor to write: name, dtype, shape, bytes.
type Tensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn torch() -> Arc<Torch> {
    let dir = std::env::var_os("TCG_TORCH_LIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/lib/python3.11/site-packages/torch/lib"));
    assert!(
        dir.join("libtorch.so").is_file(),
        "no libtorch at {} (run `make develop`, or set TCG_TORCH_LIB)",
        dir.display()
    );
    let torch = Torch::open(&dir).expect("libtorch opens");
    // Opening libtorch_cuda registers its kernels with libtorch; every test
    // waits for that here rather than racing it (one test opens CUDA).
    let _ = torch.cuda();
    torch
}

struct Unpacked {
    _dir: tempfile::TempDir,
    path: PathBuf,
    metadata: Metadata,
}

fn reference() -> Unpacked {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("graph");
    let mut captured = None;
    let envelope = root().join("testdata/reference-0.2.0/mlp-cpu.tar.gz");
    unpack(&envelope, &path, &mut |m: &Metadata| {
        captured = Some(m.clone());
        Ok(())
    })
    .unwrap();
    Unpacked {
        _dir: dir,
        path,
        metadata: captured.unwrap(),
    }
}

fn load(u: &Unpacked) -> tcg_core::Result<Graph> {
    Graph::load(
        torch(),
        &u.path.join("model.pt2"),
        ENTRY,
        "cpu",
        u.metadata.sm(),
        u.metadata.constants().to_vec(),
    )
}

fn fixture(name: &str) -> PathBuf {
    root().join("testdata/reference-0.2.0").join(name)
}

/// Little-endian f32 tensors of a safetensors file, by name.
fn read_f32(path: &Path) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| {
            let data = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name, (v.shape().to_vec(), data))
        })
        .collect()
}

fn call(graph: &Graph, x: &[f32], shape: &[i64]) -> tcg_core::Result<Vec<f32>> {
    let input = Input {
        data: x.as_ptr() as usize,
        nbytes: std::mem::size_of_val(x),
        dtype: "float32".into(),
        shape: shape.to_vec(),
        device: tcg_run::Device::Cpu,
    };
    // SAFETY: `x` is a live slice of exactly `nbytes` bytes for the whole call.
    let out = unsafe { graph.run(&[input]) }?;
    assert_eq!(out.len(), 1);
    let t = &out[0];
    assert_eq!(t.dtype().name, "float32");
    let n: i64 = t.sizes().iter().product();
    // SAFETY: the output owns `n` contiguous f32 values while `out` lives.
    let values = unsafe { std::slice::from_raw_parts(t.data_ptr() as *const f32, n as usize) };
    Ok(values.to_vec())
}

#[test]
fn the_reference_artifact_matches_its_expected_output_and_rebinds() {
    let u = reference();
    let graph = load(&u).unwrap();
    assert_eq!(
        graph.weight_fqns(),
        vec!["l1.weight", "l2.weight", "l1.bias", "l2.bias"]
    );
    assert_eq!(
        graph.constants().iter().filter(|c| c.from_folded).count(),
        2
    );
    let facts = graph.input_facts().unwrap();
    assert_eq!(facts[0].dtype, "float32");
    assert_eq!(
        facts[0].dims,
        vec![tcg_run::Dim::Static(4), tcg_run::Dim::Static(16)]
    );
    graph
        .bind(&fixture("mlp-cpu.weights.safetensors"), None)
        .unwrap();
    let io = read_f32(&fixture("mlp-cpu.io.safetensors"));
    let (xs, x) = &io["x"];
    let (_, y) = &io["y"];
    let shape: Vec<i64> = xs.iter().map(|&d| d as i64).collect();
    let got = call(&graph, x, &shape).unwrap();
    for (a, b) in got.iter().zip(y) {
        assert!((a - b).abs() <= 1e-5 + 1e-5 * b.abs(), "{a} vs {b}");
    }

    // Scale every weight by zero: the folded constants must follow the rebind.
    let dir = tempfile::tempdir().unwrap();
    let zeroed = dir.path().join("zero.safetensors");
    let weights = read_f32(&fixture("mlp-cpu.weights.safetensors"));
    let zero: Vec<(String, Vec<usize>, Vec<u8>)> = weights
        .iter()
        .map(|(k, (shape, v))| (k.clone(), shape.clone(), vec![0u8; v.len() * 4]))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = zero
        .iter()
        .map(|(k, s, b)| {
            (
                k.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &zeroed).unwrap();
    graph.bind(&zeroed, None).unwrap();
    assert!(call(&graph, x, &shape).unwrap().iter().all(|&v| v == 0.0));
    graph
        .bind(&fixture("mlp-cpu.weights.safetensors"), None)
        .unwrap();
    assert_eq!(call(&graph, x, &shape).unwrap(), got);
}

#[test]
fn wrong_inputs_are_refused_before_the_container_runs() {
    let u = reference();
    let graph = load(&u).unwrap();
    graph
        .bind(&fixture("mlp-cpu.weights.safetensors"), None)
        .unwrap();
    let x = vec![0f32; 64];
    assert_eq!(
        call(&graph, &x, &[8, 8]).unwrap_err().code(),
        Code::RunInputMismatch
    );
    assert_eq!(
        call(&graph, &x, &[64]).unwrap_err().code(),
        Code::RunInputMismatch
    );
    assert_eq!(
        call(&graph, &x[..32], &[4, 16]).unwrap_err().code(),
        Code::RunInputLayout
    );
    let ints = vec![0i64; 64];
    let input = Input {
        data: ints.as_ptr() as usize,
        nbytes: 512,
        dtype: "int64".into(),
        shape: vec![4, 16],
        device: tcg_run::Device::Cpu,
    };
    // SAFETY: `ints` holds 512 bytes for the whole call.
    assert_eq!(
        unsafe { graph.run(&[input]) }.unwrap_err().code(),
        Code::RunInputMismatch
    );
    // SAFETY: no inputs are read.
    assert_eq!(
        unsafe { graph.run(&[]) }.unwrap_err().code(),
        Code::RunCallInvalid
    );
}

#[test]
fn a_constant_table_that_disagrees_with_the_package_is_refused() {
    let u = reference();
    let mut rows = u.metadata.constants().to_vec();
    rows.pop();
    let err = Graph::load(
        torch(),
        &u.path.join("model.pt2"),
        ENTRY,
        "cpu",
        u.metadata.sm(),
        rows,
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::RunPackageInvalid);
    let mut rows = u.metadata.constants().to_vec();
    rows[0].dtype = "float16".into();
    let err = Graph::load(
        torch(),
        &u.path.join("model.pt2"),
        ENTRY,
        "cpu",
        u.metadata.sm(),
        rows,
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::RunPackageInvalid);
    let err = Graph::load(
        torch(),
        &u.path.join("model.pt2"),
        "model/other",
        "cpu",
        u.metadata.sm(),
        u.metadata.constants().to_vec(),
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::RunPackageInvalid);
    let err = Graph::load(
        torch(),
        &u.path.join("model.pt2"),
        ENTRY,
        "cuda",
        u.metadata.sm(),
        u.metadata.constants().to_vec(),
    )
    .unwrap_err();
    // A CPU artifact cannot run on a GPU, whatever the machine has.
    assert_eq!(err.code(), Code::RunDeviceMismatch);
}

#[test]
fn weights_are_checked_before_binding() {
    let u = reference();
    let graph = load(&u).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let weights = read_f32(&fixture("mlp-cpu.weights.safetensors"));
    let write = |name: &str, edit: &dyn Fn(&mut Vec<Tensor>)| {
        let mut all: Vec<Tensor> = weights
            .iter()
            .map(|(k, (s, v))| {
                (
                    k.clone(),
                    safetensors::Dtype::F32,
                    s.clone(),
                    v.iter().flat_map(|f| f.to_le_bytes()).collect(),
                )
            })
            .collect();
        edit(&mut all);
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = all
            .iter()
            .map(|(k, d, s, b)| {
                (
                    k.clone(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        let path = dir.path().join(name);
        safetensors::serialize_to_file(views, None, &path).unwrap();
        path
    };
    let code = |p: &Path| graph.bind(p, None).unwrap_err().code();
    assert_eq!(
        code(&write("missing", &|w| w.retain(|t| t.0 != "l2.bias"))),
        Code::RunConstantMissing
    );
    assert_eq!(
        code(&write("extra", &|w| w.push((
            "l3.weight".into(),
            safetensors::Dtype::F32,
            vec![1],
            vec![0; 4]
        )))),
        Code::RunConstantUnexpected
    );
    assert_eq!(
        code(&write("shape", &|w| {
            let b = w.iter_mut().find(|t| t.0 == "l1.bias").unwrap();
            b.2 = vec![31];
            b.3.truncate(31 * 4);
        })),
        Code::RunConstantMismatch
    );
    assert_eq!(
        code(&write("dtype", &|w| {
            let b = w.iter_mut().find(|t| t.0 == "l1.bias").unwrap();
            b.1 = safetensors::Dtype::F16;
            b.3.truncate(32 * 2);
        })),
        Code::RunConstantMismatch
    );
    let garbage = dir.path().join("garbage");
    std::fs::write(&garbage, b"\xff\xff\xff\xff\xff\xff\xff\x7fnot safetensors").unwrap();
    assert_eq!(code(&garbage), Code::RunWeightsInvalid);
    assert_eq!(code(&dir.path().join("absent")), Code::RunWeightsInvalid);
}

#[test]
fn a_second_libtorch_directory_is_refused() {
    let _ = torch();
    let other = tempfile::tempdir().unwrap();
    assert_eq!(
        Torch::open(other.path()).unwrap_err().code(),
        Code::RunTorchMismatch
    );
    let missing = Path::new("/nonexistent/torch/lib");
    assert_eq!(
        Torch::open(missing).unwrap_err().code(),
        Code::RunTorchNotFound
    );
}

#[test]
fn without_a_usable_gpu_cuda_is_refused_as_a_device_mismatch() {
    // This machine's torch has CUDA support but no device is visible (CI and
    // the development machine); on a GPU machine the CUDA suite covers the rest.
    let torch = torch();
    if !torch.dir().join("libtorch_cuda.so").is_file() {
        let err = torch.cuda().unwrap_err();
        assert_eq!(err.code(), Code::RunDeviceMismatch);
        return;
    }
    match torch.cuda() {
        Ok(cuda) => {
            // A GPU is visible: its capability is readable and a bad index refused.
            let (major, _) = cuda.capability(0).unwrap();
            assert!(major >= 3);
            assert_eq!(
                cuda.capability(4096).unwrap_err().code(),
                Code::RunDeviceMismatch
            );
        }
        Err(err) => {
            assert_eq!(err.code(), Code::RunDeviceMismatch, "{err}");
            assert!(err.message().contains("CUDA is not available"), "{err}");
        }
    }
    let u = reference();
    let err = Graph::load(
        torch,
        &u.path.join("model.pt2"),
        ENTRY,
        "cuda:0",
        "sm_90",
        u.metadata.constants().to_vec(),
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::RunDeviceMismatch);
}

#[test]
fn binding_through_the_std_map_api_gives_the_same_graph() {
    // torch 2.11's runtime has no C pairs API for constants, only the one
    // taking a std::unordered_map; this runtime has both, so the map path is
    // forced and must bind (and rebind) exactly as the pairs path does.
    let u = reference();
    let pairs = load(&u).unwrap();
    let mut mapped = load(&u).unwrap();
    mapped.bind_through_std_map().unwrap();
    let weights = fixture("mlp-cpu.weights.safetensors");
    pairs.bind(&weights, None).unwrap();
    mapped.bind(&weights, None).unwrap();
    let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
    let want = call(&pairs, &x, &[4, 16]).unwrap();
    assert_eq!(call(&mapped, &x, &[4, 16]).unwrap(), want);
    // A rebind with changed values changes the output through the map too.
    let dir = tempfile::tempdir().unwrap();
    let mut tensors = read_f32(&weights);
    for v in &mut tensors.get_mut("l2.bias").unwrap().1 {
        *v += 1.0;
    }
    let changed = dir.path().join("w.safetensors");
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(k, (shape, v))| {
            (
                k.clone(),
                shape.clone(),
                v.iter().flat_map(|f| f.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(k, shape, b)| {
            (
                k.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &changed).unwrap();
    mapped.bind(&changed, None).unwrap();
    let moved = call(&mapped, &x, &[4, 16]).unwrap();
    for (m, w) in moved.iter().zip(&want) {
        assert!((m - (w + 1.0)).abs() < 1e-5, "{m} vs {w} + 1");
    }
    // Constants missing from the map are refused by the checks before it is built.
    let err = mapped
        .bind(&fixture("mlp-cpu.io.safetensors"), None)
        .unwrap_err();
    assert_eq!(err.code(), Code::RunConstantMissing);
}

/// `ConstantBuffer`s over `weights` (f32 host vectors the caller owns).
fn buffers(
    weights: &std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) -> Vec<tcg_run::ConstantBuffer> {
    weights
        .iter()
        .map(|(fqn, (shape, v))| tcg_run::ConstantBuffer {
            fqn: fqn.clone(),
            data: v.as_ptr() as usize,
            nbytes: std::mem::size_of_val(v.as_slice()),
            dtype: "float32".into(),
            shape: shape.iter().map(|&d| d as i64).collect(),
            device: tcg_run::Device::Cpu,
        })
        .collect()
}

#[test]
fn caller_owned_buffers_bind_without_a_copy_after_every_check() {
    let u = reference();
    let graph = load(&u).unwrap();
    let mut weights = read_f32(&fixture("mlp-cpu.weights.safetensors"));
    let io = read_f32(&fixture("mlp-cpu.io.safetensors"));
    let (xs, x) = &io["x"];
    let (_, y) = &io["y"];
    let shape: Vec<i64> = xs.iter().map(|&d| d as i64).collect();

    let refused = |bufs: &[tcg_run::ConstantBuffer]| {
        // SAFETY: every buffer points into `weights`, alive for the test.
        unsafe { graph.bind_buffers(bufs) }.unwrap_err().code()
    };
    let good = buffers(&weights);
    assert_eq!(refused(&good[1..]), Code::RunConstantMissing);
    let mut extra = good.clone();
    extra.push(tcg_run::ConstantBuffer {
        fqn: "l3.weight".into(),
        ..good[0].clone()
    });
    assert_eq!(refused(&extra), Code::RunConstantUnexpected);
    let mut twice = good.clone();
    twice.push(good[0].clone());
    assert_eq!(refused(&twice), Code::RunConstantUnexpected);
    let folded = graph
        .constants()
        .iter()
        .find(|c| c.from_folded)
        .unwrap()
        .fqn
        .clone();
    let mut computed = good.clone();
    computed.push(tcg_run::ConstantBuffer {
        fqn: folded,
        ..good[0].clone()
    });
    assert_eq!(refused(&computed), Code::RunConstantUnexpected);
    let mut shaped = good.clone();
    shaped[0].shape.reverse();
    shaped[0].shape.push(1);
    assert_eq!(refused(&shaped), Code::RunConstantMismatch);
    let mut typed = good.clone();
    typed[0].dtype = "int32".into();
    assert_eq!(refused(&typed), Code::RunConstantMismatch);
    let mut short = good.clone();
    short[0].nbytes -= 4;
    assert_eq!(refused(&short), Code::RunInputLayout);
    let mut placed = good.clone();
    placed[0].device = tcg_run::Device::Cuda(0);
    assert_eq!(refused(&placed), Code::RunDeviceMismatch);

    // SAFETY: the buffers point into `weights`, alive until the rebind from
    // the file below replaced them (only then does the test end).
    let kept = unsafe { graph.bind_buffers(&good) }.unwrap();
    // torch 2.15's runtime has the user-managed API.
    assert!(kept);
    let got = call(&graph, x, &shape).unwrap();
    for (a, b) in got.iter().zip(y) {
        assert!((a - b).abs() <= 1e-5 + 1e-5 * b.abs(), "{a} vs {b}");
    }
    // Without a copy: a change of the caller's memory reaches the graph
    // without a rebind (the biases are read as bound, not folded).
    for name in ["l1.bias", "l2.bias"] {
        let bias = &mut weights.get_mut(name).unwrap().1;
        bias.iter_mut().for_each(|v| *v += 1.0);
    }
    assert_ne!(call(&graph, x, &shape).unwrap(), got);
    // A rebind from a file replaces the caller's buffers.
    graph
        .bind(&fixture("mlp-cpu.weights.safetensors"), None)
        .unwrap();
    assert_eq!(call(&graph, x, &shape).unwrap(), got);
}

#[test]
fn the_single_threaded_run_gives_the_threaded_runs_outputs() {
    let u = reference();
    let graph = load(&u).unwrap();
    graph
        .bind(&fixture("mlp-cpu.weights.safetensors"), None)
        .unwrap();
    let io = read_f32(&fixture("mlp-cpu.io.safetensors"));
    let (xs, x) = &io["x"];
    let shape: Vec<i64> = xs.iter().map(|&d| d as i64).collect();
    let threaded = call(&graph, x, &shape).unwrap();
    assert!(graph.has_single_threaded_run());
    assert!(!graph.single_threaded());
    graph.set_single_threaded(true).unwrap();
    assert!(graph.single_threaded());
    // Calls from several threads at once are serialised, never raced.
    let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| s.spawn(|| call(&graph, x, &shape).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for out in outs {
        assert_eq!(out, threaded);
    }
    graph.set_single_threaded(false).unwrap();
    assert_eq!(call(&graph, x, &shape).unwrap(), threaded);
}
