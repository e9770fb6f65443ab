//! A bounded ELF64 little-endian section-table reader (SPEC-v1 §8.6), the
//! machine table (§8.7) and the C++-runtime test of a shared object.
//!
//! The structures are decoded by `goblin` (its ELF64 `Header`,
//! `SectionHeader` and `Sym`, read with `scroll`); what stays here are the
//! acceptance rules goblin does not apply (only ELF64 little-endian, the
//! section table inside the file, a bounded `SHT_STRTAB` name table, names
//! NUL-terminated UTF-8) and the bounds on what is read, so memory and time
//! stay linear in the file. Every offset is computed with checked arithmetic;
//! every refusal is `artifact.elf_invalid`.

use std::collections::BTreeMap;
use std::io::Read;

use goblin::elf::header::{
    EI_CLASS, EI_DATA, EI_VERSION, ELFCLASS64, ELFDATA2LSB, ELFMAG, EV_CURRENT,
};
use goblin::elf64::header::{Header, SIZEOF_EHDR};
use goblin::elf64::section_header::{SectionHeader, SIZEOF_SHDR};
use scroll::{Pread, LE};

use crate::error::{Code, Error, Result};

/// `SHT_NULL`.
pub const SHT_NULL: u32 = goblin::elf::section_header::SHT_NULL;
/// `SHT_PROGBITS`.
pub const SHT_PROGBITS: u32 = goblin::elf::section_header::SHT_PROGBITS;
/// `SHT_STRTAB`.
pub const SHT_STRTAB: u32 = goblin::elf::section_header::SHT_STRTAB;
/// `SHT_NOBITS`.
pub const SHT_NOBITS: u32 = goblin::elf::section_header::SHT_NOBITS;
/// Largest section-name string table accepted (16 MiB).
pub const MAX_STRTAB_BYTES: u64 = 16 * 1024 * 1024;

/// The `e_machine` value that a recorded `host_isa.machine` requires, or
/// `None` for a machine outside the table (§8.7).
pub fn expected_e_machine(machine: &str) -> Option<u16> {
    use goblin::elf::header::{EM_AARCH64, EM_LOONGARCH, EM_PPC64, EM_RISCV, EM_X86_64};
    match machine {
        "x86_64" => Some(EM_X86_64),
        "aarch64" => Some(EM_AARCH64),
        "ppc64le" => Some(EM_PPC64),
        "riscv64" => Some(EM_RISCV),
        "loongarch64" => Some(EM_LOONGARCH),
        _ => None,
    }
}

/// What the verifier needs from a shared object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElfInfo {
    /// `e_machine`.
    pub machine: u16,
    /// `e_flags` (a cubin's SM lives there).
    pub flags: u32,
    /// Total section size per section name (duplicate names aggregate).
    pub section_sizes: BTreeMap<String, u64>,
}

impl ElfInfo {
    /// Total size of the sections named `name` (0 when there is none).
    pub fn section_size(&self, name: &str) -> u64 {
        self.section_sizes.get(name).copied().unwrap_or(0)
    }
}

pub(super) fn invalid(what: impl std::fmt::Display) -> Error {
    Error::new(Code::ArtifactElfInvalid, format!("ELF: {what}"))
}

fn slice(b: &[u8], off: u64, len: u64) -> Result<&[u8]> {
    let end = off
        .checked_add(len)
        .filter(|&e| e <= b.len() as u64)
        .ok_or_else(|| invalid(format_args!("range {off}+{len} lies outside the file")))?;
    Ok(&b[off as usize..end as usize])
}

/// Decode one ELF64 little-endian structure at the start of `bytes`.
pub(super) fn read<'a, T, E>(bytes: &'a [u8], what: &str) -> Result<T>
where
    T: scroll::ctx::TryFromCtx<'a, scroll::Endian, Error = E>,
    E: From<scroll::Error> + std::fmt::Display,
{
    bytes
        .pread_with(0, LE)
        .map_err(|e| invalid(format_args!("cannot read the {what}: {e}")))
}

/// The ELF header of a file of `size` bytes whose first bytes are `head`,
/// with the acceptance rules of §8.6 applied: ELF64, little-endian, version 1,
/// a section table of at least one 64-byte entry inside the file.
pub(super) fn parse_header(head: &[u8], size: u64) -> Result<Header> {
    if size < SIZEOF_EHDR as u64 || head.len() < SIZEOF_EHDR {
        return Err(invalid(format_args!(
            "file is {size} bytes, shorter than an ELF64 header"
        )));
    }
    if &head[..4] != ELFMAG {
        return Err(invalid("bad magic"));
    }
    if head[EI_CLASS] != ELFCLASS64 {
        return Err(invalid(format_args!(
            "EI_CLASS is {}, only ELF64 (2) is accepted",
            head[EI_CLASS]
        )));
    }
    if head[EI_DATA] != ELFDATA2LSB {
        return Err(invalid(format_args!(
            "EI_DATA is {}, only little-endian (1) is accepted",
            head[EI_DATA]
        )));
    }
    if head[EI_VERSION] != EV_CURRENT {
        return Err(invalid(format_args!(
            "EI_VERSION is {}, expected 1",
            head[EI_VERSION]
        )));
    }
    let h: Header = read(head, "ELF header")?;
    if h.e_shoff < SIZEOF_EHDR as u64 {
        return Err(invalid(format_args!(
            "e_shoff {} lies inside the ELF header",
            h.e_shoff
        )));
    }
    if h.e_shnum == 0 {
        return Err(invalid(
            "e_shnum is 0 (extended section numbering is unsupported)",
        ));
    }
    if (h.e_shentsize as usize) < SIZEOF_SHDR {
        return Err(invalid(format_args!(
            "e_shentsize {} is smaller than 64",
            h.e_shentsize
        )));
    }
    if h.e_shstrndx >= h.e_shnum {
        return Err(invalid(format_args!(
            "e_shstrndx {} is not below e_shnum {}",
            h.e_shstrndx, h.e_shnum
        )));
    }
    let table_end = (h.e_shentsize as u64)
        .checked_mul(h.e_shnum as u64)
        .and_then(|t| t.checked_add(h.e_shoff))
        .ok_or_else(|| invalid("section table size overflows"))?;
    if table_end > size {
        return Err(invalid(format_args!(
            "section table ends at {table_end}, past the end of the {size}-byte file"
        )));
    }
    Ok(h)
}

/// The `(offset, length)` of each section header of `h` (length 64: the
/// fields of an ELF64 section header; a larger `e_shentsize` pads).
pub(super) fn section_ranges(h: &Header) -> Vec<(u64, u64)> {
    (0..h.e_shnum as u64)
        .map(|i| (h.e_shoff + i * h.e_shentsize as u64, SIZEOF_SHDR as u64))
        .collect()
}

/// Decode the section headers gathered at [`section_ranges`].
pub(super) fn sections(raw: &[Vec<u8>]) -> Result<Vec<SectionHeader>> {
    raw.iter().map(|b| read(b, "section header")).collect()
}

/// The range of the section-name string table, checked (§8.6).
fn strtab_range(h: &Header, size: u64, sections: &[SectionHeader]) -> Result<(u64, u64)> {
    let st = &sections[h.e_shstrndx as usize];
    if st.sh_type != SHT_STRTAB {
        return Err(invalid(format_args!(
            "section name table has type {}, expected SHT_STRTAB",
            st.sh_type
        )));
    }
    if st.sh_size == 0 || st.sh_size > MAX_STRTAB_BYTES {
        return Err(invalid(format_args!(
            "section name table size {} is not in 1..=16 MiB",
            st.sh_size
        )));
    }
    match st.sh_offset.checked_add(st.sh_size) {
        Some(end) if end <= size => Ok((st.sh_offset, st.sh_size)),
        _ => Err(invalid("section name table lies outside the file")),
    }
}

/// The NUL-terminated string at `start` of a string table, or `None` when
/// `start` lies outside it or the string has no NUL.
pub(super) fn string_at(table: &[u8], start: usize) -> Option<&[u8]> {
    let rest = table.get(start..)?;
    let nul = memchr::memchr(0, rest)?;
    Some(&rest[..nul])
}

fn finish(h: &Header, size: u64, sections: &[SectionHeader], strtab: &[u8]) -> Result<ElfInfo> {
    let mut section_sizes: BTreeMap<String, u64> = BTreeMap::new();
    for (i, sh) in sections.iter().enumerate() {
        if sh.sh_type != SHT_NULL && sh.sh_type != SHT_NOBITS {
            let inside = matches!(sh.sh_offset.checked_add(sh.sh_size), Some(e) if e <= size);
            if !inside {
                return Err(invalid(format_args!("section {i} lies outside the file")));
            }
        }
        let start = sh.sh_name as usize;
        if start >= strtab.len() {
            return Err(invalid(format_args!(
                "section {i} name offset {start} lies outside the string table"
            )));
        }
        let name = string_at(strtab, start)
            .ok_or_else(|| invalid(format_args!("section {i} name is not NUL-terminated")))?;
        let name = std::str::from_utf8(name)
            .map_err(|_| invalid(format_args!("section {i} name is not UTF-8")))?;
        if name == ".lrodata" && sh.sh_type != SHT_PROGBITS {
            return Err(invalid(format_args!(
                ".lrodata section {i} has type {}, expected PROGBITS",
                sh.sh_type
            )));
        }
        let total = section_sizes.entry(name.to_owned()).or_insert(0);
        *total = total.saturating_add(sh.sh_size);
    }
    Ok(ElfInfo {
        machine: h.e_machine,
        flags: h.e_flags,
        section_sizes,
    })
}

/// Parse the section table of an ELF64 little-endian file held in memory
/// (§8.6).
pub fn parse_elf(b: &[u8]) -> Result<ElfInfo> {
    let size = b.len() as u64;
    let h = parse_header(b, size)?;
    let raw = section_ranges(&h)
        .into_iter()
        .map(|(off, len)| slice(b, off, len).map(<[u8]>::to_vec))
        .collect::<Result<Vec<_>>>()?;
    let sections = sections(&raw)?;
    let (off, len) = strtab_range(&h, size, &sections)?;
    finish(&h, size, &sections, slice(b, off, len)?)
}

/// Copy the part of `chunk` (at file offset `at`) that falls in
/// `[start, start + dst.len())` into `dst`.
fn capture(chunk: &[u8], at: u64, start: u64, dst: &mut [u8]) {
    let lo = at.max(start);
    let hi = (at + chunk.len() as u64).min(start + dst.len() as u64);
    if lo < hi {
        dst[(lo - start) as usize..(hi - start) as usize]
            .copy_from_slice(&chunk[(lo - at) as usize..(hi - at) as usize]);
    }
}

/// Stream `src` to its end, handing each chunk and its file offset to `f`;
/// the stream must hold exactly `size` bytes.
pub(super) fn stream(src: &mut dyn Read, size: u64, f: &mut dyn FnMut(&[u8], u64)) -> Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.raw_os_error().is_some() => {
                return Err(Error::io("cannot read package member", &e))
            }
            Err(e) => {
                return Err(Error::new(
                    Code::ArtifactPackageZip,
                    format!("cannot read package member: {e}"),
                ))
            }
        };
        f(&buf[..n], at);
        at += n as u64;
    }
    if at != size {
        return Err(Error::new(
            Code::ArtifactPackageZip,
            format!("cannot read package member: it holds {at} bytes, not the declared {size}"),
        ));
    }
    Ok(())
}

/// A way to read a stream from its start, as often as asked: it calls the
/// given function with the stream.
pub type Reopen<'a> = &'a mut dyn FnMut(&mut dyn FnMut(&mut dyn Read) -> Result<()>) -> Result<()>;

/// Parse an ELF64 file of `size` bytes read as a stream, in bounded memory:
/// one pass for the header and the section headers (reading the whole stream,
/// so its CRC is checked), and a second for the name table.
pub fn parse_elf_stream(size: u64, reopen: Reopen<'_>) -> Result<ElfInfo> {
    let mut head = [0u8; SIZEOF_EHDR];
    let mut header: Option<Result<Header>> = None;
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    let mut raw: Vec<Vec<u8>> = Vec::new();
    reopen(&mut |src| {
        stream(src, size, &mut |chunk, at| {
            capture(chunk, at, 0, &mut head);
            if header.is_none() && at + chunk.len() as u64 >= SIZEOF_EHDR as u64 {
                let h = parse_header(&head, size);
                if let Ok(h) = &h {
                    // At most 65535 entries of 64 bytes: 4 MiB.
                    ranges = section_ranges(h);
                    raw = vec![vec![0u8; SIZEOF_SHDR]; ranges.len()];
                }
                header = Some(h);
            }
            for (dst, &(start, _)) in raw.iter_mut().zip(&ranges) {
                if start >= at + chunk.len() as u64 {
                    break;
                }
                capture(chunk, at, start, dst);
            }
        })
    })?;
    let h = header.unwrap_or_else(|| parse_header(&head, size))?;
    let sections = sections(&raw)?;
    let (off, len) = strtab_range(&h, size, &sections)?;
    let mut strtab = vec![0u8; len as usize];
    reopen(&mut |src| {
        stream(src, size, &mut |chunk, at| {
            capture(chunk, at, off, &mut strtab)
        })
    })?;
    finish(&h, size, &sections, &strtab)
}

/// A minimal valid ELF64 little-endian shared object for tests and the
/// adversarial corpus: a NULL section, `.lrodata` (PROGBITS) of
/// `lrodata_size` bytes and `.shstrtab`.
pub fn synthetic_elf(machine: u16, lrodata_size: usize) -> Vec<u8> {
    let strtab: &[u8] = b"\0.lrodata\0.shstrtab\0";
    let data_off = 64u64;
    let str_off = data_off + lrodata_size as u64;
    let shoff = (str_off + strtab.len() as u64).next_multiple_of(8);
    let mut b = vec![0u8; shoff as usize + 3 * 64];
    b[..4].copy_from_slice(b"\x7fELF");
    b[4] = 2;
    b[5] = 1;
    b[6] = 1;
    b[0x10..0x12].copy_from_slice(&3u16.to_le_bytes()); // ET_DYN
    b[0x12..0x14].copy_from_slice(&machine.to_le_bytes());
    b[0x14..0x18].copy_from_slice(&1u32.to_le_bytes());
    b[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
    b[0x34..0x36].copy_from_slice(&64u16.to_le_bytes());
    b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    b[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
    b[0x3e..0x40].copy_from_slice(&2u16.to_le_bytes());
    for (i, x) in b[64..64 + lrodata_size].iter_mut().enumerate() {
        *x = i as u8;
    }
    b[str_off as usize..str_off as usize + strtab.len()].copy_from_slice(strtab);
    let mut sh = |i: usize, name: u32, kind: u32, off: u64, size: u64| {
        let at = shoff as usize + i * 64;
        b[at..at + 4].copy_from_slice(&name.to_le_bytes());
        b[at + 4..at + 8].copy_from_slice(&kind.to_le_bytes());
        b[at + 0x18..at + 0x20].copy_from_slice(&off.to_le_bytes());
        b[at + 0x20..at + 0x28].copy_from_slice(&size.to_le_bytes());
    };
    sh(1, 1, SHT_PROGBITS, data_off, lrodata_size as u64);
    sh(2, 10, SHT_STRTAB, str_off, strtab.len() as u64);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synthetic_object_parses() {
        let info = parse_elf(&synthetic_elf(62, 100)).unwrap();
        assert_eq!(info.machine, 62);
        assert_eq!(info.section_size(".lrodata"), 100);
        assert_eq!(info.section_size(".shstrtab"), 20);
    }

    #[test]
    fn the_stream_parser_agrees_with_the_slice_parser() {
        let good = synthetic_elf(62, 3000);
        let mut bad = good.clone();
        bad[0x3e..0x40].copy_from_slice(&3u16.to_le_bytes());
        for (i, b) in [good, bad, vec![0x7f; 10]].iter().enumerate() {
            let mut reopen = |f: &mut dyn FnMut(&mut dyn Read) -> Result<()>| f(&mut &b[..]);
            let streamed = parse_elf_stream(b.len() as u64, &mut reopen);
            match (parse_elf(b), streamed) {
                (Ok(x), Ok(y)) => assert_eq!(x, y),
                (Err(x), Err(y)) => assert_eq!(x.message(), y.message(), "case {i}"),
                (x, y) => panic!("case {i}: {x:?} vs {y:?}"),
            }
        }
    }

    struct Trickle<'a>(&'a [u8]);

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.0.len().min(buf.len()).min(7);
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    #[test]
    fn the_stream_parser_handles_any_chunking_and_checks_the_length() {
        let good = synthetic_elf(183, 1000);
        let mut reopen = |f: &mut dyn FnMut(&mut dyn Read) -> Result<()>| f(&mut Trickle(&good));
        assert_eq!(
            parse_elf_stream(good.len() as u64, &mut reopen).unwrap(),
            parse_elf(&good).unwrap()
        );
        let err = parse_elf_stream(good.len() as u64 + 1, &mut reopen).unwrap_err();
        assert_eq!(err.code(), Code::ArtifactPackageZip);
    }

    #[test]
    fn refusals_are_elf_invalid() {
        let good = synthetic_elf(62, 16);
        let mut cases: Vec<Vec<u8>> = vec![good[..63].to_vec()];
        let mut c = good.clone();
        c[4] = 1;
        cases.push(c);
        let mut c = good.clone();
        c[5] = 2;
        cases.push(c);
        let mut c = good.clone();
        c[0x3c..0x3e].copy_from_slice(&0u16.to_le_bytes());
        cases.push(c);
        let mut c = good.clone();
        c[0x3e..0x40].copy_from_slice(&3u16.to_le_bytes());
        cases.push(c);
        let mut c = good.clone();
        c[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        cases.push(c);
        cases.push(good[..good.len() - 1].to_vec());
        for (i, case) in cases.iter().enumerate() {
            assert_eq!(
                parse_elf(case).unwrap_err().code(),
                Code::ArtifactElfInvalid,
                "case {i}"
            );
        }
    }
}
