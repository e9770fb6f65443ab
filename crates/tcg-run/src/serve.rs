//! Serving a stored graph from Rust, with no Python at all: resolve a key from
//! a store (verified and admitted by `tcg-core`), check the torch installation
//! against the artifact's toolchain, load the graph on the CPU or a GPU, bind
//! its weights, and run calls whose inputs are checked against the artifact's
//! call ingress first. What `StoredCompiledGraph.load_native` does in Python,
//! for a Rust server to embed (see `examples/serve.rs` and docs/run.md).
//!
//! Calls take the graph's tensor inputs flat, in the order of the exported
//! program's inputs, and return its outputs flat, in its output order (the
//! Python layer's `(args, kwargs)` tree convention is not interpreted here).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use sha2::{Digest, Sha256};
use tcg_core::artifact::metadata::ConstantSource;
use tcg_core::engine::{Engine, Resolved};
use tcg_core::{Code, Error, Result};

use crate::capture::CaptureOptions;
use crate::cuda::Device;
use crate::graph::{BindReport, Graph, Input, LoadRequest, WeightsSource};
use crate::inputs::Dim;
use crate::runtime::{choose_for_package, OptionSource, Runtime, RuntimeChoice, RuntimeOption};
use crate::torch::{OwnedTensor, Torch};
use crate::weights::{Checkpoint, Naming};
use crate::weights_set::WeightsSet;

/// The reason of a graph bound to a weights set: sets are opened on libtorch.
pub const SET_ON_LIBTORCH: &str = "bound to a weights set (weights sets run on libtorch)";

/// One dimension the call ingress states.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Size {
    Static(i64),
    Symbol(String),
}

/// The per-input facts a call is checked against, in input order.
#[derive(Debug, Clone)]
struct Fact {
    dtype: String,
    dims: Vec<Size>,
}

/// A symbol's inclusive range, by name.
type Symbols = BTreeMap<String, (i64, i64)>;
/// Per input and dimension, the wrapper's bounds of a symbolic size.
type Ranges = Vec<Vec<Option<(Option<i64>, Option<i64>)>>>;

/// A resolved graph, loaded with its weights bound, ready to serve calls.
pub struct Served {
    graph: Graph,
    resolved: Resolved,
    facts: Vec<Fact>,
    symbols: Symbols,
    ranges: Ranges,
    torch_check: &'static str,
    bind_report: RwLock<BindReport>,
}

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Served")
            .field("key", &self.resolved.key)
            .field("device", &self.graph.device())
            .finish()
    }
}

fn unsupported(message: String) -> Error {
    Error::new(Code::RunNativeUnsupported, message)
}

/// The toolchain digest of the torch distribution owning `torch_lib`: the
/// first 16 hex of SHA-256 of its `RECORD` (the formula of
/// `toolchain.record_digest`); `None` when no single `torch-*.dist-info` sits
/// beside the package.
pub fn torch_record_digest(torch_lib: &Path) -> Option<String> {
    let lib = std::fs::canonicalize(torch_lib).ok()?;
    let site = lib.parent()?.parent()?;
    let infos: Vec<PathBuf> = std::fs::read_dir(site)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with("torch-")
                    && n.ends_with(".dist-info")
                    && n.as_bytes().get(6).is_some_and(u8::is_ascii_digit)
            })
        })
        .collect();
    let [info] = infos.as_slice() else {
        return None;
    };
    let record = std::fs::read_to_string(info.join("RECORD")).ok()?;
    let digest = Sha256::digest(record.as_bytes());
    Some(digest.iter().take(8).map(|b| format!("{b:02x}")).collect())
}

/// Refuse a torch other than the one that compiled the artifact; say what was
/// checked (`"record digest"`, or `"not recorded"` when the artifact states no
/// digest this project computes).
pub fn check_torch(resolved: &Resolved, torch_lib: &Path) -> Result<&'static str> {
    let Some(recorded) = resolved.metadata.toolchain().get("torch") else {
        return Ok("not recorded");
    };
    let is_digest = recorded.len() == 16
        && recorded
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if !is_digest {
        return Ok("not recorded");
    }
    match torch_record_digest(torch_lib) {
        Some(found) if &found == recorded => Ok("record digest"),
        Some(found) => Err(Error::new(
            Code::RunTorchMismatch,
            format!(
                "the artifact was compiled with torch {recorded}; the torch at {} is {found}",
                torch_lib.display()
            ),
        )),
        None => Err(Error::new(
            Code::RunTorchMismatch,
            format!(
                "the artifact was compiled with torch {recorded}, and the torch at {} has no distribution RECORD to compare",
                torch_lib.display()
            ),
        )),
    }
}

/// The call ingress's rows (SPEC-v1 §3.9), validated when the artifact was
/// resolved: per input its dtype and sizes, and the symbols' ranges.
fn ingress(resolved: &Resolved) -> Option<(Vec<Fact>, Symbols)> {
    let value = resolved.metadata.value();
    let ingress = value
        .get("graph_class")?
        .as_object()?
        .get("graph")?
        .as_object()?
        .get("pytree")?
        .as_object()?
        .get("ingress")?
        .as_object()?;
    let mut rows: Vec<(i64, Fact)> = Vec::new();
    for row in ingress.get("inputs")?.as_array()? {
        let row = row.as_object()?;
        let dims = row
            .get("shape")?
            .as_array()?
            .iter()
            .map(|d| match (d.as_i64(), d.as_str()) {
                (Some(v), _) => Some(Size::Static(v)),
                (None, Some(s)) => Some(Size::Symbol(s.to_owned())),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()?;
        rows.push((
            row.get("position")?.as_i64()?,
            Fact {
                dtype: row.get("dtype")?.as_str()?.to_owned(),
                dims,
            },
        ));
    }
    rows.sort_by_key(|(p, _)| *p);
    let mut symbols = BTreeMap::new();
    for (name, range) in ingress.get("symbols")?.as_object()? {
        let range = range.as_array()?;
        symbols.insert(
            name.clone(),
            (range.first()?.as_i64()?, range.get(1)?.as_i64()?),
        );
    }
    Some((rows.into_iter().map(|(_, f)| f).collect(), symbols))
}

impl Served {
    /// Resolve `key` from the store at `store` into `destination` and load it
    /// on `device` (`cpu`, `cuda:N`) with libtorch from `torch_lib`, binding
    /// the safetensors file `weights`. `None` on a clean miss; every refusal
    /// of resolve (quarantine, admission) and of loading is an error.
    pub fn open(
        store: &Path,
        key: &str,
        destination: &Path,
        torch_lib: &Path,
        device: &str,
        weights: &Path,
    ) -> Result<Option<Served>> {
        let engine = Engine::open(store)?;
        let Some(resolved) = engine.resolve(key, destination)? else {
            return Ok(None);
        };
        Served::load(resolved, torch_lib, device, weights).map(Some)
    }

    /// Load an artifact already resolved (see [`Served::open`]).
    pub fn load(
        resolved: Resolved,
        torch_lib: &Path,
        device: &str,
        weights: &Path,
    ) -> Result<Served> {
        Served::load_with(
            resolved,
            torch_lib,
            device,
            &[weights.to_owned()],
            &Naming::default(),
        )
    }

    /// [`Served::load`] from one or more weights paths (safetensors files,
    /// sharded checkpoints by their index, directories holding either), their
    /// names mapped by `naming`; bound by the artifact's weights contract
    /// (aliases bind, declared names the compiler dropped are ignored).
    ///
    /// A CUDA graph's calls are replayed as CUDA graphs ([`crate::capture`])
    /// as the environment says ([`CaptureOptions::from_env`]: on, 8 shape
    /// sets), where this process uses libtorch's stream-ordered allocator:
    /// call [`crate::capture::prepare_allocator`] before the process starts
    /// its threads (the serve example does), or set
    /// `PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`; otherwise calls run
    /// uncaptured and `graph().captures_reason()` says why.
    /// `graph().set_captures(..)` changes it later.
    ///
    /// The runtime is chosen from the artifact as
    /// [`Served::load_with_runtime`] chooses it for `None` (the environment's
    /// [`crate::runtime::RUNTIME_ENV`], else `auto`).
    pub fn load_with(
        resolved: Resolved,
        torch_lib: &Path,
        device: &str,
        weights: &[PathBuf],
        naming: &Naming,
    ) -> Result<Served> {
        Served::load_with_runtime(resolved, torch_lib, device, weights, naming, None)
    }

    /// [`Served::load_with`] on the runtime `runtime` asks for (`auto`,
    /// `libtorch`, `shim`; `None`: [`crate::runtime::RUNTIME_ENV`], else
    /// `auto`): `auto` runs a CPU graph whose `.so` imports only functions of
    /// shim set v1 on `libtcg_shim.so`, without libtorch (`torch_lib` is then
    /// not opened), unless libtorch is already loaded in this process; every
    /// other graph on libtorch. `graph().runtime()` and
    /// `graph().runtime_reason()` say which and why; `shim` on a graph the
    /// shim cannot run is `run.native_unsupported`, naming the functions.
    pub fn load_with_runtime(
        resolved: Resolved,
        torch_lib: &Path,
        device: &str,
        weights: &[PathBuf],
        naming: &Naming,
        runtime: Option<RuntimeOption>,
    ) -> Result<Served> {
        let (option, source) = match runtime {
            Some(option) => (option, OptionSource::Option),
            None => RuntimeOption::resolve(None)?,
        };
        let package = resolved
            .destination
            .join(tcg_core::artifact::PACKAGE_MEMBER);
        let choice =
            choose_for_package(&package, resolved.metadata.name(), device, option, source)?;
        let checkpoint = Checkpoint::open(weights, naming)?;
        Served::load_from(
            resolved,
            torch_lib,
            device,
            WeightsSource::Files(&checkpoint),
            choice,
        )
    }

    /// [`Served::load`] bound to a weights set (on the set's device, with the
    /// set's libtorch): the graph's table checked against the set by the
    /// artifact's weights contract and bound without a copy; only the
    /// artifact's literals are read for this graph (docs/run.md, "Weights
    /// once"). CUDA-graph replay as for [`Served::load_with`]: a rebind to
    /// files or another set bumps the binding generation, and captures of
    /// the previous one are not replayed.
    pub fn load_with_set(resolved: Resolved, set: &Arc<WeightsSet>) -> Result<Served> {
        let torch_lib = set.torch().dir().to_owned();
        let device = set.device().to_string();
        Served::load_from(
            resolved,
            &torch_lib,
            &device,
            WeightsSource::Set(Arc::clone(set)),
            RuntimeChoice::libtorch(SET_ON_LIBTORCH),
        )
    }

    fn load_from(
        resolved: Resolved,
        torch_lib: &Path,
        device: &str,
        weights: WeightsSource<'_>,
        runtime: RuntimeChoice,
    ) -> Result<Served> {
        let torch_check = match runtime.runtime {
            Runtime::Libtorch => check_torch(&resolved, torch_lib)?,
            // No torch is opened: the package's imports were checked
            // against the shim's set instead.
            Runtime::ShimV1 => "not needed (shim runtime)",
        };
        let package = resolved
            .destination
            .join(tcg_core::artifact::PACKAGE_MEMBER);
        let contract = tcg_core::artifact::package::weights_contract(&package, &resolved.metadata)?;
        let rows = resolved.metadata.constants().to_vec();
        let literals = resolved
            .destination
            .join(tcg_core::artifact::LITERALS_MEMBER);
        let has_literals = rows.iter().any(|r| r.source == ConstantSource::Literal);
        let captures = CaptureOptions::from_env()?;
        // Loaded and bound in one overlapped step (see `Graph::load_request`).
        let (graph, bind_report) = Graph::load_request(LoadRequest {
            torch_lib,
            package: &package,
            entry: resolved.metadata.name(),
            device,
            sm: resolved.metadata.sm(),
            rows,
            contract,
            weights,
            literals: has_literals.then_some(literals.as_path()),
            runtime,
        })?;
        if graph.device().is_cuda() {
            graph.set_captures(captures);
        }
        let (facts, symbols, ranges) = match ingress(&resolved) {
            Some((facts, symbols)) => {
                if facts.len() != graph.num_inputs() {
                    return Err(Error::new(
                        Code::RunPackageInvalid,
                        format!(
                            "the call ingress lists {} inputs, the graph takes {}",
                            facts.len(),
                            graph.num_inputs()
                        ),
                    ));
                }
                (facts, symbols, Vec::new())
            }
            None => {
                let wrapper = graph.input_facts().ok_or_else(|| {
                    unsupported(
                        "the artifact records no call ingress and its wrapper states no input checks, so inputs cannot be checked before a call".into(),
                    )
                })?;
                let facts = wrapper
                    .iter()
                    .map(|f| Fact {
                        dtype: f.dtype.clone(),
                        dims: f
                            .dims
                            .iter()
                            .map(|d| match d {
                                Dim::Static(v) => Size::Static(*v),
                                Dim::Range(..) => Size::Symbol(String::new()),
                            })
                            .collect(),
                    })
                    .collect();
                let ranges = wrapper
                    .iter()
                    .map(|f| {
                        f.dims
                            .iter()
                            .map(|d| match d {
                                Dim::Range(lo, hi) => Some((*lo, *hi)),
                                Dim::Static(_) => None,
                            })
                            .collect()
                    })
                    .collect();
                (facts, BTreeMap::new(), ranges)
            }
        };
        Ok(Served {
            bind_report: RwLock::new(bind_report),
            graph,
            resolved,
            facts,
            symbols,
            ranges,
            torch_check,
        })
    }

    /// The resolved artifact (key, directory, metadata).
    pub fn resolved(&self) -> &Resolved {
        &self.resolved
    }
    /// The loaded graph.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }
    /// How the torch installation was matched to the artifact's.
    pub fn torch_check(&self) -> &'static str {
        self.torch_check
    }
    /// The libtorch in use (for [`OwnedTensor`] and CUDA helpers).
    pub fn torch(&self) -> &Arc<Torch> {
        self.graph.torch()
    }

    /// Bind a new weights file, with the checks of loading; a refused rebind
    /// leaves the bound weights in place.
    pub fn rebind(&self, weights: &Path) -> Result<BindReport> {
        self.rebind_with(&[weights.to_owned()], &Naming::default())
    }

    /// [`Served::rebind`] from the weights paths of [`Served::load_with`].
    pub fn rebind_with(&self, weights: &[PathBuf], naming: &Naming) -> Result<BindReport> {
        let literals = self
            .resolved
            .destination
            .join(tcg_core::artifact::LITERALS_MEMBER);
        let checkpoint = Checkpoint::open(weights, naming)?;
        let report = self.graph.bind_checkpoint(
            &checkpoint,
            self.graph.has_literals().then_some(literals.as_path()),
        )?;
        *self.bind_report.write().unwrap_or_else(|p| p.into_inner()) = report.clone();
        Ok(report)
    }

    /// Bind the graph to a weights set instead (on the graph's device), with
    /// the checks of loading; a refused rebind leaves the bound weights in
    /// place.
    pub fn rebind_set(&self, set: &Arc<WeightsSet>) -> Result<BindReport> {
        let literals = self
            .resolved
            .destination
            .join(tcg_core::artifact::LITERALS_MEMBER);
        let report = self
            .graph
            .bind_set(set, self.graph.has_literals().then_some(literals.as_path()))?;
        *self.bind_report.write().unwrap_or_else(|p| p.into_inner()) = report.clone();
        Ok(report)
    }

    /// How long loading took, phase by phase, in seconds (docs/run.md, "The
    /// weights pipeline and the phases of a load"): `open_libraries`,
    /// `extract_package`, `open_model`, `create_container`, `plan_weights`,
    /// `allocate_weights`, `read_weights`, `copy_weights`, `bind_weights`,
    /// `load_total`, and on a GPU `cuda_init`, `cuda_context`, `cuda_runtime`,
    /// `staging_ring` and `prime_blas` (when the graph calls cuBLAS). Extraction and staging run beside opening the
    /// libraries, so the phases overlap; `load_total` is the wall time.
    pub fn timings(&self) -> &crate::pipeline::Timings {
        self.graph.load_timings()
    }

    /// What the last bind ignored (declared names the compiler dropped).
    pub fn bind_report(&self) -> BindReport {
        self.bind_report
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Check `inputs` against the call ingress (dtype, rank, static sizes,
    /// symbol ranges, the same symbol equal everywhere) without running.
    pub fn check(&self, inputs: &[Input]) -> Result<()> {
        if inputs.len() != self.facts.len() {
            return Err(Error::new(
                Code::RunCallInvalid,
                format!(
                    "the graph takes {} tensor inputs, got {}",
                    self.facts.len(),
                    inputs.len()
                ),
            ));
        }
        let bad = |m: String| Error::new(Code::RunInputMismatch, m);
        let mut bound: BTreeMap<&str, i64> = BTreeMap::new();
        for (i, (input, fact)) in inputs.iter().zip(&self.facts).enumerate() {
            if input.dtype != fact.dtype {
                return Err(bad(format!(
                    "input {i} is {}, the graph was compiled for {}",
                    input.dtype, fact.dtype
                )));
            }
            if input.shape.len() != fact.dims.len() {
                return Err(bad(format!(
                    "input {i} has rank {}, the graph was compiled for {}",
                    input.shape.len(),
                    fact.dims.len()
                )));
            }
            for (k, (&size, dim)) in input.shape.iter().zip(&fact.dims).enumerate() {
                match dim {
                    Size::Static(v) if *v != size => {
                        return Err(bad(format!(
                            "input {i} has size {size} at dimension {k}, the graph needs {v}"
                        )))
                    }
                    Size::Static(_) => {}
                    Size::Symbol(name) if name.is_empty() => {
                        let range = self.ranges.get(i).and_then(|r| r.get(k)).copied().flatten();
                        if let Some((lo, hi)) = range {
                            if lo.is_some_and(|lo| size < lo) || hi.is_some_and(|hi| size > hi) {
                                return Err(bad(format!(
                                    "input {i} has size {size} at dimension {k}, outside [{lo:?}, {hi:?}]"
                                )));
                            }
                        }
                    }
                    Size::Symbol(name) => {
                        let (lo, hi) = self.symbols.get(name).copied().ok_or_else(|| {
                            Error::new(
                                Code::RunPackageInvalid,
                                format!("the call ingress names symbol {name} without a range"),
                            )
                        })?;
                        if size < lo || size > hi {
                            return Err(bad(format!(
                                "input {i} has size {size} at dimension {k}; {name} must be in [{lo}, {hi}]"
                            )));
                        }
                        if *bound.entry(name).or_insert(size) != size {
                            return Err(bad(format!(
                                "input {i} has size {size} at dimension {k}, but {name} is {} elsewhere",
                                bound[name.as_str()]
                            )));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Check `inputs` ([`Served::check`]) and run the graph with its work
    /// queued on `stream` (0: the default stream; always 0 on CPU).
    ///
    /// # Safety
    /// As [`Graph::run_on`]: each input's memory stays valid and unchanged
    /// until the work queued on `stream` is done.
    pub unsafe fn run(&self, inputs: &[Input], stream: usize) -> Result<Vec<OwnedTensor>> {
        // SAFETY: the caller's contract is this function's.
        unsafe { self.run_with(inputs, stream, crate::capture::Outputs::Copy) }
    }

    /// [`Served::run`], with what a replayed call hands back
    /// ([`Graph::run_on_with`]): `Outputs::Static` returns the capture's output
    /// buffers without a copy, valid until this graph's next call.
    ///
    /// # Safety
    /// As [`Served::run`].
    pub unsafe fn run_with(
        &self,
        inputs: &[Input],
        stream: usize,
        outputs: crate::capture::Outputs,
    ) -> Result<Vec<OwnedTensor>> {
        self.check(inputs)?;
        // SAFETY: the caller's contract is this function's.
        unsafe { self.graph.run_on_with(inputs, stream, outputs) }
    }

    /// Run on host buffers `(bytes, dtype, shape)`, which are copied to the
    /// graph's device when it is a GPU; a safe call for servers that receive
    /// their inputs as bytes.
    pub fn run_host(&self, inputs: &[(&[u8], &str, &[i64])]) -> Result<Vec<OwnedTensor>> {
        let described: Vec<Input> = inputs
            .iter()
            .map(|(bytes, dtype, shape)| Input {
                data: bytes.as_ptr() as usize,
                nbytes: bytes.len(),
                dtype: (*dtype).to_owned(),
                shape: shape.to_vec(),
                device: Device::Cpu,
            })
            .collect();
        // SAFETY: the slices are borrowed for the whole call; on a CPU graph
        // the call returns after running, and on a GPU each host buffer is
        // copied to the device (a blocking copy) before the call returns.
        unsafe { self.run(&described, 0) }
    }
}
