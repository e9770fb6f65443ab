//! Generate the adversarial envelope corpus of `testdata/adversarial/`
//! (SPEC-v1 §13.4): small malformed envelopes, each refused with a recorded
//! code, and two valid bases they derive from. Deterministic.
//!
//! ```text
//! cargo run -p tcg-core --example gen_adversarial            # write the corpus
//! ```
//!
//! `tests/artifact_adversarial.rs` includes this file (and its modules) to check that the
//! committed corpus equals the generator's output.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use tcg_cj::{Map, Value};

#[path = "bounds_cases.rs"]
pub mod bounds_cases;
#[path = "content_cases.rs"]
mod content_cases;
#[path = "envelope_cases.rs"]
mod envelope_cases;
#[path = "fixtures.rs"]
pub mod fixtures;

use fixtures::{bases, env};

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
    add(
        "base.tar.gz",
        None,
        "valid base: two state_dict constants, no literals",
        env(&b.md_a, &b.pkg_a, None),
    );
    add(
        "base-literals.tar.gz",
        None,
        "valid base with two literal constants",
        env(&b.md_b, &b.pkg_b, Some(&b.lit_b)),
    );
    envelope_cases::cases(&b, &mut add);
    content_cases::cases(&b, &mut add);
    bounds_cases::cases(&b, &mut add);
    out
}

/// The large shapes, made at test time and never written to the corpus.
pub fn generated_cases() -> Vec<Case> {
    bounds_cases::generated(&bases())
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
