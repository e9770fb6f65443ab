//! Identity bindings: key grammar, keys, folds, digests and declarations.

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict, PyString};
use tcg_cj::{Map, Value};
use tcg_core::identity::{self as id, DeclarationInput, GraphClassDeclaration, LiteralRow};
use tcg_core::{Code, Error, Kind};

use crate::convert::{from_value, to_value};
use crate::errors::IntoPyResult;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("COMPILED_GRAPH_FORMAT", id::COMPILED_GRAPH_FORMAT)?;
    m.add("ARTIFACT_KIND", id::ARTIFACT_KIND)?;
    m.add("KEY_SCHEME", id::KEY_SCHEME)?;
    m.add(
        "COMPILE_POLICIES",
        id::COMPILE_POLICIES
            .iter()
            .copied()
            .collect::<std::collections::BTreeMap<_, _>>(),
    )?;
    m.add("KEY_AXES", id::KEY_AXES.to_vec())?;
    m.add("KEY_DIGEST_HEX", id::KEY_DIGEST_HEX)?;
    m.add("MAX_KEY_LENGTH", id::MAX_KEY_LENGTH)?;
    m.add("TOOLCHAIN_EXCLUDED", id::TOOLCHAIN_EXCLUDED.to_vec())?;
    m.add("GRAPH_FACTS_VERSION", id::GRAPH_FACTS_VERSION)?;
    m.add("CALL_INGRESS_VERSION", id::CALL_INGRESS_VERSION)?;
    m.add_function(wrap_pyfunction!(is_compiled_graph_key, m)?)?;
    m.add_function(wrap_pyfunction!(derive_key, m)?)?;
    m.add_function(wrap_pyfunction!(split_key, m)?)?;
    m.add_function(wrap_pyfunction!(key_from_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(toolchain_axis, m)?)?;
    m.add_function(wrap_pyfunction!(literal_digest, m)?)?;
    m.add_function(wrap_pyfunction!(ingress_digest, m)?)?;
    m.add_function(wrap_pyfunction!(graph_witness, m)?)?;
    m.add_function(wrap_pyfunction!(canonical_json, m)?)?;
    m.add_function(wrap_pyfunction!(declare, m)?)?;
    Ok(())
}

fn value_in(obj: &Bound<'_, PyAny>, kind: Kind) -> PyResult<Value> {
    to_value(obj, "$")
        .map_err(|e| Error::from_cj(kind, &e))
        .py()
}

fn value_as(obj: &Bound<'_, PyAny>, code: Code, what: &str) -> PyResult<Value> {
    to_value(obj, what)
        .map_err(|e| Error::new(code, format!("{what} is not canonical json: {e}")))
        .py()
}

/// Whether `value` is a compiled-graph key: a `str` matching the grammar.
#[pyfunction]
fn is_compiled_graph_key(value: &Bound<'_, PyAny>) -> bool {
    value
        .cast::<PyString>()
        .ok()
        .and_then(|s| s.to_str().ok().map(id::is_compiled_graph_key))
        .unwrap_or(false)
}

/// `(scheme, digest)` of a compiled-graph key; anything else is
/// `identity.key_invalid`.
#[pyfunction]
fn split_key(value: &Bound<'_, PyAny>) -> PyResult<(String, String)> {
    let text = value
        .cast::<PyString>()
        .ok()
        .and_then(|s| s.to_str().ok().map(str::to_owned));
    match text.as_deref().and_then(id::split_key) {
        Some((scheme, digest)) => Ok((scheme.to_owned(), digest.to_owned())),
        None => Err(crate::errors::to_py(Error::new(
            Code::IdentityKeyInvalid,
            format!(
                "not a compiled-graph key: {}",
                value.repr().map(|r| r.to_string()).unwrap_or_default()
            ),
        ))),
    }
}

/// `cg-key-v1` of an axes mapping `{"graph", "sm", "toolchain"}`.
#[pyfunction]
fn derive_key(axes: &Bound<'_, PyAny>) -> PyResult<String> {
    match value_in(axes, Kind::Identity)? {
        Value::Object(map) => id::derive_key_from_axes(&map).py(),
        _ => Err(Error::new(
            Code::IdentityAxisMissing,
            "axes must be a dict of graph, sm and toolchain",
        ))
        .py(),
    }
}

/// The key an artifact's metadata restates (SPEC-v1 §3.3).
#[pyfunction]
fn key_from_metadata(metadata: &Bound<'_, PyAny>) -> PyResult<String> {
    match value_in(metadata, Kind::Identity)? {
        Value::Object(map) => id::key_from_metadata(&map).py(),
        _ => Err(Error::new(
            Code::IdentityMetadataIncomplete,
            "metadata must be a dict",
        ))
        .py(),
    }
}

/// Convert a toolchain mapping with `str()` on keys and values (SPEC-v1 §4.4).
pub fn toolchain_block(block: &Bound<'_, PyAny>) -> PyResult<Value> {
    let dict = block.cast::<PyDict>().map_err(|_| {
        crate::errors::to_py(Error::new(
            Code::DeclarationToolchainInvalid,
            "toolchain block must be a dict",
        ))
    })?;
    let mut map = Map::new();
    for (k, v) in dict.iter() {
        map.insert(
            k.str()?.to_str()?.to_owned(),
            Value::Str(v.str()?.to_str()?.to_owned()),
        );
    }
    Ok(Value::Object(map))
}

/// The toolchain axis (hex16) of a toolchain block.
#[pyfunction]
fn toolchain_axis(block: &Bound<'_, PyAny>) -> PyResult<String> {
    let block = toolchain_block(block)?;
    let block = id::validate_toolchain_block(&block, Code::DeclarationToolchainInvalid).py()?;
    Ok(id::toolchain_axis(&block))
}

/// The literal digest over rows `(name, dtype, shape, raw bytes)`.
#[pyfunction]
fn literal_digest(
    py: Python<'_>,
    rows: Vec<(String, String, Vec<u64>, PyBackedBytes)>,
) -> PyResult<String> {
    let rows: Vec<LiteralRow> = rows
        .into_iter()
        .map(|(name, dtype, shape, bytes)| LiteralRow {
            name,
            dtype,
            shape,
            bytes: bytes.to_vec(),
        })
        .collect();
    py.detach(|| id::literal_digest(&rows)).py()
}

/// Validate a call ingress and return its hex32 digest.
#[pyfunction]
fn ingress_digest(ingress: &Bound<'_, PyAny>) -> PyResult<String> {
    let v = value_as(ingress, Code::DeclarationIngressInvalid, "ingress")?;
    id::ingress_digest(&v).py()
}

/// hex16 of the canonical lines joined by LF.
#[pyfunction]
fn graph_witness(lines: Vec<String>) -> String {
    id::graph_witness(&lines)
}

/// CJ bytes of a JSON value (SPEC-v1 §2), as ASCII `bytes`.
#[pyfunction]
fn canonical_json<'py>(
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let v = value_in(value, Kind::Identity)?;
    let bytes = tcg_cj::to_canonical(&v)
        .map_err(|e| Error::from_cj(Kind::Identity, &e))
        .py()?;
    Ok(PyBytes::new(py, &bytes))
}

fn sequence_of_pairs(obj: &Bound<'_, PyAny>, code: Code, what: &str) -> PyResult<Value> {
    let refuse = |m: String| crate::errors::to_py(Error::new(code, m));
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyDict>()
        || obj.is_instance_of::<PyBytes>()
    {
        return Err(refuse(format!(
            "{what} must be a sequence of (name, value) pairs"
        )));
    }
    let mut out = Vec::new();
    for (i, item) in obj
        .try_iter()
        .map_err(|_| refuse(format!("{what} must be a sequence of (name, value) pairs")))?
        .enumerate()
    {
        let item = item?;
        let parts: Vec<Bound<'_, PyAny>> = match item.try_iter() {
            Ok(it) if !item.is_instance_of::<PyString>() => it.collect::<PyResult<_>>()?,
            _ => return Err(refuse(format!("{what}[{i}] must be a (name, value) pair"))),
        };
        let [name, value] = parts.as_slice() else {
            return Err(refuse(format!("{what}[{i}] must be a (name, value) pair")));
        };
        let name = name.str()?.to_str()?.to_owned();
        let value = value_as(value, code, &format!("{what}[{i}]"))?;
        out.push(Value::Array(vec![Value::Str(name), value]));
    }
    Ok(Value::Array(out))
}

/// Validate a declaration; returns its canonical fields and `class_hash`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (graph_class, target, graph, graph_witness, range_digest, fork, class_dims, strict, lora_bucket, literal_values, placement))]
fn declare<'py>(
    py: Python<'py>,
    graph_class: &Bound<'py, PyAny>,
    target: &Bound<'py, PyAny>,
    graph: &Bound<'py, PyAny>,
    graph_witness: &Bound<'py, PyAny>,
    range_digest: &Bound<'py, PyAny>,
    fork: &Bound<'py, PyAny>,
    class_dims: &Bound<'py, PyAny>,
    strict: &Bound<'py, PyAny>,
    lora_bucket: &Bound<'py, PyAny>,
    literal_values: &Bound<'py, PyAny>,
    placement: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    // Fields that are not JSON at all fall through as a value of the wrong type,
    // so that the core refuses them with the rule's own code.
    let loose = |obj: &Bound<'py, PyAny>| to_value(obj, "$").unwrap_or(Value::Null);
    let mut devices = Vec::new();
    for entry in placement.try_iter()? {
        let entry = entry?;
        if entry.is_truthy()? {
            devices.push(entry.str()?.to_str()?.to_owned());
        }
    }
    let input = DeclarationInput {
        graph_class: loose(graph_class),
        target: loose(target),
        graph: value_as(graph, Code::DeclarationGraphInvalid, "graph")?,
        graph_witness: loose(graph_witness),
        range_digest: loose(range_digest),
        fork: sequence_of_pairs(fork, Code::DeclarationForkInvalid, "fork")?,
        class_dims: sequence_of_pairs(class_dims, Code::DeclarationClassDimsInvalid, "class_dims")?,
        strict: loose(strict),
        lora_bucket: loose(lora_bucket),
        literal_values: loose(literal_values),
        placement: devices,
    };
    let decl = GraphClassDeclaration::new(input).py()?;
    let mut fields = match decl.to_value() {
        Value::Object(m) => m,
        _ => unreachable!("a declaration renders as an object"),
    };
    fields.insert("facts".into(), decl.facts());
    from_value(py, &Value::Object(fields))
}
