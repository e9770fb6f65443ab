//! One copy of a checkpoint's weights on a device, shared by every graph
//! bound to it (docs/run.md, "Weights once").
//!
//! [`WeightsSet::open`] reads every tensor of a checkpoint once, through the
//! weights pipeline ([`crate::pipeline::Plan::every_tensor`]: the same header,
//! capacity and regular-file checks, threaded reads, on a GPU a pinned ring
//! and a copy stream) into one allocation. A graph bound to the set
//! ([`crate::graph::WeightsSource::Set`], [`crate::Graph::bind_set`]) checks the
//! names its table needs by its own weights contract, exactly as a bind from
//! files does, and hands the container user-managed handles over the set's
//! memory: no copy. Each graph holds an `Arc` of the set, so graphs and set
//! drop in any order; calls of a graph bound to a set hold the set's shared
//! lock while they queue their work, and an update of the set's values (a
//! LoRA fused in place) takes it alone ([`WeightsSet::exclusive`]).
//!
//! A LoRA is fused into the set in place ([`WeightsSet::apply_lora`],
//! [`WeightsSet::replace_lora`], [`WeightsSet::remove_lora`]; the work is
//! [`crate::lora_fuse`]), so into every graph bound to it without recompiling;
//! each update bumps [`WeightsSet::values_generation`], and a graph whose
//! container folds constants from the set's values folds them again before
//! its next run.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use tcg_core::artifact::metadata::{ConstantRow, ConstantSource};
use tcg_core::artifact::weights::WeightsContract;
use tcg_core::{Code, Error, Result};

use crate::cuda::Device;
use crate::lora_fuse::{prepare, FuseWeights, LoraInfo, LoraState};
use crate::pipeline::{reader_threads, row_mismatch, Memory, Plan, Readers, Timings};
use crate::torch::{Dtype, Torch};
use crate::weights::{Checkpoint, COMPARE_CHUNK};

/// One tensor of a set.
#[derive(Debug, Clone)]
struct SetEntry {
    offset: usize,
    dtype: Dtype,
    shape: Vec<i64>,
    nbytes: usize,
}

/// Every tensor of a checkpoint, read once into one allocation on a device.
pub struct WeightsSet {
    torch: Arc<Torch>,
    device: Device,
    memory: Memory,
    entries: BTreeMap<String, SetEntry>,
    nbytes: u64,
    outside_prefix: usize,
    timings: Timings,
    // Runs share it; updates of the set's values take it alone.
    lock: RwLock<()>,
    // The fused LoRA and the base values it replaced (taken under `lock`
    // held exclusive, or alone for reading its description).
    lora: Mutex<LoraState>,
    // Bumped by every update of the values (a LoRA fused, swapped, removed).
    generation: AtomicU64,
}

impl std::fmt::Debug for WeightsSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightsSet")
            .field("device", &self.device)
            .field("tensors", &self.entries.len())
            .field("nbytes", &self.nbytes)
            .finish_non_exhaustive()
    }
}

impl WeightsSet {
    /// Read every tensor of `checkpoint` (named as its [`crate::weights::Naming`]
    /// maps them) once onto `device` (`cpu`, `cuda:N`) with libtorch from
    /// `torch_lib` (the dtypes are libtorch's). Weights larger than the
    /// device's free memory are `run.weights_too_large` before anything is
    /// read; a dtype libtorch cannot bind is `run.native_unsupported`.
    pub fn open(
        torch_lib: &Path,
        device: &str,
        checkpoint: &Checkpoint,
    ) -> Result<Arc<WeightsSet>> {
        let started = Instant::now();
        let device = Device::parse(device)?;
        let readers = Readers::spawn(reader_threads())?;
        let t = Instant::now();
        let torch = Torch::open(torch_lib)?;
        if device.is_cuda() {
            torch.cuda()?;
        }
        let opened = t.elapsed().as_secs_f64();
        let mut plan = Plan::every_tensor(checkpoint)?;
        let mut entries = BTreeMap::new();
        for (name, placed) in plan.placed() {
            let dtype = torch.dtype_by_name(&placed.dtype).ok_or_else(|| {
                Error::new(
                    Code::RunNativeUnsupported,
                    format!(
                        "tensor {name:?} has dtype {:?}, which the native path does not bind",
                        placed.dtype
                    ),
                )
            })?;
            let nbytes = placed
                .shape
                .iter()
                .try_fold(dtype.size, |n, &d| n.checked_mul(d as usize))
                .ok_or_else(|| {
                    Error::new(
                        Code::RunWeightsInvalid,
                        format!("tensor {name:?} is too large"),
                    )
                })?;
            entries.insert(
                name.clone(),
                SetEntry {
                    offset: placed.offset,
                    dtype,
                    shape: placed.shape.clone(),
                    nbytes,
                },
            );
        }
        // Not `sm`-checked: each graph checks its device's capability itself.
        let into = plan.allocate(device, "")?;
        plan.read(&into, &readers)?;
        let staged = plan.hand_over(into);
        let mut timings = vec![("open_libraries", opened)];
        timings.extend(staged.timings);
        timings.push(("set_total", started.elapsed().as_secs_f64()));
        Ok(Arc::new(WeightsSet {
            torch,
            device,
            memory: staged.memory,
            entries,
            nbytes: staged.bytes,
            outside_prefix: staged.outside_prefix,
            timings,
            lock: RwLock::new(()),
            lora: Mutex::new(LoraState::default()),
            generation: AtomicU64::new(0),
        }))
    }

    /// The bytes of tensor data the set holds (without alignment padding),
    /// plus the base copies kept for a fused LoRA.
    pub fn nbytes(&self) -> u64 {
        self.nbytes + self.lora_state().base_nbytes() as u64
    }

    fn lora_state(&self) -> std::sync::MutexGuard<'_, LoraState> {
        self.lora.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fuse the LoRA at `path` (a diffusers/PEFT safetensors file, or a
    /// directory holding `pytorch_lora_weights.safetensors` or
    /// `adapter_model.safetensors`) into the set's values in place:
    /// `W <- base + scale_m · B @ A` per adapted module, in float32 on the
    /// set's device, cast to W's dtype, where `scale_m` is alpha / rank x
    /// `scale` ([`crate::lora`]). `prefix` selects one component of a
    /// pipeline's LoRA (`"unet."`). Refused (`run.lora_invalid`, nothing
    /// changed) when a LoRA is already fused or when it does not fit; checked
    /// before the set's lock is taken, written under it held exclusive.
    pub fn apply_lora(
        &self,
        path: &Path,
        scale: f64,
        prefix: Option<&str>,
        name: Option<String>,
    ) -> Result<()> {
        self.fuse_lora(path, scale, prefix, name, false)
    }

    /// Swap the fused LoRA (if any) for the one at `path` in one step: no
    /// call sees the base or a mix. Computed from the kept base values, never
    /// accumulated; weights the old LoRA changed and the new one does not go
    /// back to base. A refused LoRA changes nothing (the fused one stays).
    pub fn replace_lora(
        &self,
        path: &Path,
        scale: f64,
        prefix: Option<&str>,
        name: Option<String>,
    ) -> Result<()> {
        self.fuse_lora(path, scale, prefix, name, true)
    }

    fn fuse_lora(
        &self,
        path: &Path,
        scale: f64,
        prefix: Option<&str>,
        name: Option<String>,
        replace: bool,
    ) -> Result<()> {
        if let (false, Some(fused)) = (replace, self.lora()) {
            // Refused before reading the file (checked again under the lock).
            return Err(Error::new(
                Code::RunLoraInvalid,
                format!(
                    "a LoRA ({:?}) is already fused: replace_lora() or remove_lora() first",
                    fused.name
                ),
            ));
        }
        let targets = prepare(self, path, scale, prefix)?;
        let _exclusive = self.exclusive();
        let mut state = self.lora_state();
        // Bumped whatever happens: a failure midway restored the base values,
        // which are new values too for a graph that folded the LoRA's.
        let result = state.fuse(self, targets, scale, name, replace);
        self.generation.fetch_add(1, Ordering::SeqCst);
        result.map(drop)
    }

    /// Restore the base values bit for bit and free the copies kept of them
    /// (nothing to do when no LoRA is fused).
    pub fn remove_lora(&self) -> Result<()> {
        let _exclusive = self.exclusive();
        let mut state = self.lora_state();
        if state.info().is_none() && state.base_nbytes() == 0 {
            return Ok(());
        }
        let result = state.remove(self);
        self.generation.fetch_add(1, Ordering::SeqCst);
        result.map(drop)
    }

    /// The fused LoRA (`name`, `scale`, `targets`, `nbytes`), if any.
    pub fn lora(&self) -> Option<LoraInfo> {
        self.lora_state().info().cloned()
    }

    /// How many times the set's values were updated (a LoRA fused, swapped or
    /// removed): a graph that folded constants from older values folds again.
    pub fn values_generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Every tensor's name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The number of tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the set holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Where the tensors live.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Tensors of the checkpoint skipped for lying outside `strip_prefix`.
    pub fn outside_prefix(&self) -> usize {
        self.outside_prefix
    }

    /// How long opening took, phase by phase (`open_libraries`,
    /// `plan_weights`, `allocate_weights`, `read_weights`, `copy_weights`,
    /// on a GPU `cuda_context` and `staging_ring`, then `set_total`).
    pub fn timings(&self) -> &Timings {
        &self.timings
    }

    /// libtorch, as loaded.
    pub fn torch(&self) -> &Arc<Torch> {
        &self.torch
    }

    /// A tensor by name: its address (a device address on a GPU), dtype and
    /// shape (C-contiguous). The memory stays at that address as long as the
    /// set lives; write to it only under [`WeightsSet::exclusive`].
    pub(crate) fn entry(&self, name: &str) -> Option<(usize, Dtype, &[i64])> {
        self.entries
            .get(name)
            .map(|e| (self.memory.ptr() + e.offset, e.dtype, e.shape.as_slice()))
    }

    /// [`WeightsSet::entry`], for callers outside the crate (tests, a
    /// caller that updates values in place under [`WeightsSet::exclusive`]).
    pub fn tensor(&self, name: &str) -> Option<(usize, Dtype, &[i64])> {
        self.entry(name)
    }

    /// The shared guard: calls of graphs bound to the set hold it while they
    /// queue their work.
    pub fn shared(&self) -> RwLockReadGuard<'_, ()> {
        self.lock.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The exclusive guard: an update of the set's values holds it, so that
    /// no call queues work on values half updated. Lock order: a call takes
    /// the set's lock, then its graph's (for a replay or a run); so an update
    /// holding this guard must not wait for a graph's lock (a bind,
    /// `set_single_threaded`, a capture). On a
    /// GPU the guard orders the queueing of calls, not their execution: an
    /// update synchronises the device (or the streams of the calls) before
    /// it writes.
    pub fn exclusive(&self) -> RwLockWriteGuard<'_, ()> {
        self.lock.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The bytes of tensor `name` (for comparing aliases): copied from the
    /// device on a GPU, in chunks of at most [`COMPARE_CHUNK`].
    fn same_values(&self, a: &str, b: &str) -> Result<bool> {
        let (Some(x), Some(y)) = (self.entries.get(a), self.entries.get(b)) else {
            return Ok(false);
        };
        if x.nbytes != y.nbytes {
            return Ok(false);
        }
        let base = self.memory.ptr();
        match &self.memory {
            Memory::Host(_) => {
                // SAFETY: both ranges lie inside the set's host allocation
                // (laid out from the headers), alive as long as `self`.
                let (p, q) = unsafe {
                    (
                        std::slice::from_raw_parts((base + x.offset) as *const u8, x.nbytes),
                        std::slice::from_raw_parts((base + y.offset) as *const u8, y.nbytes),
                    )
                };
                Ok(p == q)
            }
            Memory::Device(memory) => {
                let context = memory.context();
                let mut p = vec![0u8; COMPARE_CHUNK.min(x.nbytes)];
                let mut q = vec![0u8; p.len()];
                let mut at = 0;
                while at < x.nbytes {
                    let n = (x.nbytes - at).min(p.len());
                    // SAFETY: both ranges lie inside the set's device
                    // allocation, alive as long as `self`.
                    unsafe {
                        context.copy_to_host(&mut p[..n], base + x.offset + at)?;
                        context.copy_to_host(&mut q[..n], base + y.offset + at)?;
                    }
                    if p[..n] != q[..n] {
                        return Ok(false);
                    }
                    at += n;
                }
                Ok(true)
            }
        }
    }
}

impl FuseWeights for WeightsSet {
    fn torch(&self) -> &Arc<Torch> {
        &self.torch
    }
    fn device(&self) -> Device {
        self.device
    }
    fn entry(&self, name: &str) -> Option<(usize, Dtype, Vec<i64>)> {
        WeightsSet::entry(self, name).map(|(a, d, s)| (a, d, s.to_vec()))
    }
}

/// How a graph binds a set: per table row it provides, the set's tensor.
#[derive(Debug, Clone)]
pub(crate) struct SetPlan {
    /// `(table fqn, address in the set)` for every row the set provides.
    pub bind: BTreeMap<String, usize>,
    /// The set's names the graph does not bind (declared, dropped), sorted.
    pub ignored: Vec<String>,
}

/// Check a graph's constants against `set` by its weights contract, as a
/// bind from files checks them against the files' headers (the same codes):
/// a name foreign to the declaration is `run.constant_unexpected`, a row no
/// name provides `run.constant_missing`, another dtype or shape
/// `run.constant_mismatch`, aliases both held with different values
/// `run.constant_mismatch`. Literal rows are the graph's own (not checked
/// here); computed rows are folded by the container.
pub(crate) fn plan_set(
    rows: &[ConstantRow],
    contract: &WeightsContract,
    set: &WeightsSet,
    device: Device,
) -> Result<SetPlan> {
    if set.device != device {
        return Err(Error::new(
            Code::RunDeviceMismatch,
            format!(
                "the weights set is on {}, the graph runs on {device}",
                set.device
            ),
        ));
    }
    let plan = contract.plan(set.names())?;
    for (bound, other) in &plan.duplicates {
        let (a, b) = (&set.entries[bound], &set.entries[other]);
        if a.dtype.name != b.dtype.name || a.shape != b.shape || !set.same_values(bound, other)? {
            return Err(Error::new(
                Code::RunConstantMismatch,
                format!(
                    "{bound:?} and {other:?} share storage in the exported program, but the weights hold different values for them"
                ),
            ));
        }
    }
    let source_of: BTreeMap<&str, &str> = plan
        .bind
        .iter()
        .map(|(row, name)| (row.as_str(), name.as_str()))
        .collect();
    let mut bind = BTreeMap::new();
    for row in rows
        .iter()
        .filter(|r| r.source != ConstantSource::Computed && r.source != ConstantSource::Literal)
    {
        let name = source_of.get(row.fqn.as_str()).copied().unwrap_or(&row.fqn);
        let (address, dtype, shape) = set.entry(name).ok_or_else(|| {
            Error::new(
                Code::RunConstantMissing,
                format!("the weights lack {name:?}"),
            )
        })?;
        let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        if dtype.name != row.dtype || shape != row.shape {
            return Err(row_mismatch(row, name, dtype.name, &shape));
        }
        bind.insert(row.fqn.clone(), address);
    }
    Ok(SetPlan {
        bind,
        ignored: plan.ignored,
    })
}
