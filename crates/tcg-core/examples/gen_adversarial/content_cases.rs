//! Content-level cases: metadata, literal payload, package zip and layout,
//! wrapper, constants, code-only policy and ELF.

use super::fixtures::*;
use tcg_cj::Value;
use tcg_core::artifact::package::elf::synthetic_elf;
use tcg_core::artifact::package::wrapper::synthetic_wrapper;

/// Append the content-level cases.
pub fn cases(b: &Bases, add: Add<'_>) {
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
}
