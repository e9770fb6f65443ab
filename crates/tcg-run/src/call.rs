//! A call of a loaded graph: inputs checked and described to libtorch (host
//! buffers copied to the graph's device when it runs on a GPU), the
//! container run on the caller's stream, outputs handed back owned.

use std::ffi::c_void;
use std::sync::Arc;

use tcg_core::{Code, Error, Result};

use crate::cuda::Device;
use crate::graph::{last_error, Graph, Input};
use crate::inputs::InputFact;
use crate::torch::{BorrowedTensor, Dtype, OwnedTensor, TensorHandle};

/// One input as handed to the container: a handle over the caller's memory,
/// or a device copy of a host buffer.
enum Described {
    Borrowed(BorrowedTensor),
    Copied(OwnedTensor),
}

impl Graph {
    /// Run the graph on `inputs` on the default stream (the legacy default
    /// stream of a CUDA graph) and return its outputs, which the caller owns.
    ///
    /// # Safety
    /// Each input's `data` must address `nbytes` readable bytes on its device
    /// that stay valid and unchanged until this call returns (for a CUDA
    /// graph: until the work it queued is done, see [`Graph::run_on`]).
    pub unsafe fn run(&self, inputs: &[Input]) -> Result<Vec<OwnedTensor>> {
        // SAFETY: the caller's contract is this function's.
        unsafe { self.run_on(inputs, 0) }
    }

    /// Run the graph on `inputs` with its work queued on `stream` (a
    /// `cudaStream_t` of the graph's device, 0 for the legacy default stream;
    /// always 0 for a CPU graph). Every input is checked (dtype, rank, static
    /// sizes, buffer length, device) before anything is described to libtorch.
    /// A CUDA graph's call returns once its work is queued: outputs are ready
    /// for work queued later on `stream` (or after [`crate::Cuda::synchronize`]).
    ///
    /// # Safety
    /// Each input's `data` must address `nbytes` readable bytes on its device
    /// that stay valid and unchanged until the work queued on `stream` is done;
    /// `stream` must be a live stream of the graph's device.
    pub unsafe fn run_on(&self, inputs: &[Input], stream: usize) -> Result<Vec<OwnedTensor>> {
        // SAFETY: the caller's contract is this function's.
        unsafe { self.run_on_with(inputs, stream, crate::capture::Outputs::Copy) }
    }

    /// [`Graph::run_on`], with what a replayed call hands back: copies of the
    /// capture's outputs ([`Outputs::Copy`](crate::capture::Outputs::Copy), as
    /// `run_on`), or the capture's output buffers themselves
    /// ([`Outputs::Static`](crate::capture::Outputs::Static): no copy, valid
    /// until this graph's next call). Uncaptured calls always return new tensors.
    ///
    /// # Safety
    /// As [`Graph::run_on`].
    pub unsafe fn run_on_with(
        &self,
        inputs: &[Input],
        stream: usize,
        outputs: crate::capture::Outputs,
    ) -> Result<Vec<OwnedTensor>> {
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
        if self.device == Device::Cpu && stream != 0 {
            return Err(Error::new(
                Code::RunCallInvalid,
                "a CPU graph runs on no stream; pass stream 0",
            ));
        }
        let mismatch = |m: String| Error::new(Code::RunInputMismatch, m);
        let mut dtypes = Vec::with_capacity(inputs.len());
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
            let fits = match (self.device, input.device) {
                (Device::Cpu, Device::Cpu) | (Device::Cuda(_), Device::Cpu) => true,
                (Device::Cuda(g), Device::Cuda(d)) => g == d,
                (Device::Cpu, Device::Cuda(_)) => false,
            };
            if !fits {
                // Never handed to the container: it would read the buffer as
                // memory of its own device (an illegal access aborts the process).
                return Err(Error::new(
                    Code::RunCallInvalid,
                    format!(
                        "input {i} is on {}, the graph runs on {}: move it there first",
                        input.device, self.device
                    ),
                ));
            }
            if input.data == 0 && need > 0 {
                return Err(Error::new(
                    Code::RunInputLayout,
                    format!("input {i} has no memory (a null address)"),
                ));
            }
            dtypes.push(dtype);
        }
        // A weights set's shared lock while the work is queued (a replay or a
        // run): an update of the set's values (its exclusive lock) waits for it.
        let set = self.weights_set();
        let _set_shared = set.as_deref().map(crate::weights_set::WeightsSet::shared);
        // The set's values changed since the container folded its constants
        // from them (a LoRA): fold again before this call (the set's values
        // cannot change again while its shared lock is held).
        if let Some(set) = set.as_deref().filter(|s| self.folds_stale(s)) {
            self.refold(set, stream)?;
        }
        // SAFETY: the caller's contract is this function's.
        if let Some(outputs) = unsafe { self.run_captured(inputs, &dtypes, stream, outputs)? } {
            return Ok(outputs);
        }
        // The threaded run shares the lock (the container keeps a pool of
        // models); the single-threaded run guards nothing, so it runs alone.
        let single = self.single_threaded();
        let _shared = (!single).then(|| self.lock.read().unwrap_or_else(|p| p.into_inner()));
        let _exclusive = single.then(|| self.lock.write().unwrap_or_else(|p| p.into_inner()));
        // SAFETY: as above.
        unsafe { self.run_container(inputs, &dtypes, stream) }
    }

    /// Describe checked `inputs` (of `dtypes`) to libtorch and run the
    /// container on `stream`; the caller holds `lock` as the run needs it.
    ///
    /// # Safety
    /// As [`Graph::run_on`]; the inputs were checked by it.
    pub(crate) unsafe fn run_container(
        &self,
        inputs: &[Input],
        dtypes: &[Dtype],
        stream: usize,
    ) -> Result<Vec<OwnedTensor>> {
        let mut described = Vec::with_capacity(inputs.len());
        for (input, &dtype) in inputs.iter().zip(dtypes) {
            described.push(if input.device == self.device {
                // SAFETY: the caller guarantees `data` addresses `nbytes`
                // readable bytes on `input.device` for as long as the call's
                // work runs, and `nbytes` equals what the shape and dtype need.
                Described::Borrowed(unsafe {
                    BorrowedTensor::new(
                        &self.torch,
                        input.data as *mut c_void,
                        &input.shape,
                        dtype,
                        input.device,
                    )?
                })
            } else {
                // A host buffer for a CUDA graph: copied on the call's stream
                // into memory that the stream owns (freed after the run, in
                // stream order, when the container drops the handle).
                // SAFETY: as above, `data` addresses `nbytes` host bytes.
                let bytes =
                    unsafe { std::slice::from_raw_parts(input.data as *const u8, input.nbytes) };
                Described::Copied(OwnedTensor::from_host(
                    &self.torch,
                    bytes,
                    &input.shape,
                    dtype,
                    self.device,
                    stream,
                )?)
            });
        }
        let raw: Vec<TensorHandle> = described
            .into_iter()
            .map(|d| match d {
                Described::Borrowed(t) => t.into_raw(),
                Described::Copied(t) => t.into_handle(),
            })
            .collect();
        // SAFETY: every handle describes an input as the caller guarantees.
        unsafe { self.run_handles(raw, stream) }
    }

    /// Run the container on `raw` (one live handle per input, stolen by the
    /// run) with its work queued on `stream`; the caller holds `lock` as the
    /// run needs it (shared for the threaded run, exclusive otherwise).
    ///
    /// # Safety
    /// Each handle describes memory that stays valid until the work queued
    /// on `stream` is done.
    pub(crate) unsafe fn run_handles(
        &self,
        mut raw: Vec<TensorHandle>,
        stream: usize,
    ) -> Result<Vec<OwnedTensor>> {
        if raw.len() != self.num_inputs {
            // Never handed to the run: it would read past the array.
            for h in raw {
                // SAFETY: each handle is live and owned by this call.
                drop(unsafe { OwnedTensor::from_raw(Arc::clone(&self.torch), h, stream) });
            }
            return Err(Error::new(
                Code::RunCallInvalid,
                format!("the graph takes {} inputs", self.num_inputs),
            ));
        }
        let mut outputs: Vec<TensorHandle> = vec![std::ptr::null_mut(); self.num_outputs];
        let run = match (self.single_threaded(), self.api.run_single_threaded) {
            (true, Some(f)) => f,
            _ => self.api.run,
        };
        // SAFETY: `raw` holds `num_inputs` live handles, which Run steals (the
        // count was checked above, so the container's own count check cannot
        // fail before it takes them); `outputs` has room for `num_outputs`
        // handles that Run writes and we then own. `stream` is the caller's
        // (0 for a CPU graph); no proxy executor (no custom ops).
        let rc = unsafe {
            run(
                self.container,
                raw.as_mut_ptr(),
                raw.len(),
                outputs.as_mut_ptr(),
                outputs.len(),
                stream as *mut c_void,
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
            match unsafe { OwnedTensor::from_raw(Arc::clone(&self.torch), h, stream) } {
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
    // Inputs here are C-contiguous memory; a graph that reads another layout
    // would compute from misplaced elements.
    if let Some(why) = fact.layout_mismatch(&input.shape) {
        return Err(Error::new(
            Code::RunInputLayout,
            format!(
                "input {i}: {why}; the native path passes C-contiguous inputs: run this graph \
                 through load(), which lays each input out as the graph reads it (graphs \
                 minted by torch-compiled-graphs 0.3 read every input C-contiguous)"
            ),
        ));
    }
    Ok(())
}
