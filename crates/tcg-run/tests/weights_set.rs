//! One weights set shared by several graphs on the CPU: the reference
//! artifact imported into a real store, two graphs bound to one
//! `tcg_run::WeightsSet` without a copy, their outputs those of graphs bound
//! from the files, the set and the graphs dropped in any order, and a set
//! that does not fit the graph's table refused with the codes of a bind
//! from files.

mod common;
use common::{f32s, fixture, torch_lib, write_f32, KEY};

use std::path::Path;
use std::sync::Arc;

use tcg_core::engine::Engine;
use tcg_core::Code;
use tcg_run::weights::{Checkpoint, Naming};
use tcg_run::{Served, WeightsSet};

/// The reference artifact resolved into `dir/name`.
fn resolved(store: &Path, dir: &Path, name: &str) -> tcg_core::engine::Resolved {
    Engine::open(store)
        .unwrap()
        .resolve(KEY, &dir.join(name))
        .unwrap()
        .expect("the key is in the store")
}

/// The reference weights, as `(name, shape, values)`.
fn reference() -> Vec<(&'static str, Vec<usize>, Vec<f32>)> {
    let c = Checkpoint::open(
        &[fixture("mlp-cpu.weights.safetensors")],
        &Naming::default(),
    )
    .unwrap();
    ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]
        .into_iter()
        .map(|name| {
            let (i, e) = c.entry(name).unwrap();
            let values = f32s(&c.sources()[i].read_entry(e).unwrap());
            (name, e.shape.clone(), values)
        })
        .collect()
}

fn run(served: &Served, x: &[f32]) -> Vec<f32> {
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let out = served.run_host(&[(&bytes, "float32", &[4, 16])]).unwrap();
    f32s(&out[0].to_host().unwrap())
}

fn set_of(path: &Path, naming: &Naming) -> tcg_core::Result<Arc<WeightsSet>> {
    let checkpoint = Checkpoint::open(&[path.to_owned()], naming)?;
    WeightsSet::open(&torch_lib(), "cpu", &checkpoint)
}

#[test]
fn two_graphs_share_one_set_and_drop_in_any_order() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    Engine::open(&store)
        .unwrap()
        .import_artifact(KEY, &fixture("mlp-cpu.tar.gz"))
        .unwrap();
    let weights = fixture("mlp-cpu.weights.safetensors");
    let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();

    // A set under a prefix (a pipeline's checkpoint) plus a tensor the
    // graph's contract does not declare, which it must refuse.
    let mut tensors = reference();
    let p = dir.path().join("prefixed.safetensors");
    let prefixed: Vec<(String, Vec<usize>, Vec<f32>)> = tensors
        .iter()
        .map(|(n, s, v)| (format!("mlp.{n}"), s.clone(), v.clone()))
        .chain([("other.w".to_owned(), vec![3], vec![1.0, 2.0, 3.0])])
        .collect();
    let refs: Vec<(&str, Vec<usize>, Vec<f32>)> = prefixed
        .iter()
        .map(|(n, s, v)| (n.as_str(), s.clone(), v.clone()))
        .collect();
    write_f32(&p, &refs, None);
    let naming = Naming {
        strip_prefix: "mlp.".into(),
        add_prefix: String::new(),
    };
    let set = set_of(&p, &naming).unwrap();
    assert_eq!(set.outside_prefix(), 1);
    assert_eq!(set.len(), 4);
    assert_eq!(set.nbytes(), 4 * (32 + 32 * 16 + 8 + 8 * 32));
    assert_eq!(
        set.names().collect::<Vec<_>>(),
        ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]
    );
    let phases: Vec<&str> = set.timings().iter().map(|(k, _)| *k).collect();
    assert!(phases.contains(&"read_weights"), "{phases:?}");

    let from_files = Served::load(
        resolved(&store, dir.path(), "files"),
        &torch_lib(),
        "cpu",
        &weights,
    )
    .unwrap();
    let want = run(&from_files, &x);
    assert_eq!(from_files.graph().added_bytes(), set.nbytes());

    let a = Served::load_with_set(resolved(&store, dir.path(), "a"), &set).unwrap();
    let b = Served::load_with_set(resolved(&store, dir.path(), "b"), &set).unwrap();
    assert_eq!(run(&a, &x), want);
    assert_eq!(run(&b, &x), want);
    // Nothing but the (absent) literals is the graphs' own.
    assert_eq!(a.graph().added_bytes(), 0);
    assert_eq!(a.bind_report().added_bytes, 0);
    assert!(a.bind_report().ignored.is_empty());
    let held = a.graph().weights_set().unwrap();
    assert!(Arc::ptr_eq(&held, &set));
    drop(held);
    // Three holders: this test and the two graphs.
    assert_eq!(Arc::strong_count(&set), 3);

    // The set's values are the graphs' values (no copy): an update under the
    // exclusive lock shows in both graphs' next calls.
    let (address, dtype, shape) = {
        let e = set_entry(&set, "l2.bias");
        (e.0, e.1, e.2)
    };
    assert_eq!((dtype, shape), ("float32", vec![8]));
    let original = {
        let _alone = set.exclusive();
        // SAFETY: `l2.bias` is 8 float32 of the set's host allocation, alive
        // while `set` is; no call queues work while the exclusive lock is held.
        unsafe {
            let v = *(address as *const f32);
            *(address as *mut f32) = v + 1.0;
            v
        }
    };
    let shifted = run(&a, &x);
    assert_eq!(run(&b, &x), shifted);
    for (row, (s, w)) in shifted.iter().zip(&want).enumerate() {
        let delta = if row % 8 == 0 { 1.0 } else { 0.0 };
        assert!((s - w - delta).abs() < 1e-5, "{row}: {s} vs {w}");
    }
    {
        let _alone = set.exclusive();
        // SAFETY: as above.
        unsafe { *(address as *mut f32) = original };
    }

    // The set dropped first: the graphs hold it.
    drop(set);
    assert_eq!(run(&a, &x), want);
    assert_eq!(run(&b, &x), want);
    // A graph dropped, then the other rebound to a new set, then to files.
    drop(a);
    let second = set_of(&weights, &Naming::default()).unwrap();
    b.rebind_set(&second).unwrap();
    assert_eq!(run(&b, &x), want);
    assert_eq!(Arc::strong_count(&second), 2);
    b.rebind(&weights).unwrap();
    assert_eq!(Arc::strong_count(&second), 1);
    assert!(b.graph().weights_set().is_none());
    assert_eq!(run(&b, &x), want);

    // A set with a wrong shape, a missing tensor, a foreign one: the codes
    // of a bind from files, and the bound weights stay in place.
    tensors[3].1 = vec![32, 8];
    let p = dir.path().join("wrong.safetensors");
    write_f32(&p, &tensors, None);
    let wrong = set_of(&p, &Naming::default()).unwrap();
    let err = b.rebind_set(&wrong).unwrap_err();
    assert_eq!(err.code(), Code::RunConstantMismatch, "{err}");
    let err = b.rebind(&p).unwrap_err();
    assert_eq!(err.code(), Code::RunConstantMismatch, "{err}");
    let err = Served::load_with_set(resolved(&store, dir.path(), "c"), &wrong).unwrap_err();
    assert_eq!(err.code(), Code::RunConstantMismatch, "{err}");
    let p = dir.path().join("missing.safetensors");
    write_f32(&p, &tensors[..3], None);
    let err = b
        .rebind_set(&set_of(&p, &Naming::default()).unwrap())
        .unwrap_err();
    assert_eq!(err.code(), Code::RunConstantMissing, "{err}");
    let mut foreign = reference();
    foreign.push(("other.w", vec![3], vec![1.0, 2.0, 3.0]));
    let p = dir.path().join("foreign.safetensors");
    write_f32(&p, &foreign, None);
    let err = b
        .rebind_set(&set_of(&p, &Naming::default()).unwrap())
        .unwrap_err();
    assert_eq!(err.code(), Code::RunConstantUnexpected, "{err}");
    assert_eq!(
        b.rebind(&p).unwrap_err().code(),
        Code::RunConstantUnexpected
    );
    assert_eq!(run(&b, &x), want);
}

/// A tensor of the set: address, dtype name, shape.
fn set_entry(set: &WeightsSet, name: &str) -> (usize, &'static str, Vec<i64>) {
    let (address, dtype, shape) = set.tensor(name).unwrap();
    (address, dtype.name, shape.to_vec())
}
