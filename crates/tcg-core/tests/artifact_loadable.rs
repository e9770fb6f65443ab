//! The loader-facing checks of the package verifier (program headers, their
//! agreement with the section table, the dynamic section) on the reference
//! artifact's real `.so`: it passes, targeted corruptions are refused, and
//! random corruptions of its program headers either pass every check (and are
//! then loaded in a child process by the Python suite) or are refused as
//! `artifact.elf_invalid` — never a panic.

mod common;

use tcg_core::artifact::package::loadable::check_loadable;
use tcg_core::artifact::package::{parse_elf, Package};
use tcg_core::Code;

fn reference_so() -> Vec<u8> {
    let tmp = tempfile::tempdir().unwrap();
    let package = common::members(tmp.path()).join("model.pt2");
    let mut pkg = Package::open(&package).unwrap();
    let members = pkg.entry_members(None).unwrap();
    pkg.read(&members.shared_object).unwrap()
}

fn check(b: &[u8]) -> tcg_core::Result<()> {
    parse_elf(b)?;
    check_loadable(&mut &b[..])
}

fn phdrs(b: &[u8]) -> (usize, usize) {
    let phoff = u64::from_le_bytes(b[0x20..0x28].try_into().unwrap()) as usize;
    let phnum = u16::from_le_bytes(b[0x38..0x3a].try_into().unwrap()) as usize;
    (phoff, phnum)
}

/// The index of the first program header of type `kind` (and with `flags`
/// set, when given).
fn find(b: &[u8], kind: u32, flags: u32) -> usize {
    let (phoff, phnum) = phdrs(b);
    (0..phnum)
        .find(|&i| {
            let p = phoff + i * 56;
            u32::from_le_bytes(b[p..p + 4].try_into().unwrap()) == kind
                && u32::from_le_bytes(b[p + 4..p + 8].try_into().unwrap()) & flags == flags
        })
        .unwrap_or_else(|| panic!("no program header of type {kind:#x}"))
}

fn edit(b: &[u8], index: usize, field: usize, value: &[u8]) -> Vec<u8> {
    let (phoff, _) = phdrs(b);
    let mut c = b.to_vec();
    let at = phoff + index * 56 + field;
    c[at..at + value.len()].copy_from_slice(value);
    c
}

#[test]
fn the_reference_object_passes() {
    let so = reference_so();
    assert!(phdrs(&so).1 > 0);
    check(&so).unwrap();
}

#[test]
fn targeted_corruptions_of_the_program_headers_are_refused() {
    let so = reference_so();
    let size = so.len() as u64;
    let rw = find(&so, 1, 2);
    let dynamic = find(&so, 2, 0);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "a load segment past the end of the file",
            edit(&so, rw, 0x20, &(size * 2).to_le_bytes()),
        ),
        (
            "the writable segment made read-only",
            edit(&so, rw, 4, &4u32.to_le_bytes()),
        ),
        (
            "a load segment at another address",
            edit(&so, rw, 0x10, &0x7000_0000u64.to_le_bytes()),
        ),
        (
            "an alignment that is not a power of two",
            edit(&so, rw, 0x30, &0x3000u64.to_le_bytes()),
        ),
        (
            "p_filesz over p_memsz",
            edit(&so, rw, 0x28, &1u64.to_le_bytes()),
        ),
        (
            "PT_DYNAMIC outside every segment",
            edit(&so, dynamic, 8, &(size - 16).to_le_bytes()),
        ),
        ("a PT_INTERP", edit(&so, dynamic, 0, &3u32.to_le_bytes())),
        ("e_phentsize is not 56", {
            let mut c = so.clone();
            c[0x36] = 55;
            c
        }),
    ];
    for (what, bytes) in cases {
        let err = check(&bytes).expect_err(what);
        assert_eq!(err.code(), Code::ArtifactElfInvalid, "{what}: {err}");
    }
}

#[test]
fn random_corruptions_of_the_program_headers_are_refused_or_consistent() {
    let so = reference_so();
    let (phoff, phnum) = phdrs(&so);
    // A fixed xorshift so every run tries the same mutations.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut refused, mut passed) = (0, 0);
    for _ in 0..400 {
        let mut c = so.clone();
        let at = phoff + (next() as usize) % (phnum * 56);
        c[at] = next() as u8;
        match check(&c) {
            Ok(()) => passed += 1,
            Err(e) => {
                assert_eq!(e.code(), Code::ArtifactElfInvalid, "{e}");
                refused += 1;
            }
        }
    }
    // Most single-byte corruptions of the headers are caught; the rest leave
    // fields the loader does not use (p_paddr, unused bits).
    assert!(refused > 200, "refused {refused}, passed {passed}");
}
