//! Artifact bindings: pack, unpack, read_metadata, inspect, verify and the
//! package's constant table, for tools, tests and the mint path.

use std::path::PathBuf;

use pyo3::prelude::*;
use tcg_cj::{Map, Value};
use tcg_core::artifact;
use tcg_core::host_isa::HostFacts;
use tcg_core::Kind;

use crate::convert::{from_value, to_value};
use crate::errors::IntoPyResult;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(artifact_pack, m)?)?;
    m.add_function(wrap_pyfunction!(artifact_unpack, m)?)?;
    m.add_function(wrap_pyfunction!(artifact_read_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(artifact_inspect, m)?)?;
    m.add_function(wrap_pyfunction!(artifact_verify, m)?)?;
    m.add_function(wrap_pyfunction!(package_constant_table, m)?)?;
    m.add_function(wrap_pyfunction!(package_weights_contract, m)?)?;
    m.add_function(wrap_pyfunction!(package_plan_binding, m)?)?;
    m.add_function(wrap_pyfunction!(package_check_torch_loader, m)?)?;
    m.add_function(wrap_pyfunction!(package_own_cxx_runtime, m)?)?;
    m.add_function(wrap_pyfunction!(package_mint_record, m)?)?;
    m.add_function(wrap_pyfunction!(package_native_calls, m)?)?;
    m.add_function(wrap_pyfunction!(package_input_strides, m)?)?;
    m.add_function(wrap_pyfunction!(package_shim_imports, m)?)?;
    m.add_function(wrap_pyfunction!(shim_set_v1_missing, m)?)?;
    m.add("SHIM_SET_V1", tcg_run::shim_set::SHIM_SET_V1)?;
    m.add("ENVELOPE_FILE_NAME", artifact::ENVELOPE_FILE_NAME)?;
    m.add("METADATA_MEMBER", artifact::METADATA_MEMBER)?;
    m.add("PACKAGE_MEMBER", artifact::PACKAGE_MEMBER)?;
    m.add("LITERALS_MEMBER", artifact::LITERALS_MEMBER)?;
    Ok(())
}

/// Pack `package` (and a literal payload) with `metadata` into a new envelope at `out`.
#[pyfunction]
#[pyo3(signature = (package, metadata, literals, out))]
fn artifact_pack(
    py: Python<'_>,
    package: PathBuf,
    metadata: &Bound<'_, PyAny>,
    literals: Option<PathBuf>,
    out: PathBuf,
) -> PyResult<u64> {
    let md = to_value(metadata, "metadata")
        .map_err(|e| tcg_core::Error::from_cj(Kind::Artifact, &e))
        .py()?;
    let report = py
        .detach(|| artifact::pack(&package, &md, literals.as_deref(), &out))
        .py()?;
    Ok(report.envelope_bytes)
}

/// Unpack and fully verify an envelope into the new directory `dest`;
/// with `admit_host`, refuse (before publishing) what this host cannot run.
#[pyfunction]
#[pyo3(signature = (path, dest, admit_host=true))]
fn artifact_unpack<'py>(
    py: Python<'py>,
    path: PathBuf,
    dest: PathBuf,
    admit_host: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let md = py
        .detach(|| {
            let host = if admit_host {
                Some(HostFacts::read()?)
            } else {
                None
            };
            let mut admission = |m: &artifact::Metadata| -> tcg_core::Result<()> {
                match &host {
                    Some(h) => m.host_isa().admit_on(h),
                    None => Ok(()),
                }
            };
            artifact::unpack(&path, &dest, &mut admission).map(|r| r.metadata)
        })
        .py()?;
    from_value(py, &Value::Object(md.value().clone()))
}

/// The validated metadata of an envelope (reads only its first member).
#[pyfunction]
fn artifact_read_metadata(py: Python<'_>, path: PathBuf) -> PyResult<Bound<'_, PyAny>> {
    let md = py.detach(|| artifact::read_metadata(&path)).py()?;
    from_value(py, &Value::Object(md.value().clone()))
}

/// A bounded look: compressed size, metadata size and the metadata.
#[pyfunction]
fn artifact_inspect(py: Python<'_>, path: PathBuf) -> PyResult<Bound<'_, PyAny>> {
    let v = py.detach(|| artifact::inspect(&path)).py()?;
    from_value(py, &v)
}

/// Verify an envelope completely; with `host`, also admit it on this host.
#[pyfunction]
#[pyo3(signature = (path, host=false))]
fn artifact_verify(py: Python<'_>, path: PathBuf, host: bool) -> PyResult<Bound<'_, PyAny>> {
    let r = py.detach(|| artifact::verify(&path, host)).py()?;
    let mut m = Map::new();
    m.insert("key".into(), r.key().into());
    m.insert(
        "metadata".into(),
        Value::Object(r.envelope.metadata.value().clone()),
    );
    m.insert(
        "package_bytes".into(),
        Value::Int(r.envelope.package_bytes as i64),
    );
    m.insert("host_admitted".into(), Value::Bool(r.admitted.is_some()));
    from_value(py, &Value::Object(m))
}

/// The package's wrapper constant table as metadata rows (fqn, source, dtype, shape).
#[pyfunction]
fn package_constant_table(py: Python<'_>, package: PathBuf) -> PyResult<Bound<'_, PyAny>> {
    let rows = py
        .detach(|| artifact::parse_constant_table(&package))
        .py()?;
    from_value(
        py,
        &Value::Array(rows.iter().map(|r| r.to_value()).collect()),
    )
}

/// The declared constant fqns and constant rows of a metadata mapping the
/// caller already verified (a resolved graph's): read, not validated again.
pub(crate) fn contract_inputs(
    metadata: &Bound<'_, PyAny>,
) -> PyResult<(
    std::collections::BTreeSet<String>,
    Vec<artifact::ConstantRow>,
)> {
    let md = to_value(metadata, "metadata")
        .map_err(|e| tcg_core::Error::from_cj(Kind::Artifact, &e))
        .py()?;
    let bad = |what: &str| {
        tcg_core::Error::new(
            tcg_core::Code::RunPackageInvalid,
            format!("the graph's metadata has no valid {what}"),
        )
    };
    let class = md
        .as_object()
        .and_then(|o| o.get("graph_class"))
        .and_then(Value::as_object)
        .ok_or_else(|| bad("graph_class"))
        .py()?;
    let declared = class
        .get("graph")
        .and_then(Value::as_object)
        .and_then(|g| g.get("constant_fqns"))
        .and_then(Value::as_array)
        .ok_or_else(|| bad("graph.constant_fqns"))
        .py()?
        .iter()
        .map(|v| {
            v.as_str()
                .map(str::to_owned)
                .ok_or_else(|| bad("graph.constant_fqns"))
        })
        .collect::<Result<_, _>>()
        .py()?;
    let rows = class
        .get("constants")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("constants"))
        .py()?
        .iter()
        .map(artifact::ConstantRow::from_value)
        .collect::<Result<Vec<_>, _>>()
        .py()?;
    Ok((declared, rows))
}

/// The weights contract of a resolved package (its annex's, or the one its
/// metadata implies): `{"v", "kinds", "alias_groups", "dropped", "bound", "recorded"}`.
#[pyfunction]
fn package_weights_contract<'py>(
    py: Python<'py>,
    package: PathBuf,
    metadata: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let (declared, rows) = contract_inputs(metadata)?;
    let contract = py
        .detach(|| artifact::package::weights_contract_of(&package, &declared, &rows))
        .py()?;
    from_value(py, &contract.to_report())
}

/// Plan how `names` bind the package's constants: `{"bind": [[row, name], ...],
/// "duplicates": [[bound, other], ...], "ignored": [name, ...]}`, or the
/// refusal (`run.constant_unexpected`, `run.constant_missing`).
#[pyfunction]
fn package_plan_binding<'py>(
    py: Python<'py>,
    package: PathBuf,
    metadata: &Bound<'py, PyAny>,
    names: Vec<String>,
) -> PyResult<Bound<'py, PyAny>> {
    let (declared, rows) = contract_inputs(metadata)?;
    let plan = py
        .detach(|| {
            artifact::package::weights_contract_of(&package, &declared, &rows)?
                .plan(names.iter().map(String::as_str))
        })
        .py()?;
    let pair = |(a, b): &(String, String)| {
        Value::Array(vec![Value::Str(a.clone()), Value::Str(b.clone())])
    };
    let mut out = Map::new();
    out.insert(
        "bind".into(),
        Value::Array(plan.bind.iter().map(pair).collect()),
    );
    out.insert(
        "duplicates".into(),
        Value::Array(plan.duplicates.iter().map(pair).collect()),
    );
    out.insert(
        "ignored".into(),
        Value::Array(plan.ignored.iter().cloned().map(Value::Str).collect()),
    );
    from_value(py, &Value::Object(out))
}

/// Refuse (`run.loader_unsupported`) a package torch's package loader cannot
/// load safely: its `.so` carries its own C++ runtime.
#[pyfunction]
fn package_check_torch_loader(py: Python<'_>, package: PathBuf, entry: String) -> PyResult<()> {
    py.detach(|| artifact::package::check_torch_loader(&package, &entry))
        .py()
}

/// The C++-runtime symbols the entry's `.so` defines: empty for a `.so` that
/// uses the process's runtime (or none); non-empty for one that carries its
/// own, which `load()` and parity run through the torch-free runner. A
/// package it cannot read is `run.package_invalid`.
#[pyfunction]
fn package_own_cxx_runtime(
    py: Python<'_>,
    package: PathBuf,
    entry: String,
) -> PyResult<Vec<String>> {
    py.detach(|| artifact::package::own_cxx_runtime_to_load(&package, &entry))
        .py()
}

/// The package's mint record (validated), or `None` when it has none
/// (artifacts minted before the record, 0.2.0 among them).
#[pyfunction]
fn package_mint_record(py: Python<'_>, package: PathBuf) -> PyResult<Bound<'_, PyAny>> {
    let record = py
        .detach(|| artifact::package::package_mint_record(&package))
        .py()?;
    match record {
        Some(r) => from_value(py, &Value::Object(r.value)),
        None => Ok(py.None().into_bound(py)),
    }
}

/// The calls of the package's wrapper the native path cannot make, scanned
/// now: `[{call, count, target}]`.
#[pyfunction]
fn package_native_calls(py: Python<'_>, package: PathBuf) -> PyResult<Bound<'_, PyAny>> {
    let calls = py
        .detach(|| artifact::package::package_native_calls(&package))
        .py()?;
    from_value(py, &artifact::package::native_calls::calls_value(&calls))
}

/// The static strides (in elements) the package's wrapper checks for each
/// input, one list per input and one item per dimension (`None` where the
/// stride is symbolic); `None` when the wrapper states no input checks.
#[pyfunction]
fn package_input_strides(
    py: Python<'_>,
    package: PathBuf,
) -> PyResult<Option<Vec<Vec<Option<i64>>>>> {
    let facts = py
        .detach(|| {
            let text = artifact::package::package_wrapper_text(&package)?;
            tcg_run::inputs::input_facts(&text)
        })
        .py()?;
    Ok(facts.map(|f| f.into_iter().map(|f| f.strides).collect()))
}

/// What the entry's `.so` imports, read from its dynamic symbol table now:
/// `{"aoti_torch": [...], "other": [...]}`, each sorted (the libtorch C shim
/// functions, and every other import no system library provides). `entry`
/// `None` takes the package's only entry.
#[pyfunction]
#[pyo3(signature = (package, entry=None))]
fn package_shim_imports(
    py: Python<'_>,
    package: PathBuf,
    entry: Option<String>,
) -> PyResult<Bound<'_, PyAny>> {
    let imports = py
        .detach(|| artifact::package::shim_imports(&package, entry.as_deref()))
        .py()?;
    let list = |v: Vec<String>| Value::Array(v.into_iter().map(Value::Str).collect());
    let mut out = Map::new();
    out.insert("aoti_torch".into(), list(imports.aoti_torch));
    out.insert("other".into(), list(imports.other));
    from_value(py, &Value::Object(out))
}

/// What `shim set v1` lacks to serve a package with these imports (the
/// `{"aoti_torch", "other"}` of [`package_shim_imports`]): the names, sorted
/// and distinct; empty when the libtorch-free runtime can serve it
/// (`tcg_run::shim_set::package_covered`, docs/shim.md).
#[pyfunction]
fn shim_set_v1_missing(aoti_torch: Vec<String>, other: Vec<String>) -> Vec<String> {
    let imports = artifact::package::shim_imports::ShimImports { aoti_torch, other };
    match tcg_run::shim_set::package_covered(&imports) {
        Ok(()) => Vec::new(),
        Err(missing) => missing,
    }
}
