//! The shim imports of a package's `.so` on real linker output: the
//! testdata/elf fixtures (scripts/gen_elf_fixtures.sh) and the reference
//! 0.2.0 package (a CPU graph minted by torch's AOTInductor).

mod common;

use std::io::Read;
use std::path::PathBuf;

use tcg_core::artifact::package::loadable::StreamRanges;
use tcg_core::artifact::package::shim_imports::{dynamic_imports, ShimImports};
use tcg_core::artifact::package::{shim_imports, Package};
use tcg_core::{Code, Result};

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/elf")
        .join(format!("{name}.so.gz"));
    common::gunzip(&std::fs::read(&path).unwrap())
}

fn streamed(so: &[u8]) -> Result<ShimImports> {
    let mut reopen = |f: &mut dyn FnMut(&mut dyn Read) -> Result<()>| f(&mut &so[..]);
    dynamic_imports(&mut StreamRanges {
        size: so.len() as u64,
        reopen: &mut reopen,
    })
}

/// The reference package's `.so` bytes.
fn reference_so() -> Vec<u8> {
    let d = tempfile::tempdir().unwrap();
    let parts = common::reference_parts(d.path());
    let mut pkg = Package::open(&parts.package).unwrap();
    let members = pkg.entry_members(None).unwrap();
    pkg.read(&members.shared_object).unwrap()
}

/// What the reference CPU graph (a two-layer MLP) imports from libtorch's C shim.
const REFERENCE_SHIMS: [&str; 23] = [
    "aoti_torch__reinterpret_tensor",
    "aoti_torch_clone",
    "aoti_torch_cpu_addmm_out",
    "aoti_torch_create_tensor_from_blob",
    "aoti_torch_create_tensor_from_blob_v2",
    "aoti_torch_delete_tensor_object",
    "aoti_torch_device_type_cpu",
    "aoti_torch_device_type_cuda",
    "aoti_torch_dtype_float32",
    "aoti_torch_empty_strided",
    "aoti_torch_get_data_ptr",
    "aoti_torch_get_device_type",
    "aoti_torch_get_dim",
    "aoti_torch_get_dtype",
    "aoti_torch_get_numel",
    "aoti_torch_get_sizes",
    "aoti_torch_get_storage_offset",
    "aoti_torch_get_storage_size",
    "aoti_torch_get_strides",
    "aoti_torch_grad_mode_is_enabled",
    "aoti_torch_grad_mode_set_enabled",
    "aoti_torch_layout_strided",
    "aoti_torch_new_tensor_handle",
];

#[test]
fn system_only_fixtures_import_no_shim_and_nothing_else() {
    // The C++ runtime imported (versioned and unversioned), carried statically
    // (only glibc and the toolchain's weak hooks left), or no C++ at all.
    for name in [
        "cxx-shared",
        "cxx-static",
        "cxx-static-hidden",
        "c-nostdlib",
    ] {
        let so = fixture(name);
        let got = dynamic_imports(&mut &so[..]).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, ShimImports::default(), "{name}");
        assert_eq!(streamed(&so).unwrap(), got, "{name}");
    }
}

#[test]
fn the_reference_package_imports_exactly_its_shim_functions() {
    let d = tempfile::tempdir().unwrap();
    let parts = common::reference_parts(d.path());
    let got = shim_imports(&parts.package, Some(parts.metadata.name())).unwrap();
    assert_eq!(got.aoti_torch, REFERENCE_SHIMS.to_vec());
    // Everything else it imports is glibc, libstdc++ (three of those names
    // unversioned) and libgcc_s.
    assert!(got.other.is_empty(), "{:?}", got.other);
    assert_eq!(shim_imports(&parts.package, None).unwrap(), got);
    let so = reference_so();
    assert_eq!(streamed(&so).unwrap(), got);
}

/// `so` with the first occurrence of the NUL-delimited name `from` in its
/// bytes (the dynamic string table) replaced by `to`, of the same length.
fn renamed(so: &[u8], from: &str, to: &str) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let needle = format!("\0{from}\0");
    let at = so
        .windows(needle.len())
        .position(|w| w == needle.as_bytes())
        .unwrap_or_else(|| panic!("{from} not found"));
    let mut out = so.to_vec();
    out[at + 1..at + 1 + to.len()].copy_from_slice(to.as_bytes());
    out
}

#[test]
fn an_unversioned_import_outside_the_system_is_other_and_a_versioned_one_is_judged_by_its_library()
{
    let so = reference_so();
    // aoti_torch_clone (unversioned) becomes a libtorch C++-API-like import.
    let bad = renamed(&so, "aoti_torch_clone", "_ZN3c10_clone_xy");
    let got = dynamic_imports(&mut &bad[..]).unwrap();
    assert_eq!(got.other, vec!["_ZN3c10_clone_xy".to_owned()]);
    assert!(!got.aoti_torch.contains(&"aoti_torch_clone".to_owned()));
    assert_eq!(got.aoti_torch.len(), REFERENCE_SHIMS.len() - 1);
    // strtol@GLIBC_2.2.5 renamed keeps its version: still a libc import.
    let libc = renamed(&so, "strtol", "zzzzzz");
    assert!(dynamic_imports(&mut &libc[..]).unwrap().other.is_empty());
}

fn dynsym_header(so: &[u8]) -> usize {
    let shoff = u64::from_le_bytes(so[0x28..0x30].try_into().unwrap()) as usize;
    let shnum = u16::from_le_bytes(so[0x3c..0x3e].try_into().unwrap()) as usize;
    (0..shnum)
        .map(|i| shoff + i * 64)
        .find(|&at| u32::from_le_bytes(so[at + 4..at + 8].try_into().unwrap()) == 11)
        .unwrap()
}

#[test]
fn malformed_tables_are_refused_as_elf_invalid_either_way_the_bytes_are_held() {
    let so = reference_so();
    let dynsym = dynsym_header(&so);
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut entsize = so.clone();
    entsize[dynsym + 0x38..dynsym + 0x40].copy_from_slice(&25u64.to_le_bytes());
    cases.push(("entsize", entsize));
    let mut link = so.clone();
    link[dynsym + 0x28..dynsym + 0x2c].copy_from_slice(&0u32.to_le_bytes());
    cases.push(("link", link));
    let mut outside = so.clone();
    outside[dynsym + 0x18..dynsym + 0x20].copy_from_slice(&(u64::MAX - 8).to_le_bytes());
    cases.push(("outside", outside));
    let mut huge = so.clone();
    huge[dynsym + 0x20..dynsym + 0x28].copy_from_slice(&(24u64 * (3 << 20)).to_le_bytes());
    cases.push(("over the cap", huge));
    // One symbol more than .gnu.version has entries for.
    let mut count = so.clone();
    let size = u64::from_le_bytes(so[dynsym + 0x20..dynsym + 0x28].try_into().unwrap());
    count[dynsym + 0x20..dynsym + 0x28].copy_from_slice(&(size - 24).to_le_bytes());
    cases.push(("versym count", count));
    // A symbol name offset past the string table.
    let mut name = so.clone();
    let off = u64::from_le_bytes(so[dynsym + 0x18..dynsym + 0x20].try_into().unwrap()) as usize;
    name[off + 24..off + 28].copy_from_slice(&u32::MAX.to_le_bytes());
    cases.push(("name", name));
    for (what, bad) in cases {
        let e = dynamic_imports(&mut &bad[..]).unwrap_err();
        assert_eq!(e.code(), Code::ArtifactElfInvalid, "{what}: {e}");
        assert_eq!(streamed(&bad).unwrap_err().code(), e.code(), "{what}");
    }
    // Truncations never panic.
    for cut in [0, 10, 64, so.len() / 3, so.len() - 1] {
        if let Err(e) = dynamic_imports(&mut &so[..cut]) {
            assert_eq!(e.code(), Code::ArtifactElfInvalid, "cut {cut}: {e}");
        }
    }
}

#[test]
fn mutated_fixtures_are_read_or_refused_the_same_way_in_memory_and_streamed() {
    // A deterministic mutation loop (xorshift) over the small fixtures: every
    // result is a read or `artifact.elf_invalid`, never a panic, and the two
    // ways of holding the bytes agree (the `elf` fuzz target does this at scale).
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut read, mut refused) = (0, 0);
    for name in ["cxx-shared", "cxx-static"] {
        let so = fixture(name);
        // Half the bytes written land in the section headers or the dynamic
        // tables at the start of the file (where .dynsym, .dynstr and the
        // version sections sit), the rest anywhere.
        let shoff = u64::from_le_bytes(so[0x28..0x30].try_into().unwrap());
        let dynsym = dynsym_header(&so);
        let tables_end = u64::from_le_bytes(so[dynsym + 0x18..dynsym + 0x20].try_into().unwrap())
            .saturating_add(8192)
            .min(so.len() as u64);
        for _ in 0..300 {
            let mut bad = so.clone();
            for _ in 0..1 + next() % 4 {
                let at = match next() % 4 {
                    0 => shoff + next() % (so.len() as u64 - shoff),
                    1 => next() % tables_end,
                    _ => next() % so.len() as u64,
                } as usize;
                bad[at] = next() as u8;
            }
            let a = dynamic_imports(&mut &bad[..]);
            let b = streamed(&bad);
            match (a, b) {
                (Ok(a), Ok(b)) => {
                    assert_eq!(a, b);
                    read += 1;
                }
                (Err(a), Err(b)) => {
                    assert_eq!(a.code(), Code::ArtifactElfInvalid, "{a}");
                    assert_eq!(b.code(), a.code());
                    refused += 1;
                }
                (a, b) => panic!("{name}: {a:?} vs {b:?}"),
            }
        }
    }
    // The loop exercised both outcomes.
    assert!(read > 0 && refused > 0, "read {read}, refused {refused}");
}
