//! Which runtime a graph runs on, chosen from the artifact (issue 34, item 3;
//! docs/run.md, "Runtime").
//!
//! Two runtimes provide the `aoti_torch_*` C shim a package's `.so` calls:
//! libtorch, and `libtcg_shim.so` (crates/tcg-shim, shim set v1), which needs
//! no torch at all. A package runs on the shim when everything its `.so`
//! imports outside the system libraries is in shim set v1
//! ([`crate::shim_set::package_covered`]) and the shim implements it on the
//! graph's device; otherwise on libtorch. The choice and its reason are
//! reported (`Graph::runtime`, `Graph::runtime_reason`, the debug log).
//!
//! [`choose_runtime`] is the pure rule; [`choose_for_package`] reads the
//! package's imports and this process's state and applies it.

use std::path::Path;

use tcg_core::artifact::package::shim_imports::ShimImports;
use tcg_core::{Code, Error, Result};

use crate::cuda::Device;
use crate::shim_set::{package_covered, SHIM_SET_V1};

/// The environment variable that chooses the runtime when no option does:
/// `auto`, `libtorch` or `shim`.
pub const RUNTIME_ENV: &str = "TORCH_COMPILED_GRAPHS_RUNTIME";

/// How many missing names a reason lists before it says how many more.
const NAMES_IN_REASON: usize = 3;

/// Functions of shim set v1 that `libtcg_shim.so` does not provide yet: none
/// (`aoti_torch_check` throws its C++ exception from the shim's
/// `src/check.cpp`, which the container's entry point catches). Kept so that
/// a future set's gaps have one place, checked against the built library.
pub const SHIM_LACKS: [&str; 0] = [];

/// Why a CUDA graph the shim could run stays on libtorch under `auto`: its
/// code calls the CUDA runtime, and no `libcudart.so.N` was found for it
/// ([`crate::cudart`]; `shim` is refused with `run.device_mismatch` instead).
pub const NO_CUDA_RUNTIME: &str =
    "no CUDA runtime (libcudart.so.N) found for the shim: see TORCH_COMPILED_GRAPHS_CUDART";

/// A runtime that provides the C shim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Runtime {
    /// libtorch's shared libraries.
    Libtorch,
    /// `libtcg_shim.so`, shim set v1.
    ShimV1,
}

impl Runtime {
    /// `"libtorch"` or `"shim-v1"`, as reports print it.
    pub fn as_str(self) -> &'static str {
        match self {
            Runtime::Libtorch => "libtorch",
            Runtime::ShimV1 => "shim-v1",
        }
    }
}

impl std::fmt::Display for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the caller asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuntimeOption {
    /// The shim where the package allows it, else libtorch.
    Auto,
    /// libtorch whatever the package imports.
    Libtorch,
    /// The shim; a package it cannot run is refused.
    Shim,
}

/// Where a [`RuntimeOption`] came from, for the reason text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionSource {
    /// Nothing was asked: `auto`.
    Default,
    /// The load's `runtime` option.
    Option,
    /// [`RUNTIME_ENV`].
    Env,
}

impl RuntimeOption {
    /// Parse `auto`, `libtorch` or `shim`; anything else is
    /// `run.option_invalid`, naming `what` (the option or the variable).
    pub fn parse(value: &str, what: &str) -> Result<RuntimeOption> {
        match value {
            "auto" => Ok(RuntimeOption::Auto),
            "libtorch" => Ok(RuntimeOption::Libtorch),
            "shim" => Ok(RuntimeOption::Shim),
            other => Err(Error::new(
                Code::RunOptionInvalid,
                format!("{what} is {other:?}; it must be \"auto\", \"libtorch\" or \"shim\""),
            )),
        }
    }

    /// The option a load uses: `explicit` when given, else [`RUNTIME_ENV`]
    /// when set (and not empty), else `auto`.
    pub fn resolve(explicit: Option<&str>) -> Result<(RuntimeOption, OptionSource)> {
        if let Some(value) = explicit {
            return Ok((
                RuntimeOption::parse(value, "runtime")?,
                OptionSource::Option,
            ));
        }
        match std::env::var(RUNTIME_ENV) {
            Ok(value) if !value.is_empty() => Ok((
                RuntimeOption::parse(&value, RUNTIME_ENV)?,
                OptionSource::Env,
            )),
            Ok(_) | Err(std::env::VarError::NotPresent) => {
                Ok((RuntimeOption::Auto, OptionSource::Default))
            }
            Err(std::env::VarError::NotUnicode(_)) => Err(Error::new(
                Code::RunOptionInvalid,
                format!("{RUNTIME_ENV} is not UTF-8"),
            )),
        }
    }
}

/// The runtime a graph runs on, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeChoice {
    /// The runtime.
    pub runtime: Runtime,
    /// Why, in words (the first few imports the shim lacks, "libtorch
    /// already loaded in this process", "forced by option", ...).
    pub reason: String,
}

impl RuntimeChoice {
    /// libtorch, for `reason`.
    pub fn libtorch(reason: impl Into<String>) -> RuntimeChoice {
        RuntimeChoice {
            runtime: Runtime::Libtorch,
            reason: reason.into(),
        }
    }
}

fn forced(source: OptionSource) -> &'static str {
    match source {
        OptionSource::Env => "forced by TORCH_COMPILED_GRAPHS_RUNTIME",
        OptionSource::Option | OptionSource::Default => "forced by option",
    }
}

fn listed(names: &[String]) -> String {
    let shown: Vec<&str> = names
        .iter()
        .take(NAMES_IN_REASON)
        .map(String::as_str)
        .collect();
    let more = names.len().saturating_sub(NAMES_IN_REASON);
    if more == 0 {
        shown.join(", ")
    } else {
        format!("{} and {more} more", shown.join(", "))
    }
}

/// What the shim cannot run of `imports`: the names outside shim set v1 (an
/// `other` import included), then those in it that the shim lacks
/// ([`SHIM_LACKS`]); empty when it runs everything.
pub fn shim_misses(imports: &ShimImports) -> Vec<String> {
    let mut missing = package_covered(imports).err().unwrap_or_default();
    missing.extend(
        imports
            .aoti_torch
            .iter()
            .filter(|n| SHIM_LACKS.contains(&n.as_str()))
            .cloned(),
    );
    missing.sort_unstable();
    missing.dedup();
    missing
}

/// The rule, the same on the CPU and on CUDA. `option` (from `source`)
/// first: `libtorch` is obeyed; then the package's `imports`: anything the shim cannot run means libtorch, and `shim` is
/// refused with `run.native_unsupported` naming those functions; a package the
/// shim runs goes to the shim, unless `libtorch_loaded` (this process has
/// libtorch mapped already: nothing to gain, and torch's tensors are what the
/// process works with) and the shim was not forced.
pub fn choose_runtime(
    imports: &ShimImports,
    option: RuntimeOption,
    source: OptionSource,
    libtorch_loaded: bool,
) -> Result<RuntimeChoice> {
    if option == RuntimeOption::Libtorch {
        return Ok(RuntimeChoice::libtorch(forced(source)));
    }
    let missing = shim_misses(imports);
    if !missing.is_empty() {
        if option == RuntimeOption::Shim {
            return Err(Error::new(
                Code::RunNativeUnsupported,
                format!(
                    "the shim runtime was asked for ({}), but the package's .so imports {} function{} that {SHIM_SET_V1} on libtcg_shim.so does not provide: {}",
                    forced(source),
                    missing.len(),
                    if missing.len() == 1 { "" } else { "s" },
                    missing.join(", ")
                ),
            ));
        }
        return Ok(RuntimeChoice::libtorch(format!(
            "imports outside {SHIM_SET_V1}: {}",
            listed(&missing)
        )));
    }
    if option == RuntimeOption::Shim {
        return Ok(RuntimeChoice {
            runtime: Runtime::ShimV1,
            reason: forced(source).to_owned(),
        });
    }
    if libtorch_loaded {
        return Ok(RuntimeChoice::libtorch(
            "libtorch already loaded in this process",
        ));
    }
    Ok(RuntimeChoice {
        runtime: Runtime::ShimV1,
        reason: format!(
            "every import ({} aoti_torch_*) in {SHIM_SET_V1}",
            imports.aoti_torch.len()
        ),
    })
}

/// Whether libtorch (`libtorch_cpu.so` or `libc10.so`) is mapped into this
/// process, by `/proc/self/maps`; `false` where that cannot be read.
pub fn libtorch_mapped() -> bool {
    std::fs::read_to_string("/proc/self/maps").is_ok_and(|maps| maps_have_libtorch(&maps))
}

/// Whether a `/proc/<pid>/maps` text maps libtorch.
pub fn maps_have_libtorch(maps: &str) -> bool {
    maps.lines().any(|line| {
        line.rsplit('/').next().is_some_and(|name| {
            name.starts_with("libtorch_cpu.so") || name.starts_with("libc10.so")
        })
    })
}

/// [`choose_runtime`] for entry `entry` of the package at `package` on
/// `device` (`cpu`, `cuda:N`), its imports read from the package's `.so`
/// (tcg-core's `shim_imports`), with this process's libtorch state. On CUDA,
/// `auto` also needs a CUDA runtime for the shim ([`NO_CUDA_RUNTIME`]).
pub fn choose_for_package(
    package: &Path,
    entry: &str,
    device: &str,
    option: RuntimeOption,
    source: OptionSource,
) -> Result<RuntimeChoice> {
    let device = Device::parse(device)?;
    if option == RuntimeOption::Libtorch {
        return Ok(RuntimeChoice::libtorch(forced(source)));
    }
    let imports = match tcg_core::artifact::package::shim_imports(package, Some(entry)) {
        Ok(imports) => imports,
        // The loader reads the same package next and refuses it with the
        // code it always has (a wrong entry is `run.package_invalid`): the
        // choice adds no refusal of its own.
        Err(e) if option == RuntimeOption::Auto => {
            return Ok(RuntimeChoice::libtorch(format!(
                "the package's imports cannot be read ({}): left to the loader",
                e.code().as_str()
            )))
        }
        Err(e) => return Err(e),
    };
    let choice = choose_runtime(&imports, option, source, libtorch_mapped())?;
    if device.is_cuda()
        && option == RuntimeOption::Auto
        && choice.runtime == Runtime::ShimV1
        && crate::cudart::locate().is_err()
    {
        return Ok(RuntimeChoice::libtorch(NO_CUDA_RUNTIME));
    }
    Ok(choice)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn imports(aoti: &[&str], other: &[&str]) -> ShimImports {
        ShimImports {
            aoti_torch: aoti.iter().map(|s| (*s).to_owned()).collect(),
            other: other.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    fn covered() -> ShimImports {
        imports(
            &[
                "aoti_torch_delete_tensor_object",
                "aoti_torch_dtype_float32",
                "aoti_torch_empty_strided",
                "aoti_torch_get_data_ptr",
            ],
            &[],
        )
    }

    const AUTO: (RuntimeOption, OptionSource) = (RuntimeOption::Auto, OptionSource::Default);

    #[test]
    fn a_covered_cpu_package_runs_on_the_shim_in_a_process_without_libtorch() {
        let c = choose_runtime(&covered(), AUTO.0, AUTO.1, false).unwrap();
        assert_eq!(c.runtime, Runtime::ShimV1);
        assert_eq!(c.reason, "every import (4 aoti_torch_*) in shim set v1");
    }

    #[test]
    fn libtorch_already_loaded_keeps_a_covered_package_on_libtorch_unless_the_shim_is_forced() {
        let c = choose_runtime(&covered(), AUTO.0, AUTO.1, true).unwrap();
        assert_eq!(
            c,
            RuntimeChoice::libtorch("libtorch already loaded in this process")
        );
        let c = choose_runtime(&covered(), RuntimeOption::Shim, OptionSource::Env, true).unwrap();
        assert_eq!(c.runtime, Runtime::ShimV1);
        assert_eq!(c.reason, "forced by TORCH_COMPILED_GRAPHS_RUNTIME");
    }

    #[test]
    fn an_uncovered_package_runs_on_libtorch_and_the_reason_names_the_first_misses() {
        let one = imports(
            &["aoti_torch_cpu_addmm_out", "aoti_torch_empty_strided"],
            &[],
        );
        let c = choose_runtime(&one, AUTO.0, AUTO.1, false).unwrap();
        assert_eq!(
            c,
            RuntimeChoice::libtorch("imports outside shim set v1: aoti_torch_cpu_addmm_out")
        );
        let many = imports(
            &[
                "aoti_torch_cpu_addmm_out",
                "aoti_torch_cpu_bmm_out",
                "aoti_torch_check",
            ],
            &[
                "Sleef_expf8_u10",
                "_ZN3c106detail14torchCheckFailEPKcS2_jS2_",
            ],
        );
        let c = choose_runtime(&many, AUTO.0, AUTO.1, false).unwrap();
        assert_eq!(c.runtime, Runtime::Libtorch);
        assert_eq!(
            c.reason,
            "imports outside shim set v1: Sleef_expf8_u10, _ZN3c106detail14torchCheckFailEPKcS2_jS2_, aoti_torch_cpu_addmm_out and 1 more"
        );
    }

    #[test]
    fn forcing_the_shim_on_a_package_it_cannot_run_is_refused_with_every_name() {
        let one = imports(
            &[
                "aoti_torch_check",
                "aoti_torch_cpu_addmm_out",
                "aoti_torch_cpu_bmm_out",
            ],
            &[],
        );
        let err =
            choose_runtime(&one, RuntimeOption::Shim, OptionSource::Option, false).unwrap_err();
        assert_eq!(err.code(), Code::RunNativeUnsupported);
        assert!(
            err.message().contains("forced by option"),
            "{}",
            err.message()
        );
        assert!(
            err.message()
                .ends_with("aoti_torch_cpu_addmm_out, aoti_torch_cpu_bmm_out"),
            "{}",
            err.message()
        );
    }

    #[test]
    fn cuda_follows_the_imports_as_the_cpu_does() {
        let c = choose_runtime(&covered(), AUTO.0, AUTO.1, false).unwrap();
        assert_eq!(c.runtime, Runtime::ShimV1);
        assert!(c.reason.starts_with("every import"), "{}", c.reason);
        let c = choose_runtime(&covered(), AUTO.0, AUTO.1, true).unwrap();
        assert_eq!(
            c,
            RuntimeChoice::libtorch("libtorch already loaded in this process")
        );
        let cuda = imports(
            &[
                "aoti_torch_create_cuda_stream_guard",
                "aoti_torch_delete_cuda_stream_guard",
                "aoti_torch_empty_strided",
                "aoti_torch_get_current_cuda_stream",
            ],
            &[],
        );
        let c = choose_runtime(&cuda, RuntimeOption::Shim, OptionSource::Env, true).unwrap();
        assert_eq!(c.runtime, Runtime::ShimV1);
        assert_eq!(c.reason, "forced by TORCH_COMPILED_GRAPHS_RUNTIME");
        // Forced, the imports still decide: a GEMM extern is refused.
        let err = choose_runtime(
            &imports(&["aoti_torch_cuda_mm_out"], &[]),
            RuntimeOption::Shim,
            OptionSource::Option,
            false,
        )
        .unwrap_err();
        assert_eq!(err.code(), Code::RunNativeUnsupported);
        assert!(err.message().contains("aoti_torch_cuda_mm_out"));
    }

    #[test]
    fn forcing_libtorch_wins_over_everything() {
        for loaded in [false, true] {
            let c = choose_runtime(
                &covered(),
                RuntimeOption::Libtorch,
                OptionSource::Option,
                loaded,
            )
            .unwrap();
            assert_eq!(c, RuntimeChoice::libtorch("forced by option"));
        }
    }

    #[test]
    fn options_parse_exactly() {
        assert_eq!(
            RuntimeOption::parse("shim", "runtime").unwrap(),
            RuntimeOption::Shim
        );
        for bad in ["", "Shim", "shim-v1", "torch", " auto"] {
            let err = RuntimeOption::parse(bad, "runtime").unwrap_err();
            assert_eq!(err.code(), Code::RunOptionInvalid, "{bad:?}");
        }
        assert_eq!(
            RuntimeOption::resolve(Some("libtorch")).unwrap(),
            (RuntimeOption::Libtorch, OptionSource::Option)
        );
    }

    #[test]
    fn maps_name_libtorch_by_its_file_name_only() {
        let with = "7f00-7f01 r-xp 00000000 08:01 1 /venv/torch/lib/libtorch_cpu.so\n";
        let c10 = "7f00-7f01 r-xp 00000000 08:01 1 /x/libc10.so\n";
        let without = "7f00-7f01 r-xp 00000000 08:01 1 /venv/libtorch_cpu_helpers/libfoo.so\n\
                       7f00-7f01 r-xp 00000000 08:01 1 /memfd:libtcg_shim.so (deleted)\n";
        assert!(maps_have_libtorch(with));
        assert!(maps_have_libtorch(c10));
        assert!(!maps_have_libtorch(without));
        assert!(!maps_have_libtorch(""));
    }
}
