//! LoRA checkpoints read and checked for fusing into a native weights set
//! (docs/run.md, "Weights once"): the Rust twin of the Python
//! `torch_compiled_graphs.lora`, with the same names, alpha rules and refusals.
//!
//! The format is diffusers'/PEFT's: per adapted module `<path>.lora_A.weight`
//! (rank x in, or a conv kernel rank x in x kh x kw), `<path>.lora_B.weight`
//! (out x rank, or out x rank x 1 x 1) and optionally `<path>.alpha`; names as
//! `save_lora_weights` writes them (one pipeline component's prefix `unet.`,
//! `transformer.`, `text_encoder.`, ...) or as PEFT saves them
//! (`base_model.model.`). A module's scale is alpha / rank x the caller's scale
//! (no alpha anywhere: 1 x the caller's scale, as diffusers does), alpha from
//! the module's `.alpha` tensor, else from the adapter's config: the
//! `lora_adapter_metadata` diffusers writes into the safetensors header, or
//! PEFT's `adapter_config.json` beside the file (`lora_alpha`, `alpha_pattern`,
//! `use_rslora` for alpha / sqrt(rank)).
//!
//! Everything is checked here, against the set's names, dtypes and shapes,
//! before any weight is touched: a LoRA that does not fit is refused
//! (`run.lora_invalid`) with every reason found, and changes nothing. The file
//! is read as every weights file is ([`crate::weights::Source`]): a regular
//! file only, the header bounded, `pread` from one descriptor, a file changed
//! while it was read refused. The device part, the fuse itself, is
//! [`crate::lora_fuse`].

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use tcg_core::{Code, Error, Result};

use crate::weights::{open_regular, Source, MAX_HEADER_BYTES};

/// Pipeline components whose prefix `save_lora_weights` writes before the names.
pub const COMPONENT_PREFIXES: [&str; 6] = [
    "unet.",
    "transformer.",
    "text_encoder.",
    "text_encoder_2.",
    "text_encoder_3.",
    "prior.",
];
/// The prefix PEFT's `save_pretrained` writes before the names.
pub const PEFT_PREFIX: &str = "base_model.model.";
/// File names a LoRA directory holds (diffusers', then PEFT's).
pub const LORA_FILES: [&str; 2] = [
    "pytorch_lora_weights.safetensors",
    "adapter_model.safetensors",
];
/// The most bytes an `adapter_config.json` may hold.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The dtypes a LoRA tensor or a targeted weight may have (floating point ones
/// libtorch's shim can cast between).
pub const FLOAT_DTYPES: [&str; 4] = ["float32", "float64", "float16", "bfloat16"];

fn invalid(message: impl Into<String>) -> Error {
    Error::new(Code::RunLoraInvalid, message.into())
}

/// One tensor of a LoRA file, in host memory, as the file stores it.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Inductor's dtype name (`float16`), or the lower-cased safetensors code
    /// for a dtype inductor has no name for.
    pub dtype: String,
    /// The shape.
    pub shape: Vec<usize>,
    /// The C-contiguous little-endian bytes.
    pub bytes: Vec<u8>,
}

impl HostTensor {
    fn is_float(&self) -> bool {
        FLOAT_DTYPES.contains(&self.dtype.as_str())
            || self.dtype.starts_with("float8")
            || self.dtype == "f8_e4m3"
            || self.dtype == "f8_e5m2"
    }

    /// The first element as a float (`float(t.reshape(-1)[0])`), for an
    /// `.alpha` tensor of any numeric dtype.
    fn first_value(&self) -> Option<f64> {
        let b = &self.bytes;
        let take = |n: usize| b.get(..n);
        Some(match self.dtype.as_str() {
            "float32" => f32::from_le_bytes(take(4)?.try_into().ok()?) as f64,
            "float64" => f64::from_le_bytes(take(8)?.try_into().ok()?),
            "float16" => f16_to_f64(u16::from_le_bytes(take(2)?.try_into().ok()?)),
            "bfloat16" => {
                f32::from_bits((u16::from_le_bytes(take(2)?.try_into().ok()?) as u32) << 16) as f64
            }
            "int64" => i64::from_le_bytes(take(8)?.try_into().ok()?) as f64,
            "int32" => i32::from_le_bytes(take(4)?.try_into().ok()?) as f64,
            "int16" => i16::from_le_bytes(take(2)?.try_into().ok()?) as f64,
            "int8" => *take(1)?.first()? as i8 as f64,
            "uint8" => *take(1)?.first()? as f64,
            _ => return None,
        })
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.bytes.len()
    }
}

/// An IEEE half's value.
pub(crate) fn f16_to_f64(bits: u16) -> f64 {
    let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((bits >> 10) & 0x1f);
    let frac = f64::from(bits & 0x3ff);
    match exp {
        0 => sign * frac * 2f64.powi(-24),
        31 if frac == 0.0 => sign * f64::INFINITY,
        31 => f64::NAN,
        _ => sign * (1.0 + frac / 1024.0) * 2f64.powi(exp - 15),
    }
}

/// A LoRA read from disk: its tensors by name and its adapter config
/// (possibly empty).
#[derive(Debug, Clone, Default)]
pub struct LoraFile {
    /// The file read (for messages).
    pub path: PathBuf,
    /// Its tensors, by the names the file gives them.
    pub tensors: BTreeMap<String, HostTensor>,
    /// The adapter config: diffusers' `lora_adapter_metadata`, else PEFT's
    /// `adapter_config.json` beside the file, else empty.
    pub config: Map<String, Value>,
}

/// Read a LoRA: a `.safetensors` file, or a directory holding
/// `pytorch_lora_weights.safetensors` or `adapter_model.safetensors`. Every
/// refusal is `run.lora_invalid` (a tensor too large to hold in memory
/// `run.weights_too_large`).
pub fn read(path: &Path) -> Result<LoraFile> {
    let mut path = path.to_owned();
    if path.is_dir() {
        let found = LORA_FILES
            .iter()
            .map(|name| path.join(name))
            .find(|p| p.is_file());
        path = found
            .ok_or_else(|| invalid(format!("{} holds none of {:?}", path.display(), LORA_FILES)))?;
    }
    let (source, entries) = Source::open(&path, Code::RunLoraInvalid)
        .map_err(|e| invalid(format!("cannot read the LoRA: {}", e.message())))?;
    let mut tensors = BTreeMap::new();
    for (name, entry) in &entries {
        let bytes = source.read_entry(entry)?;
        tensors.insert(
            name.clone(),
            HostTensor {
                dtype: entry.dtype.clone(),
                shape: entry.shape.clone(),
                bytes,
            },
        );
    }
    let header = header_metadata(&source)?;
    source.check_unchanged()?;
    let mut config = Map::new();
    if let Some(raw) = header
        .get("lora_adapter_metadata")
        .filter(|r| !r.is_empty())
    {
        let value: Value = serde_json::from_str(raw).map_err(|e| {
            invalid(format!(
                "the LoRA {} has malformed lora_adapter_metadata: {e}",
                path.display()
            ))
        })?;
        config = match value {
            Value::Object(map) => map,
            _ => {
                return Err(invalid(format!(
                    "the LoRA {} has an adapter config that is not an object",
                    path.display()
                )))
            }
        };
    }
    let beside = path
        .parent()
        .map(|p| p.join("adapter_config.json"))
        .filter(|p| p.is_file());
    if let (true, Some(beside)) = (config.is_empty(), beside) {
        config = read_config(&beside, &path)?;
    }
    Ok(LoraFile {
        path,
        tensors,
        config,
    })
}

/// The safetensors header's `__metadata__` (strings by key), read again from
/// the open file (its length was checked when the file was opened).
fn header_metadata(source: &Source) -> Result<BTreeMap<String, String>> {
    let mut n = [0u8; 8];
    source.read_at(&mut n, 0)?;
    let n = u64::from_le_bytes(n).min(MAX_HEADER_BYTES) as usize;
    let mut header = vec![0u8; n];
    source.read_at(&mut header, 8)?;
    let value: Value = serde_json::from_slice(&header).map_err(|e| {
        invalid(format!(
            "{}: its header is not JSON: {e}",
            source.path().display()
        ))
    })?;
    let Some(meta) = value.get("__metadata__") else {
        return Ok(BTreeMap::new());
    };
    serde_json::from_value(meta.clone()).map_err(|e| {
        invalid(format!(
            "{}: its __metadata__ is not a map of strings: {e}",
            source.path().display()
        ))
    })
}

/// PEFT's `adapter_config.json` (a regular file, bounded) as a JSON object.
fn read_config(path: &Path, lora: &Path) -> Result<Map<String, Value>> {
    let (file, meta) = open_regular(path, Code::RunLoraInvalid)?;
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(invalid(format!(
            "{} holds {} bytes, more than the {MAX_CONFIG_BYTES} an adapter config may",
            path.display(),
            meta.len()
        )));
    }
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES)
        .read_to_string(&mut text)
        .map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(invalid(format!(
            "the LoRA {} has an adapter config that is not an object",
            lora.display()
        ))),
        Err(e) => Err(invalid(format!("cannot read {}: {e}", path.display()))),
    }
}

/// One weight of the set a LoRA changes: `W <- base + scale · B @ A`.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// The set's name of the weight (`<module>.weight`).
    pub weight: String,
    /// `lora_A`: rank x in (or rank x in x kh x kw).
    pub down: HostTensor,
    /// `lora_B`: out x rank (or out x rank x 1 x 1).
    pub up: HostTensor,
    /// alpha / rank (or / sqrt(rank)) x the caller's scale.
    pub scale: f64,
    /// The rank.
    pub rank: usize,
}

impl Target {
    /// The weight's rows (`out`) and columns (`in`, or `in·kh·kw` of a conv
    /// kernel): `B @ A` is rows x columns.
    pub fn matrix(&self) -> (usize, usize) {
        (self.up.shape[0], self.down.shape[1..].iter().product())
    }
}

/// diffusers packs each component's config under `<component><key>`.
fn component_config(config: &Map<String, Value>, component: &str) -> Map<String, Value> {
    let packed: Map<String, Value> = config
        .iter()
        .filter(|(k, _)| !component.is_empty() && k.starts_with(component))
        .map(|(k, v)| (k[component.len()..].to_owned(), v.clone()))
        .collect();
    if !packed.is_empty() {
        return packed;
    }
    config
        .iter()
        .filter(|(k, _)| !COMPONENT_PREFIXES.iter().any(|p| k.starts_with(p)))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Python's truthiness of a JSON value (`bool(config.get(...))`).
fn truthy(value: Option<&Value>) -> bool {
    match value {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64().is_some_and(|x| x != 0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// A module's alpha from the config: the first `alpha_pattern` key matching
/// the module as PEFT matches it (`(.*\.)?(<key>)$` from the start), else
/// `lora_alpha`.
fn config_alpha(config: &Map<String, Value>, module: &str) -> Result<Option<f64>> {
    if let Some(Value::Object(pattern)) = config.get("alpha_pattern") {
        for (key, value) in pattern {
            let re = regex::Regex::new(&format!(r"\A(?:.*\.)?(?:{key})\z")).map_err(|e| {
                invalid(format!(
                    "the LoRA's alpha_pattern key {key:?} is not a pattern this reader takes: {e}"
                ))
            })?;
            if re.is_match(module) {
                let alpha = match value {
                    Value::Number(n) => n.as_f64(),
                    Value::String(s) => s.trim().parse::<f64>().ok(),
                    _ => None,
                };
                return alpha.map(Some).ok_or_else(|| {
                    invalid(format!(
                        "the LoRA's alpha_pattern gives {key:?} the alpha {value}, not a number"
                    ))
                });
            }
        }
    }
    Ok(config.get("lora_alpha").and_then(Value::as_f64))
}

/// What the set holds under a name: whether its dtype is floating point, and
/// its shape.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<(bool, Vec<i64>)>;

/// The targets of `lora` checked against a weights set (`lookup` answers for
/// each of the set's names): every module it adapts exists (`<path>.weight`),
/// both halves are there, the tensors are floating point, ranks agree and the
/// delta has the weight's shape. Refused (`run.lora_invalid`), with every
/// reason found, otherwise; `scale` must be finite. `prefix` selects one
/// component of a pipeline's LoRA (`"unet."`).
pub fn plan(
    lora: &LoraFile,
    lookup: Lookup<'_>,
    scale: f64,
    prefix: Option<&str>,
) -> Result<Vec<Target>> {
    if !scale.is_finite() {
        return Err(invalid(format!(
            "the LoRA scale must be a finite number, got {scale}"
        )));
    }
    if lora.tensors.is_empty() {
        return Err(invalid("the LoRA holds no tensors"));
    }
    let mut component = "";
    let mut tensors: Vec<(&str, &HostTensor)> =
        lora.tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    if let Some(prefix) = prefix {
        tensors = tensors
            .into_iter()
            .filter_map(|(k, v)| Some((k.strip_prefix(prefix)?, v)))
            .collect();
        if tensors.is_empty() {
            return Err(invalid(format!("the LoRA holds no names under {prefix:?}")));
        }
        component = prefix;
    } else {
        let mut present: Vec<&str> = COMPONENT_PREFIXES
            .iter()
            .copied()
            .filter(|p| tensors.iter().any(|(k, _)| k.starts_with(p)))
            .collect();
        present.sort_unstable();
        if present.len() > 1 {
            return Err(invalid(format!(
                "the LoRA adapts several components ({}): pass prefix= for this weights set",
                present.join(", ")
            )));
        }
        if let Some(only) = present.first() {
            if tensors.iter().all(|(k, _)| k.starts_with(only)) {
                component = only;
                tensors = tensors
                    .into_iter()
                    .map(|(k, v)| (&k[only.len()..], v))
                    .collect();
            }
        }
    }
    let tensors = tensors
        .into_iter()
        .map(|(k, v)| (k.strip_prefix(PEFT_PREFIX).unwrap_or(k), v));
    let config = component_config(&lora.config, component);
    let rslora = truthy(config.get("use_rslora"));

    #[derive(Default)]
    struct Parts<'t> {
        down: Option<&'t HostTensor>,
        up: Option<&'t HostTensor>,
        alpha: Option<&'t HostTensor>,
    }
    let mut modules: BTreeMap<&str, Parts<'_>> = BTreeMap::new();
    let mut unknown: Vec<&str> = Vec::new();
    for (name, value) in tensors {
        if let Some(m) = name.strip_suffix(".lora_A.weight") {
            modules.entry(m).or_default().down = Some(value);
        } else if let Some(m) = name.strip_suffix(".lora_B.weight") {
            modules.entry(m).or_default().up = Some(value);
        } else if let Some(m) = name.strip_suffix(".alpha") {
            modules.entry(m).or_default().alpha = Some(value);
        } else {
            unknown.push(name);
        }
    }
    let mut problems: Vec<String> = Vec::new();
    if !unknown.is_empty() {
        unknown.sort_unstable();
        unknown.truncate(5);
        problems.push(format!("names that are not LoRA weights: {unknown:?}"));
    }
    let mut targets = Vec::new();
    for (module, parts) in modules {
        let (Some(down), Some(up)) = (parts.down, parts.up) else {
            problems.push(format!("{module}: lora_A and lora_B must both be present"));
            continue;
        };
        let weight_name = format!("{module}.weight");
        let Some((weight_float, weight_shape)) = lookup(&weight_name) else {
            problems.push(format!("{module}: the weights set has no {weight_name:?}"));
            continue;
        };
        if !(down.is_float() && up.is_float() && weight_float) {
            problems.push(format!("{module}: LoRA and weight must be floating point"));
            continue;
        }
        if down.shape.len() < 2 || up.shape.len() < 2 || up.shape[2..].iter().any(|&d| d != 1) {
            problems.push(format!(
                "{module}: lora_A {:?} / lora_B {:?} are not a LoRA pair \
                 (lora_B must be out x rank, or a 1 x 1 conv kernel)",
                down.shape, up.shape
            ));
            continue;
        }
        let rank = down.shape[0];
        if up.shape[1] != rank {
            problems.push(format!(
                "{module}: lora_A has rank {rank}, lora_B has {}",
                up.shape[1]
            ));
            continue;
        }
        let delta: Vec<i64> = std::iter::once(up.shape[0])
            .chain(down.shape[1..].iter().copied())
            .map(|d| d as i64)
            .collect();
        if delta != weight_shape {
            problems.push(format!(
                "{module}: the LoRA changes a {delta:?} weight, {weight_name} is {weight_shape:?}"
            ));
            continue;
        }
        if !FLOAT_DTYPES.contains(&down.dtype.as_str())
            || !FLOAT_DTYPES.contains(&up.dtype.as_str())
        {
            problems.push(format!(
                "{module}: LoRA tensors of {} / {} are not read by the native path (one of {FLOAT_DTYPES:?})",
                down.dtype, up.dtype
            ));
            continue;
        }
        let alpha = match parts.alpha {
            Some(t) => match t.first_value() {
                Some(a) => Some(a),
                None => {
                    problems.push(format!(
                        "{module}: its alpha ({} {:?}) holds no number",
                        t.dtype, t.shape
                    ));
                    continue;
                }
            },
            None => match config_alpha(&config, module) {
                Ok(a) => a,
                Err(e) => {
                    problems.push(e.message().to_owned());
                    continue;
                }
            },
        };
        let factor = match alpha {
            None => 1.0,
            Some(alpha) if rslora => alpha / (rank as f64).sqrt(),
            Some(alpha) => alpha / rank as f64,
        };
        let scale = factor * scale;
        if !scale.is_finite() {
            problems.push(format!(
                "{module}: its scale (alpha {alpha:?} over rank {rank}) is not a finite number"
            ));
            continue;
        }
        targets.push(Target {
            weight: weight_name,
            down: down.clone(),
            up: up.clone(),
            scale,
            rank,
        });
    }
    if !problems.is_empty() {
        return Err(invalid(format!(
            "the LoRA does not fit this weights set: {}",
            problems.join("; ")
        )));
    }
    Ok(targets)
}

#[cfg(test)]
#[path = "lora_tests.rs"]
mod tests;
