//! Bindings of `tcg-run`: the native (torch-free) load path.
//!
//! `NativeModel` wraps a loaded graph; `NativeTensor` an output the caller
//! owns, exposed through `__array_interface__` so that `numpy.asarray` views
//! it without a copy and keeps it alive. The Python module
//! `torch_compiled_graphs.native` does the call convention and input checks;
//! this layer converts and maps errors.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use tcg_core::artifact::{ConstantRow, ConstantSource};
use tcg_core::{Code, Error};
use tcg_run::{Dim, Graph, Input, OwnedTensor, Torch};

use crate::errors::IntoPyResult;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeModel>()?;
    m.add_class::<NativeTensor>()?;
    Ok(())
}

/// A resolved graph loaded through libtorch's C ABI.
#[pyclass(module = "torch_compiled_graphs._native", frozen)]
struct NativeModel {
    inner: Arc<Graph>,
}

type Row = (String, String, String, Vec<u64>);
/// One input's facts: dtype and dims (an int or a `(lo, hi)` pair).
type Fact<'py> = (String, Vec<Bound<'py, PyAny>>);

#[pymethods]
impl NativeModel {
    /// Load `entry` of `package` with libtorch from `torch_lib`; `constants`
    /// are the metadata's rows `(fqn, source, dtype, shape)`.
    #[new]
    fn new(
        py: Python<'_>,
        torch_lib: PathBuf,
        package: PathBuf,
        entry: String,
        device: String,
        constants: Vec<Row>,
    ) -> PyResult<Self> {
        let rows = constants
            .into_iter()
            .map(|(fqn, source, dtype, shape)| {
                let source = ConstantSource::parse(&source).ok_or_else(|| {
                    Error::new(
                        Code::RunPackageInvalid,
                        format!("constant {fqn:?} has an unknown source {source:?}"),
                    )
                })?;
                Ok(ConstantRow {
                    fqn,
                    source,
                    dtype,
                    shape,
                })
            })
            .collect::<Result<Vec<_>, Error>>()
            .py()?;
        let graph = py
            .detach(|| {
                let torch = Torch::open(&torch_lib)?;
                Graph::load(torch, &package, &entry, &device, rows)
            })
            .py()?;
        Ok(NativeModel {
            inner: Arc::new(graph),
        })
    }

    /// Bind the weights file (and the literal payload when the graph has literals).
    #[pyo3(signature = (weights, literals=None))]
    fn bind(&self, py: Python<'_>, weights: PathBuf, literals: Option<PathBuf>) -> PyResult<()> {
        let graph = Arc::clone(&self.inner);
        py.detach(move || graph.bind(&weights, literals.as_deref()))
            .py()
    }

    /// Run on `inputs`, each `(address, nbytes, dtype, shape)` of a C-contiguous
    /// CPU buffer that the caller keeps alive and unchanged during the call.
    fn run(
        &self,
        py: Python<'_>,
        inputs: Vec<(usize, usize, String, Vec<i64>)>,
    ) -> PyResult<Vec<NativeTensor>> {
        let inputs: Vec<Input> = inputs
            .into_iter()
            .map(|(data, nbytes, dtype, shape)| Input {
                data,
                nbytes,
                dtype,
                shape,
            })
            .collect();
        let graph = Arc::clone(&self.inner);
        // SAFETY: the Python caller (torch_compiled_graphs.native) derives each
        // address and length from a live object's __array_interface__ or
        // buffer and holds a reference to that object across this call.
        let outputs = py.detach(move || unsafe { graph.run(&inputs) }).py()?;
        Ok(outputs
            .into_iter()
            .map(|t| NativeTensor { inner: t })
            .collect())
    }

    /// `(in_spec, out_spec)`: torch's treespec JSON from the container.
    #[getter]
    fn call_spec(&self) -> (String, String) {
        self.inner.call_spec().clone()
    }

    /// The number of tensor inputs.
    #[getter]
    fn num_inputs(&self) -> usize {
        self.inner.num_inputs()
    }

    /// The number of outputs.
    #[getter]
    fn num_outputs(&self) -> usize {
        self.inner.num_outputs()
    }

    /// The fqns the weights file must hold, in table order.
    #[getter]
    fn weight_fqns(&self) -> Vec<String> {
        self.inner
            .weight_fqns()
            .into_iter()
            .map(str::to_owned)
            .collect()
    }

    /// What the wrapper checks per input: `(dtype, dims)` where a dim is an
    /// int or a `(lo, hi)` pair of optional bounds; `None` when unstated.
    #[getter]
    fn input_facts<'py>(&self, py: Python<'py>) -> PyResult<Option<Vec<Fact<'py>>>> {
        let Some(facts) = self.inner.input_facts() else {
            return Ok(None);
        };
        facts
            .iter()
            .map(|f| {
                let dims = f
                    .dims
                    .iter()
                    .map(|d| match *d {
                        Dim::Static(v) => Ok(v.into_pyobject(py)?.into_any()),
                        Dim::Range(lo, hi) => Ok((lo, hi).into_pyobject(py)?.into_any()),
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                Ok((f.dtype.clone(), dims))
            })
            .collect::<PyResult<Vec<_>>>()
            .map(Some)
    }

    /// The canonical directory libtorch was loaded from.
    #[getter]
    fn torch_lib(&self) -> PathBuf {
        self.inner.torch_dir().to_owned()
    }
}

/// numpy's type string of an inductor dtype (little-endian hosts only).
fn typestr(name: &str) -> &'static str {
    match name {
        "float32" => "<f4",
        "float64" => "<f8",
        "float16" => "<f2",
        "bfloat16" => "<V2",
        "int64" => "<i8",
        "int32" => "<i4",
        "int16" => "<i2",
        "int8" => "|i1",
        "uint8" => "|u1",
        "bool" => "|b1",
        _ => "|V1",
    }
}

/// An output of a native run; owns its memory until it is garbage collected.
#[pyclass(module = "torch_compiled_graphs._native", frozen)]
struct NativeTensor {
    inner: OwnedTensor,
}

#[pymethods]
impl NativeTensor {
    /// The shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.sizes())
    }

    /// Inductor's dtype name (`float32`).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype().name
    }

    /// The strides in bytes.
    #[getter]
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let size = self.inner.dtype().size as i64;
        PyTuple::new(py, self.inner.strides().iter().map(|s| s * size))
    }

    /// The array interface (version 3): a read-write view of the output's memory.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", self.shape(py)?)?;
        d.set_item("typestr", typestr(self.inner.dtype().name))?;
        d.set_item("strides", self.strides(py)?)?;
        d.set_item("data", (self.inner.data_ptr(), false))?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "NativeTensor(dtype={}, shape={:?})",
            self.inner.dtype().name,
            self.inner.sizes()
        )
    }
}
