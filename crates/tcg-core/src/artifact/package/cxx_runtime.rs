//! Whether a shared object carries its own C++ runtime (project addition;
//! docs/run.md, "Which loader runs a package").
//!
//! A compiler that links libstdc++ statically (`-static-libstdc++`, the
//! default of some GCC builds) puts a second copy of the C++ runtime inside
//! the graph's `.so`; torch's package loader crashes on such a `.so` in its
//! constructor (seen with torch 2.11 and GCC 13.3), while the torch-free
//! runner, which opens it in a local namespace, runs it.
//!
//! The test is exact: a `.so` carries its own runtime when its symbol tables
//! (`.dynsym`, and `.symtab` when it has one) *define* at least one of
//! [`RUNTIME_SYMBOLS`], entry points that only a C++ runtime (libstdc++,
//! libsupc++, libc++abi) defines. What the `.so` imports, and what its
//! `DT_NEEDED` names, prove nothing: a `.so` that needs no C++ runtime at all
//! (an empty `DT_NEEDED`) is an ordinary package, as is one that names
//! `libstdc++.so.6`. A stripped `.so` whose runtime symbols were also hidden
//! (`-Wl,--exclude-libs,ALL`) leaves no proof and is treated as ordinary.
//!
//! Bounds: each symbol table and its string table is read at most once and
//! at most [`MAX_SYMBOL_TABLE_BYTES`] long (`artifact.elf_invalid` beyond),
//! so memory and time are linear in the file and capped.

use goblin::elf::section_header::SHN_UNDEF;
use goblin::elf::section_header::{SHT_DYNSYM, SHT_STRTAB, SHT_SYMTAB};
use goblin::elf64::header::SIZEOF_EHDR;
use goblin::elf64::sym::{Sym, SIZEOF_SYM};

use super::elf::{invalid, parse_header, read, section_ranges, sections, string_at};
use super::loadable::Ranges;
use crate::error::Result;

/// Symbols that only a C++ runtime defines: the Itanium C++ ABI's exception
/// entry points and personality routine, static-initialisation guards,
/// `std::terminate()`, `std::exception::~exception()` and the vtable of
/// `__cxxabiv1::__class_type_info`. A `.so` that defines any of them carries
/// a runtime of its own. Template instantiations of `std::` (weak, in many
/// ordinary objects) are deliberately not among them.
pub const RUNTIME_SYMBOLS: [&str; 11] = [
    "_ZNSt9exceptionD2Ev",
    "_ZSt9terminatev",
    "_ZTVN10__cxxabiv117__class_type_infoE",
    "__cxa_allocate_exception",
    "__cxa_begin_catch",
    "__cxa_end_catch",
    "__cxa_guard_acquire",
    "__cxa_guard_release",
    "__cxa_rethrow",
    "__cxa_throw",
    "__gxx_personality_v0",
];

/// Most bytes of one symbol table, or of its string table, that the test reads.
pub const MAX_SYMBOL_TABLE_BYTES: u64 = 64 << 20;

/// The [`RUNTIME_SYMBOLS`] that the shared object `src` defines, sorted and
/// without repeats: empty for an object that uses the process's C++ runtime
/// (or none). The object's header and section table are checked as
/// [`super::elf::parse_elf`] checks them.
pub fn runtime_definitions(src: &mut dyn Ranges) -> Result<Vec<String>> {
    let size = src.size();
    let head = src.gather(&[(0, SIZEOF_EHDR as u64)])?.remove(0);
    let h = parse_header(&head, size)?;
    let table = sections(&src.gather(&section_ranges(&h))?)?;
    let mut wanted: Vec<(u64, u64)> = Vec::new();
    for (i, sh) in table.iter().enumerate() {
        if sh.sh_type != SHT_DYNSYM && sh.sh_type != SHT_SYMTAB {
            continue;
        }
        if sh.sh_entsize != SIZEOF_SYM as u64 || sh.sh_size % SIZEOF_SYM as u64 != 0 {
            return Err(invalid(format_args!(
                "symbol table {i} has entries of {} bytes and size {}, not ELF64 symbols",
                sh.sh_entsize, sh.sh_size
            )));
        }
        let strings = table
            .get(sh.sh_link as usize)
            .filter(|s| s.sh_type == SHT_STRTAB)
            .ok_or_else(|| {
                invalid(format_args!(
                    "symbol table {i} links section {}, which is not a string table",
                    sh.sh_link
                ))
            })?;
        for (what, off, len) in [
            ("symbol table", sh.sh_offset, sh.sh_size),
            ("string table", strings.sh_offset, strings.sh_size),
        ] {
            if len > MAX_SYMBOL_TABLE_BYTES {
                return Err(invalid(format_args!(
                    "the {what} of symbol table {i} is {len} bytes, more than the {MAX_SYMBOL_TABLE_BYTES} read"
                )));
            }
            if !matches!(off.checked_add(len), Some(end) if end <= size) {
                return Err(invalid(format_args!(
                    "the {what} of symbol table {i} lies outside the file"
                )));
            }
            wanted.push((off, len));
        }
    }
    let mut found: Vec<String> = Vec::new();
    // One table and its strings at a time: the memory held is one pair.
    for pair in wanted.chunks(2) {
        let mut got = src.gather(pair)?.into_iter();
        let (symbols, strings) = (got.next().expect("symbols"), got.next().expect("strings"));
        for entry in symbols.chunks_exact(SIZEOF_SYM) {
            let sym: Sym = read(entry, "symbol")?;
            if sym.st_shndx == SHN_UNDEF as u16 {
                continue;
            }
            let Some(name) = string_at(&strings, sym.st_name as usize) else {
                continue;
            };
            if let Some(hit) = RUNTIME_SYMBOLS.iter().find(|s| s.as_bytes() == name) {
                found.push((*hit).to_owned());
            }
        }
    }
    found.sort_unstable();
    found.dedup();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_without_symbol_tables_defines_no_runtime() {
        let so = super::super::elf::synthetic_elf(62, 16);
        assert!(runtime_definitions(&mut &so[..]).unwrap().is_empty());
    }

    #[test]
    fn the_symbol_set_is_sorted_and_distinct() {
        let mut sorted = RUNTIME_SYMBOLS.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted, RUNTIME_SYMBOLS.to_vec());
    }
}
