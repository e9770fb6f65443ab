//! A compiled graph's container, driven through the C ABI the wrapper `.so`
//! exports (torch/csrc/inductor/aoti_runtime/interface.h).
//!
//! Ownership, as the generated wrapper implements it: `Run` steals the input
//! handles (the array is borrowed) and hands output handles to the caller;
//! `UpdateConstantBufferPairs` (not user-managed) copies each constant into the
//! container's own buffer and leaves the caller's handles with the caller;
//! afterwards the active buffer is marked unfolded, and the next `Run` folds
//! the computed constants from what was bound, as torch's package loader does.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use libloading::os::unix::{Library, Symbol};
use tcg_core::artifact::metadata::{ConstantRow, ConstantSource};
use tcg_core::{Code, Error, Result};

use crate::cuda::{check_capability, wanted_capability, Device};
use crate::extract::{extract, Extracted};
use crate::inputs::{input_facts, InputFact};
use crate::pipeline::{reader_threads, stage, stage_literals, Memory, Readers, Staged, Timings};
use crate::runtime::{Runtime, RuntimeChoice};
use crate::stdmap::CxxAbi;
use crate::torch::{BorrowedTensor, Dtype, TensorHandle, Torch};
use crate::weights::{Checkpoint, Naming};
use crate::weights_set::{plan_set, SetPlan, WeightsSet};
use tcg_core::artifact::weights::WeightsContract;

/// What a bind did besides binding: the provided names the graph does not
/// bind (declared, dropped by the compiler) and how many tensors lay outside
/// the `strip_prefix`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BindReport {
    /// Provided names the compiled table does not bind, sorted.
    pub ignored: Vec<String>,
    /// Tensors skipped for lying outside `strip_prefix`.
    pub outside_prefix: usize,
    /// Bytes of constants read from the files.
    pub bytes: u64,
    /// Bytes of constants this graph holds of its own beyond a weights set it
    /// is bound to: its literals (a graph bound from files holds every
    /// constant it read, so this is `bytes`). The constants the container
    /// folds live in its own buffers, whose size it does not report: not
    /// counted.
    pub added_bytes: u64,
    /// How long each phase of the bind took, in seconds (`plan_weights`,
    /// `cuda_context` on a GPU, `read_weights`, `copy_weights`, `bind_weights`).
    pub timings: Timings,
}

type Container = *mut c_void;

#[repr(C)]
struct ConstantMapEntry {
    name: *const c_char,
    handle: TensorHandle,
}

type CreateWithDevice =
    unsafe extern "C" fn(*mut Container, usize, *const c_char, *const c_char) -> i32;
type Delete = unsafe extern "C" fn(Container) -> i32;
type GetCount = unsafe extern "C" fn(Container, *mut usize) -> i32;
type GetStr = unsafe extern "C" fn(Container, usize, *mut *const c_char) -> i32;
type GetBool = unsafe extern "C" fn(Container, usize, *mut bool) -> i32;
type GetI32 = unsafe extern "C" fn(Container, usize, *mut i32) -> i32;
type UpdatePairs =
    unsafe extern "C" fn(Container, *const ConstantMapEntry, usize, bool, bool) -> i32;
type UpdateMap = unsafe extern "C" fn(Container, *mut c_void, bool, bool) -> i32;
type GetCallSpec = unsafe extern "C" fn(Container, *mut *const c_char, *mut *const c_char) -> i32;
type Run = unsafe extern "C" fn(
    Container,
    *mut TensorHandle,
    usize,
    *mut TensorHandle,
    usize,
    *mut c_void,
    *mut c_void,
) -> i32;
pub(crate) type LastError = unsafe extern "C" fn(*mut *const c_char) -> i32;
type ConstFold = unsafe extern "C" fn(Container, bool, *mut c_void, *mut c_void) -> i32;

#[derive(Clone, Copy)]
pub(crate) struct Api {
    delete: Delete,
    update_pairs: Option<UpdatePairs>,
    update_map: Option<UpdateMap>,
    // The user-managed variants: the container keeps handles to the caller's
    // memory instead of copying it into a buffer of its own.
    user_pairs: Option<UpdatePairs>,
    user_map: Option<UpdateMap>,
    pub(crate) run: Run,
    // The run on one model without the container's pool bookkeeping (no
    // event recorded per run): the form a CUDA-graph capture can hold.
    pub(crate) run_single_threaded: Option<Run>,
    pub(crate) last_error: Option<LastError>,
    // Folds the constants again from the bound values (after a LoRA changed
    // a weights set the graph is bound to).
    const_fold: Option<ConstFold>,
}

enum Update {
    Pairs(UpdatePairs),
    Map(UpdateMap),
}

/// One constant of the container, in its index order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerConstant {
    /// The mangled buffer name the container keys constants by.
    pub name: CString,
    /// The original fqn (the name when the wrapper records none).
    pub fqn: String,
    /// Whether constant folding computes it.
    pub from_folded: bool,
    /// Its dtype.
    pub dtype: Dtype,
}

/// One input of a call: a C-contiguous buffer in host or device memory.
#[derive(Debug, Clone)]
pub struct Input {
    /// The address of the first element (a device address for a CUDA buffer).
    pub data: usize,
    /// The buffer's length in bytes.
    pub nbytes: usize,
    /// Inductor's dtype name.
    pub dtype: String,
    /// The shape.
    pub shape: Vec<i64>,
    /// Where the buffer is. A host buffer given to a CUDA graph is copied to
    /// the graph's device on the call's stream; a buffer on another device is
    /// `run.device_mismatch`.
    pub device: Device,
}

/// A caller-owned buffer to bind as one constant ([`Graph::bind_buffers`]).
#[derive(Debug, Clone)]
pub struct ConstantBuffer {
    /// The constant's fqn, as the graph's table names it.
    pub fqn: String,
    /// The address of the first element (a device address on a GPU).
    pub data: usize,
    /// The buffer's length in bytes.
    pub nbytes: usize,
    /// Inductor's dtype name.
    pub dtype: String,
    /// The shape (C-contiguous).
    pub shape: Vec<i64>,
    /// Where the buffer is: the graph's device.
    pub device: Device,
}

/// Where a load's weights come from.
#[derive(Debug, Clone)]
pub enum WeightsSource<'a> {
    /// Safetensors files, read for this graph alone (what it binds).
    Files(&'a Checkpoint),
    /// A weights set on the graph's device, shared with other graphs: bound
    /// without a copy ([`Graph::bind_set`]).
    Set(Arc<WeightsSet>),
}

/// What [`Graph::load_request`] loads: entry `entry` of the package at
/// `package`, with libtorch from `torch_lib`, on `device` (`cpu`, `cuda:N`),
/// for an artifact of axis value `sm`, checked against `rows` (the
/// metadata's constant table) and bound by `contract` (the artifact's
/// weights contract) from `weights`, its literal rows from `literals` (the
/// artifact's `constants.safetensors`, when it has any).
#[derive(Debug)]
pub struct LoadRequest<'a> {
    /// The directory of libtorch's shared libraries.
    pub torch_lib: &'a Path,
    /// The package (`model.pt2`).
    pub package: &'a Path,
    /// The entry (graph class name) inside the package.
    pub entry: &'a str,
    /// `cpu` or `cuda:N`.
    pub device: &'a str,
    /// The artifact's axis value (`cpu…` or `sm_NN`).
    pub sm: &'a str,
    /// The metadata's constant table.
    pub rows: Vec<ConstantRow>,
    /// The artifact's weights contract.
    pub contract: WeightsContract,
    /// Where the weights come from.
    pub weights: WeightsSource<'a>,
    /// The literal payload, when the graph has literal rows.
    pub literals: Option<&'a Path>,
    /// The runtime to run on and why ([`crate::runtime::choose_for_package`]);
    /// `torch_lib` is not opened for the shim runtime. A weights set is
    /// libtorch's: a graph bound to one runs on libtorch.
    pub runtime: RuntimeChoice,
}

/// What the staging thread of a load produced.
enum Staging {
    Files(Staged),
    Set(SetPlan, Option<Staged>, f64),
}

/// A resolved graph loaded through the wrapper's C ABI.
pub struct Graph {
    pub(crate) torch: Arc<Torch>,
    pub(crate) api: Api,
    pub(crate) container: Container,
    pub(crate) device: Device,
    constants: Vec<ContainerConstant>,
    rows: BTreeMap<String, ConstantRow>,
    pub(crate) num_inputs: usize,
    pub(crate) num_outputs: usize,
    call_spec: (String, String),
    pub(crate) input_facts: Option<Vec<InputFact>>,
    // Runs share the lock; binding takes it alone (the container does not
    // guard its active constant buffer against a concurrent update).
    pub(crate) lock: RwLock<()>,
    // Whether calls use the single-threaded run (then each call takes `lock`
    // alone: that run guards nothing itself).
    pub(crate) single_threaded: std::sync::atomic::AtomicBool,
    // libstdc++'s layout and hash, when the runtime binds through a std map.
    cxx: Option<CxxAbi>,
    // How provided names bind the table (the artifact's weights contract).
    contract: RwLock<WeightsContract>,
    // The allocation the container's constants live in, when it was handed
    // over without a copy; freed after the container (see `Drop`).
    weights: Mutex<Option<Memory>>,
    // The weights set the container's constants point into, when bound to
    // one; dropped after the container (see `Drop`), so graph and set drop
    // in any order.
    pub(crate) set: Mutex<Option<Arc<WeightsSet>>>,
    // The set's values generation the container's folded constants were
    // computed from (see `WeightsSet::values_generation`).
    folded_generation: std::sync::atomic::AtomicU64,
    // What the last bind added beyond memory shared with others (see
    // `BindReport::added_bytes`).
    added_bytes: std::sync::atomic::AtomicU64,
    // How long loading took, phase by phase.
    load_timings: Timings,
    // The runtime the graph runs on and why it was chosen.
    runtime_choice: RuntimeChoice,
    // Bumped by every bind: a CUDA graph captured under another generation
    // reads constants by addresses that may be gone, and is dropped.
    pub(crate) binding_generation: std::sync::atomic::AtomicU64,
    // The captured CUDA graphs of this graph's calls (`crate::capture`).
    pub(crate) captures: Mutex<crate::capture::Captures>,
    // Dropped after the container (field order): the .so, then its directory.
    _library: Library,
    _extracted: Extracted,
}

// SAFETY: the container is built for concurrent `Run` calls (its own model
// pool and mutexes); the one operation it does not guard, updating the active
// constant buffer, is serialised against runs by `lock`. Everything else is
// immutable after construction.
unsafe impl Send for Graph {}
// SAFETY: as above.
unsafe impl Sync for Graph {}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("constants", &self.constants)
            .field("num_inputs", &self.num_inputs)
            .field("num_outputs", &self.num_outputs)
            .finish()
    }
}

fn invalid(message: String) -> Error {
    Error::new(Code::RunPackageInvalid, message)
}

fn get<T: Copy>(lib: &Library, name: &str) -> Result<T> {
    // SAFETY: `T` is the exact C signature interface.h declares for `name`;
    // the pointer is used only while `lib` is loaded (the `Graph` holds it).
    let sym: Symbol<T> = unsafe { lib.get(name.as_bytes()) }
        .map_err(|e| invalid(format!("the graph's .so does not export {name}: {e}")))?;
    Ok(*sym)
}

fn text(p: *const c_char, what: &str) -> Result<String> {
    if p.is_null() {
        return Err(invalid(format!("the container returned no {what}")));
    }
    // SAFETY: the container returns NUL-terminated strings it owns and keeps
    // alive as long as itself; this copies them at once.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(str::to_owned)
        .map_err(|_| invalid(format!("the container's {what} is not UTF-8")))
}

impl Graph {
    /// Load entry `entry` of the package at `package` with libtorch `torch`
    /// on `device` (`cpu`, `cuda:N`), for an artifact of axis value `sm`, and
    /// check the container's constants against `rows` (the metadata's
    /// constant table) before anything is bound.
    ///
    /// A CPU artifact runs on `cpu` only; an `sm_NN` artifact on a CUDA device
    /// of exactly that capability (`run.device_mismatch` otherwise, also when
    /// torch has no CUDA support or no device is visible).
    pub fn load(
        torch: Arc<Torch>,
        package: &Path,
        entry: &str,
        device: &str,
        sm: &str,
        rows: Vec<ConstantRow>,
    ) -> Result<Graph> {
        let device = Device::parse(device)?;
        let wants = wanted_capability(device, sm)?;
        if let (Device::Cuda(index), Some(want)) = (device, wants) {
            check_capability(device, sm, want, torch.cuda()?.capability(index)?)?;
        }
        let extracted = extract(package, entry, wants.map(|_| sm))?;
        Graph::from_extracted(torch, extracted, device, rows, &mut Vec::new())
    }

    /// Open the graph's `.so` from its private directory (`open_model`) and
    /// create its container (`create_container`), both timed into `timings`.
    /// The device's capability was checked by the caller.
    fn from_extracted(
        torch: Arc<Torch>,
        extracted: Extracted,
        device: Device,
        rows: Vec<ConstantRow>,
        timings: &mut Timings,
    ) -> Result<Graph> {
        let t = Instant::now();
        let library = torch.open_model(extracted.shared_object()).map_err(|e| {
            invalid(format!(
                "cannot load the graph's .so on the {} runtime: {e}",
                torch.runtime()
            ))
        })?;
        timings.push(("open_model", t.elapsed().as_secs_f64()));
        let create: CreateWithDevice = get(&library, "AOTInductorModelContainerCreateWithDevice")?;
        let api = Api {
            delete: get(&library, "AOTInductorModelContainerDelete")?,
            // The C pairs API is newer than some runtimes (torch 2.11 has only
            // the std::unordered_map one); either binds the same way.
            update_pairs: get(
                &library,
                "AOTInductorModelContainerUpdateConstantBufferPairs",
            )
            .ok(),
            update_map: get(&library, "AOTInductorModelContainerUpdateConstantBuffer").ok(),
            user_pairs: get(
                &library,
                "AOTInductorModelContainerUpdateUserManagedConstantBufferPairs",
            )
            .ok(),
            user_map: get(
                &library,
                "AOTInductorModelContainerUpdateUserManagedConstantBuffer",
            )
            .ok(),
            run: get(&library, "AOTInductorModelContainerRun")?,
            run_single_threaded: get(&library, "AOTInductorModelContainerRunSingleThreaded").ok(),
            // Older runtimes print their errors to stderr and export no getter.
            last_error: get(&library, "AOTInductorGetLastError").ok(),
            const_fold: get(&library, "AOTInductorModelContainerRunConstantFolding").ok(),
        };
        let cxx = match (api.update_pairs, api.update_map) {
            (Some(_), _) => None,
            (None, Some(_)) => Some(CxxAbi::for_graph(&torch, extracted.shared_object())?),
            (None, None) => return Err(invalid(
                "the graph's .so exports no way to bind constants (UpdateConstantBuffer[Pairs])"
                    .into(),
            )),
        };
        let num_constants: GetCount = get(&library, "AOTInductorModelContainerGetNumConstants")?;
        let constant_name: GetStr = get(&library, "AOTInductorModelContainerGetConstantName")?;
        let constant_fqn: GetStr =
            get(&library, "AOTInductorModelContainerGetConstantOriginalFQN")?;
        let from_folded: GetBool = get(&library, "AOTInductorModelContainerGetConstantFromFolded")?;
        let constant_dtype: GetI32 = get(&library, "AOTInductorModelContainerGetConstantDtype")?;
        let num_inputs: GetCount = get(&library, "AOTInductorModelContainerGetNumInputs")?;
        let num_outputs: GetCount = get(&library, "AOTInductorModelContainerGetNumOutputs")?;
        let call_spec: GetCallSpec = get(&library, "AOTInductorModelContainerGetCallSpec")?;

        let device_c = CString::new(device.to_string()).expect("no NUL in a device name");
        let cubin_dir = CString::new(extracted.dir().as_os_str().as_encoded_bytes())
            .map_err(|_| invalid("the private directory's path has a NUL".into()))?;
        let cubin_ptr = if device.is_cuda() {
            cubin_dir.as_ptr()
        } else {
            std::ptr::null()
        };
        let _device_guard = match device {
            Device::Cuda(i) => {
                // The runtime's first call in the process initialises it.
                let t = Instant::now();
                let guard = torch.cuda()?.device_guard(i)?;
                timings.push(("cuda_runtime", t.elapsed().as_secs_f64()));
                Some(guard)
            }
            Device::Cpu => None,
        };
        let t = Instant::now();
        let mut container: Container = std::ptr::null_mut();
        // SAFETY: one model; `device_c` and `cubin_dir` are NUL-terminated
        // strings that outlive the call; a CUDA graph finds its kernels in the
        // private directory the cubins were extracted to, a CPU graph takes none.
        let rc = unsafe { create(&mut container, 1, device_c.as_ptr(), cubin_ptr) };
        if rc != 0 || container.is_null() {
            return Err(invalid(format!(
                "cannot create the graph's container: {}",
                last_error(api.last_error)
            )));
        }
        // From here on `graph` owns the container and deletes it on any error.
        let mut graph = Graph {
            torch,
            api,
            container,
            device,
            constants: Vec::new(),
            rows: BTreeMap::new(),
            num_inputs: 0,
            num_outputs: 0,
            call_spec: (String::new(), String::new()),
            input_facts: None,
            lock: RwLock::new(()),
            cxx,
            contract: RwLock::new(WeightsContract::from_rows(&[])),
            weights: Mutex::new(None),
            set: Mutex::new(None),
            folded_generation: std::sync::atomic::AtomicU64::new(0),
            added_bytes: std::sync::atomic::AtomicU64::new(0),
            single_threaded: std::sync::atomic::AtomicBool::new(false),
            load_timings: Vec::new(),
            runtime_choice: RuntimeChoice {
                runtime: Runtime::Libtorch,
                reason: String::new(),
            },
            binding_generation: std::sync::atomic::AtomicU64::new(0),
            captures: Mutex::new(crate::capture::Captures::off("not enabled")),
            _library: library,
            _extracted: extracted,
        };
        let check = |rc: i32, what: &str| -> Result<()> {
            if rc == 0 {
                Ok(())
            } else {
                Err(invalid(format!(
                    "cannot read the container's {what}: {}",
                    last_error(api.last_error)
                )))
            }
        };
        let (mut n, mut inputs, mut outputs) = (0usize, 0usize, 0usize);
        // SAFETY (this block and the loop below): `container` is live; every
        // call writes through valid out-pointers; indices are below the count
        // the container reported.
        unsafe {
            check(num_constants(container, &mut n), "constant count")?;
            check(num_inputs(container, &mut inputs), "input count")?;
            check(num_outputs(container, &mut outputs), "output count")?;
        }
        for i in 0..n {
            let (mut name, mut fqn, mut folded, mut code) =
                (std::ptr::null(), std::ptr::null(), false, 0i32);
            // SAFETY: see above.
            unsafe {
                check(constant_name(container, i, &mut name), "constant names")?;
                check(constant_fqn(container, i, &mut fqn), "constant fqns")?;
                check(from_folded(container, i, &mut folded), "constant kinds")?;
                check(constant_dtype(container, i, &mut code), "constant dtypes")?;
            }
            let name = text(name, "constant name")?;
            let fqn = text(fqn, "constant fqn")?;
            let fqn = if fqn.is_empty() { name.clone() } else { fqn };
            let dtype = graph.torch.dtype_by_code(code).ok_or_else(|| {
                Error::new(
                    Code::RunNativeUnsupported,
                    format!(
                        "constant {fqn:?} has a dtype (code {code}) the native path does not bind"
                    ),
                )
            })?;
            graph.constants.push(ContainerConstant {
                name: CString::new(name)
                    .map_err(|_| invalid("a constant name has a NUL".into()))?,
                fqn,
                from_folded: folded,
                dtype,
            });
        }
        let (mut in_spec, mut out_spec) = (std::ptr::null(), std::ptr::null());
        // SAFETY: see above.
        unsafe {
            check(
                call_spec(container, &mut in_spec, &mut out_spec),
                "call spec",
            )?
        };
        graph.call_spec = (text(in_spec, "input spec")?, text(out_spec, "output spec")?);
        graph.num_inputs = inputs;
        graph.num_outputs = outputs;
        graph.input_facts = input_facts(&graph._extracted.wrapper)?;
        if let Some(facts) = &graph.input_facts {
            if facts.len() != inputs {
                return Err(invalid(format!(
                    "the wrapper checks {} inputs, the container takes {inputs}",
                    facts.len()
                )));
            }
        }
        graph.check_rows(rows)?;
        graph.runtime_choice = RuntimeChoice {
            runtime: graph.torch.runtime(),
            reason: "the runtime the caller opened".into(),
        };
        timings.push(("create_container", t.elapsed().as_secs_f64()));
        Ok(graph)
    }

    /// The container's constants must be exactly the metadata's rows: the
    /// same fqns, folded exactly where the row is `computed`, the same dtype.
    fn check_rows(&mut self, rows: Vec<ConstantRow>) -> Result<()> {
        let mut by_fqn = BTreeMap::new();
        for row in rows {
            if let Some(dup) = by_fqn.insert(row.fqn.clone(), row) {
                return Err(invalid(format!(
                    "metadata lists constant {:?} twice",
                    dup.fqn
                )));
            }
        }
        let package: BTreeSet<&str> = self.constants.iter().map(|c| c.fqn.as_str()).collect();
        let metadata: BTreeSet<&str> = by_fqn.keys().map(String::as_str).collect();
        if package != metadata || package.len() != self.constants.len() {
            return Err(invalid(format!(
                "the package's constants differ from its metadata (package only {:?}, metadata only {:?})",
                package.difference(&metadata).collect::<Vec<_>>(),
                metadata.difference(&package).collect::<Vec<_>>()
            )));
        }
        for c in &self.constants {
            let row = &by_fqn[&c.fqn];
            if c.from_folded != (row.source == ConstantSource::Computed)
                || c.dtype.name != row.dtype
            {
                return Err(invalid(format!(
                    "constant {:?} is {}{} in the package, the metadata says {} {}",
                    c.fqn,
                    if c.from_folded { "folded " } else { "" },
                    c.dtype.name,
                    row.source.as_str(),
                    row.dtype
                )));
            }
        }
        let rows: Vec<ConstantRow> = by_fqn.values().cloned().collect();
        self.set_contract(WeightsContract::from_rows(&rows));
        self.rows = by_fqn;
        Ok(())
    }

    /// The fqns the weights file must hold (`state_dict` rows), in table order.
    pub fn weight_fqns(&self) -> Vec<&str> {
        self.constants
            .iter()
            .filter(|c| self.rows[&c.fqn].source == ConstantSource::StateDict)
            .map(|c| c.fqn.as_str())
            .collect()
    }

    /// Whether any constant is a literal carried in `constants.safetensors`.
    pub fn has_literals(&self) -> bool {
        self.rows
            .values()
            .any(|r| r.source == ConstantSource::Literal)
    }

    /// Input and output tree specs (torch's treespec JSON), from the container.
    pub fn call_spec(&self) -> &(String, String) {
        &self.call_spec
    }
    /// The number of tensor inputs a call takes.
    pub fn num_inputs(&self) -> usize {
        self.num_inputs
    }
    /// The number of outputs a call returns.
    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }
    /// What the wrapper checks for each input, when it states it.
    pub fn input_facts(&self) -> Option<&[InputFact]> {
        self.input_facts.as_deref()
    }
    /// The canonical directory libtorch was loaded from.
    pub fn torch_dir(&self) -> &Path {
        self.torch.dir()
    }
    /// libtorch, as loaded (or the shim runtime: see [`Graph::runtime`]).
    pub fn torch(&self) -> &Arc<Torch> {
        &self.torch
    }
    /// The runtime the graph runs on (`libtorch`, `shim-v1`).
    pub fn runtime(&self) -> Runtime {
        self.runtime_choice.runtime
    }
    /// Why the graph runs on [`Graph::runtime`] (docs/run.md, "Runtime").
    pub fn runtime_reason(&self) -> &str {
        &self.runtime_choice.reason
    }
    /// The device the graph runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether the graph's runtime has the single-threaded run
    /// (`AOTInductorModelContainerRunSingleThreaded`).
    pub fn has_single_threaded_run(&self) -> bool {
        self.api.run_single_threaded.is_some()
    }

    /// Run calls through the single-threaded run (`true`), which records no
    /// event of its own per run, so that a caller's CUDA-graph capture can hold
    /// the call; calls then run one at a time. A runtime without it refuses
    /// (`run.native_unsupported`) and keeps the threaded run.
    pub fn set_single_threaded(&self, on: bool) -> Result<()> {
        if on && self.api.run_single_threaded.is_none() {
            return Err(Error::new(
                Code::RunNativeUnsupported,
                "the graph's runtime has no single-threaded run (AOTInductorModelContainerRunSingleThreaded)",
            ));
        }
        let _exclusive = self.lock.write().unwrap_or_else(|p| p.into_inner());
        self.single_threaded
            .store(on, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// Whether calls use the single-threaded run.
    pub fn single_threaded(&self) -> bool {
        self.single_threaded
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Bind through the `std::unordered_map` API even where the C pairs API
    /// exists (what a runtime without the pairs API does; for tests).
    #[doc(hidden)]
    pub fn bind_through_std_map(&mut self) -> Result<()> {
        if self.api.update_map.is_none() {
            return Err(invalid(
                "the graph's .so has no UpdateConstantBuffer".into(),
            ));
        }
        self.cxx = Some(CxxAbi::for_graph(
            &self.torch,
            self._extracted.shared_object(),
        )?);
        Ok(())
    }
    /// The container's constants in index order.
    pub fn constants(&self) -> &[ContainerConstant] {
        &self.constants
    }

    /// Bind the weights at `weights` (and the literal payload at `literals`
    /// when the graph has literal rows). Every constant is checked (presence,
    /// no extras, dtype, shape) before anything reaches the container; the
    /// folded constants are recomputed from these values on the next run.
    pub fn bind(&self, weights: &Path, literals: Option<&Path>) -> Result<BindReport> {
        let checkpoint = Checkpoint::open(&[weights.to_owned()], &Naming::default())?;
        self.bind_checkpoint(&checkpoint, literals)
    }

    /// Use `contract` (the artifact's weights contract) for every later bind:
    /// aliases bind, declared names the table dropped are ignored, a missing
    /// name is explained by its kind. Without it, the weights must hold
    /// exactly the table's rows.
    pub fn set_contract(&self, contract: WeightsContract) {
        *self.contract.write().unwrap_or_else(|p| p.into_inner()) = contract;
    }

    /// [`Graph::bind`] of a checkpoint already opened (one file, a sharded
    /// checkpoint, a prefix applied): staged by the weights pipeline, then
    /// bound.
    pub fn bind_checkpoint(
        &self,
        checkpoint: &Checkpoint,
        literals: Option<&Path>,
    ) -> Result<BindReport> {
        let rows: Vec<ConstantRow> = self.rows.values().cloned().collect();
        let readers = Readers::spawn(reader_threads())?;
        let staged = {
            let contract = self.contract.read().unwrap_or_else(|p| p.into_inner());
            stage(
                &rows,
                &contract,
                checkpoint,
                literals,
                self.device,
                // `Graph::load` checked the device's capability already.
                "",
                &readers,
            )?
        };
        self.bind_staged(staged)
    }

    /// Hand staged constants to the container: without a copy where the
    /// runtime has the user-managed API (the graph then keeps the allocation
    /// until the next bind or its drop), else copied into the container's
    /// own buffer (and the allocation freed when this returns).
    pub fn bind_staged(&self, staged: Staged) -> Result<BindReport> {
        let started = Instant::now();
        let Staged {
            memory,
            placed,
            ignored,
            outside_prefix,
            bytes,
            mut timings,
        } = staged;
        let base = memory.ptr();
        let mut tensors: Vec<(&ContainerConstant, BorrowedTensor)> = Vec::new();
        for c in self.constants.iter().filter(|c| !c.from_folded) {
            let p = placed.get(&c.fqn).ok_or_else(|| {
                Error::new(
                    Code::RunConstantMissing,
                    format!("the staged weights lack {:?}", c.fqn),
                )
            })?;
            if p.dtype != c.dtype.name {
                return Err(Error::new(
                    Code::RunConstantMismatch,
                    format!(
                        "constant {:?} is {}, the graph was compiled for {}",
                        c.fqn, p.dtype, c.dtype.name
                    ),
                ));
            }
            // SAFETY: `p.offset` and the constant's bytes (product(shape) *
            // element size, checked against the file's header and the row,
            // whose dtype is the container's) lie inside `memory`, which
            // outlives every handle: they drop at the end of this function,
            // and the container's own handles (user-managed) live no longer
            // than `memory`, which the graph keeps until the next bind
            // replaced them or the container is deleted.
            let t = unsafe {
                BorrowedTensor::new(
                    &self.torch,
                    (base + p.offset) as *mut c_void,
                    &p.shape,
                    c.dtype,
                    self.device,
                )?
            };
            tensors.push((c, t));
        }
        let user_managed = self.hand_over(tensors)?;
        let mut held = self.weights.lock().unwrap_or_else(|p| p.into_inner());
        // The container now reads the new allocation (or its own copy); the
        // previous allocation is no longer referenced and is freed here.
        *held = if user_managed { Some(memory) } else { None };
        drop(held);
        // No longer bound to a set (if it was).
        drop(self.set.lock().unwrap_or_else(|p| p.into_inner()).take());
        timings.push(("bind_weights", started.elapsed().as_secs_f64()));
        self.added_bytes
            .store(bytes, std::sync::atomic::Ordering::SeqCst);
        Ok(BindReport {
            ignored,
            outside_prefix,
            bytes,
            added_bytes: bytes,
            timings,
        })
    }

    /// Bind the graph to `set` (a rebind; [`WeightsSource::Set`] binds at
    /// load): the names the graph's table needs are checked by its weights
    /// contract as a bind from files checks them (the same codes; names the
    /// compiler dropped are ignored and reported), then the container gets
    /// user-managed handles over the set's memory, without a copy. The
    /// graph's literals (`literals`, the artifact's `constants.safetensors`,
    /// when it has literal rows) are read into memory of its own. A set on
    /// another device is `run.device_mismatch`. A refused bind leaves the
    /// bound weights in place.
    pub fn bind_set(&self, set: &Arc<WeightsSet>, literals: Option<&Path>) -> Result<BindReport> {
        let started = Instant::now();
        let rows: Vec<ConstantRow> = self.rows.values().cloned().collect();
        let plan = {
            let contract = self.contract.read().unwrap_or_else(|p| p.into_inner());
            plan_set(&rows, &contract, set, self.device)?
        };
        let mut timings: Timings = vec![("plan_weights", started.elapsed().as_secs_f64())];
        let staged = stage_literals(&rows, literals, self.device, &Readers::spawn(1)?)?;
        if let Some(s) = &staged {
            timings.extend(s.timings.iter().filter(|(k, _)| *k != "plan_weights"));
        }
        let mut report = self.bind_to_set(set, plan, staged)?;
        timings.extend(report.timings.iter().copied());
        report.timings = timings;
        Ok(report)
    }

    /// Bytes of constants the last bind added for this graph alone, beyond
    /// a weights set it shares ([`BindReport::added_bytes`]; the constants
    /// the container folds are its own and not counted).
    pub fn added_bytes(&self) -> u64 {
        self.added_bytes.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether the container folds constants from values of `set` that
    /// changed since it last folded them.
    pub(crate) fn folds_stale(&self, set: &WeightsSet) -> bool {
        self.folded_generation
            .load(std::sync::atomic::Ordering::SeqCst)
            != set.values_generation()
            && self.constants.iter().any(|c| c.from_folded)
    }

    /// Fold the container's constants again from `set`'s current values, on
    /// `stream`, with the graph's lock held alone (no run reads the folded
    /// buffers meanwhile); the caller holds the set's lock shared (its values
    /// do not change; the set's lock before the graph's, as a call takes
    /// them). On a GPU the fold is finished before this returns, so calls on
    /// any stream read the new folds, and the binding generation is bumped:
    /// the folded buffers may have moved, so CUDA-graph captures are dropped.
    /// A runtime without the folding entry point refuses the call
    /// (`run.weights_stale`: rebind the graph to the set).
    pub(crate) fn refold(&self, set: &WeightsSet, stream: usize) -> Result<()> {
        let _exclusive = self.lock.write().unwrap_or_else(|p| p.into_inner());
        let generation = set.values_generation();
        if self
            .folded_generation
            .load(std::sync::atomic::Ordering::SeqCst)
            == generation
        {
            return Ok(());
        }
        let fold = self.api.const_fold.ok_or_else(|| {
            Error::new(
                Code::RunWeightsStale,
                "the weights set's values changed (a LoRA) and this graph folds constants from them, \
                 but its runtime cannot fold again (no AOTInductorModelContainerRunConstantFolding): \
                 bind the graph to the set again",
            )
        })?;
        // SAFETY: the container is live; `stream` is the caller's live stream
        // of the graph's device (0 on the CPU); no proxy executor. The active
        // buffer is folded under the container's own exclusive lock, and no
        // run of this graph is in flight (its lock is held alone).
        let rc = unsafe {
            fold(
                self.container,
                false,
                stream as *mut c_void,
                std::ptr::null_mut(),
            )
        };
        if rc != 0 {
            return Err(Error::new(
                Code::RunExecutionFailed,
                format!(
                    "folding the graph's constants again failed: {}",
                    last_error(self.api.last_error)
                ),
            ));
        }
        if self.device.is_cuda() {
            self.torch.cuda()?.synchronize(stream)?;
        }
        self.folded_generation
            .store(generation, std::sync::atomic::Ordering::SeqCst);
        self.binding_generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// The weights set the graph is bound to, if any.
    pub fn weights_set(&self) -> Option<Arc<WeightsSet>> {
        self.set.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Hand the container handles over `set`'s tensors (as `plan` maps them)
    /// and the graph's own literals (`literals`, staged), then hold both.
    fn bind_to_set(
        &self,
        set: &Arc<WeightsSet>,
        plan: SetPlan,
        literals: Option<Staged>,
    ) -> Result<BindReport> {
        let started = Instant::now();
        if !Arc::ptr_eq(set.torch(), &self.torch) {
            return Err(Error::new(
                Code::RunTorchMismatch,
                "the weights set was opened with another libtorch than the graph's",
            ));
        }
        let mut tensors: Vec<(&ContainerConstant, BorrowedTensor)> = Vec::new();
        let mut shared_bytes = 0u64;
        for c in self.constants.iter().filter(|c| !c.from_folded) {
            let row = &self.rows[&c.fqn];
            let shape: Vec<i64> = row.shape.iter().map(|&d| d as i64).collect();
            let address = match row.source {
                ConstantSource::Literal => {
                    let staged = literals.as_ref().ok_or_else(|| {
                        Error::new(
                            Code::RunLiteralPayload,
                            "the graph has literal constants but no literal payload was given",
                        )
                    })?;
                    let p = staged.placed.get(&c.fqn).ok_or_else(|| {
                        Error::new(
                            Code::RunLiteralPayload,
                            format!("the literal payload lacks {:?}", c.fqn),
                        )
                    })?;
                    staged.memory.ptr() + p.offset
                }
                _ => {
                    let address = *plan.bind.get(&c.fqn).ok_or_else(|| {
                        Error::new(
                            Code::RunConstantMissing,
                            format!("the weights set lacks {:?}", c.fqn),
                        )
                    })?;
                    shared_bytes +=
                        shape.iter().product::<i64>().max(0) as u64 * c.dtype.size as u64;
                    address
                }
            };
            // SAFETY: `address` holds the constant's bytes (its dtype and
            // shape, the container's, checked against the set's entry or the
            // literal payload's header): inside the set's allocation, which
            // the graph holds (an `Arc`) until the next bind replaced it or
            // the container is deleted, or inside the staged literals, which
            // the graph keeps as long. The handles made here drop when this
            // function returns.
            let t = unsafe {
                BorrowedTensor::new(
                    &self.torch,
                    address as *mut c_void,
                    &shape,
                    c.dtype,
                    self.device,
                )?
            };
            tensors.push((c, t));
        }
        let user_managed = self.hand_over(tensors)?;
        let literal_bytes = literals.as_ref().map_or(0, |s| s.bytes);
        // Without the user-managed API the container copied everything.
        let added = if user_managed {
            literal_bytes
        } else {
            literal_bytes + shared_bytes
        };
        self.added_bytes
            .store(added, std::sync::atomic::Ordering::SeqCst);
        let memory = literals.map(|s| s.memory);
        // The container now reads the set (or, without the user-managed
        // API, its own copy) and the literals; the previous allocation or set
        // is no longer referenced and is released here.
        *self.weights.lock().unwrap_or_else(|p| p.into_inner()) =
            if user_managed { memory } else { None };
        // The container folds from the values as they are now, on its next run.
        self.folded_generation
            .store(set.values_generation(), std::sync::atomic::Ordering::SeqCst);
        *self.set.lock().unwrap_or_else(|p| p.into_inner()) = user_managed.then(|| Arc::clone(set));
        Ok(BindReport {
            ignored: plan.ignored,
            outside_prefix: set.outside_prefix(),
            bytes: literal_bytes,
            added_bytes: added,
            timings: vec![("bind_weights", started.elapsed().as_secs_f64())],
        })
    }

    /// Hand `tensors` (one per constant the caller binds) to the container:
    /// by the user-managed API where the runtime has it (the container then
    /// keeps handles to the memory, which must outlive the next bind or the
    /// container), else copied into the container's own buffer. Returns
    /// whether the container keeps the memory (user-managed).
    fn hand_over(&self, tensors: Vec<(&ContainerConstant, BorrowedTensor)>) -> Result<bool> {
        let pairs: Vec<ConstantMapEntry> = tensors
            .iter()
            .map(|(c, t)| ConstantMapEntry {
                name: c.name.as_ptr(),
                handle: t.handle(),
            })
            .collect();
        let cuda = match self.device {
            Device::Cuda(i) => Some((self.torch.cuda()?, i)),
            Device::Cpu => None,
        };
        let _device_guard = match cuda {
            Some((cuda, i)) => Some(cuda.device_guard(i)?),
            None => None,
        };
        // The user-managed API first (no second copy on the device), by the
        // C pairs where the runtime has them, else by a std::unordered_map.
        let api = self.api;
        // (`cxx` is set where the runtime lacks the C pairs API, torch 2.11,
        // or a test asks for the std-map path.)
        let how = if self.cxx.is_some() {
            match (api.user_map, api.update_map) {
                (Some(f), _) => Some((Update::Map(f), true)),
                (None, Some(f)) => Some((Update::Map(f), false)),
                (None, None) => None,
            }
        } else {
            match (api.user_pairs, api.update_pairs) {
                (Some(f), _) => Some((Update::Pairs(f), true)),
                (None, Some(f)) => Some((Update::Pairs(f), false)),
                (None, None) => None,
            }
        };
        let Some((how, user_managed)) = how else {
            return Err(invalid(
                "the graph's .so exports no way to bind constants".into(),
            ));
        };
        let _exclusive = self.lock.write().unwrap_or_else(|p| p.into_inner());
        if let Some((cuda, _)) = cuda {
            // Runs queued earlier may still read the active buffer on the GPU.
            cuda.synchronize_device()?;
        }
        // The write lock keeps runs out while the active buffer changes.
        let rc = match how {
            // SAFETY: `pairs` is an array of `pairs.len()` entries whose names
            // and handles live until after the call; the container copies the
            // data (or, user-managed, takes handles of its own to it) and
            // leaves ours with us.
            Update::Pairs(update) => unsafe {
                update(self.container, pairs.as_ptr(), pairs.len(), false, true)
            },
            Update::Map(update) => {
                let cxx = self.cxx.as_ref().expect("matched above");
                let entries: Vec<(&CString, *mut c_void)> =
                    tensors.iter().map(|(c, t)| (&c.name, t.handle())).collect();
                let map = cxx.map(&entries);
                // SAFETY: `map` is a complete, read-only std::unordered_map in
                // libstdc++'s layout (see `stdmap`) that outlives the call; the
                // container only looks names up in it.
                unsafe { update(self.container, map.as_ptr(), false, true) }
            }
        };
        // Whatever the container did, captures of the previous binding are
        // never replayed again.
        self.binding_generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if rc != 0 {
            return Err(invalid(format!(
                "the container refused the constants: {}",
                last_error(self.api.last_error)
            )));
        }
        drop(tensors);
        Ok(user_managed)
    }

    /// Bind caller-owned buffers as the constants, by fqn, without a copy
    /// where the runtime has the user-managed API: the general form of what
    /// the weights pipeline does with its own allocation (docs/run.md,
    /// "Binding caller-owned buffers"). `buffers` holds exactly one buffer
    /// per constant the caller binds (every constant that constant folding
    /// does not compute: parameters, buffers, literals), each checked
    /// against the graph's table before anything reaches the container: a
    /// name outside the table or a folded one is `run.constant_unexpected`
    /// (twice too), a missing one `run.constant_missing`, another dtype or
    /// shape `run.constant_mismatch`, a length that is not the shape's
    /// `run.input_layout`, another device `run.device_mismatch`. The folded
    /// constants are recomputed from these on the next run. The previous
    /// bind's memory (the pipeline's allocation, or the caller's buffers) is
    /// no longer referenced once this returns.
    ///
    /// Returns whether the container keeps the buffers (user-managed); when
    /// it does not, it copied them and the caller may free them at once.
    ///
    /// # Safety
    ///
    /// Each buffer's `data` is the address of `nbytes` bytes of C-contiguous
    /// memory on `device` that stay allocated, at that address and unchanged
    /// by anything but the caller's deliberate updates, until the next bind
    /// of this graph returned or the graph is dropped.
    pub unsafe fn bind_buffers(&self, buffers: &[ConstantBuffer]) -> Result<bool> {
        let mut by_fqn: BTreeMap<&str, &ConstantBuffer> = BTreeMap::new();
        for b in buffers {
            let known = self
                .constants
                .iter()
                .find(|c| c.fqn == b.fqn)
                .ok_or_else(|| {
                    Error::new(
                        Code::RunConstantUnexpected,
                        format!("the graph has no constant {:?}", b.fqn),
                    )
                })?;
            if known.from_folded {
                return Err(Error::new(
                    Code::RunConstantUnexpected,
                    format!(
                        "constant {:?} is computed by constant folding; it is not bound",
                        b.fqn
                    ),
                ));
            }
            if by_fqn.insert(b.fqn.as_str(), b).is_some() {
                return Err(Error::new(
                    Code::RunConstantUnexpected,
                    format!("constant {:?} is given twice", b.fqn),
                ));
            }
        }
        let mut tensors: Vec<(&ContainerConstant, BorrowedTensor)> = Vec::new();
        for c in self.constants.iter().filter(|c| !c.from_folded) {
            let b = by_fqn.get(c.fqn.as_str()).ok_or_else(|| {
                Error::new(
                    Code::RunConstantMissing,
                    format!("no buffer is given for constant {:?}", c.fqn),
                )
            })?;
            let row = &self.rows[&c.fqn];
            let want: Vec<i64> = row.shape.iter().map(|&d| d as i64).collect();
            if b.dtype != c.dtype.name || b.shape != want {
                return Err(Error::new(
                    Code::RunConstantMismatch,
                    format!(
                        "constant {:?} is {}{:?}, the graph was compiled for {}{:?}",
                        c.fqn, b.dtype, b.shape, c.dtype.name, want
                    ),
                ));
            }
            let elements = want
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?));
            let expected = elements.and_then(|n| n.checked_mul(c.dtype.size));
            if expected != Some(b.nbytes) || (b.data == 0 && b.nbytes > 0) {
                return Err(Error::new(
                    Code::RunInputLayout,
                    format!(
                        "the buffer of constant {:?} holds {} bytes at {:#x}, its shape needs {}",
                        c.fqn,
                        b.nbytes,
                        b.data,
                        expected.map_or_else(
                            || "more than the address space".into(),
                            |n| n.to_string()
                        )
                    ),
                ));
            }
            if b.device != self.device {
                return Err(Error::new(
                    Code::RunDeviceMismatch,
                    format!(
                        "the buffer of constant {:?} is on {}, the graph runs on {}",
                        c.fqn, b.device, self.device
                    ),
                ));
            }
            // SAFETY: `b.data` holds the constant's `nbytes` (checked against
            // its shape and dtype, the container's) on the graph's device,
            // alive until the next bind or the drop (the caller's contract);
            // the handle made here drops when `hand_over` returns.
            let t = unsafe {
                BorrowedTensor::new(
                    &self.torch,
                    b.data as *mut c_void,
                    &b.shape,
                    c.dtype,
                    self.device,
                )?
            };
            tensors.push((c, t));
        }
        let user_managed = self.hand_over(tensors)?;
        // The container reads the caller's buffers (or its own copy) now; the
        // pipeline's allocation (or the weights set) of an earlier bind is no
        // longer referenced.
        drop(
            self.weights
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        drop(self.set.lock().unwrap_or_else(|p| p.into_inner()).take());
        // The caller's buffers are the caller's; a copy is the container's.
        let copied: usize = if user_managed {
            0
        } else {
            buffers.iter().map(|b| b.nbytes).sum()
        };
        self.added_bytes
            .store(copied as u64, std::sync::atomic::Ordering::SeqCst);
        Ok(user_managed)
    }

    /// How long loading took, phase by phase, when the graph was loaded with
    /// [`Graph::load_request`] (`open_libraries`, `extract_package`,
    /// `open_model`, `create_container`, those of the first bind, ...;
    /// docs/run.md lists them); empty for [`Graph::load`].
    pub fn load_timings(&self) -> &Timings {
        &self.load_timings
    }

    /// Load the graph (as [`Graph::load`]) and bind its weights in one step,
    /// overlapped: while libtorch's libraries are opened, one thread extracts
    /// the package (the `.so` and its cubins, checked) and another stages the
    /// weights (on a GPU with the CUDA driver alone: the device context, a
    /// pinned ring, the copies) or, for [`WeightsSource::Set`], checks the
    /// set against the table and reads the graph's literals; the container
    /// is created once both the libraries and the extraction are there, and
    /// only the final hand-over waits for the weights.
    pub fn load_request(req: LoadRequest<'_>) -> Result<(Graph, BindReport)> {
        let LoadRequest {
            torch_lib,
            package,
            entry,
            device,
            sm,
            rows,
            contract,
            weights,
            literals,
            runtime,
        } = req;
        let started = Instant::now();
        let parsed = Device::parse(device)?;
        let wants = wanted_capability(parsed, sm)?;
        // Everything that makes threads or opens libraries comes first: glibc
        // serialises both against the `dlopen` of libtorch below.
        let readers = Readers::spawn(reader_threads())?;
        let mut early: Timings = Vec::new();
        if parsed.is_cuda() {
            // The driver is opened and initialised here, before the `dlopen`:
            // beside libtorch's `dlopen`, initialising it and creating the
            // device context was measured to take up to four times as long,
            // waiting for it (cuInit alone takes ~12 ms). A refusal is
            // reported by staging.
            let t = Instant::now();
            let _ = crate::driver::Driver::get();
            early.push(("cuda_init", t.elapsed().as_secs_f64()));
        }
        // Both helper threads have started before the `dlopen` begins.
        let started_both = std::sync::Barrier::new(3);
        let (loaded, staged) = std::thread::scope(|scope| {
            let staging = scope.spawn(|| {
                started_both.wait();
                match &weights {
                    WeightsSource::Files(checkpoint) => {
                        stage(&rows, &contract, checkpoint, literals, parsed, sm, &readers)
                            .map(Staging::Files)
                    }
                    WeightsSource::Set(set) => {
                        let t = Instant::now();
                        let plan = plan_set(&rows, &contract, set, parsed)?;
                        let took = t.elapsed().as_secs_f64();
                        let staged = stage_literals(&rows, literals, parsed, &readers)?;
                        Ok(Staging::Set(plan, staged, took))
                    }
                }
            });
            let extracting = scope.spawn(|| {
                started_both.wait();
                let t = Instant::now();
                (
                    extract(package, entry, wants.map(|_| sm)),
                    t.elapsed().as_secs_f64(),
                )
            });
            started_both.wait();
            let loaded = (|| -> Result<(Graph, Timings)> {
                let mut timings: Timings = early;
                let t = Instant::now();
                let torch = match runtime.runtime {
                    Runtime::Libtorch => Torch::open(torch_lib),
                    Runtime::ShimV1 if parsed.is_cuda() => Torch::open_shim_cuda(),
                    Runtime::ShimV1 => Torch::open_shim(),
                }
                .and_then(|torch| {
                    if parsed.is_cuda() {
                        torch.cuda()?;
                    }
                    Ok(torch)
                });
                timings.push(("open_libraries", t.elapsed().as_secs_f64()));
                let t = Instant::now();
                let (extracted, took) = extracting.join().unwrap_or_else(|_| {
                    (Err(invalid("extracting the package panicked".into())), 0.0)
                });
                timings.push(("extract_package", took));
                timings.push(("wait_package", t.elapsed().as_secs_f64()));
                let torch = torch?;
                if let (Device::Cuda(index), Some(want)) = (parsed, wants) {
                    // Asked of the driver: the runtime is first called by the
                    // container's creation. Before the extraction's result: a
                    // device of another capability says more than its cubins.
                    let have = crate::driver::Driver::get()?.capability(index)?;
                    check_capability(parsed, sm, want, have)?;
                }
                let extracted = extracted?;
                // cuBLAS primed on a helper thread while the container is
                // created and the weights arrive (crate::warm).
                let priming = match parsed {
                    Device::Cuda(index) => crate::warm::plan(&extracted.wrapper, &rows)
                        .and_then(|(bias, name)| Some((bias, torch.dtype_by_name(name)?)))
                        .map(|(bias, dtype)| {
                            let torch = Arc::clone(&torch);
                            scope.spawn(move || {
                                let t = Instant::now();
                                let ran = crate::warm::prime(&torch, index, bias, dtype);
                                (ran, t.elapsed().as_secs_f64())
                            })
                        }),
                    Device::Cpu => None,
                };
                let graph =
                    Graph::from_extracted(torch, extracted, parsed, rows.clone(), &mut timings);
                if let Some(priming) = priming {
                    if let Ok((true, took)) = priming.join() {
                        timings.push(("prime_blas", took));
                    }
                }
                Ok((graph?, timings))
            })();
            let t = Instant::now();
            let staged = staging
                .join()
                .unwrap_or_else(|_| Err(invalid("the weights pipeline panicked".into())));
            (
                loaded.map(|(g, mut timings)| {
                    timings.push(("wait_weights", t.elapsed().as_secs_f64()));
                    (g, timings)
                }),
                staged,
            )
        });
        // A package or device refusal says more than what staging hit after it.
        let (mut graph, mut timings) = loaded?;
        let staged = staged?;
        graph.set_contract(contract);
        graph.runtime_choice = runtime;
        let report = match (staged, &weights) {
            (Staging::Files(staged), _) => graph.bind_staged(staged)?,
            (Staging::Set(plan, literals, took), WeightsSource::Set(set)) => {
                timings.push(("plan_weights", took));
                if let Some(s) = &literals {
                    timings.extend(s.timings.iter().filter(|(k, _)| *k != "plan_weights"));
                }
                graph.bind_to_set(set, plan, literals)?
            }
            // (Staged for a set exactly when the source is a set.)
            (Staging::Set(..), WeightsSource::Files(_)) => {
                return Err(invalid("the weights were staged for another source".into()))
            }
        };
        timings.extend(report.timings.iter().copied());
        timings.push(("load_total", started.elapsed().as_secs_f64()));
        graph.load_timings = timings;
        Ok((graph, report))
    }
}

pub(crate) fn last_error(f: Option<LastError>) -> String {
    let Some(f) = f else {
        return "no error message (this runtime reports errors on stderr only)".into();
    };
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: writes one pointer to a thread-local string the runtime owns
    // until its next call on this thread; it is copied at once.
    let rc = unsafe { f(&mut p) };
    if rc != 0 || p.is_null() {
        return "no error message".into();
    }
    // SAFETY: a NUL-terminated string, valid until the next runtime call here.
    let s = unsafe { CStr::from_ptr(p) }
        .to_string_lossy()
        .trim()
        .to_owned();
    if s.is_empty() {
        "no error message".into()
    } else {
        s
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // Captured CUDA graphs launch the container's kernels and read its
        // constants: they go first, once their last replay finished.
        self.captures
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .teardown(&self.torch);
        // SAFETY: the container was created by this value and is deleted once,
        // before the library that implements it is closed (field order) and
        // before the constants' allocation it may point into is freed.
        unsafe { (self.api.delete)(self.container) };
        drop(
            self.weights
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        drop(self.set.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}
