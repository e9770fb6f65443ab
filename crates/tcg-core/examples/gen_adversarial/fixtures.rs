//! Fixtures of the corpus: a hand-made zip writer, the synthetic package,
//! metadata and literal payload of the two bases, and tar/gzip helpers.

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

/// The sink of cases: file, expected code, what is wrong, bytes.
pub type Add<'a> = &'a mut dyn FnMut(&str, Option<&'static str>, &str, Vec<u8>);

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

pub fn crc32(b: &[u8]) -> u32 {
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

pub fn wc(
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

pub const WRAPPER: &str = "model/data/aotinductor/denoiser/h=64,w=64/cabc.wrapper.cpp";
pub const SO: &str = "model/data/aotinductor/denoiser/h=64,w=64/cabc.wrapper.so";

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

pub fn parse(s: &str) -> Value {
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

pub fn literal_values() -> String {
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
    metadata_sm(table, literals, "sm_89")
}

/// [`metadata`] for another `sm` (a CPU one, say).
pub fn metadata_sm(table: &[WrapperConstant], literals: bool, sm: &str) -> Metadata {
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
    build_metadata(&decl, &rows, sm, &toolchain, &host_v3()).unwrap()
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

pub fn recheck(mut h: [u8; 512]) -> [u8; 512] {
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

pub struct Bases {
    pub md_a: Vec<u8>,
    pub pkg_a: Vec<u8>,
    pub md_b: Vec<u8>,
    pub pkg_b: Vec<u8>,
    pub lit_b: Vec<u8>,
}

pub fn bases() -> Bases {
    Bases {
        md_a: metadata(&table_a(), false).bytes().to_vec(),
        pkg_a: package(&table_a()),
        md_b: metadata(&table_b(), true).bytes().to_vec(),
        pkg_b: package(&table_b()),
        lit_b: payload_bytes(&literal_tensors()).unwrap(),
    }
}

pub fn env(md: &[u8], pkg: &[u8], lit: Option<&[u8]>) -> Vec<u8> {
    envelope_bytes(md, pkg, lit).unwrap()
}

/// Edit metadata as a value and re-encode it canonically.
pub fn md_edit(md: &[u8], f: impl FnOnce(&mut Map)) -> Vec<u8> {
    let mut m = tcg_cj::parse_strict(md)
        .unwrap()
        .as_object()
        .unwrap()
        .clone();
    f(&mut m);
    tcg_cj::to_canonical(&Value::Object(m)).unwrap()
}

pub fn sub(m: &mut Map, k: &str, f: impl FnOnce(&mut Map)) {
    let mut inner = m[k].as_object().unwrap().clone();
    f(&mut inner);
    m.insert(k.into(), Value::Object(inner));
}

/// A safetensors payload from a raw header text and data.
pub fn st(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut v = (h.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(&h);
    v.extend_from_slice(data);
    v
}

pub fn lit_data() -> Vec<u8> {
    // Writer order: int64 idx (item 8) before float32 table (item 4).
    let t = literal_tensors();
    [t[1].bytes.clone(), t[0].bytes.clone()].concat()
}

pub fn elf_edit(f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut so = small_so();
    f(&mut so);
    so
}

pub fn shoff(so: &[u8]) -> usize {
    u64::from_le_bytes(so[0x28..0x30].try_into().unwrap()) as usize
}
