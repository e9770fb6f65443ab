//! The weights pipeline: from safetensors files to each constant's final
//! place, read once, checked before anything is bound.
//!
//! Staging ([`stage`]) plans the bind from the files' headers alone (every
//! constant by fqn, dtype and shape against the artifact's table, aliases and
//! ignored names by the weights contract), lays the constants out in **one**
//! allocation (256-byte aligned), refuses weights that do not fit the
//! device's free memory, and then reads:
//!
//! - on a GPU, several threads `pread` the files into a small ring of pinned
//!   staging buffers; each buffer is copied to the device on a copy stream
//!   while the next is read, straight to the constant's final address;
//! - on the CPU, the same threads `pread` straight into the final allocation.
//!
//! Reads go into memory this process owns (no mapping of a file another
//! process can truncate); a file that shrinks is a short read, one rewritten
//! in place is caught by its size and modification time after the read, and
//! both are typed refusals. The allocation is then handed to the container
//! without a second copy where its C API allows it
//! ([`crate::graph::Graph::bind_staged`]).
//!
//! Staging needs neither libtorch nor the container: on a GPU it uses the
//! CUDA driver directly ([`crate::driver`]), so a load can create the device
//! context and stream the weights while libtorch's libraries are opened.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use tcg_core::artifact::metadata::{ConstantRow, ConstantSource};
use tcg_core::artifact::weights::WeightsContract;
use tcg_core::{Code, Error, Result};

use crate::cuda::{check_capability, Device};
use crate::driver::{Context, DeviceMemory, Driver, Event, PinnedMemory, Stream};
use crate::weights::{Checkpoint, Entry, Source};

/// Where constants start inside the allocation (a multiple of what any
/// kernel's vector loads need, and of AOTInductor's own 64).
pub const ALIGN: usize = 256;
/// The size of one pinned staging buffer.
pub const SLOT_BYTES: usize = 4 << 20;
/// The environment variable that sets the number of reader threads (1 to 64).
pub const THREADS_ENV: &str = "TORCH_COMPILED_GRAPHS_READ_THREADS";

/// Named durations in seconds, in the order they were measured.
pub type Timings = Vec<(&'static str, f64)>;

/// The reader threads: [`THREADS_ENV`] when set to 1..=64, else the
/// machine's parallelism, at most 8.
pub fn reader_threads() -> usize {
    if let Some(n) = std::env::var(THREADS_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| (1..=64).contains(n))
    {
        return n;
    }
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 8)
}

/// A job every reader thread runs once (lifetime erased: see [`Readers::run`]).
#[derive(Clone, Copy)]
struct Job(*const (dyn Fn() + Sync));
// SAFETY: the pointee is `Sync` and outlives every use (see `Readers::run`).
unsafe impl Send for Job {}

struct ReaderState {
    job: Option<Job>,
    generation: u64,
    pending: usize,
    closed: bool,
    panicked: bool,
}

struct ReaderShared {
    state: Mutex<ReaderState>,
    changed: Condvar,
}

/// The pipeline's reader threads, started before anything else: glibc
/// serialises a thread's creation and start against a `dlopen` in progress,
/// so threads made (or still starting) while libtorch's libraries load would
/// wait for them; started first, they read while the libraries load.
pub struct Readers {
    shared: Arc<ReaderShared>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Readers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Readers({})", self.handles.len())
    }
}

impl Readers {
    /// `n` (at least one) idle reader threads.
    pub fn spawn(n: usize) -> Result<Readers> {
        let shared = Arc::new(ReaderShared {
            state: Mutex::new(ReaderState {
                job: None,
                generation: 0,
                pending: 0,
                closed: false,
                panicked: false,
            }),
            changed: Condvar::new(),
        });
        let mut readers = Readers {
            shared,
            handles: Vec::new(),
        };
        for i in 0..n.max(1) {
            let shared = Arc::clone(&readers.shared);
            let handle = std::thread::Builder::new()
                .name(format!("tcg-read-{i}"))
                .spawn(move || reader_loop(&shared))
                .map_err(|e| {
                    Error::new(
                        Code::RunExecutionFailed,
                        format!("cannot start a reader thread: {e}"),
                    )
                })?;
            readers.handles.push(handle);
        }
        // Returns once every thread has started and waits for work: a
        // thread still starting when a `dlopen` begins would wait for it.
        readers.run(&|| {})?;
        Ok(readers)
    }

    /// How many threads read.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether there are no threads (never: `spawn` makes at least one).
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Run `job` once on every reader thread; returns when all returned. A
    /// job that panicked on any thread is an error (what it was to read may
    /// be missing), never a crash.
    fn run(&self, job: &(dyn Fn() + Sync)) -> Result<()> {
        // SAFETY (the lifetime erasure): `job` is only called by the reader
        // threads between the moment it is published here and the moment
        // `pending` drops to zero, and this function does not return before
        // then; each thread drops its copy of the pointer before counting
        // down. So no call outlives the borrow.
        let erased: *const (dyn Fn() + Sync + '_) = job;
        let erased: *const (dyn Fn() + Sync + 'static) = unsafe { std::mem::transmute(erased) };
        let mut state = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        state.job = Some(Job(erased));
        state.generation += 1;
        state.pending = self.handles.len();
        state.panicked = false;
        self.shared.changed.notify_all();
        while state.pending > 0 {
            state = self
                .shared
                .changed
                .wait(state)
                .unwrap_or_else(|p| p.into_inner());
        }
        state.job = None;
        if state.panicked {
            return Err(Error::new(
                Code::RunExecutionFailed,
                "a reader thread of the weights pipeline failed; nothing was bound",
            ));
        }
        Ok(())
    }
}

fn reader_loop(shared: &ReaderShared) {
    let mut seen = 0u64;
    loop {
        let job = {
            let mut state = shared.state.lock().unwrap_or_else(|p| p.into_inner());
            while !state.closed && state.generation == seen {
                state = shared
                    .changed
                    .wait(state)
                    .unwrap_or_else(|p| p.into_inner());
            }
            if state.closed {
                return;
            }
            seen = state.generation;
            state.job
        };
        if let Some(Job(f)) = job {
            // SAFETY: see `Readers::run`: the job outlives this call. A panic
            // is contained (the job records its own errors).
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*f)() }));
            if ran.is_err() {
                shared
                    .state
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .panicked = true;
            }
        }
        let mut state = shared.state.lock().unwrap_or_else(|p| p.into_inner());
        state.pending -= 1;
        if state.pending == 0 {
            shared.changed.notify_all();
        }
    }
}

impl Drop for Readers {
    fn drop(&mut self) {
        {
            let mut state = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
            state.closed = true;
            self.shared.changed.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// Host memory for constants: zeroed, [`ALIGN`]ed, freed on drop. From
/// `calloc`, whose large blocks are fresh zero pages mapped on first touch
/// (an over-aligned Rust allocation would be zeroed byte by byte up front).
pub struct HostMemory {
    raw: *mut u8,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain heap memory; the pipeline writes disjoint ranges from its
// threads and nothing reads it until they are done.
unsafe impl Send for HostMemory {}
// SAFETY: as above.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    fn new(len: usize) -> Result<HostMemory> {
        let size = len
            .checked_add(ALIGN)
            .ok_or_else(|| too_large(format!("{len} bytes cannot be allocated")))?;
        // SAFETY: a plain allocation, freed once on drop.
        let raw = unsafe { libc::calloc(1, size) }.cast::<u8>();
        if raw.is_null() {
            return Err(too_large(format!(
                "cannot allocate {len} bytes of host memory for the weights"
            )));
        }
        let pad = (ALIGN - (raw as usize % ALIGN)) % ALIGN;
        // SAFETY: `pad < ALIGN`, inside the `len + ALIGN` bytes allocated.
        let ptr = unsafe { raw.add(pad) };
        Ok(HostMemory { raw, ptr, len })
    }

    /// The address.
    pub fn ptr(&self) -> usize {
        self.ptr as usize
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: allocated by calloc in `new`, freed once.
        unsafe { libc::free(self.raw.cast()) };
    }
}

/// The one allocation that holds every staged constant.
pub enum Memory {
    /// On the host, for a CPU graph.
    Host(HostMemory),
    /// On a CUDA device.
    Device(DeviceMemory),
}

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Memory::Host(h) => write!(f, "Memory::Host({} bytes)", h.len),
            Memory::Device(d) => write!(f, "Memory::{d:?}"),
        }
    }
}

impl Memory {
    /// The address of byte 0 (a device address on a GPU).
    pub fn ptr(&self) -> usize {
        match self {
            Memory::Host(h) => h.ptr(),
            Memory::Device(d) => d.ptr(),
        }
    }
}

/// Where one constant was placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// Its byte offset inside the allocation.
    pub offset: usize,
    /// Inductor's dtype name.
    pub dtype: String,
    /// The shape.
    pub shape: Vec<i64>,
}

/// Constants read and placed, ready to bind.
#[derive(Debug)]
pub struct Staged {
    /// The allocation.
    pub memory: Memory,
    /// Every non-computed constant of the table by fqn.
    pub placed: BTreeMap<String, Placed>,
    /// Provided names the table does not bind (declared, dropped), sorted.
    pub ignored: Vec<String>,
    /// Tensors skipped for lying outside `strip_prefix`.
    pub outside_prefix: usize,
    /// Bytes read.
    pub bytes: u64,
    /// `cuda_context`, `read_weights`, `copy_weights` (and `plan_weights`).
    pub timings: Timings,
}

fn too_large(message: String) -> Error {
    Error::new(Code::RunWeightsTooLarge, message)
}

fn gib(n: u64) -> String {
    format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64)
}

/// One contiguous range of a file that goes to `dst` in the allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The index of the source file.
    pub source: usize,
    /// The offset in the file.
    pub offset: u64,
    /// The length in bytes.
    pub len: usize,
    /// The offset in the allocation.
    pub dst: usize,
}

/// The host memory this process can still allocate, when known: the
/// smaller of what Linux says can be allocated without swapping
/// (`MemAvailable`, the node's) and what the process's memory cgroup leaves
/// ([`crate::cgroup`]: in a container, a Kubernetes pod, the node's figure
/// is not the process's).
fn host_available() -> Option<u64> {
    crate::cgroup::available(Path::new("/"))
}

/// Refuse `total` bytes of weights on `device` where its free memory (on
/// the host, [`host_available`]; on a GPU, the driver's `cuMemGetInfo`) is
/// less: the check `stage` makes, for a caller that allocates the memory
/// itself (the torch-based load reads into a `torch.empty` buffer).
pub fn check_fits(total: usize, device: Device) -> Result<()> {
    match device {
        Device::Cpu => check_capacity(total as u64, host_available(), "the host"),
        Device::Cuda(index) => {
            let (free, _) = Driver::get()?.context(index)?.memory()?;
            check_capacity(total as u64, Some(free as u64), &device.to_string())
        }
    }
}

/// Refuse `need` bytes where `available` (when known) is less.
pub fn check_capacity(need: u64, available: Option<u64>, place: &str) -> Result<()> {
    match available {
        Some(have) if need > have => Err(too_large(format!(
            "the weights need {} ({need} bytes) on {place}, which has {} available; free memory there or use a larger device",
            gib(need),
            gib(have)
        ))),
        _ => Ok(()),
    }
}

fn alias_mismatch(bound: &str, other: &str) -> Error {
    Error::new(
        Code::RunConstantMismatch,
        format!(
            "{bound:?} and {other:?} share storage in the exported program, but the weights hold different values for them"
        ),
    )
}

/// The aliases of `duplicates` (pairs of names of one alias group that the
/// weights both hold) must have one dtype and shape: checked from the
/// headers, before anything is read.
pub fn check_alias_headers(checkpoint: &Checkpoint, duplicates: &[(String, String)]) -> Result<()> {
    for (bound, other) in duplicates {
        let (Some((_, a)), Some((_, b))) = (checkpoint.entry(bound), checkpoint.entry(other))
        else {
            return Err(Error::new(
                Code::RunConstantMissing,
                format!("the weights lack {bound:?} or {other:?}"),
            ));
        };
        if a.dtype != b.dtype || a.shape != b.shape {
            return Err(alias_mismatch(bound, other));
        }
    }
    Ok(())
}

/// The aliases of `duplicates` must hold the same bytes: compared in bounded
/// chunks ([`Checkpoint::same_values`]), after the header and capacity checks.
pub fn check_alias_values(checkpoint: &Checkpoint, duplicates: &[(String, String)]) -> Result<()> {
    for (bound, other) in duplicates {
        if !checkpoint.same_values(bound, other)? {
            return Err(alias_mismatch(bound, other));
        }
    }
    Ok(())
}

/// A staging plan: every tensor to read checked from the headers, laid out
/// in one allocation, before a byte of data is read. Staging is its steps:
/// a plan ([`Plan::for_graph`]: what one graph binds; [`Plan::every_tensor`]:
/// a whole checkpoint, for a [`crate::weights_set::WeightsSet`]), then
/// [`Plan::allocate`] (the capacity check, the device's capability), then
/// [`Plan::read`] (alias values, the threaded reads and copies), then
/// [`Plan::hand_over`] (the [`Staged`] result).
pub struct Plan<'c> {
    // None for a plan of the literal payload alone.
    checkpoint: Option<&'c Checkpoint>,
    // The literal payload, read after the checkpoint's files (its index is
    // `checkpoint.sources().len()`).
    literal: Option<Source>,
    pieces: Vec<Piece>,
    placed: BTreeMap<String, Placed>,
    total: usize,
    bytes: u64,
    // Aliases both provided: their values are compared before the read.
    duplicates: Vec<(String, String)>,
    ignored: Vec<String>,
    timings: Timings,
}

impl std::fmt::Debug for Plan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("tensors", &self.placed.len())
            .field("total", &self.total)
            .finish_non_exhaustive()
    }
}

/// The allocation a plan reads into, and where the reads go.
pub struct Allocated {
    target: Target,
    memory: Memory,
}

impl std::fmt::Debug for Allocated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Allocated({:?})", self.memory)
    }
}

/// The literal payload at `literals` when `rows` has literal rows: it must
/// hold exactly those.
fn literal_payload(
    rows: &[ConstantRow],
    literals: Option<&Path>,
) -> Result<Option<(Source, BTreeMap<String, Entry>)>> {
    let literal_rows: BTreeSet<&str> = rows
        .iter()
        .filter(|r| r.source == ConstantSource::Literal)
        .map(|r| r.fqn.as_str())
        .collect();
    if literal_rows.is_empty() {
        return Ok(None);
    }
    let path = literals.ok_or_else(|| {
        Error::new(
            Code::RunLiteralPayload,
            "the graph has literal constants but no literal payload was given",
        )
    })?;
    let (source, entries) = Source::open(path, Code::RunLiteralPayload)?;
    let names: BTreeSet<&str> = entries.keys().map(String::as_str).collect();
    if names != literal_rows {
        return Err(Error::new(
            Code::RunLiteralPayload,
            format!("literal payload holds {names:?}, the graph declares {literal_rows:?}"),
        ));
    }
    Ok(Some((source, entries)))
}

/// `constant {fqn} is {dtype}{shape}, the graph was compiled for ...`: the
/// refusal of a tensor whose header does not match its row.
pub(crate) fn row_mismatch(row: &ConstantRow, name: &str, dtype: &str, shape: &[u64]) -> Error {
    let shown = if name == row.fqn {
        format!("{:?}", row.fqn)
    } else {
        format!("{:?} (bound from its alias {name:?})", row.fqn)
    };
    Error::new(
        Code::RunConstantMismatch,
        format!(
            "constant {shown} is {dtype}{shape:?}, the graph was compiled for {}{:?}",
            row.dtype, row.shape
        ),
    )
}

impl<'c> Plan<'c> {
    /// Plan what one graph binds: every constant of `rows` checked against
    /// the checkpoint by `contract` (and the literal rows against the literal
    /// payload) from the headers alone.
    pub fn for_graph(
        rows: &[ConstantRow],
        contract: &WeightsContract,
        checkpoint: &'c Checkpoint,
        literals: Option<&Path>,
    ) -> Result<Plan<'c>> {
        let started = Instant::now();
        let plan = contract.plan(checkpoint.names())?;
        // Aliases: their dtypes and shapes now, from the headers; their values
        // only after every other check and the capacity check (`read`).
        check_alias_headers(checkpoint, &plan.duplicates)?;
        let source_of: BTreeMap<&str, &str> = plan
            .bind
            .iter()
            .map(|(row, name)| (row.as_str(), name.as_str()))
            .collect();
        let literal = literal_payload(rows, literals)?;
        let literal_index = checkpoint.sources().len();
        // Every constant checked from the headers before a byte of data is read.
        let mut wanted: Vec<(&str, usize, &Entry)> = Vec::new();
        for row in rows.iter().filter(|r| r.source != ConstantSource::Computed) {
            let (name, source, entry) = match row.source {
                ConstantSource::Literal => {
                    let (_, entries) = literal.as_ref().expect("checked above");
                    (row.fqn.as_str(), literal_index, &entries[&row.fqn])
                }
                _ => {
                    let name = source_of.get(row.fqn.as_str()).copied().unwrap_or(&row.fqn);
                    let (source, entry) = checkpoint.entry(name).ok_or_else(|| {
                        Error::new(
                            Code::RunConstantMissing,
                            format!("the weights lack {name:?}"),
                        )
                    })?;
                    (name, source, entry)
                }
            };
            let shape: Vec<u64> = entry.shape.iter().map(|&d| d as u64).collect();
            if entry.dtype != row.dtype || shape != row.shape {
                return Err(row_mismatch(row, name, &entry.dtype, &shape));
            }
            wanted.push((row.fqn.as_str(), source, entry));
        }
        let laid = lay_out(wanted)?;
        let mut out = Plan::from_layout(Some(checkpoint), laid);
        out.literal = literal.map(|(s, _)| s);
        out.duplicates = plan.duplicates;
        out.ignored = plan.ignored;
        out.timings
            .push(("plan_weights", started.elapsed().as_secs_f64()));
        Ok(out)
    }

    /// Plan reading every tensor of `checkpoint` (by its graph names, after
    /// the naming's prefixes): what a weights set holds.
    pub fn every_tensor(checkpoint: &'c Checkpoint) -> Result<Plan<'c>> {
        let started = Instant::now();
        let mut wanted: Vec<(&str, usize, &Entry)> = Vec::new();
        for name in checkpoint.names() {
            let (source, entry) = checkpoint.entry(name).expect("a name of the checkpoint");
            wanted.push((name, source, entry));
        }
        let laid = lay_out(wanted)?;
        let mut out = Plan::from_layout(Some(checkpoint), laid);
        out.timings
            .push(("plan_weights", started.elapsed().as_secs_f64()));
        Ok(out)
    }

    /// Plan reading the literal rows of `rows` alone from the literal
    /// payload at `literals` (checked to hold exactly those): what a graph
    /// bound to a weights set owns itself. `None` when it has none.
    pub fn literals_only(
        rows: &[ConstantRow],
        literals: Option<&Path>,
    ) -> Result<Option<Plan<'c>>> {
        let started = Instant::now();
        let Some((source, entries)) = literal_payload(rows, literals)? else {
            return Ok(None);
        };
        let mut wanted: Vec<(&str, usize, &Entry)> = Vec::new();
        for row in rows.iter().filter(|r| r.source == ConstantSource::Literal) {
            let entry = &entries[&row.fqn];
            let shape: Vec<u64> = entry.shape.iter().map(|&d| d as u64).collect();
            if entry.dtype != row.dtype || shape != row.shape {
                return Err(row_mismatch(row, &row.fqn, &entry.dtype, &shape));
            }
            wanted.push((row.fqn.as_str(), 0, entry));
        }
        let laid = lay_out(wanted)?;
        let mut out = Plan::from_layout(None, laid);
        out.literal = Some(source);
        out.timings
            .push(("plan_weights", started.elapsed().as_secs_f64()));
        Ok(Some(out))
    }

    #[allow(clippy::type_complexity)]
    fn from_layout(
        checkpoint: Option<&'c Checkpoint>,
        (pieces, offsets, total): (Vec<Piece>, Vec<(&str, usize, &Entry)>, usize),
    ) -> Plan<'c> {
        let bytes: u64 = pieces.iter().map(|p| p.len as u64).sum();
        let placed: BTreeMap<String, Placed> = offsets
            .into_iter()
            .map(|(name, dst, entry)| {
                (
                    name.to_owned(),
                    Placed {
                        offset: dst,
                        dtype: entry.dtype.clone(),
                        shape: entry.shape.iter().map(|&d| d as i64).collect(),
                    },
                )
            })
            .collect();
        Plan {
            checkpoint,
            literal: None,
            pieces,
            placed,
            total,
            bytes,
            duplicates: Vec::new(),
            ignored: Vec::new(),
            timings: Vec::new(),
        }
    }

    /// Where each tensor goes, by name.
    pub fn placed(&self) -> &BTreeMap<String, Placed> {
        &self.placed
    }

    /// The allocation's size in bytes.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Allocate the plan's memory on `device` (`allocate_weights`; on a GPU
    /// `cuda_context` first): a CUDA device of another capability than `sm`
    /// (`sm_NN`; anything else checks none) and weights larger than the
    /// device's free memory are refused before anything is read.
    pub fn allocate(&mut self, device: Device, sm: &str) -> Result<Allocated> {
        let target = target_of(device, &mut self.timings)?;
        if let (Target::Device(context), Some(want)) =
            (target, tcg_core::artifact::package::cubin::sm_number(sm))
        {
            check_capability(device, sm, want, context.capability()?)?;
        }
        let t = Instant::now();
        let total = self.total;
        let memory = match target {
            Target::Host => {
                check_capacity(total as u64, host_available(), "the host")?;
                Memory::Host(HostMemory::new(total)?)
            }
            Target::Device(context) => {
                let (free, _) = context.memory()?;
                check_capacity(total as u64, Some(free as u64), &device.to_string())?;
                Memory::Device(DeviceMemory::new(context, total)?)
            }
        };
        self.timings
            .push(("allocate_weights", t.elapsed().as_secs_f64()));
        Ok(Allocated { target, memory })
    }

    /// Compare the values of aliases both provided, then read every tensor
    /// to its place (`read_weights`, `copy_weights`; on a GPU
    /// `staging_ring`), then refuse a file that changed while it was read.
    pub fn read(&mut self, into: &Allocated, readers: &Readers) -> Result<()> {
        let mut sources: Vec<&Source> = Vec::new();
        if let Some(checkpoint) = self.checkpoint {
            check_alias_values(checkpoint, &self.duplicates)?;
            sources.extend(checkpoint.sources());
        }
        if let Some(s) = &self.literal {
            sources.push(s);
        }
        read_pieces(
            into.target,
            &sources,
            &self.pieces,
            into.memory.ptr(),
            readers,
            &mut self.timings,
        )
    }

    /// The staged result: the allocation and where each tensor lies in it.
    pub fn hand_over(self, into: Allocated) -> Staged {
        Staged {
            memory: into.memory,
            placed: self.placed,
            ignored: self.ignored,
            outside_prefix: self.checkpoint.map_or(0, Checkpoint::skipped),
            bytes: self.bytes,
            timings: self.timings,
        }
    }
}

/// Check every constant of `rows` against the checkpoint (and the literal
/// payload), then read them into one allocation on `device`. `sm` is the
/// artifact's target (`cpu…` or `sm_NN`): a CUDA device of another
/// capability is refused before anything is read.
pub fn stage(
    rows: &[ConstantRow],
    contract: &WeightsContract,
    checkpoint: &Checkpoint,
    literals: Option<&Path>,
    device: Device,
    sm: &str,
    readers: &Readers,
) -> Result<Staged> {
    let mut plan = Plan::for_graph(rows, contract, checkpoint, literals)?;
    let into = plan.allocate(device, sm)?;
    plan.read(&into, readers)?;
    Ok(plan.hand_over(into))
}

/// Read the literal rows of `rows` (from the literal payload at `literals`)
/// into an allocation of their own on `device`: what a graph bound to a
/// weights set holds itself. `None` when the graph has no literal rows.
pub fn stage_literals(
    rows: &[ConstantRow],
    literals: Option<&Path>,
    device: Device,
    readers: &Readers,
) -> Result<Option<Staged>> {
    let Some(mut plan) = Plan::literals_only(rows, literals)? else {
        return Ok(None);
    };
    let into = plan.allocate(device, "")?;
    plan.read(&into, readers)?;
    Ok(Some(plan.hand_over(into)))
}

/// Read the tensors `names` of `checkpoint` (graph names) into memory the
/// caller allocated: `capacity` bytes at `base`, host memory for
/// [`Device::Cpu`], else device memory of that device (any allocation of the
/// device's primary context: torch's, for example). Returns where each
/// tensor went (offsets laid out as [`layout_of`] does) and the timings.
///
/// # Safety
/// `base..base + capacity` must be writable memory of `device` that nothing
/// else uses during the call.
pub unsafe fn read_to(
    checkpoint: &Checkpoint,
    names: &[String],
    base: usize,
    capacity: usize,
    device: Device,
) -> Result<(Vec<(String, usize)>, Timings)> {
    let (pieces, offsets, total) = layout_of(checkpoint, names)?;
    if total > capacity {
        return Err(Error::new(
            Code::RunWeightsInvalid,
            format!("the weights need {total} bytes, the buffer holds {capacity}"),
        ));
    }
    let sources: Vec<&Source> = checkpoint.sources().iter().collect();
    let mut timings: Timings = Vec::new();
    let readers = Readers::spawn(reader_threads())?;
    let target = target_of(device, &mut timings)?;
    read_pieces(target, &sources, &pieces, base, &readers, &mut timings)?;
    Ok((offsets, timings))
}

/// Where the pieces of a read go.
#[derive(Clone, Copy)]
enum Target {
    /// Host memory.
    Host,
    /// Device memory of this context.
    Device(Context),
}

/// Where a read for `device` goes: the host, or the primary context of the
/// CUDA device, its creation timed (`cuda_context`).
fn target_of(device: Device, timings: &mut Timings) -> Result<Target> {
    let Device::Cuda(index) = device else {
        return Ok(Target::Host);
    };
    let t = Instant::now();
    let context = Driver::get()?.context(index)?;
    timings.push(("cuda_context", t.elapsed().as_secs_f64()));
    Ok(Target::Device(context))
}

/// Read `pieces` to `base` on `target` (`read_weights`, `copy_weights`), then
/// refuse a source that changed while it was read.
fn read_pieces(
    target: Target,
    sources: &[&Source],
    pieces: &[Piece],
    base: usize,
    readers: &Readers,
    timings: &mut Timings,
) -> Result<()> {
    let (read, copy) = match target {
        Target::Host => {
            let t = Instant::now();
            read_host(sources, pieces, base, readers)?;
            (t.elapsed().as_secs_f64(), 0.0)
        }
        Target::Device(context) => {
            let (ring, read, copy) = read_device(context, sources, pieces, base, readers)?;
            timings.push(("staging_ring", ring));
            (read, copy)
        }
    };
    timings.push(("read_weights", read));
    timings.push(("copy_weights", copy));
    for s in sources {
        s.check_unchanged()?;
    }
    Ok(())
}

/// The pieces to read, each name's offset, and the allocation's size.
pub type Layout = (Vec<Piece>, Vec<(String, usize)>, usize);

/// The layout of the tensors `names` of `checkpoint` in one allocation (file
/// order, [`ALIGN`]ed): the pieces to read, each name's offset, and the
/// allocation's size. A name the checkpoint lacks is `run.constant_missing`.
pub fn layout_of(checkpoint: &Checkpoint, names: &[String]) -> Result<Layout> {
    let mut wanted = Vec::with_capacity(names.len());
    for name in names {
        let (source, entry) = checkpoint.entry(name).ok_or_else(|| {
            Error::new(
                Code::RunConstantMissing,
                format!("the weights lack {name:?}"),
            )
        })?;
        wanted.push((name, source, entry));
    }
    let (pieces, offsets, total) = lay_out(wanted)?;
    let offsets = offsets
        .into_iter()
        .map(|(name, dst, _)| (name.clone(), dst))
        .collect();
    Ok((pieces, offsets, total))
}

/// Where each `(name, source, entry)` goes in one allocation: in file order
/// (reads run forward through each file), each [`ALIGN`]ed. Returns the
/// pieces to read, each name's offset, and the allocation's size.
#[allow(clippy::type_complexity)]
fn lay_out<'n, 'e, N: ?Sized>(
    mut wanted: Vec<(&'n N, usize, &'e Entry)>,
) -> Result<(Vec<Piece>, Vec<(&'n N, usize, &'e Entry)>, usize)> {
    wanted.sort_by_key(|(_, source, entry)| (*source, entry.offset));
    let mut pieces = Vec::with_capacity(wanted.len());
    let mut offsets = Vec::with_capacity(wanted.len());
    let mut total = 0usize;
    for (name, source, entry) in wanted {
        let dst = total;
        total = entry
            .len
            .checked_next_multiple_of(ALIGN)
            .and_then(|padded| total.checked_add(padded))
            .ok_or_else(|| too_large("the weights do not fit in an address space".into()))?;
        if entry.len > 0 {
            pieces.push(Piece {
                source,
                offset: entry.offset,
                len: entry.len,
                dst,
            });
        }
        offsets.push((name, dst, entry));
    }
    Ok((pieces, offsets, total))
}

/// The parts of `pieces` no longer than `max` each: `(piece, offset in it, length)`.
fn parts(pieces: &[Piece], max: usize) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        let mut at = 0;
        while at < p.len {
            let n = (p.len - at).min(max);
            out.push((i, at, n));
            at += n;
        }
    }
    out
}

/// The first error any thread hit; later ones are dropped.
struct FirstError(Mutex<Option<Error>>, AtomicBool);

impl FirstError {
    fn new() -> FirstError {
        FirstError(Mutex::new(None), AtomicBool::new(false))
    }
    fn set(&self, e: Error) {
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
        self.1.store(true, Ordering::SeqCst);
    }
    fn failed(&self) -> bool {
        self.1.load(Ordering::SeqCst)
    }
    fn take(self) -> Option<Error> {
        self.0.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

/// Read `pieces` of `sources` straight into host memory at `base` on the
/// reader threads.
fn read_host(sources: &[&Source], pieces: &[Piece], base: usize, readers: &Readers) -> Result<()> {
    let parts = parts(pieces, SLOT_BYTES * 4);
    let next = AtomicUsize::new(0);
    let error = FirstError::new();
    readers.run(&|| loop {
        if error.failed() {
            return;
        }
        let k = next.fetch_add(1, Ordering::Relaxed);
        let Some(&(i, at, n)) = parts.get(k) else {
            return;
        };
        let p = pieces[i];
        // SAFETY: `[p.dst + at, p.dst + at + n)` lies inside the allocation
        // (laid out by `stage`), and no two parts overlap, so each thread
        // writes bytes no other thread touches.
        let buf = unsafe { std::slice::from_raw_parts_mut((base + p.dst + at) as *mut u8, n) };
        if let Err(e) = sources[p.source].read_at(buf, p.offset + at as u64) {
            error.set(e);
        }
    })?;
    match error.take() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// One pinned buffer's worth of reading: a file range and where its parts go.
struct Chunk {
    source: usize,
    offset: u64,
    len: usize,
    /// `(offset in the buffer, length, offset in the allocation)`.
    copies: Vec<(usize, usize, usize)>,
}

/// Group the pieces into chunks of at most `max` bytes: consecutive pieces of
/// one file that lie close together share a read (the bytes between them,
/// at most `GAP`, are read and dropped).
fn chunks(pieces: &[Piece], max: usize) -> Vec<Chunk> {
    const GAP: u64 = 64 << 10;
    let mut out: Vec<Chunk> = Vec::new();
    for (i, at, n) in parts(pieces, max) {
        let p = pieces[i];
        let offset = p.offset + at as u64;
        let dst = p.dst + at;
        if let Some(c) = out.last_mut() {
            let end = c.offset + c.len as u64;
            if c.source == p.source
                && offset >= end
                && offset - end <= GAP
                && (offset - c.offset) as usize + n <= max
            {
                let in_buf = (offset - c.offset) as usize;
                c.copies.push((in_buf, n, dst));
                c.len = in_buf + n;
                continue;
            }
        }
        out.push(Chunk {
            source: p.source,
            offset,
            len: n,
            copies: vec![(0, n, dst)],
        });
    }
    out
}

/// Free ring slots, handed out to reader threads.
struct Ring {
    free: Mutex<Vec<usize>>,
    ready: Condvar,
}

impl Ring {
    fn take(&self) -> usize {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(slot) = free.pop() {
                return slot;
            }
            free = self.ready.wait(free).unwrap_or_else(|p| p.into_inner());
        }
    }
    fn give(&self, slot: usize) {
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(slot);
        self.ready.notify_one();
    }
}

/// Read `pieces` through a ring of pinned buffers and copy each to `memory`
/// on a copy stream while the next is read. Each slot's pinned buffer is
/// allocated by the first reader that takes the slot, so the first reads
/// start after one slot's allocation, not the whole ring's (pinning is paid
/// beside the reads and copies). Returns the seconds setting up the ring
/// took (stream, events), the seconds until every read was done and the
/// copies queued, and the seconds the copies took after that.
fn read_device(
    context: Context,
    sources: &[&Source],
    pieces: &[Piece],
    base: usize,
    readers: &Readers,
) -> Result<(f64, f64, f64)> {
    let t = Instant::now();
    let chunks = chunks(pieces, SLOT_BYTES);
    let slots = (2 * readers.len()).min(chunks.len()).max(1);
    let stream = Stream::new(context)?;
    let events = (0..slots)
        .map(|_| Event::new(context))
        .collect::<Result<Vec<_>>>()?;
    // One pinned buffer per slot, made when the slot is first taken.
    let pinned: Vec<OnceLock<PinnedMemory>> = (0..slots).map(|_| OnceLock::new()).collect();
    let ring = Ring {
        free: Mutex::new((0..slots).collect()),
        ready: Condvar::new(),
    };
    let next = AtomicUsize::new(0);
    let error = FirstError::new();
    let ring_s = t.elapsed().as_secs_f64();
    let started = Instant::now();
    let ran = readers.run(&|| {
        if let Err(e) = context.make_current() {
            error.set(e);
            return;
        }
        loop {
            if error.failed() {
                return;
            }
            let k = next.fetch_add(1, Ordering::Relaxed);
            let Some(chunk) = chunks.get(k) else {
                return;
            };
            let slot = ring.take();
            let done = (|| -> Result<()> {
                // The copies queued from this slot last time are done.
                events[slot].synchronize()?;
                // The slot is this thread's alone until given back: no other
                // thread makes its buffer meanwhile.
                let buffer = match pinned[slot].get() {
                    Some(buffer) => buffer,
                    None => {
                        let fresh = PinnedMemory::new(context, SLOT_BYTES)?;
                        pinned[slot].get_or_init(|| fresh)
                    }
                };
                let buf_addr = buffer.ptr() as usize;
                // SAFETY: the slot is this thread's alone until given back,
                // and the copies that read it have completed.
                let buf = unsafe { std::slice::from_raw_parts_mut(buf_addr as *mut u8, chunk.len) };
                sources[chunk.source].read_at(buf, chunk.offset)?;
                for &(in_buf, len, dst) in &chunk.copies {
                    // SAFETY: the source is pinned memory of this slot, not
                    // written again before `events[slot]` (recorded below)
                    // completes; `dst..dst+len` lies inside the allocation
                    // (laid out by the caller).
                    unsafe { stream.copy(base + dst, (buf_addr + in_buf) as *const u8, len)? };
                }
                events[slot].record(&stream)
            })();
            ring.give(slot);
            if let Err(e) = done {
                error.set(e);
                return;
            }
        }
    });
    let read = started.elapsed().as_secs_f64();
    let synced = stream.synchronize();
    let copy = started.elapsed().as_secs_f64() - read;
    if let Some(e) = error.take() {
        return Err(e);
    }
    ran?;
    synced?;
    Ok((ring_s, read, copy))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(source: usize, offset: u64, len: usize, dst: usize) -> Piece {
        Piece {
            source,
            offset,
            len,
            dst,
        }
    }

    #[test]
    fn chunks_share_reads_of_close_pieces_and_split_large_ones() {
        let pieces = [
            piece(0, 100, 10, 0),
            piece(0, 120, 10, 256),
            piece(0, 10_000_000, 10, 512),
            piece(1, 0, 25, 768),
        ];
        let c = chunks(&pieces, 16);
        // 100..110 and 120..130 cannot share a 16-byte read; 25 bytes split.
        let shape: Vec<(usize, u64, usize, usize)> = c
            .iter()
            .map(|c| (c.source, c.offset, c.len, c.copies.len()))
            .collect();
        assert_eq!(
            shape,
            vec![
                (0, 100, 10, 1),
                (0, 120, 10, 1),
                (0, 10_000_000, 10, 1),
                (1, 0, 16, 1),
                (1, 16, 9, 1)
            ]
        );
        let c = chunks(&pieces, 64);
        assert_eq!(c[0].len, 30);
        assert_eq!(c[0].copies, vec![(0, 10, 0), (20, 10, 256)]);
        assert_eq!(c.len(), 3);
        // Every byte of every piece lands exactly once.
        for max in [1, 3, 7, 16, 64, 1 << 20] {
            let mut seen: BTreeMap<usize, usize> = BTreeMap::new();
            for c in chunks(&pieces, max) {
                assert!(c.len <= max);
                for (in_buf, len, dst) in c.copies {
                    assert!(in_buf + len <= c.len);
                    for b in dst..dst + len {
                        *seen.entry(b).or_default() += 1;
                    }
                }
            }
            let want: usize = pieces.iter().map(|p| p.len).sum();
            assert_eq!(seen.len(), want);
            assert!(seen.values().all(|&n| n == 1));
        }
    }

    #[test]
    fn readers_run_every_job_on_every_thread_and_report_a_panic() {
        let readers = Readers::spawn(3).unwrap();
        let count = AtomicUsize::new(0);
        for _ in 0..5 {
            readers
                .run(&|| {
                    count.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
        }
        assert_eq!(count.load(Ordering::SeqCst), 15);
        let err = readers.run(&|| panic!("a bug in a reader")).unwrap_err();
        assert_eq!(err.code(), Code::RunExecutionFailed);
        // The threads survive the panic and run the next job.
        readers
            .run(&|| {
                count.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 18);
    }

    #[test]
    fn capacity_is_refused_with_its_own_code() {
        check_capacity(10, Some(10), "the host").unwrap();
        check_capacity(10, None, "the host").unwrap();
        let err = check_capacity(11 << 30, Some(10 << 30), "cuda:0").unwrap_err();
        assert_eq!(err.code(), Code::RunWeightsTooLarge);
        assert!(err.message().contains("cuda:0"), "{err}");
    }

    use crate::weights::Naming;
    use tcg_core::artifact::metadata::{ConstantRow, ConstantSource};

    /// A safetensors file of float32 tensors `(name, len)`, element `i` of
    /// tensor `k` being `k * 1000 + i`, in the order given.
    fn write(path: &Path, tensors: &[(&str, usize)]) {
        let mut header = String::from("{");
        let mut at = 0usize;
        let mut data = Vec::new();
        for (k, (name, len)) in tensors.iter().enumerate() {
            if k > 0 {
                header.push(',');
            }
            header.push_str(&format!(
                r#""{name}":{{"dtype":"F32","shape":[{len}],"data_offsets":[{at},{}]}}"#,
                at + 4 * len
            ));
            at += 4 * len;
            for i in 0..*len {
                data.extend_from_slice(&((k * 1000 + i) as f32).to_le_bytes());
            }
        }
        header.push('}');
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&data);
        std::fs::write(path, bytes).unwrap();
    }

    fn row(fqn: &str, len: u64) -> ConstantRow {
        ConstantRow {
            fqn: fqn.into(),
            source: ConstantSource::StateDict,
            dtype: "float32".into(),
            shape: vec![len],
        }
    }

    #[test]
    fn staging_reads_every_constant_to_its_place_with_any_thread_count() {
        let d = tempfile::tempdir().unwrap();
        // Odd lengths (unaligned in the file), two files, a name not bound.
        write(
            &d.path().join("a.safetensors"),
            &[("x", 3), ("skip", 5), ("y", 1_000_001)],
        );
        write(&d.path().join("b.safetensors"), &[("z", 7)]);
        let rows = vec![row("x", 3), row("y", 1_000_001), row("z", 7)];
        let contract = WeightsContract::from_rows(&rows);
        let checkpoint = Checkpoint::open(
            &[
                d.path().join("a.safetensors"),
                d.path().join("b.safetensors"),
            ],
            &Naming::default(),
        )
        .unwrap();
        let sources: Vec<&Source> = checkpoint.sources().iter().collect();
        let names: Vec<String> = ["x", "y", "z"].iter().map(|s| s.to_string()).collect();
        let (pieces, offsets, total) = layout_of(&checkpoint, &names).unwrap();
        for threads in [1, 2, 5, 16] {
            let memory = HostMemory::new(total).unwrap();
            let readers = Readers::spawn(threads).unwrap();
            read_host(&sources, &pieces, memory.ptr(), &readers).unwrap();
            for (name, offset) in &offsets {
                assert_eq!(offset % ALIGN, 0);
                let (i, e) = checkpoint.entry(name).unwrap();
                let want = checkpoint.sources()[i].read_entry(e).unwrap();
                // SAFETY: inside the allocation, written by read_host above.
                let got = unsafe {
                    std::slice::from_raw_parts((memory.ptr() + offset) as *const u8, e.len)
                };
                assert_eq!(got, want.as_slice(), "{name} with {threads} threads");
            }
        }
        // The whole stage: `skip` is not in the table, so it is foreign.
        let err = stage(
            &rows,
            &contract,
            &checkpoint,
            None,
            Device::Cpu,
            "cpu",
            &Readers::spawn(2).unwrap(),
        )
        .unwrap_err();
        assert_eq!(err.code(), Code::RunConstantUnexpected, "{err}");
        let mut with_skip = rows.clone();
        with_skip.push(row("skip", 5));
        let contract = WeightsContract::from_rows(&with_skip);
        let staged = stage(
            &with_skip,
            &contract,
            &checkpoint,
            None,
            Device::Cpu,
            "cpu",
            &Readers::spawn(3).unwrap(),
        )
        .unwrap();
        assert_eq!(staged.placed.len(), 4);
        assert_eq!(staged.bytes, 4 * (3 + 5 + 1_000_001 + 7));
        let y = &staged.placed["y"];
        // SAFETY: inside the staged allocation.
        let last = unsafe { *((staged.memory.ptr() + y.offset + 4 * 1_000_000) as *const [u8; 4]) };
        assert_eq!(f32::from_le_bytes(last), (2 * 1000 + 1_000_000) as f32);
        let phases: Vec<&str> = staged.timings.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            phases,
            [
                "plan_weights",
                "allocate_weights",
                "read_weights",
                "copy_weights"
            ]
        );
    }

    #[test]
    fn a_plan_of_every_tensor_and_one_of_the_literals_alone_share_the_steps() {
        let d = tempfile::tempdir().unwrap();
        write(&d.path().join("w.safetensors"), &[("a.x", 3), ("b.y", 5)]);
        write(&d.path().join("lit.safetensors"), &[("t", 4)]);
        let naming = Naming {
            strip_prefix: "a.".into(),
            add_prefix: "m.".into(),
        };
        let checkpoint = Checkpoint::open(&[d.path().join("w.safetensors")], &naming).unwrap();
        // Every tensor of the checkpoint, by its mapped name; `b.y` lies outside.
        let mut plan = Plan::every_tensor(&checkpoint).unwrap();
        assert_eq!(plan.placed().keys().collect::<Vec<_>>(), ["m.x"]);
        let into = plan.allocate(Device::Cpu, "").unwrap();
        plan.read(&into, &Readers::spawn(2).unwrap()).unwrap();
        let staged = plan.hand_over(into);
        assert_eq!((staged.bytes, staged.outside_prefix), (12, 1));
        // SAFETY: inside the staged allocation.
        let third = unsafe { *((staged.memory.ptr() + 8) as *const [u8; 4]) };
        assert_eq!(f32::from_le_bytes(third), 2.0);
        // The literal rows alone, from the literal payload; none: nothing.
        let mut literal = row("t", 4);
        literal.source = ConstantSource::Literal;
        let rows = vec![row("m.x", 3), literal];
        let lit = d.path().join("lit.safetensors");
        let readers = Readers::spawn(1).unwrap();
        let staged = stage_literals(&rows, Some(&lit), Device::Cpu, &readers)
            .unwrap()
            .unwrap();
        assert_eq!(staged.placed.keys().collect::<Vec<_>>(), ["t"]);
        assert_eq!(staged.bytes, 16);
        assert!(
            stage_literals(&rows[..1], Some(&lit), Device::Cpu, &readers)
                .unwrap()
                .is_none()
        );
        let err = stage_literals(&rows, None, Device::Cpu, &readers).unwrap_err();
        assert_eq!(err.code(), Code::RunLiteralPayload, "{err}");
        // A literal of another shape than its row: the mismatch of files.
        let mut wrong = row("t", 5);
        wrong.source = ConstantSource::Literal;
        let err = stage_literals(&[wrong], Some(&lit), Device::Cpu, &readers).unwrap_err();
        assert_eq!(err.code(), Code::RunConstantMismatch, "{err}");
    }

    #[test]
    fn weights_larger_than_the_memory_are_refused_before_anything_is_read() {
        let d = tempfile::tempdir().unwrap();
        // A sparse file of 1 TiB of float32 zeros: more than any test host has.
        let len: u64 = 1 << 38;
        let header = format!(
            r#"{{"w":{{"dtype":"F32","shape":[{len}],"data_offsets":[0,{}]}}}}"#,
            4 * len
        );
        let path = d.path().join("huge.safetensors");
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(bytes.len() as u64 + 4 * len).unwrap();
        let rows = vec![row("w", len)];
        let contract = WeightsContract::from_rows(&rows);
        let checkpoint = Checkpoint::open(&[path], &Naming::default()).unwrap();
        // Refused from the header (the capacity check comes before any read).
        let err = stage(
            &rows,
            &contract,
            &checkpoint,
            None,
            Device::Cpu,
            "cpu",
            &Readers::spawn(2).unwrap(),
        )
        .unwrap_err();
        assert_eq!(err.code(), Code::RunWeightsTooLarge, "{err}");
        assert!(err.message().contains("the host"), "{err}");
    }

    /// A sparse safetensors file of float32 tensors `(name, elements)`
    /// (zeros that take no disk), in the order given.
    fn sparse(path: &Path, tensors: &[(&str, u64)]) {
        let mut at = 0u64;
        let parts: Vec<String> = tensors
            .iter()
            .map(|(name, n)| {
                let part = format!(
                    r#""{name}":{{"dtype":"F32","shape":[{n}],"data_offsets":[{at},{}]}}"#,
                    at + 4 * n
                );
                at += 4 * n;
                part
            })
            .collect();
        let header = format!("{{{}}}", parts.join(","));
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        std::fs::write(path, &bytes).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.set_len(bytes.len() as u64 + at).unwrap();
    }

    /// A contract whose table binds `w` (tied to `w_tied`) and `x`.
    fn tied(rows: &[ConstantRow]) -> WeightsContract {
        let facts = tcg_cj::parse_strict(
            br#"{"kinds":{"w":"parameter","w_tied":"parameter","x":"parameter"},"alias_groups":[["w","w_tied"]]}"#,
        )
        .unwrap();
        let declared = ["w", "w_tied", "x"].iter().map(|s| s.to_string()).collect();
        WeightsContract::from_facts(&facts, &declared, rows).unwrap()
    }

    fn stage_cpu(
        rows: &[ConstantRow],
        contract: &WeightsContract,
        c: &Checkpoint,
    ) -> Result<Staged> {
        stage(
            rows,
            contract,
            c,
            None,
            Device::Cpu,
            "cpu",
            &Readers::spawn(2).unwrap(),
        )
    }

    #[test]
    fn tied_aliases_are_read_only_after_every_header_check_and_the_capacity_check() {
        let d = tempfile::tempdir().unwrap();
        let big: u64 = 1 << 26; // 256 MiB a tensor, sparse
        let rows = vec![row("w", big), row("x", 4)];
        let contract = tied(&rows);
        // Another constant's shape is wrong: refused from the headers, with
        // not one byte of the tied pair read (it was read twice in full first).
        let p = d.path().join("a.safetensors");
        sparse(&p, &[("w", big), ("w_tied", big), ("x", 5)]);
        let c = Checkpoint::open(&[p], &Naming::default()).unwrap();
        let err = stage_cpu(&rows, &contract, &c).unwrap_err();
        assert_eq!(err.code(), Code::RunConstantMismatch, "{err}");
        assert!(err.message().contains("\"x\""), "{err}");
        assert_eq!(c.bytes_read(), 0);
        // Aliases of different shapes: refused from the headers too.
        let p = d.path().join("b.safetensors");
        sparse(&p, &[("w", big), ("w_tied", big - 1), ("x", 4)]);
        let c = Checkpoint::open(&[p], &Naming::default()).unwrap();
        let err = stage_cpu(&rows, &contract, &c).unwrap_err();
        assert_eq!(err.code(), Code::RunConstantMismatch, "{err}");
        assert!(err.message().contains("share storage"), "{err}");
        assert_eq!(c.bytes_read(), 0);
        // More than any host holds: the capacity check, still nothing read.
        let huge: u64 = 1 << 38;
        let rows_huge = vec![row("w", huge), row("x", 4)];
        let p = d.path().join("c.safetensors");
        sparse(&p, &[("w", huge), ("w_tied", huge), ("x", 4)]);
        let c = Checkpoint::open(&[p], &Naming::default()).unwrap();
        let err = stage_cpu(&rows_huge, &tied(&rows_huge), &c).unwrap_err();
        assert_eq!(err.code(), Code::RunWeightsTooLarge, "{err}");
        assert_eq!(c.bytes_read(), 0);
    }

    #[test]
    fn tied_aliases_with_different_values_are_refused_and_equal_ones_bind_once() {
        let d = tempfile::tempdir().unwrap();
        let rows = vec![row("w", 300_000), row("x", 3)];
        let contract = tied(&rows);
        // `write` numbers each tensor's elements from its position: w and
        // w_tied differ.
        let p = d.path().join("differ.safetensors");
        write(&p, &[("w", 300_000), ("w_tied", 300_000), ("x", 3)]);
        let c = Checkpoint::open(&[p], &Naming::default()).unwrap();
        let err = stage_cpu(&rows, &contract, &c).unwrap_err();
        assert_eq!(err.code(), Code::RunConstantMismatch, "{err}");
        assert!(err.message().contains("share storage"), "{err}");
        // Equal values (both zeros): staged, the table's one row read once.
        let p = d.path().join("same.safetensors");
        sparse(&p, &[("w", 300_000), ("w_tied", 300_000), ("x", 3)]);
        let c = Checkpoint::open(&[p], &Naming::default()).unwrap();
        let staged = stage_cpu(&rows, &contract, &c).unwrap();
        assert_eq!(staged.placed.len(), 2);
        assert_eq!(staged.bytes, 4 * (300_000 + 3));
        // Compared (both aliases) and then read (the bound one).
        assert_eq!(c.bytes_read(), 4 * (3 * 300_000 + 3));
    }
}
