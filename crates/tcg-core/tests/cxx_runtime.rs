//! The C++-runtime test of a package's `.so` on real linker output
//! (testdata/elf, built by scripts/gen_elf_fixtures.sh): only a `.so` that
//! defines the runtime's symbols is refused by torch's loader check; one that
//! imports the runtime, or needs none at all (an empty `DT_NEEDED`), passes.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use tcg_core::artifact::package::cxx_runtime::{runtime_definitions, RUNTIME_SYMBOLS};
use tcg_core::artifact::package::loadable::{check_loadable, StreamRanges};
use tcg_core::artifact::package::{
    check_torch_loader, needed_libraries, own_cxx_runtime, parse_elf,
};
use tcg_core::{Code, Result};

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/elf")
        .join(format!("{name}.so.gz"));
    common::gunzip(&std::fs::read(&path).unwrap())
}

/// The reference package with its `.so` member replaced by `so`.
fn package_with(dir: &Path, so: &[u8]) -> (PathBuf, String) {
    let reference = common::reference_parts(dir);
    let out = dir.join("patched.pt2");
    let mut src = zip::ZipArchive::new(std::fs::File::open(&reference.package).unwrap()).unwrap();
    let mut dst = zip::ZipWriter::new(std::fs::File::create(&out).unwrap());
    for i in 0..src.len() {
        let mut member = src.by_index(i).unwrap();
        let name = member.name().unwrap().into_owned();
        let mut data = Vec::new();
        member.read_to_end(&mut data).unwrap();
        if name.ends_with(".so") {
            data = so.to_vec();
        }
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        dst.start_file(name, options).unwrap();
        dst.write_all(&data).unwrap();
    }
    dst.finish().unwrap();
    (out, reference.metadata.name().to_owned())
}

fn definitions_streamed(so: &[u8]) -> Result<Vec<String>> {
    let mut reopen = |f: &mut dyn FnMut(&mut dyn Read) -> Result<()>| f(&mut &so[..]);
    runtime_definitions(&mut StreamRanges {
        size: so.len() as u64,
        reopen: &mut reopen,
    })
}

#[test]
fn every_fixture_is_a_well_formed_shared_object() {
    for name in [
        "cxx-shared",
        "cxx-static",
        "cxx-static-hidden",
        "c-nostdlib",
    ] {
        let so = fixture(name);
        let info = parse_elf(&so).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(info.machine, 62, "{name}");
        check_loadable(&mut &so[..]).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn a_so_that_imports_the_runtime_or_needs_none_carries_no_runtime() {
    for name in ["cxx-shared", "c-nostdlib"] {
        let so = fixture(name);
        assert_eq!(
            runtime_definitions(&mut &so[..]).unwrap(),
            Vec::<String>::new(),
            "{name}"
        );
        assert_eq!(
            definitions_streamed(&so).unwrap(),
            Vec::<String>::new(),
            "{name}"
        );
    }
}

#[test]
fn a_so_with_a_static_runtime_is_proven_by_its_dynsym_or_its_symtab() {
    for name in ["cxx-static", "cxx-static-hidden"] {
        let so = fixture(name);
        let found = runtime_definitions(&mut &so[..]).unwrap();
        for expected in ["__cxa_throw", "__gxx_personality_v0", "_ZSt9terminatev"] {
            assert!(found.iter().any(|f| f == expected), "{name}: {found:?}");
        }
        assert!(found.iter().all(|f| RUNTIME_SYMBOLS.contains(&f.as_str())));
        assert_eq!(definitions_streamed(&so).unwrap(), found, "{name}");
    }
}

#[test]
fn regression_an_empty_dt_needed_is_not_a_static_runtime() {
    // Issue 31: "libstdc++.so.6 is not in DT_NEEDED" refused packages whose .so
    // needs no C++ runtime at all (the 0.2.0 suite's small test packages).
    let d = tempfile::tempdir().unwrap();
    let (package, entry) = package_with(d.path(), &fixture("c-nostdlib"));
    assert!(needed_libraries(&package, &entry).unwrap().is_empty());
    assert!(own_cxx_runtime(&package, &entry).unwrap().is_empty());
    check_torch_loader(&package, &entry).unwrap();
}

#[test]
fn only_a_package_whose_so_defines_the_runtime_is_refused_for_torchs_loader() {
    let d = tempfile::tempdir().unwrap();
    let (package, entry) = package_with(d.path(), &fixture("cxx-shared"));
    check_torch_loader(&package, &entry).unwrap();
    let d = tempfile::tempdir().unwrap();
    let (package, entry) = package_with(d.path(), &fixture("cxx-static"));
    assert!(own_cxx_runtime(&package, &entry)
        .unwrap()
        .contains(&"__cxa_throw".to_owned()));
    let err = check_torch_loader(&package, &entry).unwrap_err();
    assert_eq!(err.code(), Code::RunLoaderUnsupported, "{err}");
    assert!(err.message().contains("__cxa_throw"), "{err}");
}

#[test]
fn a_malformed_symbol_table_is_refused_as_elf_invalid() {
    let so = fixture("cxx-static");
    let info = parse_elf(&so).unwrap();
    assert!(info.section_size(".dynsym") > 0);
    // Break sh_entsize of the .dynsym section header (type 11 at +4, entsize at +0x38).
    let shoff = u64::from_le_bytes(so[0x28..0x30].try_into().unwrap()) as usize;
    let shnum = u16::from_le_bytes(so[0x3c..0x3e].try_into().unwrap()) as usize;
    let dynsym = (0..shnum)
        .map(|i| shoff + i * 64)
        .find(|&at| u32::from_le_bytes(so[at + 4..at + 8].try_into().unwrap()) == 11)
        .unwrap();
    let mut bad = so.clone();
    bad[dynsym + 0x38..dynsym + 0x40].copy_from_slice(&25u64.to_le_bytes());
    let err = runtime_definitions(&mut &bad[..]).unwrap_err();
    assert_eq!(err.code(), Code::ArtifactElfInvalid, "{err}");
    // sh_link to a section that is not a string table.
    let mut bad = so.clone();
    bad[dynsym + 0x28..dynsym + 0x2c].copy_from_slice(&0u32.to_le_bytes());
    let err = runtime_definitions(&mut &bad[..]).unwrap_err();
    assert_eq!(err.code(), Code::ArtifactElfInvalid, "{err}");
    // A symbol table past the end of the file.
    let mut bad = so.clone();
    bad[dynsym + 0x20..dynsym + 0x28].copy_from_slice(&(24u64 << 20).to_le_bytes());
    let err = runtime_definitions(&mut &bad[..]).unwrap_err();
    assert_eq!(err.code(), Code::ArtifactElfInvalid, "{err}");
    assert!(err.message().contains("outside the file"), "{err}");
    // Over the read cap: refused before anything is read.
    let mut bad = so.clone();
    bad[dynsym + 0x20..dynsym + 0x28].copy_from_slice(&(24u64 * (3 << 20)).to_le_bytes());
    let err = runtime_definitions(&mut &bad[..]).unwrap_err();
    assert_eq!(err.code(), Code::ArtifactElfInvalid, "{err}");
    assert!(err.message().contains("more than"), "{err}");
}
