//! Host-ISA bindings: this host's facts, the mint requirement and the CPU sm.

use pyo3::prelude::*;
use tcg_core::host_isa::{self, HostFacts};

use crate::convert::from_value;
use crate::errors::IntoPyResult;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(host_facts, m)?)?;
    m.add_function(wrap_pyfunction!(host_requirement, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_sm, m)?)?;
    Ok(())
}

/// This host's machine name and the CPU features every processor reports.
#[pyfunction]
fn host_facts(py: Python<'_>) -> PyResult<(String, Vec<String>)> {
    let facts = py.detach(HostFacts::read).py()?;
    Ok((
        facts.machine().to_owned(),
        facts.features().iter().cloned().collect(),
    ))
}

/// The five host-ISA facts a mint on this host records (SPEC-v1 §5.3).
#[pyfunction]
fn host_requirement(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let req = py.detach(host_isa::host_requirement).py()?;
    from_value(py, &req.to_value())
}

/// The CPU `sm` axis of this host (SPEC-v1 §4.2), such as `cpu-x86-64-v3`.
#[pyfunction]
fn cpu_sm(py: Python<'_>) -> PyResult<String> {
    py.detach(host_isa::cpu_sm).py()
}
