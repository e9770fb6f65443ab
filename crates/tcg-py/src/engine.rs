//! Engine bindings: conversion, GIL release around store and file work, and
//! the mint callback bridge (the callback re-acquires the GIL).

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use tcg_cj::{Map, Value};
use tcg_core::artifact::literals::LiteralTensor;
use tcg_core::engine::{
    Engine, MintOutput, Request, Resolved, StoreResult, TrustSettings, EXPLAIN_NEIGHBOURS,
};
use tcg_core::host_isa::HostIsa;
use tcg_core::identity::{
    derive_key, graph_witness, toolchain_axis, validate_toolchain_block, DeclarationInput,
    GraphClassDeclaration, KeyFacts, WitnessLines,
};
use tcg_core::{Code, Error};

use crate::convert::{from_value, to_value};
use crate::errors::{to_py, IntoPyResult};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeEngine>()?;
    m.add_function(wrap_pyfunction!(render_explanation, m)?)?;
    Ok(())
}

/// The text form of an explanation report: `kind` is `explain`, `pair` or `class`.
#[pyfunction]
fn render_explanation(kind: &str, report: &Bound<'_, PyAny>) -> PyResult<String> {
    let value = to_value(report, "report")
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("explanation report: {e}")))?;
    match kind {
        "explain" => Ok(tcg_core::engine::render_explanation(&value)),
        "pair" => Ok(tcg_core::engine::render_pair(&value)),
        "class" => Ok(tcg_core::engine::render_class(&value)),
        other => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "unknown explanation kind {other:?}"
        ))),
    }
}

fn key_arg(key: &Bound<'_, PyAny>) -> PyResult<String> {
    match key.cast::<PyString>() {
        Ok(s) => Ok(s.to_str()?.to_owned()),
        Err(_) => Err(to_py(Error::new(
            Code::StoreKeyInvalid,
            "v1 storage requires a compiled-graph key (a str)",
        ))),
    }
}

fn resolved_value(r: &Resolved) -> Value {
    let mut m = Map::new();
    m.insert("key".into(), r.key.clone().into());
    m.insert(
        "destination".into(),
        r.destination.display().to_string().into(),
    );
    m.insert("metadata".into(), Value::Object(r.metadata.value().clone()));
    m.insert("manifest".into(), r.manifest.clone().into());
    m.insert("source".into(), r.source.as_str().into());
    Value::Object(m)
}

fn store_result_value(r: &StoreResult) -> Value {
    let mut m = Map::new();
    m.insert("outcome".into(), r.outcome.as_str().into());
    m.insert("key".into(), r.key.clone().into());
    m.insert("manifest".into(), r.manifest.clone().into());
    Value::Object(m)
}

fn field<'py>(d: &Bound<'py, PyDict>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(name)?
        .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(format!("mint result lacks {name:?}")))
}

fn json(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Value> {
    to_value(obj, what).map_err(|e| {
        to_py(Error::new(
            Code::CompileResultInvalid,
            format!("mint result {what}: {e}"),
        ))
    })
}

/// A declaration from its `to_dict()` form (fields as `GraphClassDeclaration` names them).
fn declaration_from_dict(decl: &Bound<'_, PyDict>) -> PyResult<GraphClassDeclaration> {
    let get = |k: &str| -> PyResult<Value> { json(&field(decl, k)?, k) };
    let placement: Vec<String> = field(decl, "placement")?.extract()?;
    GraphClassDeclaration::new(DeclarationInput {
        graph_class: get("graph_class")?,
        target: get("target")?,
        graph: get("graph")?,
        graph_witness: get("graph_witness")?,
        range_digest: get("range_digest")?,
        fork: get("fork")?,
        class_dims: get("class_dims")?,
        strict: get("strict")?,
        lora_bucket: get("lora_bucket")?,
        literal_values: get("literal_values")?,
        placement,
    })
    .py()
}

/// Convert the Python mint callback's result.
fn mint_output(obj: &Bound<'_, PyAny>) -> PyResult<MintOutput> {
    let d = obj.cast::<PyDict>()?;
    let declaration = declaration_from_dict(field(d, "declaration")?.cast::<PyDict>()?)?;
    let host_isa = HostIsa::from_value(
        &json(&field(d, "host_isa")?, "host_isa")?,
        Code::CompileHostPolicy,
    )
    .py()?;
    let mut literals = Vec::new();
    for item in field(d, "literals")?.try_iter()? {
        let (fqn, dtype, shape, bytes): (String, String, Vec<u64>, Vec<u8>) = item?.extract()?;
        literals.push(LiteralTensor {
            fqn,
            dtype,
            shape,
            bytes,
        });
    }
    Ok(MintOutput {
        package: field(d, "package")?.extract()?,
        declaration,
        sm: field(d, "sm")?.extract()?,
        toolchain: json(&field(d, "toolchain")?, "toolchain")?,
        host_isa,
        literals,
        witness_lines: match d.get_item("witness_lines")? {
            Some(lines) if !lines.is_none() => Some(lines.extract()?),
            _ => None,
        },
        weights: match d.get_item("weights")? {
            Some(w) if !w.is_none() => Some(json(&w, "weights")?),
            _ => None,
        },
        parity: match d.get_item("parity")? {
            Some(p) if !p.is_none() => Some(json(&p, "parity")?),
            _ => None,
        },
    })
}

/// The longest `lock_timeout` accepted, in seconds (one year): longer waits
/// are `None` (wait indefinitely) in all but name, and far larger values
/// overflow the clock.
pub const MAX_LOCK_TIMEOUT_SECS: f64 = 365.0 * 24.0 * 3600.0;

/// A `lock_timeout` in seconds as a duration: finite, not negative, at most
/// [`MAX_LOCK_TIMEOUT_SECS`]; anything else is a `ValueError`.
fn lock_timeout_duration(seconds: f64) -> PyResult<Duration> {
    if !seconds.is_finite() || !(0.0..=MAX_LOCK_TIMEOUT_SECS).contains(&seconds) {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "lock_timeout must be a finite number of seconds from 0 to {MAX_LOCK_TIMEOUT_SECS}, or None; got {seconds}"
        )));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// The native engine over one store root. The Python `Engine` wraps it.
#[pyclass(module = "torch_compiled_graphs._native", frozen)]
pub struct NativeEngine {
    inner: Engine,
    remote_url: Option<String>,
}

#[pymethods]
impl NativeEngine {
    #[new]
    #[pyo3(signature = (root, lock_timeout=None, remote=None, signing_key=None, trust=None, revoked_keys=None, producer=None))]
    // One parameter a Python keyword argument: pyo3 maps them one to one.
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        root: PathBuf,
        lock_timeout: Option<f64>,
        remote: Option<String>,
        signing_key: Option<PathBuf>,
        trust: Option<PathBuf>,
        revoked_keys: Option<PathBuf>,
        producer: Option<String>,
    ) -> PyResult<Self> {
        let timeout = lock_timeout.map(lock_timeout_duration).transpose()?;
        let settings = TrustSettings {
            signing_key,
            trust,
            revoked_keys,
            producer,
        }
        .with_env();
        let engine = py
            .detach(|| Ok::<_, Error>(Engine::open(&root)?.with_trust(settings.load()?)))
            .py()?;
        let mut engine = engine.with_lock_timeout(timeout);
        // Only the URL is checked here: the client is built on the first miss.
        if let Some(url) = &remote {
            let r = tcg_remote::Remote::from_url(url).py()?;
            engine = engine.with_remote(std::sync::Arc::new(r));
        }
        Ok(NativeEngine {
            inner: engine,
            remote_url: remote,
        })
    }

    /// The remote URL, if one is configured.
    #[getter]
    fn remote(&self) -> Option<String> {
        self.remote_url.clone()
    }

    /// Whether a trust policy is set.
    #[getter]
    fn trusting(&self) -> bool {
        self.inner.trust().has_policy()
    }

    /// Whether mints are signed.
    #[getter]
    fn signing(&self) -> bool {
        self.inner.trust().has_signer()
    }

    #[pyo3(signature = (key, key_file, producer=None))]
    fn sign<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        key_file: PathBuf,
        producer: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let key = key_arg(key)?;
        let v = py
            .detach(|| {
                let signer = tcg_trust::Signer::from_file(&key_file).map_err(Error::from_trust)?;
                self.inner.sign_stored(&key, &signer, producer.as_deref())
            })
            .py()?;
        from_value(py, &v)
    }

    fn signers<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let key = key_arg(key)?;
        let v = py.detach(|| self.inner.signers(&key)).py()?;
        from_value(py, &Value::Array(v))
    }

    /// The store root.
    #[getter]
    fn root(&self) -> PathBuf {
        self.inner.store().root().to_path_buf()
    }

    fn resolve<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        destination: PathBuf,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let key = key_arg(key)?;
        let found = py.detach(|| self.inner.resolve(&key, &destination)).py()?;
        found
            .map(|r| from_value(py, &resolved_value(&r)))
            .transpose()
    }

    #[pyo3(signature = (key, destination, target, toolchain, mint))]
    fn ensure<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        destination: PathBuf,
        target: &str,
        toolchain: &Bound<'py, PyAny>,
        mint: Py<PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let key = key_arg(key)?;
        let block = crate::identity::toolchain_block(toolchain)?;
        let request = Request::new(target, &block).py()?;
        let raised: Mutex<Option<PyErr>> = Mutex::new(None);
        let result = py.detach(|| {
            let mut callback = || -> Result<MintOutput, Error> {
                Python::attach(|py| mint.call0(py).and_then(|out| mint_output(out.bind(py))))
                    .map_err(|e| {
                        let message = e.to_string();
                        *raised.lock().expect("not poisoned") = Some(e);
                        Error::new(
                            Code::CompileFailed,
                            format!("mint callback raised: {message}"),
                        )
                    })
            };
            self.inner
                .ensure(&key, &destination, &request, &mut callback)
        });
        let result = match result {
            Ok(r) => r,
            Err(e) => {
                return Err(raised
                    .into_inner()
                    .ok()
                    .flatten()
                    .unwrap_or_else(|| to_py(e)))
            }
        };
        let mut m = Map::new();
        m.insert("outcome".into(), result.outcome.as_str().into());
        m.insert("resolved".into(), resolved_value(&result.resolved));
        m.insert(
            "remote_publication".into(),
            result
                .remote_publication
                .as_ref()
                .map(|p| {
                    let mut r = Map::new();
                    r.insert("outcome".into(), p.outcome.as_str().into());
                    r.insert("manifest".into(), p.manifest.clone().into());
                    Value::Object(r)
                })
                .unwrap_or(Value::Null),
        );
        m.insert(
            "publication".into(),
            result
                .publication
                .as_ref()
                .map(store_result_value)
                .unwrap_or(Value::Null),
        );
        from_value(py, &Value::Object(m))
    }

    fn import_artifact<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        path: PathBuf,
    ) -> PyResult<Bound<'py, PyAny>> {
        let key = key_arg(key)?;
        let r = py.detach(|| self.inner.import_artifact(&key, &path)).py()?;
        from_value(py, &store_result_value(&r))
    }

    /// Adopt every graph of a 0.2.0 (HashRepo) store; one dict per ref.
    fn adopt_hashrepo<'py>(
        &self,
        py: Python<'py>,
        old_root: PathBuf,
    ) -> PyResult<Bound<'py, PyAny>> {
        let entries = py
            .detach(|| self.inner.adopt_hashrepo(&old_root, &mut |_, _, _| {}))
            .py()?;
        let rows = entries.iter().map(|e| e.to_value()).collect();
        from_value(py, &Value::Array(rows))
    }

    fn export_artifact(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        path: PathBuf,
    ) -> PyResult<PathBuf> {
        let key = key_arg(key)?;
        py.detach(|| self.inner.export_artifact(&key, &path)).py()
    }

    fn list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let v = py.detach(|| self.inner.list()).py()?;
        from_value(py, &v)
    }

    #[pyo3(signature = (max_bytes=None))]
    fn gc<'py>(&self, py: Python<'py>, max_bytes: Option<u64>) -> PyResult<Bound<'py, PyAny>> {
        let v = py.detach(|| self.inner.gc(max_bytes)).py()?;
        from_value(py, &v)
    }

    #[pyo3(signature = (quarantine=false))]
    fn fsck<'py>(&self, py: Python<'py>, quarantine: bool) -> PyResult<Bound<'py, PyAny>> {
        let (v, _) = py.detach(|| self.inner.fsck(quarantine)).py()?;
        from_value(py, &v)
    }

    /// Explain a requested key (a declaration's fields, the `sm` axis, the
    /// toolchain block and, when known, the program's canonical lines).
    #[pyo3(signature = (declaration, sm, toolchain, lines=None, limit=EXPLAIN_NEIGHBOURS))]
    fn explain<'py>(
        &self,
        py: Python<'py>,
        declaration: &Bound<'py, PyDict>,
        sm: &str,
        toolchain: &Bound<'py, PyAny>,
        lines: Option<Vec<String>>,
        limit: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let declaration = declaration_from_dict(declaration)?;
        let block = crate::identity::toolchain_block(toolchain)?;
        let toolchain = validate_toolchain_block(&block, Code::DeclarationToolchainInvalid).py()?;
        let key = derive_key(declaration.class_hash(), sm, &toolchain_axis(&toolchain)).py()?;
        let lines = lines
            .filter(|l| graph_witness(l) == declaration.graph_witness())
            .map(|l| WitnessLines::bounded(&l));
        let facts = KeyFacts {
            key,
            declaration,
            sm: sm.to_string(),
            toolchain,
            lines,
        };
        let v = py.detach(|| self.inner.explain(&facts, limit)).py()?;
        from_value(py, &v)
    }

    /// Explain a stored key against the other stored entries of its class;
    /// `None` when it is not stored.
    #[pyo3(signature = (key, limit=EXPLAIN_NEIGHBOURS))]
    fn explain_stored<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        limit: usize,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let key = key_arg(key)?;
        let v = py.detach(|| self.inner.explain_stored(&key, limit)).py()?;
        v.map(|v| from_value(py, &v)).transpose()
    }

    /// Diff two stored keys (`store.absent` names one that is not stored).
    fn explain_keys<'py>(
        &self,
        py: Python<'py>,
        a: &Bound<'py, PyAny>,
        b: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (a, b) = (key_arg(a)?, key_arg(b)?);
        match py.detach(|| self.inner.explain_keys(&a, &b)).py()? {
            Ok(v) => from_value(py, &v),
            Err(missing) => Err(to_py(Error::new(
                Code::StoreAbsent,
                format!("{missing} is not stored"),
            ))),
        }
    }

    /// What is stored for a graph class and how the entries differ.
    fn explain_class<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        let v = py.detach(|| self.inner.explain_class(name)).py()?;
        from_value(py, &v)
    }

    /// Bring keys into the local store from the remote (verified); one row a key.
    #[pyo3(signature = (keys, admitted_copy = false))]
    fn pull<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        admitted_copy: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let v = py
            .detach(|| tcg_remote::ops::pull(&self.inner, &keys, admitted_copy, &mut |_, _| {}))
            .py()?;
        from_value(py, &v)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let v = py.detach(|| self.inner.stats()).py()?;
        from_value(py, &v)
    }
}
