//! A bounded ELF64 little-endian section-table reader (SPEC-v1 §8.6) and the
//! machine table (§8.7). Every offset is computed with checked arithmetic;
//! every refusal is `artifact.elf_invalid`.

use std::collections::BTreeMap;

use crate::error::{Code, Error, Result};

/// `SHT_NULL`.
pub const SHT_NULL: u32 = 0;
/// `SHT_PROGBITS`.
pub const SHT_PROGBITS: u32 = 1;
/// `SHT_STRTAB`.
pub const SHT_STRTAB: u32 = 3;
/// `SHT_NOBITS`.
pub const SHT_NOBITS: u32 = 8;
/// Largest section-name string table accepted (16 MiB).
pub const MAX_STRTAB_BYTES: u64 = 16 * 1024 * 1024;

/// The `e_machine` value that a recorded `host_isa.machine` requires, or
/// `None` for a machine outside the table (§8.7).
pub fn expected_e_machine(machine: &str) -> Option<u16> {
    match machine {
        "x86_64" => Some(62),
        "aarch64" => Some(183),
        "ppc64le" => Some(21),
        "riscv64" => Some(243),
        "loongarch64" => Some(258),
        _ => None,
    }
}

/// What the verifier needs from a shared object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElfInfo {
    /// `e_machine`.
    pub machine: u16,
    /// Total section size per section name (duplicate names aggregate).
    pub section_sizes: BTreeMap<String, u64>,
}

impl ElfInfo {
    /// Total size of the sections named `name` (0 when there is none).
    pub fn section_size(&self, name: &str) -> u64 {
        self.section_sizes.get(name).copied().unwrap_or(0)
    }
}

fn invalid(what: impl std::fmt::Display) -> Error {
    Error::new(Code::ArtifactElfInvalid, format!("ELF: {what}"))
}

fn u16_at(b: &[u8], off: u64) -> Result<u16> {
    let s = slice(b, off, 2)?;
    Ok(u16::from_le_bytes([s[0], s[1]]))
}

fn u32_at(b: &[u8], off: u64) -> Result<u32> {
    let s = slice(b, off, 4)?;
    Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

fn u64_at(b: &[u8], off: u64) -> Result<u64> {
    let s = slice(b, off, 8)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Ok(u64::from_le_bytes(a))
}

fn slice(b: &[u8], off: u64, len: u64) -> Result<&[u8]> {
    let end = off
        .checked_add(len)
        .filter(|&e| e <= b.len() as u64)
        .ok_or_else(|| invalid(format_args!("range {off}+{len} lies outside the file")))?;
    Ok(&b[off as usize..end as usize])
}

/// Parse the section table of an ELF64 little-endian file (§8.6).
pub fn parse_elf(b: &[u8]) -> Result<ElfInfo> {
    let size = b.len() as u64;
    if size < 64 {
        return Err(invalid(format_args!(
            "file is {size} bytes, shorter than an ELF64 header"
        )));
    }
    if &b[..4] != b"\x7fELF" {
        return Err(invalid("bad magic"));
    }
    if b[4] != 2 {
        return Err(invalid(format_args!(
            "EI_CLASS is {}, only ELF64 (2) is accepted",
            b[4]
        )));
    }
    if b[5] != 1 {
        return Err(invalid(format_args!(
            "EI_DATA is {}, only little-endian (1) is accepted",
            b[5]
        )));
    }
    if b[6] != 1 {
        return Err(invalid(format_args!("EI_VERSION is {}, expected 1", b[6])));
    }
    let machine = u16_at(b, 0x12)?;
    let shoff = u64_at(b, 0x28)?;
    let shentsize = u16_at(b, 0x3a)? as u64;
    let shnum = u16_at(b, 0x3c)? as u64;
    let shstrndx = u16_at(b, 0x3e)? as u64;
    if shoff < 64 {
        return Err(invalid(format_args!(
            "e_shoff {shoff} lies inside the ELF header"
        )));
    }
    if shnum == 0 {
        return Err(invalid(
            "e_shnum is 0 (extended section numbering is unsupported)",
        ));
    }
    if shentsize < 64 {
        return Err(invalid(format_args!(
            "e_shentsize {shentsize} is smaller than 64"
        )));
    }
    if shstrndx >= shnum {
        return Err(invalid(format_args!(
            "e_shstrndx {shstrndx} is not below e_shnum {shnum}"
        )));
    }
    let table_end = shentsize
        .checked_mul(shnum)
        .and_then(|t| t.checked_add(shoff))
        .ok_or_else(|| invalid("section table size overflows"))?;
    if table_end > size {
        return Err(invalid(format_args!(
            "section table ends at {table_end}, past the end of the {size}-byte file"
        )));
    }
    struct Sh {
        name: u32,
        kind: u32,
        offset: u64,
        size: u64,
    }
    let mut sections = Vec::with_capacity(shnum as usize);
    for i in 0..shnum {
        let at = shoff + i * shentsize;
        sections.push(Sh {
            name: u32_at(b, at)?,
            kind: u32_at(b, at + 4)?,
            offset: u64_at(b, at + 0x18)?,
            size: u64_at(b, at + 0x20)?,
        });
    }
    let st = &sections[shstrndx as usize];
    if st.kind != SHT_STRTAB {
        return Err(invalid(format_args!(
            "section name table has type {}, expected SHT_STRTAB",
            st.kind
        )));
    }
    if st.size == 0 || st.size > MAX_STRTAB_BYTES {
        return Err(invalid(format_args!(
            "section name table size {} is not in 1..=16 MiB",
            st.size
        )));
    }
    let strtab = slice(b, st.offset, st.size)
        .map_err(|_| invalid("section name table lies outside the file"))?;
    let mut section_sizes: BTreeMap<String, u64> = BTreeMap::new();
    for (i, sh) in sections.iter().enumerate() {
        if sh.kind != SHT_NULL && sh.kind != SHT_NOBITS {
            let inside = matches!(sh.offset.checked_add(sh.size), Some(e) if e <= size);
            if !inside {
                return Err(invalid(format_args!("section {i} lies outside the file")));
            }
        }
        let start = sh.name as usize;
        if start >= strtab.len() {
            return Err(invalid(format_args!(
                "section {i} name offset {start} lies outside the string table"
            )));
        }
        let rest = &strtab[start..];
        let nul = rest
            .iter()
            .position(|&c| c == 0)
            .ok_or_else(|| invalid(format_args!("section {i} name is not NUL-terminated")))?;
        let name = std::str::from_utf8(&rest[..nul])
            .map_err(|_| invalid(format_args!("section {i} name is not UTF-8")))?;
        if name == ".lrodata" && sh.kind != SHT_PROGBITS {
            return Err(invalid(format_args!(
                ".lrodata section {i} has type {}, expected PROGBITS",
                sh.kind
            )));
        }
        let total = section_sizes.entry(name.to_owned()).or_insert(0);
        *total = total.saturating_add(sh.size);
    }
    Ok(ElfInfo {
        machine,
        section_sizes,
    })
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
