//! The mint record: what the mint measured and found, carried inside
//! `model.pt2` at `<root>/extra/tcg-mint.json` (project addition; see
//! docs/FORMAT.md, "The mint record").
//!
//! SPEC-v1 closes `metadata.json` at every level (§7.2–§7.4: exactly 9, 13
//! and 4 members) and the envelope to its three members (§6.1), so a 0.2.0
//! reader refuses any new member there. The package is where the spec
//! allows more: zip names without an AOTInductor layout are ignored (§8.2),
//! and `extra/` is the PT2 archive's own directory for extra files. The
//! record is not a key fact and does not enter the key; package bytes are
//! not identity (§6.4).
//!
//! The record is canonical JSON (CJ), at most [`MAX_MINT_RECORD_BYTES`]:
//!
//! ```json
//! {"format":"tcg-mint-record-v1",
//!  "native":{"unsupported_calls":[{"call":"…","count":1,"target":"ns::op"}]},
//!  "parity":{"inputs":"example_inputs","leaves":[{…}],"runner":"torch","status":"passed"}}
//! ```
//!
//! `parity.runner` (optional; absent in records written before it) names
//! what ran the compiled side: `torch` (torch's package loader) or `native`
//! (the torch-free runner, for a `.so` that carries its own C++ runtime).
//!
//! `parity` is absent when the mint did not check parity (a caller outside
//! the Python mint). Verification checks the shape and that
//! `native.unsupported_calls` equals a fresh scan of the wrapper
//! (`artifact.mint_record_invalid`).

use std::io::Write;
use std::path::Path;

use tcg_cj::{Map, Value};

use super::native_calls::{calls_value, UnsupportedCall};
use super::{layout_of, Package, AOTI_DIR};
use crate::error::{Code, Error, Result};

/// The record's path under the package root.
pub const MINT_RECORD_PATH: &str = "extra/tcg-mint.json";
/// The record's `format`.
pub const MINT_RECORD_FORMAT: &str = "tcg-mint-record-v1";
/// Largest record (1 MiB).
pub const MAX_MINT_RECORD_BYTES: u64 = 1 << 20;
/// What may have run the compiled side of the parity check.
pub const PARITY_RUNNERS: [&str; 2] = ["native", "torch"];
/// Most parity leaves recorded.
pub const MAX_PARITY_LEAVES: usize = 4096;

/// The members of one parity leaf.
pub const PARITY_LEAF_FIELDS: [&str; 9] = [
    "atol",
    "dtype",
    "max_abs_diff",
    "max_rel_diff",
    "numel",
    "path",
    "rtol",
    "scale",
    "shape",
];

fn invalid(m: impl std::fmt::Display) -> Error {
    Error::new(
        Code::ArtifactMintRecordInvalid,
        format!("mint record {MINT_RECORD_PATH} is invalid: {m}"),
    )
}

/// A validated mint record.
#[derive(Debug, Clone, PartialEq)]
pub struct MintRecord {
    /// The record object.
    pub value: Map,
    /// `native.unsupported_calls`.
    pub unsupported_calls: Vec<UnsupportedCall>,
}

fn members(map: &Map, required: &[&str], optional: &[&str], what: &str) -> Result<()> {
    for k in required {
        if !map.contains_key(*k) {
            return Err(invalid(format!("{what} lacks {k:?}")));
        }
    }
    if let Some(k) = map
        .keys()
        .find(|k| !required.contains(&k.as_str()) && !optional.contains(&k.as_str()))
    {
        return Err(invalid(format!("{what} has an unknown member {k:?}")));
    }
    Ok(())
}

fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Int(n) => Some(*n as f64),
        Value::Float(f) => Some(*f),
        _ => None,
    }
}

fn check_parity(v: &Value) -> Result<()> {
    let p = v
        .as_object()
        .ok_or_else(|| invalid("parity must be an object"))?;
    members(p, &["inputs", "leaves", "status"], &["runner"], "parity")?;
    if let Some(runner) = p.get("runner") {
        if !PARITY_RUNNERS.contains(&runner.as_str().unwrap_or_default()) {
            return Err(invalid(format!(
                "parity.runner must be one of {PARITY_RUNNERS:?}"
            )));
        }
    }
    if p["status"].as_str() != Some("passed") {
        return Err(invalid("parity.status must be \"passed\""));
    }
    if p["inputs"].as_str() != Some("example_inputs") {
        return Err(invalid("parity.inputs must be \"example_inputs\""));
    }
    let leaves = p["leaves"]
        .as_array()
        .ok_or_else(|| invalid("parity.leaves must be an array"))?;
    if leaves.len() > MAX_PARITY_LEAVES {
        return Err(invalid(format!(
            "parity.leaves has {} leaves, more than {MAX_PARITY_LEAVES}",
            leaves.len()
        )));
    }
    for (i, leaf) in leaves.iter().enumerate() {
        let l = leaf
            .as_object()
            .ok_or_else(|| invalid(format!("parity.leaves[{i}] must be an object")))?;
        members(l, &PARITY_LEAF_FIELDS, &[], &format!("parity.leaves[{i}]"))?;
        for k in ["dtype", "path"] {
            if l[k].as_str().is_none() {
                return Err(invalid(format!("parity.leaves[{i}].{k} must be a string")));
            }
        }
        for k in ["atol", "rtol", "scale", "max_abs_diff", "max_rel_diff"] {
            if !number(&l[k]).is_some_and(|x| x >= 0.0) {
                return Err(invalid(format!(
                    "parity.leaves[{i}].{k} must be a number >= 0"
                )));
            }
        }
        let dims_ok = matches!(&l["shape"], Value::Array(d) if d.iter().all(|x| x.as_i64().is_some_and(|n| n >= 0)));
        if !dims_ok || l["numel"].as_i64().is_none_or(|n| n < 0) {
            return Err(invalid(format!(
                "parity.leaves[{i}] shape and numel must be integers >= 0"
            )));
        }
    }
    Ok(())
}

fn parse_calls(v: &Value) -> Result<Vec<UnsupportedCall>> {
    let rows = v
        .as_array()
        .ok_or_else(|| invalid("native.unsupported_calls must be an array"))?;
    rows.iter()
        .map(|r| {
            let m = r
                .as_object()
                .ok_or_else(|| invalid("an unsupported call must be an object"))?;
            members(m, &["call", "count", "target"], &[], "an unsupported call")?;
            match (
                m["call"].as_str(),
                m["count"].as_i64(),
                m["target"].as_str(),
            ) {
                (Some(call), Some(count), Some(target)) if count >= 1 => Ok(UnsupportedCall {
                    call: call.to_owned(),
                    target: target.to_owned(),
                    count: count as u64,
                }),
                _ => Err(invalid(
                    "an unsupported call needs string call and target and an integer count >= 1",
                )),
            }
        })
        .collect()
}

/// Validate record bytes: canonical JSON of the shape above.
pub fn validate_mint_record(bytes: &[u8]) -> Result<MintRecord> {
    let value =
        tcg_cj::parse_strict(bytes).map_err(|e| invalid(format!("not strict JSON: {e}")))?;
    if tcg_cj::to_canonical(&value).ok().as_deref() != Some(bytes) {
        return Err(invalid("not canonical JSON"));
    }
    let Value::Object(top) = value else {
        return Err(invalid("the root must be an object"));
    };
    members(&top, &["format", "native"], &["parity"], "the record")?;
    if top["format"].as_str() != Some(MINT_RECORD_FORMAT) {
        return Err(invalid(format!("format must be {MINT_RECORD_FORMAT:?}")));
    }
    let native = top["native"]
        .as_object()
        .ok_or_else(|| invalid("native must be an object"))?;
    members(native, &["unsupported_calls"], &[], "native")?;
    let unsupported_calls = parse_calls(&native["unsupported_calls"])?;
    if let Some(parity) = top.get("parity") {
        check_parity(parity)?;
    }
    Ok(MintRecord {
        value: top,
        unsupported_calls,
    })
}

/// The canonical bytes of a record from its parts (validated).
pub fn build_mint_record(parity: Option<&Value>, calls: &[UnsupportedCall]) -> Result<Vec<u8>> {
    let mut native = Map::new();
    native.insert("unsupported_calls".into(), calls_value(calls));
    let mut top = Map::new();
    top.insert("format".into(), Value::Str(MINT_RECORD_FORMAT.into()));
    top.insert("native".into(), Value::Object(native));
    if let Some(p) = parity {
        top.insert("parity".into(), p.clone());
    }
    let bytes = tcg_cj::to_canonical(&Value::Object(top))
        .map_err(|e| invalid(format!("cannot be encoded: {e}")))?;
    if bytes.len() as u64 > MAX_MINT_RECORD_BYTES {
        return Err(invalid(format!(
            "{} bytes, more than {MAX_MINT_RECORD_BYTES}",
            bytes.len()
        )));
    }
    validate_mint_record(&bytes)?;
    Ok(bytes)
}

/// The record member's name in a package whose members are `names`: under
/// the root of its AOTInductor layout.
pub fn record_member(names: &[String]) -> Result<String> {
    for name in names {
        if let Some(l) = layout_of(name)? {
            return Ok(if l.root.is_empty() {
                MINT_RECORD_PATH.to_owned()
            } else {
                format!("{}/{MINT_RECORD_PATH}", l.root)
            });
        }
    }
    Err(invalid(format!("the package has no {AOTI_DIR} member")))
}

/// The package's record, validated, when it has one.
pub fn read_mint_record(pkg: &mut Package) -> Result<Option<MintRecord>> {
    let name = record_member(pkg.names())?;
    if !pkg.names().contains(&name) {
        return Ok(None);
    }
    let bytes = pkg
        .read_bounded(&name, MAX_MINT_RECORD_BYTES)
        .map_err(|e| {
            if e.code() == Code::ArtifactPackageMemberTooLarge {
                invalid(e.message())
            } else {
                e
            }
        })?;
    validate_mint_record(&bytes).map(Some)
}

/// The record of the package at `path`, when it has one.
pub fn package_mint_record(path: &Path) -> Result<Option<MintRecord>> {
    read_mint_record(&mut Package::open(path)?)
}

/// Write a copy of the package `from` to `to` (a new file) with `record`
/// appended as a stored member at [`record_member`], fsynced. A package
/// that already has a record is refused (`artifact.mint_record_invalid`).
pub fn write_with_record(from: &Path, to: &Path, record: &[u8]) -> Result<()> {
    let names = Package::open(from)?.names().to_vec();
    let member = record_member(&names)?;
    if names.contains(&member) {
        return Err(invalid(format!(
            "{} already has a mint record",
            from.display()
        )));
    }
    let io = |what: &str, p: &Path, e: &std::io::Error| {
        Error::io(format_args!("{what} {}", p.display()), e)
    };
    let mut src = std::fs::File::open(from).map_err(|e| io("cannot open", from, &e))?;
    let mut dst = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(to)
        .map_err(|e| io("cannot create", to, &e))?;
    std::io::copy(&mut src, &mut dst).map_err(|e| io("cannot copy to", to, &e))?;
    let zip_err = |e: zip::result::ZipError| match e {
        zip::result::ZipError::Io(e) => io("cannot write", to, &e),
        other => invalid(format!("cannot append to {}: {other}", to.display())),
    };
    let mut writer = zip::ZipWriter::new_append(dst).map_err(zip_err)?;
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .last_modified_time(zip::DateTime::default())
        .unix_permissions(0o644);
    writer
        .start_file(member.as_str(), options)
        .map_err(zip_err)?;
    writer
        .write_all(record)
        .map_err(|e| io("cannot write", to, &e))?;
    let file = writer.finish().map_err(zip_err)?;
    file.sync_all().map_err(|e| io("cannot fsync", to, &e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parity() -> Value {
        let leaf = tcg_cj::parse_strict(
            br#"{"atol":0.0001,"dtype":"float32","max_abs_diff":0.0,"max_rel_diff":0.0,"numel":8,"path":"","rtol":0.0001,"scale":1.0,"shape":[2,4]}"#,
        )
        .unwrap();
        let mut p = Map::new();
        p.insert("inputs".into(), Value::Str("example_inputs".into()));
        p.insert("leaves".into(), Value::Array(vec![leaf]));
        p.insert("status".into(), Value::Str("passed".into()));
        Value::Object(p)
    }

    #[test]
    fn a_built_record_validates_and_round_trips() {
        let calls = vec![UnsupportedCall {
            call: super::super::native_calls::PROXY_EXECUTOR_CALL.into(),
            target: "tcgprobe::twice".into(),
            count: 1,
        }];
        let bytes = build_mint_record(Some(&parity()), &calls).unwrap();
        let record = validate_mint_record(&bytes).unwrap();
        assert_eq!(record.unsupported_calls, calls);
        assert_eq!(record.value["parity"], parity());
        let mut with_runner = parity();
        if let Value::Object(p) = &mut with_runner {
            p.insert("runner".into(), Value::Str("native".into()));
        }
        let bytes = build_mint_record(Some(&with_runner), &[]).unwrap();
        assert_eq!(
            validate_mint_record(&bytes).unwrap().value["parity"],
            with_runner
        );
        let bare = build_mint_record(None, &[]).unwrap();
        assert_eq!(
            bare,
            br#"{"format":"tcg-mint-record-v1","native":{"unsupported_calls":[]}}"#
        );
    }

    #[test]
    fn malformed_records_are_refused_with_their_code() {
        let cases: &[&[u8]] = &[
            b"",
            b"[]",
            b"{\"format\":\"tcg-mint-record-v1\", \"native\":{\"unsupported_calls\":[]}}",
            br#"{"format":"tcg-mint-record-v2","native":{"unsupported_calls":[]}}"#,
            br#"{"format":"tcg-mint-record-v1"}"#,
            br#"{"extra":1,"format":"tcg-mint-record-v1","native":{"unsupported_calls":[]}}"#,
            br#"{"format":"tcg-mint-record-v1","native":{"unsupported_calls":[{"call":"c","count":0,"target":"t"}]}}"#,
            br#"{"format":"tcg-mint-record-v1","native":{"unsupported_calls":{}}}"#,
            br#"{"format":"tcg-mint-record-v1","native":{"unsupported_calls":[]},"parity":{"inputs":"example_inputs","leaves":[],"status":"failed"}}"#,
            br#"{"format":"tcg-mint-record-v1","native":{"unsupported_calls":[]},"parity":{"inputs":"example_inputs","leaves":[{"atol":-1}],"status":"passed"}}"#,
            br#"{"format":"tcg-mint-record-v1","native":{"unsupported_calls":[]},"parity":{"inputs":"example_inputs","leaves":[],"runner":"onnx","status":"passed"}}"#,
            br#"{"format":"tcg-mint-record-v1","native":{"unsupported_calls":[]},"parity":{"inputs":"example_inputs","leaves":[],"runner":1,"status":"passed"}}"#,
        ];
        for bytes in cases {
            let e = validate_mint_record(bytes).unwrap_err();
            assert_eq!(e.code(), Code::ArtifactMintRecordInvalid, "{e}");
        }
    }

    #[test]
    fn the_record_sits_under_the_layout_root() {
        let names = vec![
            "model/archive_format".to_owned(),
            "model/data/aotinductor/g/x.wrapper.cpp".to_owned(),
        ];
        assert_eq!(record_member(&names).unwrap(), "model/extra/tcg-mint.json");
        let rootless = vec!["data/aotinductor/g/x.wrapper.cpp".to_owned()];
        assert_eq!(record_member(&rootless).unwrap(), "extra/tcg-mint.json");
    }
}
