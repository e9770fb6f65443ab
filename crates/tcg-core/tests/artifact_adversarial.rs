//! The adversarial corpus (SPEC-v1 §13.4): every malformed envelope under
//! `testdata/adversarial/` is refused by unpack with the code recorded in
//! `index.json`, as an `ArtifactError`, leaving no destination, stage or
//! temp behind; and the committed corpus is exactly the generator's output.

#[path = "../examples/gen_adversarial/main.rs"]
#[allow(clippy::all)]
mod generator;

use std::path::Path;

use tcg_core::artifact::{self, Metadata};
use tcg_core::{Code, Kind};

fn index() -> Vec<(String, String, String)> {
    let bytes = std::fs::read(generator::corpus_dir().join("index.json")).unwrap();
    let v = tcg_cj::parse_strict(&bytes[..bytes.len() - 1]).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|row| {
            let m = row.as_object().unwrap();
            let s = |k: &str| m[k].as_str().unwrap().to_owned();
            (s("file"), s("code"), s("what"))
        })
        .collect()
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn the_committed_corpus_equals_the_generator_output() {
    let dir = generator::corpus_dir();
    let cases = generator::cases();
    for c in &cases {
        let committed =
            std::fs::read(dir.join(&c.file)).unwrap_or_else(|e| panic!("{}: {e}", c.file));
        assert!(
            committed == c.bytes,
            "{} drifted from the generator; re-run gen_adversarial",
            c.file
        );
    }
    assert_eq!(
        std::fs::read(dir.join("index.json")).unwrap(),
        generator::index(&cases)
    );
    let mut expected: Vec<String> = cases.iter().map(|c| c.file.clone()).collect();
    expected.push("index.json".into());
    expected.sort();
    assert_eq!(
        entries(&dir),
        expected,
        "unlisted files in the corpus directory"
    );
}

#[test]
fn every_corpus_file_is_refused_with_its_code_and_leaves_nothing_behind() {
    let rows = index();
    assert!(rows.len() >= 60, "corpus has only {} refusals", rows.len());
    let dir = generator::corpus_dir();
    let mut failures = Vec::new();
    for (file, code, what) in &rows {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("graphs").join("out");
        let mut admit = |_: &Metadata| Ok(());
        match artifact::unpack(&dir.join(file), &dest, &mut admit) {
            Ok(_) => failures.push(format!("{file} ({what}): accepted, expected {code}")),
            Err(e) => {
                if e.code().as_str() != code {
                    failures.push(format!(
                        "{file} ({what}): got {} ({e}), expected {code}",
                        e.code()
                    ));
                }
                assert_eq!(e.kind(), Kind::Artifact, "{file}: {e}");
            }
        }
        assert!(!dest.exists(), "{file}: destination published");
        let parent = tmp.path().join("graphs");
        if parent.exists() {
            assert!(
                entries(&parent).is_empty(),
                "{file}: left {:?}",
                entries(&parent)
            );
        }
        // The bounded readers agree with the full reader up to the metadata.
        if code == "artifact.gzip_header"
            || code == "artifact.bare_pt2"
            || file.starts_with("meta-")
        {
            match artifact::read_metadata(&dir.join(file)) {
                Err(e) if e.code().as_str() == code => {}
                // Payload presence is decided only when the archive ends.
                Ok(_) if code == "artifact.literals_mismatch" => {}
                other => failures.push(format!(
                    "{file}: read_metadata gave {:?}",
                    other.map(|m| m.key().to_owned())
                )),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_bases_verify_and_unpack() {
    let dir = generator::corpus_dir();
    let tmp = tempfile::tempdir().unwrap();
    for (base, literals) in [("base.tar.gz", false), ("base-literals.tar.gz", true)] {
        let dest = tmp.path().join(base.replace(".tar.gz", ""));
        let mut seen = None;
        let mut admit = |md: &Metadata| {
            seen = Some(md.key().to_owned());
            Ok(())
        };
        let report = artifact::unpack(&dir.join(base), &dest, &mut admit).unwrap();
        assert_eq!(seen.as_deref(), Some(report.metadata.key()));
        let mut want = vec!["metadata.json".to_owned(), "model.pt2".to_owned()];
        if literals {
            want.insert(0, "constants.safetensors".to_owned());
        }
        assert_eq!(entries(&dest), want);
        assert_eq!(report.literals_bytes.is_some(), literals);
        artifact::verify(&dir.join(base), false).unwrap();
    }
}

#[test]
fn admission_runs_before_the_package_is_read_and_refusal_leaves_nothing() {
    let dir = generator::corpus_dir();
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("out");
    // A package defect after the metadata: admission refuses first.
    let mut admit = |_: &Metadata| {
        Err(tcg_core::Error::new(
            Code::AdmissionHostFeatures,
            "artifact host ISA is unsupported: test",
        ))
    };
    let err = artifact::unpack(&dir.join("elf-truncated.tar.gz"), &dest, &mut admit).unwrap_err();
    assert_eq!(err.code(), Code::AdmissionHostFeatures);
    assert!(!dest.exists());
    assert!(entries(tmp.path()).is_empty());
}
