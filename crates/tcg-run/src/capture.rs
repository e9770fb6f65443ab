//! CUDA-graph replay on the native path (`load_native`, Rust `Served`).
//!
//! At batch 1 a compiled graph spends most of its time launching kernels. A
//! CUDA graph records the launches of one run and replays them with one
//! launch. Per *shape set* (the dtype and shape of every input), after
//! [`WARMUP_RUNS`] uncaptured calls the container's single-threaded run is
//! captured once on the graph's own stream, reading static input buffers the
//! graph owns; later calls copy their inputs into those buffers, replay, and
//! copy the outputs into fresh tensors the caller owns (a call's outputs are
//! never overwritten by a later call).
//!
//! **Memory.** A captured graph keeps reading and writing the addresses it was
//! captured with, so those blocks must never be handed to other work between
//! replays. The native path has no torch to keep a private pool, so captures
//! need libtorch's stream-ordered allocator (its `cudaMallocAsync` backend):
//! every allocation the run makes while captured becomes a memory node of the
//! CUDA graph, owned by the graph for its lifetime (instantiated with
//! auto-free-on-launch, at a fixed address). [`prepare_allocator`] selects that
//! backend when this process has not loaded libtorch's CUDA library yet and
//! the environment does not configure an allocator; otherwise, with libtorch's
//! caching allocator active, calls are not captured (the reason is reported).
//!
//! **Streams.** Captures, their priming run and replays run on a stream of the
//! graph's own, ordered after the caller's stream (an event) and before it
//! again once the outputs are copied: any caller stream works, the legacy
//! default stream included, and the caller's later work sees the outputs.
//!
//! **Bindings.** A capture reads the constants it was captured with, by
//! address: every bind bumps the graph's binding generation, and a call that
//! sees another generation drops every capture (and warms up again, since the
//! next run folds constants) before running.
//!
//! Fallbacks (the reason in [`CaptureStats`] and on stderr under
//! `TORCH_COMPILED_GRAPHS_DEBUG`): a runtime without the single-threaded run
//! or the CUDA graph functions, the caching allocator, a capture that fails
//! (the graph synchronises the host inside its run, or calls something a
//! capture cannot hold). A failed capture turns captures off for the graph;
//! its calls run uncaptured from then on, with the same results.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tcg_core::{Code, Error, Result};

use crate::cuda::{Cuda, Device, GraphApi};
use crate::graph::{Graph, Input};
use crate::torch::{BorrowedTensor, Dtype, OwnedTensor, TensorHandle, Torch};

/// Uncaptured calls of a shape set before it is captured: the first run after
/// a bind folds constants, and kernels, cuBLAS handles and workspaces are made
/// on first use; none of it may happen under capture.
pub const WARMUP_RUNS: u32 = 2;
/// Shape sets captured at once per graph, by default.
pub const MAX_CAPTURES: usize = 8;
/// `0` (or `false`, `no`, `off`) turns CUDA graphs off where the caller does
/// not say; the variable `load()` reads too.
pub const ENV_CUDA_GRAPHS: &str = "TORCH_COMPILED_GRAPHS_CUDA_GRAPHS";
/// The default bound of captured shape sets where the caller does not say.
pub const ENV_MAX_CAPTURES: &str = "TORCH_COMPILED_GRAPHS_MAX_CAPTURES";
/// Shape sets whose warm-up count is remembered (a graph called with ever new
/// shapes must not grow without bound).
const WARM_REMEMBERED: usize = 64;
/// `cudaStreamNonBlocking`: the graph's stream does not wait for the legacy
/// default stream implicitly (calls order it explicitly).
const STREAM_NON_BLOCKING: u32 = 1;
/// `cudaStreamCaptureModeThreadLocal`: other threads keep working while one
/// graph captures.
const CAPTURE_THREAD_LOCAL: i32 = 1;
/// `cudaGraphInstantiateFlagAutoFreeOnLaunch`: the outputs a replay leaves
/// allocated are freed (and allocated again, at the same address) by the next.
const AUTO_FREE_ON_LAUNCH: u64 = 1;
/// `cudaMemcpyDefault`: the direction follows from the (unified) addresses.
const MEMCPY_DEFAULT: i32 = 4;
/// The variable libtorch's CUDA allocator reads first, then the generic one.
const ALLOC_CONF: [&str; 2] = ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"];

/// One capture at a time in the process (captures of several graphs on
/// several threads would otherwise interleave allocator state).
static CAPTURE_LOCK: Mutex<()> = Mutex::new(());

/// What a replayed call hands back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Outputs {
    /// New tensors holding a copy of the replay's outputs: never overwritten
    /// by a later call (the default).
    #[default]
    Copy,
    /// The capture's own output buffers, without a copy: valid until the
    /// graph's next call (of any shape), which may overwrite them.
    Static,
}

/// Whether and how much a graph's calls are captured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureOptions {
    /// Capture at all (`cuda_graphs`).
    pub enabled: bool,
    /// Shape sets captured at once (least recently used out); 0 captures none.
    pub max_captures: usize,
}

impl Default for CaptureOptions {
    fn default() -> Self {
        CaptureOptions {
            enabled: true,
            max_captures: MAX_CAPTURES,
        }
    }
}

fn option_invalid(message: String) -> Error {
    Error::new(Code::RunOptionInvalid, message)
}

impl CaptureOptions {
    /// The options the environment states ([`ENV_CUDA_GRAPHS`],
    /// [`ENV_MAX_CAPTURES`]), else the defaults (on, [`MAX_CAPTURES`]); an
    /// invalid value is `run.option_invalid`.
    pub fn from_env() -> Result<CaptureOptions> {
        let flag = std::env::var(ENV_CUDA_GRAPHS).ok();
        let count = std::env::var(ENV_MAX_CAPTURES).ok();
        CaptureOptions::from_values(flag.as_deref(), count.as_deref())
    }

    /// The options from the two variables' values (`None`: unset).
    pub fn from_values(flag: Option<&str>, count: Option<&str>) -> Result<CaptureOptions> {
        let mut options = CaptureOptions::default();
        if let Some(v) = flag.map(str::trim).filter(|v| !v.is_empty()) {
            options.enabled = match v.to_ascii_lowercase().as_str() {
                "0" | "false" | "no" | "off" => false,
                "1" | "true" | "yes" | "on" => true,
                _ => {
                    return Err(option_invalid(format!(
                        "{ENV_CUDA_GRAPHS}={v:?}: use 0 or 1"
                    )))
                }
            };
        }
        if let Some(v) = count.map(str::trim).filter(|v| !v.is_empty()) {
            options.max_captures = v.parse::<usize>().map_err(|_| {
                option_invalid(format!(
                    "{ENV_MAX_CAPTURES}={v:?}: a number of captures (0 or more)"
                ))
            })?;
        }
        Ok(options)
    }
}

/// What the captures of one graph did so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CaptureStats {
    /// Shape sets captured.
    pub captures: u64,
    /// Calls answered by a replay (the capturing call included: it launches
    /// its capture once), as `load()` counts them.
    pub replays: u64,
    /// Captures dropped for the bound (least recently used).
    pub evictions: u64,
    /// Captures dropped because the graph was bound again.
    pub invalidated: u64,
    /// Captures given up (a capture failed): calls run uncaptured since.
    pub fallbacks: u64,
    /// Seconds spent capturing (priming run, capture, instantiation, first launch).
    pub capture_seconds: f64,
    /// The last capture's seconds.
    pub last_capture_seconds: Option<f64>,
    /// Calls that ran uncaptured while captures were on (warm-ups).
    pub uncaptured_runs: u64,
    /// Shape sets captured now.
    pub captured: u64,
}

/// Which libtorch CUDA allocator this process uses, as far as the native path
/// can tell: the configuration libtorch reads when its CUDA library loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allocator {
    /// `backend:cudaMallocAsync`: captures are safe.
    StreamOrdered,
    /// The caching allocator (`backend:native`, the default): its capture
    /// pools have no C entry point, so calls are not captured.
    Caching(String),
}

/// The backend a configuration string (`key:value,key:value`) selects.
fn backend_of(conf: &str) -> Option<&str> {
    conf.split(',').find_map(|kv| {
        let (k, v) = kv.split_once(':')?;
        (k.trim() == "backend").then_some(v.trim())
    })
}

/// The allocator the environment values of [`ALLOC_CONF`] select (libtorch
/// reads the first one set).
pub fn allocator_from(values: [Option<&str>; 2]) -> Allocator {
    let Some((name, conf)) = ALLOC_CONF
        .iter()
        .zip(values)
        .find_map(|(n, v)| v.map(|v| (*n, v)))
    else {
        return Allocator::Caching("libtorch's caching allocator is the default".into());
    };
    match backend_of(conf) {
        Some("cudaMallocAsync") => Allocator::StreamOrdered,
        Some(other) => Allocator::Caching(format!("{name} selects the {other} allocator")),
        None => Allocator::Caching(format!(
            "{name} is set without a backend (libtorch's caching allocator)"
        )),
    }
}

fn env_values() -> [Option<String>; 2] {
    ALLOC_CONF.map(|n| std::env::var(n).ok())
}

/// The allocator this process's configuration selects.
pub fn allocator() -> Allocator {
    let [a, b] = env_values();
    allocator_from([a.as_deref(), b.as_deref()])
}

/// Whether libtorch's CUDA allocator (`libc10_cuda.so`) is loaded in this process.
fn c10_cuda_loaded() -> bool {
    let name = c"libc10_cuda.so";
    // SAFETY: RTLD_NOLOAD only looks the library up among those loaded (it
    // never loads one); a handle found is released at once.
    unsafe {
        let h = libc::dlopen(name.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY);
        if h.is_null() {
            return false;
        }
        libc::dlclose(h);
        true
    }
}

/// Prepare the process for captures before a CUDA graph loads libtorch: when
/// `options` want captures, libtorch's CUDA library is not loaded yet and
/// neither variable of [`ALLOC_CONF`] is set, select the stream-ordered
/// allocator (`PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`), which every
/// later user of libtorch in this process then shares (torch included).
/// Returns the allocator the process will use.
///
/// Call it before the process starts other threads that read the environment
/// (the serve example calls it first thing; `load_native` before opening
/// libtorch): setting a variable races with concurrent readers in C.
pub fn prepare_allocator(options: &CaptureOptions) -> Allocator {
    let [a, b] = env_values();
    if options.enabled
        && options.max_captures > 0
        && a.is_none()
        && b.is_none()
        && !c10_cuda_loaded()
    {
        std::env::set_var(ALLOC_CONF[0], "backend:cudaMallocAsync");
    }
    allocator()
}

/// What a call of a shape set does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Run uncaptured (a warm-up).
    Warm,
    /// Capture now.
    Capture,
    /// Replay capture `i`.
    Replay(usize),
}

/// The shape-set bookkeeping of captures, free of CUDA (tested on the CPU):
/// warm-up counts, least-recently-used order and the bound.
#[derive(Debug)]
pub(crate) struct ShapeCache<K, E> {
    max: usize,
    // Least recently used first.
    entries: Vec<(K, E)>,
    warm: Vec<(K, u32)>,
}

impl<K: PartialEq + Clone, E> ShapeCache<K, E> {
    pub(crate) fn new(max: usize) -> Self {
        ShapeCache {
            max,
            entries: Vec::new(),
            warm: Vec::new(),
        }
    }

    /// What a call with `key` does; counts a warm-up.
    pub(crate) fn next(&mut self, key: &K) -> Next {
        if let Some(i) = self.entries.iter().position(|(k, _)| k == key) {
            // Most recently used last.
            let entry = self.entries.remove(i);
            self.entries.push(entry);
            return Next::Replay(self.entries.len() - 1);
        }
        if self.max == 0 {
            return Next::Warm;
        }
        let seen = match self.warm.iter().position(|(k, _)| k == key) {
            Some(i) => {
                let mut w = self.warm.remove(i);
                w.1 += 1;
                let n = w.1;
                self.warm.push(w);
                n
            }
            None => {
                if self.warm.len() >= WARM_REMEMBERED {
                    self.warm.remove(0);
                }
                self.warm.push((key.clone(), 1));
                1
            }
        };
        if seen > WARMUP_RUNS {
            Next::Capture
        } else {
            Next::Warm
        }
    }

    /// Keep a capture of `key`; returns the one evicted for the bound.
    pub(crate) fn insert(&mut self, key: K, entry: E) -> Option<E> {
        self.warm.retain(|(k, _)| *k != key);
        let evicted = (self.entries.len() >= self.max && !self.entries.is_empty())
            .then(|| self.entries.remove(0).1);
        self.entries.push((key, entry));
        evicted
    }

    pub(crate) fn get(&self, i: usize) -> Option<&E> {
        self.entries.get(i).map(|(_, e)| e)
    }

    /// Drop every capture and warm-up count; returns the captures.
    pub(crate) fn drain(&mut self) -> Vec<E> {
        self.warm.clear();
        self.entries.drain(..).map(|(_, e)| e).collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

/// One captured shape set: the executable graph and the buffers it reads
/// (static inputs) and leaves its outputs in.
struct Entry {
    exec: usize,
    inputs: Vec<OwnedTensor>,
    outputs: Vec<OwnedTensor>,
}

type ShapeSet = Vec<(i32, Vec<i64>)>;

/// A graph's capture stream, destroyed when its last holder goes: the
/// captures, and every static output handed out (libtorch frees a capture's
/// memory on the stream it was allocated on, so the stream must outlive the
/// last handle to that memory, which a caller may keep past the captures).
struct OwnStream {
    stream: usize,
    destroy: crate::cuda::PtrIn,
}

impl Drop for OwnStream {
    fn drop(&mut self) {
        // SAFETY: made by `Captures::stream` and destroyed once, here; work
        // still queued on it completes first (cudaStreamDestroy's contract).
        unsafe { (self.destroy)(self.stream as *mut c_void) };
    }
}

/// What a replay hands back, with what static outputs keep alive.
enum Hand {
    Copy,
    Static(Arc<OwnStream>),
}

impl Hand {
    fn of(outputs: Outputs, caps: &Captures) -> Hand {
        match (outputs, &caps.own_stream) {
            (Outputs::Static, Some(stream)) => Hand::Static(Arc::clone(stream)),
            _ => Hand::Copy,
        }
    }
}

/// The captures of one graph.
pub(crate) struct Captures {
    reason: Option<String>,
    cache: ShapeCache<ShapeSet, Entry>,
    stream: usize,
    own_stream: Option<Arc<OwnStream>>,
    generation: u64,
    stats: CaptureStats,
}

// SAFETY: the stream and executable graph handles are process-wide CUDA
// objects usable from any thread; every use is serialised by the graph's
// mutex around this value.
unsafe impl Send for Captures {}

impl Captures {
    /// Captures that never happen, for `reason`.
    pub(crate) fn off(reason: &str) -> Captures {
        Captures {
            reason: Some(reason.to_owned()),
            cache: ShapeCache::new(0),
            stream: 0,
            own_stream: None,
            generation: 0,
            stats: CaptureStats::default(),
        }
    }

    fn give_up(&mut self, torch: &Torch, reason: String) {
        debug(&format!(
            "CUDA graphs off, uncaptured runs from now on: {reason}"
        ));
        self.teardown(torch);
        self.reason = Some(reason);
        self.stats.fallbacks += 1;
    }

    /// Drop every capture (after its last replay finished); the stream stays.
    pub(crate) fn clear(&mut self, torch: &Torch) {
        let entries = self.cache.drain();
        self.stats.captured = 0;
        if entries.is_empty() {
            return;
        }
        let Ok(cuda) = torch.cuda() else {
            // No CUDA state means nothing was ever captured; keep the handles.
            entries.into_iter().for_each(std::mem::forget);
            return;
        };
        let _ = cuda.synchronize(self.stream);
        for entry in entries {
            destroy(cuda, entry);
        }
    }

    /// Drop every capture and the graph's stream.
    pub(crate) fn teardown(&mut self, torch: &Torch) {
        self.clear(torch);
        if self.stream == 0 {
            return;
        }
        if let Ok(cuda) = torch.cuda() {
            let _ = cuda.synchronize(self.stream);
        }
        // Destroyed now, or when the last static output handed out goes.
        self.own_stream = None;
        self.stream = 0;
    }

    fn stream(&mut self, cuda: &Cuda, api: &GraphApi, index: i32) -> Result<usize> {
        if self.stream == 0 {
            let _device = cuda.device_guard(index)?;
            let mut s: *mut c_void = std::ptr::null_mut();
            // SAFETY: writes one stream handle, of the current device (`index`).
            cuda.check(
                unsafe { (api.stream_create)(&mut s, STREAM_NON_BLOCKING) },
                "cudaStreamCreateWithFlags",
            )?;
            self.stream = s as usize;
            self.own_stream = Some(Arc::new(OwnStream {
                stream: self.stream,
                destroy: api.stream_destroy,
            }));
        }
        Ok(self.stream)
    }
}

impl Drop for Captures {
    fn drop(&mut self) {
        if self.cache.len() > 0 || self.stream != 0 {
            debug("captures dropped without their graph's libtorch (leaked)");
            // The stream too: its captures' memory was never freed on it.
            std::mem::forget(self.own_stream.take());
        }
    }
}

fn destroy(cuda: &Cuda, entry: Entry) {
    if let Some(api) = cuda.graphs {
        // SAFETY: instantiated by this module and destroyed once, after its
        // last launch finished (the callers synchronise the stream first).
        unsafe { (api.exec_destroy)(entry.exec as *mut c_void) };
    }
    // Then the buffers it read and wrote: the outputs are the graph's own
    // allocations (memory nodes), which outlive the executable graph until
    // freed here.
    drop(entry.outputs);
    drop(entry.inputs);
}

fn debug(message: &str) {
    if std::env::var_os("TORCH_COMPILED_GRAPHS_DEBUG").is_some_and(|v| !v.is_empty() && v != "0") {
        eprintln!("torch_compiled_graphs: {message}");
    }
}

impl Graph {
    /// Turn CUDA-graph replay on or off for this graph's calls (module docs).
    /// Returns `None` when calls will be captured, else why not. On: calls
    /// use the single-threaded run and run one at a time.
    pub fn set_captures(&self, options: CaptureOptions) -> Option<String> {
        let reason = self.capture_refusal(&options);
        let mut captures = self.captures.lock().unwrap_or_else(|p| p.into_inner());
        captures.teardown(&self.torch);
        *captures = match &reason {
            Some(r) => Captures::off(r),
            None => Captures {
                reason: None,
                cache: ShapeCache::new(options.max_captures),
                stream: 0,
                own_stream: None,
                generation: self.binding_generation.load(Ordering::SeqCst),
                stats: CaptureStats::default(),
            },
        };
        drop(captures);
        if reason.is_none() {
            // Checked by `capture_refusal`: the runtime has the run.
            let _ = self.set_single_threaded(true);
        } else if let Some(r) = &reason {
            debug(&format!("CUDA graphs off: {r}"));
        }
        reason
    }

    fn capture_refusal(&self, options: &CaptureOptions) -> Option<String> {
        if !options.enabled {
            return Some("cuda_graphs is off".into());
        }
        if options.max_captures == 0 {
            return Some("max_captures is 0".into());
        }
        let Device::Cuda(_) = self.device else {
            return Some("a cpu graph has no CUDA graphs".into());
        };
        if self.api.run_single_threaded.is_none() {
            return Some(
                "the graph's runtime has no single-threaded run (AOTInductorModelContainerRunSingleThreaded)"
                    .into(),
            );
        }
        match self.torch.cuda() {
            Ok(cuda) if cuda.graphs.is_none() => {
                return Some("the CUDA runtime lacks the CUDA graph functions".into())
            }
            Err(e) => return Some(e.message().to_owned()),
            Ok(_) => {}
        }
        match allocator() {
            Allocator::StreamOrdered => None,
            Allocator::Caching(why) => Some(format!(
                "{why}; captures on the native path need libtorch's stream-ordered allocator: \
                 set PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync before the process loads libtorch"
            )),
        }
    }

    /// Why calls are not captured (`None` while they are).
    pub fn captures_reason(&self) -> Option<String> {
        self.captures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .reason
            .clone()
    }

    /// What the captures did so far.
    pub fn capture_stats(&self) -> CaptureStats {
        let c = self.captures.lock().unwrap_or_else(|p| p.into_inner());
        let mut stats = c.stats.clone();
        stats.captured = c.cache.len() as u64;
        stats
    }

    /// Serve a checked call through captures; `None` when captures are off
    /// (the caller runs it uncaptured).
    ///
    /// # Safety
    /// As [`Graph::run_on`]; `dtypes` are the inputs' checked dtypes.
    pub(crate) unsafe fn run_captured(
        &self,
        inputs: &[Input],
        dtypes: &[Dtype],
        stream: usize,
        outputs: Outputs,
    ) -> Result<Option<Vec<OwnedTensor>>> {
        let Device::Cuda(index) = self.device else {
            return Ok(None);
        };
        let mut caps = self.captures.lock().unwrap_or_else(|p| p.into_inner());
        if caps.reason.is_some() {
            return Ok(None);
        }
        let cuda = self.torch.cuda()?;
        let Some(api) = cuda.graphs else {
            caps.give_up(
                &self.torch,
                "the CUDA runtime lacks the CUDA graph functions".into(),
            );
            return Ok(None);
        };
        // Single-threaded run: the call runs alone.
        let _exclusive = self.lock.write().unwrap_or_else(|p| p.into_inner());
        let generation = self.binding_generation.load(Ordering::SeqCst);
        if generation != caps.generation {
            let dropped = caps.cache.len() as u64;
            caps.clear(&self.torch);
            caps.stats.invalidated += dropped;
            caps.generation = generation;
        }
        let key: ShapeSet = inputs
            .iter()
            .zip(dtypes)
            .map(|(i, d)| (d.code, i.shape.clone()))
            .collect();
        match caps.cache.next(&key) {
            Next::Warm => {
                caps.stats.uncaptured_runs += 1;
                drop(caps);
                // SAFETY: as this function's.
                unsafe { self.run_container(inputs, dtypes, stream) }.map(Some)
            }
            Next::Replay(i) => {
                let own = caps.stream;
                let hand = Hand::of(outputs, &caps);
                let entry = caps.cache.get(i).expect("just found");
                // SAFETY: as this function's; `entry` belongs to this shape set.
                let out = unsafe { self.replay(cuda, &api, entry, inputs, stream, own, hand) }?;
                caps.stats.replays += 1;
                Ok(Some(out))
            }
            Next::Capture => {
                let own = caps.stream(cuda, &api, index)?;
                let hand = Hand::of(outputs, &caps);
                let started = Instant::now();
                // SAFETY: as this function's.
                match unsafe { self.capture(cuda, &api, inputs, dtypes, stream, own, hand) } {
                    Ok((entry, out)) => {
                        let took = started.elapsed().as_secs_f64();
                        caps.stats.captures += 1;
                        caps.stats.replays += 1;
                        caps.stats.capture_seconds += took;
                        caps.stats.last_capture_seconds = Some(took);
                        if let Some(old) = caps.cache.insert(key, entry) {
                            caps.stats.evictions += 1;
                            let _ = cuda.synchronize(own);
                            destroy(cuda, old);
                        }
                        debug(&format!(
                            "captured a shape set in {:.1} ms ({} captured)",
                            took * 1e3,
                            caps.cache.len()
                        ));
                        Ok(Some(out))
                    }
                    Err(e) => {
                        caps.give_up(&self.torch, format!("capture failed: {}", e.message()));
                        drop(caps);
                        // The call itself still runs, uncaptured.
                        // SAFETY: as this function's.
                        unsafe { self.run_container(inputs, dtypes, stream) }.map(Some)
                    }
                }
            }
        }
    }

    /// Copy `inputs` into `entry`'s static buffers, replay it on `own`
    /// (ordered after `caller`), hand its outputs back (copied into new
    /// tensors allocated on `caller`, or the static buffers themselves), and
    /// order `caller` after it.
    ///
    /// # Safety
    /// As [`Graph::run_on`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn replay(
        &self,
        cuda: &Cuda,
        api: &GraphApi,
        entry: &Entry,
        inputs: &[Input],
        caller: usize,
        own: usize,
        hand: Hand,
    ) -> Result<Vec<OwnedTensor>> {
        let outs = match hand {
            Hand::Copy => self.fresh_outputs(entry, caller)?,
            Hand::Static(_) => Vec::new(),
        };
        // The inputs' producers, the new outputs' allocation and (static) the
        // caller's reads of the previous call's static outputs come first.
        cuda.order_streams(caller, own)?;
        for (input, dst) in inputs.iter().zip(&entry.inputs) {
            // SAFETY: both buffers hold `nbytes` (the shape set matched, the
            // input was checked), the source stays valid until the caller's
            // stream passed this call's work (the caller's contract).
            unsafe { copy(cuda, api, dst.data_ptr(), input.data, input.nbytes, own) }?;
        }
        // SAFETY: an executable graph of this graph, launched on its stream.
        cuda.check(
            unsafe { (api.launch)(entry.exec as *mut c_void, own as *mut c_void) },
            "cudaGraphLaunch",
        )?;
        let outs = match hand {
            Hand::Copy => {
                // SAFETY: `outs` were made from `entry`'s outputs.
                unsafe { copy_outputs(cuda, api, entry, &outs, own) }?;
                outs
            }
            Hand::Static(stream) => static_outputs(entry, caller, stream)?,
        };
        cuda.order_streams(own, caller)?;
        Ok(outs)
    }

    /// New tensors, allocated on `caller`, shaped and laid out as `entry`'s
    /// outputs: a graph returns an output with the strides of the exported
    /// program's (a channels-last activation, a transposed view), and a copy
    /// of its memory is that output only under the same strides.
    fn fresh_outputs(&self, entry: &Entry, caller: usize) -> Result<Vec<OwnedTensor>> {
        entry
            .outputs
            .iter()
            .map(|o| {
                OwnedTensor::empty_strided(
                    &self.torch,
                    o.sizes(),
                    o.strides(),
                    o.dtype(),
                    self.device,
                    caller,
                )
            })
            .collect()
    }

    /// Capture the call of `inputs`' shape set: static inputs filled, one
    /// uncaptured run on `own` (the stream's per-library state: cuBLAS
    /// workspaces), then the captured run, instantiated and launched once.
    /// Returns the capture and this call's outputs.
    ///
    /// # Safety
    /// As [`Graph::run_on`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn capture(
        &self,
        cuda: &Cuda,
        api: &GraphApi,
        inputs: &[Input],
        dtypes: &[Dtype],
        caller: usize,
        own: usize,
        hand: Hand,
    ) -> Result<(Entry, Vec<OwnedTensor>)> {
        cuda.order_streams(caller, own)?;
        let mut statics = Vec::with_capacity(inputs.len());
        for (input, &dtype) in inputs.iter().zip(dtypes) {
            let t = OwnedTensor::empty(&self.torch, &input.shape, dtype, self.device, own)?;
            // SAFETY: `t` holds `nbytes` bytes (same shape and dtype); the
            // source is valid until the caller's stream passed this call.
            unsafe { copy(cuda, api, t.data_ptr(), input.data, input.nbytes, own) }?;
            statics.push(t);
        }
        let describe = |statics: &[OwnedTensor]| -> Result<Vec<TensorHandle>> {
            statics
                .iter()
                .zip(dtypes)
                .map(|(t, &dtype)| {
                    // SAFETY: the static buffer outlives every run that reads
                    // it (it lives in the capture's entry, or until this
                    // function's priming run finished on `own`).
                    unsafe {
                        BorrowedTensor::new(
                            &self.torch,
                            t.data_ptr() as *mut c_void,
                            t.sizes(),
                            dtype,
                            self.device,
                        )
                    }
                    .map(BorrowedTensor::into_raw)
                })
                .collect()
        };
        // The priming run: its outputs are freed on `own` when dropped.
        // SAFETY: the handles describe the static buffers.
        drop(unsafe { self.run_handles(describe(&statics)?, own) }?);
        let _one = CAPTURE_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let _device = cuda.device_guard(match self.device {
            Device::Cuda(i) => i,
            Device::Cpu => 0,
        })?;
        let handles = describe(&statics)?;
        // SAFETY: `own` is this graph's idle-or-ordered stream, not capturing.
        cuda.check(
            unsafe { (api.begin_capture)(own as *mut c_void, CAPTURE_THREAD_LOCAL) },
            "cudaStreamBeginCapture",
        )?;
        // SAFETY: the handles describe the static buffers.
        let ran = unsafe { self.run_handles(handles, own) };
        let mut graph: *mut c_void = std::ptr::null_mut();
        // SAFETY: ends the capture begun above, whatever the run did.
        let ended = unsafe { (api.end_capture)(own as *mut c_void, &mut graph) };
        let captured = match (ran, ended) {
            (Ok(outputs), 0) if !graph.is_null() => outputs,
            (ran, ended) => {
                // SAFETY: clears the (non-sticky) capture error of this thread.
                unsafe { (api.last_error)() };
                if !graph.is_null() {
                    // SAFETY: the graph captured above, destroyed once.
                    unsafe { (api.graph_destroy)(graph) };
                }
                let why = match ran {
                    Err(e) => e.message().to_owned(),
                    Ok(outputs) => {
                        // Their memory belongs to a capture that does not
                        // exist: freeing it would fail inside libtorch's
                        // deleter, so the handles are leaked, once.
                        std::mem::forget(outputs);
                        cuda.check(ended, "cudaStreamEndCapture")
                            .err()
                            .map(|e| e.message().to_owned())
                            .unwrap_or_else(|| "the capture recorded no graph".into())
                    }
                };
                return Err(Error::new(Code::RunExecutionFailed, why));
            }
        };
        let mut exec: *mut c_void = std::ptr::null_mut();
        // SAFETY: instantiates the graph captured above, then destroys the
        // graph (the executable graph is independent of it).
        let rc = unsafe { (api.instantiate)(&mut exec, graph, AUTO_FREE_ON_LAUNCH) };
        // SAFETY: as above.
        unsafe { (api.graph_destroy)(graph) };
        if let Err(e) = cuda.check(rc, "cudaGraphInstantiateWithFlags") {
            std::mem::forget(captured);
            return Err(e);
        }
        let entry = Entry {
            exec: exec as usize,
            inputs: statics,
            outputs: captured,
        };
        // This call's results: the first launch, then copies for the caller.
        // SAFETY: as this function's; the inputs are already in place.
        let result = (|| {
            cuda.check(
                unsafe { (api.launch)(exec, own as *mut c_void) },
                "cudaGraphLaunch",
            )?;
            let outs = match hand {
                Hand::Copy => {
                    let outs = self.fresh_outputs(&entry, caller)?;
                    cuda.order_streams(caller, own)?;
                    // SAFETY: `outs` were made from `entry`'s outputs.
                    unsafe { copy_outputs(cuda, api, &entry, &outs, own) }?;
                    outs
                }
                Hand::Static(stream) => static_outputs(&entry, caller, stream)?,
            };
            cuda.order_streams(own, caller)?;
            Ok(outs)
        })();
        match result {
            Ok(outs) => Ok((entry, outs)),
            Err(e) => {
                let _ = cuda.synchronize(own);
                destroy(cuda, entry);
                Err(e)
            }
        }
    }
}

/// Second handles to `entry`'s static outputs, for work queued on `caller`
/// (which the caller orders after the replay). They share the buffers'
/// storage, so the memory is released only once both they and the capture
/// are gone: after the executable graph was destroyed, as for the copies,
/// on the capture stream, which each handle keeps alive until then.
fn static_outputs(
    entry: &Entry,
    caller: usize,
    stream: Arc<OwnStream>,
) -> Result<Vec<OwnedTensor>> {
    entry
        .outputs
        .iter()
        .map(|o| {
            o.alias(
                caller,
                Arc::clone(&stream) as Arc<dyn std::any::Any + Send + Sync>,
            )
        })
        .collect()
}

/// Copy `entry`'s static outputs into `outs` on `stream`.
///
/// # Safety
/// `outs` match `entry.outputs` one for one in shape, strides and dtype, on
/// its device ([`Graph::fresh_outputs`]).
unsafe fn copy_outputs(
    cuda: &Cuda,
    api: &GraphApi,
    entry: &Entry,
    outs: &[OwnedTensor],
    stream: usize,
) -> Result<()> {
    for (src, dst) in entry.outputs.iter().zip(outs) {
        // The memory the output's elements span, layout and all: `dst` has
        // the same strides, so each element lands where `dst` reads it.
        debug_assert_eq!(src.strides(), dst.strides());
        // SAFETY: same shape, strides and dtype (the caller's contract), so
        // both span the same bytes from their first element; same device.
        unsafe {
            copy(
                cuda,
                api,
                dst.data_ptr(),
                src.data_ptr(),
                src.span_bytes(),
                stream,
            )
        }?;
    }
    Ok(())
}

/// `cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream)`.
///
/// # Safety
/// `dst` and `src` address `n` bytes (device or host) valid until the copy ran.
unsafe fn copy(
    cuda: &Cuda,
    api: &GraphApi,
    dst: usize,
    src: usize,
    n: usize,
    stream: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    cuda.check(
        unsafe {
            (api.memcpy_async)(
                dst as *mut c_void,
                src as *const c_void,
                n,
                MEMCPY_DEFAULT,
                stream as *mut c_void,
            )
        },
        "cudaMemcpyAsync",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_from_values() {
        assert_eq!(
            CaptureOptions::from_values(None, None).unwrap(),
            CaptureOptions::default()
        );
        let off = CaptureOptions::from_values(Some(" Off "), Some("3")).unwrap();
        assert!(!off.enabled);
        assert_eq!(off.max_captures, 3);
        assert!(
            CaptureOptions::from_values(Some("1"), Some(""))
                .unwrap()
                .enabled
        );
        for (flag, count) in [(Some("maybe"), None), (None, Some("-1")), (None, Some("x"))] {
            let e = CaptureOptions::from_values(flag, count).unwrap_err();
            assert_eq!(e.code(), Code::RunOptionInvalid);
        }
    }

    #[test]
    fn allocator_follows_libtorch_precedence() {
        assert!(matches!(
            allocator_from([None, None]),
            Allocator::Caching(_)
        ));
        assert_eq!(
            allocator_from([Some("backend:cudaMallocAsync"), None]),
            Allocator::StreamOrdered
        );
        assert_eq!(
            allocator_from([
                None,
                Some("expandable_segments:True,backend:cudaMallocAsync")
            ]),
            Allocator::StreamOrdered
        );
        // The CUDA variable wins over the generic one, as libtorch reads them.
        let Allocator::Caching(why) =
            allocator_from([Some("backend:native"), Some("backend:cudaMallocAsync")])
        else {
            panic!("the first variable decides");
        };
        assert!(why.contains("PYTORCH_CUDA_ALLOC_CONF"), "{why}");
        assert!(matches!(
            allocator_from([Some("expandable_segments:True"), None]),
            Allocator::Caching(_)
        ));
    }

    #[test]
    fn shape_sets_warm_capture_replay_and_evict() {
        let mut c: ShapeCache<u32, &str> = ShapeCache::new(2);
        assert_eq!(c.next(&1), Next::Warm);
        assert_eq!(c.next(&1), Next::Warm);
        assert_eq!(c.next(&1), Next::Capture);
        assert_eq!(c.insert(1, "a"), None);
        assert_eq!(c.next(&1), Next::Replay(0));
        for _ in 0..WARMUP_RUNS {
            assert_eq!(c.next(&2), Next::Warm);
        }
        assert_eq!(c.next(&2), Next::Capture);
        assert_eq!(c.insert(2, "b"), None);
        // 1 used last: 2 is the least recently used when 3 comes.
        assert_eq!(c.next(&1), Next::Replay(1));
        for _ in 0..WARMUP_RUNS {
            assert_eq!(c.next(&3), Next::Warm);
        }
        assert_eq!(c.next(&3), Next::Capture);
        assert_eq!(c.insert(3, "c"), Some("b"));
        assert_eq!(c.len(), 2);
        // An evicted set warms up again before it is captured again.
        assert_eq!(c.next(&2), Next::Warm);
        assert_eq!(c.drain(), vec!["a", "c"]);
        assert_eq!(c.next(&1), Next::Warm);
    }

    #[test]
    fn warm_counts_are_bounded_and_zero_captures_none() {
        let mut c: ShapeCache<usize, ()> = ShapeCache::new(1);
        for k in 0..1000 {
            assert_eq!(c.next(&k), Next::Warm);
        }
        assert!(c.warm.len() <= WARM_REMEMBERED);
        let mut none: ShapeCache<u8, ()> = ShapeCache::new(0);
        for _ in 0..10 {
            assert_eq!(none.next(&0), Next::Warm);
        }
    }
}
