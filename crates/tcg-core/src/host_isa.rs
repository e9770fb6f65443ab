//! Host ISA: read this host, state the mint requirement, validate recorded
//! facts and admit (SPEC-v1 §5).
//!
//! The hit path needs neither Python nor torch, so the core crate reads the
//! host itself: the kernel's machine name and `/proc/cpuinfo`. Everything fails
//! closed (§5.7): no fact is ever defaulted.

use std::collections::BTreeSet;

use tcg_cj::{Map, Value};

use crate::error::{Code, Error, Result};

/// The x86-64 baseline level (adds nothing).
pub const LEVEL_X86_64: &str = "x86-64";
/// The x86-64-v2 level.
pub const LEVEL_X86_64_V2: &str = "x86-64-v2";
/// The x86-64-v3 level: the highest level ever recorded (the clamp).
pub const LEVEL_X86_64_V3: &str = "x86-64-v3";
/// The x86-64-v4 level: known, never recorded, refused on read.
pub const LEVEL_X86_64_V4: &str = "x86-64-v4";
/// The level, march and simdlen of every non-x86 requirement.
pub const LEVEL_NATIVE: &str = "native";
/// The machine name of x86-64 hosts.
pub const MACHINE_X86_64: &str = "x86_64";
/// The feature text of an empty feature set.
pub const FEATURES_NONE: &str = "none";

/// The flags each x86-64 level adds to the one below, with Linux's
/// `/proc/cpuinfo` spellings (LZCNT is `abm`).
pub const X86_LEVELS: [(&str, &[&str]); 4] = [
    (LEVEL_X86_64, &[]),
    (
        LEVEL_X86_64_V2,
        &["cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"],
    ),
    (
        LEVEL_X86_64_V3,
        &[
            "abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave",
        ],
    ),
    (
        LEVEL_X86_64_V4,
        &["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"],
    ),
];

/// The five member names of a `host_isa` object, in CJ order.
pub const HOST_ISA_FIELDS: [&str; 5] = [
    "cpp_march",
    "cpp_simdlen",
    "host_isa_features",
    "host_isa_level",
    "machine",
];

/// The cumulative flags of an x86-64 level (every flag of it and of the
/// levels below), or `None` for a name that is not a level.
pub fn cumulative_flags(level: &str) -> Option<BTreeSet<&'static str>> {
    let mut out = BTreeSet::new();
    for (name, adds) in X86_LEVELS {
        out.extend(adds.iter().copied());
        if name == level {
            return Some(out);
        }
    }
    None
}

/// The facts read off a host: its machine name and the features every one of
/// its processors reports (§5.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFacts {
    machine: String,
    features: BTreeSet<String>,
}

/// The five recorded facts of an artifact's `host_isa` (§5.3, §5.5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostIsa {
    /// The machine name, for example `x86_64`.
    pub machine: String,
    /// The level: `x86-64`, `x86-64-v2`, `x86-64-v3` or `native`.
    pub host_isa_level: String,
    /// Sorted, comma-joined feature names, or `none`.
    pub host_isa_features: String,
    /// The `-march` the code was compiled for (the level, or `native`).
    pub cpp_march: String,
    /// `256`, `128` or `native`.
    pub cpp_simdlen: String,
}

fn unreadable(message: impl Into<String>) -> Error {
    Error::new(Code::AdmissionHostUnreadable, message)
}

/// The kernel's machine name (`uname -m`), unmodified.
fn uname_machine() -> Result<String> {
    // SAFETY: `utsname` is plain old data; `uname` fills it on success and the
    // field is NUL-terminated within its array.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::uname(&mut uts) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        return Err(unreadable(format!(
            "cannot read the host machine name: {err}"
        )));
    }
    let bytes: Vec<u8> = uts
        .machine
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Non-ASCII bytes become U+FFFD, one per byte (§5.2).
fn ascii_lossy(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| if b.is_ascii() { b as char } else { '\u{fffd}' })
        .collect()
}

fn is_token_separator(c: char) -> bool {
    matches!(c as u32, 0x09..=0x0d | 0x1c..=0x1f | 0x20)
}

/// The host features stated by `/proc/cpuinfo` bytes: the intersection over
/// every `flags` or `features` line of its lower-cased tokens (§5.2). A text
/// without such a line fails (`admission.host_unreadable`).
pub fn parse_cpuinfo(bytes: &[u8]) -> Result<BTreeSet<String>> {
    let text = ascii_lossy(bytes);
    let mut result: Option<BTreeSet<String>> = None;
    for line in text.split('\n') {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let key = tcg_cj::trim_w(key).to_lowercase();
        if key != "flags" && key != "features" {
            continue;
        }
        let tokens: BTreeSet<String> = value
            .split(is_token_separator)
            .filter(|t| !t.is_empty())
            .map(|t| t.to_lowercase())
            .collect();
        result = Some(match result {
            None => tokens,
            Some(prev) => prev.intersection(&tokens).cloned().collect(),
        });
    }
    result.ok_or_else(|| unreadable("/proc/cpuinfo has no flags or features line"))
}

impl HostFacts {
    /// Read this host: `uname` machine and `/proc/cpuinfo` (§5.2). Failures are
    /// `admission.host_unreadable`.
    pub fn read() -> Result<HostFacts> {
        let machine = uname_machine()?;
        let cpuinfo = std::fs::read("/proc/cpuinfo")
            .map_err(|e| unreadable(format!("cannot read /proc/cpuinfo: {e}")))?;
        HostFacts::from_parts(&machine, &cpuinfo)
    }

    /// Host facts from a machine name and `/proc/cpuinfo` bytes, with the
    /// same rules as [`HostFacts::read`] (for tests and diagnostics).
    pub fn from_parts(machine: &str, cpuinfo: &[u8]) -> Result<HostFacts> {
        let features = parse_cpuinfo(cpuinfo)?;
        HostFacts::from_features(machine, features)
    }

    /// Host facts from a machine name and an already-parsed feature set.
    pub fn from_features<I, S>(machine: &str, features: I) -> Result<HostFacts>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let machine = tcg_cj::trim_w(machine).to_lowercase();
        if machine.is_empty() {
            return Err(unreadable("the host machine name is empty"));
        }
        Ok(HostFacts {
            machine,
            features: features.into_iter().map(Into::into).collect(),
        })
    }

    /// The machine name, trimmed and lower-cased.
    pub fn machine(&self) -> &str {
        &self.machine
    }

    /// The features every processor reports.
    pub fn features(&self) -> &BTreeSet<String> {
        &self.features
    }

    /// The highest x86-64 level whose cumulative flags this host has, walking
    /// upward from v2 and stopping at the first failure (`x86-64` when v2
    /// fails). Meaningful on x86-64 hosts only.
    pub fn x86_level(&self) -> &'static str {
        let mut have = true;
        let mut level = LEVEL_X86_64;
        for (name, adds) in X86_LEVELS.iter().skip(1) {
            have = have && adds.iter().all(|f| self.features.contains(*f));
            if !have {
                break;
            }
            level = name;
        }
        level
    }

    /// The requirement recorded at mint (§5.3): on x86-64 the host level
    /// clamped to v3, elsewhere the whole feature set as `native`. A non-x86
    /// host without features fails (`declaration.host_policy`; callers in the
    /// compiler re-wrap it).
    pub fn requirement(&self) -> Result<HostIsa> {
        if self.machine == MACHINE_X86_64 {
            let host = self.x86_level();
            let march = if host == LEVEL_X86_64_V4 {
                LEVEL_X86_64_V3
            } else {
                host
            };
            let flags = cumulative_flags(march).expect("march is a level");
            let features = if flags.is_empty() {
                FEATURES_NONE.to_owned()
            } else {
                flags.into_iter().collect::<Vec<_>>().join(",")
            };
            let simdlen = if march == LEVEL_X86_64_V3 {
                "256"
            } else {
                "128"
            };
            return Ok(HostIsa {
                machine: MACHINE_X86_64.to_owned(),
                host_isa_level: march.to_owned(),
                host_isa_features: features,
                cpp_march: march.to_owned(),
                cpp_simdlen: simdlen.to_owned(),
            });
        }
        if self.features.is_empty() {
            return Err(Error::new(
                Code::DeclarationHostPolicy,
                format!(
                    "host {} reports no CPU features: cannot state a native ISA requirement",
                    self.machine
                ),
            ));
        }
        Ok(HostIsa {
            machine: self.machine.clone(),
            host_isa_level: LEVEL_NATIVE.to_owned(),
            host_isa_features: self.features.iter().cloned().collect::<Vec<_>>().join(","),
            cpp_march: LEVEL_NATIVE.to_owned(),
            cpp_simdlen: LEVEL_NATIVE.to_owned(),
        })
    }

    /// The CPU `sm` value of this host (§4.2): `cpu-` and the recorded level
    /// on x86-64 (`cpu-x86-64-v3`), `cpu-<machine>-native` elsewhere.
    pub fn cpu_sm(&self) -> Result<String> {
        let req = self.requirement()?;
        if self.machine == MACHINE_X86_64 {
            Ok(format!("cpu-{}", req.host_isa_level))
        } else {
            Ok(format!("cpu-{}-native", self.machine))
        }
    }
}

/// Decode a recorded feature text (§5.5): `none` is the empty set; otherwise a
/// comma list, already sorted and unique, of non-empty, trimmed, lower-case
/// items.
fn decode_features(text: &str) -> std::result::Result<Vec<&str>, String> {
    if text == FEATURES_NONE {
        return Ok(Vec::new());
    }
    let items: Vec<&str> = text.split(',').collect();
    for item in &items {
        if item.is_empty() {
            return Err(format!("host_isa_features {text:?} has an empty item"));
        }
        if tcg_cj::trim_w(item) != *item || item.to_lowercase() != *item {
            return Err(format!(
                "host_isa_features item {item:?} is not trimmed lower-case"
            ));
        }
    }
    if items.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!(
            "host_isa_features {text:?} is not sorted and unique"
        ));
    }
    Ok(items)
}

impl HostIsa {
    /// Validate a recorded `host_isa` value (§5.5). Failures carry `code`
    /// (`artifact.host_isa_invalid` when reading metadata) and the message
    /// prefix "host_isa facts are invalid: ".
    pub fn from_value(value: &Value, code: Code) -> Result<HostIsa> {
        HostIsa::parse(value)
            .map_err(|m| Error::new(code, format!("host_isa facts are invalid: {m}")))
    }

    fn parse(value: &Value) -> std::result::Result<HostIsa, String> {
        let map = value
            .as_object()
            .ok_or_else(|| format!("host_isa must be an object, got {}", value.type_name()))?;
        let extra: Vec<&str> = map
            .keys()
            .map(String::as_str)
            .filter(|k| !HOST_ISA_FIELDS.contains(k))
            .collect();
        let missing: Vec<&str> = HOST_ISA_FIELDS
            .iter()
            .copied()
            .filter(|k| !map.contains_key(*k))
            .collect();
        if !extra.is_empty() || !missing.is_empty() {
            return Err(format!(
                "host_isa must have exactly the members {HOST_ISA_FIELDS:?} (missing {missing:?}, extra {extra:?})"
            ));
        }
        let get = |k: &str| -> std::result::Result<String, String> {
            match &map[k] {
                Value::Str(s) => Ok(s.clone()),
                other => Err(format!(
                    "host_isa.{k} must be a string, got {}",
                    other.type_name()
                )),
            }
        };
        let facts = HostIsa {
            machine: get("machine")?,
            host_isa_level: get("host_isa_level")?,
            host_isa_features: get("host_isa_features")?,
            cpp_march: get("cpp_march")?,
            cpp_simdlen: get("cpp_simdlen")?,
        };
        let features = decode_features(&facts.host_isa_features)?;
        let m = &facts.machine;
        if m.is_empty() || tcg_cj::trim_w(m) != m || m.to_lowercase() != *m {
            return Err(format!(
                "machine {m:?} is not a non-empty trimmed lower-case name"
            ));
        }
        let level = facts.host_isa_level.as_str();
        if m == MACHINE_X86_64 {
            let flags = match level {
                LEVEL_X86_64 | LEVEL_X86_64_V2 | LEVEL_X86_64_V3 => {
                    cumulative_flags(level).expect("known level")
                }
                LEVEL_X86_64_V4 => {
                    return Err(
                        "level x86-64-v4 is never recorded (code is clamped to x86-64-v3)".into(),
                    )
                }
                other => return Err(format!("unknown x86_64 level {other:?}")),
            };
            if facts.cpp_march != level {
                return Err(format!(
                    "cpp_march {:?} does not equal the level {level:?}",
                    facts.cpp_march
                ));
            }
            let simdlen = if level == LEVEL_X86_64_V3 {
                "256"
            } else {
                "128"
            };
            if facts.cpp_simdlen != simdlen {
                return Err(format!(
                    "cpp_simdlen {:?} must be {simdlen:?} for {level}",
                    facts.cpp_simdlen
                ));
            }
            if !features.iter().copied().eq(flags.iter().copied()) {
                return Err(format!(
                    "host_isa_features {:?} do not restate the flags of {level}",
                    facts.host_isa_features
                ));
            }
        } else {
            if level != LEVEL_NATIVE
                || facts.cpp_march != LEVEL_NATIVE
                || facts.cpp_simdlen != LEVEL_NATIVE
            {
                return Err(format!(
                    "machine {m} requires level, cpp_march and cpp_simdlen \"native\""
                ));
            }
            if features.is_empty() {
                return Err(format!("machine {m} states no features"));
            }
        }
        Ok(facts)
    }

    /// The decoded feature set (empty for `none`).
    pub fn feature_set(&self) -> BTreeSet<String> {
        if self.host_isa_features == FEATURES_NONE {
            BTreeSet::new()
        } else {
            self.host_isa_features
                .split(',')
                .map(str::to_owned)
                .collect()
        }
    }

    /// The `host_isa` object (5 string members).
    pub fn to_map(&self) -> Map {
        let mut m = Map::new();
        m.insert("cpp_march".into(), Value::Str(self.cpp_march.clone()));
        m.insert("cpp_simdlen".into(), Value::Str(self.cpp_simdlen.clone()));
        m.insert(
            "host_isa_features".into(),
            Value::Str(self.host_isa_features.clone()),
        );
        m.insert(
            "host_isa_level".into(),
            Value::Str(self.host_isa_level.clone()),
        );
        m.insert("machine".into(), Value::Str(self.machine.clone()));
        m
    }

    /// The `host_isa` value.
    pub fn to_value(&self) -> Value {
        Value::Object(self.to_map())
    }

    /// Admission of these (already validated) facts on `host` (§5.6 steps 2–3):
    /// `admission.host_machine` or `admission.host_features`.
    pub fn admit_on(&self, host: &HostFacts) -> Result<()> {
        const PREFIX: &str = "artifact host ISA is unsupported: ";
        if self.machine != host.machine() {
            return Err(Error::new(
                Code::AdmissionHostMachine,
                format!(
                    "{PREFIX}artifact host code is {}, this host is {}",
                    self.machine,
                    host.machine()
                ),
            ));
        }
        let lacking: Vec<String> = self
            .feature_set()
            .into_iter()
            .filter(|f| !host.features().contains(f))
            .collect();
        if !lacking.is_empty() {
            return Err(Error::new(
                Code::AdmissionHostFeatures,
                format!(
                    "{PREFIX}artifact requires {} but this host lacks {}",
                    self.host_isa_level,
                    lacking.join(",")
                ),
            ));
        }
        Ok(())
    }
}

/// Full admission of a recorded `host_isa` value on `host` (§5.6). An absent
/// or invalid record is `admission.host_isa_missing`; a machine mismatch or a
/// feature shortfall is `admission.host_machine` / `admission.host_features`.
pub fn admit(recorded: Option<&Value>, host: &HostFacts) -> Result<HostIsa> {
    let value = recorded.ok_or_else(|| {
        Error::new(
            Code::AdmissionHostIsaMissing,
            "artifact host ISA is unsupported: the artifact records no host_isa",
        )
    })?;
    let facts = HostIsa::from_value(value, Code::AdmissionHostIsaMissing).map_err(|e| {
        Error::new(
            e.code(),
            format!("artifact host ISA is unsupported: {}", e.message()),
        )
    })?;
    facts.admit_on(host)?;
    Ok(facts)
}

/// Admission of a recorded `host_isa` value on this host, read now. Unreadable
/// host facts are `admission.host_unreadable`.
pub fn admit_this_host(recorded: Option<&Value>) -> Result<HostIsa> {
    let host = HostFacts::read()?;
    admit(recorded, &host)
}

/// The requirement this host records at mint (§5.3).
pub fn host_requirement() -> Result<HostIsa> {
    HostFacts::read()?.requirement()
}

/// The CPU `sm` value of this host (§4.2), for example `cpu-x86-64-v3`.
pub fn cpu_sm() -> Result<String> {
    HostFacts::read()?.cpu_sm()
}
