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

use super::elf::{stream, Reopen};
use crate::error::{Code, Error, Result};

fn invalid(what: impl std::fmt::Display) -> Error {
    Error::new(Code::ArtifactElfInvalid, format!("ELF: {what}"))
}

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

const ET_DYN: u16 = 3;
const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const PT_INTERP: u32 = 3;
const PT_NOTE: u32 = 4;
const PT_PHDR: u32 = 6;
const PT_TLS: u32 = 7;
const PT_GNU_EH_FRAME: u32 = 0x6474_e550;
const PT_GNU_RELRO: u32 = 0x6474_e552;
const PT_GNU_PROPERTY: u32 = 0x6474_e553;
const PF_X: u32 = 1;
const PF_W: u32 = 2;
const SHF_WRITE: u64 = 1;
const SHF_ALLOC: u64 = 2;
const SHF_EXECINSTR: u64 = 4;
const SHF_TLS: u64 = 0x400;
const SHT_NOBITS: u32 = 8;
const SHT_DYNAMIC: u32 = 6;
/// Largest dynamic section read (1 MiB: real ones hold a few dozen entries).
const MAX_DYNAMIC_BYTES: u64 = 1 << 20;
const MIN_ALIGN: u64 = 4096;

#[derive(Debug, Clone, Copy)]
struct Ph {
    kind: u32,
    flags: u32,
    offset: u64,
    vaddr: u64,
    filesz: u64,
    memsz: u64,
    align: u64,
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn end(start: u64, len: u64, what: &str) -> Result<u64> {
    start
        .checked_add(len)
        .ok_or_else(|| invalid(format_args!("{what} overflows the address space")))
}

/// The load segment holding `[offset, offset + filesz)` of the file at
/// `[vaddr, vaddr + filesz)` of memory.
fn holder(loads: &[Ph], offset: u64, vaddr: u64, filesz: u64) -> Option<&Ph> {
    loads.iter().find(|l| {
        offset >= l.offset
            && vaddr >= l.vaddr
            && offset - l.offset == vaddr - l.vaddr
            && matches!(offset.checked_add(filesz), Some(e) if e <= l.offset + l.filesz)
    })
}

/// The load segment whose memory image holds `[vaddr, vaddr + len)`.
fn mem_holder(loads: &[Ph], vaddr: u64, len: u64) -> Option<&Ph> {
    loads.iter().find(|l| {
        vaddr >= l.vaddr && matches!(vaddr.checked_add(len), Some(e) if e <= l.vaddr + l.memsz)
    })
}

/// Check what the dynamic loader relies on (see the module docs). The
/// section table must already have passed [`super::elf::parse_elf`].
pub fn check_loadable(src: &mut dyn Ranges) -> Result<()> {
    let size = src.size();
    let head = src.gather(&[(0, 64)])?.remove(0);
    let e_type = le16(&head, 0x10);
    let phoff = le64(&head, 0x20);
    let shoff = le64(&head, 0x28);
    let phentsize = le16(&head, 0x36) as u64;
    let phnum = le16(&head, 0x38) as u64;
    let shentsize = le16(&head, 0x3a) as u64;
    let shnum = le16(&head, 0x3c) as u64;
    if e_type != ET_DYN {
        return Err(invalid(format_args!(
            "e_type is {e_type}, a shared object is ET_DYN (3)"
        )));
    }
    if phnum == 0 {
        return Ok(());
    }
    if phentsize != 56 {
        return Err(invalid(format_args!("e_phentsize is {phentsize}, not 56")));
    }
    if !inside(size, phoff, phnum * 56) {
        return Err(invalid("the program header table lies outside the file"));
    }
    let mut ranges = vec![(phoff, phnum * 56)];
    // Section headers up to sh_size (+0x28); parse_elf checked the table.
    ranges.extend((0..shnum).map(|i| (shoff + i * shentsize, 0x28)));
    let mut got = src.gather(&ranges)?.into_iter();
    let table = got.next().expect("the program header table");
    let sections: Vec<Vec<u8>> = got.collect();
    let phs: Vec<Ph> = table
        .chunks(56)
        .map(|p| Ph {
            kind: le32(p, 0),
            flags: le32(p, 4),
            offset: le64(p, 8),
            vaddr: le64(p, 0x10),
            filesz: le64(p, 0x20),
            memsz: le64(p, 0x28),
            align: le64(p, 0x30),
        })
        .collect();

    let loads: Vec<Ph> = phs.iter().copied().filter(|p| p.kind == PT_LOAD).collect();
    if loads.is_empty() {
        return Err(invalid("no PT_LOAD segment"));
    }
    let mut previous_end = 0u64;
    for (i, l) in loads.iter().enumerate() {
        if l.filesz > l.memsz {
            return Err(invalid(format_args!(
                "PT_LOAD {i} has p_filesz {} over p_memsz {}",
                l.filesz, l.memsz
            )));
        }
        if !inside(size, l.offset, l.filesz) {
            return Err(invalid(format_args!(
                "PT_LOAD {i} file bytes lie outside the file"
            )));
        }
        if !l.align.is_power_of_two() || l.align < MIN_ALIGN {
            return Err(invalid(format_args!(
                "PT_LOAD {i} has p_align {:#x}, not a power of two of at least {MIN_ALIGN:#x}",
                l.align
            )));
        }
        if l.vaddr % l.align != l.offset % l.align {
            return Err(invalid(format_args!(
                "PT_LOAD {i} has p_vaddr and p_offset not congruent modulo p_align"
            )));
        }
        let seg_end = end(l.vaddr, l.memsz, "a PT_LOAD segment")?;
        if i > 0 && l.vaddr < previous_end {
            return Err(invalid(format_args!(
                "PT_LOAD {i} is out of order or overlaps the previous segment"
            )));
        }
        previous_end = seg_end;
    }
    let mut seen = [0u32; 3];
    let mut dynamic = None;
    for (i, p) in phs.iter().enumerate() {
        let counter = match p.kind {
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
                    p.kind
                )));
            }
        }
        let contained = matches!(
            p.kind,
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
        if p.filesz > p.memsz {
            return Err(invalid(format_args!(
                "program header {i} has p_filesz over p_memsz"
            )));
        }
        let Some(l) = holder(&loads, p.offset, p.vaddr, p.filesz) else {
            return Err(invalid(format_args!(
                "program header {i} (type {:#x}) does not lie inside a PT_LOAD segment",
                p.kind
            )));
        };
        if p.kind != PT_TLS && mem_holder(&loads, p.vaddr, p.memsz).is_none() {
            return Err(invalid(format_args!(
                "program header {i} (type {:#x}) extends past its PT_LOAD segment",
                p.kind
            )));
        }
        if p.kind == PT_TLS && !(p.align == 0 || p.align.is_power_of_two()) {
            return Err(invalid(
                "PT_TLS has an alignment that is not a power of two",
            ));
        }
        if p.kind == PT_DYNAMIC {
            if l.flags & PF_W == 0 {
                return Err(invalid("PT_DYNAMIC lies in a read-only segment"));
            }
            if p.filesz == 0 || p.filesz % 16 != 0 || p.filesz > MAX_DYNAMIC_BYTES {
                return Err(invalid(format_args!(
                    "PT_DYNAMIC has size {}, not a positive multiple of 16 up to {MAX_DYNAMIC_BYTES}",
                    p.filesz
                )));
            }
            dynamic = Some(*p);
        }
    }

    for (i, sh) in sections.iter().enumerate() {
        let kind = le32(sh, 4);
        let flags = le64(sh, 8);
        let addr = le64(sh, 0x10);
        let offset = le64(sh, 0x18);
        let len = le64(sh, 0x20);
        if kind == SHT_DYNAMIC {
            let matches =
                dynamic.is_some_and(|d| d.offset == offset && d.vaddr == addr && d.filesz == len);
            if !matches {
                return Err(invalid(format_args!(
                    "section {i} (SHT_DYNAMIC) does not match PT_DYNAMIC"
                )));
            }
        }
        if flags & SHF_ALLOC == 0 || len == 0 {
            continue;
        }
        let segment = if kind == SHT_NOBITS {
            if flags & SHF_TLS != 0 {
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
        if flags & SHF_WRITE != 0 && l.flags & PF_W == 0 {
            return Err(invalid(format_args!(
                "writable section {i} lies in a read-only segment"
            )));
        }
        if flags & SHF_EXECINSTR != 0 && l.flags & PF_X == 0 {
            return Err(invalid(format_args!(
                "code section {i} lies in a segment that is not executable"
            )));
        }
    }

    if let Some(d) = dynamic {
        let bytes = src.gather(&[(d.offset, d.filesz)])?.remove(0);
        check_dynamic(&bytes, &loads)?;
    }
    Ok(())
}

const DT_NULL: u64 = 0;

/// The dynamic entries: terminated, addresses inside segments, sized tables
/// inside file bytes, ELF64 entry sizes, string offsets inside the table.
fn check_dynamic(bytes: &[u8], loads: &[Ph]) -> Result<()> {
    let mut entries: Vec<(u64, u64)> = Vec::new();
    let mut terminated = false;
    for e in bytes.chunks_exact(16) {
        let (tag, val) = (le64(e, 0), le64(e, 8));
        if tag == DT_NULL {
            terminated = true;
            break;
        }
        entries.push((tag, val));
    }
    if !terminated {
        return Err(invalid("the dynamic section has no DT_NULL"));
    }
    let get = |tag: u64| entries.iter().rev().find(|e| e.0 == tag).map(|e| e.1);
    // Addresses the loader dereferences.
    const ADDRESSES: [u64; 16] = [
        3,
        4,
        5,
        6,
        7,
        12,
        13,
        17,
        23,
        25,
        26,
        32,
        0x6fff_fef5,
        0x6fff_fff0,
        0x6fff_fffc,
        0x6fff_fffe,
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
        (5, 10),
        (7, 8),
        (17, 18),
        (23, 2),
        (25, 27),
        (26, 28),
        (36, 35),
    ] {
        let (Some(addr), size) = (get(at), get(sz)) else {
            continue;
        };
        let size = size.unwrap_or(0);
        let in_file = loads.iter().any(|l| {
            addr >= l.vaddr && matches!(addr.checked_add(size), Some(e) if e <= l.vaddr + l.filesz)
        });
        if !in_file {
            return Err(invalid(format_args!(
                "dynamic table {at:#x} of {size} bytes at {addr:#x} lies outside the file image"
            )));
        }
    }
    for (tag, want) in [(9u64, 24u64), (11, 24), (19, 16)] {
        if let Some(v) = get(tag) {
            if v != want {
                return Err(invalid(format_args!(
                    "dynamic entry {tag:#x} is {v}, expected {want}"
                )));
            }
        }
    }
    if let Some(v) = get(20) {
        if v != 7 && v != 17 {
            return Err(invalid(format_args!("DT_PLTREL is {v}")));
        }
    }
    let strsz = get(10).unwrap_or(0);
    for &(tag, val) in &entries {
        if matches!(tag, 1 | 14 | 15 | 29) && val >= strsz {
            return Err(invalid(format_args!(
                "dynamic entry {tag:#x} names string offset {val}, outside the {strsz}-byte table"
            )));
        }
    }
    Ok(())
}
