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
use std::sync::{Arc, RwLock};

use libloading::os::unix::{Library, Symbol, RTLD_LOCAL, RTLD_NOW};
use tcg_core::artifact::metadata::{ConstantRow, ConstantSource};
use tcg_core::{Code, Error, Result};

use crate::extract::{extract, Extracted};
use crate::inputs::{input_facts, InputFact};
use crate::torch::{BorrowedTensor, Dtype, OwnedTensor, TensorHandle, Torch};
use crate::weights::Mapped;

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
type LastError = unsafe extern "C" fn(*mut *const c_char) -> i32;

#[derive(Clone, Copy)]
struct Api {
    delete: Delete,
    update_pairs: UpdatePairs,
    run: Run,
    last_error: LastError,
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

/// One input of a call: a C-contiguous CPU buffer.
#[derive(Debug, Clone)]
pub struct Input {
    /// The address of the first element.
    pub data: usize,
    /// The buffer's length in bytes.
    pub nbytes: usize,
    /// Inductor's dtype name.
    pub dtype: String,
    /// The shape.
    pub shape: Vec<i64>,
}

/// A resolved graph loaded through the wrapper's C ABI.
pub struct Graph {
    torch: Arc<Torch>,
    api: Api,
    container: Container,
    constants: Vec<ContainerConstant>,
    rows: BTreeMap<String, ConstantRow>,
    num_inputs: usize,
    num_outputs: usize,
    call_spec: (String, String),
    input_facts: Option<Vec<InputFact>>,
    // Runs share the lock; binding takes it alone (the container does not
    // guard its active constant buffer against a concurrent update).
    lock: RwLock<()>,
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
    /// Load entry `entry` of the package at `package` with libtorch `torch`,
    /// and check the container's constants against `rows` (the metadata's
    /// constant table) before anything is bound.
    pub fn load(
        torch: Arc<Torch>,
        package: &Path,
        entry: &str,
        device: &str,
        rows: Vec<ConstantRow>,
    ) -> Result<Graph> {
        if device != "cpu" {
            return Err(Error::new(
                Code::RunNativeUnsupported,
                format!("the native load path runs CPU graphs only, not {device:?}"),
            ));
        }
        let extracted = extract(package, entry)?;
        // SAFETY: the .so comes from the package of a verified, admitted
        // artifact (resolve checked its ELF machine and this host's ISA); its
        // initialisers only register the kernels it carries.
        let library =
            unsafe { Library::open(Some(extracted.shared_object()), RTLD_NOW | RTLD_LOCAL) }
                .map_err(|e| invalid(format!("cannot load the graph's .so: {e}")))?;
        let create: CreateWithDevice = get(&library, "AOTInductorModelContainerCreateWithDevice")?;
        let api = Api {
            delete: get(&library, "AOTInductorModelContainerDelete")?,
            update_pairs: get(
                &library,
                "AOTInductorModelContainerUpdateConstantBufferPairs",
            )?,
            run: get(&library, "AOTInductorModelContainerRun")?,
            last_error: get(&library, "AOTInductorGetLastError")?,
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

        let device_c = CString::new(device).map_err(|_| invalid("device has a NUL".into()))?;
        let mut container: Container = std::ptr::null_mut();
        // SAFETY: one model; `device_c` is a NUL-terminated string that outlives
        // the call; a null cubin directory is what a CPU graph takes.
        let rc = unsafe { create(&mut container, 1, device_c.as_ptr(), std::ptr::null()) };
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
            constants: Vec::new(),
            rows: BTreeMap::new(),
            num_inputs: 0,
            num_outputs: 0,
            call_spec: (String::new(), String::new()),
            input_facts: None,
            lock: RwLock::new(()),
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
    /// The container's constants in index order.
    pub fn constants(&self) -> &[ContainerConstant] {
        &self.constants
    }

    /// Bind the weights at `weights` (and the literal payload at `literals`
    /// when the graph has literal rows). Every constant is checked (presence,
    /// no extras, dtype, shape) before anything reaches the container; the
    /// folded constants are recomputed from these values on the next run.
    pub fn bind(&self, weights: &Path, literals: Option<&Path>) -> Result<()> {
        let weights = Mapped::open(weights, Code::RunWeightsInvalid)?;
        let weight_entries = weights.tensors(Code::RunWeightsInvalid)?;
        let wanted: Vec<&str> = self.weight_fqns();
        let missing: Vec<&&str> = wanted
            .iter()
            .filter(|f| !weight_entries.contains_key(**f))
            .collect();
        if !missing.is_empty() {
            return Err(Error::new(
                Code::RunConstantMissing,
                format!(
                    "{} lacks constants the graph needs: {missing:?}",
                    weights.path().display()
                ),
            ));
        }
        let wanted_set: BTreeSet<&str> = wanted.iter().copied().collect();
        let extra: Vec<&String> = weight_entries
            .keys()
            .filter(|k| !wanted_set.contains(k.as_str()))
            .collect();
        if !extra.is_empty() {
            return Err(Error::new(
                Code::RunConstantUnexpected,
                format!(
                    "{} holds names the graph has no constant for: {extra:?}",
                    weights.path().display()
                ),
            ));
        }
        let literal_file = if self.has_literals() {
            let path = literals.ok_or_else(|| {
                Error::new(
                    Code::RunLiteralPayload,
                    "the graph has literal constants but no literal payload was given",
                )
            })?;
            Some(Mapped::open(path, Code::RunLiteralPayload)?)
        } else {
            None
        };
        let literal_entries = match &literal_file {
            Some(m) => m.tensors(Code::RunLiteralPayload)?,
            None => BTreeMap::new(),
        };
        let literal_rows: BTreeSet<&str> = self
            .rows
            .values()
            .filter(|r| r.source == ConstantSource::Literal)
            .map(|r| r.fqn.as_str())
            .collect();
        let literal_names: BTreeSet<&str> = literal_entries.keys().map(String::as_str).collect();
        if literal_names != literal_rows {
            return Err(Error::new(
                Code::RunLiteralPayload,
                format!(
                    "literal payload holds {literal_names:?}, the graph declares {literal_rows:?}"
                ),
            ));
        }

        // Check every constant, then describe each as a tensor over its read bytes.
        let mut tensors: Vec<(&ContainerConstant, BorrowedTensor)> = Vec::new();
        for c in self.constants.iter().filter(|c| !c.from_folded) {
            let row = &self.rows[&c.fqn];
            let (file, entry) = match row.source {
                ConstantSource::Literal => (
                    literal_file.as_ref().expect("checked above"),
                    &literal_entries[&c.fqn],
                ),
                _ => (&weights, &weight_entries[&c.fqn]),
            };
            let shape: Vec<u64> = entry.shape.iter().map(|&d| d as u64).collect();
            if entry.dtype != row.dtype || shape != row.shape {
                return Err(Error::new(
                    Code::RunConstantMismatch,
                    format!(
                        "constant {:?} is {}{:?}, the graph was compiled for {}{:?}",
                        c.fqn, entry.dtype, entry.shape, row.dtype, row.shape
                    ),
                ));
            }
            let bytes = file.bytes(entry);
            let shape: Vec<i64> = entry.shape.iter().map(|&d| d as i64).collect();
            // SAFETY: `bytes` holds exactly product(shape) * element size bytes
            // (checked when the file was parsed; the dtype matches the row,
            // whose dtype matches the container's). The buffer outlives every
            // handle: the handles drop at the end of this function, after the
            // container copied the bytes. libtorch only reads through it.
            let t = unsafe {
                BorrowedTensor::new(&self.torch, bytes.as_ptr() as *mut c_void, &shape, c.dtype)?
            };
            tensors.push((c, t));
        }
        let pairs: Vec<ConstantMapEntry> = tensors
            .iter()
            .map(|(c, t)| ConstantMapEntry {
                name: c.name.as_ptr(),
                handle: t.handle(),
            })
            .collect();
        let _exclusive = self.lock.write().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `pairs` is an array of `pairs.len()` entries whose names and
        // handles live until after the call; the container copies the data
        // (not user-managed) and leaves the handles with us; the write lock
        // keeps runs out while the active buffer changes.
        let rc = unsafe {
            (self.api.update_pairs)(self.container, pairs.as_ptr(), pairs.len(), false, true)
        };
        if rc != 0 {
            return Err(invalid(format!(
                "the container refused the constants: {}",
                last_error(self.api.last_error)
            )));
        }
        Ok(())
    }

    /// Run the graph on `inputs` and return its outputs, which the caller owns.
    ///
    /// # Safety
    /// Each input's `data` must address `nbytes` readable bytes that stay
    /// valid and unchanged until this call returns.
    pub unsafe fn run(&self, inputs: &[Input]) -> Result<Vec<OwnedTensor>> {
        if inputs.len() != self.num_inputs {
            return Err(Error::new(
                Code::RunCallInvalid,
                format!(
                    "the graph takes {} tensor inputs, got {}",
                    self.num_inputs,
                    inputs.len()
                ),
            ));
        }
        let mismatch = |m: String| Error::new(Code::RunInputMismatch, m);
        let mut handles = Vec::with_capacity(inputs.len());
        for (i, input) in inputs.iter().enumerate() {
            let dtype = self.torch.dtype_by_name(&input.dtype).ok_or_else(|| {
                mismatch(format!(
                    "input {i} has dtype {:?}, which the native path does not pass",
                    input.dtype
                ))
            })?;
            if input.shape.len() > 64 || input.shape.iter().any(|&d| d < 0) {
                return Err(mismatch(format!(
                    "input {i} has an invalid shape {:?}",
                    input.shape
                )));
            }
            let need = input
                .shape
                .iter()
                .try_fold(dtype.size, |n, &d| n.checked_mul(d as usize))
                .ok_or_else(|| mismatch(format!("input {i} is too large")))?;
            if need != input.nbytes {
                return Err(Error::new(
                    Code::RunInputLayout,
                    format!(
                        "input {i} is a buffer of {} bytes, its shape needs {need}",
                        input.nbytes
                    ),
                ));
            }
            if input.data == 0 && input.nbytes > 0 {
                return Err(Error::new(
                    Code::RunInputLayout,
                    format!(
                        "input {i} has a null data pointer for {} bytes",
                        input.nbytes
                    ),
                ));
            }
            if let Some(facts) = &self.input_facts {
                check_fact(i, input, &facts[i])?;
            }
            // SAFETY: the caller guarantees `data` addresses `nbytes` readable
            // bytes for the duration of this call, and `nbytes` equals what the
            // shape and dtype need.
            handles.push(unsafe {
                BorrowedTensor::new(&self.torch, input.data as *mut c_void, &input.shape, dtype)?
            });
        }
        let mut raw: Vec<TensorHandle> =
            handles.into_iter().map(BorrowedTensor::into_raw).collect();
        let mut outputs: Vec<TensorHandle> = vec![std::ptr::null_mut(); self.num_outputs];
        let _shared = self.lock.read().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `raw` holds `num_inputs` live handles, which Run steals (the
        // count was checked above, so the container's own count check cannot
        // fail before it takes them); `outputs` has room for `num_outputs`
        // handles that Run writes and we then own. Null stream and proxy
        // executor are what a CPU graph takes.
        let rc = unsafe {
            (self.api.run)(
                self.container,
                raw.as_mut_ptr(),
                raw.len(),
                outputs.as_mut_ptr(),
                outputs.len(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        let mut owned = Vec::with_capacity(outputs.len());
        let mut failure = None;
        for h in outputs {
            if h.is_null() {
                continue;
            }
            // SAFETY: Run handed this handle to us; it is owned exactly once here.
            match unsafe { OwnedTensor::from_raw(Arc::clone(&self.torch), h) } {
                Ok(t) => owned.push(t),
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        if rc != 0 {
            return Err(Error::new(
                Code::RunExecutionFailed,
                format!("the graph failed: {}", last_error(self.api.last_error)),
            ));
        }
        if let Some(e) = failure {
            return Err(e);
        }
        if owned.len() != self.num_outputs {
            return Err(Error::new(
                Code::RunExecutionFailed,
                format!(
                    "the graph returned {} of its {} outputs",
                    owned.len(),
                    self.num_outputs
                ),
            ));
        }
        Ok(owned)
    }
}

fn check_fact(i: usize, input: &Input, fact: &InputFact) -> Result<()> {
    use crate::inputs::Dim;
    let mismatch = |m: String| Error::new(Code::RunInputMismatch, format!("input {i}: {m}"));
    if input.dtype != fact.dtype {
        return Err(mismatch(format!(
            "dtype is {}, the graph was compiled for {}",
            input.dtype, fact.dtype
        )));
    }
    if input.shape.len() != fact.dims.len() {
        return Err(mismatch(format!(
            "rank is {}, the graph was compiled for rank {}",
            input.shape.len(),
            fact.dims.len()
        )));
    }
    for (k, (&size, dim)) in input.shape.iter().zip(&fact.dims).enumerate() {
        // Only static sizes are checked here: a symbolic size's bounds in the
        // wrapper come from inductor's shape environment, whose lower bound can
        // be stricter than the exported range (it assumes sizes 0 and 1 are
        // specialised away). The caller checks bounds against the call
        // ingress when the artifact has one, else against these.
        if matches!(*dim, Dim::Static(v) if v != size) {
            return Err(mismatch(format!(
                "dimension {k} is {size}, the graph accepts {dim:?}"
            )));
        }
    }
    Ok(())
}

fn last_error(f: LastError) -> String {
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
        // SAFETY: the container was created by this value and is deleted once,
        // before the library that implements it is closed (field order).
        unsafe { (self.api.delete)(self.container) };
    }
}
