//! Which libtorch C shim functions a shared object imports (project
//! addition; docs/shim.md, issue 34).
//!
//! AOTInductor's generated code reaches libtorch only through its C shim,
//! functions named `aoti_torch_*`. A `.so` built with `link_libtorch=False`
//! has no `DT_NEEDED` on libtorch: its shim imports are undefined symbols of
//! its dynamic symbol table, resolved against whatever the process loaded.
//! Reading them from `.dynsym` says exactly which shim functions the graph
//! needs, before anything is opened.
//!
//! [`dynamic_imports`] returns the undefined global and weak symbols of
//! `.dynsym`, in two sorted, distinct lists:
//!
//! - `aoti_torch`: every name that starts with [`SHIM_PREFIX`];
//! - `other`: every other import that the platform's system libraries do
//!   not provide (the C library and its parts, `libm`, the C++ runtime,
//!   `libgcc_s`, the CUDA runtime and driver), for example a `c10::` or
//!   `at::` symbol of a `.so` that links libtorch's C++ API.
//!
//! A symbol is a system import when its GNU version requirement
//! (`.gnu.version` / `.gnu.version_r`) names a system library
//! ([`SYSTEM_LIBRARY_PREFIXES`]), or, when it carries no version, when its
//! name is one only those libraries define ([`is_system_name`]: the C++
//! runtime's `std::` and ABI entry points, the CUDA runtime (`cuda*`,
//! `__cuda*`) and driver (`cu*`) APIs, and the toolchain's weak hooks
//! `__gmon_start__` and `_ITM_*`). An unversioned C-library name (a libc
//! without symbol versions) lands in `other`: the split errs towards
//! reporting more, never less.
//!
//! Bounds: `.dynsym`, its string table and the two version sections are each
//! read at most once and at most [`MAX_SYMBOL_TABLE_BYTES`] long; the
//! version-requirement chain is walked at most once per 16 bytes of its
//! section; every offset is checked. Malformed input is
//! `artifact.elf_invalid`, never a panic; memory and time are linear in the
//! tables read.

use goblin::elf::section_header::{SHN_UNDEF, SHT_DYNSYM, SHT_STRTAB};
use goblin::elf::sym::{st_bind, STB_GLOBAL, STB_WEAK};
use goblin::elf64::header::SIZEOF_EHDR;
use goblin::elf64::sym::{Sym, SIZEOF_SYM};

use super::cxx_runtime::MAX_SYMBOL_TABLE_BYTES;
use super::elf::{invalid, parse_header, read, section_ranges, sections, string_at};
use super::loadable::Ranges;
use crate::error::Result;

/// The prefix of every libtorch C shim function.
pub const SHIM_PREFIX: &str = "aoti_torch_";

/// `SHT_GNU_versym`: one 16-bit version index per `.dynsym` entry.
pub const SHT_GNU_VERSYM: u32 = goblin::elf::section_header::SHT_GNU_VERSYM;
/// `SHT_GNU_verneed`: the version requirements, by needed library.
pub const SHT_GNU_VERNEED: u32 = goblin::elf::section_header::SHT_GNU_VERNEED;

/// Size of one `Elf64_Verneed` and of one `Elf64_Vernaux` entry.
const VERNEED_ENTRY: u64 = 16;

/// File names (prefixes of a `DT_NEEDED` / version-requirement file) of the
/// system libraries whose imports are not listed: glibc and its parts
/// (`libc`, `libm`, `libpthread`, `libdl`, `librt`, the dynamic loader), the
/// C++ runtime (`libstdc++`), `libgcc_s`, the CUDA runtime and driver.
pub const SYSTEM_LIBRARY_PREFIXES: [&str; 10] = [
    "ld-linux",
    "libc.so",
    "libcuda.so",
    "libcudart.so",
    "libdl.so",
    "libgcc_s.so",
    "libm.so",
    "libpthread.so",
    "librt.so",
    "libstdc++.so",
];

/// Prefixes of unversioned names only the system libraries define.
const SYSTEM_NAME_PREFIXES: [&str; 20] = [
    "_ITM_",
    "_Unwind_",
    "_ZNKSt",
    "_ZNOSt",
    "_ZNSt",
    "_ZNVSt",
    "_ZSt",
    "_ZTINSt",
    "_ZTISt",
    "_ZTSNSt",
    "_ZTSSt",
    "_ZTTNSt",
    "_ZTTSt",
    "_ZTVN10__cxxabiv",
    "_ZTVNSt",
    "_ZTVSt",
    "_ZGTt",
    "__cuda",
    "__cxa_",
    "__gxx_",
];

/// Whether an unversioned undefined symbol `name` is one only the system
/// libraries define: the C++ runtime (`std::` names, `operator new` and
/// `delete` and their transaction-safe clones `_ZGTt*`, the ABI's `__cxa_*`, `__gxx_*`, `__dynamic_cast`, the unwinder),
/// the CUDA runtime (`cuda[A-Z]…`, `__cuda…`) and driver (`cu[A-Z]…`) APIs,
/// and the toolchain's weak hooks (`__gmon_start__`, `_ITM_*`).
pub fn is_system_name(name: &str) -> bool {
    let upper_after = |prefix: &str| {
        name.strip_prefix(prefix)
            .and_then(|r| r.bytes().next())
            .is_some_and(|b| b.is_ascii_uppercase())
    };
    SYSTEM_NAME_PREFIXES.iter().any(|p| name.starts_with(p))
        || ["_Znw", "_Zna", "_Zdl", "_Zda"]
            .iter()
            .any(|p| name.starts_with(p))
        || name == "__gmon_start__"
        || name == "__dynamic_cast"
        || upper_after("cuda")
        || upper_after("cu")
}

/// Whether the library file `file` (a version requirement's) is a system
/// library ([`SYSTEM_LIBRARY_PREFIXES`]).
pub fn is_system_library(file: &str) -> bool {
    SYSTEM_LIBRARY_PREFIXES.iter().any(|p| file.starts_with(p))
}

/// The imports of a shared object that matter to the runtime that serves it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShimImports {
    /// The undefined `aoti_torch_*` symbols, sorted and distinct.
    pub aoti_torch: Vec<String>,
    /// Every other undefined symbol not provided by a system library, sorted
    /// and distinct.
    pub other: Vec<String>,
}

fn u16_at(b: &[u8], at: u64) -> Option<u16> {
    let at = usize::try_from(at).ok()?;
    Some(u16::from_le_bytes(
        b.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}

fn u32_at(b: &[u8], at: u64) -> Option<u32> {
    let at = usize::try_from(at).ok()?;
    Some(u32::from_le_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

/// The library file of every version index the requirements `verneed` (with
/// string table `strings`, `count` entries per `sh_info`) declare, as
/// `(index, file)` pairs.
fn version_files(verneed: &[u8], strings: &[u8], count: u32) -> Result<Vec<(u16, String)>> {
    let bad = |m: &str| invalid(format_args!("the version requirements {m}"));
    let mut out: Vec<(u16, String)> = Vec::new();
    // Every entry is 16 bytes: a chain longer than the section has entries loops.
    let mut budget = verneed.len() as u64 / VERNEED_ENTRY;
    let mut at: u64 = 0;
    for _ in 0..count {
        let (Some(cnt), Some(file), Some(aux), Some(next)) = (
            u16_at(verneed, at + 2),
            u32_at(verneed, at + 4),
            u32_at(verneed, at + 8),
            u32_at(verneed, at + 12),
        ) else {
            return Err(bad("run past their section"));
        };
        budget = budget
            .checked_sub(1)
            .ok_or_else(|| bad("chain more entries than their section holds"))?;
        let file = string_at(strings, file as usize)
            .ok_or_else(|| bad("name a file outside their string table"))?;
        let file = std::str::from_utf8(file).map_err(|_| bad("name a file that is not UTF-8"))?;
        let mut a = at
            .checked_add(u64::from(aux))
            .ok_or_else(|| bad("run past their section"))?;
        for _ in 0..cnt {
            let (Some(other), Some(anext)) = (u16_at(verneed, a + 6), u32_at(verneed, a + 12))
            else {
                return Err(bad("run past their section"));
            };
            budget = budget
                .checked_sub(1)
                .ok_or_else(|| bad("chain more entries than their section holds"))?;
            out.push((other & 0x7fff, file.to_owned()));
            a = a
                .checked_add(u64::from(anext))
                .ok_or_else(|| bad("run past their section"))?;
        }
        if next == 0 {
            break;
        }
        at = at
            .checked_add(u64::from(next))
            .ok_or_else(|| bad("run past their section"))?;
    }
    Ok(out)
}

/// The dynamic symbol table of an object, read and checked: the symbols,
/// their strings, `.gnu.version` (empty when absent) and the files its
/// version requirements name.
struct DynamicTables {
    symbols: Vec<u8>,
    strings: Vec<u8>,
    versions: Vec<u8>,
    files: Vec<(u16, String)>,
}

/// Read `src`'s dynamic symbol table (`None`: it has none). The object's
/// header and section table are checked as [`super::elf::parse_elf`] checks
/// them.
fn dynamic_tables(src: &mut dyn Ranges) -> Result<Option<DynamicTables>> {
    let size = src.size();
    let head = src.gather(&[(0, SIZEOF_EHDR as u64)])?.remove(0);
    let h = parse_header(&head, size)?;
    let table = sections(&src.gather(&section_ranges(&h))?)?;
    let only = |ty: u32, what: &str| -> Result<Option<usize>> {
        let mut found = table.iter().enumerate().filter(|(_, s)| s.sh_type == ty);
        let first = found.next().map(|(i, _)| i);
        if found.next().is_some() {
            return Err(invalid(format_args!("more than one {what} section")));
        }
        Ok(first)
    };
    let Some(dynsym) = only(SHT_DYNSYM, "dynamic symbol table")? else {
        return Ok(None);
    };
    let versym = only(SHT_GNU_VERSYM, ".gnu.version")?;
    let verneed = only(SHT_GNU_VERNEED, ".gnu.version_r")?;
    let ds = &table[dynsym];
    if ds.sh_entsize != SIZEOF_SYM as u64 || ds.sh_size % SIZEOF_SYM as u64 != 0 {
        return Err(invalid(format_args!(
            "symbol table {dynsym} has entries of {} bytes and size {}, not ELF64 symbols",
            ds.sh_entsize, ds.sh_size
        )));
    }
    let strings_of = |i: usize, link: u32| {
        table
            .get(link as usize)
            .filter(|s| s.sh_type == SHT_STRTAB)
            .map(|s| (s.sh_offset, s.sh_size))
            .ok_or_else(|| {
                invalid(format_args!(
                    "section {i} links section {link}, which is not a string table"
                ))
            })
    };
    let mut wanted: Vec<(&str, (u64, u64))> = vec![
        ("symbol table", (ds.sh_offset, ds.sh_size)),
        ("string table", strings_of(dynsym, ds.sh_link)?),
    ];
    let nsyms = ds.sh_size / SIZEOF_SYM as u64;
    if let Some(v) = versym {
        let s = &table[v];
        if s.sh_size != nsyms * 2 {
            return Err(invalid(format_args!(
                ".gnu.version is {} bytes, not 2 for each of the {nsyms} dynamic symbols",
                s.sh_size
            )));
        }
        wanted.push((".gnu.version", (s.sh_offset, s.sh_size)));
    }
    if let Some(v) = verneed {
        let s = &table[v];
        wanted.push((".gnu.version_r", (s.sh_offset, s.sh_size)));
        wanted.push(("string table of .gnu.version_r", strings_of(v, s.sh_link)?));
    }
    for (what, (off, len)) in &wanted {
        if *len > MAX_SYMBOL_TABLE_BYTES {
            return Err(invalid(format_args!(
                "the {what} is {len} bytes, more than the {MAX_SYMBOL_TABLE_BYTES} read"
            )));
        }
        if !matches!(off.checked_add(*len), Some(end) if end <= size) {
            return Err(invalid(format_args!("the {what} lies outside the file")));
        }
    }
    let ranges: Vec<(u64, u64)> = wanted.iter().map(|(_, r)| *r).collect();
    let mut got = src.gather(&ranges)?;
    let files = match verneed {
        Some(v) => {
            let n = got.len();
            version_files(&got[n - 2], &got[n - 1], table[v].sh_info)?
        }
        None => Vec::new(),
    };
    got.truncate(if versym.is_some() { 3 } else { 2 });
    let versions = if versym.is_some() {
        got.pop().unwrap_or_default()
    } else {
        Vec::new()
    };
    let strings = got.pop().unwrap_or_default();
    let symbols = got.pop().unwrap_or_default();
    Ok(Some(DynamicTables {
        symbols,
        strings,
        versions,
        files,
    }))
}

/// Whether the shared object `src` names the C++11 string ABI in its dynamic
/// symbols (a defined or undefined name mentioning `std::__cxx11`): code
/// that passes `std::string`s built with `_GLIBCXX_USE_CXX11_ABI=1`, the
/// layout [`crate`]'s users lay a `std::unordered_map<std::string, …>` out in.
/// An object without a dynamic symbol table names nothing.
pub fn names_cxx11_strings(src: &mut dyn Ranges) -> Result<bool> {
    let Some(t) = dynamic_tables(src)? else {
        return Ok(false);
    };
    for entry in t.symbols.chunks_exact(SIZEOF_SYM) {
        let sym: Sym = read(entry, "symbol")?;
        let name = string_at(&t.strings, sym.st_name as usize).unwrap_or_default();
        if name.windows(10).any(|w| w == b"St7__cxx11") {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The imports of the shared object `src` ([`ShimImports`]): its undefined
/// global and weak `.dynsym` symbols, split as the module says. An object
/// without a dynamic symbol table imports nothing. The object's header and
/// section table are checked as [`super::elf::parse_elf`] checks them.
pub fn dynamic_imports(src: &mut dyn Ranges) -> Result<ShimImports> {
    let Some(t) = dynamic_tables(src)? else {
        return Ok(ShimImports::default());
    };
    let (symbols, strings, versions, files) = (&t.symbols, &t.strings, &t.versions[..], &t.files);
    let mut out = ShimImports::default();
    for (i, entry) in symbols.chunks_exact(SIZEOF_SYM).enumerate() {
        let sym: Sym = read(entry, "symbol")?;
        if sym.st_shndx != SHN_UNDEF as u16
            || !matches!(st_bind(sym.st_info), STB_GLOBAL | STB_WEAK)
        {
            continue;
        }
        let name = string_at(strings, sym.st_name as usize).ok_or_else(|| {
            invalid(format_args!(
                "dynamic symbol {i} has no name in its string table"
            ))
        })?;
        if name.is_empty() {
            continue;
        }
        let name = std::str::from_utf8(name).map_err(|_| {
            invalid(format_args!(
                "dynamic symbol {i} has a name that is not UTF-8"
            ))
        })?;
        if name.starts_with(SHIM_PREFIX) {
            out.aoti_torch.push(name.to_owned());
            continue;
        }
        // Version index 0 is local, 1 global (unversioned); 2 and up name a requirement.
        let index = u16_at(versions, i as u64 * 2).map_or(1, |v| v & 0x7fff);
        let system = if index >= 2 {
            files
                .iter()
                .find(|(n, _)| *n == index)
                .is_some_and(|(_, file)| is_system_library(file))
        } else {
            is_system_name(name)
        };
        if !system {
            out.other.push(name.to_owned());
        }
    }
    for list in [&mut out.aoti_torch, &mut out.other] {
        list.sort_unstable();
        list.dedup();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_without_symbol_tables_imports_nothing() {
        let so = super::super::elf::synthetic_elf(62, 16);
        assert_eq!(
            dynamic_imports(&mut &so[..]).unwrap(),
            ShimImports::default()
        );
    }

    #[test]
    fn system_names_are_the_runtimes_and_only_theirs() {
        for name in [
            "_ZNSt6localeC1Ev",
            "_ZSt28__throw_bad_array_new_lengthv",
            "_Znwm",
            "_ZdlPvm",
            "__cxa_throw",
            "__gxx_personality_v0",
            "_Unwind_Resume",
            "__gmon_start__",
            "_ITM_registerTMCloneTable",
            "cudaMalloc",
            "cuLaunchKernel",
            "__cudaRegisterFatBinary",
        ] {
            assert!(is_system_name(name), "{name}");
        }
        for name in [
            "_ZN3c1019UndefinedTensorImpl10_singletonE",
            "_ZN2at4_ops3add4callERKNS_6TensorES4_RKN3c106ScalarE",
            "cublasSgemm",
            "cudnnCreate",
            "curand",
            "memcpy",
            "aoti_torch_clone",
            "cu",
        ] {
            assert!(!is_system_name(name), "{name}");
        }
        assert!(is_system_library("libc.so.6"));
        assert!(is_system_library("libcudart.so.12"));
        assert!(!is_system_library("libcublas.so.12"));
        assert!(!is_system_library("libtorch_cpu.so"));
    }

    #[test]
    fn a_version_chain_that_loops_or_overruns_is_refused() {
        // One requirement whose next offset points back at itself, with sh_info claiming 5.
        let mut v = vec![0u8; 32];
        v[0..2].copy_from_slice(&1u16.to_le_bytes());
        v[2..4].copy_from_slice(&1u16.to_le_bytes());
        v[8..12].copy_from_slice(&16u32.to_le_bytes());
        v[22..24].copy_from_slice(&2u16.to_le_bytes());
        let strings = b"\0libc.so.6\0";
        v[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(
            version_files(&v, strings, 1).unwrap(),
            vec![(2, "libc.so.6".to_owned())]
        );
        // vn_next = 0 stops the walk whatever sh_info says.
        assert_eq!(version_files(&v, strings, 5).unwrap().len(), 1);
        // An auxiliary chain that stays on one entry (vna_next = 0) while
        // vn_cnt claims 60000 runs out of budget after the section's 2 entries.
        let mut looping = v.clone();
        looping[2..4].copy_from_slice(&60000u16.to_le_bytes());
        let e = version_files(&looping, strings, 1).unwrap_err();
        assert_eq!(e.code(), crate::Code::ArtifactElfInvalid, "{e}");
        assert!(e.message().contains("more entries"), "{e}");
        // A next offset far past the section.
        let mut next = v.clone();
        next[12..16].copy_from_slice(&(u32::MAX - 15).to_le_bytes());
        let e = version_files(&next, strings, 2).unwrap_err();
        assert_eq!(e.code(), crate::Code::ArtifactElfInvalid, "{e}");
        // An auxiliary entry past the section.
        let mut far = v.clone();
        far[8..12].copy_from_slice(&1000u32.to_le_bytes());
        let e = version_files(&far, strings, 1).unwrap_err();
        assert_eq!(e.code(), crate::Code::ArtifactElfInvalid, "{e}");
        // A file name outside the string table.
        let mut name = v;
        name[4..8].copy_from_slice(&999u32.to_le_bytes());
        let e = version_files(&name, strings, 1).unwrap_err();
        assert_eq!(e.code(), crate::Code::ArtifactElfInvalid, "{e}");
    }
}
