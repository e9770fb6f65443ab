//! A LoRA fused into a native weights set's memory through libtorch's C shim
//! (docs/run.md, "Weights once"): what the Python `WeightsSet` does with torch
//! ops, done here with `aoti_torch_empty_strided`, `aoti_torch_copy_` and the
//! per-device `addmm_out` of the generated shims (`aoti_torch_cpu_addmm_out`,
//! `aoti_torch_cuda_addmm_out`).
//!
//! Per target weight W (rows x columns, a conv kernel viewed as out x
//! in·kh·kw): the base of W is kept once (a copy in W's dtype, on W's device,
//! made the first time W is targeted), and W is written as
//! `base32 + scale · B32 @ A32` computed in float32 (one `addmm` into a
//! float32 copy of the base) and cast to W's dtype by the copy back. Always
//! from the kept base, never from the fused value, so swaps do not accumulate
//! rounding. A replacement sends the weights the old LoRA changed and the new
//! one does not back to base; a removal copies every base back bit for bit
//! and frees it. A failure midway restores every base and leaves no LoRA.
//!
//! Memory: the base copies of the targeted tensors plus the LoRA's tensors
//! (held in host memory as read); while one target is written, a float32 copy
//! of it and its two LoRA factors on the device.
//!
//! The caller holds the set's lock exclusive (no call of a graph bound to the
//! set runs); on a GPU, [`LoraState`] first waits for the device to be idle
//! (calls queued on any stream), writes on a stream of its own, and waits for
//! that stream before returning, so no call queued afterwards reads
//! half-updated weights.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::c_void;
use std::path::Path;
use std::sync::Arc;

use tcg_core::{Code, Error, Result};

use crate::cuda::{AddmmOut, Device, Stream};
use crate::lora::{self, HostTensor, Target, FLOAT_DTYPES};
use crate::torch::{BorrowedTensor, Dtype, OwnedTensor, Torch};

/// What fusing a LoRA needs of a weights set.
pub trait FuseWeights {
    /// The libtorch the set's memory was allocated through.
    fn torch(&self) -> &Arc<Torch>;
    /// Where the set's tensors live.
    fn device(&self) -> Device;
    /// The tensor `name`: its address on [`FuseWeights::device`], dtype and
    /// shape. The tensor must be C-contiguous and stay allocated while the set
    /// lives.
    fn entry(&self, name: &str) -> Option<(usize, Dtype, Vec<i64>)>;
}

/// The fused LoRA, as `lora()` describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraInfo {
    /// The caller's name for it, if given.
    pub name: Option<String>,
    /// The caller's scale.
    pub scale: f64,
    /// The set's names it changed, sorted.
    pub targets: Vec<String>,
    /// Bytes of its tensors (`lora_A` and `lora_B` of every target).
    pub nbytes: usize,
}

/// Read the LoRA at `path` and check it against `set`: the targets to fuse,
/// or `run.lora_invalid` with nothing touched (no lock needed: a set's names,
/// dtypes and shapes never change).
pub fn prepare(
    set: &dyn FuseWeights,
    path: &Path,
    scale: f64,
    prefix: Option<&str>,
) -> Result<Vec<Target>> {
    let file = lora::read(path)?;
    let lookup = |name: &str| {
        set.entry(name)
            .map(|(_, dtype, shape)| (FLOAT_DTYPES.contains(&dtype.name), shape))
    };
    lora::plan(&file, &lookup, scale, prefix)
}

/// A set's LoRA: the base values of the tensors the fused LoRA changed, and
/// its description.
#[derive(Default)]
pub struct LoraState {
    base: BTreeMap<String, OwnedTensor>,
    fused: Option<LoraInfo>,
    stream: Option<Stream<'static>>,
}

impl std::fmt::Debug for LoraState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraState")
            .field("fused", &self.fused)
            .field("base", &self.base.len())
            .finish()
    }
}

fn failed(message: String) -> Error {
    Error::new(Code::RunExecutionFailed, message)
}

impl LoraState {
    /// The fused LoRA, if any.
    pub fn info(&self) -> Option<&LoraInfo> {
        self.fused.as_ref()
    }

    /// Bytes of the base copies held.
    pub fn base_nbytes(&self) -> usize {
        self.base.values().map(OwnedTensor::nbytes).sum()
    }

    /// Fuse `targets` (from [`prepare`] against the same `set`) into the set
    /// in place. With `replace` false this is refused (`run.lora_invalid`,
    /// nothing changed) while a LoRA is fused; with `replace` true it swaps
    /// the fused one. Returns the names written (the new targets and those
    /// sent back to base), for graphs that must recompute what they folded
    /// from them. The caller holds the set's lock exclusive.
    pub fn fuse(
        &mut self,
        set: &dyn FuseWeights,
        targets: Vec<Target>,
        scale: f64,
        name: Option<String>,
        replace: bool,
    ) -> Result<Vec<String>> {
        if let (false, Some(fused)) = (replace, &self.fused) {
            return Err(Error::new(
                Code::RunLoraInvalid,
                format!(
                    "a LoRA ({:?}) is already fused: replace_lora() or remove_lora() first",
                    fused.name
                ),
            ));
        }
        let wanted: BTreeSet<String> = targets.iter().map(|t| t.weight.clone()).collect();
        if wanted.len() != targets.len() {
            return Err(Error::new(
                Code::RunLoraInvalid,
                "the LoRA adapts one weight twice",
            ));
        }
        let torch = Arc::clone(set.torch());
        let device = set.device();
        let addmm = match device {
            Device::Cpu => torch.shim().cpu_addmm_out,
            Device::Cuda(_) => torch.cuda()?.addmm_out,
        }
        .ok_or_else(|| {
            Error::new(
                Code::RunNativeUnsupported,
                format!("this libtorch's shim has no addmm_out for {device}: a LoRA cannot be fused there"),
            )
        })?;
        let mut changed: BTreeSet<String> = wanted.clone();
        changed.extend(self.base.keys().cloned());
        self.on_device(set, |state, stream| {
            let written = (|| {
                for target in &targets {
                    state.write(set, &torch, target, addmm, stream)?;
                }
                // Weights the old LoRA changed and the new one does not: back to base.
                let unused: Vec<String> = state
                    .base
                    .keys()
                    .filter(|n| !wanted.contains(*n))
                    .cloned()
                    .collect();
                for name in unused {
                    state.restore(set, &torch, &name)?;
                    state.base.remove(&name);
                }
                Ok(())
            })();
            if let Err(e) = written {
                // Failing midway (out of memory for a base copy or a product):
                // nothing half-applied survives, every weight goes back to base.
                state.fused = None;
                return Err(match state.restore_all(set, &torch) {
                    Ok(()) => e,
                    Err(again) => failed(format!(
                        "{}; restoring the base weights failed too: {}",
                        e.message(),
                        again.message()
                    )),
                });
            }
            Ok(())
        })?;
        self.fused = Some(LoraInfo {
            name,
            scale,
            targets: wanted.into_iter().collect(),
            nbytes: targets
                .iter()
                .map(|t| t.down.nbytes() + t.up.nbytes())
                .sum(),
        });
        Ok(changed.into_iter().collect())
    }

    /// Restore every base bit for bit and free the copies; nothing fused
    /// afterwards. Returns the names written. The caller holds the set's lock
    /// exclusive.
    pub fn remove(&mut self, set: &dyn FuseWeights) -> Result<Vec<String>> {
        if self.fused.is_none() && self.base.is_empty() {
            return Ok(Vec::new());
        }
        let torch = Arc::clone(set.torch());
        let names: Vec<String> = self.base.keys().cloned().collect();
        self.on_device(set, |state, _| {
            state.fused = None;
            state.restore_all(set, &torch)
        })?;
        Ok(names)
    }

    /// Copy every base back; the copies restored are freed, any that could
    /// not be are kept (and the first error returned).
    fn restore_all(&mut self, set: &dyn FuseWeights, torch: &Arc<Torch>) -> Result<()> {
        let mut first = None;
        let names: Vec<String> = self.base.keys().cloned().collect();
        for name in names {
            match self.restore(set, torch, &name) {
                Ok(()) => {
                    self.base.remove(&name);
                }
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// The set's tensor `name` viewed as the matrix `shape`.
    fn view(
        set: &dyn FuseWeights,
        torch: &Torch,
        name: &str,
        shape: &[i64],
    ) -> Result<BorrowedTensor> {
        let (addr, dtype, full) = set
            .entry(name)
            .ok_or_else(|| failed(format!("the weights set lost {name:?}")))?;
        let numel = |s: &[i64]| s.iter().product::<i64>();
        if numel(&full) != numel(shape) {
            return Err(failed(format!(
                "{name}: a {shape:?} view of a {full:?} tensor"
            )));
        }
        // SAFETY: the set guarantees that `addr` holds a live C-contiguous
        // tensor of `full` (so of `shape`, same element count) and `dtype` on
        // its device for as long as the set lives, which outlasts this view
        // (dropped before the call returns).
        unsafe { BorrowedTensor::new(torch, addr as *mut c_void, shape, dtype, set.device()) }
    }

    fn restore(&mut self, set: &dyn FuseWeights, torch: &Torch, name: &str) -> Result<()> {
        let base = self
            .base
            .get(name)
            .ok_or_else(|| failed(format!("no base kept for {name:?}")))?;
        let view = Self::view(set, torch, name, base.sizes())?;
        view.copy_from(torch, base.handle())
    }

    /// `W <- base + scale · B @ A` for one target, on `stream`.
    fn write(
        &mut self,
        set: &dyn FuseWeights,
        torch: &Arc<Torch>,
        target: &Target,
        addmm: AddmmOut,
        stream: usize,
    ) -> Result<()> {
        let device = set.device();
        let (rows, cols) = target.matrix();
        let matrix = [rows as i64, cols as i64];
        let view = Self::view(set, torch, &target.weight, &matrix)?;
        let dtype = view_dtype(set, &target.weight)?;
        if !self.base.contains_key(&target.weight) {
            let base = OwnedTensor::empty(torch, &matrix, dtype, device, stream)?;
            base.copy_from(view.handle())?;
            self.base.insert(target.weight.clone(), base);
        }
        let base = &self.base[&target.weight];
        let f32 = torch
            .dtype_by_name("float32")
            .ok_or_else(|| failed("libtorch has no float32".into()))?;
        let acc = OwnedTensor::empty(torch, &matrix, f32, device, stream)?;
        acc.copy_from(base.handle())?;
        let up = upload(torch, &target.up, [rows, target.rank], f32, device, stream)?;
        let down = upload(
            torch,
            &target.down,
            [target.rank, cols],
            f32,
            device,
            stream,
        )?;
        // SAFETY: four live tensors of `device`: acc rows x cols (float32,
        // also the `self` operand, as torch's in-place addmm_ does), up rows x
        // rank, down rank x cols, all float32; the current stream is the
        // set's (on_device). The shim catches what the operator throws and
        // returns a code.
        let rc = unsafe {
            addmm(
                acc.handle(),
                acc.handle(),
                up.handle(),
                down.handle(),
                1.0,
                target.scale,
            )
        };
        if rc != 0 {
            return Err(failed(format!(
                "libtorch could not compute the LoRA product of {} on {device}",
                target.weight
            )));
        }
        view.copy_from(torch, acc.handle())
    }

    /// Run `f` with the set's device ready for an update: on a GPU, the device
    /// idle first, the set's stream current (its handle passed to `f`), and
    /// that stream finished before returning, whatever `f` returned.
    fn on_device<T>(
        &mut self,
        set: &dyn FuseWeights,
        f: impl FnOnce(&mut Self, usize) -> Result<T>,
    ) -> Result<T> {
        let index = match set.device() {
            Device::Cpu => return f(self, 0),
            Device::Cuda(index) => index,
        };
        let cuda = set.torch().cuda()?;
        let _device = cuda.device_guard(index)?;
        cuda.synchronize_device()?;
        if self.stream.is_none() {
            self.stream = Some(cuda.new_stream(index)?);
        }
        let stream = self.stream.as_ref().map_or(0, Stream::handle);
        let result = {
            let _current = cuda.stream_guard(stream, index)?;
            f(self, stream)
        };
        let synced = cuda.synchronize(stream);
        let value = result?;
        synced?;
        Ok(value)
    }
}

fn view_dtype(set: &dyn FuseWeights, name: &str) -> Result<Dtype> {
    set.entry(name)
        .map(|(_, dtype, _)| dtype)
        .ok_or_else(|| failed(format!("the weights set lost {name:?}")))
}

/// A LoRA factor on `device` in float32, as the matrix `shape` (a conv
/// factor's trailing dimensions flattened).
fn upload(
    torch: &Arc<Torch>,
    tensor: &HostTensor,
    [rows, cols]: [usize; 2],
    f32: Dtype,
    device: Device,
    stream: usize,
) -> Result<OwnedTensor> {
    let dtype = torch.dtype_by_name(&tensor.dtype).ok_or_else(|| {
        Error::new(
            Code::RunLoraInvalid,
            format!("a LoRA tensor of {} cannot be read", tensor.dtype),
        )
    })?;
    let shape = [rows as i64, cols as i64];
    let raw = OwnedTensor::from_host(torch, &tensor.bytes, &shape, dtype, device, stream)?;
    if dtype == f32 {
        return Ok(raw);
    }
    let out = OwnedTensor::empty(torch, &shape, f32, device, stream)?;
    out.copy_from(raw.handle())?;
    Ok(out)
}

#[cfg(test)]
#[path = "lora_fuse_tests.rs"]
mod tests;
