//! Serve a stored compiled graph from Rust with no Python: resolve a key from a
//! store, load it on the CPU or a GPU with libtorch opened at run time, bind
//! its weights, run it on inputs read from a safetensors file, and compare
//! with expected outputs from the same file.
//!
//! ```text
//! cargo run --release -p tcg-run --example serve -- \
//!     --store STORE --key KEY --dest DIR --torch-lib .venv/.../torch/lib \
//!     --weights weights.safetensors --io io.safetensors --in x [--out y] \
//!     [--device cuda:0] [--repeat 100] [--rtol 1e-5 --atol 1e-6] \
//!     [--strip-prefix unet.] [--add-prefix vae.] [--runtime auto|libtorch|shim] [--verbose]
//! ```
//!
//! `--runtime` (else `TORCH_COMPILED_GRAPHS_RUNTIME`, else `auto`) picks the
//! runtime: `auto` runs a CPU graph whose `.so` imports only shim set v1 on
//! the shim carried inside this binary, without opening libtorch
//! (`--torch-lib` is then unused), every other graph on libtorch
//! (docs/run.md, "Runtime"). The JSON line carries `runtime` and
//! `runtime_reason`.
//!
//! `--verbose` prints, on stderr, how long each phase of the cold start took
//! (resolve, libraries opened, CUDA context, container created, weights
//! read, copied, bound, first call); the JSON line carries them as `timings`.
//!
//! `--weights` takes a safetensors file, a sharded checkpoint's
//! `*.safetensors.index.json`, or a directory holding either; repeat it to
//! bind from several (a checkpoint and its non-persistent buffers).
//!
//! `--in` and `--out` name tensors of `--io` (repeat the flag for several, in
//! the graph's flat input and output order). Prints one JSON line: the time to
//! first inference (resolve, load, bind, first call, output on the host), the
//! median latency of `--repeat` further calls (each waits for the device), and
//! the largest error against `--out`, and how many outputs were compared
//! (`checked`: exactly the `--out` given; more than the graph has outputs is
//! a usage error). Exits 1 when an output differs beyond the tolerance, 2 on
//! a usage error or a refusal.
//!
//! Bounds: `--repeat` at most 1000000 (one latency of 8 bytes is kept per
//! call); `--rtol` and `--atol` finite and not negative; `--io` a regular
//! file, as the weights are.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use tcg_run::{OwnedTensor, Served};

/// The most calls `--repeat` may ask for.
const MAX_REPEAT: usize = 1_000_000;

const USAGE: &str = "usage: serve --store STORE --key KEY --dest DIR --torch-lib DIR \
--weights PATH [--weights PATH ...] --io FILE --in NAME [--in NAME ...] [--out NAME ...] \
[--device cpu|cuda:N] [--repeat N (0..=1000000)] [--rtol X] [--atol X] (finite, >= 0) \
[--strip-prefix P] [--add-prefix P] [--cuda-graphs on|off] [--runtime auto|libtorch|shim] [--verbose]";

#[derive(Default)]
struct Args {
    store: PathBuf,
    key: String,
    dest: PathBuf,
    torch_lib: PathBuf,
    weights: Vec<PathBuf>,
    naming: tcg_run::weights::Naming,
    io: PathBuf,
    inputs: Vec<String>,
    outputs: Vec<String>,
    device: String,
    repeat: usize,
    rtol: f64,
    atol: f64,
    verbose: bool,
    cuda_graphs: Option<bool>,
    runtime: Option<tcg_run::RuntimeOption>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        device: "cpu".into(),
        rtol: 1e-5,
        atol: 1e-6,
        ..Args::default()
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--store" => a.store = value()?.into(),
            "--key" => a.key = value()?,
            "--dest" => a.dest = value()?.into(),
            "--torch-lib" => a.torch_lib = value()?.into(),
            "--weights" => a.weights.push(value()?.into()),
            "--strip-prefix" => a.naming.strip_prefix = value()?,
            "--add-prefix" => a.naming.add_prefix = value()?,
            "--io" => a.io = value()?.into(),
            "--in" => a.inputs.push(value()?),
            "--out" => a.outputs.push(value()?),
            "--device" => a.device = value()?,
            "--repeat" => {
                let v = value()?;
                a.repeat = v
                    .parse::<u64>()
                    .ok()
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|&n| n <= MAX_REPEAT)
                    .ok_or(format!(
                        "--repeat {v:?}: a whole number of calls from 0 to {MAX_REPEAT}"
                    ))?;
            }
            "--rtol" => a.rtol = tolerance("--rtol", &value()?)?,
            "--atol" => a.atol = tolerance("--atol", &value()?)?,
            "--verbose" => a.verbose = true,
            "--runtime" => {
                a.runtime = Some(
                    tcg_run::RuntimeOption::parse(&value()?, "--runtime")
                        .map_err(|e| e.message().to_owned())?,
                )
            }
            "--cuda-graphs" => {
                a.cuda_graphs = Some(match value()?.as_str() {
                    "on" => true,
                    "off" => false,
                    v => return Err(format!("--cuda-graphs {v:?}: on or off")),
                })
            }
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if a.key.is_empty()
        || a.inputs.is_empty()
        || a.store.as_os_str().is_empty()
        || a.dest.as_os_str().is_empty()
        || a.torch_lib.as_os_str().is_empty()
        || a.weights.is_empty()
        || a.io.as_os_str().is_empty()
    {
        return Err(format!("--store, --key, --dest, --torch-lib, --weights, --io and at least one --in are required\n{USAGE}"));
    }
    Ok(a)
}

/// A tolerance: a finite number, not negative (NaN would fail every
/// comparison, infinity pass every one).
fn tolerance(flag: &str, v: &str) -> Result<f64, String> {
    v.parse::<f64>()
        .ok()
        .filter(|x| x.is_finite() && *x >= 0.0)
        .ok_or(format!("{flag} {v:?}: a finite number, at least 0"))
}

/// A tensor's elements as f64, for comparison (float and bfloat16 outputs).
fn values(dtype: &str, bytes: &[u8]) -> Option<Vec<f64>> {
    Some(match dtype {
        "float32" => bytes
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        "float64" => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        "bfloat16" => bytes
            .chunks_exact(2)
            .map(|c| {
                f64::from(f32::from_bits(
                    u32::from(u16::from_le_bytes([c[0], c[1]])) << 16,
                ))
            })
            .collect(),
        _ => return None,
    })
}

fn main() -> ExitCode {
    // Lazy module loading unless the environment says otherwise, set while
    // this process has one thread (docs/run.md, "CUDA_MODULE_LOADING").
    if std::env::var_os("CUDA_MODULE_LOADING").is_none() {
        std::env::set_var("CUDA_MODULE_LOADING", "LAZY");
    }
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    // CUDA graphs as the environment says unless the flag does; the
    // allocator they need is chosen while this process has one thread.
    let captures = match tcg_run::capture::CaptureOptions::from_env() {
        Ok(mut c) => {
            c.enabled = args.cuda_graphs.unwrap_or(c.enabled);
            c
        }
        Err(e) => {
            eprintln!("error: {}", e.message());
            eprintln!("code: {}", e.code().as_str());
            return ExitCode::from(2);
        }
    };
    if args.device.starts_with("cuda") {
        tcg_run::capture::prepare_allocator(&captures);
    }
    match serve(&args, captures) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {}", e.message());
            eprintln!("code: {}", e.code().as_str());
            ExitCode::from(2)
        }
    }
}

/// The tensors of the `--io` file by name: `(dtype, shape, bytes)`. Read
/// with the checks the weights get (a regular file, a header whose offsets
/// are checked against the file's size, memory reserved without aborting).
#[allow(clippy::type_complexity)]
fn read_io(
    path: &std::path::Path,
) -> tcg_core::Result<BTreeMap<String, (String, Vec<i64>, Vec<u8>)>> {
    let (source, entries) =
        tcg_run::weights::Source::open(path, tcg_core::Code::RunWeightsInvalid)?;
    let mut named = BTreeMap::new();
    for (name, entry) in entries {
        // Dimensions fit an int64: the header reader refuses others.
        let shape: Vec<i64> = entry.shape.iter().map(|&d| d as i64).collect();
        let bytes = source.read_entry(&entry)?;
        named.insert(name, (entry.dtype, shape, bytes));
    }
    source.check_unchanged()?;
    Ok(named)
}

fn serve(args: &Args, captures: tcg_run::capture::CaptureOptions) -> tcg_core::Result<bool> {
    let named = read_io(&args.io)?;
    let pick = |name: &String| {
        named.get(name).ok_or_else(|| {
            tcg_core::Error::new(
                tcg_core::Code::RunCallInvalid,
                format!("{} holds no tensor {name:?}", args.io.display()),
            )
        })
    };
    let inputs = args
        .inputs
        .iter()
        .map(pick)
        .collect::<tcg_core::Result<Vec<_>>>()?;
    let expected = args
        .outputs
        .iter()
        .map(pick)
        .collect::<tcg_core::Result<Vec<_>>>()?;
    let host: Vec<(&[u8], &str, &[i64])> = inputs
        .iter()
        .map(|(dtype, shape, bytes)| (bytes.as_slice(), dtype.as_str(), shape.as_slice()))
        .collect();

    let start = Instant::now();
    let resolved = tcg_core::engine::Engine::open(&args.store)?
        .resolve(&args.key, &args.dest)?
        .ok_or_else(|| {
            tcg_core::Error::new(
                tcg_core::Code::RunCallInvalid,
                format!("the store has no graph {}", args.key),
            )
        })?;
    let resolve_s = start.elapsed().as_secs_f64();
    let served = Served::load_with_runtime(
        resolved,
        &args.torch_lib,
        &args.device,
        &args.weights,
        &args.naming,
        args.runtime,
    )?;
    if served.graph().device().is_cuda() {
        served.graph().set_captures(captures);
    }
    let outputs_n = served.graph().num_outputs();
    if args.outputs.len() > outputs_n {
        return Err(tcg_core::Error::new(
            tcg_core::Code::RunCallInvalid,
            format!(
                "{} --out given, but the graph has {outputs_n} output(s)",
                args.outputs.len()
            ),
        ));
    }
    let call = Instant::now();
    let outputs: Vec<OwnedTensor> = served.run_host(&host)?;
    let first: Vec<Vec<u8>> = outputs
        .iter()
        .map(OwnedTensor::to_host)
        .collect::<tcg_core::Result<_>>()?;
    let first_call_s = call.elapsed().as_secs_f64();
    let ttfi = start.elapsed().as_secs_f64();
    let mut timings: Vec<(&str, f64)> = vec![("resolve", resolve_s)];
    timings.extend(served.timings().iter().copied());
    timings.push(("first_call", first_call_s));
    if args.verbose {
        eprintln!(
            "{:>17} {} ({})",
            "runtime",
            served.graph().runtime(),
            served.graph().runtime_reason()
        );
        for (phase, secs) in &timings {
            eprintln!("{phase:>17} {:9.1} ms", secs * 1e3);
        }
        eprintln!("{:>17} {:9.1} ms", "time to output", ttfi * 1e3);
    }
    let timings_json: Vec<String> = timings
        .iter()
        .map(|(k, v)| format!("\"{k}\":{v:.6}"))
        .collect();

    let mut latencies = Vec::with_capacity(args.repeat);
    let mut same_as_first: Option<bool> = None;
    if args.repeat > 0 {
        // Inputs placed on the graph's device once, as a server keeps them.
        let placed: Vec<OwnedTensor> = inputs
            .iter()
            .map(|(dtype, shape, bytes)| {
                let d = served.torch().dtype_by_name(dtype).ok_or_else(|| {
                    tcg_core::Error::new(
                        tcg_core::Code::RunInputMismatch,
                        format!("libtorch has no dtype {dtype}"),
                    )
                })?;
                OwnedTensor::from_host(served.torch(), bytes, shape, d, served.graph().device(), 0)
            })
            .collect::<tcg_core::Result<_>>()?;
        let described: Vec<tcg_run::Input> = placed
            .iter()
            .map(|t| tcg_run::Input {
                data: t.data_ptr(),
                nbytes: t.nbytes(),
                dtype: t.dtype().name.to_owned(),
                shape: t.sizes().to_vec(),
                device: t.device(),
            })
            .collect();
        let cuda = match served.graph().device() {
            tcg_run::Device::Cuda(_) => Some(served.torch().cuda()?),
            tcg_run::Device::Cpu => None,
        };
        let mut last = Vec::new();
        for _ in 0..args.repeat {
            let t = Instant::now();
            // SAFETY: `placed` owns every input's memory for the whole loop,
            // and each call's work is waited for below before the next one.
            let out = unsafe { served.run(&described, 0) }?;
            if let Some(cuda) = cuda {
                cuda.synchronize(0)?;
            }
            latencies.push(t.elapsed().as_secs_f64());
            last = out;
        }
        latencies.sort_by(f64::total_cmp);
        // The last call (a replay where calls are captured) against the
        // first (never captured): the same bytes.
        let again: Vec<Vec<u8>> = last
            .iter()
            .map(OwnedTensor::to_host)
            .collect::<tcg_core::Result<_>>()?;
        same_as_first = Some(again == first);
    }

    let mut worst = 0f64;
    let mut ok = true;
    let mut checked = 0usize;
    for ((got, out), (dtype, shape, want)) in first.iter().zip(&outputs).zip(&expected) {
        checked += 1;
        if out.dtype().name != dtype.as_str() || out.sizes() != shape.as_slice() {
            ok = false;
            continue;
        }
        match (values(dtype, got), values(dtype, want)) {
            (Some(g), Some(w)) => {
                for (g, w) in g.iter().zip(&w) {
                    let err = (g - w).abs();
                    worst = worst.max(err);
                    // NaN compares false, so a NaN output fails too.
                    let within = err <= args.atol + args.rtol * w.abs();
                    if !within {
                        ok = false;
                    }
                }
            }
            _ => ok &= got == want,
        }
    }
    let shapes: Vec<String> = outputs
        .iter()
        .map(|t| {
            format!(
                "{{\"dtype\":\"{}\",\"shape\":{:?},\"device\":\"{}\"}}",
                t.dtype().name,
                t.sizes(),
                t.device()
            )
        })
        .collect();
    let median = latencies.get(latencies.len() / 2).copied();
    let stats = served.graph().capture_stats();
    let reason = served.graph().captures_reason();
    let graphs = format!(
        "{{\"on\":{},\"reason\":{},\"captures\":{},\"replays\":{},\"uncaptured_runs\":{},\"capture_s\":{},\"last_equals_first\":{}}}",
        reason.is_none(),
        serde_json::to_string(&reason).unwrap_or_else(|_| "null".into()),
        stats.captures,
        stats.replays,
        stats.uncaptured_runs,
        stats.capture_seconds,
        same_as_first.map_or("null".into(), |b| b.to_string()),
    );
    ok &= same_as_first != Some(false);
    println!(
        "{{\"device\":\"{}\",\"torch_check\":\"{}\",\"runtime\":\"{}\",\"runtime_reason\":{},\"ttfi_s\":{ttfi:.6},\"call_median_s\":{},\"calls\":{},\"outputs\":[{}],\"checked\":{},\"max_abs_err\":{worst:e},\"ignored\":{},\"timings\":{{{}}},\"cuda_graphs\":{graphs},\"ok\":{ok}}}",
        served.graph().device(),
        served.torch_check(),
        served.graph().runtime(),
        serde_json::to_string(served.graph().runtime_reason()).unwrap_or_else(|_| "null".into()),
        median.map_or("null".into(), |m| format!("{m:.9}")),
        latencies.len(),
        shapes.join(","),
        checked,
        served.bind_report().ignored.len(),
        timings_json.join(","),
    );
    Ok(ok)
}
