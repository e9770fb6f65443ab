//! A graph whose wrapper calls an operator through torch's proxy executor is
//! refused by the native loader before anything is extracted
//! (`run.native_unsupported`). The package is the reference artifact's, with
//! one call of the form torch 2.15 generates for a `torch.library` custom op
//! without a C shim spliced into its wrapper, and the extern-kernel table
//! torch writes beside it. One test in this file: it owns the process's
//! `TMPDIR`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use tcg_core::artifact::{unpack, Metadata};
use tcg_core::Code;
use tcg_run::extract::extract;

const ENTRY: &str = "model/mlp";
const CALL: &str = "    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_proxy_executor_call_function(proxy_executor, 0, 0, std::array<int64_t, 0>{}.data(), 2, std::array<AtenTensorHandle, 2>{buf0, buf1}.data()));\n";
const TABLE: &str = r#"{"nodes": [{"name": "buf1", "node": {"target": "tcgprobe::twice", "inputs": [], "outputs": [{"as_tensor": {"name": "buf1"}}], "metadata": {"torch_library_custom_op": "1"}}}]}"#;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The reference package with `CALL` inserted after the first line of the
/// wrapper that mentions `proxy_executor` (the run function's signature), and
/// with `table` (when given) beside the wrapper.
fn doctored(dir: &Path, table: Option<&str>) -> PathBuf {
    let graph = dir.join(format!("graph-{}", table.is_some()));
    unpack(
        &root().join("testdata/reference-0.2.0/mlp-cpu.tar.gz"),
        &graph,
        &mut |_: &Metadata| Ok(()),
    )
    .unwrap();
    let mut input =
        zip::ZipArchive::new(std::fs::File::open(graph.join("model.pt2")).unwrap()).unwrap();
    let out_path = dir.join(format!("doctored-{}.pt2", table.is_some()));
    let mut out = zip::ZipWriter::new(std::fs::File::create(&out_path).unwrap());
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let mut spliced = false;
    for i in 0..input.len() {
        let mut member = input.by_index(i).unwrap();
        let name = member.name().unwrap().into_owned();
        let mut bytes = Vec::new();
        member.read_to_end(&mut bytes).unwrap();
        if let Some(stem) = name.strip_suffix(".wrapper.cpp") {
            let text = String::from_utf8(bytes).unwrap();
            let at = text.find("AOTIProxyExecutorHandle proxy_executor").unwrap();
            let line_end = at + text[at..].find('\n').unwrap() + 1;
            bytes = format!("{}{CALL}{}", &text[..line_end], &text[line_end..]).into_bytes();
            if let Some(table) = table {
                out.start_file(format!("{stem}.wrapper.json"), stored)
                    .unwrap();
                out.write_all(table.as_bytes()).unwrap();
            }
            spliced = true;
        }
        out.start_file(name, stored).unwrap();
        out.write_all(&bytes).unwrap();
    }
    out.finish().unwrap();
    assert!(spliced);
    out_path
}

fn native_dirs(tmp: &Path) -> usize {
    std::fs::read_dir(tmp)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("tcg-native"))
        })
        .count()
}

#[test]
fn a_proxy_executor_call_is_refused_before_anything_is_extracted() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    // SAFETY: the only test of this process, before any thread reads the
    // environment.
    unsafe { std::env::set_var("TMPDIR", &tmp) };
    assert_eq!(std::env::temp_dir(), tmp);

    // The untouched reference package extracts (it has no such call).
    let graph = dir.path().join("plain");
    unpack(
        &root().join("testdata/reference-0.2.0/mlp-cpu.tar.gz"),
        &graph,
        &mut |_: &Metadata| Ok(()),
    )
    .unwrap();
    let plain = extract(&graph.join("model.pt2"), ENTRY, None).expect("the plain package extracts");
    assert!(plain.shared_object().is_file());
    drop(plain);
    assert_eq!(
        native_dirs(&tmp),
        0,
        "the plain extraction is removed when dropped"
    );

    for (table, named) in [
        (Some(TABLE), "tcgprobe::twice ×1"),
        (None, "extern kernel 0 ×1"),
    ] {
        let package = doctored(dir.path(), table);
        let Err(err) = extract(&package, ENTRY, None) else {
            panic!("a proxy call must be refused ({table:?})");
        };
        assert_eq!(err.code(), Code::RunNativeUnsupported, "{err}");
        let message = err.to_string();
        assert!(message.contains(named), "{message}");
        assert!(
            message.contains("aoti_torch_proxy_executor_call_function"),
            "{message}"
        );
        assert!(message.contains("use load()"), "{message}");
        // Refused before the private directory exists: nothing was extracted.
        assert_eq!(native_dirs(&tmp), 0, "nothing was extracted for {table:?}");
    }

    // The Rust serving path: the doctored package packed with the reference
    // metadata, imported into a real store, resolved and refused by Served.
    let again = dir.path().join("again");
    std::fs::create_dir(&again).unwrap();
    let package = doctored(&again, Some(TABLE));
    let envelope = dir.path().join("doctored.tar.gz");
    let md =
        tcg_core::artifact::read_metadata(&root().join("testdata/reference-0.2.0/mlp-cpu.tar.gz"))
            .unwrap();
    tcg_core::artifact::pack(
        &package,
        &tcg_cj::Value::Object(md.value().clone()),
        None,
        &envelope,
    )
    .unwrap();
    let store = dir.path().join("store");
    tcg_core::engine::Engine::open(&store)
        .unwrap()
        .import_artifact(md.key(), &envelope)
        .unwrap();
    let torch_lib = std::env::var_os("TCG_TORCH_LIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/lib/python3.11/site-packages/torch/lib"));
    let served = tcg_run::Served::open(
        &store,
        md.key(),
        &dir.path().join("served"),
        &torch_lib,
        "cpu",
        &root().join("testdata/reference-0.2.0/mlp-cpu.weights.safetensors"),
    );
    let Err(err) = served else {
        panic!("Served must refuse the graph");
    };
    assert_eq!(err.code(), Code::RunNativeUnsupported, "{err}");
    assert!(err.to_string().contains("tcgprobe::twice ×1"), "{err}");
    assert_eq!(native_dirs(&tmp), 0, "Served extracted nothing");
}
