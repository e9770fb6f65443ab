//! PyO3 bindings of torch-compiled-graphs: conversion and error mapping only.
//!
//! Every rule lives in `tcg-core`; a binding converts its arguments, calls the
//! core with the GIL released where it does I/O, and maps the error.

mod artifact;
mod convert;
mod dlpack;
mod engine;
mod errors;
mod host;
mod identity;
mod run;
mod store;

use pyo3::prelude::*;

/// The extension module `torch_compiled_graphs._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    identity::register(m)?;
    host::register(m)?;
    engine::register(m)?;
    store::register(m)?;
    artifact::register(m)?;
    run::register(m)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(error_codes, m)?)?;
    // Remote-tier warnings go to the package's logger rather than raw stderr
    // (with no logging configured, Python's last-resort handler still prints
    // them on stderr).
    tcg_core::engine::set_remote_warn_hook(Box::new(log_warning));
    Ok(())
}

/// `logging.getLogger("torch_compiled_graphs").warning(line)`; a failure to
/// log is ignored (a warning never fails the caller).
fn log_warning(line: &str) {
    Python::attach(|py| {
        let _ = py
            .import("logging")
            .and_then(|l| l.call_method1("getLogger", ("torch_compiled_graphs",)))
            .and_then(|logger| logger.call_method1("warning", ("%s", line)));
    });
}

/// Run the command line with `argv` (program name first); returns the exit code.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> i32 {
    py.detach(|| tcg_cli::run(argv))
}

/// Every stable error code with the name of the Python class it raises.
#[pyfunction]
fn error_codes() -> Vec<(&'static str, &'static str)> {
    tcg_core::Code::ALL
        .iter()
        .map(|c| (c.as_str(), errors::class_name(c.default_kind())))
        .collect()
}
