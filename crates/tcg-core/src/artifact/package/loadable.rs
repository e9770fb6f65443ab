//! What the dynamic loader relies on in a shared object, checked before any
//! `dlopen` (project addition to SPEC-v1 §8.6): the program headers, their
//! agreement with the section table, and the dynamic section. `glibc` maps
//! and reads these without bounds checks of its own, so a corrupted header
//! would otherwise crash the loading process instead of failing it. Every
//! refusal is `artifact.elf_invalid`.
//!
//! Checked, with checked arithmetic throughout:
//! - `e_type` is `ET_DYN`; `e_phentsize` is 56; the program header table lies
//!   in the file. An object without program headers has no loadable segment,
//!   which the loader refuses by itself, and passes here.
//! - Each `PT_LOAD`: `p_filesz <= p_memsz`, its file bytes inside the file, a
//!   power-of-two `p_align` of at least 4096 with `p_vaddr ≡ p_offset`, and
//!   the segments in ascending, non-overlapping address order.
//! - No `PT_INTERP`; at most one `PT_DYNAMIC`, `PT_TLS` and `PT_GNU_RELRO`.
//! - `PT_DYNAMIC`, `PT_PHDR`, `PT_NOTE`, `PT_TLS`, `PT_GNU_EH_FRAME`,
//!   `PT_GNU_PROPERTY` and `PT_GNU_RELRO` lie inside one `PT_LOAD`, at the
//!   same place in the file and in memory; `PT_DYNAMIC` in a writable one,
//!   matching the `SHT_DYNAMIC` section when there is one.
//! - Every allocated section lies inside one `PT_LOAD` at the same place in
//!   file and memory (`.bss`-like sections inside its memory image), writable
//!   sections in a writable segment, code in an executable one.
//! - The dynamic section ends with `DT_NULL`; every address it names lies in
//!   a segment, every table it sizes lies in a segment's file bytes, entry
//!   sizes are the ELF64 ones and string offsets lie in the string table.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;

use goblin::elf::dynamic::{
    DT_FINI, DT_FINI_ARRAY, DT_FINI_ARRAYSZ, DT_GNU_HASH, DT_HASH, DT_INIT, DT_INIT_ARRAY,
    DT_INIT_ARRAYSZ, DT_JMPREL, DT_NEEDED, DT_NULL, DT_PLTREL, DT_PLTRELSZ, DT_PREINIT_ARRAY,
    DT_REL, DT_RELA, DT_RELAENT, DT_RELASZ, DT_RELENT, DT_RELSZ, DT_RPATH, DT_RUNPATH, DT_SONAME,
    DT_STRSZ, DT_STRTAB, DT_SYMENT, DT_SYMTAB, DT_VERDEF, DT_VERNEED, DT_VERSYM,
};
use goblin::elf::header::ET_DYN;
use goblin::elf::program_header::{
    PF_W, PF_X, PT_DYNAMIC, PT_GNU_EH_FRAME, PT_GNU_PROPERTY, PT_GNU_RELRO, PT_INTERP, PT_LOAD,
    PT_NOTE, PT_PHDR, PT_TLS,
};
use goblin::elf::section_header::{
    SHF_ALLOC, SHF_EXECINSTR, SHF_TLS, SHF_WRITE, SHT_DYNAMIC, SHT_NOBITS,
};
use goblin::elf64::dynamic::{Dyn, SIZEOF_DYN};
use goblin::elf64::header::SIZEOF_EHDR;
use goblin::elf64::program_header::{ProgramHeader, SIZEOF_PHDR};

use super::elf::{invalid, parse_header, read, section_ranges, sections, stream, Reopen};
use crate::error::{Error, Result};

/// Byte ranges of a shared object, however it is held.
pub trait Ranges {
    /// The size of the object.
    fn size(&self) -> u64;
    /// The bytes of each `(offset, length)`, each inside the object.
    fn gather(&mut self, ranges: &[(u64, u64)]) -> Result<Vec<Vec<u8>>>;
}

fn inside(size: u64, off: u64, len: u64) -> bool {
    matches!(off.checked_add(len), Some(end) if end <= size)
}

impl Ranges for &[u8] {
    fn size(&self) -> u64 {
        self.len() as u64
    }
    fn gather(&mut self, ranges: &[(u64, u64)]) -> Result<Vec<Vec<u8>>> {
        ranges
            .iter()
            .map(|&(off, len)| {
                if !inside(self.len() as u64, off, len) {
                    return Err(invalid(format_args!(
                        "range {off}+{len} lies outside the file"
                    )));
                }
                Ok(self[off as usize..(off + len) as usize].to_vec())
            })
            .collect()
    }
}

/// A file read with positioned reads.
pub struct FileRanges<'a> {
    /// The file.
    pub file: &'a File,
    /// Its size.
    pub size: u64,
}

impl Ranges for FileRanges<'_> {
    fn size(&self) -> u64 {
        self.size
    }
    fn gather(&mut self, ranges: &[(u64, u64)]) -> Result<Vec<Vec<u8>>> {
        ranges
            .iter()
            .map(|&(off, len)| {
                if !inside(self.size, off, len) {
                    return Err(invalid(format_args!(
                        "range {off}+{len} lies outside the file"
                    )));
                }
                let mut buf = vec![0u8; len as usize];
                self.file
                    .read_exact_at(&mut buf, off)
                    .map_err(|e| Error::io("cannot read the shared object", &e))?;
                Ok(buf)
            })
            .collect()
    }
}

/// A stream that can be read again from its start: one pass per gather.
pub struct StreamRanges<'a> {
    /// The declared size of the stream.
    pub size: u64,
    /// Reads the stream from its start.
    pub reopen: Reopen<'a>,
}

impl Ranges for StreamRanges<'_> {
    fn size(&self) -> u64 {
        self.size
    }
    fn gather(&mut self, ranges: &[(u64, u64)]) -> Result<Vec<Vec<u8>>> {
        let mut out: Vec<Vec<u8>> = Vec::with_capacity(ranges.len());
        for &(off, len) in ranges {
            if !inside(self.size, off, len) {
                return Err(invalid(format_args!(
                    "range {off}+{len} lies outside the file"
                )));
            }
            out.push(vec![0u8; len as usize]);
        }
        let size = self.size;
        (self.reopen)(&mut |src: &mut dyn Read| {
            stream(src, size, &mut |chunk, at| {
                for (dst, &(off, len)) in out.iter_mut().zip(ranges) {
                    let lo = at.max(off);
                    let hi = (at + chunk.len() as u64).min(off + len);
                    if lo < hi {
                        dst[(lo - off) as usize..(hi - off) as usize]
                            .copy_from_slice(&chunk[(lo - at) as usize..(hi - at) as usize]);
                    }
                }
            })
        })?;
        Ok(out)
    }
}

/// Largest dynamic section read (1 MiB: real ones hold a few dozen entries).
const MAX_DYNAMIC_BYTES: u64 = 1 << 20;
const MIN_ALIGN: u64 = 4096;
/// `DT_RELRSZ` and `DT_RELR` (glibc 2.36; goblin names neither).
const DT_RELRSZ: u64 = 35;
const DT_RELR: u64 = 36;

fn end(start: u64, len: u64, what: &str) -> Result<u64> {
    start
        .checked_add(len)
        .ok_or_else(|| invalid(format_args!("{what} overflows the address space")))
}

/// The load segment holding `[offset, offset + filesz)` of the file at
/// `[vaddr, vaddr + filesz)` of memory.
fn holder(loads: &[ProgramHeader], offset: u64, vaddr: u64, filesz: u64) -> Option<&ProgramHeader> {
    loads.iter().find(|l| {
        offset >= l.p_offset
            && vaddr >= l.p_vaddr
            && offset - l.p_offset == vaddr - l.p_vaddr
            && matches!(offset.checked_add(filesz), Some(e) if e <= l.p_offset + l.p_filesz)
    })
}

/// The load segment whose memory image holds `[vaddr, vaddr + len)`.
fn mem_holder(loads: &[ProgramHeader], vaddr: u64, len: u64) -> Option<&ProgramHeader> {
    loads.iter().find(|l| {
        vaddr >= l.p_vaddr
            && matches!(vaddr.checked_add(len), Some(e) if e <= l.p_vaddr + l.p_memsz)
    })
}

/// Check what the dynamic loader relies on (see the module docs). The
/// section table must already have passed [`super::elf::parse_elf`].
pub fn check_loadable(src: &mut dyn Ranges) -> Result<()> {
    let size = src.size();
    let head = src.gather(&[(0, SIZEOF_EHDR as u64)])?.remove(0);
    let h = parse_header(&head, size)?;
    let phoff = h.e_phoff;
    let phnum = h.e_phnum as u64;
    if h.e_type != ET_DYN {
        return Err(invalid(format_args!(
            "e_type is {}, a shared object is ET_DYN (3)",
            h.e_type
        )));
    }
    if phnum == 0 {
        return Ok(());
    }
    if h.e_phentsize as usize != SIZEOF_PHDR {
        return Err(invalid(format_args!(
            "e_phentsize is {}, not 56",
            h.e_phentsize
        )));
    }
    let table_len = phnum * SIZEOF_PHDR as u64;
    if !inside(size, phoff, table_len) {
        return Err(invalid("the program header table lies outside the file"));
    }
    let mut ranges = vec![(phoff, table_len)];
    ranges.extend(section_ranges(&h));
    let mut got = src.gather(&ranges)?.into_iter();
    let table = got.next().expect("the program header table");
    let sections = sections(&got.collect::<Vec<_>>())?;
    let phs = table
        .chunks(SIZEOF_PHDR)
        .map(|p| read(p, "program header"))
        .collect::<Result<Vec<ProgramHeader>>>()?;

    let loads: Vec<ProgramHeader> = phs
        .iter()
        .copied()
        .filter(|p| p.p_type == PT_LOAD)
        .collect();
    if loads.is_empty() {
        return Err(invalid("no PT_LOAD segment"));
    }
    let mut previous_end = 0u64;
    for (i, l) in loads.iter().enumerate() {
        if l.p_filesz > l.p_memsz {
            return Err(invalid(format_args!(
                "PT_LOAD {i} has p_filesz {} over p_memsz {}",
                l.p_filesz, l.p_memsz
            )));
        }
        if !inside(size, l.p_offset, l.p_filesz) {
            return Err(invalid(format_args!(
                "PT_LOAD {i} file bytes lie outside the file"
            )));
        }
        if !l.p_align.is_power_of_two() || l.p_align < MIN_ALIGN {
            return Err(invalid(format_args!(
                "PT_LOAD {i} has p_align {:#x}, not a power of two of at least {MIN_ALIGN:#x}",
                l.p_align
            )));
        }
        if l.p_vaddr % l.p_align != l.p_offset % l.p_align {
            return Err(invalid(format_args!(
                "PT_LOAD {i} has p_vaddr and p_offset not congruent modulo p_align"
            )));
        }
        let seg_end = end(l.p_vaddr, l.p_memsz, "a PT_LOAD segment")?;
        if i > 0 && l.p_vaddr < previous_end {
            return Err(invalid(format_args!(
                "PT_LOAD {i} is out of order or overlaps the previous segment"
            )));
        }
        previous_end = seg_end;
    }
    let mut seen = [0u32; 3];
    let mut dynamic = None;
    for (i, p) in phs.iter().enumerate() {
        let counter = match p.p_type {
            PT_INTERP => return Err(invalid("a shared object with PT_INTERP")),
            PT_DYNAMIC => Some(0),
            PT_TLS => Some(1),
            PT_GNU_RELRO => Some(2),
            _ => None,
        };
        if let Some(c) = counter {
            seen[c] += 1;
            if seen[c] > 1 {
                return Err(invalid(format_args!(
                    "program header {i}: a second segment of type {:#x}",
                    p.p_type
                )));
            }
        }
        let contained = matches!(
            p.p_type,
            PT_DYNAMIC
                | PT_PHDR
                | PT_NOTE
                | PT_TLS
                | PT_GNU_EH_FRAME
                | PT_GNU_PROPERTY
                | PT_GNU_RELRO
        );
        if !contained {
            continue;
        }
        if p.p_filesz > p.p_memsz {
            return Err(invalid(format_args!(
                "program header {i} has p_filesz over p_memsz"
            )));
        }
        let Some(l) = holder(&loads, p.p_offset, p.p_vaddr, p.p_filesz) else {
            return Err(invalid(format_args!(
                "program header {i} (type {:#x}) does not lie inside a PT_LOAD segment",
                p.p_type
            )));
        };
        if p.p_type != PT_TLS && mem_holder(&loads, p.p_vaddr, p.p_memsz).is_none() {
            return Err(invalid(format_args!(
                "program header {i} (type {:#x}) extends past its PT_LOAD segment",
                p.p_type
            )));
        }
        if p.p_type == PT_TLS && !(p.p_align == 0 || p.p_align.is_power_of_two()) {
            return Err(invalid(
                "PT_TLS has an alignment that is not a power of two",
            ));
        }
        if p.p_type == PT_DYNAMIC {
            if l.p_flags & PF_W == 0 {
                return Err(invalid("PT_DYNAMIC lies in a read-only segment"));
            }
            if p.p_filesz == 0 || p.p_filesz % 16 != 0 || p.p_filesz > MAX_DYNAMIC_BYTES {
                return Err(invalid(format_args!(
                    "PT_DYNAMIC has size {}, not a positive multiple of 16 up to {MAX_DYNAMIC_BYTES}",
                    p.p_filesz
                )));
            }
            dynamic = Some(*p);
        }
    }

    for (i, sh) in sections.iter().enumerate() {
        let (kind, flags, addr) = (sh.sh_type, sh.sh_flags, sh.sh_addr);
        let (offset, len) = (sh.sh_offset, sh.sh_size);
        if kind == SHT_DYNAMIC {
            let matches = dynamic
                .is_some_and(|d| d.p_offset == offset && d.p_vaddr == addr && d.p_filesz == len);
            if !matches {
                return Err(invalid(format_args!(
                    "section {i} (SHT_DYNAMIC) does not match PT_DYNAMIC"
                )));
            }
        }
        if flags & SHF_ALLOC as u64 == 0 || len == 0 {
            continue;
        }
        let segment = if kind == SHT_NOBITS {
            if flags & SHF_TLS as u64 != 0 {
                continue;
            }
            mem_holder(&loads, addr, len)
        } else {
            holder(&loads, offset, addr, len)
        };
        let Some(l) = segment else {
            return Err(invalid(format_args!(
                "allocated section {i} does not lie inside a PT_LOAD segment"
            )));
        };
        if flags & SHF_WRITE as u64 != 0 && l.p_flags & PF_W == 0 {
            return Err(invalid(format_args!(
                "writable section {i} lies in a read-only segment"
            )));
        }
        if flags & SHF_EXECINSTR as u64 != 0 && l.p_flags & PF_X == 0 {
            return Err(invalid(format_args!(
                "code section {i} lies in a segment that is not executable"
            )));
        }
    }

    if let Some(d) = dynamic {
        let bytes = src.gather(&[(d.p_offset, d.p_filesz)])?.remove(0);
        check_dynamic(&bytes, &loads)?;
    }
    Ok(())
}

/// The dynamic entries: terminated, addresses inside segments, sized tables
/// inside file bytes, ELF64 entry sizes, string offsets inside the table.
fn check_dynamic(bytes: &[u8], loads: &[ProgramHeader]) -> Result<()> {
    let mut entries: Vec<(u64, u64)> = Vec::new();
    let mut terminated = false;
    for e in bytes.chunks_exact(SIZEOF_DYN) {
        let d: Dyn = read(e, "dynamic entry")?;
        if d.d_tag == DT_NULL {
            terminated = true;
            break;
        }
        entries.push((d.d_tag, d.d_val));
    }
    if !terminated {
        return Err(invalid("the dynamic section has no DT_NULL"));
    }
    let get = |tag: u64| entries.iter().rev().find(|e| e.0 == tag).map(|e| e.1);
    // Addresses the loader dereferences.
    const ADDRESSES: [u64; 16] = [
        goblin::elf::dynamic::DT_PLTGOT,
        DT_HASH,
        DT_STRTAB,
        DT_SYMTAB,
        DT_RELA,
        DT_INIT,
        DT_FINI,
        DT_REL,
        DT_JMPREL,
        DT_INIT_ARRAY,
        DT_FINI_ARRAY,
        DT_PREINIT_ARRAY,
        DT_GNU_HASH,
        DT_VERSYM,
        DT_VERDEF,
        DT_VERNEED,
    ];
    for &(tag, val) in &entries {
        if ADDRESSES.contains(&tag) && mem_holder(loads, val, 1).is_none() {
            return Err(invalid(format_args!(
                "dynamic entry {tag:#x} points at {val:#x}, outside every segment"
            )));
        }
    }
    // (address tag, size tag): tables read from the file image.
    for (at, sz) in [
        (DT_STRTAB, DT_STRSZ),
        (DT_RELA, DT_RELASZ),
        (DT_REL, DT_RELSZ),
        (DT_JMPREL, DT_PLTRELSZ),
        (DT_INIT_ARRAY, DT_INIT_ARRAYSZ),
        (DT_FINI_ARRAY, DT_FINI_ARRAYSZ),
        (DT_RELR, DT_RELRSZ),
    ] {
        let (Some(addr), size) = (get(at), get(sz)) else {
            continue;
        };
        let size = size.unwrap_or(0);
        let in_file = loads.iter().any(|l| {
            addr >= l.p_vaddr
                && matches!(addr.checked_add(size), Some(e) if e <= l.p_vaddr + l.p_filesz)
        });
        if !in_file {
            return Err(invalid(format_args!(
                "dynamic table {at:#x} of {size} bytes at {addr:#x} lies outside the file image"
            )));
        }
    }
    for (tag, want) in [(DT_RELAENT, 24u64), (DT_SYMENT, 24), (DT_RELENT, 16)] {
        if let Some(v) = get(tag) {
            if v != want {
                return Err(invalid(format_args!(
                    "dynamic entry {tag:#x} is {v}, expected {want}"
                )));
            }
        }
    }
    if let Some(v) = get(DT_PLTREL) {
        if v != DT_RELA && v != DT_REL {
            return Err(invalid(format_args!("DT_PLTREL is {v}")));
        }
    }
    let strsz = get(DT_STRSZ).unwrap_or(0);
    for &(tag, val) in &entries {
        if matches!(tag, DT_NEEDED | DT_SONAME | DT_RPATH | DT_RUNPATH) && val >= strsz {
            return Err(invalid(format_args!(
                "dynamic entry {tag:#x} names string offset {val}, outside the {strsz}-byte table"
            )));
        }
    }
    Ok(())
}
