//! The mint record (docs/FORMAT.md, "The mint record"): written into the
//! package at mint, outside the metadata and the key, checked against the
//! wrapper by verification. Real files and the reference package (a real
//! AOTInductor CPU package minted by 0.2.0).

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use common::*;
use tcg_cj::Value;
use tcg_core::artifact::package::mint_record::{
    build_mint_record, package_mint_record, write_with_record, MINT_RECORD_PATH,
};
use tcg_core::artifact::package::native_calls::PROXY_EXECUTOR_CALL;
use tcg_core::artifact::package::{package_native_calls, UnsupportedCall};
use tcg_core::artifact::{pack, read_metadata};
use tcg_core::engine::{Engine, EnsureOutcome, Request};
use tcg_core::Code;

const CALL: &str = "    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_proxy_executor_call_function(proxy_executor, 0, 0, std::array<int64_t, 0>{}.data(), 2, std::array<AtenTensorHandle, 2>{buf0, buf1}.data()));\n";
const TABLE: &str = r#"{"nodes": [{"name": "buf1", "node": {"target": "tcgprobe::twice", "inputs": [], "outputs": []}}]}"#;

fn request() -> Request {
    let md = read_metadata(&reference()).unwrap();
    Request::new("cpu", &md.value()["toolchain"]).unwrap()
}

fn parity() -> Value {
    tcg_cj::parse_strict(br#"{"inputs":"example_inputs","leaves":[{"atol":0.0001,"dtype":"float32","max_abs_diff":1.1920928955078125e-07,"max_rel_diff":2.0e-07,"numel":32,"path":"","rtol":0.0001,"scale":1.5,"shape":[4,8]}],"status":"passed"}"#).unwrap()
}

/// Members to write in place of one: (name, bytes).
type Members = Vec<(String, Vec<u8>)>;

/// Rewrite the zip at `from` into `to`, member by member, through `edit`
/// (name, bytes) -> members to write instead.
fn rewrite(from: &Path, to: &Path, edit: &mut dyn FnMut(&str, Vec<u8>) -> Members) {
    let mut input = zip::ZipArchive::new(std::fs::File::open(from).unwrap()).unwrap();
    let mut out = zip::ZipWriter::new(std::fs::File::create(to).unwrap());
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for i in 0..input.len() {
        let mut m = input.by_index(i).unwrap();
        let name = m.name().unwrap().into_owned();
        let mut bytes = Vec::new();
        m.read_to_end(&mut bytes).unwrap();
        for (n, b) in edit(&name, bytes) {
            out.start_file(n, stored).unwrap();
            out.write_all(&b).unwrap();
        }
    }
    out.finish().unwrap();
}

/// The reference package with one proxy-executor call spliced into its
/// wrapper (the form torch 2.15 generates for a custom op without a C shim)
/// and the extern-kernel table beside it.
fn with_proxy_call(dir: &Path) -> PathBuf {
    let from = members(dir).join("model.pt2");
    let to = dir.join("proxy.pt2");
    rewrite(&from, &to, &mut |name, bytes| {
        let Some(stem) = name.strip_suffix(".wrapper.cpp") else {
            return vec![(name.to_owned(), bytes)];
        };
        let text = String::from_utf8(bytes).unwrap();
        let at = text.find("AOTIProxyExecutorHandle proxy_executor").unwrap();
        let end = at + text[at..].find('\n').unwrap() + 1;
        vec![
            (format!("{stem}.wrapper.json"), TABLE.as_bytes().to_vec()),
            (
                name.to_owned(),
                format!("{}{CALL}{}", &text[..end], &text[end..]).into_bytes(),
            ),
        ]
    });
    to
}

fn record_of(graph: &Path) -> tcg_core::artifact::package::MintRecord {
    package_mint_record(&graph.join("model.pt2"))
        .unwrap()
        .expect("the minted package carries a record")
}

#[test]
fn a_mint_records_parity_and_calls_in_the_package_not_in_the_metadata() {
    let d = tempfile::tempdir().unwrap();
    let e = Engine::open(d.path().join("store")).unwrap();
    let mut mint = || {
        let mut plan = reference_mint(d.path());
        plan.parity = Some(parity());
        Ok(plan)
    };
    let graph = d.path().join("graph");
    let r = e.ensure(KEY, &graph, &request(), &mut mint).unwrap();
    assert_eq!(r.outcome, EnsureOutcome::Minted);
    // The metadata (and so the key) is the reference's, byte for byte.
    let reference_md = read_metadata(&reference()).unwrap();
    assert_eq!(r.resolved.metadata.bytes(), reference_md.bytes());
    assert_eq!(
        std::fs::read(graph.join("metadata.json")).unwrap(),
        reference_md.bytes()
    );
    let record = record_of(&graph);
    assert_eq!(record.value["parity"], parity());
    assert!(record.unsupported_calls.is_empty());
    // The member sits under the package root, outside any AOTInductor layout.
    let names = tcg_core::artifact::package::Package::open(&graph.join("model.pt2"))
        .unwrap()
        .names()
        .to_vec();
    assert!(
        names.contains(&format!("model/{MINT_RECORD_PATH}")),
        "{names:?}"
    );
}

#[test]
fn a_proxy_call_is_listed_by_name_in_the_record() {
    let d = tempfile::tempdir().unwrap();
    let package = with_proxy_call(d.path());
    let calls = package_native_calls(&package).unwrap();
    let want = vec![UnsupportedCall {
        call: PROXY_EXECUTOR_CALL.into(),
        target: "tcgprobe::twice".into(),
        count: 1,
    }];
    assert_eq!(calls, want);
    let e = Engine::open(d.path().join("store")).unwrap();
    let mut mint = || {
        let mut plan = reference_mint(d.path());
        plan.package = package.clone();
        Ok(plan)
    };
    let graph = d.path().join("graph");
    e.ensure(KEY, &graph, &request(), &mut mint).unwrap();
    let record = record_of(&graph);
    assert_eq!(record.unsupported_calls, want);
    assert!(!record.value.contains_key("parity"));
}

#[test]
fn a_record_that_disagrees_with_the_wrapper_or_is_malformed_is_refused_and_nothing_is_written() {
    let d = tempfile::tempdir().unwrap();
    let plain = members(d.path()).join("model.pt2");
    let md = read_metadata(&reference()).unwrap();
    let lying = build_mint_record(
        None,
        &[UnsupportedCall {
            call: PROXY_EXECUTOR_CALL.into(),
            target: "mylib::hidden".into(),
            count: 1,
        }],
    )
    .unwrap();
    let silent = build_mint_record(None, &[]).unwrap();
    let cases: Vec<(&str, PathBuf, Vec<u8>)> = vec![
        // Claims a call the wrapper does not make.
        ("lying", plain.clone(), lying),
        // Hides the call the wrapper makes.
        ("silent", with_proxy_call(d.path()), silent),
        // Not canonical JSON.
        ("malformed", plain.clone(), b"{\"format\": 1}".to_vec()),
    ];
    for (name, package, record) in cases {
        let doctored = d.path().join(format!("{name}.pt2"));
        write_with_record(&package, &doctored, &record).unwrap();
        let out = d.path().join(format!("{name}.tar.gz"));
        let err = pack(&doctored, &Value::Object(md.value().clone()), None, &out).unwrap_err();
        assert_eq!(err.code(), Code::ArtifactMintRecordInvalid, "{name}: {err}");
        assert!(!out.exists(), "{name}: nothing is published");
    }
    // A second record is refused at writing.
    let once = d.path().join("once.pt2");
    write_with_record(&plain, &once, &build_mint_record(None, &[]).unwrap()).unwrap();
    let err = write_with_record(&once, &d.path().join("twice.pt2"), b"{}").unwrap_err();
    assert_eq!(err.code(), Code::ArtifactMintRecordInvalid);
}

#[test]
fn a_package_without_a_record_still_verifies() {
    // Every 0.2.0 artifact: no record, nothing to check.
    let d = tempfile::tempdir().unwrap();
    let plain = members(d.path()).join("model.pt2");
    assert!(package_mint_record(&plain).unwrap().is_none());
    let md = read_metadata(&reference()).unwrap();
    pack(
        &plain,
        &Value::Object(md.value().clone()),
        None,
        &d.path().join("a.tar.gz"),
    )
    .unwrap();
}
