//! Interop with the reference implementation 0.2.0 (SPEC-v1 §13.2): its
//! envelope inspects, verifies and admits here, and re-packing its members
//! with this writer yields the identical tar stream and metadata bytes.

use std::path::{Path, PathBuf};

use tcg_core::artifact::{self, METADATA_MEMBER, PACKAGE_MEMBER};
use tcg_core::host_isa::{cumulative_flags, HostFacts};
use tcg_core::Code;

fn reference_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/reference-0.2.0")
}

fn description() -> tcg_cj::Map {
    let bytes = std::fs::read(reference_dir().join("mlp-cpu.json")).unwrap();
    tcg_cj::parse_strict(&bytes)
        .unwrap()
        .as_object()
        .unwrap()
        .clone()
}

mod common;
use common::reference;

fn gunzip(path: &Path) -> Vec<u8> {
    common::gunzip(&std::fs::read(path).unwrap())
}

#[test]
fn inspect_reads_the_reference_metadata() {
    let v = artifact::inspect(&reference()).unwrap();
    let md = v.as_object().unwrap()["metadata"].as_object().unwrap();
    let desc = description();
    assert_eq!(md["compiled_graph_key"], desc["compiled_graph_key"]);
    assert_eq!(md["sm"], desc["sm"]);
    assert_eq!(md["host_isa"], desc["host_isa"]);
    let read = artifact::read_metadata(&reference()).unwrap();
    assert_eq!(read.key(), desc["compiled_graph_key"].as_str().unwrap());
    assert_eq!(read.name(), "model/mlp");
}

#[test]
fn verify_accepts_the_reference_envelope() {
    let report = artifact::verify(&reference(), false).unwrap();
    assert_eq!(
        report.key(),
        description()["compiled_graph_key"].as_str().unwrap()
    );
    assert!(report.admitted.is_none());
    let env = &report.envelope;
    assert_eq!(env.literals_bytes, None);
    assert_eq!(env.package.table.constants.len(), 6);
    assert_eq!(env.package.e_machine, 62);
    assert_eq!(env.tar_bytes % 10_240, 0);
    let summary = report.to_value();
    let summary = summary.as_object().unwrap();
    assert_eq!(summary["entry"], tcg_cj::Value::from("model/mlp"));
    assert_eq!(summary["admitted"], tcg_cj::Value::Null);
    assert_eq!(summary["constants"], tcg_cj::Value::Int(6));
    assert_eq!(
        env.compressed_bytes,
        std::fs::metadata(reference()).unwrap().len()
    );
}

#[test]
fn verify_with_host_admission_follows_this_hosts_flags() {
    let host = HostFacts::read().unwrap();
    let v3 = cumulative_flags("x86-64-v3").unwrap();
    let capable = host.machine() == "x86_64" && v3.iter().all(|f| host.features().contains(*f));
    match artifact::verify(&reference(), true) {
        Ok(report) => {
            assert!(capable, "admitted on a host without the x86-64-v3 flags");
            assert_eq!(report.admitted.unwrap().host_isa_level, "x86-64-v3");
        }
        Err(e) => {
            assert!(!capable, "refused on a capable host: {e}");
            let expected = if host.machine() == "x86_64" {
                Code::AdmissionHostFeatures
            } else {
                Code::AdmissionHostMachine
            };
            assert_eq!(e.code(), expected);
        }
    }
}

#[test]
fn repacking_the_reference_members_gives_the_identical_tar_stream() {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("unpacked");
    let mut admit = |_: &artifact::Metadata| Ok(());
    artifact::unpack(&reference(), &dest, &mut admit).unwrap();
    let md_bytes = std::fs::read(dest.join(METADATA_MEMBER)).unwrap();
    let value = tcg_cj::parse_strict(&md_bytes).unwrap();
    let out = tmp.path().join("compiled_graph.tar.gz");
    let report = artifact::pack(&dest.join(PACKAGE_MEMBER), &value, None, &out).unwrap();
    assert_eq!(report.metadata.bytes(), &md_bytes[..]);
    let ours = gunzip(&out);
    let theirs = gunzip(&reference());
    assert_eq!(ours.len(), theirs.len());
    assert!(ours == theirs, "decompressed tar streams differ");
    // Our envelope starts with the exact §6.3 header and verifies too.
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(&bytes[..10], &[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 2, 0xff]);
    artifact::verify(&out, false).unwrap();
    // Packing again onto the same output is refused, leaving it untouched.
    let err = artifact::pack(&dest.join(PACKAGE_MEMBER), &value, None, &out).unwrap_err();
    assert_eq!(err.code(), Code::IoDestinationOccupied);
    assert_eq!(std::fs::read(&out).unwrap(), bytes);
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "temps left behind: {leftovers:?}");
}
