//! CUDA packages: every `*.cubin` member must be a CUDA ELF built for the
//! artifact's `sm` (project addition to SPEC-v1 §8), checked on packages
//! built here with synthetic members.

use std::io::Write;
use std::path::{Path, PathBuf};

use tcg_core::artifact::package::cubin::synthetic_cubin;
use tcg_core::artifact::package::elf::synthetic_elf;
use tcg_core::artifact::package::verify_package_facts;
use tcg_core::artifact::package::wrapper::synthetic_wrapper;
use tcg_core::Code;

const ENTRY: &str = "model/data/aotinductor/graphs/unet/";

fn package(dir: &Path, cubins: &[(&str, Vec<u8>)]) -> PathBuf {
    let path = dir.join("model.pt2");
    let mut z = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let mut put = |name: String, bytes: &[u8]| {
        z.start_file(name, opts).unwrap();
        z.write_all(bytes).unwrap();
    };
    put(
        format!("{ENTRY}c0.wrapper.cpp"),
        synthetic_wrapper(false, &[]).as_bytes(),
    );
    put(format!("{ENTRY}c0.wrapper.so"), &synthetic_elf(62, 16));
    for (name, bytes) in cubins {
        put(format!("{ENTRY}{name}"), bytes);
    }
    put("model/archive_format".to_string(), b"pt2");
    z.finish().unwrap();
    path
}

fn verify(path: &Path, sm: &str) -> tcg_core::Result<tcg_core::artifact::package::PackageReport> {
    verify_package_facts(path, "graphs/unet", &[], "x86_64", sm)
}

#[test]
fn cubins_built_for_the_artifacts_sm_verify() {
    let d = tempfile::tempdir().unwrap();
    let pkg = package(
        d.path(),
        &[
            ("k0.cubin", synthetic_cubin(7, 0x5a055a)),
            ("k1.cubin", synthetic_cubin(7, 0x5a055a)),
        ],
    );
    let report = verify(&pkg, "sm_90").unwrap();
    assert_eq!(report.members.cubins.len(), 2);
    verify(&pkg, "sm_90a").unwrap();
    let new_abi = package(
        &d.path().join("b").tap_mkdir(),
        &[("k.cubin", synthetic_cubin(8, 0x6006402))],
    );
    verify(&new_abi, "sm_100").unwrap();
    // The header CUDA 13 writes for sm_90 (ELF ABI version 8), read off a real
    // package minted on an H200.
    let cuda13 = package(
        &d.path().join("c").tap_mkdir(),
        &[("k.cubin", synthetic_cubin(8, 0x9005a04))],
    );
    verify(&cuda13, "sm_90").unwrap();
    let err = verify(&cuda13, "sm_100").unwrap_err();
    assert_eq!(err.code(), Code::ArtifactCubinArchMismatch);
}

#[test]
fn a_cubin_for_another_architecture_is_refused_by_name() {
    let d = tempfile::tempdir().unwrap();
    let pkg = package(
        d.path(),
        &[
            ("k0.cubin", synthetic_cubin(7, 0x5a055a)),
            ("k1.cubin", synthetic_cubin(7, 0x500550)),
        ],
    );
    let err = verify(&pkg, "sm_90").unwrap_err();
    assert_eq!(err.code(), Code::ArtifactCubinArchMismatch);
    assert!(
        err.message().contains("k1.cubin") && err.message().contains("sm_80"),
        "{}",
        err.message()
    );
}

#[test]
fn a_cubin_in_a_cpu_artifact_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let pkg = package(d.path(), &[("k0.cubin", synthetic_cubin(7, 0x5a055a))]);
    assert_eq!(
        verify(&pkg, "cpu-x86-64-v3").unwrap_err().code(),
        Code::ArtifactCubinArchMismatch
    );
    // Without cubins the same package verifies for the CPU.
    let plain = package(&d.path().join("p").tap_mkdir(), &[]);
    verify(&plain, "cpu-x86-64-v3").unwrap();
}

#[test]
fn a_cubin_that_is_not_cuda_device_code_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let pkg = package(d.path(), &[("k0.cubin", synthetic_elf(62, 16))]);
    assert_eq!(
        verify(&pkg, "sm_90").unwrap_err().code(),
        Code::ArtifactCubinInvalid
    );
    let truncated = package(
        &d.path().join("t").tap_mkdir(),
        &[("k0.cubin", synthetic_cubin(7, 0x5a055a)[..40].to_vec())],
    );
    assert_eq!(
        verify(&truncated, "sm_90").unwrap_err().code(),
        Code::ArtifactCubinInvalid
    );
}

trait Mkdir {
    fn tap_mkdir(self) -> Self;
}

impl Mkdir for PathBuf {
    fn tap_mkdir(self) -> Self {
        std::fs::create_dir_all(&self).unwrap();
        self
    }
}
