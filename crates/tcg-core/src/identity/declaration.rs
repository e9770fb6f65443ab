use std::collections::BTreeSet;

use tcg_cj::{is_canonical_string, is_hex, trim_w, Map, Value};

use super::{hex_cj, ingress_digest, GRAPH_FACTS_VERSION};
use crate::{Code, Error, Kind, Result};

/// The raw fields of a declaration, before validation. Fields are JSON values
/// so that callers (the Python bindings, the metadata reader) hand over what
/// they were given and every type rule is decided here.
#[derive(Debug, Clone, PartialEq)]
pub struct DeclarationInput {
    /// The display name (`graph_class.name`), a path-like label.
    pub graph_class: Value,
    /// The target label (part of the facts).
    pub target: Value,
    /// The graph interface object.
    pub graph: Value,
    /// hex16 witness of the program's canonical lines.
    pub graph_witness: Value,
    /// hex32 range digest.
    pub range_digest: Value,
    /// Sequence of `[name, value]` pairs.
    pub fork: Value,
    /// Sequence of `[name, integer]` pairs.
    pub class_dims: Value,
    /// Boolean.
    pub strict: Value,
    /// Integer.
    pub lora_bucket: Value,
    /// `""` or hex32.
    pub literal_values: Value,
    /// Device strings; empty entries are dropped.
    pub placement: Vec<String>,
}

impl Default for DeclarationInput {
    fn default() -> Self {
        DeclarationInput {
            graph_class: Value::Null,
            target: Value::Null,
            graph: Value::Null,
            graph_witness: Value::Null,
            range_digest: Value::Null,
            fork: Value::Array(vec![]),
            class_dims: Value::Array(vec![]),
            strict: Value::Bool(true),
            lora_bucket: Value::Int(0),
            literal_values: Value::Str(String::new()),
            placement: vec![],
        }
    }
}

/// A validated, canonical graph-class declaration (SPEC-v1 §3.6) with its
/// facts-v3 class hash (§3.5). Two declarations are equal iff all their
/// canonical fields are equal.
#[derive(Debug, Clone, PartialEq)]
pub struct GraphClassDeclaration {
    name: String,
    target: String,
    graph: Map,
    graph_witness: String,
    range_digest: String,
    fork: Vec<(String, Value)>,
    class_dims: Vec<(String, i64)>,
    strict: bool,
    lora_bucket: i64,
    literal_values: String,
    placement: Vec<String>,
    class_hash: String,
}

fn fail(code: Code, message: impl Into<String>) -> Error {
    Error::new(code, message)
}

fn check_name(value: &Value) -> Result<String> {
    let code = Code::DeclarationNameInvalid;
    let raw = value.as_str().ok_or_else(|| {
        fail(
            code,
            format!("graph_class must be a string, got {}", value.type_name()),
        )
    })?;
    let name = trim_w(raw);
    if name.is_empty() {
        return Err(fail(code, "graph_class is empty"));
    }
    if name.contains('\\') {
        return Err(fail(
            code,
            format!("graph_class {name:?} contains a backslash"),
        ));
    }
    if name
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(fail(
            code,
            format!("graph_class {name:?} must be a relative path without empty, '.' or '..' components"),
        ));
    }
    Ok(name.to_string())
}

fn check_sorted_strings(graph: &Map, member: &str) -> Result<()> {
    let code = Code::DeclarationGraphList;
    let items = graph[member]
        .as_array()
        .ok_or_else(|| fail(code, format!("graph.{member} must be an array")))?;
    let mut last: Option<&str> = None;
    for item in items {
        let s = match item {
            Value::Str(s) if !s.is_empty() => s.as_str(),
            _ => {
                return Err(fail(
                    code,
                    format!("graph.{member} entries must be non-empty strings"),
                ))
            }
        };
        if last.is_some_and(|l| l >= s) {
            return Err(fail(
                code,
                format!("graph.{member} must be sorted and unique ({s:?})"),
            ));
        }
        last = Some(s);
    }
    Ok(())
}

fn check_graph(value: &Value) -> Result<Map> {
    let graph = match value {
        Value::Object(m) if !m.is_empty() => m,
        _ => {
            return Err(fail(
                Code::DeclarationGraphInvalid,
                "graph must be a non-empty object",
            ))
        }
    };
    if let Err(e) = tcg_cj::to_canonical(value) {
        return Err(fail(
            Code::DeclarationGraphInvalid,
            format!("graph is not canonical json: {e}"),
        ));
    }
    let have: BTreeSet<&str> = graph.keys().map(String::as_str).collect();
    let mut want: BTreeSet<&str> = [
        "constant_fqns",
        "lifted_inputs",
        "pytree",
        "specialization",
        "v",
    ]
    .into();
    if graph.contains_key("literal_values") {
        want.insert("literal_values");
    }
    if have != want {
        let missing: Vec<&str> = want.difference(&have).copied().collect();
        let extra: Vec<&str> = have.difference(&want).copied().collect();
        return Err(fail(
            Code::DeclarationGraphKeys,
            format!("graph members differ (missing {missing:?}, extra {extra:?})"),
        ));
    }
    if graph["v"] != Value::Int(GRAPH_FACTS_VERSION) {
        return Err(fail(
            Code::DeclarationGraphVersion,
            format!("graph.v must be the integer {GRAPH_FACTS_VERSION}"),
        ));
    }
    check_sorted_strings(graph, "constant_fqns")?;
    check_sorted_strings(graph, "lifted_inputs")?;
    for member in ["pytree", "specialization"] {
        if graph[member].as_object().is_none() {
            return Err(fail(
                Code::DeclarationGraphObject,
                format!("graph.{member} must be an object"),
            ));
        }
    }
    Ok(graph.clone())
}

fn pairs(value: &Value, code: Code, what: &str) -> Result<Vec<(String, Value)>> {
    let items = value.as_array().ok_or_else(|| {
        fail(
            code,
            format!("{what} must be a sequence of [name, value] pairs"),
        )
    })?;
    let mut out: Vec<(String, Value)> = Vec::with_capacity(items.len());
    for item in items {
        let (name, v) = match item.as_array().map(Vec::as_slice) {
            Some([Value::Str(n), v]) => (n, v),
            _ => {
                return Err(fail(
                    code,
                    format!("{what} entries must be [name, value] pairs"),
                ))
            }
        };
        if !is_canonical_string(name) {
            return Err(fail(
                code,
                format!("{what} name {name:?} is not a non-empty trimmed string"),
            ));
        }
        if let Some((last, _)) = out.last() {
            if name < last {
                return Err(fail(
                    code,
                    format!("{what} names must be sorted: {name:?} after {last:?}"),
                ));
            }
        }
        if let Err(e) = tcg_cj::to_canonical(v) {
            return Err(fail(
                code,
                format!("{what} value of {name:?} is not canonical json: {e}"),
            ));
        }
        out.push((name.clone(), v.clone()));
    }
    Ok(out)
}

impl GraphClassDeclaration {
    /// Validate and canonicalise, applying SPEC-v1 §3.6 rules 1–10 in order.
    pub fn new(input: DeclarationInput) -> Result<Self> {
        // Rule 1.
        let name = check_name(&input.graph_class)?;
        let target = match &input.target {
            Value::Str(s) if !trim_w(s).is_empty() => trim_w(s).to_string(),
            _ => {
                return Err(fail(
                    Code::DeclarationTargetInvalid,
                    "target must be a non-empty string",
                ))
            }
        };
        // Rules 2–3.
        let graph = check_graph(&input.graph)?;
        // Rule 4.
        let graph_witness = match &input.graph_witness {
            Value::Str(s) if is_hex(s, 16) => s.clone(),
            _ => {
                return Err(fail(
                    Code::DeclarationWitnessInvalid,
                    "graph_witness must be 16 lowercase hex",
                ))
            }
        };
        let range_digest = match &input.range_digest {
            Value::Str(s) if is_hex(s, 32) => s.clone(),
            _ => {
                return Err(fail(
                    Code::DeclarationRangeDigestInvalid,
                    "range_digest must be 32 lowercase hex",
                ))
            }
        };
        // Rule 5.
        let fork = pairs(&input.fork, Code::DeclarationForkInvalid, "fork")?;
        // Rule 6.
        let class_dims = pairs(
            &input.class_dims,
            Code::DeclarationClassDimsInvalid,
            "class_dims",
        )?
        .into_iter()
        .map(|(n, v)| match v {
            Value::Int(i) => Ok((n, i)),
            _ => Err(fail(
                Code::DeclarationClassDimsInvalid,
                format!("class_dims value of {n:?} must be an integer"),
            )),
        })
        .collect::<Result<Vec<_>>>()?;
        // Rule 7.
        let strict = input
            .strict
            .as_bool()
            .ok_or_else(|| fail(Code::DeclarationStrictInvalid, "strict must be a boolean"))?;
        let lora_bucket = input.lora_bucket.as_i64().ok_or_else(|| {
            fail(
                Code::DeclarationLoraBucketInvalid,
                "lora_bucket must be an integer",
            )
        })?;
        // Rule 8.
        let literal_values = match &input.literal_values {
            Value::Str(s) if s.is_empty() || is_hex(s, 32) => s.clone(),
            _ => {
                return Err(fail(
                    Code::DeclarationLiteralValuesInvalid,
                    "literal_values must be \"\" or 32 lowercase hex",
                ))
            }
        };
        match (literal_values.is_empty(), graph.get("literal_values")) {
            (true, None) => {}
            (false, Some(Value::Str(s))) if *s == literal_values => {}
            (true, Some(_)) => {
                return Err(fail(
                    Code::DeclarationLiteralValuesMismatch,
                    "graph.literal_values must be absent when literal_values is empty",
                ))
            }
            (false, _) => {
                return Err(fail(
                    Code::DeclarationLiteralValuesMismatch,
                    "graph.literal_values must equal literal_values",
                ))
            }
        }
        // Rule 9.
        let placement: Vec<String> = input
            .placement
            .into_iter()
            .filter(|p| !p.is_empty())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        if placement.len() == 1 {
            return Err(fail(
                Code::DeclarationPlacementSingle,
                "single-device placement must be omitted",
            ));
        }
        // Rule 10.
        if let Some(ingress) = graph["pytree"].as_object().and_then(|p| p.get("ingress")) {
            let digest = ingress_digest(ingress)?;
            if digest != range_digest {
                return Err(fail(
                    Code::DeclarationIngressMismatch,
                    format!("range_digest {range_digest} does not equal the call ingress digest {digest}"),
                ));
            }
        }
        let mut decl = GraphClassDeclaration {
            name,
            target,
            graph,
            graph_witness,
            range_digest,
            fork,
            class_dims,
            strict,
            lora_bucket,
            literal_values,
            placement,
            class_hash: String::new(),
        };
        decl.class_hash = hex_cj(&decl.facts(), 16, Kind::Declaration)?;
        Ok(decl)
    }

    /// Rebuild a declaration from a metadata `graph_class` object. The members
    /// `class_hash` and `constants` are not inputs and are ignored here.
    pub fn from_graph_class_value(map: &Map) -> Result<Self> {
        let get = |k: &str| map.get(k).cloned().unwrap_or(Value::Null);
        let placement = match map.get("placement") {
            Some(Value::Array(items)) => items
                .iter()
                .map(|p| {
                    p.as_str().map(str::to_string).ok_or_else(|| {
                        fail(
                            Code::DeclarationGraphInvalid,
                            "placement entries must be strings",
                        )
                    })
                })
                .collect::<Result<Vec<_>>>()?,
            _ => {
                return Err(fail(
                    Code::DeclarationGraphInvalid,
                    "placement must be an array of strings",
                ))
            }
        };
        GraphClassDeclaration::new(DeclarationInput {
            graph_class: get("name"),
            target: get("target"),
            graph: get("graph"),
            graph_witness: get("graph_witness"),
            range_digest: get("range_digest"),
            fork: get("fork"),
            class_dims: get("class_dims"),
            strict: get("strict"),
            lora_bucket: get("lora_bucket"),
            literal_values: get("literal_values"),
            placement,
        })
    }

    /// The facts-v3 object whose `hex16(CJ(·))` is the class hash.
    pub fn facts(&self) -> Value {
        let mut facts = Map::new();
        facts.insert("v".into(), Value::Int(GRAPH_FACTS_VERSION));
        facts.insert("target".into(), self.target.clone().into());
        facts.insert("fork".into(), self.fork_value());
        facts.insert("class_dims".into(), self.class_dims_value());
        facts.insert("range_digest".into(), self.range_digest.clone().into());
        facts.insert("graph".into(), Value::Object(self.graph.clone()));
        facts.insert("graph_witness".into(), self.graph_witness.clone().into());
        facts.insert("strict".into(), Value::Bool(self.strict));
        facts.insert("lora_bucket".into(), Value::Int(self.lora_bucket));
        if self.placement.len() >= 2 {
            facts.insert("placement".into(), self.placement_value());
        }
        Value::Object(facts)
    }

    fn fork_value(&self) -> Value {
        Value::Array(
            self.fork
                .iter()
                .map(|(n, v)| Value::Array(vec![n.clone().into(), v.clone()]))
                .collect(),
        )
    }

    fn class_dims_value(&self) -> Value {
        Value::Array(
            self.class_dims
                .iter()
                .map(|(n, v)| Value::Array(vec![n.clone().into(), Value::Int(*v)]))
                .collect(),
        )
    }

    fn placement_value(&self) -> Value {
        Value::Array(self.placement.iter().map(|p| p.clone().into()).collect())
    }

    /// The 13-member metadata `graph_class` object (SPEC-v1 §7.3), with the
    /// given constant rows in package order.
    pub fn to_graph_class_value(&self, constants: Vec<Value>) -> Map {
        let mut m = Map::new();
        m.insert("name".into(), self.name.clone().into());
        m.insert("target".into(), self.target.clone().into());
        m.insert("class_hash".into(), self.class_hash.clone().into());
        m.insert("graph".into(), Value::Object(self.graph.clone()));
        m.insert("graph_witness".into(), self.graph_witness.clone().into());
        m.insert("range_digest".into(), self.range_digest.clone().into());
        m.insert("fork".into(), self.fork_value());
        m.insert("class_dims".into(), self.class_dims_value());
        m.insert("strict".into(), Value::Bool(self.strict));
        m.insert("lora_bucket".into(), Value::Int(self.lora_bucket));
        m.insert("literal_values".into(), self.literal_values.clone().into());
        m.insert("placement".into(), self.placement_value());
        m.insert("constants".into(), Value::Array(constants));
        m
    }

    /// The canonical fields as one object (the 12 declaration members of
    /// `graph_class`, without `constants`), for display and for bindings.
    pub fn to_value(&self) -> Value {
        let mut m = self.to_graph_class_value(vec![]);
        m.remove("constants");
        Value::Object(m)
    }

    /// The display name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The target label.
    pub fn target(&self) -> &str {
        &self.target
    }
    /// The facts-v3 class hash (`graph` axis), 16 hex.
    pub fn class_hash(&self) -> &str {
        &self.class_hash
    }
    /// The graph interface.
    pub fn graph(&self) -> &Map {
        &self.graph
    }
    /// The graph witness.
    pub fn graph_witness(&self) -> &str {
        &self.graph_witness
    }
    /// The range digest.
    pub fn range_digest(&self) -> &str {
        &self.range_digest
    }
    /// The fork pairs.
    pub fn fork(&self) -> &[(String, Value)] {
        &self.fork
    }
    /// The class dims.
    pub fn class_dims(&self) -> &[(String, i64)] {
        &self.class_dims
    }
    /// Strictness.
    pub fn strict(&self) -> bool {
        self.strict
    }
    /// LoRA bucket.
    pub fn lora_bucket(&self) -> i64 {
        self.lora_bucket
    }
    /// `""` or the hex32 literal digest.
    pub fn literal_values(&self) -> &str {
        &self.literal_values
    }
    /// The canonical placement (empty, or two or more devices).
    pub fn placement(&self) -> &[String] {
        &self.placement
    }
}
