//! Arguments that are not UTF-8 reach the binary as the OS gives them: a path
//! is used as it is, any other argument is a usage error (exit 2) — never a
//! panic (exit 101).

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_torch-compiled-graphs"))
}

#[test]
fn a_non_utf8_path_is_a_path() {
    let tmp = tempfile::tempdir().unwrap();
    let mut name = tmp.path().as_os_str().to_owned().into_vec();
    name.extend_from_slice(b"/missing-\xff.tar.gz");
    let out = bin()
        .arg("inspect")
        .arg(OsString::from_vec(name))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("code: io."), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_non_utf8_key_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = bin()
        .arg("check-key")
        .arg(OsString::from_vec(b"cg-key-\xff".to_vec()))
        .env("HOME", tmp.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("invalid UTF-8"), "{stderr}");
}

#[test]
fn the_python_commands_are_refused_with_a_hint_naming_the_console_script() {
    for (args, name) in [
        (vec!["build", "matrix.toml", "--executor", "ray"], "build"),
        (
            vec!["build-cell", "matrix.toml", "--index", "3"],
            "build-cell",
        ),
        (vec!["toolchain", "record"], "toolchain"),
    ] {
        let out = bin().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("error: `{name}` runs in Python")),
            "{stderr}"
        );
        assert!(
            stderr.contains(&format!("python -m torch_compiled_graphs {name}")),
            "{stderr}"
        );
        assert!(out.stdout.is_empty(), "{out:?}");
    }
}

#[test]
fn the_python_commands_are_listed_in_the_help() {
    let out = bin().arg("--help").output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    for name in ["build ", "build-cell", "toolchain"] {
        assert!(text.contains(name), "{text}");
    }
}
