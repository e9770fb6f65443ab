//! Bindings of `tcg-run`: the native (torch-free) load path.
//!
//! `NativeModel` wraps a loaded graph; `NativeTensor` an output the caller
//! owns, exposed through `__array_interface__` so that `numpy.asarray` views
//! it without a copy and keeps it alive. The Python module
//! `torch_compiled_graphs.native` does the call convention and input checks;
//! this layer converts and maps errors.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::{PyAttributeError, PyBufferError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use tcg_core::artifact::{ConstantRow, ConstantSource};
use tcg_core::{Code, Error};
use tcg_run::{
    ConstantBuffer, Device, Dim, Graph, Input, LoadRequest, OwnedTensor, Torch, WeightsSet,
    WeightsSource,
};

use crate::dlpack::{capsule, DLPackInput};
use crate::errors::IntoPyResult;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(checkpoint_files, m)?)?;
    m.add_class::<CheckpointReader>()?;
    m.add_class::<NativeModel>()?;
    m.add_class::<NativeWeightsSet>()?;
    m.add_class::<NativeTensor>()?;
    m.add_class::<DLPackInput>()?;
    m.add_function(wrap_pyfunction!(upload, m)?)?;
    m.add_function(wrap_pyfunction!(synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(prepare_capture_allocator, m)?)?;
    m.add_function(wrap_pyfunction!(choose_runtime, m)?)?;
    m.add_function(wrap_pyfunction!(libtorch_mapped, m)?)?;
    Ok(())
}

/// The runtime entry `entry` of `package` runs on, on `device`, for the
/// option `runtime` (`auto`, `libtorch`, `shim`; `None`: the environment's
/// `TORCH_COMPILED_GRAPHS_RUNTIME`, else `auto`): `(runtime, reason)` with
/// runtime `"libtorch"` or `"shim-v1"` (`tcg_run::runtime::choose_for_package`).
#[pyfunction]
#[pyo3(signature = (package, entry, device, runtime=None))]
fn choose_runtime(
    py: Python<'_>,
    package: PathBuf,
    entry: String,
    device: String,
    runtime: Option<String>,
) -> PyResult<(String, String)> {
    py.detach(move || {
        let (option, source) = tcg_run::RuntimeOption::resolve(runtime.as_deref())?;
        let choice =
            tcg_run::runtime::choose_for_package(&package, &entry, &device, option, source)?;
        Ok((choice.runtime.as_str().to_owned(), choice.reason))
    })
    .py()
}

/// Whether libtorch is mapped into this process (`/proc/self/maps`).
#[pyfunction]
fn libtorch_mapped() -> bool {
    tcg_run::runtime::libtorch_mapped()
}

/// A chosen runtime from Python's `(runtime, reason)`; `None` is libtorch
/// (a caller that names `torch_lib` and chose nothing).
fn runtime_choice(runtime: Option<(String, String)>) -> PyResult<tcg_run::RuntimeChoice> {
    let Some((name, reason)) = runtime else {
        return Ok(tcg_run::RuntimeChoice::libtorch(
            "libtorch given by the caller",
        ));
    };
    let runtime = match name.as_str() {
        "libtorch" => tcg_run::Runtime::Libtorch,
        "shim-v1" => tcg_run::Runtime::ShimV1,
        other => {
            return Err(Error::new(
                Code::RunOptionInvalid,
                format!("runtime is {other:?}; it must be \"libtorch\" or \"shim-v1\""),
            ))
            .py()
        }
    };
    Ok(tcg_run::RuntimeChoice { runtime, reason })
}

/// A tensor of `dtype` and `shape` on `device` made from the `nbytes` host
/// bytes at `address` (a C-contiguous buffer the caller holds during the
/// call), copied on `stream`, with libtorch from `torch_lib`. The call returns
/// once the copy is done.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn upload(
    py: Python<'_>,
    torch_lib: PathBuf,
    address: usize,
    nbytes: usize,
    dtype: String,
    shape: Vec<i64>,
    device: String,
    stream: usize,
) -> PyResult<NativeTensor> {
    if address == 0 && nbytes > 0 {
        return Err(Error::new(Code::RunInputLayout, "the buffer has no memory")).py();
    }
    let tensor = py
        .detach(move || {
            let torch = Torch::open(&torch_lib)?;
            let dtype = torch.dtype_by_name(&dtype).ok_or_else(|| {
                Error::new(
                    Code::RunInputMismatch,
                    format!("the native path has no dtype {dtype:?}"),
                )
            })?;
            let device = Device::parse(&device)?;
            if device.is_cuda() {
                torch.cuda()?;
            }
            let bytes: &[u8] = if nbytes == 0 {
                &[]
            } else {
                // SAFETY: the Python caller (torch_compiled_graphs.native)
                // takes `address` and `nbytes` from a live buffer it holds
                // across this call.
                unsafe { std::slice::from_raw_parts(address as *const u8, nbytes) }
            };
            OwnedTensor::from_host(&torch, bytes, &shape, dtype, device, stream)
        })
        .py()?;
    Ok(NativeTensor {
        inner: Arc::new(tensor),
    })
}

/// Block until the work queued on `stream` of libtorch's CUDA runtime is done.
/// Before a CUDA graph opens libtorch: select libtorch's stream-ordered
/// allocator where captures want it and nothing else chose an allocator
/// (`tcg_run::capture::prepare_allocator`). Returns whether the process's
/// allocator is the stream-ordered one, and if not why.
#[pyfunction]
fn prepare_capture_allocator(enabled: bool, max_captures: usize) -> (bool, Option<String>) {
    let options = tcg_run::capture::CaptureOptions {
        enabled,
        max_captures,
    };
    match tcg_run::capture::prepare_allocator(&options) {
        tcg_run::capture::Allocator::StreamOrdered => (true, None),
        tcg_run::capture::Allocator::Caching(why) => (false, Some(why)),
    }
}

#[pyfunction]
fn synchronize(py: Python<'_>, torch_lib: PathBuf, stream: usize) -> PyResult<()> {
    py.detach(move || Torch::open(&torch_lib)?.cuda()?.synchronize(stream))
        .py()
}

/// Every tensor of a checkpoint read once onto a device, shared by the
/// models bound to it (`tcg_run::WeightsSet`).
#[pyclass(module = "torch_compiled_graphs._native", frozen)]
struct NativeWeightsSet {
    inner: Arc<WeightsSet>,
}

#[pymethods]
impl NativeWeightsSet {
    /// Read every tensor of `weights` (safetensors files, sharded
    /// checkpoints by their index, or directories holding either; names
    /// mapped by the prefixes) once onto `device` with libtorch from `torch_lib`.
    #[staticmethod]
    #[pyo3(signature = (torch_lib, device, weights, strip_prefix=None, add_prefix=None))]
    fn open(
        py: Python<'_>,
        torch_lib: PathBuf,
        device: String,
        weights: Vec<PathBuf>,
        strip_prefix: Option<String>,
        add_prefix: Option<String>,
    ) -> PyResult<NativeWeightsSet> {
        let naming = naming(strip_prefix, add_prefix);
        let inner = py
            .detach(move || {
                let checkpoint = tcg_run::weights::Checkpoint::open(&weights, &naming)?;
                WeightsSet::open(&torch_lib, &device, &checkpoint)
            })
            .py()?;
        Ok(NativeWeightsSet { inner })
    }

    /// Bytes of tensor data the set holds.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.nbytes()
    }

    /// Every tensor's name, sorted.
    #[getter]
    fn names(&self) -> Vec<String> {
        self.inner.names().map(str::to_owned).collect()
    }

    /// Fuse the LoRA at `path` (a diffusers/PEFT safetensors file, or a
    /// directory holding one) into the set's values in place, and so into
    /// every model bound to it; refused (`run.lora_invalid`, nothing changed)
    /// when one is fused already or when it does not fit.
    #[pyo3(signature = (path, scale=1.0, prefix=None, name=None))]
    fn apply_lora(
        &self,
        py: Python<'_>,
        path: PathBuf,
        scale: f64,
        prefix: Option<String>,
        name: Option<String>,
    ) -> PyResult<()> {
        let set = Arc::clone(&self.inner);
        py.detach(move || set.apply_lora(&path, scale, prefix.as_deref(), name))
            .py()
    }

    /// Swap the fused LoRA for the one at `path` in one step (from the base
    /// values); a refused LoRA changes nothing.
    #[pyo3(signature = (path, scale=1.0, prefix=None, name=None))]
    fn replace_lora(
        &self,
        py: Python<'_>,
        path: PathBuf,
        scale: f64,
        prefix: Option<String>,
        name: Option<String>,
    ) -> PyResult<()> {
        let set = Arc::clone(&self.inner);
        py.detach(move || set.replace_lora(&path, scale, prefix.as_deref(), name))
            .py()
    }

    /// Restore the base values bit for bit and free the copies kept of them.
    fn remove_lora(&self, py: Python<'_>) -> PyResult<()> {
        let set = Arc::clone(&self.inner);
        py.detach(move || set.remove_lora()).py()
    }

    /// The fused LoRA (`name`, `scale`, `targets`, `nbytes`), or `None`.
    #[getter]
    fn lora<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(info) = self.inner.lora() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("name", info.name)?;
        d.set_item("scale", info.scale)?;
        d.set_item("targets", info.targets)?;
        d.set_item("nbytes", info.nbytes)?;
        Ok(Some(d))
    }

    /// `"cpu"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        self.inner.device().to_string()
    }

    /// Tensors skipped for lying outside `strip_prefix`.
    #[getter]
    fn outside_prefix(&self) -> usize {
        self.inner.outside_prefix()
    }

    /// How long opening took, phase by phase (`(name, seconds)`).
    #[getter]
    fn timings(&self) -> Timings {
        timings(self.inner.timings())
    }

    /// The libtorch directory the set was opened with.
    #[getter]
    fn torch_lib(&self) -> PathBuf {
        self.inner.torch().dir().to_owned()
    }
}

/// A resolved graph loaded through libtorch's C ABI.
#[pyclass(module = "torch_compiled_graphs._native", frozen)]
struct NativeModel {
    inner: Arc<Graph>,
}

type Row = (String, String, String, Vec<u64>);
/// `(fqn, address, nbytes, dtype, shape, device)` of a caller-owned constant.
type Buffer = (String, usize, usize, String, Vec<i64>, String);
type Timings = Vec<(String, f64)>;

fn timings(t: &tcg_run::pipeline::Timings) -> Timings {
    t.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
}

fn parse_rows(constants: Vec<Row>) -> PyResult<Vec<ConstantRow>> {
    constants
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
        .py()
}

fn naming(strip_prefix: Option<String>, add_prefix: Option<String>) -> tcg_run::weights::Naming {
    tcg_run::weights::Naming {
        strip_prefix: strip_prefix.unwrap_or_default(),
        add_prefix: add_prefix.unwrap_or_default(),
    }
}
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
        sm: String,
        constants: Vec<Row>,
    ) -> PyResult<Self> {
        let rows = parse_rows(constants)?;
        let graph = py
            .detach(|| {
                let torch = Torch::open(&torch_lib)?;
                Graph::load(torch, &package, &entry, &device, &sm, rows)
            })
            .py()?;
        Ok(NativeModel {
            inner: Arc::new(graph),
        })
    }

    /// Load and bind in one overlapped step (the weights staged beside
    /// opening libtorch and creating the container): `metadata` gives the
    /// weights contract with the package's annex. Returns the model, the
    /// ignored names, the count outside `strip_prefix` and the timings.
    #[staticmethod]
    #[pyo3(signature = (torch_lib, package, entry, device, sm, constants, metadata, weights, literals=None, strip_prefix=None, add_prefix=None, runtime=None))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        py: Python<'_>,
        torch_lib: PathBuf,
        package: PathBuf,
        entry: String,
        device: String,
        sm: String,
        constants: Vec<Row>,
        metadata: &Bound<'_, PyAny>,
        weights: Vec<PathBuf>,
        literals: Option<PathBuf>,
        strip_prefix: Option<String>,
        add_prefix: Option<String>,
        runtime: Option<(String, String)>,
    ) -> PyResult<(NativeModel, Vec<String>, usize, Timings)> {
        let rows = parse_rows(constants)?;
        let runtime = runtime_choice(runtime)?;
        let (declared, contract_rows) = crate::artifact::contract_inputs(metadata)?;
        let naming = naming(strip_prefix, add_prefix);
        let (graph, report) = py
            .detach(move || {
                let contract = tcg_core::artifact::package::weights_contract_of(
                    &package,
                    &declared,
                    &contract_rows,
                )?;
                let checkpoint = tcg_run::weights::Checkpoint::open(&weights, &naming)?;
                Graph::load_request(LoadRequest {
                    torch_lib: &torch_lib,
                    package: &package,
                    entry: &entry,
                    device: &device,
                    sm: &sm,
                    rows,
                    contract,
                    weights: WeightsSource::Files(&checkpoint),
                    literals: literals.as_deref(),
                    runtime,
                })
            })
            .py()?;
        let t = timings(graph.load_timings());
        Ok((
            NativeModel {
                inner: Arc::new(graph),
            },
            report.ignored,
            report.outside_prefix,
            t,
        ))
    }

    /// Load and bind to a weights set in one overlapped step (the set's
    /// tensors bound without a copy, the literals read for this graph):
    /// returns the model, the ignored names and the timings. The set must be
    /// on `device` (`run.device_mismatch`).
    #[staticmethod]
    #[pyo3(signature = (torch_lib, package, entry, device, sm, constants, metadata, set, literals=None))]
    #[allow(clippy::too_many_arguments)]
    fn load_set(
        py: Python<'_>,
        torch_lib: PathBuf,
        package: PathBuf,
        entry: String,
        device: String,
        sm: String,
        constants: Vec<Row>,
        metadata: &Bound<'_, PyAny>,
        set: &NativeWeightsSet,
        literals: Option<PathBuf>,
    ) -> PyResult<(NativeModel, Vec<String>, Timings)> {
        let rows = parse_rows(constants)?;
        let (declared, contract_rows) = crate::artifact::contract_inputs(metadata)?;
        let set = Arc::clone(&set.inner);
        let (graph, report) = py
            .detach(move || {
                let contract = tcg_core::artifact::package::weights_contract_of(
                    &package,
                    &declared,
                    &contract_rows,
                )?;
                Graph::load_request(LoadRequest {
                    torch_lib: &torch_lib,
                    package: &package,
                    entry: &entry,
                    device: &device,
                    sm: &sm,
                    rows,
                    contract,
                    weights: WeightsSource::Set(set),
                    literals: literals.as_deref(),
                    runtime: tcg_run::RuntimeChoice::libtorch(tcg_run::serve::SET_ON_LIBTORCH),
                })
            })
            .py()?;
        let t = timings(graph.load_timings());
        Ok((
            NativeModel {
                inner: Arc::new(graph),
            },
            report.ignored,
            t,
        ))
    }

    /// Bind the model to a weights set (a rebind, with the checks of
    /// loading) and the literal payload when the graph has literals.
    /// Returns `(ignored names, timings)`.
    #[pyo3(signature = (set, literals=None))]
    fn bind_set(
        &self,
        py: Python<'_>,
        set: &NativeWeightsSet,
        literals: Option<PathBuf>,
    ) -> PyResult<(Vec<String>, Timings)> {
        let graph = Arc::clone(&self.inner);
        let set = Arc::clone(&set.inner);
        let report = py
            .detach(move || graph.bind_set(&set, literals.as_deref()))
            .py()?;
        let t = timings(&report.timings);
        Ok((report.ignored, t))
    }

    /// The runtime the model runs on: `"libtorch"` or `"shim-v1"`.
    #[getter]
    fn runtime(&self) -> &'static str {
        self.inner.runtime().as_str()
    }

    /// Why the model runs on `runtime`.
    #[getter]
    fn runtime_reason(&self) -> String {
        self.inner.runtime_reason().to_owned()
    }

    /// Bytes of constants the last bind added for this model alone, beyond
    /// a weights set it shares (the container's folded constants not counted).
    #[getter]
    fn added_bytes(&self) -> u64 {
        self.inner.added_bytes()
    }

    /// How long loading took, phase by phase (`(name, seconds)`; empty for a
    /// model made with the plain constructor).
    #[getter]
    fn load_timings(&self) -> Timings {
        timings(self.inner.load_timings())
    }

    /// Bind the weights (safetensors files, sharded checkpoints by their
    /// index, or directories holding either; names mapped by the prefixes)
    /// and the literal payload when the graph has literals. Returns
    /// `(ignored names, tensors outside strip_prefix, timings)`.
    #[pyo3(signature = (weights, literals=None, strip_prefix=None, add_prefix=None))]
    fn bind(
        &self,
        py: Python<'_>,
        weights: Vec<PathBuf>,
        literals: Option<PathBuf>,
        strip_prefix: Option<String>,
        add_prefix: Option<String>,
    ) -> PyResult<(Vec<String>, usize, Timings)> {
        let graph = Arc::clone(&self.inner);
        let naming = naming(strip_prefix, add_prefix);
        let report = py
            .detach(move || {
                let checkpoint = tcg_run::weights::Checkpoint::open(&weights, &naming)?;
                graph.bind_checkpoint(&checkpoint, literals.as_deref())
            })
            .py()?;
        let t = timings(&report.timings);
        Ok((report.ignored, report.outside_prefix, t))
    }

    /// Bind caller-owned buffers as the constants, by fqn (`tcg_run::Graph::bind_buffers`):
    /// each `(fqn, address, nbytes, dtype, shape, device)` is C-contiguous memory the
    /// caller keeps alive and in place until the next bind or the model's drop
    /// (the Python side holds the tensors). Returns whether the container keeps
    /// the buffers (user-managed) rather than a copy.
    fn bind_buffers(&self, py: Python<'_>, buffers: Vec<Buffer>) -> PyResult<bool> {
        let buffers = buffers
            .into_iter()
            .map(|(fqn, data, nbytes, dtype, shape, device)| {
                Ok(ConstantBuffer {
                    fqn,
                    data,
                    nbytes,
                    dtype,
                    shape,
                    device: Device::parse(&device)?,
                })
            })
            .collect::<Result<Vec<_>, Error>>()
            .py()?;
        let graph = Arc::clone(&self.inner);
        // SAFETY: the Python caller (torch_compiled_graphs._native_loader)
        // derives each address and length from a live torch tensor that it
        // keeps referenced, unresized, until the next bind or until it drops
        // this model.
        py.detach(move || unsafe { graph.bind_buffers(&buffers) })
            .py()
    }

    /// Every constant of the container in table order: `(fqn, folded)`.
    #[getter]
    fn constants(&self) -> Vec<(String, bool)> {
        self.inner
            .constants()
            .iter()
            .map(|c| (c.fqn.clone(), c.from_folded))
            .collect()
    }

    /// Run on `inputs` with the work queued on `stream` (0: the legacy
    /// default stream; always 0 on CPU). Each input is a `DLPackInput` or
    /// `(address, nbytes, dtype, shape)` of a C-contiguous host buffer that
    /// the caller keeps alive and unchanged during the call. With
    /// `static_outputs`, a replayed call returns the capture's output buffers
    /// (no copy; valid until this graph's next call).
    #[pyo3(signature = (inputs, stream=0, static_outputs=false))]
    fn run(
        &self,
        py: Python<'_>,
        inputs: Vec<Bound<'_, PyAny>>,
        stream: usize,
        static_outputs: bool,
    ) -> PyResult<Vec<NativeTensor>> {
        let mut described = Vec::with_capacity(inputs.len());
        for item in &inputs {
            if let Ok(dl) = item.cast::<DLPackInput>() {
                described.push(dl.get().input());
            } else {
                let (data, nbytes, dtype, shape): (usize, usize, String, Vec<i64>) =
                    item.extract()?;
                described.push(Input {
                    data,
                    nbytes,
                    dtype,
                    shape,
                    device: Device::Cpu,
                });
            }
        }
        let graph = Arc::clone(&self.inner);
        // SAFETY: the Python caller (torch_compiled_graphs.native) derives each
        // address and length from a live object's __array_interface__, buffer
        // or DLPack capsule and holds that object (and `inputs` holds every
        // DLPackInput) across this call.
        let outputs = py
            .detach(move || {
                let outputs = if static_outputs {
                    tcg_run::capture::Outputs::Static
                } else {
                    tcg_run::capture::Outputs::Copy
                };
                // SAFETY: as above.
                unsafe { graph.run_on_with(&described, stream, outputs) }
            })
            .py()?;
        drop(inputs);
        Ok(outputs
            .into_iter()
            .map(|t| NativeTensor { inner: Arc::new(t) })
            .collect())
    }

    /// Block until the work queued on `stream` of this graph's device is done,
    /// through the runtime the graph runs on (libtorch's CUDA runtime, or the
    /// shim's driver API); nothing to wait for on the CPU.
    #[pyo3(signature = (stream=0))]
    fn synchronize(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        if !self.inner.device().is_cuda() {
            return Ok(());
        }
        let graph = Arc::clone(&self.inner);
        py.detach(move || graph.torch().cuda()?.synchronize(stream))
            .py()
    }

    /// `"cpu"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        self.inner.device().to_string()
    }

    /// `(in_spec, out_spec)`: torch's treespec JSON from the container.
    #[getter]
    fn call_spec(&self) -> (String, String) {
        self.inner.call_spec().clone()
    }

    /// Whether calls use the container's single-threaded run (no event of its
    /// own per run: the form a CUDA-graph capture can hold; calls run one at a
    /// time). Setting `True` on a runtime without it is `run.native_unsupported`.
    #[getter]
    fn get_single_threaded(&self) -> bool {
        self.inner.single_threaded()
    }

    #[setter]
    fn set_single_threaded(&self, on: bool) -> PyResult<()> {
        self.inner.set_single_threaded(on).py()
    }

    /// Turn CUDA-graph replay of calls on or off (`tcg_run::capture`);
    /// returns why calls are not captured, `None` while they are.
    fn set_captures(&self, py: Python<'_>, enabled: bool, max_captures: usize) -> Option<String> {
        let graph = Arc::clone(&self.inner);
        let options = tcg_run::capture::CaptureOptions {
            enabled,
            max_captures,
        };
        py.detach(move || graph.set_captures(options))
    }

    /// Why calls are not captured (`None` while they are).
    #[getter]
    fn captures_reason(&self) -> Option<String> {
        self.inner.captures_reason()
    }

    /// What the captures did: `captures`, `replays`, `evictions`,
    /// `invalidated`, `fallbacks`, `uncaptured_runs`, `captured` (counts) and
    /// `capture_seconds`, plus `last_capture_seconds` after a capture.
    fn capture_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.capture_stats();
        let d = PyDict::new(py);
        d.set_item("captures", s.captures)?;
        d.set_item("replays", s.replays)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("invalidated", s.invalidated)?;
        d.set_item("fallbacks", s.fallbacks)?;
        d.set_item("capture_seconds", s.capture_seconds)?;
        d.set_item("uncaptured_runs", s.uncaptured_runs)?;
        d.set_item("captured", s.captured)?;
        if let Some(t) = s.last_capture_seconds {
            d.set_item("last_capture_seconds", t)?;
        }
        Ok(d)
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

/// An output of a native run; owns its memory until it is garbage collected
/// and every DLPack consumer released it.
#[pyclass(module = "torch_compiled_graphs._native", frozen)]
pub(crate) struct NativeTensor {
    inner: Arc<OwnedTensor>,
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

    /// `"cpu"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        self.inner.device().to_string()
    }

    /// The CUDA stream the producing work was queued on (0 for the legacy
    /// default stream and for host tensors).
    #[getter]
    fn stream(&self) -> usize {
        self.inner.stream()
    }

    /// A C-contiguous copy on the host, made after the producing work.
    fn cpu(&self, py: Python<'_>) -> PyResult<NativeTensor> {
        let inner = Arc::clone(&self.inner);
        let copy = py.detach(move || inner.copy_to(Device::Cpu)).py()?;
        Ok(NativeTensor {
            inner: Arc::new(copy),
        })
    }

    /// DLPack export without a copy (the Python array API protocol): the
    /// consumer's `stream` is ordered after the work that produced the tensor.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        if let Some(want) = dl_device {
            if want != self.__dlpack_device__() {
                return Err(PyBufferError::new_err(format!(
                    "the tensor is on {}; export to another device is not supported",
                    self.inner.device()
                )));
            }
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "the tensor is exported without a copy (copy=True is not supported)",
            ));
        }
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        capsule(py, &self.inner, stream, versioned)
    }

    /// `(device_type, device_id)` of DLPack: `(1, 0)` on the host, `(2, N)` on `cuda:N`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        let d = tcg_run::dlpack::dl_device(self.inner.device());
        (d.device_type, d.device_id)
    }

    /// The array interface (version 3): a read-write view of the output's
    /// memory; host tensors only (a CUDA tensor has none, so `numpy.asarray`
    /// refuses it: use `__dlpack__` or `cpu()`).
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        if self.inner.device() != Device::Cpu {
            return Err(PyAttributeError::new_err(format!(
                "a tensor on {} has no __array_interface__; use __dlpack__ or cpu()",
                self.inner.device()
            )));
        }
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
            "NativeTensor(dtype={}, shape={:?}, device={})",
            self.inner.dtype().name,
            self.inner.sizes(),
            self.inner.device()
        )
    }
}

/// The safetensors files a weights path stands for (a file, a sharded
/// checkpoint's index, a directory holding either), each with the names its
/// index maps to it (`None` without an index).
#[pyfunction]
fn checkpoint_files(
    py: Python<'_>,
    path: PathBuf,
) -> PyResult<Vec<(PathBuf, Option<Vec<String>>)>> {
    let files = py
        .detach(|| tcg_run::weights::checkpoint_files(&path))
        .py()?;
    Ok(files
        .into_iter()
        .map(|(f, names)| (f, names.map(|n| n.into_iter().collect())))
        .collect())
}

/// A checkpoint's headers, read and checked (no tensor data yet), for the
/// torch-based load: it allocates one buffer and has the weights pipeline
/// read the tensors it binds straight into it.
#[pyclass(module = "torch_compiled_graphs._native", frozen)]
struct CheckpointReader {
    inner: Arc<tcg_run::weights::Checkpoint>,
}

#[pymethods]
impl CheckpointReader {
    #[new]
    #[pyo3(signature = (weights, strip_prefix=None, add_prefix=None))]
    fn new(
        py: Python<'_>,
        weights: Vec<PathBuf>,
        strip_prefix: Option<String>,
        add_prefix: Option<String>,
    ) -> PyResult<Self> {
        let naming = naming(strip_prefix, add_prefix);
        let checkpoint = py
            .detach(move || tcg_run::weights::Checkpoint::open(&weights, &naming))
            .py()?;
        Ok(CheckpointReader {
            inner: Arc::new(checkpoint),
        })
    }

    /// Every tensor by graph name: `(name, dtype, shape)`, dtype as inductor names it.
    #[getter]
    fn entries(&self) -> Vec<(String, String, Vec<usize>)> {
        self.inner
            .names()
            .filter_map(|n| {
                self.inner
                    .entry(n)
                    .map(|(_, e)| (n.to_owned(), e.dtype.clone(), e.shape.clone()))
            })
            .collect()
    }

    /// Tensors skipped for lying outside `strip_prefix`.
    #[getter]
    fn outside_prefix(&self) -> usize {
        self.inner.skipped()
    }

    /// The bytes one allocation for `names` needs (constants 256-byte aligned).
    fn layout_bytes(&self, names: Vec<String>) -> PyResult<usize> {
        tcg_run::pipeline::layout_of(&self.inner, &names)
            .map(|(_, _, total)| total)
            .py()
    }

    /// Refuse `total` bytes of weights where `device` (`cpu`, `cuda:N`) has
    /// less free memory (`run.weights_too_large`): the capacity check of the
    /// native path, made before the caller allocates.
    fn check_capacity(&self, py: Python<'_>, total: usize, device: String) -> PyResult<()> {
        py.detach(move || tcg_run::pipeline::check_fits(total, Device::parse(&device)?))
            .py()
    }

    /// Whether the tensors `a` and `b` hold the same bytes, compared in
    /// bounded chunks (aliases of one tied weight).
    fn same_values(&self, py: Python<'_>, a: String, b: String) -> PyResult<bool> {
        let checkpoint = Arc::clone(&self.inner);
        py.detach(move || checkpoint.same_values(&a, &b)).py()
    }

    /// Bytes of tensor data read so far (headers not counted).
    #[getter]
    fn bytes_read(&self) -> u64 {
        self.inner.bytes_read()
    }

    /// Read `names` into the `capacity` bytes at `address` on `device`
    /// (`cpu`, `cuda:N`): memory the caller allocated and holds during the
    /// call. Returns each name's offset and the timings.
    fn read_into(
        &self,
        py: Python<'_>,
        names: Vec<String>,
        address: usize,
        capacity: usize,
        device: String,
    ) -> PyResult<(Vec<(String, usize)>, Timings)> {
        if address == 0 && capacity > 0 {
            return Err(Error::new(
                Code::RunWeightsInvalid,
                "the buffer has no memory",
            ))
            .py();
        }
        let checkpoint = Arc::clone(&self.inner);
        let (offsets, t) = py
            .detach(move || {
                let device = Device::parse(&device)?;
                // SAFETY: the Python caller (torch_compiled_graphs.runner)
                // passes a tensor's storage it allocated for this read and
                // holds across the call.
                unsafe {
                    tcg_run::pipeline::read_to(&checkpoint, &names, address, capacity, device)
                }
            })
            .py()?;
        Ok((offsets, timings(&t)))
    }
}
