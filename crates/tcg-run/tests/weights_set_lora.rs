//! A LoRA fused into a `tcg_run::WeightsSet` on the CPU: the reference
//! artifact (whose container folds two constants from the weights) served by
//! two graphs bound to one set; a LoRA on both linear layers applied, swapped
//! and removed, against graphs bound from files holding the fused weights;
//! refused LoRAs change nothing.

mod common;
use common::{f32s, fixture, torch_lib, write_f32, KEY};

use std::sync::Arc;

use tcg_core::engine::Engine;
use tcg_core::Code;
use tcg_run::weights::{Checkpoint, Naming};
use tcg_run::{Served, WeightsSet};

type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

fn reference() -> Tensors {
    let c = Checkpoint::open(
        &[fixture("mlp-cpu.weights.safetensors")],
        &Naming::default(),
    )
    .unwrap();
    c.names()
        .map(|name| {
            let (i, e) = c.entry(name).unwrap();
            let values = f32s(&c.sources()[i].read_entry(e).unwrap());
            (name.to_owned(), e.shape.clone(), values)
        })
        .collect()
}

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 + seed) * 0.731).sin() * 0.5)
        .collect()
}

/// A LoRA of rank `rank` on `modules` (`(name, out, in)`), `unet.`-prefixed
/// as diffusers writes it.
fn lora(modules: &[(&str, usize, usize)], rank: usize, seed: f32) -> Tensors {
    modules
        .iter()
        .flat_map(|&(m, out, inp)| {
            [
                (
                    format!("unet.{m}.lora_A.weight"),
                    vec![rank, inp],
                    values(rank * inp, seed),
                ),
                (
                    format!("unet.{m}.lora_B.weight"),
                    vec![out, rank],
                    values(out * rank, seed + 7.0),
                ),
            ]
        })
        .collect()
}

/// The reference weights with `lora` fused at `scale` (per module), in float64.
fn fused(lora: &Tensors, scale: f64) -> Tensors {
    let mut weights = reference();
    for (name, shape, w) in &mut weights {
        let Some(module) = name.strip_suffix(".weight") else {
            continue;
        };
        let find = |part: &str| {
            lora.iter()
                .find(|(n, _, _)| n == &format!("unet.{module}.{part}"))
        };
        let (Some(a), Some(b)) = (find("lora_A.weight"), find("lora_B.weight")) else {
            continue;
        };
        let (rows, cols, rank) = (shape[0], shape[1], a.1[0]);
        for r in 0..rows {
            for c in 0..cols {
                let dot: f64 = (0..rank)
                    .map(|k| b.2[r * rank + k] as f64 * a.2[k * cols + c] as f64)
                    .sum();
                w[r * cols + c] = (w[r * cols + c] as f64 + scale * dot) as f32;
            }
        }
    }
    weights
}

fn run(served: &Served, x: &[f32]) -> Vec<f32> {
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let out = served.run_host(&[(&bytes, "float32", &[4, 16])]).unwrap();
    f32s(&out[0].to_host().unwrap())
}

fn assert_close(got: &[f32], want: &[f32]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{i}: {g} vs {w}");
    }
}

#[test]
fn a_lora_on_a_set_reaches_every_graph_and_its_folds_and_is_removed_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let engine = Engine::open(&store).unwrap();
    engine
        .import_artifact(KEY, &fixture("mlp-cpu.tar.gz"))
        .unwrap();
    let resolved = |name: &str| {
        engine
            .resolve(KEY, &dir.path().join(name))
            .unwrap()
            .unwrap()
    };
    let weights = fixture("mlp-cpu.weights.safetensors");
    let checkpoint = Checkpoint::open(std::slice::from_ref(&weights), &Naming::default()).unwrap();
    let set: Arc<WeightsSet> = WeightsSet::open(&torch_lib(), "cpu", &checkpoint).unwrap();
    let held = set.nbytes();
    let a = Served::load_with_set(resolved("a"), &set).unwrap();
    let b = Served::load_with_set(resolved("b"), &set).unwrap();
    assert!(
        a.graph().constants().iter().any(|c| c.from_folded),
        "the reference container folds constants"
    );
    let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
    let before = run(&a, &x);

    // LoRA A on both layers (alpha 4, rank 2: x2, at scale 0.5: x1).
    let la = lora(&[("l1", 32, 16), ("l2", 8, 32)], 2, 1.0);
    let pa = dir.path().join("a.safetensors");
    write_f32(&pa, &la, Some(r#"{"unet.r": 2, "unet.lora_alpha": 4}"#));
    set.apply_lora(&pa, 0.5, None, Some("a".into())).unwrap();
    let info = set.lora().unwrap();
    assert_eq!(info.name.as_deref(), Some("a"));
    assert_eq!(info.scale, 0.5);
    assert_eq!(info.targets, ["l1.weight", "l2.weight"]);
    assert_eq!(info.nbytes, 4 * (2 * 16 + 32 * 2 + 2 * 32 + 8 * 2));
    assert_eq!(set.nbytes(), held + 4 * (32 * 16 + 8 * 32));
    let want_a = dir.path().join("fused-a.safetensors");
    write_f32(&want_a, &fused(&la, 1.0), None);
    let from_files = Served::load(resolved("files"), &torch_lib(), "cpu", &want_a).unwrap();
    let expected = run(&from_files, &x);
    assert_ne!(expected, before);
    assert_close(&run(&a, &x), &expected);
    assert_close(&run(&b, &x), &expected);

    // Refused: one at a time; a wrong shape; an unknown target. Nothing changes.
    let with_a = run(&a, &x);
    let err = set.apply_lora(&pa, 1.0, None, None).unwrap_err();
    assert_eq!(err.code(), Code::RunLoraInvalid);
    let wrong = dir.path().join("wrong.safetensors");
    write_f32(&wrong, &lora(&[("l1", 9, 16)], 2, 3.0), None);
    let unknown = dir.path().join("unknown.safetensors");
    write_f32(&unknown, &lora(&[("l3", 8, 8)], 2, 3.0), None);
    for bad in [&wrong, &unknown] {
        let err = set.replace_lora(bad, 1.0, None, None).unwrap_err();
        assert_eq!(err.code(), Code::RunLoraInvalid, "{err}");
    }
    assert_eq!(set.lora().unwrap().name.as_deref(), Some("a"));
    assert_eq!(run(&a, &x), with_a);
    assert_eq!(run(&b, &x), with_a);

    // Replaced by a LoRA on l1 only: l2 back to base, from the base values.
    let lb = lora(&[("l1", 32, 16)], 4, 5.0);
    let pb = dir.path().join("b.safetensors");
    write_f32(&pb, &lb, None);
    set.replace_lora(&pb, 2.0, Some("unet."), None).unwrap();
    assert_eq!(set.lora().unwrap().targets, ["l1.weight"]);
    let want_b = dir.path().join("fused-b.safetensors");
    write_f32(&want_b, &fused(&lb, 2.0), None);
    from_files.rebind(&want_b).unwrap();
    assert_close(&run(&b, &x), &run(&from_files, &x));
    assert_close(&run(&a, &x), &run(&from_files, &x));

    // Swaps while another thread calls: every call sees one LoRA whole (its
    // values and the constants folded from them), never a mix.
    let with_b = run(&b, &x);
    set.replace_lora(&pa, 0.5, None, None).unwrap();
    let with_a = run(&b, &x);
    assert_ne!(with_a, with_b);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let caller = scope.spawn(|| {
            let mut calls = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) || calls < 20 {
                let got = run(&b, &x);
                assert!(got == with_a || got == with_b, "a call saw a mix");
                calls += 1;
            }
            calls
        });
        for _ in 0..10 {
            set.replace_lora(&pb, 2.0, Some("unet."), None).unwrap();
            set.replace_lora(&pa, 0.5, None, None).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(caller.join().unwrap() >= 20);
    });
    assert_eq!(run(&a, &x), with_a);

    // Removed: bit for bit what the graphs computed before, the bases freed.
    set.remove_lora().unwrap();
    assert!(set.lora().is_none());
    assert_eq!(set.nbytes(), held);
    assert_eq!(run(&a, &x), before);
    assert_eq!(run(&b, &x), before);
    set.remove_lora().unwrap();
}
