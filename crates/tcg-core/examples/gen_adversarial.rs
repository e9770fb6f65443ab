//! Generate the adversarial envelope corpus of `testdata/adversarial/`
//! (SPEC-v1 §13.4): small malformed envelopes, each refused with a recorded
//! code, and two valid bases they derive from. Deterministic.
//!
//! ```text
//! cargo run -p tcg-core --example gen_adversarial            # write the corpus
//! ```
//!
//! `tests/artifact_adversarial.rs` includes this file to check that the
//! committed corpus equals the generator's output.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use tcg_cj::{Map, Value};
use tcg_core::artifact::envelope::envelope_bytes;
use tcg_core::artifact::gzip::GzipWriter;
use tcg_core::artifact::literals::{payload_bytes, LiteralTensor};
use tcg_core::artifact::metadata::{build_metadata, ConstantRow, Metadata};
use tcg_core::artifact::package::elf::synthetic_elf;
use tcg_core::artifact::package::wrapper::{synthetic_wrapper, WrapperConstant};
use tcg_core::artifact::tar;
use tcg_core::host_isa::HostIsa;
use tcg_core::identity::{literal_digest, DeclarationInput, GraphClassDeclaration, LiteralRow};

/// One corpus file.
pub struct Case {
    /// File name under `testdata/adversarial/`.
    pub file: String,
    /// The expected error code, or `None` for a valid base.
    pub code: Option<&'static str>,
    /// What is wrong with it.
    pub what: String,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// The graph class name of the bases (also the package entry).
pub const ENTRY: &str = "denoiser/h=64,w=64";

// ---------------------------------------------------------------- zip ----

/// A zip member for the hand-made writer (stored data).
#[derive(Clone)]
pub struct ZipMember {
    pub name: Vec<u8>,
    pub data: Vec<u8>,
    pub method: u16,
    pub flags: u16,
    pub crc: Option<u32>,
}

pub fn zm(name: &str, data: impl Into<Vec<u8>>) -> ZipMember {
    ZipMember {
        name: name.as_bytes().to_vec(),
        data: data.into(),
        method: 0,
        flags: 0x0800,
        crc: None,
    }
}

fn crc32(b: &[u8]) -> u32 {
    let mut c = flate2::Crc::new();
    c.update(b);
    c.sum()
}

/// A deterministic zip of stored members (local headers, central directory,
/// end record).
pub fn zip(members: &[ZipMember]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    for m in members {
        let offset = out.len() as u32;
        let crc = m.crc.unwrap_or_else(|| crc32(&m.data));
        let size = m.data.len() as u32;
        let p16 = |v: &mut Vec<u8>, x: u16| v.extend_from_slice(&x.to_le_bytes());
        let p32 = |v: &mut Vec<u8>, x: u32| v.extend_from_slice(&x.to_le_bytes());
        p32(&mut out, 0x0403_4b50);
        for x in [20, m.flags, m.method, 0, 0x21] {
            p16(&mut out, x);
        }
        for x in [crc, size, size] {
            p32(&mut out, x);
        }
        p16(&mut out, m.name.len() as u16);
        p16(&mut out, 0);
        out.extend_from_slice(&m.name);
        out.extend_from_slice(&m.data);
        p32(&mut central, 0x0201_4b50);
        for x in [20, 20, m.flags, m.method, 0, 0x21] {
            p16(&mut central, x);
        }
        for x in [crc, size, size] {
            p32(&mut central, x);
        }
        for x in [m.name.len() as u16, 0, 0, 0, 0] {
            p16(&mut central, x);
        }
        p32(&mut central, 0);
        p32(&mut central, offset);
        central.extend_from_slice(&m.name);
    }
    let cd_offset = out.len() as u32;
    out.extend_from_slice(&central);
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&(members.len() as u16).to_le_bytes());
    out.extend_from_slice(&(members.len() as u16).to_le_bytes());
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&cd_offset.to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out
}

// ------------------------------------------------------------ package ----

fn wc(
    index: u64,
    name: &str,
    ty: &str,
    dtype: &str,
    shape: &[u64],
    data_size: u64,
) -> WrapperConstant {
    WrapperConstant {
        index,
        name: name.replace('.', "_"),
        original_fqn: Some(name.to_owned()),
        data_size,
        from_folded: ty == "FoldedConstant",
        constant_type: ty.to_owned(),
        dtype: dtype.to_owned(),
        shape: shape.to_vec(),
    }
}

/// The constant table of base A (no literals).
pub fn table_a() -> Vec<WrapperConstant> {
    vec![
        wc(0, "w.weight", "Parameter", "float32", &[4, 4], 64),
        wc(1, "w.bias", "Buffer", "float32", &[4], 64),
    ]
}

/// The constant table of base B (two literals besides a parameter).
pub fn table_b() -> Vec<WrapperConstant> {
    vec![
        wc(0, "w.weight", "Parameter", "float32", &[4, 4], 64),
        wc(1, "table", "TensorConstant", "float32", &[2, 2], 64),
        wc(2, "idx", "TensorConstant", "int64", &[3], 64),
    ]
}

const WRAPPER: &str = "model/data/aotinductor/denoiser/h=64,w=64/cabc.wrapper.cpp";
const SO: &str = "model/data/aotinductor/denoiser/h=64,w=64/cabc.wrapper.so";

/// The package members: archive format marker, wrapper and `.so`.
pub fn package_members(table: &[WrapperConstant], blob: bool, so: Vec<u8>) -> Vec<ZipMember> {
    vec![
        zm("model/archive_format", "pt2"),
        zm(WRAPPER, synthetic_wrapper(blob, table)),
        zm(SO, so),
    ]
}

pub fn small_so() -> Vec<u8> {
    synthetic_elf(62, 16)
}

pub fn package(table: &[WrapperConstant]) -> Vec<u8> {
    zip(&package_members(table, false, small_so()))
}

// ----------------------------------------------------------- metadata ----

fn parse(s: &str) -> Value {
    tcg_cj::parse_strict(s.as_bytes()).unwrap()
}

pub fn host_v3() -> HostIsa {
    HostIsa {
        machine: "x86_64".into(),
        host_isa_level: "x86-64-v3".into(),
        host_isa_features:
            "abm,avx,avx2,bmi1,bmi2,cx16,f16c,fma,lahf_lm,movbe,popcnt,sse4_1,sse4_2,ssse3,xsave"
                .into(),
        cpp_march: "x86-64-v3".into(),
        cpp_simdlen: "256".into(),
    }
}

/// The literal tensors of base B.
pub fn literal_tensors() -> Vec<LiteralTensor> {
    let table: Vec<u8> = [1f32, 2., 3., 4.]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let idx: Vec<u8> = [7i64, -1, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
    vec![
        LiteralTensor {
            fqn: "table".into(),
            dtype: "float32".into(),
            shape: vec![2, 2],
            bytes: table,
        },
        LiteralTensor {
            fqn: "idx".into(),
            dtype: "int64".into(),
            shape: vec![3],
            bytes: idx,
        },
    ]
}

fn literal_values() -> String {
    let rows: Vec<LiteralRow> = literal_tensors()
        .into_iter()
        .map(|t| LiteralRow {
            name: t.fqn,
            dtype: format!("torch.{}", t.dtype),
            shape: t.shape,
            bytes: t.bytes,
        })
        .collect();
    literal_digest(&rows).unwrap()
}

pub fn metadata(table: &[WrapperConstant], literals: bool) -> Metadata {
    let mut graph = parse(r#"{"constant_fqns":[],"lifted_inputs":[],"pytree":{"in":"leaf","out":"leaf"},"specialization":{},"v":3}"#)
        .as_object()
        .unwrap()
        .clone();
    let mut fqns: Vec<Value> = table
        .iter()
        .map(|c| Value::Str(c.fqn().to_owned()))
        .collect();
    fqns.sort_by(|a, b| a.as_str().cmp(&b.as_str()));
    graph.insert("constant_fqns".into(), Value::Array(fqns));
    let lv = if literals {
        literal_values()
    } else {
        String::new()
    };
    if literals {
        graph.insert("literal_values".into(), Value::Str(lv.clone()));
    }
    let decl = GraphClassDeclaration::new(DeclarationInput {
        graph_class: ENTRY.into(),
        target: "unet".into(),
        graph: Value::Object(graph),
        graph_witness: "fedcba9876543210".into(),
        range_digest: "0123456789abcdef0123456789abcdef".into(),
        literal_values: Value::Str(lv),
        ..DeclarationInput::default()
    })
    .unwrap();
    let rows: Vec<ConstantRow> = table.iter().map(WrapperConstant::row).collect();
    let toolchain = parse(r#"{"torch":"record-digest","triton":"compiler-digest"}"#);
    build_metadata(&decl, &rows, "sm_89", &toolchain, &host_v3()).unwrap()
}

// ---------------------------------------------------------- envelopes ----

pub fn gzip(tar_stream: &[u8]) -> Vec<u8> {
    let mut gz = GzipWriter::new(Vec::new()).unwrap();
    gz.write(tar_stream).unwrap();
    gz.finish().unwrap()
}

/// Header, data and padding of one member.
pub fn member_with(h: [u8; 512], data: &[u8]) -> Vec<u8> {
    let mut v = h.to_vec();
    v.extend_from_slice(data);
    v.resize(v.len() + tar::padding(data.len() as u64), 0);
    v
}

pub fn member(name: &str, data: &[u8]) -> Vec<u8> {
    member_with(tar::header(name, data.len() as u64), data)
}

/// Two end blocks and record padding after `body`.
pub fn finish_tar(mut body: Vec<u8>) -> Vec<u8> {
    body.resize(body.len() + 1024, 0);
    let pad = tar::record_padding(body.len() as u64) as usize;
    body.resize(body.len() + pad, 0);
    body
}

fn recheck(mut h: [u8; 512]) -> [u8; 512] {
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| b as u32).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    h
}

/// A member whose header is edited by `f` (checksum recomputed).
pub fn edited(name: &str, data: &[u8], f: impl FnOnce(&mut [u8; 512])) -> Vec<u8> {
    let mut h = tar::header(name, data.len() as u64);
    f(&mut h);
    member_with(recheck(h), data)
}

struct Bases {
    md_a: Vec<u8>,
    pkg_a: Vec<u8>,
    md_b: Vec<u8>,
    pkg_b: Vec<u8>,
    lit_b: Vec<u8>,
}

fn bases() -> Bases {
    Bases {
        md_a: metadata(&table_a(), false).bytes().to_vec(),
        pkg_a: package(&table_a()),
        md_b: metadata(&table_b(), true).bytes().to_vec(),
        pkg_b: package(&table_b()),
        lit_b: payload_bytes(&literal_tensors()).unwrap(),
    }
}

fn env(md: &[u8], pkg: &[u8], lit: Option<&[u8]>) -> Vec<u8> {
    envelope_bytes(md, pkg, lit).unwrap()
}

/// Edit metadata as a value and re-encode it canonically.
fn md_edit(md: &[u8], f: impl FnOnce(&mut Map)) -> Vec<u8> {
    let mut m = tcg_cj::parse_strict(md)
        .unwrap()
        .as_object()
        .unwrap()
        .clone();
    f(&mut m);
    tcg_cj::to_canonical(&Value::Object(m)).unwrap()
}

fn sub(m: &mut Map, k: &str, f: impl FnOnce(&mut Map)) {
    let mut inner = m[k].as_object().unwrap().clone();
    f(&mut inner);
    m.insert(k.into(), Value::Object(inner));
}

/// A safetensors payload from a raw header text and data.
fn st(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut v = (h.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(&h);
    v.extend_from_slice(data);
    v
}

fn lit_data() -> Vec<u8> {
    // Writer order: int64 idx (item 8) before float32 table (item 4).
    let t = literal_tensors();
    [t[1].bytes.clone(), t[0].bytes.clone()].concat()
}

fn elf_edit(f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut so = small_so();
    f(&mut so);
    so
}

fn shoff(so: &[u8]) -> usize {
    u64::from_le_bytes(so[0x28..0x30].try_into().unwrap()) as usize
}

/// Every corpus file, in a fixed order.
pub fn cases() -> Vec<Case> {
    let b = bases();
    let mut out: Vec<Case> = Vec::new();
    let mut add = |file: &str, code: Option<&'static str>, what: &str, bytes: Vec<u8>| {
        out.push(Case {
            file: file.into(),
            code,
            what: what.into(),
            bytes,
        });
    };
    let good_a = env(&b.md_a, &b.pkg_a, None);
    let good_b = env(&b.md_b, &b.pkg_b, Some(&b.lit_b));
    add(
        "base.tar.gz",
        None,
        "valid base: two state_dict constants, no literals",
        good_a.clone(),
    );
    add(
        "base-literals.tar.gz",
        None,
        "valid base with two literal constants",
        good_b.clone(),
    );

    // gzip framing (§6.6 steps 2-4)
    let n = good_a.len();
    add(
        "gzip-truncated-body.tar.gz",
        Some("artifact.truncated_gzip"),
        "cut in the deflate body",
        good_a[..n / 2].to_vec(),
    );
    add(
        "gzip-truncated-trailer.tar.gz",
        Some("artifact.truncated_gzip"),
        "last 4 trailer bytes missing",
        good_a[..n - 4].to_vec(),
    );
    add(
        "gzip-header-only.tar.gz",
        Some("artifact.truncated_gzip"),
        "a gzip header and nothing else",
        good_a[..10].to_vec(),
    );
    add(
        "gzip-two-members.tar.gz",
        Some("artifact.gzip_trailing"),
        "two complete gzip members",
        [good_a.clone(), good_a.clone()].concat(),
    );
    add(
        "gzip-empty-second-member.tar.gz",
        Some("artifact.gzip_trailing"),
        "an empty gzip member appended",
        [good_a.clone(), gzip(b"")].concat(),
    );
    add(
        "gzip-trailing-byte.tar.gz",
        Some("artifact.gzip_trailing"),
        "one byte after the trailer",
        [good_a.clone(), b"x".to_vec()].concat(),
    );
    add(
        "gzip-trailing-nul.tar.gz",
        Some("artifact.gzip_trailing"),
        "one NUL after the trailer",
        [good_a.clone(), vec![0]].concat(),
    );
    let mut c = good_a.clone();
    c[n - 8] ^= 1;
    add(
        "gzip-bad-crc.tar.gz",
        Some("artifact.gzip_invalid"),
        "CRC-32 off by one bit",
        c,
    );
    let mut c = good_a.clone();
    c[n - 4] ^= 1;
    add(
        "gzip-bad-isize.tar.gz",
        Some("artifact.gzip_invalid"),
        "ISIZE off by one bit",
        c,
    );
    let mut c = good_a.clone();
    c[10] = 0x07;
    add(
        "gzip-deflate-error.tar.gz",
        Some("artifact.gzip_invalid"),
        "a reserved deflate block type",
        c,
    );
    let mut c = good_a.clone();
    c[3] = 0x08;
    add(
        "gzip-fname-flag.tar.gz",
        Some("artifact.gzip_header"),
        "FLG has FNAME set",
        c,
    );
    let mut c = good_a.clone();
    c[2] = 7;
    add(
        "gzip-method.tar.gz",
        Some("artifact.gzip_header"),
        "CM is not deflate",
        c,
    );
    add(
        "gzip-not-gzip.tar.gz",
        Some("artifact.gzip_header"),
        "plain text",
        b"hello, world\n".to_vec(),
    );
    add(
        "gzip-empty-file.tar.gz",
        Some("artifact.gzip_header"),
        "an empty file",
        Vec::new(),
    );
    add(
        "bare-pt2.tar.gz",
        Some("artifact.bare_pt2"),
        "a bare model.pt2 instead of an envelope",
        b.pkg_a.clone(),
    );
    add(
        "bare-pt2-empty-zip.tar.gz",
        Some("artifact.bare_pt2"),
        "an empty zip (end record only)",
        zip(&[]),
    );

    // tar members (§6.6 step 5)
    let m_md = member("metadata.json", &b.md_a);
    let m_pkg = member("model.pt2", &b.pkg_a);
    let t = |parts: &[&[u8]]| gzip(&finish_tar(parts.concat()));
    let big = |h: &mut [u8; 512]| h[124..136].copy_from_slice(b"00040000001\0");
    let mut hdr = tar::header("metadata.json", 0);
    big(&mut hdr);
    add(
        "tar-oversized-metadata.tar.gz",
        Some("artifact.member_too_large"),
        "metadata declares 8 MiB + 1 bytes",
        gzip(&recheck(hdr)),
    );
    let typed = |flag: u8, name: &str| edited(name, b"", |h| h[156] = flag);
    add(
        "tar-pax-header.tar.gz",
        Some("artifact.tar_member"),
        "a pax extended header first",
        t(&[&typed(b'x', "PaxHeaders/metadata.json"), &m_md, &m_pkg]),
    );
    add(
        "tar-pax-global.tar.gz",
        Some("artifact.tar_member"),
        "a pax global header first",
        t(&[&typed(b'g', "pax_global_header"), &m_md, &m_pkg]),
    );
    add(
        "tar-gnu-longname.tar.gz",
        Some("artifact.tar_member"),
        "a GNU long-name member",
        t(&[&typed(b'L', "././@LongLink"), &m_md, &m_pkg]),
    );
    add(
        "tar-aregtype.tar.gz",
        Some("artifact.tar_member"),
        "metadata with the AREGTYPE NUL typeflag",
        t(&[&edited("metadata.json", &b.md_a, |h| h[156] = 0), &m_pkg]),
    );
    add(
        "tar-symlink.tar.gz",
        Some("artifact.tar_member"),
        "metadata.json is a symlink",
        t(&[
            &edited("metadata.json", b"", |h| {
                h[156] = b'2';
                h[157..166].copy_from_slice(b"/etc/pass");
            }),
            &m_pkg,
        ]),
    );
    add(
        "tar-hardlink.tar.gz",
        Some("artifact.tar_member"),
        "model.pt2 is a hard link",
        t(&[
            &m_md,
            &edited("model.pt2", b"", |h| {
                h[156] = b'1';
                h[157..170].copy_from_slice(b"metadata.json");
            }),
        ]),
    );
    add(
        "tar-directory.tar.gz",
        Some("artifact.tar_member"),
        "a directory member",
        t(&[&typed(b'5', "metadata.json"), &m_pkg]),
    );
    add(
        "tar-dotdot-name.tar.gz",
        Some("artifact.tar_member"),
        "a ../ member name",
        t(&[&member("../metadata.json", &b.md_a), &m_pkg]),
    );
    add(
        "tar-duplicate-metadata.tar.gz",
        Some("artifact.tar_member"),
        "metadata.json twice",
        t(&[&m_md, &m_md, &m_pkg]),
    );
    add(
        "tar-duplicate-model.tar.gz",
        Some("artifact.tar_member"),
        "model.pt2 twice",
        t(&[&m_md, &m_pkg, &m_pkg]),
    );
    add(
        "tar-missing-model.tar.gz",
        Some("artifact.member_missing"),
        "metadata only",
        t(&[&m_md]),
    );
    add(
        "tar-empty-archive.tar.gz",
        Some("artifact.member_missing"),
        "end blocks only",
        t(&[]),
    );
    add(
        "tar-unexpected-member.tar.gz",
        Some("artifact.tar_member"),
        "an extra member after model.pt2",
        t(&[&m_md, &m_pkg, &member("extra.txt", b"x")]),
    );
    add(
        "tar-member-after-literals.tar.gz",
        Some("artifact.tar_member"),
        "an extra member after constants.safetensors",
        gzip(&finish_tar(
            [
                member("metadata.json", &b.md_b),
                member("model.pt2", &b.pkg_b),
                member("constants.safetensors", &b.lit_b),
                member("extra.txt", b"x"),
            ]
            .concat(),
        )),
    );
    add(
        "tar-wrong-order.tar.gz",
        Some("artifact.tar_member"),
        "model.pt2 before metadata.json",
        t(&[&m_pkg, &m_md]),
    );
    add(
        "tar-literals-before-model.tar.gz",
        Some("artifact.tar_member"),
        "constants.safetensors before model.pt2",
        gzip(&finish_tar(
            [
                member("metadata.json", &b.md_b),
                member("constants.safetensors", &b.lit_b),
                member("model.pt2", &b.pkg_b),
            ]
            .concat(),
        )),
    );
    let body = [m_md.clone(), m_pkg.clone()].concat();
    let mut c = finish_tar(body.clone());
    c[body.len() + 700] = 1;
    add(
        "tar-nonzero-end-block.tar.gz",
        Some("artifact.tar_end"),
        "a byte set in the second end block",
        gzip(&c),
    );
    let mut c = finish_tar(body.clone());
    let l = c.len();
    c[l - 1] = 1;
    add(
        "tar-nonzero-record-padding.tar.gz",
        Some("artifact.tar_end"),
        "a byte set in the record padding",
        gzip(&c),
    );
    let mut c = finish_tar(body.clone());
    c[512 + b.md_a.len() + 3] = b'!';
    add(
        "tar-nonzero-member-padding.tar.gz",
        Some("artifact.tar_end"),
        "a byte set in metadata's NUL padding",
        gzip(&c),
    );
    let mut c = finish_tar(body.clone());
    c.extend_from_slice(&[0u8; 10_240]);
    add(
        "tar-extra-record.tar.gz",
        Some("artifact.tar_end"),
        "a further zero record after the end",
        gzip(&c),
    );
    let c = finish_tar(body.clone());
    add(
        "tar-short-record-padding.tar.gz",
        Some("artifact.tar_truncated"),
        "record padding cut short",
        gzip(&c[..c.len() - 512]),
    );
    add(
        "tar-truncated-model.tar.gz",
        Some("artifact.tar_truncated"),
        "model.pt2 data cut short",
        gzip(&body[..body.len() - 700]),
    );
    add(
        "tar-no-end-blocks.tar.gz",
        Some("artifact.tar_truncated"),
        "members without end blocks",
        gzip(&body),
    );

    // tar header fields (§6.2 exactness)
    let hdr_case = |f: &dyn Fn(&mut [u8; 512])| t(&[&edited("metadata.json", &b.md_a, f), &m_pkg]);
    add(
        "hdr-mode.tar.gz",
        Some("artifact.tar_header"),
        "mode 0000755",
        hdr_case(&|h| h[100..108].copy_from_slice(b"0000755\0")),
    );
    add(
        "hdr-uid.tar.gz",
        Some("artifact.tar_header"),
        "uid 0001750",
        hdr_case(&|h| h[108..116].copy_from_slice(b"0001750\0")),
    );
    add(
        "hdr-gid-space.tar.gz",
        Some("artifact.tar_header"),
        "gid terminated by a space",
        hdr_case(&|h| h[116..124].copy_from_slice(b"0000000 ")),
    );
    add(
        "hdr-mtime.tar.gz",
        Some("artifact.tar_header"),
        "a non-zero mtime",
        hdr_case(&|h| h[136..148].copy_from_slice(b"14707444200\0")),
    );
    add(
        "hdr-base256-size.tar.gz",
        Some("artifact.tar_header"),
        "a base-256 size",
        hdr_case(&|h| {
            let n = b.md_a.len() as u64;
            h[124..136].fill(0);
            h[124] = 0x80;
            h[128..136].copy_from_slice(&n.to_be_bytes());
        }),
    );
    add(
        "hdr-size-space.tar.gz",
        Some("artifact.tar_header"),
        "size field terminated by a space",
        hdr_case(&|h| h[135] = b' '),
    );
    add(
        "hdr-uname.tar.gz",
        Some("artifact.tar_header"),
        "uname root",
        hdr_case(&|h| h[265..269].copy_from_slice(b"root")),
    );
    add(
        "hdr-gnu-magic.tar.gz",
        Some("artifact.tar_header"),
        "GNU magic ustar space space",
        hdr_case(&|h| h[257..265].copy_from_slice(b"ustar  \0")),
    );
    add(
        "hdr-prefix.tar.gz",
        Some("artifact.tar_header"),
        "a non-empty prefix",
        hdr_case(&|h| h[345..348].copy_from_slice(b"dir")),
    );
    add(
        "hdr-name-garbage.tar.gz",
        Some("artifact.tar_header"),
        "bytes after the name's NUL",
        hdr_case(&|h| h[60] = b'x'),
    );
    add(
        "hdr-devmajor.tar.gz",
        Some("artifact.tar_header"),
        "devmajor 0000000",
        hdr_case(&|h| h[329..337].copy_from_slice(b"0000000\0")),
    );
    let mut h = tar::header("metadata.json", b.md_a.len() as u64);
    let stated = std::str::from_utf8(&h[148..154]).unwrap().to_owned();
    h[148..156].copy_from_slice(format!("0{stated}\0").as_bytes());
    add(
        "hdr-checksum-format.tar.gz",
        Some("artifact.tar_header"),
        "checksum as 7 digits and NUL",
        t(&[&member_with(h, &b.md_a), &m_pkg]),
    );
    let mut h = tar::header("metadata.json", b.md_a.len() as u64);
    h[153] = if h[153] == b'0' { b'1' } else { b'0' };
    add(
        "hdr-checksum-wrong.tar.gz",
        Some("artifact.tar_header"),
        "checksum value wrong",
        t(&[&member_with(h, &b.md_a), &m_pkg]),
    );

    // metadata (§7.5), with the small package
    let me = |md: Vec<u8>| env(&md, &b.pkg_a, None);
    let text = String::from_utf8(b.md_a.clone()).unwrap();
    add(
        "meta-duplicate-top-key.tar.gz",
        Some("artifact.metadata_json"),
        "kind twice at the top level",
        me(text
            .replacen(
                r#""kind":"aot-inductor","#,
                r#""kind":"aot-inductor","kind":"aot-inductor","#,
                1,
            )
            .into_bytes()),
    );
    add(
        "meta-duplicate-nested-key.tar.gz",
        Some("artifact.metadata_json"),
        "pytree.in twice",
        me(text
            .replacen(r#""in":"leaf","#, r#""in":"leaf","in":"leaf","#, 1)
            .into_bytes()),
    );
    add(
        "meta-non-canonical.tar.gz",
        Some("artifact.metadata_json"),
        "a space after a colon",
        me(text.replacen(r#""sm":"#, r#""sm": "#, 1).into_bytes()),
    );
    add(
        "meta-not-json.tar.gz",
        Some("artifact.metadata_json"),
        "truncated JSON",
        me(b.md_a[..100].to_vec()),
    );
    add(
        "meta-format-float.tar.gz",
        Some("artifact.metadata_format"),
        "compiled_graph_format 1.0",
        me(text
            .replacen(
                r#""compiled_graph_format":1,"#,
                r#""compiled_graph_format":1.0,"#,
                1,
            )
            .into_bytes()),
    );
    add(
        "meta-format-true.tar.gz",
        Some("artifact.metadata_format"),
        "compiled_graph_format true",
        me(md_edit(&b.md_a, |m| {
            m.insert("compiled_graph_format".into(), Value::Bool(true));
        })),
    );
    add(
        "meta-format-2.tar.gz",
        Some("artifact.format_unsupported"),
        "compiled_graph_format 2",
        me(md_edit(&b.md_a, |m| {
            m.insert("compiled_graph_format".into(), Value::Int(2));
        })),
    );
    add(
        "meta-extra-key.tar.gz",
        Some("artifact.metadata_schema"),
        "a tenth top-level member",
        me(md_edit(&b.md_a, |m| {
            m.insert("entry".into(), "x".into());
        })),
    );
    add(
        "meta-kind.tar.gz",
        Some("artifact.metadata_kind"),
        "kind torchscript",
        me(md_edit(&b.md_a, |m| {
            m.insert("kind".into(), "torchscript".into());
        })),
    );
    add(
        "meta-policy.tar.gz",
        Some("artifact.metadata_policy"),
        "package_constants_in_so true",
        me(md_edit(&b.md_a, |m| {
            m.insert("package_constants_in_so".into(), Value::Bool(true));
        })),
    );
    add(
        "meta-host-isa-extra.tar.gz",
        Some("artifact.host_isa_invalid"),
        "host_isa with a sixth member",
        me(md_edit(&b.md_a, |m| {
            sub(m, "host_isa", |h| {
                h.insert("avx512".into(), "yes".into());
            })
        })),
    );
    add(
        "meta-host-isa-non-string.tar.gz",
        Some("artifact.host_isa_invalid"),
        "cpp_simdlen as an integer",
        me(md_edit(&b.md_a, |m| {
            sub(m, "host_isa", |h| {
                h.insert("cpp_simdlen".into(), Value::Int(256));
            })
        })),
    );
    add(
        "meta-host-isa-v4.tar.gz",
        Some("artifact.host_isa_invalid"),
        "level x86-64-v4",
        me(md_edit(&b.md_a, |m| {
            sub(m, "host_isa", |h| {
                h.insert("host_isa_level".into(), "x86-64-v4".into());
                h.insert("cpp_march".into(), "x86-64-v4".into());
            })
        })),
    );
    add(
        "meta-host-isa-missing.tar.gz",
        Some("artifact.metadata_schema"),
        "no host_isa member",
        me(md_edit(&b.md_a, |m| {
            m.remove("host_isa");
        })),
    );
    add(
        "meta-class-hash.tar.gz",
        Some("artifact.class_hash_mismatch"),
        "class_hash of other facts",
        me(md_edit(&b.md_a, |m| {
            sub(m, "graph_class", |g| {
                g.insert("class_hash".into(), "0123456789abcdef".into());
            })
        })),
    );
    add(
        "meta-key.tar.gz",
        Some("artifact.key_mismatch"),
        "a key of other facts",
        me(md_edit(&b.md_a, |m| {
            m.insert(
                "compiled_graph_key".into(),
                "cg-key-v1-00000000000000000000000000000000000000000000000000000000".into(),
            );
        })),
    );
    add(
        "meta-key-shaped-sm.tar.gz",
        Some("artifact.key_mismatch"),
        "sm is itself a key",
        me(md_edit(&b.md_a, |m| {
            m.insert(
                "sm".into(),
                "sm-aefe4c6d52d304f8ef7cc6f9ffae296113b1546defe761e1c12ac2cf".into(),
            );
        })),
    );
    add(
        "meta-declaration.tar.gz",
        Some("artifact.declaration_invalid"),
        "graph_witness not hex",
        me(md_edit(&b.md_a, |m| {
            sub(m, "graph_class", |g| {
                g.insert("graph_witness".into(), "not-hex".into());
            })
        })),
    );
    add(
        "meta-constants-row.tar.gz",
        Some("artifact.constants_invalid"),
        "a constant row with a fifth member",
        me(md_edit(&b.md_a, |m| {
            sub(m, "graph_class", |g| {
                g.insert("constants".into(), parse(r#"[{"dtype":"float32","fqn":"w","shape":[1],"source":"state_dict","x":0}]"#));
            })
        })),
    );
    add(
        "meta-literals-without-payload.tar.gz",
        Some("artifact.literals_mismatch"),
        "literal rows but no constants.safetensors",
        env(&b.md_b, &b.pkg_b, None),
    );
    add(
        "meta-payload-without-literals.tar.gz",
        Some("artifact.literals_mismatch"),
        "constants.safetensors but no literal rows",
        env(&b.md_a, &b.pkg_a, Some(&b.lit_b)),
    );

    // literal payload (§8.8)
    let le = |lit: Vec<u8>| env(&b.md_b, &b.pkg_b, Some(&lit));
    let d = lit_data();
    let hdr = |idx: &str, table: &str| format!(r#"{{"idx":{idx},"table":{table}}}"#);
    let idx_ok = r#"{"data_offsets":[0,24],"dtype":"I64","shape":[3]}"#;
    let table_ok = r#"{"data_offsets":[24,40],"dtype":"F32","shape":[2,2]}"#;
    add(
        "lit-names.tar.gz",
        Some("artifact.literal_payload"),
        "a tensor named tablex",
        le(st(
            &format!(r#"{{"idx":{idx_ok},"tablex":{table_ok}}}"#),
            &d,
        )),
    );
    add(
        "lit-dtype.tar.gz",
        Some("artifact.literal_payload"),
        "table stored as I32",
        le(st(
            &hdr(
                idx_ok,
                r#"{"data_offsets":[24,40],"dtype":"I32","shape":[2,2]}"#,
            ),
            &d,
        )),
    );
    add(
        "lit-shape.tar.gz",
        Some("artifact.literal_payload"),
        "table shape [4]",
        le(st(
            &hdr(
                idx_ok,
                r#"{"data_offsets":[24,40],"dtype":"F32","shape":[4]}"#,
            ),
            &d,
        )),
    );
    add(
        "lit-unsupported-dtype.tar.gz",
        Some("artifact.literal_payload"),
        "dtype F4",
        le(st(
            &hdr(
                idx_ok,
                r#"{"data_offsets":[24,40],"dtype":"F4","shape":[2,2]}"#,
            ),
            &d,
        )),
    );
    add(
        "lit-overlap.tar.gz",
        Some("artifact.literal_payload"),
        "table overlaps idx",
        le(st(
            &hdr(
                idx_ok,
                r#"{"data_offsets":[16,32],"dtype":"F32","shape":[2,2]}"#,
            ),
            &d,
        )),
    );
    add(
        "lit-gap.tar.gz",
        Some("artifact.literal_payload"),
        "8 unclaimed bytes between tensors",
        le(st(
            &hdr(
                idx_ok,
                r#"{"data_offsets":[32,48],"dtype":"F32","shape":[2,2]}"#,
            ),
            &[d.clone(), vec![0; 8]].concat(),
        )),
    );
    add(
        "lit-tail.tar.gz",
        Some("artifact.literal_payload"),
        "an unclaimed tail",
        le(st(
            &hdr(idx_ok, table_ok),
            &[d.clone(), vec![0; 4]].concat(),
        )),
    );
    add(
        "lit-span.tar.gz",
        Some("artifact.literal_payload"),
        "offsets span the wrong byte count",
        le(st(
            &hdr(
                r#"{"data_offsets":[0,20],"dtype":"I64","shape":[3]}"#,
                r#"{"data_offsets":[20,40],"dtype":"F32","shape":[2,2]}"#,
            ),
            &d,
        )),
    );
    add(
        "lit-entry-extra-member.tar.gz",
        Some("artifact.literal_payload"),
        "an entry with a fourth member",
        le(st(
            &hdr(
                idx_ok,
                r#"{"data_offsets":[24,40],"dtype":"F32","offset":0,"shape":[2,2]}"#,
            ),
            &d,
        )),
    );
    add(
        "lit-offsets-past-end.tar.gz",
        Some("artifact.literal_payload"),
        "offsets past the data",
        le(st(
            &hdr(
                idx_ok,
                r#"{"data_offsets":[24,80],"dtype":"F32","shape":[2,2]}"#,
            ),
            &d,
        )),
    );
    let mut c = d.clone();
    c[30] ^= 0x40;
    add(
        "lit-digest.tar.gz",
        Some("artifact.literal_digest_mismatch"),
        "one value changed",
        le(st(&hdr(idx_ok, table_ok), &c)),
    );
    let mut c = b.lit_b.clone();
    let odd = u64::from_le_bytes(c[..8].try_into().unwrap()) - 1;
    c[..8].copy_from_slice(&odd.to_le_bytes());
    add(
        "lit-header-length-odd.tar.gz",
        Some("artifact.literal_payload"),
        "header length not a multiple of 8",
        le(c),
    );
    let mut c = b.lit_b.clone();
    c[..8].copy_from_slice(&(16u64 << 20).to_le_bytes());
    add(
        "lit-header-too-large.tar.gz",
        Some("artifact.literal_payload"),
        "header length 16 MiB",
        le(c),
    );
    let mut c = b.lit_b.clone();
    c[..8].copy_from_slice(&4096u64.to_le_bytes());
    add(
        "lit-header-past-file.tar.gz",
        Some("artifact.literal_payload"),
        "header length beyond the file",
        le(c),
    );
    add(
        "lit-not-json.tar.gz",
        Some("artifact.literal_payload"),
        "header is not JSON",
        le(st("{not json}", &d)),
    );

    // package zip and layout (§8.1-§8.2)
    let pe = |pkg: Vec<u8>| env(&b.md_a, &pkg, None);
    let base_members = package_members(&table_a(), false, small_so());
    let with = |extra: Vec<ZipMember>| {
        let mut v = base_members.clone();
        v.extend(extra);
        zip(&v)
    };
    add(
        "pkg-not-zip.tar.gz",
        Some("artifact.package_zip"),
        "model.pt2 is not a zip",
        pe(b"PK\x03\x04 not really a zip".to_vec()),
    );
    let mut ms = base_members.clone();
    ms[1].crc = Some(0xdead_beef);
    add(
        "pkg-bad-crc.tar.gz",
        Some("artifact.package_zip"),
        "the wrapper's CRC is wrong",
        pe(zip(&ms)),
    );
    add(
        "pkg-duplicate-names.tar.gz",
        Some("artifact.package_zip"),
        "the wrapper twice",
        pe(with(vec![base_members[1].clone()])),
    );
    let mut ms = base_members.clone();
    ms[0].flags |= 1;
    add(
        "pkg-encrypted.tar.gz",
        Some("artifact.package_zip"),
        "an encrypted member",
        pe(zip(&ms)),
    );
    let mut ms = base_members.clone();
    ms[0].method = 12;
    add(
        "pkg-bzip2-method.tar.gz",
        Some("artifact.package_zip"),
        "a bzip2 member",
        pe(zip(&ms)),
    );
    add(
        "pkg-two-roots.tar.gz",
        Some("artifact.package_layout"),
        "members under two AOTInductor roots",
        pe(with(vec![zm(
            "other/data/aotinductor/denoiser/h=64,w=64/x.kernel.cpp",
            "x",
        )])),
    );
    add(
        "pkg-two-wrappers.tar.gz",
        Some("artifact.package_layout"),
        "two wrappers in the entry",
        pe(with(vec![zm(
            "model/data/aotinductor/denoiser/h=64,w=64/cdef.wrapper.cpp",
            synthetic_wrapper(false, &table_a()),
        )])),
    );
    add(
        "pkg-two-so.tar.gz",
        Some("artifact.package_layout"),
        "two shared objects in the entry",
        pe(with(vec![zm(
            "model/data/aotinductor/denoiser/h=64,w=64/cdef.so",
            small_so(),
        )])),
    );
    let mut ms = base_members.clone();
    ms.remove(2);
    add(
        "pkg-missing-so.tar.gz",
        Some("artifact.package_layout"),
        "no shared object",
        pe(zip(&ms)),
    );
    add(
        "pkg-unsafe-entry.tar.gz",
        Some("artifact.package_layout"),
        "an entry with a .. component",
        pe(with(vec![zm(
            "model/data/aotinductor/denoiser/../x/y.txt",
            "x",
        )])),
    );
    add(
        "pkg-second-entry.tar.gz",
        Some("artifact.package_entry_mismatch"),
        "a second entry with a wrapper",
        pe(with(vec![zm(
            "model/data/aotinductor/denoiser/cabc.wrapper.cpp",
            synthetic_wrapper(false, &table_a()),
        )])),
    );
    let renamed: Vec<ZipMember> = base_members
        .iter()
        .map(|m| ZipMember {
            name: String::from_utf8(m.name.clone())
                .unwrap()
                .replace("h=64,w=64", "h=32,w=32")
                .into_bytes(),
            ..m.clone()
        })
        .collect();
    add(
        "pkg-entry-mismatch.tar.gz",
        Some("artifact.package_entry_mismatch"),
        "the entry is not graph_class.name",
        pe(zip(&renamed)),
    );

    // wrapper (§8.3), constants (§8.4), code-only (§8.5)
    let wrap = |w: Vec<u8>| {
        let mut ms = base_members.clone();
        ms[1].data = w;
        pe(zip(&ms))
    };
    let wtext = synthetic_wrapper(false, &table_a());
    add(
        "wrapper-not-utf8.tar.gz",
        Some("artifact.wrapper_parse"),
        "a non-UTF-8 byte",
        wrap([wtext.as_bytes(), b"\xff"].concat()),
    );
    add(
        "wrapper-no-constructor.tar.gz",
        Some("artifact.wrapper_parse"),
        "no AOTInductorModelBase( call",
        wrap(
            wtext
                .replace("AOTInductorModelBase(", "ModelBase(")
                .into_bytes(),
        ),
    );
    add(
        "wrapper-count-mismatch.tar.gz",
        Some("artifact.wrapper_parse"),
        "declared count 3 for 2 rows",
        wrap(
            wtext
                .replacen(
                    "                           2,\n",
                    "                           3,\n",
                    1,
                )
                .into_bytes(),
        ),
    );
    add(
        "wrapper-assigned-twice.tar.gz",
        Some("artifact.wrapper_parse"),
        "a field assigned twice",
        wrap(
            wtext
                .replacen(
                    "constants_info_[1].data_size = 64;",
                    "constants_info_[1].data_size = 64;\n    constants_info_[1].data_size = 64;",
                    1,
                )
                .into_bytes(),
        ),
    );
    add(
        "wrapper-missing-field.tar.gz",
        Some("artifact.wrapper_parse"),
        "a row without dtype",
        wrap(
            wtext
                .replacen(
                    "constants_info_[1].dtype = cached_torch_dtype_float32;",
                    "",
                    1,
                )
                .into_bytes(),
        ),
    );
    let mut t16 = table_a();
    t16[1].dtype = "float16".into();
    add(
        "constants-mismatch.tar.gz",
        Some("artifact.constants_mismatch"),
        "a row's dtype differs from metadata",
        wrap(synthetic_wrapper(false, &t16).into_bytes()),
    );
    let mut swapped = table_a();
    swapped.swap(0, 1);
    swapped[0].index = 0;
    swapped[1].index = 1;
    add(
        "constants-order.tar.gz",
        Some("artifact.constants_mismatch"),
        "rows in another order",
        wrap(synthetic_wrapper(false, &swapped).into_bytes()),
    );
    add(
        "baked-blob.tar.gz",
        Some("artifact.not_code_only"),
        "load_constants_from_blob true",
        wrap(synthetic_wrapper(true, &table_a()).into_bytes()),
    );
    let so = |so: Vec<u8>| pe(zip(&package_members(&table_a(), false, so)));
    add(
        "baked-lrodata.tar.gz",
        Some("artifact.not_code_only"),
        ".lrodata as large as the declared 128 B",
        so(synthetic_elf(62, 128)),
    );

    // ELF (§8.6-§8.7)
    add(
        "elf-truncated.tar.gz",
        Some("artifact.elf_invalid"),
        "a 40-byte .so",
        so(small_so()[..40].to_vec()),
    );
    add(
        "elf-bad-magic.tar.gz",
        Some("artifact.elf_invalid"),
        "no ELF magic",
        so(elf_edit(|e| e[1] = b'X')),
    );
    add(
        "elf-class32.tar.gz",
        Some("artifact.elf_invalid"),
        "ELFCLASS32",
        so(elf_edit(|e| e[4] = 1)),
    );
    add(
        "elf-big-endian.tar.gz",
        Some("artifact.elf_invalid"),
        "ELFDATA2MSB",
        so(elf_edit(|e| e[5] = 2)),
    );
    add(
        "elf-shnum-zero.tar.gz",
        Some("artifact.elf_invalid"),
        "e_shnum 0",
        so(elf_edit(|e| e[0x3c..0x3e].copy_from_slice(&[0, 0]))),
    );
    add(
        "elf-section-table-oob.tar.gz",
        Some("artifact.elf_invalid"),
        "section table past the end",
        so(elf_edit(|e| {
            let o = shoff(e) as u64 + 8;
            e[0x28..0x30].copy_from_slice(&o.to_le_bytes());
        })),
    );
    add(
        "elf-shoff-overflow.tar.gz",
        Some("artifact.elf_invalid"),
        "e_shoff near u64::MAX",
        so(elf_edit(|e| {
            e[0x28..0x30].copy_from_slice(&(u64::MAX - 64).to_le_bytes())
        })),
    );
    add(
        "elf-strtab-type.tar.gz",
        Some("artifact.elf_invalid"),
        "the name table is PROGBITS",
        so(elf_edit(|e| {
            let at = shoff(e) + 2 * 64 + 4;
            e[at..at + 4].copy_from_slice(&1u32.to_le_bytes());
        })),
    );
    add(
        "elf-strtab-oob.tar.gz",
        Some("artifact.elf_invalid"),
        "the name table lies past the end",
        so(elf_edit(|e| {
            let at = shoff(e) + 2 * 64 + 0x20;
            e[at..at + 8].copy_from_slice(&4096u64.to_le_bytes());
        })),
    );
    add(
        "elf-name-oob.tar.gz",
        Some("artifact.elf_invalid"),
        "a section name offset past the table",
        so(elf_edit(|e| {
            let at = shoff(e) + 64;
            e[at..at + 4].copy_from_slice(&500u32.to_le_bytes());
        })),
    );
    add(
        "elf-section-oob.tar.gz",
        Some("artifact.elf_invalid"),
        "a section past the end",
        so(elf_edit(|e| {
            let at = shoff(e) + 64 + 0x20;
            e[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        })),
    );
    add(
        "elf-lrodata-nobits.tar.gz",
        Some("artifact.elf_invalid"),
        ".lrodata of type NOBITS",
        so(elf_edit(|e| {
            let at = shoff(e) + 64 + 4;
            e[at..at + 4].copy_from_slice(&8u32.to_le_bytes());
        })),
    );
    add(
        "elf-machine-mismatch.tar.gz",
        Some("artifact.elf_machine_mismatch"),
        "an aarch64 .so for x86_64 facts",
        so(synthetic_elf(183, 16)),
    );
    out
}

/// The index: `[{"code", "file", "what"}]` of the refused files, as CJ.
pub fn index(cases: &[Case]) -> Vec<u8> {
    let rows: Vec<Value> = cases
        .iter()
        .filter_map(|c| {
            let code = c.code?;
            let mut m = Map::new();
            m.insert("code".into(), code.into());
            m.insert("file".into(), Value::Str(c.file.clone()));
            m.insert("what".into(), Value::Str(c.what.clone()));
            Some(Value::Object(m))
        })
        .collect();
    let mut v = tcg_cj::to_canonical(&Value::Array(rows)).unwrap();
    v.push(b'\n');
    v
}

pub fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/adversarial")
}

fn main() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let cases = cases();
    for c in &cases {
        std::fs::write(dir.join(&c.file), &c.bytes).unwrap();
    }
    std::fs::write(dir.join("index.json"), index(&cases)).unwrap();
    let total: usize = cases.iter().map(|c| c.bytes.len()).sum();
    eprintln!(
        "wrote {} files ({total} bytes) to {}",
        cases.len(),
        dir.display()
    );
}
