//! The reference 0.2.0 package judged against `shim set v1`: its core shim
//! imports are all in the set; its one op-specific extern
//! (`aoti_torch_cpu_addmm_out`, the CPU GEMM of its linear layers) is not,
//! so a libtorch-free runtime could not serve it and the miss is named.

mod common;

use tcg_core::artifact::package::shim_imports;
use tcg_core::artifact::{unpack, Metadata};
use tcg_run::shim_set::{package_covered, shim_set_covers};

#[test]
fn the_reference_package_misses_only_its_cpu_gemm_extern() {
    let d = tempfile::tempdir().unwrap();
    let graph = d.path().join("graph");
    unpack(
        &common::fixture("mlp-cpu.tar.gz"),
        &graph,
        &mut |_: &Metadata| Ok(()),
    )
    .unwrap();
    let imports = shim_imports(&graph.join("model.pt2"), Some("model/mlp")).unwrap();
    assert!(imports.other.is_empty(), "{:?}", imports.other);
    assert_eq!(
        package_covered(&imports),
        Err(vec!["aoti_torch_cpu_addmm_out".to_owned()])
    );
    let core: Vec<&String> = imports
        .aoti_torch
        .iter()
        .filter(|n| !n.starts_with("aoti_torch_cpu_"))
        .collect();
    assert_eq!(core.len(), imports.aoti_torch.len() - 1);
    assert_eq!(shim_set_covers(&core), Ok(()));
}
