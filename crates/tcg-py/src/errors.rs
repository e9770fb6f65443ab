//! One exhaustive mapping from core errors to the Python hierarchy defined in
//! `torch_compiled_graphs.errors`.

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyModule;
use tcg_core::{Error, Kind};

static ERRORS_MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// The Python class name for a kind.
pub fn class_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Identity => "IdentityError",
        Kind::Declaration => "DeclarationError",
        Kind::Artifact => "ArtifactError",
        Kind::Compile => "CompileError",
        Kind::Storage => "StorageError",
        Kind::Quarantined => "QuarantinedArtifact",
        Kind::Admission => "AdmissionError",
        Kind::Binding => "BindingError",
        Kind::Trust => "TrustError",
        Kind::Io => "OSError",
    }
}

fn build(py: Python<'_>, err: &Error) -> PyResult<PyErr> {
    if err.kind() == Kind::Io {
        // OSError(errno, strerror) picks the errno's subclass (FileExistsError, ...).
        let exc = match (err.errno(), err.code()) {
            (Some(errno), _) => PyOSError::new_err((errno, err.message().to_string())),
            (None, tcg_core::Code::IoDestinationOccupied) => {
                PyOSError::new_err((libc_eexist(), err.message().to_string()))
            }
            (None, tcg_core::Code::IoDestinationNotDirectory) => {
                PyOSError::new_err((libc_enotdir(), err.message().to_string()))
            }
            (None, _) => PyOSError::new_err(err.message().to_string()),
        };
        exc.value(py).setattr("code", err.code().as_str())?;
        return Ok(exc);
    }
    let module = ERRORS_MODULE.get_or_try_init(py, || {
        PyModule::import(py, "torch_compiled_graphs.errors").map(Bound::unbind)
    })?;
    let class = module.bind(py).getattr(class_name(err.kind()))?;
    let value = class.call1((err.message().to_string(), err.code().as_str()))?;
    Ok(PyErr::from_value(value))
}

const fn libc_eexist() -> i32 {
    17
}

const fn libc_enotdir() -> i32 {
    20
}

/// Convert a core error to the Python exception of its kind, carrying `.code`.
pub fn to_py(err: Error) -> PyErr {
    Python::attach(|py| build(py, &err).unwrap_or_else(|e| e))
}

/// `Result` mapping helper.
pub trait IntoPyResult<T> {
    /// Map the core error to its Python exception.
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, Error> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
