//! Unit tests of `lora_fuse` on the CPU, through libtorch's shim (from the
//! project's virtual environment, or `TCG_TORCH_LIB`), on a set of tensors
//! libtorch allocated.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::PathBuf;

use super::*;
use crate::lora::{plan, read, LoraFile};

fn torch() -> Arc<Torch> {
    let dir = std::env::var_os("TCG_TORCH_LIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../.venv/lib/python3.11/site-packages/torch/lib")
        });
    Torch::open(&dir).expect("libtorch opens (make develop, or set TCG_TORCH_LIB)")
}

/// A set of CPU tensors; `vanish` makes one name disappear (a failure midway).
struct TestSet {
    torch: Arc<Torch>,
    tensors: BTreeMap<String, OwnedTensor>,
    vanish: RefCell<Option<String>>,
}

impl FuseWeights for TestSet {
    fn torch(&self) -> &Arc<Torch> {
        &self.torch
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn entry(&self, name: &str) -> Option<(usize, Dtype, Vec<i64>)> {
        if self.vanish.borrow().as_deref() == Some(name) {
            return None;
        }
        let t = self.tensors.get(name)?;
        Some((t.data_ptr(), t.dtype(), t.sizes().to_vec()))
    }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn f16_bits(v: f32) -> u16 {
    // Round to nearest even, for values in the normal range of a half.
    let b = v.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    if v == 0.0 {
        return sign;
    }
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let mant = b & 0x7f_ffff;
    let mut half = (sign as u32) | ((exp as u32) << 10) | (mant >> 13);
    let rest = mant & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && half & 1 == 1) {
        half += 1;
    }
    half as u16
}

fn to_bytes(dtype: &str, vals: &[f32]) -> Vec<u8> {
    match dtype {
        "float32" => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        "float16" => vals
            .iter()
            .flat_map(|v| f16_bits(*v).to_le_bytes())
            .collect(),
        _ => unreachable!(),
    }
}

fn from_bytes(dtype: &str, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        "float32" => bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        "float16" => bytes
            .chunks(2)
            .map(|c| crate::lora::f16_to_f64(u16::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        _ => unreachable!(),
    }
}

/// The set of the tests: `l1` (float32 24 x 16), `conv` (float16 8 x 4 x 3 x 3),
/// `l2` (float32 16 x 16).
fn make_set(torch: &Arc<Torch>) -> TestSet {
    let mut tensors = BTreeMap::new();
    for (i, (name, dtype, shape)) in [
        ("l1.weight", "float32", vec![24i64, 16]),
        ("conv.weight", "float16", vec![8, 4, 3, 3]),
        ("l2.weight", "float32", vec![16, 16]),
    ]
    .into_iter()
    .enumerate()
    {
        let n = shape.iter().product::<i64>() as usize;
        let bytes = to_bytes(dtype, &values(n, i as u32 + 1));
        let dt = torch.dtype_by_name(dtype).unwrap();
        let t = OwnedTensor::from_host(torch, &bytes, &shape, dt, Device::Cpu, 0).unwrap();
        tensors.insert(name.to_owned(), t);
    }
    TestSet {
        torch: Arc::clone(torch),
        tensors,
        vanish: RefCell::new(None),
    }
}

fn snapshot(set: &TestSet) -> BTreeMap<String, Vec<u8>> {
    set.tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.to_host().unwrap()))
        .collect()
}

fn host(dtype: &str, shape: &[usize], seed: u32) -> HostTensor {
    let n = shape.iter().product();
    HostTensor {
        dtype: dtype.into(),
        shape: shape.to_vec(),
        bytes: to_bytes(dtype, &values(n, seed)),
    }
}

/// A LoRA on `l1` (rank 4, alpha 2) and on `conv` (rank 2, float16 factors).
fn lora_a() -> LoraFile {
    let mut tensors = BTreeMap::new();
    tensors.insert("l1.lora_A.weight".into(), host("float32", &[4, 16], 11));
    tensors.insert("l1.lora_B.weight".into(), host("float32", &[24, 4], 12));
    tensors.insert(
        "l1.alpha".into(),
        HostTensor {
            dtype: "float32".into(),
            shape: vec![],
            bytes: 2f32.to_le_bytes().to_vec(),
        },
    );
    tensors.insert(
        "conv.lora_A.weight".into(),
        host("float16", &[2, 4, 3, 3], 13),
    );
    tensors.insert(
        "conv.lora_B.weight".into(),
        host("float16", &[8, 2, 1, 1], 14),
    );
    LoraFile {
        tensors,
        ..LoraFile::default()
    }
}

/// A LoRA on `l2` and `conv` only.
fn lora_b() -> LoraFile {
    let mut tensors = BTreeMap::new();
    tensors.insert("l2.lora_A.weight".into(), host("float32", &[3, 16], 21));
    tensors.insert("l2.lora_B.weight".into(), host("float32", &[16, 3], 22));
    tensors.insert(
        "conv.lora_A.weight".into(),
        host("float32", &[1, 4, 3, 3], 23),
    );
    tensors.insert(
        "conv.lora_B.weight".into(),
        host("float32", &[8, 1, 1, 1], 24),
    );
    LoraFile {
        tensors,
        ..LoraFile::default()
    }
}

fn targets(set: &TestSet, lora: &LoraFile, scale: f64) -> Vec<Target> {
    let lookup = |name: &str| {
        set.entry(name)
            .map(|(_, d, s)| (FLOAT_DTYPES.contains(&d.name), s))
    };
    plan(lora, &lookup, scale, None).unwrap()
}

/// `base + scale · B @ A` in float64 over the host values.
fn expected(base: &[f64], target: &Target) -> Vec<f64> {
    let (rows, cols) = target.matrix();
    let up = from_bytes(&target.up.dtype, &target.up.bytes);
    let down = from_bytes(&target.down.dtype, &target.down.bytes);
    (0..rows * cols)
        .map(|i| {
            let (r, c) = (i / cols, i % cols);
            let dot: f64 = (0..target.rank)
                .map(|k| up[r * target.rank + k] * down[k * cols + c])
                .sum();
            base[i] + target.scale * dot
        })
        .collect()
}

fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn a_lora_is_fused_from_the_base_swapped_and_removed_bit_for_bit() {
    let torch = torch();
    let set = make_set(&torch);
    let before = snapshot(&set);
    let mut state = LoraState::default();
    let a = targets(&set, &lora_a(), 0.5);
    assert_eq!(a.iter().map(|t| t.scale).collect::<Vec<_>>(), [0.5, 0.25]);
    let changed = state
        .fuse(&set, a.clone(), 0.5, Some("a".into()), false)
        .unwrap();
    assert_eq!(changed, ["conv.weight", "l1.weight"]);
    let info = state.info().unwrap().clone();
    assert_eq!(info.name.as_deref(), Some("a"));
    assert_eq!(info.targets, ["conv.weight", "l1.weight"]);
    assert_eq!(
        info.nbytes,
        4 * 16 * 4 + 24 * 4 * 4 + 2 * 36 * 2 + 8 * 2 * 2
    );
    // Memory: the targeted tensors' bases only.
    assert_eq!(state.base_nbytes(), 24 * 16 * 4 + 8 * 36 * 2);
    let after = snapshot(&set);
    for t in &a {
        let dtype = if t.weight == "conv.weight" {
            "float16"
        } else {
            "float32"
        };
        let base = from_bytes(dtype, &before[&t.weight]);
        let tol = if dtype == "float16" { 1e-3 } else { 1e-6 };
        assert_close(
            &from_bytes(dtype, &after[&t.weight]),
            &expected(&base, t),
            tol,
            &t.weight,
        );
    }
    assert_eq!(after["l2.weight"], before["l2.weight"]);

    // Applying over a fused LoRA is refused and changes nothing.
    let b = targets(&set, &lora_b(), 1.0);
    let err = state.fuse(&set, b.clone(), 1.0, None, false).unwrap_err();
    assert_eq!(err.code(), Code::RunLoraInvalid);
    assert_eq!(snapshot(&set), after);

    // A replacement starts from the base: the same as B fused on a fresh set,
    // bit for bit; l1 (A's only) is back to base.
    let changed = state
        .fuse(&set, b.clone(), 1.0, Some("b".into()), true)
        .unwrap();
    assert_eq!(changed, ["conv.weight", "l1.weight", "l2.weight"]);
    let swapped = snapshot(&set);
    assert_eq!(swapped["l1.weight"], before["l1.weight"]);
    let fresh = make_set(&torch);
    let mut fresh_state = LoraState::default();
    fresh_state
        .fuse(&fresh, targets(&fresh, &lora_b(), 1.0), 1.0, None, false)
        .unwrap();
    assert_eq!(snapshot(&fresh), swapped);
    assert_eq!(state.info().unwrap().targets, ["conv.weight", "l2.weight"]);
    assert_eq!(state.base_nbytes(), 16 * 16 * 4 + 8 * 36 * 2);

    // Removal: every weight bit for bit as before, the bases freed.
    assert_eq!(state.remove(&set).unwrap(), ["conv.weight", "l2.weight"]);
    assert_eq!(snapshot(&set), before);
    assert!(state.info().is_none());
    assert_eq!(state.base_nbytes(), 0);
    assert!(state.remove(&set).unwrap().is_empty());
}

#[test]
fn a_failure_midway_restores_every_base_and_leaves_no_lora() {
    let torch = torch();
    let set = make_set(&torch);
    let before = snapshot(&set);
    let mut state = LoraState::default();
    // conv is written first (sorted), then l1 vanishes: conv goes back to base.
    let a = targets(&set, &lora_a(), 1.0);
    *set.vanish.borrow_mut() = Some("l1.weight".into());
    let err = state.fuse(&set, a.clone(), 1.0, None, false).unwrap_err();
    assert!(
        err.message().contains("lost \"l1.weight\""),
        "{}",
        err.message()
    );
    *set.vanish.borrow_mut() = None;
    assert_eq!(snapshot(&set), before);
    assert!(state.info().is_none());
    assert_eq!(state.base_nbytes(), 0);
    // A replacement failing midway: the old LoRA's weights are back to base too.
    state
        .fuse(&set, targets(&set, &lora_b(), 1.0), 1.0, None, false)
        .unwrap();
    assert_ne!(snapshot(&set), before);
    *set.vanish.borrow_mut() = Some("l1.weight".into());
    state.fuse(&set, a, 1.0, None, true).unwrap_err();
    *set.vanish.borrow_mut() = None;
    assert_eq!(snapshot(&set), before);
    assert!(state.info().is_none());
}

#[test]
fn prepare_reads_a_file_and_refuses_before_anything_is_written() {
    let torch = torch();
    let set = make_set(&torch);
    let before = snapshot(&set);
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, lora: &LoraFile| {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = lora
            .tensors
            .iter()
            .map(|(n, t)| {
                let dtype = match t.dtype.as_str() {
                    "float16" => safetensors::Dtype::F16,
                    _ => safetensors::Dtype::F32,
                };
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(dtype, t.shape.clone(), &t.bytes).unwrap(),
                )
            })
            .collect();
        let path = dir.path().join(name);
        std::fs::write(&path, safetensors::tensor::serialize(views, None).unwrap()).unwrap();
        path
    };
    let good = write("a.safetensors", &lora_a());
    let read_back = read(&good).unwrap();
    assert_eq!(read_back.tensors, lora_a().tensors);
    let planned = prepare(&set, &good, 0.5, None).unwrap();
    assert_eq!(planned, targets(&set, &lora_a(), 0.5));
    let mut wrong = lora_a();
    wrong
        .tensors
        .insert("l1.lora_B.weight".into(), host("float32", &[9, 4], 1));
    let err = prepare(&set, &write("w.safetensors", &wrong), 1.0, None).unwrap_err();
    assert_eq!(err.code(), Code::RunLoraInvalid);
    assert_eq!(snapshot(&set), before);
}
