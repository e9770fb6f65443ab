//! Untrusted strings in human output (issue 25): a graph class name, a name
//! read from an old store, the producer of an unverified statement and error
//! messages that embed such strings carry terminal escapes, C1 controls,
//! bidi overrides, newlines and forged `error:` lines. The CLI's human output
//! shows them escaped and capped, on the lines they belong to; `--json`
//! output stays exact JSON.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tcg_cj::Value;
use tcg_core::artifact::{parse_constant_table, read_metadata};
use tcg_core::engine::{Engine, MintOutput};
use tcg_core::identity::GraphClassDeclaration;
use tcg_core::identity::{derive_key, toolchain_axis, validate_toolchain_block};
use tcg_core::Code;

/// A graph class name that tries everything: CSI (ESC and C1), an OSC title,
/// a bell, a bidi override, a newline with a forged error line.
const HOSTILE: &str =
    "fleet/evil\u{1b}[2J\u{1b}]0;pwned\u{7}\u{9b}31m\u{202e}txt.exe\nerror: forged line\ncode: ok";

fn at<'a>(v: &'a Value, k: &str) -> &'a Value {
    &v.as_object().unwrap()[k]
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_torch-compiled-graphs"))
}

fn testdata(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/reference-0.2.0")
        .join(name)
}

fn run(args: &[&std::ffi::OsStr]) -> Output {
    bin().args(args).output().unwrap()
}

/// No terminal-driving character, no forged line, in `text`.
fn assert_safe(what: &str, text: &str) {
    for c in text.chars() {
        assert!(
            !tcg_core::text::is_dangerous(c) || c == '\n',
            "{what}: {:?} in {text:?}",
            c
        );
    }
    for line in text.lines() {
        assert!(
            !line.starts_with("error: forged") && !line.starts_with("code: ok"),
            "{what}: a forged line in {text:?}"
        );
    }
}

/// Mint the reference package under a declaration named `name` into
/// `store`; returns the key.
fn mint_named(dir: &Path, store: &Path, name: &str) -> String {
    let members = dir.join("members");
    std::fs::create_dir_all(&members).unwrap();
    assert!(Command::new("tar")
        .arg("xzf")
        .arg(testdata("mlp-cpu.tar.gz"))
        .arg("-C")
        .arg(&members)
        .status()
        .unwrap()
        .success());
    // The package's entry directory is the class name: rename it (system
    // python's zipfile; the bytes of every member stay as they are).
    let package = dir.join("model.pt2");
    let script = r#"
import sys, zipfile
src, dst, name = sys.argv[1], sys.argv[2], sys.argv[3]
old = "model/data/aotinductor/model/mlp/"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
    for info in zin.infolist():
        data = zin.read(info)
        info.filename = info.filename.replace(old, "model/data/aotinductor/" + name + "/")
        zout.writestr(info, data)
"#;
    assert!(Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(members.join("model.pt2"))
        .arg(&package)
        .arg(name)
        .status()
        .unwrap()
        .success());
    parse_constant_table(&package).unwrap();
    let md = read_metadata(&testdata("mlp-cpu.tar.gz")).unwrap();
    let mut graph_class = md.value()["graph_class"].as_object().unwrap().clone();
    graph_class.insert("name".into(), Value::Str(name.into()));
    let declaration = GraphClassDeclaration::from_graph_class_value(&graph_class).unwrap();
    let toolchain = md.value()["toolchain"].clone();
    let block = validate_toolchain_block(&toolchain, Code::DeclarationToolchainInvalid).unwrap();
    let key = derive_key(declaration.class_hash(), md.sm(), &toolchain_axis(&block)).unwrap();
    let plan = MintOutput {
        sm: md.sm().to_string(),
        toolchain,
        host_isa: md.host_isa().clone(),
        package,
        declaration,
        literals: vec![],
        witness_lines: None,
        weights: None,
        parity: None,
    };
    Engine::open(store)
        .unwrap()
        .publish_mint(&key, &plan)
        .unwrap();
    key
}

#[test]
fn hostile_names_are_escaped_in_human_output_and_exact_in_json() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("store");
    let key = mint_named(d.path(), &store, HOSTILE);
    let s = store.as_os_str();

    // ls: the row stays one line, the name escaped.
    let out = run(&["ls".as_ref(), "--cas-root".as_ref(), s]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert_safe("ls", &text);
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(
        text.contains(
            "fleet/evil\\x1b[2J\\x1b]0;pwned\\x07\\u{9b}31m\\u{202e}txt.exe\\nerror: forged line"
        ),
        "{text}"
    );
    // ls --json: exact JSON, the name as stored.
    let out = run(&["ls".as_ref(), "--cas-root".as_ref(), s, "--json".as_ref()]);
    let rows = tcg_cj::parse_strict(&out.stdout).unwrap();
    assert_eq!(
        at(&rows.as_array().unwrap()[0], "graph_class").as_str(),
        Some(HOSTILE)
    );

    // export, verify, resolve: the summary lines on stderr.
    let env = d.path().join("graph.tar.gz");
    let out = run(&[
        "export".as_ref(),
        "--cas-root".as_ref(),
        s,
        key.as_ref(),
        env.as_os_str(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let out = run(&["verify".as_ref(), env.as_os_str()]);
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_safe("verify", &stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    let dest = d.path().join("g");
    let out = run(&[
        "resolve".as_ref(),
        "--cas-root".as_ref(),
        s,
        key.as_ref(),
        dest.as_os_str(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_safe("resolve", &stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");

    // explain --graph-class: the rendered report.
    let out = run(&[
        "explain".as_ref(),
        "--cas-root".as_ref(),
        s,
        "--graph-class".as_ref(),
        HOSTILE.as_ref(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert_safe("explain", &text);
    assert!(text.contains("\\x1b[2J"), "{text}");

    // inspect: an unverified statement's producer, on stderr.
    let key_file = d.path().join("k");
    assert!(Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "k@x", "-f"])
        .arg(&key_file)
        .status()
        .unwrap()
        .success());
    let signer = tcg_trust::Signer::from_file(&key_file).unwrap();
    let subject = tcg_core::engine::envelope_subject(&env).unwrap();
    let entry = signer
        .sign(&signer.statement(&subject, HOSTILE, 1_764_500_000))
        .unwrap();
    std::fs::write(
        tcg_core::engine::sig_path(&env),
        tcg_trust::document_bytes(&[entry]),
    )
    .unwrap();
    let out = run(&["inspect".as_ref(), env.as_os_str()]);
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_safe("inspect", &stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("producer=fleet/evil\\x1b"), "{stderr}");
    let out = run(&["inspect".as_ref(), env.as_os_str(), "--json".as_ref()]);
    let report = tcg_cj::parse_strict(&out.stdout).unwrap();
    assert_eq!(
        at(
            &at(&report, "signatures").as_array().unwrap()[0],
            "producer"
        )
        .as_str(),
        Some(HOSTILE)
    );
}

#[test]
fn error_messages_are_one_escaped_capped_line() {
    let d = tempfile::tempdir().unwrap();
    // A message embedding a hostile string (here, a path): one `error:` line.
    let path = d
        .path()
        .join("x\u{1b}[2J\nerror: forged line\u{202e}.tar.gz");
    let out = run(&["inspect".as_ref(), path.as_os_str()]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_safe("error", &stderr);
    assert_eq!(
        stderr.lines().filter(|l| l.starts_with("error:")).count(),
        1,
        "{stderr}"
    );
    assert!(
        stderr.contains("x\\x1b[2J\\nerror: forged line\\u{202e}.tar.gz"),
        "{stderr}"
    );
    // A very long one is capped.
    let long = d.path().join("y".repeat(200)).join("z".repeat(5000));
    let out = run(&["inspect".as_ref(), long.as_os_str()]);
    let stderr = String::from_utf8(out.stderr).unwrap();
    let first = stderr.lines().next().unwrap();
    assert!(first.len() < 4096 + 200, "{} bytes", first.len());
    assert!(first.contains("more bytes]"), "{first}");
}

#[test]
fn names_read_from_an_old_store_are_escaped_by_adopt() {
    let d = tempfile::tempdir().unwrap();
    let old = d.path().join("old");
    std::fs::create_dir(&old).unwrap();
    assert!(Command::new("tar")
        .arg("xzf")
        .arg(testdata("hashrepo-store.tar.gz"))
        .arg("-C")
        .arg(&old)
        .status()
        .unwrap()
        .success());
    // A ref file whose name and record carry escapes and a forged line.
    std::fs::write(
        old.join("refs")
            .join("evil\u{1b}[2J\u{9b}1m\nerror: forged"),
        "{\"format\":1,\"name\":\"x\u{1b}]0;t\u{7}\",\"target\":\"sha256:00\"}",
    )
    .unwrap();
    let new = d.path().join("new");
    let out = run(&[
        "adopt".as_ref(),
        "--from-hashrepo".as_ref(),
        old.as_os_str(),
        "--cas-root".as_ref(),
        new.as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_safe("adopt stdout", &stdout);
    assert_safe("adopt stderr", &stderr);
    assert_eq!(stdout.lines().count(), 2, "{stdout}");
    assert!(
        stdout.contains("refs/evil\\x1b[2J\\u{9b}1m\\nerror: forged"),
        "{stdout}"
    );
    // --json keeps the name exact.
    let out = run(&[
        "adopt".as_ref(),
        "--from-hashrepo".as_ref(),
        old.as_os_str(),
        "--cas-root".as_ref(),
        new.as_os_str(),
        "--json".as_ref(),
    ]);
    let report = tcg_cj::parse_strict(&out.stdout).unwrap();
    let names: Vec<&str> = at(&report, "graphs")
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|g| at(g, "ref_file").as_str())
        .collect();
    assert!(
        names.contains(&"evil\u{1b}[2J\u{9b}1m\nerror: forged"),
        "{names:?}"
    );
}
