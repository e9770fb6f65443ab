//! `LocalCAS`: the content-addressed store, for tools and operators. Every
//! call releases the GIL while it does I/O.

use std::path::PathBuf;

use pyo3::prelude::*;
use tcg_cas::{CasOutcome, Digest, FsckOptions, GcOptions, Store, Target};
use tcg_cj::{Map, Value};
use tcg_core::engine::store_err;
use tcg_core::{Code, Error};

use crate::convert::from_value;
use crate::errors::{to_py, IntoPyResult};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeStore>()?;
    m.add("GRAPH_REF_PREFIX", tcg_cas::GRAPH_REF_PREFIX)?;
    m.add("QUARANTINE_REF_PREFIX", tcg_cas::QUARANTINE_REF_PREFIX)?;
    m.add("MAX_CHUNK_BYTES", tcg_cas::MAX_CHUNK_BYTES)?;
    Ok(())
}

fn digest_arg(s: &str) -> PyResult<Digest> {
    Digest::from_hex(s)
        .or_else(|| Digest::from_prefixed(s))
        .ok_or_else(|| {
            to_py(Error::new(
                Code::StoreRefInvalid,
                format!("{s:?} is not a sha256 digest"),
            ))
        })
}

fn target_value(t: &Target) -> Value {
    let mut m = Map::new();
    m.insert("kind".into(), t.kind.as_str().into());
    m.insert("target".into(), t.digest.to_hex().into());
    Value::Object(m)
}

/// The native store handle. The Python `LocalCAS` wraps it.
#[pyclass(module = "torch_compiled_graphs._native", frozen)]
pub struct NativeStore {
    inner: Store,
}

#[pymethods]
impl NativeStore {
    #[new]
    fn new(py: Python<'_>, root: PathBuf) -> PyResult<Self> {
        let inner = py.detach(|| Store::open(&root)).map_err(store_err).py()?;
        Ok(NativeStore { inner })
    }

    #[getter]
    fn root(&self) -> PathBuf {
        self.inner.root().to_path_buf()
    }

    /// Ingest a file as chunks and a manifest; with `ref`, point that ref at
    /// the manifest (compare-and-swap from its current value) so that GC keeps it.
    #[pyo3(signature = (path, r#ref=None))]
    fn ingest_file<'py>(
        &self,
        py: Python<'py>,
        path: PathBuf,
        r#ref: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let v = py
            .detach(|| -> Result<Value, Error> {
                let lease = self.inner.lease().map_err(store_err)?;
                let info = self.inner.ingest_file(&lease, &path).map_err(store_err)?;
                if let Some(name) = &r#ref {
                    let desired = Target::manifest(info.manifest);
                    loop {
                        let current = self.inner.get_ref(name).map_err(store_err)?;
                        match self
                            .inner
                            .compare_and_swap(name, current.as_ref(), Some(&desired))
                            .map_err(store_err)?
                        {
                            CasOutcome::Matched | CasOutcome::AlreadyEqual => break,
                            CasOutcome::Conflict(_) => continue,
                        }
                    }
                }
                lease.end().map_err(store_err)?;
                let mut m = Map::new();
                m.insert("manifest".into(), info.manifest.to_hex().into());
                m.insert("digest".into(), info.file_digest.to_hex().into());
                m.insert("size".into(), Value::Int(info.size as i64));
                Ok(Value::Object(m))
            })
            .py()?;
        from_value(py, &v)
    }

    /// The target of a ref, or None.
    fn read_ref<'py>(&self, py: Python<'py>, name: String) -> PyResult<Option<Bound<'py, PyAny>>> {
        let t = py
            .detach(|| self.inner.get_ref(&name))
            .map_err(store_err)
            .py()?;
        t.map(|t| from_value(py, &target_value(&t))).transpose()
    }

    /// Compare-and-swap a ref between manifest targets (None for absent):
    /// returns "MATCHED", "ALREADY_EQUAL" or "CONFLICT".
    #[pyo3(signature = (name, expected, desired))]
    fn compare_and_swap(
        &self,
        py: Python<'_>,
        name: String,
        expected: Option<String>,
        desired: Option<String>,
    ) -> PyResult<&'static str> {
        let expected = expected
            .map(|d| digest_arg(&d).map(Target::manifest))
            .transpose()?;
        let desired = desired
            .map(|d| digest_arg(&d).map(Target::manifest))
            .transpose()?;
        let outcome = py
            .detach(|| -> Result<CasOutcome, Error> {
                let lease = self.inner.lease().map_err(store_err)?;
                if let Some(t) = &desired {
                    lease.pin(&[t.digest]).map_err(store_err)?;
                }
                let r = self
                    .inner
                    .compare_and_swap(&name, expected.as_ref(), desired.as_ref())
                    .map_err(store_err)?;
                lease.end().map_err(store_err)?;
                Ok(r)
            })
            .py()?;
        Ok(match outcome {
            CasOutcome::Matched => "MATCHED",
            CasOutcome::AlreadyEqual => "ALREADY_EQUAL",
            CasOutcome::Conflict(_) => "CONFLICT",
        })
    }

    /// Write the file of a manifest to `dest` (verified, never clobbering).
    fn materialize(&self, py: Python<'_>, manifest: String, dest: PathBuf) -> PyResult<()> {
        let m = digest_arg(&manifest)?;
        py.detach(|| -> Result<(), Error> {
            let lease = self.inner.lease().map_err(store_err)?;
            self.inner
                .materialize(&lease, &m, &dest, true)
                .map_err(store_err)?;
            lease.end().map_err(store_err)
        })
        .py()
    }

    /// Ref names under a prefix.
    #[pyo3(signature = (prefix=""))]
    fn list_refs(&self, py: Python<'_>, prefix: &str) -> PyResult<Vec<String>> {
        let l = py
            .detach(|| self.inner.list_refs(prefix))
            .map_err(store_err)
            .py()?;
        Ok(l.entries.into_iter().map(|e| e.name).collect())
    }

    #[pyo3(signature = (max_bytes=None, evict_prefix=tcg_cas::GRAPH_REF_PREFIX.to_string()))]
    fn gc<'py>(
        &self,
        py: Python<'py>,
        max_bytes: Option<u64>,
        evict_prefix: String,
    ) -> PyResult<Bound<'py, PyAny>> {
        let r = py
            .detach(|| {
                self.inner.gc(&GcOptions {
                    max_bytes,
                    evict_prefix,
                })
            })
            .map_err(store_err)
            .py()?;
        let mut m = Map::new();
        for (k, v) in [
            ("examined_objects", r.examined_objects),
            ("kept_objects", r.kept_objects),
            ("kept_bytes", r.kept_bytes),
            ("freed_objects", r.freed_objects),
            ("freed_bytes", r.freed_bytes),
            ("reaped_leases", r.reaped_leases),
            ("reaped_temps", r.reaped_temps),
        ] {
            m.insert(k.into(), Value::Int(v as i64));
        }
        m.insert(
            "evicted_refs".into(),
            Value::Array(r.evicted_refs.into_iter().map(Value::Str).collect()),
        );
        from_value(py, &Value::Object(m))
    }

    #[pyo3(signature = (quarantine=false))]
    fn fsck<'py>(&self, py: Python<'py>, quarantine: bool) -> PyResult<Bound<'py, PyAny>> {
        let r = py
            .detach(|| self.inner.fsck(FsckOptions { quarantine }))
            .map_err(store_err)
            .py()?;
        let mut m = Map::new();
        m.insert(
            "objects_checked".into(),
            Value::Int(r.objects_checked as i64),
        );
        m.insert("clean".into(), Value::Bool(r.is_clean()));
        m.insert(
            "corrupt".into(),
            Value::Array(
                r.corrupt
                    .iter()
                    .map(|c| {
                        let mut o = Map::new();
                        o.insert(
                            "digest".into(),
                            c.digest
                                .map(|d| Value::Str(d.to_hex()))
                                .unwrap_or(Value::Null),
                        );
                        o.insert("code".into(), c.error.code().into());
                        o.insert("error".into(), c.error.to_string().into());
                        Value::Object(o)
                    })
                    .collect(),
            ),
        );
        m.insert(
            "dangling_refs".into(),
            Value::Array(
                r.dangling_refs
                    .iter()
                    .map(|d| Value::Str(d.name.clone()))
                    .collect(),
            ),
        );
        from_value(py, &Value::Object(m))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let s = py.detach(|| self.inner.stats()).map_err(store_err).py()?;
        let mut m = Map::new();
        m.insert("objects".into(), Value::Int(s.objects as i64));
        m.insert("bytes".into(), Value::Int(s.object_bytes as i64));
        m.insert("refs".into(), Value::Int(s.refs as i64));
        m.insert("leases".into(), Value::Int(s.leases as i64));
        from_value(py, &Value::Object(m))
    }
}
