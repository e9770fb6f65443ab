//! Resource-bound shapes (docs/FORMAT.md "Resource bounds"): inflation bombs
//! in the wrapper and in a cubin, padding that made the wrapper scan
//! quadratic, corrupted program headers, and, generated at test time because
//! they are large, a zip of more entries than allowed and a high-ratio
//! envelope.

use flate2::{Compress, Compression, Crc, FlushCompress};

use super::fixtures::*;
use super::Case;
use tcg_core::artifact::package::wrapper::synthetic_wrapper;

/// A zip member given as its stored bytes, for members whose stored and
/// declared sizes differ (deflate).
pub struct RawMember {
    pub name: String,
    pub stored: Vec<u8>,
    pub method: u16,
    pub size: u64,
    pub crc: u32,
}

impl RawMember {
    pub fn plain(m: &ZipMember) -> RawMember {
        RawMember {
            name: String::from_utf8(m.name.clone()).unwrap(),
            stored: m.data.clone(),
            method: 0,
            size: m.data.len() as u64,
            crc: crc32(&m.data),
        }
    }
}

/// A zip of raw members; past 65,535 entries the end records are zip64.
pub fn zip_raw(members: &[RawMember]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    let p16 = |v: &mut Vec<u8>, x: u16| v.extend_from_slice(&x.to_le_bytes());
    let p32 = |v: &mut Vec<u8>, x: u32| v.extend_from_slice(&x.to_le_bytes());
    for m in members {
        let offset = out.len() as u32;
        let (csize, size) = (m.stored.len() as u32, m.size as u32);
        p32(&mut out, 0x0403_4b50);
        for x in [20, 0x0800, m.method, 0, 0x21] {
            p16(&mut out, x);
        }
        for x in [m.crc, csize, size] {
            p32(&mut out, x);
        }
        p16(&mut out, m.name.len() as u16);
        p16(&mut out, 0);
        out.extend_from_slice(m.name.as_bytes());
        out.extend_from_slice(&m.stored);
        p32(&mut central, 0x0201_4b50);
        for x in [20, 20, 0x0800, m.method, 0, 0x21] {
            p16(&mut central, x);
        }
        for x in [m.crc, csize, size] {
            p32(&mut central, x);
        }
        for x in [m.name.len() as u16, 0, 0, 0, 0] {
            p16(&mut central, x);
        }
        p32(&mut central, 0);
        p32(&mut central, offset);
        central.extend_from_slice(m.name.as_bytes());
    }
    let cd_offset = out.len() as u64;
    let n = members.len() as u64;
    out.extend_from_slice(&central);
    if n > 0xffff {
        let eocd64 = out.len() as u64;
        p32(&mut out, 0x0606_4b50);
        out.extend_from_slice(&44u64.to_le_bytes());
        p16(&mut out, 45);
        p16(&mut out, 45);
        p32(&mut out, 0);
        p32(&mut out, 0);
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&(central.len() as u64).to_le_bytes());
        out.extend_from_slice(&cd_offset.to_le_bytes());
        p32(&mut out, 0x0706_4b50);
        p32(&mut out, 0);
        out.extend_from_slice(&eocd64.to_le_bytes());
        p32(&mut out, 1);
    }
    let n16 = n.min(0xffff) as u16;
    p32(&mut out, 0x0605_4b50);
    out.extend_from_slice(&[0, 0, 0, 0]);
    p16(&mut out, n16);
    p16(&mut out, n16);
    p32(&mut out, central.len() as u32);
    p32(&mut out, cd_offset as u32);
    p16(&mut out, 0);
    out
}

/// A raw deflate stream of `mib` MiB of zeros, its CRC-32 and length: one
/// fully flushed block of 1 MiB repeated (each block stands alone), then an
/// empty final block. Cheap to make whatever its inflated size.
pub fn zero_bomb(mib: u64) -> (Vec<u8>, u32, u64) {
    let zeros = vec![0u8; 1 << 20];
    let mut c = Compress::new(Compression::best(), false);
    let mut block = Vec::with_capacity(8 << 10);
    c.compress_vec(&zeros, &mut block, FlushCompress::Full)
        .unwrap();
    assert_eq!(c.total_in(), 1 << 20);
    let mut stream = Vec::with_capacity(block.len() * mib as usize + 2);
    let mut one = Crc::new();
    one.update(&zeros);
    let mut crc = Crc::new();
    for _ in 0..mib {
        stream.extend_from_slice(&block);
        crc.combine(&one);
    }
    stream.extend_from_slice(&[0x03, 0x00]);
    (stream, crc.sum(), mib << 20)
}

fn bomb_member(name: &str, mib: u64) -> RawMember {
    let (stored, crc, size) = zero_bomb(mib);
    RawMember {
        name: name.into(),
        stored,
        method: 8,
        size,
        crc,
    }
}

/// The base package's members with `f` applied, as raw members.
fn base_raw(f: impl FnOnce(&mut Vec<RawMember>)) -> Vec<u8> {
    let mut ms: Vec<RawMember> = package_members(&table_a(), false, small_so())
        .iter()
        .map(RawMember::plain)
        .collect();
    f(&mut ms);
    zip_raw(&ms)
}

/// A wrapper of base A followed by `n` lines of unterminated assignments and
/// one repeated assignment, which the scan reaches only past the padding.
pub fn padded_wrapper(n: usize) -> String {
    let mut s = synthetic_wrapper(false, &table_a());
    for _ in 0..n {
        s.push_str("constants_info_[1].name = \"constants_info_[1].shape = {constants_info_[1].original_fqn = \"\n");
    }
    s.push_str("    constants_info_[0].data_size = 64;\n");
    s
}

/// A small shared object with one program header table: a PT_LOAD over
/// the whole file and the header given by `extra`.
pub fn elf_with_phdrs(edit: impl FnOnce(&mut Vec<[u64; 7]>)) -> Vec<u8> {
    let mut so = small_so();
    let phoff = so.len().next_multiple_of(8);
    so.resize(phoff, 0);
    // (type | flags << 32, offset, vaddr, paddr, filesz, memsz, align)
    let size = (phoff + 2 * 56) as u64;
    let mut phs: Vec<[u64; 7]> = vec![[1 | (5 << 32), 0, 0, 0, size, size, 0x1000]];
    edit(&mut phs);
    for p in &phs {
        so.extend_from_slice(&(p[0] as u32).to_le_bytes());
        so.extend_from_slice(&((p[0] >> 32) as u32).to_le_bytes());
        for v in &p[1..] {
            so.extend_from_slice(&v.to_le_bytes());
        }
    }
    so[0x20..0x28].copy_from_slice(&(phoff as u64).to_le_bytes());
    so[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
    so[0x38..0x3a].copy_from_slice(&(phs.len() as u16).to_le_bytes());
    so
}

pub fn cases(b: &Bases, add: Add<'_>) {
    let pe = |pkg: Vec<u8>| env(&b.md_a, &pkg, None);
    add(
        "bound-wrapper-bomb.tar.gz",
        Some("artifact.package_member_too_large"),
        "the wrapper inflates to 1 GiB",
        pe(base_raw(|ms| ms[1] = bomb_member(WRAPPER, 1024))),
    );
    add(
        "bound-so-ratio.tar.gz",
        Some("artifact.inflation_ratio"),
        "the .so inflates about 1000:1 to 128 MiB",
        pe(base_raw(|ms| ms[2] = bomb_member(SO, 128))),
    );
    let md_cpu = metadata_sm(&table_a(), false, "cpu-x86-64-v3");
    add(
        "bound-cubin-bomb-cpu.tar.gz",
        Some("artifact.cubin_arch_mismatch"),
        "a 1 GiB cubin in a CPU artifact",
        env(
            md_cpu.bytes(),
            &base_raw(|ms| {
                ms.push(bomb_member(
                    "model/data/aotinductor/denoiser/h=64,w=64/k.cubin",
                    1024,
                ))
            }),
            None,
        ),
    );
    add(
        "bound-wrapper-padding.tar.gz",
        Some("artifact.wrapper_parse"),
        "4 MiB of unterminated assignments before a repeated one",
        pe(base_raw(|ms| {
            let w = padded_wrapper(45_000);
            ms[1] = RawMember::plain(&zm(WRAPPER, w));
        })),
    );
    let phdr = |what: &str, f: &dyn Fn(&mut Vec<[u64; 7]>)| {
        let so = elf_with_phdrs(|p| f(p));
        (
            what.to_owned(),
            pe(base_raw(|ms| ms[2] = RawMember::plain(&zm(SO, so)))),
        )
    };
    for (file, (what, bytes)) in [
        (
            "elf-phdr-load-past-end.tar.gz",
            phdr("a PT_LOAD past the end of the file", &|p| p[0][4] += 4096),
        ),
        (
            "elf-phdr-interp.tar.gz",
            phdr("a PT_INTERP in a shared object", &|p| {
                p.push([3 | (4 << 32), 0, 0, 0, 1, 1, 1])
            }),
        ),
        (
            "elf-phdr-dynamic-outside.tar.gz",
            phdr("PT_DYNAMIC outside every PT_LOAD", &|p| {
                p.push([2 | (6 << 32), 0, 0x10_0000, 0, 16, 16, 8])
            }),
        ),
        (
            "elf-phdr-align.tar.gz",
            phdr("a PT_LOAD alignment that is not a power of two", &|p| {
                p[0][6] = 0x3000
            }),
        ),
    ] {
        add(file, Some("artifact.elf_invalid"), &what, bytes);
    }
}

/// Large shapes, made at test time and never committed.
pub fn generated(b: &Bases) -> Vec<Case> {
    let mut out = Vec::new();
    // One entry more than the cap (the count needs the zip64 end records).
    let n = tcg_core::artifact::MAX_PACKAGE_ENTRIES as usize + 1;
    let pkg = base_raw(|ms| {
        for i in ms.len()..n {
            ms.push(RawMember::plain(&zm(&format!("x/{i:06}"), "")));
        }
    });
    out.push(Case {
        file: "gen-too-many-entries.tar.gz".into(),
        code: Some("artifact.package_too_many_entries"),
        what: format!("a package zip of {n} entries"),
        bytes: env(&b.md_a, &pkg, None),
    });
    // A 256 MiB model.pt2 of zeros: the envelope inflates ~1000:1.
    out.push(Case {
        file: "gen-high-ratio.tar.gz".into(),
        code: Some("artifact.inflation_ratio"),
        what: "an envelope whose model.pt2 is 256 MiB of zeros".into(),
        bytes: high_ratio_envelope(&b.md_a, 256),
    });
    out
}

/// An envelope whose `model.pt2` member is `mib` MiB of zeros, made without
/// compressing them: the tar head compressed with a full flush, then the
/// repeated zero block, then the tail.
pub fn high_ratio_envelope(md: &[u8], mib: u64) -> Vec<u8> {
    use tcg_core::artifact::tar;
    let mut head = member("metadata.json", md);
    head.extend_from_slice(&tar::header("model.pt2", mib << 20));
    let tail = finish_tar(Vec::new());
    let mut c = Compress::new(Compression::best(), false);
    let mut out = tcg_core::artifact::gzip::GZIP_HEADER.to_vec();
    let mut buf = Vec::with_capacity(head.len() + 1024);
    c.compress_vec(&head, &mut buf, FlushCompress::Full)
        .unwrap();
    out.extend_from_slice(&buf);
    let (zeros, _, _) = zero_bomb(mib);
    // Without the bomb's empty final block: the tail's blocks follow.
    out.extend_from_slice(&zeros[..zeros.len() - 2]);
    let mut c2 = Compress::new(Compression::best(), false);
    let mut end = Vec::with_capacity(tail.len() + 1024);
    c2.compress_vec(&tail, &mut end, FlushCompress::Finish)
        .unwrap();
    out.extend_from_slice(&end);
    let mut crc = Crc::new();
    crc.update(&head);
    let mut one = Crc::new();
    one.update(&vec![0u8; 1 << 20]);
    for _ in 0..mib {
        crc.combine(&one);
    }
    crc.update(&tail);
    let total = head.len() as u64 + (mib << 20) + tail.len() as u64;
    out.extend_from_slice(&crc.sum().to_le_bytes());
    out.extend_from_slice(&(total as u32).to_le_bytes());
    out
}
