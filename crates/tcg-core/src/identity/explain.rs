//! Explaining a miss: the facts that make two keys differ, by axis and by
//! field. Every fact here is one that entered a key (SPEC-v1 §3), so when two
//! keys differ at least one difference is reported, and a difference is only
//! reported for a fact that differs.
//!
//! The diff is plain data (a [`Difference`] list) so that the engine, the
//! bindings and the CLI all print the same thing.

use std::collections::{BTreeMap, BTreeSet};

use tcg_cj::{Map, Value};

use super::{
    compile_policy_title, graph_witness, toolchain_axis, GraphClassDeclaration,
    SETTINGS_DECLARATION,
};

/// Most canonical lines kept per graph for a later line diff.
pub const WITNESS_LINES_MAX_LINES: usize = 32_768;
/// Most bytes of canonical lines kept per graph (the lines joined by LF).
pub const WITNESS_LINES_MAX_BYTES: usize = 4 << 20;
/// Most differing lines shown per side in a line diff.
pub const LINE_DIFF_MAX_LINES: usize = 8;
/// Longest line shown in a line diff, in bytes; longer lines are cut.
pub const LINE_DIFF_MAX_LINE_BYTES: usize = 512;
/// Most leaf differences reported inside one structured fact (an ingress, a pytree).
pub const VALUE_DIFF_MAX: usize = 16;

/// The canonical lines behind a graph witness, as kept at mint time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WitnessLines {
    /// The lines kept (all of them, or a prefix when the program was larger than the caps).
    pub lines: Vec<String>,
    /// Whether every line was kept (then their witness was checked).
    pub complete: bool,
}

impl WitnessLines {
    /// Keep `lines` within the caps; `complete` when nothing was cut.
    pub fn bounded(lines: &[String]) -> WitnessLines {
        let mut kept = Vec::new();
        let mut bytes = 0usize;
        for line in lines.iter().take(WITNESS_LINES_MAX_LINES) {
            bytes += line.len() + 1;
            if bytes > WITNESS_LINES_MAX_BYTES {
                break;
            }
            kept.push(line.clone());
        }
        let complete = kept.len() == lines.len();
        WitnessLines {
            lines: kept,
            complete,
        }
    }

    /// The stored form: canonical JSON `{"v":1,"witness","total_lines","lines"}`.
    pub fn to_bytes(&self, witness: &str, total_lines: usize) -> Vec<u8> {
        let mut m = Map::new();
        m.insert("v".into(), Value::Int(1));
        m.insert("witness".into(), witness.into());
        m.insert("total_lines".into(), Value::Int(total_lines as i64));
        m.insert(
            "lines".into(),
            Value::Array(self.lines.iter().map(|l| l.as_str().into()).collect()),
        );
        tcg_cj::to_canonical(&Value::Object(m)).expect("strings and integers always encode")
    }

    /// Parse the stored form and check it against `witness`: a complete set
    /// must hash to it. `None` for anything that does not hold.
    pub fn from_bytes(bytes: &[u8], witness: &str) -> Option<WitnessLines> {
        let value = tcg_cj::parse_strict(bytes).ok()?;
        let m = value.as_object()?;
        if m.get("v")?.as_i64()? != 1 || m.get("witness")?.as_str()? != witness {
            return None;
        }
        let total = usize::try_from(m.get("total_lines")?.as_i64()?).ok()?;
        let lines = m
            .get("lines")?
            .as_array()?
            .iter()
            .map(|l| l.as_str().map(str::to_string))
            .collect::<Option<Vec<String>>>()?;
        if lines.len() > total || lines.len() > WITNESS_LINES_MAX_LINES {
            return None;
        }
        let complete = lines.len() == total;
        if complete && graph_witness(&lines) != witness {
            return None;
        }
        Some(WitnessLines { lines, complete })
    }
}

/// The facts of one key: what a request states or what a stored artifact records.
#[derive(Debug, Clone)]
pub struct KeyFacts {
    /// The key these facts derive.
    pub key: String,
    /// The graph class declaration (the `graph` axis).
    pub declaration: GraphClassDeclaration,
    /// The `sm` axis.
    pub sm: String,
    /// The toolchain block (the `toolchain` axis is its fold).
    pub toolchain: BTreeMap<String, String>,
    /// The canonical lines behind the witness, where known.
    pub lines: Option<WitnessLines>,
}

/// One fact that differs between a requested key and a stored one.
#[derive(Debug, Clone, PartialEq)]
pub struct Difference {
    /// `graph`, `sm` or `toolchain`.
    pub axis: &'static str,
    /// The fact: `graph_witness`, `range_digest`, `toolchain.cxx`, `sm`, …
    pub fact: String,
    /// The requested side's value (`null` when absent there).
    pub requested: Value,
    /// The stored side's value (`null` when absent there).
    pub stored: Value,
    /// Detail where the fact is structured: names added and removed, leaf
    /// differences, or the first differing canonical lines.
    pub detail: Option<Value>,
}

impl Difference {
    /// The stable JSON form: `{"axis","fact","requested","stored"[,"detail"]}`.
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        m.insert("axis".into(), self.axis.into());
        m.insert("fact".into(), self.fact.clone().into());
        m.insert("requested".into(), self.requested.clone());
        m.insert("stored".into(), self.stored.clone());
        if let Some(d) = &self.detail {
            m.insert("detail".into(), d.clone());
        }
        Value::Object(m)
    }
}

fn diff(
    axis: &'static str,
    fact: impl Into<String>,
    requested: Value,
    stored: Value,
) -> Difference {
    Difference {
        axis,
        fact: fact.into(),
        requested,
        stored,
        detail: None,
    }
}

/// Leaf differences between two JSON values, as `{"path","requested","stored"}`
/// rows, at most [`VALUE_DIFF_MAX`]. Objects are compared member by member;
/// arrays of equal length element by element; anything else as a whole.
pub fn value_diff(requested: &Value, stored: &Value) -> Vec<Value> {
    fn walk(path: &str, a: &Value, b: &Value, out: &mut Vec<Value>) {
        if a == b || out.len() >= VALUE_DIFF_MAX {
            return;
        }
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let names: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for name in names {
                    let here = if path.is_empty() {
                        name.clone()
                    } else {
                        format!("{path}.{name}")
                    };
                    let none = Value::Null;
                    walk(
                        &here,
                        x.get(name).unwrap_or(&none),
                        y.get(name).unwrap_or(&none),
                        out,
                    );
                }
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (p, q)) in x.iter().zip(y).enumerate() {
                    walk(&format!("{path}[{i}]"), p, q, out);
                }
            }
            _ => {
                let mut row = Map::new();
                row.insert("path".into(), path.into());
                row.insert("requested".into(), a.clone());
                row.insert("stored".into(), b.clone());
                out.push(Value::Object(row));
            }
        }
    }
    let mut out = Vec::new();
    walk("", requested, stored, &mut out);
    out
}

fn cut(line: &str) -> Value {
    if line.len() <= LINE_DIFF_MAX_LINE_BYTES {
        return line.into();
    }
    let mut end = LINE_DIFF_MAX_LINE_BYTES;
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &line[..end]).into()
}

/// The first differing canonical lines: the common prefix and suffix are
/// skipped; when both differing middles have the same length (ops replaced,
/// a bound changed) only the lines that differ pairwise are kept, else the
/// whole middles. At most [`LINE_DIFF_MAX_LINES`] lines are shown per side,
/// with their 0-based line numbers. Linear in the input.
pub fn line_diff(requested: &[String], stored: &[String]) -> Value {
    let prefix = requested
        .iter()
        .zip(stored)
        .take_while(|(a, b)| a == b)
        .count();
    let suffix = requested[prefix..]
        .iter()
        .rev()
        .zip(stored[prefix..].iter().rev())
        .take_while(|(a, b)| a == b)
        .count();
    let (ma, mb) = (
        &requested[prefix..requested.len() - suffix],
        &stored[prefix..stored.len() - suffix],
    );
    // Offsets into the middles of the lines to show.
    let offsets: Vec<usize> = if ma.len() == mb.len() {
        (0..ma.len()).filter(|&i| ma[i] != mb[i]).collect()
    } else {
        (0..ma.len().max(mb.len())).collect()
    };
    let side = |middle: &[String]| -> Value {
        Value::Array(
            offsets
                .iter()
                .filter(|&&i| i < middle.len())
                .take(LINE_DIFF_MAX_LINES)
                .map(|&i| Value::Array(vec![Value::Int((prefix + i) as i64), cut(&middle[i])]))
                .collect(),
        )
    };
    let count = |middle: &[String]| offsets.iter().filter(|&&i| i < middle.len()).count();
    let mut m = Map::new();
    m.insert("first_line".into(), Value::Int(prefix as i64));
    m.insert("requested_lines".into(), Value::Int(count(ma) as i64));
    m.insert("stored_lines".into(), Value::Int(count(mb) as i64));
    m.insert("requested".into(), side(ma));
    m.insert("stored".into(), side(mb));
    Value::Object(m)
}

fn strings(items: &[String]) -> Value {
    Value::Array(items.iter().map(|s| s.as_str().into()).collect())
}

fn pairs_by_name(pairs: &[(String, Value)]) -> BTreeMap<&str, &Value> {
    pairs.iter().map(|(n, v)| (n.as_str(), v)).collect()
}

fn named_diffs(
    out: &mut Vec<Difference>,
    prefix: &str,
    a: BTreeMap<&str, &Value>,
    b: BTreeMap<&str, &Value>,
) {
    let names: BTreeSet<&str> = a.keys().chain(b.keys()).copied().collect();
    for name in names {
        let (x, y) = (a.get(name), b.get(name));
        if x != y {
            out.push(diff(
                "graph",
                format!("{prefix}.{name}"),
                x.map(|v| (*v).clone()).unwrap_or(Value::Null),
                y.map(|v| (*v).clone()).unwrap_or(Value::Null),
            ));
        }
    }
}

fn name_list(graph: &Map, member: &str) -> BTreeSet<String> {
    graph
        .get(member)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect()
}

fn graph_interface_diffs(out: &mut Vec<Difference>, a: &Map, b: &Map, range_differs: bool) {
    for member in ["constant_fqns", "lifted_inputs"] {
        let (x, y) = (name_list(a, member), name_list(b, member));
        if x != y {
            let mut detail = Map::new();
            let added: Vec<String> = x.difference(&y).cloned().collect();
            let removed: Vec<String> = y.difference(&x).cloned().collect();
            // "added": in the request, not in the stored graph.
            detail.insert("added".into(), strings(&added));
            detail.insert("removed".into(), strings(&removed));
            out.push(Difference {
                detail: Some(Value::Object(detail)),
                ..diff(
                    "graph",
                    format!("graph.{member}"),
                    a[member].clone(),
                    b[member].clone(),
                )
            });
        }
    }
    let none = Value::Null;
    let pytree = |m: &Map| m.get("pytree").and_then(Value::as_object).cloned();
    let (pa, pb) = (pytree(a).unwrap_or_default(), pytree(b).unwrap_or_default());
    let names: BTreeSet<&String> = pa.keys().chain(pb.keys()).collect();
    for name in names {
        let (x, y) = (pa.get(name).unwrap_or(&none), pb.get(name).unwrap_or(&none));
        // The call ingress is what the range digest hashes: when both differ,
        // the ingress detail is reported under `range_digest`, once.
        if x == y || (name == "ingress" && range_differs) {
            continue;
        }
        out.push(Difference {
            detail: Some(Value::Array(value_diff(x, y))),
            ..diff(
                "graph",
                format!("graph.pytree.{name}"),
                x.clone(),
                y.clone(),
            )
        });
    }
    let (x, y) = (
        a.get("specialization").unwrap_or(&none),
        b.get("specialization").unwrap_or(&none),
    );
    if x != y {
        out.push(Difference {
            detail: Some(Value::Array(value_diff(x, y))),
            ..diff("graph", "graph.specialization", x.clone(), y.clone())
        });
    }
}

fn ingress_of(d: &GraphClassDeclaration) -> Value {
    d.graph()
        .get("pytree")
        .and_then(Value::as_object)
        .and_then(|p| p.get("ingress"))
        .cloned()
        .unwrap_or(Value::Null)
}

/// The graph-axis facts that differ. `graph.literal_values` is reported
/// once, as `literal_values`.
pub fn graph_diffs(
    requested: &GraphClassDeclaration,
    stored: &GraphClassDeclaration,
    lines: (Option<&WitnessLines>, Option<&WitnessLines>),
) -> Vec<Difference> {
    let (a, b) = (requested, stored);
    let mut out = Vec::new();
    if a.target() != b.target() {
        out.push(diff(
            "graph",
            "target",
            a.target().into(),
            b.target().into(),
        ));
    }
    if a.graph_witness() != b.graph_witness() {
        let detail = match lines {
            (Some(x), Some(y)) => {
                let mut d = line_diff(&x.lines, &y.lines);
                if let Value::Object(m) = &mut d {
                    m.insert("complete".into(), Value::Bool(x.complete && y.complete));
                }
                d
            }
            (x, y) => {
                let mut m = Map::new();
                m.insert(
                    "unavailable".into(),
                    Value::from(match (x.is_some(), y.is_some()) {
                        (false, false) => "neither side's canonical lines are known",
                        (false, true) => "the requested side's canonical lines are not known",
                        _ => "the stored artifact's canonical lines were not kept",
                    }),
                );
                Value::Object(m)
            }
        };
        out.push(Difference {
            detail: Some(detail),
            ..diff(
                "graph",
                "graph_witness",
                a.graph_witness().into(),
                b.graph_witness().into(),
            )
        });
    }
    let range_differs = a.range_digest() != b.range_digest();
    if range_differs {
        let (x, y) = (ingress_of(a), ingress_of(b));
        out.push(Difference {
            detail: (x != y).then(|| Value::Array(value_diff(&x, &y))),
            ..diff(
                "graph",
                "range_digest",
                a.range_digest().into(),
                b.range_digest().into(),
            )
        });
    }
    named_diffs(
        &mut out,
        "fork",
        pairs_by_name(a.fork()),
        pairs_by_name(b.fork()),
    );
    let dims = |d: &GraphClassDeclaration| -> Vec<(String, Value)> {
        d.class_dims()
            .iter()
            .map(|(n, v)| (n.clone(), Value::Int(*v)))
            .collect()
    };
    let (da, db) = (dims(a), dims(b));
    named_diffs(
        &mut out,
        "class_dims",
        pairs_by_name(&da),
        pairs_by_name(&db),
    );
    if a.strict() != b.strict() {
        out.push(diff(
            "graph",
            "strict",
            a.strict().into(),
            b.strict().into(),
        ));
    }
    if a.lora_bucket() != b.lora_bucket() {
        out.push(diff(
            "graph",
            "lora_bucket",
            a.lora_bucket().into(),
            b.lora_bucket().into(),
        ));
    }
    if a.literal_values() != b.literal_values() {
        out.push(diff(
            "graph",
            "literal_values",
            a.literal_values().into(),
            b.literal_values().into(),
        ));
    }
    if a.placement() != b.placement() {
        out.push(diff(
            "graph",
            "placement",
            strings(a.placement()),
            strings(b.placement()),
        ));
    }
    graph_interface_diffs(&mut out, a.graph(), b.graph(), range_differs);
    out
}

/// Every fact that differs between a requested key and a stored one, axis by
/// axis in key order (`graph`, `sm`, `toolchain`). Empty iff the keys are equal
/// (the display name is not a fact and is never reported).
pub fn diff_facts(requested: &KeyFacts, stored: &KeyFacts) -> Vec<Difference> {
    let mut out = graph_diffs(
        &requested.declaration,
        &stored.declaration,
        (requested.lines.as_ref(), stored.lines.as_ref()),
    );
    if requested.sm != stored.sm {
        out.push(diff(
            "sm",
            "sm",
            requested.sm.as_str().into(),
            stored.sm.as_str().into(),
        ));
    }
    if toolchain_axis(&requested.toolchain) != toolchain_axis(&stored.toolchain) {
        let names: BTreeSet<&String> = requested
            .toolchain
            .keys()
            .chain(stored.toolchain.keys())
            .filter(|k| !super::TOOLCHAIN_EXCLUDED.contains(&k.as_str()))
            .collect();
        for name in names {
            let (x, y) = (requested.toolchain.get(name), stored.toolchain.get(name));
            if x != y {
                let v =
                    |s: Option<&String>| s.map(|s| Value::from(s.as_str())).unwrap_or(Value::Null);
                let mut d = diff("toolchain", format!("toolchain.{name}"), v(x), v(y));
                if name == SETTINGS_DECLARATION {
                    d.detail = policy_detail(x, y);
                }
                out.push(d);
            }
        }
    }
    out
}

/// The names of the compile policies behind two `settings_declaration`
/// digests (`{"policies": {"requested", "stored"}}`, `null` for a digest of no
/// known policy), so that `explain` names a variant rather than two digests;
/// `None` when neither side is a known policy.
fn policy_detail(requested: Option<&String>, stored: Option<&String>) -> Option<Value> {
    let title = |s: Option<&String>| s.and_then(|s| compile_policy_title(s));
    let (a, b) = (title(requested), title(stored));
    if a.is_none() && b.is_none() {
        return None;
    }
    let side = |t: Option<&'static str>| t.map(Value::from).unwrap_or(Value::Null);
    let mut policies = Map::new();
    policies.insert("requested".into(), side(a));
    policies.insert("stored".into(), side(b));
    let mut m = Map::new();
    m.insert("policies".into(), Value::Object(policies));
    Some(Value::Object(m))
}

/// The axes that differ, in key order, from a difference list.
pub fn differing_axes(diffs: &[Difference]) -> Vec<&'static str> {
    super::KEY_AXES
        .iter()
        .copied()
        .filter(|axis| diffs.iter().any(|d| d.axis == *axis))
        .collect()
}
