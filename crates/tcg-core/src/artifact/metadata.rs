//! `metadata.json` (SPEC-v1 §7): validation in the order of §7.5, with the
//! exact codes, and `build_metadata`, the only producer of metadata.

use std::collections::{BTreeMap, BTreeSet};

use tcg_cj::{is_canonical_string, Map, Value};

use crate::error::{Code, Error, Result};
use crate::host_isa::HostIsa;
use crate::identity::{
    derive_key, is_compiled_graph_key, toolchain_axis, validate_toolchain_block,
    GraphClassDeclaration, ARTIFACT_KIND, COMPILED_GRAPH_FORMAT,
};

/// The 9 top-level members.
pub const METADATA_FIELDS: [&str; 9] = [
    "compiled_graph_format",
    "compiled_graph_key",
    "constant_folding_fenced",
    "graph_class",
    "host_isa",
    "kind",
    "package_constants_in_so",
    "sm",
    "toolchain",
];
/// The 13 `graph_class` members.
pub const GRAPH_CLASS_FIELDS: [&str; 13] = [
    "class_dims",
    "class_hash",
    "constants",
    "fork",
    "graph",
    "graph_witness",
    "literal_values",
    "lora_bucket",
    "name",
    "placement",
    "range_digest",
    "strict",
    "target",
];
/// The 4 constant-row members.
pub const CONSTANT_ROW_FIELDS: [&str; 4] = ["dtype", "fqn", "shape", "source"];

/// The compile policy facts that metadata records (§7.2, §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompilePolicy {
    /// `package_constants_in_so`: constants are never baked into the `.so`.
    pub package_constants_in_so: bool,
    /// `constant_folding_fenced`: constant folding is fenced.
    pub constant_folding_fenced: bool,
}

/// The sole compile policy of format 1.
pub const COMPILE_POLICY: CompilePolicy = CompilePolicy {
    package_constants_in_so: false,
    constant_folding_fenced: true,
};

/// Where a constant's value comes from (§7.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ConstantSource {
    /// A parameter or buffer, bound from the state dict by fqn.
    StateDict,
    /// A folded constant, computed at load.
    Computed,
    /// A literal, carried in `constants.safetensors`.
    Literal,
}

impl ConstantSource {
    /// The recorded text: `state_dict`, `computed` or `literal`.
    pub fn as_str(self) -> &'static str {
        match self {
            ConstantSource::StateDict => "state_dict",
            ConstantSource::Computed => "computed",
            ConstantSource::Literal => "literal",
        }
    }

    /// Parse the recorded text.
    pub fn parse(s: &str) -> Option<ConstantSource> {
        match s {
            "state_dict" => Some(ConstantSource::StateDict),
            "computed" => Some(ConstantSource::Computed),
            "literal" => Some(ConstantSource::Literal),
            _ => None,
        }
    }
}

/// One constant row: a manifest row of the package's constant table (§7.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConstantRow {
    /// The fully qualified name.
    pub fqn: String,
    /// The source.
    pub source: ConstantSource,
    /// Inductor's short dtype name, for example `float32`.
    pub dtype: String,
    /// The shape.
    pub shape: Vec<u64>,
}

impl ConstantRow {
    /// The 4-member row object.
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        m.insert("dtype".into(), Value::Str(self.dtype.clone()));
        m.insert("fqn".into(), Value::Str(self.fqn.clone()));
        m.insert(
            "shape".into(),
            Value::Array(self.shape.iter().map(|&d| Value::Int(d as i64)).collect()),
        );
        m.insert("source".into(), Value::Str(self.source.as_str().into()));
        Value::Object(m)
    }

    /// Parse and check one row (`artifact.constants_invalid`).
    pub fn from_value(value: &Value) -> Result<ConstantRow> {
        let bad = |m: String| {
            Error::new(
                Code::ArtifactConstantsInvalid,
                format!("constant row is invalid: {m}"),
            )
        };
        let map = value
            .as_object()
            .ok_or_else(|| bad(format!("expected an object, got {}", value.type_name())))?;
        if !map.keys().map(String::as_str).eq(CONSTANT_ROW_FIELDS) {
            return Err(bad(format!(
                "members must be exactly {CONSTANT_ROW_FIELDS:?}"
            )));
        }
        let text = |k: &str| match &map[k] {
            Value::Str(s) if is_canonical_string(s) => Ok(s.clone()),
            _ => Err(bad(format!("{k} must be a non-empty trimmed string"))),
        };
        let fqn = text("fqn")?;
        let source_text = text("source")?;
        let source = ConstantSource::parse(&source_text).ok_or_else(|| {
            bad(format!(
                "source {source_text:?} is not state_dict, computed or literal"
            ))
        })?;
        let dtype = text("dtype")?;
        let shape = match &map["shape"] {
            Value::Array(dims) => dims
                .iter()
                .map(|d| match d {
                    Value::Int(n) if *n >= 0 => Ok(*n as u64),
                    _ => Err(bad(format!("shape of {fqn:?} must be integers >= 0"))),
                })
                .collect::<Result<Vec<u64>>>()?,
            _ => return Err(bad(format!("shape of {fqn:?} must be an array"))),
        };
        Ok(ConstantRow {
            fqn,
            source,
            dtype,
            shape,
        })
    }
}

/// Validated metadata: its canonical bytes and the facts the rest of the
/// artifact layer checks against.
#[derive(Debug, Clone)]
pub struct Metadata {
    value: Map,
    bytes: Vec<u8>,
    key: String,
    declaration: GraphClassDeclaration,
    constants: Vec<ConstantRow>,
    host_isa: HostIsa,
    toolchain: BTreeMap<String, String>,
}

impl Metadata {
    /// The metadata object.
    pub fn value(&self) -> &Map {
        &self.value
    }
    /// The canonical bytes (`metadata.json`).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// `compiled_graph_key`.
    pub fn key(&self) -> &str {
        &self.key
    }
    /// `sm`.
    pub fn sm(&self) -> &str {
        self.value["sm"].as_str().expect("validated")
    }
    /// The validated toolchain block.
    pub fn toolchain(&self) -> &BTreeMap<String, String> {
        &self.toolchain
    }
    /// The rebuilt declaration of `graph_class`.
    pub fn declaration(&self) -> &GraphClassDeclaration {
        &self.declaration
    }
    /// `graph_class.name`: the package entry.
    pub fn name(&self) -> &str {
        self.declaration.name()
    }
    /// `graph_class.literal_values`.
    pub fn literal_values(&self) -> &str {
        self.declaration.literal_values()
    }
    /// The constant rows in package order.
    pub fn constants(&self) -> &[ConstantRow] {
        &self.constants
    }
    /// The rows whose source is `literal`.
    pub fn literal_rows(&self) -> Vec<&ConstantRow> {
        self.constants
            .iter()
            .filter(|r| r.source == ConstantSource::Literal)
            .collect()
    }
    /// Whether the artifact must carry `constants.safetensors`.
    pub fn has_literal_rows(&self) -> bool {
        self.constants
            .iter()
            .any(|r| r.source == ConstantSource::Literal)
    }
    /// The validated `host_isa` facts.
    pub fn host_isa(&self) -> &HostIsa {
        &self.host_isa
    }

    /// §7.5 step 15, second half: whether a literal payload is present must
    /// agree with the literal rows (`artifact.literals_mismatch`).
    pub fn check_has_literals(&self, has_literals: bool) -> Result<()> {
        match (self.has_literal_rows(), has_literals) {
            (true, false) => Err(Error::new(
                Code::ArtifactLiteralsMismatch,
                "metadata declares literal constants but carries no literal payload",
            )),
            (false, true) => Err(Error::new(
                Code::ArtifactLiteralsMismatch,
                "metadata carries a literal payload but declares no literals",
            )),
            _ => Ok(()),
        }
    }
}

fn schema(m: impl Into<String>) -> Error {
    Error::new(Code::ArtifactMetadataSchema, m)
}

/// The integer `compiled_graph_format` of metadata bytes, when they parse
/// strictly to an object that has one (for the unreadable-format rule of
/// §10.9).
pub fn format_of(bytes: &[u8]) -> Option<i64> {
    match tcg_cj::parse_strict(bytes).ok()? {
        Value::Object(m) => m.get("compiled_graph_format")?.as_i64(),
        _ => None,
    }
}

fn exact_members(map: &Map, fields: &[&str], what: &str) -> Result<()> {
    if map.keys().map(String::as_str).eq(fields.iter().copied()) {
        return Ok(());
    }
    let missing: Vec<&str> = fields
        .iter()
        .copied()
        .filter(|f| !map.contains_key(*f))
        .collect();
    let extra: Vec<&str> = map
        .keys()
        .map(String::as_str)
        .filter(|k| !fields.contains(k))
        .collect();
    Err(schema(format!(
        "{what} must have exactly {} members (missing {missing:?}, extra {extra:?})",
        fields.len()
    )))
}

/// Validate `metadata.json` bytes (§7.5). `has_literals`, when known, is
/// whether the artifact carries a literal payload.
pub fn validate_metadata(bytes: &[u8], has_literals: Option<bool>) -> Result<Metadata> {
    // 1. strict parse
    let value = tcg_cj::parse_strict(bytes).map_err(|e| {
        Error::new(
            Code::ArtifactMetadataJson,
            format!("metadata.json is not strict JSON: {e}"),
        )
    })?;
    // 2. unreadable format precedes every other schema check
    if let Value::Object(m) = &value {
        if let Some(Value::Int(n)) = m.get("compiled_graph_format") {
            if *n != COMPILED_GRAPH_FORMAT {
                return Err(Error::new(
                    Code::ArtifactFormatUnsupported,
                    format!("compiled_graph_format {n} is not readable by this implementation (format {COMPILED_GRAPH_FORMAT})"),
                ));
            }
        }
    }
    // 3. canonical bytes
    let canonical = tcg_cj::to_canonical(&value).map_err(|e| {
        Error::new(
            Code::ArtifactMetadataJson,
            format!("metadata.json cannot be encoded: {e}"),
        )
    })?;
    if canonical != bytes {
        return Err(Error::new(
            Code::ArtifactMetadataJson,
            "metadata.json is not canonical JSON (its bytes differ from CJ of its value)",
        ));
    }
    // 4. closed top level
    let Value::Object(top) = value else {
        return Err(schema(format!(
            "metadata root must be an object, got {}",
            value.type_name()
        )));
    };
    exact_members(&top, &METADATA_FIELDS, "metadata")?;
    // 5. format, kind, policy
    if top["compiled_graph_format"] != Value::Int(COMPILED_GRAPH_FORMAT) {
        return Err(Error::new(
            Code::ArtifactMetadataFormat,
            format!(
                "compiled_graph_format must be the integer {COMPILED_GRAPH_FORMAT}, got {}",
                top["compiled_graph_format"].type_name()
            ),
        ));
    }
    if top["kind"].as_str() != Some(ARTIFACT_KIND) {
        return Err(Error::new(
            Code::ArtifactMetadataKind,
            format!("kind must be {ARTIFACT_KIND:?}"),
        ));
    }
    if top["package_constants_in_so"] != Value::Bool(COMPILE_POLICY.package_constants_in_so)
        || top["constant_folding_fenced"] != Value::Bool(COMPILE_POLICY.constant_folding_fenced)
    {
        return Err(Error::new(
            Code::ArtifactMetadataPolicy,
            "package_constants_in_so must be false and constant_folding_fenced true",
        ));
    }
    // 6. sm
    let sm = match &top["sm"] {
        Value::Str(s) if is_canonical_string(s) => s.clone(),
        _ => return Err(schema("sm must be a non-empty trimmed string")),
    };
    // 7. toolchain
    let toolchain = validate_toolchain_block(&top["toolchain"], Code::ArtifactMetadataSchema)?;
    // 8. host_isa
    let host_isa = HostIsa::from_value(&top["host_isa"], Code::ArtifactHostIsaInvalid)?;
    // 9. graph_class shape
    let gc = top["graph_class"]
        .as_object()
        .ok_or_else(|| schema("graph_class must be an object"))?;
    exact_members(gc, &GRAPH_CLASS_FIELDS, "graph_class")?;
    for k in [
        "name",
        "target",
        "class_hash",
        "graph_witness",
        "range_digest",
    ] {
        if !matches!(&gc[k], Value::Str(s) if !s.is_empty()) {
            return Err(schema(format!(
                "graph_class.{k} must be a non-empty string"
            )));
        }
    }
    if !matches!(&gc["graph"], Value::Object(g) if !g.is_empty()) {
        return Err(schema("graph_class.graph must be a non-empty object"));
    }
    // 10. member types
    check_types(gc)?;
    // 11. rebuild the declaration
    let declaration = GraphClassDeclaration::from_graph_class_value(gc).map_err(|e| {
        e.rewrap(
            Code::ArtifactDeclarationInvalid,
            "graph_class declaration is invalid",
        )
    })?;
    // 12. canonical forms and class hash
    let canon = declaration.to_graph_class_value(Vec::new());
    for k in ["name", "target", "placement", "fork", "class_dims"] {
        if canon.get(k) != gc.get(k) {
            return Err(Error::new(
                Code::ArtifactDeclarationInvalid,
                format!("graph_class declaration is invalid: {k} is not in its canonical form"),
            ));
        }
    }
    if gc["class_hash"].as_str() != Some(declaration.class_hash()) {
        return Err(Error::new(
            Code::ArtifactClassHashMismatch,
            format!(
                "class_hash does not restate its declaration facts (recorded {}, recomputed {})",
                gc["class_hash"].as_str().unwrap_or(""),
                declaration.class_hash()
            ),
        ));
    }
    // 13. key
    let key_mismatch = |why: String| {
        Error::new(
            Code::ArtifactKeyMismatch,
            format!("compiled_graph_key does not restate artifact facts: {why}"),
        )
    };
    let derived = derive_key(declaration.class_hash(), &sm, &toolchain_axis(&toolchain))
        .map_err(|e| key_mismatch(e.message().to_owned()))?;
    let key = match &top["compiled_graph_key"] {
        Value::Str(k) if is_compiled_graph_key(k) => k.clone(),
        _ => {
            return Err(key_mismatch(
                "compiled_graph_key is not a compiled-graph key".into(),
            ))
        }
    };
    if key != derived {
        return Err(key_mismatch(format!("recorded {key}, derived {derived}")));
    }
    // 14. constant rows
    let rows = gc["constants"].as_array().ok_or_else(|| {
        Error::new(
            Code::ArtifactConstantsInvalid,
            "graph_class.constants must be an array",
        )
    })?;
    let constants = rows
        .iter()
        .map(ConstantRow::from_value)
        .collect::<Result<Vec<_>>>()?;
    let mut fqns = BTreeSet::new();
    for r in &constants {
        if !fqns.insert(r.fqn.as_str()) {
            return Err(Error::new(
                Code::ArtifactConstantsInvalid,
                format!("constant fqn {:?} appears twice", r.fqn),
            ));
        }
    }
    // 15. literal rows iff literal_values
    let has_rows = constants
        .iter()
        .any(|r| r.source == ConstantSource::Literal);
    if has_rows == declaration.literal_values().is_empty() {
        return Err(Error::new(
            Code::ArtifactConstantsInvalid,
            "literal constant rows must exist exactly when graph_class.literal_values is set",
        ));
    }
    let metadata = Metadata {
        value: top,
        bytes: canonical,
        key,
        declaration,
        constants,
        host_isa,
        toolchain,
    };
    if let Some(has) = has_literals {
        metadata.check_has_literals(has)?;
    }
    Ok(metadata)
}

fn check_types(gc: &Map) -> Result<()> {
    if gc["literal_values"].as_str().is_none() {
        return Err(schema("graph_class.literal_values must be a string"));
    }
    let placement_ok = matches!(&gc["placement"], Value::Array(a)
        if a.iter().all(|p| matches!(p, Value::Str(s) if is_canonical_string(s))));
    if !placement_ok {
        return Err(schema(
            "graph_class.placement must be an array of non-empty trimmed strings",
        ));
    }
    let fork_ok = matches!(&gc["fork"], Value::Array(a)
        if a.iter().all(|p| matches!(p, Value::Array(pair) if pair.len() == 2 && pair[0].as_str().is_some())));
    if !fork_ok {
        return Err(schema(
            "graph_class.fork must be an array of [string, value] pairs",
        ));
    }
    let dims_ok = matches!(&gc["class_dims"], Value::Array(a)
        if a.iter().all(|p| matches!(p, Value::Array(pair)
            if pair.len() == 2 && pair[0].as_str().is_some() && pair[1].as_i64().is_some())));
    if !dims_ok {
        return Err(schema(
            "graph_class.class_dims must be an array of [string, integer] pairs",
        ));
    }
    if gc["strict"].as_bool().is_none() {
        return Err(schema("graph_class.strict must be a boolean"));
    }
    if gc["lora_bucket"].as_i64().is_none() {
        return Err(schema("graph_class.lora_bucket must be an integer"));
    }
    Ok(())
}

/// Assemble, stamp and validate metadata (§7.5): the 8 non-key members from
/// the declaration, its constant rows (in package order), the `sm` value, the
/// toolchain block and the host facts, with the policy members from
/// [`COMPILE_POLICY`]; then `compiled_graph_key` from §3.3.
pub fn build_metadata(
    declaration: &GraphClassDeclaration,
    constants: &[ConstantRow],
    sm: &str,
    toolchain: &Value,
    host_isa: &HostIsa,
) -> Result<Metadata> {
    let block = validate_toolchain_block(toolchain, Code::DeclarationToolchainInvalid)?;
    let key = derive_key(declaration.class_hash(), sm, &toolchain_axis(&block))?;
    let mut top = Map::new();
    top.insert(
        "compiled_graph_format".into(),
        Value::Int(COMPILED_GRAPH_FORMAT),
    );
    top.insert("compiled_graph_key".into(), Value::Str(key));
    top.insert(
        "constant_folding_fenced".into(),
        Value::Bool(COMPILE_POLICY.constant_folding_fenced),
    );
    let rows = constants.iter().map(ConstantRow::to_value).collect();
    top.insert(
        "graph_class".into(),
        Value::Object(declaration.to_graph_class_value(rows)),
    );
    top.insert("host_isa".into(), host_isa.to_value());
    top.insert("kind".into(), Value::Str(ARTIFACT_KIND.into()));
    top.insert(
        "package_constants_in_so".into(),
        Value::Bool(COMPILE_POLICY.package_constants_in_so),
    );
    top.insert("sm".into(), Value::Str(sm.into()));
    top.insert("toolchain".into(), toolchain.clone());
    let bytes = tcg_cj::to_canonical(&Value::Object(top))
        .map_err(|e| Error::from_cj(crate::Kind::Artifact, &e))?;
    validate_metadata(&bytes, None)
}
